"""``az://container/prefix``: Azure Blob Storage (or Azurite).

Its keys, as obstore's ``AzureConfig`` names them: ``access_key_id`` (the
``account_name``; alone, its key comes from the machine), ``secret_access_key`` (the
``account_key``), ``endpoint`` and ``allow_http``. No region, session token or
credentials file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from chunkd.gateway.config.kinds.cloud import bucket_of, bucket_url_problem, credentials_rules
from chunkd.gateway.config.kinds.kind import BackendKind, Where, path_prefix

__all__ = ["KIND"]


def _rules(values: Mapping[str, Any], where: Where) -> None:
    # An az:// account alone is whole: its key, a SAS or a managed identity comes from
    # the machine.
    credentials_rules(values, where, account_alone=True)


KIND: Final = BackendKind(
    schemes=("az",),
    io="chunkd.gateway.backends.azure:AzureBackend",
    example="az://container/prefix",
    what="an az:// backend",
    url_problem=lambda url: bucket_url_problem(url, "write it like 'az://container/prefix'"),
    prefix=path_prefix,
    bucket=bucket_of,
    keys=frozenset({"access_key_id", "secret_access_key", "endpoint", "allow_http"}),
    instead="give the account as access_key_id and its key as secret_access_key",
    rules=_rules,
)
