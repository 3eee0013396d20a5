"""Batches in pinned memory: :func:`pinned`, what :meth:`Batch.pin_memory
<chunkd.client.datasets.loader.Batch.pin_memory>` runs.

It is what torch's ``DataLoader(pin_memory=True)`` runs on a chunkd batch, in the
trainer's process: it puts a batch's tensors in page-locked memory, so that
``tensor.to("cuda", non_blocking=True)`` copies asynchronously. Without an accelerator
torch cannot pin: the batch is given back as it is (logged once).

It lives beside the loader, not in the torch adapter (:mod:`chunkd.client.torch`, which
sits on the loader), so that the batch reaches it without an import back up; torch is
imported when a batch is pinned, never when this module is.
:mod:`chunkd.client.torch.pinned` re-exports it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from chunkd.client.datasets.loader import Batch

__all__ = ["pinned"]

log = logging.getLogger(__name__)

_WARNED: list[bool] = []


def pinned(batch: Batch) -> Batch:
    """``batch`` with its tensors (in ``samples`` and ``columns``, nested in dicts,
    lists and tuples) in pinned memory (see the module docstring)."""
    import torch

    if not torch.cuda.is_available():
        if not _WARNED:
            _WARNED.append(True)
            log.info("no CUDA device: batches are not pinned")
        return batch
    memo: dict[int, Any] = {}
    changes: dict[str, Any] = {"samples": _pin(batch.samples, memo)}
    if batch.rows is not None or batch._columns is not None:
        changes["columns"] = _pin(batch.columns, memo)
    return batch._replace(**changes)


def _pin(value: Any, memo: dict[int, Any]) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        found = memo.get(id(value))
        if found is None:
            found = memo[id(value)] = value.pin_memory()
        return found
    if isinstance(value, np.ndarray) and value.dtype != object:
        try:
            return _pin(torch.from_numpy(value.copy()), memo)
        except TypeError:
            return value
    if isinstance(value, dict):
        return {k: _pin(v, memo) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_pin(v, memo) for v in value)
    return value
