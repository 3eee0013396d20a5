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
order, then each column's bytes.

**Units** (:meth:`~chunkd.client.datasets.formats.Format.units`) are runs of whole
samples, cut from the manifest alone at the recorded offsets (every ``stride``-th
sample's): consecutive groups while their bytes plus 4 bytes a column a row stay
within :data:`~chunkd.client.datasets.formats.UNIT_BYTES` (8 MiB) in a shard read in
place, and within :data:`STREAMED_UNIT_BYTES` (128 MiB) in a compressed one; a group
that costs more alone is a unit alone (possible only in a shard of over 1024 samples,
whose groups are more than one sample). A unit's decoded bytes are that cost.
Uncompressed shards (``raw_data``) are read in place: a unit is one ranged read of its
samples (two where the offsets are not all recorded: its part of the offsets table
too). A compressed shard (``zip_data``: ``.mds.zstd``, ``.mds.gz``, ``.mds.bz2``)
cannot be read in place, so each of its units' byte range is the whole shard: decoding
a unit decompresses the shard whole and keeps it in a per-process LRU of at most
:data:`CACHE_BYTES` (256 MiB) and two shards, so the shard's next units decompress
nothing; a shard bigger than that is decompressed from its start as far as each unit's
end, keeping none of it. A shard of up to 128 MiB decompressed (Streaming writes 64 MiB
ones by default) is one unit, decompressed once an epoch, as Streaming's own reader
does. Brotli and snappy shards are refused: decompress them, or write them with zstd.

A unit decodes (:meth:`MdsShards.decode`) to a table of one column per MDS column, in
the shard's order: ``int8`` .. ``uint64`` and ``float16`` .. ``float64`` as the Arrow
type of the same name, ``int`` as ``int64``, ``str`` as ``string`` (refused as damaged
if it is not UTF-8), every other encoding as ``binary``: the encoded bytes (a scalar
encoding whose recorded size is not its type's is ``binary`` too). Each field's
metadata holds its encoding under ``mds.encoding`` (:data:`ENCODING`), and the
schema's metadata all of them as JSON (``mds.encodings``, :data:`SCHEMA_ENCODINGS`),
which :meth:`MdsShards.sample` reads to give each value as before (below); a column of
neither (not one decode made) is given as Arrow gives it. The columns are
gathered by numpy from the samples' bytes and the sizes at their starts, with no Python
per sample; a sample whose bytes end inside its columns, or offsets other than those
recorded, are refused as damaged (:class:`~chunkd.errors.DatasetFormatError`).

**Decoded values** (:meth:`MdsShards.sample`, ``Dataset[i]``): ``bytes``, ``str``,
``int`` (a Python int), ``int8`` .. ``int64``, ``uint8`` .. ``uint64`` and ``float16``
.. ``float64`` (numpy scalars, as Streaming gives them), ``str_int``, ``str_float``,
``str_decimal``, ``json`` and ``ndarray`` (``ndarray[:dtype[:shape]]``, a read-only
numpy array) decode as Streaming decodes them. ``jpeg``, ``png`` and ``pil`` images
are given as their raw bytes (no image library is imported), and ``pkl`` as its raw
bytes: **never unpickled** (unpickling runs code); call ``pickle.loads`` on them
yourself if you trust the data. A ``binary`` column's value that its encoding cannot
decode (bad JSON, an unknown ndarray dtype code) raises a
:class:`~chunkd.errors.DatasetFormatError` when that sample is taken.

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

It is one job at ~1,000 lines: the MDS format, every hook of it (scan, units, decode,
read, check) over one shard layout and one index entry; the column encodings, the unit
plan and the shard's reading are the parts of that one format, sharing its meta, and
the format's reading speed is the loader-speed work's.
"""

from __future__ import annotations

import bz2
import functools
import gzip
import importlib
import itertools
import json
import posixpath
import struct
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from decimal import Decimal
from typing import TYPE_CHECKING, Any, BinaryIO, Final, Protocol

import numpy as np
import zstandard

from chunkd.client.datasets.formats import (
    DECODED_CACHE_BYTES,
    MAX_UNIT_BYTES,
    UNIT_BYTES,
    DecodedLRU,
    FormatBase,
)
from chunkd.errors import DatasetFormatError
from chunkd.snapshot import Member

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping

    from numpy.typing import NDArray

    from chunkd.client.datasets.findings import Finding
    from chunkd.client.datasets.source import Source

__all__ = [
    "CACHE_BYTES",
    "ENCODING",
    "ENCODINGS",
    "FORMAT",
    "MAX_INDEX_BYTES",
    "MAX_OFFSETS",
    "SCHEMA_ENCODINGS",
    "STREAMED_UNIT_BYTES",
    "MdsShards",
    "decode_sample",
    "decoder",
]

#: decompressed shards kept per process (bytes; a bigger shard is decompressed from its
#: start as far as each unit it is asked for) ...
CACHE_BYTES: Final = DECODED_CACHE_BYTES
#: ... and at most this many
_CACHE_ITEMS: Final = 2
#: a compressed shard's units decode to at most this (one group of ``stride`` samples
#: alone may be more): each unit decompresses the shard, so a shard of up to this size is
#: one unit
STREAMED_UNIT_BYTES: Final = MAX_UNIT_BYTES
#: an ``index.json`` of more than this is refused at registration (it is read whole and
#: parsed; 64 MiB lists about 100,000 shards)
MAX_INDEX_BYTES: Final = 64 << 20
#: the key of a decoded column's field metadata that holds its MDS encoding ...
ENCODING: Final = b"mds.encoding"
#: ... and of the table's schema metadata that holds every column's (JSON)
SCHEMA_ENCODINGS: Final = b"mds.encodings"
#: the MDS encodings decoded to Arrow numbers of the same type
_SCALARS: Final = {
    **{t: t for t in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")},
    **{t: t for t in ("uint64", "float16", "float32", "float64")},
    "int": "<i8",
}
#: values of at least this many bytes on average are gathered a slice each
_JOIN_BYTES: Final = 256
#: an Arrow binary array's values are at most this many bytes (its offsets are int32)
_MAX_ARRAY_BYTES: Final = (1 << 31) - 1
#: a member records at most this many sample offsets (plus the end)
MAX_OFFSETS: Final = 1024
#: the offsets table is read this many bytes at a time
_TABLE_BYTES: Final = 4 << 20
_UINT32: Final = struct.Struct("<I")

_CACHE = DecodedLRU(CACHE_BYTES, _CACHE_ITEMS)
#: members' units (:func:`_plan`), kept per process
_PLANS = DecodedLRU(16 << 20, 4096)
#: each decoded schema's converters (:func:`_converters`), and the last table's
_CONVERTERS: dict[tuple[bytes | None, tuple[str, ...]], list[tuple[str, Callable[[Any], Any]]]] = {}
_LAST: list[tuple[weakref.ref[Any], list[tuple[str, Callable[[Any], Any]]]] | None] = [None]


def _arrow() -> Any:
    return importlib.import_module("pyarrow")


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


class MdsShards(FormatBase):
    """The ``mds`` format (see the module docstring)."""

    name = "mds"
    version = 1
    suffixes = (".mds", ".mds.zstd", ".mds.gz", ".mds.bz2")
    # a sample decodes its fields' bytes further (ndarray, json, ...): not the columns
    columnar = False

    #: a dataset's shards are what its ``index.json`` files list (:meth:`members_of`)
    index_name = "index.json"

    def members_of(
        self, prefix: str, files: Sequence[Member], source: Source, options: Mapping[str, Any]
    ) -> Iterator[tuple[Member, dict[str, Any]]]:
        """The shards that the ``index.json`` files among ``files`` list, each with its
        index (``mds_index``) and its path from the index's folder (``mds_basename``).

        As Streaming reads them: an ``index.json`` at the prefix itself is the dataset's
        (a merged index names shards in folders below it, ``sub/shard.00000.mds``), and
        only without one is each folder's own index read. ``files`` come in key order,
        under ``prefix``.

        Raises:
            DatasetFormatError: no index, an index that is not JSON or lists no shards, or
                a shard it lists that is not among ``files``.
        """
        by_key = {member.key: member for member in files}
        indexes: dict[str, Any] = {}
        for member in files:
            folder, base = posixpath.split(member.key)
            if base != self.index_name:
                continue
            if member.size > MAX_INDEX_BYTES:
                # read whole and parsed (about 10 times its size in Python objects)
                raise DatasetFormatError(
                    f"{source.name(member)} is {member.size} bytes, more than the "
                    f"{MAX_INDEX_BYTES >> 20} MiB an MDS index may be: register the "
                    "dataset's folders apart, each with its own index.json"
                )
            text = bytes(source.read(member, 0, member.size))
            try:
                indexes[folder] = json.loads(text)
            except ValueError as exc:
                raise DatasetFormatError(
                    f"{source.name(member)} is not an MDS index: {exc}"
                ) from None
        if not indexes:
            raise DatasetFormatError(
                f"{_named(source, prefix)} holds no index.json: not a MosaicML Streaming "
                "(MDS) dataset"
            )
        root = prefix.rstrip("/")
        if root in indexes:
            indexes = {root: indexes[root]}
        for folder in sorted(indexes):
            index = indexes[folder]
            where = _named(source, posixpath.join(folder, self.index_name))
            shards = index.get("shards") if isinstance(index, dict) else None
            if not isinstance(shards, list):
                raise DatasetFormatError(f"{where} lists no shards")
            for shard in shards:
                if not isinstance(shard, dict):
                    raise DatasetFormatError(f"{where}: a shard is not an object")
                places = [shard.get("raw_data"), shard.get("zip_data")]
                basenames = [p.get("basename") for p in places if isinstance(p, dict)]
                found = [
                    b
                    for b in basenames
                    if isinstance(b, str) and posixpath.join(folder, b) in by_key
                ]
                if not found:
                    raise DatasetFormatError(
                        f"{where} lists shard {basenames[0] if basenames else shard!r}, which "
                        "is not there; copy the whole dataset, or rewrite its index"
                    )
                member = by_key[posixpath.join(folder, found[0])]
                yield (
                    replace(member, format=self.name),
                    {**options, "mds_index": index, "mds_basename": found[0]},
                )

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

    def units(self, member: Member) -> list[int]:
        firsts = _plan(member)[0]
        return [later - earlier for earlier, later in itertools.pairwise(firsts)]

    def unit_bytes(self, member: Member) -> list[int]:
        return list(_plan(member)[1])

    def unit_ranges(self, member: Member, unit: int) -> list[tuple[int, int]]:
        if "compression" in member.meta:
            return [(0, member.size)]
        first, stop, begin, end = _bounds(member, unit)
        found = [] if _all_offsets(member) else [(4 + 4 * first, 4 * (stop - first + 1))]
        return [*found, (begin, end - begin)] if end > begin else found

    def decode(
        self, source: Source, member: Member, unit: int, columns: Sequence[str] | None
    ) -> Any:
        pa = _arrow()
        name = source.name(member)
        recorded = [
            (str(c[0]), str(c[1]), int(c[2]) if c[2] else None) for c in member.meta["columns"]
        ]
        asked = _asked(name, recorded, columns)
        first, stop, begin, end = _bounds(member, unit)
        rows = stop - first
        if not asked:  # no column: only the row count, which the manifest knows
            return pa.table({"_": pa.nulls(rows, pa.binary())}).select([])
        offsets, data = self._unit(source, member, first, stop, begin, end)
        try:
            return _table(recorded, asked, np.frombuffer(data, np.uint8), offsets - begin)
        except _Damaged as exc:
            raise DatasetFormatError(
                f"{name}: sample {first + exc.row} cannot be decoded ({exc.what}): the shard "
                "is damaged"
            ) from None

    def sample(self, table: Any, row: int) -> dict[str, Any]:
        return {
            name: convert(values[row].as_py())
            for (name, convert), values in zip(_converters(table), table.columns, strict=True)
        }

    def schema(self, members: list[Member]) -> Any:
        found = Counter(
            tuple((str(c[0]), str(c[1])) for c in m.meta["columns"])
            for m in members
            if "columns" in m.meta
        )
        if not found:
            return None
        return [list(column) for column in found.most_common(1)[0][0]]

    def check(
        self, source: Source, members: Sequence[Member], schema_of: Any, *, deep: bool
    ) -> Iterable[Finding]:
        """``schema-differs`` (a shard's columns are not the dataset's), then
        ``compressed-shard-too-big`` (a compressed shard that decompresses to more than
        :data:`CACHE_BYTES`), from the manifest alone."""
        from chunkd.client.datasets.findings import Finding, columns_text, size_text

        if schema_of is not None:
            for member in members:
                if "columns" not in member.meta:
                    continue
                got = [[str(c[0]), str(c[1])] for c in member.meta["columns"]]
                if got != schema_of:
                    yield Finding(
                        "error",
                        member.key,
                        "schema-differs",
                        f"its columns {columns_text(got)} differ from the dataset's "
                        f"{columns_text(schema_of)}",
                    )
        for member in members:
            raw = int(member.meta.get("raw_bytes", 0)) if "compression" in member.meta else 0
            if raw > CACHE_BYTES:
                # Not kept: each unit decompresses the shard from its start to its own end.
                yield Finding(
                    "warning",
                    member.key,
                    "compressed-shard-too-big",
                    f"decompresses to {size_text(raw)}, more than the {size_text(CACHE_BYTES)} "
                    "kept per process: each unit read decompresses it from its start; write "
                    "smaller shards (size_limit), or without compression",
                )

    # -- reading -----------------------------------------------------------------------

    def _unit(
        self, source: Source, member: Member, first: int, stop: int, begin: int, end: int
    ) -> tuple[NDArray[np.int64], bytes | memoryview]:
        """The offsets of samples ``first .. stop`` (and the end of the last), and the
        bytes ``begin .. end`` of the (decompressed) shard that hold them."""
        name = source.name(member)
        count = stop - first
        if "compression" in member.meta:
            raw_bytes = int(member.meta["raw_bytes"])
            stream: Any
            if raw_bytes <= CACHE_BYTES:
                whole = self._whole(source, member)
                table = whole[4 + 4 * first : 4 + 4 * (stop + 1)]
                data: bytes | memoryview = memoryview(whole)[begin:end]
            else:
                # Too big to keep: decompressed from the start, as far as the unit's end.
                stream = _Stream(
                    _decompressor(name, str(member.meta["compression"]), source.file(member))
                )
                table = stream.take(name, 4 + 4 * first, 4 * (count + 1))
                data = stream.take(name, begin, end - begin)
        else:
            if _all_offsets(member):
                table = None
            else:
                table = _Ranged(source, member).take(name, 4 + 4 * first, 4 * (count + 1))
            data = _Ranged(source, member).take(name, begin, end - begin)
        if table is None:
            offsets = np.array(member.meta["offsets"][first : stop + 1], dtype=np.int64)
        else:
            if len(table) != 4 * (count + 1):
                raise DatasetFormatError(f"{name} ends inside its offsets table")
            offsets = np.frombuffer(table, dtype="<u4").astype(np.int64)
        if (
            int(offsets[0]) != begin
            or int(offsets[-1]) != end
            or bool(np.any(np.diff(offsets) < 0))
        ):
            raise DatasetFormatError(
                f"{name}: the offsets of samples {first}..{stop} are not those recorded: the "
                "shard is not what was registered; register the dataset again"
            )
        return offsets, data

    def _whole(self, source: Source, member: Member) -> bytes:
        """A compressed shard, decompressed (kept per process)."""
        name = source.name(member)
        key = (name, member.version)
        whole: bytes | None = _CACHE.get(key)
        if whole is None:
            raw_bytes = int(member.meta["raw_bytes"])
            stream = _Stream(
                _decompressor(name, str(member.meta["compression"]), source.file(member))
            )
            whole = stream.take(name, 0, raw_bytes)
            _CACHE.put(key, whole, raw_bytes)
        return whole


FORMAT = MdsShards()


# -- units -------------------------------------------------------------------------------


def _named(source: Source, key: str) -> str:
    """``key``'s object name, ``BACKEND/KEY``, as ``source`` names its members."""
    return source.name(Member(key, 0, "", "mds"))


def _all_offsets(member: Member) -> bool:
    return int(member.meta["stride"]) == 1


def _plan(member: Member) -> tuple[list[int], list[int]]:
    """Each unit's first sample (then the count), and each unit's decoded bytes: runs
    of the recorded offsets' groups (every ``stride``-th sample's) of about
    :data:`UNIT_BYTES`; a compressed shard's of about :data:`STREAMED_UNIT_BYTES`."""
    # The manifest's identity of the member, and its offsets: two members that only a
    # hand-made manifest would give the same key and version still differ there.
    key = (member.key, member.version, member.size, member.samples, "compression" in member.meta,
           repr(member.meta.get("offsets")), UNIT_BYTES, STREAMED_UNIT_BYTES)  # fmt: skip
    plan: tuple[list[int], list[int]] | None = _PLANS.get(key)
    if plan is not None:
        return plan
    offsets = [int(o) for o in member.meta["offsets"]]
    stride = int(member.meta["stride"])
    columns = len(member.meta["columns"])
    target = STREAMED_UNIT_BYTES if "compression" in member.meta else UNIT_BYTES
    firsts: list[int] = [0] if member.samples else []
    costs: list[int] = []
    cost = 0
    for group in range(len(offsets) - 1):
        rows = min(stride, member.samples - group * stride)
        # A row costs its bytes, and at most an offset in each column.
        more = offsets[group + 1] - offsets[group] + 4 * columns * rows
        if cost and cost + more > target:
            firsts.append(group * stride)
            costs.append(cost)
            cost = 0
        cost += more
    if member.samples:
        firsts.append(member.samples)
        costs.append(cost)
    plan = (firsts, costs)
    _PLANS.put(key, plan, 128 + 16 * len(firsts))
    return plan


def _bounds(member: Member, unit: int) -> tuple[int, int, int, int]:
    """Unit ``unit``'s samples ``first .. stop`` and their bytes ``begin .. end`` of
    the (decompressed) shard."""
    firsts = _plan(member)[0]
    if not 0 <= unit < len(firsts) - 1:
        raise IndexError(f"unit {unit} of {member.key}, which has {max(0, len(firsts) - 1)}")
    first, stop = firsts[unit], firsts[unit + 1]
    offsets, stride = member.meta["offsets"], int(member.meta["stride"])
    # Units start at recorded offsets; the last ends at the shard's recorded end.
    end = int(offsets[-1]) if stop == member.samples else int(offsets[stop // stride])
    return first, stop, int(offsets[first // stride]), end


def _asked(
    name: str, recorded: list[tuple[str, str, int | None]], columns: Sequence[str] | None
) -> list[str]:
    names = [column for column, _, _ in recorded]
    if columns is None:
        return names
    for column in columns:
        if column not in names:
            raise DatasetFormatError(
                f"{name} has no column {column!r}; its columns are {', '.join(names)}"
            )
    return list(columns)


class _Damaged(Exception):
    """A sample's bytes do not hold its columns."""

    def __init__(self, row: int, what: str) -> None:
        super().__init__(what)
        self.row = row
        self.what = what


def _table(
    recorded: list[tuple[str, str, int | None]],
    asked: list[str],
    raw: NDArray[np.uint8],
    offsets: NDArray[np.int64],
) -> Any:
    """The samples of ``raw`` (each from ``offsets[i]`` to ``offsets[i + 1]``) as a
    table of the ``asked`` columns.

    Raises:
        _Damaged: a sample's bytes are shorter than its columns say.
    """
    pa = _arrow()
    rows = len(offsets) - 1
    starts, ends = offsets[:-1], offsets[1:]
    variable = [j for j, (_, _, size) in enumerate(recorded) if not size]
    # Each sample starts with the uint32 sizes of its variable-size columns.
    head = starts + 4 * len(variable)
    short = np.flatnonzero(head > ends)
    if len(short):
        raise _Damaged(int(short[0]), "it ends inside its column sizes")
    sizes = np.empty((rows, len(recorded)), dtype=np.int64)
    for j, (_, _, size) in enumerate(recorded):
        if size:
            sizes[:, j] = size
    for v, j in enumerate(variable):
        sizes[:, j] = _gather_fixed(raw, starts + 4 * v, 4).view("<u4").reshape(rows)
    column_starts = head[:, None] + np.cumsum(sizes, axis=1) - sizes
    past: Any = np.flatnonzero(column_starts[:, -1] + sizes[:, -1] > ends) if recorded else []
    if len(past):
        row = int(past[0])
        over = np.flatnonzero(column_starts[row] + sizes[row] > ends[row])
        raise _Damaged(row, f"it ends inside its column {recorded[int(over[0])][0]!r}")
    position = {column: j for j, (column, _, _) in enumerate(recorded)}
    arrays, fields = [], []
    for column in asked:
        j = position[column]
        _, encoding, size = recorded[j]
        scalar = _SCALARS.get(encoding)
        at, lengths = column_starts[:, j], sizes[:, j]
        if scalar is not None and size == np.dtype(scalar).itemsize:
            values = _gather_fixed(raw, at, size).view(scalar).reshape(rows)
            array = pa.array(values)
        else:
            kind = pa.string() if encoding == "str" else pa.binary()
            value_offsets = np.zeros(rows + 1, dtype=np.int64)
            np.cumsum(lengths, out=value_offsets[1:])
            if int(value_offsets[-1]) > _MAX_ARRAY_BYTES:
                raise _Damaged(0, f"its column {column!r} holds more than 2 GiB")
            data = _gather(raw, at, lengths, int(value_offsets[-1]))
            array = pa.Array.from_buffers(
                kind, rows, [None, pa.py_buffer(value_offsets.astype(np.int32)), data]
            )
            if encoding == "str":
                try:
                    array.validate(full=True)
                except pa.ArrowInvalid:
                    bad = next(i for i in range(rows) if not _utf8_ok(array, i))
                    raise _Damaged(bad, f"its column {column!r} is not UTF-8") from None
        arrays.append(array)
        fields.append(pa.field(column, array.type, metadata={ENCODING: encoding.encode()}))
    # Every column's encoding in the schema's metadata too: one look-up for a sample.
    encodings = json.dumps({column: recorded[position[column]][1] for column in asked})
    schema = pa.schema(fields, metadata={SCHEMA_ENCODINGS: encodings.encode()})
    return pa.Table.from_arrays(arrays, schema=schema)


def _converters(table: Any) -> list[tuple[str, Callable[[Any], Any]]]:
    """Each column's name and what turns its Arrow value into the sample's (kept per
    schema: the encodings in the schema's metadata, else in each field's)."""
    last = _LAST[0]
    if last is not None and last[0]() is table:  # the rows of one table, one by one
        return last[1]
    names = table.column_names
    metadata = table.schema.metadata
    key = (metadata.get(SCHEMA_ENCODINGS) if metadata else None, tuple(names))
    found = _CONVERTERS.get(key)
    if found is None:
        found = _CONVERTERS[key] = _build_converters(table, key[0])
        if len(_CONVERTERS) > 256:
            _CONVERTERS.clear()
    _LAST[0] = (weakref.ref(table), found)
    return found


def _build_converters(
    table: Any, encodings: bytes | None
) -> list[tuple[str, Callable[[Any], Any]]]:
    by_name = json.loads(encodings) if encodings is not None else {}
    found = []
    for field in table.schema:
        encoding = by_name.get(field.name)
        if encoding is None:  # a column another unit's table brought in
            encoding = (field.metadata or {}).get(ENCODING, b"").decode()
        # a column of no recorded encoding (not one decode made) as Arrow gives it
        convert = _converter(field.name, encoding, field.type) if encoding else _same
        found.append((field.name, convert))
    return found


def _converter(name: str, encoding: str, kind: Any) -> Callable[[Any], Any]:
    pa = _arrow()
    if kind == pa.binary():
        decode = decoder(encoding)

        def decoded(value: bytes) -> Any:
            try:
                return decode(value)
            except (ValueError, KeyError, IndexError) as exc:  # an ndarray's dtype code
                raise DatasetFormatError(
                    f"the MDS column {name!r} ({encoding}) of this sample cannot be decoded "
                    f"({exc}): the shard is damaged"
                ) from None

        return decoded
    if kind == pa.string() or encoding == "int":
        return _same
    scalar: Callable[[Any], Any] = np.dtype(encoding).type  # a numpy scalar, as Streaming's
    return scalar


def _same(value: Any) -> Any:
    return value


def _utf8_ok(array: Any, row: int) -> bool:
    try:
        array[row].as_py()
    except UnicodeDecodeError:
        return False
    return True


def _gather_fixed(raw: NDArray[np.uint8], at: NDArray[np.int64], width: int) -> NDArray[np.uint8]:
    """``width`` bytes from each of ``at`` in ``raw``, as one contiguous array."""
    gathered: NDArray[np.uint8] = raw[at[:, None] + np.arange(width)].reshape(-1)
    return gathered


def _gather(
    raw: NDArray[np.uint8], at: NDArray[np.int64], lengths: NDArray[np.int64], total: int
) -> Any:
    """The bytes ``at[i] .. at[i] + lengths[i]`` of ``raw``, one after another, as an
    Arrow buffer."""
    pa = _arrow()
    if not total:
        return pa.py_buffer(b"")
    if total >= _JOIN_BYTES * len(at):
        # Big values: a slice each (no index of the values' size).
        view = memoryview(raw.data)
        return pa.py_buffer(
            b"".join(view[a : a + n] for a, n in zip(at.tolist(), lengths.tolist(), strict=True))
        )
    # Small values: one gather by an index of every byte.
    index = np.arange(total, dtype=np.int64)
    index += np.repeat(at - (np.cumsum(lengths) - lengths), lengths)
    return pa.py_buffer(raw[index])


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
