"""``https://host/path`` (and ``http://``): files served over HTTP, read-only and unlisted.

Dataset mirrors, a static file server, a model hub's resolve URLs: every key below
the backend's URL (``allow_http = true`` for a plain ``http://`` URL). Reads are ranged
GETs, pinned with ``If-Match`` as on S3 (and the answer's ``ETag`` checked, for a
server that ignores ``If-Match``); a HEAD answers the size and the version.

**Its own HTTP client, for its redirects.** The I/O is aiohttp's, answering the shape
of obstore's results (:class:`StoreBackend` does the rest): obstore's client (reqwest)
follows every redirect to any host, so a mirror could point chunkd at a loopback,
private, link-local or metadata address and have it cache and serve what it finds
there, and obstore cannot be told not to. Here a redirect is followed (at most
:data:`MAX_REDIRECTS` hops) to the backend's own origin (its scheme, host and port), or
to an ``https://`` URL whose host's every address is a public one (a model hub's CDN);
any other is refused (:class:`~chunkd.errors.BackendForbiddenError`, naming where it
pointed). The addresses are checked again when a connection is made, so a name that
resolves elsewhere the second time is refused too.

**A version is the strong ETag.** A server that sends none (or only a weak one,
``W/"..."``, which promises nothing about the bytes) is refused
(:class:`~chunkd.errors.UnversionedObjectError`, saying why), since a ``Last-Modified`` of
one-second resolution alone would let pinned reads mix two versions of a file
rewritten within a second. With ``immutable_files = true`` (the server's files never
change) such a server is read with size and ``Last-Modified`` as the version: a file
rewritten in place at the same size within the same second would then be read as a
mix of both.

**Read-only and unlisted.** Writes are refused (:class:`~chunkd.errors.ReadOnlyBackendError`;
config refuses ``writable = true``), and so is a listing
(:class:`~chunkd.errors.InvalidRequestError`: obstore would list by WebDAV
``PROPFIND``, which static servers and mirrors do not answer): a dataset on such a
backend is registered from a file of keys (docs/datasets.md).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import AsyncGenerator, AsyncIterator
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import quote

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from obstore.exceptions import (
    GenericError,
    NotFoundError,
    NotModifiedError,
    NotSupportedError,
    PermissionDeniedError,
    PreconditionError,
)
from yarl import URL

from chunkd.errors import (
    BackendForbiddenError,
    InvalidKeyError,
    InvalidRequestError,
    ReadOnlyBackendError,
    UnversionedObjectError,
)
from chunkd.gateway.backends.base import SCAN_BATCH
from chunkd.gateway.backends.store import _BODY_DEADLINE, StoreBackend, shown

if TYPE_CHECKING:
    from obstore import GetOptions

    from chunkd.gateway.backends.meta import ObjectMeta
    from chunkd.gateway.config import BackendConfig
    from chunkd.gateway.metrics import Metrics

__all__ = ["MAX_REDIRECTS", "HTTPBackend"]

#: redirects one request follows at most (a hub's resolve URL takes one, to its CDN)
MAX_REDIRECTS: Final = 5
_REDIRECTS: Final = frozenset({301, 302, 303, 307, 308})


def _public(address: str) -> bool:
    """Whether ``address`` (an IP) is a public one: not loopback, private, link-local
    (a cloud's metadata service), unspecified, multicast or reserved."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


class _NotPublic(OSError):
    """A host resolved, when connecting, to an address that is not public."""


class _PublicOnly(AbstractResolver):
    """A resolver that answers only public addresses for every host but the backend's
    own: a name that resolved to a public address when a redirect was checked and to
    a private one when connecting is refused there too."""

    def __init__(self, own_host: str) -> None:
        self._own = own_host
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        if host != self._own and not all(_public(r["host"]) for r in found):
            raise _NotPublic(f"{host} resolves to an address that is not public; not connecting")
        return found

    async def close(self) -> None:
        await self._inner.close()


class _StatusError(Exception):
    """An HTTP answer that is none of the ones :class:`HTTPBackend` reads."""

    def __init__(self, status: int, reason: str, method: str) -> None:
        super().__init__(f"HTTP {status} {reason} to a {method}")
        self.status = status
        self.method = method


class _Answer:
    """A GET's answer in the shape of obstore's ``GetResult``: ``meta``, ``range``,
    ``bytes_async()`` and ``stream(min_chunk_size=)``."""

    def __init__(self, response: aiohttp.ClientResponse, meta: dict[str, Any], span: Any) -> None:
        self._response = response
        self.meta = meta
        self.range = span

    def close(self) -> None:
        """Close its connection (its body is not read to the end)."""
        self._response.close()

    async def bytes_async(self) -> bytes:
        try:
            return await self._response.read()
        finally:
            self._response.release()

    def stream(self, min_chunk_size: int = 1 << 20) -> AsyncIterator[bytes]:
        return self._pieces(max(1, min_chunk_size))

    async def _pieces(self, size: int) -> AsyncIterator[bytes]:
        held: list[bytes] = []
        got = 0
        try:
            async for data in self._response.content.iter_chunked(size):
                held.append(data)
                got += len(data)
                if got >= size:
                    yield held[0] if len(held) == 1 else b"".join(held)
                    held, got = [], 0
            if held:
                yield b"".join(held)
        finally:
            self._response.close()  # a body not read to its end is not reused


def _meta(response: aiohttp.ClientResponse, size: int) -> dict[str, Any]:
    """obstore's metadata shape (``e_tag``, ``size``, ``last_modified``) of an answer."""
    stamp = None
    if (modified := response.headers.get("Last-Modified")) is not None:
        try:
            stamp = parsedate_to_datetime(modified)
        except (TypeError, ValueError):
            stamp = None
    return {"e_tag": response.headers.get("ETag"), "size": size, "last_modified": stamp}


def _content_range(value: str | None) -> tuple[int, int, int] | None:
    """``(first, stop, total)`` of ``Content-Range: bytes FIRST-LAST/TOTAL``."""
    if value is None or not value.startswith("bytes "):
        return None
    try:
        span, total = value[6:].split("/", 1)
        first, last = span.split("-", 1)
        return int(first), int(last) + 1, int(total)
    except ValueError:
        return None


class HTTPBackend(StoreBackend):
    """Files below one URL of an HTTP server."""

    def __init__(self, config: BackendConfig, metrics: Metrics, store: Any = None) -> None:
        super().__init__(config, metrics, store=store)
        self._base = URL(config.url.rstrip("/"))
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def make_store(cls, config: BackendConfig) -> Any:
        # docstring inherited: its own client (the module's docstring says why)
        return config.url

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop:
            timeout = self.config.timeout
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=0, resolver=_PublicOnly(self._base.host or "")
                ),
                timeout=aiohttp.ClientTimeout(
                    total=max(_BODY_DEADLINE, timeout),
                    sock_connect=min(5.0, timeout),
                    sock_read=timeout,
                ),
                auto_decompress=False,  # ranges are of the bytes as stored
                headers={"Accept-Encoding": "identity", "User-Agent": "chunkd"},
                trust_env=False,
            )
            self._loop = loop
        return self._session

    def _url(self, key: str) -> URL:
        # One "/" between the base and the key: a server routing by exact path (not
        # merging slashes as nginx does) finds "/base/key".
        path = f"{self._base.raw_path.rstrip('/')}/{quote(key, safe='/')}"
        return self._base.with_path(path, encoded=True)

    async def _request(
        self, method: str, key: str, headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        """One request of ``key``, its redirects followed by the module's rule."""
        url = self._url(key)
        for _ in range(MAX_REDIRECTS + 1):
            try:
                response = await self._client().request(
                    method, url, headers=headers, allow_redirects=False
                )
            except aiohttp.ClientConnectorError as exc:
                if not isinstance(exc.os_error, _NotPublic):
                    raise
                # A redirect's host resolved again to a private address (DNS rebinding):
                # the rule's refusal, not a backend that is down (not retried or counted).
                raise BackendForbiddenError(
                    f"backend {self.name!r} redirected {shown(key)} to {url.host}, which "
                    f"now resolves to an address that is not public: {exc.os_error}; "
                    "chunkd follows redirects only to public https:// hosts"
                ) from None
            if response.status not in _REDIRECTS:
                return response
            location = response.headers.get("Location")
            response.release()
            if location is None:
                raise _StatusError(response.status, "with no Location", method)
            url = url.join(URL(location))
            await self._check_redirect(key, url)
        raise BackendForbiddenError(
            f"backend {self.name!r} redirected {shown(key)} more than {MAX_REDIRECTS} times; "
            "chunkd stopped following"
        )

    async def _check_redirect(self, key: str, url: URL) -> None:
        """Refuse a redirect to anywhere but the backend's own origin or a public https:// host."""
        if (url.scheme, url.host, url.port) == (
            self._base.scheme,
            self._base.host,
            self._base.port,
        ):
            return
        where = f"{url.scheme}://{url.host}:{url.port}"
        why = None
        if url.scheme != "https":
            why = "not https"
        elif url.host is None:
            why = "no host"
        else:
            try:
                found = await asyncio.get_running_loop().getaddrinfo(
                    url.host, url.port, type=socket.SOCK_STREAM
                )
            except OSError as exc:
                why = f"its host does not resolve ({exc})"
            else:
                private = sorted({str(a[4][0]) for a in found if not _public(str(a[4][0]))})
                if private:
                    why = f"its host resolves to an address that is not public ({private[0]})"
        if why is not None:
            raise BackendForbiddenError(
                f"backend {self.name!r} redirected {shown(key)} to {where}, which chunkd does not "
                f"follow ({why}): a redirect is followed only to the backend's own server or "
                "to an https:// host at a public address"
            )

    async def _store_head(self, key: str) -> Any:
        # docstring inherited
        response = await self._request("HEAD", key, {})
        try:
            self._raise_for(response, "HEAD", key)
            length = response.headers.get("Content-Length")
            if length is None or not length.isdigit():
                raise _StatusError(response.status, "with no Content-Length", "HEAD")
            return _meta(response, int(length))
        finally:
            response.release()

    async def _store_get(self, key: str, options: GetOptions) -> Any:
        # docstring inherited
        headers: dict[str, str] = {}
        span = options.get("range")
        if span is not None:
            if not isinstance(span, tuple | list):  # StoreBackend asks (start, end) only
                raise TypeError(f"a range of {shown(key)} as {span!r}")
            headers["Range"] = f"bytes={int(span[0])}-{int(span[1]) - 1}"
        if (etag := options.get("if_match")) is not None:
            headers["If-Match"] = str(etag)
        if (etag := options.get("if_none_match")) is not None:
            headers["If-None-Match"] = str(etag)
        response = await self._request("GET", key, headers)
        try:
            return self._answer(response, key, span)
        except BaseException:
            response.close()
            raise

    def _answer(self, response: aiohttp.ClientResponse, key: str, span: Any) -> _Answer:
        """A GET's answer, checked: its status, and its range against the one asked."""
        self._raise_for(response, "GET", key)
        if span is None:
            size = response.content_length
            if response.status != 200 or size is None:
                raise _StatusError(response.status, "with no Content-Length", "GET")
            return _Answer(response, _meta(response, size), (0, size))
        if response.status == 200:
            raise NotSupportedError(f"Range request not supported by {key}")
        got = _content_range(response.headers.get("Content-Range"))
        if response.status != 206 or got is None:
            raise _StatusError(response.status, "with no Content-Range", "GET")
        first, stop, total = got
        if response.content_length is not None and response.content_length != stop - first:
            # Checked before a byte of the body is read: a huge body is never held.
            raise self._overlong(key, first, stop)
        return _Answer(response, _meta(response, total), (first, stop))

    def _raise_for(self, response: aiohttp.ClientResponse, method: str, key: str) -> None:
        """obstore's error for an answer that is not a success (a 2xx)."""
        status = response.status
        if 200 <= status < 300:
            return
        if status in (404, 410):
            raise NotFoundError(f"{shown(key)} not found (HTTP {status})")
        if status == 304:
            raise NotModifiedError(f"{shown(key)} not modified")
        if status == 412:
            raise PreconditionError(f"{shown(key)}: precondition failed")
        if status == 416:
            raise GenericError("416 Range Not Satisfiable")
        if status in (401, 403):
            raise PermissionDeniedError(f"HTTP {status} {response.reason}")
        raise _StatusError(status, response.reason or "", method)

    def refused_by_store(self, exc: BaseException, key: str, op: str) -> Exception | None:
        # docstring inherited: a request line too long (414), or a 400 to a read, is the
        # request's own URL, which no retry heals: never counted against the backend.
        if isinstance(exc, _StatusError) and (
            exc.status == 414 or (exc.status == 400 and exc.method in ("GET", "HEAD"))
        ):
            return InvalidKeyError(
                f"backend {self.name!r} refused the URL of the key {shown(key)} ({exc}); "
                "use a shorter key, or one its server can name"
            )
        return None

    async def close(self) -> None:
        # docstring inherited
        session, self._session = self._session, None
        if session is not None and self._loop is asyncio.get_running_loop():
            await session.close()
        await super().close()

    @property
    def supports_writes(self) -> bool:
        # docstring inherited
        return False

    @property
    def supports_conditional_put(self) -> bool:
        # docstring inherited
        return False

    @property
    def supports_list(self) -> bool:
        # docstring inherited
        return False

    def check_writable(self) -> None:
        # docstring inherited
        raise ReadOnlyBackendError(
            f"backend {self.name!r} ({self.config.url}) is served over HTTP, which chunkd "
            "only reads; write to another backend (s3://, gs://, az:// or file://)"
        )

    def _meta_of(self, key: str, meta: Any) -> ObjectMeta:
        # docstring inherited: the strong ETag, or (immutable_files) size and mtime
        etag = meta.get("e_tag")
        strong = bool(etag) and not str(etag).startswith("W/")
        if not strong:
            if not self.config.immutable_files:
                sent = f"only a weak ETag ({etag})" if etag else "no ETag"
                raise UnversionedObjectError(
                    f"backend {self.name!r} sent {sent} for {shown(key)}, and chunkd reads an "
                    "http(s):// backend only by a strong ETag: without one, a file rewritten "
                    "on the server could be read as a mix of two versions; serve ETags, or "
                    "set immutable_files = true for this backend if its files never change"
                )
            stamp = meta.get("last_modified")
            if stamp is None or stamp.timestamp() <= 0:
                sent = f"only a weak ETag ({etag})" if etag else "no ETag"
                raise UnversionedObjectError(
                    f"backend {self.name!r} sent {sent} and no Last-Modified for {shown(key)}: "
                    "immutable_files versions a file by its size and Last-Modified, and a "
                    "size alone would let a rewritten file of the same size pass as the "
                    "same version; serve ETags or Last-Modified"
                )
            meta = {k: v for k, v in meta.items() if k != "e_tag"}
        return super()._meta_of(key, meta)

    async def scan(
        self, prefix: str, *, start_after: str | None = None, batch: int = SCAN_BATCH
    ) -> AsyncGenerator[list[ObjectMeta], None]:
        # docstring inherited: never (supports_list is False)
        raise InvalidRequestError(
            f"backend {self.name!r} ({self.config.url}) is served over HTTP and cannot be "
            f"listed (asked for {shown(prefix)}); name its keys instead (a dataset is "
            "registered from a file of keys: chunkd dataset register --keys FILE)"
        )
        yield []  # type: ignore[unreachable]  # an async generator
