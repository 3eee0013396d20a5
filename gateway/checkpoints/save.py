"""Saving: a rank's staged part through the commit protocol, to its manifest.

A rank's save arrives on the local socket as two sealed memfds: a layout (JSON:
segments and the state tree, see :mod:`chunkd.client.checkpoint`) and the staged
bytes. From then on the trainer may die; the daemon finishes the job.

Commit protocol (one save job per rank; ``docs/checkpoints.md`` has the format)::

    1. staged   the sealed memfd is held by the daemon          -> level "staged"
    2. chunk    each segment is cut into chunk_bytes pieces and hashed (blake3, threads)
    3. local    every chunk is written (fsynced) to the disk tier and pinned there;
                then the job's journal is fsynced under <cache>/checkpoints/jobs/
                                                                -> level "local"
    3b. replicas with [peers] and K = replicas > 0, in the background beside
                steps 4-9: each chunk pushed to K peers in other failure domains
                (chunkd.gateway.peers.replicas, docs/replicas.md); once every chunk
                went out (to K peers, or as many as would)     -> level "replicated"
                (K = 0: never said; a wait for it ends at "local"; "remote" includes it)
    4. intent   intents/<save_id>.<rank>.json names every chunk id, so that a
                concurrent `chunkd gc` keeps them (it stays a day)
    5. barrier  list gc/: wait until every collection whose barrier is there is over
    6. upload   per chunk: HEAD chunks/<id>; PUT it (if absent) only when missing; one
                there of the wrong size, or read damaged on this node before, is
                read back and replaced when its bytes do not match (chunkstore.py)
    7. part     checkpoints/<PATH>/parts/<save_id>/<rank>.json
    8. commit   the coordinator (rank 0) waits for every part, then writes
                checkpoints/<PATH>/manifest.json (if absent, unless overwrite):
                the checkpoint exists from this one PUT on   -> level "remote"
    9. cleanup  the journal is deleted, the pins dropped

Garbage collection writes its barrier gc/<run>.json before it reads the intents and
removes it after its last delete; with steps 4 and 5 that order makes a collection
and a save that deduplicates against an unreferenced chunk safe by protocol
(docs/checkpoints.md has the argument; :mod:`.barrier` the collection's side).

A manifest is never written before every chunk it names is in the backend, so a
reader never sees a partial checkpoint; a missing or unparsable manifest means "no
such checkpoint". A job whose journal exists is resumed when the daemon starts
(kill -9 included) from its chunks on disk, or from the backend's copies of those
that are gone from disk (uploaded before the kill); one with a chunk in neither place
fails and never appears. A backend that is down delays a job (it retries with
backoff); one that refuses it (403, read-only, name taken) fails it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import mmap
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Final, TypeVar

import blake3

from chunkd import faults
from chunkd.cache import BytesLease, Chunk, ChunkCache, ChunkId, ChunkLease
from chunkd.cache.singleflight import SingleFlight
from chunkd.canonical import canonical, escaped
from chunkd.errors import (
    BackendUnavailableError,
    CheckpointError,
    CheckpointExistsError,
    ChunkdError,
    InvalidRequestError,
)
from chunkd.gateway.checkpoints.barrier import await_collections
from chunkd.gateway.checkpoints.commit import Committer
from chunkd.gateway.checkpoints.jobs import Jobs, backend_fault, polling, retrying
from chunkd.gateway.checkpoints.journal import Journal, syncfs
from chunkd.gateway.checkpoints.model import (
    Durability,
    SaveJob,
    SaveRequest,
)
from chunkd.gateway.chunkstore import put_chunk
from chunkd.gateway.costs import charge

if TYPE_CHECKING:
    from chunkd.gateway.backends import Backend, Backends
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.peers.replicas import Replicas

__all__ = ["Saver"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_UPLOADS_IN_FLIGHT: Final = 8
_STAGE_IN_FLIGHT: Final = 6  # chunks hashed or written at once per save
#: seconds the level remote waits for a part's replica pushes (they go on after)
_PUSH_WAIT: Final = 30.0
#: recent saves whose seq this node remembers (for their ranks' later parts)
_SEQS_KEPT: Final = 256


class Saver:
    """Save jobs from their staged bytes to their commit, resumed from the journal.

    Args:
        cache: the daemon's cache (chunks go to its disk tier, pinned there:
            :meth:`ChunkCache.put_pinned`).
        backends: the configured backends.
        metrics: the daemon's metrics.
        journal: the jobs' journal.
        jobs: the jobs this daemon knows (shared with the waits, loads and listings).
        committer: writes the manifest (rank 0) or waits for it (the other ranks).
        poll_interval: the longest pause between two looks for the barriers.
        replicas: replication to peers' RAM (``docs/replicas.md``); None: no peers.
    """

    def __init__(
        self,
        cache: ChunkCache,
        backends: Backends,
        metrics: Metrics,
        journal: Journal,
        jobs: Jobs,
        committer: Committer,
        *,
        poll_interval: float,
        replicas: Replicas | None = None,
    ) -> None:
        self.replicas = replicas
        self.cache = cache
        self.backends = backends
        self.metrics = metrics
        self.journal = journal
        self.jobs = jobs
        self.committer = committer
        self.poll_interval = poll_interval
        self._uploads: SingleFlight[tuple[str, ChunkId], bool] = SingleFlight()
        self._upload_slots = asyncio.Semaphore(_UPLOADS_IN_FLIGHT)
        # The seq of each recent save on this node (its ranks' parts share it), and
        # the largest given or journaled (a new save's is larger, whatever the clock).
        self._seqs: OrderedDict[str, int] = OrderedDict()
        self._last_seq = 0
        # commit="none": one look for a save's manifest per save on this node, shared
        # by its ranks' parts; and the largest seq of a save of this node noted
        # committed (an older save's look ends: its note would let nothing go).
        self._commit_looks: dict[tuple[str, str, str], asyncio.Future[bool]] = {}
        self._committed_seq = 0

    async def resume(self) -> int:
        """Resume every journaled job; returns how many."""
        resumed = 0
        for path in self.journal.saved():
            try:
                job = self.journal.load(path)
            except (OSError, ValueError, KeyError, TypeError, ChunkdError) as exc:
                log.error("checkpoint journal %s is unreadable (%s); set aside", path, exc)  # noqa: TRY400
                self.journal.set_aside(
                    path,
                    CheckpointError(
                        f"the journal of save job {path.stem} was unreadable when the daemon "
                        f"started again ({exc}); the save was not resumed: save again"
                    ),
                )
                continue
            request = job.request
            self._remember_seq(request.save_id, request.seq)
            missing = [cid for cid in job.unique if not self.cache.on_disk(cid)]
            if missing:  # files a crash left without their records are adopted first
                await self.cache.wait_reconciled()
                missing = [cid for cid in missing if not self.cache.on_disk(cid)]
            if missing:
                # Not lost yet: a job killed after its uploads (its part or manifest PUT
                # failing) has every chunk in the backend, and the upload step keeps
                # one found there of the right size without reading it (put_chunk).
                # One that is nowhere fails the job then, with what is missing.
                log.warning(
                    "checkpoint %s (rank %d): %d of its chunks are gone from the disk tier; "
                    "resuming with the backend's copies (it fails if one is not there)",
                    request.name,
                    request.rank,
                    len(missing),
                )
            job.pinned = set(job.unique)
            self.cache.pin(job.pinned)
            # A part whose chunks are gone from the disk tier is not local any more:
            # a waiter for local waits for the backend's copies (remote) or the job's
            # failure, never a level the node no longer holds.
            job.reach(Durability.STAGED if missing else Durability.LOCAL, "resuming")
            self.jobs.add(job)
            self._replicate(job)
            self.jobs.spawn(self._guarded(job, self._finish(job)))
            resumed += 1
            log.info("resuming checkpoint %s (rank %d)", request.name, request.rank)
        return resumed

    # -- saving ---------------------------------------------------------------------

    async def save(self, request: SaveRequest, data: mmap.mmap, size: int) -> SaveJob:
        """Take one rank's staged part; the job goes on in the background.

        Checked before anything is accepted: the backend exists and is writable,
        the segments lie inside the staged bytes, and the name is free (or
        ``overwrite``). The name check is a HEAD, so refused credentials fail here.

        Raises:
            UnknownBackendError, ReadOnlyBackendError, BackendForbiddenError,
            CheckpointExistsError, CheckpointError, AccessDeniedError (``overwrite`` of
            another user's checkpoint), InvalidRequestError (segments out of bounds, or
            a name or tree that canonical JSON cannot hold)
        """
        backend = self.backends.get(request.backend)
        backend.check_writable()
        for offset, length in request.segments:
            if offset < 0 or length < 0 or offset + length > size:
                raise InvalidRequestError(
                    f"segment ({offset}, {length}) lies outside the {size} staged bytes"
                )
        # Segments may not name more bytes than were staged (overlapping ones could
        # make one request hash the same bytes a million times).
        if sum(length for _, length in request.segments) > size:
            raise InvalidRequestError(
                f"the segments name more bytes than the {size} staged; they may not overlap"
            )
        try:
            # The part and the intent are canonical JSON: what they cannot hold is
            # refused before anything is staged or uploaded, not when the part is put.
            canonical({"name": request.name, "tree": request.tree})
        except ValueError as exc:
            raise InvalidRequestError(
                f"checkpoint {request.name[:200]!r} cannot be saved: its state tree {exc}"
            ) from None
        if not request.overwrite and request.rank == 0:
            if any(
                j.request.name == request.name
                and j.request.save_id != request.save_id
                and j.error is None
                and j.state != "done"
                for j in self.jobs
            ):
                raise CheckpointExistsError(
                    f"checkpoint {request.name} is being saved already; pass overwrite=True "
                    "to replace it"
                )
            if await self._exists_unless_down(backend, request.manifest_key):
                raise CheckpointExistsError(
                    f"checkpoint {request.name} exists; pass overwrite=True to replace it"
                )
        uid = request.uid
        if request.overwrite and request.rank == 0 and not request.admin and uid is not None:
            # Refused before anything is staged; the commit checks again.
            with contextlib.suppress(BackendUnavailableError):
                await self.committer.may_replace(backend, request.manifest_key, uid)
        request = self._placed(request)
        self.jobs.prune()
        faults.point("ckpt.stage")
        job = SaveJob(id=uuid.uuid4().hex, request=request, data=data)
        job.logical = sum(n for _, n in request.segments)
        job.reach(Durability.STAGED, "staged")
        self.jobs.add(job)
        self.metrics.ckpt_saves.labels("started").inc()
        self.jobs.spawn(self._guarded(job, self._run(job)))
        return job

    async def _exists_unless_down(self, backend: Backend, key: str) -> bool:
        """Whether ``key`` exists; False when the backend is down (the commit's
        put-if-absent still refuses to replace a checkpoint then)."""
        try:
            return await self._exists(backend, key)
        except BackendUnavailableError as exc:
            log.warning("cannot check whether %s exists (%s); saving anyway", key, exc)
            return False

    async def _exists(self, backend: Backend, key: str) -> bool:
        return await backend.head(key) is not None

    def _placed(self, request: SaveRequest) -> SaveRequest:
        """``request`` with its replica count resolved (``[peers] replicas`` when it
        names none; 0 without peers) and this node's address as its ``node``."""
        if self.replicas is None:
            return dataclasses.replace(request, replicas=0, node=None)
        wanted = self.replicas.default if request.replicas is None else request.replicas
        return dataclasses.replace(
            request, replicas=wanted, node=self.replicas.address, seq=self._seq(request.save_id)
        )

    def _seq(self, save_id: str) -> int:
        """The seq of save ``save_id`` on this node: the one its first part here got
        (every rank's part of one save shares it, so that a receiver never takes one
        part for a later save than another), else ``max(time_ns(), last seq + 1)``: a
        clock stepped back never makes a save older than one before it."""
        seq = self._seqs.get(save_id)
        if seq is None:
            seq = max(time.time_ns(), self._last_seq + 1)
        self._remember_seq(save_id, seq)
        return seq

    def _remember_seq(self, save_id: str, seq: int) -> None:
        if seq <= 0:  # journaled before saves had one
            return
        self._seqs[save_id] = seq
        self._seqs.move_to_end(save_id)
        while len(self._seqs) > _SEQS_KEPT:
            self._seqs.popitem(last=False)
        self._last_seq = max(self._last_seq, seq)

    async def _run(self, job: SaveJob) -> None:
        await self._stage_to_disk(job)
        self._replicate(job)
        await self._finish(job)

    # -- replicas ---------------------------------------------------------------------

    def _replicate(self, job: SaveJob) -> None:
        """Push the part's chunks to their replica targets in the background (level
        replicated once done); with no replicas asked, a local part is replicated."""
        wanted = job.request.replicas or 0
        if self.replicas is None or wanted <= 0 or not job.unique:
            return  # a wait for replicated ends at local (SaveJob.meets)
        # The push holds its own pins and view of the staged bytes: the upload may
        # finish first and give up the job's (the chunks stay readable until it ends).
        unique = job.unique
        where = dict(job.where)
        view = memoryview(job.data) if job.data is not None else None
        self.cache.pin(unique)
        job.pushing = self.jobs.spawn(self._push(job, self.replicas, wanted, unique, where, view))

    async def _push(
        self,
        job: SaveJob,
        replicas: Replicas,
        wanted: int,
        unique: dict[ChunkId, int],
        where: dict[ChunkId, tuple[int, int]],
        view: memoryview | None,
    ) -> None:
        request = job.request

        async def source(cid: ChunkId) -> ChunkLease:
            if view is not None and cid in where:
                start, size = where[cid]
                return BytesLease(cid, view[start : start + size])
            lease = await self.cache.read_disk(cid)
            if lease is None:
                raise CheckpointError(f"chunk {cid} is gone from this node's disk")
            return lease

        try:
            report = await replicas.push(
                request.backend, request.save_id, unique, source, wanted, seq=request.seq
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a push must never fail the save: it is durable without it
            log.warning("checkpoint %s: its replicas failed (%s)", request.name, exc)
            job.replicas = {"wanted": wanted, "outcome": "none", "error": str(exc)[:200]}
            self.metrics.replica_saves.labels("none").inc()
        else:
            job.replicas = report.describe()
            job.replica_report = report
            if report.outcome != "full":
                log.warning(
                    "checkpoint %s rank %d: %d of %d chunks have %d replicas (fewest %d)",
                    request.name,
                    request.rank,
                    report.whole,
                    report.chunks,
                    wanted,
                    report.fewest,
                )
            if job.committed:  # committed while pushing
                await replicas.committed(request.save_id, report)
        finally:
            self.cache.unpin(unique)
            if view is not None:
                view.release()
        if job.error is None and job.level >= Durability.LOCAL:
            job.reach(Durability.REPLICATED)

    async def _pushes_over(self, job: SaveJob) -> None:
        """Wait for the part's pushes, at most :data:`_PUSH_WAIT` seconds, before the
        level remote: a waiter then has the replicas' report with it. Past that the
        save is remote all the same, and the pushes go on."""
        pushing = job.pushing
        if pushing is None or pushing.done():
            return
        state, job.state = job.state, "replicating"
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(pushing), _PUSH_WAIT)
        job.state = state

    async def _committed(self, job: SaveJob) -> None:
        """Tell the part's replica targets that the save is committed (they may let
        its previous save go), once its pushes are over (else the push tells them).

        With ``commit="none"`` the part is remote before the save is committed (the
        trainer's ``ckpt_commit`` writes the manifest later, or never): the note then
        waits, in the background, until the manifest names this save, at most the
        commit's part timeout; a save never committed never lets the last one go.
        """
        if self.replicas is None or not job.request.replicas:
            return
        if job.request.commit == "none":
            self.jobs.spawn(self._note_when_committed(job))
            return
        job.committed = True
        self._committed_seq = max(self._committed_seq, job.request.seq)
        report = job.replica_report
        if report is not None:
            await self.replicas.committed(job.request.save_id, report)

    async def _note_when_committed(self, job: SaveJob) -> None:
        """Send ``job``'s note ``remote`` once its save's manifest names it (see
        :meth:`_look_for_commit`: one look per save on this node, its parts share it)."""
        request = job.request
        key = (request.backend, request.manifest_key, request.save_id)
        look = self._commit_looks.get(key)
        if look is None:
            look = self._commit_looks[key] = self.jobs.spawn(self._look_for_commit(request))
            look.add_done_callback(lambda _: self._commit_looks.pop(key, None))
        if not await asyncio.shield(look):
            return
        job.committed = True
        self._committed_seq = max(self._committed_seq, request.seq)
        report = job.replica_report
        if report is not None and self.replicas is not None:
            await self.replicas.committed(request.save_id, report)

    async def _look_for_commit(self, request: SaveRequest) -> bool:
        """Whether the manifest of ``request``'s checkpoint comes to name its save
        within the commit's part timeout. A HEAD every ``poll_interval`` at most; the
        manifest is read (and parsed off the event loop) only when its version
        changed; the look ends as soon as a later save of this node is committed
        (this one's note would let nothing go)."""
        backend = self.backends.get(request.backend)
        deadline = time.monotonic() + self.committer.part_timeout
        pauses = polling(self.committer.poll_interval).delays()
        seen: str | None = None
        while time.monotonic() < deadline:
            if self._committed_seq > request.seq:
                log.debug("checkpoint %s: a later save is committed; not looking", request.name)
                return False
            try:
                meta = await backend.head(request.manifest_key)
                if meta is not None and meta.version != seen:
                    raw = await backend.get(request.manifest_key)
                    named = None if raw is None else await asyncio.to_thread(_save_of, raw)
                    seen = meta.version
                    if named == request.save_id:
                        return True
            except (ChunkdError, OSError) as exc:
                log.debug("checkpoint %s: its manifest not read (%s)", request.name, exc)
            await asyncio.sleep(next(pauses))
        log.info(
            "checkpoint %s: not committed within %gs; its replicas stay as a save never "
            "committed (the saver's last committed save keeps its own)",
            request.name,
            self.committer.part_timeout,
        )
        return False

    async def _guarded(self, job: SaveJob, work: Awaitable[None]) -> None:
        """Run a job's steps; any failure fails the job (a cancel leaves it journaled)."""
        try:
            await work
        except asyncio.CancelledError:
            raise
        except ChunkdError as exc:
            await self._failed(job, exc)
        except Exception as exc:
            log.exception("checkpoint %s failed", job.request.name)
            await self._failed(
                job, CheckpointError(f"checkpoint {job.request.name} failed: {exc!r}")
            )

    async def _failed(self, job: SaveJob, exc: ChunkdError) -> None:
        log.warning("checkpoint %s (rank %d) failed: %s", job.request.name, job.request.rank, exc)
        self.metrics.ckpt_saves.labels("failed").inc()
        self._release(job)
        self._unpin(job)
        try:
            # Recorded before any waiter is told: a client told of the failure that
            # asks again after a restart finds the same failure, not an unknown save.
            await asyncio.to_thread(self.journal.set_aside, self.journal.path(job), exc)
        finally:
            job.fail(exc)

    async def _stage_to_disk(self, job: SaveJob) -> None:
        """Hash every chunk and write it to the disk tier; journal the job (level local).

        Each chunk is hashed and then written by one task, a few at a time, so that
        the disk is busy while later chunks are still being hashed.
        """
        assert job.data is not None
        data = memoryview(job.data)
        chunk_bytes = self.cache.config.chunk_bytes
        pieces = [
            [
                data[start : min(start + chunk_bytes, offset + length)]
                for start in range(offset, offset + length, chunk_bytes)
            ]
            for offset, length in job.request.segments
        ]
        job.state = "writing"
        slots = asyncio.Semaphore(_STAGE_IN_FLIGHT)

        async def store(piece: memoryview) -> tuple[ChunkId, bool]:
            async with slots:
                cid = await asyncio.to_thread(ChunkId.of, piece, threads=1)
                first = cid not in job.pinned  # one pin per chunk id, released by _unpin
                job.pinned.add(cid)
                # No fsync per file: _make_durable syncs the filesystem once at the end.
                # No zstd: it cost 15-25% of the write time and saved about 10%.
                # Direct: the sealed pages go to the device without a copy into the page
                # cache (0.85 s against 2.84 s for 1.25 GiB on the development VM); a load
                # soon after reads them from the disk, not from cached pages.
                chunk = Chunk.trusted(cid, piece)
                return cid, await self.cache.put_pinned(
                    chunk, pin=first, sync=False, compress=False, direct=True
                )

        started = time.perf_counter()
        stored = await asyncio.gather(*(store(p) for seg in pieces for p in seg))
        written = time.perf_counter()
        ids = iter(cid for cid, _ in stored)
        job.chunks = [[(next(ids), p.nbytes) for p in seg] for seg in pieces]
        for (offset, _), seg in zip(job.request.segments, job.chunks, strict=True):
            for i, (cid, size) in enumerate(seg):
                job.where.setdefault(cid, (offset + i * chunk_bytes, size))
        declined = sum(1 for _, kept in stored if not kept)
        del data, pieces, stored
        failed: OSError | None = None
        if not declined:
            try:
                await asyncio.to_thread(self._make_durable)
                # A put that found its chunk present may have raced an eviction that
                # chose it before the pin landed: count what the index holds now.
                declined = sum(1 for cid in job.unique if not self.cache.on_disk(cid))
                if not declined:
                    await asyncio.to_thread(self.journal.write, job)
            except OSError as exc:  # the disk failed the sync or the journal
                failed = exc
                with contextlib.suppress(OSError):
                    self.journal.remove(job)  # a journal that is not known whole: none
        if failed is not None:
            log.warning(
                "checkpoint %s: it could not be made durable on this node's disk (%s); "
                "it is durable once it is in the backend",
                job.request.name,
                failed,
            )
            job.state = "uploading"
        elif not declined:
            log.info(
                "checkpoint %s rank %d is local: %d bytes hashed and written in %.2fs, "
                "synced in %.2fs",
                job.request.name,
                job.request.rank,
                job.logical,
                written - started,
                time.perf_counter() - written,
            )
            # The staged bytes stay for the upload (no disk read, no second hash);
            # a job that has to wait for its backend gives them up (see retrying).
            job.reach(Durability.LOCAL, "uploading")
        else:
            log.warning(
                "checkpoint %s: the disk tier declined %d chunks (full or degraded); "
                "it is durable once it is in the backend",
                job.request.name,
                declined,
            )
            job.state = "uploading"

    def _release(self, job: SaveJob) -> None:
        """Give up the job's staged bytes off the event loop: unmapping a big memfd and
        freeing its pages (the last reference to them) took 0.33-0.48 s for 1.25 GiB on
        the development VM, a stall of every request the daemon serves meanwhile."""
        data, job.data = job.data, None
        if data is not None:
            self.jobs.spawn(asyncio.to_thread(_close_quietly, data))

    def _unpin(self, job: SaveJob) -> None:
        pinned, job.pinned = job.pinned, set()
        self.cache.unpin(pinned)

    def _make_durable(self) -> None:
        """Commit the index and get every chunk file (written without fsync) and its
        name to the disk with one syncfs, whatever the cache's own fsync policy
        (cached copies can be fetched again; these cannot)."""
        self.cache.commit_index()
        faults.point("ckpt.sync")
        syncfs(self.journal.root)

    async def _finish(self, job: SaveJob) -> None:
        """Steps 4 to 9 of the commit protocol; backend outages are waited out."""
        request = job.request
        backend = self.backends.get(request.backend)
        unique = job.unique
        intent = {"save_id": request.save_id, "name": request.name, "created": time.time()}
        intent["chunks"] = [str(cid) for cid in unique]

        async def put_intent() -> bool:
            backend_fault("ckpt.intent")
            return await backend.put(request.intent_key, _document(job, intent))

        await retrying(job, put_intent)
        # No dedup decision (the HEADs of _send_chunk) before every collection that
        # may have missed this intent is over: see _await_collections.
        await self._await_collections(job, backend)
        job.state = "uploading"
        job.unique_bytes = sum(unique.values())
        job.remote_bytes = 0

        async def upload(cid: ChunkId) -> bool:
            sent = await retrying(
                job, functools.partial(self._upload, job, backend, cid, unique[cid])
            )
            job.remote_bytes += unique[cid]  # in the backend now, sent or found there
            return sent

        uploaded = await asyncio.gather(*(upload(c) for c in unique))
        sizes = unique.values()
        job.new = sum(size for size, sent in zip(sizes, uploaded, strict=True) if sent)
        self.metrics.ckpt_bytes.labels("logical").inc(job.logical)
        self.metrics.ckpt_bytes.labels("new").inc(job.new)
        part = _document(job, job.part_doc())

        # If absent: a job resumed after its part went in must not change it (the
        # manifest may already name its hash).
        async def put_part() -> bool:
            backend_fault("ckpt.part")
            return await backend.put(request.part_key, part, if_absent=True)

        if not await retrying(job, put_part):
            # There already: this job's own, put before a restart, or another user's
            # planted under this save's id (refused: its tensors would be loaded as ours).
            await self.committer.check_own_part(backend, request)
        if request.commit == "auto" and request.rank == 0:
            await self.committer.write_manifest(
                job, backend, request.world_size, request.overwrite, {}
            )
        elif request.commit == "auto":
            job.state = "waiting for the commit"
            await self.committer.await_commit(job, backend)
        else:
            job.manifest_id = blake3.blake3(part).hexdigest()
        # The intent stays: a collection that began before this save listed the
        # manifests without this one, and reads the intents after its barrier is up.
        # `chunkd gc` deletes intents older than a day.
        self._unpin(job)
        try:
            await asyncio.to_thread(self.journal.remove, job)
        except OSError as exc:  # committed all the same; a restart finds it so and drops it
            log.warning("checkpoint %s: its journal could not be removed (%s)", request.name, exc)
        self._release(job)
        await self._pushes_over(job)
        job.finished = time.time()
        job.reach(Durability.REMOTE, "done")
        await self._committed(job)
        self.metrics.ckpt_saves.labels("committed").inc()
        log.info(
            "checkpoint %s rank %d committed: %d bytes, %d new",
            request.name,
            request.rank,
            job.logical,
            job.new,
        )

    async def _await_collections(self, job: SaveJob, backend: Backend) -> None:
        """Step 5: wait until every garbage collection whose barrier is up now is over
        (:func:`.barrier.await_collections`, after the intent, before any HEAD)."""
        state = job.state

        def waiting(count: int) -> None:
            self.metrics.gc_barrier_waits.inc()
            job.state = f"waiting for {count} garbage collection(s) to finish"

        await await_collections(
            backend,
            poll_interval=self.poll_interval,
            attempt=functools.partial(retrying, job),
            what=f"checkpoint {job.request.name}",
            on_wait=waiting,
        )
        job.state = state

    async def _upload(self, job: SaveJob, backend: Backend, cid: ChunkId, size: int) -> bool:
        """Put chunk ``cid`` (``size`` bytes) in the backend unless it is there, or
        repair it (:func:`~chunkd.gateway.chunkstore.put_chunk`); True if this job sent it."""
        key = (backend.name, cid)
        if self._uploads.join(key) is not None:
            await self._uploads.run(key, _never)  # another job sends it: a dedup
            return False
        return await self._uploads.run(key, lambda: self._send_chunk(job, backend, cid, size))

    async def _send_chunk(self, job: SaveJob, backend: Backend, cid: ChunkId, size: int) -> bool:
        async with self._upload_slots:
            sent = await put_chunk(
                backend,
                cid,
                size,
                lambda: self._source(job, cid),
                self.backends.damaged,
                before_put=lambda: backend_fault("ckpt.upload"),
            )
        if sent:
            charge.written("checkpoint", size, backend.name)  # the save's job (its context)
        return sent

    async def _source(self, job: SaveJob, cid: ChunkId) -> ChunkLease:
        """The bytes of ``cid``: from the staged memfd while the job holds it, else
        from the disk tier (verified there, and not promoted into RAM)."""
        if job.data is not None and cid in job.where:
            start, size = job.where[cid]
            return BytesLease(cid, memoryview(job.data)[start : start + size])
        lease = await self.cache.read_disk(cid)  # no reader's lookup
        if lease is None:
            raise CheckpointError(
                f"checkpoint {job.request.name}: chunk {cid} is no longer on this node's disk, "
                f"and backend {job.request.backend!r} does not hold it whole; the save cannot "
                "complete: save again"
            )
        return lease


def _save_of(raw: memoryview) -> object:
    """The ``save_id`` a manifest's bytes name (None: unreadable, or none)."""
    try:
        doc = json.loads(bytes(raw))
    except ValueError:
        return None
    return doc.get("save_id") if isinstance(doc, dict) else None


def _close_quietly(data: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view still in use: unmapped with the last one
        data.close()


async def _never() -> bool:  # pragma: no cover - only run() on a key already running
    raise AssertionError("unreachable")


def _document(job: SaveJob, doc: dict[str, Any]) -> bytes:
    """The bytes of ``job``'s part or intent: canonical JSON, or, for a save an older
    daemon accepted and journaled with a string UTF-8 cannot hold (a new one is refused
    before it is staged), the form that daemon wrote (:func:`chunkd.canonical.escaped`).
    Readers verify the bytes they fetch, so either reads back."""
    try:
        return canonical(doc)
    except ValueError as exc:
        log.warning("checkpoint %s: written with ASCII escapes: %s", job.request.name, exc)
        return escaped(doc)
