"""Prefetch: objects loaded into the cache ahead of a job, a bounded number at a time.

A client names objects (the local socket's ``prefetch``, or ``chunkd warm``); each
one is loaded whole through the read path (single flight, spans, peers). However
many names arrive, at most ``in_flight`` objects load at once for all clients
together, and at most ``per_client`` for one client; the other names wait in that
client's queue, which holds at most ``queue_limit`` names, and all queues together
at most ``total_queued``. So 10,000 names start ``per_client`` loads and a queue,
never 10,000 fetches, and one client's long list does not hold up the names of
another for long: slots are taken in turn.

A client is a user of the node (the uid its connection comes from), not a
connection: a queue outlives the connection that filled it (the loads it asked for
were accepted), so bounds per connection would grow without end as connections
come and go.

Each name is loaded for the request that queued it: its
:class:`~chunkd.gateway.costs.attribution.Attribution` is queued with it and set around
its load, so its backend requests are charged to that request's job and name, whichever
request's worker loads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Hashable
from typing import TYPE_CHECKING, Final

from chunkd.client.protocol import MAX_PREFETCH_QUEUED
from chunkd.errors import ChunkdError, InvalidRequestError
from chunkd.gateway.costs.attribution import ATTRIBUTION, Attribution
from chunkd.gateway.names import split_name

if TYPE_CHECKING:
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.readpath import ReadPath

__all__ = ["Prefetcher", "Wanted"]

log = logging.getLogger("chunkd.gateway.prefetch")

#: the default bound on one client's waiting names (the protocol's)
QUEUE_LIMIT: Final = MAX_PREFETCH_QUEUED
#: the bound on the waiting names of all clients together
TOTAL_QUEUED: Final = 1_000_000


#: what a client asks to have loaded: a whole object, or a byte range of one
Wanted = str | tuple[str, int, int]


class _Queue:
    def __init__(self) -> None:
        # each name with the attribution of the request that queued it
        self.names: deque[tuple[Wanted, Attribution]] = deque()
        self.workers: set[asyncio.Task[None]] = set()


class Prefetcher:
    """Loads named objects in the background, within bounds. See the module docstring.

    Args:
        read_path: how objects are loaded.
        metrics: where loads, slots in use and waiting names are shown.
        in_flight: objects loaded at once, all clients together.
        per_client: objects loaded at once for one client.
        queue_limit: names one client may have waiting.
        total_queued: names all clients together may have waiting.
    """

    def __init__(
        self,
        read_path: ReadPath,
        metrics: Metrics,
        *,
        in_flight: int,
        per_client: int,
        queue_limit: int = QUEUE_LIMIT,
        total_queued: int = TOTAL_QUEUED,
    ) -> None:
        self.read_path = read_path
        self.metrics = metrics
        self.in_flight = max(1, in_flight)
        self.per_client = max(1, per_client)
        self.queue_limit = queue_limit
        self.total_queued = total_queued
        self._slots = asyncio.Semaphore(self.in_flight)
        self._busy = 0
        self._peak = 0
        self._queues: dict[Hashable, _Queue] = {}
        self._waiting = 0

    def submit(self, client: Hashable, names: list[Wanted]) -> int:
        """Queue ``names`` for ``client``; returns how many were taken (all of them).

        A name is ``BACKEND/KEY`` (the whole object) or ``(BACKEND/KEY, OFFSET,
        LENGTH)``: the chunks that hold that range (what a data loader reads next).

        Raises:
            InvalidRequestError: the client would have more than ``queue_limit``
                names waiting, or all clients more than ``total_queued`` (nothing is
                queued).
        """
        queue = self._queues.get(client)
        waiting = len(queue.names) if queue is not None else 0
        if waiting + len(names) > self.queue_limit:
            raise InvalidRequestError(
                f"prefetch: {waiting} names of this client wait already, and at most "
                f"{self.queue_limit} may; ask for the rest once these are in"
            )
        if self._waiting + len(names) > self.total_queued:
            raise InvalidRequestError(
                f"prefetch: {self._waiting} names wait already on this node, and at most "
                f"{self.total_queued} may; ask for the rest once these are in"
            )
        if queue is None:
            queue = self._queues[client] = _Queue()
        at = ATTRIBUTION.get()
        queue.names.extend((name, at) for name in names)
        self._waiting += len(names)
        self.metrics.prefetch_queued.set(self._waiting)
        while queue.names and len(queue.workers) < self.per_client:
            task = asyncio.create_task(self._work(client, queue))
            queue.workers.add(task)
            task.add_done_callback(queue.workers.discard)
        return len(names)

    async def _work(self, client: Hashable, queue: _Queue) -> None:
        try:
            while queue.names:
                name, at = queue.names.popleft()
                self._waiting -= 1
                self.metrics.prefetch_queued.set(self._waiting)
                # Charged to the request that queued it, not to the one whose request
                # started this worker (another connection's, maybe another job's).
                token = ATTRIBUTION.set(at)
                try:
                    if isinstance(name, str):
                        async with self.slot():
                            await self.read_path.warm(*split_name(name))
                    else:
                        async with self.slot():
                            await self.read_path.warm(*split_name(name[0]), name[1], name[2])
                except ChunkdError as exc:  # counted; told at debug: a list may hold many
                    self.metrics.prefetch_objects.labels("failed").inc()
                    log.debug("prefetch of %s failed: %s", name, exc)
                except Exception:
                    self.metrics.prefetch_objects.labels("failed").inc()
                    log.exception("prefetch of %s failed", name)
                else:
                    self.metrics.prefetch_objects.labels("loaded").inc()
                finally:
                    ATTRIBUTION.reset(token)
        finally:
            queue.workers.discard(asyncio.current_task())
            if not queue.names and not queue.workers and self._queues.get(client) is queue:
                del self._queues[client]

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of the ``in_flight`` slots (``chunkd warm`` takes one per object)."""
        async with self._slots:
            self._busy += 1
            self._peak = max(self._peak, self._busy)
            self.metrics.prefetch_in_flight.set(self._busy)
            self.metrics.prefetch_in_flight_max.set(self._peak)
            try:
                yield
            finally:
                self._busy -= 1
                self.metrics.prefetch_in_flight.set(self._busy)

    @property
    def waiting(self) -> int:
        """Names waiting for a slot, all clients together."""
        return self._waiting

    async def close(self) -> None:
        """Stop every load; waiting names are dropped."""
        tasks = [t for q in self._queues.values() for t in q.workers]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._queues.clear()
        self._waiting = 0
        self.metrics.prefetch_queued.set(0)
