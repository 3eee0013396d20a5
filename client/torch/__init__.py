"""torch data loading through the node's chunkd daemon.

:func:`as_tensor`
    A tensor over a view from :meth:`Client.read <chunkd.client.Client.read>`, without
    a copy. The view maps the daemon's **sealed** chunks read-only, so the tensor must
    never be written: torch has no read-only tensors, and a write through a
    ``PROT_READ`` mapping kills the process with ``SIGSEGV`` (not an exception).
    ``copy=True`` gives a writable tensor of its own.

:class:`RecordDataset`
    A map-style dataset of byte ranges ``(name, offset, length)``.

:class:`SnapshotDataset`
    An iterable dataset of one rank's batches of a dataset snapshot, in chunkd's read
    order (:mod:`chunkd.client.datasets.order`), split over ranks and DataLoader
    workers by whole steps, with an explicit tail, prefetching ahead, and a state of
    at most 256 bytes that resumes at any world size, batch size and ``num_workers``
    (``state_dict()``/``load_state_dict()``, the contract of torchdata's
    ``StatefulDataLoader``, and :func:`global_state` for a loader of another
    ``num_workers``; the workers' states and :func:`global_state` are the core's,
    :mod:`chunkd.client.datasets.workers`). A thin adapter over
    :mod:`chunkd.client.datasets.loader`, which the plain Python
    :class:`~chunkd.client.datasets.loader.Loader` and the Grain adapter
    (:mod:`chunkd.client.grain`) share.

:func:`measured`
    The DataLoader's batches, each ``next()`` timed in the trainer's process and
    reported to the daemon (a :class:`~chunkd.client.StallMeter`): **the way to
    iterate** a DataLoader over chunkd data, ``for batch in measured(loader):``. It
    tells a :class:`SnapshotDataset` the job, the rank and when the iteration began,
    so its workers' first-batch timings carry them.

:class:`ShardDataset`
    A :class:`SnapshotDataset` of a list of shards (JSON lines, fixed-size records or
    Parquet) never registered: they are scanned into a snapshot in memory.

Clients and processes
    Each dataset reads through a :class:`~chunkd.client.Client`. A DataLoader worker
    forked after the client exists reuses it (the client reconnects after a fork, and
    its mappings stay valid). :class:`RecordDataset` and :class:`ShardDataset` make
    their client on first use in a process from a factory (default: ``Client()``),
    so they also pickle (the ``spawn`` start method) as the factory, which must then
    be picklable (``functools.partial(Client, path)`` is; a lambda is not).

    A memoryview cannot be pickled, so it cannot leave a DataLoader worker: the
    datasets turn fixed records into tensors (which torch moves into shared memory),
    and a ``transform`` can make anything else picklable.

The rooms, each one job, none importing a room above it:

- :mod:`.tensors`: :func:`as_tensor`, zero-copy tensors over views;
- :mod:`.slot`: the client of one process (:class:`~.slot.ClientSlot`);
- :mod:`.records`: :class:`Record` and :class:`RecordDataset`;
- :mod:`.sample_ids`: ``"KEY#INDEX"``;
- :mod:`.snapshots`: :class:`SnapshotDataset`;
- :mod:`.shards`: :class:`ShardDataset`;
- :mod:`.stalls`: :func:`measured`.

This package imports torch and numpy when it is imported; ``import chunkd.client``
imports neither. Install torch first (``pip install torch==2.13.0``, the ``torch``
extra).
"""

from __future__ import annotations

from chunkd.client.datasets.loader import Batch
from chunkd.client.datasets.workers import global_state
from chunkd.client.torch.records import Record, RecordDataset
from chunkd.client.torch.sample_ids import SampleId, split_sample_id
from chunkd.client.torch.shards import ShardDataset, ShardKind
from chunkd.client.torch.snapshots import SnapshotDataset
from chunkd.client.torch.stalls import measured
from chunkd.client.torch.tensors import as_tensor

__all__ = [
    "Batch",
    "Record",
    "RecordDataset",
    "SampleId",
    "ShardDataset",
    "ShardKind",
    "SnapshotDataset",
    "as_tensor",
    "global_state",
    "measured",
    "split_sample_id",
]
