"""Seeing the node: the per-second telemetry, the pages (dashboard, inspector, login),
their assets and the browser sessions (``docs/dashboard.md``, ``docs/inspector.md``)."""

from __future__ import annotations

from chunkd.gateway.dashboard.routes import TELEMETRY, add_routes
from chunkd.gateway.dashboard.telemetry import Telemetry

__all__ = ["TELEMETRY", "Telemetry", "add_routes"]
