"""Listings in pages, of any size, for every door: the local socket, HTTP, the S3 front.

A listing is read as a series of pages. Each page is answered from one streamed,
recursive listing of the backend (:meth:`Backend.scan`, in key order), which chunkd
groups by ``/`` itself, so no page holds more than its own entries in memory,
however many objects the backend has (obstore's ``list_with_delimiter`` reads a
whole level at once).

The page token
    A page that may not be the last carries ``next``: give it back as
    ``start_after`` for the following page (a full page may be followed by an empty
    last one). It is a key of the backend: the last object key of the
    page, or, when the page ends on a directory, that directory's key followed by
    ``/`` (everything under it was folded into the one entry, and is skipped). Any
    key serves as ``start_after``: a listing resumes after it, in key order (the
    UTF-8 byte order S3 lists in). The last page has ``next`` None.

Grouping
    One level (not ``recursive``): the objects directly under the prefix, and one
    ``directory`` entry per name that has objects below it. The keys under a
    directory already folded are skipped; when more than a batch of them go by, the
    scan starts again after the directory instead of reading through it.

Read-ahead
    Once a page that has a next is answered, the next page is read in the
    background, so the backend (or the disk) works while the client decodes: a long
    listing costs about the larger of the two, not their sum. A page read ahead is
    served once when the backend caches no listings (``list_revalidate = 0``).

Caching
    Pages are kept in memory per backend for its ``list_revalidate`` seconds
    (objects are often immutable, but a folder gains new shards), within
    :data:`CACHE_ENTRIES` entries in all; concurrent requests for one page make one
    backend listing. Listings that must see the backend as it is now (garbage
    collection, a commit's poll for parts, the checkpoint catalog) call
    :meth:`Backend.scan` and never read this cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple

from chunkd.cache.singleflight import SingleFlight
from chunkd.errors import ChunkdError
from chunkd.gateway.backends import SCAN_BATCH, ObjectMeta

if TYPE_CHECKING:
    from chunkd.gateway.backends import Backend, Backends
    from chunkd.gateway.metrics import Metrics

__all__ = ["CACHE_ENTRIES", "MAX_PAGE", "ListEntry", "ListPage", "Listings"]

log = logging.getLogger("chunkd.gateway.listing")

#: the most entries one page may hold
MAX_PAGE: Final = 10_000
#: entries kept by the listing cache, all backends together (about 300 bytes each)
CACHE_ENTRIES: Final = 1 << 16
#: sorts after every character a key can hold: a scan from ``d/`` + this skips ``d/``
_PAST: Final = "\U0010ffff"
#: pages read ahead at once, all listings together
_AHEAD_TASKS: Final = 64
#: seconds a page read ahead waits for its reader when listings are not cached
_AHEAD_TTL: Final = 10.0


class ListEntry(NamedTuple):
    """One entry of a listing: an object, or a directory (a key prefix up to a ``/``)."""

    #: the object's key, or the directory's key without its trailing ``/``
    key: str
    type: Literal["file", "directory"]
    size: int = 0
    #: the object's version token (None for a directory)
    version: str | None = None
    #: when the object was last written, seconds since the epoch (None: unknown)
    modified: float | None = None

    @property
    def token(self) -> str:
        """The ``start_after`` that resumes a listing after this entry."""
        return self.key + "/" if self.type == "directory" else self.key

    def to_json(self, backend: str) -> dict[str, Any]:
        """The entry as the doors answer it, named ``BACKEND/KEY``."""
        if self.type == "directory":
            return {"name": f"{backend}/{self.key}", "type": "directory"}
        return {
            "name": f"{backend}/{self.key}",
            "type": "file",
            "size": self.size,
            "version": self.version,
            "modified": self.modified,
        }

    @classmethod
    def of(cls, meta: ObjectMeta) -> ListEntry:
        """An object's entry."""
        return cls(meta.key, "file", meta.size, meta.version, meta.modified or None)


@dataclass(frozen=True, slots=True)
class ListPage:
    """One page of a listing."""

    backend: str
    entries: tuple[ListEntry, ...]
    #: ``start_after`` for the next page; None: this is the last
    next: str | None

    def to_json(self) -> list[dict[str, Any]]:
        """The entries as the doors answer them, one object each."""
        return [e.to_json(self.backend) for e in self.entries]

    def columns(self) -> dict[str, Any]:
        """The entries by column, as the local socket sends them (see its ``list``)."""
        entries = self.entries
        return {
            "backend": self.backend,
            "keys": [e.key for e in entries],
            "sizes": [e.size for e in entries],
            "versions": [e.version for e in entries],
            "modified": [e.modified for e in entries],
            "dirs": [i for i, e in enumerate(entries) if e.type == "directory"],
        }


_Key = tuple[str, str, bool, str | None, int, int]


class Listings:
    """Pages of listings, cached per backend. See the module docstring.

    Args:
        backends: the configured backends (the allowlist).
        metrics: where pages and entries are counted.
        cache_entries: the most entries the cache holds.
    """

    def __init__(
        self, backends: Backends, metrics: Metrics, *, cache_entries: int = CACHE_ENTRIES
    ) -> None:
        self.backends = backends
        self.metrics = metrics
        self.cache_entries = cache_entries
        #: key -> (expiry, page, served once only)
        self._cache: OrderedDict[_Key, tuple[float, ListPage, bool]] = OrderedDict()
        self._cached = 0
        self._flights: SingleFlight[_Key, ListPage] = SingleFlight()
        self._ahead: set[asyncio.Task[None]] = set()
        #: keys of the pages being read ahead, and those a reader joined while they were
        self._ahead_keys: set[_Key] = set()
        self._served: set[_Key] = set()

    async def page(
        self,
        backend_name: str,
        prefix: str,
        *,
        recursive: bool = False,
        start_after: str | None = None,
        limit: int = 1000,
        max_bytes: int = 1 << 24,
        fresh: bool = False,
    ) -> ListPage:
        """One page of the listing of ``prefix`` (``""``: the whole backend).

        ``prefix`` names a directory: ``a/b`` lists ``a/b/...``, never ``a/bc``.
        The page holds at most ``limit`` entries, and entries of about ``max_bytes``
        encoded in all (at least one). ``fresh``: read from the backend now, not from
        the pages kept (the page read is kept for the readers after).

        Raises:
            UnknownBackendError, BackendForbiddenError, BackendUnavailableError
        """
        backend = self.backends.get(backend_name)
        base = prefix.strip("/")
        top = f"{base}/" if base else ""
        limit = max(1, min(limit, MAX_PAGE))
        key: _Key = (backend.name, top, recursive, start_after, limit, max_bytes)
        ttl = backend.config.list_revalidate
        cached = None if fresh else self._cache.get(key)
        if fresh:
            self._forget(key)
        if cached is not None:
            expires, page, once = cached
            if time.monotonic() < expires:
                if once:
                    self._forget(key)  # read ahead for its one reader
                else:
                    self._cache.move_to_end(key)
                self._counted(backend.name, "cache", page)
                self._read_ahead(backend, key, page)
                return page
            self._forget(key)
        joined = key in self._ahead_keys
        page = await self._flights.run(
            key, lambda: self._read(backend, top, recursive, start_after, limit, max_bytes)
        )
        if joined and ttl <= 0:  # the read-ahead's one reader: nothing of it is kept
            if key in self._ahead_keys:
                self._served.add(key)  # it has not stored the page yet: it will not
            elif (kept := self._cache.get(key)) is not None and kept[2]:
                self._forget(key)
        self._counted(backend.name, "backend", page)
        if ttl > 0 and key not in self._cache:
            self._keep(key, time.monotonic() + ttl, page)
        self._read_ahead(backend, key, page)
        return page

    def _read_ahead(self, backend: Backend, key: _Key, page: ListPage) -> None:
        """Start reading the page after ``page`` in the background (see the module)."""
        if page.next is None or len(self._ahead) >= _AHEAD_TASKS:
            return
        name, top, recursive, _, limit, max_bytes = key
        after = (name, top, recursive, page.next, limit, max_bytes)
        if after in self._cache or after in self._flights:
            return
        task = asyncio.create_task(self._fetch_ahead(backend, after))
        self._ahead.add(task)
        self._ahead_keys.add(after)
        task.add_done_callback(self._ahead.discard)

    async def _fetch_ahead(self, backend: Backend, key: _Key) -> None:
        _, top, recursive, start_after, limit, max_bytes = key
        try:
            page = await self._flights.run(
                key, lambda: self._read(backend, top, recursive, start_after, limit, max_bytes)
            )
        except ChunkdError as exc:  # the reader asks again, and gets the error then
            log.debug("listing read-ahead of %s/%s failed: %s", backend.name, top, exc)
            return
        finally:
            self._ahead_keys.discard(key)
            served = key in self._served  # its reader joined, and has the page already
            self._served.discard(key)
        ttl = backend.config.list_revalidate
        if not served and key not in self._cache:
            self._keep(key, time.monotonic() + max(ttl, _AHEAD_TTL), page, once=ttl <= 0)

    async def close(self) -> None:
        """Stop reading ahead."""
        for task in self._ahead:
            task.cancel()
        await asyncio.gather(*self._ahead, return_exceptions=True)

    def _counted(self, backend: str, source: str, page: ListPage) -> None:
        self.metrics.list_requests.labels(backend, source).inc()
        self.metrics.list_entries.labels(backend).inc(len(page.entries))

    async def _read(
        self,
        backend: Backend,
        top: str,
        recursive: bool,
        start_after: str | None,
        limit: int,
        max_bytes: int,
    ) -> ListPage:
        entries: list[ListEntry] = []
        used = 0
        after = start_after
        if after is not None and after < top:
            after = None  # the token lies before the prefix: start at its beginning
        if not recursive and after is not None and after.endswith("/"):
            after += _PAST  # the page ended on a directory: skip everything under it
        folded: str | None = None  # the directory whose keys are being skipped
        skipped = 0
        # A recursive page reads what it returns; one level may fold many keys.
        size = min(limit, SCAN_BATCH) if recursive else SCAN_BATCH
        while True:
            restart = None
            scan = backend.scan(top, start_after=after, batch=size)
            async with contextlib.aclosing(scan):
                async for batch in scan:
                    if recursive:  # the common case of a long listing: a batch at once
                        take = batch[: limit - len(entries)]
                        need = sum([_cost(m.key, m.version) for m in take])
                        if used + need <= max_bytes:
                            entries += [
                                ListEntry(m.key, "file", m.size, m.version, m.modified or None)
                                for m in take
                            ]
                            used += need
                            if len(entries) >= limit:
                                return ListPage(backend.name, tuple(entries), entries[-1].token)
                            continue
                    for meta in batch:
                        key = meta.key
                        slash = -1 if recursive else key.find("/", len(top))
                        if slash < 0:
                            when = meta.modified or None
                            entry = ListEntry(key, "file", meta.size, meta.version, when)
                        else:
                            name = key[:slash]
                            if name == folded:
                                skipped += 1
                                if skipped > SCAN_BATCH:
                                    restart = name + "/" + _PAST
                                    break
                                continue
                            folded, skipped = name, 0
                            entry = ListEntry(name, "directory")
                        cost = _cost(entry.key, entry.version)
                        if entries and used + cost > max_bytes:
                            return ListPage(backend.name, tuple(entries), entries[-1].token)
                        entries.append(entry)
                        used += cost
                        if len(entries) >= limit:  # more may follow: the next page says
                            return ListPage(backend.name, tuple(entries), entry.token)
                    if restart is not None:
                        break
            if restart is None:
                return ListPage(backend.name, tuple(entries), None)
            after, skipped = restart, 0

    def _keep(self, key: _Key, expires: float, page: ListPage, *, once: bool = False) -> None:
        if len(page.entries) > self.cache_entries:
            return
        self._cache[key] = (expires, page, once)
        self._cached += len(page.entries)
        while self._cached > self.cache_entries:
            self._forget(next(iter(self._cache)))
        self.metrics.list_cached_entries.set(self._cached)

    def _forget(self, key: _Key) -> None:
        dropped = self._cache.pop(key, None)
        if dropped is not None:
            self._cached -= len(dropped[1].entries)
            self.metrics.list_cached_entries.set(self._cached)


def _cost(key: str, version: str | None) -> int:
    """An upper bound of an entry's encoded size in JSON.

    A printable ASCII character takes at most 2 bytes (a quote or a backslash is
    escaped); anything else at most 6 (a control character is written ``\u0001``).
    """
    text = key + (version or "")
    if text.isascii() and text.isprintable():
        return 2 * len(text) + 160
    return 6 * len(text.encode("utf-8", "surrogatepass")) + 160
