"""The ``ckpt_*`` requests of the local socket: checkpoints saved and loaded by trainers.

Framing, hello and errors are those of :mod:`chunkd.client.protocol`. Each request
is answered once; its arguments are checked (types and bounds) before anything is
done, and a wrong one is answered with ``InvalidRequestError``. Requests::

    {"op": "ckpt_save", "name": "BACKEND/PATH", "save_id": ID, "rank": R,
     "world_size": W, "durability": "staged|local|remote", "overwrite": B,
     "commit": "auto|none", "step": S}        + 2 fds: the layout (JSON) and the
                                                staged bytes, both sealed memfds
        -> {"ok": true, "job": JOB, "state": ..., "durability": ..., ...}
    {"op": "ckpt_wait", "job": JOB, "level": LEVEL, "timeout": SECONDS,
     "name": ..., "save_id": ID, "rank": R, "world_size": W, "commit": "auto|none"}
        -> the job as above, once it reached LEVEL or failed, or after the timeout
           (at most 10 s: the client asks again). A daemon that does not know JOB
           (it restarted, or forgot the job an hour after it ended) looks for the
           save that ``name``, ``save_id`` and ``rank`` describe in the backend and
           answers what became of it: committed, its part there, or lost.
    {"op": "ckpt_commit", "name": ..., "save_id": ID, "world_size": W,
     "overwrite": B}                          + 1 optional fd: extra manifest fields
        -> {"ok": true, "manifest_id": ID}
    {"op": "ckpt_manifest", "name": ...}      -> 1 fd: the manifest, JSON
    {"op": "ckpt_chunks", "backend": B, "ids": [ID, ...]}
        -> {"ok": true, "sizes": [...]} + one sealed memfd per chunk
    {"op": "ckpt_list", "prefix": "BACKEND[/PREFIX]", "start_after": KEY|null,
     "limit": N}
        -> {"ok": true, "count": N, "next": KEY|null}, payload: a JSON array of
           entries (name, step, sizes, dedup ratio, durability, state, created), in
           the order of their manifest keys. One page: ``limit`` is at most
           MAX_LIST_PAGE (default LIST_PAGE); a page may hold fewer entries (even
           none) to fit the payload or to bound the work of one request; ``next`` is
           the token to send back as ``start_after``, null on the last page. A
           request without ``limit`` (an older client, which reads one page) is
           refused when there is more than one page, rather than answered in part.
    {"op": "ckpt_delete", "name": ...}        -> {"ok": true, "removed": N}
    {"op": "ckpt_gc", "target": ..., "keep_last": N|null, "grace": SECONDS,
     "dry_run": B}                            -> 1 fd: the JSON report, whatever the
                                                number of checkpoints it retired;
                                                payload: the report without the
                                                names ("retired")

The bounds: ``world_size`` at most :data:`~chunkd.client.protocol.MAX_WORLD_SIZE`,
``ids`` at most :data:`~chunkd.client.protocol.MAX_FDS`, a layout at most
:data:`MAX_LAYOUT` bytes, holding at most :data:`MAX_SEGMENTS` segments whose
offsets and sizes are at most :data:`MAX_STAGED_BYTES`; a ``step`` within a signed
64-bit integer (:data:`MAX_STEP`); durations at most :data:`MAX_SECONDS`; names at
most 1200 bytes; ``limit`` at most :data:`~chunkd.client.protocol.MAX_LIST_PAGE`.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import mmap
import os
from typing import TYPE_CHECKING, Any, Final

from chunkd.cache import ChunkId, ChunkLease
from chunkd.cache.ram import seal_memfd, seal_memfd_off_loop
from chunkd.client.protocol import (
    LIST_PAGE,
    MAX_FDS,
    MAX_LIST_PAGE,
    MAX_PAYLOAD,
    MAX_WORLD_SIZE,
    ProtocolError,
    loads,
)
from chunkd.errors import InvalidChunkIdError, InvalidRequestError
from chunkd.gateway import arguments as arg
from chunkd.gateway.checkpoints import (
    MAX_SEGMENTS,
    MAX_STAGED_BYTES,
    MAX_STEP,
    Durability,
    SaveRequest,
)
from chunkd.gateway.names import checkpoint_name
from chunkd.gateway.status import error_answer

if TYPE_CHECKING:
    from chunkd.gateway.checkpoints import Checkpoints

__all__ = [
    "CKPT_OPS",
    "FD_OPS",
    "MAX_LAYOUT",
    "MAX_SECONDS",
    "MAX_SEGMENTS",
    "MAX_STAGED_BYTES",
    "MAX_STEP",
    "Answer",
    "handle",
]

#: longest a ckpt_wait request is held before the client asks again
_WAIT_SLICE: Final = 10.0
#: the largest layout or JSON fd a request may carry
MAX_LAYOUT: Final = 256 << 20
#: the longest duration a request may name (a grace period, a timeout): ten years
MAX_SECONDS: Final = 10 * 365 * 86400.0
_REQUIRED_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
_NAME_BYTES: Final = 1200
#: what a listing page's entries may take of the payload (the rest is slack)
_LIST_BYTES: Final = MAX_PAYLOAD - 4096

CKPT_OPS: Final = frozenset(
    {
        "ckpt_save",
        "ckpt_wait",
        "ckpt_commit",
        "ckpt_manifest",
        "ckpt_chunks",
        "ckpt_list",
        "ckpt_delete",
        "ckpt_gc",
    }
)
#: ops whose requests carry fds
FD_OPS: Final = frozenset({"ckpt_save", "ckpt_commit"})


class Answer:
    """What one answer carries besides its header: leases to release, fds to send,
    fds to close once sent (the request's own among them), and a payload."""

    def __init__(self, request_fds: list[int]) -> None:
        self.request_fds = request_fds
        self.leases: list[ChunkLease] = []
        self.fds: list[int] = []
        self.owned: list[int] = list(request_fds)
        self.payload = b""

    async def send_chunk(self, lease: ChunkLease) -> None:
        """Send a leased chunk's sealed memfd (sealing a copy if it has none); the
        caller has put the lease in :attr:`leases` already."""
        fd = lease.fileno()
        if fd is None:  # no RAM copy (RAM full of pinned chunks): seal one for it
            fd = await seal_memfd_off_loop(lease.view())
            self.owned.append(fd)
        self.fds.append(fd)


async def handle(
    store: Checkpoints, op: str, header: dict[str, Any], answer: Answer
) -> dict[str, Any]:
    """Answer one ``ckpt_*`` request.

    Raises:
        InvalidRequestError: an argument is wrong (the connection stays).
        ChunkdError: what the checkpoint store raised.
    """
    if op == "ckpt_save":
        return await _save(store, header, answer.request_fds)
    if op == "ckpt_wait":
        job = await store.wait(
            arg.text(header, "job", max_bytes=64),
            Durability.parse(header.get("level", "remote")),
            min(arg.number(header, "timeout", low=0, high=MAX_SECONDS, default=0), _WAIT_SLICE),
            asked=_asked_save(header),
        )
        if job.error is not None:
            return error_answer(job.error) | {"job": job.describe()}
        return {"ok": True} | job.describe()
    if op == "ckpt_commit":
        extra: dict[str, Any] = {}
        if answer.request_fds:
            extra = await asyncio.to_thread(_load_json_fd, answer.request_fds[0])
            if not isinstance(extra, dict):
                raise InvalidRequestError("ckpt_commit's fd must hold a JSON object")
        manifest_id = await store.commit(
            arg.text(header, "name", max_bytes=_NAME_BYTES),
            arg.text(header, "save_id", max_bytes=64),
            arg.whole(header, "world_size", low=1, high=MAX_WORLD_SIZE),
            arg.flag(header, "overwrite"),
            extra,
        )
        return {"ok": True, "manifest_id": manifest_id}
    if op == "ckpt_manifest":
        manifest = await store.manifest(arg.text(header, "name", max_bytes=_NAME_BYTES))
        fd = await asyncio.to_thread(
            seal_memfd, memoryview(json.dumps(manifest, separators=(",", ":")).encode())
        )
        answer.owned.append(fd)
        answer.fds.append(fd)
        return {"ok": True, "fds": 1}
    if op == "ckpt_chunks":
        return await _chunks(store, header, answer)
    if op == "ckpt_list":
        prefix = arg.text(header, "prefix", max_bytes=_NAME_BYTES)
        paged = header.get("limit") is not None
        entries, token = await store.entries_page(
            prefix,
            start_after=arg.optional_text(header, "start_after", max_bytes=_NAME_BYTES + 32),
            limit=arg.whole(header, "limit", low=1, high=MAX_LIST_PAGE, default=LIST_PAGE),
            max_bytes=_LIST_BYTES,
        )
        if token is not None and not paged:
            raise InvalidRequestError(
                f"there are more checkpoints under {prefix} than one answer holds, and this "
                "client reads only one; install the same chunkd version for the trainers "
                "and the daemon (its client reads every page)"
            )
        answer.payload = json.dumps(entries).encode()
        return {"ok": True, "count": len(entries), "next": token}
    if op == "ckpt_delete":
        removed = await store.delete(arg.text(header, "name", max_bytes=_NAME_BYTES))
        return {"ok": True, "removed": removed}
    if op == "ckpt_gc":
        keep = header.get("keep_last")
        report = await store.gc(
            arg.text(header, "target", max_bytes=_NAME_BYTES),
            keep_last=None if keep is None else arg.whole(header, "keep_last", low=0, high=1 << 31),
            grace=arg.number(header, "grace", low=0, high=MAX_SECONDS, default=3600),
            dry_run=arg.flag(header, "dry_run"),
        )
        # The names retired are not bounded: the whole report goes in a sealed memfd.
        fd = await asyncio.to_thread(seal_memfd, memoryview(json.dumps(report).encode()))
        answer.owned.append(fd)
        answer.fds.append(fd)
        answer.payload = json.dumps({k: v for k, v in report.items() if k != "retired"}).encode()
        return {"ok": True, "fds": 1}
    raise InvalidRequestError(f"unknown op {op!r}")


def _asked_save(header: dict[str, Any]) -> SaveRequest | None:
    """The save a ``ckpt_wait`` names besides its job (None: an older client's request)."""
    if header.get("name") is None:
        return None
    backend, path = checkpoint_name(arg.text(header, "name", max_bytes=_NAME_BYTES))
    return SaveRequest.from_json(
        {
            "backend": backend,
            "path": path,
            "save_id": arg.text(header, "save_id", max_bytes=64),
            "rank": header.get("rank"),
            "world_size": header.get("world_size"),
            "commit": header.get("commit") or "auto",
            "segments": [],
        }
    )


_SAVE_FIELDS: Final = (
    "save_id",
    "rank",
    "world_size",
    "durability",
    "overwrite",
    "commit",
    "step",
)


async def _save(
    store: Checkpoints, header: dict[str, Any], request_fds: list[int]
) -> dict[str, Any]:
    if len(request_fds) != 2:
        raise InvalidRequestError("ckpt_save carries two fds: the layout and the staged bytes")
    layout_fd, data_fd = request_fds
    world = arg.whole(header, "world_size", low=1, high=MAX_WORLD_SIZE, default=1)
    arg.whole(header, "rank", low=0, high=world - 1, default=0)
    layout = await asyncio.to_thread(_load_json_fd, layout_fd)
    backend, path = checkpoint_name(header.get("name"))
    if not isinstance(layout, dict):
        raise InvalidRequestError("ckpt_save's layout must be a JSON object")
    request = SaveRequest.from_json(
        {k: header.get(k) for k in _SAVE_FIELDS if header.get(k) is not None}
        | {"backend": backend, "path": path}
        | {"segments": layout.get("segments"), "tree": layout.get("tree")}
    )
    size = _sealed_size(data_fd)
    # An empty state still gets a mapping (mmap cannot map 0 bytes of a file).
    data = mmap.mmap(data_fd, size, prot=mmap.PROT_READ) if size else mmap.mmap(-1, 1)
    try:
        job = await store.save(request, data, size)
    except BaseException:
        data.close()
        raise
    return {"ok": True} | job.describe()


async def _chunks(store: Checkpoints, header: dict[str, Any], answer: Answer) -> dict[str, Any]:
    ids = header.get("ids")
    if not isinstance(ids, list) or len(ids) > MAX_FDS:
        raise InvalidRequestError(f"ckpt_chunks wants 'ids': a list of at most {MAX_FDS} chunk ids")
    backend = arg.text(header, "backend", max_bytes=64)
    try:
        wanted = [ChunkId.parse(i) for i in ids if isinstance(i, str)]
    except InvalidChunkIdError as exc:
        raise InvalidRequestError(f"ckpt_chunks: {exc}") from None
    if len(wanted) != len(ids):
        raise InvalidRequestError("ckpt_chunks wants 'ids' as strings of 64 hex digits")
    got = await asyncio.gather(*(store.chunk(backend, c) for c in wanted), return_exceptions=True)
    leases = [g for g in got if isinstance(g, ChunkLease)]
    answer.leases.extend(leases)  # released once the answer is sent, whatever happens
    for outcome in got:
        if isinstance(outcome, BaseException):
            raise outcome
    for lease in leases:
        await answer.send_chunk(lease)
    return {"ok": True, "sizes": [lease.size for lease in leases]}


def _sealed_size(fd: int) -> int:
    """The size of a memfd sealed against writes and resizes; InvalidRequestError otherwise."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise InvalidRequestError("a checkpoint fd must be a memfd") from None
    if seals & _REQUIRED_SEALS != _REQUIRED_SEALS:
        raise InvalidRequestError(
            "a checkpoint fd must be sealed (F_SEAL_WRITE, F_SEAL_SHRINK, F_SEAL_GROW): "
            "its bytes could otherwise change after they were hashed"
        )
    return os.fstat(fd).st_size


def _load_json_fd(fd: int) -> Any:
    size = _sealed_size(fd)
    if size > MAX_LAYOUT:
        raise InvalidRequestError(f"a JSON fd of {size} bytes exceeds {MAX_LAYOUT}")
    raw = os.pread(fd, size, 0)
    try:
        return loads(raw)
    except ProtocolError as exc:
        raise InvalidRequestError(f"a JSON fd: {exc}") from None
