"""Exponential backoff: the one definition of "wait a little longer each time".

Every retry or poll loop in chunkd (backend requests, the checkpoint writer's waits
for parts, commits and barriers, the client's reconnect) takes its delays from a
:class:`Backoff`. The delay before attempt ``n`` (0-based) is ``base * factor**n``,
at most ``cap``, then jittered:

- ``"full"``: uniform in ``[0, delay]`` (AWS's "full jitter": retries of many callers
  spread out instead of arriving together);
- ``"equal"``: uniform in ``[delay / 2, delay]`` (spread, but never a tight loop);
- ``"none"``: exactly ``delay`` (a poll whose interval should read as configured).

It is a value: sync and async loops use the same object, and a loop keeps its own
attempt count (``delays()`` does that for it).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

__all__ = ["Backoff", "Jitter"]

Jitter = Literal["full", "equal", "none"]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays that grow by ``factor`` from ``base`` up to ``cap`` seconds, jittered."""

    #: the first delay, in seconds
    base: float
    #: the longest delay, in seconds
    cap: float
    #: how a delay is spread; see the module's docstring
    jitter: Jitter = "full"
    #: each delay is this many times the one before (until ``cap``)
    factor: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.base <= self.cap or self.factor < 1:
            raise ValueError(
                f"Backoff(base={self.base}, cap={self.cap}, factor={self.factor}): "
                "needs 0 <= base <= cap and factor >= 1"
            )

    def ceiling(self, attempt: int) -> float:
        """The delay before ``attempt`` (0-based) before jitter: the most it can be."""
        if attempt <= 0:
            return self.base
        # min() before the power would overflow for a long-running poll's count
        grown = self.base * self.factor ** min(attempt, 64)
        return min(self.cap, grown)

    def delay(self, attempt: int) -> float:
        """The delay before ``attempt`` (0-based), jittered."""
        ceiling = self.ceiling(attempt)
        if self.jitter == "full":
            return random.uniform(0, ceiling)
        if self.jitter == "equal":
            return random.uniform(ceiling / 2, ceiling)
        return ceiling

    def delays(self, *, deadline: float | None = None) -> Iterator[float]:
        """Delays for attempt 0, 1, 2, ...; with ``deadline`` (``time.monotonic()``),
        each is cut to the time left, and the iterator ends once none is left."""
        attempt = 0
        while True:
            wait = self.delay(attempt)
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                wait = min(wait, left)
            yield wait
            attempt += 1

    def total(self, attempts: int) -> float:
        """The longest that ``attempts`` delays can add up to (their ceilings)."""
        return sum(self.ceiling(n) for n in range(attempts))
