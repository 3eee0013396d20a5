"""What the cloud kinds (``s3://``, ``gs://``, ``az://``) share: a bucket in the URL,
and credentials and endpoints checked alike. Declarations only: each kind's module
uses them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

from chunkd.errors import ConfigError

if TYPE_CHECKING:
    from chunkd.gateway.config.kinds.kind import Where

__all__ = ["bucket_of", "bucket_url_problem", "check_endpoint", "credentials_rules"]

_BUCKET_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def bucket_of(url: str) -> str | None:
    """The bucket (or container) of a cloud URL."""
    return urlsplit(url).netloc


def bucket_url_problem(url: str, hint: str) -> str | None:
    """What is wrong with ``SCHEME://BUCKET[/PREFIX]``; ``hint`` says how to write one."""
    parts = urlsplit(url)
    if "@" in parts.netloc:
        return (
            "has credentials in it; put them in access_key_id and secret_access_key, "
            "and write the URL like 's3://bucket/prefix'"
        )
    if not parts.netloc:
        return f"has no bucket; {hint}"
    if not _BUCKET_RE.fullmatch(parts.netloc):
        return f"has {parts.netloc!r}, not a bucket name; {hint}"
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return "has a query or fragment; give options as keys of the backend instead"
    if ".." in parts.path.split("/"):
        return "has '..' in its prefix; write the prefix without it"
    return None


def credentials_rules(values: Mapping[str, Any], where: Where, *, account_alone: bool) -> None:
    """Credentials go in pairs (``account_alone``: an access key id alone is whole, as
    an az:// account is), a session token with them; a plain http endpoint needs
    ``allow_http``."""
    has_id = values.get("access_key_id") is not None
    has_secret = values.get("secret_access_key") is not None
    if has_id != has_secret and not (account_alone and has_id):
        present, missing = (
            ("access_key_id", "secret_access_key")
            if has_id
            else ("secret_access_key", "access_key_id")
        )
        raise ConfigError(
            f"{where(present)} is set but {missing} is not; set both, or neither to use "
            "the credentials of the machine (instance role, provider environment)"
        )
    if values.get("session_token") is not None and not has_id:
        raise ConfigError(
            f"{where('session_token')} is set without access_key_id and secret_access_key; "
            "a session token goes with them: set all three"
        )
    check_endpoint(values, where)


def check_endpoint(values: Mapping[str, Any], where: Where) -> None:
    """A plain http endpoint needs ``allow_http``."""
    endpoint = values.get("endpoint")
    if (
        isinstance(endpoint, str)
        and urlsplit(endpoint).scheme == "http"
        and not values.get("allow_http")
    ):
        raise ConfigError(
            f"{where('endpoint')} = {endpoint!r} is plain http, but allow_http is false; "
            "set allow_http = true for this backend, or use https"
        )
