"""The daemon as a real process, reading from a real S3-protocol server (moto)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import signal
import socket
import time
import urllib.parse
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkd.cache import ChunkId
from chunkd.testing import refused_backend, s3_backend
from chunkd.testing.daemon import DaemonProcess

from .conftest import CountingProxy, Daemon, S3Server, free_port, get_from_namespace

MiB = 1 << 20


def s3_config(tmp_path: Path, bucket: str, proxy: CountingProxy, **backend: str | int) -> str:
    keys: dict[str, str | int] = {"timeout": "5s", "retries": 1, **backend}
    return f"""
[server]
shutdown_timeout = "10s"
log_format = "json"

[cache]
dir = "{tmp_path / "cache"}"
ram_bytes = "256MiB"
disk_bytes = "1GiB"
disk_min_free_bytes = 0
chunk_bytes = "4MiB"
fsync = "never"

{s3_backend("data", f"s3://{bucket}/pre", proxy.endpoint, **keys)}"""


def put(s3: S3Server, bucket: str, key: str, data: bytes) -> None:
    s3.client().put_object(Bucket=bucket, Key=f"pre/{key}", Body=data)


def test_embedded_default_serves_local_files(start_daemon, tmp_path: Path) -> None:
    daemon: Daemon = start_daemon(cwd=tmp_path / "work")
    data_dir = tmp_path / "work" / "chunkd-data"
    assert data_dir.is_dir()  # created for the newcomer
    payload = os.urandom(5 * MiB + 123)
    (data_dir / "shards").mkdir()
    (data_dir / "shards" / "a.bin").write_bytes(payload)
    status, headers, body = daemon.get("/v1/objects/local/shards/a.bin")
    assert status == 200
    assert body == payload
    assert headers["Content-Length"] == str(len(payload))
    assert (tmp_path / "work" / "chunkd-cache" / "index").is_dir()
    status, _, body = daemon.get(
        "/v1/objects/local/shards/a.bin", {"Range": "bytes=4194300-4194310"}
    )
    assert status == 206
    assert body == payload[4194300:4194311]
    assert daemon.metric("chunkd_cache_hits_total", tier="ram") >= 2
    assert daemon.stop() == 0


def test_a_whole_chunk_is_served_where_warnings_are_errors(start_daemon, tmp_path: Path) -> None:
    # A chunk's answer is written from its own view; aiohttp's Response would wrap the
    # view in a payload that warns above 1 MiB, a 500 under -W error.
    env = {"PYTHONWARNINGS": "error::ResourceWarning"}
    daemon: Daemon = start_daemon(cwd=tmp_path / "work", env=env)
    payload = os.urandom(5 * MiB)
    (tmp_path / "work" / "chunkd-data" / "w.bin").write_bytes(payload)
    assert daemon.get("/v1/objects/local/w.bin")[2] == payload
    first = ChunkId.of(payload[: 4 * MiB])
    status, headers, body = daemon.get(f"/v1/chunks/{first}")
    assert status == 200
    assert body == payload[: 4 * MiB]
    assert headers["ETag"] == f'"{first}"'
    assert headers["Content-Length"] == str(4 * MiB)
    assert daemon.stop() == 0


def test_concurrent_cold_readers_cost_one_backend_read(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str, s3_proxy: CountingProxy
) -> None:
    payload = os.urandom(64 * MiB)
    put(s3_server, bucket, "big.bin", payload)
    daemon: Daemon = start_daemon(s3_config(tmp_path, bucket, s3_proxy))
    want = hashlib.sha256(payload).hexdigest()
    s3_proxy.reset()

    def read() -> str:
        status, _, body = daemon.get("/v1/objects/data/big.bin")
        assert status == 200
        return hashlib.sha256(body).hexdigest()

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        digests = list(pool.map(lambda _: read(), range(16)))
    assert digests == [want] * 16
    # Measured outside the daemon: the bytes the S3 server sent through the proxy.
    assert len(payload) <= s3_proxy.bytes_down < 1.05 * len(payload)
    assert daemon.metric("chunkd_backend_read_bytes_total", backend="data") == len(payload)
    assert daemon.metric("chunkd_singleflight_waiters_total") > 0
    assert daemon.stop() == 0


def test_a_span_from_a_slow_steady_backend_outlives_the_request_timeout(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str, s3_proxy: CountingProxy
) -> None:
    # One span GET whose every 4 MiB chunk takes longer than the backend timeout,
    # though no read of it ever stalls: the timeout is for a backend that stops, not
    # a slow one.
    payload = os.urandom(8 * MiB)
    put(s3_server, bucket, "slow.bin", payload)
    daemon: Daemon = start_daemon(s3_config(tmp_path, bucket, s3_proxy, timeout="2s"))
    s3_proxy.reset()
    s3_proxy.delay = 3.0 / 64  # per 64 KiB: about 3 s per chunk, 6 s in all
    status, _, body = daemon.get("/v1/objects/data/slow.bin")
    s3_proxy.delay = 0.0
    assert status == 200
    assert body == payload
    assert len(payload) <= s3_proxy.bytes_down < len(payload) + (64 << 10)  # nothing twice
    assert daemon.metric("chunkd_backend_requests_total", backend="data", op="get") == 1
    assert daemon.stop() == 0


def test_kill_9_then_restart_serves_warm(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str, s3_proxy: CountingProxy
) -> None:
    payload = os.urandom(10 * MiB)
    put(s3_server, bucket, "ckpt.bin", payload)
    toml = s3_config(tmp_path, bucket, s3_proxy)
    first: Daemon = start_daemon(toml)
    assert first.get("/v1/objects/data/ckpt.bin")[2] == payload
    time.sleep(0.3)  # let the batched index writes commit
    first.process.kill()
    first.process.wait()
    s3_proxy.reset()
    second: Daemon = start_daemon(toml, port=first.port)
    status, _, body = second.get("/v1/objects/data/ckpt.bin")
    assert status == 200
    assert body == payload
    assert second.metric("chunkd_backend_read_bytes_total", backend="data") == 0
    assert s3_proxy.bytes_down < 64 * 1024  # a HEAD, no object bytes
    assert second.stop() == 0


def test_a_changed_object_is_read_whole_at_its_new_version(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str, s3_proxy: CountingProxy
) -> None:
    old = os.urandom(9 * MiB)
    new = os.urandom(9 * MiB)
    put(s3_server, bucket, "model.bin", old)
    daemon: Daemon = start_daemon(s3_config(tmp_path, bucket, s3_proxy, revalidate="200ms"))
    assert daemon.get("/v1/objects/data/model.bin")[2] == old
    put(s3_server, bucket, "model.bin", new)
    time.sleep(0.3)
    status, _, body = daemon.get("/v1/objects/data/model.bin")
    assert status == 200
    assert body == new
    # chunk by chunk too: never a mix of the two versions
    status, _, tail = daemon.get("/v1/objects/data/model.bin", {"Range": "bytes=5000000-"})
    assert tail == new[5000000:]
    assert daemon.stop() == 0


def test_backend_down_serves_cached_and_fails_fast_otherwise(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str, s3_proxy: CountingProxy
) -> None:
    cached = os.urandom(5 * MiB)
    cold = os.urandom(5 * MiB)
    put(s3_server, bucket, "cached.bin", cached)
    put(s3_server, bucket, "cold.bin", cold)
    daemon: Daemon = start_daemon(s3_config(tmp_path, bucket, s3_proxy))
    assert daemon.get("/v1/objects/data/cached.bin")[2] == cached
    s3_proxy.down()
    try:
        status, _, body = daemon.get("/v1/objects/data/cached.bin")
        assert status == 200
        assert body == cached
        started = time.monotonic()
        status, headers, body = daemon.get("/v1/objects/data/cold.bin")
        assert time.monotonic() - started < 15
        assert status == 503
        error = json.loads(body)
        assert error["error"] == "BackendUnavailableError"
        assert "data" in error["message"]
        assert headers.get("Retry-After")
    finally:
        s3_proxy.up()
    deadline = time.monotonic() + 20
    while True:  # recovers without a restart (after the circuit's cool-down)
        status, _, body = daemon.get("/v1/objects/data/cold.bin")
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert status == 200
    assert body == cold
    assert daemon.stop() == 0


def test_sd_notify_ready_and_stopping(start_daemon, tmp_path: Path) -> None:
    notify = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify))
    listener.settimeout(30)
    try:
        daemon: Daemon = start_daemon(cwd=tmp_path / "work", env={"NOTIFY_SOCKET": str(notify)})
        messages = []
        while not any("READY=1" in m for m in messages):
            messages.append(listener.recv(4096).decode())
        daemon.process.send_signal(signal.SIGTERM)
        while not any("STOPPING=1" in m for m in messages):
            messages.append(listener.recv(4096).decode())
        assert daemon.process.wait(timeout=30) == 0
    finally:
        listener.close()
    ready = next(m for m in messages if "READY=1" in m)
    assert "STATUS=" in ready


@pytest.fixture(scope="module")
def shared(tmp_path_factory, request):
    """One daemon for the bad-input tests (they must not disturb it)."""
    root = tmp_path_factory.mktemp("shared")
    (root / "chunkd-data").mkdir()
    (root / "chunkd-data" / "ok.bin").write_bytes(b"x" * 1000)
    port = free_port()
    launched = DaemonProcess(
        cwd=root,
        env={"CHUNKD_BACKENDS_LOCAL_ACCESS_KEY_ID": "ignored-but-set"},
        listen=f"127.0.0.1:{port}",
    )
    daemon = Daemon(launched.process, port, root / "none.toml", root, launched.env, launched.log)
    launched.wait_ready()
    yield daemon
    daemon.stop()


@pytest.mark.parametrize(
    ("path", "headers", "status", "kind"),
    [
        ("/v1/objects/nope/ok.bin", {}, 404, "UnknownBackendError"),
        ("/v1/objects/local/missing.bin", {}, 404, "ObjectNotFoundError"),
        ("/v1/objects/local/../etc/passwd", {}, 400, "InvalidKeyError"),
        ("/v1/objects/local/a/%2e%2e/ok.bin", {}, 400, "InvalidKeyError"),
        ("/v1/objects/local//ok.bin", {}, 400, "InvalidKeyError"),
        ("/v1/objects/local/ok%00.bin", {}, 400, "InvalidKeyError"),
        ("/v1/objects/local/ok%0a.bin", {}, 400, "InvalidKeyError"),
        ("/v1/objects/local/" + "k" * 1100, {}, 400, "InvalidKeyError"),
        ("/v1/objects/local/", {}, 400, "InvalidKeyError"),
        ("/v1/objects/local/ok.bin", {"Range": "bytes=oops"}, 400, "InvalidRangeError"),
        ("/v1/objects/local/ok.bin", {"Range": "bytes=0-1,5-6"}, 400, "InvalidRangeError"),
        ("/v1/objects/local/ok.bin", {"Range": "bytes=5000-"}, 416, "RangeNotSatisfiableError"),
        ("/v1/chunks/not-a-chunk-id", {}, 400, "InvalidChunkIdError"),
        ("/v1/chunks/" + "0" * 64, {}, 404, "ChunkNotFoundError"),
        ("/v1/nothing-here", {}, 404, "HTTPNotFound"),
    ],
)
def test_bad_input_gets_a_clear_4xx(shared: Daemon, path, headers, status, kind) -> None:
    got, response_headers, body = shared.get(path, headers)
    assert got == status, body
    error = json.loads(body)
    assert error["error"] == kind
    assert error["status"] == status
    assert error["message"]
    if status == 416:
        assert response_headers["Content-Range"] == "bytes */1000"
    assert shared.get("/v1/objects/local/ok.bin")[0] == 200  # still serving


def test_ranges_and_head(shared: Daemon) -> None:
    status, headers, body = shared.get("/v1/objects/local/ok.bin", {"Range": "bytes=-10"})
    assert (status, body) == (206, b"x" * 10)
    assert headers["Content-Range"] == "bytes 990-999/1000"
    assert headers["ETag"]
    import urllib.request

    request = urllib.request.Request(shared.url + "/v1/objects/local/ok.bin", method="HEAD")
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        assert response.headers["Content-Length"] == "1000"
        assert response.read() == b""


def test_metrics_stats_and_health(shared: Daemon) -> None:
    shared.get("/v1/objects/local/ok.bin")
    status, _, body = shared.get("/metrics")
    text = body.decode()
    for name in (
        "chunkd_backend_requests_total",
        "chunkd_backend_read_bytes_total",
        "chunkd_cache_hits_total",
        "chunkd_cache_misses_total",
        "chunkd_cache_bytes",
        "chunkd_singleflight_waiters_total",
        "chunkd_backend_request_seconds_bucket",
        "chunkd_read_seconds_bucket",
        "chunkd_cache_evictions_total",
        "chunkd_cache_integrity_failures_total",
    ):
        assert name in text, name
    status, _, body = shared.get("/v1/stats")
    assert status == 200
    stats = json.loads(body)
    assert stats["ready"] is True
    assert [b["name"] for b in stats["backends"]] == ["local"]
    assert stats["cache"]["tiers"][0]["name"] == "ram"
    assert shared.get("/healthz")[0] == 200
    assert shared.get("/readyz")[0] == 200
    assert shared.get("/")[0] == 200


def test_a_secret_never_shows_in_stats_or_logs(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str, s3_proxy: CountingProxy
) -> None:
    daemon: Daemon = start_daemon(s3_config(tmp_path, bucket, s3_proxy))
    _, _, body = daemon.get("/v1/stats")
    assert b"testing-secret" not in body
    assert daemon.stop() == 0
    assert "testing-secret" not in daemon.log.read_text()


def test_bad_config_fails_at_start_naming_key_and_file(start_daemon, tmp_path: Path) -> None:
    daemon: Daemon = start_daemon('[cache]\nram_bytes = "lots"\n', wait=False)
    assert daemon.process.wait(timeout=30) == 2
    message = daemon.log.read_text()
    assert "ram_bytes" in message
    assert str(daemon.config) in message


_SEGMENT = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=0, max_size=12
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    backend=st.sampled_from(["local", "nope", "", "LOCAL", "..", "%00"]),
    segments=st.lists(_SEGMENT, min_size=0, max_size=4),
    range_header=st.one_of(
        st.none(),
        st.text(max_size=30),
        st.builds(
            "bytes={}-{}".format,
            st.one_of(st.just(""), st.integers(0, 5000).map(str)),
            st.one_of(st.just(""), st.integers(0, 5000).map(str)),
        ),
    ),
)
def test_random_paths_and_headers_never_break_the_daemon(
    shared: Daemon, backend: str, segments: list[str], range_header: str | None
) -> None:
    path = "/v1/objects/" + urllib.parse.quote(backend, safe="") + "/"
    path += "/".join(urllib.parse.quote(s, safe="") for s in segments)
    headers = {}
    if range_header is not None:
        if any(ord(c) < 0x20 or ord(c) > 0x7E for c in range_header):
            range_header = range_header.encode("unicode_escape").decode("ascii")
        headers["Range"] = range_header
    status, _, body = shared.get(path, headers)
    assert status < 500, (path, headers, body)
    if status >= 400:
        error = json.loads(body)
        assert error["status"] == status
        assert error["message"]
    assert shared.get("/healthz")[0] == 200


def test_warm_loads_objects_ahead_and_shows_progress(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str, s3_proxy: CountingProxy
) -> None:
    import subprocess
    import sys

    first = os.urandom(9 * MiB)
    second = os.urandom(1 * MiB)
    put(s3_server, bucket, "w/a.bin", first)
    put(s3_server, bucket, "w/b.bin", second)
    daemon: Daemon = start_daemon(s3_config(tmp_path, bucket, s3_proxy))
    chunkd = str(Path(sys.executable).parent / "chunkd")
    done = subprocess.run(
        [chunkd, "warm", "--url", daemon.url, "data/w/a.bin", "data/w/b.bin", "data/w/none", "x"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout  # two of the four names are bad
    assert "data/w/a.bin: 9.0 MiB in 3 chunks, cached" in done.stdout
    assert "data/w/none: failed: 404" in done.stdout
    assert "x: not a name" in done.stdout
    assert "warmed 2 of 4 objects" in done.stdout
    loaded = daemon.metric("chunkd_backend_read_bytes_total", backend="data")
    assert loaded == len(first) + len(second)
    assert daemon.get("/v1/objects/data/w/a.bin")[2] == first
    assert daemon.metric("chunkd_backend_read_bytes_total", backend="data") == loaded
    unreachable = subprocess.run(
        [chunkd, "warm", "--url", "http://127.0.0.1:9", "data/w/a.bin"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert unreachable.returncode == 1
    assert "is the daemon running" in unreachable.stdout
    assert daemon.stop() == 0


def test_sigterm_lets_reads_in_flight_finish_and_flushes_the_index(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str, s3_proxy: CountingProxy
) -> None:
    payload = os.urandom(12 * MiB)
    put(s3_server, bucket, "slow.bin", payload)
    toml = s3_config(tmp_path, bucket, s3_proxy)
    daemon: Daemon = start_daemon(toml)
    s3_proxy.delay = 0.005  # about 1 s for the object: still in flight at SIGTERM
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reading = pool.submit(daemon.get, "/v1/objects/data/slow.bin")
        time.sleep(0.4)
        daemon.process.send_signal(signal.SIGTERM)
        status, _, body = reading.result(timeout=60)
    assert status == 200
    assert body == payload
    assert daemon.process.wait(timeout=30) == 0
    s3_proxy.delay = 0.0
    s3_proxy.reset()
    again: Daemon = start_daemon(toml, port=daemon.port)
    assert again.get("/v1/objects/data/slow.bin")[2] == payload
    assert again.metric("chunkd_backend_read_bytes_total", backend="data") == 0
    assert again.stop() == 0


def test_a_span_cut_mid_body_is_resumed_where_it_was_cut(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str, s3_proxy: CountingProxy
) -> None:
    payload = os.urandom(22 * MiB)
    put(s3_server, bucket, "cut.bin", payload)
    daemon: Daemon = start_daemon(s3_config(tmp_path, bucket, s3_proxy))
    s3_proxy.cut_after = 9 * MiB  # the one GET for all six chunks dies after about two
    status, _, body = daemon.get("/v1/objects/data/cut.bin")
    assert s3_proxy.cuts == 1
    assert status == 200
    assert body == payload
    # One more GET, for the rest of the span, not one per chunk left.
    assert daemon.metric("chunkd_backend_requests_total", backend="data", op="get") == 2
    assert daemon.get("/v1/objects/data/cut.bin")[2] == payload
    assert daemon.stop() == 0


def test_a_span_cut_in_its_last_chunk_costs_the_bytes_it_missed_only(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str, s3_proxy: CountingProxy
) -> None:
    # The concurrent cold readers above once cost 64 MiB + 4 MiB (+ one response's
    # headers): the span's response lost its tail on the way (the test proxy drops
    # what it still buffers when moto closes the connection, and counts it as sent),
    # and the read path read the whole last chunk again. Here the cut is made on
    # purpose, at the same place: what came of that chunk is kept.
    payload = os.urandom(16 * MiB)
    put(s3_server, bucket, "tail.bin", payload)
    daemon: Daemon = start_daemon(s3_config(tmp_path, bucket, s3_proxy))
    s3_proxy.reset()
    s3_proxy.cut_after = 16 * MiB - 256 * 1024
    status, _, body = daemon.get("/v1/objects/data/tail.bin")
    assert s3_proxy.cuts == 1
    assert status == 200
    assert body == payload
    assert daemon.metric("chunkd_backend_requests_total", backend="data", op="get") == 2
    # The backend client drops what it buffered towards a piece (1 MiB) when a body
    # breaks; a whole chunk (4 MiB) is no longer read twice.
    assert len(payload) <= s3_proxy.bytes_down < len(payload) + 3 * MiB // 2
    assert daemon.stop() == 0


def test_refused_credentials_are_a_403_naming_the_backend(start_daemon, tmp_path: Path) -> None:
    server = S3Server.start(checks_credentials_after=2)
    try:
        client = server.client()
        client.create_bucket(Bucket="locked")
        client.put_object(Bucket="locked", Key="pre/secret.bin", Body=b"no")
        daemon: Daemon = start_daemon(
            f"""
[cache]
dir = "{tmp_path / "cache"}"
fsync = "never"
disk_min_free_bytes = 0
{refused_backend(server.endpoint)}"""
        )
        status, _, body = daemon.get("/v1/objects/vault/secret.bin")
        assert status == 403
        error = json.loads(body)
        assert error["error"] == "BackendForbiddenError"
        assert "'vault'" in error["message"]
        assert "not-a-secret" not in error["message"]
        assert daemon.stop() == 0
    finally:
        server.stop()


def test_other_hosts_need_the_token_for_data(start_daemon, tmp_path: Path, other_host) -> None:

    ns, host_ip = other_host
    work = tmp_path / "work"
    (work / "chunkd-data").mkdir(parents=True)
    (work / "chunkd-data" / "ok.bin").write_bytes(b"data")
    port = free_port()
    daemon: Daemon = start_daemon(
        cwd=work,
        env={"CHUNKD_SERVER_LISTEN": f"{host_ip}:{port}", "CHUNKD_SERVER_TOKEN": "s3cret-token"},
        port=port,
    )

    def from_other_host(path: str, auth: str = "", target: Daemon | None = None) -> tuple[int, str]:
        return get_from_namespace(ns, (target or daemon).url + path, auth)

    assert from_other_host("/healthz")[0] == 200
    assert from_other_host("/metrics")[0] == 200
    status, body = from_other_host("/v1/objects/local/ok.bin")
    assert status == 401
    assert "Authorization" in body
    assert from_other_host("/v1/objects/local/ok.bin", "Bearer wrong")[0] == 401
    assert from_other_host("/v1/objects/local/ok.bin", "Bearer s3cret-token") == (200, "data")
    assert from_other_host("/v1/chunks/" + "0" * 64)[0] == 401
    assert daemon.stop() == 0

    # Without a token, other hosts get no data at all.
    port = free_port()
    open_daemon: Daemon = start_daemon(
        cwd=work, env={"CHUNKD_SERVER_LISTEN": f"{host_ip}:{port}"}, port=port
    )
    status, body = from_other_host("/v1/objects/local/ok.bin", target=open_daemon)
    assert status == 403
    assert "server.token" in body
    assert open_daemon.stop() == 0


def test_sequential_readers_get_readahead(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str, s3_proxy: CountingProxy
) -> None:
    payload = os.urandom(24 * MiB)
    put(s3_server, bucket, "seq.bin", payload)
    daemon: Daemon = start_daemon(s3_config(tmp_path, bucket, s3_proxy))
    chunk = 4 * MiB
    for index in range(2):  # two reads, each starting where the last one ended
        rng = f"bytes={index * chunk}-{(index + 1) * chunk - 1}"
        status, _, body = daemon.get("/v1/objects/data/seq.bin", {"Range": rng})
        assert status == 206
        assert body == payload[index * chunk : (index + 1) * chunk]
    deadline = time.monotonic() + 20
    while daemon.metric("chunkd_readahead_chunks_total") < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert daemon.metric("chunkd_readahead_chunks_total") == 4  # chunks 2-5, fetched ahead
    fetched = daemon.metric("chunkd_backend_read_bytes_total", backend="data")
    rng = f"bytes={2 * chunk}-{6 * chunk - 1}"
    status, _, body = daemon.get("/v1/objects/data/seq.bin", {"Range": rng})
    assert body == payload[2 * chunk : 6 * chunk]
    assert daemon.metric("chunkd_backend_read_bytes_total", backend="data") == fetched
    assert daemon.stop() == 0


def test_a_backend_that_stops_answering_is_a_fast_503(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str, s3_proxy: CountingProxy
) -> None:
    put(s3_server, bucket, "late.bin", os.urandom(MiB))
    daemon: Daemon = start_daemon(s3_config(tmp_path, bucket, s3_proxy, timeout="1s"))
    s3_proxy.delay = 30.0  # answers, then never sends the body in time
    started = time.monotonic()
    status, _, body = daemon.get("/v1/objects/data/late.bin")
    took = time.monotonic() - started
    s3_proxy.delay = 0.0
    assert status == 503
    assert "did not answer within 1s" in json.loads(body)["message"]
    assert took < 10  # 1 retry of a 1 s timeout, with backoff
    assert daemon.stop() == 0


def test_a_version_change_mid_read_cuts_the_body_and_the_next_read_is_whole(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str, s3_proxy: CountingProxy
) -> None:
    import http.client
    import urllib.request

    old = os.urandom(12 * MiB)
    new = os.urandom(12 * MiB)
    put(s3_server, bucket, "moving.bin", old)
    daemon: Daemon = start_daemon(s3_config(tmp_path, bucket, s3_proxy))  # immutable
    assert daemon.get("/v1/objects/data/moving.bin", {"Range": "bytes=0-99"})[2] == old[:100]
    put(s3_server, bucket, "moving.bin", new)
    with (
        urllib.request.urlopen(daemon.url + "/v1/objects/data/moving.bin", timeout=60) as r,
        pytest.raises(http.client.IncompleteRead) as cut,
    ):
        r.read()
    # What did arrive is the old version only: never a mix.
    assert old.startswith(cut.value.partial)
    assert len(cut.value.partial) < len(old)
    status, _, body = daemon.get("/v1/objects/data/moving.bin")
    assert status == 200
    assert body == new
    assert daemon.stop() == 0


def test_if_range_and_empty_objects(shared: Daemon) -> None:
    (shared.cwd / "chunkd-data" / "empty.bin").write_bytes(b"")
    status, headers, body = shared.get("/v1/objects/local/empty.bin")
    assert (status, body, headers["Content-Length"]) == (200, b"", "0")
    status, _, body = shared.get("/v1/objects/local/empty.bin", {"Range": "bytes=-5"})
    assert status == 416
    _, headers, _ = shared.get("/v1/objects/local/ok.bin")
    etag = headers["ETag"]
    status, _, body = shared.get(
        "/v1/objects/local/ok.bin", {"Range": "bytes=0-9", "If-Range": etag}
    )
    assert (status, body) == (206, b"x" * 10)
    status, _, body = shared.get(
        "/v1/objects/local/ok.bin", {"Range": "bytes=0-9", "If-Range": '"another"'}
    )
    assert (status, len(body)) == (200, 1000)  # another version: the whole object
    assert shared.metric("chunkd_http_requests_total", status="416") >= 1


def test_socket_group_takes_a_name_or_a_numeric_gid(start_daemon, tmp_path: Path) -> None:
    import grp

    group = grp.getgrgid(os.getgid() if os.getgid() else 1)  # one that exists here
    for named in (group.gr_name, str(group.gr_gid)):
        run = tmp_path / f"run-{named}"
        daemon: Daemon = start_daemon(
            f'[server]\nsocket_group = "{named}"\n[cache]\ndir = "{run / "cache"}"\n'
            f'[[backends]]\nname = "local"\nurl = "file://{run}"\n',
            cwd=run,
        )
        assert os.stat(run / "chunkd.sock").st_gid == group.gr_gid
        assert daemon.stop() == 0
    missing = start_daemon(
        f'[server]\nsocket_group = "no-such-group-x"\n[cache]\ndir = "{tmp_path / "c"}"\n'
        f'[[backends]]\nname = "local"\nurl = "file://{tmp_path}"\n',
        wait=False,
    )
    assert missing.process.wait(timeout=30) != 0
    assert "socket_group 'no-such-group-x' is not a group on this host" in missing.log.read_text()
