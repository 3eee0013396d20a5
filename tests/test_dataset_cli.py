"""``chunkd dataset check``, ``freeze``, ``migrate`` and ``replay`` end to end: a real
daemon, real files, the command line as users run it, and the client reading back."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from chunkd.client import Client
from chunkd.client.datasets import Dataset
from chunkd.client.datasets.frozen import FrozenSource
from chunkd.client.datasets.loader import Loader

from .conftest import BIN, Daemon, wait_for_socket
from .test_dataset_register import cli

CONFIG = """
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

[[backends]]
name = "copy"
url = "file://{dir}/copy"
writable = true

[datasets]
registry = "local/registry"
"""
RECORD = 24


@pytest.fixture
def node(start_daemon: Any, tmp_path: Path) -> Daemon:
    (tmp_path / "data").mkdir()
    (tmp_path / "copy").mkdir()
    daemon: Daemon = start_daemon(CONFIG.format(dir=tmp_path))
    assert wait_for_socket(tmp_path / "chunkd.sock", 10)
    return daemon


def records(tmp_path: Path, folder: str, files: int, per: int) -> dict[str, bytes]:
    written = {}
    for i in range(files):
        body = os.urandom(RECORD * per)
        path = tmp_path / "data" / folder / f"part-{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
        written[f"{folder}/part-{i:03d}.bin"] = body
    return written


def sample_bytes(written: dict[str, bytes], dataset: Dataset, index: int) -> bytes:
    member, sample = dataset.snapshot.locate(index)
    key = dataset.snapshot.members[member].key
    return written[key][sample * RECORD : (sample + 1) * RECORD]


def test_check_passes_a_clean_parquet_dataset_and_fails_bad_json_lines(
    node: Daemon, tmp_path: Path
) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    for i in range(4):
        table = pa.table({"id": list(range(i * 50, i * 50 + 50)), "text": ["x" * 10] * 50})
        sink = io.BytesIO()
        pq.write_table(table, sink, row_group_size=20)
        path = tmp_path / "data" / "pq" / f"part-{i}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(sink.getvalue())
    registered = json.loads(cli(tmp_path, "register", "pq", "local/pq/", "--json").stdout)
    assert registered["samples"] == 200
    clean = cli(tmp_path, "check", "pq", "--json")
    assert all(f["level"] == "warning" for f in json.loads(clean.stdout))

    body = b'{"a": 1}\n{"a": 2}\n{"a": oops}\n'
    (tmp_path / "data" / "js").mkdir()
    (tmp_path / "data" / "js" / "good.jsonl").write_bytes(b'{"a": 0}\n' * 3)
    (tmp_path / "data" / "js" / "bad.jsonl").write_bytes(body)
    cli(tmp_path, "register", "js", "local/js/")
    failed = cli(tmp_path, "check", "js", "--deep", check=False)
    assert failed.returncode == 1, failed.stdout
    assert "js/bad.jsonl" in failed.stdout
    assert "error" in failed.stdout


def test_a_frozen_snapshot_reads_bit_exact_after_its_source_is_rewritten_and_gc_runs(
    node: Daemon, tmp_path: Path
) -> None:
    written = records(tmp_path, "fr", 6, 40_000)  # about 1 MiB each
    cli(tmp_path, "register", "fr", "local/fr/", "--format", f"fixed:{RECORD}")
    frozen = json.loads(cli(tmp_path, "freeze", "fr@1", "--json").stdout)
    assert frozen["members"] == 6
    again = json.loads(cli(tmp_path, "freeze", "fr@1", "--json").stdout)
    assert again["uploaded"] == 0  # idempotent: every chunk is there
    for key in written:
        (tmp_path / "data" / key).write_bytes(os.urandom(len(written[key])))
    (tmp_path / "data" / "fr" / "part-002.bin").unlink()
    # The freeze's intents age past the collector's intent TTL (a day) and go: only
    # the frozen record keeps its chunks now.
    intents = list((tmp_path / "data" / "intents").glob("ds-*.json"))
    assert intents
    old = time.time() - 3 * 86400
    for intent in intents:
        os.utime(intent, (old, old))
    gc = subprocess.run(
        [str(BIN / "chunkd"), "gc", "local", "--grace", "0s"],
        env={**os.environ, "CHUNKD_SOCKET": str(tmp_path / "chunkd.sock")},
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert not [p for p in intents if p.exists()], "the aged intents were not collected"
    with Client(tmp_path / "chunkd.sock") as client:
        dataset = Dataset.open("fr@1", client)
        assert isinstance(dataset.source, FrozenSource)
        assert dataset.registry["frozen"]
        # Nothing is warmed ahead by the source objects' names: they were rewritten.
        assert dataset.ranges([(0, 0), (1, 5)]) == []
        for index in range(0, len(dataset), 997):
            assert bytes(dataset[index]) == sample_bytes(written, dataset, index)
        assert bytes(dataset[len(dataset) - 1]) == sample_bytes(written, dataset, len(dataset) - 1)
        # A worker started by spawn gets the dataset pickled: it resolves it again, frozen.
        with pickle.loads(pickle.dumps(dataset)) as clone:
            assert isinstance(clone.source, FrozenSource)
            assert bytes(clone[5]) == sample_bytes(written, dataset, 5)
    shown = json.loads(cli(tmp_path, "show", "fr@1", "--json").stdout)
    assert shown["frozen"] is True


def test_migrate_copies_verified_and_diff_shows_no_change(node: Daemon, tmp_path: Path) -> None:
    written = records(tmp_path, "mg", 5, 300)
    cli(tmp_path, "register", "mg", "local/mg/", "--format", f"fixed:{RECORD}")
    moved = json.loads(cli(tmp_path, "migrate", "mg@1", "--to", "copy/moved/", "--json").stdout)
    assert moved["version"] == 2
    assert sorted(p.name for p in (tmp_path / "copy" / "moved").iterdir()) == sorted(
        Path(k).name for k in written
    )
    diff = json.loads(cli(tmp_path, "diff", "mg@1", "mg@2", "--json").stdout)
    # The copy's objects are others: migrate read every byte of the original and
    # recorded their hashes in the copy, whose origin it is (docs/datasets.md, "diff").
    assert diff["same"], diff
    assert diff["same_by"] == {"content": 5, "version": 0}
    with Client(tmp_path / "chunkd.sock") as client:
        copy = Dataset.open("mg@2", client)
        assert copy.snapshot.backend == "copy"
        for index in range(0, len(copy), 37):
            member, sample = copy.snapshot.locate(index)
            key = "mg/" + copy.snapshot.members[member].relative(copy.snapshot.prefix)
            assert bytes(copy[index]) == written[key][sample * RECORD : (sample + 1) * RECORD]
        # The source may go now: the copy reads on its own. (The original still reads
        # its recorded bytes from the cache until the daemon revalidates, then drifts:
        # never other bytes.)
        for key in written:
            (tmp_path / "data" / key).unlink()
        with Client(tmp_path / "chunkd.sock") as fresh:
            copy = Dataset.open("mg@2", fresh)
            member, sample = copy.snapshot.locate(0)
            key = "mg/" + copy.snapshot.members[member].relative(copy.snapshot.prefix)
            assert bytes(copy[0]) == written[key][:RECORD]
    refused = cli(tmp_path, "migrate", "mg@1", "--to", "nowhere/x/", check=False)
    assert refused.returncode == 1
    assert "nowhere" in refused.stderr


def test_replay_names_the_samples_a_step_read_on_every_rank(node: Daemon, tmp_path: Path) -> None:
    records(tmp_path, "rp", 7, 33)
    cli(tmp_path, "register", "rp", "local/rp/", "--format", f"fixed:{RECORD}")
    world, batch, seed, step = 3, 5, 1234, 4
    with Client(tmp_path / "chunkd.sock") as client:
        dataset = Dataset.open("rp@1", client)
        seen: dict[int, list[str]] = {}
        for rank in range(world):
            loader = Loader(dataset, batch_size=batch, seed=seed, rank=rank, world_size=world)
            for got in loader:
                if got.step == step:
                    seen[rank] = got.ids
                    break
    replayed = json.loads(
        cli(
            tmp_path,
            "replay",
            "rp@1",
            "--seed",
            str(seed),
            "--step",
            str(step),
            "--batch-size",
            str(batch),
            "--world-size",
            str(world),
            "--json",
        ).stdout
    )
    assert {r["rank"]: [s["id"] for s in r["samples"]] for r in replayed["ranks"]} == seen
    # From a saved state: the state after 2 steps, then the 2nd step after it.
    with Client(tmp_path / "chunkd.sock") as client:
        loader = Loader(Dataset.open("rp@1", client), batch_size=batch, seed=seed, world_size=world)
        batches = iter(loader)
        next(batches)
        next(batches)
        state = loader.state()
    (tmp_path / "state.json").write_text(json.dumps(state))
    from_state = json.loads(
        cli(
            tmp_path,
            "replay",
            "--state",
            str(tmp_path / "state.json"),
            "--steps",
            "2",
            "--batch-size",
            str(batch),
            "--world-size",
            str(world),
            "--json",
        ).stdout
    )
    assert {r["rank"]: [s["id"] for s in r["samples"]] for r in from_state["ranks"]} == seen
    text = cli(
        tmp_path,
        "replay",
        "rp@1",
        "--seed",
        str(seed),
        "--step",
        "0",
        "--batch-size",
        str(batch),
        "--world-size",
        str(world),
        "--rank",
        "1",
    ).stdout
    assert "rank 1" in text
    assert "rank 0" not in text
    assert "open one:" in text


def test_the_time_to_the_first_batch_is_broken_down_and_exported(
    node: Daemon, tmp_path: Path
) -> None:
    records(tmp_path, "tt", 3, 50)
    cli(tmp_path, "register", "tt", "local/tt/", "--format", f"fixed:{RECORD}")
    with Client(tmp_path / "chunkd.sock") as client:
        loader = Loader(Dataset.open("tt", client), batch_size=8, seed=3)
        next(iter(loader))
    phases = loader.first_batch
    assert set(phases) == {"metadata", "first_chunk", "decode", "total"}
    assert phases["metadata"] > 0
    assert phases["total"] >= phases["first_chunk"] + phases["decode"]
    name = "chunkd_dataset_first_batch_seconds_count"
    for phase in ("metadata", "first_chunk", "decode", "total"):
        assert node.metric(name, phase=phase) == 1
    assert node.metric(name, phase="worker_start") == 0  # not in a worker process


def test_check_finds_every_drifted_member_and_bad_arguments_are_clear(
    node: Daemon, tmp_path: Path
) -> None:
    written = records(tmp_path, "dr", 4, 10)
    cli(tmp_path, "register", "dr", "local/dr/", "--format", f"fixed:{RECORD}")
    assert cli(tmp_path, "check", "dr").returncode == 0
    keys = sorted(written)
    (tmp_path / "data" / keys[1]).write_bytes(os.urandom(len(written[keys[1]])))
    (tmp_path / "data" / keys[3]).unlink()
    failed = cli(tmp_path, "check", "dr", "--json", check=False)
    assert failed.returncode == 1
    drift = {f["member"] for f in json.loads(failed.stdout) if f["code"] == "drift"}
    assert drift == {keys[1], keys[3]}

    by_id = json.loads(cli(tmp_path, "show", "dr", "--json").stdout)["id"]
    tagged = cli(tmp_path, "tag", by_id, "prod", check=False)
    assert tagged.returncode == 1
    assert "NAME@N" in tagged.stderr
    for args, said in (
        (["--step", "999"], "step"),
        (["--step", "0", "--rank", "7"], "rank"),
        (["--step", "0", "--batch-size", "0"], "batch"),
    ):
        geometry = {"--batch-size": "4", "--world-size": "2"}
        for i in range(0, len(args), 2):
            geometry[args[i]] = args[i + 1]
        flat = [x for pair in geometry.items() for x in pair]
        done = cli(tmp_path, "replay", "dr", "--seed", "1", *flat, check=False)
        assert done.returncode == 1, done.stdout
        assert "Traceback" not in done.stderr
        assert said in done.stderr.lower()
    full = cli(
        tmp_path,
        "replay",
        "dr",
        "--seed",
        "1",
        "--step",
        "0",
        "--batch-size",
        "4",
        "--world-size",
        "2",
        "--window",
        "0",
        "--json",
    )
    assert json.loads(full.stdout)["ranks"]
