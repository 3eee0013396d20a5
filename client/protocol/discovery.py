"""Where a client looks for the daemon's socket."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_socket_paths"]


def default_socket_paths() -> list[Path]:
    """Where a client looks for the daemon, in order."""
    paths = []
    env = os.environ.get("CHUNKD_SOCKET")
    if env:
        paths.append(Path(env))
    paths += [Path("/run/chunkd/chunkd.sock"), Path("chunkd.sock")]
    return paths
