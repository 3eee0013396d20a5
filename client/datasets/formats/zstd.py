"""The zstd frames of a ``.zst`` member: the seekable format's frame table, and reading.

A member in the *seekable zstd format* (Facebook's ``contrib/seekable_format``: the
frames, then a skippable frame holding a table of each frame's compressed and
decompressed size, ending with a footer of the frame count, a descriptor and
:data:`SEEKABLE_MAGIC`) is read by ranges: :func:`seek_table` reads the table (the
last bytes of the member only), and :func:`take` decompresses the frames that hold a
range. Any other zstd member is read from its start (:func:`decompressed` streams it,
following its frames' headers as they pass, :class:`FrameWalk`, so that a member that
is not zstd, or is truncated inside a frame, is refused with an error that says so).

The JSON lines format (:mod:`chunkd.client.datasets.formats.jsonl`) reads its ``.zst``
members through this module; it knows lines, this module frames.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any, BinaryIO, Final, cast

import numpy as np
import zstandard

from chunkd.errors import DatasetFormatError

if TYPE_CHECKING:
    from collections.abc import Iterator

    from numpy.typing import NDArray

    from chunkd.client.datasets.source import Source
    from chunkd.snapshot import Member

__all__ = [
    "READ_BYTES",
    "SEEKABLE_MAGIC",
    "SKIPPABLE_MAGIC",
    "FrameWalk",
    "decompressed",
    "not_zstd",
    "seek_table",
    "take",
]

#: bytes read at a time where the caller gives no size (a drain, a skip)
READ_BYTES: Final = 8 << 20
#: the magic of a skippable frame that holds a seekable member's frame table
SKIPPABLE_MAGIC: Final = 0x184D2A5E
#: the magic that ends a member in the seekable zstd format
SEEKABLE_MAGIC: Final = 0x8F92EAB1
_FOOTER: Final = struct.Struct("<IBI")  # frames, descriptor, magic


def decompressed(
    source: Source,
    member: Member,
    frames: list[int] | None = None,
    *,
    piece_bytes: int = READ_BYTES,
) -> Iterator[memoryview]:
    """A ``.zst`` member's decompressed bytes, ``piece_bytes`` at a time.

    The compressed bytes are followed frame by frame as they stream past
    (:class:`FrameWalk`), so a member that is not zstd, or ends inside a frame, is
    refused; ``frames``, if given, gets the offset of each zstd frame.
    """
    name = source.name(member)
    walk = FrameWalk(name, frames)
    tee = _Tee(source.file(member), walk)
    reader = zstandard.ZstdDecompressor().stream_reader(
        cast("BinaryIO", tee), read_across_frames=True
    )
    while True:
        try:
            piece = reader.read(piece_bytes)
        except zstandard.ZstdError as exc:
            raise not_zstd(name, exc) from None
        if not piece:
            break
        yield memoryview(piece)
    while tee.read(READ_BYTES):  # what the decompressor did not need: still walked
        pass
    walk.finish()


class _Tee:
    """A file that shows each piece read from it to a :class:`FrameWalk`."""

    def __init__(self, file: BinaryIO, walk: FrameWalk) -> None:
        self._file = file
        self._walk = walk

    def read(self, size: int = -1) -> bytes:
        data = self._file.read(size)
        self._walk.feed(data)
        return data


_ZSTD_MAGIC: Final = 0xFD2FB528


class FrameWalk:
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


def take(name: str, compressed: Any, skip: int, length: int) -> memoryview:
    """``length`` decompressed bytes after the first ``skip`` of ``compressed`` (bytes
    or a file of whole zstd frames), read only.

    Raises:
        DatasetFormatError: the frames cannot be decompressed, or end too early.
    """
    reader = zstandard.ZstdDecompressor().stream_reader(compressed, read_across_frames=True)
    try:
        while skip > 0:
            dropped = reader.read(min(skip, READ_BYTES))
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
        raise not_zstd(name, exc) from None
    if got != length or skip > 0:
        raise DatasetFormatError(
            f"{name}: its zstd frames end before the lines recorded for it: the file is "
            "not what was registered; register the dataset again"
        )
    return memoryview(out).toreadonly()


def not_zstd(name: str, exc: BaseException) -> DatasetFormatError:
    """The error of a member that zstd cannot decompress."""
    return DatasetFormatError(
        f"{name} cannot be decompressed as zstd ({exc}): it is damaged, truncated or not "
        "zstd; write it again, or register with --skip-bad to leave it out"
    )


def seek_table(
    source: Source, member: Member
) -> tuple[NDArray[np.int64], NDArray[np.int64]] | None:
    """A seekable zstd member's frames as cumulative (compressed, decompressed) starts,
    each ending with the total; None for a member not in the seekable format."""
    name, size = source.name(member), member.size
    if size < _FOOTER.size:
        return None
    frames, descriptor, magic = _FOOTER.unpack(bytes(source.read(member, size - 9, 9)))
    if magic != SEEKABLE_MAGIC:
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
    if skippable != SKIPPABLE_MAGIC or frame_size != table - 8:
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
