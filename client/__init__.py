"""What trainers import: the client of the node's chunkd daemon.

Light on purpose: the standard library only (numpy is imported by :func:`as_numpy`
when it is called). See :mod:`chunkd.client.core` for how reads, the client cache and
reconnection behave (and the modules that hold each part), and
:mod:`chunkd.client.protocol` for the local socket protocol.
"""

from __future__ import annotations

from chunkd.client.aio import AsyncClient
from chunkd.client.core import Client
from chunkd.client.files import ChunkdFile
from chunkd.client.jobs import job_name
from chunkd.client.results import CacheInfo, ObjectStat, Reply
from chunkd.client.stalls import StallMeter
from chunkd.client.views import as_numpy
from chunkd.errors import DaemonUnavailableError

__all__ = [
    "AsyncClient",
    "CacheInfo",
    "ChunkdFile",
    "Client",
    "DaemonUnavailableError",
    "ObjectStat",
    "Reply",
    "StallMeter",
    "as_numpy",
    "job_name",
]
