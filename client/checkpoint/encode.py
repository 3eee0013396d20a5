"""Encoding a state dict: the JSON tree of its values and the arrays whose bytes are staged.

Every value is checked here, before a byte is staged; what is not supported raises
:class:`~chunkd.errors.UnsupportedStateError` naming its key path. The tree's node
kinds are written down in ``docs/checkpoints.md``; :mod:`.decode` reads them back.
"""

from __future__ import annotations

import base64
import struct
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chunkd.client.checkpoint.cudastaging import check_cuda
from chunkd.errors import UnsupportedStateError

if TYPE_CHECKING:
    import numpy as np
    import torch


@dataclass
class Blob:
    """One array's bytes to stage: where they go, and how to get them."""

    path: str
    nbytes: int
    source: Any  # a torch.Tensor or numpy.ndarray
    node: dict[str, Any]


class Encoder:
    """Walks a state dict into a JSON tree and the arrays to stage. Checks everything."""

    def __init__(self) -> None:
        self.blobs: list[Blob] = []
        self._seen: dict[tuple[Any, ...], int] = {}
        self._cuda_checked = False
        self._torch = sys.modules.get("torch")
        self._np = sys.modules.get("numpy")

    def encode(self, value: Any, path: str) -> Any:
        np = self._np
        if np is not None and isinstance(value, np.generic):  # before float: np.float64 is one
            self._check_numpy_dtype(value.dtype, path)
            raw = np.asarray(value).tobytes()
            return {"t": "npscalar", "dtype": value.dtype.str, "b64": _b64(raw)}
        if value is None or isinstance(value, bool | str):
            return value
        if isinstance(value, int):
            return value if type(value) is int else {"t": "int", "v": int(value)}
        if isinstance(value, float):
            # The IEEE-754 bits: NaN signs and payloads survive, unlike float.hex().
            return {"t": "float", "bits": struct.unpack("<Q", struct.pack("<d", value))[0]}
        if isinstance(value, bytes | bytearray):
            return {"t": "bytes", "b64": base64.b64encode(value).decode()}
        if isinstance(value, dict):
            keys, values = [], []
            for key, item in value.items():
                if isinstance(key, bool) or not isinstance(key, str | int):
                    raise UnsupportedStateError(
                        f"{path or '<root>'} has a key {key!r} of type {type(key).__name__}; "
                        "checkpoint dict keys must be str or int"
                    )
                keys.append(key)
                values.append(self.encode(item, f"{path}.{key}" if path else str(key)))
            return {"t": "dict", "keys": keys, "values": values}
        if isinstance(value, list | tuple):
            kind = "list" if isinstance(value, list) else "tuple"
            if kind == "tuple" and type(value) is not tuple:
                raise _unsupported(path, value, "named tuples")
            items = [self.encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
            return {"t": kind, "items": items}
        torch = self._torch
        if torch is not None:
            if isinstance(value, torch.Tensor):
                return self._tensor(value, path)
            if isinstance(value, torch.dtype):
                return {"t": "dtype", "name": str(value).removeprefix("torch.")}
        if np is not None and isinstance(value, np.ndarray):
            return self._ndarray(value, path)
        raise _unsupported(path, value, None)

    def _tensor(self, tensor: torch.Tensor, path: str) -> dict[str, Any]:
        torch = self._torch
        assert torch is not None
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            raise _unsupported(path, tensor, "tensor subclasses (DTensor: use chunkd.client.dcp)")
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise _unsupported(path, tensor, f"{tensor.layout} or quantized tensors")
        if tensor.device.type == "meta":
            raise _unsupported(path, tensor, "tensors on the meta device (they hold no data)")
        if tensor.device.type == "cuda" and not self._cuda_checked:
            check_cuda(tensor.device, path)
            self._cuda_checked = True  # once a state: the answer is the process's
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.device,
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
            tensor.is_conj(),
            tensor.is_neg(),
        )
        if tensor.numel() and key in self._seen:
            return {"t": "ref", "id": self._seen[key]}
        node: dict[str, Any] = {
            "t": "tensor",
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": [*tensor.shape],
        }
        if tensor.numel():
            node["id"] = self._seen[key] = len(self._seen)
        self.blobs.append(Blob(path, tensor.numel() * tensor.element_size(), tensor, node))
        return node

    def _ndarray(self, array: np.ndarray[Any, Any], path: str) -> dict[str, Any]:
        self._check_numpy_dtype(array.dtype, path)
        node = {"t": "ndarray", "dtype": array.dtype.str, "shape": [*array.shape]}
        self.blobs.append(Blob(path, array.nbytes, array, node))
        return node

    def _check_numpy_dtype(self, dtype: Any, path: str) -> None:
        if dtype.hasobject or dtype.fields is not None:
            raise UnsupportedStateError(
                f"{path or '<root>'} is a numpy value of dtype {dtype}; object and structured "
                "dtypes cannot be checkpointed"
            )


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _unsupported(path: str, value: object, what: str | None) -> UnsupportedStateError:
    kind = type(value).__module__ + "." + type(value).__qualname__
    detail = f" ({what} are not supported)" if what else ""
    return UnsupportedStateError(
        f"{path or '<root>'} is a {kind}{detail}; a checkpoint holds dicts, lists, tuples, "
        "tensors, numpy arrays, and None/bool/int/float/str/bytes"
    )
