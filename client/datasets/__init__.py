"""Datasets: registered, versioned snapshots, read by index and in a resumable order.

- :mod:`chunkd.snapshot`: the manifest format (shared with the daemon).
- :mod:`~chunkd.client.datasets.dataset`: :class:`Dataset`, a snapshot opened for reading.
- :mod:`~chunkd.client.datasets.order`: the epoch's order, a pure function of (snapshot,
  seed, epoch); :mod:`~chunkd.client.datasets.state`: the loader state (a cursor);
  :mod:`~chunkd.client.datasets.loader`: steps, ranks, workers, the tail, prefetching,
  :class:`ReadSettings` and :class:`Loader`, the plain Python iterator;
  :mod:`~chunkd.client.datasets.columns`: batches taken by columns from decoded units;
  :mod:`~chunkd.client.datasets.shared`: units decoded once per node by the daemon;
  :mod:`~chunkd.client.datasets.workers`: DataLoader workers' states and
  :func:`global_state`.
- :mod:`~chunkd.client.datasets.register`: registration.
- :mod:`~chunkd.client.datasets.formats`: the format plug-ins: Parquet, Arrow IPC and
  Feather, JSON lines, fixed records, WebDataset and MDS members.
- :mod:`~chunkd.client.datasets.source`: pinned (and frozen) member bytes.

numpy and pyarrow (imported when a unit is first decoded) are the dependencies beyond
the client's; neither torch nor jax is imported here.
"""

from __future__ import annotations

from chunkd.client.datasets.dataset import Dataset, resolve
from chunkd.client.datasets.loader import Batch, Loader, ReadSettings, step_sample_ids
from chunkd.client.datasets.order import Order, quality
from chunkd.client.datasets.state import LoaderState
from chunkd.client.datasets.workers import global_state

__all__ = [
    "Batch",
    "Dataset",
    "Loader",
    "LoaderState",
    "Order",
    "ReadSettings",
    "global_state",
    "quality",
    "resolve",
    "step_sample_ids",
]
