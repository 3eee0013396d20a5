"""Single flight: one in-flight call per key; everyone else awaits the same result."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["SingleFlight"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SingleFlight(Generic[K, V]):
    """Coalesces concurrent calls by key.

    The first caller for a key starts ``fn`` as a task of its own; callers that
    arrive while it runs await the same task and are counted with ``on_wait``. A
    failure fails every waiter with the same exception; the key is then free, so
    the next caller tries again. A cancelled caller stops waiting, but the call
    goes on for the others.
    """

    def __init__(self, on_wait: Callable[[], None] | None = None) -> None:
        self._running: dict[K, asyncio.Future[V]] = {}
        self._on_wait = on_wait

    async def run(self, key: K, fn: Callable[[], Awaitable[V]]) -> V:
        """``await fn()``, or the result of the call already running for ``key``."""
        task = self._running.get(key)
        if task is not None:
            if self._on_wait is not None:
                self._on_wait()
        else:
            task = self.start(key, fn)
        return await asyncio.shield(task)

    def start(self, key: K, fn: Callable[[], Awaitable[V]]) -> asyncio.Future[V]:
        """Start ``fn()`` as the call for ``key``, which must have none running.

        For a caller that owns what the call returns (a lease, say) while the others
        only learn its outcome through :meth:`join`.
        """
        if key in self._running:
            raise RuntimeError(f"a call for {key!r} is already running")
        task = asyncio.ensure_future(fn())
        self._running[key] = task
        task.add_done_callback(functools.partial(self._done, key))
        return task

    def claim(self, key: K) -> asyncio.Future[V] | None:
        """Register a call for ``key`` that the caller will settle itself.

        Returns a future to resolve (``set_result``/``set_exception``) exactly once,
        or ``None`` when a call for ``key`` is already running. Callers of :meth:`run`
        for the key wait on it meanwhile.
        """
        if key in self._running:
            return None
        future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._running[key] = future
        future.add_done_callback(functools.partial(self._done, key))
        return future

    def join(self, key: K) -> asyncio.Future[V] | None:
        """The call running for ``key``, if any (not counted as a waiter)."""
        return self._running.get(key)

    def _done(self, key: K, task: asyncio.Future[V]) -> None:
        if self._running.get(key) is task:
            del self._running[key]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter re-raises it on its own

    def running(self) -> list[asyncio.Future[V]]:
        """The calls running now."""
        return list(self._running.values())

    def __len__(self) -> int:
        return len(self._running)

    def __contains__(self, key: object) -> bool:
        return key in self._running
