"""Content-addressed tiered cache: chunk ids, RAM and disk tiers, the lmdb index.

A pure library: no networking, no HTTP, no imports from the gateway or client.
"""

from __future__ import annotations

from chunkd.cache.chunkid import MAX_CHUNK_BYTES, ChunkId, chunk_count, split_chunks
from chunkd.cache.disk import DiskTier, FsyncPolicy
from chunkd.cache.index import (
    ChunkRecord,
    ChunkRef,
    Codec,
    Index,
    Locator,
    ObjectInfo,
    ObjectVersion,
    TierSet,
    ValidatedVersion,
)
from chunkd.cache.policy import EvictionPolicy, LruPolicy, S3FifoPolicy
from chunkd.cache.ram import RamLease, RamTier
from chunkd.cache.store import CacheConfig, CacheStats, ChunkCache, lock_holder
from chunkd.cache.tier import BytesLease, Chunk, ChunkLease, Tier, TierStats
from chunkd.cache.tiered import TieredCache, WritePolicy

__all__ = [
    "MAX_CHUNK_BYTES",
    "BytesLease",
    "CacheConfig",
    "CacheStats",
    "Chunk",
    "ChunkCache",
    "ChunkId",
    "ChunkLease",
    "ChunkRecord",
    "ChunkRef",
    "Codec",
    "DiskTier",
    "EvictionPolicy",
    "FsyncPolicy",
    "Index",
    "Locator",
    "LruPolicy",
    "ObjectInfo",
    "ObjectVersion",
    "RamLease",
    "RamTier",
    "S3FifoPolicy",
    "Tier",
    "TierSet",
    "TierStats",
    "TieredCache",
    "ValidatedVersion",
    "WritePolicy",
    "chunk_count",
    "lock_holder",
    "split_chunks",
]
