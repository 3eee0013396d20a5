"""Waiting for a save: for a job this daemon runs, until it reaches a level; for one it
does not know (it restarted, or forgot the job), by what the backend holds of it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import TYPE_CHECKING, Any

import blake3

from chunkd.errors import (
    BackendUnavailableError,
    CheckpointError,
    CheckpointExistsError,
)
from chunkd.gateway.checkpoints.jobs import Jobs, polling
from chunkd.gateway.checkpoints.journal import Journal
from chunkd.gateway.checkpoints.model import (
    SAVE_ID_RE,
    Durability,
    SaveJob,
    SaveRequest,
)

if TYPE_CHECKING:
    from chunkd.gateway.backends import Backend, Backends

__all__ = ["Waiter"]


class Waiter:
    """Answers "how far is this save?".

    Args:
        backends: the configured backends.
        journal: the jobs' journal (failures recorded before a restart).
        jobs: the jobs this daemon knows.
        part_timeout: how long rank 0 has to commit once a part is in.
        poll_interval: the longest pause between two looks in the backend.
    """

    def __init__(
        self,
        backends: Backends,
        journal: Journal,
        jobs: Jobs,
        *,
        part_timeout: float,
        poll_interval: float,
    ) -> None:
        self.backends = backends
        self.journal = journal
        self.jobs = jobs
        self.part_timeout = part_timeout
        self.poll_interval = poll_interval

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
        job = self.jobs.get(job_id)
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
                while not job.meets(level) and job.error is None:
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
        if SAVE_ID_RE.fullmatch(job_id):  # a file name: nothing else may be in it
            failure = await asyncio.to_thread(self.journal.recorded_failure, job_id)
        if failure is not None:
            job.fail(failure)
            return job
        backend = self.backends.get(asked.backend)
        pauses = polling(self.poll_interval).delays(deadline=time.monotonic() + seconds)
        while True:
            try:
                await self._find_in_backend(job, backend)
            except BackendUnavailableError as exc:  # not known yet: the client asks again
                job.state = f"the daemon restarted; looking for this save in the backend: {exc}"
            if job.error is not None or job.meets(level):
                return job
            pause = next(pauses, None)  # cut to the time left; None once none is left
            if pause is None:
                return job
            await asyncio.sleep(pause)

    async def _find_in_backend(self, job: SaveJob, backend: Backend) -> None:
        """Set ``job``'s level, state or error from what ``backend`` holds of its save."""
        request = job.request
        what = f"save {request.save_id} of checkpoint {request.name} (rank {request.rank})"
        doc: dict[str, Any] | None = None
        raw = await backend.get(request.manifest_key)
        try:
            doc = None if raw is None else json.loads(bytes(raw))
        except ValueError:
            doc = None  # torn: no checkpoint
        if not isinstance(doc, dict):
            doc = None
        if raw is not None and doc is not None and doc.get("save_id") == request.save_id:
            job.manifest_id = blake3.blake3(raw).hexdigest()
            job.finished = time.time()
            job.reach(Durability.REMOTE, "done")
        part_raw = await backend.get(request.part_key)
        try:
            part = None if part_raw is None else json.loads(bytes(part_raw))
            if part is not None:
                job.logical, job.new = int(part["logical_bytes"]), int(part["new_bytes"])
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
            assert part_raw is not None  # part is not None
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
