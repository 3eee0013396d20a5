"""Which job a trainer's work is accounted to (``chunkd.client.job_name``), and the
client's hello that claims it, against a real daemon (reconnections included)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chunkd.client import AsyncClient, Client, StallMeter, job_name, jobs
from chunkd.client.jobs import JOB_ENV, MAX_LABELS_BYTES, POD_LABELS_ENV

from .conftest import Daemon

_SOURCES = (*JOB_ENV, POD_LABELS_ENV)


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No job source of the machine's: none of the variables, and a labels file that
    is not there."""
    for variable in _SOURCES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(jobs, "_WARNED", set())  # each test sees its own warnings
    monkeypatch.setenv(POD_LABELS_ENV, str(tmp_path / "no-labels"))
    return monkeypatch


def _labels(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "labels"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


@pytest.mark.timeout(10)
def test_each_source_names_the_job_first_match_wins(
    env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert job_name() is None
    labels = _labels(
        tmp_path,
        'app="trainer"\ntraining.kubeflow.org/job-name="kf-1"\njob-name="k8s-job"\n'
        'batch.kubernetes.io/job-name="k8s-batch"\n',
    )
    env.setenv(POD_LABELS_ENV, str(labels))
    assert job_name() == "k8s-batch"  # batch.kubernetes.io/job-name before job-name
    labels.write_text('job-name="k8s-job"\ntraining.kubeflow.org/job-name="kf-1"\n')
    assert job_name() == "k8s-job"
    labels.write_text('training.kubeflow.org/job-name="kf-1"\n')
    assert job_name() == "kf-1"
    env.setenv("TORCHELASTIC_RUN_ID", "elastic-7")
    assert job_name() == "elastic-7"
    env.setenv("SLURM_JOB_ID", "123456")
    assert job_name() == "123456"
    env.setenv("CHUNKD_JOB", "run-7")
    assert job_name() == "run-7"
    assert job_name("given/1") == "given/1"


@pytest.mark.timeout(10)
def test_torchrun_default_run_id_is_no_job(env: pytest.MonkeyPatch) -> None:
    env.setenv("TORCHELASTIC_RUN_ID", "none")
    assert job_name() is None


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "bad",
    ["", "other", "none", "-starts-with-dash", "has space", "x" * 129, "é", "a\nb", 'q"uote'],
)
def test_an_explicit_bad_name_is_a_value_error(env: pytest.MonkeyPatch, bad: str) -> None:
    with pytest.raises(ValueError, match="train_job"):
        job_name(bad)
    with pytest.raises(ValueError, match="train_job"):
        StallMeter(train_job=bad)


@pytest.mark.timeout(10)
def test_a_bad_name_from_the_environment_is_skipped_with_a_warning(
    env: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    env.setenv("CHUNKD_JOB", "bad name")
    env.setenv("SLURM_JOB_ID", "other")
    env.setenv("TORCHELASTIC_RUN_ID", "y" * 200)
    labels = _labels(tmp_path, 'batch.kubernetes.io/job-name="../x"\njob-name="pod-job"\n')
    env.setenv(POD_LABELS_ENV, str(labels))
    with caplog.at_level(logging.WARNING, logger="chunkd.client"):
        assert job_name() == "pod-job"
        assert job_name() == "pod-job"
    warned = [r.getMessage() for r in caplog.records]
    for where in ("$CHUNKD_JOB", "$SLURM_JOB_ID", "$TORCHELASTIC_RUN_ID", "job-name"):
        assert sum(where in m for m in warned) >= 1, (where, warned)
    assert len(warned) == 4, warned  # once each, not once per call
    env.delenv(POD_LABELS_ENV)
    env.setenv(POD_LABELS_ENV, str(tmp_path / "gone"))
    assert job_name() is None  # every source bad or absent: no job


@pytest.mark.timeout(10)
def test_the_labels_file_is_read_bounded(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    filler = b"".join(b'label-%06d="%s"\n' % (i, b"v" * 40) for i in range(40_000))
    assert len(filler) > 16 * MAX_LABELS_BYTES
    # the job label past the bound is never seen
    labels = _labels(tmp_path, filler + b'job-name="late"\n')
    env.setenv(POD_LABELS_ENV, str(labels))
    assert job_name() is None
    # one inside it is
    labels.write_bytes(b'job-name="early"\n' + filler)
    assert job_name() == "early"
    # a line cut at the bound is not taken half ("abc" of "abcdef")
    cut = b"#" * (MAX_LABELS_BYTES - len(b"job-name=abc") - 1) + b"\njob-name=abcdef\n"
    assert cut[:MAX_LABELS_BYTES].endswith(b"\njob-name=abc")
    labels.write_bytes(cut)
    assert job_name() is None
    # a file that is not a labels file at all names nothing
    labels.write_bytes(os.urandom(4096))
    assert job_name() is None


# -- the hello, against a real daemon ------------------------------------------------------


def _jobs(daemon: Daemon) -> dict[str, dict[str, Any]]:
    status, _, body = daemon.get("/v1/jobs")
    assert status == 200
    return {job["name"]: job for job in json.loads(body)["jobs"]}


def _report_on_the_connection(client: Client) -> str:
    """A loader_report naming no job: the daemon takes the connection's (the hello's)."""
    buckets = [0] * 15
    buckets[0] = 1
    fields = {
        "rank": 0,
        "world_size": 1,
        "steps": 1,
        "wait": 0.0005,
        "step": 0.0005,
        "wait_buckets": buckets,
        "step_buckets": buckets,
    }
    with client.request("loader_report", fields) as reply:
        return str(reply.header["train_job"])


@pytest.mark.timeout(60)
def test_the_hello_claims_the_job_and_a_reconnection_claims_it_again(
    start_daemon: Callable[..., Daemon], tmp_path: Path, env: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "node"
    cwd.mkdir()
    daemon = start_daemon(cwd=cwd)
    env.setenv("CHUNKD_JOB", "from-env")
    with Client(cwd / "chunkd.sock", train_job="hello-job") as client:
        assert client.train_job == "hello-job"
        assert _report_on_the_connection(client) == "hello-job"
        seen = _jobs(daemon)["hello-job"]
        assert seen["uids"] == [os.getuid()]  # the claim, with who made it
        assert seen["steps"] == 1
        daemon.stop()
        daemon = start_daemon(cwd=cwd)  # a new daemon on the same socket
        assert "hello-job" not in _jobs(daemon)
        assert _report_on_the_connection(client) == "hello-job"  # the reconnection's hello
        assert _jobs(daemon)["hello-job"]["steps"] == 1
    with Client(cwd / "chunkd.sock") as client:
        assert client.train_job == "from-env"
        assert _report_on_the_connection(client) == "from-env"
    env.delenv("CHUNKD_JOB")
    with Client(cwd / "chunkd.sock") as client:
        assert client.train_job is None
        assert _report_on_the_connection(client) == "none"
    with pytest.raises(ValueError, match="train_job"):
        Client(cwd / "chunkd.sock", train_job="other")
    with pytest.raises(ValueError, match="train_job"):
        AsyncClient(cwd / "chunkd.sock", train_job="none")

    async def claim() -> str:
        async with AsyncClient(cwd / "chunkd.sock", train_job="async-job") as aio:
            assert aio.client.train_job == "async-job"
            return await asyncio.to_thread(_report_on_the_connection, aio.client)

    assert asyncio.run(claim()) == "async-job"


@pytest.mark.timeout(60)
def test_reads_for_a_named_dataset_are_accounted_to_the_job_and_the_dataset(
    start_daemon: Callable[..., Daemon], tmp_path: Path, env: pytest.MonkeyPatch
) -> None:
    from chunkd.client.datasets import Dataset, Loader
    from chunkd.client.datasets.pages import commit_snapshot
    from chunkd.snapshot import Member, Snapshot

    record = 4096
    cwd = tmp_path / "node"
    data = cwd / "chunkd-data" / "data"
    data.mkdir(parents=True)
    for i in range(3):
        (data / f"part-{i}.bin").write_bytes(os.urandom(record * 4))
    daemon = start_daemon(cwd=cwd)
    with Client(cwd / "chunkd.sock") as client:
        members = []
        for i in range(3):
            stat = client.stat(f"local/data/part-{i}.bin")
            key = f"data/part-{i}.bin"
            meta = {"record_bytes": record}
            members.append(Member(key, stat.size, stat.version, "fixed", 4, meta))
        snapshot = Snapshot.build(backend="local", prefix="data/", format="fixed", members=members)
        commit_snapshot(client, "text/acct", snapshot)
    with Client(cwd / "chunkd.sock", train_job="acct-job") as client:
        dataset = Dataset.open("text/acct@1", client)
        loader = Loader(dataset, batch_size=4, seed=1, prefetch=1, shared_decode=False)
        assert sum(len(batch) for batch in loader) == 12
    status, _, body = daemon.get("/v1/cost?job=acct-job")
    assert status == 200
    (row,) = json.loads(body)["jobs"]
    names = {entry["name"]: entry for entry in row["names"]}
    assert "text/acct" in names, names  # the reads said whose they were
    served = names["text/acct"]["served_bytes"]
    assert sum(served.values()) >= 3 * 4 * record
