"""What the checkpoint histories and the frozen dataset snapshots keep in their
backends, and what that costs a month (``GET /v1/cost/storage``, ``chunkd cost
--storage``).

Bounded: at most :data:`MAX_CHECKPOINTS` checkpoints are read per call (one listing
page of the catalog per writable backend, manifests' summaries only), and at most
:data:`MAX_SNAPSHOTS` frozen records and :data:`MAX_SNAPSHOT_CHUNKS` of their chunk ids;
past either the answer's part says ``"truncated": true``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final

from chunkd.errors import DatasetError, DatasetNotFoundError, ManifestError, UnknownBackendError
from chunkd.gateway.costs.prices import GB, Prices
from chunkd.gateway.datasets.documents import read_document
from chunkd.gateway.datasets.records import FrozenChunks, parse_frozen, record_bound

if TYPE_CHECKING:
    from chunkd.gateway.backends import Backend
    from chunkd.gateway.checkpoints import Checkpoints
    from chunkd.gateway.datasets.registry import Registry
    from chunkd.snapshot import Snapshot

__all__ = [
    "MAX_CHECKPOINTS",
    "MAX_SNAPSHOTS",
    "MAX_SNAPSHOT_CHUNKS",
    "gc_view",
    "snapshots_view",
    "storage_view",
]

#: checkpoints one call reads, over every backend
MAX_CHECKPOINTS: Final = 1000
#: frozen records one call reads (in the registry's key order: by snapshot id)
MAX_SNAPSHOTS: Final = 100
#: chunk ids of frozen snapshots one call reads, over every snapshot (each held until
#: the answer: about 7 MB at most, measured); 65536 chunks of 4 MiB are 256 GiB
MAX_SNAPSHOT_CHUNKS: Final = 65536


async def storage_view(
    checkpoints: Checkpoints,
    backends: Iterable[str],
    prices: Prices,
    registry: Registry | None = None,
    gc_reports: Iterable[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """What each checkpoint history (per run: a name less its step) keeps in the
    backends named, and each frozen snapshot of ``registry`` (:func:`snapshots_view`),
    and their price a month by the backends' tables.

    A history's stored bytes are the sum of its committed checkpoints' ``new_bytes``
    (the bytes each save uploaded that the backend did not hold: each chunk counted
    once, by the save that first sent it). The answer's ``stored_bytes`` and
    ``per_month`` are the histories' and the snapshots' together. ``gc_reports``: the
    latest garbage collection of each backend (:func:`gc_view`).
    """
    runs: dict[str, dict[str, Any]] = {}
    left = MAX_CHECKPOINTS
    truncated = False
    for backend in backends:
        if left <= 0:
            truncated = True
            break
        entries, token = await checkpoints.entries_page(backend, limit=left)
        truncated = truncated or token is not None
        left -= len(entries)
        for entry in entries:
            if entry.get("state") != "committed":
                continue
            run = str(entry["name"]).rpartition("/")[0] or str(entry["name"])
            row = runs.setdefault(
                run, {"name": run, "backend": backend, "checkpoints": 0, "stored_bytes": 0}
            )
            row["checkpoints"] += 1
            row["stored_bytes"] += int(entry.get("new_bytes") or 0)
    histories = []
    for row in sorted(runs.values(), key=lambda r: -r["stored_bytes"]):
        table = prices.table(row["backend"])
        row["per_month"] = row["stored_bytes"] / GB * table.storage_per_gb_month
        histories.append(row)
    snapshots = None if registry is None else await snapshots_view(registry, prices)
    kept = [] if snapshots is None else [snapshots]
    return {
        "currency": prices.currency,
        "checkpoints": histories,
        "per_month": sum(row["per_month"] for row in [*histories, *kept]),
        "stored_bytes": sum(row["stored_bytes"] for row in [*histories, *kept]),
        "read_at_most": MAX_CHECKPOINTS,
        "truncated": truncated,
        "snapshots": snapshots,
        "gc_reclaimable": gc_view(gc_reports, prices),
    }


def gc_view(reports: Iterable[Mapping[str, Any]], prices: Prices) -> dict[str, Any] | None:
    """What ``chunkd gc`` would reclaim, as the latest collection of each backend this
    node ran found it (no mark is made here: it reads every manifest and lists every
    chunk); None when this node ran none.

    Each backend's row is its latest run's report, with its time (``at``): a dry run's
    ``bytes`` are what it would have deleted then, a real run's what it deleted (gone:
    not reclaimable). ``reclaimable_bytes`` sums the rows that are dry runs, and
    ``per_month`` is what keeping those bytes costs a month.
    """
    rows = []
    for report in reports:
        row = dict(report)
        price = prices.table(str(row["backend"])).storage_per_gb_month
        row["per_month"] = row["bytes"] / GB * price
        rows.append(row)
    if not rows:
        return None
    pending = [row for row in rows if row["dry_run"]]
    return {
        "from": "the latest chunkd gc or gc --dry-run of each backend on this node",
        "backends": rows,
        "reclaimable_bytes": sum(row["bytes"] for row in pending),
        "per_month": sum(row["per_month"] for row in pending),
    }


async def snapshots_view(registry: Registry, prices: Prices) -> dict[str, Any] | None:
    """What the frozen snapshots of the dataset registry keep in its backend's
    ``chunks/``, and its price a month by that backend's table; None when the
    registry's backend is not configured.

    Each snapshot's ``stored_bytes`` counts each chunk it names once (a chunk two of its
    members share, once); ``own_bytes`` counts only the chunks no other snapshot read
    in this call names (what deleting it alone could free, less what checkpoints
    share); the total ``stored_bytes`` counts each chunk once over every snapshot read.
    Chunks a snapshot shares with checkpoints are counted in both (the checkpoints'
    chunk lists are not read). A chunk's size is known from the record and its
    member's size (every chunk of a member but its last is ``chunk_bytes`` long).

    Bounded: at most :data:`MAX_SNAPSHOTS` records and :data:`MAX_SNAPSHOT_CHUNKS`
    chunk ids read per call (each held, 32 bytes and a number, until the answer); a
    snapshot read in part has ``"complete": false`` and the answer ``"truncated":
    true``.

    Raises:
        BackendUnavailableError: the registry's backend is down.
    """
    try:
        backend = registry.backend
    except UnknownBackendError:
        return None
    layout = registry.layout
    # chunk -> its size << 32 | the last snapshot that named it << 1 | named by two
    chunks: dict[bytes, int] = {}
    rows: list[dict[str, Any]] = []
    left = MAX_SNAPSHOT_CHUNKS
    truncated = False
    async with contextlib.aclosing(backend.scan(layout.frozen_prefix)) as batches:
        async for batch in batches:
            for meta in batch:
                sid = layout.parse_frozen_key(meta.key)
                if sid is None:
                    continue
                if len(rows) >= MAX_SNAPSHOTS or left <= 0:
                    truncated = True
                    break
                row: dict[str, Any] = {"id": sid, "created": None, "chunks": 0, "stored_bytes": 0,
                       "own_bytes": 0, "complete": False}  # fmt: skip
                try:
                    left -= await _read_snapshot(registry, backend, meta.key, row, len(rows),
                                                 chunks, left)  # fmt: skip
                except (ManifestError, DatasetError) as exc:
                    # its chunks are GC roots still (a damaged record stops a GC): say so
                    row["error"] = str(exc)
                rows.append(row)
                truncated = truncated or (not row["complete"] and "error" not in row)
            if truncated:
                break
    for value in chunks.values():
        if not value & 1:
            rows[(value & 0xFFFFFFFF) >> 1]["own_bytes"] += value >> 32
    price = prices.table(backend.name).storage_per_gb_month
    for row in rows:
        row["per_month"] = row["stored_bytes"] / GB * price
        row["own_per_month"] = row["own_bytes"] / GB * price
    rows.sort(key=lambda r: (-r["stored_bytes"], r["id"]))
    stored = sum(value >> 32 for value in chunks.values())
    return {
        "registry": registry.registry,
        "backend": backend.name,
        "stored_bytes": stored,
        "chunks": len(chunks),
        "per_month": stored / GB * price,
        "snapshots": rows,
        "read_at_most": {"snapshots": MAX_SNAPSHOTS, "chunks": MAX_SNAPSHOT_CHUNKS},
        "truncated": truncated,
    }


async def _read_snapshot(
    registry: Registry,
    backend: Backend,
    key: str,
    row: dict[str, Any],
    index: int,
    chunks: dict[bytes, int],
    left: int,
) -> int:
    """Count snapshot ``row["id"]``'s chunks into ``row`` and ``chunks`` (as
    :func:`snapshots_view` says), at most ``left`` chunk ids; how many it read."""
    sid = row["id"]
    where = f"{backend.name}/{key}"
    snapshot = await registry.manifest(sid)
    raw = await read_document(backend, key, limit=record_bound(snapshot))
    if raw is None:
        raise DatasetNotFoundError(f"the frozen record {where} was deleted meanwhile")
    record = await asyncio.to_thread(
        functools.partial(
            parse_frozen, raw, where, expect_id=sid, backend=backend.name, snapshot=snapshot
        )
    )
    del raw
    row["created"] = record.get("created")
    named = FrozenChunks(registry, record, where)
    size = named.chunk_bytes
    read = 0
    async for members in _member_ranges(registry, snapshot):
        for at in members:
            member = snapshot.members[at]
            count = -(-member.size // size)
            if read + count > left:
                return read  # not complete
            ids = await named.of_member(snapshot, at)
            read += count
            last = member.size - (count - 1) * size
            for j, cid in enumerate(ids):
                ident = _id_bytes(cid)
                value = chunks.get(ident)
                if value is None:
                    chunk = size if j < count - 1 else last
                    chunks[ident] = chunk << 32 | index << 1
                elif (value & 0xFFFFFFFF) >> 1 != index:
                    chunk = value >> 32
                    chunks[ident] = chunk << 32 | index << 1 | 1  # named by two or more
                else:
                    continue  # named again by this snapshot: counted once
                row["chunks"] += 1
                row["stored_bytes"] += chunk
    row["complete"] = True
    return read


async def _member_ranges(registry: Registry, snapshot: Snapshot) -> AsyncIterator[range]:
    """The snapshot's member indexes, a member page at a time, each page loaded first
    (a schema-1 snapshot: one range)."""
    if snapshot.schema < 2:
        yield range(len(snapshot.members))
        return
    for page in range(len(snapshot.pages)):
        await registry.load_pages(snapshot, [page])
        start = snapshot.page_start(page)
        yield range(start, start + snapshot.pages[page].members)


def _id_bytes(cid: str) -> bytes:
    """A chunk id as its 32 bytes (a record's ids are 64 hex digits)."""
    try:
        return bytes.fromhex(cid)
    except ValueError:
        return cid.encode()
