"""``GET /v1/cost``: this node's cost ledger, as :meth:`Ledger.view` gives it."""

from __future__ import annotations

from typing import Final

from aiohttp import web

from chunkd.gateway.costs.ledger import Ledger

__all__ = ["LEDGER", "add_routes"]

#: the node's cost ledger
LEDGER: Final = web.AppKey("ledger", Ledger)


def add_routes(app: web.Application) -> None:
    """Add the cost route to the daemon's app."""
    app.router.add_get("/v1/cost", _cost)


async def _cost(request: web.Request) -> web.Response:
    return web.json_response(request.app[LEDGER].view())
