"""Member formats: how a member's metadata is read at registration, and its samples after.

Each format is one module with one :class:`Format` object: ``parquet`` (a row per
sample), ``jsonl`` (a line per sample; ``.jsonl.zst`` too), ``fixed`` (a record of
``record_bytes``), ``wds`` (a WebDataset tar: the members of one key per sample) and
``mds`` (MosaicML Streaming shards, read in place). A format's module docstring lists
the fields of its members' ``meta`` in the manifest (:mod:`chunkd.snapshot`).

A format reads bytes only through a :class:`~chunkd.client.datasets.source.Source`, so
the same code reads a pinned member and a frozen one.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

from chunkd.errors import DatasetFormatError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from chunkd.client.datasets.source import Source
    from chunkd.snapshot import Member

__all__ = ["Format", "detect", "format_of"]


class Format(Protocol):
    """One member format."""

    #: the format's name in manifests (one of :data:`chunkd.snapshot.FORMATS`)
    name: str

    def scan(self, source: Source, member: Member, options: Mapping[str, Any]) -> Member:
        """``member`` (key, size, version and format set) with its ``samples`` and ``meta``.

        Reads only what the metadata needs (a footer, headers, an index), through
        ``source``. ``options`` are the registration's format options (for example
        ``{"record_bytes": N}`` for ``fixed``).

        Raises:
            DatasetFormatError: the member cannot be read as this format; the message
                names it (``source.name(member)``) and says what is wrong.
            SnapshotDriftError: the object changed while it was being read.
        """
        ...

    def read(self, source: Source, member: Member, index: int) -> Any:
        """Sample ``index`` of ``member`` (``0 <= index < member.samples``)."""
        ...

    def ranges(self, member: Member, index: int) -> list[tuple[int, int]]:
        """The byte ranges ``(offset, length)`` of ``member`` that :meth:`read` of sample
        ``index`` reads (for prefetching): from the manifest alone, no I/O."""
        ...

    def schema(self, members: list[Member]) -> Any:
        """The dataset's schema from its scanned members (the manifest's ``schema_of``)."""
        ...


_MODULES = {
    "parquet": "parquet",
    "jsonl": "jsonl",
    "fixed": "fixed",
    "wds": "wds",
    "mds": "mds",
}
_FORMATS: dict[str, Format] = {}

#: the formats ``--format auto`` recognises, by the end of a key
_SUFFIXES = (
    (".parquet", "parquet"),
    (".jsonl", "jsonl"),
    (".jsonl.zst", "jsonl"),
    (".json.zst", "jsonl"),
    (".ndjson", "jsonl"),
    (".tar", "wds"),
    (".mds", "mds"),
    (".mds.zstd", "mds"),
)


def format_of(name: str) -> Format:
    """The format called ``name``.

    Raises:
        DatasetFormatError: no format has that name.
    """
    fmt = _FORMATS.get(name)
    if fmt is None:
        module = _MODULES.get(name)
        if module is None:
            raise DatasetFormatError(
                f"unknown member format {name!r}; known: {', '.join(_MODULES)}"
            )
        fmt = _FORMATS[name] = importlib.import_module(f"{__name__}.{module}").FORMAT
    return fmt


def detect(key: str) -> str | None:
    """The format a key's name says it holds (``--format auto``), or None."""
    lowered = key.lower()
    return next((fmt for suffix, fmt in _SUFFIXES if lowered.endswith(suffix)), None)
