"""chunkd's own formats against the conformance suite (:class:`chunkd.testing.formats.FormatTests`).

Each class writes real files with the format's own writer (pyarrow's Parquet, Arrow IPC
and Feather writers; plain bytes for fixed records) and reads them back with that
writer's reader as the reference. The JSON-lines, WebDataset and MDS subclasses live in
their own module.
"""

from __future__ import annotations

import datetime
import decimal
import io
import json
import random
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest

from chunkd.client.datasets import formats
from chunkd.client.datasets.formats import arrow, fixed, format_of, parquet
from chunkd.errors import DatasetFormatError, ManifestError
from chunkd.snapshot import FORMATS, Member, Snapshot, canonical
from chunkd.testing.formats import FileSource, FormatTests

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
ipc = pytest.importorskip("pyarrow.ipc")
feather = pytest.importorskip("pyarrow.feather")


def typed_table(rows: int, seed: int) -> Any:
    """Nulls, nested lists and structs, decimals, timestamps and a dictionary column."""
    rng = random.Random(seed)
    base = datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC)
    return pa.table(
        {
            "id": pa.array([seed * 100_000 + i for i in range(rows)], pa.int64()),
            "text": pa.array(
                [None if i % 11 == 0 else f"r{i}-" + rng.randbytes(8).hex() for i in range(rows)],
                pa.string(),
            ),
            "score": pa.array([None if i % 7 == 0 else i / 3 for i in range(rows)], pa.float64()),
            "tags": pa.array(
                [None if i % 13 == 0 else [f"t{i % 5}"] * (i % 3) for i in range(rows)],
                pa.list_(pa.string()),
            ),
            "point": pa.array(
                [{"x": i, "y": None if i % 2 else f"y{i}"} for i in range(rows)],
                pa.struct([("x", pa.int32()), ("y", pa.string())]),
            ),
            "price": pa.array(
                [
                    None if i % 5 == 0 else decimal.Decimal(f"{i}.{i % 100:02d}")
                    for i in range(rows)
                ],
                pa.decimal128(12, 2),
            ),
            "at": pa.array(
                [base + datetime.timedelta(seconds=37 * i) for i in range(rows)],
                pa.timestamp("us", tz="UTC"),
            ),
            "kind": pa.array(
                [["cat", "dog", None][i % 3] for i in range(rows)]
            ).dictionary_encode(),
        }
    )


class TestParquet(FormatTests):
    format = "parquet"

    @pytest.fixture
    def files(self, tmp_path: Path) -> list[Path]:
        paths = []
        for i, (rows, group) in enumerate([(300, 100), (250, 250), (1, 10)]):
            path = tmp_path / f"part-{i}.parquet"
            pq.write_table(typed_table(rows, seed=i + 1), path, row_group_size=group)
            paths.append(path)
        return paths

    def reference(self, path: Path) -> list[Any]:
        rows: list[Any] = pq.ParquetFile(path).read().to_pylist()
        return rows


class TestParquetSplitGroups(TestParquet):
    """Row groups above the unit bound are cut into units of whole rows (the bound is
    lowered here instead of writing 128 MiB groups)."""

    @pytest.fixture(autouse=True)
    def small_bound(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(parquet, "MAX_UNIT_BYTES", 4096)

    def max_unit_bytes(self) -> int:
        return 4096

    @pytest.mark.timeout(30)
    def test_a_big_row_group_is_split_evenly(self, source: FileSource, members: list[Any]) -> None:
        fmt = format_of("parquet")
        member = members[1]  # one row group of 250 rows
        (group,) = member.meta["row_groups"]
        counts = fmt.units(member)
        assert len(counts) >= -(-group[3] // 4096) > 1
        assert max(counts) - min(counts) <= 1
        assert sum(fmt.unit_bytes(member)) >= group[3]
        # every unit reads the group's chunks and the footer
        assert {tuple(map(tuple, fmt.unit_ranges(member, u))) for u in range(len(counts))} == {
            ((group[1], group[2]), tuple(member.meta["footer"]))
        }


def test_parquet_decodes_only_the_columns_asked(tmp_path: Path) -> None:
    path = tmp_path / "wide.parquet"
    pq.write_table(typed_table(2000, seed=9), path, row_group_size=2000)
    source = FileSource(tmp_path)
    fmt = format_of("parquet")
    member = fmt.scan(source, source.member(path, "parquet"), {})
    from chunkd.testing.formats import RangeSource

    counting = RangeSource(source, fmt.unit_ranges(member, 0))
    table = fmt.decode(counting, member, 0, ["score"])
    assert table.column_names == ["score"]
    chunk = pq.ParquetFile(path).metadata.row_group(0).column(2)
    assert chunk.path_in_schema == "score"
    # the score column's chunk alone (the footer is cached from the scan)
    assert sum(n for _, n in counting.reads) <= chunk.total_compressed_size
    assert sum(n for _, n in counting.reads) < member.meta["row_groups"][0][2] // 4


def test_parquet_units_of_an_old_manifest(tmp_path: Path) -> None:
    # a member as registered before units: its row groups are its units
    path = tmp_path / "old.parquet"
    pq.write_table(typed_table(100, seed=4), path, row_group_size=30)
    source = FileSource(tmp_path)
    fmt = format_of("parquet")
    member = fmt.scan(source, source.member(path, "parquet"), {})
    assert fmt.units(member) == [30, 30, 30, 10]
    assert fmt.unit_bytes(member) == [g[3] for g in member.meta["row_groups"]]
    assert formats.unit_starts(fmt, member) == [0, 30, 60, 90, 100]
    with pytest.raises(DatasetFormatError, match="no column 'nope'"):
        fmt.decode(source, member, 0, ["nope"])


def parquet_bytes(table: Any) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


class TestFixed(FormatTests):
    format = "fixed"
    options: ClassVar[Mapping[str, Any]] = {"record_bytes": 24}

    @pytest.fixture(autouse=True)
    def small_units(self, monkeypatch: pytest.MonkeyPatch) -> None:
        # units of 10 records (240 bytes) instead of 8 MiB ones
        monkeypatch.setattr(fixed, "UNIT_BYTES", 250)

    @pytest.fixture
    def files(self, tmp_path: Path) -> list[Path]:
        paths = []
        for i, records in enumerate([35, 10, 1]):
            path = tmp_path / f"records-{i}.bin"
            path.write_bytes(random.Random(i).randbytes(24 * records))
            paths.append(path)
        return paths

    def reference(self, path: Path) -> list[Any]:
        data = path.read_bytes()
        return [data[i : i + 24] for i in range(0, len(data), 24)]

    def damage(self, data: bytes, ranges: list[tuple[int, int]]) -> bytes | None:
        return None  # any bytes are records

    def refused(self, data: bytes) -> dict[str, bytes]:
        return {"truncated": data[:-1]}  # not a whole number of records

    @pytest.mark.timeout(30)
    def test_units_are_runs_of_whole_records(self, members: list[Any]) -> None:
        fmt = format_of("fixed")
        assert [fmt.units(m) for m in members] == [[10, 10, 10, 5], [10], [1]]
        assert fmt.unit_bytes(members[0]) == [240, 240, 240, 120]
        assert fmt.unit_ranges(members[0], 3) == [(720, 120)]

    @pytest.mark.timeout(30)
    def test_a_unit_is_the_bytes_read_not_a_copy(
        self, source: FileSource, members: list[Any]
    ) -> None:
        fmt = format_of("fixed")
        view = memoryview(bytearray(240))
        table = fmt.decode(_Fixed(view), members[0], 0, None)
        assert table.schema == pa.schema([("record", pa.binary(24))])
        view[24:48] = b"x" * 24  # the table sees a change to the bytes it was made of
        assert bytes(fmt.sample(table, 1)) == b"x" * 24


class _Bytes:
    """A source of one member's bytes, held in memory."""

    def __init__(self, view: memoryview) -> None:
        self.view = view

    def name(self, member: Any) -> str:
        return f"bytes/{member.key}"

    def read(self, member: Any, offset: int, length: int) -> memoryview:
        return self.view[offset : offset + length]


class _Fixed:
    """A source whose every read is one view."""

    def __init__(self, view: memoryview) -> None:
        self.view = view

    def name(self, member: Any) -> str:
        return f"view/{member.key}"

    def read(self, member: Any, offset: int, length: int) -> memoryview:
        return self.view[:length]


class TestFeather(FormatTests):
    """Feather v2: an IPC file, LZ4-compressed by default."""

    format = "arrow"

    @pytest.fixture
    def files(self, tmp_path: Path) -> list[Path]:
        paths = []
        for i, (rows, chunk) in enumerate([(300, 100), (250, 250), (1, 10)]):
            path = tmp_path / f"part-{i}.feather"
            feather.write_feather(typed_table(rows, seed=i + 1), path, chunksize=chunk)
            paths.append(path)
        return paths

    def reference(self, path: Path) -> list[Any]:
        rows: list[Any] = feather.read_table(path).to_pylist()
        return rows


class TestArrowFile(TestFeather):
    """An uncompressed IPC file written batch by batch (``pyarrow.ipc.new_file``)."""

    @pytest.fixture
    def files(self, tmp_path: Path) -> list[Path]:
        paths = []
        for i, sizes in enumerate([(100, 100, 100), (250,), (1,)]):
            table = typed_table(sum(sizes), seed=i + 1)
            path = tmp_path / f"part-{i}.arrow"
            with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as writer:
                start = 0
                for size in sizes:
                    writer.write_table(table.slice(start, size))
                    start += size
            paths.append(path)
        return paths

    def reference(self, path: Path) -> list[Any]:
        with pa.memory_map(str(path)) as source:
            rows: list[Any] = ipc.open_file(source).read_all().to_pylist()
        return rows


class TestFeatherWithoutDictionaries(TestFeather):
    """No dictionary column: a batch is decoded from its own bytes alone
    (``pyarrow.ipc.read_record_batch``), not through pyarrow's file reader."""

    @pytest.fixture
    def files(self, tmp_path: Path) -> list[Path]:
        paths = []
        for i, (rows, chunk) in enumerate([(300, 100), (250, 250), (1, 10)]):
            path = tmp_path / f"plain-{i}.feather"
            table = typed_table(rows, seed=i + 1).drop_columns(["kind"])
            feather.write_feather(table, path, chunksize=chunk)
            paths.append(path)
        return paths


class TestArrowFileWithoutDictionaries(TestFeather):
    """Uncompressed, no dictionary column: a batch's columns are the bytes read."""

    @pytest.fixture
    def files(self, tmp_path: Path) -> list[Path]:
        paths = []
        for i, (rows, chunk) in enumerate([(300, 100), (250, 250), (1, 10)]):
            path = tmp_path / f"plain-{i}.arrow"
            table = typed_table(rows, seed=i + 1).drop_columns(["kind"])
            feather.write_feather(table, path, chunksize=chunk, compression="uncompressed")
            paths.append(path)
        return paths

    @pytest.mark.timeout(30)
    def test_a_batch_is_the_bytes_read_not_a_copy(
        self, source: FileSource, members: list[Any]
    ) -> None:
        fmt = format_of("arrow")
        member = members[0]
        assert "compressed" not in member.meta
        assert "dictionaries" not in member.meta
        data = bytearray((source.root / member.key).read_bytes())
        view = memoryview(data)
        table = fmt.decode(_Bytes(view), member, 0, ["id"])
        values = table.column("id").chunk(0).buffers()[1]
        assert values.address >= pa.py_buffer(view).address
        assert values.address < pa.py_buffer(view).address + len(data)


class TestArrowSplitBatches(TestFeather):
    """Record batches above the unit bound are cut into units of whole rows."""

    @pytest.fixture(autouse=True)
    def small_bound(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(arrow, "MAX_UNIT_BYTES", 4096)

    def max_unit_bytes(self) -> int:
        return 4096

    @pytest.mark.timeout(30)
    def test_a_big_batch_is_split_evenly(self, members: list[Any]) -> None:
        fmt = format_of("arrow")
        member = members[1]  # one batch of 250 rows
        (batch,) = member.meta["batches"]
        counts = fmt.units(member)
        assert len(counts) >= -(-batch[3] // 4096) > 1
        assert max(counts) - min(counts) <= 1


def test_feather_v1_and_ipc_streams_are_refused_by_name(tmp_path: Path) -> None:
    table = typed_table(50, seed=3).select(["id", "text", "score"])
    v1 = tmp_path / "old.feather"
    with pytest.warns(DeprecationWarning, match="Feather V1"):  # still written, for this test
        feather.write_feather(table, v1, version=1)
    stream = tmp_path / "stream.arrow"
    with pa.OSFile(str(stream), "wb") as sink, ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    source = FileSource(tmp_path)
    fmt = format_of("arrow")
    with pytest.raises(DatasetFormatError, match=r"old\.feather is a Feather v1 file.*Feather v2"):
        fmt.scan(source, source.member(v1, "arrow"), {})
    with pytest.raises(DatasetFormatError, match=r"stream\.arrow is an Arrow IPC stream.*new_file"):
        fmt.scan(source, source.member(stream, "arrow"), {})


def test_arrow_scan_reads_only_the_footer_and_batch_messages(tmp_path: Path) -> None:
    path = tmp_path / "wide.arrow"
    table = typed_table(20_000, seed=5)
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=5000)
    source = FileSource(tmp_path)
    from chunkd.testing.formats import RangeSource

    counting = RangeSource(source, [(0, path.stat().st_size)])
    member = format_of("arrow").scan(counting, source.member(path, "arrow"), {})
    assert member.samples == 20_000
    assert [b[0] for b in member.meta["batches"]] == [5000] * 4
    assert "dictionaries" in member.meta  # the 'kind' column's
    # the last 64 KiB and four batch messages, not the batches' data
    data = sum(b[2] for b in member.meta["batches"])
    assert sum(n for _, n in counting.reads) <= (64 << 10) + 4 * 4096 < data // 4


@pytest.mark.timeout(10)
def test_a_manifest_names_any_format_and_a_reader_refuses_one_it_does_not_know() -> None:
    member = Member("a.csv", 10, "v1", "csv", 1)
    paged = Snapshot.build(backend="b", prefix="", format="csv", members=[member])
    assert paged.members[0].format == "csv"  # a plug-in's format, in a page
    # the one-document form, whose members the test edits in place below
    snapshot = Snapshot.build(backend="b", prefix="", format="csv", members=[member], schema=1)
    parsed = Snapshot.parse(snapshot.data, expect_id=snapshot.id)  # a plug-in's format
    assert parsed.members[0].format == "csv"
    with pytest.raises(DatasetFormatError, match="unknown member format 'csv'"):
        format_of(parsed.members[0].format)
    doc = json.loads(snapshot.data)
    doc["members"][0]["format"] = "CSV!"
    with pytest.raises(ManifestError, match="'CSV!' is not a format name"):
        Snapshot.parse(canonical(doc))
    assert "arrow" in FORMATS
    assert "arrow" in formats.names()


@pytest.mark.timeout(30)
def test_the_conformance_suite_imports_no_daemon() -> None:
    # chunkd.testing's names are imported when used: a format's tests need no daemon
    code = (
        "import sys, chunkd.testing, chunkd.testing.formats; "
        "print(sorted(m for m in sys.modules if m.startswith(('chunkd.gateway', 'chunkd.cache'))))"
    )
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=25
    )
    assert found.stdout.strip() == "[]"
    from chunkd.testing import free_port

    assert free_port() > 0
