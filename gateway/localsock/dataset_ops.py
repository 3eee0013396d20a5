"""The ``ds_*`` requests of the local socket: the dataset registry.

Each op, its fields, bounds, answer and errors are written down once, in
:data:`chunkd.client.protocol.OPS`; the server checks a request against it before a
handler here gets its arguments. What is left here: the manifest fd of ``ds_commit``
(a sealed memfd of at most :data:`~chunkd.client.protocol.MAX_LAYOUT` bytes), and the
fds and payloads of the answers, and the page fd of ``ds_page_put`` (a sealed memfd
of at most :data:`~chunkd.snapshot.PAGE_MAX_BYTES`, refused by its size before it is
read). The registry's protocols are in
:mod:`chunkd.gateway.datasets.layout`, and what a commit may cost the daemon in
:mod:`chunkd.gateway.datasets.registry`: the manifest's memfd is mapped, not read into
the daemon's heap, and a large one is checked by a worker that reads the fd itself.
``ds_decode`` is answered by :mod:`chunkd.gateway.decoding` (docs/decoding.md), the
decode service the server was given. Every ``ds_*`` op is refused where the daemon
serves no registry.
"""

from __future__ import annotations

import contextlib
import json
import mmap
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

from chunkd import memfd
from chunkd.client.protocol import FIRST_BATCH_PHASES, MAX_LAYOUT, check_job_name
from chunkd.errors import ChunkdError, InvalidRequestError
from chunkd.gateway.costs.attribution import ATTRIBUTION
from chunkd.gateway.localsock.answer import LIST_BYTES, sealed_size
from chunkd.gateway.localsock.family import Family, Parts
from chunkd.snapshot import PAGE_MAX_BYTES

if TYPE_CHECKING:
    from chunkd.gateway.datasets import Datasets
    from chunkd.gateway.localsock.answer import Answer

__all__ = ["FAMILY"]

#: the handlers of this module's ops
FAMILY: Final = Family("dataset")


def _registry(parts: Parts) -> Datasets:
    if parts.datasets is None:
        raise ChunkdError("this daemon serves no dataset registry")
    return parts.datasets


@FAMILY.op("ds_commit")
async def _commit(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    datasets = _registry(parts)
    fd = answer.request_fds[0]
    with _mapped(fd, "ds_commit", MAX_LAYOUT, "a manifest") as data:
        return {"ok": True} | await datasets.commit(data, args["name"], fd=fd, caller=answer.caller)


@FAMILY.op("ds_page_put")
async def _page_put(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    datasets = _registry(parts)
    fd = answer.request_fds[0]
    with _mapped(fd, "ds_page_put", PAGE_MAX_BYTES, "a page") as data:
        return {"ok": True} | await datasets.put_page(data)


@FAMILY.op("ds_page")
async def _page_of(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    lease = await _registry(parts).page_lease(args["page"], args["registry"])
    answer.leases.append(lease)  # released once the answer is sent, whatever happens
    await answer.send_chunk(lease)
    return {"ok": True, "page": args["page"], "size": lease.size, "fds": 1}


@FAMILY.op("ds_resolve")
async def _resolve(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    resolved, frozen = await _registry(parts).resolve(args["ref"])
    snapshot = resolved.snapshot
    answer.send_fd(await memfd.sealed_off_loop(snapshot.data))
    if frozen is not None:
        await answer.send_json(frozen)
    return {
        "ok": True,
        "snapshot": snapshot.id,
        "name": resolved.name,
        "version": resolved.version,
        "tags": list(resolved.tags),
        "created": resolved.created,
        "frozen": frozen is not None,
        "chunks_backend": None if frozen is None else frozen.get("backend"),
        "registry": parts.dataset_registry,
        "fds": len(answer.fds),
    }


@FAMILY.op("ds_list")
async def _list(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    entries, token = await _registry(parts).names_page(
        args["prefix"] or "", start_after=args["start_after"], limit=args["limit"]
    )
    return _page(answer, entries, token)


@FAMILY.op("ds_versions")
async def _versions(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    entries, after = await _registry(parts).versions_page(
        args["name"], start_after=args["start_after"], limit=args["limit"]
    )
    return _page(answer, entries, after)


@FAMILY.op("ds_tag")
async def _tag(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    datasets = _registry(parts)
    entry = await datasets.tag(args["name"], args["tag"], args["ref"], caller=answer.caller)
    shown = {k: entry[k] for k in ("name", "tag", "seq", "version")}
    return {"ok": True, "snapshot": entry["id"]} | shown


@FAMILY.op("ds_freeze")
async def _freeze(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    return {"ok": True} | await _registry(parts).freeze(args["ref"], caller=answer.caller)


@FAMILY.op("ds_migrate")
async def _migrate(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    return {"ok": True} | await _registry(parts).migrate(
        args["ref"], args["to"], args["name"], caller=answer.caller
    )


@FAMILY.op("ds_first_batch")
async def _first_batch(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    _registry(parts)  # refused as every ds_* op is where the daemon serves no registry
    for phase in FIRST_BATCH_PHASES:
        if args[phase] is not None:
            parts.metrics.dataset_first_batch.labels(phase).observe(args[phase])
    if parts.jobs is not None:
        who = ATTRIBUTION.get()
        job = who.job if args["train_job"] is None else check_job_name(args["train_job"])
        phases = {p: args[p] for p in FIRST_BATCH_PHASES if args[p] is not None}
        parts.jobs.first_batch(job, who.uid, args["rank"], phases)
    return {"ok": True}


@FAMILY.op("ds_decode")
async def _decode(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    _registry(parts)
    service = parts.decoder
    if service is None:
        return {"ok": True, "decoded": False, "reason": "off", "message": "no decode service"}
    fields, table = await service.decode(dict(args))
    if table is not None:
        answer.send_fd(table)
    return {"ok": True} | fields


@FAMILY.op("ds_decode_report")
async def _decode_report(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    _registry(parts)
    if parts.decoder is not None:
        parts.decoder.report(args["decodes"])
    return {"ok": True}


def _page(answer: Answer, entries: list[dict[str, Any]], token: object) -> dict[str, Any]:
    """A listing page: its entries as the payload (cut to fit, the token moved back)."""
    payload = json.dumps(entries, separators=(",", ":")).encode()
    if len(payload) > LIST_BYTES:  # pragma: no cover - names and ids are bounded
        raise InvalidRequestError("a listing page does not fit one answer; ask with a lower limit")
    answer.payload = payload
    return {"ok": True, "count": len(entries), "next": token}


@contextlib.contextmanager
def _mapped(fd: int, op: str, limit: int, what: str) -> Iterator[memoryview]:
    """The bytes of a request's memfd (``ds_commit``'s manifest, ``ds_page_put``'s
    page), mapped read-only: the client's pages, not a copy in the daemon's heap (and
    none is touched before the request's turn comes). Its size is checked first."""
    size = sealed_size(fd, f"{op}'s fd")
    if size > limit:
        raise InvalidRequestError(
            f"{what} of {size} bytes exceeds {limit} ({limit >> 20} MiB), the most the "
            "registry takes"
            + (
                ": register the dataset's folders as datasets of their own"
                if op == "ds_commit"
                else " (chunkd.snapshot.PageWriter cuts pages within it)"
            )
        )
    if not size:
        yield memoryview(b"")
        return
    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    view = memoryview(mapping)
    try:
        yield view
    finally:
        try:
            view.release()
            mapping.close()
        except BufferError:  # a put or hash given up still holds it: unmapped when it ends
            pass
