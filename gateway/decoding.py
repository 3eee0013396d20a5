"""Decode once per node: the daemon's decoded dataset units (docs/decoding.md).

The readers of a node need the same units of a snapshot. The daemon decodes each once,
in its own decode workers (``python -m chunkd.client.datasets.decoder``, a
:class:`~chunkd.gateway.workerpool.WorkerPool`: processes outside the event loop,
clients of the local socket, each with an address-space limit and a timeout), and holds
the result as a sealed memfd of Arrow IPC that every reader maps. The daemon's process
never decodes, nor imports pyarrow.

A ``ds_decode`` request carries every input of its entry's **key**: the format and its
decoder version, the member record as the manifest holds it (key, size, version, samples,
format, meta), the unit, the projection (columns or null) and the source (a pinned
member's backend; a frozen member's chunk backend, chunk size and chunk ids). The daemon
computes the key itself: the blake3 of the canonical JSON of those inputs. It never takes
a digest from a client, so no reader can name an entry made from other bytes, by another
decoder version or with other columns:

* the bytes decoded are the ones the key names: a pinned member is read at its recorded
  version (a changed object is a ``SnapshotDriftError``, never a decode of other bytes),
  a frozen member's chunks by their ids, each verified by the daemon;
* the decoder version must be the one this daemon's workers run (else the request is
  declined, and the reader decodes in-process);
* the columns are part of the key, in their order.

Per key, one flight: the first request starts the decode in a worker, the ones that come
while it runs wait for it, the later ones get the held entry. Entries are an LRU bounded
by ``[datasets] decoded_bytes`` (and :data:`MAX_ENTRIES`), never written to disk.

The request is bounded before any work (the op table's fields, then :meth:`_inputs`):
the meta's JSON (32 KiB, 16 deep), the unit (below the member's samples; the worker
checks it against the format's units before it reads), the columns (1,024), a frozen
member's chunks (768, and exactly what its size needs). A decode has
``decode_timeout``; at most :data:`WAITING_PER_WORKER` requests per worker wait for a
busy pool, and one more is declined at once (``busy``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import json
import logging
import os
import re
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import blake3

from chunkd import memfd
from chunkd.client.protocol.ops import MAX_DECODED_BYTES
from chunkd.errors import (
    BackendUnavailableError,
    CacheClosedError,
    InspectError,
    InvalidRequestError,
    ManifestError,
)
from chunkd.gateway.workerpool import PoolRole, WorkerPool, sockets_close
from chunkd.snapshot import canonical, load_json

if TYPE_CHECKING:
    from chunkd.gateway.config.schema import DatasetsConfig
    from chunkd.gateway.metrics import Metrics

__all__ = [
    "DECODER_ROLE",
    "MAX_ENTRIES",
    "MAX_ENTRY_BYTES",
    "WAITING_PER_WORKER",
    "DecodeService",
]

log = logging.getLogger("chunkd.gateway.decoding")

#: the largest decoded table held or handed out (twice a unit's bound,
#: ``chunkd.client.datasets.formats.MAX_UNIT_BYTES``, for Arrow's own overhead)
MAX_ENTRY_BYTES: Final = MAX_DECODED_BYTES
#: in-process decodes one ``ds_decode_report`` counts at most (a reader reports at most
#: once a second: no reader decodes more units than this in a second)
MAX_REPORTED: Final = 10_000
#: entries held at once, whatever their bytes (each is an fd; and at most an eighth of
#: the daemon's fd limit)
MAX_ENTRIES: Final = 4096
#: requests that may wait for a busy pool, per worker; one more is declined at once
WAITING_PER_WORKER: Final = 4
#: keys of units decoded lately, to count a unit decoded twice (repeats)
_RECENT_KEYS: Final = 65536
#: how deep a member's meta may nest
_META_DEPTH: Final = 16
#: a column name's bytes
_MAX_COLUMN_BYTES: Final = 1024
_CHUNK_ID: Final = re.compile(r"[0-9a-f]{64}")
#: the seals a decoded entry must carry: nothing about it can change, seals included
_ENTRY_SEALS: Final = memfd.SEALS
#: the source fields of a request, by kind
_PINNED: Final = ("backend",)
_FROZEN: Final = ("registry", "chunk_bytes", "chunks")

DECODER_ROLE: Final = PoolRole(
    name="decoder",
    verb="decode",
    module="chunkd.client.datasets.decoder",
    workers_key="datasets.decode_workers",
    timeout_key="datasets.decode_timeout",
    memory_key="datasets.decode_memory",
    timeout_advice="Its readers decode it in-process",
    crash_advice="its readers decode it in-process (the unit may be hostile or need more "
    "than datasets.decode_memory)",
    fds=True,
)


class Declined(Exception):
    """The daemon does not decode this unit: the reader decodes it in-process."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class _Entry:
    """One decoded unit: a sealed memfd of Arrow IPC."""

    key: str
    fd: int
    size: int
    rows: int
    columns: list[str]
    held: bool = False

    def describe(self) -> dict[str, Any]:
        return {"key": self.key, "rows": self.rows, "bytes": self.size, "columns": self.columns}


@dataclass(slots=True)
class _Flight:
    """A decode in flight: every request for its key gets a dup of its entry's fd."""

    task: asyncio.Future[None] | None = None
    waiters: list[asyncio.Future[tuple[_Entry, int]]] = field(default_factory=list)


class DecodeService:
    """The daemon's decoded units, and the pool that decodes them.

    Args:
        socket: the daemon's local socket (its workers read through it).
        config: the ``[datasets]`` section (``decoded_bytes``, ``decode_workers``,
            ``decode_timeout``, ``decode_memory``).
        metrics: the daemon's metrics.
    """

    def __init__(self, socket: Path, config: DatasetsConfig, metrics: Metrics) -> None:
        self.budget = config.decoded_bytes
        #: entries held at most: each is an fd, so at most an eighth of the fd limit
        self.max_entries = max(1, min(MAX_ENTRIES, _fd_limit() // 8))
        self.enabled = config.decoded_bytes > 0 and config.decode_workers > 0
        self.pool = WorkerPool(
            socket,
            _role(config.decode_workers),
            workers=max(1, config.decode_workers),
            timeout=config.decode_timeout,
            memory=config.decode_memory,
        )
        self.metrics = metrics
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._held = 0
        self._flights: dict[str, _Flight] = {}
        self._recent: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._formats: dict[str, int] | None = None
        self._formats_task: asyncio.Task[dict[str, int]] | None = None
        self._closed = False

    @property
    def held_bytes(self) -> int:
        """Bytes of the entries held now."""
        return self._held

    async def decode(self, args: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
        """Answer one ``ds_decode`` request whose fields the op table checked: the
        answer's fields, and the fd to send (a dup of the entry's: the caller's to close).

        Raises:
            InvalidRequestError: the request is out of bounds (see the module docstring).
            ChunkdError: the decode's own error (``DatasetFormatError``,
                ``SnapshotDriftError``, ``IntegrityError``, ...), for every request that
                waited for it.
        """
        try:
            self._check_enabled()
            key, work = self._inputs(args)
            await self._check_format(work["format"], work["decoder"])
            entry, fd, source = await self._entry(key, work)
        except Declined as declined:
            self.metrics.dataset_decode_declined.labels(declined.reason).inc()
            return {"decoded": False, "reason": declined.reason, "message": str(declined)}, None
        return {"decoded": True, "from": source} | entry.describe(), fd

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise Declined(
                "off",
                "this daemon decodes no dataset units ([datasets] decoded_bytes or "
                "decode_workers is 0)",
            )

    def report(self, decodes: int) -> None:
        """Count ``decodes`` units a reader decoded in-process (a hint: at most
        :data:`MAX_REPORTED` a report, so that no caller can run the counter up)."""
        self.metrics.dataset_decodes.labels("reader").inc(min(decodes, MAX_REPORTED))

    async def close(self) -> None:
        """Stop the workers and drop every entry."""
        self._closed = True
        tasks: list[asyncio.Future[Any]] = [
            f.task for f in self._flights.values() if f.task is not None
        ]
        if self._formats_task is not None:
            tasks.append(self._formats_task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.pool.close()
        for entry in list(self._entries.values()):
            self._drop(entry)
        self._publish()

    # -- the request --------------------------------------------------------------------

    def _inputs(self, args: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The entry's key and the worker's request, from the checked fields.

        Raises:
            InvalidRequestError: meta, unit, columns or source out of bounds.
        """
        try:
            meta = load_json(args["meta"].encode(), "the member's meta", max_depth=_META_DEPTH)
        except ManifestError as exc:
            raise InvalidRequestError(f"ds_decode: {exc}") from None
        if not isinstance(meta, dict):
            raise InvalidRequestError("ds_decode: the member's meta must be a JSON object")
        samples, unit = args["samples"], args["unit"]
        if unit >= samples:
            raise InvalidRequestError(
                f"ds_decode: unit {unit} of a member of {samples} samples: a unit holds at "
                "least one sample, so the member has no such unit"
            )
        columns = args["columns"]
        if columns is not None:
            for name in columns:
                if len(name.encode()) > _MAX_COLUMN_BYTES:
                    raise InvalidRequestError(
                        f"ds_decode: a column name over {_MAX_COLUMN_BYTES} bytes"
                    )
        source = self._source(args)
        member = {
            "key": args["key"],
            "size": args["size"],
            "version": args["version"],
            "samples": samples,
            "format": args["format"],
            "meta": meta,
        }
        inputs = {
            "format": args["format"],
            "decoder": args["decoder"],
            "member": member,
            "unit": unit,
            "columns": columns,
            "source": source,
        }
        try:
            key = blake3.blake3(canonical(inputs)).hexdigest()
        except ValueError as exc:  # a NaN in the meta: no canonical JSON
            raise InvalidRequestError(
                f"ds_decode: the member's meta is not plain JSON ({exc})"
            ) from None
        work = {k: v for k, v in member.items() if k != "format"}
        work |= {
            "format": args["format"],
            "decoder": args["decoder"],
            "unit": unit,
            "columns": columns,
        }
        return key, work | source

    @staticmethod
    def _source(args: dict[str, Any]) -> dict[str, Any]:
        pinned = [name for name in _PINNED if args[name] is not None]
        frozen = [name for name in _FROZEN if args[name] is not None]
        if (pinned and frozen) or not (pinned or frozen):
            raise InvalidRequestError(
                "ds_decode names one source: a pinned member's backend, or a frozen "
                "member's registry, chunk_bytes and chunks"
            )
        if pinned:
            return {"backend": args["backend"]}
        if len(frozen) != len(_FROZEN):
            missing = ", ".join(name for name in _FROZEN if name not in frozen)
            raise InvalidRequestError(f"ds_decode: a frozen member's source lacks {missing}")
        chunks, step, size = args["chunks"], args["chunk_bytes"], args["size"]
        if len(chunks) != -(-size // step):
            raise InvalidRequestError(
                f"ds_decode: a member of {size} bytes in chunks of {step} has "
                f"{-(-size // step)} chunks; {len(chunks)} came"
            )
        for chunk in chunks:
            if not _CHUNK_ID.fullmatch(chunk):
                raise InvalidRequestError(f"ds_decode: {chunk[:80]!r} is no chunk id")
        return {"registry": args["registry"], "chunk_bytes": step, "chunks": chunks}

    async def _check_format(self, name: str, version: int) -> None:
        formats = await self._known_formats()
        known = formats.get(name)
        if known is None:
            raise Declined(
                "format",
                f"format {name!r} is not installed beside this daemon (it decodes "
                f"{', '.join(sorted(formats)) or 'none'})",
            )
        if known != version:
            raise Declined(
                "format",
                f"this daemon decodes {name} at decoder version {known}, not {version}: "
                "the reader's chunkd and the daemon's differ",
            )

    async def _known_formats(self) -> dict[str, int]:
        """The formats the workers decode, with their versions (asked once)."""
        if self._formats is not None:
            return self._formats
        if self._formats_task is None or self._formats_task.done():
            self._formats_task = asyncio.ensure_future(self._ask_formats())
            # retrieved even when every request that waited for it has left
            self._formats_task.add_done_callback(_retrieve)
        formats = await asyncio.shield(self._formats_task)
        if formats:  # none known (a worker that could not import them): asked again next time
            self._formats = formats
        return formats

    async def _ask_formats(self) -> dict[str, int]:
        try:
            raw = await self.pool.call("formats", {})
        except BackendUnavailableError as exc:
            raise Declined("busy", str(exc)) from None
        except InspectError as exc:
            raise Declined("failed", f"the decode workers did not start: {exc}") from None
        found = json.loads(raw).get("formats", {})
        return {str(k): int(v) for k, v in found.items() if isinstance(v, int)}

    # -- entries and flights ---------------------------------------------------------------

    async def _entry(self, key: str, work: dict[str, Any]) -> tuple[_Entry, int, str]:
        """The entry of ``key`` and a dup of its fd: held, waited for, or decoded now."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.metrics.dataset_decode_hits.inc()
            return entry, _dup(entry.fd), "held"
        flight = self._flights.get(key)
        source = "waited"
        if flight is None:
            if self._closed:
                raise CacheClosedError("the daemon is stopping")
            if self.pool.busy:
                raise Declined(
                    "busy",
                    f"the daemon's {self.pool.workers} decode workers are busy and "
                    f"{self.pool.role.max_waiting} requests wait",
                )
            flight = self._flights[key] = _Flight()
            flight.task = asyncio.ensure_future(self._fly(key, work, flight))
            source = "decoded"
        else:
            self.metrics.dataset_decode_waits.inc()
        waiter: asyncio.Future[tuple[_Entry, int]] = asyncio.get_running_loop().create_future()
        flight.waiters.append(waiter)
        try:
            entry, fd = await waiter
        except asyncio.CancelledError:
            # Its answer will not be sent: the dup the flight gave it is closed here.
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                os.close(waiter.result()[1])
            raise
        return entry, fd, source

    async def _fly(self, key: str, work: dict[str, Any], flight: _Flight) -> None:
        """Decode ``key``; then each waiter gets a dup of the entry's fd (or the error)
        at once, before anything can evict the entry. A waiter that left meanwhile is
        skipped; the decode goes on for the others, and its entry is held."""
        try:
            entry = await self._decode(key, work)
        except asyncio.CancelledError:
            self._flights.pop(key, None)
            for waiter in flight.waiters:
                waiter.cancel()
            raise
        except BaseException as exc:
            self._flights.pop(key, None)
            for waiter in flight.waiters:
                if not waiter.done():
                    waiter.set_exception(exc)
            return
        self._flights.pop(key, None)
        self._hold(entry)
        for waiter in flight.waiters:
            if waiter.done():
                continue
            try:
                waiter.set_result((entry, _dup(entry.fd)))
            except Declined as exc:
                waiter.set_exception(exc)
        if not entry.held:
            os.close(entry.fd)  # too large to hold: only its readers have it

    async def _decode(self, key: str, work: dict[str, Any]) -> _Entry:
        started = time.perf_counter()
        try:
            raw, fds = await self.pool.call_fds("decode", work)
        except BackendUnavailableError as exc:
            # The pool's queue filled meanwhile, or the worker could not reach a backend:
            # either way the reader tries itself.
            raise Declined("busy" if self.pool.busy else "failed", str(exc)) from None
        except CacheClosedError:
            raise
        except InspectError as exc:  # timed out, crashed, or a format's own fault
            raise Declined("failed", str(exc)) from None
        try:
            entry = self._checked(key, raw, fds)
        except BaseException:
            sockets_close(fds)
            raise
        self.metrics.dataset_decodes.labels("daemon").inc()
        self.metrics.dataset_decode_seconds.observe(time.perf_counter() - started)
        if key in self._recent:
            self.metrics.dataset_decode_repeats.inc()
        self._recent[key] = None
        self._recent.move_to_end(key)
        while len(self._recent) > _RECENT_KEYS:
            self._recent.popitem(last=False)
        return entry

    def _checked(self, key: str, raw: bytes, fds: list[int]) -> _Entry:
        """The worker's answer as an entry: one memfd, sealed whole, of the size said."""
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise Declined("failed", "a decode worker's answer is no JSON object")
        if len(fds) != 1:
            raise Declined("failed", f"a decode worker sent {len(fds)} fds for one table")
        fd = fds[0]
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        size = os.fstat(fd).st_size
        if seals & _ENTRY_SEALS != _ENTRY_SEALS or size != answer.get("bytes"):
            raise Declined("failed", "a decode worker sent a table that is not sealed whole")
        if size > MAX_ENTRY_BYTES:
            raise Declined(
                "size",
                f"the unit decodes to {size} bytes of Arrow IPC, over the {MAX_ENTRY_BYTES} "
                "the daemon hands out",
            )
        columns = answer.get("columns")
        rows = answer.get("rows")
        if not isinstance(columns, list) or not isinstance(rows, int):
            raise Declined("failed", "a decode worker's answer lacks rows or columns")
        return _Entry(key, fd, size, rows, [str(c) for c in columns])

    def _hold(self, entry: _Entry) -> None:
        """Keep ``entry`` within the budget, dropping the least recently used."""
        if entry.size > self.budget or self._closed:
            return
        while self._entries and (
            self._held + entry.size > self.budget or len(self._entries) >= self.max_entries
        ):
            _, old = self._entries.popitem(last=False)
            self._drop(old)
            self.metrics.dataset_decoded_evicted.inc()
        entry.held = True
        self._entries[entry.key] = entry
        self._held += entry.size
        self._publish()

    def _drop(self, entry: _Entry) -> None:
        self._entries.pop(entry.key, None)
        if entry.held:
            entry.held = False
            self._held -= entry.size
            with contextlib.suppress(OSError):
                os.close(entry.fd)

    def _publish(self) -> None:
        self.metrics.dataset_decoded_bytes.set(self._held)
        self.metrics.dataset_decoded_units.set(len(self._entries))


def _dup(fd: int) -> int:
    """A reader's own fd of an entry."""
    try:
        return os.dup(fd)
    except OSError as exc:  # EMFILE: the daemon is at its fd limit
        raise Declined("failed", f"the daemon cannot hand out the table now ({exc})") from None


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _fd_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _role(workers: int) -> PoolRole:
    """The decoder's role, its queue sized for ``workers``."""
    return PoolRole(
        name=DECODER_ROLE.name,
        verb=DECODER_ROLE.verb,
        module=DECODER_ROLE.module,
        workers_key=DECODER_ROLE.workers_key,
        timeout_key=DECODER_ROLE.timeout_key,
        memory_key=DECODER_ROLE.memory_key,
        timeout_advice=DECODER_ROLE.timeout_advice,
        crash_advice=DECODER_ROLE.crash_advice,
        max_waiting=WAITING_PER_WORKER * max(1, workers),
        fds=True,
    )
