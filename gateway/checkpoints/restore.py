"""Loading: a committed manifest with its parts (verified against their hashes), and
chunks from the cache, a peer or the backend (verified against their ids)."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import blake3

from chunkd.cache import MAX_CHUNK_BYTES, BytesLease, Chunk, ChunkCache, ChunkId, ChunkLease
from chunkd.cache.singleflight import SingleFlight
from chunkd.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ChunkdError,
    ChunkNotFoundError,
    IntegrityError,
    RangeNotSatisfiableError,
)
from chunkd.gateway.checkpoints.jobs import Jobs
from chunkd.gateway.checkpoints.model import (
    CHUNKS,
    SCHEMA,
    Durability,
    manifest_key,
)
from chunkd.gateway.costs import charge
from chunkd.gateway.names import checkpoint_name
from chunkd.ranges import ByteRange

if TYPE_CHECKING:
    from collections.abc import Sequence

    from chunkd.gateway.backends import Backends
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.peers import Peers

__all__ = ["Restorer"]


class Restorer:
    """Reads checkpoints back.

    Args:
        cache: the daemon's cache (chunks are served from it, and kept there).
        backends: the configured backends.
        metrics: the daemon's metrics.
        jobs: the jobs this daemon knows (a save at level local is loadable here).
        peers: the cluster, when chunks are shared between nodes: a load asks each
            chunk's owner before it reads the backend.
    """

    def __init__(
        self,
        cache: ChunkCache,
        backends: Backends,
        metrics: Metrics,
        jobs: Jobs,
        peers: Peers | None = None,
    ) -> None:
        self.cache = cache
        self.backends = backends
        self.metrics = metrics
        self.jobs = jobs
        self.peers = peers
        self._fetches: SingleFlight[tuple[str, ChunkId], tuple[str, memoryview]] = SingleFlight()

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
        raw = await backend.get(manifest_key(path))
        if raw is None:
            if local is not None:
                return local
            raise CheckpointNotFoundError(f"no checkpoint named {name}")
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
            part_raw = await backend.get(str(entry["key"]))
            if part_raw is None:
                raise IntegrityError(
                    f"checkpoint {name}: part {entry['key']} is missing from the backend"
                )
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
            for j in self.jobs
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
        parts = [mine[r].part_doc() for r in range(newest.request.world_size)]
        return {
            "format": "chunkd-checkpoint",
            "schema": SCHEMA,
            "name": newest.request.name,
            "save_id": newest.request.save_id,
            "world_size": newest.request.world_size,
            "step": newest.request.step,
            "parts": parts,
            "durability": Durability(min(j.level for j in mine.values())).wire_name,
        }

    async def chunk(
        self,
        backend_name: str,
        cid: ChunkId,
        *,
        local: bool = False,
        replicas: Sequence[str] = (),
    ) -> ChunkLease:
        """Lease checkpoint chunk ``cid``: from the cache, else from the peers (unless
        ``local``: a peer's own request), else from ``chunks/<id>``.

        From the peers: the members named in ``replicas`` first (they may hold a
        replica of the save: asked for what they hold, at once), then the chunk's
        owner or the holders it names (:meth:`.peers.Peers.fetch_chunk`).

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
                charge.direct(backend_name, "get", lease.size)  # one GET per chunk read
                charge.served(lease.origin or "ram", lease.size, backend_name, lease.size)
            return lease
        backend = self.backends.get(backend_name)

        source = "backend"
        started = False  # whether this call started the fetch (not a waiter of it)

        async def get() -> memoryview:
            nonlocal source
            if self.peers is not None and not local:
                shared = await self.peers.fetch_chunk(backend_name, cid, replicas=replicas)
                if shared is not None:
                    await self.cache.put(Chunk.trusted(cid, shared))
                    source = "peer"
                    return shared
            # One request, never more than a chunk can be (and a byte): an object
            # larger than any chunk is damaged, and is not read whole.
            try:
                raw = await backend.get(f"{CHUNKS}{cid}", ByteRange(0, MAX_CHUNK_BYTES + 1))
            except RangeNotSatisfiableError:  # an empty object
                raw = memoryview(b"")
            if raw is not None and raw.nbytes > MAX_CHUNK_BYTES:
                raise self._damaged(
                    backend_name, cid, f"it holds more than any chunk ({MAX_CHUNK_BYTES} bytes)"
                )
            if raw is None:
                raise _chunk_error(
                    ChunkNotFoundError(f"chunk {cid} is missing from backend {backend_name!r}"),
                    cid,
                )
            got = await asyncio.to_thread(ChunkId.of, raw)
            if got != cid:
                raise self._damaged(backend_name, cid, f"its {raw.nbytes} bytes hash to {got}")
            await self.cache.put(Chunk.trusted(cid, raw))
            return raw

        async def fetch() -> tuple[str, memoryview]:
            nonlocal started
            started = True  # only the starter's closure runs
            # With peers, holder requests for the chunk wait on this fetch (whichever
            # source it reads), which keeps the bytes before it is over: they find it
            # in flight or in the cache, never neither.
            data = await (get() if self.peers is None else self.peers.holding(cid, get))
            return source, data

        # The fetch's bytes go to every reader of it, so a chunk no tier kept (RAM
        # full of pinned chunks, a disk that declines) is still served once fetched,
        # and never fetched again for them.
        source, fetched = await self._fetches.run((backend_name, cid), fetch)
        lease = await self.cache.find(cid)
        if lease is None:
            lease = BytesLease(cid, fetched)
        if not local:
            self.metrics.ckpt_restored_bytes.labels(source).inc(lease.size)
            charge.direct(backend_name, "get", lease.size)  # one GET per chunk read
            # In the cost ledger, only the reader whose call fetched the chunk got it
            # from the fetch's source (and paid for it); the others that waited on it
            # were served the node's copy, as from the cache, and are credited so.
            served = source if started else lease.origin or "ram"
            charge.served(served, lease.size, backend_name, lease.size)
        return lease

    def _damaged(self, backend_name: str, cid: ChunkId, why: str) -> ChunkdError:
        """The error of chunk ``cid`` read damaged from ``backend_name`` (``why``),
        counted and noted: the next save or freeze on this node that holds its bytes
        writes it again (chunkd.gateway.chunkstore)."""
        self.metrics.ckpt_integrity_failures.inc()
        self.backends.damaged.note(backend_name, cid)
        return _chunk_error(
            IntegrityError(
                f"chunk {cid} in backend {backend_name!r} is damaged: {why}; it was not "
                "cached. The next save or freeze that holds its bytes writes it again; "
                f"`chunkd gc {backend_name} --scrub` finds every damaged chunk of the backend"
            ),
            cid,
        )


def _chunk_error(exc: ChunkdError, cid: ChunkId) -> ChunkdError:
    exc.chunk_id = str(cid)  # type: ignore[attr-defined]
    return exc
