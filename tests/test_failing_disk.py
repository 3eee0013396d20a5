"""A cache disk that fails: EIO, ENOSPC and a stalled disk under a real daemon.

The daemon's disk tier (``chunks/`` and ``tmp/``, as one device holds both) lives
on a :class:`~chunkd.testing.faultyfs.FaultyDisk`, a FUSE passthrough whose server
runs in a process of its own; the lmdb index stays on the real disk, except in the
test of a stalled index disk. Reads must stay correct (bytes checked against the
source), the tier must say it is degraded and recover, and nothing may be lost from
the index (checked after the daemon stops, with the cache's own API).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from chunkd.cache import CacheConfig, ChunkCache, ChunkId, Index
from chunkd.cache.index import ChunkRecord
from chunkd.testing.faultyfs import FaultyDisk, unavailable

from .conftest import Daemon

CHUNK = 256 << 10
CHUNKS_PER_OBJECT = 4
OBJECT = CHUNK * CHUNKS_PER_OBJECT


@dataclass
class Node:
    """A cache directory whose disk tier is on a faulty disk, and its backend's files."""

    disk: FaultyDisk
    cache: Path
    data: Path
    toml: str

    def put_object(self, name: str) -> bytes:
        body = os.urandom(OBJECT)
        (self.data / name).write_bytes(body)
        return body


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    yield from _node(tmp_path, index_on_faulty_disk=False)


@pytest.fixture
def node_with_index(tmp_path: Path) -> Iterator[Node]:
    yield from _node(tmp_path, index_on_faulty_disk=True)


def _node(tmp_path: Path, *, index_on_faulty_disk: bool) -> Iterator[Node]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"these tests fail a disk through FUSE: {reason}")
    disk = FaultyDisk.start(tmp_path / "nvme-backing", tmp_path / "nvme", log=tmp_path / "fs.log")
    try:
        cache = tmp_path / "cache"
        cache.mkdir()
        # One faulty device under the tier's two directories: the temporary file and
        # its rename land on one file system, as they do on a real NVMe.
        names = ["chunks", "tmp", *(["index"] if index_on_faulty_disk else [])]
        for name in names:
            (disk.mount / name).mkdir()
            (cache / name).symlink_to(disk.mount / name)
        data = tmp_path / "data"
        data.mkdir()
        toml = f"""
[server]
shutdown_timeout = "5s"

[cache]
dir = "{cache}"
ram_bytes = "64MiB"
disk_bytes = "1GiB"
disk_min_free_bytes = 0
chunk_bytes = "{CHUNK // 1024}KiB"
fsync = "{"always" if index_on_faulty_disk else "never"}"
disk_retry_after = "1s"

[[backends]]
name = "local"
url = "file://{data}"
revalidate = "immutable"
"""
        yield Node(disk, cache, data, toml)
    finally:
        disk.stop()


def read_chunk(daemon: Daemon, name: str, index: int) -> tuple[bytes, float]:
    """Chunk ``index`` of object ``name`` through the daemon, and the seconds it took."""
    start = time.monotonic()
    first, last = index * CHUNK, (index + 1) * CHUNK - 1
    status, _, body = daemon.get(f"/v1/objects/local/{name}", {"Range": f"bytes={first}-{last}"})
    assert status == 206, body[:200]
    return body, time.monotonic() - start


def read_all(daemon: Daemon, name: str) -> bytes:
    status, _, body = daemon.get(f"/v1/objects/local/{name}")
    assert status == 200, body[:200]
    return body


def disk_stats(daemon: Daemon) -> dict[str, Any]:
    status, _, body = daemon.get("/v1/stats")
    assert status == 200
    tiers = json.loads(body)["cache"]["tiers"]
    found: dict[str, Any] = next(t for t in tiers if t["name"] == "disk")
    return found


def index_commits(daemon: Daemon) -> int:
    status, _, body = daemon.get("/v1/stats")
    assert status == 200
    return int(json.loads(body)["cache"]["index_commits"])


def wait_for(what: Callable[[], Any], timeout: float, message: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := what():
            return got
        time.sleep(0.05)
    raise AssertionError(message)


def committed_records(cache: Path) -> dict[bytes, ChunkRecord]:
    index = Index(cache / "index", chunk_bytes=CHUNK, sync=False)
    try:
        return dict(index.scan_chunks(None, 1 << 20))
    finally:
        index.close()


async def assert_index_sound(cache: Path) -> int:
    """Every record in the index has its file, and the file holds the chunk's bytes."""
    config = CacheConfig(
        dir=cache, chunk_bytes=CHUNK, disk_min_free_bytes=0, fsync="never", reconcile=False
    )
    async with await ChunkCache.open(config) as opened:
        records = opened.index.scan_chunks(None, 1 << 20)
        for cid, record in records:
            assert opened.disk.path_of(cid).exists(), f"chunk {cid} is indexed, its file is gone"
            data = opened.disk.read_sync(cid)  # verified against its id (and dropped if bad)
            assert data is not None, f"chunk {cid}'s file does not hold its bytes"
            assert len(data) == record.size
            assert ChunkId.of(data) == cid
        return len(records)


async def test_eio_on_reads_is_served_from_the_source_and_the_tier_recovers(
    node: Node, start_daemon: Callable[..., Daemon]
) -> None:
    body = node.put_object("a")
    daemon = start_daemon(node.toml)
    assert read_all(daemon, "a") == body  # into RAM and onto the disk
    wait_for(lambda: disk_stats(daemon)["chunks"] == CHUNKS_PER_OBJECT, 5, "not on disk")
    daemon.stop()

    node.disk.fail_reads(errno.EIO)
    daemon = start_daemon(node.toml)  # RAM is empty: every read goes to the disk first
    assert read_all(daemon, "a") == body
    stats = disk_stats(daemon)
    assert stats["errors"].get("eio", 0) >= 1
    assert "EIO" in stats["degraded"]
    assert node.disk.counts().failed >= 1

    node.disk.heal()
    wait_for(lambda: disk_stats(daemon)["degraded"] is None, 5, "the tier did not recover")
    fresh = node.put_object("b")
    assert read_all(daemon, "b") == fresh
    wait_for(lambda: disk_stats(daemon)["inserts"] >= CHUNKS_PER_OBJECT, 5, "no writes resumed")
    assert read_all(daemon, "a") == body
    assert daemon.stop() == 0
    assert await assert_index_sound(node.cache) >= CHUNKS_PER_OBJECT


async def test_enospc_on_writes_degrades_the_tier_and_reads_go_on(
    node: Node, start_daemon: Callable[..., Daemon]
) -> None:
    daemon = start_daemon(node.toml)
    node.disk.fail_writes(errno.ENOSPC)
    body = node.put_object("full")
    assert read_all(daemon, "full") == body
    stats = disk_stats(daemon)
    assert stats["errors"].get("enospc", 0) >= 1
    assert "ENOSPC" in stats["degraded"]
    assert stats["chunks"] == 0
    assert read_all(daemon, "full") == body  # from RAM
    assert not list((node.cache / "tmp").iterdir()), "a partial file was left"

    node.disk.heal()
    wait_for(lambda: disk_stats(daemon)["degraded"] is None, 5, "the tier did not recover")
    fresh = node.put_object("after")
    assert read_all(daemon, "after") == fresh
    wait_for(lambda: disk_stats(daemon)["chunks"] >= CHUNKS_PER_OBJECT, 5, "no writes resumed")
    assert daemon.stop() == 0
    assert await assert_index_sound(node.cache) >= CHUNKS_PER_OBJECT


async def test_a_stalled_disk_stalls_no_read_and_the_tier_recovers(
    node: Node, start_daemon: Callable[..., Daemon]
) -> None:
    hot, on_disk = node.put_object("hot"), node.put_object("on-disk")
    daemon = start_daemon(node.toml)
    assert read_all(daemon, "hot") == hot
    assert read_all(daemon, "on-disk") == on_disk
    wait_for(lambda: disk_stats(daemon)["chunks"] == 2 * CHUNKS_PER_OBJECT, 5, "not on disk")
    daemon.stop()
    before = committed_records(node.cache)
    assert len(before) == 2 * CHUNKS_PER_OBJECT

    daemon = start_daemon(node.toml)
    assert read_all(daemon, "hot") == hot  # from the disk into RAM; "on-disk" stays on disk
    cold = {f"cold-{i}": node.put_object(f"cold-{i}") for i in range(4)}  # the backend only
    sources = {"hot": hot, "on-disk": on_disk, **cold}

    node.disk.stall()
    jobs = [(name, i) for name in sources for i in range(CHUNKS_PER_OBJECT)] * 2
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda job: (job, *read_chunk(daemon, *job)), jobs))
        stats = disk_stats(daemon)
        healthy = daemon.get("/healthz")[0]
    slowest: dict[str, float] = {}
    for (name, i), got, took in results:
        assert got == sources[name][i * CHUNK : (i + 1) * CHUNK], (name, i)
        kind = name.partition("-")[0]
        slowest[kind] = max(slowest.get(kind, 0.0), took)
    # RAM hits, disk chunks (given up on) and backend chunks: none waits on the disk.
    assert max(slowest.values()) <= 1.0, slowest
    assert healthy == 200
    assert stats["degraded"] is not None
    assert "stalled" in stats["degraded"], stats["degraded"]
    assert stats["errors"].get("stall", 0) == 1
    assert node.disk.counts().stalled >= 1  # the disk's threads are still stuck in it

    node.disk.unstall()
    wait_for(lambda: disk_stats(daemon)["degraded"] is None, 5, "the tier did not recover")
    inserted = disk_stats(daemon)["inserts"]
    fresh = node.put_object("after")
    assert read_all(daemon, "after") == fresh
    wait_for(lambda: disk_stats(daemon)["inserts"] > inserted, 5, "no writes resumed")
    assert daemon.stop() == 0
    after = committed_records(node.cache)
    assert set(before) <= set(after), "records were lost from the index"
    assert await assert_index_sound(node.cache) == len(after)


async def test_a_stalled_index_disk_keeps_the_loop_answering(
    node_with_index: Node, start_daemon: Callable[..., Daemon]
) -> None:
    node = node_with_index
    hot = node.put_object("hot")
    daemon = start_daemon(node.toml)
    assert read_all(daemon, "hot") == hot
    wait_for(lambda: disk_stats(daemon)["chunks"] == CHUNKS_PER_OBJECT, 5, "not on disk")
    await asyncio.sleep(0.2)  # the index commits what it has batched
    cold = {f"cold-{i}": node.put_object(f"cold-{i}") for i in range(3)}

    # Commits and chunk files block in fdatasync (fsync "always"); mapped pages still read.
    node.disk.stall(reads=False)
    took: list[float] = []
    for name, body in {"hot": hot, **cold}.items():
        for i in range(CHUNKS_PER_OBJECT):
            got, seconds = read_chunk(daemon, name, i)
            assert got == body[i * CHUNK : (i + 1) * CHUNK]
            took.append(seconds)
        start = time.monotonic()
        assert daemon.get("/healthz")[0] == 200
        took.append(time.monotonic() - start)
    assert max(took) <= 1.0, took
    wait_for(lambda: node.disk.counts().stalled >= 1, 5, "nothing reached the stalled disk")
    assert disk_stats(daemon)["degraded"] is not None  # its chunk writes stall too
    stalled_at = index_commits(daemon)
    await asyncio.sleep(0.3)
    assert index_commits(daemon) == stalled_at, "a commit went through a stalled disk"

    node.disk.unstall()
    wait_for(lambda: disk_stats(daemon)["degraded"] is None, 5, "the tier did not recover")
    wait_for(lambda: index_commits(daemon) > stalled_at, 5, "commits did not resume")
    assert daemon.stop() == 0
    assert await assert_index_sound(node.cache) >= CHUNKS_PER_OBJECT


async def test_the_index_overlay_is_bounded_while_commits_stall(tmp_path: Path) -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"this test stalls an index disk through FUSE: {reason}")
    from chunkd.cache.index import Locator, ObjectInfo

    with FaultyDisk.start(tmp_path / "backing", tmp_path / "mnt") as disk:
        # Each commit fsyncs: a stalled disk stalls it there (writes land in the page cache).
        index = Index(disk.mount / "index", sync=True, max_pending=100, flush_interval=0.01)
        try:
            kept = [ChunkId.of(os.urandom(16)) for _ in range(20)]
            disk.stall(reads=False)
            index.put_chunk(kept[0], ChunkRecord(16, 16))
            wait_for(lambda: index.commit_running_for > 0.2, 5, "no commit stalled")
            for i in range(500):  # chunk-map entries and sizes: re-learnt, so droppable
                index.record(Locator("b", f"k{i}", "v", 0), kept[0], 16)
                index.put_object(ObjectInfo("b", f"k{i}", "v", 16, index.chunk_bytes))
            for cid in kept[1:]:  # a chunk record is never dropped
                index.put_chunk(cid, ChunkRecord(16, 16))
            assert index.backlog_full
            assert index.backlog <= 100 + len(kept)
            assert index.dropped >= 900
            assert all(index.lookup(cid) is not None for cid in kept)  # read your writes
            disk.unstall()
            wait_for(lambda: index.backlog == 0, 5, "the overlay did not drain")
            assert not index.backlog_full
        finally:
            index.close()
        reopened = Index(disk.mount / "index", sync=False)
        try:
            assert all(reopened.lookup(cid) is not None for cid in kept)
        finally:
            reopened.close()
