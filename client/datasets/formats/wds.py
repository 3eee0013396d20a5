"""WebDataset members (``.tar``): one sample per key, as ``{"__key__": key, ext: bytes}``.

The files of a tar are grouped into samples by WebDataset's rule: a file's **key** is
its path up to the first ``.`` of its base name, its **extension** (lowercased) the
rest (``a/b.seg.png``: key ``a/b``, extension ``seg.png``); consecutive files of the
same key make one sample. A key seen again after another key starts a new sample of
the same key, and so does an extension seen twice in a row: ``chunkd dataset check``
reports both as duplicate keys. Files without an extension, WebDataset's
``__name__`` metadata files, directories and links are not samples.

A scan reads only the tar's headers: one 512-byte header block at a time, with ranged
reads that skip each file's data; a GNU long name (``L``), a pax header (``x``; ``g``
applies to every header after it) and its records are read too, at most
:data:`MAX_EXTENDED_BYTES` each. ustar, GNU and pax archives (what ``tarfile`` and
GNU tar write) are read; a sparse file or a malformed header is refused. A
compressed tar (``.tar.gz``) is not a WebDataset member here.

Member ``meta``:

``index``
    ``[[key, [[ext, offset, size], ...]], ...]``: per sample, in tar order, its key and
    each of its files' extension and data byte range.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final

from chunkd.errors import DatasetFormatError

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

    from chunkd.client.datasets.source import Source
    from chunkd.snapshot import Member

__all__ = ["FORMAT", "MAX_EXTENDED_BYTES", "WebDataset", "split_name"]

#: a long name or a pax header's records may be at most this long
MAX_EXTENDED_BYTES: Final = 1 << 20
_BLOCK: Final = 512
#: entry types with no data after their header: links, devices, folders, FIFOs (the
#: data of a type tar does not know is skipped by its size, as tarfile does)
_NO_DATA: Final = frozenset(b"123456")
#: regular files (``7``: contiguous, ``\0``: pre-POSIX)
_REGULAR: Final = frozenset(b"07\0")
#: headers that describe the next entry: GNU long names and links, pax headers
_EXTENDED: Final = frozenset(b"LKxg")


def split_name(path: str) -> tuple[str, str] | None:
    """A file's (key, extension) by WebDataset's rule, or None if it is not part of a
    sample (no extension, or a ``__name__`` metadata file)."""
    folder, slash, base = path.rpartition("/")
    if base.startswith("__") and base.endswith("__"):
        return None
    stem, dot, ext = base.partition(".")
    if not dot or not stem or not ext:
        return None
    return folder + slash + stem, ext.lower()


class WebDataset:
    """The ``wds`` format (see the module docstring)."""

    name = "wds"

    def scan(self, source: Source, member: Member, options: Mapping[str, Any]) -> Member:
        index: list[list[Any]] = []
        current: list[Any] | None = None
        exts: set[str] = set()
        for path, offset, size in _files(source, member):
            parts = split_name(path)
            if parts is None:
                continue
            key, ext = parts
            if current is None or key != current[0] or ext in exts:
                current = [key, []]
                exts = set()
                index.append(current)
            current[1].append([ext, offset, size])
            exts.add(ext)
        return replace(member, samples=len(index), meta={"index": index})

    def read(self, source: Source, member: Member, index: int) -> dict[str, Any]:
        key, files = member.meta["index"][index]
        sample: dict[str, Any] = {"__key__": key}
        for ext, offset, size in files:
            data = source.read(member, int(offset), int(size))
            if len(data) != int(size):
                raise DatasetFormatError(
                    f"{source.name(member)} ends inside the data of {key}.{ext}: it is not "
                    "the file that was registered; register the dataset again"
                )
            sample[ext] = bytes(data)
        return sample

    def ranges(self, member: Member, index: int) -> list[tuple[int, int]]:
        _, files = member.meta["index"][index]
        return [(int(offset), int(size)) for _, offset, size in files if int(size)]

    def schema(self, members: list[Member]) -> Any:
        return sorted(extensions(members))


def extensions(members: list[Member]) -> Counter[str]:
    """How many samples of ``members`` hold each extension."""
    found: Counter[str] = Counter()
    for member in members:
        for _, files in member.meta.get("index", []):
            found.update({ext for ext, _, _ in files})
    return found


FORMAT = WebDataset()


# -- tar headers -------------------------------------------------------------------------


def _files(source: Source, member: Member) -> Iterator[tuple[str, int, int]]:
    """The regular files of a tar member: (path, data offset, size), in tar order."""
    name, size = source.name(member), member.size
    offset = 0
    long_name: str | None = None
    local: dict[str, str] = {}
    shared: dict[str, str] = {}
    while offset + _BLOCK <= size:
        block = bytes(source.read(member, offset, _BLOCK))
        if len(block) < _BLOCK:
            break
        if not any(block):
            return  # the end-of-archive marker
        header = _Header.parse(name, offset, block)
        data = offset + _BLOCK
        kind = header.kind
        extended = kind in _EXTENDED
        extra = {**shared, **local}
        length = header.size
        if not extended and "size" in extra:
            length = _pax_size(name, offset, extra["size"])
        if kind in _NO_DATA:
            length = 0
        if data + length > size:
            raise DatasetFormatError(
                f"{name}: the tar entry {header.path!r} at byte {offset} claims {length} "
                f"bytes, more than the file holds: it is truncated; write it again"
            )
        if extended:
            if length > MAX_EXTENDED_BYTES:
                raise DatasetFormatError(
                    f"{name}: the tar extended header at byte {offset} is {length} bytes, "
                    f"more than the {MAX_EXTENDED_BYTES} chunkd reads"
                )
            body = bytes(source.read(member, data, length))
            if kind == ord("L"):
                long_name = _text(body)
            elif kind != ord("K"):  # a long link name: links are not samples
                (local if kind == ord("x") else shared).update(_pax(name, offset, body))
        else:
            if kind == ord("S") or any(k.startswith("GNU.sparse") for k in extra):
                raise DatasetFormatError(
                    f"{name}: the tar entry {header.path!r} is a sparse file, which is not "
                    "read in place: write the tar without --sparse"
                )
            if kind in _REGULAR:
                yield extra.get("path") or long_name or header.path, data, length
            long_name = None
            local = {}
        offset = data + -(-length // _BLOCK) * _BLOCK
    if offset < size:
        raise DatasetFormatError(
            f"{name} ends inside a tar header at byte {offset}: it is truncated; write it again"
        )


class _Header:
    """One 512-byte tar header block (ustar, GNU or v7)."""

    __slots__ = ("kind", "path", "size")

    def __init__(self, path: str, size: int, kind: int) -> None:
        self.path = path
        self.size = size
        self.kind = kind

    @classmethod
    def parse(cls, name: str, offset: int, block: bytes) -> _Header:
        stored = _octal(name, offset, block[148:156], "checksum")
        computed = sum(block[:148]) + 8 * 0x20 + sum(block[156:])
        signed = sum(b - 256 if b > 127 else b for b in block[:148] + block[156:]) + 8 * 0x20
        if stored not in (computed, signed):
            raise DatasetFormatError(
                f"{name}: the tar header at byte {offset} has a bad checksum (stored "
                f"{stored}, computed {computed}): it is not a tar, or it is damaged"
            )
        path = _text(block[0:100])
        if block[257:263] == b"ustar\0":  # POSIX ustar: a prefix for long paths
            prefix = _text(block[345:500])
            if prefix:
                path = f"{prefix}/{path}"
        size = _number(name, offset, block[124:136])
        return cls(path, size, block[156])


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _octal(name: str, offset: int, field: bytes, what: str) -> int:
    digits = field.split(b"\0", 1)[0].strip(b" \0")
    try:
        return int(digits or b"0", 8)
    except ValueError:
        raise DatasetFormatError(
            f"{name}: the tar header at byte {offset} has a {what} field that is not octal "
            f"({field!r}): it is not a tar, or it is damaged"
        ) from None


def _number(name: str, offset: int, field: bytes) -> int:
    """A size field: octal, or GNU's base-256 (the high bit set) for big files."""
    if field[0] & 0x80:
        value = int.from_bytes(field[1:], "big") | ((field[0] & 0x7F) << 8 * (len(field) - 1))
        if field[0] & 0x40:
            raise DatasetFormatError(f"{name}: the tar header at byte {offset} has a negative size")
        return value
    return _octal(name, offset, field, "size")


def _pax_size(name: str, offset: int, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise DatasetFormatError(
            f"{name}: the pax header before byte {offset} gives a size that is not a number "
            f"({text!r}): the tar is damaged; write it again"
        ) from None


def _pax(name: str, offset: int, body: bytes) -> dict[str, str]:
    """A pax header's records: ``"%d %s=%s\\n"``, the length counting the whole record."""
    records: dict[str, str] = {}
    at = 0
    while at < len(body) and body[at] != 0:
        space = body.find(b" ", at)
        try:
            length = int(body[at:space])
        except ValueError:
            length = 0
        record = body[space + 1 : at + length]
        if space < 0 or length <= 0 or not record.endswith(b"\n") or b"=" not in record:
            raise DatasetFormatError(
                f"{name}: the pax header at byte {offset} holds a malformed record: the tar "
                "is damaged; write it again"
            )
        key, _, value = record[:-1].partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        at += length
    return records
