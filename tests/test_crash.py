"""Crash safety: a writer killed with SIGKILL at random points leaves a sound cache."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from chunkd.cache import CacheConfig, ChunkCache, ChunkId
from chunkd.testing.soundness import assert_cache_sound

WRITER = textwrap.dedent(
    """
    import asyncio, os, random, sys
    from chunkd.cache import CacheConfig, ChunkCache

    async def main(root, seed):
        rng = random.Random(seed)
        cache = await ChunkCache.open(CacheConfig(
            dir=root, ram_bytes=4 << 20, disk_bytes=24 << 20, disk_min_free_bytes=0,
            chunk_bytes=256 << 10, fsync="never", index_flush_interval=0.005))
        print("ready", flush=True)
        n = 0
        while True:
            size = rng.randint(1, 256 << 10)
            if n % 3:
                data = rng.randbytes(size)
            else:
                data = (b"%d compressible " % n) * (size // 16 + 1)
                data = data[:size]
            await cache.insert(data)
            n += 1

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
    """
)


def _check_sound(root: Path) -> int:
    """Every indexed chunk verifies; no file sits under a wrong name. Returns chunks seen."""
    return assert_cache_sound(root, 256 << 10)[0]


def test_sigkill_at_random_points_leaves_a_sound_cache(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    rng = random.Random(7)
    for round_ in range(6):
        child = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), str(round_)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.02, 0.6))
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
        _check_sound(root)

    # Reopen: reconciliation adopts verified orphans, removes temporaries, and the
    # cache then serves every chunk it indexes.
    asyncio.run(_reopen_and_serve_everything(root))
    _check_sound(root)


async def _reopen_and_serve_everything(root: Path) -> None:
    cache = await ChunkCache.open(
        CacheConfig(
            dir=root,
            ram_bytes=4 << 20,
            disk_bytes=24 << 20,
            disk_min_free_bytes=0,
            chunk_bytes=256 << 10,
        )
    )
    try:
        done = await cache.wait_reconciled()
        assert done["orphans_removed"] == 0  # nothing under a real name was bad
        assert not any((root / "tmp").iterdir())
        assert cache.disk.used_bytes <= 24 << 20
        served = 0
        after: bytes | None = None
        while page := cache.index.scan_chunks(after, 200):
            for cid, _ in page:
                after = cid
                with await cache.get(cid) as lease:
                    assert ChunkId.of(lease.view()) == cid
                served += 1
        on_disk = len(list((root / "chunks").glob("*/*/*")))
        assert served == on_disk > 0  # every file is indexed again, none lost
    finally:
        await cache.close()
