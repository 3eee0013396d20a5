"""A reader's decoded units: each unit decoded once, held, and decoded ahead.

A reader's batch names ``(member, sample)`` pairs (the order's positions). Each pair lies
in one **unit** of its member (:meth:`Format.units
<chunkd.client.datasets.formats.Format.units>`), which the member's format decodes
whole into an Arrow table (:meth:`Format.decode
<chunkd.client.datasets.formats.Format.decode>`). :class:`Units` gets those tables:

1. from the ones it holds (an LRU bounded by the units' decoded bytes);
2. else from the daemon's decoded entries (:class:`~chunkd.client.datasets.shared.SharedDecoder`):
   the node's first reader of a unit has the daemon decode it, every reader maps the
   result, so a unit is decoded once per node;
3. else (the daemon's decoding is off, full, older, or the source is one it does not
   read) by decoding it in this process, counted as such in the daemon's metrics.

It also **decodes ahead**: the loader names the units of its next steps
(:meth:`Units.ahead`) and a few threads get them while the trainer computes (pyarrow
releases the GIL), at most ``ahead_bytes`` of them in flight and held. A held unit's
fixed-width columns are numpy views over its buffers (:func:`numpy_view`), made once.

What a batch takes from the tables is :mod:`chunkd.client.datasets.columns`.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Final

import numpy as np
from numpy.typing import NDArray

from chunkd.client.datasets.formats import DECODED_CACHE_BYTES, Format, format_of

if TYPE_CHECKING:
    from chunkd.client.datasets.shared import SharedDecoder
    from chunkd.client.datasets.source import Source
    from chunkd.snapshot import Member, Snapshot

__all__ = ["DECODE_THREADS", "UnitKey", "Units", "numpy_view"]

#: threads that decode ahead, per reader
DECODE_THREADS: Final = 2

#: a unit, as ``(member, unit in member)``
UnitKey = tuple[int, int]


class Units:
    """The decoded units of one snapshot's members, for one reader (see the module
    docstring).

    Args:
        snapshot: the snapshot read.
        source: where its members' bytes come from.
        columns: the columns decoded (None: all).
        shared: the node's daemon's decoder (None: every unit is decoded here); closed
            with the units.
        held_bytes: the most decoded bytes of units kept for the next batches, ahead
            ones included (by the formats' :meth:`unit_bytes`).
        threads: decode-ahead threads (0: none; units are then decoded when read).
    """

    def __init__(
        self,
        snapshot: Snapshot,
        source: Source,
        *,
        columns: Sequence[str] | None = None,
        shared: SharedDecoder | None = None,
        held_bytes: int = DECODED_CACHE_BYTES,
        threads: int = DECODE_THREADS,
    ) -> None:
        self.snapshot = snapshot
        self.source = source
        self.columns = None if columns is None else tuple(columns)
        self.shared = shared
        self.held_bytes = max(0, held_bytes)
        self._threads = max(0, threads)
        self._pool: ThreadPoolExecutor | None = None
        #: each unit held: its table, its decoded bytes, and its columns' numpy views
        self._held: OrderedDict[UnitKey, tuple[Any, int, dict[int, NDArray[Any] | None]]] = (
            OrderedDict()
        )
        self._held_total = 0
        self._flights: dict[UnitKey, Future[Any]] = {}
        self._lock = threading.Lock()
        self._formats: dict[str, Format] = {}
        self._starts: dict[int, NDArray[np.int64]] = {}
        self._costs: dict[int, list[int]] = {}
        #: units decoded in this process, units mapped from the daemon, and units asked
        #: for ahead of their step
        self.decoded = 0
        self.mapped = 0
        self.ahead_started = 0

    def format(self, member: int) -> Format:
        """Member ``member``'s format."""
        name = self.snapshot.members[member].format
        fmt = self._formats.get(name)
        if fmt is None:
            fmt = self._formats[name] = format_of(name)
        return fmt

    def rows(self, key: UnitKey) -> int:
        """A unit's samples, as its member's format cuts it."""
        starts = self._unit_starts(key[0])
        return int(starts[key[1] + 1] - starts[key[1]])

    def unit_bytes(self, key: UnitKey) -> int:
        """A unit's decoded bytes, as its format counts them."""
        member, unit = key
        costs = self._costs.get(member)
        if costs is None:
            costs = self.format(member).unit_bytes(self.snapshot.members[member])
            if len(self._costs) > 4096:
                self._costs.clear()
            self._costs[member] = costs
        return int(costs[unit])

    def ranges(self, keys: Sequence[UnitKey]) -> list[tuple[str, int, int]]:
        """The byte ranges ``(BACKEND/KEY, offset, length)`` decoding ``keys`` reads, each
        once, from the manifest alone (for a prefetch; none from a source whose objects
        are not what it reads: a frozen snapshot's)."""
        if not getattr(self.source, "prefetchable", True):
            return []
        found: dict[tuple[str, int, int], None] = {}
        for member_index, unit in dict.fromkeys(keys):
            member = self.snapshot.members[member_index]
            name = self.source.name(member)
            for offset, length in self.format(member_index).unit_ranges(member, unit):
                found[name, int(offset), int(length)] = None
        return list(found)

    def locate(
        self, members: NDArray[np.int64], samples: NDArray[np.int64]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """The unit in its member, and the row in the unit, of each ``(member, sample)``."""
        units = np.empty_like(samples)
        rows = np.empty_like(samples)
        for member in np.unique(members).tolist():
            chosen = members == member
            starts = self._unit_starts(member)
            found = np.searchsorted(starts, samples[chosen], side="right") - 1
            units[chosen] = found
            rows[chosen] = samples[chosen] - starts[found]
        return units, rows

    def _unit_starts(self, member: int) -> NDArray[np.int64]:
        starts = self._starts.get(member)
        if starts is None:
            counts = self.format(member).units(self.snapshot.members[member])
            starts = np.concatenate(([0], np.cumsum(counts, dtype=np.int64))).astype(np.int64)
            if len(self._starts) > 4096:
                self._starts.clear()
            self._starts[member] = starts
        return starts

    # -- getting units -------------------------------------------------------------------

    def get(self, key: UnitKey) -> Any:
        """Unit ``key``'s table (held, decoded ahead, mapped from the daemon, or decoded
        now)."""
        with self._lock:
            found = self._held.get(key)
            if found is not None:
                self._held.move_to_end(key)
                return found[0]
            flight = self._flights.get(key)
        if flight is not None:
            return flight.result()
        table = self._fetch(key)
        self._hold(key, table)
        return table

    def ahead(self, keys: Sequence[UnitKey]) -> int:
        """Start getting ``keys`` (in the order of need) in the background, as far as
        ``held_bytes`` allows: the units asked for that are held, and those in flight,
        count against it; the other units held are the first to go. Returns how many
        were started."""
        if not self._threads:
            return 0
        started = 0
        with self._lock:
            wanted = list(dict.fromkeys(keys))
            budget = self.held_bytes - sum(self.unit_bytes(k) for k in self._flights)
            for key in reversed(wanted):  # the soonest needed ends most recently used
                if key in self._held:
                    self._held.move_to_end(key)
                    budget -= self._held[key][1]
            for key in wanted:
                if key in self._held or key in self._flights:
                    continue
                cost = self.unit_bytes(key)
                if cost > budget and (started or self._flights):
                    break
                budget -= cost
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        self._threads, thread_name_prefix="chunkd-decode"
                    )
                self._flights[key] = self._pool.submit(self._ahead, key)
                started += 1
            self.ahead_started += started
        return started

    def _ahead(self, key: UnitKey) -> Any:
        try:
            table = self._fetch(key)
            self._hold(key, table)
            return table
        finally:
            with self._lock:
                self._flights.pop(key, None)

    def _fetch(self, key: UnitKey) -> Any:
        member_index, unit = key
        member: Member = self.snapshot.members[member_index]
        fmt = self.format(member_index)
        shared = self.shared
        if shared is not None:
            table = shared.unit(self.source, member, fmt, unit, self.columns)
            if table is not None:
                with self._lock:
                    self.mapped += 1
                return table
        table = fmt.decode(self.source, member, unit, self.columns)
        with self._lock:
            self.decoded += 1
        if shared is not None:
            shared.local()
        return table

    def _hold(self, key: UnitKey, table: Any) -> None:
        cost = self.unit_bytes(key) or int(table.nbytes)
        with self._lock:
            old = self._held.pop(key, None)
            if old is not None:
                self._held_total -= old[1]
            self._held[key] = (table, cost, {})
            self._held_total += cost
            # the newest unit stays even alone over the bound: the batch being read needs it
            while self._held_total > self.held_bytes and len(self._held) > 1:
                self._held_total -= self._held.popitem(last=False)[1][1]

    def view(self, key: UnitKey, table: Any, column: int) -> NDArray[Any] | None:
        """Column ``column`` of unit ``key``'s ``table`` as a numpy view (:func:`numpy_view`),
        made once a unit while the unit is held (the views go with it)."""
        with self._lock:
            entry = self._held.get(key)
            views = entry[2] if entry is not None and entry[0] is table else None
        if views is None:
            return numpy_view(_pyarrow(), table.column(column))
        if column not in views:
            views[column] = numpy_view(_pyarrow(), table.column(column))
        return views[column]

    def close(self) -> None:
        """Stop decoding ahead and drop every unit held."""
        pool, self._pool = self._pool, None
        # A reader's generator left open is closed at interpreter exit, after the
        # executor's own exit hook joined its threads and while modules are torn down:
        # shutting it down then fails ("Exception ignored in ..."), and has nothing to do.
        if pool is not None and not sys.is_finalizing():
            pool.shutdown(wait=True, cancel_futures=True)
        if self.shared is not None:
            self.shared.close()
        with self._lock:
            self._held.clear()
            self._held_total = 0
            self._flights.clear()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a Units is per process: make one in each reader")


def _chunk(pa: Any, column: Any) -> Any:
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def numpy_view(pa: Any, column: Any) -> NDArray[Any] | None:
    """A unit's column as a numpy array over its buffer (no copy) where it is one of
    fixed width in whole bytes without nulls (numbers, timestamps, dates, durations,
    fixed-size binary: 2-D); else None (it is taken by Arrow)."""
    array = _chunk(pa, column)
    kind = array.type
    if array.null_count:
        return None
    if pa.types.is_fixed_size_binary(kind):
        width = kind.byte_width
        data = np.frombuffer(array.buffers()[1], dtype=np.uint8)
        start = array.offset * width
        return data[start : start + len(array) * width].reshape(len(array), width)
    if _numeric(pa, kind) and kind.bit_width % 8 == 0:
        view: NDArray[Any] = array.to_numpy(zero_copy_only=True)
        return view
    return None


def _numeric(pa: Any, kind: Any) -> bool:
    """Whether ``kind`` is a number numpy holds as it is, without a copy: integers,
    floats, timestamps and durations (not dates and times: numpy has no such types)."""
    return bool(
        pa.types.is_integer(kind)
        or pa.types.is_floating(kind)
        or pa.types.is_timestamp(kind)
        or pa.types.is_duration(kind)
    )


def _pyarrow() -> Any:
    return importlib.import_module("pyarrow")
