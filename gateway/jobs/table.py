"""The jobs a node serves: their labels in ``/metrics`` (a stable top K), and how long
their trainers wait for data, rank by rank (``loader_report``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["JobTable"]


class JobTable:
    """The jobs this node has seen (a skeleton: filled in by issue 30's work)."""

    def __init__(self, *, top: int = 16, worst_ranks: int = 3, idle: float = 600.0) -> None:
        self.top = top
        self.worst_ranks = worst_ranks
        self.idle = idle

    def label(self, job: str | None, uid: int | None = None) -> str:
        """The label of ``job`` in ``/metrics`` (``none`` for no job)."""
        return "none" if job is None else job

    def report(self, job: str | None, uid: int | None, args: Mapping[str, Any]) -> str:
        """Take one rank's ``loader_report``; the job's label."""
        return self.label(job, uid)

    def first_batch(
        self, job: str | None, uid: int | None, rank: int | None, phases: Mapping[str, float]
    ) -> None:
        """Take one loader's time to its first batch, by phase."""

    def view(self) -> dict[str, Any]:
        """The jobs as ``GET /v1/jobs`` answers them."""
        return {"jobs": []}
