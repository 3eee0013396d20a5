"""Batches in pinned memory: :func:`pinned`, what :meth:`Batch.pin_memory
<chunkd.client.datasets.loader.Batch.pin_memory>` runs.

It is what torch's ``DataLoader(pin_memory=True)`` runs on a chunkd batch, in the
trainer's process: it puts a batch's tensors in page-locked memory, so that
``tensor.to("cuda", non_blocking=True)`` copies asynchronously. Without an accelerator
torch cannot pin: the batch is given back as it is (logged once).

It lives below the loader, not in the torch adapter (:mod:`chunkd.client.torch`, which
sits on the loader), so that the batch reaches it without an import back up. It knows a
batch only by what it hands over (its samples and its columns), so it imports nothing of
the loader either. torch is imported when a batch is pinned, never when this module is.
:mod:`chunkd.client.torch.pinned` re-exports :func:`pinned`.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, TypeVar

import numpy as np

__all__ = ["Pinnable", "pinned", "pinned_values"]

log = logging.getLogger(__name__)

_WARNED: list[bool] = []


class Pinnable(Protocol):
    """What :func:`pinned` needs of a batch: its :meth:`pin_memory`."""

    def pin_memory(self) -> Any: ...


P = TypeVar("P", bound=Pinnable)


def pinned(batch: P) -> P:
    """``batch`` with its tensors in pinned memory: ``batch.pin_memory()``."""
    result: P = batch.pin_memory()
    return result


def pinned_values(samples: Any, columns: Any | None) -> dict[str, Any] | None:
    """A batch's ``samples`` (and ``columns``, unless None) with their tensors, nested in
    dicts, lists and tuples, in pinned memory, by name; None where torch cannot pin (no
    accelerator: see the module docstring). A tensor met twice is pinned once."""
    import torch

    if not torch.cuda.is_available():
        if not _WARNED:
            _WARNED.append(True)
            log.info("no CUDA device: batches are not pinned")
        return None
    memo: dict[int, Any] = {}
    changes: dict[str, Any] = {"samples": _pin(samples, memo)}
    if columns is not None:
        changes["columns"] = _pin(columns, memo)
    return changes


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
