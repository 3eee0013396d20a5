"""One phase's results: per-op counts and latencies, the daemon's peak and drift, and
how a phase renders (Markdown, JSON, CSV)."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from chunkd.testing.soak.client import ERRORS_KEPT, ClientReport, LatencyHistogram
from chunkd.testing.soak.content import GiB, MiB
from chunkd.testing.soak.sampler import Sample, SampleSeries

__all__ = ["LoadResult", "OpStats"]


@dataclass(frozen=True)
class OpStats:
    """One op over a phase, all clients together (seconds)."""

    count: int
    errors: int
    p50: float
    p99: float
    max: float
    mean: float


@dataclass
class LoadResult:
    """One phase of the soak: N clients for a while, and the daemon meanwhile."""

    phase: str
    clients: int
    #: seconds from the start signal until the last client reported
    seconds: float
    #: samples in the first ``warmup`` seconds are left out of the drift figures
    warmup: float
    ram_bytes: int
    epsilon: int
    report: ClientReport
    series: SampleSeries
    #: client processes that did not end well (exit status, or no report)
    client_failures: list[str] = field(default_factory=list)

    @property
    def ops(self) -> dict[str, OpStats]:
        """Each op's count, errors and latencies."""
        out = {}
        for op in sorted(set(self.report.ops) | set(self.report.errors)):
            h = self.report.ops.get(op, LatencyHistogram())
            mean = h.total / h.count if h.count else 0.0
            errors = self.report.errors.get(op, 0)
            out[op] = OpStats(h.count, errors, h.quantile(0.5), h.quantile(0.99), h.max, mean)
        return out

    @property
    def errors(self) -> int:
        """Failed ops and failed client processes."""
        return self.report.error_count + len(self.client_failures)

    @property
    def peak(self) -> Sample:
        """The largest value of each gauge over the phase."""
        return self.series.peak

    @property
    def peak_footprint(self) -> int:
        """The largest footprint sampled."""
        return self.series.peak.footprint

    @property
    def limit(self) -> int:
        """``ram_bytes + epsilon``: what the footprint must stay under."""
        return self.ram_bytes + self.epsilon

    def _settled(self) -> tuple[list[Sample], list[Sample]]:
        """The first and last fifths of the samples after the warm-up."""
        after = [s for s in self.series.samples if s.t >= self.warmup]
        fifth = max(1, len(after) // 5)
        return after[:fifth], after[-fifth:]

    def cpu_rate(self, counter: str) -> float:
        """CPU seconds per second over the phase of ``cpu_s`` or ``loop_cpu_s``."""
        samples = self.series.samples
        if len(samples) < 2 or samples[-1].t <= samples[0].t:
            return 0.0
        spent = getattr(samples[-1], counter) - getattr(samples[0], counter)
        return float(spent / (samples[-1].t - samples[0].t))

    def settled(self, gauge: str) -> tuple[float, float]:
        """The medians of ``gauge`` (a :class:`Sample` field) over the first and the
        last fifth of the samples after the warm-up."""
        early, late = self._settled()
        if not early:
            return 0.0, 0.0
        return (
            float(np.median([getattr(s, gauge) for s in early])),
            float(np.median([getattr(s, gauge) for s in late])),
        )

    def drift(self, gauge: str) -> float:
        """How much ``gauge`` grew from the first fifth of the samples after the
        warm-up to the last fifth (:meth:`settled`)."""
        early, late = self.settled(gauge)
        return late - early

    def summary(self) -> dict[str, Any]:
        """The figures, JSON-ready."""
        peak = self.peak
        return {
            "phase": self.phase,
            "clients": self.clients,
            "seconds": round(self.seconds, 1),
            "samples": self.series.count,
            "errors": self.errors,
            "first_errors": self.report.first_errors + self.client_failures[:ERRORS_KEPT],
            "verified_reads": self.report.verified_reads,
            "verified_bytes": self.report.verified_bytes,
            "verified_loads": self.report.verified_loads,
            "verified_pages": self.report.verified_pages,
            "ram_bytes": self.ram_bytes,
            "epsilon": self.epsilon,
            "peak_footprint": self.peak_footprint,
            "peak_pss": peak.pss,
            "peak_cache_memfd_bytes": peak.cache_memfd_bytes,
            "peak_staged_memfd_bytes": peak.staged_memfd_bytes,
            "peak_node_shmem": peak.node_shmem,
            "peak_clients_pss": peak.clients_pss,
            "peak_fds": peak.fds,
            "peak_threads": peak.threads,
            "cpu_per_second": self.cpu_rate("cpu_s"),
            "loop_cpu_per_second": self.cpu_rate("loop_cpu_s"),
            "fd_drift": self.drift("fds"),
            "other_fd_drift": self.drift("other_fds"),
            "socket_fd_drift": self.drift("socket_fds"),
            "untiered_fd_drift": self.drift("untiered_fds"),
            "peak_untiered_fds": peak.untiered_fds,
            "process_drift": self.drift("process_bytes"),
            "peak_process_bytes": peak.process_bytes,
            "ops": {op: asdict(s) for op, s in self.ops.items()},
        }

    def markdown(self) -> str:
        """The phase as Markdown: figures, then a table of ops."""
        s = self.summary()
        lines = [
            f"## Soak phase `{self.phase}`: {self.clients} clients, {s['seconds']} s",
            "",
            f"- errors: **{s['errors']}**; verified: {s['verified_reads']} reads "
            f"({s['verified_bytes'] / GiB:.2f} GiB), {s['verified_loads']} checkpoint loads, "
            f"{s['verified_pages']} listing pages",
            f"- daemon footprint (PSS - Pss_Shmem + memfds held) peak "
            f"**{s['peak_footprint'] / MiB:.0f} MiB** against ram_bytes "
            f"{self.ram_bytes / MiB:.0f} MiB + epsilon {self.epsilon / MiB:.0f} MiB "
            f"= {self.limit / MiB:.0f} MiB",
            f"- peaks: PSS {s['peak_pss'] / MiB:.0f} MiB, cache memfds "
            f"{s['peak_cache_memfd_bytes'] / MiB:.0f} MiB, staged checkpoints "
            f"{s['peak_staged_memfd_bytes'] / MiB:.0f} MiB, node Shmem "
            f"{s['peak_node_shmem'] / MiB:.0f} MiB, clients' PSS "
            f"{s['peak_clients_pss'] / MiB:.0f} MiB",
            f"- fds peak {s['peak_fds']}, drift after warm-up {s['fd_drift']:+.0f} "
            f"(neither memfds nor sockets: {s['other_fd_drift']:+.0f}; beyond the RAM "
            f"tier's chunks: {s['untiered_fd_drift']:+.0f}, peak {s['peak_untiered_fds']}); "
            f"threads peak {s['peak_threads']}; own pages (PSS - Pss_Shmem) peak "
            f"{s['peak_process_bytes'] / MiB:.0f} MiB, drift {s['process_drift'] / MiB:+.1f} MiB",
            f"- daemon CPU {s['cpu_per_second']:.2f} s/s, of which its event loop "
            f"{s['loop_cpu_per_second']:.2f} s/s",
            "",
            "| op | count | errors | p50 ms | p99 ms | max ms |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for op, st in self.ops.items():
            lines.append(
                f"| {op} | {st.count} | {st.errors} | {st.p50 * 1e3:.2f} | "
                f"{st.p99 * 1e3:.2f} | {st.max * 1e3:.1f} |"
            )
        if s["first_errors"]:
            lines += ["", "First errors:", ""] + [f"- `{m}`" for m in s["first_errors"]]
        return "\n".join(lines) + "\n"

    def csv(self) -> str:
        """The time series, one row a sample."""
        out = io.StringIO()
        rows = [s.row() for s in self.series.samples]
        writer = csv.DictWriter(out, fieldnames=list(Sample().row()))
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()

    def write(self, out: Path) -> None:
        """``soak-PHASE.md``, ``.json`` (summary and series) and ``.csv`` under ``out``."""
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"soak-{self.phase}"
        stem.with_suffix(".md").write_text(self.markdown())
        doc = self.summary() | {"series": [s.row() for s in self.series.samples]}
        stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
        stem.with_suffix(".csv").write_text(self.csv())
