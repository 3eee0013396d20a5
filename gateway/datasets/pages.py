"""Member pages in the registry: put (``ds_page_put``) and held like chunks (``ds_page``).

A page (:mod:`chunkd.snapshot`) is at most :data:`~chunkd.snapshot.PAGE_MAX_BYTES` of
canonical JSON whose blake3 is its id, stored at ``PREFIX/pages/<id>.json`` in the
registry's backend (:mod:`.layout`). Its id is the same hash as a chunk id of the same
bytes, so the daemon holds a page as it holds a chunk, by that id:

* **the node's tiers**: a page fetched once is kept in the RAM (and disk) tier under
  its id; every reader of the node is then answered from there, with no backend
  request of any kind (no HEAD: the id names the bytes, and they were hashed when they
  came in);
* **single flight**: concurrent requests of a node for one page make one fetch;
* **peers**: a page missing from the tiers is asked of its owner among the peers
  (rendezvous hashing on its id, ``GET /v1/peer/pages/{id}``: the owner answers from
  its tiers, or fetches it from the registry once for the cluster); the node that owns
  it, or whose owners all failed, GETs ``pages/<id>.json`` itself. No node asks the
  registry for a page's version (no HEAD): the id names the bytes. A page of up to
  ``chunk_bytes`` is kept in the tiers as one chunk, whose id is the page's; a larger
  one is served from its fetch and fetched again when asked again.

Whatever the source, the bytes are hashed and must be the id before anything keeps or
serves them: one that is not is a :class:`~chunkd.errors.ManifestError` naming the
page (nothing is cached), a page that is not there a
:class:`~chunkd.errors.DatasetNotFoundError` naming it. The daemon does not check that a
page fits a root: the reader does (:func:`chunkd.snapshot.parse_page`).

A put (:meth:`PageStore.put`) is bounded before anything is read (the caller checks the
size of its memfd), checked by its shape before it is parsed, parsed in a thread (a
turn of the registry's checks), refused when a member carries ``content`` (unless the
daemon's own migrate puts it), and put if absent; a copy there of another size, or that
does not hash to the id, is replaced.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Final

from chunkd.cache import BytesLease, Chunk, ChunkId, ChunkLease
from chunkd.cache.singleflight import SingleFlight
from chunkd.errors import (
    DatasetNotFoundError,
    InvalidChunkIdError,
    InvalidRequestError,
    ManifestError,
    RangeNotSatisfiableError,
)
from chunkd.ranges import ByteRange
from chunkd.snapshot import (
    CONTAINER_BYTES,
    MAX_DEPTH,
    PAGE_KIND,
    PAGE_MAX_BYTES,
    PAGE_MAX_MEMBERS,
    PAGE_SCHEMA,
    Member,
    check_json_shape,
    load_json,
    page_bytes,
)

if TYPE_CHECKING:
    from chunkd.cache import ChunkCache
    from chunkd.gateway.backends import Backend, Backends
    from chunkd.gateway.datasets.layout import Layout
    from chunkd.gateway.readpath import ReadPath

__all__ = ["KNOWN_PAGES", "PageStore", "check_page"]

log = logging.getLogger(__name__)

#: page ids this daemon put or found in the registry, remembered (the oldest forgotten
#: first) so that a commit of a root need not HEAD the pages its client just put: about
#: 200 bytes each, 25 MiB in all (a registration of 500M members' pages)
KNOWN_PAGES: Final = 1 << 17


def page_id_of(text: str) -> ChunkId:
    """A page id (64 hex digits) as the chunk id of the same bytes.

    Raises:
        InvalidRequestError: it is not one.
    """
    try:
        return ChunkId.parse(text)
    except (InvalidChunkIdError, ValueError):
        raise InvalidRequestError(
            f"{text[:80]!r} is not a page id (64 hex digits, the blake3 of the page)"
        ) from None


def check_page(data: bytes, *, verified_copy: bool = False) -> str:
    """The id of page ``data`` once its form is checked (for a put: whether it fits a
    root is the reader's check): its shape before it is parsed, a page of this schema
    of 1 to :data:`~chunkd.snapshot.PAGE_MAX_MEMBERS` members in strictly increasing
    key order, in canonical form, and no member's ``content`` unless ``verified_copy``.

    Raises:
        ManifestError: it is none of that (the message says what).
    """
    where = "the page"
    if len(data) > PAGE_MAX_BYTES:
        raise ManifestError(f"{where} is {len(data)} bytes; a page is at most {PAGE_MAX_BYTES}")
    check_json_shape(data, where, max_depth=MAX_DEPTH, container_bytes=CONTAINER_BYTES, top=b"{")
    doc = load_json(data, where, max_depth=MAX_DEPTH, checked=True)
    if (
        not isinstance(doc, dict)
        or doc.get("kind") != PAGE_KIND
        or doc.get("schema") != PAGE_SCHEMA
    ):
        raise ManifestError(f"{where} is not a member page of schema {PAGE_SCHEMA} ({PAGE_KIND!r})")
    raw = doc.get("members")
    if not isinstance(raw, list) or not 1 <= len(raw) <= PAGE_MAX_MEMBERS:
        raise ManifestError(f"{where}: 'members' must be a list of 1 to {PAGE_MAX_MEMBERS}")
    members = [Member.from_json(e, f"{where}, member {i}") for i, e in enumerate(raw)]
    keys = [m.key.encode() for m in members]
    if any(x >= y for x, y in itertools.pairwise(keys)):
        raise ManifestError(f"{where}: its members are not in strictly increasing key order")
    if not verified_copy and any(m.content is not None for m in members):
        raise ManifestError(
            f"{where} claims a member's content hash ('content'): chunkd records it itself "
            "(only chunkd dataset migrate writes it, from the bytes it read), and never takes "
            "it from a client, since diff trusts it; leave it out (nothing was stored)"
        )
    if page_bytes(members) != data:
        raise ManifestError(
            f"{where} is not in canonical form (sorted keys, no spaces, UTF-8: "
            "chunkd.snapshot.page_bytes); nothing was stored"
        )
    return str(ChunkId.of(data))


class PageStore:
    """The registry's member pages: put, known, and held like chunks (module docstring).

    Args:
        backends: the configured backends.
        backend_name: the registry's backend.
        layout: the registry's keys.
        cache: the node's chunk cache (None: pages are not kept, each is fetched).
        read_path: the node's read path; with peers, pages are read through it.
    """

    def __init__(
        self,
        backends: Backends,
        backend_name: str,
        layout: Layout,
        cache: ChunkCache | None = None,
        read_path: ReadPath | None = None,
    ) -> None:
        self.backends = backends
        self.backend_name = backend_name
        self.layout = layout
        self.cache = cache
        self.read_path = read_path
        self._fetches: SingleFlight[ChunkId, memoryview] = SingleFlight()
        self._known: OrderedDict[str, None] = OrderedDict()
        #: backend reads of pages this node made (a fetch, not a tier's answer)
        self.fetched = 0

    # -- known pages ----------------------------------------------------------------

    def note(self, page_id: str) -> None:
        """Page ``page_id`` is in the registry (this daemon put it, or found it)."""
        self._known[page_id] = None
        self._known.move_to_end(page_id)
        while len(self._known) > KNOWN_PAGES:
            self._known.popitem(last=False)

    def known(self, page_id: str) -> bool:
        """Whether this daemon knows page ``page_id`` is in the registry."""
        return page_id in self._known

    # -- reading --------------------------------------------------------------------

    async def lease(self, page_id: str, *, local: bool = False) -> ChunkLease:
        """Lease page ``page_id``'s bytes, verified: from the node's tiers, else fetched
        once for all of this node's readers: from the page's owner among the peers,
        else (this node owns it, or ``local``: a peer's own request) from the registry.

        Raises:
            InvalidRequestError: ``page_id`` is no page id.
            DatasetNotFoundError: the registry has no such page.
            ManifestError: the registry's copy does not hash to the id.
            BackendUnavailableError, BackendForbiddenError
        """
        cid = page_id_of(page_id)
        if self.cache is not None:
            held = await self.cache.find(cid)
            if held is not None:
                return held
        fetched = await self._fetches.run(cid, lambda: self._fetch(cid, local=local))
        if self.cache is not None:
            held = await self.cache.find(cid)
            if held is not None:
                return held
        return BytesLease(cid, fetched)  # no tier kept it: served from the fetch's bytes

    async def get(self, page_id: str) -> bytes:
        """Page ``page_id``'s bytes, verified (:meth:`lease`)."""
        with await self.lease(page_id) as lease:
            return bytes(lease.view())

    async def _fetch(self, cid: ChunkId, *, local: bool = False) -> memoryview:
        key = self.layout.page(str(cid))
        backend = self.backends.get(self.backend_name)
        peers = None if self.read_path is None or local else self.read_path.peers
        shared = None if peers is None else await peers.fetch_page(cid)  # verified
        raw = shared if shared is not None else await self._from_backend(backend, key, cid)
        got = cid if shared is not None else await asyncio.to_thread(ChunkId.of, raw)
        if got != cid:
            raise ManifestError(
                f"page {cid} in the dataset registry ({backend.name}/{key}) is damaged: its "
                f"{raw.nbytes} bytes hash to {got}; it was not used. Register the dataset "
                "again (its registration puts the page anew)"
            )
        self.fetched += 1
        self.note(str(cid))
        cache = self.cache
        # A page of one chunk is kept in the tiers under its id (a chunk's id is the
        # blake3 of its bytes); a larger one cannot be held as one chunk.
        if cache is not None and raw.nbytes <= cache.config.chunk_bytes:
            held = await cache.find(cid)
            if held is None:
                await cache.put(Chunk.trusted(cid, raw))
            else:
                held.release()
        return raw

    async def _from_backend(self, backend: Backend, key: str, cid: ChunkId) -> memoryview:
        # One request where the store allows (a ranged GET answers the object's size
        # too: no HEAD), never more than a page can be (and a byte): a larger object is
        # damaged and is not read whole.
        first = await backend.open_first(key, 0, PAGE_MAX_BYTES + 1, piece_bytes=PAGE_MAX_BYTES)
        if first is None:
            raise _missing(cid, f"{backend.name}/{key}")
        if first.meta.size > PAGE_MAX_BYTES:
            close = getattr(first.pieces, "aclose", None)  # its connection goes, not drained
            if close is not None:
                await close()
            raise _oversized(cid, f"{backend.name}/{key}")
        if first.pieces is None:  # an empty object
            return memoryview(b"")
        return memoryview(b"".join([bytes(piece) async for piece in first.pieces]))

    # -- writing --------------------------------------------------------------------

    async def put(self, data: bytes, page_id: str) -> bool:
        """Put checked page ``data`` (id ``page_id``) if absent; a copy there that is
        not it is replaced. Returns whether this call wrote it.

        Raises:
            ReadOnlyBackendError, BackendUnavailableError
        """
        backend = self.backends.get(self.backend_name)
        key = self.layout.page(page_id)
        if await backend.put(key, data, if_absent=True):
            self.note(page_id)
            return True
        there = await self._there(backend, key, len(data))
        if there is not None and str(await asyncio.to_thread(ChunkId.of, there)) == page_id:
            self.note(page_id)
            return False
        log.warning(
            "dataset registry: %s/%s does not hash to its id (torn or altered); replaced",
            backend.name,
            key,
        )
        await backend.put(key, data)
        if self.read_path is not None:
            self.read_path.forget(self.backend_name, key)
        self.note(page_id)
        return True

    @staticmethod
    async def _there(backend: Backend, key: str, size: int) -> memoryview | None:
        """The copy at ``key`` if it is ``size`` bytes (None: another size, or gone)."""
        try:
            raw = await backend.get(key, ByteRange(0, size + 1))
        except RangeNotSatisfiableError:
            return None
        return raw if raw is not None and raw.nbytes == size else None

    async def exists(self, page_id: str) -> bool:
        """Whether page ``page_id`` is in the registry: known, or one HEAD (a copy of
        more than a page's bytes is not one).

        Raises:
            BackendUnavailableError, BackendForbiddenError
        """
        if self.known(page_id):
            return True
        backend = self.backends.get(self.backend_name)
        meta = await backend.head(self.layout.page(page_id))
        if meta is None or meta.size > PAGE_MAX_BYTES:
            return False
        self.note(page_id)
        return True


def _missing(cid: ChunkId, where: str) -> DatasetNotFoundError:
    return DatasetNotFoundError(
        f"page {cid} is missing from the dataset registry ({where}); the snapshot that "
        "names it cannot be read: register the dataset again"
    )


def _oversized(cid: ChunkId, where: str) -> ManifestError:
    return ManifestError(
        f"page {cid} in the dataset registry ({where}) is damaged: it is larger than any "
        f"page ({PAGE_MAX_BYTES} bytes); it was not read. Register the dataset again"
    )
