"""The inspector's routes: ``GET /v1/inspect/{op}`` and ``/v1/inspect/media/...``."""

from __future__ import annotations

from typing import Final

from aiohttp import web

from chunkd.gateway.inspector.pool import InspectorPool

__all__ = ["INSPECTOR", "add_routes"]

INSPECTOR: Final = web.AppKey("inspector", InspectorPool)


def add_routes(app: web.Application) -> None:
    """Add the inspector's routes to ``app``; they use ``app[INSPECTOR]``."""
