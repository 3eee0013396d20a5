"""A batch's columns as tensors, and batches in pinned memory.

:func:`collate_columns` is the torch adapter's default collate: a batch's columns
(:attr:`Batch.columns <chunkd.client.datasets.loader.Batch.columns>`) as tensors of
their own, never views of a shared mapping, so in-place ops are safe.

:func:`pinned` (``batch.pin_memory()``; :meth:`Batch.pin_memory
<chunkd.client.datasets.loader.Batch.pin_memory>` runs, and so what torch's
``DataLoader(pin_memory=True)`` runs on a chunkd batch) puts a batch's tensors in
page-locked memory. It lives in :mod:`chunkd.client.datasets.pinning`, beside the batch,
so that the loader imports nothing of this adapter; it is re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import default_collate

from chunkd.client.datasets.pinning import pinned

if TYPE_CHECKING:
    from chunkd.client.datasets.loader import Batch

__all__ = ["collate_columns", "pinned", "tensor_of"]


def tensor_of(column: Any) -> Any:
    """One column as the default collate gives it: a numpy array of a type torch has
    as a tensor of its own (a copy where the array is a read-only view); anything else
    (Arrow arrays: strings, binary, lists, nested, nulls) as torch's ``default_collate``
    gives its Python values."""
    if isinstance(column, np.ndarray):
        try:
            return torch.from_numpy(column if column.flags.writeable else column.copy())
        except TypeError:  # a dtype torch has no tensor of (datetime64, ...): as it is
            return column
    if hasattr(column, "to_pylist"):
        return default_collate(column.to_pylist())
    return column


def collate_columns(batch: Batch) -> Any:
    """The torch adapter's default collate (see the module docstring): a dict of the
    batch's columns as tensors; the one column's tensor where a sample is not a dict
    (fixed records: ``[B, record_bytes]`` ``uint8``; JSON lines: a list of ``bytes``).
    A batch whose format decodes its samples further (MDS) is collated from its
    samples, by ``default_collate``."""
    rows = batch.rows
    if rows is None or rows.table is None or not rows.formats[0].columnar:
        return default_collate(list(batch.samples))
    columns = batch.columns
    if not isinstance(columns, Mapping):  # a batch_transform's own result
        return columns
    found = {name: tensor_of(column) for name, column in columns.items()}
    if (
        len(found) == 1
        and len(rows)
        and not isinstance(rows.formats[0].sample(rows.table, 0), dict)
    ):
        return next(iter(found.values()))
    return found
