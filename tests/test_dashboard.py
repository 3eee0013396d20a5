"""The dashboard's data: the snapshot, the per-second stream, resuming it, and what a
sample says about real reads (docs/dashboard.md)."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Daemon


def events(daemon: Daemon, *, last: str | None = None, timeout: float = 30) -> Iterator[dict]:
    """The server-sent events of ``/v1/dashboard/stream``, parsed, as they come."""
    conn = socket.create_connection(("127.0.0.1", daemon.port), timeout=timeout)
    request = "GET /v1/dashboard/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if last is not None:
        request += f"Last-Event-ID: {last}\r\n"
    conn.sendall((request + "\r\n").encode())
    reader = conn.makefile("rb")
    try:
        status = reader.readline()
        assert b" 200 " in status, status
        while reader.readline() not in (b"\r\n", b""):
            pass  # headers
        event: dict = {}
        for raw in _chunked_lines(reader):
            line = raw.rstrip("\n")
            if not line:
                if "data" in event or event.get("event"):
                    yield event
                event = {}
            elif line.startswith(":"):
                event.setdefault("comments", []).append(line[1:].strip())
            else:
                name, _, value = line.partition(": ")
                event[name] = json.loads(value) if name == "data" else value
    finally:
        reader.close()
        conn.close()


def _chunked_lines(reader) -> Iterator[str]:
    """The lines of a chunked HTTP body."""
    pending = b""
    while True:
        size_line = reader.readline()
        if not size_line:
            return
        size = int(size_line.strip() or b"0", 16)
        if size == 0:
            return
        pending += reader.read(size)
        reader.readline()
        while b"\n" in pending:
            line, _, pending = pending.partition(b"\n")
            yield line.decode() + "\n"


def snapshot(daemon: Daemon) -> dict:
    status, _, body = daemon.get("/v1/dashboard")
    assert status == 200
    return json.loads(body)


def wait_sample(daemon: Daemon, check, timeout: float = 30) -> dict:
    """The first sample in the daemon's history for which ``check`` holds (polled)."""
    deadline = time.monotonic() + timeout
    while True:
        for sample in snapshot(daemon)["history"]:
            if check(sample):
                return sample
        assert time.monotonic() < deadline, "no sample showed it"
        time.sleep(0.5)


def test_a_sample_shows_backend_reads_then_ram_hits_and_the_hot_object(start_daemon) -> None:
    daemon: Daemon = start_daemon()
    data = daemon.cwd / "chunkd-data"
    data.mkdir(exist_ok=True)
    (data / "big.bin").write_bytes(os.urandom(24 << 20))
    first = snapshot(daemon)
    assert first["schema"] == 1
    assert first["node"]["backends"] == ["local"]
    assert len(first["node"]["boot"]) == 16
    fields = {
        "seq", "t", "throughput", "hits", "hit_ratio", "backend", "backends",
        "singleflight_waits", "requests", "local_clients", "tiers", "peers",
        "checkpoints", "checkpoints_total", "hot", "errors", "errors_total",
        "jobs", "jobs_total", "cost",
    }  # fmt: skip
    sample = wait_sample(daemon, lambda s: True)
    assert set(sample) == fields
    assert sample["peers"] is None  # no [peers]
    assert [t["name"] for t in sample["tiers"]] == ["ram", "disk"]

    assert daemon.get("/v1/objects/local/big.bin")[0] == 200
    cold = wait_sample(daemon, lambda s: s["throughput"]["backend"] > 0 or s["hits"]["miss"] > 0)
    assert cold["backend"]["requests"] > 0
    assert cold["backends"][0]["name"] == "local"
    # Read it again: the RAM tier answers, and the second says so.
    for _ in range(2):
        assert daemon.get("/v1/objects/local/big.bin")[0] == 200
    warm = wait_sample(daemon, lambda s: s["throughput"]["ram"] > 0)
    assert warm["hit_ratio"]["ram"] is not None
    assert warm["hit_ratio"]["ram"] > 0.5
    assert warm["hits"]["ram"] > 0
    assert warm["hot"]["objects"][0]["name"] == "local/big.bin"
    assert warm["tiers"][0]["bytes"] >= 24 << 20
    assert warm["backend"]["latency_ms"]["p50"] is not None
    # The page and /metrics count the same reads.
    assert daemon.metric("chunkd_read_chunks_total", source="ram") >= 12
    assert daemon.metric("chunkd_read_chunk_bytes_total", source="ram") >= 2 * (24 << 20)


def test_the_stream_resumes_without_a_gap_and_says_when_the_daemon_restarted(
    start_daemon, tmp_path: Path
) -> None:
    daemon: Daemon = start_daemon()
    stream = events(daemon)
    seen = [e for e, _ in zip(stream, range(3), strict=False) if e.get("event") == "sample"]
    stream.close()
    last_id = seen[-1]["id"]
    boot, _, seq = last_id.partition(":")
    time.sleep(2.5)  # samples go by while this view is away
    resumed = events(daemon, last=last_id)
    got = [next(resumed)["data"]["seq"] for _ in range(3)]
    resumed.close()
    assert got == [int(seq) + 1, int(seq) + 2, int(seq) + 3]  # the missed ones first, in order

    port, cwd = daemon.port, daemon.cwd
    assert daemon.stop() == 0
    again: Daemon = start_daemon(port=port, cwd=cwd)
    after = events(again, last=last_id)
    first = next(after)
    second = next(after)
    after.close()
    assert first["event"] == "restarted"
    assert first["data"]["boot"] != boot
    assert first["data"] == snapshot(again)["node"]
    assert second["event"] == "sample"
    assert second["id"].startswith(first["data"]["boot"] + ":")


def test_open_streams_do_not_hold_up_a_stop(start_daemon) -> None:
    daemon: Daemon = start_daemon(env={"CHUNKD_SERVER_SHUTDOWN_TIMEOUT": "60"})
    streams = [events(daemon) for _ in range(3)]
    for stream in streams:
        assert next(stream)["event"] == "sample"
    began = time.monotonic()
    assert daemon.stop() == 0
    assert time.monotonic() - began < 30  # not the 60 s a stop gives requests in flight
    for stream in streams:
        # Each ends with the daemon (what was sent before the stop is still read).
        assert all(e["event"] == "sample" for e in stream)


def test_streams_are_bounded(start_daemon) -> None:
    daemon: Daemon = start_daemon()
    held = []
    try:
        for _ in range(64):
            conn = socket.create_connection(("127.0.0.1", daemon.port), timeout=30)
            conn.sendall(b"GET /v1/dashboard/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert b" 200 " in conn.recv(64)
            held.append(conn)
        status, _, body = daemon.get("/v1/dashboard/stream")
        assert status == 503
        assert "streams are open already" in json.loads(body)["message"]
    finally:
        for conn in held:
            conn.close()
    # Closed streams free their slots.
    deadline = time.monotonic() + 30
    while True:
        stream = events(daemon)
        try:
            assert next(stream)["event"] == "sample"
            break
        except AssertionError:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        finally:
            stream.close()


def test_the_error_tail_shows_what_the_daemon_warned_about(start_daemon, tmp_path: Path) -> None:
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there: the backend is down
    daemon: Daemon = start_daemon(
        f"[[backends]]\nname = 'local'\nurl = 'file://{tmp_path}/data'\n"
        "[[backends]]\nname = 'down'\nurl = 's3://nowhere'\n"
        f"endpoint = 'http://127.0.0.1:{port}'\nallow_http = true\nretries = 0\n"
        "access_key_id = 'AKIAEXAMPLEKEY123456'\nsecret_access_key = 'do-not-show-me'\n"
        "region = 'us-east-1'\n"
    )
    status, _, _ = daemon.get("/v1/objects/down/some/key")
    assert status == 503
    sample = wait_sample(daemon, lambda s: s["errors_total"] > 0)
    messages = [e["message"] for e in sample["errors"]]
    assert any("down/some/key" in m or "some/key" in m for m in messages), messages
    assert all(e["level"] in ("warning", "error", "critical") for e in sample["errors"])
    assert sample["backends"][1]["name"] == "down"
    text = json.dumps(snapshot(daemon))
    assert "do-not-show-me" not in text


@pytest.mark.parametrize("path", ["/", "/inspect/", "/login", "/static/chunkd.css"])
def test_pages_carry_a_strict_content_security_policy(start_daemon, path: str) -> None:
    daemon: Daemon = start_daemon()
    status, headers, _ = daemon.get(path)
    assert status == 200, path
    csp = headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp
    assert "script-src 'self'" in csp
    assert "unsafe-inline" not in csp
    assert "unsafe-eval" not in csp
    assert headers["X-Content-Type-Options"] == "nosniff"


def test_assets_are_only_the_shipped_files(start_daemon) -> None:
    daemon: Daemon = start_daemon()
    for bad in ("../api.py", "..%2Fapi.py", "telemetry.py", "nope.js", "%2e%2e%2fx.css"):
        status, _, _ = daemon.get(f"/static/{bad}")
        assert status == 404, bad
    status, headers, _ = daemon.get("/static/login.js")
    assert status == 200
    assert headers["Content-Type"].startswith("text/javascript")


def test_a_save_waiting_for_its_backend_shows_in_flight_with_its_progress(
    start_daemon, tmp_path: Path, bucket: str, s3_proxy
) -> None:
    torch = pytest.importorskip("torch")
    from chunkd.client import Client
    from chunkd.client import checkpoint as ckpt
    from tests.test_checkpoint import s3_toml

    daemon: Daemon = start_daemon(s3_toml(tmp_path, bucket, s3_proxy), cwd=tmp_path / "node")
    with Client(daemon.cwd / "chunkd.sock") as client:
        s3_proxy.down()
        state = {"w": torch.randn(512, 512)}
        handle = ckpt.async_save(state, "ckpt/seen/step-1", durability="local", client=client)
        assert handle.wait(30)  # durable on the node; the backend is down
        waiting = wait_sample(daemon, lambda s: s["checkpoints_total"] > 0)
        (job,) = waiting["checkpoints"]
        assert job["name"] == "ckpt/seen/step-1"
        assert (job["rank"], job["world_size"]) == (0, 1)
        # no replicas asked for (no [peers]): never called replicated, it stays local
        # until it is remote (docs/replicas.md)
        assert job["durability"] == "local"
        assert job["logical_bytes"] >= 512 * 512 * 4
        assert job["age_s"] >= 0
        s3_proxy.up()
        assert handle.wait(60, level="remote")
        done = wait_sample(daemon, lambda s: s["seq"] > waiting["seq"] and not s["checkpoints"])
        assert done["checkpoints_total"] == 0


def test_a_malformed_last_event_id_gets_the_stream_from_now(start_daemon) -> None:
    daemon: Daemon = start_daemon()
    for bad in ("garbage", "x:y", ":", "0" * 400, "a" * 16 + ":-5"):
        stream = events(daemon, last=bad)
        first = next(stream)
        stream.close()
        # another boot's id (or none that parses): said once, then samples go on
        assert first["event"] in ("restarted", "sample"), bad


@pytest.mark.timeout(10)
def test_peer_bytes_are_split_by_role_and_direction_and_the_replica_figures_read_the_counters() -> (
    None
):
    """The figures the peers panel shows come from the counters /metrics exports
    (issue 29): per member, bytes by direction and role (a rate between two readings,
    and the total since the start); the replica budget, use and outcomes."""
    from chunkd.gateway.dashboard.telemetry import peer_roles, replica_figures, role_reading
    from chunkd.gateway.metrics import Metrics

    metrics = Metrics()
    a, b = "198.18.0.2:8470", "198.18.0.3:8470"
    roles = metrics.peer_role_bytes
    roles.labels(peer=a, direction="in", role="owner").inc(1000)
    before = role_reading(metrics)
    roles.labels(peer=a, direction="in", role="owner").inc(4000)
    roles.labels(peer=a, direction="in", role="holder").inc(6000)
    roles.labels(peer=a, direction="out", role="replica").inc(8000)
    roles.labels(peer=b, direction="out", role="holder").inc(2000)
    now = role_reading(metrics)
    figures = peer_roles(a, now, before, 2.0)
    assert figures["roles"] == {
        "in": {"owner": 2000.0, "holder": 3000.0, "replica": 0.0},
        "out": {"owner": 0.0, "holder": 0.0, "replica": 4000.0},
    }
    assert figures["role_bytes"] == {
        "in": {"owner": 5000.0, "holder": 6000.0, "replica": 0.0},
        "out": {"owner": 0.0, "holder": 0.0, "replica": 8000.0},
    }
    # another member's bytes are its own
    assert peer_roles(b, now, before, 2.0)["role_bytes"]["out"]["holder"] == 2000.0
    assert peer_roles("198.18.0.9:8470", now, before, 2.0)["role_bytes"]["in"]["owner"] == 0.0

    metrics.replica_budget.set(1 << 30)
    metrics.replica_bytes.set(12 << 20)
    metrics.replica_received.labels(outcome="stored").inc(3)
    metrics.replica_received.labels(outcome="full").inc(2)
    metrics.replica_pushes.labels(peer=a, outcome="ok").inc(5)
    metrics.replica_pushes.labels(peer=b, outcome="full").inc(1)
    metrics.replica_saves.labels(outcome="partial").inc()
    assert replica_figures(metrics) == {
        "budget_bytes": 1 << 30,
        "bytes": 12 << 20,
        "received": {"stored": 3, "full": 2, "invalid": 0, "refused": 0},
        "pushes": {"ok": 5, "full": 1, "failed": 0},
        "saves": {"full": 0, "partial": 1, "none": 0},
    }
