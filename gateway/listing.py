"""Listings in pages, of any size, for every door: the local socket, HTTP, the S3 front.

A listing is read as a series of pages. Each page is answered from one streamed,
recursive listing of the backend (:meth:`Backend.scan`, in key order), which chunkd
groups by ``/`` itself, so no page holds more than its own entries in memory,
however many objects the backend has (obstore's ``list_with_delimiter`` reads a
whole level at once).

The page token
    A page that is not the last carries ``next``: give it back as
    ``start_after`` for the following page. A page has one only when an entry follows
    it, as S3's ``IsTruncated``, except a recursive page that ends with a full batch
    of the backend's listing, which does not look further: the page after it may be
    empty. It is a key of the backend: the last object key of the
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
from chunkd.errors import ChunkdError, InvalidKeyError
from chunkd.gateway.backends import SCAN_BATCH, ObjectMeta
from chunkd.gateway.names import MAX_KEY_BYTES, validate_key

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
#: pages of fewer entries than this are not read ahead: a page of one is a probe
_AHEAD_LIMIT: Final = 2
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


#: (backend, prefix, delimiter, start_after, limit, max_bytes)
_Key = tuple[str, str, str | None, str | None, int, int]


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
        base = prefix.strip("/")
        return await self.page_of(
            backend_name,
            f"{base}/" if base else "",
            delimiter=None if recursive else "/",
            start_after=start_after,
            limit=limit,
            max_bytes=max_bytes,
            fresh=fresh,
        )

    async def page_of(
        self,
        backend_name: str,
        prefix: str,
        *,
        delimiter: str | None,
        start_after: str | None = None,
        limit: int = 1000,
        max_bytes: int = 1 << 24,
        fresh: bool = False,
    ) -> ListPage:
        """One page of the keys that start with ``prefix``, as S3 lists them.

        ``prefix`` is any string (``data/sh`` holds ``data/shards/x`` and
        ``data/sh.txt``); ``delimiter`` groups the keys that hold it after the prefix
        into one ``directory`` entry each (the key up to, not including, the
        delimiter), and None lists every key. A directory's token (``next``) is its key
        followed by the delimiter. :meth:`page` is the directory listing of the other
        doors: ``prefix`` ending in ``/``, delimiter ``/`` or None.

        Raises:
            UnknownBackendError, BackendForbiddenError, BackendUnavailableError
        """
        backend = self.backends.get(backend_name)
        top = prefix
        limit = max(1, min(limit, MAX_PAGE))
        key: _Key = (backend.name, top, delimiter or None, start_after, limit, max_bytes)
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
        page = await self._flights.run(key, lambda: self._read(backend, *key[1:]))
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
        name, top, delimiter, _, limit, max_bytes = key
        # A page of one entry is a probe (s3fs and pyarrow ask for one key to tell a
        # directory from a file): nobody reads the page after it.
        if page.next is None or limit < _AHEAD_LIMIT or len(self._ahead) >= _AHEAD_TASKS:
            return
        after = (name, top, delimiter, page.next, limit, max_bytes)
        if after in self._cache or after in self._flights:
            return
        task = asyncio.create_task(self._fetch_ahead(backend, after))
        self._ahead.add(task)
        self._ahead_keys.add(after)
        task.add_done_callback(self._ahead.discard)

    async def _fetch_ahead(self, backend: Backend, key: _Key) -> None:
        try:
            page = await self._flights.run(key, lambda: self._read(backend, *key[1:]))
        except ChunkdError as exc:  # the reader asks again, and gets the error then
            log.debug("listing read-ahead of %s/%s failed: %s", backend.name, key[1], exc)
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
        delimiter: str | None,
        start_after: str | None,
        limit: int,
        max_bytes: int,
    ) -> ListPage:
        entries: list[ListEntry] = []
        used = 0
        # The backend lists whole path segments: the prefix's own directory is scanned,
        # from just before the prefix, and the scan ends at the first key past it.
        root = top[: top.rfind("/") + 1]
        if not _possible(top):  # "/", "a//", "a/./": no key chunkd can hold starts so
            return ListPage(backend.name, (), None)
        start = _floor(_before(top)) if top != root else None
        after = start_after
        if after is None or (start is not None and after < start) or after < root:
            after = start  # the token lies before the prefix: start at its beginning
        # A backend takes only keys as the place to start; past any other string
        # ("a/./b", "a//"), the scan starts at the greatest key before it, and what
        # is not after it goes.
        past = after
        rest = after[len(top) :] if after is not None and after.startswith(top) else ""
        if (
            delimiter
            and rest.endswith(delimiter)
            and rest.find(delimiter) == len(rest) - len(delimiter)
        ):
            past = after = f"{after}{_PAST}"  # the page ended on a directory: skip it whole
        if after is not None and _floor(after) != after:
            after = _floor(after)
        folded: str | None = None  # the directory whose keys are being skipped
        skipped = 0
        # A full page looks on for one more entry, so that only a page that has one after
        # it says so (as S3's IsTruncated does).
        full = False
        # A recursive page reads what it returns; one level may fold many keys.
        size = min(limit + 1, SCAN_BATCH) if delimiter is None else SCAN_BATCH
        while True:
            restart = None
            scan = backend.scan(root, start_after=after, batch=size)
            async with contextlib.aclosing(scan):
                async for batch in scan:
                    ended = False
                    more = len(batch) >= size  # a full batch: the backend may have more
                    if top != root:  # the keys before the prefix go, and the scan ends past it
                        ended = bool(batch) and not batch[-1].key.startswith(top)
                        batch = [m for m in batch if m.key.startswith(top)]
                    if past != after and past is not None:
                        batch = [m for m in batch if m.key > past]
                    if delimiter is None:  # the common case of a long listing: a batch at once
                        if full and batch:
                            return ListPage(backend.name, tuple(entries), entries[-1].key)
                        take = batch[: limit - len(entries)]
                        need = sum([_cost(m.key, m.version) for m in take])
                        if used + need <= max_bytes:
                            entries += [
                                ListEntry(m.key, "file", m.size, m.version, m.modified or None)
                                for m in take
                            ]
                            used += need
                            if len(entries) >= limit:
                                # Past a full batch the page does not look: that would
                                # cost a backend request per page (the next page may be
                                # empty, when the keys end right there).
                                if len(take) < len(batch) or (more and not ended):
                                    return ListPage(backend.name, tuple(entries), entries[-1].key)
                                full = True
                            batch = []
                    for meta in batch:
                        key = meta.key
                        cut = -1 if delimiter is None else key.find(delimiter, len(top))
                        if cut < 0:
                            when = meta.modified or None
                            entry = ListEntry(key, "file", meta.size, meta.version, when)
                        else:
                            name = key[:cut]
                            if name == folded:
                                skipped += 1
                                if skipped > SCAN_BATCH:
                                    restart = f"{name}{delimiter}{_PAST}"
                                    break
                                continue
                            folded, skipped = name, 0
                            entry = ListEntry(name, "directory")
                        cost = _cost(entry.key, entry.version)
                        if full or (entries and used + cost > max_bytes):  # more follows
                            return ListPage(
                                backend.name, tuple(entries), _token(entries, delimiter)
                            )
                        entries.append(entry)
                        used += cost
                        full = len(entries) >= limit
                    if restart is not None or ended:
                        break  # past the folded directory, or past the prefix
            if restart is None:
                return ListPage(backend.name, tuple(entries), None)
            after, skipped = restart, 0

    def _keep(self, key: _Key, expires: float, page: ListPage, *, once: bool = False) -> None:
        if _charge(page) > self.cache_entries:
            return
        self._forget(key)
        self._cache[key] = (expires, page, once)
        self._cached += _charge(page)
        while self._cached > self.cache_entries:
            self._forget(next(iter(self._cache)))
        self.metrics.list_cached_entries.set(self._cached)

    def _forget(self, key: _Key) -> None:
        dropped = self._cache.pop(key, None)
        if dropped is not None:
            self._cached -= _charge(dropped[1])
            self.metrics.list_cached_entries.set(self._cached)


def _token(entries: list[ListEntry], delimiter: str | None) -> str:
    """The ``next`` of a page that ends with ``entries[-1]``."""
    last = entries[-1]
    return f"{last.key}{delimiter}" if last.type == "directory" else last.key


def _charge(page: ListPage) -> int:
    """What a kept page counts against :data:`CACHE_ENTRIES`: its entries, and one for
    itself, so that empty pages are bounded too."""
    return len(page.entries) + 1


def _possible(prefix: str) -> bool:
    """Whether a key chunkd can hold may start with ``prefix`` (``a/b`` may, ``a//``,
    ``/a`` or ``a/./`` may not)."""
    if not prefix:
        return True
    try:
        validate_key(prefix + "x")  # "x" completes a last segment that is "", "." or ".."
    except InvalidKeyError:
        return len(prefix.encode("utf-8", "surrogatepass")) >= MAX_KEY_BYTES and _valid(prefix)
    return True


def _valid(key: str) -> bool:
    try:
        validate_key(key)
    except InvalidKeyError:
        return False
    return True


def _floor(text: str) -> str | None:
    """``text`` if it is a key chunkd can hold, else the longest run of its leading
    segments that is one (a string no greater than ``text``), else None."""
    if _valid(text):
        return text
    segments = text.split("/")
    for end in range(len(segments) - 1, 0, -1):
        head = "/".join(segments[:end])
        if _valid(head):
            return head
    return None


def _before(prefix: str) -> str:
    """A string that sorts before ``prefix`` and after every key that does (but no key
    that starts with ``prefix``): where a scan for ``prefix`` starts."""
    code = ord(prefix[-1]) - 1
    if code < 0:
        return prefix[:-1]
    if 0xD800 <= code <= 0xDFFF:  # no surrogates: the backends send keys as UTF-8
        code = 0xD7FF
    if code == ord("/"):  # "a/0" would start at "a//...", no key: "a/." sorts just below
        code = ord(".")
    return f"{prefix[:-1]}{chr(code)}{_PAST}"


def _cost(key: str, version: str | None) -> int:
    """An upper bound of an entry's encoded size in JSON.

    A printable ASCII character takes at most 2 bytes (a quote or a backslash is
    escaped); anything else at most 6 (a control character is written ``\u0001``).
    """
    text = key + (version or "")
    if text.isascii() and text.isprintable():
        return 2 * len(text) + 160
    return 6 * len(text.encode("utf-8", "surrogatepass")) + 160
