"""The inspector's views of text and JSON lines: :class:`LinesView`, by line number
through a bounded index of offsets (:mod:`chunkd.client.inspect.lines`), and
:class:`ZstdLinesView`, a ``.jsonl.zst`` object read by the dataset code's JSON lines
format.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

from chunkd.client.datasets.source import PinnedSource
from chunkd.client.inspect.lines import LineIndex
from chunkd.client.inspect.values import MAX_DEPTH, encode
from chunkd.client.inspect.views.view import (
    FIELD_LINES,
    HEAD_BYTES,
    PinnedReads,
    malformed,
    past_end,
    select,
    split_name,
)
from chunkd.errors import DatasetFormatError, InvalidRequestError, MalformedFileError
from chunkd.snapshot import Member

if TYPE_CHECKING:
    from chunkd.client.core import Client
    from chunkd.client.results import ObjectStat

__all__ = ["LinesView", "ZstdLinesView", "text_encoding"]

#: objects of at most this many bytes have their lines counted at ``open``
_COUNT_LINES_BYTES: Final = 8 << 20


class LinesView:
    """Text or JSON lines, paged by line (see :mod:`chunkd.client.inspect.lines`)."""

    def __init__(self, client: Client, stat: ObjectStat, kind: str) -> None:
        self.kind = kind
        self.name = stat.name
        self._stat = stat
        self._read = PinnedReads(client, stat)
        self.index = LineIndex(stat.name, stat.size, self._read)
        head = bytes(self._read(0, HEAD_BYTES))
        self.encoding = text_encoding(head)
        if stat.size <= _COUNT_LINES_BYTES:
            self.index.scan()

    @property
    def total(self) -> int | None:
        return self.index.lines

    @property
    def nbytes(self) -> int:
        return 256 + self.index.nbytes

    def describe(self) -> dict[str, Any]:
        return {"lines": self.index.lines, "encoding": self.encoding}

    def fields(self) -> list[str] | None:
        if self.kind != "jsonl":
            return None
        found: dict[str, None] = {}
        try:
            for _, _, line in _first(self.index.lines_from(0), FIELD_LINES):
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue
                if isinstance(doc, dict):
                    found.update(dict.fromkeys(doc))
        except InvalidRequestError:
            return None  # an empty object, or a first line too long
        return list(found) or None

    def rows(self, start: int, columns: list[str] | None) -> Iterator[tuple[int, Any]]:
        for number, offset, line in self.index.lines_from(start):
            if self.kind == "text":
                yield number, line.decode("utf-8", "replace")
                continue
            yield number, select(_json_line(self.name, number, offset, line), columns)


def _json_line(name: str, number: int, offset: int, line: bytes) -> Any:
    """Line ``number`` (at byte ``offset``; -1: unknown) of ``name``, parsed and encoded."""
    where = f"line {number}" + (f" (at byte {offset})" if offset >= 0 else "")
    try:
        value = json.loads(line)
    except RecursionError:
        raise MalformedFileError(
            f"{name}: {where} holds a value nested too deep to read, past the {MAX_DEPTH} "
            "levels the inspector shows; open it with format=text to see it as it is"
        ) from None
    except ValueError as exc:
        raise MalformedFileError(
            f"{name}: {where} is not JSON ({exc}); open it with format=text to see it as it is"
        ) from None
    try:
        return encode(value)
    except MalformedFileError as exc:
        raise MalformedFileError(f"{name}: {where} {exc}") from None


def text_encoding(head: bytes) -> str:
    """How an object's first bytes read as text: ``utf-8``, or UTF-8 with invalid bytes."""
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not merely a character cut at the end of the head
            return "utf-8 (invalid bytes shown as U+FFFD)"
    return "utf-8"


def _first(items: Iterator[Any], n: int) -> Iterator[Any]:
    for i, item in enumerate(items):
        if i >= n:
            return
        yield item


class ZstdLinesView:
    """A ``.jsonl.zst`` object, read by the dataset code's JSON lines format (its scan
    decompresses the object once, to index its lines)."""

    kind = "jsonl"

    def __init__(self, client: Client, stat: ObjectStat) -> None:
        from chunkd.client.datasets.formats import format_of

        self.name = stat.name
        backend, key = split_name(stat.name)
        self._source = PinnedSource(client, backend)
        self._format = format_of("jsonl")
        try:
            self._member = self._format.scan(
                self._source, Member(key, stat.size, stat.version, "jsonl"), {}
            )
        except DatasetFormatError as exc:
            raise malformed(exc) from None

    @property
    def total(self) -> int | None:
        return self._member.samples

    @property
    def nbytes(self) -> int:
        return 256 + 64 * len(self._member.meta.get("index", ()))

    def describe(self) -> dict[str, Any]:
        return {"lines": self._member.samples, "encoding": "utf-8", "compression": "zstd"}

    def fields(self) -> list[str] | None:
        found: dict[str, None] = {}
        for i in range(min(FIELD_LINES, self._member.samples)):
            try:
                doc = json.loads(self._line(i))
            except (ValueError, MalformedFileError):
                continue
            if isinstance(doc, dict):
                found.update(dict.fromkeys(doc))
        return list(found) or None

    def _line(self, i: int) -> bytes:
        try:
            line: bytes = self._format.read(self._source, self._member, i)
        except DatasetFormatError as exc:
            raise malformed(exc) from None
        return line

    def rows(self, start: int, columns: list[str] | None) -> Iterator[tuple[int, Any]]:
        if not 0 <= start < self._member.samples:
            raise past_end(self.name, start, self._member.samples)
        for i in range(start, self._member.samples):
            # the offset of a line in a compressed object is of its decompressed bytes
            yield i, select(_json_line(self.name, i, -1, self._line(i)), columns)
