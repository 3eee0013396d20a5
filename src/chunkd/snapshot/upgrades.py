"""The manifest format's version, and the chain that reads an older root as the current one.

A later schema adds its step to ``_UPGRADES`` (a root of schema N in, one of N + 1
out) and raises :data:`SCHEMA`; every stored root keeps its bytes and its id, and is
upgraded as it is read. Pages have a version of their own
(:data:`~chunkd.snapshot.pages.PAGE_SCHEMA`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from chunkd.errors import ManifestError

__all__ = ["SCHEMA", "upgrade"]

#: the manifest format's version: 2, a root and member pages. Schema 1 (one document,
#: its members inline) is still read, never written.
SCHEMA: Final = 2

#: how to turn a root of schema N into one of N + 1, for each N from 2 before SCHEMA
_UPGRADES: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


def upgrade(doc: dict[str, Any]) -> dict[str, Any]:
    """A manifest document of any schema up to :data:`SCHEMA`: schema 1 as it is (its
    own form, members inline), a root as one of SCHEMA.

    Raises:
        ManifestError: no schema, or one newer than this code reads.
    """
    schema = doc.get("schema")
    if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
        raise ManifestError("the manifest has no schema version: it is not a chunkd snapshot")
    if schema > SCHEMA:
        raise ManifestError(
            f"the manifest is of schema {schema}; this chunkd reads up to {SCHEMA}: "
            "upgrade chunkd to read it"
        )
    # Schema 1 (one document, members inline) is read as it is; the roots of schema 2
    # on are upgraded step by step to the current one.
    while 2 <= schema < SCHEMA:
        doc = _UPGRADES[schema](doc)
        schema += 1
        doc["schema"] = schema
    return doc
