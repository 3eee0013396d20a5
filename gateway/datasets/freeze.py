"""Freezing: a snapshot's member bytes into the registry's content-addressed chunk store.

The protocol is written down in :mod:`.layout` ("Freeze"); it is the checkpoints'
(intent, barrier check, HEAD, put if absent), so that a concurrent ``chunkd gc`` and a
freeze never lose a chunk to each other, and the frozen record goes last. A freeze may
run longer than a collection keeps intents (a day): its intents are written again while
it runs, and its chunks are looked up once more before the record is written.

A record as read (its bound, its check, the chunk ids it names, the roots of a garbage
collection) is :mod:`.records`'; the names stay importable from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import blake3

from chunkd.canonical import canonical
from chunkd.errors import (
    ChunkdError,
    DatasetError,
    ManifestError,
    ObjectNotFoundError,
    VersionChangedError,
)
from chunkd.frozen import (
    FROZEN_FORMAT,
    RECORD_SCHEMA,
    RecordPageWriter,
    record_root_bytes,
)
from chunkd.gateway.checkpoints.barrier import await_collections
from chunkd.gateway.checkpoints.jobs import each
from chunkd.gateway.checkpoints.model import CHUNKS, INTENTS
from chunkd.gateway.chunkstore import put_chunk
from chunkd.gateway.costs import charge
from chunkd.gateway.datasets.documents import read_document
from chunkd.gateway.datasets.layout import INTENT_CHUNKS
from chunkd.gateway.datasets.pinned import drifted, first_failure, member_leases, pinned_stat
from chunkd.gateway.datasets.records import (
    RECORD_PAGES_HELD,
    FrozenChunks,
    frozen_chunk_ids,
    parse_frozen,
    record_bound,
)

if TYPE_CHECKING:
    from chunkd.cache import ChunkCache, ChunkId, ChunkLease
    from chunkd.gateway.backends import Backend
    from chunkd.gateway.datasets.registry import Registry
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.readpath import ReadPath, Stat
    from chunkd.snapshot import Snapshot

__all__ = [
    "FROZEN_FORMAT",
    "INTENT_REFRESH",
    "RECORD_PAGES_HELD",
    "WRITE_RECORD_SCHEMA",
    "Freezer",
    "FrozenChunks",
    "frozen_chunk_ids",
    "parse_frozen",
    "record_bound",
]

log = logging.getLogger(__name__)

#: the frozen record's schema a freeze writes: 1 (one document) until the tests and
#: readers that open a record's file directly move to pages; :class:`Freezer` takes 2
#: (a root and record pages, in bounded memory) when told
WRITE_RECORD_SCHEMA: Final = 2
#: seconds after which a running freeze writes an intent of its own again: well inside
#: the day (``chunkd gc``'s ``intent_ttl``) after which a collection deletes an intent
#: and stops counting its chunks
INTENT_REFRESH: Final = 3600.0


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
    is put again (a new modification time in the backend): read back and written
    again, so that a freeze holds each intent's key and time, never its chunk ids (a
    100 TB snapshot's intents name 25M of them). An intent gone meanwhile (a
    collection deleted it) is not written again: the chunks it named may be gone with
    it, and the look-up before the record finds them missing.
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
        #: each intent's key and when it was last written, oldest first
        self._written: OrderedDict[str, float] = OrderedDict()

    async def put(self, key: str, doc: dict[str, Any]) -> None:
        """Write intent ``key``, and keep it fresh from now on."""
        with self.reach():
            await self.backend.put(key, canonical(doc))
        self._written[key] = time.monotonic()

    async def refresh_old(self) -> None:
        """Put again every intent written ``refresh`` seconds ago or more."""
        now = time.monotonic()
        old = []
        for key, at in self._written.items():
            if now - at < self.refresh:
                break  # oldest first: the rest are younger
            old.append(key)

        async def again(key: str) -> None:
            raw = await self.backend.get(key)
            if raw is None:
                log.warning("%s: its intent %s was deleted meanwhile", self.what, key)
                del self._written[key]
                return
            doc = json.loads(bytes(raw)) | {"created": time.time()}
            await self.backend.put(key, canonical(doc))
            self._written[key] = time.monotonic()
            self._written.move_to_end(key)

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
        record_schema: the frozen record's schema it writes (:data:`WRITE_RECORD_SCHEMA`):
            2, a root and record pages, cut and put as the freeze goes, so that it holds
            a page at a time; 1, one document, which holds every chunk id until it is
            written.
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
        record_schema: int = WRITE_RECORD_SCHEMA,
    ) -> None:
        self.record_schema = record_schema
        self.registry = registry
        self.read_path = read_path
        self.cache = cache
        self.metrics = metrics
        self.poll_interval = poll_interval
        self.intent_refresh = intent_refresh

    async def frozen(self, snapshot: Snapshot) -> dict[str, Any] | None:
        """The frozen record of ``snapshot``, checked; None when it is not frozen. Of a
        schema-2 record, the root alone (:class:`FrozenChunks` reads its pages).

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

    def chunks_of(self, record: dict[str, Any], snapshot: Snapshot) -> FrozenChunks:
        """A reader of the chunk ids ``record`` (:meth:`frozen`'s) names, by member."""
        where = f"{self.registry.backend_name}/{self.registry.layout.frozen(snapshot.id)}"
        return FrozenChunks(self.registry, record, where)

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

    async def _member_pages(self, snapshot: Snapshot) -> AsyncIterator[range]:
        """The snapshot's member indexes, a member page at a time, each page loaded
        (and checked) before its members are given; a schema-1 snapshot is one page."""
        if snapshot.schema < 2:
            yield range(len(snapshot.members))
            return
        for page in range(len(snapshot.pages)):
            await self.registry.load_pages(snapshot, [page])
            start = snapshot.page_start(page)
            yield range(start, start + snapshot.pages[page].members)

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
        complete = False
        if existing is not None:
            chunks = self.chunks_of(existing, snapshot)
            try:
                with reach():
                    complete = await self._all_present(backend, chunks)
            except ManifestError as exc:  # a record page missing or damaged
                log.warning("%s; writing it again", exc)
        if existing is not None and complete:
            return {
                "members": len(snapshot.members),
                "chunks": chunks.chunks,
                "bytes": snapshot.total_bytes,
                "uploaded": 0,
                "uploaded_bytes": 0,
                "already": True,
            }
        # Every member is checked before anything is sent: a drifted one fails the
        # freeze before it costs an upload.
        async for indexes in self._member_pages(snapshot):
            for index in indexes:
                await pinned_stat(self.read_path, snapshot, index)
        intents = _Intents(
            backend, self.intent_refresh, f"the freeze of snapshot {snapshot.id}", reach
        )
        refresher = asyncio.create_task(intents.keep_fresh())
        try:  # the intents are kept fresh until the record is written
            report, writer, whole = await self._copy(backend, snapshot, intents)
            await self._commit(backend, snapshot, writer, whole, intents)
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
        writer: RecordPageWriter,
        whole: dict[str, Any] | None,
        intents: _Intents,
    ) -> None:
        """Step 3: every chunk looked up once more, then the frozen record written
        (``whole``: the record of schema 1, when that is the one written)."""
        chunk_bytes = self.read_path.chunk_bytes
        if whole is not None:
            record = {
                "format": FROZEN_FORMAT,
                "schema": 1,
                "id": snapshot.id,
                "backend": backend.name,
                "chunk_bytes": chunk_bytes,
                "created": time.time(),
            } | whole
            root = await asyncio.to_thread(canonical, record)
        else:
            root = record_root_bytes(
                snapshot_id=snapshot.id,
                backend=backend.name,
                chunk_bytes=chunk_bytes,
                created=time.time(),
                members=writer.members,
                chunks=writer.chunks,
                pages=writer.refs,
            )
            record = json.loads(root)
        where = f"{backend.name}/{self.registry.layout.frozen(snapshot.id)}"
        # An intent protects its chunks only while it is younger than the collections'
        # intent_ttl: a chunk one took anyway (the freeze stalled, its intents could not
        # be written again) must not be named by a record. The record pages are read
        # back (they were put as they were cut): a page's ids at a time.
        missing: list[str] = []
        count = 0
        with intents.reach():
            async for ids in FrozenChunks(self.registry, record, where).batches():
                gone = await self._missing(backend, ids)
                count += len(gone)
                missing += gone[: max(0, 1 - len(missing))]
        if count:
            raise DatasetError(
                f"freezing snapshot {snapshot.id}: {count} of its chunks (the first "
                f"{missing[0]}) are gone from {backend.name}/{CHUNKS}, deleted by a garbage "
                "collection while the freeze ran; no frozen record was written: run freeze "
                "again (it sends only what is missing)"
            )
        with intents.reach():
            await backend.put(self.registry.layout.frozen(snapshot.id), root)

    async def _copy(
        self, backend: Backend, snapshot: Snapshot, intents: _Intents
    ) -> tuple[_Report, RecordPageWriter, dict[str, Any] | None]:
        """Every member's chunks into ``backend``, batch by batch, a member page at a
        time; their ids cut into record pages, each put in the registry once cut (or,
        for a record of schema 1, held whole: returned as its members and contents)."""
        run = uuid.uuid4().hex
        report = _Report(members=len(snapshot.members))
        cut: list[tuple[str, bytes]] = []
        paged = self.record_schema >= RECORD_SCHEMA
        whole: dict[str, Any] | None = None if paged else {"members": [], "content": []}
        writer = RecordPageWriter(
            lambda ident, data: cut.append((ident, data)) if paged else None,
            self.read_path.chunk_bytes,
        )
        batch = _Batch()
        batches = 0

        async def put_cut() -> None:
            # Content-addressed, put if absent: a page of a freeze cut short that no
            # record names is harmless (as a member page no root names).
            while cut:
                ident, data = cut.pop(0)
                with intents.reach():
                    await self.registry.pages.put(data, ident)

        async for indexes in self._member_pages(snapshot):
            for index in indexes:
                writer.begin(snapshot.members[index].key)
                if whole is not None:
                    whole["members"].append([])
                hasher = blake3.blake3()  # the member's whole bytes: its "content"
                # The freeze's own copy, not a reader's request (no direct GET).
                members = member_leases(self.read_path, snapshot, index, reader=False)
                async for chunk, stat, lease in members:
                    with lease:
                        await asyncio.to_thread(hasher.update, lease.view())
                        writer.add(str(lease.id))
                        if whole is not None:
                            whole["members"][-1].append(str(lease.id))
                        batch.add(lease.id, index, stat, chunk, lease.size)
                        report.chunks += 1
                        report.bytes += lease.size
                    if len(batch.where) >= INTENT_CHUNKS:
                        await self._send(backend, snapshot, intents, run, batches, batch, report)
                        batches += 1
                        batch = _Batch()
                    await put_cut()
                writer.end(hasher.hexdigest())
                if whole is not None:
                    whole["content"].append(hasher.hexdigest())
                await put_cut()
            writer.cut()  # a member page ends: so does its last record page
            await put_cut()
        if batch.where:
            await self._send(backend, snapshot, intents, run, batches, batch, report)
        writer.finish()
        await put_cut()
        return report, writer, whole

    async def _missing(self, backend: Backend, chunk_ids: Sequence[str]) -> list[str]:
        """The chunks of ``chunk_ids`` that ``backend`` lacks, in id order."""
        ids = sorted(set(chunk_ids))

        async def present(cid: str) -> bool:
            return await backend.head(f"{CHUNKS}{cid}") is not None

        return [cid for cid, there in zip(ids, await each(ids, present), strict=True) if not there]

    async def _all_present(self, backend: Backend, chunks: FrozenChunks) -> bool:
        """Whether every chunk the record names is in ``backend`` and none was read
        damaged on this node (a freeze again then writes those again).

        Raises:
            ManifestError: a record page is missing or damaged.
        """
        damaged = self.registry.backends.damaged
        async for ids in chunks.batches():
            if any((backend.name, c) in damaged for c in ids):
                return False
            if await self._missing(backend, ids):
                return False
        return True

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
                charge.written("freeze", size, backend.name)

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
            change = "changed while it was frozen"
        except ObjectNotFoundError:
            change = "vanished while it was frozen"
        if snapshot.schema >= 2:  # the member's page may have left the snapshot's LRU
            await self.registry.load_pages(snapshot, [snapshot.page_of(index)])
        raise drifted(snapshot, index, change)


async def _once(step: Callable[[], Awaitable[Any]]) -> Any:
    """A freeze's requests are not retried here: a client waits for the freeze, and
    freezing again is cheap (what is in the registry is not sent again)."""
    return await step()
