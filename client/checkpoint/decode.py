"""Decoding a part's tree: new values (:class:`Decoder`) or values filled in place
(:func:`fill_into`), their bytes planned on a :class:`~.reader.PartReader`: CPU
tensors and arrays read into directly, CUDA tensors through the staging ring
(:mod:`.device`)."""

from __future__ import annotations

import base64
import struct
import sys
from collections.abc import Iterator
from functools import partial
from typing import Any

from chunkd.client.checkpoint.device import device_bytes
from chunkd.client.checkpoint.reader import PartReader
from chunkd.client.checkpoint.views import flat_bytes
from chunkd.errors import CheckpointError


def walk(node: Any, path: str) -> Iterator[tuple[dict[str, Any], str]]:
    """Every node that has bytes (tensors, arrays), with its key path."""
    if not isinstance(node, dict):
        return
    kind = node.get("t")
    if kind in ("tensor", "ndarray") and node.get("len"):
        yield node, path
    elif kind == "dict":
        for key, value in zip(node["keys"], node["values"], strict=True):
            yield from walk(value, f"{path}.{key}" if path else str(key))
    elif kind in ("list", "tuple"):
        for i, value in enumerate(node["items"]):
            yield from walk(value, f"{path}[{i}]")


def tensors_by_id(tree: Any) -> dict[int, dict[str, Any]]:
    """Each tensor node that has an ``id``, by id (what ``ref`` nodes point at)."""
    return {n["id"]: n for n, _ in walk(tree, "") if n.get("t") == "tensor" and "id" in n}


class Decoder:
    """Nodes into new values, their bytes planned on ``reader``.

    ``by_id`` holds the tensor nodes that ``ref`` nodes may point at, for a ref
    decoded without its owner. ``ring_cpu``: CPU tensors too go through the reader's
    staging ring (with its stand-in link: the GPU path's logic, tested on a CPU).
    """

    def __init__(
        self,
        reader: PartReader,
        map_location: Any,
        by_id: dict[int, dict[str, Any]] | None = None,
        *,
        ring_cpu: bool = False,
    ) -> None:
        self.reader = reader
        self.map_location = map_location
        self.tensors: dict[int, Any] = {}
        self.by_id = by_id or {}
        self.ring_cpu = ring_cpu

    def decode(self, node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        kind = node["t"]
        if kind == "dict":
            return {k: self.decode(v) for k, v in zip(node["keys"], node["values"], strict=True)}
        if kind == "list":
            return [self.decode(v) for v in node["items"]]
        if kind == "tuple":
            return tuple(self.decode(v) for v in node["items"])
        if kind == "int":
            return int(node["v"])
        if kind == "float":
            return float(struct.unpack("<d", struct.pack("<Q", node["bits"]))[0])
        if kind == "bytes":
            return base64.b64decode(node["b64"])
        if kind == "dtype":
            import torch

            return getattr(torch, node["name"])
        if kind == "tensor":
            tensor = self.new_tensor(node, self.map_location)
            if "id" in node:
                self.tensors[node["id"]] = tensor
            return tensor
        if kind == "ref":
            if node["id"] not in self.tensors and node["id"] in self.by_id:
                self.decode(self.by_id[node["id"]])  # its owner was not asked for
            return self.tensors[node["id"]]
        if kind == "ndarray":
            import numpy as np

            array = np.empty(node["shape"], dtype=np.dtype(node["dtype"]))
            if node.get("len"):
                self.reader.plan(node, array.reshape(-1).view(np.uint8).data)
            return array
        if kind == "npscalar":
            import numpy as np

            raw = base64.b64decode(node["b64"])
            return np.frombuffer(raw, dtype=np.dtype(node["dtype"]))[0].copy()
        raise CheckpointError(f"unknown value kind {kind!r} in the checkpoint (a newer chunkd?)")

    def new_tensor(self, node: dict[str, Any], device: Any = None) -> Any:
        """A tensor for ``node``, filled when the reader runs (on ``device``, or the CPU)."""
        import torch

        dtype = getattr(torch, node["dtype"])
        where = torch.device("cpu" if device is None else device)
        tensor = torch.empty(node["shape"], dtype=dtype, device=where)
        if node.get("len"):
            self.fill(tensor, node)
        return tensor

    def fill(self, tensor: Any, node: dict[str, Any]) -> None:
        """Have the reader fill ``tensor`` (same shape and dtype) with ``node``'s bytes."""
        kind = tensor.device.type
        if kind == "cuda" or (self.ring_cpu and kind == "cpu"):
            flat = device_bytes(tensor)
            if flat is not None:  # into the tensor's own memory, through the ring
                self.reader.plan_device(node, flat)
                return
            # A strided view on the device: a contiguous tensor beside it is filled,
            # then copied over on the device (memory: that one tensor, for a moment).
            dense = self.new_tensor(node, tensor.device)
            self.reader.after(partial(_copy, tensor, dense))
            return
        direct = (
            kind == "cpu"
            and tensor.is_contiguous()
            and not tensor.is_conj()
            and not tensor.is_neg()
        )
        flat = flat_bytes(tensor.detach()) if direct else None
        if flat is not None:  # straight from the chunks into the tensor's own memory
            self.reader.plan(node, flat)
            return
        # CPU strided views, other devices: through a CPU copy
        self.reader.after(partial(_copy, tensor, self.new_tensor(node)))


def _copy(target: Any, source: Any) -> None:
    import torch

    with torch.no_grad():
        target.copy_(source)


def fill_into(
    target: Any,
    node: Any,
    path: str,
    decoder: Decoder,
    strict: bool,
) -> Any:
    """Fill ``target`` from ``node`` in place where it can; returns the value to keep."""
    kind = node.get("t") if isinstance(node, dict) else None
    where = path or "<root>"
    if kind == "dict":
        if not isinstance(target, dict):
            raise CheckpointError(
                f"{where}: the checkpoint has a dict, the target a {type(target).__name__}"
            )
        saved = dict(zip(node["keys"], node["values"], strict=True))
        if strict:
            missing = [k for k in saved if k not in target]
            extra = [k for k in target if k not in saved]
            if missing or extra:
                raise CheckpointError(
                    f"{where}: keys differ from the checkpoint (only in the checkpoint: "
                    f"{missing[:5]}, only in the target: {extra[:5]}); pass strict=False"
                )
        for key, value in saved.items():
            sub = f"{path}.{key}" if path else str(key)
            if key in target:
                target[key] = fill_into(target[key], value, sub, decoder, strict)
            else:
                target[key] = decoder.decode(value)
        return target
    if kind == "list" and isinstance(target, list) and len(target) == len(node["items"]):
        for i, value in enumerate(node["items"]):
            target[i] = fill_into(target[i], value, f"{path}[{i}]", decoder, strict)
        return target
    if kind == "ref":  # a tied tensor: fill the target unless it is the owner's own
        owner = decoder.by_id[node["id"]]
        _check_tensor_target(target, owner, where)
        if decoder.tensors.get(node["id"]) is not target and owner.get("len"):
            decoder.fill(target, owner)
        return target
    if kind == "tensor":
        _check_tensor_target(target, node, where)
        if node.get("len"):
            decoder.fill(target, node)
        if "id" in node:
            decoder.tensors[node["id"]] = target
        return target
    if kind == "ndarray":
        np = sys.modules.get("numpy")
        if (
            np is not None
            and isinstance(target, np.ndarray)
            and target.flags.c_contiguous
            and target.flags.writeable
            and [*target.shape] == node["shape"]
            and target.dtype == np.dtype(node["dtype"])
        ):
            if node.get("len"):
                decoder.reader.plan(node, target.reshape(-1).view(np.uint8).data)
            return target
    return decoder.decode(node)


def _check_tensor_target(target: Any, node: dict[str, Any], where: str) -> None:
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(target, torch.Tensor):
        raise CheckpointError(
            f"{where}: the checkpoint has a tensor, the target a {type(target).__name__}"
        )
    if [*target.shape] != node["shape"] or target.dtype != getattr(torch, node["dtype"]):
        raise CheckpointError(
            f"{where}: the checkpoint has {node['dtype']}{node['shape']}, the target "
            f"{str(target.dtype).removeprefix('torch.')}{[*target.shape]}"
        )
