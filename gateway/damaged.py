"""The chunks this node read damaged from the backends' chunk stores: :class:`DamagedChunks`.

Below the backends' registry (which holds one for the node) and the chunk store
(:mod:`chunkd.gateway.chunkstore`, which repairs them), so neither imports the other,
and outside the backends' package, so that the chunk store (and the checkpoints and
registry above it) can know of damaged chunks without loading every backend kind.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from chunkd.cache import ChunkId

__all__ = ["MAX_DAMAGED", "DamagedChunks"]

#: chunks a node remembers it saw damaged (the oldest is forgotten first)
MAX_DAMAGED: Final = 65_536


class DamagedChunks:
    """The chunks this node read damaged from a backend's store, until one is repaired.

    Bounded (:data:`MAX_DAMAGED`); forgetting one costs nothing but the next save's
    chance to repair it without a read (the next read notes it again).
    """

    def __init__(self, limit: int = MAX_DAMAGED) -> None:
        self.limit = limit
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()

    def note(self, backend: str, cid: ChunkId | str) -> None:
        """Chunk ``cid`` of ``backend`` read with bytes that do not hash to it."""
        self._seen[(backend, str(cid))] = None
        self._seen.move_to_end((backend, str(cid)))
        while len(self._seen) > self.limit:
            self._seen.popitem(last=False)

    def __contains__(self, item: tuple[str, ChunkId | str]) -> bool:
        backend, cid = item
        return (backend, str(cid)) in self._seen

    def repaired(self, backend: str, cid: ChunkId | str) -> None:
        """Chunk ``cid`` of ``backend`` holds its bytes again."""
        self._seen.pop((backend, str(cid)), None)

    def __len__(self) -> int:
        return len(self._seen)
