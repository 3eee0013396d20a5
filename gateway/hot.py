"""The hottest objects and datasets of a node: decayed read rates in bounded space.

The read path adds every chunk it hands a reader (:meth:`HotSet.add`); the dataset
registry says which ``BACKEND/PREFIX`` a resolved dataset lives under
(:meth:`HotSet.dataset`), so an object's reads count towards its dataset too. Once a
second the dashboard's sampler calls :meth:`HotSet.tick`, which folds the second's
counts into exponentially decayed rates (a time constant of 20 s: a read a minute ago
weighs about 5%) and returns the top entries.

Bounds: at most ``capacity`` objects and ``capacity`` datasets are tracked; past that
the coldest are dropped at the next tick, and one that goes cold (under 1 byte/s) is
dropped too; within one second at most four times ``capacity`` names are held (past
that the half with the fewest bytes goes, so a scan cannot crowd out a hot object).
An add is two dict updates plus one lookup per ``/`` of the key.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["HotSet"]

#: seconds: the time constant of the decay
TAU: Final = 20.0
#: datasets whose prefixes are remembered (the most recently resolved)
MAX_DATASETS: Final = 256


@dataclass(slots=True)
class _Rate:
    bytes_now: int = 0
    reads_now: int = 0
    bytes: float = 0.0  # decayed, per second
    reads: float = 0.0


class HotSet:
    """Decayed read rates of objects and datasets (see the module docstring)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._objects: dict[str, _Rate] = {}
        self._datasets: dict[str, _Rate] = {}
        # (backend, prefix without a trailing "/") -> dataset name, most recent last
        self._prefixes: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._depth = 0  # the most "/"-segments of a remembered prefix

    def dataset(self, backend: str, prefix: str, name: str) -> None:
        """Reads of objects under ``backend``/``prefix`` count towards dataset ``name``."""
        where = (backend, prefix.strip("/"))
        self._prefixes[where] = name
        self._prefixes.move_to_end(where)
        while len(self._prefixes) > MAX_DATASETS:
            self._prefixes.popitem(last=False)
        self._depth = max((p.count("/") + 1 if p else 0) for _, p in self._prefixes)

    def add(self, backend: str, key: str, nbytes: int) -> None:
        """A reader got ``nbytes`` of ``backend``/``key``."""
        _bump(self._objects, f"{backend}/{key}", nbytes, 4 * self.capacity)
        if self._prefixes:
            name = self._dataset_of(backend, key)
            if name is not None:
                _bump(self._datasets, name, nbytes, 4 * self.capacity)

    def _dataset_of(self, backend: str, key: str) -> str | None:
        found = self._prefixes.get((backend, ""))
        parts = key.split("/", self._depth)[:-1]  # the directories above the key
        for depth in range(1, len(parts) + 1):
            found = self._prefixes.get((backend, "/".join(parts[:depth]))) or found
        return found

    def tick(self, seconds: float, top: int = 10) -> dict[str, list[dict[str, Any]]]:
        """Fold the counts of the last ``seconds`` into the rates; the ``top`` hottest
        objects and datasets: ``{"objects": [{"name", "bytes", "reads"}], "datasets": [...]}``
        with bytes and reads per second."""
        return {
            "objects": _tick(self._objects, seconds, top, self.capacity),
            "datasets": _tick(self._datasets, seconds, top, self.capacity),
        }


def _bump(rates: dict[str, _Rate], name: str, nbytes: int, most: int) -> None:
    rate = rates.get(name)
    if rate is None:
        if len(rates) >= most:
            _compact(rates, most // 2)  # a scan of many objects within one second
        rate = rates[name] = _Rate()
    rate.bytes_now += nbytes
    rate.reads_now += 1


def _compact(rates: dict[str, _Rate], keep: int) -> None:
    """Keep the ``keep`` entries with the most bytes (decayed, and of this second).

    Dropping the newest names instead would let a scan that fills the table early in a
    second lock out an object read hard later in it; halving keeps an add amortized
    O(log n).
    """
    ranked = sorted(rates.items(), key=lambda item: item[1].bytes + item[1].bytes_now)
    for name, _ in ranked[: len(rates) - keep]:
        del rates[name]


def _tick(rates: dict[str, _Rate], seconds: float, top: int, capacity: int) -> list[dict[str, Any]]:
    seconds = max(seconds, 1e-3)
    keep = math.exp(-seconds / TAU)
    cold = []
    for name, rate in rates.items():
        rate.bytes = rate.bytes * keep + (rate.bytes_now / seconds) * (1 - keep)
        rate.reads = rate.reads * keep + (rate.reads_now / seconds) * (1 - keep)
        rate.bytes_now = rate.reads_now = 0
        if rate.bytes < 1.0 and rate.reads < 0.01:
            cold.append(name)
    for name in cold:
        del rates[name]
    ranked = sorted(rates.items(), key=lambda item: item[1].bytes, reverse=True)
    for name, _ in ranked[capacity:]:
        del rates[name]
    return [
        {"name": name, "bytes": round(rate.bytes, 1), "reads": round(rate.reads, 3)}
        for name, rate in ranked[:top]
    ]
