"""``https://host/path`` (and ``http://``): files served over HTTP, read-only and unlisted.

Dataset mirrors, a static file server, a model hub's resolve URLs: obstore's
``HTTPStore`` over the backend's URL, every key below it (``allow_http = true`` for
a plain ``http://`` URL). Reads are ranged GETs, pinned with ``If-Match`` as on S3;
a HEAD answers the size and the version.

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

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from obstore.store import HTTPStore

from chunkd.errors import (
    InvalidRequestError,
    ReadOnlyBackendError,
    UnversionedObjectError,
)
from chunkd.gateway.backends.base import SCAN_BATCH
from chunkd.gateway.backends.store import StoreBackend, client_options, no_retries, shown

if TYPE_CHECKING:
    from chunkd.gateway.backends.meta import ObjectMeta
    from chunkd.gateway.config import BackendConfig

__all__ = ["HTTPBackend"]


class HTTPBackend(StoreBackend):
    """Files below one URL of an HTTP server."""

    @classmethod
    def make_store(cls, config: BackendConfig) -> Any:
        # docstring inherited
        base = config.url if config.url.endswith("/") else f"{config.url}/"
        return HTTPStore.from_url(
            base, client_options=client_options(config), retry_config=no_retries(config)
        )

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
