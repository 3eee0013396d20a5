"""MosaicML Streaming members (MDS shards): one sample per MDS sample, as a dict
``{column: value}`` decoded per its column's encoding.

A dataset folder of MDS holds an ``index.json`` (version 2) and shard files; each
shard file it lists is a member. Registration passes the folder's parsed
``index.json`` as ``options["mds_index"]`` and the member's path relative to that
folder as ``options["mds_basename"]``; the index's entry for the shard gives its
columns, its sample count and its compression.

**A shard** (as Streaming's ``MDSWriter`` writes it, little-endian): ``n`` (uint32),
``n + 1`` sample offsets (uint32, from the start of the shard; the last is its size),
the writer's config as JSON, then the samples. A sample is the uint32 sizes of its
variable-size columns (a column whose ``column_sizes`` entry is null or 0), in column
order, then each column's bytes. Uncompressed shards (``raw_data``) are read in place:
a sample is one ranged read (two where the offsets are not all recorded). A compressed
shard (``zip_data``: ``.mds.zstd``, ``.mds.gz``, ``.mds.bz2``) cannot be read in
place: reading any of its samples decompresses the whole shard, which is kept in a
per-process LRU of at most :data:`CACHE_BYTES`; a shard bigger than that is
decompressed from its start for each sample read. A compressed shard's decoded bytes
(:meth:`~chunkd.client.datasets.formats.Format.unit_bytes`) are its raw size, so that
the read order's windows hold at most that bound of shards. Streaming's own reader does the
same, decompressing each shard whole to its local cache. Brotli and snappy shards are
refused: decompress them, or write them with zstd.

**Decoded values**: ``bytes``, ``str``, ``int`` (a Python int), ``int8`` .. ``int64``,
``uint8`` .. ``uint64`` and ``float16`` .. ``float64`` (numpy scalars, as Streaming
gives them), ``str_int``, ``str_float``, ``str_decimal``, ``json`` and ``ndarray``
(``ndarray[:dtype[:shape]]``, a read-only numpy array) decode as Streaming decodes
them. ``jpeg``, ``png`` and ``pil`` images are given as their raw bytes (no image
library is imported), and ``pkl`` as its raw bytes: **never unpickled** (unpickling
runs code); call ``pickle.loads`` on them yourself if you trust the data.

Member ``meta``:

``columns``
    ``[[name, encoding, size], ...]``: the shard's columns as its index entry lists
    them (``size``: the fixed size in bytes, or null for a variable-size column).
``offsets``
    every ``stride``-th sample's offset in the (decompressed) shard, then the end of
    the last sample: at most 1025 numbers, however many samples the shard holds.
``stride``
    the step of ``offsets``: 1 where every sample's offset is recorded.
``compression``
    a compressed shard's compression as its index entry gives it (``zstd``,
    ``zstd:7``, ``gz``, ...); absent for a shard read in place.
``raw_bytes``
    a compressed shard's decompressed size.
"""

from __future__ import annotations

import bz2
import functools
import gzip
import json
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from decimal import Decimal
from typing import TYPE_CHECKING, Any, BinaryIO, Final, Protocol

import numpy as np
import zstandard

from chunkd.client.datasets.formats import DECODED_CACHE_BYTES, DecodedLRU
from chunkd.errors import DatasetFormatError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from chunkd.client.datasets.source import Source
    from chunkd.snapshot import Member

__all__ = [
    "CACHE_BYTES",
    "ENCODINGS",
    "FORMAT",
    "MAX_OFFSETS",
    "MdsShards",
    "decode_sample",
    "decoder",
]

#: decompressed shards kept per process (bytes) ...
CACHE_BYTES: Final = DECODED_CACHE_BYTES
#: ... and at most this many
_CACHE_ITEMS: Final = 16
#: a member records at most this many sample offsets (plus the end)
MAX_OFFSETS: Final = 1024
#: the offsets table is read this many bytes at a time
_TABLE_BYTES: Final = 4 << 20
_UINT32: Final = struct.Struct("<I")

_CACHE = DecodedLRU(CACHE_BYTES, _CACHE_ITEMS)


def _scalar(dtype: str) -> Callable[[bytes], Any]:
    kind = np.dtype(dtype)
    return lambda data: np.frombuffer(data, kind)[0]


def _utf8(data: bytes) -> str:
    return data.decode("utf-8")


#: the column encodings read, by name (an ``ndarray`` encoding takes arguments)
ENCODINGS: Final[dict[str, Callable[[bytes], Any]]] = {
    "bytes": bytes,
    "str": _utf8,
    "int": lambda data: int.from_bytes(data, "little", signed=True),
    **{t: _scalar(t) for t in ("int8", "int16", "int32", "int64")},
    **{t: _scalar(t) for t in ("uint8", "uint16", "uint32", "uint64")},
    **{t: _scalar(t) for t in ("float16", "float32", "float64")},
    "str_int": lambda data: int(_utf8(data)),
    "str_float": lambda data: float(_utf8(data)),
    "str_decimal": lambda data: Decimal(_utf8(data)),
    "json": lambda data: json.loads(_utf8(data)),
    # Images as their raw bytes; a pickle is never unpickled (see the module docstring).
    "jpeg": bytes,
    "png": bytes,
    "pil": bytes,
    "pkl": bytes,
}

# Streaming's ndarray dtype codes (encodings.py: NDArray._int2value_dtype, _int2shape_dtype).
_ARRAY_DTYPES: Final = {
    8: "uint8",
    9: "int8",
    16: "uint16",
    17: "int16",
    18: "float16",
    32: "uint32",
    33: "int32",
    34: "float32",
    64: "uint64",
    65: "int64",
    66: "float64",
}
_SHAPE_DTYPES: Final = ("uint8", "uint16", "uint32", "uint64")


def _ndarray(arguments: str) -> Callable[[bytes], Any]:
    """The decoder of ``ndarray[:dtype[:shape]]``."""
    parts = arguments.split(":") if arguments else []
    if len(parts) > 2 or (parts and parts[0] not in _ARRAY_DTYPES.values()):
        raise ValueError(f"ndarray:{arguments}")
    dtype = parts[0] if parts else None
    shape = tuple(int(d) for d in parts[1].split(",")) if len(parts) == 2 else None

    def decode(data: bytes) -> Any:
        at = 0
        kind = dtype
        if kind is None:
            kind = _ARRAY_DTYPES[data[at]]
            at += 1
        dims: Any = shape
        if dims is None:
            byte = data[at]
            at += 1
            ndim, shape_kind = byte >> 2, byte & 3
            width = 1 << shape_kind
            dims = tuple(np.frombuffer(data, _SHAPE_DTYPES[shape_kind], ndim, at).tolist())
            at += ndim * width
        return np.frombuffer(data, kind, offset=at).reshape(dims)

    return decode


@functools.lru_cache(maxsize=256)
def decoder(encoding: str) -> Callable[[bytes], Any]:
    """The decoder of an MDS column encoding.

    Raises:
        ValueError: chunkd does not read that encoding.
    """
    family, _, arguments = encoding.partition(":")
    if family == "ndarray":
        return _ndarray(arguments)
    if family == "jpeg" or (family in ENCODINGS and not arguments):
        return ENCODINGS[family]
    raise ValueError(encoding)


def decode_sample(columns: list[list[Any]], data: bytes) -> dict[str, Any]:
    """An MDS sample's bytes as ``{column: value}``, ``columns`` as a member records them.

    Raises:
        ValueError: the bytes are shorter than their columns say.
    """
    sizes = []
    at = 0
    for _, _, size in columns:
        if size:
            sizes.append(int(size))
        else:
            if at + 4 > len(data):
                raise ValueError("the sample ends inside its column sizes")
            sizes.append(_UINT32.unpack_from(data, at)[0])
            at += 4
    sample = {}
    for (column, encoding, _), size in zip(columns, sizes, strict=True):
        if at + size > len(data):
            raise ValueError(f"the sample ends inside its column {column!r}")
        sample[column] = decoder(encoding)(data[at : at + size])
        at += size
    return sample


class MdsShards:
    """The ``mds`` format (see the module docstring)."""

    name = "mds"

    def scan(self, source: Source, member: Member, options: Mapping[str, Any]) -> Member:
        name = source.name(member)
        entry = _entry(name, options)
        columns = _columns(name, entry)
        raw, zipped = _part(name, entry, "raw_data"), _part(name, entry, "zip_data")
        basename = options["mds_basename"]
        packed = bool(zipped) and zipped.get("basename") == basename
        recorded = (zipped if packed else raw).get("bytes")
        if isinstance(recorded, int) and recorded != member.size:
            raise DatasetFormatError(
                f"{name} holds {member.size} bytes, but its index.json says {recorded}: "
                "it is truncated, or the index is of another version of the dataset"
            )
        meta: dict[str, Any] = {"columns": columns}
        if packed:
            compression = str(entry.get("compression") or "")
            _family(name, compression)
            raw_bytes = raw.get("bytes")
            if not isinstance(raw_bytes, int) or raw_bytes < 4:
                raise DatasetFormatError(
                    f"{name}: its index.json entry gives no decompressed size (raw_data.bytes)"
                )
            meta.update(compression=compression, raw_bytes=raw_bytes)
            reader: Any = _Stream(_decompressor(name, compression, source.file(member)))
            size = raw_bytes
        else:
            reader = _Ranged(source, member)
            size = member.size
        samples, stride, offsets = _offsets(name, reader, size)
        if samples != entry.get("samples", samples):
            raise DatasetFormatError(
                f"{name} holds {samples} samples, but its index.json says "
                f"{entry.get('samples')}: the index is of another version of the dataset"
            )
        meta.update(offsets=offsets, stride=stride)
        return replace(member, samples=samples, meta=meta)

    def read(self, source: Source, member: Member, index: int) -> dict[str, Any]:
        name = source.name(member)
        if not 0 <= index < member.samples:
            raise IndexError(f"sample {index} of {member.key}, which holds {member.samples}")
        if "compression" in member.meta:
            data = self._packed_sample(source, member, index)
        else:
            begin, end = self._bounds(source, member, index)
            data = bytes(source.read(member, begin, end - begin))
            if len(data) != end - begin:
                raise DatasetFormatError(f"{name} ends inside sample {index}")
        try:
            return decode_sample(member.meta["columns"], data)
        except (ValueError, KeyError, IndexError) as exc:  # an ndarray's unknown dtype code
            raise DatasetFormatError(
                f"{name}: sample {index} cannot be decoded ({exc}): the shard is damaged"
            ) from None

    def ranges(self, member: Member, index: int) -> list[tuple[int, int]]:
        if "compression" in member.meta:
            return [(0, member.size)]
        offsets, stride = member.meta["offsets"], int(member.meta["stride"])
        if stride == 1:
            return [(int(offsets[index]), int(offsets[index + 1]) - int(offsets[index]))]
        j = index // stride
        span = (int(offsets[j]), int(offsets[j + 1]) - int(offsets[j]))
        return [(4 + 4 * index, 8), span]

    def schema(self, members: list[Member]) -> Any:
        found = Counter(
            tuple((str(c[0]), str(c[1])) for c in m.meta["columns"])
            for m in members
            if "columns" in m.meta
        )
        if not found:
            return None
        return [list(column) for column in found.most_common(1)[0][0]]

    def unit_bytes(self, member: Member) -> list[int] | None:
        # a shard is one unit; a compressed one is decompressed whole
        raw = member.meta.get("raw_bytes")
        return None if raw is None else [int(raw)]

    # -- reading -----------------------------------------------------------------------

    def _bounds(self, source: Source, member: Member, index: int) -> tuple[int, int]:
        offsets, stride = member.meta["offsets"], int(member.meta["stride"])
        if stride == 1:
            return int(offsets[index]), int(offsets[index + 1])
        pair = bytes(source.read(member, 4 + 4 * index, 8))
        if len(pair) != 8:
            raise DatasetFormatError(f"{source.name(member)} ends inside its offsets table")
        begin, end = struct.unpack("<II", pair)
        return begin, end

    def _packed_sample(self, source: Source, member: Member, index: int) -> bytes:
        name = source.name(member)
        raw_bytes = int(member.meta["raw_bytes"])
        compression = str(member.meta["compression"])
        if raw_bytes <= CACHE_BYTES:
            key = (name, member.version)
            whole: bytes | None = _CACHE.get(key)
            if whole is None:
                stream = _Stream(_decompressor(name, compression, source.file(member)))
                whole = stream.take(name, 0, raw_bytes)
                _CACHE.put(key, whole, raw_bytes)
            begin, end = struct.unpack_from("<II", whole, 4 + 4 * index)
            return whole[begin:end]
        # Too big to keep: decompressed from the start, as far as the sample.
        stream = _Stream(_decompressor(name, compression, source.file(member)))
        begin, end = struct.unpack("<II", stream.take(name, 4 + 4 * index, 8))
        return stream.take(name, begin, end - begin)


FORMAT = MdsShards()


# -- the shard and its index entry ---------------------------------------------------------


def _entry(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The ``index.json`` entry of the shard (from the registration's options)."""
    index, basename = options.get("mds_index"), options.get("mds_basename")
    if not isinstance(index, dict) or not isinstance(basename, str):
        raise DatasetFormatError(
            f"{name}: an MDS shard is registered from its dataset folder's index.json, "
            "and none was found beside it; register the folder that holds index.json"
        )
    if index.get("version") != 2 or not isinstance(index.get("shards"), list):
        raise DatasetFormatError(
            f"{name}: the index.json beside it is not a Streaming index of version 2 "
            f"(version {index.get('version')!r}); write the dataset with a current "
            "MDSWriter"
        )
    for entry in index["shards"]:
        if not isinstance(entry, dict):
            continue
        if basename in (_part(name, entry, "raw_data").get("basename"),
                        _part(name, entry, "zip_data").get("basename")):  # fmt: skip
            if entry.get("format") != "mds" or entry.get("version") != 2:
                raise DatasetFormatError(
                    f"{name}: its index.json entry is of format {entry.get('format')!r}, "
                    f"version {entry.get('version')!r}; chunkd reads MDS shards of version 2"
                )
            return entry
    raise DatasetFormatError(
        f"{name}: the index.json beside it does not list {basename!r}; it is not a shard "
        "of that dataset (leave it out of the prefix, or register with --skip-bad)"
    )


def _part(name: str, entry: Mapping[str, Any], part: str) -> Mapping[str, Any]:
    """``raw_data`` or ``zip_data`` of an index entry: an object, or {} for null."""
    found = entry.get(part) or {}
    if not isinstance(found, dict):
        raise DatasetFormatError(
            f"{name}: its index.json entry's {part} is not an object: the index is damaged"
        )
    return found


def _columns(name: str, entry: Mapping[str, Any]) -> list[list[Any]]:
    names, encodings = entry.get("column_names"), entry.get("column_encodings")
    sizes = entry.get("column_sizes")
    if not (
        isinstance(names, list)
        and isinstance(encodings, list)
        and isinstance(sizes, list)
        and len(names) == len(encodings) == len(sizes)
    ):
        raise DatasetFormatError(
            f"{name}: its index.json entry lacks matching column_names, column_encodings "
            "and column_sizes"
        )
    for column, size in zip(names, sizes, strict=True):
        if size is not None and (type(size) is not int or size < 0):
            raise DatasetFormatError(
                f"{name}: column {column!r} has the size {size!r:.40} in its index.json "
                "entry, not a whole number of bytes (or null)"
            )
    for column, encoding in zip(names, encodings, strict=True):
        try:
            decoder(str(encoding))
        except (ValueError, KeyError):
            raise DatasetFormatError(
                f"{name}: column {column!r} has the encoding {encoding!r}, which chunkd does "
                f"not read (it reads {', '.join(ENCODINGS)} and ndarray)"
            ) from None
    return [
        [str(n), str(e), int(s) if s else None]
        for n, e, s in zip(names, encodings, sizes, strict=True)
    ]


def _offsets(name: str, reader: Any, size: int) -> tuple[int, int, list[int]]:
    """The sample count, the stride and the sampled offsets of a shard's header."""
    head = reader.take(name, 0, 4)
    (samples,) = _UINT32.unpack(head)
    table = 4 * (samples + 1)
    if 4 + table > size:
        raise DatasetFormatError(
            f"{name} says it holds {samples} samples, whose offsets alone would take more "
            f"than its {size} bytes: it is not an MDS shard, or it is damaged"
        )
    stride = max(1, -(-samples // MAX_OFFSETS))
    sampled: list[int] = []
    last = 4 + table
    at = 0  # the next sample whose offset is read
    while at <= samples:
        count = min(samples + 1 - at, _TABLE_BYTES // 4)
        values = np.frombuffer(reader.take(name, 4 + 4 * at, 4 * count), dtype="<u4")
        values = values.astype(np.int64)
        if len(values) and (int(values[0]) < last or bool(np.any(np.diff(values) < 0))):
            raise DatasetFormatError(
                f"{name}: its sample offsets are out of order: it is not an MDS shard, or "
                "it is damaged"
            )
        sampled += values[(-at) % stride :: stride].tolist()
        last = int(values[-1])
        at += count
    if samples % stride:
        sampled.append(last)
    if last != size:
        raise DatasetFormatError(
            f"{name}: its last sample ends at byte {last}, but it holds {size} bytes: it is "
            "truncated or damaged"
        )
    return samples, stride, sampled


class _Ranged:
    """A shard read in place: ranges through the source."""

    def __init__(self, source: Source, member: Member) -> None:
        self._source = source
        self._member = member

    def take(self, name: str, offset: int, length: int) -> bytes:
        data = bytes(self._source.read(self._member, offset, length))
        if len(data) != length:
            raise DatasetFormatError(f"{name} ends at byte {offset + len(data)}: it is truncated")
        return data


class _Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


class _Stream:
    """A compressed shard, decompressed forwards only."""

    def __init__(self, reader: _Readable) -> None:
        self._reader = reader
        self._position = 0

    def take(self, name: str, offset: int, length: int) -> bytes:
        try:
            while self._position < offset:
                skipped = self._reader.read(min(offset - self._position, _TABLE_BYTES))
                if not skipped:
                    break
                self._position += len(skipped)
            out = bytearray()
            while len(out) < length:
                piece = self._reader.read(length - len(out))
                if not piece:
                    break
                out += piece
        except (OSError, EOFError, zstandard.ZstdError) as exc:
            raise DatasetFormatError(
                f"{name} cannot be decompressed ({exc}): it is damaged or truncated; write it again"
            ) from None
        self._position += len(out)
        if self._position < offset or len(out) != length:
            raise DatasetFormatError(
                f"{name} decompresses to fewer bytes than its index.json says: it is "
                "truncated or damaged"
            )
        return bytes(out)


def _family(name: str, compression: str) -> str:
    family = compression.partition(":")[0]
    if family not in ("zstd", "gz", "bz2"):
        raise DatasetFormatError(
            f"{name} is compressed with {compression!r}, which chunkd does not decompress "
            "(it reads zstd, gz and bz2 shards): write the dataset with compression "
            "'zstd', or without compression to read it in place"
        )
    return family


def _decompressor(name: str, compression: str, file: BinaryIO) -> _Readable:
    family = _family(name, compression)
    if family == "zstd":
        reader: _Readable = zstandard.ZstdDecompressor().stream_reader(
            file, read_across_frames=True
        )
        return reader
    if family == "gz":
        return gzip.GzipFile(fileobj=file, mode="rb")
    return bz2.BZ2File(file, mode="rb")
