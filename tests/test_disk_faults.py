"""A full disk, I/O errors and the free-space floor never fail a read RAM can serve."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkd.cache import ChunkId, disk

from .conftest import OpenCache


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs: a real filesystem that really fills up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; this test shows ENOSPC on a real filesystem")
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        # ENOSPC faked at the OS boundary is covered by the tests below either way.
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


async def test_full_disk_degrades_the_tier_and_reads_still_succeed(
    open_cache: OpenCache, tiny_tmpfs: Path
) -> None:
    cache = await open_cache(
        dir=tiny_tmpfs / "cache", ram_bytes=16 << 20, disk_bytes=64 << 20, disk_retry_after=60
    )
    payloads = [os.urandom(512 << 10) for _ in range(12)]  # 6 MiB onto a 3 MiB disk
    ids = [await cache.insert(data) for data in payloads]  # not one raises
    disk_stats = cache.disk.stats()
    assert disk_stats.errors.get("enospc", 0) >= 1
    assert disk_stats.degraded is not None
    assert "ENOSPC" in disk_stats.degraded
    assert disk_stats.rejected >= 1
    for cid, data in zip(ids, payloads, strict=True):
        with await cache.get(cid) as lease:  # RAM serves every one of them
            assert lease.read() == data
    # While degraded the tier declines writes at once instead of failing again.
    errors_before = cache.disk.stats().errors["enospc"]
    await cache.insert(os.urandom(1000))
    assert cache.disk.stats().errors["enospc"] == errors_before
    assert not list((tiny_tmpfs / "cache" / "tmp").iterdir()), "a partial file was left"
    # Nothing on disk sits under a wrong name.
    for path in (tiny_tmpfs / "cache" / "chunks").glob("*/*/*"):
        assert ChunkId.of(path.read_bytes()) == ChunkId.parse(path.name)


async def test_free_space_floor_is_kept(open_cache: OpenCache, tmp_path: Path) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    cache = await open_cache(disk_min_free_bytes=free + (1 << 30))  # a floor above what is free
    data = os.urandom(100_000)
    cid = await cache.insert(data)
    assert not await cache.disk.contains(cid)
    assert cache.disk.stats().degraded == "free space below cache.disk_min_free"
    with await cache.get(cid) as lease:
        assert lease.read() == data


async def test_eio_on_read_is_a_miss_not_an_error(
    open_cache: OpenCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = await open_cache()
    data = os.urandom(50_000)
    cid = await cache.insert(data)
    await cache.ram.discard(cid)

    def failing_read(path: Path, size: int) -> bytearray:
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(disk, "_read_exact", failing_read)  # the OS boundary of the tier
    assert await cache.find(cid) is None  # the caller goes on to the source
    stats = cache.disk.stats()
    assert stats.errors == {"eio": 1}
    assert stats.degraded == "I/O error (EIO)"
    assert cache.index.lookup(cid) is None
    monkeypatch.undo()
    # A reader that refetches the chunk gets it stored in RAM again.
    assert await cache.insert(data) == cid
    with await cache.get(cid) as lease:
        assert lease.read() == data


async def test_eio_on_write_is_counted_and_the_insert_still_succeeds(
    open_cache: OpenCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = await open_cache()

    def failing_write(
        self: disk.DiskTier, path: Path, payload: object, sync: bool, *, direct: bool = False
    ) -> None:
        path.write_bytes(b"partial")
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(disk.DiskTier, "_write_file", failing_write)
    data = os.urandom(50_000)
    cid = await cache.insert(data)
    assert cache.disk.stats().errors == {"eio": 1}
    assert not await cache.disk.contains(cid)
    assert not any((cache.disk.root / "tmp").iterdir())
    with await cache.get(cid) as lease:
        assert lease.read() == data


async def test_degraded_tier_recovers_after_the_retry_interval(
    open_cache: OpenCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = await open_cache(disk_retry_after=0.0)
    calls = {"n": 0}
    real = disk.DiskTier._write_file

    def flaky(
        self: disk.DiskTier, path: Path, payload: object, sync: bool, *, direct: bool = False
    ) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(self, path, payload, sync, direct=direct)  # type: ignore[arg-type]

    monkeypatch.setattr(disk.DiskTier, "_write_file", flaky)
    first = await cache.insert(os.urandom(10_000))
    assert not await cache.disk.contains(first)
    second = await cache.insert(os.urandom(10_000))
    assert await cache.disk.contains(second)
    assert cache.disk.degraded is None
