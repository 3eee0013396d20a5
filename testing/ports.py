"""Loopback ports for the servers the tests and benchmarks start."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

__all__ = ["BIN", "free_port", "wait_for_port"]

#: the running interpreter's bin/ (moto_server and the like live there)
BIN = Path(sys.executable).parent


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float = 30.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
        except OSError:
            time.sleep(0.05)
        else:
            return
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s")
