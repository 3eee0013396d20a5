"""The cost ledger (issue 30): who pays for backend requests and bytes, the credit for
cache hits, "without chunkd", GET /v1/cost, chunkd cost, cost.json across restarts.

Real parts: a moto S3 behind the counting proxy, real daemons, real clients.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chunkd.client import Client
from chunkd.testing import CountingProxy, S3Server, s3_backend
from tests.conftest import Daemon

MiB = 1 << 20
#: the most a response's head and a request's framing add to the body bytes the
#: proxy counts (moto's headers are ~500 bytes)
HEAD_ALLOWANCE = 2048


def _toml(tmp_path: Path, bucket: str, proxy: CountingProxy, *, price: str = "") -> str:
    keys: dict[str, str | int | bool] = {"revalidate": "immutable", "retries": 0}
    if price:
        keys["price"] = price
    backend = s3_backend("data", f"s3://{bucket}/pre", proxy.endpoint, **keys)
    return f"""
[server]
readahead_chunks = 0

[cache]
dir = "{tmp_path / "cache"}"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
chunk_bytes = "1MiB"
fsync = "never"

{backend}"""


def _put(s3_server: S3Server, bucket: str, key: str, size: int) -> bytes:
    body = os.urandom(size)
    s3_server.client().put_object(Bucket=bucket, Key=f"pre/{key}", Body=body)
    return body


def _cost(daemon: Daemon, query: str = "") -> dict[str, Any]:
    status, _, body = daemon.get("/v1/cost" + query)
    assert status == 200, body
    answer: dict[str, Any] = json.loads(body)
    return answer


def _job(view: dict[str, Any], job: str) -> dict[str, Any]:
    found = [row for row in view["jobs"] if row["job"] == job]
    assert len(found) == 1, view["jobs"]
    return found[0]


def _read(daemon: Daemon, key: str, job: str | None) -> bytes:
    headers = {} if job is None else {"X-Chunkd-Job": job}
    status, _, body = daemon.get(f"/v1/objects/data/{key}", headers)
    assert status == 200, body
    return body


@pytest.mark.timeout(60)
def test_a_jobs_backend_requests_and_bytes_are_the_proxys_and_a_second_read_is_credited(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    s3_server: S3Server,
    bucket: str,
    s3_proxy: CountingProxy,
) -> None:
    size = 3 * MiB + 12345
    body = _put(s3_server, bucket, "a.bin", size)
    daemon = start_daemon(_toml(tmp_path, bucket, s3_proxy, price="example-s3-internet"))
    s3_proxy.reset()
    requests_before = daemon.metric("chunkd_backend_requests_total", backend="data")
    assert _read(daemon, "a.bin", "run-a") == body
    row = _job(_cost(daemon), "run-a")
    requests = daemon.metric("chunkd_backend_requests_total", backend="data") - requests_before
    # Every backend request the node made for this read is the job's, and its bytes are
    # the object's: what the proxy passed, less the responses' heads.
    assert sum(row["backend_requests"].values()) == requests > 0
    assert row["backend_bytes"]["read"] == size
    assert 0 <= s3_proxy.bytes_down - size <= requests * HEAD_ALLOWANCE
    assert row["served_bytes"]["backend"] == size, row
    # Without chunkd: one GET of the whole object.
    assert row["direct_requests"] == {"get": 1}
    assert row["direct_bytes"] == size
    # Priced by example-s3-internet: 0.09 per GB out, 0.0004 per 1000 GET and HEAD.
    gb = size / (1 << 30)
    assert row["spent"] == pytest.approx(gb * 0.09 + requests * 0.0004 / 1000)
    assert row["saved"] == {"cache": 0.0, "peer": 0.0}
    # A second job reading the same object: served from the cache, no backend bytes,
    # credited with what a direct read would have cost it.
    s3_proxy.reset()
    assert _read(daemon, "a.bin", "run-b") == body
    assert s3_proxy.bytes_down == 0
    other = _job(_cost(daemon), "run-b")
    assert other["backend_requests"] == {}
    assert other["backend_bytes"] == {}
    assert other["spent"] == 0.0
    assert other["served_bytes"]["ram"] + other["served_bytes"]["disk"] == size
    assert other["saved"]["cache"] == pytest.approx(gb * 0.09 + 0.0004 / 1000)
    assert other["direct"] == pytest.approx(other["saved"]["cache"])
    # The first job's figures did not move.
    assert _job(_cost(daemon), "run-a")["backend_bytes"]["read"] == size
    # /metrics: the same figures, by train_job.
    assert daemon.metric("chunkd_cost_backend_bytes_total", train_job="run-a") == size
    assert (
        daemon.metric("chunkd_cost_served_bytes_total", train_job="run-b", source="ram")
        == (other["served_bytes"]["ram"])
    )
    assert daemon.metric("chunkd_cost_saved_dollars_total", train_job="run-b") == pytest.approx(
        other["saved"]["cache"]
    )


@pytest.mark.timeout(60)
def test_two_jobs_reading_at_once_over_the_local_socket_are_charged_each_for_its_own(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    s3_server: S3Server,
    bucket: str,
    s3_proxy: CountingProxy,
) -> None:
    sizes = {"x.bin": 2 * MiB + 1, "y.bin": 5 * MiB + 7}
    bodies = {key: _put(s3_server, bucket, key, size) for key, size in sizes.items()}
    daemon = start_daemon(_toml(tmp_path, bucket, s3_proxy))
    s3_proxy.delay = 0.002  # both reads' fetches are in flight together
    got: dict[str, bytes] = {}

    def read(job: str, key: str) -> None:
        with Client(daemon.cwd / "chunkd.sock", train_job=job) as client:
            got[key] = client.read(f"data/{key}")

    threads = [
        threading.Thread(target=read, args=("job-x", "x.bin")),
        threading.Thread(target=read, args=("job-y", "y.bin")),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == bodies
    view = _cost(daemon)
    # Each job pays for the object it read: the single flight's fetches and spans run
    # under the reader's attribution, not the daemon's.
    for job, key in (("job-x", "x.bin"), ("job-y", "y.bin")):
        row = _job(view, job)
        assert row["backend_bytes"]["read"] == sizes[key], job
        assert row["served_bytes"]["backend"] == sizes[key], job
    assert all(row["job"] != "none" or not row["backend_bytes"] for row in view["jobs"])
    assert view["totals"]["backend_bytes"]["read"] == sum(sizes.values())


@pytest.mark.timeout(30)
def test_a_bad_job_header_is_a_400_saying_why(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    s3_server: S3Server,
    bucket: str,
    s3_proxy: CountingProxy,
) -> None:
    _put(s3_server, bucket, "a.bin", 10)
    daemon = start_daemon(_toml(tmp_path, bucket, s3_proxy))
    for bad in ("other", "none", "-lead", "x" * 129, "a b"):
        status, _, body = daemon.get("/v1/objects/data/a.bin", {"X-Chunkd-Job": bad})
        assert status == 400, (bad, body)
        assert b"X-Chunkd-Job" in body
    assert not (daemon.log.read_text().count("Traceback"))
    status, _, _ = daemon.get("/v1/objects/data/a.bin", {"X-Chunkd-Job": "ok-job"})
    assert status == 200
    # A since that is no time is a 400 too.
    for bad in ("nan", "inf", "yesterday"):
        status, _, body = daemon.get(f"/v1/cost?since={bad}")
        assert status == 400, (bad, body)
        assert b"is no time" in body


def _chunkd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chunkd", "cost", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.timeout(90)
def test_chunkd_cost_json_job_since_and_the_totals_survive_a_restart_and_a_kill(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    s3_server: S3Server,
    bucket: str,
    s3_proxy: CountingProxy,
) -> None:
    size = MiB + 5
    _put(s3_server, bucket, "a.bin", size)
    _put(s3_server, bucket, "b.bin", size)
    toml = _toml(tmp_path, bucket, s3_proxy)
    daemon = start_daemon(toml)
    _read(daemon, "a.bin", "run-1")
    _read(daemon, "b.bin", "run-2")
    done = _chunkd("--url", daemon.url, "--json")
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert {row["job"] for row in view["jobs"]} >= {"run-1", "run-2"}
    only = json.loads(_chunkd("--url", daemon.url, "--json", "--job", "run-1").stdout)
    assert [row["job"] for row in only["jobs"]] == ["run-1"]
    assert only["jobs"][0]["backend_bytes"]["read"] == size
    # --since: nothing happened in the future; everything happened in the last hour.
    later = json.loads(_chunkd("--url", daemon.url, "--json", "--since", "0s").stdout)
    assert later["totals"]["backend_bytes"].get("read", 0) == 0
    hour = json.loads(_chunkd("--url", daemon.url, "--json", "--since", "1h").stdout)
    assert hour["totals"]["backend_bytes"]["read"] == 2 * size
    # The table: a line per job with its money.
    table = _chunkd("--url", daemon.url, "--job", "run-1")
    assert table.returncode == 0, table.stderr
    assert "run-1" in table.stdout
    assert "USD" in table.stdout
    bad = _chunkd("--url", daemon.url, "--since", "yesterday-ish")
    assert bad.returncode != 0
    assert "since" in bad.stderr
    # A clean stop writes cost.json; the next start carries on from it.
    assert daemon.stop() == 0
    assert (tmp_path / "cache" / "cost.json").exists()
    daemon = start_daemon(toml)
    assert _job(_cost(daemon), "run-1")["backend_bytes"]["read"] == size
    # A kill -9 loses at most what came after the last minute's write: the figures
    # from before the restart were written at the last stop, so they are all there.
    _read(daemon, "a.bin", "run-3")  # a cache hit, credited, maybe lost
    daemon.stop(signal.SIGKILL)
    daemon = start_daemon(toml)
    view = _cost(daemon)
    assert _job(view, "run-1")["backend_bytes"]["read"] == size
    assert _job(view, "run-2")["backend_bytes"]["read"] == size


@pytest.mark.timeout(30)
def test_the_ledger_writes_its_totals_every_minute_so_a_kill_loses_at_most_the_last(
    tmp_path: Path,
) -> None:
    import asyncio

    from chunkd.gateway.costs.ledger import Ledger
    from chunkd.gateway.costs.prices import Prices
    from chunkd.gateway.jobs.table import JobTable

    now = [1000.0]
    path = tmp_path / "cost.json"

    def make() -> Ledger:
        return Ledger(
            JobTable(),
            prices=Prices(default="example-s3-internet"),
            state_path=path,
            clock=lambda: now[0],
        )

    ledger = make()
    ledger.charge("run-1", 1000, "text/web", "bytes", "data", "read", 100)
    asyncio.run(ledger.save())  # the minute's write
    now[0] += 30
    ledger.charge("run-1", 1000, "text/web", "bytes", "data", "read", 7)  # lost: no write
    # Killed now: what the next start reads is the last minute's.
    again = make()
    row = _job(again.view(), "run-1")
    assert row["backend_bytes"]["read"] == 100
    assert row["names"][0]["name"] == "text/web"
    # since: from the snapshot the minute's write took.
    ledger.tick()
    assert _job(ledger.view(since=1000.0), "run-1")["backend_bytes"]["read"] == 7


@pytest.mark.timeout(60)
def test_a_checkpoint_save_and_restore_are_charged_to_the_saving_job_and_its_run(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    import numpy as np

    from chunkd.client import checkpoint as ckpt

    daemon = start_daemon()  # the embedded default: a writable file backend, local
    state = {"w": np.arange(3 * MiB // 8, dtype=np.int64)}
    with Client(daemon.cwd / "chunkd.sock", train_job="trainer") as client:
        ckpt.save(state, "local/run-9/100", client=client)
    with Client(daemon.cwd / "chunkd.sock", train_job="restorer") as client:
        back = ckpt.load("local/run-9/100", client=client)
    assert (back["w"] == state["w"]).all()
    view = _cost(daemon)
    saver = _job(view, "trainer")
    names = {row["name"]: row for row in saver["names"]}
    # The upload is the saver's, under its run's name (no step).
    assert names["local/run-9"]["written_bytes"]["checkpoint"] >= state["w"].nbytes
    assert saver["backend_bytes"]["write"] >= state["w"].nbytes
    # The restore's chunk reads: one direct GET each, served from this node's cache.
    restorer = _job(view, "restorer")
    assert restorer["direct_requests"]["get"] >= 1
    assert restorer["direct_bytes"] >= state["w"].nbytes
    assert restorer["served_bytes"]["ram"] + restorer["served_bytes"]["disk"] >= (state["w"].nbytes)
    # Storage: the run's history, from the catalog.
    status, _, body = daemon.get("/v1/cost/storage")
    assert status == 200, body
    storage = json.loads(body)
    runs = {row["name"]: row for row in storage["checkpoints"]}
    assert runs["local/run-9"]["checkpoints"] == 1
    assert runs["local/run-9"]["stored_bytes"] >= state["w"].nbytes
    assert storage["truncated"] is False
    shown = subprocess.run(
        [sys.executable, "-m", "chunkd", "cost", "--url", daemon.url, "--storage"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    assert "local/run-9" in shown.stdout


def _samples(ledger: Any, metric: str) -> dict[tuple[str, ...], float]:
    out = {}
    for family in ledger.collector().collect():
        for sample in family.samples:
            if sample.name == metric:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


@pytest.mark.timeout(10)
def test_labels_are_bounded_names_past_the_bound_are_other_and_an_ended_jobs_series_go() -> None:
    from chunkd.gateway.costs.ledger import Ledger
    from chunkd.gateway.jobs.table import JobTable

    now = [1000.0]
    jobs = JobTable(top=1, idle=60.0, tracked=2, clock=lambda: now[0], wall=lambda: now[0])
    ledger = Ledger(jobs, names=2, tracked=2, idle=60.0, clock=lambda: now[0])
    for name in ("d1", "d2", "d3"):
        ledger.charge("first", None, name, "bytes", "data", "read", 10)
    ledger.charge("second", None, "d1", "bytes", "data", "read", 5)  # past top: other
    ledger.charge(None, None, None, "bytes", "data", "read", 1)  # no job: none
    series = _samples(ledger, "chunkd_cost_backend_bytes_total")
    labels = {(dict(k)["train_job"], dict(k)["name"]) for k in series}
    # Two names are named; the third is other. The second job is other (top = 1).
    assert labels == {("first", "d1"), ("first", "d2"), ("first", "other"), ("other", "d1"),
                      ("none", "-")}  # fmt: skip
    # The first job ends (idle): its series go. Its names, idle too, are let go: their
    # series under other go with them; none's plain reads ("-") stay.
    now[0] += 120
    ledger.charge("third", None, "d9", "bytes", "data", "read", 3)
    series = _samples(ledger, "chunkd_cost_backend_bytes_total")
    assert {(dict(k)["train_job"], dict(k)["name"]) for k in series} == {
        ("third", "d9"),
        ("none", "-"),
    }
    # tracked = 2 jobs kept by name: the idle ones were let go to make room, and the
    # node's totals still count them.
    view = ledger.view()
    assert view["totals"]["backend_bytes"]["read"] == 30 + 5 + 1 + 3
    assert len([row for row in view["jobs"] if row["job"] not in ("none",)]) <= 2


@pytest.mark.timeout(30)
def test_without_chunkd_a_head_is_one_head_a_list_page_one_list_and_a_read_one_get(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    s3_server: S3Server,
    bucket: str,
    s3_proxy: CountingProxy,
) -> None:
    import urllib.request

    _put(s3_server, bucket, "a.bin", 1000)
    daemon = start_daemon(_toml(tmp_path, bucket, s3_proxy))
    job = {"X-Chunkd-Job": "lister"}
    head = urllib.request.Request(f"{daemon.url}/v1/objects/data/a.bin", headers=job, method="HEAD")
    with urllib.request.urlopen(head, timeout=10) as response:
        assert response.status == 200
    status, _, _ = daemon.get("/v1/list/data", job)
    assert status == 200
    status, _, _ = daemon.get("/v1/objects/data/a.bin", {**job, "Range": "bytes=10-109"})
    assert status == 206
    row = _job(_cost(daemon), "lister")
    assert row["direct_requests"] == {"get": 1, "head": 1, "list": 1}
    assert row["direct_bytes"] == 100


@pytest.mark.timeout(90)
def test_a_peers_backend_fetch_for_a_remote_reader_is_charged_to_that_readers_job(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    s3_server: S3Server,
    bucket: str,
    s3_proxy: CountingProxy,
) -> None:
    from tests.test_peers import start_cluster

    # 16 objects of one chunk each: the chance that node 0 owns all 16 is 1 in 65536
    # (placement is by rendezvous hashing of each chunk's locator)
    bodies = {f"shared-{i}.bin": os.urandom(MiB) for i in range(16)}
    size = sum(len(b) for b in bodies.values())
    for key, data in bodies.items():
        s3_server.client().put_object(Bucket=bucket, Key=f"pre/{key}", Body=data)
    nodes = start_cluster(start_daemon, tmp_path, bucket, s3_proxy, 2)
    with Client(nodes[0].cwd / "chunkd.sock", timeout=60, train_job="far-job") as client:
        for key, data in bodies.items():
            assert bytes(client.read(f"ckpt/{key}")) == data
    reader, owner = (_cost(node) for node in nodes)
    near = _job(reader, "far-job")
    far = _job(owner, "far-job")
    # The owner fetched its chunks for the reader's job (X-Chunkd-Job between peers);
    # each chunk came from the backend once, on one node or the other, for this job.
    assert far["backend_bytes"]["read"] > 0
    assert near["backend_bytes"]["read"] + far["backend_bytes"]["read"] == size
    assert all(
        row["backend_bytes"].get("read", 0) == 0 for row in owner["jobs"] if row["job"] == "none"
    )
    # The reader got those bytes from a peer, and is credited for them.
    assert near["served_bytes"]["peer"] == far["backend_bytes"]["read"]
    assert near["saved"]["peer"] > 0
    # A peer's request never starts its job on the owner: the owner's own trainers keep
    # their slots of the top K, and it charges the far job under `other`.
    assert far["label"] == "other"
    status, _, body = nodes[1].get("/v1/jobs?job=far-job")
    assert (status, json.loads(body)["jobs"]) == (200, [])


@pytest.mark.timeout(60)
def test_a_freeze_counts_the_bytes_it_uploads_as_written_for_the_job_that_asked(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    from tests.test_dataset_registry import FILES, commit, data_dir, snapshot_of, write_objects

    daemon = start_daemon(cwd=tmp_path / "node")
    with Client(daemon.cwd / "chunkd.sock", train_job="freezer") as client:
        write_objects(data_dir(daemon), FILES)
        snap = snapshot_of(client, sorted(FILES))
        commit(client, snap, "frz")
        report = client.request("ds_freeze", {"ref": "frz@1"}, timeout=120).header
    assert report["uploaded_bytes"] > 0
    row = _job(_cost(daemon), "freezer")
    assert row["written_bytes"]["freeze"] == report["uploaded_bytes"]
    assert row["backend_bytes"]["write"] >= report["uploaded_bytes"]


@pytest.mark.timeout(10)
def test_a_job_that_starts_again_as_other_moves_no_count_between_series() -> None:
    from chunkd.gateway.costs.ledger import Ledger
    from chunkd.gateway.jobs.table import JobTable

    now = [1000.0]
    jobs = JobTable(top=1, idle=60.0, clock=lambda: now[0], wall=lambda: now[0])
    ledger = Ledger(jobs, idle=60.0, clock=lambda: now[0])

    def by_job() -> dict[str, float]:
        out: dict[str, float] = {}
        for key, value in _samples(ledger, "chunkd_cost_backend_bytes_total").items():
            job = dict(key)["train_job"]
            out[job] = out.get(job, 0) + value
        return out

    ledger.charge("a", None, None, "bytes", "data", "read", 30)
    assert by_job() == {"a": 30}
    now[0] += 120  # a has ended
    ledger.charge("b", None, None, "bytes", "data", "read", 5)  # b takes the named slot
    ledger.charge("a", None, None, "bytes", "data", "read", 7)  # a again: other now
    # other grew by a's new bytes only; a's old series is gone with its end.
    assert by_job() == {"b": 5, "other": 7}
    assert ledger.view()["totals"]["backend_bytes"]["read"] == 42
    assert _job(ledger.view(), "a")["backend_bytes"]["read"] == 7


@pytest.mark.timeout(30)
def test_the_s3_front_charges_a_get_to_its_x_chunkd_job_and_refuses_a_bad_one(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    s3_server: S3Server,
    bucket: str,
    s3_proxy: CountingProxy,
) -> None:
    import urllib.error
    import urllib.request

    from chunkd.testing.ports import free_port

    body = _put(s3_server, bucket, "a.bin", 5000)
    front = free_port()
    toml = _toml(tmp_path, bucket, s3_proxy)
    section = f'[s3_front]\nlisten = "127.0.0.1:{front}"\nunsigned_from_loopback = true\n'
    toml = toml.replace("[cache]", section + "\n[cache]")
    daemon = start_daemon(toml)

    def get(job: str) -> tuple[int, bytes]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{front}/data/a.bin", headers={"X-Chunkd-Job": job}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    assert get("s3-job") == (200, body)
    row = _job(_cost(daemon), "s3-job")
    assert row["backend_bytes"]["read"] == 5000
    assert row["direct_requests"] == {"get": 1}
    status, answer = get("none")
    assert status == 400
    assert b"X-Chunkd-Job" in answer


@pytest.mark.timeout(30)
def test_a_readv_of_unkept_ranges_is_one_direct_get_a_range(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = start_daemon(cwd=tmp_path / "node")
    data = daemon.cwd / "chunkd-data"
    (data / "x.bin").write_bytes(os.urandom(100))
    (data / "y.bin").write_bytes(os.urandom(100))
    ranges = [["local/x.bin", 0, 10], ["local/y.bin", 5, 20]]
    with Client(daemon.cwd / "chunkd.sock", train_job="footers") as client:
        reply = client.request("readv", {"ranges": ranges, "keep": False})
        assert reply.header["answered"] == 2
    row = _job(_cost(daemon), "footers")
    assert row["direct_requests"] == {"get": 2}
    assert row["direct_bytes"] == 30
    assert row["served_bytes"]["backend"] == 30


@pytest.mark.timeout(30)
def test_a_local_stat_is_one_direct_head_and_a_list_page_one_direct_list(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = start_daemon(cwd=tmp_path / "node")
    (daemon.cwd / "chunkd-data" / "x.bin").write_bytes(os.urandom(100))
    with Client(daemon.cwd / "chunkd.sock", train_job="stat-list") as client:
        assert client.stat("local/x.bin").size == 100
        assert len(client.ls("local/")) == 1
    row = _job(_cost(daemon), "stat-list")
    assert row["direct_requests"] == {"head": 1, "list": 1}


@pytest.mark.timeout(10)
def test_the_ledger_stays_bounded_however_many_jobs_come_and_go() -> None:
    from chunkd.gateway.costs.ledger import Ledger
    from chunkd.gateway.jobs.table import JobTable

    now = [1000.0]
    jobs = JobTable(top=2, idle=60.0, tracked=4, clock=lambda: now[0], wall=lambda: now[0])
    ledger = Ledger(jobs, names=2, tracked=4, idle=60.0, clock=lambda: now[0])

    def run(count: int) -> int:
        for i in range(count):
            ledger.charge(f"job-{i}", None, f"data-{i}", "bytes", "data", "read", 1)
            now[0] += 61  # each job ends before the next starts
        ledger.tick()
        return len(json.dumps(ledger.state()))

    small = run(10)
    large = run(200)
    assert large <= small * 1.5
    assert ledger.view()["totals"]["backend_bytes"]["read"] == 210


@pytest.mark.timeout(30)
def test_the_daemon_takes_jobs_top_and_the_cost_default_table_from_its_config(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    s3_server: S3Server,
    bucket: str,
    s3_proxy: CountingProxy,
) -> None:
    size = MiB
    _put(s3_server, bucket, "a.bin", size)
    _put(s3_server, bucket, "b.bin", size)
    toml = _toml(tmp_path, bucket, s3_proxy).replace(
        "[cache]", '[jobs]\ntop = 1\n\n[cost]\ndefault = "example-gcs-internet"\n\n[cache]'
    )
    daemon = start_daemon(toml)
    _read(daemon, "a.bin", "job-1")
    _read(daemon, "b.bin", "job-2")  # past top = 1: other
    view = _cost(daemon)
    assert _job(view, "job-1")["label"] == "job-1"
    assert _job(view, "job-2")["label"] == "other"
    assert daemon.metric("chunkd_cost_backend_bytes_total", train_job="job-2") == 0
    assert daemon.metric("chunkd_cost_backend_bytes_total", train_job="other") == size
    # Priced by [cost] default: example-gcs-internet's 0.12 per GB out.
    egress = daemon.metric("chunkd_cost_dollars_total", train_job="job-1", item="egress")
    assert egress == pytest.approx(size / (1 << 30) * 0.12)


@pytest.mark.timeout(10)
def test_a_view_without_names_has_the_same_figures_and_follows_each_charge_and_let_go() -> None:
    from chunkd.gateway.costs.ledger import Ledger
    from chunkd.gateway.jobs.table import JobTable

    now = [1000.0]
    jobs = JobTable(top=4, idle=600.0, clock=lambda: now[0], wall=lambda: now[0])
    ledger = Ledger(jobs, names=8, idle=60.0, clock=lambda: now[0])
    ledger.charge("a", None, "d1", "bytes", "data", "read", 10)
    ledger.charge("b", None, "d2", "served", "ram", 4, "data", 4)
    full, light = ledger.view(), ledger.view(names=False)
    assert all("names" not in row for row in light["jobs"])
    assert [{k: v for k, v in row.items() if k != "names"} for row in full["jobs"]] == light["jobs"]
    assert full["totals"] == light["totals"]
    # A charge after a view is in the next one (the rows' sums are kept between views).
    ledger.charge("a", None, "d1", "bytes", "data", "read", 5)
    assert _job(ledger.view(names=False), "a")["backend_bytes"]["read"] == 15
    # d2, idle, is let go when a new name comes: its series end, but b's row keeps
    # counting it (carried), though nothing was charged to b since the view before.
    assert _job(ledger.view(names=False), "b")["served_bytes"]["ram"] == 4
    now[0] += 70
    ledger.charge("a", None, "d3", "bytes", "data", "read", 1)
    assert _job(ledger.view(names=False), "b")["served_bytes"]["ram"] == 4
    assert [n["name"] for n in _job(ledger.view(), "b")["names"]] == ["d2"]
    assert ledger.view(names=False)["totals"]["served_bytes"]["ram"] == 4


def _storage(daemon: Daemon) -> dict[str, Any]:
    status, _, body = daemon.get("/v1/cost/storage")
    assert status == 200, body
    storage: dict[str, Any] = json.loads(body)
    return storage


@pytest.mark.timeout(60)
def test_storage_counts_each_frozen_snapshots_chunks_once_and_its_own_apart_from_shared(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    from tests.test_dataset_registry import commit, data_dir, snapshot_of, write_objects

    # the registry's backend (local) priced like S3, so that a month costs something
    daemon = start_daemon(
        cwd=tmp_path / "node", env={"CHUNKD_BACKENDS_LOCAL_PRICE": "example-s3-in-region"}
    )
    shared, first, second = os.urandom(2 * MiB + 48), os.urandom(160), os.urandom(MiB)
    files = {"data/shared.bin": shared, "data/again.bin": shared,  # same bytes: same chunks
             "data/first.bin": first, "data/second.bin": second}  # fmt: skip
    with Client(daemon.cwd / "chunkd.sock") as client:
        write_objects(data_dir(daemon), files)
        one = snapshot_of(client, ["data/again.bin", "data/first.bin", "data/shared.bin"])
        two = snapshot_of(client, ["data/second.bin", "data/shared.bin"])
        commit(client, one, "kept")
        commit(client, two, "kept")
        for ref in ("kept@1", "kept@2"):
            client.request("ds_freeze", {"ref": ref}, timeout=120)
    snapshots = _storage(daemon)["snapshots"]
    assert snapshots["backend"] == "local"
    assert snapshots["truncated"] is False
    rows = {row["id"]: row for row in snapshots["snapshots"]}
    assert set(rows) == {one.id, two.id}
    # each snapshot: each chunk once (again.bin's chunks are shared.bin's)
    assert rows[one.id]["stored_bytes"] == len(shared) + len(first)
    assert rows[two.id]["stored_bytes"] == len(shared) + len(second)
    # its own: the chunks no other snapshot names
    assert rows[one.id]["own_bytes"] == len(first)
    assert rows[two.id]["own_bytes"] == len(second)
    assert all(row["complete"] for row in rows.values())
    # overall: each chunk once over every snapshot
    assert snapshots["stored_bytes"] == len(shared) + len(first) + len(second)
    month = 0.023 / (1 << 30)  # example-s3-in-region's storage_per_gb_month, GB = 2^30
    assert snapshots["per_month"] == pytest.approx(snapshots["stored_bytes"] * month)
    assert rows[one.id]["own_per_month"] == pytest.approx(len(first) * month)
    storage = _storage(daemon)
    assert storage["stored_bytes"] == snapshots["stored_bytes"] + sum(
        row["stored_bytes"] for row in storage["checkpoints"]
    )
    shown = subprocess.run(
        [sys.executable, "-m", "chunkd", "cost", "--url", daemon.url, "--storage"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    assert f"frozen {one.id[:12]}" in shown.stdout
    assert f"frozen {two.id[:12]}" in shown.stdout
    assert "frozen snapshots, each chunk once" in shown.stdout
    assert "gc would reclaim: unknown (no chunkd gc ran on this node)" in shown.stdout
    # a record whose snapshot is not registered: its row says why, the rest are counted
    planted = "0" * 64
    (data_dir(daemon) / "datasets" / "frozen" / f"{planted}.json").write_text("{}")
    rows = {row["id"]: row for row in _storage(daemon)["snapshots"]["snapshots"]}
    assert rows[planted]["stored_bytes"] == 0
    assert planted in rows[planted]["error"]
    assert rows[planted]["complete"] is False
    assert rows[one.id]["stored_bytes"] == len(shared) + len(first)


@pytest.mark.timeout(10)
def test_the_ledger_keeps_the_latest_gc_of_each_backend_across_a_restart(tmp_path: Path) -> None:
    import asyncio

    from chunkd.gateway.costs.ledger import Ledger
    from chunkd.gateway.jobs.table import JobTable

    now = [1000.0]
    path = tmp_path / "cost.json"
    ledger = Ledger(JobTable(), state_path=path, clock=lambda: now[0])
    ledger.note_gc("local", {"target": "local/runs", "dry_run": True, "freed_bytes": 7, "swept": 1})
    now[0] += 5
    ledger.note_gc("s3", {"target": "s3", "dry_run": True, "freed_bytes": 3, "swept": 1})
    now[0] += 5  # a later run of local replaces its report
    ledger.note_gc("local", {"target": "local", "dry_run": False, "freed_bytes": 9, "swept": 2,
                             "retired_count": 1})  # fmt: skip
    asyncio.run(ledger.save())
    again = Ledger(JobTable(), state_path=path, clock=lambda: now[0])
    reports = again.gc_reports()
    assert reports == ledger.gc_reports()
    assert [(r["backend"], r["at"], r["dry_run"], r["bytes"], r["chunks"], r["retired"])
            for r in reports] == [("local", 1010.0, False, 9, 2, 1),
                                  ("s3", 1005.0, True, 3, 1, 0)]  # fmt: skip


@pytest.mark.timeout(60)
def test_storage_says_what_the_latest_gc_dry_run_would_reclaim_and_when_it_ran(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    import time

    import blake3

    from chunkd.client import checkpoint as ckpt

    daemon = start_daemon(cwd=tmp_path / "node")  # the embedded default: local, a file backend
    assert _storage(daemon)["gc_reclaimable"] is None  # no gc ran on this node
    # garbage: chunks no checkpoint, snapshot or intent names, written an hour ago
    chunks = daemon.cwd / "chunkd-data" / "chunks"
    chunks.mkdir(parents=True, exist_ok=True)
    garbage = [os.urandom(size) for size in (1000, 2000, 3000)]
    for data in garbage:
        path = chunks / blake3.blake3(data).hexdigest()
        path.write_bytes(data)
        os.utime(path, (time.time() - 3600,) * 2)
    before = time.time()
    with Client(daemon.cwd / "chunkd.sock") as client:
        report = ckpt.gc("local", grace=60, dry_run=True, client=client)
    assert report["freed_bytes"] == 6000
    reclaimable = _storage(daemon)["gc_reclaimable"]
    (row,) = reclaimable["backends"]
    assert row["backend"] == "local"
    assert row["dry_run"] is True
    assert row["bytes"] == 6000
    assert row["chunks"] == 3
    assert before <= row["at"] <= time.time()
    assert reclaimable["reclaimable_bytes"] == 6000
    shown = subprocess.run(
        [sys.executable, "-m", "chunkd", "cost", "--url", daemon.url, "--storage"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert "gc local would reclaim 5.9 KiB (3 chunks; dry run at " in shown.stdout, shown.stdout
    # a real run afterwards: it deleted them; nothing is left to reclaim as of then
    with Client(daemon.cwd / "chunkd.sock") as client:
        done = ckpt.gc("local", grace=60, client=client)
    assert done["freed_bytes"] == 6000
    reclaimable = _storage(daemon)["gc_reclaimable"]
    assert reclaimable["backends"][0]["dry_run"] is False
    assert reclaimable["backends"][0]["bytes"] == 6000
    assert reclaimable["reclaimable_bytes"] == 0
