"""Tensors and arrays as bytes: the view a save copies from and the view a load fills.

torch and numpy are imported only when a value of theirs is there.
"""

from __future__ import annotations

import sys
from typing import Any


def blob_bytes(source: Any) -> memoryview:
    """The raw bytes of a tensor or array, C order, on the CPU (a copy only if needed)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(source, torch.Tensor):
        tensor = source.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        tensor = tensor.resolve_conj().resolve_neg().contiguous()
        if tensor.numel() == 0:
            return memoryview(b"")
        flat = flat_bytes(tensor)
        if flat is None:  # contiguous, yet a size-1 dimension keeps an odd stride
            flat = flat_bytes(tensor.clone(memory_format=torch.contiguous_format))
        assert flat is not None
        return flat
    import numpy as np

    array = np.ascontiguousarray(source)
    return array.reshape(-1).view(np.uint8).data


def view_address(view: memoryview) -> int:
    """The address of the first byte of a C-contiguous ``view`` (read-only or not)."""
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def flat_bytes(tensor: Any) -> memoryview | None:
    """A writable byte view of a contiguous CPU tensor's elements, or None."""
    import torch

    flat = tensor.reshape(-1)
    if flat.numel() and (flat.stride(0) != 1 or flat.data_ptr() != tensor.data_ptr()):
        return None
    return memoryview(flat.view(torch.uint8).numpy())
