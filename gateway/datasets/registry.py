"""The registry's names: commits of versions, tags, resolving a reference, listings.

The layout and the commit and tag protocols are written down in :mod:`.layout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from chunkd.errors import (
    BackendUnavailableError,
    DatasetError,
    DatasetNotFoundError,
    ManifestError,
    ReadOnlyBackendError,
    UnknownBackendError,
)
from chunkd.gateway.checkpoints.jobs import each
from chunkd.gateway.datasets.layout import COMMIT_TRIES, MAX_NUMBER, Layout
from chunkd.snapshot import (
    Ref,
    Snapshot,
    check_dataset_name,
    check_snapshot_id,
    check_tag,
    parse_ref,
    snapshot_id,
)

if TYPE_CHECKING:
    from chunkd.gateway.backends import Backend, Backends

__all__ = ["MAX_TAGS", "Registry", "Resolved"]

log = logging.getLogger(__name__)

#: the most distinct tags one name may have that a listing of its versions shows
MAX_TAGS: Final = 1000
#: listing batches one page of names reads at most (more only to finish one name)
_PAGE_BATCHES: Final = 10


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


@dataclass(frozen=True, slots=True)
class Resolved:
    """A reference resolved: the snapshot, and the name and version it was found by."""

    snapshot: Snapshot
    #: None when the reference was a snapshot id
    name: str | None = None
    version: int | None = None
    #: the tags of ``name`` whose current value is ``version``
    tags: tuple[str, ...] = ()
    created: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Registry:
    """The names of one dataset registry (``[datasets] registry = BACKEND/PREFIX``).

    Args:
        backends: the configured backends; the registry's is looked up at each use,
            so that a config without it still serves everything else.
        registry: ``BACKEND/PREFIX``.
    """

    def __init__(self, backends: Backends, registry: str) -> None:
        self.backends = backends
        self.registry = registry
        self.backend_name, _, prefix = registry.partition("/")
        self.layout = Layout(prefix)

    # -- the backend ----------------------------------------------------------------

    @property
    def backend(self) -> Backend:
        """The registry's backend.

        Raises:
            UnknownBackendError: it is not configured (the message names the key).
        """
        try:
            return self.backends.get(self.backend_name)
        except UnknownBackendError as exc:
            raise UnknownBackendError(
                f"the dataset registry {self.registry!r} ([datasets] registry): {exc}; "
                "configure that backend, or point [datasets] registry at one"
            ) from None

    def writable(self) -> Backend:
        """The registry's backend, if it takes writes.

        Raises:
            ReadOnlyBackendError: it does not.
        """
        backend = self.backend
        if not backend.supports_writes:
            raise ReadOnlyBackendError(
                f"the dataset registry {self.registry} is on backend {backend.name!r}, which is "
                "read-only: registering, tagging and freezing write there; set writable = "
                "true in its [[backends]] entry, or point [datasets] registry at a writable "
                "backend (reads of registered datasets go on meanwhile)"
            )
        if not backend.supports_conditional_put:
            # Without an atomic put-if-absent two registrations could take one number.
            raise DatasetError(
                f"the dataset registry {self.registry} is on backend {backend.name!r}, which "
                "cannot put an object only if it is absent; point [datasets] registry at a "
                "backend that can (s3, gs, az, file and memory backends all can)"
            )
        return backend

    @contextlib.contextmanager
    def reaching(self, what: str) -> Iterator[None]:
        """Around a request to the registry: a backend that is down says which registry."""
        try:
            yield
        except BackendUnavailableError as exc:
            raise BackendUnavailableError(
                f"{what}: the dataset registry {self.registry} cannot be reached ({exc}); "
                "try again once the backend answers"
            ) from exc

    # -- manifests ------------------------------------------------------------------

    async def manifest(self, ident: str) -> Snapshot:
        """The snapshot whose id is ``ident``, checked against it.

        Raises:
            DatasetNotFoundError: no manifest has that id.
            ManifestError: the stored bytes do not hash to it (torn or forged), or are
                not a manifest this code reads.
        """
        check_snapshot_id(ident)
        raw = await self.backend.get(self.layout.manifest(ident))
        if raw is None:
            raise DatasetNotFoundError(f"no snapshot {ident} in the dataset registry")
        # Hashing and parsing a large manifest is CPU work: off the loop.
        return await asyncio.to_thread(Snapshot.parse, raw, ident)

    async def _store_manifest(self, backend: Backend, snapshot: Snapshot) -> None:
        """Step 2 of a commit: the manifest, put if absent (a torn one replaced)."""
        key = self.layout.manifest(snapshot.id)
        if await backend.put(key, snapshot.data, if_absent=True):
            return
        there = await backend.get(key)
        if there is not None and snapshot_id(there) == snapshot.id:
            return
        log.warning(
            "dataset registry: %s/%s does not hash to its id (torn or altered); replaced",
            backend.name,
            key,
        )
        await backend.put(key, snapshot.data)

    # -- versions -------------------------------------------------------------------

    async def _pointer(self, name: str, number: int) -> dict[str, Any] | None:
        """Version ``number`` of ``name``'s pointer (None: there is none)."""
        key = self.layout.version(name, number)
        raw = await self.backend.get(key)
        return None if raw is None else _document(raw, key, ("id",))

    async def _highest_version(self, name: str) -> int:
        """The highest version number of ``name`` (0: none), from one listing."""
        highest = 0
        async with contextlib.aclosing(self.backend.scan(self.layout.versions(name))) as batches:
            async for batch in batches:
                for meta in batch:
                    parsed = self.layout.parse_version_key(meta.key)
                    if parsed is not None and parsed[0] == name:
                        highest = max(highest, parsed[1])
        return highest

    async def commit(self, data: bytes, name: str) -> tuple[Snapshot, int, bool]:
        """Register manifest ``data`` as the next version of ``name`` (:mod:`.layout`).

        Returns the snapshot, its version number, and whether a version was made
        (False: the latest version was this snapshot already).

        Raises:
            ManifestError: ``data`` is not a manifest.
            InvalidRequestError: ``name`` is not a dataset name.
            ReadOnlyBackendError, DatasetError: too many concurrent registrations won
                the numbers this one tried.
        """
        check_dataset_name(name)
        # The id is the daemon's own hash of the bytes, never the client's word.
        snapshot = await asyncio.to_thread(Snapshot.parse, data)
        backend = self.writable()
        await self._store_manifest(backend, snapshot)
        highest = await self._highest_version(name)
        if highest:
            try:
                latest = await self._pointer(name, highest)
            except ManifestError as exc:
                # A damaged pointer must not block the name for good: it stays (resolving
                # it says so), and this commit takes the next number.
                log.warning("dataset %s: %s; this commit takes the next version", name, exc)
                latest = None
            if latest is not None and latest.get("id") == snapshot.id:
                return snapshot, highest, False
        number = highest + 1
        for _ in range(COMMIT_TRIES):
            if number > MAX_NUMBER:
                break
            pointer = {
                "format": "chunkd-dataset-version",
                "schema": 1,
                "name": name,
                "version": number,
                "id": snapshot.id,
                "created": time.time(),
            }
            if await backend.put(
                self.layout.version(name, number), _dumps(pointer), if_absent=True
            ):
                log.info("dataset %s@%d registered: snapshot %s", name, number, snapshot.id)
                return snapshot, number, True
            number += 1  # a concurrent registration took it
        raise DatasetError(
            f"registering {name}: {COMMIT_TRIES} version numbers from {highest + 1} on were "
            "taken by concurrent registrations; nothing was registered: register again"
        )

    async def _resolve_version(
        self, name: str, number: int, what: str
    ) -> tuple[dict[str, Any], Snapshot]:
        pointer = await self._pointer(name, number)
        if pointer is None:
            highest = await self._highest_version(name)
            if not highest:
                raise DatasetNotFoundError(f"no dataset named {name} in the registry")
            raise DatasetNotFoundError(
                f"dataset {name} has no version {number}; its versions go from 1 to {highest}"
            )
        return pointer, await self._snapshot_of(pointer, what)

    async def _snapshot_of(self, pointer: dict[str, Any], what: str) -> Snapshot:
        ident = str(pointer["id"])
        try:
            return await self.manifest(ident)
        except DatasetNotFoundError:
            raise DatasetNotFoundError(
                f"{what} names snapshot {ident}, whose manifest is missing from the registry "
                f"({self.registry}); register the dataset again"
            ) from None

    async def resolve(self, text: str) -> Resolved:
        """The snapshot ``text`` (``NAME``, ``NAME@N``, ``NAME@latest``, ``NAME@TAG`` or
        an id) refers to, its manifest checked against its id.

        Raises:
            InvalidRequestError: ``text`` is not a reference.
            DatasetNotFoundError: no such name, version, tag or snapshot, or its
                manifest is missing.
            ManifestError: the manifest is torn or forged.
        """
        ref = parse_ref(text)
        if ref.id is not None:
            return Resolved(await self.manifest(ref.id))
        assert ref.name is not None
        name = ref.name
        if ref.version is not None:
            number = ref.version
        elif ref.latest:
            number = await self._highest_version(name)
            if not number:
                raise DatasetNotFoundError(f"no dataset named {name} in the registry")
        else:
            number = await self._tagged(ref)
        what = f"{name}@{number}" if ref.version is not None else f"{ref} (version {number})"
        pointer, snapshot = await self._resolve_version(name, number, what)
        tags = await self.tags_of(name)
        return Resolved(
            snapshot,
            name,
            number,
            tuple(sorted(t for t, (_, doc) in tags.items() if doc.get("version") == number)),
            _number(pointer.get("created")),
        )

    # -- tags -----------------------------------------------------------------------

    async def _tag_highest(self, name: str, tag: str) -> int:
        """The highest entry number of a tag (0: never set), from one listing."""
        highest = 0
        async with contextlib.aclosing(self.backend.scan(self.layout.tag(name, tag))) as batches:
            async for batch in batches:
                for meta in batch:
                    parsed = self.layout.parse_tag_key(meta.key)
                    if parsed is not None and parsed[:2] == (name, tag):
                        highest = max(highest, parsed[2])
        return highest

    async def _tag_head(self, name: str, tag: str) -> tuple[int, dict[str, Any]] | None:
        """The highest entry of a tag: (seq, entry); None: the tag was never set.

        Raises:
            ManifestError: that entry is damaged.
        """
        highest = await self._tag_highest(name, tag)
        if not highest:
            return None
        key = self.layout.tag_entry(name, tag, highest)
        raw = await self.backend.get(key)
        if raw is None:  # pragma: no cover - tag entries are never deleted
            return None
        return highest, _document(raw, key, ("version", "id"))

    async def _tagged(self, ref: Ref) -> int:
        assert ref.name is not None
        assert ref.tag is not None
        head = await self._tag_head(ref.name, ref.tag)
        if head is None:
            if not await self._highest_version(ref.name):
                raise DatasetNotFoundError(f"no dataset named {ref.name} in the registry")
            raise DatasetNotFoundError(f"dataset {ref.name} has no tag {ref.tag!r}")
        version = head[1]["version"]
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ManifestError(f"tag {ref} holds no version number; tag it again")
        return version

    async def tags_of(self, name: str) -> dict[str, tuple[int, dict[str, Any]]]:
        """Each tag of ``name`` with its current entry (at most :data:`MAX_TAGS`).

        One listing of the tags' histories; one read per tag.
        """
        heads: dict[str, int] = {}
        async with contextlib.aclosing(self.backend.scan(self.layout.tags(name))) as batches:
            async for batch in batches:
                for meta in batch:
                    parsed = self.layout.parse_tag_key(meta.key)
                    if parsed is None or parsed[0] != name:
                        continue
                    _, tag, seq = parsed
                    if tag not in heads and len(heads) >= MAX_TAGS:
                        raise DatasetError(
                            f"dataset {name} has more than {MAX_TAGS} tags; chunkd shows at "
                            "most that many"
                        )
                    heads[tag] = max(heads.get(tag, 0), seq)

        async def read(item: tuple[str, int]) -> tuple[str, tuple[int, dict[str, Any]] | None]:
            tag, seq = item
            key = self.layout.tag_entry(name, tag, seq)
            raw = await self.backend.get(key)
            if raw is None:  # pragma: no cover - tag entries are never deleted
                return tag, None
            try:
                return tag, (seq, _document(raw, key, ("version", "id")))
            except ManifestError as exc:
                log.warning("dataset %s: %s", name, exc)
                return tag, None

        found = await each(sorted(heads.items()), read)
        return {tag: entry for tag, entry in found if entry is not None}

    async def tag(self, name: str, tag: str, target: str) -> dict[str, Any]:
        """Point tag ``tag`` of ``name`` at the version ``target`` refers to.

        ``target`` is a reference to a version of ``name`` (``NAME@N``, ``NAME@TAG``,
        ``NAME``) or a bare version number. The new entry is put if absent at the
        tag's highest seq + 1 (:mod:`.layout`).

        Raises:
            InvalidRequestError, DatasetNotFoundError, ReadOnlyBackendError, DatasetError
        """
        check_dataset_name(name)
        check_tag(tag)
        if target.isdigit() and target.isascii():
            target = f"{name}@{target}"
        ref = parse_ref(target)
        if ref.name != name:
            raise DatasetNotFoundError(
                f"tag {name}@{tag}: {target} is not a version of {name}; a tag points at a "
                f"version of its own dataset ({name}@N)"
            )
        backend = self.writable()
        resolved = await self.resolve(target)
        # Only the number of the tag's head counts here, not its contents: a damaged
        # head does not block moving the tag past it.
        seq = await self._tag_highest(name, tag) + 1
        for _ in range(COMMIT_TRIES):
            if seq > MAX_NUMBER:
                break
            entry = {
                "format": "chunkd-dataset-tag",
                "schema": 1,
                "name": name,
                "tag": tag,
                "seq": seq,
                "version": resolved.version,
                "id": resolved.snapshot.id,
                "created": time.time(),
            }
            key = self.layout.tag_entry(name, tag, seq)
            if await backend.put(key, _dumps(entry), if_absent=True):
                log.info("dataset %s@%s -> version %s", name, tag, resolved.version)
                return entry
            seq += 1
        raise DatasetError(
            f"tagging {name}@{tag}: {COMMIT_TRIES} concurrent moves of the tag won the "
            "numbers this one tried; the tag was not moved: tag again"
        )

    # -- listings -------------------------------------------------------------------

    async def versions_page(
        self, name: str, *, start_after: int | None = None, limit: int = 1000
    ) -> tuple[list[dict[str, Any]], int | None]:
        """One page of ``name``'s versions, oldest first, with the tags at each.

        Returns the entries (``{"version", "snapshot", "created", "tags"}``) and the number
        to pass as ``start_after`` for the next page (None: the last page).

        Raises:
            DatasetNotFoundError: ``name`` has no versions.
        """
        check_dataset_name(name)
        after = self.layout.version(name, start_after) if start_after else None
        numbers: list[int] = []
        more = False
        scan = self.backend.scan(self.layout.versions(name), start_after=after)
        async with contextlib.aclosing(scan) as batches:
            async for batch in batches:
                for meta in batch:
                    parsed = self.layout.parse_version_key(meta.key)
                    if parsed is None or parsed[0] != name:
                        continue
                    if len(numbers) == limit:
                        more = True
                        break
                    numbers.append(parsed[1])
                if more:
                    break
        if not numbers and not start_after:
            raise DatasetNotFoundError(f"no dataset named {name} in the registry")
        tags = await self.tags_of(name)
        at: dict[int, list[str]] = {}
        for tag, (_, entry) in sorted(tags.items()):
            at.setdefault(entry.get("version"), []).append(tag)  # type: ignore[arg-type]

        async def read(number: int) -> dict[str, Any]:
            pointer = await self._pointer(name, number)
            return {
                "version": number,
                "snapshot": None if pointer is None else pointer.get("id"),
                "created": None if pointer is None else _number(pointer.get("created")),
                "tags": at.get(number, []),
            }

        entries = await each(numbers, read)
        return entries, numbers[-1] if more else None

    async def names_page(
        self, prefix: str = "", *, start_after: str | None = None, limit: int = 1000
    ) -> tuple[list[dict[str, Any]], str | None]:
        """One page of the dataset names under ``prefix`` (whole name segments), in
        key order, each with its latest version and that version's snapshot id.

        Returns the entries (``{"name", "latest", "snapshot", "created"}``) and the token to
        pass as ``start_after`` for the next page (None: the last page). A page reads
        at most a few listing batches; it may hold fewer than ``limit`` names (it
        holds at least one unless the listing is over).
        """
        if prefix.strip("/"):
            check_dataset_name(prefix.strip("/"))
        found: list[tuple[str, int]] = []
        token: str | None = None
        run: tuple[str, int] | None = None  # the name whose versions are being listed
        before_run = start_after  # the key listed just before the run's first
        last_key = start_after
        batches_read = 0
        done = True
        scan = self.backend.scan(self.layout.names_under(prefix), start_after=start_after)
        async with contextlib.aclosing(scan) as batches:
            async for batch in batches:
                batches_read += 1
                for meta in batch:
                    parsed = self.layout.parse_version_key(meta.key)
                    if parsed is not None:
                        name, number = parsed
                        if run is not None and run[0] == name:
                            run = (name, max(run[1], number))
                        else:
                            if run is not None:
                                found.append(run)
                                if len(found) == limit:
                                    token, done = last_key, False
                                    break
                            run, before_run = (name, number), last_key
                    last_key = meta.key
                if not done:
                    break
                # Bounded work: stop at a batch's end, unless nothing would be answered
                # (one name with more versions than the bound: its run is finished).
                if batches_read >= _PAGE_BATCHES and found:
                    token, done, run = before_run, False, None
                    break
        if done and run is not None:
            found.append(run)

        async def read(item: tuple[str, int]) -> dict[str, Any]:
            name, number = item
            pointer = await self._pointer(name, number)
            return {
                "name": name,
                "latest": number,
                "snapshot": None if pointer is None else pointer.get("id"),
                "created": None if pointer is None else _number(pointer.get("created")),
            }

        return await each(found, read), None if done else token


def _document(raw: memoryview | bytes, key: str, required: tuple[str, ...]) -> dict[str, Any]:
    """A registry document (a pointer, a tag entry) that must hold ``required``."""
    try:
        doc = json.loads(bytes(raw))
    except (ValueError, UnicodeDecodeError):
        doc = None
    if not isinstance(doc, dict) or any(k not in doc for k in required):
        raise ManifestError(
            f"the registry's {key} is damaged (not the JSON chunkd wrote); nothing was read "
            "from it: register or tag again"
        )
    if "id" in doc and not (isinstance(doc["id"], str) and len(doc["id"]) == 64):
        raise ManifestError(f"the registry's {key} names no snapshot id; register again")
    return doc


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
