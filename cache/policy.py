"""Eviction policies for byte-budgeted tiers.

A policy only orders keys; the tier owns the data and the pins. The tier tells
the policy what happens (:meth:`~EvictionPolicy.insert`, :meth:`~EvictionPolicy.access`,
:meth:`~EvictionPolicy.remove`) and asks it for victims with
:meth:`~EvictionPolicy.evict`, passing a predicate for keys it must skip (pinned
by a lease). A returned victim is already forgotten by the policy.

:class:`S3FifoPolicy` is the default: scan-resistant, so one pass over a large
dataset does not flush the hot working set. :class:`LruPolicy` is the plain
baseline.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["EvictionPolicy", "LruPolicy", "S3FifoPolicy"]

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(ABC, Generic[K]):
    """Orders the keys of one tier for eviction."""

    capacity_bytes: int = 0

    def set_capacity(self, capacity_bytes: int) -> None:
        """Tell the policy the tier's byte budget (called once by the tier)."""
        self.capacity_bytes = capacity_bytes

    @abstractmethod
    def insert(self, key: K, size: int) -> None:
        """A new key of ``size`` bytes entered the tier."""

    @abstractmethod
    def access(self, key: K) -> None:
        """``key`` was read."""

    @abstractmethod
    def remove(self, key: K) -> None:
        """``key`` left the tier for a reason of its own (discarded, damaged)."""

    @abstractmethod
    def evict(self, skip: Callable[[K], bool]) -> K | None:
        """Choose and forget one victim for which ``skip`` is false.

        Returns ``None`` when every remaining key must be skipped.
        """

    @abstractmethod
    def __len__(self) -> int:
        """Number of keys tracked."""


class LruPolicy(EvictionPolicy[K]):
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def insert(self, key: K, size: int) -> None:
        # docstring inherited
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key: K) -> None:
        # docstring inherited
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: K) -> None:
        # docstring inherited
        self._order.pop(key, None)

    def evict(self, skip: Callable[[K], bool]) -> K | None:
        # docstring inherited
        for key in self._order:
            if not skip(key):
                del self._order[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)


class S3FifoPolicy(EvictionPolicy[K]):
    """S3-FIFO (Yang et al., SOSP 2023): a small probation FIFO, a main FIFO, a ghost.

    New keys enter the small queue (about 10% of the budget). A key evicted from
    it unread leaves a ghost; a key read at least ``promote_after`` times moves to
    the main queue. Keys in the main queue get one more lap per read (up to 3).
    A key whose ghost is still remembered goes straight to the main queue when it
    comes back. A scan therefore churns only the small queue.
    """

    _MAX_FREQ = 3

    def __init__(self, small_ratio: float = 0.1, promote_after: int = 1) -> None:
        if not 0.0 < small_ratio < 1.0:
            raise ValueError(f"small_ratio must lie in (0, 1); got {small_ratio}")
        self.small_ratio = small_ratio
        self.promote_after = promote_after
        self._small: OrderedDict[K, None] = OrderedDict()
        self._main: OrderedDict[K, None] = OrderedDict()
        self._ghost: OrderedDict[K, None] = OrderedDict()
        self._freq: dict[K, int] = {}
        self._size: dict[K, int] = {}
        self._small_bytes = 0

    def insert(self, key: K, size: int) -> None:
        # docstring inherited
        if key in self._size:
            self.access(key)
            return
        self._size[key] = size
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
            self._small_bytes += size

    def access(self, key: K) -> None:
        # docstring inherited
        freq = self._freq.get(key)
        if freq is not None and freq < self._MAX_FREQ:
            self._freq[key] = freq + 1

    def remove(self, key: K) -> None:
        # docstring inherited
        size = self._size.pop(key, None)
        if size is None:
            return
        del self._freq[key]
        if key in self._small:
            del self._small[key]
            self._small_bytes -= size
        else:
            self._main.pop(key, None)

    def evict(self, skip: Callable[[K], bool]) -> K | None:
        # docstring inherited
        # Skipped (pinned) keys are remembered per queue, so a queue counts as
        # exhausted only when every key in it was skipped. Each other key can be
        # passed over at most _MAX_FREQ + 1 times (laps for its reads, one
        # promotion), so the loop bound never hides a victim that exists.
        budget = (self._MAX_FREQ + 3) * (len(self._small) + len(self._main)) + 1
        small_target = self.small_ratio * self.capacity_bytes
        skipped_small: set[K] = set()
        skipped_main: set[K] = set()
        for _ in range(budget):
            small_open = len(skipped_small) < len(self._small)
            main_open = len(skipped_main) < len(self._main)
            if not small_open and not main_open:
                return None
            use_small = small_open and (self._small_bytes >= small_target or not main_open)
            if use_small:
                key = next(iter(self._small))
                if skip(key):
                    self._small.move_to_end(key)
                    skipped_small.add(key)
                    continue
                del self._small[key]
                self._small_bytes -= self._size[key]
                if self._freq[key] >= self.promote_after:
                    self._freq[key] = 0
                    self._main[key] = None
                    continue
                self._forget(key)
                self._remember_ghost(key)
                return key
            key = next(iter(self._main))
            if skip(key):
                self._main.move_to_end(key)
                skipped_main.add(key)
                continue
            if self._freq[key] > 0:
                self._freq[key] -= 1
                self._main.move_to_end(key)
                continue
            del self._main[key]
            self._forget(key)
            return key
        return None

    def _forget(self, key: K) -> None:
        del self._size[key]
        del self._freq[key]

    def _remember_ghost(self, key: K) -> None:
        self._ghost[key] = None
        limit = max(64, len(self._size))
        while len(self._ghost) > limit:
            self._ghost.popitem(last=False)

    def __len__(self) -> int:
        return len(self._size)
