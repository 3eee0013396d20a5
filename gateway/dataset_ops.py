"""The ``ds_*`` requests of the local socket: the dataset registry.

Each op, its fields, bounds, answer and errors are written down once, in
:data:`chunkd.client.protocol.OPS`; the local server checks a request against it before
:func:`handle` gets its arguments. What is left here: the manifest fd of ``ds_commit``
(a sealed memfd of at most :data:`~chunkd.client.protocol.MAX_LAYOUT` bytes), and the
fds and payloads of the answers, and the page fd of ``ds_page_put`` (a sealed memfd
of at most :data:`~chunkd.snapshot.PAGE_MAX_BYTES`, refused by its size before it is
read). The registry's protocols are in
:mod:`chunkd.gateway.datasets.layout`, and what a commit may cost the daemon in
:mod:`chunkd.gateway.datasets.registry`: the manifest's memfd is mapped, not read into
the daemon's heap, and a large one is checked by a worker that reads the fd itself.
``ds_decode`` is answered by :mod:`chunkd.gateway.decoding` (docs/decoding.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import mmap
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

from chunkd import memfd
from chunkd.client.protocol import FIRST_BATCH_PHASES, MAX_LAYOUT, MAX_PAYLOAD, OPS
from chunkd.errors import InvalidRequestError
from chunkd.snapshot import PAGE_MAX_BYTES

if TYPE_CHECKING:
    from chunkd.gateway.checkpoint_ops import Answer
    from chunkd.gateway.datasets import Datasets

__all__ = ["DS_OPS", "handle"]

#: the ops this module answers (declared in chunkd.client.protocol.OPS)
DS_OPS: Final = frozenset(name for name in OPS if name.startswith("ds_"))
#: what a listing page's entries may take of the payload (the rest is slack)
_LIST_BYTES: Final = MAX_PAYLOAD - 4096


async def handle(
    datasets: Datasets, op: str, args: Mapping[str, Any], answer: Answer
) -> dict[str, Any]:
    """Answer one ``ds_*`` request whose fields ``args`` were checked against
    :data:`~chunkd.client.protocol.OPS`.

    Raises:
        InvalidRequestError: an argument is wrong (the connection stays).
        ChunkdError: what the registry raised.
    """
    if op == "ds_commit":
        fd = answer.request_fds[0]
        with _mapped(fd, "ds_commit", MAX_LAYOUT, "a manifest") as data:
            return {"ok": True} | await datasets.commit(
                data, args["name"], fd=fd, caller=answer.caller
            )
    if op == "ds_page_put":
        fd = answer.request_fds[0]
        with _mapped(fd, "ds_page_put", PAGE_MAX_BYTES, "a page") as data:
            return {"ok": True} | await datasets.put_page(data)
    if op == "ds_page":
        lease = await datasets.page_lease(args["page"], args["registry"])
        answer.leases.append(lease)  # released once the answer is sent, whatever happens
        await answer.send_chunk(lease)
        return {"ok": True, "page": args["page"], "size": lease.size, "fds": 1}
    if op == "ds_resolve":
        resolved, frozen = await datasets.resolve(args["ref"])
        snapshot = resolved.snapshot
        _send(answer, await memfd.sealed_off_loop(snapshot.data))
        if frozen is not None:
            _send(answer, await asyncio.to_thread(_sealed_json, frozen))
        return {
            "ok": True,
            "snapshot": snapshot.id,
            "name": resolved.name,
            "version": resolved.version,
            "tags": list(resolved.tags),
            "created": resolved.created,
            "frozen": frozen is not None,
            "chunks_backend": None if frozen is None else frozen.get("backend"),
            "registry": datasets.registry.registry,
            "fds": len(answer.fds),
        }
    if op == "ds_list":
        entries, token = await datasets.names_page(
            args["prefix"] or "", start_after=args["start_after"], limit=args["limit"]
        )
        return _page(answer, entries, token)
    if op == "ds_versions":
        entries, after = await datasets.versions_page(
            args["name"], start_after=args["start_after"], limit=args["limit"]
        )
        return _page(answer, entries, after)
    if op == "ds_tag":
        entry = await datasets.tag(args["name"], args["tag"], args["ref"], caller=answer.caller)
        shown = {k: entry[k] for k in ("name", "tag", "seq", "version")}
        return {"ok": True, "snapshot": entry["id"]} | shown
    if op == "ds_freeze":
        return {"ok": True} | await datasets.freeze(args["ref"], caller=answer.caller)
    if op == "ds_first_batch":
        for phase in FIRST_BATCH_PHASES:
            if args[phase] is not None:
                datasets.metrics.dataset_first_batch.labels(phase).observe(args[phase])
        return {"ok": True}
    if op in ("ds_decode", "ds_decode_report"):
        service = datasets.decoding
        if op == "ds_decode_report":
            if service is not None:
                service.report(args["decodes"])
            return {"ok": True}
        if service is None:
            return {"ok": True, "decoded": False, "reason": "off", "message": "no decode service"}
        fields, table = await service.decode(dict(args))
        if table is not None:
            _send(answer, table)
        return {"ok": True} | fields
    if op == "ds_migrate":
        return {"ok": True} | await datasets.migrate(
            args["ref"], args["to"], args["name"], caller=answer.caller
        )
    raise InvalidRequestError(f"unknown op {op!r}")


def _page(answer: Answer, entries: list[dict[str, Any]], token: object) -> dict[str, Any]:
    """A listing page: its entries as the payload (cut to fit, the token moved back)."""
    payload = json.dumps(entries, separators=(",", ":")).encode()
    if len(payload) > _LIST_BYTES:  # pragma: no cover - names and ids are bounded
        raise InvalidRequestError("a listing page does not fit one answer; ask with a lower limit")
    answer.payload = payload
    return {"ok": True, "count": len(entries), "next": token}


def _send(answer: Answer, fd: int) -> None:
    answer.owned.append(fd)
    answer.fds.append(fd)


def _sealed_json(doc: Any) -> int:
    return memfd.sealed(json.dumps(doc, separators=(",", ":")).encode())


@contextlib.contextmanager
def _mapped(fd: int, op: str, limit: int, what: str) -> Iterator[memoryview]:
    """The bytes of a request's memfd (``ds_commit``'s manifest, ``ds_page_put``'s
    page), mapped read-only: the client's pages, not a copy in the daemon's heap (and
    none is touched before the request's turn comes). Its size is checked first."""
    size = memfd.sealed_size(fd)
    if size is None:
        raise InvalidRequestError(
            f"{op}'s fd must be a memfd sealed against writes and resizes (F_SEAL_WRITE, "
            "F_SEAL_SHRINK, F_SEAL_GROW): its bytes could otherwise change after they were hashed"
        )
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
