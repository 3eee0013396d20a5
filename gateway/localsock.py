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
import fcntl
import grp
import json
import logging
import mmap
import os
import socket
import stat as statmod
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import chunkd
from chunkd.cache import ChunkId, ChunkLease
from chunkd.cache.ram import seal_memfd, seal_memfd_off_loop
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
from chunkd.errors import CheckpointError, ChunkdError, InvalidKeyError
from chunkd.gateway.checkpoints import Durability, SaveRequest, checkpoint_name
from chunkd.gateway.ranges import InvalidRangeError, RangeNotSatisfiableError
from chunkd.gateway.readpath import validate_key
from chunkd.gateway.status import http_status

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge

    from chunkd.gateway.checkpoints import Checkpoints
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.readpath import ReadPath

__all__ = ["LocalServer"]

log = logging.getLogger("chunkd.gateway.local")

_CREDS: Final = struct.Struct("3i")  # pid, uid, gid
_PREFETCH_IN_FLIGHT: Final = 8
_REQUIRED_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
#: longest a ckpt_wait request is held before the client asks again
_WAIT_SLICE: Final = 10.0
_MAX_LAYOUT: Final = 256 << 20


class LocalServer:
    """Serves the local protocol on a Unix socket.

    Args:
        path: the socket's path (its directory must exist).
        read_path: the daemon's read path.
        metrics: the daemon's metrics.
        checkpoints: the daemon's checkpoint store (the ``ckpt_*`` ops).
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
        checkpoints: Checkpoints | None = None,
        *,
        mode: int = 0o660,
        group: str | None = None,
        send_timeout: float = 30.0,
        max_clients: int = 1024,
    ) -> None:
        self.path = Path(path)
        self.read_path = read_path
        self.checkpoints = checkpoints
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
                received = await self._receive(conn)
                if received is None:
                    return
                header, request_fds = received
                op = str(header.get("op"))
                self._requests.labels(str(uid), op if op in _OPS else "unknown").inc()
                await self._answer(conn, header, request_fds)
        except ProtocolError as exc:
            self._malformed.inc()
            log.warning("local client sent a malformed frame: %s; closing it", exc, extra=peer)
        except (ConnectionError, TimeoutError) as exc:
            log.info("local client went away: %s", exc, extra=peer)
        finally:
            self._connected.dec()
            conn.close()
            self._slots.release()

    async def _receive(self, conn: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
        """The next request and the fds that came with it; None at a clean close."""
        prefix, fds = await _recv_prefix(conn)
        try:
            if prefix is None:
                _close_all(fds)
                return None
            header_length, payload_length = PREFIX.unpack(prefix)
            check_prefix(header_length, payload_length)
            _no_payload(payload_length)
            raw = await _recv_exact(conn, header_length, eof_ok=False)
            assert raw is not None
            return decode_header(raw), fds
        except BaseException:
            _close_all(fds)
            raise

    async def _answer(
        self, conn: socket.socket, header: dict[str, Any], request_fds: list[int]
    ) -> None:
        leases: list[ChunkLease] = []
        fds: list[int] = []
        owned: list[int] = list(request_fds)  # fds closed after the send
        payload = b""
        try:
            try:
                if request_fds and header.get("op") not in _FD_OPS:
                    raise ProtocolError(f"op {header.get('op')!r} takes no fds")
                response, payload = await self._handle(header, leases, fds, owned, request_fds)
            except ChunkdError as exc:
                response = _error(exc)
            response["id"] = header.get("id")
            response.setdefault("fds", len(fds))
            await self._send(conn, encode_frame(response, payload), fds)
        finally:
            for lease in leases:
                lease.release()
            for fd in owned:
                os.close(fd)

    async def _handle(
        self,
        header: dict[str, Any],
        leases: list[ChunkLease],
        fds: list[int],
        owned: list[int],
        request_fds: list[int],
    ) -> tuple[dict[str, Any], bytes]:
        op = header.get("op")
        if isinstance(op, str) and op.startswith("ckpt_"):
            return await self._checkpoint(op, header, leases, fds, owned, request_fds)
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

    # -- checkpoints ----------------------------------------------------------------

    async def _checkpoint(
        self,
        op: str,
        header: dict[str, Any],
        leases: list[ChunkLease],
        fds: list[int],
        owned: list[int],
        request_fds: list[int],
    ) -> tuple[dict[str, Any], bytes]:
        store = self.checkpoints
        if store is None:
            raise ChunkdError("this daemon serves no checkpoints")
        try:
            return await self._checkpoint_op(store, op, header, leases, fds, owned, request_fds)
        except ProtocolError as exc:  # a bad checkpoint request is answered, not dropped
            raise CheckpointError(f"malformed {op} request: {exc}") from None

    async def _checkpoint_op(
        self,
        store: Checkpoints,
        op: str,
        header: dict[str, Any],
        leases: list[ChunkLease],
        fds: list[int],
        owned: list[int],
        request_fds: list[int],
    ) -> tuple[dict[str, Any], bytes]:
        if op == "ckpt_save":
            return await self._save(store, header, request_fds), b""
        if op == "ckpt_wait":
            job = await store.wait(
                str(header.get("job")),
                Durability.parse(header.get("level", "remote")),
                min(_number(header.get("timeout"), "timeout"), _WAIT_SLICE),
            )
            if job.error is not None:
                return _error(job.error) | {"job": job.describe()}, b""
            return {"ok": True} | job.describe(), b""
        if op == "ckpt_commit":
            extra: dict[str, Any] = {}
            if request_fds:
                extra = await asyncio.to_thread(_load_json_fd, request_fds[0])
                if not isinstance(extra, dict):
                    raise ProtocolError("ckpt_commit's fd must hold a JSON object")
            manifest_id = await store.commit(
                str(header.get("name")),
                str(header.get("save_id")),
                int(_number(header.get("world_size"), "world_size")),
                bool(header.get("overwrite", False)),
                extra,
            )
            return {"ok": True, "manifest_id": manifest_id}, b""
        if op == "ckpt_manifest":
            manifest = await store.manifest(str(header.get("name")))
            fd = await asyncio.to_thread(
                seal_memfd, memoryview(json.dumps(manifest, separators=(",", ":")).encode())
            )
            owned.append(fd)
            fds.append(fd)
            return {"ok": True, "fds": 1}, b""
        if op == "ckpt_chunks":
            return await self._checkpoint_chunks(store, header, leases, fds, owned), b""
        if op == "ckpt_list":
            entries = await store.entries(str(header.get("prefix", "")))
            return {"ok": True}, json.dumps(entries).encode()
        if op == "ckpt_delete":
            return {"ok": True, "removed": await store.delete(str(header.get("name")))}, b""
        if op == "ckpt_gc":
            keep = header.get("keep_last")
            report = await store.gc(
                str(header.get("target", "")),
                keep_last=None if keep is None else int(_number(keep, "keep_last")),
                grace=_number(header.get("grace", 3600), "grace"),
                dry_run=bool(header.get("dry_run", False)),
            )
            return {"ok": True}, json.dumps(report).encode()
        raise ProtocolError(f"unknown op {op!r}")

    async def _save(
        self, store: Checkpoints, header: dict[str, Any], request_fds: list[int]
    ) -> dict[str, Any]:
        if len(request_fds) != 2:
            raise ProtocolError("ckpt_save carries two fds: the layout and the staged bytes")
        layout_fd, data_fd = request_fds
        layout = await asyncio.to_thread(_load_json_fd, layout_fd)
        backend, path = checkpoint_name(header.get("name"))
        if not isinstance(layout, dict):
            raise ProtocolError("ckpt_save's layout must be a JSON object")
        request = SaveRequest.from_json(
            {k: header.get(k) for k in _SAVE_FIELDS if header.get(k) is not None}
            | {"backend": backend, "path": path}
            | {"segments": layout.get("segments"), "tree": layout.get("tree")}
        )
        size = _sealed_size(data_fd)
        # An empty state still gets a mapping (mmap cannot map 0 bytes of a file).
        data = mmap.mmap(data_fd, size, prot=mmap.PROT_READ) if size else mmap.mmap(-1, 1)
        try:
            job = await store.save(request, data, size)
        except BaseException:
            data.close()
            raise
        return {"ok": True} | job.describe()

    async def _checkpoint_chunks(
        self,
        store: Checkpoints,
        header: dict[str, Any],
        leases: list[ChunkLease],
        fds: list[int],
        owned: list[int],
    ) -> dict[str, Any]:
        ids = header.get("ids")
        if not isinstance(ids, list) or len(ids) > MAX_FDS:
            raise ProtocolError(f"ckpt_chunks wants 'ids': a list of at most {MAX_FDS} chunk ids")
        backend = str(header.get("backend"))
        wanted = [ChunkId.parse(str(i)) for i in ids]
        got = await asyncio.gather(
            *(store.chunk(backend, c) for c in wanted), return_exceptions=True
        )
        leases.extend(g for g in got if isinstance(g, ChunkLease))
        for outcome in got:
            if isinstance(outcome, BaseException):
                raise outcome
        sizes = []
        for lease in leases:
            fd = lease.fileno()
            if fd is None:
                fd = await seal_memfd_off_loop(lease.view())
                owned.append(fd)
            fds.append(fd)
            sizes.append(lease.size)
        return {"ok": True, "sizes": sizes}

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


_CKPT_OPS: Final = frozenset(
    {
        "ckpt_save",
        "ckpt_wait",
        "ckpt_commit",
        "ckpt_manifest",
        "ckpt_chunks",
        "ckpt_list",
        "ckpt_delete",
        "ckpt_gc",
    }
)
_OPS: Final = frozenset({"hello", "stat", "read", "list", "prefetch"}) | _CKPT_OPS
_FD_OPS: Final = frozenset({"ckpt_save", "ckpt_commit"})
_SAVE_FIELDS: Final = (
    "save_id",
    "rank",
    "world_size",
    "durability",
    "overwrite",
    "commit",
    "step",
)


def _error(exc: ChunkdError) -> dict[str, Any]:
    out = {
        "ok": False,
        "error": type(exc).__name__,
        "status": http_status(exc),
        "message": str(exc),
    }
    chunk = getattr(exc, "chunk_id", None)
    if chunk is not None:
        out["chunk"] = chunk
    return out


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ProtocolError(f"{what} must be a number >= 0; got {value!r}")
    return float(value)


def _sealed_size(fd: int) -> int:
    """The size of a memfd sealed against writes and resizes; ProtocolError otherwise."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ProtocolError("a checkpoint fd must be a memfd") from None
    if seals & _REQUIRED_SEALS != _REQUIRED_SEALS:
        raise ProtocolError(
            "a checkpoint fd must be sealed (F_SEAL_WRITE, F_SEAL_SHRINK, F_SEAL_GROW): "
            "its bytes could otherwise change after they were hashed"
        )
    return os.fstat(fd).st_size


def _load_json_fd(fd: int) -> Any:
    size = _sealed_size(fd)
    if size > _MAX_LAYOUT:
        raise ProtocolError(f"a JSON fd of {size} bytes exceeds {_MAX_LAYOUT}")
    raw = os.pread(fd, size, 0)
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ProtocolError(f"a JSON fd does not hold JSON: {exc}") from None


def _no_payload(length: int) -> None:
    if length:
        raise ProtocolError("requests carry no payload")


async def _readable(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(conn.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(conn.fileno())


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


async def _recv_prefix(conn: socket.socket) -> tuple[bytes | None, list[int]]:
    """A frame's 8-byte prefix and the fds on its first byte (None at a clean EOF)."""
    loop = asyncio.get_running_loop()
    space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    while True:
        try:
            data, ancillary, flags, _ = conn.recvmsg(PREFIX.size, space)
        except BlockingIOError:
            await _readable(loop, conn)
            continue
        break
    fds: list[int] = []
    for level, kind, raw in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(raw[: len(raw) - len(raw) % got.itemsize])
            fds.extend(got)
    if flags & socket.MSG_CTRUNC:
        _close_all(fds)
        raise ProtocolError(f"more than {MAX_FDS} fds came with a request")
    if not data:
        return None, fds
    if len(data) < PREFIX.size:
        try:
            rest = await _recv_exact(conn, PREFIX.size - len(data), eof_ok=False)
        except BaseException:
            _close_all(fds)
            raise
        assert rest is not None
        data += rest
    return data, fds


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
