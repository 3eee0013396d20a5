"""The dashboard page (``GET /``) in a real headless Chromium against a real daemon.

What a person relies on: the page loads under the daemon's CSP with no errors, its
figures move while something reads, it stays the same size as samples come, every
name reaches the page as text, and through a daemon restart it says it lost the
daemon and that the daemon came back as a new process.
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

from chunkd.testing.browser import chromium, chromium_missing

if TYPE_CHECKING:
    from playwright.sync_api import Page

    from .conftest import Daemon

pytestmark = pytest.mark.skipif(
    chromium_missing() is not None, reason=chromium_missing() or "chromium is available"
)

#: a page waits this long for a figure the daemon sends each second
WAIT_MS = 30_000
#: an object whose name is markup: the page must show it as text
MARKUP_NAME = "<img src=x onerror=alert(1)>.bin"
SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "images" / "dashboard.png"


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
def _reading(daemon: Daemon, names: list[str]) -> Iterator[list[BaseException]]:
    """Reads ``names`` through the daemon in a loop, in a thread, until the block ends."""
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


def _open(browser: Any, daemon: Daemon) -> tuple[Page, list[str]]:
    context = browser.new_context(viewport={"width": 1280, "height": 800}, timezone_id="UTC")
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


def test_page_loads_and_its_figures_follow_reads(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon()
    names = _objects(daemon)
    expect = _expect()
    with chromium() as browser:
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

        with _reading(daemon, names):
            # the first reads come from the backend, the next from the cache
            expect(page.locator("#tp-backend")).not_to_have_text(idle, timeout=WAIT_MS)
            expect(page.locator("#tp-ram")).not_to_have_text(idle, timeout=WAIT_MS)
            expect(page.locator("#be-requests")).not_to_have_text("0.0/s", timeout=WAIT_MS)
            expect(page.locator("#ratio-ram")).to_have_text(re.compile(r"%$"), timeout=WAIT_MS)
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


def test_page_says_when_the_daemon_restarted(start_daemon: Callable[..., Daemon]) -> None:
    first = start_daemon()
    expect = _expect()
    with chromium() as browser:
        page, problems = _open(browser, first)
        connection = page.locator("#connection")
        expect(connection).to_have_text("live", timeout=WAIT_MS)
        expect(page.locator("#restart")).to_be_hidden()

        assert first.stop() == 0
        expect(connection).to_contain_text("disconnected, retrying", timeout=WAIT_MS)

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
        # the charts start again with the new daemon's history and go on
        _next_samples(page, 2)
        expect(page.locator("#updated")).to_contain_text("sample ")
        # the browser logs each refused reconnect while the daemon is down; nothing else
        unexpected = [p for p in problems if "ERR_CONNECTION_REFUSED" not in p]
        assert unexpected == []
        assert _violations(page) == []


@pytest.mark.skipif(
    os.environ.get("CHUNKD_SCREENSHOTS") != "1", reason="set CHUNKD_SCREENSHOTS=1 to take it"
)
def test_screenshot(start_daemon: Callable[..., Daemon]) -> None:
    """docs/images/dashboard.png: the page at 1280x800 under a little load."""
    daemon = start_daemon()
    names = _objects(daemon)
    expect = _expect()
    with chromium() as browser, _reading(daemon, names):
        page, problems = _open(browser, daemon)
        expect(page.locator("#connection")).to_have_text("live", timeout=WAIT_MS)
        for name in names:
            expect(page.locator("#hot-objects tbody")).to_contain_text(name, timeout=WAIT_MS)
        _next_samples(page, 20)  # some history in the charts
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOT))
        assert problems == []
