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
* **A scrub** (:func:`chunkd.gateway.checkpoints.scrub.scrub`, ``chunkd gc --scrub``)
  reads every chunk of a store and reports (or deletes) those whose bytes do not hash
  to their names. It lives with the garbage collection, whose side of the barrier
  protocol its removals take; this module knows nothing of checkpoints.

**Bounds.** No object under ``chunks/`` is read whole without a bound: a chunk is at
most :data:`MAX_CHUNK_BYTES`, so an object listed or found larger is damaged without
being read, and every read is pinned to a version whose size is known (:func:`hash_at`).

What a size check cannot see (a forged chunk of the right size that no reader on this
node has read yet) a read on any node finds, and the scrub finds everywhere.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

from chunkd.cache import MAX_CHUNK_BYTES, ChunkId
from chunkd.errors import IntegrityError, VersionChangedError
from chunkd.gateway.damaged import MAX_DAMAGED, DamagedChunks

if TYPE_CHECKING:
    from chunkd.cache import ChunkLease
    from chunkd.gateway.backends import Backend, ObjectMeta

__all__ = [
    "CHUNKS",
    "MAX_CHUNK_BYTES",
    "MAX_DAMAGED",
    "ByteBudget",
    "DamagedChunks",
    "chunk_key",
    "hash_at",
    "put_chunk",
]

log = logging.getLogger(__name__)

#: the chunk store's prefix in a backend
CHUNKS: Final = "chunks/"
#: the largest chunk chunkd writes (``cache.chunk_bytes`` is at most this; the tiers
#: refuse larger chunks at the same size): an object under ``chunks/`` that is larger
#: is no chunk of chunkd's, and is damaged without being read


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


async def hash_at(
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
        if there.size == size and await hash_at(backend, there) == cid:
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
        got = await hash_at(backend, meta)
        if got is not None:
            return got == cid
    return False


#: the scrub's names, which lived here before it moved beside the collection
#: (:mod:`chunkd.gateway.checkpoints.scrub`): resolved from there on first use (PEP 562,
#: by module name, since the checkpoints import this module)
_SCRUB: Final = frozenset({"SCRUB_BYTES_AT_ONCE", "ScrubPage", "scrub"})


def __getattr__(name: str) -> Any:
    if name not in _SCRUB:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("chunkd.gateway.checkpoints.scrub"), name)
    globals()[name] = value
    return value
