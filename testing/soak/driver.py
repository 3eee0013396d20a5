"""The soak's driver: the dataset written, a daemon over it, a sampler, and phases of
client processes (:meth:`Soak.load`)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

import numpy as np

from chunkd.client import Client
from chunkd.testing.soak.client import ClientPlan, ClientReport
from chunkd.testing.soak.content import content
from chunkd.testing.soak.daemon import SoakConfig, SoakDaemon
from chunkd.testing.soak.results import LoadResult
from chunkd.testing.soak.sampler import DaemonSampler

__all__ = ["Soak"]


class Soak:
    """The driver: a dataset written under ``work``, a daemon over it, a sampler.

    Use as a context manager; :meth:`load` runs a phase of clients.
    """

    def __init__(self, work: Path, config: SoakConfig | None = None) -> None:
        self.work = work
        self.config = config or SoakConfig()
        work.mkdir(parents=True, exist_ok=True)
        self.config.dataset.write(work / "backend")
        self.daemon = SoakDaemon(work, self.config)
        self.sampler = DaemonSampler(
            self.daemon.pid, self.daemon.url, backend_dirs=(f"{work / 'backend'}/",)
        )
        self.sampler.start()

    def __enter__(self) -> Soak:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop the sampler and the daemon."""
        self.sampler.stop()
        self.daemon.stop()

    def warm(self) -> float:
        """Read every large object once (the RAM tier fills and starts evicting);
        the seconds it took."""
        started = time.monotonic()
        data = self.config.dataset
        with Client(self.daemon.socket, cache_bytes=0, timeout=120.0) as client:
            for i in range(data.large_objects):
                client.read(f"{data.backend}/{data.large_key(i)}")
        return time.monotonic() - started

    def load(
        self,
        phase: str,
        clients: int,
        duration: float,
        *,
        warmup: float | None = None,
        mix: Mapping[str, float] | None = None,
    ) -> LoadResult:
        """``clients`` client processes for ``duration`` seconds; the daemon sampled
        all along. ``warmup``: seconds left out of the drift figures (a fifth of the
        duration unless told)."""
        folder = self.work / f"clients-{phase}"
        folder.mkdir(parents=True, exist_ok=True)
        plans = [
            ClientPlan(
                index=i,
                phase=phase,
                socket=self.daemon.socket,
                dataset=self.config.dataset,
                state=self.config.state,
                mix=dict(mix or self.config.mix),
                duration=duration,
                chunk_bytes=self.config.chunk_bytes,
                cache_bytes=self.config.client_cache_bytes,
                gc_every=self.config.gc_every,
                out=str(folder / f"report-{i}.json"),
            )
            for i in range(clients)
        ]
        processes = []
        environ = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
        with (folder / "stderr.log").open("ab") as stderr:
            for plan in plans:
                path = folder / f"plan-{plan.index}.json"
                path.write_text(json.dumps(plan.to_json()))
                processes.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "chunkd.testing.soak", str(path)],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=stderr,
                        env=environ,
                        text=True,
                    )
                )
        failures: list[str] = []
        try:
            for plan, process in zip(plans, processes, strict=True):
                assert process.stdout is not None
                if process.stdout.readline().strip() != "ready":
                    failures.append(f"client {plan.index} did not start (see {folder})")
            series = self.sampler.begin([p.pid for p in processes])
            started = time.monotonic()
            for process in processes:
                assert process.stdin is not None
                with contextlib.suppress(BrokenPipeError):
                    process.stdin.write("go\n")
                    process.stdin.flush()
            # An op in flight at the deadline ends first (a collection may take a while).
            deadline = started + duration + 180.0
            for plan, process in zip(plans, processes, strict=True):
                try:
                    code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                    failures.append(f"client {plan.index} was still running at the deadline")
                    continue
                if code != 0:
                    failures.append(f"client {plan.index} exited with {code} (see {folder})")
            seconds = time.monotonic() - started
            self.sampler.begin([])  # the phase's series is complete
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
                for pipe in (process.stdin, process.stdout):
                    if pipe is not None:
                        with contextlib.suppress(BrokenPipeError):
                            pipe.close()
        if self.sampler.failure:
            failures.append(self.sampler.failure)
        merged = ClientReport()
        for plan in plans:
            try:
                merged.merge(ClientReport.from_json(json.loads(Path(plan.out).read_text())))
            except (OSError, ValueError, KeyError) as exc:
                failures.append(f"client {plan.index} left no report: {exc}")
        return LoadResult(
            phase=phase,
            clients=clients,
            seconds=seconds,
            warmup=duration / 5 if warmup is None else warmup,
            ram_bytes=self.config.ram_bytes,
            epsilon=self.config.epsilon(clients),
            report=merged,
            series=series,
            client_failures=failures,
        )

    def check_serving(self) -> None:
        """A fresh client reads and checks one object of each kind, and ``/readyz``
        answers: the daemon still serves.

        Raises:
            AssertionError: it does not.
        """
        data = self.config.dataset
        assert self.daemon.ready(), "the daemon's /readyz does not answer 200"
        with Client(self.daemon.socket, cache_bytes=0, timeout=60.0) as client:
            for name, key_id, size in (
                (data.small_key(0), data.small_id(0), data.small_size(0)),
                (data.large_key(0), data.large_id(0), data.large_size(0)),
            ):
                got = np.frombuffer(client.read(f"{data.backend}/{name}"), dtype=np.uint8)
                assert np.array_equal(got, content(key_id, 0, size)), f"{name} reads wrong"
