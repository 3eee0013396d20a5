"""The :class:`Backend` interface: one configured object store, as the daemon sees it.

Modelled on zarr-python v3's ``abc/store.py``: async methods, ``None`` for what is
absent and an exception only for a real failure, capabilities as properties, and byte
ranges as values (:mod:`chunkd.ranges`). Every kind of backend (``s3``,
``gs``, ``az``, ``file``, ``memory``, ``https``) implements it, and every one passes the
same conformance suite, :class:`chunkd.testing.backends.BackendTests`, with the
capabilities it claims (docs/backends.md).

The contract, for each method:

1. :meth:`Backend.head` ``(key)``: the current version's :class:`ObjectMeta`, or
   ``None`` when there is no object ``key``.
2. :meth:`Backend.get` ``(key, byte_range, version=)``: the bytes, or ``None`` when
   there is no object. ``version`` (the meta of a :meth:`head`) pins the read: an
   object that is no longer that version raises :class:`VersionChangedError`. A
   range is resolved against the object's size by :func:`chunkd.ranges.resolve`,
   the one rule for "past the end" (a range that starts at or after the end of a
   non-empty object, or any range of an empty one, is
   :class:`RangeNotSatisfiableError`; one that runs past the end is cut there),
   whatever the store would have said.
3. :meth:`Backend.stream_range` ``(meta, byte_range, piece_bytes=)``: the same bytes
   as a pinned :meth:`get`, in pieces; it raises :class:`ObjectNotFoundError` when the
   object is gone (an iterator has no ``None`` to give).
4. :meth:`Backend.open_first` ``(key, start, end, piece_bytes=, known=)``: a read of
   an object whose version the caller does not know (or knows, and wants confirmed)
   in one request: the object's current :class:`ObjectMeta` and, unless that is
   ``known``'s version, a stream of its bytes from ``start`` (cut at its end).
   ``None`` when there is no object. By default a :meth:`head` and a
   :meth:`stream_range`; a store that answers a GET with the version (every obstore
   kind) does it in one round trip.
5. :meth:`Backend.scan` ``(prefix, start_after=, batch=)``: every object under
   ``prefix`` in key order (UTF-8 bytes, as S3 lists), after ``start_after``, in
   batches of at most ``batch``.
6. :meth:`Backend.put` ``(key, data, if_absent=)`` and :meth:`Backend.delete`
   ``(key)``: only where :attr:`Backend.supports_writes`; a put with ``if_absent``
   returns ``False`` when an object was there already.
7. :meth:`Backend.put_stream` ``(key, pieces, size=)``: an object written from a
   stream of pieces, **never over another**: it returns ``False`` when an object is
   there (before or when the write would finish), and leaves nothing behind when it
   fails (no partial object, no multipart upload, no temporary file). Where
   :attr:`Backend.streams_conditional_put`, it holds a bounded part of the object at
   once (:meth:`Backend.held_by_put`): a multipart upload finished with
   ``If-None-Match: *`` (``s3://``), a temporary file linked into place
   (``file://``). Elsewhere the object is put whole, and one larger than
   :attr:`Backend.single_put_bytes` is refused before anything is read
   (:class:`InvalidRequestError`).

An optional protocol, apart from the interface: :class:`BatchReads`
(``read_batch``), small first reads of many objects in one go where the store is a
local filesystem (a registration's footers). A caller asks ``isinstance(backend,
BatchReads)``; a store without it is read one :meth:`Backend.open_first` an object.

Each request a backend makes goes through :attr:`Backend.requests`
(:meth:`Requests.call`): the registry wraps every backend in a
:class:`~chunkd.gateway.backends.resilience.Resilient`, which sets it to itself and so
retries, counts and breaks the circuit for every kind alike; a kind is its I/O.

Failures are :class:`BackendUnavailableError` (may heal: retried, counted against
the backend's health), :class:`BackendForbiddenError` (the credentials),
:class:`InvalidKeyError` (the request's own key: never retried, never counted against
the backend) and :class:`ReadOnlyBackendError` (a write to a read-only backend).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol, TypeVar, runtime_checkable

from chunkd.errors import (
    IntegrityError,
    InvalidRequestError,
    ObjectNotFoundError,
    ReadOnlyBackendError,
)
from chunkd.ranges import ByteRange

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from chunkd.gateway.backends.meta import ObjectMeta
    from chunkd.gateway.config import BackendConfig
    from chunkd.ranges import RequestRange

__all__ = [
    "SCAN_BATCH",
    "SINGLE_PUT_BYTES",
    "Backend",
    "BatchReads",
    "FirstRead",
    "Requests",
    "gather_stream",
    "stream_size_error",
]

#: objects one listing request asks for (S3's own page size)
SCAN_BATCH: Final = 1000
#: the largest object :meth:`Backend.put_stream` writes where the store cannot finish a
#: streamed write conditionally: it is put whole (held in memory), with ``if_absent``
SINGLE_PUT_BYTES: Final = 64 << 20

T = TypeVar("T")


class Requests(Protocol):
    """What a backend hands each request it makes to (:attr:`Backend.requests`): the
    resilience policy (:class:`~chunkd.gateway.backends.resilience.Resilient`), or,
    for a backend built outside the registry, each request once."""

    async def call(self, op: str, key: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """The result of ``attempt()``, one request ``op`` (``head``, ``get``, ``put``,
        ``delete``, ``list``) about ``key``, which raises chunkd's errors (the kind
        translates its store's own): tried again where the policy says."""
        ...

    def settle(self, error: Exception) -> None:
        """A failure outside :meth:`call` (a body read in pieces, a batch of reads):
        count it, and tell the circuit breaker."""
        ...

    def answered(self) -> None:
        """A request made outside :meth:`call` was answered."""
        ...


class _Once:
    """Each request once, nothing counted: a backend built outside the registry."""

    async def call(self, op: str, key: str, attempt: Callable[[], Awaitable[T]]) -> T:
        return await attempt()

    def settle(self, error: Exception) -> None:
        pass

    def answered(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class FirstRead:
    """What :meth:`Backend.open_first` found: the object's current version, and the
    first bytes of it the caller asked for."""

    meta: ObjectMeta
    #: the bytes ``start`` to ``end`` of ``meta``'s version, in pieces; None when the
    #: version is the one the caller knew (nothing sent), or ``start`` is at or past
    #: the end of the object
    pieces: AsyncIterator[memoryview] | None
    start: int
    #: where the bytes stop: the end asked for, cut at the object's end
    end: int


@runtime_checkable
class BatchReads(Protocol):
    """A backend that reads the first bytes of many objects in one go, cheaper than one
    :meth:`Backend.open_first` each (a local filesystem: one thread hop for a batch of
    files, where each request through the object store client is a hop of its own)."""

    async def read_batch(
        self, asked: Sequence[tuple[str, int, int]]
    ) -> list[tuple[ObjectMeta, bytes | None] | None]:
        """For each ``(key, start, end)`` (``start < end``): the object's current version
        and its bytes ``start`` to ``end`` (cut at its end; None where ``start`` is at or
        past its end), both from one look at the object, as :meth:`Backend.open_first`
        gives them; or None where this object must be read the usual way
        (:meth:`Backend.open_first`: it is absent, not a plain object, named in a way
        only the store itself resolves, or changed while it was read). Counted as one
        GET an object read.

        Raises:
            BackendUnavailableError: the batch did not finish within the backend's
                ``timeout``.
        """
        ...


class Backend(ABC):
    """One configured object store (one ``[[backends]]`` entry).

    Args:
        config: its ``[[backends]]`` entry.
    """

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.name = config.name
        #: where each request of this backend goes (the resilience wrapper sets it)
        self.requests: Requests = _Once()

    # -- capabilities -------------------------------------------------------------------

    @property
    def supports_writes(self) -> bool:
        """Whether :meth:`put` and :meth:`delete` may be called (``writable = true``)."""
        return self.config.writable

    @property
    def supports_conditional_put(self) -> bool:
        """Whether ``put(..., if_absent=True)`` is atomic in the store itself."""
        return True

    @property
    def supports_list(self) -> bool:
        """Whether :meth:`scan` lists the backend."""
        return True

    # -- reads --------------------------------------------------------------------------

    @abstractmethod
    async def head(self, key: str) -> ObjectMeta | None:
        """Size and version of ``key``; ``None`` when there is no such object.

        Raises:
            InvalidKeyError, BackendForbiddenError, BackendUnavailableError
        """

    @abstractmethod
    async def get(
        self,
        key: str,
        byte_range: RequestRange | None = None,
        *,
        version: ObjectMeta | None = None,
    ) -> memoryview | None:
        """The bytes of ``key`` (``byte_range`` of them; all of it for ``None``), or
        ``None`` when there is no such object.

        Args:
            key: the object.
            byte_range: which bytes, resolved by :func:`chunkd.ranges.resolve`.
            version: the version to read (its ``key`` is ``key``); without it, the
                current one.

        Raises:
            VersionChangedError: the object is no longer ``version``.
            RangeNotSatisfiableError: ``byte_range`` selects nothing of the object.
            InvalidKeyError, BackendForbiddenError, BackendUnavailableError
        """

    @abstractmethod
    def stream_range(
        self, meta: ObjectMeta, byte_range: RequestRange | None, *, piece_bytes: int
    ) -> AsyncIterator[memoryview]:
        """``byte_range`` of ``meta``'s version, streamed in pieces of about
        ``piece_bytes``.

        The request is retried like :meth:`get`; a failure while the body streams is
        raised to the caller, who knows what it still needs.

        Raises:
            ObjectNotFoundError, VersionChangedError, RangeNotSatisfiableError,
            BackendForbiddenError, BackendUnavailableError
        """

    async def open_first(
        self,
        key: str,
        start: int,
        end: int,
        *,
        piece_bytes: int,
        known: ObjectMeta | None = None,
    ) -> FirstRead | None:
        """The current version of ``key`` and its bytes ``start`` to ``end``, in one
        request where the store allows; ``None`` when there is no such object.

        ``known``: a version the caller holds; when it is still current, no bytes
        come (``pieces`` is None) and ``meta`` is the backend's confirmation of it.
        The stream is pinned to ``meta``'s version as :meth:`stream_range` is; the
        caller that stops early closes it (``aclose``).

        Raises:
            InvalidKeyError, BackendForbiddenError, BackendUnavailableError
        """
        meta = await self.head(key)
        if meta is None:
            return None
        if (known is not None and known.version == meta.version) or start >= meta.size:
            return FirstRead(meta, None, start, start)
        end = min(end, meta.size)
        pieces = self.stream_range(meta, ByteRange(start, end), piece_bytes=piece_bytes)
        return FirstRead(meta, pieces, start, end)

    @abstractmethod
    def scan(
        self, prefix: str, *, start_after: str | None = None, batch: int = SCAN_BATCH
    ) -> AsyncGenerator[list[ObjectMeta], None]:
        """Every object under ``prefix`` in key order, after ``start_after``, in batches.

        Key order is the UTF-8 byte order of the keys, as S3 lists them, for every
        kind of backend. ``prefix`` counts whole path segments (``a/b`` holds
        ``a/b/x``, neither ``a/bc`` nor ``a/b`` itself); ``""`` is the whole backend.
        Each batch is one request (at most ``batch`` objects); it holds no more than
        one batch in memory, and a caller that stops early stops the listing.

        Raises:
            InvalidKeyError: ``start_after`` is not a key this backend can name.
            BackendForbiddenError, BackendUnavailableError
        """

    # -- writes -------------------------------------------------------------------------

    @abstractmethod
    async def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        """Write ``data`` to ``key``; with ``if_absent``, only where nothing is there yet.

        Returns whether this call wrote the object (``False``: ``if_absent`` found one).

        Raises:
            ReadOnlyBackendError, InvalidKeyError, BackendForbiddenError,
            BackendUnavailableError
        """

    @property
    def streams_conditional_put(self) -> bool:
        """Whether :meth:`put_stream` writes in bounded memory and still never
        overwrites (the store finishes the write only where nothing is there)."""
        return False

    @property
    def single_put_bytes(self) -> int:
        """The largest object :meth:`put_stream` takes when it cannot stream
        conditionally (:data:`SINGLE_PUT_BYTES`); unbounded where it can."""
        return SINGLE_PUT_BYTES

    def held_by_put(self, size: int) -> int:
        """The most bytes :meth:`put_stream` holds at once for an object of ``size``
        bytes (the pieces it is given aside): here, the whole object."""
        return size

    async def put_stream(
        self, key: str, pieces: AsyncIterable[bytes | memoryview], *, size: int
    ) -> bool:
        """Write the ``size`` bytes of ``pieces`` to ``key`` where nothing is there yet:
        an object is never overwritten, whoever wrote it and whenever.

        A piece is read before the next is asked for, and may change after (a cache
        lease): the backend copies what it keeps. A failure (the stream's own error
        included: it is raised as itself) leaves nothing behind. Here (a store that
        cannot finish a streamed write conditionally) the object is gathered and put
        whole with ``if_absent``: one larger than :attr:`single_put_bytes` is refused
        before any piece is read.

        Returns whether this call wrote the object (``False``: one was there; nothing
        was written).

        Raises:
            InvalidRequestError: ``size`` is more than this backend writes without
                overwriting.
            IntegrityError: ``pieces`` did not give ``size`` bytes (nothing written).
            ReadOnlyBackendError, InvalidKeyError, BackendForbiddenError,
            BackendUnavailableError
        """
        self.check_writable()
        if size > self.single_put_bytes:
            raise InvalidRequestError(
                f"cannot write {self.name}/{key} ({size} bytes): backend {self.name!r} "
                "cannot finish a streamed write only where no object is (it would risk "
                f"overwriting one), and puts at most {self.single_put_bytes} bytes whole; "
                "write it to an s3:// or file:// backend"
            )
        data = await gather_stream(pieces, size, f"{self.name}/{key}")
        return await self.put(key, memoryview(data), if_absent=True)

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Delete ``key`` (deleting a missing object is not an error).

        Raises:
            ReadOnlyBackendError, InvalidKeyError, BackendForbiddenError,
            BackendUnavailableError
        """

    def check_writable(self) -> None:
        """Raise :class:`ReadOnlyBackendError` unless the backend takes writes."""
        if not self.supports_writes:
            raise ReadOnlyBackendError(
                f"backend {self.name!r} is read-only; set writable = true in its "
                "[[backends]] entry to save checkpoints there"
            )

    # -- health and lifecycle -----------------------------------------------------------

    @property
    def request_bound(self) -> float:
        """The longest one request can take, its retries and their backoff included
        (here, one attempt: the resilience wrapper says more)."""
        return self.config.timeout

    @property
    def circuit_open(self) -> bool:
        """Whether the backend fails fast right now (its circuit breaker is open)."""
        return False

    def not_found(self, key: str) -> ObjectNotFoundError:
        """The error a caller raises for an absent ``key`` it needed."""
        return ObjectNotFoundError(f"{self.name}/{key} does not exist in backend {self.name!r}")

    async def close(self) -> None:  # noqa: B027 (a backend that holds nothing closes nothing)
        """Release what the backend holds (connections)."""


async def gather_stream(
    pieces: AsyncIterable[bytes | memoryview], size: int, name: str
) -> bytearray:
    """The ``size`` bytes of ``pieces``, whole (at most ``size`` are held: one more is
    an error at once).

    Raises:
        IntegrityError: ``pieces`` gave more or fewer than ``size`` bytes.
    """
    data = bytearray()
    async for piece in pieces:
        if len(data) + memoryview(piece).nbytes > size:
            raise stream_size_error(name, size, len(data) + memoryview(piece).nbytes)
        data += piece
    if len(data) != size:
        raise stream_size_error(name, size, len(data))
    return data


def stream_size_error(name: str, size: int, got: int) -> IntegrityError:
    """The error for a stream meant to write ``size`` bytes to ``name`` that gave ``got``
    (at least, when more)."""
    more = "at least " if got > size else ""
    return IntegrityError(
        f"the write of {name} was to be {size} bytes and its source gave {more}{got}; "
        "nothing was written"
    )
