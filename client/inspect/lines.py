"""Lines of a plain object (text, JSON lines), paged by line number: :class:`LineIndex`.

A line is what ends with ``\\n`` (the newline is not part of it), and a last line
without a newline, as the dataset's JSON lines format counts them
(:mod:`chunkd.client.datasets.formats.jsonl`). Line ``i`` is found from an index of the
offsets of every ``stride``-th line that the worker has seen: paging forward scans only
what no page has scanned before, and a jump back starts from the nearest recorded line.
The index is bounded: past :data:`MAX_MARKS` offsets its stride doubles and every other
offset is dropped, so it holds at most that many however long the object is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Final

import numpy as np

from chunkd.errors import InvalidRequestError

__all__ = ["MAX_LINE_BYTES", "MAX_MARKS", "LineIndex"]

#: the most line offsets one index keeps
MAX_MARKS: Final = 1 << 16
#: a scan for newlines reads this much at a time
_SCAN_BYTES: Final = 4 << 20
#: a line's bytes are read this much at a time to begin with (it doubles)
_FIRST_READ: Final = 64 << 10
#: a longer line is not sent: the inspector does not page inside a line
MAX_LINE_BYTES: Final = 16 << 20
_NEWLINE: Final = 0x0A

#: reads bytes ``offset .. offset + length`` of the object (cut at its end)
Read = Callable[[int, int], memoryview]


class LineIndex:
    """Where the lines of one version of an object start, as far as they were scanned.

    Args:
        name: the object (for messages).
        size: its bytes.
        read: reads a range of it (pinned to the version the index is of).
    """

    def __init__(self, name: str, size: int, read: Read) -> None:
        self.name = name
        self.size = size
        self._read = read
        self._stride = 256
        self._marks = [0]  # the offset of line k * stride
        self._scanned = 0  # bytes scanned for newlines, from the start
        self._newlines = 0  # newlines among them
        self._last = -1  # the last scanned byte

    @property
    def nbytes(self) -> int:
        """About the memory the index holds."""
        return 64 + 8 * len(self._marks)

    @property
    def lines(self) -> int | None:
        """How many lines the object holds, once a scan reached its end (else None)."""
        if self._scanned < self.size:
            return None
        return self._newlines + (1 if self.size and self._last != _NEWLINE else 0)

    def scan(self, upto_lines: int | None = None, upto_bytes: int | None = None) -> None:
        """Scan on until ``upto_lines`` lines start inside the scanned bytes, or
        ``upto_bytes`` are scanned, or the object ends."""
        while self._scanned < self.size:
            if upto_lines is not None and self._newlines >= upto_lines:
                return
            if upto_bytes is not None and self._scanned >= upto_bytes:
                return
            piece = self._read(self._scanned, min(_SCAN_BYTES, self.size - self._scanned))
            if not len(piece):
                return
            data = np.frombuffer(piece, dtype=np.uint8)
            ends = np.flatnonzero(data == _NEWLINE)
            if len(ends):
                # line n starts after the n-th newline: keep those at multiples of the stride
                first = self._newlines + 1
                numbers = np.arange(first, first + len(ends))
                wanted = numbers % self._stride == 0
                for offset in (ends[wanted] + self._scanned + 1).tolist():
                    self._marks.append(int(offset))
                self._newlines += len(ends)
                while len(self._marks) > MAX_MARKS:
                    self._marks = self._marks[::2]
                    self._stride *= 2
            self._last = int(data[-1])
            self._scanned += len(data)

    def lines_from(self, start: int) -> Iterator[tuple[int, int, bytes]]:
        """``(number, offset, bytes)`` of lines ``start``, ``start + 1``, ... to the end.

        Raises:
            InvalidRequestError: ``start`` is past the last line, or a line is longer
                than :data:`MAX_LINE_BYTES`.
        """
        self.scan(upto_lines=start)
        if not self._holds(start):
            raise InvalidRequestError(
                f"line {start} of {self.name}, which holds {self.lines} lines: ask for a "
                "start below that"
            )
        mark = start // self._stride
        number, offset = mark * self._stride, self._marks[mark]
        buffer = b""
        at = offset  # the object's offset of buffer[0]
        want = _FIRST_READ
        while True:
            end = buffer.find(b"\n")
            if end < 0:
                if at + len(buffer) >= self.size:
                    if buffer and number >= start:  # a last line without a newline
                        yield number, at, buffer
                    return
                if len(buffer) > MAX_LINE_BYTES:
                    raise InvalidRequestError(
                        f"line {number} of {self.name} (at byte {at}) is longer than "
                        f"{MAX_LINE_BYTES} bytes: the inspector does not page inside a line; "
                        "open the object as binary, or read its bytes with the client"
                    )
                piece = self._read(at + len(buffer), min(want, self.size - at - len(buffer)))
                if not len(piece):
                    return
                buffer += bytes(piece)
                want = min(want * 2, _SCAN_BYTES)
                continue
            if number >= start:
                yield number, at, buffer[:end]
            number += 1
            at += end + 1
            buffer = buffer[end + 1 :]

    def _holds(self, line: int) -> bool:
        """Whether line ``line`` exists, once the scan has passed its start."""
        if self._newlines != line:
            return self._newlines > line
        # it starts right after the scanned bytes' last newline: it exists if a byte follows
        return self._scanned < self.size or (self._scanned > 0 and self._last != _NEWLINE)
