"""The scrub of a backend's chunk store (``chunkd gc --scrub``, op ``ckpt_scrub``).

A scrub reads every chunk of a store, page by page, and reports (or, with ``remove``,
deletes) those whose bytes do not hash to their names, for a store damaged or poisoned
before; a removed chunk is sent again by the next save or freeze that holds it
(:func:`chunkd.gateway.chunkstore.put_chunk`). A removal takes the garbage collection's
side of the barrier protocol (:mod:`chunkd.gateway.checkpoints.barrier`), so that it never
deletes a chunk a save or freeze has just repaired and is about to commit: that is why the
scrub lives here, with the collection, and the chunk store beneath knows nothing of it.

**Bounds.** An object larger than any chunk is damaged without being read; every other
read is pinned to a version whose size is known. One scrub request reads at most
:data:`~chunkd.client.protocol.MAX_SCRUB_PAGE` chunks and holds at most
:data:`SCRUB_BYTES_AT_ONCE` bytes of them at once (:data:`_SCRUB_AT_ONCE` reads).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from chunkd.cache import MAX_CHUNK_BYTES, ChunkId
from chunkd.client.protocol import MAX_SCRUB_PAGE
from chunkd.errors import InvalidChunkIdError
from chunkd.gateway.checkpoints.barrier import Barrier, Spawn, intent_chunks, remove_barrier
from chunkd.gateway.checkpoints.jobs import each
from chunkd.gateway.chunkstore import CHUNKS, ByteBudget, hash_at

if TYPE_CHECKING:
    from chunkd.gateway.backends import Backend, ObjectMeta
    from chunkd.gateway.damaged import DamagedChunks

__all__ = ["SCRUB_BYTES_AT_ONCE", "ScrubPage", "scrub"]

log = logging.getLogger(__name__)

#: chunk bytes one scrub request holds at once (read, not yet hashed)
SCRUB_BYTES_AT_ONCE: Final = 64 << 20
#: chunks one scrub request reads at once
_SCRUB_AT_ONCE: Final = 8
#: deletes one scrub request sends at once (as a collection's sweep)
_DELETES_AT_ONCE: Final = 16


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
            got = await hash_at(backend, meta, budget)
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
        got = await hash_at(backend, meta, budget)
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
