"""Which view an object gets, and the views a worker keeps open: :func:`detect_format`
and :class:`Views`. The views themselves, one module per format, are
:mod:`chunkd.client.inspect.views` (what ``open``, ``rows`` and ``sample`` read):

- :class:`ParquetView` (:mod:`~chunkd.client.inspect.views.parquet`),
- :class:`LinesView` and :class:`ZstdLinesView` (text and JSON lines,
  :mod:`~chunkd.client.inspect.views.lines`),
- :class:`TarView` (WebDataset, :mod:`~chunkd.client.inspect.views.wds`),
- :class:`MdsView` (:mod:`~chunkd.client.inspect.views.mds`),
- :class:`MediaView` and :class:`BinaryView` (:mod:`~chunkd.client.inspect.views.media`,
  :mod:`~chunkd.client.inspect.views.binary`).

Their names, and :func:`file_errors`, :func:`out_of_memory`, :func:`malformed` and
:func:`pyarrow_modules`, are importable from here as before.

A file that cannot be read as its format raises :class:`~chunkd.errors.MalformedFileError`
naming the object and the fault.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from chunkd.client.datasets.formats import detect
from chunkd.client.inspect.views.binary import BinaryView
from chunkd.client.inspect.views.lines import LinesView, ZstdLinesView, text_encoding
from chunkd.client.inspect.views.mds import MdsView
from chunkd.client.inspect.views.media import MediaView
from chunkd.client.inspect.views.parquet import ParquetView, clear_row_groups, pyarrow_modules
from chunkd.client.inspect.views.view import (
    FORMATS,
    HEAD_BYTES,
    Guarded,
    PinnedReads,
    View,
    file_errors,
    malformed,
    out_of_memory,
    split_name,
)
from chunkd.client.inspect.views.wds import TarView
from chunkd.errors import DatasetFormatError, InvalidRequestError
from chunkd.mediatype import kind_of, sniff

if TYPE_CHECKING:
    from chunkd.client.core import Client
    from chunkd.client.results import ObjectStat

__all__ = [
    "FORMATS",
    "HEAD_BYTES",
    "VIEWS",
    "BinaryView",
    "LinesView",
    "MdsView",
    "MediaView",
    "ParquetView",
    "TarView",
    "View",
    "Views",
    "ZstdLinesView",
    "detect_format",
    "file_errors",
    "malformed",
    "out_of_memory",
    "pyarrow_modules",
]

#: open views (footers, line indexes, tar indexes) kept per worker
VIEWS: Final = 32

_TEXT_SUFFIXES: Final = (
    ".txt", ".text", ".log", ".md", ".rst", ".csv", ".tsv", ".json", ".yaml", ".yml",
    ".toml", ".ini", ".cfg", ".py", ".sh", ".xml", ".html", ".htm", ".svg",
)  # fmt: skip


def detect_format(key: str, head: bytes) -> str:
    """The format of an object from its key and its first bytes."""
    by_key = detect(key)
    if by_key is not None:
        return by_key
    found = kind_of(sniff(head))
    if found is not None:
        return found
    if head.startswith(b"PAR1"):
        return "parquet"
    if len(head) >= 263 and head[257:262] == b"ustar":
        return "wds"
    if key.lower().endswith(_TEXT_SUFFIXES):
        return "text"
    if b"\0" in head:
        return "binary"
    if text_encoding(head) != "utf-8":
        return "binary"
    first = head.split(b"\n", 1)[0].strip()
    if first.startswith(b"{") and b"\n" in head:
        try:
            json.loads(first)
        except ValueError:
            return "text"
        return "jsonl"
    return "text"


class Views:
    """The views a worker has open, by object version and format: an LRU bounded by
    count (:data:`VIEWS`) and by their bytes.

    Args:
        client: the worker's client.
        max_bytes: the most bytes of views kept.
    """

    def __init__(self, client: Client, max_bytes: int = 256 << 20) -> None:
        self.client = client
        self.max_bytes = max_bytes
        self._views: OrderedDict[tuple[str, str, str], View] = OrderedDict()

    def clear(self) -> None:
        """Drop every view (and the decoded row groups)."""
        self._views.clear()
        clear_row_groups()

    def open(self, name: str, fmt: str | None = None) -> tuple[View, ObjectStat, str | None]:
        """The view of ``name``'s current version as ``fmt`` (detected: None), its stat,
        and the media type its first bytes have.

        Raises:
            InvalidRequestError: ``fmt`` is not one of :data:`FORMATS`.
            MalformedFileError: the object cannot be read as the format.
            ObjectNotFoundError, UnknownBackendError, InvalidKeyError: as the client has them.
        """
        if fmt is not None and fmt not in FORMATS:
            raise InvalidRequestError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
        stat = self.client.stat(name)
        head = (
            bytes(self.client.read(name, 0, HEAD_BYTES, version=stat.version)) if stat.size else b""
        )
        media_type = sniff(head)
        chosen = fmt or detect_format(split_name(name)[1], head)
        key = (name, stat.version, chosen)
        view = self._views.get(key)
        if view is None:
            with file_errors(name, f"it cannot be opened as {chosen}"):
                view = self._make(stat, chosen, head, media_type)
            self._views[key] = view
            self._trim()
        else:
            self._views.move_to_end(key)
        return Guarded(view), stat, media_type

    def _make(self, stat: ObjectStat, fmt: str, head: bytes, media_type: str | None) -> View:
        makers: dict[str, Callable[[], View]] = {
            "parquet": lambda: ParquetView(self.client, stat),
            "jsonl": lambda: (
                ZstdLinesView(self.client, stat)
                if stat.name.lower().endswith((".zst", ".zstd"))
                else LinesView(self.client, stat, "jsonl")
            ),
            "text": lambda: LinesView(self.client, stat, "text"),
            "wds": lambda: TarView(self.client, stat),
            "mds": lambda: MdsView(self.client, stat),
            "binary": lambda: BinaryView(stat, head),
        }
        maker = makers.get(fmt)
        if maker is None:  # image, audio, video
            return MediaView(stat, fmt, media_type, PinnedReads(self.client, stat))
        try:
            return maker()
        except DatasetFormatError as exc:
            raise malformed(exc) from None

    def _trim(self) -> None:
        total = sum(v.nbytes for v in self._views.values())
        while len(self._views) > VIEWS or (total > self.max_bytes and len(self._views) > 1):
            _, dropped = self._views.popitem(last=False)
            total -= dropped.nbytes
