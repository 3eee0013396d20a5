"""The disk tier: one file per chunk, recorded in the lmdb index.

Layout under the tier's root::

    chunks/ab/cd/<id>    the chunk's bytes, raw or one zstd frame
    tmp/<token>.<n>      files being written (renamed into chunks/ when complete)

Writing: bytes go to a temporary file, are fsynced when the policy says so, and
are renamed to their real name; only then is the index record queued. A caller
whose bytes cannot change (a checkpoint's sealed memfd) may ask for a direct write
(``put(direct=True)``): the block-aligned part of the chunk goes from its pages to
the device with ``O_DIRECT``, without a copy into the page cache, and the rest (a
tail shorter than a block, or everything where the file system or the alignment
refuses direct I/O) is written as usual. A tier under a RAM tier writes every raw
chunk so (``direct_writes=True``): what it writes is the RAM tier's sealed copy, and a
page-cache copy would be a third; a cold read through the daemon ran 1.42x as fast
(s3rver on loopback, 512 MiB, 2 cores: 401 against 283 MB/s), the buffered write's
copy and page allocation having been the daemon's largest cost. A crash at
any point leaves either no file, a temporary file, or a complete file under its
id. The index never claims a file that is not there: the file comes first, the
record second; on eviction the record is deleted (and committed) before the file.

Names and records. The invariant: a record the index holds (or queues) names a
file under ``chunks/`` with the bytes the record describes and, for a write with
fsync, whose bytes and name were durable before the record was queued, so that
after ``kill -9`` or a power loss the index claims no chunk that is not on disk
with the right bytes. ``_names_lock`` keeps it against the tier's other threads:

* A write renames its complete (and, with fsync, fdatasynced) temporary file to
  the chunk's name under the lock, fsyncs the directory (and, for a directory this
  process made, its parents) *without* the lock, then, under the lock again,
  queues the record only if the name still holds that very file (device and
  inode). Holding the lock across the directory fsync made concurrent inserts'
  fsyncs run one at a time; without it they share the file system's journal
  commits. A write without fsync (policy ``never``, or ``sync=False``: a checkpoint
  save, whose ``syncfs`` makes its files and names durable) queues its record
  right after the rename, as before.
* Between its rename and its record a chunk is *being named* (``_naming``): it has
  no record, so eviction (which unlinks only recorded chunks) cannot touch it, a
  reader finds no record and goes to the source, and reconciliation neither adopts
  it (its record could then be committed before the name is durable) nor removes
  it (an older file it failed to verify may have been renamed over since). Only a
  discard unlinks it: the write then finds its name gone and records nothing.
* A write never renames over a chunk that is recorded or being named: it checks
  both under the lock before its rename (its first lookup ran without the lock,
  and another write of the same id, one given up on after a stall, or a
  reconciliation may have got there since). So a recorded file is never replaced
  by one of another size, form or durability, and a name being synced is never
  taken from its write.
* Whatever unlinks a recorded file (eviction, a drop of a damaged or missing
  chunk, reconciliation) deletes and commits the record and unlinks the file
  under the lock, so no rename lands between the two, which would leave the index
  claiming a file that is gone.
* Reconciliation adopts an unindexed file under the lock, and only the very file
  it verified, unless a record appeared or a write is naming it; under policy
  ``always`` it first fsyncs the file and its directories (a killed process may
  have left it before its own fsyncs ran).
* ``kill -9`` anywhere leaves a temporary file (removed at the next start), a
  named file without a record (verified and adopted, or removed, by
  reconciliation), or a named file with its record: the same states as before
  the directory fsync moved out of the lock, since records were always queued
  after the rename and committed later in a batch.

The stricter alternative, queuing the record at once and having the index's
committer fsync every touched directory (or ``syncfs``) before each batched
commit, would also take the directory fsync off the writer, but ties the index to
this tier's directories and makes a failed directory fsync fail a commit of other
writes; the measured gain of releasing the lock already matched a plain
``open/write/fsync/rename`` path with no lock at all (``bench/aiofiles_bench.py``).

Reading: the record gives size and codec; the file is read, decompressed, and
verified by blake3 (``verify=True`` by default). A damaged, truncated or missing
file is counted, its record and file are dropped, and the read is a miss: the
caller goes on to the source. ENOSPC and EIO are counted and degrade the tier
(no new writes for ``retry_after`` seconds); they never fail a caller's read.

A stalled disk (a device that stops answering: every ``read(2)`` and ``write(2)``
blocks, and a thread blocked in one cannot be cancelled) must not stall the reads
RAM or the backend can serve. The tier's file I/O runs on ``workers`` threads behind
:class:`~chunkd.cache.admission.Admission` (admission on the loop, stall detection
after ``stall_after`` seconds, 0.5 by default; the mechanism is written down there).
For this tier:

* While stalled, :attr:`DiskTier.degraded` says so (``/v1/stats``, the
  ``chunkd_cache_degraded`` gauge), every ``get`` is a miss and every ``put``
  declines at once, without a worker, and every caller waiting for a worker or an
  operation stops waiting (a get is a miss, a put is declined). A get also stops
  waiting for its own operation after ``stall_after`` seconds, stalled or not: the
  source is always there, and a read must not wait on one bad file.
* An operation nobody waits for any more goes on in its thread: a late read is
  dropped, a late write still lands under its name with its record (file first,
  then index, as always), so a stall loses nothing from the index.
* Recovery needs no probe: the stall ends as soon as a stuck operation completes
  (a disk that comes back completes them first), and the tier takes reads and
  writes again at once. Each stall is counted once (``errors["stall"]``), each
  operation given up on too (``errors["gave_up"]``).

How a chunk's bytes are stored (raw, or one zstd frame when that saves enough) is
:mod:`chunkd.cache.codec`'s.

The index can stall as well (see :mod:`chunkd.cache.index`): when its commits fall
so far behind that its queue of batched writes is full, the tier declines writes
(a record it could not queue would leave a file the index does not know) and says
why in :attr:`DiskTier.degraded` until the queue drains.

This module is one job, the files of one tier and their agreement with the index
(write, read, evict, reconcile, and what each does with a failing disk); it passes
600 lines because each of those paths has its crash and fault cases written next to
it. Admission and stall detection (:mod:`chunkd.cache.admission`) and the stored form
(:mod:`chunkd.cache.codec`) are mechanisms of their own.

Startup does no scan: budget totals live in the index. :meth:`DiskTier.reconcile`
runs in the background to remove stale temporary files, drop records whose file is
gone, and adopt (after verifying) or delete files the index does not know.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import functools
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import Final

import blake3
import lmdb

from chunkd import faults
from chunkd.cache.admission import STALL_AFTER, Admission, GaveUp
from chunkd.cache.chunkid import HEX_CHARS, ChunkId, hash_threads
from chunkd.cache.codec import ChunkCodec, stored_forms
from chunkd.cache.index import ChunkRecord, Codec, Index, TierSet
from chunkd.cache.singleflight import SingleFlight
from chunkd.cache.tier import BytesLease, Chunk, Tier, TierStats
from chunkd.errors import (
    CacheClosedError,
    ChunkTooLargeError,
    IntegrityError,
    InvalidChunkIdError,
)

__all__ = ["DiskTier", "FsyncPolicy"]

log = logging.getLogger("chunkd.cache.disk")

# Constants, not config keys: they are the cost model of one decision, and no
# operator setting would make them better on one node than another.
#: the oldest chunks read from the index at a time while the tier evicts to its budget
_EVICT_BATCH: Final = 256
#: what a direct write's file offsets and lengths are multiples of: the largest
#: logical block size of the devices chunkd runs on (512 and 4096 both divide it)
_DIRECT_ALIGN: Final = 4096


class FsyncPolicy(StrEnum):
    """When the disk tier fsyncs what it writes."""

    #: fsync each chunk file and its directory before the index records it
    ALWAYS = "always"
    #: leave it to the kernel; a power loss may lose recent chunks (verification
    #: catches any damage on read)
    NEVER = "never"


class DiskTier(Tier):
    """Chunks as files under ``root``, recorded in ``index``.

    Args:
        root: the tier's directory (``chunks/`` and ``tmp/`` are created in it).
        index: the index that records this tier's chunks.
        budget_bytes: most stored (possibly compressed) bytes held.
        min_free_bytes: free space to leave on the filesystem; chunks are evicted,
            or new ones declined, to keep it.
        fsync: when to fsync (``"always"`` by default).
        compress: store a chunk zstd-compressed when that saves at least
            ``1 - compress_ratio`` of its size.
        compress_level: zstd level.
        compress_ratio: the largest compressed/raw ratio worth keeping (7/8).
        verify: check each chunk read against its id (on by default).
        max_chunk_bytes: largest chunk accepted.
        workers: threads for file I/O, and the most operations outstanding at once.
        retry_after: seconds a degraded tier waits before writing again (after
            ENOSPC or EIO; a stall ends when the disk answers again).
        stall_after: seconds an operation may be outstanding, with none completing,
            before the disk counts as stalled (see the module docstring).
        direct_writes: write every raw chunk as ``put(direct=True)`` does: for a
            tier under a RAM tier, which holds the chunks read soon.
    """

    name = "disk"

    def __init__(
        self,
        root: str | Path,
        index: Index,
        *,
        budget_bytes: int,
        min_free_bytes: int = 0,
        fsync: FsyncPolicy | str = FsyncPolicy.ALWAYS,
        compress: bool = True,
        compress_level: int = 1,
        compress_ratio: float = 7 / 8,
        verify: bool = True,
        max_chunk_bytes: int = 64 << 20,
        workers: int = 4,
        retry_after: float = 30.0,
        stall_after: float = STALL_AFTER,
        direct_writes: bool = False,
    ) -> None:
        self.root = Path(root)
        self._direct_writes = direct_writes
        self.index = index
        self._chunks_dir = self.root / "chunks"
        self._tmp_dir = self.root / "tmp"
        self._chunks_dir.mkdir(parents=True, exist_ok=True)
        self._tmp_dir.mkdir(parents=True, exist_ok=True)
        self._budget = budget_bytes
        self._min_free = min_free_bytes
        self._fsync = FsyncPolicy(fsync)
        self._compress = compress
        self._codec = ChunkCodec(compress=compress, level=compress_level, ratio=compress_ratio)
        self._verify = verify
        self._max_chunk = max_chunk_bytes
        self._retry_after = retry_after
        self._admission = Admission(
            workers,
            what=f"disk tier at {self.root}",
            count=self._count_kind,
            stall_after=stall_after,
        )
        self._token = secrets.token_hex(6)  # names this process's temporary files
        self._serial = itertools.count()
        # What a name under chunks/ may do next is decided under this lock (the
        # module docstring's "Names and records" says why each rule keeps the index
        # true): a record and its file are unlinked as a pair under it (eviction,
        # drops, reconciliation), a file gets its real name under it, and its record
        # is queued under it once the name is durable. Not held across a chunk's
        # directory fsync (see _write); eviction does hold it across its record
        # delete's commit, which must be durable before the unlink.
        self._names_lock = threading.Lock()
        # Chunk ids renamed into chunks/ whose writes have not recorded them yet (a
        # count: two writes of one id can overlap). Under _names_lock.
        self._naming: dict[bytes, int] = {}
        # Directories under chunks/ this process made whose own names may not be
        # durable yet; a sync write into one fsyncs its parents too. At most the
        # 65,536 leaf directories. Under _names_lock.
        self._unsynced_dirs: set[Path] = set()
        self._stats_lock = threading.Lock()
        self._stats = TierStats(name=self.name, budget_bytes=budget_bytes)
        self._degraded_until = 0.0
        self._writing: SingleFlight[ChunkId, bool] = SingleFlight()  # used on the loop only
        # Chunks eviction must keep (checkpoint chunks not yet in their backend).
        self._pins: dict[bytes, int] = {}
        self._pins_lock = threading.Lock()
        self._closed = False

    # -- properties -----------------------------------------------------------------

    @property
    def budget_bytes(self) -> int:
        # docstring inherited
        return self._budget

    @property
    def used_bytes(self) -> int:
        # docstring inherited
        return self.index.disk_bytes

    @property
    def persistent(self) -> bool:
        # docstring inherited
        return True

    def path_of(self, cid: ChunkId) -> Path:
        """Where chunk ``cid`` lives: ``chunks/ab/cd/<id>``."""
        hexid = cid.hex()
        return self._chunks_dir / hexid[:2] / hexid[2:4] / hexid

    def pin(self, cids: Iterable[bytes]) -> None:
        """Keep ``cids`` from eviction until as many :meth:`unpin` calls.

        A pinned chunk can still be dropped when it is found damaged: a pin keeps
        bytes, never wrong bytes.
        """
        with self._pins_lock:
            for cid in cids:
                self._pins[cid] = self._pins.get(cid, 0) + 1

    def unpin(self, cids: Iterable[bytes]) -> None:
        """Undo one :meth:`pin` of each of ``cids``."""
        with self._pins_lock:
            for cid in cids:
                left = self._pins.get(cid, 0) - 1
                if left > 0:
                    self._pins[cid] = left
                else:
                    self._pins.pop(cid, None)

    @property
    def pinned(self) -> int:
        """How many distinct chunks are pinned."""
        return len(self._pins)

    # -- Tier -----------------------------------------------------------------------

    async def get(self, cid: ChunkId, *, count: bool = True) -> BytesLease | None:
        # docstring inherited
        self._check_open()
        data = await self._admission.run(
            self.read_sync, cid, count, patience=self._admission.stall_after
        )
        if isinstance(data, GaveUp):
            if count:
                self._bump("misses")
            return None
        return None if data is None else BytesLease(cid, data, "disk")

    async def put(
        self,
        chunk: Chunk,
        *,
        sync: bool | None = None,
        compress: bool | None = None,
        direct: bool = False,
    ) -> bool:
        """Store ``chunk`` (see :meth:`Tier.put`).

        ``sync=False`` skips this write's fsyncs whatever the tier's policy: for a
        caller that writes many chunks and then makes them all durable at once
        (``syncfs``, as checkpoint saves do), which is much cheaper than one fsync
        per file and directory. ``compress=False`` stores it raw whatever the
        tier's policy (a save in a hurry: zstd cost it 15-25% of its write time).
        ``direct=True`` writes a raw chunk's block-aligned part with ``O_DIRECT``
        straight from ``chunk.data`` (see the module docstring): only for bytes
        that cannot change until the call returns, and only worth it for bytes
        that are not read again soon (the page cache keeps no copy).
        """
        self._check_open()
        if chunk.size > self._max_chunk:
            raise ChunkTooLargeError(
                f"chunk {chunk.id} is {chunk.size} bytes; the disk tier accepts at most "
                f"{self._max_chunk} (raise cache.chunk_bytes or split the data)"
            )
        if self._admission.stalled() is not None:
            # Declined without a worker; a chunk already stored is still stored.
            if self.index.lookup(chunk.id) is not None:
                return True
            self._bump("rejected")
            return False
        # One write per chunk id, run as a task of its own: a caller that is
        # cancelled stops waiting, while the write and its other waiters go on.
        return await self._writing.run(chunk.id, lambda: self._put(chunk, sync, compress, direct))

    async def _put(
        self, chunk: Chunk, sync: bool | None, compress: bool | None, direct: bool
    ) -> bool:
        direct = direct or self._direct_writes
        write = functools.partial(self.write_sync, direct=True) if direct else self.write_sync
        done = await self._admission.run(write, chunk, sync, compress, patience=None)
        if isinstance(done, GaveUp):
            self._bump("rejected")  # the write goes on, and its record with it
            return False
        return done

    async def contains(self, cid: ChunkId) -> bool:
        # docstring inherited
        self._check_open()
        return self.index.lookup(cid) is not None

    async def discard(self, cid: ChunkId) -> bool:
        # docstring inherited
        self._check_open()
        gone = await self._admission.run(self._drop, cid, patience=None)
        return gone is not None and not isinstance(gone, GaveUp)

    def stats(self) -> TierStats:
        # docstring inherited
        with self._stats_lock:
            snap = TierStats(**vars(self._stats))
            snap.errors = dict(self._stats.errors)
        snap.bytes = self.index.disk_bytes
        snap.chunks = self.index.disk_chunks
        snap.degraded = self.degraded
        return snap

    async def close(self) -> None:
        # docstring inherited
        if self._closed:
            return
        self._closed = True
        pending = self._writing.running()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, self._admission.shutdown)

    # -- health ---------------------------------------------------------------------

    @property
    def degraded(self) -> str | None:
        """Why the tier declines writes now, or ``None`` when it is healthy."""
        stalled = self._admission.stalled()
        if stalled is not None:
            return stalled
        if self.index.backlog_full:
            return (
                f"index commits stalled: {self.index.backlog} writes wait "
                f"(at most {self.index.max_pending})"
            )
        with self._stats_lock:
            if self._stats.degraded and time.monotonic() >= self._degraded_until:
                self._stats.degraded = None
            return self._stats.degraded

    def _degrade(self, reason: str) -> None:
        with self._stats_lock:
            if self._stats.degraded is None:
                log.warning(
                    "disk tier degraded: %s; writes pause for %ss", reason, self._retry_after
                )
            self._stats.degraded = reason
            self._degraded_until = time.monotonic() + self._retry_after

    def _count_error(self, exc: OSError | lmdb.Error) -> None:
        if isinstance(exc, lmdb.Error):
            kind = "index"
        else:
            kind = {errno.ENOSPC: "enospc", errno.EIO: "eio", errno.EDQUOT: "enospc"}.get(
                exc.errno or 0, "other"
            )
        self._count_kind(kind)
        if kind == "enospc":
            self._degrade("disk full (ENOSPC)")
        elif kind == "eio":
            self._degrade("I/O error (EIO)")

    def _count_kind(self, kind: str) -> None:
        """Count one error of ``kind`` (``errors[kind]`` in :meth:`stats`)."""
        with self._stats_lock:
            self._stats.errors[kind] = self._stats.errors.get(kind, 0) + 1

    def _bump(self, field: str, n: int = 1) -> None:
        with self._stats_lock:
            setattr(self._stats, field, getattr(self._stats, field) + n)

    # -- blocking work (run in the tier's threads) ----------------------------------

    def read_sync(self, cid: ChunkId, count: bool = True) -> bytearray | None:
        """Read and verify chunk ``cid``; ``None`` (after dropping it) if absent or damaged.

        Never raises for the tier's own trouble (I/O errors, a failing index): the
        caller gets a miss and goes on to the source. ``count``: a lookup, counted as
        a hit or a miss (see :meth:`Tier.get`).
        """
        try:
            data = self._read(cid)
        except lmdb.Error as exc:
            self._count_error(exc)
            log.warning("reading chunk %s: the index failed (%s); treated as a miss", cid, exc)
            data = None
        if count:
            self._bump("misses" if data is None else "hits")
        return data

    def _read(self, cid: ChunkId) -> bytearray | None:
        record = self.index.lookup(cid)
        if record is None:
            return None
        path = self.path_of(cid)
        try:
            faults.point("disk.read")
            raw = _read_exact(path, record.stored_size)
        except FileNotFoundError:
            if self._drop(cid, record) is not None:
                self._bump("missing")
                log.warning("chunk %s was indexed but its file is gone; dropped", cid)
            return None
        except OSError as exc:
            self._count_error(exc)
            log.warning("reading chunk %s failed (%s); dropped", cid, exc)
            self._drop(cid, record)
            return None
        if len(raw) != record.stored_size:
            log.warning(
                "chunk %s: file holds %d bytes, the index says %d; dropped",
                cid,
                len(raw),
                record.stored_size,
            )
            data = None
        else:
            data = self._decode(cid, record, raw)
        if data is None:
            self._bump("integrity_failures")
            self._drop(cid, record)
            return None
        self.index.touch(cid)
        return data

    def write_sync(
        self,
        chunk: Chunk,
        sync: bool | None = None,
        compress: bool | None = None,
        *,
        direct: bool = False,
    ) -> bool:
        """Store ``chunk`` as a file and queue its record; ``False`` if declined.

        Never raises for the tier's own trouble (a full disk, I/O errors, a failing
        index): those are counted, degrade the tier, and decline the write.
        """
        try:
            return self._write(
                chunk,
                self._fsync is FsyncPolicy.ALWAYS if sync is None else sync,
                self._compress if compress is None else compress,
                direct=direct,
            )
        except lmdb.Error as exc:
            self._count_error(exc)
            self._degrade(f"index failed ({exc})")
            self._bump("rejected")
            return False

    def _write(self, chunk: Chunk, sync: bool, compress: bool, *, direct: bool = False) -> bool:
        if self.index.lookup(chunk.id) is not None:
            self.index.touch(chunk.id)
            return True
        if self.degraded or self.index.backlog_full:
            self._bump("rejected")
            return False
        payload, codec = self._codec.encode(chunk.data) if compress else (chunk.data, Codec.RAW)
        if not self._make_room(len(payload)):
            self._bump("rejected")
            return False
        final = self.path_of(chunk.id)
        tmp = self._tmp_dir / f"{self._token}.{next(self._serial)}"
        naming = False
        try:
            if direct and codec is Codec.RAW:
                self._write_file(tmp, payload, sync, direct=True)
            else:
                self._write_file(tmp, payload, sync)
            written = os.stat(tmp)  # the very file that will hold the name (its inode)
            with self._names_lock:
                if self.index.lookup(chunk.id) is not None:
                    # Recorded since this write looked (another write of the id, or
                    # reconciliation's adoption): never rename over a recorded file,
                    # whose record names its size, its form and its durability.
                    _unlink_quietly(tmp)
                    self.index.touch(chunk.id)
                    return True
                if self._naming.get(chunk.id):
                    # Another write of the id holds the name and records it once its
                    # directory is synced: this file must not replace it meanwhile.
                    _unlink_quietly(tmp)
                    self._bump("rejected")
                    return False
                faults.point("disk.rename")
                try:
                    os.rename(tmp, final)
                except FileNotFoundError:
                    # The id's directory is made when a rename first needs it (an
                    # operator may also have removed it since): a makedirs before
                    # every rename cost 7-17% of the daemon's samples in a cold read.
                    os.makedirs(final.parent, exist_ok=True)
                    self._unsynced_dirs.add(final.parent)
                    os.rename(tmp, final)
                # Named, not yet recorded: reconciliation leaves it alone (see the
                # module docstring), so no record reaches the index before the name
                # is durable, and no other thread unlinks it but a discard.
                self._naming[chunk.id] = self._naming.get(chunk.id, 0) + 1
                naming = True
                new_dir = final.parent in self._unsynced_dirs
            if sync:
                # Outside the lock, so that concurrent writers' directory fsyncs share
                # the file system's journal commits instead of running one at a time
                # (16 inserts in flight, fsync always, 30 rounds: 4 MiB chunks 1.5-1.9x
                # the MB/s, 64 KiB 1.7-1.8x, on a 2-core VM's ext4; at 1 in flight no
                # change; bench/aiofiles_bench.py --only insert).
                if new_dir:  # its own name, and its parent's, become durable too
                    _fsync_dir(final.parent.parent)
                    _fsync_dir(self._chunks_dir)
                _fsync_dir(final.parent)
            with self._names_lock:
                self._named(chunk.id)
                naming = False
                if sync and new_dir:
                    self._unsynced_dirs.discard(final.parent)
                if not _is_file(final, written):
                    # Discarded while its name was synced, or renamed over by another
                    # write of the same id, which records its own file: never record a
                    # name this write no longer holds.
                    self._bump("rejected")
                    return False
                self.index.put_chunk(
                    chunk.id, ChunkRecord(chunk.size, len(payload), codec, TierSet.DISK)
                )
        except OSError as exc:
            _unlink_quietly(tmp)
            self._count_error(exc)
            self._bump("rejected")
            return False
        finally:
            if naming:  # an error (or the index) stopped it between the two steps
                with self._names_lock:
                    self._named(chunk.id)
        self._bump("inserts")
        return True

    def _named(self, cid: bytes) -> None:
        """One write of ``cid`` left its window between name and record (lock held)."""
        left = self._naming.pop(cid, 0) - 1
        if left > 0:
            self._naming[cid] = left

    def _write_file(
        self, path: Path, payload: memoryview | bytes, sync: bool, *, direct: bool = False
    ) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
        try:
            view = memoryview(payload).cast("B")
            done = _write_direct(fd, view) if direct else 0
            while done < view.nbytes:
                done += os.write(fd, view[done:])
            faults.point("disk.write")
            if sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def _decode(
        self,
        cid: ChunkId,
        record: ChunkRecord,
        raw: bytearray,
        *,
        quiet: bool = False,
        verify: bool | None = None,
    ) -> bytearray | None:
        """The chunk's bytes from a file's contents, or ``None`` if they are damaged."""
        problem = None
        data = raw
        try:
            data = self._codec.decode(record.codec, raw, record.size)
        except IntegrityError as exc:
            problem = str(exc)
        if problem is None and len(data) != record.size:
            problem = f"{len(data)} bytes, the index says {record.size}"
        if problem is None and (self._verify if verify is None else verify):
            actual = blake3.blake3(data, max_threads=hash_threads(len(data))).digest()
            if actual != cid:
                problem = f"file hashes to {actual.hex()}"
        if problem is None:
            return data
        if not quiet:
            log.warning("chunk %s: %s; dropped", cid, problem)
        return None

    def _drop(self, cid: ChunkId, seen: ChunkRecord | None = None) -> ChunkRecord | None:
        """Delete the record (committed), then the file. Returns the old record.

        With ``seen``, only if the record is still the one the caller acted on: a
        reader that found a damaged copy must not drop a good one written since.
        (A record that was only touched meanwhile is left too; the next reader
        that finds the copy bad drops it.)
        """
        with self._names_lock:
            if seen is not None and self.index.lookup(cid) != seen:
                return None
            gone = self.index.delete_chunks([cid])
            _unlink_quietly(self.path_of(cid))
        return gone[0] if gone else None

    def _free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def _make_room(self, need: int) -> bool:
        """Evict least recently used chunks until ``need`` more bytes fit."""
        if need > self._budget:
            return False
        with self._names_lock:
            over_budget = self.index.disk_bytes + need - self._budget
            short_of_floor = self._min_free + need - self._free_bytes() if self._min_free else 0
            if over_budget <= 0 and short_of_floor <= 0:
                return True
            # Evict down to a low-water mark so the next writes do not each evict.
            slack = self._budget // 10
            to_free = max(over_budget, short_of_floor) + slack
            while to_free > 0:
                victims = self.index.oldest(_EVICT_BATCH)
                take = []
                with self._pins_lock:
                    for cid, record in victims:
                        if cid in self._pins:
                            continue
                        take.append(cid)
                        to_free -= record.stored_size
                        if to_free <= 0:
                            break
                if not take:  # nothing, or only pinned chunks, among the oldest
                    break
                self.index.delete_chunks(take)
                for cid in take:
                    _unlink_quietly(self.path_of(cid), "disk.evict")
                self._bump("evictions", len(take))
            fits_budget = self.index.disk_bytes + need <= self._budget
            fits_floor = not self._min_free or self._free_bytes() - need >= self._min_free
            if not fits_floor:
                self._degrade("free space below cache.disk_min_free")
            return fits_budget and fits_floor

    # -- background reconciliation --------------------------------------------------

    def reconcile(
        self, *, batch: int = 1024, stop: threading.Event | None = None
    ) -> dict[str, int]:
        """Bring files and index into agreement; safe to run while the tier serves.

        Removes other processes' temporary files, drops records whose file is gone
        or has the wrong size, and adopts files the index does not know when they
        verify (deletes them when they do not). Returns what it did.
        """
        done = {"tmp_removed": 0, "stale_dropped": 0, "orphans_adopted": 0, "orphans_removed": 0}
        halted = stop.is_set if stop is not None else (lambda: False)
        for entry in os.scandir(self._tmp_dir):
            if not entry.name.startswith(self._token + "."):
                _unlink_quietly(Path(entry.path))
                done["tmp_removed"] += 1
        after: bytes | None = None
        while not halted() and not self._closed:
            records = self.index.scan_chunks(after, batch)
            if not records:
                break
            for cid, record in records:
                after = cid
                try:
                    size = os.stat(self.path_of(cid)).st_size
                except FileNotFoundError:
                    size = -1
                if size != record.stored_size and self._drop(cid, record) is not None:
                    done["stale_dropped"] += 1
        for top in _subdirs(self._chunks_dir):
            for mid in _subdirs(top):
                if halted() or self._closed:
                    return done
                for entry in os.scandir(mid):
                    self._reconcile_file(Path(entry.path), entry.name, done)
        self.index.flush()
        return done

    def _reconcile_file(self, path: Path, name: str, done: dict[str, int]) -> None:
        try:
            cid = ChunkId.parse(name) if len(name) == HEX_CHARS else None
        except InvalidChunkIdError:
            cid = None
        if cid is None or path != self.path_of(cid):
            with self._names_lock:
                _unlink_quietly(path)
            done["orphans_removed"] += 1
            return
        # (a chunk a live write is naming is that write's; checked again under the lock)
        if self.index.lookup(cid) is not None or cid in self._naming:
            return
        try:
            found = self._verify_orphan(cid, path)
        except OSError:
            return
        if found is not None:
            record, before = found
            if self._fsync is FsyncPolicy.ALWAYS:
                # A file a killed process left may be neither on the device nor named
                # there yet (its write's fsyncs may not have run): make both durable
                # before a record that claims it can be committed.
                try:
                    _fsync_file(path)
                    _fsync_dir(path.parent)
                    _fsync_dir(path.parent.parent)
                    _fsync_dir(self._chunks_dir)
                except OSError:
                    return
            with self._names_lock:
                # Adopt only the very file that was verified, and only if nothing
                # indexed or evicted it meanwhile (an unlink happens under this lock).
                try:
                    same = _same_file(before, path.stat())
                except FileNotFoundError:
                    same = False
                # A file a live write is still naming is that write's to record.
                adopt = same and self.index.lookup(cid) is None and cid not in self._naming
                if adopt:
                    self.index.put_chunk(cid, record)
            if adopt:
                done["orphans_adopted"] += 1
                self._make_room(0)  # adopting may have taken the tier over its budget
            return
        with self._names_lock:
            # What failed to verify may have been an older file that a live write has
            # renamed over since: that write's file is good and its record is coming.
            if self.index.lookup(cid) is None and cid not in self._naming:
                _unlink_quietly(path)
                done["orphans_removed"] += 1

    def _verify_orphan(self, cid: ChunkId, path: Path) -> tuple[ChunkRecord, os.stat_result] | None:
        """The record under which an unindexed file verifies, or ``None`` if it does not."""
        before = path.stat()
        if before.st_size > self._max_chunk + 1024:  # no chunk, raw or zstd, is this big
            return None
        raw = bytearray(path.read_bytes())
        for record in _candidate_records(raw, self._max_chunk):
            # An orphan is always verified: nothing vouches for it.
            if self._decode(cid, record, raw, quiet=True, verify=True) is not None:
                return record, before
        return None

    # -- plumbing -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError(f"the disk tier at {self.root} is closed; open a new cache")


def _candidate_records(raw: bytearray, max_chunk: int) -> list[ChunkRecord]:
    """How an unindexed file may have been stored: zstd (if it looks like it), raw."""
    return [
        ChunkRecord(size, len(raw), codec, TierSet.DISK)
        for codec, size in stored_forms(raw, max_chunk)
    ]


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_ino, a.st_dev, a.st_size, a.st_mtime_ns) == (
        b.st_ino,
        b.st_dev,
        b.st_size,
        b.st_mtime_ns,
    )


def _is_file(path: Path, written: os.stat_result) -> bool:
    """Whether ``path`` names the very file ``written`` describes (its device and inode)."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (written.st_dev, written.st_ino)


def _read_exact(path: Path, size: int) -> bytearray:
    """Read a file expected to hold ``size`` bytes; one byte more is read to spot growth."""
    buf = bytearray(size + 1)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        got = 0
        while got < len(buf):
            n = os.readv(fd, [view[got:]])
            if n == 0:
                break
            got += n
    finally:
        os.close(fd)
    del view
    del buf[got:]
    return buf


def _write_direct(fd: int, view: memoryview) -> int:
    """Write what :data:`_DIRECT_ALIGN`-aligned part of ``view`` the file system takes
    with ``O_DIRECT``; returns the bytes written. The file is buffered again after.

    A file system without direct I/O refuses the flag (``fcntl``), a buffer at an odd
    address makes the write fail with ``EINVAL`` before a byte is written: either way
    the caller writes the rest buffered. Measured on the development VM (ext4 on
    virtio, 1.25 GiB in 4 MiB files from a sealed memfd, then syncfs): 0.85 s direct
    against 2.84 s buffered, which also allocates and fills as many page-cache pages.
    """
    aligned = view.nbytes - view.nbytes % _DIRECT_ALIGN
    if not aligned:
        return 0
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError:
        return 0  # no direct I/O here (tmpfs, some FUSE file systems)
    done = 0
    try:
        while done < aligned:
            written = os.write(fd, view[done:aligned])
            done += written
            if written % _DIRECT_ALIGN:
                break  # a short, unaligned write: the rest cannot go direct
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return done


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: Path, fault: str | None = None) -> None:
    try:
        if fault is not None:
            faults.point(fault)
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)


def _subdirs(path: Path) -> list[Path]:
    try:
        return sorted(Path(e.path) for e in os.scandir(path) if e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []
