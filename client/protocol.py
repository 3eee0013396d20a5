"""The local socket protocol between trainers and the daemon of their node.

This module is the only one the client and the gateway share; it needs nothing but
the standard library.

Transport: a Unix stream socket (``server.socket``; the client looks at
``$CHUNKD_SOCKET``, then ``/run/chunkd/chunkd.sock``, then ``./chunkd.sock``).

Framing, both ways::

    u32 header_length  (big-endian)
    u32 payload_length (big-endian)
    header             JSON object, UTF-8, at most MAX_HEADER bytes
    payload            raw bytes, at most MAX_PAYLOAD bytes (inline read data)

File descriptors travel with SCM_RIGHTS on the ``sendmsg`` that carries a frame's
first byte; the receiver takes them with the ``recvmsg`` that reads the 8-byte
prefix. A response names how many it carries (``"fds": n``); at most MAX_FDS.

Every request has ``"op"`` and a client-chosen ``"id"`` that its response echoes.
A connection carries one request at a time, and starts with ``hello``: a daemon
answers nothing else before it, and refuses a client of another version (whose
requests it might otherwise answer differently than that client expects, for
example a listing cut to its first page). Requests:

``{"op": "hello", "id": 1, "version": 2}``
    ``{"ok": true, "version": 2, "chunk_bytes": N, "daemon": "chunkd X"}``; a
    ``version`` other than :data:`VERSION` gets ``ProtocolVersionError``.
``{"op": "stat", "id": 2, "name": "BACKEND/KEY"}``
    ``{"ok": true, "size": S, "version": V, "chunk_bytes": N, "revalidate": SECONDS|null,
    "modified": T|null, "stale": SECONDS|null}``; ``modified`` is when the object was
    written (seconds since the epoch), ``stale`` is set when the backend could not
    re-check the version and the daemon serves the one it checked that long ago.
``{"op": "read", "id": 3, "name": "BACKEND/KEY", "offset": O, "length": L|null,
"inline": true}``
    ``{"ok": true, "size": S, "version": V, "offset": O, "length": L,
    "spans": [{"chunk": ID, "index": I, "size": CHUNK_SIZE, "start": A, "stop": B}],
    "fds": K}`` where span ``j`` is bytes ``A..B`` of chunk ``I`` (whose id is ``ID``,
    ``CHUNK_SIZE`` bytes long), carried by the ``j``-th fd: a sealed memfd holding the
    whole chunk, to be mapped read-only. Small reads answer inline instead
    (``"fds": 0, "inline": true`` and the bytes as the payload), unless the request
    says ``"inline": false`` (a client that caches mappings wants the chunk).
``{"op": "readv", "id": 6, "ranges": [["BACKEND/KEY", OFFSET, LENGTH], ...]}``
    Several small ranges in one round trip (at most :data:`MAX_RANGES`), answered
    inline: ``{"ok": true, "answered": K, "ranges": [{"size": S, "version": V,
    "offset": O, "length": L} | {"error": KIND, "status": N, "message": TEXT}]}``
    and the payload holds the bytes of the first ``K`` ranges, one after the other.
    ``K`` is as many as fit in :data:`MAX_PAYLOAD` (at least one, whose length the
    daemon then cuts to fit); the client asks again for the rest.
``{"op": "list", "id": 5, "name": "BACKEND[/PREFIX]", "recursive": false,
"start_after": KEY|null, "limit": N|null}``
    One page of a listing, in key order: one level (objects, and the directories
    that hold more), or every object below when recursive. The answer is
    ``{"ok": true, "count": N, "next": KEY|null}`` and a payload, one JSON object
    with the entries by column: ``{"backend": B, "keys": [KEY, ...], "sizes": [S,
    ...], "versions": [V, ...], "modified": [T, ...], "dirs": [I, ...]}``, where
    entry ``i`` is ``BACKEND/keys[i]``, ``dirs`` lists the positions of the
    directories (whose size is 0 and version and time null), and ``modified`` is
    seconds since the epoch. ``limit`` is at most :data:`MAX_LIST_PAGE` (default
    :data:`LIST_PAGE`); a page may hold fewer entries, to fit the payload. ``next``
    is the page token: send it back as ``start_after`` for the next page; null on
    the last page (a full page may be followed by an empty last one). It is a key of
    the backend, after which the listing resumes (a directory's key ends in ``/``).
``{"op": "prefetch", "id": 4, "names": ["BACKEND/KEY", ...]}``
    ``{"ok": true, "started": N}``: the daemon loads the objects in the background,
    a few at a time (``[server] prefetch_per_client`` for the user the connection
    comes from, and ``prefetch_in_flight`` for all); at most
    :data:`MAX_PREFETCH_QUEUED` names of one user wait at once.

The ``ckpt_*`` requests are written down in :mod:`chunkd.gateway.checkpoint_ops`.

Bounds: every number, count and length a request can name has one, named below
(``MAX_*``); JSON nested deeper than :data:`MAX_DEPTH`, and the non-numbers
``NaN`` and ``Infinity``, are refused.

Any request may instead get ``{"ok": false, "error": KIND, "status": HTTP_LIKE,
"message": TEXT}`` (KIND is the chunkd error class name); a request with arguments
of the wrong type or out of bounds gets ``InvalidRequestError``, and the connection
stays. A frame that breaks the framing (lengths over the limits, a payload or fds
on a request that takes none, a frame cut off) closes the connection; nothing else
is affected.
"""

from __future__ import annotations

import array
import json
import math
import os
import socket
import struct
from pathlib import Path
from typing import Any, Final

__all__ = [
    "INLINE_MAX",
    "LIST_PAGE",
    "MAX_DEPTH",
    "MAX_FDS",
    "MAX_HEADER",
    "MAX_LIST_PAGE",
    "MAX_PAYLOAD",
    "MAX_PREFETCH_QUEUED",
    "MAX_RANGES",
    "MAX_WORLD_SIZE",
    "PREFIX",
    "VERSION",
    "ProtocolError",
    "check_prefix",
    "decode_header",
    "default_socket_paths",
    "encode_frame",
    "loads",
    "recv_frame",
    "send_frame",
]

#: 2: listings come in pages (``start_after``, ``next``); ``readv``; hello first
VERSION: Final = 2
PREFIX: Final = struct.Struct(">II")
MAX_HEADER: Final = 64 * 1024
MAX_PAYLOAD: Final = 1 << 20
MAX_FDS: Final = 250  # Linux passes at most 253 fds per message (SCM_MAX_FD)
#: reads up to this many bytes may be answered inline rather than with fds
INLINE_MAX: Final = 64 * 1024
#: entries in a listing page when the request names no limit, and the most it may name
LIST_PAGE: Final = 1000
MAX_LIST_PAGE: Final = 10_000
#: ranges in one ``readv``
MAX_RANGES: Final = 256
#: names of one user of the node waiting to be prefetched
MAX_PREFETCH_QUEUED: Final = 100_000
#: ranks of one checkpoint save
MAX_WORLD_SIZE: Final = 1 << 16
#: JSON nesting (objects and arrays) in a header
MAX_DEPTH: Final = 32


class ProtocolError(Exception):
    """A frame that breaks the protocol (the connection is closed)."""


def default_socket_paths() -> list[Path]:
    """Where a client looks for the daemon, in order."""
    paths = []
    env = os.environ.get("CHUNKD_SOCKET")
    if env:
        paths.append(Path(env))
    paths += [Path("/run/chunkd/chunkd.sock"), Path("chunkd.sock")]
    return paths


def encode_frame(header: dict[str, Any], payload: bytes | memoryview = b"") -> bytes:
    """One frame: prefix, JSON header, payload."""
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
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
    """JSON as chunkd takes it: numbers are finite (no ``NaN``, ``Infinity``, ``1e400``).

    Raises:
        ProtocolError: ``raw`` is not such JSON (or nests deeper than the parser goes).
    """
    try:
        return json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
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
    """Raise :class:`ProtocolError` for lengths beyond the limits."""
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
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        sent = sock.sendmsg([data], ancillary)
        data = data[sent:]
    if data:
        sock.sendall(data)


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], bytes, list[int]]:
    """Receive one frame on a blocking socket: header, payload, fds.

    Raises:
        ConnectionError: the peer closed the connection.
        ProtocolError: the frame breaks the protocol.
    """
    fds: list[int] = []
    prefix = bytearray()
    space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    try:
        while len(prefix) < PREFIX.size:
            data, ancillary, _flags, _addr = sock.recvmsg(PREFIX.size - len(prefix), space)
            fds += _fds_of(ancillary)
            if not data:
                raise ConnectionError("the chunkd daemon closed the connection")  # noqa: TRY301 - fds close below
            prefix += data
        header_length, payload_length = PREFIX.unpack(prefix)
        check_prefix(header_length, payload_length)
        header = decode_header(_recv_exact(sock, header_length))
        payload = _recv_exact(sock, payload_length) if payload_length else b""
    except BaseException:
        _close_all(fds)
        raise
    return header, payload, fds


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the chunkd daemon closed the connection mid-frame")
        got += n
    return bytes(buf)


def _fds_of(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % array.array("i").itemsize
            fds += array.array("i", data[:usable]).tolist()
    return fds


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
