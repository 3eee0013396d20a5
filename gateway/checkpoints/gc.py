"""Garbage collection: retention, then mark and sweep of a backend's chunks, safe
against the saves running meanwhile by the barrier protocol (:mod:`.barrier`)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any, Final

from chunkd.errors import CheckpointNotFoundError
from chunkd.gateway.checkpoints.barrier import Barrier, intent_chunks, remove_barrier
from chunkd.gateway.checkpoints.catalog import Catalog
from chunkd.gateway.checkpoints.jobs import Jobs, each
from chunkd.gateway.checkpoints.model import (
    CHECKPOINTS,
    CHUNKS,
    PART_RE,
    is_manifest,
    manifest_key,
)
from chunkd.gateway.names import split_name

if TYPE_CHECKING:
    from chunkd.gateway.backends import Backend, ObjectMeta

__all__ = ["Collector"]

log = logging.getLogger(__name__)

_DELETES_AT_ONCE: Final = 16

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
    """

    def __init__(self, catalog: Catalog, jobs: Jobs, roots: Roots | None = None) -> None:
        self.catalog = catalog
        self.jobs = jobs
        self.roots = roots

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
        the collection ends, a cancel included. Every listing is the backend's own,
        one batch at a time; only the set of referenced chunks is held whole.
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
        live, stale = await self._mark(backend, retired, stale_before=now - pending_ttl)
        if self.roots is not None:
            # Roots written after this listing were preceded by their intents (read
            # below, after the barrier), as a save's part is.
            rooted = 0
            async with contextlib.aclosing(self.roots(backend)) as ids:
                async for cid in ids:
                    live.add(cid)
                    rooted += 1
            report["root_chunks"] = rooted
        report["stale_parts"] = len(stale)
        if not dry_run:
            await each(stale, backend.delete)
        try:
            if barrier is not None:
                await barrier.write()  # before the intents are read: the protocol's pivot
            expire = None if dry_run else intent_ttl
            live |= await intent_chunks(backend, expire_after=expire, barrier=barrier)
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
        return report

    async def _mark(
        self, backend: Backend, retired: set[str], *, stale_before: float
    ) -> tuple[set[str], list[str]]:
        """The chunks the checkpoints name, and the parts of saves never committed.

        One pass over ``checkpoints/`` in key order: a checkpoint's manifest
        (``.../manifest.json``) comes before its parts (``.../parts/...``), so each
        part is known as committed or not when it is reached. Parts no manifest names
        are a save in flight (their chunks are marked) or, last written before
        ``stale_before``, an abandoned one (returned, to be deleted).
        """
        live: set[str] = set()
        committed: set[str] = set()
        old: list[str] = []
        async with contextlib.aclosing(backend.scan(CHECKPOINTS.rstrip("/"))) as batches:
            async for batch in batches:
                manifests = [m for m in batch if is_manifest(m.key)]
                named = await each(
                    [m.key for m in manifests], functools.partial(self._manifest_parts, backend)
                )
                to_read: list[str] = []
                for meta, keys in zip(manifests, named, strict=True):
                    committed.update(keys)
                    if meta.key not in retired:
                        to_read += keys
                for meta in batch:
                    if not PART_RE.search(meta.key) or meta.key in committed:
                        continue
                    if meta.modified < stale_before:
                        old.append(meta.key)
                    else:
                        to_read.append(meta.key)  # a save in flight
                for chunks in await each(to_read, functools.partial(self._part_chunks, backend)):
                    live |= chunks
        return live, [k for k in old if k not in committed]

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
        self, backend: Backend, live: set[str], doomed_before: float, barrier: Barrier | None
    ) -> dict[str, int]:
        """Delete the chunks not in ``live`` written before ``doomed_before`` (none
        without a barrier: a dry run); count what was found."""
        counts = dict.fromkeys(("chunks", "referenced", "kept_young", "swept", "freed_bytes"), 0)
        async with contextlib.aclosing(backend.scan(CHUNKS.rstrip("/"))) as batches:
            async for batch in batches:
                doomed: list[ObjectMeta] = []
                for meta in batch:
                    counts["chunks"] += 1
                    if meta.key[len(CHUNKS) :] in live:
                        counts["referenced"] += 1
                    elif meta.modified >= doomed_before:
                        counts["kept_young"] += 1
                    else:
                        doomed.append(meta)
                for start in range(0, len(doomed), _DELETES_AT_ONCE):
                    group = doomed[start : start + _DELETES_AT_ONCE]
                    if barrier is not None:
                        while not await barrier.clear_to_delete():
                            # The barrier may have looked dead to saves for a while:
                            # one of them may have written its intent and gone on.
                            barrier.rereads += 1
                            live |= await intent_chunks(backend, expire_after=None, barrier=barrier)
                        kept = [m for m in group if m.key[len(CHUNKS) :] in live]
                        counts["referenced"] += len(kept)
                        group = [m for m in group if m.key[len(CHUNKS) :] not in live]
                        with barrier.sending():
                            await each([m.key for m in group], backend.delete)
                    counts["swept"] += len(group)
                    counts["freed_bytes"] += sum(m.size for m in group)
                if barrier is not None:
                    await barrier.keep_fresh()
        return counts

    async def _part_chunks(self, backend: Backend, key: str) -> set[str]:
        """The chunk ids a part names (none if it is gone or unreadable)."""
        raw = await backend.get(key)
        if raw is None:
            return set()
        try:
            part = json.loads(bytes(raw))
            return {str(c) for seg in part["segments"] for c, _ in seg["chunks"]}
        except (ValueError, KeyError, TypeError):
            return set()
