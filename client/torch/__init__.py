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

The rooms, each one job, none importing a room above it:

- :mod:`.tensors`: :func:`as_tensor`, zero-copy tensors over views;
- :mod:`.slot`: the client of one process (:class:`~.slot.ClientSlot`);
- :mod:`.records`: :class:`Record` and :class:`RecordDataset`;
- :mod:`.order`: an epoch's global read order and a consumer's cursor in it (numpy
  only; what the order depends on and what the cursor holds are written down there);
- :mod:`.formats`: how a JSON lines, fixed-record or Parquet shard splits into samples;
- :mod:`.sample_ids`: ``"BACKEND/KEY#INDEX"``;
- :mod:`.state`: the saved states of a :class:`ShardDataset`, their checks, and a
  rank's global state from what a DataLoader saved;
- :mod:`.shards`: :class:`ShardDataset`, which composes them.

This package imports torch and numpy when it is imported; ``import chunkd.client``
imports neither. Install torch first (``pip install torch==2.13.0``, the ``torch``
extra).
"""

from __future__ import annotations

from chunkd.client.torch.formats import ShardKind
from chunkd.client.torch.records import Record, RecordDataset
from chunkd.client.torch.sample_ids import SampleId, split_sample_id
from chunkd.client.torch.shards import ShardDataset
from chunkd.client.torch.tensors import as_tensor

__all__ = [
    "Record",
    "RecordDataset",
    "SampleId",
    "ShardDataset",
    "ShardKind",
    "as_tensor",
    "split_sample_id",
]
