"""Saving: a state dict staged and handed to the daemon, the handle that waits for its
durability, and the commit of a save whose ranks commit on their own.

The daemon's side of a save (chunk, write, upload, commit) is the commit protocol in
:mod:`chunkd.gateway.checkpoints.save`.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Final

from chunkd.client.checkpoint.cudastaging import is_cuda
from chunkd.client.checkpoint.encode import Encoder
from chunkd.client.checkpoint.process import client_or_default, distributed
from chunkd.client.checkpoint.staging import SPARE, plan, sealed_json, stage
from chunkd.client.core import Client
from chunkd.client.protocol import DURABILITY_LEVELS
from chunkd.errors import UnsupportedStateError

#: a commit waits in the daemon until every rank's part is in the backend
_COMMIT_TIMEOUT: Final = 3600.0


@dataclass(frozen=True)
class SaveResult:
    """What a finished save reports (for this rank's part)."""

    name: str
    #: blake3 of the committed manifest (of this rank's part for commit="none" saves)
    manifest_id: str | None
    #: the durability reached: "staged", "local", "replicated" or "remote"
    durability: str | None
    #: bytes of tensors and arrays staged by this rank
    logical_bytes: int
    #: bytes this rank's save uploaded (chunks the backend did not have yet)
    new_bytes: int
    #: bytes that were already in the backend (other ranks, earlier steps)
    dedup_bytes: int
    #: what became of this part's replicas in peers' RAM (docs/replicas.md):
    #: ``wanted``, ``chunks``, ``whole`` (chunks with ``wanted`` copies), ``fewest``,
    #: ``outcome`` (full, partial, none), ``targets``; None: none were asked for
    replicas: dict[str, Any] | None = None


class SaveHandle:
    """A save in progress in the daemon. :func:`save` returns one that is done."""

    def __init__(self, client: Client, name: str, job: dict[str, Any], durability: str) -> None:
        self.name = name
        self.job_id = str(job["job"])
        self.durability = durability
        self.save_id = str(job["save_id"])
        #: which save this is: a daemon that restarted (and so forgot the job) looks
        #: for it in the backend by these
        self._save: dict[str, Any] = {
            "name": name,
            "save_id": self.save_id,
            "rank": int(job.get("rank", 0)),
            "world_size": int(job.get("world_size", 1)),
            "commit": str(job.get("commit") or "auto"),
        }
        self._client = client
        self._last = job
        self._done = False

    def __repr__(self) -> str:
        replicas = self.replicas
        shown = f" replicas {replicas.get('outcome')}" if replicas else ""
        return f"<SaveHandle {self.name} {self._last.get('state')}{shown}>"

    @property
    def replicas(self) -> dict[str, Any] | None:
        """What became of this part's replicas, as the daemon last said (None: not
        pushed yet, or none asked for): ``wanted``, ``chunks``, ``whole`` (chunks with
        ``wanted`` copies), ``fewest``, ``outcome`` (full, partial or none: fewer
        peers would take them), ``targets``."""
        found = self._last.get("replicas")
        return dict(found) if isinstance(found, dict) else None

    def wait(self, timeout: float | None = None, *, level: str | None = None) -> bool:
        """Wait until the save reached its durability (or ``level``); False on timeout.

        Raises:
            CheckpointError, BackendForbiddenError, ...: the save failed.
        """
        wanted = level or self.durability
        if wanted not in DURABILITY_LEVELS:
            raise ValueError(f"level must be one of {DURABILITY_LEVELS}; got {wanted!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 10.0 if deadline is None else max(0.0, deadline - time.monotonic())
            fields = {"job": self.job_id, "level": wanted, "timeout": min(left, 10)} | self._save
            with self._client.request(
                "ckpt_wait", fields, what=f"waiting for checkpoint {self.name}"
            ) as answer:
                reply = answer.header
            self._last = reply
            reached = reply.get("durability")
            level_of = DURABILITY_LEVELS.index
            # "met": the daemon says the level is reached (a save without replicas
            # meets "replicated" at "local"); an older daemon sends none.
            met = reply.get("met") is True
            if met or (reached is not None and level_of(reached) >= level_of(wanted)):
                self._done = (met and wanted == self.durability) or (
                    reached is not None and level_of(reached) >= level_of(self.durability)
                )
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def done(self) -> bool:
        """Whether the save reached its durability (asks the daemon without waiting)."""
        return self._done or self.wait(0)

    def result(self, timeout: float | None = None) -> SaveResult:
        """Wait for the save and report it.

        Raises:
            TimeoutError: it did not finish within ``timeout`` seconds.
        """
        if not self.wait(timeout):
            raise TimeoutError(f"checkpoint {self.name} did not reach {self.durability} in time")
        job = self._last
        return SaveResult(
            name=self.name,
            manifest_id=job.get("manifest_id"),
            durability=job.get("durability"),
            logical_bytes=int(job.get("logical_bytes", 0)),
            new_bytes=int(job.get("new_bytes", 0)),
            dedup_bytes=int(job.get("dedup_bytes", 0)),
            replicas=self.replicas,
        )


def async_save(
    state_dict: Any,
    name: str,
    *,
    durability: str = "remote",
    overwrite: bool = False,
    step: int | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    save_id: str | None = None,
    replicas: int | None = None,
    client: Client | None = None,
    _commit: str = "auto",
) -> SaveHandle:
    """Stage ``state_dict`` into shared memory and hand it to the daemon; return at once.

    The tensors may change as soon as this returns. ``name`` is ``BACKEND/PATH`` on a
    writable backend.

    Under ``torch.distributed`` (and without an explicit ``world_size``) the save is
    collective, as in DCP: every rank calls it with its own part, the ranks agree on
    a save id and check that each can encode its state before any of them stages
    (one ``all_gather_object``), and rank 0 commits once every part is durable. To
    save from one rank only, pass ``world_size=1``. Without ``torch.distributed``,
    ``rank``, ``world_size`` and ``save_id`` (the same on every rank) say the same.

    ``replicas``: K peers in other failure domains whose RAM gets a copy of this
    part's chunks, in the background (``durability="replicated"`` waits for them;
    ``docs/replicas.md``); None: the daemon's ``[peers] replicas``.

    Raises:
        UnsupportedStateError: something in ``state_dict`` (or, in a collective
            save, in another rank's) cannot be saved; nothing was staged.
        CheckpointExistsError: ``name`` exists and ``overwrite`` is False.
        ReadOnlyBackendError, BackendForbiddenError, UnknownBackendError
    """
    if durability not in DURABILITY_LEVELS:
        raise ValueError(f"durability must be one of {DURABILITY_LEVELS}; got {durability!r}")
    encoder = Encoder()
    problem: UnsupportedStateError | None = None
    try:
        tree = encoder.encode(state_dict, "")
    except UnsupportedStateError as exc:
        problem = exc
    dist = distributed()
    if dist is not None and world_size is None:
        rank = dist[0] if rank is None else rank
        world_size = dist[1]
        everyone: list[Any] = [None] * world_size
        dist[2].all_gather_object(everyone, (str(problem or ""), save_id or uuid.uuid4().hex))
        others = [f"rank {r}: {e}" for r, (e, _) in enumerate(everyone) if e and r != dist[0]]
        if others and problem is None:
            raise UnsupportedStateError(
                "not saved: another rank cannot save its state (" + "; ".join(others) + ")"
            )
        save_id = str(everyone[0][1])
    if problem is not None:
        raise problem
    rank, world_size = rank or 0, world_size or 1
    if world_size > 1 and save_id is None:
        raise ValueError(
            "a save with world_size > 1 needs a save_id that every rank passes (or a "
            "torch.distributed process group, which agrees on one)"
        )
    save_id = save_id or uuid.uuid4().hex
    chunkd = client_or_default(client)
    chunk_bytes = chunkd.chunk_bytes
    segments, total = plan(encoder.blobs, chunk_bytes)
    data_fd = stage(encoder.blobs, segments, total)
    try:
        layout_fd = sealed_json({"segments": [[*s] for s in segments], "tree": tree})
        try:
            fields = {
                "name": name,
                "save_id": save_id,
                "rank": rank,
                "world_size": world_size,
                "durability": durability,
                "overwrite": overwrite,
                "commit": _commit,
                "step": step,
            }
            if replicas is not None:  # only then: an older daemon knows no such field
                fields["replicas"] = replicas
            with chunkd.request(
                "ckpt_save", fields, fds=[layout_fd, data_fd], what=f"saving {name}"
            ) as answer:
                reply = answer.header
        finally:
            os.close(layout_fd)
    finally:
        os.close(data_fd)
        # Only now: making the next save's memory ready takes a core for a while, and
        # must not slow the hand-off the trainer waits for.
        SPARE.prepare(total, pin=any(is_cuda(b.source) for b in encoder.blobs))
    return SaveHandle(chunkd, name, reply, durability)


def save(
    state_dict: Any,
    name: str,
    *,
    durability: str = "remote",
    overwrite: bool = False,
    timeout: float | None = None,
    **kwargs: Any,
) -> SaveHandle:
    """:func:`async_save`, then wait until the save is ``durability``-durable.

    Raises:
        TimeoutError: it was not durable within ``timeout`` seconds (it goes on).
        Whatever :func:`async_save` raises, and the error a failed save reports.
    """
    handle = async_save(state_dict, name, durability=durability, overwrite=overwrite, **kwargs)
    if not handle.wait(timeout):
        raise TimeoutError(f"checkpoint {name} was not {durability}-durable in {timeout}s")
    return handle


def commit(
    name: str,
    save_id: str,
    world_size: int,
    *,
    overwrite: bool = False,
    extra: dict[str, Any] | None = None,
    client: Client | None = None,
) -> str:
    """Commit a save made with ``_commit="none"`` once all its parts are in; its id.

    ``extra`` is merged into the manifest (``chunkd.client.dcp`` keeps DCP's
    metadata there).
    """
    fd = sealed_json(extra or {})
    try:
        answer = client_or_default(client).request(
            "ckpt_commit",
            {"name": name, "save_id": save_id, "world_size": world_size, "overwrite": overwrite},
            fds=[fd],
            timeout=_COMMIT_TIMEOUT,
            what=f"committing {name}",
        )
    finally:
        os.close(fd)
    answer.close()
    return str(answer.header["manifest_id"])
