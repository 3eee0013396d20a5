"""A list of shards read as a snapshot: :class:`ShardDataset`.

For shards that were never registered: the dataset scans them (through the daemon,
with the member formats of :mod:`chunkd.client.datasets.formats`) into a snapshot held
in memory, and is then a :class:`~chunkd.client.torch.SnapshotDataset` of it: the same
order, steps, state and resume as a registered snapshot's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

from chunkd.client.core import Client
from chunkd.client.datasets.dataset import Dataset
from chunkd.client.datasets.epoch import DEFAULT_WINDOW, DEFAULT_WINDOW_BYTES
from chunkd.client.datasets.formats import format_of
from chunkd.client.datasets.loader import DEFAULT_PREFETCH, Tail
from chunkd.client.datasets.source import PinnedSource
from chunkd.client.torch.slot import ClientFactory
from chunkd.client.torch.snapshots import _COLLATE, SnapshotDataset
from chunkd.snapshot import Member, Snapshot

__all__ = ["ShardDataset", "ShardKind"]

#: what a shard holds: a sample per JSON line, per fixed-size record, per Parquet row
ShardKind = Literal["jsonl", "fixed", "parquet"]
_KINDS = ("jsonl", "fixed", "parquet")


class ShardDataset(SnapshotDataset):
    """Batches of a list of shards, in chunkd's order: a :class:`SnapshotDataset` of the
    snapshot the shards make.

    The shards are scanned on first use (what registration reads: a ``stat``, and the
    format's metadata: Parquet footers, JSON lines' line ends; fixed records need
    none), once, in the process that first needs them: call :meth:`total_samples`
    before making the DataLoader for its workers to inherit the snapshot. The
    snapshot's members are the shards in key order, pinned at the versions the scan
    saw: a shard that changes after it fails its reads with ``SnapshotDriftError``, and
    states saved of one version of the shards do not resume another.

    Samples are the formats': a Parquet **row** (a dict; before chunkd's snapshots a
    sample was a whole row group), a JSON line (``bytes``), a fixed-size record (a
    read-only ``uint8`` tensor). Sample ids are ``KEY#i``.

    Args:
        shards: shard names, ``BACKEND/KEY``, each once, all of one backend.
        kind: ``"jsonl"``, ``"fixed"`` or ``"parquet"``.
        record_bytes: the size of a record (``kind="fixed"`` only).
        client_factory: makes the process's :class:`~chunkd.client.Client` (default:
            ``Client()``); must pickle under the ``spawn`` start method.
        batch_size, seed, rank, world_size, shuffle, window, window_bytes, tail, prefetch,
            transform, collate_fn, train_job: as :class:`SnapshotDataset`'s.

    Raises:
        ValueError: a bad argument (an unknown kind, ``record_bytes`` missing or where
            it does not belong, a shard listed twice, shards of several backends).
    """

    def __init__(
        self,
        shards: Sequence[str],
        *,
        kind: ShardKind,
        seed: int,
        batch_size: int = 1,
        record_bytes: int | None = None,
        client_factory: ClientFactory | None = None,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        window: int | None = DEFAULT_WINDOW,
        window_bytes: int | None = DEFAULT_WINDOW_BYTES,
        tail: Tail = "uneven",
        prefetch: int = DEFAULT_PREFETCH,
        transform: Callable[[Any], Any] | None = None,
        collate_fn: Callable[[Any], Any] | None = _COLLATE,
        train_job: str | None = None,
    ) -> None:
        super().__init__(
            None,
            batch_size=batch_size,
            seed=seed,
            rank=rank,
            world_size=world_size,
            shuffle=shuffle,
            window=window,
            window_bytes=window_bytes,
            tail=tail,
            prefetch=prefetch,
            transform=transform,
            collate_fn=collate_fn,
            train_job=train_job,
        )
        self.shards = [str(name) for name in shards]
        if len(set(self.shards)) != len(self.shards):
            raise ValueError("a shard is listed twice; list each shard once (sample ids name it)")
        if kind not in _KINDS:
            raise ValueError(f"kind must be 'jsonl', 'fixed' or 'parquet'; got {kind!r}")
        if kind == "fixed" and (record_bytes is None or record_bytes <= 0):
            raise ValueError(f"kind='fixed' needs record_bytes > 0; got {record_bytes!r}")
        if kind != "fixed" and record_bytes is not None:
            raise ValueError(f"record_bytes is for kind='fixed' only; kind is {kind!r}")
        backends = sorted({name.partition("/")[0] for name in self.shards})
        if len(backends) > 1:
            raise ValueError(
                f"the shards are in several backends ({', '.join(backends)}); a snapshot's "
                "members are of one: make one dataset per backend, or register them"
            )
        self.kind: ShardKind = kind
        self.record_bytes = record_bytes
        self._backend = backends[0] if backends else "local"
        # The client is the dataset's, made from the factory in each process that
        # needs one (a forked worker inherits it; a pickled copy makes its own).
        self._factory: ClientFactory = client_factory or Client
        self._snapshot: Snapshot | None = None
        self._built: Dataset | None = None

    @property
    def dataset(self) -> Dataset:
        """The snapshot of the shards, scanned on first use (see the class docstring)."""
        if self._built is None:
            client = self._factory()
            source = PinnedSource(client, self._backend)
            if self._snapshot is None:
                self._snapshot = self._scan(source)
            self._built = Dataset(self._snapshot, source)
            # the client made here is the dataset's: it closes when the dataset goes
            weakref.finalize(self._built, client.close)
        return self._built

    def _scan(self, source: PinnedSource) -> Snapshot:
        fmt = format_of(self.kind)
        options = {} if self.record_bytes is None else {"record_bytes": self.record_bytes}
        members = []
        for name in self.shards:
            stat = source.client.stat(name)
            key = name.partition("/")[2]
            member = Member(key=key, size=stat.size, version=stat.version, format=self.kind)
            members.append(fmt.scan(source, member, options))
        return Snapshot.build(
            backend=self._backend,
            prefix="",
            format=self.kind,
            members=members,
            schema_of=fmt.schema(members) if members else None,
        )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_built"] = None  # its client does not pickle; the snapshot does
        return state
