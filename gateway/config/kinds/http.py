"""``https://host/path`` (and ``http://``): files served over HTTP, read-only and unlisted
(a dataset mirror, a static file server, a model hub's resolve URLs).

Its keys, as obstore's ``HTTPStore`` client options name them (its I/O is its own
client's, for its redirects: ``gateway/backends/http.py``): ``allow_http`` (a
plain ``http://`` URL needs it) and ``immutable_files`` (the server's files never change:
a server without a strong ``ETag`` is read with size and ``Last-Modified`` as the
version, which it otherwise refuses). The URL is the base every key is below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import urlsplit

from chunkd.errors import ConfigError
from chunkd.gateway.config.kinds.kind import BackendKind, Where, path_prefix

__all__ = ["KIND"]

_HINT: Final = "write it like 'https://host/path'"


def _url_problem(url: str) -> str | None:
    parts = urlsplit(url)
    if "@" in parts.netloc:
        return "has credentials in it; chunkd sends none to an http(s):// backend"
    if not parts.netloc:
        return f"has no host; {_HINT}"
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return "has a query or fragment; give options as keys of the backend instead"
    if ".." in parts.path.split("/"):
        return "has '..' in its path; write the path without it"
    return None


def _rules(values: Mapping[str, Any], where: Where) -> None:
    url = str(values["url"])
    if url.lower().startswith("http://") and not values.get("allow_http"):
        raise ConfigError(
            f"{where('url')} = {url!r} is plain http, but allow_http is false; "
            "set allow_http = true for this backend, or use https"
        )


KIND: Final = BackendKind(
    schemes=("http", "https"),
    io="chunkd.gateway.backends.http:HTTPBackend",
    example="https://host/path",
    what="an http(s):// backend",
    url_problem=_url_problem,
    prefix=path_prefix,
    keys=frozenset({"allow_http", "immutable_files"}),
    instead="an http(s):// backend takes allow_http and immutable_files",
    rules=_rules,
    lists=False,
    writes=False,
)
