"""The cost ledger's per-job summaries, made a few jobs per turn of the event loop
before a view reads them (the dashboard's samples, ``GET /v1/cost``), so that no
view blocks the loop for tens of milliseconds summing every job at once."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from chunkd.gateway.costs.ledger import Ledger

__all__ = ["LEDGER_WARM_JOBS", "warm_ledger"]

#: jobs whose summary is made per turn of the loop (64 x 8 names: about 1.5 ms)
LEDGER_WARM_JOBS: Final = 64


async def warm_ledger(ledger: Ledger, jobs_at_once: int = LEDGER_WARM_JOBS) -> int:
    """Make the summary each job of ``ledger`` keeps until it is charged again, for the
    jobs charged since their last one, ``jobs_at_once`` jobs per turn of the loop (the
    loop runs other work between turns): a view made right after sums only the jobs
    charged meanwhile, instead of every job charged since the view before (1024 jobs
    x 8 names: 23 ms in one piece on the loop, measured). It runs on the loop, as every
    charge does, so each summary is of one moment. How many summaries it made.
    """
    made = 0
    pending = ledger.unsummed()
    for start in range(0, len(pending), jobs_at_once):
        for entry in pending[start : start + jobs_at_once]:
            if entry.summed is None:  # not summed meanwhile (by a view)
                entry.summary()
                made += 1
        await asyncio.sleep(0)
    return made
