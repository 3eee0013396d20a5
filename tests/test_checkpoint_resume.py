"""A save acknowledged at ``local`` survives a restart that finds its chunks evicted.

A daemon killed with -9 restarts with its index as last committed: files whose
records were still batched are adopted by the background reconciliation, which
evicts down to the disk budget (:meth:`chunkd.cache.disk.DiskTier.reconcile`).
The journaled jobs' chunks are pinned only when their job resumes, so that
eviction could take them first: the fault walk
(``tests/test_fault_points.py::...[ckpt.part:eio]``) lost its acknowledged
``local`` save about one run in eight so ("cannot resume: 3 of its chunks are gone
from the disk tier"), though every one of them was in the backend already.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from chunkd.cache import CacheConfig, Chunk, ChunkCache, ChunkId, FsyncPolicy
from chunkd.cache.index import Index
from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.gateway.backends import Backends, make_backend
from chunkd.gateway.checkpoints import Checkpoints
from chunkd.gateway.checkpoints.journal import Journal
from chunkd.gateway.checkpoints.model import Durability, SaveJob, SaveRequest
from chunkd.gateway.config import BackendConfig
from chunkd.gateway.metrics import Metrics
from chunkd.testing import free_port
from tests.conftest import Daemon

CHUNK = 256 << 10


def node_toml(root: Path, data: Path) -> str:
    return f"""
[cache]
dir = "{root / "cache"}"
chunk_bytes = "256KiB"
ram_bytes = "1MiB"
disk_bytes = "8MiB"
disk_min_free_bytes = 0

[[backends]]
name = "data"
url = "file://{data}"
writable = true
"""


def fault_hits(daemon: Daemon, point: str) -> int:
    _, _, body = daemon.get("/v1/stats")
    return int(json.loads(body)["faults"]["hits"].get(point, 0))


def settled_jobs(daemon: Daemon, timeout: float) -> list[dict[str, object]]:
    """The checkpoint jobs once none is running (each ``done`` or ``failed``)."""
    deadline = time.monotonic() + timeout
    while True:
        status, _, body = daemon.get("/v1/stats")
        jobs: list[dict[str, object]] = json.loads(body)["checkpoints"]["jobs"]
        if status == 200 and all(j.get("state") in ("done", "failed") for j in jobs):
            return jobs
        assert time.monotonic() < deadline, f"checkpoint jobs never settled: {jobs}"
        time.sleep(0.05)


@pytest.mark.timeout(30)
def test_a_local_save_whose_chunks_a_restart_evicted_commits_from_the_backends_copies(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    toml = node_toml(tmp_path / "n", data)
    port = free_port()
    # The part PUT fails (EIO) every time: the job stays journaled, its chunks uploaded.
    daemon = start_daemon(
        toml,
        cwd=tmp_path / "n",
        port=port,
        env={"CHUNKD_FAULTS": "ckpt.part:eio"},
        extra_args=("--enable-faults",),
    )
    rng = np.random.default_rng(7)
    state = {f"w{i}": rng.standard_normal(48 << 10).astype(np.float32) for i in range(3)}
    with Client(daemon.cwd / "chunkd.sock") as client:
        result = ckpt.save(state, "data/evicted/step-1", durability="local", client=client)
        assert result.result().durability == "local"
    deadline = time.monotonic() + 10
    while fault_hits(daemon, "ckpt.part") < 1:  # every chunk went up before the part
        assert time.monotonic() < deadline, "the save never reached its part PUT"
        time.sleep(0.02)
    (journal,) = (tmp_path / "n" / "cache" / "checkpoints" / "jobs").glob("*.json")
    cids = [ChunkId.parse(c) for seg in json.loads(journal.read_bytes())["chunks"] for c, _ in seg]
    assert len(cids) == 3
    assert all((data / "chunks" / str(cid)).is_file() for cid in cids)
    daemon.process.kill()
    daemon.process.wait()

    # What the restart's reconciliation did to them in the fault walk, before the job
    # resumed: their records deleted (committed) and their files unlinked.
    index = Index(tmp_path / "n" / "cache" / "index", chunk_bytes=CHUNK)
    try:
        assert len(index.delete_chunks(cids)) == 3
        index.flush()
    finally:
        index.close()
    for cid in cids:
        hexid = str(cid)
        (tmp_path / "n" / "cache" / "chunks" / hexid[:2] / hexid[2:4] / hexid).unlink()

    again = start_daemon(toml, cwd=tmp_path / "n", port=port)
    jobs = settled_jobs(again, 20)
    assert not [j for j in jobs if j.get("state") == "failed"], jobs
    with Client(again.cwd / "chunkd.sock") as client:
        back = ckpt.load("data/evicted/step-1", client=client)
    assert list(back) == list(state)
    for key, array in state.items():
        assert back[key].tobytes() == array.tobytes(), key
    log = again.log.read_text()
    assert "resuming checkpoint data/evicted/step-1" in log
    assert "Traceback" not in log


def request_of(chunks: int) -> SaveRequest:
    return SaveRequest(
        backend="data",
        path="journaled/step-1",
        save_id="s1",
        rank=0,
        world_size=1,
        durability=Durability.LOCAL,
        overwrite=False,
        commit="auto",
        step=None,
        segments=[(i * CHUNK, CHUNK) for i in range(chunks)],
        tree={},
    )


async def put_chunks(cache: ChunkCache, count: int, seed: int) -> list[ChunkId]:
    """``count`` new chunks on the disk tier, each used later than the one before."""
    rng = np.random.default_rng(seed)
    cids = []
    for _ in range(count):
        chunk = Chunk.of(rng.integers(0, 256, CHUNK, dtype=np.uint8).tobytes())
        assert await cache.disk.put(chunk)
        cids.append(chunk.id)
        await asyncio.sleep(0.003)  # the index orders last use by the millisecond
    return cids


def config(root: Path, disk_bytes: int) -> CacheConfig:
    return CacheConfig(
        dir=root,
        ram_bytes=1 << 20,
        disk_bytes=disk_bytes,
        disk_min_free_bytes=0,
        chunk_bytes=CHUNK,
        fsync=FsyncPolicy.NEVER,
    )


@pytest.mark.timeout(30)
async def test_journaled_chunks_pinned_as_the_cache_opens_outlive_its_reconciliation(
    tmp_path: Path,
) -> None:
    # A cache as a kill -9 leaves it: a journaled save's 3 chunks, the oldest; 9 the
    # node read since, of which the index lost the last 2 records (files kept); and
    # over its budget once those are adopted again (2 MiB for 12 chunks of 256 KiB).
    root = tmp_path / "cache"
    cache = await ChunkCache.open(config(root, 8 << 20))
    try:
        journaled = await put_chunks(cache, 3, seed=1)
        read_since = await put_chunks(cache, 9, seed=2)
        job = SaveJob(id="j1", request=request_of(3))
        job.chunks = [[(cid, CHUNK)] for cid in journaled]
        job.logical = 3 * CHUNK
        journal = Journal(root / "checkpoints")
        journal.make_dirs()
        journal.write(job)
    finally:
        await cache.close()
    index = Index(root / "index", chunk_bytes=CHUNK)
    try:
        assert len(index.delete_chunks(read_since[-2:])) == 2
        index.flush()
    finally:
        index.close()
    unpinned = tmp_path / "unpinned"
    shutil.copytree(root, unpinned)

    # Opened as the daemon opened it, the job resuming later: they are evicted first.
    cache = await ChunkCache.open(config(unpinned, 2 << 20))
    try:
        assert (await cache.wait_reconciled())["orphans_adopted"] == 2
        assert all(cache.index.lookup(cid) is None for cid in journaled)
    finally:
        await cache.close()

    # Read before the open, pinned by it before its reconciliation starts: they stay,
    # and the job resumes from them, commits, and leaves nothing pinned.
    held = await Checkpoints.journaled_chunks(root / "checkpoints")
    assert held == set(journaled)
    cache = await ChunkCache.open(config(root, 2 << 20), pinned=held)
    try:
        assert (await cache.wait_reconciled())["orphans_adopted"] == 2
        assert all(cache.index.lookup(cid) is not None for cid in journaled)
        assert cache.disk.used_bytes <= 2 << 20  # the others made the room
        (tmp_path / "data").mkdir()
        metrics = Metrics()
        backend = make_backend(
            BackendConfig(name="data", url=f"file://{tmp_path / 'data'}", writable=True), metrics
        )
        store = Checkpoints(cache, Backends([backend]), metrics, root / "checkpoints", held=held)
        try:
            assert await store.start() == 1
            done = await store.wait("j1", Durability.REMOTE, 20)
            assert done.error is None
            assert cache.disk.pinned == 0
        finally:
            await store.close()
    finally:
        await cache.close()
    for cid in journaled:
        assert (tmp_path / "data" / "chunks" / str(cid)).read_bytes()  # committed whole
    assert (tmp_path / "data" / "checkpoints" / "journaled" / "step-1" / "manifest.json").is_file()


@pytest.mark.timeout(30)
def test_a_save_an_older_daemon_journaled_with_a_key_utf8_cannot_hold_still_commits(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    # Before canonical JSON was one function, the daemon took a state-tree key with a lone
    # surrogate (a valid escape on the wire) and journaled the save. A daemon of today
    # refuses such a save up front, but one it resumes was acknowledged at `local`: it
    # must still commit, its part written as the older daemon would have written it.
    data = tmp_path / "data"
    data.mkdir()
    toml = node_toml(tmp_path / "n", data)
    port = free_port()
    daemon = start_daemon(
        toml,
        cwd=tmp_path / "n",
        port=port,
        env={"CHUNKD_FAULTS": "ckpt.part:eio"},
        extra_args=("--enable-faults",),
    )
    state = {"kX": np.arange(4096, dtype=np.float32)}
    with Client(daemon.cwd / "chunkd.sock") as client:
        result = ckpt.save(state, "data/old/step-1", durability="local", client=client)
        assert result.result().durability == "local"
    deadline = time.monotonic() + 10
    while fault_hits(daemon, "ckpt.part") < 1:
        assert time.monotonic() < deadline, "the save never reached its part PUT"
        time.sleep(0.02)
    daemon.process.kill()
    daemon.process.wait()
    # The journal as the older daemon wrote it: the tree's key holds a lone surrogate.
    (journal,) = (tmp_path / "n" / "cache" / "checkpoints" / "jobs").glob("*.json")
    text = journal.read_text()
    assert text.count('"kX"') >= 1
    journal.write_text(text.replace('"kX"', '"k\\udc80"'))

    again = start_daemon(toml, cwd=tmp_path / "n", port=port)
    jobs = settled_jobs(again, 20)
    assert not [j for j in jobs if j.get("state") == "failed"], jobs
    with Client(again.cwd / "chunkd.sock") as client:
        back = ckpt.load("data/old/step-1", client=client)
    assert list(back) == ["k\udc80"]
    assert back["k\udc80"].tobytes() == state["kX"].tobytes()
    log = again.log.read_text()
    assert "resuming checkpoint data/old/step-1" in log
    assert "Traceback" not in log
