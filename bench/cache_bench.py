"""The cache library, measured side by side with what a user would write instead.

Scenarios (each interleaves chunkd and baseline rounds, and reports the median):

1. RAM-tier insert of 4 MiB chunks (hash, copy into a memfd, seal) against a plain
   memcpy of the same bytes into memory set aside for them.
2. Disk-tier insert against plain Python open/write/rename of the same bytes, with
   and without fsync on both sides.
3. RAM-tier hits: chunk id to a leased, handed-out fd, per second.
4. Index lookups against a raw lmdb get loop over the same keys and values.
5. Opening an index of 1M chunks and serving the first hit.

It is one job at ~670 lines: the cache library's speed, one scenario family (the tiers'
inserts, reads and hits, the index's lookups and opening) each against the plain code a
user would write instead, sharing the chunks and the interleaved rounds; no daemon runs,
and the rows go to :class:`bench.report.Report`.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import mmap
import os
import random
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import lmdb

from chunkd.cache import (
    CacheConfig,
    Chunk,
    ChunkCache,
    ChunkId,
    ChunkRecord,
    DiskTier,
    Index,
    RamTier,
    WritePolicy,
)
from chunkd.cache.index import Codec, TierSet
from chunkd.cache.ram import seal_memfd

from .report import Report, Result, Rounds, interleave, median_rate, rates_of

MiB = 1 << 20
CHUNK = 4 * MiB


def _chunks(count: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(CHUNK) for _ in range(count)]


# -- 1. RAM insert ---------------------------------------------------------------------


async def ram_insert(report: Report, work: Path, count: int, rounds: int) -> None:
    payloads = _chunks(count, 1)
    total = count * CHUNK
    # The baseline's destination: one buffer per chunk, allocated and touched once
    # up front, as a cache of plain bytes would hold them. Its cost is the memcpy only.
    slots = [bytearray(CHUNK) for _ in payloads]
    dst = [(ctypes.c_char * CHUNK).from_buffer(s) for s in slots]
    hot = (ctypes.c_char * CHUNK).from_buffer(bytearray(CHUNK))
    config = CacheConfig(
        dir=work / "ram-insert",
        ram_bytes=2 * total,
        disk_bytes=2 * total,
        disk_min_free_bytes=0,
        write_policy=WritePolicy.UPPER_ONLY,  # the RAM tier alone
        reconcile=False,
    )
    cache = await ChunkCache.open(config)
    tier = RamTier(2 * total, max_chunk_bytes=CHUNK)
    ids = [ChunkId.of(p) for p in payloads]
    in_flight = asyncio.Semaphore(4)

    async def insert_one(data: bytes) -> None:
        async with in_flight:
            await cache.insert(data)

    async def empty() -> None:
        for cid in ids:
            await cache.ram.discard(cid)
            await tier.discard(cid)

    async def chunkd_sequential() -> tuple[float, float]:
        start = time.perf_counter()
        for p in payloads:
            await cache.insert(p)
        took = time.perf_counter() - start
        await empty()
        return total, took

    async def chunkd_concurrent() -> tuple[float, float]:
        start = time.perf_counter()
        await asyncio.gather(*(insert_one(p) for p in payloads))
        took = time.perf_counter() - start
        await empty()
        return total, took

    async def tier_put() -> tuple[float, float]:
        start = time.perf_counter()
        for p in payloads:
            await tier.put(Chunk.of(p))
        took = time.perf_counter() - start
        await empty()
        return total, took

    async def memcpy_slots() -> tuple[float, float]:
        start = time.perf_counter()
        for d, p in zip(dst, payloads, strict=True):
            ctypes.memmove(d, p, CHUNK)
        return total, time.perf_counter() - start

    async def memfd_floor() -> tuple[float, float]:
        # What the kernel charges for the memfds alone: create, copy, seal, no hash.
        start = time.perf_counter()
        fds = [seal_memfd(memoryview(p)) for p in payloads]
        took = time.perf_counter() - start
        for fd in fds:
            os.close(fd)
        return total, took

    async def memcpy_fresh() -> tuple[float, float]:
        # A copy into freshly mapped memory, as any store that allocates per chunk does.
        start = time.perf_counter()
        maps = []
        for p in payloads:
            fresh = mmap.mmap(-1, CHUNK)
            fresh[:] = p
            maps.append(fresh)
        took = time.perf_counter() - start
        for fresh in maps:
            fresh.close()
        return total, took

    async def memcpy_hot() -> tuple[float, float]:
        start = time.perf_counter()
        for p in payloads:
            ctypes.memmove(hot, p, CHUNK)
        return total, time.perf_counter() - start

    try:
        rates = await interleave(
            rounds,
            {
                "seq": chunkd_sequential,
                "conc": chunkd_concurrent,
                "tier": tier_put,
                "memcpy": memcpy_slots,
                "hot": memcpy_hot,
                "floor": memfd_floor,
                "fresh": memcpy_fresh,
            },
        )
    finally:
        await cache.close()
        await tier.close()
    gb = {name: rate / 1e9 for name, rate in rates.items()}
    why = (
        "a memfd needs fresh pages for every chunk, and on this VM (which reports freed "
        "pages to its host) fresh pages cost more than the copy; the baseline copies into "
        "buffers allocated and faulted in before timing"
    )
    report.add(
        Result(
            "RAM insert 4 MiB, 4 in flight (hash, memfd, seal)",
            gb["conc"],
            gb["memcpy"],
            "GB/s",
            "memcpy into per-chunk buffers",
            target_ratio=0.25,
            samples=rates.pair("conc", "memcpy"),
            note=(
                "ChunkCache.insert with 4 inserts in flight, as the daemon's readers and "
                "readahead keep several; each copies into its memfd on one thread while "
                "blake3 hashes on another. " + why
            ),
        )
    )
    report.add(
        Result(
            "RAM insert 4 MiB, one at a time",
            gb["seq"],
            gb["memcpy"],
            "GB/s",
            "memcpy into per-chunk buffers",
            target_ratio=0.25,
            samples=rates.pair("seq", "memcpy"),
            note="the same call awaited one chunk at a time: hash and copy still overlap",
        )
    )
    report.add(
        Result(
            "RAM insert 4 MiB, RamTier.put(Chunk.of(..))",
            gb["tier"],
            gb["memcpy"],
            "GB/s",
            "memcpy into per-chunk buffers",
            samples=rates.pair("tier", "memcpy"),
            note="hash, then copy and seal, one after the other (no overlap)",
        )
    )
    report.add(
        Result(
            "RAM insert 4 MiB, 4 in flight, vs memcpy into fresh memory",
            gb["conc"],
            gb["fresh"],
            "GB/s",
            "mmap a new 4 MiB region, copy into it",
            samples=rates.pair("conc", "fresh"),
            note="a copy that needs new pages, as each memfd does; shows what the pages cost",
        )
    )
    report.add(
        Result(
            "kernel floor: memfd create + write + seal (no hash)",
            gb["floor"],
            gb["memcpy"],
            "GB/s",
            "memcpy into per-chunk buffers",
            samples=rates.pair("floor", "memcpy"),
            note="one thread, no hashing: the most a memfd-per-chunk RAM tier can insert here",
        )
    )
    report.add(
        Result(
            "RAM insert 4 MiB, 4 in flight, vs a cache-hot memcpy",
            gb["conc"],
            gb["hot"],
            "GB/s",
            "memcpy into one reused 4 MiB buffer",
            samples=rates.pair("conc", "hot"),
            note="the strictest baseline: the destination stays in the CPU cache",
        )
    )


# -- 2. Disk insert --------------------------------------------------------------------


def _plain_write(root: Path, cid: ChunkId, data: bytes, fsync: bool) -> None:
    hexid = cid.hex()
    final = root / hexid[:2] / hexid[2:4] / hexid
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{hexid}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.rename(tmp, final)
    if fsync:
        dirfd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(dirfd)
        os.close(dirfd)


async def disk_insert(report: Report, work: Path, count: int, rounds: int) -> None:
    payloads = _chunks(count, 2)
    chunks = [Chunk.of(p) for p in payloads]
    total = count * CHUNK
    root = work / "disk-insert"
    plain_root = work / "plain-insert"
    for fsync in (False, True):
        label = "fsync" if fsync else "no fsync"

        async def chunkd_disk(concurrent: bool, fsync: bool = fsync) -> tuple[float, float]:
            shutil.rmtree(root, ignore_errors=True)
            index = Index(root / "index", chunk_bytes=CHUNK, sync=fsync)  # as ChunkCache does
            tier = DiskTier(
                root,
                index,
                budget_bytes=4 * total,
                fsync="always" if fsync else "never",
                max_chunk_bytes=CHUNK,
            )
            os.sync()  # nobody pays for the other's dirty pages
            start = time.perf_counter()
            if concurrent:
                await asyncio.gather(*(tier.put(chunk) for chunk in chunks))
            else:
                for chunk in chunks:
                    await tier.put(chunk)
            took = time.perf_counter() - start
            await tier.close()
            index.close()
            shutil.rmtree(root, ignore_errors=True)
            return total, took

        async def plain(fsync: bool = fsync) -> tuple[float, float]:
            shutil.rmtree(plain_root, ignore_errors=True)
            plain_root.mkdir(parents=True)
            os.sync()
            start = time.perf_counter()
            for chunk, data in zip(chunks, payloads, strict=True):
                _plain_write(plain_root, chunk.id, data, fsync)
            took = time.perf_counter() - start
            shutil.rmtree(plain_root, ignore_errors=True)
            return total, took

        async def one_at_a_time() -> tuple[float, float]:
            return await chunkd_disk(False)

        async def concurrent() -> tuple[float, float]:
            return await chunkd_disk(True)

        rates = await interleave(rounds, {"seq": one_at_a_time, "conc": concurrent, "plain": plain})
        gb = {name: rate / 1e9 for name, rate in rates.items()}
        report.add(
            Result(
                f"disk insert 4 MiB, one at a time, {label}",
                gb["seq"],
                gb["plain"],
                "GB/s",
                f"open/write/rename in Python, {label}",
                target_ratio=0.7,
                samples=rates.pair("seq", "plain"),
                note=(
                    "DiskTier.put: temp file, rename, batched lmdb record, a zstd probe "
                    "(random data stays raw); the same file layout on both sides"
                )
                if not fsync
                else "",
            )
        )
        report.add(
            Result(
                f"disk insert 4 MiB, {count} concurrent puts, {label}",
                gb["conc"],
                gb["plain"],
                "GB/s",
                f"open/write/rename in Python, {label}",
                samples=rates.pair("conc", "plain"),
            )
        )


async def disk_read(report: Report, work: Path, count: int, rounds: int) -> None:
    payloads = _chunks(count, 5)
    chunks = [Chunk.of(p) for p in payloads]
    total = count * CHUNK
    root = work / "disk-read"
    shutil.rmtree(root, ignore_errors=True)
    index = Index(root / "index", chunk_bytes=CHUNK, sync=False)
    tier = DiskTier(root, index, budget_bytes=4 * total, fsync="never", max_chunk_bytes=CHUNK)
    for chunk in chunks:
        await tier.put(chunk)
    paths = [tier.path_of(chunk.id) for chunk in chunks]

    async def chunkd_get() -> tuple[float, float]:
        start = time.perf_counter()
        for chunk in chunks:
            lease = await tier.get(chunk.id)
            assert lease is not None
            lease.release()
        return total, time.perf_counter() - start

    async def plain_read(verify: bool) -> tuple[float, float]:
        start = time.perf_counter()
        for path in paths:
            with open(path, "rb") as f:
                data = f.read()
            if verify:
                ChunkId.of(data)
        return total, time.perf_counter() - start

    try:
        rates = await interleave(
            rounds,
            {
                "get": chunkd_get,
                "read": functools.partial(plain_read, False),
                "hash": functools.partial(plain_read, True),
            },
        )
    finally:
        await tier.close()
        index.close()
        shutil.rmtree(root, ignore_errors=True)
    gb = {name: rate / 1e9 for name, rate in rates.items()}
    report.add(
        Result(
            "disk hit 4 MiB, verified (page cache warm)",
            gb["get"],
            gb["hash"],
            "GB/s",
            "open().read() + blake3 in Python",
            samples=rates.pair("get", "hash"),
            note=(
                "DiskTier.get: index lookup, read into a buffer, blake3 check, a thread hop; "
                "the files are in the page cache on both sides"
            ),
        )
    )
    report.add(
        Result(
            "disk hit 4 MiB, verified, vs an unverified read",
            gb["get"],
            gb["read"],
            "GB/s",
            "open().read() in Python, no check",
            samples=rates.pair("get", "read"),
            note="what verification costs: a reader that skips it trusts whatever is on disk",
        )
    )


# -- 3. RAM hits -----------------------------------------------------------------------


async def ram_hits(report: Report, lookups: int, rounds: int) -> None:
    tier = RamTier(256 * MiB)
    ids = []
    for i in range(64):
        chunk = Chunk.of(i.to_bytes(4, "little") * 1024)
        await tier.put(chunk)
        ids.append(chunk.id)
    keys = [ids[i % len(ids)] for i in range(lookups)]
    fds = {cid: i for i, cid in enumerate(ids)}
    sync_rounds: list[tuple[float, float]] = []
    async_rounds: list[tuple[float, float]] = []
    dict_rounds: list[tuple[float, float]] = []
    for _ in range(rounds):
        start = time.perf_counter()
        for cid in keys:
            lease = tier.lease(cid)
            assert lease is not None
            lease.fileno()
            lease.release()
        sync_rounds.append((lookups, time.perf_counter() - start))
        start = time.perf_counter()
        for cid in keys:
            lease = await tier.get(cid)
            assert lease is not None
            lease.fileno()
            lease.release()
        async_rounds.append((lookups, time.perf_counter() - start))
        start = time.perf_counter()
        for cid in keys:
            fds.get(cid)
        dict_rounds.append((lookups, time.perf_counter() - start))
    await tier.close()
    base = median_rate(dict_rounds)
    report.add(
        Result(
            "RAM hit: id -> leased fd -> release (sync)",
            median_rate(sync_rounds),
            base,
            "ops/s",
            "a bare dict.get of an fd",
            samples=Rounds.of(rates_of(sync_rounds), rates_of(dict_rounds)),
            note="lock, pin, policy update, lease object, unpin; no syscall",
        )
    )
    report.add(
        Result(
            "RAM hit: await tier.get(id) -> fd -> release",
            median_rate(async_rounds),
            base,
            "ops/s",
            "a bare dict.get of an fd",
            samples=Rounds.of(rates_of(async_rounds), rates_of(dict_rounds)),
        )
    )


# -- 4. Index lookups ------------------------------------------------------------------


def _ids(count: int) -> list[ChunkId]:
    return [ChunkId.of(i.to_bytes(8, "little")) for i in range(count)]


def _fill_index(path: Path, ids: list[ChunkId]) -> None:
    index = Index(path, chunk_bytes=CHUNK, flush_ops=50_000, flush_interval=3600)
    try:
        for n, cid in enumerate(ids):
            index.put_chunk(cid, ChunkRecord(CHUNK, CHUNK - n % 1000, Codec.RAW, TierSet.DISK))
    finally:
        index.close()


async def index_lookups(
    report: Report, work: Path, entries: int, lookups: int, rounds: int
) -> None:
    ids = _ids(entries)
    root = work / "index-lookups"
    shutil.rmtree(root, ignore_errors=True)
    _fill_index(root / "index", ids)
    raw_env = lmdb.open(str(root / "raw"), map_size=1 << 34, readahead=False)
    with raw_env.begin(write=True) as txn:
        for n, cid in enumerate(ids):
            txn.put(bytes(cid), ChunkRecord(CHUNK, CHUNK - n % 1000).pack())
    index = Index(root / "index", chunk_bytes=CHUNK)
    rng = random.Random(3)
    keys = [ids[rng.randrange(entries)] for _ in range(lookups)]
    raw_keys = [bytes(k) for k in keys]
    batch = 64
    single, raw_single, many, raw_many = [], [], [], []
    for _ in range(rounds):
        start = time.perf_counter()
        for cid in keys:
            index.lookup(cid)
        single.append((lookups, time.perf_counter() - start))

        start = time.perf_counter()
        for key in raw_keys:
            with raw_env.begin() as txn:
                txn.get(key)
        raw_single.append((lookups, time.perf_counter() - start))

        start = time.perf_counter()
        for i in range(0, lookups, batch):
            index.lookup_many(keys[i : i + batch])
        many.append((lookups, time.perf_counter() - start))

        start = time.perf_counter()
        for i in range(0, lookups, batch):
            with raw_env.begin() as txn:
                for key in raw_keys[i : i + batch]:
                    txn.get(key)
        raw_many.append((lookups, time.perf_counter() - start))
    index.close()
    raw_env.close()
    shutil.rmtree(root, ignore_errors=True)
    note = (
        f"{entries:,} chunk records; random ids. chunkd also checks its write overlay and "
        "decodes each record into a ChunkRecord; the raw loop returns the bytes only."
    )
    report.add(
        Result(
            "index lookup, one id per call",
            median_rate(single),
            median_rate(raw_single),
            "ops/s",
            "raw lmdb: begin(); get(); per key",
            target_ratio=0.5,
            samples=Rounds.of(rates_of(single), rates_of(raw_single)),
            note=note,
        )
    )
    report.add(
        Result(
            f"index lookup_many, {batch} ids per call",
            median_rate(many),
            median_rate(raw_many),
            "ops/s",
            f"raw lmdb: one txn, get() x {batch}",
            target_ratio=0.5,
            samples=Rounds.of(rates_of(many), rates_of(raw_many)),
        )
    )


# -- 5. Opening a big index ------------------------------------------------------------


async def index_open(report: Report, work: Path, entries: int, rounds: int) -> None:
    root = work / "index-open"
    shutil.rmtree(root, ignore_errors=True)
    ids = _ids(entries)
    print(f"    (building an index of {entries:,} chunks...)", flush=True)
    _fill_index(root / "index", ids)
    # One of those chunks really exists on disk, so a full cache can serve it.
    payload = random.Random(4).randbytes(CHUNK)
    real = ChunkId.of(payload)
    path = root / "chunks" / str(real)[:2] / str(real)[2:4] / str(real)
    path.parent.mkdir(parents=True)
    path.write_bytes(payload)
    index = Index(root / "index", chunk_bytes=CHUNK)
    index.put_chunk(real, ChunkRecord(CHUNK, CHUNK))
    index.close()

    opens, scans, cache_opens = [], [], []
    probe = ids[entries // 2]
    for _ in range(rounds):
        start = time.perf_counter()
        index = Index(root / "index", chunk_bytes=CHUNK)
        assert index.lookup(probe) is not None
        opens.append(time.perf_counter() - start)
        assert index.disk_chunks == entries + 1

        start = time.perf_counter()
        seen = 0
        after: bytes | None = None
        while page := index.scan_chunks(after, 10_000):
            seen += len(page)
            after = page[-1][0]
        scans.append(time.perf_counter() - start)
        assert seen == entries + 1
        index.close()

        start = time.perf_counter()
        cache = await ChunkCache.open(
            CacheConfig(dir=root, disk_bytes=1 << 50, disk_min_free_bytes=0, reconcile=False)
        )
        with await cache.get(real) as lease:
            assert lease.size == CHUNK
        cache_opens.append(time.perf_counter() - start)
        await cache.close()
    shutil.rmtree(root, ignore_errors=True)
    scan = min(scans)
    report.add(
        Result(
            f"open index of {entries / 1e6:g}M chunks + first lookup",
            min(opens),
            scan,
            "s",
            "a start-up scan of every record",
            target_max=1.0,
            samples=Rounds.of(opens, scans),
            note=(
                "totals live in the index, so opening reads no records; the baseline is "
                "what a scan at start-up (to learn sizes and budgets) would cost"
            ),
        )
    )
    report.add(
        Result(
            f"open cache of {entries / 1e6:g}M chunks + first hit (disk, verified)",
            min(cache_opens),
            scan,
            "s",
            "a start-up scan of every record",
            target_max=1.0,
            samples=Rounds.of(cache_opens, scans),
            note=(
                "ChunkCache.open (lock, lmdb, tiers; background reconciliation off so it "
                "does not sweep the 1M records that have no file) and get(): read 4 MiB, "
                "blake3-verify, promote to a sealed memfd"
            ),
        )
    )


SCENARIOS = ("ram_insert", "disk_insert", "disk_read", "ram_hits", "index_lookups", "index_open")


async def run(report: Report, work: Path, *, quick: bool, only: set[str] | None = None) -> None:
    """Every cache scenario (or ``only`` those named); ``quick`` shrinks them."""
    count = 8 if quick else 48
    # Rounds are cheap and this VM's outliers are not: take the median of many (the
    # inserts are saves: at least 5).
    rounds = report.rounds_for(2 if quick else 9)
    # the loops below are short: 5 rounds cost little more than 3
    loops = report.rounds_for(3 if quick else 5)

    steps: dict[str, Callable[[], Awaitable[None]]] = {
        "ram_insert": lambda: ram_insert(report, work, count, rounds),
        "disk_insert": lambda: disk_insert(report, work, count, rounds),
        "disk_read": lambda: disk_read(report, work, count, rounds),
        "ram_hits": lambda: ram_hits(report, 20_000 if quick else 200_000, loops),
        "index_lookups": lambda: index_lookups(
            report, work, 20_000 if quick else 200_000, 20_000 if quick else 200_000, loops
        ),
        "index_open": lambda: index_open(
            report, work, 20_000 if quick else 1_000_000, report.rounds_for(3)
        ),
    }
    for name in SCENARIOS:
        if only is None or name in only:
            print(f"cache: {name}", flush=True)
            with report.timed(name, "cache"):
                await steps[name]()
