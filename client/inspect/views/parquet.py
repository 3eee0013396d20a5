"""The inspector's view of a Parquet object (:class:`ParquetView`).

The footer is read once (the view is kept in the worker's bounded LRU of views); a
page decodes only the row groups that hold its rows, and of them only the asked
columns, each column chunk one ranged read; decoded groups are kept in a bounded LRU.
The footer and the row groups are read by the dataset code's Parquet format (its scan
and ``row_group``); a group too big to decode whole is read page by page
(:class:`_GroupPages`).
"""

from __future__ import annotations

import contextlib
import importlib
import io
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING, Any, Final

from chunkd.client.datasets.formats import DECODED_CACHE_BYTES, DecodedLRU
from chunkd.client.datasets.source import PinnedSource
from chunkd.client.inspect.values import encode
from chunkd.client.inspect.views.view import (
    PinnedReads,
    file_errors,
    malformed,
    past_end,
    split_name,
)
from chunkd.errors import DatasetFormatError, InvalidRequestError, MalformedFileError
from chunkd.mediatype import SNIFF_BYTES, sniff
from chunkd.snapshot import Member

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

    from chunkd.client.core import Client
    from chunkd.client.results import ObjectStat

__all__ = [
    "MAX_ROW_GROUPS",
    "PAGE_BATCH_BYTES",
    "PAGE_BUFFER",
    "ROW_GROUP_BYTES",
    "WHOLE_GROUP_BYTES",
    "ParquetView",
    "clear_row_groups",
    "pyarrow_modules",
]

#: decoded Parquet row groups kept per worker, by their bytes in memory
ROW_GROUP_BYTES: Final = DECODED_CACHE_BYTES
#: ``open`` lists at most this many row groups ...
MAX_ROW_GROUPS: Final = 10_000
#: ... and at most this many column statistics over them
_MAX_COLUMN_STATS: Final = 200_000
#: a footer metadata value is cut to this many bytes
_METADATA_BYTES: Final = 4096
#: a column statistic bigger than this goes as its size and type, not its value
_STAT_BYTES: Final = 1024
#: rows converted from Arrow at a time
_ARROW_BATCH: Final = 64
#: a row group whose asked columns hold at most this many bytes (as its footer says) is
#: decoded whole and kept; a bigger one is read page by page
WHOLE_GROUP_BYTES: Final = 32 << 20
#: the buffer each column chunk of a row group read page by page is read through
PAGE_BUFFER: Final = 1 << 20
#: a batch of a row group read page by page holds about this many bytes of rows ...
PAGE_BATCH_BYTES: Final = 4 << 20
#: ... and at most this many rows
_MAX_BATCH_ROWS: Final = 8192

_ROW_GROUPS = DecodedLRU(ROW_GROUP_BYTES, 64)
_PYARROW_READY = False


def pyarrow_modules() -> tuple[Any, Any]:
    """``pyarrow`` and ``pyarrow.parquet``, set up for a worker on first use."""
    global _PYARROW_READY  # once per process, before pyarrow's pools start
    pa = importlib.import_module("pyarrow")
    pq = importlib.import_module("pyarrow.parquet")
    if not _PYARROW_READY:
        # A worker lives under an address-space limit: a thread pool sized to a big
        # machine's cores would reserve stacks and arenas for nothing.
        pa.set_cpu_count(2)
        pa.set_io_thread_count(2)
        _PYARROW_READY = True
    return pa, pq


class _Window(io.RawIOBase):
    """A read-only file over an object that answers from ranges already read (a row
    group's column chunks); anything else is read through the client."""

    def __init__(self, read: PinnedReads, pieces: list[tuple[int, memoryview]]) -> None:
        super().__init__()
        self._read = read
        self._pieces = pieces
        self._position = 0
        self._size = read.stat.size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: WriteableBuffer) -> int:
        target = memoryview(buffer).cast("B")
        n = min(len(target), self._size - self._position)
        if n <= 0:
            return 0
        for start, view in self._pieces:
            inside = self._position - start
            if inside >= 0 and inside + n <= len(view):
                target[:n] = view[inside : inside + n]
                break
        else:
            got = self._read(self._position, n)
            n = len(got)
            target[:n] = got
        self._position += n
        return n


class ParquetView:
    """A Parquet object (see the module docstring)."""

    kind = "parquet"

    def __init__(self, client: Client, stat: ObjectStat) -> None:
        from chunkd.client.datasets.formats import parquet

        self.name = stat.name
        self._read = PinnedReads(client, stat)
        self._stat = stat
        backend, key = split_name(stat.name)
        # The dataset format reads the footer and decodes row groups: one Parquet reader
        self._source = PinnedSource(client, backend)
        self._format = parquet.FORMAT
        try:
            self._member = self._format.scan(
                self._source, Member(key, stat.size, stat.version, "parquet"), {}
            )
            self.metadata = self._format.metadata(self._source, self._member)
        except DatasetFormatError as exc:
            raise malformed(exc) from None
        try:
            self.schema = self.metadata.schema.to_arrow_schema()
            groups = [self.metadata.row_group(g) for g in range(self.metadata.num_row_groups)]
            self._starts = [0]
            for group in groups:
                self._starts.append(self._starts[-1] + group.num_rows)
        except Exception as exc:  # pyarrow's own errors: ArrowInvalid, OSError, ...
            raise MalformedFileError(
                f"{self.name} has a Parquet footer pyarrow cannot read ({exc}): it is damaged; "
                "write it again"
            ) from None
        self._footer_bytes = int(self.metadata.serialized_size)
        #: the row group being read page by page, where the last page left it
        self._pages: _GroupPages | None = None

    @property
    def total(self) -> int | None:
        return self._starts[-1]

    @property
    def nbytes(self) -> int:
        pages = self._pages.nbytes if self._pages is not None else 0
        return self._footer_bytes * 4 + 8 * len(self._starts) + pages

    def fields(self) -> list[str] | None:
        return [f.name for f in self.schema]

    def describe(self) -> dict[str, Any]:
        metadata = self.metadata
        schema = [{"name": f.name, "type": str(f.type)} for f in self.schema]
        total = metadata.num_row_groups
        columns = max(1, metadata.num_columns)
        shown = min(total, MAX_ROW_GROUPS, max(1, _MAX_COLUMN_STATS // columns))
        groups = []
        for g in range(shown):
            group = metadata.row_group(g)
            stats = []
            for c in range(group.num_columns):
                column = group.column(c)
                st: Any = column.statistics if column.is_stats_set else None
                has = st is not None and st.has_min_max
                stats.append(
                    {
                        "name": column.path_in_schema,
                        "min": _stat(st.min) if has else None,
                        "max": _stat(st.max) if has else None,
                        "nulls": st.null_count if st is not None and st.has_null_count else None,
                        "compressed_bytes": int(column.total_compressed_size),
                    }
                )
            groups.append(
                {
                    "index": g,
                    "rows": group.num_rows,
                    "first_row": self._starts[g],
                    "bytes": int(group.total_byte_size),
                    "columns": stats,
                }
            )
        kv: dict[str, str] = {}
        for key, value in (metadata.metadata or {}).items():
            text = key.decode("utf-8", "replace")
            kv[text] = value[:_METADATA_BYTES].decode("utf-8", "replace")
        return {
            "num_rows": metadata.num_rows,
            "schema": schema,
            "row_groups": groups,
            "row_groups_total": total,
            "metadata": kv,
            "created_by": metadata.created_by,
        }

    def check_columns(self, columns: list[str] | None) -> list[str] | None:
        """``columns``, if the schema has each.

        Raises:
            InvalidRequestError: it has not.
        """
        if columns is None:
            return None
        known = set(self.schema.names)
        missing = [c for c in columns if c not in known]
        if missing:
            raise InvalidRequestError(
                f"{self.name} has no column {missing[0]!r}; its columns are "
                f"{', '.join(self.schema.names)[:2000]}"
            )
        return columns

    def rows(self, start: int, columns: list[str] | None) -> Iterator[tuple[int, Any]]:
        import bisect

        columns = self.check_columns(columns)
        total = self._starts[-1]
        if not 0 <= start < total:
            raise past_end(self.name, start, total)
        group = bisect.bisect_right(self._starts, start) - 1
        row = start - self._starts[group]
        while group < self.metadata.num_row_groups:
            for at, value in self._group_rows(group, row, columns):
                index = self._starts[group] + at
                yield index, encode(value, {"sample": f"{self.name}#{index}"})
            group, row = group + 1, 0

    def _group_rows(
        self, group: int, row: int, columns: list[str] | None
    ) -> Iterator[tuple[int, Any]]:
        """``(row in the group, value)`` of row group ``group`` from ``row`` on: from the
        group decoded whole when it is small, else page by page (:class:`_GroupPages`)."""
        if self._asked_bytes(group, columns) <= WHOLE_GROUP_BYTES:
            table = self.group(group, columns)
            while row < table.num_rows:
                for value in table.slice(row, _ARROW_BATCH).to_pylist():
                    yield row, value
                    row += 1
            return
        pages = self._pages
        if pages is None or not pages.serves(group, columns, row):
            self._pages = None  # its buffers go before the new reader's come
            pages = self._pages = _GroupPages(self, group, columns)
        try:
            yield from pages.rows_from(row)
        except Exception:
            self._pages = None  # its reader failed: the next page starts afresh
            raise

    def _asked_bytes(self, group: int, columns: list[str] | None) -> int:
        """The bytes the asked columns of row group ``group`` hold, as its footer says
        (uncompressed or compressed, the larger)."""
        meta = self.metadata.row_group(group)
        size = 0
        for c in range(meta.num_columns):
            column = meta.column(c)
            if _asked(column.path_in_schema, columns):
                size += max(int(column.total_uncompressed_size), int(column.total_compressed_size))
        return size

    def group(self, group: int, columns: list[str] | None) -> Any:
        """Row group ``group``'s ``columns`` (all: None), decoded (and kept a while)."""
        key: Hashable = (self.name, self._stat.version, group, tuple(columns or ()))
        table = _ROW_GROUPS.get(key)
        if table is not None:
            return table
        pyarrow_modules()  # set up for a worker
        with _decoding(self.name, group):
            try:
                table = self._format.row_group(self._source, self._member, group, columns)
            except DatasetFormatError as exc:
                raise malformed(exc) from None
        _ROW_GROUPS.put(key, table, int(table.nbytes))
        return table


class _GroupPages:
    """One row group's asked columns read page by page: each column chunk through a
    buffered stream of :data:`PAGE_BUFFER` bytes (pyarrow's ``buffer_size``, without
    ``pre_buffer``, which would read the whole group first), decoded a batch of rows at
    a time (``iter_batches``). A page of rows costs the column pages and the batches
    that hold it, never the group; the next page of the same group goes on from where
    this one stopped, and an earlier one starts the group again."""

    def __init__(self, view: ParquetView, group: int, columns: list[str] | None) -> None:
        pa, pq = pyarrow_modules()
        self.name = view.name
        self.group = group
        self.columns = columns
        rows = max(1, view.metadata.row_group(group).num_rows)
        per_row = max(1, view._asked_bytes(group, columns) // rows)
        #: rows a batch holds: about PAGE_BATCH_BYTES of them, as the footer sizes them
        self.batch_rows = min(_MAX_BATCH_ROWS, max(1, PAGE_BATCH_BYTES // per_row))
        with _decoding(self.name, group):
            parquet = pq.ParquetFile(
                pa.PythonFile(_Window(view._read, []), mode="r"),
                metadata=view.metadata,
                buffer_size=PAGE_BUFFER,
                pre_buffer=False,
            )
            self._batches = parquet.iter_batches(
                batch_size=self.batch_rows, row_groups=[group], columns=columns, use_threads=False
            )
        #: the current batch, and the row (in the group) it starts at
        self.batch: Any = None
        self.first = 0

    @property
    def nbytes(self) -> int:
        """About the memory its buffers and its batch hold."""
        batch = int(self.batch.nbytes) if self.batch is not None else 0
        return batch + PAGE_BUFFER * (len(self.columns) if self.columns else 8)

    def serves(self, group: int, columns: list[str] | None, row: int) -> bool:
        """Whether it can go on to ``row`` of ``group`` without starting again."""
        return (group, columns) == (self.group, self.columns) and row >= self.first

    def rows_from(self, row: int) -> Iterator[tuple[int, Any]]:
        """``(row in the group, value)`` from ``row`` (at or past :attr:`first`) on."""
        while True:
            if self.batch is None or row >= self.first + self.batch.num_rows:
                if self.batch is not None:
                    self.first += self.batch.num_rows
                    self.batch = None
                with _decoding(self.name, self.group):
                    self.batch = next(self._batches, None)
                if self.batch is None:
                    return
                continue
            for value in self.batch.slice(row - self.first, _ARROW_BATCH).to_pylist():
                yield row, value
                row += 1


def _asked(path: str, columns: list[str] | None) -> bool:
    """Whether the column chunk at ``path`` is one of ``columns`` (or inside one)."""
    return columns is None or any(path == want or path.startswith(f"{want}.") for want in columns)


def _decoding(name: str, group: int) -> contextlib.AbstractContextManager[None]:
    """pyarrow's errors on row group ``group`` of ``name`` as the file's."""
    return file_errors(name, f"row group {group} cannot be decoded")


def _stat(value: Any) -> Any:
    """A column statistic: its value, or its size and type where it is big (a binary
    column's statistics are often whole images)."""
    if isinstance(value, bytes) and len(value) > 64:
        return {"$bytes": len(value), "media_type": sniff(value[:SNIFF_BYTES])}
    if isinstance(value, str) and len(value) > _STAT_BYTES:
        data = value.encode("utf-8", "surrogatepass")
        return {"$bytes": len(data), "media_type": None}
    return encode(value)


def clear_row_groups() -> None:
    """Drop the decoded row groups kept (the worker's views are cleared)."""
    _ROW_GROUPS.clear()
