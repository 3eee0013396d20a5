"""``GET /v1/cost``: this node's cost ledger, as :meth:`Ledger.view` gives it, and
``GET /v1/cost/storage``: what the checkpoints and frozen snapshots keep costs."""

from __future__ import annotations

import time
from typing import Final

from aiohttp import web

from chunkd.gateway.appkeys import BACKENDS, CACHE, CHECKPOINTS, CONFIG, READ_PATH
from chunkd.gateway.costs.ledger import Ledger
from chunkd.gateway.costs.since import parse_since
from chunkd.gateway.costs.storage import storage_view
from chunkd.gateway.datasets.registry import Registry

__all__ = ["LEDGER", "add_routes"]

#: the node's cost ledger
LEDGER: Final = web.AppKey("ledger", Ledger)


def add_routes(app: web.Application) -> None:
    """Add the cost routes to the daemon's app."""
    app.router.add_get("/v1/cost", _cost)
    app.router.add_get("/v1/cost/storage", _storage)


async def _cost(request: web.Request) -> web.Response:
    job = request.query.get("job") or None
    since_text = request.query.get("since")
    since = None if not since_text else parse_since(since_text, time.time())
    return web.json_response(request.app[LEDGER].view(job=job, since=since))


async def _storage(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    writable = [b.name for b in request.app[CONFIG].backends if b.writable]
    app = request.app
    # the registry's own reader (its pages come through the node's cache and read path)
    registry = Registry(
        app[BACKENDS], app[CONFIG].datasets.registry, cache=app[CACHE], read_path=app[READ_PATH]
    )
    storage = await storage_view(
        app[CHECKPOINTS], writable, ledger.prices, registry, ledger.gc_reports()
    )
    return web.json_response(ledger.view() | {"storage": storage})
