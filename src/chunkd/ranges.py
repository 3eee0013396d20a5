"""Byte ranges as values, from the HTTP ``Range`` header to the backend call.

Three small frozen types, as zarr and obstore use them: :class:`ByteRange` (start,
exclusive end), :class:`OffsetRange` (from an offset to the end) and
:class:`SuffixRange` (the last N bytes). :func:`parse_range` reads a single-range
``Range`` header; :func:`from_offset` makes one of an offset and a length (the local
socket's reads); :func:`resolve` turns any of them into concrete ``(start, end)``
offsets for an object of known size. The backends take the same values
(:meth:`chunkd.gateway.backends.Backend.get`) and resolve them with the same rule.

The one rule for "past the end", for every door and every backend (RFC 9110's):

- no range is the whole object, whatever its size (an empty object included);
- a range that asks for bytes must start before the end of the object
  (:class:`RangeNotSatisfiableError` otherwise, so any such range of an empty object);
- a range that asks for no bytes (``ByteRange(n, n)``) is satisfiable at or before
  the end, and selects nothing;
- a range that runs past the end is cut at the end; a suffix longer than the object
  is the whole object.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from chunkd.errors import InvalidRangeError, RangeNotSatisfiableError

__all__ = [
    "ByteRange",
    "InvalidRangeError",
    "OffsetRange",
    "RangeNotSatisfiableError",
    "RequestRange",
    "SuffixRange",
    "from_offset",
    "parse_range",
    "reading",
    "resolve",
]

_SPEC: Final = re.compile(r"bytes=(\d*)-(\d*)")
_MAX_DIGITS: Final = 19  # beyond any object size; keeps int() cheap on hostile input


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Bytes ``start`` up to ``end`` (exclusive)."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise InvalidRangeError(f"ByteRange({self.start}, {self.end}): needs 0 <= start <= end")


@dataclass(frozen=True, slots=True)
class OffsetRange:
    """Bytes from ``start`` to the end of the object."""

    start: int

    def __post_init__(self) -> None:
        if self.start < 0:
            raise InvalidRangeError(f"OffsetRange({self.start}): needs start >= 0")


@dataclass(frozen=True, slots=True)
class SuffixRange:
    """The last ``length`` bytes of the object."""

    length: int

    def __post_init__(self) -> None:
        if self.length < 0:
            raise InvalidRangeError(f"SuffixRange({self.length}): needs length >= 0")


RequestRange = ByteRange | OffsetRange | SuffixRange


def parse_range(header: str | None) -> RequestRange | None:
    """Parse a ``Range`` header holding one byte range; ``None`` for no header.

    Raises:
        InvalidRangeError: the header is malformed, not in bytes, or has several ranges.
    """
    if header is None:
        return None
    text = header.strip()
    if "," in text:
        raise InvalidRangeError(
            f"Range {header!r} asks for several ranges; chunkd serves one range per request"
        )
    match = _SPEC.fullmatch(text.replace(" ", ""))
    first, last = match.groups() if match else ("", "")
    if not match or (not first and not last) or max(len(first), len(last)) > _MAX_DIGITS:
        raise InvalidRangeError(
            f"Range {header!r} is not a byte range; write it as 'bytes=START-END', "
            "'bytes=START-' or 'bytes=-LENGTH'"
        )
    if not first:
        return SuffixRange(int(last))
    if not last:
        return OffsetRange(int(first))
    start, end = int(first), int(last)
    if end < start:
        raise InvalidRangeError(f"Range {header!r} ends before it starts")
    return ByteRange(start, end + 1)


def from_offset(offset: int, length: int | None) -> RequestRange | None:
    """The range of ``length`` bytes from ``offset`` (``None``: to the end); the whole
    object (``None``) for offset 0 to the end.

    Raises:
        InvalidRangeError: ``offset`` or ``length`` is negative.
    """
    if length is None:
        return None if offset == 0 else OffsetRange(offset)
    if length < 0:
        raise InvalidRangeError(f"a length of {length} bytes; it must be >= 0")
    return ByteRange(offset, offset + length)


def reading(request: RequestRange | None) -> tuple[int, int | None] | None:
    """Where a read of ``request`` starts and ends (None: at the end) before the
    object's size is known; None for a suffix, which needs the size first."""
    if request is None:
        return 0, None
    if isinstance(request, ByteRange):
        return request.start, request.end
    if isinstance(request, OffsetRange):
        return request.start, None
    return None


def resolve(request: RequestRange | None, size: int) -> tuple[int, int]:
    """Concrete ``(start, end)`` offsets (end exclusive) of ``request`` in ``size`` bytes.

    The one rule for "past the end" (see the module's docstring): ``None`` is the
    whole object; a range that asks for bytes must start before the end; an empty
    ``ByteRange`` at or before the end selects nothing; a range running past the end
    is cut at the end, as RFC 9110 says.

    Raises:
        RangeNotSatisfiableError: the range asks for bytes but starts at or after the
            end of the object, is an empty suffix, or starts past the end.
    """
    if request is None:
        return 0, size
    if isinstance(request, ByteRange) and request.start == request.end:
        if request.start > size:
            raise RangeNotSatisfiableError(
                f"range starts at byte {request.start}, past the end of the object ({size} bytes)",
                size,
            )
        return request.start, request.start
    if isinstance(request, SuffixRange):
        if request.length == 0 or size == 0:
            raise RangeNotSatisfiableError(
                f"a suffix of {request.length} bytes of a {size}-byte object selects nothing",
                size,
            )
        return max(0, size - request.length), size
    if request.start >= size:
        raise RangeNotSatisfiableError(
            f"range starts at byte {request.start}, past the end of the object ({size} bytes)",
            size,
        )
    end = size if isinstance(request, OffsetRange) else min(request.end, size)
    return request.start, end
