"""Batches as columns: the values equal the per-sample reads, whatever the snapshot, the
columns asked for, the steps and the resumes (a property test); projections, transforms,
the torch collate's own tensors, pinning, and the decode-ahead bound.

Snapshots are built in memory (a :class:`MemorySource` over bytes), so these tests read
no daemon: the daemon's decoding is ``tests/test_decode_service.py``'s.
"""

from __future__ import annotations

import datetime
import decimal
import hashlib
import io
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkd.client.datasets import Dataset
from chunkd.client.datasets.columns import Units, arrays, take
from chunkd.client.datasets.formats import format_of, settle
from chunkd.client.datasets.loader import Loader, ReadSettings
from chunkd.snapshot import Member, Snapshot

from .test_dataset_order import MemorySource

pytestmark = pytest.mark.timeout(120)


def dataset_of(blobs: dict[str, bytes], fmt_name: str, options: dict[str, Any]) -> Dataset:
    source = MemorySource(blobs)
    fmt = format_of(fmt_name)
    members = [
        fmt.scan(
            source, Member(key, len(blob), hashlib.sha256(blob).hexdigest(), fmt_name), options
        )
        for key, blob in sorted(blobs.items())
    ]
    schema, members = settle(fmt, members)
    snapshot = Snapshot.build(
        backend="mem", prefix="", format=fmt_name, members=members, schema_of=schema
    )
    return Dataset(snapshot, source)


# -- random Parquet snapshots, with the types a trainer meets -----------------------------

COLUMNS = ("i", "f", "s", "tags", "when", "price", "kind", "pt", "flag", "day", "at")


def parquet_blob(first: int, rows: int, group: int, nulls: bool) -> bytes:
    ids = list(range(first, first + rows))

    def maybe(values: list[Any]) -> list[Any]:
        return [None if nulls and v_i % 7 == 3 else v for v_i, v in zip(ids, values, strict=True)]

    table = pa.table(
        {
            "i": pa.array(ids, pa.int64()),
            "f": pa.array(maybe([i / 4 for i in ids]), pa.float32()),
            "s": pa.array(maybe([f"row {i}" for i in ids]), pa.string()),
            "tags": pa.array(maybe([[i, i + 1][: i % 3] for i in ids]), pa.list_(pa.int32())),
            "when": pa.array(
                [datetime.datetime(2026, 1, 1) + datetime.timedelta(seconds=i) for i in ids],
                pa.timestamp("ms"),
            ),
            "price": pa.array(maybe([decimal.Decimal(i) / 100 for i in ids]), pa.decimal128(12, 2)),
            "kind": pa.array([("cat", "dog", "eel")[i % 3] for i in ids]).dictionary_encode(),
            "pt": pa.array(
                maybe([{"x": i, "y": -i} for i in ids]),
                pa.struct([("x", pa.int32()), ("y", pa.int32())]),
            ),
            "flag": pa.array([i % 2 == 0 for i in ids], pa.bool_()),
            "day": pa.array(
                maybe([datetime.date(2026, 1, 1) + datetime.timedelta(days=i) for i in ids]),
                pa.date32(),
            ),
            "at": pa.array([datetime.time(i % 24, i % 60) for i in ids], pa.time64("us")),
        }
    )
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=group)
    return sink.getvalue()


def parquet_dataset(sizes: Sequence[int], group: int, nulls: bool) -> Dataset:
    blobs, first = {}, 0
    for n, rows in enumerate(sizes):
        blobs[f"part-{n:03d}.parquet"] = parquet_blob(first, rows, group, nulls)
        first += rows
    return dataset_of(blobs, "parquet", {})


def as_python(column: Any) -> list[Any]:
    """A column of :attr:`Batch.columns` as Python values, to compare with samples."""
    if isinstance(column, np.ndarray):
        if column.dtype.kind == "M":  # datetime64: what Arrow gives as datetime
            return pa.array(column).to_pylist()
        return column.tolist()
    return list(column.to_pylist())


@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    group=st.integers(1, 16),
    nulls=st.booleans(),
    picked=st.one_of(st.none(), st.lists(st.sampled_from(COLUMNS), min_size=1, unique=True)),
    world=st.integers(1, 3),
    batch=st.integers(1, 9),
    seed=st.integers(0, 50),
    resume_after=st.integers(0, 3),
    shuffle=st.booleans(),
)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_columns_and_samples_equal_the_per_sample_reads(
    sizes: list[int],
    group: int,
    nulls: bool,
    picked: list[str] | None,
    world: int,
    batch: int,
    seed: int,
    resume_after: int,
    shuffle: bool,
) -> None:
    dataset = parquet_dataset(sizes, group, nulls)
    chosen = ReadSettings(batch, seed, world_size=world, columns=picked, shuffle=shuffle)
    loaders = [Loader(dataset, chosen.replace(rank=r), prefetch=1) for r in range(world)]
    state: dict[str, Any] | None = None
    seen: list[str] = []
    for rounds in (resume_after, None):
        if state is not None:
            for loader in loaders:
                loader.restore(json.dumps(state))
        iterators = [iter(loader) for loader in loaders]
        step = 0
        while rounds is None or step < rounds:
            batches = [next(it, None) for it in iterators]
            if all(b is None for b in batches):
                break
            for b in batches:
                if b is None:
                    continue
                seen += b.ids
                expected = []
                for sample_id in b.ids:
                    key, _, index = sample_id.partition("#")
                    member = next(i for i, m in enumerate(dataset.snapshot.members) if m.key == key)
                    row = dataset.read(member, int(index))
                    expected.append(row if picked is None else {c: row[c] for c in picked})
                assert b.samples == expected
                assert list(b.columns) == (list(COLUMNS) if picked is None else picked)
                for name, column in b.columns.items():
                    assert len(column) == len(expected)
                    want = [row[name] for row in expected]
                    if name == "when" and isinstance(column, np.ndarray):
                        want = [np.datetime64(w, "ms") for w in want]
                        assert column.tolist() == [w.astype(datetime.datetime) for w in want]
                    else:
                        assert as_python(column) == want, name
            step += 1
        state = loaders[0].state()
    assert sorted(seen) == sorted(dataset.sample_id(m, s) for m, s in _all_pairs(dataset))


def _all_pairs(dataset: Dataset) -> list[tuple[int, int]]:
    return [
        (m, s) for m, member in enumerate(dataset.snapshot.members) for s in range(member.samples)
    ]


def test_each_column_type_has_its_stated_form() -> None:
    dataset = parquet_dataset([12], 5, nulls=False)
    batch = next(iter(Loader(dataset, batch_size=12, seed=1, shuffle=False)))
    columns = batch.columns
    # numbers, booleans and timestamps without nulls: numpy
    assert isinstance(columns["i"], np.ndarray)
    assert columns["i"].dtype == np.int64
    assert columns["f"].dtype == np.float32
    assert columns["flag"].dtype == np.bool_
    assert columns["when"].dtype == np.dtype("datetime64[ms]")
    # gathered from several units: arrays of the batch's own, writable
    assert columns["i"].flags.writeable
    assert columns["i"].flags.owndata
    # one run of one unit: a read-only view, since every batch taken from it shares it
    whole = next(
        iter(Loader(parquet_dataset([12], 12, nulls=False), batch_size=6, seed=1, shuffle=False))
    )
    assert not whole.columns["i"].flags.writeable
    assert whole.columns["i"].tolist() == list(range(6))
    # numbers only (a window laid out): a read-only view of it, the same
    numbers = parquet_dataset([12], 12, nulls=False)
    run = next(iter(Loader(numbers, batch_size=6, seed=1, shuffle=False, columns=["i", "f"])))
    assert not run.columns["i"].flags.writeable
    assert run.columns["i"].tolist() == list(range(6))
    # a dictionary comes decoded, as its value type; strings, lists, structs and
    # decimals as Arrow arrays
    assert isinstance(columns["kind"], pa.Array)
    assert columns["kind"].type == pa.string()
    assert columns["kind"].to_pylist()[:3] == ["cat", "dog", "eel"]
    for name in ("s", "tags", "price", "pt", "day", "at"):
        assert isinstance(columns[name], pa.Array), name
    with_nulls = next(iter(Loader(parquet_dataset([12], 5, nulls=True), batch_size=12, seed=1)))
    # a number column with nulls is an Arrow array too: nothing is filled in
    assert isinstance(with_nulls.columns["f"], pa.Array)
    assert with_nulls.columns["f"].null_count > 0


def test_a_projection_decodes_only_its_columns() -> None:
    dataset = parquet_dataset([30], 10, nulls=False)
    units = Units(dataset.snapshot, dataset.source, columns=["s", "i"], threads=0)
    rows = take(units, np.array([0, 0, 0]), np.array([25, 3, 14]))
    assert rows.table.column_names == ["s", "i"]
    assert rows.samples == [
        {"s": "row 25", "i": 25},
        {"s": "row 3", "i": 3},
        {"s": "row 14", "i": 14},
    ]
    with pytest.raises(Exception, match="nope"):
        take(
            Units(dataset.snapshot, dataset.source, columns=["nope"], threads=0),
            np.array([0]),
            np.array([0]),
        )


def test_fixed_records_come_as_one_2d_array_and_torch_tensors_survive_in_place_ops() -> None:
    torch = pytest.importorskip("torch")
    from chunkd.client.torch.pinned import collate_columns, pinned

    blobs = {"a.bin": bytes(range(256)) * 4, "b.bin": bytes(range(255, -1, -1)) * 4}
    dataset = dataset_of(blobs, "fixed", {"record_bytes": 16})
    batch = next(iter(Loader(dataset, batch_size=8, seed=3)))
    records = batch.columns["record"]
    assert records.shape == (8, 16)
    assert records.dtype == np.uint8
    assert [bytes(r) for r in records] == [bytes(s) for s in batch.samples]
    tensor = collate_columns(batch)
    assert tensor.shape == (8, 16)
    tensor.add_(1)  # a tensor of its own: a write neither crashes nor reaches the unit
    assert [bytes(r) for r in batch.columns["record"]] == [bytes(s) for s in batch.samples]
    # no accelerator here: pinning gives the batch back, its values unchanged
    assert torch.equal(pinned(batch._replace(samples=tensor)).samples, tensor)


def test_batch_transform_makes_the_columns_and_transform_the_samples() -> None:
    dataset = parquet_dataset([20], 4, nulls=False)
    loader = Loader(
        dataset,
        batch_size=5,
        seed=2,
        columns=["i", "f"],
        batch_transform=lambda cols: {"x": cols["i"] * 2 + cols["f"]},
        transform=lambda row: row["i"],
    )
    for batch in loader:
        ids = [int(i.partition("#")[2]) for i in batch.ids]
        assert batch.samples == ids
        assert batch.columns["x"].tolist() == [i * 2 + i / 4 for i in ids]


def test_settings_are_one_value_the_keywords_override() -> None:
    dataset = parquet_dataset([10], 5, nulls=False)
    chosen = ReadSettings(4, 9, window=2, prefetch=0)
    loader = Loader(dataset, chosen, batch_size=2)
    assert loader.settings == chosen.replace(batch_size=2)
    assert loader.batch_size == 2
    assert loader.settings.window == 2
    with pytest.raises(TypeError, match="batch_size and seed"):
        Loader(dataset)
    with pytest.raises(ValueError, match="columns"):
        ReadSettings(4, 9, columns="i")
    with pytest.raises(ValueError, match="columns"):
        ReadSettings(4, 9, columns=["i", "i"])
    with pytest.raises(ValueError, match="decode_ahead"):
        ReadSettings(4, 9, decode_ahead=-1)


def test_decoding_ahead_holds_at_most_its_bytes() -> None:
    dataset = parquet_dataset([40, 40], 4, nulls=False)
    fmt = format_of("parquet")
    per_unit = max(b for m in dataset.snapshot.members for b in fmt.unit_bytes(m))
    units = Units(dataset.snapshot, dataset.source, held_bytes=3 * per_unit, threads=2)
    keys = [(m, u) for m in range(2) for u in range(10)]
    units.ahead(keys)
    for key in keys:
        units.get(key)
        assert units._held_total <= 3 * per_unit
    units.close()
    assert units.decoded >= len(keys)


def test_a_loader_decodes_ahead_all_epoch_long() -> None:
    # 40 units of 4 rows, windows of 4 units, and room for 3 windows: once what it holds
    # is full, the reader still asks for its next steps' units ahead (the units it no
    # longer needs go first), so nearly every unit is decoded ahead of its step
    dataset = parquet_dataset([40] * 4, 4, nulls=False)
    per = max(b for m in dataset.snapshot.members for b in format_of("parquet").unit_bytes(m))
    loader = Loader(dataset, batch_size=4, seed=1, window=4, decode_ahead=12 * per, prefetch=3)
    assert sum(len(b) for b in loader) == 160
    units = loader.units()
    assert units is not None
    assert units.decoded == 40
    assert units.ahead_started >= 30


def test_arrays_of_an_empty_table_and_a_sliced_fixed_column() -> None:
    table = pa.table({"r": pa.array([b"ab", b"cd", b"ef"], pa.binary(2))}).slice(1, 2)
    got = arrays(table)["r"]
    assert got.tolist() == [[ord("c"), ord("d")], [ord("e"), ord("f")]]
    assert arrays(pa.table({"x": pa.array([], pa.int64())}))["x"].tolist() == []


# -- through a real daemon: the node's readers share its decoded units --------------------


@pytest.mark.timeout(90)
def test_a_nodes_loaders_take_units_the_daemon_decoded_once(
    start_daemon: Any, tmp_path: Any
) -> None:
    from chunkd.client import Client
    from chunkd.client.datasets import Dataset as Opened

    from .conftest import dataset_cli, small_node_toml

    data = tmp_path / "data" / "pq"
    data.mkdir(parents=True)
    for n in range(3):
        (data / f"part-{n}.parquet").write_bytes(parquet_blob(100 * n, 100, 25, nulls=True))
    toml = small_node_toml(tmp_path / "cache", ("local", tmp_path / "data"))
    toml += '\n[datasets]\nregistry = "local/registry"\n'
    daemon = start_daemon(toml, cwd=tmp_path)
    dataset_cli(daemon, "register", "pq", "local/pq/", "--format", "parquet")
    units_total = 3 * 4
    with Client(socket_path=daemon.cwd / "chunkd.sock") as client:
        dataset = Opened.open("pq", client)
        seen: list[str] = []
        for rank in range(2):  # two ranks of one node, in turn
            loader = Loader(dataset, batch_size=7, seed=4, rank=rank, world_size=2)
            for batch in loader:
                seen += batch.ids
                expected = []
                for sample_id in batch.ids:
                    key, _, index = sample_id.partition("#")
                    member = [m.key for m in dataset.snapshot.members].index(key)
                    expected.append(dataset.read(member, int(index)))
                assert batch.samples == expected
                assert batch.columns["i"].tolist() == [r["i"] for r in expected]
            units = loader.units()
            assert units is not None
            assert units.decoded == 0  # every unit mapped from the daemon's entries
            assert units.mapped > 0
            loader.close()
        assert sorted(seen) == sorted(
            f"pq/part-{n}.parquet#{i}" for n in range(3) for i in range(100)
        )
    assert daemon.metric("chunkd_dataset_decodes_total", where="daemon") == units_total
    assert daemon.metric("chunkd_dataset_decodes_total", where="reader") == 0


def test_a_batch_sent_from_a_worker_keeps_its_columns_samples_and_ids() -> None:
    import pickle

    dataset = parquet_dataset([30], 7, nulls=True)
    batch = next(iter(Loader(dataset, batch_size=9, seed=6, columns=["i", "s"])))
    moved = pickle.loads(pickle.dumps(batch))
    assert moved.ids == batch.ids
    assert moved.samples == batch.samples
    assert moved.columns["i"].tolist() == batch.columns["i"].tolist()
    transformed = Loader(
        dataset, batch_size=9, seed=6, columns=["i"], batch_transform=lambda c: {"n": c["i"] + 1}
    )
    first = next(iter(transformed))
    again = pickle.loads(pickle.dumps(first))
    assert again.samples == first.samples
    assert again.columns["n"].tolist() == [s["i"] + 1 for s in first.samples]


@pytest.mark.parametrize("bound", [64 << 20, 0])
def test_a_windows_laid_out_columns_give_the_same_rows(
    bound: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # numbers only: every column laid out once a window (bound 64 MiB), or none (0: each
    # taken unit by unit); the rows are the per-sample reads' either way
    from chunkd.client.datasets import columns as columns_module

    monkeypatch.setattr(columns_module, "WINDOW_BYTES", bound)
    dataset = parquet_dataset([37, 23, 40], 6, nulls=False)
    loader = Loader(dataset, batch_size=11, seed=2, window=3, columns=["i", "f", "when"])
    laid: list[int] = []
    original = columns_module.Window.column

    def counted(self: Any, c: int) -> Any:
        found = original(self, c)
        laid.append(found is not None)
        return found

    monkeypatch.setattr(columns_module.Window, "column", counted)
    seen = []
    for batch in loader:
        seen += batch.ids
        for sample_id, i, when in zip(
            batch.ids, batch.columns["i"].tolist(), batch.columns["when"].tolist(), strict=True
        ):
            member, _, index = sample_id.partition("#")
            m = [x.key for x in dataset.snapshot.members].index(member)
            row = dataset.read(m, int(index))
            assert i == row["i"]
            assert when == row["when"]
    assert len(seen) == 100
    assert any(laid) == bool(bound)


def test_an_unshuffled_first_batch_decodes_only_its_unit() -> None:
    dataset = parquet_dataset([40, 40], 4, nulls=False)  # 20 units of 4 rows
    for columns in (["s"], ["i", "s"], ["i"]):
        loader = Loader(dataset, batch_size=4, seed=1, shuffle=False, prefetch=0, columns=columns)
        first = next(iter(loader))
        assert first.samples == [{c: dataset.read(0, r)[c] for c in columns} for r in range(4)]
        units = loader.units()
        assert units is not None
        assert units.decoded == 1, columns
        loader.close()


def test_a_unit_of_another_row_count_than_its_manifest_is_refused() -> None:
    import dataclasses

    honest = parquet_dataset([40], 10, nulls=False)
    member = honest.snapshot.members[0]
    groups = [list(g) for g in member.meta["row_groups"]]
    groups[0][0], groups[1][0] = 9, 11  # the same 40 rows, cut one row off
    lying = dataclasses.replace(member, meta={**member.meta, "row_groups": groups})
    snapshot = Snapshot.build(
        backend="mem", prefix="", format="parquet", members=[lying], schema_of=None
    )
    dataset = Dataset(snapshot, honest.source)
    loader = Loader(dataset, batch_size=8, seed=3, columns=["i", "f"])
    with pytest.raises(Exception, match="rows") as raised:
        for _ in loader:
            pass
    from chunkd.errors import DatasetFormatError

    assert isinstance(raised.value, DatasetFormatError)


def test_a_batch_sent_from_a_worker_carries_its_rows_not_its_units() -> None:
    import pickle

    dataset = parquet_dataset([4000], 4000, nulls=False)  # one unit of 4,000 rows
    batch = next(iter(Loader(dataset, batch_size=8, seed=1, shuffle=False)))
    assert batch.rows is not None
    sent = pickle.dumps(batch)
    whole = pickle.dumps(dataset.snapshot)  # a yardstick: small
    # a slice of the unit would pickle the whole unit's buffers (about 200 KB here)
    assert len(sent) < 20_000 + len(whole)
    moved = pickle.loads(sent)
    assert moved.samples == batch.samples


def test_a_snapshots_units_are_worked_out_once_a_process_not_once_an_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 20,000 fixed-record members: the units are a Python pass over every member, which
    # the readers of every epoch would otherwise repeat (about 0.4 s here, 20 s at 1M)
    from chunkd.client.datasets import loader as loader_module
    from chunkd.client.datasets.state import LoaderState

    members = [
        Member(f"m/{i:06d}.bin", 64, "v", "fixed", samples=4, meta={"record_bytes": 16})
        for i in range(20_000)
    ]
    # order version 1 (a schema-1 snapshot) is the one worked out from every member's units
    snapshot = Snapshot.build(backend="mem", prefix="", format="fixed", members=members, schema=1)
    calls: list[str] = []
    counted = loader_module.snapshot_units

    def units(s: Snapshot) -> Any:
        calls.append(s.id)
        return counted(s)

    monkeypatch.setattr(loader_module, "snapshot_units", units)
    orders = [
        loader_module.order_of(snapshot, LoaderState(snapshot.id, 7, epoch, 0))
        for epoch in range(3)
    ]
    assert calls == [snapshot.id]
    assert all(len(order) == 80_000 for order in orders)
    assert len(set(orders[0].indices(range(0, 80_000, 997)).tolist())) == len(range(0, 80_000, 997))
