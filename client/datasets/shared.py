"""Units decoded once per node, by the daemon: :class:`SharedDecoder` (docs/decoding.md).

A reader asks the daemon for a unit with ``ds_decode``, naming every input of the
decoded entry's key (the format and its decoder version, the member record, the unit,
the columns, the source). The daemon decodes it in its own worker processes, once per
node, and answers with a sealed memfd of the table as an Arrow IPC file; the reader maps
it read-only and opens it without a copy. Where the daemon does not decode (its pool is
off or full, another decoder version, an older daemon, a source it cannot read), the
reader decodes in-process and says so with :meth:`SharedDecoder.local`.

Each decoder keeps connections of its own to the daemon (at most
:data:`MAX_CONNECTIONS`, made as they are needed): a decode can take as long as the
unit does, and the client's own connection would carry nothing else meanwhile.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import mmap
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Final

from chunkd.client.connection import Connection
from chunkd.client.datasets.frozen import FrozenSource
from chunkd.client.datasets.source import PinnedSource
from chunkd.client.protocol import MAX_HEADER
from chunkd.client.protocol.ops import (
    MAX_DECODE_CHUNKS,
    MAX_DECODE_COLUMNS,
    MAX_DECODE_META,
    OPS,
)
from chunkd.errors import ChunkdError, DatasetFormatError, SnapshotDriftError
from chunkd.memfd import close_all, sealed_size

if TYPE_CHECKING:
    from chunkd.client.core import Client
    from chunkd.client.datasets.formats import Format
    from chunkd.client.datasets.source import Source
    from chunkd.snapshot import Member

__all__ = ["MAX_CONNECTIONS", "REPORT_INTERVAL", "SharedDecoder"]

log = logging.getLogger("chunkd.datasets.shared")

#: connections one decoder opens to the daemon at most (requests beyond wait for one)
MAX_CONNECTIONS: Final = 8
#: the least time between two reports of in-process decodes (``ds_decode_report``)
REPORT_INTERVAL: Final = 1.0
#: after the daemon said it decodes nothing (off, an older daemon), ask again after this
_RETRY_OFF: Final = 30.0
#: what a request's header may take, leaving room for the frame's own fields
_HEADER_ROOM: Final = MAX_HEADER - 1024
#: errors of a decode that the reader gets as they are (decoding it itself would fail too)
_RAISED: Final = (DatasetFormatError, SnapshotDriftError)


class SharedDecoder:
    """Units decoded by the node's daemon, mapped zero-copy (see the module docstring).

    Safe to use from several threads; a forked child opens connections of its own.

    Args:
        client: the node's daemon (its socket and timeout are used).
    """

    def __init__(self, client: Client) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._idle: list[Connection] = []
        self._off_until = 0.0
        self._pending = 0
        self._reported = time.monotonic()
        _DECODERS.add(self)
        # A decoder dropped unclosed closes its connections (each is a socket).
        self._finalizer = weakref.finalize(self, _close_connections, self._idle)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        _close_connections(self._idle)  # the child's copies of the parent's sockets

    def unit(
        self,
        source: Source,
        member: Member,
        fmt: Format,
        unit: int,
        columns: tuple[str, ...] | None,
    ) -> Any | None:
        """Unit ``unit`` of ``member`` decoded by the daemon (one flight per key per
        node), mapped zero-copy from its sealed memfd, as a ``pyarrow.Table``; None
        where the daemon does not decode it (its pool is off or full, an older daemon,
        another decoder version, a source it cannot read): the caller then decodes
        in-process and calls :meth:`local`.

        Raises:
            DatasetFormatError: the unit's bytes are not what was registered, or a column
                asked for is not the member's.
            SnapshotDriftError: the member's object changed since it was registered.
        """
        if time.monotonic() < self._off_until:
            return None
        fields = _request(source, member, fmt, unit, columns)
        if fields is None:
            return None
        try:
            reply, fds = self._ask("ds_decode", fields, f"decoding unit {unit} of {member.key}")
        except _RAISED:
            raise
        except ChunkdError as exc:
            if "unknown op" in str(exc):  # a daemon older than ds_decode
                self._off_until = time.monotonic() + _RETRY_OFF
            log.debug("the daemon did not decode unit %d of %s: %s", unit, member.key, exc)
            return None
        try:
            if not reply.get("decoded"):
                if reply.get("reason") == "off":
                    self._off_until = time.monotonic() + _RETRY_OFF
                return None
            return _mapped(reply, fds, columns, fmt.units(member)[unit])
        finally:
            close_all(fds)

    def local(self, decodes: int = 1) -> None:
        """Count in-process decodes for the daemon's metrics (batched: at most one small
        request a second, never one per decode; never raises)."""
        try:
            with self._lock:
                self._pending += max(0, int(decodes))
                now = time.monotonic()
                if not self._pending or now - self._reported < REPORT_INTERVAL:
                    return
                pending, self._pending, self._reported = self._pending, 0, now
            self._ask("ds_decode_report", {"decodes": pending}, "reporting in-process decodes")
        except Exception as exc:  # a hint: lost rather than raised
            log.debug("in-process decodes not reported: %s", exc)

    def close(self) -> None:
        """Close the decoder's connections (the client stays open)."""
        with self._lock:
            _close_connections(self._idle)

    def _ask(self, op: str, fields: dict[str, Any], what: str) -> tuple[dict[str, Any], list[int]]:
        with self._slots:
            with self._lock:
                connection = self._idle.pop() if self._idle else None
            if connection is None:
                connection = Connection(
                    self.client.socket_path, self.client.timeout, self.client.train_job
                )
            try:
                reply, _, fds = connection.request({"op": op, **fields}, what)
            except BaseException:
                connection.close()
                raise
            with self._lock:
                self._idle.append(connection)
            return reply, fds


#: every decoder of the process: a forked child gives each fresh locks and connections
_DECODERS: weakref.WeakSet[SharedDecoder] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for decoder in list(_DECODERS):
        decoder._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_connections(connections: list[Connection]) -> None:
    """Close every connection of ``connections`` and empty it."""
    idle = list(connections)
    connections.clear()
    for connection in idle:
        with contextlib.suppress(Exception):
            connection.close()


def _request(
    source: Source, member: Member, fmt: Format, unit: int, columns: tuple[str, ...] | None
) -> dict[str, Any] | None:
    """The fields of a ``ds_decode`` request, or None where it cannot carry them (a
    source the daemon does not read, a meta or a chunk list over the bounds)."""
    fields: dict[str, Any]
    if isinstance(source, PinnedSource):
        fields = {"backend": source.backend}
    elif isinstance(source, FrozenSource):
        try:
            chunks = source.chunks_of(member)
        except KeyError:
            return None
        if len(chunks) > MAX_DECODE_CHUNKS:
            return None
        fields = {"registry": source.registry, "chunk_bytes": source.chunk_bytes, "chunks": chunks}
    else:
        return None
    if columns is not None and len(columns) > MAX_DECODE_COLUMNS:
        return None
    try:
        meta = json.dumps(dict(member.meta), sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return None
    if len(meta.encode()) > MAX_DECODE_META:
        return None
    fields |= {
        "format": fmt.name,
        "decoder": fmt.version,
        "key": member.key,
        "size": member.size,
        "version": member.version,
        "samples": member.samples,
        "meta": meta,
        "unit": unit,
        "columns": None if columns is None else list(columns),
        "dataset": getattr(source, "dataset", None),  # whose cost the decode's reads are
    }
    try:
        OPS["ds_decode"].check(fields | {"op": "ds_decode"})
    except ChunkdError:
        return None
    if len(json.dumps(fields)) > _HEADER_ROOM:
        return None
    return fields


def _mapped(
    reply: dict[str, Any], fds: list[int], columns: tuple[str, ...] | None, rows: int
) -> Any | None:
    """The table of a ``ds_decode`` answer, mapped read-only; None where the answer is
    not what was asked for (``rows`` rows, the unit's count in the reader's own
    manifest, and the columns asked: the reader then decodes it itself)."""
    if len(fds) != 1:
        return None
    size = sealed_size(fds[0])
    if size is None or size != reply.get("bytes") or size <= 0:
        return None
    pa: Any = importlib.import_module("pyarrow")
    try:
        mapping = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ)
    except OSError as exc:  # out of address space, a limit on mappings
        log.warning("a decoded unit from the daemon cannot be mapped (%s); decoding it here", exc)
        return None
    try:
        table = pa.ipc.open_file(pa.py_buffer(mapping)).read_all()
    except (pa.ArrowException, OSError, ValueError) as exc:
        log.warning("a decoded unit from the daemon does not open (%s); decoding it here", exc)
        with contextlib.suppress(BufferError):
            mapping.close()
        return None
    asked = reply.get("columns") if columns is None else list(columns)
    if table.num_rows != reply.get("rows") or table.num_rows != rows or table.column_names != asked:
        log.warning(
            "a decoded unit from the daemon is not the one asked for (%d rows, columns %s); "
            "decoding it here",
            table.num_rows,
            table.column_names[:8],
        )
        return None
    return table
