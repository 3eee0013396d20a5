"""The replica routes: other nodes push copies of their saves' chunks into this
node's RAM (``PUT /v1/peer/replicas/...``). Peer routes: the token rule of
:mod:`chunkd.gateway.api` applies to every one of them.

The routes are added by :func:`add_replica_routes`, called from
:func:`chunkd.gateway.api.build_app`.
"""

from __future__ import annotations

from aiohttp import web

__all__ = ["add_replica_routes"]


def add_replica_routes(app: web.Application) -> None:
    """Add the replica routes to ``app`` (none yet: the replica store comes next)."""
    del app
