"""Prefetch and `chunkd warm` load objects a bounded number at a time."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from chunkd.client import Client

from .conftest import BIN, Daemon

CONFIG = """
[server]
prefetch_in_flight = {total}
prefetch_per_client = {per_client}

[cache]
dir = "{dir}/cache"
ram_bytes = "256MiB"
disk_bytes = "1GiB"
disk_min_free_bytes = 0
fsync = "never"

[[backends]]
name = "local"
url = "file://{dir}/data"
"""


@pytest.fixture
def node(start_daemon, tmp_path: Path) -> Daemon:
    (tmp_path / "data").mkdir()
    return start_daemon(CONFIG.format(total=8, per_client=6, dir=tmp_path))


def objects(daemon_dir: Path, folder: str, count: int) -> list[str]:
    root = daemon_dir / "data" / folder
    root.mkdir(parents=True)
    names = []
    for i in range(count):
        fd = os.open(root / f"{i:05d}.bin", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, os.urandom(256 + i % 512))
        os.close(fd)
        names.append(f"local/{folder}/{i:05d}.bin")
    return names


def wait_for(daemon: Daemon, loaded: float, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while daemon.metric("chunkd_prefetch_objects_total", outcome="loaded") < loaded:
        assert time.monotonic() < deadline, "the prefetch did not finish"
        time.sleep(0.2)


def test_10k_names_load_at_most_the_bound_at_once(node: Daemon, tmp_path: Path) -> None:
    names = objects(tmp_path, "one", 10_000)
    sock = node.cwd / "chunkd.sock"
    with Client(sock) as client:
        assert client.prefetch(names) == len(names)  # taken at once; loads go on
        assert node.metric("chunkd_prefetch_queued") > 0  # waiting, not 10,000 fetches
        wait_for(node, len(names))
    # One client: its own bound, never more, and it was reached.
    assert node.metric("chunkd_prefetch_in_flight_max") == 6
    assert node.metric("chunkd_prefetch_queued") == 0
    assert node.metric("chunkd_prefetch_objects_total", outcome="failed") == 0
    assert node.metric("chunkd_cache_chunks", tier="ram") >= len(names)

    # Two connections of one user: one user's bound (6), not 6 a connection.
    more = objects(tmp_path, "two", 4000)
    done = threading.Barrier(2)

    def ask(part: list[str]) -> None:
        with Client(sock) as client:
            client.prefetch(part)
            done.wait(timeout=60)

    threads = [threading.Thread(target=ask, args=(more[i::2],)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    wait_for(node, len(names) + len(more))
    assert node.metric("chunkd_prefetch_in_flight_max") == 6
    assert node.metric("chunkd_prefetch_in_flight") == 0


async def test_two_users_share_the_total_bound(open_cache, tmp_path: Path) -> None:
    from chunkd.gateway.backends import Backends
    from chunkd.gateway.config import BackendConfig
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.prefetch import Prefetcher
    from chunkd.gateway.readpath import ReadPath

    names = objects(tmp_path, "both", 2000)
    metrics = Metrics()
    backends = Backends.from_config(
        [BackendConfig(name="local", url=f"file://{tmp_path}/data")], metrics
    )
    read_path = ReadPath(await open_cache(ram_bytes=64 << 20), backends, metrics)
    prefetcher = Prefetcher(read_path, metrics, in_flight=8, per_client=6)
    prefetcher.submit(("uid", 1000), names[::2])
    prefetcher.submit(("uid", 1001), names[1::2])

    def sample(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, labels) or 0.0

    for _ in range(2400):  # two minutes at most
        if sample("chunkd_prefetch_objects_total", outcome="loaded") == len(names):
            break
        await asyncio.sleep(0.05)
    # 2 x 6 workers, 8 slots: the total bound is what holds, and it was reached.
    assert sample("chunkd_prefetch_in_flight_max") == 8
    assert sample("chunkd_prefetch_objects_total", outcome="loaded") == len(names)
    await prefetcher.close()
    await read_path.close()


def test_a_prefetch_over_the_queue_bound_is_refused_whole(node: Daemon, tmp_path: Path) -> None:
    from chunkd.errors import InvalidRequestError

    names = [f"local/none/{i:06d}" for i in range(60_000)]
    with Client(node.cwd / "chunkd.sock") as client:
        client.prefetch(names)  # misses fail fast, but not before the next ask
    # Another connection of the same user: the same queue, which outlived the first.
    with (
        Client(node.cwd / "chunkd.sock") as client,
        pytest.raises(InvalidRequestError, match="wait already"),
    ):
        client.prefetch(names)
    assert node.get("/healthz")[0] == 200


def test_chunkd_warm_loads_several_objects_at_once(node: Daemon, tmp_path: Path) -> None:
    names = objects(tmp_path, "warm", 40)
    done = subprocess.run(
        [str(BIN / "chunkd"), "warm", "--url", node.url, "--jobs", "4", *names],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "warmed 40 of 40 objects" in done.stdout
    assert sum(line.endswith("cached") for line in done.stdout.splitlines()) == 40
    peak = node.metric("chunkd_prefetch_in_flight_max")
    assert 1 <= peak <= 4
    bad = subprocess.run(
        [str(BIN / "chunkd"), "warm", "--url", node.url, "--jobs", "0", names[0]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "--jobs must be 1 or more" in bad.stderr


def test_a_range_prefetch_loads_only_the_chunks_of_its_ranges(node: Daemon, tmp_path: Path) -> None:
    """A data loader's prefetch of its next samples' byte ranges loads those chunks, not
    the whole objects, and a read of them is then served from the cache."""
    data = os.urandom(12 << 20)  # three 4 MiB chunks
    (tmp_path / "data" / "big.bin").write_bytes(data)
    with Client(socket_path=node.cwd / "chunkd.sock") as client:
        started = client.prefetch_ranges([("local/big.bin", (4 << 20) + 10, 100)])
        assert started == 1
        wait_for(node, 1)
        read_before = node.metric("chunkd_backend_read_bytes_total", backend="local")
        assert read_before == 4 << 20  # the chunk that holds the range, alone
        assert (
            bytes(client.read("local/big.bin", (4 << 20) + 10, 100))
            == data[(4 << 20) + 10 : (4 << 20) + 110]
        )
        assert node.metric("chunkd_backend_read_bytes_total", backend="local") == read_before
        # Bad ranges are refused whole, before anything is queued.
        with pytest.raises(ValueError, match="ranges"):
            client.prefetch_ranges([("local/big.bin", -1, 5)])
