"""A snapshot's member: one object that holds samples, as a manifest records it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from chunkd.errors import ManifestError
from chunkd.snapshot.names import _ID_RE
from chunkd.snapshot.shape import _object, _text, _whole

__all__ = ["FORMATS", "Member"]

#: the member formats chunkd ships (a manifest may name any format a process knows:
#: :func:`chunkd.client.datasets.formats.names`)
FORMATS: Final = ("parquet", "jsonl", "fixed", "wds", "mds", "arrow")
#: a format's name: a plug-in's too (reading a member of a format this process does
#: not know fails then, in ``chunkd.client.datasets.formats.format_of``)
_FORMAT_RE: Final = re.compile(r"[a-z][a-z0-9_.-]{0,31}")


@dataclass(frozen=True, slots=True)
class Member:
    """One object of a snapshot (see the module docstring for its fields)."""

    key: str
    size: int
    version: str
    format: str
    samples: int = 0
    meta: Mapping[str, Any] = field(default_factory=dict)
    #: the blake3 of the member's whole bytes (64 hex digits); None: not known
    content: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The member's entry in a manifest (``content`` only where it is known, so that
        a manifest written before the field existed keeps its bytes and its id)."""
        entry = {
            "key": self.key,
            "size": self.size,
            "version": self.version,
            "format": self.format,
            "samples": self.samples,
            "meta": dict(self.meta),
        }
        if self.content is not None:
            entry["content"] = self.content
        return entry

    @classmethod
    def from_json(cls, doc: object, where: str = "a member") -> Member:
        """A member from its manifest entry.

        Raises:
            ManifestError: the entry is malformed.
        """
        entry = _object(doc, where)
        fmt = _text(entry, "format", where)
        if not _FORMAT_RE.fullmatch(fmt):
            raise ManifestError(
                f"{where}: {fmt!r} is not a format name (lowercase letters, digits, "
                "'_', '.' and '-', at most 32, starting with a letter)"
            )
        meta = entry.get("meta", {})
        if not isinstance(meta, dict):
            raise ManifestError(f"{where}: 'meta' must be an object")
        content = entry.get("content")
        if content is not None and not (isinstance(content, str) and _ID_RE.fullmatch(content)):
            raise ManifestError(f"{where}: 'content' must be a blake3 digest (64 hex digits)")
        return cls(
            key=_text(entry, "key", where),
            size=_whole(entry, "size", where),
            version=_text(entry, "version", where),
            format=fmt,
            samples=_whole(entry, "samples", where),
            meta=meta,
            content=content,
        )

    def relative(self, prefix: str) -> str:
        """The key below ``prefix`` (the snapshot's source prefix)."""
        return self.key[len(prefix) :] if prefix and self.key.startswith(prefix) else self.key
