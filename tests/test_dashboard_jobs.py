"""The dashboard's jobs view and cost panel (issue 30) in a real headless Chromium
against a real daemon.

A real client says hello with a ``train_job``, reports its ranks' waits
(``loader_report``) and its slowest rank's first batch (``ds_first_batch``) and reads
an object through the local socket. What a person relies on: the jobs view shows the
job with the stall, worst ranks and first-batch phases the daemon's own ``/v1/jobs``
says; ``/#jobs=NAME`` selects it (a name's URL characters survive the trip) and a
crafted link's markup stays text; the cost panel shows the figures ``/v1/cost`` says,
exactly. ``CHUNKD_SCREENSHOTS=1`` also takes docs/images/jobs.png and cost.png.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from chunkd.client import Client
from chunkd.client.protocol import LOADER_BUCKETS
from chunkd.testing.browser import chromium, chromium_missing
from tests.conftest import Daemon, small_node_toml

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

pytestmark = pytest.mark.skipif(
    chromium_missing() is not None, reason=chromium_missing() or "chromium is available"
)

WAIT_MS = 30_000
IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"
#: a job name with the characters a URL treats apart (JOB_NAME allows them)
JOB = "team/run+7:a@b"
#: a second job, that waits less
CALM = "calm-job"
#: each rank's (steps, seconds waited, seconds of steps, longest wait) in one window:
#: rank 3 waits most, rank 0 least
RANKS = {
    0: (20, 0.4, 20.0, 0.05),
    1: (20, 1.0, 20.0, 0.1),
    2: (20, 2.0, 20.0, 0.3),
    3: (20, 6.0, 20.0, 0.9),
}
#: rank 3's loader's time to its first batch, by phase
FIRST_BATCH = {"metadata": 0.1, "worker_start": 1.2, "first_chunk": 0.4, "decode": 0.2}
OBJECT = "train/shard-0.bin"
OBJECT_BYTES = 3 << 20


def node_toml(root: Path) -> str:
    """A node with one file backend ``data`` priced as an internet S3 (egress and GET
    fees are not zero, so every cost figure is)."""
    toml = small_node_toml(root / "cache", ("data", root / "data"))
    return toml + 'price = "example-s3-internet"\n'


def _buckets(steps: int, each: float) -> list[int]:
    """Bucket counts over LOADER_BUCKETS (and +Inf) of ``steps`` that each took ``each``."""
    counts = [0] * (len(LOADER_BUCKETS) + 1)
    index = next(
        (i for i, bound in enumerate(LOADER_BUCKETS) if each <= bound), len(LOADER_BUCKETS)
    )
    counts[index] = steps
    return counts


def report(
    client: Client,
    rank: int,
    world_size: int,
    window: tuple[int, float, float, float],
    job: str | None = None,
) -> dict[str, Any]:
    """One ``loader_report`` of ``rank``, as the client's stall meter sends it."""
    steps, wait, step, wait_max = window
    fields: dict[str, Any] = {
        "rank": rank,
        "world_size": world_size,
        "steps": steps,
        "wait": wait,
        "step": step,
        "wait_max": wait_max,
        "wait_buckets": _buckets(steps, wait / steps),
        "step_buckets": _buckets(steps, step / steps),
    }
    if job is not None:
        fields["train_job"] = job
    return dict(client.request("loader_report", fields).header)


def run_jobs(daemon: Daemon) -> None:
    """Two jobs on the node: ``JOB`` (four ranks, rank 3 waits most, a first batch,
    an object read twice) and ``CALM`` (one rank that hardly waits)."""
    data = daemon.cwd / "data"
    (data / OBJECT).parent.mkdir(parents=True, exist_ok=True)
    (data / OBJECT).write_bytes(os.urandom(OBJECT_BYTES))
    with Client(daemon.cwd / "chunkd.sock", train_job=JOB) as client:
        for rank, window in RANKS.items():
            assert report(client, rank, len(RANKS), window)["train_job"] == JOB
        client.request("ds_first_batch", {**FIRST_BATCH, "total": 1.9, "rank": 3})
        assert len(bytes(client.read("data/" + OBJECT))) == OBJECT_BYTES  # the backend's
    with Client(daemon.cwd / "chunkd.sock", train_job=JOB) as again:  # the cache's
        assert len(bytes(again.read("data/" + OBJECT))) == OBJECT_BYTES
    with Client(daemon.cwd / "chunkd.sock", train_job=CALM) as calm:
        report(calm, 0, 1, (10, 0.01, 10.0, 0.002))


@contextlib.contextmanager
def _reading(daemon: Daemon, job: str) -> Iterator[None]:
    """``job`` reads the object over and over, each time as a new client (a client
    keeps what it mapped), in a thread, until the block ends."""
    stop = threading.Event()
    failures: list[BaseException] = []

    def read() -> None:
        while not stop.is_set():
            try:
                with Client(daemon.cwd / "chunkd.sock", train_job=job) as client:
                    assert len(bytes(client.read("data/" + OBJECT))) == OBJECT_BYTES
            except BaseException as exc:
                failures.append(exc)
                return
            stop.wait(0.05)

    thread = threading.Thread(target=read, name="job-reader", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not failures, failures


def v1(daemon: Daemon, path: str) -> dict[str, Any]:
    status, _, body = daemon.get(path)
    assert status == 200, (path, status, body[:300])
    found: dict[str, Any] = json.loads(body)
    return found


def job_view(daemon: Daemon, name: str) -> dict[str, Any]:
    """The job ``name`` as ``GET /v1/jobs`` shows it."""
    return next(j for j in v1(daemon, "/v1/jobs")["jobs"] if j["name"] == name)


def percent(value: float) -> str:
    """A ratio as the page writes it."""
    return f"{value * 100:.1f} %"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as started:
        yield started


def _open(
    browser: Browser, daemon: Daemon, hash_: str = "", width: int = 1280
) -> tuple[Page, list[str]]:
    context = browser.new_context(viewport={"width": width, "height": 900}, timezone_id="UTC")
    page = context.new_page()
    problems: list[str] = []
    page.on(
        "console",
        lambda m: (
            problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None
        ),
    )
    page.on("pageerror", lambda error: problems.append(f"uncaught: {error}"))
    page.on("dialog", lambda dialog: problems.append(f"dialog: {dialog.message}"))
    response = page.goto(f"{daemon.url}/{hash_}")
    assert response is not None
    assert response.status == 200
    assert "script-src 'self'" in response.headers.get("content-security-policy", "")
    return page, problems


def _expect() -> Callable[..., Any]:
    from playwright.sync_api import expect

    return expect


@pytest.mark.timeout(90)
def test_the_jobs_view_shows_each_jobs_stall_worst_ranks_and_first_batch(
    start_daemon: Callable[..., Daemon], browser: Browser, tmp_path: Path
) -> None:
    daemon = start_daemon(node_toml(tmp_path))
    run_jobs(daemon)
    job = job_view(daemon, JOB)
    # the daemon's own figures, which the page must show as they are
    assert job["stall"] == pytest.approx(9.4 / 80.0)
    assert [r["rank"] for r in job["worst_ranks"]] == [3, 2, 1]
    expect = _expect()

    page, problems = _open(browser, daemon, "#jobs=" + urllib.parse.quote(JOB, safe=""))
    rows = page.locator("#jobs-table tbody tr[data-job]")
    expect(rows).to_have_count(2, timeout=WAIT_MS)
    # the highest stall first
    assert page.eval_on_selector_all(
        "#jobs-table tbody tr[data-job]", "rs => rs.map(r => r.dataset.job)"
    ) == [JOB, CALM]
    row = page.locator("#jobs-table tbody tr[data-job]").first
    cells = row.locator("td")
    expect(cells.nth(0)).to_have_text(JOB)
    expect(cells.nth(1)).to_have_text(percent(job["stall"]))
    expect(cells.nth(3)).to_have_text("4 of 4")
    worst = ", ".join(f"{r['rank']}: {percent(r['stall'])}" for r in job["worst_ranks"])
    expect(cells.nth(4)).to_have_text(worst)
    # past the alert's 10 %: the row is shown in trouble; the calm job is not
    bad = re.compile(r"\bbad\b")
    expect(row).to_have_class(bad)
    expect(page.locator("#jobs-table tbody tr[data-job]").nth(1)).not_to_have_class(bad)
    # its link selects it, its name percent-encoded
    href = row.locator("a").get_attribute("href")
    assert href == "#jobs=" + urllib.parse.quote(JOB, safe="~()*!.'")
    # the time to first batch: one segment per phase, in order, as wide as its share
    phases = row.locator("svg.first-batch-bar rect.phase")
    expect(phases).to_have_count(4)
    seconds = [float(phases.nth(i).get_attribute("data-seconds") or "nan") for i in range(4)]
    assert seconds == [job["first_batch"][p] for p in FIRST_BATCH]
    widths = [float(phases.nth(i).get_attribute("width") or "nan") for i in range(4)]
    whole = sum(FIRST_BATCH.values())
    assert widths == pytest.approx([160 * FIRST_BATCH[p] / whole for p in FIRST_BATCH], abs=0.1)
    expect(row.locator(".first-batch-label")).to_have_text("1.90 s")

    # /#jobs=NAME selected it: its row is marked and its detail shown below the table
    expect(row).to_have_class(re.compile(r"\bselected\b"))
    expect(page.locator("#job-detail-title")).to_have_text(f"Job {JOB}")
    expect(page.locator("#job-stall")).to_have_text(percent(job["stall"]))
    expect(page.locator("#job-steps")).to_have_text("80")
    expect(page.locator("#job-first-rank")).to_have_text("rank 3")
    for phase, shown in (
        ("metadata", "100 ms"),
        ("worker_start", "1.20 s"),
        ("first_chunk", "400 ms"),
        ("decode", "200 ms"),
    ):
        expect(page.locator(f"#job-phase-{phase}")).to_have_text(shown)
    ranks = page.locator("#job-ranks tbody tr:not([hidden])")
    expect(ranks).to_have_count(3)
    expect(ranks.first).to_contain_text("rank 3")
    expect(ranks.first).to_contain_text("900 ms")
    # the bytes it was served: the backend's once, then the cache's (the ledger's figures)
    cost = next(j for j in v1(daemon, "/v1/cost")["jobs"] if j["job"] == JOB)
    assert cost["served_bytes"]["backend"] == OBJECT_BYTES
    assert cost["served_bytes"]["ram"] + cost["served_bytes"]["disk"] == OBJECT_BYTES
    expect(page.locator("#job-served-backend")).to_have_text("3.0 MiB")

    # while the job reads, its row says how fast, by source (the cache's, here)
    with _reading(daemon, JOB):
        source = row.locator("td").nth(5)  # RAM
        expect(source).not_to_have_text("0 B/s", timeout=WAIT_MS)
        expect(source).to_have_text(re.compile(r"^[\d.]+ (B|KiB|MiB|GiB)/s$"))

    # a click on another job selects it
    page.locator("#jobs-table tbody tr[data-job]").nth(1).locator("a").click()
    expect(page.locator("#job-detail-title")).to_have_text(f"Job {CALM}")
    assert page.evaluate("location.hash") == f"#jobs={CALM}"
    if os.environ.get("CHUNKD_SCREENSHOTS") == "1":
        page.goto(f"{daemon.url}/#jobs=" + urllib.parse.quote(JOB, safe=""))
        expect(page.locator("#job-detail-title")).to_have_text(f"Job {JOB}", timeout=WAIT_MS)
        page.locator("#jobs").screenshot(path=str(IMAGES / "jobs.png"))
    assert problems == []


@pytest.mark.timeout(60)
def test_a_deep_link_shows_the_jobs_panel_and_its_markup_stays_text(
    start_daemon: Callable[..., Daemon], browser: Browser, tmp_path: Path
) -> None:
    daemon = start_daemon(node_toml(tmp_path))
    run_jobs(daemon)
    expect = _expect()
    page, problems = _open(browser, daemon, "#jobs", width=1280)
    expect(page.locator("#jobs-table tbody tr[data-job]")).to_have_count(2, timeout=WAIT_MS)
    # /#jobs brings the panel into view (it is below the node's panels) and selects none
    top = page.evaluate("document.getElementById('jobs').getBoundingClientRect().top")
    assert 0 <= top < 900, top
    expect(page.locator("#job-detail")).to_be_hidden()

    # a crafted link: the name is markup, shown as text, nothing runs
    markup = "<img src=x onerror=alert(1)>"
    page.goto(f"{daemon.url}/#jobs=" + urllib.parse.quote(markup))
    expect(page.locator("#job-detail-title")).to_have_text(
        f"Job {markup}: not among the jobs this node lists now", timeout=WAIT_MS
    )
    assert page.locator("#jobs img").count() == 0
    # and a hash that is not percent-encoded UTF-8 is taken as it is written
    page.goto(f"{daemon.url}/#jobs=%E0%A4%A")
    expect(page.locator("#job-detail-title")).to_contain_text("%E0%A4%A", timeout=WAIT_MS)
    assert problems == []


@pytest.mark.timeout(90)
def test_the_cost_panel_shows_the_ledgers_figures(
    start_daemon: Callable[..., Daemon], browser: Browser, tmp_path: Path
) -> None:
    daemon = start_daemon(node_toml(tmp_path))
    run_jobs(daemon)
    ledger = v1(daemon, "/v1/cost")
    totals = ledger["totals"]
    # something was spent (a GET and its egress), and the second read saved as much
    assert totals["spent"] > 0
    assert totals["saved"]["cache"] > 0
    assert ledger["currency"] == "USD"
    expect = _expect()
    page, problems = _open(browser, daemon, "#cost")
    figures = {
        "cost-spent": totals["spent"],
        "cost-direct": totals["direct"],
        "cost-saved-cache": totals["saved"]["cache"],
        "cost-saved-peer": totals["saved"]["peer"],
        # the sums the telemetry makes: every op's requests, every kind's bytes written
        "cost-requests": sum(totals["backend_requests"].values()),
        "cost-read": totals["backend_bytes"]["read"],
        "cost-written": sum(totals["written_bytes"].values()),
    }
    for ident, value in figures.items():
        # each figure the page shows carries the daemon's own value
        expect(page.locator(f"#{ident}")).to_have_attribute(
            "data-value", re.compile(r"."), timeout=WAIT_MS
        )
        shown = float(page.locator(f"#{ident}").get_attribute("data-value") or "nan")
        assert shown == pytest.approx(value, rel=1e-12), ident
        expect(page.locator(f"#{ident}")).not_to_have_text("\u2013")
    expect(page.locator("#cost-spent")).to_have_text(_money(totals["spent"], "USD"))
    expect(page.locator("#cost-direct")).to_have_text(_money(totals["direct"], "USD"))
    expect(page.locator("#cost-saved-cache")).to_have_text(_money(totals["saved"]["cache"], "USD"))
    # by job: the job that read, what it spent
    rows = page.locator("#cost-jobs tbody tr:not([hidden]):not(:has(td.empty))")
    job = next(j for j in ledger["jobs"] if j["job"] == JOB)
    row = rows.filter(has_text=JOB)
    expect(row).to_have_count(1)
    expect(row.locator("td").nth(1)).to_have_text(_money(job["spent"], "USD"))
    expect(row.locator("td").nth(3)).to_have_text(_money(job["saved"]["cache"], "USD"))
    if os.environ.get("CHUNKD_SCREENSHOTS") == "1":
        page.locator("#cost").screenshot(path=str(IMAGES / "cost.png"))
    assert problems == []


def _money(value: float, currency: str) -> str:
    """An amount as the page writes it (docs/dashboard.md): two decimals, more where
    needed never to read as zero."""
    import math

    if value == 0:
        return f"0.00 {currency}"
    decimals = min(10, max(2, 1 - math.floor(math.log10(abs(value)))))
    return f"{value:.{decimals}f} {currency}"


@pytest.mark.timeout(60)
def test_the_inspectors_step_view_links_to_the_jobs_view(
    start_daemon: Callable[..., Daemon], browser: Browser, tmp_path: Path
) -> None:
    daemon = start_daemon(node_toml(tmp_path))
    run_jobs(daemon)
    expect = _expect()
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    # opened for a job: the link selects it on the dashboard
    page.goto(f"{daemon.url}/inspect/?view=step&job=" + urllib.parse.quote(JOB, safe=""))
    link = page.locator("a.jobs-link")
    expect(link).to_have_attribute("href", "/#jobs=" + urllib.parse.quote(JOB, safe="~()*!.'"))
    link.click()
    expect(page.locator("#job-detail-title")).to_have_text(f"Job {JOB}", timeout=WAIT_MS)
    # opened for no job: a plain link to the jobs view
    page.goto(f"{daemon.url}/inspect/?view=step")
    expect(page.locator("a.jobs-link")).to_have_attribute("href", "/#jobs")


@pytest.mark.timeout(90)
def test_no_figure_of_the_jobs_and_cost_panels_wraps_or_is_cut(
    start_daemon: Callable[..., Daemon], browser: Browser, tmp_path: Path
) -> None:
    """At 1280, 820 and 420 px, with a job selected: as for the rest of the page
    (tests/test_dashboard_page.py), no number or unit is cut or broken across lines and
    no table is wider than its panel."""
    from tests.test_dashboard_page import _CUT_OR_WRAPPED

    daemon = start_daemon(node_toml(tmp_path))
    run_jobs(daemon)
    expect = _expect()
    for width in (1280, 820, 420):
        page, problems = _open(
            browser, daemon, "#jobs=" + urllib.parse.quote(JOB, safe=""), width=width
        )
        expect(page.locator("#job-detail-title")).to_have_text(f"Job {JOB}", timeout=WAIT_MS)
        expect(page.locator("#cost-jobs tbody")).to_contain_text(JOB)
        found: list[list[str]] = page.evaluate(_CUT_OR_WRAPPED)
        assert found == [], (width, found)
        assert page.evaluate("document.documentElement.scrollWidth") <= width
        assert problems == []
        page.context.close()


@pytest.mark.timeout(60)
def test_a_sample_lists_20_jobs_and_the_10_that_spent_most(
    start_daemon: Callable[..., Daemon], browser: Browser, tmp_path: Path
) -> None:
    """The bounds of a sample (docs/dashboard.md): 20 jobs, the highest stall first,
    and how many there are; the cost's 10 jobs that spent most, and how many."""
    from chunkd.gateway.dashboard.telemetry import COST_JOBS_SHOWN, JOBS_SHOWN

    daemon = start_daemon(node_toml(tmp_path))
    data = daemon.cwd / "data"
    data.mkdir(parents=True, exist_ok=True)
    names = [f"bound-{i:02d}" for i in range(JOBS_SHOWN + 5)]
    for i, name in enumerate(names):
        (data / f"{name}.bin").write_bytes(os.urandom(1024 * (i + 1)))
        with Client(daemon.cwd / "chunkd.sock", train_job=name) as client:
            # job i waits i/100 of its steps: the last one stalls most
            report(client, 0, 1, (10, 0.1 * i, 10.0, 0.01 * i))
            if i < COST_JOBS_SHOWN + 2:  # these read, and pay for it
                assert len(bytes(client.read(f"data/{name}.bin"))) == 1024 * (i + 1)
    deadline = time.monotonic() + 30
    sample: dict[str, Any] = {}
    while time.monotonic() < deadline:
        history = v1(daemon, "/v1/dashboard")["history"]
        sample = history[-1] if history else {"jobs_total": 0, "cost": None}
        if sample["jobs_total"] == len(names) and (sample["cost"] or {}).get("jobs_total", 0) >= 12:
            break
        time.sleep(0.3)
    assert [j["name"] for j in sample["jobs"]] == names[::-1][:JOBS_SHOWN]
    assert sample["jobs_total"] == len(names)
    cost = sample["cost"]
    assert len(cost["jobs"]) == COST_JOBS_SHOWN
    spent = [j["spent"] for j in cost["jobs"]]
    assert spent == sorted(spent, reverse=True)
    assert cost["jobs_total"] >= COST_JOBS_SHOWN + 2
    # the page says how many more there are
    page, problems = _open(browser, daemon, "#jobs")
    expect = _expect()
    rows = page.locator("#jobs-table tbody tr[data-job]")
    expect(rows).to_have_count(JOBS_SHOWN, timeout=WAIT_MS)
    expect(page.locator("#jobs-table td.empty")).to_have_text("and 5 more")
    expect(page.locator("#jobs-summary")).to_contain_text(f"{len(names)} jobs")
    assert problems == []


@pytest.mark.timeout(30)
def test_the_ledger_is_summed_a_few_jobs_a_turn_with_the_loop_free_between() -> None:
    import asyncio
    import concurrent.futures

    from chunkd.gateway.costs.ledger import Ledger
    from chunkd.gateway.costs.summaries import warm_ledger
    from chunkd.gateway.jobs import JobTable

    ledger = Ledger(JobTable(tracked=256), tracked=256)

    def charge(job: int) -> None:
        for name in ("text/web", "images"):
            ledger.charge(f"job-{job}", 1000, name, "request", "data", "get", 1)
            ledger.charge(f"job-{job}", 1000, name, "bytes", "data", "read", 4096)

    async def main() -> tuple[int, int]:
        for job in range(256):
            charge(job)
        turns = 0

        async def other_work() -> None:
            nonlocal turns
            while True:
                await asyncio.sleep(0)
                turns += 1
                if turns == 1:
                    charge(0)  # a job charged between two turns of the warming

        task = asyncio.create_task(other_work())
        await asyncio.sleep(0)
        made = await warm_ledger(ledger, jobs_at_once=64)
        task.cancel()
        return made, turns

    # a loop of its own, in a thread (the browser's sync API may hold this thread's)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        made, turns = pool.submit(asyncio.run, main()).result()
    assert made == 256  # every job charged since the last view, one summary each
    assert turns >= 4  # the other work ran between the 4 slices of 64 jobs
    view = ledger.view(names=False)
    rows = {row["job"]: row for row in view["jobs"]}
    # job-0's charge between two turns is in its figures (its summary made again)
    assert rows["job-0"]["backend_requests"] == {"get": 4}
    assert rows["job-1"]["backend_requests"] == {"get": 2}
    assert view["totals"]["backend_requests"] == {"get": 2 * 256 + 2}
    assert view["totals"]["backend_bytes"] == {"read": 4096 * (2 * 256 + 2)}
