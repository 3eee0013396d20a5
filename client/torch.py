"""torch data loading through the node's chunkd daemon.

Three things, all reading through a :class:`~chunkd.client.Client`:

:func:`as_tensor`
    A tensor over a view from :meth:`Client.read <chunkd.client.Client.read>`, without
    a copy. The view maps the daemon's **sealed** chunks read-only, so the tensor must
    never be written: torch has no read-only tensors, and a write through a
    ``PROT_READ`` mapping kills the process with ``SIGSEGV`` (not an exception).
    ``copy=True`` gives a writable tensor of its own.

:class:`RecordDataset`
    A map-style dataset of byte ranges ``(name, offset, length)``.

:class:`ShardDataset`
    An iterable dataset over shards (JSON lines, fixed-size records, or Parquet
    row groups) with a seeded global shuffle per epoch, sharding by rank and by
    DataLoader worker, and a resumable **global position** (``state_dict()`` /
    ``load_state_dict()``, the contract of torchdata's ``StatefulDataLoader``).

Clients and processes
    Each dataset makes its :class:`~chunkd.client.Client` on first use in a process,
    from a factory (default: ``Client()``, which finds the socket through
    ``$CHUNKD_SOCKET``). A DataLoader worker forked after the client exists reuses
    it (the client reconnects after a fork, and its mappings stay valid); a pickled
    dataset (the ``spawn`` start method) carries only the factory, which must then be
    picklable (``functools.partial(Client, path)`` is; a lambda is not).

    A memoryview cannot be pickled, so it cannot leave a DataLoader worker: where a
    dataset would hand out a view, pass a ``transform`` that returns something
    picklable (``bytes``, ``json.loads``, ``functools.partial(as_tensor, copy=True)``).
    A tensor over a view does leave a worker: torch copies it into shared memory.

This module imports torch and numpy when it is imported; ``import chunkd.client``
imports neither. Install torch first (``pip install torch==2.13.0``, the ``torch``
extra).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import json
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, NamedTuple

import numpy as np
import torch
from numpy.typing import NDArray
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from chunkd.client.core import Client

__all__ = [
    "Record",
    "RecordDataset",
    "SampleId",
    "ShardDataset",
    "ShardKind",
    "as_tensor",
    "split_sample_id",
]

#: what a shard holds: one sample per JSON line, per fixed-size record, per Parquet row group
ShardKind = Literal["jsonl", "fixed", "parquet"]

#: a sample's stable id: ``"BACKEND/KEY#INDEX"``, the shard and the sample's index in it
SampleId = str

ClientFactory = Callable[[], Client]

#: the ``format`` of every ShardDataset state; bumped if the state's meaning changes
_STATE_FORMAT: Final = "chunkd.ShardDataset/1"
#: keys only a DataLoader worker's state has (see ShardDataset.global_state)
_WORKER_KEYS: Final = ("worker_id", "num_workers", "batch_size", "origin", "yielded")
#: global indices mapped to samples at a time
_STEP: Final = 256
#: a JSON lines shard is scanned for newlines this many bytes at a time
_SCAN_BYTES: Final = 64 << 20
#: open Parquet files kept per process
_PARQUET_FILES: Final = 16


# -- zero-copy tensors -------------------------------------------------------------------


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


# -- one client per process --------------------------------------------------------------


class _ClientSlot:
    """The Client of one process, made on first use; pickles as its factory only."""

    def __init__(self, client: Client | ClientFactory | None) -> None:
        self._client: Client | None = None
        if isinstance(client, Client):
            self._client = client
            self._factory: ClientFactory = functools.partial(
                Client, client.socket_path, timeout=client.timeout
            )
        elif client is None:
            self._factory = Client
        elif callable(client):
            self._factory = client
        else:
            raise TypeError(f"client must be a Client, a factory of one, or None; got {client!r}")

    def get(self) -> Client:
        if self._client is None:
            self._client = self._factory()
            # A client made here is this slot's: it closes when the dataset goes.
            weakref.finalize(self, self._client.close)
        return self._client

    def __getstate__(self) -> dict[str, Any]:
        return {"_client": None, "_factory": self._factory}


# -- a map-style dataset of byte ranges --------------------------------------------------


class Record(NamedTuple):
    """A byte range of an object: a sample of a :class:`RecordDataset`."""

    name: str
    offset: int
    length: int


class RecordDataset(Dataset[Any]):
    """A map-style dataset whose samples are byte ranges of objects.

    ``dataset[i]`` reads ``records[i]`` through the client: a read-only, zero-copy
    ``memoryview`` of its bytes, or ``transform(view)``. Pass a transform with
    DataLoader workers, since a view does not pickle (see the module docstring).

    Args:
        records: ``(name, offset, length)`` per sample (``name`` is ``BACKEND/KEY``).
        client: a :class:`~chunkd.client.Client`, a zero-argument factory of one,
            or None (``Client()``); made on first use in each process.
        transform: applied to the view of each sample.
    """

    def __init__(
        self,
        records: Sequence[tuple[str, int, int]],
        client: Client | ClientFactory | None = None,
        *,
        transform: Callable[[memoryview], Any] | None = None,
    ) -> None:
        self.records = records
        self.transform = transform
        self._client = _ClientSlot(client)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Any:
        name, offset, length = self.records[index]
        view = self._client.get().read(name, offset, length)
        if len(view) != length:
            raise ValueError(
                f"record {index} asks for {length} bytes of {name} at {offset}, "
                f"but the object ends after {len(view)} of them; fix the record"
            )
        return view if self.transform is None else self.transform(view)


# -- a stable pseudorandom permutation ---------------------------------------------------

_ROUNDS: Final = 6
_MIX1: Final = np.uint64(0xBF58476D1CE4E5B9)
_MIX2: Final = np.uint64(0x94D049BB133111EB)


def _mix(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """splitmix64's finalizer, elementwise (wrapping uint64 arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


class _Permutation:
    """A pseudorandom permutation of ``range(size)`` from a key, element by element.

    A balanced Feistel network over the smallest even power of two that holds
    ``size``, with cycle walking: no table, any element computed directly, and the
    same permutation for the same key on every platform and library version (numpy's
    and torch's generators promise no stable stream across versions; a resumed run
    needs one).
    """

    def __init__(self, size: int, key: str) -> None:
        self.size = size
        self._half = max(1, ((size - 1).bit_length() + 1) // 2)
        self._mask = np.uint64((1 << self._half) - 1)
        digest = hashlib.blake2b(key.encode(), digest_size=8 * _ROUNDS).digest()
        self._keys = [np.uint64(k) for k in np.frombuffer(digest, dtype="<u8")]

    def __call__(self, index: NDArray[np.int64]) -> NDArray[np.int64]:
        if self.size <= 1:
            return index
        x = index.astype(np.uint64)
        with np.errstate(over="ignore"):
            x = self._encrypt(x)
            outside = x >= np.uint64(self.size)
            while outside.any():
                x[outside] = self._encrypt(x[outside])
                outside = x >= np.uint64(self.size)
        return x.astype(np.int64)

    def _encrypt(self, x: NDArray[np.uint64]) -> NDArray[np.uint64]:
        half = np.uint64(self._half)
        left, right = x >> half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << half) | right


# -- an epoch's global order -------------------------------------------------------------


class _Order:
    """One epoch's global order of ``(shard, sample)`` pairs.

    Shards are permuted; each run of ``window`` consecutive shards in that order is a
    window, and the samples of a window are permuted together. Unshuffled, both
    permutations are the identity: shards as listed, samples as stored.
    """

    def __init__(
        self,
        counts: NDArray[np.int64],
        *,
        seed: int,
        epoch: int,
        shuffle: bool,
        window: int | None,
    ) -> None:
        shards = len(counts)
        positions = np.arange(shards, dtype=np.int64)
        if shuffle:
            self.shard_order = _Permutation(shards, f"chunkd.ShardDataset:{seed}:{epoch}:shards")(
                positions
            )
        else:
            self.shard_order = positions
        # cum[p]: where the shard at position p of the order starts in its concatenation
        self.cum = np.concatenate(([0], np.cumsum(counts[self.shard_order]))).astype(np.int64)
        per = shards if window is None else window
        firsts = np.arange(0, shards, max(1, per), dtype=np.int64)
        self.window_starts = np.concatenate((self.cum[firsts], self.cum[-1:])).astype(np.int64)
        self.total = int(self.cum[-1])
        self._key = f"chunkd.ShardDataset:{seed}:{epoch}:window:"
        self._shuffle = shuffle

    def locate(self, index: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """The (shard, sample in shard) at each global index (all below ``total``)."""
        shard = np.empty_like(index)
        sample = np.empty_like(index)
        windows = np.searchsorted(self.window_starts, index, side="right") - 1
        for w in np.unique(windows):
            chosen = windows == w
            start = int(self.window_starts[w])
            size = int(self.window_starts[w + 1]) - start
            inside = index[chosen] - start
            if self._shuffle:
                inside = _Permutation(size, f"{self._key}{int(w)}")(inside)
            at = inside + start
            position = np.searchsorted(self.cum, at, side="right") - 1
            shard[chosen] = self.shard_order[position]
            sample[chosen] = at - self.cum[position]
        return shard, sample


# -- shard formats -----------------------------------------------------------------------


class _Format:
    """How one kind of shard splits into samples. Caches are per process."""

    def count(self, client: Client, name: str) -> int:
        raise NotImplementedError

    def read(self, client: Client, name: str, index: int) -> Any:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)


class _JsonLines(_Format):
    """One sample per line (its bytes without the newline); a last line may lack one."""

    def __init__(self) -> None:
        #: per shard, where each line ends (its newline, or the end of the shard)
        self.ends: dict[str, NDArray[np.int64]] = {}

    def count(self, client: Client, name: str) -> int:
        return len(self._ends(client, name))

    def read(self, client: Client, name: str, index: int) -> bytes:
        ends = self._ends(client, name)
        start = 0 if index == 0 else int(ends[index - 1]) + 1
        length = int(ends[index]) - start
        return bytes(client.read(name, start, length)) if length else b""

    def _ends(self, client: Client, name: str) -> NDArray[np.int64]:
        ends = self.ends.get(name)
        if ends is None:
            size = client.stat(name).size
            found = []
            for offset in range(0, size, _SCAN_BYTES):
                view = client.read(name, offset, min(_SCAN_BYTES, size - offset))
                found.append(np.flatnonzero(np.frombuffer(view, dtype=np.uint8) == 0x0A) + offset)
            if size and (not found or not len(found[-1]) or found[-1][-1] != size - 1):
                found.append(np.array([size]))
            ends = np.concatenate([np.empty(0, dtype=np.int64), *found]).astype(np.int64)
            self.ends[name] = ends
        return ends


class _FixedRecords(_Format):
    """One sample per ``record_bytes`` bytes: a read-only, zero-copy uint8 tensor."""

    def __init__(self, record_bytes: int) -> None:
        self.record_bytes = record_bytes

    def count(self, client: Client, name: str) -> int:
        size = client.stat(name).size
        records, left = divmod(size, self.record_bytes)
        if left:
            raise ValueError(
                f"shard {name} holds {size} bytes, not a whole number of "
                f"{self.record_bytes}-byte records ({left} bytes left over); "
                "check record_bytes or the shard"
            )
        return records

    def read(self, client: Client, name: str, index: int) -> torch.Tensor:
        size = self.record_bytes
        return as_tensor(client.read(name, index * size, size))


class _ParquetRowGroups(_Format):
    """One sample per row group: a ``pyarrow.Table``."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._files: OrderedDict[str, Any] = OrderedDict()

    def count(self, client: Client, name: str) -> int:
        count = self.counts.get(name)
        if count is None:
            count = self.counts[name] = int(self._file(client, name).metadata.num_row_groups)
        return count

    def read(self, client: Client, name: str, index: int) -> Any:
        return self._file(client, name).read_row_group(index)

    def _file(self, client: Client, name: str) -> Any:
        parquet = self._files.get(name)
        if parquet is None:
            pa = importlib.import_module("pyarrow")
            pq = importlib.import_module("pyarrow.parquet")
            # Only the footer and the row groups asked for are read, not the shard.
            parquet = pq.ParquetFile(pa.PythonFile(client.open(name), mode="r"))
            self._files[name] = parquet
            while len(self._files) > _PARQUET_FILES:
                self._files.popitem(last=False)[1].close()
        else:
            self._files.move_to_end(name)
        return parquet

    def __getstate__(self) -> dict[str, Any]:
        return {"counts": self.counts, "_files": OrderedDict()}


def split_sample_id(sample_id: SampleId) -> tuple[str, int]:
    """``"BACKEND/KEY#INDEX"`` as ``(shard name, index in the shard)``."""
    name, _, index = sample_id.rpartition("#")
    if not name or not index.isdigit():
        raise ValueError(f"{sample_id!r} is not a sample id (BACKEND/KEY#INDEX)")
    return name, int(index)


# -- the sharded, shuffled, resumable dataset --------------------------------------------


@dataclass(slots=True)
class _Cursor:
    """Where one consumer (a rank, or one DataLoader worker of a rank) is in an epoch.

    The rank's samples are its local indices ``j`` (global index ``j * world_size +
    rank``). From ``origin`` on, they are dealt to the workers in blocks of
    ``batch_size``: block ``k`` to worker ``k % num_workers``. ``yielded`` counts the
    samples this consumer has yielded.
    """

    epoch: int
    world_size: int
    rank: int
    worker_id: int
    num_workers: int
    batch_size: int
    origin: int
    yielded: int = 0
    done: bool = False

    def local(self, t: NDArray[np.int64]) -> NDArray[np.int64]:
        """The local index of this consumer's ``t``-th sample."""
        block = self.worker_id + (t // self.batch_size) * self.num_workers
        return self.origin + block * self.batch_size + t % self.batch_size

    @property
    def position(self) -> int:
        """The global position: this consumer's next sample is its first at or after it."""
        nxt = self.local(np.array([self.yielded], dtype=np.int64))
        return int(nxt[0]) * self.world_size


class ShardDataset(IterableDataset[Any]):
    """Samples of many shards in a seeded global order, dealt to ranks and workers.

    Samples
        ``kind="jsonl"``: one sample per line, as ``bytes`` without the newline (every
        ``\\n``-terminated line, empty ones too, and a last line without a newline).
        ``kind="fixed"``: one sample per ``record_bytes`` bytes, as a read-only,
        zero-copy ``uint8`` tensor (see :func:`as_tensor`: never write to it).
        ``kind="parquet"``: one sample per **row group**, as a ``pyarrow.Table``
        (row groups are Parquet's unit of reading; size them as samples or batches).
        ``transform``, if given, is applied to each of these, in the process that
        reads it. Sample ``i`` of shard ``NAME`` has the id ``"NAME#i"``: stable
        whatever the seed, epoch, ranks or workers. ``with_ids=True`` yields
        ``(sample_id, sample)`` pairs.

    The global order (of an epoch)
        All ``(shard, sample)`` pairs, permuted by a pseudorandom permutation keyed by
        ``(seed, epoch)`` alone: shards first, then samples within each run of
        ``shuffle_window`` consecutive shards (None: all shards, a uniform shuffle of
        every sample). The same seed and epoch give the same order on every machine
        and library version; another epoch, another order. ``shuffle=False``: shards
        as listed, samples as stored. Building the order needs every shard's sample
        count: a ``stat`` for fixed records, the footer for Parquet, and one scan of
        the shard for JSON lines (through the daemon's cache, once per process; call
        :meth:`total_samples` before making the DataLoader to do it once, in the main
        process, for the workers to inherit).

    Ranks and workers
        Global index ``g`` goes to rank ``g % world_size`` (with ``drop_uneven``, the
        last ``total % world_size`` samples go to none, so all ranks yield as many).
        A rank's samples, in order, are dealt to its DataLoader workers in blocks of
        ``batch_size``: block ``k`` of the iteration to worker ``k % num_workers``.
        torch's DataLoader takes one batch from each worker in turn, so when
        ``batch_size`` equals the DataLoader's (1 for ``batch_size=None``), a rank's
        DataLoader yields its samples **in the global order** whatever
        ``num_workers`` is, and a ``drop_last`` DataLoader drops only the last batch.

    Epochs
        :meth:`set_epoch` before each epoch, as with ``DistributedSampler``. The
        dataset is copied into DataLoader workers at the start of each epoch, so
        ``set_epoch`` on it does not reach ``persistent_workers``.

    Resuming: ``state_dict()`` is a plain, JSON-able dict
        ``format``; ``order``, a fingerprint of the shards, kind, ``record_bytes``,
        seed, shuffle and window (a state of another order does not load);
        ``epoch``; ``world_size`` and ``rank`` (for the record); ``done``, whether
        the iteration reached its end; and ``position`` ``P``, a **global**
        position: ``world_size`` times the samples this rank has yielded in the
        epoch. When the ranks are in step, ``P`` is the number of samples of the
        global order that all of them together have yielded, and every rank holds
        the same state.

        After ``load_state_dict``, the next iteration of that epoch yields, on rank
        ``r`` of ``R``, the samples at global indices ``g >= P`` with
        ``g % R == r``, in the global order. So a resumed run yields exactly the
        remaining samples, in the same order:

        - on the same ``world_size``, each rank loading its own state, whatever the
          ``num_workers`` and ``batch_size`` of the new DataLoader (as long as its
          batch size is the dataset's ``batch_size``);
        - on another ``world_size``, when all old ranks had yielded as many samples
          (as in synchronous data-parallel training) and ``drop_uneven`` is off:
          every new rank loads that one state.

        A ``done`` state (but a worker's) leaves nothing of its epoch: loading it
        only drops a state loaded before, and the next iteration deals the epoch that
        :meth:`set_epoch` chose from its start. (torchdata loads a finished loader's
        state after the training loop's ``set_epoch`` for the next epoch.)

        Inside a DataLoader **worker**, the state is the worker's own: it adds
        ``worker_id``, ``num_workers``, ``batch_size``, ``origin`` and ``yielded``, and
        loads back only into that worker of the same rank and geometry. torchdata's
        ``StatefulDataLoader`` keeps one per worker and restores them into a loader
        of the same ``num_workers`` (it refuses another): that resumes exactly.
        To resume with another ``num_workers``, turn the loader's state into the
        global one with :meth:`global_state` and ``load_state_dict`` it on the
        dataset of the new loader (a ``DataLoader``, or a ``StatefulDataLoader``
        without a loaded state). That is exact when the saving loader was a
        ``StatefulDataLoader`` with ``in_order=True`` and ``snapshot_every_n_steps=1``
        (its defaults) and with the dataset's ``batch_size``; a plain
        ``DataLoader`` with workers saves no state at all.

        A loaded state applies to the next iteration of its epoch; ``set_epoch`` to
        another epoch drops it. A DataLoader with workers copies the dataset for
        every epoch, so after ``load_state_dict`` on its dataset, ``set_epoch`` the
        next epoch before iterating again (the usual loop does).

    One iteration at a time: ``state_dict`` follows the latest iterator. Shards must
    not change during a run.

    Args:
        shards: shard names, ``BACKEND/KEY``, each once.
        kind: ``"jsonl"``, ``"fixed"`` or ``"parquet"``.
        seed: the shuffle's seed; the same on every rank.
        shuffle: permute shards and samples (else the order as listed and stored).
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: how many ranks share the epoch.
        record_bytes: the size of a record (``kind="fixed"`` only).
        transform: applied to each sample before it is yielded.
        client_factory: makes the process's :class:`~chunkd.client.Client` (default:
            ``Client()``); must pickle under the ``spawn`` start method.
        batch_size: the DataLoader's batch size (1 for ``batch_size=None``): workers
            take blocks of this many samples, so the loader keeps the global order.
        shuffle_window: shards whose samples are shuffled together (None: all).
        drop_uneven: leave out the last ``total % world_size`` samples of each epoch.
        with_ids: yield ``(sample_id, sample)`` pairs.

    Raises:
        ValueError: a bad argument (unknown kind, missing ``record_bytes``, a shard
            listed twice, a rank outside the world).
    """

    def __init__(
        self,
        shards: Sequence[str],
        *,
        kind: ShardKind,
        seed: int,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        record_bytes: int | None = None,
        transform: Callable[[Any], Any] | None = None,
        client_factory: ClientFactory | None = None,
        batch_size: int = 1,
        shuffle_window: int | None = None,
        drop_uneven: bool = False,
        with_ids: bool = False,
    ) -> None:
        super().__init__()
        self.shards = [str(name) for name in shards]
        if len(set(self.shards)) != len(self.shards):
            raise ValueError("a shard is listed twice; list each shard once (sample ids name it)")
        if kind == "fixed":
            if record_bytes is None or record_bytes <= 0:
                raise ValueError(f"kind='fixed' needs record_bytes > 0; got {record_bytes!r}")
            self._format: _Format = _FixedRecords(record_bytes)
        elif record_bytes is not None:
            raise ValueError(f"record_bytes is for kind='fixed' only; kind is {kind!r}")
        elif kind == "jsonl":
            self._format = _JsonLines()
        elif kind == "parquet":
            self._format = _ParquetRowGroups()
        else:
            raise ValueError(f"kind must be 'jsonl', 'fixed' or 'parquet'; got {kind!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size; got rank {rank}, world_size {world_size}"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size!r}")
        if shuffle_window is not None and shuffle_window < 1:
            raise ValueError(f"shuffle_window must be >= 1 shard or None; got {shuffle_window!r}")
        self.kind: ShardKind = kind
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.rank = rank
        self.world_size = world_size
        self.record_bytes = record_bytes
        self.transform = transform
        self.batch_size = batch_size
        self.shuffle_window = shuffle_window
        self.drop_uneven = bool(drop_uneven)
        self.with_ids = bool(with_ids)
        self._client = _ClientSlot(client_factory)
        self._counts: NDArray[np.int64] | None = None
        self._epoch = 0
        self._pending: dict[str, Any] | None = None
        self._cursor: _Cursor | None = None
        fingerprint = [kind, record_bytes, self.seed, self.shuffle, shuffle_window, self.shards]
        self.order_id = hashlib.blake2b(
            json.dumps(fingerprint).encode(), digest_size=12
        ).hexdigest()

    def __repr__(self) -> str:
        return (
            f"<chunkd ShardDataset {len(self.shards)} {self.kind} shards, seed={self.seed}, "
            f"epoch={self._epoch}, rank {self.rank}/{self.world_size}>"
        )

    @property
    def epoch(self) -> int:
        """The epoch whose order is dealt."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Deal epoch ``epoch``'s order next; a loaded state of another epoch is dropped."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0; got {epoch!r}")
        if epoch != self._epoch:
            self._epoch = epoch
            self._pending = None
            self._cursor = None

    def total_samples(self) -> int:
        """Samples in an epoch, all ranks together (counting every shard, once per process)."""
        return int(self._shard_counts().sum())

    # -- resuming ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this rank (or this DataLoader worker) is: see the class docstring."""
        if self._cursor is None:
            if self._pending is not None:
                return dict(self._pending)
            return self._state(self._epoch, 0)
        cursor = self._cursor
        state = self._state(cursor.epoch, cursor.position, done=cursor.done)
        if cursor.num_workers > 1:
            state.update(
                worker_id=cursor.worker_id,
                num_workers=cursor.num_workers,
                batch_size=cursor.batch_size,
                origin=cursor.origin,
                yielded=cursor.yielded,
            )
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from a :meth:`state_dict` (or :meth:`global_state`) on the next iteration.

        Raises:
            ValueError: the state is not a ShardDataset state, or is one of another
                order (other shards, kind, seed or shuffle).
        """
        state = _checked(state_dict)
        if state["order"] != self.order_id:
            raise ValueError(
                f"this state is of another ShardDataset order ({state['order']}; this one "
                f"is {self.order_id}): the shards, kind, record_bytes, seed or shuffle "
                "differ; resume with the dataset that saved it"
            )
        self._cursor = None
        if state["done"] and "worker_id" not in state:
            # Nothing is left of that epoch: the next iteration deals the epoch that
            # set_epoch chose from its start (torchdata loads a finished loader's state
            # after the training loop's set_epoch for the next epoch). A finished
            # worker, though, resumes with nothing while the other workers finish.
            self._pending = None
            return
        self._epoch = state["epoch"]
        self._pending = state

    @staticmethod
    def global_state(state: Any) -> dict[str, Any]:
        """The global state of a rank, from what its DataLoader saved.

        Finds the ShardDataset states anywhere inside ``state``: a ``state_dict()``, a
        list of them, or a ``StatefulDataLoader.state_dict()`` (any nesting of dicts,
        lists and tuples). Worker states, which must be of one rank, one epoch and all
        ``num_workers`` workers, give the smallest of their positions: with
        ``in_order=True`` that is where the loader stands. The result loads into a
        dataset used with any ``num_workers`` (see the class docstring).

        Raises:
            ValueError: no ShardDataset state in ``state``; states of different
                orders, epochs or ranks; a worker's state missing; or a
                ``StatefulDataLoader`` state taken between snapshots (use
                ``snapshot_every_n_steps=1``).
        """
        if isinstance(state, Mapping) and state.get("_steps_since_snapshot", 0):
            raise ValueError(
                "the StatefulDataLoader's state was taken between worker snapshots, so "
                "its workers' positions are behind it; make the loader with "
                "snapshot_every_n_steps=1 (its default)"
            )
        found = [_checked(s) for s in _find_states(state)]
        if not found:
            raise ValueError("no ShardDataset state found in what was given")
        first = found[0]
        for other in found[1:]:
            keys = ("order", "epoch", "world_size", "rank")
            if any(other[key] != first[key] for key in keys):
                raise ValueError(
                    "the states are of different orders, epochs or ranks: "
                    + "; ".join(str({key: s[key] for key in keys}) for s in (first, other))
                    + "; pass the states of one rank's loader"
                )
        workers = [s for s in found if "worker_id" in s]
        if not workers:
            positions = {(s["position"], s["done"]) for s in found}
            if len(positions) != 1:
                raise ValueError(f"the states disagree on the position: {sorted(positions)}")
            return {key: first[key] for key in _GLOBAL_KEYS}
        count = workers[0]["num_workers"]
        ids = sorted(s["worker_id"] for s in workers)
        if ids != list(range(count)) or any(s["num_workers"] != count for s in workers):
            raise ValueError(f"need the states of all {count} workers once each; got workers {ids}")
        position = min(s["position"] for s in workers)
        done = all(s["done"] for s in workers)
        return {key: first[key] for key in _GLOBAL_KEYS} | {"position": position, "done": done}

    def _state(self, epoch: int, position: int, *, done: bool = False) -> dict[str, Any]:
        return {
            "format": _STATE_FORMAT,
            "order": self.order_id,
            "epoch": epoch,
            "position": position,
            "world_size": self.world_size,
            "rank": self.rank,
            "done": done,
        }

    # -- iterating -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        # The cursor is set now, not on the first next(): torchdata asks a worker for
        # its state right after iter(), before any sample.
        cursor = self._cursor = self._start()
        return self._samples(cursor)

    def _start(self) -> _Cursor:
        info = get_worker_info()
        worker_id, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        geometry = {
            "world_size": self.world_size,
            "rank": self.rank,
            "worker_id": worker_id,
            "num_workers": num_workers,
            "batch_size": self.batch_size,
        }
        pending, self._pending = self._pending, None
        origin = yielded = 0
        if pending is not None and "worker_id" in pending:
            saved = {key: pending[key] for key in geometry}
            if saved != geometry:
                raise ValueError(
                    f"this is the state of one DataLoader worker ({saved}); it resumes only "
                    f"that worker, not this one ({geometry}); load "
                    "ShardDataset.global_state(loader_state) instead"
                )
            origin, yielded = pending["origin"], pending["yielded"]
        elif pending is not None:
            # The rank's first sample at or after the position.
            origin = max(0, -(-(pending["position"] - self.rank) // self.world_size))
        return _Cursor(
            self._epoch,
            self.world_size,
            self.rank,
            worker_id,
            num_workers,
            self.batch_size,
            origin,
            yielded,
        )

    def _samples(self, cursor: _Cursor) -> Iterator[Any]:
        client = self._client.get()
        order = _Order(
            self._shard_counts(),
            seed=self.seed,
            epoch=cursor.epoch,
            shuffle=self.shuffle,
            window=self.shuffle_window,
        )
        total = order.total
        if self.drop_uneven:
            total -= total % self.world_size
        # local indices j of this rank: j * world_size + rank < total
        local_count = max(0, -(-(total - self.rank) // self.world_size))
        while True:
            ts = np.arange(cursor.yielded, cursor.yielded + _STEP, dtype=np.int64)
            local = cursor.local(ts)
            local = local[local < local_count]  # increasing in t: a prefix
            if not len(local):
                cursor.done = True
                return
            shards, samples = order.locate(local * self.world_size + self.rank)
            for shard, sample in zip(shards.tolist(), samples.tolist(), strict=True):
                name = self.shards[shard]
                data = self._format.read(client, name, sample)
                if self.transform is not None:
                    data = self.transform(data)
                cursor.yielded += 1  # before the yield: a state taken now counts it
                yield (f"{name}#{sample}", data) if self.with_ids else data

    def _shard_counts(self) -> NDArray[np.int64]:
        if self._counts is None:
            client = self._client.get()
            counts = [self._format.count(client, name) for name in self.shards]
            self._counts = np.array(counts, dtype=np.int64)
        return self._counts

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cursor"] = None
        return state


_GLOBAL_KEYS: Final = ("format", "order", "epoch", "position", "world_size", "rank", "done")


def _checked(state: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a ShardDataset state, its fields checked."""
    if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
        raise ValueError(
            f"not a ShardDataset state (its format is not {_STATE_FORMAT!r}): {state!r:.200}"
        )
    keys = [key for key in _GLOBAL_KEYS if key not in ("format", "order", "done")]
    if "worker_id" in state:
        keys += _WORKER_KEYS
    done = state.get("done")
    if type(done) is not bool:  # a malformed state is a ValueError, as any other
        raise ValueError(f"a ShardDataset state needs 'done', True or False; got {done!r}")
    checked: dict[str, Any] = {
        "format": _STATE_FORMAT,
        "order": str(state.get("order")),
        "done": done,
    }
    for key in keys:
        value = state.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(
                f"a ShardDataset state needs {key!r}, a whole number >= 0; got {value!r}"
            )
        checked[key] = value
    return checked


def _find_states(state: Any) -> Iterator[Mapping[str, Any]]:
    if isinstance(state, Mapping):
        if state.get("format") == _STATE_FORMAT:
            yield state
            return
        for value in state.values():
            yield from _find_states(value)
    elif isinstance(state, list | tuple):
        for value in state:
            yield from _find_states(value)
