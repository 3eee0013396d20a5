"""The cost ledger's read paths (issue 30, review R1): what is a reader's request
("without chunkd", bytes served, credit) and what is not (prefetch, ``chunkd warm``,
the inspector's look), who pays for a prefetch, how many bytes an fd read asks, which
reader counts a fresh chunk as from the backend, and a listing of a backend that is
not one.

Real parts: real daemons over a file:// backend (a moto S3 where a delay is needed),
real clients.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chunkd.client import Client
from chunkd.testing import CountingProxy, S3Server
from tests.conftest import Daemon

MiB = 1 << 20

CONFIG = """
[server]
readahead_chunks = {readahead}
prefetch_in_flight = 1
prefetch_per_client = 1

[cache]
dir = "{dir}/cache"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
chunk_bytes = "1MiB"
fsync = "never"

[[backends]]
name = "local"
url = "file://{dir}/data"
"""


def _node(start_daemon: Callable[..., Daemon], tmp_path: Path, *, readahead: int = 0) -> Daemon:
    (tmp_path / "data").mkdir(exist_ok=True)
    return start_daemon(CONFIG.format(dir=tmp_path, readahead=readahead))


def _put(tmp_path: Path, key: str, size: int) -> bytes:
    body = os.urandom(size)
    path = tmp_path / "data" / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body)
    return body


def _cost(daemon: Daemon) -> dict[str, Any]:
    status, _, body = daemon.get("/v1/cost")
    assert status == 200, body
    answer: dict[str, Any] = json.loads(body)
    return answer


def _job(view: dict[str, Any], job: str) -> dict[str, Any]:
    found = [row for row in view["jobs"] if row["job"] == job]
    assert len(found) == 1, view["jobs"]
    return found[0]


def _served(row: dict[str, Any]) -> int:
    return sum(row["served_bytes"].values())


def _wait_loaded(daemon: Daemon, count: float) -> None:
    deadline = time.monotonic() + 30
    while daemon.metric("chunkd_prefetch_objects_total", outcome="loaded") < count:
        assert time.monotonic() < deadline, "the prefetch did not finish"
        time.sleep(0.05)


@pytest.mark.timeout(30)
def test_a_listing_of_a_backend_that_is_not_one_is_charged_nothing(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = _node(start_daemon, tmp_path)
    _put(tmp_path, "x.bin", 10)
    with Client(daemon.cwd / "chunkd.sock", train_job="lister") as client:
        for i in range(3):
            with pytest.raises(Exception, match="backend"):
                client.ls(f"nope-{i}/")
        assert len(client.ls("local/")) == 1
    status, _, _ = daemon.get("/v1/list/http-nope", {"X-Chunkd-Job": "lister"})
    assert status == 404
    status, _, _ = daemon.get("/v1/list/local", {"X-Chunkd-Job": "lister"})
    assert status == 200
    # Only the two pages of the backend there is are direct LISTs; no unknown name
    # became a label value.
    assert _job(_cost(daemon), "lister")["direct_requests"] == {"list": 2}
    status, _, metrics = daemon.get("/metrics")
    assert b"nope" not in metrics


@pytest.mark.timeout(30)
def test_prefetch_warm_and_the_inspectors_look_are_not_reader_requests(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = _node(start_daemon, tmp_path)
    size = 3 * MiB + 5
    body = _put(tmp_path, "big.bin", size)
    _put(tmp_path, "media.bin", 2 * MiB)
    with Client(daemon.cwd / "chunkd.sock", train_job="prefetcher") as client:
        assert client.prefetch(["local/big.bin"]) == 1
        _wait_loaded(daemon, 1)
    row = _job(_cost(daemon), "prefetcher")
    # The load's backend reads are the job's; no direct GET, nothing served.
    assert row["backend_bytes"]["read"] == size
    assert row["direct_requests"] == {}
    assert row["direct_bytes"] == 0
    assert _served(row) == 0
    # chunkd warm of the cached object, twice: no direct GET, nothing served, no credit
    # (nothing to charge: the job has no row at all).
    before = _cost(daemon)["totals"]
    for _ in range(2):
        request = urllib.request.Request(
            daemon.url + "/v1/warm/local/big.bin", method="POST", headers={"X-Chunkd-Job": "w"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert b'"done": true' in response.read()
    after = _cost(daemon)
    assert [row["job"] for row in after["jobs"] if row["job"] == "w"] == []
    for figure in ("direct_requests", "direct_bytes", "served_bytes", "saved"):
        assert after["totals"][figure] == before[figure], figure
    # A reader's read of the prefetched object: one direct GET, from the cache.
    with Client(daemon.cwd / "chunkd.sock", train_job="reader") as client:
        assert bytes(client.read("local/big.bin")) == body
    reader = _job(_cost(daemon), "reader")
    assert reader["direct_requests"] == {"get": 1}
    assert reader["served_bytes"]["ram"] + reader["served_bytes"]["disk"] == size
    # The job that prefetched it reads it: it paid for the fetch, so its read is
    # served from the backend (once), not credited as from the cache.
    with Client(daemon.cwd / "chunkd.sock", train_job="prefetcher") as client:
        assert bytes(client.read("local/big.bin")) == body
    row = _job(_cost(daemon), "prefetcher")
    assert row["direct_requests"] == {"get": 1}
    assert row["served_bytes"]["backend"] == size
    assert row["served_bytes"]["ram"] + row["served_bytes"]["disk"] == 0
    # The inspector's media route: its sniff of the head is not a read; the bytes it
    # serves are (one GET of the window).
    status, _, media = daemon.get(
        "/v1/inspect/media/local/media.bin?offset=10&length=1000", {"X-Chunkd-Job": "looker"}
    )
    assert status == 200
    assert len(media) == 1000
    looker = _job(_cost(daemon), "looker")
    assert looker["direct_requests"] == {"get": 1}
    assert looker["direct_bytes"] == 1000
    assert _served(looker) == 1000


@pytest.mark.timeout(60)
def test_a_prefetch_is_charged_to_the_job_that_queued_it_not_to_the_workers(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = _node(start_daemon, tmp_path)  # one prefetch worker per user
    sizes = {f"a/{i:02d}.bin": MiB + i for i in range(20)}
    sizes |= {f"b/{i:02d}.bin": 2 * MiB + i for i in range(10)}
    for key, size in sizes.items():
        _put(tmp_path, key, size)
    a_names = [f"local/{k}" for k in sizes if k.startswith("a/")]
    b_names = [f"local/{k}" for k in sizes if k.startswith("b/")]
    # The same user (uid), two connections of two jobs: job-b's names join the queue
    # job-a's worker drains.
    with (
        Client(daemon.cwd / "chunkd.sock", train_job="job-a") as a,
        Client(daemon.cwd / "chunkd.sock", train_job="job-b") as b,
    ):
        assert a.prefetch(a_names) == 20
        assert b.prefetch(b_names) == 10
        _wait_loaded(daemon, 30)
    view = _cost(daemon)
    a_bytes = sum(size for key, size in sizes.items() if key.startswith("a/"))
    b_bytes = sum(size for key, size in sizes.items() if key.startswith("b/"))
    assert _job(view, "job-a")["backend_bytes"]["read"] == a_bytes
    assert _job(view, "job-b")["backend_bytes"]["read"] == b_bytes


@pytest.mark.timeout(30)
def test_an_fd_read_is_one_direct_get_of_the_bytes_asked_not_of_its_chunks(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = _node(start_daemon, tmp_path)
    body = _put(tmp_path, "x.bin", 4 * MiB)
    # Longer than INLINE_MAX (64 KiB): answered with the chunks' fds.
    asked = [(100, 200_000), (2 * MiB + 5, 100_000), (MiB - 10, 300_000)]
    with Client(daemon.cwd / "chunkd.sock", train_job="sampler") as client:
        for offset, length in asked:
            assert (
                bytes(client.read("local/x.bin", offset, length))
                == (body[offset : offset + length])
            )
    row = _job(_cost(daemon), "sampler")
    total = sum(length for _, length in asked)
    assert row["direct_requests"] == {"get": 3}
    assert row["direct_bytes"] == total
    assert _served(row) == total


@pytest.mark.timeout(30)
def test_readahead_is_from_the_backend_for_its_reader_and_from_the_cache_for_another_job(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = _node(start_daemon, tmp_path, readahead=2)
    body = _put(tmp_path, "seq.bin", 6 * MiB)
    with Client(daemon.cwd / "chunkd.sock", train_job="sequential") as client:
        # Chunk 0, then chunk 1: a sequential reader, so chunks 2 and 3 are read ahead.
        for index in (0, 1):
            got = client.read("local/seq.bin", index * MiB, MiB)
            assert bytes(got) == body[index * MiB : (index + 1) * MiB]
        deadline = time.monotonic() + 10
        while daemon.metric("chunkd_readahead_chunks_total") < 2:
            assert time.monotonic() < deadline, "the readahead did not finish"
            time.sleep(0.05)
        # The reader it was read ahead for reads chunk 3: fetched for it, from the
        # backend (it paid for the fetch; no credit).
        assert bytes(client.read("local/seq.bin", 3 * MiB, MiB)) == body[3 * MiB : 4 * MiB]
    with Client(daemon.cwd / "chunkd.sock", train_job="other-job") as client:
        # Another job reads chunk 2, which nobody it runs for read: from the cache.
        assert bytes(client.read("local/seq.bin", 2 * MiB, MiB)) == body[2 * MiB : 3 * MiB]
    view = _cost(daemon)
    sequential = _job(view, "sequential")
    assert sequential["served_bytes"]["backend"] == 3 * MiB
    other = _job(view, "other-job")
    assert other["served_bytes"]["backend"] == 0
    assert other["served_bytes"]["ram"] + other["served_bytes"]["disk"] == MiB
    assert other["backend_bytes"] == {}


@pytest.mark.timeout(60)
def test_of_readers_waiting_on_one_restore_fetch_only_the_one_that_fetched_is_served_by_the_backend(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    import numpy as np

    from chunkd.client import checkpoint as ckpt

    config = """
[cache]
dir = "{cache}"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
chunk_bytes = "1MiB"
fsync = "never"

[[backends]]
name = "ckpt"
url = "file://{data}"
writable = true
"""
    (tmp_path / "data").mkdir()
    state = {"w": np.arange(8 * MiB // 8, dtype=np.int64)}
    saver = start_daemon(
        config.format(cache=tmp_path / "cache-1", data=tmp_path / "data"), cwd=tmp_path / "n1"
    )
    with Client(saver.cwd / "chunkd.sock", train_job="trainer") as client:
        ckpt.save(state, "ckpt/run-1/10", client=client)
    saver.stop()
    # A node with a cold cache: the restores' chunks come from the backend, each once.
    node = start_daemon(
        config.format(cache=tmp_path / "cache-2", data=tmp_path / "data"), cwd=tmp_path / "n2"
    )
    jobs = [f"restorer-{i}" for i in range(4)]
    barrier = threading.Barrier(len(jobs))
    failures: list[BaseException] = []

    def restore(job: str) -> None:
        try:
            with Client(node.cwd / "chunkd.sock", train_job=job) as client:
                barrier.wait()
                back = ckpt.load("ckpt/run-1/10", client=client)
                assert (back["w"] == state["w"]).all()
        except BaseException as exc:  # told by the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=restore, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    view = _cost(node)
    rows = [_job(view, job) for job in jobs]
    served = sum(_served(row) for row in rows)
    from_backend = sum(row["served_bytes"]["backend"] for row in rows)
    # Each reader was served the checkpoint's chunks; each chunk's bytes from the
    # backend once, to the reader that fetched it (and paid for it); the readers that
    # waited on that fetch got the node's copy, as from the cache, and are credited.
    assert served == len(jobs) * (served // len(jobs)) > 0
    assert from_backend == served // len(jobs)
    assert served - from_backend == sum(
        row["served_bytes"]["ram"] + row["served_bytes"]["disk"] for row in rows
    )


@pytest.mark.timeout(60)
def test_a_freezes_chunk_reads_are_not_reader_requests(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    from tests.test_dataset_registry import FILES, commit, data_dir, snapshot_of, write_objects

    daemon = start_daemon(cwd=tmp_path / "node")
    with Client(daemon.cwd / "chunkd.sock", train_job="freezer") as client:
        write_objects(data_dir(daemon), FILES)
        snap = snapshot_of(client, sorted(FILES))
        commit(client, snap, "frz")
        before = _job(_cost(daemon), "freezer")
        report = client.request("ds_freeze", {"ref": "frz@1"}, timeout=120).header
    assert report["uploaded_bytes"] > 0
    row = _job(_cost(daemon), "freezer")
    assert row["written_bytes"]["freeze"] == report["uploaded_bytes"]
    # Its member reads are the daemon's own copy, not a reader's: no direct GET,
    # nothing served.
    assert row["direct_requests"] == before["direct_requests"]
    assert row["direct_bytes"] == before["direct_bytes"]
    assert _served(row) == _served(before)


@pytest.mark.timeout(90)
def test_chunks_an_owner_fetched_for_a_peer_are_from_the_cache_for_its_own_readers(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    s3_server: S3Server,
    bucket: str,
    s3_proxy: CountingProxy,
) -> None:
    from tests.test_peers import start_cluster

    # 16 objects of one chunk each: node 1 owns some of them but 1 time in 65536
    bodies = {f"shared-{i}.bin": os.urandom(MiB // 4) for i in range(16)}
    for key, data in bodies.items():
        s3_server.client().put_object(Bucket=bucket, Key=f"pre/{key}", Body=data)
    nodes = start_cluster(start_daemon, tmp_path, bucket, s3_proxy, 2)
    with Client(nodes[0].cwd / "chunkd.sock", timeout=60, train_job="far-job") as client:
        for key, data in bodies.items():
            assert bytes(client.read(f"ckpt/{key}")) == data
    fetched_for_peer = _job(_cost(nodes[1]), "far-job")["backend_bytes"]["read"]
    assert fetched_for_peer > 0
    assert _cost(nodes[1])["totals"]["backend_bytes"]["read"] == fetched_for_peer
    # The same job reads them on node 1 (the HTTP door). The peer's requests were
    # charged under other (the job was not live here); its start here, under its own
    # label, is a new row, the earlier figures in the node's totals (docs/jobs.md).
    # What node 1 fetched for node 0 is in its cache now: served from there, with
    # credit; the rest comes from node 0, a peer.
    for key, data in bodies.items():
        status, _, body = nodes[1].get(f"/v1/objects/ckpt/{key}", {"X-Chunkd-Job": "far-job"})
        assert status == 200
        assert body == data
    view = _cost(nodes[1])
    assert view["totals"]["backend_bytes"]["read"] == fetched_for_peer  # nothing fetched again
    row = _job(view, "far-job")
    assert row["backend_bytes"].get("read", 0) == 0
    assert row["served_bytes"]["backend"] == 0
    assert row["served_bytes"]["ram"] + row["served_bytes"]["disk"] == fetched_for_peer
    assert row["served_bytes"]["peer"] == sum(map(len, bodies.values())) - fetched_for_peer


@pytest.mark.timeout(60)
def test_of_peeks_waiting_on_one_fetch_only_the_one_that_fetched_is_served_by_the_backend(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    s3_server: S3Server,
    bucket: str,
    s3_proxy: CountingProxy,
) -> None:
    from chunkd.testing import s3_backend

    size = 10_000
    body = os.urandom(size)
    s3_server.client().put_object(Bucket=bucket, Key="pre/small.bin", Body=body)
    backend = s3_backend("data", f"s3://{bucket}/pre", s3_proxy.endpoint, retries=0)
    node = start_daemon(
        CONFIG.split("[[backends]]")[0].format(dir=tmp_path, readahead=0) + backend,
        cwd=tmp_path / "n1",
    )
    # a slow backend: the readers all come while the first one's GET is on its way
    s3_proxy.delay = 0.5
    jobs = [f"peeker-{i}" for i in range(4)]
    barrier = threading.Barrier(len(jobs))
    failures: list[BaseException] = []

    def peek(job: str) -> None:
        try:
            with Client(node.cwd / "chunkd.sock", train_job=job) as client:
                barrier.wait()
                answer = client.request(
                    "read", {"name": "data/small.bin", "offset": 0, "length": size, "keep": False}
                )
                assert answer.payload == body
        except BaseException as exc:  # told by the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=peek, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    rows = [_job(_cost(node), job) for job in jobs]
    # one GET for the four; its bytes from the backend once, for the peek that fetched
    # them; the others got the node's copy in memory, as from the cache (credited)
    assert sum(row["backend_requests"].get("get", 0) for row in rows) == 1
    assert sum(row["served_bytes"]["backend"] for row in rows) == size
    assert sum(row["served_bytes"]["ram"] for row in rows) == (len(jobs) - 1) * size
    assert all(row["direct_requests"] == {"get": 1} for row in rows)
