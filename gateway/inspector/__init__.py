"""The data inspector's daemon side: a bounded pool of decoding worker processes, and
the ``/v1/inspect/...`` routes that forward to it (``docs/inspector.md``).

The daemon's own process never decodes a file: it routes requests to the pool and
serves media bytes by range.
"""

from __future__ import annotations

from chunkd.gateway.inspector.pool import InspectorPool
from chunkd.gateway.inspector.routes import INSPECTOR, add_routes

__all__ = ["INSPECTOR", "InspectorPool", "add_routes"]
