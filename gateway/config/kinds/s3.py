"""``s3://bucket/prefix``: Amazon S3 or an S3-compatible service (MinIO, Ceph, moto).

Its keys, as obstore's ``S3Config`` names them: ``endpoint`` (path-style requests to
it), ``region``, ``access_key_id`` + ``secret_access_key`` (+ ``session_token``), and
``allow_http`` for a plain http endpoint. None of the credentials: the machine's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from chunkd.gateway.config.kinds.cloud import bucket_of, bucket_url_problem, credentials_rules
from chunkd.gateway.config.kinds.kind import BackendKind, Where, path_prefix

__all__ = ["KIND"]


def _rules(values: Mapping[str, Any], where: Where) -> None:
    credentials_rules(values, where, account_alone=False)


KIND: Final = BackendKind(
    schemes=("s3",),
    io="chunkd.gateway.backends.s3:S3Backend",
    example="s3://bucket/prefix",
    what="an s3:// backend",
    url_problem=lambda url: bucket_url_problem(url, "write it like 's3://bucket/prefix'"),
    prefix=path_prefix,
    bucket=bucket_of,
    keys=frozenset(
        {"endpoint", "region", "access_key_id", "secret_access_key", "session_token", "allow_http"}
    ),
    instead="give access_key_id and secret_access_key, or none for the machine's credentials",
    rules=_rules,
)
