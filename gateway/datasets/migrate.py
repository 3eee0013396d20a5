"""Migrating: a snapshot's members copied to another backend, verified, and registered as
a new version of the same dataset with the same logical contents.

The snapshot is worked through a page at a time (a schema-2 snapshot's member pages,
each loaded from the registry when its turn comes: :meth:`.Registry.load_pages`; a
schema-1 snapshot's members in runs of :data:`~chunkd.snapshot.PAGE_TARGET`), never
every member at once. First every destination key is checked, page by page (nothing
is copied if one fails); then, page by page, each member (:data:`_MEMBERS_AT_ONCE`
tasks take a page's members one after another, bounded by bytes in flight)::

    1. its bytes, streamed: from the frozen chunks when the snapshot is frozen (each
       chunk checked against its id), else through the read path at the recorded
       version (a member that drifted is a SnapshotDriftError naming it); their chunk
       ids are noted, and the blake3 of the whole is taken as they pass
    2. the destination key: PREFIX + the member's key below the snapshot's prefix.
       Every destination key is checked before anything is copied: a valid key, and
       none under a prefix chunkd keeps for itself (:mod:`chunkd.gateway.reserved`:
       ``chunks/``, ``checkpoints/``, ``intents/``, ``gc/``, the registry's), however
       it was reached (the destination prefix, or a member's own relative key), and
       wherever it lands: a destination backend whose place holds another backend's
       (``s3://b`` holds ``s3://b/team``) keeps the other's prefixes too; and the keys
       must stay in the source's key order, each once. The checks run in a thread,
       not on the event loop (microseconds a member: seconds at a million members).
       An object there already whose chunks hash to the source's chunk ids is kept as
       it is (migrating twice is harmless; nothing is rewritten, so no version token
       changes); one with other bytes is never overwritten: the migration fails
       naming it
    3. the stream written with :meth:`.Backend.put_stream`, which never overwrites:
       on s3:// a multipart upload finished with ``If-None-Match: *``, on file:// a
       staging file linked into place, elsewhere a put of the whole member if absent
       (refused above :data:`~chunkd.gateway.backends.base.SINGLE_PUT_BYTES`). The
       stream checks the member's size and recorded ``content`` at its end, before
       the write is finished: a member read as other bytes leaves nothing behind. An
       object that appeared meanwhile is checked as in step 2. Then HEAD (the new
       version token), then a GET pinned to that version, straight from the
       destination backend (never the cache), streamed: each chunk of what came back
       must hash to the source's chunk id (IntegrityError otherwise)
    4. the member again, with the destination key and version token, and the blake3
       of its whole bytes (``content``); the copy's ``origin`` is the source snapshot,
       so ``diff`` compares the two by content (chunkd.snapshot)

The copy is a schema-2 snapshot whatever the source's schema: its members go through a
:class:`~chunkd.snapshot.PageWriter` as their pages finish, each page put to the
registry as it is cut (:meth:`.Registry.put_page`, as the daemon's own: its members
carry ``content``), and its root is what is committed as the next version of the
dataset's name. A destination on the source's backend whose prefix lies inside the
source's prefix, or holds it (the backend's root holds every prefix), is refused
before anything is copied: the copy could overwrite its own source, or be listed with
it by the next registration.

Memory: a member in flight holds what its destination's streamed write keeps
(:meth:`.Backend.held_by_put`: one part, 8 MiB, on s3://; nothing on file://; the
whole member where the write is a single put) and one chunk of the check read back;
the source's pieces are leases of the cache (the RAM tier's own bound).
:data:`BYTES_IN_FLIGHT` bounds those shares together (a larger one runs alone), and
the pages held are the snapshot's (one loaded page at a time, of its LRU) and the one
being written (at most :data:`~chunkd.snapshot.PAGE_MAX_BYTES`). A frozen member's
chunk is read only when its object is no larger than the frozen record's chunk size
(a larger one is damaged, unread).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, cast

import blake3

from chunkd.cache import ChunkId
from chunkd.errors import (
    ChunkNotFoundError,
    DatasetNotFoundError,
    IntegrityError,
    InvalidRequestError,
    ObjectExistsError,
    ObjectNotFoundError,
    ReadOnlyBackendError,
    VersionChangedError,
)
from chunkd.gateway.checkpoints.model import CHUNKS
from chunkd.gateway.chunkstore import ByteBudget
from chunkd.gateway.costs import charge
from chunkd.gateway.datasets.pinned import drifted, first_failure, pinned_stat
from chunkd.gateway.datasets.records import FrozenChunks
from chunkd.gateway.names import split_prefix, validate_key
from chunkd.gateway.reserved import ReservedPrefixes
from chunkd.snapshot import PAGE_CACHE, PAGE_TARGET, Member, PageWriter, Snapshot

if TYPE_CHECKING:
    from chunkd.cache import ChunkLease
    from chunkd.gateway.backends import Backend, Backends, ObjectMeta
    from chunkd.gateway.datasets.registry import Registry
    from chunkd.gateway.readpath import ReadPath

__all__ = ["BYTES_IN_FLIGHT", "SOURCE_WINDOW_BYTES", "Migrator"]

log = logging.getLogger(__name__)

#: the members' shares held at once by one migration (a larger share is copied alone)
BYTES_IN_FLIGHT: Final = 512 << 20
#: members copied at once
_MEMBERS_AT_ONCE: Final = 8
#: a member's source bytes asked of the read path at once (one run of its chunks)
SOURCE_WINDOW_BYTES: Final = 8 << 20


class _RecentPages:
    """The copy's page source: the last :data:`~chunkd.snapshot.PAGE_CACHE` pages cut
    (a small copy's every page); any other is loaded from the registry
    (:meth:`.Registry.load_pages`), where every page was put."""

    def __init__(self) -> None:
        self._pages: OrderedDict[str, bytes] = OrderedDict()

    def put(self, page_id: str, data: bytes) -> None:
        self._pages[page_id] = data
        while len(self._pages) > PAGE_CACHE:
            self._pages.popitem(last=False)

    def page(self, page_id: str) -> bytes:
        found = self._pages.get(page_id)
        if found is None:
            raise DatasetNotFoundError(
                f"page {page_id} of a migrated copy is in the dataset registry, not held "
                "here; load it from there (Registry.load_pages)"
            )
        return found


@dataclass
class _Read:
    """What one pass over a member's bytes found."""

    ids: list[ChunkId] = field(default_factory=list)
    content: str | None = None  # set once every byte passed and was checked


class Migrator:
    """Copies snapshots to other backends and registers the copies.

    Args:
        registry: the dataset registry (the copy's pages are put there).
        read_path: the daemon's read path (members are read through it, pinned).
        backends: the configured backends (the destination among them).
    """

    def __init__(self, registry: Registry, read_path: ReadPath, backends: Backends) -> None:
        self.registry = registry
        self.read_path = read_path
        self.backends = backends
        # Where every backend lies: a backend inside another's place keeps the other's
        # reserved prefixes too (``raw = s3://b`` holds ``ckpt = s3://b/team``'s chunks).
        self.reserved = ReservedPrefixes(registry.registry, (b.config for b in backends))

    def destination(self, to: str) -> tuple[Backend, str]:
        """The destination backend (writable) and prefix of ``to`` (``BACKEND/PREFIX``).

        Raises:
            UnknownBackendError, InvalidKeyError, ReadOnlyBackendError
        """
        name, prefix = split_prefix(to)
        backend = self.backends.get(name)
        if not backend.supports_writes:
            raise ReadOnlyBackendError(
                f"cannot migrate to {to}: backend {name!r} is read-only; set writable = true "
                "in its [[backends]] entry, or migrate to a writable backend"
            )
        return backend, prefix

    async def copy(
        self, snapshot: Snapshot, to: str, frozen: dict[str, Any] | None
    ) -> tuple[Snapshot, dict[str, int]]:
        """Copy ``snapshot``'s members to ``to`` and verify them (steps 1-4 above).

        Returns the snapshot of the copy (schema 2; its pages are in the registry, its
        root not committed yet) and what was done.

        Raises:
            ReadOnlyBackendError, ReservedKeyError, InvalidKeyError, InvalidRequestError,
            SnapshotDriftError, IntegrityError, ChunkNotFoundError, DatasetError
        """
        dest, prefix = self.destination(to)
        if dest.name == snapshot.backend:
            source = snapshot.prefix.strip("/")
            if prefix == source:
                raise InvalidRequestError(
                    f"snapshot {snapshot.id} is at {to} already; migrate it to another place"
                )
            if _nested(source, prefix):
                raise InvalidRequestError(
                    f"cannot migrate snapshot {snapshot.id} to {to}: its source "
                    f"{snapshot.backend}/{source} and the destination are one inside the other "
                    "(the copy could overwrite its own source, or be registered with it); "
                    "migrate to a prefix outside the source's"
                )
        # The copy's prefix names a folder, as a registration's does ("" only for the
        # backend's root), so each member's key below it is the same as below the
        # source's (a source at its backend's root included): diff shows no change.
        new_prefix = f"{prefix}/" if prefix else ""
        if new_prefix:
            self.reserved.check(dest.name, new_prefix, door="ds_migrate")
        # Every final key, checked before anything is copied (a page at a time).
        last: str | None = None
        async for _, members in self._runs(snapshot):
            last = (await self._keys(dest.name, new_prefix, snapshot, members, last))[-1]
        chunks = None
        if frozen is not None:  # either schema of record: its pages read as needed
            where = f"{self.registry.backend_name}/{self.registry.layout.frozen(snapshot.id)}"
            chunks = FrozenChunks(self.registry, frozen, where)
        budget = ByteBudget(BYTES_IN_FLIGHT)
        total = len(snapshot.members)
        counts = {"members": total, "bytes": 0, "copied": 0, "kept": 0}
        cut: list[tuple[str, bytes]] = []
        recent = _RecentPages()

        def sink(ident: str, data: bytes) -> None:
            cut.append((ident, data))
            recent.put(ident, data)

        writer = PageWriter(sink)
        last = None
        async for start, members in self._runs(snapshot):
            keys = await self._keys(dest.name, new_prefix, snapshot, members, last)
            last = keys[-1]
            copied = await self._copy_run(
                snapshot, start, members, keys, dest, chunks, counts, budget
            )
            await asyncio.to_thread(_add_all, writer, copied)
            await self._put_pages(cut)
        refs = writer.finish()
        await self._put_pages(cut)
        copy = Snapshot.from_pages(
            backend=dest.name,
            prefix=new_prefix,
            format=snapshot.format,
            pages=refs,
            source=recent,
            schema_of=snapshot.schema_of,
            excluded=snapshot.excluded,
            origin=snapshot.id,
            claims=writer.claimed,
        )
        return copy, counts

    async def _runs(self, snapshot: Snapshot) -> AsyncIterator[tuple[int, Sequence[Member]]]:
        """``(index of the first, members)`` a page at a time: a schema-2 snapshot's
        pages, each loaded from the registry when its turn comes (and held by the
        snapshot while its members are copied), or a schema-1 snapshot's members in
        runs of :data:`PAGE_TARGET`."""
        if not snapshot.pages:
            members = snapshot.members
            for start in range(0, len(members), PAGE_TARGET):
                yield start, members[start : start + PAGE_TARGET]
            return
        for page in range(len(snapshot.pages)):
            await self.registry.load_pages(snapshot, [page])
            yield snapshot.page_start(page), snapshot.page_members(page)

    async def _keys(
        self,
        dest: str,
        prefix: str,
        snapshot: Snapshot,
        members: Sequence[Member],
        after: str | None,
    ) -> list[str]:
        """The final keys of ``members`` in backend ``dest`` below ``prefix``, each a
        valid key outside the reserved prefixes, in strictly increasing order after
        ``after`` (checked in a thread).

        Raises:
            InvalidKeyError, ReservedKeyError: the first member whose key is not.
            InvalidRequestError: two members land on one key, or out of order.
        """
        check = self.reserved.check

        def keys() -> list[str]:
            found = [
                check(dest, validate_key(_dest_key(prefix, snapshot, m)), door="ds_migrate")
                for m in members
            ]
            before = after
            for key in found:
                if before is not None and key.encode() <= before.encode():
                    raise InvalidRequestError(
                        f"cannot migrate snapshot {snapshot.id}: members land on {dest}/{before} "
                        f"and then {dest}/{key}, which is not after it (a member outside the "
                        f"source's prefix {snapshot.prefix!r}); nothing was copied"
                    )
                before = key
            return found

        return await asyncio.to_thread(keys)

    async def _copy_run(
        self,
        snapshot: Snapshot,
        start: int,
        members: Sequence[Member],
        keys: list[str],
        dest: Backend,
        chunks: FrozenChunks | None,
        counts: dict[str, int],
        budget: ByteBudget,
    ) -> list[Member]:
        """Copy one page's ``members`` (global indexes from ``start``), a few at once."""
        copied: dict[int, Member] = {}
        indexes = iter(range(len(members)))
        chunk_bytes = self._chunk_bytes(chunks)

        async def copier() -> None:
            # A few copiers take the members in turn: the tasks in flight are
            # _MEMBERS_AT_ONCE, whatever the number of members.
            for i in indexes:
                size = members[i].size
                share = dest.held_by_put(size) + min(size, chunk_bytes + SOURCE_WINDOW_BYTES)
                await budget.take(share)
                try:
                    copied[i] = await self._copy_member(
                        snapshot, start + i, members[i], dest, keys[i], chunks, counts
                    )
                finally:
                    await budget.give(share)

        with first_failure():
            async with asyncio.TaskGroup() as group:
                for _ in range(min(_MEMBERS_AT_ONCE, len(members))):
                    group.create_task(copier())
        return [copied[i] for i in range(len(members))]

    async def _put_pages(self, cut: list[tuple[str, bytes]]) -> None:
        """Put the copy's pages cut so far to the registry (the daemon's own: their
        members carry ``content``), and let them go."""
        while cut:
            ident, data = cut.pop(0)
            put, _ = await self.registry.put_page(data, verified_copy=True)
            if put != ident:  # pragma: no cover (the writer's id is the hash of the bytes)
                raise IntegrityError(f"page {ident} was stored as {put}")

    def _chunk_bytes(self, chunks: FrozenChunks | None) -> int:
        return chunks.chunk_bytes if chunks is not None else self.read_path.chunk_bytes

    async def _copy_member(
        self,
        snapshot: Snapshot,
        index: int,
        member: Member,
        dest: Backend,
        key: str,
        chunks: FrozenChunks | None,
        counts: dict[str, int],
    ) -> Member:
        chunk_bytes = self._chunk_bytes(chunks)
        name = f"{dest.name}/{key}"
        read = _Read()
        there = await dest.head(key)
        created = False
        if there is None:
            pieces = self._pieces(snapshot, index, member, chunks, read)
            async with contextlib.aclosing(pieces):
                created = await dest.put_stream(key, pieces, size=member.size)
        if created:
            there = await dest.head(key)
            if there is None:
                raise IntegrityError(f"{name} is gone right after it was written; migrate again")
            await self._matches(dest, there, read.ids, chunk_bytes, name, strict=True)
            counts["copied"] += 1
            charge.written("migrate", member.size, dest.name)
        else:
            if read.content is None:  # not read through (an object was there first)
                read = _Read()
                pieces = self._pieces(snapshot, index, member, chunks, read)
                async with contextlib.aclosing(pieces):
                    async for _ in pieces:
                        pass
            there = await dest.head(key)
            if (
                there is None
                or there.size != member.size
                or not await self._matches(dest, there, read.ids, chunk_bytes, name, strict=False)
            ):
                raise ObjectExistsError(
                    f"migrating snapshot {snapshot.id}: {name} exists already with other bytes "
                    f"than member {snapshot.name_of(index)}; it was not overwritten and nothing "
                    "was registered: delete it, or migrate to another prefix"
                )
            counts["kept"] += 1
        counts["bytes"] += member.size
        assert read.content is not None
        return Member(
            key=key,
            size=member.size,
            version=there.version,
            format=member.format,
            samples=member.samples,
            meta=member.meta,
            content=read.content,
        )

    async def _pieces(
        self,
        snapshot: Snapshot,
        index: int,
        member: Member,
        chunks: FrozenChunks | None,
        read: _Read,
    ) -> AsyncGenerator[memoryview, None]:
        """Member ``index``'s bytes, a chunk at a time (each valid until the next is
        asked for), its chunk ids noted in ``read``. At the end, before the consumer
        finishes its write, the size and the recorded ``content`` are checked: only
        then is ``read.content`` set.

        Raises:
            IntegrityError: the member read as other bytes than it records.
            SnapshotDriftError, ChunkNotFoundError
        """
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        size = 0
        if chunks is not None:
            for cid in (ChunkId.parse(c) for c in await chunks.of_member(snapshot, index)):
                raw = await self._frozen_chunk(snapshot, index, cid, chunks.chunk_bytes)
                read.ids.append(cid)
                await asyncio.to_thread(hasher.update, raw)
                size += raw.nbytes
                yield raw
        else:
            leases = self._leases(snapshot, index)
            async with contextlib.aclosing(leases):
                async for lease in leases:
                    with lease:
                        view = lease.view()
                        read.ids.append(lease.id)
                        await asyncio.to_thread(hasher.update, view)
                        size += view.nbytes
                        yield view
        # The hash of the member's whole bytes, as read at its recorded version (or from
        # its verified chunks): the copy's content, and its origin's (chunkd.snapshot).
        digest = hasher.hexdigest()
        if size != member.size or (member.content is not None and member.content != digest):
            raise IntegrityError(
                f"member {snapshot.name_of(index)} of snapshot {snapshot.id} read as other "
                f"bytes than it records ({size} bytes, content {digest}; it records "
                f"{member.size} bytes, content {member.content}); nothing was written or "
                "registered"
            )
        read.content = digest

    async def _leases(self, snapshot: Snapshot, index: int) -> AsyncGenerator[ChunkLease, None]:
        """Leases on member ``index``'s chunks at its recorded version, in order, read
        through the read path a window of :data:`SOURCE_WINDOW_BYTES` at a time (the
        read path fetches a run of cold chunks with one GET, and holds what it fetched
        until it is taken: a window bounds that run). The caller releases each lease.

        Raises:
            SnapshotDriftError: the member changed or vanished (before or during).
        """
        stat = await pinned_stat(self.read_path, snapshot, index)
        window = max(1, SOURCE_WINDOW_BYTES // self.read_path.chunk_bytes)
        for first in range(0, stat.chunks, window):
            leases = self.read_path.leases(stat, first, min(stat.chunks, first + window) - 1)
            async with contextlib.aclosing(leases):
                while True:
                    try:
                        lease = await anext(leases)
                    except StopAsyncIteration:
                        break
                    except VersionChangedError:
                        raise drifted(snapshot, index, "changed while it was read") from None
                    except ObjectNotFoundError:
                        raise drifted(snapshot, index, "vanished while it was read") from None
                    yield lease

    async def _frozen_chunk(
        self, snapshot: Snapshot, index: int, cid: ChunkId, chunk_bytes: int
    ) -> memoryview:
        """A frozen member's chunk ``cid`` (at most ``chunk_bytes``), checked against
        its id."""
        backend = self.registry.backend
        key = f"{CHUNKS}{cid}"
        meta = await backend.head(key)
        # A chunk is at most the record's chunk size: a larger object is damaged
        # and is not read (a planted one may be of any size).
        raw = (
            None
            if meta is None or meta.size > chunk_bytes
            else await backend.get(key, version=meta)
        )
        if meta is None or (raw is None and meta.size <= chunk_bytes):
            raise ChunkNotFoundError(
                f"member {snapshot.name_of(index)} of frozen snapshot {snapshot.id}: chunk "
                f"{cid} is missing from {backend.name}/{CHUNKS}; freeze it again"
            )
        if raw is None or await asyncio.to_thread(ChunkId.of, raw) != cid:
            self.backends.damaged.note(backend.name, cid)
            raise IntegrityError(
                f"member {snapshot.name_of(index)} of frozen snapshot {snapshot.id}: chunk "
                f"{cid} in {backend.name} is damaged; nothing was copied from it"
            )
        return raw

    async def _matches(
        self,
        dest: Backend,
        meta: ObjectMeta,
        ids: list[ChunkId],
        chunk_bytes: int,
        name: str,
        *,
        strict: bool,
    ) -> bool:
        """Whether ``dest``'s object (that version, read from the backend itself, one
        chunk at a time) is the chunks ``ids``; with ``strict``, IntegrityError rather
        than False."""
        found = 0

        def mismatch() -> bool:
            if strict:
                raise IntegrityError(
                    f"the copy at {name} does not match its source: chunk {found} read back "
                    "from the destination hashes differently; nothing was registered: "
                    "migrate again"
                )
            return False

        async def same(chunk: bytearray | memoryview) -> bool:
            cid = await asyncio.to_thread(ChunkId.of, chunk)
            return found < len(ids) and ids[found] == cid

        held = bytearray()
        try:
            pieces = cast(
                "AsyncGenerator[memoryview, None]",
                dest.stream_range(meta, None, piece_bytes=chunk_bytes),
            )
            async with contextlib.aclosing(pieces):
                async for piece in pieces:
                    view = memoryview(piece)
                    while view.nbytes:
                        take = min(chunk_bytes - len(held), view.nbytes)
                        held += view[:take]
                        view = view[take:]
                        if len(held) == chunk_bytes:
                            if not await same(held):
                                return mismatch()
                            found += 1
                            held = bytearray()
        except (ObjectNotFoundError, VersionChangedError):
            return mismatch()
        if held:
            if not await same(held):
                return mismatch()
            found += 1
        return found == len(ids) or mismatch()


def _add_all(writer: PageWriter, members: list[Member]) -> None:
    for member in members:
        writer.add(member)


def _dest_key(prefix: str, snapshot: Snapshot, member: Member) -> str:
    """The copy's key of ``member``: its key below the source's prefix, under ``prefix``
    (``""`` or ending in ``/``)."""
    return prefix + member.relative(snapshot.prefix).lstrip("/")


def _nested(source: str, dest: str) -> bool:
    """Whether the keys under prefixes ``source`` and ``dest`` (no outer slashes; ``""``
    the backend's root) of one backend overlap: one prefix inside the other."""
    below = f"{dest}/" if dest else ""
    return below.startswith(f"{source}/" if source else "") or source.startswith(below)
