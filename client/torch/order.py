"""The global read order of an epoch, and a consumer's cursor in it.

What the order depends on
    Only on the shards' sample counts, in the order the shards are listed, and on
    ``seed``, ``epoch``, ``shuffle`` and ``window`` (how many consecutive shards of the
    shard order have their samples shuffled together; None: all). Not on ranks,
    workers, batch sizes, the machine, or numpy's and torch's versions: the shuffle is
    a keyed pseudorandom permutation (:class:`Permutation`, a Feistel network keyed by
    ``seed`` and ``epoch``), and :meth:`Order.locate` maps any global index to its
    ``(shard, sample)`` directly, with no table of the epoch. Unshuffled, the order is
    the shards as listed and the samples as stored.

What the cursor holds
    A :class:`Cursor` is where one consumer (a rank, or one DataLoader worker of a
    rank) is in an epoch's order: the ``epoch``; the geometry (``world_size``,
    ``rank``, ``worker_id``, ``num_workers``, ``batch_size``); ``origin``, the rank's
    local index where the iteration started; ``yielded``, the samples this consumer
    has yielded since; and ``done``. Global index ``g`` is rank ``g % world_size``'s
    local index ``g // world_size``; from ``origin`` on, a rank's local indices are
    dealt to its workers in blocks of ``batch_size``. :attr:`Cursor.position`, the
    global position of the consumer's next sample, is what a saved state records
    (:mod:`chunkd.client.torch.state`).

This module needs numpy only: no torch, no client.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import NDArray

__all__ = ["Cursor", "Order", "Permutation"]

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


# -- an epoch's global order -------------------------------------------------------------


class Order:
    """One epoch's global order of ``(shard, sample)`` pairs.

    Shards are permuted; each run of ``window`` consecutive shards in that order is a
    window, and the samples of a window are permuted together. Unshuffled, both
    permutations are the identity: shards as listed, samples as stored.
    """

    def __init__(
        self,
        counts: NDArray[np.int64],
        *,
        seed: int,
        epoch: int,
        shuffle: bool,
        window: int | None,
    ) -> None:
        shards = len(counts)
        positions = np.arange(shards, dtype=np.int64)
        # The permutations' keys are part of every saved order: changing them (the
        # "chunkd.ShardDataset" in them too) changes the order of every seed and epoch.
        if shuffle:
            self.shard_order = Permutation(shards, f"chunkd.ShardDataset:{seed}:{epoch}:shards")(
                positions
            )
        else:
            self.shard_order = positions
        # cum[p]: where the shard at position p of the order starts in its concatenation
        self.cum = np.concatenate(([0], np.cumsum(counts[self.shard_order]))).astype(np.int64)
        per = shards if window is None else window
        firsts = np.arange(0, shards, max(1, per), dtype=np.int64)
        self.window_starts = np.concatenate((self.cum[firsts], self.cum[-1:])).astype(np.int64)
        self.total = int(self.cum[-1])
        self._key = f"chunkd.ShardDataset:{seed}:{epoch}:window:"
        self._shuffle = shuffle

    def locate(self, index: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """The (shard, sample in shard) at each global index (all below ``total``)."""
        shard = np.empty_like(index)
        sample = np.empty_like(index)
        windows = np.searchsorted(self.window_starts, index, side="right") - 1
        for w in np.unique(windows):
            chosen = windows == w
            start = int(self.window_starts[w])
            size = int(self.window_starts[w + 1]) - start
            inside = index[chosen] - start
            if self._shuffle:
                inside = Permutation(size, f"{self._key}{int(w)}")(inside)
            at = inside + start
            position = np.searchsorted(self.cum, at, side="right") - 1
            shard[chosen] = self.shard_order[position]
            sample[chosen] = at - self.cum[position]
        return shard, sample


# -- a consumer's place in the order ----------------------------------------------------


@dataclass(slots=True)
class Cursor:
    """Where one consumer (a rank, or one DataLoader worker of a rank) is in an epoch.

    The rank's samples are its local indices ``j`` (global index ``j * world_size +
    rank``). From ``origin`` on, they are dealt to the workers in blocks of
    ``batch_size``: block ``k`` to worker ``k % num_workers``. ``yielded`` counts the
    samples this consumer has yielded.
    """

    epoch: int
    world_size: int
    rank: int
    worker_id: int
    num_workers: int
    batch_size: int
    origin: int
    yielded: int = 0
    done: bool = False

    def local(self, t: NDArray[np.int64]) -> NDArray[np.int64]:
        """The local index of this consumer's ``t``-th sample."""
        block = self.worker_id + (t // self.batch_size) * self.num_workers
        return self.origin + block * self.batch_size + t % self.batch_size

    @property
    def position(self) -> int:
        """The global position: this consumer's next sample is its first at or after it."""
        nxt = self.local(np.array([self.yielded], dtype=np.int64))
        return int(nxt[0]) * self.world_size
