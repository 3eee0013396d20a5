"""Dataset member formats through a real daemon: what a scan records, what reads return.

Every test writes real files (pyarrow's Parquet, JSON lines plain and zstd, tars made by
``tarfile``, MDS shards laid out as MosaicML Streaming's writer lays them) into the
``local`` file:// backend of a ``chunkd serve``, scans them as registration does
(``format_of(fmt).scan(PinnedSource(client, "local"), member, options)``) and reads
every sample back. A counting source shows what a scan and a read touch.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import random
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import zstandard

from chunkd.client import Client
from chunkd.client.datasets.formats import DecodedLRU, detect, format_of, settle
from chunkd.client.datasets.source import PinnedSource
from chunkd.errors import DatasetFormatError, SnapshotDriftError
from chunkd.snapshot import Member
from chunkd.testing import free_port
from chunkd.testing.daemon import DaemonProcess

from .conftest import wait_for_socket

CHUNK = 256 << 10

TOML = """
[server]
socket = "{dir}/chunkd.sock"
[cache]
dir = "{dir}/chunkd-cache"
ram_bytes = "256MiB"
disk_bytes = "1GiB"
disk_min_free_bytes = 0
chunk_bytes = "256KiB"
fsync = "never"
[[backends]]
name = "local"
url = "file://{dir}/chunkd-data"
revalidate = "1s"
"""


# -- a daemon, and files in its backend ---------------------------------------------------


class CountingSource:
    """A source that records every range it is asked for (``file()`` reads included)."""

    def __init__(self, inner: PinnedSource) -> None:
        self.inner = inner
        self.reads: list[tuple[int, int]] = []

    def name(self, member: Member) -> str:
        return self.inner.name(member)

    def read(self, member: Member, offset: int, length: int) -> memoryview:
        view = self.inner.read(member, offset, length)
        self.reads.append((offset, len(view)))
        return view

    def file(self, member: Member) -> BinaryIO:
        return _CountingFile(self, member)  # type: ignore[return-value]

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.reads)

    def clear(self) -> None:
        self.reads.clear()


class _CountingFile(io.RawIOBase):
    def __init__(self, source: CountingSource, member: Member) -> None:
        super().__init__()
        self.source, self.member, self.position = source, member, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.position, self.member.size)[whence]
        self.position = base + offset
        return self.position

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.member.size - self.position)
        if n <= 0:
            return 0
        got = self.source.read(self.member, self.position, n)
        buffer[: len(got)] = got
        self.position += len(got)
        return len(got)


@dataclass
class Store:
    """A running daemon, its backend folder and a client."""

    client: Client
    data: Path
    #: this test's folder in the backend
    prefix: str

    @property
    def source(self) -> PinnedSource:
        return PinnedSource(self.client, "local")

    def counting(self) -> CountingSource:
        return CountingSource(self.source)

    def put(self, key: str, content: bytes, fmt: str | None = None) -> Member:
        key = f"{self.prefix}/{key}"
        path = self.data / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        stat = self.client.stat(f"local/{key}")
        fmt = fmt or detect(key)
        assert fmt is not None
        return Member(key, stat.size, stat.version, fmt)

    def scan(self, key: str, content: bytes, fmt: str | None = None, **options: Any) -> Member:
        member = self.put(key, content, fmt)
        return format_of(member.format).scan(self.source, member, options)

    def samples(self, member: Member) -> list[Any]:
        fmt = format_of(member.format)
        source = self.source  # one source: FormatBase.read keeps units per source
        return [fmt.read(source, member, i) for i in range(member.samples)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One ``chunkd serve`` for the module (each test writes under its own prefix)."""
    root = tmp_path_factory.mktemp("formats")
    (root / "chunkd-data").mkdir()
    launched = DaemonProcess(TOML.format(dir=root), cwd=root, listen=f"127.0.0.1:{free_port()}")
    try:
        launched.wait_ready()
        if not wait_for_socket(root / "chunkd.sock", 10):
            pytest.skip("`chunkd serve` did not create its local socket in 10 s")
        yield root
    finally:
        launched.stop()


@pytest.fixture
def store(daemon: Path, request: pytest.FixtureRequest) -> Iterator[Store]:
    prefix = "".join(c if c.isalnum() else "-" for c in request.node.name)
    with Client(daemon / "chunkd.sock") as client:
        yield Store(client, daemon / "chunkd-data", prefix)


def assert_covered(reads: list[tuple[int, int]], ranges: list[tuple[int, int]]) -> None:
    """Every byte read lies inside one of ``ranges``."""
    for offset, length in reads:
        if length:
            assert any(o <= offset and offset + length <= o + n for o, n in ranges), (
                f"read {offset}+{length} is outside {ranges}"
            )


# -- Parquet -----------------------------------------------------------------------------

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from chunkd.client.datasets import formats as formats_module  # noqa: E402


def parquet_bytes(table: Any, row_group_size: int) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=row_group_size)
    return sink.getvalue()


def rows_table(rows: int, seed: int = 1) -> Any:
    rng = random.Random(seed)
    return pa.table(
        {
            "id": list(range(rows)),
            "text": [f"row {i} " + rng.randbytes(rng.randrange(200)).hex() for i in range(rows)],
            "score": [None if i % 7 == 0 else i / 3 for i in range(rows)],
            "tags": [[f"t{i % 5}"] * (i % 3) for i in range(rows)],
        }
    )


def test_parquet_rows_read_back_from_their_row_group_only(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = rows_table(10_000)
    content = parquet_bytes(table, row_group_size=200)  # 50 row groups
    source = store.counting()
    member = store.put("pq/part-0.parquet", content)
    member = format_of("parquet").scan(source, member, {})

    # The scan read the footer and nothing else: the file's last 64 KiB at most.
    footer_offset, footer_length = member.meta["footer"]
    assert footer_offset + footer_length == len(content)
    assert all(offset >= len(content) - (64 << 10) for offset, _ in source.reads)
    assert source.bytes <= (64 << 10) < len(content) // 20
    assert member.samples == 10_000
    assert len(member.meta["row_groups"]) == 50
    assert [g[0] for g in member.meta["row_groups"]] == [200] * 50
    assert member.meta["schema"] == [
        ["id", "int64"],
        ["text", "string"],
        ["score", "double"],
        ["tags", "list<element: string>"],
    ]

    # Every row is its dict; the decoded row group serves its neighbours.
    # decoded row groups are FormatBase's per-process units (issue 25)
    monkeypatch.setattr(formats_module, "_UNITS", DecodedLRU(64 << 20, 4))
    expected = table.to_pylist()
    fmt = format_of("parquet")
    source.clear()
    assert fmt.read(source, member, 0) == expected[0]
    first = list(source.reads)
    assert fmt.read(source, member, 1) == expected[1]
    assert fmt.read(source, member, 199) == expected[199]
    assert source.reads == first  # rows 1 and 199 decoded nothing again
    for index in random.Random(2).sample(range(10_000), 300):
        source.clear()
        assert fmt.read(source, member, index) == expected[index]
        assert_covered(source.reads, fmt.ranges(member, index))
        assert len(formats_module._UNITS) <= 4
    assert [fmt.read(store.source, member, i) for i in range(0, 10_000, 97)] == expected[::97]


def test_parquet_schema_is_kept_only_where_a_member_differs(store: Store) -> None:
    same = [store.scan(f"pq/s-{i}.parquet", parquet_bytes(rows_table(30), 10)) for i in range(3)]
    other = store.scan("pq/s-9.parquet", parquet_bytes(pa.table({"id": [1.5, 2.5]}), 10))
    fmt = format_of("parquet")
    schema, members = settle(fmt, [*same, other])
    assert schema == same[0].meta["schema"]
    assert ["schema" in m.meta for m in members] == [False, False, False, True]
    assert members[3].meta["schema"] == [["id", "double"]]
    # Reads need no schema in the member.
    assert fmt.read(store.source, members[1], 29)["id"] == 29
    assert fmt.schema([]) is None


def test_parquet_that_is_not_parquet_is_refused_by_name(store: Store) -> None:
    content = parquet_bytes(rows_table(100), 10)
    bad = {
        "pq/tiny.parquet": b"PAR1",
        "pq/truncated.parquet": content[: len(content) - 100],
        "pq/garbage.parquet": random.Random(3).randbytes(5000),
        "pq/footer.parquet": content[:-200] + b"\x00" * 192 + content[-8:],
        "pq/length.parquet": content[:-8] + struct.pack("<I", 10**9) + b"PAR1",
    }
    for key, data in bad.items():
        with pytest.raises(DatasetFormatError, match=f"local/{store.prefix}/{key}"):
            store.scan(key, data)


def test_an_empty_parquet_file_holds_no_samples(store: Store) -> None:
    empty = pa.table({"id": pa.array([], pa.int64())})
    member = store.scan("pq/empty.parquet", parquet_bytes(empty, 10))
    assert member.samples == 0


# -- JSON lines --------------------------------------------------------------------------

from chunkd.client.datasets.formats import UNIT_BYTES  # noqa: E402
from chunkd.client.datasets.formats import jsonl as jsonl_format  # noqa: E402


def json_lines(count: int, seed: int = 5) -> list[bytes]:
    """Lines of JSON of varied length, with an empty line now and then."""
    rng = random.Random(seed)
    lines = []
    for i in range(count):
        if i % 997 == 13:
            lines.append(b"")
        else:
            lines.append(json.dumps({"i": i, "pad": "é" * rng.randrange(30)}).encode())
    return lines


def test_jsonl_lines_read_back_through_a_sparse_index(store: Store) -> None:
    lines = json_lines(100_000)
    content = b"\n".join(lines)  # no newline at the end
    source = store.counting()
    member = store.put("jl/big.jsonl", content)
    member = format_of("jsonl").scan(source, member, {})
    assert member.samples == 100_000
    index = member.meta["index"]
    assert index[0] == [0, 0]
    assert 98 <= len(index) <= 100  # a block every 1024 lines: a small meta
    assert all(later[0] - earlier[0] == 1024 for earlier, later in itertools.pairwise(index))
    assert all(content[offset - 1] == 0x0A for _, offset in index[1:])
    assert set(member.meta) == {"index"}
    # The scan read the member once, in pieces.
    assert source.bytes == len(content)

    fmt = format_of("jsonl")
    assert store.samples(member) == lines
    for i in random.Random(1).sample(range(100_000), 200):
        source.clear()
        assert fmt.read(source, member, i) == lines[i]
        assert_covered(source.reads, fmt.ranges(member, i))
        # its unit (whole blocks of about UNIT_BYTES decoded, what the loader decodes
        # at once), not more
        assert source.bytes <= sum(n for _, n in fmt.ranges(member, i)) <= 2 * UNIT_BYTES


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"", []),
        (b"\n", [b""]),
        (b"a", [b"a"]),
        (b"a\n", [b"a"]),
        (b"\n\n", [b"", b""]),
        (b'{"a":1}\n\n{"b":2}', [b'{"a":1}', b"", b'{"b":2}']),
    ],
)
def test_jsonl_keeps_every_line_as_the_torch_format_does(
    store: Store, content: bytes, expected: list[bytes]
) -> None:
    member = store.scan("jl/small.jsonl", content)
    assert member.samples == len(expected)
    assert store.samples(member) == expected
    zst = store.scan("jl/small.jsonl.zst", zstandard.ZstdCompressor().compress(content))
    assert store.samples(zst) == expected
    seekable = store.scan("jl/small.json.zst", seekable_zstd(content, 1))
    assert seekable.meta["seekable"] is True
    assert store.samples(seekable) == expected


def test_jsonl_blocks_are_bounded_by_bytes_too(store: Store) -> None:
    lines = [json.dumps({"i": i, "pad": "y" * 100_000}).encode() for i in range(200)]
    member = store.scan("jl/wide.ndjson", b"\n".join(lines) + b"\n")
    assert member.samples == 200
    spans = [later[1] - earlier[1] for earlier, later in itertools.pairwise(member.meta["index"])]
    assert spans
    assert max(spans) < (4 << 20) + 200_000
    assert store.samples(member)[150] == lines[150]


def seekable_zstd(data: bytes, frame_bytes: int, *, checksums: bool = False) -> bytes:
    """``data`` in the seekable zstd format: frames of ``frame_bytes`` decompressed
    bytes, then the skippable frame of the frame table (the format of zstd's
    ``contrib/seekable_format``)."""
    compressor = zstandard.ZstdCompressor(write_content_size=False)
    frames, entries = [], []
    for at in range(0, len(data), frame_bytes):
        raw = data[at : at + frame_bytes]
        frame = compressor.compress(raw)
        frames.append(frame)
        entry = struct.pack("<II", len(frame), len(raw))
        if checksums:
            entry += struct.pack("<I", 0)
        entries.append(entry)
    footer = struct.pack("<IBI", len(frames), 0x80 if checksums else 0, 0x8F92EAB1)
    table = b"".join(entries) + footer
    return b"".join(frames) + struct.pack("<II", 0x184D2A5E, len(table)) + table


def test_seekable_zstd_lines_decompress_only_their_frames(store: Store) -> None:
    lines = json_lines(30_000, seed=8)
    content = b"\n".join(lines) + b"\n"
    source = store.counting()
    member = store.put("jl/seek.jsonl.zst", seekable_zstd(content, 64 << 10, checksums=True))
    member = format_of("jsonl").scan(source, member, {})
    assert member.meta["seekable"] is True
    assert member.meta["bytes"] == len(content)
    assert member.meta["frames"] == -(-len(content) // (64 << 10))
    assert member.samples == 30_000
    fmt = format_of("jsonl")
    for i in random.Random(4).sample(range(30_000), 100):
        source.clear()
        assert fmt.read(source, member, i) == lines[i]
        assert_covered(source.reads, fmt.ranges(member, i))
        # a unit's frames at most (issue 25: a unit is a run of blocks of about 8 MiB)
        assert source.bytes <= sum(n for _, n in fmt.ranges(member, i))
    assert store.samples(member) == lines


def test_zstd_that_is_not_seekable_is_read_from_its_start(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = json_lines(5_000, seed=9)
    content = b"\n".join(lines)
    member = store.scan("jl/plain.jsonl.zst", zstandard.ZstdCompressor().compress(content))
    assert member.meta["seekable"] is False
    assert member.meta["bytes"] == len(content)
    assert member.samples == 5_000
    fmt = format_of("jsonl")
    assert fmt.ranges(member, 4_000) == [(0, member.size)]
    assert store.samples(member) == lines
    # Units of a streamed member (issue 25): each decompressed from the member's start,
    # as far as its end.
    monkeypatch.setattr(jsonl_format, "STREAMED_UNIT_BYTES", 20_000)
    member = store.scan("jl/units.jsonl.zst", zstandard.ZstdCompressor().compress(content))
    assert len(fmt.units(member)) > 3
    assert [fmt.read(store.source, member, i) for i in (4_999, 7, 2_500)] == [
        lines[4_999],
        lines[7],
        lines[2_500],
    ]


def test_broken_zstd_is_refused_by_name(store: Store) -> None:
    good = seekable_zstd(b"a\n" * 1000, 100)
    cases = {
        "jl/garbage.jsonl.zst": random.Random(1).randbytes(3000),
        "jl/truncated.jsonl.zst": zstandard.ZstdCompressor().compress(b"\n".join(json_lines(5000)))[
            :-20
        ],
        "jl/table.jsonl.zst": good[:-17] + b"\xff" * 8 + good[-9:],
        "jl/skippable.jsonl.zst": good[: -(8 + 20 * 8 + 9)] + b"\0" * 8 + good[-(20 * 8 + 9) :],
    }
    for key, data in cases.items():
        with pytest.raises(DatasetFormatError, match=f"local/{store.prefix}/{key}"):
            store.scan(key, data)


def test_line_problems_are_found_by_streaming(store: Store) -> None:
    lines = [b'{"a": 1}', b"", b"not json", b'"caf\xe9"', b"[1, 2]", b"   "]
    member = store.scan("jl/bad.jsonl", b"\n".join(lines) + b"\n")
    found = [(n, kind) for n, kind, _ in jsonl_format.problems(store.source, member)]
    assert found == [(1, "blank"), (2, "not-json"), (3, "not-utf8"), (5, "blank")]
    first_two = list(jsonl_format.problems(store.source, member, lines=2))
    assert [kind for _, kind, _ in first_two] == ["blank"]
    zst = store.scan("jl/bad.jsonl.zst", zstandard.ZstdCompressor().compress(b"\n".join(lines)))
    assert [(n, kind) for n, kind, _ in jsonl_format.problems(store.source, zst)] == found


# -- WebDataset --------------------------------------------------------------------------

import pickle  # noqa: E402
import tarfile  # noqa: E402

import numpy as np  # noqa: E402


def tar_bytes(files: list[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    """A tar of ``(path, data)`` files (a path ending in ``/`` is a folder)."""
    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode="w", format=fmt) as tar:
        for path, data in files:
            info = tarfile.TarInfo(path.rstrip("/"))
            if path.endswith("/"):
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return sink.getvalue()


def wds_samples(files: list[tuple[str, bytes]]) -> list[dict[str, Any]]:
    """What WebDataset makes of the files, written out apart from the format's code."""
    samples: list[dict[str, Any]] = []
    for path, data in files:
        folder, _, base = path.rpartition("/")
        if path.endswith("/") or "." not in base or base.startswith("__"):
            continue
        key = (folder + "/" if folder else "") + base.split(".", 1)[0]
        ext = base.split(".", 1)[1].lower()
        if not samples or samples[-1]["__key__"] != key or ext in samples[-1]:
            samples.append({"__key__": key})
        samples[-1][ext] = data
    return samples


def wds_files(count: int, seed: int = 3) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    files: list[tuple[str, bytes]] = [("shard/", b"")]
    for i in range(count):
        key = f"shard/sample{i:06d}"
        if i % 50 == 7:  # a path longer than ustar's 100 bytes of name
            key = "shard/" + "deep/" * 25 + f"sample{i:06d}"
        files.append((f"{key}.jpg", rng.randbytes(rng.randrange(1, 3000))))
        files.append((f"{key}.cls", str(i % 10).encode()))
        if i % 3 == 0:
            files.append((f"{key}.seg.PNG", rng.randbytes(700)))
        if i % 97 == 5:
            files.append((f"{key}.json", b""))  # an empty file is part of its sample
    files.append(("shard/__index__", b"not a sample"))
    files.append(("README", b"no extension: not a sample"))
    return files


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_tar_samples_are_grouped_by_key_from_headers_alone(store: Store, fmt: int) -> None:
    files = wds_files(400)
    content = tar_bytes(files, fmt)
    source = store.counting()
    member = store.put("wds/part-0.tar", content)
    member = format_of("wds").scan(source, member, {})
    expected = wds_samples(files)
    assert member.samples == len(expected) == 400
    assert [s[0] for s in member.meta["index"]] == [s["__key__"] for s in expected]
    # Headers only: far fewer bytes than the tar's.
    assert all(n <= 2048 for _, n in source.reads)
    assert source.bytes < len(content) // 3

    fmt_ = format_of("wds")
    assert store.samples(member) == expected
    assert expected[3]["seg.png"]
    for i in random.Random(7).sample(range(400), 50):
        source.clear()
        assert fmt_.read(source, member, i) == expected[i]
        assert_covered(source.reads, fmt_.ranges(member, i))
    assert fmt_.schema([member]) == ["cls", "jpg", "json", "seg.png"]


def test_tar_pax_headers_give_names_and_sizes(store: Store) -> None:
    files = [("ünïcode/名前.txt", b"pax path"), ("a.b/c.d.e", b"x" * 600), ("a.b/c.f", b"")]
    sink = io.BytesIO()
    with tarfile.open(
        fileobj=sink, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "g"}
    ) as tar:
        for path, data in files:
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    member = store.scan("wds/pax.tar", sink.getvalue())
    assert store.samples(member) == [
        {"__key__": "ünïcode/名前", "txt": b"pax path"},
        {"__key__": "a.b/c", "d.e": b"x" * 600, "f": b""},
    ]


def test_repeated_keys_start_new_samples(store: Store) -> None:
    files = [("k1.a", b"1"), ("k2.a", b"2"), ("k1.a", b"3"), ("k1.b", b"4"), ("k1.b", b"5")]
    member = store.scan("wds/dup.tar", tar_bytes(files))
    assert [s[0] for s in member.meta["index"]] == ["k1", "k2", "k1", "k1"]
    assert store.samples(member)[2:] == [
        {"__key__": "k1", "a": b"3", "b": b"4"},
        {"__key__": "k1", "b": b"5"},
    ]


def test_a_tar_that_is_not_a_tar_is_refused_by_name(store: Store) -> None:
    content = tar_bytes(wds_files(20))
    with tarfile.open(fileobj=io.BytesIO(content)) as tar:
        entries = [(m.offset, m.size) for m in tar.getmembers()]
    jpg = next(offset for offset, size in entries[5:] if size > 200)
    checksum = bytearray(content)
    checksum[entries[4][0] + 10] ^= 0x01  # inside a header's name: its checksum fails
    cases = {
        "wds/garbage.tar": random.Random(2).randbytes(4096),
        "wds/truncated.tar": content[: jpg + 512 + 100],  # inside a file's data
        "wds/checksum.tar": bytes(checksum),
        "wds/half-header.tar": content[: entries[10][0] + 300],
    }
    for key, data in cases.items():
        with pytest.raises(DatasetFormatError, match=f"local/{store.prefix}/{key}"):
            store.scan(key, data)
    assert store.scan("wds/empty.tar", tar_bytes([])).samples == 0


# -- MDS ---------------------------------------------------------------------------------

from chunkd.client.datasets.formats import mds as mds_format  # noqa: E402

MDS_FIXED = {"int": 8, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1,
             "uint16": 2, "uint32": 4, "uint64": 8, "float16": 2, "float32": 4,
             "float64": 8}  # fmt: skip
MDS_ARRAY_CODES = {"uint8": 8, "int8": 9, "uint16": 16, "int16": 17, "float16": 18,
                   "uint32": 32, "int32": 33, "float32": 34, "uint64": 64, "int64": 65,
                   "float64": 66}  # fmt: skip


def mds_encode(encoding: str, value: Any) -> bytes:
    """One column value as Streaming's encodings.py encodes it."""
    family, _, arguments = encoding.partition(":")
    if family == "bytes" or family in ("jpeg", "png", "pil"):
        return bytes(value)
    if family == "str":
        return value.encode()
    if family == "int":
        return np.int64(value).tobytes()
    if family in MDS_FIXED:
        return np.dtype(family).type(value).tobytes()
    if family in ("str_int", "str_float", "str_decimal"):
        return str(value).encode()
    if family == "json":
        return json.dumps(value).encode()
    if family == "pkl":
        return pickle.dumps(value)
    assert family == "ndarray"
    parts = arguments.split(":") if arguments else []
    out = b""
    if not parts:
        out += bytes([MDS_ARRAY_CODES[value.dtype.name]])
    if len(parts) < 2:
        top = max(value.shape)
        code = 0 if top < 256 else 1 if top < 65536 else 2
        out += bytes([(value.ndim << 2) | code])
        out += np.array(value.shape, ("uint8", "uint16", "uint32")[code]).tobytes()
    return out + value.tobytes()


def mds_shard(
    columns: dict[str, str], samples: list[dict[str, Any]], basename: str, compression: str | None
) -> tuple[bytes, dict[str, Any]]:
    """A shard and its index.json entry, laid out as Streaming's MDSWriter writes them."""
    names = sorted(columns)
    encodings = [columns[n] for n in names]
    sizes: list[int | None] = []
    for encoding in encodings:
        family, _, arguments = encoding.partition(":")
        parts = arguments.split(":")
        if family in MDS_FIXED:
            sizes.append(MDS_FIXED[family])
        elif family == "ndarray" and len(parts) == 2:
            shape = [int(d) for d in parts[1].split(",")]
            sizes.append(int(np.prod(shape)) * np.dtype(parts[0]).itemsize)
        else:
            sizes.append(None)
    config = {
        "version": 2,
        "format": "mds",
        "compression": compression,
        "hashes": [],
        "size_limit": 1 << 26,
        "column_names": names,
        "column_encodings": encodings,
        "column_sizes": sizes,
    }
    config_data = json.dumps(config, sort_keys=True).encode()
    encoded = []
    for sample in samples:
        head, body = [], b""
        for column, encoding, size in zip(names, encodings, sizes, strict=True):
            datum = mds_encode(encoding, sample[column])
            if size is None:
                head.append(len(datum))
            else:
                assert len(datum) == size
            body += datum
        encoded.append(np.array(head, np.uint32).tobytes() + body)
    offsets = np.array([0] + [len(e) for e in encoded]).cumsum().astype(np.uint32)
    offsets += 4 + 4 * (len(samples) + 1) + len(config_data)
    raw = np.uint32(len(samples)).tobytes() + offsets.tobytes() + config_data + b"".join(encoded)
    entry: dict[str, Any] = {
        "samples": len(samples),
        "raw_data": {"basename": basename, "bytes": len(raw), "hashes": {}},
        "zip_data": None,
        **config,
    }
    if compression is None:
        return raw, entry
    family = compression.partition(":")[0]
    if family == "zstd":
        packed = zstandard.ZstdCompressor(level=3).compress(raw)
    else:
        import gzip

        packed = gzip.compress(raw)
    entry["zip_data"] = {"basename": f"{basename}.{family}", "bytes": len(packed), "hashes": {}}
    return packed, entry


MDS_COLUMNS = {
    "id": "int",
    "label": "uint8",
    "score": "float32",
    "half": "float16",
    "big": "uint64",
    "small": "int16",
    "text": "str",
    "blob": "bytes",
    "meta": "json",
    "count": "str_int",
    "image": "jpeg",
    "obj": "pkl",
    "vec": "ndarray:float32:3",
    "grid": "ndarray",
    "row": "ndarray:int16",
}


def mds_samples(count: int, seed: int = 4) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "id": i - 500,
            "label": i % 256,
            "score": i / 8,
            "half": 0.5,
            "big": 2**63 + i,
            "small": -i % 30000,
            "text": f"sample {i} " + "ü" * rng.randrange(10),
            "blob": rng.randbytes(rng.randrange(100)),
            "meta": {"i": i, "tags": ["a"] * (i % 3)},
            "count": i * 1000,
            "image": b"\xff\xd8\xff" + rng.randbytes(20),
            "obj": {"never": "unpickled"},
            "vec": np.array([i, i + 1, i + 2], np.float32),
            "grid": np.arange(6, dtype=np.int32).reshape(2, 3) + i,
            "row": np.arange(i % 5 + 1, dtype=np.int16),
        }
        for i in range(count)
    ]


def assert_mds_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for column, value in want.items():
        if column == "obj":
            assert got[column] == pickle.dumps(value)  # raw bytes: never unpickled
        elif isinstance(value, np.ndarray):
            assert got[column].dtype == value.dtype
            np.testing.assert_array_equal(got[column], value)
        else:
            assert got[column] == value, column


def mds_members(
    store: Store, shards: list[tuple[list[dict[str, Any]], str | None]]
) -> list[tuple[Member, list[dict[str, Any]], dict[str, Any], str]]:
    """Shards and their index.json written to one folder, each member scanned."""
    entries, written = [], []
    for i, (samples, compression) in enumerate(shards):
        data, entry = mds_shard(MDS_COLUMNS, samples, f"shard.{i:05d}.mds", compression)
        entries.append(entry)
        basename = (entry["zip_data"] or entry["raw_data"])["basename"]
        written.append((store.put(f"mds/{basename}", data, "mds"), samples, basename))
    index = {"version": 2, "shards": entries}
    store.put("mds/index.json", json.dumps(index, sort_keys=True).encode(), "mds")
    scanned = []
    for member, samples, basename in written:
        options = {"mds_index": index, "mds_basename": basename}
        scanned.append(
            (format_of("mds").scan(store.source, member, options), samples, index, basename)
        )
    return scanned


def test_mds_shards_are_read_in_place_and_decoded(store: Store) -> None:
    many, few = mds_samples(3000), mds_samples(40, seed=5)
    (big, want_big, _, _), (small, want_small, _, _) = mds_members(
        store, [(many, None), (few, None)]
    )
    assert big.samples == 3000
    assert big.meta["stride"] == 3  # at most 1024 offsets recorded
    assert len(big.meta["offsets"]) == 1001
    assert small.meta["stride"] == 1
    assert len(small.meta["offsets"]) == 41
    assert big.meta["columns"][0] == ["big", "uint64", 8]
    assert ["blob", "bytes", None] in big.meta["columns"]
    fmt = format_of("mds")
    for member, want in ((big, want_big), (small, want_small)):
        source = store.counting()
        for i in [0, member.samples - 1, *random.Random(3).sample(range(member.samples), 30)]:
            source.clear()
            got = fmt.read(source, member, i)
            assert_mds_equal(got, want[i])
            assert_covered(source.reads, fmt.ranges(member, i))
            # the sample's unit, once (issue 25): one range where every offset is
            # recorded, else the offsets' part too
            assert len(source.reads) <= (1 if member.meta["stride"] == 1 else 2)
    assert isinstance(fmt.read(store.source, big, 5)["label"], np.uint8)
    assert fmt.schema([big, small]) == [[c[0], c[1]] for c in big.meta["columns"]]


def test_compressed_mds_shards_are_decompressed_whole(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    want_z, want_g = mds_samples(1500, seed=6), mds_samples(30, seed=7)
    (zst, _, _, _), (gz, _, _, _) = mds_members(store, [(want_z, "zstd:7"), (want_g, "gz")])
    assert zst.meta["compression"] == "zstd:7"
    assert zst.meta["raw_bytes"] > zst.size
    assert gz.meta["compression"] == "gz"
    fmt = format_of("mds")
    for member, want in ((zst, want_z), (gz, want_g)):
        assert fmt.ranges(member, 3) == [(0, member.size)]
        for i in random.Random(1).sample(range(member.samples), 20):
            assert_mds_equal(fmt.read(store.source, member, i), want[i])
    # A shard bigger than the cache is decompressed as far as each sample.
    monkeypatch.setattr(mds_format, "CACHE_BYTES", 1000)
    monkeypatch.setattr(mds_format, "_CACHE", DecodedLRU(1000, 4))
    for i in (1499, 3, 700):
        assert_mds_equal(fmt.read(store.source, zst, i), want_z[i])


def test_mds_that_does_not_match_its_index_is_refused_by_name(store: Store) -> None:
    ((member, _, index, basename),) = mds_members(store, [(mds_samples(10), None)])
    options = {"mds_index": index, "mds_basename": basename}
    data = (store.data / member.key).read_bytes()
    fmt = format_of("mds")
    entry = index["shards"][0]
    as_brotli = {**entry, "zip_data": {"basename": basename, "bytes": len(data)}}
    sizeless = {**entry, "raw_data": {"basename": basename, "bytes": None}}
    cases: dict[str, tuple[bytes, dict[str, Any], dict[str, Any]]] = {
        # index.json gives no size: the offsets find the truncation
        "truncated": (data[:-10], sizeless, options),
        "bad-count": (struct.pack("<I", 10**6) + data[4:], entry, options),
        "no-index": (data, entry, {}),
        "not-listed": (data, entry, {**options, "mds_basename": "shard.99999.mds"}),
        "brotli": (data, {**as_brotli, "compression": "br"}, options),
        "encoding": (data, {**entry, "column_encodings": ["bytes"] * 14 + ["pil2"]}, options),
        # a hostile index: parts that are no objects, sizes that are no numbers
        "raw-text": (data, {**entry, "raw_data": "shard.00000.mds"}, options),
        "zip-text": (data, {**entry, "zip_data": "x"}, options),
        "size-zz": (data, {**entry, "column_sizes": ["zz"] * 15}, options),
    }
    for case, (content, shard, case_options) in cases.items():
        key = f"mds/{case}/{basename}"
        if case_options:
            case_options = {**case_options, "mds_index": {"version": 2, "shards": [shard]}}
        target = store.put(key, content, "mds")
        with pytest.raises(DatasetFormatError, match=f"local/{store.prefix}/{key}"):
            fmt.scan(store.source, target, case_options)


# -- drift -------------------------------------------------------------------------------


def test_a_member_that_changed_after_its_scan_fails_its_reads(store: Store) -> None:
    members = [
        store.scan("drift/a.parquet", parquet_bytes(rows_table(50), 10)),
        store.scan("drift/b.jsonl", b"\n".join(json_lines(100))),
        store.scan("drift/c.jsonl.zst", seekable_zstd(b"\n".join(json_lines(100)), 500)),
        store.scan("drift/d.tar", tar_bytes(wds_files(10))),
        mds_members(store, [(mds_samples(10), None)])[0][0],
    ]
    for member in members:
        # Rewritten longer: every range the old member had is still inside the new one.
        (store.data / member.key).write_bytes(b"rewritten" * member.size)
    time.sleep(1.2)  # the backend's revalidation period
    for member in members:
        fmt = format_of(member.format)
        with pytest.raises(SnapshotDriftError, match=f"local/{member.key}"):
            fmt.read(store.source, member, member.samples - 1)


# -- check -------------------------------------------------------------------------------

from chunkd.client.datasets.check import MAX_PER_CODE, Finding, check, summarize  # noqa: E402
from chunkd.client.datasets.formats import parquet as parquet_module  # noqa: E402
from chunkd.snapshot import Snapshot  # noqa: E402


def snapshot_of(members: list[Member], excluded: list[dict[str, str]] | None = None) -> Snapshot:
    """A snapshot of scanned members, as registration builds it."""
    fmt = format_of(members[0].format)
    schema, settled = settle(fmt, members)
    return Snapshot.build(
        backend="local",
        prefix="",
        format=members[0].format,
        members=settled,
        schema_of=schema,
        excluded=excluded or [],
    )


def codes(findings: list[Finding]) -> list[tuple[str, str, str | None]]:
    return [(f.level, f.code, f.member.rsplit("/", 1)[-1] if f.member else None) for f in findings]


def test_check_finds_nothing_in_a_well_made_dataset(store: Store) -> None:
    parts = [store.scan(f"ok/p{i}.parquet", parquet_bytes(rows_table(100), 100)) for i in range(3)]
    assert check(snapshot_of(parts), store.source, deep=True) == []
    lines = [store.scan(f"ok/l{i}.jsonl", b'{"a": 1}\n[2]\n"3"') for i in range(2)]
    assert check(snapshot_of(lines), store.source, deep=True) == []
    tars = [
        store.scan(f"ok/t{i}.tar", tar_bytes([(f"s{i}{j}.{e}", b"x") for j in "abc" for e in "xy"]))
        for i in range(2)
    ]
    assert check(snapshot_of(tars), store.source, deep=True) == []


def test_check_parquet_schemas_and_row_groups(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    members = [
        store.scan("c/p0.parquet", parquet_bytes(rows_table(100), 100)),
        store.scan("c/p1.parquet", parquet_bytes(rows_table(100), 100)),
        store.scan("c/p2.parquet", parquet_bytes(pa.table({"id": [1.5]}), 10)),
        store.scan("c/p3.parquet", parquet_bytes(rows_table(1000), 20)),  # 50 tiny groups
        store.scan("c/p4.parquet", parquet_bytes(pa.table({"id": pa.array([], pa.int64())}), 5)),
    ]
    snapshot = snapshot_of(members[:2] + members[3:4] + members[2:3] + members[4:])
    found = check(snapshot, store.source)
    assert codes(found) == [
        ("error", "schema-differs", "p2.parquet"),
        ("error", "schema-differs", "p4.parquet"),
        ("warning", "empty-member", "p4.parquet"),
        ("warning", "row-group-too-small", "p3.parquet"),
    ]
    assert "id:double" in found[0].message
    monkeypatch.setattr(parquet_module, "ROW_GROUP_MAX_BYTES", 1000)
    assert ("warning", "row-group-too-big", "p0.parquet") in codes(check(snapshot, store.source))


def test_check_json_lines_first_lines_or_every_line(store: Store) -> None:
    good = b"\n".join(json.dumps({"i": i, "text": "é" * (i % 9)}).encode() for i in range(3000))
    late = good + b'\n{"broken": \n' + b'"caf\xe9"\n' + good
    members = [
        store.scan("c/late.jsonl", late),
        store.scan("c/first.jsonl", b"nope\n" + good),
        store.scan("c/blank.jsonl", b"\n" + good),
        store.scan("c/packed.jsonl.zst", zstandard.ZstdCompressor().compress(late)),
        store.scan("c/seekable.jsonl.zst", seekable_zstd(late, 10_000)),
        store.scan("c/empty.jsonl", b""),
    ]
    snapshot = snapshot_of(members)
    assert codes(check(snapshot, store.source)) == [
        ("error", "jsonl-not-json", "first.jsonl"),
        ("warning", "empty-member", "empty.jsonl"),
        ("warning", "jsonl-blank-line", "blank.jsonl"),
        ("warning", "zst-not-seekable", "packed.jsonl.zst"),
    ]
    deep = check(snapshot, store.source, deep=True)
    # The same lines, broken the same way, in three members: one finding each, of 3.
    assert codes(deep) == [
        ("error", "jsonl-not-json", "first.jsonl"),
        ("error", "jsonl-not-json", "late.jsonl"),
        ("error", "jsonl-not-utf8", "late.jsonl"),
        ("warning", "empty-member", "empty.jsonl"),
        ("warning", "jsonl-blank-line", "blank.jsonl"),
        ("warning", "zst-not-seekable", "packed.jsonl.zst"),
    ]
    assert [f.count for f in deep[1:3]] == [3, 3]
    assert [k.rsplit("/", 1)[-1] for k in deep[1].examples] == [
        "late.jsonl",
        "packed.jsonl.zst",
        "seekable.jsonl.zst",
    ]
    not_json = next(f for f in deep if f.code == "jsonl-not-json" and "late" in str(f.member))
    assert not_json.message.startswith("line 3001: not JSON")


def test_check_duplicate_keys_and_extensions_of_tars(store: Store) -> None:
    inside = [("k1.a", b"1"), ("k2.a", b"2"), ("k1.a", b"3")]
    across = [("k2.a", b"4"), ("k9.a", b"5"), ("k9.b", b"6")]
    members = [store.scan("c/inside.tar", tar_bytes(inside)),
               store.scan("c/across.tar", tar_bytes(across))]  # fmt: skip
    assert codes(check(snapshot_of(members), store.source)) == [
        ("error", "duplicate-key", "inside.tar"),
        ("warning", "duplicate-key", "inside.tar"),
        ("warning", "extensions-differ", "inside.tar"),
    ]


def test_check_mds_columns_and_the_dataset_as_a_whole(store: Store) -> None:
    ((shard, _, _, _),) = mds_members(store, [(mds_samples(5), None)])
    columns = shard.meta["columns"]
    twin = dataclasses.replace(shard, key="c/twin.mds")
    other = dataclasses.replace(
        shard, key="c/other.mds", meta={**shard.meta, "columns": columns[1:]}
    )
    found = check(snapshot_of([shard, twin, other]), store.source)
    assert codes(found) == [("error", "schema-differs", "other.mds")]

    # Many tiny files, many empty ones, and files left out: from the manifest alone.
    tiny = [Member(f"t/{i:05d}.bin", 100, "v", "fixed", 0 if i < 30 else 25, {"record_bytes": 4})
            for i in range(1200)]  # fmt: skip
    snapshot = Snapshot.build(
        backend="local",
        prefix="t/",
        format="fixed",
        members=tiny,
        excluded=[{"key": "t/bad.bin", "error": "not a whole number of records"}],
    )
    found = check(snapshot, store.source)
    # The same warning of 30 members is one finding that counts them all.
    assert [(f.level, f.code, f.member, f.count) for f in found] == [
        ("warning", "empty-member", "t/00000.bin", 30),
        ("warning", "excluded", "t/bad.bin", 1),
        ("warning", "many-tiny-files", None, 1),
    ]
    assert found[0].examples == ("t/00000.bin", "t/00001.bin", "t/00002.bin")
    # Findings that differ are listed up to MAX_PER_CODE a code; one more counts the rest.
    drifted = [
        Finding("error", f"t/{i:05d}.bin", "drift", f"t/{i:05d}.bin changed")
        for i in range(MAX_PER_CODE + 10)
    ]
    summed = summarize(drifted)
    assert [f.member for f in summed] == [f"t/{i:05d}.bin" for i in range(MAX_PER_CODE)] + [None]
    assert (summed[-1].message, summed[-1].count) == ("... and 10 more like these", 10)
    assert sum(f.count for f in summed) == MAX_PER_CODE + 10
