"""The ``ckpt_*`` requests of the local socket: checkpoints saved and loaded by trainers.

Each op, its fields, bounds, answer and errors are written down once, in
:data:`chunkd.client.protocol.OPS` (and its module's docs); the local server checks
a request against it before :func:`handle` gets its arguments. What is left to check
here is what no single field says: a rank inside its world size, the layout and
JSON fds (sealed memfds of at most :data:`~chunkd.client.protocol.MAX_LAYOUT`
bytes), chunk ids that parse.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from chunkd import memfd
from chunkd.cache import ChunkId, ChunkLease
from chunkd.client.protocol import (
    LIST_PAGE,
    MAX_LAYOUT,
    MAX_PAYLOAD,
    OPS,
    ProtocolError,
    error_answer,
    loads,
)
from chunkd.errors import InvalidChunkIdError, InvalidRequestError
from chunkd.gateway.checkpoints import Durability, SaveRequest
from chunkd.gateway.names import checkpoint_name

if TYPE_CHECKING:
    from chunkd.gateway.authority import Caller
    from chunkd.gateway.checkpoints import Checkpoints

__all__ = ["CKPT_OPS", "Answer", "handle"]

#: longest a ckpt_wait request is held before the client asks again
_WAIT_SLICE: Final = 10.0
#: what a listing page's entries may take of the payload (the rest is slack)
_LIST_BYTES: Final = MAX_PAYLOAD - 4096
#: the ops this module answers (declared in chunkd.client.protocol.OPS)
CKPT_OPS: Final = frozenset(name for name in OPS if name.startswith("ckpt_"))
#: the fields of ckpt_save that go into a SaveRequest as they are
_PASSED_ON: Final = tuple(f.name for f in OPS["ckpt_save"].fields if f.name != "name")


class Answer:
    """What one answer carries besides its header: leases to release, fds to send,
    fds to close once sent (the request's own among them), and a payload."""

    def __init__(self, request_fds: list[int], caller: Caller | None = None) -> None:
        self.request_fds = request_fds
        #: who sent the request (the kernel's word): the ops that change or remove
        #: what someone made check it (docs/security.md); None: the daemon itself
        self.caller = caller
        self.leases: list[ChunkLease] = []
        self.fds: list[int] = []
        self.owned: list[int] = list(request_fds)
        self.payload = b""

    async def send_chunk(self, lease: ChunkLease) -> None:
        """Send a leased chunk's sealed memfd (sealing a copy if it has none); the
        caller has put the lease in :attr:`leases` already."""
        fd = lease.fileno()
        if fd is None:  # no RAM copy (RAM full of pinned chunks): seal one for it
            fd = await memfd.sealed_off_loop(lease.view())
            self.owned.append(fd)
        self.fds.append(fd)


async def handle(
    store: Checkpoints, op: str, args: Mapping[str, Any], answer: Answer
) -> dict[str, Any]:
    """Answer one ``ckpt_*`` request whose fields ``args`` were checked against
    :data:`~chunkd.client.protocol.OPS`.

    Raises:
        InvalidRequestError: an argument is wrong (the connection stays).
        ChunkdError: what the checkpoint store raised.
    """
    if op == "ckpt_save":
        return await _save(store, args, answer)
    if op == "ckpt_wait":
        job = await store.wait(
            args["job"],
            Durability.parse(args["level"]),
            min(args["timeout"], _WAIT_SLICE),
            asked=_asked_save(args),
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
            args["name"],
            args["save_id"],
            args["world_size"],
            args["overwrite"],
            extra,
            caller=answer.caller,
        )
        return {"ok": True, "manifest_id": manifest_id}
    if op == "ckpt_manifest":
        manifest = await store.manifest(args["name"])
        _send_json(answer, await asyncio.to_thread(_sealed_json, manifest))
        return {"ok": True, "fds": 1}
    if op == "ckpt_chunks":
        return await _chunks(store, args, answer)
    if op == "ckpt_list":
        prefix, paged = args["prefix"], args["limit"] is not None
        entries, token = await store.entries_page(
            prefix,
            start_after=args["start_after"],
            limit=args["limit"] or LIST_PAGE,
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
        return {"ok": True, "removed": await store.delete(args["name"], caller=answer.caller)}
    if op == "ckpt_gc":
        report = await store.gc(
            args["target"],
            keep_last=args["keep_last"],
            grace=args["grace"],
            dry_run=args["dry_run"],
            caller=answer.caller,
        )
        # The names retired are not bounded: the whole report goes in a sealed memfd.
        _send_json(answer, await asyncio.to_thread(_sealed_json, report))
        answer.payload = json.dumps({k: v for k, v in report.items() if k != "retired"}).encode()
        return {"ok": True, "fds": 1}
    if op == "ckpt_scrub":
        page = await store.scrub(
            args["backend"],
            start_after=args["start_after"],
            limit=args["limit"],
            remove=args["remove"],
            caller=answer.caller,
        )
        return {"ok": True} | page.to_json()
    raise InvalidRequestError(f"unknown op {op!r}")


def _sealed_json(doc: Any) -> int:
    return memfd.sealed(json.dumps(doc, separators=(",", ":")).encode())


def _send_json(answer: Answer, fd: int) -> None:
    answer.owned.append(fd)
    answer.fds.append(fd)


def _asked_save(args: Mapping[str, Any]) -> SaveRequest | None:
    """The save a ``ckpt_wait`` names besides its job (None: an older client's request)."""
    if args["name"] is None:
        return None
    if args["save_id"] is None:  # a made-up id would look like a save that was lost
        raise InvalidRequestError("a ckpt_wait that names its save gives its save_id too")
    backend, path = checkpoint_name(args["name"])
    return SaveRequest.from_json(
        {
            "backend": backend,
            "path": path,
            "save_id": args["save_id"],
            "rank": args["rank"],
            "world_size": args["world_size"],
            "commit": args["commit"] or "auto",
            "segments": [],
        }
    )


async def _save(store: Checkpoints, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    layout_fd, data_fd = answer.request_fds  # two: the op table says so, and the server checked
    if args["rank"] >= args["world_size"]:
        raise InvalidRequestError(f"rank {args['rank']} is outside world_size {args['world_size']}")
    layout = await asyncio.to_thread(_load_json_fd, layout_fd)
    backend, path = checkpoint_name(args["name"])
    if not isinstance(layout, dict):
        raise InvalidRequestError("ckpt_save's layout must be a JSON object")
    request = SaveRequest.from_json(
        {k: args[k] for k in _PASSED_ON if args[k] is not None}
        | {"backend": backend, "path": path}
        | {"segments": layout.get("segments"), "tree": layout.get("tree")}
    )
    size = _sealed_size(data_fd)
    # An empty state still gets a mapping (mmap cannot map 0 bytes of a file).
    data = mmap.mmap(data_fd, size, prot=mmap.PROT_READ) if size else mmap.mmap(-1, 1)
    try:
        job = await store.save(request, data, size, caller=answer.caller)
    except BaseException:
        data.close()
        raise
    return {"ok": True} | job.describe()


async def _chunks(store: Checkpoints, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    backend = args["backend"]
    try:
        wanted = [ChunkId.parse(i) for i in args["ids"]]
    except InvalidChunkIdError as exc:
        raise InvalidRequestError(f"ckpt_chunks: {exc}") from None
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
    size = memfd.sealed_size(fd)
    if size is None:
        raise InvalidRequestError(
            "a checkpoint fd must be a memfd sealed against writes and resizes "
            "(F_SEAL_WRITE, F_SEAL_SHRINK, F_SEAL_GROW): its bytes could otherwise change "
            "after they were hashed"
        )
    return size


def _load_json_fd(fd: int) -> Any:
    size = _sealed_size(fd)
    if size > MAX_LAYOUT:
        raise InvalidRequestError(f"a JSON fd of {size} bytes exceeds {MAX_LAYOUT}")
    raw = os.pread(fd, size, 0)
    try:
        return loads(raw)
    except ProtocolError as exc:
        raise InvalidRequestError(f"a JSON fd: {exc}") from None
