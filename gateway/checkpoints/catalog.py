"""The catalog: listing the checkpoints under a prefix (committed ones, and saves in
flight on this node), and deleting one. Every listing is the backend's own."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any, Final

from chunkd.errors import CheckpointNotFoundError
from chunkd.gateway.checkpoints.jobs import Jobs, each
from chunkd.gateway.checkpoints.model import (
    CHECKPOINTS,
    is_manifest,
    manifest_key,
    path_of_manifest,
)
from chunkd.gateway.names import checkpoint_name, split_prefix

if TYPE_CHECKING:
    from chunkd.gateway.backends import Backend, Backends, ObjectMeta

__all__ = ["Catalog"]

_SUMMARIES_AT_ONCE: Final = 32
#: backend keys one listing page looks at, at most
_PAGE_SCAN_KEYS: Final = 20_000


class Catalog:
    """The checkpoints of the backends, as a listing.

    Args:
        backends: the configured backends.
        jobs: the jobs this daemon knows (saves in flight are listed too).
    """

    def __init__(self, backends: Backends, jobs: Jobs) -> None:
        self.backends = backends
        self.jobs = jobs

    async def entries_page(
        self,
        prefix: str,
        *,
        start_after: str | None = None,
        limit: int = 1000,
        max_bytes: int = 1 << 20,
    ) -> tuple[list[dict[str, Any]], str | None]:
        """One page of the checkpoints under ``BACKEND[/PREFIX]``: committed ones, and
        saves in flight on this node, in the order of their manifest keys.

        Returns the entries and the page token (None on the last page): the key after
        which the next page starts. A page holds at most ``limit`` entries whose JSON
        takes at most ``max_bytes``, and looks at no more than
        :data:`_PAGE_SCAN_KEYS` backend keys, so it may hold fewer entries (even none)
        before the last page. The listing is the backend's own, never a cached one.
        """
        backend, path = self.listed(prefix)
        base = f"{CHECKPOINTS}{path}" if path else CHECKPOINTS.rstrip("/")
        after = start_after or ""
        pending = sorted(
            (k, e) for k, e in self._in_flight(backend.name, path).items() if k > after
        )
        page: list[dict[str, Any]] = []
        used = 2  # the brackets of the JSON array
        last: str | None = None  # the key of the last entry in the page

        def add(key: str, entry: dict[str, Any]) -> bool:
            """Put ``entry`` in the page; False (and nothing added) when it is full."""
            nonlocal used, last
            size = len(json.dumps(entry)) + 2
            if len(page) >= limit or used + size > max_bytes:
                return False
            page.append(entry)
            used += size
            last = key
            return True

        def flush(upto: str | None, *, inclusive: bool = False) -> bool:
            """Add the saves in flight before key ``upto`` (or at it, or all: None);
            False when the page is full."""
            while pending and (
                upto is None or pending[0][0] < upto or (inclusive and pending[0][0] == upto)
            ):
                if not add(*pending[0]):
                    return False
                pending.pop(0)
            return True

        scanned = 0
        async with contextlib.aclosing(backend.scan(base, start_after=start_after)) as batches:
            async for batch in batches:
                manifests = [m for m in batch if is_manifest(m.key)]
                for start in range(0, len(manifests), _SUMMARIES_AT_ONCE):
                    group = manifests[start : start + _SUMMARIES_AT_ONCE]
                    summaries = await each(group, functools.partial(self._summary, backend))
                    for meta, summary in zip(group, summaries, strict=True):
                        if not flush(meta.key):
                            return page, last
                        if pending and pending[0][0] == meta.key and summary is not None:
                            pending.pop(0)  # committed: the manifest says more
                        if summary is not None and not add(meta.key, summary):
                            return page, last
                scanned += len(batch)
                if scanned >= _PAGE_SCAN_KEYS:
                    end = batch[-1].key  # enough work for one request: the rest next time
                    return page, end if flush(end, inclusive=True) else last
        if not flush(None):
            return page, last
        return page, None

    async def entries(self, prefix: str) -> list[dict[str, Any]]:
        """Every checkpoint under ``BACKEND[/PREFIX]`` (:meth:`entries_page`, page by page)."""
        out: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            page, token = await self.entries_page(prefix, start_after=token)
            out += page
            if token is None:
                return out

    def listed(self, prefix: str) -> tuple[Backend, str]:
        """The backend and path of ``BACKEND[/PREFIX]``."""
        backend_name, path = split_prefix(prefix)
        return self.backends.get(backend_name), path

    def _in_flight(self, backend: str, path: str) -> dict[str, dict[str, Any]]:
        """Saves in flight here under ``path`` (whole components), by manifest key."""
        out: dict[str, dict[str, Any]] = {}
        for job in sorted(self.jobs, key=lambda j: j.started):
            request = job.request
            if (
                request.backend == backend
                and (not path or f"{request.path}/".startswith(f"{path}/"))
                and job.state != "done"
            ):
                out[request.manifest_key] = {  # the newest save of a name wins
                    "name": request.name,
                    "step": request.step,
                    "logical_bytes": job.logical,
                    "new_bytes": job.new,
                    "dedup_ratio": None,
                    "durability": job.describe()["durability"],
                    "state": job.state,
                    "world_size": request.world_size,
                    "created": job.started,
                }
        return out

    async def _summary(self, backend: Backend, meta: ObjectMeta) -> dict[str, Any] | None:
        """The listing entry of the manifest ``meta``; None if it is gone or torn."""
        raw = await backend.get(meta.key)
        if raw is None:
            return None  # deleted meanwhile
        try:
            return _summary(backend.name, meta.key, json.loads(bytes(raw)), meta)
        except (ValueError, KeyError, TypeError):
            return None  # torn: not a checkpoint

    async def committed(self, backend: Backend, path: str) -> AsyncGenerator[dict[str, Any], None]:
        """The committed checkpoints under ``path``, in key order, straight from the backend."""
        base = f"{CHECKPOINTS}{path}" if path else CHECKPOINTS.rstrip("/")
        async with contextlib.aclosing(backend.scan(base)) as batches:
            async for batch in batches:
                manifests = [m for m in batch if is_manifest(m.key)]
                for summary in await each(manifests, functools.partial(self._summary, backend)):
                    if summary is not None:
                        yield summary

    async def delete(
        self,
        name: str,
        *,
        save_id: str | None = None,
        may_delete: Callable[[dict[str, Any]], None] | None = None,
    ) -> int:
        """Delete checkpoint ``name``: its manifest first, then the parts it names.

        Returns the objects removed. Its chunks stay until ``chunkd gc`` finds them
        unreferenced; parts of other saves under the same name are left alone.
        ``save_id``: delete only the checkpoint that save committed (retention, which
        decided on a listing: a save may have committed another one there since).
        ``may_delete``: called with the manifest (``{}`` when torn) before anything is
        deleted; it raises to refuse (the caller's authority, docs/security.md).

        Raises:
            CheckpointNotFoundError: no checkpoint of that name (or of that save).
            AccessDeniedError: what ``may_delete`` raised.
        """
        backend_name, path = checkpoint_name(name)
        backend = self.backends.get(backend_name)
        backend.check_writable()
        key = manifest_key(path)
        raw = await backend.get(key)
        if raw is None:
            raise CheckpointNotFoundError(f"no checkpoint named {name}")
        try:
            doc = json.loads(bytes(raw))
            parts = [str(p["key"]) for p in doc["parts"]]
        except (ValueError, KeyError, TypeError):
            doc, parts = {}, []  # a torn manifest: no checkpoint, but remove it
        if save_id is not None and doc.get("save_id") != save_id:
            raise CheckpointNotFoundError(
                f"checkpoint {name} was committed again (save {doc.get('save_id')!r}) after it "
                "was listed for retention; it is kept"
            )
        if may_delete is not None:
            may_delete(doc if isinstance(doc, dict) else {})
        await backend.delete(key)  # the checkpoint is gone from here on
        for part in parts:
            await backend.delete(part)
        return 1 + len(parts)


def _summary(backend: str, key: str, doc: dict[str, Any], meta: ObjectMeta) -> dict[str, Any]:
    logical, new = int(doc["logical_bytes"]), int(doc["new_bytes"])
    path = path_of_manifest(key)
    return {
        "name": f"{backend}/{path}",
        "step": doc.get("step"),
        "logical_bytes": logical,
        "new_bytes": new,
        "dedup_ratio": round(logical / new, 3) if new else None,
        "durability": "remote",
        "state": "committed",
        "world_size": doc.get("world_size"),
        "created": doc.get("created", meta.modified),
        "save_id": doc.get("save_id"),
        "owner": doc.get("owner"),
    }
