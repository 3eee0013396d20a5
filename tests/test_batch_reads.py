"""Metadata reads of many files at once (issue 26, registration at the speed of the
footers): ``FileBackend.read_batch`` reads a batch of files in one thread hop, and
``ReadPath.peek_many`` (a ``readv`` with ``keep: false``) reads a file:// backend's
ranges through it, with the versions, errors, single flight and counting of one
``peek`` each. Real files, a real cache and index, a real daemon.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from chunkd.client import Client
from chunkd.errors import (
    InvalidKeyError,
    ObjectNotFoundError,
    RangeNotSatisfiableError,
    UnknownBackendError,
    VersionChangedError,
)
from chunkd.gateway.backends import Backends, FileBackend
from chunkd.gateway.backends.base import BatchReads
from chunkd.gateway.config import BackendConfig
from chunkd.gateway.metrics import Metrics
from chunkd.gateway.readpath import ReadPath

from .conftest import Daemon, OpenCache, wait_for_socket


def gets(metrics: Metrics) -> float:
    labels = {"backend": "data", "op": "get"}
    return metrics.registry.get_sample_value("chunkd_backend_requests_total", labels) or 0


def tree(root: Path) -> dict[str, bytes]:
    """Plain files, and the things a batch leaves to the usual GET."""
    files = {"a.bin": os.urandom(5000), "sub/b.bin": os.urandom(300), "empty.bin": b""}
    for key, data in files.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    (root / "dir.bin").mkdir()
    os.mkfifo(root / "fifo.bin")  # opened plainly, it would block the thread
    (root / "x%41.bin").write_bytes(b"percent")
    (root / "link.bin").symlink_to(root / "a.bin")
    return files


@pytest.mark.timeout(20)
async def test_a_file_backend_reads_a_batch_as_its_gets_read_each_file(tmp_path: Path) -> None:
    root = tmp_path / "objects"
    root.mkdir()
    files = tree(root)
    metrics = Metrics()
    backend = FileBackend(BackendConfig("data", f"file://{root}"), metrics)
    assert isinstance(backend, BatchReads)
    try:
        asked = [
            ("a.bin", 4000, 9000),  # cut at the end
            ("sub/b.bin", 0, 300),
            ("a.bin", 5000, 6000),  # starts at the end: the version, no bytes
            ("empty.bin", 0, 10),
            ("link.bin", 0, 10),  # followed, as LocalStore follows it
            ("nope.bin", 0, 10),
            ("dir.bin", 0, 10),
            ("fifo.bin", 0, 10),
            ("x%41.bin", 0, 10),
        ]
        got = await backend.read_batch(asked)
        assert got[5:] == [None, None, None, None]  # left to the GET, which says why
        listed = {m.key: m for batch in [b async for b in backend.scan("")] for m in batch}
        for (key, start, end), one in zip(asked[:5], got[:5], strict=True):
            assert one is not None
            meta, data = one
            head = await backend.head(key)
            assert head is not None
            # The version is LocalStore's, and the lister's: registration pins it.
            assert (meta.key, meta.size, meta.version, meta.etag) == (
                head.key,
                head.size,
                head.version,
                head.etag,
            )
            assert meta.version == listed[key].version
            whole = files.get(key, files["a.bin"])
            assert data == (whole[start:end] if start < len(whole) else None)
        assert gets(metrics) == 5  # one GET a file read
    finally:
        await backend.close()


@pytest.mark.timeout(20)
async def test_peek_many_reads_a_batch_once_with_each_peeks_answer(
    open_cache: OpenCache, tmp_path: Path
) -> None:
    root = tmp_path / "objects"
    root.mkdir()
    files = tree(root)
    metrics = Metrics()
    config = BackendConfig("data", f"file://{root}", revalidate=3600.0)
    backends = Backends.from_config([config], metrics)
    cache = await open_cache()
    read_path = ReadPath(cache, backends, metrics)
    try:
        asked = [
            ("data", "a.bin", 4000, 5000),
            ("data", "sub/b.bin", 10, 20),
            ("data", "a.bin", 4000, 5000),  # the same range: it waits for the first
            ("data", "nope.bin", 0, 10),
            ("data", "a.bin", 6000, 10),
            ("data", "x%41.bin", 1, 3),
            ("data", "../a.bin", 0, 10),
            ("nowhere", "a.bin", 0, 10),
        ]
        got = await read_path.peek_many(asked)
        first, second, again = got[0], got[1], got[2]
        assert not isinstance(first, Exception)
        assert not isinstance(second, Exception)
        assert not isinstance(again, Exception)
        assert first[1] == files["a.bin"][4000:] == again[1]
        assert second[1] == files["sub/b.bin"][10:30]
        head = await backends.get("data").head("a.bin")
        assert head is not None
        assert first[0].meta.version == head.version
        assert isinstance(got[3], ObjectNotFoundError)
        assert isinstance(got[4], RangeNotSatisfiableError)
        assert not isinstance(got[5], Exception)
        assert got[5][1] == b"erc"
        assert isinstance(got[6], InvalidKeyError)
        assert isinstance(got[7], UnknownBackendError)
        # a.bin's range once (the same range again waited), its range past the end,
        # b.bin, then the percent name's GET and the missing file's.
        assert gets(metrics) == 5
        # A metadata read leaves nothing in the index: a later read asks the backend.
        assert cache.validated("data", "a.bin") is None
        assert cache.validated("data", "sub/b.bin") is None
        # Nothing kept in the tiers either.
        assert cache.resolve(first[0].locator(0)) is None
        # Nor by a single read not kept.
        await read_path.peek("data", "sub/b.bin", 0, 10)
        assert cache.validated("data", "sub/b.bin") is None
    finally:
        await read_path.close()
        await backends.close()


@pytest.mark.timeout(20)
@pytest.mark.parametrize("revalidate", [3600.0, None])
async def test_peek_many_replaces_another_version_the_index_holds(
    open_cache: OpenCache, tmp_path: Path, revalidate: float | None
) -> None:
    root = tmp_path / "objects"
    root.mkdir()
    (root / "a.bin").write_bytes(b"first version")
    metrics = Metrics()
    config = BackendConfig("data", f"file://{root}", revalidate=revalidate)
    backends = Backends.from_config([config], metrics)
    cache = await open_cache()
    read_path = ReadPath(cache, backends, metrics, known_objects=1)
    try:
        old = await read_path.stat("data", "a.bin")
        record = cache.validated("data", "a.bin")
        assert record is not None
        assert record.version == old.meta.version
        (root / "a.bin").write_bytes(b"second version, longer")
        os.utime(root / "a.bin", ns=(1, 1))  # another mtime, whatever the clock
        (root / "other.bin").write_bytes(b"x")
        await read_path.stat("data", "other.bin")  # pushes a.bin out of memory
        [got] = await read_path.peek_many([("data", "a.bin", 0, 6)])
        if revalidate is None:
            # Immutable: the version the index holds is read, pinned; the backend says
            # it changed, and it is forgotten: the next read learns the new one.
            assert isinstance(got, VersionChangedError)
            assert cache.validated("data", "a.bin") is None
            [got] = await read_path.peek_many([("data", "a.bin", 0, 6)])
        assert not isinstance(got, Exception)
        assert got[1] == b"second"
        assert got[0].meta.version != old.meta.version
        record = cache.validated("data", "a.bin")
        if revalidate is None:
            assert record is None  # forgotten, and not written again by a metadata read
        else:
            # The index must not keep the older version for a name read since.
            assert record is not None
            assert record.version == got[0].meta.version
    finally:
        await read_path.close()
        await backends.close()


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Daemon:
    daemon = start_daemon()
    assert wait_for_socket(tmp_path / "chunkd.sock", 10)
    return daemon


@pytest.mark.timeout(30)
def test_a_readv_not_kept_answers_what_a_kept_one_answers(node: Daemon, tmp_path: Path) -> None:
    root = tmp_path / "chunkd-data"
    root.mkdir(exist_ok=True)
    files = tree(root)
    ranges = [
        ["local/a.bin", 4000, 2000],
        ["local/sub/b.bin", 0, 300],
        ["local/nope.bin", 0, 10],
        ["local/dir.bin", 0, 10],
        ["local/x%41.bin", 0, 3],
        ["local/a.bin", 9000, 10],
        ["local/../a.bin", 0, 10],
        ["nowhere/a.bin", 0, 10],
        ["local/link.bin", 0, 10],
        ["local/empty.bin", 0, 10],
    ]
    with Client(tmp_path / "chunkd.sock") as client:
        unkept = client.request("readv", {"ranges": ranges, "keep": False})
        kept = client.request("readv", {"ranges": ranges})
        # A name that is no BACKEND/KEY is its range's own error, the others answered.
        named = client.request("readv", {"ranges": [["nobackend", 0, 1], *ranges], "keep": False})
    assert unkept.header["answered"] == kept.header["answered"] == len(ranges)
    # Each range the same: its version, size and length, or the same kind of error.
    shape = [
        {k: v for k, v in entry.items() if k != "message"} for entry in unkept.header["ranges"]
    ]
    assert shape == [
        {k: v for k, v in entry.items() if k != "message"} for entry in kept.header["ranges"]
    ]
    assert unkept.payload == kept.payload
    assert unkept.payload.startswith(files["a.bin"][4000:] + files["sub/b.bin"])
    errors = [entry.get("error") for entry in unkept.header["ranges"]]
    assert errors[2:8] == [
        "ObjectNotFoundError",
        "ObjectNotFoundError",
        None,
        "RangeNotSatisfiableError",
        "InvalidKeyError",
        "UnknownBackendError",
    ]
    assert named.header["ranges"][0]["error"] == "InvalidKeyError"
    assert named.header["ranges"][1:] == unkept.header["ranges"]
    assert "Traceback" not in node.log.read_text()
