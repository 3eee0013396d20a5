"""The manifest: :class:`Snapshot`, built, parsed and checked, and its id.

A schema-1 manifest (members inline) or a schema-2 root (member pages,
:mod:`chunkd.snapshot.pages`), read through the upgrade chain
(:mod:`chunkd.snapshot.upgrades`), and what a reader asks of it: its members, the
sample at an index, the member of a key, the pages to load.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

import blake3

from chunkd.canonical import canonical
from chunkd.errors import ManifestError
from chunkd.snapshot.member import Member
from chunkd.snapshot.names import _ID_RE, check_snapshot_id
from chunkd.snapshot.pages import (
    Members,
    MemoryPages,
    PageRef,
    PageSource,
    PageWriter,
    _Paged,
)
from chunkd.snapshot.shape import (
    _collector_paused,
    _load_manifest_doc,
    _object,
    _text,
    check_manifest_shape,
)
from chunkd.snapshot.upgrades import SCHEMA, upgrade

__all__ = ["MAX_EXCLUDED", "WRITE_SCHEMA", "Snapshot", "snapshot_id"]

#: the schema :meth:`Snapshot.build` writes unless told
WRITE_SCHEMA: Final = 2
#: the most files a snapshot records as left out (``excluded``)
MAX_EXCLUDED: Final = 10_000


def snapshot_id(data: bytes | memoryview) -> str:
    """The id of a manifest's canonical bytes."""
    return blake3.blake3(data).hexdigest()


def _key_bytes(member: Member) -> bytes:
    """A member's key as snapshots order them: by its UTF-8 bytes."""
    return member.key.encode()


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
