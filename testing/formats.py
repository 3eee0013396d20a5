"""The conformance suite of the dataset :class:`~chunkd.client.datasets.formats.Format`.

As :mod:`chunkd.testing.backends` does for backends: :class:`FormatTests` holds every
test a format must pass, and each format is a short subclass that supplies its member
files, its registration options and a reference reader::

    class TestMyFormat(FormatTests):
        format = "myformat"

        @pytest.fixture
        def files(self, tmp_path: Path) -> list[Path]:
            ...  # write two or more members (three or more units in all)

        def reference(self, path: Path) -> list[Any]:
            ...  # every sample of one member, as Dataset[i] must give it

The members are read through a :class:`FileSource`: files under one folder, each read
pinned to its version (its size and mtime), so rewriting one is drift. The suite checks
a scan, the units (bounds and sums), decode (values against the reference, column
projection, an unknown column), a table taken from two units, the byte ranges a decode
reads (through a source that refuses every other byte), drift, damaged input, a
round trip through a manifest, and that the format's ``chunkd dataset check`` hook
finds no error in its files. It imports neither the daemon nor a server: a format's
tests run anywhere pyarrow does.
"""

from __future__ import annotations

import io
import os
import random
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar

import pytest

from chunkd.client.datasets.formats import (
    MAX_UNIT_BYTES,
    Format,
    detect,
    format_of,
    settle,
    unit_starts,
)
from chunkd.client.datasets.source import MemberFile
from chunkd.errors import DatasetFormatError, SnapshotDriftError
from chunkd.snapshot import Member, MemoryPages, Snapshot

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping


__all__ = ["FileSource", "FormatTests", "RangeSource", "file_version"]


def file_version(path: Path) -> str:
    """A file's version token: its size and mtime (nanoseconds)."""
    stat = path.stat()
    return f"{stat.st_size}-{stat.st_mtime_ns}"


class FileSource:
    """Members as files under ``root`` (a member's key is its path below it), each read
    pinned to the member's recorded version (:func:`file_version`).

    Args:
        root: the folder of the members.
        label: the backend name :meth:`name` puts before a key.
    """

    def __init__(self, root: Path, label: str = "files") -> None:
        self.root = root
        self.label = label

    def member(self, path: Path, fmt: str) -> Member:
        """An unscanned member of format ``fmt`` for ``path`` (under :attr:`root`)."""
        return Member(
            path.relative_to(self.root).as_posix(), path.stat().st_size, file_version(path), fmt
        )

    def name(self, member: Member) -> str:
        return f"{self.label}/{member.key}"

    def read(self, member: Member, offset: int, length: int) -> memoryview:
        if length <= 0 or offset >= member.size:
            return memoryview(b"")
        path = self.root / member.key
        try:
            with path.open("rb") as file:
                stat = os.fstat(file.fileno())
                if f"{stat.st_size}-{stat.st_mtime_ns}" != member.version:
                    raise self._drift(member)
                file.seek(offset)
                return memoryview(file.read(min(length, member.size - offset)))
        except FileNotFoundError:
            raise self._drift(member) from None

    def file(self, member: Member) -> BinaryIO:
        return io.BufferedReader(MemberFile(self, member), buffer_size=1 << 20)

    def _drift(self, member: Member) -> SnapshotDriftError:
        return SnapshotDriftError(
            f"snapshot member {self.name(member)} changed since it was registered "
            f"(recorded version {member.version!r})"
        )


class RangeSource:
    """A source that reads through ``inner`` only inside ``allowed`` byte ranges, and
    records (in :attr:`outside`) and refuses every read past them (``file()`` reads
    included: they go through :meth:`read` unbuffered).

    Args:
        inner: the source read.
        allowed: ``(offset, length)`` ranges of the member read.
    """

    def __init__(self, inner: Any, allowed: list[tuple[int, int]]) -> None:
        self.inner = inner
        self.allowed = allowed
        self.reads: list[tuple[int, int]] = []
        self.outside: list[tuple[int, int]] = []

    def name(self, member: Member) -> str:
        return str(self.inner.name(member))

    def read(self, member: Member, offset: int, length: int) -> memoryview:
        length = max(0, min(length, member.size - offset))
        if length and not any(o <= offset and offset + length <= o + n for o, n in self.allowed):
            self.outside.append((offset, length))
            raise AssertionError(f"read {offset}+{length} is outside {self.allowed}")
        self.reads.append((offset, length))
        view: memoryview = self.inner.read(member, offset, length)
        return view

    def file(self, member: Member) -> BinaryIO:
        return MemberFile(self, member)  # type: ignore[return-value]


class FormatTests:
    """Every test a member format must pass. A subclass (named ``Test...``) sets
    :attr:`format` and :attr:`options`, and supplies the :meth:`files` fixture and
    :meth:`reference`; it may override :meth:`assert_same`, :meth:`damage`,
    :meth:`refused` and :meth:`max_unit_bytes`."""

    #: the format's name (:func:`~chunkd.client.datasets.formats.format_of`)
    format: ClassVar[str] = ""
    #: the registration's format options (``{"record_bytes": N}`` for ``fixed``)
    options: ClassVar[Mapping[str, Any]] = {}

    # -- what a subclass supplies ------------------------------------------------------

    @pytest.fixture
    def files(self, tmp_path: Path) -> list[Path]:
        """Member files written under ``tmp_path``, in key order: at least two members
        and three units in all, of one schema (a subclass supplies it)."""
        raise NotImplementedError("a FormatTests subclass supplies the files fixture")

    def reference(self, path: Path) -> list[Any]:
        """Every sample of the member at ``path`` as the format's own reference reader
        gives it: what ``Dataset[i]`` must return (a subclass supplies it)."""
        raise NotImplementedError("a FormatTests subclass supplies reference()")

    def assert_same(self, got: Any, want: Any) -> None:
        """``got`` (a sample read) is ``want`` (the reference's)."""
        if isinstance(got, memoryview):
            assert got.readonly
            got = bytes(got)
        assert got == want

    def damage(self, data: bytes, ranges: list[tuple[int, int]]) -> bytes | None:
        """``data`` (a member's bytes) of the same length, damaged in ``ranges`` (the
        ones a unit's decode reads) so that the decode must refuse it; None: the
        format has no bytes it could refuse (every byte string is records). By default
        each range is overwritten with random bytes."""
        damaged = bytearray(data)
        rng = random.Random(len(data))
        for offset, length in ranges:
            damaged[offset : offset + length] = rng.randbytes(min(length, len(data) - offset))
        return bytes(damaged)

    def refused(self, data: bytes) -> dict[str, bytes]:
        """Files a scan must refuse with a :class:`DatasetFormatError` naming them, by a
        name for each, from a good member's bytes. By default: the file cut to two
        thirds, and random bytes of its length."""
        return {
            "truncated": data[: len(data) * 2 // 3],
            "garbage": random.Random(7).randbytes(len(data)),
        }

    def max_unit_bytes(self) -> int:
        """The bound of a unit's decoded bytes the members are held to."""
        return MAX_UNIT_BYTES

    # -- what the suite builds from it -------------------------------------------------

    @pytest.fixture
    def source(self, files: list[Path]) -> FileSource:
        root = Path(os.path.commonpath([p.parent for p in files]))
        return FileSource(root)

    @pytest.fixture
    def fmt(self) -> Format:
        return format_of(self.format)

    @pytest.fixture
    def members(self, fmt: Format, source: FileSource, files: list[Path]) -> list[Member]:
        """The members scanned and settled, as a manifest holds them."""
        scanned = [fmt.scan(source, source.member(p, self.format), self.options) for p in files]
        _, settled = settle(fmt, scanned)
        return settled

    @pytest.fixture
    def expected(self, files: list[Path]) -> list[list[Any]]:
        return [self.reference(p) for p in files]

    def units(self, fmt: Format, members: list[Member]) -> Iterator[tuple[Member, int]]:
        """Every ``(member, unit)`` of the members."""
        for member in members:
            for unit in range(len(fmt.units(member))):
                yield member, unit

    # -- the tests ---------------------------------------------------------------------

    @pytest.mark.timeout(30)
    def test_the_format_is_a_plug_in(self, fmt: Format, files: list[Path]) -> None:
        assert isinstance(fmt, Format)
        assert fmt.name == self.format
        assert isinstance(fmt.version, int)
        assert fmt.version >= 1
        assert all(s == s.lower() and s.startswith(".") for s in fmt.suffixes)
        for path in files:
            if fmt.suffixes:
                assert detect(path.name) == fmt.name

    @pytest.mark.timeout(30)
    def test_its_check_finds_no_error_in_good_files(
        self, fmt: Format, source: FileSource, members: list[Member]
    ) -> None:
        """``chunkd dataset check``'s hook (:meth:`Format.check`, every sample read where
        the format checks them): the files are one well-made dataset, so it finds no
        error; what it finds are findings of its members."""
        from chunkd.client.datasets.check import Finding

        found = list(fmt.check(source, members, fmt.schema(members), deep=True))
        assert all(isinstance(f, Finding) for f in found)
        assert {f.member for f in found} <= {m.key for m in members}
        assert [f for f in found if f.level == "error"] == []

    @pytest.mark.timeout(30)
    def test_a_scan_counts_every_sample(
        self, fmt: Format, source: FileSource, members: list[Member], expected: list[list[Any]]
    ) -> None:
        assert len(members) >= 2
        for member, want in zip(members, expected, strict=True):
            assert member.format == self.format
            assert member.samples == len(want)
            # the manifest's entry reads back as the member
            assert Member.from_json(member.to_json()) == member

    @pytest.mark.timeout(30)
    def test_units_add_up_and_are_bounded(self, fmt: Format, members: list[Member]) -> None:
        total = 0
        for member in members:
            counts, sizes = fmt.units(member), fmt.unit_bytes(member)
            assert sum(counts) == member.samples
            assert len(sizes) == len(counts)
            assert all(c > 0 for c in counts)
            assert all(0 <= s <= self.max_unit_bytes() for s in sizes)
            for unit in range(len(counts)):
                for offset, length in fmt.unit_ranges(member, unit):
                    assert offset >= 0
                    assert 0 <= length <= member.size - offset
            # from the manifest alone
            again = Member.from_json(member.to_json())
            assert fmt.units(again) == counts
            assert fmt.unit_bytes(again) == sizes
            assert unit_starts(fmt, member)[-1] == member.samples
            total += len(counts)
        assert total >= 3, "the files fixture makes at least three units in all"

    @pytest.mark.timeout(30)
    def test_decode_gives_every_sample_of_its_unit(
        self, fmt: Format, source: FileSource, members: list[Member], expected: list[list[Any]]
    ) -> None:
        for member, want in zip(members, expected, strict=True):
            starts = unit_starts(fmt, member)
            for unit, count in enumerate(fmt.units(member)):
                table = fmt.decode(source, member, unit, None)
                assert table.num_rows == count
                for row in range(count):
                    self.assert_same(fmt.sample(table, row), want[starts[unit] + row])

    @pytest.mark.timeout(30)
    def test_decode_gives_the_columns_asked_in_their_order(
        self, fmt: Format, source: FileSource, members: list[Member]
    ) -> None:
        member = members[0]
        whole = fmt.decode(source, member, 0, None)
        names = list(whole.column_names)
        for asked in (names[::-1], names[-1:], names[:1]):
            table = fmt.decode(source, member, 0, asked)
            assert table.column_names == asked
            assert table.num_rows == whole.num_rows
            for name in asked:
                assert table.column(name).equals(whole.column(name))

    @pytest.mark.timeout(30)
    def test_an_unknown_column_is_refused_by_name(
        self, fmt: Format, source: FileSource, members: list[Member]
    ) -> None:
        member = members[0]
        names = fmt.decode(source, member, 0, None).column_names
        with pytest.raises(DatasetFormatError, match="no such column") as refused:
            fmt.decode(source, member, 0, [names[0], "no such column"])
        assert names[-1] in str(refused.value)  # the member's columns are named

    @pytest.mark.timeout(30)
    def test_a_table_taken_from_two_units_gives_the_same_samples(
        self, fmt: Format, source: FileSource, members: list[Member], expected: list[list[Any]]
    ) -> None:
        pa = pytest.importorskip("pyarrow")
        picked = [(m, u, i) for i, m in enumerate(members) for u in range(len(fmt.units(m)))]
        (first, a, i), (second, b, j) = picked[0], picked[-1]
        tables = [fmt.decode(source, first, a, None), fmt.decode(source, second, b, None)]
        want = [expected[i][unit_starts(fmt, first)[a] + r] for r in range(tables[0].num_rows)] + [
            expected[j][unit_starts(fmt, second)[b] + r] for r in range(tables[1].num_rows)
        ]
        order = list(range(len(want)))
        random.Random(3).shuffle(order)
        taken = pa.concat_tables(tables).take(pa.array(order, pa.int64()))
        for row, index in enumerate(order):
            self.assert_same(fmt.sample(taken, row), want[index])

    @pytest.mark.timeout(30)
    def test_decode_reads_only_its_units_ranges(
        self, fmt: Format, source: FileSource, members: list[Member]
    ) -> None:
        for member, unit in self.units(fmt, members):
            ranges = fmt.unit_ranges(member, unit)
            refusing = RangeSource(source, ranges)
            table = fmt.decode(refusing, member, unit, None)
            assert not refusing.outside
            assert table.num_rows == fmt.units(member)[unit]
            # a sample's ranges are its unit's
            start = unit_starts(fmt, member)[unit]
            assert fmt.ranges(member, start) == ranges
            assert fmt.locate(member, start) == (unit, 0)

    @pytest.mark.timeout(30)
    def test_a_changed_member_is_drift(
        self, fmt: Format, source: FileSource, members: list[Member], files: list[Path]
    ) -> None:
        member, path = members[0], files[0]
        data = path.read_bytes()
        stat = path.stat()
        path.write_bytes(data[::-1])
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        for unit in range(len(fmt.units(member))):
            with pytest.raises(SnapshotDriftError):
                fmt.decode(source, member, unit, None)
        path.unlink()
        with pytest.raises(SnapshotDriftError):
            fmt.decode(source, member, 0, None)

    @pytest.mark.timeout(30)
    def test_damaged_bytes_are_refused_by_name(
        self, fmt: Format, source: FileSource, members: list[Member], files: list[Path]
    ) -> None:
        member, path = members[0], files[0]
        data = path.read_bytes()
        damaged = self.damage(data, fmt.unit_ranges(member, 0))
        if damaged is not None:
            assert len(damaged) == len(data)
            path.write_bytes(damaged)
            # the member as registered, pinned to its damaged bytes
            pinned = replace(member, version=file_version(path))
            with pytest.raises(DatasetFormatError, match=source.name(member)):
                fmt.decode(source, pinned, 0, None)
        for label, content in self.refused(data).items():
            bad = path.with_name(f"{label}-{path.name}")
            bad.write_bytes(content)
            with pytest.raises(DatasetFormatError, match=bad.name):
                fmt.scan(source, source.member(bad, self.format), self.options)

    @pytest.mark.timeout(30)
    def test_a_manifest_round_trip_reads_what_the_reference_reads(
        self, fmt: Format, source: FileSource, members: list[Member], expected: list[list[Any]]
    ) -> None:
        schema = fmt.schema(members)
        pages = MemoryPages()  # where a paged snapshot's member pages are written and read
        snapshot = Snapshot.build(
            backend=source.label,
            prefix="",
            format=self.format,
            members=members,
            schema_of=schema,
            pages=pages,
        )
        parsed = Snapshot.parse(snapshot.data, pages=pages)
        assert parsed.id == snapshot.id
        by_key = {m.key: want for m, want in zip(members, expected, strict=True)}
        for member in parsed.members:
            want = by_key[member.key]
            got = [fmt.read(source, member, i) for i in range(member.samples)]
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                self.assert_same(g, w)
            with pytest.raises(IndexError):
                fmt.read(source, member, member.samples)
