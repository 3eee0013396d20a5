"""The S3 front's door: S3 requests in, the read path and the listings behind.

Path-style addressing on a port of its own (``[s3_front] listen``)::

    GET  /                          ListBuckets: the configured backends
    HEAD /BUCKET                    HeadBucket
    GET  /BUCKET?location           GetBucketLocation
    GET  /BUCKET?list-type=2&...    ListObjectsV2 (prefix, delimiter, continuation-token,
                                    start-after, max-keys, fetch-owner, encoding-type)
    GET  /BUCKET?prefix=...         ListObjects (v1: marker, prefix, delimiter, max-keys)
    HEAD /BUCKET/KEY                HeadObject
    GET  /BUCKET/KEY                GetObject: Range, If-Range, If-Match, If-None-Match,
                                    If-Modified-Since, If-Unmodified-Since, partNumber,
                                    response-*

Each request is checked in this order: the header section's size, the signature
(:mod:`chunkd.gateway.s3front.sigv4`; unsigned ones only from loopback, only with
``unsigned_from_loopback``, and only under the front's own names and not from a page of
another site: the HTTP port's rule against DNS rebinding), the bucket (a configured
backend: the allowlist), the operation, the key. Writes are refused: ``AccessDenied``
under chunkd's own prefixes (``chunks/``, ``checkpoints/``, ``intents/``, the dataset
registry), ``NotImplemented`` elsewhere (with status 405, so that no client takes it for
a server fault to retry).

A key chunkd cannot hold (``dir/``, ``a//b``, ``..``) is a key no object has: GET
answers ``NoSuchKey`` and HEAD a bare 404, as S3 does for a missing key, never 400.
Listings leave such keys out, and an object that obstore names without its trailing
``/`` (``dir/`` holding bytes, listed as ``dir``) is checked with a HEAD where the page
gives cause (:meth:`S3Front._as_named`), so what a listing shows, a GET finds (docs/s3.md
says where it cannot tell).

Every answer carries ``x-amz-request-id`` (also in the log line of a failure); the
front never redirects.

It is one job at ~630 lines: the door, from a request as it arrives to its operation's
answer (the checks in the order above, then ListBuckets, the bucket operations, a
listing's pages with their tokens and name checks, GetObject and HeadObject), and the
answer to what the HTTP parser refuses, in the same XML. What stands apart is in the
rooms beside it: the signatures (:mod:`~chunkd.gateway.s3front.sigv4`), an object's
conditions (:mod:`~chunkd.gateway.s3front.conditions`), the documents
(:mod:`~chunkd.gateway.s3front.xml`) and the error codes
(:mod:`~chunkd.gateway.s3front.errors`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import bisect
import email.utils
import logging
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import unquote

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from multidict import MultiDict

from chunkd.errors import (
    BackendError,
    ChunkdError,
    InvalidKeyError,
    InvalidRangeError,
    InvalidRequestError,
    ObjectNotFoundError,
    ReservedKeyError,
)
from chunkd.gateway.appkeys import READ_PATH, STREAMING
from chunkd.gateway.config.addresses import is_loopback
from chunkd.gateway.connections import GuardedHandler, GuardedRunner, HeadLimits, head_too_large
from chunkd.gateway.costs import charge
from chunkd.gateway.costs.attribution import ATTRIBUTION
from chunkd.gateway.costs.headers import attribution_of
from chunkd.gateway.costs.ledger import Ledger
from chunkd.gateway.dashboard.session import browser_refusal
from chunkd.gateway.names import validate_key
from chunkd.gateway.objectbody import etag_of, quoted_etag, reading_of, send_object
from chunkd.gateway.reserved import ReservedPrefixes
from chunkd.gateway.s3front import xml
from chunkd.gateway.s3front.conditions import check_conditions, range_applies
from chunkd.gateway.s3front.errors import S3Error, s3_error, s3_error_of
from chunkd.gateway.s3front.keys import AccessKeys
from chunkd.gateway.s3front.querystring import decoded_query
from chunkd.gateway.s3front.sigv4 import SigV4Verifier
from chunkd.ranges import RequestRange, parse_range

if TYPE_CHECKING:
    from chunkd.gateway.backends import Backends
    from chunkd.gateway.config import Config
    from chunkd.gateway.listing import ListEntry, Listings
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.readpath import ReadPath, Stat

__all__ = ["S3Front", "S3FrontRunner"]

log = logging.getLogger("chunkd.gateway.s3front")

#: S3's own bound on a request's header section (aiohttp's parser refuses one header
#: line past it; the front refuses a section past it; both in XML)
MAX_HEADER_BYTES: Final = 8192
#: the longest start-after, marker (a key) or continuation token taken
_MAX_AFTER_BYTES: Final = 1024
_MAX_TOKEN_CHARS: Final = 2048
#: S3's cap on one listing page
MAX_KEYS: Final = 1000
#: HEADs at once that tell an object from one obstore named without its trailing "/"
_NAME_CHECKS: Final = 16
#: subresources of a bucket or an object the front does not serve
_UNSERVED: Final = frozenset(
    {
        "accelerate", "acl", "analytics", "attributes", "cors", "delete", "encryption",
        "intelligent-tiering", "inventory", "legal-hold", "lifecycle", "logging",
        "metrics", "notification", "object-lock", "ownershipControls", "policy",
        "policyStatus", "publicAccessBlock", "replication", "requestPayment", "restore",
        "retention", "select", "tagging", "torrent", "uploadId", "uploads", "versioning",
        "versions", "website",
    }
)  # fmt: skip
#: the response-* query overrides of GetObject, and the header each one sets
_OVERRIDES: Final = {
    "response-content-type": "Content-Type",
    "response-content-language": "Content-Language",
    "response-expires": "Expires",
    "response-cache-control": "Cache-Control",
    "response-content-disposition": "Content-Disposition",
    "response-content-encoding": "Content-Encoding",
}
_TOKEN_MARK: Final = b"chunkd1:"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class S3Front:
    """The S3 front over one node's read path and listings. See the module docstring.

    Args:
        config: the daemon's config (``[s3_front]``, and ``[datasets]`` for the
            registry's prefix that writes may not touch).
        read_path: the node's read path: single flight, tiers, peers.
        listings: the node's listings, in pages.
        backends: the configured backends: the buckets.
        metrics: ``chunkd_s3_requests_total`` and the read counters.
        keys: the front's access keys (made from ``config`` when not given).
        ledger: the node's cost ledger, which a request's reads are charged to (the
            job in its ``X-Chunkd-Job`` header; a bad one is refused); None: none.

    Raises:
        ConfigError: the access keys cannot be read (see :class:`AccessKeys`).
    """

    def __init__(
        self,
        config: Config,
        *,
        read_path: ReadPath,
        listings: Listings,
        backends: Backends,
        metrics: Metrics,
        keys: AccessKeys | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        self.config = config.s3_front
        self.ledger = ledger
        self.read_path = read_path
        self.listings = listings
        self.backends = backends
        self.metrics = metrics
        self.keys = keys if keys is not None else AccessKeys(self.config)
        self.verifier = SigV4Verifier(
            self.keys, max_skew=self.config.max_skew, sigv2_allowed=self.config.sigv2
        )
        self.started = time.time()
        self._reserved = ReservedPrefixes(config.datasets.registry, config.backends)

    def build_app(self) -> web.Application:
        """The front's aiohttp application: one route, every method, every path."""
        app = web.Application(middlewares=[self._answer_errors, self._attribute])
        app[READ_PATH] = self.read_path  # what send_object streams from
        app.router.add_route("*", r"/{path:[\s\S]*}", self._dispatch)
        return app

    # -- the edge --------------------------------------------------------------------

    @web.middleware
    async def _attribute(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # The job the request's reads are charged to (X-Chunkd-Job; a bad one is refused
        # as InvalidArgument, 400).
        try:
            attribution = attribution_of(request.headers, self.ledger)
        except InvalidRequestError as exc:
            raise s3_error("InvalidArgument", str(exc)) from None
        token = ATTRIBUTION.set(attribution)
        try:
            return await handler(request)
        finally:
            ATTRIBUTION.reset(token)

    @web.middleware
    async def _answer_errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        request_id = secrets.token_hex(8).upper()
        request["s3_request_id"] = request_id
        request["s3_op"] = "Unknown"
        try:
            response = await handler(request)
        except web.HTTPException as exc:  # aiohttp's own, before a handler ran
            if exc.status < 400:
                raise
            failure = s3_error("InvalidRequest", exc.reason)
        except ChunkdError as exc:
            if request.get(STREAMING):
                log.warning(
                    "S3 %s %s failed mid-body (request %s): %s",
                    request.method,
                    request.path,
                    request_id,
                    exc,
                )
                raise  # the headers are out: aiohttp cuts the connection short
            failure = s3_error_of(exc, bucket=request.get("s3_bucket", ""), key=None)
            if failure.status >= 500 or isinstance(exc, BackendError):
                # What the backend said stays in the log: the answer names no endpoint.
                log.warning(
                    "S3 %s %s: %s (request %s)", request.method, request.path, exc, request_id
                )
        except Exception as exc:  # a fault of ours: logged whole, answered as S3 would
            if request.get(STREAMING):
                raise
            log.exception("S3 %s %s failed (request %s)", request.method, request.path, request_id)
            failure = s3_error("InternalError", f"chunkd failed: {type(exc).__name__}")
        else:
            response.headers["x-amz-request-id"] = request_id
            self.metrics.s3_requests.labels(request["s3_op"], "OK").inc()
            return response
        self.metrics.s3_requests.labels(request["s3_op"], failure.code).inc()
        return error_response(failure, request_id, head=request.method == "HEAD")

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        raw_path, _, raw_query = request.raw_path.partition("?")
        if sum(len(k) + len(v) + 4 for k, v in request.raw_headers) > MAX_HEADER_BYTES:
            raise s3_error(
                "RequestHeaderSectionTooLarge",
                f"Your request header section exceeds the maximum size ({MAX_HEADER_BYTES} bytes)",
            )
        identity = self.verifier.verify(request.method, raw_path, raw_query, request.headers)
        if identity is None:
            self._admit_unsigned(request)
        raw_bucket, _, raw_key = raw_path.lstrip("/").partition("/")
        # The parameters as the signature check read them: one reading for both.
        query = request["s3_query"] = MultiDict(decoded_query(raw_query))
        method = request.method
        if not raw_bucket:
            if method != "GET":
                raise _not_allowed(method, "the service")
            request["s3_op"] = "ListBuckets"
            return self._xml(xml.bucket_list((b.name for b in self.backends), self.started))
        if not raw_key and method in ("PUT", "POST", "DELETE"):
            request["s3_op"] = "BucketWrite"
            raise s3_error(
                "NotImplemented",
                "chunkd's S3 front serves the configured backends as they are; buckets "
                "are made, changed and removed in the config",
            )
        bucket = _unquoted(raw_bucket) or "\0"  # undecodable: no backend has that name
        request["s3_bucket"] = bucket
        backend = self.backends.get(bucket)  # UnknownBackendError: NoSuchBucket
        if not raw_key:  # the bucket itself
            return await self._bucket(request, backend.name, method)
        key = _unquoted(raw_key) or ""  # undecodable: no object has that key
        if method in ("PUT", "POST", "DELETE"):
            request["s3_op"] = {"PUT": "PutObject", "POST": "PostObject"}.get(
                method, "DeleteObject"
            )
            raise self._refused_write(backend.name, key)
        if method not in ("GET", "HEAD"):
            raise _not_allowed(method, "an object")
        unserved = _UNSERVED.intersection(query)
        if unserved:
            raise s3_error(
                "NotImplemented", f"chunkd's S3 front does not serve ?{min(unserved)} on objects"
            )
        request["s3_op"] = "GetObject" if method == "GET" else "HeadObject"
        if query.get("versionId", "null") != "null":
            # Served as the current version, it could be other bytes than those asked for.
            raise s3_error(
                "NotImplemented",
                "chunkd's S3 front serves the current version of an object only (versionId "
                "'null'); read older versions from the backend itself",
            )
        return await self._object(request, backend.name, key)

    def _admit_unsigned(self, request: web.Request) -> None:
        """Let an unsigned request in, or raise ``AccessDenied`` saying why not.

        Unsigned requests come from this host only, with ``unsigned_from_loopback``,
        and only as the HTTP port takes a loopback client's: under one of the front's
        own names, and not sent by a page of another site. A page whose name was made
        to point at 127.0.0.1 (DNS rebinding) sends its own name as ``Host``, and a
        browser sends no ``Sec-Fetch-*`` headers to such a plain-HTTP origin, so every
        unsigned request is checked. A signed request is not: its signature binds the
        host it was made for, and no page holds the secret.
        """
        if not (self.config.unsigned_from_loopback and is_loopback(request.remote)):
            raise s3_error(
                "AccessDenied",
                "Anonymous access is refused: sign the request (SigV4, or SigV2) with an "
                "access key of [s3_front] (unsigned requests are answered from this host "
                "only, with unsigned_from_loopback = true)",
            )
        refusal = browser_refusal(request, loopback=True, listen=self.config.listen or "")
        if refusal is not None:
            raise s3_error(
                "AccessDenied",
                f"An unsigned request is refused: {refusal}. Sign the request (SigV4, or "
                "SigV2) with an access key of [s3_front]: a signed request is served "
                "under any Host",
            )

    def _xml(self, body: bytes, status: int = 200) -> web.Response:
        return web.Response(body=body, status=status, content_type="application/xml")

    def _refused_write(self, bucket: str, key: str) -> S3Error:
        # Every write is refused; the one rule for chunkd's own prefixes picks the error.
        try:
            self._reserved.check(bucket, key, door="the S3 front")
        except ReservedKeyError as exc:
            return s3_error("AccessDenied", f"{exc}: the S3 front never writes there")
        return s3_error(
            "NotImplemented",
            "chunkd's S3 front serves reads; write through the backend itself, or save "
            "checkpoints with chunkd.client.checkpoint",
        )

    # -- buckets ---------------------------------------------------------------------

    async def _bucket(self, request: web.Request, bucket: str, method: str) -> web.StreamResponse:
        query = request["s3_query"]
        if method == "HEAD":
            request["s3_op"] = "HeadBucket"
            return web.Response(headers={"x-amz-bucket-region": self.config.region})
        if method != "GET":
            raise _not_allowed(method, "a bucket")
        if "location" in query:
            request["s3_op"] = "GetBucketLocation"
            return self._xml(xml.location(self.config.region))
        unserved = _UNSERVED.intersection(query)
        if unserved:
            request["s3_op"] = "Bucket" + min(unserved).capitalize()
            raise s3_error(
                "NotImplemented", f"chunkd's S3 front does not serve ?{min(unserved)} on buckets"
            )
        list_type = query.get("list-type")
        if list_type == "2":
            request["s3_op"] = "ListObjectsV2"
            return await self._list_v2(request, bucket)
        if list_type is not None:
            raise s3_error("InvalidArgument", f"list-type must be 2 (or absent); got {list_type!r}")
        request["s3_op"] = "ListObjects"
        return await self._list_v1(request, bucket)

    async def _list_v2(self, request: web.Request, bucket: str) -> web.Response:
        query = request["s3_query"]
        token = query.get("continuation-token")
        start_after = _key_param(query, "start-after")
        after = start_after if token is None else _decode_token(token)
        page = await self._page(bucket, query, after)
        body = xml.listing_v2(
            page,
            continuation=token,
            next_continuation=None if page.after is None else _encode_token(page.after),
            start_after=start_after,
            owner=query.get("fetch-owner", "false").lower() == "true",
        )
        return self._xml(body)

    async def _list_v1(self, request: web.Request, bucket: str) -> web.Response:
        query = request["s3_query"]
        marker = _key_param(query, "marker") or ""
        page = await self._page(bucket, query, marker or None)
        return self._xml(xml.listing_v1(page, marker=marker))

    async def _page(self, bucket: str, query: Any, after: str | None) -> xml.Listing:
        """One page of an S3 listing of ``bucket`` after ``after``, as ``query`` asks."""
        prefix, delimiter, max_keys, url = _listing_params(query)
        contents: list[xml.Content] = []
        prefixes: list[str] = []
        if max_keys == 0:
            return xml.Listing(bucket, prefix, delimiter, 0, contents, prefixes, None, url)
        charge.direct(bucket, "list")  # without chunkd: one LIST a page
        try:
            page = await self.listings.page_of(
                bucket, prefix, delimiter=delimiter, start_after=after, limit=max_keys
            )
        except InvalidKeyError as exc:  # a key in the backend it cannot list past
            raise s3_error("InternalError", str(exc)) from exc
        for entry in await self._as_named(bucket, page.entries, more=page.next is not None):
            if entry.type == "directory":
                prefixes.append(f"{entry.key}{delimiter}")
            elif _holdable(entry.key):
                etag = quoted_etag(entry.version or "")
                contents.append(xml.Content(entry.key, entry.size, etag, entry.modified or 0.0))
        return xml.Listing(bucket, prefix, delimiter, max_keys, contents, prefixes, page.next, url)

    async def _as_named(
        self, bucket: str, entries: Sequence[ListEntry], *, more: bool
    ) -> list[ListEntry]:
        """``entries`` without an object listed under a name it does not have.

        S3 keys may end in ``/`` and hold bytes (``dir/``), and object_store, under
        every cloud backend, names such an object without its ``/``: ``dir``, a key no
        object has (or the key of another object: ``both`` and ``both/`` list as
        ``both`` twice). A listing would show a key a GET cannot find. Such a name has
        the keys under ``dir/`` next to it, in the page; so each object entry that
        has, or that is listed twice, is asked for with a HEAD through the read path
        (its version kept, so a later listing or GET asks again only as the backend's
        ``revalidate`` says), at most :data:`_NAME_CHECKS` at once: one that is not
        there goes, and of two entries of one name the one of the version there stays.
        The keys under the last object of a page that ``more`` follows may be on the
        next page, so that object is asked for too. A file and a folder of one name are
        rare in data: a page costs a HEAD for each such pair, and one for its last key.
        """
        tokens = sorted(entry.token for entry in entries)
        named = Counter(entry.key for entry in entries if entry.type == "file")
        last = entries[-1].key if more and entries and entries[-1].type == "file" else None
        doubtful = sorted(
            key
            for key, count in named.items()
            if _holdable(key) and (count > 1 or key == last or _has_keys_under(tokens, key))
        )
        if not doubtful:
            return list(entries)
        limit = asyncio.Semaphore(_NAME_CHECKS)

        async def version_of(key: str) -> str | None:
            async with limit:
                try:
                    return (await self.read_path.stat(bucket, key)).meta.version
                except ObjectNotFoundError:
                    return None

        versions = await asyncio.gather(*map(version_of, doubtful))
        # Of each doubtful name, the entry of the version there (or, when the object
        # changed since it was listed, the first entry, as the listing said); none of
        # a name that is not there.
        keep: set[int] = set()
        for key, version in zip(doubtful, versions, strict=True):
            if version is None:
                continue
            same = [e for e in entries if e.type == "file" and e.key == key]
            keep.add(id(next((e for e in same if e.version == version), same[0])))
        chosen = set(doubtful)
        return [
            entry
            for entry in entries
            if entry.type != "file" or entry.key not in chosen or id(entry) in keep
        ]

    # -- objects ---------------------------------------------------------------------

    async def _object(self, request: web.Request, bucket: str, key: str) -> web.StreamResponse:
        query = request["s3_query"]
        if not _holdable(key):
            raise s3_error("NoSuchKey", "The specified key does not exist.")
        started = time.perf_counter()
        stat = await self.read_path.stat(bucket, key, reading=reading_of(request))
        if request.method == "HEAD":
            charge.direct(bucket, "head")  # without chunkd: one HEAD
        part = query.get("partNumber")
        if part is not None and part != "1":
            raise s3_error(
                "InvalidPartNumber" if part.isdigit() else "InvalidArgument",
                "The requested partnumber is not satisfiable (objects here have one part)",
            )
        headers = _object_headers(stat)
        for name, header in _OVERRIDES.items():
            if name in query:
                headers[header] = _header_value(name, query[name])
        check_conditions(request.headers, stat, headers)
        try:
            wanted: RequestRange | None = parse_range(request.headers.get("Range"))
        except InvalidRangeError:
            wanted = None  # S3 serves the whole object for a Range it cannot read
        if not range_applies(request.headers.get("If-Range"), headers["ETag"], stat):
            wanted = None
        response, served = await send_object(request, stat, headers=headers, byte_range=wanted)
        if request.method == "GET":
            self.metrics.read_seconds.observe(time.perf_counter() - started)
            self.metrics.read_bytes.labels("s3").inc(served)
        return response


# -- the parts of a request ----------------------------------------------------------


def _listing_params(query: Any) -> tuple[str, str | None, int, bool]:
    """(prefix, delimiter, max-keys, encoding-type=url) of a listing request."""
    prefix = query.get("prefix", "")
    delimiter = query.get("delimiter") or None
    text = query.get("max-keys", str(MAX_KEYS))
    if not (text.isascii() and text.isdigit()) or len(text) > 10:
        raise s3_error("InvalidArgument", f"max-keys must be a whole number; got {text!r}")
    encoding = query.get("encoding-type")
    if encoding not in (None, "url"):
        raise s3_error(
            "InvalidArgument", f"Invalid Encoding Method specified in Request: {encoding!r}"
        )
    for name, value in (("prefix", prefix), ("delimiter", delimiter or "")):
        if len(value.encode("utf-8", "surrogatepass")) > 1024:
            raise s3_error("InvalidArgument", f"{name} is longer than a key can be")
    return prefix, delimiter, min(int(text), MAX_KEYS), encoding == "url"


def _key_param(query: Any, name: str) -> str | None:
    """A listing parameter that is a key (``start-after``, ``marker``), bounded."""
    value: str | None = query.get(name) or None
    if value is not None and len(value.encode("utf-8", "surrogatepass")) > _MAX_AFTER_BYTES:
        raise s3_error("InvalidArgument", f"{name} is longer than a key can be")
    return value


def _encode_token(after: str) -> str:
    raw = _TOKEN_MARK + after.encode("utf-8", "surrogatepass")
    return base64.urlsafe_b64encode(raw).decode()


def _decode_token(token: str) -> str:
    if len(token) > _MAX_TOKEN_CHARS:
        raise s3_error("InvalidArgument", "The continuation token provided is incorrect")
    try:
        raw = base64.urlsafe_b64decode(token.encode("ascii"))
        after = raw[len(_TOKEN_MARK) :].decode("utf-8")
    except (ValueError, UnicodeError, binascii.Error):
        raw = b""
    if not raw.startswith(_TOKEN_MARK):
        raise s3_error("InvalidArgument", "The continuation token provided is incorrect")
    return after


def _header_value(name: str, value: str) -> str:
    """A ``response-*`` override as a header value: printable, no line breaks."""
    if len(value) > 1024 or any((c < " " and c != "\t") or "\x7f" <= c <= "\x9f" for c in value):
        raise s3_error(
            "InvalidArgument",
            f"{name} holds a control character or is too long for a header value",
        )
    return value


def _unquoted(raw: str) -> str | None:
    """A path part percent-decoded as UTF-8 (``+`` stays ``+``); None if it is not UTF-8."""
    try:
        return unquote(raw, errors="strict")
    except UnicodeDecodeError:
        return None


def _has_keys_under(tokens: Sequence[str], key: str) -> bool:
    """Whether sorted ``tokens`` (a page's keys, and its folders' with their delimiter)
    hold one under ``key/``."""
    under = f"{key}/"
    at = bisect.bisect_left(tokens, under)
    return at < len(tokens) and tokens[at].startswith(under)


def _holdable(key: str) -> bool:
    """Whether chunkd can hold ``key`` (see :func:`~chunkd.gateway.names.validate_key`)."""
    try:
        validate_key(key)
    except InvalidKeyError:
        return False
    return True


def _object_headers(stat: Stat) -> dict[str, str]:
    headers = {
        "ETag": etag_of(stat),
        "Content-Type": "binary/octet-stream",
        "Accept-Ranges": "bytes",
    }
    if stat.meta.modified:
        headers["Last-Modified"] = email.utils.formatdate(stat.meta.modified, usegmt=True)
    return headers


def _not_allowed(method: str, what: str) -> S3Error:
    return S3Error(
        "MethodNotAllowed",
        405,
        f"The specified method is not allowed against this resource ({method} on {what})",
        headers={"Allow": "GET, HEAD"},
    )


def error_response(failure: S3Error, request_id: str, *, head: bool = False) -> web.Response:
    """``failure`` as S3 answers it: XML (no body on a HEAD or a 304)."""
    headers = {"x-amz-request-id": request_id, **failure.headers}
    if head or failure.status == 304:
        return web.Response(status=failure.status, headers=headers)
    body = xml.error_document(failure.code, failure.message, request_id, failure.fields)
    return web.Response(
        status=failure.status, body=body, headers=headers, content_type="application/xml"
    )


# -- what the HTTP parser refuses ------------------------------------------------------

#: the front's request heads: S3's 8 KiB of headers, counted as they arrive
S3_HEAD: Final = HeadLimits(section=MAX_HEADER_BYTES)


class _S3RequestHandler(GuardedHandler):
    """The front's connection handler (:class:`~chunkd.gateway.connections.GuardedHandler`,
    under the daemon's connection bounds), answering what its parser refuses in S3 XML,
    not plain text: a head over its bounds (a line past 8 KiB, more than 128 headers,
    more than :data:`S3_HEAD` bytes in all) is ``RequestHeaderSectionTooLarge``, a
    ``Content-Length`` that is no length (not digits, past 2^64, given twice, or with a
    ``Transfer-Encoding``) is ``InvalidArgument``, anything else ``InvalidRequest``."""

    __slots__ = ()

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status != 400:
            return super().handle_error(request, status, exc, message)
        text = f"{message or ''} {exc or ''}".strip() or "bad request"
        if head_too_large(exc):
            failure = s3_error(
                "RequestHeaderSectionTooLarge",
                "Your request header section exceeds the maximum size",
            )
        elif "content-length" in text.lower():
            failure = s3_error(
                "InvalidArgument",
                "The Content-Length header is not a length this endpoint can read",
                fields={"ArgumentName": "Content-Length"},
            )
        else:
            failure = s3_error(
                "InvalidRequest", f"The request could not be read as HTTP: {text[:200]}"
            )
        if isinstance(exc, HttpProcessingError):
            # As the HTTP port's are: counted, a line each (rate limited), no traceback.
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        response = error_response(failure, secrets.token_hex(8).upper())
        response.force_close()
        return response


class S3FrontRunner(GuardedRunner):
    """The front's runner: a :class:`~chunkd.gateway.connections.GuardedRunner` with
    the heads of :data:`S3_HEAD` and the connection handler of :class:`_S3RequestHandler`.

    aiohttp has no public hook for how its parser's refusals are answered, so the
    server it makes is given that handler's class; ``tests/test_s3front.py`` checks
    the answer, and so an aiohttp that changes this.
    """

    handler_class = _S3RequestHandler

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, port="s3", head=S3_HEAD, **kwargs)
