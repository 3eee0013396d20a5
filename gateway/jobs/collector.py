"""The job table's figures in ``/metrics``, read when Prometheus scrapes.

A custom collector, not labelled metric objects: a job's series leave ``/metrics`` the
moment it ends, with nothing to remove by hand, and a scrape costs
O(live jobs x worst_ranks), never a walk over every rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from chunkd.gateway.jobs.stalls import LabelFigures

__all__ = ["JobCollector", "JobFigures"]


class JobFigures(Protocol):
    """What the collector reads: :class:`~chunkd.gateway.jobs.JobTable`."""

    @property
    def starts(self) -> Mapping[str, int]:
        """Job starts by admission, ``"true"``/``"false"``."""

    def figures(self) -> Iterator[LabelFigures]:
        """Each live ``train_job`` label's figures."""

    def live_jobs(self) -> Mapping[str, int]:
        """Live jobs by state."""


class JobCollector(Collector):
    """Reads a job table (:class:`~chunkd.gateway.jobs.JobTable`) when Prometheus scrapes."""

    def __init__(self, table: JobFigures) -> None:
        self.table = table

    def collect(self) -> Iterator[Metric]:
        # docstring inherited
        wait = HistogramMetricFamily(
            "chunkd_loader_wait_seconds",
            "Trainer steps by the time the trainer waited for its batch (asked for the "
            "next batch to got it), from the loaders' reports",
            labels=["train_job"],
        )
        step = HistogramMetricFamily(
            "chunkd_loader_step_seconds",
            "Trainer steps by their time (a batch got to the next got: compute and wait), "
            "from the loaders' reports",
            labels=["train_job"],
        )
        worst = GaugeMetricFamily(
            "chunkd_loader_worst_rank_wait_ratio",
            "Wait / step over the latest report window of the job's ranks that waited "
            "most ([jobs] worst_ranks of them, among ranks live in the last 2 min)",
            labels=["train_job", "rank"],
        )
        ranks = GaugeMetricFamily(
            "chunkd_loader_ranks",
            "Ranks of the job that reported in the last 2 min",
            labels=["train_job"],
        )
        first = GaugeMetricFamily(
            "chunkd_job_first_batch_seconds",
            "The job's slowest rank's time to its first batch, by phase (latest seen)",
            labels=["train_job", "phase"],
        )
        for figures in self.table.figures():
            label = figures.label
            wait.add_metric([label], figures.wait.cumulative(), figures.wait.total)
            step.add_metric([label], figures.step.cumulative(), figures.step.total)
            for w in figures.worst:
                worst.add_metric([label, str(w.rank)], w.stall)
            ranks.add_metric([label], figures.ranks)
            for phase, seconds in (figures.first_batch or {}).items():
                first.add_metric([label, phase], seconds)
        jobs = GaugeMetricFamily(
            "chunkd_jobs",
            "Jobs live on this node, named (a label of their own) or other",
            labels=["state"],
        )
        for state, n in self.table.live_jobs().items():
            jobs.add_metric([state], n)
        starts = CounterMetricFamily(
            "chunkd_job_starts",
            "Jobs started on this node, by admission to a label of their own "
            "(false: other, the top [jobs] top were live)",
            labels=["admitted"],
        )
        for admitted, n in self.table.starts.items():
            starts.add_metric([admitted], n)
        yield from (wait, step, worst, ranks, first, jobs, starts)
