"""The dataset snapshot format: a manifest of members, its id, and dataset names.

Written down once, here; the client (registration, readers) and the daemon (the
registry, freeze, migrate, the garbage collector's roots) both read it. ``docs/datasets.md``
is the prose.

A snapshot
    An immutable manifest of a dataset's **members** (the objects that hold its
    samples), in key order. Its **id** is the blake3 (256 bits, 64 hex digits) of its
    canonical bytes: JSON with sorted keys, no spaces, UTF-8, no NaN. The bytes stored
    in the registry are exactly those, so a reader checks a manifest by hashing what it
    got: a torn or forged manifest does not hash to the id it is stored under.

    Top-level fields::

        schema      the format's version (:data:`SCHEMA`); newer code reads older ones
                    (:func:`upgrade`), older code refuses newer ones by name
        source      {"backend": B, "prefix": P}: where the members were listed
        format      the members' format (:data:`FORMATS`)
        totals      {"members": N, "samples": N, "bytes": N}
        schema_of   the dataset's schema: Parquet, a list of [column, type] pairs; MDS,
                    the columns and their encodings; WebDataset, the member extensions;
                    JSON lines and fixed records, null
        excluded    [{"key": K, "error": TEXT}, ...]: files registration could not read,
                    left out with --skip-bad
        members     [member, ...], in key order

    A member::

        key         the key in the source backend (not a name: the backend is source's)
        size        bytes
        version     the version token the registration read (ETag, version id, or size
                    and mtime): reads are pinned to it
        format      one of FORMATS
        samples     how many samples it holds
        meta        per format (the format's module documents its fields), e.g. Parquet's
                    row groups with their rows and byte ranges

    A member's **samples** are numbered from 0 in the member, and a snapshot's samples
    from 0 over its members in order (:meth:`Snapshot.locate`).

Names
    ``NAME`` is one or more ``/``-separated segments of letters, digits, ``.``, ``_`` and
    ``-`` (each starting with a letter or digit). A reference (:class:`Ref`) is
    ``NAME@N`` (version N, from 1), ``NAME@latest`` (also plain ``NAME``), ``NAME@TAG``,
    or a snapshot id alone.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import blake3

from chunkd.errors import InvalidRequestError, ManifestError

__all__ = [
    "FORMATS",
    "MAX_NAME_BYTES",
    "SCHEMA",
    "Member",
    "Ref",
    "Snapshot",
    "canonical",
    "check_dataset_name",
    "check_snapshot_id",
    "check_tag",
    "diff",
    "parse_ref",
    "snapshot_id",
    "upgrade",
]

#: the manifest format's version. Bump it with an entry in :data:`_UPGRADES` that
#: turns a manifest of the version before into this one.
SCHEMA: Final = 1
#: the member formats
FORMATS: Final = ("parquet", "jsonl", "fixed", "wds", "mds")
#: the longest dataset name
MAX_NAME_BYTES: Final = 256
#: the longest tag
MAX_TAG_BYTES: Final = 64

_SEGMENT: Final = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_NAME_RE: Final = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT})*")
_TAG_RE: Final = re.compile(r"[A-Za-z][A-Za-z0-9._-]*")
_ID_RE: Final = re.compile(r"[0-9a-f]{64}")
_LATEST: Final = "latest"


# -- names -------------------------------------------------------------------------------


def check_dataset_name(name: str) -> str:
    """``name``, if it is a dataset name.

    Raises:
        InvalidRequestError: it is not (the message says what one is).
    """
    if (
        not isinstance(name, str)
        or len(name.encode()) > MAX_NAME_BYTES
        or not _NAME_RE.fullmatch(name)
        or any(part in (".", "..") or part.endswith(".") for part in name.split("/"))
        or _ID_RE.fullmatch(name)
    ):
        raise InvalidRequestError(
            f"{name!r} is not a dataset name: use '/'-separated segments of letters, "
            "digits, '.', '_' and '-', each starting with a letter or digit (at most "
            f"{MAX_NAME_BYTES} bytes, and not 64 hex digits, which name a snapshot)"
        )
    return name


def check_tag(tag: str) -> str:
    """``tag``, if it is a tag name (not ``latest``, not a number).

    Raises:
        InvalidRequestError: it is not.
    """
    if (
        not isinstance(tag, str)
        or len(tag) > MAX_TAG_BYTES
        or not _TAG_RE.fullmatch(tag)
        or tag == _LATEST
    ):
        raise InvalidRequestError(
            f"{tag!r} is not a tag: a letter, then letters, digits, '.', '_' or '-' (at "
            f"most {MAX_TAG_BYTES}); 'latest' is kept for the newest version"
        )
    return tag


def check_snapshot_id(text: str) -> str:
    """``text``, if it is a snapshot id (64 lowercase hex digits).

    Raises:
        InvalidRequestError: it is not.
    """
    if not isinstance(text, str) or not _ID_RE.fullmatch(text):
        raise InvalidRequestError(f"{text!r} is not a snapshot id (64 lowercase hex digits)")
    return text


@dataclass(frozen=True, slots=True)
class Ref:
    """A reference to a snapshot: by name and version or tag, or by id.

    Exactly one of ``version`` (a number), ``tag`` (``latest`` included) and ``id``
    is set; ``name`` is None only for an id.
    """

    name: str | None
    version: int | None = None
    tag: str | None = None
    id: str | None = None

    def __str__(self) -> str:
        if self.id is not None:
            return self.id
        return f"{self.name}@{self.version if self.version is not None else self.tag}"

    @property
    def latest(self) -> bool:
        """Whether this is ``NAME@latest``."""
        return self.tag == _LATEST


def parse_ref(text: str) -> Ref:
    """``NAME``, ``NAME@N``, ``NAME@latest``, ``NAME@TAG`` or a snapshot id.

    Raises:
        InvalidRequestError: ``text`` is none of these.
    """
    if not isinstance(text, str):
        raise InvalidRequestError(f"a snapshot reference is text, not {type(text).__name__}")
    if _ID_RE.fullmatch(text):
        return Ref(None, id=text)
    name, at, after = text.partition("@")
    check_dataset_name(name)
    if not at or after == _LATEST:
        return Ref(name, tag=_LATEST)
    if after.isdigit() and after.isascii():
        version = int(after)
        if version < 1 or len(after) > 18:
            raise InvalidRequestError(f"{text!r}: versions count from 1")
        return Ref(name, version=version)
    return Ref(name, tag=check_tag(after))


# -- the manifest ------------------------------------------------------------------------


def canonical(doc: Any) -> bytes:
    """The canonical bytes of a JSON document: sorted keys, no spaces, UTF-8."""
    return json.dumps(
        doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def snapshot_id(data: bytes | memoryview) -> str:
    """The id of a manifest's canonical bytes."""
    return blake3.blake3(data).hexdigest()


@dataclass(frozen=True, slots=True)
class Member:
    """One object of a snapshot (see the module docstring for its fields)."""

    key: str
    size: int
    version: str
    format: str
    samples: int = 0
    meta: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The member's entry in a manifest."""
        return {
            "key": self.key,
            "size": self.size,
            "version": self.version,
            "format": self.format,
            "samples": self.samples,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_json(cls, doc: object, where: str = "a member") -> Member:
        """A member from its manifest entry.

        Raises:
            ManifestError: the entry is malformed.
        """
        entry = _object(doc, where)
        fmt = _text(entry, "format", where)
        if fmt not in FORMATS:
            raise ManifestError(f"{where}: unknown format {fmt!r} (known: {', '.join(FORMATS)})")
        meta = entry.get("meta", {})
        if not isinstance(meta, dict):
            raise ManifestError(f"{where}: 'meta' must be an object")
        return cls(
            key=_text(entry, "key", where),
            size=_whole(entry, "size", where),
            version=_text(entry, "version", where),
            format=fmt,
            samples=_whole(entry, "samples", where),
            meta=meta,
        )

    def relative(self, prefix: str) -> str:
        """The key below ``prefix`` (the snapshot's source prefix)."""
        return self.key[len(prefix) :] if prefix and self.key.startswith(prefix) else self.key


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A dataset snapshot: its members and totals (see the module docstring).

    Build one with :meth:`build`, read one with :meth:`parse`; :attr:`data` is its
    canonical bytes and :attr:`id` their blake3.
    """

    backend: str
    prefix: str
    format: str
    members: tuple[Member, ...]
    schema_of: Any = None
    excluded: tuple[Mapping[str, str], ...] = ()
    data: bytes = field(default=b"", repr=False, compare=False)
    id: str = ""
    _starts: tuple[int, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def build(
        cls,
        *,
        backend: str,
        prefix: str,
        format: str,
        members: Iterable[Member],
        schema_of: Any = None,
        excluded: Iterable[Mapping[str, str]] = (),
    ) -> Snapshot:
        """A snapshot of ``members`` (sorted by key here), with its bytes and id."""
        ordered = tuple(sorted(members, key=lambda m: m.key.encode()))
        keys = [m.key for m in ordered]
        if len(set(keys)) != len(keys):
            raise ManifestError("a snapshot lists a member twice")
        doc = {
            "schema": SCHEMA,
            "source": {"backend": backend, "prefix": prefix},
            "format": format,
            "totals": {
                "members": len(ordered),
                "samples": sum(m.samples for m in ordered),
                "bytes": sum(m.size for m in ordered),
            },
            "schema_of": schema_of,
            "excluded": sorted((dict(e) for e in excluded), key=lambda e: e.get("key", "")),
            "members": [m.to_json() for m in ordered],
        }
        return cls.parse(canonical(doc))

    @classmethod
    def parse(cls, data: bytes | memoryview, expect_id: str | None = None) -> Snapshot:
        """A snapshot from its stored bytes; ``expect_id``: the id it was stored under.

        Raises:
            ManifestError: the bytes do not hash to ``expect_id`` (torn or forged), are
                not a manifest, or are of a newer schema than this code reads.
        """
        data = bytes(data)
        got = snapshot_id(data)
        if expect_id is not None and got != expect_id:
            raise ManifestError(
                f"the manifest stored as snapshot {expect_id} hashes to {got}: it is torn "
                "or was altered; register the dataset again (nothing was read from it)"
            )
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"snapshot {got} is not JSON: {exc}") from None
        doc = upgrade(_object(doc, "a manifest"))
        source = _object(doc.get("source"), "the manifest's source")
        raw_members = doc.get("members")
        if not isinstance(raw_members, list):
            raise ManifestError("the manifest's 'members' must be a list")
        members = tuple(
            Member.from_json(entry, f"member {i}") for i, entry in enumerate(raw_members)
        )
        excluded = doc.get("excluded", [])
        if not isinstance(excluded, list) or not all(isinstance(e, dict) for e in excluded):
            raise ManifestError("the manifest's 'excluded' must be a list of objects")
        fmt = _text(doc, "format", "the manifest")
        starts = [0]
        for member in members:
            starts.append(starts[-1] + member.samples)
        totals = _object(doc.get("totals"), "the manifest's totals")
        if totals.get("samples") != starts[-1] or totals.get("members") != len(members):
            raise ManifestError("the manifest's totals do not add up to its members")
        return cls(
            backend=_text(source, "backend", "the manifest's source"),
            prefix=_text(source, "prefix", "the manifest's source"),
            format=fmt,
            members=members,
            schema_of=doc.get("schema_of"),
            excluded=tuple(excluded),
            data=data,
            id=got,
            _starts=tuple(starts),
        )

    # -- samples ---------------------------------------------------------------------

    def __len__(self) -> int:
        return self._starts[-1] if self._starts else 0

    @property
    def total_bytes(self) -> int:
        """The members' bytes together."""
        return sum(m.size for m in self.members)

    @property
    def counts(self) -> list[int]:
        """Each member's sample count, in member order."""
        return [m.samples for m in self.members]

    def start_of(self, member: int) -> int:
        """The snapshot index of member ``member``'s first sample."""
        return self._starts[member]

    def locate(self, index: int) -> tuple[int, int]:
        """The (member, sample in member) of snapshot sample ``index``.

        Raises:
            IndexError: ``index`` is outside ``0 <= index < len(self)``.
        """
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of a snapshot of {len(self)} samples")
        member = bisect.bisect_right(self._starts, index) - 1
        return member, index - self._starts[member]

    def name_of(self, member: int) -> str:
        """Member ``member``'s object name, ``BACKEND/KEY``."""
        return f"{self.backend}/{self.members[member].key}"

    def with_source(self, backend: str, prefix: str, members: Sequence[Member]) -> Snapshot:
        """The same dataset at another place (``migrate``): ``members`` in the same order."""
        return Snapshot.build(
            backend=backend,
            prefix=prefix,
            format=self.format,
            members=members,
            schema_of=self.schema_of,
            excluded=self.excluded,
        )


# -- reading older manifests -------------------------------------------------------------

#: how to turn a manifest of schema N into one of N + 1, for each N before SCHEMA
_UPGRADES: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


def upgrade(doc: dict[str, Any]) -> dict[str, Any]:
    """A manifest document of any schema up to :data:`SCHEMA`, as one of SCHEMA.

    Raises:
        ManifestError: no schema, or one newer than this code reads.
    """
    schema = doc.get("schema")
    if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
        raise ManifestError("the manifest has no schema version: it is not a chunkd snapshot")
    if schema > SCHEMA:
        raise ManifestError(
            f"the manifest is of schema {schema}; this chunkd reads up to {SCHEMA}: "
            "upgrade chunkd to read it"
        )
    while schema < SCHEMA:
        doc = _UPGRADES[schema](doc)
        schema += 1
        doc["schema"] = schema
    return doc


# -- checks ------------------------------------------------------------------------------


def _object(doc: object, where: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ManifestError(f"{where} must be a JSON object")
    return doc


def _text(doc: Mapping[str, Any], key: str, where: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str):
        raise ManifestError(f"{where}: {key!r} must be text")
    return value


def _whole(doc: Mapping[str, Any], key: str, where: str) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ManifestError(f"{where}: {key!r} must be a whole number")
    return value


def diff(a: Snapshot, b: Snapshot) -> dict[str, Any]:
    """What differs between two snapshots' logical contents (``chunkd dataset diff`` and
    the inspector's ``diff``).

    Members are matched by their key below each snapshot's prefix, so a migrated copy
    (another backend, another prefix, new version tokens) shows no difference. A member
    differs when its size, format, sample count or format metadata does. The answer:
    ``a`` and ``b`` (the ids), ``added`` and ``removed`` (keys), ``changed``
    (``[{"key", "fields", "samples"}]``), ``unchanged`` (how many members are the same),
    ``samples`` and ``bytes`` (``[a's, b's]``), ``schema_changed``, and ``same`` (nothing
    differs at all).
    """
    left = {m.relative(a.prefix): m for m in a.members}
    right = {m.relative(b.prefix): m for m in b.members}
    changed = []
    for key in sorted(left.keys() & right.keys()):
        x, y = left[key], right[key]
        fields = [
            f
            for f, u, v in (
                ("size", x.size, y.size),
                ("format", x.format, y.format),
                ("samples", x.samples, y.samples),
                ("meta", x.meta, y.meta),
            )
            if u != v
        ]
        if fields:
            changed.append({"key": key, "fields": fields, "samples": [x.samples, y.samples]})
    return {
        "a": a.id,
        "b": b.id,
        "added": sorted(right.keys() - left.keys()),
        "removed": sorted(left.keys() - right.keys()),
        "changed": changed,
        "unchanged": len(left.keys() & right.keys()) - len(changed),
        "samples": [len(a), len(b)],
        "bytes": [a.total_bytes, b.total_bytes],
        "schema_changed": a.schema_of != b.schema_of,
        "same": left.keys() == right.keys() and not changed and a.schema_of == b.schema_of,
    }
