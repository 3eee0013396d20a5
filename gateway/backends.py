"""Backends: the configured object stores, reached through obstore.

One :class:`Backend` per ``[[backends]]`` entry; the set of configured backends is
also the allowlist (:class:`Backends` refuses any other name). Each backend keeps
its own bounded retries (exponential backoff with full jitter) and circuit breaker:
after ``_BREAK_AFTER`` consecutive failures it fails fast for a cool-down, then lets
one request through to probe. obstore's own retries are off, so every attempt is
visible in the metrics.

Errors are mapped once, here: a missing object is :class:`ObjectNotFoundError`, a
refusal :class:`BackendForbiddenError`, a failed ``If-Match``
:class:`VersionChangedError`, a key the store cannot hold :class:`InvalidKeyError`,
and everything that may heal (5xx, timeouts, refused connections, an open circuit)
:class:`BackendUnavailableError`. A key the store cannot hold is the request's own
fault: it is neither retried nor counted for or against the backend's health (it is
counted in ``chunkd_backend_rejected_keys_total``), so no client can open a circuit
by asking for names a backend refuses.
"""

from __future__ import annotations

import asyncio
import builtins
import errno
import functools
import logging
import random
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import obstore
from obstore.exceptions import (
    AlreadyExistsError,
    InvalidPathError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)
from obstore.store import AzureStore, GCSStore, LocalStore, MemoryStore, S3Store

from chunkd.errors import (
    BackendForbiddenError,
    BackendUnavailableError,
    InvalidKeyError,
    ObjectNotFoundError,
    ReadOnlyBackendError,
    UnknownBackendError,
    VersionChangedError,
)
from chunkd.gateway.filelist import FileLister
from chunkd.gateway.objects import ObjectMeta

if TYPE_CHECKING:
    from obstore import GetOptions
    from obstore.store import ClientConfig, RetryConfig

    from chunkd.gateway.config import BackendConfig
    from chunkd.gateway.metrics import Metrics

__all__ = ["Backend", "Backends", "ObjectMeta"]

log = logging.getLogger("chunkd.gateway.backends")

T = TypeVar("T")

_BREAK_AFTER: Final = 5  # consecutive failures that open the circuit
_COOL_DOWN: Final = 5.0  # seconds an open circuit fails fast
_BACKOFF_BASE: Final = 0.05
_BACKOFF_CAP: Final = 2.0
#: objects one listing request asks for (S3's own page size)
SCAN_BATCH: Final = 1000
_BODY_DEADLINE: Final = 3600.0  # seconds one response may take in all, a span GET included
# The longest object name each object store holds, its prefix included: S3 and Cloud
# Storage count UTF-8 bytes, Azure characters.
_NAME_LIMITS: Final = {"s3": ("S3 keys", 1024), "gs": ("Cloud Storage names", 1024)}
_AZURE_NAME_CHARS: Final = 1024
_OBJECT_OPS: Final = frozenset({"head", "get", "put", "delete"})
# obstore's text for an OS error (LocalFileSystem): "... File name too long (os error 36)".
_OS_ERROR: Final = re.compile(r"\(os error (\d+)\)")


class Backend:
    """One configured object store.

    Args:
        config: its ``[[backends]]`` entry.
        metrics: where requests, bytes, errors and latencies are counted.
        store: the obstore store (built from ``config`` when not given).
    """

    def __init__(self, config: BackendConfig, metrics: Metrics, store: Any = None) -> None:
        self.config = config
        self.name = config.name
        self._metrics = metrics
        self._store = store if store is not None else _make_store(config)
        self._failures = 0
        self._open_until = 0.0
        self._probing = False
        # Over HTTP, reqwest's read_timeout bounds every read of a body, so reads are
        # bounded per read and a slow, steady body is never cut off. Local and
        # in-memory stores have no such timeout: their reads stay bounded as a whole.
        self._per_read = config.scheme not in ("file", "memory")
        # obstore lists a LocalStore in directory order, and filters for an offset
        # after walking everything: file backends are listed by chunkd itself.
        self._files = FileLister(config.prefix) if config.scheme == "file" else None

    async def head(self, key: str) -> ObjectMeta:
        """Size and version of ``key``.

        Raises:
            ObjectNotFoundError, BackendForbiddenError, BackendUnavailableError
        """

        async def call() -> ObjectMeta:
            meta = await obstore.head_async(self._store, key)
            return _meta(key, meta)

        return await self._call("head", key, call)

    async def get_range(self, meta: ObjectMeta, start: int, end: int) -> memoryview:
        """Bytes ``start`` to ``end`` (exclusive) of the version ``meta`` describes.

        Raises:
            VersionChangedError: the object is no longer that version.
            ObjectNotFoundError, BackendForbiddenError, BackendUnavailableError
        """

        async def call() -> memoryview:
            result = await asyncio.wait_for(self._open(meta, start, end), self.config.timeout)
            data = memoryview(await result.bytes_async())  # each read: read_timeout
            if data.nbytes != end - start:
                raise BackendUnavailableError(
                    f"backend {self.name!r} returned {data.nbytes} bytes of {meta.key} for a "
                    f"{end - start}-byte range; the read will be retried"
                )
            self._metrics.backend_read_bytes.labels(self.name).inc(data.nbytes)
            return data

        return await self._call("get", meta.key, call, whole=not self._per_read)

    async def get(self, key: str) -> memoryview:
        """The whole object ``key`` (small objects: manifests, single chunks).

        Raises:
            ObjectNotFoundError, BackendForbiddenError, BackendUnavailableError
        """

        async def call() -> memoryview:
            opening = obstore.get_async(self._store, key)
            result = await asyncio.wait_for(opening, self.config.timeout)
            data = memoryview(await result.bytes_async())  # each read: read_timeout
            self._metrics.backend_read_bytes.labels(self.name).inc(data.nbytes)
            return data

        return await self._call("get", key, call, whole=not self._per_read)

    async def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        """Write ``data`` to ``key``; with ``if_absent``, only where nothing is there yet.

        Returns whether this call wrote the object (``False``: ``if_absent`` found one).

        Raises:
            ReadOnlyBackendError: the backend is not configured ``writable = true``.
            BackendForbiddenError, BackendUnavailableError
        """
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
            return True

        return await self._call("put", key, call)

    async def delete(self, key: str) -> None:
        """Delete ``key`` (deleting a missing object is not an error).

        Raises:
            ReadOnlyBackendError, BackendForbiddenError, BackendUnavailableError
        """
        self.check_writable()

        async def call() -> None:
            try:
                await obstore.delete_async(self._store, key)
            except (NotFoundError, FileNotFoundError):
                return

        await self._call("delete", key, call)

    def check_writable(self) -> None:
        """Raise :class:`ReadOnlyBackendError` unless the backend takes writes."""
        if not self.config.writable:
            raise ReadOnlyBackendError(
                f"backend {self.name!r} is read-only; set writable = true in its "
                "[[backends]] entry to save checkpoints there"
            )

    async def stream_range(
        self, meta: ObjectMeta, start: int, end: int, *, piece_bytes: int
    ) -> AsyncIterator[memoryview]:
        """Stream bytes ``start`` to ``end`` of ``meta``'s version in pieces.

        The request itself is retried like :meth:`get_range`; a failure while the body
        streams is raised (translated) to the caller, who knows what it still needs.
        """

        result = await self._call("get", meta.key, lambda: self._open(meta, start, end))
        pieces = result.stream(min_chunk_size=piece_bytes)
        got = 0
        while True:
            started = time.perf_counter()
            try:
                # A stalled body is cut by read_timeout (the backend timeout), not by
                # a bound on the whole piece, which many spans sharing a link make slow.
                piece = await (
                    anext(pieces, None)
                    if self._per_read
                    else asyncio.wait_for(anext(pieces, None), timeout=self.config.timeout)
                )
            except Exception as exc:
                error = self._translate(exc, meta.key)
                self._metrics.backend_errors.labels(self.name, type(error).__name__).inc()
                self._failed()
                raise error from exc
            finally:
                self._metrics.backend_seconds.labels(self.name, "stream").observe(
                    time.perf_counter() - started
                )
            if piece is None:
                break
            view = memoryview(piece)
            got += view.nbytes
            self._metrics.backend_read_bytes.labels(self.name).inc(view.nbytes)
            yield view
        if got != end - start:
            raise BackendUnavailableError(
                f"backend {self.name!r} sent {got} bytes of {meta.key} for a "
                f"{end - start}-byte range"
            )

    async def scan(
        self, prefix: str, *, start_after: str | None = None, batch: int = SCAN_BATCH
    ) -> AsyncGenerator[builtins.list[ObjectMeta], None]:
        """Every object under ``prefix`` in key order, after ``start_after``, in batches.

        Key order is the UTF-8 byte order of the keys, as S3 lists them, for every
        kind of backend. ``prefix`` counts whole path segments (``a/b`` holds
        ``a/b/x``, not ``a/bc``, nor ``a/b`` itself, which is how obstore names an S3
        directory marker ``a/b/``); ``""`` is the whole backend. Each batch is one
        request (at most ``batch`` objects), retried and counted like any other; a
        listing broken off is taken up again after the last key it gave. It holds no
        more than one batch in memory, however many objects there are, and a caller
        that stops early stops the listing.

        Raises:
            InvalidKeyError: ``start_after`` is not a key this backend can name.
            BackendForbiddenError, BackendUnavailableError
        """
        if self._files is not None:
            last = start_after
            while True:
                after = last
                got = await self._call(
                    "list",
                    prefix or "/",
                    functools.partial(asyncio.to_thread, self._files.batch, prefix, after, batch),
                )
                if got:
                    yield got
                    last = got[-1].key
                if len(got) < batch:
                    return
        # One stream for the whole listing: a store without a native offset (Azure,
        # in object_store) lists from the start again whenever one is given.
        top = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        last = start_after
        stream: Any = None

        async def next_batch() -> builtins.list[Any]:
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
            metas = [_meta(m["path"], m) for m in raw]
            # obstore drops a trailing "/" of an offset, and names a marker "a/b/" as
            # "a/b": what is not after the token, or not below the prefix, goes.
            got = [
                m
                for m in metas
                if (start_after is None or m.key > start_after) and m.key.startswith(top)
            ]
            if got:
                yield got
            if metas:
                last = metas[-1].key
            if len(raw) < batch:
                return

    def _list_stream(self, prefix: str, after: str | None, batch: int) -> Any:
        try:
            return obstore.list(self._store, prefix or None, offset=after, chunk_size=batch)
        except ValueError as exc:  # obstore cannot parse the offset as a path
            raise InvalidKeyError(
                f"backend {self.name!r} cannot start a listing after {_shown(after or '')}: "
                f"it is not a key it can hold ({_first_line(exc)})"
            ) from None

    async def _open(self, meta: ObjectMeta, start: int, end: int) -> Any:
        """A ranged GET pinned to ``meta``'s version (If-Match, or a version check)."""
        options: GetOptions = {"range": (start, end)}
        if meta.etag is not None:
            options["if_match"] = meta.etag
        result = await obstore.get_async(self._store, meta.key, options=options)
        if meta.etag is None and _version_of(result.meta) != meta.version:
            raise VersionChangedError(
                f"{self.name}/{meta.key} changed while it was read; read it again"
            )
        return result

    @property
    def request_bound(self) -> float:
        """The longest one request can take, its retries and their backoff included."""
        retries = max(0, self.config.retries)
        return self.config.timeout * (retries + 1) + _BACKOFF_CAP * retries

    @property
    def circuit_open(self) -> bool:
        """Whether the backend fails fast right now."""
        return time.monotonic() < self._open_until

    async def _call(
        self, op: str, key: str, attempt: Callable[[], Awaitable[T]], *, whole: bool = True
    ) -> T:
        """``attempt()`` with retries (full jitter) and the circuit breaker.

        ``whole``: the timeout bounds the whole attempt. Reads over HTTP pass False
        and bound the wait for the response themselves: their bodies are bounded per
        read (``read_timeout``), so a slow but steady transfer shared by many
        requests is not cut off and fetched again. Writes, HEADs and listings stay
        bounded as a whole.
        """
        if op in _OBJECT_OPS and (refused := self._refuse_long_name(key)) is not None:
            self._metrics.rejected_keys.labels(self.name).inc()
            raise refused
        retries = max(0, self.config.retries)
        for n in range(retries + 1):
            self._check_circuit(key)
            started = time.perf_counter()
            self._metrics.backend_requests.labels(self.name, op).inc()
            try:
                result = await (
                    asyncio.wait_for(attempt(), timeout=self.config.timeout) if whole else attempt()
                )
            except asyncio.CancelledError:
                self._probing = False  # a cancelled probe must not hold the circuit shut
                raise
            except Exception as exc:
                error = self._translate(exc, key, op)
                if isinstance(error, InvalidKeyError):
                    # The request's own key: said at once, and neither a failure nor a
                    # success of the backend (a probe is over, the circuit unchanged).
                    self._probing = False
                    self._metrics.rejected_keys.labels(self.name).inc()
                    raise error from exc
                kind = type(error).__name__
                self._metrics.backend_errors.labels(self.name, kind).inc()
                if not isinstance(error, BackendUnavailableError):
                    self._succeeded()  # the backend answered: it is up
                    raise error from exc
                self._failed()
                if n == retries or self.circuit_open:
                    raise error from exc
                delay = random.uniform(0, min(_BACKOFF_CAP, _BACKOFF_BASE * 2**n))
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

    def _check_circuit(self, key: str) -> None:
        now = time.monotonic()
        if now < self._open_until:
            raise BackendUnavailableError(
                f"backend {self.name!r} is failing; chunkd stopped asking it for "
                f"{self._open_until - now:.1f}s more (reading {key}); cached data is still served"
            )
        if self._failures >= _BREAK_AFTER:
            if self._probing:  # one probe at a time once the cool-down is over
                raise BackendUnavailableError(
                    f"backend {self.name!r} is failing; a probe request is in flight"
                )
            self._probing = True

    def _failed(self) -> None:
        self._failures += 1
        self._probing = False
        if self._failures >= _BREAK_AFTER:
            if not self.circuit_open:
                log.warning(
                    "backend %s: %d failures in a row; circuit open for %.0fs",
                    self.name,
                    self._failures,
                    _COOL_DOWN,
                )
            self._open_until = time.monotonic() + _COOL_DOWN
            self._metrics.backend_circuit_open.labels(self.name).set(1)

    def _succeeded(self) -> None:
        if self._failures >= _BREAK_AFTER:
            log.info("backend %s: answering again; circuit closed", self.name)
        self._failures = 0
        self._probing = False
        self._open_until = 0.0
        self._metrics.backend_circuit_open.labels(self.name).set(0)

    def _translate(self, exc: BaseException, key: str, op: str = "get") -> Exception:
        where = f"{self.name}/{key}"
        if isinstance(exc, NotFoundError | FileNotFoundError):
            return ObjectNotFoundError(f"{where} does not exist in backend {self.name!r}")
        refused = self._refused_key(exc, key, op)
        if refused is not None:
            return refused
        if isinstance(exc, PermissionDeniedError | UnauthenticatedError):
            return BackendForbiddenError(
                f"backend {self.name!r} refused access to {key}: {_first_line(exc)}; "
                "check the credentials configured for it"
            )
        if isinstance(exc, PreconditionError | VersionChangedError):
            return VersionChangedError(f"{where} changed while it was read; read it again")
        if isinstance(exc, TimeoutError):
            return BackendUnavailableError(
                f"backend {self.name!r} did not answer within {self.config.timeout:g}s ({key})"
            )
        if isinstance(exc, BackendUnavailableError):
            return exc
        return BackendUnavailableError(f"backend {self.name!r} failed on {key}: {_first_line(exc)}")

    def _refuse_long_name(self, key: str) -> InvalidKeyError | None:
        """The error for a key longer than the object store holds, before it is asked.

        Such a request fails with a 400 (S3's KeyTooLongError; a bare 400 to a HEAD),
        which must not count against the backend; chunkd knows the limit and does not
        send it.
        """
        scheme = self.config.scheme
        if scheme not in _NAME_LIMITS and scheme != "az":
            return None
        prefix = self.config.prefix
        name = f"{prefix}/{key}" if prefix else key
        if scheme == "az":
            what, limit, size, unit = "Azure blob names", _AZURE_NAME_CHARS, len(name), "characters"
        else:
            what, limit = _NAME_LIMITS[scheme]
            size, unit = len(name.encode("utf-8", "surrogatepass")), "bytes"
        if size <= limit:
            return None
        with_prefix = f" with the backend's prefix {prefix!r}" if prefix else ""
        return InvalidKeyError(
            f"backend {self.name!r} cannot hold the key {_shown(key)}: it is {size} {unit} "
            f"long{with_prefix}, and {what} are at most {limit} {unit}; use a shorter key"
        )

    def _refused_key(self, exc: BaseException, key: str, op: str) -> Exception | None:
        if isinstance(exc, InvalidKeyError):  # the attempt found the request's own key bad
            return exc
        if type(exc) is ValueError and "parse path" in str(exc):  # obstore's path parser
            return InvalidKeyError(
                f"backend {self.name!r} cannot hold the key {_shown(key)}: it is not a path "
                "it can name; use another name"
            )
        return self._refused_by_store(exc, key, op)

    def _refused_by_store(self, exc: BaseException, key: str, op: str) -> Exception | None:
        """The error for a key the store refused, or None when ``exc`` is not that.

        A file:// backend's filesystem refuses a path segment longer than it allows
        (ENAMETOOLONG) or a name it cannot encode (EILSEQ, EINVAL), and
        object_store's LocalFileSystem refuses names that end in ``#`` and digits (it
        writes its temporary files under them). A key below a key that is a file
        (ENOTDIR) does not exist when read, and cannot be written; nor can a key where
        a directory is (EISDIR). Only the key is named in the message, never the
        backend's own paths.
        """
        if isinstance(exc, UnicodeError):
            return InvalidKeyError(f"backend {self.name!r} refused the key {_shown(key)}: {exc}")
        if isinstance(exc, InvalidPathError):  # its text may hold the backend's own paths
            return InvalidKeyError(
                f"backend {self.name!r} refused the key {_shown(key)} as a path it cannot "
                "hold; use another name"
            )
        if self.config.scheme != "file":
            return None
        text = str(exc)
        refused = f"backend {self.name!r} cannot hold the key {_shown(key)}"
        if "InvalidPath {" in text:
            return InvalidKeyError(
                f"{refused}: a file:// backend keeps names that end in '#' and digits for "
                "its temporary files; use another name"
            )
        found = _OS_ERROR.search(text)
        code = int(found.group(1)) if found else None
        if code == errno.ENAMETOOLONG:
            longest = max(len(part.encode("utf-8", "surrogatepass")) for part in key.split("/"))
            why = (
                f"one path segment is {longest} bytes, and filesystems allow 255 at most"
                if longest > 255
                else "the whole path is longer than it allows"
            )
            return InvalidKeyError(
                f"{refused}: its filesystem refused the name as too long ({why}); use a shorter key"
            )
        if code in (errno.EILSEQ, errno.EINVAL):
            return InvalidKeyError(
                f"{refused}: its filesystem refused the name ({errno.errorcode[code]}: "
                "a character it does not allow in file names); use another name"
            )
        if code in (errno.ENOTDIR, errno.EISDIR):
            why = (
                "a part of its path is an object, and a file:// backend holds nothing below "
                "an object"
                if code == errno.ENOTDIR
                else "it names a directory of other objects"
            )
            if op in ("head", "get"):
                return ObjectNotFoundError(
                    f"{self.name}/{key} does not exist in backend {self.name!r} ({why})"
                )
            return InvalidKeyError(f"{refused}: {why}; use another name")
        return None

    async def close(self) -> None:
        """Release the store's connections (obstore closes them when dropped)."""
        self._store = None


class Backends:
    """The configured backends by name: the only ones chunkd will reach."""

    def __init__(self, backends: Iterable[Backend]) -> None:
        self._by_name = {b.name: b for b in backends}

    @classmethod
    def from_config(cls, configs: Iterable[BackendConfig], metrics: Metrics) -> Backends:
        """Build every backend of the config (local directories are created)."""
        made = []
        for config in configs:
            if config.scheme == "file":
                Path(config.prefix).mkdir(parents=True, exist_ok=True)
            made.append(Backend(config, metrics))
        return cls(made)

    def get(self, name: str) -> Backend:
        """The backend called ``name``.

        Raises:
            UnknownBackendError: no backend of that name is configured.
        """
        backend = self._by_name.get(name)
        if backend is None:
            known = ", ".join(sorted(self._by_name)) or "none"
            raise UnknownBackendError(
                f"no backend named {name!r} is configured (configured: {known})"
            )
        return backend

    def __iter__(self) -> Any:
        return iter(self._by_name.values())

    async def close(self) -> None:
        """Close every backend."""
        for backend in self._by_name.values():
            await backend.close()


def _make_store(config: BackendConfig) -> Any:
    # ``timeout`` bounds a backend that stops answering: the wait for a response
    # (``_call``, ``get``, ``get_range``) and each read of a body (``read_timeout``).
    # reqwest's overall ``timeout`` would also bound a whole body, so a span GET of
    # 64 chunks from a slow but steady backend would break every time; here it is
    # only a last resort of an hour.
    client: ClientConfig = {
        "timeout": timedelta(seconds=max(_BODY_DEADLINE, config.timeout)),
        "read_timeout": timedelta(seconds=config.timeout),
        "connect_timeout": timedelta(seconds=min(5.0, config.timeout)),
    }
    if config.allow_http:
        client["allow_http"] = True
    no_retries: RetryConfig = {"max_retries": 0, "retry_timeout": timedelta(seconds=config.timeout)}
    scheme = config.scheme
    if scheme == "s3":
        kwargs: dict[str, Any] = {}
        if config.endpoint:
            kwargs["endpoint"] = config.endpoint
            kwargs["virtual_hosted_style_request"] = False
        if config.region:
            kwargs["region"] = config.region
        if config.access_key_id:
            kwargs["access_key_id"] = config.access_key_id
        if config.secret_access_key is not None:
            kwargs["secret_access_key"] = config.secret_access_key.reveal()
        if config.session_token is not None:
            kwargs["session_token"] = config.session_token.reveal()
        return S3Store(
            config.bucket,
            prefix=config.prefix or None,
            client_options=client,
            retry_config=no_retries,
            **kwargs,
        )
    if scheme in ("gs", "az"):  # credentials come from the environment, as usual there
        store = GCSStore if scheme == "gs" else AzureStore
        return store(
            config.bucket,
            prefix=config.prefix or None,
            client_options=client,
            retry_config=no_retries,
        )
    if scheme == "file":
        return LocalStore(config.prefix)
    if scheme == "memory":
        return MemoryStore()
    raise UnknownBackendError(f"backend {config.name!r} has an unsupported scheme {scheme!r}")


def _meta(key: str, meta: Any) -> ObjectMeta:
    etag = meta.get("e_tag")
    stamp = meta.get("last_modified")
    return ObjectMeta(
        key=key,
        size=int(meta["size"]),
        version=_version_of(meta),
        etag=etag,
        modified=stamp.timestamp() if stamp is not None else 0.0,
    )


def _version_of(meta: Any) -> str:
    etag = meta.get("e_tag")
    if etag:
        return str(etag)
    stamp = meta["last_modified"]
    return f"{meta['size']}-{stamp.timestamp():.9f}"


def _shown(key: str) -> str:
    """``key`` quoted for a message; a long one shortened, with its length."""
    if len(key) <= 80:
        return repr(key)
    return f"{key[:40]!r}...{key[-20:]!r} ({len(key)} characters)"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
