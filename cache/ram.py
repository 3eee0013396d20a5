"""The RAM tier: one sealed memfd per chunk.

Each chunk is written once into its own ``memfd`` and then sealed against write,
grow and shrink (and against further sealing). A sealed fd can be handed to any
local process (``SCM_RIGHTS``) and mapped read-only: no copy, and no client can
change the cache's bytes. Evicting a chunk only closes the tier's fd; a process
that mapped it keeps a valid mapping until it unmaps, and a lease keeps the fd
itself open.

Charges against the budget are page-rounded, since that is what the kernel
really holds for a memfd.

Where shared memory may use transparent huge pages
(``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` set to ``advise``,
``within_size``, ``always`` or ``force``), a chunk of at least 2 MiB has its pages
allocated through a 2 MiB aligned mapping advised ``MADV_HUGEPAGE`` before its bytes
are written: the kernel gives a shared memory file huge pages only on a fault in such
a mapping (``write(2)`` and ``fallocate(2)`` give it 4 KiB pages under ``advise``). A
reader that maps the chunk 2 MiB aligned then takes one fault per 2 MiB, not one per
4 KiB (:mod:`chunkd.client.views` does). Where they may not (``never``, this
kernel's default), chunks are written with ``pwrite`` as before: filling through a
mapping costs more there (measured: 2.1 ms per 4 MiB chunk against 1.5).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import mmap
import os
import threading
from typing import Final

from chunkd import memfd
from chunkd.cache.chunkid import ChunkId
from chunkd.cache.policy import EvictionPolicy, S3FifoPolicy
from chunkd.cache.tier import Chunk, ChunkLease, Tier, TierStats
from chunkd.errors import CacheClosedError, ChunkTooLargeError
from chunkd.memfd import SEALS, close_fd_result

__all__ = [
    "HUGE_PAGE",
    "MEMFD_NAME",
    "SEALS",
    "RamLease",
    "RamTier",
    "close_fd_result",
    "seal_memfd",
    "seal_memfd_off_loop",
    "shmem_huge_pages",
]

#: the name every RAM-tier memfd carries (``/proc/PID/fd`` shows ``/memfd:chunkd``)
MEMFD_NAME: Final = "chunkd"

_PAGE: Final = mmap.PAGESIZE
# Below this size the copy is cheaper than a hop to a worker thread.
_INLINE_COPY_BYTES: Final = 256 * 1024

#: a PMD-mapped transparent huge page (x86-64, and arm64 with 4 KiB base pages)
HUGE_PAGE: Final = 2 << 20
_THP: Final = "/sys/kernel/mm/transparent_hugepage"
_GLOBAL: Final = f"{_THP}/shmem_enabled"
_PER_SIZE: Final = f"{_THP}/hugepages-{HUGE_PAGE >> 10}kB/shmem_enabled"
#: the shmem_enabled modes under which a fault in an advised mapping gets a huge page
_HUGE_MODES: Final = frozenset({b"always", b"within_size", b"advise", b"force"})
_MADV_HUGEPAGE: Final = 14
_MADV_POPULATE_WRITE: Final = 23
_MADV_DONTFORK: Final = 10
_MAP_FIXED: Final = 0x10


def _page_round(size: int) -> int:
    return max(_PAGE, -(-size // _PAGE) * _PAGE)


def _selected(path: str) -> bytes | None:
    """The bracketed choice of a THP sysfs file (``always [advise] never``).

    Raw ``os`` calls: about 2 us where ``Path.read_text`` takes 20.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        text = os.read(fd, 256)
    except OSError:
        return None
    finally:
        os.close(fd)
    start, end = text.find(b"["), text.find(b"]")
    return text[start + 1 : end] if 0 <= start < end else None


def shmem_huge_pages() -> bool:
    """Whether shared memory may use 2 MiB pages now, for a mapping advised
    ``MADV_HUGEPAGE``.

    Read from sysfs on every call (about 5 us, against about a millisecond to fill a
    4 MiB chunk), so a change of the setting counts from the next chunk on. The
    per-size setting (``hugepages-2048kB/shmem_enabled``), where the kernel has one and
    it is not ``inherit``, overrides the global one.
    """
    mode = _selected(_PER_SIZE)
    if mode is None or mode == b"inherit":
        mode = _selected(_GLOBAL)
    return mode in _HUGE_MODES


def _allocate_huge(fd: int, size: int) -> None:
    """Allocate the first ``size`` bytes of memfd ``fd`` as huge pages where the kernel
    allows them: map them shared and writable at a 2 MiB aligned address, advise
    ``MADV_HUGEPAGE``, fault every page in (``MADV_POPULATE_WRITE``), and unmap (a
    seal needs every writable mapping gone). The bytes are then written with
    ``pwrite``, which releases the GIL, into the pages already there.

    Raises:
        OSError: no memory for the pages, or no address space for the mapping.
    """
    lib = memfd.libc()
    span = size + HUGE_PAGE
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    base = lib.mmap(None, span, 0, private, -1, 0)  # PROT_NONE: address space only
    if base is None or base == lib.failed:
        err = ctypes.get_errno()
        raise OSError(err, f"reserving {span} bytes failed: {os.strerror(err)}")
    try:
        address = -(-base // HUGE_PAGE) * HUGE_PAGE
        flags = mmap.MAP_SHARED | _MAP_FIXED
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        if lib.mmap(address, size, prot, flags, fd, 0) != address:
            err = ctypes.get_errno()
            raise OSError(err, f"mapping a {size}-byte memfd failed: {os.strerror(err)}")
        # A worker process forked now must not inherit a writable mapping: the seal
        # would fail for as long as it lives (as chunkd.memfd.WritableMapping).
        if lib.madvise(address, size, _MADV_DONTFORK) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_DONTFORK) failed: {os.strerror(err)}")
        # EINVAL: a kernel without THP (or before 5.14, without POPULATE_WRITE): the
        # pages come as pwrite makes them.
        if lib.madvise(address, size, _MADV_HUGEPAGE) == 0 and (
            lib.madvise(address, size, _MADV_POPULATE_WRITE) != 0
        ):
            err = ctypes.get_errno()
            if err != errno.EINVAL:
                raise OSError(err, f"allocating a {size}-byte memfd failed: {os.strerror(err)}")
    finally:
        lib.munmap(base, span)


def seal_memfd(data: memoryview) -> int:
    """:func:`chunkd.memfd.sealed` under the RAM tier's name, :data:`MEMFD_NAME`, in
    2 MiB pages where the kernel allows them (:func:`shmem_huge_pages`; see the module's
    docstring).

    Blocking (one copy of the bytes); safe to call from any thread, and it needs no
    chunk id, so it can run while another thread hashes the same bytes.
    """
    view = memoryview(data).cast("B")
    if view.nbytes < HUGE_PAGE or not shmem_huge_pages():
        return memfd.sealed(view, MEMFD_NAME)
    fd = memfd.create(MEMFD_NAME, view.nbytes)
    try:
        _allocate_huge(fd, view.nbytes)
        memfd.write_at(fd, view)
        memfd.seal(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


async def seal_memfd_off_loop(data: memoryview) -> int:
    """:func:`seal_memfd` in a worker thread.

    Cancelling the caller never leaks the memfd (as
    :func:`chunkd.memfd.sealed_off_loop`): the copy finishes in its thread and the fd
    is closed as soon as it exists.
    """
    future = asyncio.get_running_loop().run_in_executor(None, seal_memfd, data)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(close_fd_result)
        raise


class _Entry:
    __slots__ = ("charge", "doomed", "fd", "pins", "size")

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.charge = _page_round(size)
        self.pins = 0
        self.doomed = False  # left the tier while pinned: close on last unpin


class RamLease(ChunkLease):
    """A pinned RAM-tier chunk; :meth:`fileno` is its sealed memfd."""

    __slots__ = ("_entry", "_map", "_tier")

    def __init__(self, tier: RamTier, cid: ChunkId, entry: _Entry) -> None:
        super().__init__(cid, entry.size, "ram")
        self._tier = tier
        self._entry = entry
        self._map: mmap.mmap | None = None

    def fileno(self) -> int:
        # docstring inherited
        if self.released:
            raise CacheClosedError(f"lease on chunk {self.id} was released; lease it again")
        return self._entry.fd

    def view(self) -> memoryview:
        # docstring inherited
        if self.size == 0:
            return memoryview(b"")
        if self._map is None:
            self._map = mmap.mmap(
                self.fileno(), self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ
            )
        return memoryview(self._map).toreadonly()

    def _on_release(self) -> None:
        # The mapping (if any) is not closed here: views handed out may still use
        # it, and they keep it alive on their own.
        self._map = None
        self._tier._unpin(self._entry)


class RamTier(Tier):
    """Chunks in sealed memfds, under a byte budget and an eviction policy.

    Args:
        budget_bytes: most bytes held (page-rounded charges).
        policy: eviction order; :class:`S3FifoPolicy` by default.
        max_chunk_bytes: largest chunk accepted.
        max_chunks: most chunks held, each one an open memfd (None: no bound but the
            bytes). Small chunks (a dataset of 100k small files) would else hold more
            fds than the process may open.
    """

    name = "ram"

    def __init__(
        self,
        budget_bytes: int,
        *,
        policy: EvictionPolicy[ChunkId] | None = None,
        max_chunk_bytes: int = 64 << 20,
        max_chunks: int | None = None,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must not be negative; got {budget_bytes}")
        if max_chunks is not None and max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1 or None; got {max_chunks}")
        self._budget = budget_bytes
        self._max_chunks = max_chunks
        self._max_chunk = max_chunk_bytes
        self._policy: EvictionPolicy[ChunkId] = policy or S3FifoPolicy()
        self._policy.set_capacity(budget_bytes)
        self._entries: dict[ChunkId, _Entry] = {}
        self._used = 0
        self._pinned = 0
        self._lock = threading.Lock()
        self._closed = False
        self._stats = TierStats(name=self.name, budget_bytes=budget_bytes)

    # -- properties -----------------------------------------------------------------

    @property
    def budget_bytes(self) -> int:
        # docstring inherited
        return self._budget

    @property
    def used_bytes(self) -> int:
        # docstring inherited
        return self._used

    @property
    def supports_fds(self) -> bool:
        # docstring inherited
        return True

    # -- Tier -----------------------------------------------------------------------

    async def get(self, cid: ChunkId, *, count: bool = True) -> RamLease | None:
        # docstring inherited
        return self.lease(cid, count=count)

    def lease(self, cid: ChunkId, *, count: bool = True) -> RamLease | None:
        """Synchronous :meth:`get`: cheap enough to call on the event loop."""
        with self._lock:
            self._check_open()
            entry = self._entries.get(cid)
            if entry is None:
                if count:
                    self._stats.misses += 1
                return None
            self._pin(entry)
            self._policy.access(cid)
            if count:
                self._stats.hits += 1
        return RamLease(self, cid, entry)

    async def put(self, chunk: Chunk) -> bool:
        # docstring inherited
        return await self._put(chunk, lease=False) is not None

    async def put_leased(self, chunk: Chunk) -> RamLease | None:
        # docstring inherited
        return await self._put(chunk, lease=True)

    async def _put(self, chunk: Chunk, *, lease: bool) -> RamLease | None:
        # Returns the lease (with lease=False, a released placeholder) when the
        # tier holds the chunk, None when it declined.
        staged = chunk.take_staged_fd()  # ours from here on: admitted or closed
        adopt = False
        try:
            self._check_put(chunk)
            with self._lock:
                held = self._entries.get(chunk.id)
                if held is not None:
                    self._policy.access(chunk.id)
                    return self._lease_entry(chunk.id, held, lease)
                if _page_round(chunk.size) > self._budget:
                    self._stats.rejected += 1
                    return None
            adopt = True
        finally:
            if staged is not None and not adopt:
                os.close(staged)
        if staged is not None:
            fd = staged
        elif chunk.size <= _INLINE_COPY_BYTES:
            fd = seal_memfd(chunk.data)
        else:
            fd = await seal_memfd_off_loop(chunk.data)
        return self.admit(chunk.id, fd, chunk.size, lease=lease)

    def admit(self, cid: ChunkId, fd: int, size: int, *, lease: bool = True) -> RamLease | None:
        """Take ownership of a sealed memfd ``fd`` holding chunk ``cid``.

        The fd must carry :data:`SEALS` (see :func:`seal_memfd`); it is closed if the
        tier declines it or already holds the chunk.
        """
        with self._lock:
            if self._closed:
                os.close(fd)
                self._check_open()
            held = self._entries.get(cid)
            if held is not None:  # another put won the race
                os.close(fd)
                self._policy.access(cid)
                return self._lease_entry(cid, held, lease)
            entry = _Entry(fd, size)
            if not self._make_room(entry.charge):
                os.close(fd)
                self._stats.rejected += 1
                return None
            self._entries[cid] = entry
            self._used += entry.charge
            self._policy.insert(cid, entry.charge)
            self._stats.inserts += 1
            return self._lease_entry(cid, entry, lease)

    async def contains(self, cid: ChunkId) -> bool:
        # docstring inherited
        self._check_open()
        return cid in self._entries

    async def discard(self, cid: ChunkId) -> bool:
        # docstring inherited
        with self._lock:
            self._check_open()
            entry = self._entries.pop(cid, None)
            if entry is None:
                return False
            self._policy.remove(cid)
            self._drop(entry)
            return True

    def stats(self) -> TierStats:
        # docstring inherited
        with self._lock:
            snap = TierStats(**vars(self._stats))
            snap.errors = dict(self._stats.errors)
            snap.bytes = self._used
            snap.chunks = len(self._entries)
            snap.pinned = self._pinned
            return snap

    async def close(self) -> None:
        # docstring inherited
        with self._lock:
            if self._closed:
                return
            self._closed = True
            entries, self._entries = self._entries, {}
            for cid, entry in entries.items():
                self._policy.remove(cid)
                self._drop(entry)

    # -- internals ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError("the RAM tier is closed; open a new cache")

    def _check_put(self, chunk: Chunk) -> None:
        self._check_open()
        if chunk.size > self._max_chunk:
            raise ChunkTooLargeError(
                f"chunk {chunk.id} is {chunk.size} bytes; the RAM tier accepts at most "
                f"{self._max_chunk} (raise cache.chunk_bytes or split the data)"
            )

    def _lease_entry(self, cid: ChunkId, entry: _Entry, lease: bool) -> RamLease:
        # called with the lock held
        if lease:
            self._pin(entry)
            return RamLease(self, cid, entry)
        placeholder = RamLease(self, cid, entry)
        placeholder._released = True
        return placeholder

    def _pin(self, entry: _Entry) -> None:
        if entry.pins == 0:
            self._pinned += 1
        entry.pins += 1

    def _unpin(self, entry: _Entry) -> None:
        with self._lock:
            entry.pins -= 1
            if entry.pins == 0:
                self._pinned -= 1
                if entry.doomed:
                    os.close(entry.fd)

    def _is_pinned(self, cid: ChunkId) -> bool:
        return self._entries[cid].pins > 0

    def _make_room(self, charge: int) -> bool:
        # called with the lock held
        most = self._max_chunks
        while self._used + charge > self._budget or (
            most is not None and len(self._entries) >= most
        ):
            victim = self._policy.evict(self._is_pinned)
            if victim is None:
                return False
            self._drop(self._entries.pop(victim))
            self._stats.evictions += 1
        return True

    def _drop(self, entry: _Entry) -> None:
        # called with the lock held; the entry has left _entries
        self._used -= entry.charge
        if entry.pins:
            entry.doomed = True
        else:
            os.close(entry.fd)
