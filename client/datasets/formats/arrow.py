"""Arrow IPC files and Feather v2 members: one sample per row, as a dict ``{column: value}``.

An Arrow IPC **file** (``pyarrow.ipc.new_file``; ``.arrow``, ``.ipc``) and a Feather v2
file (``pyarrow.feather.write_feather``, which is an IPC file, its buffers often LZ4- or
zstd-compressed; ``.feather``) are read in place. Feather v1 and the IPC **stream**
format are refused by name: they have no footer that says where each record batch lies,
so a batch cannot be read alone; write Feather v2 or an IPC file instead
(``pyarrow.feather.write_feather(table, path)`` or ``pyarrow.ipc.new_file``).

A member's **units** are its record batches: :meth:`~ArrowFiles.decode` reads one batch
(its message and body, one ranged read), the dictionary batches if the schema has
dictionary-encoded columns, and the footer, and gives an Arrow table of the file's
columns with their types as stored. Only the columns asked are decompressed
(``IpcReadOptions(included_fields=...)``). A batch of more than
:data:`~chunkd.client.datasets.formats.MAX_UNIT_BYTES` decoded is cut into units of
whole rows as a Parquet row group is (:mod:`chunkd.client.datasets.formats.parquet`):
each decodes the batch and keeps a copy of its rows. A unit's decoded bytes are its
batch's buffers' bytes, uncompressed (its share of them, for a cut batch).

A sample (:meth:`~ArrowFiles.sample`) is its row as ``Table.to_pylist`` gives it, as for
Parquet: nulls are None, lists lists, structs dicts, decimals
:class:`decimal.Decimal`, timestamps :class:`datetime.datetime`, dictionary-encoded
columns their values.

A scan reads the footer (the file's last 64 KiB answer it when it is that small), then
each record batch's message (its row count and buffers) and, in a compressed file, the
8-byte uncompressed length that starts each compressed buffer; never a batch's data.

Member ``meta``:

``footer``
    ``[offset, length]``: the footer's byte range: its flatbuffer, the 4-byte length and
    the closing ``ARROW1``.
``batches``
    ``[[rows, offset, length, bytes], ...]``: per record batch, in file order, its row
    count, the byte range of its message and body, and its buffers' uncompressed size.
``dictionaries``
    ``[[offset, length], ...]``: the byte ranges of the dictionary batches; only where
    the file has any.
``compressed``
    ``true`` where the file's buffers are compressed (LZ4 or zstd); absent otherwise.
``schema``
    ``[[column, type], ...]``: the member's Arrow schema, only where it differs from the
    dataset's (the manifest's ``schema_of``), as for Parquet.

pyarrow is imported when an Arrow member is first scanned or read.
"""

from __future__ import annotations

import importlib
import math
import struct
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final

from chunkd.client.datasets.formats import MAX_UNIT_BYTES, DecodedLRU, FormatBase
from chunkd.client.datasets.formats.parquet import ParquetRows, schema_findings, schema_of
from chunkd.client.datasets.source import MemberFile
from chunkd.errors import DatasetFormatError, SnapshotDriftError

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from chunkd.client.datasets.findings import Finding
    from chunkd.client.datasets.source import Source
    from chunkd.snapshot import Member

__all__ = ["FORMAT", "ArrowFiles"]

_MAGIC: Final = b"ARROW1"
#: a scan reads this much of the file's end at once: the footer of most files fits
_TAIL_BYTES: Final = 64 << 10
#: a footer of more than this is not an Arrow file's
_MAX_FOOTER_BYTES: Final = 64 << 20
#: a record batch's message (its flatbuffer) of more than this is not an Arrow file's
_MAX_MESSAGE_BYTES: Final = 16 << 20
#: a scan reads the compressed buffers' length prefixes that lie this close together
#: as one range
_GAP_BYTES: Final = 64 << 10
#: the message header of a record batch (flatbuffers' MessageHeader union)
_RECORD_BATCH: Final = 3


def _pyarrow() -> tuple[Any, Any]:
    return importlib.import_module("pyarrow"), importlib.import_module("pyarrow.ipc")


class ArrowFiles(FormatBase):
    """The ``arrow`` format (see the module docstring)."""

    name = "arrow"
    version = 1
    suffixes = (".arrow", ".feather", ".ipc")

    def scan(self, source: Source, member: Member, options: Mapping[str, Any]) -> Member:
        name = source.name(member)
        offset, length, tail = self._footer(source, member)
        pieces = {offset: tail}
        try:
            footer = _Flat(bytes(tail[: length - 10]))
            blocks = footer.structs(footer.root(), 3, "<qi4xq")
            dictionaries = footer.structs(footer.root(), 2, "<qi4xq")
            arrow_schema = self._open(source, member, pieces, None).schema
        except DatasetFormatError:
            raise
        except SnapshotDriftError:
            raise
        except Exception as exc:  # pyarrow's and struct's errors of damaged bytes
            raise DatasetFormatError(
                f"{name} has an Arrow footer that cannot be read ({exc}): it is damaged or "
                "truncated; write it again, or register with --skip-bad to leave it out"
            ) from None
        batches, compressed = [], False
        for start, meta_length, body in blocks:
            _inside(name, start, meta_length + body, offset)
            rows, decoded, packed = self._batch(source, member, start, meta_length, body)
            batches.append([rows, start, meta_length + body, decoded])
            compressed = compressed or packed
        meta: dict[str, Any] = {"footer": [offset, length], "batches": batches}
        if compressed:
            meta["compressed"] = True
        for start, meta_length, body in dictionaries:
            _inside(name, start, meta_length + body, offset)
        if dictionaries:
            meta["dictionaries"] = [[s, m + b] for s, m, b in dictionaries]
        meta["schema"] = schema_of(arrow_schema)
        return replace(member, samples=sum(b[0] for b in batches), meta=meta)

    def schema(self, members: list[Member]) -> Any:
        return _PARQUET.schema(members)

    def settle(self, members: list[Member], schema: Any) -> list[Member]:
        """``members``, each without its ``schema`` where it is the dataset's."""
        return _PARQUET.settle(members, schema)

    def check(
        self, source: Source, members: Sequence[Member], schema_of: Any, *, deep: bool
    ) -> Iterable[Finding]:
        """``schema-differs``: a member whose schema is not the dataset's, as Parquet's."""
        return schema_findings(members, schema_of)

    # -- units -------------------------------------------------------------------------

    def units(self, member: Member) -> list[int]:
        return [rows for _, _, rows, _ in _units(member)]

    def unit_bytes(self, member: Member) -> list[int]:
        return [size for _, _, _, size in _units(member)]

    def unit_ranges(self, member: Member, unit: int) -> list[tuple[int, int]]:
        batch = _units(member)[unit][0]
        _, start, length, _ = member.meta["batches"][batch]
        offset, footer = member.meta["footer"]
        dictionaries = [(int(s), int(n)) for s, n in member.meta.get("dictionaries", ())]
        return [(int(start), int(length)), *dictionaries, (int(offset), int(footer))]

    def decode(
        self, source: Source, member: Member, unit: int, columns: Sequence[str] | None
    ) -> Any:
        pa, ipc = _pyarrow()
        name = source.name(member)
        batch, first, rows, _ = _units(member)[unit]
        try:
            schema = self._schema(source, member)
            known = schema.names
            _check_columns(name, columns, known)
            asked = None if columns is None else list(dict.fromkeys(columns))
            if asked == []:  # no column: the rows alone
                return pa.table({"": pa.nulls(rows)}).select([])
            project = asked is not None and len(asked) < len(known)
            if not member.meta.get("dictionaries") and not (
                project and member.meta.get("compressed")
            ):
                # The batch's message and body alone: its columns are the bytes read,
                # not a copy (decompressed, where they are compressed).
                _, start, length, _ = member.meta["batches"][batch]
                view = source.read(member, int(start), int(length))
                record_batch = ipc.read_record_batch(pa.py_buffer(view), schema)
            else:
                # pyarrow's file reader reads the dictionaries, and decompresses only
                # the asked columns' buffers
                ranges = self.unit_ranges(member, unit)
                pieces = {o: source.read(member, o, n) for o, n in ranges}
                fields = sorted(known.index(c) for c in asked) if asked and project else None
                record_batch = self._open(source, member, pieces, fields).get_batch(batch)
        except (DatasetFormatError, SnapshotDriftError, MemoryError):
            raise
        except Exception as exc:  # pyarrow's errors of damaged bytes
            raise DatasetFormatError(
                f"{name}: record batch {batch} cannot be decoded ({exc}); the file is "
                "damaged: write it again"
            ) from None
        whole = int(member.meta["batches"][batch][0])
        if record_batch.num_rows != whole:
            raise DatasetFormatError(
                f"{name}: record batch {batch} decoded to {record_batch.num_rows} rows where "
                f"its message says {whole}; the file is damaged: write it again"
            )
        if rows != whole:  # a copy of the unit's rows: a slice would hold the batch
            record_batch = record_batch.take(pa.array(range(first, first + rows), pa.int64()))
        table = pa.Table.from_batches([record_batch])
        return table if columns is None else table.select(list(columns))

    def sample(self, table: Any, row: int) -> dict[str, Any]:
        rows: list[dict[str, Any]] = table.slice(row, 1).to_pylist()
        return rows[0]

    # -- reading -----------------------------------------------------------------------

    def _schema(self, source: Source, member: Member) -> Any:
        """``member``'s Arrow schema, from its footer (kept per process)."""
        key = (source.name(member), member.version)
        schema = _SCHEMAS.get(key)
        if schema is None:
            offset, length = (int(v) for v in member.meta["footer"])
            pieces = {offset: source.read(member, offset, length)}
            schema = self._open(source, member, pieces, None).schema
            _SCHEMAS.put(key, schema, length)
        return schema

    def _open(
        self,
        source: Source,
        member: Member,
        pieces: dict[int, memoryview],
        fields: list[int] | None,
    ) -> Any:
        """pyarrow's reader of the file, its reads answered from ``pieces`` (offset:
        bytes) where they lie inside one, else through ``source``."""
        pa, ipc = _pyarrow()
        options = ipc.IpcReadOptions(included_fields=fields) if fields is not None else None
        window = MemberFile(source, member, pieces)
        return ipc.open_file(pa.PythonFile(window, mode="r"), options=options)

    def _footer(self, source: Source, member: Member) -> tuple[int, int, memoryview]:
        """The footer's offset, its length with the trailer, and its bytes."""
        name, size = source.name(member), member.size
        if size < 18:
            raise DatasetFormatError(
                f"{name} holds {size} bytes: too few for an Arrow IPC file (at least 18)"
            )
        tail_offset = max(0, size - _TAIL_BYTES)
        tail = source.read(member, tail_offset, size - tail_offset)
        if len(tail) != size - tail_offset:
            raise DatasetFormatError(f"{name} ended before its recorded size of {size} bytes")
        if bytes(tail[-6:]) != _MAGIC:
            head = bytes(source.read(member, 0, 8))
            if head[:4] == b"FEA1" or bytes(tail[-4:]) == b"FEA1":
                what = "a Feather v1 file"
            elif head[:4] == b"\xff\xff\xff\xff":
                what = "an Arrow IPC stream, not an IPC file"
            else:
                what = f"not an Arrow IPC file: it does not end with {_MAGIC!r}"
            raise DatasetFormatError(
                f"{name} is {what}; chunkd reads Arrow IPC files and Feather v2, whose footer "
                "locates each record batch: write it with pyarrow.feather.write_feather "
                "(version 2, the default) or pyarrow.ipc.new_file"
            )
        (length,) = struct.unpack("<i", tail[-10:-6])
        offset = size - 10 - length
        if not 0 < length <= _MAX_FOOTER_BYTES or offset < 8:
            raise DatasetFormatError(
                f"{name}: its footer claims {length} bytes, which the file's {size} cannot "
                "hold: the footer is damaged or the file is truncated; write it again"
            )
        if offset >= tail_offset:
            footer = tail[offset - tail_offset :]
        else:
            footer = source.read(member, offset, length + 10)
        return offset, length + 10, footer

    def _batch(
        self, source: Source, member: Member, start: int, meta_length: int, body: int
    ) -> tuple[int, int, bool]:
        """A record batch's rows, its buffers' uncompressed bytes and whether they are
        compressed, from its message (and, when compressed, its buffers' length
        prefixes)."""
        name = source.name(member)
        if not 8 <= meta_length <= _MAX_MESSAGE_BYTES:
            raise DatasetFormatError(
                f"{name}: a record batch's message claims {meta_length} bytes: the file is "
                "damaged; write it again"
            )
        data = bytes(source.read(member, start, meta_length))
        try:
            found = _record_batch(data)
        except (ValueError, IndexError, struct.error) as exc:
            found, why = None, f"({exc})"
        else:
            why = "(it is not a record batch's message)"
        if found is None:
            raise DatasetFormatError(
                f"{name}: the record batch at byte {start} cannot be read {why}: the file "
                "is damaged; write it again"
            )
        rows, buffers, compressed = found
        if rows < 0 or any(o < 0 or n < 0 or o + n > body for o, n in buffers):
            raise DatasetFormatError(
                f"{name}: the record batch at byte {start} claims buffers outside its body: "
                "the file is damaged; write it again"
            )
        if not compressed:
            return rows, sum(n for _, n in buffers), False
        return rows, self._uncompressed(source, member, start + meta_length, buffers), True

    def _uncompressed(
        self, source: Source, member: Member, body: int, buffers: list[tuple[int, ...]]
    ) -> int:
        """The uncompressed bytes of a compressed batch's buffers: each starts with its
        length (-1: stored uncompressed), read in ranges of nearby prefixes."""
        starts = sorted(body + o for o, n in buffers if n >= 8)
        total, i = 0, 0
        while i < len(starts):
            j = i
            while j + 1 < len(starts) and starts[j + 1] - starts[i] <= _GAP_BYTES:
                j += 1
            span = source.read(member, starts[i], starts[j] + 8 - starts[i])
            for at in starts[i : j + 1]:
                (length,) = struct.unpack_from("<q", span, at - starts[i])
                total += length if length >= 0 else 0
            i = j + 1
        stored = sum(n - 8 for o, n in buffers if n >= 8)
        return max(total, stored)


def _check_columns(name: str, columns: Sequence[str] | None, known: list[str]) -> None:
    unknown = [c for c in columns or () if c not in known]
    if unknown:
        raise DatasetFormatError(
            f"{name} has no column {unknown[0]!r}; its columns: {', '.join(known)}"
        )


def _record_batch(data: bytes) -> tuple[int, list[tuple[int, ...]], bool] | None:
    """A record batch's message (``data``, as the file holds it): its rows, its
    buffers' ``(offset, length)`` in the body and whether they are compressed; None:
    another message."""
    skip = 8 if data[:4] == b"\xff\xff\xff\xff" else 4  # the continuation marker
    message = _Flat(data[skip:])
    root = message.root()
    header = message.table(root, 2)
    if message.scalar(root, 1, "<B", 0) != _RECORD_BATCH or header is None:
        return None
    rows = message.scalar(header, 0, "<q", 0)
    return rows, message.structs(header, 2, "<qq"), message.table(header, 3) is not None


def _inside(name: str, start: int, length: int, end: int) -> None:
    if start < 8 or length < 0 or start + length > end:
        raise DatasetFormatError(
            f"{name}: a batch claims bytes {start}..{start + length}, outside the data "
            f"before the footer at {end}: the file is damaged; write it again"
        )


def _units(member: Member) -> list[tuple[int, int, int, int]]:
    """``member``'s units: ``(batch, first row in it, rows, decoded bytes)`` each
    (cached): a record batch each, one of more than ``MAX_UNIT_BYTES`` cut into runs of
    its rows shared evenly, each of at most ``MAX_UNIT_BYTES``."""
    batches = member.meta.get("batches", ())
    key = (member.key, member.version, member.size, member.samples, len(batches), MAX_UNIT_BYTES)
    found: list[tuple[int, int, int, int]] | None = _SPLITS.get(key)
    if found is not None:
        return found
    found = []
    for b, (rows, _, _, size) in enumerate(batches):
        rows, size = int(rows), int(size)
        if rows == 0:
            continue  # an empty batch holds no sample
        pieces = max(1, math.ceil(size / MAX_UNIT_BYTES))
        while pieces < rows and math.ceil(rows / pieces) * size > MAX_UNIT_BYTES * rows:
            pieces += 1
        pieces = min(pieces, rows)
        share, extra = divmod(rows, pieces)
        first = 0
        for p in range(pieces):
            count = share + (p < extra)
            found.append((b, first, count, size if pieces == 1 else -(-size * count // rows)))
            first += count
    _SPLITS.put(key, found, 64 * len(found))
    return found


_SPLITS = DecodedLRU(64 << 20, 4096)
#: parsed schemas kept per process, by their footers' bytes
_SCHEMAS = DecodedLRU(64 << 20, 64)
_PARQUET: Final = ParquetRows()


class _Flat:
    """Just enough of a flatbuffer reader for an Arrow footer and a batch's message."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def root(self) -> int:
        return int(struct.unpack_from("<I", self.data, 0)[0])

    def _field(self, table: int, index: int) -> int:
        """The position of field ``index`` of the table at ``table``, or 0: absent."""
        vtable = table - struct.unpack_from("<i", self.data, table)[0]
        size = struct.unpack_from("<H", self.data, vtable)[0]
        if 4 + 2 * index >= size:
            return 0
        at = struct.unpack_from("<H", self.data, vtable + 4 + 2 * index)[0]
        return table + at if at else 0

    def scalar(self, table: int, index: int, fmt: str, default: int) -> int:
        at = self._field(table, index)
        return int(struct.unpack_from(fmt, self.data, at)[0]) if at else default

    def table(self, table: int, index: int) -> int | None:
        at = self._field(table, index)
        return at + int(struct.unpack_from("<I", self.data, at)[0]) if at else None

    def structs(self, table: int, index: int, fmt: str) -> list[tuple[int, ...]]:
        at = self._field(table, index)
        if not at:
            return []
        vector = at + struct.unpack_from("<I", self.data, at)[0]
        (count,) = struct.unpack_from("<I", self.data, vector)
        size = struct.calcsize(fmt)
        if vector + 4 + count * size > len(self.data):
            raise ValueError("a vector runs past its flatbuffer")
        return [struct.unpack_from(fmt, self.data, vector + 4 + i * size) for i in range(count)]


FORMAT = ArrowFiles()
