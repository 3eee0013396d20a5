"""Reading a frozen record off a file backend, either schema (chunkd.frozen): for tests
that look at what a freeze wrote in the registry's folder."""

from __future__ import annotations

import json
from pathlib import Path


def record_pieces(registry: Path, raw: bytes) -> list[tuple[list[str], str | None]]:
    """Each member's chunk ids and content hash (None: not recorded) of the frozen
    record ``raw``, in member order; a paged record's pages are read from
    ``registry/pages`` (``registry``: the registry's folder on a file backend)."""
    record = json.loads(raw)
    if record.get("schema") != 2:
        contents = record.get("content") or [None] * len(record["members"])
        return [(list(ids), c) for ids, c in zip(record["members"], contents, strict=True)]
    members: list[tuple[list[str], str | None]] = []
    last: str | None = None
    for ident, _, _, _ in record["pages"]:
        page = json.loads((registry / "pages" / f"{ident}.json").read_bytes())
        for key, first, ids, content in page["pieces"]:
            if key == last and first:  # the member goes on from the last page
                members[-1] = (members[-1][0] + ids, content)
            else:
                members.append((list(ids), content))
            last = key
    return members


def record_chunk_lists(registry: Path, raw: bytes) -> list[list[str]]:
    """Each member's chunk ids of the frozen record ``raw`` (:func:`record_pieces`)."""
    return [ids for ids, _ in record_pieces(registry, raw)]


def record_contents(registry: Path, raw: bytes) -> list[str | None]:
    """Each member's content hash of the frozen record ``raw`` (:func:`record_pieces`)."""
    return [content for _, content in record_pieces(registry, raw)]
