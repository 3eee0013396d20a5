"""Batches as columns: a batch's rows taken from its decoded units by index.

A reader's batch names ``(member, sample)`` pairs (the order's positions); each lies in
one unit of its member, whose Arrow table :class:`~chunkd.client.datasets.units.Units`
gets (held, mapped from the daemon, or decoded; decoded ahead).

:func:`take` assembles a batch from the unit tables with Arrow's ``take`` over their
concatenation: no Python per row. A :class:`Rows` is the result: the batch's table, and
its samples and columns built on first use (:class:`~chunkd.client.datasets.loader.Batch`).
A :class:`Window` lays out a window's columns once, so that each batch of it takes a
column with one gather (:func:`take_laid`); :func:`arrays` gives a table's columns as a
trainer takes them. ``Units`` and ``DECODE_THREADS`` are importable from here too.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Final

import numpy as np
from numpy.typing import NDArray

from chunkd.client.datasets.units import (
    DECODE_THREADS,
    UnitKey,
    Units,
    _chunk,
    _numeric,
    _pyarrow,
    numpy_view,
)
from chunkd.errors import DatasetFormatError

if TYPE_CHECKING:
    from chunkd.client.datasets.epoch import EpochOrder
    from chunkd.client.datasets.formats import Format

__all__ = [
    "DECODE_THREADS",
    "WINDOW_BYTES",
    "Rows",
    "Units",
    "Window",
    "Windows",
    "arrays",
    "numpy_view",
    "take",
    "take_laid",
]

#: the most bytes of a window's columns a reader lays out (:class:`Window`); it keeps
#: two windows
WINDOW_BYTES: Final = 64 << 20


class Rows:
    """A batch's rows, taken from decoded units: its Arrow ``table`` and, built on first
    use, its per-sample values (:attr:`samples`) and its columns (:attr:`columns`).

    Args:
        table: the batch's rows, one per sample, in the batch's order (None where the
            batch mixes formats whose tables cannot be one, or where ``schema`` and
            ``numpy`` make it when first asked for).
        formats: each row's format, where they differ (else one entry).
        pieces: for a mixed batch, each row's ``(unit table, row)``.
        numpy: columns already gathered into numpy arrays of the batch's own (or views).
        schema: the table's schema, where ``numpy`` holds every column and the table is
            made from them only if asked for.
    """

    __slots__ = ("_columns", "_numpy", "_pieces", "_samples", "_schema", "_table", "formats")

    def __init__(
        self,
        table: Any,
        formats: list[Format],
        pieces: list[tuple[Any, int]] | None = None,
        *,
        numpy: dict[str, Any] | None = None,
        schema: Any = None,
    ) -> None:
        self._table = table
        self._schema = schema
        self.formats = formats
        self._pieces = pieces
        self._numpy = numpy
        self._samples: list[Any] | None = None
        self._columns: dict[str, Any] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # Sent to another process (from a DataLoader or Grain worker): the rows alone, as
        # Arrow IPC, which holds only a slice's own bytes (pickling a slice of a unit
        # sends the whole unit's buffers).
        pieces = None
        if self._pieces is not None:
            pieces = [(_ipc(t.slice(r, 1)), 0) for t, r in self._pieces]
        table = None if self._table is None else _ipc(self._table)
        return (_rows_from, (table, self.formats, pieces, self._numpy, self._schema))

    @property
    def table(self) -> Any:
        """The rows as one ``pyarrow.Table`` (None for a batch across formats)."""
        if self._table is None and self._schema is not None and self._numpy is not None:
            pa = _pyarrow()
            self._table = pa.table(
                [_from_numpy(pa, f.type, self._numpy[f.name]) for f in self._schema],
                schema=self._schema,
            )
        return self._table

    def __len__(self) -> int:
        if self._table is None and self._numpy and self._schema is not None:
            return len(next(iter(self._numpy.values())))
        table = self.table
        return int(table.num_rows) if table is not None else len(self._pieces or ())

    @property
    def samples(self) -> list[Any]:
        """The per-sample values, as ``Dataset[i]`` gives them."""
        if self._samples is None:
            table = self.table
            if table is not None:
                fmt = self.formats[0]
                self._samples = [fmt.sample(table, row) for row in range(len(self))]
            else:
                pieces = self._pieces or []
                fmts = self.formats
                self._samples = [fmts[i].sample(t, r) for i, (t, r) in enumerate(pieces)]
        return self._samples

    @property
    def columns(self) -> dict[str, Any]:
        """The batch's columns (:func:`arrays`; those gathered into numpy as they are)."""
        if self._columns is None:
            if self._schema is not None and self._numpy is not None:
                self._columns = {f.name: self._numpy[f.name] for f in self._schema}
                return self._columns
            table = self.table
            if table is None:
                raise DatasetFormatError(
                    "this batch mixes members of formats whose columns are not one table "
                    f"({', '.join(sorted({f.name for f in self.formats}))}): read its "
                    "samples, or register the formats as separate datasets"
                )
            numpy = self._numpy or {}
            # gathered into arrays of the batch's own: those as they are, the rest converted
            rest = table.drop_columns(list(numpy)) if numpy else table
            found = arrays(rest)
            self._columns = {
                name: numpy[name] if name in numpy else found[name] for name in table.column_names
            }
        return self._columns


def _ipc(table: Any) -> bytes:
    pa = _pyarrow()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data: bytes = sink.getvalue().to_pybytes()
    return data


def _table_of(data: bytes) -> Any:
    pa = _pyarrow()
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def _rows_from(
    table: bytes | None,
    formats: list[Format],
    pieces: list[tuple[bytes, int]] | None,
    numpy: dict[str, Any] | None,
    schema: Any,
) -> Rows:
    return Rows(
        None if table is None else _table_of(table),
        formats,
        None if pieces is None else [(_table_of(t), r) for t, r in pieces],
        numpy=numpy,
        schema=schema,
    )


class Window:
    """One window of a reader's order (:meth:`EpochOrder.locate_windows
    <chunkd.client.datasets.order.EpochOrder.locate_windows>`) with its columns laid out
    once: each the column of the window's units, unit after unit in the units' order
    (a copy: a numpy array for a fixed-width column without nulls, one Arrow array for
    any other), so that a batch of the window takes a column with one gather or one
    ``take``, where unit by unit it costs one a unit. At most :data:`WINDOW_BYTES` of a
    window's columns are laid out; the others are taken unit by unit.

    Args:
        units: the reader's decoded units (the window's are all got to lay it out).
        keys: the window's units, in the units' order.
    """

    def __init__(self, units: Units, keys: list[UnitKey]) -> None:
        self.units = units
        self.keys = keys
        self.bytes = 0
        self._columns: dict[int, Any] = {}
        self._uniform: bool | None = None
        self._schema: Any = None

    def whole(self) -> tuple[Format, Any, list[Any]] | None:
        """The window's format, schema and every column laid out, or None where some
        column is not (then a batch takes those unit by unit)."""
        tables = self._tables()
        if tables is None:
            return None
        laid = [self.column(c) for c in range(len(self._schema))]
        if any(column is None for column in laid):
            return None
        return self.units.format(self.keys[0][0]), self._schema, laid

    def _tables(self) -> list[Any] | None:
        """The window's unit tables, where they are of one format and schema."""
        if self._uniform is False:
            return None
        tables = [self.units.get(key) for key in self.keys]
        if self._uniform is None:
            schema = tables[0].schema
            names = {self.units.format(m).name for m, _ in self.keys}
            self._uniform = len(names) == 1 and all(t.schema.equals(schema) for t in tables)
            self._schema = schema
        return tables if self._uniform else None

    def column(self, c: int) -> Any:
        """Column ``c`` laid out (made on first use): a numpy array, an Arrow array, or
        None where it cannot be (the units' schemas or formats differ, or the window's
        bound is spent).

        Raises:
            DatasetFormatError: a unit's column is not its manifest's row count long.
        """
        if c in self._columns:
            return self._columns[c]
        tables = self._tables()
        found = None if tables is None else self._lay(c, tables)
        self._columns[c] = found
        return found

    def _lay(self, c: int, tables: list[Any]) -> Any:
        views = [self.units.view(key, t, c) for key, t in zip(self.keys, tables, strict=True)]
        whole = [v for v in views if v is not None]
        if len(whole) == len(views) and len({(v.dtype, v.shape[1:]) for v in whole}) == 1:
            lengths = [len(v) for v in whole]
            size = sum(v.nbytes for v in whole)
            if self.bytes + size > WINDOW_BYTES:
                return None
            self._check(lengths)
            found: Any = np.concatenate(whole)
            found.flags.writeable = False  # every batch of the window takes from it
        else:  # strings, lists, nested, nulls: one Arrow array of the units' columns
            pa = _pyarrow()
            pieces = [_chunk(pa, t.column(c)) for t in tables]
            size = sum(int(p.nbytes) for p in pieces)
            if self.bytes + size > WINDOW_BYTES:
                return None
            self._check([len(p) for p in pieces])
            found = pa.concat_arrays(pieces)
        self.bytes += size
        return found

    def _check(self, lengths: list[int]) -> None:
        for key, length in zip(self.keys, lengths, strict=True):
            rows = self.units.rows(key)
            if length != rows:  # a place in the window would name another row
                member = self.units.snapshot.members[key[0]]
                raise DatasetFormatError(
                    f"unit {key[1]} of {member.key} decoded to {length} rows; its "
                    f"manifest says {rows}: the member is not what was registered"
                )


class Windows:
    """A reader's laid-out windows (:class:`Window`): the last two (a step may cross
    from one window to the next), each laid out only if its units fit what the reader
    holds (``held_bytes``)."""

    def __init__(self, units: Units, order: EpochOrder) -> None:
        self.units = units
        self.order = order
        self._windows: OrderedDict[int, Window | None] = OrderedDict()

    def window(self, w: int) -> Window | None:
        """Window ``w``, or None where its units do not fit what the reader holds."""
        if w in self._windows:
            self._windows.move_to_end(w)
            return self._windows[w]
        keys = self.order.window_keys(w)
        fits = sum(self.units.unit_bytes(k) for k in keys) <= self.units.held_bytes
        window = Window(self.units, keys) if fits and keys else None
        self._windows[w] = window
        while len(self._windows) > 2:
            self._windows.popitem(last=False)
        return window


def take_laid(window: Window, at: NDArray[np.int64]) -> Rows | None:
    """The rows at places ``at`` of a window whose every column is laid out: one gather
    or ``take`` a column, no unit touched (None where some column is not laid out)."""
    whole = window.whole()
    if whole is None:
        return None
    fmt, kinds, laid = whole
    run = _contiguous(at, 1 << 62)  # an unshuffled run: read-only views, no copy
    gathered: dict[str, Any] = {}
    taken: dict[str, Any] = {}
    pa = _pyarrow()
    for field, column in zip(kinds, laid, strict=True):
        if isinstance(column, np.ndarray):
            gathered[field.name] = column[int(at[0]) : int(at[0]) + len(at)] if run else column[at]
        elif run:
            taken[field.name] = column.slice(int(at[0]), len(at))
        else:
            taken[field.name] = column.take(pa.array(at, type=pa.int64()))
    if not taken:
        return Rows(None, [fmt], numpy=gathered, schema=kinds)
    arrays = [
        _from_numpy(pa, f.type, gathered[f.name]) if f.name in gathered else taken[f.name]
        for f in kinds
    ]
    return Rows(pa.table(arrays, schema=kinds), [fmt], numpy=gathered)


def take(
    units: Units,
    members: NDArray[np.int64],
    samples: NDArray[np.int64],
    located: tuple[NDArray[np.int64], NDArray[np.int64]] | None = None,
    window: tuple[Window, NDArray[np.int64]] | None = None,
) -> Rows:
    """The rows of ``(members[i], samples[i])``, in that order, from their decoded units
    (``located``: their units and rows, :meth:`Units.locate`, where known; ``window``:
    the one window they all are of, with their places in it, whose laid-out columns
    serve them)."""
    if window is not None:
        whole = take_laid(*window)
        if whole is not None:
            return whole
    unit_of, row_of = located if located is not None else units.locate(members, samples)
    # one number a unit (member and unit side by side), and each row's unit among them
    codes, which = np.unique((members << 32) | unit_of, return_inverse=True)
    keys = [(int(c >> 32), int(c & 0xFFFFFFFF)) for c in codes]
    tables = [units.get(key) for key in keys]
    formats = [units.format(m) for m, _ in keys]
    pa = _pyarrow()
    if len({f.name for f in formats}) > 1:  # a batch across formats: rows of each unit's table
        return Rows(
            None,
            [formats[i] for i in which.tolist()],
            [(tables[i], r) for i, r in zip(which.tolist(), row_of.tolist(), strict=True)],
        )
    if len(tables) == 1:
        table = tables[0]
        if _contiguous(row_of, table.num_rows):  # an unshuffled run: a slice, no copy
            return Rows(table.slice(int(row_of[0]), len(row_of)), formats[:1])
        return Rows(table.take(pa.array(row_of, type=pa.int64())), formats[:1])
    schema = tables[0].schema
    if any(not t.schema.equals(schema) for t in tables[1:]):
        return Rows(_take_combined(pa, tables, which, row_of), formats[:1])
    by_unit = _ByUnit(units, keys, tables, which, row_of)
    columns: dict[str, Any] = {}
    gathered: dict[str, Any] = {}
    for c, field in enumerate(schema):
        laid = None if window is None else window[0].column(c)
        if laid is not None and window is not None and not isinstance(laid, np.ndarray):
            columns[field.name] = laid.take(pa.array(window[1], type=pa.int64()))
            continue
        out = by_unit.gather(c) if laid is None or window is None else laid[window[1]]
        if out is not None:
            gathered[field.name] = out
            columns[field.name] = _from_numpy(pa, field.type, out)
        else:
            columns[field.name] = by_unit.take(pa, c)
    return Rows(pa.table(columns), formats[:1], numpy=gathered)


class _ByUnit:
    """A batch's rows grouped by unit, for the columns taken unit by unit: numpy gathers
    for fixed-width columns, Arrow takes for the rest (Arrow's take over many chunks
    concatenates them first: a copy of every unit's column, each batch, where a take of
    each unit's rows costs only the rows)."""

    def __init__(
        self,
        units: Units,
        keys: list[UnitKey],
        tables: list[Any],
        which: NDArray[np.int64],
        row_of: NDArray[np.int64],
    ) -> None:
        self.units = units
        self.keys = keys
        self.tables = tables
        self.count = len(row_of)
        self.order = np.argsort(which, kind="stable")
        bounds = np.searchsorted(which[self.order], np.arange(len(tables) + 1))
        self.picks = [self.order[bounds[u] : bounds[u + 1]] for u in range(len(tables))]
        self.rows = [row_of[pick] for pick in self.picks]

    def gather(self, c: int) -> NDArray[Any] | None:
        """Column ``c`` gathered into an array of the batch's own, or None where it is
        not of fixed width in every unit."""
        found = [self.units.view(k, t, c) for k, t in zip(self.keys, self.tables, strict=True)]
        views = [v for v in found if v is not None]
        if len(views) != len(found) or len({(v.dtype, v.shape[1:]) for v in views}) != 1:
            return None
        out = np.empty((self.count, *views[0].shape[1:]), dtype=views[0].dtype)
        for view, pick, r in zip(views, self.picks, self.rows, strict=True):
            out[pick] = view[r]
        return out

    def take(self, pa: Any, c: int) -> Any:
        """Column ``c`` taken by Arrow, unit by unit, in the batch's order."""
        pieces = [
            _chunk(pa, table.column(c)).take(pa.array(r, type=pa.int64()))
            for table, r in zip(self.tables, self.rows, strict=True)
        ]
        return pa.concat_arrays(pieces).take(pa.array(np.argsort(self.order)))


def _take_combined(pa: Any, tables: list[Any], which: Any, row_of: Any) -> Any:
    """The rows of units whose schemas differ: their tables combined (missing columns
    null, types widened), one ``take`` over them."""
    try:
        whole = pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise DatasetFormatError(
            f"the units of one batch have schemas that do not combine ({exc}): the "
            "members' schemas differ; check the dataset (chunkd dataset check)"
        ) from None
    starts = np.zeros(len(tables) + 1, dtype=np.int64)
    np.cumsum([t.num_rows for t in tables], out=starts[1:])
    return whole.take(pa.array(starts[which] + row_of, type=pa.int64()))


def _from_numpy(pa: Any, kind: Any, values: NDArray[Any]) -> Any:
    """An Arrow array of ``kind`` over ``values`` (no copy)."""
    return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(values)])


def _contiguous(index: NDArray[np.int64], total: int) -> bool:
    """Whether ``index`` is ``k, k+1, ...`` (an unshuffled run: a slice, no copy)."""
    return bool(len(index)) and bool(np.all(np.diff(index) == 1)) and int(index[-1]) < total


def arrays(table: Any) -> dict[str, Any]:
    """A table's columns as a trainer takes them (``docs/datasets.md``, "Columns").

    - integers, floats, booleans, timestamps and durations without nulls: numpy arrays,
      read-only views of the batch's buffers where the type allows (a boolean is
      unpacked: a copy);
    - fixed-size binary (the ``fixed`` format's records) and fixed-size lists of such
      numbers without nulls: 2-D numpy arrays ``[rows, width]``, read-only views;
    - dictionary-encoded columns: decoded first, then as their value type;
    - everything else (strings, binary, lists, structs, maps, decimals, dates, times)
      and any column with nulls: a ``pyarrow.Array`` (one chunk).
    """
    pa = _pyarrow()
    found: dict[str, Any] = {}
    for name, column in zip(table.column_names, table.columns, strict=True):
        array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
        if pa.types.is_dictionary(array.type):
            array = array.dictionary_decode()
        found[name] = _numpy(pa, array)
    return found


def _numpy(pa: Any, array: Any) -> Any:
    kind = array.type
    if array.null_count:
        return array
    if pa.types.is_fixed_size_binary(kind):
        width = kind.byte_width
        data = np.frombuffer(array.buffers()[1], dtype=np.uint8)
        start = array.offset * width
        return data[start : start + len(array) * width].reshape(len(array), width)
    if pa.types.is_fixed_size_list(kind):
        values = array.flatten()
        if values.null_count or not _numeric(pa, values.type):
            return array
        return values.to_numpy(zero_copy_only=False).reshape(len(array), kind.list_size)
    if _numeric(pa, kind) or pa.types.is_boolean(kind):
        return array.to_numpy(zero_copy_only=False)
    return array
