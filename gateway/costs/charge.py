"""The hooks' side of the ledger: one call per event, charged to the work at hand.

Each function reads :data:`~chunkd.gateway.costs.attribution.ATTRIBUTION` and does
nothing when its ledger is None (a read path built without a daemon). The call
sites, one line each:

- ``backends/resilience.py``: :func:`backend_request` per attempt;
- ``backends/store.py``, ``file.py``, ``s3.py``: :func:`backend_bytes` per body;
- ``readpath.py``: :func:`served` per source of a read, :func:`direct` per read;
- ``checkpoints/restore.py``: :func:`served` and :func:`direct` per chunk read;
- checkpoint uploads, freezes, migrations and the S3 front's PUTs: :func:`written`;
- ``checkpoints/gc.py``: :func:`gc_report` at the end of each collection (or dry run).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chunkd.gateway.costs.attribution import ATTRIBUTION

__all__ = ["backend_bytes", "backend_request", "direct", "gc_report", "served", "written"]


def backend_request(backend: str, op: str, count: int = 1) -> None:
    """``count`` requests (attempts) ``op`` (get, head, put, list, delete) to ``backend``."""
    at = ATTRIBUTION.get()
    if at.ledger is not None and count:
        at.ledger.charge(at.job, at.uid, at.name, "request", backend, op, count, remote=at.remote)


def backend_bytes(backend: str, direction: str, n: int) -> None:
    """``n`` bytes read from (``read``) or written to (``write``) ``backend``."""
    at = ATTRIBUTION.get()
    if at.ledger is not None and n:
        at.ledger.charge(at.job, at.uid, at.name, "bytes", backend, direction, n, remote=at.remote)


def served(source: str, n: int, backend: str | None, total: int | None = None) -> None:
    """``n`` bytes handed to a reader from ``source`` (ram, disk, peer, backend), of an
    object of ``backend``; ``total``: the bytes of the whole read (the GET fee a
    direct reader pays is credited pro rata by bytes)."""
    at = ATTRIBUTION.get()
    if at.ledger is not None and n:
        at.ledger.charge(
            at.job, at.uid, at.name, "served", source, n, backend, total, remote=at.remote
        )


def direct(backend: str, op: str, n: int = 0) -> None:
    """What a reader asked, as a direct reader would have asked ``backend``: one
    request ``op`` (get, head, list) of ``n`` bytes."""
    at = ATTRIBUTION.get()
    if at.ledger is not None:
        at.ledger.charge(at.job, at.uid, at.name, "direct", backend, op, n, remote=at.remote)


def written(kind: str, n: int, backend: str | None = None) -> None:
    """``n`` bytes written for the work at hand: ``kind`` checkpoint, freeze, migrate or
    object."""
    at = ATTRIBUTION.get()
    if at.ledger is not None and n:
        at.ledger.charge(at.job, at.uid, at.name, "written", kind, n, backend, remote=at.remote)


def gc_report(backend: str, report: Mapping[str, Any]) -> None:
    """A garbage collection (or dry run) of ``backend`` ended with ``report``: the
    ledger keeps what it found to delete (``GET /v1/cost/storage``)."""
    at = ATTRIBUTION.get()
    if at.ledger is not None:
        at.ledger.note_gc(backend, report)
