"""What every save and load shares with its process: one connection to the daemon,
made lazily, and the process's place in a ``torch.distributed`` group."""

from __future__ import annotations

import sys
import threading
from typing import Any, Final

from chunkd.client.core import Client

#: threads that copy a save's arrays into its memfd, or a load's chunks into its arrays
COPY_THREADS: Final = 4

_default: Client | None = None
_default_lock = threading.Lock()


def client_or_default(client: Client | None) -> Client:
    """``client``, else the process's own (made on first use, and again once closed)."""
    global _default  # one lazily made connection per process
    if client is not None:
        return client
    with _default_lock:
        if _default is None or _default.closed:
            _default = Client()
        return _default


def distributed() -> tuple[int, int, Any] | None:
    """(rank, world size, ``torch.distributed``) if a process group is up, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), dist
    return None
