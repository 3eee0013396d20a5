"""Scanning listed files into members: each file's metadata read, many files at once.

:func:`scan_members` reads, for each listed file, only what its format's metadata needs
(Parquet footers, tar headers, MDS indexes; JSON lines are counted in bounded streams),
and gives the members in the order the files were given: what a registration does to
each file of its listing (:func:`~chunkd.client.datasets.register.scan_prefix`) and what
a bulk job's task runs (:mod:`chunkd.client.datasets.bulk`).

How the files are read (docs/registration.md):

* At most ``WINDOW * concurrency`` files (32 by default) are listed and not landed at
  once (a listing of a million files is never a million futures), in **batches** of
  consecutive files (up to :data:`BATCH_FILES`), each one task of a pool of up to
  :data:`WORKERS` threads, each over its own connection to the daemon.
* A format whose scan starts at the member's end (Parquet and Arrow: the last 64 KiB,
  :data:`TAIL_BYTES`, hold the footer of most files) has the tails of a whole batch read
  in one ``readv`` round trip with ``keep: false``: the daemon reads them (pinned to the
  version the listing saw, one GET each, all of the batch at once: what hides an object
  store's latency) without putting them in its RAM and disk tiers. Whatever else a scan
  reads (a footer larger than the tail, another format's headers) is one pinned read
  each, as before.

A file that cannot be read as its format stops the scan with a
:class:`~chunkd.errors.DatasetFormatError` naming it, or with ``skip_bad`` is recorded
in :attr:`Scanned.excluded`.
"""

from __future__ import annotations

import io
import posixpath
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, Final

from chunkd.client.datasets.formats import Format, format_of, names
from chunkd.client.datasets.source import MemberFile, PinnedSource, drift
from chunkd.client.protocol import MAX_PAYLOAD, MAX_RANGES
from chunkd.client.views import chunk_budget
from chunkd.errors import (
    DatasetFormatError,
    ObjectNotFoundError,
    ProtocolError,
    RangeNotSatisfiableError,
    VersionChangedError,
)
from chunkd.snapshot import Member

if TYPE_CHECKING:
    from chunkd.client.core import Client

__all__ = [
    "BATCH_FILES",
    "CONCURRENCY",
    "TAIL_BYTES",
    "WINDOW",
    "WINDOW_BATCHES",
    "WORKERS",
    "Scanned",
    "scan_members",
]

#: members read at once: a registration has at most ``WINDOW * concurrency`` files
#: listed and not yet landed (being read, or read and waiting for an earlier one)
CONCURRENCY: Final = 8
#: files in flight per unit of ``concurrency``
WINDOW: Final = 4
#: the most consecutive files of one batch: their first reads go out as one ``readv``
BATCH_FILES: Final = 64
#: the most worker threads, each over its own connection to the daemon (a scan is
#: mostly Python: more threads than this add switching, not speed)
WORKERS: Final = 2
#: batches in flight a worker: the window goes out in as few batches as keep every
#: worker busy (a readv round trip costs the daemon and the client ~10x a file of it;
#: two batches a worker, half the size, cost a registration 25% more CPU a file)
WINDOW_BATCHES: Final = 1
#: the end of a member its format's scan reads first, read for a whole batch at once
#: with ``keep: false`` (the footer of most files is in it)
TAIL_BYTES: Final[Mapping[str, int]] = {"parquet": 64 << 10, "arrow": 64 << 10}
#: the client cache of each worker (it reads each member's metadata once)
_WORKER_CACHE_BYTES: Final = 64 << 20
#: keys that are a dataset's bookkeeping, never a member
_IGNORED: Final = ("_SUCCESS", "_metadata", "_common_metadata", "index.json")
_IGNORED_SUFFIXES: Final = (".crc", ".md", ".txt", ".json")


class _Formats:
    """The formats known when a registration starts, looked up once: what
    :func:`~chunkd.client.datasets.formats.detect` and ``format_of`` answer, without
    asking the installed packages' entry points again for every file (2.6 ms a file
    with 150 packages installed: the bound of registration before)."""

    def __init__(self) -> None:
        self._formats: dict[str, Format] = {}
        self._suffixes: list[tuple[str, str]] = []
        for name in names():
            try:
                fmt = format_of(name)
            except DatasetFormatError:
                continue  # a plug-in that does not load detects nothing
            self._formats[name] = fmt
            self._suffixes += [(suffix, name) for suffix in fmt.suffixes]
        # The longest suffix first; among equals, the first format named.
        self._suffixes.sort(key=lambda pair: -len(pair[0]))

    def get(self, name: str) -> Format:
        fmt = self._formats.get(name)
        if fmt is None:
            fmt = self._formats[name] = format_of(name)
        return fmt

    def detect(self, key: str) -> str | None:
        lowered = key.lower()
        for suffix, name in self._suffixes:
            if lowered.endswith(suffix):
                return name
        return None

    def wanted(self, key: str, fmt: str) -> str | None:
        """The format of ``key`` in a registration of ``fmt`` (None: not a member)."""
        base = posixpath.basename(key)
        if base.startswith(".") or base in _IGNORED:
            return None
        found = self.detect(key)
        if fmt == "auto":
            return found
        if found is not None:
            return fmt if found == fmt else None
        return None if base.lower().endswith(_IGNORED_SUFFIXES) else fmt


@dataclass(frozen=True, slots=True)
class Scanned:
    """What a scan of listed files found (:func:`scan_members`)."""

    #: the members read, in the order they were given, as their format scanned them
    #: (not settled: :func:`snapshot_of` settles them against the dataset's schema)
    members: list[Member]
    #: the files left out (``skip_bad``): ``{"key", "error"}`` each, in the order given
    excluded: list[dict[str, str]]


class _ScanSource:
    """A :class:`~chunkd.client.datasets.source.Source` for a scan: the bytes read for
    the batch (each member's tail, by key) first, and any other range with one pinned
    read that the daemon does not keep."""

    def __init__(
        self, client: Client, backend: str, tails: Mapping[str, tuple[int, bytes]]
    ) -> None:
        self._client = client
        self._backend = backend
        self._tails = tails
        self._pinned = PinnedSource(client, backend)

    def name(self, member: Member) -> str:
        return f"{self._backend}/{member.key}"

    def read(self, member: Member, offset: int, length: int) -> memoryview:
        length = min(length, member.size - offset)
        if length <= 0:
            return memoryview(b"")
        held = self._tails.get(member.key)
        if held is not None:
            start, data = held
            if start <= offset and offset + length <= start + len(data):
                return memoryview(data)[offset - start : offset - start + length]
        if length > MAX_PAYLOAD:
            return self._pinned.read(member, offset, length)
        # A range past the batch's tail (a footer larger than it, a failed answer): one
        # read pinned to the listed version, not kept either.
        name = self.name(member)
        fields = {
            "name": name,
            "offset": offset,
            "length": length,
            "version": member.version,
            "keep": False,
        }
        try:
            reply = self._client.request("read", fields)
        except (VersionChangedError, ObjectNotFoundError, RangeNotSatisfiableError) as exc:
            raise drift(name, member.version, exc) from None
        if str(reply.header.get("version")) != member.version:
            raise drift(name, member.version, VersionChangedError(name))
        return memoryview(reply.payload)

    def file(self, member: Member) -> BinaryIO:
        return io.BufferedReader(MemberFile(self, member), buffer_size=1 << 20)


def _tails(
    client: Client, backend: str, batch: Sequence[tuple[Member, Mapping[str, Any]]]
) -> dict[str, tuple[int, bytes]]:
    """The tail of each member of ``batch`` whose format reads its end first
    (:data:`TAIL_BYTES`), by key, in as few ``readv`` round trips as fit (``keep:
    false``). A member whose answer failed, or came at another version than the one
    listed, is left out: its scan reads it pinned, and says what is wrong."""
    wanted: list[tuple[Member, int, int]] = []
    for member, _ in batch:
        tail = TAIL_BYTES.get(member.format, 0)
        if tail and member.size:
            start = max(0, member.size - tail)
            wanted.append((member, start, member.size - start))
    got: dict[str, tuple[int, bytes]] = {}
    while wanted:
        asked = wanted[:MAX_RANGES]
        ranges = [[f"{backend}/{m.key}", start, length] for m, start, length in asked]
        reply = client.request("readv", {"ranges": ranges, "keep": False})
        answers = reply.header.get("ranges")
        if not isinstance(answers, list):
            answers = []
        answered = len(answers)
        if not 0 < answered <= len(asked):
            raise ProtocolError(f"the daemon answered {answered} of {len(asked)} ranges")
        view = memoryview(reply.payload)
        for (member, start, length), entry in zip(asked, answers, strict=False):
            if "error" in entry:
                continue  # read again pinned by the scan, which raises what is wrong
            size = int(entry["length"])
            if not 0 <= size <= min(length, view.nbytes):
                raise ProtocolError(f"a readv answer gives {size} bytes of {member.key}")
            data, view = view[:size], view[size:]
            if str(entry["version"]) == member.version and int(entry["size"]) == member.size:
                got[member.key] = (start, bytes(data))
        wanted = wanted[answered:]
    return got


def _scan_batch(
    client: Client,
    backend: str,
    formats: _Formats,
    batch: Sequence[tuple[Member, Mapping[str, Any]]],
    skip_bad: bool,
) -> list[Member | dict[str, str]]:
    """Each member of ``batch`` scanned, or (``skip_bad``) the record of its exclusion."""
    source = _ScanSource(client, backend, _tails(client, backend, batch))
    out: list[Member | dict[str, str]] = []
    for member, options in batch:
        try:
            out.append(formats.get(member.format).scan(source, member, options))
        except DatasetFormatError as exc:
            if not skip_bad:
                raise
            out.append({"key": member.key, "error": str(exc)})
    return out


def _scan_stream(
    client: Client,
    backend: str,
    entries: Iterable[tuple[Member, Mapping[str, Any]]],
    formats: _Formats,
    *,
    skip_bad: bool,
    concurrency: int,
    client_factory: Callable[[], Client] | None,
    listed: Callable[[Member], None] | None = None,
) -> Iterator[tuple[Member, Member | dict[str, str]]]:
    """Each entry with what its scan found, in the order given, whatever order the
    batches finish in; at most ``WINDOW * concurrency`` files in flight, in batches of
    up to :data:`BATCH_FILES` over at most :data:`WORKERS` workers."""
    window = WINDOW * max(1, concurrency)
    workers = max(1, min(WORKERS, concurrency))
    size = max(1, min(BATCH_FILES, window // (workers * WINDOW_BATCHES)))
    workers = max(1, min(workers, window // size))
    most = max(1, window // size)  # batches in flight
    local = threading.local()
    # Each worker reads a footer or a header once: a small cache of its own, whose fds
    # (one per chunk) stay few whatever the count of files and workers.
    chunks = max(8, min(64, chunk_budget() // (workers + 1)))
    make = client_factory or (
        lambda: type(client)(
            socket_path=client.socket_path, cache_bytes=_WORKER_CACHE_BYTES, cache_chunks=chunks
        )
    )
    made: list[Client] = []
    made_lock = threading.Lock()

    def scan(batch: list[tuple[Member, Mapping[str, Any]]]) -> list[Member | dict[str, str]]:
        mine = getattr(local, "client", None)
        if mine is None:
            mine = local.client = make()
            with made_lock:
                made.append(mine)
        return _scan_batch(mine, backend, formats, batch, skip_bad)

    pending: deque[tuple[Future[list[Member | dict[str, str]]], list[Member]]] = deque()
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="chunkd-scan") as pool:
            batch: list[tuple[Member, Mapping[str, Any]]] = []

            def submit() -> None:
                pending.append((pool.submit(scan, batch), [m for m, _ in batch]))

            for entry in entries:
                if listed is not None:
                    listed(entry[0])
                batch.append(entry)
                if len(batch) < size:
                    continue
                submit()
                batch = []
                while len(pending) >= most or (pending and pending[0][0].done()):
                    future, members = pending.popleft()
                    yield from zip(members, future.result(), strict=True)
            if batch:
                submit()
            while pending:
                future, members = pending.popleft()
                yield from zip(members, future.result(), strict=True)
    finally:
        for future, _ in pending:
            future.cancel()
        for mine in made:
            mine.close()


def scan_members(
    client: Client,
    backend: str,
    entries: Iterable[tuple[Member, Mapping[str, Any]]],
    *,
    skip_bad: bool = False,
    concurrency: int = CONCURRENCY,
    client_factory: Callable[[], Client] | None = None,
) -> Scanned:
    """Scan listed files into members: what :func:`scan_prefix` does to each file of
    its listing, for a given list (a bulk job's task).

    Args:
        client: the node's daemon (each worker thread makes its own connection).
        backend: the backend the files are in.
        entries: each file as listed, ``Member(key, size, version, format)`` (samples
            and meta not known yet), with its format's options; in key order for a
            snapshot (:func:`snapshot_of` takes them so).
        skip_bad: a file that cannot be read as its format is recorded in
            :attr:`Scanned.excluded` instead of stopping the scan.
        concurrency: batches of :data:`BATCH_FILES` files read at once.
        client_factory: makes each worker's client (default: one like ``client``).

    Returns:
        The members found and the files left out, in the order given.

    Raises:
        DatasetFormatError: a file cannot be read as its format (without ``skip_bad``).
        SnapshotDriftError: a file is no longer the version listed.
    """
    members: list[Member] = []
    excluded: list[dict[str, str]] = []
    for _, found in _scan_stream(
        client,
        backend,
        entries,
        _Formats(),
        skip_bad=skip_bad,
        concurrency=concurrency,
        client_factory=client_factory,
    ):
        if isinstance(found, Member):
            members.append(found)
        else:
            excluded.append(found)
    return Scanned(members, excluded)
