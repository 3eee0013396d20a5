"""How a kind of backend declares itself: :class:`BackendKind`.

A kind's module (one per kind, beside this one) makes one :class:`BackendKind`: its
URL scheme(s), the keys of its own it takes (as obstore's per-store config types
name a store's own settings: ``S3Config``, ``GCSConfig``, ``AzureConfig``,
``HTTPStore``'s client options), the rules its URLs and keys follow, and the class
that does its I/O, named by dotted path so that config never imports the backends
(the backends' registry imports it when a backend of the kind is made).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

from chunkd.errors import ConfigError

__all__ = ["KIND_KEYS", "BackendKind", "Where", "path_prefix"]

#: ``where(key)``: how a message names the key (its file and table, or its variable)
Where = Callable[[str], str]

#: the keys a kind may take beyond those every backend has (``name``, ``url``,
#: ``writable``, ``revalidate``, ``timeout``, ``retries``, ``list_revalidate``,
#: ``stale_if_error``), as TOML names them
KIND_KEYS: Final = (
    "endpoint",
    "region",
    "access_key_id",
    "secret_access_key",
    "session_token",
    "credentials_file",
    "allow_http",
    "immutable_files",
)


def path_prefix(url: str) -> str:
    """The URL's path without leading or trailing slashes (``""`` for none)."""
    return urlsplit(url).path.strip("/")


def _no_bucket(url: str) -> str | None:
    return None


def _no_rules(values: Mapping[str, Any], where: Where) -> None:
    return None


@dataclass(frozen=True)
class BackendKind:
    """One kind of backend, as config and the backends' registry know it."""

    #: the URL schemes of the kind (``("s3",)``; ``("http", "https")``)
    schemes: tuple[str, ...]
    #: the class that does its I/O, ``"module:Class"`` (imported by the backends'
    #: registry, never by config)
    io: str
    #: a URL of the kind, as the hint of a bad URL shows it
    example: str
    #: the kind as a message names it: ``"an s3:// backend"``
    what: str
    #: what :meth:`url_problem` says is wrong with a URL of the kind, or None
    url_problem: Callable[[str], str | None]
    #: where keys start inside the backend, from its URL
    prefix: Callable[[str], str]
    #: the kind's own keys it takes (of :data:`KIND_KEYS`)
    keys: frozenset[str] = frozenset()
    #: what to give instead, when a key of another kind is set (it is refused); None:
    #: a local kind, which ignores the keys of remote stores
    instead: str | None = None
    #: the bucket (or container) of a URL of the kind; None where it has none
    bucket: Callable[[str], str | None] = _no_bucket
    #: checks across the keys of one backend of the kind (credentials in pairs, ...)
    rules: Callable[[Mapping[str, Any], Where], None] = field(default=_no_rules)
    #: whether chunkd may list it, and write it (the backends answer for themselves;
    #: config says it early: a dataset registry needs a backend that lists and writes)
    lists: bool = True
    writes: bool = True

    def check(self, values: Mapping[str, Any], where: Where) -> None:
        """The kind's checks across the keys of one backend, when the config is read.

        Raises:
            ConfigError: what is wrong, naming the key.
        """
        if not self.writes and values.get("writable"):
            raise ConfigError(
                f"{where('writable')} is true, but {self.what} is read-only; "
                "write checkpoints and datasets to another backend"
            )
        self.rules(values, where)

    def refuse_others(self, values: Mapping[str, Any], name: str) -> None:
        """Refuse the keys of other kinds set for backend ``name``, when the backend is
        made (a local kind ignores them).

        Raises:
            ConfigError: naming every such key, and what to give instead.
        """
        if self.instead is None:
            return
        refused = [
            k for k in KIND_KEYS if k not in self.keys and values.get(k) not in (None, False)
        ]
        if refused:
            raise ConfigError(
                f"backend {name!r}: {self.what} takes no {', '.join(refused)}; {self.instead}"
            )
