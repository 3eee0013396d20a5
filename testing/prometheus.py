"""A real Prometheus for tests: Debian's ``prometheus`` (2.42) on loopback.

:class:`PrometheusServer` runs ``/usr/bin/prometheus`` on ``127.0.0.1`` at a free port,
with its storage under a directory of the test's and a generated config: the given
targets scraped every second (scrape and rule evaluation interval 1 s), and chunkd's
recording rules and alerts (``deploy/prometheus/chunkd.rules.yml``) loaded. The
package's own service (``:9090`` on every interface) is never involved. :meth:`query`
asks the HTTP API (``/api/v1/query``). Skip a test with :func:`prometheus_or_skip`
where Prometheus is absent (``make test`` installs it as root).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from chunkd.testing.ports import free_port
from chunkd.testing.process import ServerProcess

__all__ = [
    "PROMETHEUS",
    "PROMTOOL",
    "RULES",
    "PrometheusServer",
    "prometheus_or_skip",
    "promtool_or_skip",
]

#: where Debian's prometheus package installs the server
PROMETHEUS: Final = "/usr/bin/prometheus"
#: and its rule checker
PROMTOOL: Final = "/usr/bin/promtool"
#: the rules the server loads unless told otherwise: the ones chunkd ships
RULES: Final = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "chunkd.rules.yml"

#: the most bytes of one API answer read (a test's queries answer a few KiB)
_MAX_ANSWER: Final = 16 << 20


def _binary(path: str, name: str) -> str | None:
    return path if os.access(path, os.X_OK) else shutil.which(name)


def prometheus_or_skip() -> str:
    """The prometheus binary; the test is skipped (with the reason) where it is absent."""
    import pytest

    found = _binary(PROMETHEUS, "prometheus")
    if found is None:
        pytest.skip(
            "prometheus is not installed and make test could not install it (as root: "
            "apt-get install prometheus, with its service kept stopped)"
        )
    return found


def promtool_or_skip() -> str:
    """The promtool binary; the test is skipped (with the reason) where it is absent."""
    import pytest

    found = _binary(PROMTOOL, "promtool")
    if found is None:
        pytest.skip(
            "promtool is not installed and make test could not install it (as root: "
            "apt-get install prometheus, with its service kept stopped)"
        )
    return found


class PrometheusServer:
    """Prometheus scraping ``targets`` every second, its files under ``workdir``.

    Args:
        targets: ``host:port`` of each chunkd daemon to scrape (``/metrics``, plain
            HTTP); each is its own ``instance``, all under the scrape job ``chunkd``.
        workdir: where its config, storage and log go.
        rules: rule files to load (chunkd's shipped rules by default).
        interval: seconds between scrapes and between rule evaluations.
    """

    def __init__(
        self,
        targets: Sequence[str],
        workdir: Path,
        *,
        rules: Sequence[Path] = (RULES,),
        interval: float = 1.0,
    ) -> None:
        self.targets = list(targets)
        self.workdir = workdir
        self.rules = list(rules)
        self.interval = interval
        self.port = 0
        self._log = workdir / "prometheus.log"
        self._server: ServerProcess | None = None

    @property
    def url(self) -> str:
        """The server's base URL: ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict[str, Any]:
        """The configuration it runs with (written as JSON, which is YAML too)."""
        every = f"{round(self.interval * 1000)}ms"
        return {
            "global": {
                "scrape_interval": every,
                "scrape_timeout": every,
                "evaluation_interval": every,
            },
            "rule_files": [str(path) for path in self.rules],
            "scrape_configs": [
                {
                    "job_name": "chunkd",
                    "metrics_path": "/metrics",
                    "static_configs": [{"targets": self.targets}],
                }
            ],
        }

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        """Start it and wait until it is ready (its rules loaded, its storage open)."""
        binary = _binary(PROMETHEUS, "prometheus")
        if binary is None:
            raise FileNotFoundError("prometheus is not installed (apt-get install prometheus)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        conf = self.workdir / "prometheus.yml"
        conf.write_text(json.dumps(self.config(), indent=2))
        argv = [
            binary,
            f"--config.file={conf}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            "--storage.tsdb.retention.time=1d",
            "--log.level=warn",
        ]
        # ServerProcess discards a server's output; Prometheus logs to stderr only, so a
        # shell sends it to a file first (exec: the signals still reach Prometheus).
        shell = ["/bin/sh", "-c", 'exec "$@" 2>>"$PROMETHEUS_LOG"', "prometheus", *argv]
        env = dict(os.environ, PROMETHEUS_LOG=str(self._log))
        try:
            self._server = ServerProcess.launch(shell, port=self.port, env=env)
        except TimeoutError:
            raise RuntimeError(f"prometheus did not start: {self.log()}") from None
        deadline = time.monotonic() + timeout
        while not self._ready():
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus not ready after {timeout}s: {self.log()}")
            time.sleep(0.1)
        return self

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=5) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/PATH?params``'s ``data``; an answer whose status is not
        ``success`` raises ``RuntimeError`` with Prometheus's error."""
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=30) as answer:
                body = answer.read(_MAX_ANSWER)
        except urllib.error.HTTPError as exc:
            body = exc.read(_MAX_ANSWER)
        doc = json.loads(body)
        if doc.get("status") != "success":
            raise RuntimeError(f"prometheus: {path} {params}: {doc.get('error', doc)}")
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result now: ``[{"metric": {...}, "value": [t, "v"]}]``
        for a vector (a scalar answers one entry without labels)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def values(self, expr: str, by: str | None = None) -> dict[str, float]:
        """An instant query's values keyed by the label ``by`` (``""`` without it; a
        NaN is left out)."""
        found: dict[str, float] = {}
        for sample in self.query(expr):
            value = float(sample["value"][1])
            if not math.isnan(value):
                found[sample["metric"].get(by, "") if by else ""] = value
        return found

    def wait_for(
        self,
        expr: str,
        accept: Callable[[list[dict[str, Any]]], bool] = bool,
        timeout: float = 30.0,
    ) -> list[dict[str, Any]]:
        """Query ``expr`` until ``accept`` takes its result (a non-empty one, by
        default); the last result raises ``TimeoutError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if accept(result):
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus: {expr} answered {result} after {timeout}s")
            time.sleep(self.interval / 4)

    def scrapes(self) -> dict[str, float]:
        """The time (seconds since the epoch) of each target's latest scrape
        (``timestamp(up)``), keyed by ``instance``."""
        return self.values("timestamp(up)", by="instance")

    def log(self) -> str:
        """What Prometheus wrote to its log."""
        return self._log.read_text(errors="replace") if self._log.exists() else ""

    def stop(self) -> None:
        """Stop it (and wait for it)."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
