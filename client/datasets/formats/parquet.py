"""Parquet members: one sample per row, as a dict ``{column: value}``.

A member's **units** are its row groups: :meth:`~ParquetRows.decode` reads one with one
ranged read (the group's column chunks) and decodes it into an Arrow table, the file's
columns with their Arrow types as stored (pyarrow's ``read_row_group``). A row group
of more than :data:`~chunkd.client.datasets.formats.MAX_UNIT_BYTES` uncompressed is
split into ``ceil(bytes / MAX_UNIT_BYTES)`` units (more where its rows do not divide
evenly) of whole rows, its rows shared evenly; such a unit reads the group's column
chunks and decodes only its rows (``iter_batches``), so no decode holds more than about
a unit and a batch of rows. A unit's decoded bytes
(:meth:`~ParquetRows.unit_bytes`) are its group's uncompressed size (its share of it,
for a split group).

Decoding only some columns reads only their column chunks (a ranged read each) and
decodes only them. A sample (:meth:`~ParquetRows.sample`) is its row as
``Table.to_pylist`` gives it: nulls are None, lists are lists, structs dicts, decimals
:class:`decimal.Decimal`, timestamps :class:`datetime.datetime` and dictionary-encoded
columns their values.

A scan reads only the footer: the 8-byte trailer, then the footer itself (one read of
the file's last 64 KiB answers both when the footer is that small). Parsed footers are
kept per process (64 of them), so decoding a unit reads its row group only.

Member ``meta``:

``footer``
    ``[offset, length]``: the footer's byte range: its Thrift metadata, the 4-byte
    length and the closing ``PAR1``.
``row_groups``
    ``[[rows, offset, length, bytes], ...]``: per row group, in file order, its row
    count, the byte range of its column chunks (from the smallest dictionary or data
    page offset to the end of the last column chunk) and its uncompressed size.
``schema``
    ``[[column, type], ...]``: the member's Arrow schema (types as Arrow writes them,
    e.g. ``int64``, ``list<item: string>``), only where it differs from the dataset's
    (the manifest's ``schema_of``, in the same form).

pyarrow is imported when a Parquet member is first scanned or read.
"""

from __future__ import annotations

import importlib
import math
import statistics
import struct
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final

from chunkd.client.datasets.findings import Finding, columns_text, size_text
from chunkd.client.datasets.formats import (
    DECODED_CACHE_BYTES,
    MAX_UNIT_BYTES,
    DecodedLRU,
    FormatBase,
)
from chunkd.client.datasets.source import MemberFile
from chunkd.errors import DatasetFormatError, SnapshotDriftError

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping, Sequence

    from chunkd.client.datasets.source import Source
    from chunkd.snapshot import Member

__all__ = [
    "FORMAT",
    "ROW_GROUP_CACHE_BYTES",
    "ROW_GROUP_MAX_BYTES",
    "ROW_GROUP_MIN_BYTES",
    "ParquetRows",
    "schema_findings",
]

#: the bound of the per-process cache of decoded units (row groups), in bytes
#: (:data:`~chunkd.client.datasets.formats.DECODED_CACHE_BYTES`)
ROW_GROUP_CACHE_BYTES: Final = DECODED_CACHE_BYTES
#: a row group bigger than this (uncompressed) is cut into units that each decode it: the
#: check's ``row-group-too-big`` (read when the rule runs)
ROW_GROUP_MAX_BYTES: Final = MAX_UNIT_BYTES
#: row groups whose median is smaller than this (uncompressed) are too small: the check's
#: ``row-group-too-small``
ROW_GROUP_MIN_BYTES: Final = 1 << 20
#: parsed footers kept per process
_FOOTERS: Final = 64
#: a scan reads this much of the file's end at once: the footer of most files fits
_TAIL_BYTES: Final = 64 << 10
#: a footer of more than this is not a Parquet file's
_MAX_FOOTER_BYTES: Final = 256 << 20
_MAGIC: Final = b"PAR1"

_METADATA = DecodedLRU(64 << 20, _FOOTERS)


def _pyarrow() -> tuple[Any, Any]:
    return importlib.import_module("pyarrow"), importlib.import_module("pyarrow.parquet")


def schema_of(arrow_schema: Any) -> list[list[str]]:
    """An Arrow schema as the manifest holds it: ``[[column, type], ...]``."""
    return [[field.name, str(field.type)] for field in arrow_schema]


class ParquetRows(FormatBase):
    """The ``parquet`` format (see the module docstring)."""

    name = "parquet"
    version = 1
    suffixes = (".parquet",)

    def scan(self, source: Source, member: Member, options: Mapping[str, Any]) -> Member:
        name = source.name(member)
        offset, length, metadata = self._footer(source, member)
        groups = []
        try:
            arrow_schema = metadata.schema.to_arrow_schema()
            for g in range(metadata.num_row_groups):
                group = metadata.row_group(g)
                start, stop = _extent(group)
                groups.append([group.num_rows, start, stop - start, group.total_byte_size])
        except Exception as exc:  # pyarrow's own errors: ArrowInvalid, OSError, ...
            raise DatasetFormatError(
                f"{name} has a Parquet footer pyarrow cannot read ({exc}); "
                "write it again, or register with --skip-bad to leave it out"
            ) from None
        for rows, start, size, _ in groups:
            if rows and (start < 4 or start + size > offset):
                raise DatasetFormatError(
                    f"{name}: a row group of {rows} rows claims bytes {start}..{start + size}, "
                    f"outside the data before the footer at {offset}: the file is damaged; "
                    "write it again"
                )
        _METADATA.put((name, member.version), metadata, length)
        meta = {"footer": [offset, length], "row_groups": groups, "schema": schema_of(arrow_schema)}
        return replace(member, samples=sum(g[0] for g in groups), meta=meta)

    def schema(self, members: list[Member]) -> Any:
        schemas = Counter(_frozen(m.meta["schema"]) for m in members if "schema" in m.meta)
        if not schemas:
            return None
        # The most common schema is the dataset's; a tie goes to the first in key order.
        top = max(schemas.values())
        first = next(
            _frozen(m.meta["schema"])
            for m in members
            if "schema" in m.meta and schemas[_frozen(m.meta["schema"])] == top
        )
        return [list(column) for column in first]

    def settle(self, members: list[Member], schema: Any) -> list[Member]:
        """``members``, each without its ``schema`` where it is the dataset's."""
        return [
            replace(m, meta={k: v for k, v in m.meta.items() if k != "schema"})
            if m.meta.get("schema") == schema
            else m
            for m in members
        ]

    def check(
        self, source: Source, members: Sequence[Member], schema_of: Any, *, deep: bool
    ) -> Iterable[Finding]:
        """``schema-differs`` (a member's schema is not the dataset's), then
        ``row-group-too-big`` and ``row-group-too-small`` (from the manifest alone)."""
        yield from schema_findings(members, schema_of)
        for member in members:
            yield from _row_groups(member)

    # -- units -------------------------------------------------------------------------

    def units(self, member: Member) -> list[int]:
        return [rows for _, _, rows, _ in _units(member)]

    def unit_bytes(self, member: Member) -> list[int]:
        return [size for _, _, _, size in _units(member)]

    def unit_ranges(self, member: Member, unit: int) -> list[tuple[int, int]]:
        group = _units(member)[unit][0]
        _, start, size, _ = member.meta["row_groups"][group]
        offset, length = member.meta["footer"]
        return [(int(start), int(size)), (int(offset), int(length))]

    def decode(
        self, source: Source, member: Member, unit: int, columns: Sequence[str] | None
    ) -> Any:
        group, first, rows, _ = _units(member)[unit]
        whole = rows == int(member.meta["row_groups"][group][0])
        return self.row_group(source, member, group, columns, None if whole else (first, rows))

    def row_group(
        self,
        source: Source,
        member: Member,
        group: int,
        columns: Sequence[str] | None,
        part: tuple[int, int] | None = None,
    ) -> Any:
        """Row group ``group`` of ``member`` as a ``pyarrow.Table`` (``part``: only its
        rows ``first .. first + count``): only ``columns`` (None: all), in that order.
        What :meth:`decode` gives for a unit, and the inspector for a group.

        Raises:
            DatasetFormatError: the bytes are damaged, or a column is not the file's.
            SnapshotDriftError: the object changed.
            MemoryError: decoding ran out of memory (not the file's fault).
        """
        _, pq = _pyarrow()
        pa = importlib.import_module("pyarrow")
        name = source.name(member)
        first, rows = part if part is not None else (0, int(member.meta["row_groups"][group][0]))
        metadata = self.metadata(source, member)
        known = metadata.schema.to_arrow_schema().names
        if columns is not None:
            unknown = [c for c in columns if c not in known]
            if unknown:
                raise DatasetFormatError(
                    f"{name} has no column {unknown[0]!r}; its columns: {', '.join(known)}"
                )
        asked = None if columns is None else list(dict.fromkeys(columns))
        if asked == []:  # no column: the rows alone
            return pa.table({"": pa.nulls(rows)}).select([])
        _, start, size, _ = member.meta["row_groups"][group]
        # All columns: the group's chunks in one read. Some: each asked column's chunk
        # as pyarrow asks for it, so the others are neither read nor decoded.
        whole = asked is None or len(asked) == len(known)
        view = source.read(member, int(start), int(size)) if whole else memoryview(b"")
        window = MemberFile(source, member, {int(start): view})
        try:
            parquet = pq.ParquetFile(pa.PythonFile(window, mode="r"), metadata=metadata)
            if part is None:
                table = parquet.read_row_group(group, columns=asked)
            else:
                table = _rows(parquet, group, first, rows, asked)
        except (SnapshotDriftError, MemoryError):
            raise
        except Exception as exc:  # pyarrow's errors of damaged bytes: OSError, ArrowInvalid
            raise DatasetFormatError(
                f"{name}: row group {group} cannot be decoded ({exc}); the file is damaged: "
                "write it again"
            ) from None
        if table.num_rows != rows:
            raise DatasetFormatError(
                f"{name}: row group {group} decoded to {table.num_rows} rows where its "
                f"footer says {rows}; the file is damaged: write it again"
            )
        return table if columns is None else table.select(list(columns))

    def sample(self, table: Any, row: int) -> dict[str, Any]:
        rows: list[dict[str, Any]] = table.slice(row, 1).to_pylist()
        return rows[0]

    # -- reading -----------------------------------------------------------------------

    def metadata(self, source: Source, member: Member) -> Any:
        """``member``'s parsed footer (pyarrow's ``FileMetaData``), kept per process.

        Raises:
            DatasetFormatError: the footer cannot be parsed.
            SnapshotDriftError: the object changed.
        """
        key = (source.name(member), member.version)
        metadata = _METADATA.get(key)
        if metadata is None:
            offset, length = (int(v) for v in member.meta["footer"])
            metadata = _parse_footer(source.name(member), source.read(member, offset, length))
            _METADATA.put(key, metadata, length)
        return metadata

    def _footer(self, source: Source, member: Member) -> tuple[int, int, Any]:
        name, size = source.name(member), member.size
        if size < 12:
            raise DatasetFormatError(
                f"{name} holds {size} bytes: too few for a Parquet file (at least 12)"
            )
        tail_offset = max(0, size - _TAIL_BYTES)
        tail = source.read(member, tail_offset, size - tail_offset)
        if len(tail) != size - tail_offset:
            raise DatasetFormatError(f"{name} ended before its recorded size of {size} bytes")
        (length,) = struct.unpack("<I", tail[-8:-4])
        magic = bytes(tail[-4:])
        if magic == b"PARE":
            raise DatasetFormatError(
                f"{name} is an encrypted Parquet file: chunkd reads plaintext footers only"
            )
        if magic != _MAGIC:
            raise DatasetFormatError(
                f"{name} is not a Parquet file: it does not end with {_MAGIC!r} (it ends "
                f"with {magic!r}); it may be truncated or of another format"
            )
        offset = size - 8 - length
        if length > _MAX_FOOTER_BYTES or offset < 4:
            raise DatasetFormatError(
                f"{name}: its footer claims {length} bytes, more than the file's {size}: "
                "the footer is damaged or the file is truncated; write it again"
            )
        if offset >= tail_offset:
            footer = tail[offset - tail_offset : size - 8 - tail_offset]
        else:
            footer = source.read(member, offset, length)
        return offset, length + 8, _parse_footer(name, footer, trailer=False)


def schema_findings(members: Sequence[Member], schema_of: Any) -> Iterator[Finding]:
    """``schema-differs`` of each member whose recorded schema (kept in its ``meta``
    only where it differs: :meth:`ParquetRows.settle`) is not the dataset's."""
    if schema_of is None:
        return
    for member in members:
        got = member.meta.get("schema", schema_of)
        if got != schema_of:
            yield Finding(
                "error",
                member.key,
                "schema-differs",
                f"its schema {columns_text(got)} differs from the dataset's "
                f"{columns_text(schema_of)}: rewrite it with the dataset's schema, or "
                "register it apart",
            )


def _row_groups(member: Member) -> Iterator[Finding]:
    groups = member.meta.get("row_groups", [])
    sizes = [int(g[3]) if len(g) > 3 else int(g[2]) for g in groups if int(g[0])]
    if not sizes:
        return
    biggest = max(sizes)
    if biggest > ROW_GROUP_MAX_BYTES:
        yield Finding(
            "warning",
            member.key,
            "row-group-too-big",
            f"a row group of {size_text(biggest)} uncompressed: groups over "
            f"{size_text(ROW_GROUP_MAX_BYTES)} are cut into units that each "
            "read the whole group and decode it up to their rows; write row groups of 1 "
            "to 128 MiB",
        )
    median = statistics.median(sizes)
    if len(sizes) > 1 and median < ROW_GROUP_MIN_BYTES:
        yield Finding(
            "warning",
            member.key,
            "row-group-too-small",
            f"{len(sizes)} row groups of median size {size_text(int(median))} "
            "uncompressed: each is a read and a decode of its own; write row groups of 1 "
            "to 128 MiB",
        )


def _rows(parquet: Any, group: int, first: int, rows: int, columns: list[str] | None) -> Any:
    """Rows ``first .. first + rows`` of row group ``group``: ``iter_batches`` decodes the
    group a batch of ``rows`` at a time, and the rows before ``first`` are dropped batch
    by batch, so no more than two batches and the result are held at once."""
    pa = importlib.import_module("pyarrow")
    pieces, seen = [], 0
    for batch in parquet.iter_batches(batch_size=rows, row_groups=[group], columns=columns):
        stop = seen + batch.num_rows
        if stop > first:
            pieces.append(batch.slice(max(0, first - seen), first + rows - max(seen, first)))
        seen = stop
        if seen >= first + rows:
            break
    if not pieces:  # the group holds fewer rows than its footer says
        return pa.table({"": pa.nulls(0)}).select([])
    # a copy of the unit's rows alone: a slice would hold its whole batch
    return pa.Table.from_batches(pieces).combine_chunks()


def _units(member: Member) -> list[tuple[int, int, int, int]]:
    """``member``'s units: ``(row group, first row in it, rows, decoded bytes)`` each
    (cached): a row group each, a group of more than ``MAX_UNIT_BYTES`` cut into
    runs of its rows shared evenly, each of at most ``MAX_UNIT_BYTES``."""
    groups = member.meta.get("row_groups", ())
    key = (member.key, member.version, member.size, member.samples, len(groups), MAX_UNIT_BYTES)
    found: list[tuple[int, int, int, int]] | None = _SPLITS.get(key)
    if found is not None:
        return found
    found = []
    for g, (rows, _, _, size) in enumerate(groups):
        rows, size = int(rows), int(size)
        pieces = max(1, math.ceil(size / MAX_UNIT_BYTES))
        # rows shared evenly: a piece holds at most ceil(rows / pieces) of them
        while pieces < rows and math.ceil(rows / pieces) * size > MAX_UNIT_BYTES * rows:
            pieces += 1
        pieces = min(pieces, max(1, rows))
        share, extra = divmod(rows, pieces)
        first = 0
        for p in range(pieces):
            count = share + (p < extra)
            found.append((g, first, count, size if pieces == 1 else -(-size * count // rows)))
            first += count
    _SPLITS.put(key, found, 64 * len(found))
    return found


def _parse_footer(name: str, data: memoryview | bytes, *, trailer: bool = True) -> Any:
    """The ``FileMetaData`` of a footer's bytes (``trailer``: they end with the length
    and ``PAR1``)."""
    pa, pq = _pyarrow()
    body = bytes(data[:-8]) if trailer else bytes(data)
    try:
        # A file of the magic and the footer alone: pyarrow parses only the footer.
        stub = _MAGIC + body + struct.pack("<I", len(body)) + _MAGIC
        return pq.ParquetFile(pa.BufferReader(stub)).metadata
    except MemoryError:  # not the file's fault
        raise
    except Exception as exc:
        raise DatasetFormatError(
            f"{name} has a Parquet footer pyarrow cannot read ({exc}): it is damaged or "
            "truncated; write it again, or register with --skip-bad to leave it out"
        ) from None


def _extent(group: Any) -> tuple[int, int]:
    """The byte range of a row group's column chunks."""
    start, stop = None, 0
    for c in range(group.num_columns):
        column = group.column(c)
        first = int(column.data_page_offset)
        if column.has_dictionary_page and 0 < int(column.dictionary_page_offset) < first:
            first = int(column.dictionary_page_offset)
        start = first if start is None else min(start, first)
        stop = max(stop, first + int(column.total_compressed_size))
    return (start or 0), stop


def _frozen(schema: Any) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(column) for column in schema)


_SPLITS = DecodedLRU(64 << 20, 4096)


FORMAT = ParquetRows()
