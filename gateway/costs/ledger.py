"""What data movement cost, by job and by dataset or checkpoint name.

The hooks (:mod:`chunkd.gateway.costs.charge`) call :meth:`Ledger.charge` with the
job, uid and name of the work at hand. The ledger keeps, per (job, name), counters
of backend requests and bytes, bytes served by source, bytes written, and what the
same reads would have sent to the backend without chunkd ("direct"), each priced by
the backend's price table (:class:`~chunkd.gateway.costs.prices.Prices`). A charge
naming a backend the daemon does not have, or an op, direction, source or kind the
ledger does not count, is dropped: no door can add a label value.

Two stores per job: what this process counted in the job's current life (its
``accounts``: the ``chunkd_cost_*`` counters, which start at 0 with the daemon and
with each start of the job) and what it ``carried`` (read from ``cost.json`` at
start, earlier lives of the job under the same label, names let go of): the JSON view
(``GET /v1/cost``, ``chunkd cost``) adds both, ``/metrics`` shows the first only, so
Prometheus's ``increase()`` never counts history twice.

Bounds (docs/jobs.md): at most ``tracked`` jobs kept by name; a job first charged
while they are all charged within ``idle`` is ``other`` until it goes quiet for
``idle`` (decided once, no scan per charge). At most ``names`` dataset or checkpoint
names are labelled at once: a name's label (itself, or ``other``) is decided at its
first charge and kept until nothing was charged to it for ``idle`` seconds; at most
:data:`NAMES_PER_JOB` names per job life (past it: ``other``) and
:data:`NAMES_KEPT` names remembered at once. Per job, snapshots of its totals answer
``since``: one per minute with activity for the last hour, then one per hour for a
day (:data:`RING_MINUTES`, :data:`RING_HOURS`).

The totals and snapshots are written to ``state_path`` (``<cache.dir>/cost.json``)
atomically every minute (:meth:`Ledger.run`) and at close, encoded a job at a time
with the loop let run between slices; read back at start (a file of the wrong shape
is renamed ``cost.json.damaged``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Final

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from chunkd.gateway.costs.prices import OPS, Prices

if TYPE_CHECKING:
    from chunkd.gateway.jobs.table import JobTable

__all__ = ["NO_NAME", "SOURCES", "Ledger"]

log = logging.getLogger(__name__)

#: the ``name`` label of work for no dataset or checkpoint (plain object reads)
NO_NAME: Final = "-"
#: the ``train_job`` label of work for no job, and of jobs and names folded together
_NONE: Final = "none"
_OTHER: Final = "other"
#: where a reader's bytes came from (``chunkd_cost_served_bytes_total{source}``)
SOURCES: Final = ("ram", "disk", "peer", "backend")
#: the ``kind`` of bytes written (``chunkd_cost_written_bytes_total{kind}``)
WRITTEN_KINDS: Final = ("checkpoint", "freeze", "migrate", "object")
_DIRECTIONS: Final = ("read", "write")
#: seconds between snapshots of the totals (the ring's step and the file's)
MINUTE: Final = 60.0
HOUR: Final = 3600.0
#: per-minute snapshots kept per job (the last hour), then hourly ones (a day)
RING_MINUTES: Final = 60
RING_HOURS: Final = 25
#: names one job life may charge under their own label; past it: ``other`` (a client
#: names datasets as it likes: this bounds what one job can make the ledger hold)
NAMES_PER_JOB: Final = 256
#: names remembered at once (labelled or refused); past it a new name is ``other``
NAMES_KEPT: Final = 4096
#: jobs remembered as folded into ``other`` (past ``tracked``), as a multiple of tracked
_FOLDED_PER_TRACKED: Final = 4
#: seconds of the loop one slice of the file's encoding may take before it yields
_SLICE: Final = 0.002
_STATE_VERSION: Final = 2
#: garbage collection reports kept: the latest of each backend, at most this many
#: backends (the oldest report goes first)
GC_REPORTS_KEPT: Final = 64
#: the totals a snapshot keeps, in this order (a few numbers per snapshot)
RING_KEYS: Final = (
    "spent",
    "direct",
    "saved.cache",
    "saved.peer",
    *(f"backend_requests.{op}" for op in OPS),
    *(f"backend_bytes.{d}" for d in _DIRECTIONS),
    *(f"served_bytes.{s}" for s in SOURCES),
    *(f"written_bytes.{k}" for k in WRITTEN_KINDS),
    *(f"direct_requests.{op}" for op in OPS),
    "direct_bytes",
)


@dataclass
class _Account:
    """The counters of one (job, name)."""

    requests: defaultdict[tuple[str, str], float] = field(
        default_factory=lambda: defaultdict(float)
    )  # (backend, op)
    bytes: defaultdict[tuple[str, str], float] = field(
        default_factory=lambda: defaultdict(float)
    )  # (backend, direction)
    served: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))  # source
    written: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))  # kind
    direct_requests: defaultdict[tuple[str, str], float] = field(
        default_factory=lambda: defaultdict(float)
    )  # (backend, op)
    direct_bytes: defaultdict[str, float] = field(
        default_factory=lambda: defaultdict(float)
    )  # backend
    spent: defaultdict[tuple[str, str], float] = field(
        default_factory=lambda: defaultdict(float)
    )  # (backend, item)
    direct: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))  # backend
    saved: defaultdict[tuple[str, str], float] = field(
        default_factory=lambda: defaultdict(float)
    )  # (backend, source)

    #: each counter's key parts
    _FIELDS: ClassVar[dict[str, int]] = {
        "requests": 2,
        "bytes": 2,
        "served": 1,
        "written": 1,
        "direct_requests": 2,
        "direct_bytes": 1,
        "spent": 2,
        "direct": 1,
        "saved": 2,
    }

    def add(self, other: _Account) -> None:
        for name in self._FIELDS:
            mine = getattr(self, name)
            for key, value in getattr(other, name).items():
                mine[key] += value

    def summary(self) -> dict[str, Any]:
        """The figures of ``GET /v1/cost`` (money in the tables' currency)."""
        return {
            "spent": sum(self.spent.values()),
            "direct": sum(self.direct.values()),
            "saved": {
                source: sum(v for (_, s), v in self.saved.items() if s == source)
                for source in ("cache", "peer")
            },
            "backend_requests": _by(self.requests, 1),
            "backend_bytes": _by(self.bytes, 1),
            "served_bytes": {source: round(self.served.get(source, 0)) for source in SOURCES},
            "written_bytes": {k: round(v) for k, v in sorted(self.written.items())},
            "direct_requests": _by(self.direct_requests, 1),
            "direct_bytes": round(sum(self.direct_bytes.values())),
        }

    def dump(self) -> dict[str, Any]:
        return {
            name: [[*_key(k), v] for k, v in getattr(self, name).items()] for name in self._FIELDS
        }

    @classmethod
    def load(cls, data: Any) -> _Account:
        """An account from :meth:`dump`'s form.

        Raises:
            ValueError: ``data`` is not of that shape (a type is wrong anywhere).
        """
        account = cls()
        for name, parts in cls._FIELDS.items():
            counter = getattr(account, name)
            for item in _list(_dict(data).get(name, [])):
                row = _list(item)
                if len(row) != parts + 1:
                    raise ValueError(f"{name}: {len(row)} items, not {parts + 1}")
                key = tuple(_text(part) for part in row[:parts])
                counter[key[0] if parts == 1 else key] += _number(row[parts])
        return account


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{str(value)[:32]!r} is no finite number")
    return float(value)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{str(value)[:32]!r} is no string")
    return value


def _dict(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"{type(value).__name__} where an object belongs")
    return value


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"{type(value).__name__} where a list belongs")
    return value


def _add(into: defaultdict[str, float], flat: Mapping[str, float]) -> None:
    for key, value in flat.items():
        into[key] += value


def _key(key: str | tuple[str, ...]) -> list[str]:
    return [key] if isinstance(key, str) else list(key)


def _by(counter: Mapping[tuple[str, str], float], part: int) -> dict[str, int]:
    """``counter`` (of counts) summed by one part of its keys."""
    out: defaultdict[str, float] = defaultdict(float)
    for key, value in counter.items():
        out[key[part]] += value
    return {k: round(v) for k, v in sorted(out.items())}


def _flat(summary: Mapping[str, Any]) -> dict[str, float]:
    """A summary's figures by dotted name (:data:`RING_KEYS`' names)."""
    flat: dict[str, float] = {"spent": summary["spent"], "direct": summary["direct"]}
    for group in (
        "saved",
        "backend_requests",
        "backend_bytes",
        "served_bytes",
        "written_bytes",
        "direct_requests",
    ):
        for key, value in summary[group].items():
            flat[f"{group}.{key}"] = value
    flat["direct_bytes"] = summary["direct_bytes"]
    return flat


def _unflat(flat: Mapping[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "spent": flat.get("spent", 0.0),
        "direct": flat.get("direct", 0.0),
        "saved": {"cache": 0.0, "peer": 0.0},
        "backend_requests": {},
        "backend_bytes": {},
        "served_bytes": dict.fromkeys(SOURCES, 0),
        "written_bytes": {},
        "direct_requests": {},
        "direct_bytes": round(flat.get("direct_bytes", 0)),
    }
    for key, value in flat.items():
        group, dot, name = key.partition(".")
        if dot:
            # counts and bytes are whole numbers; money (saved) is not
            out[group][name] = value if group == "saved" else round(value)
    return out


def _vector(flat: Mapping[str, float]) -> tuple[float, ...]:
    """A snapshot: the flat totals as numbers in :data:`RING_KEYS`' order."""
    return tuple(flat.get(key, 0.0) for key in RING_KEYS)


@dataclass
class _Job:
    """One job's accounts by name label, and its snapshots."""

    label: str
    #: this process's counts of the job's current life, by name label (in /metrics)
    accounts: dict[str, _Account] = field(default_factory=dict)
    #: what the view adds: read from cost.json, earlier lives, names let go of
    carried: dict[str, _Account] = field(default_factory=dict)
    #: which start of the job (in the job table) the accounts are of
    life: tuple[float, int] | None = None
    #: the names its current life charged (at most NAMES_PER_JOB)
    seen: set[str] = field(default_factory=set)
    #: (wall time, totals then as RING_KEYS numbers), oldest first: the last hour's
    #: minutes, and a snapshot an hour before them
    minutes: deque[tuple[float, tuple[float, ...]]] = field(
        default_factory=lambda: deque(maxlen=RING_MINUTES)
    )
    hours: deque[tuple[float, tuple[float, ...]]] = field(
        default_factory=lambda: deque(maxlen=RING_HOURS)
    )
    #: snapshots older than the hours' were dropped (``since`` cannot reach before them)
    trimmed: bool = False
    dirty: bool = False
    #: when it was first charged, and last (seconds since the epoch)
    created: float = 0.0
    touched: float = 0.0

    #: the summary of its total and its flat form, kept until it is charged again (a
    #: view of many jobs sums only those charged since the view before)
    summed: tuple[dict[str, Any], dict[str, float]] | None = None

    def total(self) -> _Account:
        total = _Account()
        for account in chain(self.accounts.values(), self.carried.values()):
            total.add(account)
        return total

    def summary(self) -> tuple[dict[str, Any], dict[str, float]]:
        """Its total's summary (``GET /v1/cost``'s figures) and its flat form."""
        if self.summed is None:
            summary = self.total().summary()
            self.summed = (summary, _flat(summary))
        return self.summed

    def named(self) -> dict[str, _Account]:
        """Its accounts and carried figures together, by name."""
        out: dict[str, _Account] = {}
        for name, account in chain(self.carried.items(), self.accounts.items()):
            out.setdefault(name, _Account()).add(account)
        return out

    def carry(self, name: str, account: _Account, kept: int) -> None:
        """Keep ``account`` among the carried figures (at most ``kept`` names; the rest
        under ``other``)."""
        if name not in self.carried and len(self.carried) >= kept:
            name = _OTHER
        self.carried.setdefault(name, _Account()).add(account)

    def snapshot(self, now: float) -> None:
        if len(self.minutes) == self.minutes.maxlen:
            # the hour's oldest minute leaves: kept if an hour after the last kept one
            taken, numbers = self.minutes[0]
            if not self.hours or taken >= self.hours[-1][0] + HOUR - MINUTE:
                if len(self.hours) == self.hours.maxlen:
                    self.trimmed = True
                self.hours.append((taken, numbers))
        self.minutes.append((now, _vector(self.summary()[1])))

    def state(self, key: str | None) -> dict[str, Any]:
        return {
            "job": key,
            "label": self.label,
            "accounts": {n: a.dump() for n, a in self.named().items()},
            "minutes": [[t, list(v)] for t, v in self.minutes],
            "hours": [[t, list(v)] for t, v in self.hours],
            "trimmed": self.trimmed,
            "created": self.created,
            "touched": self.touched,
        }


@dataclass(slots=True)
class _Name:
    """A name live in the ledger: its label, decided at its first charge."""

    label: str  # the name itself, or other
    last: float  # when it was last charged
    #: the jobs whose accounts hold it under its own label (to let go of it there)
    holders: set[str | None] = field(default_factory=set)


class Ledger:
    """The node's cost ledger (docs/jobs.md).

    Args:
        jobs: the node's job table, which gives each job's ``train_job`` label.
        prices: the price tables and which backend is priced by which; its backends
            (``backend_prices``) are the only backends charged (when it names any).
        backend_prices: more backends' table names, over those of ``prices``.
        names: dataset and checkpoint names labelled at once; the rest ``other``.
        tracked: jobs kept by name; past it a new job is kept as ``other``.
        idle: seconds after which a name nothing was charged to is let go.
        state_path: where the totals are kept across restarts (``<cache.dir>/cost.json``);
            None: nowhere.
        clock: seconds since the epoch (tests pass their own).
    """

    def __init__(
        self,
        jobs: JobTable,
        *,
        prices: Prices | None = None,
        backend_prices: Mapping[str, str] | None = None,
        names: int = 64,
        tracked: int = 1024,
        idle: float = 600.0,
        state_path: Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.jobs = jobs
        self.prices = prices or Prices()
        if backend_prices is not None:
            self.prices.backend_prices.update(backend_prices)
        self.names = names
        self.tracked = tracked
        self.idle = idle
        self.state_path = state_path
        self.clock = clock
        self._reset()
        self._write_lock = asyncio.Lock()
        if state_path is not None:
            self._load(state_path)

    def _reset(self) -> None:
        #: when these totals began (the first start whose file was kept)
        self.started = self.clock()
        # accounts by job name (None: no job; "other": past tracked), least recently
        # charged first (the one let go of to make room is at the front)
        self._jobs: OrderedDict[str | None, _Job] = OrderedDict()
        # the jobs charged as other because tracked were busy, and when last charged
        self._folded: OrderedDict[str, float] = OrderedDict()
        # the live names (labelled or refused), least recently charged first
        self._names: OrderedDict[str, _Name] = OrderedDict()
        self._labelled = 0
        # the accounts of other and none jobs let go of to make room, by label and name:
        # in /metrics under other and none (their series live as long as the daemon)
        self._retired: dict[str, dict[str, _Account]] = {}
        # the figures of jobs let go of, and what was read from the file that no job
        # row carries: in the node's totals only (one bucket however many come and go)
        self._ended = _Account()
        # the latest garbage collection (or dry run) of each backend, by backend
        self._gc: dict[str, dict[str, Any]] = {}

    # --- what the hooks call ---------------------------------------------------------

    def charge(
        self,
        job: str | None,
        uid: int | None,
        name: str | None,
        what: str,
        *args: Any,
        remote: bool = False,
    ) -> None:
        """Count one event for ``job``'s ``name`` (see :mod:`.charge` for ``what``).

        A charge naming a backend the ledger's prices do not list, or an op, direction,
        source or kind it does not count, is dropped (no label value comes from a door).
        """
        prices = self.prices
        known = prices.backend_prices
        if what == "request":
            backend, op, count = args
            if op not in OPS or (known and backend not in known):
                return
            account = self._account(job, uid, name, remote)
            account.requests[backend, op] += count
            account.spent[backend, "requests"] += prices.request(backend, op) * count
        elif what == "bytes":
            backend, direction, n = args
            if direction not in _DIRECTIONS or (known and backend not in known):
                return
            account = self._account(job, uid, name, remote)
            account.bytes[backend, direction] += n
            if direction == "read":
                account.spent[backend, "egress"] += prices.egress(backend, n)
        elif what == "served":
            source, n, backend, total = args
            if source not in SOURCES:
                return
            account = self._account(job, uid, name, remote)
            account.served[source] += n
            if source != "backend" and backend is not None and (not known or backend in known):
                # what a direct reader would have paid for these bytes: their egress and
                # their share (by bytes) of the request's GET fee
                share = n / total if total else 1.0
                credit = prices.egress(backend, n) + prices.request(backend, "get") * share
                account.saved[backend, "peer" if source == "peer" else "cache"] += credit
        elif what == "direct":
            backend, op, n = args
            if op not in OPS or (known and backend not in known):
                return
            account = self._account(job, uid, name, remote)
            account.direct_requests[backend, op] += 1
            account.direct_bytes[backend] += n
            fee = prices.request(backend, op)
            account.direct[backend] += fee + (prices.egress(backend, n) if op == "get" else 0)
        elif what == "written":
            kind, n, _backend = args
            if kind not in WRITTEN_KINDS:
                return
            self._account(job, uid, name, remote).written[kind] += n

    def _account(
        self, job: str | None, uid: int | None, name: str | None, remote: bool = False
    ) -> _Account:
        now = self.clock()
        # a peer's request for its node's job never starts the job here (remote)
        label = self.jobs.label(job, uid, start=not remote)
        key = job
        if job is not None and job not in self._jobs:
            self._forget_folded(now)
            if job in self._folded or (self._kept() >= self.tracked and not self._retire_one(now)):
                # past tracked: other until it goes quiet for idle (decided once)
                key = _OTHER
                self._folded[job] = now
                self._folded.move_to_end(job)
                while len(self._folded) > _FOLDED_PER_TRACKED * self.tracked:
                    self._folded.popitem(last=False)
        entry = self._jobs.get(key)
        if entry is not None and key not in (None, _OTHER):
            life = self._life(key)
            if entry.label != label:
                # The job ended and started again under another label: what it had goes
                # to the node's totals (a counter never moves between series), and it
                # starts again at zero.
                self._retire(key)
                entry = None
            elif entry.life != life:
                # Started again under the same label: its counters start at 0 (as its
                # loader series do); its row carries on.
                for held, before in entry.accounts.items():
                    entry.carry(held, before, self.names + 2)
                entry.accounts.clear()
                entry.seen.clear()
                entry.life = life
        if entry is None:
            entry = self._jobs[key] = _Job(
                _OTHER if key == _OTHER else label,
                created=now,
                life=None if key in (None, _OTHER) else self._life(key),
            )
        else:
            self._jobs.move_to_end(key)
        entry.dirty = True
        entry.summed = None  # the account is charged once this returns
        entry.touched = now
        name_label = self._name_label(entry, key, name, now)
        account = entry.accounts.get(name_label)
        if account is None:
            account = entry.accounts[name_label] = _Account()
        return account

    def _life(self, job: str) -> tuple[float, int] | None:
        """Which start of ``job`` the job table has live (None: it keeps it by no name)."""
        return self.jobs.life(job)

    def _kept(self) -> int:
        return len(self._jobs) - (None in self._jobs) - (_OTHER in self._jobs)

    def _forget_folded(self, now: float) -> None:
        while self._folded:
            job, seen = next(iter(self._folded.items()))
            if seen >= now - self.idle:
                break
            del self._folded[job]

    def _retire_one(self, now: float) -> bool:
        """Make room for a job: let go of the job charged least recently, if nothing was
        charged to it for ``idle`` seconds. Whether one was (O(1): the front)."""
        for key, entry in self._jobs.items():
            if key is None or key == _OTHER:
                continue
            if entry.touched >= now - self.idle:
                return False
            self._retire(key)
            return True
        return False

    def _retire(self, key: str | None) -> None:
        entry = self._jobs.pop(key)
        for account in entry.carried.values():
            self._ended.add(account)
        if entry.label not in (_OTHER, _NONE):
            for account in entry.accounts.values():
                self._ended.add(account)
            return
        retired = self._retired.setdefault(entry.label, {})
        for name, account in entry.accounts.items():
            retired.setdefault(name, _Account()).add(account)

    def _name_label(self, entry: _Job, key: str | None, name: str | None, now: float) -> str:
        if name is None:
            return NO_NAME
        self._let_go_idle(now)
        if name not in entry.seen:
            if len(entry.seen) >= NAMES_PER_JOB:
                return _OTHER
            entry.seen.add(name)
        known = self._names.get(name)
        if known is None:
            if len(self._names) >= NAMES_KEPT:
                return _OTHER
            labelled = self._labelled < self.names
            known = self._names[name] = _Name(name if labelled else _OTHER, now)
            self._labelled += labelled
        else:
            known.last = now
            self._names.move_to_end(name)
        if known.label != _OTHER:
            known.holders.add(key)
        return known.label

    def _let_go_idle(self, now: float) -> None:
        """Let go of the names nothing was charged to for ``idle`` seconds (from the
        front: each name once)."""
        while self._names:
            name, known = next(iter(self._names.items()))
            if known.last >= now - self.idle:
                break
            del self._names[name]
            if known.label != _OTHER:
                self._labelled -= 1
                self._let_go(name, known.holders)

    def _let_go(self, name: str, holders: set[str | None]) -> None:
        """A labelled name let go of: its series end (under every job); its figures
        stay in the jobs' rows (carried)."""
        for key in holders:
            entry = self._jobs.get(key)
            account = None if entry is None else entry.accounts.pop(name, None)
            if entry is not None and account is not None:
                entry.carry(name, account, self.names + 2)
        for accounts in self._retired.values():
            account = accounts.pop(name, None)
            if account is not None:
                self._ended.add(account)

    def note_gc(self, backend: str, report: Mapping[str, Any]) -> None:
        """Keep what a ``chunkd gc`` (or ``--dry-run``) of ``backend`` found to delete,
        the latest of each backend (:data:`GC_REPORTS_KEPT` backends at most), with its
        time: ``GET /v1/cost/storage``'s ``gc_reclaimable``."""
        self._gc.pop(backend, None)
        self._gc[backend] = {
            "backend": backend,
            "target": str(report.get("target", backend))[:1024],
            "at": self.clock(),
            "dry_run": bool(report.get("dry_run")),
            "bytes": int(report.get("freed_bytes") or 0),
            "chunks": int(report.get("swept") or 0),
            "retired": int(report.get("retired_count") or 0),
            "kept_young": int(report.get("kept_young") or 0),
        }
        while len(self._gc) > GC_REPORTS_KEPT:
            del self._gc[next(iter(self._gc))]

    def gc_reports(self) -> list[dict[str, Any]]:
        """The garbage collections :meth:`note_gc` kept, by backend name."""
        return [dict(self._gc[b]) for b in sorted(self._gc)]

    # --- views -----------------------------------------------------------------------

    def unsummed(self) -> list[_Job]:
        """The jobs charged since their summary was last made (what a view would sum);
        :func:`~chunkd.gateway.costs.summaries.warm_ledger` makes theirs a few at a
        time before a view, so that no view sums them all in one piece."""
        return [entry for entry in self._jobs.values() if entry.summed is None]

    def view(
        self, *, job: str | None = None, since: float | None = None, names: bool = True
    ) -> dict[str, Any]:
        """The ledger as ``GET /v1/cost`` answers it (docs/jobs.md has the shape).

        Args:
            job: only this job (its name; ``none`` for work with no job).
            since: only what happened after this time (seconds since the epoch), as
                well as the snapshots allow: the answer's ``since`` is the time it
                really counts from (never before the totals began).
            names: each job's row lists its names (``names``); False: the rows
                without them, the same totals (the dashboard reads that every second:
                the names' summaries are most of a view's work).
        """
        now = self.clock()
        if since is not None:
            since = min(max(since, 0.0), now + 86400.0) if math.isfinite(since) else now
        answered_since = self.started if since is None else max(self.started, since)
        rows = []
        total_flat: defaultdict[str, float] = defaultdict(float)
        for key, entry in sorted(self._jobs.items(), key=lambda kv: kv[0] or ""):
            name = _NONE if key is None else key
            if job is not None and job != name:
                continue
            row: dict[str, Any] = {"job": name, "label": entry.label}
            if since is None:
                summary, flat = entry.summary()
                # copies: the summary is kept for the next view
                row.update({k: dict(v) if isinstance(v, dict) else v for k, v in summary.items()})
                if names:
                    row["names"] = [
                        {"name": n, **a.summary()} for n, a in sorted(entry.named().items())
                    ]
                _add(total_flat, flat)
            else:
                flat, counted_from = self._since(entry, since)
                answered_since = min(answered_since, counted_from)
                row.update(_unflat(flat))
                _add(total_flat, flat)
            rows.append(row)
        if job is None and since is None:
            for accounts in self._retired.values():
                for account in accounts.values():
                    _add(total_flat, _flat(account.summary()))
            _add(total_flat, _flat(self._ended.summary()))
        rows.sort(key=lambda r: -r["spent"] - r["direct"])
        return {
            "since": answered_since,
            "now": now,
            "currency": self.prices.currency,
            "totals": _unflat(total_flat),
            "jobs": rows,
            "storage": None,
        }

    def _since(self, entry: _Job, since: float) -> tuple[dict[str, float], float]:
        """The job's totals now less its totals at ``since``, and the time they count
        from: ``since`` when exact (nothing charged after it; or the job began after
        it; or a snapshot taken then), else the snapshot's or the job's start before it
        (the figures then include some of what came before ``since``)."""
        current = dict(entry.summary()[1])
        if entry.touched <= since:
            return dict.fromkeys(current, 0.0), since
        if entry.created > since:
            return current, since
        base: tuple[float, ...] | None = None
        base_time = max(entry.created, self.started)
        for taken, numbers in chain(entry.hours, entry.minutes):
            if taken > since:
                break
            base, base_time = numbers, taken
        if base is None and entry.trimmed:
            # the snapshots no longer reach back that far: from the oldest kept
            oldest = (entry.hours or entry.minutes)[0]
            base, base_time = oldest[1], oldest[0]
        was = dict(zip(RING_KEYS, base or (), strict=False))
        # (a job's total never goes down; max() guards a float's rounding)
        return {k: max(0.0, v - was.get(k, 0.0)) for k, v in current.items()}, base_time

    def collector(self) -> Collector:
        """The ``chunkd_cost_*`` metrics, read from the ledger at each scrape."""
        return _CostCollector(self)

    def series(self) -> Iterator[tuple[str, str, _Account]]:
        """(train_job label, name label, account) of the live labels, summed: what this
        process counted only (never what it read from cost.json)."""
        live: dict[tuple[str, str], _Account] = {}
        self._let_go_idle(self.clock())  # a name quiet for idle ends its series
        # a named job's series go when it ends (as the job table's do)
        named = self.jobs.live_labels()
        for label, accounts in self._retired.items():
            if label in (_OTHER, _NONE):
                for name, account in accounts.items():
                    live.setdefault((label, name), _Account()).add(account)
        for entry in self._jobs.values():
            if entry.label not in (_OTHER, _NONE) and entry.label not in named:
                continue
            for name, account in entry.accounts.items():
                live.setdefault((entry.label, name), _Account()).add(account)
        for (label, name), account in sorted(live.items()):
            yield label, name, account

    # --- persistence -----------------------------------------------------------------

    def tick(self) -> None:
        """Snapshot the totals of each job charged since the last tick."""
        now = self.clock()
        for entry in self._jobs.values():
            if entry.dirty:
                entry.snapshot(now)
                entry.dirty = False

    def _head(self) -> dict[str, Any]:
        retired = _Account()
        for accounts in self._retired.values():
            for account in accounts.values():
                retired.add(account)
        # what no job row carries goes back as one bucket (the node's totals only)
        retired.add(self._ended)
        return {
            "version": _STATE_VERSION,
            "started": self.started,
            "written": self.clock(),
            "ended": retired.dump(),
            "gc": list(self._gc.values()),
        }

    def state(self) -> dict[str, Any]:
        """The ledger as ``cost.json`` keeps it."""
        return self._head() | {"jobs": [e.state(k) for k, e in self._jobs.items()]}

    async def save(self) -> None:
        """Tick, and write the totals to ``state_path`` atomically.

        The file is encoded a job at a time on the loop, which runs other work between
        slices of :data:`_SLICE` seconds; the write and fsync run in a thread.
        """
        self.tick()
        if self.state_path is None:
            return
        async with self._write_lock:
            loop = asyncio.get_running_loop()
            head = json.dumps(self._head(), separators=(",", ":"))
            # bytes: the thread's write is syscalls (the GIL let go), no encoding
            pieces = [head[:-1].encode(), b',"jobs":[']
            jobs = list(self._jobs.items())
            deadline = loop.time() + _SLICE
            first = True
            for key, entry in jobs:
                if self._jobs.get(key) is not entry:
                    continue  # let go of since: in the totals written above
                text = json.dumps(entry.state(key), separators=(",", ":"))
                pieces.append(text.encode() if first else b"," + text.encode())
                first = False
                if loop.time() > deadline:
                    await asyncio.sleep(0)
                    deadline = loop.time() + _SLICE
            pieces.append(b"]}")
            await asyncio.to_thread(_write_atomically, self.state_path, pieces)

    async def run(self) -> None:
        """Save every minute until cancelled (the daemon runs it as a task)."""
        while True:
            await asyncio.sleep(MINUTE)
            try:
                await self.save()
            except OSError as exc:
                log.warning("cannot write the cost ledger to %s: %s", self.state_path, exc)

    def _load(self, path: Path) -> None:
        try:
            self._read_state(_dict(json.loads(path.read_text())))
        except FileNotFoundError:
            return
        except Exception as exc:  # any shape: set aside, never fatal
            # A damaged file is set aside, not fatal: the totals start again.
            log.warning("cost ledger %s unreadable (%s); starting from zero", path, exc)
            self._reset()
            with contextlib.suppress(OSError):
                path.rename(path.with_suffix(".json.damaged"))
        else:
            # what was read is carried (the view's), never counted in /metrics again
            self._jobs = OrderedDict(sorted(self._jobs.items(), key=lambda kv: kv[1].touched))

    def _read_state(self, data: dict[str, Any]) -> None:
        """Take ``cost.json``'s totals (all carried: the view's only).

        Raises:
            ValueError, TypeError, KeyError: ``data`` is not of the file's shape.
        """
        if data.get("version") != _STATE_VERSION:
            raise ValueError(f"version {str(data.get('version'))[:16]!r}, not {_STATE_VERSION}")
        self.started = _number(data["started"])
        for item in _list(data["jobs"])[: self.tracked + 2]:
            item = _dict(item)
            key = item["job"]
            if key is not None:
                _text(key)
            entry = _Job(
                _text(item["label"]),
                created=_number(item["created"]),
                touched=_number(item["touched"]),
                trimmed=bool(item.get("trimmed")),
            )
            for name, account in _dict(item["accounts"]).items():
                entry.carry(name, _Account.load(account), self.names + 2)
            for ring, kept in (("minutes", entry.minutes), ("hours", entry.hours)):
                for snapshot in _list(item.get(ring, [])):
                    taken, numbers = _list(snapshot)
                    values = tuple(_number(n) for n in _list(numbers))
                    if len(values) != len(RING_KEYS):
                        raise ValueError(f"a snapshot of {len(values)} numbers")
                    kept.append((_number(taken), values))
            self._jobs[key] = entry
        self._ended = _Account.load(data.get("ended", {}))
        for item in _list(data.get("gc", []))[-GC_REPORTS_KEPT:]:
            item = _dict(item)
            self._gc[_text(item["backend"])] = {
                "backend": item["backend"],
                "target": _text(item["target"])[:1024],
                "at": _number(item["at"]),
                "dry_run": bool(item["dry_run"]),
                **{k: int(_number(item[k])) for k in ("bytes", "chunks", "retired", "kept_young")},
            }


def _write_atomically(path: Path, pieces: list[bytes]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as out:
        out.writelines(pieces)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


class _CostCollector(Collector):
    """Reads the ledger when Prometheus scrapes."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def collect(self) -> Iterator[Metric]:
        # docstring inherited
        job_name = ["train_job", "name"]
        families = {
            "requests": CounterMetricFamily(
                "chunkd_cost_backend_requests",
                "Backend requests by the job and name whose work made them, each attempt "
                "(as chunkd_backend_requests_total counts them)",
                labels=[*job_name, "backend", "op"],
            ),
            "bytes": CounterMetricFamily(
                "chunkd_cost_backend_bytes",
                "Bytes read from and written to backends, by job and name",
                labels=[*job_name, "backend", "direction"],
            ),
            "served": CounterMetricFamily(
                "chunkd_cost_served_bytes",
                "Bytes handed to readers, by job, name and where they came from",
                labels=[*job_name, "source"],
            ),
            "written": CounterMetricFamily(
                "chunkd_cost_written_bytes",
                "Bytes written for a job: checkpoints, freezes, migrations, objects",
                labels=[*job_name, "kind"],
            ),
            "direct_requests": CounterMetricFamily(
                "chunkd_cost_direct_requests",
                "Backend requests the same reads would have made without chunkd (one per "
                "read request of every rank)",
                labels=[*job_name, "backend", "op"],
            ),
            "direct_bytes": CounterMetricFamily(
                "chunkd_cost_direct_bytes",
                "Bytes the same reads would have read from the backend without chunkd",
                labels=[*job_name, "backend"],
            ),
            "spent": CounterMetricFamily(
                "chunkd_cost_dollars",
                "What backend requests and egress cost, in the price table's currency",
                labels=[*job_name, "backend", "item"],
            ),
            "direct": CounterMetricFamily(
                "chunkd_cost_direct_dollars",
                "What the same reads would have cost without chunkd, in the table's currency",
                labels=[*job_name, "backend"],
            ),
            "saved": CounterMetricFamily(
                "chunkd_cost_saved_dollars",
                "Credit for bytes served from the cache or by a peer: their direct price",
                labels=[*job_name, "source"],
            ),
        }
        for label, name, account in self.ledger.series():
            for what, family in families.items():
                counter: Mapping[Any, float] = getattr(account, what)
                if what == "saved":
                    by_source: defaultdict[str, float] = defaultdict(float)
                    for (_, source), value in counter.items():
                        by_source[source] += value
                    counter = by_source
                for key, value in sorted(counter.items()):
                    family.add_metric([label, name, *_key(key)], value)
        yield from families.values()
