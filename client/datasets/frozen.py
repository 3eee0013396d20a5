"""A frozen snapshot's member bytes, from the registry's chunks: :class:`FrozenSource`.

``chunkd dataset freeze`` copies every member's bytes into the registry backend's
content-addressed chunk store and writes the snapshot's frozen record last (see
:mod:`chunkd.gateway.datasets`)::

    {"chunk_bytes": N, "members": [[CHUNK_ID, ...], ...], "content": [HEX|null, ...]}

one list per member, in the manifest's member order: member ``m``'s byte ``b`` is in
its chunk ``b // N``; ``content`` (where the freeze recorded it) the blake3 of each
member's whole bytes. The daemon verifies each chunk against its id before it sends
it (``ckpt_chunks``), so a frozen snapshot reads bit-exact whatever became of its
source objects.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any, BinaryIO, Final

from chunkd.client.files import ChunkdFile
from chunkd.client.results import ObjectStat
from chunkd.client.views import Chunk, ChunkLRU, Located, Span, check_chunk_fd
from chunkd.errors import ManifestError
from chunkd.memfd import close_all
from chunkd.snapshot import load_json

if TYPE_CHECKING:
    from chunkd.client.core import Client
    from chunkd.snapshot import Member, Snapshot

__all__ = ["FrozenSource"]

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
        #: the frozen record as ``ds_resolve`` sent it (what ``diff`` learns of each
        #: member's bytes: :func:`chunkd.snapshot.content_evidence`)
        self.record: dict[str, Any] = {"chunk_bytes": chunk_bytes, "members": chunks}

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
        source.record = {"chunk_bytes": chunk_bytes, "members": [list(chunks)]}
        return source

    def chunks_of(self, member: Member) -> list[str]:
        """The chunk ids of ``member``, in order (what ``ds_decode`` sends for it).

        Raises:
            KeyError: ``member`` is not one of this source's.
        """
        return list(self._chunks[member.key])

    @classmethod
    def from_record(
        cls, client: Client, header: dict[str, Any], data: bytes, snapshot: Snapshot
    ) -> FrozenSource:
        """The source of a frozen record (``data``) as ``ds_resolve`` answered it.

        Raises:
            ManifestError: the record is malformed or does not match the manifest.
        """
        what = f"the frozen record of snapshot {snapshot.id}"
        try:
            record = load_json(data, what, max_depth=_RECORD_DEPTH)
            chunk_bytes = int(record["chunk_bytes"])
            chunks = [[str(c) for c in ids] for ids in record["members"]]
            backend = str(record.get("backend") or header.get("chunks_backend") or "")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ManifestError(f"{what} is malformed ({exc}); freeze it again") from None
        if not backend:
            raise ManifestError(f"{what} names no chunk backend; freeze it again")
        source = cls(client, backend, chunk_bytes, chunks, snapshot)
        source.record = record
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
        ids = self._chunks[member.key]
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
