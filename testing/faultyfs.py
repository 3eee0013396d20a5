"""A disk that fails on command: a FUSE passthrough with injected EIO, ENOSPC and stalls.

:class:`FaultyDisk` mounts a backing directory at a mount point through a FUSE server
that runs in a subprocess of its own (so a daemon that reads the mount is never the
server that answers it), passes every operation through to the backing directory,
and on command from the test process makes the disk fail:

* :meth:`FaultyDisk.fail_reads`: every ``read`` answers an errno (``EIO`` by default);
* :meth:`FaultyDisk.fail_writes`: every change (``write``, ``fsync``, ``create``,
  ``mkdir``, ``rename``) answers an errno: ``EIO``, or ``ENOSPC`` for a full disk;
* :meth:`FaultyDisk.stall`: every read and/or change blocks until :meth:`unstall`
  (a stalled NVMe: the caller's thread sits in ``read(2)`` and cannot be cancelled);
* :meth:`FaultyDisk.slow`: every read and/or change first sleeps N seconds;
* :meth:`FaultyDisk.heal`: all of it off; stalled operations go on.

Lookups, ``getattr``, ``open``, ``readdir`` and ``statfs`` are never failed: a kernel
answers those from its caches while the device is gone. Files are opened with
``direct_io``, so every read and write reaches the server (and its faults), as they
reach a device, whatever the page cache holds; lmdb's files (``*.mdb``) are the
exception, because lmdb maps them and a mapping needs the page cache: their pages
are read from the server once, then from the cache while the kernel keeps them, and
their writes land in the page cache and are written back later (the writeback cache),
as on a block device: a stall then blocks writeback and ``fsync``, not each
``write(2)`` with its pages locked, which would block readers of those pages too.

The control channel is a Unix socket beside the mount (one JSON line each way), so
commands never pass through the file system they change. :meth:`FaultyDisk.counts`
says what the server saw: reads, writes, failed operations, stalled ones.

Why pyfuse3: ``python -m bench.fuse_pick`` mounts one passthrough on each candidate
and writes (with fdatasync) then reads back 32 files of 4 MiB through it, median of
three rounds, on the 2-core development machine (MB/s; ``direct`` is the backing
directory itself, whose fdatasync costs more than the one FUSE forwards)::

                write+fdatasync   read
    direct                 348     911
    fusepy                  90     636   (ctypes, libfuse 2; unmaintained since 2018)
    mfusepy                659     686   (ctypes, libfuse 3)
    pyfuse3                679     731   (Cython, libfuse 3, asyncio)

pyfuse3 is the fastest of the three and the only one that is async: a stalled
operation is a coroutine awaiting an event, not one of libfuse's worker threads, so
a test can stall any number of operations without the server running out of threads
to answer the lookups and ``getattr`` calls that must keep working. It needs
libfuse 3 (Debian: ``fuse3``, and ``libfuse3-dev`` to build it; ``make tools``
installs both), ``/dev/fuse`` and root; :func:`unavailable` says which is missing.

Run ``python -m chunkd.testing.faultyfs BACKING MOUNT CONTROL`` to serve by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, ParamSpec, Self, TypeVar

if TYPE_CHECKING:
    import asyncio

__all__ = ["FaultCounts", "FaultyDisk", "unavailable"]

T = TypeVar("T")
P = ParamSpec("P")


def unavailable() -> str | None:
    """Why a :class:`FaultyDisk` cannot be mounted here, or ``None`` when it can."""
    if os.geteuid() != 0:
        return "mounting a FUSE file system needs root"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (a container without the FUSE device)"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (Debian package fuse3; `make tools` installs it)"
    try:
        import pyfuse3  # noqa: F401
    except ImportError as exc:
        return f"pyfuse3 is not installed ({exc}; it is in the dev extras, needs libfuse3-dev)"
    return None


@dataclass(frozen=True)
class FaultCounts:
    """What the server has seen since it started."""

    #: ``read`` calls that reached the server
    reads: int
    #: changes (``write``, ``fsync``, ``create``, ``mkdir``, ``rename``, ``unlink``)
    writes: int
    #: operations answered with an injected errno
    failed: int
    #: operations blocked by a stall right now
    stalled: int
    #: operations a stall has blocked in all
    stalled_total: int


class FaultyDisk:
    """A FUSE mount of ``backing`` at ``mount`` that fails on command. Use :meth:`start`.

    As a context manager it unmounts on exit (healing first, so that no caller is
    left blocked in a stalled operation).
    """

    def __init__(
        self, backing: Path, mount: Path, control: Path, process: subprocess.Popen[bytes]
    ) -> None:
        self.backing = backing
        self.mount = mount
        self.control = control
        self.process = process

    @classmethod
    def start(
        cls, backing: str | Path, mount: str | Path, *, log: str | Path | None = None
    ) -> FaultyDisk:
        """Mount ``backing`` at ``mount`` (both created if missing) and wait until it serves.

        Args:
            backing: the directory that holds the files.
            mount: the empty directory to mount over.
            log: where the server writes its log (discarded by default).

        Raises:
            RuntimeError: FUSE is not usable here (see :func:`unavailable`) or the
                server did not mount within 20 seconds (its log says why).
        """
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(f"cannot mount a faulty disk at {mount}: {reason}")
        backing, mount = Path(backing).absolute(), Path(mount).absolute()
        backing.mkdir(parents=True, exist_ok=True)
        mount.mkdir(parents=True, exist_ok=True)
        control = mount.parent / f".{mount.name}.faultyfs.sock"
        control.unlink(missing_ok=True)
        sink = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "chunkd.testing.faultyfs",
                    str(backing),
                    str(mount),
                    str(control),
                ],
                stdout=sink,
                stderr=sink,
            )
        finally:
            if log is not None:
                sink.close()  # type: ignore[union-attr]
        disk = cls(backing, mount, control, process)
        deadline = time.monotonic() + 20
        while not (_mounted(mount) and control.exists()):
            if process.poll() is not None or time.monotonic() > deadline:
                disk.stop()
                raise RuntimeError(
                    f"the faulty disk at {mount} did not mount in 20 s (server exit "
                    f"{process.returncode}); see its log ({log or 'pass log= to keep one'})"
                )
            time.sleep(0.02)
        return disk

    # -- commands ---------------------------------------------------------------------

    def fail_reads(self, code: int = errno.EIO) -> None:
        """Answer every read with ``code`` (``0``: reads work again)."""
        self._send({"read_errno": code})

    def fail_writes(self, code: int = errno.EIO) -> None:
        """Answer every change with ``code``: ``EIO``, ``ENOSPC`` (``0``: writes work again)."""
        self._send({"write_errno": code})

    def stall(self, *, reads: bool = True, writes: bool = True) -> None:
        """Block every read and/or change until :meth:`unstall` or :meth:`heal`."""
        self._send({"stall_reads": reads, "stall_writes": writes})

    def unstall(self) -> None:
        """Let stalled operations, and every one after them, go on."""
        self._send({"stall_reads": False, "stall_writes": False})

    def slow(self, seconds: float, *, reads: bool = True, writes: bool = True) -> None:
        """Make every read and/or change sleep ``seconds`` first (``0``: no delay)."""
        self._send({"delay": seconds, "delay_reads": reads, "delay_writes": writes})

    def heal(self) -> None:
        """Turn every fault off; stalled operations go on."""
        self._send(
            {
                "read_errno": 0,
                "write_errno": 0,
                "stall_reads": False,
                "stall_writes": False,
                "delay": 0,
            }
        )

    def counts(self) -> FaultCounts:
        """What the server has seen."""
        return FaultCounts(**self._send({}))

    # -- lifecycle --------------------------------------------------------------------

    def stop(self) -> None:
        """Heal, unmount (lazily if something still holds the mount) and end the server."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError, RuntimeError):
                self.heal()
        if _mounted(self.mount):
            done = subprocess.run(
                ["fusermount3", "-u", str(self.mount)], capture_output=True, check=False
            )
            if done.returncode != 0:
                subprocess.run(
                    ["fusermount3", "-u", "-z", str(self.mount)], capture_output=True, check=False
                )
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.control.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _send(self, settings: dict[str, Any]) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(10)
            try:
                conn.connect(str(self.control))
                conn.sendall(json.dumps(settings).encode() + b"\n")
                reply = conn.makefile("rb").readline()
            except OSError as exc:
                raise RuntimeError(
                    f"the faulty disk at {self.mount} did not answer its control socket "
                    f"{self.control} ({exc}); is its server (pid {self.process.pid}) alive?"
                ) from exc
        answer: dict[str, Any] = json.loads(reply)
        return answer


def _mounted(mount: Path) -> bool:
    with open("/proc/self/mounts") as table:
        return any(line.split()[1] == str(mount) for line in table)


# -- the server (runs in its own process) -----------------------------------------------


class _Faults:
    """The server's fault settings and counters, changed by the control socket."""

    def __init__(self) -> None:
        import asyncio

        self.read_errno = 0
        self.write_errno = 0
        self.delay = 0.0
        self.delay_reads = True
        self.delay_writes = True
        self.reads_flow = asyncio.Event()
        self.writes_flow = asyncio.Event()
        self.reads_flow.set()
        self.writes_flow.set()
        self.counts = {"reads": 0, "writes": 0, "failed": 0, "stalled": 0, "stalled_total": 0}

    def apply(self, settings: dict[str, Any]) -> None:
        for key in ("read_errno", "write_errno"):
            if key in settings:
                setattr(self, key, int(settings[key]))
        if "delay" in settings:
            self.delay = float(settings["delay"])
            self.delay_reads = bool(settings.get("delay_reads", True))
            self.delay_writes = bool(settings.get("delay_writes", True))
        for key, flow in (("stall_reads", self.reads_flow), ("stall_writes", self.writes_flow)):
            if key in settings:
                flow.clear() if settings[key] else flow.set()

    async def gate(self, write: bool, fails: bool = True) -> None:
        """What an operation meets before it reaches the backing directory."""
        import asyncio

        import pyfuse3

        self.counts["writes" if write else "reads"] += 1
        flow = self.writes_flow if write else self.reads_flow
        if not flow.is_set():
            self.counts["stalled"] += 1
            self.counts["stalled_total"] += 1
            try:
                await flow.wait()
            finally:
                self.counts["stalled"] -= 1
        if self.delay > 0 and (self.delay_writes if write else self.delay_reads):
            await asyncio.sleep(self.delay)
        code = self.write_errno if write else self.read_errno
        if code and fails:
            self.counts["failed"] += 1
            raise pyfuse3.FUSEError(code)


def _serve(backing: Path, mount: Path, control: Path) -> None:
    import asyncio
    import signal

    import pyfuse3
    import pyfuse3.asyncio

    def passes_errno(
        fn: Callable[P, Coroutine[Any, Any, T]],
    ) -> Callable[P, Coroutine[Any, Any, T]]:
        # The kernel is told the backing file system's errno, as a passthrough must.
        @functools.wraps(fn)
        async def wrapped(*args: P.args, **kwargs: P.kwargs) -> T:
            try:
                return await fn(*args, **kwargs)
            except OSError as exc:
                raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None

        return wrapped

    class Passthrough(pyfuse3.Operations):
        """Inode numbers are the backing files' own (the root's is ROOT_INODE)."""

        # Writes to files with the page cache (lmdb's) land in it and are written
        # back later, as on a block device: a stalled disk then stalls writeback and
        # fsync, not every write(2) with its pages locked (which a device never does).
        enable_writeback_cache = True

        def __init__(self, root: Path, faults: _Faults) -> None:
            super().__init__()
            self.faults = faults
            self.paths: dict[int, str] = {pyfuse3.ROOT_INODE: str(root)}
            self.root_ino = os.lstat(root).st_ino

        def _attr(self, path: str) -> pyfuse3.EntryAttributes:
            st = os.lstat(path)
            ino = pyfuse3.ROOT_INODE if st.st_ino == self.root_ino else st.st_ino
            self.paths[ino] = path
            entry = pyfuse3.EntryAttributes()
            entry.st_ino = ino
            entry.st_mode, entry.st_nlink = st.st_mode, st.st_nlink
            entry.st_uid, entry.st_gid, entry.st_rdev = st.st_uid, st.st_gid, st.st_rdev
            entry.st_size, entry.st_blksize, entry.st_blocks = (
                st.st_size,
                st.st_blksize,
                st.st_blocks,
            )
            entry.st_atime_ns, entry.st_mtime_ns = st.st_atime_ns, st.st_mtime_ns
            entry.st_ctime_ns = st.st_ctime_ns
            entry.entry_timeout = entry.attr_timeout = 1
            return entry

        def _join(self, parent: int, name: bytes) -> str:
            return os.path.join(self.paths[parent], os.fsdecode(name))

        @passes_errno
        async def lookup(self, parent: int, name: bytes, ctx: Any = None) -> Any:
            return self._attr(self._join(parent, name))

        @passes_errno
        async def getattr(self, inode: int, ctx: Any = None) -> Any:
            return self._attr(self.paths[inode])

        @passes_errno
        async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> Any:
            path = self.paths[inode]
            if fields.update_size:
                await self.faults.gate(write=True)
                if fh is not None:
                    os.ftruncate(fh, attr.st_size)
                else:
                    os.truncate(path, attr.st_size)
            if fields.update_mode:
                os.chmod(path, attr.st_mode & 0o7777)
            if fields.update_atime or fields.update_mtime:
                os.utime(path, ns=(attr.st_atime_ns, attr.st_mtime_ns))
            return self._attr(path)

        @passes_errno
        async def opendir(self, inode: int, ctx: Any) -> int:
            return inode

        @passes_errno
        async def readdir(self, inode: int, start: int, token: Any) -> None:
            names = sorted(os.listdir(self.paths[inode]))
            for offset, name in enumerate(names[start:], start + 1):
                attr = self._attr(os.path.join(self.paths[inode], name))
                if not pyfuse3.readdir_reply(token, os.fsencode(name), attr, offset):
                    break

        async def releasedir(self, fh: int) -> None:
            pass

        @passes_errno
        async def mkdir(self, parent: int, name: bytes, mode: int, ctx: Any) -> Any:
            await self.faults.gate(write=True)
            path = self._join(parent, name)
            os.mkdir(path, mode)
            return self._attr(path)

        @passes_errno
        async def rmdir(self, parent: int, name: bytes, ctx: Any) -> None:
            await self.faults.gate(write=True, fails=False)
            os.rmdir(self._join(parent, name))

        @passes_errno
        async def unlink(self, parent: int, name: bytes, ctx: Any) -> None:
            # A full or failing disk still frees space: an unlink stalls, never fails.
            await self.faults.gate(write=True, fails=False)
            os.unlink(self._join(parent, name))

        @passes_errno
        async def rename(
            self, old_parent: int, old: bytes, new_parent: int, new: bytes, flags: int, ctx: Any
        ) -> None:
            await self.faults.gate(write=True)
            target = self._join(new_parent, new)
            os.rename(self._join(old_parent, old), target)
            self.paths[os.lstat(target).st_ino] = target

        def _info(self, path: str, fd: int) -> pyfuse3.FileInfo:
            # direct_io: every read and write of the file reaches the server, as they
            # reach a device. lmdb's files map their pages, which needs the page cache.
            return pyfuse3.FileInfo(fh=fd, direct_io=not path.endswith(".mdb"))

        @staticmethod
        def _flags(flags: int) -> int:
            # With the writeback cache the kernel reads pages of write-only files and
            # does appends itself.
            if flags & os.O_ACCMODE == os.O_WRONLY:
                flags = (flags & ~os.O_ACCMODE) | os.O_RDWR
            return flags & ~os.O_APPEND

        @passes_errno
        async def open(self, inode: int, flags: int, ctx: Any) -> Any:
            path = self.paths[inode]
            return self._info(path, os.open(path, self._flags(flags) & ~os.O_CREAT))

        @passes_errno
        async def create(self, parent: int, name: bytes, mode: int, flags: int, ctx: Any) -> Any:
            await self.faults.gate(write=True)
            path = self._join(parent, name)
            fd = os.open(path, self._flags(flags) | os.O_CREAT, mode)
            return self._info(path, fd), self._attr(path)

        @passes_errno
        async def read(self, fh: int, off: int, size: int) -> bytes:
            await self.faults.gate(write=False)
            return os.pread(fh, size, off)

        @passes_errno
        async def write(self, fh: int, off: int, buf: bytes) -> int:
            await self.faults.gate(write=True)
            return os.pwrite(fh, buf, off)

        async def flush(self, fh: int) -> None:
            pass

        @passes_errno
        async def release(self, fh: int) -> None:
            os.close(fh)

        @passes_errno
        async def fsync(self, fh: int, datasync: bool) -> None:
            await self.faults.gate(write=True)
            if datasync:
                os.fdatasync(fh)
            else:
                os.fsync(fh)

        async def fsyncdir(self, fh: int, datasync: bool) -> None:
            pass

        @passes_errno
        async def statfs(self, ctx: Any) -> Any:
            st = os.statvfs(self.paths[pyfuse3.ROOT_INODE])
            out = pyfuse3.StatvfsData()
            out.f_bsize, out.f_frsize, out.f_namemax = st.f_bsize, st.f_frsize, st.f_namemax
            out.f_blocks, out.f_bfree, out.f_bavail = st.f_blocks, st.f_bfree, st.f_bavail
            out.f_files, out.f_ffree, out.f_favail = st.f_files, st.f_ffree, st.f_favail
            return out

        async def forget(self, inode_list: Any) -> None:
            pass  # paths stay known: a test mounts a few thousand files at most

    async def control_session(
        faults: _Faults, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            line = await reader.readline()
            if line:
                faults.apply(json.loads(line))
                writer.write(json.dumps(faults.counts).encode() + b"\n")
                await writer.drain()
        finally:
            writer.close()

    async def main() -> None:
        faults = _Faults()
        pyfuse3.init(
            Passthrough(backing, faults),
            str(mount),
            set(pyfuse3.default_options) | {"fsname=faultyfs"},
        )
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, pyfuse3.terminate)
        loop.add_signal_handler(signal.SIGINT, pyfuse3.terminate)
        server = await asyncio.start_unix_server(
            lambda r, w: control_session(faults, r, w), path=str(control)
        )
        try:
            await pyfuse3.main(max_tasks=256)
        finally:
            server.close()
            faults.reads_flow.set()
            faults.writes_flow.set()

    pyfuse3.asyncio.enable()
    try:
        asyncio.run(main())
    finally:
        pyfuse3.close(unmount=True)
        control.unlink(missing_ok=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Serve a faulty disk (see the module docstring).")
    parser.add_argument("backing", type=Path)
    parser.add_argument("mount", type=Path)
    parser.add_argument("control", type=Path, help="the control socket to listen on")
    args = parser.parse_args()
    _serve(args.backing, args.mount, args.control)
