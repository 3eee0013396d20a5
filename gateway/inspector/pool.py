"""A bounded pool of inspector worker processes (``docs/inspector.md``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["InspectorPool"]


class InspectorPool:
    """``workers`` processes of ``python -m chunkd.client.inspect.worker``, each reading
    through the daemon's local socket ``socket``, limited to ``memory`` bytes of address
    space and ``timeout`` seconds a request."""

    def __init__(self, socket: Path, *, workers: int, timeout: float, memory: int) -> None:
        self.socket = socket
        self.workers = workers
        self.timeout = timeout
        self.memory = memory

    async def call(self, op: str, args: dict[str, str]) -> dict[str, Any]:
        """Run ``op`` with ``args`` in a worker; its result."""
        raise NotImplementedError(op)

    async def close(self) -> None:
        """Stop every worker."""
