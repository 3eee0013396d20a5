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
A connection carries one request at a time. Requests:

``{"op": "hello", "id": 1, "version": 1}``
    ``{"ok": true, "version": 1, "chunk_bytes": N, "daemon": "chunkd X"}``
``{"op": "stat", "id": 2, "name": "BACKEND/KEY"}``
    ``{"ok": true, "size": S, "version": V, "chunk_bytes": N, "revalidate": SECONDS|null}``
``{"op": "read", "id": 3, "name": "BACKEND/KEY", "offset": O, "length": L|null,
"inline": true}``
    ``{"ok": true, "size": S, "version": V, "offset": O, "length": L,
    "spans": [{"chunk": ID, "index": I, "size": CHUNK_SIZE, "start": A, "stop": B}],
    "fds": K}`` where span ``j`` is bytes ``A..B`` of chunk ``I`` (whose id is ``ID``,
    ``CHUNK_SIZE`` bytes long), carried by the ``j``-th fd: a sealed memfd holding the
    whole chunk, to be mapped read-only. Small reads answer inline instead
    (``"fds": 0, "inline": true`` and the bytes as the payload), unless the request
    says ``"inline": false`` (a client that caches mappings wants the chunk).
``{"op": "list", "id": 5, "name": "BACKEND[/PREFIX]", "recursive": false}``
    ``{"ok": true, "entries": [{"name": "BACKEND/KEY", "type": "file", "size": S},
    {"name": "BACKEND/DIR", "type": "directory"}]}`` (one level; every object below
    when recursive)
``{"op": "prefetch", "id": 4, "names": ["BACKEND/KEY", ...]}``
    ``{"ok": true, "started": N}`` (loading goes on in the daemon)

Any request may instead get ``{"ok": false, "error": KIND, "status": HTTP_LIKE,
"message": TEXT}`` (KIND is the chunkd error class name). A malformed frame closes
the connection; nothing else is affected.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
from pathlib import Path
from typing import Any, Final

__all__ = [
    "INLINE_MAX",
    "MAX_FDS",
    "MAX_HEADER",
    "MAX_PAYLOAD",
    "PREFIX",
    "VERSION",
    "ProtocolError",
    "check_prefix",
    "decode_header",
    "default_socket_paths",
    "encode_frame",
    "recv_frame",
    "send_frame",
]

VERSION: Final = 1
PREFIX: Final = struct.Struct(">II")
MAX_HEADER: Final = 64 * 1024
MAX_PAYLOAD: Final = 1 << 20
MAX_FDS: Final = 250  # Linux passes at most 253 fds per message (SCM_MAX_FD)
#: reads up to this many bytes may be answered inline rather than with fds
INLINE_MAX: Final = 64 * 1024


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
    body = json.dumps(header, separators=(",", ":")).encode()
    if len(body) > MAX_HEADER:
        raise ProtocolError(f"header of {len(body)} bytes exceeds {MAX_HEADER}")
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return PREFIX.pack(len(body), len(payload)) + body + bytes(payload)


def decode_header(raw: bytes) -> dict[str, Any]:
    """Parse a frame's header; raise :class:`ProtocolError` on anything but a JSON object."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"frame header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("frame header is not a JSON object")
    return header


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
