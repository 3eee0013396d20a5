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
        format      the members' format (:data:`FORMATS`, or a plug-in's name)
        totals      {"members": N, "samples": N, "bytes": N}
        schema_of   the dataset's schema: Parquet, a list of [column, type] pairs; MDS,
                    the columns and their encodings; WebDataset, the member extensions;
                    JSON lines and fixed records, null
        excluded    [{"key": K, "error": TEXT}, ...]: files registration could not read,
                    left out with --skip-bad
        members     [member, ...], in key order
        origin      (optional) the id of the snapshot this one is a verified copy of
                    (``migrate``): each member's ``content`` is then also the hash of
                    the origin's member of the same relative key, at its recorded
                    version; absent otherwise. Only the daemon's own migrate writes
                    it: a client's ``ds_commit`` that carries it is refused

    A member::

        key         the key in the source backend (not a name: the backend is source's)
        size        bytes
        version     the version token the registration read (ETag, version id, or size
                    and mtime): reads are pinned to it
        format      a format's name: one of FORMATS, or a plug-in's
                    (``chunkd.client.datasets.formats``); a reader that does not know
                    it refuses the member when it reads it, not the manifest
        samples     how many samples it holds
        meta        per format (the format's module documents its fields), e.g. Parquet's
                    row groups with their rows and byte ranges
        content     (optional) the blake3 of the member's whole bytes, 64 hex digits,
                    where chunkd read every byte (a migrated copy); absent when
                    unknown, so that a manifest without it keeps its id. Like
                    ``origin``, chunkd's own record (:attr:`Snapshot.claims`): a
                    client's ``ds_commit`` that carries it is refused

    A member's **samples** are numbered from 0 in the member, and a snapshot's samples
    from 0 over its members in order (:meth:`Snapshot.locate`).

    Its **shape** is checked before it is parsed (:func:`check_manifest_shape`): one
    JSON object, nested at most :data:`MAX_DEPTH` deep, with at most one object or list
    in :data:`CONTAINER_BYTES` bytes. What a parse costs grows with the count of JSON
    values, not with the bytes: ``[{}, {}, ...]`` takes 26 times its size in Python
    objects, a real manifest about 11 (measured on Parquet, JSON lines, WebDataset and
    MDS registrations), so a shape no manifest has is refused before it costs that.

Names
    ``NAME`` is one or more ``/``-separated segments of letters, digits, ``.``, ``_`` and
    ``-`` (each starting with a letter or digit). A reference (:class:`Ref`) is
    ``NAME@N`` (version N, from 1), ``NAME@latest`` (also plain ``NAME``), ``NAME@TAG``,
    or a snapshot id alone.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import json
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import blake3

from chunkd.errors import InvalidRequestError, ManifestError

__all__ = [
    "CONTAINER_BYTES",
    "FORMATS",
    "MAX_DEPTH",
    "MAX_NAME_BYTES",
    "SCHEMA",
    "Member",
    "Ref",
    "Snapshot",
    "canonical",
    "check_dataset_name",
    "check_json_shape",
    "check_manifest_shape",
    "check_snapshot_id",
    "check_tag",
    "content_evidence",
    "diff",
    "load_json",
    "parse_ref",
    "snapshot_id",
    "upgrade",
]

#: the manifest format's version. Bump it with an entry in :data:`_UPGRADES` that
#: turns a manifest of the version before into this one.
SCHEMA: Final = 1
#: the member formats chunkd ships (a manifest may name any format a process knows:
#: :func:`chunkd.client.datasets.formats.names`)
FORMATS: Final = ("parquet", "jsonl", "fixed", "wds", "mds", "arrow")
#: a format's name: a plug-in's too (reading a member of a format this process does
#: not know fails then, in ``chunkd.client.datasets.formats.format_of``)
_FORMAT_RE: Final = re.compile(r"[a-z][a-z0-9_.-]{0,31}")
#: the longest dataset name
MAX_NAME_BYTES: Final = 256
#: the longest tag
MAX_TAG_BYTES: Final = 64

_SEGMENT: Final = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_NAME_RE: Final = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT})*")
_TAG_RE: Final = re.compile(r"[A-Za-z][A-Za-z0-9._-]*")
_ID_RE: Final = re.compile(r"[0-9a-f]{64}")
_LATEST: Final = "latest"
#: the deepest a manifest's JSON may nest (registered ones nest 8 deep at most: a
#: WebDataset member's index of samples, each a list of its files)
MAX_DEPTH: Final = 32
#: the fewest bytes a manifest may spend on each JSON object or list, over its whole
#: length (registered ones spend 17 or more; the densest entry of any, a JSON-lines
#: index's first ``[0,0],``, spends 6; ``[{},{},...]`` spends 3)
CONTAINER_BYTES: Final = 6


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


# -- a JSON document's shape, before it is parsed -----------------------------------------

#: every byte but JSON's brackets and the quote, for ``bytes.translate`` to delete
_NOT_STRUCTURE: Final = bytes(c for c in range(256) if c not in b'[]{}"')
#: an opening bracket as "(", a closing one as ")"
_PAIRS: Final = bytes.maketrans(b"[{]}", b"(())")
_QUOTED: Final = re.compile(rb'"[^"]*"')


def check_json_shape(
    data: bytes, what: str, *, max_depth: int, container_bytes: int = 1, top: bytes = b""
) -> None:
    """Refuse, before it is parsed, JSON whose shape no document of its kind has.

    A cheap pass over the bytes (counts, translations and replacements that run at
    memory speed, no Python object per value): at most one object or list per
    ``container_bytes`` bytes over the whole document, nesting at most ``max_depth``
    deep (strings' contents left out), and, with ``top``, a first byte that is one of
    ``top`` (``b"{"``: an object). Brackets inside strings count as objects or lists in
    the first rule: it can only refuse more, never less.

    Args:
        data: the document's bytes.
        what: what the document is, for the error (``"the manifest"``).
        max_depth: the deepest nesting allowed.
        container_bytes: the fewest bytes per object or list.
        top: the bytes the document may start with (after white space); empty: any.

    Raises:
        ManifestError: the shape is not one of a document of this kind; nothing was
            parsed.
    """
    size = len(data)
    start = data[:256].lstrip()[:1]
    if top and (not start or start not in top):
        raise ManifestError(
            f"{what} is not JSON, or not a JSON {'object' if top == b'{' else 'document'} "
            f"(it starts with {start!r}); refused before it was parsed"
        )
    containers = data.count(b"{") + data.count(b"[")
    if containers > size // container_bytes + 8:
        raise ManifestError(
            f"{what} holds {containers} JSON objects and lists in {size} bytes, more than "
            f"one in {container_bytes} bytes, which no such document has (parsing it would "
            "cost far more memory than its size); refused before it was parsed"
        )
    text = data
    if b"\\" in text:  # escapes: a quote inside a string never ends it
        text = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    skeleton = text.translate(None, _NOT_STRUCTURE).replace(b'""', b"")
    if b'"' in skeleton:  # strings that hold brackets
        skeleton = _QUOTED.sub(b"", skeleton)
    skeleton = skeleton.translate(_PAIRS)
    deep = b"(" * (max_depth + 1)
    for _ in range(max_depth):
        if not skeleton or deep in skeleton:
            break
        shorter = skeleton.replace(b"()", b"")  # one level of nesting, everywhere
        if len(shorter) == len(skeleton):
            break
        skeleton = shorter
    if skeleton:
        raise ManifestError(
            f"{what} nests its JSON more than {max_depth} deep, or its brackets do not "
            "pair up: no such document does; refused before it was parsed"
        )


def check_manifest_shape(data: bytes) -> None:
    """Refuse, before it is parsed, what cannot be a manifest: anything but one JSON
    object, nested more than :data:`MAX_DEPTH` deep, or with more than one object or
    list per :data:`CONTAINER_BYTES` bytes (see the module docstring).

    Raises:
        ManifestError: it is not a manifest's shape.
    """
    check_json_shape(
        data,
        "the manifest",
        max_depth=MAX_DEPTH,
        container_bytes=CONTAINER_BYTES,
        top=b"{",
    )


def load_json(data: bytes, what: str, *, max_depth: int, checked: bool = False) -> Any:
    """``json.loads`` of a document whose nesting is bounded: its shape checked first
    (:func:`check_json_shape`, unless ``checked``: the caller did), and any failure
    to parse a :class:`~chunkd.errors.ManifestError` that names ``what``, never a
    ``RecursionError``.

    Raises:
        ManifestError: the document is not JSON, or nests more than ``max_depth`` deep.
    """
    if not checked:
        check_json_shape(data, what, max_depth=max_depth)
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{what} is not JSON: {exc}") from None
    except RecursionError:  # pragma: no cover - the shape check refuses it first
        raise ManifestError(f"{what} nests its JSON too deep") from None


# -- the manifest ------------------------------------------------------------------------

_DECODER: Final = json.JSONDecoder()
#: the parses running that paused the cyclic garbage collector, and whether it ran before
_paused = {"parses": 0, "was_enabled": True}
_paused_lock: Final = threading.Lock()


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a manifest's objects are made.

    A parse makes millions of containers; every few hundred thousand of them start a
    full collection, which walks every object of the process holding the GIL (measured
    0.2-1 s each for a 16 MiB manifest, several per parse). A manifest's objects hold
    no reference cycles, and reference counting frees them as usual; a collection after
    the parse finds whatever cycles other code made meanwhile.
    """
    with _paused_lock:
        if not _paused["parses"]:
            _paused["was_enabled"] = gc.isenabled()
            gc.disable()
        _paused["parses"] += 1
    try:
        yield
    finally:
        with _paused_lock:
            _paused["parses"] -= 1
            if not _paused["parses"] and _paused["was_enabled"]:
                gc.enable()


_SPACE: Final = re.compile(r"[ \t\n\r]*")


def _load_manifest_doc(data: bytes, what: str) -> dict[str, Any]:
    """The JSON object of a manifest whose shape was checked, parsed as ``json.loads``
    parses it, but its ``members`` list one entry at a time.

    ``json.loads`` holds the GIL from the first byte to the last: over a second for
    16 MiB of manifest, during which a daemon that parses it in a thread answers
    nothing. Parsed entry by entry, the parse lets other threads (the event loop) run
    between entries, so it holds the GIL for about one member's entry at a time.

    Raises:
        ManifestError: it is not a JSON object.
    """
    try:
        text = data.decode()
        return _object_by_members(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{what} is not JSON: {exc}") from None
    except RecursionError:  # pragma: no cover - the shape check refuses it first
        raise ManifestError(f"{what} nests its JSON too deep") from None


def _skip_space(text: str, at: int) -> int:
    """The index of the first character at or after ``at`` that is not JSON's space."""
    found = _SPACE.match(text, at)
    return at if found is None else found.end()


def _object_by_members(text: str) -> dict[str, Any]:
    decode = _DECODER.raw_decode
    at = _skip_space(text, 0)
    if text[at : at + 1] != "{":
        raise ValueError("a manifest is a JSON object")
    doc: dict[str, Any] = {}
    at = _skip_space(text, at + 1)
    if text[at : at + 1] == "}":
        at += 1
    else:
        while True:
            if text[at : at + 1] != '"':
                raise ValueError(f"expecting a property name in double quotes (char {at})")
            key, at = decode(text, at)
            at = _skip_space(text, at)
            if text[at : at + 1] != ":":
                raise ValueError(f"expecting ':' delimiter (char {at})")
            at = _skip_space(text, at + 1)
            if key == "members" and text[at : at + 1] == "[":
                doc[key], at = _list_by_entries(text, at)
            else:
                doc[key], at = decode(text, at)
            at = _skip_space(text, at)
            delimiter = text[at : at + 1]
            at = _skip_space(text, at + 1)
            if delimiter == "}":
                break
            if delimiter != ",":
                raise ValueError(f"expecting ',' delimiter (char {at})")
    if at != len(text):
        raise ValueError(f"extra data (char {at})")
    return doc


def _list_by_entries(text: str, at: int) -> tuple[list[Any], int]:
    """The JSON list at ``text[at]`` (a ``[``), each entry parsed apart, and the
    index after it."""
    decode = _DECODER.raw_decode
    entries: list[Any] = []
    at = _skip_space(text, at + 1)
    if text[at : at + 1] == "]":
        return entries, at + 1
    while True:
        entry, at = decode(text, at)
        entries.append(entry)
        at = _skip_space(text, at)
        delimiter = text[at : at + 1]
        if delimiter == "]":
            return entries, at + 1
        if delimiter != ",":
            raise ValueError(f"expecting ',' delimiter (char {at})")
        at = _skip_space(text, at + 1)


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
    #: the blake3 of the member's whole bytes (64 hex digits); None: not known
    content: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The member's entry in a manifest (``content`` only where it is known, so that
        a manifest written before the field existed keeps its bytes and its id)."""
        entry = {
            "key": self.key,
            "size": self.size,
            "version": self.version,
            "format": self.format,
            "samples": self.samples,
            "meta": dict(self.meta),
        }
        if self.content is not None:
            entry["content"] = self.content
        return entry

    @classmethod
    def from_json(cls, doc: object, where: str = "a member") -> Member:
        """A member from its manifest entry.

        Raises:
            ManifestError: the entry is malformed.
        """
        entry = _object(doc, where)
        fmt = _text(entry, "format", where)
        if not _FORMAT_RE.fullmatch(fmt):
            raise ManifestError(
                f"{where}: {fmt!r} is not a format name (lowercase letters, digits, "
                "'_', '.' and '-', at most 32, starting with a letter)"
            )
        meta = entry.get("meta", {})
        if not isinstance(meta, dict):
            raise ManifestError(f"{where}: 'meta' must be an object")
        content = entry.get("content")
        if content is not None and not (isinstance(content, str) and _ID_RE.fullmatch(content)):
            raise ManifestError(f"{where}: 'content' must be a blake3 digest (64 hex digits)")
        return cls(
            key=_text(entry, "key", where),
            size=_whole(entry, "size", where),
            version=_text(entry, "version", where),
            format=fmt,
            samples=_whole(entry, "samples", where),
            meta=meta,
            content=content,
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
    #: the snapshot this one is a verified copy of (``migrate``), or None
    origin: str | None = None
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
        origin: str | None = None,
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
        if origin is not None:
            doc["origin"] = check_snapshot_id(origin)
        return cls.parse(canonical(doc))

    @classmethod
    def parse(
        cls, data: bytes | memoryview, expect_id: str | None = None, *, checked: bool = False
    ) -> Snapshot:
        """A snapshot from its stored bytes; ``expect_id``: the id it was stored under.

        ``checked``: the caller has hashed these very bytes to ``expect_id`` and checked
        their shape already (a worker process did, reading the same sealed memfd), so
        neither is done again.

        Raises:
            ManifestError: the bytes do not hash to ``expect_id`` (torn or forged), are
                not a manifest (a shape no manifest has is refused before it is parsed:
                :func:`check_manifest_shape`), or are of a newer schema than this code
                reads.
        """
        data = bytes(data)
        if checked and expect_id is not None:
            got = expect_id
        else:
            got = snapshot_id(data)
            if expect_id is not None and got != expect_id:
                raise ManifestError(
                    f"the manifest stored as snapshot {expect_id} hashes to {got}: it is torn "
                    "or was altered; register the dataset again (nothing was read from it)"
                )
            check_manifest_shape(data)
        with _collector_paused():
            doc = upgrade(_load_manifest_doc(data, f"snapshot {got}"))
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
        origin = doc.get("origin")
        if origin is not None and not (isinstance(origin, str) and _ID_RE.fullmatch(origin)):
            raise ManifestError("the manifest's 'origin' must be a snapshot id (64 hex digits)")
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
            origin=origin,
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
    def claims(self) -> tuple[str, ...]:
        """The fields of chunkd's own records this manifest carries: ``"content"`` (a
        member's hash) and ``"origin"``, in that order; empty for a registration's.
        Only the daemon's migrate writes them (a client's ``ds_commit`` of a manifest
        that claims either is refused), since ``diff`` trusts them."""
        found: tuple[str, ...] = ()
        if any(m.content is not None for m in self.members):
            found += ("content",)
        if self.origin is not None:
            found += ("origin",)
        return found

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
        """The same dataset at another place (``migrate``): ``members`` in the same order,
        each with the ``content`` hash of the bytes copied; its ``origin`` is this one."""
        return Snapshot.build(
            backend=backend,
            prefix=prefix,
            format=self.format,
            members=members,
            schema_of=self.schema_of,
            excluded=self.excluded,
            origin=self.id,
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


def content_evidence(
    snapshot: Snapshot, frozen: Mapping[str, Any] | None = None, *, claims: bool = True
) -> list[dict[str, str]]:
    """What is known of each member's bytes, in member order, by kind of evidence.

    ``{"blake3": HEX}``: the blake3 of the member's whole bytes, from its ``content``
    field (a migrated copy's) or from the frozen record's ``"content"`` list (one hash
    or null per member). ``{"chunks/N": DIGEST}``: from the frozen record's chunk ids
    at chunk size N (each id is its chunk's blake3, so the same ids at the same size
    are the same bytes); DIGEST stands for the whole list. A record that does not fit
    the snapshot gives nothing. Every hash is of the bytes chunkd read at the member's
    recorded version (a freeze, a migrate).

    Args:
        snapshot: the snapshot.
        frozen: its frozen record (as ``ds_resolve`` sends it), if it is frozen.
        claims: whether the manifest's own ``content`` fields count (False: only the
            frozen record, which the daemon writes apart from any manifest).
    """
    found: list[dict[str, str]] = [
        {"blake3": m.content} if claims and m.content is not None else {} for m in snapshot.members
    ]
    if not isinstance(frozen, Mapping):
        return found
    count = len(found)
    contents = frozen.get("content")
    if isinstance(contents, list) and len(contents) == count:
        for known, digest in zip(found, contents, strict=True):
            if isinstance(digest, str) and _ID_RE.fullmatch(digest):
                known.setdefault("blake3", digest)
    chunks, size = frozen.get("members"), frozen.get("chunk_bytes")
    if isinstance(chunks, list) and len(chunks) == count and isinstance(size, int):
        for known, ids in zip(found, chunks, strict=True):
            if isinstance(ids, list) and all(isinstance(c, str) for c in ids):
                known[f"chunks/{size}"] = blake3.blake3("\n".join(ids).encode()).hexdigest()
    return found


def _agree(x: Mapping[str, str], y: Mapping[str, str]) -> bool | None:
    """Whether two members' evidence says their bytes are equal (True), differ
    (False), or nothing (None: no kind of evidence on both sides)."""
    kinds = x.keys() & y.keys()
    if not kinds:
        return None
    return all(x[k] == y[k] for k in kinds)


def diff(
    a: Snapshot,
    b: Snapshot,
    *,
    frozen: tuple[Mapping[str, Any] | None, Mapping[str, Any] | None] = (None, None),
) -> dict[str, Any]:
    """What differs between two snapshots (``chunkd dataset diff`` and the inspector's
    ``diff``).

    Members are matched by their key below each snapshot's prefix (so a migrated copy,
    at another backend and prefix, is matched member for member). A member present in
    both is "different" only when it is known to differ, "the same" only when it is
    known to be, and otherwise "unknown". What is known of its bytes is their hash
    (:func:`content_evidence`: a member's ``content``, which only migrate writes, and
    a copy's hashes are its ``origin``'s too; a frozen record's hashes and chunk ids),
    always of the bytes chunkd read at the recorded version.

    * Its size, format, sample count or format metadata differ: **different**.
    * Both sides read **the same object** (same backend and key): the version tokens
      decide.

      - The same token: **the same** (``version``), unless hashes on both sides differ
        (then the token was faked: **different**, ``content``).
      - Other tokens: the object was rewritten in between: **different**
        (``version``; with ``content`` too where hashes on both sides differ). Only
        the frozen records of both sides, the daemon's own reads at each version,
        can show that the rewrite kept the bytes: equal there, **the same**
        (``content``). A manifest's ``content`` claim never outweighs the tokens.
    * Other objects (a copy at another backend or key): hashes on both sides decide:
      equal, **the same** (``content``); not, **different** (``content``); none on
      one side, **unknown**. Never "the same".

    A ``file://`` version token is the file's inode, mtime and size: a rewrite that
    keeps all three (``cp -p``, ``rsync -t`` onto the same inode) is not seen by it,
    nor by a hash recorded after it (read at the same, faked token).

    Args:
        a, b: the snapshots.
        frozen: their frozen records (as ``ds_resolve`` sends them), where frozen.

    Returns:
        ``a`` and ``b`` (the ids), ``added`` and ``removed`` (keys), ``changed``
        (``[{"key", "fields", "samples"}]``: ``fields`` names what differs, among
        ``size``, ``format``, ``samples``, ``meta``, ``content`` and ``version``),
        ``unknown`` (keys), ``unchanged`` (how many members are known to be the same)
        and ``same_by`` (``{"content": N, "version": N}``: how each was known),
        ``samples`` and ``bytes`` (``[a's, b's]``), ``schema_changed``, and ``same``:
        true only when no member was added, removed, changed or unknown and the schema
        is the same.
    """
    left = {m.relative(a.prefix): i for i, m in enumerate(a.members)}
    right = {m.relative(b.prefix): i for i, m in enumerate(b.members)}
    known_a, known_b = content_evidence(a, frozen[0]), content_evidence(b, frozen[1])
    # The daemon's own reads at each recorded version, apart from any manifest's claim.
    read_a = content_evidence(a, frozen[0], claims=False)
    read_b = content_evidence(b, frozen[1], claims=False)
    # A verified copy's hashes are its origin's too (the bytes it copied, read at the
    # origin's recorded versions).
    for origin, copy, known_origin, known_copy, at_origin, at_copy in (
        (a, b, known_a, known_b, left, right),
        (b, a, known_b, known_a, right, left),
    ):
        if copy.origin == origin.id:
            for key in at_origin.keys() & at_copy.keys():
                digest = known_copy[at_copy[key]].get("blake3")
                if digest is not None:
                    known_origin[at_origin[key]].setdefault("blake3", digest)
    changed: list[dict[str, Any]] = []
    unknown: list[str] = []
    same_by = {"content": 0, "version": 0}
    for key in sorted(left.keys() & right.keys()):
        i, j = left[key], right[key]
        x, y = a.members[i], b.members[j]
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
        agree = _agree(known_a[i], known_b[j])
        if agree is False:
            fields.append("content")
        basis: str | None = None
        if a.backend == b.backend and x.key == y.key:
            if x.version == y.version:
                basis = "version"
            elif agree is not False and _agree(read_a[i], read_b[j]):
                basis = "content"
            else:
                fields.append("version")
        elif agree:
            basis = "content"
        if fields:
            changed.append({"key": key, "fields": fields, "samples": [x.samples, y.samples]})
        elif basis is None:
            unknown.append(key)
        else:
            same_by[basis] += 1
    added = sorted(right.keys() - left.keys())
    removed = sorted(left.keys() - right.keys())
    schema_changed = a.schema_of != b.schema_of
    return {
        "a": a.id,
        "b": b.id,
        "added": added,
        "removed": removed,
        "changed": changed,
        "unknown": unknown,
        "unchanged": sum(same_by.values()),
        "same_by": same_by,
        "samples": [len(a), len(b)],
        "bytes": [a.total_bytes, b.total_bytes],
        "schema_changed": schema_changed,
        "same": not (added or removed or changed or unknown or schema_changed),
    }


# -- a large manifest's check, in a process of its own -----------------------------------


def manifest_check_main(argv: Sequence[str] | None = None) -> int:
    """``python -m chunkd.snapshot --memory BYTES [--shape-only]``: check the manifest
    on fd 0 as :meth:`Snapshot.parse` does, under an address-space limit of BYTES.

    The daemon runs it for a manifest too large to parse in its own process
    (``ds_commit``; docs/datasets.md, "What a registration may cost the daemon"): the
    parse's Python objects, about 11 times a real manifest's size, then live and die
    in this process, and the daemon's event loop never waits on its GIL. fd 0 is a
    regular file or a memfd, read whole from offset 0. One JSON line goes to stdout:
    ``{"id": ID, "members": N, "samples": N, "claims": [FIELD, ...], "peak_bytes": N}``
    (``claims``: :attr:`Snapshot.claims`, the fields of chunkd's own records the
    manifest carries), or ``{"error": KIND, "message": TEXT}``; the exit status is 0
    either way (anything else is a crash).

    With ``--shape-only`` (the daemon resolving a large manifest it is about to parse
    itself): only its hash and shape (:func:`check_manifest_shape`), nothing parsed;
    the answer is ``{"id": ID, "peak_bytes": N}`` or the error.
    """
    import argparse
    import os
    import resource
    import sys

    parser = argparse.ArgumentParser(prog="python -m chunkd.snapshot")
    parser.add_argument("--memory", type=int, required=True, help="RLIMIT_AS, bytes")
    parser.add_argument("--shape-only", action="store_true", help="hash and shape only")
    args = parser.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = args.memory if hard == resource.RLIM_INFINITY else min(args.memory, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    answer: dict[str, Any]
    size = 0
    try:
        size = os.fstat(0).st_size
        data = os.pread(0, size, 0) if size else b""
        if args.shape_only:
            ident = snapshot_id(data)
            check_manifest_shape(data)
            answer = {"id": ident}
        else:
            snapshot = Snapshot.parse(data)
            answer = {
                "id": snapshot.id,
                "members": len(snapshot.members),
                "samples": len(snapshot),
                "claims": list(snapshot.claims),
            }
    except ManifestError as exc:
        answer = {"error": "ManifestError", "message": str(exc)}
    except MemoryError:
        answer = {
            "error": "ManifestError",
            "message": (
                f"checking the manifest of {size} bytes needed more than {limit >> 20} MiB "
                "of memory, more than a manifest of its size takes: it is not one"
            ),
        }
    answer["peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sys.stdout.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(manifest_check_main())
