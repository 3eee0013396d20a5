"""The content-addressed chunk store in a backend, ``chunks/<id>``: trusted only once verified.

Checkpoint saves and dataset freezes put their chunks there, and find the ones that
are there already (the dedup: a step that changed a quarter of a model uploads a
quarter). A name alone proves nothing: bytes under ``chunks/<id>`` may have been put
there by anyone who could write the backend, before chunkd refused such writes
(:mod:`chunkd.gateway.reserved`), or damaged since. So:

* **Readers verify.** Every chunk read from the store is hashed and compared with its
  id before anything uses it (:meth:`Restorer.chunk <chunkd.gateway.checkpoints.
  restore.Restorer.chunk>`, which also serves frozen snapshots' chunks, and
  ``migrate``). One that does not match is an :class:`~chunkd.errors.IntegrityError`,
  and is noted in this node's :class:`DamagedChunks`.
* **Writers repair** (:func:`put_chunk`, for saves and freezes, which hold the chunk's
  true bytes): a chunk that is absent is put if absent. One that is present is kept
  without reading it (the dedup) only when its size is the chunk's size and this node
  has not seen it damaged. One of another size is damaged already: it is replaced
  without being read (a planted object may be of any size). One of the right size
  that this node read damaged is read back and hashed, and replaced when it does not
  match. A replacement is read back once more. So the next save or freeze that holds
  a damaged chunk's bytes rewrites it, on the node that read it damaged or wherever
  its size is wrong.
* **A scrub** (:func:`scrub`, ``chunkd gc --scrub``) reads every chunk of a store, page
  by page, and reports (or, with ``remove``, deletes) those whose bytes do not hash to
  their names, for a store damaged or poisoned before; a removed chunk is sent again by
  the next save or freeze that holds it. A removal takes the garbage collection's side
  of the barrier protocol (:mod:`chunkd.gateway.checkpoints.barrier`), so that it never
  deletes a chunk a save or freeze has just repaired and is about to commit.

**Bounds.** No object under ``chunks/`` is read whole without a bound: a chunk is at
most :data:`MAX_CHUNK_BYTES`, so an object listed or found larger is damaged without
being read, and every read is pinned to a version whose size is known. One scrub
request holds at most :data:`SCRUB_BYTES_AT_ONCE` bytes of chunks at once
(:data:`_SCRUB_AT_ONCE` reads).

What a size check cannot see (a forged chunk of the right size that no reader on this
node has read yet) a read on any node finds, and the scrub finds everywhere.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from chunkd.cache import MAX_CHUNK_BYTES, ChunkId
from chunkd.client.protocol import MAX_SCRUB_PAGE
from chunkd.errors import IntegrityError, InvalidChunkIdError, VersionChangedError
from chunkd.gateway.backends.damaged import MAX_DAMAGED, DamagedChunks

if TYPE_CHECKING:
    from chunkd.cache import ChunkLease
    from chunkd.gateway.backends import Backend, ObjectMeta
    from chunkd.gateway.checkpoints.barrier import Barrier, Spawn

__all__ = [
    "CHUNKS",
    "MAX_CHUNK_BYTES",
    "MAX_DAMAGED",
    "SCRUB_BYTES_AT_ONCE",
    "ByteBudget",
    "DamagedChunks",
    "ScrubPage",
    "chunk_key",
    "put_chunk",
    "scrub",
]

log = logging.getLogger(__name__)

#: the chunk store's prefix in a backend
CHUNKS: Final = "chunks/"
#: the largest chunk chunkd writes (``cache.chunk_bytes`` is at most this; the tiers
#: refuse larger chunks at the same size): an object under ``chunks/`` that is larger
#: is no chunk of chunkd's, and is damaged without being read
#: chunk bytes one scrub request holds at once (read, not yet hashed)
SCRUB_BYTES_AT_ONCE: Final = 64 << 20
#: chunks one scrub request reads at once
_SCRUB_AT_ONCE: Final = 8
#: deletes one scrub request sends at once (as a collection's sweep)
_DELETES_AT_ONCE: Final = 16


def chunk_key(cid: ChunkId | str) -> str:
    """The key of chunk ``cid`` in a backend's chunk store."""
    return f"{CHUNKS}{cid}"


class ByteBudget:
    """At most ``limit`` bytes held at once by one request's concurrent work; a share
    larger than the limit waits until nothing else is held, then runs alone."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.taken = 0
        self._changed = asyncio.Condition()

    async def take(self, size: int) -> None:
        """Wait until ``size`` more bytes fit, and take them."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.taken == 0 or self.taken + size <= self.limit)
            self.taken += size

    async def give(self, size: int) -> None:
        """Give back ``size`` bytes taken."""
        async with self._changed:
            self.taken -= size
            self._changed.notify_all()


async def _hash_of(raw: memoryview) -> ChunkId:
    return await asyncio.to_thread(ChunkId.of, raw)


async def _hash_at(
    backend: Backend, meta: ObjectMeta, budget: ByteBudget | None = None
) -> ChunkId | None:
    """The hash of version ``meta`` of an object (a read bounded by its size, within
    ``budget``); None when that version is gone or was replaced meanwhile."""
    if budget is not None:
        await budget.take(meta.size)
    try:
        try:
            raw = await backend.get(meta.key, version=meta)
        except VersionChangedError:
            return None
        return None if raw is None else await _hash_of(raw)
    finally:
        if budget is not None:
            await budget.give(meta.size)


async def put_chunk(
    backend: Backend,
    cid: ChunkId,
    size: int,
    lease_of: Callable[[], Awaitable[ChunkLease]],
    damaged: DamagedChunks,
    *,
    before_put: Callable[[], None] = lambda: None,
) -> bool:
    """Make ``chunks/<cid>`` of ``backend`` hold chunk ``cid`` (``size`` bytes), whose
    bytes ``lease_of()`` leases when they must be sent.

    Absent: put if absent (one put by someone else meanwhile is theirs). Present: kept
    unread when of ``size`` bytes and not in ``damaged``; of another size, replaced
    without being read; of ``size`` bytes but in ``damaged``, read back (``size``
    bytes at most) and hashed, and replaced when it does not match. A replacement is
    read back once more. ``before_put`` runs before each put (a fault point). Returns
    whether this call wrote it.

    Raises:
        IntegrityError: the replacement reads back damaged too (the backend does not
            keep what it is given); nothing refers to it yet.
        BackendError: what the backend raised.
    """
    key = chunk_key(cid)
    there = await backend.head(key)
    replace = False
    if there is not None:
        suspect = (backend.name, cid) in damaged
        if there.size == size and not suspect:
            return False
        # A wrong size is damage already: nothing to read (a planted object may be of
        # any size). The right size on a node that read it damaged: read it again,
        # someone may have repaired it since.
        if there.size == size and await _hash_at(backend, there) == cid:
            damaged.repaired(backend.name, cid)
            return False
        log.warning(
            "chunk %s in backend %r is damaged (%d bytes there, %d expected%s); writing it again",
            cid,
            backend.name,
            there.size,
            size,
            "; read damaged on this node before" if suspect else "",
        )
        replace = True
    with await lease_of() as lease:
        before_put()
        if not replace:
            return await backend.put(key, lease.view(), if_absent=True)
        await backend.put(key, lease.view())
    if not await _holds(backend, key, cid, size):
        damaged.note(backend.name, cid)
        raise IntegrityError(
            f"chunk {cid} in backend {backend.name!r} was damaged and its replacement reads "
            "back damaged too: the backend does not keep what it is given; check it"
        )
    damaged.repaired(backend.name, cid)
    return True


async def _holds(backend: Backend, key: str, cid: ChunkId, size: int) -> bool:
    """Whether ``key`` holds chunk ``cid`` of ``size`` bytes now (read at most ``size``
    bytes; a version replaced between the HEAD and the GET is looked at again, once:
    another node repairing the same chunk)."""
    for _ in range(2):
        meta = await backend.head(key)
        if meta is None or meta.size != size:
            return False
        got = await _hash_at(backend, meta)
        if got is not None:
            return got == cid
    return False


@dataclass
class ScrubPage:
    """What one scrub request found (:func:`scrub`)."""

    checked: int = 0
    bytes: int = 0
    #: ``[{"key", "problem"}]``: chunks whose bytes do not hash to their names (or
    #: that are larger than any chunk), and keys under ``chunks/`` that are no chunk id
    damaged: list[dict[str, Any]] = field(default_factory=list)
    removed: int = 0
    #: the key to scrub after next; None when the store is done
    next: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The page as the ``ckpt_scrub`` answer carries it."""
        return {
            "checked": self.checked,
            "bytes": self.bytes,
            "damaged": self.damaged,
            "removed": self.removed,
            "next": self.next,
        }


@dataclass
class _Suspect:
    """A chunk found damaged, and its entry in the page's ``damaged`` list."""

    cid: ChunkId
    entry: dict[str, Any]


async def scrub(
    backend: Backend,
    damaged: DamagedChunks,
    *,
    start_after: str | None = None,
    limit: int = MAX_SCRUB_PAGE,
    remove: bool = False,
    largest_chunk: int = MAX_CHUNK_BYTES,
    spawn: Spawn | None = None,
) -> ScrubPage:
    """Read up to ``limit`` chunks of ``backend``'s store after key ``start_after`` and
    check each against its name; with ``remove``, delete those that do not match.

    An object larger than ``largest_chunk`` (as listed, or by its HEAD) is damaged
    without being read; every other read is pinned to the version the HEAD saw, so it
    is bounded by that size. At most :data:`SCRUB_BYTES_AT_ONCE` bytes are held at once.
    A key under ``chunks/`` that is not a chunk id is reported, never removed (chunkd
    did not write it). Resume with the answer's ``next``.

    ``remove`` follows the garbage collection's side of the barrier protocol
    (docs/checkpoints.md, "Why a save and a scrub never lose a chunk"), for this
    request only: when the page found damaged chunks, it writes a barrier
    (``gc/<run>.json``), reads the intents, keeps every chunk an intent names (a save
    or freeze in flight may be repairing it), reads each other one again and hashes it
    right before its delete (one that matches now, or was replaced or deleted
    meanwhile, is left alone), and removes the barrier however the request ends
    (``spawn`` runs that removal when it must outlive the request).

    Raises:
        BackendError: what the backend raised (nothing is removed past it).
        CheckpointError: ``remove`` on a backend whose one request may take longer
            than a barrier can cover (nothing was read).
    """
    barrier: Barrier | None = None
    if remove:
        # Here, not at the top: the checkpoints package imports this module.
        from chunkd.gateway.checkpoints.barrier import Barrier

        barrier = Barrier(backend, f"{backend.name} (scrub)")  # refuses before any work
    page = ScrubPage()
    listed: list[ObjectMeta] = []
    async for batch in backend.scan(CHUNKS.rstrip("/"), start_after=start_after, batch=limit):
        listed.extend(batch)
        if len(listed) >= limit:
            break
    listed = listed[:limit]
    slots = asyncio.Semaphore(_SCRUB_AT_ONCE)
    budget = ByteBudget(SCRUB_BYTES_AT_ONCE)
    suspects: dict[str, _Suspect] = {}

    def too_large(cid: ChunkId, key: str, size: int) -> None:
        damaged.note(backend.name, cid)
        entry = {
            "key": key,
            "problem": f"{size} bytes, more than any chunk ({largest_chunk}): not read",
        }
        page.damaged.append(entry)
        suspects[key] = _Suspect(cid, entry)

    async def check(listing: ObjectMeta) -> None:
        key = listing.key
        name = key[len(CHUNKS) :]
        try:
            cid = ChunkId.parse(name)
        except InvalidChunkIdError:
            cid = None
        if cid is None or str(cid) != name:
            page.damaged.append({"key": key, "problem": "not a chunk id (not written by chunkd)"})
            return
        if listing.size > largest_chunk:
            too_large(cid, key, listing.size)
            return
        async with slots:
            meta = await backend.head(key)
            if meta is None:
                return  # deleted meanwhile (a collection)
            if meta.size > largest_chunk:
                too_large(cid, key, meta.size)
                return
            got = await _hash_at(backend, meta, budget)
        if got is None:
            return  # written again or deleted meanwhile (a save's repair): checked next time
        page.checked += 1
        page.bytes += meta.size
        if got == cid:
            damaged.repaired(backend.name, cid)
            return
        damaged.note(backend.name, cid)
        entry = {"key": key, "problem": f"its {meta.size} bytes hash to {got}"}
        page.damaged.append(entry)
        suspects[key] = _Suspect(cid, entry)

    async with asyncio.TaskGroup() as group:
        for listing in listed:
            group.create_task(check(listing))
    if barrier is not None and suspects:
        await _remove(backend, damaged, barrier, suspects, page, largest_chunk, budget, spawn)
    page.damaged.sort(key=lambda d: str(d["key"]))
    page.next = listed[-1].key if len(listed) == limit else None
    return page


async def _remove(
    backend: Backend,
    damaged: DamagedChunks,
    barrier: Barrier,
    suspects: dict[str, _Suspect],
    page: ScrubPage,
    largest_chunk: int,
    budget: ByteBudget,
    spawn: Spawn | None,
) -> None:
    """Delete the ``suspects`` a save or freeze cannot be repairing, by the collection's
    side of the barrier protocol (:func:`scrub`)."""
    from chunkd.gateway.checkpoints.barrier import intent_chunks, remove_barrier
    from chunkd.gateway.checkpoints.jobs import each

    wanted = {str(s.cid) for s in suspects.values()}

    async def still_damaged(key: str) -> bool:
        # Read again right before the delete: one repaired since (by a writer outside
        # chunkd's protocol, or an older daemon) is left alone, as is one deleted.
        suspect = suspects[key]
        meta = await backend.head(key)
        if meta is None:
            suspect.entry["problem"] += "; gone before it was removed"
            return False
        if meta.size > largest_chunk:
            return True
        got = await _hash_at(backend, meta, budget)
        if got is None or got == suspect.cid:
            if got is not None:
                damaged.repaired(backend.name, suspect.cid)
            suspect.entry["problem"] += "; not removed: written again meanwhile"
            return False
        return True

    def keep_named(keys: list[str], named: set[str]) -> list[str]:
        for key in keys:
            if str(suspects[key].cid) in named:
                suspects[key].entry["problem"] += (
                    "; not removed: a save or freeze in flight names it (its intent), and "
                    "sends its bytes again if they are damaged"
                )
        return [k for k in keys if str(suspects[k].cid) not in named]

    try:
        await barrier.write()  # before the intents are read: the protocol's pivot
        named = await intent_chunks(backend, expire_after=None, barrier=barrier, wanted=wanted)
        keys = keep_named(sorted(suspects), named)
        for start in range(0, len(keys), _DELETES_AT_ONCE):
            group = keys[start : start + _DELETES_AT_ONCE]
            checked = await each(group, still_damaged)
            group = [k for k, bad in zip(group, checked, strict=True) if bad]
            while not await barrier.clear_to_delete():
                # The barrier may have looked dead to saves for a while: one of them
                # may have written its intent and gone on.
                barrier.rereads += 1
                again = await intent_chunks(
                    backend, expire_after=None, barrier=barrier, wanted=wanted
                )
                group = keep_named(group, again - named)
                named |= again
            with barrier.sending():
                await each(group, backend.delete)
            page.removed += len(group)
            for key in group:
                suspects[key].entry["problem"] += "; removed"
                cid = suspects[key].cid
                log.warning("scrub removed damaged chunk %s from backend %r", cid, backend.name)
    finally:
        await remove_barrier(barrier, spawn if spawn is not None else _spawn, "gc --scrub")


#: removals of scrubs' barriers that outlive their request, when the caller gave no
#: ``spawn`` of its own (kept here so that they are not garbage-collected mid-flight)
_BACKGROUND: set[asyncio.Future[Any]] = set()


def _spawn(work: Awaitable[Any]) -> asyncio.Future[Any]:
    task = asyncio.ensure_future(work)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return task
