"""Which FUSE library the failing-disk kit is built on: plain passthroughs, measured.

``chunkd.testing.faultyfs`` puts a FUSE passthrough under a daemon's disk tier. This
script mounts the same minimal passthrough written against each candidate library,
in a server process of its own, and times writing and reading back 4 MiB files
through it (the disk tier's chunk size) against the backing directory itself:

* ``fusepy`` (ctypes, libfuse 2, high-level path API, multi-threaded);
* ``mfusepy`` (its maintained fork, ctypes, here on libfuse 3);
* ``pyfuse3`` (Cython, libfuse 3, low-level inode API, async on asyncio).

Run as root with /dev/fuse: ``python -m bench.fuse_pick [--files 32] [--rounds 3]``.
The figures the pick rests on are in chunkd.testing.faultyfs's docstring.
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
FILE = 4 * MiB
KINDS = ("fusepy", "mfusepy", "pyfuse3")


# -- the passthroughs (run in the server process) ---------------------------------------


def serve_highlevel(module: str, backing: str, mount: str) -> None:
    """The path-based passthrough, for fusepy and mfusepy (one API, two libraries)."""
    if module == "mfusepy":
        os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")
    fuse = __import__("fuse" if module == "fusepy" else "mfusepy")

    class Passthrough(fuse.Operations):  # type: ignore[misc, name-defined]
        def __init__(self, root: str) -> None:
            self.root = root

        def _p(self, path: str) -> str:
            return self.root + path

        def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
            st = os.lstat(self._p(path))
            keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime")
            out = {k: getattr(st, k) for k in keys}
            out.update(st_mtime=st.st_mtime, st_ctime=st.st_ctime)
            return out

        def readdir(self, path: str, fh: Any) -> list[str]:
            return [".", "..", *os.listdir(self._p(path))]

        def mkdir(self, path: str, mode: int) -> None:
            os.mkdir(self._p(path), mode)

        def rmdir(self, path: str) -> None:
            os.rmdir(self._p(path))

        def unlink(self, path: str) -> None:
            os.unlink(self._p(path))

        def rename(self, old: str, new: str) -> None:
            os.rename(self._p(old), self._p(new))

        def truncate(self, path: str, length: int, fh: Any = None) -> None:
            os.truncate(self._p(path), length)

        def chmod(self, path: str, mode: int) -> None:
            os.chmod(self._p(path), mode)

        def utimens(self, path: str, times: Any = None) -> None:
            os.utime(self._p(path), times)

        def statfs(self, path: str) -> dict[str, Any]:
            st = os.statvfs(self._p(path))
            keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_frsize", "f_namemax")
            return {k: getattr(st, k) for k in keys}

        def open(self, path: str, flags: int) -> int:
            return os.open(self._p(path), flags)

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            return os.open(self._p(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            return os.pread(fh, size, offset)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            return os.pwrite(fh, data, offset)

        def flush(self, path: str, fh: int) -> None:
            pass

        def release(self, path: str, fh: int) -> None:
            os.close(fh)

        def fsync(self, path: str, datasync: int, fh: int) -> None:
            os.fdatasync(fh) if datasync else os.fsync(fh)

    fuse.FUSE(Passthrough(backing), mount, foreground=True, nothreads=False)


def serve_pyfuse3(backing: str, mount: str) -> None:
    """The inode-based passthrough on pyfuse3, run on asyncio."""
    import asyncio

    import pyfuse3
    import pyfuse3.asyncio

    class Passthrough(pyfuse3.Operations):
        def __init__(self, root: str) -> None:
            super().__init__()
            self.paths: dict[int, str] = {pyfuse3.ROOT_INODE: root}
            self.root_ino = os.lstat(root).st_ino

        def _attr(self, path: str) -> pyfuse3.EntryAttributes:
            st = os.lstat(path)
            ino = pyfuse3.ROOT_INODE if st.st_ino == self.root_ino else st.st_ino
            self.paths.setdefault(ino, path)
            entry = pyfuse3.EntryAttributes()
            for name in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size"):
                setattr(entry, name, getattr(st, name))
            entry.st_ino = ino
            entry.st_blksize, entry.st_blocks = st.st_blksize, st.st_blocks
            entry.st_atime_ns, entry.st_mtime_ns = st.st_atime_ns, st.st_mtime_ns
            entry.st_ctime_ns = st.st_ctime_ns
            entry.entry_timeout = entry.attr_timeout = 1
            return entry

        def _join(self, parent: int, name: bytes) -> str:
            return os.path.join(self.paths[parent], os.fsdecode(name))

        async def lookup(self, parent: int, name: bytes, ctx: Any = None) -> Any:
            try:
                return self._attr(self._join(parent, name))
            except OSError as exc:
                raise pyfuse3.FUSEError(exc.errno) from None

        async def getattr(self, inode: int, ctx: Any = None) -> Any:
            return self._attr(self.paths[inode])

        async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> Any:
            path = self.paths[inode]
            if fields.update_size:
                os.truncate(path, attr.st_size)
            if fields.update_mode:
                os.chmod(path, attr.st_mode & 0o7777)
            return self._attr(path)

        async def opendir(self, inode: int, ctx: Any) -> int:
            return inode

        async def readdir(self, inode: int, start: int, token: Any) -> None:
            names = sorted(os.listdir(self.paths[inode]))
            for i, name in enumerate(names[start:], start + 1):
                attr = self._attr(os.path.join(self.paths[inode], name))
                if not pyfuse3.readdir_reply(token, os.fsencode(name), attr, i):
                    break

        async def releasedir(self, fh: int) -> None:
            pass

        async def mkdir(self, parent: int, name: bytes, mode: int, ctx: Any) -> Any:
            path = self._join(parent, name)
            os.mkdir(path, mode)
            return self._attr(path)

        async def rmdir(self, parent: int, name: bytes, ctx: Any) -> None:
            os.rmdir(self._join(parent, name))

        async def unlink(self, parent: int, name: bytes, ctx: Any) -> None:
            os.unlink(self._join(parent, name))

        async def rename(
            self, p0: int, n0: bytes, p1: int, n1: bytes, flags: int, ctx: Any
        ) -> None:
            old, new = self._join(p0, n0), self._join(p1, n1)
            os.rename(old, new)
            ino = os.lstat(new).st_ino
            self.paths[ino] = new

        async def open(self, inode: int, flags: int, ctx: Any) -> Any:
            return pyfuse3.FileInfo(fh=os.open(self.paths[inode], flags & ~os.O_CREAT))

        async def create(self, parent: int, name: bytes, mode: int, flags: int, ctx: Any) -> Any:
            path = self._join(parent, name)
            fd = os.open(path, flags | os.O_CREAT, mode)
            return pyfuse3.FileInfo(fh=fd), self._attr(path)

        async def read(self, fh: int, off: int, size: int) -> bytes:
            return os.pread(fh, size, off)

        async def write(self, fh: int, off: int, buf: bytes) -> int:
            return os.pwrite(fh, buf, off)

        async def flush(self, fh: int) -> None:
            pass

        async def release(self, fh: int) -> None:
            os.close(fh)

        async def fsync(self, fh: int, datasync: bool) -> None:
            os.fdatasync(fh) if datasync else os.fsync(fh)

        async def statfs(self, ctx: Any) -> Any:
            st = os.statvfs(self.paths[pyfuse3.ROOT_INODE])
            out = pyfuse3.StatvfsData()
            for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_namemax"):
                setattr(out, name, getattr(st, name))
            return out

        async def forget(self, inodes: Any) -> None:
            pass

    options = set(pyfuse3.default_options)
    options.add("fsname=fusepick")
    pyfuse3.init(Passthrough(backing), mount, options)
    pyfuse3.asyncio.enable()
    try:
        asyncio.run(pyfuse3.main())
    finally:
        pyfuse3.close(unmount=True)


# -- the measurement (run in the bench process) -----------------------------------------


def _mounted(mount: Path) -> bool:
    with open("/proc/self/mounts") as table:
        return any(line.split()[1] == str(mount) for line in table)


def measure(directory: Path, files: int, payload: bytes) -> tuple[float, float]:
    """MB/s writing ``files`` 4 MiB files (fdatasync each) into ``directory``, then
    reading them back (each opened anew, as the disk tier does)."""
    paths = [directory / f"f{i}" for i in range(files)]
    start = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
        try:
            done = 0
            while done < len(payload):
                done += os.write(fd, payload[done:])
            os.fdatasync(fd)
        finally:
            os.close(fd)
    wrote = time.perf_counter() - start
    # Drop what the backing file system caches, so each side reads what the other did.
    subprocess.run(["sync"], check=False)
    Path("/proc/sys/vm/drop_caches").write_text("1") if os.access(
        "/proc/sys/vm/drop_caches", os.W_OK
    ) else None
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            got = f.readall()
        assert len(got) == FILE
    read = time.perf_counter() - start
    for path in paths:
        path.unlink()
    total = files * FILE / 1e6
    return total / wrote, total / read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", nargs=3, metavar=("KIND", "BACKING", "MOUNT"))
    args = parser.parse_args()
    if args.serve:
        kind, backing, mount = args.serve
        if kind == "pyfuse3":
            serve_pyfuse3(backing, mount)
        else:
            serve_highlevel(kind, backing, mount)
        return
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        sys.exit("needs root and /dev/fuse")
    payload = os.urandom(FILE)
    work = Path(tempfile.mkdtemp(prefix="fuse-pick-"))
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in ("direct", *KINDS)}
    try:
        for _ in range(args.rounds):
            plain = work / "plain"
            plain.mkdir(exist_ok=True)
            results["direct"].append(measure(plain, args.files, payload))
            for kind in KINDS:
                backing, mount = work / f"{kind}-back", work / f"{kind}-mnt"
                backing.mkdir(exist_ok=True)
                mount.mkdir(exist_ok=True)
                server = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "bench.fuse_pick",
                        "--serve",
                        kind,
                        str(backing),
                        str(mount),
                    ]
                )
                try:
                    deadline = time.monotonic() + 20
                    while not _mounted(mount):
                        if server.poll() is not None or time.monotonic() > deadline:
                            raise RuntimeError(f"{kind} did not mount")
                        time.sleep(0.05)
                    results[kind].append(measure(mount, args.files, payload))
                finally:
                    subprocess.run(["fusermount3", "-u", "-z", str(mount)], check=False)
                    subprocess.run(["fusermount", "-u", "-z", str(mount)], check=False)
                    server.wait(timeout=10)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.files} files of 4 MiB, median of {args.rounds} rounds (MB/s)")
    print(f"{'':10} {'write+fdatasync':>16} {'read':>10}")
    for kind, rows in results.items():
        w = statistics.median(r[0] for r in rows)
        r = statistics.median(r[1] for r in rows)
        print(f"{kind:10} {w:16.0f} {r:10.0f}")


if __name__ == "__main__":
    _ = errno  # the passthroughs raise OSError, which each library maps to its errno
    main()
