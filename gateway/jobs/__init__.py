"""Jobs: the jobs a node serves, their labels in ``/metrics``, and how long their
trainers wait for data (:mod:`.table`). docs/jobs.md is the user's side; who the
work at hand is for is :mod:`chunkd.gateway.costs.attribution`."""

from __future__ import annotations

from chunkd.gateway.jobs.table import JobTable

__all__ = ["JobTable"]
