"""Checkpoints through chunkd: save, async_save, load and load_into.

::

    from chunkd.client import checkpoint

    handle = checkpoint.async_save(model.state_dict(), "ckpt/run1/step-100")
    ...                                   # training goes on; tensors may change at once
    handle.wait()                         # committed in the backend (durability="remote")
    state = checkpoint.load("ckpt/run1/step-100")
    checkpoint.load_into(model.state_dict(), "ckpt/run1/step-100")   # in place

The trainer's only blocking cost is a copy of its tensors into one memfd, which is
then sealed and handed to the daemon with its layout. The daemon chunks, hashes,
deduplicates, writes to disk, uploads and commits (see
:mod:`chunkd.gateway.checkpoints` for the commit protocol and ``docs/checkpoints.md``
for the format). The trainer may exit, or be killed, once :func:`async_save` has
returned: the daemon holds the bytes.

What a state dict may hold: dicts (``str`` or ``int`` keys), lists, tuples, ``None``,
``bool``, ``int``, ``float``, ``str``, ``bytes``, ``torch.dtype``, torch tensors of any
dtype on any device (strided, not quantized; they load on the CPU unless
``map_location`` says otherwise), numpy arrays and numpy scalars (not of object or
structured dtypes). Anything else fails before a byte is staged, naming its key path.
The same tensor reached twice (tied weights: same storage, offset, shape, strides and
dtype) is stored once and loads as one tensor; other views are saved as their own
values.

Layout staged for the daemon: tensors of at least :data:`OWN_SEGMENT_BYTES` get a
segment each (a changed tensor changes only its own chunks, so a step that changes
a quarter of the weights uploads about a quarter); smaller values are packed
together, 64-byte aligned, into shared segments of up to ``chunk_bytes``.
"""

from __future__ import annotations

import base64
import builtins
import json
import mmap
import os
import socket
import struct
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from chunkd import memfd
from chunkd.client.core import Client
from chunkd.client.protocol import DURABILITY_LEVELS
from chunkd.errors import (
    CheckpointError,
    ChunkdError,
    IntegrityError,
    UnsupportedStateError,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "OWN_SEGMENT_BYTES",
    "CheckpointReader",
    "SaveHandle",
    "SaveResult",
    "async_save",
    "commit",
    "delete",
    "gc",
    "list",
    "load",
    "load_into",
    "manifest",
    "pages",
    "save",
]

#: values at least this large get a segment (and so chunks) of their own
OWN_SEGMENT_BYTES: Final = 256 * 1024
_ALIGN: Final = 64
_COPY_THREADS: Final = 4
#: chunks asked for in one request: 256 MiB, which a cold backend must deliver
#: within the client's timeout
_CHUNKS_PER_REQUEST: Final = 64
#: a commit waits in the daemon until every rank's part is in the backend
_COMMIT_TIMEOUT: Final = 3600.0
#: a collection over a large backend lists and deletes for a long time
_GC_TIMEOUT: Final = 6 * 3600.0
#: checkpoints asked for in one listing page
_LIST_PAGE: Final = 1000

_default: Client | None = None
_default_lock = threading.Lock()


def _client(client: Client | None) -> Client:
    global _default  # one lazily made connection per process
    if client is not None:
        return client
    with _default_lock:
        if _default is None or _default.closed:
            _default = Client()
        return _default


# -- encoding a state dict -------------------------------------------------------------


@dataclass
class _Blob:
    """One array's bytes to stage: where they go, and how to get them."""

    path: str
    nbytes: int
    source: Any  # a torch.Tensor or numpy.ndarray
    node: dict[str, Any]


class _Encoder:
    """Walks a state dict into a JSON tree and the arrays to stage. Checks everything."""

    def __init__(self) -> None:
        self.blobs: builtins.list[_Blob] = []
        self._seen: dict[tuple[Any, ...], int] = {}
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
        if isinstance(value, builtins.list | tuple):
            kind = "list" if isinstance(value, builtins.list) else "tuple"
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
        self.blobs.append(_Blob(path, tensor.numel() * tensor.element_size(), tensor, node))
        return node

    def _ndarray(self, array: np.ndarray[Any, Any], path: str) -> dict[str, Any]:
        self._check_numpy_dtype(array.dtype, path)
        node = {"t": "ndarray", "dtype": array.dtype.str, "shape": [*array.shape]}
        self.blobs.append(_Blob(path, array.nbytes, array, node))
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


def _plan(
    blobs: builtins.list[_Blob], chunk_bytes: int
) -> tuple[builtins.list[tuple[int, int]], int]:
    """Give each blob a place; returns the segments (offset, size) and the total size."""
    segments: builtins.list[tuple[int, int]] = []
    offset = 0
    pack_start: int | None = None

    def close_pack() -> None:
        nonlocal pack_start
        if pack_start is not None:
            segments.append((pack_start, offset - pack_start))
            pack_start = None

    for blob in blobs:
        if blob.nbytes >= OWN_SEGMENT_BYTES:
            close_pack()
            offset = _round_up(offset, mmap.PAGESIZE)
            blob.node |= {"seg": len(segments), "off": 0, "len": blob.nbytes}
            segments.append((offset, blob.nbytes))
            offset += blob.nbytes
            continue
        start = _round_up(offset, _ALIGN)
        if pack_start is not None and start + blob.nbytes - pack_start > chunk_bytes:
            close_pack()
        if pack_start is None:
            offset = start = _round_up(offset, mmap.PAGESIZE)
            pack_start = start
        blob.node |= {"seg": len(segments), "off": start - pack_start, "len": blob.nbytes}
        offset = start + blob.nbytes
    close_pack()
    return segments, offset


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _blob_bytes(source: Any) -> memoryview:
    """The raw bytes of a tensor or array, C order, on the CPU (a copy only if needed)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(source, torch.Tensor):
        tensor = source.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        tensor = tensor.resolve_conj().resolve_neg().contiguous()
        if tensor.numel() == 0:
            return memoryview(b"")
        flat = _flat_bytes(tensor)
        if flat is None:  # contiguous, yet a size-1 dimension keeps an odd stride
            flat = _flat_bytes(tensor.clone(memory_format=torch.contiguous_format))
        assert flat is not None
        return flat
    import numpy as np

    array = np.ascontiguousarray(source)
    return array.reshape(-1).view(np.uint8).data


def _stage(
    blobs: builtins.list[_Blob], segments: builtins.list[tuple[int, int]], total: int
) -> int:
    """Copy every blob into a memfd (the spare, when it is big enough) and seal it."""
    fd = _SPARE.take(total)
    if fd is None:
        fd = memfd.create("chunkd-checkpoint")
    try:
        os.ftruncate(fd, total)  # grows a new memfd; trims a larger spare

        def put(blob: _Blob) -> None:
            at = segments[blob.node["seg"]][0] + blob.node["off"]
            memfd.write_at(fd, _blob_bytes(blob.source), at)

        big = [b for b in blobs if b.nbytes >= OWN_SEGMENT_BYTES]
        small = [b for b in blobs if b.nbytes < OWN_SEGMENT_BYTES]
        for blob in small:
            put(blob)
        if len(big) > 1:
            with ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="chunkd-stage") as pool:
                [*pool.map(put, big)]
        else:
            for blob in big:
                put(blob)
        memfd.seal(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Spare:
    """One memfd whose memory is allocated ahead of the next save.

    Most of the cost of staging into a new memfd is the kernel handing out fresh
    pages (about 2 GB/s on the development VM, against 4.7 GB/s into pages that
    exist). After each save a thread allocates the next memfd's pages
    (``posix_fallocate``) while training goes on, so the next save only copies.
    It costs one state's worth of shared memory between saves; set
    ``CHUNKD_CKPT_SPARE=0`` to go without.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._size = 0
        self.enabled = os.environ.get("CHUNKD_CKPT_SPARE", "1") != "0"

    def take(self, size: int) -> int | None:
        """The spare memfd if it holds at least ``size`` bytes (the caller owns it)."""
        with self._lock:
            if self._fd is None or self._size < size:
                return None
            fd, self._fd = self._fd, None
            return fd

    def prepare(self, size: int) -> None:
        """Allocate a spare of ``size`` bytes in the background (if none as big is ready)."""
        if not self.enabled or size == 0:
            return
        with self._lock:
            if self._fd is not None and self._size >= size:
                return
        threading.Thread(
            target=self._allocate, args=(size,), name="chunkd-spare", daemon=True
        ).start()

    def _allocate(self, size: int) -> None:
        fd = memfd.create("chunkd-checkpoint")
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:  # no room in shared memory now: the next save allocates as it goes
            os.close(fd)
            return
        with self._lock:
            old, self._fd, self._size = self._fd, fd, size
        if old is not None:
            os.close(old)

    def forget_in_child(self) -> None:
        """After fork: the child must not write into the memory its parent will send."""
        self._lock = threading.Lock()  # another thread may have held it at the fork
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # the child's copy only


_SPARE: Final = _Spare()
os.register_at_fork(after_in_child=_SPARE.forget_in_child)


def _sealed_json(doc: Any) -> int:
    return memfd.sealed(json.dumps(doc, separators=(",", ":")).encode(), "chunkd-layout")


# -- saving ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveResult:
    """What a finished save reports (for this rank's part)."""

    name: str
    #: blake3 of the committed manifest (of this rank's part for commit="none" saves)
    manifest_id: str | None
    #: the durability reached: "staged", "local" or "remote"
    durability: str | None
    #: bytes of tensors and arrays staged by this rank
    logical_bytes: int
    #: bytes this rank's save uploaded (chunks the backend did not have yet)
    new_bytes: int
    #: bytes that were already in the backend (other ranks, earlier steps)
    dedup_bytes: int


class SaveHandle:
    """A save in progress in the daemon. :func:`save` returns one that is done."""

    def __init__(self, client: Client, name: str, job: dict[str, Any], durability: str) -> None:
        self.name = name
        self.job_id = str(job["job"])
        self.durability = durability
        self.save_id = str(job["save_id"])
        #: which save this is: a daemon that restarted (and so forgot the job) looks
        #: for it in the backend by these
        self._save: dict[str, Any] = {
            "name": name,
            "save_id": self.save_id,
            "rank": int(job.get("rank", 0)),
            "world_size": int(job.get("world_size", 1)),
            "commit": str(job.get("commit") or "auto"),
        }
        self._client = client
        self._last = job
        self._done = False

    def __repr__(self) -> str:
        return f"<SaveHandle {self.name} {self._last.get('state')}>"

    def wait(self, timeout: float | None = None, *, level: str | None = None) -> bool:
        """Wait until the save reached its durability (or ``level``); False on timeout.

        Raises:
            CheckpointError, BackendForbiddenError, ...: the save failed.
        """
        wanted = level or self.durability
        if wanted not in DURABILITY_LEVELS:
            raise ValueError(f"level must be one of {DURABILITY_LEVELS}; got {wanted!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 10.0 if deadline is None else max(0.0, deadline - time.monotonic())
            fields = {"job": self.job_id, "level": wanted, "timeout": min(left, 10)} | self._save
            with self._client.request(
                "ckpt_wait", fields, what=f"waiting for checkpoint {self.name}"
            ) as answer:
                reply = answer.header
            self._last = reply
            reached = reply.get("durability")
            level_of = DURABILITY_LEVELS.index
            if reached is not None and level_of(reached) >= level_of(wanted):
                self._done = level_of(reached) >= level_of(self.durability)
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def done(self) -> bool:
        """Whether the save reached its durability (asks the daemon without waiting)."""
        return self._done or self.wait(0)

    def result(self, timeout: float | None = None) -> SaveResult:
        """Wait for the save and report it.

        Raises:
            TimeoutError: it did not finish within ``timeout`` seconds.
        """
        if not self.wait(timeout):
            raise TimeoutError(f"checkpoint {self.name} did not reach {self.durability} in time")
        job = self._last
        return SaveResult(
            name=self.name,
            manifest_id=job.get("manifest_id"),
            durability=job.get("durability"),
            logical_bytes=int(job.get("logical_bytes", 0)),
            new_bytes=int(job.get("new_bytes", 0)),
            dedup_bytes=int(job.get("dedup_bytes", 0)),
        )


def _distributed() -> tuple[int, int, Any] | None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), dist
    return None


def async_save(
    state_dict: Any,
    name: str,
    *,
    durability: str = "remote",
    overwrite: bool = False,
    step: int | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    save_id: str | None = None,
    client: Client | None = None,
    _commit: str = "auto",
) -> SaveHandle:
    """Stage ``state_dict`` into shared memory and hand it to the daemon; return at once.

    The tensors may change as soon as this returns. ``name`` is ``BACKEND/PATH`` on a
    writable backend.

    Under ``torch.distributed`` (and without an explicit ``world_size``) the save is
    collective, as in DCP: every rank calls it with its own part, the ranks agree on
    a save id and check that each can encode its state before any of them stages
    (one ``all_gather_object``), and rank 0 commits once every part is durable. To
    save from one rank only, pass ``world_size=1``. Without ``torch.distributed``,
    ``rank``, ``world_size`` and ``save_id`` (the same on every rank) say the same.

    Raises:
        UnsupportedStateError: something in ``state_dict`` (or, in a collective
            save, in another rank's) cannot be saved; nothing was staged.
        CheckpointExistsError: ``name`` exists and ``overwrite`` is False.
        ReadOnlyBackendError, BackendForbiddenError, UnknownBackendError
    """
    if durability not in DURABILITY_LEVELS:
        raise ValueError(f"durability must be one of {DURABILITY_LEVELS}; got {durability!r}")
    encoder = _Encoder()
    problem: UnsupportedStateError | None = None
    try:
        tree = encoder.encode(state_dict, "")
    except UnsupportedStateError as exc:
        problem = exc
    dist = _distributed()
    if dist is not None and world_size is None:
        rank = dist[0] if rank is None else rank
        world_size = dist[1]
        everyone: builtins.list[Any] = [None] * world_size
        dist[2].all_gather_object(everyone, (str(problem or ""), save_id or uuid.uuid4().hex))
        others = [f"rank {r}: {e}" for r, (e, _) in enumerate(everyone) if e and r != dist[0]]
        if others and problem is None:
            raise UnsupportedStateError(
                "not saved: another rank cannot save its state (" + "; ".join(others) + ")"
            )
        save_id = str(everyone[0][1])
    if problem is not None:
        raise problem
    rank, world_size = rank or 0, world_size or 1
    if world_size > 1 and save_id is None:
        raise ValueError(
            "a save with world_size > 1 needs a save_id that every rank passes (or a "
            "torch.distributed process group, which agrees on one)"
        )
    save_id = save_id or uuid.uuid4().hex
    chunkd = _client(client)
    chunk_bytes = chunkd.chunk_bytes
    segments, total = _plan(encoder.blobs, chunk_bytes)
    data_fd = _stage(encoder.blobs, segments, total)
    _SPARE.prepare(total)
    try:
        layout_fd = _sealed_json({"segments": [[*s] for s in segments], "tree": tree})
        try:
            fields = {
                "name": name,
                "save_id": save_id,
                "rank": rank,
                "world_size": world_size,
                "durability": durability,
                "overwrite": overwrite,
                "commit": _commit,
                "step": step,
            }
            with chunkd.request(
                "ckpt_save", fields, fds=[layout_fd, data_fd], what=f"saving {name}"
            ) as answer:
                reply = answer.header
        finally:
            os.close(layout_fd)
    finally:
        os.close(data_fd)
    return SaveHandle(chunkd, name, reply, durability)


def save(
    state_dict: Any,
    name: str,
    *,
    durability: str = "remote",
    overwrite: bool = False,
    timeout: float | None = None,
    **kwargs: Any,
) -> SaveHandle:
    """:func:`async_save`, then wait until the save is ``durability``-durable.

    Raises:
        TimeoutError: it was not durable within ``timeout`` seconds (it goes on).
        Whatever :func:`async_save` raises, and the error a failed save reports.
    """
    handle = async_save(state_dict, name, durability=durability, overwrite=overwrite, **kwargs)
    if not handle.wait(timeout):
        raise TimeoutError(f"checkpoint {name} was not {durability}-durable in {timeout}s")
    return handle


# -- loading ---------------------------------------------------------------------------


def manifest(name: str, *, client: Client | None = None) -> dict[str, Any]:
    """The committed manifest of ``name`` with its parts (see ``docs/checkpoints.md``).

    Raises:
        CheckpointNotFoundError: there is no such checkpoint (or its manifest is torn).
    """
    answer = _client(client).request("ckpt_manifest", {"name": name}, what=f"loading {name}")
    return _json_fd(answer.fds, f"the manifest of {name}")


def _json_fd(fds: builtins.list[int], what: str) -> dict[str, Any]:
    """The JSON object in the one sealed memfd of an answer (``fds`` are closed)."""
    try:
        if len(fds) != 1:
            raise CheckpointError(f"the daemon answered {what} without its fd")
        size = os.fstat(fds[0]).st_size
        doc = json.loads(os.pread(fds[0], size, 0))
    finally:
        memfd.close_all(fds)
    if not isinstance(doc, dict):
        raise CheckpointError(f"{what} is not a JSON object")
    return doc


class _Reader:
    """The bytes of one part's segments, copied out of the daemon's chunks.

    Copies are planned first (:meth:`plan`: this node's bytes go to that buffer),
    then :meth:`run` asks the daemon for the chunks, 64 at a time (256 MiB),
    and reads each piece straight from the chunk's sealed memfd into its target
    with ``preadv``, on a few threads: no mapping of the chunk is set up (that
    costs more than the copy), and at most one batch of fds is open at once.
    """

    def __init__(self, client: Client, name: str, part: dict[str, Any]) -> None:
        self.client = client
        self.name = name
        self.backend = name.split("/", 1)[0]
        self.segments: builtins.list[builtins.list[tuple[str, int]]] = [
            [(str(c), int(n)) for c, n in seg["chunks"]] for seg in part["segments"]
        ]
        self._owners: dict[str, builtins.list[str]] = {}
        # chunk id -> (start, stop, target) pieces to read from it
        self._planned: dict[str, builtins.list[tuple[int, int, memoryview]]] = {}
        self._after: builtins.list[Callable[[], None]] = []

    def note_owner(self, node: dict[str, Any], path: str) -> None:
        for cid, _, _ in self._pieces(node["seg"], node["off"], node["len"]):
            self._owners.setdefault(cid, []).append(path)

    def plan(self, node: dict[str, Any], target: memoryview) -> None:
        """Have :meth:`run` fill ``target`` with the bytes of ``node``."""
        if target.nbytes != node["len"]:
            raise CheckpointError(
                f"checkpoint {self.name}: a value of {node['len']} bytes has a "
                f"{target.nbytes}-byte target"
            )
        at = 0
        for cid, lo, hi in self._pieces(node["seg"], node["off"], node["len"]):
            self._planned.setdefault(cid, []).append((lo, hi, target[at : at + hi - lo]))
            at += hi - lo
        if at != node["len"]:
            raise CheckpointError(f"checkpoint {self.name}: a value's bytes are incomplete")

    def after(self, step: Callable[[], None]) -> None:
        """Run ``step`` once every planned copy is done (e.g. a copy to a GPU)."""
        self._after.append(step)

    def run(self) -> None:
        """Do every planned copy, then every step given to :meth:`after`."""
        planned, self._planned = self._planned, {}
        wanted = builtins.list(planned)
        if wanted:  # each host starts at its own place: N nodes restoring one
            # checkpoint spread their requests over the chunks' owners (docs/peers.md)
            turn = zlib.crc32(socket.gethostname().encode()) % len(wanted)
            wanted = wanted[turn:] + wanted[:turn]
        with ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="chunkd-load") as pool:
            for start in range(0, len(wanted), _CHUNKS_PER_REQUEST):
                batch = wanted[start : start + _CHUNKS_PER_REQUEST]
                fds = self._chunks(batch)
                try:
                    jobs = [(fd, planned[cid]) for cid, fd in zip(batch, fds, strict=True)]
                    for _ in pool.map(_read_pieces, jobs):
                        pass
                finally:
                    memfd.close_all(fds)
        steps, self._after = self._after, []
        for step in steps:
            step()

    def _chunks(self, batch: builtins.list[str]) -> builtins.list[int]:
        try:
            answer = self.client.request(
                "ckpt_chunks", {"backend": self.backend, "ids": batch}, what=f"loading {self.name}"
            )
        except ChunkdError as exc:
            raise self._named(exc) from exc
        fds = answer.fds
        if len(fds) != len(batch) or len(answer.header.get("sizes", [])) != len(batch):
            answer.close()
            raise CheckpointError(
                f"the daemon sent {len(fds)} chunks of {len(batch)} for {self.name}"
            )
        return fds

    def _named(self, exc: ChunkdError) -> ChunkdError:
        cid = getattr(exc, "chunk_id", None)
        paths = self._owners.get(cid or "", [])
        if not paths:
            return exc
        shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
        cls = type(exc) if isinstance(exc, IntegrityError | CheckpointError) else CheckpointError
        return cls(f"checkpoint {self.name}: cannot load {shown}: {exc}")

    def _pieces(self, seg: int, off: int, length: int) -> Iterator[tuple[str, int, int]]:
        """(chunk id, start in chunk, stop in chunk) covering ``length`` bytes at ``off``."""
        pos = 0
        for cid, size in self.segments[seg]:
            lo, hi = max(off, pos), min(off + length, pos + size)
            if lo < hi:
                yield cid, lo - pos, hi - pos
            pos += size
            if pos >= off + length:
                return


def _read_pieces(job: tuple[int, builtins.list[tuple[int, int, memoryview]]]) -> None:
    fd, pieces = job
    for lo, _, target in pieces:
        at = 0
        while at < target.nbytes:
            got = os.preadv(fd, [target[at:]], lo + at)
            if got <= 0:
                raise CheckpointError("a chunk from the daemon is shorter than its size")
            at += got


def _open_part(name: str, client: Client | None, part: int | None) -> tuple[_Reader, Any]:
    chunkd = _client(client)
    doc = manifest(name, client=chunkd)
    parts = doc["parts"]
    if part is None:
        dist = _distributed()
        part = dist[0] if dist is not None and dist[1] == len(parts) else 0
    chosen = next((p for p in parts if p["rank"] == part), None)
    if chosen is None:
        raise CheckpointError(
            f"checkpoint {name} has parts for ranks 0..{len(parts) - 1}, not {part}; "
            "pass part= (or use chunkd.client.dcp to reshard)"
        )
    return _Reader(chunkd, name, chosen), chosen["tree"]


class CheckpointReader:
    """One rank's part of a committed checkpoint, read value by value.

    For adapters that need only some values of a part (``chunkd.client.dcp``):
    :attr:`values` maps each top-level key of the saved dict to its encoded node;
    :meth:`read` fetches and decodes just those.

    Raises:
        CheckpointNotFoundError: no committed checkpoint has that name.
    """

    def __init__(self, name: str, part: int = 0, *, client: Client | None = None) -> None:
        self.name = name
        self._reader, self.tree = _open_part(name, client, part)
        self.values: dict[Any, Any] = {}
        if isinstance(self.tree, dict) and self.tree.get("t") == "dict":
            self.values = dict(zip(self.tree["keys"], self.tree["values"], strict=True))
        self._by_id = _ids(self.tree)
        for node, path in _walk(self.tree, ""):
            self._reader.note_owner(node, path)

    def read(self, keys: builtins.list[Any]) -> dict[Any, Any]:
        """Decode the top-level values ``keys`` (tensors on the CPU).

        A tied tensor read without the key that holds its bytes still loads: the
        owner's bytes are fetched for it.
        """
        decoder = _Decoder(self._reader, "cpu", self._by_id)
        values = {k: decoder.decode(self.values[k]) for k in keys}
        self._reader.run()
        return values

    def close(self) -> None:
        """Nothing stays open between reads; kept for ``with``."""

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def commit(
    name: str,
    save_id: str,
    world_size: int,
    *,
    overwrite: bool = False,
    extra: dict[str, Any] | None = None,
    client: Client | None = None,
) -> str:
    """Commit a save made with ``_commit="none"`` once all its parts are in; its id.

    ``extra`` is merged into the manifest (``chunkd.client.dcp`` keeps DCP's
    metadata there).
    """
    fd = _sealed_json(extra or {})
    try:
        answer = _client(client).request(
            "ckpt_commit",
            {"name": name, "save_id": save_id, "world_size": world_size, "overwrite": overwrite},
            fds=[fd],
            timeout=_COMMIT_TIMEOUT,
            what=f"committing {name}",
        )
    finally:
        os.close(fd)
    answer.close()
    return str(answer.header["manifest_id"])


def load(
    name: str,
    *,
    map_location: Any = "cpu",
    part: int | None = None,
    client: Client | None = None,
) -> Any:
    """Load checkpoint ``name`` into new tensors and arrays.

    ``part`` picks a rank's part (default: this rank under ``torch.distributed`` when
    the world sizes match, else 0).

    Raises:
        CheckpointNotFoundError: no committed checkpoint has that name.
        IntegrityError: a chunk is damaged in the backend; the message names the tensor.
    """
    reader, tree = _open_part(name, client, part)
    for node, path in _walk(tree, ""):
        reader.note_owner(node, path)
    state = _Decoder(reader, map_location).decode(tree)
    reader.run()
    return state


def load_into(
    state_dict: Any,
    name: str,
    *,
    strict: bool = True,
    part: int | None = None,
    client: Client | None = None,
) -> Any:
    """Fill the tensors and arrays of ``state_dict`` in place from checkpoint ``name``.

    Tensors keep their storage (pinned, CUDA or plain); their shapes and dtypes must
    match the checkpoint's. Other values (step counters, scalars, strings) are set
    in their dicts and lists. With ``strict``, a key missing on either side is an error.
    Returns ``state_dict``.

    Raises:
        CheckpointError: the checkpoint and ``state_dict`` do not match (named).
    """
    reader, tree = _open_part(name, client, part)
    for node, path in _walk(tree, ""):
        reader.note_owner(node, path)
    _fill(state_dict, tree, "", _Decoder(reader, "cpu", _ids(tree)), strict)
    reader.run()
    return state_dict


def _walk(node: Any, path: str) -> Iterator[tuple[dict[str, Any], str]]:
    """Every node that has bytes (tensors, arrays), with its key path."""
    if not isinstance(node, dict):
        return
    kind = node.get("t")
    if kind in ("tensor", "ndarray") and node.get("len"):
        yield node, path
    elif kind == "dict":
        for key, value in zip(node["keys"], node["values"], strict=True):
            yield from _walk(value, f"{path}.{key}" if path else str(key))
    elif kind in ("list", "tuple"):
        for i, value in enumerate(node["items"]):
            yield from _walk(value, f"{path}[{i}]")


def _refs(node: Any) -> Iterator[int]:
    """The ids that ``ref`` nodes under ``node`` point at."""
    if not isinstance(node, dict):
        return
    kind = node.get("t")
    if kind == "ref":
        yield node["id"]
    elif kind == "dict":
        for value in node["values"]:
            yield from _refs(value)
    elif kind in ("list", "tuple"):
        for value in node["items"]:
            yield from _refs(value)


class _Decoder:
    def __init__(
        self, reader: _Reader, map_location: Any, by_id: dict[int, dict[str, Any]] | None = None
    ) -> None:
        self.reader = reader
        self.map_location = map_location
        self.tensors: dict[int, Any] = {}
        self.by_id = by_id or {}

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
        direct = (
            tensor.device.type == "cpu"
            and tensor.is_contiguous()
            and not tensor.is_conj()
            and not tensor.is_neg()
        )
        flat = _flat_bytes(tensor.detach()) if direct else None
        if flat is not None:  # straight from the chunks into the tensor's own memory
            self.reader.plan(node, flat)
            return
        staging = self.new_tensor(node)  # CUDA, strided views: through a CPU copy

        def copy() -> None:
            import torch

            with torch.no_grad():
                tensor.copy_(staging)

        self.reader.after(copy)


def _flat_bytes(tensor: Any) -> memoryview | None:
    """A writable byte view of a contiguous CPU tensor's elements, or None."""
    import torch

    flat = tensor.reshape(-1)
    if flat.numel() and (flat.stride(0) != 1 or flat.data_ptr() != tensor.data_ptr()):
        return None
    return memoryview(flat.view(torch.uint8).numpy())


def _tensor_bytes(tensor: Any) -> memoryview:
    flat = _flat_bytes(tensor)
    if flat is None:
        raise CheckpointError("internal: a fresh tensor is not laid out contiguously")
    return flat


def _fill(
    target: Any,
    node: Any,
    path: str,
    decoder: _Decoder,
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
                target[key] = _fill(target[key], value, sub, decoder, strict)
            else:
                target[key] = decoder.decode(value)
        return target
    if kind == "list" and isinstance(target, builtins.list) and len(target) == len(node["items"]):
        for i, value in enumerate(node["items"]):
            target[i] = _fill(target[i], value, f"{path}[{i}]", decoder, strict)
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


def _ids(tree: Any) -> dict[int, dict[str, Any]]:
    """Each tensor node that has an ``id``, by id (what ``ref`` nodes point at)."""
    return {n["id"]: n for n, _ in _walk(tree, "") if n.get("t") == "tensor" and "id" in n}


# -- catalog ---------------------------------------------------------------------------


def list(prefix: str, *, client: Client | None = None) -> builtins.list[dict[str, Any]]:
    """Checkpoints under ``BACKEND[/PREFIX]``: name, step, sizes, dedup ratio, durability.

    Every one of them, read from the daemon page by page (see :func:`pages`).
    """
    return [entry for page in pages(prefix, client=client) for entry in page]


def pages(
    prefix: str, *, limit: int = _LIST_PAGE, client: Client | None = None
) -> Iterator[builtins.list[dict[str, Any]]]:
    """The checkpoints under ``BACKEND[/PREFIX]``, one page (at most ``limit``) at a time,
    in the order of their manifest keys; a page may be empty before the last one."""
    chunkd = _client(client)
    token: str | None = None
    while True:
        with chunkd.request(
            "ckpt_list",
            {"prefix": prefix, "start_after": token, "limit": limit},
            what=f"listing {prefix}",
        ) as answer:
            entries: builtins.list[dict[str, Any]] = json.loads(answer.payload)
        yield entries
        token = answer.header.get("next")
        if token is None:
            return


def gc(
    target: str,
    *,
    keep_last: int | None = None,
    grace: float = 3600.0,
    dry_run: bool = False,
    timeout: float = _GC_TIMEOUT,
    client: Client | None = None,
) -> dict[str, Any]:
    """Retention, then mark and sweep, in the daemon: what ``chunkd gc`` runs.

    Returns the report: ``retired`` (every checkpoint name retired, however many),
    ``chunks``, ``referenced``, ``kept_young``, ``swept``, ``freed_bytes``,
    ``stale_parts``. Saves may run meanwhile (docs/checkpoints.md, garbage collection).
    """
    fields = {"target": target, "keep_last": keep_last, "grace": grace, "dry_run": dry_run}
    answer = _client(client).request(
        "ckpt_gc", fields, timeout=timeout, what=f"collecting garbage in {target}"
    )
    return _json_fd(answer.fds, f"the garbage collection report of {target}")


def delete(name: str, *, client: Client | None = None) -> int:
    """Delete checkpoint ``name`` (its chunks go at the next ``chunkd gc``)."""
    with _client(client).request("ckpt_delete", {"name": name}, what=f"deleting {name}") as answer:
        return int(answer.header.get("removed", 0))
