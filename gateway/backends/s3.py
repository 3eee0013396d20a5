"""``s3://bucket/prefix``: Amazon S3 or an S3-compatible service (MinIO, Ceph, moto).

Config keys: ``endpoint`` (path-style requests to it), ``region``,
``access_key_id`` + ``secret_access_key`` (+ ``session_token``); none of them set:
the machine's credentials (environment, instance role), as the AWS SDKs find them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from obstore.store import S3Store

from chunkd.gateway.backends.store import StoreBackend, cloud_store, refuse_keys

if TYPE_CHECKING:
    from chunkd.gateway.config import BackendConfig

__all__ = ["S3Backend"]

#: S3 keys are at most 1024 bytes of UTF-8, the prefix included
_NAME_BYTES: Final = 1024


class S3Backend(StoreBackend):
    """An S3 bucket (or a prefix of one)."""

    @classmethod
    def make_store(cls, config: BackendConfig) -> Any:
        # docstring inherited
        refuse_keys(
            config,
            ("credentials_file",),
            "an s3:// backend",
            "give access_key_id and secret_access_key, or none for the machine's credentials",
        )
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
