"""An object (or one window of it) as an HTTP response: ``Range``, ``If-Range``,
``HEAD``, ``ETag``, streamed chunk by chunk from the read path.

Shared by ``/v1/objects/...`` and the inspector's ``/v1/inspect/media/...``, which
serves a window of an object (a tar member, say) as a resource of its own.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from typing import Final, Literal

from aiohttp import web

from chunkd.errors import InvalidRangeError
from chunkd.gateway.appkeys import READ_PATH, STREAMING
from chunkd.gateway.readpath import Stat
from chunkd.ranges import RequestRange, parse_range, reading, resolve

__all__ = ["etag_of", "quoted_etag", "reading_of", "send_object"]


def etag_of(stat: Stat) -> str:
    """The object version's ETag, quoted."""
    return quoted_etag(stat.meta.version)


def quoted_etag(version: str) -> str:
    """A version token as an ETag: quoted, as HTTP writes entity tags."""
    return version if version.startswith('"') else f'"{version}"'


#: headers that can make a GET's answer a 304 or a 412, or the whole object (If-Range)
_CONDITIONS: Final = (
    "If-Match",
    "If-None-Match",
    "If-Modified-Since",
    "If-Unmodified-Since",
    "If-Range",
)


def reading_of(request: web.Request) -> tuple[int, int | None] | None:
    """The bytes a GET's ``Range`` asks for, before the object's size is known (a hint
    for the read path's first GET: :meth:`~chunkd.gateway.readpath.ReadPath.stat`);
    None for a HEAD, a suffix or a ``Range`` that :func:`send_object` refuses later,
    and for a GET that may be answered without a body (a condition, an S3
    ``partNumber``): the first GET's span would fetch bytes nobody reads."""
    if request.method != "GET" or any(h in request.headers for h in _CONDITIONS):
        return None
    if "partNumber" in request.query:
        return None
    try:
        return reading(parse_range(request.headers.get("Range")))
    except InvalidRangeError:
        return None


async def send_object(
    request: web.Request,
    stat: Stat,
    *,
    window: tuple[int, int] | None = None,
    headers: Mapping[str, str] | None = None,
    byte_range: RequestRange | Literal["header"] | None = "header",
) -> tuple[web.StreamResponse, int]:
    """Answer ``request`` with the bytes of ``stat``; returns the response and the bytes
    sent.

    ``window``: ``(offset, length)`` of the object to serve as if it were the whole
    resource (a ``Range`` is taken inside it; the window is cut at the object's end).
    ``headers``: more headers (a ``Content-Type``, say; octet-stream otherwise).
    ``byte_range``: the range to serve, as the caller read it from the request;
    ``"header"``: parsed here from ``Range`` (and dropped when ``If-Range`` names
    another version).
    """
    base, size = 0, stat.size
    if window is not None:
        base = min(window[0], stat.size)
        size = min(window[1], stat.size - base)
    etag = etag_of(stat)
    if byte_range == "header":
        wanted = parse_range(request.headers.get("Range"))
        if_range = request.headers.get("If-Range")
        if wanted is not None and if_range is not None and if_range.strip() != etag:
            wanted = None  # the client's partial copy is of another version: send it whole
    else:
        wanted = byte_range
    start, end = resolve(wanted, size)
    out = {
        "ETag": etag,
        "Accept-Ranges": "bytes",
        "Content-Type": "application/octet-stream",
        **(headers or {}),
        "Content-Length": str(end - start),
    }
    if stat.stale is not None:  # stale-if-error (RFC 5861): the backend could not re-check it
        out["Warning"] = '111 chunkd "Revalidation Failed"'
        out["X-Chunkd-Stale"] = str(int(stat.stale))
    status = 200
    if wanted is not None:
        status = 206
        out["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    if request.method == "HEAD":
        return web.Response(status=status, headers=out), 0
    response = web.StreamResponse(status=status, headers=out)
    pieces = request.app[READ_PATH].read(stat, base + start, base + end)
    return response, await _send(request, response, pieces)


async def _send(
    request: web.Request,
    response: web.StreamResponse,
    pieces: AsyncGenerator[memoryview, None],
) -> int:
    """Stream ``pieces`` as the body of ``response``; returns the bytes read from them.

    The first piece is fetched before the headers go out, so a backend failure on a
    cold read is still a proper error status. After that an error can only cut the
    connection: the client sees a body shorter than Content-Length, never an error
    page spliced into a success.
    """
    total = 0
    try:
        piece = await anext(pieces, None)
        await response.prepare(request)
        request[STREAMING] = True
        while piece is not None:
            # No copy: a view maps its chunk on its own (cache.tier.ChunkLease.view),
            # so it stays valid in aiohttp's buffer after the read path moves on and
            # releases the lease, even if the chunk is evicted meanwhile.
            await response.write(piece)
            total += piece.nbytes
            piece = await anext(pieces, None)
        await response.write_eof()
    finally:
        await pieces.aclose()
    return total
