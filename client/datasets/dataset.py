"""A registered snapshot, opened for reading: :class:`Dataset`.

A dataset is ``len``-sized, and its sample ``i`` is read directly (random access): the
snapshot's samples are numbered over its members in key order
(:meth:`chunkd.snapshot.Snapshot.locate`). Every read is pinned: a member whose source
object changed raises :class:`~chunkd.errors.SnapshotDriftError` naming it, unless
the snapshot is frozen, in which case its bytes come from the registry's chunks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from chunkd.client.datasets.formats import Format, format_of
from chunkd.client.datasets.pages import DaemonPages
from chunkd.client.datasets.source import PinnedSource, Source
from chunkd.memfd import close_all
from chunkd.snapshot import Snapshot

if TYPE_CHECKING:
    from chunkd.client.core import Client

__all__ = ["Dataset", "resolve"]


def resolve(client: Client, ref: str) -> tuple[Snapshot, dict[str, Any], Source]:
    """The snapshot ``ref`` names (``NAME@N``, ``NAME@TAG``, ``NAME`` or an id), what the
    registry says of it, and the source its members are read from.

    Raises:
        DatasetNotFoundError: no snapshot answers to ``ref``.
        ManifestError: its manifest is torn or forged.
        InvalidRequestError: ``ref`` is not a reference.
    """
    with client.request("ds_resolve", {"ref": ref}) as reply:
        header = dict(reply.header)
        fds = list(reply.fds)
        reply.fds.clear()
    try:
        # A schema-2 snapshot's pages come from the daemon as they are touched.
        pages = DaemonPages(client, header.get("registry"))
        snapshot = Snapshot.parse(_fd_bytes(fds[0]), expect_id=header["snapshot"], pages=pages)
        source: Source = PinnedSource(client, snapshot.backend)
        if header.get("frozen") and len(fds) > 1:
            from chunkd.client.datasets.frozen import FrozenSource

            source = FrozenSource.from_record(client, header, _fd_bytes(fds[1]), snapshot)
    finally:
        close_all(fds)
    return snapshot, header, source


def _fd_bytes(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, size, 0) if size else b""


class Dataset:
    """A snapshot's samples, by index.

    Args:
        snapshot: the snapshot.
        source: where its members' bytes come from.
        registry: what the registry said of it (name, version, tags), if resolved.
    """

    def __init__(
        self, snapshot: Snapshot, source: Source, registry: dict[str, Any] | None = None
    ) -> None:
        self.snapshot = snapshot
        self.source = source
        self.registry = registry or {}
        name = self.registry.get("name")
        if isinstance(name, str) and getattr(source, "dataset", False) is None:
            source.dataset = name  # type: ignore[attr-defined]  # its reads say whose they are
        #: seconds it took to get the snapshot (resolving it, or scanning its members)
        self.metadata_seconds = 0.0
        self._formats: dict[str, Format] = {}
        self._owned: Client | None = None

    @classmethod
    def open(cls, ref: str, client: Client | None = None) -> Dataset:
        """The snapshot ``ref`` names, through the node's daemon (default: ``Client()``).

        Raises:
            DatasetNotFoundError, ManifestError, InvalidRequestError: as :func:`resolve`.
        """
        owned = client is None
        if client is None:
            from chunkd.client.core import Client

            client = Client()
        started = time.perf_counter()
        try:
            snapshot, header, source = resolve(client, ref)
        except BaseException:
            if owned:
                client.close()
            raise
        dataset = cls(snapshot, source, header)
        dataset.metadata_seconds = time.perf_counter() - started
        if owned:
            dataset._owned = client
        return dataset

    def close(self) -> None:
        """Close the client the dataset opened for itself (``Dataset.open`` without a
        client, or a copy unpickled in a worker); a client given to it stays open."""
        owned, self._owned = self._owned, None
        if owned is not None:
            owned.close()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        # A DataLoader or Grain worker started by ``spawn`` gets the dataset pickled: it
        # carries the manifest and the daemon's socket, never a connection, and opens
        # its own (a resolved snapshot is resolved again, so a frozen one stays frozen).
        client = getattr(self.source, "client", None)
        socket = None if client is None else client.socket_path
        return (_reopen, (self.snapshot.data, self.snapshot.id, self.registry, socket))

    def __repr__(self) -> str:
        label = self.registry.get("name")
        version = self.registry.get("version")
        what = f"{label}@{version}" if label else self.id[:12]
        members = len(self.snapshot.members)
        return f"<chunkd Dataset {what}: {len(self)} samples in {members} members>"

    @property
    def id(self) -> str:
        """The snapshot id."""
        return self.snapshot.id

    def __len__(self) -> int:
        return len(self.snapshot)

    def __getitem__(self, index: int) -> Any:
        if index < 0:
            index += len(self)
        member, sample = self.snapshot.locate(index)
        return self.read(member, sample)

    def format(self, member: int) -> Format:
        """The format of member ``member``."""
        name = self.snapshot.members[member].format
        fmt = self._formats.get(name)
        if fmt is None:
            fmt = self._formats[name] = format_of(name)
        return fmt

    def read(self, member: int, sample: int) -> Any:
        """Sample ``sample`` of member ``member``."""
        entry = self.snapshot.members[member]
        if not 0 <= sample < entry.samples:
            raise IndexError(f"sample {sample} of member {entry.key} of {entry.samples}")
        return self.format(member).read(self.source, entry, sample)

    def fetch(self, pairs: Iterable[tuple[int, int]]) -> int:
        """Read the byte ranges that reading each ``(member, sample)`` pair needs (into
        the client's cache, where the source has one); returns the bytes read."""
        got = 0
        for member, sample in pairs:
            entry = self.snapshot.members[member]
            for offset, length in self.format(member).ranges(entry, sample):
                got += len(self.source.read(entry, offset, length))
        return got

    def ranges(self, pairs: Iterable[tuple[int, int]]) -> list[tuple[str, int, int]]:
        """The byte ranges ``(BACKEND/KEY, offset, length)`` that reading each
        ``(member, sample)`` pair needs, from the manifest alone (for a prefetch)."""
        found: list[tuple[str, int, int]] = []
        if not getattr(self.source, "prefetchable", True):
            return found  # a frozen snapshot: its source objects are not what it reads
        for member, sample in pairs:
            entry = self.snapshot.members[member]
            name = self.source.name(entry)
            found += [(name, o, n) for o, n in self.format(member).ranges(entry, sample)]
        return found

    def sample_id(self, member: int, sample: int) -> str:
        """A sample's id: ``KEY#i``, stable whatever the order, ranks or workers."""
        return f"{self.snapshot.members[member].key}#{sample}"


def _reopen(data: bytes, snapshot_id: str, registry: dict[str, Any], socket: object) -> Dataset:
    from chunkd.client.core import Client

    client = Client(socket_path=socket if isinstance(socket, str | os.PathLike) else None)
    try:
        if registry.get("snapshot") == snapshot_id:
            dataset = Dataset.open(snapshot_id, client)
        else:
            snapshot = Snapshot.parse(data, expect_id=snapshot_id, pages=DaemonPages(client))
            dataset = Dataset(snapshot, PinnedSource(client, snapshot.backend))
    except BaseException:
        client.close()
        raise
    dataset._owned = client
    return dataset
