"""The save jobs' journal on the node's disk: ``<cache dir>/checkpoints/jobs/<job>.json``
for a job that reached ``local`` (resumed when the daemon starts), ``failed/`` for the
ones set aside, with what went wrong."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import time
from pathlib import Path
from typing import Final

import chunkd.errors
from chunkd import faults
from chunkd.cache import ChunkId
from chunkd.errors import CheckpointError, ChunkdError
from chunkd.gateway.checkpoints.model import SaveJob, SaveRequest

__all__ = ["Journal", "syncfs", "write_durably"]

#: how long the failures of jobs are kept, for clients that wait after a restart
_FAILURES_KEPT: Final = 7 * 86400.0


class Journal:
    """The journals of the save jobs under ``root`` (``<cache dir>/checkpoints``)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.jobs_dir = self.root / "jobs"
        self.failed_dir = self.root / "failed"

    def make_dirs(self) -> None:
        """Create the directories; forget failures older than a week."""
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        self.failed_dir.mkdir(parents=True, exist_ok=True)
        old = time.time() - _FAILURES_KEPT
        for record in self.failed_dir.glob("*.error.json"):
            with contextlib.suppress(OSError):
                if record.stat().st_mtime < old:
                    record.unlink()

    def saved(self) -> list[Path]:
        """The journals on disk, oldest job id first."""
        return sorted(self.jobs_dir.glob("*.json"))

    def chunks(self) -> set[ChunkId]:
        """Every chunk id the readable journals name (an unreadable one is set aside
        when the jobs resume)."""
        named: set[ChunkId] = set()
        for path in self.saved():
            try:
                named.update(self.load(path).unique)
            except (OSError, ValueError, KeyError, TypeError, ChunkdError):
                continue
        return named

    def path(self, job: SaveJob) -> Path:
        """Where ``job``'s journal lies."""
        return self.jobs_dir / f"{job.id}.json"

    @staticmethod
    def load(path: Path) -> SaveJob:
        """The job a journal describes, its chunks hashed and on disk.

        Raises:
            OSError, ValueError, KeyError, TypeError, ChunkdError: it is unreadable.
        """
        doc = json.loads(path.read_bytes())
        request = SaveRequest.from_json(doc["request"])
        job = SaveJob(id=str(doc["job"]), request=request)
        job.chunks = [[(ChunkId.parse(c), int(n)) for c, n in seg] for seg in doc["chunks"]]
        job.logical = int(doc["logical"])
        return job

    def write(self, job: SaveJob) -> None:
        """Journal ``job`` durably (fsynced, and its directory too)."""
        faults.point("ckpt.journal")
        doc = {
            "job": job.id,
            "request": job.request.to_json(),
            "chunks": [[[str(cid), n] for cid, n in seg] for seg in job.chunks],
            "logical": job.logical,
        }
        write_durably(self.path(job), json.dumps(doc).encode())

    def remove(self, job: SaveJob) -> None:
        """Drop ``job``'s journal (it is over), if there is one."""
        faults.point("ckpt.cleanup")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(job))

    def set_aside(self, journal: Path, error: ChunkdError | None = None) -> None:
        """Move a job's journal to ``failed/``, with what went wrong: a client that
        waits for the job after a restart is told that, not that the save was lost."""
        with contextlib.suppress(OSError):
            os.replace(journal, self.failed_dir / journal.name)
        if error is not None:
            doc = {"error": type(error).__name__, "message": str(error), "failed": time.time()}
            with contextlib.suppress(OSError):
                write_durably(
                    self.failed_dir / f"{journal.stem}.error.json", json.dumps(doc).encode()
                )

    def recorded_failure(self, job_id: str) -> ChunkdError | None:
        """The failure :meth:`set_aside` recorded for ``job_id``, if any."""
        try:
            doc = json.loads((self.failed_dir / f"{job_id}.error.json").read_bytes())
            kind, message = str(doc["error"]), str(doc["message"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        cls = getattr(chunkd.errors, kind, None)
        if not (isinstance(cls, type) and issubclass(cls, ChunkdError)):
            cls = CheckpointError
        return cls(message)


def write_durably(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically, fsynced (file and directory)."""
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


def syncfs(path: Path) -> None:
    """syncfs(2) on the filesystem holding ``path``: one call flushes all its dirty data."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs of {path} failed: {os.strerror(err)}")
    finally:
        os.close(fd)
