"""aiofiles against chunkd's own file I/O, side by side: same data, same machine, one run.

The design card names aiofiles; chunkd's disk tier runs its file I/O on its own bounded
workers instead (one hop per operation, admission on the loop, stall detection,
``O_DIRECT`` writes under a RAM tier), and the file backend reads through obstore's
``LocalStore`` (and one thread per batch for small first reads). This bench measures
whether aiofiles, which runs each file call (open, read, write, close, ...) in the
loop's default executor, would do better at the same jobs:

1. ``insert``: disk-tier inserts of 4 MiB and 64 KiB chunks, 1 and 16 in flight.
   chunkd: ``DiskTier.put`` with the daemon's fsync policy (``always``: fdatasync the
   file, rename, fsync its directory), once with direct writes (the daemon's setting
   under a RAM tier) and once buffered. aiofiles: the same writes (a temporary file
   opened ``O_EXCL``, written, fdatasync, closed, renamed into the same layout, the
   directory fsynced) and the same lmdb record. Compression is off on both sides (it is
   the tier's CPU policy, not its I/O; random data stays raw anyway).
2. ``read``: reading the chunks back verified (blake3 against the id), 1 and 16
   readers, page cache warm and cold. chunkd: ``DiskTier.get``. aiofiles: the record's
   lookup, open, read, close, and the hash in the default executor (hashing 4 MiB on
   the loop would stall it).
3. ``backend``: the ``file://`` backend's reads against aiofiles reads of the same
   files: whole 4 MiB objects, 64 KiB ranges (the backend pins the version: a stat and
   a checked read; the aiofiles side stats too), and the small first reads of many
   files that :meth:`FileBackend.read_batch` does in one thread. Rows marked "one-hop
   read" put aiofiles against that same one-thread path used for a single file, which
   the backend's ``get`` does not take today: what a faster ``get`` could use instead.

Each pair runs once untimed, then ``--rounds`` times (5 by default) with the order of
the two sides alternating; cold rounds drop the page cache (``echo 1 >
/proc/sys/vm/drop_caches``, root only; without it cold rows are skipped) before each
side. Figures: MB/s and operations/s, median and min-max over rounds, and chunkd's rate
over aiofiles' per round (paired), median and min-max.

Run: ``python -m bench.aiofiles_bench [--quick] [--rounds N] [--only GROUP]
[--work DIR] [--aiofiles-threads N] [--json FILE]``.

It is one job at ~660 lines: one question, whether aiofiles beats chunkd's own file I/O,
asked of three scenario groups (insert, read, backend) that share the chunks, the files,
the paired rounds and the rows' figures; it stands alone (no daemon, no
:mod:`bench.report`), run by hand for docs/design.md's package table.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import mmap
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.os
import blake3
import uvloop

from chunkd.cache import Chunk, ChunkId, ChunkRecord, DiskTier, Index
from chunkd.cache.index import Codec, TierSet
from chunkd.gateway.backends import make_backend
from chunkd.gateway.config import BackendConfig
from chunkd.gateway.metrics import Metrics
from chunkd.ranges import ByteRange

KiB = 1 << 10
MiB = 1 << 20
BIG = 4 * MiB
SMALL = 64 * KiB
GROUPS = ("insert", "read", "backend")

#: a side's timed part: (wall seconds, this process's CPU seconds, all threads)
Timed = Callable[[], Awaitable[tuple[float, float]]]


class _Clock:
    """Wall and process CPU time from its creation: CPU time is what the mechanism
    costs whatever else the shared machine runs; wall time includes waiting on fsyncs
    that other tenants' dirty pages slow down."""

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = time.process_time()

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


@dataclass
class Row:
    """One pair: each side's seconds per round for the same work."""

    group: str
    name: str
    nbytes: int
    ops: int
    cache: str  # "warm" / "cold" / "-" (writes)
    chunkd_side: str
    aiofiles_side: str
    chunkd_s: list[float] = field(default_factory=list)
    aiofiles_s: list[float] = field(default_factory=list)
    chunkd_cpu: list[float] = field(default_factory=list)
    aiofiles_cpu: list[float] = field(default_factory=list)

    def rates(self, side: str, amount: int) -> list[float]:
        """``amount`` per second of each round of ``side``."""
        return [amount / s for s in (self.chunkd_s if side == "chunkd" else self.aiofiles_s)]

    def ratios(self) -> list[float]:
        """chunkd's rate over aiofiles' of each round (same work, so a time ratio)."""
        return [a / c for c, a in zip(self.chunkd_s, self.aiofiles_s, strict=True)]

    def cpu_us_per_op(self, side: str) -> list[float]:
        """This process's CPU microseconds per operation, each round of ``side``."""
        cpu = self.chunkd_cpu if side == "chunkd" else self.aiofiles_cpu
        return [1e6 * c / self.ops for c in cpu]

    def as_json(self) -> dict[str, Any]:
        """Everything measured, for ``--json``."""
        return {
            "group": self.group,
            "name": self.name,
            "cache": self.cache,
            "bytes": self.nbytes,
            "ops": self.ops,
            "chunkd": self.chunkd_side,
            "aiofiles": self.aiofiles_side,
            "chunkd_s": self.chunkd_s,
            "aiofiles_s": self.aiofiles_s,
            "chunkd_cpu_s": self.chunkd_cpu,
            "aiofiles_cpu_s": self.aiofiles_cpu,
            "ratio": self.ratios(),
        }


def _spread(values: Sequence[float], scale: float = 1.0, digits: int = 0) -> str:
    med = statistics.median(values) / scale
    lo, hi = min(values) / scale, max(values) / scale
    return f"{med:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def _row_text(row: Row) -> str:
    return (
        f"| {row.name} | {row.cache} "
        f"| {_spread(row.rates('chunkd', row.nbytes), 1e6)} "
        f"| {_spread(row.rates('aiofiles', row.nbytes), 1e6)} "
        f"| {_spread(row.rates('chunkd', row.ops))} "
        f"| {_spread(row.rates('aiofiles', row.ops))} "
        f"| {_spread(row.ratios(), digits=2)} "
        f"| {_spread(row.cpu_us_per_op('chunkd'))} "
        f"| {_spread(row.cpu_us_per_op('aiofiles'))} |"
    )


HEADER = (
    "| scenario | page cache | chunkd MB/s | aiofiles MB/s | chunkd ops/s | aiofiles ops/s "
    "| chunkd/aiofiles | chunkd CPU us/op | aiofiles CPU us/op |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


# -- plumbing ----------------------------------------------------------------------------


def _aligned_payloads(count: int, size: int, seed: int) -> list[memoryview]:
    """Random chunks in page-aligned memory (anonymous mmap), as a RAM tier's sealed
    memfd pages are: only such a buffer can go to the disk with ``O_DIRECT``."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        region = mmap.mmap(-1, size)
        region[:] = rng.randbytes(size)
        out.append(memoryview(region))
    return out


def _can_drop_caches() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
    except OSError:
        return False
    return True


def _drop_caches() -> None:
    os.sync()  # only clean pages can be dropped
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1")


async def _bounded(concurrency: int, jobs: Sequence[Callable[[], Awaitable[Any]]]) -> None:
    """Run ``jobs`` with at most ``concurrency`` in flight (the same helper on both sides)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(job: Callable[[], Awaitable[Any]]) -> None:
        async with gate:
            await job()

    await asyncio.gather(*(one(job) for job in jobs))


async def _measure(row: Row, chunkd: Timed, aio: Timed, rounds: int) -> Row:
    """Both sides once untimed, then ``rounds`` times, alternating which goes first."""
    cold = row.cache == "cold"
    await chunkd()
    await aio()
    for i in range(rounds):
        sides = [("chunkd", chunkd), ("aiofiles", aio)]
        if i % 2:
            sides.reverse()
        for side, run in sides:
            if cold:
                _drop_caches()
            wall, cpu = await run()
            (row.chunkd_s if side == "chunkd" else row.aiofiles_s).append(wall)
            (row.chunkd_cpu if side == "chunkd" else row.aiofiles_cpu).append(cpu)
    print(_row_text(row), flush=True)
    return row


def _chunk_path(root: Path, cid: ChunkId) -> Path:
    """The disk tier's layout (``chunks/ab/cd/<id>``), for the aiofiles side."""
    hexid = cid.hex()
    return root / "chunks" / hexid[:2] / hexid[2:4] / hexid


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# aiofiles has no fsync of its own: its ``wrap`` runs any call in the default executor,
# which is how a user of aiofiles gets one.
_aio_fdatasync = aiofiles.os.wrap(os.fdatasync)
_aio_fsync_dir = aiofiles.os.wrap(_fsync_dir)


def _verify(cid: ChunkId, data: bytes) -> None:
    if blake3.blake3(data).digest() != cid:
        raise AssertionError(f"chunk {cid} read back wrong")


# -- 1. insert -----------------------------------------------------------------------------


async def _aio_put(root: Path, index: Index, name: str, chunk: Chunk) -> None:
    """What ``DiskTier._write`` does to the file system, each call through aiofiles."""
    if index.lookup(chunk.id) is not None:
        return
    final = _chunk_path(root, chunk.id)
    tmp = root / "tmp" / name
    # buffering=0: a FileIO, so the write is one write(2) of the caller's buffer
    async with aiofiles.open(tmp, "xb", buffering=0) as f:
        view = chunk.data
        while view.nbytes:
            view = view[await f.write(view) :]
        await _aio_fdatasync(f.fileno())
    try:
        await aiofiles.os.rename(tmp, final)
    except FileNotFoundError:
        await aiofiles.os.makedirs(final.parent, exist_ok=True)
        await _aio_fsync_dir(final.parent.parent)
        await _aio_fsync_dir(root / "chunks")
        await aiofiles.os.rename(tmp, final)
    await _aio_fsync_dir(final.parent)
    index.put_chunk(chunk.id, ChunkRecord(chunk.size, chunk.size, Codec.RAW, TierSet.DISK))


def _fresh_tier_dir(root: Path) -> Index:
    shutil.rmtree(root, ignore_errors=True)
    (root / "tmp").mkdir(parents=True)
    (root / "chunks").mkdir()
    return Index(root / "index", chunk_bytes=BIG, sync=True)  # as ChunkCache does


def _insert_sides(
    root: Path, chunks: list[Chunk], concurrency: int, direct: bool
) -> tuple[Timed, Timed]:
    """The timed part of each side's insert of ``chunks`` into an empty tier."""

    async def chunkd() -> tuple[float, float]:
        index = _fresh_tier_dir(root)
        tier = DiskTier(
            root,
            index,
            budget_bytes=4 * sum(c.size for c in chunks),
            fsync="always",
            compress=False,
            max_chunk_bytes=BIG,
            direct_writes=direct,
        )
        os.sync()  # nobody pays for the other's dirty pages
        clock = _Clock()
        await _bounded(concurrency, [functools.partial(tier.put, c) for c in chunks])
        took = clock.stop()
        await tier.close()
        index.close()
        return took

    async def aio() -> tuple[float, float]:
        index = _fresh_tier_dir(root)
        os.sync()
        clock = _Clock()
        await _bounded(
            concurrency,
            [functools.partial(_aio_put, root, index, f"aio.{n}", c) for n, c in enumerate(chunks)],
        )
        took = clock.stop()
        index.close()
        return took

    return chunkd, aio


async def insert(work: Path, rounds: int, quick: bool) -> list[Row]:
    rows = []
    root = work / "insert"
    for size, count, seed in ((BIG, 4 if quick else 16, 1), (SMALL, 32 if quick else 256, 2)):
        chunks = [Chunk.of(p) for p in _aligned_payloads(count, size, seed)]
        label = "4 MiB" if size == BIG else "64 KiB"
        for concurrency in (1, 16):
            for direct in (True, False):
                how = "O_DIRECT" if direct else "buffered"
                row = Row(
                    "insert",
                    f"insert {label} x{count}, {concurrency} in flight, fsync always "
                    f"(chunkd {how})",
                    size * count,
                    count,
                    "-",
                    f"DiskTier.put, direct_writes={direct}, 4 workers",
                    "aiofiles open/write/fdatasync/close/rename/fsync dir + lmdb record",
                )
                chunkd, aio = _insert_sides(root, chunks, concurrency, direct)
                rows.append(await _measure(row, chunkd, aio, rounds))
    shutil.rmtree(root, ignore_errors=True)
    return rows


# -- 2. read back, verified ---------------------------------------------------------------


async def _chunkd_get(tier: DiskTier, cid: ChunkId) -> None:
    lease = await tier.get(cid)
    assert lease is not None, "a chunk the bench wrote was not read back"
    lease.release()


async def _aio_get(root: Path, index: Index, cid: ChunkId) -> None:
    """What ``DiskTier.get`` does, the file calls through aiofiles."""
    record = index.lookup(cid)
    assert record is not None
    async with aiofiles.open(_chunk_path(root, cid), "rb") as f:
        data = await f.read()
    if len(data) != record.stored_size:
        raise AssertionError(f"chunk {cid} read back {len(data)} bytes")
    await asyncio.get_running_loop().run_in_executor(None, _verify, cid, data)
    index.touch(cid)


def _timed(concurrency: int, jobs: Sequence[Callable[[], Awaitable[Any]]]) -> Timed:
    async def run() -> tuple[float, float]:
        clock = _Clock()
        await _bounded(concurrency, jobs)
        return clock.stop()

    return run


async def read(work: Path, rounds: int, quick: bool, cold_ok: bool) -> list[Row]:
    rows = []
    root = work / "read"
    for size, count, seed in ((BIG, 4 if quick else 16, 3), (SMALL, 32 if quick else 256, 4)):
        chunks = [Chunk.of(p) for p in _aligned_payloads(count, size, seed)]
        label = "4 MiB" if size == BIG else "64 KiB"
        shutil.rmtree(root, ignore_errors=True)
        index = Index(root / "index", chunk_bytes=BIG, sync=False)
        tier = DiskTier(
            root,
            index,
            budget_bytes=4 * size * count,
            fsync="never",
            compress=False,
            max_chunk_bytes=BIG,
        )
        for chunk in chunks:
            assert await tier.put(chunk)
        index.flush()
        ids = [c.id for c in chunks]
        for concurrency in (1, 16):
            for cache in ("warm", "cold") if cold_ok else ("warm",):
                row = Row(
                    "read",
                    f"read {label} x{count} verified, {concurrency} readers",
                    size * count,
                    count,
                    cache,
                    "DiskTier.get (lookup, readv, blake3, 4 workers)",
                    "lookup, aiofiles open/read/close, blake3 in the default executor",
                )
                chunkd = _timed(concurrency, [functools.partial(_chunkd_get, tier, c) for c in ids])
                aio = _timed(
                    concurrency, [functools.partial(_aio_get, root, index, c) for c in ids]
                )
                rows.append(await _measure(row, chunkd, aio, rounds))
        await tier.close()
        index.close()
    shutil.rmtree(root, ignore_errors=True)
    return rows


# -- 3. the file backend's reads ----------------------------------------------------------


async def backend(work: Path, rounds: int, quick: bool, cold_ok: bool) -> list[Row]:
    rows = []
    data_dir = work / "backend"
    shutil.rmtree(data_dir, ignore_errors=True)
    rng = random.Random(5)
    big = [f"big/{n:03d}.bin" for n in range(4 if quick else 16)]
    small = [f"small/{n:04d}.bin" for n in range(64 if quick else 256)]
    for key in big:
        (data_dir / key).parent.mkdir(parents=True, exist_ok=True)
        (data_dir / key).write_bytes(rng.randbytes(BIG))
    for key in small:
        (data_dir / key).parent.mkdir(parents=True, exist_ok=True)
        (data_dir / key).write_bytes(rng.randbytes(256 * KiB))
    files = make_backend(BackendConfig(name="files", url=f"file://{data_dir}"), Metrics())
    # 64 KiB ranges at random 4 KiB-aligned offsets of the big files
    ranges = [
        (big[i % len(big)], rng.randrange(0, (BIG - SMALL) // 4096) * 4096)
        for i in range(64 if quick else 256)
    ]

    async def whole_chunkd(key: str) -> None:
        got = await files.get(key)
        assert got is not None
        assert got.nbytes == BIG

    async def whole_aio(key: str) -> None:
        async with aiofiles.open(data_dir / key, "rb") as f:
            got = await f.read()
        assert len(got) == BIG

    async def range_chunkd(key: str, start: int) -> None:
        got = await files.get(key, ByteRange(start, start + SMALL))
        assert got is not None
        assert got.nbytes == SMALL

    async def range_aio(key: str, start: int) -> None:
        path = data_dir / key
        await aiofiles.os.stat(path)  # the version a pinned read needs, as the backend's head
        async with aiofiles.open(path, "rb") as f:
            await f.seek(start)
            got = await f.read(SMALL)
        assert len(got) == SMALL

    async def aio_first(key: str) -> None:
        path = data_dir / key
        await aiofiles.os.stat(path)
        async with aiofiles.open(path, "rb") as f:
            got = await f.read(SMALL)
        assert len(got) == SMALL

    async def one_hop(key: str, start: int, end: int) -> None:
        # the backend's own one-thread read (open, fstat, pread, fstat, close) for one file
        got = await files.read_batch([(key, start, end)])
        assert got[0] is not None
        assert got[0][1] is not None
        assert len(got[0][1]) == end - start

    async def batch_chunkd() -> tuple[float, float]:
        # read_batch as a registration calls it: many files' first bytes in one call
        clock = _Clock()
        for i in range(0, len(small), 64):
            got = await files.read_batch([(key, 0, SMALL) for key in small[i : i + 64]])
            assert all(one is not None and one[1] is not None for one in got)
        return clock.stop()

    try:
        for concurrency in (1, 16):
            for cache in ("warm", "cold") if cold_ok else ("warm",):
                row = Row(
                    "backend",
                    f"file backend whole 4 MiB x{len(big)}, {concurrency} readers",
                    BIG * len(big),
                    len(big),
                    cache,
                    "FileBackend.get (obstore LocalStore)",
                    "aiofiles open/read/close",
                )
                rows.append(
                    await _measure(
                        row,
                        _timed(concurrency, [functools.partial(whole_chunkd, k) for k in big]),
                        _timed(concurrency, [functools.partial(whole_aio, k) for k in big]),
                        rounds,
                    )
                )
            row = Row(
                "backend",
                f"file backend 64 KiB ranges x{len(ranges)}, {concurrency} readers",
                SMALL * len(ranges),
                len(ranges),
                "warm",
                "FileBackend.get(key, ByteRange) (head + pinned ranged GET)",
                "aiofiles stat, open/seek/read/close",
            )
            rows.append(
                await _measure(
                    row,
                    _timed(concurrency, [functools.partial(range_chunkd, k, s) for k, s in ranges]),
                    _timed(concurrency, [functools.partial(range_aio, k, s) for k, s in ranges]),
                    rounds,
                )
            )
        for concurrency in (1, 16):
            # Not the backend's get today: its one-hop read path (read_batch of one file),
            # what a faster get would use rather than aiofiles.
            row = Row(
                "backend",
                f"file backend whole 4 MiB x{len(big)}, {concurrency} readers, one-hop read",
                BIG * len(big),
                len(big),
                "warm",
                "FileBackend.read_batch of one file (one thread hop)",
                "aiofiles open/read/close",
            )
            rows.append(
                await _measure(
                    row,
                    _timed(concurrency, [functools.partial(one_hop, k, 0, BIG) for k in big]),
                    _timed(concurrency, [functools.partial(whole_aio, k) for k in big]),
                    rounds,
                )
            )
            row = Row(
                "backend",
                f"file backend 64 KiB ranges x{len(ranges)}, {concurrency} readers, one-hop read",
                SMALL * len(ranges),
                len(ranges),
                "warm",
                "FileBackend.read_batch of one range (one thread hop, version by fstat)",
                "aiofiles stat, open/seek/read/close",
            )
            rows.append(
                await _measure(
                    row,
                    _timed(
                        concurrency,
                        [functools.partial(one_hop, k, s, s + SMALL) for k, s in ranges],
                    ),
                    _timed(concurrency, [functools.partial(range_aio, k, s) for k, s in ranges]),
                    rounds,
                )
            )
        row = Row(
            "backend",
            f"file backend first 64 KiB of {len(small)} files (read_batch, 64 a call)",
            SMALL * len(small),
            len(small),
            "warm",
            "FileBackend.read_batch (one thread a batch)",
            "aiofiles stat, open/read/close, 16 in flight",
        )
        rows.append(
            await _measure(
                row,
                batch_chunkd,
                _timed(16, [functools.partial(aio_first, k) for k in small]),
                rounds,
            )
        )
    finally:
        await files.close()
        shutil.rmtree(data_dir, ignore_errors=True)
    return rows


# -- entry point ---------------------------------------------------------------------------


async def run(
    work: Path,
    *,
    quick: bool,
    rounds: int,
    only: set[str] | None = None,
    aiofiles_threads: int | None = None,
) -> list[Row]:
    """Every group (or ``only`` those named); ``quick`` shrinks the data, not the rounds.

    ``aiofiles_threads``: the size of the default executor, where aiofiles runs every
    call (``None``: the loop's own, ``min(32, cpus + 4)`` threads; the disk tier has 4).
    """
    if aiofiles_threads is not None:
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(aiofiles_threads, thread_name_prefix="aiofiles")
        )
    threads = aiofiles_threads or min(32, (os.cpu_count() or 1) + 4)
    print(f"(aiofiles: default executor of {threads} threads; disk tier: 4 workers)", flush=True)
    cold_ok = _can_drop_caches()
    if not cold_ok:
        print("(cannot drop the page cache: not root; cold rows skipped)", flush=True)
    print(HEADER, flush=True)
    rows: list[Row] = []
    if only is None or "insert" in only:
        rows += await insert(work, rounds, quick)
    if only is None or "read" in only:
        rows += await read(work, rounds, quick, cold_ok)
    if only is None or "backend" in only:
        rows += await backend(work, rounds, quick, cold_ok)
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.aiofiles_bench``: print the table (and write ``--json``)."""
    parser = argparse.ArgumentParser(prog="python -m bench.aiofiles_bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small data (checks it runs)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per pair (5)")
    parser.add_argument("--only", action="append", choices=GROUPS, help="a group (repeatable)")
    parser.add_argument("--work", type=Path, default=None, help="scratch dir on the disk tested")
    parser.add_argument(
        "--aiofiles-threads", type=int, default=None, help="default executor size (cpus + 4)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write every round here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="aiofiles-bench-", dir=args.work))
    try:
        started = time.perf_counter()
        # the daemon's loop: its default executor is the pool aiofiles runs every call in
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            rows = runner.run(
                run(
                    work,
                    quick=args.quick,
                    rounds=args.rounds,
                    only=set(args.only or GROUPS),
                    aiofiles_threads=args.aiofiles_threads,
                )
            )
        print(f"({time.perf_counter() - started:.0f} s, {os.cpu_count()} cpus)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json is not None:
        args.json.write_text(json.dumps([row.as_json() for row in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
