"""The inspector's pool of decoding worker processes (``docs/inspector.md``): a
:class:`~chunkd.gateway.workerpool.WorkerPool` in the role :data:`INSPECTOR_ROLE`.

The pool itself (spawning, the line protocol, timeouts, the queue, stderr) is
:mod:`chunkd.gateway.workerpool`, which the dataset decoder's pool shares; this module
says what the inspector's workers are and which worker a request goes to. Its names
are re-exported here, where they were.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from chunkd.gateway.workerpool import (
    MAX_ANSWER_BYTES,
    MAX_WAITING,
    PoolRole,
    WorkerPool,
    sockets_close,
)

__all__ = [
    "INSPECTOR_ROLE",
    "MAX_ANSWER_BYTES",
    "MAX_WAITING",
    "InspectorPool",
    "PoolRole",
    "WorkerPool",
    "sockets_close",
]


def _subject(op: str, args: dict[str, Any]) -> str | None:
    """What a request reads: an object's name, a sample's object or snapshot, a ref."""
    if "name" in args:
        return str(args["name"])
    if "id" in args:
        ident = str(args["id"])
        return ident.rpartition("#")[0] or ident
    ref = args.get("ref")
    return None if ref is None else str(ref)


#: the inspector's workers (``docs/inspector.md``)
INSPECTOR_ROLE: Final = PoolRole(
    name="inspector",
    verb="inspect",
    module="chunkd.client.inspect.worker",
    workers_key="server.inspect_workers",
    timeout_key="server.inspect_timeout",
    memory_key="server.inspect_memory",
    timeout_advice="Ask for less (a smaller count, fewer columns) or raise server.inspect_timeout",
    crash_advice="the file may be hostile or need more than server.inspect_memory to decode",
    affinity=_subject,
)


class InspectorPool(WorkerPool):
    """The inspector's :class:`WorkerPool`: ``workers`` processes of
    ``python -m chunkd.client.inspect.worker``.

    Args:
        socket: The daemon's local socket, which the workers read through.
        workers: How many processes decode at once.
        timeout: Seconds one request may take before its worker is killed.
        memory: Bytes of address space each worker may map (``--memory``).
    """

    def __init__(self, socket: Path, *, workers: int, timeout: float, memory: int) -> None:
        super().__init__(socket, INSPECTOR_ROLE, workers=workers, timeout=timeout, memory=memory)
