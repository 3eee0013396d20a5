"""Each tier is a short subclass of the shared conformance suite."""

from __future__ import annotations

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
from chunkd.cache.testing import TierTests


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
