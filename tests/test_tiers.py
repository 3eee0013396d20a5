"""Each tier is a short subclass of the shared conformance suite."""

from __future__ import annotations

import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from chunkd.cache import (
    CacheConfig,
    Chunk,
    ChunkCache,
    Codec,
    DiskTier,
    Index,
    LruPolicy,
    RamTier,
    Tier,
)
from chunkd.client import Client
from chunkd.testing import free_port
from chunkd.testing.daemon import DaemonProcess
from chunkd.testing.tiers import TierTests


class TestRamTier(TierTests):
    @pytest.fixture
    async def tier(self) -> AsyncIterator[Tier]:
        tier = RamTier(self.budget_bytes, max_chunk_bytes=self.max_chunk_bytes)
        yield tier
        await tier.close()


class TestRamTierLru(TierTests):
    @pytest.fixture
    async def tier(self) -> AsyncIterator[Tier]:
        tier = RamTier(self.budget_bytes, policy=LruPolicy(), max_chunk_bytes=self.max_chunk_bytes)
        yield tier
        await tier.close()


def _disk(root: Path, budget: int, max_chunk: int) -> DiskTier:
    index = Index(root / "index", chunk_bytes=max_chunk)
    return DiskTier(root, index, budget_bytes=budget, max_chunk_bytes=max_chunk, fsync="never")


class TestDiskTier(TierTests):
    @pytest.fixture
    async def tier(self, tmp_path: Path) -> AsyncIterator[Tier]:
        tier = _disk(tmp_path, self.budget_bytes, self.max_chunk_bytes)
        yield tier
        await tier.close()
        tier.index.close()

    async def reopen(self, tier: Tier) -> Tier:
        assert isinstance(tier, DiskTier)
        await tier.close()
        tier.index.close()
        return _disk(tier.root, self.budget_bytes, self.max_chunk_bytes)


class TestTieredCache(TierTests):
    @pytest.fixture
    async def tier(self, tmp_path: Path) -> AsyncIterator[Tier]:
        self.root = tmp_path
        self.cache = await ChunkCache.open(self.config(tmp_path))
        yield self.cache.tiers
        await self.cache.close()

    async def reopen(self, tier: Tier) -> Tier:
        await self.cache.close()
        self.cache = await ChunkCache.open(self.config(self.root))
        return self.cache.tiers

    def config(self, root: Path) -> CacheConfig:
        # RAM and disk each get half the budget, so the sum is what the suite expects.
        return CacheConfig(
            dir=root,
            ram_bytes=self.budget_bytes // 2,
            disk_bytes=self.budget_bytes // 2,
            disk_min_free_bytes=0,
            chunk_bytes=self.max_chunk_bytes,
            fsync="never",
        )


async def test_disk_put_can_skip_zstd_and_fsync_per_call(tmp_path: Path) -> None:
    index = Index(tmp_path / "index")
    tier = DiskTier(tmp_path, index, budget_bytes=1 << 30, fsync="always")
    try:
        squashy = Chunk.of(b"abcd" * 65536)
        assert await tier.put(squashy)
        record = index.lookup(squashy.id)
        assert record is not None
        assert record.codec == Codec.ZSTD  # the tier's policy
        raw = Chunk.of(b"wxyz" * 65536)
        assert await tier.put(raw, sync=False, compress=False)
        record = index.lookup(raw.id)
        assert record is not None
        assert record.codec == Codec.RAW
        lease = await tier.get(raw.id)
        assert lease is not None
        assert lease.read() == b"wxyz" * 65536
    finally:
        await tier.close()
        index.close()


async def test_ram_tier_holds_at_most_max_chunks_memfds() -> None:
    """Each RAM-tier chunk is an open memfd: a budget of bytes alone lets 100k small
    chunks hold 100k fds, so the tier also evicts by count."""
    tier = RamTier(1 << 30, max_chunks=50)
    try:
        chunks = [Chunk.of(i.to_bytes(8, "little") * 16) for i in range(500)]
        for chunk in chunks:
            assert await tier.put(chunk)
        held = 0
        for chunk in chunks:
            lease = await tier.get(chunk.id)
            if lease is not None:
                held += 1
                lease.release()
        assert 0 < held <= 50
        assert tier.used_bytes <= 50 * 4096
    finally:
        await tier.close()


def test_a_daemon_serves_more_small_objects_than_its_fd_limit(tmp_path: Path) -> None:
    """Under a hard limit of 512 open files, 2,000 small objects are read (and cached)
    one after the other: the RAM tier evicts by count before the daemon runs out of fds."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(2000):
        (data / f"{i:05d}.bin").write_bytes(i.to_bytes(4, "little") * 64)
    port = free_port()
    daemon = DaemonProcess(
        f'[cache]\ndir = "{tmp_path}/cache"\ndisk_min_free_bytes = 0\nfsync = "never"\n'
        f'[[backends]]\nname = "d"\nurl = "file://{data}"\n',
        cwd=tmp_path,
        prefix=("prlimit", "--nofile=512:512"),
        log=tmp_path / "log",
        listen=f"127.0.0.1:{port}",
        socket=tmp_path / "s.sock",
    )
    try:
        daemon.wait_socket(timeout=30)
        with Client(tmp_path / "s.sock", cache_chunks=16) as client:
            for i in range(2000):
                assert bytes(client.read(f"d/{i:05d}.bin")) == i.to_bytes(4, "little") * 64
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as answer:
            assert answer.status == 200
    finally:
        daemon.stop()
    assert "Too many open files" not in (tmp_path / "log").read_text()
