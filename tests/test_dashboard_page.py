"""The dashboard page (``GET /``) in a real headless Chromium against a real daemon.

What a person relies on: the page loads under the daemon's CSP with no errors, its
figures move while something reads, it stays the same size as samples come, every
name reaches the page as text, and through a daemon restart it says it lost the
daemon and that the daemon came back as a new process. And that it reads at a glance
(issue 27): charts fit the history they have, their axes say round numbers, the small
charts are tall enough to read, an empty panel folds to one line, the figures dim while
the daemon is not answering, a rate never prints as zero beside bytes that moved, and
no number or unit is wrapped or cut short, at 1280 px or at 820 px.

The checks that only look share one daemon under load and one browser
(:func:`busy_node`); each opens its own page.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import signal
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from chunkd.testing import CountingProxy, free_port
from chunkd.testing.browser import chromium, chromium_missing
from chunkd.testing.daemon import DaemonProcess
from tests.conftest import Daemon

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

pytestmark = pytest.mark.skipif(
    chromium_missing() is not None, reason=chromium_missing() or "chromium is available"
)

#: a page waits this long for a figure the daemon sends each second
WAIT_MS = 30_000
#: an object whose name is markup: the page must show it as text
MARKUP_NAME = "<img src=x onerror=alert(1)>.bin"
IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"
SCREENSHOT = IMAGES / "dashboard.png"
#: an object of the busy node read once, and only once (for the screenshots)
READ_ONCE = "once/read-once.bin"
#: a number's unit on a chart's axis, and the number before it
AXIS_LABEL = re.compile(r"^(\d+(?:\.\d+)?) (B/s|KiB/s|MiB/s|GiB/s|TiB/s|ms|s|%)$")


def _objects(daemon: Daemon) -> list[str]:
    """A few objects in the daemon's default backend (``local`` = ./chunkd-data)."""
    data = daemon.cwd / "chunkd-data"
    data.mkdir(parents=True, exist_ok=True)
    names = ["train/shard-0000.bin", "train/shard-0001.bin", MARKUP_NAME]
    for i, name in enumerate(names):
        path = data / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(2 << 20) + bytes([i]))
    return names


@contextlib.contextmanager
def _reading(daemon: Daemon, names: list[str], pause: float = 0.0) -> Iterator[list[BaseException]]:
    """Reads ``names`` through the daemon in a loop, in a thread, until the block ends
    (``pause`` seconds between rounds: enough load to see, not a whole core)."""
    stop = threading.Event()
    failures: list[BaseException] = []

    def read() -> None:
        while not stop.is_set():
            for name in names:
                try:
                    status, _, _ = daemon.get("/v1/objects/local/" + urllib.parse.quote(name))
                    assert status == 200, f"reading {name}: HTTP {status}"
                except BaseException as exc:
                    failures.append(exc)
                    return
            stop.wait(pause)

    thread = threading.Thread(target=read, name="dashboard-reader", daemon=True)
    thread.start()
    try:
        yield failures
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not failures, failures


def _watch(page: Page) -> list[str]:
    """Every console error, uncaught exception and CSP violation the page has."""
    problems: list[str] = []
    page.on(
        "console",
        lambda message: (
            problems.append(f"console {message.type}: {message.text}")
            if message.type in ("error", "warning")
            else None
        ),
    )
    page.on("pageerror", lambda error: problems.append(f"uncaught: {error}"))
    # injected by the browser driver, outside the page's CSP
    page.add_init_script(
        "window.__violations = [];"
        "document.addEventListener('securitypolicyviolation', (e) =>"
        " window.__violations.push(e.violatedDirective + ' ' + e.blockedURI));"
    )
    return problems


def _violations(page: Page) -> list[str]:
    found: list[str] = page.evaluate("window.__violations")
    return found


def _open(browser: Any, daemon: Daemon, width: int = 1280) -> tuple[Page, list[str]]:
    context = browser.new_context(viewport={"width": width, "height": 800}, timezone_id="UTC")
    page = context.new_page()
    problems = _watch(page)
    response = page.goto(daemon.url + "/")
    assert response is not None
    assert response.status == 200
    csp = response.headers.get("content-security-policy", "")
    assert "script-src 'self'" in csp, csp
    assert "default-src 'none'" in csp, csp
    return page, problems


def _expect() -> Callable[..., Any]:
    from playwright.sync_api import expect

    return expect


def _next_samples(page: Page, count: int) -> None:
    """Waits until the page has shown ``count`` more samples."""
    for _ in range(count):
        shown = page.text_content("#updated")
        _expect()(page.locator("#updated")).not_to_have_text(shown or "", timeout=WAIT_MS)


def _node_count(page: Page) -> int:
    nodes: int = page.evaluate("document.getElementsByTagName('*').length")
    return nodes


def _classes(page: Page, selector: str) -> list[str]:
    found: list[str] = page.evaluate(
        "(s) => Array.from(document.querySelector(s).classList)", selector
    )
    return found


def _height(page: Page, selector: str) -> float:
    box = page.locator(selector).bounding_box()
    assert box is not None, f"{selector} is not shown"
    return float(box["height"])


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """One headless Chromium for the module (playwright's sync API runs one at a time);
    each test opens its own pages in it."""
    with chromium() as started:
        yield started


#: a zero rate, as a page would print it
ZERO_RATE = re.compile(r"^0(\.0+)?/s$")


@pytest.mark.timeout(90)
def test_page_loads_and_its_figures_follow_reads(
    start_daemon: Callable[..., Daemon], browser: Browser
) -> None:
    daemon = start_daemon()
    names = _objects(daemon)
    expect = _expect()
    page, problems = _open(browser, daemon)
    expect(page.locator("#connection")).to_have_text("live", timeout=WAIT_MS)
    expect(page.locator("#node")).to_contain_text(f"127.0.0.1:{daemon.port}")
    expect(page.locator("#backends tbody")).to_contain_text("local")
    expect(page.locator("#tiers tbody")).to_contain_text("ram")
    expect(page.locator("#peers-summary")).to_have_text("not configured")
    expect(page.get_by_role("link", name="inspector")).to_have_attribute("href", "/inspect/")
    idle = re.compile(r"^0 B/s$")
    for source in ("ram", "disk", "backend"):
        expect(page.locator(f"#tp-{source}")).to_have_text(idle, timeout=WAIT_MS)
    # nothing read yet: the hottest objects fold to their title line
    hot_panel = page.locator("#hot-objects-panel")
    expect(hot_panel).to_have_class(re.compile(r"\bfolded\b"), timeout=WAIT_MS)
    expect(page.locator("#hot-objects")).to_be_hidden()

    with _reading(daemon, names):
        # the first reads come from the backend, the next from the cache
        expect(page.locator("#tp-backend")).not_to_have_text(idle, timeout=WAIT_MS)
        expect(page.locator("#tp-ram")).not_to_have_text(idle, timeout=WAIT_MS)
        expect(page.locator("#be-requests")).not_to_have_text(ZERO_RATE, timeout=WAIT_MS)
        expect(page.locator("#ratio-ram")).to_have_text(re.compile(r"%$"), timeout=WAIT_MS)
        # reads came: the panel unfolds and lists them
        expect(hot_panel).not_to_have_class(re.compile(r"\bfolded\b"), timeout=WAIT_MS)
        hot = page.locator("#hot-objects tbody")
        for name in names:
            expect(hot).to_contain_text(name, timeout=WAIT_MS)
        # the markup in a name is text: no element came of it
        assert page.locator("#hot-objects img").count() == 0
        # the chart draws the history: a line with more than one point
        expect(page.locator("#throughput-chart path.series-ram")).to_have_attribute(
            "d", re.compile(r"L"), timeout=WAIT_MS
        )

        # steady state: samples replace figures, they add no nodes
        _next_samples(page, 2)
        before = _node_count(page)
        _next_samples(page, 5)
        assert _node_count(page) == before

    assert problems == []
    assert _violations(page) == []


def _stale(page: Page) -> tuple[bool, float]:
    """Whether the page's figures are marked stale, and the opacity they are shown at."""
    found: list[Any] = page.evaluate(
        "() => { const m = document.querySelector('main');"
        " return [m.classList.contains('stale'), Number(getComputedStyle(m).opacity)]; }"
    )
    return bool(found[0]), float(found[1])


def _wait_stale(page: Page, stale: bool) -> None:
    main = page.locator("main")
    if stale:
        _expect()(main).to_have_class(re.compile(r"\bstale\b"), timeout=WAIT_MS)
    else:
        _expect()(main).not_to_have_class(re.compile(r"\bstale\b"), timeout=WAIT_MS)
    # the opacity eases in over a fraction of a second
    page.wait_for_timeout(600)


@pytest.mark.timeout(90)
def test_stale_figures_dim_and_the_page_says_when_the_daemon_restarted(
    start_daemon: Callable[..., Daemon], browser: Browser
) -> None:
    first = start_daemon()
    expect = _expect()
    page, problems = _open(browser, first)
    connection = page.locator("#connection")
    expect(connection).to_have_text("live", timeout=WAIT_MS)
    expect(page.locator("#restart")).to_be_hidden()
    _next_samples(page, 1)
    assert _stale(page) == (False, 1.0)
    expect(page.locator("#stale")).to_be_hidden()

    # a daemon that stops answering but keeps its connection: no sample comes
    first.process.send_signal(signal.SIGSTOP)
    try:
        _wait_stale(page, True)
        shown = page.text_content("#updated") or ""
        last_seen = shown.rpartition(" at ")[2]
        assert re.fullmatch(r"\d\d:\d\d:\d\d", last_seen), shown
        stale, opacity = _stale(page)
        assert stale
        assert opacity <= 0.5, f"stale figures are shown at opacity {opacity}"
        expect(page.locator("#stale")).to_have_text(f"stale since {last_seen}")
    finally:
        first.process.send_signal(signal.SIGCONT)
    _wait_stale(page, False)
    assert _stale(page) == (False, 1.0)
    expect(page.locator("#stale")).to_be_hidden()
    expect(connection).to_have_text("live", timeout=WAIT_MS)

    # the daemon goes away: the figures dim at once
    assert first.stop() == 0
    expect(connection).to_contain_text("disconnected, retrying", timeout=WAIT_MS)
    _wait_stale(page, True)
    assert _stale(page)[1] <= 0.5
    shown = page.text_content("#updated") or ""
    expect(page.locator("#stale")).to_have_text(f"stale since {shown.rpartition(' at ')[2]}")

    second = start_daemon(port=first.port, cwd=first.cwd)
    status, _, body = second.get("/v1/dashboard")
    assert status == 200
    started = json.loads(body)["node"]["started"]
    expect(connection).to_have_text("live", timeout=WAIT_MS)
    restart = page.locator("#restart")
    expect(restart).to_have_text(
        f"daemon restarted at {time.strftime('%H:%M:%S', time.gmtime(started))}",
        timeout=WAIT_MS,
    )
    # the charts start again with the new daemon's history and go on, at full contrast
    _next_samples(page, 2)
    expect(page.locator("#updated")).to_contain_text("sample ")
    _wait_stale(page, False)
    assert _stale(page) == (False, 1.0)
    # the browser logs each refused reconnect while the daemon is down; nothing else
    unexpected = [p for p in problems if "ERR_CONNECTION_REFUSED" not in p]
    assert unexpected == []
    assert _violations(page) == []


# -- one busy node for the checks that only look ---------------------------------------


@pytest.fixture(scope="module")
def busy_node(
    tmp_path_factory: pytest.TempPathFactory, browser: Browser
) -> Iterator[tuple[Daemon, Browser]]:
    """A daemon (the embedded default) read in a loop and a headless Chromium, shared by
    the module's checks that only look at the page."""
    run_dir = tmp_path_factory.mktemp("dashboard")
    port = free_port()
    launched = DaemonProcess(
        cwd=run_dir, listen=f"127.0.0.1:{port}", socket=run_dir / "chunkd.sock"
    )
    log = launched.log
    daemon = Daemon(launched.process, port, run_dir / "none.toml", run_dir, launched.env, log)
    try:
        launched.wait_ready()
        names = _objects(daemon)
        with _reading(daemon, names, pause=0.05):
            yield daemon, browser
    finally:
        launched.kill()
    assert "Traceback" not in log.read_text(errors="replace")


def _read_once(daemon: Daemon, name: str) -> None:
    """Writes a 3 MiB object in the daemon's ``local`` backend and reads it once."""
    path = daemon.cwd / "chunkd-data" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(3 << 20))
    status, _, _ = daemon.get("/v1/objects/local/" + name)
    assert status == 200


def _busy_page(busy: tuple[Daemon, Browser], width: int = 1280) -> tuple[Page, list[str]]:
    """A page of the busy node, live, its hottest objects listed, a few samples in."""
    daemon, browser = busy
    page, problems = _open(browser, daemon, width)
    expect = _expect()
    expect(page.locator("#connection")).to_have_text("live", timeout=WAIT_MS)
    expect(page.locator("#hot-objects tbody")).to_contain_text(
        "train/shard-0000.bin", timeout=WAIT_MS
    )
    _next_samples(page, 2)
    return page, problems


def _plots(page: Page) -> dict[str, dict[str, Any]]:
    """Each chart's plot area (from its horizontal grid lines), the extent of each line
    drawn, its height, and the labels of its value axis."""
    found: dict[str, dict[str, Any]] = page.evaluate(
        """() => {
          const out = {};
          for (const chart of document.querySelectorAll('.chart')) {
            const svg = chart.querySelector('svg');
            const shown = (e) => getComputedStyle(e).display !== 'none';
            const grid = Array.from(svg.querySelectorAll('line.gridline:not(.time)'))
              .filter(shown);
            const lines = {};
            for (const path of svg.querySelectorAll('path.line')) {
              if (!path.getAttribute('d')) continue;
              const box = path.getBBox();
              lines[path.getAttribute('class')] = [box.x, box.x + box.width];
            }
            const labels = Array.from(svg.querySelectorAll('text.axis'))
              .filter(shown)
              .map((t) => t.textContent)
              .filter((t) => !/ago$|^now$|^[-\u2212]/.test(t));
            out[chart.id] = {
              left: grid.length ? Number(grid[0].getAttribute('x1')) : null,
              right: grid.length ? Number(grid[0].getAttribute('x2')) : null,
              lines,
              labels,
              height: svg.getBoundingClientRect().height,
            };
          }
          return out;
        }"""
    )
    return found


@pytest.mark.timeout(90)
def test_charts_fit_their_data(busy_node: tuple[Daemon, Browser]) -> None:
    """With less history than the window, a line spans the chart from its first sample
    (the left edge) to the last (the right edge), not a sliver at the right."""
    page, problems = _busy_page(busy_node)
    plot = _plots(page)["throughput-chart"]
    first, last = plot["lines"]["line series-ram"]
    width = plot["right"] - plot["left"]
    assert abs(first - plot["left"]) <= 2, (plot, "the oldest sample is not at the left edge")
    assert abs(last - plot["right"]) <= 2, (plot, "the newest sample is not at the right edge")
    assert last - first >= 0.95 * width
    # the time axis says how far back the left edge is, not a fixed "5 min ago"
    axis = page.locator("#throughput-chart text.axis").all_text_contents()
    assert "5 min ago" not in axis, axis
    assert problems == []


def _is_round(value: float, step: float) -> bool:
    return abs(value / step - round(value / step)) < 1e-6


@pytest.mark.timeout(90)
def test_axis_labels_are_round_numbers(busy_node: tuple[Daemon, Browser]) -> None:
    """Each chart's value axis: one unit, evenly spaced ticks whose step is 1, 2 or 5
    times a power of ten, each label a whole multiple of it."""
    page, problems = _busy_page(busy_node)
    for chart, plot in _plots(page).items():
        labels = plot["labels"]
        assert len(labels) >= 2, (chart, labels)
        parsed = [AXIS_LABEL.fullmatch(label) for label in labels]
        assert all(parsed), (chart, labels)
        units = {m.group(2) for m in parsed if m is not None}
        assert len(units) == 1, (chart, labels, "one unit an axis")
        values = sorted(float(m.group(1)) for m in parsed if m is not None)
        step = values[1] - values[0]
        assert step > 0, (chart, labels)
        mantissa = step / 10 ** math.floor(math.log10(step) + 1e-9)
        assert min(abs(mantissa - m) for m in (1, 2, 5)) < 1e-6, (chart, labels, step)
        for value in values:
            assert _is_round(value, step), (chart, labels, step)
        gaps = [b - a for a, b in itertools.pairwise(values)]
        assert all(abs(g - step) < 1e-6 for g in gaps), (chart, labels)
    assert problems == []


@pytest.mark.timeout(90)
def test_small_charts_are_tall_enough(busy_node: tuple[Daemon, Browser]) -> None:
    """The hit-ratio and latency charts are as tall as the throughput chart, or close."""
    page, problems = _busy_page(busy_node)
    plots = _plots(page)
    tall = plots["throughput-chart"]["height"]
    for chart in ("ratio-chart", "latency-chart"):
        height = plots[chart]["height"]
        assert height >= 120, (chart, height)
        assert height >= 0.7 * tall, (chart, height, tall)
    assert problems == []


@pytest.mark.timeout(90)
def test_empty_panels_fold(busy_node: tuple[Daemon, Browser]) -> None:
    """A panel with nothing to list is one line that says so; a busy one stays open."""
    page, problems = _busy_page(busy_node)
    expect = _expect()
    folded = {
        "#peers-panel": "not configured",
        "#checkpoints-panel": "none in flight",
        "#hot-datasets-panel": "no dataset reads in the last minute",
        "#errors-panel": "none since the start",
    }
    busy = _height(page, "#hot-objects-panel")
    for panel, says in folded.items():
        expect(page.locator(panel)).to_have_class(re.compile(r"\bfolded\b"))
        expect(page.locator(panel)).to_contain_text(says)
        assert page.locator(f"{panel} table").is_hidden(), panel
        assert _height(page, panel) <= 48, (panel, _height(page, panel))
    assert "folded" not in _classes(page, "#hot-objects-panel")
    assert page.locator("#hot-objects").is_visible()
    assert busy > 100
    assert problems == []


@pytest.mark.timeout(90)
def test_a_rate_never_reads_zero_beside_bytes_that_moved(
    busy_node: tuple[Daemon, Browser],
) -> None:
    """An object read once shows its bytes and a rate of reads that is not zero."""
    daemon, _ = busy_node
    name = f"once/read-once-{time.monotonic_ns()}.bin"
    _read_once(daemon, name)  # its decayed rate: about 0.05 reads/s and 150 KiB/s
    page, problems = _busy_page(busy_node)
    _expect()(page.locator("#hot-objects tbody")).to_contain_text(name, timeout=WAIT_MS)
    rows: list[list[str]] = page.evaluate(
        "() => Array.from(document.querySelectorAll('#hot-objects tbody tr'))"
        ".filter((r) => !r.hidden && r.cells.length === 3)"
        ".map((r) => Array.from(r.cells).map((c) => c.textContent))"
    )
    once = [row for row in rows if row[0] == f"local/{name}"]
    assert once, rows
    for name, moved, reads in rows:
        if moved != "0 B/s":
            assert not ZERO_RATE.match(reads), (name, moved, reads)
    # zero is zero, with no decimals that suggest a small rate
    expect = _expect()
    expect(page.locator("#req-s3")).to_have_text("0/s")
    assert problems == []


_CUT_OR_WRAPPED = """() => {
  const bad = [];
  const cells = document.querySelectorAll(
    '.rows td:not(:first-child):not(.empty):not(.text), .figures dd, .legend .figure');
  for (const el of cells) {
    if (!el.offsetParent || (el.closest('#errors') && el.cellIndex === 3)) continue;
    if (el.scrollWidth > el.clientWidth) bad.push(['cut', el.textContent]);
    // the lines its text is on (a bar drawn beside a figure is no line of text)
    const tops = new Set();
    const walk = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
    for (let node = walk.nextNode(); node; node = walk.nextNode()) {
      if (node.parentElement.closest('svg') || !node.textContent.trim()) continue;
      const range = document.createRange();
      range.selectNodeContents(node);
      for (const r of range.getClientRects()) tops.add(Math.round(r.bottom));
    }
    if (tops.size > 1) bad.push(['wrapped', el.textContent]);
  }
  for (const table of document.querySelectorAll('.rows')) {
    if (!table.offsetParent) continue;
    const panel = table.closest('.panel').getBoundingClientRect();
    const box = table.getBoundingClientRect();
    if (box.right > panel.right + 0.5) bad.push(['overflows', table.id]);
  }
  return bad;
}"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("width", [1280, 820, 420])
def test_numbers_never_wrap_or_truncate(busy_node: tuple[Daemon, Browser], width: int) -> None:
    """At 1280, 820 and 420 px no figure's number or unit is cut short with an
    ellipsis or broken across lines, and no table is wider than its panel."""
    page, problems = _busy_page(busy_node, width)
    cells = page.locator(".rows td:not(:first-child):not(.empty)").count()
    assert cells > 10
    found: list[list[str]] = page.evaluate(_CUT_OR_WRAPPED)
    assert found == [], found
    # the page is no wider than the window
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    assert problems == []


@pytest.mark.timeout(120)
def test_a_save_in_flight_opens_the_checkpoints_panel(
    start_daemon: Callable[..., Daemon],
    browser: Browser,
    tmp_path: Path,
    bucket: str,
    s3_proxy: CountingProxy,
) -> None:
    """The checkpoints panel folds with no save in flight, opens with one (its figures
    whole at 820 px), and folds again once it is in the backend."""
    torch = pytest.importorskip("torch")
    from chunkd.client import Client
    from chunkd.client import checkpoint as ckpt
    from tests.test_checkpoint import s3_toml

    daemon = start_daemon(s3_toml(tmp_path, bucket, s3_proxy), cwd=tmp_path / "node")
    expect = _expect()
    folded = re.compile(r"\bfolded\b")
    with Client(daemon.cwd / "chunkd.sock") as client:
        page, problems = _open(browser, daemon, 820)
        panel = page.locator("#checkpoints-panel")
        expect(page.locator("#connection")).to_have_text("live", timeout=WAIT_MS)
        expect(panel).to_have_class(folded, timeout=WAIT_MS)
        expect(page.locator("#checkpoints-summary")).to_have_text("none in flight")

        s3_proxy.down()
        state = {"w": torch.randn(512, 512)}
        handle = ckpt.async_save(state, "ckpt/seen/step-1", durability="local", client=client)
        try:
            assert handle.wait(30)  # durable on the node; the backend is down
            expect(panel).not_to_have_class(folded, timeout=WAIT_MS)
            expect(page.locator("#checkpoints tbody")).to_contain_text("ckpt/seen/step-1")
            expect(page.locator("#checkpoints-summary")).to_have_text("1 in flight")
            expect(page.locator("#checkpoints tbody")).to_contain_text("1.0 MiB")
            # staged and local filled; replicated not (no replicas asked: a save without
            # replicas is never called replicated), remote not yet (the backend is down)
            expect(page.locator("#checkpoints .durability-label")).to_have_text("local")
            widths = page.evaluate(
                "Array.from(document.querySelectorAll('#checkpoints .durability rect.reached'))"
                ".map((r) => Number(r.getAttribute('width')))"
            )
            assert widths == [38, 38, 0, 0], widths
            found: list[list[str]] = page.evaluate(_CUT_OR_WRAPPED)
            assert found == [], found
            if os.environ.get("CHUNKD_SCREENSHOTS") == "1":
                page.screenshot(path=str(IMAGES / "dashboard-checkpoint-820.png"), full_page=True)
        finally:
            s3_proxy.up()
        assert handle.wait(60, level="remote")
        expect(panel).to_have_class(folded, timeout=WAIT_MS)
        # the refused uploads were logged: the warnings panel opened for them
        unexpected = [p for p in problems if "ERR_CONNECTION_REFUSED" not in p]
        assert unexpected == []


@pytest.mark.skipif(
    os.environ.get("CHUNKD_SCREENSHOTS") != "1", reason="set CHUNKD_SCREENSHOTS=1 to take it"
)
def test_screenshot(busy_node: tuple[Daemon, Browser]) -> None:
    """docs/images/dashboard.png (1280x800), dashboard-820.png (820 wide, the whole page)
    and dashboard-stale.png (1280x800, the daemon stopped): the page under a little load,
    with an object read once among the hottest."""
    daemon, _ = busy_node
    _read_once(daemon, READ_ONCE)
    IMAGES.mkdir(parents=True, exist_ok=True)
    page, problems = _busy_page(busy_node, 820)
    _next_samples(page, 12)  # some history in the charts
    page.screenshot(path=str(IMAGES / "dashboard-820.png"), full_page=True)
    page, problems = _busy_page(busy_node, 1280)
    _next_samples(page, 4)
    page.screenshot(path=str(IMAGES / "dashboard.png"))
    daemon.process.send_signal(signal.SIGSTOP)
    try:
        _wait_stale(page, True)
        page.screenshot(path=str(IMAGES / "dashboard-stale.png"))
    finally:
        daemon.process.send_signal(signal.SIGCONT)
    _wait_stale(page, False)
    assert problems == []
