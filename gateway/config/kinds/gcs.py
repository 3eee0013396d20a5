"""``gs://bucket/prefix``: Google Cloud Storage (or fake-gcs-server).

Its keys, as obstore's ``GCSConfig`` names them: ``credentials_file`` (its
``service_account``), ``endpoint`` (its ``base_url``) and ``allow_http``. Cloud
Storage's JSON API has no access key pair and the client names no region.
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
    schemes=("gs",),
    io="chunkd.gateway.backends.gcs:GCSBackend",
    example="gs://bucket",
    what="a gs:// backend",
    url_problem=lambda url: bucket_url_problem(url, "write it like 'gs://bucket/prefix'"),
    prefix=path_prefix,
    bucket=bucket_of,
    keys=frozenset({"credentials_file", "endpoint", "allow_http"}),
    instead="give a service-account JSON file as credentials_file, or none for the "
    "machine's credentials (HMAC keys go with s3:// and "
    "endpoint = 'https://storage.googleapis.com')",
    rules=_rules,
)
