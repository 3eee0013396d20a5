"""The write path: checkpoints saved through the daemon, committed atomically.

A rank's save arrives on the local socket as two sealed memfds: a layout (JSON:
segments and the state tree, see :mod:`chunkd.client.checkpoint`) and the staged
bytes. From then on the trainer may die; the daemon finishes the job.

Commit protocol (one save job per rank; ``docs/checkpoints.md`` has the format)::

    1. staged   the sealed memfd is held by the daemon          -> level "staged"
    2. chunk    each segment is cut into chunk_bytes pieces and hashed (blake3, threads)
    3. local    every chunk is written (fsynced) to the disk tier and pinned there;
                then the job's journal is fsynced under <cache>/checkpoints/jobs/
                                                                -> level "local"
    4. intent   intents/<save_id>.<rank>.json names every chunk id, so that a
                concurrent `chunkd gc` keeps them
    5. upload   per chunk: HEAD chunks/<id>; PUT it (if absent) only when missing
    6. part     checkpoints/<PATH>/parts/<save_id>/<rank>.json
    7. commit   the coordinator (rank 0) waits for every part, then writes
                checkpoints/<PATH>/manifest.json (if absent, unless overwrite):
                the checkpoint exists from this one PUT on   -> level "remote"
    8. cleanup  the intent and the journal are deleted, the pins dropped

A manifest is never written before every chunk it names is in the backend, so a
reader never sees a partial checkpoint; a missing or unparsable manifest means "no
such checkpoint". A job whose journal exists is resumed when the daemon starts
(kill -9 included) from its chunks on disk; one whose chunks are gone from disk
fails and never appears. A backend that is down delays a job (it retries with
backoff); one that refuses it (403, read-only, name taken) fails it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import logging
import mmap
import os
import random
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import blake3

from chunkd.cache import BytesLease, Chunk, ChunkCache, ChunkId, ChunkLease
from chunkd.cache.singleflight import SingleFlight
from chunkd.errors import (
    BackendUnavailableError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChunkdError,
    ChunkNotFoundError,
    IntegrityError,
    InvalidKeyError,
    ObjectNotFoundError,
)
from chunkd.gateway.readpath import validate_key

if TYPE_CHECKING:
    from chunkd.gateway.backends import Backend, Backends, ObjectMeta
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.peers import Peers

__all__ = [
    "SCHEMA",
    "Checkpoints",
    "Durability",
    "SaveJob",
    "SaveRequest",
    "checkpoint_name",
]

log = logging.getLogger("chunkd.gateway.checkpoints")

T = TypeVar("T")

SCHEMA: Final = 1
CHUNKS: Final = "chunks/"
CHECKPOINTS: Final = "checkpoints/"
INTENTS: Final = "intents/"
MANIFEST: Final = "manifest.json"
_UPLOADS_IN_FLIGHT: Final = 8
_STAGE_IN_FLIGHT: Final = 6  # chunks hashed or written at once per save
_RETRY_CAP: Final = 30.0
_STEP_RE: Final = re.compile(r"(\d+)\D*$")


class Durability(IntEnum):
    """How safe a save is; each level includes the ones below it."""

    STAGED = 1  # in the daemon's memory
    LOCAL = 2  # fsynced on this node's disk; survives a daemon kill -9
    REMOTE = 3  # committed in the backend

    @classmethod
    def parse(cls, text: object) -> Durability:
        """``"staged"``, ``"local"`` or ``"remote"``."""
        try:
            return cls[str(text).upper()]
        except KeyError:
            raise CheckpointError(
                f"durability must be 'staged', 'local' or 'remote'; got {text!r}"
            ) from None


def checkpoint_name(name: object) -> tuple[str, str]:
    """Split ``BACKEND/PATH`` and check the path; raise :class:`InvalidKeyError`."""
    if not isinstance(name, str):
        raise InvalidKeyError("a checkpoint is named 'BACKEND/PATH' (a string)")
    backend, _, path = name.strip("/").partition("/")
    path = path.strip("/")
    if not backend or not path:
        raise InvalidKeyError(f"{name!r} is not BACKEND/PATH")
    validate_key(path)
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise InvalidKeyError(f"checkpoint path {path!r} has an empty, '.' or '..' component")
    return backend, path


def _step_of(path: str) -> int | None:
    found = _STEP_RE.search(path.rsplit("/", 1)[-1])
    return int(found.group(1)) if found else None


@dataclass
class SaveRequest:
    """One rank's part of a checkpoint, as the client described it."""

    backend: str
    path: str
    save_id: str
    rank: int
    world_size: int
    durability: Durability
    overwrite: bool
    #: "auto": the coordinator commits once every part is in; "none": a separate
    #: commit request does (torch.distributed.checkpoint's ``finish``)
    commit: str
    step: int | None
    #: (offset, size) of each segment in the staged memfd
    segments: list[tuple[int, int]]
    #: the state tree (opaque to the daemon; the client encodes and decodes it)
    tree: Any

    @property
    def name(self) -> str:
        """``BACKEND/PATH``."""
        return f"{self.backend}/{self.path}"

    @property
    def prefix(self) -> str:
        """The checkpoint's directory in the backend."""
        return f"{CHECKPOINTS}{self.path}/"

    @property
    def part_key(self) -> str:
        """Where this rank's part manifest goes."""
        return f"{self.prefix}parts/{self.save_id}/{self.rank}.json"

    @property
    def intent_key(self) -> str:
        """Where this rank's intent goes while the save is in flight."""
        return f"{INTENTS}{self.save_id}.{self.rank}.json"

    def to_json(self) -> dict[str, Any]:
        """The request as the journal keeps it."""
        return {
            "backend": self.backend,
            "path": self.path,
            "save_id": self.save_id,
            "rank": self.rank,
            "world_size": self.world_size,
            "durability": self.durability.name.lower(),
            "overwrite": self.overwrite,
            "commit": self.commit,
            "step": self.step,
            "segments": [list(s) for s in self.segments],
            "tree": self.tree,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SaveRequest:
        """Parse and check a request (from the client or the journal).

        Raises:
            CheckpointError, InvalidKeyError: the request is malformed.
        """
        try:
            backend, path = checkpoint_name(f"{doc['backend']}/{doc['path']}")
            save_id = str(doc.get("save_id") or uuid.uuid4().hex)
            if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", save_id):
                raise CheckpointError(f"save_id {save_id!r} must be 1-64 of [A-Za-z0-9_-]")
            rank, world = int(doc.get("rank", 0)), int(doc.get("world_size", 1))
            if not 0 <= rank < world:
                raise CheckpointError(f"rank {rank} is outside world_size {world}")
            commit = str(doc.get("commit", "auto"))
            if commit not in ("auto", "none"):
                raise CheckpointError(f"commit must be 'auto' or 'none'; got {commit!r}")
            segments = [(int(o), int(n)) for o, n in doc["segments"]]
            step = doc.get("step")
            return cls(
                backend=backend,
                path=path,
                save_id=save_id,
                rank=rank,
                world_size=world,
                durability=Durability.parse(doc.get("durability", "remote")),
                overwrite=bool(doc.get("overwrite", False)),
                commit=commit,
                step=int(step) if step is not None else _step_of(path),
                segments=segments,
                tree=doc.get("tree"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"malformed checkpoint request: {exc!r}") from None


@dataclass
class SaveJob:
    """One rank's save as it moves through the commit protocol."""

    id: str
    request: SaveRequest
    #: chunk ids and sizes of each segment, once hashed
    chunks: list[list[tuple[ChunkId, int]]] = field(default_factory=list)
    level: int = 0
    state: str = "staged"
    error: ChunkdError | None = None
    logical: int = 0
    new: int = 0
    manifest_id: str | None = None
    started: float = field(default_factory=time.time)
    finished: float | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    data: mmap.mmap | None = None
    #: where each chunk lies in the staged bytes (offset, size)
    where: dict[ChunkId, tuple[int, int]] = field(default_factory=dict)
    #: chunk ids this job pinned in the disk tier (unpinned when it ends)
    pinned: set[ChunkId] = field(default_factory=set)

    @property
    def unique(self) -> dict[ChunkId, int]:
        """Each distinct chunk id of the part, with its size."""
        return {cid: size for seg in self.chunks for cid, size in seg}

    def reach(self, level: Durability, state: str | None = None) -> None:
        """Record progress and wake the waiters."""
        self.level = max(self.level, int(level))
        if state is not None:
            self.state = state
        self.changed.set()
        self.changed = asyncio.Event()

    def fail(self, error: ChunkdError) -> None:
        """Record a failure and wake the waiters."""
        self.error = error
        self.finished = time.time()
        self.state = "failed"
        self.changed.set()
        self.changed = asyncio.Event()

    def describe(self) -> dict[str, Any]:
        """What a waiter is told."""
        out: dict[str, Any] = {
            "job": self.id,
            "name": self.request.name,
            "rank": self.request.rank,
            "world_size": self.request.world_size,
            "save_id": self.request.save_id,
            "state": self.state,
            "durability": Durability(self.level).name.lower() if self.level else None,
            "logical_bytes": self.logical,
            "new_bytes": self.new,
            "dedup_bytes": self.logical - self.new,
            "manifest_id": self.manifest_id,
        }
        if self.error is not None:
            out["error"] = type(self.error).__name__
            out["message"] = str(self.error)
        return out


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
    ) -> None:
        self.cache = cache
        self.backends = backends
        self.metrics = metrics
        self.root = Path(root)
        self.part_timeout = part_timeout
        self.poll_interval = poll_interval
        self.peers = peers
        self._jobs_dir = self.root / "jobs"
        self._failed_dir = self.root / "failed"
        self._jobs: dict[str, SaveJob] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._uploads: SingleFlight[tuple[str, ChunkId], bool] = SingleFlight()
        self._fetches: SingleFlight[tuple[str, ChunkId], str] = SingleFlight()
        self._upload_slots = asyncio.Semaphore(_UPLOADS_IN_FLIGHT)

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> int:
        """Resume every journaled job; returns how many."""
        await asyncio.to_thread(self._make_dirs)
        resumed = 0
        for path in sorted(self._jobs_dir.glob("*.json")):
            try:
                doc = json.loads(path.read_bytes())
                request = SaveRequest.from_json(doc["request"])
                job = SaveJob(id=str(doc["job"]), request=request)
                job.chunks = [[(ChunkId.parse(c), int(n)) for c, n in seg] for seg in doc["chunks"]]
                job.logical = int(doc["logical"])
            except (OSError, ValueError, KeyError, TypeError, ChunkdError) as exc:
                log.error("checkpoint journal %s is unreadable (%s); set aside", path, exc)  # noqa: TRY400
                self._set_aside(path)
                continue
            missing = [cid for cid in job.unique if self.cache.index.lookup(cid) is None]
            if missing:  # files a crash left without their records are adopted first
                await self.cache.wait_reconciled()
                missing = [cid for cid in missing if self.cache.index.lookup(cid) is None]
            if missing:
                log.error(
                    "checkpoint %s (rank %d) cannot resume: %d of its chunks are gone from "
                    "the disk tier; it will not appear",
                    request.name,
                    request.rank,
                    len(missing),
                )
                self._set_aside(path)
                continue
            job.pinned = set(job.unique)
            self.cache.disk.pin(job.pinned)
            job.reach(Durability.LOCAL, "resuming")
            self._jobs[job.id] = job
            self._spawn(self._guarded(job, self._finish(job)))
            resumed += 1
            log.info("resuming checkpoint %s (rank %d)", request.name, request.rank)
        return resumed

    def _make_dirs(self) -> None:
        self._jobs_dir.mkdir(parents=True, exist_ok=True)
        self._failed_dir.mkdir(parents=True, exist_ok=True)

    def _set_aside(self, journal: Path) -> None:
        with contextlib.suppress(OSError):
            os.replace(journal, self._failed_dir / journal.name)

    async def close(self) -> None:
        """Stop every job (journaled ones resume on the next start)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for job in self._jobs.values():
            self._release_data(job)

    def _spawn(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- saving ---------------------------------------------------------------------

    async def save(self, request: SaveRequest, data: mmap.mmap, size: int) -> SaveJob:
        """Take one rank's staged part; the job goes on in the background.

        Checked before anything is accepted: the backend exists and is writable,
        the segments lie inside the staged bytes, and the name is free (or
        ``overwrite``). The name check is a HEAD, so refused credentials fail here.

        Raises:
            UnknownBackendError, ReadOnlyBackendError, BackendForbiddenError,
            CheckpointExistsError, CheckpointError
        """
        backend = self.backends.get(request.backend)
        backend.check_writable()
        for offset, length in request.segments:
            if offset < 0 or length < 0 or offset + length > size:
                raise CheckpointError(
                    f"segment ({offset}, {length}) lies outside the {size} staged bytes"
                )
        if not request.overwrite and request.rank == 0:
            if any(
                j.request.name == request.name
                and j.request.save_id != request.save_id
                and j.error is None
                and j.state != "done"
                for j in self._jobs.values()
            ):
                raise CheckpointExistsError(
                    f"checkpoint {request.name} is being saved already; pass overwrite=True "
                    "to replace it"
                )
            if await self._exists_unless_down(backend, request.prefix + MANIFEST):
                raise CheckpointExistsError(
                    f"checkpoint {request.name} exists; pass overwrite=True to replace it"
                )
        self._prune()
        job = SaveJob(id=uuid.uuid4().hex, request=request, data=data)
        job.logical = sum(n for _, n in request.segments)
        job.reach(Durability.STAGED, "staged")
        self._jobs[job.id] = job
        self.metrics.ckpt_saves.labels("started").inc()
        self._spawn(self._guarded(job, self._run(job)))
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
        try:
            await backend.head(key)
        except ObjectNotFoundError:
            return False
        return True

    async def _run(self, job: SaveJob) -> None:
        await self._stage_to_disk(job)
        await self._finish(job)

    async def _guarded(self, job: SaveJob, work: Awaitable[None]) -> None:
        """Run a job's steps; any failure fails the job (a cancel leaves it journaled)."""
        try:
            await work
        except asyncio.CancelledError:
            raise
        except ChunkdError as exc:
            self._failed(job, exc)
        except Exception as exc:
            log.exception("checkpoint %s failed", job.request.name)
            self._failed(job, CheckpointError(f"checkpoint {job.request.name} failed: {exc!r}"))

    def _failed(self, job: SaveJob, exc: ChunkdError) -> None:
        log.warning("checkpoint %s (rank %d) failed: %s", job.request.name, job.request.rank, exc)
        self.metrics.ckpt_saves.labels("failed").inc()
        job.fail(exc)
        self._release_data(job)
        self._unpin(job)
        self._set_aside(self._journal(job))

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
                if cid not in job.pinned:
                    job.pinned.add(cid)
                    self.cache.disk.pin([cid])
                # No fsync per file: _make_durable syncs the filesystem once at the end.
                # No zstd: it cost 15-25% of the write time and saved about 10%.
                chunk = Chunk.trusted(cid, piece)
                return cid, await self.cache.disk.put(chunk, sync=False, compress=False)

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
        if not declined:
            await asyncio.to_thread(self._make_durable)
            # A put that found its chunk present may have raced an eviction that
            # chose it before the pin landed: count what the index holds now.
            declined = sum(1 for cid in job.unique if self.cache.index.lookup(cid) is None)
        if not declined:
            await asyncio.to_thread(self._write_journal, job)
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
            # a job that has to wait for its backend gives them up (see _retrying).
            job.reach(Durability.LOCAL, "uploading")
        else:
            log.warning(
                "checkpoint %s: the disk tier declined %d chunks (full or degraded); "
                "it is durable once it is in the backend",
                job.request.name,
                declined,
            )
            job.state = "uploading"

    def _unpin(self, job: SaveJob) -> None:
        pinned, job.pinned = job.pinned, set()
        self.cache.disk.unpin(pinned)

    def _make_durable(self) -> None:
        """Commit the index and get every chunk file (written without fsync) and its
        name to the disk with one syncfs, whatever the cache's own fsync policy
        (cached copies can be fetched again; these cannot)."""
        self.cache.index.flush()
        _syncfs(self.root)

    def _journal(self, job: SaveJob) -> Path:
        return self._jobs_dir / f"{job.id}.json"

    def _write_journal(self, job: SaveJob) -> None:
        doc = {
            "job": job.id,
            "request": job.request.to_json(),
            "chunks": [[[str(cid), n] for cid, n in seg] for seg in job.chunks],
            "logical": job.logical,
        }
        _write_durably(self._journal(job), json.dumps(doc).encode())

    def _release_data(self, job: SaveJob) -> None:
        if job.data is not None:
            with contextlib.suppress(BufferError):
                job.data.close()
                job.data = None

    async def _finish(self, job: SaveJob) -> None:
        """Steps 4 to 8 of the commit protocol; backend outages are waited out."""
        request = job.request
        backend = self.backends.get(request.backend)
        unique = job.unique
        intent = {"save_id": request.save_id, "name": request.name, "created": time.time()}
        intent["chunks"] = [str(cid) for cid in unique]
        await self._retrying(job, lambda: backend.put(request.intent_key, _dumps(intent)))
        job.state = "uploading"
        uploaded = await asyncio.gather(
            *(self._retrying(job, functools.partial(self._upload, job, backend, c)) for c in unique)
        )
        sizes = unique.values()
        job.new = sum(size for size, sent in zip(sizes, uploaded, strict=True) if sent)
        self.metrics.ckpt_bytes.labels("logical").inc(job.logical)
        self.metrics.ckpt_bytes.labels("new").inc(job.new)
        part = _dumps(self._part(job))
        # If absent: a job resumed after its part went in must not change it (the
        # manifest may already name its hash).
        await self._retrying(job, lambda: backend.put(request.part_key, part, if_absent=True))
        if request.commit == "auto" and request.rank == 0:
            await self._commit(job, backend, request.world_size, request.overwrite, {})
        elif request.commit == "auto":
            job.state = "waiting for the commit"
            await self._await_commit(job, backend)
        else:
            job.manifest_id = blake3.blake3(part).hexdigest()
        # The intent stays: a collection that began before this save listed the
        # manifests without this one, and reads the intents before each sweep batch.
        # `chunkd gc` deletes intents older than a day.
        self._unpin(job)
        await asyncio.to_thread(_unlink_quietly, self._journal(job))
        self._release_data(job)
        job.finished = time.time()
        job.reach(Durability.REMOTE, "done")
        self.metrics.ckpt_saves.labels("committed").inc()
        log.info(
            "checkpoint %s rank %d committed: %d bytes, %d new",
            request.name,
            request.rank,
            job.logical,
            job.new,
        )

    async def _upload(self, job: SaveJob, backend: Backend, cid: ChunkId) -> bool:
        """Put chunk ``cid`` in the backend unless it is there; True if this job sent it."""
        key = (backend.name, cid)
        if self._uploads.join(key) is not None:
            await self._uploads.run(key, _never)  # another job sends it: a dedup
            return False
        return await self._uploads.run(key, lambda: self._send_chunk(job, backend, cid))

    async def _send_chunk(self, job: SaveJob, backend: Backend, cid: ChunkId) -> bool:
        async with self._upload_slots:
            if await self._exists(backend, f"{CHUNKS}{cid}"):
                return False
            lease = await self._source(job, cid)
            with lease:
                return await backend.put(f"{CHUNKS}{cid}", lease.view(), if_absent=True)

    async def _source(self, job: SaveJob, cid: ChunkId) -> ChunkLease:
        """The bytes of ``cid``: from the staged memfd while the job holds it, else
        from the disk tier (verified there, and not promoted into RAM)."""
        if job.data is not None and cid in job.where:
            start, size = job.where[cid]
            return BytesLease(cid, memoryview(job.data)[start : start + size])
        lease = await self.cache.disk.get(cid)
        if lease is None:
            raise CheckpointError(
                f"checkpoint {job.request.name}: chunk {cid} is no longer on this node's disk; "
                "the save cannot complete"
            )
        return lease

    def _part(self, job: SaveJob) -> dict[str, Any]:
        request = job.request
        return {
            "format": "chunkd-checkpoint-part",
            "schema": SCHEMA,
            "name": request.name,
            "save_id": request.save_id,
            "rank": request.rank,
            "world_size": request.world_size,
            "step": request.step,
            "created": time.time(),
            "segments": [
                {"size": size, "chunks": [[str(cid), n] for cid, n in seg]}
                for (_, size), seg in zip(request.segments, job.chunks, strict=True)
            ],
            "logical_bytes": job.logical,
            "new_bytes": job.new,
            "tree": request.tree,
        }

    async def _commit(
        self,
        job: SaveJob | None,
        backend: Backend,
        world_size: int,
        overwrite: bool,
        extra: dict[str, Any],
        *,
        path: str | None = None,
        save_id: str | None = None,
    ) -> str:
        """Wait for every part, then write the manifest; returns its id (blake3)."""
        if job is not None:
            path, save_id = job.request.path, job.request.save_id
            job.state = "waiting for parts"
        assert path is not None
        assert save_id is not None
        prefix = f"{CHECKPOINTS}{path}/parts/{save_id}/"
        deadline = time.monotonic() + self.part_timeout
        delay = 0.05
        while True:
            parts = await self._retrying(job, lambda: self._parts(backend, prefix, world_size))
            if parts is not None:
                break
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"checkpoint {backend.name}/{path}: not every one of {world_size} ranks "
                    f"saved its part within {self.part_timeout:g}s; nothing was committed"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.poll_interval)
        logical = sum(p["logical_bytes"] for p in parts)
        manifest = {
            "format": "chunkd-checkpoint",
            "schema": SCHEMA,
            "name": f"{backend.name}/{path}",
            "save_id": save_id,
            "world_size": world_size,
            "step": parts[0].get("step"),
            "created": time.time(),
            "logical_bytes": logical,
            "new_bytes": sum(p["new_bytes"] for p in parts),
            "parts": [
                {"rank": p["rank"], "key": f"{prefix}{p['rank']}.json", "blake3": p["_id"]}
                for p in parts
            ],
        } | extra
        body = _dumps(manifest)
        key = f"{CHECKPOINTS}{path}/{MANIFEST}"
        if job is not None:
            job.state = "committing"
        wrote = await self._retrying(job, lambda: backend.put(key, body, if_absent=not overwrite))
        if not wrote:
            ours = await self._committed_id(backend, key, save_id)
            if ours is not None:  # a retried PUT, or a resumed job: it went in before
                if job is not None:
                    job.manifest_id = ours
                return ours
            raise CheckpointExistsError(
                f"checkpoint {backend.name}/{path} was committed by another save meanwhile; "
                "this one was not (pass overwrite=True to replace it)"
            )
        manifest_id = blake3.blake3(body).hexdigest()
        if job is not None:
            job.manifest_id = manifest_id
        return manifest_id

    async def _committed_id(self, backend: Backend, key: str, save_id: str) -> str | None:
        """The id of the manifest at ``key`` if it commits ``save_id``, else None."""
        try:
            raw = await backend.get(key)
            if json.loads(bytes(raw)).get("save_id") == save_id:
                return blake3.blake3(raw).hexdigest()
        except (ObjectNotFoundError, ValueError, AttributeError):
            pass
        return None

    async def _parts(
        self, backend: Backend, prefix: str, world_size: int
    ) -> list[dict[str, Any]] | None:
        """Every part under ``prefix`` (with its id), or None while some are missing."""
        _, objects = await backend.list(prefix, recursive=True)
        keys = {m.key for m in objects}
        wanted = [f"{prefix}{r}.json" for r in range(world_size)]
        if not all(k in keys for k in wanted):
            return None
        parts = []
        for key in wanted:
            raw = await backend.get(key)
            part = json.loads(bytes(raw))
            part["_id"] = blake3.blake3(raw).hexdigest()
            parts.append(part)
        return parts

    async def _await_commit(self, job: SaveJob, backend: Backend) -> None:
        key = job.request.prefix + MANIFEST
        deadline = time.monotonic() + self.part_timeout
        delay = 0.05
        while True:
            try:
                raw = await self._retrying(job, lambda: backend.get(key))
                doc = json.loads(bytes(raw))
                if doc.get("save_id") == job.request.save_id:
                    job.manifest_id = blake3.blake3(raw).hexdigest()
                    return
            except (ObjectNotFoundError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"checkpoint {job.request.name}: rank 0 did not commit within "
                    f"{self.part_timeout:g}s"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.poll_interval)

    async def _retrying(self, job: SaveJob | None, step: Callable[[], Awaitable[T]]) -> T:
        """``step()``, waiting out a backend that is down (forever: nothing is dropped)."""
        delay = 0.5
        while True:
            try:
                return await step()
            except BackendUnavailableError as exc:
                if job is not None:
                    job.state = f"waiting for the backend: {exc}"
                    if job.level >= Durability.LOCAL:
                        self._release_data(job)  # on disk: no memory held while waiting
                log.info("checkpoint step failed (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(random.uniform(delay / 2, delay))
                delay = min(delay * 2, _RETRY_CAP)

    async def commit(
        self, name: str, save_id: str, world_size: int, overwrite: bool, extra: dict[str, Any]
    ) -> str:
        """Commit a save made with ``commit="none"`` once all its parts are in."""
        backend_name, path = checkpoint_name(name)
        backend = self.backends.get(backend_name)
        backend.check_writable()
        return await self._commit(
            None, backend, world_size, overwrite, extra, path=path, save_id=save_id
        )

    # -- waiting --------------------------------------------------------------------

    def job(self, job_id: str) -> SaveJob:
        """The job called ``job_id``.

        Raises:
            CheckpointError: the daemon does not know it (it restarted before the
                job was journaled, so that save is lost).
        """
        job = self._jobs.get(job_id)
        if job is None:
            raise CheckpointError(
                f"this daemon knows no save job {job_id!r}: it restarted before that save "
                "was durable on its disk, so the save was lost; save again"
            )
        return job

    async def wait(self, job_id: str, level: Durability, seconds: float) -> SaveJob:
        """Wait up to ``seconds`` for ``job_id`` to reach ``level`` or fail."""
        job = self.job(job_id)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                while job.level < level and job.error is None:
                    await job.changed.wait()
        return job

    def _prune(self) -> None:
        """Forget finished jobs after an hour (their waiters have had their answer)."""
        old = time.time() - 3600
        for job in list(self._jobs.values()):
            if job.finished is not None and job.finished < old:
                del self._jobs[job.id]

    # -- loading --------------------------------------------------------------------

    async def manifest(self, name: str) -> dict[str, Any]:
        """The committed manifest of ``name`` with its parts inlined (``"parts"``).

        A checkpoint saved at level local (or staged) on this node and not yet
        committed is answered from the daemon's own job when all its parts are here.

        Raises:
            CheckpointNotFoundError: no committed checkpoint has that name.
            IntegrityError: a part does not match the hash the manifest gives.
        """
        backend_name, path = checkpoint_name(name)
        backend = self.backends.get(backend_name)
        local = self._local_manifest(backend_name, path)
        try:
            raw = await backend.get(f"{CHECKPOINTS}{path}/{MANIFEST}")
        except ObjectNotFoundError:
            if local is not None:
                return local
            raise CheckpointNotFoundError(f"no checkpoint named {name}") from None
        try:
            manifest = json.loads(bytes(raw))
            entries = list(manifest["parts"])
        except (ValueError, KeyError, TypeError) as exc:
            manifest, entries = {}, []
            torn = str(exc)
        else:
            torn = "" if manifest.get("format") == "chunkd-checkpoint" else "not a chunkd manifest"
        if torn:
            raise CheckpointNotFoundError(
                f"checkpoint {name} has a torn or foreign manifest ({torn}); treated as absent"
            )
        if manifest.get("schema") != SCHEMA:
            raise CheckpointError(
                f"checkpoint {name} has manifest schema {manifest.get('schema')}; this "
                f"chunkd reads schema {SCHEMA}"
            )
        parts = []
        for entry in entries:
            try:
                part_raw = await backend.get(str(entry["key"]))
            except ObjectNotFoundError:
                raise IntegrityError(
                    f"checkpoint {name}: part {entry['key']} is missing from the backend"
                ) from None
            if blake3.blake3(part_raw).hexdigest() != entry["blake3"]:
                raise IntegrityError(
                    f"checkpoint {name}: part {entry['key']} does not match its hash in the "
                    "manifest; the checkpoint is damaged"
                )
            parts.append(json.loads(bytes(part_raw)))
        manifest["parts"] = parts
        manifest["manifest_id"] = blake3.blake3(raw).hexdigest()
        manifest["durability"] = "remote"
        return dict(manifest)

    def _local_manifest(self, backend: str, path: str) -> dict[str, Any] | None:
        jobs = [
            j
            for j in self._jobs.values()
            if j.request.backend == backend
            and j.request.path == path
            and j.error is None
            and j.state != "done"
            and j.level >= Durability.LOCAL
        ]
        if not jobs:
            return None
        newest = max(jobs, key=lambda j: j.started)
        mine = {j.request.rank: j for j in jobs if j.request.save_id == newest.request.save_id}
        if len(mine) != newest.request.world_size:
            return None
        parts = [self._part(mine[r]) for r in range(newest.request.world_size)]
        return {
            "format": "chunkd-checkpoint",
            "schema": SCHEMA,
            "name": newest.request.name,
            "save_id": newest.request.save_id,
            "world_size": newest.request.world_size,
            "step": newest.request.step,
            "parts": parts,
            "durability": Durability(min(j.level for j in mine.values())).name.lower(),
        }

    async def chunk(self, backend_name: str, cid: ChunkId, *, local: bool = False) -> ChunkLease:
        """Lease checkpoint chunk ``cid``: from the cache, else from its owner among the
        peers (unless ``local``: a peer's own request), else from ``chunks/<id>``.

        Bytes from a peer or the backend are verified against the id before they are
        cached; concurrent requests for one chunk make one fetch.

        Raises:
            IntegrityError: the backend's copy is damaged (nothing is cached).
            CheckpointError: the backend has no such chunk.
        """
        lease = await self.cache.find(cid)
        if lease is not None:
            if not local:
                self.metrics.ckpt_restored_bytes.labels("cache").inc(lease.size)
            return lease
        backend = self.backends.get(backend_name)
        data: list[memoryview] = []

        async def fetch() -> str:
            if self.peers is not None and not local:
                shared = await self.peers.fetch_chunk(backend_name, cid)  # verified
                if shared is not None:
                    data.append(shared)
                    await self.cache.put(Chunk.trusted(cid, shared))
                    return "peer"
            try:
                raw = await backend.get(f"{CHUNKS}{cid}")
            except ObjectNotFoundError:
                raise _chunk_error(
                    ChunkNotFoundError(f"chunk {cid} is missing from backend {backend_name!r}"),
                    cid,
                ) from None
            got = await asyncio.to_thread(ChunkId.of, raw)
            if got != cid:
                self.metrics.ckpt_integrity_failures.inc()
                raise _chunk_error(
                    IntegrityError(
                        f"chunk {cid} in backend {backend_name!r} is damaged: its "
                        f"{raw.nbytes} bytes hash to {got}; it was not cached"
                    ),
                    cid,
                )
            data.append(raw)
            await self.cache.put(Chunk.trusted(cid, raw))
            return "backend"

        # Every reader of one fetch counts its bytes under the fetch's source: each
        # of this node's readers got them from there.
        source = await self._fetches.run((backend_name, cid), fetch)
        lease = await self.cache.find(cid)
        if lease is None and data:  # no tier kept it (RAM full of pinned chunks)
            lease = BytesLease(cid, bytes(data[0]))
        if lease is None:
            return await self.chunk(backend_name, cid, local=local)  # evicted meanwhile
        if not local:
            self.metrics.ckpt_restored_bytes.labels(source).inc(lease.size)
        return lease

    # -- listing, deleting, GC -------------------------------------------------------

    async def entries(self, prefix: str) -> list[dict[str, Any]]:
        """Committed checkpoints under ``BACKEND[/PREFIX]``, and saves in flight here."""
        backend_name, _, path = prefix.strip("/").partition("/")
        backend = self.backends.get(backend_name)
        if path:
            validate_key(path)
        manifests = await self._manifests(backend, path)
        out = []
        for key, meta in manifests:
            try:
                doc = json.loads(bytes(await backend.get(key)))
                out.append(_summary(backend.name, key, doc, meta))
            except (ObjectNotFoundError, ValueError, KeyError, TypeError):
                continue  # deleted meanwhile, or torn: not a checkpoint
        committed = {e["name"] for e in out}
        for job in self._jobs.values():
            request = job.request
            if (
                request.backend == backend.name
                and (not path or f"{request.path}/".startswith(f"{path.strip('/')}/"))
                and job.state != "done"
                and request.name not in committed
            ):
                out.append(
                    {
                        "name": request.name,
                        "step": request.step,
                        "logical_bytes": job.logical,
                        "new_bytes": job.new,
                        "dedup_ratio": None,
                        "durability": job.describe()["durability"],
                        "state": job.state,
                        "world_size": request.world_size,
                        "created": job.started,
                    }
                )
        out.sort(key=lambda e: e["name"])
        return out

    async def _manifests(self, backend: Backend, path: str) -> list[tuple[str, ObjectMeta]]:
        # A whole path component: "run1" is not a prefix of "run10".
        prefix = f"{CHECKPOINTS}{path.strip('/')}/" if path else CHECKPOINTS
        _, objects = await backend.list(prefix, recursive=True)
        return [(m.key, m) for m in objects if m.key.endswith("/" + MANIFEST)]

    async def delete(self, name: str) -> int:
        """Delete checkpoint ``name``: its manifest first, then the parts it names.

        Returns the objects removed. Its chunks stay until ``chunkd gc`` finds them
        unreferenced; parts of other saves under the same name are left alone.
        """
        backend_name, path = checkpoint_name(name)
        backend = self.backends.get(backend_name)
        backend.check_writable()
        key = f"{CHECKPOINTS}{path}/{MANIFEST}"
        try:
            doc = json.loads(bytes(await backend.get(key)))
            parts = [str(p["key"]) for p in doc["parts"]]
        except ObjectNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint named {name}") from None
        except (ValueError, KeyError, TypeError):
            parts = []  # a torn manifest: no checkpoint, but remove it
        await backend.delete(key)  # the checkpoint is gone from here on
        for part in parts:
            await backend.delete(part)
        return 1 + len(parts)

    async def gc(
        self,
        target: str,
        *,
        keep_last: int | None,
        grace: float,
        dry_run: bool,
        pending_ttl: float = 7 * 86400,
        intent_ttl: float = 86400,
    ) -> dict[str, Any]:
        """Retention under ``BACKEND[/PREFIX]``, then mark and sweep the backend's chunks.

        Mark: every chunk named by the parts of a committed manifest anywhere in the
        backend, by a part of a save not yet committed (younger than ``pending_ttl``;
        older ones are deleted), or by an intent (intents outlive their save's commit
        and are deleted after ``intent_ttl``). Sweep: unreferenced chunks older than
        ``grace`` seconds. Intents are read again right before each batch of deletes,
        so a save that starts during the collection keeps what it named.
        """
        backend_name, _, path = target.strip("/").partition("/")
        backend = self.backends.get(backend_name)
        backend.check_writable()
        if path:
            validate_key(path)
        report: dict[str, Any] = {"target": target, "dry_run": dry_run, "retired": []}
        if keep_last is not None:
            listed = [e for e in await self.entries(target) if e.get("state") == "committed"]
            listed.sort(key=lambda e: (e["step"] if e["step"] is not None else -1, e["created"]))
            retire = listed[: max(0, len(listed) - keep_last)]
            for entry in retire:
                report["retired"].append(entry["name"])
                if not dry_run:
                    await self.delete(entry["name"])
        live: set[str] = set()
        now = time.time()
        _, objects = await backend.list(CHECKPOINTS, recursive=True, limit=None)
        # A dry run marks as if the retired checkpoints were gone already.
        retired = {f"{CHECKPOINTS}{n.partition('/')[2]}/{MANIFEST}" for n in report["retired"]}
        committed_parts: set[str] = set()
        for meta in objects:
            if not meta.key.endswith("/" + MANIFEST):
                continue
            try:
                doc = json.loads(bytes(await backend.get(meta.key)))
                keys = [str(p["key"]) for p in doc["parts"]]
            except ObjectNotFoundError:
                continue  # deleted meanwhile
            except (ValueError, KeyError, TypeError):
                continue  # torn: not a checkpoint
            committed_parts.update(keys)
            if meta.key not in retired:
                for key in keys:
                    live |= await self._part_chunks(backend, key)
        stale_parts = []
        for meta in objects:
            if meta.key.endswith("/" + MANIFEST) or meta.key in committed_parts:
                continue
            if now - meta.modified > pending_ttl:
                stale_parts.append(meta)  # a save that never committed: its chunks may go
                continue
            live |= await self._part_chunks(backend, meta.key)  # a save in flight
        live |= await self._intent_chunks(backend, expire_after=None if dry_run else intent_ttl)
        report["stale_parts"] = len(stale_parts)
        if not dry_run:
            for meta in stale_parts:
                await backend.delete(meta.key)
        _, chunks = await backend.list(CHUNKS, recursive=True, limit=None)
        report["chunks"] = len(chunks)
        report["referenced"] = sum(1 for m in chunks if m.key[len(CHUNKS) :] in live)
        doomed = [
            m for m in chunks if m.key[len(CHUNKS) :] not in live and now - m.modified > grace
        ]
        swept = freed = 0
        for start in range(0, len(doomed), 256):
            batch = doomed[start : start + 256]
            if not dry_run:
                keep = await self._intent_chunks(backend, expire_after=None)
                batch = [m for m in batch if m.key[len(CHUNKS) :] not in keep]
                for meta in batch:
                    await backend.delete(meta.key)
            swept += len(batch)
            freed += sum(m.size for m in batch)
        report["swept"] = swept
        report["freed_bytes"] = freed
        report["kept_young"] = sum(
            1 for m in chunks if m.key[len(CHUNKS) :] not in live and now - m.modified <= grace
        )
        log.info("gc %s: %s", target, report)
        return report

    async def _part_chunks(self, backend: Backend, key: str) -> set[str]:
        """The chunk ids a part names (none if it is gone or unreadable)."""
        try:
            part = json.loads(bytes(await backend.get(key)))
            return {str(c) for seg in part["segments"] for c, _ in seg["chunks"]}
        except (ObjectNotFoundError, ValueError, KeyError, TypeError):
            return set()

    async def _intent_chunks(self, backend: Backend, *, expire_after: float | None) -> set[str]:
        """Chunk ids named by intents; intents older than ``expire_after`` are deleted."""
        _, intents = await backend.list(INTENTS, recursive=True, limit=None)
        keep: set[str] = set()
        now = time.time()
        for meta in intents:
            if expire_after is not None and now - meta.modified > expire_after:
                await backend.delete(meta.key)  # its save committed or died long ago
                continue
            with contextlib.suppress(ObjectNotFoundError, ValueError, KeyError, TypeError):
                keep.update(json.loads(bytes(await backend.get(meta.key)))["chunks"])
        return keep

    def stats(self) -> dict[str, Any]:
        """Jobs in flight, for /v1/stats."""
        return {
            "jobs": [j.describe() for j in self._jobs.values() if j.state != "done"],
            "pinned_chunks": self.cache.disk.pinned,
        }


async def _never() -> bool:  # pragma: no cover - only run() on a key already running
    raise AssertionError("unreachable")


def _chunk_error(exc: ChunkdError, cid: ChunkId) -> ChunkdError:
    exc.chunk_id = str(cid)  # type: ignore[attr-defined]
    return exc


def _summary(backend: str, key: str, doc: dict[str, Any], meta: ObjectMeta) -> dict[str, Any]:
    logical, new = int(doc["logical_bytes"]), int(doc["new_bytes"])
    path = key[len(CHECKPOINTS) : -len("/" + MANIFEST)]
    return {
        "name": f"{backend}/{path}",
        "step": doc.get("step"),
        "logical_bytes": logical,
        "new_bytes": new,
        "dedup_ratio": round(logical / new, 3) if new else None,
        "durability": "remote",
        "state": "committed",
        "world_size": doc.get("world_size"),
        "created": doc.get("created", meta.modified),
    }


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def _write_durably(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _syncfs(path: Path) -> None:
    """syncfs(2) on the filesystem holding ``path``: one call flushes all its dirty data."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs of {path} failed: {os.strerror(err)}")
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
