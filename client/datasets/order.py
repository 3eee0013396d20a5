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

Order version 2: a schema-2 (paged) snapshot's
    The order above needs every unit, so every member, of the snapshot. A schema-2
    snapshot's order is built from its root alone, in O(pages): its pages permuted and
    taken in groups, each group's units ordered as above when a position of it is first
    asked for (:class:`~chunkd.client.datasets.paged_order.PagedOrder`, whose module
    says how and what it measured). The version is recorded in a loader state's format
    (:func:`order_version`, :mod:`chunkd.client.datasets.state`).

Where it lives
    This module is the order's definition and version 1 (:class:`Order`), and how good an
    order is (:func:`quality`). Beside it: :mod:`~chunkd.client.datasets.permutation`
    (the keyed permutation), :mod:`~chunkd.client.datasets.epoch` (what every version
    gives the loader: :class:`EpochOrder`, :class:`Located`, the defaults, the window
    cut) and :mod:`~chunkd.client.datasets.paged_order` (version 2). Every name of
    theirs that importers used from here is still importable from here.

This module needs numpy only: no torch, no jax, no client.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import NDArray

from chunkd.client.datasets.epoch import (
    DEFAULT_WINDOW,
    DEFAULT_WINDOW_BYTES,
    ORDER_VERSION,
    EpochOrder,
    Located,
    order_version,
    window_starts,
)
from chunkd.client.datasets.paged_order import (
    GROUP_MEMBERS,
    GROUP_PAGES,
    GROUPS_HELD,
    PAGE_UNITS_BYTES,
    PagedOrder,
    PageUnits,
    page_units,
)
from chunkd.client.datasets.permutation import Permutation

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


# -- an epoch's order (version 1) -------------------------------------------------------


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
