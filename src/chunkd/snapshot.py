"""The dataset snapshot format: a manifest of members, its id, and dataset names.

Written down once, here; the client (registration, readers) and the daemon (the
registry, freeze, migrate, the garbage collector's roots) both read it. ``docs/datasets.md``
is the prose.

A snapshot (schema 2): a root and member pages
    An immutable manifest of a dataset's **members** (the objects that hold its
    samples), in key order. It is a small **root** plus **member pages**, bounded
    pieces of the member table. Its **id** is the blake3 (256 bits, 64 hex digits) of
    the root's canonical bytes: JSON with sorted keys, no spaces, UTF-8, no NaN. The
    root names each page by its id, the blake3 of the page's own canonical bytes (a
    Merkle tree of one level), so a snapshot id names one immutable content, and a
    reader checks whatever it reads by hashing it: a torn or forged root or page does
    not hash to the id it is read for.

    A **page** is ``{"kind": "chunkd-dataset-page", "schema": 2, "members": [member,
    ...]}``: at most :data:`PAGE_MAX_MEMBERS` members and :data:`PAGE_MAX_BYTES` bytes,
    keys strictly increasing. Where a page ends depends on the members alone
    (:class:`PageWriter`): after a member whose key's blake3 (its first 8 bytes,
    little-endian) is 0 modulo :data:`PAGE_TARGET`, or before one that would take the
    page past a bound. So a registration split over many workers and one done alone
    make the same pages, and a new version that adds or changes a few members writes
    a few pages and a root: versions share every other page.

    The root's fields: ``schema`` (2), ``source``, ``format``, ``totals``,
    ``schema_of``, ``excluded`` (at most :data:`MAX_EXCLUDED`) and ``origin`` as below,
    ``claims`` (``["content"]`` where a member carries ``content``; absent otherwise:
    a page whose member carries it under a root that does not claim it is refused), and
    ``pages``: ``[[id, members, samples, bytes, first key, last key], ...]`` in key
    order. A page read is checked against its entry: its hash is the id, and its
    members' count, samples, bytes, first and last keys are the entry's, so a root
    cannot name a page of another snapshot unless it is that very content. Opening a
    snapshot reads its root; a member is read with its page (held parsed, the
    :data:`PAGE_CACHE` most recently used); finding sample ``i`` is a binary search
    over the root's pages, then one over the page. At 4096 members a page on average a
    root takes about 200 bytes a page: 50 KiB at a million members, 5 MiB at 100
    million.

    Schema 1, what chunkd wrote before: one document, the fields below and ``members``
    inline. It is still read, with its id unchanged; nothing writes it any more (but
    :meth:`Snapshot.build` with ``schema=1``, for tests of it).

    Fields (a schema-1 manifest's top level; a root's, less ``members``)::

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
import itertools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, NamedTuple, Protocol, overload

import blake3

from chunkd.canonical import canonical
from chunkd.errors import DatasetNotFoundError, InvalidRequestError, ManifestError

__all__ = [
    "CONTAINER_BYTES",
    "FORMATS",
    "MAX_DEPTH",
    "MAX_EXCLUDED",
    "MAX_NAME_BYTES",
    "PAGE_CACHE",
    "PAGE_CACHE_MEMBERS",
    "PAGE_KIND",
    "PAGE_MAX_BYTES",
    "PAGE_MAX_MEMBERS",
    "PAGE_SCHEMA",
    "PAGE_TARGET",
    "SCHEMA",
    "WRITE_SCHEMA",
    "Member",
    "Members",
    "MemoryPages",
    "PageRef",
    "PageSource",
    "PageWriter",
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
    "page_bytes",
    "parse_page",
    "parse_ref",
    "snapshot_id",
    "upgrade",
]

#: the manifest format's version: 2, a root and member pages. Schema 1 (one document,
#: its members inline) is still read, never written.
SCHEMA: Final = 2
#: the schema :meth:`Snapshot.build` writes unless told
WRITE_SCHEMA: Final = 2
#: a page ends after a member whose key's hash is 0 modulo this: pages of 4096
#: members on average (about 1 MiB of Parquet members' entries)
PAGE_TARGET: Final = 4096
#: the most members one page holds
PAGE_MAX_MEMBERS: Final = 16384
#: the most bytes one page's canonical JSON takes
PAGE_MAX_BYTES: Final = 4 << 20
#: the most files a snapshot records as left out (``excluded``)
MAX_EXCLUDED: Final = 10_000
#: the pages one snapshot holds parsed, the most recently used first ...
PAGE_CACHE: Final = 8
#: ... and the members they hold together at most (a parsed page of 16,384 Parquet
#: members takes about 27 MiB; the read order works on groups of up to 32,768 members
#: and needs two of them held), beyond which the least recently used pages go (the
#: one in use always stays)
PAGE_CACHE_MEMBERS: Final = 65_536
#: a member page's ``kind``
PAGE_KIND: Final = "chunkd-dataset-page"
#: a member page's format version: its own, so that a later root schema (upgraded on
#: read) keeps reading the pages already stored
PAGE_SCHEMA: Final = 2
_PAGE_HEAD: Final = b'{"kind":"' + PAGE_KIND.encode() + b'","members":['
_PAGE_TAIL: Final = b'],"schema":' + str(PAGE_SCHEMA).encode() + b"}"
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


# -- pages (schema 2) --------------------------------------------------------------------


class PageRef(NamedTuple):
    """A root's entry for one member page: the page's id (the blake3 of its bytes), and
    what its members add up to, which the page must fit when it is read."""

    id: str
    members: int
    samples: int
    bytes: int
    #: the page's first and last member keys
    first: str
    last: str

    def to_json(self) -> list[Any]:
        """The entry in a root's ``pages``."""
        return [self.id, self.members, self.samples, self.bytes, self.first, self.last]

    @classmethod
    def from_json(cls, doc: object, where: str) -> PageRef:
        """An entry of a root's ``pages``.

        Raises:
            ManifestError: the entry is malformed.
        """
        if not (isinstance(doc, list) and len(doc) == 6):
            raise ManifestError(
                f"{where} must be [id, members, samples, bytes, first key, last key]"
            )
        ident, members, samples, size, first, last = doc
        if not (isinstance(ident, str) and _ID_RE.fullmatch(ident)):
            raise ManifestError(f"{where}: the page id must be a blake3 digest (64 hex digits)")
        for what, value in (("members", members), ("samples", samples), ("bytes", size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ManifestError(f"{where}: {what} must be a whole number")
        if not 1 <= members <= PAGE_MAX_MEMBERS:
            raise ManifestError(f"{where}: a page holds 1 to {PAGE_MAX_MEMBERS} members")
        if not (isinstance(first, str) and isinstance(last, str)):
            raise ManifestError(f"{where}: the first and last keys must be text")
        return cls(ident, members, samples, size, first, last)


class PageSource(Protocol):
    """Where a snapshot's pages come from (the daemon's ``ds_page``, the registry's
    backend, memory). Nothing it returns is trusted: the snapshot checks each page
    against its id and its root's entry."""

    def page(self, page_id: str) -> bytes:
        """The bytes stored as page ``page_id``.

        Raises:
            DatasetNotFoundError: there is no such page.
        """
        ...


class MemoryPages:
    """Pages held in a dict (a snapshot being built, tests, a registration's pages
    before they are put)."""

    def __init__(self, pages: Mapping[str, bytes] | None = None) -> None:
        #: page id -> page bytes
        self.pages: dict[str, bytes] = dict(pages or {})

    def put(self, page_id: str, data: bytes) -> None:
        """Hold page ``page_id``."""
        self.pages[page_id] = data

    def page(self, page_id: str) -> bytes:
        # docstring inherited
        found = self.pages.get(page_id)
        if found is None:
            raise DatasetNotFoundError(f"page {page_id} is not here")
        return found


def _entry_bytes(member: Member) -> bytes:
    return canonical(member.to_json())


def page_bytes(members: Sequence[Member]) -> bytes:
    """A page's canonical bytes (members in strictly increasing key order)."""
    return _PAGE_HEAD + b",".join(_entry_bytes(m) for m in members) + _PAGE_TAIL


def _cuts_after(key: str) -> bool:
    """Whether a page ends after the member of ``key`` (when nothing ended it before):
    the first 8 bytes of its key's blake3, little-endian, are 0 modulo PAGE_TARGET. A
    function of the key alone, so pages end at the same keys however the members
    arrived, and a change to a few members changes only the pages they are in."""
    digest = blake3.blake3(key.encode()).digest(length=8)
    return int.from_bytes(digest, "little") % PAGE_TARGET == 0


class PageWriter:
    """Cuts members, given in strictly increasing key order, into pages.

    A page ends after a member whose key :func:`_cuts_after` says so, and before a
    member that would take it past :data:`PAGE_MAX_MEMBERS` members or
    :data:`PAGE_MAX_BYTES` bytes. Boundaries depend on the members alone, never on how
    the work that found them was split.

    Args:
        sink: called with ``(page_id, page_bytes)`` for each page as it is cut.
    """

    def __init__(self, sink: Callable[[str, bytes], None]) -> None:
        self._sink = sink
        self._entries: list[bytes] = []
        self._size = len(_PAGE_HEAD) + len(_PAGE_TAIL)
        self._samples = 0
        self._bytes = 0
        self._first = ""
        self._last: bytes | None = None
        self._last_key = ""
        #: the pages cut so far
        self.refs: list[PageRef] = []
        #: members carrying a ``content`` hash (chunkd's own claim)
        self.claimed = False
        #: members added
        self.members = 0

    def add(self, member: Member) -> None:
        """Add the next member.

        Raises:
            ManifestError: its key is not after the previous member's, or its entry
                alone is larger than a page may be.
        """
        raw = member.key.encode()
        if self._last is not None and raw <= self._last:
            raise ManifestError(
                f"member {member.key!r} comes after {self._last_key!r}: a snapshot's members "
                "are added once each, in key order"
                if raw != self._last
                else f"a snapshot lists member {member.key!r} twice"
            )
        entry = _entry_bytes(member)
        overhead = len(_PAGE_HEAD) + len(_PAGE_TAIL)
        if overhead + len(entry) > PAGE_MAX_BYTES:
            raise ManifestError(
                f"member {member.key!r}'s entry takes {len(entry)} bytes; a page holds at "
                f"most {PAGE_MAX_BYTES} (its format metadata is too large)"
            )
        if self._entries and (
            len(self._entries) >= PAGE_MAX_MEMBERS or self._size + 1 + len(entry) > PAGE_MAX_BYTES
        ):
            self._cut()
        if not self._entries:
            self._first = member.key
        else:
            self._size += 1  # the comma
        self._entries.append(entry)
        self._size += len(entry)
        self._samples += member.samples
        self._bytes += member.size
        self._last, self._last_key = raw, member.key
        self.claimed = self.claimed or member.content is not None
        self.members += 1
        if _cuts_after(member.key):
            self._cut()

    def _cut(self) -> None:
        data = _PAGE_HEAD + b",".join(self._entries) + _PAGE_TAIL
        ident = blake3.blake3(data).hexdigest()
        self._sink(ident, data)
        self.refs.append(
            PageRef(
                ident, len(self._entries), self._samples, self._bytes, self._first, self._last_key
            )
        )
        self._entries = []
        self._size = len(_PAGE_HEAD) + len(_PAGE_TAIL)
        self._samples = self._bytes = 0

    def finish(self) -> list[PageRef]:
        """Cut the last page; every page's entry, in key order."""
        if self._entries:
            self._cut()
        return self.refs


def parse_page(
    data: bytes | memoryview, ref: PageRef, *, claims: bool = True
) -> tuple[Member, ...]:
    """The members of a page, checked against its root's entry ``ref``.

    Args:
        data: the bytes a page source gave for ``ref.id``.
        ref: the root's entry for the page.
        claims: whether the root says members may carry ``content`` (chunkd's own
            record): a page that carries one under a root that does not say so is
            refused.

    Raises:
        ManifestError: the bytes do not hash to the id (torn, forged, or another
            page), are not a page, or do not fit the root's entry (count, samples,
            bytes, first and last key), or its keys are not in strictly increasing
            order.
    """
    data = bytes(data)
    where = f"page {ref.id}"
    got = blake3.blake3(data).hexdigest()
    if got != ref.id:
        raise ManifestError(
            f"{where} hashes to {got}: it is torn or was altered (nothing was read from it)"
        )
    if len(data) > PAGE_MAX_BYTES:
        raise ManifestError(f"{where} is {len(data)} bytes, more than a page's {PAGE_MAX_BYTES}")
    check_json_shape(data, where, max_depth=MAX_DEPTH, container_bytes=CONTAINER_BYTES, top=b"{")
    with _collector_paused():
        doc = load_json(data, where, max_depth=MAX_DEPTH, checked=True)
        page = _object(doc, where)
        if page.get("kind") != PAGE_KIND or page.get("schema") != PAGE_SCHEMA:
            raise ManifestError(f"{where} is not a member page of schema {PAGE_SCHEMA}")
        raw = page.get("members")
        if not isinstance(raw, list):
            raise ManifestError(f"{where}: 'members' must be a list")
        members = tuple(Member.from_json(e, f"{where}, member {i}") for i, e in enumerate(raw))
    fits = (
        len(members) == ref.members
        and sum(m.samples for m in members) == ref.samples
        and sum(m.size for m in members) == ref.bytes
        and members
        and members[0].key == ref.first
        and members[-1].key == ref.last
    )
    if not fits:
        raise ManifestError(
            f"{where} does not fit its root's entry (members, samples, bytes, first and "
            "last key): the root names a page of another snapshot"
        )
    keys = [m.key.encode() for m in members]
    if any(x >= y for x, y in itertools.pairwise(keys)):
        raise ManifestError(f"{where}: its members are not in strictly increasing key order")
    if not claims and any(m.content is not None for m in members):
        raise ManifestError(
            f"{where} carries a member's 'content', which its root does not claim "
            "(only chunkd's own migrate records it)"
        )
    return members


class _Paged:
    """A schema-2 snapshot's pages: the root's entries, where each page starts, and
    the pages loaded, the most recently used first (at most :data:`PAGE_CACHE`)."""

    def __init__(self, refs: tuple[PageRef, ...], source: PageSource | None, claims: bool) -> None:
        self.refs = refs
        self.source = source
        self.claims = claims
        members, samples = [0], [0]
        for ref in refs:
            members.append(members[-1] + ref.members)
            samples.append(samples[-1] + ref.samples)
        #: the snapshot index of each page's first member, and one past the last
        self.member_starts = members
        #: the snapshot index of each page's first sample, and one past the last
        self.sample_starts = samples
        self._held: OrderedDict[int, tuple[tuple[Member, ...], list[int]]] = OrderedDict()
        self._lock = threading.Lock()
        self._members_held = 0
        #: pages read from the source (how many loads a reader caused)
        self.loads = 0

    def with_source(self, source: PageSource | None) -> _Paged:
        return _Paged(self.refs, source, self.claims)

    def page_of(self, member: int) -> int:
        return bisect.bisect_right(self.member_starts, member) - 1

    def held(self, page: int) -> tuple[tuple[Member, ...], list[int]]:
        """Page ``page``'s members and where each one's samples start in the page."""
        with self._lock:
            found = self._held.get(page)
            if found is not None:
                self._held.move_to_end(page)
                return found
        ref = self.refs[page]
        if self.source is None:
            raise ManifestError(
                f"page {ref.id} of the snapshot is not loaded, and the snapshot has no "
                "page source to load it from"
            )
        data = self.source.page(ref.id)
        members = parse_page(data, ref, claims=self.claims)
        return self._hold(page, members)

    def _hold(self, page: int, members: tuple[Member, ...]) -> tuple[tuple[Member, ...], list[int]]:
        starts = [0]
        for m in members:
            starts.append(starts[-1] + m.samples)
        entry = (members, starts)
        with self._lock:
            self.loads += 1
            if page not in self._held:
                self._members_held += len(members)
            self._held[page] = entry
            self._held.move_to_end(page)
            while len(self._held) > 1 and (
                len(self._held) > PAGE_CACHE or self._members_held > PAGE_CACHE_MEMBERS
            ):
                _, (gone, _) = self._held.popitem(last=False)
                self._members_held -= len(gone)
        return entry

    def offer(self, page_id: str, data: bytes) -> None:
        pages = [i for i, ref in enumerate(self.refs) if ref.id == page_id]
        if not pages:
            raise ManifestError(f"page {page_id} is not one of the snapshot's pages")
        members = parse_page(data, self.refs[pages[0]], claims=self.claims)
        for page in pages:
            self._hold(page, members)


def _key_bytes(member: Member) -> bytes:
    """A member's key as snapshots order them: by its UTF-8 bytes."""
    return member.key.encode()


class Members(Sequence[Member]):
    """A schema-2 snapshot's members, each page loaded when one of its members is
    first asked for (and verified then)."""

    def __init__(self, paged: _Paged) -> None:
        self._paged = paged

    def __len__(self) -> int:
        return self._paged.member_starts[-1]

    @overload
    def __getitem__(self, index: int) -> Member: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Member]: ...

    def __getitem__(self, index: int | slice) -> Member | Sequence[Member]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        count = len(self)
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError(f"member {index} of a snapshot of {count} members")
        page = self._paged.page_of(index)
        members, _ = self._paged.held(page)
        return members[index - self._paged.member_starts[page]]

    def __iter__(self) -> Iterator[Member]:
        for page in range(len(self._paged.refs)):
            yield from self._paged.held(page)[0]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Members):
            return self._paged.refs == other._paged.refs
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._paged.refs)

    def __repr__(self) -> str:
        return f"<{len(self)} members in {len(self._paged.refs)} pages>"


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A dataset snapshot: its members and totals (see the module docstring).

    Build one with :meth:`build` (or :meth:`from_pages`), read one with :meth:`parse`;
    :attr:`data` is its canonical bytes (a schema-2 snapshot's root) and :attr:`id`
    their blake3. A schema-2 snapshot's :attr:`members` load their page when first
    asked for (from the page source given to :meth:`parse` or :meth:`with_pages`, or
    offered with :meth:`offer_page`), each checked against its id and its root's entry.
    """

    backend: str
    prefix: str
    format: str
    members: Sequence[Member]
    schema_of: Any = None
    excluded: tuple[Mapping[str, str], ...] = ()
    #: the snapshot this one is a verified copy of (``migrate``), or None
    origin: str | None = None
    data: bytes = field(default=b"", repr=False, compare=False)
    id: str = ""
    #: the manifest's schema: 1 (one document) or 2 (a root and member pages)
    schema: int = SCHEMA
    #: a schema-2 snapshot's pages (the root's entries, in key order); () for schema 1
    pages: tuple[PageRef, ...] = field(default=(), repr=False)
    _starts: tuple[int, ...] = field(default=(), repr=False, compare=False)
    _paged: _Paged | None = field(default=None, repr=False, compare=False)

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
        pages: MemoryPages | None = None,
        schema: int | None = None,
    ) -> Snapshot:
        """A snapshot of ``members`` (sorted by key here), with its root's bytes and id;
        its pages are written into ``pages`` (a new :class:`MemoryPages` if None), which
        the snapshot reads them from. ``schema``: 1 writes the one-document form
        (tests of what older chunkd wrote); None: :data:`WRITE_SCHEMA`.

        Raises:
            ManifestError: a member is listed twice, or an entry is larger than a page.
        """
        ordered = sorted(members, key=lambda m: m.key.encode())
        if (WRITE_SCHEMA if schema is None else schema) == 1:
            return cls._inline(backend, prefix, format, ordered, schema_of, excluded, origin)
        store = MemoryPages() if pages is None else pages
        writer = PageWriter(store.put)
        for member in ordered:
            writer.add(member)
        return cls.from_pages(
            backend=backend,
            prefix=prefix,
            format=format,
            pages=writer.finish(),
            source=store,
            schema_of=schema_of,
            excluded=excluded,
            origin=origin,
            claims=writer.claimed,
        )

    @classmethod
    def _inline(
        cls,
        backend: str,
        prefix: str,
        format: str,
        ordered: Sequence[Member],
        schema_of: Any,
        excluded: Iterable[Mapping[str, str]],
        origin: str | None,
    ) -> Snapshot:
        """A schema-1 snapshot: one document, its members inline."""
        keys = [m.key for m in ordered]
        if len(set(keys)) != len(keys):
            raise ManifestError("a snapshot lists a member twice")
        doc = {
            "schema": 1,
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
    def from_pages(
        cls,
        *,
        backend: str,
        prefix: str,
        format: str,
        pages: Sequence[PageRef],
        source: PageSource | None,
        schema_of: Any = None,
        excluded: Iterable[Mapping[str, str]] = (),
        origin: str | None = None,
        claims: bool = False,
    ) -> Snapshot:
        """The snapshot whose root names ``pages`` (a :class:`PageWriter`'s, in key
        order), read from ``source``; ``claims``: some member carries ``content``.

        Raises:
            ManifestError: more than :data:`MAX_EXCLUDED` files excluded, or pages out
                of key order.
        """
        left_out = sorted((dict(e) for e in excluded), key=lambda e: e.get("key", ""))
        if len(left_out) > MAX_EXCLUDED:
            raise ManifestError(
                f"{len(left_out)} files could not be read; a snapshot records at most "
                f"{MAX_EXCLUDED} left out (--skip-bad): fix the source first"
            )
        doc: dict[str, Any] = {
            "schema": SCHEMA,
            "source": {"backend": backend, "prefix": prefix},
            "format": format,
            "totals": {
                "members": sum(p.members for p in pages),
                "samples": sum(p.samples for p in pages),
                "bytes": sum(p.bytes for p in pages),
            },
            "schema_of": schema_of,
            "excluded": left_out,
            "pages": [p.to_json() for p in pages],
        }
        if claims:
            doc["claims"] = ["content"]
        if origin is not None:
            doc["origin"] = check_snapshot_id(origin)
        return cls.parse(canonical(doc), pages=source)

    @classmethod
    def parse(
        cls,
        data: bytes | memoryview,
        expect_id: str | None = None,
        *,
        checked: bool = False,
        pages: PageSource | None = None,
    ) -> Snapshot:
        """A snapshot from its stored bytes; ``expect_id``: the id it was stored under;
        ``pages``: where a schema-2 snapshot's pages are read from.

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
            if doc["schema"] >= 2:
                return cls._root(doc, data, got, pages)
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
            schema=1,
            _starts=tuple(starts),
        )

    @classmethod
    def _root(
        cls, doc: dict[str, Any], data: bytes, ident: str, source: PageSource | None
    ) -> Snapshot:
        where = f"the root of snapshot {ident}"
        origin_doc = _object(doc.get("source"), f"{where}: source")
        raw_pages = doc.get("pages")
        if not isinstance(raw_pages, list):
            raise ManifestError(f"{where}: 'pages' must be a list")
        refs = tuple(PageRef.from_json(e, f"{where}: page {i}") for i, e in enumerate(raw_pages))
        previous = b""
        for i, ref in enumerate(refs):
            first, last = ref.first.encode(), ref.last.encode()
            if (i and first <= previous) or last < first or (ref.members == 1 and first != last):
                raise ManifestError(f"{where}: its pages are not in key order (page {i})")
            previous = last
        totals = _object(doc.get("totals"), f"{where}: totals")
        if (
            totals.get("members") != sum(r.members for r in refs)
            or totals.get("samples") != sum(r.samples for r in refs)
            or totals.get("bytes") != sum(r.bytes for r in refs)
        ):
            raise ManifestError(f"{where}: its totals do not add up to its pages")
        excluded = doc.get("excluded", [])
        if (
            not isinstance(excluded, list)
            or len(excluded) > MAX_EXCLUDED
            or not all(isinstance(e, dict) for e in excluded)
        ):
            raise ManifestError(
                f"{where}: 'excluded' must be a list of at most {MAX_EXCLUDED} objects"
            )
        claims = doc.get("claims", [])
        if not isinstance(claims, list) or any(c != "content" for c in claims):
            raise ManifestError(f"{where}: 'claims' may only be [\"content\"]")
        origin = doc.get("origin")
        if origin is not None and not (isinstance(origin, str) and _ID_RE.fullmatch(origin)):
            raise ManifestError(f"{where}: 'origin' must be a snapshot id (64 hex digits)")
        paged = _Paged(refs, source, claims=bool(claims))
        return cls(
            backend=_text(origin_doc, "backend", f"{where}: source"),
            prefix=_text(origin_doc, "prefix", f"{where}: source"),
            format=_text(doc, "format", where),
            members=Members(paged),
            schema_of=doc.get("schema_of"),
            excluded=tuple(excluded),
            origin=origin,
            data=data,
            id=ident,
            schema=doc["schema"],
            pages=refs,
            _paged=paged,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as its bytes (checked again when unpickled) and, where they are in
        # memory, its pages; a page source that is a connection (the daemon's) does not
        # travel: the process that unpickles it attaches its own (``with_pages``).
        source = self._paged.source if self._paged is not None else None
        kept = source if isinstance(source, MemoryPages) else None
        return (_unpickled, (self.data, self.id, kept))

    # -- pages -----------------------------------------------------------------------

    def with_pages(self, source: PageSource | None) -> Snapshot:
        """The same snapshot, its pages read from ``source`` (nothing loaded yet)."""
        if self._paged is None:
            return self
        paged = self._paged.with_source(source)
        return replace(self, members=Members(paged), _paged=paged)

    def page_of(self, member: int) -> int:
        """The page that holds member ``member`` (schema 2)."""
        return self._need_pages().page_of(member)

    def page_start(self, page: int) -> int:
        """The index of page ``page``'s first member (schema 2)."""
        return self._need_pages().member_starts[page]

    def page_sample_start(self, page: int) -> int:
        """The snapshot index of page ``page``'s first sample (schema 2)."""
        return self._need_pages().sample_starts[page]

    def page_members(self, page: int) -> tuple[Member, ...]:
        """Page ``page``'s members, loaded and checked if they were not (schema 2).

        Raises:
            DatasetNotFoundError: the page source has no such page.
            ManifestError: the page is damaged or does not fit the root.
        """
        return self._need_pages().held(page)[0]

    def offer_page(self, page_id: str, data: bytes) -> None:
        """Hold page ``page_id``'s bytes, fetched elsewhere (the daemon's own reads),
        once checked.

        Raises:
            ManifestError: it is not one of this snapshot's pages, or does not fit.
        """
        self._need_pages().offer(page_id, data)

    @property
    def page_loads(self) -> int:
        """How many pages this snapshot has loaded and checked so far."""
        return 0 if self._paged is None else self._paged.loads

    def iter_members(self, start: int = 0) -> Iterator[Member]:
        """The members from ``start`` on, a page at a time."""
        if self._paged is None:
            yield from self.members[start:]
            return
        paged = self._paged
        for page in range(max(0, paged.page_of(start)), len(self.pages)):
            members = paged.held(page)[0]
            skip = max(0, start - paged.member_starts[page])
            yield from members[skip:]

    def _need_pages(self) -> _Paged:
        if self._paged is None:
            raise ManifestError(f"snapshot {self.id} is of schema {self.schema}: it has no pages")
        return self._paged

    # -- samples ---------------------------------------------------------------------

    def __len__(self) -> int:
        if self._paged is not None:
            return self._paged.sample_starts[-1]
        return self._starts[-1] if self._starts else 0

    @property
    def total_bytes(self) -> int:
        """The members' bytes together."""
        if self._paged is not None:
            return sum(p.bytes for p in self.pages)
        return sum(m.size for m in self.members)

    @property
    def claims(self) -> tuple[str, ...]:
        """The fields of chunkd's own records this manifest carries: ``"content"`` (a
        member's hash) and ``"origin"``, in that order; empty for a registration's.
        Only the daemon's migrate writes them (a client's ``ds_commit`` of a manifest
        that claims either is refused), since ``diff`` trusts them. A schema-2 root says
        so itself (``"claims"``), and a page is checked against it when it is read."""
        found: tuple[str, ...] = ()
        if self._paged is not None:
            if self._paged.claims:
                found += ("content",)
        elif any(m.content is not None for m in self.members):
            found += ("content",)
        if self.origin is not None:
            found += ("origin",)
        return found

    @property
    def counts(self) -> list[int]:
        """Each member's sample count, in member order (every page of a schema-2
        snapshot is read)."""
        return [m.samples for m in self.iter_members()]

    def start_of(self, member: int) -> int:
        """The snapshot index of member ``member``'s first sample."""
        if self._paged is None:
            return self._starts[member]
        paged = self._paged
        page = paged.page_of(member)
        _, starts = paged.held(page)
        return paged.sample_starts[page] + starts[member - paged.member_starts[page]]

    def locate(self, index: int) -> tuple[int, int]:
        """The (member, sample in member) of snapshot sample ``index``.

        Raises:
            IndexError: ``index`` is outside ``0 <= index < len(self)``.
        """
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of a snapshot of {len(self)} samples")
        if self._paged is None:
            member = bisect.bisect_right(self._starts, index) - 1
            return member, index - self._starts[member]
        paged = self._paged
        page = bisect.bisect_right(paged.sample_starts, index) - 1
        _, starts = paged.held(page)
        at = index - paged.sample_starts[page]
        inner = bisect.bisect_right(starts, at) - 1
        return paged.member_starts[page] + inner, at - starts[inner]

    def member_index(self, key: str) -> int | None:
        """The index of the member whose key is ``key``, or None: a binary search over
        the root's pages, then over the one page that may hold it (schema 2), or over
        the members (schema 1)."""
        raw = key.encode()
        if self._paged is None:
            at = bisect.bisect_left(self.members, raw, key=_key_bytes)
            found = at < len(self.members) and self.members[at].key == key
            return at if found else None
        page = bisect.bisect_left(self.pages, raw, key=lambda ref: ref.last.encode())
        if page >= len(self.pages) or self.pages[page].first.encode() > raw:
            return None
        members = self.page_members(page)
        at = bisect.bisect_left(members, raw, key=_key_bytes)
        if at < len(members) and members[at].key == key:
            return self._paged.member_starts[page] + at
        return None

    def name_of(self, member: int) -> str:
        """Member ``member``'s object name, ``BACKEND/KEY``."""
        return f"{self.backend}/{self.members[member].key}"

    def with_source(self, backend: str, prefix: str, members: Iterable[Member]) -> Snapshot:
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


def _unpickled(data: bytes, ident: str, pages: PageSource | None) -> Snapshot:
    return Snapshot.parse(data, ident, pages=pages)


# -- reading older manifests -------------------------------------------------------------

#: how to turn a root of schema N into one of N + 1, for each N from 2 before SCHEMA
_UPGRADES: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


def upgrade(doc: dict[str, Any]) -> dict[str, Any]:
    """A manifest document of any schema up to :data:`SCHEMA`: schema 1 as it is (its
    own form, members inline), a root as one of SCHEMA.

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
    # Schema 1 (one document, members inline) is read as it is; the roots of schema 2
    # on are upgraded step by step to the current one.
    while 2 <= schema < SCHEMA:
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
    return _evidence(list(snapshot.members), frozen, claims=claims)


def _evidence(
    members: Sequence[Member], frozen: Mapping[str, Any] | None, *, claims: bool
) -> list[dict[str, str]]:
    """:func:`content_evidence` of ``members`` (a snapshot's, all of them when a frozen
    record is given, whose lists are by member index)."""
    found: list[dict[str, str]] = [
        {"blake3": m.content} if claims and m.content is not None else {} for m in members
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


def _members_to_compare(
    a: Snapshot,
    b: Snapshot,
    frozen: tuple[Mapping[str, Any] | None, Mapping[str, Any] | None],
) -> tuple[list[Member], list[Member], int]:
    """The members of ``a`` and ``b`` that :func:`diff` must compare, and how many
    more it may count as the same without reading them.

    Two schema-2 snapshots of the same source share every page whose id is on both
    sides: a page's id names its members' every field (key, version, size, format,
    samples, meta, content), and its keys are on both sides, in no other page. Those
    members are the same object at the same version token: the same, by ``version``.
    So only the pages whose ids differ are read. With a frozen record on either side
    (whose lists go by member index) every member is compared.
    """
    if not (
        a.schema >= 2
        and b.schema >= 2
        and a.backend == b.backend
        and a.prefix == b.prefix
        and frozen == (None, None)
    ):
        return list(a.members), list(b.members), 0
    common = {p.id for p in a.pages} & {p.id for p in b.pages}
    xs = [m for i, p in enumerate(a.pages) if p.id not in common for m in a.page_members(i)]
    ys = [m for i, p in enumerate(b.pages) if p.id not in common for m in b.page_members(i)]
    return xs, ys, sum(p.members for p in a.pages if p.id in common)


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
    xs, ys, shared = _members_to_compare(a, b, frozen)
    left = {m.relative(a.prefix): i for i, m in enumerate(xs)}
    right = {m.relative(b.prefix): i for i, m in enumerate(ys)}
    known_a = _evidence(xs, frozen[0], claims=True)
    known_b = _evidence(ys, frozen[1], claims=True)
    # The daemon's own reads at each recorded version, apart from any manifest's claim.
    read_a = _evidence(xs, frozen[0], claims=False)
    read_b = _evidence(ys, frozen[1], claims=False)
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
        x, y = xs[i], ys[j]
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
    same_by["version"] += shared
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
    ``{"id": ID, "members": N, "samples": N, "claims": [FIELD, ...], "schema": N,
    "peak_bytes": N}``
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
                "schema": snapshot.schema,
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
