"""Freezing: a snapshot's member bytes into the registry's content-addressed chunk store.

The protocol is written down in :mod:`.layout` ("Freeze"); it is the checkpoints'
(intent, barrier check, HEAD, put if absent), so that a concurrent ``chunkd gc`` and a
freeze never lose a chunk to each other, and the frozen record goes last. A freeze may
run longer than a collection keeps intents (a day): its intents are written again while
it runs, and its chunks are looked up once more before the record is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import blake3

from chunkd.client.protocol import MAX_LAYOUT
from chunkd.errors import (
    ChunkdError,
    DatasetError,
    ManifestError,
    ObjectNotFoundError,
    VersionChangedError,
)
from chunkd.gateway.checkpoints.barrier import await_collections
from chunkd.gateway.checkpoints.jobs import each
from chunkd.gateway.checkpoints.model import CHUNKS, INTENTS
from chunkd.gateway.chunkstore import put_chunk
from chunkd.gateway.datasets.layout import INTENT_CHUNKS, SCHEMA
from chunkd.gateway.datasets.pinned import drifted, first_failure, member_leases, pinned_stat
from chunkd.gateway.datasets.registry import load_document, read_document

if TYPE_CHECKING:
    from chunkd.cache import ChunkCache, ChunkId, ChunkLease
    from chunkd.gateway.backends import Backend
    from chunkd.gateway.datasets.registry import Registry
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.readpath import ReadPath, Stat
    from chunkd.snapshot import Snapshot

__all__ = ["FROZEN_FORMAT", "INTENT_REFRESH", "Freezer", "parse_frozen"]

log = logging.getLogger(__name__)

FROZEN_FORMAT: Final = "chunkd-dataset-frozen"
#: seconds after which a running freeze writes an intent of its own again: well inside
#: the day (``chunkd gc``'s ``intent_ttl``) after which a collection deletes an intent
#: and stops counting its chunks
INTENT_REFRESH: Final = 3600.0


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def record_bound(snapshot: Snapshot) -> int:
    """The most bytes ``snapshot``'s frozen record can hold (at the smallest chunk size,
    a page), up to :data:`~chunkd.client.protocol.MAX_LAYOUT`: a record read is never
    larger, so a planted one is refused unread."""
    per_chunk = 64 + 3  # an id, its quotes and a comma
    size = 4096 + sum(-(-m.size // 4096) * per_chunk + 160 for m in snapshot.members)
    return min(size, MAX_LAYOUT)


def parse_frozen(
    raw: bytes | memoryview,
    key: str,
    *,
    expect_id: str,
    backend: str,
    snapshot: Snapshot | None = None,
) -> dict[str, Any]:
    """A frozen record, checked: the one written for snapshot ``expect_id`` (the id in
    its key) with its chunks in ``backend`` (the registry's), and, when ``snapshot``
    is given, one chunk list per member of the member's size.

    What that proves, and what it does not: the record names this snapshot and this
    registry's chunk store, so a record copied from another snapshot, or one naming
    another backend's chunks, is refused. It does not prove who wrote it: whoever can
    write the registry's backend directly can write a record (docs/security.md).
    Every chunk it names is still checked against its id when read.

    Raises:
        ManifestError: the record is damaged, or is not this snapshot's.
    """
    try:
        # Its shape is checked before it is parsed: nested too deep is damaged, never a
        # RecursionError.
        doc: Any = load_document(raw, key, ("members",), max_depth=4)
    except ManifestError:
        doc = None
    members = doc.get("members") if isinstance(doc, dict) else None
    if (
        not isinstance(doc, dict)
        or doc.get("format") != FROZEN_FORMAT
        or not isinstance(members, list)
        or not all(isinstance(m, list) and all(isinstance(c, str) for c in m) for m in members)
        or not isinstance(doc.get("chunk_bytes"), int)
        or isinstance(doc.get("chunk_bytes"), bool)
        or doc["chunk_bytes"] <= 0
    ):
        raise ManifestError(
            f"the frozen record {key} is damaged (not the JSON chunkd wrote); freeze the "
            "snapshot again"
        )
    if doc.get("id") != expect_id or doc.get("backend") != backend:
        raise ManifestError(
            f"the frozen record {key} is not snapshot {expect_id}'s in backend {backend!r}: "
            f"it names snapshot {str(doc.get('id'))[:64]!r} in backend "
            f"{str(doc.get('backend'))[:64]!r}; freeze the snapshot again (it is written anew)"
        )
    if snapshot is not None:
        size = doc["chunk_bytes"]
        if len(members) != len(snapshot.members) or any(
            len(ids) != -(-m.size // size) for ids, m in zip(members, snapshot.members, strict=True)
        ):
            raise ManifestError(
                f"the frozen record {key} does not match snapshot {snapshot.id}'s members; "
                "freeze the snapshot again"
            )
    return doc


@dataclass
class _Batch:
    """Chunks read whose intent is not written yet: where each came from (the member's
    index, its stat, the chunk's index, its size)."""

    where: dict[ChunkId, tuple[int, Stat, int, int]] = field(default_factory=dict)

    def add(self, cid: ChunkId, index: int, stat: Stat, chunk: int, size: int) -> None:
        self.where.setdefault(cid, (index, stat, chunk, size))


class _Intents:
    """The intents one freeze wrote, written again before a collection deletes them.

    A collection deletes an intent whose object is older than its ``intent_ttl`` (a
    day) and no longer counts its chunks; a freeze of a large snapshot can take longer.
    While :meth:`keep_fresh` runs, every intent written ``refresh`` seconds ago or more
    is put again (a new modification time in the backend).
    """

    def __init__(
        self,
        backend: Backend,
        refresh: float,
        what: str,
        reach: Callable[[], AbstractContextManager[None]],
    ) -> None:
        self.backend = backend
        self.refresh = refresh
        self.what = what
        #: around each request to the registry's backend: a backend down names it
        self.reach = reach
        self._written: dict[str, tuple[dict[str, Any], float]] = {}

    async def put(self, key: str, doc: dict[str, Any]) -> None:
        """Write intent ``key``, and keep it fresh from now on."""
        with self.reach():
            await self.backend.put(key, _dumps(doc))
        self._written[key] = (doc, time.monotonic())

    async def refresh_old(self) -> None:
        """Put again every intent written ``refresh`` seconds ago or more."""
        now = time.monotonic()
        old = [key for key, (_, at) in self._written.items() if now - at >= self.refresh]

        async def again(key: str) -> None:
            doc = self._written[key][0] | {"created": time.time()}
            await self.backend.put(key, _dumps(doc))
            self._written[key] = (doc, time.monotonic())

        await each(old, again)

    async def keep_fresh(self) -> None:
        """:meth:`refresh_old`, four times a ``refresh`` period, until cancelled."""
        pause = self.refresh / 4
        while True:
            await asyncio.sleep(pause)
            try:
                await self.refresh_old()
            except ChunkdError as exc:
                # Tried again at the next pause; a chunk lost meanwhile fails the
                # freeze at its last look-up, never the snapshot.
                log.warning("%s: could not write its intents again (%s)", self.what, exc)


@dataclass
class _Report:
    members: int = 0
    chunks: int = 0
    bytes: int = 0
    uploaded: int = 0
    uploaded_bytes: int = 0

    def to_json(self) -> dict[str, int]:
        return {
            "members": self.members,
            "chunks": self.chunks,
            "bytes": self.bytes,
            "uploaded": self.uploaded,
            "uploaded_bytes": self.uploaded_bytes,
        }


class Freezer:
    """Freezes snapshots into the registry backend's ``chunks/``.

    Args:
        registry: the dataset registry.
        read_path: the daemon's read path (members are read through it, pinned).
        cache: the daemon's cache (chunks read for the intent are uploaded from it).
        metrics: the daemon's metrics.
        poll_interval: the longest pause between two looks for the barriers of
            garbage collections.
        intent_refresh: seconds after which a running freeze writes an intent of its
            own again (:data:`INTENT_REFRESH`; keep it well under the collections'
            ``intent_ttl``).
    """

    def __init__(
        self,
        registry: Registry,
        read_path: ReadPath,
        cache: ChunkCache,
        metrics: Metrics,
        *,
        poll_interval: float = 2.0,
        intent_refresh: float = INTENT_REFRESH,
    ) -> None:
        self.registry = registry
        self.read_path = read_path
        self.cache = cache
        self.metrics = metrics
        self.poll_interval = poll_interval
        self.intent_refresh = intent_refresh

    async def frozen(self, snapshot: Snapshot) -> dict[str, Any] | None:
        """The frozen record of ``snapshot``, checked; None when it is not frozen.

        Raises:
            ManifestError: the record is damaged.
        """
        key = self.registry.layout.frozen(snapshot.id)
        backend = self.registry.backend
        raw = await read_document(backend, key, limit=record_bound(snapshot))
        if raw is None:
            return None
        return await asyncio.to_thread(
            functools.partial(
                parse_frozen,
                raw,
                key,
                expect_id=snapshot.id,
                backend=backend.name,
                snapshot=snapshot,
            )
        )

    async def freeze(self, snapshot: Snapshot, *, what: str | None = None) -> dict[str, Any]:
        """Copy every member's chunks into the registry, then write the frozen record.

        ``what`` is the request, for errors (``"freezing NAME@N"``).

        Idempotent: a snapshot frozen already whose chunks are all there is answered
        at once (``"already": true``); otherwise chunks present are not sent again.

        Raises:
            ReadOnlyBackendError: the registry's backend takes no writes.
            SnapshotDriftError: a member changed or vanished (nothing is frozen).
            DatasetError: a chunk sent was deleted by a garbage collection before the
                record was written (nothing is frozen; freezing again sends it again).
            BackendUnavailableError: the registry's backend is down (the message names
                the registry), or a member's.
        """
        backend = self.registry.writable()
        with first_failure():  # the errors of chunks sent at once, each as itself
            return await self._freeze(backend, snapshot, what or f"freezing {snapshot.id}")

    async def _freeze(self, backend: Backend, snapshot: Snapshot, what: str) -> dict[str, Any]:
        def reach() -> AbstractContextManager[None]:
            return self.registry.reaching(what)

        try:
            with reach():
                existing = await self.frozen(snapshot)
        except ManifestError as exc:
            # Freezing again is the repair the error names: the record is written anew.
            log.warning("%s; writing it again", exc)
            existing = None
        with reach():
            complete = existing is not None and await self._all_present(backend, existing)
        if existing is not None and complete:
            return {
                "members": len(snapshot.members),
                "chunks": sum(len(member) for member in existing["members"]),
                "bytes": snapshot.total_bytes,
                "uploaded": 0,
                "uploaded_bytes": 0,
                "already": True,
            }
        # Every member is checked before anything is sent: a drifted one fails the
        # freeze before it costs an upload.
        for index in range(len(snapshot.members)):
            await pinned_stat(self.read_path, snapshot, index)
        intents = _Intents(
            backend, self.intent_refresh, f"the freeze of snapshot {snapshot.id}", reach
        )
        refresher = asyncio.create_task(intents.keep_fresh())
        try:  # the intents are kept fresh until the record is written
            report, members, contents = await self._copy(backend, snapshot, intents)
            await self._commit(backend, snapshot, members, contents, intents)
        finally:
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher
        log.info(
            "snapshot %s frozen in %s: %d chunks, %d uploaded",
            snapshot.id,
            backend.name,
            report.chunks,
            report.uploaded,
        )
        return report.to_json() | {"already": False}

    async def _commit(
        self,
        backend: Backend,
        snapshot: Snapshot,
        members: list[list[str]],
        contents: list[str],
        intents: _Intents,
    ) -> None:
        """Step 3: every chunk looked up once more, then the frozen record written."""
        # An intent protects its chunks only while it is younger than the collections'
        # intent_ttl: a chunk one took anyway (the freeze stalled, its intents could not
        # be written again) must not be named by a record.
        with intents.reach():
            missing = await self._missing(backend, members)
        if missing:
            raise DatasetError(
                f"freezing snapshot {snapshot.id}: {len(missing)} of its chunks (the first "
                f"{missing[0]}) are gone from {backend.name}/{CHUNKS}, deleted by a garbage "
                "collection while the freeze ran; no frozen record was written: run freeze "
                "again (it sends only what is missing)"
            )
        record = {
            "format": FROZEN_FORMAT,
            "schema": SCHEMA,
            "id": snapshot.id,
            "backend": backend.name,
            "chunk_bytes": self.read_path.chunk_bytes,
            "created": time.time(),
            "members": members,
            "content": contents,
        }
        data = await asyncio.to_thread(_dumps, record)
        with intents.reach():
            await backend.put(self.registry.layout.frozen(snapshot.id), data)

    async def _copy(
        self, backend: Backend, snapshot: Snapshot, intents: _Intents
    ) -> tuple[_Report, list[list[str]], list[str]]:
        """Every member's chunks into ``backend``, batch by batch; their ids per member."""
        run = uuid.uuid4().hex
        report = _Report(members=len(snapshot.members))
        members: list[list[str]] = []
        contents: list[str] = []
        batch = _Batch()
        batches = 0
        for index in range(len(snapshot.members)):
            ids: list[str] = []
            hasher = blake3.blake3()  # the member's whole bytes: the record's "content"
            async for chunk, stat, lease in member_leases(self.read_path, snapshot, index):
                with lease:
                    await asyncio.to_thread(hasher.update, lease.view())
                    ids.append(str(lease.id))
                    batch.add(lease.id, index, stat, chunk, lease.size)
                    report.chunks += 1
                    report.bytes += lease.size
                if len(batch.where) >= INTENT_CHUNKS:
                    await self._send(backend, snapshot, intents, run, batches, batch, report)
                    batches += 1
                    batch = _Batch()
            members.append(ids)
            contents.append(hasher.hexdigest())
        if batch.where:
            await self._send(backend, snapshot, intents, run, batches, batch, report)
        return report, members, contents

    async def _missing(self, backend: Backend, members: list[list[str]]) -> list[str]:
        """The chunks of ``members`` that ``backend`` lacks, in id order."""
        ids = sorted({c for member in members for c in member})

        async def present(cid: str) -> bool:
            return await backend.head(f"{CHUNKS}{cid}") is not None

        return [cid for cid, there in zip(ids, await each(ids, present), strict=True) if not there]

    async def _all_present(self, backend: Backend, record: dict[str, Any]) -> bool:
        """Whether every chunk of ``record`` is in ``backend`` and none was read damaged
        on this node (a freeze again then writes those again)."""
        damaged = self.registry.backends.damaged
        if any((backend.name, c) in damaged for member in record["members"] for c in member):
            return False
        return not await self._missing(backend, record["members"])

    async def _send(
        self,
        backend: Backend,
        snapshot: Snapshot,
        intents: _Intents,
        run: str,
        number: int,
        batch: _Batch,
        report: _Report,
    ) -> None:
        """One batch: its intent, the barrier check, then each chunk if missing."""
        intent = {
            "format": "chunkd-dataset-freeze-intent",
            "snapshot": snapshot.id,
            "created": time.time(),
            "chunks": [str(cid) for cid in batch.where],
        }
        await intents.put(f"{INTENTS}ds-{run}.{number}.json", intent)

        def waiting(count: int) -> None:
            self.metrics.gc_barrier_waits.inc()
            log.info("freeze of %s waits for %d garbage collection(s)", snapshot.id, count)

        with intents.reach():
            await await_collections(
                backend,
                poll_interval=self.poll_interval,
                attempt=_once,
                what=f"the freeze of snapshot {snapshot.id}",
                on_wait=waiting,
            )

        async def upload(item: tuple[ChunkId, tuple[int, Stat, int, int]]) -> None:
            cid, (index, stat, chunk, size) = item

            async def lease_of() -> ChunkLease:
                lease = await self._lease(snapshot, index, cid, stat, chunk)
                if lease.id != cid:  # pragma: no cover - the read path verifies by the map
                    lease.release()
                    raise DatasetError(f"chunk {chunk} of {stat.meta.key} is not {cid}")
                return lease

            with intents.reach():
                sent = await put_chunk(backend, cid, size, lease_of, self.registry.backends.damaged)
            if sent:
                report.uploaded += 1
                report.uploaded_bytes += size

        await each(list(batch.where.items()), upload)

    async def _lease(
        self, snapshot: Snapshot, index: int, cid: ChunkId, stat: Stat, chunk: int
    ) -> ChunkLease:
        """The bytes of ``cid``: from the cache, else read again (pinned) from member
        ``index``, which must not have changed since."""
        lease = await self.cache.find(cid)
        if lease is not None:
            return lease
        try:
            return await self.read_path.chunk(stat, chunk)
        except VersionChangedError:
            raise drifted(snapshot, index, "changed while it was frozen") from None
        except ObjectNotFoundError:
            raise drifted(snapshot, index, "vanished while it was frozen") from None


async def _once(step: Callable[[], Awaitable[Any]]) -> Any:
    """A freeze's requests are not retried here: a client waits for the freeze, and
    freezing again is cheap (what is in the registry is not sent again)."""
    return await step()


async def frozen_chunk_ids(registry: Registry, backend: Backend) -> AsyncGenerator[str, None]:
    """Every chunk id a frozen record in the registry names, if ``backend`` is the
    registry's (the roots of a garbage collection there; nothing for another backend).

    Raises:
        DatasetError: a frozen record is damaged (the collection must stop: the
            snapshot's chunks cannot be told from garbage).
    """
    if backend.name != registry.backend_name:
        return
    layout = registry.layout
    async with contextlib.aclosing(backend.scan(layout.frozen_prefix)) as batches:
        async for batch in batches:
            records = [(m.key, layout.parse_frozen_key(m.key)) for m in batch]
            keys = [(key, sid) for key, sid in records if sid is not None]

            async def read(item: tuple[str, str]) -> list[str]:
                key, sid = item
                try:
                    raw = await read_document(backend, key, limit=MAX_LAYOUT)
                    if raw is None:
                        return []  # deleted meanwhile
                    doc = await asyncio.to_thread(
                        functools.partial(
                            parse_frozen,
                            raw,
                            f"{backend.name}/{key}",
                            expect_id=sid,
                            backend=backend.name,
                        )
                    )
                except ManifestError as exc:
                    raise DatasetError(
                        f"garbage collection stopped before deleting anything: {exc}. Its "
                        "chunks cannot be told from garbage; freeze that snapshot again or "
                        "delete the record"
                    ) from None
                return [c for member in doc["members"] for c in member]

            for ids in await each(keys, read):
                for cid in ids:
                    yield cid
