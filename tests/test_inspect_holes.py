"""The inspector's holes of issue 24, each against a real daemon and real workers:
requests whose clients left, a Parquet row group bigger than a worker's memory, hostile
files that made 500s, and datasets opened by name."""

from __future__ import annotations

import concurrent.futures
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import Daemon
from .test_inspector_pool import get_json, huge_sparse_text, jsonl, node, workers_of

#: the slow request: line 10^12 of a sparse file with no newline, scanned until killed
SLOW = "/v1/inspect/rows?name=local/huge.txt&format=text&start=1000000000000&count=1"


def abandon(daemon: Daemon, path: str, clients: int, after: float) -> None:
    """Send ``clients`` requests for ``path`` on connections of their own, and close
    every connection ``after`` seconds later, without reading an answer."""
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    sockets = []
    try:
        for _ in range(clients):
            connection = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
            connection.sendall(request)
            sockets.append(connection)
        time.sleep(after)
    finally:
        for connection in sockets:
            connection.close()


def timed_get(daemon: Daemon, path: str) -> tuple[float, int, Any]:
    started = time.monotonic()
    status, body = get_json(daemon, path)
    return time.monotonic() - started, status, body


# -- 1. requests whose clients left --------------------------------------------------------

#: docs/inspector.md: a fresh request behind 64 abandoned ones answers within this (about
#: 1 s here: the abandoned requests are given up within 0.25 s, and a worker restarts)
FRESH_BOUND_S = 5.0


@pytest.mark.timeout(60)
def test_abandoned_requests_leave_the_queue_and_free_their_workers(
    start_daemon: Any, tmp_path: Path
) -> None:
    huge_sparse_text(tmp_path, "huge.txt")
    rows = jsonl(tmp_path, "small.jsonl", 4)
    # The default timeout: without the fix, 64 abandoned requests hold 2 workers 10 s
    # each, and a fresh request waits about 320 s.
    daemon = node(start_daemon, tmp_path, workers=2, timeout="10s")
    assert get_json(daemon, "/v1/inspect/open?name=local/small.jsonl")[0] == 200
    deadline = time.monotonic() + 30
    while len(workers_of(daemon)) != 2:
        assert time.monotonic() < deadline, workers_of(daemon)
        time.sleep(0.1)
    before = set(workers_of(daemon))
    # 64 slow requests (2 run, 62 wait: the queue's bound), whose clients leave at 0.3 s.
    abandon(daemon, SLOW, 64, 0.3)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fresh = pool.submit(timed_get, daemon, "/v1/inspect/rows?name=local/small.jsonl")
        health = []
        while not fresh.done():
            health.append(timed_get(daemon, "/healthz"))
            time.sleep(0.2)
        took, status, body = fresh.result()
    assert status == 200, body
    assert [r["value"] for r in body["rows"]] == rows
    assert took < FRESH_BOUND_S, f"a fresh request waited {took:.1f} s behind abandoned ones"
    assert health, "the fresh request answered before /healthz was asked"
    assert all(status == 200 and seconds < 1 for seconds, status, _ in health), health
    # The two that ran were killed (their scans would have run 10 s), and replaced.
    assert not before & set(workers_of(daemon))
    assert len(workers_of(daemon)) <= 2
    log = daemon.log.read_text(errors="replace")
    assert "Traceback" not in log


# -- 4. a dataset opened by its name -----------------------------------------------------


@pytest.mark.timeout(60)
def test_open_takes_a_dataset_name_version_tag_or_snapshot_id(
    start_daemon: Any, tmp_path: Path
) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from chunkd.client import Client
    from chunkd.client.datasets import Dataset
    from chunkd.client.datasets.register import commit, scan_prefix

    daemon = node(start_daemon, tmp_path)
    data = tmp_path / "data" / "ds" / "web"
    data.mkdir(parents=True)
    for part in range(3):
        ids = pa.array(range(part * 40, part * 40 + 40), pa.int64())
        pq.write_table(pa.table({"id": ids, "part": [part] * 40}), data / f"part-{part}.parquet")
    with Client(tmp_path / "chunkd.sock") as client:
        commit(client, "web", scan_prefix(client, "local/ds/web/"))
        commit(client, "text/web", scan_prefix(client, "local/ds/web/"))
        pq.write_table(pa.table({"id": [999], "part": [3]}), data / "part-3.parquet")
        commit(client, "web", scan_prefix(client, "local/ds/web/"))
        with client.request("ds_tag", {"name": "web", "tag": "gold", "ref": "web@1"}):
            pass
        with Dataset.open("web@1", client) as dataset:
            first, want = dataset.id, [dataset[i] for i in (57, 58, 59)]
        with Dataset.open("web@2", client) as dataset:
            second = dataset.id
    for name, snapshot, samples in (
        ("web@1", first, 120),
        ("web@gold", first, 120),
        ("web", second, 121),
        ("web@latest", second, 121),
        (first, first, 120),
        ("text/web@1", first, 120),
    ):
        status, body = get_json(daemon, f"/v1/inspect/open?name={name}")
        assert status == 200, (name, body)
        assert (body["kind"], body["name"], body["snapshot"]) == ("snapshot", name, snapshot)
        assert (body["total"], body["samples"], body["members_total"]) == (
            samples,
            samples,
            3 if samples == 120 else 4,
        )
        assert body["format"] == "parquet"
    status, body = get_json(daemon, "/v1/inspect/rows?name=web@gold&start=57&count=3")
    assert status == 200, body
    assert [r["index"] for r in body["rows"]] == [57, 58, 59]
    assert [r["value"] for r in body["rows"]] == want
    assert (body["total"], body["next"]) == (120, 60)
    # An object is opened as before, and a name that is neither says so.
    status, body = get_json(daemon, "/v1/inspect/open?name=local/ds/web/part-0.parquet")
    assert (status, body["kind"], body["total"]) == (200, "parquet", 40)
    status, body = get_json(daemon, "/v1/inspect/open?name=nope@1")
    assert (status, body["error"]) == (404, "DatasetNotFoundError"), body
    status, body = get_json(daemon, "/v1/inspect/open?name=web@1.5")
    assert (status, body["error"]) == (400, "InvalidRequestError"), body
    assert "neither an object" in body["message"]
