"""The trainer's side of a torch DataLoader, measured: :func:`measured`.

A :class:`~chunkd.client.torch.SnapshotDataset` runs in the DataLoader's workers,
which never see the trainer: how long the trainer waited for a batch is seen only in
the main process, around the DataLoader's iterator. :func:`measured` is that
iterator, timed by a :class:`~chunkd.client.StallMeter`: the documented way to
iterate a DataLoader over chunkd data::

    for batch in measured(loader, train_job="run-7"):
        step(batch)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from chunkd.client.datasets.loader import client_of
from chunkd.client.stalls import REPORT_WINDOW, StallMeter, job_of
from chunkd.client.torch.snapshots import SnapshotDataset

if TYPE_CHECKING:
    from chunkd.client.core import Client

__all__ = ["measured"]

T = TypeVar("T")


def measured(
    dataloader: Iterable[T],
    *,
    train_job: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    client: Client | None = None,
    window: float = REPORT_WINDOW,
) -> Iterator[T]:
    """The batches of ``dataloader`` (one epoch: one ``iter(dataloader)``), each
    ``next()`` timed and reported to the node's daemon by a
    :class:`~chunkd.client.StallMeter` (a ``loader_report`` a window of ``window``
    seconds, and one when the loop ends or leaves). An epoch's end is not the job's:
    the rank's end (``end=true``) is sent once, when the process exits. A chunkd
    ``Loader`` or Grain iterator inside ``dataloader`` (``num_workers=0``, or
    ``measured(loader)`` itself) does not measure the same steps again.

    Where the DataLoader's dataset is a :class:`SnapshotDataset`, it is told the job
    and the moment the iteration starts, before ``iter(dataloader)`` starts the
    workers: their ``ds_first_batch`` then carries the ``train_job``, the ``rank`` and
    ``worker_start`` counted from that moment. The first step's wait runs from the
    call of ``measured`` (a dataset opened on first use, such as a
    :class:`~chunkd.client.torch.ShardDataset`'s scan, is opened here and counts).

    Args:
        dataloader: a ``torch.utils.data.DataLoader`` (any iterable).
        train_job: the job; None: the SnapshotDataset's ``train_job``, else the
            client's (``Client(train_job=)``), else :func:`~chunkd.client.job_name`'s
            (the environment's).
        rank: this trainer's rank; None: the SnapshotDataset's (whether or not
            ``world_size`` is given), else ``$RANK``, else ``$SLURM_PROCID``, else 0.
        world_size: the job's ranks; None: the SnapshotDataset's (whether or not
            ``rank`` is given), else ``$WORLD_SIZE``, else ``$SLURM_NTASKS``, else 1;
            at least ``rank + 1``.
        client: the daemon reported to (its socket); None: the SnapshotDataset's
            client, else the default socket.
        window: seconds between two reports.

    Raises:
        ValueError: a bad ``train_job``, ``rank``, ``world_size`` or ``window``.
    """
    asked = time.perf_counter()  # the first wait runs from here: the loop began
    dataset: Any = getattr(dataloader, "dataset", None)
    snapshots = dataset if isinstance(dataset, SnapshotDataset) else None
    if snapshots is not None:
        # each on its own: a rank given still takes the dataset's world size, and the
        # reverse, before the environment's
        rank = snapshots.rank if rank is None else rank
        world_size = snapshots.world_size if world_size is None else world_size
        if client is None:
            try:
                client = client_of(snapshots.dataset)
            except ValueError:  # a SnapshotDataset without a dataset
                client = None
        if train_job is None:
            train_job = snapshots.train_job  # the dataset's own argument
    # the argument, else the client's (its reads' job), else the environment's
    job = job_of(train_job, client)
    meter = StallMeter(client, train_job=job, rank=rank, world_size=world_size, window=window)
    return meter.wrap(_started(dataloader, snapshots, meter.train_job), asked=asked)


def _started(
    dataloader: Iterable[T], snapshots: SnapshotDataset | None, job: str | None
) -> Iterator[T]:
    if snapshots is not None:
        # Before iter(): the workers take the dataset (forked or pickled) as it is then.
        snapshots.train_job = job
        snapshots.iteration_started = time.monotonic()
    yield from dataloader
