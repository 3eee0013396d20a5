"""Batched commits off the hot path: a thread that commits what writers queued.

Writers put their writes into an overlay (the owner's: readers consult it first,
read-your-writes) and call :meth:`BatchCommitter.enqueued`. A background thread takes
the overlay as one batch and commits it every ``interval`` seconds, or at once after
``ops`` writes. A caller may also commit now (:meth:`BatchCommitter.flush`), or build
a batch of its own and commit it at once (:meth:`BatchCommitter.commit_with`: a
delete that must be durable before the caller goes on).

One commit runs at a time. A commit that fails puts its batch back (the owner's
``settle``), under the writes queued since, which are newer and win: nothing is
lost, and the next round tries again. The index (:mod:`chunkd.cache.index`) is its
user: it owns the overlay, what a batch holds and how it is written; this module owns
when, on which thread, and what a failure does to the counters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["BatchCommitter"]

B = TypeVar("B")


class BatchCommitter(Generic[B]):
    """Commits batches of an owner's overlay on a thread of its own.

    Args:
        lock: the owner's overlay lock; ``take``, ``settle`` and the ``prepare`` of
            :meth:`commit_with` run with it held, and so must :meth:`enqueued`.
        take: takes the overlay's pending writes as one batch (the owner keeps it
            visible to readers until ``settle``).
        write: commits a batch (blocking; runs without the lock); returns whether it
            wrote anything (an empty batch is no commit).
        settle: after ``write``, with whether it succeeded: a failed batch goes back
            under the pending writes; returns how many writes it put back.
        interval: most seconds a queued write waits for its commit.
        ops: queued writes that trigger a commit at once.
        retry_on: the exceptions of ``write`` the thread waits out (one ``interval``)
            and tries again on; any other stops nothing either, but is raised to the
            caller of :meth:`flush`.
        name: the thread's name.
    """

    def __init__(
        self,
        lock: threading.Lock,
        *,
        take: Callable[[], B],
        write: Callable[[B], bool],
        settle: Callable[[B, bool], int],
        interval: float,
        ops: int,
        retry_on: tuple[type[BaseException], ...] = (),
        name: str = "chunkd-commit",
    ) -> None:
        self._lock = lock
        self._take = take
        self._write = write
        self._settle = settle
        self._interval = interval
        self._ops = ops
        self._retry_on = retry_on
        self._pending_ops = 0
        self._stopped = threading.Event()
        self._started: float | None = None
        #: one commit (one write transaction) at a time
        self.write_lock = threading.Lock()
        #: batches committed (empty ones aside)
        self.commits = 0
        #: commits that failed (their batches were put back)
        self.commit_errors = 0
        self._wake = threading.Condition(lock)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def enqueued(self) -> None:
        """Count one queued write (call with the lock held): the ``ops``-th wakes the thread."""
        self._pending_ops += 1
        if self._pending_ops >= self._ops:
            self._wake.notify()

    def flush(self) -> None:
        """Commit every queued write now (nothing once :meth:`stop` was called)."""
        with self.write_lock:
            with self._lock:
                if self._stopped.is_set():
                    return
                batch = self._taken(self._take())
            self._commit(batch)

    def commit_with(self, prepare: Callable[[], B]) -> None:
        """Commit now the batch ``prepare`` returns, run with the lock held (it may queue
        writes of its own first, then take the overlay)."""
        with self.write_lock:
            with self._lock:
                batch = self._taken(prepare())
            self._commit(batch)

    @property
    def running_for(self) -> float:
        """Seconds the commit in progress has run (0 when none is)."""
        started = self._started
        return 0.0 if started is None else time.monotonic() - started

    def wake(self) -> None:
        """Wake the thread (call with the lock held)."""
        self._wake.notify_all()

    def stop(self) -> None:
        """Stop the thread (call with the lock held; :meth:`join` after releasing it)."""
        self._stopped.set()
        self._wake.notify_all()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the stopped thread to end."""
        self._thread.join(timeout=timeout)

    def _taken(self, batch: B) -> B:
        # called with the lock held
        self._pending_ops = 0
        return batch

    def _commit(self, batch: B) -> None:
        # called with write_lock held
        committed = False
        self._started = time.monotonic()
        try:
            if self._write(batch):
                self.commits += 1
            committed = True
        finally:
            self._started = None
            with self._lock:
                if not committed:
                    self.commit_errors += 1
                # before the batch leaves the owner's in-flight list: readers must see it
                self._pending_ops += self._settle(batch, committed)

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._stopped.is_set():
                    return
                if self._pending_ops < self._ops:
                    self._wake.wait(self._interval)
                idle = self._pending_ops == 0
            if self._stopped.is_set():
                return
            if not idle:
                try:
                    self.flush()
                except self._retry_on:  # pragma: no cover - retried on the next round
                    time.sleep(self._interval)
