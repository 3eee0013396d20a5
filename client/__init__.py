"""What trainers import: the client of the node's chunkd daemon.

Light on purpose: the standard library only (numpy is imported by :func:`as_numpy`
when it is called). See :mod:`chunkd.client.core` for how reads, the client cache and
reconnection behave, and :mod:`chunkd.client.protocol` for the local socket protocol.
"""

from __future__ import annotations

from chunkd.client.core import (
    AsyncClient,
    CacheInfo,
    ChunkdFile,
    Client,
    DaemonUnavailableError,
    ObjectStat,
    Reply,
    as_numpy,
)

__all__ = [
    "AsyncClient",
    "CacheInfo",
    "ChunkdFile",
    "Client",
    "DaemonUnavailableError",
    "ObjectStat",
    "Reply",
    "as_numpy",
]
