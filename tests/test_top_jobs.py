"""``chunkd top``'s jobs and cost panels (issue 30): the same figures as the page, from
the same samples, in ``--once``, ``--json`` and the live view (tmux), against a real
daemon that a real client told about its job (see tests/test_dashboard_jobs.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chunkd.client import Client
from chunkd.gateway.cli.options import human_size
from chunkd.gateway.cli.toppanels import money

from .conftest import BIN, Daemon
from .test_dashboard_jobs import CALM, FIRST_BATCH, JOB, node_toml, run_jobs, v1
from .test_top import Pane, needs_tmux, terminal  # noqa: F401 (the fixture)

CHUNKD = BIN / "chunkd"


def _settled(daemon: Daemon) -> dict[str, Any]:
    """The daemon's newest sample once it shows what ``/v1/jobs`` and ``/v1/cost`` say
    now (the work is done: the figures no longer move)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        history = v1(daemon, "/v1/dashboard")["history"]
        if history:
            sample = history[-1]
            cost = v1(daemon, "/v1/cost")
            names = [j["name"] for j in sample["jobs"]]
            if names == [JOB, CALM] and sample["cost"]["totals"] == with_sums(cost["totals"]):
                return sample
        time.sleep(0.3)
    raise AssertionError("no sample showed the jobs and the ledger as they are")


def with_sums(totals: dict[str, Any]) -> dict[str, Any]:
    """The ledger's totals as a sample carries them: with the sums the views show (the
    telemetry makes them; a view adds nothing up)."""
    return totals | {
        "written_total": sum(totals["written_bytes"].values()),
        "backend_requests_total": sum(totals["backend_requests"].values()),
    }


def _top(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "160"}  # a wide page: no line cut short
    return subprocess.run(
        [str(CHUNKD), "top", *args, "--url", daemon.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


@pytest.mark.timeout(60)
def test_once_and_json_show_the_jobs_and_the_cost(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = start_daemon(node_toml(tmp_path))
    run_jobs(daemon)
    # a first batch without its total: the sample's total is its phases added up
    with Client(daemon.cwd / "chunkd.sock", train_job=CALM) as calm:
        calm.request("ds_first_batch", {"metadata": 0.25, "decode": 0.5, "rank": 0})
    _settled(daemon)
    job = next(j for j in v1(daemon, "/v1/jobs")["jobs"] if j["name"] == JOB)
    ledger = v1(daemon, "/v1/cost")
    totals = ledger["totals"]

    done = _top(daemon, "--json")
    assert done.returncode == 0, done.stderr
    sample = json.loads(done.stdout)
    # the daemon's own figures, as they are
    shown = sample["jobs"][0]
    assert shown["name"] == JOB
    assert shown["stall"] == job["stall"]
    assert shown["worst_ranks"] == job["worst_ranks"]
    assert shown["first_batch"] == job["first_batch"]
    assert shown["served_bytes"]["backend"] == 3 << 20
    assert sample["jobs_total"] == 2
    assert sample["cost"]["totals"] == with_sums(totals)
    calm = next(j for j in sample["jobs"] if j["name"] == CALM)
    assert calm["first_batch"]["total"] == 0.75
    assert sample["cost"]["currency"] == "USD"
    assert [j["job"] for j in sample["cost"]["jobs"]][:1] == [JOB]

    done = _top(daemon, "--once")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert re.search(r"^─* ?jobs ?─*$", out, re.MULTILINE), out
    line = next(line for line in out.splitlines() if line.startswith(JOB))
    assert re.search(rf"stall +{job['stall'] * 100:.1f}%", line), line
    assert "4/4 ranks" in line
    worst = ", ".join(f"{r['rank']} {r['stall'] * 100:.1f}%" for r in job["worst_ranks"])
    # worst ranks, then the bytes by source, under the job's line
    assert f"worst {worst};" in out
    # the first batch by phase, under the job's line
    assert "first batch 1.90s: metadata 100ms worker start 1.20s first chunk 400ms" in out
    assert "decode 200ms (rank 3)" in out
    assert set(FIRST_BATCH) == {"metadata", "worker_start", "first_chunk", "decode"}
    # the cost: the ledger's figures, written as the page writes them
    assert f"spent {money(totals['spent'], 'USD')}," in out
    assert f"without chunkd {money(totals['direct'], 'USD')};" in out
    assert f"saved by cache {money(totals['saved']['cache'], 'USD')}," in out
    # the page's words for the backend's figures, with the sample's sums
    requests = sum(totals["backend_requests"].values())
    assert requests > 0
    assert f"backend requests {requests}," in out
    assert f"backend bytes read {human_size(totals['backend_bytes']['read'])}," in out
    assert f"bytes written {human_size(0)}" in out
    assert "first batch 750ms:" in out  # CALM's: the sample's total, as it is
    spent = next(j for j in ledger["jobs"] if j["job"] == JOB)["spent"]
    assert re.search(rf"^{re.escape(JOB)}\s+spent {re.escape(money(spent, 'USD'))}", out, re.M)


@needs_tmux
@pytest.mark.timeout(60)
def test_the_live_view_shows_the_jobs_and_cost_panels(
    start_daemon: Callable[..., Daemon],
    terminal: Callable[..., Pane],  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    daemon = start_daemon(node_toml(tmp_path))
    run_jobs(daemon)
    sample = _settled(daemon)
    stall = rf"stall +{sample['jobs'][0]['stall'] * 100:.1f}%"
    spent = money(sample["cost"]["totals"]["spent"], "USD")
    pane = terminal(f"{CHUNKD} top --url {daemon.url}", 120, 40)
    screen = pane.wait_for(r"\blive\b", r"─jobs─", r"─cost─", re.escape(JOB), stall)
    assert f"spent {spent}" in screen, screen
    assert re.search(rf"{re.escape(CALM)}\s+stall", screen), screen
    lines = screen.splitlines()
    assert len(lines) <= 40
    assert all(len(line) <= 120 for line in lines)
    pane.keys("q")
    assert pane.exit_status() == 0
