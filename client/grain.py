"""Grain adapters: a snapshot as a Grain data source, and chunkd's order under Grain.

:class:`GrainSource`
    A ``RandomAccessDataSource`` (``__len__``, ``__getitem__``): sample ``i`` of the
    snapshot (its snapshot index, :meth:`Snapshot.locate
    <chunkd.snapshot.Snapshot.locate>`). Grain's own sampler (``IndexSampler``) or
    ``MapDataset.shuffle`` then sets the order, and Grain's state resumes it (with
    Grain's rules: the same ``worker_count``).

:class:`OrderSampler`
    A sampler for Grain's ``DataLoader`` that walks chunkd's order
    (:mod:`chunkd.client.datasets.order`) epoch after epoch: the locality of
    windows of units under Grain's own loader, batching and workers. Grain's
    loader shards the records by its ``shard_options`` (rank ``r`` of ``W`` takes
    records ``r, r+W, ...``), and its state is its own.

:class:`ChunkdIterDataset`
    A Grain ``IterDataset`` of one rank's :class:`~chunkd.client.datasets.loader.Batch`
    es, the loader core's steps, ranks, tail, prefetching and state: its iterator's
    ``get_state()`` is the ``chunkd.loader/3`` state (at most 256 bytes), and
    ``set_state`` takes one of any world size, batch size and worker count. Under
    ``mp_prefetch(MultiprocessingOptions(num_workers=K))`` Grain gives worker ``k`` the
    slice ``k::K``, which the dataset takes as the core's worker split (steps ``k,
    k+K, ...``), and Grain's interleave takes one batch from each in turn: the
    rank's batches come in step order. That pipeline's state holds each worker's
    (:mod:`chunkd.client.datasets.workers`); :func:`global_state` of it is the chunkd
    state, which a dataset of any other ``num_workers`` starts from (``state=``).

Grain's prefetch processes are spawned: the datasets pickle as their snapshot and a
client factory (``functools.partial(Client, path)``; default ``Client()``), and each
process opens the snapshot again: by its id through the registry if it was resolved
there, else pinned in its backend. Fixed-size records come as read-only ``uint8``
numpy arrays over the mapped chunks (Grain moves them between processes).

Importing this module imports grain (``pip install grain``); grain needs no jax.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Unpack

import grain
import numpy as np

from chunkd.client.core import Client
from chunkd.client.datasets.dataset import Dataset
from chunkd.client.datasets.epoch import (
    DEFAULT_WINDOW,
    DEFAULT_WINDOW_BYTES,
    EpochOrder,
    order_version,
)
from chunkd.client.datasets.loader import (
    Batch,
    Readable,
    ReadOptions,
    ReadSettings,
    Steps,
    Tail,
    client_of,
    open_units,
    order_of,
    read_steps,
)
from chunkd.client.datasets.source import PinnedSource
from chunkd.client.datasets.state import LoaderState
from chunkd.client.datasets.units import Units
from chunkd.client.datasets.workers import (
    WORKER_FORMAT,
    WorkerState,
    global_state,
    reader_state,
)
from chunkd.client.protocol import MAX_SECONDS
from chunkd.client.stalls import (
    MIN_WINDOW,
    REPORT_WINDOW,
    StallMeter,
    in_grain_worker,
    in_loader_worker,
    job_of,
    measured_outside,
)
from chunkd.errors import ResumeStateError
from chunkd.snapshot import Snapshot

__all__ = ["ChunkdIterDataset", "GrainSource", "OrderSampler", "global_state"]

ClientFactory = Callable[[], Client]


def as_array(sample: Any) -> Any:
    """A sample Grain can move between processes: a view becomes a read-only numpy
    array over the same bytes (no copy here)."""
    if isinstance(sample, memoryview):
        return np.frombuffer(sample, dtype=np.uint8)
    return sample


class GrainSource:
    """A snapshot as a Grain ``RandomAccessDataSource`` (see the module docstring).

    Args:
        dataset: the snapshot opened for reading.
        client_factory: makes a client in a process the source is pickled into
            (default: ``Client()``).
    """

    def __init__(self, dataset: Dataset, client_factory: ClientFactory | None = None) -> None:
        self._dataset: Dataset | None = dataset
        self._snapshot = dataset.snapshot
        self._registered = bool(dataset.registry)
        self._factory: ClientFactory = client_factory or _default_factory(dataset)

    @property
    def dataset(self) -> Dataset:
        """The dataset read (opened again in a process the source was pickled into)."""
        if self._dataset is None:
            client = self._factory()
            if self._registered:
                self._dataset = Dataset.open(self._snapshot.id, client)
            else:
                self._dataset = Dataset(
                    self._snapshot, PinnedSource(client, self._snapshot.backend)
                )
        return self._dataset

    @property
    def snapshot(self) -> Snapshot:
        """The snapshot."""
        return self._snapshot

    def __len__(self) -> int:
        return len(self._snapshot)

    def __getitem__(self, index: int) -> Any:
        return as_array(self.dataset[int(index)])

    def __repr__(self) -> str:
        # Grain checks a source's repr in its checkpoints: the snapshot is the source.
        return f"chunkd.GrainSource(snapshot={self._snapshot.id})"

    def __getstate__(self) -> dict[str, Any]:
        return {
            "_dataset": None,
            "_snapshot": self._snapshot,
            "_registered": self._registered,
            "_factory": self._factory,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _default_factory(dataset: Dataset) -> ClientFactory:
    client = client_of(dataset)
    if isinstance(client, Client) and client.socket_path is not None:
        return functools.partial(Client, client.socket_path, timeout=client.timeout)
    return Client


class OrderSampler:
    """chunkd's order as a sampler of Grain's ``DataLoader`` (see the module docstring).

    Record ``i`` is position ``i % N`` of epoch ``i // N`` of chunkd's order (``N``: the
    snapshot's samples). Grain's loader shards the records by the ``shard_options``
    given to it (none: one shard): rank ``r`` of ``W`` reads records ``r, r+W, ...``.

    Args:
        snapshot: the snapshot (or a dataset, or a :class:`GrainSource`).
        seed: the run's seed.
        shuffle: shuffle (else members in order, samples as stored).
        window: the most units whose samples are mixed together (None: no bound).
        window_bytes: the most decoded bytes of a window's units (None: no bound;
            default: the formats' decode caches' bound).
        num_epochs: epochs to walk (None: without end).
    """

    def __init__(
        self,
        snapshot: Snapshot | Readable | GrainSource,
        *,
        seed: int,
        shuffle: bool = True,
        window: int | None = DEFAULT_WINDOW,
        window_bytes: int | None = DEFAULT_WINDOW_BYTES,
        num_epochs: int | None = 1,
    ) -> None:
        self._snapshot = snapshot if isinstance(snapshot, Snapshot) else snapshot.snapshot
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.window = window
        self.window_bytes = window_bytes
        self.num_epochs = num_epochs
        # what Grain's loader shards by when it is given no shard_options: none
        self._shard_options = grain.sharding.NoSharding()
        self._orders: dict[int, EpochOrder] = {}

    def __len__(self) -> int:
        if self.num_epochs is None:
            return 1 << 62
        return self.num_epochs * len(self._snapshot)

    def __repr__(self) -> str:
        return (
            f"chunkd.OrderSampler(snapshot={self._snapshot.id}, seed={self.seed}, "
            f"shuffle={self.shuffle}, window={self.window}, window_bytes={self.window_bytes}, "
            f"num_epochs={self.num_epochs})"
        )

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < len(self) or not len(self._snapshot):
            raise IndexError(f"record {index} of a sampler of {len(self)}")
        epoch, position = divmod(int(index), len(self._snapshot))
        order = self._orders.get(epoch)
        if order is None:
            order = self._order(epoch)
            self._orders = {epoch: order}  # one epoch at a time
        key = int(order.indices([position])[0])
        return grain.RecordMetadata(index=int(index), record_key=key)

    def _order(self, epoch: int) -> EpochOrder:
        # The loader's own order (a paged snapshot's is built from its root, never from
        # every member's count): the same order every reader of the snapshot deals.
        state = LoaderState(
            self._snapshot.id,
            self.seed,
            epoch,
            0,
            shuffle=self.shuffle,
            window=self.window,
            window_bytes=self.window_bytes,
            order=order_version(self._snapshot),
        )
        return order_of(self._snapshot, state)


class ChunkdIterDataset(grain.IterDataset):  # type: ignore[misc]
    """One rank's batches in chunkd's order, as a Grain ``IterDataset`` (see the module
    docstring).

    Args:
        dataset: the snapshot opened for reading.
        settings: the reading's settings
            (:class:`~chunkd.client.datasets.loader.ReadSettings`), or each as a keyword
            argument (``batch_size`` and ``seed`` are then needed): ``batch_size``,
            ``seed``, ``rank``, ``world_size``, ``shuffle``, ``window``,
            ``window_bytes``, ``tail``, ``prefetch``, ``columns``, ``decode_ahead``,
            ``shared_decode``.
        epoch: the epoch (a ``state`` sets its own).
        state: a ``chunkd.loader/3`` state to start from (of any geometry).
        collate_fn: makes a batch's ``samples`` of its list (None: the list, built
            when first asked for; the batch's ``columns`` are there either way).
        batch_transform: makes the batch's ``columns`` of its columns.
        client_factory: as :class:`GrainSource`'s.
        measure: time the trainer's waits for each batch and report them to the
            daemon (:class:`~chunkd.client.StallMeter`), where the iterator runs in
            the process and thread that made the dataset (:meth:`measured_here`; not
            in an ``mp_prefetch`` worker, even with one, nor a ``prefetch`` thread:
            there, wrap the pipeline's iterator in ``StallMeter(...).wrap(...)``), and
            not inside another meter's ``wrap``. An iteration's end, or the loop
            leaving it, sends its window; the rank's end is sent at the process's exit
            (or ``iterator.meter.close()``).
        train_job: the job the waits and the first batch's timings are accounted to;
            None: the dataset's client's (``Client(train_job=)``), else
            :func:`~chunkd.client.job_name`'s (the environment's).
        stall_window: seconds between two of the meter's reports.

    Raises:
        ValueError: an argument out of its range, or a ``train_job`` that is no job
            name.
        ResumeStateError: ``state`` is malformed or of another order.
    """

    def __init__(
        self,
        dataset: Dataset,
        settings: ReadSettings | None = None,
        *,
        epoch: int = 0,
        state: Mapping[str, Any] | str | bytes | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        batch_transform: Callable[[dict[str, Any]], Any] | None = None,
        client_factory: ClientFactory | None = None,
        measure: bool = True,
        train_job: str | None = None,
        stall_window: float = REPORT_WINDOW,
        **options: Unpack[ReadOptions],
    ) -> None:
        super().__init__()
        self.train_job = job_of(train_job, client_of(dataset))
        self.measure = bool(measure)
        # the trainer's process and thread: the iterator measures only there (Grain's
        # mp_prefetch runs a copy in a child, even with one worker; prefetch a thread)
        self._trainer = os.getpid(), threading.get_ident()
        if not MIN_WINDOW <= stall_window <= MAX_SECONDS:
            raise ValueError(
                f"stall_window is {MIN_WINDOW} to {MAX_SECONDS:g} seconds; got {stall_window!r}"
            )
        self.stall_window = float(stall_window)
        chosen = ReadSettings.merged(settings, options)
        self.settings = chosen
        self.source = GrainSource(dataset, client_factory)
        self.batch_size = chosen.batch_size
        self.rank = chosen.rank
        self.world_size = chosen.world_size
        self.tail: Tail = chosen.tail
        self.prefetch = chosen.prefetch
        self.collate_fn = collate_fn
        self.batch_transform = batch_transform
        self.start = chosen.state(dataset.id, epoch, order=order_version(dataset.snapshot))
        if state is not None:
            self.start = self.checked(LoaderState.parse(state))
        self.worker, self.workers = 0, 1

    def checked(self, state: LoaderState) -> LoaderState:
        """``state``, if it is of this dataset's order.

        Raises:
            ResumeStateError: it is not.
        """
        s = self.start
        state.check(
            snapshot=s.snapshot,
            order=s.order,
            seed=s.seed,
            shuffle=s.shuffle,
            window=s.window,
            window_bytes=s.window_bytes,
            total=len(self.source),
        )
        return state

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Grain's worker split (``k::K``), taken as the core's: steps ``k, k+K, ...``."""
        start, stop, step = sl.start or 0, sl.stop, sl.step or 1
        if stop is not None or not 0 <= start < step:
            raise ValueError(f"a ChunkdIterDataset splits by workers, k::K; got {sl}")
        self.worker, self.workers = start, step

    def __iter__(self) -> ChunkdIterator:
        return ChunkdIterator(self)

    def measured_here(self) -> bool:
        """Whether an iterator of this dataset times the trainer's waits where it runs
        now: ``measure``, in the process and thread that made the dataset (not Grain's
        ``mp_prefetch`` child, even with one worker, nor a ``prefetch`` thread), not in
        a torch DataLoader's worker, and the dataset not split by workers."""
        return (
            self.measure
            and self.workers == 1
            and (os.getpid(), threading.get_ident()) == self._trainer
            and not in_grain_worker()
            and not in_loader_worker()
        )

    def __str__(self) -> str:
        return (
            f"ChunkdIterDataset(snapshot={self.start.snapshot[:12]}, rank={self.rank}/"
            f"{self.world_size}, batch={self.batch_size}, worker={self.worker}/{self.workers})"
        )


class ChunkdIterator(grain.DatasetIterator):  # type: ignore[misc]
    """The iterator of a :class:`ChunkdIterDataset`: ``get_state``/``set_state``."""

    def __init__(self, owner: ChunkdIterDataset) -> None:
        super().__init__()
        self._owner = owner
        self._units: Units | None = None  # made on the first batch, in the reading process
        #: the stall meter (made on the first batch, where the iterator is measured)
        self.meter: StallMeter | None = None
        self._last: float | None = None
        self._begin(owner.start, 0)

    def _begin(self, start: LoaderState, yielded: int) -> None:
        self._start = start
        self._yielded = yielded
        self._finished = False
        self._batches: Iterator[Batch] | None = None
        total = len(self._owner.source)
        owner = self._owner
        self._steps = Steps(total, start.cursor, owner.batch_size, owner.world_size, owner.tail)

    def __next__(self) -> Batch:
        owner = self._owner
        outside = measured_outside()  # a meter around this next() counts the step
        if self.meter is None and not self._finished and not outside and owner.measured_here():
            self.meter = made = StallMeter(
                client_of(owner.source.dataset),
                train_job=owner.train_job,
                rank=owner.rank,
                world_size=owner.world_size,
                window=owner.stall_window,
            )
            # the loop leaving early (a break, an exception) sends the window too; the
            # rank's end is sent at the process's exit (or ``meter.close()``)
            finalizer = weakref.finalize(self, made.finish)
            finalizer.atexit = False  # at exit the meter's own hook ends the rank
        meter = self.meter
        if meter is None or outside:
            return self._next()
        asked = meter.clock()
        try:
            batch = self._next()
        except StopIteration:
            self._last = None  # the iteration's end: its window, not the job's end
            meter.finish()
            raise
        got = meter.clock()
        meter.add(got - asked, got - (asked if self._last is None else self._last), now=got)
        self._last = got
        return batch

    def _next(self) -> Batch:
        owner = self._owner
        if self._batches is None:
            dataset = owner.source.dataset
            if self._units is None:
                self._units = open_units(dataset, owner.settings)
            self._batches = read_steps(
                dataset,
                order_of(dataset.snapshot, self._start),
                self._steps,
                rank=owner.rank,
                first=owner.worker + self._yielded * owner.workers,
                every=owner.workers,
                prefetch=owner.prefetch,
                client=client_of(dataset),
                convert=as_array,
                units=self._units,
                batch_transform=owner.batch_transform,
                train_job=owner.train_job,
            )
        try:
            batch = next(self._batches)
        except StopIteration:
            self._finished = True
            raise
        if owner.collate_fn is not None:
            batch = batch._replace(samples=owner.collate_fn(list(batch.samples)))
        self._yielded += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        owner = self._owner
        return reader_state(
            self._start,
            self._steps,
            rank=owner.rank,
            world_size=owner.world_size,
            batch_size=owner.batch_size,
            tail=owner.tail,
            worker=owner.worker,
            workers=owner.workers,
            yielded=self._yielded,
            finished=self._finished,
            in_worker=owner.workers != 1,
        )

    def set_state(self, state: dict[str, Any]) -> None:
        owner = self._owner
        if isinstance(state, Mapping) and state.get("format") == WORKER_FORMAT:
            worker = WorkerState.parse(state)
            owner.checked(worker.start)
            theirs = (worker.rank, worker.world_size, worker.batch_size, worker.tail)
            mine = (owner.rank, owner.world_size, owner.batch_size, owner.tail)
            if (*theirs, worker.worker, worker.workers, worker.total) != (
                *mine,
                owner.worker,
                owner.workers,
                len(owner.source),
            ):
                raise ResumeStateError(
                    f"this is the state of worker {worker.worker} of {worker.workers} (rank "
                    f"{worker.rank} of {worker.world_size}, batch {worker.batch_size}); it "
                    "resumes only that worker of such a pipeline: start a ChunkdIterDataset "
                    "from global_state(pipeline_state) instead"
                )
            self._begin(worker.start, worker.yielded)
            return
        self._begin(owner.checked(LoaderState.parse(state)), 0)

    def __str__(self) -> str:
        return f"ChunkdIterator({self._owner})"
