"""The sharded, shuffled, resumable dataset: :class:`ShardDataset`.

It composes the other rooms: the order (:mod:`~chunkd.client.torch.order`), the
shard formats (:mod:`~chunkd.client.torch.formats`), sample ids
(:mod:`~chunkd.client.torch.sample_ids`), the saved states
(:mod:`~chunkd.client.torch.state`) and the process's client
(:mod:`~chunkd.client.torch.slot`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray
from torch.utils.data import IterableDataset, get_worker_info

from chunkd.client.torch.formats import ShardFormat, ShardKind, shard_format
from chunkd.client.torch.order import Cursor, Order
from chunkd.client.torch.sample_ids import sample_id
from chunkd.client.torch.slot import ClientFactory, ClientSlot
from chunkd.client.torch.state import STATE_FORMAT, checked_state, global_state_of

__all__ = ["ShardDataset"]

#: global indices mapped to samples at a time
_STEP: Final = 256


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
        self._format: ShardFormat = shard_format(kind, record_bytes)
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
        self._client = ClientSlot(client_factory)
        self._counts: NDArray[np.int64] | None = None
        self._epoch = 0
        self._pending: dict[str, Any] | None = None
        self._cursor: Cursor | None = None
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
        state = checked_state(state_dict)
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
        return global_state_of(state)

    def _state(self, epoch: int, position: int, *, done: bool = False) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
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

    def _start(self) -> Cursor:
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
        return Cursor(
            self._epoch,
            self.world_size,
            self.rank,
            worker_id,
            num_workers,
            self.batch_size,
            origin,
            yielded,
        )

    def _samples(self, cursor: Cursor) -> Iterator[Any]:
        client = self._client.get()
        order = Order(
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
                yield (sample_id(name, sample), data) if self.with_ids else data

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
