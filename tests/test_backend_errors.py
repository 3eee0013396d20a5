"""A key a backend cannot hold is the request's fault: a 4xx, never a backend outage.

Each backend kind refuses its own keys. A file:// backend's filesystem refuses a path
segment over NAME_MAX ("File name too long"), and object_store's LocalFileSystem
keeps names that end in ``#`` and digits for its temporary files; a key below a key
that is a file does not exist. obstore's MemoryStore holds every key chunkd's
``validate_key`` lets through (every character from U+0020 up and keys far over 1024
bytes were tried). S3 holds keys of at most 1024 bytes, its prefix included; moto
holds longer ones and answers no key that ``validate_key`` allows with a 400, so
chunkd refuses an over-long key itself, before asking. None of these may be retried,
counted as a backend failure, or open the backend's circuit.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from pathlib import Path

from chunkd.testing import S3Server, s3_backend
from tests.conftest import Daemon

CACHE = """
[server]
log_format = "json"

[cache]
dir = "{dir}"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
fsync = "never"
"""


def config(tmp_path: Path, *backends: str) -> str:
    return CACHE.format(dir=tmp_path / "cache") + "\n".join(backends)


def read(daemon: Daemon, name: str) -> tuple[int, dict[str, str], bytes, float]:
    started = time.monotonic()
    status, headers, body = daemon.get("/v1/objects/" + urllib.parse.quote(name))
    return status, headers, body, time.monotonic() - started


def assert_backend_healthy(daemon: Daemon, backend: str) -> None:
    assert daemon.metric("chunkd_backend_circuit_open", backend=backend) == 0
    assert (
        daemon.metric(
            "chunkd_backend_errors_total", backend=backend, kind="BackendUnavailableError"
        )
        == 0
    )
    _, _, body = daemon.get("/v1/stats")
    circuits = {b["name"]: b["circuit_open"] for b in json.loads(body)["backends"]}
    assert circuits[backend] is False


def test_keys_a_file_backend_cannot_hold_are_4xx_and_leave_it_up(
    start_daemon, tmp_path: Path
) -> None:
    root = tmp_path / "files"
    root.mkdir()
    (root / "ok.bin").write_bytes(b"x" * 1000)
    (root / "dir").mkdir()
    (root / "dir" / "inside.bin").write_bytes(b"y" * 10)
    (root / "deep" / "deep" / "deep").mkdir(parents=True)
    (root / "cold.bin").write_bytes(b"z" * 2000)
    daemon: Daemon = start_daemon(
        config(tmp_path, f'[[backends]]\nname = "local"\nurl = "file://{root}"\nretries = 3\n')
    )
    too_long = "a" * 256  # one byte over NAME_MAX; the whole key is far under 1024
    refused = {
        too_long: "too long",
        "deep/" * 3 + "é" * 128: "too long",  # 256 bytes in 128 characters
        "shard#1": "'#'",
    }
    # Below a file (ENOTDIR), below a directory that is not there, a directory.
    missing = ["ok.bin/x", "ok.bin/x/y.bin", "ok.bin/" + too_long, "nope/" + too_long, "dir"]
    requests_before = daemon.metric("chunkd_backend_requests_total", backend="local")
    for _ in range(3):  # two such requests opened the circuit before
        for key, why in refused.items():
            status, _, body, took = read(daemon, f"local/{key}")
            error = json.loads(body)
            assert (status, error["error"]) == (400, "InvalidKeyError"), body
            assert why in error["message"], error["message"]
            assert "local" in error["message"]
            assert str(root) not in error["message"]  # the daemon's own paths stay its own
            assert took < 2  # no retries with backoff
        for key in missing:
            status, _, body, _ = read(daemon, f"local/{key}")
            assert (status, json.loads(body)["error"]) == (404, "ObjectNotFoundError"), body
    asked = daemon.metric("chunkd_backend_requests_total", backend="local") - requests_before
    assert asked == 3 * (len(refused) + len(missing))  # one HEAD each: never retried
    assert daemon.metric("chunkd_backend_rejected_keys_total", backend="local") == 3 * len(refused)
    assert_backend_healthy(daemon, "local")
    status, _, body, _ = read(daemon, "local/cold.bin")  # an uncached read right after
    assert (status, body) == (200, b"z" * 2000)
    assert daemon.stop() == 0
    log = daemon.log.read_text()
    assert "circuit open" not in log
    assert "retry" not in log


def test_a_memory_backend_holds_any_key_chunkd_allows(start_daemon, tmp_path: Path) -> None:
    daemon: Daemon = start_daemon(
        config(tmp_path, '[[backends]]\nname = "mem"\nurl = "memory://"\n')
    )
    for _ in range(3):
        for key in ["a" * 256, "shard#1", "é" * 512, "a/" * 300 + "b", "x" * 1024]:
            status, _, body, took = read(daemon, f"mem/{key}")
            assert (status, json.loads(body)["error"]) == (404, "ObjectNotFoundError"), body
            assert took < 2
    assert daemon.metric("chunkd_backend_rejected_keys_total", backend="mem") == 0
    assert_backend_healthy(daemon, "mem")
    assert daemon.stop() == 0


def test_a_key_longer_than_s3_holds_is_refused_before_asking(
    start_daemon, tmp_path: Path, s3_server: S3Server, bucket: str
) -> None:
    room = 1024 - len("pre/")  # S3 counts the prefix in its limit of 1024 bytes
    fits_on_s3 = ["a" * 256, "shard#1", "k" * room]  # what a file:// backend refuses is fine
    s3 = s3_server.client()
    for key in fits_on_s3:
        s3.put_object(Bucket=bucket, Key=f"pre/{key}", Body=b"s3")
    url = f"s3://{bucket}/pre"
    daemon: Daemon = start_daemon(config(tmp_path, s3_backend("data", url, s3_server.endpoint)))
    # 1025 and 1026 bytes with the prefix, and the longest key validate_key lets through
    over = ["k" * (room + 1), "é" * (room // 2 + 1), "k" * 1024]
    asked = daemon.metric("chunkd_backend_requests_total", backend="data")
    for _ in range(3):
        for key in over:
            status, _, body, _ = read(daemon, f"data/{key}")
            error = json.loads(body)
            assert (status, error["error"]) == (400, "InvalidKeyError"), body
            assert "1024" in error["message"], error["message"]
    assert daemon.metric("chunkd_backend_requests_total", backend="data") == asked
    assert daemon.metric("chunkd_backend_rejected_keys_total", backend="data") == 3 * len(over)
    assert_backend_healthy(daemon, "data")
    for key in fits_on_s3:
        status, _, body, _ = read(daemon, f"data/{key}")
        assert (status, body) == (200, b"s3")
    assert daemon.stop() == 0
