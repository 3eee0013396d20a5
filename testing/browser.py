"""Headless Chromium for the page tests: Debian's ``/usr/bin/chromium`` driven by
playwright (no browser download: this machine has no network but the registries).

The flags keep Chromium off the network it would reach for by itself (updates, sync,
QUIC probes): this machine refuses those connections, many at a time.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from playwright.sync_api import Browser

__all__ = ["CHROMIUM", "chromium", "chromium_missing"]

#: where Debian's package puts it; CHUNKD_CHROMIUM overrides
CHROMIUM = os.environ.get("CHUNKD_CHROMIUM", "/usr/bin/chromium")

_ARGS = (
    "--no-sandbox",  # we run as root in CI
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",  # media tests play without a click
)


def chromium_missing() -> str | None:
    """Why the page tests cannot run here, or None when they can."""
    if shutil.which(CHROMIUM) is None and not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} is not installed (apt-get install chromium; make tools does it)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright)"
    return None


@contextlib.contextmanager
def chromium(**launch: Any) -> Iterator[Browser]:
    """A headless Chromium, closed on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, args=list(_ARGS), **launch)
        try:
            yield browser
        finally:
            browser.close()
