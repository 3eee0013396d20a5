"""The cache as the daemon uses it: index, RAM tier over disk tier, chunk maps.

:class:`ChunkCache` owns one cache directory (exclusively: a second process gets
a clear error), opens the lmdb index and both tiers, starts the background
reconciliation, and exposes the few operations the read and write paths need.

Hits and misses (:meth:`ChunkCache.stats`) count readers' lookups, each once: a hit
of the tier whose copy the reader got, or a miss. A reader looks a chunk up by locator
(:meth:`ChunkCache.lookup`, the read path) or by id (:meth:`ChunkCache.get`);
:meth:`ChunkCache.find` is the daemon's own lease (a chunk it has just stored, or
fetched for a reader whose miss was counted, or checks) and counts as neither.

Pinned writes (:meth:`ChunkCache.put_pinned`, :meth:`ChunkCache.pin`,
:meth:`ChunkCache.unpin`) are for bytes that exist nowhere else yet, such as a
checkpoint's chunks before they reach their backend: they go to the disk tier and
eviction leaves them there until released.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import resource
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from chunkd import faults
from chunkd.cache.chunkid import ChunkId
from chunkd.cache.disk import DiskTier, FsyncPolicy
from chunkd.cache.index import (
    ChunkRef,
    Index,
    Locator,
    ObjectInfo,
    ObjectVersion,
    ValidatedVersion,
)
from chunkd.cache.policy import EvictionPolicy, LruPolicy, S3FifoPolicy
from chunkd.cache.ram import RamTier, close_fd_result, seal_memfd_off_loop
from chunkd.cache.tier import Chunk, ChunkLease, TierStats
from chunkd.cache.tiered import TieredCache, WritePolicy
from chunkd.errors import (
    CacheClosedError,
    ChunkdError,
    ChunkNotFoundError,
    ChunkTooLargeError,
    ConfigError,
    IntegrityError,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["CacheConfig", "CacheStats", "ChunkCache", "lock_holder"]

log = logging.getLogger("chunkd.cache")

_GiB = 1 << 30
# Below this size a chunk is hashed and copied on the calling thread.
_STAGE_MIN_BYTES = 256 * 1024


@dataclass(frozen=True)
class CacheConfig:
    """Settings of one cache. Every field has the default shown."""

    #: the cache directory: ``index/`` (lmdb), ``chunks/``, ``tmp/``, ``LOCK``
    dir: Path = Path("chunkd-cache")
    #: RAM tier budget (page-rounded bytes in sealed memfds)
    ram_bytes: int = 8 * _GiB
    #: disk tier budget (stored bytes, after compression)
    disk_bytes: int = 200 * _GiB
    #: free space the disk tier leaves on its filesystem
    disk_min_free_bytes: int = 1 * _GiB
    #: the largest chunk, and the size objects are split into
    chunk_bytes: int = 4 << 20
    #: when the disk tier fsyncs ("always" or "never")
    fsync: FsyncPolicy = FsyncPolicy.ALWAYS
    #: store chunks zstd-compressed on disk when that saves at least 1/8
    compress: bool = True
    #: verify every chunk read from disk against its id
    verify_reads: bool = True
    #: where new chunks go ("write-through", "write-behind", "upper-only")
    write_policy: WritePolicy = WritePolicy.THROUGH
    #: RAM eviction policy: "s3fifo" (scan-resistant) or "lru"
    eviction: str = "s3fifo"
    #: threads for disk I/O
    disk_workers: int = 4
    #: most seconds an index write waits to be committed
    index_flush_interval: float = 0.05
    #: seconds the disk tier pauses writes after ENOSPC or EIO
    disk_retry_after: float = 30.0
    #: sweep the disk tier against the index in the background after opening
    reconcile: bool = True

    def policy(self) -> EvictionPolicy[ChunkId]:
        """A new instance of the configured RAM eviction policy."""
        if self.eviction == "s3fifo":
            return S3FifoPolicy()
        if self.eviction == "lru":
            return LruPolicy()
        raise ConfigError(f"cache.eviction must be 's3fifo' or 'lru'; got {self.eviction!r}")


@dataclass
class CacheStats:
    """A snapshot of the whole cache."""

    #: each tier's counters; a tier's ``hits`` are the readers' lookups it answered
    tiers: list[TierStats]
    #: lookups no tier could answer, a locator the chunk map did not know included:
    #: each lookup is one hit (of one tier) or one miss
    misses: int
    index_commits: int
    index_commit_errors: int
    #: index writes waiting for a commit (a stalled index disk shows here first)
    index_backlog: int = 0
    #: re-learnt index writes dropped because commits fell that far behind
    index_dropped: int = 0
    #: what the last background reconciliation did (empty while it runs)
    reconciled: dict[str, int] = field(default_factory=dict)


class ChunkCache:
    """One cache directory: RAM over disk, with the index. Use :meth:`open`.

    Pinned writes: a writer whose bytes exist nowhere else yet (a checkpoint save
    before its upload) writes them with :meth:`put_pinned`, which stores the chunk on
    the disk tier (not in RAM) and pins it there: eviction, however full the tier,
    passes over a pinned chunk until as many :meth:`unpin` calls as pins were taken
    (:meth:`pin` takes more, :attr:`pinned` counts the chunks held). A pin keeps bytes,
    never wrong bytes: a pinned chunk found damaged when read is still dropped. A pin
    lives in this process only; after a restart the writer pins again (the daemon
    passes its journaled chunks to :meth:`open`). :meth:`on_disk` says whether the
    disk tier holds a chunk now (a pin taken after a concurrent eviction chose the
    chunk does not bring it back), :meth:`commit_index` commits the index's batched
    records (before a ``syncfs`` makes the files and their records durable together),
    and :meth:`read_disk` reads a chunk back from the disk tier, verified, without
    promoting it into RAM or counting a lookup.
    """

    def __init__(
        self, config: CacheConfig, index: Index, ram: RamTier, disk: DiskTier, lock_fd: int
    ) -> None:
        self.config = config
        self.index = index
        self.ram = ram
        self.disk = disk
        self.tiers = TieredCache(ram, disk, write_policy=config.write_policy)
        self._lock_fd = lock_fd
        self._closed = False
        self._stop = threading.Event()
        self._reconciled: dict[str, int] = {}
        self._reconcile_task: asyncio.Task[None] | None = None
        # Lookups of a locator the chunk map did not know: misses no tier was asked.
        self._unmapped_misses = 0

    @classmethod
    async def open(cls, config: CacheConfig, *, pinned: Iterable[bytes] = ()) -> ChunkCache:
        """Open (creating if needed) the cache in ``config.dir``.

        ``pinned``: chunk ids kept from eviction (:meth:`pin`) before the
        background reconciliation starts, which evicts down to the budget, oldest first
        (the daemon's journaled saves, whose jobs pin their own chunks only once resumed);
        the caller unpins them.

        Raises:
            ChunkdError: another process holds the directory.
            IndexSchemaError: the index was written by an incompatible version.
        """
        cache = await asyncio.to_thread(cls._open_sync, config)
        cache.disk.pin(pinned)
        if config.reconcile:
            cache._reconcile_task = asyncio.create_task(cache._reconcile())
        return cache

    @classmethod
    def _open_sync(cls, config: CacheConfig) -> ChunkCache:
        raise_fd_limit()
        root = Path(config.dir)
        root.mkdir(parents=True, exist_ok=True)
        lock_fd = _lock_dir(root)
        try:
            index = Index(
                root / "index",
                chunk_bytes=config.chunk_bytes,
                flush_interval=config.index_flush_interval,
                # One durability policy for the directory: with fsync "never" the
                # index does not fsync either (on ext4 each index fsync would also
                # force out the chunk files' dirty data, fsyncing them after all).
                sync=config.fsync is FsyncPolicy.ALWAYS,
            )
            try:
                ram = RamTier(
                    config.ram_bytes,
                    policy=config.policy(),
                    max_chunk_bytes=config.chunk_bytes,
                    max_chunks=memfd_budget(),
                )
                disk = DiskTier(
                    root,
                    index,
                    budget_bytes=config.disk_bytes,
                    min_free_bytes=config.disk_min_free_bytes,
                    fsync=config.fsync,
                    compress=config.compress,
                    verify=config.verify_reads,
                    max_chunk_bytes=config.chunk_bytes,
                    workers=config.disk_workers,
                    retry_after=config.disk_retry_after,
                    # RAM holds the chunks read soon; the page cache need not too
                    direct_writes=config.ram_bytes > 0,
                )
            except BaseException:
                index.close()
                raise
        except BaseException:
            os.close(lock_fd)
            raise
        return cls(config, index, ram, disk, lock_fd)

    async def _reconcile(self) -> None:
        try:
            done = await asyncio.to_thread(self.disk.reconcile, stop=self._stop)
        except CacheClosedError:
            return
        except Exception:
            log.exception("background reconciliation of %s failed", self.config.dir)
            return
        self._reconciled = done
        if any(done.values()):
            log.info("reconciled %s: %s", self.config.dir, done)

    async def wait_reconciled(self) -> dict[str, int]:
        """Wait for the background reconciliation; return what it did."""
        if self._reconcile_task is not None:
            await self._reconcile_task
        return dict(self._reconciled)

    # -- chunks ---------------------------------------------------------------------

    async def insert(self, data: Buffer, expected: ChunkId | None = None) -> ChunkId:
        """Hash ``data``, check it against ``expected`` if given, and store it.

        Returns the chunk id, whether or not a tier could keep the chunk (a full
        RAM tier of pinned chunks and a degraded disk both decline): the caller
        has the bytes either way. Use :meth:`put` when the verdict matters.
        Hashing runs in a thread for large buffers, next to
        the copy into the RAM tier. ``data`` must not change during the call: the
        hash and the copy read it at about the same time. (Bytes from a memory
        another process can still write must be sealed first, then hashed.)

        Raises:
            ChunkTooLargeError: ``data`` is longer than ``chunk_bytes``.
            IntegrityError: ``data`` does not hash to ``expected``.
        """
        self._check_open()
        view = memoryview(data)
        if view.nbytes > self.config.chunk_bytes:
            raise ChunkTooLargeError(
                f"a chunk holds at most {self.config.chunk_bytes} bytes (cache.chunk_bytes); "
                f"got {view.nbytes}: split it with split_chunks()"
            )
        if view.nbytes < _STAGE_MIN_BYTES:
            cid = ChunkId.of(view)
            fd = None
        else:
            # Copy into a sealed memfd on one thread while another hashes: the two
            # passes over the bytes overlap instead of adding up. The hash keeps to
            # one thread; a multi-threaded one only fights the copy for the cores
            # (measured on 2 cores: 1.1 GB/s against 0.7).
            staging = asyncio.ensure_future(seal_memfd_off_loop(view))
            try:
                cid = await asyncio.to_thread(ChunkId.of, view, threads=1)
                fd = await staging
            except BaseException:
                staging.add_done_callback(close_fd_result)  # cancelled or failed: no leak
                raise
        chunk = Chunk.trusted(cid, view, staged_fd=fd)
        try:
            if expected is not None and cid != expected:
                raise IntegrityError(
                    f"chunk {expected} failed verification: its {view.nbytes} bytes hash to {cid}"
                )
            faults.point("cache.insert")
            await self.tiers.put(chunk)
        except OSError as exc:
            # The caller has the bytes: a tier that fails to take them (no memory for
            # a memfd, a failing disk) costs a later read, never this one.
            log.warning("chunk %s could not be cached (%s); served without keeping it", cid, exc)
        finally:
            chunk.close_staged_fd()
        return cid

    async def put(self, chunk: Chunk) -> bool:
        """Store a chunk whose bytes are already known to match its id."""
        self._check_open()
        return await self.tiers.put(chunk)

    async def find(self, cid: ChunkId) -> ChunkLease | None:
        """Lease ``cid`` from the fastest tier that holds it, or ``None``.

        Not counted as a hit or a miss: a reader's lookup is :meth:`lookup` (by
        locator) or :meth:`get` (by id). This is the daemon's own lease (a chunk it
        has just stored, or fetched for a reader whose miss was counted, or checks).
        """
        self._check_open()
        return await self.tiers.get(cid, count=False)

    async def lookup(self, locator: Locator) -> tuple[ChunkRef | None, ChunkLease | None]:
        """A reader's lookup of the chunk at ``locator``: its chunk map entry (if the
        index knows it) and a lease from the fastest tier that holds it (if any).

        Counted once (:meth:`stats`): a hit of the tier whose copy the lease is
        (``disk`` for a chunk promoted into RAM by this lookup), else a miss, also
        when the chunk map does not know the locator yet (a first read).
        """
        self._check_open()
        ref = self.index.resolve(locator)
        if ref is None:
            self._unmapped_misses += 1
            return None, None
        return ref, await self.tiers.get(ref.id)

    async def get(self, cid: ChunkId) -> ChunkLease:
        """A reader's lookup of ``cid`` by id (``GET /v1/chunks/{id}``): a lease from the
        fastest tier that holds it, counted as :meth:`lookup` is.

        Raises:
            ChunkNotFoundError: no tier holds it.
        """
        self._check_open()
        lease = await self.tiers.get(cid)
        if lease is None:
            raise ChunkNotFoundError(
                f"chunk {cid} is not cached on this node; read it through its object "
                "(BACKEND/KEY) so it is fetched from the source"
            )
        return lease

    async def contains(self, cid: ChunkId) -> bool:
        """Whether any tier holds ``cid``."""
        self._check_open()
        return await self.tiers.contains(cid)

    async def discard(self, cid: ChunkId) -> bool:
        """Remove ``cid`` from every tier."""
        self._check_open()
        return await self.tiers.discard(cid)

    # -- pinned writes --------------------------------------------------------------

    async def put_pinned(
        self,
        chunk: Chunk,
        *,
        pin: bool = True,
        sync: bool = False,
        compress: bool = False,
        direct: bool = True,
    ) -> bool:
        """Pin ``chunk`` (see the class docstring) and write it to the disk tier; whether
        the tier holds it now (``False``: declined, full of pinned chunks or degraded; the
        pin is kept all the same and released by :meth:`unpin` as any other).

        ``pin=False``: the caller holds a pin on this id already (a chunk repeated within
        one save), so none is taken. ``sync=False`` skips the per-file fsyncs (make many
        chunks durable at once with :meth:`commit_index` and a ``syncfs``);
        ``compress=False`` stores it raw; ``direct=True`` writes its pages to the device
        without a page-cache copy (:meth:`DiskTier.put`): ``chunk.data`` must not change
        until the call returns.

        Raises:
            ChunkTooLargeError: the chunk is larger than the tier accepts.
        """
        if pin:  # first, whatever follows: the caller releases one pin per id it asked for
            self.disk.pin([chunk.id])
        self._check_open()
        return await self.disk.put(chunk, sync=sync, compress=compress, direct=direct)

    def pin(self, cids: Iterable[bytes]) -> None:
        """Keep ``cids`` on the disk tier, out of eviction's reach, until as many
        :meth:`unpin` calls (a chunk not on the tier is kept once it is written)."""
        self.disk.pin(cids)

    def unpin(self, cids: Iterable[bytes]) -> None:
        """Release one pin of each of ``cids``: eviction may take them again."""
        self.disk.unpin(cids)

    @property
    def pinned(self) -> int:
        """How many distinct chunks are pinned."""
        return self.disk.pinned

    def on_disk(self, cid: bytes) -> bool:
        """Whether the disk tier holds ``cid`` now (its record is in the index)."""
        self._check_open()
        return self.index.lookup(cid) is not None

    def commit_index(self) -> None:
        """Commit the index's batched records now (blocking: call it in a thread)."""
        self._check_open()
        self.index.flush()

    async def read_disk(self, cid: ChunkId) -> ChunkLease | None:
        """``cid`` from the disk tier, verified; ``None`` if it is not there (or found
        damaged and dropped). Not promoted into RAM, not counted as a reader's lookup."""
        self._check_open()
        return await self.disk.get(cid, count=False)

    # -- chunk maps -----------------------------------------------------------------

    def resolve(self, locator: Locator) -> ChunkRef | None:
        """The chunk recorded at ``locator``, if any."""
        self._check_open()
        return self.index.resolve(locator)

    def resolve_many(self, version: ObjectVersion, indexes: Iterable[int]) -> list[ChunkRef | None]:
        """Chunk map entries of ``version`` at ``indexes``."""
        self._check_open()
        return self.index.resolve_many(version, indexes)

    def record(self, locator: Locator, cid: ChunkId, length: int) -> None:
        """Record that ``locator`` holds ``cid`` (batched)."""
        self._check_open()
        self.index.record(locator, cid, length)

    def record_object(self, info: ObjectInfo) -> None:
        """Record an object version's size (batched)."""
        self._check_open()
        self.index.put_object(info)

    # -- validated versions of names ------------------------------------------------

    def validated(self, backend: str, key: str) -> ValidatedVersion | None:
        """The version ``backend/key`` had when its backend last confirmed it, and when;
        kept across restarts. A single lookup: cheap enough for the event loop."""
        self._check_open()
        return self.index.get_validated(backend, key)

    def record_validated(self, record: ValidatedVersion) -> None:
        """Record that the backend confirmed ``record``'s version just now (batched)."""
        self._check_open()
        self.index.put_validated(record)

    def forget_validated(self, backend: str, key: str) -> None:
        """Drop what was validated of ``backend/key`` (batched)."""
        self._check_open()
        self.index.forget_validated(backend, key)

    # -- lifecycle ------------------------------------------------------------------

    def stats(self) -> CacheStats:
        """Per-tier counters and index health."""
        return CacheStats(
            tiers=self.tiers.tier_stats(),
            misses=self.tiers.stats().misses + self._unmapped_misses,
            index_commits=self.index.commits,
            index_commit_errors=self.index.commit_errors,
            index_backlog=self.index.backlog,
            index_dropped=self.index.dropped,
            reconciled=dict(self._reconciled),
        )

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    async def close(self) -> None:
        """Finish pending writes, flush the index, close the tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._reconcile_task is not None:
            await asyncio.gather(self._reconcile_task, return_exceptions=True)
        await self.tiers.close()
        await asyncio.to_thread(self.index.close)
        os.close(self._lock_fd)

    async def __aenter__(self) -> ChunkCache:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError(f"the cache at {self.config.dir} is closed; open it again")


def lock_holder(root: Path) -> str | None:
    """Who holds the cache directory ``root`` open: the pid its holder wrote into
    ``LOCK`` (``"unknown"`` when it wrote none), or ``None`` when no process does.

    Creates nothing and keeps no lock: a look, for a command that must not touch a
    cache in use (``chunkd selfcheck``). A process opening the cache meanwhile
    finds it free again at once.

    Raises:
        OSError: ``LOCK`` exists but cannot be opened (another user's cache).
    """
    try:
        fd = os.open(root / "LOCK", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder(fd)
        return None  # closing the fd lets go of the shared lock
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"


def _lock_dir(root: Path) -> int:
    """Hold ``root/LOCK`` exclusively for this process's lifetime."""
    fd = os.open(root / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise ChunkdError(
            f"the cache directory {root} is in use by another chunkd (pid {holder}); "
            "stop it or give this one its own cache.dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def raise_fd_limit() -> int:
    """Raise this process's soft limit of open fds to its hard limit (every RAM-tier
    chunk is an open memfd; a shell's soft limit is often 1024); returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:  # a container's odd limits: keep the soft one
            log.warning("could not raise the open-files limit from %s to %s: %s", soft, hard, exc)
            return soft
        soft = hard
    return soft


def memfd_budget() -> int | None:
    """The most chunks the RAM tier may hold: three quarters of the open-files limit
    (the rest is for sockets, the index, disk files and fds in flight); None when the
    limit is infinite."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    return max(64, soft * 3 // 4)
