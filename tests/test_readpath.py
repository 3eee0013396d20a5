"""The read path in-process, over a real cache and a real file:// backend."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from chunkd.gateway.backends import Backends
from chunkd.gateway.config import BackendConfig
from chunkd.gateway.metrics import Metrics
from chunkd.gateway.readpath import ReadPath

from .conftest import OpenCache


@pytest.fixture
def objects(tmp_path: Path) -> Path:
    """The directory a file:// backend serves."""
    root = tmp_path / "objects"
    root.mkdir()
    return root


def heads(metrics: Metrics) -> Callable[[], float]:
    """HEAD requests sent to backend ``data`` so far."""

    def count() -> float:
        labels = {"backend": "data", "op": "head"}
        return metrics.registry.get_sample_value("chunkd_backend_requests_total", labels) or 0

    return count


async def test_known_versions_leave_memory_least_recently_used_first(
    open_cache: OpenCache, objects: Path
) -> None:
    for name in "abc":
        (objects / f"{name}.bin").write_bytes(name.encode() * 100)
    metrics = Metrics()
    # A duration backend: a version not in memory is asked of the backend again.
    config = BackendConfig("data", f"file://{objects}", revalidate=3600.0)
    backends = Backends.from_config([config], metrics)
    read_path = ReadPath(await open_cache(), backends, metrics, known_objects=2)
    sent = heads(metrics)
    try:
        for name in "abac":
            await read_path.stat("data", f"{name}.bin")
        assert sent() == 3  # a's second stat was a hit
        await read_path.stat("data", "a.bin")
        assert sent() == 3  # used after b, so c pushed b out, not a
        await read_path.stat("data", "b.bin")
        assert sent() == 4
    finally:
        await read_path.close()
        await backends.close()


def requests(metrics: Metrics, op: str) -> float:
    labels = {"backend": "data", "op": op}
    return metrics.registry.get_sample_value("chunkd_backend_requests_total", labels) or 0


def read_bytes(metrics: Metrics) -> float:
    labels = {"backend": "data"}
    return metrics.registry.get_sample_value("chunkd_backend_read_bytes_total", labels) or 0


async def read_all(read_path: ReadPath, key: str, start: int, end: int | None) -> bytes:
    stat = await read_path.stat("data", key, reading=(start, end))
    stop = stat.size if end is None else min(end, stat.size)
    return b"".join([bytes(piece) async for piece in read_path.read(stat, start, stop)])


async def test_a_cold_read_learns_the_version_from_its_own_first_get(
    open_cache: OpenCache, objects: Path
) -> None:
    chunk = 64 << 10
    blob = bytes(range(256)) * (10 * chunk // 256 + 3)  # 10 chunks and a short one
    (objects / "big.bin").write_bytes(blob)
    (objects / "small.bin").write_bytes(b"tiny")
    (objects / "empty.bin").write_bytes(b"")
    metrics = Metrics()
    config = BackendConfig("data", f"file://{objects}", revalidate=3600.0)
    backends = Backends.from_config([config], metrics)
    read_path = ReadPath(await open_cache(chunk_bytes=chunk), backends, metrics)
    try:
        # A whole small object: one request, no HEAD.
        assert await read_all(read_path, "small.bin", 0, None) == b"tiny"
        assert (requests(metrics, "head"), requests(metrics, "get")) == (0, 1)
        # One byte of a big one: the first GET asks for that byte's chunk only.
        assert await read_all(read_path, "big.bin", 5, 6) == blob[5:6]
        assert (requests(metrics, "head"), requests(metrics, "get")) == (0, 2)
        assert read_bytes(metrics) == 4 + chunk
        # The rest of it: the chunk it has is not fetched again.
        assert await read_all(read_path, "big.bin", 0, None) == blob
        assert read_bytes(metrics) == 4 + len(blob)
        # An empty object, and a read past the end: the version from a HEAD.
        assert await read_all(read_path, "empty.bin", 0, None) == b""
        stat = await read_path.stat("data", "small.bin", reading=(100, None))
        assert stat.size == 4
    finally:
        await read_path.close()
        await backends.close()


async def test_a_version_due_for_a_check_is_confirmed_by_a_conditional_get(
    open_cache: OpenCache, objects: Path
) -> None:
    (objects / "v.bin").write_bytes(b"first version")
    metrics = Metrics()
    config = BackendConfig("data", f"file://{objects}", revalidate=0.05)
    backends = Backends.from_config([config], metrics)
    read_path = ReadPath(await open_cache(), backends, metrics)
    try:
        assert await read_all(read_path, "v.bin", 0, None) == b"first version"
        fetched = read_bytes(metrics)
        await asyncio.sleep(0.1)
        # Still current: the check is one GET that sends no bytes; the cache answers.
        assert await read_all(read_path, "v.bin", 0, None) == b"first version"
        assert (requests(metrics, "head"), requests(metrics, "get")) == (0, 2)
        assert read_bytes(metrics) == fetched
        await asyncio.sleep(0.1)
        (objects / "v.bin").write_bytes(b"other version, longer")
        # Changed: the same GET brings the new version's bytes.
        assert await read_all(read_path, "v.bin", 0, None) == b"other version, longer"
        assert (requests(metrics, "head"), requests(metrics, "get")) == (0, 3)
    finally:
        await read_path.close()
        await backends.close()
