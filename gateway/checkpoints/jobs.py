"""The save jobs a daemon knows, the background work it runs for them, and the one
bounded fan-out every step of the store uses."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, Final, TypeVar

from chunkd import faults
from chunkd.backoff import Backoff
from chunkd.errors import BackendUnavailableError
from chunkd.gateway.checkpoints.model import Durability, SaveJob

__all__ = ["RETRY", "Jobs", "backend_fault", "each", "polling", "retrying"]

log = logging.getLogger(__name__)

T = TypeVar("T")
A = TypeVar("A")

#: backend requests one fan-out sends at once
_READS_AT_ONCE: Final = 16
#: the pauses between two tries of a step whose backend is down: 0.25-0.5 s at first,
#: 15-30 s at most (spread, so that the jobs of a node do not retry together)
RETRY: Final = Backoff(base=0.5, cap=30.0, jitter="equal")
#: the first pause of a poll
_FIRST_POLL: Final = 0.05
#: how long a finished job is remembered (its waiters have had their answer), and how
#: many at most: a node saving fast forgets the oldest first
_FINISHED_KEPT: Final = 3600.0
_FINISHED_MOST: Final = 4096


class Jobs:
    """The jobs of this daemon by id, and the tasks that run their steps (or remove a
    collection's barrier): :meth:`close` stops them all."""

    def __init__(self) -> None:
        self._jobs: dict[str, SaveJob] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def __iter__(self) -> Iterator[SaveJob]:
        return iter(list(self._jobs.values()))

    def get(self, job_id: str) -> SaveJob | None:
        """The job ``job_id``, if this daemon knows it."""
        return self._jobs.get(job_id)

    def add(self, job: SaveJob) -> None:
        """Know ``job`` by its id."""
        self._jobs[job.id] = job

    def spawn(self, work: Awaitable[Any]) -> asyncio.Future[Any]:
        """Run ``work`` in the background until it ends or :meth:`close`."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def prune(self) -> None:
        """Forget finished jobs after an hour, and all but the newest
        ``_FINISHED_MOST`` (their waiters have had their answer); keep only what the
        answer needs of the others."""
        old = time.time() - _FINISHED_KEPT
        finished = []
        for job in list(self._jobs.values()):
            if job.finished is None:
                continue
            if job.finished < old:
                del self._jobs[job.id]
                continue
            job.forget_parts()
            finished.append(job)
        if len(finished) > _FINISHED_MOST:
            finished.sort(key=lambda j: j.finished or 0.0)
            for job in finished[: len(finished) - _FINISHED_MOST]:
                del self._jobs[job.id]

    async def close(self) -> None:
        """Stop every task and give up every job's staged bytes."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for job in self._jobs.values():
            job.release_data()


async def each(items: Iterable[A], fn: Callable[[A], Awaitable[T]]) -> list[T]:
    """``[await fn(i) for i in items]``, a few at a time; the first failure stops the rest
    and is raised as itself."""
    slots = asyncio.Semaphore(_READS_AT_ONCE)

    async def one(item: A) -> T:
        async with slots:
            return await fn(item)

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(item)) for item in items]
    except BaseExceptionGroup as failed:
        # The first failure as itself: a caller (and a client answered by the error's
        # class and message) sees ObjectNotFoundError, not an ExceptionGroup.
        first: BaseException = failed
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return [task.result() for task in tasks]


def polling(interval: float) -> Backoff:
    """The pauses of a poll for what another rank or another process writes (a part,
    a manifest, a barrier gone): 50 ms, twice as long each time, up to ``interval``;
    exact, so that a poll's interval reads as configured."""
    return Backoff(base=min(_FIRST_POLL, interval), cap=interval, jitter="none")


async def retrying(job: SaveJob | None, step: Callable[[], Awaitable[T]]) -> T:
    """``step()``, waiting out a backend that is down (forever: nothing is dropped),
    with :data:`RETRY`'s pauses."""
    pauses = RETRY.delays()
    while True:
        try:
            return await step()
        except BackendUnavailableError as exc:
            if job is not None:
                job.state = f"waiting for the backend: {exc}"
                if job.level >= Durability.LOCAL and job.data is not None:
                    # On disk: no memory held while waiting. Off the loop: the last
                    # unmap of a big memfd took 0.33-0.48 s a GiB (see Saver._release).
                    await asyncio.to_thread(job.release_data)
            pause = next(pauses)
            log.info("checkpoint step failed (%s); retrying in %.1fs", exc, pause)
            await asyncio.sleep(pause)


def backend_fault(point: str) -> None:
    """Fault point ``point`` before a backend request. An injected I/O error is what
    a failed request raises (:class:`BackendUnavailableError`), so it is waited out
    like one."""
    faults.point(point, lambda _code, message: BackendUnavailableError(message))
