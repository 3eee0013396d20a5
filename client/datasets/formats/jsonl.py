"""JSON lines members (``.jsonl``, ``.ndjson``; ``.jsonl.zst``, ``.json.zst``): one sample
per line, as ``bytes`` without its newline.

Every ``\\n``-terminated line is a sample, empty ones included, and so is a last line
without a newline; a member of ``n`` newlines holds ``n`` lines, or ``n + 1`` when its
last byte is not a newline (as ``chunkd.client.torch``'s ``JsonLines`` has it). The
lines are not parsed when read: ``chunkd dataset check`` says whether they are JSON.

**The sparse line index.** A scan streams the member (:data:`SCAN_BYTES` a read) and
records where a new *block* of lines starts every :data:`BLOCK_LINES` lines or
:data:`BLOCK_BYTES` bytes, whichever comes first, so a member's ``meta`` stays small
however many lines it holds.

**Units** (:meth:`~chunkd.client.datasets.formats.Format.units`) are runs of whole
blocks, cut from the manifest alone: consecutive blocks while their lines' bytes plus 4
bytes a line (the table's offsets) stay within :data:`UNIT_BYTES` (8 MiB); a block
that costs more alone is a unit alone (at most :data:`BLOCK_BYTES` plus its last line,
so more than :data:`MAX_UNIT_BYTES` only where one line is that long). A unit's decoded
bytes are that cost. A unit decodes (:meth:`JsonLines.decode`) to a table of one
column, ``line`` (``binary``): each line's bytes without its newline, what ``read``
gives as ``bytes``; the offsets are found by numpy, with no Python per line. A unit
of more than 2 GiB (a line that long: Arrow's binary offsets are 32-bit) is refused
before it is read, and one whose bytes hold another number of lines than the index
records is refused as damaged (:class:`~chunkd.errors.DatasetFormatError`). Reading one
line (``Dataset[i]``) decodes its unit, kept per process by
:class:`~chunkd.client.datasets.formats.FormatBase`.

**Compressed members.** A ``.zst`` member written in the *seekable zstd format* (its
frames followed by a skippable frame of magic ``0x184D2A5E`` that holds the frame
table, ending with the magic ``0x8F92EAB1``) is read at random: a unit decompresses
only the frames that hold its blocks (one ranged read). Any other ``.zst`` member is
``seekable: false``, and can only be decompressed from its start: its units are runs of
blocks of at most :data:`STREAMED_UNIT_BYTES` (128 MiB) each, and decoding unit ``k``
decompresses the member from its start as far as that unit's end, keeping only the
unit. A member of up to 128 MiB is one unit, decompressed once; an epoch over a bigger
one of ``D`` decompressed bytes decompresses about ``D**2 / 256 MiB`` (a 1 GiB member:
8 units, 4.5 GiB decompressed): write such members seekable (``chunkd dataset check``
warns of them). Such a unit's byte range is the whole member. The frames themselves
(the frame table, following frames, decompressing a range) are
:mod:`chunkd.client.datasets.formats.zstd`'s; this module knows lines.

Member ``meta``:

``index``
    the blocks, in order; the first starts at line 0, byte 0. Each is
    ``[line, offset]`` (``offset`` in the decompressed bytes of a ``.zst`` member) or,
    in a seekable ``.zst`` member, ``[line, offset, frames_from, skip, frames_to]``:
    the compressed byte range ``frames_from .. frames_to`` of the frames that hold the
    block, and how many decompressed bytes of the first of them come before it.
``compression``
    ``"zstd"``, for a ``.zst`` member only.
``bytes``
    the decompressed size, for a ``.zst`` member only.
``seekable``
    for a ``.zst`` member only: whether it is in the seekable zstd format.
``frames``
    for a seekable ``.zst`` member only: how many frames its frame table lists.
"""

from __future__ import annotations

import importlib
import itertools
import json
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from chunkd.client.datasets.formats import (
    DECODED_CACHE_BYTES,
    MAX_UNIT_BYTES,
    UNIT_BYTES,
    DecodedLRU,
    FormatBase,
)
from chunkd.client.datasets.formats.zstd import decompressed, seek_table, take
from chunkd.errors import DatasetFormatError, SnapshotDriftError
from chunkd.snapshot import Member

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from numpy.typing import NDArray

    from chunkd.client.datasets.findings import Finding, Level
    from chunkd.client.datasets.source import Source

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_LINES",
    "CACHE_BYTES",
    "COLUMN",
    "FORMAT",
    "MAX_LINE_BYTES",
    "SCAN_BYTES",
    "STREAMED_UNIT_BYTES",
    "JsonLines",
    "LineProblem",
    "problems",
]

#: a scan (and a check) reads this many bytes at a time
SCAN_BYTES: Final = 8 << 20
#: a new block of the line index starts after this many lines ...
BLOCK_LINES: Final = 1024
#: ... or this many bytes, whichever comes first
BLOCK_BYTES: Final = 4 << 20
#: decoded units kept per process (bytes): the formats' common bound
CACHE_BYTES: Final = DECODED_CACHE_BYTES
#: a unit of a ``.zst`` member that is not seekable decodes to at most this (one block
#: alone may be more): each unit is decompressed from the member's start, so few big
#: units cost less than many small ones
STREAMED_UNIT_BYTES: Final = MAX_UNIT_BYTES
#: the one column of a decoded unit
COLUMN: Final = "line"
#: an Arrow binary array's values are at most this many bytes (its offsets are int32)
_MAX_ARRAY_BYTES: Final = (1 << 31) - 1
#: newlines are searched for this many bytes at a time (bounds numpy's index arrays)
_SEARCH_BYTES: Final = 1 << 20
#: a look at a member's first lines reads this many bytes at a time
_FIRST_LINES_BYTES: Final = 64 << 10
#: a check reports a line longer than this as too long, without holding it
MAX_LINE_BYTES: Final = 64 << 20

_NEWLINE: Final = 0x0A

#: units' first blocks per member (:func:`_plan`), kept per process
_PLANS = DecodedLRU(16 << 20, 4096)


def _arrow() -> Any:
    return importlib.import_module("pyarrow")


def compressed(member: Member) -> bool:
    """Whether ``member`` is zstd-compressed JSON lines (by its key)."""
    return member.key.lower().endswith((".zst", ".zstd"))


class JsonLines(FormatBase):
    """The ``jsonl`` format (see the module docstring)."""

    name = "jsonl"
    version = 1
    suffixes = (".jsonl", ".jsonl.zst", ".json.zst", ".ndjson", ".ndjson.zst")

    def scan(self, source: Source, member: Member, options: Mapping[str, Any]) -> Member:
        if not compressed(member):
            index = _LineIndex()
            for piece in _pieces(source, member):
                index.feed(piece)
            if index.position != member.size:
                raise DatasetFormatError(
                    f"{source.name(member)} ended at byte {index.position}, before its "
                    f"recorded size of {member.size}"
                )
            lines, entries = index.finish()
            return replace(member, samples=lines, meta={"index": entries})
        frames = seek_table(source, member)
        index = _LineIndex()
        # The frames' offsets, to hold against the frame table (seekable members only).
        starts: list[int] | None = [] if frames is not None else None
        for piece in decompressed(source, member, starts):
            index.feed(piece)
        lines, entries = index.finish()
        meta: dict[str, Any] = {"compression": "zstd", "bytes": index.position}
        if frames is None:
            meta.update(seekable=False, index=entries)
        else:
            c_starts, d_starts = frames
            if starts != c_starts[:-1].tolist():
                raise DatasetFormatError(
                    f"{source.name(member)}: its seekable zstd frame table lists frames at "
                    "other offsets than its frames are: the table is damaged; write the "
                    "file again"
                )
            if int(d_starts[-1]) != index.position:
                raise DatasetFormatError(
                    f"{source.name(member)}: its seekable zstd frame table says "
                    f"{int(d_starts[-1])} decompressed bytes, but its frames hold "
                    f"{index.position}: the table is damaged; write the file again"
                )
            meta.update(
                seekable=True,
                frames=len(c_starts) - 1,
                index=_with_frames(entries, index.position, c_starts, d_starts),
            )
        return replace(member, samples=lines, meta=meta)

    def schema(self, members: list[Member]) -> Any:
        return None

    def check(
        self, source: Source, members: Sequence[Member], schema_of: Any, *, deep: bool
    ) -> Iterable[Finding]:
        """``zst-not-seekable``, then each member's lines (:func:`problems`): its first
        line, or every line with ``deep`` (streamed). A member that cannot be read is
        ``unreadable``, one that changed ``drift``."""
        from chunkd.client.datasets.findings import Finding

        for member in members:
            if compressed(member) and member.meta.get("seekable") is False:
                yield Finding(
                    "warning",
                    member.key,
                    "zst-not-seekable",
                    "zstd, but not in the seekable zstd format: a random read decompresses "
                    "it from its start; write it with a seekable zstd writer",
                )
            if not member.samples:
                continue
            counts: Counter[str] = Counter()
            first: dict[str, tuple[int, str]] = {}
            try:
                for line, kind, detail in problems(source, member, lines=None if deep else 1):
                    counts[kind] += 1
                    first.setdefault(kind, (line, detail))
            except SnapshotDriftError as exc:
                yield Finding("error", member.key, "drift", str(exc))
                continue
            except DatasetFormatError as exc:
                yield Finding("error", member.key, "unreadable", str(exc))
                continue
            for kind, count in counts.items():
                level, code = _LINE_CODES[kind]
                line, detail = first[kind]
                more = f" (and {count - 1} more lines)" if count > 1 else ""
                yield Finding(level, member.key, code, f"line {line + 1}: {detail}{more}")

    def units(self, member: Member) -> list[int]:
        plan = _plan(member)
        entries = member.meta["index"]
        lines = [*(int(entries[b][0]) for b in plan[:-1]), member.samples]
        return [later - earlier for earlier, later in itertools.pairwise(lines)]

    def unit_bytes(self, member: Member) -> list[int]:
        plan = _plan(member)
        return [_cost(member, first, stop) for first, stop in itertools.pairwise(plan)]

    def unit_ranges(self, member: Member, unit: int) -> list[tuple[int, int]]:
        first, stop = _blocks(member, unit)
        if not compressed(member):
            start, end = _span(member, first, stop)
            return [(start, end - start)] if end > start else []
        if not member.meta.get("seekable"):
            return [(0, member.size)]
        entries = member.meta["index"]
        frames_from, frames_to = int(entries[first][2]), int(entries[stop - 1][4])
        return [(frames_from, frames_to - frames_from)] if frames_to > frames_from else []

    def decode(
        self, source: Source, member: Member, unit: int, columns: Sequence[str] | None
    ) -> Any:
        pa = _arrow()
        name = source.name(member)
        asked = _asked(name, columns)
        first, stop = _blocks(member, unit)
        entries = member.meta["index"]
        begin = int(entries[first][0])
        lines = (int(entries[stop][0]) if stop < len(entries) else member.samples) - begin
        if not asked:  # no column: only the row count, which the manifest knows
            return pa.table({COLUMN: pa.nulls(lines, pa.binary())}).select([])
        start, end = _span(member, first, stop)
        if end - start > _MAX_ARRAY_BYTES:
            raise DatasetFormatError(
                f"{name}: lines {begin}..{begin + lines} hold {end - start} bytes, more than "
                f"an Arrow binary column holds ({_MAX_ARRAY_BYTES}): a line of over 2 GiB is "
                "not read; split it"
            )
        data = self._bytes(source, member, first, stop, start, end)
        column = _lines(name, data, begin, lines, at_end=stop == len(entries))
        return pa.Table.from_arrays([column] * len(asked), names=list(asked))

    def sample(self, table: Any, row: int) -> bytes:
        line: bytes = table.column(COLUMN)[row].as_py()
        return line

    # -- reading -----------------------------------------------------------------------

    def _bytes(
        self, source: Source, member: Member, first: int, stop: int, start: int, end: int
    ) -> memoryview:
        """The bytes ``start .. end`` of blocks ``first .. stop`` (decompressed, for a
        ``.zst`` member)."""
        name = source.name(member)
        if not compressed(member):
            data = source.read(member, start, end - start)
            if len(data) != end - start:
                raise DatasetFormatError(
                    f"{name} ends at byte {start + len(data)}, inside lines recorded up to "
                    f"byte {end}: it is not the file that was registered; register the "
                    "dataset again"
                )
            return data
        if member.meta.get("seekable"):
            entries = member.meta["index"]
            frames_from, skip = int(entries[first][2]), int(entries[first][3])
            frames_to = int(entries[stop - 1][4])
            raw = source.read(member, frames_from, frames_to - frames_from)
            return take(name, raw, skip, end - start)
        # Not seekable: decompressed from the start, as far as the unit's end.
        return take(name, source.file(member), start, end - start)


FORMAT = JsonLines()


# -- the line index ----------------------------------------------------------------------


class _LineIndex:
    """Counts lines in a stream of pieces and records where each block starts."""

    def __init__(self) -> None:
        self.newlines = 0
        self.position = 0
        self.last = -1
        self.entries: list[list[int]] = [[0, 0]]

    def feed(self, piece: memoryview | bytes) -> None:
        data = np.frombuffer(piece, dtype=np.uint8)
        for at in range(0, len(data), _SEARCH_BYTES):
            part = data[at : at + _SEARCH_BYTES]
            found = np.flatnonzero(part == _NEWLINE)
            if len(found):
                self._mark(found + (self.position + at + 1), self.newlines + 1)
                self.newlines += len(found)
        if len(data):
            self.last = int(data[-1])
        self.position += len(data)

    def _mark(self, starts: NDArray[np.intp], first_line: int) -> None:
        """Add the blocks that start among ``starts``, the starts of lines
        ``first_line, first_line + 1, ...``."""
        line, offset = self.entries[-1]
        while True:
            by_lines = max(0, line + BLOCK_LINES - first_line)
            by_bytes = int(np.searchsorted(starts, offset + BLOCK_BYTES, side="left"))
            at = min(by_lines, by_bytes)
            if at >= len(starts):
                return
            line, offset = first_line + at, int(starts[at])
            self.entries.append([line, offset])

    def finish(self) -> tuple[int, list[list[int]]]:
        """The line count and the blocks."""
        lines = self.newlines + (1 if self.position and self.last != _NEWLINE else 0)
        entries = [e for e in self.entries if e[0] < lines] or [[0, 0]]
        return lines, entries


def _with_frames(
    entries: list[list[int]], total: int, c_starts: NDArray[np.int64], d_starts: NDArray[np.int64]
) -> list[list[int]]:
    """Seekable blocks: each entry with the compressed range of its frames."""
    out = []
    for j, (line, start) in enumerate(entries):
        stop = entries[j + 1][1] if j + 1 < len(entries) else total
        first = int(np.searchsorted(d_starts, start, side="right")) - 1
        last = int(np.searchsorted(d_starts, max(start, stop - 1), side="right")) - 1
        last = min(last, len(c_starts) - 2)
        first = min(first, last)
        out.append([line, start, int(c_starts[first]), start - int(d_starts[first]),
                    int(c_starts[last + 1])])  # fmt: skip
    return out


def _span(member: Member, first: int, stop: int) -> tuple[int, int]:
    """The byte range of blocks ``first .. stop`` (decompressed, for a ``.zst`` member)."""
    entries = member.meta["index"]
    total = int(member.meta.get("bytes", member.size))
    return int(entries[first][1]), int(entries[stop][1]) if stop < len(entries) else total


def _blocks(member: Member, unit: int) -> tuple[int, int]:
    """The blocks ``first .. stop`` of unit ``unit``."""
    plan = _plan(member)
    if not 0 <= unit < len(plan) - 1:
        raise IndexError(f"unit {unit} of {member.key}, which has {len(plan) - 1}")
    return plan[unit], plan[unit + 1]


def _plan(member: Member) -> list[int]:
    """The first block of each unit, then the number of blocks (kept per process)."""
    entries = member.meta["index"]
    # The manifest's identity of the member, and enough of its index to tell apart two
    # members that only a hand-made manifest would give the same key and version.
    key = (member.key, member.version, member.size, member.samples, len(entries),
           tuple(entries[-1]), member.meta.get("bytes"),
           UNIT_BYTES, STREAMED_UNIT_BYTES)  # fmt: skip
    plan: list[int] | None = _PLANS.get(key)
    if plan is None:
        plan = _cut(member)
        _PLANS.put(key, plan, 64 + 8 * len(plan))
    return plan


def _cut(member: Member) -> list[int]:
    """Runs of whole blocks whose lines cost at most :data:`UNIT_BYTES` (a streamed
    member's: :data:`STREAMED_UNIT_BYTES`), a block that costs more alone."""
    entries = member.meta["index"]
    if not member.samples:
        return [0]
    streamed = compressed(member) and not member.meta.get("seekable")
    target = STREAMED_UNIT_BYTES if streamed else UNIT_BYTES
    total = int(member.meta.get("bytes", member.size))
    offsets = [*(int(e[1]) for e in entries), total]
    lines = [*(int(e[0]) for e in entries), member.samples]
    plan = [0]
    for block in range(1, len(entries)):
        first = plan[-1]
        cost = offsets[block + 1] - offsets[first] + 4 * (lines[block + 1] - lines[first])
        if cost > target:
            plan.append(block)
    plan.append(len(entries))
    return plan


def _cost(member: Member, first: int, stop: int) -> int:
    """What blocks ``first .. stop`` decode to: their bytes and their lines' offsets."""
    entries = member.meta["index"]
    start, end = _span(member, first, stop)
    lines = (int(entries[stop][0]) if stop < len(entries) else member.samples) - int(
        entries[first][0]
    )
    return end - start + 4 * lines


def _asked(name: str, columns: Sequence[str] | None) -> list[str]:
    if columns is None:
        return [COLUMN]
    for column in columns:
        if column != COLUMN:
            raise DatasetFormatError(
                f"{name} has no column {column!r}: a JSON lines member has one, {COLUMN!r}"
            )
    return list(columns)


def _lines(name: str, data: memoryview, begin: int, lines: int, *, at_end: bool) -> Any:
    """The lines of ``data`` (whole lines, the first being line ``begin``) as a binary
    array of ``lines`` values, without their newlines."""
    raw = np.frombuffer(data, dtype=np.uint8)
    newline = raw == _NEWLINE
    ends = np.flatnonzero(newline)
    if len(raw) and not newline[-1]:
        if not at_end:
            raise DatasetFormatError(
                f"{name}: lines {begin}..{begin + lines} do not end with a newline where "
                "the next line was recorded: its bytes are not what was registered; "
                "register the dataset again"
            )
        ends = np.append(ends, len(raw))  # the last line, without a newline
    if len(ends) != lines:
        raise DatasetFormatError(
            f"{name}: the bytes of lines {begin}..{begin + lines} hold {len(ends)} lines: "
            "they are not what was registered; register the dataset again"
        )
    # Without its newlines, line i (i newlines before it) ends i bytes earlier.
    offsets = np.zeros(lines + 1, dtype=np.int32)
    offsets[1:] = ends - np.arange(lines)
    values = raw[~newline]
    pa = _arrow()
    return pa.Array.from_buffers(
        pa.binary(), lines, [None, pa.py_buffer(offsets), pa.py_buffer(values)]
    )


def _pieces(
    source: Source,
    member: Member,
    start: int = 0,
    stop: int | None = None,
    *,
    piece_bytes: int = SCAN_BYTES,
) -> Iterator[memoryview]:
    """``member``'s bytes ``start .. stop`` (default: all), ``piece_bytes`` at a time."""
    stop = member.size if stop is None else stop
    for offset in range(start, stop, piece_bytes):
        piece = source.read(member, offset, min(piece_bytes, stop - offset))
        if not len(piece):
            return
        yield piece


# -- checking ----------------------------------------------------------------------------

#: what a check finds wrong with a line: (line number, kind, detail); kinds are
#: "not-utf8", "not-json", "blank" and "too-long"
LineProblem = tuple[int, str, str]


#: the level and code of ``chunkd dataset check``'s finding of each kind of problem
_LINE_CODES: Final[dict[str, tuple[Level, str]]] = {
    "not-json": ("error", "jsonl-not-json"),
    "not-utf8": ("error", "jsonl-not-utf8"),
    "blank": ("warning", "jsonl-blank-line"),
    "too-long": ("warning", "jsonl-line-too-long"),
}


def problems(source: Source, member: Member, *, lines: int | None = None) -> Iterator[LineProblem]:
    """What is wrong with each of ``member``'s first ``lines`` lines (default: all), as
    JSON: a line that is not UTF-8, not JSON, blank, or longer than
    :data:`MAX_LINE_BYTES`. Streams the member: memory holds one piece and one line.

    Raises:
        DatasetFormatError: a ``.zst`` member cannot be decompressed.
        SnapshotDriftError: the member changed.
    """
    # A look at the first lines reads small pieces; a whole member, big ones.
    step = SCAN_BYTES if lines is None else _FIRST_LINES_BYTES
    if compressed(member):
        pieces = decompressed(source, member, piece_bytes=step)
    else:
        pieces = _pieces(source, member, piece_bytes=step)
    number = 0
    carry = bytearray()
    too_long = False
    for piece in pieces:
        data = bytes(piece)
        at = 0
        while True:
            end = data.find(b"\n", at)
            if end < 0:
                if not too_long:
                    carry += data[at:]
                    if len(carry) > MAX_LINE_BYTES:
                        too_long, carry = True, bytearray()
                break
            if too_long:
                yield number, "too-long", f"longer than {MAX_LINE_BYTES} bytes"
            elif carry:
                carry += data[at:end]
                yield from _problem(number, bytes(carry))
                carry.clear()
            else:
                yield from _problem(number, data[at:end])
            too_long = False
            number += 1
            at = end + 1
            if lines is not None and number >= lines:
                return
    if too_long:
        yield number, "too-long", f"longer than {MAX_LINE_BYTES} bytes"
    elif carry:
        yield from _problem(number, bytes(carry))


def _problem(number: int, line: bytes) -> Iterator[LineProblem]:
    if not line.strip():
        yield number, "blank", "an empty line (read as a sample of no bytes)"
        return
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        yield number, "not-utf8", f"not UTF-8: {exc.reason} at byte {exc.start}"
        return
    try:
        json.loads(text)
    except ValueError as exc:
        yield number, "not-json", f"not JSON: {exc}"
