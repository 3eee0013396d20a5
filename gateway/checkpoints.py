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
                concurrent `chunkd gc` keeps them (it stays a day)
    5. barrier  list gc/: wait until every collection whose barrier is there is over
    6. upload   per chunk: HEAD chunks/<id>; PUT it (if absent) only when missing
    7. part     checkpoints/<PATH>/parts/<save_id>/<rank>.json
    8. commit   the coordinator (rank 0) waits for every part, then writes
                checkpoints/<PATH>/manifest.json (if absent, unless overwrite):
                the checkpoint exists from this one PUT on   -> level "remote"
    9. cleanup  the journal is deleted, the pins dropped

Garbage collection writes its barrier gc/<run>.json before it reads the intents and
removes it after its last delete; with steps 4 and 5 that order makes a collection
and a save that deduplicates against an unreferenced chunk safe by protocol
(docs/checkpoints.md has the argument; :class:`_Barrier` the collection's side).

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
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import blake3

import chunkd.errors
from chunkd.cache import BytesLease, Chunk, ChunkCache, ChunkId, ChunkLease
from chunkd.cache.singleflight import SingleFlight
from chunkd.client.protocol import MAX_WORLD_SIZE
from chunkd.errors import (
    BackendUnavailableError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChunkdError,
    ChunkNotFoundError,
    IntegrityError,
    InvalidRequestError,
    ObjectNotFoundError,
)
from chunkd.gateway import arguments as arg
from chunkd.gateway.names import checkpoint_name, split_prefix

if TYPE_CHECKING:
    from chunkd.gateway.backends import Backend, Backends, ObjectMeta
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.peers import Peers

__all__ = [
    "MAX_SEGMENTS",
    "MAX_STAGED_BYTES",
    "MAX_STEP",
    "SCHEMA",
    "Checkpoints",
    "Durability",
    "SaveJob",
    "SaveRequest",
    "check_save_id",
]

log = logging.getLogger("chunkd.gateway.checkpoints")

T = TypeVar("T")
A = TypeVar("A")

SCHEMA: Final = 1
CHUNKS: Final = "chunks/"
CHECKPOINTS: Final = "checkpoints/"
INTENTS: Final = "intents/"
MANIFEST: Final = "manifest.json"
#: the top-level keys of a manifest that chunkd writes (extra fields may not replace them)
_MANIFEST_KEYS: Final = frozenset(
    {
        "format",
        "schema",
        "name",
        "save_id",
        "world_size",
        "step",
        "created",
        "logical_bytes",
        "new_bytes",
        "parts",
    }
)
GC_BARRIERS: Final = "gc/"
#: the shortest expiry of a collection's barrier (longer where one backend request
#: may take longer): how long saves wait for a collection that died
BARRIER_EXPIRY: Final = 120.0
#: the longest expiry a save honours, whatever a barrier declares
_BARRIER_EXPIRY_CAP: Final = 3600.0
#: the share of a barrier's expiry a collection relies on: clocks run at rates that
#: differ by far less than 1%
_CLOCK_RATE_SLACK: Final = 0.99
_DELETES_AT_ONCE: Final = 16
_SUMMARIES_AT_ONCE: Final = 32
#: backend keys one listing page looks at, at most
_PAGE_SCAN_KEYS: Final = 20_000
_READS_AT_ONCE: Final = 16
_PART_RE: Final = re.compile(r"/parts/[A-Za-z0-9_-]{1,64}/(0|[1-9][0-9]{0,5})\.json$")
_UPLOADS_IN_FLIGHT: Final = 8
_STAGE_IN_FLIGHT: Final = 6  # chunks hashed or written at once per save
_RETRY_CAP: Final = 30.0
#: how long the failures of jobs are kept, for clients that wait after a restart
_FAILURES_KEPT: Final = 7 * 86400.0
_STEP_RE: Final = re.compile(r"(\d+)\D*$")
_SAVE_ID_RE: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: segments one save request may name
MAX_SEGMENTS: Final = 1 << 20
#: the largest offset or size a segment may name (256 TiB)
MAX_STAGED_BYTES: Final = 1 << 48
#: the largest step (a signed 64-bit integer); the smallest is ``-MAX_STEP - 1``
MAX_STEP: Final = (1 << 63) - 1


class Durability(IntEnum):
    """How safe a save is; each level includes the ones below it."""

    STAGED = 1  # in the daemon's memory
    LOCAL = 2  # fsynced on this node's disk; survives a daemon kill -9
    REMOTE = 3  # committed in the backend

    @classmethod
    def parse(cls, text: object) -> Durability:
        """``"staged"``, ``"local"`` or ``"remote"``."""
        if isinstance(text, str) and text.upper() in cls.__members__:
            return cls[text.upper()]
        raise InvalidRequestError(
            f"durability must be 'staged', 'local' or 'remote'; got {str(text)[:40]!r}"
        )


def _step_of(path: str) -> int | None:
    found = _STEP_RE.search(path.rsplit("/", 1)[-1])
    if not found or len(found.group(1)) > 19:
        return None
    step = int(found.group(1))
    return step if step <= MAX_STEP else None


def check_save_id(save_id: str) -> str:
    """Return ``save_id`` if it is 1-64 of ``[A-Za-z0-9_-]``; InvalidRequestError otherwise.

    A save id is a path component of the part keys, so nothing else may be in it.
    """
    if not _SAVE_ID_RE.fullmatch(save_id):
        raise InvalidRequestError(f"save_id {save_id[:80]!r} must be 1-64 of [A-Za-z0-9_-]")
    return save_id


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

        Every number and count is bounded: ``world_size`` by
        :data:`~chunkd.client.protocol.MAX_WORLD_SIZE`, the segments by
        :data:`MAX_SEGMENTS` and :data:`MAX_STAGED_BYTES`, ``step`` by :data:`MAX_STEP`.

        Raises:
            InvalidRequestError, InvalidKeyError: the request is malformed or out of bounds.
        """
        backend, path = checkpoint_name(f"{doc.get('backend')}/{doc.get('path')}")
        save_id = arg.optional_text(doc, "save_id", max_bytes=64) or uuid.uuid4().hex
        world = arg.whole(doc, "world_size", low=1, high=MAX_WORLD_SIZE, default=1)
        rank = arg.whole(doc, "rank", low=0, high=MAX_WORLD_SIZE - 1, default=0)
        if rank >= world:
            raise InvalidRequestError(f"rank {rank} is outside world_size {world}")
        commit = doc.get("commit", "auto")
        if commit not in ("auto", "none"):
            raise InvalidRequestError(f"commit must be 'auto' or 'none'; got {str(commit)[:40]!r}")
        step = doc.get("step")
        return cls(
            backend=backend,
            path=path,
            save_id=check_save_id(save_id),
            rank=rank,
            world_size=world,
            durability=Durability.parse(doc.get("durability", "remote")),
            overwrite=arg.flag(doc, "overwrite"),
            commit=str(commit),
            step=_step_of(path)
            if step is None
            else arg.whole(doc, "step", low=-MAX_STEP - 1, high=MAX_STEP),
            segments=_segments(doc.get("segments")),
            tree=doc.get("tree"),
        )


def _segments(raw: object) -> list[tuple[int, int]]:
    """The (offset, size) pairs of a request, checked against their bounds."""
    if not isinstance(raw, list) or len(raw) > MAX_SEGMENTS:
        raise InvalidRequestError(
            f"a save's segments are a list of at most {MAX_SEGMENTS} [offset, size] pairs"
        )
    segments = []
    for item in raw:
        if (
            not isinstance(item, list | tuple)
            or len(item) != 2
            or any(
                isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_STAGED_BYTES
                for n in item
            )
        ):
            raise InvalidRequestError(
                f"a segment is [offset, size], whole numbers from 0 to {MAX_STAGED_BYTES}; "
                f"got {str(item)[:60]}"
            )
        segments.append((int(item[0]), int(item[1])))
    return segments


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
            "commit": self.request.commit,
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


class _Barrier:
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
        if self.expiry > _BARRIER_EXPIRY_CAP:
            raise CheckpointError(
                f"backend {backend.name!r}: with timeout {config.timeout:g}s and {config.retries} "
                f"retries, one request may take {self.request_bound:g}s, too long for a "
                "garbage collection whose barrier saves wait at most "
                f"{_BARRIER_EXPIRY_CAP:g}s for; lower the backend's timeout or retries"
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
            await self.backend.put(self.key, _dumps(doc))
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


def _clock() -> float:
    """Seconds on a clock that never goes back and counts time suspended."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


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
        self._fetches: SingleFlight[tuple[str, ChunkId], tuple[str, memoryview]] = SingleFlight()
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
                self._set_aside(
                    path,
                    CheckpointError(
                        f"the journal of save job {path.stem} was unreadable when the daemon "
                        f"started again ({exc}); the save was not resumed: save again"
                    ),
                )
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
                self._set_aside(
                    path,
                    CheckpointError(
                        f"checkpoint {request.name} (rank {request.rank}) could not resume when "
                        f"the daemon started again: {len(missing)} of its chunks were gone from "
                        "the node's disk; save again"
                    ),
                )
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
        old = time.time() - _FAILURES_KEPT
        for record in self._failed_dir.glob("*.error.json"):
            with contextlib.suppress(OSError):
                if record.stat().st_mtime < old:
                    record.unlink()

    def _set_aside(self, journal: Path, error: ChunkdError | None = None) -> None:
        """Move a job's journal to ``failed/``, with what went wrong: a client that
        waits for the job after a restart is told that, not that the save was lost."""
        with contextlib.suppress(OSError):
            os.replace(journal, self._failed_dir / journal.name)
        if error is not None:
            doc = {"error": type(error).__name__, "message": str(error), "failed": time.time()}
            with contextlib.suppress(OSError):
                _write_durably(self._failed_dir / f"{journal.stem}.error.json", _dumps(doc))

    def _recorded_failure(self, job_id: str) -> ChunkdError | None:
        """The failure :meth:`_set_aside` recorded for ``job_id``, if any."""
        try:
            doc = json.loads((self._failed_dir / f"{job_id}.error.json").read_bytes())
            kind, message = str(doc["error"]), str(doc["message"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        cls = getattr(chunkd.errors, kind, None)
        if not (isinstance(cls, type) and issubclass(cls, ChunkdError)):
            cls = CheckpointError
        return cls(message)

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
                raise InvalidRequestError(
                    f"segment ({offset}, {length}) lies outside the {size} staged bytes"
                )
        # Segments may not name more bytes than were staged (overlapping ones could
        # make one request hash the same bytes a million times).
        if sum(length for _, length in request.segments) > size:
            raise InvalidRequestError(
                f"the segments name more bytes than the {size} staged; they may not overlap"
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
            await self._failed(job, exc)
        except Exception as exc:
            log.exception("checkpoint %s failed", job.request.name)
            await self._failed(
                job, CheckpointError(f"checkpoint {job.request.name} failed: {exc!r}")
            )

    async def _failed(self, job: SaveJob, exc: ChunkdError) -> None:
        log.warning("checkpoint %s (rank %d) failed: %s", job.request.name, job.request.rank, exc)
        self.metrics.ckpt_saves.labels("failed").inc()
        job.fail(exc)
        self._release_data(job)
        self._unpin(job)
        await asyncio.to_thread(self._set_aside, self._journal(job), exc)

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
        """Steps 4 to 9 of the commit protocol; backend outages are waited out."""
        request = job.request
        backend = self.backends.get(request.backend)
        unique = job.unique
        intent = {"save_id": request.save_id, "name": request.name, "created": time.time()}
        intent["chunks"] = [str(cid) for cid in unique]
        await self._retrying(job, lambda: backend.put(request.intent_key, _dumps(intent)))
        # No dedup decision (the HEADs of _send_chunk) before every collection that
        # may have missed this intent is over: see _await_collections.
        await self._await_collections(job, backend)
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
        # manifests without this one, and reads the intents after its barrier is up.
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

    async def _await_collections(self, job: SaveJob, backend: Backend) -> None:
        """Wait until every garbage collection whose barrier is up now is over.

        Called after the job's intent is in the backend and before any of its chunks
        is looked up there. A collection whose barrier is listed here may have read the
        intents before this one was written, so it may still delete a chunk this save
        would find present: wait until its barrier is gone. One whose barrier is not
        listed yet writes it after this intent exists, and reads the intents after
        that, before it deletes anything (docs/checkpoints.md has the argument).

        A barrier that stays the same for the expiry it declares, measured here on this
        daemon's monotonic clock, belongs to a collection that died (kill -9): it is
        passed over. The collection's side of that bargain is :class:`_Barrier`.
        """
        barriers = await self._retrying(job, lambda: self._barriers(backend))
        if not barriers:
            return
        self.metrics.gc_barrier_waits.inc()
        state = job.state
        job.state = f"waiting for {len(barriers)} garbage collection(s) to finish"
        seen = time.monotonic()
        # barrier key -> (version, when that version was first seen, its expiry)
        watched: dict[str, tuple[str, float, float]] = {}
        for meta in barriers:
            expiry = await self._declared_expiry(backend, meta)
            if expiry is not None:
                watched[meta.key] = (meta.version, seen, expiry)
        delay = 0.05
        while watched:
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.poll_interval)
            asked = time.monotonic()
            now = {m.key: m for m in await self._retrying(job, lambda: self._barriers(backend))}
            answered = time.monotonic()
            for key, (version, since, expiry) in list(watched.items()):
                current = now.get(key)
                if current is None:
                    del watched[key]  # that collection is over
                elif current.version != version:  # rewritten: alive
                    renewed = await self._declared_expiry(backend, current)
                    if renewed is None:
                        del watched[key]
                    else:
                        watched[key] = (current.version, answered, renewed)
                elif asked - since >= expiry:
                    log.warning(
                        "checkpoint %s: garbage collection barrier %s/%s has not changed for "
                        "%.0fs; its collection is taken for dead and the save goes on",
                        job.request.name,
                        backend.name,
                        key,
                        asked - since,
                    )
                    del watched[key]
        job.state = state

    async def _barriers(self, backend: Backend) -> list[ObjectMeta]:
        """The barriers of the collections running in ``backend`` (never a cached listing)."""
        found: list[ObjectMeta] = []
        async with contextlib.aclosing(backend.scan(GC_BARRIERS.rstrip("/"))) as batches:
            async for batch in batches:
                found += [m for m in batch if m.key.endswith(".json")]
        return found

    async def _declared_expiry(self, backend: Backend, meta: ObjectMeta) -> float | None:
        """How long barrier ``meta`` may stay unchanged before it counts as abandoned
        (None: it is gone already)."""
        try:
            doc = json.loads(bytes(await backend.get(meta.key)))
            declared = float(doc["expires_after"])
        except ObjectNotFoundError:
            return None
        except (ValueError, KeyError, TypeError):
            declared = _BARRIER_EXPIRY_CAP  # not ours to judge: the longest wait
        if not declared > 0:
            declared = _BARRIER_EXPIRY_CAP
        return min(declared, _BARRIER_EXPIRY_CAP)

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
        }
        assert not set(extra) & set(manifest)
        manifest |= extra
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
        """Every part under ``prefix`` (with its id), or None while some are missing.

        A look costs what is present (one listing request per 1000 parts), whatever
        ``world_size`` is; the parts are read once all of them are there.
        """
        present: set[int] = set()
        async with contextlib.aclosing(backend.scan(prefix.rstrip("/"))) as batches:
            async for batch in batches:
                for meta in batch:
                    rank = _part_rank(meta.key[len(prefix) :], world_size)
                    if rank is not None:
                        present.add(rank)
        if len(present) < world_size:
            return None

        async def read(rank: int) -> dict[str, Any]:
            raw = await backend.get(f"{prefix}{rank}.json")
            part: dict[str, Any] = json.loads(bytes(raw))
            part["_id"] = blake3.blake3(raw).hexdigest()
            return part

        return await _each(range(world_size), read)

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
        """Commit a save made with ``commit="none"`` once all its parts are in.

        Raises:
            InvalidRequestError: ``save_id`` or ``world_size`` is malformed or out of
                bounds, or ``extra`` would replace a field of chunkd's.
            CheckpointExistsError: another save committed the name meanwhile.
            CheckpointError: the parts did not all come within the part timeout.
        """
        backend_name, path = checkpoint_name(name)
        check_save_id(save_id)
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise InvalidRequestError(
                f"world_size must be from 1 to {MAX_WORLD_SIZE}; got {world_size}"
            )
        clash = sorted(set(extra) & _MANIFEST_KEYS)
        if clash:
            raise InvalidRequestError(
                f"the extra manifest fields of a commit must not replace chunkd's own; "
                f"{clash[:5]} are chunkd's"
            )
        backend = self.backends.get(backend_name)
        backend.check_writable()
        return await self._commit(
            None, backend, world_size, overwrite, extra, path=path, save_id=save_id
        )

    # -- waiting --------------------------------------------------------------------

    async def wait(
        self,
        job_id: str,
        level: Durability,
        seconds: float,
        *,
        asked: SaveRequest | None = None,
    ) -> SaveJob:
        """Wait up to ``seconds`` for ``job_id`` to reach ``level`` or fail.

        A job this daemon does not know (it restarted before the job was journaled,
        or after the job ended, or forgot it an hour after it ended) is looked up by
        what the client says it saved (``asked``: its name, save id, rank, world size
        and commit mode): see :meth:`_after_restart`.

        Raises:
            CheckpointError: the job is unknown and the client did not say which save
                it was.
        """
        job = self._jobs.get(job_id)
        if job is None:
            if asked is None:
                raise CheckpointError(
                    f"this daemon knows no save job {job_id!r} (it restarted or forgot the "
                    "job), and the request does not say which save it was; ask with its "
                    "name, save_id and rank (a chunkd client of this version does)"
                )
            return await self._after_restart(job_id, asked, level, seconds)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                while job.level < level and job.error is None:
                    await job.changed.wait()
        return job

    async def _after_restart(
        self, job_id: str, asked: SaveRequest, level: Durability, seconds: float
    ) -> SaveJob:
        """What became of a save whose job this daemon does not know.

        In order: a failure recorded here before a restart; a manifest with the save's
        id (committed: remote); the rank's part (for a ``commit="none"`` save, remote;
        else durable, and a rank other than 0 waits for rank 0's commit); nothing (the
        save was lost, or committed and deleted since).
        """
        job = SaveJob(id=job_id, request=asked)
        failure = None
        if _SAVE_ID_RE.fullmatch(job_id):  # a file name: nothing else may be in it
            failure = await asyncio.to_thread(self._recorded_failure, job_id)
        if failure is not None:
            job.fail(failure)
            return job
        backend = self.backends.get(asked.backend)
        deadline = time.monotonic() + seconds
        delay = 0.05
        while True:
            try:
                await self._find_in_backend(job, backend)
            except BackendUnavailableError as exc:  # not known yet: the client asks again
                job.state = f"the daemon restarted; looking for this save in the backend: {exc}"
            left = deadline - time.monotonic()
            if job.error is not None or job.level >= level or left <= 0:
                return job
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, self.poll_interval)

    async def _find_in_backend(self, job: SaveJob, backend: Backend) -> None:
        """Set ``job``'s level, state or error from what ``backend`` holds of its save."""
        request = job.request
        what = f"save {request.save_id} of checkpoint {request.name} (rank {request.rank})"
        doc: dict[str, Any] | None = None
        try:
            raw = await backend.get(request.prefix + MANIFEST)
            doc = json.loads(bytes(raw))
        except ObjectNotFoundError:
            pass
        except ValueError:
            doc = None  # torn: no checkpoint
        if not isinstance(doc, dict):
            doc = None
        if doc is not None and doc.get("save_id") == request.save_id:
            job.manifest_id = blake3.blake3(raw).hexdigest()
            job.finished = time.time()
            job.reach(Durability.REMOTE, "done")
        try:
            part_raw = await backend.get(request.part_key)
            part = json.loads(bytes(part_raw))
            job.logical, job.new = int(part["logical_bytes"]), int(part["new_bytes"])
        except ObjectNotFoundError:
            part = None
        except (ValueError, KeyError, TypeError):
            part = {}  # there, but unreadable
        if job.level >= Durability.REMOTE:
            return
        other = f" ({doc.get('save_id')!s:.64})" if doc is not None else ""
        if part is None:
            there = f"; the manifest there is another save's{other}" if doc is not None else ""
            job.fail(
                CheckpointError(
                    f"{what}: this daemon does not know it (it restarted or forgot the job), "
                    f"and backend {backend.name!r} holds neither its part nor a manifest "
                    f"with its save id{there}: the save was lost before it was durable on "
                    "this node's disk, or it was committed and deleted since; save again if "
                    "you need it"
                )
            )
        elif request.commit == "none":
            job.manifest_id = blake3.blake3(part_raw).hexdigest()
            job.finished = time.time()
            job.reach(Durability.REMOTE, "done")
        elif doc is not None:
            job.fail(
                CheckpointExistsError(
                    f"{what}: its part is in backend {backend.name!r}, but checkpoint "
                    f"{request.name} was committed by another save{other}; this one was not"
                )
            )
        elif request.rank == 0:
            job.fail(
                CheckpointError(
                    f"{what}: its part is in backend {backend.name!r}, but the daemon "
                    "restarted before it committed the checkpoint, and nothing will commit "
                    "it now; the name is free: save again"
                )
            )
        elif time.time() - float(part.get("created", 0) or 0) > self.part_timeout:
            job.fail(
                CheckpointError(
                    f"{what}: its part is in backend {backend.name!r}, but rank 0 did not "
                    f"commit the checkpoint within {self.part_timeout:g}s"
                )
            )
        else:
            job.reach(Durability.LOCAL, "part in the backend; waiting for rank 0 to commit")

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

        async def fetch() -> tuple[str, memoryview]:
            if self.peers is not None and not local:
                shared = await self.peers.fetch_chunk(backend_name, cid)  # verified
                if shared is not None:
                    await self.cache.put(Chunk.trusted(cid, shared))
                    return "peer", shared
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
            await self.cache.put(Chunk.trusted(cid, raw))
            return "backend", raw

        # Every reader of one fetch counts its bytes under the fetch's source: each
        # of this node's readers got them from there. The fetch's bytes go to every
        # one of them, so a chunk no tier kept (RAM full of pinned chunks, a disk that
        # declines) is still served once fetched, and never fetched again for them.
        source, fetched = await self._fetches.run((backend_name, cid), fetch)
        lease = await self.cache.find(cid)
        if lease is None:
            lease = BytesLease(cid, fetched)
        if not local:
            self.metrics.ckpt_restored_bytes.labels(source).inc(lease.size)
        return lease

    # -- listing, deleting, GC -------------------------------------------------------

    async def entries_page(
        self,
        prefix: str,
        *,
        start_after: str | None = None,
        limit: int = 1000,
        max_bytes: int = 1 << 20,
    ) -> tuple[list[dict[str, Any]], str | None]:
        """One page of the checkpoints under ``BACKEND[/PREFIX]``: committed ones, and
        saves in flight on this node, in the order of their manifest keys.

        Returns the entries and the page token (None on the last page): the key after
        which the next page starts. A page holds at most ``limit`` entries whose JSON
        takes at most ``max_bytes``, and looks at no more than
        :data:`_PAGE_SCAN_KEYS` backend keys, so it may hold fewer entries (even none)
        before the last page. The listing is the backend's own, never a cached one.
        """
        backend, path = self._listed(prefix)
        base = f"{CHECKPOINTS}{path}" if path else CHECKPOINTS.rstrip("/")
        after = start_after or ""
        pending = sorted(
            (k, e) for k, e in self._in_flight(backend.name, path).items() if k > after
        )
        page: list[dict[str, Any]] = []
        used = 2  # the brackets of the JSON array
        last: str | None = None  # the key of the last entry in the page

        def add(key: str, entry: dict[str, Any]) -> bool:
            """Put ``entry`` in the page; False (and nothing added) when it is full."""
            nonlocal used, last
            size = len(json.dumps(entry)) + 2
            if len(page) >= limit or used + size > max_bytes:
                return False
            page.append(entry)
            used += size
            last = key
            return True

        def flush(upto: str | None, *, inclusive: bool = False) -> bool:
            """Add the saves in flight before key ``upto`` (or at it, or all: None);
            False when the page is full."""
            while pending and (
                upto is None or pending[0][0] < upto or (inclusive and pending[0][0] == upto)
            ):
                if not add(*pending[0]):
                    return False
                pending.pop(0)
            return True

        scanned = 0
        async with contextlib.aclosing(backend.scan(base, start_after=start_after)) as batches:
            async for batch in batches:
                manifests = [m for m in batch if m.key.endswith("/" + MANIFEST)]
                for start in range(0, len(manifests), _SUMMARIES_AT_ONCE):
                    group = manifests[start : start + _SUMMARIES_AT_ONCE]
                    summaries = await _each(group, functools.partial(self._summary, backend))
                    for meta, summary in zip(group, summaries, strict=True):
                        if not flush(meta.key):
                            return page, last
                        if pending and pending[0][0] == meta.key and summary is not None:
                            pending.pop(0)  # committed: the manifest says more
                        if summary is not None and not add(meta.key, summary):
                            return page, last
                scanned += len(batch)
                if scanned >= _PAGE_SCAN_KEYS:
                    end = batch[-1].key  # enough work for one request: the rest next time
                    return page, end if flush(end, inclusive=True) else last
        if not flush(None):
            return page, last
        return page, None

    async def entries(self, prefix: str) -> list[dict[str, Any]]:
        """Every checkpoint under ``BACKEND[/PREFIX]`` (:meth:`entries_page`, page by page)."""
        out: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            page, token = await self.entries_page(prefix, start_after=token)
            out += page
            if token is None:
                return out

    def _listed(self, prefix: str) -> tuple[Backend, str]:
        backend_name, path = split_prefix(prefix)
        return self.backends.get(backend_name), path

    def _in_flight(self, backend: str, path: str) -> dict[str, dict[str, Any]]:
        """Saves in flight here under ``path`` (whole components), by manifest key."""
        out: dict[str, dict[str, Any]] = {}
        for job in sorted(self._jobs.values(), key=lambda j: j.started):
            request = job.request
            if (
                request.backend == backend
                and (not path or f"{request.path}/".startswith(f"{path}/"))
                and job.state != "done"
            ):
                out[request.prefix + MANIFEST] = {  # the newest save of a name wins
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
        return out

    async def _summary(self, backend: Backend, meta: ObjectMeta) -> dict[str, Any] | None:
        """The listing entry of the manifest ``meta``; None if it is gone or torn."""
        try:
            doc = json.loads(bytes(await backend.get(meta.key)))
            return _summary(backend.name, meta.key, doc, meta)
        except (ObjectNotFoundError, ValueError, KeyError, TypeError):
            return None  # deleted meanwhile, or torn: not a checkpoint

    async def _committed(self, backend: Backend, path: str) -> AsyncGenerator[dict[str, Any], None]:
        """The committed checkpoints under ``path``, in key order, straight from the backend."""
        base = f"{CHECKPOINTS}{path}" if path else CHECKPOINTS.rstrip("/")
        async with contextlib.aclosing(backend.scan(base)) as batches:
            async for batch in batches:
                manifests = [m for m in batch if m.key.endswith("/" + MANIFEST)]
                for summary in await _each(manifests, functools.partial(self._summary, backend)):
                    if summary is not None:
                        yield summary

    async def delete(self, name: str, *, save_id: str | None = None) -> int:
        """Delete checkpoint ``name``: its manifest first, then the parts it names.

        Returns the objects removed. Its chunks stay until ``chunkd gc`` finds them
        unreferenced; parts of other saves under the same name are left alone.
        ``save_id``: delete only the checkpoint that save committed (retention, which
        decided on a listing: a save may have committed another one there since).

        Raises:
            CheckpointNotFoundError: no checkpoint of that name (or of that save).
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
            doc, parts = {}, []  # a torn manifest: no checkpoint, but remove it
        if save_id is not None and doc.get("save_id") != save_id:
            raise CheckpointNotFoundError(
                f"checkpoint {name} was committed again (save {doc.get('save_id')!r}) after it "
                "was listed for retention; it is kept"
            )
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
        ``grace`` seconds.

        Safe against saves running meanwhile, by protocol: the collection's barrier
        (``gc/<run>.json``) is up from before it reads the intents until after its last
        delete, and a save looks for barriers after its intent is written and before
        it looks up any chunk (docs/checkpoints.md). The barrier is removed however
        the collection ends, a cancel included. Every listing is the backend's own,
        one batch at a time; only the set of referenced chunks is held whole.
        """
        backend, path = self._listed(target)
        backend.check_writable()
        barrier = None if dry_run else _Barrier(backend, target)  # refuses before any work
        report: dict[str, Any] = {"target": target, "dry_run": dry_run, "retired": []}
        if keep_last is not None:
            listed = [e async for e in self._committed(backend, path)]
            listed.sort(key=lambda e: (e["step"] if e["step"] is not None else -1, e["created"]))
            doomed = listed[: max(0, len(listed) - keep_last)]
            gone: list[str] = []

            async def retire(entry: dict[str, Any]) -> None:
                # Only the checkpoint that was listed: one committed at the name since
                # is kept, and its chunks are marked below like any other's.
                with contextlib.suppress(CheckpointNotFoundError):  # or deleted meanwhile
                    await self.delete(entry["name"], save_id=entry.get("save_id"))
                    gone.append(entry["name"])

            if dry_run:
                gone = [e["name"] for e in doomed]
            else:
                await _each(doomed, retire)
            report["retired"] = sorted(gone)
        report["retired_count"] = len(report["retired"])
        now = time.time()
        # A dry run marks as if the retired checkpoints were gone already.
        retired = {f"{CHECKPOINTS}{n.partition('/')[2]}/{MANIFEST}" for n in report["retired"]}
        live, stale = await self._mark(backend, retired, stale_before=now - pending_ttl)
        report["stale_parts"] = len(stale)
        if not dry_run:
            await _each(stale, backend.delete)
        try:
            if barrier is not None:
                await barrier.write()  # before the intents are read: the protocol's pivot
            expire = None if dry_run else intent_ttl
            live |= await self._intent_chunks(backend, expire_after=expire, barrier=barrier)
            report |= await self._sweep(backend, live, now - grace, barrier)
        finally:
            if barrier is not None:
                await self._drop_barrier(barrier)
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
                manifests = [m for m in batch if m.key.endswith("/" + MANIFEST)]
                named = await _each(
                    [m.key for m in manifests], functools.partial(self._manifest_parts, backend)
                )
                to_read: list[str] = []
                for meta, keys in zip(manifests, named, strict=True):
                    committed.update(keys)
                    if meta.key not in retired:
                        to_read += keys
                for meta in batch:
                    if not _PART_RE.search(meta.key) or meta.key in committed:
                        continue
                    if meta.modified < stale_before:
                        old.append(meta.key)
                    else:
                        to_read.append(meta.key)  # a save in flight
                for chunks in await _each(to_read, functools.partial(self._part_chunks, backend)):
                    live |= chunks
        return live, [k for k in old if k not in committed]

    async def _manifest_parts(self, backend: Backend, key: str) -> list[str]:
        """The part keys the manifest at ``key`` names (none if it is gone or torn)."""
        try:
            doc = json.loads(bytes(await backend.get(key)))
            return [str(p["key"]) for p in doc["parts"]]
        except (ObjectNotFoundError, ValueError, KeyError, TypeError):
            return []

    async def _sweep(
        self, backend: Backend, live: set[str], doomed_before: float, barrier: _Barrier | None
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
                            live |= await self._intent_chunks(
                                backend, expire_after=None, barrier=barrier
                            )
                        kept = [m for m in group if m.key[len(CHUNKS) :] in live]
                        counts["referenced"] += len(kept)
                        group = [m for m in group if m.key[len(CHUNKS) :] not in live]
                        with barrier.sending():
                            await _each([m.key for m in group], backend.delete)
                    counts["swept"] += len(group)
                    counts["freed_bytes"] += sum(m.size for m in group)
                if barrier is not None:
                    await barrier.keep_fresh()
        return counts

    async def _drop_barrier(self, barrier: _Barrier) -> None:
        """Remove a collection's barrier, however the collection ended.

        The delete runs as a task of its own, so a collection cancelled (its client
        went away) still removes its barrier. If the collection ended with a request
        of its own maybe still on its way (a delete cancelled or failed mid-flight),
        the barrier stays until that request is surely over (its bound), in the
        background: a save must not look for a chunk that delete may yet remove. If
        even the removal fails, saves take the barrier for abandoned once it has not
        changed for its expiry.
        """
        delay = barrier.request_bound if barrier.unsettled else 0.0

        async def remove() -> None:
            await asyncio.sleep(delay)
            try:
                await barrier.backend.delete(barrier.key)
            except ChunkdError as exc:
                log.warning(
                    "gc: could not remove barrier %s/%s (%s); saves pass it once it has "
                    "been unchanged for %.0fs",
                    barrier.backend.name,
                    barrier.key,
                    exc,
                    barrier.expiry,
                )

        removal = asyncio.ensure_future(remove())
        self._tasks.add(removal)
        removal.add_done_callback(self._tasks.discard)
        if not delay:
            await asyncio.shield(removal)

    async def _part_chunks(self, backend: Backend, key: str) -> set[str]:
        """The chunk ids a part names (none if it is gone or unreadable)."""
        try:
            part = json.loads(bytes(await backend.get(key)))
            return {str(c) for seg in part["segments"] for c, _ in seg["chunks"]}
        except (ObjectNotFoundError, ValueError, KeyError, TypeError):
            return set()

    async def _intent_chunks(
        self, backend: Backend, *, expire_after: float | None, barrier: _Barrier | None = None
    ) -> set[str]:
        """Chunk ids named by intents; intents older than ``expire_after`` are deleted.

        ``barrier`` is kept fresh meanwhile (there may be many intents to read).
        """
        keep: set[str] = set()
        now = time.time()

        async def read(key: str) -> list[Any]:
            try:
                chunks = json.loads(bytes(await backend.get(key)))["chunks"]
            except (ObjectNotFoundError, ValueError, KeyError, TypeError):
                return []
            return chunks if isinstance(chunks, list) else []

        async with contextlib.aclosing(backend.scan(INTENTS.rstrip("/"))) as batches:
            async for batch in batches:
                expired = [
                    m.key
                    for m in batch
                    if expire_after is not None and now - m.modified > expire_after
                ]
                await _each(expired, backend.delete)  # their saves committed or died long ago
                gone = set(expired)
                for chunks in await _each([m.key for m in batch if m.key not in gone], read):
                    keep.update(str(c) for c in chunks)
                if barrier is not None:
                    await barrier.keep_fresh()
        return keep

    def stats(self) -> dict[str, Any]:
        """Jobs in flight, for /v1/stats."""
        return {
            "jobs": [j.describe() for j in self._jobs.values() if j.state != "done"],
            "pinned_chunks": self.cache.disk.pinned,
        }


async def _never() -> bool:  # pragma: no cover - only run() on a key already running
    raise AssertionError("unreachable")


async def _each(items: Iterable[A], fn: Callable[[A], Awaitable[T]]) -> list[T]:
    """``[await fn(i) for i in items]``, a few at a time; the first failure stops the rest."""
    slots = asyncio.Semaphore(_READS_AT_ONCE)

    async def one(item: A) -> T:
        async with slots:
            return await fn(item)

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(one(item)) for item in items]
    return [task.result() for task in tasks]


def _part_rank(name: str, world_size: int) -> int | None:
    """The rank of part file ``name`` (``"<rank>.json"``) if it is below ``world_size``."""
    digits = name.removesuffix(".json")
    if digits == name or not digits.isdigit() or not digits.isascii() or len(digits) > 6:
        return None
    if digits != "0" and digits.startswith("0"):
        return None
    rank = int(digits)
    return rank if rank < world_size else None


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
        "save_id": doc.get("save_id"),
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
