"""The trainer-side client of the node's chunkd daemon: :class:`Client`.

:class:`Client` speaks :mod:`chunkd.client.protocol` over the daemon's Unix socket and
hands out **read-only, zero-copy** views of object bytes. It imports nothing but the
standard library (numpy only inside :func:`~chunkd.client.views.as_numpy`), and never
the daemon's code. Its parts live beside it:

- :mod:`chunkd.client.views`: reads as views of the sealed chunk memfds the daemon
  sends, one contiguous view over several chunks (or a copy where that fails).
- :mod:`chunkd.client.reader`: the client cache (chunk mappings and what it learned
  of each name), and reads of what it does not hold from the daemon.
- :mod:`chunkd.client.connection`: finding the daemon, reconnecting with backoff, and
  a connection of its own in a forked child.
- :mod:`chunkd.client.results`: :class:`Reply`, :class:`ObjectStat`, :class:`CacheInfo`.
- :mod:`chunkd.client.files` (:class:`~chunkd.client.files.ChunkdFile`) and
  :mod:`chunkd.client.aio` (:class:`~chunkd.client.aio.AsyncClient`) build on it.

Reads
    The daemon answers a small read inline (the bytes in the frame) and any other
    read with one sealed memfd per chunk (SCM_RIGHTS), which the client maps
    read-only. A range inside one chunk is a view into that chunk's mapping; a range
    over several chunks is still one contiguous view. A read whose chunks the client
    cache holds makes no round trip while the name is fresh. Mappings and views stay
    valid across daemon restarts, whatever happens to the client afterwards.

Connection
    ``Client()`` connects to the first socket that answers ``hello``: the
    ``socket_path`` argument, else ``$CHUNKD_SOCKET``, ``/run/chunkd/chunkd.sock``,
    ``./chunkd.sock``. When the connection breaks (the daemon restarted), the next
    request reconnects with backoff for up to ``timeout`` seconds and is sent again:
    every operation is idempotent. A request the daemon does not answer within
    ``timeout`` seconds raises :class:`DaemonUnavailableError`.

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

It is one job at ~600 lines: the :class:`Client` door, whose every public operation
turns its arguments into requests of the protocol and the answers into values (reads,
stats, a listing's pages, batched ``readv`` ranges, prefetches); the cache and the
mapping of chunks (:mod:`~chunkd.client.reader`, :mod:`~chunkd.client.views`), the
connection (:mod:`~chunkd.client.connection`) and the result types are the modules
above, and the client holds no state but the two parts it composes.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

from chunkd.client import protocol
from chunkd.client.connection import Connection
from chunkd.client.files import ChunkdFile
from chunkd.client.jobs import FOR_DATASET, job_name
from chunkd.client.reader import Reader, check_range
from chunkd.client.results import CacheInfo, ObjectStat, Reply
from chunkd.client.views import Located, byte_target
from chunkd.errors import ChunkdError, DaemonUnavailableError, VersionChangedError
from chunkd.memfd import close_all

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer
    from torch import Tensor

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_TIMEOUT",
    "CacheInfo",
    "Client",
    "DaemonUnavailableError",
    "ObjectStat",
    "Reply",
]

#: seconds a client waits for the daemon unless told (``Client(timeout=...)``)
DEFAULT_TIMEOUT: Final = 30.0
#: the client cache's budget unless told (``Client(cache_bytes=...)``): 1 GiB
DEFAULT_CACHE_BYTES: Final = 1 << 30

#: at most this much of a prefetch request's header is names
_PREFETCH_HEADER_BYTES: Final = protocol.MAX_HEADER // 2
#: ranges up to this size go in a readv; larger ones are read with fds
_READV_MAX: Final = 256 * 1024


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
            out[i] = protocol.error_of(got, f"a read of {name}")
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
        cache_chunks: the most chunks that cache holds (each holds an fd); None: a
            quarter of the process's fd limit. Give it where a process makes many
            clients (each would else count on that quarter alone).
        train_job: the job this client's work is accounted to (sent in its hello,
            and again on each reconnection); None: the first of ``$CHUNKD_JOB``,
            ``$SLURM_JOB_ID``, ``$TORCHELASTIC_RUN_ID`` and the Kubernetes pod's job
            label that is set (:func:`chunkd.client.job_name`), else no job. A claim
            for accounting, not an identity: the daemon records the uid beside it.

    Raises:
        ValueError: ``train_job`` is no job name (1 to 128 characters of
            ``A-Za-z0-9._:@/+-``, a letter or digit first; not ``other`` or ``none``).
        DaemonUnavailableError: no daemon answers on any of the sockets tried.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        cache_chunks: int | None = None,
        train_job: str | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds; got {timeout!r}")
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0; got {cache_bytes!r}")
        path = None if socket_path is None else Path(os.fspath(socket_path))
        self._connection = Connection(path, float(timeout), job_name(train_job))
        self._reader = Reader(self._connection, cache_bytes, cache_chunks)
        _CLIENTS.add(self)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"socket={str(self.socket_path)!r}"
        return f"<chunkd Client {state}>"

    @property
    def timeout(self) -> float:
        """Seconds to wait for the daemon: for an answer, and for it to come back."""
        return self._connection.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._connection.timeout = seconds

    @property
    def train_job(self) -> str | None:
        """The job this client's work is accounted to (its hello's ``train_job``)."""
        return self._connection.train_job

    @property
    def socket_path(self) -> Path | None:
        """The socket of the daemon last connected to."""
        return self._connection.path

    @property
    def daemon(self) -> str:
        """The daemon's name and version as it said hello (``"chunkd 0.1.0"``)."""
        return str(self._connection.hello.get("daemon", "chunkd"))

    @property
    def chunk_bytes(self) -> int:
        """The daemon's chunk size as it said hello (objects may have their own)."""
        return int(self._connection.hello["chunk_bytes"])

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._connection.closed

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
        header = {"op": op, **(fields or {})}  # checked against OPS by the connection, once
        reply, payload, got = self._request(header, what or f"a {op} request", fds, timeout=timeout)
        return Reply(reply, payload, got)

    # -- public operations -------------------------------------------------------------

    def read(
        self,
        name: str,
        offset: int = 0,
        length: int | None = None,
        *,
        version: str | None = None,
    ) -> memoryview:
        """Read bytes of an object as a read-only view, without a copy where possible.

        The view stays valid as long as it is referenced, whatever happens to the
        client, its cache or the daemon afterwards.

        Args:
            name: the object, ``BACKEND/KEY``.
            offset: the first byte.
            length: how many bytes; None: up to the end. A range that runs past the
                end is cut there; one that asks for bytes must start before the end
                (the rule of :mod:`chunkd.ranges`, as HTTP ``Range`` has it).
            version: the version token the bytes must be of (a pinned read); None:
                the current version, whatever it is.

        Returns:
            A read-only ``memoryview`` of format ``"B"``.

        Raises:
            ObjectNotFoundError: the object does not exist.
            UnknownBackendError: no backend of that name is configured.
            InvalidKeyError: the name is not a key chunkd looks up.
            RangeNotSatisfiableError: ``offset`` is at or past the end, and bytes were
                asked for (an empty object has no byte to start at).
            VersionChangedError: ``version`` was given, and the object is of another
                version now.
            ChunkdError: the daemon refused the read.
            DaemonUnavailableError: the daemon did not answer.
        """
        if version is None:
            hit = self._reader.hit(name, offset, length)
            if hit is not None:
                return hit
        located = self.locate(name, offset, length, version)
        if version is not None and located.version != version:
            raise VersionChangedError(
                f"{name} is at version {located.version!r}, not {version!r} as asked"
            )
        return located.view()

    def read_into(self, name: str, buf: WriteableBuffer | Tensor, offset: int = 0) -> int:
        """Copy bytes of an object into a writable buffer (e.g. a pinned tensor's memory).

        Each byte is copied once, from the chunk the daemon holds straight into
        ``buf`` (``preadv`` from the chunk's memfd, or from its mapping if the client
        already mapped it); a range of 32 MiB or more is copied by up to four threads
        (at most half the CPUs).
        A CPU torch tensor, pinned or not, is filled in its own memory: read into a
        pinned tensor, then ``tensor.to("cuda", non_blocking=True)``.

        Args:
            name: the object, ``BACKEND/KEY``.
            buf: any writable, C-contiguous buffer, or a contiguous CPU torch tensor;
                it is filled from its start, byte for byte (the object's bytes are
                taken as the tensor's raw bytes, whatever its dtype).
            offset: the object's byte that lands at ``buf[0]``.

        Returns:
            Bytes copied: ``len(buf)`` in bytes, or fewer where the object ends first.

        Raises:
            TypeError: ``buf`` is read-only, or a tensor on a device or not contiguous.
            ObjectNotFoundError, UnknownBackendError, InvalidKeyError, ChunkdError,
            DaemonUnavailableError: as for :meth:`read`.
        """
        target = byte_target(buf)
        return self.locate(name, offset, len(target)).copy_into(target)

    def stat(self, name: str) -> ObjectStat:
        """Size, version and chunking of an object (from the client cache while fresh).

        Raises:
            ObjectNotFoundError, UnknownBackendError, InvalidKeyError,
            DaemonUnavailableError: as for :meth:`read`.
        """
        known = self._reader.fresh(name)
        if known is None:
            known = self._reader.stat_remote(name)
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

    def prefetch_ranges(self, ranges: Iterable[tuple[str, int, int]]) -> int:
        """Ask the daemon to load the chunks that hold byte ranges, in the background.

        What a data loader calls for the samples of its next steps: only the chunks
        those samples lie in are loaded, not their whole objects.

        Args:
            ranges: ``(BACKEND/KEY, offset, length)`` each.

        Returns:
            How many loads the daemon started.
        """
        batch: list[list[Any]] = []
        started = 0
        budget = 0
        for name, offset, length in ranges:
            cost = _json_bytes(name) + 48
            if batch and (
                budget + cost > _PREFETCH_HEADER_BYTES or len(batch) >= protocol.MAX_PREFETCH_RANGES
            ):
                started += self._prefetch_request({"ranges": batch})
                batch, budget = [], 0
            batch.append([name, int(offset), int(length)])
            budget += cost
        if batch:
            started += self._prefetch_request({"ranges": batch})
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
        fresh: bool = False,
    ) -> Iterator[dict[str, Any]]:
        """The entries of :meth:`ls`, one page of ``page`` entries in memory at a time.

        ``start_after``: a page token (or any key of the backend) to resume after.
        ``fresh``: what the backend lists now, not a listing the daemon holds (it keeps
        listings for the backend's ``list_revalidate``).
        """
        token = start_after
        while True:
            entries, token = self.ls_page(
                prefix, recursive=recursive, start_after=token, limit=page, fresh=fresh
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
        fresh: bool = False,
    ) -> tuple[list[dict[str, Any]], str | None]:
        """One page of a listing: its entries and the token of the next (None: the last).

        Give the token back as ``start_after`` for the next page; the protocol's
        ``list`` op says what it is (a key of the backend). ``fresh``: as for
        :meth:`iter_ls`.
        """
        request: dict[str, Any] = {"op": "list", "name": prefix, "recursive": recursive}
        if fresh:
            request["fresh"] = True
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
        trip); a large one is read as :meth:`read` does. A range that runs past the
        end of its object comes back shorter; one that starts at or past the end
        comes back as :class:`RangeNotSatisfiableError`, as :meth:`read` raises it. A
        range that fails comes back as its error, and the others are still read.
        """
        asked = list(ranges)
        out: list[bytearray | ChunkdError] = [bytearray() for _ in asked]
        todo: list[tuple[int, str, int, int]] = []
        for i, (name, offset, length) in enumerate(asked):
            check_range(offset, length)
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
            request = {
                "op": "readv",
                "ranges": [[n, o, ln] for _, n, o, ln in batch],
                "dataset": FOR_DATASET.get(),
            }
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
        return self._reader.info()

    def close(self) -> None:
        """Close the connection and drop the cache; views already handed out stay valid."""
        self._connection.close()
        self._reader.clear()
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

    # -- the seams: the reader and the connection ---------------------------------------

    @property
    def reader(self) -> Reader:
        """The client's reader: its mapped chunks and what it knows of objects (what
        the file objects, the async client and the dataset sources read through)."""
        return self._reader

    def locate(
        self, name: str, offset: int, length: int | None, version: str | None = None
    ) -> Located:
        """Bytes ``offset .. offset + length`` of ``name`` (``length`` None: to its end)
        as the pieces that hold them, without a copy (what a :class:`ChunkdFile` and a
        dataset source read); ``version``: the version they must be of (the daemon
        re-checks one it doubts).

        Raises:
            ObjectNotFoundError, RangeNotSatisfiableError, VersionChangedError: as
                :meth:`read`.
        """
        return self._reader.locate(name, offset, length, version)

    def _prefetch(self, names: list[str]) -> int:
        return self._prefetch_request({"names": names})

    def _prefetch_request(self, fields: dict[str, Any]) -> int:
        request = {"op": "prefetch", **fields, "dataset": FOR_DATASET.get()}
        reply, _, fds = self._request(request, "a prefetch")
        close_all(fds)
        return int(reply.get("started", 0))

    def _after_fork(self) -> None:
        """In a forked child: fresh locks and a connection of its own on first use."""
        self._reader.after_fork()
        self._connection.after_fork()

    def _request(
        self,
        header: dict[str, Any],
        what: str,
        send_fds: list[int] | None = None,
        *,
        timeout: float | None = None,
    ) -> tuple[dict[str, Any], bytes, list[int]]:
        """Send a request and return its successful answer; the caller owns the fds.

        See :meth:`chunkd.client.connection.Connection.request`.
        """
        return self._connection.request(header, what, send_fds, timeout=timeout)
