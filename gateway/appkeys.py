"""The typed keys of the daemon's aiohttp application: the parts every door reaches.

The composition root (:mod:`chunkd.gateway.daemon`) sets them inside the app's
``cleanup_ctx``; the route modules (:mod:`chunkd.gateway.api`, the dashboard's, the
inspector's) read them. They live apart so that route modules import no other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Final

from aiohttp import web

from chunkd.cache import ChunkCache
from chunkd.gateway.backends import Backends
from chunkd.gateway.checkpoints import Checkpoints
from chunkd.gateway.config import Config
from chunkd.gateway.datasets.pages import PageStore
from chunkd.gateway.listing import Listings
from chunkd.gateway.metrics import Metrics
from chunkd.gateway.peers import Peers
from chunkd.gateway.prefetch import Prefetcher
from chunkd.gateway.readpath import ReadPath
from chunkd.gateway.tls import PeerTLS

__all__ = [
    "BACKENDS",
    "CACHE",
    "CHECKPOINTS",
    "CONFIG",
    "LISTINGS",
    "METRICS",
    "PEERS",
    "PEER_TLS",
    "PREFETCHER",
    "READ_PATH",
    "STATE",
    "STREAMING",
    "DaemonState",
]


@dataclass
class DaemonState:
    """What /readyz and /v1/stats report about the process itself."""

    started: float = field(default_factory=time.time)
    ready: bool = False
    stopping: bool = False


CONFIG: Final = web.AppKey("config", Config)
METRICS: Final = web.AppKey("metrics", Metrics)
STATE: Final = web.AppKey("state", DaemonState)
CACHE: Final = web.AppKey("cache", ChunkCache)
BACKENDS: Final = web.AppKey("backends", Backends)
READ_PATH: Final = web.AppKey("read_path", ReadPath)
CHECKPOINTS: Final = web.AppKey("checkpoints", Checkpoints)
LISTINGS: Final = web.AppKey("listings", Listings)
PREFETCHER: Final = web.AppKey("prefetcher", Prefetcher)
PEERS: Final[web.AppKey[Peers | None]] = web.AppKey("peers")
#: the dataset registry's pages (what ``/v1/peer/pages/{id}`` serves)
PAGES: Final = web.AppKey("pages", PageStore)
PEER_TLS: Final[web.AppKey[PeerTLS | None]] = web.AppKey("peer_tls")
#: set on a request once its response headers are sent
STREAMING: Final = "chunkd.streaming"
