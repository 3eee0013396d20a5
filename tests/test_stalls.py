"""How long trainers wait for data: the loaders' stall meter, against a real daemon.

The stall test of issue 30: a trainer loop that sleeps a fixed compute time per step
reads a dataset whose backend is deliberately slow (moto's S3 behind the counting
proxy, which sleeps :data:`DELAY` before each 64 KiB it passes on), then the same
data again from the cache. The loop times each ``next()`` itself; the daemon's
figure is the deltas of ``chunkd_loader_wait_seconds_sum``/``_count`` and
``chunkd_loader_step_seconds_sum`` in ``/metrics`` for the job. They agree within
:data:`TOLERANCE` seconds a step, on both sides of the slow-down: the plain
``Loader``, torch's DataLoader (2 workers) through ``chunkd.client.torch.measured``,
and Grain's iterator.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from chunkd.client import Client, StallMeter
from chunkd.client.datasets.loader import Loader
from chunkd.client.protocol import LOADER_BUCKETS
from chunkd.testing.proxy import CountingProxy
from chunkd.testing.s3 import S3Server, s3_backend

from .conftest import Daemon

#: the bytes of a record: one chunk, one object (a read is one backend GET)
RECORD = 64 * 1024
#: records (objects) read in each phase
STEPS = 8
#: the proxy's sleep before each 64 KiB it passes on, in the slow phase
DELAY = 0.12
#: the trainer's compute, per step
COMPUTE = 0.04
#: how far the daemon's figure may be from the loop's own, in seconds per step (the
#: loop times next() from outside, the meter from inside: they differ by the
#: generator's resumption and, once a window, the report's round trip)
TOLERANCE = 0.03
JOB = "stall-test"


@dataclass
class SlowNode:
    daemon: Daemon
    proxy: CountingProxy
    shards: list[str]

    @property
    def socket(self) -> Path:
        return self.daemon.cwd / "chunkd.sock"

    def figures(self) -> dict[str, float]:
        return {
            part: self.daemon.metric(f"chunkd_loader_{part}", train_job=JOB)
            for part in ("wait_seconds_sum", "wait_seconds_count", "step_seconds_sum")
        }

    def job(self) -> dict[str, Any]:
        status, _, body = self.daemon.get("/v1/jobs")
        assert status == 200
        jobs = {job["name"]: job for job in json.loads(body)["jobs"]}
        return jobs[JOB]


@pytest.fixture
def slow_node(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    bucket: str,
    s3_server: S3Server,
    s3_proxy: CountingProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> SlowNode:
    for variable in ("CHUNKD_JOB", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("CHUNKD_POD_LABELS", str(tmp_path / "no-labels"))
    s3 = s3_server.client()
    shards = []
    for i in range(STEPS):
        s3.put_object(Bucket=bucket, Key=f"pre/rec-{i:02d}.bin", Body=os.urandom(RECORD))
        shards.append(f"s3/rec-{i:02d}.bin")
    toml = f"""
[cache]
dir = "{tmp_path / "cache"}"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
chunk_bytes = "64KiB"
fsync = "never"

{s3_backend("s3", f"s3://{bucket}/pre", s3_proxy.endpoint)}"""
    node = SlowNode(start_daemon(toml), s3_proxy, shards)
    monkeypatch.setenv("CHUNKD_SOCKET", str(node.socket))  # the node's daemon, as deployed
    return node


@dataclass
class Measured:
    """What the training loop measured itself."""

    waits: list[float]
    steps: list[float]


def train(batches: Iterator[Any] | Callable[[], Iterator[Any]]) -> Measured:
    """A training loop: each ``next()`` timed from outside, then ``COMPUTE`` seconds of
    work. ``batches`` is an iterator, or what makes one (timed as the first wait)."""
    waits: list[float] = []
    steps: list[float] = []
    last: float | None = None
    asked = time.perf_counter()
    items = batches() if callable(batches) else batches
    while True:
        try:
            next(items)
        except StopIteration:
            break
        got = time.perf_counter()
        waits.append(got - asked)
        steps.append(got - (asked if last is None else last))
        last = got
        time.sleep(COMPUTE)
        asked = time.perf_counter()
    return Measured(waits, steps)


def check_phase(node: SlowNode, before: dict[str, float], measured: Measured) -> None:
    """The daemon's figures of the phase (deltas) are the loop's, within tolerance."""
    after = node.figures()
    count = len(measured.waits)
    assert count == STEPS
    assert after["wait_seconds_count"] - before["wait_seconds_count"] == count
    waited = after["wait_seconds_sum"] - before["wait_seconds_sum"]
    stepped = after["step_seconds_sum"] - before["step_seconds_sum"]
    assert abs(waited - sum(measured.waits)) <= TOLERANCE * count, (waited, measured.waits)
    assert abs(stepped - sum(measured.steps)) <= TOLERANCE * count, (stepped, measured.steps)


def two_phases(node: SlowNode, run: Callable[[int], Measured]) -> tuple[Measured, Measured]:
    """The slow phase (cold, through the slow proxy), then the fast one (the same data,
    cached, the proxy's delay gone): each checked against the daemon's figures."""
    node.proxy.delay = DELAY
    before = node.figures()
    slow = run(0)
    check_phase(node, before, slow)
    # every read went to the slow backend, at most two at once: a floor under the time
    assert sum(slow.steps) >= STEPS * DELAY / 2, slow.steps
    node.proxy.delay = 0.0
    before = node.figures()
    fast = run(1)
    check_phase(node, before, fast)
    return slow, fast


# -- the stall test: the plain Loader, torch's DataLoader, Grain ----------------------------


def _dataset(node: SlowNode) -> Any:
    torch_shards = pytest.importorskip("chunkd.client.torch.shards")
    return torch_shards.ShardDataset(
        node.shards,
        kind="fixed",
        record_bytes=RECORD,
        client_factory=functools.partial(Client, node.socket),
        batch_size=1,
        seed=0,
        shuffle=False,
        prefetch=0,
    )


@pytest.mark.timeout(60)
def test_the_plain_loader_reports_what_the_trainer_waited(slow_node: SlowNode) -> None:
    dataset = _dataset(slow_node).dataset
    loader = Loader(
        dataset, batch_size=1, seed=0, shuffle=False, prefetch=0, shared_decode=False, train_job=JOB
    )

    def run(epoch: int) -> Measured:
        loader.set_epoch(epoch)
        return train(lambda: iter(loader))

    two_phases(slow_node, run)
    job = slow_node.job()
    assert job["steps"] == 2 * STEPS
    assert job["uids"] == [os.getuid()]
    assert loader.meter is not None
    # one meter for both epochs; a window of 5 s: one report at each epoch's end
    assert loader.meter.reports == 2
    assert job["first_batch"]["rank"] == 0  # ds_first_batch, for the job


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_a_dataloader_with_workers_is_measured_in_the_trainer(slow_node: SlowNode) -> None:
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from chunkd.client.torch import measured

    dataset = _dataset(slow_node)
    loader = DataLoader(dataset, batch_size=None, num_workers=2)

    def run(epoch: int) -> Measured:
        dataset.set_epoch(epoch)
        return train(lambda: measured(loader, train_job=JOB, window=0.5))

    two_phases(slow_node, run)
    job = slow_node.job()
    assert job["steps"] == 2 * STEPS
    assert dataset.train_job == JOB
    # the workers' ds_first_batch: the job's, the rank's, the workers' start counted
    # from the iteration's (the dataset's own client claims no job)
    first = job["first_batch"]
    assert first is not None
    assert first["rank"] == 0
    assert "worker_start" in first, first


@pytest.mark.timeout(60)
def test_grain_iterator_is_measured(slow_node: SlowNode) -> None:
    grain_adapter = pytest.importorskip("chunkd.client.grain")
    dataset = _dataset(slow_node).dataset

    def run(epoch: int) -> Measured:
        pipeline = grain_adapter.ChunkdIterDataset(
            dataset,
            batch_size=1,
            seed=0,
            shuffle=False,
            prefetch=0,
            shared_decode=False,
            epoch=epoch,
            train_job=JOB,
        )
        return train(iter(pipeline))

    two_phases(slow_node, run)
    assert slow_node.job()["steps"] == 2 * STEPS


# -- the meter's bounds ------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_steps_land_in_the_daemons_buckets(slow_node: SlowNode) -> None:
    with Client(slow_node.socket) as client:
        meter = StallMeter(client, train_job=JOB, rank=3, world_size=4, window=3600)
    for wait, step in [(0.003, 0.02), (0.003, 0.02), (0.1, 0.1), (0.3, 0.7), (99.0, 120.0)]:
        meter.add(wait, step)
    assert meter.reports == 0  # nothing before the window's end
    meter.close()
    assert meter.reports == 1
    daemon = slow_node.daemon

    def bucket(kind: str, le: str) -> float:
        return daemon.metric(f"chunkd_loader_{kind}_seconds_bucket", train_job=JOB, le=le)

    assert bucket("wait", "0.001") == 0
    assert bucket("wait", "0.005") == 2
    assert bucket("wait", "0.1") == 3  # a bound holds the steps equal to it
    assert bucket("wait", "0.5") == 4
    assert bucket("wait", "60.0") == 4
    assert bucket("wait", "+Inf") == 5
    assert bucket("step", "0.025") == 2
    assert bucket("step", "1.0") == 4
    assert bucket("step", "+Inf") == 5
    assert daemon.metric("chunkd_loader_wait_seconds_sum", train_job=JOB) == pytest.approx(
        0.003 * 2 + 0.1 + 0.3 + 99.0
    )
    job = slow_node.job()
    assert job["world_size"] == 4
    assert job["worst_ranks"][0]["rank"] == 3
    assert len(LOADER_BUCKETS) == 14


@pytest.mark.timeout(30)
def test_a_daemon_that_is_gone_never_breaks_training(tmp_path: Path) -> None:
    meter = StallMeter(socket_path=tmp_path / "nobody.sock", train_job=JOB, window=0.05)
    got = list(meter.wrap(range(20)))
    assert got == list(range(20))
    assert meter.reports == 0
    assert meter.failed >= 1


@pytest.mark.timeout(30)
def test_a_daemon_that_does_not_answer_costs_one_timeout_then_is_left_alone(
    tmp_path: Path,
) -> None:
    # a socket that takes connections and never answers: a hung daemon
    path = tmp_path / "hung.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(16)
    server.settimeout(0.05)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        meter = StallMeter(socket_path=path, train_job=JOB, window=0.05)

        def slow_items() -> Iterator[int]:
            for i in range(40):
                time.sleep(0.01)
                yield i

        assert list(meter.wrap(slow_items())) == list(range(40))
        assert meter.reports == 0
        assert meter.failed >= 2  # every window after the first dropped, unsent
        assert len(held) == 1  # one connection tried, then none for RETRY_AFTER
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()
        for conn in held:
            conn.close()


class _LoaderInWorkers:
    """A torch IterableDataset over a plain Loader (what a user may write): in a
    DataLoader's worker its Loader must not measure, the trainer is not there."""

    def __init__(self, node: SlowNode) -> None:
        self.node = node

    def __iter__(self) -> Iterator[Any]:
        dataset = _dataset(self.node).dataset
        loader = Loader(dataset, batch_size=1, seed=0, shuffle=False, prefetch=0, train_job=JOB)
        for batch in loader:
            yield batch.ids


@pytest.mark.timeout(60)
def test_a_loader_in_a_dataloader_worker_leaves_the_measuring_to_the_trainer(
    slow_node: SlowNode,
) -> None:
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader, IterableDataset

    from chunkd.client.torch import measured

    class Wrapped(_LoaderInWorkers, IterableDataset[Any]):
        pass

    loader = DataLoader(Wrapped(slow_node), batch_size=None, num_workers=1)
    measured_steps = train(lambda: measured(loader, train_job=JOB))
    assert len(measured_steps.waits) == STEPS
    # the trainer's steps, once: the worker's Loader sent no report of its own
    assert slow_node.figures()["wait_seconds_count"] == STEPS
    assert slow_node.job()["steps"] == STEPS
