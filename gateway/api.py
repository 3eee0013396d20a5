"""The HTTP API (aiohttp): objects, chunks, metrics, stats, health.

Routes::

    GET|HEAD /v1/objects/{backend}/{key}   an object, honouring one Range
    GET      /v1/chunks/{id}               a cached chunk by id
    GET      /metrics                      Prometheus text
    POST     /v1/warm/{backend}/{key}      load an object into the cache; NDJSON progress
    GET      /v1/list/{backend}/{prefix}   one page of a listing: JSON, with a page token
    GET      /v1/stats                     JSON: config (no secrets), tiers, backends
    GET      /healthz                      the process answers
    GET      /readyz                       the index is open and the sites are bound

The pages (``/``, ``/inspect/``, ``/login``), the dashboard's data and the assets are
:mod:`chunkd.gateway.dashboard`'s routes; ``/v1/inspect/...`` are
:mod:`chunkd.gateway.inspector`'s.

Exposure: the daemon holds backend credentials and must never become a public read
proxy. A client that is not on loopback gets only ``/healthz``, ``/readyz``,
``/metrics``, ``/login`` and ``/static/...`` without more ado; every data route (the
pages and the dashboard's data included: they show object names, errors, samples)
wants ``Authorization: Bearer <server.token>`` from it (403 when no token is
configured, 401 when it sends a wrong one), or, on GET and HEAD, the session cookie
``/login`` gives a browser for that token (:mod:`chunkd.gateway.dashboard.session`).
A request a browser sends from another site's page is refused from every client,
loopback included. Peer routes (``/v1/peer/...``) want the peer token
from every client, and with ``[peers]`` TLS also a client certificate that chains to
``tls_ca`` (401 otherwise); see :mod:`chunkd.gateway.tls`.

Errors are mapped to HTTP status here and nowhere else, with a JSON body that says
what went wrong and what to do: ``{"error": KIND, "message": TEXT, "status": N}``.

Connections: before any route runs, every connection is held to the bounds of
:mod:`chunkd.gateway.connections` (caps per address and in all, a budget of their own
for the peers' addresses, header, idle and body timeouts, the size of a request head);
a head too large is answered there, ``431`` with the same error body.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any, Final
from urllib.parse import quote

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import chunkd
from chunkd import faults
from chunkd.cache import BytesLease, ChunkId, ChunkLease
from chunkd.errors import (
    BackendUnavailableError,
    ChunkdError,
    InvalidRequestError,
)
from chunkd.gateway.appkeys import (
    BACKENDS,
    CACHE,
    CHECKPOINTS,
    CONFIG,
    LISTINGS,
    METRICS,
    PAGES,
    PEER_TLS,
    PEERS,
    PREFETCHER,
    READ_PATH,
    STATE,
    STREAMING,
    DaemonState,
)
from chunkd.gateway.config import Config
from chunkd.gateway.config.addresses import is_loopback
from chunkd.gateway.costs import charge
from chunkd.gateway.costs.attribution import ATTRIBUTION
from chunkd.gateway.costs.headers import attribution_of
from chunkd.gateway.costs.routes import LEDGER
from chunkd.gateway.costs.routes import add_routes as add_cost_routes
from chunkd.gateway.dashboard import add_routes as add_dashboard_routes
from chunkd.gateway.dashboard.session import browser_refusal, valid_session
from chunkd.gateway.inspector import add_routes as add_inspector_routes
from chunkd.gateway.jobs.routes import add_routes as add_job_routes
from chunkd.gateway.listing import MAX_PAGE
from chunkd.gateway.metrics import Metrics
from chunkd.gateway.names import validate_prefix
from chunkd.gateway.objectbody import reading_of, send_object
from chunkd.gateway.peers.client import HOLDERS_HEADER, MAX_HOLDERS_NAMED
from chunkd.gateway.peers.replica_routes import add_replica_routes
from chunkd.gateway.status import http_status
from chunkd.gateway.tls import PeerTLS
from chunkd.ranges import RangeNotSatisfiableError

__all__ = ["build_app"]

log = logging.getLogger("chunkd.gateway.api")


def build_app(config: Config, *, metrics: Metrics, tls: PeerTLS | None) -> web.Application:
    """The routes and middlewares over the parts the daemon puts in the app's keys.

    The composition root (:mod:`chunkd.gateway.daemon`) builds those parts in a
    ``cleanup_ctx`` and sets :data:`CACHE`, :data:`READ_PATH` and the others; the
    site that serves the app takes ``app[PEER_TLS].server`` as its SSL context.
    """
    # _count outermost, so that error responses are counted too.
    app = web.Application(middlewares=[_count, _errors, _guard, _attribute])
    app[CONFIG] = config
    app[PEER_TLS] = tls
    app[METRICS] = metrics
    app[STATE] = DaemonState()
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/stats", _stats)
    app.router.add_get("/v1/chunks/{id}", _chunk)
    # [\s\S], not ".": a newline in a key must reach the handler and be refused there.
    app.router.add_get(r"/v1/objects/{backend}/{key:[\s\S]*}", _object)
    app.router.add_post(r"/v1/warm/{backend}/{key:[\s\S]*}", _warm)
    app.router.add_get("/v1/list/{backend}", _list)
    app.router.add_get(r"/v1/list/{backend}/{prefix:[\s\S]*}", _list)
    app.router.add_get("/v1/peer/chunks/{backend}/{id}", _peer_chunk)
    app.router.add_get(r"/v1/peer/objects/{backend}/{key:[\s\S]*}", _peer_object_chunk)
    app.router.add_get("/v1/peer/pages/{id}", _peer_page)
    add_replica_routes(app)
    add_dashboard_routes(app)
    add_inspector_routes(app)
    add_job_routes(app)
    add_cost_routes(app)
    return app


# -- middlewares -----------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = _error_response(exc.status, type(exc).__name__, exc.reason)
        for name in ("Allow",):
            if name in exc.headers:
                response.headers[name] = exc.headers[name]
        return response
    except ChunkdError as exc:
        if request.get(STREAMING):
            # The headers are out: a new response cannot be sent. Let aiohttp cut the
            # connection so that the client sees a short body, not a spliced error.
            log.warning("%s %s failed mid-body: %s", request.method, request.path, exc)
            raise
        status = http_status(exc)
        if status >= 500:
            log.warning("%s %s failed: %s", request.method, request.path, exc)
        response = _error_response(status, type(exc).__name__, str(exc))
        if isinstance(exc, RangeNotSatisfiableError):
            response.headers["Content-Range"] = f"bytes */{exc.size}"
        if isinstance(exc, BackendUnavailableError):
            response.headers["Retry-After"] = "5"
        return response


@web.middleware
async def _count(request: web.Request, handler: Handler) -> web.StreamResponse:
    response = await handler(request)
    route = request.match_info.route.resource
    name = route.canonical if route is not None else "unmatched"
    request.app[METRICS].http_requests.labels(name, str(response.status)).inc()
    return response


#: open to every client: health, metrics, the login form and the assets (no data)
_OPEN_PATHS: Final = frozenset({"/healthz", "/readyz", "/metrics", "/login", "/logout"})
_OPEN_PREFIX: Final = "/static/"
#: pages a browser loads: without a session they go to the login form
_PAGES: Final = re.compile(r"/(inspect(/.*)?)?")


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path.startswith("/v1/peer/"):  # the peer token, from anywhere
        peers = request.app.get(PEERS)
        if peers is None:
            return _error_response(404, "NotFound", "this node has no [peers] section")
        if peers.tls is not None and not _has_client_certificate(request):
            return _error_response(
                401,
                "Unauthorized",
                "peer routes want a client certificate that chains to [peers] tls_ca, "
                "and the peer token",
            )
        if not peers.authorized(request.headers.get("Authorization")):
            return _error_response(
                401, "Unauthorized", "peer routes want 'Authorization: Bearer <peer token>'"
            )
        return await handler(request)
    loopback = is_loopback(request.remote)
    listen = request.app[CONFIG].server.listen
    if (refusal := browser_refusal(request, loopback=loopback, listen=listen)) is not None:
        return _error_response(403, "Forbidden", refusal)
    if request.path in _OPEN_PATHS or request.path.startswith(_OPEN_PREFIX) or loopback:
        return await handler(request)
    token = request.app[CONFIG].server.token
    if token is None:
        return _error_response(
            403,
            "Forbidden",
            f"{request.path} answers clients on this host only; set server.token (or "
            "CHUNKD_SERVER_TOKEN) to serve other hosts that present it, or reach this "
            "one through an ssh tunnel (ssh -L 8470:127.0.0.1:8470 NODE)",
        )
    sent = request.headers.get("Authorization", "")
    wanted = f"Bearer {token.reveal()}".encode()
    if hmac.compare_digest(sent.encode("utf-8", "surrogateescape"), wanted):
        return await handler(request)
    if not sent and valid_session(request, token.reveal()):
        return await handler(request)
    if not sent and request.method == "GET" and _PAGES.fullmatch(request.path):
        raise web.HTTPSeeOther(f"/login?next={quote(request.path_qs, safe='/')}")
    return _error_response(
        401,
        "Unauthorized",
        "send 'Authorization: Bearer <server.token>' to use data routes (a browser: sign "
        "in at /login)",
    )


@web.middleware
async def _attribute(request: web.Request, handler: Handler) -> web.StreamResponse:
    # The job (X-Chunkd-Job; a peer's request also its X-Chunkd-Name) the request's
    # work is charged to in the cost ledger; a bad header is a 400 (InvalidRequestError).
    attribution = attribution_of(
        request.headers, request.app.get(LEDGER), peer=request.path.startswith("/v1/peer/")
    )
    token = ATTRIBUTION.set(attribution)
    try:
        return await handler(request)
    finally:
        ATTRIBUTION.reset(token)


def _has_client_certificate(request: web.Request) -> bool:
    """Whether the client sent a certificate in the TLS handshake.

    The server asks with CERT_OPTIONAL: a certificate that is sent is verified
    against tls_ca during the handshake, and one that fails ends the connection, so
    a certificate seen here is one that chains to tls_ca.
    """
    transport = request.transport
    return transport is not None and bool(transport.get_extra_info("peercert"))


def _error_response(status: int, kind: str, message: str) -> web.Response:
    body = {"error": kind, "message": message, "status": status}
    return web.json_response(body, status=status)


# -- handlers --------------------------------------------------------------------------


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def _readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.ready and not state.stopping:
        return web.json_response({"ready": True})
    why = "stopping" if state.stopping else "starting: the index or the sites are not up yet"
    return web.json_response({"ready": False, "why": why}, status=503)


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _stats(request: web.Request) -> web.Response:
    app = request.app
    cache_stats = app[CACHE].stats()
    body: dict[str, Any] = {
        "version": chunkd.__version__,
        "uptime_s": round(time.time() - app[STATE].started, 3),
        "ready": app[STATE].ready,
        "config": app[CONFIG].redacted(),
        "cache": asdict(cache_stats),
        "backends": [
            {"name": b.name, "scheme": b.config.scheme, "circuit_open": b.circuit_open}
            for b in app[BACKENDS]
        ],
        "checkpoints": app[CHECKPOINTS].stats(),
        "peers": peers.stats() if (peers := app[PEERS]) is not None else None,
        # Fault injection (tests only): what is armed and how often each was reached.
        "faults": {"armed": faults.armed(), "hits": faults.hits()} if faults.armed() else None,
    }
    return web.json_response(body, dumps=lambda obj: json.dumps(obj, default=str))


async def _chunk(request: web.Request) -> web.StreamResponse:
    cid = ChunkId.parse(request.match_info["id"])
    lease = await request.app[CACHE].get(cid)
    with lease:
        body = lease.view()  # no copy: the view maps the chunk on its own
    return await _send_chunk(request, body, {"ETag": f'"{cid}"'})


async def _send_chunk(
    request: web.Request, view: memoryview, headers: dict[str, str]
) -> web.StreamResponse:
    """A chunk's bytes as the answer, written from its own view: no copy. (A
    ``web.Response`` would wrap a memoryview in aiohttp's ``BytesPayload``, which
    warns of a large body above 1 MiB: an exception where warnings are errors.)

    A reader that goes away mid-body (a peer that gave up on this node, or was cut
    off) is its own affair: one line at info, no traceback, nothing counted as an
    error of this node."""
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream", **headers})
    response.content_length = view.nbytes
    try:
        await response.prepare(request)
        await response.write(view)
        await response.write_eof()
    except ConnectionError as exc:  # aiohttp's ClientConnectionResetError is one too
        log.info(
            "%s %s: the reader went away during the %d-byte body (%s)",
            request.method,
            request.path,
            view.nbytes,
            exc,
        )
    return response


async def _peer_chunk(request: web.Request) -> web.StreamResponse:
    """A checkpoint chunk for a peer.

    As its owner (no ``held``): served from this node's cache or fetched here from the
    backend (single flight), never passed on to another peer; or, once the owner has
    sent it ``holder_fanout`` times, ``300`` naming members that hold it
    (``X-Chunkd-Holders``, :mod:`chunkd.gateway.peers.holders`), only to an asker
    that said it follows one (``holders=1``; an older daemon does not, and is always
    served and never made a holder). ``direct=1`` (the asker's holders failed) is
    always served; its ``bad=`` holders (at most 3) are dropped. ``held=1``: only what
    this node holds (``wait=1``, a holder request: or its own fetch in flight, while it
    makes progress), else 404 NotHeld; counted in the role the asker names (``role=``).
    ``forget=1&bad=...``: drop those holders, 204 (the asker got the chunk from a later
    holder).
    """
    cid = ChunkId.parse(request.match_info["id"])
    backend = request.match_info["backend"]
    peers = request.app[PEERS]
    assert peers is not None  # _guard answers peer routes only with [peers]
    query = request.query
    if _held_only(request):
        held: ChunkLease | None = await request.app[CACHE].find(cid)
        if held is None and query.get("wait") == "1":
            # A holder request: this node was named a holder as it asked for the chunk;
            # its own fetch may still be on its way. Never fetched for the asker.
            fetched = await peers.fetching(cid, wait=peers.config.timeout)
            if fetched is not None:
                held = await request.app[CACHE].find(cid) or BytesLease(cid, fetched)
        if held is None:
            return _not_held(cid)
        lease, role = held, _asked_role(request) or peers.role_of_held(cid)
    elif query.get("forget") == "1":
        # The asker got the chunk from a later holder: the earlier ones failed it.
        peers.forget_holders(cid, _bad_holders(request))
        return web.Response(status=204)
    else:
        named = peers.owner_answer(
            cid,
            request.headers.get("X-Chunkd-Peer"),
            direct=query.get("direct") == "1",
            bad=_bad_holders(request),
            follows=query.get("holders") == "1",
        )
        if named:
            return web.Response(status=300, headers={HOLDERS_HEADER: ", ".join(named)})
        lease = await request.app[CHECKPOINTS].chunk(backend, cid, local=True)
        role = "owner"
    with lease:
        body = lease.view()  # no copy: the view maps the chunk on its own
    _served_to_peer(request, len(body), role)
    return await _send_chunk(request, body, {})


async def _peer_page(request: web.Request) -> web.StreamResponse:
    """A dataset registry page for a peer: from this node's tiers, or fetched here from
    the registry (single flight), never passed on to another peer. The receiver checks
    the bytes against the id."""
    page = request.match_info["id"]
    if _held_only(request):
        held = await request.app[CACHE].find(ChunkId.parse(page))
        if held is None:
            return _not_held(page)
        lease = held
    else:
        lease = await request.app[PAGES].lease(page, local=True)
    with lease:
        body = lease.view()  # no copy: the view maps the page on its own
    role = (_asked_role(request) or "holder") if _held_only(request) else "owner"
    _served_to_peer(request, len(body), role)
    return await _send_chunk(request, body, {})


async def _peer_object_chunk(request: web.Request) -> web.StreamResponse:
    """Chunk ``index`` of an object version, for the peer that asks: this node owns
    its locator. Fetched here from the backend (single flight), never passed on; the
    id goes in ``X-Chunkd-Chunk`` and the receiver checks the bytes against it.

    No holders here: this node always serves. A dataset's readers read the same
    shard at about the same time, and a holder named then would not have the chunk
    yet (its read is not one that holder requests wait on): the asker would pay
    holder round trips that fail, and drop good holders, to save this node nothing.
    """
    read_path = request.app[READ_PATH]
    version = request.query.get("version", "")
    try:
        index = int(request.query.get("index", ""))
    except ValueError:
        return _error_response(400, "InvalidRange", "index must be a whole number")
    stat = await read_path.stat(request.match_info["backend"], request.match_info["key"])
    if stat.meta.version != version or not 0 <= index < max(1, stat.chunks):
        return _error_response(
            409, "VersionChanged", f"this node has version {stat.meta.version!r} of the object"
        )
    role = "owner"
    if _held_only(request):
        held = await read_path.held_chunk(stat, index)
        if held is None:
            return _not_held(f"chunk {index} of {stat.meta.key}")
        lease, role = held, _asked_role(request) or "holder"
    else:
        lease = await read_path.chunk(stat, index, local=True)
    with lease:
        body = lease.view()  # no copy: the view maps the chunk on its own
    _served_to_peer(request, len(body), role)
    return await _send_chunk(request, body, {"X-Chunkd-Chunk": str(lease.id)})


def _bad_holders(request: web.Request) -> list[str]:
    """The ``bad=`` holders of a peer's request (at most 3; 400 past that)."""
    bad = request.query.getall("bad", [])
    if len(bad) > MAX_HOLDERS_NAMED:
        raise InvalidRequestError(
            f"a chunk request names at most {MAX_HOLDERS_NAMED} bad holders; got {len(bad)}"
        )
    return bad


def _asked_role(request: web.Request) -> str | None:
    """The role a ``held=1`` asker names (``role=holder`` or ``replica``), so that both
    ends count the bytes under it; None: it names none (or another), the server's
    own view counts."""
    role = request.query.get("role")
    return role if role in ("holder", "replica") else None


def _held_only(request: web.Request) -> bool:
    """``held=1``: a rejoined node's handoff, answered from this node's tiers only."""
    return request.query.get("held") == "1"


def _not_held(what: object) -> web.Response:
    return _error_response(404, "NotHeld", f"this node does not hold {what}; fetch it yourself")


def _served_to_peer(request: web.Request, nbytes: int, role: str = "owner") -> None:
    faults.point("peer.send")
    peers = request.app[PEERS]
    if peers is not None:
        peers.served(request.headers.get("X-Chunkd-Peer"), nbytes, role)


async def _object(request: web.Request) -> web.StreamResponse:
    app = request.app
    started = time.perf_counter()
    stat = await app[READ_PATH].stat(
        request.match_info["backend"], request.match_info["key"], reading=reading_of(request)
    )
    response, served = await send_object(request, stat)
    if request.method == "HEAD":
        charge.direct(stat.backend, "head")  # without chunkd: one HEAD
    else:
        app[METRICS].read_seconds.observe(time.perf_counter() - started)
        app[METRICS].read_bytes.labels("chunkd").inc(served)
    return response


async def _warm(request: web.Request) -> web.StreamResponse:
    """Load an object into the cache without sending it; stream progress as NDJSON.

    Lines of ``{"loaded": BYTES, "size": BYTES}`` (the latest progress each time the
    client reads), then a last line with ``"done": true``. Errors before the first
    chunk is in are ordinary JSON errors. The load holds one of the prefetch slots
    (``chunkd warm`` and ``prefetch`` share one bound), and only while it loads: a
    client that stops reading its progress does not keep a slot.
    """
    read_path = request.app[READ_PATH]
    stat = await read_path.stat(request.match_info["backend"], request.match_info["key"])
    loaded = 0
    changed = asyncio.Event()

    async def load() -> None:
        nonlocal loaded
        async with request.app[PREFETCHER].slot():
            # Not a reader's request: no direct GET, no bytes served (nor credited).
            async for piece in read_path.read(stat, 0, stat.size, reader=False):
                loaded += piece.nbytes
                changed.set()

    task = asyncio.ensure_future(load())
    try:
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        while True:
            waits: set[asyncio.Future[Any]] = {task, asyncio.ensure_future(changed.wait())}
            _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for waiting in pending - {task}:
                waiting.cancel()
            if task.done():
                task.result()  # a failure before any byte was sent is a proper status
            if not response.prepared:
                await response.prepare(request)
                request[STREAMING] = True
            if task.done():
                break
            changed.clear()
            await response.write(json.dumps({"loaded": loaded, "size": stat.size}).encode() + b"\n")
    finally:
        if not task.done():
            task.cancel()  # the client went away: so does its load
        await asyncio.gather(task, return_exceptions=True)
    name = f"{stat.backend}/{stat.meta.key}"
    done = {"done": True, "name": name, "loaded": loaded, "size": stat.size, "chunks": stat.chunks}
    await response.write(json.dumps(done).encode() + b"\n")
    await response.write_eof()
    return response


async def _list(request: web.Request) -> web.Response:
    """One page of a listing: ``{"entries": [...], "next": TOKEN|null}``.

    Query: ``recursive`` (``true``/``false``), ``start_after`` (the ``next`` of the
    page before), ``limit`` (1 to 10,000; 1,000 by default). See
    :mod:`chunkd.gateway.listing` for the entries and the token.
    """
    backend = request.match_info["backend"]
    prefix = validate_prefix(request.match_info.get("prefix", ""))
    query = request.query
    recursive = query.get("recursive", "false").lower()
    if recursive not in ("true", "false", "1", "0"):
        raise InvalidRequestError(f"recursive must be true or false; got {recursive!r}")
    limit_text = query.get("limit", "1000")
    if not re.fullmatch(r"[0-9]{1,6}", limit_text) or not 1 <= int(limit_text) <= MAX_PAGE:
        raise InvalidRequestError(f"limit must be a whole number from 1 to {MAX_PAGE}")
    start_after = query.get("start_after") or None
    if start_after is not None and len(start_after.encode("utf-8", "surrogatepass")) > 1200:
        raise InvalidRequestError("start_after is longer than a key can be")
    page = await request.app[LISTINGS].page(
        backend,
        prefix,
        recursive=recursive in ("true", "1"),
        start_after=start_after,
        limit=int(limit_text),
    )
    # Without chunkd: one LIST a page; charged once the backend is known to be one
    # (an unknown name must not become a label value).
    charge.direct(page.backend, "list")
    body = {"backend": page.backend, "prefix": prefix, "entries": page.to_json(), "next": page.next}
    return web.json_response(body, dumps=lambda obj: json.dumps(obj, ensure_ascii=False))
