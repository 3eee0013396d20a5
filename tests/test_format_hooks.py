"""The formats' hooks (issue 25, "Formats become plug-ins"): what ``chunkd dataset
check`` and registration ask of a format, with no branch on its name outside its module.

- :meth:`Format.check`: each format's own rules, called by ``check`` once per format.
- :meth:`Format.options` and :attr:`Format.argument`: ``--format NAME:ARG``.
- :attr:`Format.index_name` and :meth:`Format.members_of`: members listed by an index.

Members are real files read through :class:`chunkd.testing.formats.FileSource`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from chunkd.client.datasets import formats
from chunkd.client.datasets.check import Finding, check
from chunkd.client.datasets.formats import FormatBase, format_of, register, settle
from chunkd.client.datasets.formats import mds as mds_format
from chunkd.client.datasets.register import parse_format
from chunkd.client.datasets.source import Source
from chunkd.errors import DatasetFormatError, InvalidRequestError
from chunkd.snapshot import Member, Snapshot
from chunkd.testing.formats import FileSource

from .test_dataset_formats import (
    MDS_COLUMNS,
    mds_samples,
    mds_shard,
    parquet_bytes,
    rows_table,
    tar_bytes,
)

pa = pytest.importorskip("pyarrow")
ipc = pytest.importorskip("pyarrow.ipc")


class Tiny(FormatBase):
    """A plug-in of a test's own: one sample per byte; ``tiny:K`` sets ``step``; a
    member of an odd size is a warning of its own code."""

    name = "tiny-test"
    version = 1
    suffixes = (".tiny",)
    argument = "K"

    def options(self, arg: str) -> dict[str, Any]:
        if not arg.isdecimal():
            raise InvalidRequestError("tiny-test takes a step, as tiny-test:K")
        return {"step": int(arg)}

    def scan(self, source: Source, member: Member, options: Mapping[str, Any]) -> Member:
        return dataclasses.replace(member, samples=member.size, meta={})

    def schema(self, members: list[Member]) -> Any:
        return None

    def units(self, member: Member) -> list[int]:
        return [member.samples] if member.samples else []

    def unit_bytes(self, member: Member) -> list[int]:
        return [member.size] if member.samples else []

    def unit_ranges(self, member: Member, unit: int) -> list[tuple[int, int]]:
        return [(0, member.size)]

    def decode(
        self, source: Source, member: Member, unit: int, columns: Sequence[str] | None
    ) -> Any:
        data = bytes(source.read(member, 0, member.size))
        return pa.table({"byte": pa.array(list(data), pa.uint8())})

    def sample(self, table: Any, row: int) -> Any:
        return table.column("byte")[row].as_py()

    def check(
        self, source: Source, members: Sequence[Member], schema_of: Any, *, deep: bool
    ) -> Iterable[Finding]:
        for member in members:
            if member.size % 2:
                yield Finding("warning", member.key, "tiny-odd", "an odd count of bytes")


@pytest.fixture
def tiny() -> Iterator[Tiny]:
    fmt = Tiny()
    register(fmt)
    try:
        yield fmt
    finally:
        formats._FORMATS.pop(fmt.name, None)  # this process's formats as they were


def scanned(source: FileSource, paths: list[Path], fmt: str) -> Snapshot:
    """A snapshot of ``paths``, scanned and settled as registration does."""
    format_ = format_of(fmt)
    members = [format_.scan(source, source.member(p, fmt), {}) for p in paths]
    schema, members = settle(format_, members)
    return Snapshot.build(backend="files", prefix="", format=fmt, members=members, schema_of=schema)


@pytest.mark.timeout(10)
def test_the_hooks_default_to_nothing_and_every_format_has_them(tiny: Tiny) -> None:
    class Plain(Tiny):
        argument = ""
        options = FormatBase.options
        check = FormatBase.check

    plain = Plain()
    member = Member("a.tiny", 3, "v", "tiny-test", 3)
    assert plain.options("") == {}
    with pytest.raises(InvalidRequestError, match="takes no argument"):
        plain.options("3")
    assert plain.index_name is None
    assert list(plain.members_of("", [member], FileSource(Path("/")), {"x": 1})) == [
        (member, {"x": 1})
    ]
    assert list(plain.check(FileSource(Path("/")), [member], None, deep=True)) == []
    for name in ("parquet", "arrow", "jsonl", "fixed", "wds", "mds"):
        fmt = format_of(name)
        assert isinstance(fmt, formats.Format)
        assert all(callable(hook) for hook in (fmt.check, fmt.options, fmt.members_of))
    # register() holds a plug-in to the hooks too (FormatBase gives them)
    bare = type("Bare", (), {k: getattr(tiny, k) for k in formats._REQUIRED if k != "check"})
    with pytest.raises(DatasetFormatError, match="lacks check"):
        register(bare())


@pytest.mark.timeout(10)
def test_a_plug_in_format_is_checked_by_dataset_check(tiny: Tiny, tmp_path: Path) -> None:
    for name, size in (("a.tiny", 4), ("b.tiny", 5), ("c.tiny", 7), ("d.tiny", 0)):
        (tmp_path / name).write_bytes(b"x" * size)
    source = FileSource(tmp_path)
    snapshot = scanned(source, sorted(tmp_path.glob("*.tiny")), "tiny-test")
    found = [(f.level, f.code, f.member, f.count) for f in check(snapshot, source)]
    # its own rule, grouped as every rule is, next to the generic ones
    assert found == [
        ("warning", "empty-member", "d.tiny", 1),
        ("warning", "tiny-odd", "b.tiny", 2),
    ]
    # a member of a format this process does not know cannot be read: an error
    strange = dataclasses.replace(snapshot.members[0], format="nowhere")
    unknown = Snapshot.build(backend="files", prefix="", format="nowhere", members=[strange])
    (finding,) = check(unknown, source)
    assert (finding.level, finding.code, finding.member) == ("error", "unreadable", "a.tiny")
    assert "unknown member format 'nowhere'" in finding.message


@pytest.mark.timeout(10)
def test_format_arguments_are_the_formats_own(tiny: Tiny) -> None:
    assert parse_format("fixed:16") == ("fixed", {"record_bytes": 16})
    assert parse_format("tiny-test:3") == ("tiny-test", {"step": 3})
    assert parse_format("auto") == ("auto", {})
    assert parse_format("parquet") == ("parquet", {})
    for text, said in (
        ("fixed:²", "fixed:N"),  # a digit to str.isdigit, not to int()
        ("fixed:" + "9" * 5000, "fixed:N"),
        ("tiny-test:x", "tiny-test:K"),
        ("jsonl:3", "takes no argument"),
        ("auto:1", "use auto"),
        ("csv", "use auto"),
    ):
        with pytest.raises(InvalidRequestError, match="--format") as caught:
            parse_format(text)
        assert said in str(caught.value)
        # what --format takes, each format as it is spelled
        assert "fixed:N" in str(caught.value)
        assert "tiny-test:K" in str(caught.value)


@pytest.mark.timeout(20)
def test_each_formats_own_rules_are_its_check(tmp_path: Path) -> None:
    """Each built-in format's hook, called as ``check`` calls it: its members only."""
    (tmp_path / "p0.parquet").write_bytes(parquet_bytes(rows_table(100), 100))
    (tmp_path / "p1.parquet").write_bytes(parquet_bytes(rows_table(1000), 20))
    (tmp_path / "l.jsonl").write_bytes(b'{"a": 1}\n[2]\nnope\n')
    (tmp_path / "t.tar").write_bytes(tar_bytes([("k1.a", b"1"), ("k2.a", b"2"), ("k1.a", b"3")]))
    source = FileSource(tmp_path)

    def own(name: str, paths: list[str], *, deep: bool = False) -> list[tuple[str, str]]:
        snapshot = scanned(source, [tmp_path / p for p in paths], name)
        hook = format_of(name).check(source, snapshot.members, snapshot.schema_of, deep=deep)
        return [(f.code, str(f.member)) for f in hook]

    assert own("parquet", ["p0.parquet", "p1.parquet"]) == [("row-group-too-small", "p1.parquet")]
    assert own("jsonl", ["l.jsonl"]) == []
    assert own("jsonl", ["l.jsonl"], deep=True) == [("jsonl-not-json", "l.jsonl")]
    assert own("wds", ["t.tar"]) == [("duplicate-key", "t.tar")]


@pytest.mark.timeout(20)
def test_arrow_members_of_another_schema_are_an_error(tmp_path: Path) -> None:
    for name, table in (
        ("a.arrow", pa.table({"id": [1, 2], "text": ["x", "y"]})),
        ("b.arrow", pa.table({"id": [3, 4], "text": ["z", "w"]})),
        ("c.arrow", pa.table({"id": [1.5], "text": ["v"]})),
    ):
        with ipc.new_file(str(tmp_path / name), table.schema) as writer:
            writer.write_table(table)
    source = FileSource(tmp_path)
    snapshot = scanned(source, sorted(tmp_path.glob("*.arrow")), "arrow")
    (finding,) = check(snapshot, source)
    assert (finding.level, finding.code, finding.member) == ("error", "schema-differs", "c.arrow")
    assert "id:double" in finding.message
    assert "id:int64" in finding.message


@pytest.mark.timeout(20)
def test_a_compressed_shard_too_big_is_read_again_for_each_unit(tmp_path: Path) -> None:
    data, entry = mds_shard(MDS_COLUMNS, mds_samples(5), "shard.00000.mds", None)
    (tmp_path / "shard.00000.mds").write_bytes(data)
    source = FileSource(tmp_path)
    fmt = format_of("mds")
    shard = fmt.scan(
        source,
        source.member(tmp_path / "shard.00000.mds", "mds"),
        {"mds_index": {"version": 2, "shards": [entry]}, "mds_basename": "shard.00000.mds"},
    )
    # what a compressed shard's manifest entry says: the rule reads nothing else
    big = dataclasses.replace(
        shard,
        key="big.mds.zstd",
        meta={**shard.meta, "compression": "zstd", "raw_bytes": mds_format.CACHE_BYTES + 1},
    )
    snapshot = Snapshot.build(
        backend="files", prefix="", format="mds", members=[shard, big],
        schema_of=fmt.schema([shard, big]),
    )  # fmt: skip
    (finding,) = check(snapshot, source)
    assert (finding.code, finding.member) == ("compressed-shard-too-big", "big.mds.zstd")
    assert "each unit read decompresses it from its start" in finding.message
    assert "sample read" not in finding.message


@pytest.mark.timeout(20)
def test_mds_members_are_what_its_index_lists(tmp_path: Path) -> None:
    fmt = format_of("mds")
    assert fmt.index_name == "index.json"
    entries = []
    for folder in ("a", "b"):
        data, entry = mds_shard(MDS_COLUMNS, mds_samples(3), "shard.00000.mds", None)
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "shard.00000.mds").write_bytes(data)
        (tmp_path / folder / "index.json").write_text(json.dumps({"version": 2, "shards": [entry]}))
        (tmp_path / folder / "notes.bin").write_bytes(b"not listed")
        merged = json.loads(json.dumps(entry))
        merged["raw_data"]["basename"] = f"{folder}/shard.00000.mds"
        entries.append(merged)
    source = FileSource(tmp_path)

    def listed() -> list[Member]:
        paths = sorted(p for p in tmp_path.rglob("*") if p.is_file())
        return [source.member(p, "mds") for p in paths]

    def members() -> list[tuple[str, str]]:
        found = fmt.members_of("", listed(), source, {"keep": 1})
        return [(m.key, o["mds_basename"]) for m, o in found if o["keep"] == 1]

    # each folder's own index, then a merged one at the prefix: the same shards once
    per_folder = members()
    assert per_folder == [("a/shard.00000.mds", "shard.00000.mds"),
                          ("b/shard.00000.mds", "shard.00000.mds")]  # fmt: skip
    (tmp_path / "index.json").write_text(json.dumps({"version": 2, "shards": entries}))
    assert [key for key, _ in members()] == [key for key, _ in per_folder]
    # a listed shard that is not there, and no index at all, are refused by name
    (tmp_path / "b" / "shard.00000.mds").unlink()
    missing = re.escape("files/index.json lists shard 'b/shard.00000.mds', which is not there")
    with pytest.raises(DatasetFormatError, match=missing):
        members()
    # an index too big to read whole is refused by its size, before it is read
    with (tmp_path / "index.json").open("r+b") as index:
        index.truncate(mds_format.MAX_INDEX_BYTES + 1)
    with pytest.raises(DatasetFormatError, match=r"files/index\.json is 67108865 bytes, more"):
        members()
    with pytest.raises(DatasetFormatError, match=re.escape("files/a/ holds no index.json")):
        list(fmt.members_of("a/", [m for m in listed() if "index" not in m.key], source, {}))
