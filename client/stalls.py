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
of the iteration, with ``end=true``. Never per sample: a rank sends one report a
window whatever its step rate, and at most
:data:`~chunkd.client.protocol.MAX_REPORT_STEPS` steps in one.

A failing daemon never breaks training: a report that fails is dropped (logged once at
debug level) and no report is tried for :data:`RETRY_AFTER` seconds after; a report
waits at most :data:`REPORT_TIMEOUT` seconds for its answer. The meter reports over a
connection of its own (so it never waits behind the loader's reads).

The job is :func:`~chunkd.client.jobs.job_name`'s (the ``train_job`` argument, else
the environment's); the rank and world size default to ``$RANK`` and
``$WORLD_SIZE`` (``torchrun`` sets both), else 0 and 1.
"""

from __future__ import annotations

import bisect
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Final, TypeVar

from chunkd.client.core import Client
from chunkd.client.jobs import job_name
from chunkd.client.protocol import LOADER_BUCKETS, MAX_REPORT_STEPS, MAX_SECONDS, MAX_WORLD_SIZE
from chunkd.errors import ChunkdError

__all__ = ["REPORT_TIMEOUT", "REPORT_WINDOW", "RETRY_AFTER", "StallMeter", "in_loader_worker"]

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


def in_loader_worker() -> bool:
    """Whether this is a torch DataLoader's worker process: there, a loader's own
    waits are not the trainer's (the trainer's are measured in the main process, by
    :func:`chunkd.client.torch.measured`)."""
    data = sys.modules.get("torch.utils.data")
    info = getattr(data, "get_worker_info", None)
    return info is not None and info() is not None


def _whole_env(name: str, default: int, low: int, high: int) -> int:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        number = low - 1
    if not low <= number <= high:
        log.warning(
            "chunkd: $%s=%.40r is not a whole number %d..%d; taken as %d",
            *(name, value, low, high, default),
        )
        return default
    return number


class StallMeter:
    """Times a training loop's waits for data and reports them to the node's daemon
    (see the module docstring).

    Use :meth:`wrap` around the iterator the loop takes its batches from::

        meter = StallMeter(train_job="run-7")
        for batch in meter.wrap(loader):
            step(batch)

    or call :meth:`add` with each step's times and :meth:`close` at the end.

    Args:
        client: a client of the daemon to report to: its socket is used (the meter
            opens a connection of its own), and its job where ``train_job`` is None and
            the environment names none. None: the default socket
            (``$CHUNKD_SOCKET``, ...).
        socket_path: the daemon's socket, where no ``client`` is given.
        train_job: the job (:func:`~chunkd.client.jobs.job_name`).
        rank: this trainer's rank; None: ``$RANK``, else 0.
        world_size: the job's ranks; None: ``$WORLD_SIZE``, else 1.
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
        if world_size is None:
            world_size = _whole_env("WORLD_SIZE", 1, 1, MAX_WORLD_SIZE)
        if rank is None:
            rank = _whole_env("RANK", 0, 0, MAX_WORLD_SIZE - 1)
            rank = rank if rank < world_size else 0
        if not 1 <= world_size <= MAX_WORLD_SIZE or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size <= {MAX_WORLD_SIZE}; got rank {rank}, "
                f"world_size {world_size}"
            )
        self.train_job = job_name(train_job)
        # a loader may hold a stand-in of a client (a test's): only a Client's are taken
        known = getattr(client, "train_job", None), getattr(client, "socket_path", None)
        if self.train_job is None and isinstance(known[0], str):
            self.train_job = known[0]
        self.rank = rank
        self.world_size = world_size
        self.window = float(window)
        self.clock = clock
        self._socket: Path | None = (
            Path(os.fspath(socket_path)) if socket_path is not None else None
        )
        if self._socket is None and isinstance(known[1], Path):
            self._socket = known[1]
        self._client: Client | None = None
        self._quiet_until = 0.0
        self._warned = False
        self.reports = 0
        self.failed = 0
        self.label: str | None = None
        self._reset(clock())

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
        """``iterable``'s items, each ``next()`` timed; the end of the iteration (its
        end, an exception, or the loop leaving it) sends the last report, ``end=true``.
        ``iter(iterable)`` is called on the first ``next()`` and counts in the first
        wait, which runs from ``asked`` (the clock's time the trainer began the
        iteration; None: that first ``next()``)."""
        clock = self.clock
        last: float | None = None
        try:
            asked = clock() if asked is None else asked
            items = iter(iterable)
            while True:
                try:
                    item = next(items)
                except StopIteration:
                    return
                got = clock()
                self.add(got - asked, got - (asked if last is None else last), now=got)
                last = got
                yield item
                asked = clock()
        finally:
            self.close()

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

    def close(self) -> None:
        """Send the last report (``end=true``) and close the meter's connection. The
        meter may be used again (a next epoch): a new window begins."""
        try:
            self.flush(end=True)
        finally:
            client, self._client = self._client, None
            if client is not None:
                client.close()

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
