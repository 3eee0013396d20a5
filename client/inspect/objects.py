"""Views of one object version, by format: what ``open``, ``rows`` and ``sample`` read.

Every view reads through the worker's :class:`~chunkd.client.Client` only, pinned to
the version it was opened on, and only the ranges it needs:

- :class:`ParquetView`: the footer once (kept in a bounded LRU of views); a page decodes
  only the row groups that hold its rows, and of them only the asked columns, each
  column chunk one ranged read; decoded groups are kept in a bounded LRU. The footer
  and the row groups are read by the dataset code's Parquet format (its scan and
  ``row_group``); a group too big to decode whole is read page by page.
- :class:`LinesView`: text and JSON lines, by line number (:mod:`.lines`); a
  ``.jsonl.zst`` object is read by the dataset code's JSON lines format.
- :class:`TarView`: a WebDataset tar, one sample per key, from its headers alone;
  members go as ``$media`` ranges of the tar.
- :class:`MdsView`: an MDS shard, with the ``index.json`` beside it, read by the
  dataset code's MDS format.
- :class:`MediaView` and :class:`BinaryView`: an image, audio or video object (the
  whole object as ``$media``), anything else (its first bytes).

A file that cannot be read as its format raises :class:`~chunkd.errors.MalformedFileError`
naming the object and the fault.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import io
import json
import posixpath
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Any, Final, Protocol

from chunkd.client.datasets.formats import DECODED_CACHE_BYTES, DecodedLRU, detect
from chunkd.client.datasets.source import PinnedSource
from chunkd.client.inspect.audio import audio_info
from chunkd.client.inspect.lines import LineIndex
from chunkd.client.inspect.values import MAX_DEPTH, AudioCells, encode, media, tar_file
from chunkd.errors import (
    ChunkdError,
    DatasetFormatError,
    InvalidRequestError,
    MalformedFileError,
)
from chunkd.mediatype import SNIFF_BYTES, kind_of, sniff
from chunkd.snapshot import Member

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

    from chunkd.client.core import Client
    from chunkd.client.results import ObjectStat

__all__ = [
    "FORMATS",
    "BinaryView",
    "LinesView",
    "MdsView",
    "MediaView",
    "ParquetView",
    "TarView",
    "View",
    "Views",
]

#: the formats ``open`` takes (``format=``)
FORMATS: Final = ("parquet", "jsonl", "text", "wds", "mds", "image", "audio", "video", "binary")
#: the first bytes read to detect a format and shown for a binary object
HEAD_BYTES: Final = 4096
#: open views (footers, line indexes, tar indexes) kept per worker
VIEWS: Final = 32
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
#: a tar is indexed up to this many samples
MAX_TAR_SAMPLES: Final = 200_000
#: the first page of a tar's samples in ``open``
_TAR_FIRST_PAGE: Final = 20
#: an index.json bigger than this is not read
_MAX_INDEX_JSON: Final = 64 << 20
#: objects of at most this many bytes have their lines counted at ``open``
_COUNT_LINES_BYTES: Final = 8 << 20
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
#: a view's field names are looked for in this many first records (JSON lines)
_FIELD_LINES: Final = 8
#: a decoder's own words on a fault are cut to this many characters
_FAULT_CHARS: Final = 500

_TEXT_SUFFIXES: Final = (
    ".txt", ".text", ".log", ".md", ".rst", ".csv", ".tsv", ".json", ".yaml", ".yml",
    ".toml", ".ini", ".cfg", ".py", ".sh", ".xml", ".html", ".htm", ".svg",
)  # fmt: skip


class View(Protocol):
    """One object version, read as one format."""

    #: the format (one of :data:`FORMATS`)
    kind: str
    #: the object, ``BACKEND/KEY``
    name: str

    @property
    def total(self) -> int | None:
        """Its rows (samples, lines), or None while unknown."""
        ...

    @property
    def nbytes(self) -> int:
        """About the memory the view holds."""
        ...

    def describe(self) -> dict[str, Any]:
        """The fields of its ``open`` answer that are particular to its kind."""
        ...

    def fields(self) -> list[str] | None:
        """The names of its records' fields (for RL detection), or None."""
        ...

    def rows(self, start: int, columns: list[str] | None) -> Iterator[tuple[int, Any]]:
        """``(index, value)`` of rows ``start``, ``start + 1``, ... to the end; values as
        :func:`~chunkd.client.inspect.values.encode` sends them.

        Raises:
            InvalidRequestError: ``start`` is past the end, or the view has no rows.
            MalformedFileError: a row cannot be decoded.
        """
        ...


def malformed(exc: BaseException) -> MalformedFileError:
    """The inspector's error for a dataset format's refusal (its message names the file)."""
    return MalformedFileError(str(exc))


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is the worker's address-space limit at work (an allocation, a
    mapping or a thread refused), not a fault of the file."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        return True
    text = str(exc)
    return "Cannot allocate memory" in text or "Failed to launch worker thread" in text


@contextlib.contextmanager
def file_errors(name: str, what: str) -> Iterator[None]:
    """What a decoder raises on the bytes of ``name``, as the file's fault.

    chunkd's own errors pass as they are (they say what they are), and so does running
    out of memory (an ``ENOMEM`` from a mapping or a thread is made a MemoryError).
    Anything else a decoder raised on the file's bytes (a ValueError, a TypeError on a
    value of the wrong type, pyarrow's errors, a RecursionError) is
    :class:`~chunkd.errors.MalformedFileError` naming the file, ``what`` failed and the
    fault: a malformed file is a 422, never a 500.
    """
    try:
        yield
    except (ChunkdError, MemoryError):
        raise
    except RecursionError:
        raise MalformedFileError(
            f"{name}: {what}: it holds a value nested too deep to read; read it with the client"
        ) from None
    except Exception as exc:
        if out_of_memory(exc):
            raise MemoryError(f"{name}: {exc}") from None
        raise MalformedFileError(
            f"{name}: {what} ({type(exc).__name__}: {str(exc)[:_FAULT_CHARS]}): the file is "
            "damaged, or not of its format"
        ) from None


class _Guarded:
    """A view whose every read of the file goes through :func:`file_errors`: what a
    view is asked (its description, fields and rows) fails as the file's fault, or as
    chunkd's own error, never as a bug of the worker's."""

    def __init__(self, view: View) -> None:
        self.view = view
        self.kind = view.kind
        self.name = view.name

    @property
    def total(self) -> int | None:
        return self.view.total

    @property
    def nbytes(self) -> int:
        return self.view.nbytes

    def describe(self) -> dict[str, Any]:
        with file_errors(self.name, f"its {self.kind} structure cannot be shown"):
            return self.view.describe()

    def fields(self) -> list[str] | None:
        with file_errors(self.name, "its fields cannot be read"):
            return self.view.fields()

    def rows(self, start: int, columns: list[str] | None) -> Iterator[tuple[int, Any]]:
        rows = self.view.rows(start, columns)
        at = start
        while True:
            with file_errors(self.name, f"row {at} cannot be read as {self.kind}"):
                try:
                    index, value = next(rows)
                except StopIteration:
                    return
            yield index, value
            at = index + 1


def _past_end(name: str, start: int, total: int | None) -> InvalidRequestError:
    return InvalidRequestError(
        f"row {start} of {name}, which holds {total} rows: ask for a start below that"
    )


def _split_name(name: str) -> tuple[str, str]:
    backend, _, key = name.partition("/")
    return backend, key


class _Pinned:
    """Reads of one object version through the client (a changed object raises)."""

    def __init__(self, client: Client, stat: ObjectStat) -> None:
        self.client = client
        self.stat = stat

    def __call__(self, offset: int, length: int) -> memoryview:
        if length <= 0 or offset >= self.stat.size:
            return memoryview(b"")
        return self.client.read(self.stat.name, offset, length, version=self.stat.version)


# -- Parquet -----------------------------------------------------------------------------

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

    def __init__(self, read: _Pinned, pieces: list[tuple[int, memoryview]]) -> None:
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
        self._read = _Pinned(client, stat)
        self._stat = stat
        backend, key = _split_name(stat.name)
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
            raise _past_end(self.name, start, total)
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


# -- lines -------------------------------------------------------------------------------


class LinesView:
    """Text or JSON lines, paged by line (see :mod:`chunkd.client.inspect.lines`)."""

    def __init__(self, client: Client, stat: ObjectStat, kind: str) -> None:
        self.kind = kind
        self.name = stat.name
        self._stat = stat
        self._read = _Pinned(client, stat)
        self.index = LineIndex(stat.name, stat.size, self._read)
        head = bytes(self._read(0, HEAD_BYTES))
        self.encoding = _encoding(head)
        if stat.size <= _COUNT_LINES_BYTES:
            self.index.scan()

    @property
    def total(self) -> int | None:
        return self.index.lines

    @property
    def nbytes(self) -> int:
        return 256 + self.index.nbytes

    def describe(self) -> dict[str, Any]:
        return {"lines": self.index.lines, "encoding": self.encoding}

    def fields(self) -> list[str] | None:
        if self.kind != "jsonl":
            return None
        found: dict[str, None] = {}
        try:
            for _, _, line in _first(self.index.lines_from(0), _FIELD_LINES):
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue
                if isinstance(doc, dict):
                    found.update(dict.fromkeys(doc))
        except InvalidRequestError:
            return None  # an empty object, or a first line too long
        return list(found) or None

    def rows(self, start: int, columns: list[str] | None) -> Iterator[tuple[int, Any]]:
        for number, offset, line in self.index.lines_from(start):
            if self.kind == "text":
                yield number, line.decode("utf-8", "replace")
                continue
            yield number, _select(_json_line(self.name, number, offset, line), columns)


def _json_line(name: str, number: int, offset: int, line: bytes) -> Any:
    """Line ``number`` (at byte ``offset``; -1: unknown) of ``name``, parsed and encoded."""
    where = f"line {number}" + (f" (at byte {offset})" if offset >= 0 else "")
    try:
        value = json.loads(line)
    except RecursionError:
        raise MalformedFileError(
            f"{name}: {where} holds a value nested too deep to read, past the {MAX_DEPTH} "
            "levels the inspector shows; open it with format=text to see it as it is"
        ) from None
    except ValueError as exc:
        raise MalformedFileError(
            f"{name}: {where} is not JSON ({exc}); open it with format=text to see it as it is"
        ) from None
    try:
        return encode(value)
    except MalformedFileError as exc:
        raise MalformedFileError(f"{name}: {where} {exc}") from None


def _select(value: Any, columns: list[str] | None) -> Any:
    if columns is None or not isinstance(value, dict):
        return value
    return {k: v for k, v in value.items() if k in columns}


def _encoding(head: bytes) -> str:
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not merely a character cut at the end of the head
            return "utf-8 (invalid bytes shown as U+FFFD)"
    return "utf-8"


def _first(items: Iterator[Any], n: int) -> Iterator[Any]:
    for i, item in enumerate(items):
        if i >= n:
            return
        yield item


class ZstdLinesView:
    """A ``.jsonl.zst`` object, read by the dataset code's JSON lines format (its scan
    decompresses the object once, to index its lines)."""

    kind = "jsonl"

    def __init__(self, client: Client, stat: ObjectStat) -> None:
        from chunkd.client.datasets.formats import format_of

        self.name = stat.name
        backend, key = _split_name(stat.name)
        self._source = PinnedSource(client, backend)
        self._format = format_of("jsonl")
        try:
            self._member = self._format.scan(
                self._source, Member(key, stat.size, stat.version, "jsonl"), {}
            )
        except DatasetFormatError as exc:
            raise malformed(exc) from None

    @property
    def total(self) -> int | None:
        return self._member.samples

    @property
    def nbytes(self) -> int:
        return 256 + 64 * len(self._member.meta.get("index", ()))

    def describe(self) -> dict[str, Any]:
        return {"lines": self._member.samples, "encoding": "utf-8", "compression": "zstd"}

    def fields(self) -> list[str] | None:
        found: dict[str, None] = {}
        for i in range(min(_FIELD_LINES, self._member.samples)):
            try:
                doc = json.loads(self._line(i))
            except (ValueError, MalformedFileError):
                continue
            if isinstance(doc, dict):
                found.update(dict.fromkeys(doc))
        return list(found) or None

    def _line(self, i: int) -> bytes:
        try:
            line: bytes = self._format.read(self._source, self._member, i)
        except DatasetFormatError as exc:
            raise malformed(exc) from None
        return line

    def rows(self, start: int, columns: list[str] | None) -> Iterator[tuple[int, Any]]:
        if not 0 <= start < self._member.samples:
            raise _past_end(self.name, start, self._member.samples)
        for i in range(start, self._member.samples):
            # the offset of a line in a compressed object is of its decompressed bytes
            yield i, _select(_json_line(self.name, i, -1, self._line(i)), columns)


# -- WebDataset --------------------------------------------------------------------------


class TarView:
    """A WebDataset tar: one sample per key, its files as ranges of the tar."""

    kind = "wds"

    def __init__(self, client: Client, stat: ObjectStat) -> None:
        from chunkd.client.datasets.formats import wds

        self.name = stat.name
        self._read = _Pinned(client, stat)
        backend, key = _split_name(stat.name)
        source = PinnedSource(client, backend)
        member = Member(key, stat.size, stat.version, "wds")
        self._split = wds.split_name
        # The dataset format's header walk, taken only as far as the pages asked for: a
        # tar's headers lie all along it, and reading them is reading the tar.
        self._walk = wds._files(source, member)
        self.index: list[list[Any]] = []
        self._exts: set[str] = set()
        self.walked = False  # every header read
        self.bounded = False  # stopped at MAX_TAR_SAMPLES
        self._grow(_TAR_FIRST_PAGE)

    def _grow(self, upto: int) -> None:
        """Index samples until sample ``upto`` is whole (the next one has begun), the
        tar ends, or :data:`MAX_TAR_SAMPLES` are indexed."""
        while not (self.walked or self.bounded) and len(self.index) <= upto + 1:
            try:
                path, offset, size = next(self._walk)
            except StopIteration:
                self.walked = True
                break
            except DatasetFormatError as exc:
                raise malformed(exc) from None
            parts = self._split(path)
            if parts is None:
                continue
            name, ext = parts
            current = self.index[-1] if self.index else None
            if current is None or name != current[0] or ext in self._exts:
                if len(self.index) >= MAX_TAR_SAMPLES:
                    self.bounded = True
                    break
                current = [name, []]
                self._exts = set()
                self.index.append(current)
            current[1].append((ext, offset, size))
            self._exts.add(ext)

    def _whole(self) -> int:
        """How many samples are indexed whole."""
        done = self.walked or self.bounded
        return len(self.index) if done else max(0, len(self.index) - 1)

    @property
    def total(self) -> int | None:
        return len(self.index) if self.walked else None

    @property
    def nbytes(self) -> int:
        return 256 + sum(120 + 100 * len(files) for _, files in self.index)

    def fields(self) -> list[str] | None:
        found: dict[str, None] = {}
        for _, files in self.index[:_FIELD_LINES]:
            found.update(dict.fromkeys(ext for ext, _, _ in files))
        return list(found) or None

    def describe(self) -> dict[str, Any]:
        samples = []
        for i, (key, files) in enumerate(self.index[: min(_TAR_FIRST_PAGE, self._whole())]):
            members = []
            for ext, offset, size in files:
                head = bytes(self._read(offset, min(size, SNIFF_BYTES)))
                members.append(
                    {"ext": ext, "offset": offset, "length": size, "media_type": sniff(head)}
                )
            samples.append({"key": key, "index": i, "members": members})
        return {
            "samples_total": self.total,
            "samples_indexed": len(self.index),
            "samples": samples,
        }

    def rows(self, start: int, columns: list[str] | None) -> Iterator[tuple[int, Any]]:
        self._grow(start)
        if not 0 <= start < self._whole():
            if self.bounded and start >= len(self.index):
                raise InvalidRequestError(
                    f"sample {start} of {self.name}: the inspector indexes a tar's first "
                    f"{MAX_TAR_SAMPLES} samples only; split the tar, or register it as a dataset"
                )
            raise _past_end(self.name, start, len(self.index))
        i = start
        cells = AudioCells()  # this page's audio headers
        while True:
            self._grow(i)
            if i >= self._whole():
                return
            key, files = self.index[i]
            value: dict[str, Any] = {"__key__": key}
            for ext, offset, size in files:
                if columns is None or ext in columns:
                    value[ext] = tar_file(self._read, self.name, ext, offset, size, cells)
            yield i, value
            i += 1


# -- MDS ---------------------------------------------------------------------------------


class MdsView:
    """An MDS shard, read by the dataset code's MDS format with the ``index.json``
    beside it (or one folder up)."""

    kind = "mds"

    def __init__(self, client: Client, stat: ObjectStat) -> None:
        from chunkd.client.datasets.formats import format_of

        self.name = stat.name
        backend, key = _split_name(stat.name)
        self._source = PinnedSource(client, backend)
        self._format = format_of("mds")
        found = _mds_index(client, backend, key)
        if found is None:
            raise MalformedFileError(
                f"{stat.name}: an MDS shard is read with its dataset's index.json, and none "
                "lies beside it (or one folder up); open it as binary, or register its folder"
            )
        index_name, index, basename = found
        _check_mds_index(index_name, index, basename)
        self.index_name = index_name
        folder = posixpath.dirname(index_name.partition("/")[2])
        self.shards = [
            {
                "name": f"{backend}/{posixpath.join(folder, _basename(s))}",
                "samples": _whole_or_none(s.get("samples")),
            }
            for s in index["shards"][:1000]
            if isinstance(s, dict)
        ]
        member = Member(key, stat.size, stat.version, "mds")
        try:
            self._member = self._format.scan(
                self._source, member, {"mds_index": index, "mds_basename": basename}
            )
        except DatasetFormatError as exc:
            raise malformed(exc) from None

    @property
    def total(self) -> int | None:
        return self._member.samples

    @property
    def nbytes(self) -> int:
        return 4096 + 16 * len(self._member.meta.get("offsets", ()))

    def fields(self) -> list[str] | None:
        return [str(c[0]) for c in self._member.meta["columns"]]

    def describe(self) -> dict[str, Any]:
        return {
            "samples_total": self._member.samples,
            "columns": [
                {"name": str(c[0]), "encoding": str(c[1])} for c in self._member.meta["columns"]
            ],
            "shards": self.shards,
            "index": self.index_name,
            "compression": self._member.meta.get("compression"),
        }

    def rows(self, start: int, columns: list[str] | None) -> Iterator[tuple[int, Any]]:
        if not 0 <= start < self._member.samples:
            raise _past_end(self.name, start, self._member.samples)
        for i in range(start, self._member.samples):
            try:
                sample = self._format.read(self._source, self._member, i)
            except DatasetFormatError as exc:
                raise malformed(exc) from None
            yield i, encode(_select(sample, columns), {"sample": f"{self.name}#{i}"})


def _basename(entry: dict[str, Any]) -> str:
    zipped = entry.get("zip_data") or {}
    raw = entry.get("raw_data") or {}
    return str(zipped.get("basename") or raw.get("basename") or "")


def _whole_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _check_mds_index(name: str, index: dict[str, Any], basename: str) -> None:
    """Refuse an ``index.json`` whose parts the MDS reader takes are of the wrong type:
    ``shards`` a list, each shard's ``raw_data`` and ``zip_data`` objects (or null), and
    the shard's own ``column_sizes`` whole numbers (or null).

    Raises:
        MalformedFileError: naming ``name`` and the part.
    """
    shards = index.get("shards")
    if not isinstance(shards, list):
        raise MalformedFileError(
            f"{name}: its 'shards' is {_json_type(shards)}, not a list of shard entries: it "
            "is not an MDS index; write the dataset again"
        )
    for i, entry in enumerate(shards):
        if not isinstance(entry, dict):
            continue
        for part in ("raw_data", "zip_data"):
            found = entry.get(part)
            if found is not None and not isinstance(found, dict):
                raise MalformedFileError(
                    f"{name}: shard {i}'s {part} is {_json_type(found)}, not an object "
                    "with basename, bytes and hashes: the index is damaged"
                )
            if isinstance(found, dict) and not isinstance(found.get("basename", ""), str):
                raise MalformedFileError(f"{name}: shard {i}'s {part}.basename is not text")
        names = [(entry.get(part) or {}).get("basename") for part in ("raw_data", "zip_data")]
        if basename not in names:
            continue
        sizes = entry.get("column_sizes")
        for size in sizes if isinstance(sizes, list) else ():
            if size is not None and (_whole_or_none(size) is None or size < 0):
                raise MalformedFileError(
                    f"{name}: shard {i}'s column_sizes holds {json.dumps(size)[:40]}, not a "
                    "size in bytes (a whole number, or null for a column of varying size)"
                )


def _json_type(value: Any) -> str:
    """What JSON calls the type of ``value``, with an article."""
    if value is None:
        return "null"
    for kind, name in ((bool, "a boolean"), (int, "a number"), (float, "a number"),
                       (str, "a string"), (list, "a list"), (dict, "an object")):  # fmt: skip
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _mds_index(client: Client, backend: str, key: str) -> tuple[str, dict[str, Any], str] | None:
    """The ``index.json`` that lists the shard ``key``: its name, its contents and the
    shard's basename in it (the path from the index's folder)."""
    folder = posixpath.dirname(key)
    for _ in range(2):
        index_key = posixpath.join(folder, "index.json") if folder else "index.json"
        name = f"{backend}/{index_key}"
        try:
            stat = client.stat(name)
        except FileNotFoundError:
            stat = None
        if stat is not None:
            if stat.size > _MAX_INDEX_JSON:
                raise MalformedFileError(
                    f"{name} is {stat.size} bytes, more than the {_MAX_INDEX_JSON} an MDS "
                    "index.json may be here"
                )
            try:
                doc = json.loads(bytes(client.read(name, 0, stat.size)) if stat.size else b"")
            except ValueError as exc:
                raise MalformedFileError(f"{name} is not JSON ({exc})") from None
            basename = key[len(folder) + 1 :] if folder else key
            if isinstance(doc, dict):
                return name, doc, basename
        if not folder:
            return None
        folder = posixpath.dirname(folder)
    return None


# -- media and binary --------------------------------------------------------------------


class MediaView:
    """An image, audio or video object: the browser decodes it from ranges."""

    def __init__(
        self, stat: ObjectStat, kind: str, media_type: str | None, read: _Pinned | None = None
    ) -> None:
        self.kind = kind
        self.name = stat.name
        self._stat = stat
        self.media_type = media_type
        self._read = read
        self._audio: dict[str, Any] | None = None

    total = 1
    nbytes = 256

    def fields(self) -> list[str] | None:
        return None

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"media": self._media()}
        if self.kind == "audio":
            # its duration, rate and channels from its headers: a few small reads
            if self._audio is None and self._read is not None:
                read = self._read
                self._audio = (
                    audio_info(lambda o, n: bytes(read(o, n)), self._stat.size, self.media_type)
                    or {}
                )
            out["audio"] = self._audio or None
        return out

    def _media(self) -> dict[str, Any]:
        return media(self.name, 0, self._stat.size, self.media_type)

    def rows(self, start: int, columns: list[str] | None) -> Iterator[tuple[int, Any]]:
        if start != 0:
            raise _past_end(self.name, start, 1)
        yield 0, self._media()


class BinaryView:
    """Any other object: its first bytes, as hex and as text."""

    kind = "binary"

    def __init__(self, stat: ObjectStat, head: bytes) -> None:
        self.name = stat.name
        self._head = head

    total = None
    nbytes = 256 + HEAD_BYTES

    def fields(self) -> list[str] | None:
        return None

    def describe(self) -> dict[str, Any]:
        return {
            "head_bytes": len(self._head),
            "hex": self._head.hex(),
            "text": self._head.decode("utf-8", "replace"),
        }

    def rows(self, start: int, columns: list[str] | None) -> Iterator[tuple[int, Any]]:
        raise InvalidRequestError(
            f"{self.name} is opened as binary, which has no rows: open it with a format "
            f"({', '.join(FORMATS[:-1])}), or fetch its bytes as media"
        )


# -- detection and the views' cache ------------------------------------------------------


def detect_format(key: str, head: bytes) -> str:
    """The format of an object from its key and its first bytes."""
    by_key = detect(key)
    if by_key is not None:
        return by_key
    found = kind_of(sniff(head))
    if found is not None:
        return found
    if head.startswith(b"PAR1"):
        return "parquet"
    if len(head) >= 263 and head[257:262] == b"ustar":
        return "wds"
    if key.lower().endswith(_TEXT_SUFFIXES):
        return "text"
    if b"\0" in head:
        return "binary"
    if _encoding(head) != "utf-8":
        return "binary"
    first = head.split(b"\n", 1)[0].strip()
    if first.startswith(b"{") and b"\n" in head:
        try:
            json.loads(first)
        except ValueError:
            return "text"
        return "jsonl"
    return "text"


class Views:
    """The views a worker has open, by object version and format: an LRU bounded by
    count (:data:`VIEWS`) and by their bytes.

    Args:
        client: the worker's client.
        max_bytes: the most bytes of views kept.
    """

    def __init__(self, client: Client, max_bytes: int = 256 << 20) -> None:
        self.client = client
        self.max_bytes = max_bytes
        self._views: OrderedDict[tuple[str, str, str], View] = OrderedDict()

    def clear(self) -> None:
        """Drop every view (and the decoded row groups)."""
        self._views.clear()
        _ROW_GROUPS.clear()

    def open(self, name: str, fmt: str | None = None) -> tuple[View, ObjectStat, str | None]:
        """The view of ``name``'s current version as ``fmt`` (detected: None), its stat,
        and the media type its first bytes have.

        Raises:
            InvalidRequestError: ``fmt`` is not one of :data:`FORMATS`.
            MalformedFileError: the object cannot be read as the format.
            ObjectNotFoundError, UnknownBackendError, InvalidKeyError: as the client has them.
        """
        if fmt is not None and fmt not in FORMATS:
            raise InvalidRequestError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
        stat = self.client.stat(name)
        head = (
            bytes(self.client.read(name, 0, HEAD_BYTES, version=stat.version)) if stat.size else b""
        )
        media_type = sniff(head)
        chosen = fmt or detect_format(_split_name(name)[1], head)
        key = (name, stat.version, chosen)
        view = self._views.get(key)
        if view is None:
            with file_errors(name, f"it cannot be opened as {chosen}"):
                view = self._make(stat, chosen, head, media_type)
            self._views[key] = view
            self._trim()
        else:
            self._views.move_to_end(key)
        return _Guarded(view), stat, media_type

    def _make(self, stat: ObjectStat, fmt: str, head: bytes, media_type: str | None) -> View:
        makers: dict[str, Callable[[], View]] = {
            "parquet": lambda: ParquetView(self.client, stat),
            "jsonl": lambda: (
                ZstdLinesView(self.client, stat)
                if stat.name.lower().endswith((".zst", ".zstd"))
                else LinesView(self.client, stat, "jsonl")
            ),
            "text": lambda: LinesView(self.client, stat, "text"),
            "wds": lambda: TarView(self.client, stat),
            "mds": lambda: MdsView(self.client, stat),
            "binary": lambda: BinaryView(stat, head),
        }
        maker = makers.get(fmt)
        if maker is None:  # image, audio, video
            return MediaView(stat, fmt, media_type, _Pinned(self.client, stat))
        try:
            return maker()
        except DatasetFormatError as exc:
            raise malformed(exc) from None

    def _trim(self) -> None:
        total = sum(v.nbytes for v in self._views.values())
        while len(self._views) > VIEWS or (total > self.max_bytes and len(self._views) > 1):
            _, dropped = self._views.popitem(last=False)
            total -= dropped.nbytes
