"""Datasets: registered, versioned snapshots, read by index and in a resumable order.

- :mod:`chunkd.snapshot`: the manifest format (shared with the daemon).
- :mod:`~chunkd.client.datasets.dataset`: :class:`Dataset`, a snapshot opened for reading.
- :mod:`~chunkd.client.datasets.formats`: Parquet, JSON lines, fixed records, WebDataset
  and MDS members.
- :mod:`~chunkd.client.datasets.source`: pinned (and frozen) member bytes.

numpy is the only dependency beyond the client's (pyarrow for Parquet members); neither
torch nor jax is imported here.
"""

from __future__ import annotations

from chunkd.client.datasets.dataset import Dataset, resolve

__all__ = ["Dataset", "resolve"]
