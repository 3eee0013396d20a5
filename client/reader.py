"""How the client finds the bytes of a range: its own cache first, then the daemon.

A :class:`Reader` keeps a bounded LRU of chunk mappings keyed by chunk id
(``cache_bytes``, page-rounded; also at most a quarter of the process's fd limit), and
what it learned of each name from the daemon's answers: size, version, chunk size, the
backend's revalidation period, and the chunk id of each chunk index it saw
(:class:`Known`). A read whose chunks are all mapped makes **no round trip** while the
name is fresh: forever for an immutable backend, else for ``revalidate`` seconds after
the daemon said so. Once stale, one small ``stat`` confirms the version before the
mappings serve again; a new version forgets the old chunk ids. Chunk ids name content,
so a cached mapping is never stale. A cached chunk keeps its memfd open (one fd per
cached chunk) so that it can be laid out contiguously again without asking the daemon.
Evicting a chunk only drops the reader's reference: views handed out keep their own
mapping alive. The pages are the daemon's (shared), but a mapping keeps a chunk in
memory after the daemon evicted it, so ``cache_bytes`` bounds that too.

A read the cache cannot answer goes to the daemon over the reader's
:class:`~chunkd.client.connection.Connection`. A read of more than
:data:`~chunkd.client.protocol.MAX_FDS` chunks goes out as several requests of the same
version, put together as one range (:class:`~chunkd.client.views.Located`).

Internal to :mod:`chunkd.client`: :class:`~chunkd.client.Client` holds one.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Final

from chunkd.client import protocol
from chunkd.client.connection import Connection
from chunkd.client.jobs import FOR_DATASET
from chunkd.client.results import CacheInfo, ObjectStat
from chunkd.client.views import Chunk, ChunkLRU, Located, Span, check_chunk_fd, chunk_budget
from chunkd.errors import RangeNotSatisfiableError, VersionChangedError
from chunkd.memfd import close_all
from chunkd.ranges import from_offset, resolve

__all__ = ["Known", "Reader", "check_range"]

#: names whose size, version and chunk ids the client remembers
_KNOWN_NAMES: Final = 1 << 16
#: a read restarts this many times when the object changes between its requests
_VERSION_RETRIES: Final = 3


@dataclass(slots=True)
class Known:
    """An object version as last reported, and the chunk ids seen for it."""

    size: int
    version: str
    chunk_bytes: int
    revalidate: float | None
    learned: float
    chunks: dict[int, str] = field(default_factory=dict)
    modified: float | None = None

    def fresh(self, now: float) -> bool:
        return self.revalidate is None or now - self.learned < self.revalidate

    def stat(self, name: str) -> ObjectStat:
        chunks = -(-self.size // self.chunk_bytes)
        return ObjectStat(name, self.size, self.version, self.chunk_bytes, chunks, self.modified)


def check_range(offset: int, length: int | None) -> None:
    """Refuse an offset or a length that is not a whole number >= 0 (ValueError)."""
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be a whole number >= 0; got {offset!r}")
    if length is not None and (not isinstance(length, int) or length < 0):
        raise ValueError(f"length must be a whole number >= 0 or None; got {length!r}")


def _parse_spans(reply: dict[str, Any], fds: int) -> list[tuple[str, int, int, int, int]]:
    """A read answer's spans as (chunk id, index, size, start, stop)."""
    try:
        spans = [
            (str(s["chunk"]), int(s["index"]), int(s["size"]), int(s["start"]), int(s["stop"]))
            for s in reply["spans"]
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise protocol.ProtocolError(f"the daemon's read answer is malformed: {exc!r}") from exc
    if len(spans) != fds:
        raise protocol.ProtocolError(
            f"the daemon's read answer has {fds} fds for {len(spans)} spans"
        )
    return spans


class Reader:
    """A client's cache of chunk mappings and names, and its reads from the daemon.

    Args:
        connection: the connection to the daemon, for what the cache cannot answer.
        cache_bytes: budget of the cache of chunk mappings (0: none).

    Attributes:
        lock: held for every look at or change of the cache (not while a request is
            out).
        chunks: the chunk mappings cached.
        known: what was learned of each name, least recently used first.
    """

    def __init__(
        self, connection: Connection, cache_bytes: int, cache_chunks: int | None = None
    ) -> None:
        self._connection = connection
        self.lock = threading.Lock()
        most = chunk_budget() if cache_chunks is None else cache_chunks
        self.chunks = ChunkLRU(cache_bytes, most)
        self.known: OrderedDict[str, Known] = OrderedDict()

    def info(self) -> CacheInfo:
        """What the cache holds now."""
        with self.lock:
            return CacheInfo(
                len(self.chunks),
                self.chunks.nbytes,
                self.chunks.max_bytes,
                self.chunks.max_chunks,
                len(self.known),
            )

    def clear(self) -> None:
        """Forget every chunk and name; views already handed out stay valid."""
        with self.lock:
            self.chunks.clear()
            self.known.clear()

    def after_fork(self) -> None:
        """In a forked child: a fresh lock (the parent's mappings stay usable)."""
        self.lock = threading.Lock()

    def hit(self, name: str, offset: int, length: int | None) -> memoryview | None:
        """The fast path: a fresh name, a range inside one mapped chunk; else None.

        No system call and no allocation beyond the view: this is what makes small
        random reads cheaper than a ``pread``.
        """
        if length is None or length <= 0 or offset < 0:
            return None
        with self.lock:
            known = self.known.get(name)
            if known is None or self._connection.closed:
                return None
            if known.revalidate is not None and not known.fresh(time.monotonic()):
                return None
            step = known.chunk_bytes
            index, start = divmod(offset, step)
            stop = start + length
            if stop > step or offset + length > known.size:
                return None
            chunk_id = known.chunks.get(index)
            chunk = self.chunks.get(chunk_id) if chunk_id is not None else None
        if chunk is None or stop > chunk.size:
            return None
        return chunk.view(start, stop)

    def locate(
        self, name: str, offset: int, length: int | None, version: str | None = None
    ) -> Located:
        """A range of ``name``'s current version: from the cache, else from the daemon.

        ``version``: the version the range must be of (a pinned read). The cache answers
        only for that version, and the daemon is told it: one that knows another
        version of the object checks the object again before it answers.
        """
        check_range(offset, length)
        located = self.from_cache(name, offset, length, time.monotonic())
        if located is None and self.from_cache(name, offset, length, None) is not None:
            # Everything is mapped but the name is stale: a stat is cheaper than a read.
            self.stat_remote(name)
            located = self.from_cache(name, offset, length, time.monotonic())
        if located is not None and version is not None and located.version != version:
            located = None
        if located is None:
            located = self._read_remote(name, offset, length, version)
        return located

    def from_cache(
        self, name: str, offset: int, length: int | None, now: float | None
    ) -> Located | None:
        """The range from cached mappings alone, or None (``now`` None: even if stale)."""
        with self.lock:
            self._connection.check_open()
            known = self.known.get(name)
            if known is None or (now is not None and not known.fresh(now)):
                return None
            size, step = known.size, known.chunk_bytes
            try:
                offset, end = resolve(from_offset(offset, length), size)
            except RangeNotSatisfiableError:
                return None  # past the end: the daemon says so, with the object's size
            pieces: list[Span | memoryview] = []
            for index in range(offset // step, -(-end // step)):
                chunk_id = known.chunks.get(index)
                chunk = self.chunks.get(chunk_id) if chunk_id is not None else None
                base = index * step
                if chunk is None or chunk.size != min(step, size - base):
                    return None
                pieces.append(Span(chunk, max(offset, base) - base, min(end, base + step) - base))
            return Located(name, known.version, size, max(0, end - offset), pieces)

    def _read_remote(
        self, name: str, offset: int, length: int | None, wanted: str | None = None
    ) -> Located:
        for _ in range(_VERSION_RETRIES):
            try:
                located = self._read_version(name, offset, length, wanted)
            except RangeNotSatisfiableError:
                # A whole read of an object not known yet asks for its first chunks,
                # which an empty object does not have: it is whole, and empty.
                if offset or length is not None:
                    raise
                self.stat_remote(name)
                located = self.from_cache(name, 0, None, None)
                if located is None or located.size:
                    raise
            if located is not None:
                return located
        raise VersionChangedError(
            f"{name} changed {_VERSION_RETRIES} times while it was being read; "
            "read it again once it stops changing"
        )

    def _read_version(
        self, name: str, offset: int, length: int | None, wanted: str | None = None
    ) -> Located | None:
        """Read a range with as many requests as its chunk count needs; None if the
        object changed between them."""
        pieces: list[Span | memoryview] = []
        version: str | None = None
        size = end = -1
        position = offset
        while True:
            ask_offset, ask_length = self._plan(name, offset, position, length, end)
            asked = time.monotonic()
            request = {
                "op": "read",
                "name": name,
                "offset": ask_offset,
                "length": ask_length,
                # Small reads come as fds too: a mapped chunk answers the next
                # reads inside it with no round trip at all.
                "inline": False,
            }
            if wanted is not None:
                request["version"] = wanted
            dataset = FOR_DATASET.get()
            if dataset is not None:
                request["dataset"] = dataset
            reply, payload, fds = self._connection.request(request, f"a read of {name}")
            try:
                known = self._learn(name, reply, asked)
            except BaseException:
                close_all(fds)
                raise
            if version is None:
                version, size = known.version, known.size
                end = size if length is None else min(size, offset + length)
            elif known.version != version:
                close_all(fds)
                return None
            got = self._take(name, reply, payload, fds, ask_offset, position, pieces)
            if got >= end:
                return Located(name, version, size, max(0, end - offset), pieces)
            if got <= position:
                raise protocol.ProtocolError(
                    f"the daemon answered a read of {name} at byte {position} with no bytes"
                )
            position = got

    def _plan(
        self, name: str, offset: int, position: int, length: int | None, end: int
    ) -> tuple[int, int | None]:
        """The next request's (offset, length): at most MAX_FDS chunks, none tiny."""
        with self.lock:
            known = self.known.get(name)
            step = (
                known.chunk_bytes if known else int(self._connection.hello.get("chunk_bytes") or 0)
            )
            if end < 0 and known is not None:
                end = known.size if length is None else min(known.size, offset + length)
        limit = protocol.MAX_FDS
        if step <= 0 or position >= end >= 0:
            return position, length  # at or past the end: the daemon says what that means
        if end < 0:  # nothing known of the object: ask for at most `limit` chunks
            cap = (position // step + limit) * step - position
            return position, cap if length is None else min(length, cap)
        first, last = position // step, max(position, end - 1) // step
        count = last - first + 1
        if count <= limit:
            if position > offset and end - position <= protocol.INLINE_MAX:
                # A tail this small would come back inline, and the range could not be
                # one mapped view: ask for a bit more, already-mapped bytes included.
                start = max(0, end - protocol.INLINE_MAX - 1)
                return start, end - start
            return position, end - position
        per = -(-count // -(-count // limit))  # balanced pieces of at most `limit` chunks
        return position, (first + per) * step - position

    def _take(
        self,
        name: str,
        reply: dict[str, Any],
        payload: bytes,
        fds: list[int],
        asked: int,
        position: int,
        pieces: list[Span | memoryview],
    ) -> int:
        """Add the bytes of one read answer from ``position`` on; return where they end.

        Owns ``fds``: each is adopted by a chunk or closed, even on error.
        """
        if reply.get("inline"):
            close_all(fds)
            data = memoryview(payload)
            if position > asked:
                data = data[position - asked :]
            if len(data):
                pieces.append(data)
            return position + len(data)
        try:
            spans = _parse_spans(reply, len(fds))
        except protocol.ProtocolError:
            close_all(fds)
            raise
        step = self._step(name)
        for i, ((chunk_id, index, size, start, stop), fd) in enumerate(
            zip(spans, fds, strict=True)
        ):
            try:
                chunk = self._adopt(chunk_id, size, fd)
            except BaseException:
                close_all(fds[i + 1 :])
                raise
            base = index * step
            if base + stop <= position:
                continue  # asked again only to keep the range one mapped view
            pieces.append(Span(chunk, max(start, position - base), stop))
            position = base + stop
        return position

    def _step(self, name: str) -> int:
        with self.lock:
            known = self.known.get(name)
            return known.chunk_bytes if known else int(self._connection.hello["chunk_bytes"])

    def _adopt(self, chunk_id: str, size: int, fd: int) -> Chunk:
        """The chunk ``fd`` holds: the cached one (closing ``fd``) or a new one that owns it."""
        try:
            with self.lock:
                cached = self.chunks.get(chunk_id)
            if cached is not None and cached.size == size:
                os.close(fd)
                return cached
            check_chunk_fd(chunk_id, size, fd)
        except BaseException:
            os.close(fd)
            raise
        chunk = Chunk(chunk_id, size, fd)
        with self.lock:
            self.chunks.put(chunk)
        return chunk

    def fresh(self, name: str) -> Known | None:
        """What is known of ``name`` while it is fresh, else None."""
        with self.lock:
            self._connection.check_open()
            known = self.known.get(name)
            return known if known is not None and known.fresh(time.monotonic()) else None

    def stat_remote(self, name: str) -> Known:
        """Ask the daemon what ``name`` is now, and remember it."""
        asked = time.monotonic()
        reply, _, fds = self._connection.request({"op": "stat", "name": name}, f"a stat of {name}")
        close_all(fds)
        return self._learn(name, reply, asked)

    def _learn(self, name: str, reply: dict[str, Any], asked: float) -> Known:
        """Record what an answer says of ``name``; ``asked``: when the request went out."""
        try:
            size, version = int(reply["size"]), str(reply["version"])
            chunk_bytes = int(reply.get("chunk_bytes") or self._connection.hello["chunk_bytes"])
            revalidate = reply.get("revalidate", 0.0)
            revalidate = None if revalidate is None else float(revalidate)
            modified = reply.get("modified")
            modified = None if modified is None else float(modified)
            spans = [(int(s["index"]), str(s["chunk"])) for s in reply.get("spans") or ()]
        except (KeyError, TypeError, ValueError) as exc:
            raise protocol.ProtocolError(
                f"the daemon's answer about {name} is malformed: {exc}"
            ) from exc
        if chunk_bytes <= 0 or size < 0:
            raise protocol.ProtocolError(
                f"the daemon reported {name} as {size} bytes in chunks of {chunk_bytes}"
            )
        with self.lock:
            known = self.known.get(name)
            if known is None or (known.version, known.size, known.chunk_bytes) != (
                version,
                size,
                chunk_bytes,
            ):
                known = Known(size, version, chunk_bytes, revalidate, asked, modified=modified)
                self.known[name] = known
            else:
                known.revalidate, known.learned = revalidate, max(known.learned, asked)
                known.modified = modified if modified is not None else known.modified
            self.known.move_to_end(name)
            while len(self.known) > _KNOWN_NAMES:
                self.known.popitem(last=False)
            known.chunks.update(spans)
            return known
