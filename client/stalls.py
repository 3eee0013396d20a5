"""How long a trainer waits for its data: :class:`StallMeter`.

A meter wraps the iterator a training loop takes its batches from and times each
``next()``:

- a step's **wait** runs from the trainer asking for the next batch to getting it;
- a step's **time** runs from getting the previous batch to getting this one (the
  trainer's compute and the wait); the first step's time is its wait (there was no
  batch before it: the time to the first batch, the iterator's start included).

The stall ratio is Σwait / Σstep. A meter keeps, for the current window, the sums, the
longest wait and the steps counted into the daemon's buckets
(:data:`~chunkd.client.protocol.LOADER_BUCKETS`, and one for the rest), and sends
them to the node's daemon as one ``loader_report`` once at least ``window`` seconds
have passed since the window began (checked as each step ends, so a report goes out
inline, between two steps: a small request, about 100 µs), and once more at the end
of each iteration (an epoch). Never per sample: a rank sends one report a window
whatever its step rate, and at most :data:`~chunkd.client.protocol.MAX_REPORT_STEPS`
steps in one.

**The job's end** (``end=true``) is this rank's last report: the daemon ends a job on
its node when every rank that reported sent it and nothing else came for 60 s (or
when nothing came for ``[jobs] idle``). An epoch's end is not the job's end: the end
of an iteration only sends its window. ``end=true`` is sent by :meth:`StallMeter.close`,
and, for every rank this process reported and did not close, once when the process
exits (an :mod:`atexit` hook: the live meters' last windows, then an empty end report
for each rank whose meters are gone). A process killed (``kill -9``, a crash in C)
sends none: its job ends ``[jobs] idle`` after its last request.

**Nested iterators are measured once**, by the outermost meter: while a meter's
:meth:`~StallMeter.wrap` calls ``iter()``/``next()`` of what it wraps, the loaders
inside (a :class:`~chunkd.client.datasets.Loader`, a Grain ``ChunkdIterDataset``'s
iterator) do not measure (:func:`measured_outside`).

A failing daemon never breaks training: a report that fails is dropped (logged once at
debug level) and no report is tried for :data:`RETRY_AFTER` seconds after; a report
waits at most :data:`REPORT_TIMEOUT` seconds for its answer. The meter reports over a
connection of its own (so it never waits behind the loader's reads).

The job is the ``train_job`` argument, else the client's (``Client(train_job=)``,
itself its argument, else the environment's), else
:func:`~chunkd.client.jobs.job_name`'s (:func:`job_of`). The rank and world size
default to ``$RANK`` and ``$WORLD_SIZE`` (``torchrun`` sets both), else
``$SLURM_PROCID`` and ``$SLURM_NTASKS`` (``srun``), else 0 and 1; a rank known
without a world size makes the world size at least ``rank + 1``.
"""

from __future__ import annotations

import atexit
import bisect
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Final, TypeVar

from chunkd.client.core import Client
from chunkd.client.jobs import job_name
from chunkd.client.protocol import LOADER_BUCKETS, MAX_REPORT_STEPS, MAX_SECONDS, MAX_WORLD_SIZE
from chunkd.errors import ChunkdError

__all__ = [
    "MAX_UNENDED",
    "REPORT_TIMEOUT",
    "REPORT_WINDOW",
    "RETRY_AFTER",
    "StallMeter",
    "in_grain_worker",
    "in_loader_worker",
    "job_of",
    "measured_outside",
]

log = logging.getLogger("chunkd.client")

T = TypeVar("T")

#: seconds between two reports of a meter, unless told
REPORT_WINDOW: Final = 5.0
#: seconds a report waits for the daemon's answer (and for it to come back)
REPORT_TIMEOUT: Final = 2.0
#: seconds without a report after one failed
RETRY_AFTER: Final = 60.0
#: the shortest window a meter takes (a report a window: not per step)
MIN_WINDOW: Final = 0.05
#: ranks (daemon socket, job, rank) a process remembers to end at its exit; past it a
#: rank whose meters are all gone is not ended at exit (its job ends by ``[jobs] idle``)
MAX_UNENDED: Final = 64

#: set while a meter's wrap calls iter()/next() of what it wraps (the trainer's wait is
#: measured there: a loader inside must not count the same steps again)
_MEASURED: ContextVar[bool] = ContextVar("chunkd_measured", default=False)

_Rank = tuple["Path | None", "str | None", int, int]  # socket, job, rank, world size
#: the meters of this process (weakly: a meter gone is not kept alive for its end)
_LIVE: weakref.WeakSet[StallMeter] = weakref.WeakSet()
#: the ranks that reported and sent no end yet, in the order first seen
_UNENDED: dict[_Rank, None] = {}


def measured_outside() -> bool:
    """Whether an outer :class:`StallMeter` is timing the ``iter()``/``next()`` running
    now (a loader inside it then leaves the measuring to it)."""
    return _MEASURED.get()


def job_of(train_job: str | None, client: Any = None) -> str | None:
    """The job a meter or loader accounts to: ``train_job``, else ``client``'s
    ``train_job`` (the job its reads are accounted to), else
    :func:`~chunkd.client.jobs.job_name`'s (the environment's).

    Raises:
        ValueError: ``train_job`` is given and is no job name.
    """
    if train_job is not None:
        return job_name(train_job)
    # a loader may hold a stand-in of a client (a test's): only a str is taken
    known = getattr(client, "train_job", None)
    if isinstance(known, str):
        return known
    return job_name()


def in_loader_worker() -> bool:
    """Whether this is a torch DataLoader's worker process: there, a loader's own
    waits are not the trainer's (the trainer's are measured in the main process, by
    :func:`chunkd.client.torch.measured`)."""
    data = sys.modules.get("torch.utils.data")
    info = getattr(data, "get_worker_info", None)
    return info is not None and info() is not None


def in_grain_worker() -> bool:
    """Whether this is a worker process of Grain's ``mp_prefetch`` (Grain's own test,
    read only where Grain is imported: a process without Grain is none of its
    workers)."""
    workers = sys.modules.get("grain._src.python.dataset.transformations.process_prefetch")
    test = getattr(workers, "is_in_worker_process", None)
    return test is not None and bool(test())


def _first_env(names: tuple[str, str], low: int, high: int) -> int | None:
    """The first of ``names`` set, as a whole number; None: neither is set, or the one
    set is no whole number ``low..high`` (logged, and the next is not tried: the two
    are the same figure from two launchers)."""
    for name in names:
        value = os.environ.get(name)
        if not value:
            continue
        try:
            number = int(value)
        except ValueError:
            number = low - 1
        if low <= number <= high:
            return number
        log.warning(
            "chunkd: $%s=%.40r is not a whole number %d..%d; not taken", name, value, low, high
        )
        return None
    return None


def _ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``rank`` and ``world_size``, each from the environment where None (see the module
    docstring)."""
    given = world_size is not None
    if world_size is None:
        world_size = _first_env(("WORLD_SIZE", "SLURM_NTASKS"), 1, MAX_WORLD_SIZE)
    if rank is None:
        rank = _first_env(("RANK", "SLURM_PROCID"), 0, MAX_WORLD_SIZE - 1) or 0
    if not given:
        # a rank known without its world size (or past the one the environment says) is
        # kept: taken as rank 0 it would be counted as another process's rank
        world_size = max(world_size or 1, rank + 1)
    assert world_size is not None
    if not 1 <= world_size <= MAX_WORLD_SIZE or not 0 <= rank < world_size:
        raise ValueError(
            f"need 0 <= rank < world_size <= {MAX_WORLD_SIZE}; got rank {rank}, "
            f"world_size {world_size}"
        )
    return rank, world_size


class StallMeter:
    """Times a training loop's waits for data and reports them to the node's daemon
    (see the module docstring).

    Use :meth:`wrap` around the iterator the loop takes its batches from::

        meter = StallMeter(train_job="run-7")
        for batch in meter.wrap(loader):
            step(batch)

        meter.close()  # this rank is done with the job (else: at the process's exit)

    or call :meth:`add` with each step's times. :meth:`wrap` may be called again for
    each epoch; an epoch's end sends its window, not the job's end.

    Args:
        client: a client of the daemon to report to: its socket is used (the meter
            opens a connection of its own), and its job where ``train_job`` is None.
            None: the default socket (``$CHUNKD_SOCKET``, ...).
        socket_path: the daemon's socket, where no ``client`` is given.
        train_job: the job; None: ``client``'s, else
            :func:`~chunkd.client.jobs.job_name`'s (:func:`job_of`).
        rank: this trainer's rank; None: ``$RANK``, else ``$SLURM_PROCID``, else 0.
        world_size: the job's ranks; None: ``$WORLD_SIZE``, else ``$SLURM_NTASKS``,
            else 1; and at least ``rank + 1``.
        window: seconds between reports (at least :data:`MIN_WINDOW`).
        clock: the clock steps are timed by (seconds, monotonic).

    Attributes:
        steps, wait, step, wait_max: this window's figures, so far.
        reports: reports the daemon took; failed: reports dropped.
        label: the job's label in ``/metrics``, as the last report's answer gave it.

    Raises:
        ValueError: a bad ``train_job``, ``rank``, ``world_size`` or ``window``.
    """

    def __init__(
        self,
        client: Client | None = None,
        *,
        socket_path: str | os.PathLike[str] | None = None,
        train_job: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        window: float = REPORT_WINDOW,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not MIN_WINDOW <= window <= MAX_SECONDS:
            raise ValueError(f"window is {MIN_WINDOW} to {MAX_SECONDS:g} seconds; got {window!r}")
        rank, world_size = _ranks(rank, world_size)
        self.train_job = job_of(train_job, client)
        # a loader may hold a stand-in of a client (a test's): only a Client's is taken
        known = getattr(client, "socket_path", None)
        self.rank = rank
        self.world_size = world_size
        self.window = float(window)
        self.clock = clock
        self._socket: Path | None = (
            Path(os.fspath(socket_path)) if socket_path is not None else None
        )
        if self._socket is None and isinstance(known, Path):
            self._socket = known
        self._client: Client | None = None
        self._quiet_until = 0.0
        self._warned = False
        self.reports = 0
        self.failed = 0
        self.label: str | None = None
        self._reset(clock())
        _LIVE.add(self)

    def __repr__(self) -> str:
        return (
            f"<chunkd StallMeter job {self.train_job or 'none'}, rank {self.rank}/"
            f"{self.world_size}, {self.steps} steps this window>"
        )

    def _reset(self, now: float) -> None:
        self.started = now
        self.steps = 0
        self.wait = 0.0
        self.step_seconds = 0.0
        self.wait_max = 0.0
        self._wait_buckets = [0] * (len(LOADER_BUCKETS) + 1)
        self._step_buckets = [0] * (len(LOADER_BUCKETS) + 1)

    @property
    def step(self) -> float:
        """Seconds of this window's steps, so far."""
        return self.step_seconds

    def wrap(self, iterable: Iterable[T], *, asked: float | None = None) -> Iterator[T]:
        """``iterable``'s items, each ``next()`` timed. The end of the iteration (its
        end, an exception, or the loop leaving it) sends the window's report and closes
        the meter's connection (:meth:`finish`): an epoch's end is not the job's, see
        :meth:`close`. ``iter(iterable)`` is called on the first ``next()`` and counts
        in the first wait, which runs from ``asked`` (the clock's time the trainer
        began the iteration; None: that first ``next()``). Loaders inside the
        ``iter()``/``next()`` of ``iterable`` do not measure (:func:`measured_outside`):
        their steps are these."""
        clock = self.clock
        last: float | None = None
        try:
            asked = clock() if asked is None else asked
            token = _MEASURED.set(True)
            try:
                items = iter(iterable)
            finally:
                _MEASURED.reset(token)
            while True:
                token = _MEASURED.set(True)
                try:
                    item = next(items)
                except StopIteration:
                    return
                finally:
                    _MEASURED.reset(token)
                got = clock()
                self.add(got - asked, got - (asked if last is None else last), now=got)
                last = got
                yield item
                asked = clock()
        finally:
            self.finish()

    def add(self, wait: float, step: float, *, now: float | None = None) -> None:
        """Count one step: ``wait`` seconds waited for its batch, ``step`` seconds since
        the previous batch (``now``: the clock's time, read if not given); report if the
        window is over."""
        wait = min(max(0.0, wait), MAX_SECONDS)
        step = min(max(wait, step), MAX_SECONDS)
        self.steps += 1
        self.wait += wait
        self.step_seconds += step
        self.wait_max = max(self.wait_max, wait)
        self._wait_buckets[bisect.bisect_left(LOADER_BUCKETS, wait)] += 1
        self._step_buckets[bisect.bisect_left(LOADER_BUCKETS, step)] += 1
        now = self.clock() if now is None else now
        if now - self.started >= self.window or self.steps >= MAX_REPORT_STEPS:
            self.flush(now=now)

    def flush(self, *, end: bool = False, now: float | None = None) -> None:
        """Send this window's report now (nothing without steps, unless ``end``) and
        begin the next window."""
        now = self.clock() if now is None else now
        if self.steps or end:
            self._send(end)
        self._reset(now)

    def finish(self) -> None:
        """The end of an iteration (an epoch): send this window's report (if it has
        steps) and close the meter's connection; the next step begins a new window. Not
        the job's end (:meth:`close`); after the process's exit hook ran, it is."""
        try:
            self.flush(end=_EXITED)
        finally:
            self._disconnect()

    def close(self) -> None:
        """This rank is done with the job: send the last report (``end=true``) and close
        the meter's connection. Once every rank that reported sent its end and nothing
        else came for 60 s, the daemon ends the job on its node (its series leave
        ``/metrics``; a later start is a new start). Called once per rank for the job
        (the process's exit does it for a rank not closed); the meter may be used
        again, and then reports the rank live again."""
        try:
            self.flush(end=True)
        finally:
            self._disconnect()

    def _disconnect(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def _rank(self) -> _Rank:
        return self._socket, self.train_job, self.rank, self.world_size

    def _report(self, end: bool) -> dict[str, object]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "steps": self.steps,
            "wait": min(self.wait, MAX_SECONDS),
            "step": min(self.step_seconds, MAX_SECONDS),
            "wait_max": self.wait_max,
            "wait_buckets": list(self._wait_buckets),
            "step_buckets": list(self._step_buckets),
            "train_job": self.train_job,
            "end": end,
        }

    def _send(self, end: bool) -> None:
        if time.monotonic() < self._quiet_until:
            self.failed += 1
            return
        try:
            client = self._connected()
            with client.request("loader_report", self._report(end), what="a loader report") as r:
                label = r.header.get("train_job")
            self.label = label if isinstance(label, str) else None
            self.reports += 1
            key = self._rank()
            if end:
                _UNENDED.pop(key, None)
            elif key in _UNENDED or len(_UNENDED) < MAX_UNENDED:
                _UNENDED[key] = None
        except (ChunkdError, OSError) as exc:
            # A report is a hint: the training goes on without it.
            self.failed += 1
            self._quiet_until = time.monotonic() + RETRY_AFTER
            dropped, self._client = self._client, None
            if dropped is not None:
                dropped.close()
            if not self._warned:
                self._warned = True
                log.debug("chunkd: a loader report was dropped: %s", exc)

    def _connected(self) -> Client:
        if self._client is None:
            self._client = Client(
                self._socket, timeout=REPORT_TIMEOUT, cache_bytes=0, train_job=self.train_job
            )
        return self._client


#: whether the exit hook ran (a meter's later flush is then its rank's end)
_EXITED = False


@atexit.register
def _end_at_exit() -> None:
    """The process exits: each rank it reported and did not close sends its end, the
    live meters with their last window."""
    global _EXITED
    _EXITED = True
    for meter in list(_LIVE):
        if meter.steps or meter._rank() in _UNENDED:
            try:
                meter.close()
            except Exception:  # an exit never fails on a hint
                log.debug("chunkd: a loader's end report was not sent", exc_info=True)
    gone: set[Path | None] = set()  # daemons that did not take an end: not asked again
    for socket, job, rank, world_size in list(_UNENDED):
        if socket in gone:
            continue
        sent = False
        try:
            meter = StallMeter(socket_path=socket, rank=rank, world_size=world_size)
            meter.train_job = job
            meter.close()
            sent = not meter.failed
        except Exception:  # as above
            log.debug("chunkd: a loader's end report was not sent", exc_info=True)
        if not sent:
            gone.add(socket)
    _UNENDED.clear()


def _forget() -> None:
    # a forked child (a DataLoader's worker) ends no rank of its parent's
    _UNENDED.clear()
    _LIVE.clear()


os.register_at_fork(after_in_child=_forget)
