"""A schema-2 snapshot's member pages: cut, written, read and checked, held parsed.

:class:`PageWriter` cuts members into pages at boundaries that depend on the members
alone, :func:`parse_page` checks a page's bytes against its root's entry
(:class:`PageRef`), and :class:`Members` is a root's member table, each page loaded
from a :class:`PageSource` when first asked for and held among the most recently used
(the module docstring of :mod:`chunkd.snapshot` says what a page is).
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final, NamedTuple, Protocol, overload

import blake3

from chunkd.canonical import canonical
from chunkd.errors import DatasetNotFoundError, ManifestError
from chunkd.snapshot.member import Member
from chunkd.snapshot.names import _ID_RE
from chunkd.snapshot.shape import (
    CONTAINER_BYTES,
    MAX_DEPTH,
    _collector_paused,
    _object,
    check_json_shape,
    load_json,
)

__all__ = [
    "PAGE_CACHE",
    "PAGE_CACHE_MEMBERS",
    "PAGE_KIND",
    "PAGE_MAX_BYTES",
    "PAGE_MAX_MEMBERS",
    "PAGE_SCHEMA",
    "PAGE_TARGET",
    "Members",
    "MemoryPages",
    "PageRef",
    "PageSource",
    "PageWriter",
    "page_bytes",
    "parse_page",
]

#: a page ends after a member whose key's hash is 0 modulo this: pages of 4096
#: members on average (about 1 MiB of Parquet members' entries)
PAGE_TARGET: Final = 4096
#: the most members one page holds
PAGE_MAX_MEMBERS: Final = 16384
#: the most bytes one page's canonical JSON takes
PAGE_MAX_BYTES: Final = 4 << 20
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
