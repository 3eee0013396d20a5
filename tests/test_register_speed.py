"""Registration at the speed of the footers (issue 26): footers read in batches through
the daemon with ``keep: false`` (served, verified, never put in the RAM and disk tiers),
members emitted in key order, the same members as a registration file by file.

Every test runs a real daemon (the embedded default config: ``local`` at
``./chunkd-data``; or a moto S3 server through ``chunkd.testing``) and real Parquet
files written by pyarrow. Speed is measured in ``bench/dataset_bench.py``, not here.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from chunkd.client import Client
from chunkd.client.datasets.formats import format_of, settle
from chunkd.client.datasets.register import (
    TAIL_BYTES,
    commit,
    scan_members,
    scan_prefix,
    snapshot_of,
)
from chunkd.client.datasets.source import PinnedSource
from chunkd.client.protocol import MAX_PAYLOAD
from chunkd.errors import DatasetFormatError, InvalidRangeError, SnapshotDriftError
from chunkd.snapshot import Member, Snapshot
from chunkd.testing import S3Server, s3_backend

from .conftest import Daemon, wait_for_socket


@pytest.fixture
def node(start_daemon: Any, tmp_path: Path) -> Daemon:
    daemon: Daemon = start_daemon()
    assert wait_for_socket(tmp_path / "chunkd.sock", 10)
    return daemon


def rows_of(i: int) -> int:
    return 1 + i % 7


def write_parquet(root: Path, folder: str, files: int, *, columns: int = 2) -> dict[str, int]:
    """``files`` small Parquet files of ``rows_of(i)`` rows each (two row groups where
    they have more than 3 rows); their row counts by key."""
    counts = {}
    for i in range(files):
        key = f"{folder}/{i // 100:02d}/part-{i:05d}.parquet"
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = rows_of(i)
        table = pa.table(
            {
                f"c{c}": pa.array(range(i * 10 + c, i * 10 + c + rows), pa.int64())
                for c in range(columns)
            }
        )
        pq.write_table(table, path, row_group_size=3)
        counts[key] = rows
    return counts


def tiers(daemon: Daemon) -> tuple[float, float]:
    """The chunks the daemon's RAM and disk tiers hold."""
    return (
        daemon.metric("chunkd_cache_chunks", tier="ram"),
        daemon.metric("chunkd_cache_chunks", tier="disk"),
    )


def file_by_file(client: Client, backend: str, snapshot: Snapshot) -> list[dict[str, Any]]:
    """The members of ``snapshot``'s files as a registration read them before (one
    pinned read of each file through ``PinnedSource``, then settled): their entries."""
    source = PinnedSource(client, backend)
    fmt = format_of(snapshot.format)
    listed = [Member(m.key, m.size, m.version, m.format) for m in snapshot.members]
    scanned = [fmt.scan(source, m, {}) for m in listed]
    _, members = settle(fmt, scanned)
    return [m.to_json() for m in members]


@pytest.mark.timeout(60)
def test_a_registration_reads_footers_without_filling_the_tiers(
    node: Daemon, tmp_path: Path
) -> None:
    counts = write_parquet(tmp_path / "chunkd-data", "pq", 300)
    before = tiers(node)
    with Client(tmp_path / "chunkd.sock") as client:
        snapshot = scan_prefix(client, "local/pq/", fmt="parquet")
        # Read through the daemon (each file once, as a metadata read), kept nowhere.
        assert node.metric("chunkd_backend_requests_total", op="get") >= 300
        assert node.metric("chunkd_read_chunks_total", source="fetched") >= 300
        assert tiers(node) == before
        assert [m.key for m in snapshot.members] == sorted(counts)
        assert {m.key: m.samples for m in snapshot.members} == counts
        assert len(snapshot) == sum(counts.values())
        # The same members as a registration file by file (pinned, kept reads).
        assert [m.to_json() for m in snapshot.members] == file_by_file(client, "local", snapshot)
        answer = commit(client, "pq", snapshot)
        assert answer["version"] == 1
        assert answer["snapshot"] == snapshot.id


@pytest.mark.timeout(60)
def test_a_footer_larger_than_the_tail_is_read_pinned_and_not_kept(
    node: Daemon, tmp_path: Path
) -> None:
    # 600 columns: a footer of more than the 64 KiB tail a batch reads.
    counts = write_parquet(tmp_path / "chunkd-data", "wide", 3, columns=600)
    sizes = [(tmp_path / "chunkd-data" / key).stat().st_size for key in counts]
    assert all(size > TAIL_BYTES["parquet"] for size in sizes)
    before = tiers(node)
    with Client(tmp_path / "chunkd.sock") as client:
        snapshot = scan_prefix(client, "local/wide/", fmt="parquet")
        assert tiers(node) == before
        assert {m.key: m.samples for m in snapshot.members} == counts
        assert [m.to_json() for m in snapshot.members] == file_by_file(client, "local", snapshot)


@pytest.mark.timeout(60)
def test_bad_files_are_named_or_excluded_and_the_counts_stay_right(
    node: Daemon, tmp_path: Path
) -> None:
    data = tmp_path / "chunkd-data"
    counts = write_parquet(data, "mixed", 120)
    bad = sorted(counts)[7], sorted(counts)[64], sorted(counts)[119]
    (data / bad[0]).write_bytes(b"not parquet at all, just words" * 10)
    whole = (data / bad[1]).read_bytes()
    (data / bad[1]).write_bytes(whole[: len(whole) // 2])  # truncated: no footer
    (data / bad[2]).write_bytes(whole[:-8] + b"\xff\xff\x00\x00PAR1")  # a footer too long
    with Client(tmp_path / "chunkd.sock") as client:
        with pytest.raises(DatasetFormatError, match=bad[0]):
            scan_prefix(client, "local/mixed/", fmt="parquet")
        snapshot = scan_prefix(client, "local/mixed/", fmt="parquet", skip_bad=True)
    assert [e["key"] for e in snapshot.excluded] == list(bad)
    good = {k: v for k, v in counts.items() if k not in bad}
    assert {m.key: m.samples for m in snapshot.members} == good
    assert len(snapshot) == sum(good.values())


@pytest.mark.timeout(60)
def test_scan_members_scans_a_given_list_and_refuses_a_file_not_at_its_listed_version(
    node: Daemon, tmp_path: Path
) -> None:
    counts = write_parquet(tmp_path / "chunkd-data", "list", 40)
    with Client(tmp_path / "chunkd.sock") as client:
        listed = [
            (Member(e["name"][len("local/") :], int(e["size"]), str(e["version"]), "parquet"), {})
            for e in client.iter_ls("local/list", recursive=True, fresh=True)
        ]
        scanned = scan_members(client, "local", listed, concurrency=2)
        assert [m.key for m in scanned.members] == sorted(counts)
        assert [m.samples for m in scanned.members] == [counts[k] for k in sorted(counts)]
        assert scanned.excluded == []
        # The pages of a snapshot depend on its members alone, not on how they were found.
        built = snapshot_of("local", "list/", scanned.members, fmt="parquet")
        assert built.id == scan_prefix(client, "local/list/", fmt="parquet").id
        member, options = listed[5]
        stale = Member(member.key, member.size, "not-its-version", "parquet")
        with pytest.raises(SnapshotDriftError, match=member.key):
            scan_members(client, "local", [*listed[:5], (stale, options)])


@pytest.mark.timeout(60)
def test_a_read_not_kept_is_bounded_served_and_left_out_of_the_tiers(
    node: Daemon, tmp_path: Path
) -> None:
    data = tmp_path / "chunkd-data"
    (data / "blob").mkdir(parents=True)
    payload = os.urandom(3 << 20)
    (data / "blob" / "a.bin").write_bytes(payload)
    (data / "blob" / "b.bin").write_bytes(payload[:100_000])
    before = tiers(node)
    with Client(tmp_path / "chunkd.sock") as client:
        # Three reads of one range at once share one GET (single flight).
        gets = node.metric("chunkd_backend_requests_total", op="get")
        waiters = node.metric("chunkd_singleflight_waiters_total")
        same = [["local/blob/b.bin", 90_000, 10_000]] * 3
        shared = client.request("readv", {"ranges": same, "keep": False})
        assert shared.payload == payload[90_000:100_000] * 3
        assert node.metric("chunkd_backend_requests_total", op="get") == gets + 1
        assert node.metric("chunkd_singleflight_waiters_total") == waiters + 2
        fields = {"name": "local/blob/a.bin", "offset": 1000, "length": 5000, "keep": False}
        reply = client.request("read", fields)
        assert reply.payload == payload[1000:6000]
        assert reply.header["inline"]
        assert reply.header["length"] == 5000
        assert reply.header["size"] == len(payload)
        # The same range again, and a range of several of its ranges at once.
        ranges = [["local/blob/a.bin", 0, 10], ["local/blob/a.bin", len(payload) - 7, 100]]
        again = client.request("readv", {"ranges": ranges, "keep": False})
        assert again.payload == payload[:10] + payload[-7:]
        assert [r["length"] for r in again.header["ranges"]] == [10, 7]
        assert tiers(node) == before
        # Bounded before anything is read: a length, at most one payload.
        with pytest.raises(InvalidRangeError, match="keep=false"):
            client.request("read", {"name": "local/blob/a.bin", "keep": False})
        with pytest.raises(InvalidRangeError, match="keep=false"):
            client.request(
                "read", {"name": "local/blob/a.bin", "length": MAX_PAYLOAD + 1, "keep": False}
            )
        # A kept read of the same bytes fills the tiers as before.
        assert bytes(client.read("local/blob/a.bin", 0, 10)) == payload[:10]
        assert tiers(node)[0] > before[0]
    log = node.log.read_text()
    assert "Traceback" not in log


@pytest.mark.timeout(90)
def test_registering_from_s3_reads_many_files_in_flight_correctly(
    start_daemon: Any, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    local = tmp_path / "made"
    counts = write_parquet(local, "s3pq", 400)
    s3 = s3_server.client()
    for key in counts:
        s3.put_object(Bucket=bucket, Key=f"pre/{key}", Body=(local / key).read_bytes())
    toml = f"""
[server]
log_format = "json"

[cache]
dir = "{tmp_path / "cache"}"
ram_bytes = "256MiB"
disk_bytes = "1GiB"
disk_min_free_bytes = 0

{s3_backend("s3", f"s3://{bucket}/pre", s3_server.endpoint, timeout="10s", retries=1)}"""
    daemon: Daemon = start_daemon(toml)
    before = tiers(daemon)
    started = time.monotonic()
    with Client(tmp_path / "chunkd.sock") as client:
        snapshot = scan_prefix(client, "s3/s3pq/", fmt="parquet", concurrency=32)
        took = time.monotonic() - started
        assert {m.key: m.samples for m in snapshot.members} == counts
        assert tiers(daemon) == before
        assert [m.to_json() for m in snapshot.members] == file_by_file(client, "s3", snapshot)
    # One GET a file (the version comes with its bytes), no HEAD.
    assert daemon.metric("chunkd_backend_requests_total", op="head") == 0
    assert took < 60
