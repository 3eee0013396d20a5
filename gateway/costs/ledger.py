"""What data movement cost, by job and by dataset or checkpoint name."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chunkd.gateway.jobs.table import JobTable

__all__ = ["Ledger"]


class Ledger:
    """The node's cost ledger (a skeleton: filled in by issue 30's work)."""

    def __init__(self, jobs: JobTable) -> None:
        self.jobs = jobs

    def view(self) -> dict[str, Any]:
        """The ledger as ``GET /v1/cost`` answers it."""
        return {"jobs": []}
