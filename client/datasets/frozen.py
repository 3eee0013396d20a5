"""A frozen snapshot's member bytes, from the registry's chunks: :class:`FrozenSource`.

``chunkd dataset freeze`` copies every member's bytes into the registry backend's
content-addressed chunk store and writes the snapshot's frozen record last: a root and
record pages (:mod:`chunkd.frozen`), which ``ds_resolve`` answers with the root alone.
Member ``m``'s byte ``b`` is in its chunk ``b // N`` (``N`` the record's
``chunk_bytes``); its chunk ids are in the record page(s) of its key, which this source
fetches with ``ds_page`` when the member is first read, checks against its id and its
root's entry, and keeps parsed (the :data:`RECORD_PAGES_HELD` most recently used). A
record written before records paged (schema 1: one document, ``{"chunk_bytes": N,
"members": [[CHUNK_ID, ...], ...], "content": [...]}``) is read whole, as before.

The daemon verifies each chunk against its id before it sends it (``ckpt_chunks``), so
a frozen snapshot reads bit-exact whatever became of its source objects.
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, BinaryIO, Final

from chunkd.client.files import ChunkdFile
from chunkd.client.results import ObjectStat
from chunkd.client.views import Chunk, ChunkLRU, Located, Span, check_chunk_fd
from chunkd.errors import DatasetNotFoundError, ManifestError
from chunkd.frozen import (
    FROZEN_FORMAT,
    RECORD_SCHEMA,
    Piece,
    RecordRoot,
    member_chunks,
    parse_record_page,
)
from chunkd.memfd import close_all
from chunkd.snapshot import PageSource, load_json

if TYPE_CHECKING:
    from chunkd.client.core import Client
    from chunkd.snapshot import Member, Snapshot

__all__ = ["RECORD_PAGES_HELD", "FrozenSource"]

#: record pages a frozen source keeps parsed (each at most 4 MiB of JSON)
RECORD_PAGES_HELD: Final = 4

#: chunk mappings a frozen source keeps (they share the daemon's pages)
_MAPPED_CHUNKS: Final = 64
#: chunks asked for in one request
_CHUNKS_AT_ONCE: Final = 16
#: how deep a frozen record nests (its chunk lists: 2)
_RECORD_DEPTH: Final = 4


class FrozenSource:
    """Members read from the registry's chunks (see the module docstring).

    Loaders do not prefetch for it (:attr:`prefetchable`): a prefetch names objects,
    and a frozen snapshot's objects may have been rewritten since; its chunks are
    fetched, verified, as they are read.

    Args:
        client: the node's daemon.
        registry: the backend that holds the chunks (the registry's).
        chunk_bytes: the size of every chunk but a member's last.
        chunks: each member's chunk ids, in the manifest's member order.
        snapshot: the snapshot (for member names and order).
    """

    def __init__(
        self,
        client: Client,
        registry: str,
        chunk_bytes: int,
        chunks: list[list[str]],
        snapshot: Snapshot,
    ) -> None:
        self._root: RecordRoot | None = None
        self._pages: PageSource | None = None
        self._held: OrderedDict[int, dict[str, list[Piece]]] = OrderedDict()
        self._lock = threading.Lock()
        if len(chunks) != len(snapshot.members):
            raise ManifestError(
                f"the frozen record of snapshot {snapshot.id} lists {len(chunks)} members; "
                f"the manifest has {len(snapshot.members)}: freeze it again"
            )
        self.client = client
        self.registry = registry
        self.chunk_bytes = chunk_bytes
        self.snapshot: Snapshot | None = snapshot
        #: the snapshot's source backend (the members' names) and id (for messages)
        self._backend = snapshot.backend
        self._label = f"snapshot {snapshot.id}"
        self._chunks = {m.key: ids for m, ids in zip(snapshot.members, chunks, strict=True)}
        self._mapped = ChunkLRU(max_bytes=_MAPPED_CHUNKS * max(1, chunk_bytes), max_chunks=64)
        self._record: dict[str, Any] = {"chunk_bytes": chunk_bytes, "members": chunks}

    @classmethod
    def of_member(
        cls,
        client: Client,
        registry: str,
        chunk_bytes: int,
        member: Member,
        chunks: list[str],
        *,
        backend: str = "frozen",
    ) -> FrozenSource:
        """A source of one frozen member alone, ``chunks`` its chunk ids: what the
        daemon's decode workers read (docs/decoding.md). Every chunk is verified by the
        daemon against its id, as for a whole snapshot.

        Args:
            client: the node's daemon.
            registry: the backend that holds the chunks.
            chunk_bytes: the size of every chunk but the member's last.
            member: the member.
            chunks: its chunk ids, in order.
            backend: the member's source backend, for its name in messages.
        """
        source = cls.__new__(cls)
        source.client = client
        source.registry = registry
        source.chunk_bytes = chunk_bytes
        source.snapshot = None
        source._backend = backend
        source._label = f"member {member.key}"
        source._chunks = {member.key: list(chunks)}
        source._mapped = ChunkLRU(max_bytes=_MAPPED_CHUNKS * max(1, chunk_bytes), max_chunks=64)
        source._record = {"chunk_bytes": chunk_bytes, "members": [list(chunks)]}
        source._root = None
        source._pages = None
        source._held = OrderedDict()
        source._lock = threading.Lock()
        return source

    @property
    def record(self) -> dict[str, Any]:
        """The frozen record as a schema-1 document, ``{"chunk_bytes", "members",
        "content"}`` by member index: what ``diff`` learns of each member's bytes
        (:func:`chunkd.snapshot.content_evidence`). Of a paged record it reads every
        record page (and every member page): ``diff`` compares every member of a
        frozen snapshot anyway."""
        if self._root is None or self.snapshot is None:
            return self._record
        members: list[list[str]] = []
        contents: list[str | None] = []
        for member in self.snapshot.members:
            members.append(list(self._ids(member)))
            contents.append(self._content(member))
        return {"chunk_bytes": self.chunk_bytes, "members": members, "content": contents}

    def chunks_of(self, member: Member) -> list[str]:
        """The chunk ids of ``member``, in order (what ``ds_decode`` sends for it).

        Raises:
            KeyError: ``member`` is not one of this source's.
            ManifestError: a record page is damaged, or does not fit the member.
        """
        return list(self._ids(member))

    def _ids(self, member: Member) -> Sequence[str]:
        """``member``'s chunk ids: from the record whole (schema 1), or from the record
        page(s) of its key, loaded as needed (schema 2)."""
        root = self._root
        if root is None:
            return self._chunks[member.key]
        if root.page_for(member.key) is None:
            raise KeyError(member.key)
        count = -(-member.size // self.chunk_bytes)
        return member_chunks(
            root, member.key, count, lambda page: self._record_page(page).get(member.key, [])
        )

    def _content(self, member: Member) -> str | None:
        """The blake3 the freeze recorded of ``member``'s bytes (on its last piece)."""
        assert self._root is not None
        at = self._root.page_for(member.key, max(0, -(-member.size // self.chunk_bytes) - 1))
        if at is None:
            return None
        pieces = self._record_page(at).get(member.key, [])
        return pieces[-1].content if pieces else None

    def _record_page(self, index: int) -> dict[str, list[Piece]]:
        """Record page ``index``'s pieces by member key, fetched and checked when not
        held (the :data:`RECORD_PAGES_HELD` most recently used are)."""
        with self._lock:
            held = self._held.get(index)
            if held is not None:
                self._held.move_to_end(index)
                return held
        assert self._root is not None
        assert self._pages is not None
        ref = self._root.pages[index]
        try:
            pieces = parse_record_page(self._pages.page(ref.id), ref, self.chunk_bytes)
        except DatasetNotFoundError as exc:
            raise ManifestError(
                f"the frozen record of {self._label} lacks page {ref.id} ({exc}); freeze it again"
            ) from None
        by_key: dict[str, list[Piece]] = {}
        for piece in pieces:
            by_key.setdefault(piece.key, []).append(piece)
        with self._lock:
            self._held[index] = by_key
            while len(self._held) > RECORD_PAGES_HELD:
                self._held.popitem(last=False)
        return by_key

    @classmethod
    def from_record(
        cls,
        client: Client,
        header: dict[str, Any],
        data: bytes,
        snapshot: Snapshot,
        pages: PageSource | None = None,
    ) -> FrozenSource:
        """The source of a frozen record (``data``) as ``ds_resolve`` answered it: of a
        paged record (schema 2), its root, whose pages come from ``pages`` (default:
        ``ds_page`` from the daemon of ``client``, in ``header``'s registry).

        Raises:
            ManifestError: the record is malformed or does not match the manifest.
        """
        what = f"the frozen record of snapshot {snapshot.id}"
        try:
            record = load_json(data, what, max_depth=_RECORD_DEPTH)
            if isinstance(record, dict) and record.get("schema") == RECORD_SCHEMA:
                return cls._paged(client, header, record, snapshot, pages)
            chunk_bytes = int(record["chunk_bytes"])
            chunks = [[str(c) for c in ids] for ids in record["members"]]
            backend = str(record.get("backend") or header.get("chunks_backend") or "")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ManifestError(f"{what} is malformed ({exc}); freeze it again") from None
        if not backend:
            raise ManifestError(f"{what} names no chunk backend; freeze it again")
        source = cls(client, backend, chunk_bytes, chunks, snapshot)
        source._record = record
        return source

    @classmethod
    def _paged(
        cls,
        client: Client,
        header: dict[str, Any],
        record: dict[str, Any],
        snapshot: Snapshot,
        pages: PageSource | None,
    ) -> FrozenSource:
        what = f"the frozen record of snapshot {snapshot.id}"
        root = RecordRoot.from_doc(record, what)
        if record.get("format") != FROZEN_FORMAT or root.id != snapshot.id:
            raise ManifestError(f"{what} names another snapshot; freeze it again")
        if root.members != len(snapshot.members):
            raise ManifestError(
                f"{what} lists {root.members} members; the manifest has "
                f"{len(snapshot.members)}: freeze it again"
            )
        backend = root.backend or str(header.get("chunks_backend") or "")
        if pages is None:
            from chunkd.client.datasets.pages import DaemonPages

            pages = DaemonPages(client, header.get("registry"))
        source = cls.__new__(cls)
        source.client = client
        source.registry = backend
        source.chunk_bytes = root.chunk_bytes
        source.snapshot = snapshot
        source._backend = snapshot.backend
        source._label = f"snapshot {snapshot.id}"
        source._chunks = {}
        source._mapped = ChunkLRU(
            max_bytes=_MAPPED_CHUNKS * max(1, root.chunk_bytes), max_chunks=64
        )
        source._record = record
        source._root = root
        source._pages = pages
        source._held = OrderedDict()
        source._lock = threading.Lock()
        return source

    #: a loader warms nothing ahead for a frozen snapshot (see the class docstring)
    prefetchable = False

    def name(self, member: Member) -> str:
        return f"{self._backend}/{member.key}"

    def read(self, member: Member, offset: int, length: int) -> memoryview:
        return self._locate_member(member, offset, length).view()

    def file(self, member: Member) -> BinaryIO:
        stat = ObjectStat(self.name(member), member.size, member.version, self.chunk_bytes, 0)
        raw = ChunkdFile(_MemberRanges(self, member), stat)
        return io.BufferedReader(raw, buffer_size=1 << 20)

    def _locate_member(self, member: Member, offset: int, length: int | None) -> Located:
        end = member.size if length is None else min(member.size, offset + length)
        offset = min(offset, end)
        step = self.chunk_bytes
        ids = self._ids(member)
        first, last = offset // step, -(-end // step)
        self._load([ids[i] for i in range(first, last) if ids[i] not in self._mapped])
        pieces: list[Span | memoryview] = []
        for index in range(first, last):
            chunk = self._mapped.get(ids[index])
            if chunk is None:  # evicted by this very read: a read larger than the LRU
                self._load([ids[index]])
                chunk = self._mapped.get(ids[index])
                assert chunk is not None
            base = index * step
            pieces.append(Span(chunk, max(offset, base) - base, min(end, base + step) - base))
        return Located(self.name(member), member.version, member.size, end - offset, pieces)

    def _load(self, wanted: list[str]) -> None:
        wanted = list(dict.fromkeys(wanted))
        for at in range(0, len(wanted), _CHUNKS_AT_ONCE):
            batch = wanted[at : at + _CHUNKS_AT_ONCE]
            reply = self.client.request(
                "ckpt_chunks",
                {"backend": self.registry, "ids": batch},
                what=f"reading frozen {self._label[:21]}",
            )
            fds, sizes = list(reply.fds), list(reply.header.get("sizes", []))
            reply.fds.clear()
            try:
                if len(fds) != len(batch) or len(sizes) != len(batch):
                    raise ManifestError(
                        f"the daemon sent {len(fds)} chunks of {len(batch)} asked for "
                        f"frozen {self._label}"
                    )
                for chunk_id, size in zip(batch, sizes, strict=True):
                    check_chunk_fd(chunk_id, int(size), fds[0])
                    self._mapped.put(Chunk(chunk_id, int(size), fds.pop(0)))
            finally:
                close_all(fds)


class _MemberRanges:
    """A range source (for :class:`ChunkdFile`) over one frozen member."""

    def __init__(self, source: FrozenSource, member: Member) -> None:
        self._source = source
        self._member = member

    def locate(self, name: str, offset: int, length: int | None) -> Located:
        return self._source._locate_member(self._member, offset, length)
