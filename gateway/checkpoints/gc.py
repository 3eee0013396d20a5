"""Garbage collection: retention, then mark and sweep of a backend's chunks, safe
against the saves running meanwhile by the barrier protocol (:mod:`.barrier`)."""

from __future__ import annotations

import contextlib
import functools
import heapq
import json
import logging
import tempfile
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from chunkd.errors import CheckpointError, CheckpointNotFoundError
from chunkd.gateway.checkpoints.barrier import Barrier, intent_chunk_ids, remove_barrier
from chunkd.gateway.checkpoints.catalog import Catalog
from chunkd.gateway.checkpoints.jobs import Jobs, each
from chunkd.gateway.checkpoints.mark import LiveIds, MarkSet, id_bytes
from chunkd.gateway.checkpoints.model import (
    CHECKPOINTS,
    CHUNKS,
    PART_RE,
    is_manifest,
    manifest_key,
)
from chunkd.gateway.costs import charge
from chunkd.gateway.names import split_name

if TYPE_CHECKING:
    from chunkd.gateway.backends import Backend, ObjectMeta

__all__ = ["Collector"]

log = logging.getLogger(__name__)

_DELETES_AT_ONCE: Final = 16
#: documents (parts, manifests) the mark reads at once: each is parsed whole
_READS_AT_ONCE: Final = 16
#: root ids taken before they are added to the mark
_ROOT_IDS_AT_ONCE: Final = 4096

#: the chunk ids that other stores keep in a backend (a dataset registry's frozen
#: snapshots): roots of the mark, like the checkpoints' parts
Roots = Callable[["Backend"], AsyncGenerator[str, None]]


class Collector:
    """``chunkd gc``, run by the daemon with its own credentials.

    Args:
        catalog: the checkpoints (retention lists and deletes through it).
        jobs: where the removal of a barrier runs when it must outlive its collection.
        roots: the chunk ids other stores keep in a backend (the dataset registry's
            frozen snapshots), marked live like the checkpoints' own; a failure there
            stops the collection before it deletes anything.
        mark_dir: where a collection writes the ids it marks (:mod:`.mark`): the
            daemon's ``<cache dir>/checkpoints/gc-mark``; None: the system's
            temporary directory.
    """

    def __init__(
        self,
        catalog: Catalog,
        jobs: Jobs,
        roots: Roots | None = None,
        *,
        mark_dir: Path | None = None,
    ) -> None:
        self.catalog = catalog
        self.jobs = jobs
        self.roots = roots
        self.mark_dir = mark_dir if mark_dir is not None else Path(tempfile.gettempdir())

    async def gc(
        self,
        target: str,
        *,
        keep_last: int | None,
        grace: float,
        dry_run: bool,
        pending_ttl: float = 7 * 86400,
        intent_ttl: float = 86400,
        may_retire: Callable[[dict[str, Any]], bool] | None = None,
    ) -> dict[str, Any]:
        """Retention under ``BACKEND[/PREFIX]``, then mark and sweep the backend's chunks.

        ``may_retire`` says of each checkpoint under ``target`` (its listing entry,
        ``owner`` included) whether retention may retire it (the caller's own): only
        those count towards ``keep_last`` and are retired; the others are kept, and
        the report counts them (``others_kept``).

        Mark: every chunk named by the parts of a committed manifest anywhere in the
        backend, by a part of a save not yet committed (younger than ``pending_ttl``;
        older ones are deleted), by the roots (frozen dataset snapshots), or by an
        intent (intents outlive their save's commit and are deleted after
        ``intent_ttl``; a freeze in flight has its own). Sweep: unreferenced chunks older than
        ``grace`` seconds.

        Safe against saves running meanwhile, by protocol: the collection's barrier
        (``gc/<run>.json``) is up from before it reads the intents until after its last
        delete, and a save looks for barriers after its intent is written and before
        it looks up any chunk (docs/checkpoints.md). The barrier is removed however
        the collection ends, a cancel included.

        Memory is bounded whatever the number of live chunks: every listing is the
        backend's own, one batch at a time, and the marked ids go to disk in sorted
        runs (:class:`.MarkSet`), merged against the listing of ``chunks/`` in key
        order (docs/checkpoints.md, "How much memory a collection takes").
        """
        backend, path = self.catalog.listed(target)
        backend.check_writable()
        barrier = None if dry_run else Barrier(backend, target)  # refuses before any work
        report: dict[str, Any] = {"target": target, "dry_run": dry_run, "retired": []}
        if keep_last is not None:
            listed = [e async for e in self.catalog.committed(backend, path)]
            listed.sort(key=lambda e: (e["step"] if e["step"] is not None else -1, e["created"]))
            if may_retire is not None:
                mine = [e for e in listed if may_retire(e)]
                report["others_kept"] = len(listed) - len(mine)
                listed = mine
            doomed = listed[: max(0, len(listed) - keep_last)]
            gone: list[str] = []

            async def retire(entry: dict[str, Any]) -> None:
                # Only the checkpoint that was listed: one committed at the name since
                # is kept, and its chunks are marked below like any other's.
                with contextlib.suppress(CheckpointNotFoundError):  # or deleted meanwhile
                    await self.catalog.delete(entry["name"], save_id=entry.get("save_id"))
                    gone.append(entry["name"])

            if dry_run:
                gone = [e["name"] for e in doomed]
            else:
                await each(doomed, retire)
            report["retired"] = sorted(gone)
        report["retired_count"] = len(report["retired"])
        now = time.time()
        # A dry run marks as if the retired checkpoints were gone already.
        retired = {manifest_key(split_name(n)[1]) for n in report["retired"]}
        async with MarkSet(self.mark_dir) as marked:
            stale = await self._mark(backend, retired, marked, stale_before=now - pending_ttl)
            if self.roots is not None:
                # Roots written after this listing were preceded by their intents (read
                # below, after the barrier), as a save's part is.
                rooted = 0
                ids: list[str] = []
                async with contextlib.aclosing(self.roots(backend)) as roots:
                    async for cid in roots:
                        ids.append(cid)
                        rooted += 1
                        if len(ids) >= _ROOT_IDS_AT_ONCE:
                            await marked.extend(ids)
                            ids = []
                await marked.extend(ids)
                report["root_chunks"] = rooted
            report["stale_parts"] = len(stale)
            if not dry_run:
                await each(stale, backend.delete)
            try:
                if barrier is not None:
                    await barrier.write()  # before the intents are read: the protocol's pivot
                expire = None if dry_run else intent_ttl
                async with contextlib.aclosing(
                    intent_chunk_ids(backend, expire_after=expire, barrier=barrier)
                ) as intents:
                    async for named in intents:
                        await marked.extend(named)
                report["marked_ids"] = marked.named
                live = await marked.live()
                report |= await self._sweep(backend, live, now - grace, barrier)
            finally:
                if barrier is not None:
                    await remove_barrier(barrier, self.jobs.spawn)
                    report["barrier_refreshes"] = barrier.refreshes - 1
                    report["intent_rereads"] = barrier.rereads
        log.info(
            "gc %s: %s",
            target,
            {k: v for k, v in report.items() if k != "retired"},
        )
        charge.gc_report(backend.name, report)  # GET /v1/cost/storage's gc_reclaimable
        return report

    async def _mark(
        self, backend: Backend, retired: set[str], marked: MarkSet, *, stale_before: float
    ) -> list[str]:
        """Mark the chunks the checkpoints name; return the parts of saves never
        committed that were last written before ``stale_before``.

        One pass over ``checkpoints/`` in key order: a checkpoint's manifest
        (``.../manifest.json``) comes before its parts (``.../parts/...``), so each
        part is known as committed or not when it is reached. Parts no manifest names
        are a save in flight (their chunks are marked) or, last written before
        ``stale_before``, an abandoned one (returned, to be deleted). The part keys
        a manifest names are held only until the listing has passed them.
        """
        committed: set[str] = set()
        ahead: list[str] = []  # a heap of ``committed``: the keys the listing has not passed
        old: set[str] = set()
        async with contextlib.aclosing(backend.scan(CHECKPOINTS.rstrip("/"))) as batches:
            async for batch in batches:
                manifests = [m for m in batch if is_manifest(m.key)]
                named = await each(
                    [m.key for m in manifests], functools.partial(self._manifest_parts, backend)
                )
                to_read: list[str] = []
                for meta, keys in zip(manifests, named, strict=True):
                    for key in keys:
                        if key not in committed:
                            committed.add(key)
                            heapq.heappush(ahead, key)
                    old.difference_update(keys)  # an earlier part, committed after all
                    if meta.key not in retired:
                        to_read += keys
                for meta in batch:
                    if not PART_RE.search(meta.key) or meta.key in committed:
                        continue
                    if meta.modified < stale_before:
                        old.add(meta.key)
                    else:
                        to_read.append(meta.key)  # a save in flight
                # A few parts at a time: each may name a rank's every chunk.
                for start in range(0, len(to_read), _READS_AT_ONCE):
                    keys = to_read[start : start + _READS_AT_ONCE]
                    for chunks in await each(keys, functools.partial(self._part_chunks, backend)):
                        await marked.extend(chunks)
                if batch:
                    passed = batch[-1].key
                    while ahead and ahead[0] <= passed:
                        committed.discard(heapq.heappop(ahead))
        return sorted(old)

    async def _manifest_parts(self, backend: Backend, key: str) -> list[str]:
        """The part keys the manifest at ``key`` names (none if it is gone or torn)."""
        raw = await backend.get(key)
        if raw is None:
            return []
        try:
            return [str(p["key"]) for p in json.loads(bytes(raw))["parts"]]
        except (ValueError, KeyError, TypeError):
            return []

    async def _sweep(
        self, backend: Backend, live: LiveIds, doomed_before: float, barrier: Barrier | None
    ) -> dict[str, int]:
        """Delete the chunks ``live`` does not hold written before ``doomed_before``
        (none without a barrier: a dry run); count what was found.

        The listing of ``chunks/`` and ``live`` both ascend, so each chunk is looked
        up by advancing ``live`` to its id. The intents read again after a gap go to a
        mark of their own (with what the last such mark held further on), looked up
        alongside ``live`` from then on.
        """
        counts = dict.fromkeys(("chunks", "referenced", "kept_young", "swept", "freed_bytes"), 0)
        last: bytes | None = None
        async with contextlib.AsyncExitStack() as stack:
            again: LiveIds | None = None  # the intents read again, if they were
            again_set: MarkSet | None = None
            batches = await stack.enter_async_context(
                contextlib.aclosing(backend.scan(CHUNKS.rstrip("/")))
            )
            async for batch in batches:
                ids = [id_bytes(meta.key[len(CHUNKS) :]) for meta in batch]
                listed = [cid for cid in ids if cid is not None]
                for listed_id in listed:
                    if last is not None and listed_id <= last:
                        raise CheckpointError(
                            f"backend {backend.name!r} listed {CHUNKS}{listed_id.hex()} after "
                            f"{CHUNKS}{last.hex()}, out of key order; garbage collection "
                            "stopped, deleting nothing more"
                        )
                    last = listed_id
                held = await live.holding(listed)
                if again is not None:
                    held = [a or b for a, b in zip(held, await again.holding(listed), strict=True)]
                found = iter(held)
                doomed: list[tuple[ObjectMeta, bytes | None]] = []
                for meta, cid in zip(batch, ids, strict=True):
                    counts["chunks"] += 1
                    if cid is not None and next(found):
                        counts["referenced"] += 1
                    elif meta.modified >= doomed_before:
                        counts["kept_young"] += 1
                    else:
                        doomed.append((meta, cid))
                reread = False  # this batch's doomed chunks are looked up in ``again`` too
                for start in range(0, len(doomed), _DELETES_AT_ONCE):
                    group = doomed[start : start + _DELETES_AT_ONCE]
                    if barrier is not None:
                        while not await barrier.clear_to_delete():
                            # The barrier may have looked dead to saves for a while:
                            # one of them may have written its intent and gone on.
                            barrier.rereads += 1
                            reread = True
                            fresh = MarkSet(self.mark_dir)
                            stack.push_async_callback(fresh.close)
                            await self._reread_intents(backend, barrier, fresh)
                            if again is not None and again_set is not None:
                                await fresh.absorb(again)  # every read's intents count
                                await again_set.close()
                            again, again_set = await fresh.live(), fresh
                        if reread and again is not None:
                            ask = [c for _, c in group if c is not None]
                            kept = iter(await again.holding(ask))
                            before = len(group)
                            group = [(m, c) for m, c in group if c is None or not next(kept)]
                            counts["referenced"] += before - len(group)
                        with barrier.sending():
                            await each([m.key for m, _ in group], backend.delete)
                    counts["swept"] += len(group)
                    counts["freed_bytes"] += sum(m.size for m, _ in group)
                if barrier is not None:
                    await barrier.keep_fresh()
        return counts

    async def _reread_intents(self, backend: Backend, barrier: Barrier, into: MarkSet) -> None:
        """Mark the intents' chunk ids, read again (after a gap in the barrier)."""
        async with contextlib.aclosing(
            intent_chunk_ids(backend, expire_after=None, barrier=barrier)
        ) as intents:
            async for named in intents:
                await into.extend(named)

    async def _part_chunks(self, backend: Backend, key: str) -> list[str]:
        """The chunk ids a part names (none if it is gone or unreadable)."""
        raw = await backend.get(key)
        if raw is None:
            return []
        try:
            part = json.loads(bytes(raw))
            return [str(c) for seg in part["segments"] for c, _ in seg["chunks"]]
        except (ValueError, KeyError, TypeError):
            return []
