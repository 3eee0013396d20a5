"""``chunkd top`` in a real terminal (tmux) against a real daemon, and its --once/--json.

Each live test runs ``chunkd top`` in a tmux server of its own (a private socket, so no
other tmux is touched) and reads the screen with ``capture-pane``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chunkd.testing import free_port

from .conftest import BIN, Daemon

CHUNKD = BIN / "chunkd"
#: the screen shows a new sample each second; this is how long a test waits for one
WAIT_S = 30.0

needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


class Pane:
    """One tmux session running one command, on a private tmux server."""

    def __init__(self, socket: Path, command: str, width: int = 80, height: int = 24) -> None:
        self.socket = socket
        self.name = f"top-{uuid.uuid4().hex[:8]}"
        # The pane's shell writes the command's exit status down: tmux can be slow to
        # reap a pane's process on a busy machine, so its pane_dead_status comes late.
        self.status = socket.parent / f"{self.name}.status"
        wrapped = f"{command}; echo $? > {self.status}"
        # remain-on-exit in the same tmux call: the pane stays to be read once the
        # command ends
        self.tmux(
            "new-session", "-d", "-s", self.name, "-x", str(width), "-y", str(height), wrapped,
            ";", "set-option", "-t", self.name, "remain-on-exit", "on",
        )  # fmt: skip

    def tmux(self, *args: str) -> str:
        # COLUMNS and LINES (set under pytest) would pin the size the app sees; the
        # pane's own size is what is under test
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        done = subprocess.run(
            ["tmux", "-S", str(self.socket), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return done.stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", self.name)

    def wait_for(self, *patterns: str, timeout: float = WAIT_S) -> str:
        """The screen once it shows every one of ``patterns`` (regular expressions)."""
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.screen()
            if all(re.search(p, screen) for p in patterns):
                return screen
            time.sleep(0.2)
        missing = [p for p in patterns if not re.search(p, screen)]
        raise AssertionError(f"the screen never showed {missing}:\n{screen}")

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", self.name, *keys)

    def resize(self, width: int, height: int) -> None:
        self.tmux("resize-window", "-t", self.name, "-x", str(width), "-y", str(height))

    def exit_status(self, timeout: float = WAIT_S) -> int:
        """The command's exit status, once it has ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError, ValueError):
                return int(self.status.read_text())
            time.sleep(0.2)
        raise AssertionError(f"chunkd top did not end:\n{self.screen()}")


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Callable[..., Pane]]:
    """Factory: ``terminal(command)`` runs it in an 80x24 tmux pane; all killed after."""
    socket = tmp_path / "tmux.sock"
    opened: list[Pane] = []

    def factory(command: str, width: int = 80, height: int = 24) -> Pane:
        pane = Pane(socket, command, width, height)
        opened.append(pane)
        return pane

    try:
        yield factory
    finally:
        if opened:
            subprocess.run(
                ["tmux", "-S", str(socket), "kill-server"], capture_output=True, timeout=30
            )


def _objects(daemon: Daemon) -> list[str]:
    data = daemon.cwd / "chunkd-data"
    names = ["top/hot-0.bin", "top/hot-1.bin"]
    for i, name in enumerate(names):
        path = data / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(2 << 20) + bytes([i]))
    return names


@contextlib.contextmanager
def _reading(daemon: Daemon, names: list[str]) -> Iterator[None]:
    stop = threading.Event()
    failures: list[str] = []

    def read() -> None:
        while not stop.is_set():
            for name in names:
                status, _, _ = daemon.get(f"/v1/objects/local/{name}")
                if status != 200:
                    failures.append(f"{name}: HTTP {status}")
                    return

    thread = threading.Thread(target=read, name="top-reader", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not failures, failures


def _top(daemon: Daemon, *args: str) -> str:
    return f"{CHUNKD} top --url {daemon.url} {' '.join(args)}".strip()


PANELS = (
    "throughput",
    "tiers and hits",
    "backends",
    "peers",
    "checkpoints in flight",
    "hottest",
    "warnings and errors",
)


@needs_tmux
def test_live_view_fits_updates_resizes_and_quits(
    start_daemon: Callable[..., Daemon], terminal: Callable[..., Pane]
) -> None:
    daemon = start_daemon()
    names = _objects(daemon)
    pane = terminal(_top(daemon))
    screen = pane.wait_for(r"\blive\b", *PANELS, r"RAM\s+0 B/s", r"\blocal\b.* ok\b")
    lines = screen.splitlines()
    assert len(lines) <= 24
    assert all(len(line) <= 80 for line in lines)
    assert f"127.0.0.1:{daemon.port}" in screen
    assert "no [peers] in the config" in screen
    assert "no saves in flight" in screen

    with _reading(daemon, names):
        # the figures move: bytes from the cache, the objects read among the hottest
        pane.wait_for(r"RAM\s+[1-9][\d.]* (KiB|MiB|GiB)/s", r"local/top/hot-0\.bin")
        pane.wait_for(r"ram\s+[\d.]+ \w+/[\d.]+ GiB\s+[1-9][\d.]*% hit")

        pane.resize(120, 40)
        # bigger: the same panels, wider (the backend's bytes show), still one screen
        screen = pane.wait_for(*PANELS, r"latency p50", r"local\s+[\d.]+/s err\s+[\d.]+/s\s+\S+")
        lines = screen.splitlines()
        assert 24 < len(lines) <= 40
        assert all(len(line) <= 120 for line in lines)
        assert any(len(line.rstrip()) > 80 for line in lines)

        pane.resize(80, 24)
        screen = pane.wait_for(*PANELS)
        assert len(screen.splitlines()) <= 24

    pane.keys("q")
    assert pane.exit_status() == 0


@needs_tmux
def test_ctrl_c_quits(start_daemon: Callable[..., Daemon], terminal: Callable[..., Pane]) -> None:
    daemon = start_daemon()
    pane = terminal(_top(daemon))
    pane.wait_for(r"\blive\b", "throughput", r"RAM\s+\S+ B/s")
    pane.keys("C-c")
    assert pane.exit_status() == 0


@needs_tmux
def test_live_view_goes_on_through_a_daemon_restart(
    start_daemon: Callable[..., Daemon], terminal: Callable[..., Pane]
) -> None:
    first = start_daemon()
    pane = terminal(_top(first))
    pane.wait_for(r"\blive\b", "throughput")
    assert first.stop() == 0
    pane.wait_for(r"disconnected, retrying")

    second = start_daemon(port=first.port, cwd=first.cwd)
    status, _, body = second.get("/v1/dashboard")
    assert status == 200
    started = json.loads(body)["node"]["started"]
    # the pane's clock is the local time of this machine, as time.localtime
    at = time.strftime("%H:%M:%S", time.localtime(started))
    pane.wait_for(rf"daemon restarted at {at}", r"\blive\b", rf"127\.0\.0\.1:{second.port}")
    # and goes on: the new daemon's samples come in
    pane.wait_for(r"RAM\s+0 B/s", r"\blocal\b.* ok\b")
    pane.keys("q")
    assert pane.exit_status() == 0


@needs_tmux
def test_live_view_waits_for_a_daemon_that_is_not_there(terminal: Callable[..., Pane]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    pane = terminal(f"{CHUNKD} top --url {url}")
    pane.wait_for(r"disconnected, retrying in \d+s", r"no answer from")
    pane.keys("q")
    assert pane.exit_status() == 0


def test_once_prints_the_latest_sample_as_text(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon()
    done = subprocess.run(
        [str(CHUNKD), "top", "--once", "--url", daemon.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "\x1b" not in out  # not a terminal: no escape codes
    assert f"chunkd {json.loads(daemon.get('/v1/dashboard')[2])['node']['version']}" in out
    for heading in ("throughput", "tiers and hits", "backends", "peers", "checkpoints"):
        assert heading in out
    assert re.search(r"^RAM\s+\S+ B/s$", out, re.MULTILINE), out
    assert re.search(r"^local\s+[\d.]+/s err", out, re.MULTILINE), out


def test_json_prints_the_latest_sample(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon()
    done = subprocess.run(
        [str(CHUNKD), "top", "--json", "--url", daemon.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    sample = json.loads(done.stdout)
    status, _, body = daemon.get("/v1/dashboard")
    assert status == 200
    newest = json.loads(body)["history"][-1]
    # the sample as the daemon sent it: the same fields, no more, no less
    assert set(sample) == set(newest)
    assert sample["seq"] <= newest["seq"]
    assert [b["name"] for b in sample["backends"]] == ["local"]


def test_once_without_a_daemon_exits_1_saying_so() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [str(CHUNKD), "top", "--once", "--url", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert f"no answer from {url}" in done.stderr
    assert "is the daemon running" in done.stderr
    assert done.stdout == ""


def test_token_file_that_cannot_be_read(tmp_path: Path) -> None:
    missing = tmp_path / "no-token"
    done = subprocess.run(
        [str(CHUNKD), "top", "--once", "--token-file", str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert f"cannot read --token-file {missing}" in done.stderr
