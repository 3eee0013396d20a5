"""The read order of an epoch: one pure function of (snapshot, seed, epoch).

What the order depends on
    The snapshot's id and its members' **units** (below) with their sample counts, in
    member order, with their decoded bytes, ``seed``, ``epoch``, and the order's three
    settings: ``shuffle``, ``window`` and ``window_bytes``. Nothing else: not ranks,
    workers, batch sizes, the machine, or numpy's and torch's versions. The shuffles
    are keyed pseudorandom permutations (:class:`Permutation`, a Feistel network)
    whose keys name the snapshot, seed and epoch::

        chunkd.order:{snapshot}:{seed}:{epoch}:units          the units' order
        chunkd.order:{snapshot}:{seed}:{epoch}:window:{w}     the samples of window w

    so two snapshots, seeds or epochs get unrelated orders, and the same ones get the
    same order on every machine, for as long as these keys stay (changing them
    changes every saved order; a loader state records what it needs to check it,
    :mod:`chunkd.client.datasets.loader`).

Units: what a format decodes whole
    A member splits into units, consecutive runs of its samples that its format
    decodes together (:func:`chunkd.client.datasets.formats.units_of`): a Parquet
    member's units are its row groups; every other format's member is one unit. Units
    are what a reader pays for: reading one row of a row group decodes the whole group,
    and the format keeps a bounded LRU of decoded groups. Units holding no sample take
    no place in the order.

Locality: units shuffled, then samples mixed within a window of units
    The units are permuted first (across members: a window's units come from
    anywhere in the dataset). Then that order is cut into **windows**: runs of
    consecutive units holding at most ``window`` units AND at most ``window_bytes``
    of their decoded bytes (a unit's decoded bytes, from the manifest alone:
    :func:`chunkd.client.datasets.formats.unit_bytes_of`; a unit of more than
    ``window_bytes`` is a window alone). The cut is greedy from the first unit
    (:func:`window_starts`, O(units)), so it too is a pure function of the inputs
    above. The samples of a window are permuted together: the epoch reads window 0's
    samples in a shuffled order, then window 1's, and so on. A reader reading
    positions in order therefore holds at most ``window`` units (so at most
    ``window`` members), and at most ``window_bytes`` decoded, inside a window, and at
    most twice that across a window's edge, whatever the dataset's size. Each unit is
    in one window, and a window's samples all come before the next window's: a
    reader whose cache of decoded units holds a window decodes each unit once an
    epoch. ``window=None`` / ``window_bytes=None``: no such bound; both None make one
    window of every unit: a uniform shuffle of all samples (the baseline
    :func:`quality` measures against). ``shuffle=False``: members in key order,
    samples as stored (positions are snapshot indices).

The defaults: 16 units, 256 MiB decoded
    Measured with :func:`quality` on 64 members of 8 row groups of 1000 rows (512
    units; the whole epoch, seed 1). With units that decode to nothing (read in
    place) only ``window`` bounds: the mean distance between adjacent samples is 0.87
    of a full shuffle's at window 8, 0.93 at 16 and 0.98 at 32 (a window's units are
    drawn from the whole dataset), and a run of 1024 positions touches 9 units (8.5
    members) at window 8, 17 (15.3) at 16 and 33 (26.9) at 32, against 443 units (all
    64 members) for a full shuffle. ``window_bytes`` defaults to the formats' decode
    caches' bound (:data:`DEFAULT_WINDOW_BYTES` ``=``
    :data:`~chunkd.client.datasets.formats.DECODED_CACHE_BYTES`, 256 MiB), so a
    window's units fit the cache they are decoded into and reading an epoch in order
    decodes each once, whatever the units' size. Row groups of up to 16 MiB decoded
    are bounded by ``window`` alone. Spark's 128 MiB row groups (the same 64 x 8
    units, each 128 MiB decoded; a synthetic manifest) make windows of 2 units: a mean
    gap of 0.49 of a full shuffle's, and 2.8 row groups (2.8 members) per 1024 rows,
    each decoded once; without the byte bound (``window_bytes=None``) the windows of
    16 such units (2 GiB) would mix to 0.93 and touch 16 row groups per 1024 rows, but
    thrash the 256 MiB cache, decoding a whole row group for nearly every row read.
    512 MiB or 1 GiB (with caches as big) mix to 0.73 or 0.87.

Cost
    :meth:`Order.locate` maps any positions to their ``(member, sample)`` directly: a
    binary search for the window, the window's permutation (O(1) expected), and a
    binary search for the unit. Nothing of the size of the epoch is built; the only
    tables are per member and per unit (the units' order, their members, first
    samples and cumulative counts).

Order version 2: a schema-2 (paged) snapshot's (:class:`PagedOrder`)
    The order above needs every unit, so every member, of the snapshot: arrays over all
    units, built in O(units) by every process each epoch (6 s and 1.7 GiB at 10M row
    groups). A schema-2 snapshot is a root naming member pages (``chunkd.snapshot``), and
    its order is built from the root alone, in O(pages)::

        chunkd.order:{snapshot}:{seed}:{epoch}:pages                the pages' order
        chunkd.order:{snapshot}:{seed}:{epoch}:group:{g}:units      group g's units' order
        chunkd.order:{snapshot}:{seed}:{epoch}:group:{g}:window:{w} the samples of its window w

    The pages holding samples are permuted (:class:`Permutation`), then cut greedily
    into **groups** of consecutive pages of that order: at most :data:`GROUP_PAGES` (4)
    pages and at most :data:`GROUP_MEMBERS` (32,768) members, one page at least (so
    every group but the last has two pages at least: a page holds at most 16,384). The
    root gives each page's samples, so where each group starts in the epoch is a prefix
    sum over the pages. Inside a group everything is as above, over the group's units
    alone: its units (the formats' own, from its pages' members) permuted, cut into
    windows of at most ``window`` units and ``window_bytes`` decoded, the samples of a
    window permuted. So the epoch reads group 0's windows, then group 1's, and so on; a
    window's units come from the group's 2 to 4 pages, which the pages' order draws
    from anywhere in the dataset. ``shuffle=False``: pages, units and samples in order
    (positions are snapshot indices). ``window=None`` and ``window_bytes=None``: a
    group's samples mixed whole (no uniform shuffle of the whole epoch: that needs every
    unit).

    A position's group is a binary search over the groups; the group is built when a
    position of it is first asked for: its pages are loaded (checked against their ids
    and the root), its members' units worked out (kept a process, by page id, within
    :data:`PAGE_UNITS_BYTES`), permuted and windowed. An order keeps :data:`GROUPS_HELD`
    (2) groups built. Memory: the root's arrays (a few per page) and two groups' units;
    the pages themselves are the snapshot's (its page cache, ``PAGE_CACHE`` pages), and
    two groups' pages fit it, so a reader crossing from one group to the next loads each
    page once an epoch (groups of 16 pages made a reader reload a page for nearly every
    unit: 4,862 loads and 340 s for 200 steps where 4 loads took 0.8 s). The version
    (:data:`ORDER_VERSION`, :func:`order_version`) is recorded in a loader state's
    format (:mod:`chunkd.client.datasets.state`); schema-1 snapshots keep version 1.

    Measured (``bench/order_bench.py``; Parquet-like members of 8 row groups of 125
    rows): at 10M units, building the order and locating a first run of positions takes
    0.2-0.4 s and 27-46 MiB in a fresh process, against 5.9-6.5 s and 1.7 GiB for
    version 1 from the lists in hand; at 100M units, 0.1 s (version 1 does not fit). In
    runs of 50,000 rows of 100,000 such members a reader holds 16 row groups open (a
    full shuffle: about 800); adjacent samples lie 0.35-0.5 as far apart in the
    snapshot as under a full shuffle, where version 1's windows give 0.95: a window's
    units come from the 2-4 pages of a group, not from 16 places (groups of 16 pages:
    0.6-0.9, but a reader then holds 16 pages, twice the snapshot's page cache).

This module needs numpy only: no torch, no jax, no client.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, NamedTuple, Protocol

import numpy as np
from numpy.typing import NDArray

from chunkd.client.datasets.formats import DECODED_CACHE_BYTES, Format, format_of
from chunkd.errors import ManifestError

if TYPE_CHECKING:
    from chunkd.snapshot import Member

__all__ = [
    "DEFAULT_WINDOW",
    "DEFAULT_WINDOW_BYTES",
    "GROUPS_HELD",
    "GROUP_MEMBERS",
    "GROUP_PAGES",
    "ORDER_VERSION",
    "PAGE_UNITS_BYTES",
    "EpochOrder",
    "Located",
    "Order",
    "OrderQuality",
    "PageUnits",
    "PagedOrder",
    "Permutation",
    "order_version",
    "page_units",
    "quality",
    "window_starts",
]

#: units whose samples are mixed together, by default (see the module docstring)
DEFAULT_WINDOW: Final = 16
#: decoded bytes a window's units hold at most, by default: the formats' decode caches'
#: bound, so that a window's units fit them (see the module docstring)
DEFAULT_WINDOW_BYTES: Final = DECODED_CACHE_BYTES

# -- a stable pseudorandom permutation ---------------------------------------------------

_ROUNDS: Final = 6
#: a permutation of at most this many elements is tabled once much of it is asked for
_TABLE_MAX: Final = 1 << 20
_MIX1: Final = np.uint64(0xBF58476D1CE4E5B9)
_MIX2: Final = np.uint64(0x94D049BB133111EB)


def _mix(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """splitmix64's finalizer, elementwise (wrapping uint64 arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


class Permutation:
    """A pseudorandom permutation of ``range(size)`` from a key, element by element.

    A balanced Feistel network over the smallest even power of two that holds
    ``size``, with cycle walking: no table, any element computed directly, and the
    same permutation for the same key on every platform and library version (numpy's
    and torch's generators promise no stable stream across versions; a resumed run
    needs one).
    """

    def __init__(self, size: int, key: str) -> None:
        self.size = size
        self._half = max(1, ((size - 1).bit_length() + 1) // 2)
        self._mask = np.uint64((1 << self._half) - 1)
        digest = hashlib.blake2b(key.encode(), digest_size=8 * _ROUNDS).digest()
        self._keys = [np.uint64(k) for k in np.frombuffer(digest, dtype="<u8")]
        self._table: NDArray[np.int64] | None = None

    def __call__(self, index: NDArray[np.int64]) -> NDArray[np.int64]:
        if self.size <= 1:
            return index
        if self._table is not None:
            return self._table[index]
        # A reader walks the whole permutation a step at a time: the whole table (one
        # vectorised pass, ~60 ms for a million) costs less than the steps' small calls
        # (each pays the rounds' numpy overhead). Small permutations only: 8 bytes an
        # element, at most 8 MiB each, and an order keeps four.
        if self.size <= _TABLE_MAX:
            self._table = self._compute(np.arange(self.size, dtype=np.int64))
            return self._table[index]
        return self._compute(index)

    def _compute(self, index: NDArray[np.int64]) -> NDArray[np.int64]:
        x = index.astype(np.uint64)
        with np.errstate(over="ignore"):
            x = self._encrypt(x)
            outside = x >= np.uint64(self.size)
            while outside.any():
                x[outside] = self._encrypt(x[outside])
                outside = x >= np.uint64(self.size)
        return x.astype(np.int64)

    def _encrypt(self, x: NDArray[np.uint64]) -> NDArray[np.uint64]:
        half = np.uint64(self._half)
        left, right = x >> half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << half) | right


# -- an epoch's order --------------------------------------------------------------------


class Order:
    """One epoch's order of a snapshot's samples (see the module docstring).

    Args:
        counts: each member's sample count, in member order (``Snapshot.counts``).
        snapshot: the snapshot's id (it keys the permutations).
        seed: the run's seed.
        epoch: the epoch.
        shuffle: permute (else: members in order, samples as stored).
        window: the most units whose samples are mixed together (None: no bound).
        window_bytes: the most decoded bytes of a window's units (None: no bound; a
            unit of more is a window alone).
        units: each member's units' sample counts, in member order, one entry per
            member (None there: the member is one unit); None: every member is one
            unit. :func:`chunkd.client.datasets.formats.snapshot_units` gives a
            snapshot's.
        unit_bytes: each member's units' decoded bytes, as ``units`` (None there, or
            None for all: 0, nothing decoded whole).
            :func:`chunkd.client.datasets.formats.snapshot_unit_bytes` gives a
            snapshot's.

    Raises:
        ValueError: a negative count, a window below 1, window_bytes below 0, units
            that are not one entry per member or do not add up to their member's
            count, or unit bytes that are not one per unit or are negative.
    """

    def __init__(
        self,
        counts: Sequence[int] | NDArray[np.int64],
        *,
        snapshot: str,
        seed: int,
        epoch: int,
        shuffle: bool = True,
        window: int | None = DEFAULT_WINDOW,
        window_bytes: int | None = DEFAULT_WINDOW_BYTES,
        units: Sequence[Sequence[int] | None] | None = None,
        unit_bytes: Sequence[Sequence[int] | None] | None = None,
    ) -> None:
        sizes = np.asarray(counts, dtype=np.int64).reshape(-1)
        if (sizes < 0).any():
            raise ValueError("a member's sample count is negative")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 unit, or None for all; got {window!r}")
        if window_bytes is not None and window_bytes < 0:
            raise ValueError(
                f"window_bytes must be >= 0, or None for no bound; got {window_bytes!r}"
            )
        self.shuffle = bool(shuffle)
        self.window = window
        self.window_bytes = window_bytes
        self._key = f"chunkd.order:{snapshot}:{seed}:{epoch}"
        #: where each member's first sample is in the snapshot (its index)
        self.member_starts: NDArray[np.int64] = np.concatenate(([0], np.cumsum(sizes))).astype(
            np.int64
        )
        unit_sizes, unit_member = _units(sizes, units)
        #: whether the units were given (the formats' own, as :func:`order_of
        #: <chunkd.client.datasets.loader.order_of>` gives them), not whole members
        self.by_units = units is not None
        #: each unit's samples, units in snapshot order
        self.unit_sizes: NDArray[np.int64] = unit_sizes
        #: the member each unit is of
        self.unit_member: NDArray[np.int64] = unit_member
        #: where each unit's first sample is in the snapshot (its index)
        self.unit_starts: NDArray[np.int64] = np.concatenate(([0], np.cumsum(unit_sizes))).astype(
            np.int64
        )
        #: each unit's decoded bytes (0: read in place)
        self.unit_bytes: NDArray[np.int64] = _unit_bytes(unit_bytes, unit_member, len(sizes))
        #: each unit's first sample in its member
        self.unit_first: NDArray[np.int64] = (
            self.unit_starts[:-1] - self.member_starts[unit_member]
        ).astype(np.int64)
        filled = np.flatnonzero(unit_sizes > 0).astype(np.int64)
        if self.shuffle:
            filled = filled[
                Permutation(len(filled), f"{self._key}:units")(
                    np.arange(len(filled), dtype=np.int64)
                )
            ]
        #: the unit at each position of the units' order (units holding no sample left out)
        self.unit_order: NDArray[np.int64] = filled
        # cum[p]: where the unit at position p of that order starts in the epoch
        self._cum = np.concatenate(([0], np.cumsum(unit_sizes[filled]))).astype(np.int64)
        firsts = window_starts(self.unit_bytes[filled], window, window_bytes)
        #: where each window starts in the units' order (its first unit's position)
        self.window_firsts: NDArray[np.int64] = firsts
        self._window_starts = np.concatenate((self._cum[firsts], self._cum[-1:])).astype(np.int64)
        #: samples in the epoch
        self.total = int(self._cum[-1])
        self._permutations: dict[int, Permutation] = {}

    #: the order's version (:data:`ORDER_VERSION`): 1, the order of schema-1 snapshots
    version: Final = 1

    def __len__(self) -> int:
        return self.total

    def locate(
        self, positions: NDArray[np.int64] | Sequence[int]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """The ``(member, sample in member)`` at each position (``0 <= p < total``).

        Raises:
            IndexError: a position outside the epoch.
        """
        unit, offset = self.locate_units(positions)
        return self.unit_member[unit], self.unit_first[unit] + offset

    def located(self, positions: NDArray[np.int64] | Sequence[int]) -> Located:
        """Everything about each position (:class:`Located`); a unit is the formats'
        only where the order was given them (:attr:`by_units`), else a member.

        Raises:
            IndexError: a position outside the epoch.
        """
        unit, offset = self.locate_units(positions)
        members = self.unit_member[unit]
        unit_of = unit - np.searchsorted(self.unit_member, members, side="left")
        return Located(
            members,
            self.unit_first[unit] + offset,
            unit_of,
            offset,
            self.unit_starts[unit] + offset,
        )

    def locate_units(
        self, positions: NDArray[np.int64] | Sequence[int]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """The ``(unit, sample in unit)`` at each position (``0 <= p < total``); units
        are numbered in snapshot order (:attr:`unit_member` says whose).

        Raises:
            IndexError: a position outside the epoch.
        """
        index = np.asarray(positions, dtype=np.int64).reshape(-1)
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= self.total):
            raise IndexError(f"positions outside an epoch of {self.total} samples")
        if not self.shuffle:
            unit = np.searchsorted(self.unit_starts, index, side="right") - 1
            return unit.astype(np.int64), index - self.unit_starts[unit]
        unit = np.empty_like(index)
        offset = np.empty_like(index)
        windows = np.searchsorted(self._window_starts, index, side="right") - 1
        for w in np.unique(windows).tolist():
            chosen = windows == w
            start = int(self._window_starts[w])
            at = self._permutation(w)(index[chosen] - start) + start
            position = np.searchsorted(self._cum, at, side="right") - 1
            unit[chosen] = self.unit_order[position]
            offset[chosen] = at - self._cum[position]
        return unit, offset

    def locate_windows(
        self, positions: NDArray[np.int64] | Sequence[int]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """The window of each position, and where its sample is in that window's
        samples laid out unit after unit in the units' order (:meth:`window_units`):
        what :meth:`locate_units` computes on the way (shuffled or not).

        Raises:
            IndexError: a position outside the epoch.
        """
        index = np.asarray(positions, dtype=np.int64).reshape(-1)
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= self.total):
            raise IndexError(f"positions outside an epoch of {self.total} samples")
        if len(index) and int(index[-1]) - int(index[0]) == len(index) - 1:
            # a run of positions (a step's): one window, unless it crosses into the next
            first, last = np.searchsorted(self._window_starts, index[[0, -1]], side="right") - 1
            if first == last:
                w = int(first)
                at = index - self._window_starts[w]
                if self.shuffle:
                    at = self._permutation(w)(at)
                return np.full(len(index), w, dtype=np.int64), at
        windows = np.searchsorted(self._window_starts, index, side="right") - 1
        at = index - self._window_starts[windows]
        if self.shuffle:
            for w in np.unique(windows).tolist():
                chosen = windows == w
                at[chosen] = self._permutation(w)(at[chosen])
        return windows.astype(np.int64), at

    def window_units(self, window: int) -> NDArray[np.int64]:
        """The units of window ``window``, in the units' order (snapshot numbering)."""
        last = self.window_firsts[window + 1] if window + 1 < len(self.window_firsts) else None
        return self.unit_order[int(self.window_firsts[window]) : last]

    def window_keys(self, window: int) -> list[tuple[int, int]]:
        """The units of window ``window`` as ``(member, unit in member)``, in the units'
        order (the formats' units where the order was given them)."""
        found = self.window_units(window)
        members = self.unit_member[found]
        first = np.searchsorted(self.unit_member, members, side="left")
        return list(zip(members.tolist(), (found - first).tolist(), strict=True))

    def rows_at(
        self, windows: NDArray[np.int64], at: NDArray[np.int64]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
        """``(member, sample in member, unit in member, row in unit)`` of places ``at``
        of ``windows`` (:meth:`locate_windows`)."""
        unit, row = self.units_at(windows, at)
        members = self.unit_member[unit]
        unit_of = unit - np.searchsorted(self.unit_member, members, side="left")
        return members, self.unit_first[unit] + row, unit_of, row

    def units_at(
        self, windows: NDArray[np.int64], at: NDArray[np.int64]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """The ``(unit, sample in unit)`` of places ``at`` of ``windows``
        (:meth:`locate_windows`)."""
        where = at + self._window_starts[windows]
        position = np.searchsorted(self._cum, where, side="right") - 1
        return self.unit_order[position], where - self._cum[position]

    def indices(self, positions: NDArray[np.int64] | Sequence[int]) -> NDArray[np.int64]:
        """The snapshot index of the sample at each position."""
        unit, offset = self.locate_units(positions)
        return self.unit_starts[unit] + offset

    def _permutation(self, w: int) -> Permutation:
        found = self._permutations.get(w)
        if found is None:
            if len(self._permutations) >= 4:
                self._permutations.clear()
            size = int(self._window_starts[w + 1] - self._window_starts[w])
            found = self._permutations[w] = Permutation(size, f"{self._key}:window:{w}")
        return found


def window_starts(
    costs: NDArray[np.int64], window: int | None, window_bytes: int | None
) -> NDArray[np.int64]:
    """Where each window starts in a units' order whose units decode to ``costs`` bytes:
    greedily, each window the longest run from where the last ended of at most
    ``window`` units and ``window_bytes`` bytes (None: no such bound), and at least one
    unit (a unit of more than ``window_bytes`` is a window alone). O(units)."""
    n = len(costs)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if window_bytes is None:
        return np.arange(0, n, n if window is None else window, dtype=np.int64)
    here = np.arange(n, dtype=np.int64)
    ends = np.full(n, n, dtype=np.int64) if window is None else np.minimum(here + window, n)
    cum = np.concatenate(([0], np.cumsum(costs))).astype(np.int64)
    # where the longest run from each unit of at most window_bytes ends (one unit at least)
    fits = np.searchsorted(cum, cum[:-1] + window_bytes, side="right") - 1
    ends = np.minimum(ends, np.maximum(fits, here + 1))
    following = ends.tolist()
    firsts: list[int] = []
    at = 0
    while at < n:
        firsts.append(at)
        at = following[at]
    return np.asarray(firsts, dtype=np.int64)


# -- the order of a paged snapshot (version 2) -------------------------------------------

#: the order of a schema-2 (paged) snapshot; a schema-1 snapshot's is version 1 (:class:`Order`)
ORDER_VERSION: Final = 2
#: the most pages whose units an order of version 2 mixes together: a group (see the
#: module docstring; part of the version's definition: changing it changes every
#: order). Two groups' pages fit a snapshot's page cache (``chunkd.snapshot.PAGE_CACHE``,
#: 8), so a reader crossing from one group to the next loads each page once
GROUP_PAGES: Final = 4
#: the most members of a group, unless it is one page: two pages' most (a page holds at
#: most 16,384), so every group but an epoch's last has two pages at least, and what a
#: reader holds of the manifest is bounded in members whatever the pages' sizes
GROUP_MEMBERS: Final = 32_768
#: groups a :class:`PagedOrder` keeps built (a step may cross from one to the next)
GROUPS_HELD: Final = 2
#: the most bytes of pages' unit tables a process keeps (:func:`page_units`), shared by
#: every order: a page's units depend on its content alone
PAGE_UNITS_BYTES: Final = 4 << 20


def order_version(snapshot: object) -> int:
    """The version of ``snapshot``'s order: 2 for a schema-2 (paged) snapshot
    (:class:`PagedOrder`), 1 for a schema-1 one (:class:`Order`)."""
    return ORDER_VERSION if int(getattr(snapshot, "schema", 2)) >= 2 else 1


class Located(NamedTuple):
    """Where positions of an order are: each one's member, its sample in the member,
    its unit in the member (what the member's format decodes whole), its row in that
    unit, and its snapshot index."""

    members: NDArray[np.int64]
    samples: NDArray[np.int64]
    units: NDArray[np.int64]
    rows: NDArray[np.int64]
    indices: NDArray[np.int64]


class PageEntry(Protocol):
    """What an order reads of a root's entry for a page (``chunkd.snapshot.PageRef``)."""

    @property
    def id(self) -> str: ...

    @property
    def members(self) -> int: ...

    @property
    def samples(self) -> int: ...


class PagedSnapshot(Protocol):
    """What a :class:`PagedOrder` reads of a snapshot (``chunkd.snapshot.Snapshot`` of
    schema 2): its id, its root's pages, and a page's members when a group needs them."""

    @property
    def id(self) -> str: ...

    @property
    def pages(self) -> Sequence[PageEntry]: ...

    def page_members(self, page: int) -> Sequence[Member]: ...


class EpochOrder(Protocol):
    """What the loader reads of an epoch's order: :class:`Order` (version 1) and
    :class:`PagedOrder` (version 2) both are one."""

    @property
    def version(self) -> int: ...

    @property
    def total(self) -> int: ...

    @property
    def shuffle(self) -> bool: ...

    @property
    def by_units(self) -> bool: ...

    def __len__(self) -> int: ...

    def locate(
        self, positions: NDArray[np.int64] | Sequence[int]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]: ...

    def located(self, positions: NDArray[np.int64] | Sequence[int]) -> Located: ...

    def locate_windows(
        self, positions: NDArray[np.int64] | Sequence[int]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]: ...

    def window_keys(self, window: int) -> list[tuple[int, int]]: ...

    def rows_at(
        self, windows: NDArray[np.int64], at: NDArray[np.int64]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]: ...

    def indices(self, positions: NDArray[np.int64] | Sequence[int]) -> NDArray[np.int64]: ...


class PageUnits(NamedTuple):
    """A page's units, in member order: each one's member (in the page), its number in
    its member, its first sample in its member, its samples, its decoded bytes, and
    its first sample in the page."""

    member: NDArray[np.int64]
    unit: NDArray[np.int64]
    first: NDArray[np.int64]
    size: NDArray[np.int64]
    cost: NDArray[np.int64]
    start: NDArray[np.int64]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self)


def page_units(snapshot: PagedSnapshot, page: int) -> PageUnits:
    """Page ``page``'s units (:class:`PageUnits`), from its members' formats
    (:func:`~chunkd.client.datasets.formats.units_of`,
    :func:`~chunkd.client.datasets.formats.unit_bytes_of`); kept by page id, at most
    :data:`PAGE_UNITS_BYTES` of them a process.

    Raises:
        ManifestError: a member's units do not add up to its samples, or its decoded
            bytes are not one per unit, or negative.
        DatasetNotFoundError: the page source has no such page.
    """
    page_id = snapshot.pages[page].id
    found = _PAGE_UNITS.get(page_id)
    if found is not None:
        return found
    members = snapshot.page_members(page)
    formats: dict[str, Format] = {}
    sizes: list[int] = []
    costs: list[int] = []
    lengths: list[int] = []
    for member in members:
        fmt = formats.get(member.format)
        if fmt is None:
            fmt = formats[member.format] = format_of(member.format)
        counts = fmt.units(member)
        spent = fmt.unit_bytes(member)
        if len(spent) != len(counts) or sum(counts) != member.samples:
            raise ManifestError(
                f"member {member.key!r} (page {page_id}): its format cuts it into units of "
                f"{sum(counts)} samples with {len(spent)} decoded sizes for {len(counts)} "
                f"units, where it holds {member.samples}: its metadata is damaged"
            )
        sizes.extend(counts)
        costs.extend(spent)
        lengths.append(len(counts))
    size = np.asarray(sizes, dtype=np.int64).reshape(-1)
    cost = np.asarray(costs, dtype=np.int64).reshape(-1)
    if (size < 0).any() or (cost < 0).any():
        raise ManifestError(f"page {page_id}: a unit's samples or decoded bytes are negative")
    per = np.asarray(lengths, dtype=np.int64).reshape(-1)
    member_of = np.repeat(np.arange(len(per), dtype=np.int64), per)
    firsts = np.cumsum(per) - per  # each member's first unit
    cum = np.concatenate(([0], np.cumsum(size))).astype(np.int64)
    start = cum[:-1]
    found = PageUnits(
        member_of,
        np.arange(len(size), dtype=np.int64) - firsts[member_of],
        start - cum[firsts][member_of],
        size,
        cost,
        start,
    )
    _PAGE_UNITS.put(page_id, found)
    return found


class _PageUnitsCache:
    """Pages' units by page id, the most recently used last, within a byte bound."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._held: OrderedDict[str, PageUnits] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, page_id: str) -> PageUnits | None:
        with self._lock:
            found = self._held.get(page_id)
            if found is not None:
                self._held.move_to_end(page_id)
            return found

    def put(self, page_id: str, units: PageUnits) -> None:
        size = units.nbytes
        if size > self.bound:
            return
        with self._lock:
            old = self._held.pop(page_id, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._held[page_id] = units
            self._bytes += size
            while self._bytes > self.bound:
                _, gone = self._held.popitem(last=False)
                self._bytes -= gone.nbytes

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
            self._bytes = 0


_PAGE_UNITS: Final = _PageUnitsCache(PAGE_UNITS_BYTES)


class _Group:
    """One group's units in its units' order (units holding no sample left out), where
    each starts in the group's samples, and where its windows start."""

    __slots__ = ("cum", "first", "firsts", "index", "member", "starts", "unit")

    def __init__(
        self,
        member: NDArray[np.int64],
        unit: NDArray[np.int64],
        first: NDArray[np.int64],
        index: NDArray[np.int64],
        cum: NDArray[np.int64],
        firsts: NDArray[np.int64],
    ) -> None:
        self.member = member
        self.unit = unit
        self.first = first
        self.index = index
        self.cum = cum
        self.firsts = firsts
        self.starts: NDArray[np.int64] = np.concatenate((cum[firsts], cum[-1:])).astype(np.int64)

    def window_span(self, w: int) -> tuple[int, int]:
        """Window ``w``'s units: positions ``first .. stop`` of the units' order."""
        stop = int(self.firsts[w + 1]) if w + 1 < len(self.firsts) else len(self.member)
        return int(self.firsts[w]), stop


def _group_firsts(members: NDArray[np.int64], most: int) -> NDArray[np.int64]:
    """Where each group starts in a pages' order whose pages hold ``members``, and their
    end: greedily, each group the longest run from where the last ended of at most
    ``most`` pages and :data:`GROUP_MEMBERS` members, and one page at least. O(pages)."""
    count = len(members)
    firsts = [0]
    held = pages = 0
    for at, size in enumerate(members.tolist()):
        if pages and (pages >= most or held + size > GROUP_MEMBERS):
            firsts.append(at)
            held = pages = 0
        held += size
        pages += 1
    if count:
        firsts.append(count)
    return np.asarray(firsts, dtype=np.int64)


#: a window of a :class:`PagedOrder` is numbered ``group << _WINDOW_BITS | window in group``
_WINDOW_BITS: Final = 32


class PagedOrder:
    """One epoch's order of a schema-2 (paged) snapshot's samples: order version 2
    (see the module docstring).

    Built from the root alone (O(pages)): the pages are permuted and taken in groups of
    :data:`GROUP_PAGES`; a group's units are loaded, permuted and cut into windows
    when a position of the group is first asked for (at most :data:`GROUPS_HELD`
    groups are kept built).

    Args:
        snapshot: the snapshot (its root's pages, and its page source for the members).
        seed: the run's seed.
        epoch: the epoch.
        shuffle: permute (else: members in key order, samples as stored).
        window: the most units whose samples are mixed together (None: no bound; a
            group's units at most).
        window_bytes: the most decoded bytes of a window's units (None: no bound; a
            unit of more is a window alone).
        group_pages: pages a group mixes (:data:`GROUP_PAGES`, which order version 2
            is defined with; another makes another order, which no loader state
            names: for measuring only).

    Raises:
        ValueError: a window below 1, window_bytes below 0, group_pages below 1, or a
            snapshot of schema 1 (its order is :class:`Order`).
    """

    #: the order's version (:data:`ORDER_VERSION`)
    version: Final = ORDER_VERSION
    #: units are the formats' own (a Parquet row group), always
    by_units: Final = True

    def __init__(
        self,
        snapshot: PagedSnapshot,
        *,
        seed: int,
        epoch: int,
        shuffle: bool = True,
        window: int | None = DEFAULT_WINDOW,
        window_bytes: int | None = DEFAULT_WINDOW_BYTES,
        group_pages: int = GROUP_PAGES,
    ) -> None:
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 unit, or None for all; got {window!r}")
        if window_bytes is not None and window_bytes < 0:
            raise ValueError(
                f"window_bytes must be >= 0, or None for no bound; got {window_bytes!r}"
            )
        if group_pages < 1:
            raise ValueError(f"group_pages must be >= 1; got {group_pages!r}")
        if order_version(snapshot) != ORDER_VERSION:
            raise ValueError(
                f"snapshot {snapshot.id} is of schema 1: its order is version 1 (Order), "
                "not a paged order"
            )
        self.snapshot = snapshot
        self.group_pages = group_pages
        self.shuffle = bool(shuffle)
        self.window = window
        self.window_bytes = window_bytes
        self._key = f"chunkd.order:{snapshot.id}:{seed}:{epoch}"
        refs = snapshot.pages
        count = len(refs)
        samples = np.fromiter((r.samples for r in refs), dtype=np.int64, count=count)
        members = np.fromiter((r.members for r in refs), dtype=np.int64, count=count)
        #: each page's first member, and its first sample (snapshot indices)
        self.page_member_starts: NDArray[np.int64] = np.concatenate(
            ([0], np.cumsum(members))
        ).astype(np.int64)
        self.page_sample_starts: NDArray[np.int64] = np.concatenate(
            ([0], np.cumsum(samples))
        ).astype(np.int64)
        filled = np.flatnonzero(samples > 0).astype(np.int64)
        if self.shuffle:
            filled = filled[
                Permutation(len(filled), f"{self._key}:pages")(
                    np.arange(len(filled), dtype=np.int64)
                )
            ]
        #: the page at each place of the pages' order (pages holding no sample left out)
        self.page_order: NDArray[np.int64] = filled
        cum = np.concatenate(([0], np.cumsum(samples[filled]))).astype(np.int64)
        #: where each group starts in the pages' order, and their end
        self.group_firsts: NDArray[np.int64] = _group_firsts(members[filled], group_pages)
        #: where each group starts in the epoch, and the epoch's end
        self.group_starts: NDArray[np.int64] = cum[self.group_firsts]
        #: samples in the epoch
        self.total = int(cum[-1])
        self._groups: OrderedDict[int, _Group] = OrderedDict()
        self._permutations: OrderedDict[tuple[int, int], Permutation] = OrderedDict()
        self._lock = threading.Lock()
        #: groups built so far (each loads its pages' units)
        self.groups_built = 0

    def __len__(self) -> int:
        return self.total

    @property
    def groups(self) -> int:
        """How many groups the epoch has."""
        return len(self.group_starts) - 1

    def pages_of(self, group: int) -> NDArray[np.int64]:
        """The pages of group ``group``, in the pages' order."""
        return self.page_order[int(self.group_firsts[group]) : int(self.group_firsts[group + 1])]

    def locate(
        self, positions: NDArray[np.int64] | Sequence[int]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """The ``(member, sample in member)`` at each position (``0 <= p < total``).

        Raises:
            IndexError: a position outside the epoch.
            ManifestError, DatasetNotFoundError: a page the positions need is damaged or
                missing.
        """
        found = self.located(positions)
        return found.members, found.samples

    def located(self, positions: NDArray[np.int64] | Sequence[int]) -> Located:
        """Everything about each position (:class:`Located`).

        Raises:
            IndexError: a position outside the epoch.
        """
        windows, at = self.locate_windows(positions)
        members, samples, units, rows, indices = self._rows(windows, at, True)
        return Located(members, samples, units, rows, indices)

    def indices(self, positions: NDArray[np.int64] | Sequence[int]) -> NDArray[np.int64]:
        """The snapshot index of the sample at each position."""
        return self.located(positions).indices

    def locate_windows(
        self, positions: NDArray[np.int64] | Sequence[int]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """The window of each position (numbered ``group << 32 | window in group``), and
        where its sample is in that window's samples laid out unit after unit in the
        units' order (:meth:`window_keys`).

        Raises:
            IndexError: a position outside the epoch.
        """
        index = np.asarray(positions, dtype=np.int64).reshape(-1)
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= self.total):
            raise IndexError(f"positions outside an epoch of {self.total} samples")
        windows = np.empty_like(index)
        at = np.empty_like(index)
        if not len(index):
            return windows, at
        groups = np.searchsorted(self.group_starts, index, side="right") - 1
        first = int(groups[0])
        if bool(np.all(groups == first)):  # a step's run: one group, most often
            windows[:], at[:] = self._group_windows(first, index - self.group_starts[first])
            return windows, at
        for g in np.unique(groups).tolist():
            chosen = groups == g
            windows[chosen], at[chosen] = self._group_windows(
                g, index[chosen] - self.group_starts[g]
            )
        return windows, at

    def window_keys(self, window: int) -> list[tuple[int, int]]:
        """The units of window ``window`` as ``(member, unit in member)``, in the units'
        order."""
        g, w = int(window) >> _WINDOW_BITS, int(window) & ((1 << _WINDOW_BITS) - 1)
        group = self._group(g)
        first, stop = group.window_span(w)
        return list(
            zip(group.member[first:stop].tolist(), group.unit[first:stop].tolist(), strict=True)
        )

    def rows_at(
        self, windows: NDArray[np.int64], at: NDArray[np.int64]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
        """``(member, sample in member, unit in member, row in unit)`` of places ``at``
        of ``windows`` (:meth:`locate_windows`)."""
        members, samples, units, rows, _ = self._rows(windows, at, False)
        return members, samples, units, rows

    def _rows(
        self, windows: NDArray[np.int64], at: NDArray[np.int64], indices: bool
    ) -> tuple[NDArray[np.int64], ...]:
        members = np.empty_like(at)
        samples = np.empty_like(at)
        units = np.empty_like(at)
        rows = np.empty_like(at)
        index = np.empty_like(at) if indices else at
        if not len(at):
            return members, samples, units, rows, index
        groups = windows >> _WINDOW_BITS
        inner = windows & ((1 << _WINDOW_BITS) - 1)
        touched = np.unique(groups).tolist()
        for g in touched:
            chosen: slice | NDArray[np.bool_] = slice(None) if len(touched) == 1 else groups == g
            group = self._group(g)
            where = at[chosen] + group.starts[inner[chosen]]
            place = np.searchsorted(group.cum, where, side="right") - 1
            row = where - group.cum[place]
            members[chosen] = group.member[place]
            samples[chosen] = group.first[place] + row
            units[chosen] = group.unit[place]
            rows[chosen] = row
            if indices:
                index[chosen] = group.index[place] + row
        return members, samples, units, rows, index

    def _group_windows(
        self, g: int, local: NDArray[np.int64]
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        group = self._group(g)
        w = np.searchsorted(group.starts, local, side="right") - 1
        at = local - group.starts[w]
        if self.shuffle:
            for one in np.unique(w).tolist():
                chosen = w == one
                at[chosen] = self._permutation(g, one, group)(at[chosen])
        return (np.int64(g) << _WINDOW_BITS) | w.astype(np.int64), at

    def _group(self, g: int) -> _Group:
        with self._lock:
            found = self._groups.get(g)
            if found is not None:
                self._groups.move_to_end(g)
                return found
        found = self._build(g)
        with self._lock:
            self._groups[g] = found
            self._groups.move_to_end(g)
            while len(self._groups) > GROUPS_HELD:
                self._groups.popitem(last=False)
            self.groups_built += 1
        return found

    def _build(self, g: int) -> _Group:
        if not 0 <= g < self.groups:
            raise IndexError(f"group {g} of an epoch of {self.groups} groups")
        pages = self.pages_of(g).tolist()
        parts = [page_units(self.snapshot, p) for p in pages]
        member = np.concatenate(
            [u.member + self.page_member_starts[p] for p, u in zip(pages, parts, strict=True)]
        )
        index = np.concatenate(
            [u.start + self.page_sample_starts[p] for p, u in zip(pages, parts, strict=True)]
        )
        size = np.concatenate([u.size for u in parts])
        filled = np.flatnonzero(size > 0).astype(np.int64)
        if self.shuffle:
            filled = filled[
                Permutation(len(filled), f"{self._key}:group:{g}:units")(
                    np.arange(len(filled), dtype=np.int64)
                )
            ]
        cum = np.concatenate(([0], np.cumsum(size[filled]))).astype(np.int64)
        expected = int(self.group_starts[g + 1] - self.group_starts[g])
        if int(cum[-1]) != expected:  # page_units checks each member; belt and braces
            raise ManifestError(
                f"the units of group {g}'s pages hold {int(cum[-1])} samples, where the "
                f"root says {expected}: a page is damaged"
            )
        cost = np.concatenate([u.cost for u in parts])[filled]
        return _Group(
            member[filled],
            np.concatenate([u.unit for u in parts])[filled],
            np.concatenate([u.first for u in parts])[filled],
            index[filled],
            cum,
            window_starts(cost, self.window, self.window_bytes),
        )

    def _permutation(self, g: int, w: int, group: _Group) -> Permutation:
        with self._lock:
            found = self._permutations.get((g, w))
            if found is not None:
                self._permutations.move_to_end((g, w))
                return found
        size = int(group.starts[w + 1] - group.starts[w])
        found = Permutation(size, f"{self._key}:group:{g}:window:{w}")
        with self._lock:
            self._permutations[g, w] = found
            while len(self._permutations) > 4:
                self._permutations.popitem(last=False)
        return found


def _unit_bytes(
    unit_bytes: Sequence[Sequence[int] | None] | None,
    unit_member: NDArray[np.int64],
    members: int,
) -> NDArray[np.int64]:
    """Each unit's decoded bytes, units in snapshot order (0 where none are given)."""
    found = np.zeros(len(unit_member), dtype=np.int64)
    if unit_bytes is None:
        return found
    if len(unit_bytes) != members:
        raise ValueError(f"unit_bytes: one entry per member, {members}; got {len(unit_bytes)}")
    per = np.bincount(unit_member, minlength=members).tolist()
    starts = np.concatenate(([0], np.cumsum(per))).astype(np.int64).tolist()
    for m, costs in enumerate(unit_bytes):
        if costs is None:
            continue
        if len(costs) != per[m]:
            raise ValueError(f"unit_bytes of member {m}: one per unit, {per[m]}; got {len(costs)}")
        found[starts[m] : starts[m + 1]] = costs
    if (found < 0).any():
        raise ValueError("a unit's decoded bytes are negative")
    return found


def _units(
    sizes: NDArray[np.int64], units: Sequence[Sequence[int] | None] | None
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Each unit's samples and member, units in snapshot order."""
    members = np.arange(len(sizes), dtype=np.int64)
    if units is None or all(u is None for u in units):
        if units is not None and len(units) != len(sizes):
            raise ValueError(f"units: one entry per member, {len(sizes)}; got {len(units)}")
        return sizes.copy(), members
    if len(units) != len(sizes):
        raise ValueError(f"units: one entry per member, {len(sizes)}; got {len(units)}")
    counts = sizes.tolist()
    flat: list[int] = []
    lengths: list[int] = []
    for m, u in enumerate(units):
        if u is None:
            flat.append(counts[m])
            lengths.append(1)
        else:
            flat.extend(u)
            lengths.append(len(u))
    unit_sizes = np.asarray(flat, dtype=np.int64).reshape(-1)
    if (unit_sizes < 0).any():
        raise ValueError("a unit's sample count is negative")
    unit_member = np.repeat(members, lengths).astype(np.int64)
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    cum = np.concatenate(([0], np.cumsum(unit_sizes))).astype(np.int64)
    sums = cum[ends] - cum[ends - np.asarray(lengths, dtype=np.int64)]
    bad = np.flatnonzero(sums != sizes)
    if len(bad):
        m = int(bad[0])
        raise ValueError(
            f"the units of member {m} add up to {int(sums[m])} samples, not its {counts[m]}"
        )
    return unit_sizes, unit_member


# -- how good an order is ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OrderQuality:
    """What reading a run of positions of an order costs, and how well it mixes.

    Attributes:
        positions: how many positions were measured.
        members_touched: distinct members they read.
        members_held: the most members open at once, a member being open from its
            first sample in the run to its last (what a reader must hold to never
            open a member twice).
        mean_gap: the mean distance ``|i - j|`` between the snapshot indices of
            adjacent samples (a uniform shuffle of N samples: about N / 3; in order: 1).
        units_touched: distinct units they read.
        units_held: the most units open at once, as ``members_held``: the decoded
            working set a reader needs to decode each unit once.
    """

    positions: int
    members_touched: int
    members_held: int
    mean_gap: float
    units_touched: int = 0
    units_held: int = 0


def quality(order: EpochOrder, start: int = 0, stop: int | None = None) -> OrderQuality:
    """How positions ``start .. stop`` (default: the whole epoch) of ``order`` read.

    For the bench: compare an order with ``window=None`` (a uniform shuffle of every
    sample) on the same snapshot.
    """
    stop = order.total if stop is None else min(stop, order.total)
    if stop <= start:
        return OrderQuality(0, 0, 0, 0.0)
    found = order.located(np.arange(start, stop, dtype=np.int64))
    index = found.indices
    gap = float(np.abs(np.diff(index)).mean()) if len(index) > 1 else 0.0
    members_touched, members_held = _held(found.members)
    units_touched, units_held = _held((found.members << 32) | found.units)
    return OrderQuality(len(index), members_touched, members_held, gap, units_touched, units_held)


def _held(which: NDArray[np.int64]) -> tuple[int, int]:
    """How many distinct things ``which`` names, and the most open at once."""
    # Each is open over [its first position, its last position]; the most intervals
    # covering one position is the sweep's maximum.
    touched, compact = np.unique(which, return_inverse=True)
    count = len(touched)
    first = np.full(count, len(which), dtype=np.int64)
    last = np.full(count, -1, dtype=np.int64)
    steps = np.arange(len(which), dtype=np.int64)
    np.minimum.at(first, compact, steps)
    np.maximum.at(last, compact, steps)
    opened = np.bincount(first, minlength=len(which) + 1)
    closed = np.bincount(last + 1, minlength=len(which) + 1)
    return count, int(np.cumsum(opened - closed).max())
