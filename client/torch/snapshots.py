"""A dataset snapshot as a torch ``IterableDataset`` of batches: :class:`SnapshotDataset`.

A thin adapter over the loader core (:mod:`chunkd.client.datasets.loader`): the order,
the steps, their split over ranks and workers, the tail, prefetching and the state are
the core's; this module adds torch's worker detection, tensors and collation, and
the ``state_dict``/``load_state_dict`` pair torchdata's ``StatefulDataLoader`` calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, Unpack

from torch.utils.data import IterableDataset, default_collate, get_worker_info

from chunkd.client.datasets.epoch import order_version
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
from chunkd.client.datasets.state import LoaderState
from chunkd.client.datasets.workers import (
    WORKER_FORMAT,
    WorkerState,
    global_state,
    reader_state,
)
from chunkd.client.jobs import job_name
from chunkd.client.torch.pinned import collate_columns
from chunkd.client.torch.tensors import as_tensor
from chunkd.errors import ResumeStateError

__all__ = ["SnapshotDataset", "collate_columns"]

#: ``collate_fn``'s default: the batch's columns as tensors (:func:`collate_columns`)
_COLLATE: Final = collate_columns


@dataclass(slots=True)
class _Progress:
    """Where the current iteration of this process is."""

    start: LoaderState
    steps: Steps
    worker: int
    workers: int
    in_worker: bool
    yielded: int = 0
    finished: bool = False


class SnapshotDataset(IterableDataset[Batch]):
    """One rank's batches of a dataset snapshot, in chunkd's order, resumable anywhere.

    Use it with ``batch_size=None`` (the dataset batches): each item is a
    :class:`~chunkd.client.datasets.loader.Batch`, this rank's share of one global
    step, read by columns, with ``samples`` collated: by default
    (:func:`~chunkd.client.torch.pinned.collate_columns`) straight from the columns,
    as tensors of their own (fixed-size records: one ``[B, record_bytes]`` ``uint8``
    tensor; Parquet and Arrow rows: a dict of columns, numbers as tensors of the
    column's type, strings and other values as ``default_collate`` gives them; JSON
    lines: a list of ``bytes``), and ``columns`` set to the same tensors; a
    ``collate_fn`` given (or a ``transform``) collates the list of samples instead, as
    before. Also ``ids``, ``step``, ``position``, ``padding`` and ``last`` (see the
    core's module docstring for steps, ranks, workers and the tail). With
    ``DataLoader(pin_memory=True)`` torch pins the batch's tensors
    (:meth:`Batch.pin_memory <chunkd.client.datasets.loader.Batch.pin_memory>`).

    Workers
        Worker ``k`` of ``K`` produces the rank's batches of steps ``k, k+K, ...``, so
        torch's DataLoader (and torchdata's ``StatefulDataLoader``, ``in_order=True``),
        which takes a batch from each worker in turn, yields them in step order at any
        ``num_workers``. Each worker warms its next ``prefetch`` steps in the daemon's
        cache before it reads one (the first ones before its first read). Workers are
        forked (the default on Linux) and inherit the dataset and its client, which
        reconnects after the fork.

    Resuming
        ``state_dict()`` in the main process is the ``chunkd.loader/3`` state (at most
        256 bytes, the same on every rank): load it into a dataset of any world size,
        batch size and ``num_workers``. In a DataLoader worker it is the worker's own
        (:mod:`chunkd.client.datasets.workers`); torchdata restores those into a loader of
        the same ``num_workers``, exactly. For any other loader, turn the loader's
        state into the chunkd state with :meth:`global_state` and
        ``load_state_dict`` that on the new loader's dataset (before iterating it, and
        without loading the old loader state into the new loader).

        A loaded state of an epoch's end (its cursor at the epoch's size) only drops
        a state loaded before: the next iteration deals the epoch :meth:`set_epoch`
        chose, from its start (torchdata loads a finished loader's state after the
        training loop has set the next epoch). ``set_epoch`` to another epoch than a
        loaded state's drops that state; to the same one, keeps it.

    Args:
        dataset: the snapshot opened for reading
            (:class:`~chunkd.client.datasets.Dataset`).
        settings: the reading's settings
            (:class:`~chunkd.client.datasets.loader.ReadSettings`), or each as a keyword
            argument (``batch_size`` and ``seed`` are then needed): ``batch_size``,
            ``seed``, ``rank``, ``world_size``, ``shuffle``, ``window``,
            ``window_bytes``, ``tail``, ``prefetch``, ``columns``, ``decode_ahead``,
            ``shared_decode``.
        transform: applied to each sample (after fixed records become tensors); the
            batch is then collated from its samples.
        batch_transform: makes the batch's columns of its columns, before the collate.
        collate_fn: makes a batch's ``samples``: the default takes the columns
            (:func:`~chunkd.client.torch.pinned.collate_columns`); any other callable
            gets the list of samples (None: the list as it is).
        train_job: the job its first batch's timings and reads are accounted to
            (:func:`~chunkd.client.job_name`; None: the client's);
            :func:`~chunkd.client.torch.measured` sets it.

    Raises:
        ValueError: an argument out of its range, or a ``train_job`` that is no job
            name.
    """

    def __init__(
        self,
        dataset: Readable | None,
        settings: ReadSettings | None = None,
        *,
        transform: Callable[[Any], Any] | None = None,
        batch_transform: Callable[[dict[str, Any]], Any] | None = None,
        collate_fn: Callable[[Any], Any] | None = _COLLATE,
        train_job: str | None = None,
        **options: Unpack[ReadOptions],
    ) -> None:
        super().__init__()
        self.train_job = None if train_job is None else job_name(train_job)
        #: when the trainer began the current iteration (``time.monotonic()``), as
        #: :func:`~chunkd.client.torch.measured` tells it: the workers' ``worker_start``
        #: runs from it
        self.iteration_started: float | None = None
        chosen = ReadSettings.merged(settings, options)
        self.settings = chosen
        self._dataset = dataset
        self.batch_size = chosen.batch_size
        self.seed = chosen.seed
        self.rank = chosen.rank
        self.world_size = chosen.world_size
        self.shuffle = chosen.shuffle
        self.window = chosen.window
        self.window_bytes = chosen.window_bytes
        self.tail: Tail = chosen.tail
        self.prefetch = chosen.prefetch
        self.transform = transform
        self.batch_transform = batch_transform
        self.collate_fn = collate_fn
        self._epoch = 0
        self._pending: LoaderState | WorkerState | None = None
        self._progress: _Progress | None = None

    def __repr__(self) -> str:
        return (
            f"<chunkd {type(self).__name__} seed={self.seed}, epoch={self._epoch}, "
            f"rank {self.rank}/{self.world_size}, batch {self.batch_size}>"
        )

    @property
    def dataset(self) -> Readable:
        """The dataset read."""
        if self._dataset is None:
            raise ValueError("this SnapshotDataset has no dataset")
        return self._dataset

    @property
    def epoch(self) -> int:
        """The epoch dealt."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Deal epoch ``epoch`` next; a loaded state of another epoch is dropped."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0; got {epoch!r}")
        if epoch != self._epoch:
            self._epoch = epoch
            self._pending = None
            self._progress = None

    def total_samples(self) -> int:
        """Samples in an epoch, all ranks together."""
        return len(self.dataset.snapshot)

    # -- resuming ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this rank (in the main process) or this DataLoader worker is: see the
        class docstring."""
        progress = self._progress
        if progress is None:
            if self._pending is not None:
                return self._pending.to_dict()
            return self._fresh().to_dict()
        return reader_state(
            progress.start,
            progress.steps,
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.batch_size,
            tail=self.tail,
            worker=progress.worker,
            workers=progress.workers,
            yielded=progress.yielded,
            finished=progress.finished,
            in_worker=progress.in_worker,
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from a :meth:`state_dict` (or a :meth:`global_state`) on the next
        iteration.

        Raises:
            ResumeStateError: the state is malformed, of another snapshot, seed or
                order settings, or of a format chunkd no longer resumes.
        """
        snapshot = self.dataset.snapshot
        if isinstance(state_dict, Mapping) and state_dict.get("format") == WORKER_FORMAT:
            worker = WorkerState.parse(state_dict)
            self._check(worker.start)
            self._progress = None
            self._epoch = worker.start.epoch
            self._pending = worker
            return
        loaded = LoaderState.parse(state_dict)
        self._check(loaded)
        self._progress = None
        if loaded.cursor == len(snapshot):
            self._pending = None  # nothing is left of that epoch (see the class docstring)
            return
        self._epoch = loaded.epoch
        self._pending = loaded

    @staticmethod
    def global_state(state: Any) -> dict[str, Any]:
        """The ``chunkd.loader`` state of what DataLoaders saved: see
        :func:`chunkd.client.datasets.workers.global_state`."""
        return global_state(state)

    def _check(self, state: LoaderState) -> None:
        state.check(
            snapshot=self.dataset.snapshot.id,
            order=order_version(self.dataset.snapshot),
            seed=self.seed,
            shuffle=self.shuffle,
            window=self.window,
            window_bytes=self.window_bytes,
            total=len(self.dataset.snapshot),
        )

    def _fresh(self) -> LoaderState:
        return LoaderState(
            self.dataset.snapshot.id,
            self.seed,
            self._epoch,
            0,
            shuffle=self.shuffle,
            window=self.window,
            window_bytes=self.window_bytes,
            order=order_version(self.dataset.snapshot),
        )

    # -- iterating -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        # The progress is set now, not on the first next(): torchdata asks a worker for
        # its state right after iter(), before any batch.
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        dataset = self.dataset
        pending, self._pending = self._pending, None
        start, yielded = self._fresh(), 0
        total = len(dataset.snapshot)
        if isinstance(pending, WorkerState):
            mine = (total, self.rank, self.world_size, self.batch_size, self.tail)
            theirs = (pending.total, pending.rank, pending.world_size, pending.batch_size)
            if (*theirs, pending.tail, pending.worker, pending.workers) != (
                *mine,
                worker,
                workers,
            ):
                raise ResumeStateError(
                    f"this is the state of DataLoader worker {pending.worker} of "
                    f"{pending.workers} (rank {pending.rank} of {pending.world_size}, batch "
                    f"{pending.batch_size}, tail {pending.tail}); it resumes only that "
                    f"worker of such a loader, not worker {worker} of {workers} (rank "
                    f"{self.rank} of {self.world_size}, batch {self.batch_size}, tail "
                    f"{self.tail}): load SnapshotDataset.global_state(loader_state) instead"
                )
            start, yielded = pending.start, pending.yielded
        elif pending is not None:
            start = pending
        steps = Steps(total, start.cursor, self.batch_size, self.world_size, self.tail)
        progress = _Progress(start, steps, worker, workers, info is not None, yielded)
        self._progress = progress
        return self._batches(dataset, progress)

    def _batches(self, dataset: Readable, progress: _Progress) -> Iterator[Batch]:
        units = open_units(dataset, self.settings)
        batches = read_steps(
            dataset,
            order_of(dataset.snapshot, progress.start),
            progress.steps,
            rank=self.rank,
            first=progress.worker + progress.yielded * progress.workers,
            every=progress.workers,
            prefetch=self.prefetch,
            client=client_of(dataset),
            convert=self._convert,
            units=units,
            batch_transform=self.batch_transform,
            train_job=self.train_job,
            started=self.iteration_started,
        )
        try:
            for batch in batches:
                batch = self._collated(batch)
                progress.yielded += 1  # before the yield: a state taken now counts it
                yield batch
            progress.finished = True
        finally:
            if units is not None:
                units.close()

    def _collated(self, batch: Batch) -> Batch:
        collate = self.collate_fn
        if collate is None:  # the rows as they are: samples and columns built where used
            return batch
        if collate is collate_columns and self.transform is None:
            collated = collate_columns(batch)
            if isinstance(collated, dict):
                return batch._replace(samples=collated, columns=collated)
            if batch.rows is not None and batch.rows.table is not None:
                name = batch.rows.table.column_names[0]
                return batch._replace(samples=collated, columns={name: collated})
            return batch._replace(samples=collated)
        if collate is collate_columns:  # a per-sample transform: its samples, collated
            return batch._replace(samples=default_collate(list(batch.samples)))
        return batch._replace(samples=collate(list(batch.samples)))

    def _convert(self, sample: Any) -> Any:
        if isinstance(sample, memoryview):
            sample = as_tensor(sample)
        return sample if self.transform is None else self.transform(sample)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_progress"] = None
        return state
