"""The node's figures, once a second: the one source the dashboard, ``chunkd top`` and
anything else that shows the node live read (``docs/dashboard.md`` lists every field).

A :class:`Telemetry` reads the daemon's counters (the same prometheus-client objects
``/metrics`` exports, and the cache's own stats) once every ``interval`` seconds,
turns the difference from the reading before into a **sample** (rates per second,
ratios, latency percentiles over the last 10 s), keeps the last ``history`` samples,
and hands each new one to every stream that follows it. A view formats a sample; it
never computes a figure of its own.

Streams: at most ``max_streams`` follow at once (:class:`TooManyStreamsError` past
that); each has a queue of at most ``_QUEUE`` samples, and a stream that falls that far
behind (a client that does not read) is ended. A stream that resumes with
``Last-Event-ID: BOOT:SEQ`` of this boot first gets the samples it missed that are
still in the history; of another boot, a ``restarted`` event.

Errors: a logging handler on the ``chunkd`` loggers keeps the last
:data:`ERRORS_KEPT` warnings and errors (their time, level, logger and first
:data:`MESSAGE_CHARS` characters); it is removed when the telemetry closes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import chunkd
from chunkd.client.protocol import FIRST_BATCH_PHASES
from chunkd.errors import BackendUnavailableError
from chunkd.gateway.costs.summaries import warm_ledger

if TYPE_CHECKING:
    from prometheus_client.metrics import MetricWrapperBase

    from chunkd.cache import ChunkCache
    from chunkd.gateway.backends import Backends
    from chunkd.gateway.checkpoints import Checkpoints
    from chunkd.gateway.costs import Ledger
    from chunkd.gateway.hot import HotSet
    from chunkd.gateway.jobs import JobTable
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.peers import Peers

__all__ = [
    "COST_JOBS_SHOWN",
    "ERRORS_KEPT",
    "JOBS_SHOWN",
    "SCHEMA",
    "SERVED_SOURCES",
    "Event",
    "Telemetry",
    "TooManyStreamsError",
    "peer_roles",
    "replica_figures",
    "role_reading",
]

SCHEMA: Final = 1
#: warnings and errors a sample carries (the newest)
ERRORS_KEPT: Final = 20
MESSAGE_CHARS: Final = 500
#: seconds of history the latency percentiles are taken over
LATENCY_WINDOW: Final = 10
#: saves in flight a sample lists (the oldest first)
CHECKPOINTS_SHOWN: Final = 50
#: jobs a sample lists (the highest stall first), and jobs its cost figures list (the
#: highest spent first)
JOBS_SHOWN: Final = 20
COST_JOBS_SHOWN: Final = 10
#: a job's worst ranks and uids a sample lists at most
JOB_RANKS_SHOWN: Final = 8
JOB_UIDS_SHOWN: Final = 8
#: the share of the sampling interval reading the ledger may take on average (a ledger
#: that takes longer is read every few samples, at most every LEDGER_EVERY_MAX)
LEDGER_SHARE: Final = 0.02
LEDGER_EVERY_MAX: Final = 30
#: where a reader's bytes came from (a job's throughput, the ledger's served bytes)
SERVED_SOURCES: Final = ("ram", "disk", "peer", "backend")
_QUEUE: Final = 60


class TooManyStreamsError(BackendUnavailableError):
    """Every stream slot is taken; try again later (503)."""


@dataclass(frozen=True, slots=True)
class Event:
    """One server-sent event: its name, its id (``BOOT:SEQ``, or "") and its data."""

    name: str
    id: str
    data: dict[str, Any]


class _ErrorTail(logging.Handler):
    """The last warnings and errors logged, bounded; safe from any thread."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.kept: collections.deque[dict[str, Any]] = collections.deque(maxlen=ERRORS_KEPT)
        self.total = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:
            message = str(record.msg)
        if record.exc_info and record.exc_info[1] is not None:
            message += f" ({type(record.exc_info[1]).__name__}: {record.exc_info[1]})"
        self.kept.append(
            {
                "t": round(record.created, 3),
                "level": record.levelname.lower(),
                "logger": record.name,
                "message": message[:MESSAGE_CHARS],
            }
        )
        self.total += 1


@dataclass
class _Reading:
    """Cumulative counters at one moment."""

    at: float
    chunks: dict[str, float] = field(default_factory=dict)
    chunk_bytes: dict[str, float] = field(default_factory=dict)
    peer_in: float = 0.0
    backends: dict[str, dict[str, float]] = field(default_factory=dict)
    waits: float = 0.0
    http: float = 0.0
    local: float = 0.0
    s3: float = 0.0
    members: dict[tuple[str, str], float] = field(default_factory=dict)
    #: chunk bytes by (peer, direction, role): chunkd_peer_role_bytes
    roles: dict[tuple[str, str, str], float] = field(default_factory=dict)
    #: backend latency: cumulative count per bucket bound (seconds; inf last)
    latency: list[tuple[float, float]] = field(default_factory=list)


@dataclass(eq=False)
class _Stream:
    queue: asyncio.Queue[Event | None] = field(
        default_factory=lambda: asyncio.Queue(maxsize=_QUEUE)
    )


class Telemetry:
    """Samples the node's figures every ``interval`` seconds (see the module docstring)."""

    def __init__(
        self,
        metrics: Metrics,
        cache: ChunkCache,
        backends: Backends,
        checkpoints: Checkpoints,
        hot: HotSet,
        *,
        peers: Peers | None,
        listen: str,
        jobs: JobTable | None = None,
        ledger: Ledger | None = None,
        interval: float = 1.0,
        history: int = 300,
        max_streams: int = 64,
    ) -> None:
        self.metrics = metrics
        self.cache = cache
        self.backends = backends
        self.checkpoints = checkpoints
        self.hot = hot
        self.peers = peers
        self.jobs = jobs
        self.ledger = ledger
        self.interval = interval
        self.max_streams = max_streams
        self.boot = secrets.token_hex(8)
        self.started = time.time()
        self.node = {
            "version": chunkd.__version__,
            "boot": self.boot,
            "started": round(self.started, 3),
            "listen": listen,
            "backends": [b.name for b in backends],
            "self": peers.address if peers is not None else None,
        }
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=history)
        self._streams: set[_Stream] = set()
        self._errors = _ErrorTail()
        self._readings: collections.deque[_Reading] = collections.deque(maxlen=LATENCY_WINDOW + 1)
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        #: the ledger's view at its last reading, and when that was (monotonic); the
        #: sample at which it is read again
        self._ledger_view: dict[str, Any] | None = None
        self._ledger_at = time.monotonic()
        self._ledger_next = 0
        #: each job's bytes served by source at that reading (cumulative), and per
        #: second since the reading before
        self._served: dict[str, dict[str, float]] = {}
        self._served_rates: dict[str, dict[str, float]] = {}
        #: the parts of a sample that failed once already (logged once, then quiet)
        self._failed: set[str] = set()

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Start sampling, and keeping the warnings and errors of the ``chunkd`` loggers."""
        logging.getLogger("chunkd").addHandler(self._errors)
        self._readings.append(self._read())
        self._task = asyncio.create_task(self._run())

    def end_streams(self) -> None:
        """End every stream now (the daemon is stopping: they must not hold it up)."""
        for stream in list(self._streams):
            _offer(stream, None)

    async def close(self) -> None:
        """Stop sampling; end every stream; remove the logging handler."""
        self.end_streams()
        logging.getLogger("chunkd").removeHandler(self._errors)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time() + self.interval
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            # A stalled loop does not make a burst of samples: the next is one interval on.
            next_at = max(next_at + self.interval, loop.time() + self.interval / 2)
            try:
                await self._warm_ledger()
                sample = self.sample()
            except Exception:
                logging.getLogger("chunkd.gateway.dashboard").exception("a sample failed")
                continue
            event = Event("sample", f"{self.boot}:{sample['seq']}", sample)
            for stream in list(self._streams):
                if not _offer(stream, event):
                    self._streams.discard(stream)  # it fell behind: ended

    # -- what views read ----------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The node and its history: what a view loads once before following the stream."""
        return {
            "schema": SCHEMA,
            "node": self.node,
            "interval_s": self.interval,
            "history": list(self.history),
        }

    @contextlib.asynccontextmanager
    async def follow(self, last_event_id: str | None = None) -> AsyncIterator[_Follower]:
        """A stream of events for one view, ended when the context exits.

        Raises:
            TooManyStreamsError: ``max_streams`` streams are open already.
        """
        if len(self._streams) >= self.max_streams:
            raise TooManyStreamsError(
                f"{self.max_streams} dashboard streams are open already; close one, or "
                "read /v1/dashboard instead"
            )
        stream = _Stream()
        for event in self._resume(last_event_id):
            _offer(stream, event)
        self._streams.add(stream)
        try:
            yield _Follower(stream)
        finally:
            self._streams.discard(stream)

    def _resume(self, last_event_id: str | None) -> list[Event]:
        if not last_event_id:
            return []
        boot, _, seq_text = last_event_id.partition(":")
        if boot != self.boot:
            return [Event("restarted", "", self.node)]
        try:
            seq = int(seq_text)
        except ValueError:
            return []
        missed = [s for s in self.history if s["seq"] > seq][-(_QUEUE - 1) :]
        return [Event("sample", f"{self.boot}:{s['seq']}", s) for s in missed]

    # -- sampling -----------------------------------------------------------------------

    def sample(self) -> dict[str, Any]:
        """Take a reading and make the sample of the time since the one before; it goes
        into the history. Runs on the loop: it only reads counters."""
        now = self._read()
        before = self._readings[-1]
        self._readings.append(now)
        oldest = self._readings[0]  # LATENCY_WINDOW samples before this one
        seconds = max(now.at - before.at, 1e-3)

        def rate(value: float, previous: float) -> float:
            return round(max(0.0, value - previous) / seconds, 3)

        gets = {s: rate(now.chunks.get(s, 0), before.chunks.get(s, 0)) for s in _SOURCES}
        all_gets = sum(gets.values())
        backends = []
        for backend in self.backends:
            mine = now.backends.get(backend.name, {})
            theirs = before.backends.get(backend.name, {})
            entry: dict[str, Any] = {"name": backend.name}
            entry |= {k: rate(mine.get(k, 0), theirs.get(k, 0)) for k in _BACKEND_FIELDS}
            entry["circuit_open"] = backend.circuit_open
            backends.append(entry)
        sample: dict[str, Any] = {
            "seq": self._seq,
            "t": round(time.time(), 3),
            "throughput": {
                "ram": rate(now.chunk_bytes.get("ram", 0), before.chunk_bytes.get("ram", 0)),
                "disk": rate(now.chunk_bytes.get("disk", 0), before.chunk_bytes.get("disk", 0)),
                "peer": rate(now.peer_in, before.peer_in),
                "backend": round(sum(b["bytes"] for b in backends), 3),
            },
            "hits": {"ram": gets["ram"], "disk": gets["disk"], "miss": gets["fetched"]},
            "hit_ratio": {
                tier: (round(gets[tier] / all_gets, 4) if all_gets else None)
                for tier in ("ram", "disk")
            },
            "backend": {
                **{k: round(sum(b[k] for b in backends), 3) for k in _BACKEND_FIELDS},
                "latency_ms": _percentiles(oldest.latency, now.latency),
            },
            "backends": backends,
            "singleflight_waits": rate(now.waits, before.waits),
            "requests": {
                "http": rate(now.http, before.http),
                "local": rate(now.local, before.local),
                "s3": rate(now.s3, before.s3),
            },
            "local_clients": int(_gauge(self.metrics.local_clients)),
            "tiers": self._tiers(),
            "peers": self._peers(now, before, seconds),
            "hot": self.hot.tick(seconds),
            "errors": list(self._errors.kept),
            "errors_total": self._errors.total,
        }
        sample |= self._checkpoints()
        sample |= self._jobs_and_cost()
        self._seq += 1
        self.history.append(sample)
        return sample

    def _read(self) -> _Reading:
        m = self.metrics
        reading = _Reading(at=time.monotonic())
        reading.chunks = _by_label(m.read_chunks, "source")
        reading.chunk_bytes = _by_label(m.read_chunk_bytes, "source")
        reading.peer_in = _by_label(m.peer_bytes, "direction").get("in", 0.0)
        for name, value in _by_label(m.backend_requests, "backend").items():
            reading.backends.setdefault(name, {})["requests"] = value
        for name, value in _by_label(m.backend_errors, "backend").items():
            reading.backends.setdefault(name, {})["errors"] = value
        for name, value in _by_label(m.backend_read_bytes, "backend").items():
            reading.backends.setdefault(name, {})["bytes"] = value
        reading.waits = sum(v for _, v in _totals(m.singleflight_waiters))
        reading.http = sum(v for _, v in _totals(m.http_requests))
        reading.local = sum(v for _, v in _totals(m.local_requests))
        reading.s3 = sum(v for _, v in _totals(m.s3_requests))
        for labels, value in _totals(m.peer_member_bytes):
            reading.members[(labels["peer"], labels["direction"])] = value
        reading.roles = role_reading(m)
        # Requests only: a streamed GET also observes each piece ("stream").
        reading.latency = _buckets(m.backend_seconds, skip_op="stream")
        return reading

    def _tiers(self) -> list[dict[str, Any]]:
        if self.cache.closed:
            return []
        return [
            {
                "name": tier.name,
                "bytes": tier.bytes,
                "budget_bytes": tier.budget_bytes,
                "chunks": tier.chunks,
                "degraded": tier.degraded,
            }
            for tier in self.cache.stats().tiers
        ]

    def _peers(self, now: _Reading, before: _Reading, seconds: float) -> dict[str, Any] | None:
        if self.peers is None:
            return None
        stats = self.peers.stats()
        m = self.metrics
        pushes: dict[str, dict[str, int]] = {}
        for labels, value in _totals(m.replica_pushes):
            outcomes = pushes.setdefault(labels["peer"], dict.fromkeys(PUSH_OUTCOMES, 0))
            outcomes[labels["outcome"]] = outcomes.get(labels["outcome"], 0) + int(value)
        members = []
        for member in stats["members"]:
            address = member["address"]
            flows = {}
            for direction in ("in", "out"):
                moved = now.members.get((address, direction), 0.0)
                moved -= before.members.get((address, direction), 0.0)
                flows[direction] = round(max(0.0, moved) / seconds, 3)
            members.append(
                {
                    "address": address,
                    "healthy": member["healthy"],
                    **flows,
                    **peer_roles(address, now.roles, before.roles, seconds),
                    "pushes": pushes.get(address, dict.fromkeys(PUSH_OUTCOMES, 0)),
                }
            )
        answers = _by_label(m.peer_holder_answers, "answer")
        return {
            "self": stats["self"],
            "healthy": stats["healthy"],
            "members": members,
            "holder_answers": {a: int(answers.get(a, 0)) for a in HOLDER_ANSWERS},
            "holders_tracked": int(_gauge(m.peer_holders_tracked)),
            "replicas": replica_figures(m),
        }

    def _checkpoints(self) -> dict[str, Any]:
        # In flight: a failed save stays in the daemon's jobs for a while, not here.
        jobs = [j for j in self.checkpoints.stats()["jobs"] if j["state"] != "failed"]
        shown = [
            {
                "name": job["name"],
                "rank": job["rank"],
                "world_size": job["world_size"],
                "state": job["state"],
                "durability": job["durability"],
                "logical_bytes": job["logical_bytes"],
                "unique_bytes": job.get("unique_bytes", 0),
                "remote_bytes": job.get("remote_bytes", 0),
                "age_s": job.get("age_s"),
            }
            for job in jobs[:CHECKPOINTS_SHOWN]
        ]
        return {"checkpoints": shown, "checkpoints_total": len(jobs)}

    def _jobs_and_cost(self) -> dict[str, Any]:
        """``jobs``, ``jobs_total`` and ``cost``: the job table's live jobs (the highest
        stall first), then the jobs that ended lately (the last seen first), with their
        bytes by source from the ledger, as totals and per second between its last two
        readings; the ledger's totals and its top jobs."""
        self._read_ledger()
        ledger = self._ledger_view
        table = self._part("jobs", self.jobs.view) if self.jobs is not None else None
        live = [j for j in (table or {}).get("jobs") or () if isinstance(j, dict)]
        ended = [j for j in (table or {}).get("ended") or () if isinstance(j, dict)]
        # live jobs first, then those ended lately (the newest first), each by stall
        ended.sort(key=lambda j: -float(j.get("last_seen") or 0))
        live.sort(key=_by_stall)
        listed = live + ended
        shown = []
        for job in listed[:JOBS_SHOWN]:
            name = job.get("name")
            served = self._served.get(name, {}) if isinstance(name, str) else {}
            rates = self._served_rates.get(name, {}) if isinstance(name, str) else {}
            entry = dict(job)
            entry["uids"] = list(job.get("uids") or ())[:JOB_UIDS_SHOWN]
            entry["worst_ranks"] = list(job.get("worst_ranks") or ())[:JOB_RANKS_SHOWN]
            entry["first_batch"] = _first_batch(job.get("first_batch"))
            entry["served_bytes"] = {s: int(served.get(s, 0)) for s in SERVED_SOURCES}
            entry["throughput"] = {s: rates.get(s, 0.0) for s in SERVED_SOURCES}
            shown.append(entry)
        return {"jobs": shown, "jobs_total": len(listed), "cost": _cost(ledger)}

    async def _warm_ledger(self) -> None:
        """Before a sample that reads the ledger: its jobs' summaries, made a few jobs at
        a time with the loop free between (:func:`warm_ledger`), so that the view the
        sample reads sums only the jobs charged meanwhile."""
        if self.ledger is not None and self._seq >= self._ledger_next:
            await warm_ledger(self.ledger)

    def _read_ledger(self) -> None:
        """Read the ledger's view when it is due: every sample, or every few when the
        view takes longer than :data:`LEDGER_SHARE` of the interval (a ledger of
        thousands of jobs and names), so that it takes that share of the loop at most
        on average; then each job's bytes by source and their rates since the reading
        before. The view is read without the jobs' names (``names=False``): 1024 jobs x 8
        names, 3 ms when few jobs were charged since the reading before, 31 ms when every
        one was (the whole view: 60-90 ms)."""
        if self.ledger is None or self._seq < self._ledger_next:
            return
        started = time.perf_counter()
        # without the names: the totals and the jobs' rows are what a sample shows
        view = self._part("cost", functools.partial(self.ledger.view, names=False))
        took = time.perf_counter() - started
        every = math.ceil(took / (LEDGER_SHARE * self.interval))
        self._ledger_next = self._seq + min(LEDGER_EVERY_MAX, max(1, every))
        at = time.monotonic()
        served: dict[str, dict[str, float]] = {}
        for entry in (view or {}).get("jobs") or ():
            if isinstance(entry, dict) and isinstance(entry.get("job"), str):
                served[entry["job"]] = _served(entry)
        span = max(at - self._ledger_at, 1e-3)
        self._served_rates = {
            name: {
                s: round(max(0.0, now[s] - self._served.get(name, now).get(s, 0.0)) / span, 3)
                for s in SERVED_SOURCES
            }
            for name, now in served.items()
        }
        self._served = served
        self._ledger_at = at
        self._ledger_view = view

    def _part(self, name: str, view: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """``view()``, or None when it fails: the rest of the sample is still worth
        sending; the first failure of each part is logged."""
        try:
            return view()
        except Exception:
            if name not in self._failed:
                self._failed.add(name)
                logging.getLogger("chunkd.gateway.dashboard").exception(
                    "the dashboard's %s figures failed (logged once; the samples go on "
                    "without them)",
                    name,
                )
            return None


def _by_stall(job: dict[str, Any]) -> tuple[float, str]:
    """The highest stall first (a job with none yet last), then by name."""
    stall = job.get("stall")
    key = -float(stall) if isinstance(stall, int | float) else 1.0
    return key, str(job.get("name"))


def _served(entry: dict[str, Any]) -> dict[str, float]:
    """A ledger job's bytes served by source: its own ``served_bytes``, else the sum of
    its names'."""
    own = entry.get("served_bytes")
    if isinstance(own, dict):
        return {s: float(own.get(s) or 0) for s in SERVED_SOURCES}
    total = dict.fromkeys(SERVED_SOURCES, 0.0)
    for name in entry.get("names") or ():
        if isinstance(name, dict) and isinstance(name.get("served_bytes"), dict):
            for s in SERVED_SOURCES:
                total[s] += float(name["served_bytes"].get(s) or 0)
    return total


def _first_batch(first: Any) -> dict[str, Any] | None:
    """A job's slowest first batch with its ``total`` always there: the table's, else
    its phases added up (the views show it, they do not add it up)."""
    if not isinstance(first, dict):
        return None
    total = first.get("total")
    if not isinstance(total, int | float):
        total = sum(float(first.get(p) or 0) for p in FIRST_BATCH_PHASES if p != "total")
    return {**first, "total": total}


def _cost_totals(totals: Any) -> dict[str, Any] | None:
    """The ledger's totals, with the figures the views show made here: ``written_total``
    (bytes written, every kind) and ``backend_requests_total`` (every op)."""
    if not isinstance(totals, dict):
        return None
    written = totals.get("written_bytes")
    requests = totals.get("backend_requests")
    return {
        **totals,
        "written_total": sum(written.values()) if isinstance(written, dict) else 0,
        "backend_requests_total": sum(requests.values()) if isinstance(requests, dict) else 0,
    }


def _cost(view: dict[str, Any] | None) -> dict[str, Any] | None:
    """A sample's ``cost``: the ledger's totals (with :func:`_cost_totals`' sums), its top
    jobs by what they spent (names left out), and the storage figures when the ledger
    has them; None without a ledger."""
    if view is None:
        return None
    jobs = [j for j in view.get("jobs") or () if isinstance(j, dict)]
    jobs.sort(key=lambda j: (-float(j.get("spent") or 0), str(j.get("job"))))
    return {
        "since": view.get("since"),
        "currency": view.get("currency"),
        "totals": _cost_totals(view.get("totals")),
        "jobs": [
            {k: j.get(k) for k in ("job", "label", "spent", "direct", "saved")}
            for j in jobs[:COST_JOBS_SHOWN]
        ],
        "jobs_total": len(jobs),
        "storage": view.get("storage"),
    }


class _Follower:
    """The events of one stream, in order; ``None`` from :meth:`next` ends it."""

    def __init__(self, stream: _Stream) -> None:
        self._stream = stream

    async def next(self) -> Event | None:
        """The next event (wait for it under ``asyncio.timeout``)."""
        return await self._stream.queue.get()


_SOURCES: Final = ("ram", "disk", "fetched")
#: the roles a peer's chunk bytes are counted under (chunkd_peer_role_bytes{role})
ROLES: Final = ("owner", "holder", "replica")
#: an owner's answers to askers (chunkd_peer_holder_answers{answer})
HOLDER_ANSWERS: Final = ("served", "holders", "direct")
#: replica pushes this node made, by outcome (chunkd_replica_pushes{outcome})
PUSH_OUTCOMES: Final = ("ok", "full", "failed")
#: replica pushes other nodes made here, by outcome (chunkd_replica_received{outcome})
RECEIVED_OUTCOMES: Final = ("stored", "full", "invalid", "refused")
#: this node's replicated saves, by outcome (chunkd_replica_saves{outcome})
SAVE_OUTCOMES: Final = ("full", "partial", "none")


def role_reading(metrics: Metrics) -> dict[tuple[str, str, str], float]:
    """``chunkd_peer_role_bytes`` now: the bytes keyed (peer, direction, role)."""
    return {
        (labels["peer"], labels["direction"], labels["role"]): value
        for labels, value in _totals(metrics.peer_role_bytes)
    }


def peer_roles(
    address: str,
    now: dict[tuple[str, str, str], float],
    before: dict[tuple[str, str, str], float],
    seconds: float,
) -> dict[str, dict[str, dict[str, float]]]:
    """One member's chunk bytes by direction and role, from two readings of
    ``chunkd_peer_role_bytes`` keyed (peer, direction, role).

    Returns:
        ``{"roles": {"in": {"owner", "holder", "replica"}, "out": {...}}}`` in bytes per
        second over the time between the readings, and ``"role_bytes"`` of the same
        shape: the bytes since the daemon started. ``in`` is what the member sent this
        node, under the role it played (the chunk's owner, a holder of it, a replica of
        this node's save); ``out`` what this node sent it, under the role this node played.
    """
    rates: dict[str, dict[str, float]] = {}
    totals: dict[str, dict[str, float]] = {}
    for direction in ("in", "out"):
        rates[direction] = {}
        totals[direction] = {}
        for role in ROLES:
            key = (address, direction, role)
            moved = now.get(key, 0.0) - before.get(key, 0.0)
            rates[direction][role] = round(max(0.0, moved) / seconds, 3)
            totals[direction][role] = now.get(key, 0.0)
    return {"roles": rates, "role_bytes": totals}


def replica_figures(metrics: Metrics) -> dict[str, Any]:
    """The replica store's figures from the counters ``/metrics`` exports: the budget
    and the bytes of other nodes' replicas held here (gauges), and since the start, the
    pushes received (by outcome), the pushes this node made (all peers, by outcome) and
    this node's replicated saves (by outcome)."""
    received = _by_label(metrics.replica_received, "outcome")
    pushed = _by_label(metrics.replica_pushes, "outcome")
    saves = _by_label(metrics.replica_saves, "outcome")
    return {
        "budget_bytes": int(_gauge(metrics.replica_budget)),
        "bytes": int(_gauge(metrics.replica_bytes)),
        "received": {o: int(received.get(o, 0)) for o in RECEIVED_OUTCOMES},
        "pushes": {o: int(pushed.get(o, 0)) for o in PUSH_OUTCOMES},
        "saves": {o: int(saves.get(o, 0)) for o in SAVE_OUTCOMES},
    }


_BACKEND_FIELDS: Final = ("requests", "errors", "bytes")


def _offer(stream: _Stream, event: Event | None) -> bool:
    """Queue ``event`` (None: the end); False (and the stream ended) when its queue is
    full: the client stopped reading."""
    queue = stream.queue
    if queue.full():
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(None)  # room now: the stream ends here
        return False
    queue.put_nowait(event)
    return True


def _totals(metric: MetricWrapperBase) -> Iterable[tuple[dict[str, str], float]]:
    """The (labels, value) of each series of a counter."""
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                yield sample.labels, sample.value


def _by_label(metric: MetricWrapperBase, label: str) -> dict[str, float]:
    """A counter's series summed by one label."""
    out: dict[str, float] = {}
    for labels, value in _totals(metric):
        out[labels[label]] = out.get(labels[label], 0.0) + value
    return out


def _gauge(metric: MetricWrapperBase) -> float:
    return sum(s.value for family in metric.collect() for s in family.samples)


def _buckets(metric: MetricWrapperBase, *, skip_op: str) -> list[tuple[float, float]]:
    """A histogram's cumulative bucket counts, summed over its series (but those of op
    ``skip_op``), by bound."""
    counts: dict[float, float] = {}
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels.get("op") != skip_op:
                bound = float(sample.labels["le"])
                counts[bound] = counts.get(bound, 0.0) + sample.value
    return sorted(counts.items())


def _percentiles(
    old: list[tuple[float, float]], new: list[tuple[float, float]]
) -> dict[str, float | None]:
    """p50, p90, p99 in milliseconds of the observations between two bucket readings
    (linear inside a bucket, as Prometheus's histogram_quantile); None without any."""
    before = dict(old)
    window = [(bound, count - before.get(bound, 0.0)) for bound, count in new]
    total = window[-1][1] if window else 0.0
    out: dict[str, float | None] = {}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        if total <= 0:
            out[name] = None
            continue
        rank = q * total
        lower_bound, lower_count = 0.0, 0.0
        value = None
        for bound, count in window:
            if count >= rank:
                if math.isinf(bound):
                    value = lower_bound  # past the last finite bucket: its bound
                else:
                    inside = count - lower_count
                    share = (rank - lower_count) / inside if inside > 0 else 1.0
                    value = lower_bound + (bound - lower_bound) * share
                break
            lower_bound, lower_count = bound, count
        out[name] = None if value is None else round(value * 1000, 3)
    return out
