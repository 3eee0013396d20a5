"""Registering a dataset: a prefix listed, its members' metadata read, a snapshot committed.

:func:`scan_prefix` lists ``BACKEND/PREFIX`` page by page and reads, for each member,
only what its format's metadata needs (Parquet footers, tar headers, MDS indexes; JSON
lines are counted in bounded streams), several members at once, each worker thread
over its own connection to the daemon. :func:`commit` hands the snapshot to the
daemon, which writes it into the registry (``ds_commit``: the manifest if absent, then
the version pointer, the commit).

A file that cannot be read as its format stops the registration with a
:class:`~chunkd.errors.DatasetFormatError` naming it, or with ``skip_bad`` is recorded
in the snapshot's ``excluded`` list. Nothing is written before every member is read.
"""

from __future__ import annotations

import posixpath
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from chunkd import memfd
from chunkd.client.datasets.formats import detect, format_of, names, settle
from chunkd.client.datasets.source import PinnedSource
from chunkd.client.protocol import MAX_LAYOUT
from chunkd.client.views import chunk_budget
from chunkd.errors import ChunkdError, DatasetFormatError, InvalidRequestError
from chunkd.snapshot import Member, Snapshot, canonical, check_dataset_name

if TYPE_CHECKING:
    from chunkd.client.core import Client

__all__ = ["Progress", "commit", "parse_format", "scan_prefix"]

#: members read at once (each worker has its own connection to the daemon)
CONCURRENCY: Final = 8
#: the client cache of each worker (it reads each member's metadata once)
_WORKER_CACHE_BYTES: Final = 64 << 20
#: keys that are a dataset's bookkeeping, never a member
_IGNORED: Final = ("_SUCCESS", "_metadata", "_common_metadata", "index.json")
_IGNORED_SUFFIXES: Final = (".crc", ".md", ".txt", ".json")


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


def _split(prefix: str) -> tuple[str, str]:
    backend, _, key = prefix.partition("/")
    if not backend:
        raise InvalidRequestError(f"{prefix!r} is not BACKEND/PREFIX")
    # A prefix names a folder (as listings do): data/web and data/web/ are the same.
    key = key.strip("/")
    return backend, f"{key}/" if key else ""


def _wanted(key: str, fmt: str) -> str | None:
    """The format of ``key`` in a registration of ``fmt`` (None: not a member)."""
    base = posixpath.basename(key)
    if base.startswith(".") or base in _IGNORED:
        return None
    found = detect(key)
    if fmt == "auto":
        return found
    if found is not None:
        return fmt if found == fmt else None
    return None if base.lower().endswith(_IGNORED_SUFFIXES) else fmt


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
) -> Snapshot:
    """The snapshot of ``BACKEND/PREFIX``: every member listed, its metadata read.

    Args:
        client: the node's daemon (it lists; each worker makes its own).
        prefix: ``BACKEND/PREFIX`` (a prefix of keys: ``data/web/`` takes the keys
            below ``web/``).
        fmt: ``auto`` (by each key's ending) or a format's name
            (:func:`~chunkd.client.datasets.formats.names`).
        options: the format's options (``{"record_bytes": N}`` for ``fixed``;
            :func:`parse_format` gives them from ``--format``).
        skip_bad: record files that cannot be read as excluded, instead of stopping.
        concurrency: members read at once.
        progress: called with the progress, from the calling thread, as members land.
        client_factory: makes each worker's client (default: one like ``client``).

    Raises:
        DatasetFormatError: a file cannot be read as its format (without ``skip_bad``),
            or the prefix holds no member of the format.
        SnapshotDriftError: a file changed while it was read; register again.
    """
    backend, key_prefix = _split(prefix)
    opts = dict(options or {})
    state = Progress()
    members: list[Member] = []
    excluded: list[dict[str, str]] = []
    local = threading.local()
    # Each worker reads a footer or a header once: a small cache of its own, whose fds
    # (one per chunk) stay few whatever the count of files and workers.
    chunks = max(8, min(64, chunk_budget() // (max(1, concurrency) + 1)))
    make = client_factory or (
        lambda: type(client)(
            socket_path=client.socket_path, cache_bytes=_WORKER_CACHE_BYTES, cache_chunks=chunks
        )
    )
    made: list[Client] = []
    made_lock = threading.Lock()

    def worker_client() -> Client:
        mine = getattr(local, "client", None)
        if mine is None:
            mine = local.client = make()
            with made_lock:
                made.append(mine)
        return mine

    def scan_one(member: Member, member_options: dict[str, Any]) -> Member:
        source = PinnedSource(worker_client(), backend)
        return format_of(member.format).scan(source, member, member_options)

    manifest_bytes = [0]

    def land(future: Future[Member], member: Member) -> None:
        try:
            scanned = future.result()
        except (DatasetFormatError, ChunkdError) as exc:
            if not skip_bad or not isinstance(exc, DatasetFormatError):
                raise
            excluded.append({"key": member.key, "error": str(exc)})
            state.excluded += 1
        else:
            members.append(scanned)
            manifest_bytes[0] += len(canonical(scanned.to_json())) + 1
            if manifest_bytes[0] > MAX_LAYOUT:
                raise DatasetFormatError(
                    f"the snapshot of {prefix} would be over {MAX_LAYOUT >> 20} MiB of "
                    f"manifest after {len(members)} files (the most the registry takes): "
                    "register its folders as datasets of their own"
                )
        state.scanned += 1
        if progress is not None:
            progress(state)

    pending: deque[tuple[Future[Member], Member]] = deque()
    try:
        with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="chunkd-scan") as pool:
            for member, member_options in _candidates(client, backend, key_prefix, fmt, opts):
                state.listed += 1
                state.bytes += member.size
                pending.append((pool.submit(scan_one, member, member_options), member))
                # A bounded window of members in flight: the listing of 1M files is
                # never turned into 1M futures.
                while len(pending) >= 4 * max(1, concurrency) or (pending and pending[0][0].done()):
                    land(*pending.popleft())
            state.listing_done = True
            while pending:
                land(*pending.popleft())
    finally:
        for future, _ in pending:
            future.cancel()
        for mine in made:
            mine.close()
    if not members:
        raise DatasetFormatError(
            f"{prefix} holds no {'dataset' if fmt == 'auto' else fmt} files to register"
            + (f" ({len(excluded)} could not be read)" if excluded else "")
            + "; check the prefix, or name the format with --format"
        )
    formats = sorted({m.format for m in members})
    if len(formats) > 1:
        raise DatasetFormatError(
            f"{prefix} holds files of several formats ({', '.join(formats)}); register "
            "each under its own prefix, or name one with --format"
        )
    schema_of, members = settle(format_of(formats[0]), members)
    return Snapshot.build(
        backend=backend,
        prefix=key_prefix,
        format=formats[0],
        members=members,
        schema_of=schema_of,
        excluded=excluded,
    )


def _candidates(
    client: Client, backend: str, key_prefix: str, fmt: str, options: dict[str, Any]
) -> Iterator[tuple[Member, dict[str, Any]]]:
    """The members to read, in key order, with each one's format options."""
    # What the backend holds now: a listing the daemon kept would miss files just written.
    listed = client.iter_ls(f"{backend}/{key_prefix}".rstrip("/"), recursive=True, fresh=True)
    named = None if fmt == "auto" else format_of(fmt)
    if named is not None and named.index_name:
        # Its members are what its index files list: every file under the prefix, held
        # (name, size, version) until the indexes are read, which may come after them.
        files = [
            Member(key, int(entry["size"]), str(entry["version"]), fmt)
            for key, entry in _files(listed, backend, key_prefix)
        ]
        yield from named.members_of(key_prefix, files, PinnedSource(client, backend), options)
        return
    for key, entry in _files(listed, backend, key_prefix):
        member_fmt = _wanted(key, fmt)
        if member_fmt is None:
            continue
        indexed = format_of(member_fmt).index_name  # (auto only: a named one went above)
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
    (``{"id", "version", ...}``).

    Raises:
        InvalidRequestError: ``name`` is not a dataset name.
        ReadOnlyBackendError: the registry's backend is not writable.
        BackendUnavailableError: the registry's backend is down.
    """
    check_dataset_name(name)
    fd = memfd.sealed(snapshot.data, "chunkd-manifest")
    try:
        with client.request("ds_commit", {"name": name}, fds=[fd], timeout=None) as reply:
            return dict(reply.header)
    finally:
        memfd.close_all([fd])
