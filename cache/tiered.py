"""Two tiers composed into one: an upper (fast) tier over a lower (larger) one.

A :class:`TieredCache` is itself a :class:`~chunkd.cache.tier.Tier`, so it passes
the same conformance suite, and tiers compose as wrappers rather than flags. The
usual stack is RAM over disk:

* ``get`` tries the upper tier, then the lower one; a lower hit is promoted into
  the upper tier and served from there (so a RAM lease, with its fd, comes back
  whenever RAM could take the chunk). Concurrent gets of one chunk share a single
  lower-tier read and promotion.
* ``put`` follows the :class:`WritePolicy`: by default write-through (the call
  returns once both tiers hold the chunk, or at least one could). The lower tier
  is written from the upper tier's copy whenever there is one.

A slow or failing lower tier never holds a reader up for long: the disk tier bounds
its own reads and declines writes while its disk is stalled (see
:mod:`chunkd.cache.disk`), and a write-through ``put`` that the upper tier took
waits at most ``through_wait`` seconds for the lower tier; past that the lower
write goes on in the background (:meth:`TieredCache.drain` waits for it, as for
write-behind), so a reader whose chunk is in RAM is never kept waiting by one disk
write that hangs.
"""

from __future__ import annotations

import asyncio
import logging
from enum import StrEnum
from typing import Final

from chunkd.cache.chunkid import ChunkId
from chunkd.cache.singleflight import SingleFlight
from chunkd.cache.tier import Chunk, ChunkLease, Tier, TierStats
from chunkd.errors import ChunkTooLargeError

__all__ = ["TieredCache", "WritePolicy"]

log = logging.getLogger("chunkd.cache.tiered")

#: seconds a write-through put waits for the lower tier once the upper one holds the
#: chunk: a disk write takes milliseconds; one that takes a second is hanging, and
#: the reader it would hold up has its bytes already
THROUGH_WAIT: Final = 1.0


def _release_result(future: asyncio.Future[tuple[ChunkLease | None, bool]]) -> None:
    if not future.cancelled() and future.exception() is None:
        lease = future.result()[0]
        if lease is not None:
            lease.release()


class WritePolicy(StrEnum):
    """Where a new chunk goes."""

    #: both tiers; ``put`` returns when both are done
    THROUGH = "write-through"
    #: the upper tier now, the lower one in the background (``drain`` waits for it)
    BEHIND = "write-behind"
    #: the upper tier only; the lower tier fills only from explicit puts to it
    UPPER_ONLY = "upper-only"


class TieredCache(Tier):
    """``upper`` over ``lower``. See the module docstring.

    Args:
        upper: the fast tier (RAM).
        lower: the larger tier (disk).
        write_policy: where new chunks go.
        name: the name in stats.
        max_behind: most write-behind copies queued; ``put`` waits beyond that.
        through_wait: most seconds a write-through ``put`` waits for the lower tier
            once the upper tier holds the chunk (``None``: as long as it takes).
    """

    def __init__(
        self,
        upper: Tier,
        lower: Tier,
        *,
        write_policy: WritePolicy | str = WritePolicy.THROUGH,
        name: str = "tiered",
        max_behind: int = 64,
        through_wait: float | None = THROUGH_WAIT,
    ) -> None:
        self.name = name
        self.upper = upper
        self.lower = lower
        self.write_policy = WritePolicy(write_policy)
        self._background: set[asyncio.Task[bool]] = set()
        self._behind_slots = asyncio.Semaphore(max_behind)
        self.through_wait = through_wait
        # Single flight: one read and promotion of a chunk from the lower tier at a time.
        self._loads: SingleFlight[ChunkId, tuple[ChunkLease | None, bool]] = SingleFlight()
        self._misses = 0
        #: gets that waited on another reader's load from the lower tier
        self.coalesced = 0

    @property
    def budget_bytes(self) -> int:
        # docstring inherited
        return self.upper.budget_bytes + self.lower.budget_bytes

    @property
    def used_bytes(self) -> int:
        # docstring inherited
        return self.upper.used_bytes + self.lower.used_bytes

    @property
    def persistent(self) -> bool:
        # docstring inherited
        return self.lower.persistent

    @property
    def supports_fds(self) -> bool:
        # docstring inherited
        return self.upper.supports_fds

    @property
    def tiers(self) -> tuple[Tier, Tier]:
        """The two tiers, upper first."""
        return (self.upper, self.lower)

    async def get(self, cid: ChunkId, *, count: bool = True) -> ChunkLease | None:
        # docstring inherited
        # Each lookup counts once in all: a hit in the tier whose copy it got, or a
        # miss here (the tiers' own misses say which tier was asked, not the verdict).
        lease = await self.upper.get(cid, count=count)
        if lease is not None:
            return lease
        # Single flight: concurrent readers of a chunk that is only in the lower tier
        # cause one read and one promotion; the others then lease the promoted copy.
        load = self._loads.join(cid)
        if load is not None:
            self.coalesced += 1
            found, promoted = await asyncio.shield(load)
            if found is None:
                if count:
                    self._misses += 1
                return None
            if promoted and (again := await self.upper.get(cid, count=count)) is not None:
                return again
            return await self._get_lower(cid, count)  # the upper tier could not keep it
        load = self._loads.start(cid, lambda: self._load(cid, count))
        try:
            return (await asyncio.shield(load))[0]
        except asyncio.CancelledError:
            load.add_done_callback(_release_result)  # the lease nobody will take
            raise

    async def _load(self, cid: ChunkId, count: bool) -> tuple[ChunkLease | None, bool]:
        """Read ``cid`` from the lower tier and promote it: (a lease, promoted?)."""
        lower = await self.lower.get(cid, count=count)
        if lower is None:
            if count:
                self._misses += 1
            return None, False
        # The lower tier verified these bytes on the way up.
        try:
            promoted = await self.upper.put_leased(Chunk.trusted(lower.id, lower.view()))
        except ChunkTooLargeError:  # the upper tier takes smaller chunks than the lower
            promoted = None
        if promoted is None:
            return lower, False
        lower.release()
        promoted.origin = lower.origin  # this reader's bytes came from the lower tier
        return promoted, True

    async def _get_lower(self, cid: ChunkId, count: bool) -> ChunkLease | None:
        lease = await self.lower.get(cid, count=count)
        if lease is None and count:
            self._misses += 1
        return lease

    async def put(self, chunk: Chunk) -> bool:
        # docstring inherited
        if self.write_policy is WritePolicy.UPPER_ONLY:
            return await self.upper.put(chunk)
        lease = await self.upper.put_leased(chunk)
        if lease is None:  # the upper tier declined: the lower one copies the caller's bytes
            return await self.lower.put(chunk)
        # The lower tier writes from the upper tier's copy (a sealed memfd for RAM),
        # not from the caller's buffer: a caller that is cancelled or reuses its
        # buffer cannot change what lands on disk under this id.
        try:
            source = Chunk.trusted(chunk.id, lease.view())
        finally:
            lease.release()  # the view keeps its own reference to the memory
        if self.write_policy is WritePolicy.BEHIND:
            # Bounded: each queued write holds a mapping (and an fd) of its chunk.
            await self._behind_slots.acquire()
            task = asyncio.create_task(self._put_lower(source))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return True
        if self.through_wait is None:
            await self.lower.put(source)
            return True
        # A task of its own: past through_wait it goes on without this caller.
        lower = asyncio.create_task(self.lower.put(source))
        try:
            await asyncio.wait_for(asyncio.shield(lower), self.through_wait)
        except TimeoutError:
            log.info(
                "chunk %s: the %s tier took more than %s s; its write goes on in the background",
                chunk.id,
                self.lower.name,
                self.through_wait,
            )
        finally:
            if not lower.done():
                self._background.add(lower)
                lower.add_done_callback(self._background.discard)
                lower.add_done_callback(self._late_put_done)
        return True

    def _late_put_done(self, task: asyncio.Future[bool]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("a late write to the %s tier failed: %r", self.lower.name, exc)

    async def _put_lower(self, chunk: Chunk) -> bool:
        try:
            return await self.lower.put(chunk)
        except Exception:
            log.exception(
                "write-behind of chunk %s to the %s tier failed", chunk.id, self.lower.name
            )
            return False
        finally:
            self._behind_slots.release()

    async def drain(self) -> None:
        """Wait for write-behind puts still running."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def contains(self, cid: ChunkId) -> bool:
        # docstring inherited
        return await self.upper.contains(cid) or await self.lower.contains(cid)

    async def discard(self, cid: ChunkId) -> bool:
        # docstring inherited
        upper, lower = await asyncio.gather(self.upper.discard(cid), self.lower.discard(cid))
        return upper or lower

    def stats(self) -> TierStats:
        # docstring inherited
        up, low = self.upper.stats(), self.lower.stats()
        return TierStats(
            name=self.name,
            hits=up.hits + low.hits,
            misses=self._misses,
            inserts=up.inserts + low.inserts,
            rejected=up.rejected + low.rejected,
            evictions=up.evictions + low.evictions,
            integrity_failures=up.integrity_failures + low.integrity_failures,
            missing=up.missing + low.missing,
            errors={
                k: up.errors.get(k, 0) + low.errors.get(k, 0) for k in {*up.errors, *low.errors}
            },
            bytes=up.bytes + low.bytes,
            chunks=max(up.chunks, low.chunks),
            budget_bytes=up.budget_bytes + low.budget_bytes,
            pinned=up.pinned + low.pinned,
            degraded=up.degraded or low.degraded,
        )

    def tier_stats(self) -> list[TierStats]:
        """Per-tier snapshots, upper first (and nested tiers flattened)."""
        out: list[TierStats] = []
        for tier in self.tiers:
            out.extend(tier.tier_stats() if isinstance(tier, TieredCache) else [tier.stats()])
        return out

    async def close(self) -> None:
        # docstring inherited
        await self.drain()
        await self.upper.close()
        await self.lower.close()
