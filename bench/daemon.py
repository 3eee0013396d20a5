"""A real ``chunkd serve`` process for the benchmarks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from chunkd.testing import free_port

__all__ = ["BenchDaemon"]


class BenchDaemon:
    """``chunkd serve`` in ``work`` (its cwd), with ``CHUNKD_*`` overrides in ``env``.

    Waits for /readyz; the log goes to ``work/daemon.log``.
    """

    def __init__(
        self, work: Path, env: dict[str, str], config: Path | None = None, port: int | None = None
    ) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.work = work
        self.port = port or free_port()
        environ = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
        environ |= env | {"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{self.port}"}
        environ.setdefault("CHUNKD_SERVER_SOCKET", str(work / "chunkd.sock"))
        args = [str(Path(sys.executable).parent / "chunkd"), "serve"]
        if config is not None:
            args += ["--config", str(config)]
        self.log = (work / "daemon.log").open("ab")
        self.process = subprocess.Popen(
            args, cwd=work, env=environ, stdout=self.log, stderr=self.log
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"chunkd did not start; see {work / 'daemon.log'}") from None
                time.sleep(0.1)

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
        self.process.terminate()
        self.process.wait(timeout=60)
        self.log.close()
