"""Figures an operator reads must say what happened, and a self-check must touch nothing
of a daemon's (issue 24): real daemons on their embedded default, as ``make run``
starts one, read over HTTP and the local socket; ``chunkd`` commands as subprocesses.

- ``chunkd_cache_hits_total{tier}`` and ``chunkd_cache_misses_total``: a cold read is
  a miss per chunk and no hit; a warm read a RAM hit per chunk; after a restart, a disk
  hit per chunk. They agree with ``chunkd_read_chunks_total{source}`` exactly (the
  README's example is run as written by tests/test_walkthrough.py).
- ``chunkd_backend_errors_total``: an absence a caller asked about (a dataset's frozen
  record that does not exist, a missing object) is an answer, not a backend error; a
  backend that cannot be reached still is one.
- ``chunkd selfcheck`` works in a directory of its own, and refuses a cache directory
  a daemon holds (or any directory that holds a cache) without changing it.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from chunkd.client import Client
from chunkd.client.datasets import Dataset
from chunkd.testing import free_port, s3_backend

from .conftest import BIN, Daemon, wait_for_socket

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
CHUNK = 4 * MiB  # the embedded default's cache.chunk_bytes


def counters(daemon: Daemon) -> dict[str, float]:
    """The cache's and the read path's chunk counters, by a short name."""
    return {
        "ram": daemon.metric("chunkd_cache_hits_total", tier="ram"),
        "disk": daemon.metric("chunkd_cache_hits_total", tier="disk"),
        "miss": daemon.metric("chunkd_cache_misses_total"),
        "read_ram": daemon.metric("chunkd_read_chunks_total", source="ram"),
        "read_disk": daemon.metric("chunkd_read_chunks_total", source="disk"),
        "read_fetched": daemon.metric("chunkd_read_chunks_total", source="fetched"),
    }


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def read(daemon: Daemon, name: str) -> bytes:
    status, _, body = daemon.get(f"/v1/objects/{name}")
    assert status == 200, body[:300]
    return body


def expect(*, ram: int = 0, disk: int = 0, miss: int = 0) -> dict[str, float]:
    """The counters' change for a read: the cache's and the read path's, the same."""
    return {
        "ram": ram,
        "disk": disk,
        "miss": miss,
        "read_ram": ram,
        "read_disk": disk,
        "read_fetched": miss,
    }


def disk_chunks(cache: Path) -> dict[str, tuple[int, int]]:
    """Every chunk file of a cache directory: its name, size and mtime."""
    found = {}
    for path in (cache / "chunks").rglob("*"):
        if path.is_file():
            st = path.stat()
            found[path.name] = (st.st_size, st.st_mtime_ns)
    return found


def chunkd(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    environ.update(env or {})
    return subprocess.run(
        [str(BIN / "chunkd"), *args],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# -- cache hits and misses -----------------------------------------------------------------


@pytest.mark.timeout(40)
def test_a_cold_read_counts_misses_a_warm_read_ram_hits_and_a_restart_disk_hits(
    start_daemon: Any, tmp_path: Path
) -> None:
    daemon: Daemon = start_daemon()
    body = os.urandom(2 * CHUNK + 12345)  # three chunks
    (daemon.cwd / "chunkd-data" / "three.bin").write_bytes(body)

    before = counters(daemon)
    assert read(daemon, "local/three.bin") == body
    cold = counters(daemon)
    assert delta(cold, before) == expect(miss=3)

    assert read(daemon, "local/three.bin") == body
    warm = counters(daemon)
    assert delta(warm, cold) == expect(ram=3)

    # A range of one chunk: one lookup, one hit.
    status, _, part = daemon.get(
        "/v1/objects/local/three.bin", {"Range": f"bytes={CHUNK}-{CHUNK + 9}"}
    )
    assert status == 206
    assert part == body[CHUNK : CHUNK + 10]
    assert delta(counters(daemon), warm) == expect(ram=1)

    # The local socket's reads count the same way.
    (daemon.cwd / "chunkd-data" / "two.bin").write_bytes(body[: CHUNK + 1])
    with Client(daemon.cwd / "chunkd.sock") as client:
        start = counters(daemon)
        assert bytes(client.read("local/two.bin")) == body[: CHUNK + 1]
        after_cold = counters(daemon)
        assert delta(after_cold, start) == expect(miss=2)
        # The client keeps what it mapped: a fresh one asks the daemon again.
    with Client(daemon.cwd / "chunkd.sock") as client:
        assert bytes(client.read("local/two.bin")) == body[: CHUNK + 1]
    assert delta(counters(daemon), after_cold) == expect(ram=2)

    # After a restart RAM is empty and the disk tier answers: a disk hit per chunk.
    assert daemon.stop() == 0
    again: Daemon = start_daemon(cwd=daemon.cwd, port=free_port())
    before = counters(again)
    assert before == expect()
    assert read(again, "local/three.bin") == body
    restarted = counters(again)
    assert delta(restarted, before) == expect(disk=3)
    assert read(again, "local/three.bin") == body
    assert delta(counters(again), restarted) == expect(ram=3)


@pytest.mark.timeout(40)
def test_concurrent_cold_readers_count_each_lookup_once_where_it_was_answered(
    start_daemon: Any,
) -> None:
    daemon: Daemon = start_daemon()
    body = os.urandom(6 * CHUNK)
    (daemon.cwd / "chunkd-data" / "six.bin").write_bytes(body)
    readers = 8
    got: list[bytes] = []

    def reader() -> None:
        got.append(read(daemon, "local/six.bin"))

    before = counters(daemon)
    threads = [threading.Thread(target=reader) for _ in range(readers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == [body] * readers
    change = delta(counters(daemon), before)
    # Each reader's lookup of each chunk is counted once: a miss (it was fetched, or
    # the reader waited on the fetch) or a hit in the tier that held it.
    assert change["ram"] + change["disk"] + change["miss"] == readers * 6
    assert change["miss"] >= 6  # the first reader's, at least
    assert change["disk"] == 0  # nothing was evicted from RAM
    assert change["ram"] == change["read_ram"]
    assert change["miss"] == change["read_fetched"]
    assert daemon.metric("chunkd_backend_read_bytes_total") == len(body)  # once


# -- backend errors ------------------------------------------------------------------------


@pytest.mark.timeout(40)
def test_opening_a_dataset_and_reading_a_missing_object_are_no_backend_errors(
    start_daemon: Any, tmp_path: Path
) -> None:
    down = free_port()  # nothing listens there
    config = tmp_path / "node.toml"
    data = tmp_path / "node" / "chunkd-data"
    (data / "recs").mkdir(parents=True)
    config.write_text(
        f"""
[cache]
dir = "{tmp_path}/node/chunkd-cache"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
fsync = "never"

[[backends]]
name = "local"
url = "file://{data}"
writable = true

"""
        + s3_backend("down", "s3://nowhere/x", f"http://127.0.0.1:{down}", retries=0, timeout="2s")
    )
    daemon: Daemon = start_daemon(config.read_text(), cwd=tmp_path / "node")
    assert wait_for_socket(daemon.cwd / "chunkd.sock", 10)
    for i in range(3):
        (data / "recs" / f"part-{i}.bin").write_bytes(os.urandom(16 * 100))
    env = {"CHUNKD_SOCKET": str(daemon.cwd / "chunkd.sock")}
    registered = chunkd(
        "dataset",
        "register",
        "recs",
        "local/recs/",
        "--format",
        "fixed:16",
        cwd=daemon.cwd,
        env=env,
    )
    assert registered.returncode == 0, registered.stdout + registered.stderr

    def not_found_errors() -> float:
        return daemon.metric(
            "chunkd_backend_errors_total", backend="local", kind="ObjectNotFoundError"
        )

    gets = daemon.metric("chunkd_backend_requests_total", backend="local", op="get")
    answered = daemon.metric("chunkd_backend_not_found_total", backend="local")
    with Client(daemon.cwd / "chunkd.sock") as client:
        for _ in range(5):
            dataset = Dataset.open("recs@1", client)
            assert len(dataset) == 300, dataset
            assert not dataset.registry.get("frozen")
    # Each open asked whether the snapshot is frozen: the registry answered "no such
    # record", an answer (counted as one), not a backend failing.
    assert daemon.metric("chunkd_backend_requests_total", backend="local", op="get") >= gets + 5
    assert not_found_errors() == 0
    assert daemon.metric("chunkd_backend_not_found_total", backend="local") >= answered + 5

    # A missing object is a 404 for its reader, and no error of the backend's.
    status, _, answer = daemon.get("/v1/objects/local/no/such.bin")
    assert status == 404, answer
    assert not_found_errors() == 0
    errors = daemon.metric("chunkd_backend_errors_total", backend="local")
    assert errors == 0, daemon.log.read_text()[-3000:]

    # A backend that cannot be reached is a backend error still.
    status, _, answer = daemon.get("/v1/objects/down/x.bin")
    assert status == 503, answer
    assert (
        daemon.metric("chunkd_backend_errors_total", backend="down", kind="BackendUnavailableError")
        >= 1
    )
    _, _, stats = daemon.get("/v1/stats")
    assert json.loads(stats)


# -- chunkd selfcheck ----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_selfcheck_never_touches_a_daemons_cache(start_daemon: Any, tmp_path: Path) -> None:
    daemon: Daemon = start_daemon()
    body = os.urandom(5 * CHUNK)
    (daemon.cwd / "chunkd-data" / "five.bin").write_bytes(body)
    assert read(daemon, "local/five.bin") == body
    cache = daemon.cwd / "chunkd-cache"
    held = disk_chunks(cache)
    assert len(held) == 5
    chunks_metric = daemon.metric("chunkd_cache_chunks", tier="disk")
    assert chunks_metric == 5
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {"TMPDIR": str(scratch)}

    # As users run it, next to the daemon: a directory of its own, removed after.
    ran = chunkd("selfcheck", "--chunks", "4", cwd=daemon.cwd, env=env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "selfcheck passed" in ran.stdout
    first = ran.stdout.splitlines()[0]
    assert str(scratch) in first, first
    assert str(cache) not in first, first
    assert list(scratch.iterdir()) == []  # removed after
    assert disk_chunks(cache) == held
    assert daemon.metric("chunkd_cache_chunks", tier="disk") == chunks_metric

    # Pointed at the daemon's cache: refused, with the daemon named; nothing changes.
    for target in ("chunkd-cache", str(cache)):
        refused = chunkd("selfcheck", "--chunks", "4", "--dir", target, cwd=daemon.cwd, env=env)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "in use by another chunkd" in refused.stdout
        assert f"pid {daemon.process.pid}" in refused.stdout
        assert "Traceback" not in refused.stdout + refused.stderr
        assert disk_chunks(cache) == held
    assert read(daemon, "local/five.bin") == body
    assert daemon.metric("chunkd_cache_chunks", tier="disk") == chunks_metric

    # A stopped daemon's cache may hold checkpoint chunks not uploaded yet: a
    # selfcheck refuses any directory that holds a cache, in use or not.
    assert daemon.stop() == 0
    refused = chunkd("selfcheck", "--chunks", "4", "--dir", str(cache), cwd=daemon.cwd, env=env)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "holds a chunkd cache" in refused.stdout
    assert disk_chunks(cache) == held
    # An empty directory of the user's choosing: used, and left empty again.
    own = tmp_path / "own"
    own.mkdir()
    ran = chunkd("selfcheck", "--chunks", "4", "--dir", str(own), cwd=daemon.cwd, env=env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert list(own.iterdir()) == []
