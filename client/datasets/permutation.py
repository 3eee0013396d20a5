"""A stable pseudorandom permutation of ``range(size)`` from a key: :class:`Permutation`.

The shuffles of an epoch's order (:mod:`chunkd.client.datasets.order`) are such
permutations, keyed by the snapshot, seed and epoch: a balanced Feistel network with
cycle walking, so any element is computed directly, no table of the size of the epoch is
needed, and the same key gives the same permutation on every machine and library
version. It knows nothing of snapshots or orders.

This module needs numpy only.
"""

from __future__ import annotations

import hashlib
from typing import Final

import numpy as np
from numpy.typing import NDArray

__all__ = ["Permutation"]

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
