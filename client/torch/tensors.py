"""Zero-copy tensors over the bytes of a view.

:func:`as_tensor` is a tensor over a view from :meth:`Client.read
<chunkd.client.Client.read>`, without a copy. The view maps the daemon's **sealed**
chunks read-only, so the tensor must never be written: torch has no read-only tensors,
and a write through a ``PROT_READ`` mapping kills the process with ``SIGSEGV`` (not an
exception). ``copy=True`` gives a writable tensor of its own.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["as_tensor"]


def as_tensor(
    view: memoryview | bytes | bytearray,
    dtype: torch.dtype = torch.uint8,
    shape: Sequence[int] | None = None,
    *,
    copy: bool = False,
) -> torch.Tensor:
    """A 1-D (or ``shape``-d) tensor over the bytes of a view, without a copy.

    The tensor shares the view's memory and keeps it mapped for as long as the
    tensor lives. No ``UserWarning`` about a non-writable buffer is raised.

    Warning:
        Never write to the tensor (in place: ``t[0] = 1``, ``t.add_(1)``,
        ``torch.add(..., out=t)``) unless ``copy=True``. The bytes of a
        :meth:`Client.read <chunkd.client.Client.read>` view are the daemon's sealed
        chunks, mapped read-only: torch cannot mark a tensor read-only, and a write
        through a ``PROT_READ`` mapping ends the process with ``SIGSEGV``. Operations
        that make a new tensor (``t.float()``, ``t + 1``, ``t.to("cuda")``,
        ``torch.stack``, pinning) are fine.

    Args:
        view: the bytes, e.g. from ``Client.read``; any C-contiguous buffer.
        dtype: the element type; the view's length must be a multiple of its size.
        shape: reshape to this (without a copy); its product must match.
        copy: return a writable tensor over a copy of the bytes instead.

    Raises:
        ValueError: the view's length does not fit ``dtype`` or ``shape``.
    """
    data = memoryview(view)
    if data.ndim != 1 or data.format != "B":
        data = data.cast("B")
    itemsize = dtype.itemsize
    if len(data) % itemsize:
        raise ValueError(
            f"a view of {len(data)} bytes does not split into {dtype} elements of "
            f"{itemsize} bytes; read a length that is a multiple of {itemsize}"
        )
    if not len(data):
        tensor = torch.empty(0, dtype=dtype)
    elif copy:
        tensor = torch.frombuffer(bytearray(data), dtype=dtype)
    elif data.readonly:
        tensor = torch.frombuffer(_writable_alias(data), dtype=dtype)
    else:
        tensor = torch.frombuffer(data, dtype=dtype)
    if shape is not None:
        try:
            tensor = tensor.view(tuple(shape))
        except RuntimeError as exc:
            raise ValueError(
                f"{tensor.numel()} elements of {dtype} cannot take the shape {tuple(shape)}"
            ) from exc
    return tensor


def _writable_alias(data: memoryview) -> ctypes.Array[ctypes.c_ubyte]:
    """A ctypes array at the address of a read-only view, holding the view alive.

    ``torch.frombuffer`` warns on every read-only buffer (torch has no read-only
    tensors). Silencing that with ``warnings.catch_warnings()`` swaps the process's
    warning filters, which races with other threads before Python 3.14; a buffer that
    does not claim to be read-only draws no warning and touches no global state. The
    promise not to write is the caller's, exactly as with the warning.
    """
    address = np.frombuffer(data, dtype=np.uint8).ctypes.data
    alias = (ctypes.c_ubyte * len(data)).from_address(address)
    alias._chunkd_view = data  # type: ignore[attr-defined]  # the mapping lives as long as this
    return alias
