"""What data movement cost, by job and by dataset or checkpoint name.

The hooks (:mod:`chunkd.gateway.costs.charge`) call :meth:`Ledger.charge` with the
job, uid and name of the work at hand. The ledger keeps, per (job, name), counters
of backend requests and bytes, bytes served by source, bytes written, and what the
same reads would have sent to the backend without chunkd ("direct"), each priced by
the backend's price table (:class:`~chunkd.gateway.costs.prices.Prices`).

Bounds: at most ``tracked`` jobs are kept by name (the rest are kept as one job,
``other``); at most ``names`` dataset or checkpoint names are labelled at once (the
rest: ``other``; a name is admitted at its first charge while fewer are live, and
stays named until nothing has been charged to it for ``idle`` seconds); so at most
``tracked`` x (``names`` + 2) accounts. Per job, a ring of per-minute snapshots of
its totals for 24 hours (only minutes with activity) answers ``since``.

The cumulative totals and rings are written to ``state_path`` (``<cache.dir>/cost.json``)
atomically every minute (:meth:`Ledger.run`) and at close, and read back at start:
``chunkd cost`` survives a restart, and a kill -9 loses at most the last minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Final

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from chunkd.gateway.costs.prices import Prices

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
#: seconds between snapshots of the totals (the ring's step and the file's)
MINUTE: Final = 60.0
#: snapshots kept per job: 24 hours of minutes
RING_MINUTES: Final = 1440
_STATE_VERSION: Final = 1
#: garbage collection reports kept: the latest of each backend, at most this many
#: backends (the oldest report goes first)
GC_REPORTS_KEPT: Final = 64


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

    _FIELDS: ClassVar[tuple[str, ...]] = (
        "requests",
        "bytes",
        "served",
        "written",
        "direct_requests",
        "direct_bytes",
        "spent",
        "direct",
        "saved",
    )

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
    def load(cls, data: Mapping[str, Any]) -> _Account:
        account = cls()
        for name in cls._FIELDS:
            counter = getattr(account, name)
            for *key, value in data.get(name, ()):
                counter[key[0] if len(key) == 1 else tuple(key)] += value
        return account


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


#: the totals a ring snapshot keeps (a few numbers per minute)
def _flat(summary: Mapping[str, Any]) -> dict[str, float]:
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


@dataclass
class _Job:
    """One job's accounts by name label, and its ring of snapshots."""

    label: str
    accounts: dict[str, _Account] = field(default_factory=dict)
    #: (wall time of the snapshot, flat totals then), oldest first
    ring: deque[tuple[float, dict[str, float]]] = field(
        default_factory=lambda: deque(maxlen=RING_MINUTES)
    )
    dirty: bool = False
    #: when it was first charged, and last (seconds since the epoch)
    created: float = 0.0
    touched: float = 0.0

    #: the summary of its total and its flat form, kept until it is charged again (a
    #: view of many jobs sums only those charged since the view before)
    summed: tuple[dict[str, Any], dict[str, float]] | None = None

    def total(self) -> _Account:
        total = _Account()
        for account in self.accounts.values():
            total.add(account)
        return total

    def summary(self) -> tuple[dict[str, Any], dict[str, float]]:
        """Its total's summary (``GET /v1/cost``'s figures) and its flat form."""
        if self.summed is None:
            summary = self.total().summary()
            self.summed = (summary, _flat(summary))
        return self.summed


class Ledger:
    """The node's cost ledger (docs/jobs.md).

    Args:
        jobs: the node's job table, which gives each job's ``train_job`` label.
        prices: the price tables and which backend is priced by which.
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
        #: when these totals began (the first start whose file was kept)
        self.started = clock()
        # accounts by job name (None: no job; "other": past tracked)
        self._jobs: dict[str | None, _Job] = {}
        # the named names and when each was last charged
        self._names: dict[str, float] = {}
        # the accounts of jobs let go of to make room, by label and name: in the view's
        # totals; in /metrics under other and none only (a named job's series end with it)
        self._retired: dict[str, dict[str, _Account]] = {}
        # the figures of named jobs let go of and of names let go of, all in one: in the
        # node's totals only (bounded however many jobs and names come and go)
        self._ended = _Account()
        # the latest garbage collection (or dry run) of each backend, by backend
        self._gc: dict[str, dict[str, Any]] = {}
        self._write_lock = asyncio.Lock()
        if state_path is not None:
            self._load(state_path)

    # --- what the hooks call ---------------------------------------------------------

    def charge(
        self, job: str | None, uid: int | None, name: str | None, what: str, *args: Any
    ) -> None:
        """Count one event for ``job``'s ``name`` (see :mod:`.charge` for ``what``)."""
        account = self._account(job, uid, name)
        prices = self.prices
        if what == "request":
            backend, op, count = args
            account.requests[backend, op] += count
            account.spent[backend, "requests"] += prices.request(backend, op) * count
        elif what == "bytes":
            backend, direction, n = args
            account.bytes[backend, direction] += n
            if direction == "read":
                account.spent[backend, "egress"] += prices.egress(backend, n)
        elif what == "served":
            source, n, backend, total = args
            account.served[source] += n
            if source != "backend" and backend is not None:
                # what a direct reader would have paid for these bytes: their egress and
                # their share (by bytes) of the request's GET fee
                share = n / total if total else 1.0
                credit = prices.egress(backend, n) + prices.request(backend, "get") * share
                account.saved[backend, "peer" if source == "peer" else "cache"] += credit
        elif what == "direct":
            backend, op, n = args
            account.direct_requests[backend, op] += 1
            account.direct_bytes[backend] += n
            fee = prices.request(backend, op)
            account.direct[backend] += fee + (prices.egress(backend, n) if op == "get" else 0)
        elif what == "written":
            kind, n, _backend = args
            account.written[kind] += n

    def _account(self, job: str | None, uid: int | None, name: str | None) -> _Account:
        label = self.jobs.label(job, uid)
        key = job
        if job is not None and job not in self._jobs and len(self._jobs) >= self.tracked:
            key = job if self._retire_one() else _OTHER
        entry = self._jobs.get(key)
        if entry is not None and entry.label != label and key != _OTHER:
            # The job ended and started again under another label: what it had goes to
            # the retired totals under its old label (a counter never moves between
            # series), and it starts again at zero.
            self._retire(key)
            entry = None
        if entry is None:
            now = self.clock()
            entry = self._jobs[key] = _Job(_OTHER if key == _OTHER else label, created=now)
        entry.dirty = True
        entry.summed = None  # the account is charged once this returns
        entry.touched = self.clock()
        name_label = self._name_label(name)
        account = entry.accounts.get(name_label)
        if account is None:
            account = entry.accounts[name_label] = _Account()
        return account

    def _retire_one(self) -> bool:
        """Make room for a job: fold the job charged least recently, if nothing was
        charged to it for ``idle`` seconds, into the retired totals. Whether one was."""
        now = self.clock()
        oldest = min(
            (k for k in self._jobs if k is not None and k != _OTHER),
            key=lambda k: self._jobs[k].touched,
            default=None,
        )
        if oldest is None or self._jobs[oldest].touched >= now - self.idle:
            return False
        self._retire(oldest)
        return True

    def _let_go(self, name: str) -> None:
        """A name nothing was charged to for ``idle`` seconds: its figures leave the
        jobs' rows and /metrics for the node's totals (its series end, as a job's do)."""
        for entry in self._jobs.values():
            if name in entry.accounts:
                entry.summed = None
        buckets = [entry.accounts for entry in self._jobs.values()]
        for accounts in [*buckets, *self._retired.values()]:
            account = accounts.pop(name, None)
            if account is not None:
                self._ended.add(account)

    def _retire(self, key: str | None) -> None:
        entry = self._jobs.pop(key)
        if entry.label not in (_OTHER, _NONE):
            for account in entry.accounts.values():
                self._ended.add(account)
            return
        retired = self._retired.setdefault(entry.label, {})
        for name, account in entry.accounts.items():
            retired.setdefault(name, _Account()).add(account)

    def _name_label(self, name: str | None) -> str:
        if name is None:
            return NO_NAME
        now = self.clock()
        if name in self._names:
            self._names[name] = now
            return name
        # let go of the names nothing was charged to for idle seconds
        for stale in [n for n, seen in self._names.items() if seen < now - self.idle]:
            del self._names[stale]
            self._let_go(stale)
        if len(self._names) >= self.names:
            return _OTHER
        self._names[name] = now
        return name

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

    def view(
        self, *, job: str | None = None, since: float | None = None, names: bool = True
    ) -> dict[str, Any]:
        """The ledger as ``GET /v1/cost`` answers it (docs/jobs.md has the shape).

        Args:
            job: only this job (its name; ``none`` for work with no job).
            since: only what happened after this time (seconds since the epoch), as
                well as the per-minute snapshots allow: the answer's ``since`` is the
                time it really counts from (never before the totals began).
            names: each job's row lists its names (``names``); False: the rows
                without them, the same totals (the dashboard reads that every second:
                the names' summaries are most of a view's work).
        """
        now = self.clock()
        answered_since = self.started if since is None else max(self.started, since)
        rows = []
        totals = _Account().summary()
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
                        {"name": n, **a.summary()} for n, a in sorted(entry.accounts.items())
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
        totals = _unflat(total_flat)
        rows.sort(key=lambda r: -r["spent"] - r["direct"])
        return {
            "since": answered_since,
            "now": now,
            "currency": self.prices.currency,
            "totals": totals,
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
        base: dict[str, float] | None = None
        base_time = max(entry.created, self.started)
        for taken, flat in entry.ring:
            if taken > since:
                break
            base, base_time = flat, taken
        if base is None and len(entry.ring) == RING_MINUTES:
            # the ring no longer reaches back that far: from its oldest snapshot
            base, base_time = entry.ring[0][1], entry.ring[0][0]
        base = base or {}
        # a name let go since leaves the job's figures: never below zero
        return {k: max(0.0, v - base.get(k, 0)) for k, v in current.items()}, base_time

    def collector(self) -> Collector:
        """The ``chunkd_cost_*`` metrics, read from the ledger at each scrape."""
        return _CostCollector(self)

    def series(self) -> Iterator[tuple[str, str, _Account]]:
        """(train_job label, name label, account) of the live labels, summed."""
        live: dict[tuple[str, str], _Account] = {}
        # a named job's series go when it ends (as the job table's do)
        named = {
            str(job["label"]) for job in self.jobs.view().get("jobs", []) if not job.get("ended")
        }
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
        """Snapshot the totals of each job charged since the last tick into its ring."""
        now = self.clock()
        for entry in self._jobs.values():
            if entry.dirty:
                entry.ring.append((now, dict(entry.summary()[1])))
                entry.dirty = False

    def state(self) -> dict[str, Any]:
        """The ledger as ``cost.json`` keeps it."""
        return {
            "version": _STATE_VERSION,
            "started": self.started,
            "written": self.clock(),
            "jobs": [
                {
                    "job": key,
                    "label": entry.label,
                    "accounts": {n: a.dump() for n, a in entry.accounts.items()},
                    "ring": [[t, flat] for t, flat in entry.ring],
                    "created": entry.created,
                    "touched": entry.touched,
                }
                for key, entry in self._jobs.items()
            ],
            "retired": {
                label: {n: a.dump() for n, a in accounts.items()}
                for label, accounts in self._retired.items()
            },
            "ended": self._ended.dump(),
            "gc": list(self._gc.values()),
        }

    async def save(self) -> None:
        """Tick, and write the totals to ``state_path`` atomically (off the loop)."""
        self.tick()
        if self.state_path is None:
            return
        state = self.state()  # copied on the loop; encoded and written off it
        async with self._write_lock:
            await asyncio.to_thread(_write_atomically, self.state_path, state)

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
            data = json.loads(path.read_text())
            _check_version(data)
            self.started = float(data["started"])
            for item in data["jobs"][: self.tracked + 2]:
                entry = _Job(
                    str(item["label"]),
                    created=float(item["created"]),
                    touched=float(item["touched"]),
                )
                for name, account in item["accounts"].items():
                    entry.accounts[name] = _Account.load(account)
                entry.ring.extend((float(t), flat) for t, flat in item["ring"])
                self._jobs[item["job"]] = entry
            for label, accounts in data.get("retired", {}).items():
                self._retired[str(label)] = {n: _Account.load(a) for n, a in accounts.items()}
            self._ended = _Account.load(data.get("ended", {}))
            for item in data.get("gc", [])[-GC_REPORTS_KEPT:]:
                self._gc[str(item["backend"])] = {
                    "backend": str(item["backend"]),
                    "target": str(item["target"])[:1024],
                    "at": float(item["at"]),
                    "dry_run": bool(item["dry_run"]),
                    **{k: int(item[k]) for k in ("bytes", "chunks", "retired", "kept_young")},
                }
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # A damaged file is set aside, not fatal: the totals start again.
            log.warning("cost ledger %s unreadable (%s); starting from zero", path, exc)
            self._jobs.clear()
            self._retired.clear()
            self._ended = _Account()
            self._gc.clear()
            with contextlib.suppress(OSError):
                path.rename(path.with_suffix(".json.damaged"))


def _check_version(data: Any) -> None:
    if data.get("version") != _STATE_VERSION:
        raise ValueError(f"version {data.get('version')!r}, not {_STATE_VERSION}")


def _write_atomically(path: Path, state: Mapping[str, Any]) -> None:
    text = json.dumps(state, separators=(",", ":"))
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as out:
        out.write(text)
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
