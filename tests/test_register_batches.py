"""How a registration batches its footer reads (issue 26, registration at the speed of
the footers): each ``readv`` round trip costs the daemon and the client far more than
a file of it, so the window of files in flight (``WINDOW * concurrency``) goes out in as
few batches as keep both workers busy: two of 16 files at the default concurrency of 8,
where there were four of 8. Real daemon, real Parquet files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from chunkd.client import Client
from chunkd.client.datasets.register import Progress, scan_prefix

from .conftest import Daemon, wait_for_socket
from .test_register_speed import write_parquet


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Daemon:
    daemon = start_daemon()
    assert wait_for_socket(tmp_path / "chunkd.sock", 10)
    return daemon


@pytest.mark.timeout(30)
def test_a_registration_reads_its_window_in_two_batches(node: Daemon, tmp_path: Path) -> None:
    counts = write_parquet(tmp_path / "chunkd-data", "pq", 320)
    seen: list[tuple[int, int]] = []

    def progress(p: Progress) -> None:
        seen.append((p.listed, p.scanned))

    readv = node.metric("chunkd_local_requests_total", op="readv")
    with Client(tmp_path / "chunkd.sock") as client:
        snapshot = scan_prefix(client, "local/pq/", fmt="parquet", progress=progress)
    assert {m.key: m.samples for m in snapshot.members} == counts
    # 320 files in batches of 16 (the window of 32 in two), one readv each.
    assert node.metric("chunkd_local_requests_total", op="readv") - readv == 320 / 16
    assert max(listed - scanned for listed, scanned in seen) <= 4 * 8
