"""The replica routes: other nodes push copies of their saves' chunks into this
node's RAM. Peer routes: the token rule of :mod:`chunkd.gateway.api` applies to every
one of them (a request without the token is refused before it gets here).

::

    PUT  /v1/peer/replicas/{backend}/{id}?save=S&saver=ADDR   one chunk (the body)
    POST /v1/peer/replicas/saves?save=S&saver=ADDR&state=replicated|remote

The protocol is written down in :mod:`chunkd.gateway.peers.replicas`. A push is
checked before its body is read (member, own saver, length, per-sender bound,
budget): with ``Expect: 100-continue`` (the saver's pushes) before ``100 Continue``,
the peer token included, so a refused push never sends its body; without it, after
the routes' guard, and a refused push's connection is not kept (what it sends is
read and dropped for at most the port's linger, 1 s). Served as any held chunk:
``GET /v1/peer/chunks/...?held=1``.

The routes are added by :func:`add_replica_routes`, called from
:func:`chunkd.gateway.api.build_app`; the daemon puts its
:class:`~chunkd.gateway.peers.replicas.ReplicaStore` under :data:`REPLICAS`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Final

from aiohttp import web

from chunkd.cache import ChunkId
from chunkd.errors import InvalidChunkIdError
from chunkd.gateway.appkeys import PEERS
from chunkd.gateway.peers.replicas import ReplicaRefused, ReplicaStore

__all__ = ["REPLICAS", "add_replica_routes"]

#: the node's replica store; absent (or None): this node takes no replicas
REPLICAS: Final[web.AppKey[ReplicaStore | None]] = web.AppKey("replicas")


#: a push admitted before its body: (chunk id, save, saver, release of its slot)
_Slot = tuple[ChunkId, str, str, Callable[[], None]]
#: where the Expect handler leaves a push's slot for the route
_SLOT: Final = "chunkd.replica_slot"

#: a save id, as :data:`chunkd.gateway.checkpoints.model.SAVE_ID_RE` spells it
_SAVE_ID_RE: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")


def add_replica_routes(app: web.Application) -> None:
    """Add the replica routes to ``app``."""
    app.router.add_post("/v1/peer/replicas/saves", _note)
    app.router.add_put("/v1/peer/replicas/{backend}/{id}", _push, expect_handler=_expect)


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


def _admit(request: web.Request, store: ReplicaStore) -> _Slot:
    """A push's checks before its body (see :meth:`ReplicaStore.admit`)."""
    try:
        cid = ChunkId.parse(request.match_info["id"])
    except InvalidChunkIdError as exc:
        raise ReplicaRefused(400, "invalid", str(exc)) from None
    save, saver = _save_of(request)
    chunked = request.headers.get("Transfer-Encoding", "").lower() not in ("", "identity")
    length = None if chunked else request.content_length
    release = store.admit(request.headers.get("X-Chunkd-Peer"), saver, length)
    return cid, save, saver, release


async def _expect(request: web.Request) -> web.StreamResponse | None:
    """``Expect: 100-continue`` (the saver sends it): every check, the peer token's
    included (this runs before the routes' guard), before ``100 Continue``; a push
    refused here never sends its body."""
    if request.headers.get("Expect", "").lower() != "100-continue":
        return _refusal(417, "ExpectationFailed", "only 'Expect: 100-continue' is known")
    store = _store(request)
    peers = request.app.get(PEERS)
    if store is None or peers is None:
        return _refusal(404, "NotFound", "this node takes no replicas", close=True)
    transport = request.transport
    certified = transport is not None and bool(transport.get_extra_info("peercert"))
    if (peers.tls is not None and not certified) or not peers.authorized(
        request.headers.get("Authorization")
    ):
        return _refusal(401, "Unauthorized", "peer routes want the peer token", close=True)
    try:
        request[_SLOT] = _admit(request, store)
    except ReplicaRefused as exc:
        store.metrics.replica_received.labels(exc.outcome).inc()
        return _refusal(exc.status, _kind(exc), str(exc), close=True)
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0
    return None


async def _push(request: web.Request) -> web.StreamResponse:
    store = _store(request)
    if store is None:
        return _refusal(404, "NotFound", "this node takes no replicas", close=True)
    slot: _Slot | None = request.get(_SLOT)
    if slot is None:  # no Expect: checked here, after the token
        try:
            slot = _admit(request, store)
        except ReplicaRefused as exc:
            store.metrics.replica_received.labels(exc.outcome).inc()
            return _refusal(exc.status, _kind(exc), str(exc), close=True)
    cid, save, saver, release = slot
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
    if saver != request.headers.get("X-Chunkd-Peer") or not store.is_member(saver):
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
