"""The barrier between garbage collections and saves: ``gc/<run>.json``.

A collection writes its barrier before it reads the intents and removes it after its
last delete (:class:`Barrier`, the collection's side; :func:`intent_chunks`,
:func:`remove_barrier`); a save lists the barriers after its intent is written and
before its first dedup decision, and waits for the ones it saw
(:func:`await_collections`: step 5 in :mod:`chunkd.gateway.checkpoints.save`, and the
same step of a dataset freeze). ``docs/checkpoints.md`` has the argument that together
they never lose a chunk.

Whatever deletes chunks a save might find present takes the collection's side whole:
``chunkd gc``'s sweep (:mod:`.gc`) and ``chunkd gc --scrub --remove``
(:func:`chunkd.gateway.checkpoints.scrub.scrub`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Final

from chunkd.canonical import canonical
from chunkd.errors import CheckpointError, ChunkdError
from chunkd.gateway.checkpoints.jobs import each, polling
from chunkd.gateway.checkpoints.model import GC_BARRIERS, INTENTS

if TYPE_CHECKING:
    from chunkd.gateway.backends import Backend, ObjectMeta

__all__ = [
    "BARRIER_EXPIRY",
    "BARRIER_EXPIRY_CAP",
    "Barrier",
    "Spawn",
    "await_collections",
    "declared_expiry",
    "intent_chunk_ids",
    "intent_chunks",
    "list_barriers",
    "remove_barrier",
]

log = logging.getLogger(__name__)

#: how a writer sends one backend request: ``attempt(step)`` awaits ``step()``, with
#: whatever retries it wants (a save job waits out a backend that is down)
Attempt = Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]
#: runs work in the background, beyond the request that starts it (``Jobs.spawn``)
Spawn = Callable[[Awaitable[Any]], "asyncio.Future[Any]"]

#: the shortest expiry of a collection's barrier (longer where one backend request
#: may take longer): how long saves wait for a collection that died
BARRIER_EXPIRY: Final = 120.0
#: the longest expiry a save honours, whatever a barrier declares
BARRIER_EXPIRY_CAP: Final = 3600.0
#: the share of a barrier's expiry a collection relies on: clocks run at rates that
#: differ by far less than 1%
_CLOCK_RATE_SLACK: Final = 0.99
#: intents read at once (each is parsed whole)
_INTENTS_AT_ONCE: Final = 16


class Barrier:
    """One garbage collection's barrier, ``gc/<run>.json``, kept fresh while it sweeps.

    The protocol (docs/checkpoints.md): a save that lists this barrier waits until it
    is gone, or until it has not changed for :attr:`expiry` seconds, measured on the
    save's own monotonic clock (the collection died). So that safety never rests on
    clocks agreeing, the collection keeps its own side of that bargain on its own
    clock alone (``CLOCK_BOOTTIME``: it goes on while the machine is suspended, so a
    suspended collection only overestimates how long it was away):

    * it rewrites the barrier every ``expiry / 8`` seconds (:meth:`keep_fresh`);
    * it sends a delete only if the delete, retries included (:attr:`request_bound`),
      ends before ``expiry`` (less 1% for clocks that run at different rates) after the
      start of the last rewrite that completed, with ``expiry / 4`` to spare for a
      process stalled between that check and the send (:meth:`clear_to_delete`): no
      save can have taken that version of the barrier for dead before then;
    * a rewrite that completes later than that point is a *gap*: saves may have passed
      the barrier meanwhile, each with its intent written first, so the intents are
      read again before the next delete.
    """

    def __init__(self, backend: Backend, target: str) -> None:
        config = backend.config
        self.backend = backend
        self.target = target
        self.run = uuid.uuid4().hex
        self.key = f"{GC_BARRIERS}{self.run}.json"
        #: the longest one request may take, its retries and their backoff included
        self.request_bound = backend.request_bound
        #: how long the barrier may go unchanged before saves take the collection for dead
        self.expiry = max(BARRIER_EXPIRY, 4 * self.request_bound)
        if self.expiry > BARRIER_EXPIRY_CAP:
            raise CheckpointError(
                f"backend {backend.name!r}: with timeout {config.timeout:g}s and {config.retries} "
                f"retries, one request may take {self.request_bound:g}s, too long for a "
                "garbage collection whose barrier saves wait at most "
                f"{BARRIER_EXPIRY_CAP:g}s for; lower the backend's timeout or retries"
            )
        self.refreshes = 0
        #: how many times the intents were read again after a gap
        self.rereads = 0
        #: a request of the collection's may still be on its way (a delete or a
        #: rewrite that was cancelled or failed): the backend may yet carry it out
        self.unsettled = False
        self._gap = False
        self._written: float | None = None  # when the last completed write started

    def _safe_until(self) -> float:
        assert self._written is not None
        return self._written + self.expiry * _CLOCK_RATE_SLACK

    async def write(self) -> None:
        """Write (or rewrite) the barrier; a rewrite that ends late records a gap."""
        started = _clock()
        doc = {
            "format": "chunkd-gc-barrier",
            "run": self.run,
            "target": self.target,
            "written": time.time(),
            "refreshes": self.refreshes,  # each rewrite differs: a new version token
            "expires_after": self.expiry,
        }
        with self.sending():
            await self.backend.put(self.key, canonical(doc))
        if self._written is not None and _clock() > self._safe_until():
            self._gap = True
        self._written = started
        self.refreshes += 1

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        """Around the collection's writes: :attr:`unsettled` unless they all ended."""
        self.unsettled = True
        yield
        self.unsettled = False

    async def keep_fresh(self) -> None:
        """Rewrite the barrier if the last write is ``expiry / 8`` old."""
        if self._written is None or _clock() - self._written > self.expiry / 8:
            await self.write()

    async def clear_to_delete(self) -> bool:
        """Whether deletes sent right now are covered by the barrier; False when the
        intents must be read again first (there was a gap)."""
        while True:
            await self.keep_fresh()
            if self._gap:
                self._gap = False
                return False
            if _clock() + self.request_bound + self.expiry / 4 <= self._safe_until():
                return True
            await self.write()  # the last write itself was slow: start afresh


async def remove_barrier(barrier: Barrier, spawn: Spawn, what: str = "gc") -> None:
    """Remove ``barrier``, however the collection (or scrub) that wrote it ended.

    The delete runs as work of its own (``spawn``), so a collection cancelled (its
    client went away) still removes its barrier. If the collection ended with a
    request of its own maybe still on its way (a delete cancelled or failed
    mid-flight: :attr:`Barrier.unsettled`), the barrier stays until that request is
    surely over (:attr:`Barrier.request_bound`), in the background: a save must not
    look for a chunk that delete may yet remove. If even the removal fails, saves take
    the barrier for abandoned once it has not changed for its expiry.
    """
    delay = barrier.request_bound if barrier.unsettled else 0.0

    async def remove() -> None:
        await asyncio.sleep(delay)
        try:
            await barrier.backend.delete(barrier.key)
        except ChunkdError as exc:
            log.warning(
                "%s: could not remove barrier %s/%s (%s); saves pass it once it has "
                "been unchanged for %.0fs",
                what,
                barrier.backend.name,
                barrier.key,
                exc,
                barrier.expiry,
            )

    removal = spawn(remove())
    if not delay:
        await asyncio.shield(removal)


async def intent_chunks(
    backend: Backend,
    *,
    expire_after: float | None,
    barrier: Barrier | None = None,
    wanted: set[str] | None = None,
) -> set[str]:
    """The chunk ids the intents in ``backend`` name (saves and freezes in flight, and
    saves committed less than the intents' lifetime ago), as a set: a scrub's few
    (``wanted``: only those ids are kept, whatever the intents name). A collection
    streams them instead (:func:`intent_chunk_ids`).
    """
    keep: set[str] = set()
    async with contextlib.aclosing(
        intent_chunk_ids(backend, expire_after=expire_after, barrier=barrier)
    ) as named:
        async for ids in named:
            keep.update(ids if wanted is None else (c for c in ids if c in wanted))
    return keep


async def intent_chunk_ids(
    backend: Backend, *, expire_after: float | None, barrier: Barrier | None = None
) -> AsyncGenerator[list[str], None]:
    """The chunk ids the intents in ``backend`` name, one intent's list at a time
    (repeats included), a listing batch's intents read a few at a time.

    Intents older than ``expire_after`` seconds are deleted (None: none is, and every
    intent counts). ``barrier`` is kept fresh meanwhile (there may be many intents to
    read).
    """
    now = time.time()

    async def read(key: str) -> list[str]:
        raw = await backend.get(key)
        if raw is None:
            return []
        try:
            chunks = json.loads(bytes(raw))["chunks"]
        except (ValueError, KeyError, TypeError):
            return []
        return [str(c) for c in chunks] if isinstance(chunks, list) else []

    async with contextlib.aclosing(backend.scan(INTENTS.rstrip("/"))) as batches:
        async for batch in batches:
            expired = [
                m.key for m in batch if expire_after is not None and now - m.modified > expire_after
            ]
            await each(expired, backend.delete)  # their saves committed or died long ago
            gone = set(expired)
            keys = [m.key for m in batch if m.key not in gone]
            # A few intents at a time: each may name a whole rank's save.
            for start in range(0, len(keys), _INTENTS_AT_ONCE):
                for ids in await each(keys[start : start + _INTENTS_AT_ONCE], read):
                    yield ids
                if barrier is not None:
                    await barrier.keep_fresh()


def _clock() -> float:
    """Seconds on a clock that never goes back and counts time suspended."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


async def list_barriers(backend: Backend) -> list[ObjectMeta]:
    """The barriers of the collections running in ``backend`` (never a cached listing)."""
    found: list[ObjectMeta] = []
    async with contextlib.aclosing(backend.scan(GC_BARRIERS.rstrip("/"))) as batches:
        async for batch in batches:
            found += [m for m in batch if m.key.endswith(".json")]
    return found


async def declared_expiry(backend: Backend, meta: ObjectMeta) -> float | None:
    """How long barrier ``meta`` may stay unchanged before it counts as abandoned
    (None: it is gone already)."""
    raw = await backend.get(meta.key)
    if raw is None:
        return None
    try:
        declared = float(json.loads(bytes(raw))["expires_after"])
    except (ValueError, KeyError, TypeError):
        declared = BARRIER_EXPIRY_CAP  # not ours to judge: the longest wait
    if not declared > 0:
        declared = BARRIER_EXPIRY_CAP
    return min(declared, BARRIER_EXPIRY_CAP)


async def await_collections(
    backend: Backend,
    *,
    poll_interval: float,
    attempt: Attempt,
    what: str,
    on_wait: Callable[[int], None] | None = None,
) -> None:
    """Wait until every garbage collection whose barrier is up now is over.

    The writer's side of the barrier protocol, for every writer that deduplicates
    against ``chunks/`` (a save, a dataset freeze): call it after the writer's intent
    is in the backend and before any of its chunks is looked up there. A collection
    whose barrier is listed here may have read the intents before that intent was
    written, so it may still delete a chunk the writer would find present: wait
    until its barrier is gone. One whose barrier is not listed yet writes it after
    the intent exists, and reads the intents after that, before it deletes anything
    (docs/checkpoints.md has the argument).

    A barrier that stays the same for the expiry it declares, measured here on this
    daemon's monotonic clock, belongs to a collection that died (kill -9): it is
    passed over. The collection's side of that bargain is :class:`Barrier`.

    Args:
        backend: where the writer's chunks go.
        poll_interval: the longest pause between two listings of the barriers.
        attempt: sends one request (with the writer's own retries).
        what: the writer, for the log ("checkpoint BACKEND/PATH").
        on_wait: called with the number of barriers, when there are any to wait for.
    """
    barriers: list[ObjectMeta] = await attempt(lambda: list_barriers(backend))
    if not barriers:
        return
    if on_wait is not None:
        on_wait(len(barriers))
    seen = time.monotonic()
    # barrier key -> (version, when that version was first seen, its expiry)
    watched: dict[str, tuple[str, float, float]] = {}
    for meta in barriers:
        expiry = await declared_expiry(backend, meta)
        if expiry is not None:
            watched[meta.key] = (meta.version, seen, expiry)
    pauses = polling(poll_interval).delays()
    while watched:
        await asyncio.sleep(next(pauses))
        asked = time.monotonic()
        listed: list[ObjectMeta] = await attempt(lambda: list_barriers(backend))
        now = {m.key: m for m in listed}
        answered = time.monotonic()
        for key, (version, since, expiry) in list(watched.items()):
            current = now.get(key)
            if current is None:
                del watched[key]  # that collection is over
            elif current.version != version:  # rewritten: alive
                renewed = await declared_expiry(backend, current)
                if renewed is None:
                    del watched[key]
                else:
                    watched[key] = (current.version, answered, renewed)
            elif asked - since >= expiry:
                log.warning(
                    "%s: garbage collection barrier %s/%s has not changed for %.0fs; its "
                    "collection is taken for dead and the write goes on",
                    what,
                    backend.name,
                    key,
                    asked - since,
                )
                del watched[key]
