"""The daemon's dataset registry: one object that composes the rooms of the package
(the registry's names, freezing, migrating, the garbage collector's roots)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from chunkd.errors import InvalidRequestError
from chunkd.gateway.authority import Authority, Caller
from chunkd.gateway.datasets.freeze import INTENT_REFRESH, Freezer, frozen_chunk_ids
from chunkd.gateway.datasets.migrate import Migrator
from chunkd.gateway.datasets.registry import Registry, Resolved

if TYPE_CHECKING:
    from chunkd.cache import ChunkCache, ChunkLease
    from chunkd.gateway.backends import Backend, Backends
    from chunkd.gateway.config.schema import DatasetsConfig
    from chunkd.gateway.datasets.pages import PageStore
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.readpath import ReadPath
    from chunkd.snapshot import Snapshot

__all__ = ["Datasets"]


class Datasets:
    """The dataset registry of ``[datasets] registry``: commits, tags, resolving,
    listings, freezing and migrating (:mod:`.layout` has the protocols).

    Args:
        config: the ``[datasets]`` section.
        backends: the configured backends.
        read_path: the daemon's read path (members are read through it, pinned).
        cache: the daemon's cache.
        metrics: the daemon's metrics.
        poll_interval: the longest pause between two looks for the barriers of
            garbage collections (a freeze waits for the ones running).
        intent_refresh: seconds after which a running freeze writes an intent of its
            own again (:data:`.freeze.INTENT_REFRESH`, an hour).
        authority: who may write what (docs/security.md); the methods that take a
            ``caller`` check it (None: a request of the daemon's own).
    """

    def __init__(
        self,
        config: DatasetsConfig,
        backends: Backends,
        read_path: ReadPath,
        cache: ChunkCache,
        metrics: Metrics,
        *,
        poll_interval: float = 2.0,
        intent_refresh: float = INTENT_REFRESH,
        authority: Authority | None = None,
    ) -> None:
        self.authority = authority if authority is not None else Authority()
        self.registry = Registry(backends, config.registry, cache=cache, read_path=read_path)
        self.metrics = metrics
        self._hot = read_path.hot
        self._freezer = Freezer(
            self.registry,
            read_path,
            cache,
            metrics,
            poll_interval=poll_interval,
            intent_refresh=intent_refresh,
        )
        self._migrator = Migrator(self.registry, read_path, backends)

    @property
    def registry_name(self) -> str:
        """``[datasets] registry`` (``BACKEND[/PREFIX]``): the registry ``ds_resolve`` names."""
        return self.registry.registry

    @property
    def pages(self) -> PageStore:
        """The member pages of schema-2 snapshots, held like chunks (:mod:`.pages`):
        what the peer route of pages serves."""
        return self.registry.pages

    def _may_write(
        self, caller: Caller | None, name: str, action: str
    ) -> Callable[[int | None], None] | None:
        """What refuses ``caller`` to ``action`` dataset ``name`` (given its owner)
        unless they own it or are an admin; None: no check."""
        if caller is None:
            return None
        authority = self.authority

        def check(owner: int | None) -> None:
            authority.require_owner(caller, owner, f"dataset {name}", action)

        return check

    async def commit(
        self,
        data: bytes | memoryview,
        name: str,
        *,
        fd: int | None = None,
        caller: Caller | None = None,
    ) -> dict[str, Any]:
        """Register manifest ``data`` as the next version of ``name`` (``fd``: a sealed
        memfd of the same bytes, if the caller has one: :meth:`.Registry.commit`); a
        name that exists only by its owner or an admin.

        A client's manifest may not carry ``content`` or ``origin``
        (:meth:`.Registry.check_manifest`: a ``ManifestError``): chunkd records those
        itself, and only :meth:`migrate` commits them.

        Returns ``{"snapshot", "name", "version", "created"}``; ``created`` is False when
        the latest version was this snapshot already (no new version is made).
        """
        return await self._commit(data, name, fd=fd, caller=caller, verified_copy=False)

    async def _commit(
        self,
        data: bytes | memoryview,
        name: str,
        *,
        fd: int | None = None,
        caller: Caller | None,
        verified_copy: bool,
    ) -> dict[str, Any]:
        may_write = self._may_write(caller, name, "register a new version of")
        with self.registry.reaching(f"registering {name}"):
            if may_write is not None and await self.registry.has_versions(name):
                # Refused before the manifest is checked (the costly part); the commit
                # checks again before it writes.
                may_write(await self.registry.owner(name))
            ident, version, created = await self.registry.commit(
                data,
                name,
                fd=fd,
                uid=None if caller is None else caller.uid,
                may_write=may_write,
                verified_copy=verified_copy,
            )
        return {"snapshot": ident, "name": name, "version": version, "created": created}

    async def put_page(self, data: bytes | memoryview) -> dict[str, Any]:
        """Store member page ``data`` (:meth:`.Registry.put_page`): ``{"page",
        "created"}``. Anyone may: a page is named by its hash, and changes no name."""
        with self.registry.reaching("storing a member page"):
            ident, created = await self.registry.put_page(data)
        return {"page": ident, "created": created}

    async def page_lease(self, page_id: str, registry: str | None = None) -> ChunkLease:
        """A lease on page ``page_id``'s bytes, verified against it (the node's tiers,
        else one fetch for all its readers: :class:`.pages.PageStore`).

        Raises:
            InvalidRequestError: ``registry`` is not this daemon's.
            DatasetNotFoundError, ManifestError
        """
        if registry is not None and registry.strip("/") != self.registry.registry.strip("/"):
            raise InvalidRequestError(
                f"page {page_id[:64]} of registry {registry!r}: this daemon serves the pages of "
                f"its own registry, {self.registry.registry!r} ([datasets] registry)"
            )
        with self.registry.reaching(f"reading page {page_id[:64]}"):
            return await self.registry.pages.lease(page_id)

    async def resolve(self, ref: str) -> tuple[Resolved, dict[str, Any] | None]:
        """The snapshot ``ref`` refers to, and its frozen record (None: not frozen)."""
        with self.registry.reaching(f"resolving {ref}"):
            resolved = await self.registry.resolve(ref)
            frozen = await self._frozen(resolved.snapshot)
        snapshot = resolved.snapshot
        # Readers of this snapshot read its members next: the dashboard names the dataset.
        self._hot.dataset(snapshot.backend, snapshot.prefix, resolved.name or snapshot.id[:12])
        return resolved, frozen

    async def _frozen(self, snapshot: Snapshot) -> dict[str, Any] | None:
        """The frozen record of ``snapshot`` (None: not frozen). A schema-2 snapshot
        that has none is answered from one HEAD, without its pages: the record's bound
        is worked out from the members, which a resolve never reads."""
        if snapshot.schema >= 2:
            key = self.registry.layout.frozen(snapshot.id)
            if await self.registry.backend.head(key) is None:
                return None
        return await self._freezer.frozen(snapshot)

    async def tag(
        self, name: str, tag: str, ref: str, *, caller: Caller | None = None
    ) -> dict[str, Any]:
        """Point tag ``tag`` of ``name`` at the version ``ref`` names (its owner or an
        admin)."""
        with self.registry.reaching(f"tagging {name}@{tag}"):
            return await self.registry.tag(
                name,
                tag,
                ref,
                uid=None if caller is None else caller.uid,
                may_write=self._may_write(caller, name, "move a tag of"),
            )

    async def names_page(
        self, prefix: str, *, start_after: str | None, limit: int
    ) -> tuple[list[dict[str, Any]], str | None]:
        """One page of the names under ``prefix`` (:meth:`.Registry.names_page`)."""
        with self.registry.reaching("listing the datasets"):
            return await self.registry.names_page(prefix, start_after=start_after, limit=limit)

    async def versions_page(
        self, name: str, *, start_after: int | None, limit: int
    ) -> tuple[list[dict[str, Any]], int | None]:
        """One page of ``name``'s versions (:meth:`.Registry.versions_page`)."""
        with self.registry.reaching(f"listing the versions of {name}"):
            return await self.registry.versions_page(name, start_after=start_after, limit=limit)

    async def freeze(self, ref: str, *, caller: Caller | None = None) -> dict[str, Any]:
        """Freeze the snapshot ``ref`` refers to (:meth:`.Freezer.freeze`): a version of
        a name by its owner or an admin; a bare snapshot id by anyone.

        A freeze writes only what the daemon itself reads at the recorded versions and
        verifies (chunks named by their hashes, a record under the snapshot's id), so
        it changes no snapshot's meaning, whoever asks it (and anyone may register a
        snapshot's manifest under a name of their own and freeze that). Freezing a
        version *of a name* stays its owner's, as every other write to a name is."""
        self.registry.writable()  # before any work
        with self.registry.reaching(f"freezing {ref}"):
            resolved = await self.registry.resolve(ref)
            if resolved.name is not None:
                check = self._may_write(caller, resolved.name, "freeze")
                if check is not None:
                    check(await self.registry.owner(resolved.name))
        report = await self._freezer.freeze(resolved.snapshot, what=f"freezing {ref}")
        return {"snapshot": resolved.snapshot.id} | report

    async def migrate(
        self, ref: str, to: str, name: str | None = None, *, caller: Caller | None = None
    ) -> dict[str, Any]:
        """Copy the snapshot ``ref`` refers to to ``to`` (``BACKEND/PREFIX``), verified,
        and register the copy as the next version of its name (or of ``name``): a name
        that exists, by its owner or an admin (checked before anything is copied)."""
        self.registry.writable()
        self._migrator.destination(to)
        with self.registry.reaching(f"migrating {ref}"):
            resolved = await self.registry.resolve(ref)
            frozen = await self._frozen(resolved.snapshot)
        target = name or resolved.name
        if target is None:
            raise InvalidRequestError(
                f"migrating snapshot {ref}: a snapshot id names no dataset; give the name to "
                "register the copy under"
            )
        may_write = self._may_write(caller, target, "register a new version of")
        if may_write is not None:
            with self.registry.reaching(f"migrating {ref}"):
                if await self.registry.has_versions(target):
                    may_write(await self.registry.owner(target))
        copy, counts = await self._migrator.copy(resolved.snapshot, to, frozen)
        # The copy's content and origin are the daemon's own record of what it read.
        committed = await self._commit(copy.data, target, caller=caller, verified_copy=True)
        return committed | {"from": resolved.snapshot.id, "frozen": frozen is not None} | counts

    def roots(self, backend: Backend) -> AsyncGenerator[str, None]:
        """The chunk ids a garbage collection of ``backend`` must keep: those of every
        frozen snapshot, when ``backend`` is the registry's (nothing otherwise)."""
        return frozen_chunk_ids(self.registry, backend)
