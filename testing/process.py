"""A server in a subprocess on a loopback port: started, waited for and stopped in one
place, for the emulators the tests run (moto, fake-gcs-server, Azurite)."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self

from chunkd.testing.ports import wait_for_port

__all__ = ["ServerProcess"]


@dataclass
class ServerProcess:
    """A server subprocess listening on ``host:port``; a kind subclasses it and builds
    its command line in its own ``start``. As a context manager, it stops on exit."""

    port: int
    process: subprocess.Popen[bytes]
    host: str = "127.0.0.1"

    @classmethod
    def launch(
        cls,
        argv: Sequence[str],
        *,
        port: int,
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
    ) -> Self:
        """Run ``argv`` (its output discarded) and wait until ``host:port`` listens;
        a server that does not listen in time is killed before the error goes on."""
        process = subprocess.Popen(
            list(argv),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for_port(port, host=host)
        except BaseException:
            process.kill()
            process.wait()
            raise
        return cls(port, process, host)

    def stop(self) -> None:
        """Stop the server: SIGTERM, and SIGKILL if it has not exited 10 s later (a
        server slow to stop on a loaded machine is not left running, nor its Popen
        unreaped)."""
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"
