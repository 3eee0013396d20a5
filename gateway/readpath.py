"""The read path: object ranges through the tiered cache, the backend asked once.

For each chunk index of a range (chunks sit at ``index * chunk_bytes``)::

    locator (backend, key, version, index)
      -> chunk id through the index's chunk map     (lmdb)
      -> RAM, then disk                              (ChunkCache.find)
      -> single flight per locator: one ranged GET with If-Match on the version,
         hashed, verified against the chunk map when the id was known, stored,
         and recorded in the chunk map

An object's version comes from the backend, kept per its revalidation policy:
``immutable`` keeps it for good, a duration re-checks after that long. A read asks it
with its own first GET where it can (the GET's answer names the version, and its
bytes settle the first chunks: one round trip where a HEAD and a GET make two), a
re-check with the same GET made conditional (``If-None-Match``: no bytes when the
version is current); with peers, whose placement depends on the version, and for
``stat`` alone, a HEAD. What a HEAD
validated is kept in memory (the ``known_objects`` most recently used names) and
in the cache's index (:class:`~chunkd.cache.ValidatedVersion`), so that it
outlives the daemon: after a restart an ``immutable`` backend's cached objects are
served without asking the backend again. Every chunk of one read is fetched with
the version the read started with, so a reader never gets a mix of two versions:
if the object changes mid-read, the ranged GET fails its If-Match and the read
fails (a new read sees the new version).

When the backend cannot be asked (it is down), a duration backend's last validated
version keeps serving what is cached for ``stale_if_error`` seconds after its last
successful check (RFC 5861), in memory or from the index after a restart; such an
answer carries :attr:`Stat.stale` and is counted in ``chunkd_stale_served_total``.
Past that window the read fails as it would without a cache.

Sequential readers (a read that starts where the previous one of the same object
ended) trigger readahead of the next chunks, bounded by ``readahead_chunks`` per
read and by a global cap on chunks in flight.

Each chunk a reader asks for is counted once, by where it was found:
``chunkd_read_chunks_total{source}`` (``ram``, ``disk``, ``fetched``) here, and the
same lookup in the cache's ``chunkd_cache_hits_total{tier}`` or
``chunkd_cache_misses_total`` (:meth:`ChunkCache.lookup`). A chunk fetched from a
peer or the backend, or waited on while another reader fetched it, is a miss; the
lease on it once stored is no second lookup. Readahead counts in neither.

One job in ~1,250 lines: serving an object's bytes from a version that stays one. Its
sections (versions, chunks, spans, ranges, unkept reads) share one state and ask each
other: what is known of each object's version (in memory and in the index) and the
revalidation policy, which every read starts from; the single flight per locator,
which a span's GET settles for each chunk it brings; the first read that asks the
version with its own GET. Apart, each would reach into the others' state.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Hashable,
    Sequence,
)
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

from chunkd.cache import BytesLease, ChunkCache, ChunkId, ChunkLease, Locator, ValidatedVersion
from chunkd.cache.singleflight import SingleFlight
from chunkd.errors import (
    BackendForbiddenError,
    BackendUnavailableError,
    BucketNotFoundError,
    ChunkdError,
    IntegrityError,
    ObjectNotFoundError,
    VersionChangedError,
)
from chunkd.gateway.backends import Backend, Backends, ObjectMeta
from chunkd.gateway.backends.base import BatchReads
from chunkd.gateway.costs import charge
from chunkd.gateway.costs.attribution import ATTRIBUTION, Attribution
from chunkd.gateway.hot import HotSet
from chunkd.gateway.names import validate_key
from chunkd.ranges import ByteRange, RequestRange, from_offset, reading, resolve

if TYPE_CHECKING:
    from prometheus_client import Counter

    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.peers import Peers

__all__ = ["ReadPath", "Stat"]

log = logging.getLogger("chunkd.gateway.read")

_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")

# Readahead chunks in flight, all readers together: a bound on the memory and the backend
# requests readahead may hold (128 MiB of 4 MiB chunks) whatever the number of readers;
# each read's own depth is [server] readahead_chunks.
_READAHEAD_IN_FLIGHT: Final = 32
_KNOWN_OBJECTS: Final = 1 << 16  # object versions remembered in memory between reads
_SETTLING: Final = 4  # chunks of one span being hashed and stored at once
# A span streams in pieces this big at most: what a cut stream had delivered of the
# chunk it was in is kept, and a backend client drops what it buffered towards a
# piece when the body breaks, so smaller pieces lose less.
_PIECE_BYTES: Final = 1 << 20
# a first peek's GET of a range to the end of the object: up to here (cut at its end)
_NO_END: Final = 1 << 62


class _Pieces:
    """Pieces of a streamed body not cut into chunks yet, in order."""

    __slots__ = ("nbytes", "views")

    def __init__(self) -> None:
        self.views: collections.deque[memoryview] = collections.deque()
        self.nbytes = 0

    def add(self, piece: memoryview) -> None:
        self.views.append(piece)
        self.nbytes += piece.nbytes

    def take(self, need: int) -> memoryview:
        """The next ``need`` bytes (there are that many): a slice of the first piece
        when it holds them all, else one copy of the pieces they span."""
        self.nbytes -= need
        first = self.views[0]
        if first.nbytes >= need:
            if first.nbytes == need:
                self.views.popleft()
            else:
                self.views[0] = first[need:]
            return first[:need]
        parts: list[memoryview] = []
        left = need
        while left:
            view = self.views[0]
            if view.nbytes <= left:
                parts.append(self.views.popleft())
                left -= view.nbytes
            else:
                parts.append(view[:left])
                self.views[0] = view[left:]
                left = 0
        return memoryview(b"".join(parts))


async def _close_stream(pieces: AsyncIterator[memoryview]) -> None:
    """Close a backend stream that may not have been read to its end (its connection
    goes, rather than being drained)."""
    close = getattr(pieces, "aclose", None)
    if close is not None:
        await close()


def _settle_claims(futures: list[asyncio.Future[Any]], exc: BaseException) -> None:
    """Fail claimed chunks with ``exc`` (cancel them if it is no Exception)."""
    for future in futures:
        if isinstance(exc, Exception):
            future.set_exception(exc)
        else:
            future.cancel()


def _cancel_unsettled(futures: list[asyncio.Future[Any]], _task: asyncio.Future[None]) -> None:
    for future in futures:
        if not future.done():
            future.cancel()


def _answered(
    outcome: tuple[Stat, bytes] | BaseException,
) -> tuple[Stat, bytes] | ChunkdError:
    """A peek's outcome as a batch answers it: its result or its chunkd error; any other
    exception (a bug, a cancellation) is raised."""
    if isinstance(outcome, BaseException) and not isinstance(outcome, ChunkdError):
        raise outcome
    return outcome


def _charge_peeked(backend: str, outcome: object) -> None:
    """A batched peek's range in the cost ledger: one read request (one direct GET) whose
    bytes the batch's backend call brought."""
    if isinstance(outcome, tuple):
        n = len(outcome[1])
        charge.direct(backend, "get", n)
        charge.served("backend", n, backend, n)


def _locator_key(stat: Stat, index: int) -> bytes:
    """What rendezvous hashing places a chunk by before its id is known."""
    return f"{stat.backend}\0{stat.meta.key}\0{stat.meta.version}\0{index}".encode()


@dataclass(frozen=True, slots=True)
class Stat:
    """An object version as the read path knows it."""

    backend: str
    meta: ObjectMeta
    chunk_bytes: int
    #: served stale (stale-if-error): seconds since the version was last checked;
    #: None: the version is fresh
    stale: float | None = None

    @property
    def size(self) -> int:
        """Bytes in the object."""
        return self.meta.size

    @property
    def chunks(self) -> int:
        """Chunks the object splits into."""
        return -(-self.meta.size // self.chunk_bytes)

    def locator(self, index: int) -> Locator:
        """The locator of chunk ``index`` of this version."""
        return Locator(self.backend, self.meta.key, self.meta.version, index)


@dataclass(frozen=True, slots=True)
class _PeekClaim:
    """A range a batch of peeks reads (:meth:`ReadPath.peek_many`), claimed in the
    peeks' single flight."""

    backend: Backend
    key: str
    start: int
    end: int
    future: asyncio.Future[tuple[ObjectMeta, bytes | None]]


@dataclass
class _Known:
    meta: ObjectMeta
    #: when the backend last confirmed the version (time.monotonic())
    checked: float


def _known_from(record: ValidatedVersion) -> _Known:
    """What the index recorded, as the read path keeps it in memory."""
    meta = ObjectMeta(
        key=record.key,
        size=record.size,
        version=record.version,
        etag=record.etag,
        modified=record.modified,
    )
    # The index keeps wall-clock time (it outlives the process); memory, monotonic.
    age = max(0.0, time.time() - record.checked)
    return _Known(meta, time.monotonic() - age)


#: chunks remembered as just fetched (for the cost ledger's served bytes by source)
_FRESH_KEPT: Final = 4096


class ReadPath:
    """Reads object ranges through the cache. See the module docstring.

    Args:
        cache: the node's chunk cache.
        backends: the configured backends (the allowlist).
        metrics: the daemon's metrics.
        readahead_chunks: chunks fetched ahead of a sequential reader.
        span_chunks: most chunks one backend GET fetches for a run of cold chunks.
        peers: the cluster, when chunks are shared between nodes: a cold chunk owned
            by another node (rendezvous hashing of its locator) is asked of that
            node first; spans hold only the chunks this node owns.
        known_objects: most object names whose validated version is kept in memory
            (least recently used first out); the index keeps every one.
    """

    def __init__(
        self,
        cache: ChunkCache,
        backends: Backends,
        metrics: Metrics,
        *,
        readahead_chunks: int = 4,
        span_chunks: int = 64,
        peers: Peers | None = None,
        known_objects: int = _KNOWN_OBJECTS,
    ) -> None:
        self.cache = cache
        self.peers = peers
        self.backends = backends
        self.metrics = metrics
        self.chunk_bytes = cache.config.chunk_bytes
        self.readahead_chunks = readahead_chunks
        self.span_chunks = max(1, span_chunks)
        self._known: OrderedDict[tuple[str, str], _Known] = OrderedDict()
        self._known_objects = max(1, known_objects)
        self._heads: SingleFlight[tuple[str, str], ObjectMeta] = SingleFlight(self._waited)
        # Keyed by locator, or by chunk id once the chunk map knows it: two objects
        # that share a chunk fetch it once.
        self._fetches: SingleFlight[Locator | ChunkId, tuple[ChunkId, memoryview]] = SingleFlight(
            self._waited
        )
        # Metadata reads (peek): by name and range while the version is being learnt,
        # by version and range after.
        self._peeks: SingleFlight[
            tuple[str, str, None, int, int | None], tuple[ObjectMeta, bytes | None]
        ] = SingleFlight(self._waited)
        self._peeks_known: SingleFlight[tuple[str, str, str, int, int], bytes] = SingleFlight(
            self._waited
        )
        self._next_chunk: dict[tuple[str, str, str], int] = {}
        self._batch_kinds: dict[type[Backend], bool] = {}
        self._ahead = asyncio.Semaphore(_READAHEAD_IN_FLIGHT)
        self._background: set[asyncio.Future[None]] = set()
        #: the hottest objects (and datasets, as the registry names their prefixes)
        self.hot = HotSet()
        self._read_counters: dict[str, tuple[Counter, Counter]] = {}
        # chunks just fetched, by where from ("backend", "peer") and for whom (the
        # attribution of the work that fetched them: the reader whose read, span or
        # readahead it was), until that reader is handed one: its bytes are counted
        # as from there in the cost ledger once; anyone else's (another job, or the
        # same job's next read of it) as from the tier that holds it. Not marked:
        # chunks fetched for a peer's request (this node's readers did not cause it).
        self._fresh: OrderedDict[ChunkId, tuple[str, Attribution]] = OrderedDict()

    def _waited(self) -> None:
        self.metrics.singleflight_waiters.inc()

    def _count_read(self, source: str, nbytes: int) -> None:
        """Count a reader's chunk lookup by where it was found (``chunkd_read_chunks``)."""
        counters = self._read_counters.get(source)
        if counters is None:  # a handful of sources: the labelled children, kept
            m = self.metrics
            counters = (m.read_chunks.labels(source), m.read_chunk_bytes.labels(source))
            self._read_counters[source] = counters
        counters[0].inc()
        if nbytes:
            counters[1].inc(nbytes)

    # -- versions ---------------------------------------------------------------------

    def revalidate_after(self, backend_name: str) -> float | None:
        """Seconds after which a version of ``backend_name``'s objects is checked
        again; None: never (the backend is ``immutable``).

        Raises:
            UnknownBackendError: no backend is called ``backend_name``.
        """
        return self.backends.get(backend_name).config.revalidate

    async def stat(
        self,
        backend_name: str,
        key: str,
        *,
        expect: str | None = None,
        reading: tuple[int, int | None] | None = None,
    ) -> Stat:
        """The current version of ``backend_name/key``, per the revalidation policy.

        ``expect``: the version a reader wants (a pinned read). When what is known is
        another version, the object is checked again whatever the policy says (a
        backend configured immutable, or a version not due for a check, would else
        answer the old one for ever), and the answer is what the backend says now.

        ``reading``: the bytes (start, end or None for the rest) a read is about to
        ask for. When the version must be asked and no peer places chunks by it, the
        asking is that read's own first GET (:meth:`_first_read`): one round trip to
        the backend, where a HEAD and then a GET make two. A version known but due
        for a check is checked by the same GET, conditional (``If-None-Match``): a
        version still current sends no bytes.

        Raises:
            UnknownBackendError, InvalidKeyError, ObjectNotFoundError,
            BackendForbiddenError, BackendUnavailableError
        """
        backend = self.backends.get(backend_name)
        validate_key(key)
        ident = (backend.name, key)
        revalidate = backend.config.revalidate
        known = self._recall(ident, from_index=revalidate is None)
        if (
            known is not None
            and (expect is None or known.meta.version == expect)
            and (revalidate is None or time.monotonic() - known.checked < revalidate)
        ):
            return Stat(backend.name, known.meta, self.chunk_bytes)
        if reading is not None and self._first_reads():
            ask = functools.partial(self._first_read, backend, key, reading, known)
        else:
            ask = functools.partial(self._head, backend, key)
        try:
            meta = await self._heads.run(ident, ask)
        except BackendUnavailableError as exc:
            return self._stale(backend, key, known, exc)
        except (ObjectNotFoundError, BucketNotFoundError):
            self.forget(backend.name, key)  # gone: nothing of it may be served later
            raise
        if known is not None and known.meta.version != meta.version:
            log.info(
                "%s/%s changed: version %s -> %s",
                backend.name,
                key,
                known.meta.version,
                meta.version,
            )
        return Stat(backend.name, meta, self.chunk_bytes)

    async def _head(self, backend: Backend, key: str) -> ObjectMeta:
        """HEAD ``key`` and keep what it validated, in memory and in the index (once
        for all the readers that wait on the HEAD)."""
        meta = await backend.head(key)
        if meta is None:
            raise backend.not_found(key)
        self._validated(backend, key, meta)
        return meta

    def _validated(self, backend: Backend, key: str, meta: ObjectMeta) -> None:
        """Keep ``meta`` as what the backend just said of ``key``, in memory and in
        the index."""
        self._remember((backend.name, key), _Known(meta, time.monotonic()))
        self.cache.record_validated(
            ValidatedVersion(
                backend.name, key, meta.version, meta.etag, meta.size, meta.modified, time.time()
            )
        )

    def _learnt(self, backend: Backend, key: str, meta: ObjectMeta) -> None:
        """Keep ``meta``, which a metadata read (:meth:`peek`) just learnt, in memory;
        in the index only where it holds another version of ``key``, which must not
        outlive this one. A name the index knows nothing of stays out of it: a metadata
        read leaves nothing on the node's disk (each record cost a registration about
        35 us a file of the index's writer); after a restart, a read asks the backend."""
        self._remember((backend.name, key), _Known(meta, time.monotonic()))
        record = self.cache.validated(backend.name, key)
        if record is not None and record.version != meta.version:
            self._validated(backend, key, meta)

    def _first_reads(self) -> bool:
        """Whether a read may learn an object's version from its own first GET: not
        when other nodes share the work, since which node fetches a chunk depends on
        the version (its locator); that takes the HEAD first."""
        return self.peers is None or len(self.peers.healthy()) <= 1

    async def _first_read(
        self,
        backend: Backend,
        key: str,
        reading: tuple[int, int | None],
        known: _Known | None,
    ) -> ObjectMeta:
        """Ask the version of ``key`` with the first GET of the read to come (once for
        every reader that waits on it): the bytes it brings settle the chunks it
        covers, as a span's do (:meth:`_start_first_span`)."""
        size = self.chunk_bytes
        first = reading[0] // size
        stop = (first + self.span_chunks) * size
        if reading[1] is not None:
            stop = max((first + 1) * size, min(stop, -(-reading[1] // size) * size))
        if known is None and backend.config.revalidate is not None:
            # After a restart or an eviction from memory: the index's version, to be
            # confirmed rather than read again.
            record = self.cache.validated(backend.name, key)
            known = _known_from(record) if record is not None else None
        opened = await backend.open_first(
            key,
            first * size,
            stop,
            piece_bytes=min(size, _PIECE_BYTES),
            known=known.meta if known is not None else None,
        )
        if opened is None:
            raise backend.not_found(key)
        self._validated(backend, key, opened.meta)
        if opened.pieces is not None:
            stat = Stat(backend.name, opened.meta, size)
            await self._start_first_span(backend, stat, first, opened.end, opened.pieces)
        return opened.meta

    async def _start_first_span(
        self,
        backend: Backend,
        stat: Stat,
        first: int,
        end: int,
        pieces: AsyncIterator[memoryview],
    ) -> None:
        """Claim the chunks a first read's GET holds (from chunk ``first`` to byte
        ``end``), up to the first one cached or in flight, and settle them from its
        stream in the background; a stream nobody claims is closed."""
        try:
            stop = -(-end // self.chunk_bytes)  # the chunk after the GET's last one
            futures, known = await self._claim_run(stat, first, stop, stop - first)
        except BaseException:
            await _close_stream(pieces)
            raise
        if not futures:
            await _close_stream(pieces)
            return
        task = asyncio.ensure_future(
            self._fetch_span(backend, stat, first, futures, known, opened=pieces)
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(functools.partial(_cancel_unsettled, futures))

    def _stale(
        self, backend: Backend, key: str, known: _Known | None, error: BackendUnavailableError
    ) -> Stat:
        """The version last validated, served stale while the backend cannot say
        (stale-if-error), or ``error`` once that is too old to serve."""
        if known is None:
            # Not in memory (a restart, or evicted): what the index kept. It stays out
            # of memory, where it would pass for fresh: until the backend answers,
            # every read of it asks again and is answered stale.
            record = self.cache.validated(backend.name, key)
            if record is None:
                raise error
            known = _known_from(record)
        age = time.monotonic() - known.checked
        window = backend.config.stale_if_error
        if not age < window:
            raise BackendUnavailableError(
                f"{error}; the version of {backend.name}/{key} this node knows was last "
                f"checked {age:.0f}s ago, past the backend's stale_if_error ({window:g}s), "
                "so its cached copy is not served: read it again once the backend "
                "answers, or raise stale_if_error"
            ) from error
        self.metrics.stale_served.labels(backend.name).inc()
        log.warning(
            "backend %s is unavailable; serving %s stale, at the version checked %.0fs ago",
            backend.name,
            key,
            age,
        )
        return Stat(backend.name, known.meta, self.chunk_bytes, stale=age)

    def _recall(self, ident: tuple[str, str], *, from_index: bool) -> _Known | None:
        """What is known of ``ident``'s version: from memory (a use), else, with
        ``from_index``, from the index."""
        known = self._known.get(ident)
        if known is not None:
            self._known.move_to_end(ident)
            return known
        if not from_index:
            # A duration backend asks again after a restart or an eviction; the
            # index serves only when that fails (see _stale).
            return None
        record = self.cache.validated(*ident)
        if record is None:
            return None
        known = _known_from(record)
        self._remember(ident, known)
        return known

    def _remember(self, ident: tuple[str, str], known: _Known) -> None:
        self._known[ident] = known
        self._known.move_to_end(ident)
        while len(self._known) > self._known_objects:
            self._known.popitem(last=False)  # the least recently used

    def forget(self, backend_name: str, key: str) -> None:
        """Drop what is known of an object's version (the next read HEADs it)."""
        self._known.pop((backend_name, key), None)
        self.cache.forget_validated(backend_name, key)

    # -- chunks -----------------------------------------------------------------------

    async def chunk(
        self,
        stat: Stat,
        index: int,
        *,
        own: bool = False,
        local: bool = False,
        ahead: bool = False,
    ) -> ChunkLease:
        """Lease chunk ``index`` of ``stat``'s version, fetching it if no tier has it.

        ``own`` marks a reader that claimed the chunk's fetch itself (a span): it
        waits on it without being counted as a single-flight waiter. ``local``
        fetches from the backend only, never from a peer (a peer's own request).
        ``ahead``: readahead, not a reader (counted neither in ``chunkd_read_chunks``
        nor as a cache hit or miss).
        """
        locator = stat.locator(index)
        if ahead:  # no reader's lookup: counted neither here nor in the cache
            ref = self.cache.resolve(locator)
            lease = None if ref is None else await self.cache.find(ref.id)
        else:
            # The cache counts this lookup as the read path does: a hit of the tier
            # whose copy it is, or a miss (the chunk map not knowing it included).
            ref, lease = await self.cache.lookup(locator)
        if lease is not None:
            if not ahead:
                self._count_read(lease.origin, lease.size)
            return lease
        if not ahead:
            self._count_read("fetched", 0)
        flight = self._fetches.join(locator) if own else None
        try:
            if flight is not None:
                cid, data = await asyncio.shield(flight)
            else:
                cid, data = await self._fetch_once(
                    stat, index, locator, ref.id if ref else None, local=local
                )
        except VersionChangedError:
            self.forget(stat.backend, stat.meta.key)  # the next read HEADs the new version
            raise
        # The fetched chunk, leased back (find: not counted): this reader's miss, no hit.
        lease = await self.cache.find(cid)
        # No tier could keep it (RAM full of pinned chunks, disk degraded): the
        # fetched bytes, verified on the way in, serve this reader anyway.
        return lease if lease is not None else BytesLease(cid, bytes(data))

    async def held_chunk(self, stat: Stat, index: int) -> ChunkLease | None:
        """Chunk ``index`` of ``stat``'s version if a tier holds it; never fetched (a
        peer's handoff, ``held=1``)."""
        ref = self.cache.resolve(stat.locator(index))
        return None if ref is None else await self.cache.find(ref.id)

    async def _fetch_once(
        self, stat: Stat, index: int, locator: Locator, known: ChunkId | None, *, local: bool
    ) -> tuple[ChunkId, memoryview]:
        """Fetch one chunk, once for all its readers (keyed by id when it is known)."""
        backend = self.backends.get(stat.backend)
        key: Locator | ChunkId = locator if known is None or locator in self._fetches else known
        # A peer's own request (local) fetches for no reader of this node: its chunk
        # is not marked fresh (the next reader here is served from the cache).
        return await self._fetches.run(
            key, lambda: self._fetch(backend, stat, index, known, local=local, mark=not local)
        )

    def _owned_elsewhere(self, stat: Stat, index: int) -> bool:
        """Whether another node may hold this chunk: another healthy node owns its
        locator, or this node rejoined the cluster and the next-ranked one may hold it
        (a handoff). Such chunks go through :meth:`_fetch`, which asks, not a span."""
        if self.peers is None:
            return False
        owners = self.peers.owners(_locator_key(stat, index))
        return not self.peers.is_self(owners[0]) or (self.peers.handing_off() and len(owners) > 1)

    async def _fetch(
        self,
        backend: Backend,
        stat: Stat,
        index: int,
        known: ChunkId | None,
        *,
        local: bool,
        mark: bool = True,
    ) -> tuple[ChunkId, memoryview]:
        if self.peers is not None and not local:
            shared = await self.peers.fetch_locator(
                stat.backend, stat.meta.key, stat.meta.version, index, _locator_key(stat, index)
            )
            if shared is not None:
                owner, stated, data = shared
                if known is not None and stated != known:
                    # The chunk map names this locator's chunk already: whatever the
                    # peer's bytes hash to, they are not it, and a peer must never
                    # rewrite a chunk map. The backend's bytes, then.
                    self.peers.integrity_failure(owner, known)
                else:
                    try:
                        # checks the bytes
                        stored = await self._store(stat, index, data, stated, mark=None)
                    except IntegrityError:
                        self.peers.integrity_failure(owner, stated)  # the backend's, then
                    else:
                        if mark:
                            self._mark_fresh(stored[0], "peer")
                        return stored
        start = index * self.chunk_bytes
        end = min(stat.size, start + self.chunk_bytes)
        got = await backend.get(stat.meta.key, ByteRange(start, end), version=stat.meta)
        if got is None:
            raise backend.not_found(stat.meta.key)
        return await self._store(stat, index, got, known, mark="backend" if mark else None)

    def _mark_fresh(self, cid: ChunkId, source: str) -> None:
        """Mark ``cid`` as just fetched from ``source`` for the work at hand (see
        ``_fresh``)."""
        self._fresh[cid] = (source, ATTRIBUTION.get())
        self._fresh.move_to_end(cid)
        while len(self._fresh) > _FRESH_KEPT:
            self._fresh.popitem(last=False)

    def _served_from(self, lease: ChunkLease) -> str:
        """Where a reader's chunk came from, for the cost ledger: the source of the
        fetch made for this reader's work (once), else the tier that holds it."""
        fresh = self._fresh.get(lease.id)
        if fresh is not None and fresh[1] == ATTRIBUTION.get():
            del self._fresh[lease.id]
            return fresh[0]
        return lease.origin or "ram"

    async def _store(
        self,
        stat: Stat,
        index: int,
        data: memoryview | bytes,
        known: ChunkId | None,
        *,
        mark: str | None = "backend",
    ) -> tuple[ChunkId, memoryview]:
        # Known id (the chunk map outlived the chunk): the new bytes must match it.
        cid = await self.cache.insert(data, expected=known)
        if mark is not None:
            self._mark_fresh(cid, mark)
        view = memoryview(data)
        self.cache.record(stat.locator(index), cid, view.nbytes)
        return cid, view

    # -- spans: one backend GET for a run of cold chunks ---------------------------------

    async def _claim_run(
        self, stat: Stat, first: int, stop: int, most: int
    ) -> tuple[list[asyncio.Future[tuple[ChunkId, memoryview]]], list[ChunkId | None]]:
        """Claim chunks ``first``, ``first + 1``, ... before ``stop`` (at most ``most``)
        up to the first one cached, in flight or a peer's to fetch; with each, the id
        it must have if the chunk map knows it. A failure settles what was claimed."""
        futures: list[asyncio.Future[tuple[ChunkId, memoryview]]] = []
        known: list[ChunkId | None] = []
        index = first
        try:
            while index < stop and len(futures) < most:
                locator = stat.locator(index)
                if locator in self._fetches or self._owned_elsewhere(stat, index):
                    break
                ref = self.cache.resolve(locator)
                if ref is not None and (
                    ref.id in self._fetches or await self.cache.contains(ref.id)
                ):
                    break
                future = self._fetches.claim(locator)
                if future is None:
                    break
                futures.append(future)
                known.append(ref.id if ref else None)
                index += 1
        except BaseException as exc:
            # Claimed chunks must never stay claimed: their readers would wait forever.
            _settle_claims(futures, exc)
            raise
        return futures, known

    async def _claim_span(self, stat: Stat, first: int, last: int) -> None:
        """Claim the run of cold chunks from ``first`` (at most ``span_chunks``, up to
        ``last``) and fetch them with one streamed GET. Does nothing if ``first`` is
        cached or already in flight."""
        futures, known = await self._claim_run(stat, first, last + 1, self.span_chunks)
        if not futures:
            return
        try:
            backend = self.backends.get(stat.backend)
        except BaseException as exc:
            _settle_claims(futures, exc)
            raise
        task = asyncio.ensure_future(self._fetch_span(backend, stat, first, futures, known))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        # A span cancelled before it ran (the daemon closing) settles nothing itself.
        task.add_done_callback(functools.partial(_cancel_unsettled, futures))

    async def _fetch_span(
        self,
        backend: Backend,
        stat: Stat,
        first: int,
        futures: list[asyncio.Future[tuple[ChunkId, memoryview]]],
        known: list[ChunkId | None],
        opened: AsyncIterator[memoryview] | None = None,
    ) -> None:
        """Settle ``futures`` (chunks ``first`` on) from one streamed GET: ``opened``
        when the caller's first read already started it (its bytes from chunk
        ``first`` on, perhaps past the span), else a new one."""
        size = self.chunk_bytes
        count = len(futures)
        index = first  # the next chunk to settle
        end = min(stat.size, (first + count) * size)
        offset = first * size  # the next byte wanted from the backend
        resumes = max(0, backend.config.retries)
        settling: set[asyncio.Future[None]] = set()
        try:
            # The bytes of chunk `index` (and on) not settled yet, as the pieces came:
            # a chunk is cut from them with one copy at most (none when one piece
            # holds it), never appended to and sliced out of one growing buffer.
            held = _Pieces()
            while offset < end:
                began = offset
                pieces = opened or backend.stream_range(
                    stat.meta, ByteRange(offset, end), piece_bytes=min(size, _PIECE_BYTES)
                )
                opened = None
                try:
                    async for piece in pieces:
                        offset += piece.nbytes
                        held.add(piece)
                        while index < first + count:
                            need = min(size, stat.size - index * size)
                            if held.nbytes < need:
                                break
                            data = held.take(need)
                            # Hash and store in the background while the stream goes
                            # on; a few at most, so a fast backend cannot run away
                            # with memory.
                            while len(settling) >= _SETTLING:
                                await asyncio.wait(settling, return_when=asyncio.FIRST_COMPLETED)
                            task = asyncio.ensure_future(
                                self._settle(
                                    stat, index, data, known[index - first], futures[index - first]
                                )
                            )
                            settling.add(task)
                            task.add_done_callback(settling.discard)
                            index += 1
                        if index == first + count:
                            break  # a first read's GET may run past the span: not needed
                except (ObjectNotFoundError, BackendForbiddenError, VersionChangedError) as exc:
                    # Will not heal by asking again: every chunk left fails the same way.
                    for future in futures[index - first :]:
                        future.set_exception(exc)
                    index = first + count
                    break
                except Exception as exc:
                    # A body cut short (a reset, a stalled read): what came is kept,
                    # and the span goes on from the first byte that did not, rather
                    # than the cut chunk being read whole again. A GET that brought
                    # nothing was retried already: the chunks go one by one.
                    if resumes > 0 and offset > began:
                        resumes -= 1
                        log.info(
                            "%s/%s: a span GET failed at chunk %d (%s); resuming at byte %d",
                            stat.backend,
                            stat.meta.key,
                            index,
                            exc,
                            offset,
                        )
                        continue
                    log.info(
                        "%s/%s: a span GET failed at chunk %d (%s); fetching the rest chunk "
                        "by chunk",
                        stat.backend,
                        stat.meta.key,
                        index,
                        exc,
                    )
                    break
                finally:
                    await _close_stream(pieces)
            if settling:
                await asyncio.wait(settling)
            # Whatever the span did not deliver: one chunk at a time, each with retries.
            for i in range(index, first + count):
                future = futures[i - first]
                try:
                    result = await self._fetch(backend, stat, i, known[i - first], local=True)
                except Exception as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
        finally:
            for pending_settle in settling:
                pending_settle.cancel()
            for future in futures:  # only on cancellation (the daemon is closing)
                if not future.done():
                    future.cancel()

    async def _settle(
        self,
        stat: Stat,
        index: int,
        data: memoryview,
        known: ChunkId | None,
        future: asyncio.Future[tuple[ChunkId, memoryview]],
    ) -> None:
        try:
            result = await self._store(stat, index, data, known)
        except Exception as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)

    # -- ranges -----------------------------------------------------------------------

    async def read(
        self, stat: Stat, start: int, end: int, *, reader: bool = True
    ) -> AsyncGenerator[memoryview, None]:
        """Yield the bytes ``start`` to ``end`` (exclusive) of ``stat``, chunk by chunk.

        Each yielded view is valid until the next iteration. See :meth:`leases`
        (``reader``).
        """
        if start >= end:
            return
        first = start // self.chunk_bytes
        leases = self.leases(
            stat, first, (end - 1) // self.chunk_bytes, reading=(start, end), reader=reader
        )
        index = first
        try:
            async for lease in leases:
                with lease:
                    base = index * self.chunk_bytes
                    lo = max(start, base) - base
                    hi = min(end, base + lease.size) - base
                    yield lease.view()[lo:hi]
                index += 1
        finally:
            await leases.aclose()

    async def leases(
        self,
        stat: Stat,
        first: int,
        last: int,
        *,
        reading: tuple[int, int] | None = None,
        reader: bool = True,
    ) -> AsyncGenerator[ChunkLease, None]:
        """Yield leases on chunks ``first`` to ``last`` of ``stat``, in order.

        Each call is one read request in the cost ledger (one GET of a direct reader,
        of the bytes ``reading`` names, else of the chunks); each lease's bytes in it
        are counted as served by where they came from. ``reader=False``: the daemon's
        own load (a prefetch, ``chunkd warm``, the inspector, a freeze), not a reader's
        request: neither counted as a direct GET nor as bytes served (its backend
        requests and bytes are counted where they are made, as always).

        The chunks after the current one are fetched concurrently (up to
        ``readahead_chunks`` ahead); a run of cold chunks is fetched with one streamed
        GET of up to ``span_chunks`` chunks, each chunk stored and served as soon as
        its bytes are in. The caller releases each lease it gets; leases fetched
        ahead are released here if the caller stops early.
        """
        if first > last:
            return
        lo, hi = reading or (
            first * self.chunk_bytes,
            min(stat.size, (last + 1) * self.chunk_bytes),
        )
        if reader:
            charge.direct(stat.backend, "get", hi - lo)
        self._note_sequential(stat, first, last)
        pending: dict[int, asyncio.Task[ChunkLease]] = {}
        scheduled = first
        try:
            for index in range(first, last + 1):
                # Keep readahead_chunks chunks ahead in flight; a cold chunk claims the
                # run of cold chunks it starts (one backend GET for up to span_chunks).
                while scheduled <= min(last, index + self.readahead_chunks):
                    await self._claim_span(stat, scheduled, last)
                    pending[scheduled] = asyncio.ensure_future(
                        self.chunk(stat, scheduled, own=True)
                    )
                    scheduled += 1
                # The next span's GET starts while this one's bytes are being served.
                if index + self.span_chunks <= last:
                    await self._claim_span(stat, index + self.span_chunks, last)
                lease = await pending.pop(index)
                self.hot.add(stat.backend, stat.meta.key, lease.size)
                if reader:
                    base = index * self.chunk_bytes
                    served = min(hi, base + lease.size) - max(lo, base)
                    charge.served(self._served_from(lease), served, stat.backend, hi - lo)
                yield lease
        finally:
            for task in pending.values():
                task.cancel()
            # Leases of chunks that arrived before the reader stopped go back.
            for done in await asyncio.gather(*pending.values(), return_exceptions=True):
                if isinstance(done, ChunkLease):
                    done.release()

    def _note_sequential(self, stat: Stat, first: int, last: int) -> None:
        """Prefetch past the end of a read that continues the previous one."""
        ident = (stat.backend, stat.meta.key, stat.meta.version)
        sequential = self._next_chunk.get(ident) == first
        self._next_chunk[ident] = last + 1
        if len(self._next_chunk) > 4096:  # forget the oldest readers
            self._next_chunk.pop(next(iter(self._next_chunk)))
        if not sequential or self.readahead_chunks <= 0:
            return
        for index in range(last + 1, min(stat.chunks, last + 1 + self.readahead_chunks)):
            task = asyncio.ensure_future(self._prefetch(stat, index))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _prefetch(self, stat: Stat, index: int) -> None:
        if self._ahead.locked():
            return  # enough is in flight already; readahead is a hint
        async with self._ahead:
            try:
                lease = await self.chunk(stat, index, ahead=True)
            except Exception as exc:
                log.debug(
                    "readahead of %s/%s chunk %d failed: %s",
                    stat.backend,
                    stat.meta.key,
                    index,
                    exc,
                )
                return
            lease.release()
            self.metrics.readahead_chunks.inc()

    # -- metadata reads: served, never kept ----------------------------------------------

    async def peek(
        self,
        backend_name: str,
        key: str,
        offset: int,
        length: int | None,
        *,
        expect: str | None = None,
    ) -> tuple[Stat, bytes]:
        """Bytes ``offset .. offset + length`` of ``backend_name/key`` (cut at its end)
        for a reader that will not read them again (registration's footers): served and
        verified, but never inserted into the RAM and disk tiers, nor into the chunk map.

        The version is learnt as :meth:`stat` learns it: from what is known while the
        revalidation policy allows, else from the backend, by the same GET that brings
        the bytes (one request; with peers, a HEAD first). A version learnt so is kept
        in memory, and in the index only where it held another version of the name
        (:meth:`_learnt`). A chunk a tier holds is
        served from it; any other bytes come from one ranged GET pinned to the version
        (If-Match), shared by every concurrent peek of the same range (single flight).
        Where the bytes are a whole chunk the chunk map names, they must hash to it.
        ``expect``: the version the bytes must be of (a pinned read, as :meth:`stat`
        takes it): a node that knows another asks the backend again.

        Raises:
            UnknownBackendError, InvalidKeyError, ObjectNotFoundError,
            RangeNotSatisfiableError, VersionChangedError, IntegrityError,
            BackendForbiddenError, BackendUnavailableError
        """
        backend = self.backends.get(backend_name)
        validate_key(key)
        asked = from_offset(offset, length)
        revalidate = backend.config.revalidate
        known = self._recall((backend.name, key), from_index=revalidate is None)
        if (
            length != 0
            and (
                known is None
                or (expect is not None and known.meta.version != expect)
                or (revalidate is not None and time.monotonic() - known.checked >= revalidate)
            )
            and self._first_reads()
        ):
            self._count_read("fetched", 0)
            (meta, first), ran = await self._shared(
                self._peeks,
                (backend.name, key, None, offset, length),
                functools.partial(self._peek_first, backend, key, asked),
            )
            stat = Stat(backend.name, meta, self.chunk_bytes)
            if first is not None:
                data = self._verified(stat, resolve(asked, meta.size)[0], first)
                charge.direct(backend.name, "get", len(data))  # one read request
                # from the backend for the peek that fetched it; the peeks that waited
                # on it got the node's copy in memory (credited), as a restore's do
                source = "backend" if ran else "ram"
                charge.served(source, len(data), backend.name, len(data))
                return stat, data
        else:
            stat = await self.stat(backend_name, key, expect=expect)
        start, end = resolve(asked, stat.size)
        charge.direct(backend.name, "get", end - start)  # one read request
        return stat, await self._peek_known(backend, stat, start, end)

    async def peek_many(
        self, asked: Sequence[tuple[str, str, int, int]]
    ) -> list[tuple[Stat, bytes] | ChunkdError]:
        """:meth:`peek` of each ``(backend, key, offset, length)`` (``length`` given),
        at once: each outcome is what that peek returns, or the chunkd error it raises.

        The files of a backend that reads batches (:class:`BatchReads`: ``file://``)
        whose version must be learnt are read in one call of the backend for them all
        (one thread hop, a few us a file), each claimed as its peek claims it (single
        flight: a concurrent peek of the same range waits for it, and a range another
        peek is reading is waited for), validated, verified and counted as its peek
        does. A file that call leaves to the usual way, and every other range, is its
        own :meth:`peek`, all concurrently (an object store's latency hidden).
        """
        out: list[tuple[Stat, bytes] | ChunkdError | None] = [None] * len(asked)
        batches: dict[str, list[tuple[int, _PeekClaim]]] = {}
        usual: list[int] = []
        first_reads = self._first_reads()
        now = time.monotonic()
        for i, (backend_name, key, offset, length) in enumerate(asked):
            try:
                backend = self.backends.get(backend_name)
                validate_key(key)
            except ChunkdError as exc:
                out[i] = exc
                continue
            if not (first_reads and length > 0 and self._reads_batches(backend)):
                usual.append(i)
                continue
            revalidate = backend.config.revalidate
            known = self._recall((backend.name, key), from_index=revalidate is None)
            if known is not None and (revalidate is None or now - known.checked < revalidate):
                usual.append(i)  # the version is known: the tiers first, as a peek does
                continue
            claimed = self._peeks.claim((backend.name, key, None, offset, length))
            if claimed is None:
                usual.append(i)  # another peek reads this range: its own waits for it
                continue
            batches.setdefault(backend.name, []).append(
                (i, _PeekClaim(backend, key, offset, offset + length, claimed))
            )
        # The usual peeks start now (tasks), so that those of a range this batch claimed
        # wait for it rather than read it again.
        others = (
            asyncio.gather(*(self.peek(*asked[i]) for i in usual), return_exceptions=True)
            if usual
            else None
        )
        try:
            for claims in batches.values():
                await self._peek_batch(claims, out)
                for i, claim in claims:
                    _charge_peeked(claim.backend.name, out[i])
            if others is not None:
                for i, outcome in zip(usual, await others, strict=True):
                    out[i] = _answered(outcome)
        except BaseException:
            for claims in batches.values():
                for _, claim in claims:
                    if not claim.future.done():
                        claim.future.cancel()
            if others is not None and not others.done():
                others.cancel()
                with contextlib.suppress(BaseException):
                    await others
            raise
        return cast("list[tuple[Stat, bytes] | ChunkdError]", out)

    def _reads_batches(self, backend: Backend) -> bool:
        """Whether ``backend`` is :class:`BatchReads` (asked once a kind: a protocol's
        isinstance walks its attributes)."""
        kind = type(backend)
        found = self._batch_kinds.get(kind)
        if found is None:
            found = self._batch_kinds[kind] = isinstance(backend, BatchReads)
        return found

    async def _peek_batch(
        self,
        claims: list[tuple[int, _PeekClaim]],
        out: list[tuple[Stat, bytes] | ChunkdError | None],
    ) -> None:
        """Read the claimed ranges of one backend with one :meth:`BatchReads.read_batch`;
        each outcome into ``out``, each claim settled."""
        backend = cast("BatchReads", claims[0][1].backend)  # _reads_batches said so
        for _ in claims:
            self._count_read("fetched", 0)
        try:
            got = await backend.read_batch([(c.key, c.start, c.end) for _, c in claims])
        except Exception as exc:
            for i, claim in claims:
                claim.future.set_exception(exc)
                out[i] = exc if isinstance(exc, ChunkdError) else None
            if not isinstance(exc, ChunkdError):
                raise
            return
        slow: list[tuple[int, _PeekClaim]] = []
        for (i, claim), one in zip(claims, got, strict=True):
            if one is None:
                slow.append((i, claim))
                continue
            meta, data = one
            self._learnt(claim.backend, claim.key, meta)
            claim.future.set_result((meta, data))
            stat = Stat(claim.backend.name, meta, self.chunk_bytes)
            if data is None:  # past the end: the range's error, as a peek says it
                try:
                    resolve(ByteRange(claim.start, claim.end), meta.size)
                except ChunkdError as exc:
                    out[i] = exc
                else:  # pragma: no cover - resolve refuses a range past the end
                    out[i] = (stat, b"")
                continue
            try:
                out[i] = (stat, self._verified(stat, claim.start, data))
            except ChunkdError as exc:
                out[i] = exc
        if slow:
            done = await asyncio.gather(
                *(self._peek_claimed(claim) for _, claim in slow), return_exceptions=True
            )
            for (i, _), outcome in zip(slow, done, strict=True):
                out[i] = _answered(outcome)

    async def _peek_claimed(self, claim: _PeekClaim) -> tuple[Stat, bytes]:
        """A claimed range the batch left to the usual way: its first GET, under the
        claim, then the rest of a :meth:`peek`."""
        backend, asked = claim.backend, ByteRange(claim.start, claim.end)
        try:
            meta, first = await self._peek_first(backend, claim.key, asked)
        except BaseException as exc:
            _settle_claims([claim.future], exc)
            raise
        claim.future.set_result((meta, first))
        stat = Stat(backend.name, meta, self.chunk_bytes)
        if first is not None:
            return stat, self._verified(stat, claim.start, first)
        start, end = resolve(asked, meta.size)
        return stat, await self._peek_known(backend, stat, start, end)

    async def _shared(
        self, flights: SingleFlight[_K, _V], key: _K, fn: Callable[[], Awaitable[_V]]
    ) -> tuple[_V, bool]:
        """``fn()`` once for every concurrent caller with ``key``: run by the first
        caller itself (a peek is the cheapest read there is: no task of its own), the
        others awaiting its outcome. A waiter whose runner was cancelled (its client
        went) runs ``fn`` itself, unless it is being cancelled too. Returns the outcome
        and whether this caller ran ``fn`` (the cost ledger's source of the bytes)."""
        while True:
            claimed = flights.claim(key)
            if claimed is not None:
                break
            running = flights.join(key)
            if running is None:  # pragma: no cover - claim() said one runs
                continue
            self._waited()
            try:
                return await asyncio.shield(running), False
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if running.cancelled() and (task is None or not task.cancelling()):
                    continue
                raise
        try:
            result = await fn()
        except BaseException as exc:
            _settle_claims([claimed], exc)
            raise
        claimed.set_result(result)
        return result, True

    async def _peek_first(
        self, backend: Backend, key: str, asked: RequestRange | None
    ) -> tuple[ObjectMeta, bytes | None]:
        """One GET of the range that also says the version (kept as :meth:`_learnt`
        keeps it); no bytes where the range is past the end (the caller's error)."""
        start, end = reading(asked) or (0, None)
        if end is None:
            end = _NO_END
        opened = await backend.open_first(key, start, end, piece_bytes=_PIECE_BYTES)
        if opened is None:
            self.forget(backend.name, key)
            raise backend.not_found(key)
        self._learnt(backend, key, opened.meta)
        if opened.pieces is None:
            return opened.meta, None
        try:
            data = b"".join([bytes(piece) async for piece in opened.pieces])
        finally:
            await _close_stream(opened.pieces)
        return opened.meta, data

    async def _peek_known(self, backend: Backend, stat: Stat, start: int, end: int) -> bytes:
        """Bytes ``start .. end`` of a known version: each chunk's part from the tier
        that holds it, the rest with one ranged GET a run, shared by concurrent peeks."""
        size = self.chunk_bytes
        parts: list[bytes] = []
        at = start
        while at < end:
            index = at // size
            stop = min(end, (index + 1) * size)
            _, lease = await self.cache.lookup(stat.locator(index))
            if lease is not None:
                with lease:
                    self._count_read(lease.origin, lease.size)
                    base = index * size
                    parts.append(bytes(lease.view()[at - base : stop - base]))
                charge.served(lease.origin or "ram", stop - at, stat.backend, end - start)
                at = stop
                continue
            self._count_read("fetched", 0)
            # The run of chunks no tier holds, up to the end: one GET.
            while stop < end:
                held = self.cache.resolve(stat.locator(stop // size))
                if held is not None and await self.cache.contains(held.id):
                    break
                stop = min(end, stop + size)
            ident = (stat.backend, stat.meta.key, stat.meta.version, at, stop)
            data, ran = await self._shared(
                self._peeks_known, ident, functools.partial(self._peek_get, backend, stat, at, stop)
            )
            parts.append(self._verified(stat, at, data))
            # a peek that waited on another's GET got the node's copy in memory
            charge.served("backend" if ran else "ram", stop - at, stat.backend, end - start)
            at = stop
        return b"".join(parts)

    async def _peek_get(self, backend: Backend, stat: Stat, start: int, end: int) -> bytes:
        try:
            got = await backend.get(stat.meta.key, ByteRange(start, end), version=stat.meta)
        except VersionChangedError:
            self.forget(stat.backend, stat.meta.key)  # the next read asks the new version
            raise
        if got is None:
            self.forget(stat.backend, stat.meta.key)
            raise backend.not_found(stat.meta.key)
        return bytes(got)

    def _verified(self, stat: Stat, start: int, data: bytes) -> bytes:
        """``data`` (bytes ``start ..`` of ``stat``), checked against the chunk map for
        every whole chunk it holds."""
        size = self.chunk_bytes
        index = -(-start // size)
        while True:
            base = index * size
            stop = min(stat.size, base + size)
            if base >= stat.size or stop > start + len(data):
                return data
            ref = self.cache.resolve(stat.locator(index))
            if ref is not None and not ref.id.matches(data[base - start : stop - start]):
                raise IntegrityError(
                    f"{stat.backend}/{stat.meta.key} chunk {index} (version "
                    f"{stat.meta.version}) does not hash to {ref.id}, the id this node "
                    "recorded for it: the backend served other bytes for the same version"
                )
            index += 1

    async def warm(
        self, backend_name: str, key: str, offset: int = 0, length: int | None = None
    ) -> tuple[Stat, int]:
        """Load the chunks of an object (or of a range of it: ``offset``, ``length``, cut at
        the end) into the cache; returns the stat and bytes loaded."""
        stat = await self.stat(
            backend_name, key, reading=(offset, None if length is None else offset + length)
        )
        start = min(offset, stat.size)
        end = stat.size if length is None else min(stat.size, start + length)
        loaded = 0
        if start < end or stat.size == 0:
            # Not a reader's request: no direct GET, no bytes served (nor credited).
            async for piece in self.read(stat, start, end, reader=False):
                loaded += piece.nbytes
        return stat, loaded

    async def close(self) -> None:
        """Stop readahead."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
