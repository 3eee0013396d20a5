"""What the fault points cost when nothing is armed: the shipped daemon's case.

A point (:func:`chunkd.faults.point`) sits on the hot path of every chunk the cache
takes: ``cache.insert``, ``disk.write``, ``disk.rename`` and the index's commits. Two
rows, each interleaving the two sides round by round:

1. inserts of 64 KiB chunks into a RAM-over-disk cache (hash, memfd, file, rename,
   index record), as shipped, against the same inserts with ``faults.point``
   replaced by a function that does nothing: the points' whole cost on the path;
2. a disarmed ``faults.point`` call against a call of an empty function: what one
   point costs, next to the least any call costs.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from pathlib import Path

from chunkd import faults
from chunkd.cache import CacheConfig, ChunkCache

from .report import Report, Result, interleave

SMALL = 64 << 10


def _nothing(name: str, error: object = None) -> None:
    """A fault point with nothing in it: the baseline."""


async def insert_path(report: Report, work: Path, count: int, rounds: int) -> None:
    rng = random.Random(7)
    shipped = faults.point
    serial = [0]

    async def inserts(patched: bool) -> tuple[float, float]:
        # Fresh bytes every round: an insert of a chunk the cache holds is a lookup.
        serial[0] += 1
        payloads = [rng.randbytes(SMALL) for _ in range(count)]
        root = work / f"faults-{serial[0]}"
        cache = await ChunkCache.open(
            CacheConfig(
                dir=root,
                ram_bytes=4 * count * SMALL,
                disk_bytes=4 * count * SMALL,
                disk_min_free_bytes=0,
                fsync="never",
                reconcile=False,
            )
        )
        faults.point = _nothing if patched else shipped  # type: ignore[assignment]
        try:
            started = time.perf_counter()
            for data in payloads:
                await cache.insert(data)
            cache.index.flush()
            took = time.perf_counter() - started
        finally:
            faults.point = shipped  # type: ignore[assignment]
            await cache.close()
            shutil.rmtree(root, ignore_errors=True)
        return count, took

    async def with_points() -> tuple[float, float]:
        return await inserts(False)

    async def without_points() -> tuple[float, float]:
        return await inserts(True)

    rates = await interleave(rounds, {"shipped": with_points, "patched": without_points})
    report.add(
        Result(
            "insert 64 KiB, RAM over disk: fault points unset vs removed",
            rates["shipped"],
            rates["patched"],
            "chunk/s",
            "the same inserts with faults.point a no-op",
            target_ratio=0.95,
            samples=rates.pair("shipped", "patched"),
            note=(
                "ChunkCache.insert of fresh 64 KiB chunks (hash, memfd, file, rename, index "
                "record: four points per chunk); 1.00 means the points cost nothing measurable"
            ),
        )
    )


async def point_call(report: Report, calls: int, rounds: int) -> None:
    assert not faults.armed(), "the bench measures disarmed points"

    def timed(fn: object) -> tuple[float, float]:
        call = fn  # bound locally, as a call site's global lookup is
        started = time.perf_counter()
        for _ in range(calls):
            call("disk.write")  # type: ignore[operator]
        return calls, time.perf_counter() - started

    async def point() -> tuple[float, float]:
        return timed(faults.point)

    async def empty() -> tuple[float, float]:
        return timed(_nothing)

    rates = await interleave(rounds, {"point": point, "empty": empty})
    report.add(
        Result(
            "a disarmed fault point, per call",
            rates["point"] / 1e6,
            rates["empty"] / 1e6,
            "Mcall/s",
            "a call of an empty function",
            target_ratio=0.5,
            samples=rates.pair("point", "empty", 1e-6),
            note=(
                f"{1e9 / rates['point']:.0f} ns a call: one test of an empty dict; an insert of "
                "a 4 MiB chunk takes milliseconds"
            ),
        )
    )


def run(report: Report, work: Path, *, quick: bool) -> None:
    """Both rows; ``quick`` shrinks them. The inserts are writes, noisy here: 7 rounds."""
    work.mkdir(parents=True, exist_ok=True)
    rounds = report.rounds_for(2 if quick else 7)
    asyncio.run(insert_path(report, work, 200 if quick else 2000, rounds))
    asyncio.run(point_call(report, 100_000 if quick else 2_000_000, rounds))
