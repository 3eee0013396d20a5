"""The frozen record's format, written down once for the daemon (freeze, GC's roots,
migrate) and the client (:class:`chunkd.client.datasets.frozen.FrozenSource`).

A freeze copies every member's bytes into the registry backend's content-addressed
``chunks/`` and writes the snapshot's frozen record last, at ``PREFIX/frozen/<id>.json``
(:mod:`chunkd.gateway.datasets.layout`). A 100 TB snapshot names 25M chunk ids, so the
record pages the way the snapshot does (schema 2): a small **root** and **record
pages**, each at most :data:`RECORD_PAGE_BYTES`, content-addressed (a page's id is the
blake3 of its bytes) and stored with the member pages in ``PREFIX/pages/<id>.json``,
put if absent. A reader loads the root, then only the record pages of the members it
reads, each checked against its id and its root's entry.

A record page (canonical JSON: sorted keys, no spaces, UTF-8)::

    {"chunk_bytes": N, "kind": "chunkd-frozen-page", "schema": 2,
     "pieces": [[member key, first chunk, [chunk id, ...], content | null], ...]}

A **piece** is a run of one member's chunk ids from chunk ``first`` on. Pieces go in
member key order (UTF-8 bytes), then chunk order; a member's pieces tile its chunks
``0 .. ceil(size / N) - 1`` without a gap, each chunk but the member's last ``N`` bytes
long. ``content`` (the blake3 of the member's whole bytes, where the freeze hashed them)
is on the member's last piece only (null on the others). A page ends where a member page
of the snapshot ends (so versions that share a member page and were frozen at the same
chunk size share its record pages), and before a chunk id that would take it past
:data:`RECORD_PAGE_BYTES`: a member with more chunks than fit goes on over the next
pages.

The root (canonical JSON)::

    {"format": "chunkd-dataset-frozen", "schema": 2, "id": SNAPSHOT ID, "backend": B,
     "chunk_bytes": N, "created": T, "totals": {"members": M, "chunks": C},
     "pages": [[page id, first member key, first chunk, chunk ids], ...]}

``pages`` in (key, chunk) order: each entry names a record page and what its first
piece starts with, and how many chunk ids it holds, which the page must fit when it is
read. Finding member ``K``'s chunk ``c`` is a binary search over the entries, then one
page. A root takes about 130 bytes a page (plus the key): 25M ids at about 60,000 a
page are about 420 pages, 60 KB.

Schema 1, what chunkd wrote before: one document, ``{"format", "schema": 1, "id",
"backend", "chunk_bytes", "created", "members": [[chunk id, ...], ...], "content":
[...]}`` (one list per member in the manifest's member order). It is still read;
nothing writes it any more.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import blake3

from chunkd.canonical import canonical
from chunkd.errors import ManifestError
from chunkd.snapshot import CONTAINER_BYTES, PAGE_MAX_BYTES, check_json_shape, load_json

__all__ = [
    "FROZEN_FORMAT",
    "RECORD_PAGE_BYTES",
    "RECORD_PAGE_KIND",
    "RECORD_SCHEMA",
    "Piece",
    "RecordPageWriter",
    "RecordRef",
    "RecordRoot",
    "member_chunks",
    "parse_record_page",
    "record_root_bytes",
]

FROZEN_FORMAT: Final = "chunkd-dataset-frozen"
#: the frozen record's schema: 2, a root and record pages (1: one document)
RECORD_SCHEMA: Final = 2
RECORD_PAGE_KIND: Final = "chunkd-frozen-page"
#: the most bytes a record page takes: a member page's bound (both live in ``pages/``
#: and travel by ``ds_page``)
RECORD_PAGE_BYTES: Final = PAGE_MAX_BYTES
#: how deep a record page or root nests
_DEPTH: Final = 5
_ID_RE: Final = re.compile(r"[0-9a-f]{64}")
_HEAD_AFTER: Final = b',"kind":"' + RECORD_PAGE_KIND.encode() + b'","pieces":['
_TAIL: Final = b'],"schema":' + str(RECORD_SCHEMA).encode() + b"}"
#: an id in a piece: its quotes and a comma
_ID_COST: Final = 64 + 3
#: what closing a piece may add: ``],"<content>"]`` and the comma before the next
_CLOSE_COST: Final = 2 + 66 + 1 + 1


def _text(value: str) -> bytes:
    return canonical(value)


class RecordRef(NamedTuple):
    """A root's entry for one record page: its id, where its first piece starts
    (member key, chunk index) and how many chunk ids it holds."""

    id: str
    key: str
    chunk: int
    ids: int

    def to_json(self) -> list[Any]:
        """The entry in a root's ``pages``."""
        return [self.id, self.key, self.chunk, self.ids]

    @classmethod
    def from_json(cls, doc: object, where: str) -> RecordRef:
        """An entry of a root's ``pages``.

        Raises:
            ManifestError: the entry is malformed.
        """
        if not (isinstance(doc, list) and len(doc) == 4):
            raise ManifestError(f"{where} must be [page id, member key, first chunk, chunk ids]")
        ident, key, chunk, ids = doc
        if not (isinstance(ident, str) and _ID_RE.fullmatch(ident)):
            raise ManifestError(f"{where}: the page id must be a blake3 digest (64 hex digits)")
        if not isinstance(key, str):
            raise ManifestError(f"{where}: the member key must be text")
        for value in (chunk, ids):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ManifestError(f"{where}: the chunk index and count must be whole numbers")
        return cls(ident, key, chunk, ids)


class Piece(NamedTuple):
    """A run of one member's chunk ids, from chunk :attr:`first` on."""

    key: str
    first: int
    ids: tuple[str, ...]
    #: the blake3 of the member's whole bytes, on its last piece (None: unknown, or
    #: not its last piece)
    content: str | None


class RecordPageWriter:
    """Cuts members' chunk lists, given member by member in key order, into record
    pages (the module docstring says where a page ends).

    Call :meth:`begin` with a member's key, :meth:`add` with each of its chunk ids in
    order, :meth:`end` with its content hash; :meth:`cut` where a member page of the
    snapshot ends; :meth:`finish` last.

    Args:
        sink: called with ``(page_id, page_bytes)`` for each page as it is cut.
        chunk_bytes: the chunk size of every chunk but a member's last.
    """

    def __init__(self, sink: Callable[[str, bytes], None], chunk_bytes: int) -> None:
        self._sink = sink
        self._head = b'{"chunk_bytes":' + str(chunk_bytes).encode() + _HEAD_AFTER
        self._pieces: list[bytes] = []
        self._size = len(self._head) + len(_TAIL)
        self._ids = 0  # ids in the page's pieces
        self._first: tuple[str, int] | None = None  # where the page's first piece starts
        self._key: str | None = None
        self._key_json = b""
        self._start = 0  # the open piece's first chunk
        self._open: list[bytes] = []  # the open piece's ids, quoted
        self._open_bytes = 0  # and their bytes, a comma each
        self._next = 0  # the member's next chunk index
        #: the pages cut so far
        self.refs: list[RecordRef] = []
        #: members and chunk ids added
        self.members = 0
        self.chunks = 0

    def _piece_head(self) -> int:
        return 1 + len(self._key_json) + 1 + len(str(self._start)) + 2

    def _open_size(self) -> int:
        return self._piece_head() + self._open_bytes

    def begin(self, key: str) -> None:
        """Start member ``key`` (after the previous member's key)."""
        self._key, self._key_json = key, _text(key)
        self._start, self._next, self._open, self._open_bytes = 0, 0, [], 0
        if self._first is None:
            self._first = (key, 0)
        if self._size + self._piece_head() + _CLOSE_COST > RECORD_PAGE_BYTES and self._pieces:
            self.cut()
            self._first = (key, 0)

    def add(self, cid: str) -> None:
        """The member's next chunk id."""
        quoted = b'"' + cid.encode() + b'"'
        if self._size + self._open_size() + len(quoted) + 1 + _CLOSE_COST > RECORD_PAGE_BYTES and (
            self._open or self._pieces
        ):
            self._close(None)
            self.cut()
            self._start = self._next
            self._first = (self._key or "", self._start)
        self._open.append(quoted)
        self._open_bytes += len(quoted) + 1
        self._next += 1
        self.chunks += 1

    def end(self, content: str | None) -> None:
        """End the member; ``content``: the blake3 of its whole bytes, if known."""
        self._close(content)
        self._key = None
        self.members += 1

    def _close(self, content: str | None) -> None:
        piece = (
            b"["
            + self._key_json
            + b","
            + str(self._start).encode()
            + b",["
            + b",".join(self._open)
            + b"],"
            + (b"null" if content is None else _text(content))
            + b"]"
        )
        if self._pieces:
            self._size += 1
        self._pieces.append(piece)
        self._size += len(piece)
        self._ids += len(self._open)
        self._open = []
        self._open_bytes = 0

    def cut(self) -> None:
        """End the page here (nothing happens on an empty page)."""
        if not self._pieces or self._first is None:
            return
        data = self._head + b",".join(self._pieces) + _TAIL
        ident = blake3.blake3(data).hexdigest()
        self._sink(ident, data)
        self.refs.append(RecordRef(ident, self._first[0], self._first[1], self._ids))
        self._pieces, self._ids, self._first = [], 0, None
        self._size = len(self._head) + len(_TAIL)

    def finish(self) -> list[RecordRef]:
        """Cut the last page; every page's entry, in order."""
        self.cut()
        return self.refs


def parse_record_page(
    data: bytes | memoryview, ref: RecordRef, chunk_bytes: int
) -> tuple[Piece, ...]:
    """A record page's pieces, checked against its root's entry ``ref``.

    Raises:
        ManifestError: the bytes do not hash to the id, are not a record page of
            ``chunk_bytes``, do not fit the entry (first piece, chunk id count), or
            their pieces are out of order.
    """
    data = bytes(data)
    where = f"record page {ref.id} of the frozen record"
    got = blake3.blake3(data).hexdigest()
    if got != ref.id:
        raise ManifestError(
            f"{where} hashes to {got}: it is torn or was altered; freeze the snapshot again"
        )
    if len(data) > RECORD_PAGE_BYTES:
        raise ManifestError(f"{where} is {len(data)} bytes, more than a page's {RECORD_PAGE_BYTES}")
    check_json_shape(data, where, max_depth=_DEPTH, container_bytes=CONTAINER_BYTES, top=b"{")
    doc = load_json(data, where, max_depth=_DEPTH, checked=True)
    raw = doc.get("pieces") if isinstance(doc, dict) else None
    if (
        not isinstance(doc, dict)
        or doc.get("kind") != RECORD_PAGE_KIND
        or doc.get("schema") != RECORD_SCHEMA
        or doc.get("chunk_bytes") != chunk_bytes
        or not isinstance(raw, list)
        or not raw
    ):
        raise ManifestError(f"{where} is not a record page of {chunk_bytes}-byte chunks")
    pieces: list[Piece] = []
    for n, entry in enumerate(raw):
        if not (
            isinstance(entry, list)
            and len(entry) == 4
            and isinstance(entry[0], str)
            and isinstance(entry[1], int)
            and not isinstance(entry[1], bool)
            and entry[1] >= 0
            and isinstance(entry[2], list)
            and all(isinstance(c, str) and _ID_RE.fullmatch(c) for c in entry[2])
            and (entry[3] is None or (isinstance(entry[3], str) and _ID_RE.fullmatch(entry[3])))
        ):
            raise ManifestError(f"{where}: piece {n} is not [key, first chunk, [ids], content]")
        piece = Piece(entry[0], entry[1], tuple(entry[2]), entry[3])
        if pieces:
            last = pieces[-1]
            order = (last.key.encode(), last.first) < (piece.key.encode(), piece.first)
            if not order or (piece.key == last.key and piece.first != last.first + len(last.ids)):
                raise ManifestError(f"{where}: its pieces are out of order (piece {n})")
        pieces.append(piece)
    if (pieces[0].key, pieces[0].first) != (ref.key, ref.chunk) or sum(
        len(p.ids) for p in pieces
    ) != ref.ids:
        raise ManifestError(
            f"{where} does not fit its root's entry: the root names a page of another record"
        )
    return tuple(pieces)


def record_root_bytes(
    *,
    snapshot_id: str,
    backend: str,
    chunk_bytes: int,
    created: float,
    members: int,
    chunks: int,
    pages: Sequence[RecordRef],
) -> bytes:
    """A root's canonical bytes."""
    doc = {
        "format": FROZEN_FORMAT,
        "schema": RECORD_SCHEMA,
        "id": snapshot_id,
        "backend": backend,
        "chunk_bytes": chunk_bytes,
        "created": created,
        "totals": {"members": members, "chunks": chunks},
        "pages": [p.to_json() for p in pages],
    }
    return canonical(doc)


@dataclass(frozen=True)
class RecordRoot:
    """A frozen record's root (schema 2), checked."""

    id: str
    backend: str
    chunk_bytes: int
    members: int
    chunks: int
    pages: tuple[RecordRef, ...]
    #: the root as a document (what ``ds_resolve`` sends)
    doc: dict[str, Any]

    @classmethod
    def from_doc(cls, doc: dict[str, Any], where: str) -> RecordRoot:
        """The root of a record document whose ``schema`` is 2 (its ``format``, ``id``
        and ``backend`` are the caller's to check).

        Raises:
            ManifestError: the root is malformed.
        """
        raw = doc.get("pages")
        totals = doc.get("totals")
        counts = totals if isinstance(totals, dict) else {}
        numbers: list[int] = []
        for name, value in (
            ("chunk_bytes", doc.get("chunk_bytes")),
            ("members", counts.get("members")),
            ("chunks", counts.get("chunks")),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ManifestError(f"{where} is damaged: {name!r} must be a whole number")
            numbers.append(value)
        if not isinstance(raw, list):
            raise ManifestError(f"{where} is damaged: 'pages' must be a list")
        chunk_bytes, members, chunks = numbers
        if chunk_bytes <= 0:
            raise ManifestError(f"{where} is damaged: its chunk size is {chunk_bytes}")
        refs = tuple(RecordRef.from_json(e, f"{where}: page {i}") for i, e in enumerate(raw))
        starts = [(r.key.encode(), r.chunk) for r in refs]
        if any(x >= y for x, y in itertools.pairwise(starts)):
            raise ManifestError(f"{where}: its pages are not in key order")
        if sum(r.ids for r in refs) != chunks:
            raise ManifestError(f"{where}: its pages do not add up to its chunk count")
        return cls(
            id=str(doc.get("id")),
            backend=str(doc.get("backend")),
            chunk_bytes=chunk_bytes,
            members=members,
            chunks=chunks,
            pages=refs,
            doc=doc,
        )

    def page_for(self, key: str, chunk: int = 0) -> int | None:
        """The index of the page that holds chunk ``chunk`` of member ``key``, if any
        could (the page itself says whether it does)."""
        at = bisect.bisect_right(self._starts, (key.encode(), chunk)) - 1
        return at if at >= 0 else None

    @property
    def _starts(self) -> list[tuple[bytes, int]]:
        starts = self.__dict__.get("_starts_cache")
        if starts is None:
            starts = [(r.key.encode(), r.chunk) for r in self.pages]
            object.__setattr__(self, "_starts_cache", starts)
        return starts


def member_chunks(
    root: RecordRoot,
    key: str,
    count: int,
    page: Callable[[int], Sequence[Piece]],
) -> tuple[str, ...]:
    """Member ``key``'s chunk ids (``count`` of them), from its pieces over one page or
    more; ``page(i)`` gives page ``i``'s pieces (loaded and checked).

    Raises:
        ManifestError: the record does not name exactly ``count`` chunks for it.
    """
    where = f"the frozen record of snapshot {root.id}"
    at = root.page_for(key, 0)
    found: list[str] = []
    while at is not None and at < len(root.pages):
        for piece in page(at):
            if piece.key != key:
                continue
            if piece.first != len(found):
                raise ManifestError(f"{where} skips chunks of member {key!r}; freeze it again")
            if not found and len(piece.ids) == count:
                return piece.ids  # the common case: the member's chunks in one piece
            found.extend(piece.ids)
        if len(found) >= count:
            break
        at += 1
        if at >= len(root.pages) or root.pages[at].key != key:
            break
    if len(found) != count:
        raise ManifestError(
            f"{where} names {len(found)} chunks for member {key!r}, which takes {count}: "
            "freeze the snapshot again"
        )
    return tuple(found)
