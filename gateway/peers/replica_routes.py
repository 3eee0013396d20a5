"""The replica routes: other nodes push copies of their saves' chunks into this
node's RAM. Peer routes: the token rule of :mod:`chunkd.gateway.api` applies to every
one of them (a request without the token is refused before it gets here).

::

    PUT  /v1/peer/replicas/{backend}/{id}?save=S&saver=ADDR   one chunk (the body)
    POST /v1/peer/replicas/saves?save=S&saver=ADDR&state=replicated|remote

The protocol is written down in :mod:`chunkd.gateway.peers.replicas`. A push is
checked before its body is read (member, own saver, length, per-sender bound,
budget); a refused one is answered and its connection closed, so that what it
sent is never read. Served as any held chunk: ``GET /v1/peer/chunks/...?held=1``.

The routes are added by :func:`add_replica_routes`, called from
:func:`chunkd.gateway.api.build_app`; the daemon puts its
:class:`~chunkd.gateway.peers.replicas.ReplicaStore` under :data:`REPLICAS`.
"""

from __future__ import annotations

import re
from typing import Final

from aiohttp import web

from chunkd.cache import ChunkId
from chunkd.errors import InvalidChunkIdError
from chunkd.gateway.peers.replicas import ReplicaRefused, ReplicaStore

__all__ = ["REPLICAS", "add_replica_routes"]

#: the node's replica store; absent (or None): this node takes no replicas
REPLICAS: Final[web.AppKey[ReplicaStore | None]] = web.AppKey("replicas")


#: a save id, as :data:`chunkd.gateway.checkpoints.model.SAVE_ID_RE` spells it
_SAVE_ID_RE: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")


def add_replica_routes(app: web.Application) -> None:
    """Add the replica routes to ``app``."""
    app.router.add_post("/v1/peer/replicas/saves", _note)
    app.router.add_put("/v1/peer/replicas/{backend}/{id}", _push)


def _refusal(status: int, kind: str, message: str, *, close: bool = False) -> web.Response:
    response = web.json_response(
        {"error": kind, "message": message, "status": status}, status=status
    )
    if close:
        response.force_close()  # the body it may be sending is never read
    return response


def _store(request: web.Request) -> ReplicaStore | None:
    return request.app.get(REPLICAS)


def _save_of(request: web.Request) -> tuple[str, str]:
    save = request.query.get("save", "")
    saver = request.query.get("saver", "")
    if not _SAVE_ID_RE.fullmatch(save) or not 0 < len(saver) <= 300:
        raise ReplicaRefused(400, "invalid", "a replica request names save= (a save id) and saver=")
    return save, saver


async def _push(request: web.Request) -> web.StreamResponse:
    store = _store(request)
    if store is None:
        return _refusal(404, "NotFound", "this node takes no replicas", close=True)
    try:
        cid = ChunkId.parse(request.match_info["id"])
    except InvalidChunkIdError as exc:
        store.metrics.replica_received.labels("invalid").inc()
        return _refusal(400, "InvalidChunkIdError", str(exc), close=True)
    try:
        save, saver = _save_of(request)
        chunked = request.headers.get("Transfer-Encoding", "").lower() not in ("", "identity")
        length = None if chunked else request.content_length
        release = store.admit(request.headers.get("X-Chunkd-Peer"), saver, length)
    except ReplicaRefused as exc:
        store.metrics.replica_received.labels(exc.outcome).inc()
        return _refusal(exc.status, _kind(exc), str(exc), close=True)
    try:
        length = request.content_length or 0
        body = await request.content.readexactly(length) if length else b""
        await store.store(saver, save, cid, memoryview(body))
    except ReplicaRefused as exc:
        store.metrics.replica_received.labels(exc.outcome).inc()
        return _refusal(exc.status, _kind(exc), str(exc))
    finally:
        release()
    store.metrics.replica_received.labels("stored").inc()
    return web.json_response({"ok": True})


async def _note(request: web.Request) -> web.StreamResponse:
    store = _store(request)
    if store is None:
        return _refusal(404, "NotFound", "this node takes no replicas")
    state = request.query.get("state")
    try:
        save, saver = _save_of(request)
    except ReplicaRefused as exc:
        return _refusal(exc.status, _kind(exc), str(exc))
    if state not in ("replicated", "remote"):
        return _refusal(400, "InvalidRequest", "state= is 'replicated' or 'remote'")
    if saver != request.headers.get("X-Chunkd-Peer"):
        return _refusal(401, "Unauthorized", "a member notes its own saves only")
    store.note(saver, save, replicated=state == "replicated", remote=state == "remote")
    return web.json_response({"ok": True})


def _kind(exc: ReplicaRefused) -> str:
    return {
        400: "InvalidRequest",
        401: "Unauthorized",
        411: "LengthRequired",
        413: "PayloadTooLarge",
        422: "IntegrityError",
        429: "TooManyRequests",
        507: "ReplicaBudgetFull",
    }.get(exc.status, "Refused")
