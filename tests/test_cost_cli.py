"""``chunkd cost``'s sources: ``--prometheus`` (the cluster's figures from a real
Prometheus scraping a real daemon with more jobs than the table shows) and ``GET
/v1/cost/storage`` (``--storage``), which callers at once share.

The totals are Prometheus's ``sum`` over every series (not the rows added up, nor a
cut of the series), the rows the 200 jobs that spent most (``topk``), ``--job J``
asks Prometheus for that job's series only, and the table says what the figures
cover without ``--since`` (the live series as they stand).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from chunkd.testing import CountingProxy, S3Server, s3_backend
from chunkd.testing.ports import BIN, free_port
from chunkd.testing.prometheus import PrometheusServer, prometheus_or_skip
from tests.conftest import Daemon

#: the Grafana dashboard shipped in deploy/
DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "chunkd.json"

#: jobs that each read the object once: more series of one figure than the CLI used to
#: keep (200 x 8) before it summed them
JOBS = 1700
SIZE = 4096


def _toml(tmp_path: Path, data: Path) -> str:
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

[jobs]
top = 2048
tracked = 2048

[[backends]]
name = "data"
url = "file://{data}"
price = "example-s3-internet"
"""


def run_cost(*args: str) -> subprocess.CompletedProcess[str]:
    """``chunkd cost ARGS`` as a user runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    return subprocess.run(
        [str(BIN / "chunkd"), "cost", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def chunkd_cost(*args: str) -> str:
    """``chunkd cost ARGS`` as a user runs it; its output (it must exit 0)."""
    done = run_cost(*args)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.timeout(120)
def test_prometheus_totals_are_sums_rows_are_the_top_and_job_is_asked_for(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    prometheus_or_skip()
    data = tmp_path / "data"
    data.mkdir()
    (data / "obj").write_bytes(os.urandom(SIZE))
    daemon = start_daemon(_toml(tmp_path, data))

    def read(i: int) -> None:
        request = urllib.request.Request(
            f"{daemon.url}/v1/objects/data/obj", headers={"X-Chunkd-Job": f"job-{i:04d}"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert len(response.read()) == SIZE

    read(0)  # job-0000's read fetches from the backend: it spends most
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(read, range(1, JOBS)))
    status, _, body = daemon.get("/v1/cost")
    assert status == 200
    truth = json.loads(body)
    served = truth["totals"]["served_bytes"]
    assert sum(served.values()) == JOBS * SIZE, served

    server = PrometheusServer([f"127.0.0.1:{daemon.port}"], tmp_path / "prometheus")
    with server:
        server.wait_for(
            "count(chunkd_cost_served_bytes_total)", lambda r: bool(r) and
            float(r[0]["value"][1]) >= JOBS, timeout=30,
        )  # fmt: skip
        # and each job's money series (a job's dollars come once its row is summed)
        server.wait_for(
            "count(chunkd_cost_direct_dollars_total)", lambda r: bool(r) and
            float(r[0]["value"][1]) >= JOBS, timeout=30,
        )  # fmt: skip
        asked = json.loads(chunkd_cost("--prometheus", server.url, "--json"))
        # the totals: every job's, however many series
        totals = asked["totals"]
        assert sum(totals["served_bytes"].values()) == JOBS * SIZE, totals
        assert totals["direct"] == pytest.approx(truth["totals"]["direct"], rel=1e-9)
        assert totals["spent"] == pytest.approx(truth["totals"]["spent"], rel=1e-9)
        # the rows: the 200 that spent most (spent + without chunkd), biggest first
        rows = asked["jobs"]
        assert len(rows) == min(200, JOBS)
        money = [row["spent"] + row["direct"] for row in rows]
        assert money == sorted(money, reverse=True)
        assert rows[0]["job"] == "job-0000"  # the one whose read went to the backend
        assert "live series as they stand" in asked["covers"]
        # --job: that job's figures, whichever it is, and the totals are its own
        for job in ("job-0000", f"job-{JOBS // 2:04d}", f"job-{JOBS - 1:04d}"):
            mine = json.loads(chunkd_cost("--prometheus", server.url, "--job", job, "--json"))
            assert [row["job"] for row in mine["jobs"]] == [job]
            assert sum(mine["totals"]["served_bytes"].values()) == SIZE, mine
            assert sum(mine["jobs"][0]["served_bytes"].values()) == SIZE
        assert (
            json.loads(chunkd_cost("--prometheus", server.url, "--job", "nobody", "--json"))["jobs"]
            == []
        )
        # the table says what the figures cover
        table = chunkd_cost("--prometheus", server.url)
        head = table.splitlines()[0]
        assert "live series as they stand" in head, table
        assert "since it started" in head, table
        assert sum(1 for line in table.splitlines() if line.startswith("job-")) == min(200, JOBS)


@pytest.mark.timeout(60)
def test_storage_callers_at_once_share_one_computation(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    s3_server: S3Server,
    bucket: str,
    s3_proxy: CountingProxy,
) -> None:
    backend = s3_backend("data", f"s3://{bucket}/pre", s3_proxy.endpoint, writable=True)
    daemon = start_daemon(f"""
[cache]
dir = "{tmp_path / "cache"}"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
fsync = "never"

{backend}""")

    def requests() -> float:
        return daemon.metric("chunkd_backend_requests_total", backend="data")

    def storage() -> dict[str, object]:
        status, _, body = daemon.get("/v1/cost/storage")
        assert status == 200, body
        answer: dict[str, object] = json.loads(body)
        return answer

    before = requests()
    alone = storage()
    one = requests() - before
    assert one > 0  # one computation lists the checkpoints' catalog in the backend
    # a slow backend: each computation takes a while, and 8 callers come meanwhile
    s3_proxy.delay = 1.0
    before = requests()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: storage(), range(8)))
    assert requests() - before == one  # one computation for the 8 (8 x one without)
    assert all(answer == alone for answer in answers)


#: a daemon whose backend is writable (checkpoints) and priced by a EUR table
WRITABLE = """
[server]
readahead_chunks = 0

[cache]
dir = "{cache}"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
chunk_bytes = "1MiB"
fsync = "never"

[cost]
default = "eur"

[cost.eur]
egress_per_gb = 0.08
get_per_1000 = 0.0004
put_per_1000 = 0.005
storage_per_gb_month = 0.02
currency = "EUR"

[[backends]]
name = "data"
url = "file://{data}"
writable = true
price = "eur"
"""


def _writable(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Daemon:
    data = tmp_path / "data"
    data.mkdir()
    (data / "obj").write_bytes(os.urandom(SIZE))
    return start_daemon(WRITABLE.format(cache=tmp_path / "cache", data=data))


def _get_object(daemon: Daemon, job: str) -> None:
    status, _, body = daemon.get("/v1/objects/data/obj", {"X-Chunkd-Job": job})
    assert status == 200, body[:200]
    assert len(body) == SIZE


def _save(daemon: Daemon) -> None:
    """A checkpoint saved by a trainer that names no job (the ``none`` row)."""
    import numpy as np

    from chunkd.client import Client
    from chunkd.client import checkpoint as ckpt

    with Client(daemon.cwd / "chunkd.sock") as client:
        ckpt.save({"w": np.arange(4096, dtype=np.int64)}, "data/run-1/10", client=client)


@pytest.mark.timeout(60)
def test_a_bad_job_is_a_400_and_the_cli_says_the_daemons_message(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = _writable(start_daemon, tmp_path)
    _get_object(daemon, "run-1")
    status, _, body = daemon.get("/v1/cost?job=bad%20name")
    assert status == 400, body
    refused = json.loads(body)
    assert refused["error"] == "InvalidRequestError", refused
    status, _, body = daemon.get("/v1/cost?job=" + "a" * 129)
    assert status == 400, body
    # none and other are the ledger's own rows: asked for, they answer
    for reserved in ("none", "other"):
        status, _, body = daemon.get(f"/v1/cost?job={reserved}")
        assert status == 200, body
        assert all(row["job"] == reserved for row in json.loads(body)["jobs"])
    status, _, body = daemon.get("/v1/cost?job=run-1")
    assert [row["job"] for row in json.loads(body)["jobs"]] == ["run-1"]
    # the CLI: the daemon's own message, exit 2 (not "is the daemon running?")
    done = run_cost("--url", daemon.url, "--job", "bad name")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert refused["message"][:60] in " ".join(done.stderr.split()), done.stderr
    assert "HTTP 400" in done.stderr, done.stderr
    assert "daemon running" not in done.stderr, done.stderr
    assert done.stdout == ""
    # a refusal (here the daemon's 403 to a request a page of another site sent) says
    # what the cost routes want, not "is the daemon running?"
    from chunkd.gateway.cli.cost import _refusal

    request = urllib.request.Request(
        f"{daemon.url}/v1/cost", headers={"Sec-Fetch-Site": "cross-site"}
    )
    with pytest.raises(urllib.error.HTTPError) as refused_403:
        urllib.request.urlopen(request, timeout=30)
    said = _refusal(refused_403.value)
    assert "HTTP 403" in said, said
    assert "another site" in said, said  # the daemon's own message
    assert "server.token" in said, said
    assert "ssh -L" in said, said


@pytest.mark.timeout(60)
def test_cost_storage_answers_the_storage_object_and_the_cli_asks_both_routes(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = _writable(start_daemon, tmp_path)
    _save(daemon)
    _get_object(daemon, "run-1")
    status, _, body = daemon.get("/v1/cost/storage")
    assert status == 200, body
    storage = json.loads(body)
    # the storage object itself, as docs/jobs.md shows it (no ledger around it)
    assert "jobs" not in storage, storage
    assert "totals" not in storage, storage
    assert storage["currency"] == "EUR"
    assert [row["name"] for row in storage["checkpoints"]] == ["data/run-1"]
    assert storage["stored_bytes"] >= 4096 * 8
    # --storage: the ledger (of the job asked) and the storage, from the two routes
    both = json.loads(chunkd_cost("--url", daemon.url, "--storage", "--job", "run-1", "--json"))
    assert [row["job"] for row in both["jobs"]] == ["run-1"]
    assert both["storage"] == storage
    table = chunkd_cost("--url", daemon.url, "--storage")
    for shown in ("run-1 ", "data/run-1", "kept in all"):
        assert shown in table, table
    # the storage is one node's catalog: not with --prometheus
    done = run_cost("--url", daemon.url, "--prometheus", daemon.url, "--storage")
    assert done.returncode == 2, done.stderr
    assert "--storage" in done.stderr
    assert "--prometheus" in done.stderr
    assert done.stdout == ""


@pytest.mark.timeout(90)
def test_prometheus_json_has_the_ledgers_figures_its_currency_and_grafana_lists_every_job(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    prometheus_or_skip()
    daemon = _writable(start_daemon, tmp_path)
    _save(daemon)  # none: a checkpoint's writes, no read, no loader report
    for job in ("reader-a", "reader-b"):
        _get_object(daemon, job)
    _status, _, body = daemon.get("/v1/cost")
    truth = json.loads(body)["totals"]
    assert truth["written_bytes"]["checkpoint"] > 0
    assert truth["direct_bytes"] == 2 * SIZE
    server = PrometheusServer([f"127.0.0.1:{daemon.port}"], tmp_path / "prometheus")
    with server:
        server.wait_for(
            "sum(chunkd_cost_direct_bytes_total) + sum(chunkd_cost_written_bytes_total)",
            lambda r: (
                bool(r)
                and float(r[0]["value"][1])
                >= truth["direct_bytes"] + sum(truth["written_bytes"].values())
            ),
            timeout=30,
        )
        # the GET /v1/cost keys Prometheus has, equal to the daemon's; its currency
        asked = json.loads(chunkd_cost("--prometheus", server.url, "--url", daemon.url, "--json"))
        for key in ("written_bytes", "direct_requests", "direct_bytes", "backend_requests"):
            assert asked["totals"][key] == truth[key], (key, asked["totals"], truth)
        reader = next(row for row in asked["jobs"] if row["job"] == "reader-a")
        assert reader["direct_requests"] == {"get": 1}
        assert reader["direct_bytes"] == SIZE
        assert (asked["currency"], asked["currency_assumed"]) == ("EUR", False)
        # no daemon to ask: USD assumed, and the table says so; --currency wins
        nowhere = f"http://127.0.0.1:{free_port()}"
        assumed = json.loads(chunkd_cost("--prometheus", server.url, "--url", nowhere, "--json"))
        assert (assumed["currency"], assumed["currency_assumed"]) == ("USD", True)
        table = chunkd_cost("--prometheus", server.url, "--url", nowhere)
        assert "USD assumed" in table, table
        given = json.loads(
            chunkd_cost("--prometheus", server.url, "--url", nowhere, "--currency", "GBP", "--json")
        )
        assert (given["currency"], given["currency_assumed"]) == ("GBP", False)
        # Grafana's train_job variable: every job with a cost series, none's checkpoint
        # writes (no served bytes, no loader series) included
        dashboard = json.loads(DASHBOARD.read_text())
        variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "train_job")
        found = re.fullmatch(r"label_values\((.+), train_job\)", variable["definition"])
        assert found, variable
        listed = set(server.api("label/train_job/values", **{"match[]": found.group(1)}))
        assert listed >= {"reader-a", "reader-b", "none"}, listed
