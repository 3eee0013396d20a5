"""How long one job's trainers waited for data: its histograms and its ranks.

A job's figures are kept at a bounded, constant cost per report: histograms over
:data:`~chunkd.client.protocol.LOADER_BUCKETS` that only ever grow (the series a
``rate()`` reads), and at most :data:`MAX_RANKS` ranks, each with its latest report
window (a handful of numbers). The worst ranks come from a heap with lazy deletion,
so neither a report nor a scrape walks every rank.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from chunkd.client.protocol import LOADER_BUCKETS

__all__ = [
    "MAX_KEPT",
    "MAX_RANKS",
    "RECENT",
    "LabelFigures",
    "LoaderHistogram",
    "Ranks",
    "WorstRank",
]

#: ranks one job keeps one by one; a report of a rank past them is counted in the job's
#: histograms and sums, not kept (it is in no worst rank, no ``ranks`` figure, and its
#: ``end`` is not waited for)
MAX_RANKS: Final = 4096
#: records (a rank's window, a loader's first batch: a few hundred bytes each) one
#: table keeps over all its jobs; past it a new rank is counted, not kept
MAX_KEPT: Final = 1 << 16
#: a rank counts as live (``chunkd_loader_ranks``, the worst ranks, ``recent_stall``)
#: this many seconds after its latest report
RECENT: Final = 120.0


@dataclass(slots=True)
class LoaderHistogram:
    """Steps counted into :data:`LOADER_BUCKETS` (+Inf last), not cumulative, and the
    sum of their seconds: what ``chunkd_loader_*_seconds`` exposes."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(LOADER_BUCKETS) + 1))
    total: float = 0.0

    def add(self, counts: Sequence[int], seconds: float) -> None:
        """Count one report's steps (``counts``, one per bucket) and their seconds."""
        for i, n in enumerate(counts):
            self.buckets[i] += n
        self.total += seconds

    @property
    def count(self) -> int:
        """Steps counted."""
        return sum(self.buckets)

    def cumulative(self) -> list[tuple[str, float]]:
        """The buckets as Prometheus exposes them: ``(le, steps at most le)``."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*map(str, LOADER_BUCKETS), "+Inf"), self.buckets, strict=True):
            running += n
            out.append((bound, running))
        return out


@dataclass(slots=True)
class _Rank:
    """One rank's latest report window, and whether its iteration ended."""

    rank: int
    seen: float = 0.0  # the clock at its latest report
    wait: float = 0.0  # the latest window with steps
    step: float = 0.0
    wait_max: float = 0.0
    ended: bool = False
    seq: int = 0  # its live entry in the heap (older entries are stale)


@dataclass(frozen=True, slots=True)
class WorstRank:
    """A rank with one of the highest waits over its latest window."""

    rank: int
    stall: float  # wait / step over its latest window
    wait_max: float

    def view(self) -> dict[str, Any]:
        """As ``GET /v1/jobs`` shows it."""
        return {"rank": self.rank, "stall": self.stall, "wait_max": self.wait_max}


@dataclass(frozen=True, slots=True)
class LabelFigures:
    """What ``/metrics`` shows for one ``train_job`` label."""

    label: str
    wait: LoaderHistogram
    step: LoaderHistogram
    ranks: int
    worst: list[WorstRank]
    first_batch: Mapping[str, float] | None


class Ranks:
    """The ranks of one job: their latest windows, which ended, the worst, and the
    slowest first batch. Each method costs O(1) amortized, ``worst`` O(k log n)."""

    def __init__(self) -> None:
        self._ranks: dict[int, _Rank] = {}
        # the ranks by their latest report, oldest first: the live ones are a suffix
        self._recent: OrderedDict[int, _Rank] = OrderedDict()
        self._recent_wait = 0.0
        self._recent_step = 0.0
        self._ended = 0
        # (-stall, rank, seq): the ranks' windows, highest stall first; an entry whose
        # seq is not its rank's, or whose rank is no longer live, is stale
        self._heap: list[tuple[float, int, int]] = []
        self._seq = 0
        # the first batch of each loader that told it, by rank (None: no rank given)
        self._first: dict[int | None, tuple[float, Mapping[str, float]]] = {}
        self._slowest: int | None = None
        #: reports of ranks past :data:`MAX_RANKS`, counted but not kept
        self.unkept = 0

    def __len__(self) -> int:
        return len(self._ranks)

    @property
    def kept(self) -> int:
        """Records kept: ranks' windows and loaders' first batches (the table bounds
        their sum over all its jobs)."""
        return len(self._ranks) + len(self._first)

    def report(self, now: float, rank: int, steps: int, wait: float, step: float,
               wait_max: float, end: bool, *, room: bool = True) -> None:  # fmt: skip
        """Take one rank's window; a window without steps only notes the rank's
        report (and its ``end``). ``room``: a rank not kept yet may be."""
        self.expire(now)
        kept = self._ranks.get(rank)
        if kept is None:
            if len(self._ranks) >= MAX_RANKS or not room:
                self.unkept += 1
                return
            kept = self._ranks[rank] = _Rank(rank)
        if rank in self._recent:
            del self._recent[rank]
            self._recent_wait -= kept.wait
            self._recent_step -= kept.step
        if steps > 0 and step > 0:
            kept.wait, kept.step, kept.wait_max = wait, step, wait_max
            self._seq += 1
            kept.seq = self._seq
            heapq.heappush(self._heap, (-(wait / step), rank, kept.seq))
            if len(self._heap) > 2 * len(self._ranks) + 16:
                self._compact()
        kept.seen = now
        self._recent[rank] = kept
        self._recent_wait += kept.wait
        self._recent_step += kept.step
        if end != kept.ended:
            self._ended += 1 if end else -1
            kept.ended = end

    @property
    def all_ended(self) -> bool:
        """Every rank kept sent ``end`` (and there is at least one)."""
        return bool(self._ranks) and self._ended == len(self._ranks)

    def expire(self, now: float) -> None:
        """Ranks silent for :data:`RECENT` seconds stop counting as live."""
        while self._recent:
            rank, kept = next(iter(self._recent.items()))
            if kept.seen >= now - RECENT:
                break
            del self._recent[rank]
            self._recent_wait -= kept.wait
            self._recent_step -= kept.step
        if not self._recent:  # no float drift outlives the live ranks
            self._recent_wait = self._recent_step = 0.0

    def live(self, now: float) -> int:
        """Ranks that reported in the last :data:`RECENT` seconds."""
        self.expire(now)
        return len(self._recent)

    def recent_stall(self, now: float) -> float | None:
        """Σ wait / Σ step over the live ranks' latest windows (None: no window)."""
        self.expire(now)
        if self._recent_step <= 0:
            return None
        return max(0.0, self._recent_wait) / self._recent_step

    def worst(self, now: float, k: int) -> list[WorstRank]:
        """The ``k`` live ranks with the highest stall over their latest window."""
        self.expire(now)
        found: list[tuple[float, int, int]] = []
        while self._heap and len(found) < k:
            entry = heapq.heappop(self._heap)
            _, rank, seq = entry
            kept = self._ranks.get(rank)
            if kept is not None and kept.seq == seq and rank in self._recent:
                found.append(entry)
        for entry in found:
            heapq.heappush(self._heap, entry)
        return [WorstRank(rank, -stall, self._ranks[rank].wait_max) for stall, rank, _ in found]

    def _compact(self) -> None:
        self._heap = [
            (-(r.wait / r.step), r.rank, r.seq) for r in self._ranks.values() if r.step > 0
        ]
        heapq.heapify(self._heap)

    def first_batch(
        self, rank: int | None, phases: Mapping[str, float], *, room: bool = True
    ) -> None:
        """Take one loader's time to its first batch, by phase (the latest per rank);
        ``room``: a rank not kept yet may be."""
        if rank not in self._first and (len(self._first) >= MAX_RANKS or not room):
            return
        total = phases.get("total")
        if total is None:
            total = sum(v for p, v in phases.items() if p != "total")
        slowest = self._first.get(self._slowest) if self._first else None
        self._first[rank] = (total, dict(phases))
        if slowest is None or total >= slowest[0]:
            self._slowest = rank
        elif rank == self._slowest:  # the slowest got faster: look again (rare)
            self._slowest = max(self._first, key=lambda r: self._first[r][0])

    def slowest_first_batch(self) -> tuple[int | None, Mapping[str, float]] | None:
        """The rank whose first batch took longest, and its phases (None: none told)."""
        if self._slowest not in self._first:
            return None
        return self._slowest, self._first[self._slowest][1]
