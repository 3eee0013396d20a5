"""A damaged copy on disk is detected, dropped and counted, and never returned."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from chunkd.cache import ChunkCache, ChunkId, Codec
from chunkd.errors import ChunkNotFoundError

from .conftest import OpenCache


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _grow(path: Path) -> None:
    with path.open("ab") as f:
        f.write(b"\0")


def _delete(path: Path) -> None:
    path.unlink()


def _empty(path: Path) -> None:
    os.truncate(path, 0)


DAMAGE: dict[str, Callable[[Path], None]] = {
    "flipped byte": _flip,
    "truncated": _truncate,
    "grown": _grow,
    "deleted": _delete,
    "emptied": _empty,
}


async def _stored_on_disk_only(cache: ChunkCache, data: bytes) -> ChunkId:
    cid = await cache.insert(data)
    await cache.ram.discard(cid)  # the next read must come from disk
    return cid


@pytest.mark.parametrize("compressible", [False, True], ids=["raw", "zstd"])
@pytest.mark.parametrize("damage", list(DAMAGE))
async def test_damaged_chunk_is_reported_missing_dropped_and_counted(
    open_cache: OpenCache, damage: str, compressible: bool
) -> None:
    cache = await open_cache()
    data = (b"checkpoint shard " * 40_000)[:600_000] if compressible else os.urandom(600_000)
    cid = await _stored_on_disk_only(cache, data)
    record = cache.index.lookup(cid)
    assert record is not None
    assert record.codec == (Codec.ZSTD if compressible else Codec.RAW)
    good = await _stored_on_disk_only(cache, os.urandom(1000))

    DAMAGE[damage](cache.disk.path_of(cid))

    assert await cache.find(cid) is None
    with pytest.raises(ChunkNotFoundError, match="not cached on this node"):
        await cache.get(cid)
    assert cache.index.lookup(cid) is None, "the damaged chunk is still indexed"
    assert not cache.disk.path_of(cid).exists(), "the damaged file was left behind"
    disk = cache.disk.stats()
    if damage == "deleted":
        assert disk.missing == 1
    else:
        assert disk.integrity_failures == 1
    with await cache.get(good) as lease:  # the rest of the cache is unaffected
        assert ChunkId.of(lease.view()) == good
    # The chunk can be stored again and served.
    assert await cache.insert(data) == cid
    with await cache.get(cid) as lease:
        assert lease.read() == data


async def test_a_file_swapped_for_another_chunk_is_caught(open_cache: OpenCache) -> None:
    cache = await open_cache()
    a = await _stored_on_disk_only(cache, os.urandom(5000))
    b = await _stored_on_disk_only(cache, os.urandom(5000))
    os.replace(cache.disk.path_of(b), cache.disk.path_of(a))
    assert await cache.find(a) is None
    assert cache.disk.stats().integrity_failures == 1


async def test_without_verification_size_checks_still_apply(open_cache: OpenCache) -> None:
    cache = await open_cache(verify_reads=False)
    cid = await _stored_on_disk_only(cache, os.urandom(5000))
    _truncate(cache.disk.path_of(cid))
    assert await cache.find(cid) is None
    assert cache.disk.stats().integrity_failures == 1
