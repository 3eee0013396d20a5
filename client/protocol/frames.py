"""Frames on the local socket: the prefix, the JSON header, fds with SCM_RIGHTS.

A frame is ``u32 header_length``, ``u32 payload_length`` (big-endian), the header (a
JSON object, UTF-8, at most :data:`MAX_HEADER` bytes) and the payload (at most
:data:`MAX_PAYLOAD` bytes). Fds travel on the ``sendmsg`` that carries a frame's
first byte and are taken with the ``recvmsg`` that reads its prefix, at most
:data:`MAX_FDS`. Sending and receiving, on a blocking socket and on a non-blocking
one in the running loop, are defined here once for both ends.
"""

from __future__ import annotations

import array
import asyncio
import json
import math
import socket
import struct
from typing import Any, Final, NamedTuple

from chunkd.errors import ProtocolError
from chunkd.memfd import close_all

__all__ = [
    "MAX_DEPTH",
    "MAX_FDS",
    "MAX_HEADER",
    "MAX_PAYLOAD",
    "PREFIX",
    "Frame",
    "RawFrame",
    "check_prefix",
    "decode_header",
    "encode_frame",
    "loads",
    "recv_frame",
    "recv_raw",
    "recv_raw_async",
    "send_frame",
    "send_frame_async",
]

#: a frame's first 8 bytes: the lengths of its header and its payload
PREFIX: Final = struct.Struct(">II")
MAX_HEADER: Final = 64 * 1024
MAX_PAYLOAD: Final = 1 << 20
MAX_FDS: Final = 250  # Linux passes at most 253 fds per message (SCM_MAX_FD)
#: JSON nesting (objects and arrays) in a header
MAX_DEPTH: Final = 32


class RawFrame(NamedTuple):
    """A frame as it came: the header undecoded, and whether the kernel cut its fds."""

    header: bytes
    payload: bytes
    fds: list[int]
    fds_cut: bool


class Frame(NamedTuple):
    """A frame: its header, payload and the fds that came with it (the receiver's)."""

    header: dict[str, Any]
    payload: bytes
    fds: list[int]


def encode_frame(header: dict[str, Any], payload: bytes | memoryview = b"") -> bytes:
    """One frame: prefix, JSON header, payload."""
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False)
    try:
        body = text.encode()
    except UnicodeEncodeError:
        # A lone surrogate, which a request may carry escaped ("\ud800") and its answer
        # echoes (its id, a name in a message): escaped again, so the header stays UTF-8.
        body = json.dumps(header, separators=(",", ":")).encode()
    if len(body) > MAX_HEADER:
        raise ProtocolError(f"header of {len(body)} bytes exceeds {MAX_HEADER}")
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return PREFIX.pack(len(body), len(payload)) + body + bytes(payload)


def decode_header(raw: bytes) -> dict[str, Any]:
    """Parse a frame's header.

    Raises:
        ProtocolError: it is not a JSON object, nests deeper than :data:`MAX_DEPTH`,
            or holds ``NaN``, ``Infinity`` or a number too large for a float.
    """
    header = loads(raw)
    if not isinstance(header, dict):
        raise ProtocolError("frame header is not a JSON object")
    # Only a header with many brackets can nest deep; most have a handful.
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and _depth(header) > MAX_DEPTH:
        raise ProtocolError(f"frame header nests JSON deeper than {MAX_DEPTH} levels")
    return header


def loads(raw: bytes) -> Any:
    """JSON as chunkd takes it: UTF-8, and numbers are finite (no ``NaN``, ``Infinity``,
    ``1e400``).

    Raises:
        ProtocolError: ``raw`` is not such JSON (or nests deeper than the parser goes).
    """
    try:
        # Decoded here, strictly: json.loads would take bytes in UTF-16 or UTF-32, and
        # UTF-8 with surrogates encoded in it, which is not UTF-8.
        text = raw.decode("utf-8")
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"not JSON chunkd takes: {exc}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number chunkd takes")


def _finite(text: str) -> float:
    value = float(text)
    if value in (math.inf, -math.inf):
        raise ValueError(f"{text[:20]} is out of range of a number chunkd takes")
    return value


def _depth(value: Any) -> int:
    """How deep objects and arrays nest in ``value`` (counted to MAX_DEPTH + 1 at most)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                break
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def check_prefix(header_length: int, payload_length: int) -> None:
    """Raise :class:`ProtocolError` for lengths beyond the limits (the stream is lost)."""
    if not 0 < header_length <= MAX_HEADER:
        raise ProtocolError(f"header length {header_length} outside 1..{MAX_HEADER}")
    if not 0 <= payload_length <= MAX_PAYLOAD:
        raise ProtocolError(f"payload length {payload_length} outside 0..{MAX_PAYLOAD}")


def send_frame(
    sock: socket.socket,
    header: dict[str, Any],
    payload: bytes | memoryview = b"",
    fds: list[int] | None = None,
) -> None:
    """Send one frame on a blocking socket, with ``fds`` on its first byte."""
    data = memoryview(encode_frame(header, payload))
    if fds:
        if len(fds) > MAX_FDS:
            raise ProtocolError(f"{len(fds)} fds exceed {MAX_FDS}")
        sent = sock.sendmsg([data], _ancillary(fds))
        data = data[sent:]
    if data:
        sock.sendall(data)


async def send_frame_async(
    sock: socket.socket, frame: bytes, fds: list[int], *, stall_limit: float
) -> None:
    """Send an encoded ``frame`` on a non-blocking socket, with ``fds`` on its first
    byte; :class:`TimeoutError` when the peer reads nothing for ``stall_limit`` s."""
    loop = asyncio.get_running_loop()
    view = memoryview(frame)
    ancillary = _ancillary(fds) if fds else []
    while view:
        try:
            sent = sock.sendmsg([view], ancillary)
        except BlockingIOError:
            await _ready(loop, sock, write=True, limit=stall_limit)
            continue
        ancillary = []  # the fds went with the first bytes
        view = view[sent:]


def recv_frame(sock: socket.socket) -> Frame:
    """Receive one frame on a blocking socket: header, payload, fds.

    Raises:
        ConnectionError: the peer closed the connection.
        ProtocolError: the frame breaks the protocol.
    """
    raw = recv_raw(sock)
    if raw.fds_cut:
        close_all(raw.fds)
        raise ProtocolError(
            f"the kernel cut the fds that came with a frame: more than {MAX_FDS}, or this "
            "process is out of fds (its RLIMIT_NOFILE; cached chunks hold one each: give "
            "clients a smaller cache_chunks, or raise the limit)",
            in_sync=True,
        )
    try:
        return Frame(decode_header(raw.header), raw.payload, raw.fds)
    except BaseException:
        close_all(raw.fds)
        raise


def recv_raw(sock: socket.socket) -> RawFrame:
    """Receive one frame on a blocking socket, its header undecoded.

    Raises:
        ConnectionError: the peer closed the connection (before or inside the frame).
        ProtocolError: the prefix breaks the limits (the stream is lost).
    """
    fds: list[int] = []
    cut = False
    try:
        prefix = b""
        while len(prefix) < PREFIX.size:
            data, ancillary, flags, _ = sock.recvmsg(PREFIX.size - len(prefix), _FD_SPACE)
            cut |= _take_fds(ancillary, flags, fds)
            if not data:
                raise ConnectionError("the peer closed the connection")  # noqa: TRY301
            prefix += data
        header_length, payload_length = PREFIX.unpack(prefix)
        check_prefix(header_length, payload_length)
        header = _recv_exact(sock, header_length)
        payload = _recv_exact(sock, payload_length) if payload_length else b""
    except BaseException:
        close_all(fds)
        raise
    return RawFrame(header, payload, fds, cut)


async def recv_raw_async(sock: socket.socket) -> RawFrame | None:
    """:func:`recv_raw` on a non-blocking socket in the running loop; None when the
    peer closed the connection cleanly, between frames."""
    loop = asyncio.get_running_loop()
    fds: list[int] = []
    cut = False
    try:
        prefix = b""
        while len(prefix) < PREFIX.size:
            try:
                data, ancillary, flags, _ = sock.recvmsg(PREFIX.size - len(prefix), _FD_SPACE)
            except BlockingIOError:
                await _ready(loop, sock, write=False, limit=None)
                continue
            cut |= _take_fds(ancillary, flags, fds)
            if not data:
                if prefix:
                    raise ConnectionError("the peer closed the connection mid-frame")  # noqa: TRY301
                close_all(fds)
                return None
            prefix += data
        header_length, payload_length = PREFIX.unpack(prefix)
        check_prefix(header_length, payload_length)
        header = await _recv_exact_async(loop, sock, header_length)
        payload = await _recv_exact_async(loop, sock, payload_length) if payload_length else b""
    except BaseException:
        close_all(fds)
        raise
    return RawFrame(header, payload, fds, cut)


_FD_SPACE: Final = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


def _ancillary(fds: list[int]) -> list[tuple[int, int, array.array[int]]]:
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]


def _take_fds(ancillary: list[tuple[int, int, bytes]], flags: int, into: list[int]) -> bool:
    """Add the fds of one ``recvmsg`` to ``into``; True if the kernel cut some off."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(data[: len(data) - len(data) % got.itemsize])
            into.extend(got)
    return bool(flags & socket.MSG_CTRUNC)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection mid-frame")
        got += n
    return bytes(buf)


async def _recv_exact_async(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, size: int
) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection mid-frame")
        got += n
    return bytes(buf)


async def _ready(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, *, write: bool, limit: float | None
) -> None:
    """Wait until ``sock`` is writable (or readable); TimeoutError after ``limit`` s."""
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    fd = sock.fileno()
    if write:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        async with asyncio.timeout(limit):
            await ready
    except TimeoutError:
        raise TimeoutError(f"the peer read nothing for {limit:g}s; it was dropped") from None
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)
