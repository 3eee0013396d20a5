"""The inspector's routes: ``GET /v1/inspect/{op}`` and ``/v1/inspect/media/...``.

Both are doors and nothing more (``docs/inspector.md``):

- ``GET /v1/inspect/{op}?ARGS`` forwards the query, as strings, to op ``{op}`` of a
  worker of the pool and answers its result as JSON. The worker checks the arguments;
  its error answers arrive here as chunkd errors and leave through the app's error
  middleware (a malformed file 422, a timeout 504, a crashed worker 422). A request
  whose client leaves is given up: every :data:`GONE_POLL_S` the route looks at its
  connection, and once it has closed, the call is cancelled, so the request leaves the
  pool's queue, or its worker is killed and replaced (:meth:`InspectorPool.call`). This
  route alone is cancelled so: it changes nothing, where aiohttp's global
  ``handler_cancellation`` would also stop state-changing handlers halfway.
- ``GET|HEAD /v1/inspect/media/{backend}/{key}?offset=O&length=N`` serves bytes ``O``
  to ``O+N`` of an object through the cache as a resource of its own (``Range`` is
  taken inside the window, so ``<audio>`` and ``<video>`` seek). Its type is sniffed
  from the window's first bytes and must be one of :data:`chunkd.mediatype.MEDIA_TYPES`;
  anything else goes out as an ``application/octet-stream`` attachment. Every answer
  says ``nosniff`` and carries a ``sandbox`` CSP: no sample is ever served as a page.

The daemon never decodes here: the media route reads at most
:data:`chunkd.mediatype.SNIFF_BYTES` to name the type, then streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from typing import Final

from aiohttp import web

from chunkd.errors import InvalidRangeError, InvalidRequestError
from chunkd.gateway.appkeys import METRICS, READ_PATH
from chunkd.gateway.inspector.pool import InspectorPool
from chunkd.gateway.objectbody import send_object
from chunkd.gateway.readpath import ReadPath, Stat
from chunkd.mediatype import MEDIA_TYPES, SNIFF_BYTES, sniff

__all__ = ["GONE_POLL_S", "INSPECTOR", "MEDIA_HEADERS", "OPS", "add_routes"]

log = logging.getLogger("chunkd.gateway.inspector")

INSPECTOR: Final = web.AppKey("inspector", InspectorPool)

#: the worker's ops, as ``docs/inspector.md`` lists them
OPS: Final = ("open", "rows", "sample", "rl", "datasets", "dataset", "snapshot", "diff", "step")

#: what every media answer says, whatever its type
MEDIA_HEADERS: Final = {
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "sandbox; default-src 'none'",
}

# An op's query: a URL is at most ~8 KiB (aiohttp's line limit), these bound the rest.
_MAX_ARGS: Final = 32
_MAX_ARG_CHARS: Final = 64 << 10
# An offset or a length: a whole number an object's size can be (S3's 5 TiB fits).
_WHOLE: Final = re.compile(r"[0-9]{1,16}")
#: how often a waiting inspector request looks whether its client is still there
GONE_POLL_S: Final = 0.25
#: the status logged (and counted) for a request whose client left: nginx's, and no
#: client reads it
_CLIENT_GONE: Final = 499


def add_routes(app: web.Application) -> None:
    """Add the inspector's routes to ``app``; they use ``app[INSPECTOR]``."""
    # [\s\S], not ".": a newline in a key must reach the read path and be refused there.
    app.router.add_get(r"/v1/inspect/media/{backend}/{key:[\s\S]*}", _media)
    app.router.add_get("/v1/inspect/{op}", _op)


async def _op(request: web.Request) -> web.Response:
    op = request.match_info["op"]
    if op not in OPS:
        raise web.HTTPNotFound(
            reason=f"no inspector op {op!r}; the ops are {', '.join(OPS)} "
            "(GET /v1/inspect/OP?ARGS), and media (GET /v1/inspect/media/BACKEND/KEY)"
        )
    args: dict[str, str] = {}
    for name, value in request.query.items():
        if name in args:
            raise InvalidRequestError(f"inspect {op}: {name!r} is given twice; give it once")
        if len(value) > _MAX_ARG_CHARS:
            raise InvalidRequestError(
                f"inspect {op}: {name!r} is {len(value)} characters, more than "
                f"{_MAX_ARG_CHARS} an argument may be"
            )
        args[name] = value
    if len(args) > _MAX_ARGS:
        raise InvalidRequestError(f"inspect {op}: {len(args)} arguments, at most {_MAX_ARGS}")
    call = asyncio.ensure_future(request.app[INSPECTOR].call(op, args))
    try:
        while not call.done():
            await asyncio.wait((call,), timeout=GONE_POLL_S)
            if not call.done() and _gone(request):
                call.cancel()
                await asyncio.wait((call,))  # it leaves the queue, or its worker is killed
                if not call.cancelled():
                    call.exception()  # it ended as the client left: retrieved, unread
                log.info(
                    "inspector request given up: its client left",
                    extra={"op": op, "peer": request.remote},
                )
                return web.Response(status=_CLIENT_GONE, reason="Client Closed Request")
    finally:
        call.cancel()  # the handler itself was cancelled: the daemon is stopping
    # The worker's JSON as it wrote it (ASCII, so a lone surrogate is still valid UTF-8).
    return web.Response(body=call.result(), content_type="application/json")


def _gone(request: web.Request) -> bool:
    """Whether the request's client has closed its connection: aiohttp reads the socket
    while a handler runs, and drops the transport when the peer closes it."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def _media(request: web.Request) -> web.StreamResponse:
    app = request.app
    started = time.perf_counter()
    read_path = app[READ_PATH]
    stat = await read_path.stat(request.match_info["backend"], request.match_info["key"])
    offset, length = _window(request, stat)
    head = await _head(read_path, stat, offset, min(length, SNIFF_BYTES))
    media_type = sniff(head)
    headers = dict(MEDIA_HEADERS)
    if media_type in MEDIA_TYPES:
        headers["Content-Type"] = media_type
    else:
        # Not a type a browser may show: it can only be saved, never run as a page.
        headers["Content-Type"] = "application/octet-stream"
        headers["Content-Disposition"] = "attachment"
    response, served = await send_object(request, stat, window=(offset, length), headers=headers)
    if request.method != "HEAD":
        app[METRICS].read_seconds.observe(time.perf_counter() - started)
        app[METRICS].read_bytes.labels("chunkd").inc(served)
    return response


def _window(request: web.Request, stat: Stat) -> tuple[int, int]:
    """``(offset, length)`` from the query: the whole object without them."""
    name = f"{stat.backend}/{stat.meta.key}"
    offset = _whole(request, "offset", 0)
    if offset > stat.size:
        raise InvalidRangeError(
            f"offset {offset} is past the end of {name} ({stat.size} bytes); "
            "give an offset inside the object"
        )
    length = _whole(request, "length", stat.size - offset)
    if offset + length > stat.size:
        raise InvalidRangeError(
            f"the window {offset}+{length} runs past the end of {name} ({stat.size} bytes); "
            "the object may have changed since its window was given: open it again"
        )
    return offset, length


def _whole(request: web.Request, name: str, default: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    if not _WHOLE.fullmatch(text):
        raise InvalidRangeError(
            f"{name} must be a whole number of bytes (0 or more, at most 16 digits); "
            f"got {text[:40]!r}"
        )
    return int(text)


async def _head(read_path: ReadPath, stat: Stat, offset: int, count: int) -> bytes:
    """The first ``count`` bytes at ``offset``, through the cache (the inspector's
    look, not a reader's request: neither a direct GET nor bytes served in the cost
    ledger)."""
    head = bytearray()
    pieces = read_path.read(stat, offset, offset + count, reader=False)
    async with contextlib.aclosing(pieces):
        async for piece in pieces:
            head += piece  # a copy: the view is valid only until the next piece
    return bytes(head)
