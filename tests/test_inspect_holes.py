"""The inspector's holes of issue 24, each against a real daemon and real workers:
requests whose clients left, a Parquet row group bigger than a worker's memory, hostile
files that made 500s, and datasets opened by name."""

from __future__ import annotations

import concurrent.futures
import io
import json
import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import Daemon
from .test_inspector_pool import get_json, huge_sparse_text, jsonl, node, put, workers_of

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


@pytest.mark.timeout(30)
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
    # Every abandoned request was given up, and counted so (nginx's 499).
    deadline = time.monotonic() + 5
    while daemon.metric("chunkd_http_requests_total", status="499") < 64:
        assert time.monotonic() < deadline, daemon.metric("chunkd_http_requests_total")
        time.sleep(0.2)
    log = daemon.log.read_text(errors="replace")
    assert "Traceback" not in log


# -- 4. a dataset opened by its name -----------------------------------------------------


@pytest.mark.timeout(30)
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


# -- 3. hostile files are 422s, never 500s -------------------------------------------------


def mds_folder(tmp_path: Path, folder: str, spoil: Any = None, column: str = "bytes") -> str:
    """An MDS shard of 3 samples of one column of 2,000 bytes and its index.json in
    ``folder``, the entry made ``column`` and spoiled by ``spoil(index)``; the shard's
    name."""
    from .test_dataset_formats import mds_shard

    samples = [{"n": bytes([7 + i]) * 2000} for i in range(3)]
    shard, entry = mds_shard({"n": "bytes"}, samples, "shard.00000.mds", None)
    entry["column_encodings"] = [column]
    index = {"version": 2, "shards": [entry]}
    if spoil is not None:
        spoil(index)
    put(tmp_path, f"{folder}/shard.00000.mds", shard)
    put(tmp_path, f"{folder}/index.json", json.dumps(index).encode())
    return f"local/{folder}/shard.00000.mds"


def nested(depth: int) -> bytes:
    return b'{"deep": ' + b"[" * depth + b"]" * depth + b"}\n"


def hostile(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Each hostile file: its name, and what its 422's message says."""
    files = {}
    for depth in (201, 500, 990):
        put(tmp_path, f"deep-{depth}.jsonl", b'{"fine": 1}\n' + nested(depth))
        files[f"json {depth} deep"] = (f"local/deep-{depth}.jsonl", "nested")
    files["an MDS int of 4,800 digits"] = (
        mds_folder(tmp_path, "mds-int", column="int"),
        "digits",
    )

    def shards_dict(index: dict[str, Any]) -> None:
        index["shards"] = {"0": index["shards"][0]}

    def sizes_zz(index: dict[str, Any]) -> None:
        index["shards"][0]["column_sizes"] = ["zz"]

    def zip_string(index: dict[str, Any]) -> None:
        index["shards"][0]["zip_data"] = "shard.00000.mds.zstd"

    def shards_null(index: dict[str, Any]) -> None:
        index["shards"] = None

    def raw_string(index: dict[str, Any]) -> None:
        index["shards"][0]["raw_data"] = "shard.00000.mds"

    # Found by fuzzing each view (500s before): a Parquet column of invalid UTF-8 (its
    # statistics too), compressed JSON lines nested deep.
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    zstandard = pytest.importorskip("zstandard")
    offsets = pa.py_buffer(struct.pack("<3i", 0, 2, 4))
    text = pa.StringArray.from_buffers(2, offsets, pa.py_buffer(b"ok\xff\xfe"))
    sink = io.BytesIO()
    pq.write_table(pa.table({"text": text}), sink)
    put(tmp_path, "utf8.parquet", sink.getvalue())
    files["Parquet footer: text of invalid UTF-8"] = ("local/utf8.parquet", "utf-8")
    put(
        tmp_path,
        "deep.jsonl.zst",
        zstandard.ZstdCompressor().compress(b'{"fine": 1}\n' + nested(600)),
    )
    files["zstd JSON 600 deep"] = ("local/deep.jsonl.zst", "nested")
    files["MDS index: shards null"] = (
        mds_folder(tmp_path, "mds-null", shards_null),
        "'shards' is null",
    )
    files["MDS index: raw_data a string"] = (
        mds_folder(tmp_path, "mds-raw", raw_string),
        "raw_data is a string",
    )
    files["MDS index: shards a dict"] = (
        mds_folder(tmp_path, "mds-dict", shards_dict),
        "'shards' is an object",
    )
    files["MDS index: column_sizes zz"] = (
        mds_folder(tmp_path, "mds-zz", sizes_zz),
        'column_sizes holds "zz"',
    )
    files["MDS index: zip_data a string"] = (
        mds_folder(tmp_path, "mds-zip", zip_string),
        "zip_data is a string",
    )
    return files


@pytest.mark.timeout(30)
def test_hostile_files_are_422_with_a_message_and_no_traceback(
    start_daemon: Any, tmp_path: Path
) -> None:
    pytest.importorskip("pyarrow")
    files = hostile(tmp_path)
    daemon = node(start_daemon, tmp_path, workers=2)
    wrong = []
    for what, (name, says) in files.items():
        # open reads no record: a file whose records are bad opens, and its rows fail
        for op in ("open", "rows") if "index" in what or "footer" in what else ("rows",):
            page = "&start=1" if op == "rows" else ""
            status, body = get_json(daemon, f"/v1/inspect/{op}?name={name}{page}")
            # the message names the file at fault (a shard's index.json, say)
            folder = name.rpartition("/")[0]
            if (
                (status, body.get("error")) != (422, "MalformedFileError")
                or folder not in body["message"]
                or says not in body["message"]
            ):
                wrong.append((what, op, status, body.get("message", body)))
    assert not wrong, "\n".join(map(str, wrong))
    # The good rows of a file are shown around a bad one, and the workers lived.
    status, body = get_json(daemon, "/v1/inspect/rows?name=local/deep-500.jsonl&count=1")
    assert (status, body["rows"][0]["value"]) == (200, {"fine": 1})
    log = daemon.log.read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]
    assert "InspectError" not in log


# -- 2. a Parquet row group bigger than a worker's memory --------------------------------


@pytest.mark.timeout(45)
def test_a_row_group_bigger_than_the_worker_shows_its_pages(
    start_daemon: Any, tmp_path: Path
) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    np = pytest.importorskip("numpy")
    # pyarrow's defaults: one row group, here of 600,000 rows and 65 MB (random text
    # does not compress). Read whole it takes a worker over 768 MiB; the limit is 512.
    rows, width = 600_000, 100
    rng = np.random.default_rng(0)
    letters = rng.integers(97, 123, size=rows * width, dtype=np.uint8)
    offsets = np.arange(0, (rows + 1) * width, width, dtype=np.int32)
    text = pa.StringArray.from_buffers(rows, pa.py_buffer(offsets), pa.py_buffer(letters))
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"id": np.arange(rows), "text": text}), tmp_path / "data/one.parquet")
    assert pq.ParquetFile(tmp_path / "data/one.parquet").metadata.num_row_groups == 1

    def row(i: int) -> dict[str, Any]:
        return {"id": i, "text": letters[i * width : (i + 1) * width].tobytes().decode()}

    daemon = node(start_daemon, tmp_path, workers=1, memory="512MiB")
    name = "local/one.parquet"
    status, body = get_json(daemon, f"/v1/inspect/rows?name={name}&count=1")
    assert status == 200, body
    assert (body["total"], body["next"]) == (rows, 1)
    assert [r["value"] for r in body["rows"]] == [row(0)]
    # The next pages go on from there; one deep in the group, and the last, are found.
    for start, count in ((1, 500), (501, 500), (300_000, 20), (rows - 5, 20)):
        status, body = get_json(daemon, f"/v1/inspect/rows?name={name}&start={start}&count={count}")
        assert status == 200, (start, body)
        got = [r["value"] for r in body["rows"]]
        assert got == [row(i) for i in range(start, min(rows, start + count))], start
    status, body = get_json(daemon, f"/v1/inspect/rows?name={name}&start=7&count=2&columns=id")
    assert (status, [r["value"] for r in body["rows"]]) == (200, [{"id": 7}, {"id": 8}])
    status, body = get_json(daemon, f"/v1/inspect/sample?id={name}%23123456")
    assert (status, body["value"]) == (200, row(123456))
    status, body = get_json(daemon, f"/v1/inspect/open?name={name}")
    assert (status, body["num_rows"], len(body["row_groups"])) == (200, rows, 1)
