"""What every obstore-backed :class:`Backend` shares: its I/O, and its store's errors.

:class:`StoreBackend` implements the :class:`~chunkd.gateway.backends.base.Backend`
interface over an obstore store; each kind (``s3.py``, ``gcs.py``, ``azure.py``,
``file.py``, ``memory.py``, ``http.py``) only says how its store is built and what
its store refuses. Each request is handed to the backend's
:attr:`~chunkd.gateway.backends.base.Backend.requests`: the resilience wrapper
(:mod:`chunkd.gateway.backends.resilience`: retries, backoff, the circuit breaker),
which the registry puts around every backend. obstore's own retries are off, so
every attempt is visible in the metrics.

Errors are mapped once, here: a missing object is ``None`` (or
:class:`ObjectNotFoundError` from a stream: an answer, counted in
``chunkd_backend_not_found_total`` and never as a backend error), a refusal
:class:`BackendForbiddenError`, a failed ``If-Match`` :class:`VersionChangedError`, a
key the store cannot hold :class:`InvalidKeyError`, and everything that may heal (5xx,
timeouts, refused connections, an open circuit) :class:`BackendUnavailableError`. A
key the store cannot hold is the request's own fault: it is neither retried nor
counted for or against the backend's health (it is counted in
``chunkd_backend_rejected_keys_total``), so no client can open a circuit by asking
for names a backend refuses.

One job, over ~600 lines: the obstore I/O every obstore kind shares (a pinned ranged
read, a first read, a streamed body, a listing without folder markers, a conditional
put) and the translation of obstore's errors into chunkd's, which each of those reads
needs; the retries and the circuit breaker are the wrapper's
(:mod:`chunkd.gateway.backends.resilience`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Final, TypeVar

import obstore
from obstore.exceptions import (
    AlreadyExistsError,
    GenericError,
    InvalidPathError,
    NotFoundError,
    NotModifiedError,
    NotSupportedError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)

from chunkd.errors import (
    BackendForbiddenError,
    BackendUnavailableError,
    BucketNotFoundError,
    IntegrityError,
    InvalidKeyError,
    ObjectNotFoundError,
    UnversionedObjectError,
    VersionChangedError,
)
from chunkd.gateway.backends.base import SCAN_BATCH, Backend, FirstRead
from chunkd.gateway.backends.meta import ObjectMeta
from chunkd.gateway.costs import charge
from chunkd.ranges import resolve

if TYPE_CHECKING:
    from obstore import GetOptions
    from obstore.store import ClientConfig, RetryConfig

    from chunkd.gateway.config import BackendConfig
    from chunkd.gateway.metrics import Metrics
    from chunkd.ranges import RequestRange

__all__ = [
    "StoreBackend",
    "client_options",
    "cloud_store",
    "first_line",
    "no_retries",
    "shown",
]

T = TypeVar("T")

_BODY_DEADLINE: Final = 3600.0  # seconds one response may take in all, a span GET included
_OBJECT_OPS: Final = frozenset({"head", "get", "put", "delete"})
# A version read again when it changed between a ranged get's HEAD and its GET.
_UNPINNED_TRIES: Final = 2
_MARKER_HEADS: Final = 16  # HEADs at once that tell a folder marker from an empty object
# How each store says a range starts at or past the end of the object (an empty one
# included): S3 and GCS answer 416 (as the status line reads: a bare "416" also
# matches a port, a key or a timing in obstore's text); obstore says so itself for
# Azure and for its local and in-memory stores.
_PAST_THE_END: Final = (
    "416 Range Not Satisfiable",
    "Requested range was invalid",
    "Invalid range",
    "Wanted range starting at",
)


#: obstore's text for a server that answered a ranged GET with the whole object
_RANGE_IGNORED: Final = "Range request not supported"
#: ... and its S3 client's (its own GET, not the shared one)
_NOT_PARTIAL: Final = "Received non-partial response when range requested"


def past_the_end(exc: Exception) -> bool:
    """Whether ``exc``, a store's refusal of a GET, says its range starts at or past the end."""
    return any(sign in str(exc) for sign in _PAST_THE_END)


class StoreBackend(Backend):
    """A :class:`Backend` over an obstore store (each request through :attr:`requests`).

    Args:
        config: its ``[[backends]]`` entry.
        metrics: where requests, bytes, errors and latencies are counted.
        store: the obstore store (built by :meth:`make_store` when not given).
    """

    #: whether reads are bounded per read of a body (reqwest's ``read_timeout``, over
    #: HTTP) rather than as a whole (local and in-memory stores have no such timeout)
    bounded_per_read: ClassVar[bool] = True

    def __init__(self, config: BackendConfig, metrics: Metrics, store: Any = None) -> None:
        super().__init__(config)
        self._metrics = metrics
        self._store = store if store is not None else self.make_store(config)

    @classmethod
    def make_store(cls, config: BackendConfig) -> Any:
        """The obstore store for ``config``."""
        raise NotImplementedError(f"{cls.__name__} is given its store")

    # -- reads --------------------------------------------------------------------------

    async def head(self, key: str) -> ObjectMeta | None:
        # docstring inherited
        async def call() -> ObjectMeta:
            meta = await self._store_head(key)
            return self._meta_of(key, meta)

        try:
            return await self._call("head", key, call)
        except ObjectNotFoundError:
            return None

    async def get(
        self,
        key: str,
        byte_range: RequestRange | None = None,
        *,
        version: ObjectMeta | None = None,
    ) -> memoryview | None:
        # docstring inherited
        if version is not None:
            return await self._get_pinned(version, byte_range)
        if byte_range is None:
            return await self._get_whole(key)
        # A range needs the size (one rule for "past the end", not each store's own):
        # the current version's, then that version's bytes.
        for attempt in range(_UNPINNED_TRIES):
            meta = await self.head(key)
            if meta is None:
                return None
            try:
                return await self._get_pinned(meta, byte_range)
            except VersionChangedError:
                if attempt + 1 == _UNPINNED_TRIES:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _get_whole(self, key: str) -> memoryview | None:
        async def call() -> memoryview:
            async with asyncio.timeout(self.config.timeout):
                result = await self._store_get(key, {})
            data = memoryview(await result.bytes_async())  # each read: read_timeout
            self._metrics.backend_read_bytes.labels(self.name).inc(data.nbytes)
            charge.backend_bytes(self.name, "read", data.nbytes)
            return data

        try:
            return await self._call("get", key, call, whole=not self.bounded_per_read)
        except ObjectNotFoundError:
            return None

    async def _get_pinned(
        self, meta: ObjectMeta, byte_range: RequestRange | None
    ) -> memoryview | None:
        start, end = resolve(byte_range, meta.size)
        if start == end:
            return memoryview(b"")

        async def call() -> memoryview:
            async with asyncio.timeout(self.config.timeout):
                result = await self._open(meta, start, end)
            data = await self._body(result, meta.key, end - start)  # each read: read_timeout
            self._metrics.backend_read_bytes.labels(self.name).inc(data.nbytes)
            charge.backend_bytes(self.name, "read", data.nbytes)
            return data

        try:
            return await self._call("get", meta.key, call, whole=not self.bounded_per_read)
        except ObjectNotFoundError:
            return None
        except VersionChangedError as exc:
            await self._raise_if_gone(meta, exc)
            return None

    async def _raise_if_gone(self, meta: ObjectMeta, changed: VersionChangedError) -> None:
        """After a failed If-Match: return if ``meta``'s object is gone, else re-raise.

        Some stores (Azure) answer 412 rather than 404 when the object a condition
        names was deleted; a deleted object is absent, not changed. One HEAD, on this
        error path only.
        """
        if await self.head(meta.key) is not None:
            raise changed

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
        options: GetOptions = {"range": (start, end)}
        if known is not None and known.etag is not None:
            options["if_none_match"] = known.etag
        elif known is not None:
            return await super().open_first(key, start, end, piece_bytes=piece_bytes, known=known)

        async def call() -> Any:
            # Both refusals are answers, not failures: nothing to retry or count.
            try:
                async with asyncio.timeout(self.config.timeout):  # the answer's head
                    return await self._store_get(key, options)
            except NotModifiedError:
                return known
            except GenericError as exc:
                if past_the_end(exc):
                    return None
                raise
            except NotSupportedError as exc:
                # A server that answers a Range with the whole object (an HTTP server
                # does, for an empty file): said by the HEAD below.
                if _RANGE_IGNORED in str(exc):
                    return _RANGE_IGNORED
                raise

        try:
            result = await self._call("get", key, call, whole=not self.bounded_per_read)
        except ObjectNotFoundError:
            return None
        if isinstance(result, ObjectMeta):
            return FirstRead(result, None, start, start)  # not modified
        if result is None or result is _RANGE_IGNORED:
            # past the end (or an empty object): the version, from a HEAD
            meta = await self.head(key)
            if meta is None:
                return None
            if result is _RANGE_IGNORED and start < meta.size:
                raise IntegrityError(
                    f"backend {self.name!r} answered a read of bytes {start} to {end} of "
                    f"{shown(key)} with the whole object: its server does not serve byte "
                    "ranges, which chunkd needs to read it"
                )
            return FirstRead(meta, None, start, start)
        meta = self._meta_of(key, result.meta)
        first, stop = result.range
        if first != start or not start < stop <= end:
            raise self._off_range(key, start, end, (first, stop))
        return FirstRead(meta, self._pieces(result, key, first, stop, piece_bytes), first, stop)

    async def stream_range(
        self, meta: ObjectMeta, byte_range: RequestRange | None, *, piece_bytes: int
    ) -> AsyncIterator[memoryview]:
        # docstring inherited
        start, end = resolve(byte_range, meta.size)
        if start == end:
            return
        try:
            result = await self._call("get", meta.key, lambda: self._open(meta, start, end))
        except VersionChangedError as exc:
            await self._raise_if_gone(meta, exc)
            raise self.not_found(meta.key) from exc
        async for view in self._pieces(result, meta.key, start, end, piece_bytes):
            yield view

    async def _pieces(
        self, result: Any, key: str, start: int, end: int, piece_bytes: int
    ) -> AsyncIterator[memoryview]:
        """The body of an opened GET of bytes ``start`` to ``end``, in pieces: each
        read bounded, each counted, and the whole checked to be all there."""
        pieces = result.stream(min_chunk_size=piece_bytes)
        got = 0
        while True:
            started = time.perf_counter()
            try:
                # A stalled body is cut by read_timeout (the backend timeout), not by
                # a bound on the whole piece, which many spans sharing a link make slow.
                if self.bounded_per_read:
                    piece = await anext(pieces, None)
                else:
                    async with asyncio.timeout(self.config.timeout):
                        piece = await anext(pieces, None)
            except Exception as exc:
                error = self._translate(exc, key)
                self.requests.settle(error)
                raise error from exc
            finally:
                self._metrics.backend_seconds.labels(self.name, "stream").observe(
                    time.perf_counter() - started
                )
            if piece is None:
                break
            view = memoryview(piece)
            got += view.nbytes
            if got > end - start:
                # Not one byte past what was asked: a server that sends more (a huge
                # body for a small range) is cut off here, its excess never held.
                error = self._overlong(key, start, end)
                _discard(result)
                self.requests.settle(error)
                raise error
            self._metrics.backend_read_bytes.labels(self.name).inc(view.nbytes)
            charge.backend_bytes(self.name, "read", view.nbytes)
            yield view
        if got != end - start:
            raise BackendUnavailableError(
                f"backend {self.name!r} sent {got} bytes of {key} for a {end - start}-byte range"
            )

    async def _open(self, meta: ObjectMeta, start: int, end: int) -> Any:
        """A ranged GET pinned to ``meta``'s version: ``If-Match`` where it has an ETag,
        and the answer's own version checked in every case (a server that ignores
        ``If-Match`` would otherwise hand over another version's bytes), as is the
        range it answers (the body itself is read no further than asked: :meth:`_body`,
        :meth:`_pieces`)."""
        options: GetOptions = {"range": (start, end)}
        if meta.etag is not None:
            options["if_match"] = meta.etag
        result = await self._store_get(meta.key, options)
        try:
            self._check_answer(meta, result, start, end)
        except Exception:
            _discard(result)
            raise
        return result

    def _check_answer(self, meta: ObjectMeta, result: Any, start: int, end: int) -> None:
        """Refuse an answer of another version than ``meta``'s, or of another range."""
        if self._meta_of(meta.key, result.meta).version != meta.version:
            raise VersionChangedError(
                f"{self.name}/{meta.key} changed while it was read; read it again"
            )
        if tuple(result.range) != (start, end):
            raise self._off_range(meta.key, start, end, tuple(result.range))

    async def _body(self, result: Any, key: str, size: int) -> memoryview:
        """The body of an opened ranged GET of ``size`` bytes, never read past ``size``.

        Read as a stream in pieces of at least ``size`` bytes: an honest answer is one
        piece, used as it is (no copy); a body longer than asked is refused
        (:class:`IntegrityError`) after at most one network read past ``size``, never
        held whole; a short one may heal (:class:`BackendUnavailableError`, retried).
        """
        pieces = result.stream(min_chunk_size=size)
        held: list[memoryview] = []
        got = 0
        async for piece in pieces:
            view = memoryview(piece)
            got += view.nbytes
            if got > size:
                _discard(result)
                raise self._overlong(key, 0, size)
            held.append(view)
        if got != size:
            raise BackendUnavailableError(
                f"backend {self.name!r} returned {got} bytes of {key} for a "
                f"{size}-byte range; the read will be retried"
            )
        return held[0] if len(held) == 1 else memoryview(b"".join(held))

    def _overlong(self, key: str, start: int, end: int) -> IntegrityError:
        return IntegrityError(
            f"backend {self.name!r} sent more than the {end - start} bytes asked for of "
            f"{shown(key)} (bytes {start} to {end}); chunkd stopped reading its answer"
        )

    def _off_range(
        self, key: str, start: int, end: int, answered: tuple[int, ...]
    ) -> IntegrityError:
        return IntegrityError(
            f"backend {self.name!r} answered a read of bytes {start} to {end} of "
            f"{shown(key)} with bytes {answered[0]} to {answered[-1]}"
        )

    async def _store_head(self, key: str) -> Any:
        """One HEAD of ``key``: obstore's metadata of it (a kind not read through
        obstore answers the same shape)."""
        return await obstore.head_async(self._store, key)

    async def _store_get(self, key: str, options: GetOptions) -> Any:
        """One GET of ``key``: obstore's ``GetResult`` (``meta``, ``range``,
        ``bytes_async()``, ``stream(min_chunk_size=)``), or its errors."""
        return await obstore.get_async(self._store, key, options=options)

    async def scan(
        self, prefix: str, *, start_after: str | None = None, batch: int = SCAN_BATCH
    ) -> AsyncGenerator[list[ObjectMeta], None]:
        # docstring inherited
        # One stream for the whole listing: a store without a native offset (Azure,
        # in object_store) lists from the start again whenever one is given. Each
        # batch is retried and counted like any other request; a stream broken off is
        # opened again after the last key it gave.
        top = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        last = start_after
        stream: Any = None

        async def next_batch() -> list[Any]:
            nonlocal stream
            if stream is None:
                stream = self._list_stream(prefix, last, batch)
            try:
                got = await anext(stream, None)
            except BaseException:
                stream = None  # broken: opened again after the last key it gave
                raise
            return list(got) if got is not None else []

        while True:
            raw = await self._call("list", prefix or "/", next_batch)
            metas = [self._meta_of(m["path"], m) for m in raw]
            # obstore drops a trailing "/" of an offset, and names a marker "a/b/" as
            # "a/b": what is not after the token, or not below the prefix, goes.
            got = [
                m
                for m in metas
                if (start_after is None or m.key > start_after) and m.key.startswith(top)
            ]
            if any(m.size == 0 for m in got):
                got = await self._without_markers(got)
            if got:
                yield got
            if metas:
                last = metas[-1].key
            if len(raw) < batch:
                return

    async def _without_markers(self, metas: list[ObjectMeta]) -> list[ObjectMeta]:
        """``metas`` without folder markers.

        A folder marker is a zero-byte object named ``a/b/`` (S3 consoles and many tools
        make them). obstore lists it as ``a/b``, a key no object has: a listing would show
        a file that a GET cannot find, and pyarrow would try to read it as one. So each
        zero-byte entry is asked for with a HEAD (at most :data:`_MARKER_HEADS` at once),
        and one that is not there goes. Zero-byte objects are few in data; each costs
        one HEAD per listing that meets it.
        """
        empty = [m for m in metas if m.size == 0]
        limit = asyncio.Semaphore(_MARKER_HEADS)

        async def there(meta: ObjectMeta) -> bool:
            async with limit:
                return await self.head(meta.key) is not None

        found = await asyncio.gather(*(there(m) for m in empty))
        gone = {m.key for m, present in zip(empty, found, strict=True) if not present}
        return [m for m in metas if m.key not in gone] if gone else metas

    def _list_stream(self, prefix: str, after: str | None, batch: int) -> Any:
        try:
            return obstore.list(self._store, prefix or None, offset=after, chunk_size=batch)
        except ValueError as exc:  # obstore cannot parse the offset as a path
            raise InvalidKeyError(
                f"backend {self.name!r} cannot start a listing after {shown(after or '')}: "
                f"it is not a key it can hold ({first_line(exc)})"
            ) from None

    # -- writes -------------------------------------------------------------------------

    async def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        # docstring inherited
        self.check_writable()

        async def call() -> bool:
            try:
                await obstore.put_async(
                    self._store, key, data, mode="create" if if_absent else "overwrite"
                )
            except (AlreadyExistsError, PreconditionError):
                if if_absent:
                    return False
                raise
            self._metrics.backend_write_bytes.labels(self.name).inc(memoryview(data).nbytes)
            charge.backend_bytes(self.name, "write", memoryview(data).nbytes)
            return True

        return await self._call("put", key, call)

    async def delete(self, key: str) -> None:
        # docstring inherited
        self.check_writable()

        async def call() -> None:
            try:
                await obstore.delete_async(self._store, key)
            except (NotFoundError, FileNotFoundError):
                return

        await self._call("delete", key, call)

    # -- requests -------------------------------------------------------------------

    async def _call(
        self, op: str, key: str, attempt: Callable[[], Awaitable[T]], *, whole: bool = True
    ) -> T:
        """``attempt()``, one request to the store, handed to :attr:`requests` (the
        resilience wrapper: retries and the circuit breaker) with its errors translated.

        A key the store cannot hold is refused before the request is made (counted in
        ``chunkd_backend_rejected_keys_total``, never against the backend).

        ``whole``: the timeout bounds the whole attempt. Reads over HTTP pass False
        and bound the wait for the response themselves: their bodies are bounded per
        read (``read_timeout``), so a slow but steady transfer shared by many
        requests is not cut off and fetched again. Writes, HEADs and listings stay
        bounded as a whole.
        """
        if op in _OBJECT_OPS and (refused := self._refuse_long_name(key)) is not None:
            self._metrics.rejected_keys.labels(self.name).inc()
            raise refused

        async def translated() -> T:
            try:
                # A timeout in this task, not wait_for's task of its own per attempt.
                if whole:
                    async with asyncio.timeout(self.config.timeout):
                        return await attempt()
                return await attempt()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                raise self._translate(exc, key, op) from exc

        return await self.requests.call(op, key, translated)

    # -- errors -------------------------------------------------------------------------

    def _translate(self, exc: BaseException, key: str, op: str = "get") -> Exception:
        if _missing_bucket(exc, key):
            # The backend answered (no retry, no failure for the circuit): its bucket is
            # gone, which is no missing key (a HEAD's 404 has no body: that one is).
            return BucketNotFoundError(
                f"backend {self.name!r}: its bucket does not exist (deleted, or never "
                f"made), reading {shown(key)}; make it again, or fix the backend's url"
            )
        if isinstance(exc, NotFoundError | FileNotFoundError):
            return self.not_found(key)
        refused = self._refused_key(exc, key, op)
        if refused is not None:
            return refused
        if isinstance(exc, PermissionDeniedError | UnauthenticatedError):
            return BackendForbiddenError(
                f"backend {self.name!r} refused access to {key}: {first_line(exc)}; "
                "check the credentials configured for it"
            )
        if isinstance(exc, PreconditionError | VersionChangedError):
            return VersionChangedError(
                f"{self.name}/{key} changed while it was read; read it again"
            )
        if isinstance(exc, NotSupportedError | GenericError) and (
            _RANGE_IGNORED in str(exc) or _NOT_PARTIAL in str(exc)
        ):
            # The server's answer, which no retry changes: not counted against it.
            return IntegrityError(
                f"backend {self.name!r} answered a read of a byte range of {shown(key)} with "
                "the whole object: its server does not serve byte ranges, which chunkd "
                "needs to read it"
            )
        if isinstance(exc, TimeoutError):
            return BackendUnavailableError(
                f"backend {self.name!r} did not answer within {self.config.timeout:g}s ({key})"
            )
        if isinstance(
            exc,
            BackendUnavailableError
            | BackendForbiddenError
            | BucketNotFoundError
            | IntegrityError
            | UnversionedObjectError,
        ):
            return exc  # said already (a streamed write's own requests, a kind's own check)
        return BackendUnavailableError(f"backend {self.name!r} failed on {key}: {first_line(exc)}")

    def _meta_of(self, key: str, meta: Any) -> ObjectMeta:
        """The :class:`ObjectMeta` of a store's answer about ``key`` (a kind whose
        versions need a check of their own says so here)."""
        return _meta(key, meta)

    def name_limit(self, name: str) -> tuple[str, int, int, str] | None:
        """``(what, limit, size, unit)`` of the store's longest object name for
        ``name`` (the backend's prefix included); ``None``: the store says itself."""
        return None

    def _refuse_long_name(self, key: str) -> InvalidKeyError | None:
        """The error for a key longer than the object store holds, before it is asked.

        Such a request fails with a 400 (S3's KeyTooLongError; a bare 400 to a HEAD),
        which must not count against the backend; chunkd knows the limit and does not
        send it.
        """
        prefix = self.config.prefix
        limit = self.name_limit(f"{prefix}/{key}" if prefix else key)
        if limit is None or limit[2] <= limit[1]:
            return None
        what, most, size, unit = limit
        with_prefix = f" with the backend's prefix {prefix!r}" if prefix else ""
        return InvalidKeyError(
            f"backend {self.name!r} cannot hold the key {shown(key)}: it is {size} {unit} "
            f"long{with_prefix}, and {what} are at most {most} {unit}; use a shorter key"
        )

    def _refused_key(self, exc: BaseException, key: str, op: str) -> Exception | None:
        if isinstance(exc, InvalidKeyError):  # the attempt found the request's own key bad
            return exc
        if op == "list" and (
            isinstance(exc, InvalidPathError) or (type(exc) is ValueError and "path" in str(exc))
        ):
            # A key the listing met, not the request's: S3 allows "a//b" and "a/./b",
            # object_store cannot name them, and fails the whole page that holds one.
            return InvalidKeyError(
                f"backend {self.name!r} holds an object under {shown(key)} whose key has an "
                "empty, '.' or '..' segment (S3 allows them; chunkd's object store client "
                "cannot name them), and a listing cannot go past it: rename that object"
            )
        if type(exc) is ValueError and "parse path" in str(exc):  # obstore's path parser
            return InvalidKeyError(
                f"backend {self.name!r} cannot hold the key {shown(key)}: it is not a path "
                "it can name; use another name"
            )
        if isinstance(exc, UnicodeError):
            return InvalidKeyError(f"backend {self.name!r} refused the key {shown(key)}: {exc}")
        if isinstance(exc, InvalidPathError):  # its text may hold the backend's own paths
            return InvalidKeyError(
                f"backend {self.name!r} refused the key {shown(key)} as a path it cannot "
                "hold; use another name"
            )
        return self.refused_by_store(exc, key, op)

    def refused_by_store(self, exc: BaseException, key: str, op: str) -> Exception | None:
        """The error for a key this kind of store refused in its own way, or None when
        ``exc`` is not that (a file:// backend reads its filesystem's errors)."""
        return None

    async def close(self) -> None:
        # docstring inherited: obstore closes the store's connections when it is dropped
        self._store = None


def client_options(config: BackendConfig) -> ClientConfig:
    """The HTTP client options of a cloud backend.

    ``timeout`` bounds a backend that stops answering: the wait for a response and
    each read of a body (``read_timeout``). reqwest's overall ``timeout`` would also
    bound a whole body, so a span GET of 64 chunks from a slow but steady backend
    would break every time; here it is only a last resort of an hour.
    """
    client: ClientConfig = {
        "timeout": timedelta(seconds=max(_BODY_DEADLINE, config.timeout)),
        "read_timeout": timedelta(seconds=config.timeout),
        "connect_timeout": timedelta(seconds=min(5.0, config.timeout)),
    }
    if config.allow_http:
        client["allow_http"] = True
    return client


def no_retries(config: BackendConfig) -> RetryConfig:
    """obstore's own retries off: :meth:`StoreBackend._call` retries, and counts."""
    return {"max_retries": 0, "retry_timeout": timedelta(seconds=config.timeout)}


def cloud_store(store_type: Callable[..., Any], config: BackendConfig, /, **settings: Any) -> Any:
    """A cloud kind's obstore store (``S3Store``, ``GCSStore``, ``AzureStore``) over
    ``config``'s bucket and prefix, with :func:`client_options` and obstore's retries
    off (:func:`no_retries`); ``settings``: the keyword arguments of the kind's own."""
    return store_type(
        config.bucket,
        prefix=config.prefix or None,
        client_options=client_options(config),
        retry_config=no_retries(config),
        **settings,
    )


def _discard(result: Any) -> None:
    """Let go of an answer whose body is not read to its end: its connection closed
    now where the result can say so (one not read through obstore), else when it is
    dropped."""
    close = getattr(result, "close", None)
    if close is not None:
        close()


def _etag(meta: Any) -> str | None:
    """The ETag, quoted as HTTP quotes it: Azure's listings give it bare, its HEADs
    quoted, and one object has one version token."""
    etag = meta.get("e_tag")
    if etag and not etag.startswith(('"', "W/")):
        return f'"{etag}"'
    return str(etag) if etag else None


def _meta(key: str, meta: Any) -> ObjectMeta:
    etag = _etag(meta)
    stamp = meta.get("last_modified")
    return ObjectMeta(
        key=key,
        size=int(meta["size"]),
        version=_version_of(meta),
        etag=etag,
        modified=stamp.timestamp() if stamp is not None else 0.0,
    )


def _version_of(meta: Any) -> str:
    etag = _etag(meta)
    if etag:
        return etag
    stamp = meta["last_modified"]
    return f"{meta['size']}-{stamp.timestamp():.9f}"


#: how each store says the bucket (or container) itself does not exist, in the error
#: document it sends: S3's and GCS's XML API, Azure's
_NO_BUCKET: Final = ("<Code>NoSuchBucket</Code>", "<Code>ContainerNotFound</Code>")


def _missing_bucket(exc: BaseException, key: str) -> bool:
    """Whether ``exc``, a store's refusal of a request for ``key``, says the bucket itself
    does not exist (the key's own text, which obstore's message repeats, left out)."""
    if not isinstance(exc, NotFoundError | FileNotFoundError | GenericError):
        return False
    text = str(exc)
    repeated = text.count(key) if key else 0
    return any(text.count(sign) > key.count(sign) * repeated for sign in _NO_BUCKET)


def shown(key: str) -> str:
    """``key`` quoted for a message; a long one shortened, with its length."""
    if len(key) <= 80:
        return repr(key)
    return f"{key[:40]!r}...{key[-20:]!r} ({len(key)} characters)"


def first_line(exc: BaseException) -> str:
    """The first line of an error's text (obstore's run to many)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
