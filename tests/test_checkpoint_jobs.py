"""What a daemon keeps of the saves it finished: their answers, bounded in number and
in size."""

from __future__ import annotations

import time

from chunkd.cache import ChunkId
from chunkd.gateway.checkpoints import jobs as jobs_module
from chunkd.gateway.checkpoints.jobs import Jobs
from chunkd.gateway.checkpoints.model import Durability, SaveJob, SaveRequest


def finished_job(n: int, *, at: float) -> SaveJob:
    request = SaveRequest(
        backend="ckpt",
        path=f"run/step-{n}",
        save_id=f"save{n}",
        rank=0,
        world_size=1,
        durability=Durability.LOCAL,
        overwrite=False,
        commit="auto",
        step=n,
        segments=[(0, 4096)] * 100,
        tree={"w": [{"t": "ndarray", "shape": [1024]}] * 1000},
    )
    job = SaveJob(f"job{n}", request)
    cid = ChunkId.of(n.to_bytes(8, "little"))
    job.chunks = [[(cid, 4096)] * 100]
    job.where = {cid: (0, 4096)}
    job.logical = 409600
    job.reach(Durability.REMOTE, "done")
    job.finished = at
    return job


def test_finished_jobs_keep_their_answer_only_and_the_newest_few(monkeypatch) -> None:
    monkeypatch.setattr(jobs_module, "_FINISHED_MOST", 50)
    jobs = Jobs()
    now = time.time()
    for n in range(120):
        jobs.add(finished_job(n, at=now - 120 + n))
    jobs.add(finished_job(999, at=now - 7200))  # past the hour
    answers = {job.id: job.describe() for job in jobs}
    jobs.prune()
    kept = list(jobs)
    assert sorted(job.id for job in kept) == sorted(f"job{n}" for n in range(70, 120))
    for job in kept:
        assert job.describe() == answers[job.id] | {"age_s": job.describe()["age_s"]}
        assert (job.request.tree, job.request.segments, job.chunks, job.where) == (None, [], [], {})
