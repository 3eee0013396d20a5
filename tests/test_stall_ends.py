"""When a trainer's rank is done with its job, and who measures a step (R2 of issue 30).

- An epoch's end is not the job's end: a loader's iteration ends by sending its
  window; ``end=true`` comes from ``meter.close()`` or, once per rank, the process's
  exit. A pause between two epochs longer than the daemon's quiet after every rank's
  end keeps the job's one start and its label.
- Nested iterators are measured once (the outermost meter): ``measured`` over a
  DataLoader with ``num_workers=0`` over a Loader, ``measured(loader)``.
- Grain measures only in the process and thread that made the dataset, and a loop
  that leaves early still sends its window.
- The job is the argument, then the client's, then the environment's; rank and world
  size fall back to Slurm's; a worker's start is reported on its first iteration only.

The daemons here are real ``chunkd serve`` processes whose quiet after every rank's
end (``gateway/jobs/table.py`` ``END_QUIET``, 60 s) is :data:`QUIET` seconds, so that
a test sees a job end in seconds; ``[jobs] top = 1`` stands for a full top K.
"""

from __future__ import annotations

import functools
import gc
import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from chunkd.client import Client, StallMeter
from chunkd.client.datasets.loader import FirstBatch, Loader
from chunkd.client.jobs import _pod_labels, job_name
from chunkd.testing.daemon import DaemonProcess

from .conftest import Daemon, free_port, wait_ready

#: the daemon's quiet after every rank's end, here (60 s in a real daemon)
QUIET = 1.0
#: records, each one batch
STEPS = 6
RECORD = 4096
JOB = "epochs-test"

#: ``chunkd serve`` with the jobs table's END_QUIET set to QUIET (nothing else changed)
_SERVE = (
    "import sys; import chunkd.gateway.jobs.table as table; "
    f"table.END_QUIET = {QUIET}; "
    "from chunkd.gateway.cli import main; raise SystemExit(main())"
)


@dataclass
class QuickNode:
    daemon: Daemon
    shards: list[str]

    @property
    def socket(self) -> Path:
        return self.daemon.cwd / "chunkd.sock"

    def jobs(self) -> dict[str, Any]:
        status, _, body = self.daemon.get("/v1/jobs")
        assert status == 200
        answer: dict[str, Any] = json.loads(body)
        return answer

    def loader(self, **options: Any) -> Loader:
        return Loader(
            _dataset(self).dataset,
            batch_size=1,
            seed=0,
            shuffle=False,
            prefetch=0,
            shared_decode=False,
            **options,
        )


def _dataset(node: QuickNode, train_job: str | None = None) -> Any:
    shards = pytest.importorskip("chunkd.client.torch.shards")
    return shards.ShardDataset(
        node.shards,
        kind="fixed",
        record_bytes=RECORD,
        client_factory=functools.partial(Client, node.socket, train_job=train_job),
        batch_size=1,
        seed=0,
        shuffle=False,
        prefetch=0,
    )


@pytest.fixture
def quick_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[QuickNode]:
    for variable in (
        "CHUNKD_JOB",
        "SLURM_JOB_ID",
        "TORCHELASTIC_RUN_ID",
        "RANK",
        "WORLD_SIZE",
        "SLURM_PROCID",
        "SLURM_NTASKS",
    ):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("CHUNKD_POD_LABELS", str(tmp_path / "no-labels"))
    files = tmp_path / "files"
    files.mkdir()
    shards = []
    for i in range(STEPS):
        (files / f"rec-{i}.bin").write_bytes(os.urandom(RECORD))
        shards.append(f"f/rec-{i}.bin")
    port = free_port()
    cwd = tmp_path / "node"
    toml = f"""
[cache]
dir = "{tmp_path / "cache"}"
ram_bytes = "16MiB"
disk_bytes = "64MiB"
disk_min_free_bytes = 0
chunk_bytes = "64KiB"
fsync = "never"

[jobs]
top = 1

[[backends]]
name = "f"
url = "file://{files}"
"""
    launched = DaemonProcess(
        toml,
        cwd=cwd,
        program=(sys.executable, "-c", _SERVE),
        listen=f"127.0.0.1:{port}",
        socket=cwd / "chunkd.sock",
        log=tmp_path / "daemon.log",
    )
    daemon = Daemon(launched.process, port, launched.config or cwd, cwd, launched.env, launched.log)
    try:
        wait_ready(daemon)
        node = QuickNode(daemon, shards)
        monkeypatch.setenv("CHUNKD_SOCKET", str(node.socket))
        yield node
    finally:
        launched.process.kill()
        launched.process.wait(timeout=10)


# -- H1: an epoch's end is not the job's end ------------------------------------------


@pytest.mark.timeout(60)
def test_a_pause_between_epochs_keeps_the_jobs_start_and_label(quick_node: QuickNode) -> None:
    loader = quick_node.loader(train_job=JOB)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        assert len(list(loader)) == STEPS
        if epoch == 0:
            # evaluation, a checkpoint: longer than the quiet after every rank's end;
            # meanwhile another job starts on the node (top = 1: a slot if one is free)
            time.sleep(QUIET * 2.5)
            with Client(quick_node.socket, train_job="intruder") as other:
                assert other.train_job == "intruder"
    daemon = quick_node.daemon
    assert daemon.metric("chunkd_job_starts_total", admitted="true") == 1
    assert daemon.metric("chunkd_job_starts_total", admitted="false") == 1  # the intruder
    assert loader.meter is not None
    assert loader.meter.label == JOB  # still named: its one start, its one label
    assert daemon.metric("chunkd_loader_wait_seconds_count", train_job=JOB) == 2 * STEPS
    live = {job["name"]: job for job in quick_node.jobs()["jobs"]}
    assert live[JOB]["label"] == JOB
    assert live["intruder"]["label"] == "other"


@pytest.mark.timeout(60)
def test_close_is_the_ranks_end(quick_node: QuickNode) -> None:
    loader = quick_node.loader(train_job=JOB)
    assert len(list(loader)) == STEPS
    assert loader.meter is not None
    loader.meter.close()
    time.sleep(QUIET * 2.5)
    answer = quick_node.jobs()  # the view expires the jobs that ended
    assert JOB not in {job["name"] for job in answer["jobs"]}
    assert JOB in {job["name"] for job in answer["ended"]}


@pytest.mark.timeout(60)
def test_the_loaders_meter_is_there_before_its_first_iteration(quick_node: QuickNode) -> None:
    # R3 L8: the docs' loader.meter.close() works on a Loader never iterated (a rank
    # that stops before its first step), and the same meter then measures its epochs
    loader = quick_node.loader(train_job=JOB)
    meter = loader.meter
    assert meter is not None
    meter.close()
    assert (meter.reports, meter.failed) == (1, 0)  # the rank's end, taken
    assert len(list(loader)) == STEPS
    assert loader.meter is meter
    assert meter.reports == 2  # the epoch's window, one report
    assert quick_node.daemon.metric("chunkd_loader_wait_seconds_count", train_job=JOB) == STEPS
    assert quick_node.loader(train_job=JOB, measure=False).meter is None


_EXITING = """
import functools, gc, sys
from chunkd.client import Client, StallMeter
from chunkd.client.datasets.loader import Loader
from chunkd.client.torch.shards import ShardDataset

shards, record, socket = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3]
dataset = ShardDataset(
    shards, kind="fixed", record_bytes=record, seed=0, shuffle=False, prefetch=0,
    client_factory=functools.partial(Client, socket),
).dataset
loader = Loader(dataset, batch_size=1, seed=0, shuffle=False, prefetch=0,
                shared_decode=False, train_job="exit-loader")
for epoch in (0, 1):
    loader.set_epoch(epoch)
    assert len(list(loader)) == len(shards)

def epoch():  # a meter gone before the exit (torch's measured makes one an epoch)
    meter = StallMeter(socket_path=socket, train_job="exit-gone")
    assert list(meter.wrap(range(3))) == [0, 1, 2]
    assert meter.reports == 1

epoch()
gc.collect()
print("done")
"""


@pytest.mark.timeout(60)
def test_the_process_exit_ends_each_rank_it_reported(quick_node: QuickNode) -> None:
    pytest.importorskip("torch")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _EXITING,
            ",".join(quick_node.shards),
            str(RECORD),
            str(quick_node.socket),
        ],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "done"
    time.sleep(QUIET * 2.5)
    answer = quick_node.jobs()  # the view expires the jobs that ended
    assert not {job["name"] for job in answer["jobs"]} & {"exit-loader", "exit-gone"}
    ended = {job["name"]: job for job in answer["ended"]}
    assert ended["exit-loader"]["steps"] == 2 * STEPS  # one rank, both epochs, then its end
    assert ended["exit-gone"]["steps"] == 3  # its meter was gone: an empty end at exit


# -- H2: nested meters count each step once -------------------------------------------


class _LoaderInside:
    """A torch IterableDataset over a plain Loader (what a user may write)."""

    def __init__(self, node: QuickNode) -> None:
        self.node = node

    def __iter__(self) -> Iterator[Any]:
        for batch in self.node.loader(train_job=JOB):
            yield batch.ids


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_measured_over_a_loader_in_the_trainers_process_counts_each_step_once(
    quick_node: QuickNode,
) -> None:
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader, IterableDataset

    from chunkd.client.torch import measured

    class Wrapped(_LoaderInside, IterableDataset[Any]):
        pass

    loader = DataLoader(Wrapped(quick_node), batch_size=None, num_workers=0)
    assert len(list(measured(loader, train_job=JOB))) == STEPS
    daemon = quick_node.daemon
    assert daemon.metric("chunkd_loader_wait_seconds_count", train_job=JOB) == STEPS
    # and measured (or a meter's wrap) straight over a Loader: its steps, once
    plain = quick_node.loader(train_job=JOB)
    assert len(list(measured(plain, train_job=JOB))) == STEPS
    assert plain.meter is not None
    assert plain.meter.reports == 0  # the Loader left the measuring to the outer meter
    assert daemon.metric("chunkd_loader_wait_seconds_count", train_job=JOB) == 2 * STEPS


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_measured_takes_rank_and_world_size_each_from_the_snapshot_dataset(
    quick_node: QuickNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    # R3 L9: one of the two given, the other is still the dataset's, not the environment's
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from chunkd.client.torch import SnapshotDataset, measured

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "16")
    dataset = _dataset(quick_node).dataset
    ranked = SnapshotDataset(dataset, batch_size=1, seed=0, shuffle=False, rank=1, world_size=2)
    loader = DataLoader(ranked, batch_size=None, num_workers=0)
    assert len(list(measured(loader, train_job="given-rank", rank=1))) == STEPS // 2
    assert len(list(measured(loader, train_job="given-world", world_size=2))) == STEPS // 2
    jobs = {job["name"]: job for job in quick_node.jobs()["jobs"]}
    for job in ("given-rank", "given-world"):
        assert jobs[job]["world_size"] == 2  # the dataset's, not $WORLD_SIZE's 16
        assert [rank["rank"] for rank in jobs[job]["worst_ranks"]] == [1]  # not $RANK's 3


# -- M1, L6: Grain ---------------------------------------------------------------------


def _grain(node: QuickNode, **options: Any) -> Any:
    grain_adapter = pytest.importorskip("chunkd.client.grain")
    return grain_adapter.ChunkdIterDataset(
        _dataset(node).dataset,
        batch_size=1,
        seed=0,
        shuffle=False,
        prefetch=0,
        shared_decode=False,
        train_job=JOB,
        **options,
    )


@pytest.mark.timeout(60)
def test_a_grain_iterator_inside_a_meter_leaves_the_steps_to_it(quick_node: QuickNode) -> None:
    meter = StallMeter(socket_path=quick_node.socket, train_job=JOB)
    assert len(list(meter.wrap(_grain(quick_node)))) == STEPS
    assert quick_node.daemon.metric("chunkd_loader_wait_seconds_count", train_job=JOB) == STEPS


@pytest.mark.timeout(60)
def test_grain_with_one_prefetch_worker_is_measured_by_the_trainer_only(
    quick_node: QuickNode,
) -> None:
    pipeline = _grain(quick_node)
    import grain

    pipeline = pipeline.mp_prefetch(grain.MultiprocessingOptions(num_workers=1))
    # the documented way under mp_prefetch: the trainer wraps the pipeline's iterator
    meter = StallMeter(socket_path=quick_node.socket, train_job=JOB)
    assert len(list(meter.wrap(pipeline))) == STEPS
    assert meter.reports == 1
    # the child (Grain does not split a dataset for one worker) sent nothing of its own
    assert quick_node.daemon.metric("chunkd_loader_wait_seconds_count", train_job=JOB) == STEPS


@pytest.mark.timeout(60)
def test_grain_under_thread_prefetch_is_not_measured_in_the_thread(
    quick_node: QuickNode,
) -> None:
    dataset = _grain(quick_node)
    import grain.experimental

    pipeline = grain.experimental.ThreadPrefetchIterDataset(dataset, prefetch_buffer_size=2)
    assert len(list(pipeline)) == STEPS
    assert quick_node.daemon.metric("chunkd_loader_wait_seconds_count", train_job=JOB) == 0


@pytest.mark.timeout(60)
def test_a_grain_loop_that_leaves_early_sends_its_window(quick_node: QuickNode) -> None:
    iterator = iter(_grain(quick_node, stall_window=3600))
    for _ in range(3):
        next(iterator)
    assert iterator.meter is not None
    assert iterator.meter.reports == 0  # one long window, not over
    del iterator  # the loop left (a break): the iterator is let go
    gc.collect()
    assert quick_node.daemon.metric("chunkd_loader_wait_seconds_count", train_job=JOB) == 3


# -- M2: the job; L2: rank and world size ----------------------------------------------


@pytest.mark.timeout(30)
def test_the_clients_job_comes_before_the_environments(
    quick_node: QuickNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with Client(quick_node.socket, train_job="run-7") as client:
        assert StallMeter(client).train_job == "run-7"
        assert StallMeter(client, train_job="run-8").train_job == "run-8"
        loader = Loader(
            _dataset(quick_node).dataset, batch_size=1, seed=0, shuffle=False, client=client
        )
        assert loader.train_job == "run-7"
    assert StallMeter(socket_path=quick_node.socket).train_job == "4242"  # no client
    dataset = _dataset(quick_node, train_job="run-9").dataset  # its client's job
    assert Loader(dataset, batch_size=1, seed=0).train_job == "run-9"
    grain_adapter = pytest.importorskip("chunkd.client.grain")
    assert grain_adapter.ChunkdIterDataset(dataset, batch_size=1, seed=0).train_job == "run-9"


@pytest.mark.timeout(30)
def test_rank_and_world_size_from_slurm_and_a_rank_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(variable, raising=False)
    nobody = tmp_path / "nobody.sock"

    def ranks() -> tuple[int, int]:
        meter = StallMeter(socket_path=nobody)
        return meter.rank, meter.world_size

    assert ranks() == (0, 1)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert ranks() == (3, 8)  # plain srun, no torchrun
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert ranks() == (5, 16)  # torchrun's come first
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("SLURM_NTASKS")
    assert ranks() == (5, 6)  # a rank without a world size is kept, never 0
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("SLURM_PROCID")
    meter = StallMeter(socket_path=nobody, rank=3)
    assert (meter.rank, meter.world_size) == (3, 4)
    with pytest.raises(ValueError, match="rank"):
        StallMeter(socket_path=nobody, rank=3, world_size=2)


# -- M3: a worker's start, once; R3 M2: a spawned trainer is no worker -----------------


def _worker_starts(answers: Any) -> None:
    started = time.monotonic()
    answers.put([FirstBatch(None, started=started).worker_start is not None for _ in range(3)])  # type: ignore[arg-type]


class _StartsInWorker:
    """A torch IterableDataset whose one item is what three epochs' first batches of
    its worker would say of ``worker_start`` (set or not)."""

    def __iter__(self) -> Iterator[list[bool]]:
        started = time.monotonic()
        yield [FirstBatch(None, started=started).worker_start is not None for _ in range(3)]  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_a_worker_reports_its_start_on_its_first_iteration_only() -> None:
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader, IterableDataset

    class Starts(_StartsInWorker, IterableDataset[list[bool]]):
        pass

    # epochs 1, 2, 3 of a persistent DataLoader worker: its start belongs to the first
    assert list(DataLoader(Starts(), batch_size=None, num_workers=1)) == [[True, False, False]]
    assert FirstBatch(None).worker_start is None  # type: ignore[arg-type]  # no worker


def _grain_worker_starts(_: int) -> list[bool]:
    started = time.monotonic()
    return [FirstBatch(None, started=started).worker_start is not None for _ in range(3)]  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_a_grain_worker_reports_its_start_on_its_first_iteration_only() -> None:
    grain = pytest.importorskip("grain")
    pipeline = grain.MapDataset.source([0]).to_iter_dataset().map(_grain_worker_starts)
    pipeline = pipeline.mp_prefetch(grain.MultiprocessingOptions(num_workers=1))
    assert list(pipeline) == [[True, False, False]]  # Grain's worker, by Grain's own test


@pytest.mark.timeout(30)
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_trainer_started_by_multiprocessing_reports_no_worker_start(method: str) -> None:
    # mp.spawn's trainers, a multiprocessing.Process, a pool's: a parent process, but
    # no DataLoader or Grain worker; their age is the model's setup, not a worker's start
    context = multiprocessing.get_context(method)
    answers = context.Queue()
    trainer = context.Process(target=_worker_starts, args=(answers,))
    trainer.start()
    try:
        assert answers.get(timeout=25) == [False, False, False]
    finally:
        trainer.join(timeout=10)


# -- L8: the labels file -----------------------------------------------------------------


@pytest.mark.timeout(10)
def test_a_labels_file_that_is_no_file_is_skipped_without_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in ("CHUNKD_JOB", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(variable, raising=False)
    fifo = tmp_path / "labels"
    os.mkfifo(fifo)
    monkeypatch.setenv("CHUNKD_POD_LABELS", str(fifo))
    found: list[str | None] = []
    looking = threading.Thread(target=lambda: found.append(job_name()), daemon=True)
    looking.start()
    looking.join(timeout=3)
    assert found == [None]  # a FIFO nobody writes: not waited on
    monkeypatch.setenv("CHUNKD_POD_LABELS", str(tmp_path))  # a directory
    assert job_name() is None


@pytest.mark.timeout(10)
def test_label_values_are_unquoted_in_one_pass(tmp_path: Path) -> None:
    labels = tmp_path / "labels"
    labels.write_text(
        textwrap.dedent(
            r"""
            job-name="a\\\"b\\"
            training.kubeflow.org/job-name="run-7"
            batch.kubernetes.io/job-name="x\\\\"
            """
        )
    )
    assert _pod_labels(labels) == [
        ("batch.kubernetes.io/job-name", "x\\\\"),
        ("job-name", 'a\\"b\\'),
        ("training.kubeflow.org/job-name", "run-7"),
    ]
