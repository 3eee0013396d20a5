"""The jobs a node serves: their labels in ``/metrics`` (a stable top K), and how long
their trainers wait for data, rank by rank (``loader_report``).

A job starts on this node the first time the node sees its name (a ``hello`` naming
it, a report, a read). At its start it is admitted to a label of its own if fewer
than ``top`` named jobs are live, else it is ``other``, and it keeps that label until
its end: a series that moved between a name and ``other`` would break ``rate()``.
A job ends when every rank that reported sent ``end`` and nothing came for
:data:`END_QUIET` seconds, or when nothing came for ``idle`` seconds; its series
then leave ``/metrics`` and its slot is free. Work that names no job is ``none``.

Everything is bounded: ``tracked`` jobs are kept (past them a new job is ``other``
and kept by no name: its reports count in ``other``'s histograms only), at most
:data:`~chunkd.gateway.jobs.stalls.MAX_RANKS` ranks a job and
:data:`~chunkd.gateway.jobs.stalls.MAX_KEPT` ranks over all jobs (past them a rank's
reports count in its job's histograms, and it is kept by no number), :data:`MAX_UIDS`
uids a job. Expiry is lazy (each call looks at the oldest jobs only), so a call costs O(1)
amortized and a scrape O(live jobs x worst_ranks).

All calls come from the event loop (the local socket's handlers, the HTTP routes,
the scrape): the table takes no lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from chunkd.client.protocol import FIRST_BATCH_PHASES, check_job_name
from chunkd.gateway.jobs.collector import JobCollector
from chunkd.gateway.jobs.stalls import MAX_KEPT, LabelFigures, LoaderHistogram, Ranks, WorstRank

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

__all__ = ["ENDED_SHOWN", "END_QUIET", "MAX_UIDS", "JobTable"]

#: seconds of quiet after every rank's ``end`` before the job ends
END_QUIET: Final = 60.0
#: uids recorded beside one job (the first seen; the rest are not recorded)
MAX_UIDS: Final = 16
#: jobs that ended the view still shows (the latest, each for ``idle`` seconds)
ENDED_SHOWN: Final = 16
#: the label of jobs past the top K, and of jobs past ``tracked``
OTHER: Final = "other"
#: the label of work that names no job
NONE: Final = "none"


@dataclass(slots=True)
class _Job:
    """One job live on this node."""

    name: str
    label: str  # its name, or "other": fixed at its start
    started: float  # wall clock
    last_seen: float  # wall clock
    touched: float  # the table's clock at its latest sight
    uids: list[int] = field(default_factory=list)
    world_size: int | None = None
    wait: LoaderHistogram = field(default_factory=LoaderHistogram)
    step: LoaderHistogram = field(default_factory=LoaderHistogram)
    ranks: Ranks = field(default_factory=Ranks)
    serial: int = 0  # which start on this node (the table's count of starts)

    def see(self, uid: int | None, now: float, wall: float) -> None:
        self.touched, self.last_seen = now, wall
        if uid is not None and uid not in self.uids and len(self.uids) < MAX_UIDS:
            self.uids.append(uid)

    def view(self, now: float, worst: int, *, ended: bool = False) -> dict[str, Any]:
        steps = self.step.count
        first = self.ranks.slowest_first_batch()
        return {
            "name": self.name,
            "label": self.label,
            "uids": list(self.uids),
            "started": self.started,
            "last_seen": self.last_seen,
            "ended": ended,
            "ranks": self.ranks.live(now),
            "world_size": self.world_size,
            "steps": steps,
            "wait_seconds": self.wait.total,
            "step_seconds": self.step.total,
            "stall": self.wait.total / self.step.total if self.step.total > 0 else None,
            "recent_stall": self.ranks.recent_stall(now),
            "worst_ranks": [w.view() for w in self.ranks.worst(now, worst)],
            "first_batch": None if first is None else {"rank": first[0], **first[1]},
        }


class JobTable:
    """The jobs this node serves and their trainers' waits (docs/jobs.md).

    Args:
        top: jobs named in ``/metrics`` at once; a job starting while they are live is
            ``other`` for its whole life on this node.
        worst_ranks: ranks per job shown as ``chunkd_loader_worst_rank_wait_ratio``
            and in the view.
        idle: seconds of silence after which a job has ended.
        tracked: jobs kept (named or ``other``); past it a new job is ``other`` and
            kept by no name.
        clock: seconds, monotonic (tests pass their own).
        wall: seconds since the epoch, for the view's ``started``/``last_seen``.
    """

    def __init__(
        self,
        *,
        top: int = 16,
        worst_ranks: int = 3,
        idle: float = 600.0,
        tracked: int = 1024,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.top = top
        self.worst_ranks = worst_ranks
        self.idle = idle
        self.tracked = tracked
        self.clock = clock
        self.wall = wall
        # the live jobs by their latest sight, oldest first (idle expiry from the front)
        self._jobs: OrderedDict[str, _Job] = OrderedDict()
        # the jobs all of whose ranks ended, by their latest sight (END_QUIET expiry)
        self._ending: OrderedDict[str, _Job] = OrderedDict()
        self._named = 0
        # the labels of the live named jobs (at most ``top``): what the cost ledger's
        # scrape asks, kept on admission and end so that it needs no walk over the jobs
        self._labels: set[str] = set()
        self._serial = 0  # starts of kept jobs so far (each start's serial)
        self._kept = 0  # records kept by all jobs' Ranks (MAX_KEPT)
        #: job starts by admission (``chunkd_job_starts_total``)
        self.starts = {"true": 0, "false": 0}
        # every report of an ``other`` job, and of work with no job: these series live
        # as long as the daemon (their counters must never go down)
        self._other_wait = LoaderHistogram()
        self._other_step = LoaderHistogram()
        self._none = _Job(NONE, NONE, self.wall(), self.wall(), self.clock())
        self._none_reported = False
        # the last jobs that ended, for the view (for ``idle`` seconds)
        self._ended: deque[tuple[float, dict[str, Any]]] = deque(maxlen=ENDED_SHOWN)

    # --- what the doors call ---------------------------------------------------------

    def label(self, job: str | None, uid: int | None = None, *, start: bool = True) -> str:
        """The label of ``job`` in ``/metrics``: its name, ``other``, or ``none`` for no
        job. Sees the job: starts it if it is new (admission), notes its activity.
        ``start=False`` (a peer's request for its own node's job): a job this table does
        not have is ``other`` and is not started.

        Raises:
            InvalidRequestError: ``job`` is no job name (a reserved one included).
        """
        if not start and job is not None:
            self._expire(self.clock())
            if job not in self._jobs:
                check_job_name(job)
                return OTHER
        found = self._see(job, uid)
        if found is None:
            return NONE if job is None else OTHER
        return found.label

    def report(self, job: str | None, uid: int | None, args: Mapping[str, Any]) -> str:
        """Take one rank's ``loader_report`` (its fields, checked); the job's label.

        Raises:
            InvalidRequestError: ``job`` is no job name.
        """
        found = self._see(job, uid)
        steps, wait, step = args["steps"], args["wait"], args["step"]
        if found is None and job is not None:  # past ``tracked``: counted as other only
            self._other_wait.add(args["wait_buckets"], wait)
            self._other_step.add(args["step_buckets"], step)
            return OTHER
        target = self._none if found is None else found
        if found is None:
            self._none_reported = True
        target.wait.add(args["wait_buckets"], wait)
        target.step.add(args["step_buckets"], step)
        if target.label == OTHER:
            self._other_wait.add(args["wait_buckets"], wait)
            self._other_step.add(args["step_buckets"], step)
        if args.get("world_size") is not None:
            target.world_size = args["world_size"]
        now = self.clock()
        was_ending = target.ranks.all_ended
        kept = target.ranks.kept
        target.ranks.report(
            now,
            args["rank"],
            steps,
            wait,
            step,
            args.get("wait_max") or 0.0,
            args["end"],
            room=self._kept < MAX_KEPT,
        )
        self._kept += target.ranks.kept - kept
        if target is not self._none and target.ranks.all_ended != was_ending:
            if was_ending:
                self._ending.pop(target.name, None)
            else:
                self._ending[target.name] = target
        return target.label

    def first_batch(
        self, job: str | None, uid: int | None, rank: int | None, phases: Mapping[str, float]
    ) -> None:
        """Take one loader's time to its first batch, by phase (the job's slowest rank's
        is what ``/metrics`` and the view show).

        Raises:
            InvalidRequestError: ``job`` is no job name.
        """
        found = self._see(job, uid)
        if found is None and job is not None:
            return  # past ``tracked``: kept by no name
        if found is None:
            self._none_reported = True
        ranks = (self._none if found is None else found).ranks
        kept = ranks.kept
        ranks.first_batch(rank, phases, room=self._kept < MAX_KEPT)
        self._kept += ranks.kept - kept

    def view(self, *, job: str | None = None) -> dict[str, Any]:
        """The jobs as ``GET /v1/jobs`` answers them (docs/jobs.md); ``job``: only the
        job of that name (in ``jobs`` and ``ended``).

        Raises:
            InvalidRequestError: ``job`` is no job name.
        """
        if job is not None:
            check_job_name(job)
        now = self.clock()
        self._expire(now)
        wall = self.wall()
        while self._ended and self._ended[0][0] < wall - self.idle:
            self._ended.popleft()
        if job is None:
            jobs = [j.view(now, self.worst_ranks) for j in self._jobs.values()]
        else:
            found = self._jobs.get(job)
            jobs = [] if found is None else [found.view(now, self.worst_ranks)]
        jobs.sort(key=lambda j: j["started"])
        return {
            "top": self.top,
            "tracked": self.tracked,
            "worst_ranks": self.worst_ranks,
            "idle": self.idle,
            "live": {"named": self._named, "other": len(self._jobs) - self._named},
            "jobs": jobs,
            "ended": [v for _, v in self._ended if job is None or v["name"] == job],
            "none": (self._none.view(now, self.worst_ranks) if self._none_reported else None),
        }

    def collector(self) -> Collector:
        """A Prometheus collector of this table's figures, to register on the daemon's
        registry (``metrics.registry.register(jobs.collector())``)."""
        return JobCollector(self)

    # --- what the collector reads ----------------------------------------------------

    def figures(self) -> Iterator[LabelFigures]:
        """Each live ``train_job`` label's figures: the named jobs, ``other`` (once a
        job was), ``none`` (once work with no job reported). Costs O(live jobs x
        worst_ranks)."""
        now = self.clock()
        self._expire(now)
        k = self.worst_ranks
        others: list[_Job] = []
        for job in self._jobs.values():
            if job.label == OTHER:
                others.append(job)
                continue
            yield self._figures(job.label, job, now, [job])
        if self._other_step.count or self._other_wait.count or others:
            worst: dict[int, WorstRank] = {}
            for job in others:
                for w in job.ranks.worst(now, k):
                    if w.rank not in worst or worst[w.rank].stall < w.stall:
                        worst[w.rank] = w
            yield LabelFigures(
                OTHER,
                self._other_wait,
                self._other_step,
                sum(j.ranks.live(now) for j in others),
                sorted(worst.values(), key=lambda w: -w.stall)[:k],
                _slowest(others),
            )
        if self._none_reported:
            yield self._figures(NONE, self._none, now, [self._none])

    def life(self, job: str) -> tuple[float, int] | None:
        """Which start of ``job`` is live: (its start, wall clock; a serial number of
        that start, new at each start). None when the table keeps no job of that name. The cost
        ledger asks it at each charge to start a job's counters again at a new start;
        a dict lookup (no expiry: the caller's ``label()`` just ran it)."""
        found = self._jobs.get(job)
        return None if found is None else (found.started, found.serial)

    def live_labels(self) -> frozenset[str]:
        """The labels of the named jobs live now (at most ``top``; never ``other`` or
        ``none``): a label not among them has no series of this table in ``/metrics``.
        What the cost ledger's collector asks at each scrape; costs O(top)."""
        self._expire(self.clock())
        return frozenset(self._labels)

    def live_jobs(self) -> dict[str, int]:
        """Live jobs by state, ``named`` and ``other`` (``chunkd_jobs``)."""
        self._expire(self.clock())
        return {"named": self._named, "other": len(self._jobs) - self._named}

    def _figures(self, label: str, job: _Job, now: float, jobs: list[_Job]) -> LabelFigures:
        return LabelFigures(
            label,
            job.wait,
            job.step,
            job.ranks.live(now),
            job.ranks.worst(now, self.worst_ranks),
            _slowest(jobs),
        )

    # --- admission and expiry --------------------------------------------------------

    def _see(self, job: str | None, uid: int | None) -> _Job | None:
        """The live job named ``job``, started if new; None for no job or a job past
        ``tracked``."""
        now = self.clock()
        self._expire(now)
        if job is None:
            self._none.see(uid, now, self.wall())
            return None
        found = self._jobs.get(job)
        if found is None:
            check_job_name(job)
            if len(self._jobs) >= self.tracked:
                return None  # other, and kept by no name (its start is not counted)
            named = self._named < self.top
            self.starts["true" if named else "false"] += 1
            wall = self.wall()
            self._serial += 1
            found = _Job(job, job if named else OTHER, wall, wall, now, serial=self._serial)
            self._jobs[job] = found
            self._named += named
            if named:
                self._labels.add(job)
            # a job started again is no longer an ended one
            self._ended = deque((e for e in self._ended if e[1]["name"] != job), self._ended.maxlen)
        else:
            self._jobs.move_to_end(job)
            if job in self._ending:
                self._ending.move_to_end(job)
        found.see(uid, now, self.wall())
        return found

    def _expire(self, now: float) -> None:
        while self._jobs:
            job = next(iter(self._jobs.values()))
            if job.touched >= now - self.idle:
                break
            self._end(job)
        while self._ending:
            job = next(iter(self._ending.values()))
            if job.touched >= now - END_QUIET:
                break
            self._end(job)

    def _end(self, job: _Job) -> None:
        self._drop(job)
        self._ended.append((self.wall(), job.view(self.clock(), self.worst_ranks, ended=True)))

    def _drop(self, job: _Job) -> None:
        del self._jobs[job.name]
        self._ending.pop(job.name, None)
        self._kept -= job.ranks.kept
        if job.label != OTHER:
            self._named -= 1
            self._labels.discard(job.label)


def _slowest(jobs: list[_Job]) -> Mapping[str, float] | None:
    """The phases of the slowest first batch among ``jobs``' slowest ranks."""
    best: tuple[float, Mapping[str, float]] | None = None
    for job in jobs:
        first = job.ranks.slowest_first_batch()
        if first is None:
            continue
        phases = first[1]
        total = phases.get("total", sum(v for p, v in phases.items() if p != "total"))
        if best is None or total > best[0]:
            best = (total, phases)
    return None if best is None else {p: best[1][p] for p in FIRST_BATCH_PHASES if p in best[1]}
