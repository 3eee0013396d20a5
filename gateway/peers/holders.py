"""Holders: an owner's memory of which members hold each of its chunks.

Holders serve. The owner of a checkpoint chunk (rendezvous by id) sends it itself
to its first ``holder_fanout`` askers; after that it answers a peer's request with
``300 Multiple Choices`` and ``X-Chunkd-Holders``: up to :data:`MAX_NAMED` members
that got the chunk before (or were sent to holders before), the ones with the
fewest askers sent to them so far, each below ``holder_fanout`` (only the first
named counts as an asker sent to it: the others are fallbacks). Every asker is
added to the chunk's list, whatever the answer: it will hold the chunk soon. An
asker whose holders failed comes back with ``direct=1`` (the owner serves) and names
the failed ones (``bad=``), which are dropped. So a hot chunk reaches N nodes
through a tree of fan-out about ``holder_fanout`` rather than from its owner alone,
and the owner sends about ``holder_fanout`` copies of it, not N - 1.

A node is only ever sent to holders added before it (one that asks again keeps its
place and is sent only to those before it), so holder requests (which wait on the
holder's own fetch) cannot wait on each other in a circle while the owner stays the
same; the holder's wait is capped at ``timeout`` for the rest.

Bounds (at the bounds, 65,536 chunks of 32 holders each, about 75 MB, measured with
tracemalloc; an answer takes about 14 µs):

- at most :data:`MAX_HOLDERS_PER_CHUNK` (32) holders per chunk: adding one more
  forgets a holder that has no room left (``holder_fanout`` askers sent to it),
  else the oldest;
- at most :data:`MAX_CHUNKS` (65,536) chunks: the one asked least recently is
  forgotten first;
- a holder is forgotten ``holder_ttl`` after it was added (it may have evicted the
  chunk since), and a chunk not asked for ``holder_ttl`` is forgotten whole (with
  its count of copies sent).

Only members are ever added: the caller passes the asker's ``X-Chunkd-Peer`` only
when the request carried the peer token and :meth:`.membership.Membership.get`
knows the address (:meth:`.cluster.Peers.owner_answer`).
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from chunkd.cache import ChunkId

__all__ = ["MAX_CHUNKS", "MAX_HOLDERS_PER_CHUNK", "MAX_NAMED", "Holders"]

#: The most holders remembered for one chunk.
MAX_HOLDERS_PER_CHUNK: Final = 32
#: The most chunks whose holders are remembered.
MAX_CHUNKS: Final = 65_536
#: The most holders named in one answer (and ``bad=`` names in one request).
MAX_NAMED: Final = 3


class _Chunk:
    """One chunk's holders, in the order they were added (parallel arrays: compact)."""

    __slots__ = ("added", "addresses", "asked", "askers", "sent")

    def __init__(self, now: float) -> None:
        self.sent = 0  # copies the owner sent itself
        self.asked = now  # when a peer last asked for it
        self.addresses: list[str] = []
        self.askers = array("I")  # askers sent to each holder
        self.added = array("d")  # when each holder was added

    def forget(self, i: int) -> None:
        del self.addresses[i], self.askers[i], self.added[i]


class Holders:
    """Which members hold each chunk this node owns, and whom to send askers to.

    Args:
        fanout: ``[peers] holder_fanout``: copies of a chunk the owner sends before it
            names holders, and askers sent to any one holder.
        ttl: ``[peers] holder_ttl``: seconds a holder (and a chunk not asked) is
            remembered.
        on_size: called with the number of chunks remembered when it changes (the
            ``chunkd_peer_holders_tracked`` gauge).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        *,
        fanout: int,
        ttl: float,
        on_size: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fanout = fanout
        self.ttl = ttl
        self._on_size = on_size
        self._clock = clock
        self._chunks: OrderedDict[ChunkId, _Chunk] = OrderedDict()  # least recently asked first
        self._reported = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def holders(self, cid: ChunkId) -> list[tuple[str, int]]:
        """The holders remembered for ``cid`` in the order added, with the askers
        sent to each (expired ones left out)."""
        chunk = self._chunks.get(cid)
        if chunk is None:
            return []
        self._expire(chunk, self._clock())
        return list(zip(chunk.addresses, chunk.askers, strict=True))

    def answer(
        self, cid: ChunkId, asker: str | None, *, direct: bool = False, bad: Iterable[str] = ()
    ) -> list[str]:
        """How to answer ``asker`` (a member's address, or None for a caller that is
        not one) for chunk ``cid``: the holders to send it to (each one's count of
        askers goes up), or ``[]``: serve it (counted as a copy sent).

        ``direct``: the asker's holders failed, serve it; ``bad`` (at most
        :data:`MAX_NAMED` are read) are forgotten for this chunk first. Either way
        the asker is added to the chunk's holders.
        """
        now = self._clock()
        chunk = self._touch(cid, now)
        for address in list(bad)[:MAX_NAMED]:
            if address in chunk.addresses:
                chunk.forget(chunk.addresses.index(address))
        named: list[str] = []
        if not direct and chunk.sent >= self.fanout:
            named = self._pick(chunk, asker)
        if not named:
            chunk.sent += 1
        if asker is not None:
            self._add(chunk, asker, now)
        return named

    def forget(self, cid: ChunkId, bad: Iterable[str]) -> None:
        """Forget holders ``bad`` (at most :data:`MAX_NAMED` are read) of chunk ``cid``:
        an asker got the chunk from a later holder after these failed it."""
        chunk = self._chunks.get(cid)
        if chunk is None:
            return
        for address in list(bad)[:MAX_NAMED]:
            if address in chunk.addresses:
                chunk.forget(chunk.addresses.index(address))

    def _pick(self, chunk: _Chunk, asker: str | None) -> list[str]:
        """Up to MAX_NAMED holders with room added before ``asker``, fewest askers
        first (the earlier added first among equals); only the first named one's
        count of askers goes up: the asker gets the chunk from it unless it fails,
        the others are fallbacks (counting them too would use up a holder's room
        about three times as fast as it serves, and make the tree deeper)."""
        # An asker already listed (it asks again) is sent only to holders added
        # before it: the ones after it may have been sent to it, and two holder
        # requests would then wait on each other's fetch.
        before = chunk.addresses.index(asker) if asker in chunk.addresses else len(chunk.addresses)
        room = [i for i in range(before) if chunk.askers[i] < self.fanout]
        room.sort(key=lambda i: (chunk.askers[i], i))
        picked = sorted(room[:MAX_NAMED])  # named in the order they were added
        if picked:
            chunk.askers[picked[0]] += 1
        return [chunk.addresses[i] for i in picked]

    def _add(self, chunk: _Chunk, address: str, now: float) -> None:
        if address in chunk.addresses:
            return  # kept where it was: it is only ever sent to holders added before it
        if len(chunk.addresses) >= MAX_HOLDERS_PER_CHUNK:
            full = next((i for i, askers in enumerate(chunk.askers) if askers >= self.fanout), 0)
            chunk.forget(full)
        chunk.addresses.append(address)
        chunk.askers.append(0)
        chunk.added.append(now)

    def _touch(self, cid: ChunkId, now: float) -> _Chunk:
        """The chunk's record, made or refreshed as the most recently asked; records
        past the bounds (or not asked for ``ttl``) are forgotten."""
        chunk = self._chunks.get(cid)
        if chunk is not None and now - chunk.asked > self.ttl:
            del self._chunks[cid]
            chunk = None
        if chunk is None:
            chunk = self._chunks[cid] = _Chunk(now)
        else:
            self._chunks.move_to_end(cid)
            chunk.asked = now
            self._expire(chunk, now)
        while self._chunks:
            oldest = next(iter(self._chunks.values()))
            if len(self._chunks) <= MAX_CHUNKS and now - oldest.asked <= self.ttl:
                break
            self._chunks.popitem(last=False)
        if self._on_size is not None and self._reported != len(self._chunks):
            self._reported = len(self._chunks)
            self._on_size(self._reported)
        return chunk

    def _expire(self, chunk: _Chunk, now: float) -> None:
        """Forget the chunk's holders added more than ``ttl`` ago (the oldest first)."""
        stale = 0
        while stale < len(chunk.added) and now - chunk.added[stale] > self.ttl:
            stale += 1
        if stale:
            del chunk.addresses[:stale], chunk.askers[:stale], chunk.added[:stale]
