"""Dataset member formats through a real daemon: what a scan records, what reads return.

Every test writes real files (pyarrow's Parquet, JSON lines plain and zstd, tars made by
``tarfile``, MDS shards laid out as MosaicML Streaming's writer lays them) into the
``local`` file:// backend of a ``chunkd serve``, scans them as registration does
(``format_of(fmt).scan(PinnedSource(client, "local"), member, options)``) and reads
every sample back. A counting source shows what a scan and a read touch.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import random
import struct
import subprocess
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

from .conftest import BIN, Daemon, wait_for_socket, wait_ready

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
        return [fmt.read(self.source, member, i) for i in range(member.samples)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One ``chunkd serve`` for the module (each test writes under its own prefix)."""
    root = tmp_path_factory.mktemp("formats")
    (root / "chunkd-data").mkdir()
    config = root / "chunkd.toml"
    config.write_text(TOML.format(dir=root))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    port = free_port()
    environ["CHUNKD_SERVER_LISTEN"] = f"127.0.0.1:{port}"
    log = root / "daemon.log"
    with log.open("ab") as sink:
        process = subprocess.Popen(
            [str(BIN / "chunkd"), "serve", "--config", str(config)],
            cwd=root,
            env=environ,
            stdout=sink,
            stderr=sink,
        )
    try:
        wait_ready(Daemon(process, port, config, root, environ, log))
        if not wait_for_socket(root / "chunkd.sock", 10):
            pytest.skip("`chunkd serve` did not create its local socket in 10 s")
        yield root
    finally:
        process.terminate()
        process.wait(timeout=30)


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

from chunkd.client.datasets.formats import parquet as parquet_format  # noqa: E402


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
    monkeypatch.setattr(parquet_format, "_ROW_GROUPS", DecodedLRU(64 << 20, 4))
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
        assert len(parquet_format._ROW_GROUPS) <= 4
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
        assert source.bytes < 200_000  # a block, not the member


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
        assert source.bytes < member.size // 4
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
    # A member bigger than the cache is decompressed from its start for each block.
    monkeypatch.setattr(jsonl_format, "CACHE_BYTES", 1000)
    monkeypatch.setattr(jsonl_format, "_CACHE", DecodedLRU(1000, 8))
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


# -- drift -------------------------------------------------------------------------------


def test_a_member_that_changed_after_its_scan_fails_its_reads(store: Store) -> None:
    members = [
        store.scan("drift/a.parquet", parquet_bytes(rows_table(50), 10)),
        store.scan("drift/b.jsonl", b"\n".join(json_lines(100))),
    ]
    for member in members:
        # Rewritten longer: every range the old member had is still inside the new one.
        (store.data / member.key).write_bytes(b"rewritten" * member.size)
    time.sleep(1.2)  # the backend's revalidation period
    for member in members:
        fmt = format_of(member.format)
        with pytest.raises(SnapshotDriftError, match=f"local/{member.key}"):
            fmt.read(store.source, member, member.samples - 1)
