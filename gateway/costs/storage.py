"""What the checkpoint histories keep in their backends, and what that costs a month
(``GET /v1/cost/storage``, ``chunkd cost --storage``).

Bounded: at most :data:`MAX_CHECKPOINTS` checkpoints are read per call (one listing
page of the catalog per writable backend, manifests' summaries only); past it the
answer says ``"truncated": true``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final

from chunkd.gateway.costs.prices import GB, Prices

if TYPE_CHECKING:
    from chunkd.gateway.checkpoints import Checkpoints

__all__ = ["MAX_CHECKPOINTS", "storage_view"]

#: checkpoints one call reads, over every backend
MAX_CHECKPOINTS: Final = 1000


async def storage_view(
    checkpoints: Checkpoints, backends: Iterable[str], prices: Prices
) -> dict[str, Any]:
    """What each checkpoint history (per run: a name less its step) keeps in the
    backends named, and its price a month by the backend's table.

    A history's stored bytes are the sum of its committed checkpoints' ``new_bytes``
    (the bytes each save uploaded that the backend did not hold: each chunk counted
    once, by the save that first sent it).
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
    return {
        "currency": prices.currency,
        "checkpoints": histories,
        "per_month": sum(row["per_month"] for row in histories),
        "stored_bytes": sum(row["stored_bytes"] for row in histories),
        "read_at_most": MAX_CHECKPOINTS,
        "truncated": truncated,
        # not from the catalog cheaply: frozen snapshots' chunks and what GC would
        # reclaim need the mark (chunkd gc --dry-run says the latter)
        "snapshots": None,
        "gc_reclaimable": None,
    }
