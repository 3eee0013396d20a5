"""The ops of the local socket that report on a job's trainers: ``loader_report``.

The job is the report's ``train_job``, else the connection's (its ``hello``'s), a
claim for accounting; the uid is the kernel's (the request's
:class:`~chunkd.gateway.costs.Attribution`). A report is a hint: a bounded handful of
numbers per step window, taken by :class:`~chunkd.gateway.jobs.JobTable`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from chunkd.client.protocol import check_job_name
from chunkd.errors import InvalidRequestError
from chunkd.gateway.costs.attribution import ATTRIBUTION
from chunkd.gateway.localsock.family import Family, Parts

if TYPE_CHECKING:
    from chunkd.gateway.localsock.answer import Answer

__all__ = ["FAMILY"]

#: the handlers of this module's ops
FAMILY: Final = Family("jobs")


@FAMILY.op("loader_report")
async def _loader_report(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    steps = args["steps"]
    for buckets in ("wait_buckets", "step_buckets"):
        if sum(args[buckets]) != steps:
            raise InvalidRequestError(
                f"loader_report: {buckets} add up to {sum(args[buckets])}, not the "
                f"{steps} steps reported"
            )
    if args["world_size"] is not None and args["rank"] >= args["world_size"]:
        raise InvalidRequestError(
            f"loader_report: rank {args['rank']} of a job of {args['world_size']} ranks "
            "(ranks count from 0)"
        )
    who = ATTRIBUTION.get()
    job = who.job if args["train_job"] is None else check_job_name(args["train_job"])
    if parts.jobs is None:
        return {"ok": True, "train_job": "none"}
    return {"ok": True, "train_job": parts.jobs.report(job, who.uid, args)}
