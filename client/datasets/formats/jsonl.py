"""JSON lines members (``.jsonl``, ``.ndjson``; ``.jsonl.zst``, ``.json.zst``): one sample
per line, as ``bytes`` without its newline.

Every ``\\n``-terminated line is a sample, empty ones included, and so is a last line
without a newline; a member of ``n`` newlines holds ``n`` lines, or ``n + 1`` when its
last byte is not a newline (as ``chunkd.client.torch``'s ``JsonLines`` has it). The
lines are not parsed when read: ``chunkd dataset check`` says whether they are JSON.

**The sparse line index.** A scan streams the member (:data:`SCAN_BYTES` a read) and
records where a new *block* of lines starts every :data:`BLOCK_LINES` lines or
:data:`BLOCK_BYTES` bytes, whichever comes first, so a member's ``meta`` stays small
however many lines it holds. Reading line ``i`` finds its block, and the line ends of
that block (found once by reading the block, then kept per process), then reads the
line alone.

**Compressed members.** A ``.zst`` member written in the *seekable zstd format* (its
frames followed by a skippable frame of magic ``0x184D2A5E`` that holds the frame
table, ending with the magic ``0x8F92EAB1``) is read at random: reading line ``i``
decompresses only the frames that hold its block. Any other ``.zst`` member is
``seekable: false``: reading a line decompresses the member from its start. A member
whose decompressed bytes fit in :data:`CACHE_BYTES` is decompressed once per process
and kept; a bigger one is decompressed from the start for each block read, which
makes random access cost O(position): write such members seekable (``chunkd dataset
check`` warns of them). Decompressed blocks are kept in a per-process LRU of at most
:data:`CACHE_BYTES`. A non-seekable member's decoded bytes
(:meth:`~chunkd.client.datasets.formats.Format.unit_bytes`) are its decompressed size,
so that the read order's windows hold at most that bound of such members.

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

import bisect
import json
import struct
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, BinaryIO, Final, cast

import numpy as np
import zstandard

from chunkd.client.datasets.formats import DECODED_CACHE_BYTES, DecodedLRU
from chunkd.errors import DatasetFormatError
from chunkd.snapshot import Member

if TYPE_CHECKING:
    from collections.abc import Mapping

    from numpy.typing import NDArray

    from chunkd.client.datasets.source import Source

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_LINES",
    "CACHE_BYTES",
    "FORMAT",
    "MAX_LINE_BYTES",
    "SCAN_BYTES",
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
#: decompressed members and blocks, and line ends, kept per process (bytes)
CACHE_BYTES: Final = DECODED_CACHE_BYTES
#: ... and at most this many of them
_CACHE_ITEMS: Final = 4096
#: newlines are searched for this many bytes at a time (bounds numpy's index arrays)
_SEARCH_BYTES: Final = 1 << 20
#: a look at a member's first lines reads this many bytes at a time
_FIRST_LINES_BYTES: Final = 64 << 10
#: a check reports a line longer than this as too long, without holding it
MAX_LINE_BYTES: Final = 64 << 20

_SKIPPABLE_MAGIC: Final = 0x184D2A5E
_SEEKABLE_MAGIC: Final = 0x8F92EAB1
_FOOTER: Final = struct.Struct("<IBI")  # frames, descriptor, magic
_NEWLINE: Final = 0x0A

_CACHE = DecodedLRU(CACHE_BYTES, _CACHE_ITEMS)


def compressed(member: Member) -> bool:
    """Whether ``member`` is zstd-compressed JSON lines (by its key)."""
    return member.key.lower().endswith((".zst", ".zstd"))


class JsonLines:
    """The ``jsonl`` format (see the module docstring)."""

    name = "jsonl"

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
        frames = _seek_table(source, member)
        index = _LineIndex()
        # The frames' offsets, to hold against the frame table (seekable members only).
        starts: list[int] | None = [] if frames is not None else None
        for piece in _decompressed(source, member, starts):
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

    def read(self, source: Source, member: Member, index: int) -> bytes:
        block, first = self._block_of(member, index)
        start, stop = _span(member, block)
        data, ends = self._block(source, member, block, start, stop)
        k = index - first
        begin = start if k == 0 else int(ends[k - 1]) + 1
        end = int(ends[k])
        if data is None:
            return bytes(source.read(member, begin, end - begin)) if end > begin else b""
        return bytes(data[begin - start : end - start])

    def ranges(self, member: Member, index: int) -> list[tuple[int, int]]:
        block, _ = self._block_of(member, index)
        if not compressed(member):
            start, stop = _span(member, block)
            return [(start, stop - start)]
        if not member.meta.get("seekable"):
            return [(0, member.size)]
        entry = member.meta["index"][block]
        return [(int(entry[2]), int(entry[4]) - int(entry[2]))]

    def schema(self, members: list[Member]) -> Any:
        return None

    def unit_bytes(self, member: Member) -> list[int] | None:
        # a member is one unit; a non-seekable .zst one is decompressed whole
        if member.meta.get("seekable") is False:
            return [int(member.meta["bytes"])]
        return None

    # -- reading -----------------------------------------------------------------------

    def _block_of(self, member: Member, index: int) -> tuple[int, int]:
        """The block that holds line ``index``, and the block's first line."""
        if not 0 <= index < member.samples:
            raise IndexError(f"line {index} of {member.key}, which holds {member.samples}")
        entries = member.meta["index"]
        block = bisect.bisect_right(entries, index, key=lambda e: int(e[0])) - 1
        return block, int(entries[block][0])

    def _block(
        self, source: Source, member: Member, block: int, start: int, stop: int
    ) -> tuple[memoryview | None, NDArray[np.int64]]:
        """A block's decompressed bytes (None for a plain member: read in place) and
        where each of its lines ends (its newline, or the end of the member)."""
        name = source.name(member)
        data = self._block_bytes(source, member, block, start, stop)
        key = (name, member.version, block, "ends")
        ends: NDArray[np.int64] | None = _CACHE.get(key)
        if ends is not None:
            return data, ends
        if data is None:
            ends = _ends(
                (start + offset, piece)
                for offset, piece in _offsets(_pieces(source, member, start, stop))
            )
        else:
            ends = _ends([(start, data)])
        if not len(ends) or int(ends[-1]) != stop - 1:
            ends = np.append(ends, np.int64(stop))  # the last line, without a newline
        lines = _lines_in(member, block)
        if len(ends) != lines:
            raise DatasetFormatError(
                f"{name}: block {block} holds {len(ends)} lines, not {lines} as recorded: "
                "its bytes are not what was registered; register the dataset again"
            )
        _CACHE.put(key, ends, ends.nbytes)
        return data, ends

    def _block_bytes(
        self, source: Source, member: Member, block: int, start: int, stop: int
    ) -> memoryview | None:
        """A ``.zst`` member's block, decompressed (kept per process); None for a plain
        member."""
        if not compressed(member):
            return None
        name = source.name(member)
        total = int(member.meta["bytes"])
        if not member.meta.get("seekable") and total <= CACHE_BYTES:
            whole_key = (name, member.version, "whole")
            whole: memoryview | None = _CACHE.get(whole_key)
            if whole is None:
                whole = _take(name, self._reader(source, member), 0, total)
                _CACHE.put(whole_key, whole, total)
            return whole[start:stop]
        key = (name, member.version, block, "data")
        data: memoryview | None = _CACHE.get(key)
        if data is not None:
            return data
        if member.meta.get("seekable"):
            _, _, frames_from, skip, frames_to = (int(v) for v in member.meta["index"][block])
            raw = source.read(member, frames_from, frames_to - frames_from)
            reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
            data = _take(name, reader, skip, stop - start)
        else:
            # Too big to keep: decompressed from the start again (see the module docstring).
            data = _take(name, self._reader(source, member), start, stop - start)
        _CACHE.put(key, data, len(data))
        return data

    def _reader(self, source: Source, member: Member) -> BinaryIO:
        reader: BinaryIO = zstandard.ZstdDecompressor().stream_reader(
            source.file(member), read_across_frames=True
        )
        return reader


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


def _span(member: Member, block: int) -> tuple[int, int]:
    """A block's byte range (decompressed, for a ``.zst`` member)."""
    entries = member.meta["index"]
    total = int(member.meta.get("bytes", member.size))
    start = int(entries[block][1])
    stop = int(entries[block + 1][1]) if block + 1 < len(entries) else total
    return start, stop


def _lines_in(member: Member, block: int) -> int:
    entries = member.meta["index"]
    stop = int(entries[block + 1][0]) if block + 1 < len(entries) else member.samples
    return stop - int(entries[block][0])


def _ends(pieces: Iterator[tuple[int, memoryview]] | list[tuple[int, memoryview]]) -> Any:
    """Where the newlines of ``(offset, piece)`` pieces are, as absolute offsets."""
    found = [
        np.flatnonzero(np.frombuffer(piece, dtype=np.uint8) == _NEWLINE).astype(np.int64) + offset
        for offset, piece in pieces
    ]
    return np.concatenate([np.empty(0, dtype=np.int64), *found])


def _offsets(pieces: Iterator[memoryview]) -> Iterator[tuple[int, memoryview]]:
    at = 0
    for piece in pieces:
        yield at, piece
        at += len(piece)


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


def _decompressed(
    source: Source,
    member: Member,
    frames: list[int] | None = None,
    *,
    piece_bytes: int = SCAN_BYTES,
) -> Iterator[memoryview]:
    """A ``.zst`` member's decompressed bytes, ``piece_bytes`` at a time.

    The compressed bytes are followed frame by frame as they stream past
    (:class:`_FrameWalk`), so a member that is not zstd, or ends inside a frame, is
    refused; ``frames``, if given, gets the offset of each zstd frame.
    """
    name = source.name(member)
    walk = _FrameWalk(name, frames)
    tee = _Tee(source.file(member), walk)
    reader = zstandard.ZstdDecompressor().stream_reader(
        cast("BinaryIO", tee), read_across_frames=True
    )
    while True:
        try:
            piece = reader.read(piece_bytes)
        except zstandard.ZstdError as exc:
            raise _not_zstd(name, exc) from None
        if not piece:
            break
        yield memoryview(piece)
    while tee.read(SCAN_BYTES):  # what the decompressor did not need: still walked
        pass
    walk.finish()


class _Tee:
    """A file that shows each piece read from it to a :class:`_FrameWalk`."""

    def __init__(self, file: BinaryIO, walk: _FrameWalk) -> None:
        self._file = file
        self._walk = walk

    def read(self, size: int = -1) -> bytes:
        data = self._file.read(size)
        self._walk.feed(data)
        return data


_ZSTD_MAGIC: Final = 0xFD2FB528


class _FrameWalk:
    """Follows zstd frames (RFC 8878) through a stream of compressed bytes, reading
    only their headers: whether the stream is zstd, and whether it ends between
    frames."""

    def __init__(self, name: str, frames: list[int] | None = None) -> None:
        self._name = name
        self._frames = frames
        self._position = 0  # of the stream, at the end of what was fed
        self._buffer = bytearray()
        self._want = 4  # header bytes to gather in the state below
        self._state = "magic"
        self._skip = 0  # bytes to pass over before the state goes on
        self._checksum = False

    def feed(self, data: bytes) -> None:
        at, size = 0, len(data)
        while at < size:
            if self._skip:
                n = min(self._skip, size - at)
                self._skip -= n
                at += n
                continue
            n = min(self._want - len(self._buffer), size - at)
            self._buffer += data[at : at + n]
            at += n
            if len(self._buffer) == self._want:
                self._advance(self._position + at - len(self._buffer))
        self._position += size

    def _advance(self, where: int) -> None:
        head = self._buffer
        if self._state == "magic":
            (magic,) = struct.unpack_from("<I", head)
            if magic == _ZSTD_MAGIC:
                if self._frames is not None:
                    self._frames.append(where)
                self._state, self._want = "descriptor", 5
                return
            if magic & 0xFFFFFFF0 == 0x184D2A50:  # a skippable frame
                self._state, self._want = "skippable", 8
                return
            raise DatasetFormatError(
                f"{self._name} is not zstd: no zstd frame starts at byte {where} (found "
                f"{bytes(head).hex()}); it is damaged or of another format"
            )
        if self._state == "skippable":
            (self._skip,) = struct.unpack_from("<I", head, 4)
            self._restart()
            return
        if self._state == "descriptor":
            descriptor = head[4]
            single = bool(descriptor & 0x20)
            content = (1 if single else 0, 2, 4, 8)[descriptor >> 6]
            dictionary = (0, 1, 2, 4)[descriptor & 0x03]
            self._checksum = bool(descriptor & 0x04)
            # The rest of the frame header, then the first block's header.
            self._skip = (0 if single else 1) + dictionary + content
            self._state, self._want = "block", 3
            self._buffer = bytearray()
            return
        # A block header: 1 bit "last", 2 bits type, 21 bits size.
        (word,) = struct.unpack("<I", bytes(head) + b"\0")
        kind, size = (word >> 1) & 3, word >> 3
        if kind == 3:
            raise DatasetFormatError(
                f"{self._name}: the zstd block at byte {where} is of a reserved type: the "
                "file is damaged; write it again"
            )
        self._skip = 1 if kind == 1 else size
        if word & 1:  # the frame's last block
            self._skip += 4 if self._checksum else 0
            self._restart()
        else:
            self._buffer = bytearray()

    def _restart(self) -> None:
        self._state, self._want = "magic", 4
        self._buffer = bytearray()

    def finish(self) -> None:
        """Raise if the stream ended inside a frame."""
        if self._state != "magic" or self._buffer or self._skip:
            raise DatasetFormatError(
                f"{self._name} ends inside a zstd frame, at byte {self._position}: it is "
                "truncated; write it again, or register with --skip-bad to leave it out"
            )


def _take(name: str, reader: Any, skip: int, length: int) -> memoryview:
    """``length`` decompressed bytes after the first ``skip`` of ``reader``."""
    try:
        while skip > 0:
            dropped = reader.read(min(skip, SCAN_BYTES))
            if not dropped:
                break
            skip -= len(dropped)
        out = bytearray(length)
        view = memoryview(out)
        got = 0
        while got < length:
            n = reader.readinto(view[got:])
            if not n:
                break
            got += n
    except zstandard.ZstdError as exc:
        raise _not_zstd(name, exc) from None
    if got != length or skip > 0:
        raise DatasetFormatError(
            f"{name}: its zstd frames end before the lines recorded for it: the file is "
            "not what was registered; register the dataset again"
        )
    return memoryview(out).toreadonly()


def _not_zstd(name: str, exc: BaseException) -> DatasetFormatError:
    return DatasetFormatError(
        f"{name} cannot be decompressed as zstd ({exc}): it is damaged, truncated or not "
        "zstd; write it again, or register with --skip-bad to leave it out"
    )


def _seek_table(
    source: Source, member: Member
) -> tuple[NDArray[np.int64], NDArray[np.int64]] | None:
    """A seekable zstd member's frames as cumulative (compressed, decompressed) starts,
    each ending with the total; None for a member not in the seekable format."""
    name, size = source.name(member), member.size
    if size < _FOOTER.size:
        return None
    frames, descriptor, magic = _FOOTER.unpack(bytes(source.read(member, size - 9, 9)))
    if magic != _SEEKABLE_MAGIC:
        return None
    entry = 12 if descriptor & 0x80 else 8
    table = 8 + frames * entry + _FOOTER.size
    if descriptor & 0x7C or table > size:
        raise DatasetFormatError(
            f"{name} ends with the seekable zstd magic, but its frame table ({frames} "
            f"frames, descriptor {descriptor:#x}) does not fit in its {size} bytes: the "
            "table is damaged; write the file again"
        )
    raw = bytes(source.read(member, size - table, table))
    skippable, frame_size = struct.unpack_from("<II", raw)
    if skippable != _SKIPPABLE_MAGIC or frame_size != table - 8:
        raise DatasetFormatError(
            f"{name} ends with the seekable zstd magic, but the skippable frame that holds "
            "its frame table is missing or of the wrong size: write the file again"
        )
    sizes = np.frombuffer(raw, dtype=np.uint32, count=frames * entry // 4, offset=8)
    sizes = sizes.reshape(frames, entry // 4).astype(np.int64)
    c_starts = np.concatenate([[0], np.cumsum(sizes[:, 0])]).astype(np.int64)
    d_starts = np.concatenate([[0], np.cumsum(sizes[:, 1])]).astype(np.int64)
    if int(c_starts[-1]) != size - table:
        raise DatasetFormatError(
            f"{name}: its seekable zstd frame table lists {int(c_starts[-1])} compressed "
            f"bytes, but {size - table} come before it: the table is damaged; write the "
            "file again"
        )
    return c_starts, d_starts


# -- checking ----------------------------------------------------------------------------

#: what a check finds wrong with a line: (line number, kind, detail); kinds are
#: "not-utf8", "not-json", "blank" and "too-long"
LineProblem = tuple[int, str, str]


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
        pieces = _decompressed(source, member, piece_bytes=step)
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
