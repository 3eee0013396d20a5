"""The replica routes: other nodes push copies of their saves' chunks into this
node's RAM. Peer routes: the token rule of :mod:`chunkd.gateway.api` applies to every
one of them (a request without the token is refused before it gets here).

::

    PUT  /v1/peer/replicas/{backend}/{id}?save=S&saver=ADDR&seq=N   one chunk (the body)
    POST /v1/peer/replicas/saves?save=S&saver=ADDR&seq=N&state=replicated|remote

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

import asyncio
import re
from collections.abc import Callable
from typing import Final

import aiohttp
from aiohttp import web

from chunkd.cache import ChunkId
from chunkd.errors import InvalidChunkIdError
from chunkd.gateway.appkeys import PEERS
from chunkd.gateway.peers.replicas import ReplicaRefused, ReplicaStore

__all__ = ["REPLICAS", "add_replica_routes"]

#: the node's replica store; absent (or None): this node takes no replicas
REPLICAS: Final[web.AppKey[ReplicaStore | None]] = web.AppKey("replicas")


#: a push admitted before its body: (chunk id, save, saver, seq, release of its slot)
_Slot = tuple[ChunkId, str, str, int, Callable[[], None]]
#: where the Expect handler leaves a push's slot for the route
_SLOT: Final[web.RequestKey[_Slot]] = web.RequestKey("chunkd.replica_slot")

#: a save id, as :data:`chunkd.gateway.checkpoints.model.SAVE_ID_RE` spells it
_SAVE_ID_RE: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: a save's seq (SaveRequest.seq): a whole number below 2**63
_SEQ_RE: Final = re.compile(r"[0-9]{1,19}")


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


def _save_of(request: web.Request) -> tuple[str, str, int]:
    save = request.query.get("save", "")
    saver = request.query.get("saver", "")
    seq = request.query.get("seq", "")
    if (
        not _SAVE_ID_RE.fullmatch(save)
        or not 0 < len(saver) <= 300
        or not _SEQ_RE.fullmatch(seq)
        or int(seq) >= 1 << 63
    ):
        raise ReplicaRefused(
            400, "invalid", "a replica request names save= (a save id), saver= and seq="
        )
    return save, saver, int(seq)


def _admit(request: web.Request, store: ReplicaStore) -> _Slot:
    """A push's checks before its body (see :meth:`ReplicaStore.admit`)."""
    try:
        cid = ChunkId.parse(request.match_info["id"])
    except InvalidChunkIdError as exc:
        raise ReplicaRefused(400, "invalid", str(exc)) from None
    save, saver, seq = _save_of(request)
    chunked = request.headers.get("Transfer-Encoding", "").lower() not in ("", "identity")
    length = None if chunked else request.content_length
    sender = request.headers.get("X-Chunkd-Peer")
    release = store.admit(sender, saver, length)
    if not _from_member(request, sender):
        release()
        raise ReplicaRefused(401, "refused", "a replica push comes from its member's own address")
    return cid, save, saver, seq, release


def _from_member(request: web.Request, address: str | None) -> bool:
    """Whether the connection comes from ``address``'s member: its IP is one the
    member's address names or resolves to (:meth:`.membership.Peer.connects_from`).
    The token alone would let any holder of it push or note in a member's name."""
    peers = request.app.get(PEERS)
    if peers is None or address is None:
        return False
    member = next((p for p in peers.members if p.address == address), None)
    return member is not None and member.connects_from(request.remote)


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
        slot = request[_SLOT] = _admit(request, store)
    except ReplicaRefused as exc:
        store.metrics.replica_received.labels(exc.outcome).inc()
        return _refusal(exc.status, _kind(exc), str(exc), close=True)
    # The slot is let go when the request's task ends, whatever ends it: the write
    # below or aiohttp's drain after it failing (the sender closed), a middleware's
    # refusal, or the sender closing mid-body; _push lets it go sooner (idempotent).
    task = asyncio.current_task()
    assert task is not None
    task.add_done_callback(lambda _task: slot[4]())
    try:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    except ConnectionError:  # the sender closed after its head: nothing to answer
        return _refusal(400, "InvalidRequest", "the push was closed before its body", close=True)
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
    cid, save, saver, seq, release = slot
    try:
        length = request.content_length or 0
        try:
            body = await request.content.readexactly(length) if length else b""
        except (asyncio.IncompleteReadError, ConnectionError, aiohttp.ClientError):
            store.metrics.replica_received.labels("invalid").inc()
            return _refusal(400, "InvalidRequest", "the push's body ended early", close=True)
        kept = await store.store(saver, save, cid, memoryview(body), seq=seq)
    except ReplicaRefused as exc:
        store.metrics.replica_received.labels(exc.outcome).inc()
        return _refusal(exc.status, _kind(exc), str(exc))
    finally:
        release()
    # Not kept: a save older than one of its saver's already whole here (200: the
    # saver has nothing to do about it).
    store.metrics.replica_received.labels("stored" if kept else "refused").inc()
    return web.json_response({"ok": True, "kept": kept})


async def _note(request: web.Request) -> web.StreamResponse:
    store = _store(request)
    if store is None:
        return _refusal(404, "NotFound", "this node takes no replicas")
    state = request.query.get("state")
    try:
        save, saver, seq = _save_of(request)
    except ReplicaRefused as exc:
        return _refusal(exc.status, _kind(exc), str(exc))
    if state not in ("replicated", "remote"):
        return _refusal(400, "InvalidRequest", "state= is 'replicated' or 'remote'")
    if (
        saver != request.headers.get("X-Chunkd-Peer")
        or not store.is_member(saver)
        or not _from_member(request, saver)
    ):
        return _refusal(
            401, "Unauthorized", "a member notes its own saves only, from its own address"
        )
    store.note(saver, save, replicated=state == "replicated", remote=state == "remote", seq=seq)
    store.sweep()
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
