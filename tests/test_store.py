"""ChunkCache: restart, exclusivity, errors, reconciliation, cross-process mappings."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from chunkd.cache import (
    CacheConfig,
    Chunk,
    ChunkCache,
    ChunkId,
    Locator,
    ObjectInfo,
    ObjectVersion,
    RamLease,
    split_chunks,
)
from chunkd.errors import (
    CacheClosedError,
    ChunkdError,
    ChunkNotFoundError,
    ChunkTooLargeError,
    IntegrityError,
)

from .conftest import OpenCache


async def test_reopened_cache_serves_what_it_held(open_cache: OpenCache, tmp_path: Path) -> None:
    cache = await open_cache()
    blob = os.urandom(3 << 20) + b"tail"
    version = ObjectVersion("data", "shards/000.bin", "etag-1")
    ids = []
    for i, part in enumerate(split_chunks(blob, cache.config.chunk_bytes)):
        cid = await cache.insert(part)
        cache.record(version.locator(i), cid, part.nbytes)
        ids.append(cid)
    cache.record_object(ObjectInfo("data", "shards/000.bin", "etag-1", len(blob), 1 << 20))
    await cache.close()

    again = await open_cache()
    assert again.ram.used_bytes == 0  # RAM starts cold, disk is warm
    refs = again.resolve_many(version, range(len(ids)))
    assert [r.id for r in refs if r] == ids
    got = bytearray()
    for ref in refs:
        assert ref is not None
        with await again.get(ref.id) as lease:
            assert isinstance(lease, RamLease)  # promoted on the way out
            got += lease.view()
    assert got == blob
    info = again.index.get_object(version)
    assert info is not None
    assert info.size == len(blob)


async def test_a_second_process_cannot_open_the_same_directory(
    open_cache: OpenCache, tmp_path: Path
) -> None:
    await open_cache()
    with pytest.raises(ChunkdError, match=rf"in use by another chunkd \(pid {os.getpid()}\)"):
        await ChunkCache.open(CacheConfig(dir=tmp_path / "cache"))


async def test_bad_input_gets_clear_errors(open_cache: OpenCache) -> None:
    cache = await open_cache()
    with pytest.raises(ChunkTooLargeError, match="split it"):
        await cache.insert(bytes((1 << 20) + 1))
    data = os.urandom(1000)
    with pytest.raises(IntegrityError, match="failed verification"):
        await cache.insert(data, expected=ChunkId.of(b"something else"))
    assert not await cache.contains(ChunkId.of(data))
    assert await cache.insert(data, expected=ChunkId.of(data)) == ChunkId.of(data)
    with pytest.raises(ChunkNotFoundError, match="not cached") as info:
        await cache.get(ChunkId.of(b"absent"))
    assert isinstance(info.value, LookupError)
    assert not isinstance(info.value, KeyError)
    with pytest.raises(ChunkdError, match=r"cache\.eviction"):
        CacheConfig(eviction="random").policy()


async def test_closed_cache_raises_cache_closed(open_cache: OpenCache) -> None:
    cache = await open_cache()
    cid = await cache.insert(b"x")
    await cache.close()
    await cache.close()
    for call in (cache.get(cid), cache.insert(b"y"), cache.contains(cid)):
        with pytest.raises(CacheClosedError, match="closed"):
            await call
    with pytest.raises(CacheClosedError):
        cache.resolve(Locator("b", "k", "v", 0))


async def test_reconcile_repairs_what_a_crash_or_an_operator_left(
    open_cache: OpenCache, tmp_path: Path
) -> None:
    cache = await open_cache()
    kept = await cache.insert(os.urandom(20_000))
    vanished = await cache.insert(os.urandom(20_000))
    await cache.close()
    root = tmp_path / "cache"
    disk_path = cache.disk.path_of
    disk_path(vanished).unlink()  # stale record
    orphan = os.urandom(30_000)  # a complete file the index never heard of
    orphan_id = ChunkId.of(orphan)
    disk_path(orphan_id).parent.mkdir(parents=True, exist_ok=True)
    disk_path(orphan_id).write_bytes(orphan)
    liar = ChunkId.of(b"liar")  # a file whose bytes do not match its name
    disk_path(liar).parent.mkdir(parents=True, exist_ok=True)
    disk_path(liar).write_bytes(b"not the bytes of its name")
    (root / "chunks" / "00" / "00").mkdir(parents=True, exist_ok=True)
    (root / "chunks" / "00" / "00" / "junk.txt").write_text("junk")
    (root / "tmp" / "deadbeef.7").write_bytes(b"half a chunk")  # a dead writer's temporary

    again = await open_cache()
    done = await again.wait_reconciled()
    assert done == {
        "tmp_removed": 1,
        "stale_dropped": 1,
        "orphans_adopted": 1,
        "orphans_removed": 2,
    }
    assert again.index.lookup(vanished) is None
    with await again.get(orphan_id) as lease:
        assert lease.read() == orphan
    with await again.get(kept) as lease:
        assert ChunkId.of(lease.view()) == kept
    assert not disk_path(liar).exists()
    assert not any((root / "tmp").iterdir())
    assert again.disk.stats().chunks == 2


async def test_disk_tier_compresses_only_when_it_pays(open_cache: OpenCache) -> None:
    cache = await open_cache()
    text = (b"the same words again " * 50_000)[: 1 << 20]
    noise = os.urandom(1 << 20)
    half = os.urandom(1 << 19) + bytes(1 << 19)  # saves about half: worth it
    for data in (text, noise, half):
        await cache.insert(data)
    records = [cache.index.lookup(ChunkId.of(d)) for d in (text, noise, half)]
    assert all(records)
    text_r, noise_r, half_r = records
    assert text_r is not None
    assert noise_r is not None
    assert half_r is not None
    assert text_r.stored_size < text_r.size // 8
    assert noise_r.stored_size == noise_r.size
    assert half_r.stored_size <= half_r.size * 7 // 8
    assert cache.disk.used_bytes == text_r.stored_size + noise_r.stored_size + half_r.stored_size


async def test_disk_tier_evicts_least_recently_used_first(open_cache: OpenCache) -> None:
    cache = await open_cache(disk_bytes=10 << 20, ram_bytes=1 << 20, compress=False)
    first = await cache.insert(os.urandom(1 << 20))
    rest = [await cache.insert(os.urandom(1 << 20)) for _ in range(12)]
    assert cache.disk.used_bytes <= 10 << 20
    assert not await cache.disk.contains(first)
    assert await cache.disk.contains(rest[-1])
    assert cache.disk.stats().evictions >= 3


@pytest.mark.timeout(20)
async def test_a_pinned_write_survives_eviction_until_released(open_cache: OpenCache) -> None:
    cache = await open_cache(disk_bytes=10 << 20, ram_bytes=1 << 20, compress=False)
    data = os.urandom(1 << 20)
    held = Chunk.trusted(ChunkId.of(data), data)
    assert await cache.put_pinned(held)
    assert not await cache.ram.contains(held.id)  # a pinned write goes to disk only
    cache.pin([held.id])  # a second pin: two releases are needed
    unpinned = await cache.insert(os.urandom(1 << 20))  # written as early, not pinned
    assert cache.pinned == 1

    async def pressure(n: int) -> None:  # 3x the budget: every unpinned chunk goes
        for _ in range(n):
            await cache.insert(os.urandom(1 << 20))

    await pressure(30)
    assert cache.disk.stats().evictions >= 20
    assert not cache.on_disk(unpinned)  # what eviction does to a chunk nobody pinned
    assert cache.on_disk(held.id)
    lease = await cache.read_disk(held.id)
    assert lease is not None
    with lease:
        assert bytes(lease.view()) == data

    cache.unpin([held.id])
    await pressure(30)
    assert cache.on_disk(held.id), "one of two pins released: still held"
    cache.unpin([held.id])
    assert cache.pinned == 0
    await pressure(30)
    assert not cache.on_disk(held.id), "released, it is evicted as any other"
    assert await cache.read_disk(held.id) is None


async def test_a_pinned_write_refused_by_a_closed_cache_still_takes_its_pin(
    open_cache: OpenCache,
) -> None:
    # A save releases one pin per chunk id it asked to pin, whatever became of the write:
    # a write refused at shutdown must not let that release take another save's pin.
    cache = await open_cache(disk_bytes=10 << 20, ram_bytes=1 << 20, compress=False)
    data = os.urandom(1 << 16)
    chunk = Chunk.trusted(ChunkId.of(data), data)
    cache.pin([chunk.id])  # another save holds it
    await cache.close()
    with pytest.raises(CacheClosedError):
        await cache.put_pinned(chunk)
    cache.unpin([chunk.id])  # this save's release
    assert cache.pinned == 1, "the other save's pin is still held"


async def test_many_concurrent_readers_of_one_chunk(open_cache: OpenCache) -> None:
    cache = await open_cache()
    data = os.urandom(1 << 20)
    cid = await cache.insert(data)
    await cache.ram.discard(cid)
    disk_hits = cache.disk.stats().hits
    leases = await asyncio.gather(*(cache.get(cid) for _ in range(32)))
    for lease in leases:
        with lease:
            assert isinstance(lease, RamLease)
            assert lease.read() == data
    assert cache.ram.stats().pinned == 0
    assert cache.disk.stats().hits == disk_hits + 1  # one disk read served all 32
    assert cache.tiers.coalesced == 31


async def test_a_cancelled_reader_leaves_no_pinned_chunk(open_cache: OpenCache) -> None:
    cache = await open_cache()
    cid = await cache.insert(os.urandom(1 << 20))
    await cache.ram.discard(cid)
    first = asyncio.ensure_future(cache.get(cid))
    second = asyncio.ensure_future(cache.get(cid))
    await asyncio.sleep(0)
    first.cancel()
    with await second as lease:
        assert ChunkId.of(lease.view()) == cid
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.sleep(0.05)
    assert cache.ram.stats().pinned == 0


def _fds_open_on(inode: int) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.stat(f"/proc/self/fd/{fd}").st_ino == inode:
                found.append(fd)
        except FileNotFoundError:
            continue
    return found


EVICTED_READER = textwrap.dedent(
    """
    import mmap, os, sys
    fd, size = int(sys.argv[1]), int(sys.argv[2])
    view = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    os.close(fd)
    print("mapped", flush=True)
    sys.stdin.readline()  # the parent evicts the chunk meanwhile
    import blake3
    print(blake3.blake3(view).hexdigest(), flush=True)
    """
)


async def test_a_chunk_evicted_after_handout_still_reads_in_another_process(
    open_cache: OpenCache,
) -> None:
    cache = await open_cache(ram_bytes=4 << 20)
    data = os.urandom(1 << 20)
    cid = await cache.insert(data)
    lease = await cache.get(cid)
    fd = lease.fileno()
    assert fd is not None
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        EVICTED_READER,
        str(fd),
        str(lease.size),
        pass_fds=[fd],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert child.stdin is not None
    assert child.stdout is not None
    assert (await child.stdout.readline()).strip() == b"mapped"
    inode = os.fstat(fd).st_ino
    assert _fds_open_on(inode) == [str(fd)]
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:chunkd")
    lease.release()
    for _ in range(8):  # churn the RAM tier until the chunk is evicted
        await cache.insert(os.urandom(1 << 20))
    await cache.ram.discard(cid)
    assert not await cache.ram.contains(cid)
    assert not _fds_open_on(inode)  # the tier closed its fd
    child.stdin.write(b"go\n")
    await child.stdin.drain()
    assert (await child.stdout.readline()).decode().strip() == str(cid)
    assert await asyncio.wait_for(child.wait(), 30) == 0


async def test_inserts_leak_no_fds_whatever_happens(open_cache: OpenCache) -> None:
    before = len(_memfds())  # what earlier tests in this process still hold, if anything
    cache = await open_cache(ram_bytes=2 << 20)
    data = os.urandom(1 << 20)  # large enough to be staged in a memfd while hashing
    await cache.insert(data)
    await cache.insert(data)  # already held: the staged copy is closed
    with pytest.raises(IntegrityError):
        await cache.insert(os.urandom(1 << 20), expected=ChunkId.of(b"other"))
    for _ in range(6):  # RAM full of evictable chunks: admitted, older ones closed
        await cache.insert(os.urandom(1 << 20))
    held = cache.ram.stats().chunks
    assert held == 2
    # One memfd per chunk the RAM tier holds, no more, once the disk tier's worker
    # threads have let go of their mappings (mmap holds an fd of its own): a worker
    # drops its call's arguments a moment after the call is reported done.
    for _ in range(500):
        if len(_memfds()) == before + held:
            break
        await asyncio.sleep(0.01)
    assert len(_memfds()) == before + held


def _memfds() -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            # the RAM tier's memfds only (not, say, a checkpoint client's staging spare)
            if os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)") == "/memfd:chunkd":
                found.append(fd)
        except FileNotFoundError:
            continue
    return found
