"""chunkd:// through fsspec: pyarrow and pandas read Parquet through a real daemon."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from chunkd.client import Client
from chunkd.client.fsspec import ChunkdFileSystem

from .conftest import Daemon


@pytest.fixture
def node(start_daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Daemon]:
    work = tmp_path / "work"
    data = work / "chunkd-data"
    (data / "tables" / "part=a").mkdir(parents=True)
    (data / "tables" / "part=b").mkdir(parents=True)
    for part, start in (("a", 0), ("b", 50_000)):
        table = pa.table(
            {
                "id": pa.array(range(start, start + 50_000)),
                "payload": [os.urandom(40).hex()] * 50_000,
            }
        )
        pq.write_table(table, data / "tables" / f"part={part}" / "0.parquet", row_group_size=10_000)
    pq.write_table(
        pa.table({"x": list(range(1000)), "y": [float(i) / 3 for i in range(1000)]}),
        data / "small.parquet",
    )
    daemon: Daemon = start_daemon(cwd=work)
    monkeypatch.setenv("CHUNKD_SOCKET", str(work / "chunkd.sock"))
    fsspec.config.conf.pop("chunkd", None)
    ChunkdFileSystem.clear_instance_cache()
    yield daemon
    for fs in list(ChunkdFileSystem._cache.values()):
        if fs._client is not None:
            fs._client.close()
    ChunkdFileSystem.clear_instance_cache()
    gc.collect()


def test_the_protocol_is_registered_through_the_entry_point() -> None:
    assert fsspec.get_filesystem_class("chunkd") is ChunkdFileSystem


def test_listing_and_info(node: Daemon) -> None:
    fs = fsspec.filesystem("chunkd")
    assert sorted(fs.ls("chunkd://local", detail=False)) == [
        "local/small.parquet",
        "local/tables",
    ]
    assert fs.info("local/tables")["type"] == "directory"
    assert (
        fs.info("chunkd://local/small.parquet")["size"]
        == (node.cwd / "chunkd-data" / "small.parquet").stat().st_size
    )
    assert sorted(fs.find("local/tables")) == [
        "local/tables/part=a/0.parquet",
        "local/tables/part=b/0.parquet",
    ]
    with pytest.raises(FileNotFoundError):
        fs.info("local/nope.parquet")
    with pytest.raises(PermissionError, match="read-only"):
        fs.open("local/new.bin", "wb")
    with Client() as client:
        recursive = client.ls("local", recursive=True)
        assert {e["name"] for e in recursive} == {
            "local/small.parquet",
            "local/tables/part=a/0.parquet",
            "local/tables/part=b/0.parquet",
        }


def test_pyarrow_reads_parquet_like_a_direct_read(node: Daemon) -> None:
    direct = pq.read_table(node.cwd / "chunkd-data" / "small.parquet")
    # pyarrow resolves only its own URI schemes, so it is handed the filesystem
    # (pandas and datasets find chunkd:// through fsspec by themselves).
    fs = fsspec.filesystem("chunkd")
    assert pq.read_table("chunkd://local/small.parquet", filesystem=fs).equals(direct)
    assert pq.read_table("local/small.parquet", filesystem=fs).equals(direct)
    with fs.open("local/small.parquet") as f:
        assert pq.read_table(f).equals(direct)
    with fsspec.open("chunkd://local/small.parquet", "rb") as f:
        assert f.read(4) == b"PAR1"


def test_pyarrow_dataset_discovery(node: Daemon) -> None:
    fs = fsspec.filesystem("chunkd")
    dataset = ds.dataset("local/tables", filesystem=fs, format="parquet", partitioning="hive")
    table = dataset.to_table().sort_by("id")
    direct = (
        ds.dataset(str(node.cwd / "chunkd-data" / "tables"), format="parquet", partitioning="hive")
        .to_table()
        .sort_by("id")
    )
    assert table.num_rows == 100_000
    assert table.equals(direct)
    assert set(table.column("part").to_pylist()) == {"a", "b"}


def test_pandas_reads_parquet(node: Daemon) -> None:
    frame = pd.read_parquet("chunkd://local/small.parquet")
    direct = pd.read_parquet(node.cwd / "chunkd-data" / "small.parquet")
    pd.testing.assert_frame_equal(frame, direct)
