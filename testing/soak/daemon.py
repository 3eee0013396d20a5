"""The soak's daemon: its config (:class:`SoakConfig`, with the budget's ε), the
``chunkd serve`` process over it, and what its log holds that a healthy run would not."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from chunkd.testing.daemon import DaemonProcess
from chunkd.testing.ports import free_port
from chunkd.testing.soak.client import DEFAULT_MIX
from chunkd.testing.soak.content import GiB, MiB, SoakDataset, StateShape

__all__ = ["CLIENT_ALLOWANCE", "PROCESS_ALLOWANCE", "LogReport", "SoakConfig", "SoakDaemon"]


#: ε's part for the daemon process itself, whatever the load (see
#: :mod:`chunkd.testing.soak`)
PROCESS_ALLOWANCE: Final = 272 * MiB
#: ε's part per client, besides its staged save (see
#: :mod:`chunkd.testing.soak`)
CLIENT_ALLOWANCE: Final = 1 * MiB


# -- the daemon --------------------------------------------------------------------------


@dataclass(frozen=True)
class SoakConfig:
    """The soak's daemon, dataset and clients.

    The RAM budget is smaller than the dataset, so the RAM tier evicts all along
    and the disk tier serves and promotes.
    """

    dataset: SoakDataset = field(default_factory=SoakDataset)
    state: StateShape = field(default_factory=StateShape)
    mix: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    ram_bytes: int = 128 * MiB
    disk_bytes: int = 2 * GiB
    chunk_bytes: int = 1 * MiB
    #: each client's own cache of mapped chunks: it keeps evicted chunks alive, so the
    #: node holds up to ``ram_bytes`` plus this much per client (a trainer's default
    #: is 1 GiB; the soak keeps the node's total small)
    client_cache_bytes: int = 32 * MiB
    #: a collection after every this many saves of a client (0: none)
    gc_every: int = 8
    #: how long the daemon answers a listing from its memory
    list_revalidate: str = "5s"
    process_allowance: int = PROCESS_ALLOWANCE

    def epsilon(self, clients: int) -> int:
        """What the daemon may hold beyond ``ram_bytes`` with ``clients`` clients (see
        the package docstring)."""
        return self.process_allowance + clients * (CLIENT_ALLOWANCE + self.state.staged_bytes)

    def toml(self, work: Path, port: int) -> str:
        """The daemon's config file, everything under ``work``."""
        return f"""
[server]
listen = "127.0.0.1:{port}"
socket = "{work / "chunkd.sock"}"
log_format = "json"
shutdown_timeout = "10s"

[cache]
dir = "{work / "cache"}"
ram_bytes = {self.ram_bytes}
disk_bytes = {self.disk_bytes}
disk_min_free_bytes = 0
chunk_bytes = {self.chunk_bytes}
fsync = "never"

[datasets]
registry = "{self.dataset.backend}/datasets"

[[backends]]
name = "{self.dataset.backend}"
url = "file://{work / "backend"}"
writable = true
list_revalidate = "{self.list_revalidate}"
"""


@dataclass
class LogReport:
    """What the daemon's log holds that a healthy run would not."""

    tracebacks: int = 0
    errors: int = 0
    warnings: int = 0
    first: list[str] = field(default_factory=list)


class SoakDaemon:
    """``chunkd serve`` on a config of :class:`SoakConfig`, its log in ``work/daemon.log``."""

    def __init__(self, work: Path, config: SoakConfig) -> None:
        self.work = work
        self.port = free_port()
        self.config_path = work / "chunkd.toml"
        self.log_path = work / "daemon.log"
        self.daemon = DaemonProcess(
            config.toml(work, self.port),
            cwd=work,
            config_path=self.config_path,
            log=self.log_path,
            url=f"http://127.0.0.1:{self.port}",
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

    @property
    def pid(self) -> int:
        """The daemon's process id."""
        return self.process.pid

    def ready(self) -> bool:
        """Whether ``/readyz`` answers 200 now."""
        return self.daemon.ready()

    def log_report(self) -> LogReport:
        """Tracebacks, errors and warnings in the log, read a line at a time."""
        report = LogReport()
        with self.log_path.open(errors="replace") as log:
            for line in log:
                bad = "Traceback" in line or "exception was never retrieved" in line
                level = _log_level(line)
                report.tracebacks += bad
                report.errors += level in ("error", "critical")
                report.warnings += level == "warning"
                if (bad or level in ("error", "critical")) and len(report.first) < 5:
                    report.first.append(line.strip()[:2000])
        return report

    def stop(self) -> int:
        """SIGTERM, and wait (SIGKILL after 30 s); the exit status."""
        return self.daemon.stop(timeout=30)


def _log_level(line: str) -> str:
    """The level of one JSON log line ("" when it is not one)."""
    if not line.startswith("{"):
        return ""
    try:
        return str(json.loads(line).get("level", "")).lower()
    except ValueError:
        return ""
