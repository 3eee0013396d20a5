"""Parquet members: one sample per row, as a dict ``{column: value}``.

A sample is its row as ``pyarrow`` gives it (``Table.to_pylist``). Reading one fetches
and decodes only the row group that holds it, with one ranged read; decoded row groups
are kept in a per-process :class:`~chunkd.client.datasets.formats.DecodedLRU` of at most
:data:`ROW_GROUP_CACHE_BYTES` and :data:`ROW_GROUP_CACHE_ITEMS`, so that reading the
neighbouring rows decodes nothing again. A row group bigger than the whole bound is
decoded again for every row read of it (``chunkd dataset check`` warns of such groups).
A member's units (:meth:`~chunkd.client.datasets.formats.Format.units`) are its row
groups, so the read order mixes rows within windows of row groups
(:mod:`chunkd.client.datasets.order`), and a unit's decoded bytes
(:meth:`~chunkd.client.datasets.formats.Format.unit_bytes`) are its group's
uncompressed size, so that a window holds at most the cache's bound of them: reading an
epoch in order decodes each group once.

A scan reads only the footer: the 8-byte trailer, then the footer itself (one read of
the file's last 64 KiB answers both when the footer is that small).

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

import bisect
import importlib
import io
import itertools
import struct
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final

from chunkd.client.datasets.formats import DECODED_CACHE_BYTES, DecodedLRU
from chunkd.errors import DatasetFormatError, SnapshotDriftError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from _typeshed import WriteableBuffer

    from chunkd.client.datasets.source import Source
    from chunkd.snapshot import Member

__all__ = ["FORMAT", "ROW_GROUP_CACHE_BYTES", "ROW_GROUP_CACHE_ITEMS", "ParquetRows"]

#: decoded row groups kept per process, by their bytes in memory ...
ROW_GROUP_CACHE_BYTES: Final = DECODED_CACHE_BYTES
#: ... and by their count
ROW_GROUP_CACHE_ITEMS: Final = 64
#: parsed footers kept per process
_FOOTERS: Final = 64
#: a scan reads this much of the file's end at once: the footer of most files fits
_TAIL_BYTES: Final = 64 << 10
#: a footer of more than this is not a Parquet file's
_MAX_FOOTER_BYTES: Final = 256 << 20
_MAGIC: Final = b"PAR1"

_ROW_GROUPS = DecodedLRU(ROW_GROUP_CACHE_BYTES, ROW_GROUP_CACHE_ITEMS)
_METADATA = DecodedLRU(64 << 20, _FOOTERS)


def _pyarrow() -> tuple[Any, Any]:
    return importlib.import_module("pyarrow"), importlib.import_module("pyarrow.parquet")


def schema_of(arrow_schema: Any) -> list[list[str]]:
    """An Arrow schema as the manifest holds it: ``[[column, type], ...]``."""
    return [[field.name, str(field.type)] for field in arrow_schema]


class ParquetRows:
    """The ``parquet`` format (see the module docstring)."""

    name = "parquet"

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
        meta = {"footer": [offset, length], "row_groups": groups, "schema": schema_of(arrow_schema)}
        return replace(member, samples=sum(g[0] for g in groups), meta=meta)

    def read(self, source: Source, member: Member, index: int) -> dict[str, Any]:
        group, row = self._locate(member, index)
        key = (source.name(member), member.version, group)
        table = _ROW_GROUPS.get(key)
        if table is None:
            table = self._decode(source, member, group)
            # Charged at the size the read order counts (the manifest's uncompressed
            # size), so that a window of row groups, cut to the cache's bound, fits the
            # cache: Arrow's figure for the same group (dictionaries decoded) is often
            # larger, and two 128 MiB groups would else overflow 256 MiB and thrash.
            charged = int(member.meta["row_groups"][group][3]) or int(table.nbytes)
            _ROW_GROUPS.put(key, table, charged)
        rows: list[dict[str, Any]] = table.slice(row, 1).to_pylist()
        return rows[0]

    def ranges(self, member: Member, index: int) -> list[tuple[int, int]]:
        group, _ = self._locate(member, index)
        _, start, size, _ = member.meta["row_groups"][group]
        offset, length = member.meta["footer"]
        return [(int(start), int(size)), (int(offset), int(length))]

    def units(self, member: Member) -> list[int] | None:
        # a row group is what a read decodes whole
        return [int(g[0]) for g in member.meta.get("row_groups", ())]

    def unit_bytes(self, member: Member) -> list[int] | None:
        # a row group decodes to about its uncompressed size
        return [int(g[3]) for g in member.meta.get("row_groups", ())]

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

    # -- reading -----------------------------------------------------------------------

    def _locate(self, member: Member, index: int) -> tuple[int, int]:
        groups = member.meta["row_groups"]
        starts = _starts(member, groups)
        if not 0 <= index < starts[-1]:
            raise IndexError(f"row {index} of {member.key}, which holds {starts[-1]} rows")
        group = bisect.bisect_right(starts, index) - 1
        return group, index - starts[group]

    def _decode(self, source: Source, member: Member, group: int) -> Any:
        _, pq = _pyarrow()
        pa = importlib.import_module("pyarrow")
        name = source.name(member)
        metadata = self._metadata(source, member)
        _, start, size, _ = member.meta["row_groups"][group]
        window = _Window(source, member, int(start), source.read(member, int(start), int(size)))
        try:
            parquet = pq.ParquetFile(pa.PythonFile(window, mode="r"), metadata=metadata)
            return parquet.read_row_group(group)
        except Exception as exc:
            if isinstance(exc, SnapshotDriftError):
                raise
            raise DatasetFormatError(
                f"{name}: row group {group} cannot be decoded ({exc}); the file is damaged: "
                "write it again"
            ) from None

    def _metadata(self, source: Source, member: Member) -> Any:
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


def _parse_footer(name: str, data: memoryview | bytes, *, trailer: bool = True) -> Any:
    """The ``FileMetaData`` of a footer's bytes (``trailer``: they end with the length
    and ``PAR1``)."""
    pa, pq = _pyarrow()
    body = bytes(data[:-8]) if trailer else bytes(data)
    try:
        # A file of the magic and the footer alone: pyarrow parses only the footer.
        stub = _MAGIC + body + struct.pack("<I", len(body)) + _MAGIC
        return pq.ParquetFile(pa.BufferReader(stub)).metadata
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


_STARTS = DecodedLRU(64 << 20, 4096)


def _starts(member: Member, groups: list[list[int]]) -> list[int]:
    """Each row group's first row, and the member's row count last."""
    cache_key = (member.key, member.version, member.size, member.samples, len(groups))
    starts: list[int] | None = _STARTS.get(cache_key)
    if starts is None:
        starts = [0, *itertools.accumulate(int(g[0]) for g in groups)]
        _STARTS.put(cache_key, starts, 8 * len(starts))
    return starts


class _Window(io.RawIOBase):
    """A read-only file over a member that answers from one range already read (the
    row group); anything else is read through the source."""

    def __init__(self, source: Source, member: Member, start: int, view: memoryview) -> None:
        super().__init__()
        self._source = source
        self._member = member
        self._start = start
        self._view = view
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._member.size}
        self._position = max(0, base[whence] + offset)
        return self._position

    def readinto(self, buffer: WriteableBuffer) -> int:
        target = memoryview(buffer).cast("B")
        n = min(len(target), self._member.size - self._position)
        if n <= 0:
            return 0
        inside = self._position - self._start
        if inside >= 0 and inside + n <= len(self._view):
            target[:n] = self._view[inside : inside + n]
        else:
            got = self._source.read(self._member, self._position, n)
            n = len(got)
            target[:n] = got
        self._position += n
        return n


FORMAT = ParquetRows()
