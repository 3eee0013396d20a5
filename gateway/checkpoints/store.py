"""The daemon's checkpoint store: one object that composes the rooms of the package
(saving, committing, waiting, loading, the catalog, garbage collection) over the
state they share, the jobs this daemon knows."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import mmap
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkd.cache import ChunkCache, ChunkId, ChunkLease
from chunkd.errors import AccessDeniedError
from chunkd.gateway.authority import Authority, Caller
from chunkd.gateway.checkpoints.catalog import Catalog
from chunkd.gateway.checkpoints.commit import Committer
from chunkd.gateway.checkpoints.gc import Collector, Roots
from chunkd.gateway.checkpoints.jobs import Jobs
from chunkd.gateway.checkpoints.journal import Journal
from chunkd.gateway.checkpoints.model import Durability, SaveJob, SaveRequest
from chunkd.gateway.checkpoints.restore import Restorer
from chunkd.gateway.checkpoints.save import Saver
from chunkd.gateway.checkpoints.scrub import ScrubPage, scrub
from chunkd.gateway.checkpoints.wait import Waiter

if TYPE_CHECKING:
    from chunkd.gateway.backends import Backends
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.peers import Peers
    from chunkd.gateway.peers.replicas import Replicas

__all__ = ["Checkpoints"]


class Checkpoints:
    """The daemon's checkpoint store: save jobs, commits, loads, listing and GC.

    Args:
        cache: the daemon's cache (chunks go to its disk tier, loads come from it).
        backends: the configured backends.
        metrics: the daemon's metrics.
        root: where journals live (``<cache dir>/checkpoints``).
        part_timeout: seconds a coordinator waits for the other ranks' parts.
        poll_interval: the longest pause between two looks for parts or a manifest.
        peers: the cluster, when chunks are shared between nodes: a load asks each
            chunk's owner before it reads the backend.
        gc_roots: the chunk ids other stores keep in a backend (the dataset registry's
            frozen snapshots), which garbage collection marks live.
        authority: who may replace and delete what (docs/security.md); the methods
            that take a ``caller`` check it (None: a request of the daemon's own).
        held: the chunk ids the caller pinned on the cache's disk tier for the
            journaled jobs as soon as the cache opened (:meth:`journaled_chunks`);
            :meth:`start` unpins them once every job resumed and pinned its own.
        replicas: copies of this node's saves in peers' RAM, and theirs here
            (``docs/replicas.md``); None: no peers.
    """

    def __init__(
        self,
        cache: ChunkCache,
        backends: Backends,
        metrics: Metrics,
        root: Path,
        *,
        part_timeout: float = 3600.0,
        poll_interval: float = 2.0,
        peers: Peers | None = None,
        gc_roots: Roots | None = None,
        authority: Authority | None = None,
        held: Iterable[ChunkId] = (),
        replicas: Replicas | None = None,
    ) -> None:
        self.replicas = replicas
        self._held = frozenset(held)
        self.authority = authority if authority is not None else Authority()
        self.cache = cache
        self.backends = backends
        self.metrics = metrics
        self.root = Path(root)
        self._jobs = Jobs()
        self._journal = Journal(self.root)
        self._committer = Committer(
            backends, part_timeout=part_timeout, poll_interval=poll_interval
        )
        self._saver = Saver(
            cache,
            backends,
            metrics,
            self._journal,
            self._jobs,
            self._committer,
            poll_interval=poll_interval,
            replicas=replicas,
        )
        self._waiter = Waiter(
            backends,
            self._journal,
            self._jobs,
            part_timeout=part_timeout,
            poll_interval=poll_interval,
        )
        self._restorer = Restorer(cache, backends, metrics, self._jobs, peers)
        self._catalog = Catalog(backends, self._jobs)
        # The ids a collection marks go to the cache dir's disk (never a tmpfs /tmp).
        self._collector = Collector(
            self._catalog, self._jobs, gc_roots, mark_dir=self.root / "gc-mark"
        )

    @staticmethod
    async def journaled_chunks(root: Path) -> frozenset[ChunkId]:
        """Every chunk the save jobs journaled under ``root`` name.

        A daemon reads them before it opens its cache and pins them on the disk tier
        at once after (before its first await): the background reconciliation the
        open starts evicts down to the budget (a kill -9 leaves files whose records
        were still batched, adopted then), oldest first, and a journaled job's
        chunks, written before everything the node read since, would go first,
        before the job resumes and pins them. Pass them to the store as ``held``.
        """
        return frozenset(await asyncio.to_thread(Journal(root).chunks))

    async def start(self) -> int:
        """Resume every journaled job; returns how many."""
        try:
            await asyncio.to_thread(self._journal.make_dirs)
            # What collections cut short (kill -9) left of their marks: none runs yet.
            await asyncio.to_thread(shutil.rmtree, self._collector.mark_dir, True)
            return await self._saver.resume()
        finally:
            # Each resumed job pins its own chunks; those of a job set aside go free.
            held, self._held = self._held, frozenset()
            self.cache.unpin(held)

    async def close(self) -> None:
        """Stop every job (journaled ones resume on the next start)."""
        await self._jobs.close()

    async def save(
        self, request: SaveRequest, data: mmap.mmap, size: int, *, caller: Caller | None = None
    ) -> SaveJob:
        """Take one rank's staged part (:meth:`.Saver.save`); the job goes on in the
        background, owned by ``caller`` (who may replace only their own checkpoints)."""
        if caller is not None:
            request = dataclasses.replace(
                request, uid=caller.uid, admin=self.authority.is_admin(caller)
            )
        return await self._saver.save(request, data, size)

    async def commit(
        self,
        name: str,
        save_id: str,
        world_size: int,
        overwrite: bool,
        extra: dict[str, Any],
        *,
        caller: Caller | None = None,
    ) -> str:
        """Commit a save made with ``commit="none"`` (:meth:`.Committer.commit`), owned
        by ``caller``."""
        return await self._committer.commit(
            name,
            save_id,
            world_size,
            overwrite,
            extra,
            owner=None if caller is None else caller.uid,
            admin=caller is None or self.authority.is_admin(caller),
        )

    async def wait(
        self,
        job_id: str,
        level: Durability,
        seconds: float,
        *,
        asked: SaveRequest | None = None,
    ) -> SaveJob:
        """Wait up to ``seconds`` for a job to reach ``level`` or fail (:meth:`.Waiter.wait`)."""
        return await self._waiter.wait(job_id, level, seconds, asked=asked)

    async def manifest(self, name: str) -> dict[str, Any]:
        """The committed manifest of ``name``, parts inlined (:meth:`.Restorer.manifest`)."""
        return await self._restorer.manifest(name)

    async def chunk(
        self,
        backend_name: str,
        cid: ChunkId,
        *,
        local: bool = False,
        part: tuple[str, str, int] | None = None,
    ) -> ChunkLease:
        """Lease checkpoint chunk ``cid``, verified (:meth:`.Restorer.chunk`).

        ``part``: (save id, saving node, replicas) of the part the chunk belongs to
        (its document's ``save_id``, ``node`` and ``replicas``): that part's replica
        targets are asked first (``docs/replicas.md``).
        """
        return await self._restorer.chunk(
            backend_name, cid, local=local, replicas=self.replica_sources(part)
        )

    def replica_sources(self, part: tuple[str, str, int] | None) -> tuple[str, ...]:
        """The members a restore of ``part`` (save id, node, replicas) asks first."""
        if part is None or self.replicas is None:
            return ()
        save_id, node, wanted = part
        return tuple(self.replicas.sources(save_id, node, wanted))

    async def entries_page(
        self,
        prefix: str,
        *,
        start_after: str | None = None,
        limit: int = 1000,
        max_bytes: int = 1 << 20,
    ) -> tuple[list[dict[str, Any]], str | None]:
        """One page of the checkpoints under a prefix (:meth:`.Catalog.entries_page`)."""
        return await self._catalog.entries_page(
            prefix, start_after=start_after, limit=limit, max_bytes=max_bytes
        )

    async def entries(self, prefix: str) -> list[dict[str, Any]]:
        """Every checkpoint under ``BACKEND[/PREFIX]`` (:meth:`.Catalog.entries`)."""
        return await self._catalog.entries(prefix)

    async def delete(
        self, name: str, *, save_id: str | None = None, caller: Caller | None = None
    ) -> int:
        """Delete checkpoint ``name``; its chunks stay for gc (:meth:`.Catalog.delete`).

        Raises:
            AccessDeniedError: ``caller`` is neither its owner nor an admin.
        """
        return await self._catalog.delete(
            name, save_id=save_id, may_delete=self._owner_check(caller, "delete")
        )

    def _owner_check(
        self, caller: Caller | None, action: str
    ) -> Callable[[dict[str, Any]], None] | None:
        """What refuses ``caller`` ``action`` on a checkpoint (by its manifest or
        listing entry) unless they own it or are an admin; None: no check."""
        if caller is None:
            return None
        authority = self.authority

        def check(doc: dict[str, Any]) -> None:
            what = f"checkpoint {doc.get('name', '(torn)')}"
            authority.require_owner(caller, doc.get("owner"), what, action)

        return check

    def _may_retire(self, caller: Caller, entry: dict[str, Any]) -> bool:
        """Whether ``caller`` may retire the checkpoint of listing ``entry``."""
        try:
            self.authority.require_owner(caller, entry.get("owner"), "", "retire")
        except AccessDeniedError:
            return False
        return True

    async def scrub(
        self,
        backend_name: str,
        *,
        start_after: str | None,
        limit: int,
        remove: bool,
        caller: Caller | None = None,
    ) -> ScrubPage:
        """Check one page of a backend's chunk store against the chunks' names
        (:func:`chunkd.gateway.checkpoints.scrub.scrub`); only an admin may ``remove``.

        Raises:
            UnknownBackendError, ReadOnlyBackendError (``remove``), AccessDeniedError,
            CheckpointError (``remove``: a barrier could not be written or a collection
            did not end in time)
        """
        backend = self.backends.get(backend_name)
        if remove:
            if caller is not None:
                self.authority.require_admin(caller, f"remove chunks from {backend_name}")
            backend.check_writable()
        return await scrub(
            backend,
            self.backends.damaged,
            start_after=start_after,
            limit=limit,
            remove=remove,
            spawn=self._jobs.spawn,
        )

    async def gc(
        self,
        target: str,
        *,
        keep_last: int | None,
        grace: float,
        dry_run: bool,
        pending_ttl: float = 7 * 86400,
        intent_ttl: float = 86400,
        caller: Caller | None = None,
    ) -> dict[str, Any]:
        """Retention, then mark and sweep of the chunks (:meth:`.Collector.gc`).
        Retention counts and retires only checkpoints ``caller`` may delete (theirs,
        or every one for an admin); others' are kept (``others_kept`` in the report)."""
        return await self._collector.gc(
            target,
            keep_last=keep_last,
            grace=grace,
            dry_run=dry_run,
            pending_ttl=pending_ttl,
            intent_ttl=intent_ttl,
            may_retire=None if caller is None else functools.partial(self._may_retire, caller),
        )

    def stats(self) -> dict[str, Any]:
        """Jobs in flight, for /v1/stats."""
        return {
            "jobs": [j.describe() for j in self._jobs if j.state != "done"],
            "pinned_chunks": self.cache.pinned,
        }
