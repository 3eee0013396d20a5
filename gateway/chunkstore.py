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
  has not seen it damaged; otherwise it is read back and hashed, and a copy that does
  not match is replaced and read back again. So the next save or freeze that holds a
  damaged chunk's bytes rewrites it, on the node that read it damaged or wherever its
  size is wrong.
* **A scrub** (:func:`scrub`, ``chunkd gc --scrub``) reads every chunk of a store, page
  by page, and reports (or, with ``remove``, deletes) those whose bytes do not hash to
  their names, for a store damaged or poisoned before; a removed chunk is sent again by
  the next save or freeze that holds it.

What a size check cannot see (a forged chunk of the right size that no reader on this
node has read yet) a read on any node finds, and the scrub finds everywhere.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from chunkd.cache import ChunkId
from chunkd.client.protocol import MAX_SCRUB_PAGE
from chunkd.errors import IntegrityError, InvalidChunkIdError, VersionChangedError

if TYPE_CHECKING:
    from chunkd.cache import ChunkLease
    from chunkd.gateway.backends import Backend

__all__ = [
    "CHUNKS",
    "MAX_DAMAGED",
    "DamagedChunks",
    "ScrubPage",
    "chunk_key",
    "put_chunk",
    "scrub",
]

log = logging.getLogger(__name__)

#: the chunk store's prefix in a backend
CHUNKS: Final = "chunks/"
#: chunks a node remembers it saw damaged (the oldest is forgotten first)
MAX_DAMAGED: Final = 65_536
#: chunks one scrub request reads at once
_SCRUB_AT_ONCE: Final = 8


def chunk_key(cid: ChunkId | str) -> str:
    """The key of chunk ``cid`` in a backend's chunk store."""
    return f"{CHUNKS}{cid}"


class DamagedChunks:
    """The chunks this node read damaged from a backend's store, until one is repaired.

    Bounded (:data:`MAX_DAMAGED`); forgetting one costs nothing but the next save's
    chance to repair it without a read (the next read notes it again).
    """

    def __init__(self, limit: int = MAX_DAMAGED) -> None:
        self.limit = limit
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()

    def note(self, backend: str, cid: ChunkId | str) -> None:
        """Chunk ``cid`` of ``backend`` read with bytes that do not hash to it."""
        self._seen[(backend, str(cid))] = None
        self._seen.move_to_end((backend, str(cid)))
        while len(self._seen) > self.limit:
            self._seen.popitem(last=False)

    def __contains__(self, item: tuple[str, ChunkId | str]) -> bool:
        backend, cid = item
        return (backend, str(cid)) in self._seen

    def repaired(self, backend: str, cid: ChunkId | str) -> None:
        """Chunk ``cid`` of ``backend`` holds its bytes again."""
        self._seen.pop((backend, str(cid)), None)

    def __len__(self) -> int:
        return len(self._seen)


async def _hash_of(raw: memoryview) -> ChunkId:
    return await asyncio.to_thread(ChunkId.of, raw)


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
    unread when of ``size`` bytes and not in ``damaged``; otherwise read back and
    hashed, and replaced when it does not match, then read back once more.
    ``before_put`` runs before each put (a fault point). Returns whether this call
    wrote it.

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
        raw = await backend.get(key)
        if raw is not None and await _hash_of(raw) == cid:
            damaged.repaired(backend.name, cid)
            return False
        log.warning(
            "chunk %s in backend %r is damaged (%s bytes there, %d expected%s); writing it again",
            cid,
            backend.name,
            "no" if raw is None else raw.nbytes,
            size,
            "; read damaged on this node before" if suspect else "",
        )
        replace = True
    with await lease_of() as lease:
        before_put()
        if not replace:
            return await backend.put(key, lease.view(), if_absent=True)
        await backend.put(key, lease.view())
    again = await backend.get(key)
    if again is None or await _hash_of(again) != cid:
        damaged.note(backend.name, cid)
        raise IntegrityError(
            f"chunk {cid} in backend {backend.name!r} was damaged and its replacement reads "
            "back damaged too: the backend does not keep what it is given; check it"
        )
    damaged.repaired(backend.name, cid)
    return True


@dataclass
class ScrubPage:
    """What one scrub request found (:func:`scrub`)."""

    checked: int = 0
    bytes: int = 0
    #: ``[{"key", "problem"}]``: chunks whose bytes do not hash to their names, and keys
    #: under ``chunks/`` that are no chunk id
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


async def scrub(
    backend: Backend,
    damaged: DamagedChunks,
    *,
    start_after: str | None = None,
    limit: int = MAX_SCRUB_PAGE,
    remove: bool = False,
) -> ScrubPage:
    """Read up to ``limit`` chunks of ``backend``'s store after key ``start_after`` and
    check each against its name; with ``remove``, delete those that do not match.

    A key under ``chunks/`` that is not a chunk id is reported, never removed (chunkd
    did not write it). Resume with the answer's ``next``.

    Raises:
        BackendError: what the backend raised (nothing is removed past it).
    """
    page = ScrubPage()
    keys: list[str] = []
    async for batch in backend.scan(CHUNKS.rstrip("/"), start_after=start_after, batch=limit):
        keys.extend(meta.key for meta in batch)
        if len(keys) >= limit:
            break
    keys = keys[:limit]
    slots = asyncio.Semaphore(_SCRUB_AT_ONCE)

    async def check(key: str) -> None:
        name = key[len(CHUNKS) :]
        try:
            cid = ChunkId.parse(name)
        except InvalidChunkIdError:
            cid = None
        if cid is None or str(cid) != name:
            page.damaged.append({"key": key, "problem": "not a chunk id (not written by chunkd)"})
            return
        async with slots:
            meta = await backend.head(key)
            if meta is None:
                return  # deleted meanwhile (a collection)
            try:
                raw = await backend.get(key, version=meta)
            except VersionChangedError:
                return  # written again meanwhile (a save's repair): checked next time
            if raw is None:
                return
            got = await _hash_of(raw)
        page.checked += 1
        page.bytes += raw.nbytes
        if got == cid:
            damaged.repaired(backend.name, cid)
            return
        damaged.note(backend.name, cid)
        page.damaged.append({"key": key, "problem": f"its {raw.nbytes} bytes hash to {got}"})
        if remove:
            now = await backend.head(key)
            if now is None or now.version != meta.version:
                return  # written again since it was read: not the damaged copy any more
            await backend.delete(key)
            page.removed += 1
            log.warning("scrub removed damaged chunk %s from backend %r", cid, backend.name)

    async with asyncio.TaskGroup() as group:
        for key in keys:
            group.create_task(check(key))
    page.damaged.sort(key=lambda d: str(d["key"]))
    page.next = keys[-1] if len(keys) == limit else None
    return page
