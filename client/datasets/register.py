"""Registering a dataset: a prefix listed, its members' metadata read, a snapshot committed.

:func:`scan_prefix` lists ``BACKEND/PREFIX`` page by page and reads, for each member,
only what its format's metadata needs (Parquet footers, tar headers, MDS indexes; JSON
lines are counted in bounded streams), through the scan of
:func:`~chunkd.client.datasets.scan.scan_members` (what a bulk job's task runs, also
importable from here). :func:`commit` hands the snapshot to the daemon, which writes it
into the registry (its pages, then ``ds_commit``: the root if absent, then the version
pointer, the commit).

How the files are read, many at once in batches with their tails read in one round
trip, is :mod:`chunkd.client.datasets.scan`'s (docs/registration.md); this module chooses
the files (a listing, or a file of keys each stat'ed) and makes the snapshot of what the
scan found:

* Members are emitted in key order, whatever order the reads finish in, through a
  spill file on disk into the snapshot's :class:`~chunkd.snapshot.PageWriter`: a
  registration writes a schema-2 snapshot (a root and member pages), and the process
  holds a batch window and a page, not the dataset (nor a manifest of it: no bound on
  the member count but the disk's).

It is one job at ~600 lines: turning a set of files into a committed snapshot (which
files, from a listing or a file of keys; the members in key order through the spill;
the commit). How each file is read is the scan's, and the snapshot's format is
:mod:`chunkd.snapshot`'s.

A file that cannot be read as its format stops the registration with a
:class:`~chunkd.errors.DatasetFormatError` naming it, or with ``skip_bad`` is recorded
in the snapshot's ``excluded`` list. Nothing is written before every member is read.
"""

from __future__ import annotations

import itertools
import os
import pickle
import shutil
import tempfile
import threading
import time
import weakref
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, cast, overload

from chunkd import memfd
from chunkd.client.datasets.formats import Format, format_of, names
from chunkd.client.datasets.scan import (
    _WORKER_CACHE_BYTES,
    BATCH_FILES,
    CONCURRENCY,
    TAIL_BYTES,
    WINDOW,
    WINDOW_BATCHES,
    WORKERS,
    Scanned,
    _Formats,
    _scan_stream,
    scan_members,
)
from chunkd.client.datasets.source import PinnedSource
from chunkd.errors import (
    DatasetFormatError,
    DatasetNotFoundError,
    InvalidRequestError,
)
from chunkd.keys import key_problem
from chunkd.snapshot import (
    MAX_EXCLUDED,
    Member,
    PageWriter,
    Snapshot,
    check_dataset_name,
)

if TYPE_CHECKING:
    from chunkd.client.core import Client

__all__ = [
    "BATCH_FILES",
    "CONCURRENCY",
    "MAX_KEYS",
    "MAX_KEYS_FILE_BYTES",
    "TAIL_BYTES",
    "WINDOW",
    "WINDOW_BATCHES",
    "WORKERS",
    "Progress",
    "Scanned",
    "commit",
    "parse_format",
    "read_keys",
    "scan_members",
    "scan_prefix",
    "snapshot_of",
]

#: the pages of the last registrations of this process, on disk, until committed
_PENDING_PAGES: Final = 4
#: the most keys a registration from a file of keys takes (a backend that cannot be
#: listed: an https:// mirror): they are held, sorted, for the registration
MAX_KEYS: Final = 1_000_000
#: the largest file of keys :func:`read_keys` reads
MAX_KEYS_FILE_BYTES: Final = 64 << 20
#: keys asked for their size and version at once, in a registration from keys
_STATS_AT_ONCE: Final = 16


@dataclass(slots=True)
class Progress:
    """How far a registration is: updated as members are read."""

    listed: int = 0
    scanned: int = 0
    bytes: int = 0
    excluded: int = 0
    listing_done: bool = False
    started: float = field(default_factory=time.monotonic)

    @property
    def rate(self) -> float:
        """Members read per second so far."""
        return self.scanned / max(1e-9, time.monotonic() - self.started)

    def line(self) -> str:
        """One line for a terminal."""
        total = str(self.listed) if self.listing_done else f"{self.listed}+"
        excluded = f", {self.excluded} excluded" if self.excluded else ""
        return (
            f"read {self.scanned}/{total} files, {self.bytes / 2**20:.1f} MiB listed, "
            f"{self.rate:.0f} files/s{excluded}"
        )


def parse_format(text: str) -> tuple[str, dict[str, Any]]:
    """``auto``, or a format's name with its argument where it takes one
    (``NAME:ARG``, as ``fixed:N``): the format and its options
    (:meth:`~chunkd.client.datasets.formats.Format.options`).

    Raises:
        InvalidRequestError: none of these, or an argument the format refuses.
    """
    name, colon, arg = text.partition(":")
    if name == "auto" and not colon:
        return name, {}
    if name not in names():
        raise InvalidRequestError(f"--format {text!r}: use {_usage()}")
    try:
        return name, format_of(name).options(arg)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"--format {text!r}: {exc}; use {_usage()}") from None


def _usage() -> str:
    """What ``--format`` takes: ``auto``, then each known format as it is spelled."""
    spelled = ["auto"]
    for name in names():
        try:
            fmt = format_of(name)
        except DatasetFormatError:
            continue  # a plug-in that does not load is not offered
        spelled.append(f"{name}:{fmt.argument}" if fmt.argument else name)
    return ", ".join(spelled[:-1]) + f" or {spelled[-1]}"


def read_keys(path: str | os.PathLike[str]) -> list[str]:
    """The keys of a file of keys: one a line (UTF-8, ``\\n`` or ``\\r\\n``), each below
    the registration's prefix; blank lines are skipped, and a leading byte-order mark
    and the whitespace around each key are not part of it.

    Each key must be one chunkd looks up (the key rule,
    :func:`chunkd.keys.key_problem`: at most 1024 UTF-8 bytes, no
    control character, no backslash, no leading ``/``, no empty, ``.`` or ``..``
    segment); the first that is not is refused with its line number.

    Raises:
        InvalidRequestError: the file is larger than :data:`MAX_KEYS_FILE_BYTES`, holds
            more than :data:`MAX_KEYS` keys, is not UTF-8, names a key twice, or holds a
            key chunkd would not look up.
    """
    with open(path, "rb") as held:
        data = held.read(MAX_KEYS_FILE_BYTES + 1)
    if len(data) > MAX_KEYS_FILE_BYTES:
        raise InvalidRequestError(
            f"the file of keys {os.fspath(path)!r} is larger than {MAX_KEYS_FILE_BYTES} bytes; "
            "register the dataset in parts, under prefixes of their own"
        )
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(
            f"the file of keys {os.fspath(path)!r} is not UTF-8 (byte {exc.start})"
        ) from None
    keys = []
    for number, line in enumerate(text.split("\n"), start=1):
        key = line.strip()
        if not key:
            continue
        problem = key_problem(key)
        if problem is not None:
            raise InvalidRequestError(
                f"line {number} of the file of keys {os.fspath(path)!r}: {problem}"
            )
        keys.append(key)
    return _checked_keys(keys)


def _checked_keys(keys: Sequence[str]) -> list[str]:
    """``keys``, sorted as listings are (UTF-8 bytes), each once, at most :data:`MAX_KEYS`."""
    if len(keys) > MAX_KEYS:
        raise InvalidRequestError(
            f"{len(keys)} keys are more than a registration takes ({MAX_KEYS}); register the "
            "dataset in parts, under prefixes of their own"
        )
    ordered = sorted(keys, key=lambda k: k.encode("utf-8", "surrogatepass"))
    for before, after in itertools.pairwise(ordered):
        if before == after:
            raise InvalidRequestError(f"the key {before!r} is named twice; name each member once")
    for key in ordered:
        if not key or key.startswith("/"):
            raise InvalidRequestError(
                f"{key!r} is not a key below the prefix; write each key as the listing would "
                "show it below the prefix, without a leading '/'"
            )
    return ordered


def _stated(
    client: Client, backend: str, key_prefix: str, keys: Sequence[str]
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each of ``keys`` (below ``key_prefix``) as a listing entry: its key in the
    backend, and its size and version (a stat through the daemon, a few at once, each
    worker over a connection of its own)."""
    local = threading.local()
    made: list[Client] = []
    made_lock = threading.Lock()

    def stat(key: str) -> tuple[str, dict[str, Any]]:
        mine = getattr(local, "client", None)
        if mine is None:
            mine = local.client = type(client)(
                socket_path=client.socket_path, cache_bytes=_WORKER_CACHE_BYTES, cache_chunks=8
            )
            with made_lock:
                made.append(mine)
        found = mine.stat(f"{backend}/{key}")
        return key, {"type": "file", "size": found.size, "version": found.version}

    pending: deque[Future[tuple[str, dict[str, Any]]]] = deque()
    pool = ThreadPoolExecutor(_STATS_AT_ONCE, thread_name_prefix="chunkd-keys")
    try:
        for key in keys:
            pending.append(pool.submit(stat, f"{key_prefix}{key}"))
            if len(pending) >= _STATS_AT_ONCE:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:  # stopped early, or failed: what has not started goes
            future.cancel()
        pool.shutdown(wait=True)
        for made_client in made:
            made_client.close()


def _split(prefix: str) -> tuple[str, str]:
    backend, _, key = prefix.partition("/")
    if not backend:
        raise InvalidRequestError(f"{prefix!r} is not BACKEND/PREFIX")
    # A prefix names a folder (as listings do): data/web and data/web/ are the same.
    key = key.strip("/")
    return backend, f"{key}/" if key else ""


def _wanted(key: str, fmt: str) -> str | None:
    """The format of ``key`` in a registration of ``fmt`` (None: not a member)."""
    return _Formats().wanted(key, fmt)


def scan_prefix(
    client: Client,
    prefix: str,
    *,
    fmt: str = "auto",
    options: Mapping[str, Any] | None = None,
    skip_bad: bool = False,
    concurrency: int = CONCURRENCY,
    progress: Callable[[Progress], None] | None = None,
    client_factory: Callable[[], Client] | None = None,
    keys: Sequence[str] | None = None,
) -> Snapshot:
    """The snapshot of ``BACKEND/PREFIX``: every member listed (or named in ``keys``),
    its metadata read.

    Args:
        client: the node's daemon (it lists; each worker makes its own).
        prefix: ``BACKEND/PREFIX`` (a prefix of keys: ``data/web/`` takes the keys
            below ``web/``).
        fmt: ``auto`` (by each key's ending) or a format's name
            (:func:`~chunkd.client.datasets.formats.names`).
        options: the format's options (``{"record_bytes": N}`` for ``fixed``;
            :func:`parse_format` gives them from ``--format``).
        skip_bad: record files that cannot be read as excluded, instead of stopping.
        concurrency: batches of :data:`BATCH_FILES` files read at once.
        progress: called with the progress, from the calling thread, as members land.
        client_factory: makes each worker's client (default: one like ``client``).
        keys: the members' keys below the prefix, instead of a listing (a backend that
            cannot be listed, such as an ``https://`` mirror; :func:`read_keys` reads
            them from a file): at most :data:`MAX_KEYS`, each asked for its size and
            version.

    Raises:
        DatasetFormatError: a file cannot be read as its format (without ``skip_bad``),
            or the prefix holds no member of the format.
        SnapshotDriftError: a file changed while it was read; register again.
        InvalidRequestError: ``keys`` has more than :data:`MAX_KEYS` keys, or one twice.
        ObjectNotFoundError: a key of ``keys`` names no object.
    """
    backend, key_prefix = _split(prefix)
    named_keys = None if keys is None else _checked_keys(keys)
    formats = _Formats()
    state = Progress()

    def listed(member: Member) -> None:
        state.listed += 1
        state.bytes += member.size

    def landed() -> Iterator[Member | dict[str, str]]:
        for _, found in _scan_stream(
            client,
            backend,
            _candidates(client, backend, key_prefix, fmt, dict(options or {}), formats, named_keys),
            formats,
            skip_bad=skip_bad,
            concurrency=concurrency,
            client_factory=client_factory,
            listed=listed,
        ):
            if not isinstance(found, Member):
                state.excluded += 1
            state.scanned += 1
            if progress is not None:
                progress(state)
            yield found
        state.listing_done = True

    return snapshot_of(backend, key_prefix, landed(), what=prefix, fmt=fmt, formats=formats)


def snapshot_of(
    backend: str,
    prefix: str,
    found: Iterable[Member | Mapping[str, str]],
    *,
    what: str | None = None,
    fmt: str = "auto",
    formats: _Formats | None = None,
) -> Snapshot:
    """The snapshot of scanned members (unsettled, as :func:`scan_members` gives them)
    and excluded files (``{"key", "error"}``), in key order: the dataset's schema is
    settled over them all, then each member, settled, goes into the snapshot's pages.

    The members go through a spill file on disk (canonical JSON, a line each), so the
    process holds a page of them at a time; a schema-2 snapshot's pages stay on disk
    until :func:`commit` (at most :data:`_PENDING_PAGES` registrations' worth). Members
    out of key order (a format whose index lists them so) are sorted in memory.

    Raises:
        DatasetFormatError: no member, or members of several formats.
        ManifestError: more than :data:`~chunkd.snapshot.MAX_EXCLUDED` files excluded.
    """
    what = what or f"{backend}/{prefix}"
    formats = formats or _Formats()
    excluded: list[dict[str, str]] = []
    kinds: set[str] = set()
    with _Spill() as spill:
        for item in found:
            if isinstance(item, Member):
                spill.add(item)
                kinds.add(item.format)
            else:
                excluded.append(dict(item))
                if len(excluded) > MAX_EXCLUDED:
                    break  # the snapshot refuses them (from_pages says so)
        if not len(spill):
            raise DatasetFormatError(
                f"{what} holds no {'dataset' if fmt == 'auto' else fmt} files to register"
                + (f" ({len(excluded)} could not be read)" if excluded else "")
                + "; check the prefix, or name the format with --format"
            )
        if len(kinds) > 1:
            raise DatasetFormatError(
                f"{what} holds files of several formats ({', '.join(sorted(kinds))}); "
                "register each under its own prefix, or name one with --format"
            )
        kind = formats.get(kinds.pop())
        members: Sequence[Member] = spill if spill.ordered else spill.sorted()
        # The format's contract takes a list; a spill reads as one (by index or in order).
        schema = kind.schema(cast("list[Member]", members))
        pages = _DiskPages()
        writer = PageWriter(pages.put)
        for member in _settled(kind, members, schema):
            writer.add(member)
        built = Snapshot.from_pages(
            backend=backend,
            prefix=prefix,
            format=kind.name,
            pages=writer.finish(),
            source=pages,
            schema_of=schema,
            excluded=excluded,
            claims=writer.claimed,
        )
    _PAGES_OF[built.id] = pages
    while len(_PAGES_OF) > _PENDING_PAGES:
        _PAGES_OF.popitem(last=False)
    return built


def _settled(kind: Format, members: Sequence[Member], schema: Any) -> Iterator[Member]:
    """``members`` as the manifest holds them, a run at a time (a format settles each
    member against the dataset's schema on its own)."""
    run: list[Member] = []
    for member in members:
        run.append(member)
        if len(run) >= 1024:
            yield from kind.settle(run, schema)
            run = []
    if run:
        yield from kind.settle(run, schema)


class _Spill(Sequence[Member]):
    """Members written to a temporary file, read back in order or by index (8 bytes of
    offset a member in memory).

    A record is the pickle of the member's fields: the file is this process's own, never
    read by another, and a pickle is written and read back several times faster than a
    canonical JSON line parsed and checked again (the spill is read twice: once for the
    dataset's schema, once to settle each member into its page)."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="chunkd-register-")  # noqa: SIM115
        self._offsets = array("Q")
        self._last: bytes | None = None
        #: whether the members came in strictly increasing key order
        self.ordered = True
        #: bytes written
        self.bytes = 0

    def __enter__(self) -> _Spill:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def add(self, member: Member) -> None:
        raw = member.key.encode()
        if self._last is not None and raw <= self._last:
            self.ordered = False
        self._last = raw
        record = pickle.dumps(
            (
                member.key,
                member.size,
                member.version,
                member.format,
                member.samples,
                member.meta,
                member.content,
            ),
            pickle.HIGHEST_PROTOCOL,
        )
        self._offsets.append(self.bytes)
        self._file.write(record)
        self.bytes += len(record)

    def __len__(self) -> int:
        return len(self._offsets)

    @overload
    def __getitem__(self, index: int) -> Member: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Member]: ...

    def __getitem__(self, index: int | slice) -> Member | Sequence[Member]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        offset = self._offsets[index]
        self._file.flush()
        self._file.seek(offset)
        return Member(*pickle.load(self._file))

    def __iter__(self) -> Iterator[Member]:
        self._file.flush()
        self._file.seek(0)
        load, held = pickle.load, self._file
        for _ in range(len(self)):
            yield Member(*load(held))
        self._file.seek(0, os.SEEK_END)

    def sorted(self) -> list[Member]:
        """The members in key order (in memory: for members that came out of order)."""
        return sorted(self, key=lambda m: m.key.encode())


class _DiskPages:
    """A :class:`~chunkd.snapshot.PageSource` of pages written to a temporary folder,
    removed with it (when neither the snapshot reading from it nor :data:`_PAGES_OF`
    holds it, or at exit): a registration's pages."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="chunkd-pages-")
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.folder, True)

    def put(self, page_id: str, data: bytes) -> None:
        with open(os.path.join(self.folder, page_id), "wb") as out:
            out.write(data)

    def page(self, page_id: str) -> bytes:
        try:
            with open(os.path.join(self.folder, page_id), "rb") as held:
                return held.read()
        except FileNotFoundError:
            raise DatasetNotFoundError(f"page {page_id} is not among this registration's") from None


#: the pages of the last registrations of this process, by snapshot id, until committed
_PAGES_OF: OrderedDict[str, _DiskPages] = OrderedDict()


def _candidates(
    client: Client,
    backend: str,
    key_prefix: str,
    fmt: str,
    options: dict[str, Any],
    formats: _Formats | None = None,
    keys: Sequence[str] | None = None,
) -> Iterator[tuple[Member, dict[str, Any]]]:
    """The members to read, in key order, with each one's format options: what the
    listing of the prefix finds, or the ``keys`` below it (sorted)."""
    formats = formats or _Formats()
    files: Iterable[tuple[str, dict[str, Any]]]
    if keys is not None:
        files = _stated(client, backend, key_prefix, keys)
    else:
        # What the backend holds now: a listing the daemon kept would miss files just
        # written.
        listed = client.iter_ls(f"{backend}/{key_prefix}".rstrip("/"), recursive=True, fresh=True)
        files = _files(listed, backend, key_prefix)
    named = None if fmt == "auto" else formats.get(fmt)
    if named is not None and named.index_name:
        # Its members are what its index files list: every file under the prefix, held
        # (name, size, version) until the indexes are read, which may come after them.
        held = [Member(key, int(entry["size"]), str(entry["version"]), fmt) for key, entry in files]
        yield from named.members_of(key_prefix, held, PinnedSource(client, backend), options)
        return
    for key, entry in files:
        member_fmt = formats.wanted(key, fmt)
        if member_fmt is None:
            continue
        indexed = formats.get(member_fmt).index_name  # (auto only: a named one went above)
        if indexed:
            raise DatasetFormatError(
                f"{backend}/{key} is a {member_fmt} file: register such datasets with "
                f"--format {member_fmt} (the members are the files its {indexed} lists)"
            )
        member = Member(key, int(entry["size"]), str(entry["version"]), member_fmt)
        yield member, options


def _files(
    listed: Iterator[dict[str, Any]], backend: str, key_prefix: str
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each file of a listing under ``key_prefix``: its key and its entry."""
    for entry in listed:
        if entry.get("type") != "file":
            continue
        key = entry["name"][len(backend) + 1 :]
        if key.startswith(key_prefix):
            yield key, entry


def commit(client: Client, name: str, snapshot: Snapshot) -> dict[str, Any]:
    """Register ``snapshot`` as the next version of ``name``; the registry's answer
    (``{"id", "version", ...}``). A schema-2 snapshot's pages are put first (those
    :func:`scan_prefix` wrote are read from its spill folder), then its root
    (:func:`~chunkd.client.datasets.pages.commit_snapshot`).

    Raises:
        InvalidRequestError: ``name`` is not a dataset name.
        ReadOnlyBackendError: the registry's backend is not writable.
        BackendUnavailableError: the registry's backend is down.
    """
    check_dataset_name(name)
    if snapshot.schema >= 2:
        from chunkd.client.datasets.pages import commit_snapshot

        answer = commit_snapshot(client, name, snapshot, _PAGES_OF.get(snapshot.id))
        # The snapshot still reads its members from its pages there: they go with it.
        _PAGES_OF.pop(snapshot.id, None)
        return answer
    fd = memfd.sealed(snapshot.data, "chunkd-manifest")
    try:
        with client.request("ds_commit", {"name": name}, fds=[fd], timeout=None) as reply:
            return dict(reply.header)
    finally:
        memfd.close_all([fd])
