"""Worker admission with stall detection: blocking file I/O that a stalled disk cannot
pile up behind.

A thread blocked in ``read(2)`` or ``write(2)`` on a device that stopped answering
cannot be cancelled. :class:`Admission` runs such operations on a fixed number of
worker threads and keeps the event loop's callers from waiting on them forever:

* Admission: an operation runs only on a free worker; one that finds none waits
  for one on the loop, never in the executor's queue, so a stalled disk holds at
  most ``workers`` threads and nothing piles up behind them.
* Detection: the disk is *stalled* while an operation has been outstanding for
  ``stall_after`` seconds and none has completed for as long (:meth:`Admission.stalled`).
  A slow disk that still completes operations is not stalled; one that completes
  none is, within ``stall_after``.
* While stalled, :meth:`Admission.run` gives up at once, without a worker, and every
  caller waiting for a worker or an operation stops waiting; a caller may also stop
  waiting for its own operation after ``patience`` seconds, stalled or not.
* An operation nobody waits for any more goes on in its thread and keeps its worker
  until it returns; what it returns late is dropped (an exception is logged).
* Recovery needs no probe: the stall ends as soon as a stuck operation completes.

The disk tier (:mod:`chunkd.cache.disk`) is its user, and says what a give-up means
for a read and a write there.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar

from chunkd.errors import CacheClosedError

__all__ = ["GAVE_UP", "STALL_AFTER", "Admission", "GaveUp"]

log = logging.getLogger("chunkd.cache.disk")

T = TypeVar("T")

#: seconds an operation may be outstanding, with none completing, before the disk
#: counts as stalled; also the longest a get waits for its own operation. Half a
#: second: a healthy disk reads a chunk in milliseconds, and a reader that gives up
#: still has time to fetch from the source within its second.
STALL_AFTER: Final = 0.5
#: how often a caller waiting on the disk looks again whether it has stalled
_STALL_CHECK: Final = 0.05


class GaveUp:
    """What :meth:`Admission.run` returns when the caller stopped waiting."""


#: the one :class:`GaveUp` value
GAVE_UP: Final = GaveUp()


class Admission:
    """A bounded set of worker threads, admitted on the loop, with stall detection.

    Args:
        workers: threads, and the most operations outstanding at once.
        what: how log lines name the disk (``"disk tier at /var/cache/chunkd"``).
        count: called with ``"stall"`` once per stall and ``"gave_up"`` once per
            operation a caller stopped waiting for (the user's error counters).
        stall_after: see the module docstring.
        thread_name_prefix: the worker threads' names.
    """

    def __init__(
        self,
        workers: int,
        *,
        what: str,
        count: Callable[[str], None],
        stall_after: float = STALL_AFTER,
        thread_name_prefix: str = "chunkd-disk",
    ) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=thread_name_prefix)
        self._what = what
        self._count = count
        self.stall_after = stall_after
        # One slot per worker, freed when the thread is done, not when its caller
        # stops waiting; callers queue here, in order (used on the loop only).
        self._free_workers = workers
        self._worker_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._ops_lock = threading.Lock()
        self._running: dict[int, float] = {}  # operation -> when it started (monotonic)
        self._last_done = time.monotonic()
        self._stalled_since: float | None = None
        self._op_serial = itertools.count()

    def stalled(self) -> str | None:
        """Why the disk counts as stalled now (see the module docstring), or ``None``."""
        with self._ops_lock:
            now = time.monotonic()
            oldest = min(self._running.values(), default=now)
            stuck = now - oldest >= self.stall_after and now - self._last_done >= self.stall_after
            if not stuck:
                if self._stalled_since is not None:
                    log.warning(
                        "%s: the disk answers again after a %.1f s stall",
                        self._what,
                        now - self._stalled_since,
                    )
                    self._stalled_since = None
                return None
            outstanding = len(self._running)
            first = self._stalled_since is None
            if first:
                self._stalled_since = now
        if first:
            self._count("stall")
            log.warning(
                "%s stalled: %d operations outstanding, none done for %.1f s; "
                "reads go to the source and writes are declined until it answers",
                self._what,
                outstanding,
                now - oldest,
            )
        return (
            f"disk stalled: {outstanding} operations outstanding for more than "
            f"{self.stall_after:g} s, none completing"
        )

    async def run(self, fn: Callable[..., T], *args: object, patience: float | None) -> T | GaveUp:
        """``fn(*args)`` on a worker, or :data:`GAVE_UP` when the caller stopped waiting:
        the disk stalled, or ``fn`` ran for ``patience`` seconds (``None``: no limit).

        The operation itself is never abandoned: it holds its worker until it returns.
        """
        if self.stalled() is not None:
            self._count("gave_up")
            return GAVE_UP
        if not await self._admit():
            self._count("gave_up")
            return GAVE_UP
        loop = asyncio.get_running_loop()
        op = next(self._op_serial)
        with self._ops_lock:
            self._running[op] = time.monotonic()
        try:
            future = loop.run_in_executor(self._pool, self._tracked, op, fn, args)
        except BaseException:
            self._finished(op)
            self._free_worker()
            raise
        future.add_done_callback(lambda _: self._free_worker())
        deadline = None if patience is None else loop.time() + patience
        taken = False
        try:
            while True:
                done, _ = await asyncio.wait({future}, timeout=_STALL_CHECK)
                if done:
                    taken = True
                    return future.result()
                if self.stalled() is not None or (deadline is not None and loop.time() >= deadline):
                    self._count("gave_up")
                    return GAVE_UP
        finally:
            if not taken:  # cancelled or given up: nobody will take the late result
                future.add_done_callback(_discard_late_result)

    def shutdown(self) -> None:
        """Wait for every worker's operation to return and stop the threads (blocking)."""
        self._pool.shutdown(wait=True)

    async def _admit(self) -> bool:
        """Take a free worker, waiting for one in order; ``False`` if the disk stalls first."""
        if self._free_workers > 0 and not self._worker_waiters:
            self._free_workers -= 1
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._worker_waiters.append(waiter)
        handed = False
        try:
            while True:
                await asyncio.wait({waiter}, timeout=_STALL_CHECK)
                if waiter.done():
                    handed = True
                    return True
                if self.stalled() is not None:
                    return False
        finally:
            if not handed:
                if waiter.done() and not waiter.cancelled():
                    self._free_worker()  # handed a worker just as this caller left
                else:
                    waiter.cancel()
                    with contextlib.suppress(ValueError):
                        self._worker_waiters.remove(waiter)

    def _free_worker(self) -> None:
        """A worker's thread is done: hand it to the first caller still waiting."""
        while self._worker_waiters:
            waiter = self._worker_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free_workers += 1

    def _tracked(self, op: int, fn: Callable[..., T], args: tuple[object, ...]) -> T:
        try:
            return fn(*args)
        finally:
            self._finished(op)

    def _finished(self, op: int) -> None:
        with self._ops_lock:
            self._running.pop(op, None)
            self._last_done = time.monotonic()


def _discard_late_result(future: asyncio.Future[Any]) -> None:
    """Retrieve what an operation nobody waits for returned (a late read's bytes are
    dropped; an exception is logged, not left unretrieved)."""
    if future.cancelled():
        return
    exc = future.exception()
    if exc is not None and not isinstance(exc, CacheClosedError):
        log.warning("a disk operation given up on failed late: %r", exc)
