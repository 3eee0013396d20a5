"""Shared fixtures: caches in temporary directories that are always closed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from chunkd.cache import CacheConfig, ChunkCache

OpenCache = Callable[..., Awaitable[ChunkCache]]


@pytest.fixture
async def open_cache(tmp_path: Path) -> AsyncIterator[OpenCache]:
    """Factory: ``await open_cache(**config)`` opens a cache under ``tmp_path/cache``.

    Small budgets and no fsync unless overridden; every cache opened is closed at
    the end of the test.
    """
    opened: list[ChunkCache] = []

    async def factory(**overrides: Any) -> ChunkCache:
        settings: dict[str, Any] = {
            "dir": tmp_path / "cache",
            "ram_bytes": 8 << 20,
            "disk_bytes": 32 << 20,
            "disk_min_free_bytes": 0,
            "chunk_bytes": 1 << 20,
            "fsync": "never",
        }
        settings.update(overrides)
        cache = await ChunkCache.open(CacheConfig(**settings))
        opened.append(cache)
        return cache

    yield factory
    for cache in opened:
        await cache.close()
