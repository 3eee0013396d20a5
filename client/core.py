"""The trainer-side client of the node's chunkd daemon.

:class:`Client` speaks :mod:`chunkd.client.protocol` over the daemon's Unix socket and
hands out **read-only, zero-copy** views of object bytes. It imports nothing but the
standard library (numpy only inside :func:`as_numpy`), and never the daemon's code.

Reads
    The daemon answers a small read inline (the bytes in the frame) and any other
    read with one sealed memfd per chunk (SCM_RIGHTS). The client maps each chunk
    read-only. A range inside one chunk is a view into that chunk's mapping. A
    range over several chunks is still **one contiguous view**: the client reserves
    the address space once (an anonymous ``PROT_NONE`` mapping) and maps each
    chunk's memfd at its place inside it with ``MAP_FIXED`` (chunks are page-size
    multiples, all but an object's last). The region is unmapped when the last view
    of it is garbage collected. Where ``MAP_FIXED`` fails, for whatever reason, the
    range is copied into a fresh buffer instead: the same bytes, slower, and still
    read-only. A read of more than :data:`~chunkd.client.protocol.MAX_FDS` chunks
    goes out as several requests of the same version, put together the same way.

The client cache
    The client keeps a bounded LRU of chunk mappings keyed by chunk id (``cache_bytes``,
    page-rounded; also at most a quarter of the process's fd limit), and what it
    learned of each name from the daemon's answers: size, version, chunk size, the
    backend's revalidation period, and the chunk id of each chunk index it saw. A
    read whose chunks are all mapped makes **no round trip** while the name is fresh:
    forever for an immutable backend, else for ``revalidate`` seconds after the daemon
    said so. Once stale, one small ``stat`` confirms the version before the mappings
    serve again; a new version forgets the old chunk ids. Chunk ids name content, so a
    cached mapping is never stale. A cached chunk keeps its memfd open (one fd per
    cached chunk) so that it can be laid out contiguously again without asking the
    daemon. Evicting a chunk only drops the client's reference: views handed out keep
    their own mapping alive. The pages are the daemon's (shared), but a mapping keeps a
    chunk in memory after the daemon evicted it, so ``cache_bytes`` bounds that too.

Connection
    ``Client()`` connects to the first socket that answers ``hello``: the
    ``socket_path`` argument, else ``$CHUNKD_SOCKET``, ``/run/chunkd/chunkd.sock``,
    ``./chunkd.sock``. When the connection breaks (the daemon restarted), the next
    request reconnects with backoff for up to ``timeout`` seconds and is sent again:
    every operation is idempotent. Mappings and views stay valid across restarts. A
    request the daemon does not answer within ``timeout`` seconds raises
    :class:`DaemonUnavailableError`.

Threads and processes
    A client is thread-safe: one request at a time goes over its connection (under
    a lock), while reads that the cache answers take only a short lock of their own.
    A forked child (a data-loader worker) gets its own connection on first use; the
    parent's mappings and cached chunks stay usable in it.

Errors
    An error answer raises the :mod:`chunkd.errors` class that the daemon named, with
    the daemon's message (a name it does not know raises :class:`ChunkdError`).

Other requests
    :meth:`Client.request` sends any op of :data:`chunkd.client.protocol.OPS` (the
    checkpoint module speaks the ``ckpt_*`` ops through it) on the same connection,
    with the same reconnection and errors, and returns a :class:`Reply`.
"""

from __future__ import annotations

import asyncio
import ctypes
import io
import itertools
import json
import logging
import mmap
import os
import socket
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from chunkd.backoff import Backoff
from chunkd.client import protocol
from chunkd.errors import (
    CacheClosedError,
    ChunkdError,
    DaemonUnavailableError,
    VersionChangedError,
)
from chunkd.memfd import close_all, sealed_size

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer
    from numpy import ndarray
    from numpy.typing import DTypeLike

__all__ = [
    "AsyncClient",
    "CacheInfo",
    "ChunkdFile",
    "Client",
    "DaemonUnavailableError",
    "ObjectStat",
    "Reply",
    "as_numpy",
]

log = logging.getLogger("chunkd.client")

_PAGE: Final = mmap.PAGESIZE
#: names whose size, version and chunk ids the client remembers
_KNOWN_NAMES: Final = 1 << 16
#: a read restarts this many times when the object changes between its requests
_VERSION_RETRIES: Final = 3
#: at most this much of a prefetch request's header is names
_PREFETCH_HEADER_BYTES: Final = protocol.MAX_HEADER // 2
#: ranges up to this size go in a readv; larger ones are read with fds
_READV_MAX: Final = 256 * 1024
#: an AsyncClient copies a cache hit on the event loop up to this size, else in a thread
_LOOP_COPY_BYTES: Final = 1 << 20
#: the delays between attempts to reconnect to a daemon that went away
_RECONNECT: Final = Backoff(base=0.02, cap=0.5, jitter="equal")


@dataclass(frozen=True, slots=True)
class Reply:
    """A successful answer of the daemon to :meth:`Client.request`.

    The caller owns :attr:`fds` (sealed memfds): close them with :meth:`close`, or
    use the reply as a context manager.
    """

    #: the answer's JSON header (``"ok": true`` and the op's fields)
    header: dict[str, Any]
    #: the bytes that came with it
    payload: bytes
    #: the fds that came with it, the caller's to close
    fds: list[int]

    def close(self) -> None:
        """Close every fd of the reply."""
        close_all(self.fds)
        self.fds.clear()

    def __enter__(self) -> Reply:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class ObjectStat:
    """An object version as the daemon reports it.

    Attributes:
        name: ``BACKEND/KEY``.
        size: bytes in the object.
        version: the backend's version token (ETag, version id, size+mtime).
        chunk_bytes: the size of every chunk but the last.
        chunks: how many chunks the object splits into.
        modified: when the object was last written, seconds since the epoch (None:
            the backend does not say).
    """

    name: str
    size: int
    version: str
    chunk_bytes: int
    chunks: int
    modified: float | None = None


@dataclass(frozen=True, slots=True)
class CacheInfo:
    """What a client's own cache holds (see :meth:`Client.cache_info`).

    Attributes:
        chunks: chunk mappings cached.
        bytes: their page-rounded size.
        max_bytes: the ``cache_bytes`` budget.
        max_chunks: the most chunks cached at once (each holds an fd).
        names: names whose size, version and chunk ids are remembered.
    """

    chunks: int
    bytes: int
    max_bytes: int
    max_chunks: int
    names: int


# -- chunk mappings ----------------------------------------------------------------------


def _page_round(size: int) -> int:
    return max(_PAGE, -(-size // _PAGE) * _PAGE)


class _Chunk:
    """One chunk's sealed memfd, and its read-only mapping once a view needs it.

    The fd is closed when the last reference to the chunk goes; a mapping lives on
    in the views made from it.
    """

    __slots__ = ("__weakref__", "_closer", "_mapping", "_whole", "fd", "id", "size")

    def __init__(self, chunk_id: str, size: int, fd: int) -> None:
        self.id = chunk_id
        self.size = size
        self.fd = fd
        self._mapping: mmap.mmap | None = None
        self._whole: memoryview | None = None
        self._closer = weakref.finalize(self, os.close, fd)
        self._closer.atexit = False

    def view(self, start: int, stop: int) -> memoryview:
        whole = self._whole
        if whole is None:
            if self._mapping is None:
                self._mapping = mmap.mmap(self.fd, self.size, prot=mmap.PROT_READ)
            whole = self._whole = memoryview(self._mapping).toreadonly()
        return whole[start:stop]


class _ChunkLRU:
    """Chunk mappings by chunk id, least recently used first out."""

    def __init__(self, max_bytes: int, max_chunks: int) -> None:
        self.max_bytes = max_bytes
        self.max_chunks = max_chunks
        self.nbytes = 0
        self._entries: OrderedDict[str, _Chunk] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, chunk_id: object) -> bool:
        return chunk_id in self._entries

    def get(self, chunk_id: str) -> _Chunk | None:
        chunk = self._entries.get(chunk_id)
        if chunk is not None:
            self._entries.move_to_end(chunk_id)
        return chunk

    def put(self, chunk: _Chunk) -> None:
        charge = _page_round(chunk.size)
        if charge > self.max_bytes or self.max_chunks <= 0:
            return
        old = self._entries.pop(chunk.id, None)
        if old is not None:
            self.nbytes -= _page_round(old.size)
        self._entries[chunk.id] = chunk
        self.nbytes += charge
        while self.nbytes > self.max_bytes or len(self._entries) > self.max_chunks:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= _page_round(evicted.size)

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0


def _chunk_budget() -> int:
    """Cached chunks hold an fd each: stay well inside the process's fd limit."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 256
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    return max(16, soft // 4)


# -- contiguous views over several chunks -----------------------------------------------


_PROT_NONE: Final = 0
_MAP_FIXED: Final = 0x10  # Linux, every architecture chunkd runs on


class _Libc:
    """``mmap``/``munmap`` through ctypes (Linux only; the memfds are Linux too)."""

    def __init__(self) -> None:
        if not sys.platform.startswith("linux"):
            raise OSError("contiguous chunk views need Linux")
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        self.munmap = libc.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.failed = ctypes.c_void_p(-1).value


_LIBC: _Libc | None = None


def _libc() -> _Libc:
    global _LIBC
    if _LIBC is None:
        _LIBC = _Libc()
    return _LIBC


class _Span(NamedTuple):
    """Bytes ``start`` to ``stop`` of one chunk."""

    chunk: _Chunk
    start: int
    stop: int


def _contiguous(spans: list[_Span]) -> bool:
    """Whether the chunks of ``spans`` can sit back to back at page-aligned places."""
    return all(
        a.stop == a.chunk.size and b.start == 0 and a.chunk.size % _PAGE == 0
        for a, b in itertools.pairwise(spans)
    )


def _map_fixed(libc: _Libc, address: int, chunk: _Chunk) -> None:
    """Map ``chunk`` read-only at ``address``, replacing what is mapped there."""
    flags = mmap.MAP_SHARED | _MAP_FIXED
    got = libc.mmap(address, chunk.size, mmap.PROT_READ, flags, chunk.fd, 0)
    if got != address:
        err = ctypes.get_errno()
        if got is not None and got != libc.failed:
            libc.munmap(got, chunk.size)
        raise OSError(err, f"MAP_FIXED of chunk {chunk.id} failed: {os.strerror(err)}")


def _layout(spans: list[_Span], length: int) -> memoryview:
    """One read-only view of ``length`` bytes over the chunks of ``spans``, no copy.

    Reserves the address space of all the chunks, maps each chunk's memfd at its
    place with ``MAP_FIXED``, and unmaps the whole region when the ctypes array that
    exposes it is garbage collected (that is, once no view of it is left).

    Raises:
        OSError: a mapping failed; nothing is left mapped.
    """
    libc = _libc()
    total = sum(span.chunk.size for span in spans)
    reserved = _page_round(total)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    base = libc.mmap(None, reserved, _PROT_NONE, flags, -1, 0)
    if base is None or base == libc.failed:
        err = ctypes.get_errno()
        raise OSError(err, f"reserving {reserved} bytes failed: {os.strerror(err)}")
    try:
        at = 0
        for span in spans:
            _map_fixed(libc, base + at, span.chunk)
            at += span.chunk.size
        region = (ctypes.c_char * reserved).from_address(base)
        unmap = weakref.finalize(region, libc.munmap, base, reserved)
        # At interpreter exit a view may still be read by another finalizer: leave the
        # region to the kernel rather than unmap it under that reader.
        unmap.atexit = False
    except BaseException:
        libc.munmap(base, reserved)
        raise
    first = spans[0].start
    return memoryview(region).cast("B")[first : first + length].toreadonly()


@dataclass(slots=True)
class _Located:
    """A byte range of one object version, as pieces held by the client."""

    name: str
    version: str
    size: int
    length: int
    pieces: list[_Span | memoryview]

    def view(self) -> memoryview:
        """The range as one read-only view: zero-copy when the pieces allow it."""
        pieces = self.pieces
        if not pieces or self.length == 0:
            return memoryview(b"")
        if len(pieces) == 1:
            piece = pieces[0]
            if isinstance(piece, memoryview):
                return piece.toreadonly()
            return piece.chunk.view(piece.start, piece.stop).toreadonly()
        spans = [piece for piece in pieces if isinstance(piece, _Span)]
        if len(spans) == len(pieces) and _contiguous(spans):
            try:
                return _layout(spans, self.length)
            except OSError as exc:
                log.debug("contiguous view of %s failed (%s); copying instead", self.name, exc)
        buffer = bytearray(self.length)
        self.copy_into(memoryview(buffer))
        return memoryview(buffer).toreadonly()

    def copy_into(self, target: memoryview) -> int:
        """Copy the range into ``target`` (a writable byte view); return bytes copied."""
        at = 0
        for piece in self.pieces:
            source = _source(piece)
            n = min(len(source), len(target) - at)
            target[at : at + n] = source[:n]
            at += n
        return at

    def to_bytes(self) -> bytes:
        """The range as ``bytes`` (one copy)."""
        return b"".join(_source(piece) for piece in self.pieces)


def _source(piece: _Span | memoryview) -> memoryview:
    if isinstance(piece, memoryview):
        return piece
    return piece.chunk.view(piece.start, piece.stop)


# -- what the client knows of names ------------------------------------------------------


@dataclass(slots=True)
class _Known:
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


def _error_from(reply: dict[str, Any], what: str) -> ChunkdError:
    return protocol.error_of(reply, what)


def _json_bytes(text: str) -> int:
    """The bytes ``text`` takes in a frame's header (JSON, UTF-8)."""
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8", "surrogatepass"))


def _take_ranges(
    batch: list[tuple[int, str, int, int]],
    answers: list[dict[str, Any]],
    payload: bytes,
    out: list[bytearray | ChunkdError],
    versions: dict[int, str],
) -> list[tuple[int, str, int, int]]:
    """Put one ``readv`` answer's bytes where they belong; returns what to ask again.

    ``batch`` is what was asked, as (slot in ``out``, name, offset, length); the
    payload holds the bytes of every answered range in order, whatever becomes of
    them here. A range cut to fit is asked again for the rest; one whose object
    changed version between two answers fails with :class:`VersionChangedError`.
    """
    view = memoryview(payload)
    again = []
    for (i, name, offset, length), got in zip(batch, answers, strict=False):
        if "error" in got:
            out[i] = _error_from(got, f"a read of {name}")
            continue
        size = int(got["length"])
        if not 0 <= size <= min(length, view.nbytes):
            raise protocol.ProtocolError(f"a readv answer gives {size} bytes of {name}")
        data, view = view[:size], view[size:]  # this range's bytes, whatever follows
        target = out[i]
        if not isinstance(target, bytearray):
            continue  # failed in an earlier round
        version = str(got["version"])
        if versions.setdefault(i, version) != version:
            out[i] = VersionChangedError(f"{name} changed while it was read; read it again")
            continue
        target += data
        if size < length and offset + size < int(got["size"]):
            again.append((i, name, offset + size, length - size))  # cut to fit
    return again


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


def _check_chunk_fd(chunk_id: str, size: int, fd: int) -> None:
    """Refuse an fd that is not a sealed memfd of at least ``size`` bytes.

    A memfd that could shrink under a mapping would crash the reader with SIGBUS; one
    that could change would not hold the chunk its id names.
    """
    if size <= 0:
        raise protocol.ProtocolError(f"the daemon sent chunk {chunk_id} of size {size}")
    held = sealed_size(fd)
    if held is None or held < size:
        raise protocol.ProtocolError(
            f"the daemon sent chunk {chunk_id} in an fd that is not a sealed memfd of {size} bytes"
        )


def _fields_of(header: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in header.items() if k != "op"}


def _check_range(offset: int, length: int | None) -> None:
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be a whole number >= 0; got {offset!r}")
    if length is not None and (not isinstance(length, int) or length < 0):
        raise ValueError(f"length must be a whole number >= 0 or None; got {length!r}")


_CLIENTS: weakref.WeakSet[Client] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for client in list(_CLIENTS):
        client._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# -- the client --------------------------------------------------------------------------


class Client:
    """A connection to this node's chunkd daemon, with a cache of chunk mappings.

    See the module docstring for how reads, the cache and reconnection behave.

    Args:
        socket_path: the daemon's socket; None: ``$CHUNKD_SOCKET``, then
            ``/run/chunkd/chunkd.sock``, then ``./chunkd.sock``, the first that answers.
        timeout: seconds to wait for the daemon: for an answer to one request, and
            for it to come back after the connection broke.
        cache_bytes: budget of the client's own cache of chunk mappings (0: none).

    Raises:
        DaemonUnavailableError: no daemon answers on any of the sockets tried.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        timeout: float = 30.0,
        cache_bytes: int = 1 << 30,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds; got {timeout!r}")
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0; got {cache_bytes!r}")
        self.timeout = float(timeout)
        self._socket_arg = None if socket_path is None else Path(os.fspath(socket_path))
        self._io_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._path: Path | None = None
        self._hello: dict[str, Any] = {}
        self._next_id = 0
        self._closed = False
        self._chunks = _ChunkLRU(cache_bytes, _chunk_budget())
        self._known: OrderedDict[str, _Known] = OrderedDict()
        with self._io_lock:
            self._connect()
        _CLIENTS.add(self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"socket={str(self._path)!r}"
        return f"<chunkd Client {state}>"

    @property
    def socket_path(self) -> Path | None:
        """The socket of the daemon last connected to."""
        return self._path

    @property
    def daemon(self) -> str:
        """The daemon's name and version as it said hello (``"chunkd 0.1.0"``)."""
        return str(self._hello.get("daemon", "chunkd"))

    @property
    def chunk_bytes(self) -> int:
        """The daemon's chunk size as it said hello (objects may have their own)."""
        return int(self._hello["chunk_bytes"])

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def request(
        self,
        op: str,
        fields: dict[str, Any] | None = None,
        *,
        fds: list[int] | None = None,
        timeout: float | None = None,
        what: str | None = None,
    ) -> Reply:
        """Send one request of the local protocol and return its successful answer.

        The header is built from :data:`chunkd.client.protocol.OPS` (fields that are
        None are left out); the connection is the client's, reconnected (with
        backoff) and the request sent once more when it broke.

        Args:
            op: the op, for example ``"ckpt_manifest"``.
            fields: the request's fields, by name.
            fds: fds to send with it (the caller keeps and closes them).
            timeout: seconds to wait for this answer instead of the client's
                ``timeout`` (for an op the daemon may hold long).
            what: what the request does, for error messages (``"saving NAME"``).

        Raises:
            InvalidRequestError: a field the op does not take, or out of its bounds.
            ChunkdError: the error answer's class (see :mod:`chunkd.errors`).
            DaemonUnavailableError: no daemon answered in time.
        """
        header = protocol.request_header(op, fields)
        reply, payload, got = self._request(header, what or f"a {op} request", fds, timeout=timeout)
        return Reply(reply, payload, got)

    # -- public operations -------------------------------------------------------------

    def read(self, name: str, offset: int = 0, length: int | None = None) -> memoryview:
        """Read bytes of an object as a read-only view, without a copy where possible.

        The view stays valid as long as it is referenced, whatever happens to the
        client, its cache or the daemon afterwards.

        Args:
            name: the object, ``BACKEND/KEY``.
            offset: the first byte.
            length: how many bytes; None (or past the end): up to the end.

        Returns:
            A read-only ``memoryview`` of format ``"B"``.

        Raises:
            ObjectNotFoundError: the object does not exist.
            UnknownBackendError: no backend of that name is configured.
            InvalidKeyError: the name is not a key chunkd looks up.
            ChunkdError: the daemon refused the read (e.g. ``offset`` past the end).
            DaemonUnavailableError: the daemon did not answer.
        """
        hit = self._hit(name, offset, length)
        if hit is not None:
            return hit
        return self._locate(name, offset, length).view()

    def _hit(self, name: str, offset: int, length: int | None) -> memoryview | None:
        """The fast path: a fresh name, a range inside one mapped chunk; else None.

        No system call and no allocation beyond the view: this is what makes small
        random reads cheaper than a ``pread``.
        """
        if length is None or length <= 0 or offset < 0:
            return None
        with self._state_lock:
            known = self._known.get(name)
            if known is None or self._closed:
                return None
            if known.revalidate is not None and not known.fresh(time.monotonic()):
                return None
            step = known.chunk_bytes
            index, start = divmod(offset, step)
            stop = start + length
            if stop > step or offset + length > known.size:
                return None
            chunk_id = known.chunks.get(index)
            chunk = self._chunks.get(chunk_id) if chunk_id is not None else None
        if chunk is None or stop > chunk.size:
            return None
        return chunk.view(start, stop)

    def read_into(self, name: str, buf: WriteableBuffer, offset: int = 0) -> int:
        """Copy bytes of an object into a writable buffer (e.g. a pinned tensor's memory).

        Args:
            name: the object, ``BACKEND/KEY``.
            buf: any writable, C-contiguous buffer; it is filled from its start.
            offset: the object's byte that lands at ``buf[0]``.

        Returns:
            Bytes copied: ``len(buf)`` in bytes, or fewer where the object ends first.

        Raises:
            TypeError: ``buf`` is read-only.
            ObjectNotFoundError, UnknownBackendError, InvalidKeyError, ChunkdError,
            DaemonUnavailableError: as for :meth:`read`.
        """
        target = _byte_target(buf)
        return self._locate(name, offset, len(target)).copy_into(target)

    def stat(self, name: str) -> ObjectStat:
        """Size, version and chunking of an object (from the client cache while fresh).

        Raises:
            ObjectNotFoundError, UnknownBackendError, InvalidKeyError,
            DaemonUnavailableError: as for :meth:`read`.
        """
        known = self._fresh(name)
        if known is None:
            known = self._stat_remote(name)
        return known.stat(name)

    def open(self, name: str) -> ChunkdFile:
        """A read-only, seekable file over one version of an object.

        Raises:
            ObjectNotFoundError, UnknownBackendError, InvalidKeyError,
            DaemonUnavailableError: as for :meth:`read`.
        """
        return ChunkdFile(self, self.stat(name))

    def prefetch(self, names: Iterable[str]) -> int:
        """Ask the daemon to load objects into its cache; it does so in the background.

        Args:
            names: objects, ``BACKEND/KEY`` (a single string is one name).

        Returns:
            How many loads the daemon started.
        """
        batch: list[str] = []
        started = 0
        budget = 0
        for name in [names] if isinstance(names, str) else names:
            cost = _json_bytes(name) + 1
            if batch and budget + cost > _PREFETCH_HEADER_BYTES:
                started += self._prefetch(batch)
                batch, budget = [], 0
            batch.append(name)
            budget += cost
        if batch:
            started += self._prefetch(batch)
        return started

    def ls(self, prefix: str, *, recursive: bool = False) -> list[dict[str, Any]]:
        """Entries under ``BACKEND`` or ``BACKEND/PREFIX``, all of them, in key order.

        Each is ``{"name": "BACKEND/KEY", "type": "file", "size": N, "version": V,
        "modified": T}`` or ``{"name": "BACKEND/DIR", "type": "directory"}``: one
        level, or every object below when ``recursive``. The listing is read page by
        page; :meth:`iter_ls` yields it without holding it all.
        """
        return list(self.iter_ls(prefix, recursive=recursive))

    def iter_ls(
        self,
        prefix: str,
        *,
        recursive: bool = False,
        start_after: str | None = None,
        page: int = protocol.LIST_PAGE,
    ) -> Iterator[dict[str, Any]]:
        """The entries of :meth:`ls`, one page of ``page`` entries in memory at a time.

        ``start_after``: a page token (or any key of the backend) to resume after.
        """
        token = start_after
        while True:
            entries, token = self.ls_page(
                prefix, recursive=recursive, start_after=token, limit=page
            )
            yield from entries
            if token is None:
                return

    def ls_page(
        self,
        prefix: str,
        *,
        recursive: bool = False,
        start_after: str | None = None,
        limit: int | None = None,
    ) -> tuple[list[dict[str, Any]], str | None]:
        """One page of a listing: its entries and the token of the next (None: the last).

        Give the token back as ``start_after`` for the next page; the protocol's
        ``list`` op says what it is (a key of the backend).
        """
        request: dict[str, Any] = {"op": "list", "name": prefix, "recursive": recursive}
        if start_after is not None:
            request["start_after"] = start_after
        if limit is not None:
            request["limit"] = limit
        reply, payload, fds = self._request(request, f"a list of {prefix}")
        close_all(fds)
        try:
            page = json.loads(payload)
            backend = str(page["backend"])
            keys, sizes = page["keys"], page["sizes"]
            versions, modified = page["versions"], page["modified"]
            dirs = set(page["dirs"])
            entries = [
                {"name": f"{backend}/{key}", "type": "directory"}
                if i in dirs
                else {
                    "name": f"{backend}/{key}",
                    "type": "file",
                    "size": size,
                    "version": version,
                    "modified": when,
                }
                for i, (key, size, version, when) in enumerate(
                    zip(keys, sizes, versions, modified, strict=True)
                )
            ]
        except (ValueError, KeyError, TypeError) as exc:
            raise protocol.ProtocolError(
                f"the daemon's listing page of {prefix} is malformed: {exc}"
            ) from None
        if len(entries) != reply.get("count"):
            raise protocol.ProtocolError(
                f"the daemon's listing page of {prefix} holds {len(entries)} entries, "
                f"not the {reply.get('count')} it says"
            )
        token = reply.get("next")
        return entries, token if isinstance(token, str) else None

    def read_ranges(self, ranges: Iterable[tuple[str, int, int]]) -> list[bytes | ChunkdError]:
        """Several byte ranges ``(name, offset, length)`` as bytes, in few round trips.

        Small ranges go out together (``readv``: up to 256 ranges and 1 MiB a round
        trip); a large one is read as :meth:`read` does. A range past the end of its
        object comes back shorter (or empty); a range that fails comes back as its
        error, and the others are still read.
        """
        asked = list(ranges)
        out: list[bytearray | ChunkdError] = [bytearray() for _ in asked]
        todo: list[tuple[int, str, int, int]] = []
        for i, (name, offset, length) in enumerate(asked):
            _check_range(offset, length)
            if length > _READV_MAX:
                try:
                    out[i] = bytearray(self.read(name, offset, length))
                except ChunkdError as exc:
                    out[i] = exc
            elif length:
                todo.append((i, name, offset, length))
        versions: dict[int, str] = {}
        while todo:
            # As many ranges as the protocol takes, and as fit in half a frame's header.
            count, budget = 0, 0
            while count < min(len(todo), protocol.MAX_RANGES):
                budget += _json_bytes(todo[count][1]) + 48
                if count and budget > protocol.MAX_HEADER // 2:
                    break
                count += 1
            batch, todo = todo[:count], todo[count:]
            request = {"op": "readv", "ranges": [[n, o, ln] for _, n, o, ln in batch]}
            reply, payload, fds = self._request(request, f"{len(batch)} ranges")
            close_all(fds)
            answered = int(reply.get("answered", 0))
            if not 0 < answered <= len(batch):
                raise protocol.ProtocolError(
                    f"the daemon answered {answered} of {len(batch)} ranges"
                )
            again = _take_ranges(batch, reply["ranges"][:answered], payload, out, versions)
            todo = again + batch[answered:] + todo
        return [bytes(r) if isinstance(r, bytearray) else r for r in out]

    def cache_info(self) -> CacheInfo:
        """What the client's own cache holds now."""
        with self._state_lock:
            return CacheInfo(
                len(self._chunks),
                self._chunks.nbytes,
                self._chunks.max_bytes,
                self._chunks.max_chunks,
                len(self._known),
            )

    def close(self) -> None:
        """Close the connection and drop the cache; views already handed out stay valid."""
        with self._io_lock:
            self._closed = True
            self._disconnect()
        with self._state_lock:
            self._chunks.clear()
            self._known.clear()
        _CLIENTS.discard(self)

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- locating a range: the cache first, then the daemon ---------------------------

    def _locate(self, name: str, offset: int, length: int | None) -> _Located:
        _check_range(offset, length)
        located = self._from_cache(name, offset, length, time.monotonic())
        if located is None and self._from_cache(name, offset, length, None) is not None:
            # Everything is mapped but the name is stale: a stat is cheaper than a read.
            self._stat_remote(name)
            located = self._from_cache(name, offset, length, time.monotonic())
        if located is None:
            located = self._read_remote(name, offset, length)
        return located

    def _from_cache(
        self, name: str, offset: int, length: int | None, now: float | None
    ) -> _Located | None:
        """The range from cached mappings alone, or None (``now`` None: even if stale)."""
        with self._state_lock:
            self._check_open()
            known = self._known.get(name)
            if known is None or (now is not None and not known.fresh(now)):
                return None
            size, step = known.size, known.chunk_bytes
            end = size if length is None else min(size, offset + length)
            # Leave what the daemon refuses (reads past the end) to the daemon.
            if offset > size or (offset == size and size and length != 0):
                return None
            pieces: list[_Span | memoryview] = []
            for index in range(offset // step, -(-end // step)):
                chunk_id = known.chunks.get(index)
                chunk = self._chunks.get(chunk_id) if chunk_id is not None else None
                base = index * step
                if chunk is None or chunk.size != min(step, size - base):
                    return None
                pieces.append(_Span(chunk, max(offset, base) - base, min(end, base + step) - base))
            return _Located(name, known.version, size, max(0, end - offset), pieces)

    def _read_remote(self, name: str, offset: int, length: int | None) -> _Located:
        for _ in range(_VERSION_RETRIES):
            located = self._read_version(name, offset, length)
            if located is not None:
                return located
        raise VersionChangedError(
            f"{name} changed {_VERSION_RETRIES} times while it was being read; "
            "read it again once it stops changing"
        )

    def _read_version(self, name: str, offset: int, length: int | None) -> _Located | None:
        """Read a range with as many requests as its chunk count needs; None if the
        object changed between them."""
        pieces: list[_Span | memoryview] = []
        version: str | None = None
        size = end = -1
        position = offset
        while True:
            ask_offset, ask_length = self._plan(name, offset, position, length, end)
            asked = time.monotonic()
            reply, payload, fds = self._request(
                {
                    "op": "read",
                    "name": name,
                    "offset": ask_offset,
                    "length": ask_length,
                    # Small reads come as fds too: a mapped chunk answers the next
                    # reads inside it with no round trip at all.
                    "inline": False,
                },
                f"a read of {name}",
            )
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
                return _Located(name, version, size, max(0, end - offset), pieces)
            if got <= position:
                raise protocol.ProtocolError(
                    f"the daemon answered a read of {name} at byte {position} with no bytes"
                )
            position = got

    def _plan(
        self, name: str, offset: int, position: int, length: int | None, end: int
    ) -> tuple[int, int | None]:
        """The next request's (offset, length): at most MAX_FDS chunks, none tiny."""
        with self._state_lock:
            known = self._known.get(name)
            step = known.chunk_bytes if known else int(self._hello.get("chunk_bytes") or 0)
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
        pieces: list[_Span | memoryview],
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
            pieces.append(_Span(chunk, max(start, position - base), stop))
            position = base + stop
        return position

    def _step(self, name: str) -> int:
        with self._state_lock:
            known = self._known.get(name)
            return known.chunk_bytes if known else int(self._hello["chunk_bytes"])

    def _adopt(self, chunk_id: str, size: int, fd: int) -> _Chunk:
        """The chunk ``fd`` holds: the cached one (closing ``fd``) or a new one that owns it."""
        try:
            with self._state_lock:
                cached = self._chunks.get(chunk_id)
            if cached is not None and cached.size == size:
                os.close(fd)
                return cached
            _check_chunk_fd(chunk_id, size, fd)
        except BaseException:
            os.close(fd)
            raise
        chunk = _Chunk(chunk_id, size, fd)
        with self._state_lock:
            self._chunks.put(chunk)
        return chunk

    # -- what the client knows of names ------------------------------------------------

    def _fresh(self, name: str) -> _Known | None:
        with self._state_lock:
            self._check_open()
            known = self._known.get(name)
            return known if known is not None and known.fresh(time.monotonic()) else None

    def _stat_remote(self, name: str) -> _Known:
        asked = time.monotonic()
        reply, _, fds = self._request({"op": "stat", "name": name}, f"a stat of {name}")
        close_all(fds)
        return self._learn(name, reply, asked)

    def _learn(self, name: str, reply: dict[str, Any], asked: float) -> _Known:
        """Record what an answer says of ``name``; ``asked``: when the request went out."""
        try:
            size, version = int(reply["size"]), str(reply["version"])
            chunk_bytes = int(reply.get("chunk_bytes") or self._hello["chunk_bytes"])
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
        with self._state_lock:
            known = self._known.get(name)
            if known is None or (known.version, known.size, known.chunk_bytes) != (
                version,
                size,
                chunk_bytes,
            ):
                known = _Known(size, version, chunk_bytes, revalidate, asked, modified=modified)
                self._known[name] = known
            else:
                known.revalidate, known.learned = revalidate, max(known.learned, asked)
                known.modified = modified if modified is not None else known.modified
            self._known.move_to_end(name)
            while len(self._known) > _KNOWN_NAMES:
                self._known.popitem(last=False)
            known.chunks.update(spans)
            return known

    def _prefetch(self, names: list[str]) -> int:
        reply, _, fds = self._request({"op": "prefetch", "names": names}, "a prefetch")
        close_all(fds)
        return int(reply.get("started", 0))

    # -- the connection ----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError("this chunkd Client is closed; create a new one")

    def _candidates(self) -> list[Path]:
        if self._socket_arg is not None:
            return [self._socket_arg]
        paths = protocol.default_socket_paths()
        if self._path in paths:  # after a break, the daemon we had comes first
            paths.remove(self._path)
            paths.insert(0, self._path)
        return paths

    def _connect(self) -> None:
        """Connect to the first socket whose daemon says hello (under the io lock)."""
        tried: list[str] = []
        for path in self._candidates():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(os.fspath(path))
                self._next_id += 1
                hello_request = protocol.request_header("hello", {"version": protocol.VERSION})
                protocol.send_frame(sock, hello_request | {"id": self._next_id})
                hello, _, fds = protocol.recv_frame(sock)
                close_all(fds)
            except (OSError, protocol.ProtocolError) as exc:
                sock.close()
                reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
                if isinstance(exc, PermissionError):
                    reason += "; join the group that owns it (server.socket_group)"
                tried.append(f"{os.path.abspath(path)} ({reason})")
                continue
            if not hello.get("ok"):
                sock.close()
                raise _error_from(hello, "hello")
            if hello.get("version") != protocol.VERSION:
                sock.close()
                raise ChunkdError(
                    f"the chunkd daemon at {path} speaks local protocol version "
                    f"{hello.get('version')!r}; this client speaks {protocol.VERSION}; "
                    "install the same chunkd version for both"
                )
            self._sock, self._path, self._hello = sock, path, hello
            return
        hint = (
            "pass the socket_path the daemon serves (server.socket in its config)"
            if self._socket_arg is not None
            else "set CHUNKD_SOCKET to the socket of a running daemon"
        )
        raise DaemonUnavailableError(
            f"no chunkd daemon answered on {', '.join(tried)}; start one on this node "
            f"with `chunkd serve` (or `make run` in a chunkd checkout), or {hint}"
        )

    def _reconnect(self) -> None:
        """Connect again, with backoff, for up to ``timeout`` seconds (under the io lock)."""
        delays = _RECONNECT.delays(deadline=time.monotonic() + self.timeout)
        while True:
            try:
                self._connect()
            except DaemonUnavailableError as exc:
                delay = next(delays, None)
                if delay is None:
                    raise DaemonUnavailableError(
                        f"lost the connection to the chunkd daemon and none came back "
                        f"within {self.timeout:g}s: {exc}"
                    ) from None
                time.sleep(delay)
            else:
                return

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _after_fork(self) -> None:
        """In a forked child: fresh locks and a connection of its own on first use."""
        self._io_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._disconnect()  # closes only the child's copy of the socket

    def _exchange(
        self,
        header: dict[str, Any],
        send_fds: list[int] | None = None,
        timeout: float | None = None,
    ) -> tuple[dict[str, Any], bytes, list[int]]:
        """One round trip on the connection (under the io lock)."""
        assert self._sock is not None
        self._next_id += 1
        request = protocol.request_header(header["op"], _fields_of(header)) | {"id": self._next_id}
        protocol.send_frame(self._sock, request, fds=send_fds)
        if timeout is not None:
            self._sock.settimeout(timeout)
        try:
            reply, payload, fds = protocol.recv_frame(self._sock)
        finally:
            if timeout is not None and self._sock is not None:
                self._sock.settimeout(self.timeout)
        if reply.get("id") != request["id"]:
            close_all(fds)
            raise protocol.ProtocolError(
                f"answer {reply.get('id')!r} came for request {request['id']}"
            )
        return reply, payload, fds

    def _request(
        self,
        header: dict[str, Any],
        what: str,
        send_fds: list[int] | None = None,
        *,
        timeout: float | None = None,
    ) -> tuple[dict[str, Any], bytes, list[int]]:
        """Send a request and return its successful answer; the caller owns the fds.

        ``send_fds`` go with the request (the caller keeps and closes them);
        ``timeout`` replaces the client's for this answer (a long daemon-side wait). A broken
        connection is reconnected (with backoff) and the request sent once more. An
        error answer raises its :mod:`chunkd.errors` class.
        """
        with self._io_lock:
            self._check_open()
            for attempt in range(2):
                if self._sock is None:
                    self._reconnect()
                try:
                    reply, payload, fds = self._exchange(header, send_fds, timeout)
                except TimeoutError:
                    self._disconnect()
                    raise DaemonUnavailableError(
                        f"the chunkd daemon at {self._path} did not answer {what} within "
                        f"{timeout or self.timeout:g}s; it may be overloaded (raise "
                        "Client(timeout=...))"
                    ) from None
                except protocol.ProtocolError:
                    self._disconnect()
                    raise
                except OSError as exc:  # reset, broken pipe, EOF: the daemon went away
                    self._disconnect()
                    if attempt:
                        raise DaemonUnavailableError(
                            f"the chunkd daemon at {self._path} dropped {what} twice: {exc}"
                        ) from exc
                    log.info("chunkd connection lost (%s); reconnecting", exc)
                    continue
                except BaseException:
                    # Interrupted mid-exchange (KeyboardInterrupt, ...): the answer may
                    # still come, so this connection cannot carry the next request.
                    self._disconnect()
                    raise
                break
        if not reply.get("ok"):
            close_all(fds)
            raise _error_from(reply, what)
        return reply, payload, fds


def _byte_target(buf: WriteableBuffer) -> memoryview:
    target = memoryview(buf)
    if target.readonly:
        raise TypeError("read_into needs a writable buffer; got a read-only one")
    if target.format != "B" or target.ndim != 1:
        target = target.cast("B")
    return target


# -- files -------------------------------------------------------------------------------


class ChunkdFile(io.RawIOBase):
    """A read-only, seekable file over one version of an object (``Client.open``).

    Suits ``io.BufferedReader`` and ``pyarrow.PythonFile``. Every read goes through
    the client (and its cache). The file is pinned to the version it was opened
    on: if the object changes, a read raises :class:`~chunkd.errors.VersionChangedError`
    rather than mix two versions.
    """

    def __init__(self, client: Client, stat: ObjectStat) -> None:
        super().__init__()
        self._client = client
        self._stat = stat
        self._position = 0

    def __repr__(self) -> str:
        return f"<ChunkdFile {self.name!r} size={self.size}>"

    @property
    def name(self) -> str:
        """The object, ``BACKEND/KEY``."""
        return self._stat.name

    @property
    def mode(self) -> str:
        """Always ``"rb"``."""
        return "rb"

    @property
    def size(self) -> int:
        """Bytes in the object version this file reads."""
        return self._stat.size

    @property
    def version(self) -> str:
        """The object version this file reads."""
        return self._stat.version

    def readable(self) -> bool:
        self._checkClosed()
        return True

    def seekable(self) -> bool:
        self._checkClosed()
        return True

    def tell(self) -> int:
        self._checkClosed()
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._checkClosed()
        if whence == io.SEEK_SET:
            position = offset
        elif whence == io.SEEK_CUR:
            position = self._position + offset
        elif whence == io.SEEK_END:
            position = self.size + offset
        else:
            raise ValueError(f"whence must be 0, 1 or 2; got {whence!r}")
        if position < 0:
            raise ValueError(f"cannot seek to {position}, before the start of {self.name}")
        self._position = position
        return position

    def readinto(self, buffer: WriteableBuffer) -> int:
        self._checkClosed()
        target = _byte_target(buffer)
        n = min(len(target), self.size - self._position)
        if n <= 0:
            return 0
        copied = self._located(n).copy_into(target)
        self._position += copied
        return copied

    def read(self, size: int | None = -1) -> bytes:
        self._checkClosed()
        left = self.size - self._position
        n = left if size is None or size < 0 else min(size, left)
        if n <= 0:
            return b""
        data = self._located(n).to_bytes()
        self._position += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def _located(self, n: int) -> _Located:
        located = self._client._locate(self.name, self._position, n)
        if located.version != self.version:
            raise VersionChangedError(
                f"{self.name} changed from version {self.version} to {located.version} "
                "while it was open; open it again to read the new version"
            )
        return located


# -- asyncio -----------------------------------------------------------------------------


class AsyncClient:
    """The :class:`Client` API as coroutines.

    v1 runs each call that needs the daemon on a worker thread with
    :func:`asyncio.to_thread`, over one sync :class:`Client` (one request on its
    connection at a time). Reads and stats that the client cache answers run on the
    event loop and never hop threads; only a cache hit that :meth:`read_into` must copy
    and that is over 1 MiB is copied in a thread, so the loop does not stall.

    Connects on ``await connect()``, ``async with``, or the first call.

    Args:
        socket_path: as for :class:`Client`.
        timeout: as for :class:`Client`.
        cache_bytes: as for :class:`Client`.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        timeout: float = 30.0,
        cache_bytes: int = 1 << 30,
    ) -> None:
        self._args = (socket_path, timeout, cache_bytes)
        self._client: Client | None = None
        self._connecting: asyncio.Lock | None = None

    @classmethod
    def from_client(cls, client: Client) -> AsyncClient:
        """An async face over an already connected :class:`Client` (shares its cache)."""
        self = cls()
        self._client = client
        return self

    @property
    def client(self) -> Client:
        """The sync client underneath.

        Raises:
            RuntimeError: not connected yet.
        """
        if self._client is None:
            raise RuntimeError("the AsyncClient is not connected yet; await connect() first")
        return self._client

    async def connect(self) -> AsyncClient:
        """Connect (once); return the client.

        Raises:
            DaemonUnavailableError: no daemon answers.
        """
        if self._client is None:
            if self._connecting is None:
                self._connecting = asyncio.Lock()
            async with self._connecting:
                if self._client is None:
                    path, timeout, cache_bytes = self._args
                    self._client = await asyncio.to_thread(
                        Client, path, timeout=timeout, cache_bytes=cache_bytes
                    )
        return self

    async def _sync(self) -> Client:
        if self._client is None:
            await self.connect()
        assert self._client is not None
        return self._client

    async def read(self, name: str, offset: int = 0, length: int | None = None) -> memoryview:
        """See :meth:`Client.read`."""
        client = await self._sync()
        _check_range(offset, length)
        located = client._from_cache(name, offset, length, time.monotonic())
        if located is not None:
            return located.view()
        return await asyncio.to_thread(client.read, name, offset, length)

    async def read_into(self, name: str, buf: WriteableBuffer, offset: int = 0) -> int:
        """See :meth:`Client.read_into`."""
        client = await self._sync()
        target = _byte_target(buf)
        _check_range(offset, None)
        located = client._from_cache(name, offset, len(target), time.monotonic())
        if located is None:
            return await asyncio.to_thread(client.read_into, name, target, offset)
        if located.length <= _LOOP_COPY_BYTES:
            return located.copy_into(target)
        return await asyncio.to_thread(located.copy_into, target)

    async def stat(self, name: str) -> ObjectStat:
        """See :meth:`Client.stat`."""
        client = await self._sync()
        known = client._fresh(name)
        if known is not None:
            return known.stat(name)
        return await asyncio.to_thread(client.stat, name)

    async def open(self, name: str) -> ChunkdFile:
        """See :meth:`Client.open`. The file's own methods are blocking (sync) calls."""
        return ChunkdFile(await self._sync(), await self.stat(name))

    async def prefetch(self, names: Iterable[str]) -> int:
        """See :meth:`Client.prefetch`."""
        client = await self._sync()
        listed = [names] if isinstance(names, str) else list(names)
        return await asyncio.to_thread(client.prefetch, listed)

    async def ls(self, prefix: str, *, recursive: bool = False) -> list[dict[str, Any]]:
        """See :meth:`Client.ls`."""
        client = await self._sync()
        return await asyncio.to_thread(client.ls, prefix, recursive=recursive)

    async def ls_page(
        self,
        prefix: str,
        *,
        recursive: bool = False,
        start_after: str | None = None,
        limit: int | None = None,
    ) -> tuple[list[dict[str, Any]], str | None]:
        """See :meth:`Client.ls_page`."""
        client = await self._sync()
        return await asyncio.to_thread(
            client.ls_page, prefix, recursive=recursive, start_after=start_after, limit=limit
        )

    async def read_ranges(
        self, ranges: Iterable[tuple[str, int, int]]
    ) -> list[bytes | ChunkdError]:
        """See :meth:`Client.read_ranges`."""
        client = await self._sync()
        return await asyncio.to_thread(client.read_ranges, list(ranges))

    def cache_info(self) -> CacheInfo:
        """See :meth:`Client.cache_info`."""
        return self.client.cache_info()

    async def close(self) -> None:
        """See :meth:`Client.close`."""
        if self._client is not None:
            self._client.close()

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


# -- array helpers -----------------------------------------------------------------------


def as_numpy(view: memoryview, dtype: DTypeLike = "uint8") -> ndarray[Any, Any]:
    """A numpy array over a view from :meth:`Client.read`, without a copy.

    The array is read-only, like the view, and keeps the view's mapping alive.
    numpy is imported here, on first use.

    Raises:
        ValueError: the view's length is not a multiple of the dtype's size.
    """
    import numpy

    return numpy.frombuffer(view, dtype=dtype)
