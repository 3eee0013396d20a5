"""``GET /v1/cost``: this node's cost ledger, as :meth:`Ledger.view` gives it, and
``GET /v1/cost/storage``: what the checkpoints and frozen snapshots keep costs (the
storage object itself, for the node: it takes no ``job`` or ``since``).

``GET /v1/cost/storage`` computes one answer at a time: a caller that comes while one
is being computed waits for it and gets the same answer (its backend requests are
charged to the job of the caller that started it), so however many callers come at
once, the node reads at most one computation's bounded pages and chunk ids
(:mod:`.storage`) at a time."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Final

from aiohttp import web

from chunkd.client.protocol import RESERVED_JOB_NAMES, check_job_name
from chunkd.gateway.appkeys import BACKENDS, CACHE, CHECKPOINTS, CONFIG, READ_PATH
from chunkd.gateway.costs.ledger import Ledger
from chunkd.gateway.costs.since import parse_since
from chunkd.gateway.costs.storage import storage_view
from chunkd.gateway.costs.summaries import warm_ledger
from chunkd.gateway.datasets.registry import Registry

__all__ = ["LEDGER", "add_routes"]

#: the node's cost ledger
LEDGER: Final = web.AppKey("ledger", Ledger)


class _StorageFlight:
    """The ``GET /v1/cost/storage`` computation in progress, if any: one at a time,
    shared by every caller that comes while it runs."""

    def __init__(self) -> None:
        self.task: asyncio.Task[dict[str, Any]] | None = None
        #: computations started (tests read it: callers at once share one)
        self.started = 0


_STORAGE: Final = web.AppKey("cost_storage_flight", _StorageFlight)


def add_routes(app: web.Application) -> None:
    """Add the cost routes to the daemon's app."""
    app.router.add_get("/v1/cost", _cost)
    app.router.add_get("/v1/cost/storage", _storage)
    app[_STORAGE] = _StorageFlight()


async def _cost(request: web.Request) -> web.Response:
    job = request.query.get("job") or None
    if job is not None and job not in RESERVED_JOB_NAMES:
        # a bad name is a 400 (InvalidRequestError); none and other are the ledger's rows
        check_job_name(job)
    since_text = request.query.get("since")
    since = None if not since_text else parse_since(since_text, time.time())
    ledger = request.app[LEDGER]
    await warm_ledger(ledger)  # the jobs' totals, a few a turn: the view sums fewer
    return web.json_response(ledger.view(job=job, since=since))


async def _storage(request: web.Request) -> web.Response:
    app = request.app
    flight = app[_STORAGE]
    if flight.task is None or flight.task.done():
        flight.task = asyncio.create_task(_storage_answer(app))
        # its error is each waiting caller's; retrieved here when every caller went away
        flight.task.add_done_callback(lambda t: t.cancelled() or t.exception())
        flight.started += 1
    # shielded: a caller that goes away does not cancel the others' answer
    return web.json_response(await asyncio.shield(flight.task))


async def _storage_answer(app: web.Application) -> dict[str, Any]:
    ledger = app[LEDGER]
    writable = [b.name for b in app[CONFIG].backends if b.writable]
    # the registry's own reader (its pages come through the node's cache and read path)
    registry = Registry(
        app[BACKENDS], app[CONFIG].datasets.registry, cache=app[CACHE], read_path=app[READ_PATH]
    )
    return await storage_view(
        app[CHECKPOINTS], writable, ledger.prices, registry, ledger.gc_reports()
    )
