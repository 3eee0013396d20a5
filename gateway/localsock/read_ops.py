"""The reads and listings of the local socket: ``stat``, ``read``, ``readv``, ``list``.

A kept read (``keep``, the default) answers each chunk of its range as a leased
chunk's sealed memfd (or inline, up to :data:`~chunkd.client.protocol.INLINE_MAX`,
when the client asks); an unkept one (``keep: false``) answers its bytes inline and
keeps none of them in the tiers (:meth:`ReadPath.peek`). ``readv`` answers many
ranges inline in one payload of at most :data:`~chunkd.client.protocol.MAX_PAYLOAD`
bytes, a range's own error in its entry; the client asks again for what did not fit.
Each is planned from the lengths asked before anything is read.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from chunkd.client.protocol import (
    INLINE_MAX,
    MAX_FDS,
    MAX_HEADER,
    MAX_PAYLOAD,
    error_answer,
)
from chunkd.errors import ChunkdError, InvalidRangeError, RangeNotSatisfiableError
from chunkd.gateway.costs import charge
from chunkd.gateway.localsock.answer import LIST_BYTES
from chunkd.gateway.localsock.family import Family, Parts
from chunkd.gateway.names import split_name, split_prefix
from chunkd.ranges import from_offset, reading, resolve

if TYPE_CHECKING:
    from chunkd.gateway.localsock.answer import Answer
    from chunkd.gateway.readpath import ReadPath, Stat

__all__ = ["FAMILY"]

#: the handlers of this module's ops
FAMILY: Final = Family("read")

#: what the entries of a readv answer may take of its header, and the longest
#: message one failed range carries
_READV_HEADER: Final = MAX_HEADER - 4096
_RANGE_MESSAGE: Final = 300


@FAMILY.op("stat")
async def _stat(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    read_path = parts.read_path
    backend, key = split_name(args["name"])
    stat = await read_path.stat(backend, key)
    charge.direct(backend, "head")  # without chunkd: one HEAD
    return _describe(read_path, stat)


def _describe(read_path: ReadPath, stat: Stat) -> dict[str, Any]:
    return {
        "ok": True,
        "size": stat.size,
        "version": stat.meta.version,
        "chunk_bytes": stat.chunk_bytes,
        "revalidate": read_path.revalidate_after(stat.backend),
        "modified": stat.meta.modified or None,
        "stale": stat.stale,
    }


@FAMILY.op("read")
async def _read(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    read_path = parts.read_path
    offset, length = args["offset"], args["length"]
    if not args["keep"]:
        return await _read_unkept(read_path, args, answer)
    stat = await read_path.stat(
        *split_name(args["name"]),
        expect=args["version"],
        reading=reading(from_offset(offset, length)),
    )
    offset, end = resolve(from_offset(offset, length), stat.size)
    response = _describe(read_path, stat) | {"offset": offset, "length": end - offset, "spans": []}
    if end - offset <= INLINE_MAX and args["inline"]:
        chunks = [bytes(piece) async for piece in read_path.read(stat, offset, end)]
        answer.payload = b"".join(chunks)
        return response | {"inline": True, "fds": 0}
    size = stat.chunk_bytes
    first, last = offset // size, (end - 1) // size
    if last - first + 1 > MAX_FDS:
        raise InvalidRangeError(
            f"a read covers at most {MAX_FDS} chunks ({MAX_FDS * size >> 20} MiB); split it"
        )
    index = first
    async for lease in read_path.leases(stat, first, last, reading=(offset, end)):
        answer.leases.append(lease)
        await answer.send_chunk(lease)
        base = index * size
        response["spans"].append(
            {
                "chunk": str(lease.id),
                "index": index,
                "size": lease.size,
                "start": max(offset, base) - base,
                "stop": min(end, base + lease.size) - base,
            }
        )
        index += 1
    return response


async def _read_unkept(
    read_path: ReadPath, args: Mapping[str, Any], answer: Answer
) -> dict[str, Any]:
    """A read with ``keep: false``: its bytes inline, never kept in the tiers
    (:meth:`ReadPath.peek`); at most :data:`MAX_PAYLOAD` of them, asked for by
    length before anything is read."""
    offset, length = args["offset"], args["length"]
    if length is None or length > MAX_PAYLOAD:
        raise InvalidRangeError(
            f"a read with keep=false is answered inline: it names its length, at most "
            f"{MAX_PAYLOAD} bytes (asked: {length}); split it, or read it kept"
        )
    stat, data = await read_path.peek(
        *split_name(args["name"]), offset, length, expect=args["version"]
    )
    answer.payload = data
    return _describe(read_path, stat) | {
        "offset": offset,
        "length": len(data),
        "spans": [],
        "inline": True,
        "fds": 0,
    }


@FAMILY.op("readv")
async def _readv(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    read_path = parts.read_path
    asked: list[tuple[str, int, int]] = args["ranges"]
    if not args["keep"]:
        return await _readv_unkept(read_path, asked, answer)
    stats = await asyncio.gather(
        *(
            read_path.stat(*split_name(name), reading=(offset, offset + length))
            for name, offset, length in asked
        ),
        return_exceptions=True,
    )
    planned: list[tuple[Stat, int, int] | BaseException] = []
    used = 0
    for (_, offset, length), stat in zip(asked, stats, strict=True):
        if isinstance(stat, BaseException):
            planned.append(stat)
            continue
        try:
            offset, end = resolve(from_offset(offset, length), stat.size)
        except RangeNotSatisfiableError as exc:
            planned.append(exc)
            continue
        room = MAX_PAYLOAD - used
        if end - offset > room:
            if planned:
                break  # the rest is asked again
            end = offset + room
        planned.append((stat, offset, end))
        used += end - offset
    for outcome in planned:
        if isinstance(outcome, BaseException) and not isinstance(outcome, ChunkdError):
            raise outcome
    got = await asyncio.gather(
        *(_bytes_of(read_path, p) for p in planned if not isinstance(p, BaseException)),
        return_exceptions=True,
    )
    results = iter(got)
    out: list[dict[str, Any]] = []
    pieces: list[bytes] = []
    room = _READV_HEADER  # the answer's header holds one entry a range: it must fit
    for outcome in planned:
        entry: dict[str, Any]
        data: bytes | BaseException = b""
        if isinstance(outcome, BaseException):
            entry = _range_error(outcome)
        else:
            stat, start, end = outcome
            data = next(results)
            if isinstance(data, BaseException):
                if not isinstance(data, ChunkdError):
                    raise data
                entry = _range_error(data)
            else:
                entry = {
                    "size": stat.size,
                    "version": stat.meta.version,
                    "offset": start,
                    "length": end - start,
                }
        room -= len(json.dumps(entry)) + 1
        if room < 0 and out:
            break  # the rest is asked again
        out.append(entry)
        if isinstance(data, bytes):
            pieces.append(data)
    answer.payload = b"".join(pieces)
    return {"ok": True, "answered": len(out), "ranges": out}


async def _readv_unkept(
    read_path: ReadPath, asked: list[tuple[str, int, int]], answer: Answer
) -> dict[str, Any]:
    """``readv`` with ``keep: false``: the ranges whose lengths fit in
    :data:`MAX_PAYLOAD` together (at least the first, cut to fit) are read at once,
    none of them kept in the tiers (:meth:`ReadPath.peek_many`); the client asks again
    for the rest. Planned from the lengths asked, before anything is read."""
    planned: list[tuple[str, int, int]] = []
    used = 0
    for name, offset, length in asked:
        if used + length > MAX_PAYLOAD:
            if planned:
                break
            length = MAX_PAYLOAD
        planned.append((name, offset, length))
        used += length
    names: list[tuple[str, str] | ChunkdError] = []
    for name, _, _ in planned:
        try:
            names.append(split_name(name))
        except ChunkdError as exc:
            names.append(exc)  # this range's own error; the others are read
    peeked = iter(
        await read_path.peek_many(
            [
                (*named, offset, length)
                for named, (_, offset, length) in zip(names, planned, strict=True)
                if not isinstance(named, ChunkdError)
            ]
        )
    )
    got = [named if isinstance(named, ChunkdError) else next(peeked) for named in names]
    out: list[dict[str, Any]] = []
    pieces: list[bytes] = []
    room = _READV_HEADER
    for (_, offset, _), outcome in zip(planned, got, strict=True):
        data = b""
        if isinstance(outcome, ChunkdError):
            entry = _range_error(outcome)
            room -= len(json.dumps(entry)) + 1
        else:
            stat, data = outcome
            entry = {
                "size": stat.size,
                "version": stat.meta.version,
                "offset": offset,
                "length": len(data),
            }
            # At most this long in JSON (three numbers of up to 20 digits, the
            # keys, and the version escaped at worst six characters a character):
            # a bound, not a dump a range.
            room -= 112 + 6 * len(stat.meta.version)
        if room < 0 and out:
            break  # the rest is asked again
        out.append(entry)
        pieces.append(data)
    answer.payload = b"".join(pieces)
    return {"ok": True, "answered": len(out), "ranges": out}


async def _bytes_of(read_path: ReadPath, planned: tuple[Stat, int, int]) -> bytes:
    stat, start, end = planned
    return b"".join([bytes(piece) async for piece in read_path.read(stat, start, end)])


@FAMILY.op("list")
async def _list(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    backend, prefix = split_prefix(args["name"])
    page = await parts.listings.page(
        backend,
        prefix,
        recursive=args["recursive"],
        start_after=args["start_after"],
        limit=args["limit"],
        max_bytes=LIST_BYTES,
        fresh=args["fresh"],
    )
    # Without chunkd: one LIST a page; charged once the backend is known to be one
    # (an unknown name must not become a label value).
    charge.direct(page.backend, "list")
    answer.payload = json.dumps(page.columns(), ensure_ascii=False, separators=(",", ":")).encode()
    return {"ok": True, "count": len(page.entries), "next": page.next}


def _range_error(exc: BaseException) -> dict[str, Any]:
    body = error_answer(exc)
    del body["ok"]
    if len(body["message"]) > _RANGE_MESSAGE:
        body["message"] = body["message"][: _RANGE_MESSAGE - 3] + "..."
    return body
