"""Time to first batch: 4 ranks x 2 workers open ~1 GiB of Parquet on moto S3.

The data: 64 Parquet files of about 16 MiB (``--quick``: 8 of about 0.5 MiB), each of
8 row groups (``--quick``: 2), with columns ``id`` (int64, the row's global index, 0..N-1
in file order), ``label`` (int64, ``id * 7919 % 1000``) and ``text`` (1-3 KiB of ASCII
words), written by pyarrow with its defaults (snappy) and uploaded to a moto S3 server on
loopback as ``s3://BUCKET/parquet/part-00000.parquet`` ... A sample is one row.

Contenders, each a job of 4 rank processes started at once, each rank a torch
``DataLoader`` of 2 workers and batches of 32, reading its share of one epoch:

- **chunkd** (:func:`chunkd_side`): the files registered as a snapshot, each rank a
  ``SnapshotDataset`` over it through the node's daemon (cold, warm, and cold with a
  warm peer), read by columns (the default collate: ``batch.columns`` as tensors), each
  row group decoded once per node by the daemon: the notes give the daemon's decode
  metrics over each job, and the peak of its decoded bytes held against
  ``[datasets] decoded_bytes``;
- **MosaicML Streaming** 0.13 (:mod:`bench.streaming_side`, in a venv of its own): the
  same rows converted with its own ``MDSWriter`` (its defaults: no compression; shards
  of 16 MiB for moto's sake), which uploads them to ``s3://BUCKET/mds/``; a
  ``StreamingDataset(remote=..., local=..., shuffle=True)`` per rank, with ``RANK``,
  ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` set as a launcher sets them. Cold: an empty
  cache dir; warm: the cache dir a previous job filled;
- **pyarrow + s3fs**, as a user writes it without either: an ``IterableDataset`` whose
  global worker g of G takes every G-th file of a seeded shuffle of the listing and reads
  it row group by row group through ``s3fs`` and ``pyarrow.parquet.ParquetFile``.

Time to first batch is the slowest rank's time from the dataset's construction (its
imports done) to its first batch; the notes break it into imports, metadata (listing,
index), worker start and first batch (fetch + decode), and give it with imports. Steady
samples/s is the sum over ranks of the samples after the first batch over the time they
took. Every job's ids and text CRCs are checked against the Parquet's: a full epoch must
cover every id; the moto server's request log (its recorder) counts each side's GETs.

It is one job at ~1,250 lines: one scenario (time to first batch of one dataset on S3)
and its two baselines, which share its data, its bucket, its request recorder, its rank
processes' launcher and its checks of every id; the daemon is
:class:`bench.daemon.BenchDaemon`, the Streaming side's venv :mod:`bench.streaming_side`,
the daemon's decode figures :mod:`bench.loader_bench`'s, and the rows go to
:class:`bench.report.Report`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .loader_bench import DecodedPeak, decode_metrics
from .report import Report, Result, Rounds
from .streaming_side import StreamingVenv, Unavailable, ensure_venv

__all__ = ["Job", "Layout", "RankTimes", "chunkd_side", "run"]

MiB = 1 << 20
WORLD_SIZE = 4
WORKERS = 2
BATCH = 32
SEED = 17
ACCESS_KEY, SECRET_KEY, REGION = "testing", "testing-secret", "us-east-1"


@dataclass(frozen=True)
class Layout:
    """Where the bench's data lies, and what is in it.

    The Parquet files are ``s3://{bucket}/{parquet_prefix}part-{i:05d}.parquet`` for i in
    ``range(files)`` on the moto server at ``endpoint`` (credentials :data:`ACCESS_KEY`,
    :data:`SECRET_KEY`, region :data:`REGION`), and the same files under ``local_dir``.
    File i holds ids ``[i * rows_per_file, (i + 1) * rows_per_file)`` in
    ``row_groups`` row groups of equal size. ``crcs[id]`` is ``zlib.crc32`` of row
    ``id``'s text (UTF-8), what a reader's samples are checked against.
    """

    endpoint: str
    bucket: str
    parquet_prefix: str
    local_dir: Path
    files: int
    rows_per_file: int
    row_groups: int
    parquet_bytes: int
    crcs: Any = field(repr=False)  # numpy int64 array, one per id
    mds_prefix: str = "mds/"

    @property
    def rows(self) -> int:
        """Samples in the dataset."""
        return self.files * self.rows_per_file

    def parquet_url(self) -> str:
        """``s3://BUCKET/PREFIX`` of the Parquet files (no trailing slash)."""
        return f"s3://{self.bucket}/{self.parquet_prefix.rstrip('/')}"

    def mds_url(self) -> str:
        """``s3://BUCKET/PREFIX`` of Streaming's MDS copy."""
        return f"s3://{self.bucket}/{self.mds_prefix.rstrip('/')}"


@dataclass(frozen=True)
class RankTimes:
    """What one rank process prints as its last line of output (JSON, these keys).

    Times are ``time.time()`` of that rank: ``spawned`` when the job was started (given
    to it by the launcher), ``imported`` once its imports are done, ``constructed`` once
    its dataset object exists (metadata read), ``workers_started`` when the last of its
    DataLoader workers ran its ``worker_init_fn``, ``first_batch`` when its first batch
    was in hand, ``ended`` when it stopped reading. ``samples`` counts all it read,
    ``first_batch_samples`` the first batch's. Beside it the rank writes ``ids_out``:
    ``np.save`` of a (2, samples) int64 array, the ids read and their texts' CRC32.
    """

    rank: int
    spawned: float
    imported: float
    constructed: float
    workers_started: float
    first_batch: float
    ended: float
    samples: int
    first_batch_samples: int


@dataclass(frozen=True)
class Job:
    """The ranks of one job, and what their figures add up to."""

    ranks: list[RankTimes]
    gets: int = 0  # GET requests the moto server answered during the job

    @property
    def ttfb(self) -> float:
        """Seconds, the slowest rank: its dataset's construction to its first batch."""
        return max(r.first_batch - r.imported for r in self.ranks)

    @property
    def ttfb_with_imports(self) -> float:
        """Seconds from the job's start to the last rank's first batch."""
        return max(r.first_batch for r in self.ranks) - min(r.spawned for r in self.ranks)

    @property
    def steady(self) -> float:
        """Samples/s after the first batch, summed over the ranks."""
        return sum(
            (r.samples - r.first_batch_samples) / max(r.ended - r.first_batch, 1e-9)
            for r in self.ranks
        )

    def phases(self) -> dict[str, float]:
        """The slowest rank's time to first batch, in seconds per phase."""
        r = max(self.ranks, key=lambda r: r.first_batch - r.imported)
        return {
            "imports": r.imported - r.spawned,
            "metadata": r.constructed - r.imported,
            "worker start": max(r.workers_started - r.constructed, 0.0),
            "first batch": r.first_batch - max(r.workers_started, r.constructed),
        }

    def phases_text(self) -> str:
        """The phases, as the notes print them."""
        return ", ".join(f"{name} {s:.2f}s" for name, s in self.phases().items())


def chunkd_side(
    layout: Layout, work: Path, *, quick: bool, rounds: int = 3
) -> dict[str, Job] | None:
    """chunkd's side: the same job shape as the baselines over a registered snapshot.

    The Parquet files of ``layout`` are registered once (``chunkd dataset register``,
    timed apart: a one-off, as Streaming's conversion is) in a registry on the node's
    disk; each rank then opens ``ttfb@1``, and reads it with a torch ``DataLoader`` of
    :data:`WORKERS` workers over :class:`~chunkd.client.torch.SnapshotDataset` (batches
    of :data:`BATCH`, chunkd's order, the next steps prefetched). Cases, a :class:`Job`
    each:

    - ``"cold"``: a daemon started on an empty cache (RAM and disk) for each job;
    - ``"warm"``: the same daemon again after a job read the whole epoch;
    - ``"peer"``: a cold daemon whose peer (the warm daemon, restarted on its disk
      cache) holds the epoch: the chunks the peer owns come from it, not from S3.

    Each case runs ``rounds`` times (``quick``: the cold case not at all, the epoch's job
    stands for it; the others once).

    Returns:
        The jobs by case (the median of its rounds by time to first batch), every round
        as ``"cold/0"``, ``"warm/1"``..., and ``"epoch"`` (the cold job that read the whole
        epoch).
    """
    from .daemon import BenchDaemon

    rounds = 0 if quick else rounds
    ttfb_batches = 4
    registry = work / "registry"
    registry.mkdir(parents=True, exist_ok=True)
    token = work / "peer-token"
    token.write_text(uuid.uuid4().hex)
    token.chmod(0o600)
    a_port, b_port = free_ports(2)
    nodes = {"a": (work / "a", a_port), "b": (work / "b", b_port)}

    def start(node: str, *, fresh: bool, peers: bool = False) -> BenchDaemon:
        home, port = nodes[node]
        if fresh:
            shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True, exist_ok=True)
        config = home / "chunkd.toml"
        config.write_text(_chunkd_config(layout, home, registry, port, peers=peers, nodes=nodes))
        return BenchDaemon(home, {}, config, port=port)

    def job(daemon: BenchDaemon, name: str, *, max_batches: int, full_epoch: bool) -> Job:
        def argv(_rank: int, ids_out: Path) -> list[str]:
            return [
                sys.executable,
                "-m",
                "bench.ttfb_bench",
                "chunkd-rank",
                f"--socket={daemon.socket}",
                "--ref=ttfb@1",
                f"--batch-size={BATCH}",
                f"--workers={WORKERS}",
                f"--seed={SEED}",
                f"--max-batches={max_batches}",
                f"--ids-out={ids_out}",
            ]

        env = _s3_env(layout.endpoint) | {"CHUNKD_SOCKET": daemon.socket}
        env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
        prefix = f"/{layout.bucket}/{layout.parquet_prefix}"
        before = _first_batch_phases(daemon.url)
        decodes = decode_metrics(daemon.url)
        peak = DecodedPeak(daemon.url)
        try:
            done = _job(argv, env, work / name, layout, _NO_RECORDER, prefix, full_epoch=full_epoch)
        finally:
            held = peak.stop()
        after = _first_batch_phases(daemon.url)
        now = decode_metrics(daemon.url)
        _DECODES[name] = {k: v - decodes.get(k, 0.0) for k, v in now.items()} | {
            "peak": held,
            "budget": float(DECODED_BYTES),
        }
        # the mean over the job's readers (every rank's workers) of each phase
        _PHASES[name] = {
            phase: (total - before.get(phase, (0.0, 0))[0])
            / max(1, n - before.get(phase, (0, 0))[1])
            for phase, (total, n) in after.items()
        }
        return done

    daemon = start("a", fresh=True)
    try:
        started = time.perf_counter()
        done = subprocess.run(
            [
                str(Path(sys.executable).parent / "chunkd"),
                "dataset",
                "register",
                "ttfb",
                f"s3/{layout.parquet_prefix}",
                "--format",
                "parquet",
                "--json",
                "--quiet",
            ],
            env={**os.environ, "CHUNKD_SOCKET": daemon.socket},
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"chunkd dataset register failed: {done.stderr[-2000:]}")
        registered = json.loads(done.stdout)
        _REGISTERED.update(registered, seconds=time.perf_counter() - started)
    finally:
        daemon.stop()
    cold: list[Job] = []
    for r in range(rounds):
        daemon = start("a", fresh=True)
        try:
            cold.append(job(daemon, f"chunkd-cold{r}", max_batches=ttfb_batches, full_epoch=False))
        finally:
            daemon.stop()
    daemon = start("a", fresh=True)
    warm: list[Job] = []
    try:
        epoch = job(daemon, "chunkd-epoch", max_batches=0, full_epoch=True)
        for r in range(max(rounds, 1)):
            warm.append(job(daemon, f"chunkd-warm{r}", max_batches=ttfb_batches, full_epoch=False))
    finally:
        daemon.stop()
    # The peer: node a, warm on its disk cache, and node b, cold, as a cluster of two.
    peer: list[Job] = []
    peer_node = start("a", fresh=False, peers=True)
    try:
        for r in range(max(rounds, 1)):
            cold_node = start("b", fresh=True, peers=True)
            try:
                time.sleep(1.0)  # both see the other up (health_interval 200ms, up_after 1)
                peer.append(
                    job(cold_node, f"chunkd-peer{r}", max_batches=ttfb_batches, full_epoch=False)
                )
                if r == 0:
                    _REGISTERED["peer_bytes"] = _metric(
                        cold_node.url, "chunkd_peer_bytes_total", "in"
                    )
                    _REGISTERED["backend_bytes"] = _metric(
                        cold_node.url, "chunkd_backend_read_bytes_total"
                    )
            finally:
                cold_node.stop()
    finally:
        peer_node.stop()
    rounds_of = {"cold": cold or [epoch], "warm": warm, "peer": peer}
    every = {f"{case}/{r}": j for case, jobs in rounds_of.items() for r, j in enumerate(jobs)}
    return every | {case: _median_job(jobs) for case, jobs in rounds_of.items()} | {"epoch": epoch}


#: what chunkd_side learned of the registration and the peer job, for the notes
_REGISTERED: dict[str, Any] = {}
#: per chunkd job, the mean first-batch phases its readers reported to the daemon
_PHASES: dict[str, dict[str, float]] = {}
#: per chunkd job, the daemon's decode metrics over it (deltas), and the peak of
#: chunkd_dataset_decoded_bytes while it ran ("peak") against the budget ("budget")
_DECODES: dict[str, dict[str, float]] = {}
#: the node's [datasets] decoded_bytes in the bench's daemons (the default)
DECODED_BYTES = 1 << 30


def _first_batch_phases(url: str) -> dict[str, tuple[float, int]]:
    """``chunkd_dataset_first_batch_seconds`` of a daemon: (sum, count) by phase."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        for part, slot in (("_sum{", 0), ("_count{", 1)):
            head = "chunkd_dataset_first_batch_seconds" + part
            if line.startswith(head):
                phase = line.split('phase="', 1)[1].split('"', 1)[0]
                found.setdefault(phase, [0.0, 0.0])[slot] = float(line.rsplit(" ", 1)[1])
    return {phase: (v[0], int(v[1])) for phase, v in found.items()}


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports."""
    from chunkd.testing import free_port

    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


def _metric(url: str, name: str, direction: str | None = None) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (direction is None or f'direction="{direction}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _chunkd_config(
    layout: Layout,
    home: Path,
    registry: Path,
    port: int,
    *,
    peers: bool,
    nodes: dict[str, tuple[Path, int]],
) -> str:
    members = ", ".join(f'"127.0.0.1:{p}"' for _, p in nodes.values())
    peers_section = (
        f"""
[peers]
self = "127.0.0.1:{port}"
members = [{members}]
token_file = "{registry.parent / "peer-token"}"
health_interval = "200ms"
up_after = 1
"""
        if peers
        else ""
    )
    return f'''
[server]
socket = "{home / "chunkd.sock"}"

[cache]
dir = "{home / "cache"}"
ram_bytes = "2GiB"
disk_bytes = "4GiB"
disk_min_free_bytes = 0
fsync = "never"

[[backends]]
name = "s3"
url = "s3://{layout.bucket}"
endpoint = "{layout.endpoint}"
region = "{REGION}"
access_key_id = "{ACCESS_KEY}"
secret_access_key = "{SECRET_KEY}"
allow_http = true

[[backends]]
name = "registry"
url = "file://{registry}"
writable = true

[datasets]
registry = "registry/datasets"
decoded_bytes = {DECODED_BYTES}
{peers_section}'''


class _NoRecorder:
    """The moto request recorder, unused: chunkd's GETs come from its daemon, counted
    by its own metrics."""

    def start(self) -> None:
        return

    def stop_and_count(self, prefix: str) -> int:
        del prefix
        return 0


_NO_RECORDER: Any = _NoRecorder()


# ---------------------------------------------------------------------------------------
# The data.


def _vocabulary(rng: Any) -> Any:
    import numpy as np

    words = 8192
    lengths = rng.integers(2, 11, words)
    table = np.zeros((words, 12), np.uint8)  # a word, one space, zeros
    letters = rng.integers(97, 123, (words, 11), dtype=np.uint8)
    for i, n in enumerate(lengths):
        table[i, :n] = letters[i, :n]
        table[i, n] = 32
    return table


def _write_parquet(
    root: Path, *, files: int, rows_per_file: int, row_groups: int
) -> tuple[list[Path], Any]:
    """The bench's Parquet files under ``root``; returns them and the CRC of each id's text."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    vocabulary = _vocabulary(rng)
    paths, crcs = [], []
    for i in range(files):
        lengths = rng.integers(1024, 3073, rows_per_file)
        total = int(lengths.sum())
        picks = (len(vocabulary) * rng.random(total // 6 + 4096) ** 2).astype(np.int64)
        words = vocabulary[picks]
        data = words[words != 0][:total]
        assert len(data) == total
        offsets = np.zeros(rows_per_file + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        text = pa.StringArray.from_buffers(
            rows_per_file, pa.py_buffer(offsets), pa.py_buffer(data.tobytes())
        )
        ids = np.arange(i * rows_per_file, (i + 1) * rows_per_file, dtype=np.int64)
        table = pa.table({"id": ids, "label": ids * 7919 % 1000, "text": text})
        path = root / f"part-{i:05d}.parquet"
        pq.write_table(table, path, row_group_size=rows_per_file // row_groups)
        paths.append(path)
        raw = data.tobytes()
        crcs.extend(zlib.crc32(raw[a:b]) for a, b in itertools.pairwise(offsets.tolist()))
    return paths, np.asarray(crcs, dtype=np.int64)


# ---------------------------------------------------------------------------------------
# Jobs: rank processes started at once, their figures and their samples checked.


def _s3_env(endpoint: str) -> dict[str, str]:
    """What every rank's environment gets: the moto server's address and credentials,
    and nothing that could send a request past loopback."""
    env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY")}
    return env | {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_EC2_METADATA_DISABLED": "true",
        "S3_ENDPOINT_URL": endpoint,  # Streaming's name for it
        "NO_PROXY": "127.0.0.1,localhost",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


class _Recorder:
    """moto's request recorder: which requests the server answered, to count GETs."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def _post(self, action: str) -> None:
        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/recorder/{action}", data=b"", method="POST"
        )
        with urllib.request.urlopen(request, timeout=30):
            pass

    def start(self) -> None:
        self._post("reset-recording")
        self._post("start-recording")

    def stop_and_count(self, prefix: str) -> int:
        """Stop; the GETs of keys under ``/BUCKET/PREFIX`` since :meth:`start`."""
        self._post("stop-recording")
        url = f"{self.endpoint}/moto-api/recorder/download-recording"
        with urllib.request.urlopen(url, timeout=60) as response:
            lines = response.read().decode().splitlines()
        gets = 0
        for line in lines:
            entry = json.loads(line)
            path = entry["url"].split("://", 1)[-1].split("/", 1)[-1]
            if entry["method"] == "GET" and ("/" + path).startswith(prefix):
                gets += 1
        return gets


def _job(
    argv: Callable[[int, Path], list[str]],
    env: dict[str, str],
    work: Path,
    layout: Layout,
    recorder: _Recorder,
    prefix: str,
    *,
    full_epoch: bool,
) -> Job:
    """Start :data:`WORLD_SIZE` ranks at once (``argv(rank, ids_out)``), wait for them,
    and check what they read against the data."""
    import numpy as np

    from chunkd.testing import free_port

    work.mkdir(parents=True, exist_ok=True)
    # As a launcher sets them: Streaming starts a gloo group of its own over them.
    env = env | {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "GLOO_SOCKET_IFNAME": "lo",
    }
    recorder.start()
    spawned = time.time()
    procs = []
    for rank in range(WORLD_SIZE):
        rank_env = env | {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD_SIZE),
            "LOCAL_WORLD_SIZE": str(WORLD_SIZE),
            "NODE_RANK": "0",
            "BENCH_SPAWNED": repr(spawned),
        }
        out = (work / f"rank{rank}.log").open("w")
        procs.append(
            (
                subprocess.Popen(
                    argv(rank, work / f"ids{rank}.npy"),
                    env=rank_env,
                    stdout=subprocess.PIPE,
                    stderr=out,
                    text=True,
                ),
                out,
            )
        )
    ranks, failed = [], []
    for rank, (proc, out) in enumerate(procs):
        try:
            stdout, _ = proc.communicate(timeout=1800)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, _ = proc.communicate()
        out.close()
        if proc.returncode != 0:
            failed.append(
                f"rank {rank} exited {proc.returncode}: " + _tail(work / f"rank{rank}.log")
            )
            continue
        ranks.append(RankTimes(**json.loads(stdout.strip().splitlines()[-1])))
    gets = recorder.stop_and_count(prefix)
    if failed:
        raise RuntimeError("; ".join(failed))
    read = np.concatenate([np.load(work / f"ids{r}.npy") for r in range(WORLD_SIZE)], axis=1)
    ids, crcs = read
    assert ((ids >= 0) & (ids < layout.rows)).all(), "a rank read an id out of range"
    assert (layout.crcs[ids] == crcs).all(), "a rank read a text that differs from the Parquet's"
    if full_epoch:
        missing = layout.rows - len(np.unique(ids))
        assert missing == 0, f"the epoch missed {missing} of {layout.rows} samples"
    return Job(sorted(ranks, key=lambda r: r.rank), gets)


def _tail(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-3:])


# ---------------------------------------------------------------------------------------
# pyarrow + s3fs: a rank, run as ``python -m bench.ttfb_bench parquet-rank ...``.


def _parquet_rank(options: argparse.Namespace) -> None:
    spawned = float(os.environ["BENCH_SPAWNED"])
    import multiprocessing

    import numpy as np
    import pyarrow.parquet as pq
    import s3fs
    import torch
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info

    imported = time.time()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    def filesystem() -> Any:
        return s3fs.S3FileSystem(
            key=ACCESS_KEY,
            secret=SECRET_KEY,
            endpoint_url=options.endpoint,
            client_kwargs={"region_name": REGION},
            skip_instance_cache=True,
        )

    class ParquetRows(IterableDataset[dict[str, Any]]):
        def __init__(self, files: list[str]) -> None:
            self.files = files

        def __iter__(self) -> Iterator[dict[str, Any]]:
            info = get_worker_info()
            workers, worker = (info.num_workers, info.id) if info else (1, 0)
            fs = filesystem()  # its own, in this worker process
            for path in self.files[rank * workers + worker :: world * workers]:
                with fs.open(path, "rb") as f:
                    parquet = pq.ParquetFile(f)
                    for group in range(parquet.num_row_groups):
                        yield from parquet.read_row_group(group).to_pylist()

    files = sorted(filesystem().glob(f"{options.url.removeprefix('s3://')}/*.parquet"))
    random.Random(options.seed).shuffle(files)
    dataset = ParquetRows(files)
    constructed = time.time()
    worker_started = multiprocessing.Array("d", options.workers, lock=False)

    def on_start(worker: int) -> None:
        worker_started[worker] = time.time()

    loader = DataLoader(
        dataset, batch_size=options.batch_size, num_workers=options.workers, worker_init_fn=on_start
    )
    ids: list[Any] = []
    crcs: list[int] = []
    first, first_count = 0.0, 0
    for batch in loader:
        ids.append(batch["id"])
        crcs.extend(zlib.crc32(text.encode()) for text in batch["text"])
        if not first:
            first, first_count = time.time(), len(batch["text"])
        if options.max_batches and len(ids) >= options.max_batches:
            break
    ended = time.time()
    read = torch.cat(ids).numpy()
    np.save(options.ids_out, np.stack([read, np.asarray(crcs, dtype=np.int64)]))
    times = {
        "rank": rank,
        "spawned": spawned,
        "imported": imported,
        "constructed": constructed,
        "workers_started": max(worker_started),
        "first_batch": first,
        "ended": ended,
        "samples": len(read),
        "first_batch_samples": first_count,
    }
    print(json.dumps(times))


# ---------------------------------------------------------------------------------------
# chunkd: a rank, run as ``python -m bench.ttfb_bench chunkd-rank ...``.


def _chunkd_rank(options: argparse.Namespace) -> None:
    spawned = float(os.environ["BENCH_SPAWNED"])
    import multiprocessing

    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    from chunkd.client import Client
    from chunkd.client.datasets import Dataset
    from chunkd.client.torch import SnapshotDataset

    imported = time.time()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    client = Client(options.socket)
    dataset = Dataset.open(options.ref, client)
    snapshots = SnapshotDataset(
        dataset, batch_size=options.batch_size, seed=options.seed, rank=rank, world_size=world
    )
    constructed = time.time()
    worker_started = multiprocessing.Array("d", options.workers, lock=False)

    def on_start(worker: int) -> None:
        worker_started[worker] = time.time()

    loader = DataLoader(
        snapshots, batch_size=None, num_workers=options.workers, worker_init_fn=on_start
    )
    ids: list[Any] = []
    crcs: list[int] = []
    first, first_count = 0.0, 0
    for batch in loader:
        # the default collate's columns: numbers as tensors of their own, text as str
        columns = batch.columns
        ids.append(columns["id"])
        crcs.extend(zlib.crc32(text.encode()) for text in columns["text"])
        if not first:
            first, first_count = time.time(), len(columns["text"])
        if options.max_batches and len(ids) >= options.max_batches:
            break
    ended = time.time()
    read = torch.cat(ids).numpy() if ids else np.zeros(0, np.int64)
    np.save(options.ids_out, np.stack([read, np.asarray(crcs, dtype=np.int64)]))
    client.close()
    times = {
        "rank": rank,
        "spawned": spawned,
        "imported": imported,
        "constructed": constructed,
        "workers_started": max(worker_started),
        "first_batch": first,
        "ended": ended,
        "samples": len(read),
        "first_batch_samples": first_count,
    }
    print(json.dumps(times))


def _parquet_job(
    layout: Layout, work: Path, recorder: _Recorder, *, max_batches: int, full_epoch: bool
) -> Job:
    def argv(_rank: int, ids_out: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "bench.ttfb_bench",
            "parquet-rank",
            f"--endpoint={layout.endpoint}",
            f"--url={layout.parquet_url()}",
            f"--batch-size={BATCH}",
            f"--workers={WORKERS}",
            f"--seed={SEED}",
            f"--max-batches={max_batches}",
            f"--ids-out={ids_out}",
        ]

    env = _s3_env(layout.endpoint)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    prefix = f"/{layout.bucket}/{layout.parquet_prefix}"
    return _job(argv, env, work, layout, recorder, prefix, full_epoch=full_epoch)


# ---------------------------------------------------------------------------------------
# MosaicML Streaming.


def _streaming_job(
    venv: StreamingVenv,
    layout: Layout,
    work: Path,
    cache: Path,
    recorder: _Recorder,
    *,
    max_batches: int,
    full_epoch: bool,
) -> Job:
    def argv(_rank: int, ids_out: Path) -> list[str]:
        return venv.args(
            "read",
            f"--remote={layout.mds_url()}",
            f"--local={cache}",
            f"--batch-size={BATCH}",
            f"--workers={WORKERS}",
            f"--seed={SEED}",
            f"--max-batches={max_batches}",
            f"--ids-out={ids_out}",
        )

    prefix = f"/{layout.bucket}/{layout.mds_prefix}"
    env = _s3_env(layout.endpoint)
    return _job(argv, env, work, layout, recorder, prefix, full_epoch=full_epoch)


def _cache_files(cache: Path) -> tuple[int, int]:
    """The shard files in a Streaming cache dir, and their bytes."""
    shards = [p for p in cache.rglob("*.mds") if p.is_file()]
    return len(shards), sum(p.stat().st_size for p in shards)


# ---------------------------------------------------------------------------------------
# The scenario.


def _row(
    report: Report,
    scenario: str,
    chunkd: float | None,
    baseline: float | None,
    unit: str,
    baseline_name: str,
    note: str,
    *,
    unavailable: str = "",
    target_ratio: float | None = None,
    target_max: float | None = None,
    rounds: tuple[list[float], list[float]] | None = None,
) -> None:
    """A row; ``None`` for a side that did not run (the chunkd side while it is pending,
    a baseline that is unavailable here), and the note says which."""
    nan = float("nan")
    prefix = "" if chunkd is not None else "chunkd side: pending. "
    if baseline is None:
        prefix += f"{baseline_name} unavailable: {unavailable}. "
    report.add(
        Result(
            scenario,
            nan if chunkd is None else chunkd,
            nan if baseline is None else baseline,
            unit,
            baseline_name,
            target_ratio=target_ratio if chunkd is not None and baseline is not None else None,
            target_max=target_max if chunkd is not None else None,
            samples=Rounds.of(*rounds) if rounds and rounds[0] else None,
            note=prefix + note,
        )
    )


def _median_job(jobs: list[Job]) -> Job:
    return sorted(jobs, key=lambda j: j.ttfb)[len(jobs) // 2]


def run(report: Report, work: Path, *, quick: bool) -> None:
    """The time-to-first-batch scenario (``quick``: a few MiB, to check the bench runs)."""
    from chunkd.testing import S3Server

    work.mkdir(parents=True, exist_ok=True)
    files, rows_per_file, row_groups = (8, 256, 2) if quick else (64, 9216, 8)
    rounds = 0 if quick else report.rounds_for(3)
    streaming = ensure_venv(build=not quick)
    saved = os.environ.get("MOTO_RECORDER_FILEPATH")
    os.environ["MOTO_RECORDER_FILEPATH"] = str(work / "moto_recording")
    try:
        server = S3Server.start()
    finally:
        if saved is None:
            os.environ.pop("MOTO_RECORDER_FILEPATH")
        else:
            os.environ["MOTO_RECORDER_FILEPATH"] = saved
    try:
        bucket = f"ttfb-{uuid.uuid4().hex[:10]}"
        s3 = server.client()
        s3.create_bucket(Bucket=bucket)
        started = time.perf_counter()
        paths, crcs = _write_parquet(
            work / "parquet", files=files, rows_per_file=rows_per_file, row_groups=row_groups
        )
        for path in paths:
            s3.put_object(Bucket=bucket, Key=f"parquet/{path.name}", Body=path.read_bytes())
        layout = Layout(
            endpoint=server.endpoint,
            bucket=bucket,
            parquet_prefix="parquet/",
            local_dir=work / "parquet",
            files=files,
            rows_per_file=rows_per_file,
            row_groups=row_groups,
            parquet_bytes=sum(p.stat().st_size for p in paths),
            crcs=crcs,
        )
        print(
            f"ttfb: {layout.rows} rows in {files} Parquet files, "
            f"{layout.parquet_bytes / MiB:.1f} MiB, written and uploaded in "
            f"{time.perf_counter() - started:.1f}s",
            flush=True,
        )
        recorder = _Recorder(server.endpoint)
        _measure(report, layout, streaming, recorder, work, quick=quick, rounds=rounds)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def _measure(
    report: Report,
    layout: Layout,
    streaming: StreamingVenv | Unavailable,
    recorder: _Recorder,
    work: Path,
    *,
    quick: bool,
    rounds: int,
) -> None:
    shape = f"{WORLD_SIZE} ranks x {WORKERS} workers, {layout.parquet_bytes / MiB:.0f} MiB Parquet"
    # Time-to-first-batch rounds read a few batches; one job per side reads the epoch
    # (--quick: that job alone gives the time to first batch too).
    ttfb_batches = 4
    converted: dict[str, Any] = {}
    if isinstance(streaming, StreamingVenv):
        try:
            converted = streaming.run_json(
                "convert",
                f"--parquet={layout.local_dir}",
                f"--local={work / 'mds-out'}",
                f"--remote={layout.mds_url()}",
                f"--size-limit={MiB if quick else 16 * MiB}",
                env=_s3_env(layout.endpoint),
            )
        except RuntimeError as e:
            streaming = Unavailable(f"the MDS conversion failed: {e}")
        else:
            assert converted["samples"] == layout.rows, converted
            print(
                f"ttfb: converted to {converted['shards']} MDS shards "
                f"({converted['zip_bytes'] / MiB:.1f} MiB) in {converted['seconds']:.1f}s",
                flush=True,
            )

    parquet_cold: list[Job] = []
    streaming_cold: list[Job] = []
    for r in range(rounds):
        order = ["parquet", "streaming"] if r % 2 == 0 else ["streaming", "parquet"]
        for who in order:
            if who == "parquet":
                parquet_cold.append(
                    _parquet_job(
                        layout,
                        work / f"pq{r}",
                        recorder,
                        max_batches=ttfb_batches,
                        full_epoch=False,
                    )
                )
            elif isinstance(streaming, StreamingVenv):
                streaming_cold.append(
                    _streaming_job(
                        streaming,
                        layout,
                        work / f"st{r}",
                        work / f"st{r}" / "cache",
                        recorder,
                        max_batches=ttfb_batches,
                        full_epoch=False,
                    )
                )
    # The epoch: steady samples/s, every id checked; then Streaming warm, on its cache.
    parquet_epoch = _parquet_job(
        layout, work / "pq-epoch", recorder, max_batches=0, full_epoch=True
    )
    streaming_epoch = streaming_warm = None
    streaming_warm_jobs: list[Job] = []
    cache_note = ""
    if isinstance(streaming, StreamingVenv):
        cache = work / "st-epoch" / "cache"
        streaming_epoch = _streaming_job(
            streaming, layout, work / "st-epoch", cache, recorder, max_batches=0, full_epoch=True
        )
        shards, cached = _cache_files(cache)
        cache_note = (
            f"; its cache dir then held {shards} of {converted['shards']} shards "
            f"({cached / MiB:.1f} MiB) and the S3 server answered {streaming_epoch.gets} GETs "
            f"under mds/ ({layout.parquet_bytes / MiB:.0f} MiB Parquet, "
            f"{converted['zip_bytes'] / MiB:.0f} MiB MDS, converted in "
            f"{converted['seconds']:.1f}s, a one-off)"
        )
        streaming_warm_jobs = [
            _streaming_job(
                streaming,
                layout,
                work / f"st-warm{r}",
                cache,
                recorder,
                max_batches=ttfb_batches,
                full_epoch=False,
            )
            for r in range(max(rounds, 1))
        ]
        streaming_warm = _median_job(streaming_warm_jobs)
    if not rounds:
        parquet_cold.append(parquet_epoch)
        streaming_cold += [streaming_epoch] if streaming_epoch else []
    why = streaming.reason if isinstance(streaming, Unavailable) else ""
    pq_cold = _median_job(parquet_cold)
    st_cold = _median_job(streaming_cold) if streaming_cold else None
    figures = chunkd_side(layout, work / "chunkd", quick=quick, rounds=rounds)
    chunkd_cold = figures["cold"] if figures else None

    def ttfbs(case: str) -> list[float]:
        """chunkd's time to first batch in every round of ``case``."""
        return [j.ttfb for k, j in (figures or {}).items() if k.startswith(case + "/")]

    st_cold_s = [j.ttfb for j in streaming_cold]
    _breakdown(
        report,
        shape,
        {
            "chunkd, cold node": chunkd_cold,
            "chunkd, cold node, warm peer": figures["peer"] if figures else None,
            "chunkd, warm node": figures["warm"] if figures else None,
            "Streaming, cold": st_cold,
            "Streaming, cache dir full": streaming_warm,
            "pyarrow + s3fs": pq_cold,
        },
    )

    def described(name: str, job: Job | None) -> str:
        if job is None:
            return f"{name}: not run"
        return (
            f"{name} {job.ttfb:.2f}s ({job.phases_text()}; {job.ttfb_with_imports:.2f}s "
            f"from the job's start; {job.gets} GETs)"
        )

    registered = ""
    if figures:
        phases = _PHASES.get("chunkd-cold0") or _PHASES.get("chunkd-epoch", {})
        shown = ", ".join(
            f"{p.replace('_', ' ')} {phases[p]:.2f}s"
            for p in ("metadata", "worker_start", "first_chunk", "decode")
            if p in phases
        )
        registered = (
            f"; chunkd's readers' own breakdown (the mean of its 8 readers, from the "
            f"daemon's chunkd_dataset_first_batch_seconds): {shown}; the registration, a "
            f"one-off, read {_REGISTERED.get('members')} footers in "
            f"{_REGISTERED.get('seconds', 0.0):.1f}s"
        )
    breakdown = "; ".join(
        described(name, job)
        for name, job in (
            ("chunkd", chunkd_cold),
            ("Streaming", st_cold),
            ("pyarrow+s3fs", pq_cold),
        )
    )
    _row(
        report,
        f"time to first batch, {shape}, cold node",
        chunkd_cold.ttfb if chunkd_cold else None,
        st_cold.ttfb if st_cold else None,
        "s",
        "MosaicML Streaming 0.13, same rows as MDS",
        f"lower is better; slowest rank, median of {max(rounds, 1)}; {breakdown}. Streaming "
        "runs with its defaults and shuffle=True: its shuffle block (py1e) is larger than this "
        "dataset, so a first batch draws on most shards; pyarrow+s3fs shuffles files only; "
        "chunkd mixes rows within windows of 16 row groups and reads only the row groups a batch "
        "needs" + registered,
        unavailable=why,
        target_max=0.5 * st_cold.ttfb if st_cold else None,
        rounds=(ttfbs("cold"), st_cold_s),
    )
    _row(
        report,
        f"time to first batch, {shape}, cold node: pyarrow",
        chunkd_cold.ttfb if chunkd_cold else None,
        pq_cold.ttfb,
        "s",
        "pyarrow + s3fs straight from S3",
        "lower is better; s3fs reads the footer, then the row groups of each worker's file",
        rounds=(ttfbs("cold"), [j.ttfb for j in parquet_cold]),
    )
    chunkd_warm = figures["warm"] if figures else None
    _row(
        report,
        f"time to first batch, {shape}, warm node",
        chunkd_warm.ttfb if chunkd_warm else None,
        streaming_warm.ttfb if streaming_warm else None,
        "s",
        "Streaming with its cache dir full",
        "lower is better; "
        + described("chunkd", chunkd_warm)
        + "; "
        + described("Streaming", streaming_warm)
        + _readers_text("chunkd-warm0"),
        unavailable=why,
        target_max=0.5,
        rounds=(ttfbs("warm"), [j.ttfb for j in streaming_warm_jobs]),
    )
    chunkd_peer = figures["peer"] if figures else None
    _row(
        report,
        f"time to first batch, {shape}, cold node, warm peer",
        chunkd_peer.ttfb if chunkd_peer else None,
        st_cold.ttfb if st_cold else None,
        "s",
        "Streaming, cold (it has no peers)",
        "lower is better; the node's peer read the epoch before"
        + (
            f"; the cold node took {_REGISTERED.get('peer_bytes', 0) / MiB:.0f} MiB from its "
            f"peer and {_REGISTERED.get('backend_bytes', 0) / MiB:.0f} MiB from S3 (a chunk's "
            "owner fetches it: the chunks the cold node owns come from S3)"
            if figures
            else ""
        ),
        unavailable=why,
        target_max=0.5 * st_cold.ttfb if st_cold else None,
        rounds=(ttfbs("peer"), st_cold_s),
    )
    decoded = ""
    if figures:
        decoded = "; decodes: " + "; ".join(
            f"{job.removeprefix('chunkd-')}: {_decodes_text(_DECODES[job])}"
            for job in ("chunkd-epoch", "chunkd-warm0")
            if job in _DECODES
        )
    chunkd_steady = figures["epoch"].steady if figures else None
    _row(
        report,
        f"steady samples/s, {shape}",
        chunkd_steady,
        streaming_epoch.steady if streaming_epoch else None,
        "samples/s",
        "MosaicML Streaming 0.13, cold, one epoch",
        "every rank to the end of its epoch (one epoch each: a rate over every sample of "
        "it); every id read and its text checked" + cache_note + decoded,
        unavailable=why,
        target_ratio=2.0,
    )
    _row(
        report,
        f"steady samples/s, {shape}: pyarrow",
        chunkd_steady,
        parquet_epoch.steady,
        "samples/s",
        "pyarrow + s3fs straight from S3, one epoch",
        f"every id read and its text checked; {parquet_epoch.gets} GETs under parquet/",
        target_ratio=1.0,
    )
    if figures:
        units = layout.files * layout.row_groups
        epoch_decodes = _DECODES.get("chunkd-epoch", {})
        decodes = sum(
            epoch_decodes.get(f'chunkd_dataset_decodes_total{{where="{where}"}}', 0.0)
            for where in ("daemon", "reader")
        )
        report.add(
            Result(
                f"units decoded per unit per node, {shape}, one epoch",
                decodes / units,
                1.0,
                "decodes",
                "once per node",
                better="lower",
                note=(
                    f"the cold epoch job's decodes (by the daemon and, where it declined, by "
                    f"the readers in-process) over its {units} row groups" + decoded
                ),
            )
        )


def _readers_text(job: str) -> str:
    """A chunkd job's first-batch phases as its readers reported them to the daemon."""
    phases = _PHASES.get(job)
    if not phases:
        return ""
    shown = ", ".join(
        f"{p.replace('_', ' ')} {phases[p]:.2f}s"
        for p in ("metadata", "worker_start", "first_chunk", "decode")
        if p in phases
    )
    return f"; chunkd's readers' own breakdown (the mean of its 8 readers): {shown}"


def _decodes_text(found: dict[str, float]) -> str:
    """A job's decode metrics, as the notes give them."""

    def got(name: str) -> float:
        return found.get(name, 0.0)

    declined = sum(v for k, v in found.items() if k.startswith("chunkd_dataset_decode_declined"))
    daemon = got('chunkd_dataset_decodes_total{where="daemon"}')
    reader = got('chunkd_dataset_decodes_total{where="reader"}')
    return (
        f"daemon {daemon:.0f}, in-process {reader:.0f}, "
        f"repeats {got('chunkd_dataset_decode_repeats_total'):.0f}, "
        f"hits {got('chunkd_dataset_decode_hits_total'):.0f}, "
        f"waits {got('chunkd_dataset_decode_waits_total'):.0f}, declined {declined:.0f}, "
        f"evicted {got('chunkd_dataset_decoded_evicted_total'):.0f}, "
        f"peak held {got('peak') / MiB:.0f} of {got('budget') / MiB:.0f} MiB"
    )


def _breakdown(report: Report, shape: str, jobs: dict[str, Job | None]) -> None:
    """The plot of where each contender's slowest rank spent its time to first batch
    (the median job of each case), imports included as the first segment."""
    figure = f"time to first batch, {shape}: the slowest rank's phases"
    for label, job in jobs.items():
        if job is not None:
            report.stack(figure, label, job.phases(), "s")


def main() -> None:
    """A rank of the pyarrow + s3fs baseline (the bench starts it)."""
    parser = argparse.ArgumentParser(prog="python -m bench.ttfb_bench")
    commands = parser.add_subparsers(dest="command", required=True)
    rank = commands.add_parser("parquet-rank", help="one rank of the pyarrow + s3fs job")
    rank.add_argument("--endpoint", required=True)
    rank.add_argument("--url", required=True)
    rank.add_argument("--batch-size", type=int, required=True)
    rank.add_argument("--workers", type=int, required=True)
    rank.add_argument("--seed", type=int, required=True)
    rank.add_argument("--max-batches", type=int, default=0)
    rank.add_argument("--ids-out", required=True)
    ours = commands.add_parser("chunkd-rank", help="one rank of the chunkd job")
    ours.add_argument("--socket", required=True)
    ours.add_argument("--ref", required=True)
    for name in ("--batch-size", "--workers", "--seed"):
        ours.add_argument(name, type=int, required=True)
    ours.add_argument("--max-batches", type=int, default=0)
    ours.add_argument("--ids-out", required=True)
    options = parser.parse_args()
    if options.command == "chunkd-rank":
        _chunkd_rank(options)
    else:
        _parquet_rank(options)


if __name__ == "__main__":
    main()
