"""Backends: the configured object stores, one module per kind.

- :mod:`~chunkd.gateway.backends.base`: the :class:`Backend` interface (its contract
  is written down there);
- :mod:`~chunkd.gateway.backends.resilience`: :class:`Resilient`, the wrapper the
  registry puts around every backend (retries with :class:`chunkd.backoff.Backoff`,
  the circuit breaker, the metrics of each attempt);
- :mod:`~chunkd.gateway.backends.store`: :class:`StoreBackend`, what the obstore
  kinds share (their I/O, their store's errors);
- one module per kind: :mod:`~chunkd.gateway.backends.s3`,
  :mod:`~chunkd.gateway.backends.gcs`, :mod:`~chunkd.gateway.backends.azure`,
  :mod:`~chunkd.gateway.backends.file` (with
  :mod:`~chunkd.gateway.backends.filelist`), :mod:`~chunkd.gateway.backends.memory`,
  :mod:`~chunkd.gateway.backends.http` (``https://``: read-only, unlisted), each declared
  in :mod:`chunkd.gateway.config.kinds` (the classes of the first five are re-exported
  here as they were; a new kind's is imported from its declaration, not here);
- :mod:`~chunkd.gateway.backends.registry`: :class:`Backends` (the allowlist by
  name) and :func:`make_backend` (each kind's class imported from its declaration);
- :class:`DamagedChunks` (the chunks this node read damaged) lives beside the package,
  in :mod:`chunkd.gateway.damaged`, so that the chunk store needs no backend kind;
- :mod:`~chunkd.gateway.backends.meta`: :class:`ObjectMeta`.

Every kind passes the conformance suite :class:`chunkd.testing.backends.BackendTests`.
"""

from __future__ import annotations

from chunkd.gateway.backends.azure import AzureBackend
from chunkd.gateway.backends.base import SCAN_BATCH, Backend
from chunkd.gateway.backends.file import FileBackend
from chunkd.gateway.backends.filelist import FileLister
from chunkd.gateway.backends.gcs import GCSBackend
from chunkd.gateway.backends.memory import MemoryBackend
from chunkd.gateway.backends.meta import ObjectMeta
from chunkd.gateway.backends.registry import KINDS, Backends, make_backend
from chunkd.gateway.backends.resilience import RETRY_BACKOFF, Resilient
from chunkd.gateway.backends.s3 import S3Backend
from chunkd.gateway.backends.store import StoreBackend

__all__ = [
    "KINDS",
    "RETRY_BACKOFF",
    "SCAN_BATCH",
    "AzureBackend",
    "Backend",
    "Backends",
    "FileBackend",
    "FileLister",
    "GCSBackend",
    "MemoryBackend",
    "ObjectMeta",
    "Resilient",
    "S3Backend",
    "StoreBackend",
    "make_backend",
]
