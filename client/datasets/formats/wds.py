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

**Units** (:meth:`~chunkd.client.datasets.formats.Format.units`) are runs of whole
samples in tar order, cut from the index alone: consecutive samples while their bytes
of the tar (from the unit's first file's data to its last file's end, the headers
between included) plus their keys and 4 bytes a column a row stay within
:data:`~chunkd.client.datasets.formats.UNIT_BYTES` (8 MiB); a sample that costs more
alone is a unit alone, so a unit is over 8 MiB (or over ``MAX_UNIT_BYTES``) only where
one sample is. A unit's decoded bytes are that cost, and its byte range that one span
of the tar: decoding it is one read, the headers between its files skipped (but their
checksums checked: a header that fails it is damage).

A unit decodes (:meth:`WebDataset.decode`) to a table of ``__key__`` (``string``) then
one ``binary`` column per extension the **member's** index holds, sorted, null where a
sample has no file of it (an empty file is ``b""``, not null). Members of one dataset
may hold other extensions: the loader combines the units' tables of a batch by name
(``concat_tables(promote_options="permissive")``), a column a unit lacks being null.
``columns=`` gives exactly the columns asked, in that order: ``__key__`` only if asked,
and an extension the member lacks as a column of nulls (not an error: another member's
samples may have it); a name no extension can have (not lowercase, empty, or with a
``/``) is refused. :meth:`WebDataset.sample` gives today's dict: ``__key__`` and the
extensions present (sorted; nulls left out). A key that is not UTF-8 (a tar name
read with ``surrogateescape``) keeps its bytes in the column and its ``str`` in the
dict. A tar that ends inside a unit's files is refused
(:class:`~chunkd.errors.DatasetFormatError`), as before.

Member ``meta``:

``index``
    ``[[key, [[ext, offset, size], ...]], ...]``: per sample, in tar order, its key and
    each of its files' extension and data byte range.

It is one job at ~600 lines: the WebDataset format's hooks, and the tar header walk
they and the inspector's tar view share (:func:`tar_files`).
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from chunkd.client.datasets.formats import UNIT_BYTES, DecodedLRU, FormatBase
from chunkd.errors import DatasetFormatError

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping

    from chunkd.client.datasets.findings import Finding
    from chunkd.client.datasets.source import Source
    from chunkd.snapshot import Member

__all__ = [
    "FORMAT",
    "KEY",
    "MAX_EXTENDED_BYTES",
    "WebDataset",
    "extensions",
    "split_name",
    "tar_files",
]

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
#: the column of the samples' keys
KEY: Final = "__key__"
#: an Arrow binary array's values are at most this many bytes (its offsets are int32)
_MAX_ARRAY_BYTES: Final = (1 << 31) - 1

#: members' units (:class:`_Plan`), kept per process
_PLANS = DecodedLRU(64 << 20, 1024)


def _arrow() -> Any:
    return importlib.import_module("pyarrow")


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


class WebDataset(FormatBase):
    """The ``wds`` format (see the module docstring)."""

    name = "wds"
    version = 1
    suffixes = (".tar",)

    def scan(self, source: Source, member: Member, options: Mapping[str, Any]) -> Member:
        index: list[list[Any]] = []
        current: list[Any] | None = None
        exts: set[str] = set()
        for path, offset, size in tar_files(source, member):
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

    def schema(self, members: list[Member]) -> Any:
        return sorted(extensions(members))

    def check(
        self, source: Source, members: Sequence[Member], schema_of: Any, *, deep: bool
    ) -> Iterable[Finding]:
        """``extensions-differ`` (a tar whose samples lack extensions others have, or
        add some), then ``duplicate-key``: inside a tar (errors) and across tars
        (warnings). From the manifest alone."""
        yield from _extensions_differ(members)
        yield from _duplicate_keys(members)

    def units(self, member: Member) -> list[int]:
        firsts = _plan(member).firsts
        return [later - earlier for earlier, later in itertools.pairwise(firsts)]

    def unit_bytes(self, member: Member) -> list[int]:
        return list(_plan(member).costs)

    def unit_ranges(self, member: Member, unit: int) -> list[tuple[int, int]]:
        offset, length = _plan(member).span(member, unit)
        return [(offset, length)] if length else []

    def decode(
        self, source: Source, member: Member, unit: int, columns: Sequence[str] | None
    ) -> Any:
        pa = _arrow()
        name = source.name(member)
        plan = _plan(member)
        asked = _asked(name, plan.extensions, columns)
        offset, length = plan.span(member, unit)
        first, stop = plan.firsts[unit], plan.firsts[unit + 1]
        samples = member.meta["index"][first:stop]
        if length > _MAX_ARRAY_BYTES:
            raise DatasetFormatError(
                f"{name}: the sample {samples[0][0]!r} spans {length} bytes of the tar, more "
                f"than an Arrow binary column holds ({_MAX_ARRAY_BYTES}): it is not read"
            )
        if not asked:  # no column: only the row count, which the manifest knows
            return pa.table({KEY: pa.nulls(len(samples), pa.string())}).select([])
        wanted = list(dict.fromkeys(column for column in asked if column != KEY))
        files = {}
        if wanted:
            data = self._data(source, member, samples, offset, length)
            files = _columns(data, offset, samples, wanted)
        if KEY in asked:
            files[KEY] = _keys([str(key) for key, _ in samples])
        return pa.Table.from_arrays([files[column] for column in asked], names=list(asked))

    def sample(self, table: Any, row: int) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for column, values in zip(table.column_names, table.columns, strict=True):
            value = values[row]
            if not value.is_valid:
                continue  # the sample has no file of that extension
            if column == KEY:
                found[column] = _key(value)
            else:
                found[column] = value.as_py()
        return found

    def _data(
        self, source: Source, member: Member, samples: list[Any], offset: int, length: int
    ) -> memoryview:
        data = source.read(member, offset, length)
        if len(data) != length:
            # The file whose data the read ends inside, for the message.
            end = offset + len(data)
            key, ext = next(
                (key, ext)
                for key, files in samples
                for ext, at, size in files
                if int(at) + int(size) > end
            )
            raise DatasetFormatError(
                f"{source.name(member)} ends inside the data of {key}.{ext}: it is not "
                "the file that was registered; register the dataset again"
            )
        _check_headers(source.name(member), data, offset, samples)
        return data


# -- checking ----------------------------------------------------------------------------


def _extensions_differ(tars: Sequence[Member]) -> Iterator[Finding]:
    from chunkd.client.datasets.findings import Finding

    every = set(extensions(tars))
    for member in tars:
        mine = set(extensions([member]))
        if member.samples and mine != every:
            lacks, adds = sorted(every - mine), sorted(mine - every)
            yield Finding(
                "warning",
                member.key,
                "extensions-differ",
                "its samples "
                + "; ".join(
                    part
                    for part in (
                        f"lack {', '.join(lacks)}" if lacks else "",
                        f"add {', '.join(adds)}" if adds else "",
                    )
                    if part
                )
                + " (other tars of the dataset differ)",
            )


def _duplicate_keys(tars: Sequence[Member]) -> Iterator[Finding]:
    """Keys repeated inside a tar (errors), and across tars (warnings), in memory
    proportional to the sample count (8 bytes a key, plus a member number)."""
    from chunkd.client.datasets.findings import Finding

    hashes: list[np.ndarray[Any, np.dtype[np.uint64]]] = []
    owners: list[np.ndarray[Any, np.dtype[np.int32]]] = []
    for number, member in enumerate(tars):
        keys = [str(sample[0]) for sample in member.meta.get("index", [])]
        repeated = [key for key, n in Counter(keys).items() if n > 1]
        if repeated:
            shown = ", ".join(repr(k) for k in repeated[:3]) + (
                ", ..." if len(repeated) > 3 else ""
            )
            yield Finding(
                "error",
                member.key,
                "duplicate-key",
                f"{len(repeated)} keys name more than one sample ({shown}): their files are "
                "not adjacent in the tar, or an extension repeats; write each sample's "
                "files together, once",
            )
        unique = sorted(set(keys))
        hashes.append(np.fromiter((_hash(k) for k in unique), np.uint64, len(unique)))
        owners.append(np.full(len(unique), number, np.int32))
    if len(tars) < 2:
        return
    every = np.concatenate(hashes)
    who = np.concatenate(owners)
    order = np.argsort(every, kind="stable")
    every, who = every[order], who[order]
    same = np.flatnonzero(every[1:] == every[:-1])
    if not len(same):
        return
    suspects = set(every[same].tolist())
    places: dict[str, set[int]] = defaultdict(set)
    for number, member in enumerate(tars):
        for sample in member.meta.get("index", []):
            key = str(sample[0])
            if _hash(key) in suspects:
                places[key].add(number)
    for key, numbers in places.items():
        if len(numbers) > 1:
            names = sorted(tars[n].key for n in numbers)
            for name in names[1:]:
                yield Finding(
                    "warning", name, "duplicate-key", f"key {key!r} is also a sample of {names[0]}"
                )


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def extensions(members: Sequence[Member]) -> Counter[str]:
    """How many samples of ``members`` hold each extension."""
    found: Counter[str] = Counter()
    for member in members:
        for _, files in member.meta.get("index", []):
            found.update({ext for ext, _, _ in files})
    return found


FORMAT = WebDataset()


# -- units -------------------------------------------------------------------------------


class _Plan:
    """A member's units, from its index: each unit's first sample (then the count),
    its decoded bytes, and the member's extensions (sorted)."""

    __slots__ = ("costs", "extensions", "firsts")

    def __init__(self, member: Member) -> None:
        index = member.meta["index"]
        self.extensions = sorted({str(ext) for _, files in index for ext, _, _ in files})
        # A row costs its key, and an offset (and a validity bit) in every column.
        row = 4 * (len(self.extensions) + 2)
        self.firsts = [0] if index else []
        self.costs: list[int] = []
        start = cost = 0
        for j, (key, files) in enumerate(index):
            begin = int(files[0][1])
            end = int(files[-1][1]) + int(files[-1][2])
            if j == 0:
                start = begin
            # What the sample adds: its bytes of the tar (headers included), its row.
            more = end - start + len(key) + row
            if j > self.firsts[-1] and cost + more > UNIT_BYTES:
                self.firsts.append(j)
                self.costs.append(cost)
                cost, more = 0, end - begin + len(key) + row
            cost += more
            start = end
        if index:
            self.firsts.append(len(index))
            self.costs.append(cost)

    def span(self, member: Member, unit: int) -> tuple[int, int]:
        """Unit ``unit``'s bytes of the tar: from its first file's data to its last
        file's end (the headers between are read and skipped)."""
        if not 0 <= unit < len(self.firsts) - 1:
            raise IndexError(f"unit {unit} of {member.key}, which has {len(self.costs)}")
        index = member.meta["index"]
        first = index[self.firsts[unit]][1][0]
        last = index[self.firsts[unit + 1] - 1][1][-1]
        return int(first[1]), int(last[1]) + int(last[2]) - int(first[1])


def _plan(member: Member) -> _Plan:
    """``member``'s units (kept per process)."""
    index = member.meta["index"]
    # The manifest's identity of the member, and enough of its index to tell apart two
    # members that only a hand-made manifest would give the same key and version.
    key = (member.key, member.version, member.size, member.samples, len(index),
           repr(index[-1]) if index else None, UNIT_BYTES)  # fmt: skip
    plan: _Plan | None = _PLANS.get(key)
    if plan is None:
        plan = _Plan(member)
        _PLANS.put(key, plan, 256 + 16 * len(plan.firsts))
    return plan


def _asked(name: str, extensions: list[str], columns: Sequence[str] | None) -> list[str]:
    if columns is None:
        return [KEY, *extensions]
    for column in columns:
        # An extension this member lacks is a column of nulls (another member's samples
        # may have it); a name no extension can have is not a column.
        if column != KEY and (not column or column != column.lower() or "/" in column):
            raise DatasetFormatError(
                f"{name} has no column {column!r}: a WebDataset member's columns are "
                f"{KEY!r} and its files' extensions (lowercase), here "
                f"{', '.join(extensions) or 'none'}"
            )
    return list(columns)


def _keys(keys: list[str]) -> Any:
    """The samples' keys as a string array (a key that is not UTF-8, held as
    ``surrogateescape`` gives it, keeps its bytes: :func:`_key` gives it back)."""
    pa = _arrow()
    try:
        return pa.array(keys, pa.string())
    except UnicodeEncodeError:
        raw = [key.encode("utf-8", "surrogateescape") for key in keys]
        offsets = np.zeros(len(raw) + 1, dtype=np.int32)
        np.cumsum([len(k) for k in raw], out=offsets[1:])
        values = pa.py_buffer(b"".join(raw))
        return pa.Array.from_buffers(pa.string(), len(raw), [None, pa.py_buffer(offsets), values])


def _key(value: Any) -> str:
    try:
        key: str = value.as_py()
    except UnicodeDecodeError:  # a tar name that is not UTF-8 (see _keys)
        key = value.cast(_arrow().binary()).as_py().decode("utf-8", "surrogateescape")
    return key


def _check_headers(name: str, data: memoryview, offset: int, samples: list[Any]) -> None:
    """Raise if a tar header read between the files of ``samples`` (``data`` from byte
    ``offset`` of the tar) has a bad checksum: the bytes are not what was registered."""
    at = [int(o) - offset - _BLOCK for _, files in samples for _, o, _ in files][1:]
    if not at:
        return
    # The range starts at a file's data, so its headers lie on whole 512-byte blocks.
    raw = np.frombuffer(data, dtype=np.uint8)
    blocks = raw[: len(raw) // _BLOCK * _BLOCK].reshape(-1, _BLOCK)[np.array(at) // _BLOCK]
    field = blocks[:, 148:156]
    unsigned = blocks.sum(axis=1, dtype=np.int64) - field.sum(axis=1, dtype=np.int64) + 8 * 0x20
    high = (blocks >= 0x80).sum(axis=1) - (field >= 0x80).sum(axis=1)
    signed = unsigned - 256 * high
    for k, stored in enumerate(field):
        digits = bytes(stored).split(b"\0", 1)[0].strip(b" \0")
        try:
            value = int(digits or b"0", 8)
        except ValueError:
            value = -1
        if value not in (int(unsigned[k]), int(signed[k])):
            raise DatasetFormatError(
                f"{name}: the tar header at byte {offset + at[k]} has a bad checksum: the "
                "file is not the one that was registered; register the dataset again"
            )


def _columns(data: memoryview, offset: int, samples: list[Any], exts: list[str]) -> dict[str, Any]:
    """The files of each extension of ``exts`` in ``samples`` (``data`` from byte
    ``offset`` of the tar) as binary arrays: null where a sample has no such file."""
    pa = _arrow()
    rows = len(samples)
    # per extension: each row's size + 1 (0: no file), and the files' bytes in order
    sizes = {ext: np.zeros(rows, dtype=np.int64) for ext in exts}
    parts: dict[str, list[memoryview]] = {ext: [] for ext in exts}
    for row, (_, files) in enumerate(samples):
        for ext, at, size in files:
            found = sizes.get(ext)
            if found is not None:
                begin = int(at) - offset
                parts[ext].append(data[begin : begin + int(size)])
                found[row] = int(size) + 1
    arrays = {}
    for ext in exts:
        lengths = sizes[ext]
        present = lengths > 0
        lengths[present] -= 1
        offsets = np.zeros(rows + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        nulls = rows - int(present.sum())
        validity = pa.py_buffer(np.packbits(present, bitorder="little")) if nulls else None
        values = pa.py_buffer(b"".join(parts[ext]))
        arrays[ext] = pa.Array.from_buffers(
            pa.binary(), rows, [validity, pa.py_buffer(offsets), values], null_count=nulls
        )
    return arrays


# -- tar headers -------------------------------------------------------------------------


def tar_files(source: Source, member: Member) -> Iterator[tuple[str, int, int]]:
    """The regular files of a tar member: (path, data offset, size), in tar order, each
    header read as the walk reaches it (the inspector pages a tar by taking it only as far
    as it needs)."""
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
