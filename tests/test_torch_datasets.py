"""chunkd.client.torch: zero-copy tensors, and datasets read through a real daemon.

Every test that reads runs ``chunkd serve`` (the ``start_daemon`` fixture) over a few
JSON lines, fixed-record and Parquet shards in its ``local`` backend, and reads them
with torch's DataLoader (workers included) and torchdata's StatefulDataLoader, each
rank's loader with its own worker processes.
"""

from __future__ import annotations

import functools
import gc
import io
import itertools
import json
import pickle
import random
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .conftest import wait_for_socket

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader  # noqa: E402

from chunkd.client import Client  # noqa: E402
from chunkd.client.datasets import Dataset  # noqa: E402
from chunkd.client.datasets.formats import snapshot_units  # noqa: E402
from chunkd.client.datasets.loader import Batch, Loader, order_of  # noqa: E402
from chunkd.client.datasets.state import MAX_STATE_BYTES, LoaderState  # noqa: E402
from chunkd.client.torch import (  # noqa: E402
    RecordDataset,
    ShardDataset,
    SnapshotDataset,
    as_tensor,
    global_state,
    split_sample_id,
)
from chunkd.errors import ResumeStateError  # noqa: E402

RECORD = 16
SEED = 20240611
FIXED = [9, 0, 12, 25, 30, 24]  # 100 records, one shard empty

# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates on every loader made.
stateful_warning = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
# Some tests run more workers than the machine has cores, on purpose (a few processes each).
many_workers = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


# -- a daemon with shards ----------------------------------------------------------------


@dataclass
class Node:
    """A running daemon and what its ``local`` backend holds."""

    socket: Path
    jsonl: list[str] = field(default_factory=list)
    fixed: list[str] = field(default_factory=list)
    parquet: list[str] = field(default_factory=list)
    #: sample id (KEY#i) -> its bytes (JSON lines, records) or its row (Parquet)
    samples: dict[str, Any] = field(default_factory=dict)

    @property
    def factory(self) -> Callable[[], Client]:
        return functools.partial(Client, self.socket)

    def dataset(self, kind: str, **options: Any) -> ShardDataset:
        shards = {"jsonl": self.jsonl, "fixed": self.fixed, "parquet": self.parquet}[kind]
        options.setdefault("seed", SEED)
        if kind == "fixed":
            options.setdefault("record_bytes", RECORD)
        return ShardDataset(shards, kind=kind, client_factory=self.factory, **options)  # type: ignore[arg-type]

    def ids(self, kind: str) -> set[str]:
        return {sid for sid in self.samples if sid.startswith(f"{kind}/")}


def key(name: str) -> str:
    return name.partition("/")[2]


@pytest.fixture
def node(start_daemon: Any, tmp_path: Path) -> Node:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    data = tmp_path / "chunkd-data"
    rng = random.Random(11)
    node = Node(tmp_path / "chunkd.sock")

    def put(key: str, content: bytes) -> str:
        (data / key).parent.mkdir(parents=True, exist_ok=True)
        (data / key).write_bytes(content)
        return f"local/{key}"

    # JSON lines: an empty shard, one without a final newline, one with an empty line.
    for i, (count, last_newline) in enumerate([(7, True), (0, True), (13, False), (5, True)]):
        lines = [json.dumps({"shard": i, "line": j}).encode() for j in range(count)]
        if i == 3:
            lines[2] = b""
        body = b"\n".join(lines) + (b"\n" if lines and last_newline else b"")
        name = put(f"jsonl/part-{i}.jsonl", body)
        node.jsonl.append(name)
        node.samples.update({f"{key(name)}#{j}": line for j, line in enumerate(lines)})
    for i, count in enumerate(FIXED):
        records = [rng.randbytes(RECORD) for _ in range(count)]
        name = put(f"fixed/part-{i}.bin", b"".join(records))
        node.fixed.append(name)
        node.samples.update({f"{key(name)}#{j}": record for j, record in enumerate(records)})
    for i, (rows, group) in enumerate([(10, 4), (6, 2), (5, 8)]):
        table = pa.table({"shard": [i] * rows, "row": list(range(rows))})
        sink = io.BytesIO()
        pq.write_table(table, sink, row_group_size=group)
        name = put(f"parquet/part-{i}.parquet", sink.getvalue())
        node.parquet.append(name)
        for j, row in enumerate(table.to_pylist()):
            node.samples[f"{key(name)}#{j}"] = row
    start_daemon()
    if not wait_for_socket(node.socket, 10):
        pytest.skip(f"`chunkd serve` did not create its local socket {node.socket} in 10 s")
    return node


def ids(batches: Iterable[Batch]) -> list[list[str]]:
    """The sample ids of each batch."""
    return [list(batch.ids) for batch in batches]


def flat(batches: Iterable[Batch]) -> list[str]:
    return [sid for batch in batches for sid in batch.ids]


# -- as_tensor ---------------------------------------------------------------------------


def test_as_tensor_shares_the_mapped_bytes_without_a_warning(node: Node) -> None:
    name = node.fixed[2]
    expected = b"".join(node.samples[f"{key(name)}#{j}"] for j in range(12))
    with Client(node.socket) as client:
        view = client.read(name)
        assert view.readonly
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tensor = as_tensor(view)
            ints = as_tensor(view, torch.int32, shape=(12, 4))
        assert caught == []
        assert tensor.dtype == torch.uint8
        assert bytes(tensor.numpy()) == expected
        # The same memory, not a copy.
        address = np.frombuffer(view, dtype=np.uint8).ctypes.data
        assert tensor.data_ptr() == ints.data_ptr() == address
        assert ints.shape == (12, 4)
        assert ints.numpy().tobytes() == expected

        # The tensor keeps the mapping alive after the view and the client are gone.
        del view
        client.close()
        gc.collect()
        assert bytes(tensor.numpy()) == expected

    copied = as_tensor(memoryview(expected).toreadonly(), copy=True)
    copied[0] ^= 0xFF  # a copy is writable, and is its own
    assert bytes(copied.numpy())[1:] == expected[1:]
    assert copied[0] != expected[0]
    assert as_tensor(b"").shape == (0,)
    with pytest.raises(ValueError, match="multiple of 4"):
        as_tensor(memoryview(expected)[:10], torch.float32)
    with pytest.raises(ValueError, match="shape"):
        as_tensor(memoryview(expected), shape=(5, 5))


# -- RecordDataset -----------------------------------------------------------------------


def test_record_dataset_reads_ranges_in_the_process_and_in_workers(node: Node) -> None:
    name = node.fixed[0]
    records = [(name, j * RECORD, RECORD) for j in range(9)]
    expected = [node.samples[f"{key(name)}#{j}"] for j in range(9)]

    views = RecordDataset(records, node.factory)
    assert len(views) == 9
    assert isinstance(views[3], memoryview)
    assert views[3].readonly
    assert [bytes(views[j]) for j in range(9)] == expected

    # A view does not pickle: in workers, a transform makes a tensor of each record.
    tensors = RecordDataset(records, node.factory, transform=as_tensor)
    loader = DataLoader(tensors, batch_size=4, num_workers=2)
    batches = list(loader)
    assert [b.shape[0] for b in batches] == [4, 4, 1]
    assert [bytes(row.numpy()) for row in torch.cat(batches)] == expected
    # Unbatched, each zero-copy tensor itself leaves its worker (torch copies it).
    unbatched = DataLoader(tensors, batch_size=None, num_workers=2)
    assert [bytes(t.numpy()) for t in unbatched] == expected

    # A connected client pickles as a way to connect again.
    with Client(node.socket) as client:
        connected = RecordDataset(records, client, transform=bytes)
        assert connected[1] == expected[1]
        again = pickle.loads(pickle.dumps(connected))
    assert again[8] == expected[8]

    short = RecordDataset([(name, 8 * RECORD, 2 * RECORD)], node.factory)
    with pytest.raises(ValueError, match="ends after 16"):
        short[0]


# -- the one order, in torch -------------------------------------------------------------


def test_batches_are_the_cores_and_every_sample_comes_once(node: Node) -> None:
    dataset = node.dataset("fixed", rank=0, world_size=2, batch_size=3)
    snapshot = dataset.dataset
    assert isinstance(snapshot, Dataset)
    assert dataset.total_samples() == len(snapshot) == 100
    assert [m.key for m in snapshot.snapshot.members] == sorted(key(n) for n in node.fixed)
    seen: list[str] = []
    for rank in (0, 1):
        ranked = node.dataset("fixed", rank=rank, world_size=2, batch_size=3)
        batches = list(ranked)
        # one implementation: the plain loader over the same snapshot reads the same
        plain = Loader(snapshot, batch_size=3, seed=SEED, rank=rank, world_size=2)
        assert ids(batches) == [b.ids for b in plain]
        for batch in batches:
            assert batch.samples.dtype == torch.uint8
            assert batch.samples.shape == (len(batch.ids), RECORD)
            rows = [bytes(row.numpy()) for row in batch.samples]
            assert rows == [node.samples[sid] for sid in batch.ids]
        assert [b.step for b in batches] == list(range(17))  # 100 over steps of 6
        assert batches[-1].last
        assert [len(b.ids) for b in batches[-1:]] == [2]  # 4 left: 2 and 2
        seen += flat(batches)
    assert sorted(seen) == sorted(node.ids("fixed"))

    # deterministic per (snapshot, seed, epoch); another epoch, another order
    again = node.dataset("fixed", batch_size=4)
    assert flat(again) == flat(node.dataset("fixed", batch_size=4))
    later = node.dataset("fixed", batch_size=4)
    later.set_epoch(1)
    assert flat(later) != flat(again)
    assert sorted(flat(later)) == sorted(node.ids("fixed"))
    assert flat(node.dataset("fixed", batch_size=4, seed=SEED + 1)) != flat(again)
    # unshuffled: members in key order, samples as stored
    in_order = flat(node.dataset("fixed", batch_size=7, shuffle=False))
    assert in_order == sorted(
        node.ids("fixed"), key=lambda s: (split_sample_id(s)[0], split_sample_id(s)[1])
    )


@many_workers
def test_workers_yield_a_ranks_batches_in_step_order(node: Node) -> None:
    for rank in (0, 2):
        dataset = node.dataset("fixed", rank=rank, world_size=3, batch_size=4)
        expected = ids(dataset)
        for workers in (1, 2, 3):
            loader = DataLoader(dataset, batch_size=None, num_workers=workers)
            got = list(loader)
            assert ids(got) == expected, (rank, workers)
            assert [b.step for b in got] == list(range(len(expected)))
            assert all(isinstance(b, Batch) for b in got)


def test_tails_reach_the_trainer(node: Node) -> None:
    # 100 samples, 3 ranks of 8: steps of 24; 4 are left for the last
    uneven = [list(node.dataset("fixed", rank=r, world_size=3, batch_size=8)) for r in range(3)]
    assert [len(b) for b in uneven] == [5, 5, 5]
    assert [len(b[-1].ids) for b in uneven] == [2, 1, 1]
    pad = [
        list(node.dataset("fixed", rank=r, world_size=3, batch_size=8, tail="pad"))
        for r in range(3)
    ]
    assert [[len(b.ids) for b in ranked] for ranked in pad] == [[8] * 5] * 3
    assert [ranked[-1].padding for ranked in pad] == [4, 8, 8]
    real = [sid for ranked in pad for b in ranked for sid in b.ids[: len(b.ids) - b.padding]]
    assert sorted(real) == sorted(node.ids("fixed"))
    drop = [
        list(node.dataset("fixed", rank=r, world_size=3, batch_size=8, tail="drop"))
        for r in range(3)
    ]
    assert [len(b) for b in drop] == [4, 4, 4]


# -- resuming ----------------------------------------------------------------------------


@stateful_warning
@many_workers
def test_stateful_dataloader_resumes_with_the_same_or_other_num_workers(node: Node) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    rng = random.Random(9)
    snapshot = node.dataset("fixed").dataset

    def make(rank: int, workers: int) -> Any:
        dataset = SnapshotDataset(snapshot, seed=SEED, rank=rank, world_size=2, batch_size=3)
        return stateful.StatefulDataLoader(dataset, batch_size=None, num_workers=workers)

    for rank in (0, 1):
        full = ids(make(rank, 0))
        for saved_with, resumed_with in ((2, 2), (3, 3), (2, 3), (2, 0), (0, 2), (3, 1)):
            stop = rng.randrange(1, len(full))
            loader = make(rank, saved_with)
            batches = iter(loader)
            head = ids(itertools.islice(batches, stop))
            state = loader.state_dict()
            del batches, loader

            resumed = make(rank, resumed_with)
            if resumed_with == saved_with:
                resumed.load_state_dict(state)  # torchdata's own resume: per worker
            else:
                chunkd_state = global_state(state)
                assert len(json.dumps(chunkd_state, separators=(",", ":"))) <= MAX_STATE_BYTES
                assert chunkd_state["cursor"] == stop * 6
                resumed.dataset.load_state_dict(chunkd_state)
            assert head + ids(resumed) == full, (rank, saved_with, resumed_with, stop)

    # A loader saved at the end of an epoch resumes with the next epoch, whole.
    for workers in (0, 2):
        loader = make(0, workers)
        loader.dataset.set_epoch(1)
        assert len(ids(loader)) == 17
        state = loader.state_dict()
        assert global_state(state)["cursor"] == 100
        resumed = make(0, workers)
        resumed.load_state_dict(state)
        resumed.dataset.set_epoch(2)
        epoch2 = SnapshotDataset(snapshot, seed=SEED, rank=0, world_size=2, batch_size=3)
        epoch2.set_epoch(2)
        assert ids(resumed) == ids(epoch2), workers


@stateful_warning
@many_workers
def test_eight_ranks_of_two_workers_resume_as_three_ranks_of_five(node: Node) -> None:
    """The elastic resume end to end: real StatefulDataLoader worker processes read
    ahead of what the trainer takes; the state counts only what it took."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    snapshot = node.dataset("fixed").dataset
    seen: Counter[str] = Counter()

    def loaders(world: int, workers: int, batch: int, state: Any = None) -> list[Any]:
        made = []
        for rank in range(world):
            dataset = SnapshotDataset(
                snapshot, seed=SEED, rank=rank, world_size=world, batch_size=batch
            )
            if state is not None:
                dataset.load_state_dict(state)
            made.append(stateful.StatefulDataLoader(dataset, batch_size=None, num_workers=workers))
        return made

    def take(batch: Batch) -> None:
        rows = [bytes(row.numpy()) for row in batch.samples]
        assert rows == [node.samples[sid] for sid in batch.ids]
        seen.update(batch.ids)

    # W=8, K=2, B=2: steps of 16 positions; the trainer takes 3 steps, the workers
    # read ahead (2 batches each by default)
    old = loaders(8, 2, 2)
    running = [iter(loader) for loader in old]
    for _ in range(3):
        for it in running:
            take(next(it))
    states = [loader.state_dict() for loader in old]
    del running, old
    gc.collect()
    state = global_state(states)  # every rank's state: they agree
    assert state == global_state(states[5])
    assert state["cursor"] == 48
    assert len(json.dumps(state, separators=(",", ":"))) <= MAX_STATE_BYTES
    saved = json.loads(json.dumps(state))  # as it would be stored

    # W=3, K=5, B=3: steps of 9; the 52 left take 6 steps, the last short
    new = loaders(3, 5, 3, saved)
    for loader in new:
        for batch in loader:
            take(batch)
    assert len(seen) == 100
    assert set(seen) == node.ids("fixed")
    assert max(seen.values()) == 1  # 0 repeated, 0 skipped


def test_bad_states_are_refused(node: Node) -> None:
    dataset = node.dataset("fixed", batch_size=2)
    fresh = dataset.state_dict()
    assert LoaderState.parse(fresh).cursor == 0
    other = ShardDataset(
        node.fixed[:3], kind="fixed", record_bytes=RECORD, seed=SEED, client_factory=node.factory
    )
    for state, message in (
        (other.state_dict(), "of snapshot"),
        (node.dataset("fixed", seed=SEED + 1).state_dict(), "of seed"),
        (node.dataset("fixed", window=None).state_dict(), "window=None"),
        (fresh | {"cursor": 101}, "past the end"),
        (fresh | {"cursor": "7"}, "'cursor' is a whole number"),
        (json.dumps(fresh)[:40], "does not parse"),
        (json.dumps(fresh | {"pad": "x" * 300}), "at most 256 bytes"),
        ({"epoch": 0}, "not a loader state"),
        (fresh | {"format": "chunkd.loader/1"}, "windows of units"),
        (
            {
                "format": "chunkd.ShardDataset/1",
                "order": "f00",
                "epoch": 1,
                "position": 30,
                "world_size": 2,
                "rank": 0,
                "done": False,
            },
            "row groups",
        ),
    ):
        with pytest.raises(ResumeStateError, match=message):
            dataset.load_state_dict(state)  # type: ignore[arg-type]
    with pytest.raises(ResumeStateError, match="row groups"):
        global_state({"dataset_state": {"format": "chunkd.ShardDataset/1", "epoch": 0}})
    with pytest.raises(ResumeStateError, match="loader/1 state"):
        global_state({"dataset_state": fresh | {"format": "chunkd.loader/1"}})
    with pytest.raises(ResumeStateError, match="no chunkd loader state"):
        global_state({"_snapshot": {}})
    with pytest.raises(ResumeStateError, match="snapshot_every_n_steps"):
        global_state({"_steps_since_snapshot": 2, "_snapshot": {}})

    # a worker's state resumes only that worker of a loader of the same geometry
    worker = {
        "format": "chunkd.loader.worker/1",
        "start": fresh,
        "total": 100,
        "rank": 0,
        "world_size": 1,
        "batch_size": 2,
        "tail": "uneven",
        "worker": 1,
        "workers": 2,
        "yielded": 3,
        "finished": False,
    }
    dataset.load_state_dict(worker)
    with pytest.raises(ResumeStateError, match="global_state"):
        iter(dataset)
    with pytest.raises(ResumeStateError, match="all 2 DataLoader workers"):
        global_state([worker])
    both = global_state([worker, worker | {"worker": 0, "yielded": 4}])
    assert both["cursor"] == 7 * 2
    assert global_state([worker, worker | {"worker": 0, "finished": True}])["cursor"] == 100
    with pytest.raises(ResumeStateError, match="not in step"):
        global_state([both, fresh])


def test_a_loaded_state_applies_to_its_epoch(node: Node) -> None:
    dataset = node.dataset("fixed", batch_size=5)
    state = LoaderState.parse(dataset.state_dict())
    mid = state.to_dict() | {"epoch": 3, "cursor": 35}
    dataset.load_state_dict(mid)
    assert dataset.epoch == 3
    dataset.set_epoch(3)  # the usual loop: the loaded cursor holds
    assert dataset.state_dict() == mid
    rest = flat(dataset)
    whole = node.dataset("fixed", batch_size=5)
    whole.set_epoch(3)
    assert rest == flat(whole)[35:]
    assert dataset.state_dict() == mid | {"cursor": 100}
    dataset.set_epoch(4)
    assert dataset.state_dict() == mid | {"epoch": 4, "cursor": 0}
    # an epoch's end loaded after set_epoch: the epoch set, from its start
    dataset.load_state_dict(mid | {"cursor": 100})
    assert dataset.epoch == 4
    assert len(flat(dataset)) == 100


# -- formats: Parquet rows, JSON lines ---------------------------------------------------


def test_parquet_rows_and_json_lines_are_samples(node: Node) -> None:
    rows = node.dataset("parquet", batch_size=4)
    got: list[str] = []
    for batch in DataLoader(rows, batch_size=None, num_workers=2):
        # a batch of dict rows collates into a dict of columns
        assert set(batch.samples) == {"shard", "row"}
        expected = [node.samples[sid] for sid in batch.ids]
        assert batch.samples["row"].tolist() == [r["row"] for r in expected]
        assert batch.samples["shard"].tolist() == [r["shard"] for r in expected]
        got += batch.ids
    assert sorted(got) == sorted(node.ids("parquet"))  # 21 rows, not 7 row groups
    # the order is by row groups: with a window of 1, each row group's rows come
    # together, row groups in the units' order (not a member's groups together)
    one = node.dataset("parquet", batch_size=5, window=1)
    snapshot = one.dataset.snapshot
    assert snapshot_units(snapshot) == [[4, 4, 2], [2, 2, 2], [5]]
    group_rows = [4, 2, 8]
    read = [sid.rsplit("#", 1) for sid in flat(DataLoader(one, batch_size=None))]
    members = [m.key for m in snapshot.members]
    groups = [(members.index(k), int(i) // group_rows[members.index(k)]) for k, i in read]
    runs = [g for g, _ in itertools.groupby(groups)]
    assert len(runs) == len(set(runs)) == 7
    order = order_of(snapshot, LoaderState(snapshot.id, SEED, 0, 0, window=1))
    at = order.located(np.arange(len(snapshot)))  # each position's member and unit
    placed = zip(at.members.tolist(), at.units.tolist(), strict=True)
    assert runs == [u for u, _ in itertools.groupby(placed)]

    lines = node.dataset("jsonl", batch_size=3, rank=1, world_size=2)
    # What a spawned worker gets: a pickled copy, its client left out.
    assert ids(pickle.loads(pickle.dumps(lines))) == ids(lines)
    both = []
    for rank in (0, 1):
        for batch in node.dataset("jsonl", batch_size=3, rank=rank, world_size=2):
            assert batch.samples == [node.samples[sid] for sid in batch.ids]
            both += batch.ids
    assert sorted(both) == sorted(node.ids("jsonl"))
    assert node.samples["jsonl/part-3.jsonl#2"] == b""  # an empty line is a sample


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="record_bytes > 0"):
        ShardDataset(["local/a"], kind="fixed", seed=0)
    with pytest.raises(ValueError, match="for kind='fixed' only"):
        ShardDataset(["local/a"], kind="jsonl", seed=0, record_bytes=4)
    with pytest.raises(ValueError, match="kind must be"):
        ShardDataset(["local/a"], kind="csv", seed=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="listed twice"):
        ShardDataset(["local/a", "local/a"], kind="jsonl", seed=0)
    with pytest.raises(ValueError, match="several backends"):
        ShardDataset(["local/a", "data/b"], kind="jsonl", seed=0)
    with pytest.raises(ValueError, match="rank < world_size"):
        ShardDataset(["local/a"], kind="jsonl", seed=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="tail"):
        ShardDataset(["local/a"], kind="jsonl", seed=0, tail="wrap")  # type: ignore[arg-type]
    assert split_sample_id("data/a#b.jsonl#17") == ("data/a#b.jsonl", 17)
    with pytest.raises(ValueError, match="not a sample id"):
        split_sample_id("data/a.jsonl")
