"""Decode once per node (docs/decoding.md): the daemon's decode workers, its held entries
and their key, through real daemons, real worker processes and real reader processes.

* N readers asking for the same units: each unit decoded once on the node, every reader
  gets the same table (equal to an in-process decode).
* A reader never maps an entry made from other bytes (the object rewritten: a new
  registration gets a new decode; the old one reads its own or drifts), by another
  decoder version (declined: the reader decodes itself), or with other columns.
* The pool off, or full: declined at once, the reader decodes itself.
* The held entries stay within ``[datasets] decoded_bytes``.
* Bad requests get clear errors before any work.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from chunkd.client import Client
from chunkd.client.datasets import resolve
from chunkd.client.datasets.formats import format_of
from chunkd.client.datasets.shared import SharedDecoder
from chunkd.client.protocol import VERSION, recv_frame, send_frame
from chunkd.errors import SnapshotDriftError

from .conftest import Daemon, dataset_cli, small_node_toml

ROWS = 600
GROUP = 200  # three row groups, three units, per file


def node(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    *,
    workers: int = 2,
    budget: str = "64MiB",
) -> Daemon:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    toml = small_node_toml(tmp_path / "cache", ("local", data))
    toml += f"""
[datasets]
registry = "local/registry"
decode_workers = {workers}
decoded_bytes = "{budget}"
"""
    return start_daemon(toml, cwd=tmp_path)


def write_parquet(path: Path, seed: int, rows: int = ROWS, width: int = 8) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "a": pa.array(range(seed, seed + rows), pa.int64()),
            "b": pa.array([f"{seed}-{i}-" + "x" * width for i in range(rows)]),
        }
    )
    pq.write_table(table, path, row_group_size=GROUP)


def client_of(daemon: Daemon) -> Client:
    return Client(socket_path=daemon.cwd / "chunkd.sock")


def units(snapshot: Any) -> list[tuple[Any, int]]:
    found = []
    for member in snapshot.members:
        fmt = format_of(member.format)
        found += [(member, u) for u in range(len(fmt.units(member)))]
    return found


def registered(daemon: Daemon, name: str, prefix: str) -> None:
    dataset_cli(daemon, "register", name, f"local/{prefix}/", "--format", "parquet")


READER = """
import hashlib, json, sys
from chunkd.client import Client
from chunkd.client.datasets import resolve
from chunkd.client.datasets.formats import format_of
from chunkd.client.datasets.shared import SharedDecoder

client = Client(socket_path=sys.argv[1])
snapshot, _, source = resolve(client, sys.argv[2])
shared = SharedDecoder(client)
out = []
for member in snapshot.members:
    fmt = format_of(member.format)
    for unit in range(len(fmt.units(member))):
        table = shared.unit(source, member, fmt, unit, None)
        out.append(None if table is None else table.to_pydict())
print(json.dumps(out))
"""


@pytest.mark.timeout(60)
def test_readers_of_a_node_get_each_unit_decoded_once(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = node(start_daemon, tmp_path)
    for i in range(2):
        write_parquet(tmp_path / "data" / "pq" / f"part-{i}.parquet", seed=1000 * i)
    registered(daemon, "pq", "pq")
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", READER, str(daemon.cwd / "chunkd.sock"), "pq"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(4)
    ]
    results = []
    for reader in readers:
        out, err = reader.communicate(timeout=50)
        assert reader.returncode == 0, err.decode()
        results.append(json.loads(out))
    with client_of(daemon) as client:
        snapshot, _, source = resolve(client, "pq")
        expected = [
            format_of(m.format).decode(source, m, u, None).to_pydict() for m, u in units(snapshot)
        ]
    assert len(expected) == 6
    for result in results:
        assert result == expected  # every reader, every unit: the daemon's, and right
    assert daemon.metric("chunkd_dataset_decodes_total", where="daemon") == 6
    assert daemon.metric("chunkd_dataset_decode_repeats_total") == 0
    assert daemon.metric("chunkd_dataset_decoded_units") == 6
    # 24 requests: 6 decoded, the other 18 held or waited for
    answered = daemon.metric("chunkd_dataset_decode_hits_total") + daemon.metric(
        "chunkd_dataset_decode_waits_total"
    )
    assert answered == 18


@pytest.mark.timeout(60)
def test_a_frozen_member_is_decoded_from_its_chunks(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = node(start_daemon, tmp_path)
    write_parquet(tmp_path / "data" / "fz" / "part-0.parquet", seed=7)
    registered(daemon, "fz", "fz")
    dataset_cli(daemon, "freeze", "fz")
    with client_of(daemon) as client:
        snapshot, header, source = resolve(client, "fz")
        assert header["frozen"]
        shared = SharedDecoder(client)
        member = snapshot.members[0]
        fmt = format_of(member.format)
        want = fmt.decode(source, member, 1, ("b",))
        # the object itself is gone: only the frozen chunks can give the bytes
        (tmp_path / "data" / "fz" / "part-0.parquet").unlink()
        got = shared.unit(source, member, fmt, 1, ("b",))
        assert got is not None
        assert got.equals(want)
    assert daemon.metric("chunkd_dataset_decodes_total", where="daemon") == 1


@pytest.mark.timeout(60)
def test_fixed_records_are_decoded_by_the_daemon_too(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = node(start_daemon, tmp_path)
    folder = tmp_path / "data" / "rec"
    folder.mkdir(parents=True)
    for i in range(2):
        (folder / f"part-{i}.bin").write_bytes(os.urandom(16 * 4000))
    dataset_cli(daemon, "register", "rec", "local/rec/", "--format", "fixed:16")
    with client_of(daemon) as client:
        snapshot, _, source = resolve(client, "rec")
        shared = SharedDecoder(client)
        fmt = format_of("fixed")
        for member, unit in units(snapshot):
            want = fmt.decode(source, member, unit, None)
            for columns in (None, ("record",)):
                got = shared.unit(source, member, fmt, unit, columns)
                assert got is not None
                assert got.equals(want)
                assert bytes(fmt.sample(got, 7)) == bytes(fmt.sample(want, 7))
        shared.close()
    assert daemon.metric("chunkd_dataset_decodes_total", where="daemon") == 2 * len(units(snapshot))


@pytest.mark.timeout(60)
def test_a_reader_never_maps_an_entry_of_other_bytes_versions_or_columns(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = node(start_daemon, tmp_path)
    path = tmp_path / "data" / "rw" / "part-0.parquet"
    write_parquet(path, seed=0)
    registered(daemon, "rw", "rw")
    with client_of(daemon) as client:
        shared = SharedDecoder(client)
        old, _, source = resolve(client, "rw@1")
        member = old.members[0]
        fmt = format_of("parquet")
        first = shared.unit(source, member, fmt, 0, None)
        assert first is not None
        assert first.column("a").to_pylist()[:2] == [0, 1]

        # 1. Other bytes: the object rewritten and registered again.
        time.sleep(0.01)
        write_parquet(path, seed=500)
        registered(daemon, "rw", "rw")
        new, _, _ = resolve(client, "rw@2")
        renewed = new.members[0]
        assert renewed.version != member.version
        fresh = shared.unit(source, renewed, fmt, 0, None)
        assert fresh is not None
        assert fresh.column("a").to_pylist()[:2] == [500, 501]  # never the old table
        assert daemon.metric("chunkd_dataset_decodes_total", where="daemon") == 2
        # The old snapshot's units were decoded from the old bytes, or drift: unit 1 of
        # the old version was never decoded, and its bytes are gone.
        with pytest.raises(SnapshotDriftError):
            shared.unit(source, member, fmt, 1, None)
        # A request that claims the old version for the new bytes drifts too.
        forged = type(member)(
            member.key, renewed.size, member.version, "parquet", member.samples, renewed.meta
        )
        with pytest.raises(SnapshotDriftError):
            shared.unit(source, forged, fmt, 2, None)

        # 2. Another decoder version: declined, the reader decodes itself.
        class Bumped:
            name = "parquet"
            version = fmt.version + 1

        assert shared.unit(source, renewed, Bumped(), 0, None) is None  # type: ignore[arg-type]
        assert daemon.metric("chunkd_dataset_decode_declined_total", reason="format") == 1

        # 3. Other columns: each projection is its own entry, in its own order.
        only_a = shared.unit(source, renewed, fmt, 0, ("a",))
        both = shared.unit(source, renewed, fmt, 0, ("a", "b"))
        swapped = shared.unit(source, renewed, fmt, 0, ("b", "a"))
        again_a = shared.unit(source, renewed, fmt, 0, ("a",))
        assert only_a is not None
        assert both is not None
        assert swapped is not None
        assert again_a is not None
        assert only_a.column_names == ["a"] == again_a.column_names
        assert both.column_names == ["a", "b"]
        assert swapped.column_names == ["b", "a"]
        assert both.column("b").to_pylist() == swapped.column("b").to_pylist()
        assert daemon.metric("chunkd_dataset_decodes_total", where="daemon") == 5


@pytest.mark.timeout(60)
def test_a_daemon_that_decodes_nothing_declines_and_readers_count_their_own(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = node(start_daemon, tmp_path, budget="0")
    write_parquet(tmp_path / "data" / "off" / "part-0.parquet", seed=0)
    registered(daemon, "off", "off")
    with client_of(daemon) as client:
        snapshot, _, source = resolve(client, "off")
        shared = SharedDecoder(client)
        member = snapshot.members[0]
        assert shared.unit(source, member, format_of("parquet"), 0, None) is None
        for _ in range(1000):
            shared.local()  # batched: not a request each
        time.sleep(1.05)
        shared.local(2)
    assert daemon.metric("chunkd_dataset_decode_declined_total", reason="off") == 1
    assert daemon.metric("chunkd_dataset_decodes_total", where="daemon") == 0
    assert daemon.metric("chunkd_dataset_decodes_total", where="reader") == 1002
    assert not list(worker_pids(daemon))  # no worker was ever started


@pytest.mark.timeout(60)
def test_a_full_pool_declines_at_once(start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    daemon = node(start_daemon, tmp_path, workers=1)
    write_parquet(tmp_path / "data" / "busy" / "part-0.parquet", seed=0)
    registered(daemon, "busy", "busy")
    with client_of(daemon) as client:
        snapshot, _, source = resolve(client, "busy")
        member = snapshot.members[0]
        fmt = format_of("parquet")
        shared = SharedDecoder(client)
        # 24 distinct keys at once: while the one worker starts, every request queues;
        # one runs, 4 wait (WAITING_PER_WORKER), the rest are declined at once.
        asks = [(u, cols) for u in range(3) for cols in (None, ("a",), ("b",), ("b", "a"))]
        asks = asks * 2  # repeats of a key wait for its flight: 12 keys, 24 requests
        with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
            tables = list(pool.map(lambda a: shared.unit(source, member, fmt, *a), asks))
        shared.close()
    declined = daemon.metric("chunkd_dataset_decode_declined_total", reason="busy")
    assert declined >= 1
    assert sum(t is None for t in tables) == declined
    assert daemon.metric("chunkd_dataset_decodes_total", where="daemon") <= 12


@pytest.mark.timeout(60)
def test_held_entries_stay_within_their_budget(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    budget = 1 << 20
    daemon = node(start_daemon, tmp_path, budget="1MiB")
    # units of about 300 KiB of Arrow IPC each, and one file whose units exceed the budget
    for i in range(3):
        write_parquet(tmp_path / "data" / "big" / f"part-{i}.parquet", seed=i, width=1500)
    write_parquet(tmp_path / "data" / "big" / "z-huge.parquet", seed=9, width=8000)
    registered(daemon, "big", "big")
    with client_of(daemon) as client:
        snapshot, _, source = resolve(client, "big")
        shared = SharedDecoder(client)
        for member, unit in units(snapshot):
            table = shared.unit(source, member, format_of("parquet"), unit, None)
            assert table is not None  # handed out, held or not
            assert table.num_rows == GROUP
            assert daemon.metric("chunkd_dataset_decoded_bytes") <= budget
    assert daemon.metric("chunkd_dataset_decoded_evicted_total") >= 1
    assert 1 <= daemon.metric("chunkd_dataset_decoded_units") <= 3
    assert daemon.metric("chunkd_dataset_decodes_total", where="daemon") == 12


def raw_request(path: Path, header: dict[str, Any]) -> dict[str, Any]:
    """One request sent as it is, past the client's own checks; the answer's header."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(path))
        send_frame(sock, {"op": "hello", "version": VERSION, "id": 0})
        recv_frame(sock)
        send_frame(sock, header | {"id": 1})
        answer, _, fds = recv_frame(sock)
        for fd in fds:
            os.close(fd)
        return answer


@pytest.mark.timeout(60)
def test_bad_requests_get_clear_errors_before_any_work(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = node(start_daemon, tmp_path)
    write_parquet(tmp_path / "data" / "bad" / "part-0.parquet", seed=0)
    registered(daemon, "bad", "bad")
    with client_of(daemon) as client:
        snapshot, _, _ = resolve(client, "bad")
        member = snapshot.members[0]  # its page is read through the client
    sock = daemon.cwd / "chunkd.sock"
    good = {
        "op": "ds_decode",
        "format": "parquet",
        "decoder": format_of("parquet").version,
        "key": member.key,
        "size": member.size,
        "version": member.version,
        "samples": member.samples,
        "meta": json.dumps(dict(member.meta)),
        "unit": 0,
        "backend": "local",
    }
    assert raw_request(sock, good)["decoded"] is True

    def refused(change: dict[str, Any], error: str, words: str) -> None:
        answer = raw_request(sock, {k: v for k, v in (good | change).items() if v is not None})
        assert answer["ok"] is False, answer
        assert answer["error"] == error, answer
        assert words in answer["message"], answer

    refused({"meta": "{" + '"k":"' + "x" * (33 << 10) + '"}'}, "InvalidRequestError", "longer")
    refused({"meta": "[1, 2]"}, "InvalidRequestError", "JSON object")
    refused({"meta": "[" * 40 + "]" * 40}, "InvalidRequestError", "meta")
    refused({"meta": "{nope"}, "InvalidRequestError", "meta")
    refused({"unit": member.samples}, "InvalidRequestError", "no such unit")
    refused({"unit": 3}, "InvalidRequestError", "3 units")  # within samples; the worker's
    refused({"unit": -1}, "InvalidRequestError", "unit")
    refused({"columns": ["a"] * 1025}, "InvalidRequestError", "columns")
    refused({"columns": ["nope"]}, "DatasetFormatError", "nope")
    refused({"backend": None}, "InvalidRequestError", "one source")
    refused({"backend": None, "registry": "local"}, "InvalidRequestError", "lacks chunk_bytes")
    refused(
        {"backend": None, "registry": "local", "chunk_bytes": 1 << 20, "chunks": ["ab" * 32] * 2},
        "InvalidRequestError",
        "1 chunks; 2 came",
    )
    refused(
        {"backend": None, "registry": "local", "chunk_bytes": 1 << 20, "chunks": ["zz"]},
        "InvalidRequestError",
        "no chunk id",
    )
    unknown = raw_request(sock, good | {"format": "tarball"})
    assert unknown["ok"] is True
    assert unknown["decoded"] is False
    assert unknown["reason"] == "format"
    assert "'tarball'" in unknown["message"]
    older = raw_request(sock, good | {"decoder": 99})
    assert older["decoded"] is False
    assert older["reason"] == "format"
    # a header past the frame's bound closes nothing but that request's connection
    with pytest.raises((ConnectionError, OSError, ValueError)):
        raw_request(sock, good | {"columns": ["c" * 1000] * 100})
    assert raw_request(sock, good)["decoded"] is True
    log = daemon.log.read_text(errors="replace")
    assert "Traceback" not in log


def worker_pids(daemon: Daemon) -> list[int]:
    """The pids of the daemon's decode worker processes."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            status = (entry / "status").read_text()
        except OSError:
            continue
        parent = next((line for line in status.splitlines() if line.startswith("PPid:")), "")
        if b"chunkd.client.datasets.decoder" in cmdline and parent.split()[-1:] == [
            str(daemon.process.pid)
        ]:
            found.append(int(entry.name))
    return found


@pytest.mark.timeout(60)
def test_a_forged_member_record_cannot_change_what_another_request_decodes(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    # One decode worker, so both requests meet in one process: the formats' caches there
    # (footers, a member's unit plan) are keyed by its name and version, and a request
    # that names the member with a forged record (row group 0 "200 MiB", so cut in two)
    # must not leave a plan that the genuine request's decode then follows.
    import dataclasses

    from chunkd.client.datasets.formats import clear_caches

    daemon = node(start_daemon, tmp_path, workers=1)
    path = tmp_path / "data" / "pz" / "part-0.parquet"
    path.parent.mkdir(parents=True)
    with pq.ParquetWriter(path, pa.schema([("x", pa.int64())])) as writer:
        writer.write_table(pa.table({"x": list(range(1000))}), row_group_size=1000)
        writer.write_table(pa.table({"x": list(range(1000, 1500))}), row_group_size=500)
    registered(daemon, "pz", "pz")
    with client_of(daemon) as client:
        snapshot, _, source = resolve(client, "pz")
        member = snapshot.members[0]
        fmt = format_of("parquet")
        want = fmt.decode(source, member, 1, None)
        assert want["x"].to_pylist() == list(range(1000, 1500))
        groups = [list(g) for g in member.meta["row_groups"]]
        groups[0][3] = 200 << 20
        forged = dataclasses.replace(member, meta={**member.meta, "row_groups": groups})
        shared = SharedDecoder(client)
        shared.unit(source, forged, fmt, 0, None)  # its own entry, whatever it decodes to
        clear_caches()  # this process's own view of the forged record goes too
        got = shared.unit(source, member, fmt, 1, None)
        assert got is not None
        assert got.equals(want)
        shared.close()


@pytest.mark.timeout(60)
def test_a_report_of_reader_decodes_counts_at_most_its_bound(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    from chunkd.gateway.decoding import MAX_REPORTED

    daemon = node(start_daemon, tmp_path)
    with client_of(daemon) as client:
        client.request("ds_decode_report", {"decodes": (1 << 31) - 1}).close()
        client.request("ds_decode_report", {"decodes": 3}).close()
    assert daemon.metric("chunkd_dataset_decodes_total", where="reader") == MAX_REPORTED + 3


@pytest.mark.timeout(60)
def test_a_decode_worker_killed_is_replaced_and_its_readers_are_answered(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    # kill -9 of the node's one decode worker: the next request gets a fresh worker (or
    # is declined once, and its reader decodes itself); no reader gets a wrong table
    import signal

    daemon = node(start_daemon, tmp_path, workers=1)
    write_parquet(tmp_path / "data" / "kz" / "part-0.parquet", seed=3)
    registered(daemon, "kz", "kz")
    with client_of(daemon) as client:
        snapshot, _, source = resolve(client, "kz")
        member = snapshot.members[0]
        fmt = format_of("parquet")
        shared = SharedDecoder(client)
        assert shared.unit(source, member, fmt, 0, None) is not None
        found = subprocess.run(
            ["pgrep", "-P", str(daemon.process.pid), "-f", "chunkd.client.datasets.decoder"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()
        assert found, "no decode worker under the daemon"
        for pid in found:
            os.kill(int(pid), signal.SIGKILL)
        want = fmt.decode(source, member, 1, None)
        answers = [shared.unit(source, member, fmt, 1, None) for _ in range(3)]
        assert all(a is None or a.equals(want) for a in answers)
        assert answers[-1] is not None
        assert answers[-1].equals(want)
        shared.close()
    assert "Traceback" not in daemon.log.read_text()
