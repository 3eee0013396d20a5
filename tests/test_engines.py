"""chunkd:// read by the engines users run, as they run them: DuckDB, pyarrow, HF
datasets, pandas, polars, through the fsspec filesystem and a real daemon."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from chunkd.errors import ObjectNotFoundError

from .conftest import Daemon

ROWS = 1000


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Parquet tables, JSON lines, and 10,000 small Parquet files in hive partitions."""
    root = tmp_path_factory.mktemp("engines") / "chunkd-data"
    (root / "tables").mkdir(parents=True)
    for i in range(4):
        table = pa.table(
            {"x": range(i * ROWS, (i + 1) * ROWS), "s": [f"row{j}" for j in range(ROWS)]}
        )
        pq.write_table(table, root / "tables" / f"part-{i}.parquet", row_group_size=250)
    (root / "jsonl").mkdir()
    for i in range(3):
        lines = (json.dumps({"i": i * 100 + j, "t": "hello"}) for j in range(100))
        (root / "jsonl" / f"p{i}.jsonl").write_text("\n".join(lines) + "\n")
    (root / "blob.bin").write_bytes(os.urandom(3 << 20))
    for i in range(10_000):
        folder = root / "many" / f"day={i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"x": [i, i + 1]}), folder / f"part-{i:05d}.parquet")
    return root


@pytest.fixture
def node(start_daemon, data: Path) -> Daemon:
    return start_daemon(cwd=data.parent)


def fs_of(node: Daemon) -> fsspec.AbstractFileSystem:
    sock = str(node.cwd / "chunkd.sock")
    return fsspec.filesystem("chunkd", socket_path=sock, skip_instance_cache=True)


def test_duckdb_through_register_filesystem(node: Daemon) -> None:
    import duckdb

    con = duckdb.connect()
    con.register_filesystem(fs_of(node))
    got = con.sql("SELECT count(*), sum(x) FROM read_parquet('chunkd://local/tables/*.parquet')")
    assert got.fetchall() == [(4 * ROWS, sum(range(4 * ROWS)))]
    got = con.sql("SELECT count(*), sum(i) FROM read_json('chunkd://local/jsonl/*.jsonl')")
    assert got.fetchall() == [(300, sum(range(300)))]
    one = con.sql("SELECT s FROM 'chunkd://local/tables/part-2.parquet' WHERE x = 2500")
    assert one.fetchall() == [("row500",)]
    con.close()


def test_pyarrow_discovers_10k_files(node: Daemon, data: Path) -> None:
    fs = fs_of(node)
    dataset = pads.dataset("local/many", filesystem=fs, format="parquet", partitioning="hive")
    assert len(dataset.files) == 10_000
    day = dataset.to_table(filter=pads.field("day") == 3)
    assert day.num_rows == 2000
    assert sorted(day.column("x").to_pylist()[::2]) == sorted(range(3, 10_000, 10))
    assert pq.read_table("local/tables/part-1.parquet", filesystem=fs) == pq.read_table(
        data / "tables" / "part-1.parquet"
    )


HF = textwrap.dedent(
    """
    import json, sys
    import datasets
    streaming = sys.argv[1] == "streaming"
    out = {}
    tables = datasets.load_dataset(
        "parquet", data_files="chunkd://local/tables/*.parquet", split="train", streaming=streaming
    )
    out["parquet"] = sum(row["x"] for row in tables)
    lines = datasets.load_dataset(
        "json", data_files="chunkd://local/jsonl/*.jsonl", split="train", streaming=streaming
    )
    out["json"] = sum(row["i"] for row in lines)
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize("mode", ["streaming", "download"])
def test_hf_datasets_load_chunkd_urls(node: Daemon, tmp_path: Path, mode: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "CHUNKD_"))}
    env |= {
        "CHUNKD_SOCKET": str(node.cwd / "chunkd.sock"),
        "HF_HOME": str(tmp_path / "hf"),
        # Nothing may reach for the Hub: it points at a closed port on this host.
        "HF_ENDPOINT": "http://127.0.0.1:9",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    if mode == "streaming":
        env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    # (Without streaming, datasets 5 copies each file into its cache first, and in
    # offline mode it refuses any URL that is not a local path: chunkd:// included.)
    done = subprocess.run(
        [sys.executable, "-c", HF, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"parquet": sum(range(4 * ROWS)), "json": sum(range(300))}


def test_pandas_and_polars(node: Daemon, data: Path) -> None:
    import pandas as pd
    import polars as pl

    options = {"socket_path": str(node.cwd / "chunkd.sock")}
    frame = pd.read_parquet("chunkd://local/tables/part-3.parquet", storage_options=options)
    assert frame.equals(pd.read_parquet(data / "tables" / "part-3.parquet"))
    lines = pd.read_json("chunkd://local/jsonl/p1.jsonl", lines=True, storage_options=options)
    assert lines["i"].tolist() == list(range(100, 200))
    fs = fs_of(node)
    with fs.open("local/tables/part-0.parquet") as handle:
        polars_frame = pl.read_parquet(handle)
    assert polars_frame.shape == (ROWS, 2)
    assert polars_frame["x"].sum() == sum(range(ROWS))
    with fs.open("chunkd://local/jsonl/p2.jsonl") as handle:
        assert pl.read_ndjson(handle)["i"].to_list() == list(range(200, 300))


def test_what_engines_ask_of_a_file(node: Daemon, data: Path) -> None:
    fs = fs_of(node)
    path = "local/tables/part-0.parquet"
    st = (data / "tables" / "part-0.parquet").stat()
    info = fs.info(path)
    assert (info["type"], info["size"]) == ("file", st.st_size)
    assert info["mtime"] == pytest.approx(st.st_mtime, abs=1e-5)
    assert info["ETag"]
    assert fs.modified(path) == datetime.datetime.fromtimestamp(info["mtime"], tz=datetime.UTC)
    assert fs.created(path) == fs.modified(path)
    assert fs.ukey(path) == info["ETag"]
    before = fs.checksum(path)
    assert fs.checksum(path) == before
    listed = {e["name"]: e for e in fs.ls("local/tables")}
    assert listed[path]["ETag"] == info["ETag"]
    assert listed[path]["mtime"] == info["mtime"]
    with pytest.raises(IsADirectoryError):
        fs.modified("local/tables")
    with pytest.raises(FileNotFoundError):
        fs.modified("local/tables/none.parquet")
    # A file that changes gets another version, key and checksum.
    target = data / "jsonl" / "changing.jsonl"
    target.write_text('{"i": 1}\n')
    name = "local/jsonl/changing.jsonl"
    first = (fs.ukey(name), fs.checksum(name))
    target.write_text('{"i": 2}\n{"i": 3}\n')
    time.sleep(1.2)  # the embedded default's local backend re-checks versions after 1 s
    fs2 = fs_of(node)  # a client that has not cached the old version
    assert (fs2.ukey(name), fs2.checksum(name)) != first
    target.unlink()


def test_cat_ranges_batches_ranges_and_reports_each_failure(node: Daemon, data: Path) -> None:
    fs = fs_of(node)
    raw = (data / "tables" / "part-1.parquet").read_bytes()
    paths = ["local/tables/part-1.parquet"] * 300 + ["local/tables/none.parquet"]
    starts = [i * 7 for i in range(300)] + [0]
    ends = [i * 7 + 100 for i in range(300)] + [10]
    got = fs.cat_ranges(paths, starts, ends)
    assert got[:300] == [raw[s:e] for s, e in zip(starts[:300], ends[:300], strict=True)]
    assert isinstance(got[300], ObjectNotFoundError)
    with pytest.raises(ObjectNotFoundError):
        fs.cat_ranges(paths, starts, ends, on_error="raise")
    # None and negative bounds, as cat_file takes them; and ranges larger than a batch.
    size = len(raw)
    assert fs.cat_ranges([paths[0]] * 3, [None, -10, 0], [10, None, size + 99]) == [
        raw[:10],
        raw[-10:],
        raw,
    ]
    # Ranges whose bytes fill several answers (1 MiB each): one is cut, and asked again.
    blob = (data / "blob.bin").read_bytes()
    step = 200_000
    starts = list(range(0, len(blob), step))
    got = fs.cat_ranges(["local/blob.bin"] * len(starts), starts, [s + step for s in starts])
    assert b"".join(got) == blob
    assert node.metric("chunkd_local_requests_total", op="readv") >= 5


def test_an_answer_of_several_ranges_is_cut_where_each_range_ends() -> None:
    """A range that changed version between two answers, or that failed in an earlier
    one, still takes its bytes out of the answer, so the ranges after it get theirs."""
    from chunkd.client.core import _take_ranges
    from chunkd.errors import VersionChangedError

    out: list = [bytearray(b"A" * 100), bytearray(), ObjectNotFoundError("gone"), bytearray()]
    versions = {0: "v1", 2: "w"}
    batch = [(0, "b/x", 100, 50), (2, "b/z", 0, 5), (1, "b/y", 0, 10), (3, "b/w", 0, 8)]
    answers = [
        {"size": 150, "version": "v2", "offset": 100, "length": 50},  # changed meanwhile
        {"size": 5, "version": "w", "offset": 0, "length": 5},  # failed before
        {"size": 10, "version": "y", "offset": 0, "length": 10},
        {"size": 99, "version": "u", "offset": 0, "length": 4},  # cut to fit: ask again
    ]
    payload = b"B" * 50 + b"Z" * 5 + b"C" * 10 + b"D" * 4
    again = _take_ranges(batch, answers, payload, out, versions)
    assert isinstance(out[0], VersionChangedError)
    assert out[1] == b"C" * 10
    assert isinstance(out[2], ObjectNotFoundError)
    assert out[3] == b"D" * 4
    assert again == [(3, "b/w", 4, 4)]


def test_many_failed_ranges_fit_their_answers(node: Daemon, data: Path) -> None:
    """256 ranges of long, missing names: the daemon answers as many as fit in a frame
    and the client asks again for the rest; the connection is never dropped."""
    from chunkd.client import Client

    names = [f"local/none/{i:03d}-" + "é" * 200 for i in range(256)]
    with Client(node.cwd / "chunkd.sock") as client:
        got = client.read_ranges([(n, 0, 10) for n in names] + [("local/blob.bin", 5, 10)])
    assert all(isinstance(g, ObjectNotFoundError) for g in got[:-1])
    assert got[-1] == (data / "blob.bin").read_bytes()[5:15]
    assert node.metric("chunkd_local_malformed_frames_total") == 0
