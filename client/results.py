"""The values the client hands back: a daemon's answer, an object's stat, the cache's state.

:class:`Reply` is what :meth:`~chunkd.client.Client.request` returns, :class:`ObjectStat`
what :meth:`~chunkd.client.Client.stat` returns, and :class:`CacheInfo` what
:meth:`~chunkd.client.Client.cache_info` returns. All three are re-exported by
:mod:`chunkd.client`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chunkd.memfd import close_all

__all__ = ["CacheInfo", "ObjectStat", "Reply"]


@dataclass(frozen=True, slots=True)
class Reply:
    """A successful answer of the daemon to :meth:`Client.request`.

    The caller owns :attr:`fds` (sealed memfds): close them with :meth:`close`, or
    use the reply as a context manager.
    """

    #: the answer's JSON header (``"ok": true`` and the op's fields)
    header: dict[str, Any]
    #: the bytes that came with it
    payload: bytes
    #: the fds that came with it, the caller's to close
    fds: list[int]

    def close(self) -> None:
        """Close every fd of the reply."""
        close_all(self.fds)
        self.fds.clear()

    def __enter__(self) -> Reply:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class ObjectStat:
    """An object version as the daemon reports it.

    Attributes:
        name: ``BACKEND/KEY``.
        size: bytes in the object.
        version: the backend's version token (ETag, version id, size+mtime).
        chunk_bytes: the size of every chunk but the last.
        chunks: how many chunks the object splits into.
        modified: when the object was last written, seconds since the epoch (None:
            the backend does not say).
    """

    name: str
    size: int
    version: str
    chunk_bytes: int
    chunks: int
    modified: float | None = None


@dataclass(frozen=True, slots=True)
class CacheInfo:
    """What a client's own cache holds (see :meth:`Client.cache_info`).

    Attributes:
        chunks: chunk mappings cached.
        bytes: their page-rounded size.
        max_bytes: the ``cache_bytes`` budget.
        max_chunks: the most chunks cached at once (each holds an fd).
        names: names whose size, version and chunk ids are remembered.
    """

    chunks: int
    bytes: int
    max_bytes: int
    max_chunks: int
    names: int
