"""The inspector's daemon side: its pool of worker processes and its routes, against a
real daemon, real worker processes and real files.

The pool starts nothing until it is used, queues what its workers cannot take yet,
kills and replaces a worker that runs out of time or memory or dies, and leaves no
process behind; the media route serves a window of an object through the cache, typed
only when its first bytes are an allowed image, audio or video type.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from .conftest import Daemon

MEDIA = Path(__file__).parent / "data" / "media"
WORKER = "chunkd.client.inspect.worker"

CONFIG = """
[server]
inspect_workers = {workers}
inspect_timeout = "{timeout}"
inspect_memory = "{memory}"

[cache]
dir = "{dir}/cache"
ram_bytes = "256MiB"
disk_bytes = "1GiB"
disk_min_free_bytes = 0
fsync = "never"

[[backends]]
name = "local"
url = "file://{dir}/data"
writable = true

[datasets]
registry = "local/registry"
"""


def node(
    start_daemon: Any,
    tmp_path: Path,
    *,
    workers: int = 2,
    timeout: str = "30s",
    memory: str = "2GiB",
) -> Daemon:
    (tmp_path / "data").mkdir(exist_ok=True)
    toml = CONFIG.format(dir=tmp_path, workers=workers, timeout=timeout, memory=memory)
    daemon: Daemon = start_daemon(toml)
    return daemon


def put(tmp_path: Path, key: str, body: bytes) -> None:
    path = tmp_path / "data" / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body)


def get_json(daemon: Daemon, path: str) -> tuple[int, Any]:
    status, _, body = daemon.get(path)
    return status, json.loads(body)


def workers_of(daemon: Daemon) -> list[int]:
    """The pids of the daemon's inspector worker processes, from /proc."""
    pids: list[int] = []
    for task in Path(f"/proc/{daemon.process.pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in map(int, children):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if WORKER.encode() in cmdline:
                pids.append(pid)
    return sorted(pids)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def cpu_ticks(pid: int) -> int:
    """The CPU time a process has used so far, in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])  # utime and stime


def jsonl(tmp_path: Path, key: str, records: int) -> list[dict[str, Any]]:
    rows = [{"id": i, "text": f"record {i}"} for i in range(records)]
    put(tmp_path, key, b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    return rows


def huge_sparse_text(tmp_path: Path, key: str, size: int = 64 << 30) -> None:
    """A file of ``size`` zero bytes that takes no disk: a line scan must read it all."""
    path = tmp_path / "data" / key
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as file:
        file.truncate(size)


# -- the pool ----------------------------------------------------------------------------


def test_workers_start_on_first_use_and_concurrent_calls_queue(
    start_daemon: Any, tmp_path: Path
) -> None:
    rows = jsonl(tmp_path, "small.jsonl", 50)
    daemon = node(start_daemon, tmp_path, workers=2)
    assert workers_of(daemon) == []  # a daemon that is never inspected spawns nothing
    status, body = get_json(daemon, "/v1/inspect/rows?name=local/small.jsonl&count=5")
    assert status == 200, body
    assert [r["value"] for r in body["rows"]] == rows[:5]
    assert 1 <= len(workers_of(daemon)) <= 2

    def page(start: int) -> tuple[int, Any]:
        return get_json(daemon, f"/v1/inspect/rows?name=local/small.jsonl&start={start}&count=3")

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(page, range(0, 48, 4)))
    for start, (status, body) in zip(range(0, 48, 4), answers, strict=True):
        assert status == 200, body
        assert [r["value"] for r in body["rows"]] == rows[start : start + 3]
    assert len(workers_of(daemon)) <= 2


def test_past_64_waiting_requests_more_are_refused_with_503(
    start_daemon: Any, tmp_path: Path
) -> None:
    huge_sparse_text(tmp_path, "huge.txt", 1 << 40)
    rows = jsonl(tmp_path, "small.jsonl", 3)
    daemon = node(start_daemon, tmp_path, workers=1, timeout="110s")
    assert get_json(daemon, "/v1/inspect/open?name=local/small.jsonl")[0] == 200
    [busy] = workers_of(daemon)
    small = "/v1/inspect/rows?name=local/small.jsonl"
    with concurrent.futures.ThreadPoolExecutor(100) as pool:
        # The one worker scans a terabyte of text for a line: the rest must wait.
        slow = pool.submit(
            get_json,
            daemon,
            "/v1/inspect/rows?name=local/huge.txt&format=text&start=1000000000000&count=1",
        )
        used = cpu_ticks(busy)
        deadline = time.monotonic() + 60
        while cpu_ticks(busy) < used + 30:  # it is scanning: it is busy
            assert time.monotonic() < deadline, "the worker never began the scan"
            time.sleep(0.05)
        waiting = [pool.submit(get_json, daemon, small) for _ in range(96)]
        # At most 64 wait: at least 32 are refused, at once, while the worker is busy.
        refused = []
        for future in concurrent.futures.as_completed(waiting, timeout=100):
            status, body = future.result()
            assert status == 503, body
            assert body["error"] == "BackendUnavailableError"
            assert "busy" in body["message"]
            refused.append(future)
            if len(refused) == 32:
                break
        os.kill(busy, signal.SIGKILL)  # the slow request fails; the waiting ones go on
        assert slow.result(timeout=100)[0] == 422
        answers = [f.result(timeout=100) for f in waiting]
    served = [body for status, body in answers if status == 200]
    assert len(served) + sum(1 for status, _ in answers if status == 503) == len(answers)
    assert len(served) >= 64  # every request that waited was served
    for body in served:
        assert [r["value"] for r in body["rows"]] == rows


def test_unknown_op_is_404_naming_the_ops(start_daemon: Any, tmp_path: Path) -> None:
    daemon = node(start_daemon, tmp_path)
    status, body = get_json(daemon, "/v1/inspect/decode?name=local/x")
    assert status == 404
    assert "'decode'" in body["message"]
    for op in ("open", "rows", "sample", "rl", "snapshot", "step"):
        assert op in body["message"]
    assert workers_of(daemon) == []


def test_a_request_past_the_timeout_is_504_and_the_next_one_works(
    start_daemon: Any, tmp_path: Path
) -> None:
    huge_sparse_text(tmp_path, "huge.txt")
    rows = jsonl(tmp_path, "small.jsonl", 5)
    daemon = node(start_daemon, tmp_path, workers=1, timeout="3s")
    # Line 10^12 of 64 GiB without a newline: the worker scans all of it, far past 3 s.
    status, body = get_json(
        daemon, "/v1/inspect/rows?name=local/huge.txt&format=text&start=1000000000000&count=1"
    )
    assert status == 504, body
    assert body["error"] == "InspectTimeoutError"
    assert "server.inspect_timeout" in body["message"]
    status, body = get_json(daemon, "/v1/inspect/rows?name=local/small.jsonl")
    assert status == 200, body
    assert [r["value"] for r in body["rows"]] == rows
    assert len(workers_of(daemon)) == 1


def test_a_worker_killed_mid_request_is_replaced(start_daemon: Any, tmp_path: Path) -> None:
    huge_sparse_text(tmp_path, "huge.txt")
    rows = jsonl(tmp_path, "small.jsonl", 5)
    daemon = node(start_daemon, tmp_path, workers=1, timeout="60s")
    assert get_json(daemon, "/v1/inspect/open?name=local/small.jsonl")[0] == 200
    [first] = workers_of(daemon)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(
            get_json,
            daemon,
            "/v1/inspect/rows?name=local/huge.txt&format=text&start=1000000000000&count=1",
        )
        used = cpu_ticks(first)
        deadline = time.monotonic() + 60
        while cpu_ticks(first) < used + 30:  # it is scanning
            assert time.monotonic() < deadline, "the worker never began the scan"
            time.sleep(0.05)
        os.kill(first, signal.SIGKILL)
        status, body = slow.result(timeout=60)
    assert status == 422, body
    assert body["error"] == "InspectCrashedError"
    assert "SIGKILL" in body["message"]
    status, body = get_json(daemon, "/v1/inspect/rows?name=local/small.jsonl")
    assert status == 200, body
    assert [r["value"] for r in body["rows"]] == rows
    [second] = workers_of(daemon)
    assert second != first
    assert not alive(first)


def test_a_decode_past_the_memory_limit_fails_that_request_only(
    start_daemon: Any, tmp_path: Path
) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"n": list(range(10))}), tmp_path / "data" / "small.parquet")
    # One row group whose one value decodes to 400 MiB (a few KiB on disk, compressed).
    table = pa.table({"blob": pa.array(["a" * (400 << 20)], pa.large_string())})
    pq.write_table(table, tmp_path / "data" / "big.parquet", compression="zstd")
    del table
    daemon = node(start_daemon, tmp_path, workers=1, memory="300MiB")
    small = "/v1/inspect/rows?name=local/small.parquet&count=3"
    status, body = get_json(daemon, small)
    assert status == 200, body  # the limit lets a worker read Parquet ...
    assert [r["value"] for r in body["rows"]] == [{"n": 0}, {"n": 1}, {"n": 2}]
    status, body = get_json(daemon, "/v1/inspect/rows?name=local/big.parquet&count=1")
    assert status == 422, body  # ... but not decode this one
    assert body["error"] == "InspectCrashedError", body
    assert daemon.get("/healthz")[0] == 200
    status, body = get_json(daemon, small)
    assert status == 200, body
    assert [r["value"] for r in body["rows"]] == [{"n": 0}, {"n": 1}, {"n": 2}]


def test_stopping_the_daemon_leaves_no_worker(start_daemon: Any, tmp_path: Path) -> None:
    jsonl(tmp_path, "small.jsonl", 3)
    daemon = node(start_daemon, tmp_path, workers=2)

    def page(start: int) -> int:
        return daemon.get(f"/v1/inspect/rows?name=local/small.jsonl&start={start}")[0]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(page, [0, 1, 2, 0])) == [200] * 4
    pids = workers_of(daemon)
    assert pids
    assert daemon.stop() == 0
    assert not [pid for pid in pids if alive(pid)]


def test_worker_environment_holds_no_secret(start_daemon: Any, tmp_path: Path) -> None:
    jsonl(tmp_path, "small.jsonl", 3)
    (tmp_path / "data").mkdir(exist_ok=True)
    toml = CONFIG.format(dir=tmp_path, workers=1, timeout="30s", memory="2GiB")
    daemon: Daemon = start_daemon(
        toml,
        env={
            "AWS_SECRET_ACCESS_KEY": "not-for-workers",
            "CHUNKD_SERVER_TOKEN": "also-not-for-workers",
        },
    )
    assert daemon.get("/v1/inspect/open?name=local/small.jsonl")[0] == 200
    [pid] = workers_of(daemon)
    environ = dict(
        item.split("=", 1)
        for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
        if "=" in item
    )
    assert environ["CHUNKD_SOCKET"] == str(tmp_path / "chunkd.sock")
    assert "AWS_SECRET_ACCESS_KEY" not in environ
    assert not [k for k in environ if k.startswith("CHUNKD_") and k != "CHUNKD_SOCKET"]


# -- the media route ---------------------------------------------------------------------


def test_a_window_of_an_object_is_served_as_its_sniffed_type(
    start_daemon: Any, tmp_path: Path
) -> None:
    png = (MEDIA / "picture.png").read_bytes()
    wav = (MEDIA / "tone.wav").read_bytes()
    junk = os.urandom(5000)
    put(tmp_path, "shard.bin", junk + png + wav + junk)
    put(tmp_path, "picture.png", png)
    daemon = node(start_daemon, tmp_path)
    base = "/v1/inspect/media/local/shard.bin"
    for offset, body, media_type in ((5000, png, "image/png"), (5000 + len(png), wav, "audio/wav")):
        status, headers, got = daemon.get(f"{base}?offset={offset}&length={len(body)}")
        assert status == 200
        assert got == body
        assert headers["Content-Type"] == media_type
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["Content-Security-Policy"].startswith("sandbox")
        assert "Content-Disposition" not in headers
    status, headers, got = daemon.get("/v1/inspect/media/local/picture.png")
    assert (status, got, headers["Content-Type"]) == (200, png, "image/png")
    assert workers_of(daemon) == []  # serving media decodes nothing


def test_range_inside_a_window_is_relative_to_it(start_daemon: Any, tmp_path: Path) -> None:
    wav = (MEDIA / "tone.wav").read_bytes()
    put(tmp_path, "shard.bin", b"x" * 777 + wav + b"y" * 99)
    daemon = node(start_daemon, tmp_path)
    path = f"/v1/inspect/media/local/shard.bin?offset=777&length={len(wav)}"
    status, headers, got = daemon.get(path, {"Range": "bytes=100-1099"})
    assert status == 206
    assert got == wav[100:1100]
    assert headers["Content-Range"] == f"bytes 100-1099/{len(wav)}"
    assert headers["Content-Type"] == "audio/wav"
    status, headers, got = daemon.get(path, {"Range": "bytes=-10"})
    assert (status, got) == (206, wav[-10:])
    status, headers, _ = daemon.get(path, {"Range": f"bytes={len(wav)}-"})
    assert status == 416


@pytest.mark.parametrize(
    "body",
    [
        b"<!DOCTYPE html><html><body><script>alert(document.cookie)</script></body></html>",
        b"<svg xmlns='http://www.w3.org/2000/svg'><script>alert(1)</script></svg>",
        b'{"not": "media"}\n',
    ],
    ids=["html", "svg", "json"],
)
def test_anything_else_is_an_attachment(start_daemon: Any, tmp_path: Path, body: bytes) -> None:
    put(tmp_path, "page.html", body)
    daemon = node(start_daemon, tmp_path)
    status, headers, got = daemon.get("/v1/inspect/media/local/page.html")
    assert (status, got) == (200, body)
    assert headers["Content-Type"] == "application/octet-stream"
    assert headers["Content-Disposition"] == "attachment"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["Content-Security-Policy"] == "sandbox; default-src 'none'"


def test_head_names_the_type_without_a_body(start_daemon: Any, tmp_path: Path) -> None:
    png = (MEDIA / "picture.png").read_bytes()
    put(tmp_path, "picture.png", png)
    daemon = node(start_daemon, tmp_path)
    request = urllib.request.Request(
        daemon.url + "/v1/inspect/media/local/picture.png", method="HEAD"
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "image/png"
        assert response.headers["Content-Length"] == str(len(png))
        assert response.read() == b""


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("offset=-1", "whole number"),
        ("offset=abc", "whole number"),
        ("offset=1.5", "whole number"),
        ("length=", "whole number"),
        ("offset=99999999999999999999", "whole number"),
        ("offset=1001", "past the end"),
        ("offset=10&length=991", "runs past the end"),
    ],
)
def test_bad_windows_are_400(start_daemon: Any, tmp_path: Path, query: str, says: str) -> None:
    put(tmp_path, "blob.bin", os.urandom(1000))
    daemon = node(start_daemon, tmp_path)
    status, body = get_json(daemon, f"/v1/inspect/media/local/blob.bin?{query}")
    assert status == 400, body
    assert says in body["message"]


def test_media_of_a_missing_object_is_404(start_daemon: Any, tmp_path: Path) -> None:
    daemon = node(start_daemon, tmp_path)
    status, body = get_json(daemon, "/v1/inspect/media/local/nothing.png")
    assert status == 404
    assert body["error"] == "ObjectNotFoundError"
    status, body = get_json(daemon, "/v1/inspect/media/nobackend/x.png")
    assert status == 404


def test_a_lone_surrogate_in_a_sample_is_served_as_valid_json(
    start_daemon: Any, tmp_path: Path
) -> None:
    # JSON may hold a lone surrogate (web-scraped text does): it must reach the page.
    put(tmp_path, "odd.jsonl", b'{"text": "half \\ud800 a pair"}\n{"text": "fine"}\n')
    daemon = node(start_daemon, tmp_path)
    status, headers, body = daemon.get("/v1/inspect/rows?name=local/odd.jsonl")
    assert status == 200, body
    assert headers["Content-Type"].startswith("application/json")
    body.decode("utf-8")  # valid UTF-8 on the wire
    rows = json.loads(body)["rows"]
    assert rows[0]["value"]["text"] == "half \ud800 a pair"
    assert rows[1]["value"]["text"] == "fine"


def test_the_first_request_starts_every_worker_and_no_more(
    start_daemon: Any, tmp_path: Path
) -> None:
    rows = jsonl(tmp_path, "small.jsonl", 3)
    daemon = node(start_daemon, tmp_path, workers=2)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(
            pool.map(
                lambda _: get_json(daemon, "/v1/inspect/rows?name=local/small.jsonl"), range(6)
            )
        )
    assert all(status == 200 for status, _ in answers)
    assert all([r["value"] for r in body["rows"]] == rows for _, body in answers)
    deadline = time.monotonic() + 30
    while len(workers_of(daemon)) != 2:
        assert time.monotonic() < deadline, workers_of(daemon)
        time.sleep(0.1)
    time.sleep(1)
    assert len(workers_of(daemon)) == 2  # never more than inspect_workers
