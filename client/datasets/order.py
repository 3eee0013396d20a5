"""The read order of an epoch: one pure function of (snapshot, seed, epoch).

What the order depends on
    The snapshot's id and its members' sample counts (in member order), ``seed``,
    ``epoch``, and the order's two settings: ``shuffle`` and ``window``. Nothing else:
    not ranks, workers, batch sizes, the machine, or numpy's and torch's versions. The
    shuffles are keyed pseudorandom permutations (:class:`Permutation`, a Feistel
    network) whose keys name the snapshot, seed and epoch::

        chunkd.order:{snapshot}:{seed}:{epoch}:members        the members' order
        chunkd.order:{snapshot}:{seed}:{epoch}:window:{w}     the samples of window w

    so two snapshots, seeds or epochs get unrelated orders, and the same ones get the
    same order on every machine, for as long as these keys stay (changing them
    changes every saved order; a loader state records what it needs to check it,
    :mod:`chunkd.client.datasets.loader`).

Locality: members shuffled, then samples mixed within a window of members
    The members are permuted first. Then each run of ``window`` consecutive members
    of that order (the last run may be shorter) is a **window**, and the samples of a
    window are permuted together: the epoch reads window 0's samples in a shuffled
    order, then window 1's, and so on. A reader reading positions in order therefore
    holds at most ``window`` members open inside a window, and at most ``2 *
    window`` across a window's edge, whatever the dataset's size. ``window=None``
    makes one window of every member: a uniform shuffle of all samples (the baseline
    :func:`quality` measures against). ``shuffle=False``: members in key order, samples
    as stored (positions are snapshot indices).

Cost
    :meth:`Order.locate` maps any positions to their ``(member, sample)`` directly: a
    binary search for the window, the window's permutation (O(1) expected), and a
    binary search for the member. Nothing of the size of the epoch is built; the only
    tables are per member (the members' order and their cumulative counts).

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

#: members whose samples are mixed together, by default
DEFAULT_WINDOW: Final = 8

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
        window: members whose samples are mixed together (None: all of them).

    Raises:
        ValueError: a negative count, or a window below 1.
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
    ) -> None:
        sizes = np.asarray(counts, dtype=np.int64).reshape(-1)
        if (sizes < 0).any():
            raise ValueError("a member's sample count is negative")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 member, or None for all; got {window!r}")
        members = len(sizes)
        self.shuffle = bool(shuffle)
        self.window = window
        self._key = f"chunkd.order:{snapshot}:{seed}:{epoch}"
        positions = np.arange(members, dtype=np.int64)
        if self.shuffle:
            positions = Permutation(members, f"{self._key}:members")(positions)
        #: the member at each position of the members' order
        self.member_order: NDArray[np.int64] = positions
        # cum[p]: where the member at position p of that order starts in the epoch
        self._cum = np.concatenate(([0], np.cumsum(sizes[positions]))).astype(np.int64)
        per = members if window is None else window
        firsts = np.arange(0, members, max(1, per), dtype=np.int64)
        self._window_starts = np.concatenate((self._cum[firsts], self._cum[-1:])).astype(np.int64)
        #: where each member's first sample is in the snapshot (its index)
        self.member_starts: NDArray[np.int64] = np.concatenate(([0], np.cumsum(sizes))).astype(
            np.int64
        )
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
        index = np.asarray(positions, dtype=np.int64).reshape(-1)
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= self.total):
            raise IndexError(f"positions outside an epoch of {self.total} samples")
        if not self.shuffle:
            member = np.searchsorted(self.member_starts, index, side="right") - 1
            return member.astype(np.int64), index - self.member_starts[member]
        member = np.empty_like(index)
        sample = np.empty_like(index)
        windows = np.searchsorted(self._window_starts, index, side="right") - 1
        for w in np.unique(windows).tolist():
            chosen = windows == w
            start = int(self._window_starts[w])
            inside = self._permutation(w)(index[chosen] - start)
            at = inside + start
            position = np.searchsorted(self._cum, at, side="right") - 1
            member[chosen] = self.member_order[position]
            sample[chosen] = at - self._cum[position]
        return member, sample

    def indices(self, positions: NDArray[np.int64] | Sequence[int]) -> NDArray[np.int64]:
        """The snapshot index of the sample at each position."""
        member, sample = self.locate(positions)
        return self.member_starts[member] + sample

    def _permutation(self, w: int) -> Permutation:
        found = self._permutations.get(w)
        if found is None:
            if len(self._permutations) >= 64:
                self._permutations.clear()
            size = int(self._window_starts[w + 1] - self._window_starts[w])
            found = self._permutations[w] = Permutation(size, f"{self._key}:window:{w}")
        return found


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
    """

    positions: int
    members_touched: int
    members_held: int
    mean_gap: float


def quality(order: Order, start: int = 0, stop: int | None = None) -> OrderQuality:
    """How positions ``start .. stop`` (default: the whole epoch) of ``order`` read.

    For the bench: compare an order with ``window=None`` (a uniform shuffle of every
    sample) on the same snapshot.
    """
    stop = order.total if stop is None else min(stop, order.total)
    if stop <= start:
        return OrderQuality(0, 0, 0, 0.0)
    positions = np.arange(start, stop, dtype=np.int64)
    member, sample = order.locate(positions)
    index = order.member_starts[member] + sample
    gap = float(np.abs(np.diff(index)).mean()) if len(index) > 1 else 0.0
    touched = np.unique(member)
    # Each member is open over [its first position, its last position]; the most
    # intervals covering one position is the sweep's maximum.
    first = np.full(len(order.member_starts), len(index), dtype=np.int64)
    last = np.full(len(order.member_starts), -1, dtype=np.int64)
    steps = np.arange(len(index), dtype=np.int64)
    np.minimum.at(first, member, steps)
    np.maximum.at(last, member, steps)
    opened = np.bincount(first[touched], minlength=len(index) + 1)
    closed = np.bincount(last[touched] + 1, minlength=len(index) + 1)
    held = int(np.cumsum(opened - closed).max())
    return OrderQuality(len(index), len(touched), held, gap)
