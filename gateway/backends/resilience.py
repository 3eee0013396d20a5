"""Resilience around any backend: retries, backoff and the circuit breaker (:class:`Resilient`).

:func:`~chunkd.gateway.backends.registry.make_backend` wraps every backend it builds
in a :class:`Resilient`, a :class:`~chunkd.gateway.backends.base.Backend` that holds
the backend of a kind (its I/O) and answers for it. A kind only does its I/O: it
hands each request it makes to its :attr:`Backend.requests
<chunkd.gateway.backends.base.Backend.requests>` (:meth:`Resilient.call`), which the
wrapper sets to itself, so the policy applies to every request, a sub-request of one
call included (the HEAD after a failed ``If-Match``, each batch of a listing, each part
of a streamed write), exactly once. The rules, the same for every kind:

* **Attempts.** A request is tried at most ``retries + 1`` times (the backend's
  ``retries`` key), with delays from :data:`RETRY_BACKOFF` (full jitter) between;
  each attempt is counted (``chunkd_backend_requests_total``, and its time in
  ``chunkd_backend_request_seconds``). Only a failure that may heal
  (:class:`BackendUnavailableError`: 5xx, timeouts, refused connections) is tried
  again; every other error is the backend's answer, given at once.
* **A conditional put is retried as a conditional put** (``if_absent``, a streamed
  write's finish with ``If-None-Match: *``): a retry never overwrites, and one that
  finds the object its lost first attempt wrote answers ``False``, as for any object
  that is there (callers of a conditional put check what is there:
  :func:`chunkd.gateway.chunkstore.put_chunk`).
* **The circuit breaker.** After :data:`BREAK_AFTER` failures in a row the backend
  fails fast for :data:`COOL_DOWN` seconds (``chunkd_backend_circuit_open`` is 1), then
  lets one request through to probe: its success closes the circuit, its failure opens
  it again. A request fails fast, without a retry, while the circuit is open.
* **What counts against the circuit.** A :class:`BackendUnavailableError` only. Any
  other error (no such object, no such bucket, a refusal, a changed version, a range
  past the end) is the backend's answer: it is up, and the failures in a row start
  again. "No such object" is counted in ``chunkd_backend_not_found_total``, every other
  error in ``chunkd_backend_errors_total{kind}``.
* **A request's own bad key is never counted** for or against the backend
  (:class:`InvalidKeyError`, counted in ``chunkd_backend_rejected_keys_total``):
  no client can open a circuit by asking for names a backend refuses. A probe that
  ends so is over, and the circuit is as it was.
* **Streams.** Opening a stream (a ranged GET of :meth:`Backend.stream_range`, the GET
  of :meth:`Backend.open_first`) is a request like any other; a failure while its body
  streams is settled here (:meth:`Resilient.settle`: counted, and told to the circuit
  breaker) and raised to the caller, who knows what it still needs. Each batch of a
  listing is a request (a stream broken off is opened again after the last key it gave).

The log lines: ``backend NAME: OP KEY failed (ERROR); retry N of M in Ss`` (info), and
the circuit's ``N failures in a row; circuit open for Ss`` (warning) and ``answering
again; circuit closed`` (info).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Final, TypeVar

from chunkd.backoff import Backoff
from chunkd.errors import BackendUnavailableError, InvalidKeyError, ObjectNotFoundError
from chunkd.gateway.backends.base import SCAN_BATCH, Backend, BatchReads
from chunkd.gateway.costs import charge

if TYPE_CHECKING:
    from collections.abc import Sequence

    from chunkd.gateway.backends.base import FirstRead
    from chunkd.gateway.backends.meta import ObjectMeta
    from chunkd.gateway.metrics import Metrics
    from chunkd.ranges import RequestRange

__all__ = ["BREAK_AFTER", "COOL_DOWN", "RETRY_BACKOFF", "Resilient"]

log = logging.getLogger("chunkd.gateway.backends")

T = TypeVar("T")

#: consecutive failures that open the circuit
BREAK_AFTER: Final = 5
#: seconds an open circuit fails fast
COOL_DOWN: Final = 5.0
#: the delays between a request's attempts
RETRY_BACKOFF: Final = Backoff(base=0.05, cap=2.0, jitter="full")


class Resilient(Backend):
    """``inner`` with retries, backoff and a circuit breaker around each of its requests.

    Build one with :meth:`around` (which keeps the optional protocols ``inner`` has,
    such as :class:`~chunkd.gateway.backends.base.BatchReads`).

    Args:
        inner: the backend of a kind (its I/O).
        metrics: where attempts, errors and the circuit's state are counted.
    """

    def __init__(self, inner: Backend, metrics: Metrics) -> None:
        super().__init__(inner.config)
        self.inner = inner
        self._metrics = metrics
        self._failures = 0
        self._open_until = 0.0
        self._probing = False
        inner.requests = self

    @classmethod
    def around(cls, inner: Backend, metrics: Metrics) -> Resilient:
        """``inner`` wrapped, as a class that has the optional protocols ``inner`` has."""
        if isinstance(inner, BatchReads):
            return _ResilientBatchReads(inner, metrics)
        return cls(inner, metrics)

    # -- the policy, for each request of the inner backend --------------------------

    async def call(self, op: str, key: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt()`` (one request ``op`` of ``key``, which raises chunkd's errors)
        with retries and the circuit breaker; the rules are in the module's docstring."""
        retries = max(0, self.config.retries)
        for n in range(retries + 1):
            self._check_circuit(key)
            started = time.perf_counter()
            self._metrics.backend_requests.labels(self.name, op).inc()
            charge.backend_request(self.name, op)
            try:
                result = await attempt()
            except asyncio.CancelledError:
                self._probing = False  # a cancelled probe must not hold the circuit shut
                raise
            except Exception as error:
                self.settle(error)
                if not isinstance(error, BackendUnavailableError):
                    raise
                if n == retries or self.circuit_open:
                    raise
                delay = RETRY_BACKOFF.delay(n)
                log.info(
                    "backend %s: %s %s failed (%s); retry %d of %d in %.2fs",
                    self.name,
                    op,
                    key,
                    error,
                    n + 1,
                    retries,
                    delay,
                )
                await asyncio.sleep(delay)
                continue
            finally:
                self._metrics.backend_seconds.labels(self.name, op).observe(
                    time.perf_counter() - started
                )
            self._succeeded()
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    def settle(self, error: Exception) -> None:
        """Count a request's error and tell the circuit breaker, one way for every
        path (a request, and a body read in pieces).

        A key the store cannot hold is the request's own (said at once, neither a
        failure nor a success: a probe is over, the circuit unchanged). A failure that
        may heal (:class:`BackendUnavailableError`) counts towards opening the circuit.
        Any other error is the backend's answer (no such object, no such bucket, a
        refusal, a changed version): it is up.
        """
        if isinstance(error, InvalidKeyError):
            self._probing = False
            self._metrics.rejected_keys.labels(self.name).inc()
            return
        self._count_error(error)
        if isinstance(error, BackendUnavailableError):
            self._failed()
        else:
            self._succeeded()

    def answered(self) -> None:
        """A request made without :meth:`call` (a batch of reads) was answered."""
        if self._failures:
            self._succeeded()

    def _count_error(self, error: Exception) -> None:
        """Count a request's outcome other than success. "No such object" is the
        backend's answer to a question the caller asked (a HEAD or a GET that the
        interface answers with ``None``, a stream whose object is gone): counted in
        ``chunkd_backend_not_found_total``, never as a backend error. Every other error
        is one (``chunkd_backend_errors_total``)."""
        if isinstance(error, ObjectNotFoundError):
            self._metrics.backend_not_found.labels(self.name).inc()
            return
        self._metrics.backend_errors.labels(self.name, type(error).__name__).inc()

    def _check_circuit(self, key: str) -> None:
        now = time.monotonic()
        if now < self._open_until:
            raise BackendUnavailableError(
                f"backend {self.name!r} is failing; chunkd stopped asking it for "
                f"{self._open_until - now:.1f}s more (reading {key}); cached data is still served"
            )
        if self._failures >= BREAK_AFTER:
            if self._probing:  # one probe at a time once the cool-down is over
                raise BackendUnavailableError(
                    f"backend {self.name!r} is failing; a probe request is in flight"
                )
            self._probing = True

    def _failed(self) -> None:
        self._failures += 1
        self._probing = False
        if self._failures >= BREAK_AFTER:
            if not self.circuit_open:
                log.warning(
                    "backend %s: %d failures in a row; circuit open for %.0fs",
                    self.name,
                    self._failures,
                    COOL_DOWN,
                )
            self._open_until = time.monotonic() + COOL_DOWN
            self._metrics.backend_circuit_open.labels(self.name).set(1)

    def _succeeded(self) -> None:
        if self._failures >= BREAK_AFTER:
            log.info("backend %s: answering again; circuit closed", self.name)
        self._failures = 0
        self._probing = False
        self._open_until = 0.0
        self._metrics.backend_circuit_open.labels(self.name).set(0)

    # -- health -----------------------------------------------------------------------

    @property
    def request_bound(self) -> float:
        # docstring inherited: every attempt, and the longest delays between them
        retries = max(0, self.config.retries)
        return self.config.timeout * (retries + 1) + RETRY_BACKOFF.cap * retries

    @property
    def circuit_open(self) -> bool:
        # docstring inherited
        return time.monotonic() < self._open_until

    # -- the interface, answered by the inner backend ----------------------------------
    # (each of its requests comes back through call() above)

    @property
    def supports_writes(self) -> bool:
        # docstring inherited
        return self.inner.supports_writes

    @property
    def supports_conditional_put(self) -> bool:
        # docstring inherited
        return self.inner.supports_conditional_put

    @property
    def supports_list(self) -> bool:
        # docstring inherited
        return self.inner.supports_list

    @property
    def streams_conditional_put(self) -> bool:
        # docstring inherited
        return self.inner.streams_conditional_put

    @property
    def single_put_bytes(self) -> int:
        # docstring inherited
        return self.inner.single_put_bytes

    def held_by_put(self, size: int) -> int:
        # docstring inherited
        return self.inner.held_by_put(size)

    def check_writable(self) -> None:
        # docstring inherited
        self.inner.check_writable()

    async def head(self, key: str) -> ObjectMeta | None:
        # docstring inherited
        return await self.inner.head(key)

    async def get(
        self,
        key: str,
        byte_range: RequestRange | None = None,
        *,
        version: ObjectMeta | None = None,
    ) -> memoryview | None:
        # docstring inherited
        return await self.inner.get(key, byte_range, version=version)

    def stream_range(
        self, meta: ObjectMeta, byte_range: RequestRange | None, *, piece_bytes: int
    ) -> AsyncIterator[memoryview]:
        # docstring inherited
        return self.inner.stream_range(meta, byte_range, piece_bytes=piece_bytes)

    async def open_first(
        self,
        key: str,
        start: int,
        end: int,
        *,
        piece_bytes: int,
        known: ObjectMeta | None = None,
    ) -> FirstRead | None:
        # docstring inherited
        return await self.inner.open_first(key, start, end, piece_bytes=piece_bytes, known=known)

    def scan(
        self, prefix: str, *, start_after: str | None = None, batch: int = SCAN_BATCH
    ) -> AsyncGenerator[list[ObjectMeta], None]:
        # docstring inherited
        return self.inner.scan(prefix, start_after=start_after, batch=batch)

    async def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        # docstring inherited
        return await self.inner.put(key, data, if_absent=if_absent)

    async def put_stream(
        self, key: str, pieces: AsyncIterable[bytes | memoryview], *, size: int
    ) -> bool:
        # docstring inherited
        return await self.inner.put_stream(key, pieces, size=size)

    async def delete(self, key: str) -> None:
        # docstring inherited
        await self.inner.delete(key)

    async def close(self) -> None:
        # docstring inherited
        await self.inner.close()


class _ResilientBatchReads(Resilient):
    """A :class:`Resilient` around a backend that reads batches (:class:`BatchReads`):
    a class of its own, so that the protocol's ``isinstance`` (asked once a class)
    tells the two apart."""

    async def read_batch(
        self, asked: Sequence[tuple[str, int, int]]
    ) -> list[tuple[ObjectMeta, bytes | None] | None]:
        # docstring inherited (BatchReads): the inner backend settles its own outcome
        inner = self.inner
        assert isinstance(inner, BatchReads)
        return await inner.read_batch(asked)
