"""Member formats: how a member's metadata is read at registration, and its samples after.

Each format is one module with one :class:`Format` object: ``parquet`` (a row per
sample), ``jsonl`` (a line per sample; ``.jsonl.zst`` too), ``fixed`` (a record of
``record_bytes``), ``wds`` (a WebDataset tar: the members of one key per sample) and
``mds`` (MosaicML Streaming shards, read in place). A format's module docstring lists
the fields of its members' ``meta`` in the manifest (:mod:`chunkd.snapshot`).

A format reads bytes only through a :class:`~chunkd.client.datasets.source.Source`, so
the same code reads a pinned member and a frozen one. What a format decodes (a Parquet
row group, a block of decompressed lines, a decompressed MDS shard) it keeps in a
:class:`DecodedLRU` of its own: per process, bounded by bytes and by count.

Registration scans each member (:meth:`Format.scan`), then asks :func:`settle` for the
dataset's schema and the members as the manifest holds them (a format may drop what
repeats the dataset's schema from its members' ``meta``).

A member's **units** are the runs of its samples its format decodes whole
(:meth:`Format.units`, :func:`units_of`): a Parquet member's row groups; one unit per
member for every other format. The read order shuffles units, not members, so that a
reader's decoded working set stays within its LRU (:mod:`chunkd.client.datasets.order`).
A unit's **decoded bytes** (:meth:`Format.unit_bytes`, :func:`unit_bytes_of`) are what
reading it puts in its format's LRU, from the manifest alone: a Parquet row group's
uncompressed size, a non-seekable ``.jsonl.zst`` member's decompressed size, a compressed
MDS shard's raw size; 0 for every unit read in place. The order's windows hold at most
:data:`DECODED_CACHE_BYTES` of them by default: the bound of every decode cache.
"""

from __future__ import annotations

import bisect
import importlib
import importlib.metadata
import itertools
import os
import re
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol, cast, runtime_checkable

from chunkd.errors import DatasetFormatError, InvalidRequestError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from chunkd.client.datasets.findings import Finding
    from chunkd.client.datasets.source import Source
    from chunkd.snapshot import Member, Snapshot

__all__ = [
    "DECODED_CACHE_BYTES",
    "ENTRY_POINTS",
    "MAX_UNIT_BYTES",
    "UNIT_BYTES",
    "DecodedLRU",
    "Format",
    "FormatBase",
    "clear_caches",
    "detect",
    "format_of",
    "names",
    "register",
    "settle",
    "snapshot_unit_bytes",
    "snapshot_units",
    "unit_bytes_of",
    "unit_starts",
    "units_of",
]

#: the bound of each format's per-process cache of decoded pieces (row groups,
#: decompressed members and shards), in bytes; the order's default ``window_bytes``
DECODED_CACHE_BYTES: Final = 256 << 20


#: a unit's decoded bytes are at most this (:meth:`Format.units`): a huge row group or
#: a 4 GB tar is split into units of whole samples below it
MAX_UNIT_BYTES: Final = 128 << 20
#: the decoded bytes a format aims its units at where it chooses their bounds freely
#: (fixed records, JSON lines, WebDataset samples, MDS samples)
UNIT_BYTES: Final = 8 << 20


@runtime_checkable
class Format(Protocol):
    """One member format: a plug-in (:func:`register`).

    Required: :attr:`name`, :attr:`version`, :attr:`suffixes`, :meth:`scan`,
    :meth:`schema`, :meth:`units`, :meth:`unit_bytes`, :meth:`unit_ranges`,
    :meth:`decode` and :meth:`sample`. :class:`FormatBase` gives the rest
    (:meth:`settle`, :meth:`locate`, :meth:`read`, :meth:`ranges`) from those, and the
    hooks a format overrides only where it has something of its own: :meth:`options`
    and :attr:`argument` (``--format NAME:ARG``), :attr:`index_name` and
    :meth:`members_of` (members listed by an index, not by name), :meth:`check` (its
    own rules of ``chunkd dataset check``).

    A member's samples are cut into **units**: runs of whole samples the format decodes
    at once (a Parquet row group or a part of a huge one, a block of JSON lines, a run
    of records, of tar samples, of MDS samples), each of at most
    :data:`MAX_UNIT_BYTES` decoded. :meth:`decode` turns one unit into an Arrow table
    of one row per sample; a batch is taken from such tables by index
    (:mod:`chunkd.client.datasets.columns`), and :meth:`sample` gives one row as the
    per-sample value (``Dataset[i]``, ``Batch.samples``).
    """

    #: the format's name in manifests
    name: str
    #: its decoder's version: part of the key of every unit it decodes (bump it whenever
    #: :meth:`decode` would give another table for the same bytes)
    version: int
    #: the ends of a key ``--format auto`` takes for this format (lowercase)
    suffixes: tuple[str, ...]
    #: whether :meth:`sample` gives a row's column values as they are (a dict of them, or
    #: the one column's value), so that a consumer may take the columns instead of the
    #: samples (the torch adapter's default collate); False where it decodes them further
    #: (MDS's encoded fields)
    columnar: bool

    def scan(self, source: Source, member: Member, options: Mapping[str, Any]) -> Member:
        """``member`` (key, size, version and format set) with its ``samples`` and ``meta``.

        Reads only what the metadata needs (a footer, headers, an index), through
        ``source``. ``options`` are the registration's format options (for example
        ``{"record_bytes": N}`` for ``fixed``).

        Raises:
            DatasetFormatError: the member cannot be read as this format; the message
                names it (``source.name(member)``) and says what is wrong.
            SnapshotDriftError: the object changed while it was being read.
        """
        ...

    def schema(self, members: list[Member]) -> Any:
        """The dataset's schema from its scanned members (the manifest's ``schema_of``)."""
        ...

    def settle(self, members: list[Member], schema: Any) -> list[Member]:
        """``members`` as the manifest holds them, once the dataset's ``schema`` is known
        (a format may drop from a member what repeats the schema)."""
        ...

    def units(self, member: Member) -> list[int]:
        """The sample counts of ``member``'s units, in order, from the manifest alone
        (no I/O); they add up to ``member.samples``. The read order shuffles units
        (:mod:`chunkd.client.datasets.order`)."""
        ...

    def unit_bytes(self, member: Member) -> list[int]:
        """Each unit's **decoded bytes**, from the manifest alone: about what its decoded
        table holds (a Parquet row group's uncompressed size; the bytes of the records,
        lines or files). The read order's windows hold at most ``window_bytes`` of them,
        and decode caches are charged by them."""
        ...

    def unit_ranges(self, member: Member, unit: int) -> list[tuple[int, int]]:
        """The byte ranges ``(offset, length)`` of ``member`` that :meth:`decode` of
        ``unit`` reads, from the manifest alone (for prefetching, and the decoded
        entry's key)."""
        ...

    def decode(
        self, source: Source, member: Member, unit: int, columns: Sequence[str] | None
    ) -> Any:
        """Unit ``unit`` of ``member`` as a ``pyarrow.Table``: one row per sample, in
        order; only ``columns`` (in the order given; None: all), each decoded only if
        asked for.

        Raises:
            DatasetFormatError: the bytes are not what was registered (damaged or
                truncated), or a column asked for is not the member's.
            SnapshotDriftError: the object changed.
        """
        ...

    def sample(self, table: Any, row: int) -> Any:
        """Row ``row`` of a table :meth:`decode` made (or a batch taken from such tables)
        as the per-sample value: what ``Dataset[i]`` gives."""
        ...

    def locate(self, member: Member, index: int) -> tuple[int, int]:
        """The unit that holds sample ``index`` and its row in it.

        Raises:
            IndexError: ``index`` is outside the member.
        """
        ...

    def read(self, source: Source, member: Member, index: int) -> Any:
        """Sample ``index`` of ``member`` (``0 <= index < member.samples``)."""
        ...

    def ranges(self, member: Member, index: int) -> list[tuple[int, int]]:
        """The byte ranges reading sample ``index`` reads: its unit's."""
        ...

    # -- hooks: FormatBase's defaults do nothing ---------------------------------------

    #: what ``--format NAME:ARG`` takes after the colon, as usage shows it (``"N"``:
    #: ``fixed:N``); "" where the format takes no argument
    argument: str
    #: the base name of the files that list a dataset's members (MDS's ``index.json``):
    #: a format with one registers what those files list (:meth:`members_of`), never
    #: the files by their names; None: each file of the format is a member
    index_name: str | None

    def options(self, arg: str) -> dict[str, Any]:
        """The registration's format options (what :meth:`scan` takes) from ``ARG`` of
        ``--format NAME:ARG`` ("" when none is given).

        Raises:
            InvalidRequestError: ``arg`` is not what the format takes; the message says
                what it takes.
        """
        ...

    def members_of(
        self, prefix: str, files: Sequence[Member], source: Source, options: Mapping[str, Any]
    ) -> Iterator[tuple[Member, dict[str, Any]]]:
        """The members its index files list, each with its :meth:`scan` options
        (``options`` and what the index gives): every file under the registered key
        ``prefix`` is in ``files`` (in key order), read through ``source``. Called only
        where :attr:`index_name` is set.

        Raises:
            DatasetFormatError: an index cannot be read, or lists a file that is not there.
        """
        ...

    def check(
        self, source: Source, members: Sequence[Member], schema_of: Any, *, deep: bool
    ) -> Iterable[Finding]:
        """What ``members`` (all this format's members of a snapshot, in order) break of
        the format's own storage expectations (``chunkd dataset check``): findings of
        :mod:`chunkd.client.datasets.check`. ``schema_of`` is the dataset's schema;
        ``deep`` asks for every sample's bytes to be read where the format checks them.
        Reads only the manifest, except where the format says otherwise."""
        ...


class FormatBase:
    """What every format gets from its required methods (see :class:`Format`).

    :meth:`read` decodes the sample's unit (all columns) and keeps it in a per-process
    :class:`DecodedLRU` of :data:`DECODED_CACHE_BYTES`, so reading the neighbouring
    samples decodes nothing again.
    """

    name: str
    version: int
    columnar: bool = True

    def units(self, member: Member) -> list[int]:
        raise NotImplementedError

    def unit_ranges(self, member: Member, unit: int) -> list[tuple[int, int]]:
        raise NotImplementedError

    def unit_bytes(self, member: Member) -> list[int]:
        raise NotImplementedError

    def decode(
        self, source: Source, member: Member, unit: int, columns: Sequence[str] | None
    ) -> Any:
        raise NotImplementedError

    def sample(self, table: Any, row: int) -> Any:
        raise NotImplementedError

    def settle(self, members: list[Member], schema: Any) -> list[Member]:
        return members

    argument: str = ""
    index_name: str | None = None

    def options(self, arg: str) -> dict[str, Any]:
        if arg:
            raise InvalidRequestError(f"the {self.name} format takes no argument")
        return {}

    def members_of(
        self, prefix: str, files: Sequence[Member], source: Source, options: Mapping[str, Any]
    ) -> Iterator[tuple[Member, dict[str, Any]]]:
        return ((member, dict(options)) for member in files)

    def check(
        self, source: Source, members: Sequence[Member], schema_of: Any, *, deep: bool
    ) -> Iterable[Finding]:
        return ()

    def locate(self, member: Member, index: int) -> tuple[int, int]:
        starts = unit_starts(cast("Format", self), member)
        if not 0 <= index < starts[-1]:
            raise IndexError(f"sample {index} of {member.key}, which holds {starts[-1]}")
        unit = bisect.bisect_right(starts, index) - 1
        return unit, index - starts[unit]

    def read(self, source: Source, member: Member, index: int) -> Any:
        unit, row = self.locate(member, index)
        # by the source too: two sources may name members alike (the same key and version
        # in two daemons' backends of one name)
        key = (id(source), source.name(member), member.version, self.name, self.version, unit)
        found = _UNITS.get(key)
        if found is None or found[1] is not source:
            found = (self.decode(source, member, unit, None), source)
            _UNITS.put(key, found, self.unit_bytes(member)[unit] or int(found[0].nbytes))
        return self.sample(found[0], row)

    def ranges(self, member: Member, index: int) -> list[tuple[int, int]]:
        return self.unit_ranges(member, self.locate(member, index)[0])


def unit_starts(fmt: Format, member: Member) -> list[int]:
    """Each unit's first sample in ``member``, and ``member.samples`` last (cached)."""
    key = (fmt.name, member.key, member.version, member.size, member.samples)
    starts: list[int] | None = _STARTS.get(key)
    if starts is None:
        starts = [0, *itertools.accumulate(fmt.units(member))]
        _STARTS.put(key, starts, 8 * len(starts))
    return starts


#: the formats chunkd ships, by name: the module under this package that holds each
_BUILTIN: Final = {
    "parquet": "parquet",
    "jsonl": "jsonl",
    "fixed": "fixed",
    "wds": "wds",
    "mds": "mds",
    "arrow": "arrow",
}
#: the entry-point group a package names its formats in (``name = "pkg.module:FORMAT"``)
ENTRY_POINTS: Final = "chunkd.formats"
_FORMATS: dict[str, Format] = {}
#: every DecodedLRU of the process (:func:`clear_caches`)
_CACHES: weakref.WeakSet[DecodedLRU] = weakref.WeakSet()
_FORMATS_LOCK = threading.Lock()
_NAME = re.compile(r"[a-z][a-z0-9_.-]{0,31}")


def register(fmt: Format) -> Format:
    """Make ``fmt`` the format of its :attr:`~Format.name` in this process (a plug-in:
    see :class:`Format` for what it must have); returns it.

    Raises:
        DatasetFormatError: it lacks a required member, or its name is not a format
            name (lowercase letters, digits, ``_``, ``.``, ``-``; at most 32).
    """
    missing = [m for m in _REQUIRED if not hasattr(fmt, m)]
    if missing:
        raise DatasetFormatError(
            f"format {getattr(fmt, 'name', fmt)!r} lacks {', '.join(missing)}: see "
            "chunkd.client.datasets.formats.Format for what a format has"
        )
    if not isinstance(fmt.name, str) or not _NAME.fullmatch(fmt.name):
        raise DatasetFormatError(f"a format's name is [a-z][a-z0-9_.-]*; got {fmt.name!r}")
    with _FORMATS_LOCK:
        _FORMATS[fmt.name] = fmt
    return fmt


_REQUIRED: Final = (
    "name",
    "version",
    "suffixes",
    "scan",
    "schema",
    "units",
    "unit_bytes",
    "unit_ranges",
    "decode",
    "sample",
    "settle",
    "locate",
    "read",
    "ranges",
    "argument",
    "index_name",
    "options",
    "members_of",
    "check",
)


def format_of(name: str) -> Format:
    """The format called ``name``: one chunkd ships, one :func:`register` ed, or one a
    package names in the ``chunkd.formats`` entry points.

    Raises:
        DatasetFormatError: no format has that name.
    """
    fmt = _FORMATS.get(name)
    if fmt is not None:
        return fmt
    module = _BUILTIN.get(name)
    if module is not None:
        # chunkd's own formats are held to the contract by the conformance suite
        fmt = cast("Format", importlib.import_module(f"{__name__}.{module}").FORMAT)
        with _FORMATS_LOCK:
            _FORMATS[name] = fmt
        return fmt
    plugged = _plugins().get(name)
    if plugged is not None:
        try:
            loaded = plugged.load()
        except Exception as exc:  # the plug-in's own import failed: name it, not a traceback
            raise DatasetFormatError(
                f"format {name!r} is the plug-in {plugged.value!r}, which does not load "
                f"({type(exc).__name__}: {exc}); fix or reinstall its package"
            ) from None
        return register(loaded)
    raise DatasetFormatError(f"unknown member format {name!r}; known: {', '.join(names())}")


def names() -> list[str]:
    """The names of every format known here: chunkd's, then plug-ins'."""
    return list(dict.fromkeys([*_BUILTIN, *_FORMATS, *_plugins()]))


def _plugins() -> dict[str, Any]:
    """The plug-ins' entry points by name, looked up again only when a path entry of
    ``sys.path`` changed (a package installed or removed adds or removes its
    ``.dist-info`` there): asking every installed distribution costs milliseconds,
    and ``detect()`` and ``names()`` are asked for every file a registration lists."""
    global _PLUGINS_SEEN
    mark = _path_mark()
    seen = _PLUGINS_SEEN
    if seen is not None and seen[0] == mark:
        return seen[1]
    try:
        points = importlib.metadata.entry_points(group=ENTRY_POINTS)
    except Exception:  # a broken distribution's metadata: no plug-ins from it
        found: dict[str, Any] = {}
    else:
        found = {point.name: point for point in points if point.name not in _BUILTIN}
    _PLUGINS_SEEN = (mark, found)
    return found


def _path_mark() -> tuple[tuple[str, int], ...]:
    """Each ``sys.path`` entry with the time it last changed (-1: none there)."""
    mark = []
    for entry in sys.path:
        try:
            mark.append((entry, os.stat(entry or ".").st_mtime_ns))
        except (OSError, ValueError):
            mark.append((entry, -1))
    return tuple(mark)


#: the plug-ins found, and the mark of sys.path they were found under
_PLUGINS_SEEN: tuple[tuple[tuple[str, int], ...], dict[str, Any]] | None = None


def detect(key: str) -> str | None:
    """The format a key's name says it holds (``--format auto``), or None: the longest
    suffix of any format's :attr:`~Format.suffixes` that ends it."""
    lowered = key.lower()
    best: tuple[int, str] | None = None
    for name in names():
        try:
            fmt = format_of(name)
        except DatasetFormatError:
            continue
        for suffix in fmt.suffixes:
            if lowered.endswith(suffix) and (best is None or len(suffix) > best[0]):
                best = (len(suffix), name)
    return None if best is None else best[1]


def units_of(fmt: Format, member: Member) -> list[int]:
    """``member``'s units' sample counts (:meth:`Format.units`)."""
    return fmt.units(member)


def unit_bytes_of(fmt: Format, member: Member) -> list[int]:
    """``member``'s units' decoded bytes (:meth:`Format.unit_bytes`)."""
    return fmt.unit_bytes(member)


def snapshot_units(snapshot: Snapshot) -> list[list[int] | None]:
    """Each member's units' sample counts (:func:`units_of`), in member order: what
    :class:`~chunkd.client.datasets.order.Order` takes as ``units``."""
    return _per_member(snapshot, units_of)


def snapshot_unit_bytes(snapshot: Snapshot) -> list[list[int] | None]:
    """Each member's units' decoded bytes (:func:`unit_bytes_of`), in member order: what
    :class:`~chunkd.client.datasets.order.Order` takes as ``unit_bytes``."""
    return _per_member(snapshot, unit_bytes_of)


def _per_member(
    snapshot: Snapshot, of: Callable[[Format, Member], list[int] | None]
) -> list[list[int] | None]:
    formats: dict[str, Format] = {}
    found: list[list[int] | None] = []
    for member in snapshot.members:
        fmt = formats.get(member.format)
        if fmt is None:
            fmt = formats[member.format] = format_of(member.format)
        found.append(of(fmt, member))
    return found


def settle(fmt: Format, members: list[Member]) -> tuple[Any, list[Member]]:
    """The dataset's schema (the manifest's ``schema_of``) and ``members`` as the
    manifest holds them: a format that records a per-member schema (Parquet) keeps it
    only in the members whose schema differs from the dataset's."""
    schema = fmt.schema(members)
    return schema, list(fmt.settle(members, schema))


class DecodedLRU:
    """A per-process LRU of decoded pieces, bounded by their bytes and their count.

    Safe to share between threads; a forked child starts with the parent's pieces
    and a fresh lock. A piece bigger than the whole bound is not kept.

    Args:
        max_bytes: the most bytes of pieces kept together.
        max_items: the most pieces kept.
    """

    def __init__(self, max_bytes: int, max_items: int) -> None:
        self.max_bytes = max_bytes
        self.max_items = max_items
        _CACHES.add(self)
        self._pieces: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pieces)

    @property
    def bytes(self) -> int:
        """The bytes of the pieces kept now."""
        return self._bytes

    def get(self, key: Hashable) -> Any | None:
        """The piece kept under ``key`` (now the most recently used), or None."""
        with self._lock:
            found = self._pieces.get(key)
            if found is None:
                return None
            self._pieces.move_to_end(key)
            return found[0]

    def put(self, key: Hashable, piece: Any, size: int) -> None:
        """Keep ``piece`` (``size`` bytes) under ``key``, dropping the least recently
        used pieces beyond the bounds."""
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._pieces.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._pieces[key] = (piece, size)
            self._bytes += size
            while self._bytes > self.max_bytes or len(self._pieces) > self.max_items:
                self._bytes -= self._pieces.popitem(last=False)[1][1]

    def clear(self) -> None:
        """Drop every piece."""
        with self._lock:
            self._pieces.clear()
            self._bytes = 0


def clear_caches() -> None:
    """Drop what every :class:`DecodedLRU` of this process holds (the formats' footers,
    plans, shards and units): what the daemon's decode worker does before each request,
    so that a request is decoded from its own inputs alone, never from what another
    request (another user's, with another member record under the same name) left."""
    for cache in list(_CACHES):
        cache.clear()


#: decoded units :meth:`FormatBase.read` keeps, per process
_UNITS = DecodedLRU(DECODED_CACHE_BYTES, 4096)
_STARTS = DecodedLRU(64 << 20, 4096)
