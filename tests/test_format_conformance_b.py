"""JSON lines, WebDataset and MDS against the conformance suite
(:class:`chunkd.testing.formats.FormatTests`), and what each does beyond it.

Each class writes real files: JSON lines plain, in the seekable zstd format and as one
plain zstd frame; tars written by ``tarfile``; MDS shards laid out as Streaming's
``MDSWriter`` lays them (plain, zstd and gzip). The reference readers are apart from
the formats' code: lines split at ``\\n``, ``tarfile`` iteration grouped by WebDataset's
rule, and each MDS sample's bytes (found by the shard's own offsets table) decoded by
:func:`~chunkd.client.datasets.formats.mds.decode_sample`, the per-sample decoder
``Dataset[i]`` used before units, checked against the writer's inputs. Units are made
small here (the modules' bounds lowered) so that small files hold several.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import random
import struct
import tarfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import zstandard

from chunkd.client.datasets import formats
from chunkd.client.datasets.formats import format_of, jsonl, mds, settle, unit_starts, wds
from chunkd.errors import DatasetFormatError
from chunkd.snapshot import Member
from chunkd.testing.formats import FileSource, FormatTests, RangeSource

from .test_dataset_formats import (
    MDS_COLUMNS,
    assert_mds_equal,
    json_lines,
    mds_samples,
    mds_shard,
    seekable_zstd,
    tar_bytes,
    wds_files,
)

pa = pytest.importorskip("pyarrow")


@pytest.fixture(autouse=True)
def fresh_units(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test decodes afresh: no unit kept by an earlier read."""
    monkeypatch.setattr(formats, "_UNITS", formats.DecodedLRU(formats.DECODED_CACHE_BYTES, 4096))


# -- JSON lines --------------------------------------------------------------------------


def split_lines(data: bytes) -> list[bytes]:
    """JSON lines' samples: every line, the last one even without its newline."""
    if not data:
        return []
    lines = data.split(b"\n")
    return lines[:-1] if data.endswith(b"\n") else lines


def line_files(tmp_path: Path, suffix: str, pack: Any) -> list[Path]:
    contents = [
        b"\n".join(json_lines(300, seed=1)),  # no newline at the end; an empty line
        b"\n".join(json_lines(50, seed=2)) + b"\n",
        b'{"one": 1}',
    ]
    paths = []
    for i, content in enumerate(contents):
        path = tmp_path / f"part-{i}{suffix}"
        path.write_bytes(pack(content))
        paths.append(path)
    return paths


class TestJsonLines(FormatTests):
    format = "jsonl"

    @pytest.fixture(autouse=True)
    def small_units(self, monkeypatch: pytest.MonkeyPatch) -> None:
        # blocks of 16 lines, units of about three blocks
        monkeypatch.setattr(jsonl, "BLOCK_LINES", 16)
        monkeypatch.setattr(jsonl, "UNIT_BYTES", 3000)

    @pytest.fixture
    def files(self, tmp_path: Path) -> list[Path]:
        return line_files(tmp_path, ".jsonl", bytes)

    def reference(self, path: Path) -> list[Any]:
        return split_lines(path.read_bytes())

    def refused(self, data: bytes) -> dict[str, bytes]:
        return {}  # any bytes are lines

    @pytest.mark.timeout(30)
    def test_units_are_runs_of_whole_blocks(self, members: list[Member]) -> None:
        fmt = format_of("jsonl")
        member = members[0]
        counts = fmt.units(member)
        assert len(member.meta["index"]) == 19  # blocks of 16 lines
        assert len(counts) > 3
        assert all(count % 16 == 0 for count in counts[:-1])
        # a unit's decoded bytes: its lines' bytes and an offset each, about the bound
        assert all(size <= 3000 for size in fmt.unit_bytes(member)[:-1])
        assert fmt.unit_bytes(member)[0] > 3000 - 16 * 100


class TestJsonLinesSeekable(TestJsonLines):
    @pytest.fixture
    def files(self, tmp_path: Path) -> list[Path]:
        return line_files(tmp_path, ".jsonl.zst", lambda data: seekable_zstd(data, 700))

    def reference(self, path: Path) -> list[Any]:
        reader = zstandard.ZstdDecompressor().stream_reader(
            io.BytesIO(path.read_bytes()), read_across_frames=True
        )
        return split_lines(reader.read())

    def refused(self, data: bytes) -> dict[str, bytes]:
        return {"truncated": data[: len(data) * 2 // 3], "garbage": random.Random(7).randbytes(99)}


class TestJsonLinesStreamed(TestJsonLinesSeekable):
    """One zstd frame, not seekable: each unit is decompressed from the start."""

    @pytest.fixture(autouse=True)
    def small_streamed_units(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(jsonl, "STREAMED_UNIT_BYTES", 5000)

    @pytest.fixture
    def files(self, tmp_path: Path) -> list[Path]:
        return line_files(tmp_path, ".json.zst", zstandard.ZstdCompressor().compress)

    @pytest.mark.timeout(30)
    def test_units_are_runs_of_whole_blocks(self, members: list[Member]) -> None:
        fmt = format_of("jsonl")
        member = members[0]
        assert member.meta["seekable"] is False
        counts = fmt.units(member)
        assert len(counts) > 2
        assert all(count % 16 == 0 for count in counts[:-1])
        assert all(size <= 5000 for size in fmt.unit_bytes(member))
        assert fmt.unit_ranges(member, 1) == [(0, member.size)]


@pytest.mark.timeout(30)
def test_jsonl_decodes_one_binary_column_of_lines(tmp_path: Path) -> None:
    lines = [b'{"a": 1}', b"", b"caf\xc3\xa9 \r", b"[1]"]
    path = tmp_path / "lines.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    source = FileSource(tmp_path)
    fmt = format_of("jsonl")
    member = fmt.scan(source, source.member(path, "jsonl"), {})
    table = fmt.decode(source, member, 0, None)
    assert table.schema == pa.schema([("line", pa.binary())])
    assert table.column("line").to_pylist() == lines
    assert [fmt.sample(table, i) for i in range(4)] == lines
    assert all(type(fmt.sample(table, i)) is bytes for i in range(4))
    # no column asked: the rows alone
    assert fmt.decode(source, member, 0, []).num_rows == 4
    with pytest.raises(DatasetFormatError, match=r"no column 'text'.*'line'"):
        fmt.decode(source, member, 0, ["text"])


@pytest.mark.timeout(30)
def test_jsonl_units_aim_at_unit_bytes_and_a_streamed_member_is_bounded(tmp_path: Path) -> None:
    # 12 MB of lines: two units of about 8 MiB in place, one streamed unit
    lines = json_lines(110_000, seed=6)
    content = b"\n".join(lines) + b"\n"
    source = FileSource(tmp_path)
    fmt = format_of("jsonl")
    plain_path, zst_path = tmp_path / "big.jsonl", tmp_path / "big.jsonl.zst"
    plain_path.write_bytes(content)
    zst_path.write_bytes(zstandard.ZstdCompressor(level=1).compress(content))
    plain = fmt.scan(source, source.member(plain_path, "jsonl"), {})
    streamed = fmt.scan(source, source.member(zst_path, "jsonl"), {})
    sizes = fmt.unit_bytes(plain)
    assert len(sizes) == 2
    assert formats.UNIT_BYTES - jsonl.BLOCK_BYTES < sizes[0] <= formats.UNIT_BYTES
    assert fmt.units(streamed) == [110_000]
    assert jsonl.STREAMED_UNIT_BYTES == formats.MAX_UNIT_BYTES
    # a unit reads its own blocks: one range, the second's from where the first ends
    (first,), (second,) = fmt.unit_ranges(plain, 0), fmt.unit_ranges(plain, 1)
    assert first[0] == 0
    assert second == (sum(first), len(content) - sum(first))
    starts = unit_starts(fmt, plain)
    refusing = RangeSource(source, [second])
    table = fmt.decode(refusing, plain, 1, None)
    assert table.column("line").to_pylist() == lines[starts[1] :]


@pytest.mark.timeout(30)
def test_jsonl_lines_that_are_not_those_recorded_are_refused(tmp_path: Path) -> None:
    source = FileSource(tmp_path)
    fmt = format_of("jsonl")
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"a\nb\nc\n")
    member = fmt.scan(source, source.member(path, "jsonl"), {})
    # the same length, one line fewer: what a manifest says no longer holds
    path.write_bytes(b"a\nbbc\n")
    rewritten = Member(member.key, member.size, source.member(path, "jsonl").version, "jsonl",
                       member.samples, member.meta)  # fmt: skip
    with pytest.raises(
        DatasetFormatError, match=r"files/a\.jsonl: the bytes of lines 0\.\.3 hold 2"
    ):
        fmt.decode(source, rewritten, 0, None)


# -- WebDataset --------------------------------------------------------------------------


def tarfile_samples(path: Path) -> list[dict[str, Any]]:
    """A tar's samples by ``tarfile`` iteration and WebDataset's grouping rule."""
    samples: list[dict[str, Any]] = []
    with tarfile.open(path) as tar:
        for info in tar:
            if not info.isreg():
                continue
            folder, _, base = info.name.rpartition("/")
            stem, dot, ext = base.partition(".")
            if not dot or not stem or not ext or (base.startswith("__") and base.endswith("__")):
                continue
            key, ext = (f"{folder}/" if folder else "") + stem, ext.lower()
            if not samples or samples[-1]["__key__"] != key or ext in samples[-1]:
                samples.append({"__key__": key})
            file = tar.extractfile(info)
            assert file is not None
            samples[-1][ext] = file.read()
    return samples


class TestWebDataset(FormatTests):
    format = "wds"

    @pytest.fixture(autouse=True)
    def small_units(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(wds, "UNIT_BYTES", 20_000)

    @pytest.fixture
    def files(self, tmp_path: Path) -> list[Path]:
        paths = []
        for i, (count, fmt) in enumerate(
            [(40, tarfile.PAX_FORMAT), (12, tarfile.GNU_FORMAT), (6, tarfile.USTAR_FORMAT)]
        ):
            path = tmp_path / f"shard-{i}.tar"
            path.write_bytes(tar_bytes(wds_files(count, seed=i), fmt))
            paths.append(path)
        return paths

    def reference(self, path: Path) -> list[Any]:
        return tarfile_samples(path)

    @pytest.mark.timeout(30)
    def test_an_unknown_column_is_refused_by_name(
        self, fmt: Any, source: FileSource, members: list[Member]
    ) -> None:
        # An extension the member lacks is a column of nulls: the batch that asks for it
        # may hold another member's samples that have it. A name no extension can have
        # (extensions are lowercase) is refused, naming the member's columns.
        member = members[0]
        table = fmt.decode(source, member, 0, ["txt", "__key__"])
        assert table.column_names == ["txt", "__key__"]
        assert table.column("txt").null_count == table.num_rows
        assert table.schema.field("txt").type == pa.binary()
        assert all("txt" not in fmt.sample(table, r) for r in range(table.num_rows))
        with pytest.raises(DatasetFormatError, match=r"no column 'JPG'.*cls, jpg, json, seg\.png"):
            fmt.decode(source, member, 0, ["__key__", "JPG"])

    @pytest.mark.timeout(30)
    def test_units_are_runs_of_whole_samples_of_about_unit_bytes(
        self, fmt: Any, source: FileSource, members: list[Member], files: list[Path]
    ) -> None:
        member = members[0]
        counts, sizes = fmt.units(member), fmt.unit_bytes(member)
        assert len(counts) >= 3
        assert all(size <= 20_000 for size in sizes)
        # a unit's range: its first file's data to its last file's end, in one read
        index = member.meta["index"]
        starts = unit_starts(fmt, member)
        for unit in range(len(counts)):
            first = index[starts[unit]][1][0]
            last = index[starts[unit + 1] - 1][1][-1]
            assert fmt.unit_ranges(member, unit) == [(first[1], last[1] + last[2] - first[1])]
        # the columns: the key, then the member's own extensions, sorted
        table = fmt.decode(source, member, 0, None)
        assert table.schema == pa.schema(
            [(name, pa.string() if name == "__key__" else pa.binary())
             for name in ["__key__", "cls", "jpg", "json", "seg.png"]]
        )  # fmt: skip
        assert table.column("seg.png").null_count > 0  # nulls where a sample lacks one
        # a sample bigger than the target is a unit alone
        big = files[0].with_name("big.tar")
        big.write_bytes(tar_bytes([("a.bin", b"1" * 30_000), ("b.bin", b"2"), ("c.bin", b"3")]))
        scanned = fmt.scan(source, source.member(big, "wds"), {})
        assert fmt.units(scanned) == [1, 2]

    @pytest.mark.timeout(30)
    def test_members_of_other_extensions_combine_as_the_loader_combines_them(
        self, fmt: Any, source: FileSource, tmp_path: Path
    ) -> None:
        paths = [tmp_path / "a.tar", tmp_path / "b.tar"]
        paths[0].write_bytes(tar_bytes([("k1.jpg", b"j1"), ("k1.cls", b"1"), ("k2.cls", b"2")]))
        paths[1].write_bytes(tar_bytes([("k3.txt", b"t3"), ("k3.cls", b"3")]))
        members = [fmt.scan(source, source.member(p, "wds"), {}) for p in paths]
        tables = [fmt.decode(source, m, 0, None) for m in members]
        assert [t.column_names for t in tables] == [
            ["__key__", "cls", "jpg"],
            ["__key__", "cls", "txt"],
        ]
        # the loader's batch: the units' tables combined, a missing column null
        whole = pa.concat_tables(tables, promote_options="permissive").take([2, 0, 1])
        assert [fmt.sample(whole, r) for r in range(3)] == [
            {"__key__": "k3", "cls": b"3", "txt": b"t3"},
            {"__key__": "k1", "cls": b"1", "jpg": b"j1"},
            {"__key__": "k2", "cls": b"2"},
        ]

    @pytest.mark.timeout(30)
    def test_a_key_that_is_not_utf8_keeps_its_bytes(
        self, fmt: Any, source: FileSource, tmp_path: Path
    ) -> None:
        path = tmp_path / "latin.tar"
        sink = io.BytesIO()
        with tarfile.open(
            fileobj=sink, mode="w", format=tarfile.GNU_FORMAT, encoding="latin-1"
        ) as tar:
            for name, data in [("caf\xe9.txt", b"x"), ("plain.txt", b"y")]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        path.write_bytes(sink.getvalue())
        member = fmt.scan(source, source.member(path, "wds"), {})
        want = [{"__key__": "caf\udce9", "txt": b"x"}, {"__key__": "plain", "txt": b"y"}]
        table = fmt.decode(source, member, 0, None)
        taken = pa.concat_tables([table, table]).take([3, 0])
        assert [fmt.sample(taken, 0), fmt.sample(taken, 1)] == want[::-1]
        assert [fmt.read(source, member, i) for i in range(2)] == want

    @pytest.mark.timeout(30)
    def test_a_truncated_tar_is_refused_as_it_was(
        self, fmt: Any, source: FileSource, members: list[Member], files: list[Path]
    ) -> None:
        member, path = members[0], files[0]
        data = path.read_bytes()
        last = len(fmt.units(member)) - 1
        ((offset, _),) = fmt.unit_ranges(member, last)
        path.write_bytes(data[: offset + 10])
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        cut = Member(member.key, member.size, source.member(path, "wds").version, "wds",
                     member.samples, member.meta)  # fmt: skip
        with pytest.raises(DatasetFormatError, match="ends inside the data of"):
            fmt.decode(source, cut, last, None)


# -- MDS ---------------------------------------------------------------------------------


def shard_samples(path: Path, entry: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every sample of a shard: its bytes found by the shard's offsets table, decoded by
    the per-sample decoder (``mds.decode_sample``)."""
    data = path.read_bytes()
    compression = entry.get("compression")
    if compression:
        family = str(compression).partition(":")[0]
        if family == "zstd":
            data = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read()
        else:
            data = gzip.decompress(data)
    (count,) = struct.unpack_from("<I", data)
    offsets = struct.unpack_from(f"<{count + 1}I", data, 4)
    columns = [[n, e, s] for n, e, s in zip(entry["column_names"], entry["column_encodings"],
                                            entry["column_sizes"], strict=True)]  # fmt: skip
    return [mds.decode_sample(columns, data[offsets[i] : offsets[i + 1]]) for i in range(count)]


def assert_same_mds(got: dict[str, Any], want: dict[str, Any]) -> None:
    """The same columns, values and types (numpy scalars stay numpy scalars)."""
    assert list(got) == list(want)
    for column, value in want.items():
        assert type(got[column]) is type(value), column
        if isinstance(value, np.ndarray):
            assert got[column].dtype == value.dtype
            assert not got[column].flags.writeable
            np.testing.assert_array_equal(got[column], value)
        else:
            assert got[column] == value, column


class TestMds(FormatTests):
    format = "mds"
    #: each shard's compression
    compressions: ClassVar[list[str | None]] = [None, None, None]

    @pytest.fixture(autouse=True)
    def small_units(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(mds, "UNIT_BYTES", 3000)
        monkeypatch.setattr(mds, "STREAMED_UNIT_BYTES", 6000)

    @pytest.fixture
    def written(self, tmp_path: Path) -> tuple[list[Path], dict[str, Any], list[list[Any]]]:
        """Shards and their folder's index.json, and the samples written."""
        paths, entries, inputs = [], [], []
        for i, (count, compression) in enumerate(
            zip([60, 3000, 1], self.compressions, strict=True)
        ):
            samples = mds_samples(count, seed=i)
            data, entry = mds_shard(MDS_COLUMNS, samples, f"shard.{i:05d}.mds", compression)
            basename = (entry["zip_data"] or entry["raw_data"])["basename"]
            path = tmp_path / basename
            path.write_bytes(data)
            paths.append(path)
            entries.append(entry)
            inputs.append(samples)
        index = {"version": 2, "shards": entries}
        (tmp_path / "index.json").write_text(json.dumps(index))
        return paths, index, inputs

    @pytest.fixture
    def files(self, written: tuple[list[Path], dict[str, Any], list[list[Any]]]) -> list[Path]:
        return written[0]

    @pytest.fixture
    def members(
        self, fmt: Any, source: FileSource, written: tuple[list[Path], dict[str, Any], Any]
    ) -> list[Member]:
        # each shard scanned with its entry in the folder's index.json, as registration does
        paths, index, _ = written
        scanned = [
            fmt.scan(source, source.member(p, "mds"), {"mds_index": index, "mds_basename": p.name})
            for p in paths
        ]
        return settle(fmt, scanned)[1]

    def reference(self, path: Path) -> list[Any]:
        index = json.loads((path.parent / "index.json").read_text())
        (entry,) = [e for e in index["shards"]
                    if path.name in ((e["zip_data"] or {}).get("basename"),
                                     e["raw_data"]["basename"])]  # fmt: skip
        return shard_samples(path, entry)

    def assert_same(self, got: Any, want: Any) -> None:
        assert_same_mds(got, want)

    def refused(self, data: bytes) -> dict[str, bytes]:
        # a shard is scanned with its index.json entry: the refusals of a shard that
        # does not match it are test_dataset_formats' (..._refused_by_name)
        return {}

    @pytest.mark.timeout(30)
    def test_samples_are_what_the_writer_wrote(
        self, fmt: Any, source: FileSource, members: list[Member], written: Any
    ) -> None:
        for member, want in zip(members, written[2], strict=True):
            for unit in range(len(fmt.units(member))):
                table = fmt.decode(source, member, unit, None)
                first = unit_starts(fmt, member)[unit]
                for row in range(table.num_rows):
                    assert_mds_equal(fmt.sample(table, row), want[first + row])

    @pytest.mark.timeout(30)
    def test_columns_are_arrow_numbers_strings_and_encoded_bytes(
        self, fmt: Any, source: FileSource, members: list[Member]
    ) -> None:
        table = fmt.decode(source, members[0], 0, None)
        types = {field.name: field.type for field in table.schema}
        assert table.column_names == [c[0] for c in members[0].meta["columns"]]
        assert types == {
            "big": pa.uint64(), "blob": pa.binary(), "count": pa.binary(), "grid": pa.binary(),
            "half": pa.float16(), "id": pa.int64(), "image": pa.binary(), "label": pa.uint8(),
            "meta": pa.binary(), "obj": pa.binary(), "row": pa.binary(), "score": pa.float32(),
            "small": pa.int16(), "text": pa.string(), "vec": pa.binary(),
        }  # fmt: skip
        # a pickle stays its bytes, never unpickled
        assert table.column("obj")[0].as_py() == pickle.dumps({"never": "unpickled"})
        assert fmt.sample(table, 0)["obj"] == pickle.dumps({"never": "unpickled"})
        # "int" is a Python int; "uint8" a numpy scalar, as Streaming gives them
        assert type(fmt.sample(table, 0)["id"]) is int
        assert type(fmt.sample(table, 0)["label"]) is np.uint8
        only = fmt.decode(source, members[0], 0, ["text", "label"])
        assert fmt.sample(only, 1) == {"text": fmt.sample(table, 1)["text"],
                                       "label": fmt.sample(table, 1)["label"]}  # fmt: skip

    @pytest.mark.timeout(30)
    def test_units_are_runs_of_the_recorded_offsets(self, fmt: Any, members: list[Member]) -> None:
        member = members[1]  # 3000 samples: every third offset recorded
        assert member.meta["stride"] == 3
        counts = fmt.units(member)
        assert len(counts) > 3
        assert all(count % 3 == 0 for count in counts[:-1])
        assert all(size <= 3000 for size in fmt.unit_bytes(member)[:-1])
        if "compression" not in member.meta:
            # the offsets table's part and the samples: two ranges
            (table, samples) = fmt.unit_ranges(member, 1)
            assert table == (4 + 4 * counts[0], 4 * (counts[1] + 1))
            offsets = member.meta["offsets"]
            assert samples[0] == offsets[counts[0] // 3]


class TestMdsCompressed(TestMds):
    compressions: ClassVar[list[str | None]] = ["zstd:7", "zstd", "gz"]

    @pytest.mark.timeout(30)
    def test_units_are_runs_of_the_recorded_offsets(self, fmt: Any, members: list[Member]) -> None:
        member = members[1]
        counts = fmt.units(member)
        assert len(counts) > 3
        assert all(size <= 6000 for size in fmt.unit_bytes(member)[:-1])
        assert all(fmt.unit_ranges(member, u) == [(0, member.size)] for u in range(len(counts)))

    @pytest.mark.timeout(30)
    def test_a_shard_is_decompressed_once_for_its_units(
        self, fmt: Any, source: FileSource, members: list[Member], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        member = members[1]
        counting = RangeSource(source, [(0, member.size)])
        units = len(fmt.units(member))
        for unit in reversed(range(units)):
            fmt.decode(counting, member, unit, None)
        assert sum(n for _, n in counting.reads) == member.size
        # a shard bigger than the cache's bound: each unit decompresses it from its start,
        # as far as the unit's end, keeping none of it
        monkeypatch.setattr(mds, "CACHE_BYTES", 1000)
        monkeypatch.setattr(mds, "_CACHE", formats.DecodedLRU(1000, 2))
        again = RangeSource(source, [(0, member.size)])
        want = self.reference(source.root / member.key)
        starts = unit_starts(fmt, member)
        for unit in (0, units - 1, 1):
            table = fmt.decode(again, member, unit, None)
            for row in range(table.num_rows):
                assert_same_mds(fmt.sample(table, row), want[starts[unit] + row])
        assert len(mds._CACHE) == 0
        assert sum(n for _, n in again.reads) > member.size
