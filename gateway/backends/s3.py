"""``s3://bucket/prefix``: Amazon S3 or an S3-compatible service (MinIO, Ceph, moto).

Config keys: ``endpoint`` (path-style requests to it), ``region``,
``access_key_id`` + ``secret_access_key`` (+ ``session_token``); none of them set:
the machine's credentials (environment, instance role), as the AWS SDKs find them.

A streamed write (:meth:`S3Backend.put_stream`) of an object larger than one part is a
multipart upload whose CompleteMultipartUpload carries ``If-None-Match: *``: S3 makes
the object only where none is (412 otherwise), so an object is never overwritten.
obstore has no such call (its ``put(mode="create")`` sends one PUT of the whole input,
and its multipart upload takes no condition), so these four requests are made here,
signed with AWS Signature Version 4. Each part is :func:`part_bytes` (8 MiB, more for
an object over 80 GB: S3 takes 10,000 parts), the one buffer held; the upload is
aborted on any failure (and when the object is found there at the end). This needs
the access key in the backend's entry or in the environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``); with the machine's other
credentials (an instance role) a streamed write is put whole, at most
:data:`~chunkd.gateway.backends.base.SINGLE_PUT_BYTES`.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import hmac
import logging
import os
import re
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import quote, urlsplit
from xml.sax.saxutils import escape

import aiohttp
import yarl
from obstore.store import S3Store

from chunkd.errors import (
    BackendForbiddenError,
    BackendUnavailableError,
    BucketNotFoundError,
    InvalidRequestError,
)
from chunkd.gateway.backends.base import gather_stream, stream_size_error
from chunkd.gateway.backends.store import StoreBackend, cloud_store, shown
from chunkd.gateway.costs import charge

if TYPE_CHECKING:
    from chunkd.gateway.config import BackendConfig
    from chunkd.gateway.metrics import Metrics

__all__ = ["PART_BYTES", "S3Backend", "part_bytes"]

log = logging.getLogger("chunkd.gateway.backends")

#: S3 keys are at most 1024 bytes of UTF-8, the prefix included
_NAME_BYTES: Final = 1024
#: the part size of a streamed write (S3 takes parts of 5 MiB or more, the last aside)
PART_BYTES: Final = 8 << 20
#: parts one multipart upload may have
_MAX_PARTS: Final = 10_000
#: the largest object S3 holds
_MAX_OBJECT: Final = 5 << 40
_UNSIGNED: Final = "UNSIGNED-PAYLOAD"
#: a request body is sent in slices of this size
_SLICE_BYTES: Final = 256 << 10
_UPLOAD_ID: Final = re.compile(rb"<UploadId>([^<]+)</UploadId>")
_ERROR_CODE: Final = re.compile(rb"<Code>([^<]+)</Code>")


def part_bytes(size: int) -> int:
    """The part size of a streamed write of ``size`` bytes: :data:`PART_BYTES`, or
    more (whole MiB) where 10,000 parts of it would not hold the object."""
    needed = -(-size // _MAX_PARTS)
    return max(PART_BYTES, -(-needed // (1 << 20)) << 20)


@dataclass(frozen=True, slots=True)
class _Signer:
    """Signs S3 requests (AWS Signature Version 4) for one bucket."""

    access_key: str
    secret_key: str
    token: str | None
    region: str
    scheme: str
    netloc: str
    #: the URL path of the bucket's root, ending in "/" (path-style: with the bucket)
    root: str

    def url_and_headers(
        self, method: str, key: str, query: dict[str, str], payload_hash: str
    ) -> tuple[yarl.URL, dict[str, str]]:
        now = datetime.datetime.now(datetime.UTC)
        stamp = now.strftime("%Y%m%dT%H%M%SZ")
        day = stamp[:8]
        path = self.root + quote(key, safe="/-_.~")
        canonical_query = "&".join(
            f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(query.items())
        )
        headers = {
            "host": self.netloc,
            "x-amz-content-sha256": payload_hash,
            "x-amz-date": stamp,
        }
        if self.token:
            headers["x-amz-security-token"] = self.token
        return yarl.URL(
            f"{self.scheme}://{self.netloc}{path}" + (f"?{canonical_query}" if query else ""),
            encoded=True,
        ), self._signed(method, path, canonical_query, headers, payload_hash, stamp, day)

    def _signed(
        self,
        method: str,
        path: str,
        canonical_query: str,
        headers: dict[str, str],
        payload_hash: str,
        stamp: str,
        day: str,
    ) -> dict[str, str]:
        names = sorted(headers)
        request = "\n".join(
            [
                method,
                path,
                canonical_query,
                "".join(f"{n}:{headers[n]}\n" for n in names),
                ";".join(names),
                payload_hash,
            ]
        )
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(
            ["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(request.encode()).hexdigest()]
        )
        key = f"AWS4{self.secret_key}".encode()
        for part in (day, self.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        return headers | {
            "authorization": f"AWS4-HMAC-SHA256 Credential={self.access_key}/{scope}, "
            f"SignedHeaders={';'.join(names)}, Signature={signature}"
        }


def _signer(config: BackendConfig) -> _Signer | None:
    """The signer of ``config``'s streamed writes: None without an access key in the
    entry or the environment."""
    env = os.environ
    if config.access_key_id and config.secret_access_key is not None:
        access, secret = config.access_key_id, config.secret_access_key.reveal()
        token = config.session_token.reveal() if config.session_token is not None else None
    elif env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        access, secret = env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
        token = env.get("AWS_SESSION_TOKEN") or None
    else:
        return None
    region = config.region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
    bucket = config.bucket or ""
    if config.endpoint:
        parts = urlsplit(config.endpoint)
        root = f"{parts.path.rstrip('/')}/{quote(bucket, safe='-_.~')}/"
        scheme, netloc = parts.scheme, parts.netloc
    else:
        scheme, netloc, root = "https", f"{bucket}.s3.{region}.amazonaws.com", "/"
    return _Signer(access, secret, token, region, scheme, netloc, root)


async def _slices(body: bytes | bytearray) -> AsyncIterator[memoryview]:
    view = memoryview(body)
    for start in range(0, view.nbytes, _SLICE_BYTES):
        yield view[start : start + _SLICE_BYTES]


class _Refused(Exception):
    """An S3 answer other than the one asked for (status, code)."""

    def __init__(self, status: int, code: str) -> None:
        super().__init__(f"HTTP {status} {code}")
        self.status = status
        self.code = code


class S3Backend(StoreBackend):
    """An S3 bucket (or a prefix of one)."""

    def __init__(self, config: BackendConfig, metrics: Metrics, store: Any = None) -> None:
        super().__init__(config, metrics, store)
        self._signer = _signer(config)
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def make_store(cls, config: BackendConfig) -> Any:
        # docstring inherited
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
        return cloud_store(S3Store, config, **kwargs)

    def name_limit(self, name: str) -> tuple[str, int, int, str] | None:
        # docstring inherited
        return "S3 keys", _NAME_BYTES, len(name.encode("utf-8", "surrogatepass")), "bytes"

    # -- streamed writes --------------------------------------------------------------

    @property
    def streams_conditional_put(self) -> bool:
        # docstring inherited
        return self._signer is not None

    @property
    def single_put_bytes(self) -> int:
        # docstring inherited
        return _MAX_OBJECT if self._signer is not None else super().single_put_bytes

    def held_by_put(self, size: int) -> int:
        # docstring inherited: one part
        return min(size, part_bytes(size)) if self._signer is not None else size

    async def put_stream(
        self, key: str, pieces: AsyncIterable[bytes | memoryview], *, size: int
    ) -> bool:
        # docstring inherited
        if self._signer is None:
            return await super().put_stream(key, pieces, size=size)
        self.check_writable()
        name = f"{self.name}/{key}"
        if size > _MAX_OBJECT:
            raise InvalidRequestError(
                f"cannot write {name} ({size} bytes): S3 objects are at most {_MAX_OBJECT} bytes"
            )
        part = part_bytes(size)
        if size <= part:  # one request, the object held once
            data = await gather_stream(pieces, size, name)
            return await self.put(key, memoryview(data), if_absent=True)
        upload = await self._call("put", key, lambda: self._create_upload(key))
        finished = False
        try:
            etags: list[str] = []
            buffer = bytearray()
            written = 0
            async for piece in pieces:
                view = memoryview(piece).cast("B")
                if written + view.nbytes > size:
                    raise stream_size_error(name, size, written + view.nbytes)
                written += view.nbytes
                while view.nbytes:
                    take = min(part - len(buffer), view.nbytes)
                    buffer += view[:take]
                    view = view[take:]
                    if len(buffer) == part:
                        etags.append(await self._send_part(key, upload, len(etags) + 1, buffer))
                        buffer = bytearray()
            if written != size:
                raise stream_size_error(name, size, written)
            if buffer:
                etags.append(await self._send_part(key, upload, len(etags) + 1, buffer))
            del buffer
            finished = await self._call("put", key, lambda: self._complete(key, upload, etags))
        finally:
            if not finished:  # failed, or an object is there: the parts go
                await asyncio.shield(self._abort(key, upload))
        if finished:
            self._metrics.backend_write_bytes.labels(self.name).inc(size)
            charge.backend_bytes(self.name, "write", size)
        return finished

    def _full_key(self, key: str) -> str:
        prefix = self.config.prefix
        return f"{prefix}/{key}" if prefix else key

    async def _request(
        self,
        method: str,
        key: str,
        query: dict[str, str],
        body: bytes | bytearray = b"",
        *,
        headers: dict[str, str] | None = None,
        unsigned: bool = False,
        answers: tuple[int, ...] = (),
    ) -> tuple[int, Any, bytes]:
        """One signed request about ``key``: its status, headers and body. A refusal
        is raised as the error it means (:meth:`_refusal`), unless its status is one
        of ``answers``."""
        assert self._signer is not None
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_read=self.config.timeout)
            )
        payload_hash = _UNSIGNED if unsigned else hashlib.sha256(body).hexdigest()
        url, signed = self._signer.url_and_headers(method, self._full_key(key), query, payload_hash)
        sent: dict[str, str] = {**(headers or {}), **signed}
        if body:  # in slices: aiohttp's own send of a large body would hold the loop
            sent["Content-Length"] = str(len(body))
        async with self._session.request(
            method, url, data=_slices(body) if body else None, headers=sent
        ) as response:
            got = await response.read()
            if response.status >= 300 and response.status not in answers:
                found = _ERROR_CODE.search(got)
                raise self._refusal(
                    key, _Refused(response.status, found.group(1).decode() if found else "")
                )
            return response.status, response.headers, got

    def _refusal(self, key: str, refused: _Refused) -> Exception:
        """The error an S3 refusal means (412 is left to the caller)."""
        if refused.status == 412:
            return refused
        if refused.status == 403:
            return BackendForbiddenError(
                f"backend {self.name!r} refused a write of {shown(key)}: {refused}; "
                "check the credentials configured for it"
            )
        if refused.code == "NoSuchBucket":
            return BucketNotFoundError(
                f"backend {self.name!r}: its bucket does not exist (deleted, or never "
                f"made), writing {shown(key)}; make it again, or fix the backend's url"
            )
        return BackendUnavailableError(
            f"backend {self.name!r} failed a write of {shown(key)}: {refused}"
        )

    async def _create_upload(self, key: str) -> str:
        _, _, body = await self._request("POST", key, {"uploads": ""})
        found = _UPLOAD_ID.search(body)
        if found is None:
            raise BackendUnavailableError(
                f"backend {self.name!r} started a multipart upload of {shown(key)} "
                "without naming it"
            )
        return found.group(1).decode()

    async def _send_part(self, key: str, upload: str, number: int, data: bytearray) -> str:
        async def call() -> str:
            query = {"partNumber": str(number), "uploadId": upload}
            _, headers, _ = await self._request("PUT", key, query, data, unsigned=True)
            etag = headers.get("ETag")
            if not etag:
                raise BackendUnavailableError(
                    f"backend {self.name!r} took part {number} of {shown(key)} without an ETag"
                )
            return str(etag)

        return await self._call("put", key, call)

    async def _complete(self, key: str, upload: str, etags: list[str]) -> bool:
        """Finish the upload where no object ``key`` is: False when one is (412)."""
        body = (
            "<CompleteMultipartUpload>"
            + "".join(
                f"<Part><PartNumber>{n}</PartNumber><ETag>{escape(etag)}</ETag></Part>"
                for n, etag in enumerate(etags, 1)
            )
            + "</CompleteMultipartUpload>"
        ).encode()
        try:
            _, _, answer = await self._request(
                "POST", key, {"uploadId": upload}, body, headers={"If-None-Match": "*"}
            )
        except _Refused:  # 412: an object is there
            return False
        # S3 may answer 200 and then an error document (the request is to be sent again).
        if b"<Error>" in answer:
            found = _ERROR_CODE.search(answer)
            raise BackendUnavailableError(
                f"backend {self.name!r} failed to finish the write of {shown(key)}: "
                f"{found.group(1).decode() if found else 'an error document'}"
            )
        return True

    async def _abort(self, key: str, upload: str) -> None:
        """Abort the upload (a failure is logged: a bucket lifecycle rule for
        incomplete multipart uploads is the last resort)."""
        try:
            # 404: the upload is gone already (a finish whose answer was lost, retried)
            await self._call(
                "put",
                key,
                lambda: self._request("DELETE", key, {"uploadId": upload}, answers=(404,)),
            )
        except Exception as exc:  # the write's own error (or answer) is the one given
            log.warning(
                "backend %s: could not abort the multipart upload %s of %s (%s); "
                "it holds storage until aborted",
                self.name,
                upload,
                key,
                exc,
            )

    async def close(self) -> None:
        # docstring inherited
        if self._session is not None:
            await self._session.close()
            self._session = None
        await super().close()
