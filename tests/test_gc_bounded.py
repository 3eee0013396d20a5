"""Garbage collection at bounded memory: the marked ids go to disk in sorted runs and
are merged against the key-ordered listing of ``chunks/`` (gateway/checkpoints/mark.py).

These run the collector in this process over a real file backend, so that its Python
heap can be measured (tracemalloc sees every thread's allocations).
"""

from __future__ import annotations

import json
import os
import random
import time
import tracemalloc
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import blake3
import pytest

from chunkd.gateway.backends import Backend, Backends, make_backend
from chunkd.gateway.checkpoints import barrier as barrier_module
from chunkd.gateway.checkpoints.catalog import Catalog
from chunkd.gateway.checkpoints.gc import Collector
from chunkd.gateway.checkpoints.jobs import Jobs
from chunkd.gateway.checkpoints.mark import RUN_IDS, MarkSet
from chunkd.gateway.config import BackendConfig
from chunkd.gateway.metrics import Metrics

MiB = 1 << 20
#: the generated live ids of the big test: a set of them as str is about 42 MB
LIVE_IDS = 300_000
#: what the collection of LIVE_IDS may add to the Python heap at its peak
HEAP_BOUND = 16 * MiB


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[tuple[Backends, Path]]:
    """A writable file backend 'local' at ``tmp_path/local``."""
    root = tmp_path / "local"
    root.mkdir()
    config = BackendConfig(name="local", url=f"file://{root}", writable=True)
    backends = Backends([make_backend(config, Metrics())])
    try:
        yield backends, root
    finally:
        for backend in backends:
            await backend.close()


def put_chunks(root: Path, count: int, tag: str) -> list[str]:
    """``count`` real chunks in ``root/chunks``, written an hour ago; their ids."""
    (root / "chunks").mkdir(exist_ok=True)
    hour_ago = time.time() - 3600
    ids = []
    for n in range(count):
        data = f"{tag} {n}".encode()
        cid = blake3.blake3(data).hexdigest()
        path = root / "chunks" / cid
        path.write_bytes(data)
        os.utime(path, (hour_ago, hour_ago))
        ids.append(cid)
    return ids


def put_json(root: Path, key: str, doc: Any, *, age: float = 0.0) -> None:
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    if age:
        then = time.time() - age
        os.utime(path, (then, then))


def commit_checkpoint(root: Path, path: str, chunks: list[str]) -> None:
    """A committed checkpoint at ``path`` whose one part names ``chunks``."""
    part = f"checkpoints/{path}/parts/s1/0.json"
    put_json(root, part, {"segments": [{"chunks": [[c, 1] for c in chunks]}]})
    put_json(root, f"checkpoints/{path}/manifest.json", {"parts": [{"key": part}]})


def generated_ids(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [rng.randbytes(32).hex() for _ in range(count)]


@pytest.mark.timeout(60)
async def test_gc_over_300k_live_ids_holds_a_bounded_heap_and_deletes_exactly_the_dead(
    store: tuple[Backends, Path], tmp_path: Path
) -> None:
    backends, root = store
    rooted = put_chunks(root, 20, "rooted")
    intended = put_chunks(root, 20, "intended")
    saved = put_chunks(root, 20, "saved")
    dead = put_chunks(root, 30, "dead")
    put_json(root, "intents/save.0.json", {"chunks": intended})
    commit_checkpoint(root, "run/step-1", saved)
    (root / "chunks" / "not-a-chunk-id").write_bytes(b"x")  # old, named by nothing
    os.utime(root / "chunks" / "not-a-chunk-id", (time.time() - 3600,) * 2)

    # Most live ids name no chunk here: the bound is about the ids, not the chunks.
    # They come out of order, repeated (a chunk shared by many checkpoints), and a
    # few are not chunk ids at all; each is made as it is read (as a frozen record's).
    async def roots(backend: Backend) -> AsyncGenerator[str, None]:
        rng = random.Random(1)
        for n in range(LIVE_IDS):
            yield rng.randbytes(32).hex()
            if n % 10 == 0:
                yield rooted[n // 10 % len(rooted)]
        yield "NOT AN ID"

    jobs = Jobs()
    collector = Collector(Catalog(backends, jobs), jobs, roots, mark_dir=tmp_path / "mark")
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        report = await collector.gc("local", keep_last=None, grace=0, dry_run=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        await jobs.close()
    grew = (peak - before) / MiB
    assert peak - before < HEAP_BOUND, f"the collection's heap grew by {grew:.1f} MiB"
    left = {p.name for p in (root / "chunks").iterdir()}
    assert left == set(rooted) | set(intended) | set(saved)
    assert report["swept"] == len(dead) + 1
    assert report["referenced"] == 60
    assert report["root_chunks"] == LIVE_IDS + LIVE_IDS // 10 + 1
    # Its runs are gone with it.
    assert not list((tmp_path / "mark").iterdir())


@pytest.mark.timeout(30)
async def test_the_mark_merges_runs_into_one_ascending_stream_without_repeats(
    tmp_path: Path,
) -> None:
    # More than one run, several levels' worth of merging for the same ids.
    ids = generated_ids(RUN_IDS * 3 + 17, seed=2)
    asked = sorted({*ids, *generated_ids(5000, seed=3)})
    async with MarkSet(tmp_path) as marked:
        await marked.extend(ids)
        await marked.extend(ids[:1000])  # repeats
        await marked.extend(["", "A" * 64, "00"])  # not chunk ids: left out
        live = await marked.live()
        held = []
        for start in range(0, len(asked), 977):
            held += await live.holding([bytes.fromhex(c) for c in asked[start : start + 977]])
    wanted = set(ids)
    assert held == [c in wanted for c in asked]
    assert marked.ignored == 3
    assert not os.listdir(tmp_path)


@pytest.mark.timeout(30)
async def test_intents_read_again_after_a_gap_in_the_barrier_keep_their_chunks(
    store: tuple[Backends, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rewrite of the barrier that ends past its expiry is a gap: a save may have
    taken the collection for dead, written its intent and deduplicated against a chunk
    the collection found unreferenced. The intents are read again before the next
    delete, and that chunk is kept; the others go."""
    backends, root = store
    backend = backends.get("local")
    doomed = put_chunks(root, 40, "doomed")
    first = min(doomed)  # deleted before the gap, in the first group
    saved = sorted(doomed)[-5:]  # what the save deduplicated against during the gap
    expiry = barrier_module.Barrier(backend, "local").expiry
    jump = 0.0
    clock = barrier_module._clock
    monkeypatch.setattr(barrier_module, "_clock", lambda: clock() + jump)
    put = backend.put
    writes = 0

    async def put_then(key: str, data: bytes | memoryview, **kwargs: Any) -> bool:
        nonlocal jump, writes
        done = await put(key, data, **kwargs)
        if key.startswith("gc/"):
            writes += 1
            if writes == 2:  # the first rewrite during the sweep: it ends late
                put_json(root, "intents/during-gap.0.json", {"chunks": saved})
                jump += 2 * expiry
        return done

    monkeypatch.setattr(backend, "put", put_then)
    deletes = backend.delete

    async def delete_first(key: str) -> None:
        nonlocal jump
        await deletes(key)
        if key == f"chunks/{first}" and writes == 1:
            jump += expiry / 8 + 1  # past expiry/8: the barrier is rewritten before the next group

    monkeypatch.setattr(backend, "delete", delete_first)
    jobs = Jobs()
    collector = Collector(Catalog(backends, jobs), jobs, None, mark_dir=tmp_path / "mark")
    try:
        report = await collector.gc("local", keep_last=None, grace=0, dry_run=False)
    finally:
        await jobs.close()
    assert report["intent_rereads"] >= 1
    assert {p.name for p in (root / "chunks").iterdir()} == set(saved)
    assert report["referenced"] == len(saved)
