"""Member pages in the peers lab: 3 daemons x several readers open one schema-2 snapshot
and read every page; the registry backend serves each page about once for the cluster.
Counted on the backend's own side (moto's request recorder)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from chunkd.client import Client
from chunkd.client.datasets.dataset import resolve as resolve_snapshot
from chunkd.client.datasets.pages import commit_snapshot
from chunkd.snapshot import Member, MemoryPages, Snapshot
from chunkd.testing import CountingProxy, S3Server, free_port
from tests.conftest import Daemon
from tests.test_peers import node_toml

READERS = 3


@pytest.fixture
def recorded_s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[S3Server, Path]]:
    """A moto server of this test's own that records every request it serves."""
    recording = tmp_path / "moto-recording.jsonl"
    monkeypatch.setenv("MOTO_ENABLE_RECORDING", "true")
    monkeypatch.setenv("MOTO_RECORDER_FILEPATH", str(recording))
    with S3Server.start() as server:
        monkeypatch.delenv("MOTO_ENABLE_RECORDING")
        yield server, recording


def recorded(recording: Path) -> list[tuple[str, str]]:
    """(method, path) of each request the server recorded."""
    found = []
    for line in recording.read_text().splitlines():
        entry = json.loads(line)
        found.append((entry["method"], entry["url"].split("?")[0]))
    return found


@pytest.mark.timeout(120)
def test_three_nodes_of_readers_get_each_page_from_the_registry_about_once(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    recorded_s3: tuple[S3Server, Path],
) -> None:
    server, recording = recorded_s3
    bucket = "pages-lab"
    server.client().create_bucket(Bucket=bucket)
    proxy = CountingProxy(server.port)
    try:
        ports = [free_port() for _ in range(3)]
        nodes = [
            start_daemon(
                node_toml(tmp_path, bucket, proxy, f"n{i}", port, ports)
                + '\n[datasets]\nregistry = "ckpt/datasets"\n',
                cwd=tmp_path / f"n{i}",
                env={"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{port}"},
                port=port,
            )
            for i, port in enumerate(ports)
        ]
        deadline = time.monotonic() + 20
        while any(n.metric("chunkd_peer_healthy") < 3 for n in nodes):
            assert time.monotonic() < deadline, "the nodes never all saw each other up"
            time.sleep(0.1)
        members = [
            Member(f"m/{i:06d}.bin", 64, f"v{i}", "fixed", 4, {"record_bytes": 16})
            for i in range(40_000)
        ]
        pages = MemoryPages()
        snapshot = Snapshot.build(
            backend="ckpt",
            prefix="data/",
            format="fixed",
            members=members,
            pages=pages,
            schema=2,
        )
        with Client(nodes[0].cwd / "chunkd.sock", timeout=60) as client:
            commit_snapshot(client, "lab/web", snapshot, pages)
        page_count = len({r.id for r in snapshot.pages})
        assert page_count >= 5
        recording.write_text("")  # only the opens are counted from here
        results: list[Any] = []

        def open_and_read(node: Daemon) -> None:
            try:
                with Client(node.cwd / "chunkd.sock", timeout=60) as client:
                    got, _, _ = resolve_snapshot(client, "lab/web")
                    results.append(list(got.iter_members()) == members)
            except Exception as exc:  # reported below
                results.append(exc)

        threads = [
            threading.Thread(target=open_and_read, args=(node,))
            for node in nodes
            for _ in range(READERS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        assert results == [True] * (3 * READERS)
        requests = recorded(recording)
        page_gets = [p for m, p in requests if m == "GET" and "/datasets/pages/" in p]
        page_heads = [p for m, p in requests if m == "HEAD" and "/datasets/pages/" in p]
        print(
            f"\n{3 * READERS} readers on 3 nodes, {page_count} pages: {len(page_gets)} page "
            f"GETs, {len(page_heads)} page HEADs, {len(requests)} registry requests in all"
        )
        # Each page left the registry once for the whole cluster, and no node asked for
        # a page's version: a page is named by its content (its id), and its owner
        # among the peers fetches it for all.
        assert len(page_gets) == page_count
        assert len(set(page_gets)) == page_count
        assert page_heads == []
        for node in nodes:
            assert "Traceback" not in node.log.read_text()
    finally:
        proxy.close()
