"""The kinds of backend, each declared in a module of its own (:class:`BackendKind`).

Config asks them: :mod:`~chunkd.gateway.config.addresses` whether a URL is right,
:mod:`~chunkd.gateway.config.schema` a backend's bucket and prefix and which keys
it takes; the backends' registry (:mod:`chunkd.gateway.backends.registry`) imports
each kind's I/O class by the dotted path it declares. Adding a kind is a module here,
its line in :data:`KINDS`, and its I/O module in :mod:`chunkd.gateway.backends`
(docs/backends.md, "Adding a kind").
"""

from __future__ import annotations

from typing import Final

from chunkd.gateway.config.kinds import azure, file, gcs, http, memory, s3
from chunkd.gateway.config.kinds.kind import KIND_KEYS, BackendKind, Where

__all__ = ["KINDS", "KIND_KEYS", "BackendKind", "Where", "kind_of", "schemes", "url_hint"]

#: every kind, in the order messages list them
KINDS: Final = (s3.KIND, gcs.KIND, azure.KIND, file.KIND, memory.KIND, http.KIND)

_BY_SCHEME: Final = {scheme: kind for kind in KINDS for scheme in kind.schemes}


def kind_of(scheme: str) -> BackendKind | None:
    """The kind of URL scheme ``scheme`` (as written: lower case), or None."""
    return _BY_SCHEME.get(scheme)


def schemes() -> tuple[str, ...]:
    """Every scheme a kind has, in :data:`KINDS`' order."""
    return tuple(_BY_SCHEME)


def url_hint() -> str:
    """How to write a backend URL, each kind's example."""
    examples = [f"'{kind.example}'" for kind in KINDS]
    return f"write it like {', '.join(examples[:-1])} or {examples[-1]}"
