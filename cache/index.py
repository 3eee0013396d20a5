"""The cache index, in lmdb.

Five named databases live in one lmdb environment (``<dir>/index``):

``meta``
    ``schema`` (u32) and the persistent tier totals (``disk_bytes``,
    ``disk_chunks``), updated in the same transaction as the records they sum,
    so opening needs no scan.
``chunks``
    chunk id (32 raw bytes) -> :class:`ChunkRecord` (size, stored size, codec,
    persistent tiers, last use).
``lru``
    big-endian last use (u64 milliseconds) + chunk id -> empty: the disk tier's
    eviction order, oldest first, without a scan.
``maps`` and ``objects``
    an object version's chunk map: ``objkey + be32(chunk index)`` -> chunk id +
    le32(length), where ``objkey`` is a 16-byte blake3 of (chunk size, backend,
    key, version token); and ``objkey`` -> the object's size and names.
``names`` (schema 2)
    ``namekey`` -> the version of an object name last validated against its
    backend and when (:class:`ValidatedVersion`, JSON), where ``namekey`` is a
    16-byte blake3 of (backend, key). A name points at one version at a time, so
    it has a database of its own rather than a place in ``objects``, whose entries
    describe versions (one per version, next to their chunk maps). A restarted
    daemon reads it to serve what it cached before it can ask the backend again.

Writes are batched off the hot path: :meth:`Index.put_chunk`, :meth:`Index.touch`,
:meth:`Index.record` and the writes of ``names`` land in an in-memory overlay that
readers consult first (read-your-writes), and a background thread
(:class:`~chunkd.cache.committer.BatchCommitter`) commits the overlay every
``flush_interval`` seconds or ``flush_ops`` operations. Deletes of
chunk records commit at once, because a deleted record must be durable before its
file is unlinked (the index never claims a chunk that is not on disk: file first,
then index).

A stalled index disk: reads are lmdb page reads through its memory map (on the
loop, for single lookups), so they keep going from pages the kernel has cached and
a read of a page it must fetch waits for the disk (the index is small and hot, so
this is rare; chunkd does not guard the loop against it). Commits run on the
flusher thread (and in :meth:`Index.delete_chunks`, on the disk tier's threads); a
stalled commit stalls that thread, never the loop, and the overlay keeps serving
every write queued since. The overlay is bounded: once ``max_pending`` writes wait
(:attr:`Index.backlog_full`), writes that are re-learnt are dropped and counted in
:attr:`Index.dropped` (chunk-map entries, object sizes, uses of a chunk), and a
newly validated version of a name is queued as a forget instead (the next read asks
the backend, never a stale version), while the writes whose absence would lose data
are always queued: chunk records (the disk tier stops writing chunks while the
overlay is full, so these stay few) and deletes (committed at once). When commits
succeed again the overlay drains and the bound lifts.

One job, the records and their queries, over 600 lines because five record kinds
each need their write (into the overlay), their reads (overlay, then lmdb) and their
bound; when and on which thread the overlay is committed is
:mod:`chunkd.cache.committer`'s.

Every method is thread-safe and blocking; an asyncio caller runs them in a thread
(single lookups are cheap enough to call on the loop).

Schema changes go through :data:`MIGRATIONS`: ``MIGRATIONS[n]`` upgrades schema
``n`` to ``n + 1`` inside one write transaction. History:

1. chunks, LRU order, chunk maps, object sizes.
2. adds ``names``; nothing else changes, so the upgrade keeps every record.
"""

from __future__ import annotations

import functools
import json
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from pathlib import Path
from typing import Any, Final, NamedTuple

import blake3
import lmdb

from chunkd import faults
from chunkd.cache.chunkid import DIGEST_BYTES, ChunkId
from chunkd.cache.committer import BatchCommitter
from chunkd.errors import CacheClosedError, IndexSchemaError

__all__ = [
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "ChunkRecord",
    "ChunkRef",
    "Codec",
    "Index",
    "Locator",
    "ObjectInfo",
    "ObjectVersion",
    "TierSet",
    "ValidatedVersion",
]

log = logging.getLogger("chunkd.cache.index")

#: the schema this version of chunkd writes
SCHEMA_VERSION: Final = 2

Migration = Callable[[Any, Any], None]  # gets the lmdb environment and a write transaction


def _add_names(env: Any, txn: Any) -> None:
    """Schema 1 to 2: create the ``names`` database, in the transaction that bumps
    the schema (an index is never marked 2 without it)."""
    env.open_db(b"names", txn=txn, create=True)


#: ``MIGRATIONS[n]`` upgrades schema ``n`` to ``n + 1``
MIGRATIONS: Final[Mapping[int, Migration]] = {1: _add_names}

# The on-disk layout of the index's records and keys: part of the schema, never tuned.
_RECORD: Final = struct.Struct("<QQBBxxxxxxQ")
_BE64: Final = struct.Struct(">Q")
_BE32: Final = struct.Struct(">I")
_LE32: Final = struct.Struct("<I")
_U64: Final = struct.Struct("<Q")
# Object names are keyed by a 128-bit blake3 of the name: no collision in any cache,
# and part of the schema.
_OBJKEY_BYTES: Final = 16


class Codec(IntEnum):
    """How a chunk's bytes are stored on disk."""

    RAW = 0
    ZSTD = 1


class TierSet(IntFlag):
    """The persistent tiers that hold a chunk (the RAM tier is never recorded)."""

    NONE = 0
    DISK = 1
    REMOTE = 2


class ChunkRecord(NamedTuple):
    """What the index knows about one chunk (``last_use`` in unix milliseconds).

    A named tuple rather than a dataclass: every lookup builds one, and this is the
    cheapest immutable record Python has. ``codec`` and ``tiers`` hold the integer
    values of :class:`Codec` and :class:`TierSet` (compare with ``==``, not ``is``).
    """

    size: int
    stored_size: int
    codec: int = Codec.RAW
    tiers: int = TierSet.DISK
    last_use: int = 0

    def pack(self) -> bytes:
        """The record's 32-byte on-disk form."""
        return _RECORD.pack(*self)

    @classmethod
    def unpack(cls, raw: bytes) -> ChunkRecord:
        """Parse the on-disk form."""
        return _make_record(_RECORD.unpack(raw))


# tuple.__new__ straight from struct's tuple: ChunkRecord._make without its
# Python-level length check (the struct always yields exactly five fields).
_make_record: Final[Callable[[tuple[Any, ...]], ChunkRecord]] = functools.partial(
    tuple.__new__, ChunkRecord
)


@dataclass(frozen=True, slots=True)
class ObjectVersion:
    """One version of an object: the unit a chunk map describes."""

    backend: str
    key: str
    version: str

    def locator(self, index: int) -> Locator:
        """The locator of this version's chunk ``index``."""
        return Locator(self.backend, self.key, self.version, index)


@dataclass(frozen=True, slots=True)
class Locator:
    """Where a chunk comes from before its id is known."""

    backend: str
    key: str
    version: str
    index: int

    @property
    def object(self) -> ObjectVersion:
        """The object version this locator points into."""
        return ObjectVersion(self.backend, self.key, self.version)


class ChunkRef(NamedTuple):
    """A chunk map entry: the chunk's id and its length."""

    id: ChunkId
    length: int


@dataclass(frozen=True, slots=True)
class ValidatedVersion:
    """The version an object name had when its backend last confirmed it.

    ``checked`` is when (unix seconds): what a revalidation policy and
    ``stale_if_error`` are measured from, across restarts too.
    """

    backend: str
    key: str
    version: str
    #: the ETag to send as If-Match, when the store has one
    etag: str | None
    size: int
    #: when the object was last written (unix seconds; 0 when unknown)
    modified: float
    checked: float

    def pack(self) -> bytes:
        """The record's stored form (JSON)."""
        fields = {
            "backend": self.backend,
            "key": self.key,
            "version": self.version,
            "etag": self.etag,
            "size": self.size,
            "modified": self.modified,
            "checked": self.checked,
        }
        return json.dumps(fields, ensure_ascii=False).encode("utf-8", "surrogatepass")

    @classmethod
    def unpack(cls, raw: bytes) -> ValidatedVersion:
        """Parse the stored form."""
        doc = json.loads(raw.decode("utf-8", "surrogatepass"))
        return cls(
            doc["backend"],
            doc["key"],
            doc["version"],
            doc["etag"],
            int(doc["size"]),
            float(doc["modified"]),
            float(doc["checked"]),
        )


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """An object version's size, as recorded with its chunk map."""

    backend: str
    key: str
    version: str
    size: int
    chunk_bytes: int

    @property
    def chunks(self) -> int:
        """How many chunks the version splits into."""
        return -(-self.size // self.chunk_bytes)


_MISSING: Final[Any] = object()


class Index:
    """The lmdb index of one cache directory. See the module docstring.

    Args:
        path: the lmdb directory (created if missing).
        chunk_bytes: the chunk size chunk maps are built with; part of each map's key,
            so maps built with another size are simply not found.
        map_size: the lmdb map size (virtual address space, not disk).
        sync: fsync each commit.
        flush_interval: most seconds a batched write waits before it is committed.
        flush_ops: batched operations that trigger an early commit.
        touch_interval: a chunk's last use is rewritten at most this often (seconds).
        max_pending: batched writes queued before those that are re-learnt are
            dropped (commits stalled or failing; see the module docstring).
        schema_version, migrations: for tests of the migration hook.
        clock: the time source for last use (seconds).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        chunk_bytes: int = 4 << 20,
        map_size: int = 1 << 40,
        sync: bool = True,
        flush_interval: float = 0.05,
        flush_ops: int = 4096,
        touch_interval: float = 60,
        max_pending: int = 100_000,
        schema_version: int = SCHEMA_VERSION,
        migrations: Mapping[int, Migration] = MIGRATIONS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.chunk_bytes = chunk_bytes
        self._touch_interval_ms = int(touch_interval * 1000)
        self.max_pending = max_pending
        #: writes dropped because commits fell ``max_pending`` behind
        self.dropped = 0
        self._clock = clock
        self._env = lmdb.open(
            str(self.path),
            map_size=map_size,
            max_dbs=8,
            sync=sync,
            readahead=False,
            max_readers=512,
        )
        self._meta = self._env.open_db(b"meta")
        self._chunks = self._env.open_db(b"chunks")
        self._lru = self._env.open_db(b"lru")
        self._maps = self._env.open_db(b"maps")
        self._objects = self._env.open_db(b"objects")
        self.schema_version = self._check_schema(schema_version, migrations)
        # After the schema check: an old index gains it in its migration's transaction.
        self._names = self._env.open_db(b"names")
        with self._env.begin(db=self._meta) as txn:
            self._disk_bytes = _read_u64(txn.get(b"disk_bytes"))
            self._disk_chunks = _read_u64(txn.get(b"disk_chunks"))

        # Overlay of batched writes. A value of None in _pend_chunks is a delete.
        self._lock = threading.Lock()
        self._pend_chunks: dict[bytes, ChunkRecord | None] = {}
        self._pend_lru_add: set[bytes] = set()
        self._pend_lru_del: set[bytes] = set()
        self._pend_maps: dict[bytes, bytes] = {}
        self._pend_objects: dict[bytes, bytes] = {}
        self._pend_names: dict[bytes, bytes | None] = {}  # None: a delete
        self._flushing: list[list[Any]] = []  # chunk/map/object/name overlays in flight
        self._closed = False
        self._committer: BatchCommitter[list[Any]] = BatchCommitter(
            self._lock,
            take=self._take_batch,
            write=self._write_batch,
            settle=self._settle,
            interval=flush_interval,
            ops=flush_ops,
            retry_on=(lmdb.Error,),
            name="chunkd-index",
        )

    # -- schema ---------------------------------------------------------------------

    def _check_schema(self, current: int, migrations: Mapping[int, Migration]) -> int:
        with self._env.begin(write=True) as txn:
            raw = txn.get(b"schema", db=self._meta)
            if raw is None:
                txn.put(b"schema", _LE32.pack(current), db=self._meta)
                return current
            found: int = _LE32.unpack(raw)[0]
            if found > current:
                raise IndexSchemaError(
                    f"the index at {self.path} has schema {found}, newer than this chunkd "
                    f"understands ({current}); upgrade chunkd or point cache.dir elsewhere"
                )
            while found < current:
                step = migrations.get(found)
                if step is None:
                    raise IndexSchemaError(
                        f"the index at {self.path} has schema {found} and no migration to "
                        f"{found + 1} exists; delete the cache directory to start cold"
                    )
                step(self._env, txn)
                found += 1
                txn.put(b"schema", _LE32.pack(found), db=self._meta)
            return found

    # -- chunks ---------------------------------------------------------------------

    def lookup(self, cid: bytes) -> ChunkRecord | None:
        """The record of chunk ``cid``, or ``None``."""
        hit = self._pend_chunks.get(cid, _MISSING)
        if hit is _MISSING and self._flushing:
            hit = self._in_flight(cid, 0)
            if hit is _MISSING:  # a failed commit may have put its batch back meanwhile
                hit = self._pend_chunks.get(cid, _MISSING)
        if hit is not _MISSING:
            return hit  # type: ignore[no-any-return]
        if self._closed:
            self._check_open()
        # A read transaction used for one get and dropped at once is aborted by its
        # deallocation: cheaper than a with-block, and just as short-lived.
        got = self._env.begin(db=self._chunks).get(cid)
        return None if got is None else _make_record(_RECORD.unpack(got))

    def lookup_many(self, cids: Iterable[bytes]) -> list[ChunkRecord | None]:
        """Records for several ids, in one read transaction."""
        self._check_open()
        layers = self._overlays(0)  # before the transaction begins: see _overlays
        out: list[ChunkRecord | None] = []
        append = out.append
        unpack = _RECORD.unpack
        with self._env.begin(db=self._chunks) as txn:
            get = txn.get
            for cid in cids:
                for layer in layers:
                    hit = layer.get(cid, _MISSING)
                    if hit is not _MISSING:
                        append(hit)
                        break
                else:
                    got = get(cid)
                    append(None if got is None else _make_record(unpack(got)))
        return out

    def put_chunk(self, cid: ChunkId, record: ChunkRecord) -> None:
        """Record (or replace) chunk ``cid``. Batched."""
        if record.last_use == 0:
            record = record._replace(last_use=self._now_ms())
        with self._lock:
            self._check_open()
            old = self._lookup_locked(cid)
            if old is not None:
                self._pend_lru_add.discard(_lru_key(old.last_use, cid))
                self._pend_lru_del.add(_lru_key(old.last_use, cid))
                self._count(old, -1)
            self._pend_lru_add.add(_lru_key(record.last_use, cid))
            self._pend_chunks[cid] = record
            self._count(record, +1)
            self._committer.enqueued()

    def touch(self, cid: ChunkId) -> None:
        """Note a use of ``cid`` (coarse: rewritten at most every ``touch_interval``)."""
        now = self._now_ms()
        with self._lock:
            self._check_open()
            old = self._lookup_locked(cid)
            if old is None or now - old.last_use < self._touch_interval_ms:
                return
            if self._full_locked():
                self.dropped += 1  # LRU order only: the chunk ages a little early
                return
            self._pend_lru_add.discard(_lru_key(old.last_use, cid))
            self._pend_lru_del.add(_lru_key(old.last_use, cid))
            self._pend_lru_add.add(_lru_key(now, cid))
            self._pend_chunks[cid] = old._replace(last_use=now)
            self._committer.enqueued()

    def delete_chunks(self, cids: Iterable[bytes]) -> list[ChunkRecord]:
        """Delete the records of ``cids`` and commit at once; return those that existed."""
        gone: list[ChunkRecord] = []

        def prepare() -> list[Any]:
            # with the overlay lock held, inside the commit's write lock
            self._check_open()
            for cid in cids:
                old = self._lookup_locked(cid)
                if old is None:
                    continue
                gone.append(old)
                self._pend_lru_del.add(_lru_key(old.last_use, cid))
                self._pend_lru_add.discard(_lru_key(old.last_use, cid))
                self._pend_chunks[cid] = None
                self._count(old, -1)
            return self._take_batch()

        self._committer.commit_with(prepare)
        return gone

    def oldest(self, limit: int) -> list[tuple[ChunkId, ChunkRecord]]:
        """Up to ``limit`` chunks in least-recently-used order (commits pending writes)."""
        self.flush()
        out: list[tuple[ChunkId, ChunkRecord]] = []
        with self._env.begin(buffers=False) as txn:
            cursor = txn.cursor(db=self._lru)
            for key, _ in cursor:
                cid = ChunkId(key[8:])
                raw = txn.get(cid, db=self._chunks)
                if raw is None:
                    continue
                record = ChunkRecord.unpack(raw)
                if _lru_key(record.last_use, cid) != key:
                    continue  # a stale position; the record sits at its newer one
                out.append((cid, record))
                if len(out) >= limit:
                    break
        return out

    def scan_chunks(self, after: bytes | None, limit: int) -> list[tuple[ChunkId, ChunkRecord]]:
        """Committed records in id order, starting after ``after``; for background sweeps."""
        self._check_open()
        out: list[tuple[ChunkId, ChunkRecord]] = []
        with self._env.begin(db=self._chunks, buffers=False) as txn:
            cursor = txn.cursor()
            found = cursor.set_range(after) if after is not None else cursor.first()
            while found and len(out) < limit:
                key, value = cursor.item()
                if key != after:
                    out.append((ChunkId(key), ChunkRecord.unpack(value)))
                found = cursor.next()
        return out

    @property
    def disk_bytes(self) -> int:
        """Total stored bytes of chunks recorded on the disk tier."""
        return self._disk_bytes

    @property
    def disk_chunks(self) -> int:
        """Number of chunks recorded on the disk tier."""
        return self._disk_chunks

    # -- chunk maps -----------------------------------------------------------------

    def objkey(self, version: ObjectVersion) -> bytes:
        """The 16-byte key of ``version``'s chunk map (includes the chunk size)."""
        text = f"{self.chunk_bytes}\0{version.backend}\0{version.key}\0{version.version}"
        return blake3.blake3(text.encode("utf-8", "surrogatepass")).digest(_OBJKEY_BYTES)

    def record(self, locator: Locator, cid: ChunkId, length: int) -> None:
        """Record that ``locator`` holds chunk ``cid`` of ``length`` bytes. Batched."""
        key = self.objkey(locator.object) + _BE32.pack(locator.index)
        with self._lock:
            self._check_open()
            if self._full_locked() and key not in self._pend_maps:
                self.dropped += 1  # the next read of the locator learns it again
                return
            self._pend_maps[key] = bytes(cid) + _LE32.pack(length)
            self._committer.enqueued()

    def resolve(self, locator: Locator) -> ChunkRef | None:
        """The chunk at ``locator``, if it was recorded."""
        return self.resolve_many(locator.object, [locator.index])[0]

    def resolve_many(self, version: ObjectVersion, indexes: Iterable[int]) -> list[ChunkRef | None]:
        """Chunk map entries of ``version`` at ``indexes``, in one read transaction."""
        self._check_open()
        objkey = self.objkey(version)
        layers = self._overlays(1)
        out: list[ChunkRef | None] = []
        with self._env.begin(db=self._maps, buffers=False) as txn:
            for index in indexes:
                key = objkey + _BE32.pack(index)
                for layer in layers:
                    raw = layer.get(key, _MISSING)
                    if raw is not _MISSING:
                        break
                else:
                    raw = txn.get(key)
                out.append(None if raw is None else _ref(raw))
        return out

    def put_object(self, info: ObjectInfo) -> None:
        """Record an object version's size next to its chunk map. Batched."""
        version = ObjectVersion(info.backend, info.key, info.version)
        body = json.dumps(
            {"backend": info.backend, "key": info.key, "version": info.version, "size": info.size}
        ).encode()
        key = self.objkey(version)
        with self._lock:
            self._check_open()
            if self._full_locked() and key not in self._pend_objects:
                self.dropped += 1  # the next stat of the object learns it again
                return
            self._pend_objects[key] = body
            self._committer.enqueued()

    def get_object(self, version: ObjectVersion) -> ObjectInfo | None:
        """The recorded size of ``version``, if any."""
        self._check_open()
        key = self.objkey(version)
        raw = self._overlay_get(key, 2)
        if raw is _MISSING:
            with self._env.begin(db=self._objects, buffers=False) as txn:
                raw = txn.get(key)
        if raw is None:
            return None
        doc = json.loads(raw)
        return ObjectInfo(doc["backend"], doc["key"], doc["version"], doc["size"], self.chunk_bytes)

    # -- validated versions of names ----------------------------------------------------

    def put_validated(self, record: ValidatedVersion) -> None:
        """Record (or replace) the version ``record.backend/record.key`` was last
        validated at. Batched."""
        key = _namekey(record.backend, record.key)
        with self._lock:
            self._check_open()
            if self._full_locked() and key not in self._pend_names:
                # Dropped, an older validation would show through: forget instead,
                # so the next read asks the backend.
                self.dropped += 1
                self._pend_names[key] = None
            else:
                self._pend_names[key] = record.pack()
            self._committer.enqueued()

    def get_validated(self, backend: str, key: str) -> ValidatedVersion | None:
        """The version ``backend/key`` was last validated at, if one was recorded."""
        self._check_open()
        name = _namekey(backend, key)
        raw = self._overlay_get(name, 3)
        if raw is _MISSING:
            with self._env.begin(db=self._names, buffers=False) as txn:
                raw = txn.get(name)
        if raw is None:
            return None
        record = ValidatedVersion.unpack(raw)
        # The key is a 16-byte hash: a record of another name is not this one's.
        return record if (record.backend, record.key) == (backend, key) else None

    def forget_validated(self, backend: str, key: str) -> None:
        """Drop the validated version of ``backend/key`` (it changed, or is gone). Batched."""
        with self._lock:
            self._check_open()
            self._pend_names[_namekey(backend, key)] = None
            self._committer.enqueued()

    # -- lifecycle ------------------------------------------------------------------

    def flush(self) -> None:
        """Commit every batched write now."""
        self._committer.flush()

    def close(self) -> None:
        """Commit pending writes and close lmdb. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._committer.wake()
        try:
            self.flush()
        except lmdb.Error:
            # Shutdown goes on: the chunk files are on disk, and the next
            # reconciliation adopts those whose records were lost here.
            log.exception("index %s: the last commit failed; batched writes were lost", self.path)
        with self._lock:
            self._closed = True
            self._committer.stop()
        self._committer.join(timeout=5)
        with self._committer.write_lock:
            self._env.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def commits(self) -> int:
        """Batches committed."""
        return self._committer.commits

    @property
    def commit_errors(self) -> int:
        """Commits that failed (their writes were queued again)."""
        return self._committer.commit_errors

    @property
    def backlog(self) -> int:
        """Batched writes waiting for a commit (the batch being committed aside)."""
        return (
            len(self._pend_chunks)
            + len(self._pend_maps)
            + len(self._pend_objects)
            + len(self._pend_names)
        )

    @property
    def backlog_full(self) -> bool:
        """Whether ``max_pending`` writes wait: commits are stalled or failing, and
        writes that are re-learnt are being dropped."""
        return self.backlog >= self.max_pending

    @property
    def commit_running_for(self) -> float:
        """Seconds the commit in progress has run (0 when none is): a stalled index
        disk shows here first."""
        return self._committer.running_for

    def stat(self) -> dict[str, int]:
        """lmdb's own counters (entries per database, map use)."""
        self._check_open()
        info = self._env.info()
        out = {"map_size": int(info["map_size"]), "last_pgno": int(info["last_pgno"])}
        with self._env.begin() as txn:
            for name, db in (
                ("chunks", self._chunks),
                ("maps", self._maps),
                ("names", self._names),
            ):
                out[f"{name}_entries"] = int(txn.stat(db)["entries"])
        return out

    # -- internals ------------------------------------------------------------------

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError(f"the index at {self.path} is closed; open the cache again")

    def _overlay_get(self, key: bytes, which: int) -> Any:
        """Look ``key`` up in the pending and in-flight overlays (0 chunks, 1 maps,
        2 objects, 3 names).

        Lock-free: a batch is appended to ``_flushing`` before the pending dicts are
        swapped out, and leaves it only after its commit, or after a failed commit
        has put it back into the pending dict; so a reader that misses the pending
        dict finds the batch in flight, back in the pending dict, or in lmdb.
        """
        hit = self._pending(which).get(key, _MISSING)
        if hit is _MISSING and self._flushing:
            hit = self._in_flight(key, which)
            if hit is _MISSING:  # a failed commit puts its batch back before leaving
                hit = self._pending(which).get(key, _MISSING)
        return hit

    def _pending(self, which: int) -> dict[bytes, Any]:
        return (self._pend_chunks, self._pend_maps, self._pend_objects, self._pend_names)[which]

    def _in_flight(self, key: bytes, which: int) -> Any:
        for batch in reversed(tuple(self._flushing)):
            hit = batch[which].get(key, _MISSING)
            if hit is not _MISSING:
                return hit
        return _MISSING

    def _overlays(self, which: int) -> list[dict[bytes, Any]]:
        """The non-empty overlay layers for a multi-key read, newest first.

        Call it before beginning the read transaction: a batch that commits after
        this snapshot is still in the snapshot, and one that committed before it is
        in the transaction's view.
        """
        # The pending dict goes in even when empty: a failed commit may refill it.
        layers = [self._pending(which)]
        if self._flushing:
            layers += [b[which] for b in reversed(tuple(self._flushing)) if b[which]]
        return layers

    def _lookup_locked(self, cid: bytes) -> ChunkRecord | None:
        if cid in self._pend_chunks:
            return self._pend_chunks[cid]
        for batch in reversed(self._flushing):
            if cid in batch[0]:
                return batch[0][cid]  # type: ignore[no-any-return]
        with self._env.begin(db=self._chunks, buffers=False) as txn:
            got = txn.get(cid)
        return None if got is None else ChunkRecord.unpack(got)

    def _count(self, record: ChunkRecord, sign: int) -> None:
        if record.tiers & TierSet.DISK:
            self._disk_bytes += sign * record.stored_size
            self._disk_chunks += sign

    def _full_locked(self) -> bool:
        # called with _lock held
        return self.backlog >= self.max_pending

    def _take_batch(self) -> list[Any]:
        # called with _lock held
        batch: list[Any] = [
            self._pend_chunks,
            self._pend_maps,
            self._pend_objects,
            self._pend_names,
            self._pend_lru_add,
            self._pend_lru_del,
            (self._disk_bytes, self._disk_chunks),
        ]
        self._flushing.append(batch)  # first: lock-free readers rely on this order
        self._pend_chunks, self._pend_maps, self._pend_objects = {}, {}, {}
        self._pend_names = {}
        self._pend_lru_add, self._pend_lru_del = set(), set()
        return batch

    def _write_batch(self, batch: list[Any]) -> bool:
        """Commit ``batch`` in one lmdb write transaction; whether it held anything."""
        chunks, maps, objects, names, lru_add, lru_del, totals = batch
        if not (chunks or maps or objects or names or lru_add or lru_del):
            return False
        faults.point("index.commit", _lmdb_error)
        with self._env.begin(write=True) as txn:
            for key in lru_del - lru_add:
                txn.delete(key, db=self._lru)
            for key in lru_add:
                txn.put(key, b"", db=self._lru)
            for cid, record in chunks.items():
                if record is None:
                    txn.delete(cid, db=self._chunks)
                else:
                    txn.put(cid, record.pack(), db=self._chunks)
            for key, value in maps.items():
                txn.put(key, value, db=self._maps)
            for key, value in objects.items():
                txn.put(key, value, db=self._objects)
            for key, named in names.items():
                if named is None:
                    txn.delete(key, db=self._names)
                else:
                    txn.put(key, named, db=self._names)
            txn.put(b"disk_bytes", _U64.pack(totals[0]), db=self._meta)
            txn.put(b"disk_chunks", _U64.pack(totals[1]), db=self._meta)
        return True

    def _settle(self, batch: list[Any], committed: bool) -> int:
        # called with _lock held, after a commit; returns the writes queued again
        requeued = 0 if committed else self._requeue(batch)  # before leaving _flushing
        self._flushing.remove(batch)
        return requeued

    def _requeue(self, batch: list[Any]) -> int:
        # A commit failed (disk full, I/O error): nothing is lost, the batch goes back
        # under the writes queued since, which are newer and win.
        chunks, maps, objects, names, lru_add, lru_del, _ = batch
        for older, newer in (
            (chunks, self._pend_chunks),
            (maps, self._pend_maps),
            (objects, self._pend_objects),
            (names, self._pend_names),
        ):
            for key, value in older.items():
                newer.setdefault(key, value)
        self._pend_lru_add |= lru_add - self._pend_lru_del
        self._pend_lru_del |= lru_del - self._pend_lru_add
        return len(chunks) + len(maps) + len(objects) + len(names)


def _lmdb_error(code: int, message: str) -> lmdb.Error:
    """What a failed commit raises (for :func:`chunkd.faults.point`)."""
    return lmdb.Error(f"[Errno {code}] {message}")


def _namekey(backend: str, key: str) -> bytes:
    text = f"{backend}\0{key}".encode("utf-8", "surrogatepass")
    return blake3.blake3(text).digest(_OBJKEY_BYTES)


def _lru_key(last_use: int, cid: bytes) -> bytes:
    return _BE64.pack(last_use) + bytes(cid)


def _ref(raw: bytes) -> ChunkRef:
    return ChunkRef(ChunkId(raw[:DIGEST_BYTES]), _LE32.unpack_from(raw, DIGEST_BYTES)[0])


def _read_u64(raw: bytes | None) -> int:
    return 0 if raw is None else int(_U64.unpack(raw)[0])
