"""A frozen record as read: its bound, its check, and the chunk ids it names, in bounded
memory.

A record's size is bounded by its snapshot before it is read (:func:`record_bound`), it
is checked to be this snapshot's in this registry (:func:`parse_frozen`), and the chunk
ids it names are read a member or a record page at a time (:class:`FrozenChunks`), for
the freeze that checks it again, a frozen member's reader, migrate, and the roots of a
garbage collection (:func:`frozen_chunk_ids`). The record's format is
:mod:`chunkd.frozen`; writing one is :mod:`.freeze`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import OrderedDict
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Final

from chunkd.client.protocol import MAX_LAYOUT
from chunkd.errors import DatasetError, DatasetNotFoundError, ManifestError
from chunkd.frozen import (
    FROZEN_FORMAT,
    RECORD_PAGE_BYTES,
    RECORD_SCHEMA,
    Piece,
    RecordRoot,
    member_chunks,
    parse_record_page,
)
from chunkd.gateway.checkpoints.jobs import each
from chunkd.gateway.datasets.documents import load_document, read_document

if TYPE_CHECKING:
    from chunkd.gateway.backends import Backend
    from chunkd.gateway.datasets.registry import Registry
    from chunkd.snapshot import Snapshot

__all__ = [
    "RECORD_PAGES_HELD",
    "FrozenChunks",
    "frozen_chunk_ids",
    "parse_frozen",
    "record_bound",
]

#: record pages a reader of a record holds parsed (the most recently used)
RECORD_PAGES_HELD: Final = 4
#: record pages read at once (each at most RECORD_PAGE_BYTES)
_RECORD_PAGES_AT_ONCE: Final = 4
#: the most a root's entry takes: an id, a key (1024 bytes, escaped), two numbers
_ROOT_ENTRY_BYTES: Final = 64 + 6 * 1024 + 64


def record_bound(snapshot: Snapshot) -> int:
    """The most bytes ``snapshot``'s frozen record can hold (at the smallest chunk size,
    a page), up to :data:`~chunkd.client.protocol.MAX_LAYOUT`: a record read is never
    larger, so a planted one is refused unread.

    A schema-2 snapshot's record is a root (schema 2) whose entries are bounded by its
    member pages' sizes, worked out from its own root (no member page is read). A
    schema-1 snapshot's may be of either schema (one written before records paged).
    """
    per_chunk = 64 + 3  # an id, its quotes and a comma
    if snapshot.schema >= 2:
        # A record page is cut only when the next id does not fit, so all but the last
        # of a member page's record pages hold RECORD_PAGE_BYTES less an entry or so.
        full = RECORD_PAGE_BYTES - _ROOT_ENTRY_BYTES - 256
        entries = sum(
            1
            + (p.members * (_ROOT_ENTRY_BYTES + 160) + (p.bytes // 4096 + p.members) * per_chunk)
            // full
            for p in snapshot.pages
        )
        return min(4096 + entries * _ROOT_ENTRY_BYTES, MAX_LAYOUT)
    size = 4096 + sum(-(-m.size // 4096) * per_chunk + 160 for m in snapshot.members)
    return min(size, MAX_LAYOUT)


def parse_frozen(
    raw: bytes | memoryview,
    key: str,
    *,
    expect_id: str,
    backend: str,
    snapshot: Snapshot | None = None,
) -> dict[str, Any]:
    """A frozen record, checked: the one written for snapshot ``expect_id`` (the id in
    its key) with its chunks in ``backend`` (the registry's), and, when ``snapshot``
    is given, one chunk list per member of the member's size (schema 1), or a root of
    as many members (schema 2: the pages are checked as they are read).

    What that proves, and what it does not: the record names this snapshot and this
    registry's chunk store, so a record copied from another snapshot, or one naming
    another backend's chunks, is refused. It does not prove who wrote it: whoever can
    write the registry's backend directly can write a record (docs/security.md).
    Every chunk it names is still checked against its id when read.

    Raises:
        ManifestError: the record is damaged, or is not this snapshot's.
    """
    damaged = ManifestError(
        f"the frozen record {key} is damaged (not the JSON chunkd wrote); freeze the snapshot again"
    )
    try:
        # Its shape is checked before it is parsed: nested too deep is damaged, never a
        # RecursionError.
        doc: Any = load_document(raw, key, max_depth=4)
    except ManifestError:
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != FROZEN_FORMAT:
        raise damaged
    if doc.get("id") != expect_id or doc.get("backend") != backend:
        raise ManifestError(
            f"the frozen record {key} is not snapshot {expect_id}'s in backend {backend!r}: "
            f"it names snapshot {str(doc.get('id'))[:64]!r} in backend "
            f"{str(doc.get('backend'))[:64]!r}; freeze the snapshot again (it is written anew)"
        )
    if doc.get("schema") == RECORD_SCHEMA:
        root = RecordRoot.from_doc(doc, f"the frozen record {key}")
        if snapshot is not None and root.members != len(snapshot.members):
            raise ManifestError(
                f"the frozen record {key} does not match snapshot {snapshot.id}'s members; "
                "freeze the snapshot again"
            )
        return doc
    members = doc.get("members")
    if (
        not isinstance(members, list)
        or not all(isinstance(m, list) and all(isinstance(c, str) for c in m) for m in members)
        or not isinstance(doc.get("chunk_bytes"), int)
        or isinstance(doc.get("chunk_bytes"), bool)
        or doc["chunk_bytes"] <= 0
    ):
        raise damaged
    if snapshot is not None:
        size = doc["chunk_bytes"]
        # A schema-2 snapshot's members are in pages the daemon has not loaded: their
        # count is checked here, each list's length as the member is read.
        if len(members) != len(snapshot.members) or (
            snapshot.schema < 2
            and any(
                len(ids) != -(-m.size // size)
                for ids, m in zip(members, snapshot.members, strict=True)
            )
        ):
            raise ManifestError(
                f"the frozen record {key} does not match snapshot {snapshot.id}'s members; "
                "freeze the snapshot again"
            )
    return doc


class FrozenChunks:
    """The chunk ids a frozen record (either schema) names, read in bounded memory:
    a schema-2 record's pages are fetched from the registry as they are needed (each
    checked against its id and its root's entry) and the :data:`RECORD_PAGES_HELD`
    most recently used are held parsed.

    Args:
        registry: the dataset registry (where the record pages are).
        record: the record (:func:`parse_frozen`'s).
        where: the record, for errors (``BACKEND/KEY``).
    """

    def __init__(self, registry: Registry, record: dict[str, Any], where: str) -> None:
        self.registry = registry
        self.record = record
        self.where = where
        self.chunk_bytes = int(record["chunk_bytes"])
        self.root = (
            RecordRoot.from_doc(record, where) if record.get("schema") == RECORD_SCHEMA else None
        )
        self._held: OrderedDict[int, tuple[Piece, ...]] = OrderedDict()

    @property
    def chunks(self) -> int:
        """How many chunk ids the record names (repeats included)."""
        if self.root is not None:
            return self.root.chunks
        return sum(len(member) for member in self.record["members"])

    async def page(self, index: int) -> tuple[Piece, ...]:
        """Record page ``index``'s pieces, loaded and checked (schema 2).

        Raises:
            DatasetError: the page is missing or damaged (the message names it).
        """
        assert self.root is not None
        held = self._held.get(index)
        if held is not None:
            self._held.move_to_end(index)
            return held
        ref = self.root.pages[index]
        try:
            data = await self.registry.page(ref.id)
            pieces = await asyncio.to_thread(parse_record_page, data, ref, self.chunk_bytes)
        except (DatasetNotFoundError, ManifestError) as exc:
            raise ManifestError(
                f"the frozen record {self.where} cannot be read: {exc}; freeze the snapshot again"
            ) from None
        self._held[index] = pieces
        while len(self._held) > RECORD_PAGES_HELD:
            self._held.popitem(last=False)
        return pieces

    async def of_member(self, snapshot: Snapshot, index: int) -> list[str]:
        """Member ``index``'s chunk ids, in order (its snapshot page must be loaded).

        Raises:
            ManifestError: the record is damaged, or does not fit the member.
        """
        member = snapshot.members[index]
        count = -(-member.size // self.chunk_bytes)
        if self.root is None:
            ids = [str(c) for c in self.record["members"][index]]
            if len(ids) != count:
                raise ManifestError(
                    f"the frozen record {self.where} names {len(ids)} chunks for member "
                    f"{member.key!r}, which takes {count}: freeze the snapshot again"
                )
            return ids
        pages: dict[int, tuple[Piece, ...]] = {}
        at = self.root.page_for(member.key, 0)
        # The pages a member's pieces may be on: its first, and the next ones whose
        # entries start with it.
        while at is not None and at < len(self.root.pages):
            pages[at] = await self.page(at)
            at += 1
            if at >= len(self.root.pages) or self.root.pages[at].key != member.key:
                break
        return list(member_chunks(self.root, member.key, count, pages.__getitem__))

    async def batches(self) -> AsyncGenerator[list[str], None]:
        """Every chunk id the record names, a member (schema 1) or a record page
        (schema 2) at a time; pages are read a few at a time, and none is held after."""
        if self.root is None:
            for member in self.record["members"]:
                yield [str(c) for c in member]
            return
        refs = self.root.pages
        for start in range(0, len(refs), _RECORD_PAGES_AT_ONCE):
            indexes = list(range(start, min(len(refs), start + _RECORD_PAGES_AT_ONCE)))
            for pieces in await each(indexes, self._read_once):
                yield [c for piece in pieces for c in piece.ids]

    async def _read_once(self, index: int) -> tuple[Piece, ...]:
        held = self._held.get(index)
        if held is not None:
            return held
        assert self.root is not None
        ref = self.root.pages[index]
        try:
            data = await self.registry.page(ref.id)
            return await asyncio.to_thread(parse_record_page, data, ref, self.chunk_bytes)
        except (DatasetNotFoundError, ManifestError) as exc:
            raise ManifestError(
                f"the frozen record {self.where} cannot be read: {exc}; freeze the snapshot again"
            ) from None


async def frozen_chunk_ids(registry: Registry, backend: Backend) -> AsyncGenerator[str, None]:
    """Every chunk id a frozen record in the registry names, if ``backend`` is the
    registry's (the roots of a garbage collection there; nothing for another backend).

    In bounded memory: one record at a time, a schema-2 record's pages a few at a
    time (never a record whole); a schema-1 record, one document, is parsed whole (it
    is at most :data:`~chunkd.client.protocol.MAX_LAYOUT`).

    Raises:
        DatasetError: a frozen record is damaged, or one of its pages is missing or
            damaged (the collection must stop: the snapshot's chunks cannot be told
            from garbage).
    """
    if backend.name != registry.backend_name:
        return
    layout = registry.layout
    async with contextlib.aclosing(backend.scan(layout.frozen_prefix)) as batches:
        async for batch in batches:
            for meta in batch:
                sid = layout.parse_frozen_key(meta.key)
                if sid is None:
                    continue
                where = f"{backend.name}/{meta.key}"
                try:
                    raw = await read_document(backend, meta.key, limit=MAX_LAYOUT)
                    if raw is None:
                        continue  # deleted meanwhile
                    doc = await asyncio.to_thread(
                        functools.partial(
                            parse_frozen, raw, where, expect_id=sid, backend=backend.name
                        )
                    )
                    del raw
                    async with contextlib.aclosing(
                        FrozenChunks(registry, doc, where).batches()
                    ) as named:
                        async for ids in named:
                            for cid in ids:
                                yield cid
                except ManifestError as exc:
                    raise DatasetError(
                        f"garbage collection stopped before deleting anything: {exc}. Its "
                        "chunks cannot be told from garbage; freeze that snapshot again or "
                        "delete the record"
                    ) from None
