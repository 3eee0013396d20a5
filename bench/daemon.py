"""A real ``chunkd serve`` process for the benchmarks, on :mod:`chunkd.testing.daemon`."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from chunkd.testing import free_port
from chunkd.testing.daemon import DaemonProcess

__all__ = ["BenchDaemon"]


class BenchDaemon:
    """``chunkd serve`` in ``work`` (its cwd), with ``CHUNKD_*`` overrides in ``env``.

    Waits for /readyz; the log goes to ``work/daemon.log``.
    """

    def __init__(
        self, work: Path, env: dict[str, str], config: Path | None = None, port: int | None = None
    ) -> None:
        self.work = work
        self.port = port or free_port()
        self.daemon = DaemonProcess(
            config,
            cwd=work,
            env=env | {"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{self.port}"},
            socket=work / "chunkd.sock",
        )
        self.process = self.daemon.process
        self.daemon.wait_ready(60.0)

    @property
    def url(self) -> str:
        """The daemon's HTTP address."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def socket(self) -> str:
        """The daemon's local socket."""
        return str(self.work / "chunkd.sock")

    def http(self, name: str, headers: dict[str, str] | None = None) -> bytes:
        """GET /v1/objects/NAME whole."""
        request = urllib.request.Request(f"{self.url}/v1/objects/{name}", headers=headers or {})
        with urllib.request.urlopen(request, timeout=600) as response:
            data: bytes = response.read()
            return data

    def stream(self, name: str) -> int:
        """GET /v1/objects/NAME, reading and dropping the body; returns its size."""
        got = 0
        with urllib.request.urlopen(f"{self.url}/v1/objects/{name}", timeout=600) as r:
            while block := r.read(4 << 20):
                got += len(block)
        return got

    def stop(self) -> None:
        """SIGTERM, and wait."""
        self.daemon.stop(timeout=60)
