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

import importlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Final, Protocol

from chunkd.errors import DatasetFormatError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from chunkd.client.datasets.source import Source
    from chunkd.snapshot import Member, Snapshot

__all__ = [
    "DECODED_CACHE_BYTES",
    "DecodedLRU",
    "Format",
    "detect",
    "format_of",
    "settle",
    "snapshot_unit_bytes",
    "snapshot_units",
    "unit_bytes_of",
    "units_of",
]

#: the bound of each format's per-process cache of decoded pieces (row groups,
#: decompressed members and shards), in bytes; the order's default ``window_bytes``
DECODED_CACHE_BYTES: Final = 256 << 20


class Format(Protocol):
    """One member format."""

    #: the format's name in manifests (one of :data:`chunkd.snapshot.FORMATS`)
    name: str

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

    def read(self, source: Source, member: Member, index: int) -> Any:
        """Sample ``index`` of ``member`` (``0 <= index < member.samples``)."""
        ...

    def ranges(self, member: Member, index: int) -> list[tuple[int, int]]:
        """The byte ranges ``(offset, length)`` of ``member`` that :meth:`read` of sample
        ``index`` reads (for prefetching): from the manifest alone, no I/O."""
        ...

    def schema(self, members: list[Member]) -> Any:
        """The dataset's schema from its scanned members (the manifest's ``schema_of``)."""
        ...

    def units(self, member: Member) -> list[int] | None:
        """The sample counts of ``member``'s **units**, in order: the runs of its samples
        this format decodes whole (a Parquet member's row groups), from the manifest
        alone; None: the member is one unit of ``member.samples``. The read order
        shuffles units (:mod:`chunkd.client.datasets.order`). Optional: a format without
        it is one unit per member (:func:`units_of`)."""
        ...

    def unit_bytes(self, member: Member) -> list[int] | None:
        """Each of ``member``'s units' **decoded bytes** (one per unit of :meth:`units`),
        from the manifest alone: what reading the unit keeps in this format's decode
        cache; 0 for a unit read in place. None: 0 for every unit. The read order's
        windows hold at most ``window_bytes`` of them. Optional: a format without it
        decodes nothing whole (:func:`unit_bytes_of`)."""
        ...


_MODULES = {
    "parquet": "parquet",
    "jsonl": "jsonl",
    "fixed": "fixed",
    "wds": "wds",
    "mds": "mds",
}
_FORMATS: dict[str, Format] = {}

#: the formats ``--format auto`` recognises, by the end of a key
_SUFFIXES = (
    (".parquet", "parquet"),
    (".jsonl", "jsonl"),
    (".jsonl.zst", "jsonl"),
    (".json.zst", "jsonl"),
    (".ndjson", "jsonl"),
    (".ndjson.zst", "jsonl"),
    (".tar", "wds"),
    (".mds", "mds"),
    (".mds.zstd", "mds"),
    (".mds.gz", "mds"),
    (".mds.bz2", "mds"),
)


def format_of(name: str) -> Format:
    """The format called ``name``.

    Raises:
        DatasetFormatError: no format has that name.
    """
    fmt = _FORMATS.get(name)
    if fmt is None:
        module = _MODULES.get(name)
        if module is None:
            raise DatasetFormatError(
                f"unknown member format {name!r}; known: {', '.join(_MODULES)}"
            )
        fmt = _FORMATS[name] = importlib.import_module(f"{__name__}.{module}").FORMAT
    return fmt


def detect(key: str) -> str | None:
    """The format a key's name says it holds (``--format auto``), or None."""
    lowered = key.lower()
    return next((fmt for suffix, fmt in _SUFFIXES if lowered.endswith(suffix)), None)


def units_of(fmt: Format, member: Member) -> list[int] | None:
    """``member``'s units' sample counts (:meth:`Format.units`), or None where the member
    is one unit (every format without a ``units`` of its own)."""
    split = getattr(fmt, "units", None)
    return None if split is None else split(member)


def unit_bytes_of(fmt: Format, member: Member) -> list[int] | None:
    """``member``'s units' decoded bytes (:meth:`Format.unit_bytes`), or None where they
    are all 0 (every format without a ``unit_bytes`` of its own)."""
    cost = getattr(fmt, "unit_bytes", None)
    return None if cost is None else cost(member)


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
    trim = getattr(fmt, "settle", None)
    return schema, (list(trim(members, schema)) if trim is not None else members)


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
