"""The read order of an epoch: one pure function of (snapshot, seed, epoch).

What the order depends on
    The snapshot's id and its members' **units** (below) with their sample counts, in
    member order, ``seed``, ``epoch``, and the order's two settings: ``shuffle`` and
    ``window``. Nothing else: not ranks, workers, batch sizes, the machine, or numpy's
    and torch's versions. The shuffles are keyed pseudorandom permutations
    (:class:`Permutation`, a Feistel network) whose keys name the snapshot, seed and
    epoch::

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
    anywhere in the dataset). Then each run of ``window`` consecutive units of that
    order (the last run may be shorter) is a **window**, and the samples of a window
    are permuted together: the epoch reads window 0's samples in a shuffled order,
    then window 1's, and so on. A reader reading positions in order therefore holds at
    most ``window`` units (so at most ``window`` members) inside a window, and at most
    ``2 * window`` across a window's edge, whatever the dataset's size. Each unit is in
    one window, and a window's samples all come before the next window's: a reader
    whose cache of decoded units holds ``window`` of them decodes each unit once an
    epoch. ``window=None`` makes one window of every unit: a uniform shuffle of all
    samples (the baseline :func:`quality` measures against). ``shuffle=False``:
    members in key order, samples as stored (positions are snapshot indices).

The default window: 16 units
    Measured with :func:`quality` on 64 members of 8 row groups of 1000 rows (512
    units; the whole epoch, seed 1). The mean distance between adjacent samples is
    0.87 of a full shuffle's at window 8, 0.93 at 16 and 0.98 at 32 (a window's units
    are drawn from the whole dataset). What the window buys is how many units a batch
    draws from: a run of 1024 positions touches 9 units (8.5 members) at window 8, 17
    (15.3) at 16 and 33 (26.9) at 32, against 443 units (all 64 members) for a full
    shuffle. 16 doubles 8's mix within a batch while its working set, 16 units, fits
    the Parquet row-group cache (64 groups, 256 MiB) for row groups of up to 16 MiB
    decoded: reading the epoch in order then decodes each row group once. 32 would
    fit only groups of up to 8 MiB, and thrash the cache beyond (an LRU of 256 MiB
    decodes 0.5 groups per row at window 32 with 16 MiB groups, 0.75 at window 16
    with 64 MiB groups: for big row groups, choose ``window`` of at most 256 MiB over
    the group's decoded size).

Cost
    :meth:`Order.locate` maps any positions to their ``(member, sample)`` directly: a
    binary search for the window, the window's permutation (O(1) expected), and a
    binary search for the unit. Nothing of the size of the epoch is built; the only
    tables are per member and per unit (the units' order, their members, first
    samples and cumulative counts).

This module needs numpy only: no torch, no jax, no client.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import NDArray

__all__ = ["DEFAULT_WINDOW", "Order", "OrderQuality", "Permutation", "quality"]

#: units whose samples are mixed together, by default (see the module docstring)
DEFAULT_WINDOW: Final = 16

# -- a stable pseudorandom permutation ---------------------------------------------------

_ROUNDS: Final = 6
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

    def __call__(self, index: NDArray[np.int64]) -> NDArray[np.int64]:
        if self.size <= 1:
            return index
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
        window: units whose samples are mixed together (None: all of them).
        units: each member's units' sample counts, in member order, one entry per
            member (None there: the member is one unit); None: every member is one
            unit. :func:`chunkd.client.datasets.formats.snapshot_units` gives a
            snapshot's.

    Raises:
        ValueError: a negative count, a window below 1, or units that are not one
            entry per member or do not add up to their member's count.
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
        units: Sequence[Sequence[int] | None] | None = None,
    ) -> None:
        sizes = np.asarray(counts, dtype=np.int64).reshape(-1)
        if (sizes < 0).any():
            raise ValueError("a member's sample count is negative")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 unit, or None for all; got {window!r}")
        self.shuffle = bool(shuffle)
        self.window = window
        self._key = f"chunkd.order:{snapshot}:{seed}:{epoch}"
        #: where each member's first sample is in the snapshot (its index)
        self.member_starts: NDArray[np.int64] = np.concatenate(([0], np.cumsum(sizes))).astype(
            np.int64
        )
        unit_sizes, unit_member = _units(sizes, units)
        #: each unit's samples, units in snapshot order
        self.unit_sizes: NDArray[np.int64] = unit_sizes
        #: the member each unit is of
        self.unit_member: NDArray[np.int64] = unit_member
        #: where each unit's first sample is in the snapshot (its index)
        self.unit_starts: NDArray[np.int64] = np.concatenate(([0], np.cumsum(unit_sizes))).astype(
            np.int64
        )
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
        per = len(filled) if window is None else window
        firsts = np.arange(0, len(filled), max(1, per), dtype=np.int64)
        self._window_starts = np.concatenate((self._cum[firsts], self._cum[-1:])).astype(np.int64)
        #: samples in the epoch
        self.total = int(self._cum[-1])
        self._permutations: dict[int, Permutation] = {}

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

    def indices(self, positions: NDArray[np.int64] | Sequence[int]) -> NDArray[np.int64]:
        """The snapshot index of the sample at each position."""
        unit, offset = self.locate_units(positions)
        return self.unit_starts[unit] + offset

    def _permutation(self, w: int) -> Permutation:
        found = self._permutations.get(w)
        if found is None:
            if len(self._permutations) >= 64:
                self._permutations.clear()
            size = int(self._window_starts[w + 1] - self._window_starts[w])
            found = self._permutations[w] = Permutation(size, f"{self._key}:window:{w}")
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


def quality(order: Order, start: int = 0, stop: int | None = None) -> OrderQuality:
    """How positions ``start .. stop`` (default: the whole epoch) of ``order`` read.

    For the bench: compare an order with ``window=None`` (a uniform shuffle of every
    sample) on the same snapshot.
    """
    stop = order.total if stop is None else min(stop, order.total)
    if stop <= start:
        return OrderQuality(0, 0, 0, 0.0)
    positions = np.arange(start, stop, dtype=np.int64)
    unit, offset = order.locate_units(positions)
    index = order.unit_starts[unit] + offset
    gap = float(np.abs(np.diff(index)).mean()) if len(index) > 1 else 0.0
    member = order.unit_member[unit]
    members_touched, members_held = _held(member, len(order.member_starts))
    units_touched, units_held = _held(unit, len(order.unit_sizes))
    return OrderQuality(len(index), members_touched, members_held, gap, units_touched, units_held)


def _held(which: NDArray[np.int64], count: int) -> tuple[int, int]:
    """How many distinct things ``which`` names, and the most open at once."""
    # Each is open over [its first position, its last position]; the most intervals
    # covering one position is the sweep's maximum.
    touched = np.unique(which)
    first = np.full(count, len(which), dtype=np.int64)
    last = np.full(count, -1, dtype=np.int64)
    steps = np.arange(len(which), dtype=np.int64)
    np.minimum.at(first, which, steps)
    np.maximum.at(last, which, steps)
    opened = np.bincount(first[touched], minlength=len(which) + 1)
    closed = np.bincount(last[touched] + 1, minlength=len(which) + 1)
    return len(touched), int(np.cumsum(opened - closed).max())
