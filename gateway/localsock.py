"""The local socket: sealed chunks handed to the trainers of this node.

Speaks :mod:`chunkd.client.protocol` (framing, ops and fd passing are written down
there). For a read, each chunk of the range goes out as its sealed memfd
(SCM_RIGHTS); the client maps it read-only, so the bytes cross no socket and the
node holds one copy whatever the number of readers. Small reads are answered
inline.

The daemon is protected from every client:

* a malformed frame closes that connection only;
* each connection is served by a task of its own, and a client that stops reading
  stalls only itself: a send that cannot progress for ``send_timeout`` seconds
  closes its connection;
* a client that dies mid-request leaks nothing: leases are released whether or not
  the answer was sent, and the fds in a message the kernel could not deliver are
  closed with it;
* peer credentials (SO_PEERCRED) are logged and counted per uid.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import grp
import logging
import os
import socket
import stat as statmod
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import chunkd
from chunkd.cache import ChunkLease
from chunkd.cache.ram import seal_memfd_off_loop
from chunkd.client.protocol import (
    INLINE_MAX,
    MAX_FDS,
    PREFIX,
    VERSION,
    ProtocolError,
    check_prefix,
    decode_header,
    encode_frame,
)
from chunkd.errors import ChunkdError, InvalidKeyError
from chunkd.gateway.ranges import InvalidRangeError, RangeNotSatisfiableError
from chunkd.gateway.readpath import validate_key
from chunkd.gateway.status import http_status

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge

    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.readpath import ReadPath

__all__ = ["LocalServer"]

log = logging.getLogger("chunkd.gateway.local")

_CREDS: Final = struct.Struct("3i")  # pid, uid, gid
_PREFETCH_IN_FLIGHT: Final = 8


class LocalServer:
    """Serves the local protocol on a Unix socket.

    Args:
        path: the socket's path (its directory must exist).
        read_path: the daemon's read path.
        metrics: the daemon's metrics.
        mode: the socket's permissions (0660 by default).
        group: the group that owns the socket, or None.
        send_timeout: seconds a send may make no progress before the client is dropped.
        max_clients: connections served at once; more wait in the listen backlog.
    """

    def __init__(
        self,
        path: Path,
        read_path: ReadPath,
        metrics: Metrics,
        *,
        mode: int = 0o660,
        group: str | None = None,
        send_timeout: float = 30.0,
        max_clients: int = 1024,
    ) -> None:
        self.path = Path(path)
        self.read_path = read_path
        self.mode = mode
        self.group = group
        self.send_timeout = send_timeout
        self._slots = asyncio.Semaphore(max_clients)
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._clients: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[Any]] = set()
        self._requests: Counter = metrics.local_requests
        self._connected: Gauge = metrics.local_clients
        self._malformed: Counter = metrics.local_malformed

    async def start(self) -> None:
        """Bind the socket (replacing a stale one) and start accepting."""
        self._clear_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))
            os.chmod(self.path, self.mode)  # the unit's UMask would leave it 0750
            if self.group is not None:
                os.chown(self.path, -1, grp.getgrnam(self.group).gr_gid)
            sock.listen(1024)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise ChunkdError(
                f"cannot serve the local socket {self.path}: {exc.strerror or exc}; set "
                "server.socket (or CHUNKD_SERVER_SOCKET) to a path in a directory chunkd "
                "can write"
            ) from exc
        except KeyError:
            sock.close()
            raise ChunkdError(
                f"server.socket_group {self.group!r} is not a group on this host"
            ) from None
        self._sock = sock
        self._accepting = asyncio.create_task(self._accept())
        log.info("local socket ready", extra={"socket": str(self.path)})

    def _clear_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not statmod.S_ISSOCK(st.st_mode):
            raise ChunkdError(
                f"{self.path} exists and is not a socket; remove it or move server.socket"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self.path))
        except OSError:
            os.unlink(self.path)  # nobody answers: left by a daemon that died
            return
        finally:
            probe.close()
        raise ChunkdError(f"another chunkd already serves {self.path}; stop it first")

    async def close(self) -> None:
        """Stop accepting, drop every client, and remove the socket."""
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        for task in (*self._clients, *self._background):
            task.cancel()
        await asyncio.gather(*self._clients, *self._background, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    # -- connections -------------------------------------------------------------------

    async def _accept(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._slots.acquire()
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:
                self._slots.release()
                log.warning("local socket: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            except BaseException:
                self._slots.release()
                raise
            conn.setblocking(False)
            task = asyncio.create_task(self._serve(conn))
            self._clients.add(task)
            task.add_done_callback(self._clients.discard)

    async def _serve(self, conn: socket.socket) -> None:
        pid, uid, gid = _CREDS.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
        )
        peer = {"pid": pid, "uid": uid, "gid": gid}
        log.info("local client connected", extra=peer)
        self._connected.inc()
        try:
            while True:
                header = await self._receive(conn)
                if header is None:
                    return
                op = str(header.get("op"))
                self._requests.labels(str(uid), op if op in _OPS else "unknown").inc()
                await self._answer(conn, header)
        except ProtocolError as exc:
            self._malformed.inc()
            log.warning("local client sent a malformed frame: %s; closing it", exc, extra=peer)
        except (ConnectionError, TimeoutError) as exc:
            log.info("local client went away: %s", exc, extra=peer)
        finally:
            self._connected.dec()
            conn.close()
            self._slots.release()

    async def _receive(self, conn: socket.socket) -> dict[str, Any] | None:
        """The next request, or None when the client closed the connection cleanly."""
        prefix = await _recv_exact(conn, PREFIX.size, eof_ok=True)
        if prefix is None:
            return None
        header_length, payload_length = PREFIX.unpack(prefix)
        check_prefix(header_length, payload_length)
        if payload_length:
            raise ProtocolError("requests carry no payload")
        raw = await _recv_exact(conn, header_length, eof_ok=False)
        assert raw is not None
        return decode_header(raw)

    async def _answer(self, conn: socket.socket, header: dict[str, Any]) -> None:
        leases: list[ChunkLease] = []
        fds: list[int] = []
        owned: list[int] = []  # fds made for this answer, closed after the send
        payload = b""
        try:
            try:
                response, payload = await self._handle(header, leases, fds, owned)
            except ChunkdError as exc:
                response = {
                    "ok": False,
                    "error": type(exc).__name__,
                    "status": http_status(exc),
                    "message": str(exc),
                }
            response["id"] = header.get("id")
            response.setdefault("fds", len(fds))
            await self._send(conn, encode_frame(response, payload), fds)
        finally:
            for lease in leases:
                lease.release()
            for fd in owned:
                os.close(fd)

    async def _handle(
        self, header: dict[str, Any], leases: list[ChunkLease], fds: list[int], owned: list[int]
    ) -> tuple[dict[str, Any], bytes]:
        op = header.get("op")
        read_path = self.read_path
        if op == "hello":
            return {
                "ok": True,
                "version": VERSION,
                "chunk_bytes": read_path.chunk_bytes,
                "daemon": f"chunkd {chunkd.__version__}",
            }, b""
        if op == "stat":
            stat = await read_path.stat(*_split_name(header.get("name")))
            return self._describe(stat), b""
        if op == "read":
            return await self._read(header, leases, fds, owned)
        if op == "list":
            return await self._list(header), b""
        if op == "prefetch":
            names = header.get("names")
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ProtocolError("prefetch wants 'names': a list of strings")
            for name in names:
                task = asyncio.create_task(self._prefetch(name))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            return {"ok": True, "started": len(names)}, b""
        raise ProtocolError(f"unknown op {op!r}")

    def _describe(self, stat: Any) -> dict[str, Any]:
        backend = self.read_path.backends.get(stat.backend)
        return {
            "ok": True,
            "size": stat.size,
            "version": stat.meta.version,
            "chunk_bytes": stat.chunk_bytes,
            "revalidate": backend.config.revalidate,
        }

    async def _read(
        self, header: dict[str, Any], leases: list[ChunkLease], fds: list[int], owned: list[int]
    ) -> tuple[dict[str, Any], bytes]:
        offset, length = header.get("offset", 0), header.get("length")
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise InvalidRangeError(f"offset must be a whole number >= 0; got {offset!r}")
        if length is not None and (
            not isinstance(length, int) or isinstance(length, bool) or length < 0
        ):
            raise InvalidRangeError(f"length must be a whole number >= 0 or null; got {length!r}")
        stat = await self.read_path.stat(*_split_name(header.get("name")))
        if offset > stat.size or (offset == stat.size and stat.size and length != 0):
            raise RangeNotSatisfiableError(
                f"offset {offset} is past the end of the object ({stat.size} bytes)", stat.size
            )
        end = stat.size if length is None else min(stat.size, offset + length)
        response = self._describe(stat) | {"offset": offset, "length": end - offset, "spans": []}
        if end - offset <= INLINE_MAX and header.get("inline", True) is not False:
            chunks = [bytes(piece) async for piece in self.read_path.read(stat, offset, end)]
            return response | {"inline": True, "fds": 0}, b"".join(chunks)
        size = stat.chunk_bytes
        first, last = offset // size, (end - 1) // size
        if last - first + 1 > MAX_FDS:
            raise InvalidRangeError(
                f"a read covers at most {MAX_FDS} chunks ({MAX_FDS * size >> 20} MiB); split it"
            )
        index = first
        async for lease in self.read_path.leases(stat, first, last):
            leases.append(lease)
            fd = lease.fileno()
            if fd is None:  # no RAM copy (RAM full of pinned chunks): seal one for it
                fd = await seal_memfd_off_loop(lease.view())
                owned.append(fd)
            fds.append(fd)
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
        return response, b""

    async def _list(self, header: dict[str, Any]) -> dict[str, Any]:
        name = header.get("name")
        if not isinstance(name, str) or not name.strip("/"):
            raise InvalidKeyError("a list names 'BACKEND' or 'BACKEND/PREFIX' (a string)")
        backend_name, _, prefix = name.strip("/").partition("/")
        backend = self.read_path.backends.get(backend_name)
        if prefix:
            validate_key(prefix)
        dirs, objects = await backend.list(prefix, recursive=bool(header.get("recursive")))
        entries: list[dict[str, Any]] = [
            {"name": f"{backend.name}/{d}", "type": "directory"} for d in dirs
        ]
        entries += [
            {"name": f"{backend.name}/{m.key}", "type": "file", "size": m.size} for m in objects
        ]
        return {"ok": True, "entries": entries}

    async def _prefetch(self, name: str) -> None:
        try:
            await self.read_path.warm(*_split_name(name))
        except ChunkdError as exc:
            log.info("prefetch of %s failed: %s", name, exc)

    async def _send(self, conn: socket.socket, data: bytes, fds: list[int]) -> None:
        """Send ``data`` with ``fds`` on its first byte; drop a client that stalls."""
        loop = asyncio.get_running_loop()
        view = memoryview(data)
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        while view:
            try:
                sent = conn.sendmsg([view], ancillary)
            except BlockingIOError:
                await _wait_writable(loop, conn, self.send_timeout)
                continue
            ancillary = []  # the fds went with the first bytes
            view = view[sent:]


_OPS: Final = frozenset({"hello", "stat", "read", "list", "prefetch"})


def _split_name(name: object) -> tuple[str, str]:
    if not isinstance(name, str):
        raise InvalidKeyError("a request names its object as 'BACKEND/KEY' (a string)")
    backend, _, key = name.partition("/")
    if not backend or not key:
        raise InvalidKeyError(f"{name!r} is not BACKEND/KEY")
    return backend, key


async def _recv_exact(conn: socket.socket, size: int, *, eof_ok: bool) -> bytes | None:
    loop = asyncio.get_running_loop()
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = await loop.sock_recv_into(conn, view[got:])
        if n == 0:
            if got == 0 and eof_ok:
                return None
            raise ConnectionError("the client closed the connection mid-frame")
        got += n
    return bytes(buf)


async def _wait_writable(
    loop: asyncio.AbstractEventLoop, conn: socket.socket, stall_limit: float
) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    fd = conn.fileno()
    loop.add_writer(fd, wake)
    try:
        async with asyncio.timeout(stall_limit):
            await ready
    except TimeoutError:
        raise TimeoutError(
            f"the client read nothing for {stall_limit:g}s; it was dropped"
        ) from None
    finally:
        loop.remove_writer(fd)
