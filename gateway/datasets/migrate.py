"""Migrating: a snapshot's members copied to another backend, verified, and registered as
a new version of the same dataset with the same logical contents.

For each member, in turn (:data:`_MEMBERS_AT_ONCE` tasks take the members one after
another, whatever their number, bounded by bytes in flight)::

    1. its bytes: from the frozen chunks when the snapshot is frozen (each chunk checked
       against its id), else through the read path at the recorded version (a member
       that drifted is a SnapshotDriftError naming it); their chunk ids are noted
    2. the destination key: PREFIX + the member's key below the snapshot's prefix.
       Every destination key is checked before anything is copied: a valid key, and
       none under a prefix chunkd keeps for itself (:mod:`chunkd.gateway.reserved`:
       ``chunks/``, ``checkpoints/``, ``intents/``, ``gc/``, the registry's), however
       it was reached (the destination prefix, or a member's own relative key), and
       wherever it lands: a destination backend whose place holds another backend's
       (``s3://b`` holds ``s3://b/team``) keeps the other's prefixes too. The checks
       run in a thread, not on the event loop (microseconds a member: seconds at a
       million members).
       An object there already whose chunks hash to the source's chunk ids is kept as
       it is (migrating twice is harmless; nothing is rewritten, so no version token
       changes); one with other bytes is never overwritten: the migration fails
       naming it
    3. PUT if absent (an object that appeared meanwhile is checked as in step 2),
       then HEAD (the new version token), then a GET pinned to that version,
       straight from the destination backend (never the cache): each chunk of what
       came back must hash to the source's chunk id (IntegrityError otherwise)
    4. the member again, with the destination key and version token, and the blake3
       of its whole bytes (``content``); the copy's ``origin`` is the source snapshot,
       so ``diff`` compares the two by content (chunkd.snapshot)

Then ``snapshot.with_source(backend, prefix, members)`` is committed as the next
version of the dataset's name. A destination on the source's backend whose prefix
lies inside the source's prefix, or holds it (the backend's root holds every
prefix), is refused before anything is copied: the copy could overwrite its own
source, or be listed with it by the next registration.

A member is held whole in memory while it is copied (the Backend interface puts
whole objects); :data:`BYTES_IN_FLIGHT` bounds how many bytes are held at once, and
a member larger than that is copied alone. A frozen member's chunk is read only when
its object is no larger than the frozen record's chunk size (a larger one is damaged,
unread).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Final

import blake3

from chunkd.cache import ChunkId
from chunkd.errors import (
    ChunkNotFoundError,
    DatasetError,
    IntegrityError,
    InvalidRequestError,
    ReadOnlyBackendError,
)
from chunkd.gateway.checkpoints.model import CHUNKS
from chunkd.gateway.chunkstore import ByteBudget
from chunkd.gateway.datasets.pinned import first_failure, member_leases
from chunkd.gateway.names import split_prefix, validate_key
from chunkd.gateway.reserved import ReservedPrefixes
from chunkd.snapshot import Member, Snapshot

if TYPE_CHECKING:
    from chunkd.gateway.backends import Backend, Backends
    from chunkd.gateway.datasets.registry import Registry
    from chunkd.gateway.readpath import ReadPath

__all__ = ["BYTES_IN_FLIGHT", "Migrator"]

log = logging.getLogger(__name__)

#: member bytes held at once by one migration (a larger member is copied alone)
BYTES_IN_FLIGHT: Final = 512 << 20
#: members copied at once
_MEMBERS_AT_ONCE: Final = 8


class Migrator:
    """Copies snapshots to other backends and registers the copies.

    Args:
        registry: the dataset registry (the copy is committed there).
        read_path: the daemon's read path (members are read through it, pinned).
        backends: the configured backends (the destination among them).
    """

    def __init__(self, registry: Registry, read_path: ReadPath, backends: Backends) -> None:
        self.registry = registry
        self.read_path = read_path
        self.backends = backends
        # Where every backend lies: a backend inside another's place keeps the other's
        # reserved prefixes too (``raw = s3://b`` holds ``ckpt = s3://b/team``'s chunks).
        self.reserved = ReservedPrefixes(registry.registry, (b.config for b in backends))

    def destination(self, to: str) -> tuple[Backend, str]:
        """The destination backend (writable) and prefix of ``to`` (``BACKEND/PREFIX``).

        Raises:
            UnknownBackendError, InvalidKeyError, ReadOnlyBackendError
        """
        name, prefix = split_prefix(to)
        backend = self.backends.get(name)
        if not backend.supports_writes:
            raise ReadOnlyBackendError(
                f"cannot migrate to {to}: backend {name!r} is read-only; set writable = true "
                "in its [[backends]] entry, or migrate to a writable backend"
            )
        return backend, prefix

    async def copy(
        self, snapshot: Snapshot, to: str, frozen: dict[str, Any] | None
    ) -> tuple[Snapshot, dict[str, int]]:
        """Copy ``snapshot``'s members to ``to`` and verify them (steps 1-4 above).

        Returns the snapshot of the copy (not committed yet) and what was done.

        Raises:
            ReadOnlyBackendError, ReservedKeyError, InvalidKeyError, SnapshotDriftError,
            IntegrityError, ChunkNotFoundError
        """
        dest, prefix = self.destination(to)
        if dest.name == snapshot.backend:
            source = snapshot.prefix.strip("/")
            if prefix == source:
                raise InvalidRequestError(
                    f"snapshot {snapshot.id} is at {to} already; migrate it to another place"
                )
            if _nested(source, prefix):
                raise InvalidRequestError(
                    f"cannot migrate snapshot {snapshot.id} to {to}: its source "
                    f"{snapshot.backend}/{source} and the destination are one inside the other "
                    "(the copy could overwrite its own source, or be registered with it); "
                    "migrate to a prefix outside the source's"
                )
        # The copy's prefix names a folder, as a registration's does ("" only for the
        # backend's root), so each member's key below it is the same as below the
        # source's (a source at its backend's root included): diff shows no change.
        new_prefix = f"{prefix}/" if prefix else ""
        if new_prefix:
            self.reserved.check(dest.name, new_prefix, door="ds_migrate")
        # Every final key, checked before anything is copied: in a thread, as the
        # checks cost microseconds a member, seconds at a million members.
        keys = await asyncio.to_thread(self._destination_keys, dest.name, new_prefix, snapshot)
        budget = ByteBudget(BYTES_IN_FLIGHT)
        counts = {"members": len(snapshot.members), "bytes": 0, "copied": 0, "kept": 0}
        copied: dict[int, Member] = {}
        indexes = iter(range(len(snapshot.members)))

        async def copier() -> None:
            # A few copiers take the members in turn: the tasks in flight are
            # _MEMBERS_AT_ONCE, whatever the number of members.
            for index in indexes:
                size = snapshot.members[index].size
                await budget.take(size)
                try:
                    copied[index] = await self._copy_member(
                        snapshot, index, dest, keys[index], frozen, counts
                    )
                finally:
                    await budget.give(size)

        with first_failure():
            async with asyncio.TaskGroup() as group:
                for _ in range(min(_MEMBERS_AT_ONCE, len(snapshot.members))):
                    group.create_task(copier())
        members = [copied[i] for i in range(len(snapshot.members))]
        copy = await asyncio.to_thread(snapshot.with_source, dest.name, new_prefix, members)
        return copy, counts

    def _destination_keys(self, dest: str, prefix: str, snapshot: Snapshot) -> list[str]:
        """Every member's final key in backend ``dest`` below ``prefix``, each a valid
        key outside the reserved prefixes (run in a thread).

        Raises:
            InvalidKeyError, ReservedKeyError: the first member whose key is not.
        """
        check = self.reserved.check
        return [
            check(dest, validate_key(_dest_key(prefix, snapshot, m)), door="ds_migrate")
            for m in snapshot.members
        ]

    async def _copy_member(
        self,
        snapshot: Snapshot,
        index: int,
        dest: Backend,
        key: str,
        frozen: dict[str, Any] | None,
        counts: dict[str, int],
    ) -> Member:
        member = snapshot.members[index]
        if frozen is not None:
            chunk_bytes = int(frozen["chunk_bytes"])
            ids = [ChunkId.parse(c) for c in frozen["members"][index]]
            data = await self._from_chunks(snapshot, index, ids, chunk_bytes)
        else:
            chunk_bytes = self.read_path.chunk_bytes
            ids, data = [], bytearray()
            async for _, _, lease in member_leases(self.read_path, snapshot, index):
                with lease:
                    ids.append(lease.id)
                    data += lease.view()
        # The hash of the member's whole bytes, as read at its recorded version (or from
        # its verified chunks): the copy's content, and its origin's (chunkd.snapshot).
        digest = await asyncio.to_thread(_content_of, data)
        if member.content is not None and member.content != digest:
            raise IntegrityError(
                f"member {snapshot.name_of(index)} of snapshot {snapshot.id} read as other "
                f"bytes than its recorded content {member.content}; nothing was registered"
            )
        name = f"{dest.name}/{key}"
        there = await dest.head(key)
        if there is None and await dest.put(key, memoryview(data), if_absent=True):
            there = await dest.head(key)
            if there is None:
                raise IntegrityError(f"{name} is gone right after it was written; migrate again")
            await self._matches(dest, there, ids, chunk_bytes, name, strict=True)
            counts["copied"] += 1
        else:
            if there is None:  # written by someone else since the HEAD
                there = await dest.head(key)
            if (
                there is None
                or there.size != member.size
                or not await self._matches(dest, there, ids, chunk_bytes, name, strict=False)
            ):
                raise DatasetError(
                    f"migrating snapshot {snapshot.id}: {name} exists already with other bytes "
                    f"than member {snapshot.name_of(index)}; it was not overwritten and nothing "
                    "was registered: delete it, or migrate to another prefix"
                )
            counts["kept"] += 1
        counts["bytes"] += member.size
        return Member(
            key=key,
            size=member.size,
            version=there.version,
            format=member.format,
            samples=member.samples,
            meta=member.meta,
            content=digest,
        )

    async def _from_chunks(
        self, snapshot: Snapshot, index: int, ids: list[ChunkId], chunk_bytes: int
    ) -> bytearray:
        """A frozen member's bytes, each chunk (at most ``chunk_bytes``) checked against
        its id."""
        backend = self.registry.backend
        data = bytearray()
        for cid in ids:
            key = f"{CHUNKS}{cid}"
            meta = await backend.head(key)
            # A chunk is at most the record's chunk size: a larger object is damaged
            # and is not read (a planted one may be of any size).
            raw = (
                None
                if meta is None or meta.size > chunk_bytes
                else await backend.get(key, version=meta)
            )
            if meta is None or (raw is None and meta.size <= chunk_bytes):
                raise ChunkNotFoundError(
                    f"member {snapshot.name_of(index)} of frozen snapshot {snapshot.id}: chunk "
                    f"{cid} is missing from {backend.name}/{CHUNKS}; freeze it again"
                )
            if raw is None or await asyncio.to_thread(ChunkId.of, raw) != cid:
                self.backends.damaged.note(backend.name, cid)
                raise IntegrityError(
                    f"member {snapshot.name_of(index)} of frozen snapshot {snapshot.id}: chunk "
                    f"{cid} in {backend.name} is damaged; nothing was copied from it"
                )
            data += raw
        return data

    async def _matches(
        self,
        dest: Backend,
        meta: Any,
        ids: list[ChunkId],
        chunk_bytes: int,
        name: str,
        *,
        strict: bool,
    ) -> bool:
        """Whether ``dest``'s object (that version, read from the backend itself) is the
        chunks ``ids``; with ``strict``, IntegrityError rather than False."""
        raw = await dest.get(meta.key, version=meta)
        got = b"" if raw is None else raw

        def hashes() -> list[ChunkId]:
            view = memoryview(got)
            return [
                ChunkId.of(view[start : start + chunk_bytes])
                for start in range(0, view.nbytes, chunk_bytes)
            ]

        found = await asyncio.to_thread(hashes)
        if found == ids:
            return True
        if strict:
            bad = next(
                (i for i, (a, b) in enumerate(zip(found, ids, strict=False)) if a != b), len(found)
            )
            raise IntegrityError(
                f"the copy at {name} does not match its source: chunk {bad} read back from the "
                "destination hashes differently; nothing was registered: migrate again"
            )
        return False


def _content_of(data: bytes | bytearray) -> str:
    return blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()


def _dest_key(prefix: str, snapshot: Snapshot, member: Member) -> str:
    """The copy's key of ``member``: its key below the source's prefix, under ``prefix``
    (``""`` or ending in ``/``)."""
    return prefix + member.relative(snapshot.prefix).lstrip("/")


def _nested(source: str, dest: str) -> bool:
    """Whether the keys under prefixes ``source`` and ``dest`` (no outer slashes; ``""``
    the backend's root) of one backend overlap: one prefix inside the other."""
    below = f"{dest}/" if dest else ""
    return below.startswith(f"{source}/" if source else "") or source.startswith(below)
