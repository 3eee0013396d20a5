"""A backend outage: what a daemon serves from its cache, before and after a restart."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .conftest import CountingProxy, Daemon, S3Server
from .test_daemon import MiB, put, s3_config

NAMES = [f"out/{n}.bin" for n in range(6)]


def cache_six(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str, toml: str
) -> dict[str, bytes]:
    """Put six objects (one to two chunks each) and read them through a daemon that is
    then stopped: its cache holds them, and its index what it validated."""
    payloads = {name: os.urandom(MiB + n * 700_000) for n, name in enumerate(NAMES)}
    for name, data in payloads.items():
        put(s3_server, bucket, name, data)
    first: Daemon = start_daemon(toml)
    for name, data in payloads.items():
        status, _, body = first.get(f"/v1/objects/data/{name}")
        assert (status, body == data) == (200, True)
    assert first.stop() == 0  # SIGTERM: the index is flushed
    return payloads


def test_an_immutable_backend_serves_its_cache_after_a_restart_in_an_outage(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str, s3_proxy: CountingProxy
) -> None:
    toml = s3_config(tmp_path, bucket, s3_proxy)  # revalidate = "immutable"
    payloads = cache_six(start_daemon, tmp_path, s3_server, bucket, toml)
    s3_proxy.down()
    try:
        again: Daemon = start_daemon(toml)
        for name, data in payloads.items():
            status, headers, body = again.get(f"/v1/objects/data/{name}")
            assert status == 200, body
            assert body == data
            assert "X-Chunkd-Stale" not in headers  # immutable: never stale
        # Nothing was asked of the backend: the versions came from the index.
        assert again.metric("chunkd_backend_requests_total", backend="data") == 0
        assert again.metric("chunkd_stale_served_total") == 0
    finally:
        s3_proxy.up()
    assert again.stop() == 0


def test_a_duration_backend_serves_its_cache_stale_after_a_restart_in_an_outage(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str, s3_proxy: CountingProxy
) -> None:
    toml = s3_config(tmp_path, bucket, s3_proxy, revalidate="10m")  # stale_if_error: 1 day
    payloads = cache_six(start_daemon, tmp_path, s3_server, bucket, toml)
    s3_proxy.down()
    try:
        again: Daemon = start_daemon(toml)
        for name, data in payloads.items():
            status, headers, body = again.get(f"/v1/objects/data/{name}")
            assert status == 200, body
            assert body == data
            assert headers["Warning"] == '111 chunkd "Revalidation Failed"'
            assert 0 <= int(headers["X-Chunkd-Stale"]) < 60  # since the first daemon's check
        # Stale for as long as the backend cannot say otherwise, every time.
        status, headers, _ = again.get(f"/v1/objects/data/{NAMES[0]}")
        assert status == 200
        assert "X-Chunkd-Stale" in headers
        assert again.metric("chunkd_stale_served_total", backend="data") == len(NAMES) + 1
        # Each check was one conditional GET (If-None-Match: a current version sends no
        # bytes), which failed; no chunk was asked for: every byte came from the cache.
        assert again.metric("chunkd_backend_read_bytes_total", backend="data") == 0
        assert again.metric("chunkd_backend_requests_total", backend="data", op="head") == 0
    finally:
        s3_proxy.up()
    # Once the backend answers (after the circuit's cool-down), the version is
    # checked again and fresh.
    deadline = time.monotonic() + 20
    while True:
        status, headers, _ = again.get(f"/v1/objects/data/{NAMES[0]}")
        if "X-Chunkd-Stale" not in headers or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert status == 200
    assert "X-Chunkd-Stale" not in headers
    assert again.stop() == 0


def test_past_stale_if_error_a_restarted_daemon_answers_503(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str, s3_proxy: CountingProxy
) -> None:
    toml = s3_config(tmp_path, bucket, s3_proxy, revalidate="10m", stale_if_error=0)
    cache_six(start_daemon, tmp_path, s3_server, bucket, toml)
    s3_proxy.down()
    try:
        again: Daemon = start_daemon(toml)
        for name in NAMES:
            status, headers, body = again.get(f"/v1/objects/data/{name}")
            assert status == 503
            error = json.loads(body)
            assert error["error"] == "BackendUnavailableError"
            assert "stale_if_error" in error["message"]
            assert headers.get("Retry-After")
        assert again.metric("chunkd_stale_served_total") == 0
    finally:
        s3_proxy.up()
    assert again.stop() == 0


def test_a_known_version_is_served_stale_only_within_the_window(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str, s3_proxy: CountingProxy
) -> None:
    # The same window applies to what the running daemon holds in memory.
    data = os.urandom(MiB)
    put(s3_server, bucket, "window.bin", data)
    toml = s3_config(tmp_path, bucket, s3_proxy, revalidate="200ms", stale_if_error="3s")
    daemon: Daemon = start_daemon(toml)
    assert daemon.get("/v1/objects/data/window.bin")[2] == data
    checked = time.monotonic()
    s3_proxy.down()
    try:
        time.sleep(0.3)  # past revalidate: the next read asks the backend, which fails
        status, headers, body = daemon.get("/v1/objects/data/window.bin")
        assert status == 200
        assert body == data
        assert headers["Warning"] == '111 chunkd "Revalidation Failed"'
        assert daemon.metric("chunkd_stale_served_total", backend="data") == 1
        time.sleep(max(0.0, checked + 3.5 - time.monotonic()))
        status, _, body = daemon.get("/v1/objects/data/window.bin")
        assert status == 503, body
        assert "stale_if_error (3s)" in json.loads(body)["message"]
        assert daemon.metric("chunkd_stale_served_total", backend="data") == 1
    finally:
        s3_proxy.up()
    assert daemon.stop() == 0
