"""Jobs on a node: admission to a label (a stable top K), end and idle, the loaders'
reports as histograms and worst ranks, and the bounds (docs/jobs.md)."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from chunkd.client.protocol import LOADER_BUCKETS, VERSION, recv_frame, send_frame
from chunkd.errors import InvalidRequestError
from chunkd.gateway.jobs import JobTable
from chunkd.gateway.jobs.stalls import MAX_RANKS
from chunkd.gateway.jobs.table import END_QUIET

from .conftest import Daemon, wait_for_socket

NB = len(LOADER_BUCKETS) + 1


def bucket_of(seconds: float) -> int:
    return next((i for i, b in enumerate(LOADER_BUCKETS) if seconds <= b), NB - 1)


def window(
    rank: int,
    steps: int = 10,
    wait: float = 0.02,
    step: float = 0.2,
    *,
    world_size: int | None = 8,
    end: bool = False,
) -> dict[str, object]:
    """A rank's report of ``steps`` equal steps (each ``wait``/``step`` seconds)."""
    waits, steps_ = [0] * NB, [0] * NB
    waits[bucket_of(wait)] = steps
    steps_[bucket_of(step)] = steps
    return {
        "rank": rank,
        "world_size": world_size,
        "steps": steps,
        "wait": wait * steps,
        "step": step * steps,
        "wait_max": wait,
        "wait_buckets": waits,
        "step_buckets": steps_,
        "end": end,
    }


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def exposition(table: JobTable) -> str:
    registry = CollectorRegistry()
    registry.register(table.collector())
    return generate_latest(registry).decode()


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the one sample ``name{labels}`` in ``text`` (None: absent)."""
    found = None
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name or line.startswith("#"):
            continue
        pairs = dict(p.split("=", 1) for p in label_text.rstrip("}").split(",") if p)
        if {k: v.strip('"') for k, v in pairs.items()} == labels:
            assert found is None, f"two samples {name}{labels}"
            found = float(value)
    return found


@pytest.mark.timeout(10)
def test_the_first_top_jobs_are_named_and_the_rest_are_other_for_life(clock: Clock) -> None:
    table = JobTable(top=2, idle=600, clock=clock)
    assert [table.label(j, 1000) for j in ("a", "b", "c")] == ["a", "b", "other"]
    assert table.label(None) == "none"
    assert table.live_labels() == {"a", "b"}  # what the cost ledger's scrape asks
    clock.now += 300
    table.label("b")
    table.label("c")
    clock.now += 301  # a is idle: ended, its slot free
    assert table.label("c") == "other"  # c keeps the label it started with
    assert table.label("d") == "d"  # a new start takes the free slot
    assert table.label("e") == "other"
    assert table.live_labels() == {"b", "d"}
    text = exposition(table)
    assert sample(text, "chunkd_jobs", state="named") == 2
    assert sample(text, "chunkd_jobs", state="other") == 2
    assert sample(text, "chunkd_job_starts_total", admitted="true") == 3
    assert sample(text, "chunkd_job_starts_total", admitted="false") == 2
    assert [(j["name"], j["label"], j["uids"]) for j in table.view()["jobs"]] == [
        ("b", "b", [1000]),
        ("c", "other", [1000]),
        ("d", "d", []),
        ("e", "other", []),
    ]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", ["other", "none", "-starts-with-dash", "a b", "x" * 129, ""])
def test_a_bad_or_reserved_job_name_is_refused(clock: Clock, name: str) -> None:
    table = JobTable(clock=clock)
    with pytest.raises(InvalidRequestError):
        table.label(name)
    with pytest.raises(InvalidRequestError):
        table.report(name, None, window(0))
    assert table.view()["jobs"] == []


@pytest.mark.timeout(10)
def test_reports_become_histograms_of_the_jobs_label(clock: Clock) -> None:
    table = JobTable(top=1, clock=clock)
    assert table.report("run-7", 1000, window(0, 10, 0.02, 0.2)) == "run-7"
    assert table.report("run-7", 1000, window(1, 5, 0.3, 0.6)) == "run-7"
    assert table.report("run-8", 1000, window(0, 4, 0.002, 0.2)) == "other"
    assert table.report(None, 1000, window(0, 3, 0.002, 0.2)) == "none"
    text = exposition(table)
    wait = "chunkd_loader_wait_seconds"
    assert sample(text, f"{wait}_count", train_job="run-7") == 15
    assert sample(text, f"{wait}_sum", train_job="run-7") == pytest.approx(0.2 + 1.5)
    # cumulative: 10 waits of 0.02 s are <= 0.025, the 5 of 0.3 s <= 0.5
    assert sample(text, f"{wait}_bucket", train_job="run-7", le="0.01") == 0
    assert sample(text, f"{wait}_bucket", train_job="run-7", le="0.025") == 10
    assert sample(text, f"{wait}_bucket", train_job="run-7", le="0.25") == 10
    assert sample(text, f"{wait}_bucket", train_job="run-7", le="0.5") == 15
    assert sample(text, f"{wait}_bucket", train_job="run-7", le="+Inf") == 15
    assert sample(text, "chunkd_loader_step_seconds_sum", train_job="run-7") == pytest.approx(5)
    assert sample(text, f"{wait}_count", train_job="other") == 4
    assert sample(text, f"{wait}_count", train_job="none") == 3
    assert sample(text, "chunkd_loader_ranks", train_job="run-7") == 2
    (job, other) = table.view()["jobs"]
    assert (job["steps"], job["ranks"], job["world_size"]) == (15, 2, 8)
    assert job["stall"] == pytest.approx(1.7 / 5.0)
    assert job["recent_stall"] == pytest.approx(1.7 / 5.0)
    assert (other["label"], other["steps"]) == ("other", 4)
    assert table.view()["none"]["steps"] == 3


@pytest.mark.timeout(10)
def test_a_job_ends_after_every_ranks_end_and_a_quiet_minute(clock: Clock) -> None:
    table = JobTable(top=1, clock=clock)
    for rank in range(4):
        table.report("run-7", None, window(rank))
    table.first_batch("run-7", None, 0, {"metadata": 0.1, "total": 1.0})
    assert sample(exposition(table), "chunkd_loader_wait_seconds_count", train_job="run-7")
    for rank in range(3):
        table.report("run-7", None, window(rank, end=True))
    clock.now += END_QUIET + 1
    assert table.label("late") == "other"  # one rank has not ended: run-7 holds the slot
    table.report("run-7", None, window(3, 0, end=True))  # the last rank's end
    clock.now += END_QUIET - 1
    assert [j["name"] for j in table.view()["jobs"]] == ["run-7", "late"]
    clock.now += 2
    view = table.view()
    assert [j["name"] for j in view["jobs"]] == ["late"]
    assert [(j["name"], j["ended"], j["steps"]) for j in view["ended"]] == [("run-7", True, 70)]
    text = exposition(table)
    assert 'train_job="run-7"' not in text  # every series of the job is gone
    assert sample(text, "chunkd_jobs", state="named") == 0
    assert table.live_labels() == frozenset()
    assert table.label("next") == "next"  # and its slot is free


@pytest.mark.timeout(10)
def test_a_rank_that_reports_again_after_its_end_keeps_the_job(clock: Clock) -> None:
    table = JobTable(clock=clock)
    table.report("run-7", None, window(0, end=True))
    clock.now += 30
    table.report("run-7", None, window(0))  # a new epoch
    clock.now += END_QUIET + 1
    assert [j["name"] for j in table.view()["jobs"]] == ["run-7"]


@pytest.mark.timeout(10)
def test_a_silent_job_ends_after_idle_and_its_series_go(clock: Clock) -> None:
    table = JobTable(top=4, idle=600, clock=clock)
    table.report("run-7", None, window(0))
    table.label("run-8")
    clock.now += 599
    table.label("run-8")
    assert 'train_job="run-7"' in exposition(table)
    clock.now += 2
    text = exposition(table)
    assert 'train_job="run-7"' not in text
    assert sample(text, "chunkd_jobs", state="named") == 1
    assert table.life("run-7") is None  # ended: no life
    life = table.life("run-8")
    assert life is not None
    assert life == table.life("run-8")  # the same start
    # a job of that name seen again is a new start, counted from zero
    table.report("run-7", None, window(0, 2))
    assert sample(exposition(table), "chunkd_loader_wait_seconds_count", train_job="run-7") == 2
    clock.now += 601
    table.label("run-8")  # run-8 ended (idle) and starts again: another life
    assert table.life("run-8") not in (None, life)


@pytest.mark.timeout(10)
def test_the_worst_ranks_are_the_live_ranks_with_the_highest_stall(clock: Clock) -> None:
    table = JobTable(worst_ranks=3, clock=clock)
    for rank in range(64):
        table.report("run-7", None, window(rank, 10, 0.001 * rank, 1.0, world_size=64))
    worst = table.view()["jobs"][0]["worst_ranks"]
    assert [w["rank"] for w in worst] == [63, 62, 61]
    assert worst[0]["stall"] == pytest.approx(0.063)
    assert worst[0]["wait_max"] == pytest.approx(0.063)
    # rank 63 got fast, rank 5 got slow
    table.report("run-7", None, window(63, 10, 0.0, 1.0))
    table.report("run-7", None, window(5, 10, 0.5, 1.0))
    text = exposition(table)
    ratio = "chunkd_loader_worst_rank_wait_ratio"
    assert sample(text, ratio, train_job="run-7", rank="5") == pytest.approx(0.5)
    assert sample(text, ratio, train_job="run-7", rank="62") == pytest.approx(0.062)
    assert sample(text, ratio, train_job="run-7", rank="61") == pytest.approx(0.061)
    assert sample(text, ratio, train_job="run-7", rank="63") is None
    assert text.count(f"{ratio}{{") == 3
    # ranks silent for two minutes are no longer live: only rank 0 reported since
    clock.now += 100
    table.report("run-7", None, window(0, 10, 0.001, 1.0))
    clock.now += 21
    text = exposition(table)
    assert sample(text, "chunkd_loader_ranks", train_job="run-7") == 1
    assert [w["rank"] for w in table.view()["jobs"][0]["worst_ranks"]] == [0]
    assert table.view()["jobs"][0]["recent_stall"] == pytest.approx(0.001)


@pytest.mark.timeout(10)
def test_many_reports_keep_the_worst_ranks_heap_bounded(clock: Clock) -> None:
    table = JobTable(clock=clock)
    for i in range(20_000):
        table.report("run-7", None, window(i % 8, 1, 0.001 * (i % 13), 1.0))
    ranks = table._jobs["run-7"].ranks
    assert len(ranks._heap) <= 2 * len(ranks) + 16
    assert len(table.view()["jobs"][0]["worst_ranks"]) == 3


@pytest.mark.timeout(10)
def test_the_first_batch_shown_is_the_slowest_ranks(clock: Clock) -> None:
    table = JobTable(clock=clock)
    table.first_batch("run-7", None, 0, {"metadata": 0.1, "decode": 0.2, "total": 1.0})
    table.first_batch("run-7", None, 3, {"metadata": 0.5, "first_chunk": 2.0, "total": 3.0})
    table.first_batch("run-7", None, 1, {"metadata": 0.2, "total": 2.0})
    first = table.view()["jobs"][0]["first_batch"]
    assert first == {"rank": 3, "metadata": 0.5, "first_chunk": 2.0, "total": 3.0}
    text = exposition(table)
    phase = "chunkd_job_first_batch_seconds"
    assert sample(text, phase, train_job="run-7", phase="first_chunk") == 2.0
    assert sample(text, phase, train_job="run-7", phase="total") == 3.0
    assert sample(text, phase, train_job="run-7", phase="decode") is None  # rank 3's own
    # rank 3 started again, faster: rank 1 is now the slowest
    table.first_batch("run-7", None, 3, {"metadata": 0.1, "total": 0.5})
    assert table.view()["jobs"][0]["first_batch"] == {"rank": 1, "metadata": 0.2, "total": 2.0}


@pytest.mark.timeout(20)
def test_jobs_past_tracked_fold_into_other_and_are_not_kept(clock: Clock) -> None:
    table = JobTable(top=4, tracked=10, clock=clock)
    for i in range(2000):
        label = table.report(f"job-{i}", None, window(0, 1))
        assert label == (f"job-{i}" if i < 4 else "other")
    view = table.view()
    assert len(view["jobs"]) == 10
    assert view["live"] == {"named": 4, "other": 6}
    text = exposition(table)
    assert sample(text, "chunkd_loader_wait_seconds_count", train_job="other") == 1996
    assert sample(text, "chunkd_jobs", state="other") == 6
    assert sample(text, "chunkd_job_starts_total", admitted="false") == 6
    assert text.count("chunkd_loader_ranks{") == 5  # 4 names and other


@pytest.mark.timeout(20)
def test_ranks_past_the_bound_are_counted_not_kept(clock: Clock) -> None:
    table = JobTable(clock=clock)
    for rank in range(MAX_RANKS + 100):
        table.report("big", None, window(rank, 1, world_size=None))
    job = table.view()["jobs"][0]
    assert (job["ranks"], job["steps"]) == (MAX_RANKS, MAX_RANKS + 100)
    assert len(table._jobs["big"].ranks) == MAX_RANKS


@pytest.mark.timeout(10)
def test_ranks_past_the_tables_budget_are_counted_not_kept(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("chunkd.gateway.jobs.table.MAX_KEPT", 10)
    table = JobTable(clock=clock)
    for job in ("a", "b"):
        for rank in range(8):
            table.report(job, None, window(rank, 1))
    assert [(j["name"], j["ranks"], j["steps"]) for j in table.view()["jobs"]] == [
        ("a", 8, 8),
        ("b", 2, 8),
    ]
    clock.now += 601  # both idle: their records are freed
    for rank in range(8):
        table.report("c", None, window(rank, 1))
    assert [(j["name"], j["ranks"]) for j in table.view()["jobs"]] == [("c", 8)]


# --- a real daemon -------------------------------------------------------------------


@pytest.fixture
def node(start_daemon, tmp_path: Path) -> Daemon:
    work = tmp_path / "work"
    (work / "chunkd-data").mkdir(parents=True)
    return start_daemon(cwd=work)


def connect(daemon: Daemon, train_job: str | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60)
    sock.connect(str(daemon.cwd / "chunkd.sock"))
    header = ask(sock, op="hello", version=VERSION, train_job=train_job)
    assert header["ok"], header
    return sock


def ask(sock: socket.socket, **request: object) -> dict:
    send_frame(sock, {"id": 7, **request})
    header, _, fds = recv_frame(sock)
    assert fds == []
    return header


def jobs_of(daemon: Daemon, query: str = "") -> dict:
    status, _, body = daemon.get("/v1/jobs" + query)
    assert status == 200
    return json.loads(body)


def reports(n: int) -> Iterator[dict[str, object]]:
    for rank in range(n):
        yield window(rank, 10, 0.01 * (rank + 1), 0.5)


@pytest.mark.timeout(60)
def test_a_daemon_takes_reports_and_views_the_job(node: Daemon) -> None:
    with connect(node, "run-7") as sock:
        for report in reports(4):
            answer = ask(sock, op="loader_report", **report)
            assert (answer["ok"], answer["train_job"]) == (True, "run-7")
        # a report may name another job than its connection's
        answer = ask(sock, op="loader_report", train_job="eval-1", **window(0, 2, 0.1, 0.2))
        assert answer["train_job"] == "eval-1"
    with connect(node) as sock:  # no job: none
        assert ask(sock, op="loader_report", **window(0, 3))["train_job"] == "none"
    view = jobs_of(node)
    assert view["top"] == 16
    by_name = {j["name"]: j for j in view["jobs"]}
    job = by_name["run-7"]
    assert (job["label"], job["ranks"], job["world_size"], job["steps"]) == ("run-7", 4, 8, 40)
    assert job["wait_seconds"] == pytest.approx(0.1 * (1 + 2 + 3 + 4))
    assert job["step_seconds"] == pytest.approx(20.0)
    assert [w["rank"] for w in job["worst_ranks"]] == [3, 2, 1]
    assert job["uids"] == [os.getuid()]
    assert job["ended"] is False
    assert by_name["eval-1"]["steps"] == 2
    assert view["none"]["steps"] == 3
    assert [j["name"] for j in jobs_of(node, "?job=eval-1")["jobs"]] == ["eval-1"]
    assert jobs_of(node, "?job=never-seen")["jobs"] == []
    status, _, body = node.get("/v1/jobs?job=other")
    assert status == 400
    assert json.loads(body)["error"] == "InvalidRequestError"


@pytest.mark.timeout(60)
def test_a_hello_alone_starts_its_job(node: Daemon) -> None:
    with connect(node, "just-hello"):
        pass
    (job,) = jobs_of(node, "?job=just-hello")["jobs"]
    assert (job["label"], job["uids"], job["steps"]) == ("just-hello", [os.getuid()], 0)
    # its loader series are in /metrics at 0 from its start: Prometheus has a 0 before
    # the first report, so rate() and increase() count the first report's steps
    _, _, body = node.get("/metrics")
    text = body.decode()
    for histogram in ("chunkd_loader_wait_seconds", "chunkd_loader_step_seconds"):
        assert sample(text, f"{histogram}_count", train_job="just-hello") == 0
        assert sample(text, f"{histogram}_sum", train_job="just-hello") == 0
        assert sample(text, f"{histogram}_bucket", train_job="just-hello", le="+Inf") == 0
    assert sample(text, "chunkd_loader_ranks", train_job="just-hello") == 0


@pytest.mark.timeout(10)
def test_a_job_is_exported_at_zero_from_its_start(clock: Clock) -> None:
    table = JobTable(top=1, clock=clock)
    table.label("run-7")
    table.label("late")  # other: other's series appear at 0 with the first other job
    text = exposition(table)
    for label in ("run-7", "other"):
        for histogram in ("chunkd_loader_wait_seconds", "chunkd_loader_step_seconds"):
            assert sample(text, f"{histogram}_count", train_job=label) == 0
            assert sample(text, f"{histogram}_bucket", train_job=label, le="0.1") == 0


@pytest.mark.timeout(60)
def test_a_daemon_exports_the_reported_jobs(node: Daemon) -> None:
    with connect(node, "run-7") as sock:
        for report in reports(4):
            ask(sock, op="loader_report", **report)
    _, _, body = node.get("/metrics")
    text = body.decode()
    assert sample(text, "chunkd_loader_wait_seconds_count", train_job="run-7") == 40
    assert sample(text, "chunkd_loader_step_seconds_sum", train_job="run-7") == pytest.approx(20)
    assert sample(text, "chunkd_loader_ranks", train_job="run-7") == 4
    ratio = "chunkd_loader_worst_rank_wait_ratio"
    assert sample(text, ratio, train_job="run-7", rank="3") == pytest.approx(0.08)
    assert sample(text, "chunkd_jobs", state="named") == 1
    assert sample(text, "chunkd_job_starts_total", admitted="true") == 1


@pytest.mark.timeout(60)
def test_a_daemon_ends_an_idle_job_and_frees_its_label(start_daemon, tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "chunkd-data").mkdir(parents=True)
    limits = {"CHUNKD_JOBS_TOP": "1", "CHUNKD_JOBS_TRACKED": "3", "CHUNKD_JOBS_IDLE": "1s"}
    node = start_daemon(cwd=work, env=limits)
    with connect(node) as sock:
        labels = [
            ask(sock, op="loader_report", train_job=f"run-{i}", **window(0, 1))["train_job"]
            for i in range(5)
        ]
        assert labels == ["run-0", "other", "other", "other", "other"]
        assert [j["name"] for j in jobs_of(node)["jobs"]] == ["run-0", "run-1", "run-2"]
        _, _, body = node.get("/metrics")
        assert sample(body.decode(), "chunkd_loader_wait_seconds_count", train_job="other") == 4
        for _ in range(100):  # [jobs] idle: nothing came for 1 s
            _, _, body = node.get("/metrics")
            if 'train_job="run-0"' not in body.decode():
                break
            time.sleep(0.1)
        assert 'train_job="run-0"' not in body.decode()
        assert sample(body.decode(), "chunkd_jobs", state="named") == 0
        # the other label's counters never go down
        assert sample(body.decode(), "chunkd_loader_wait_seconds_count", train_job="other") == 4
        view = jobs_of(node)
        assert view["jobs"] == []
        ended = [(j["name"], j["label"], j["ended"]) for j in view["ended"]]
        assert ended == [
            ("run-0", "run-0", True),
            ("run-1", "other", True),
            ("run-2", "other", True),
        ]
        answer = ask(sock, op="loader_report", train_job="run-9", **window(0, 1))
        assert answer["train_job"] == "run-9"  # the slot is free


REGISTRY_CONFIG = """
[cache]
dir = "{dir}/cache"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
fsync = "never"

[[backends]]
name = "local"
url = "file://{dir}/data"
writable = true

[datasets]
registry = "local/registry"
"""


@pytest.mark.timeout(60)
def test_a_daemon_shows_the_slowest_ranks_first_batch(start_daemon, tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    node = start_daemon(REGISTRY_CONFIG.format(dir=tmp_path))
    assert wait_for_socket(tmp_path / "chunkd.sock", 10)
    with connect(node, "run-7") as sock:
        for rank, total in ((0, 1.0), (3, 3.0), (1, 2.0)):
            phases = {"metadata": total / 4, "first_chunk": total / 2, "total": total}
            assert ask(sock, op="ds_first_batch", rank=rank, **phases)["ok"]
        header = ask(sock, op="ds_first_batch", rank=0, train_job="bad name", total=1.0)
        assert header["error"] == "InvalidRequestError"
    (job,) = jobs_of(node)["jobs"]
    assert job["first_batch"] == {"rank": 3, "metadata": 0.75, "first_chunk": 1.5, "total": 3.0}
    _, _, body = node.get("/metrics")
    text = body.decode()
    phase = "chunkd_job_first_batch_seconds"
    assert sample(text, phase, train_job="run-7", phase="first_chunk") == 1.5
    assert sample(text, phase, train_job="run-7", phase="total") == 3.0


def _bad_buckets() -> dict[str, object]:
    report = window(0, 10)
    report["wait_buckets"] = [1] * NB  # 15 steps' worth, not 10
    return report


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "request_",
    [
        {"op": "loader_report", **_bad_buckets()},
        {"op": "loader_report", **window(0), "wait_buckets": [10]},  # too few buckets
        {"op": "loader_report", **window(8, world_size=8)},  # rank past world_size
        {"op": "loader_report", **window(0), "train_job": "other"},  # reserved
        {"op": "loader_report", **window(0), "train_job": "none"},
        {"op": "loader_report", **window(0), "train_job": "bad name"},
        {"op": "loader_report", **window(0), "train_job": "x" * 129},
        {"op": "loader_report", **window(0), "steps": -1},
        {"op": "hello", "version": VERSION, "train_job": "other"},
        {"op": "hello", "version": VERSION, "train_job": "/etc/passwd"},
    ],
)
def test_bad_reports_are_refused_and_counted_nowhere(node: Daemon, request_: dict) -> None:
    with connect(node, "run-7") as sock:
        header = ask(sock, **request_)
        assert (header["ok"], header["error"]) == (False, "InvalidRequestError"), header
        assert header["message"]
        assert ask(sock, op="loader_report", **window(0, 1))["ok"]  # the connection stays
    assert [(j["name"], j["steps"]) for j in jobs_of(node)["jobs"]] == [("run-7", 1)]
    assert "Traceback" not in node.log.read_text()


@pytest.mark.timeout(60)
def test_a_flood_of_job_names_stays_within_tracked(node: Daemon) -> None:
    with connect(node) as sock:
        for i in range(2000):
            answer = ask(sock, op="loader_report", train_job=f"flood-{i}", **window(0, 1))
            assert answer["train_job"] == (f"flood-{i}" if i < 16 else "other")
    view = jobs_of(node)
    assert len(view["jobs"]) == 1024  # [jobs] tracked
    assert view["live"] == {"named": 16, "other": 1024 - 16}
    _, _, body = node.get("/metrics")
    text = body.decode()
    assert sample(text, "chunkd_loader_wait_seconds_count", train_job="other") == 2000 - 16
    assert text.count("chunkd_loader_ranks{") == 17  # 16 names and other
    assert len(body) < 256 * 1024


@pytest.mark.timeout(60)
def test_the_jobs_route_answers_the_none_entry_for_job_none(node: Daemon) -> None:
    # before any report that names no job: none is null, ?job=none answers no row
    with connect(node, "run-7") as sock:
        ask(sock, op="loader_report", **window(0, 2))
    before = jobs_of(node, "?job=none")
    assert before["none"] is None
    assert before["jobs"] == []
    with connect(node) as sock:  # no job: none
        ask(sock, op="loader_report", **window(0, 3))
    view = jobs_of(node, "?job=none")
    # the none entry alone, in jobs as GET /v1/cost?job=none answers its row
    assert [j["name"] for j in view["jobs"]] == ["none"]
    assert view["jobs"][0]["steps"] == 3
    assert view["none"] == view["jobs"][0]
    assert view["ended"] == []
    status, _, _ = node.get("/v1/jobs?job=other")  # jobs past top are listed by name
    assert status == 400
