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
from typing import Any

import pytest

from chunkd.gateway.cli.topfeed import Sample
from chunkd.gateway.cli.toppanels import (
    backends_text,
    durability_bar,
    hot_text,
    peers_text,
    per_second,
    spark,
    spark_rows,
)
from chunkd.testing import free_port

from .conftest import BIN, Daemon, small_node_toml

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
def _in_background(step: Callable[[], str | None], name: str) -> Iterator[None]:
    """``step`` again and again in a thread while inside; a step that returns a failure
    ends the loop, and the failure fails the test on the way out."""
    stop = threading.Event()
    failures: list[str] = []

    def loop() -> None:
        while not stop.is_set():
            failure = step()
            if failure is not None:
                failures.append(failure)
                return

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not failures, failures


@contextlib.contextmanager
def _reading(daemon: Daemon, names: list[str]) -> Iterator[None]:
    def read() -> str | None:
        for name in names:
            status, _, _ = daemon.get(f"/v1/objects/local/{name}")
            if status != 200:
                return f"{name}: HTTP {status}"
        return None

    with _in_background(read, "top-reader"):
        yield


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
    assert "checkpoints in flight: none" in screen  # nothing in flight: the panel folds

    with _reading(daemon, names):
        # the figures move: bytes from the cache, the objects read among the hottest
        pane.wait_for(r"RAM\s+[1-9][\d.]* (KiB|MiB|GiB)/s", r"local/top/hot-0\.bin")
        pane.wait_for(r"ram\s+[\d.]+ \w+/[\d.]+ GiB\s+[1-9][\d.]*% hit")

        pane.resize(120, 40)
        # bigger: the same panels, wider, and the hit ratio and latency panel; one screen
        screen = pane.wait_for(
            *PANELS,
            r"hit ratio and backend latency",
            r"latency p50",
            r"local\s+[\d.]+/s err\s+[\d.]+/s\s+\S+",
        )
        lines = screen.splitlines()
        assert 24 < len(lines) <= 40
        assert all(len(line) <= 120 for line in lines)
        assert any(len(line.rstrip()) > 80 for line in lines), screen

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


def _label_colour(pane: Pane, label: str) -> tuple[int, int, int]:
    """The colour ``label`` is drawn in on the pane now."""
    ansi = pane.tmux("capture-pane", "-e", "-p", "-t", pane.name)
    found = re.search(rf"38;2;(\d+);(\d+);(\d+)m{label}\s", ansi)
    assert found, ansi
    return int(found[1]), int(found[2]), int(found[3])


@needs_tmux
@pytest.mark.timeout(60)
def test_figures_dim_while_the_daemon_is_down(
    start_daemon: Callable[..., Daemon], terminal: Callable[..., Pane]
) -> None:
    daemon = start_daemon()
    pane = terminal(f"COLORTERM=truecolor {_top(daemon)}")
    pane.wait_for(r"\blive\b", r"RAM\s+0 B/s")
    live = _label_colour(pane, "RAM")
    assert daemon.stop() == 0
    pane.wait_for(r"disconnected, retrying", r"RAM\s+0 B/s")  # the last figures stay...
    stale = _label_colour(pane, "RAM")
    assert sum(stale) < sum(live) * 0.7, (live, stale)  # ...dimmed
    pane.keys("q")
    assert pane.exit_status() == 0


@needs_tmux
def test_live_view_waits_for_a_daemon_that_is_not_there(terminal: Callable[..., Pane]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    pane = terminal(f"{CHUNKD} top --url {url}")
    pane.wait_for(r"disconnected, retrying in \d+s", r"no answer from")
    # the layout follows the terminal's size, not only the samples (none come here)
    pane.resize(120, 40)
    pane.wait_for(r"hit ratio and backend latency")
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


# -- eight backends, the last busy: what a small screen must not hide ------------------


#: the backends of :func:`_backends`: ``train``, the last by name and in the config, is busy
BACKENDS = ("archive", "ckpt", "eval", "logs", "models", "scratch", "shared", "train")


def _backends(start_daemon: Callable[..., Daemon], tmp_path: Path) -> tuple[Daemon, Path]:
    """A daemon with the backends :data:`BACKENDS`; the root of ``train``, where
    :func:`_busy` writes."""
    roots = {name: tmp_path / name for name in BACKENDS}
    for root in roots.values():
        root.mkdir()
    toml = small_node_toml(tmp_path / "cache", *roots.items())
    return start_daemon(toml), roots["train"]


@contextlib.contextmanager
def _busy(daemon: Daemon, backend: str, root: Path) -> Iterator[None]:
    """Reads of ``backend`` (under ``root``) while inside: one object again and again, and
    new objects that miss the cache, so the backend has requests and bytes every second."""
    (root / "hot.bin").write_bytes(os.urandom(1 << 20))
    count = iter(range(1 << 30))

    def read() -> str | None:
        # one object read again and again (from RAM), one new object (from the backend)
        status, _, _ = daemon.get(f"/v1/objects/{backend}/hot.bin")
        if status != 200:
            return f"hot.bin: HTTP {status}"
        i = next(count)
        path = root / "busy" / f"{i}.bin"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(256 << 10))
        status, _, _ = daemon.get(f"/v1/objects/{backend}/busy/{i}.bin")
        path.unlink()
        if status != 200:
            return f"busy/{i}.bin: HTTP {status}"
        time.sleep(0.05)
        return None

    with _in_background(read, "top-busy"):
        yield


def _backend_lines(screen: str) -> list[str]:
    """The names of the backends' lines on ``screen``, top to bottom."""
    found = []
    for line in screen.splitlines():
        words = line.split()
        if words and words[0] in BACKENDS and re.search(r"/s err", line):
            found.append(words[0])
    return found


@needs_tmux
@pytest.mark.timeout(90)
def test_a_small_screen_shows_the_busy_backend_first_and_hides_idle_ones(
    start_daemon: Callable[..., Daemon], terminal: Callable[..., Pane], tmp_path: Path
) -> None:
    daemon, train = _backends(start_daemon, tmp_path)
    with _busy(daemon, "train", train):
        pane = terminal(_top(daemon), 80, 24)
        # train is the last backend by name and in the config, and the only busy one
        screen = pane.wait_for(r"\btrain\s+[1-9][\d.]*/s err", r"… \d+ more, idle")
    shown = _backend_lines(screen)
    assert shown[0] == "train", screen
    # what is hidden is idle; what is shown of the idle ones is in name order
    assert shown[1:] == sorted(shown[1:]), screen
    hidden = int(re.search(r"… (\d+) more, idle", screen)[1])  # type: ignore[index]
    assert len(shown) + hidden == len(BACKENDS)
    assert len(screen.splitlines()) <= 24
    pane.keys("q")
    assert pane.exit_status() == 0


@needs_tmux
@pytest.mark.timeout(90)
def test_a_big_screen_uses_its_room(
    start_daemon: Callable[..., Daemon], terminal: Callable[..., Pane], tmp_path: Path
) -> None:
    daemon, train = _backends(start_daemon, tmp_path)
    with _busy(daemon, "train", train):
        pane = terminal(_top(daemon), 120, 40)
        screen = pane.wait_for(
            r"hit ratio and backend latency",
            r"p99 latency\s+[\d.]+m?s [▁▂▃▄▅▆▇█ ]*[▁▂▃▄▅▆▇█]",
            r"\btrain\s+[1-9][\d.]*/s err.* ok [▁▂▃▄▅▆▇█ ]*[▁▂▃▄▅▆▇█]",  # its own sparkline
        )
    lines = screen.splitlines()
    # every backend has its line (the busy one first), and nothing says more are hidden
    assert _backend_lines(screen) == ["train", *BACKENDS[:-1]], screen
    assert "more, idle" not in screen
    # the throughput's sparklines are taller: RAM's chart has a line above its figure's
    ram = next(i for i, line in enumerate(lines) if line.startswith(" RAM "))
    assert re.search(r"^\s{20,}[▁▂▃▄▅▆▇█ ]*[▁▂▃▄▅▆▇█]", lines[ram - 1]), screen
    # the room is used: hardly a blank line (the status bar and footer aside)
    blank = [line for line in lines if not line.strip()]
    assert len(blank) <= 3, screen
    assert all(len(line) <= 120 for line in lines)
    pane.keys("q")
    assert pane.exit_status() == 0


def _css_colours() -> dict[str, tuple[int, int, int]]:
    """The dashboard's colour of each source, in its dark scheme (chunkd.css)."""
    css = (Path(__file__).parents[1] / "gateway/dashboard/static/chunkd.css").read_text()
    dark = css.split("prefers-color-scheme: dark", 1)[1]
    found = {}
    for source in ("ram", "disk", "peer", "backend"):
        value = re.search(rf"--{source}:\s*#([0-9a-fA-F]{{6}})", dark)
        assert value, f"chunkd.css has no --{source} in its dark scheme"
        found[source] = tuple(int(value[1][i : i + 2], 16) for i in (0, 2, 4))
    return found  # type: ignore[return-value]


@needs_tmux
@pytest.mark.timeout(60)
def test_each_source_has_the_dashboards_colour(
    start_daemon: Callable[..., Daemon], terminal: Callable[..., Pane]
) -> None:
    daemon = start_daemon()
    pane = terminal(f"COLORTERM=truecolor {_top(daemon)}", 80, 24)
    pane.wait_for(r"\blive\b", r"backend\s+\S+ B/s [▁▂▃▄▅▆▇█]")
    ansi = pane.tmux("capture-pane", "-e", "-p", "-t", pane.name)
    lines = ansi.splitlines()
    for source, label in (
        ("ram", "RAM"),
        ("disk", "disk"),
        ("peer", "peer"),
        ("backend", "backend"),
    ):
        line = next(line for line in lines if re.search(rf"m{label}\s+[\d.]+ \w*B/s", line))
        red, green, blue = _css_colours()[source]
        # the sparkline after the figure is drawn in that colour
        assert re.search(rf"38;2;{red};{green};{blue}m[▁▂▃▄▅▆▇█ ]*[▁▂▃▄▅▆▇█]", line), (
            source,
            line,
        )
    pane.keys("q")
    assert pane.exit_status() == 0


# -- the order of lists, on samples as the daemon sends them ---------------------------


def _sample(backends: list[dict[str, Any]], members: list[dict[str, Any]] | None = None) -> Sample:
    """A sample with these backends (and peers), every other field at rest."""
    return {
        "backend": {"requests": 0.0, "errors": 0.0, "bytes": 0.0, "latency_ms": None},
        "backends": [
            {"requests": 0.0, "errors": 0.0, "bytes": 0.0, "circuit_open": False} | b
            for b in backends
        ],
        "peers": None
        if members is None
        else {
            "self": "198.18.0.1:8470",
            "healthy": sum(m.get("healthy", True) for m in members),
            "members": [{"healthy": True, "in": 0.0, "out": 0.0} | m for m in members],
        },
    }


def test_backends_in_trouble_first_then_the_busiest_then_by_name() -> None:
    names = [{"name": n} for n in ("alpha", "beta", "delta", "gamma", "omega", "zulu")]
    quiet = _sample(names)
    busy = _sample(
        [
            {"name": "alpha"},
            {"name": "beta", "requests": 5.0},  # requests only
            {"name": "delta"},
            {"name": "gamma", "circuit_open": True},
            {"name": "omega", "bytes": 1e6, "requests": 1.0},
            {"name": "zulu", "bytes": 2e6, "requests": 1.0, "errors": 1.0},
        ]
    )
    # gamma's circuit is open now, zulu failed a request within the window
    now = _sample([{"name": "gamma", "circuit_open": True}, *names[:3], *names[4:]])
    history = [quiet, busy, now]
    text = backends_text(history, 100, 0, sparklines=False).plain
    order = [line.split()[0] for line in text.splitlines()[1:]]
    # an open circuit, then errors in the window, then bytes, then requests, then names
    assert order == ["gamma", "zulu", "omega", "beta", "alpha", "delta"]
    # five rows: the header, four lines, and the rest said to be idle
    short = backends_text(history, 100, 5, sparklines=False).plain.splitlines()
    assert [line.split()[0] for line in short[1:4]] == ["gamma", "zulu", "omega"]
    assert short[4] == "… 3 more"  # beta moved in the window: not idle
    shorter = backends_text(history, 100, 6, sparklines=False).plain.splitlines()
    assert shorter[5] == "… 2 more, idle"
    # the window is the last 10 samples: what moved before it no longer orders the list
    later = backends_text([busy] + [quiet] * 10, 100, 0, sparklines=False).plain
    assert [line.split()[0] for line in later.splitlines()[1:]] == sorted(n["name"] for n in names)


def test_peers_down_first_then_the_busiest() -> None:
    members = [
        {"address": "198.18.0.2:8470"},
        {"address": "198.18.0.3:8470", "in": 1e6},
        {"address": "198.18.0.4:8470", "healthy": False},
        {"address": "198.18.0.5:8470", "out": 3e6},
    ]
    text = peers_text([_sample([], members)], 80, 0, sparklines=False).plain
    order = [line.split()[0] for line in text.splitlines()[1:]]
    assert order == ["198.18.0.4:8470", "198.18.0.5:8470", "198.18.0.3:8470", "198.18.0.2:8470"]


def test_hot_datasets_never_hide_every_hot_object() -> None:
    def item(name: str, nbytes: float) -> dict[str, Any]:
        return {"name": name, "bytes": nbytes, "reads": 1.0}

    sample = {
        "hot": {
            "datasets": [item(f"ds-{i}", 1000.0 * i) for i in range(10)],
            "objects": [item("local/a", 5.0), item("local/b", 50.0)],
        }
    }
    lines = hot_text(sample, 60, 8).plain.splitlines()
    assert len(lines) == 8
    assert lines[0] == "datasets"
    # busiest first, within the kind's share of the rows
    assert [line.split()[0] for line in lines[1:4]] == ["ds-9", "ds-8", "ds-7"]
    assert lines[4].startswith("… 7 more")
    assert lines[5] == "objects"
    assert [line.split()[0] for line in lines[6:]] == ["local/b", "local/a"]


@pytest.mark.timeout(10)
def test_the_hottest_panel_fits_every_height_and_shows_items() -> None:
    """At 1 to 8 rows: never more lines than rows, and an item on the first line
    under 6 rows (no heading, no "… N more" alone); each kind's busiest from 2 rows."""

    def item(name: str, nbytes: float) -> dict[str, Any]:
        return {"name": name, "bytes": nbytes, "reads": 1.0}

    sample = {
        "hot": {
            "datasets": [item(f"ds-{i}", 1000.0 * i) for i in range(1, 7)],
            "objects": [item(f"local/o-{i}", 10.0 * i) for i in range(1, 7)],
        }
    }
    for rows in range(1, 9):
        lines = hot_text(sample, 60, rows).plain.splitlines()
        assert 1 <= len(lines) <= rows, (rows, lines)
        names = [line.split()[0] for line in lines if not line.startswith("…")]
        assert names, (rows, lines)
        if rows < 6:
            assert "datasets" not in lines, (rows, lines)
            assert "objects" not in lines, (rows, lines)
            assert names[0] == "ds-6"
            assert len(lines) == rows
            if rows >= 2:  # each kind's busiest, however busy the datasets are
                assert "local/o-6" in names, (rows, lines)
            if rows >= 3:
                hidden = 12 - len(names)
                assert lines[-1] == f"… {hidden} more", (rows, lines)
        else:
            assert lines[0] == "datasets"
            assert "objects" in lines
            # every heading has an item under it
            for heading in ("datasets", "objects"):
                after = lines[lines.index(heading) + 1]
                assert not after.startswith("…"), (rows, lines)
    # few enough items for the rows: all of them, no "more"
    few = {"hot": {"datasets": [item("ds-1", 5.0)], "objects": [item("local/a", 1.0)]}}
    assert [ln.split()[0] for ln in hot_text(few, 60, 3).plain.splitlines()] == [
        "ds-1",
        "local/a",
    ]


def test_rates_never_read_as_zero_when_they_are_not() -> None:
    assert per_second(0.0) == "0/s"
    assert per_second(0.05) == "0.05/s"
    assert per_second(0.0024) == "0.0024/s"
    assert per_second(12.53) == "12.5/s"
    assert per_second(150.4) == "150/s"
    # an object read once: its decayed bytes still show, its reads too
    hot = {"datasets": [], "objects": [{"name": "local/x", "bytes": 150e3, "reads": 0.05}]}
    assert hot_text({"hot": hot}, 60, 0).plain.endswith("146.5 KiB/s   0.05/s")
    hot["objects"][0]["reads"] = 0.0  # under the daemon's 3 decimals
    assert hot_text({"hot": hot}, 60, 0).plain.endswith("146.5 KiB/s <0.001/s")


def test_a_sparkline_of_several_lines() -> None:
    values: list[float | None] = [0.0, 8.0, None, 16.0]
    assert spark_rows(values, 4, 1) == [spark(values, 4)] == ["▁▅ █"]
    # top line first; zero is the baseline's eighth, so half the highest is just over
    # the lower line
    assert spark_rows(values, 4, 2) == [" ▁ █", "▁█ █"]
    assert spark_rows(values, 6, 2) == ["   ▁ █", "  ▁█ █"]  # the newest on the right


# -- screenshots: the pane's ANSI rendered to a PNG in headless Chromium ---------------

SHOTS = Path(os.environ.get("CHUNKD_SCREENSHOTS_DIR") or Path(__file__).parents[1] / "docs/images")


def _png(ansi: str, path: Path, width: int, height: int) -> None:
    """``capture-pane -e`` output as a PNG: rich turns the ANSI into HTML, Chromium draws it."""
    import io

    from rich.ansi import AnsiDecoder
    from rich.console import Console
    from rich.terminal_theme import MONOKAI, TerminalTheme

    from chunkd.testing.browser import chromium

    console = Console(
        record=True,
        file=io.StringIO(),
        width=width,
        color_system="truecolor",
        force_terminal=True,
        legacy_windows=False,
    )
    # one decoder for the whole capture: tmux writes a style once, not on every line
    for line in list(AnsiDecoder().decode(ansi))[:height]:
        console.print(line, crop=True, no_wrap=True)
    palette = [tuple(c) for c in MONOKAI.ansi_colors._colors]
    # the default colours are textual's screen's, as in a dark terminal
    theme = TerminalTheme((18, 18, 18), (224, 224, 224), palette[:8], palette[8:])
    html = console.export_html(
        theme=theme,
        inline_styles=True,
        code_format=(
            "<!DOCTYPE html><html><head><meta charset='utf-8'><style>"
            # textual's screen colours; a line as tall as the font's box, so the cells'
            # backgrounds and the block characters of the sparklines meet
            "body{{margin:0;background:#121212}}"
            "pre{{margin:0;padding:6px;display:inline-block;font:13px/1.16 'DejaVu Sans Mono',"
            "monospace;color:#e0e0e0;background:#121212}}"
            "</style></head><body><pre id='screen'><code>{code}</code></pre></body></html>"
        ),
    )
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_content(html)
        path.parent.mkdir(parents=True, exist_ok=True)
        page.locator("#screen").screenshot(path=str(path))


@needs_tmux
@pytest.mark.skipif(
    os.environ.get("CHUNKD_SCREENSHOTS") != "1", reason="CHUNKD_SCREENSHOTS=1 retakes them"
)
@pytest.mark.timeout(180)
def test_screenshots(
    start_daemon: Callable[..., Daemon], terminal: Callable[..., Pane], tmp_path: Path
) -> None:
    """docs/images/top-80x24.png and top-120x40.png: ``train`` busy, the others idle."""
    daemon, train = _backends(start_daemon, tmp_path)
    with _busy(daemon, "train", train):
        for width, height in ((80, 24), (120, 40)):
            pane = terminal(f"COLORTERM=truecolor {_top(daemon)}", width, height)
            pane.wait_for(r"\blive\b", r"backend\s+[1-9][\d.]* (KiB|MiB|GiB)/s")
            time.sleep(30)  # some history in the sparklines
            ansi = pane.tmux("capture-pane", "-e", "-p", "-t", pane.name)
            _png(ansi, SHOTS / f"top-{width}x{height}.png", width, height)
            pane.keys("q")
            assert pane.exit_status() == 0


def _role_bytes(**moved: float) -> dict[str, dict[str, float]]:
    """``role_bytes`` of a member: ``in_holder=3e6`` is 3 MB received from it as holder."""
    out = {d: dict.fromkeys(("owner", "holder", "replica"), 0.0) for d in ("in", "out")}
    for key, value in moved.items():
        direction, role = key.split("_")
        out[direction][role] = value
    return out


def test_peers_show_bytes_by_role_and_the_replica_line() -> None:
    """Issue 29: under each peer that exchanged chunks, its bytes by the role the sender
    played, each way; under the head, the replicas against their budget and this node's
    answers as an owner. Short of rows, the per-role lines go first."""
    members = [
        {"address": "198.18.0.2:8470", "role_bytes": _role_bytes(in_holder=3 << 20)},
        {
            "address": "198.18.0.3:8470",
            "in": 1e6,
            "role_bytes": _role_bytes(in_owner=12 << 20, out_replica=4 << 20),
        },
        {"address": "198.18.0.4:8470", "role_bytes": _role_bytes()},
    ]
    sample = _sample([], members)
    sample["peers"]["replicas"] = {
        "budget_bytes": 1 << 30,
        "bytes": 8 << 20,
        "received": {"stored": 2, "full": 1, "invalid": 0, "refused": 0},
        "pushes": {"ok": 5, "full": 3, "failed": 0},
        "saves": {"full": 1, "partial": 2, "none": 0},
    }
    sample["peers"]["holder_answers"] = {"served": 10, "holders": 4, "direct": 1}
    sample["peers"]["holders_tracked"] = 7
    lines = peers_text([sample], 120, 0, sparklines=False).plain.splitlines()
    assert lines[1] == (
        "replicas 8.0 MiB of 1.0 GiB; in 2 stored 1 full 0 invalid; out 5 ok 3 full 0 failed;"
        " saves 1 full 2 partial"
    )
    assert lines[2] == "as owner: served 10, to holders 4, direct 1; 7 chunks tracked"
    assert lines[3].startswith("198.18.0.3:8470")  # the busiest first
    assert lines[4] == "  from owner 12.0 MiB, to replica 4.0 MiB"
    assert lines[5].startswith("198.18.0.2:8470")
    assert lines[6] == "  from holder 3.0 MiB"
    assert lines[7].startswith("198.18.0.4:8470")  # nothing by role: no line under it
    assert len(lines) == 8
    # narrow: the same figures on more lines, none cut
    narrow = peers_text([sample], 40, 0, sparklines=False).plain.splitlines()
    assert narrow[1:5] == [
        "replicas 8.0 MiB of 1.0 GiB;",
        "in 2 stored 1 full 0 invalid;",
        "out 5 ok 3 full 0 failed;",
        "saves 1 full 2 partial",
    ]
    assert "  from owner 12.0 MiB," in narrow
    assert "  to replica 4.0 MiB" in narrow
    assert all(len(line) <= 40 and "…" not in line for line in narrow[1:] if line[0] != "1")
    # five rows: the head, the replica line and the three peers; the per-role lines and
    # then the owner's line give way
    short = peers_text([sample], 120, 5, sparklines=False).plain.splitlines()
    assert [line.split()[0] for line in short] == [
        "3", "replicas", "198.18.0.3:8470", "198.18.0.2:8470", "198.18.0.4:8470"
    ]  # fmt: skip


def test_the_durability_bar_has_the_replicated_level() -> None:
    """staged → local → replicated → remote (issue 29): a part each; the remote part
    fills as the bytes upload, from local on."""
    job = {"unique_bytes": 4 << 20, "remote_bytes": 2 << 20}
    assert durability_bar(job | {"durability": None}) == "░" * 12
    assert durability_bar(job | {"durability": "local"}) == "██████░░░▓░░"
    assert durability_bar(job | {"durability": "replicated"}) == "█████████▓░░"
    assert durability_bar(job | {"durability": "remote"}) == "█" * 12
