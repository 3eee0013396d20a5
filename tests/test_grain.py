"""chunkd.client.grain with the real ``grain`` package: a snapshot as Grain's data source,
chunkd's order under Grain's loader, and the chunkd-ordered ``IterDataset`` whose state
resumes at any worker count, through Grain's own (spawned) prefetch processes.
"""

from __future__ import annotations

import functools
import json
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .conftest import wait_for_socket
from .test_dataset_order import memory_dataset, parquet_dataset

grain = pytest.importorskip("grain")

from chunkd.client import Client  # noqa: E402
from chunkd.client.datasets import Dataset  # noqa: E402
from chunkd.client.datasets.formats import format_of  # noqa: E402
from chunkd.client.datasets.loader import Loader, order_of  # noqa: E402
from chunkd.client.datasets.order import Order  # noqa: E402
from chunkd.client.datasets.source import PinnedSource  # noqa: E402
from chunkd.client.datasets.state import MAX_STATE_BYTES, LoaderState  # noqa: E402
from chunkd.client.grain import (  # noqa: E402
    ChunkdIterDataset,
    GrainSource,
    OrderSampler,
    global_state,
)
from chunkd.errors import ResumeStateError  # noqa: E402
from chunkd.snapshot import Member, Snapshot  # noqa: E402

SEED = 77
RECORD = 8


def test_a_snapshot_is_a_random_access_source_for_grains_own_order() -> None:
    dataset, expected = memory_dataset([5, 0, 9, 4])
    source = GrainSource(dataset)
    assert len(source) == 18
    assert repr(source) == f"chunkd.GrainSource(snapshot={dataset.id})"
    records = [bytes(source[i]) for i in range(len(source))]
    ids = [dataset.sample_id(*dataset.snapshot.locate(i)) for i in range(18)]
    assert records == [expected[sid] for sid in ids]
    assert isinstance(source[0], np.ndarray)  # a view becomes an array Grain can move

    # Grain's own sampler and loader set the order
    sampler = grain.samplers.IndexSampler(18, shuffle=True, seed=SEED, num_epochs=1)
    loader = grain.DataLoader(data_source=source, sampler=sampler, worker_count=0)
    got = [bytes(r) for r in loader]
    assert sorted(got) == sorted(records)
    assert got != records
    # and Grain's datasets too
    shuffled = grain.MapDataset.source(source).shuffle(seed=SEED)
    assert sorted(bytes(shuffled[i]) for i in range(18)) == sorted(records)


def test_chunkds_order_under_grains_loader() -> None:
    dataset, _ = memory_dataset([6, 3, 0, 11, 7])
    source = GrainSource(dataset)
    order = order_of(dataset.snapshot, LoaderState(dataset.id, SEED, 0, 0))  # the loader's
    records = [bytes(source[i]) for i in range(len(source))]
    sampler = OrderSampler(source, seed=SEED, num_epochs=2)
    assert len(sampler) == 54
    loader = grain.DataLoader(data_source=source, sampler=sampler, worker_count=0)
    got = [bytes(r) for r in loader]
    epoch1 = order_of(dataset.snapshot, LoaderState(dataset.id, SEED, 1, 0))
    assert got == [records[i] for i in order.indices(np.arange(27)).tolist()] + [
        records[i] for i in epoch1.indices(np.arange(27)).tolist()
    ]
    # Grain's loader shards the records: rank r of W takes records r, r+W, ...
    one = OrderSampler(source, seed=SEED)
    ranks = [
        [
            bytes(r)
            for r in grain.DataLoader(
                data_source=source,
                sampler=one,
                worker_count=0,
                shard_options=grain.sharding.ShardOptions(shard_index=r, shard_count=3),
            )
        ]
        for r in range(3)
    ]
    assert [ranks[r] for r in range(3)] == [got[r:27:3] for r in range(3)]
    with pytest.raises(IndexError):
        one[27]


def test_the_order_sampler_orders_parquet_by_row_groups_as_the_loader_does() -> None:
    dataset = parquet_dataset(files=3, groups=4, rows=5)
    sampler = OrderSampler(dataset, seed=SEED, window=2)
    keys = [sampler[i].record_key for i in range(len(dataset))]
    order = order_of(dataset.snapshot, LoaderState(dataset.id, SEED, 0, 0, window=2))
    assert keys == order.indices(np.arange(len(dataset))).tolist()
    loader = Loader(dataset, batch_size=len(dataset), seed=SEED, window=2)
    assert [s["id"] for s in next(iter(loader)).samples] == keys  # row i holds id i
    # and that is by units: not the order of members as one unit each
    by_members = Order(dataset.snapshot.counts, snapshot=dataset.id, seed=SEED, epoch=0, window=2)
    assert keys != by_members.indices(np.arange(len(dataset))).tolist()


def test_the_chunkd_iter_dataset_is_the_loaders_order_and_state() -> None:
    dataset, expected = memory_dataset([7, 0, 12, 5, 9])
    for rank in (0, 1):
        plain = [b.ids for b in Loader(dataset, batch_size=3, seed=SEED, rank=rank, world_size=2)]
        ds = ChunkdIterDataset(dataset, batch_size=3, seed=SEED, rank=rank, world_size=2)
        batches = list(ds)
        assert [b.ids for b in batches] == plain
        for batch in batches:
            assert [bytes(s) for s in batch.samples] == [expected[s] for s in batch.ids]

    stop = random.Random(3).randrange(1, 5)
    it = iter(ChunkdIterDataset(dataset, batch_size=3, seed=SEED, world_size=2))
    head = [next(it).ids for _ in range(stop)]
    state = it.get_state()
    assert state == LoaderState(dataset.id, SEED, 0, stop * 6).to_dict()
    assert len(json.dumps(state, separators=(",", ":"))) <= MAX_STATE_BYTES
    # resumed through set_state, or as a dataset that starts from the state
    again = iter(ChunkdIterDataset(dataset, batch_size=3, seed=SEED, world_size=2))
    again.set_state(json.loads(json.dumps(state)))
    rest = [b.ids for b in again]
    whole = [b.ids for b in ChunkdIterDataset(dataset, batch_size=3, seed=SEED, world_size=2)]
    assert head + rest == whole
    assert again.get_state()["cursor"] == 33
    # elastically: 3 ranks of 2 from there read the rest once
    rest_ids = Counter(
        sid
        for r in range(3)
        for b in ChunkdIterDataset(
            dataset, batch_size=2, seed=SEED, rank=r, world_size=3, state=state
        )
        for sid in b.ids
    )
    positions = [sid for b in Loader(dataset, batch_size=1, seed=SEED) for sid in b.ids]
    assert set(rest_ids) == set(positions[stop * 6 :])
    assert max(rest_ids.values()) == 1

    with pytest.raises(ResumeStateError, match="of seed"):
        ChunkdIterDataset(dataset, batch_size=3, seed=SEED + 1, state=state)
    with pytest.raises(ResumeStateError, match="does not parse"):
        again.set_state("{oops")  # type: ignore[arg-type]
    with pytest.raises(ResumeStateError, match="row groups"):
        again.set_state({"format": "chunkd.ShardDataset/1", "epoch": 0, "position": 3})


# -- through Grain's prefetch processes, over a real daemon -------------------------------


@dataclass
class OnDaemon:
    """A snapshot of fixed records in a daemon's ``local`` backend."""

    dataset: Dataset
    expected: dict[str, bytes]
    factory: Callable[[], Client]


@pytest.fixture
def on_daemon(start_daemon: Any, tmp_path: Path) -> Iterator[OnDaemon]:
    data = tmp_path / "chunkd-data"
    rng = random.Random(5)
    expected: dict[str, bytes] = {}
    for i, count in enumerate([13, 0, 20, 7, 16]):
        records = [rng.randbytes(RECORD) for _ in range(count)]
        path = data / f"grain/part-{i}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"".join(records))
        expected.update({f"grain/part-{i}.bin#{j}": r for j, r in enumerate(records)})
    start_daemon()
    socket = tmp_path / "chunkd.sock"
    if not wait_for_socket(socket, 10):
        pytest.skip(f"`chunkd serve` did not create its local socket {socket} in 10 s")
    client = Client(socket)
    source = PinnedSource(client, "local")
    fixed = format_of("fixed")
    members = []
    for i in range(5):
        stat = client.stat(f"local/grain/part-{i}.bin")
        member = Member(f"grain/part-{i}.bin", stat.size, stat.version, "fixed")
        members.append(fixed.scan(source, member, {"record_bytes": RECORD}))
    snapshot = Snapshot.build(backend="local", prefix="grain/", format="fixed", members=members)
    yield OnDaemon(Dataset(snapshot, source), expected, functools.partial(Client, socket))
    client.close()


def test_grain_prefetch_workers_resume_at_another_worker_count(on_daemon: OnDaemon) -> None:
    dataset, expected, factory = on_daemon.dataset, on_daemon.expected, on_daemon.factory

    def pipeline(workers: int, state: Any = None) -> Any:
        ds = ChunkdIterDataset(
            dataset, batch_size=4, seed=SEED, state=state, client_factory=factory
        )
        return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))

    whole = [b.ids for b in ChunkdIterDataset(dataset, batch_size=4, seed=SEED)]
    assert len(whole) == 14  # 56 records

    it = iter(pipeline(2))
    head = [next(it) for _ in range(5)]
    assert [b.ids for b in head] == whole[:5]  # workers' batches, in step order
    for batch in head:
        assert [bytes(s) for s in batch.samples] == [expected[s] for s in batch.ids]
    raw = it.get_state()
    assert json.dumps(raw).count('"chunkd.loader.worker/1"') == 2  # each worker's own
    state = global_state(raw)  # the workers read ahead; the state does not
    it.close()
    assert state["cursor"] == 20
    assert len(json.dumps(state, separators=(",", ":"))) <= MAX_STATE_BYTES

    rest = iter(pipeline(3, state))
    tail = [b.ids for b in rest]
    rest.close()
    assert [b.ids for b in head] + tail == whole
    seen = Counter(sid for ids in whole for sid in ids)
    assert set(seen) == set(expected)
    assert max(seen.values()) == 1
