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
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from chunkd.testing import CountingProxy, S3Server, s3_backend
from chunkd.testing.ports import BIN
from chunkd.testing.prometheus import PrometheusServer, prometheus_or_skip
from tests.conftest import Daemon

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


def chunkd_cost(*args: str) -> str:
    """``chunkd cost ARGS`` as a user runs it; its output (it must exit 0)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    done = subprocess.run(
        [str(BIN / "chunkd"), "cost", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
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
    assert all(answer["storage"] == alone["storage"] for answer in answers)
