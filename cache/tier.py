"""The tier interface: one abstract, async-first contract every tier implements.

A tier stores chunks by id. :class:`RamTier` keeps each chunk in a sealed memfd,
:class:`DiskTier` in a file, and :class:`TieredCache` composes two tiers (RAM over
disk) and is itself a tier. All of them pass the same conformance suite
(``tests/tier_conformance.py``).

Contract, modelled on zarr's ``Store``:

* ``get`` returns ``None`` when the chunk is absent. It raises only for real
  failures of the caller's request (a closed tier). A damaged or unreadable copy
  is counted, dropped, and reported as absent: a tier never returns bytes that do
  not hash to their id.
* ``get`` is a lookup, and counts as one: a hit when the tier answers, a miss when
  it does not (:class:`TierStats`). ``get(cid, count=False)`` leases without
  counting, for a caller that is not looking a chunk up: one that has just stored
  it, or waited on another caller's fetch of it, or reads it back for its own work
  (an upload). So a chunk fetched from the source and then leased to its reader is
  one miss, never a miss and a hit.
* ``put`` takes a :class:`Chunk`, whose bytes are known to match its id, and
  returns whether the tier now holds it. A tier may decline (budget full of pinned
  chunks, disk degraded); declining is not an error.
* A :class:`ChunkLease` keeps the chunk it names readable until it is released:
  a leased chunk is never evicted, and the bytes it exposes stay valid.
"""

from __future__ import annotations

import mmap
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING

from chunkd.cache.chunkid import ChunkId
from chunkd.errors import IntegrityError

if TYPE_CHECKING:  # collections.abc.Buffer arrives in 3.12
    from typing_extensions import Buffer

__all__ = ["BytesLease", "Chunk", "ChunkLease", "Tier", "TierStats"]


class Chunk:
    """A chunk's bytes together with an id they are known to hash to.

    Build one with :meth:`of` (hash the bytes) or :meth:`verified` (hash and
    compare with an expected id). :meth:`trusted` skips the hash and is only for
    bytes that were verified already, such as the contents of a sealed memfd.
    The bytes are not copied: ``data`` is a read-only view of the caller's buffer,
    which must not change while the chunk is being stored.
    """

    __slots__ = ("_staged_fd", "data", "id")

    def __init__(self, cid: ChunkId, data: Buffer, *, staged_fd: int | None = None) -> None:
        self.id = cid
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        self.data = view.toreadonly()
        self._staged_fd = staged_fd

    def take_staged_fd(self) -> int | None:
        """Take ownership of a sealed memfd already holding these bytes, if one came along.

        A caller may copy the bytes into a sealed memfd (:func:`chunkd.memfd.sealed`)
        while it hashes them, and attach it here; the first fd-backed tier that
        stores the chunk adopts the fd instead of copying again. Whoever takes it
        owns it; :meth:`close_staged_fd` closes one nobody took.
        """
        fd, self._staged_fd = self._staged_fd, None
        return fd

    def close_staged_fd(self) -> None:
        """Close the staged memfd if no tier adopted it."""
        fd = self.take_staged_fd()
        if fd is not None:
            os.close(fd)

    @classmethod
    def of(cls, data: Buffer) -> Chunk:
        """Hash ``data`` and wrap it with its id."""
        view = memoryview(data)
        return cls(ChunkId.of(view), view)

    @classmethod
    def verified(cls, cid: ChunkId, data: Buffer) -> Chunk:
        """Wrap ``data`` after checking that it hashes to ``cid``.

        Raises:
            IntegrityError: ``data`` hashes to another id.
        """
        view = memoryview(data)
        actual = ChunkId.of(view)
        if actual != cid:
            raise IntegrityError(
                f"chunk {cid} failed verification: its {view.nbytes} bytes hash to {actual}"
            )
        return cls(cid, view)

    @classmethod
    def trusted(cls, cid: ChunkId, data: Buffer, *, staged_fd: int | None = None) -> Chunk:
        """Wrap bytes already verified against ``cid`` (no hash)."""
        return cls(cid, data, staged_fd=staged_fd)

    @property
    def size(self) -> int:
        """The chunk's length in bytes."""
        return self.data.nbytes

    def __repr__(self) -> str:
        return f"Chunk({self.id}, {self.size} bytes)"


class ChunkLease(ABC):
    """A chunk handed out by a tier, readable until :meth:`release`.

    While a lease is held its chunk is pinned: the tier will not evict it. Use it
    as a context manager, or call :meth:`release` exactly once (extra calls are
    harmless).
    """

    __slots__ = ("_released", "id", "origin", "size")

    def __init__(self, cid: ChunkId, size: int, origin: str = "") -> None:
        self.id = cid
        self.size = size
        #: the tier whose copy the bytes come from ("ram", "disk"; "" when none):
        #: a chunk the RAM tier took from the disk tier on this get is "disk"
        self.origin = origin
        self._released = False

    def fileno(self) -> int | None:
        """A sealed, read-only-mappable fd holding exactly the chunk's bytes.

        The fd belongs to the tier and stays open while the lease is held: pass it
        on (``SCM_RIGHTS``, ``sendfile``) or ``dup`` it, never close it. ``None``
        when the tier does not keep chunks in fds.
        """
        return None

    @abstractmethod
    def view(self) -> memoryview:
        """A read-only view of the chunk's bytes.

        The view stays valid after the lease is released (it holds its own
        reference to the memory), but only the lease keeps the chunk in the tier.
        """

    def read(self) -> bytes:
        """A copy of the chunk's bytes."""
        return bytes(self.view())

    def release(self) -> None:
        """Unpin the chunk. Idempotent."""
        if not self._released:
            self._released = True
            self._on_release()

    def _on_release(self) -> None:  # noqa: B027 - a hook; most leases pin nothing
        """Hook for subclasses: drop the pin."""

    @property
    def released(self) -> bool:
        """Whether :meth:`release` was called."""
        return self._released

    def __enter__(self) -> ChunkLease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"{type(self).__name__}({self.id}, {self.size} bytes, {state})"


class BytesLease(ChunkLease):
    """A lease over bytes already in this process (read from disk, say)."""

    __slots__ = ("_data",)

    def __init__(
        self,
        cid: ChunkId,
        data: bytes | bytearray | mmap.mmap | memoryview,
        origin: str = "",
    ) -> None:
        super().__init__(
            cid, memoryview(data).nbytes if isinstance(data, memoryview) else len(data), origin
        )
        self._data = data

    def view(self) -> memoryview:
        # docstring inherited
        return memoryview(self._data).toreadonly()


@dataclass
class TierStats:
    """A snapshot of one tier's counters. Counters only grow; gauges are current."""

    name: str
    #: lookups (``get``) answered from this tier
    hits: int = 0
    #: lookups this tier could not answer
    misses: int = 0
    #: chunks stored by ``put``
    inserts: int = 0
    #: puts declined (no room, degraded, too large for the budget)
    rejected: int = 0
    #: chunks removed to make room
    evictions: int = 0
    #: copies found damaged (wrong hash, truncated) and dropped
    integrity_failures: int = 0
    #: copies the index named but that were gone, dropped
    missing: int = 0
    #: OS errors by kind ("enospc", "eio", "other")
    errors: dict[str, int] = field(default_factory=dict)
    #: gauge: bytes held (as charged against the budget)
    bytes: int = 0
    #: gauge: chunks held
    chunks: int = 0
    #: gauge: the byte budget
    budget_bytes: int = 0
    #: gauge: chunks pinned by leases
    pinned: int = 0
    #: gauge: why the tier is degraded, or ``None`` when healthy
    degraded: str | None = None


class Tier(ABC):
    """A store of chunks by id. See the module docstring for the contract."""

    #: short name used in metrics labels ("ram", "disk", ...)
    name: str

    @property
    @abstractmethod
    def budget_bytes(self) -> int:
        """The most bytes this tier holds."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes held now, as charged against the budget."""

    @property
    def persistent(self) -> bool:
        """Whether the tier's contents survive a restart."""
        return False

    @property
    def supports_fds(self) -> bool:
        """Whether leases carry a sealed fd (see :meth:`ChunkLease.fileno`)."""
        return False

    @abstractmethod
    async def get(self, cid: ChunkId, *, count: bool = True) -> ChunkLease | None:
        """Lease the chunk ``cid``, or return ``None`` when the tier does not hold it.

        Args:
            cid: the chunk.
            count: a lookup, counted as a hit or a miss in :meth:`stats`; ``False``
                for a lease that is no lookup (a chunk the caller just stored, or
                waited on another's fetch of).
        """

    @abstractmethod
    async def put(self, chunk: Chunk) -> bool:
        """Store ``chunk``; return whether the tier holds it afterwards.

        Storing a chunk the tier already holds is cheap and returns ``True``.

        Raises:
            ChunkTooLargeError: the chunk is larger than the tier accepts.
            CacheClosedError: the tier is closed.
        """

    async def put_leased(self, chunk: Chunk) -> ChunkLease | None:
        """Store ``chunk`` and lease it in one step; ``None`` when the tier declined.

        Unlike ``put`` followed by ``get``, this does not count a hit.
        """
        if not await self.put(chunk):
            return None
        return await self.get(chunk.id, count=False)

    @abstractmethod
    async def contains(self, cid: ChunkId) -> bool:
        """Whether the tier holds ``cid`` (without leasing it)."""

    @abstractmethod
    async def discard(self, cid: ChunkId) -> bool:
        """Remove ``cid``; return whether it was held. Outstanding leases stay valid."""

    @abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of the tier's counters and gauges."""

    @abstractmethod
    async def close(self) -> None:
        """Release the tier's resources. Later calls raise ``CacheClosedError``."""
