"""Committing: the coordinator's step 8 of the commit protocol (:mod:`.save`). It waits
until every rank's part is in the backend, then writes ``manifest.json`` with one
put-if-absent (unless ``overwrite``): the checkpoint exists from that PUT on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import TYPE_CHECKING, Any

import blake3

from chunkd.canonical import canonical
from chunkd.client.protocol import MAX_LAYOUT, MAX_WORLD_SIZE, ProtocolError, loads
from chunkd.errors import (
    AccessDeniedError,
    CheckpointError,
    CheckpointExistsError,
    InvalidRequestError,
    RangeNotSatisfiableError,
)
from chunkd.gateway.checkpoints.jobs import backend_fault, each, polling, retrying
from chunkd.gateway.checkpoints.model import (
    MANIFEST_KEYS,
    SCHEMA,
    SaveJob,
    SaveRequest,
    check_save_id,
    manifest_key,
    part_rank,
    parts_prefix,
)
from chunkd.gateway.names import checkpoint_name
from chunkd.ranges import ByteRange

if TYPE_CHECKING:
    from chunkd.gateway.backends import Backend, Backends

__all__ = ["Committer"]


class Committer:
    """Manifests written once every part is in, and waits for another rank's commit.

    Args:
        backends: the configured backends.
        part_timeout: seconds a coordinator waits for the other ranks' parts (and a
            rank for its coordinator's commit).
        poll_interval: the longest pause between two looks for parts or a manifest.
    """

    def __init__(self, backends: Backends, *, part_timeout: float, poll_interval: float) -> None:
        self.backends = backends
        self.part_timeout = part_timeout
        self.poll_interval = poll_interval

    async def write_manifest(
        self,
        job: SaveJob | None,
        backend: Backend,
        world_size: int,
        overwrite: bool,
        extra: dict[str, Any],
        *,
        path: str | None = None,
        save_id: str | None = None,
        owner: int | None = None,
        admin: bool = False,
    ) -> str:
        """Wait for every part, then write the manifest; returns its id (blake3).

        ``owner``: the uid that commits (a job's own request's, or ``ckpt_commit``'s
        caller), an admin when ``admin``. Every part records the uid that saved it; they
        must all be one uid, the manifest's ``owner``, and a non-admin commits only
        their own parts. With ``overwrite``, a checkpoint there that another uid made is
        replaced only by an admin (docs/security.md).

        Raises:
            AccessDeniedError: the parts are another user's, or ``overwrite`` of another
                user's checkpoint, by a non-admin.
            CheckpointError: the parts were saved by several users.
        """
        if job is not None:
            path, save_id = job.request.path, job.request.save_id
            owner, admin = job.request.uid, job.request.admin
            job.state = "waiting for parts"
        assert path is not None
        assert save_id is not None
        prefix = parts_prefix(path, save_id)
        if job is None and owner is not None and not admin:
            # Another user's commit of these parts is refused before it waits for them.
            saver = await self._a_savers_uid(backend, prefix)
            if saver is not None and saver != owner:
                raise _not_their_parts(owner, f"{backend.name}/{path}", save_id, saver)
        deadline = time.monotonic() + self.part_timeout
        pauses = polling(self.poll_interval).delays()
        while True:
            parts = await retrying(job, lambda: self._parts(backend, prefix, world_size))
            if parts is not None:
                break
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"checkpoint {backend.name}/{path}: not every one of {world_size} ranks "
                    f"saved its part within {self.part_timeout:g}s; nothing was committed"
                )
            await asyncio.sleep(next(pauses))
        saver = _saver_of(parts, f"{backend.name}/{path}", save_id)
        if saver is not None and owner is not None and saver != owner and not admin:
            raise _not_their_parts(owner, f"{backend.name}/{path}", save_id, saver)
        owner = saver if saver is not None else owner
        logical = sum(p["logical_bytes"] for p in parts)
        manifest = {
            "format": "chunkd-checkpoint",
            "schema": SCHEMA,
            "name": f"{backend.name}/{path}",
            "save_id": save_id,
            "world_size": world_size,
            "step": parts[0].get("step"),
            "created": time.time(),
            "logical_bytes": logical,
            "new_bytes": sum(p["new_bytes"] for p in parts),
            "parts": [
                {"rank": p["rank"], "key": f"{prefix}{p['rank']}.json", "blake3": p["_id"]}
                for p in parts
            ],
        }
        if owner is not None:
            manifest["owner"] = owner
        assert not set(extra) & set(manifest)
        manifest |= extra
        body = canonical(manifest)
        key = manifest_key(path)
        if job is not None:
            job.state = "committing"

        if overwrite and not admin and owner is not None:  # None: journaled before owners
            await self.may_replace(backend, key, owner)

        async def put_manifest() -> bool:
            backend_fault("ckpt.manifest")
            return await backend.put(key, body, if_absent=not overwrite)

        wrote = await retrying(job, put_manifest)
        if not wrote:
            ours = await self._committed_id(backend, key, manifest)
            if ours is not None:  # a retried PUT, or a resumed job: it went in before
                if job is not None:
                    job.manifest_id = ours
                return ours
            raise CheckpointExistsError(
                f"checkpoint {backend.name}/{path} was committed by another save meanwhile; "
                "this one was not (pass overwrite=True to replace it)"
            )
        manifest_id = blake3.blake3(body).hexdigest()
        if job is not None:
            job.manifest_id = manifest_id
        return manifest_id

    async def may_replace(self, backend: Backend, key: str, owner: int) -> None:
        """Raise unless the checkpoint at ``key`` (if any) may be replaced by ``owner``
        (a non-admin): none there (or a torn one, which is no checkpoint), or one
        ``owner`` made.

        Raises:
            AccessDeniedError: another user's checkpoint (or one that records no owner).
        """
        doc = await self._manifest_at(backend, key)
        if doc is None:
            return
        there = doc.get("owner")
        if there != owner:
            name = doc.get("name", key)
            made = "records no owner" if there is None else f"was made by uid {there}"
            raise AccessDeniedError(
                f"uid {owner} may not overwrite checkpoint {name}: it {made}; only its owner, "
                "root, the daemon's own user and members of server.admin_group may"
            )

    async def _manifest_at(self, backend: Backend, key: str) -> dict[str, Any] | None:
        """The manifest at ``key`` as a JSON object, bounded and parsed off the loop;
        None when there is none or it is torn (no checkpoint)."""
        try:
            raw = await backend.get(key, ByteRange(0, MAX_LAYOUT + 1))
        except RangeNotSatisfiableError:  # empty: torn
            return None
        if raw is None or raw.nbytes > MAX_LAYOUT:
            return None
        try:
            doc = await asyncio.to_thread(loads, bytes(raw))
        except ProtocolError:
            return None
        return doc if isinstance(doc, dict) else None

    async def _committed_id(self, backend: Backend, key: str, ours: dict[str, Any]) -> str | None:
        """The id of the manifest at ``key`` if it is this commit's (``ours``, but for
        its time): the same save, owner and parts, hash for hash; else None. One made
        from this save's id by another commit (another world size, other parts, another
        owner) is not this one's."""
        raw = await backend.get(key)
        if raw is None:
            return None
        try:
            doc = json.loads(bytes(raw))
        except (ValueError, RecursionError):
            return None
        if isinstance(doc, dict) and all(
            doc.get(field) == ours.get(field)
            for field in ("save_id", "owner", "world_size", "parts")
        ):
            return blake3.blake3(raw).hexdigest()
        return None

    async def _a_savers_uid(self, backend: Backend, prefix: str) -> int | None:
        """The uid the first part under ``prefix`` records (None: no part yet, or one
        that records none)."""
        async with contextlib.aclosing(backend.scan(prefix.rstrip("/"), batch=16)) as batches:
            async for batch in batches:
                for meta in batch:
                    raw = await backend.get(meta.key, ByteRange(0, MAX_LAYOUT + 1))
                    try:
                        doc = None if raw is None else loads(bytes(raw))
                    except ProtocolError:
                        continue
                    uid = doc.get("uid") if isinstance(doc, dict) else None
                    return uid if isinstance(uid, int) and not isinstance(uid, bool) else None
        return None

    async def check_own_part(self, backend: Backend, request: SaveRequest) -> None:
        """A part found at ``request``'s key when this job put its own (put if absent):
        this save's, by the same uid (a job resumed after its part went in), or refused.

        Raises:
            AccessDeniedError: another user's part under this save's id and rank.
        """
        raw = await backend.get(request.part_key)
        try:
            doc = None if raw is None else json.loads(bytes(raw))
        except (ValueError, RecursionError):
            doc = None
        there = doc.get("uid") if isinstance(doc, dict) else None
        if request.uid is not None and there != request.uid:
            raise AccessDeniedError(
                f"checkpoint {request.name}: rank {request.rank}'s part of save "
                f"{request.save_id} is there already, saved by "
                f"{'no recorded user' if there is None else f'uid {there}'}, not by this "
                f"save's uid {request.uid}; save again under another save id"
            )

    async def _parts(
        self, backend: Backend, prefix: str, world_size: int
    ) -> list[dict[str, Any]] | None:
        """Every part under ``prefix`` (with its id), or None while some are missing.

        A look costs what is present (one listing request per 1000 parts), whatever
        ``world_size`` is; the parts are read once all of them are there.
        """
        present: set[int] = set()
        async with contextlib.aclosing(backend.scan(prefix.rstrip("/"))) as batches:
            async for batch in batches:
                for meta in batch:
                    rank = part_rank(meta.key[len(prefix) :], world_size)
                    if rank is not None:
                        present.add(rank)
        if len(present) < world_size:
            return None

        async def read(rank: int) -> dict[str, Any]:
            key = f"{prefix}{rank}.json"
            raw = await backend.get(key)
            if raw is None:  # listed a moment ago: removed since
                raise backend.not_found(key)
            part: dict[str, Any] = json.loads(bytes(raw))
            part["_id"] = blake3.blake3(raw).hexdigest()
            return part

        return await each(range(world_size), read)

    async def await_commit(self, job: SaveJob, backend: Backend) -> None:
        key = job.request.manifest_key
        deadline = time.monotonic() + self.part_timeout
        pauses = polling(self.poll_interval).delays()
        while True:
            raw = await retrying(job, lambda: backend.get(key))
            try:
                doc = None if raw is None else json.loads(bytes(raw))
            except ValueError:
                doc = None  # torn: not a commit
            if doc is not None and doc.get("save_id") == job.request.save_id:
                assert raw is not None
                job.manifest_id = blake3.blake3(raw).hexdigest()
                return
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"checkpoint {job.request.name}: rank 0 did not commit within "
                    f"{self.part_timeout:g}s"
                )
            await asyncio.sleep(next(pauses))

    async def commit(
        self,
        name: str,
        save_id: str,
        world_size: int,
        overwrite: bool,
        extra: dict[str, Any],
        *,
        owner: int | None = None,
        admin: bool = False,
    ) -> str:
        """Commit a save made with ``commit="none"`` once all its parts are in;
        ``owner`` and ``admin`` as :meth:`write_manifest` takes them.

        Raises:
            AccessDeniedError: ``overwrite`` of another user's checkpoint, by a non-admin.
            InvalidRequestError: ``save_id`` or ``world_size`` is malformed or out of
                bounds, or ``extra`` would replace a field of chunkd's, or holds what
                canonical JSON cannot (``NaN``, ``Infinity``, a lone surrogate).
            CheckpointExistsError: another save committed the name meanwhile.
            CheckpointError: the parts did not all come within the part timeout.
        """
        backend_name, path = checkpoint_name(name)
        check_save_id(save_id)
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise InvalidRequestError(
                f"world_size must be from 1 to {MAX_WORLD_SIZE}; got {world_size}"
            )
        clash = sorted(set(extra) & MANIFEST_KEYS)
        if clash:
            raise InvalidRequestError(
                f"the extra manifest fields of a commit must not replace chunkd's own; "
                f"{clash[:5]} are chunkd's"
            )
        try:
            canonical(extra)  # refused now, not after the parts' wait, and nothing is put
        except ValueError as exc:
            raise InvalidRequestError(
                f"the extra manifest fields of checkpoint {name} cannot be stored: {exc}"
            ) from None
        backend = self.backends.get(backend_name)
        backend.check_writable()
        return await self.write_manifest(
            None,
            backend,
            world_size,
            overwrite,
            extra,
            path=path,
            save_id=save_id,
            owner=owner,
            admin=admin,
        )


def _saver_of(parts: list[dict[str, Any]], name: str, save_id: str) -> int | None:
    """The one uid the parts of a save record (None: they record none: saved before
    chunkd recorded owners).

    Raises:
        CheckpointError: they record several (or some do and some do not).
    """
    uids = {p.get("uid") for p in parts}
    if len(uids) > 1:
        raise CheckpointError(
            f"checkpoint {name}: the parts of save {save_id} were saved by several users "
            f"({sorted(str(u) for u in uids)}); nothing was committed: save again, every "
            "rank as one user"
        )
    uid = uids.pop() if uids else None
    return uid if isinstance(uid, int) and not isinstance(uid, bool) else None


def _not_their_parts(owner: int, name: str, save_id: str, saver: int) -> AccessDeniedError:
    return AccessDeniedError(
        f"uid {owner} may not commit checkpoint {name}: the parts of save {save_id} were "
        f"saved by uid {saver}; only that user, root, the daemon's own user and members of "
        "server.admin_group may commit them"
    )
