"""The ``ckpt_*`` ops of the local socket: checkpoints saved and loaded by trainers.

Each op, its fields, bounds, answer and errors are written down once, in
:data:`chunkd.client.protocol.OPS` (and its module's docs); the server checks a
request against it before a handler here gets its arguments. What is left to check
here is what no single field says: a rank inside its world size, the layout and
JSON fds (sealed memfds of at most :data:`~chunkd.client.protocol.MAX_LAYOUT`
bytes), chunk ids that parse. Each handler asks the checkpoint store
(:class:`~chunkd.gateway.checkpoints.Checkpoints`) through its public methods.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from chunkd.cache import ChunkId, ChunkLease
from chunkd.client.protocol import (
    LIST_PAGE,
    MAX_LAYOUT,
    OPS,
    ProtocolError,
    error_answer,
    loads,
)
from chunkd.errors import ChunkdError, InvalidChunkIdError, InvalidRequestError
from chunkd.gateway.checkpoints import Durability, SaveRequest
from chunkd.gateway.localsock.answer import LIST_BYTES, sealed_size
from chunkd.gateway.localsock.family import Family, Parts
from chunkd.gateway.names import checkpoint_name

if TYPE_CHECKING:
    from chunkd.gateway.checkpoints import Checkpoints
    from chunkd.gateway.localsock.answer import Answer

__all__ = ["FAMILY"]

#: the handlers of this module's ops
FAMILY: Final = Family("checkpoint")

#: longest a ckpt_wait request is held before the client asks again
_WAIT_SLICE: Final = 10.0
#: the fields of ckpt_save that go into a SaveRequest as they are
_PASSED_ON: Final = tuple(f.name for f in OPS["ckpt_save"].fields if f.name != "name")


def _store(parts: Parts) -> Checkpoints:
    if parts.checkpoints is None:
        raise ChunkdError("this daemon serves no checkpoints")
    return parts.checkpoints


@FAMILY.op("ckpt_wait")
async def _wait(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    job = await _store(parts).wait(
        args["job"],
        Durability.parse(args["level"]),
        min(args["timeout"], _WAIT_SLICE),
        asked=_asked_save(args),
    )
    knows = args["level"] == "replicated"
    if job.error is not None:
        return error_answer(job.error) | {"job": _told(job.describe(), knows=knows)}
    # met: the level asked is reached (a save without replicas meets "replicated" at
    # "local", which its durability says).
    met = job.meets(Durability.parse(args["level"]))
    return {"ok": True, "met": met} | _told(job.describe(), knows=knows)


def _told(described: dict[str, Any], *, knows: bool) -> dict[str, Any]:
    """A job's description as a client is told it: the level ``replicated`` only to
    a client that shows it knows the name (it asked for that level, or gave
    ``replicas``); an older client knows three levels (its ``DURABILITY_LEVELS.index``
    raised on a fourth), and is told ``local``, which a replicated save also is."""
    if not knows and described.get("durability") == "replicated":
        described["durability"] = "local"
    return described


@FAMILY.op("ckpt_commit")
async def _commit(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    store = _store(parts)
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


@FAMILY.op("ckpt_manifest")
async def _manifest(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    await answer.send_json(await _store(parts).manifest(args["name"]))
    return {"ok": True, "fds": 1}


@FAMILY.op("ckpt_list")
async def _list(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    prefix, paged = args["prefix"], args["limit"] is not None
    entries, token = await _store(parts).entries_page(
        prefix,
        start_after=args["start_after"],
        limit=args["limit"] or LIST_PAGE,
        max_bytes=LIST_BYTES,
    )
    if token is not None and not paged:
        raise InvalidRequestError(
            f"there are more checkpoints under {prefix} than one answer holds, and this "
            "client reads only one; install the same chunkd version for the trainers "
            "and the daemon (its client reads every page)"
        )
    answer.payload = json.dumps(entries).encode()
    return {"ok": True, "count": len(entries), "next": token}


@FAMILY.op("ckpt_delete")
async def _delete(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    removed = await _store(parts).delete(args["name"], caller=answer.caller)
    return {"ok": True, "removed": removed}


@FAMILY.op("ckpt_gc")
async def _gc(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    report = await _store(parts).gc(
        args["target"],
        keep_last=args["keep_last"],
        grace=args["grace"],
        dry_run=args["dry_run"],
        caller=answer.caller,
    )
    # The names retired are not bounded: the whole report goes in a sealed memfd.
    await answer.send_json(report)
    answer.payload = json.dumps({k: v for k, v in report.items() if k != "retired"}).encode()
    return {"ok": True, "fds": 1}


@FAMILY.op("ckpt_scrub")
async def _scrub(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    page = await _store(parts).scrub(
        args["backend"],
        start_after=args["start_after"],
        limit=args["limit"],
        remove=args["remove"],
        caller=answer.caller,
    )
    return {"ok": True} | page.to_json()


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


@FAMILY.op("ckpt_save")
async def _save(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    store = _store(parts)
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
    size = sealed_size(data_fd, "a checkpoint fd")
    # An empty state still gets a mapping (mmap cannot map 0 bytes of a file).
    data = mmap.mmap(data_fd, size, prot=mmap.PROT_READ) if size else mmap.mmap(-1, 1)
    try:
        job = await store.save(request, data, size, caller=answer.caller)
    except BaseException:
        data.close()
        raise
    knows = args["durability"] == "replicated" or args["replicas"] is not None
    return {"ok": True} | _told(job.describe(), knows=knows)


@FAMILY.op("ckpt_chunks")
async def _chunks(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    store = _store(parts)
    backend = args["backend"]
    try:
        wanted = [ChunkId.parse(i) for i in args["ids"]]
    except InvalidChunkIdError as exc:
        raise InvalidRequestError(f"ckpt_chunks: {exc}") from None
    part = None
    if args["save"] is not None and args["node"] is not None and args["replicas"]:
        part = (args["save"], args["node"], args["replicas"])
    got = await asyncio.gather(
        *(store.chunk(backend, c, part=part) for c in wanted), return_exceptions=True
    )
    leases = [g for g in got if isinstance(g, ChunkLease)]
    answer.leases.extend(leases)  # released once the answer is sent, whatever happens
    for outcome in got:
        if isinstance(outcome, BaseException):
            raise outcome
    for lease in leases:
        await answer.send_chunk(lease)
    return {"ok": True, "sizes": [lease.size for lease in leases]}


def _load_json_fd(fd: int) -> Any:
    size = sealed_size(fd, "a checkpoint fd")
    if size > MAX_LAYOUT:
        raise InvalidRequestError(f"a JSON fd of {size} bytes exceeds {MAX_LAYOUT}")
    raw = os.pread(fd, size, 0)
    try:
        return loads(raw)
    except ProtocolError as exc:
        raise InvalidRequestError(f"a JSON fd: {exc}") from None
