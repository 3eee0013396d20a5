"""chunkd.client.torch: zero-copy tensors, and datasets read through a real daemon.

Every test that reads runs ``chunkd serve`` (the ``start_daemon`` fixture) over a few
JSON lines, fixed-record and Parquet shards in its ``local`` backend, and reads them
with torch's DataLoader (workers included) and torchdata's StatefulDataLoader.
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
from chunkd.client.torch import (  # noqa: E402
    RecordDataset,
    ShardDataset,
    as_tensor,
    split_sample_id,
)

RECORD = 16
SEED = 20240611


# -- a daemon with shards ----------------------------------------------------------------


@dataclass
class Node:
    """A running daemon and what its ``local`` backend holds."""

    socket: Path
    jsonl: list[str] = field(default_factory=list)
    fixed: list[str] = field(default_factory=list)
    parquet: list[str] = field(default_factory=list)
    #: sample id -> its bytes (JSON lines, records) or its table (Parquet)
    samples: dict[str, Any] = field(default_factory=dict)

    @property
    def factory(self) -> Callable[[], Client]:
        return functools.partial(Client, self.socket)

    def dataset(self, kind: str, **options: Any) -> ShardDataset:
        shards = {"jsonl": self.jsonl, "fixed": self.fixed, "parquet": self.parquet}[kind]
        options.setdefault("seed", SEED)
        options.setdefault("with_ids", True)
        if kind == "fixed":
            options.setdefault("record_bytes", RECORD)
        return ShardDataset(shards, kind=kind, client_factory=self.factory, **options)  # type: ignore[arg-type]


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
        node.samples.update({f"{name}#{j}": line for j, line in enumerate(lines)})
    for i, count in enumerate([9, 4, 12]):
        records = [rng.randbytes(RECORD) for _ in range(count)]
        name = put(f"fixed/part-{i}.bin", b"".join(records))
        node.fixed.append(name)
        node.samples.update({f"{name}#{j}": record for j, record in enumerate(records)})
    for i, (rows, group) in enumerate([(10, 4), (6, 2), (5, 8)]):
        table = pa.table({"shard": [i] * rows, "row": list(range(rows))})
        sink = io.BytesIO()
        pq.write_table(table, sink, row_group_size=group)
        name = put(f"parquet/part-{i}.parquet", sink.getvalue())
        node.parquet.append(name)
        for j, start in enumerate(range(0, rows, group)):
            node.samples[f"{name}#{j}"] = table.slice(start, group)
    start_daemon()
    if not wait_for_socket(node.socket, 10):
        pytest.skip(f"`chunkd serve` did not create its local socket {node.socket} in 10 s")
    return node


def ids(items: Iterable[Any]) -> list[str]:
    """The sample ids of ``(id, sample)`` pairs, or of batches of them."""
    out: list[str] = []
    for item in items:
        if isinstance(item, list):
            out += [sample_id for sample_id, _ in item]
        else:
            out.append(item[0])
    return out


def interleave(*sequences: list[str]) -> list[str]:
    """Round-robin over the sequences: what global order ranks' sequences make up."""
    merged = itertools.zip_longest(*sequences)
    return [x for row in merged for x in row if x is not None]


# -- as_tensor ---------------------------------------------------------------------------


def test_as_tensor_shares_the_mapped_bytes_without_a_warning(node: Node) -> None:
    name = node.fixed[2]
    expected = b"".join(node.samples[f"{name}#{j}"] for j in range(12))
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
    expected = [node.samples[f"{name}#{j}"] for j in range(9)]

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


# -- ShardDataset: the global order ------------------------------------------------------


def test_every_sample_once_across_ranks_in_one_seeded_global_order(node: Node) -> None:
    everything = [sid for sid in node.samples if "/jsonl/" in sid]
    assert len(everything) == 7 + 13 + 5

    one = list(node.dataset("jsonl"))
    assert sorted(ids(one)) == sorted(everything)
    assert all(sample == node.samples[sid] for sid, sample in one)
    assert node.samples[f"{node.jsonl[3]}#2"] == b""  # an empty line is a sample

    # Two ranks split the same global order, round-robin: disjoint, complete.
    ranks = [ids(node.dataset("jsonl", rank=r, world_size=2)) for r in (0, 1)]
    assert not set(ranks[0]) & set(ranks[1])
    assert interleave(*ranks) == ids(one)
    assert len(ranks[0]) - len(ranks[1]) == 1
    even = [ids(node.dataset("jsonl", rank=r, world_size=2, drop_uneven=True)) for r in (0, 1)]
    assert len(even[0]) == len(even[1]) == 12

    # Deterministic per (seed, epoch); another epoch or seed, another order.
    assert ids(node.dataset("jsonl")) == ids(one)
    later = node.dataset("jsonl")
    later.set_epoch(1)
    epoch1 = ids(later)
    assert epoch1 != ids(one)
    assert sorted(epoch1) == sorted(everything)
    again = node.dataset("jsonl")
    again.set_epoch(1)
    assert ids(again) == epoch1
    assert ids(node.dataset("jsonl", seed=SEED + 1)) != ids(one)

    # Unshuffled: shards as listed, samples as stored.
    assert ids(node.dataset("jsonl", shuffle=False)) == everything

    # Windows of shards: shards shuffled, samples only within each window.
    windowed = ids(node.dataset("jsonl", shuffle_window=1))
    shard_runs = [name for name, _ in itertools.groupby(split_sample_id(s)[0] for s in windowed)]
    assert sorted(shard_runs) == sorted(n for n in node.jsonl if n != node.jsonl[1])


def test_workers_yield_each_rank_in_the_global_order(node: Node) -> None:
    for rank in (0, 1):
        expected = ids(node.dataset("jsonl", rank=rank, world_size=2))
        for batch_size in (None, 3):
            dataset = node.dataset("jsonl", rank=rank, world_size=2, batch_size=batch_size or 1)
            loader = DataLoader(dataset, batch_size=batch_size, num_workers=2, collate_fn=list)
            got = ids(loader) if batch_size else [sid for sid, _ in loader]
            assert got == expected, (rank, batch_size)


# -- ShardDataset: resuming --------------------------------------------------------------


def test_resume_at_a_random_step_yields_exactly_the_rest(node: Node) -> None:
    rng = random.Random(5)
    for rank in (0, 1):
        full = ids(node.dataset("jsonl", rank=rank, world_size=2))
        for _ in range(3):
            stop = rng.randrange(len(full) + 1)
            first = node.dataset("jsonl", rank=rank, world_size=2)
            head = ids(itertools.islice(first, stop))
            state = first.state_dict()
            assert json.loads(json.dumps(state)) == state  # a plain dict
            resumed = node.dataset("jsonl", rank=rank, world_size=2)
            resumed.load_state_dict(state)
            assert head + ids(resumed) == full, (rank, stop)

        # Through a DataLoader in the process, stopped between batches.
        loader = DataLoader(node.dataset("jsonl", rank=rank, world_size=2), 3, collate_fn=list)
        batches = iter(loader)
        head = ids(itertools.islice(batches, 2))
        state = loader.dataset.state_dict()  # type: ignore[attr-defined]
        resumed = node.dataset("jsonl", rank=rank, world_size=2)
        resumed.load_state_dict(state)
        assert head + ids(DataLoader(resumed, 3, collate_fn=list)) == full


def test_ranks_in_step_resume_on_another_world_size(node: Node) -> None:
    everything = ids(node.dataset("jsonl"))
    old = [node.dataset("jsonl", rank=r, world_size=2) for r in (0, 1)]
    heads = [ids(itertools.islice(dataset, 4)) for dataset in old]
    states = [dataset.state_dict() for dataset in old]
    assert states[0] == states[1] | {"rank": 0}  # ranks in step hold the same position
    new = [node.dataset("jsonl", rank=r, world_size=3) for r in (0, 1, 2)]
    for dataset in new:
        dataset.load_state_dict(states[0])
    rests = [ids(dataset) for dataset in new]
    # Global index g goes to rank g % 3: the rank of the first sample left leads.
    lead = states[0]["position"] % 3
    assert interleave(*heads) + interleave(*rests[lead:], *rests[:lead]) == everything


# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates on every loader made.
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_stateful_dataloader_resumes_with_the_same_or_other_num_workers(node: Node) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    loader_class = stateful.StatefulDataLoader
    rng = random.Random(9)
    batch = 2

    def make(rank: int, workers: int) -> Any:
        dataset = node.dataset("fixed", rank=rank, world_size=2, batch_size=batch)
        return loader_class(dataset, batch_size=batch, num_workers=workers, collate_fn=list)

    for rank in (0, 1):
        full = ids(node.dataset("fixed", rank=rank, world_size=2))
        for saved_with, resumed_with in ((2, 2), (2, 1), (2, 0), (0, 2)):
            stop = rng.randrange(1, -(-len(full) // batch))
            loader = make(rank, saved_with)
            batches = iter(loader)
            head = ids(itertools.islice(batches, stop))
            state = loader.state_dict()
            del batches, loader

            resumed = make(rank, resumed_with)
            if resumed_with == saved_with:
                resumed.load_state_dict(state)
            else:
                resumed.dataset.load_state_dict(ShardDataset.global_state(state))
            assert head + ids(resumed) == full, (rank, saved_with, resumed_with, stop)

    # Workers restored from the states of a finished epoch (as torchdata restores
    # them), done or not, yield nothing more of it, not the epoch again.
    loader = make(1, 2)
    assert len(ids(loader)) == 12
    finished = {s["worker_id"]: s for s in _all_states(loader.state_dict())}
    assert sorted(finished) == [0, 1]
    for done in (False, True):

        def restore(worker_id: int, done: bool = done) -> None:
            info = torch.utils.data.get_worker_info()
            info.dataset.load_state_dict(finished[worker_id] | {"done": done})

        dataset = node.dataset("fixed", rank=1, world_size=2, batch_size=batch)
        assert list(DataLoader(dataset, batch, num_workers=2, worker_init_fn=restore)) == []

    # A loader saved at the end of an epoch resumes with the next epoch, whole.
    for workers in (0, 2):
        loader = make(0, workers)
        loader.dataset.set_epoch(1)
        assert len(ids(loader)) == 13
        state = loader.state_dict()
        resumed = make(0, workers)
        resumed.load_state_dict(state)
        resumed.dataset.set_epoch(2)
        epoch2 = node.dataset("fixed", rank=0, world_size=2)
        epoch2.set_epoch(2)
        assert ids(resumed) == ids(epoch2), workers


def test_a_workers_state_resumes_only_that_worker(node: Node) -> None:
    worker_state = node.dataset("jsonl").state_dict() | {
        "worker_id": 1,
        "num_workers": 2,
        "batch_size": 1,
        "origin": 0,
        "yielded": 3,
    }
    dataset = node.dataset("jsonl")
    dataset.load_state_dict(worker_state)
    with pytest.raises(ValueError, match="global_state"):
        iter(dataset)
    with pytest.raises(ValueError, match="all 2 workers"):
        ShardDataset.global_state({"workers": [worker_state]})
    worker_state["position"] = 6
    other = worker_state | {"worker_id": 0, "position": 4}
    assert ShardDataset.global_state([worker_state, other])["position"] == 4

    with pytest.raises(ValueError, match="another ShardDataset order"):
        node.dataset("jsonl", seed=SEED + 1).load_state_dict(worker_state)
    with pytest.raises(ValueError, match="not a ShardDataset state"):
        dataset.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="no ShardDataset state"):
        ShardDataset.global_state({"_snapshot": {}})


def test_epochs_and_loaded_states(node: Node) -> None:
    dataset = node.dataset("jsonl")
    assert dataset.state_dict()["position"] == 0
    state = dataset.state_dict() | {"epoch": 3, "position": 5}
    dataset.load_state_dict(state)
    assert dataset.epoch == 3
    dataset.set_epoch(3)  # the usual loop: the loaded position holds
    assert dataset.state_dict() == state
    rest = ids(dataset)
    fresh = node.dataset("jsonl")
    fresh.set_epoch(3)
    assert rest == ids(fresh)[5:]
    end = dataset.state_dict()
    assert end == state | {"position": 25, "done": True}
    assert ids(dataset) == ids(fresh)  # iterating again: the whole epoch again
    dataset.set_epoch(4)
    assert dataset.state_dict() == state | {"epoch": 4, "position": 0}

    # The last sample taken, the end not reached yet: nothing left, not done.
    last = node.dataset("jsonl")
    assert len(ids(itertools.islice(last, 25))) == 25
    assert last.state_dict()["done"] is False
    empty = node.dataset("jsonl")
    empty.load_state_dict(last.state_dict())
    assert ids(empty) == []

    # A finished epoch's state leaves the epoch set_epoch chose, from its start.
    after = node.dataset("jsonl")
    after.set_epoch(4)
    after.load_state_dict(end)
    assert after.epoch == 4
    assert ids(after) == ids(dataset)


def _all_states(state: Any) -> list[dict[str, Any]]:
    """Every ShardDataset state inside a loader's state."""
    if isinstance(state, dict):
        if "order" in state and "position" in state:
            return [state]
        return [s for value in state.values() for s in _all_states(value)]
    return []


# -- ShardDataset: fixed records and Parquet ---------------------------------------------


def test_fixed_records_come_as_tensors_through_workers(node: Node) -> None:
    dataset = node.dataset("fixed", batch_size=4)
    dataset.total_samples()  # the workers inherit the counts
    got: list[tuple[str, bytes]] = []
    for batch_ids, tensors in DataLoader(dataset, batch_size=4, num_workers=2):
        assert tensors.dtype == torch.uint8
        assert tensors.shape[1:] == (RECORD,)
        got += [(sid, bytes(row.numpy())) for sid, row in zip(batch_ids, tensors, strict=True)]
    assert [sid for sid, _ in got] == ids(node.dataset("fixed"))
    assert all(data == node.samples[sid] for sid, data in got)
    assert len(got) == 25

    as_ints = node.dataset("fixed", transform=lambda t: t.view(torch.int32), with_ids=False)
    first = next(iter(as_ints))
    assert first.dtype == torch.int32
    assert first.shape == (RECORD // 4,)

    with pytest.raises(ValueError, match="whole number of 12-byte records"):
        list(node.dataset("fixed", record_bytes=12))


def test_parquet_row_groups_are_samples(node: Node) -> None:
    dataset = node.dataset("parquet", rank=1, world_size=2)
    expected = ids(dataset)
    assert len(expected) == 3  # of 3 + 3 + 1 row groups
    # What a spawned worker gets: a pickled copy, its client and open files left out.
    assert ids(pickle.loads(pickle.dumps(dataset))) == expected
    tables = list(DataLoader(dataset, batch_size=None, num_workers=2))
    assert [sid for sid, _ in tables] == expected
    for sid, table in tables:
        assert table.equals(node.samples[sid])
    both = ids(node.dataset("parquet", rank=0, world_size=2)) + expected
    assert sorted(both) == sorted(s for s in node.samples if "/parquet/" in s)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="record_bytes > 0"):
        ShardDataset(["local/a"], kind="fixed", seed=0)
    with pytest.raises(ValueError, match="for kind='fixed' only"):
        ShardDataset(["local/a"], kind="jsonl", seed=0, record_bytes=4)
    with pytest.raises(ValueError, match="kind must be"):
        ShardDataset(["local/a"], kind="csv", seed=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="listed twice"):
        ShardDataset(["local/a", "local/a"], kind="jsonl", seed=0)
    with pytest.raises(ValueError, match="rank < world_size"):
        ShardDataset(["local/a"], kind="jsonl", seed=0, rank=2, world_size=2)
    assert split_sample_id("data/a#b.jsonl#17") == ("data/a#b.jsonl", 17)
    with pytest.raises(ValueError, match="not a sample id"):
        split_sample_id("data/a.jsonl")
