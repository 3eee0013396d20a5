"""The registry's manifests by id: checked before they are registered, loaded and
kept parsed, each check and load in its turn.

What a manifest may cost the daemon, bounded before the work starts:

* **a manifest to commit** (``ds_commit``, and a migration's commit): at most
  :data:`COMMIT_CHECKS` are checked at once (the registry's turns, which page puts
  share); the others wait their turn in arrival order, holding their request's fd and
  nothing else (a client that leaves while it waits is dropped from the line). A
  check refuses a shape no manifest has before it parses anything
  (:func:`chunkd.snapshot.check_manifest_shape`). A manifest of up to
  :data:`IN_PROCESS_BYTES` is then parsed in a thread; a larger one in a worker
  process (``python -m chunkd.snapshot``) under an address-space limit of
  :data:`WORKER_BASE` + :data:`WORKER_RATIO` times its size and a time limit of
  :data:`WORKER_SECONDS`: the daemon's heap and event loop never carry its parse. A
  client's manifest may not carry ``content`` or ``origin`` (:attr:`Snapshot.claims`):
  chunkd records those itself, and only the daemon's own migrate commits them;
* **a manifest to resolve** (``ds_resolve``, ``ds_freeze``, ``ds_migrate``, the
  inspector's open; a schema-2 snapshot's root, whose pages are not read): parsed
  snapshots are kept by id, the most recently used first, up to :data:`PARSED_BYTES`
  of manifest bytes and :data:`PARSED_COUNT` manifests (a snapshot is immutable and
  its id names its bytes, so a kept one is always right). Concurrent resolves of one
  id share one load. A load takes a turn of the same :data:`COMMIT_CHECKS` as
  commits: one of up to :data:`IN_PROCESS_BYTES` is read and parsed in a thread; a
  larger one is read into a sealed memfd :data:`READ_PIECE` bytes at a time, its hash
  and shape are checked by a worker process first (a hostile one costs the daemon
  nothing more), and only then is it parsed in a thread of the daemon. That parse is
  the bound left: a legitimate manifest of 256 MiB holds the GIL for seconds
  (``json.loads``), once per id while it is kept (one larger than :data:`PARSED_BYTES`
  is not kept);
* **a schema-2 root to commit**: as a manifest above, and at most
  :data:`ROOT_MAX_BYTES` (a larger root is refused once the worker has checked it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from chunkd import memfd
from chunkd.client.protocol import MAX_LAYOUT
from chunkd.errors import (
    DatasetError,
    DatasetNotFoundError,
    ManifestError,
    RangeNotSatisfiableError,
)
from chunkd.gateway.datasets.documents import _oversized, read_document
from chunkd.ranges import ByteRange
from chunkd.snapshot import Snapshot, check_snapshot_id, snapshot_id

if TYPE_CHECKING:
    from chunkd.gateway.backends import Backend
    from chunkd.gateway.datasets.layout import Layout

__all__ = [
    "COMMIT_CHECKS",
    "IN_PROCESS_BYTES",
    "PARSED_BYTES",
    "PARSED_COUNT",
    "READ_PIECE",
    "ROOT_MAX_BYTES",
    "WORKER_BASE",
    "WORKER_RATIO",
    "WORKER_SECONDS",
    "Manifests",
]

log = logging.getLogger("chunkd.gateway.datasets.registry")  # as before the split

#: manifests checked at once; more commits wait their turn
COMMIT_CHECKS: Final = 2
#: a manifest up to this size is parsed in a thread of the daemon: json.loads, which
#: holds the GIL throughout, took 3 ms for 148 KiB of a real manifest (about 5 ms at
#: this size; 3-10 times that on a loaded node); a larger one goes to a worker
IN_PROCESS_BYTES: Final = 256 << 10
#: a worker's address-space limit: this ...
WORKER_BASE: Final = 256 << 20
#: ... plus this many times the manifest's size (a worker checking a real manifest
#: peaks at 13.3-13.6 times its size: WebDataset-like manifests of 64 and 240 MiB, the
#: densest kind, in bench/dataset_bench.py)
WORKER_RATIO: Final = 20
#: the longest a worker's check may take, in seconds
WORKER_SECONDS: Final = 600.0
#: the parsed manifests kept, by their bytes (a parsed one takes about 14 times its
#: bytes in Python objects: up to about 900 MiB of the daemon's memory) ...
PARSED_BYTES: Final = 64 << 20
#: ... and by count
PARSED_COUNT: Final = 64
#: the most bytes of a large manifest the daemon holds in its heap while it reads it
#: into a memfd for its worker
READ_PIECE: Final = 8 << 20
#: the largest schema-2 root a commit takes (a root's page entry is about 150-2,300
#: bytes, by its keys; 100M members in pages of 4,096 on average come to about 25,000
#: entries, 4-55 MiB)
ROOT_MAX_BYTES: Final = 64 << 20


class Manifests:
    """The manifests of one dataset registry, by id (see the module docstring).

    Args:
        layout: the registry's layout (where a manifest's key is).
        backend: the registry's backend, looked up at each use (it raises
            :class:`~chunkd.errors.UnknownBackendError` naming the registry's key).
        turns: the registry's turns: manifest checks and loads, and page checks, run
            at most :data:`COMMIT_CHECKS` at once.
    """

    def __init__(
        self, layout: Layout, backend: Callable[[], Backend], turns: asyncio.Semaphore
    ) -> None:
        self.layout = layout
        self._backend = backend
        self._checks = turns
        #: parsed snapshots by id, least recently used first, and their bytes together
        self._parsed: OrderedDict[str, Snapshot] = OrderedDict()
        self._parsed_bytes = 0
        #: the loads in flight, by id: every concurrent resolve of one id awaits one
        self._loading: dict[str, asyncio.Future[Snapshot]] = {}

    async def get(self, ident: str) -> Snapshot:
        """The snapshot whose id is ``ident``, checked against it: a kept one, or the
        load in flight for it, or a new load (see the module docstring for what one
        may cost).

        Raises:
            DatasetNotFoundError: no manifest has that id.
            ManifestError: the stored bytes do not hash to it (torn or forged), are
                not a manifest this code reads, or are larger than any manifest.
        """
        check_snapshot_id(ident)
        kept = self._parsed.get(ident)
        if kept is not None:
            self._parsed.move_to_end(ident)
            return _own(kept)
        loading = self._loading.get(ident)
        if loading is None:
            loading = asyncio.ensure_future(self._load(ident))
            self._loading[ident] = loading
            loading.add_done_callback(functools.partial(self._loaded, ident))
        # A caller that leaves (its client closed) does not cancel the others' load.
        return _own(await asyncio.shield(loading))

    def _loaded(self, ident: str, loading: asyncio.Future[Snapshot]) -> None:
        self._loading.pop(ident, None)
        if loading.cancelled() or loading.exception() is not None:
            return  # its waiters got the error (retrieved here: none may be left)
        snapshot = loading.result()
        size = len(snapshot.data)
        if size > PARSED_BYTES or ident in self._parsed:
            return
        self._parsed[ident] = snapshot
        self._parsed_bytes += size
        while len(self._parsed) > PARSED_COUNT or self._parsed_bytes > PARSED_BYTES:
            _, dropped = self._parsed.popitem(last=False)
            self._parsed_bytes -= len(dropped.data)

    async def _load(self, ident: str) -> Snapshot:
        """Read and parse manifest ``ident``, in its turn."""
        key = self.layout.manifest(ident)
        backend = self._backend()
        started = time.monotonic()
        # The first read is bounded by IN_PROCESS_BYTES: not worth a turn.
        try:
            raw = await backend.get(key, ByteRange(0, IN_PROCESS_BYTES + 1))
        except RangeNotSatisfiableError:  # an empty object: no manifest
            raw = memoryview(b"")
        if raw is None:
            raise DatasetNotFoundError(f"no snapshot {ident} in the dataset registry")
        async with self._checks:
            if len(raw) <= IN_PROCESS_BYTES:
                snapshot = await asyncio.to_thread(Snapshot.parse, raw, ident)
            else:
                del raw
                snapshot = await self._load_large(backend, key, ident)
            log.info(
                "snapshot %s parsed: %d bytes in %.2fs",
                ident,
                len(snapshot.data),
                time.monotonic() - started,
            )
            return snapshot

    async def _load_large(self, backend: Backend, key: str, ident: str) -> Snapshot:
        """A manifest over :data:`IN_PROCESS_BYTES`: into a sealed memfd piece by piece,
        its hash and shape checked by a worker, then parsed here."""
        meta = await backend.head(key)
        if meta is None:
            raise DatasetNotFoundError(f"no snapshot {ident} in the dataset registry")
        if meta.size > MAX_LAYOUT:  # no commit takes one: not read at all
            raise _oversized(key, f"{meta.size} bytes", MAX_LAYOUT)
        size = meta.size
        fd = memfd.create("chunkd-manifest", size)
        try:
            for start in range(0, size, READ_PIECE):
                piece = await backend.get(key, ByteRange(start, min(size, start + READ_PIECE)))
                if piece is None:
                    raise DatasetNotFoundError(f"no snapshot {ident} in the dataset registry")
                if len(piece) != min(READ_PIECE, size - start):
                    raise _torn(ident, "it changed while it was read")
                await asyncio.to_thread(memfd.write_at, fd, piece, start)
                del piece
            memfd.seal(fd)
            answer = await _check_in_worker(fd, size, shape_only=True)
            if answer.get("id") != ident:
                raise _torn(ident, f"it hashes to {answer.get('id')}")
            data = await asyncio.to_thread(os.pread, fd, size, 0)
        finally:
            os.close(fd)
        return await asyncio.to_thread(functools.partial(Snapshot.parse, data, ident, checked=True))

    async def check(
        self, data: bytes | memoryview, *, fd: int | None = None, verified_copy: bool = False
    ) -> tuple[str, Snapshot | None]:
        """The id of manifest ``data``, and the snapshot when it is a schema-2 root (or
        small enough to be parsed here: None for a large schema-1 manifest, which a
        worker checked), once it is checked whole as :meth:`Snapshot.parse`
        checks it: its shape first, then a full parse (see the module docstring for
        where, and what it may cost). At most :data:`COMMIT_CHECKS` run at once; a
        call waits its turn, in order.

        Args:
            data: the manifest's bytes.
            fd: a sealed memfd holding the same bytes, if the caller has one (a worker
                reads it without a copy; otherwise one is made for a large manifest).
            verified_copy: the manifest is the daemon's own migrate's, whose members'
                ``content`` and ``origin`` it recorded itself; otherwise a manifest
                that carries either (:attr:`Snapshot.claims`) is refused.

        Raises:
            ManifestError: ``data`` is not a manifest (refused by its shape before it
                is parsed, by its parse, or by the memory its parse took), or claims
                what only chunkd records.
            DatasetError: the worker failed (its exit status and last words are logged).
        """
        async with self._checks:
            if len(data) <= IN_PROCESS_BYTES:
                snapshot = await asyncio.to_thread(Snapshot.parse, bytes(data))
                ident, claims = snapshot.id, snapshot.claims
            else:
                owned: int | None = None
                if fd is None:
                    fd = owned = await asyncio.to_thread(memfd.sealed, data, "chunkd-manifest")
                try:
                    answer = await _check_in_worker(fd, len(data))
                finally:
                    if owned is not None:
                        os.close(owned)
                ident = check_snapshot_id(str(answer.get("id")))
                found = answer.get("claims")
                claims = tuple(str(c) for c in found) if isinstance(found, list) else ()
                snapshot = None
                if _may_be_root(data, answer):
                    if len(data) > ROOT_MAX_BYTES:
                        raise ManifestError(
                            f"the root of snapshot {ident} is {len(data)} bytes, more than a "
                            f"root's {ROOT_MAX_BYTES} ({ROOT_MAX_BYTES >> 20} MiB); nothing "
                            "was registered: register the dataset's folders as datasets of "
                            "their own"
                        )
                    # A root is small beside its members: parsed here for its pages
                    # (the worker checked its shape and hash from these very bytes).
                    parsed = await asyncio.to_thread(
                        functools.partial(Snapshot.parse, bytes(data), ident, checked=True)
                    )
                    snapshot = parsed if parsed.schema >= 2 else None
        if claims and not verified_copy:
            raise _claimed(claims)
        return ident, snapshot

    async def store(self, backend: Backend, ident: str, data: bytes | memoryview) -> None:
        """Step 2 of a commit: the manifest, put if absent (a torn one replaced)."""
        key = self.layout.manifest(ident)
        if await backend.put(key, data, if_absent=True):
            return
        try:
            there = await read_document(backend, key, limit=MAX_LAYOUT)
        except ManifestError:  # over any manifest's size: not this one
            there = None
        if there is not None and await asyncio.to_thread(snapshot_id, there) == ident:
            return
        log.warning(
            "dataset registry: %s/%s does not hash to its id (torn or altered); replaced",
            backend.name,
            key,
        )
        await backend.put(key, data)


def _own(snapshot: Snapshot) -> Snapshot:
    """A caller's own copy of a kept snapshot: a paged one holds the pages its caller
    loads (``load_pages``) in a cache of its own, freed with it, so that what one
    request loads is neither kept for the daemon's life with the snapshot nor evicted by
    another request's loads. Its root is shared (the copy costs O(pages))."""
    return snapshot.with_pages(None) if snapshot.schema >= 2 else snapshot


async def _check_in_worker(fd: int, size: int, *, shape_only: bool = False) -> dict[str, Any]:
    """The answer of a worker process (:func:`chunkd.snapshot.manifest_check_main`)
    that checked the manifest in memfd ``fd`` (``size`` bytes): ``"id"``, and
    ``"claims"`` unless ``shape_only`` (its hash and shape alone). The worker is killed
    if the check is given up (the client left, the daemon stops) or takes too long.

    Raises:
        ManifestError: the manifest is refused (the worker's message).
        DatasetError: the worker failed.
    """
    limit = WORKER_BASE + WORKER_RATIO * size
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-P",  # the working directory is not on its import path
        "-m",
        "chunkd.snapshot",
        "--memory",
        str(limit),
        *(["--shape-only"] if shape_only else []),
        stdin=fd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), WORKER_SECONDS)
    except TimeoutError:
        raise ManifestError(
            f"checking a manifest of {size} bytes took more than {WORKER_SECONDS:g}s; "
            "it was given up (nothing was registered)"
        ) from None
    finally:
        if process.returncode is None:
            process.kill()
            with contextlib.suppress(ProcessLookupError, asyncio.CancelledError):
                await asyncio.shield(process.wait())
    try:
        answer = json.loads(out.splitlines()[-1]) if out.strip() else None
    except ValueError:
        answer = None
    if process.returncode != 0 or not isinstance(answer, dict):
        log.warning(
            "the check of a manifest of %d bytes failed (worker exit status %s): %s",
            size,
            process.returncode,
            err[-2000:].decode(errors="replace").strip(),
        )
        raise DatasetError(
            f"the check of a manifest of {size} bytes failed (its worker exited with status "
            f"{process.returncode}); nothing was registered: the daemon's log says more"
        )
    log.info(
        "manifest of %d bytes checked in a worker%s in %.2fs, peak %.0f MiB",
        size,
        " (hash and shape)" if shape_only else "",
        time.monotonic() - started,
        float(answer.get("peak_bytes") or 0) / 2**20,
    )
    if "error" in answer:
        raise ManifestError(str(answer.get("message")))
    ident = answer.get("id")
    if not isinstance(ident, str):  # pragma: no cover - the worker is chunkd's own
        raise DatasetError(f"the check of a manifest answered no id: {answer!r:.200}")
    check_snapshot_id(ident)
    return answer


def _may_be_root(data: bytes | memoryview, answer: dict[str, Any]) -> bool:
    """Whether a manifest a worker checked may be a schema-2 root: its answer's
    ``schema`` where it gives one, else whether the bytes hold a root's page list."""
    schema = answer.get("schema")
    if isinstance(schema, int) and not isinstance(schema, bool):
        return schema >= 2
    return bytes(data).find(b'"pages":[[') >= 0


def _torn(ident: str, why: str) -> ManifestError:
    return ManifestError(
        f"the manifest stored as snapshot {ident} is torn or was altered ({why}); "
        "register the dataset again (nothing was read from it)"
    )


def _claimed(claims: tuple[str, ...]) -> ManifestError:
    said = {"content": "a content hash of its members ('content')", "origin": "an 'origin'"}
    return ManifestError(
        f"the manifest claims {' and '.join(said.get(c, repr(c)) for c in claims)}: "
        "chunkd records those itself, from the bytes it reads (chunkd dataset migrate "
        "writes both into the copy it registers; a freeze writes the hashes into its "
        "frozen record), and never takes them from a client, since diff trusts them; "
        "leave them out of the manifest (nothing was registered)"
    )
