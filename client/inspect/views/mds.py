"""The inspector's view of an MDS shard (:class:`MdsView`), read by the dataset code's MDS
format with the ``index.json`` beside it (or one folder up), which is checked first.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

from chunkd.client.datasets.source import PinnedSource
from chunkd.client.inspect.values import encode
from chunkd.client.inspect.views.view import malformed, past_end, select, split_name
from chunkd.errors import DatasetFormatError, MalformedFileError
from chunkd.snapshot import Member

if TYPE_CHECKING:
    from chunkd.client.core import Client
    from chunkd.client.results import ObjectStat

__all__ = ["MdsView"]

#: an index.json bigger than this is not read
_MAX_INDEX_JSON: Final = 64 << 20


class MdsView:
    """An MDS shard, read by the dataset code's MDS format with the ``index.json``
    beside it (or one folder up)."""

    kind = "mds"

    def __init__(self, client: Client, stat: ObjectStat) -> None:
        from chunkd.client.datasets.formats import format_of

        self.name = stat.name
        backend, key = split_name(stat.name)
        self._source = PinnedSource(client, backend)
        self._format = format_of("mds")
        found = _mds_index(client, backend, key)
        if found is None:
            raise MalformedFileError(
                f"{stat.name}: an MDS shard is read with its dataset's index.json, and none "
                "lies beside it (or one folder up); open it as binary, or register its folder"
            )
        index_name, index, basename = found
        _check_mds_index(index_name, index, basename)
        self.index_name = index_name
        folder = posixpath.dirname(index_name.partition("/")[2])
        self.shards = [
            {
                "name": f"{backend}/{posixpath.join(folder, _basename(s))}",
                "samples": _whole_or_none(s.get("samples")),
            }
            for s in index["shards"][:1000]
            if isinstance(s, dict)
        ]
        member = Member(key, stat.size, stat.version, "mds")
        try:
            self._member = self._format.scan(
                self._source, member, {"mds_index": index, "mds_basename": basename}
            )
        except DatasetFormatError as exc:
            raise malformed(exc) from None

    @property
    def total(self) -> int | None:
        return self._member.samples

    @property
    def nbytes(self) -> int:
        return 4096 + 16 * len(self._member.meta.get("offsets", ()))

    def fields(self) -> list[str] | None:
        return [str(c[0]) for c in self._member.meta["columns"]]

    def describe(self) -> dict[str, Any]:
        return {
            "samples_total": self._member.samples,
            "columns": [
                {"name": str(c[0]), "encoding": str(c[1])} for c in self._member.meta["columns"]
            ],
            "shards": self.shards,
            "index": self.index_name,
            "compression": self._member.meta.get("compression"),
        }

    def rows(self, start: int, columns: list[str] | None) -> Iterator[tuple[int, Any]]:
        if not 0 <= start < self._member.samples:
            raise past_end(self.name, start, self._member.samples)
        for i in range(start, self._member.samples):
            try:
                sample = self._format.read(self._source, self._member, i)
            except DatasetFormatError as exc:
                raise malformed(exc) from None
            yield i, encode(select(sample, columns), {"sample": f"{self.name}#{i}"})


def _basename(entry: dict[str, Any]) -> str:
    zipped = entry.get("zip_data") or {}
    raw = entry.get("raw_data") or {}
    return str(zipped.get("basename") or raw.get("basename") or "")


def _whole_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _check_mds_index(name: str, index: dict[str, Any], basename: str) -> None:
    """Refuse an ``index.json`` whose parts the MDS reader takes are of the wrong type:
    ``shards`` a list, each shard's ``raw_data`` and ``zip_data`` objects (or null), and
    the shard's own ``column_sizes`` whole numbers (or null).

    Raises:
        MalformedFileError: naming ``name`` and the part.
    """
    shards = index.get("shards")
    if not isinstance(shards, list):
        raise MalformedFileError(
            f"{name}: its 'shards' is {_json_type(shards)}, not a list of shard entries: it "
            "is not an MDS index; write the dataset again"
        )
    for i, entry in enumerate(shards):
        if not isinstance(entry, dict):
            continue
        for part in ("raw_data", "zip_data"):
            found = entry.get(part)
            if found is not None and not isinstance(found, dict):
                raise MalformedFileError(
                    f"{name}: shard {i}'s {part} is {_json_type(found)}, not an object "
                    "with basename, bytes and hashes: the index is damaged"
                )
            if isinstance(found, dict) and not isinstance(found.get("basename", ""), str):
                raise MalformedFileError(f"{name}: shard {i}'s {part}.basename is not text")
        names = [(entry.get(part) or {}).get("basename") for part in ("raw_data", "zip_data")]
        if basename not in names:
            continue
        sizes = entry.get("column_sizes")
        for size in sizes if isinstance(sizes, list) else ():
            if size is not None and (_whole_or_none(size) is None or size < 0):
                raise MalformedFileError(
                    f"{name}: shard {i}'s column_sizes holds {json.dumps(size)[:40]}, not a "
                    "size in bytes (a whole number, or null for a column of varying size)"
                )


def _json_type(value: Any) -> str:
    """What JSON calls the type of ``value``, with an article."""
    if value is None:
        return "null"
    for kind, name in ((bool, "a boolean"), (int, "a number"), (float, "a number"),
                       (str, "a string"), (list, "a list"), (dict, "an object")):  # fmt: skip
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _mds_index(client: Client, backend: str, key: str) -> tuple[str, dict[str, Any], str] | None:
    """The ``index.json`` that lists the shard ``key``: its name, its contents and the
    shard's basename in it (the path from the index's folder)."""
    folder = posixpath.dirname(key)
    for _ in range(2):
        index_key = posixpath.join(folder, "index.json") if folder else "index.json"
        name = f"{backend}/{index_key}"
        try:
            stat = client.stat(name)
        except FileNotFoundError:
            stat = None
        if stat is not None:
            if stat.size > _MAX_INDEX_JSON:
                raise MalformedFileError(
                    f"{name} is {stat.size} bytes, more than the {_MAX_INDEX_JSON} an MDS "
                    "index.json may be here"
                )
            try:
                doc = json.loads(bytes(client.read(name, 0, stat.size)) if stat.size else b"")
            except ValueError as exc:
                raise MalformedFileError(f"{name} is not JSON ({exc})") from None
            basename = key[len(folder) + 1 :] if folder else key
            if isinstance(doc, dict):
                return name, doc, basename
        if not folder:
            return None
        folder = posixpath.dirname(folder)
    return None
