"""The read path in-process, over a real cache and a real file:// backend."""

from __future__ import annotations

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
