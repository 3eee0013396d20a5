"""Staging CUDA tensors: device-to-host copies straight into the staged memfd.

A CUDA tensor's bytes have to come to host memory once. ``tensor.to("cpu")`` would
copy them into new pageable memory (which the driver copies again, through its own
pinned buffer), and staging would copy them a third time into the memfd. Instead the
staged memfd is mapped, the mapping is registered with CUDA as pinned memory
(``cudaHostRegister``), and each tensor is copied into its place by the GPU's copy
engines, ``non_blocking`` on a side stream of its device, while the host copies the
CPU values of the same state dict. The order (:class:`DeviceCopies`):

1. :meth:`DeviceCopies.begin`: the mapping is registered, unless it already is (a
   spare registered ahead, see :mod:`.staging`).
2. :meth:`DeviceCopies.copy`, per tensor: the side stream of its device is made on
   first use and waits for that device's current stream, so the bytes saved are the
   ones the work queued so far leaves (what a synchronous ``.cpu()`` would see). On
   that stream the tensor is made contiguous if it is not, and its bytes are copied.
3. :meth:`DeviceCopies.finish` (always, after a failure too): the host waits for
   every side stream; only then is the mapping unregistered, and only after that
   may the caller unmap and seal the memfd. No copy can land in memory that is
   unmapped, or after the seal.

Where registering fails (a driver that refuses the range), the copies go on into
pageable memory: slower (the driver stages them), not wrong.

torch is imported only when a CUDA tensor is there; nothing here runs without one.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Final

from chunkd.errors import CheckpointError, UnsupportedStateError
from chunkd.memfd import WritableMapping

__all__ = ["DeviceCopies", "check_cuda", "is_cuda", "register", "unregister"]

log = logging.getLogger("chunkd.client")

#: ``cudaHostRegisterPortable``: the range counts as pinned in every CUDA context
_PORTABLE: Final = 1


def is_cuda(source: Any) -> bool:
    """Whether ``source`` is a torch tensor on a CUDA device (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(source, torch.Tensor) and source.device.type == "cuda"


def check_cuda(device: Any, path: str) -> None:
    """Raise unless this process can copy from CUDA device ``device``.

    A CUDA tensor in a process that sees no CUDA device (a child forked after CUDA
    started, a driver gone, ``CUDA_VISIBLE_DEVICES`` changed) cannot be saved.

    Raises:
        UnsupportedStateError: names the key path, the device and what this process sees.
    """
    import torch

    if torch.cuda.is_available():
        return
    built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    raise UnsupportedStateError(
        f"{path or '<root>'} is a tensor on {device}, and this process sees no CUDA device "
        f"(torch {torch.__version__}, {built}; CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); move it to the CPU first "
        "(.cpu()), or save from the process that owns the GPU"
    )


def register(mapping: WritableMapping) -> bool:
    """Register ``mapping`` with CUDA as pinned memory; False if the driver refused."""
    err = int(_cudart().cudaHostRegister(mapping.address, mapping.size, _PORTABLE))
    if err != 0:
        log.warning(
            "checkpoint staging: cudaHostRegister of %d bytes failed (CUDA error %d); "
            "copying from the GPU into pageable memory instead (slower)",
            mapping.size,
            err,
        )
        return False
    return True


def unregister(mapping: WritableMapping) -> None:
    """Undo :func:`register` (before the mapping goes)."""
    err = int(_cudart().cudaHostUnregister(mapping.address))
    if err != 0:  # the pages stay pinned until the process ends: memory, not bytes, at stake
        log.warning("checkpoint staging: cudaHostUnregister failed (CUDA error %d)", err)


def _cudart() -> Any:
    """torch's binding of the CUDA runtime (what DCP's own stager registers memory with)."""
    import torch

    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


class DeviceCopies:
    """The device-to-host copies of one save into ``mapping`` (see the module docstring).

    Args:
        mapping: the staged memfd, mapped writable (at least as long as the state).
        registered: whether ``mapping`` is registered already (a spare registered
            ahead); :meth:`finish` leaves such a registration to its owner.
    """

    def __init__(self, mapping: WritableMapping, *, registered: bool = False) -> None:
        import torch

        self._torch = torch
        self.mapping = mapping
        #: whether the copies go to pinned memory (registered here or ahead)
        self.pinned = registered
        self._registered_here = False
        self._host: Any = None
        self._streams: dict[int, Any] = {}

    def begin(self) -> None:
        """Register the mapping (unless it is) and view it as a ``uint8`` CPU tensor."""
        if not self.pinned:
            self.pinned = self._registered_here = register(self.mapping)
        self._host = self._torch.frombuffer(self.mapping.buffer(), dtype=self._torch.uint8)

    def copy(self, tensor: Any, at: int, path: str) -> None:
        """Queue the copy of ``tensor``'s bytes (C order) to ``at`` in the mapping.

        Raises:
            CheckpointError: CUDA failed to queue it (names the key path).
        """
        torch = self._torch
        try:
            stream = self._stream(tensor.device)
            with torch.cuda.stream(stream):
                flat = _device_flat(tensor.detach().resolve_conj().resolve_neg().contiguous())
                if flat.numel():
                    self._host[at : at + flat.numel()].copy_(flat, non_blocking=True)
        except RuntimeError as exc:
            raise CheckpointError(
                f"{path or '<root>'}: copying the tensor from {tensor.device} failed ({exc})"
            ) from exc

    def finish(self) -> None:
        """Wait for every copy, then unregister what :meth:`begin` registered.

        Raises:
            CheckpointError: a copy failed on the device.
        """
        failed: RuntimeError | None = None
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            try:
                stream.synchronize()
            except RuntimeError as exc:  # a device error; the other streams still drain
                failed = failed or exc
        self._host = None
        if self._registered_here:
            self._registered_here = False
            unregister(self.mapping)
        if failed is not None:
            raise CheckpointError(f"copying a checkpoint's tensors from the GPU failed: {failed}")

    def _stream(self, device: Any) -> Any:
        torch = self._torch
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=index)
            stream.wait_stream(torch.cuda.current_stream(index))
            self._streams[index] = stream
        return stream


def _device_flat(tensor: Any) -> Any:
    """A contiguous tensor's bytes as a flat ``uint8`` tensor on its device."""
    import torch

    flat = tensor.reshape(-1)
    if flat.numel() and (flat.stride(0) != 1 or flat.data_ptr() != tensor.data_ptr()):
        flat = tensor.clone(memory_format=torch.contiguous_format).reshape(-1)
    return flat.view(torch.uint8)
