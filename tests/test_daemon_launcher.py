"""The kit's one launcher of ``chunkd serve`` (:mod:`chunkd.testing.daemon`): what it
takes, how it waits, what it says when the daemon does not start, how it stops."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from chunkd.testing import DaemonProcess, free_port
from chunkd.testing.daemon import DaemonStartError


def _toml(root: Path) -> str:
    (root / "data").mkdir(parents=True, exist_ok=True)
    (root / "data" / "ok.bin").write_bytes(b"launched")
    return f"""
[cache]
dir = "{root / "cache"}"
ram_bytes = "16MiB"
disk_bytes = "64MiB"
disk_min_free_bytes = 0
fsync = "never"

[[backends]]
name = "local"
url = "file://{root / "data"}"
"""


@pytest.mark.timeout(60)
def test_a_daemon_starts_on_text_under_a_prefix_without_the_machines_chunkd_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A machine's own CHUNKD_* never reaches the daemon: this one would make it fail.
    monkeypatch.setenv("CHUNKD_CACHE_RAM_BYTES", "not a size")
    port = free_port()
    daemon = DaemonProcess(
        _toml(tmp_path),
        cwd=tmp_path / "work",
        prefix=("nice", "-n", "3"),
        env={"CHUNKD_SERVER_TOKEN": "launcher-token"},
        listen=f"127.0.0.1:{port}",
        socket=tmp_path / "work" / "chunkd.sock",
    )
    try:
        daemon.wait_ready(30.0).wait_socket(timeout=10.0)
        assert daemon.url == f"http://127.0.0.1:{port}"
        assert daemon.config == tmp_path / "work" / "chunkd.toml"
        assert "CHUNKD_CACHE_RAM_BYTES" not in daemon.env
        assert daemon.env["CHUNKD_SERVER_TOKEN"] == "launcher-token"
        # the prefix ran it: nice execs chunkd, whose niceness is the 19th field
        stat = Path(f"/proc/{daemon.pid}/stat").read_text()
        assert int(stat.rpartition(")")[2].split()[16]) == 3
    finally:
        assert daemon.stop() == 0
    assert "serving on" in daemon.log.read_text()


@pytest.mark.timeout(30)
def test_a_daemon_that_cannot_start_says_why_from_its_log(tmp_path: Path) -> None:
    daemon = DaemonProcess('[cache]\nram_bytes = "lots"\n', cwd=tmp_path, listen="127.0.0.1:1")
    with pytest.raises(DaemonStartError, match=r"exited with 2[\s\S]*ram_bytes"):
        daemon.wait_ready(20.0)


@pytest.mark.timeout(30)
def test_stop_kills_a_daemon_that_does_not_stop_in_time(tmp_path: Path) -> None:
    daemon = DaemonProcess(
        _toml(tmp_path),
        cwd=tmp_path / "work",
        listen=f"127.0.0.1:{free_port()}",
        socket=tmp_path / "work" / "chunkd.sock",
    )
    daemon.wait_ready(20.0)
    # a stopped process ignores everything but SIGKILL
    assert daemon.stop(signal.SIGSTOP, timeout=1.0) == -signal.SIGKILL
