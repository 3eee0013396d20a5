"""Pinned reads: a snapshot's member through the read path, at its recorded version only.

A member is read at the version token the registration recorded. If the source
object changed or vanished since, the read fails with a
:class:`~chunkd.errors.SnapshotDriftError` that names the member (``BACKEND/KEY``); it is
never read at its new contents. Chunks the cache holds for the recorded version
(its locators name the version) are served from the cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Iterator
from typing import TYPE_CHECKING

from chunkd.errors import ObjectNotFoundError, SnapshotDriftError, VersionChangedError

if TYPE_CHECKING:
    from chunkd.cache import ChunkLease
    from chunkd.gateway.readpath import ReadPath, Stat
    from chunkd.snapshot import Snapshot

__all__ = ["drifted", "first_failure", "member_leases", "pinned_stat"]


def drifted(snapshot: Snapshot, index: int, what: str) -> SnapshotDriftError:
    """The error for member ``index`` of ``snapshot``, which ``what`` ("changed")."""
    member = snapshot.members[index]
    return SnapshotDriftError(
        f"member {snapshot.name_of(index)} of snapshot {snapshot.id} {what} since it was "
        f"registered (at version {member.version}, {member.size} bytes); it is not read at "
        "other contents: register the dataset again, or freeze snapshots to keep them"
    )


async def pinned_stat(read_path: ReadPath, snapshot: Snapshot, index: int) -> Stat:
    """The read path's version of member ``index``, if it is the recorded one.

    Raises:
        SnapshotDriftError: the object is gone, or is another version now.
        UnknownBackendError, BackendUnavailableError, BackendForbiddenError
    """
    member = snapshot.members[index]
    try:
        stat = await read_path.stat(snapshot.backend, member.key)
    except ObjectNotFoundError:
        raise drifted(snapshot, index, "is gone from its backend") from None
    if stat.meta.version != member.version or stat.size != member.size:
        raise drifted(
            snapshot,
            index,
            f"changed (it is version {stat.meta.version} now, {stat.size} bytes)",
        )
    return stat


async def member_leases(
    read_path: ReadPath, snapshot: Snapshot, index: int, *, reader: bool = True
) -> AsyncGenerator[tuple[int, Stat, ChunkLease], None]:
    """``(chunk index, stat, lease)`` for each chunk of member ``index``, in order, at
    its recorded version. The caller releases each lease. ``reader=False``: the
    daemon's own copy (a freeze), not a reader's request in the cost ledger
    (:meth:`ReadPath.leases`).

    Raises:
        SnapshotDriftError: the member changed or vanished (before or during the read).
    """
    stat = await pinned_stat(read_path, snapshot, index)
    if not stat.size:
        return
    leases = read_path.leases(stat, 0, stat.chunks - 1, reader=reader)
    chunk = 0
    try:
        while True:
            try:
                lease = await anext(leases)
            except StopAsyncIteration:
                return
            except VersionChangedError:
                raise drifted(snapshot, index, "changed while it was read") from None
            except ObjectNotFoundError:
                raise drifted(snapshot, index, "vanished while it was read") from None
            yield chunk, stat, lease
            chunk += 1
    finally:
        await leases.aclose()


@contextlib.contextmanager
def first_failure() -> Iterator[None]:
    """Around members read or copied at once (a task group, :func:`~chunkd.gateway.
    checkpoints.jobs.each`): their first failure raised as itself, not inside an
    ``ExceptionGroup``, so that the client is answered by its class and message."""
    try:
        yield
    except BaseExceptionGroup as group:
        first: BaseException = group
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
