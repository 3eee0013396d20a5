"""The tier conformance suite, shipped with the library (as zarr ships ``StoreTests``).

Every tier passes the same tests. An implementation's test module is a short
subclass that supplies the ``tier`` fixture and, for persistent tiers, ``reopen``::

    from chunkd.testing.tiers import TierTests

    class TestRamTier(TierTests):
        @pytest.fixture
        async def tier(self, tmp_path):
            tier = RamTier(self.budget_bytes, max_chunk_bytes=self.max_chunk_bytes)
            yield tier
            await tier.close()

It lives in ``chunkd.testing`` with the other suites (``BackendTests``,
``FormatTests``); ``chunkd.cache.testing.TierTests``, its old name, still works (a
lazy re-export). Importing this module needs pytest (a dev dependency); it imports
nothing of the daemon, and nothing but tests imports it.
"""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import random

import pytest

from chunkd.cache.chunkid import ChunkId
from chunkd.cache.ram import SEALS
from chunkd.cache.tier import Chunk, Tier
from chunkd.errors import CacheClosedError, ChunkTooLargeError

__all__ = ["TierTests"]


class TierTests:
    """Behaviour every :class:`~chunkd.cache.tier.Tier` must show."""

    #: budget the ``tier`` fixture must give its tier
    budget_bytes = 1 << 20
    #: largest chunk the ``tier`` fixture's tier must accept
    max_chunk_bytes = 128 << 10

    @pytest.fixture
    async def tier(self) -> Tier:
        """A fresh, empty tier with :attr:`budget_bytes` and :attr:`max_chunk_bytes`.

        Subclasses override this (usually as an async generator that closes the tier).
        """
        raise NotImplementedError(f"{type(self).__name__} must supply the tier fixture")

    async def reopen(self, tier: Tier) -> Tier | None:
        """Close ``tier`` and open it again (persistent tiers); ``None`` to skip."""
        return None

    @staticmethod
    def chunks(n: int, size: int = 16 << 10, seed: int = 0) -> list[Chunk]:
        """``n`` distinct chunks of ``size`` random bytes."""
        rng = random.Random(seed)
        return [Chunk.of(rng.randbytes(size)) for _ in range(n)]

    # -- basic contract ---------------------------------------------------------------

    async def test_get_absent_returns_none(self, tier: Tier) -> None:
        assert await tier.get(ChunkId.of(b"never stored")) is None

    async def test_put_then_get_returns_the_same_bytes(self, tier: Tier) -> None:
        for chunk in self.chunks(4):
            assert await tier.put(chunk)
            lease = await tier.get(chunk.id)
            assert lease is not None
            with lease:
                assert lease.id == chunk.id
                assert lease.size == chunk.size
                assert lease.read() == bytes(chunk.data)
                assert ChunkId.of(lease.view()) == chunk.id

    async def test_put_is_idempotent(self, tier: Tier) -> None:
        (chunk,) = self.chunks(1)
        assert await tier.put(chunk)
        used = tier.used_bytes
        assert await tier.put(chunk)
        assert tier.used_bytes == used
        assert tier.stats().chunks == 1

    async def test_concurrent_puts_of_one_chunk_store_it_once(self, tier: Tier) -> None:
        (chunk,) = self.chunks(1)
        results = await asyncio.gather(*(tier.put(chunk) for _ in range(8)))
        assert all(results)
        assert tier.stats().chunks == 1
        lease = await tier.get(chunk.id)
        assert lease is not None
        with lease:
            assert lease.read() == bytes(chunk.data)

    async def test_contains_and_discard(self, tier: Tier) -> None:
        (chunk,) = self.chunks(1)
        assert not await tier.contains(chunk.id)
        await tier.put(chunk)
        assert await tier.contains(chunk.id)
        assert await tier.discard(chunk.id)
        assert not await tier.contains(chunk.id)
        assert await tier.get(chunk.id) is None
        assert not await tier.discard(chunk.id)
        assert tier.used_bytes == 0

    async def test_empty_chunk(self, tier: Tier) -> None:
        chunk = Chunk.of(b"")
        assert await tier.put(chunk)
        lease = await tier.get(chunk.id)
        assert lease is not None
        with lease:
            assert lease.size == 0
            assert lease.read() == b""

    async def test_oversize_chunk_is_refused_clearly(self, tier: Tier) -> None:
        chunk = Chunk.of(os.urandom(self.max_chunk_bytes + 1))
        with pytest.raises(ChunkTooLargeError, match="at most"):
            await tier.put(chunk)
        assert not await tier.contains(chunk.id)

    async def test_stats_count_hits_and_misses(self, tier: Tier) -> None:
        (chunk,) = self.chunks(1)
        await tier.put(chunk)
        before = tier.stats()
        lease = await tier.get(chunk.id)
        assert lease is not None
        lease.release()
        assert await tier.get(ChunkId.of(b"absent")) is None
        after = tier.stats()
        assert after.hits == before.hits + 1
        assert after.misses >= before.misses + 1
        assert after.bytes == tier.used_bytes > 0

    async def test_a_lease_that_is_no_lookup_counts_neither_hit_nor_miss(self, tier: Tier) -> None:
        (chunk,) = self.chunks(1)
        leased = await tier.put_leased(chunk)  # stored and leased: no hit
        assert leased is not None
        leased.release()
        before = tier.stats()
        lease = await tier.get(chunk.id, count=False)
        assert lease is not None
        assert lease.read() == bytes(chunk.data)
        lease.release()
        assert await tier.get(ChunkId.of(b"absent"), count=False) is None
        after = tier.stats()
        assert (after.hits, after.misses) == (before.hits, before.misses)
        assert before.hits == 0

    # -- leases and budgets -------------------------------------------------------------

    async def test_lease_outlives_discard(self, tier: Tier) -> None:
        (chunk,) = self.chunks(1)
        await tier.put(chunk)
        lease = await tier.get(chunk.id)
        assert lease is not None
        view = lease.view()
        assert await tier.discard(chunk.id)
        assert bytes(view) == bytes(chunk.data)
        assert lease.read() == bytes(chunk.data)
        lease.release()
        lease.release()  # idempotent
        assert bytes(view) == bytes(chunk.data)

    async def test_budget_holds_under_churn(self, tier: Tier) -> None:
        size = 32 << 10
        chunks = self.chunks(4 * self.budget_bytes // size, size=size, seed=1)
        rng = random.Random(2)
        for i, chunk in enumerate(chunks):
            await tier.put(chunk)
            assert tier.used_bytes <= tier.budget_bytes
            # Re-read some earlier chunks so the policy sees a working set.
            for earlier in rng.sample(chunks[: i + 1], k=min(3, i + 1)):
                lease = await tier.get(earlier.id)
                if lease is not None:
                    with lease:
                        assert lease.read() == bytes(earlier.data)
        assert tier.used_bytes <= tier.budget_bytes
        assert tier.stats().evictions > 0

    async def test_views_of_evicted_chunks_stay_valid(self, tier: Tier) -> None:
        size = 32 << 10
        first, *rest = self.chunks(4 * self.budget_bytes // size, size=size, seed=3)
        await tier.put(first)
        lease = await tier.get(first.id)
        assert lease is not None
        view = lease.view()
        lease.release()
        for chunk in rest:
            await tier.put(chunk)
        assert bytes(view) == bytes(first.data)

    async def test_pinned_chunk_survives_eviction_pressure(self, tier: Tier) -> None:
        size = 32 << 10
        first, *rest = self.chunks(4 * self.budget_bytes // size, size=size, seed=4)
        await tier.put(first)
        lease = await tier.get(first.id)
        assert lease is not None
        with lease:
            for chunk in rest:
                await tier.put(chunk)
            if tier.supports_fds:
                # fd-backed tiers keep the chunk itself while it is leased
                assert await tier.contains(first.id)
            assert lease.read() == bytes(first.data)

    # -- fds ----------------------------------------------------------------------------

    async def test_fd_is_sealed_and_refuses_writes(self, tier: Tier) -> None:
        if not tier.supports_fds:
            pytest.skip(f"the {tier.name} tier hands out no fds")
        (chunk,) = self.chunks(1)
        await tier.put(chunk)
        lease = await tier.get(chunk.id)
        assert lease is not None
        with lease:
            fd = lease.fileno()
            assert fd is not None
            assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"corrupt", 0)
            with pytest.raises(PermissionError):
                mmap.mmap(fd, chunk.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 1)
            # Another process sees the bytes through its own read-only mapping.
            other = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
            try:
                with mmap.mmap(other, chunk.size, prot=mmap.PROT_READ) as mapped:
                    assert mapped[:] == bytes(chunk.data)
            finally:
                os.close(other)
        again = await tier.get(chunk.id)
        assert again is not None
        with again:
            assert again.read() == bytes(chunk.data)

    # -- lifecycle ----------------------------------------------------------------------

    async def test_reopened_tier_serves_what_it_held(self, tier: Tier) -> None:
        chunks = self.chunks(3, seed=5)
        for chunk in chunks:
            await tier.put(chunk)
        reopened = await self.reopen(tier)
        if reopened is None:
            pytest.skip(f"the {tier.name} tier is not persistent")
        try:
            for chunk in chunks:
                lease = await reopened.get(chunk.id)
                assert lease is not None, f"{chunk.id} lost across reopen"
                with lease:
                    assert lease.read() == bytes(chunk.data)
        finally:
            await reopened.close()

    async def test_closed_tier_raises_a_clear_error(self, tier: Tier) -> None:
        (chunk,) = self.chunks(1)
        await tier.put(chunk)
        await tier.close()
        await tier.close()  # idempotent
        with pytest.raises(CacheClosedError, match="closed"):
            await tier.get(chunk.id)
        with pytest.raises(CacheClosedError, match="closed"):
            await tier.put(chunk)
