"""``memory://``: objects in the daemon's memory, gone when it stops (tests, demos)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from obstore.store import MemoryStore

from chunkd.gateway.backends.store import StoreBackend

if TYPE_CHECKING:
    from chunkd.gateway.config import BackendConfig

__all__ = ["MemoryBackend"]


class MemoryBackend(StoreBackend):
    """An in-memory store; it takes no endpoint, region or credentials."""

    bounded_per_read: ClassVar[bool] = False

    @classmethod
    def make_store(cls, config: BackendConfig) -> Any:
        # docstring inherited
        return MemoryStore()
