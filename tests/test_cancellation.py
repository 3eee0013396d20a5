"""Cancelled callers leak nothing and disturb no one; the tier's own trouble is a miss."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import lmdb
import pytest

from chunkd.cache import Chunk, ChunkId, DiskTier, Index, RamTier, TieredCache, disk

from .conftest import OpenCache


def _memfds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            # the RAM tier's memfds only (not, say, a checkpoint client's staging spare)
            name = os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")
            count += name == "/memfd:chunkd"
        except FileNotFoundError:
            continue
    return count


async def _cancel_soon(coro: object, delay: float = 0.0) -> bool:
    """Cancel ``coro`` after ``delay``; whether the cancel landed (it may have finished)."""
    task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
    await asyncio.sleep(delay)
    finished = task.done()
    task.cancel()
    if finished:
        await task
        return False
    with pytest.raises(asyncio.CancelledError):
        await task
    return True


async def test_cancelled_ram_puts_leak_no_memfds() -> None:
    # Counted from what the process held before: clients of earlier tests (an fsspec
    # file system's cached Client, say) keep the memfds they were handed.
    before = _memfds()
    ram = RamTier(64 << 20)
    try:
        for _ in range(6):
            await _cancel_soon(ram.put(Chunk.of(os.urandom(1 << 20))))
        await asyncio.sleep(0.3)  # the copies finish in their threads
        assert _memfds() - before == ram.stats().chunks
    finally:
        await ram.close()


async def test_cancelled_inserts_leak_no_memfds(open_cache: OpenCache) -> None:
    before = _memfds()
    cache = await open_cache()
    cancelled = 0
    for delay in (0.0, 0.0005, 0.002):
        for _ in range(3):
            cancelled += await _cancel_soon(cache.insert(os.urandom(1 << 20)), delay)
    assert cancelled >= 3  # the ones cancelled at once, at least
    await asyncio.sleep(0.5)
    await cache.tiers.drain()
    assert _memfds() - before == cache.ram.stats().chunks


async def test_a_cancelled_disk_put_does_not_cancel_other_waiters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = Index(tmp_path / "index")
    tier = DiskTier(tmp_path, index, budget_bytes=1 << 30, fsync="never")
    slow = tier.write_sync

    def slow_write(chunk: Chunk, sync: bool | None = None, compress: bool | None = None) -> bool:
        time.sleep(0.2)
        return slow(chunk, sync, compress)

    monkeypatch.setattr(tier, "write_sync", slow_write)
    chunk = Chunk.of(os.urandom(1 << 16))
    first = asyncio.ensure_future(tier.put(chunk))
    await asyncio.sleep(0.02)
    second = asyncio.ensure_future(tier.put(chunk))
    await asyncio.sleep(0.02)
    first.cancel()
    assert await second is True
    assert first.cancelled()
    assert await tier.contains(chunk.id)
    await tier.close()
    index.close()


async def test_the_disk_copy_is_made_from_the_sealed_copy_not_the_callers_buffer(
    tmp_path: Path,
) -> None:
    index = Index(tmp_path / "index", sync=False)
    lower = DiskTier(tmp_path, index, budget_bytes=1 << 30, fsync="never", verify=False)
    for policy in ("write-behind", "write-through"):
        tiers = TieredCache(RamTier(1 << 30), lower, write_policy=policy)
        buf = bytearray(os.urandom(1 << 20))
        chunk = Chunk.of(buf)
        put = asyncio.ensure_future(tiers.put(chunk))
        await asyncio.sleep(0)
        await put
        buf[:] = os.urandom(1 << 20)  # the caller reuses its receive buffer at once
        await tiers.drain()
        lease = await lower.get(chunk.id)
        assert lease is not None
        assert ChunkId.of(lease.view()) == chunk.id, policy
        await tiers.upper.close()
    await lower.close()
    index.close()


async def test_index_failures_are_a_miss_or_a_declined_write(
    open_cache: OpenCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = await open_cache()
    await cache.wait_reconciled()
    data = os.urandom(50_000)
    cid = await cache.insert(data)
    await cache.ram.discard(cid)

    def broken(*_args: object) -> None:
        raise lmdb.DiskError("simulated: the index's disk failed")

    monkeypatch.setattr(cache.index, "lookup", broken)
    assert await cache.find(cid) is None  # a miss, not an exception
    assert await cache.disk.put(Chunk.of(os.urandom(1000))) is False
    stats = cache.disk.stats()
    assert stats.errors["index"] == 2
    assert stats.degraded is not None
    assert "index failed" in stats.degraded
    other = os.urandom(2000)
    assert await cache.insert(other) == ChunkId.of(other)  # RAM still takes it
    monkeypatch.undo()


async def test_a_stale_drop_never_removes_a_newer_copy(tmp_path: Path) -> None:
    index = Index(tmp_path / "index", sync=False)
    tier = DiskTier(tmp_path, index, budget_bytes=1 << 30, fsync="never")
    chunk = Chunk.of(os.urandom(10_000))
    assert tier.write_sync(chunk)
    seen = index.lookup(chunk.id)
    assert seen is not None
    await tier.discard(chunk.id)
    await asyncio.sleep(0.002)  # the rewrite gets another last-use stamp
    assert tier.write_sync(chunk)
    assert tier._drop(chunk.id, seen) is None  # the reader's view is stale: nothing dropped
    assert tier.path_of(chunk.id).exists()
    assert index.lookup(chunk.id) is not None
    await tier.close()
    index.close()


async def test_reconcile_ignores_misnamed_and_oversized_files(open_cache: OpenCache) -> None:
    cache = await open_cache()
    await cache.close()
    data = os.urandom(4096)
    cid = ChunkId.of(data)
    upper = cache.disk.path_of(cid).with_name(str(cid).upper())
    upper.parent.mkdir(parents=True, exist_ok=True)
    upper.write_bytes(data)  # the right bytes under a name the tier never writes
    bomb_id = ChunkId.of(b"bomb")
    bomb = cache.disk.path_of(bomb_id)
    bomb.parent.mkdir(parents=True, exist_ok=True)
    # a zstd frame header that claims 2**40 bytes of content
    bomb.write_bytes(b"\x28\xb5\x2f\xfd\xc4" + (1 << 40).to_bytes(8, "little") + b"\0" * 8)
    again = await open_cache()
    done = await again.wait_reconciled()
    assert done["orphans_removed"] == 2
    assert done["orphans_adopted"] == 0
    assert not upper.exists()
    assert not bomb.exists()
    assert again.disk.stats().chunks == 0


def test_disk_module_is_importable_as_an_attribute() -> None:
    assert disk.DiskTier is DiskTier


async def test_write_behind_backlog_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = Index(tmp_path / "index", sync=False)
    lower = DiskTier(tmp_path, index, budget_bytes=1 << 30, fsync="never")
    release = asyncio.Event()
    real_put = lower.put

    async def stalled_put(chunk: Chunk) -> bool:
        await release.wait()
        return await real_put(chunk)

    monkeypatch.setattr(lower, "put", stalled_put)
    tiers = TieredCache(RamTier(1 << 30), lower, write_policy="write-behind", max_behind=2)
    chunks = [Chunk.of(os.urandom(4096)) for _ in range(3)]
    assert await tiers.put(chunks[0])
    assert await tiers.put(chunks[1])
    third = asyncio.ensure_future(tiers.put(chunks[2]))
    await asyncio.sleep(0.05)
    assert not third.done()  # two copies queued: the third put waits for a slot
    release.set()
    assert await third
    await tiers.drain()
    for chunk in chunks:
        assert await lower.contains(chunk.id)
    await tiers.close()
    index.close()


async def test_a_chunk_too_big_for_ram_is_served_from_disk(tmp_path: Path) -> None:
    index = Index(tmp_path / "index", sync=False)
    lower = DiskTier(tmp_path, index, budget_bytes=1 << 30, fsync="never")
    tiers = TieredCache(RamTier(1 << 30, max_chunk_bytes=1 << 20), lower)
    big = Chunk.of(os.urandom(2 << 20))
    assert await lower.put(big)
    lease = await tiers.get(big.id)  # promotion is refused; the disk copy is served
    assert lease is not None
    with lease:
        assert lease.fileno() is None
        assert ChunkId.of(lease.view()) == big.id
    await tiers.close()
    index.close()
