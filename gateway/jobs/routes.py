"""``GET /v1/jobs[?job=NAME]``: the jobs this node serves (or the one named), as
:meth:`JobTable.view` gives them; ``?job=none``: the ``none`` entry only (the work no
job claimed), in ``jobs`` as ``GET /v1/cost?job=none`` answers its row."""

from __future__ import annotations

from typing import Final

from aiohttp import web

from chunkd.gateway.jobs.table import NONE, JobTable

__all__ = ["JOBS", "add_routes"]

#: the node's job table
JOBS: Final = web.AppKey("jobs", JobTable)


def add_routes(app: web.Application) -> None:
    """Add the jobs route to the daemon's app."""
    app.router.add_get("/v1/jobs", _jobs)


async def _jobs(request: web.Request) -> web.Response:
    # ?job=NAME: that job only (a bad name is 400, as InvalidRequestError maps)
    job = request.query.get("job") or None
    table = request.app[JOBS]
    if job != NONE:
        return web.json_response(table.view(job=job))
    view = table.view()
    none = view["none"]
    return web.json_response(view | {"jobs": [] if none is None else [none], "ended": []})
