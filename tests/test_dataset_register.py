"""``chunkd dataset register`` and the client's registration: a prefix listed, each
member's metadata read through the daemon, the snapshot committed in the registry.

Every test runs a real daemon on the embedded default config (``local`` at
``./chunkd-data``, the registry at ``local/datasets``) and real files.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from chunkd.client import Client
from chunkd.client.datasets import Dataset
from chunkd.client.datasets.register import Progress, commit, parse_format, scan_prefix
from chunkd.errors import (
    DatasetFormatError,
    DatasetNotFoundError,
    InvalidRequestError,
    SnapshotDriftError,
)

from .conftest import BIN, Daemon, wait_for_socket

RECORD = 32


@pytest.fixture
def node(start_daemon: Any, tmp_path: Path) -> Daemon:
    daemon: Daemon = start_daemon()
    assert wait_for_socket(tmp_path / "chunkd.sock", 10)
    return daemon


def write_records(root: Path, folder: str, files: int, records: int) -> dict[str, bytes]:
    """``files`` files of ``records`` fixed-size records each; their bytes by key."""
    written = {}
    for i in range(files):
        key = f"{folder}/{i // 1000:03d}/part-{i:06d}.bin"
        body = b"".join(
            (i * records + j).to_bytes(8, "little") * (RECORD // 8) for j in range(records)
        )
        path = root / "chunkd-data" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
        written[key] = body
    return written


def cli(tmp_path: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    env["CHUNKD_SOCKET"] = str(tmp_path / "chunkd.sock")
    done = subprocess.run(
        [str(BIN / "chunkd"), "dataset", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=110,
        check=False,
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done


def test_10k_files_register_read_and_resolve_by_version(node: Daemon, tmp_path: Path) -> None:
    written = write_records(tmp_path, "rec", 10_000, 3)
    seen: list[Progress] = []
    with Client(tmp_path / "chunkd.sock") as client:
        fmt, options = parse_format(f"fixed:{RECORD}")
        snapshot = scan_prefix(
            client,
            "local/rec/",
            fmt=fmt,
            options=options,
            progress=lambda p: seen.append(Progress(p.listed, p.scanned)),
        )
        assert len(snapshot.members) == 10_000
        assert len(snapshot) == 30_000
        assert seen
        assert seen[-1].scanned == 10_000
        # The window of members in flight is bounded: never the whole listing.
        assert max(p.listed - p.scanned for p in seen) <= 4 * 8
        answer = commit(client, "rec/train", snapshot)
        assert answer["version"] == 1
        assert answer["snapshot"] == snapshot.id

        dataset = Dataset.open("rec/train@1", client)
        assert dataset.id == snapshot.id
        assert len(dataset) == 30_000
        for index in (0, 1, 2, 3, 12_345, 29_999):
            member, sample = dataset.snapshot.locate(index)
            key = dataset.snapshot.members[member].key
            assert bytes(dataset[index]) == written[key][sample * RECORD : (sample + 1) * RECORD]
        assert Dataset.open("rec/train", client).id == snapshot.id  # latest
        assert Dataset.open(snapshot.id, client).id == snapshot.id
        with pytest.raises(DatasetNotFoundError):
            Dataset.open("rec/train@2", client)
        with pytest.raises(DatasetNotFoundError):
            Dataset.open("rec/other", client)


def test_a_bad_file_stops_the_registration_by_name_or_is_excluded(
    node: Daemon, tmp_path: Path
) -> None:
    write_records(tmp_path, "bad", 20, 2)
    (tmp_path / "chunkd-data" / "bad" / "000" / "part-000007.bin").write_bytes(b"x" * (RECORD + 1))
    failed = cli(
        tmp_path, "register", "bad", "local/bad/", "--format", f"fixed:{RECORD}", check=False
    )
    assert failed.returncode == 1
    assert "bad/000/part-000007.bin" in failed.stderr
    assert "not a whole number" in failed.stderr
    # Nothing was registered.
    assert "no datasets registered" in cli(tmp_path, "ls").stdout

    done = cli(
        tmp_path,
        "register",
        "bad",
        "local/bad/",
        "--format",
        f"fixed:{RECORD}",
        "--skip-bad",
        "--json",
    )
    report = json.loads(done.stdout)
    assert report["version"] == 1
    assert report["members"] == 19
    assert [e["key"] for e in report["excluded"]] == ["bad/000/part-000007.bin"]
    shown = json.loads(cli(tmp_path, "show", "bad@1", "--json").stdout)
    assert shown["excluded"][0]["key"] == "bad/000/part-000007.bin"
    assert shown["samples"] == 38


def test_versions_tags_and_diff_through_the_command_line(node: Daemon, tmp_path: Path) -> None:
    write_records(tmp_path, "web", 30, 2)
    first = json.loads(
        cli(
            tmp_path, "register", "web", "local/web/", "--format", f"fixed:{RECORD}", "--json"
        ).stdout
    )
    (tmp_path / "chunkd-data" / "web" / "000" / "part-000003.bin").unlink()
    write_records(tmp_path, "web2", 1, 5)  # one more file, moved under web/
    os.rename(
        tmp_path / "chunkd-data" / "web2" / "000" / "part-000000.bin",
        tmp_path / "chunkd-data" / "web" / "000" / "extra.bin",
    )
    second = json.loads(
        cli(
            tmp_path, "register", "web", "local/web/", "--format", f"fixed:{RECORD}", "--json"
        ).stdout
    )
    assert (first["version"], second["version"]) == (1, 2)
    assert first["snapshot"] != second["snapshot"]

    cli(tmp_path, "tag", "web@1", "prod")
    assert json.loads(cli(tmp_path, "show", "web@prod", "--json").stdout)["id"] == first["snapshot"]
    cli(tmp_path, "tag", "web@2", "prod")  # a tag moves: the newest entry wins
    assert (
        json.loads(cli(tmp_path, "show", "web@prod", "--json").stdout)["id"] == second["snapshot"]
    )

    diff = json.loads(cli(tmp_path, "diff", "web@1", "web@2", "--json").stdout)
    assert diff["added"] == ["000/extra.bin"]
    assert diff["removed"] == ["000/part-000003.bin"]
    assert not diff["same"]
    same = json.loads(cli(tmp_path, "diff", "web@1", first["snapshot"], "--json").stdout)
    assert same["same"]
    listed = json.loads(cli(tmp_path, "ls", "--json").stdout)
    assert [(e["name"], e["latest"]) for e in listed] == [("web", 2)]
    missing = cli(tmp_path, "show", "web@7", check=False)
    assert missing.returncode == 1
    assert "web@7" in missing.stderr or "version 7" in missing.stderr


def test_a_member_that_drifted_is_never_read_at_its_new_contents(
    node: Daemon, tmp_path: Path
) -> None:
    written = write_records(tmp_path, "drift", 3, 4)
    with Client(tmp_path / "chunkd.sock") as client:
        snapshot = scan_prefix(
            client, "local/drift/", fmt="fixed", options={"record_bytes": RECORD}
        )
        commit(client, "drift", snapshot)
        key = snapshot.members[1].key
        path = tmp_path / "chunkd-data" / key
        time.sleep(0.01)
        path.write_bytes(b"\xee" * len(written[key]))  # same size, new contents
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
        dataset = Dataset.open("drift", client)
        assert bytes(dataset[0]) == written[snapshot.members[0].key][:RECORD]
        # The daemon may serve the recorded version from its cache until it revalidates;
        # a fresh client and a cold read of the changed member must refuse it.
        deadline = time.monotonic() + 30
        drifted: SnapshotDriftError | None = None
        while drifted is None:
            try:
                with Client(tmp_path / "chunkd.sock") as fresh:
                    got = bytes(Dataset.open("drift", fresh)[5])
            except SnapshotDriftError as exc:
                drifted = exc
                continue
            assert got == written[key][RECORD : 2 * RECORD], "read at its new contents"
            assert time.monotonic() < deadline, "the drift was never noticed"
            time.sleep(0.5)
        assert key in str(drifted)
        path.unlink()
        with (
            Client(tmp_path / "chunkd.sock") as fresh,
            pytest.raises(SnapshotDriftError, match=key),
        ):
            bytes(Dataset.open("drift", fresh)[5])


def test_bad_arguments_are_refused_clearly(node: Daemon, tmp_path: Path) -> None:
    for text in ("fixed", "fixed:0", "csv", "parquet:3"):
        with pytest.raises(InvalidRequestError, match="--format"):
            parse_format(text)
    with (
        Client(tmp_path / "chunkd.sock") as client,
        pytest.raises(DatasetFormatError, match="holds no"),
    ):
        scan_prefix(client, "local/nothing-here/", fmt="fixed", options={"record_bytes": 4})
    bad_name = cli(tmp_path, "register", "../x", "local/", check=False)
    assert bad_name.returncode == 1
    assert "not a dataset name" in bad_name.stderr


def test_a_registration_killed_midway_leaves_no_version(node: Daemon, tmp_path: Path) -> None:
    """kill -9 of ``chunkd dataset register`` while it reads the members: nothing is
    registered (the manifest is committed only once every member is read), and the next
    registration is version 1."""
    root = tmp_path / "chunkd-data" / "kill"
    root.mkdir(parents=True)
    for i in range(4000):
        (root / f"part-{i:05d}.jsonl").write_bytes(b'{"a": 1}\n' * (1 + i % 7))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    env["CHUNKD_SOCKET"] = str(tmp_path / "chunkd.sock")
    args = ["register", "kill", "local/kill/", "--format", "jsonl", "--concurrency", "1"]
    process = subprocess.Popen(
        [str(BIN / "chunkd"), "dataset", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=10) == -signal.SIGKILL, "the registration ended before the kill"
    shown = cli(tmp_path, "show", "kill", check=False)
    assert shown.returncode == 1
    assert "kill" in shown.stderr
    done = json.loads(cli(tmp_path, *args, "--json").stdout)
    assert done["members"] == 4000
    assert done["version"] == 1


def test_a_file_read_then_rewritten_registers_at_its_new_version(
    start_daemon: Any, tmp_path: Path
) -> None:
    """A backend of a config file is immutable by default: the daemon never checks a
    version it knows again. A registration lists the file's new version, and its pinned
    reads make the daemon check the object again instead of drifting for ever."""
    data = tmp_path / "data"
    (data / "web").mkdir(parents=True)
    start_daemon(
        f"""
[cache]
dir = "{tmp_path}/cache"
disk_min_free_bytes = 0

[[backends]]
name = "d"
url = "file://{data}"

[[backends]]
name = "r"
url = "file://{tmp_path}/registry"
writable = true

[datasets]
registry = "r/datasets"
"""
    )
    (tmp_path / "registry").mkdir(exist_ok=True)
    path = data / "web" / "a.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": 2}\n')
    with Client(tmp_path / "chunkd.sock") as client:
        assert bytes(client.read("d/web/a.jsonl")) == b'{"a": 1}\n{"a": 2}\n'
        time.sleep(0.01)
        path.write_bytes(b'{"b": 10}\n{"b": 20}\n{"b": 30}\n')
        snapshot = scan_prefix(client, "d/web/", fmt="jsonl")
        assert len(snapshot) == 3
        commit(client, "web", snapshot)
        dataset = Dataset.open("web", client)
        assert [bytes(dataset[i]) for i in range(3)] == [b'{"b": 10}', b'{"b": 20}', b'{"b": 30}']


def test_mds_datasets_register_from_their_index_merged_or_per_folder(
    node: Daemon, tmp_path: Path
) -> None:
    from .test_dataset_formats import MDS_COLUMNS, assert_mds_equal, mds_samples, mds_shard

    root = tmp_path / "chunkd-data" / "mds"
    want: list[dict[str, Any]] = []
    entries = []
    for i, folder in enumerate(("a", "b")):
        samples = mds_samples(50 + i, seed=i)
        data, entry = mds_shard(MDS_COLUMNS, samples, "shard.00000.mds", None)
        (root / folder).mkdir(parents=True)
        (root / folder / "shard.00000.mds").write_bytes(data)
        (root / folder / "index.json").write_text(json.dumps({"version": 2, "shards": [entry]}))
        merged = json.loads(json.dumps(entry))
        merged["raw_data"]["basename"] = f"{folder}/shard.00000.mds"
        entries.append(merged)
        want += samples
    with Client(tmp_path / "chunkd.sock") as client:
        # Each folder's own index, without a merged one at the prefix.
        per_folder = scan_prefix(client, "local/mds/", fmt="mds")
        assert [m.key for m in per_folder.members] == [
            "mds/a/shard.00000.mds",
            "mds/b/shard.00000.mds",
        ]
        # A merged index at the prefix is the dataset's, as Streaming reads it: each
        # shard once, not once per index that names it.
        (root / "index.json").write_text(json.dumps({"version": 2, "shards": entries}))
        merged_snapshot = scan_prefix(client, "local/mds/", fmt="mds")
        assert [m.key for m in merged_snapshot.members] == [m.key for m in per_folder.members]
        commit(client, "mds", merged_snapshot)
        dataset = Dataset.open("mds", client)
        assert len(dataset) == len(want) == 101
        for index in (0, 49, 50, 100):
            assert_mds_equal(dataset[index], want[index])
        with pytest.raises(DatasetFormatError, match="--format mds"):
            scan_prefix(client, "local/mds/", fmt="auto")


def test_a_registration_of_many_files_stays_inside_a_small_fd_limit(
    node: Daemon, tmp_path: Path
) -> None:
    """Every chunk a client caches holds an fd: a registration's worker clients keep
    few, so 3,000 files read by 8 workers fit a process limit of 256 fds."""
    root = tmp_path / "chunkd-data" / "fds"
    root.mkdir(parents=True)
    for i in range(3000):
        (root / f"part-{i:05d}.jsonl").write_bytes(b'{"n": %d}\n' % i)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    env["CHUNKD_SOCKET"] = str(tmp_path / "chunkd.sock")

    def small_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    done = subprocess.run(
        [str(BIN / "chunkd"), "dataset", "register", "fds", "local/fds/", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        preexec_fn=small_limit,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["members"] == 3000
