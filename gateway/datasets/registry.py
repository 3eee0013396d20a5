"""The registry's names: commits of versions, tags, resolving a reference, listings.

The layout and the commit and tag protocols are written down in :mod:`.layout`.

It is one job at ~920 lines: what a dataset's names say, kept as append-only histories
on the backend (a name's versions, a tag's moves, each with its hint) and read the same
way for both (the hint, probes, a listing), committed, resolved and listed. The rooms
it stands on do the rest: the manifests by id (:mod:`.manifests`), the registry's small
documents read within a bound (:mod:`.documents`), the member pages (:mod:`.pages`).

What a request may cost the daemon, bounded before the work starts:

* **a manifest to commit or resolve**: checked in turns, at most
  :data:`COMMIT_CHECKS` at once, in a thread or a worker process by its size, and kept
  parsed by id within bounds (:mod:`.manifests` says what each may cost);
* **a schema-2 root to commit**: as a manifest above (at most :data:`ROOT_MAX_BYTES`);
  then every page it names must be in the registry: pages this daemon put or read are
  known (:data:`.pages.KNOWN_PAGES` ids), the others are HEADed a few at a time (one
  request a page, never a read of it). A missing page is a
  :class:`~chunkd.errors.DatasetNotFoundError` naming it, before anything is written;
* **a page to put** (``ds_page_put``): at most :data:`~chunkd.snapshot.PAGE_MAX_BYTES`,
  refused by the size of its memfd before a byte is read; its shape checked before it
  is parsed, then parsed in a thread in a turn of the same :data:`COMMIT_CHECKS`
  (:func:`.pages.check_page`);
* **a page to read** (``ds_page``, :meth:`Registry.page`): one ranged read of at most
  :data:`~chunkd.snapshot.PAGE_MAX_BYTES` + 1 bytes (a larger object is damaged and not
  read), hashed before it is kept or served, held by the node's tiers like a chunk
  (:mod:`.pages`). The daemon never parses a page to resolve, commit or serve it;
* **the latest version or a tag's head**: the hint, the pointer it names, and one
  probe per version the hint is behind, at most :data:`HINT_PROBES`, then one listing
  from there (:mod:`.layout`): a resolve's reads do not grow with the history;
* **a version pointer or a tag entry** (a few hundred bytes as chunkd writes them):
  at most :data:`DOCUMENT_BYTES` are read and parsed, after a shape check
  (:mod:`.documents`: :func:`read_document`, :func:`load_document`). One over the
  bound, or not the JSON chunkd writes, is *damaged*: resolving it says so, and a
  listing names it and goes on (``"damaged"`` in its entry) rather than failing the
  page.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from chunkd.canonical import canonical
from chunkd.errors import (
    BackendUnavailableError,
    ChunkdError,
    DatasetError,
    DatasetNotFoundError,
    ManifestError,
    ReadOnlyBackendError,
    UnknownBackendError,
)
from chunkd.gateway.checkpoints.jobs import each
from chunkd.gateway.datasets.documents import DOCUMENT_BYTES, load_document, read_document
from chunkd.gateway.datasets.layout import COMMIT_TRIES, HINT, MAX_NUMBER, Layout
from chunkd.gateway.datasets.manifests import (
    COMMIT_CHECKS,
    IN_PROCESS_BYTES,
    PARSED_BYTES,
    PARSED_COUNT,
    READ_PIECE,
    ROOT_MAX_BYTES,
    WORKER_BASE,
    WORKER_RATIO,
    WORKER_SECONDS,
    Manifests,
)
from chunkd.gateway.datasets.pages import PageStore, check_page
from chunkd.snapshot import (
    Ref,
    Snapshot,
    check_dataset_name,
    check_tag,
    parse_ref,
)

if TYPE_CHECKING:
    from chunkd.cache import ChunkCache
    from chunkd.gateway.backends import Backend, Backends, ObjectMeta
    from chunkd.gateway.readpath import ReadPath

__all__ = [
    "COMMIT_CHECKS",
    "DOCUMENT_BYTES",
    "HINT_PROBES",
    "IN_PROCESS_BYTES",
    "MAX_TAGS",
    "PARSED_BYTES",
    "PARSED_COUNT",
    "READ_PIECE",
    "ROOT_MAX_BYTES",
    "WORKER_BASE",
    "WORKER_RATIO",
    "WORKER_SECONDS",
    "Registry",
    "Resolved",
    "load_document",
    "read_document",
]

log = logging.getLogger(__name__)

#: the most distinct tags one name may have that a listing of its versions shows
MAX_TAGS: Final = 1000
#: listing batches one page of names reads at most (more only to finish one name)
_PAGE_BATCHES: Final = 10
#: pages a commit looks for in one batch; the first batch with a page missing ends the
#: check (a forged root's HEADs stop there)
_PAGES_CHECKED: Final = 256
#: a hint behind the highest version by more than this many probes is left for one
#: listing from the last version found (a name committed by daemons without hints)
HINT_PROBES: Final = 8


#: a pointer's or tag entry's bytes as read: None (absent), or the error of a damaged one
_Document = memoryview | ManifestError | None


def _loaded_document(
    found: _Document, key: str, required: tuple[str, ...]
) -> dict[str, Any] | None:
    """The JSON of a document :meth:`Registry._document` read (None: absent).

    Raises:
        ManifestError: it is damaged.
    """
    if isinstance(found, ManifestError):
        raise found
    return None if found is None else load_document(found, key, required)


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
        cache: the node's chunk cache, which holds the pages read (None: not kept).
        read_path: the node's read path, through which pages are read (with peers:
            once for the cluster); None: straight from the backend.
    """

    def __init__(
        self,
        backends: Backends,
        registry: str,
        *,
        cache: ChunkCache | None = None,
        read_path: ReadPath | None = None,
    ) -> None:
        self.backends = backends
        self.registry = registry
        self.backend_name, _, prefix = registry.partition("/")
        self.layout = Layout(prefix)
        #: the member pages of schema-2 snapshots, held like chunks (:mod:`.pages`)
        self.pages = PageStore(backends, self.backend_name, self.layout, cache, read_path)
        #: the manifest and page checks and loads running (COMMIT_CHECKS at once; the
        #: rest wait in line)
        self._checks = asyncio.Semaphore(COMMIT_CHECKS)
        #: the manifests by id: checked, loaded and kept parsed (:mod:`.manifests`)
        self.manifests = Manifests(self.layout, lambda: self.backend, self._checks)

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
        """The snapshot whose id is ``ident``, checked against it
        (:meth:`.manifests.Manifests.get`).

        Raises:
            DatasetNotFoundError: no manifest has that id.
            ManifestError: the stored bytes do not hash to it (torn or forged), are
                not a manifest this code reads, or are larger than any manifest.
        """
        return await self.manifests.get(ident)

    async def check_manifest(
        self, data: bytes | memoryview, *, fd: int | None = None, verified_copy: bool = False
    ) -> str:
        """The id of manifest ``data`` (:meth:`checked_manifest`)."""
        ident, _ = await self.checked_manifest(data, fd=fd, verified_copy=verified_copy)
        return ident

    async def checked_manifest(
        self, data: bytes | memoryview, *, fd: int | None = None, verified_copy: bool = False
    ) -> tuple[str, Snapshot | None]:
        """The id of manifest ``data``, and the snapshot when it is a schema-2 root, once
        it is checked whole, in its turn (:meth:`.manifests.Manifests.check`).

        Raises:
            ManifestError: ``data`` is not a manifest, or claims what only chunkd
                records.
            DatasetError: the worker failed (its exit status and last words are logged).
        """
        return await self.manifests.check(data, fd=fd, verified_copy=verified_copy)

    # -- pages ----------------------------------------------------------------------

    async def put_page(
        self, data: bytes | memoryview, *, verified_copy: bool = False
    ) -> tuple[str, bool]:
        """Put member page ``data`` (at most :data:`~chunkd.snapshot.PAGE_MAX_BYTES`,
        which the caller checks before it reads it) if it is absent: checked first, in
        a turn of the manifest checks (:func:`.pages.check_page`). ``verified_copy``:
        the daemon's own migrate's page, whose members' ``content`` it recorded itself;
        otherwise a page that carries one is refused.

        Returns the page's id and whether this call wrote it (False: it was there).

        Raises:
            ManifestError: ``data`` is not a page, or claims ``content``.
            ReadOnlyBackendError, DatasetError, BackendUnavailableError
        """
        self.writable()
        data = bytes(data)
        async with self._checks:
            ident = await asyncio.to_thread(check_page, data, verified_copy=verified_copy)
        return ident, await self.pages.put(data, ident)

    async def page(self, page_id: str) -> bytes:
        """The bytes of page ``page_id``, verified against it: held by this node like a
        chunk, else fetched once for its readers (:class:`.pages.PageStore`). Whether
        it fits a snapshot is :meth:`Snapshot.offer_page`'s check.

        Raises:
            DatasetNotFoundError: the registry has no such page.
            ManifestError: the registry's copy is damaged.
        """
        return await self.pages.get(page_id)

    async def load_pages(self, snapshot: Snapshot, page_indexes: Iterable[int]) -> None:
        """Fetch pages ``page_indexes`` of schema-2 ``snapshot`` (a few at a time) and
        offer each to it, which checks it against its root's entry: daemon code then
        indexes those pages' members (``snapshot.members[i]``).

        Raises:
            DatasetNotFoundError: a page is missing (the message names it).
            ManifestError: a page is damaged, or does not fit the root (it names it).
        """
        wanted = sorted(set(page_indexes))

        async def load(index: int) -> None:
            ref = snapshot.pages[index]
            data = await self.page(ref.id)
            await asyncio.to_thread(snapshot.offer_page, ref.id, data)

        await each(wanted, load)

    async def _check_pages(self, snapshot: Snapshot) -> None:
        """Every page root ``snapshot`` names is in the registry: known from this
        daemon's puts, else a HEAD each, a few at a time.

        Raises:
            DatasetNotFoundError: pages are missing (the message names them); nothing
                was written.
        """
        ids = sorted({ref.id for ref in snapshot.pages})

        async def there(page_id: str) -> bool:
            return await self.pages.exists(page_id)

        missing: list[str] = []
        for start in range(0, len(ids), _PAGES_CHECKED):  # a batch, then the next
            batch = ids[start : start + _PAGES_CHECKED]
            found = await each(batch, there)
            missing = [i for i, ok in zip(batch, found, strict=True) if not ok]
            if missing:  # the first batch that lacks one ends it: no HEAD more
                break
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            shown = ", ".join(missing[:5]) + more
            raise DatasetNotFoundError(
                f"snapshot {snapshot.id} names {len(missing)} page(s) missing from the dataset "
                f"registry ({self.registry}): {shown}; put them first (ds_page_put: "
                "chunkd.client.datasets.pages.commit_snapshot does), then commit the root "
                "again (nothing was registered)"
            )

    # -- versions -------------------------------------------------------------------

    async def _pointer(
        self, name: str, number: int, meta: ObjectMeta | None = None
    ) -> dict[str, Any] | None:
        """Version ``number`` of ``name``'s pointer (None: there is none); ``meta``:
        what a listing said of it.

        Raises:
            ManifestError: it is damaged (over :data:`DOCUMENT_BYTES`, or not the JSON
                chunkd writes).
        """
        key = self.layout.version(name, number)
        raw = await read_document(self.backend, key, meta=meta)
        return None if raw is None else load_document(raw, key, ("id",))

    async def _listed_highest(self, name: str, start_after: str | None = None) -> int:
        """The highest version number of ``name`` (0: none), from a listing (after
        ``start_after``): a name with no hint, or one far behind."""
        highest = 0
        scan = self.backend.scan(self.layout.versions(name), start_after=start_after)
        async with contextlib.aclosing(scan) as batches:
            async for batch in batches:
                for meta in batch:
                    parsed = self.layout.parse_version_key(meta.key)
                    if parsed is not None and parsed[0] == name:
                        highest = max(highest, parsed[1])
        return highest

    async def _highest_version(self, name: str) -> int:
        """The highest version number of ``name`` (0: none): :meth:`_latest`."""
        return (await self._latest(name))[0]

    async def _latest(self, name: str) -> tuple[int, _Document]:
        """The highest version of ``name`` (0: none) and its pointer's bytes (None when
        0; a ManifestError when it is damaged): the hint, then probes (:mod:`.layout`)."""
        return await self._highest_of(
            self.layout.hint(name),
            "version",
            functools.partial(self.layout.version, name),
            functools.partial(self._listed_highest, name),
        )

    async def _highest_of(
        self,
        hint_key: str,
        field: str,
        key_of: Callable[[int], str],
        listed: Callable[[str | None], Awaitable[int]],
    ) -> tuple[int, _Document]:
        """The highest number of an append-only history (versions of a name, moves of
        a tag) and its document: from the number its hint holds, probing forward until
        one is absent (:data:`HINT_PROBES` at most, then one listing from there); from
        a listing when there is no hint, or it names nothing."""
        number = await self._hint(hint_key, field)
        found: _Document = None
        if number:
            found = await self._document(key_of(number))
            if found is None:  # a hint that names nothing is not chunkd's: list
                number = 0
        if not number:
            number = await listed(None)
            return number, (await self._document(key_of(number)) if number else None)
        for _ in range(HINT_PROBES):
            if number >= MAX_NUMBER:
                return number, found
            following = await self._document(key_of(number + 1))
            if following is None:
                return number, found
            number, found = number + 1, following
        further = await listed(key_of(number))
        if further > number:
            number, found = further, await self._document(key_of(further))
        return number, found

    async def _hint(self, key: str, field: str) -> int:
        """The number hint ``key`` holds in ``field`` (0: none, or damaged)."""
        try:
            raw = await read_document(self.backend, key)
            if raw is None:
                return 0
            doc = load_document(raw, key, (field,))
        except ManifestError as exc:
            log.warning("dataset registry: %s (the hint is passed over)", exc)
            return 0
        number = doc[field]
        valid = isinstance(number, int) and not isinstance(number, bool)
        return number if valid and 1 <= number <= MAX_NUMBER else 0

    async def _write_hint(self, key: str, doc: dict[str, Any]) -> None:
        """Write hint ``key`` after a commit or a tag move; a failure only leaves it
        behind (the next resolve probes past it), never fails what was committed."""
        try:
            await self.backend.put(key, canonical(doc))
        except ChunkdError as exc:
            log.warning("dataset registry: the hint %s was not written (%s)", key, exc)

    async def _document(self, key: str) -> _Document:
        """The bytes of a pointer or tag entry (None: absent; a damaged one's error)."""
        try:
            return await read_document(self.backend, key)
        except ManifestError as exc:
            return exc

    async def has_versions(self, name: str) -> bool:
        """Whether ``name`` has a version (one listing request of at most one key)."""
        scan = self.backend.scan(self.layout.versions(name), batch=1)
        async with contextlib.aclosing(scan) as batches:
            async for batch in batches:
                if any(self.layout.parse_version_key(m.key) is not None for m in batch):
                    return True
        return False

    async def owner(self, name: str) -> int | None:
        """The uid that owns ``name``: the one its version 1 records (docs/security.md).
        None when it records none (made before chunkd recorded owners), is damaged or
        gone, or ``name`` has no version yet."""
        try:
            first = await self._pointer(name, 1)
        except ManifestError:
            return None
        uid = None if first is None else first.get("uid")
        return uid if isinstance(uid, int) and not isinstance(uid, bool) else None

    async def commit(
        self,
        data: bytes | memoryview,
        name: str,
        *,
        fd: int | None = None,
        uid: int | None = None,
        may_write: Callable[[int | None], None] | None = None,
        verified_copy: bool = False,
    ) -> tuple[str, int, bool]:
        """Register manifest ``data`` as the next version of ``name`` (:mod:`.layout`).

        ``fd``: a sealed memfd of the same bytes, if the caller has one
        (:meth:`check_manifest`). ``uid``: who asks; version 1 records it as the name's
        owner. ``may_write``: called with the name's :meth:`owner` before any version
        after the first is written; it raises to refuse (docs/security.md).
        ``verified_copy``: the manifest is the daemon's own migrate's, which may carry
        ``content`` and ``origin`` (:meth:`check_manifest`); a client's may not.

        Returns the snapshot's id, its version number, and whether a version was made
        (False: the latest version was this snapshot already).

        Raises:
            ManifestError: ``data`` is not a manifest, or claims ``content`` or
                ``origin`` and is not a verified copy.
            InvalidRequestError: ``name`` is not a dataset name.
            ReadOnlyBackendError, DatasetError: too many concurrent registrations won
                the numbers this one tried.
            AccessDeniedError: what ``may_write`` raised.
        """
        check_dataset_name(name)
        backend = self.writable()  # before the manifest's check costs anything
        # The id is the daemon's own hash of the bytes, never the client's word.
        ident, snapshot = await self.checked_manifest(data, fd=fd, verified_copy=verified_copy)
        highest, latest_raw = await self._latest(name)
        checked = False
        if highest and may_write is not None:
            # before the pages are looked for: a caller who may not write the name costs
            # no HEAD of a page
            may_write(await self.owner(name))
            checked = True
        if snapshot is not None and snapshot.schema >= 2:
            await self._check_pages(snapshot)
        await self.manifests.store(backend, ident, data)
        if highest:
            try:
                latest = _loaded_document(latest_raw, self.layout.version(name, highest), ("id",))
            except ManifestError as exc:
                # A damaged pointer must not block the name for good: it stays (resolving
                # it says so), and this commit takes the next number.
                log.warning("dataset %s: %s; this commit takes the next version", name, exc)
                latest = None
            if latest is not None and latest.get("id") == ident:
                return ident, highest, False
        number = highest + 1
        for _ in range(COMMIT_TRIES):
            if number > MAX_NUMBER:
                break
            if number > 1 and may_write is not None and not checked:
                may_write(await self.owner(name))  # a concurrent first commit won: its name
                checked = True
            pointer = {
                "format": "chunkd-dataset-version",
                "schema": 1,
                "name": name,
                "version": number,
                "id": ident,
                "created": time.time(),
            }
            if uid is not None:
                pointer["uid"] = uid
            if await backend.put(
                self.layout.version(name, number), canonical(pointer), if_absent=True
            ):
                log.info("dataset %s@%d registered: snapshot %s", name, number, ident)
                await self._write_hint(self.layout.hint(name), {"version": number})
                return ident, number, True
            number += 1  # a concurrent registration took it
        raise DatasetError(
            f"registering {name}: {COMMIT_TRIES} version numbers from {highest + 1} on were "
            "taken by concurrent registrations; nothing was registered: register again"
        )

    async def _version(self, ref: Ref) -> tuple[int, dict[str, Any], str]:
        """The version of a name ``ref`` refers to: its number, its pointer, and how to
        name it in an error.

        Raises:
            DatasetNotFoundError: no such name, version or tag.
            ManifestError: the pointer or tag entry is damaged.
        """
        assert ref.name is not None
        name = ref.name
        if ref.latest:
            number, found = await self._latest(name)
            if not number:
                raise DatasetNotFoundError(f"no dataset named {name} in the registry")
            pointer = _loaded_document(found, self.layout.version(name, number), ("id",))
        else:
            number = ref.version if ref.version is not None else await self._tagged(ref)
            pointer = await self._pointer(name, number)
        what = f"{name}@{number}" if ref.version is not None else f"{ref} (version {number})"
        if pointer is None:
            highest = await self._highest_version(name)
            if not highest:
                raise DatasetNotFoundError(f"no dataset named {name} in the registry")
            raise DatasetNotFoundError(
                f"dataset {name} has no version {number}; its versions go from 1 to {highest}"
            )
        return number, pointer, what

    def _missing_manifest(self, what: str, ident: str) -> DatasetNotFoundError:
        return DatasetNotFoundError(
            f"{what} names snapshot {ident}, whose manifest is missing from the registry "
            f"({self.registry}); register the dataset again"
        )

    async def resolve(self, text: str) -> Resolved:
        """The snapshot ``text`` (``NAME``, ``NAME@N``, ``NAME@latest``, ``NAME@TAG`` or
        an id) refers to, its manifest checked against its id (:meth:`manifest`).

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
        number, pointer, what = await self._version(ref)
        ident = str(pointer["id"])
        try:
            snapshot = await self.manifest(ident)
        except DatasetNotFoundError:
            raise self._missing_manifest(what, ident) from None
        tags = await self.tags_of(name)
        return Resolved(
            snapshot,
            name,
            number,
            tuple(sorted(t for t, (_, doc) in tags.items() if doc.get("version") == number)),
            _number(pointer.get("created")),
        )

    # -- tags -----------------------------------------------------------------------

    async def _tag_listed_highest(self, name: str, tag: str, start_after: str | None) -> int:
        """The highest entry number of a tag (0: never set), from a listing (after
        ``start_after``): a tag with no hint, or one far behind."""
        highest = 0
        scan = self.backend.scan(self.layout.tag(name, tag), start_after=start_after)
        async with contextlib.aclosing(scan) as batches:
            async for batch in batches:
                for meta in batch:
                    parsed = self.layout.parse_tag_key(meta.key)
                    if parsed is not None and parsed[:2] == (name, tag):
                        highest = max(highest, parsed[2])
        return highest

    async def _tag_latest(self, name: str, tag: str) -> tuple[int, _Document]:
        """The highest entry number of a tag (0: never set) and its bytes: the tag's
        hint, then probes (:mod:`.layout`)."""
        return await self._highest_of(
            self.layout.tag_hint(name, tag),
            "seq",
            functools.partial(self.layout.tag_entry, name, tag),
            functools.partial(self._tag_listed_highest, name, tag),
        )

    async def _tag_highest(self, name: str, tag: str) -> int:
        """The highest entry number of a tag (0: never set)."""
        return (await self._tag_latest(name, tag))[0]

    async def _tag_head(self, name: str, tag: str) -> tuple[int, dict[str, Any]] | None:
        """The highest entry of a tag: (seq, entry); None: the tag was never set.

        Raises:
            ManifestError: that entry is damaged.
        """
        highest, found = await self._tag_latest(name, tag)
        if not highest:
            return None
        entry = _loaded_document(
            found, self.layout.tag_entry(name, tag, highest), ("version", "id")
        )
        if entry is None:  # pragma: no cover - tag entries are never deleted
            return None
        return highest, entry

    async def _tagged(self, ref: Ref) -> int:
        assert ref.name is not None
        assert ref.tag is not None
        head = await self._tag_head(ref.name, ref.tag)
        if head is None:
            if not await self.has_versions(ref.name):
                raise DatasetNotFoundError(f"no dataset named {ref.name} in the registry")
            raise DatasetNotFoundError(f"dataset {ref.name} has no tag {ref.tag!r}")
        version = head[1]["version"]
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ManifestError(f"tag {ref} holds no version number; tag it again")
        return version

    async def tags_of(self, name: str) -> dict[str, tuple[int, dict[str, Any]]]:
        """Each tag of ``name`` with its current entry (at most :data:`MAX_TAGS`).

        The tags' names by a listing that skips each tag's history (one request a
        tag, whatever its moves), then each tag's head by its hint (:meth:`_tag_head`).
        """
        names: list[str] = []
        prefix = self.layout.tags(name)
        after: str | None = None
        while True:
            tag = await self._next_tag(name, prefix, after)
            if tag is None:
                break
            if len(names) >= MAX_TAGS:
                raise DatasetError(
                    f"dataset {name} has more than {MAX_TAGS} tags; chunkd shows at most that many"
                )
            names.append(tag)
            # '~' sorts after every entry of a tag's folder (digits, '_latest.json'),
            # and before the next tag's ('/' sorts before every character of a tag
            # but '-' and '.', whose tags come before this one's folder).
            after = f"{prefix}/{tag}/~"

        async def read(tag: str) -> tuple[str, tuple[int, dict[str, Any]] | None]:
            try:
                return tag, await self._tag_head(name, tag)
            except ManifestError as exc:
                # A damaged head hides its tag (resolving the tag names the file).
                log.warning("dataset %s: %s", name, exc)
                return tag, None

        found = await each(names, read)
        return {tag: entry for tag, entry in found if entry is not None}

    async def _next_tag(self, name: str, prefix: str, after: str | None) -> str | None:
        """The first tag of ``name`` whose folder comes after key ``after`` (None:
        none): one listing request of a few keys."""
        scan = self.backend.scan(prefix, start_after=after, batch=8)
        async with contextlib.aclosing(scan) as batches:
            async for batch in batches:
                for meta in batch:
                    parsed = self.layout.parse_tag_key(meta.key)
                    if parsed is not None and parsed[0] == name:
                        return parsed[1]
                    hinted = meta.key[len(prefix) + 1 :].partition("/")
                    if hinted[2] == HINT and meta.key.startswith(prefix + "/"):
                        return hinted[0]
        return None

    async def tag(
        self,
        name: str,
        tag: str,
        target: str,
        *,
        uid: int | None = None,
        may_write: Callable[[int | None], None] | None = None,
    ) -> dict[str, Any]:
        """Point tag ``tag`` of ``name`` at the version ``target`` refers to.

        ``target`` is a reference to a version of ``name`` (``NAME@N``, ``NAME@TAG``,
        ``NAME``) or a bare version number. The new entry is put if absent at the
        tag's highest seq + 1 (:mod:`.layout`). ``uid``: who moves it (recorded);
        ``may_write``: called with the name's :meth:`owner` first, to refuse.

        Raises:
            InvalidRequestError, DatasetNotFoundError, ReadOnlyBackendError, DatasetError,
            AccessDeniedError
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
        # The pointer names the snapshot: its manifest need only be there, not parsed.
        number, pointer, what = await self._version(ref)
        ident = str(pointer["id"])
        if await backend.head(self.layout.manifest(ident)) is None:
            raise self._missing_manifest(what, ident)
        if may_write is not None:
            may_write(await self.owner(name))
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
                "version": number,
                "id": ident,
                "created": time.time(),
            }
            if uid is not None:
                entry["uid"] = uid
            key = self.layout.tag_entry(name, tag, seq)
            if await backend.put(key, canonical(entry), if_absent=True):
                log.info("dataset %s@%s -> version %s", name, tag, number)
                await self._write_hint(self.layout.tag_hint(name, tag), {"seq": seq})
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

        Returns the entries (``{"version", "snapshot", "created", "tags"}``, and
        ``"damaged": {"key", "error"}`` for a version whose pointer is damaged: its
        snapshot and time are then null) and the number to pass as ``start_after`` for
        the next page (None: the last page). A damaged pointer never fails the page.

        Raises:
            DatasetNotFoundError: ``name`` has no versions.
        """
        check_dataset_name(name)
        after = self.layout.version(name, start_after) if start_after else None
        numbers: list[tuple[int, ObjectMeta]] = []
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
                    numbers.append((parsed[1], meta))
                if more:
                    break
        if not numbers and not start_after:
            raise DatasetNotFoundError(f"no dataset named {name} in the registry")
        tags = await self.tags_of(name)
        at: dict[int, list[str]] = {}
        for tag, (_, entry) in sorted(tags.items()):
            at.setdefault(entry.get("version"), []).append(tag)  # type: ignore[arg-type]

        async def read(item: tuple[int, ObjectMeta]) -> dict[str, Any]:
            number, meta = item
            entry = {"version": number, "tags": at.get(number, [])}
            return entry | await self._listed_pointer(name, number, meta)

        entries = await each(numbers, read)
        return entries, numbers[-1][0] if more else None

    async def names_page(
        self, prefix: str = "", *, start_after: str | None = None, limit: int = 1000
    ) -> tuple[list[dict[str, Any]], str | None]:
        """One page of the dataset names under ``prefix`` (whole name segments), in
        key order, each with its latest version and that version's snapshot id.

        Returns the entries (``{"name", "latest", "snapshot", "created"}``, and
        ``"damaged": {"key", "error"}`` for a name whose latest pointer is damaged: its
        snapshot and time are then null) and the token to pass as ``start_after`` for
        the next page (None: the last page). A page reads at most a few listing
        batches; it may hold fewer than ``limit`` names (it holds at least one unless
        the listing is over). A damaged pointer never fails the page.
        """
        if prefix.strip("/"):
            check_dataset_name(prefix.strip("/"))
        found: list[tuple[str, int, ObjectMeta]] = []
        token: str | None = None
        # the name whose versions are being listed: its highest number and pointer
        run: tuple[str, int, ObjectMeta] | None = None
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
                            if number > run[1]:
                                run = (name, number, meta)
                        else:
                            if run is not None:
                                found.append(run)
                                if len(found) == limit:
                                    token, done = last_key, False
                                    break
                            run, before_run = (name, number, meta), last_key
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

        async def read(item: tuple[str, int, ObjectMeta]) -> dict[str, Any]:
            name, number, meta = item
            entry = {"name": name, "latest": number}
            return entry | await self._listed_pointer(name, number, meta)

        return await each(found, read), None if done else token

    async def _listed_pointer(self, name: str, number: int, meta: ObjectMeta) -> dict[str, Any]:
        """A listing's fields of pointer ``number`` of ``name``: ``snapshot`` and
        ``created``, or, for a damaged one, those null and ``damaged`` (which file, and
        why): a listing goes on around it."""
        try:
            pointer = await self._pointer(name, number, meta)
        except ManifestError as exc:
            key = self.layout.version(name, number)
            log.warning("dataset %s: %s (listed as damaged)", name, exc)
            return {"snapshot": None, "created": None, "damaged": {"key": key, "error": str(exc)}}
        return {
            "snapshot": None if pointer is None else pointer.get("id"),
            "created": None if pointer is None else _number(pointer.get("created")),
        }


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
