"""Datasets: registration against reading every footer directly, and the read order's
locality against a full random permutation.

1. **Registration**: ``chunkd dataset register`` of N small Parquet files in a
   ``file://`` backend (100,000 files), through a fresh daemon,
   against the same footers read straight from the disk with ``pyarrow.parquet.
   read_metadata`` at the same concurrency (what a user who indexes a dataset by hand
   does), 3 rounds (``--quick``: 1), a cold daemon each, the sides' order alternating;
   target 0.8x. The figure is files per second; the note gives the daemon's CPU a file,
   the register process's peak memory and the anchor DVC reports (600,000 files in
   6-8 h: about 25 files/s). (500 files with ``--quick``.) The full bench registers
   1,000,000 files once more: their rate and the peak memory. Then the same scan from
   S3 (moto's server; 2,000 files, ``--quick``: 100) against pyarrow's S3FileSystem.
2. **Order locality**: over the epoch order of a Parquet-like snapshot of 1,000 files
   of 8 row groups, chunkd's windowed order against a full random permutation: the
   row groups (and files) a reader holds open over 100,000 rows, and the mean distance
   between adjacent samples in the snapshot; one seed a round (3 seeds).
3. **What a large manifest's commit costs** (issue 24): ``ds_commit`` of a legitimate
   WebDataset-like manifest (the densest kind: an entry per sample) of 64 and 240 MiB
   (``--quick``: 4 MiB) through a real daemon, which checks it in a worker process,
   against the same bytes parsed in one process with ``Snapshot.parse`` (what the daemon
   did on its own heap and event loop before). The note gives the daemon's RSS growth,
   the worker's peak, and ``/healthz``'s slowest answer meanwhile.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .daemon import BenchDaemon
from .report import Report, Result, Rounds

__all__ = ["run"]

_CONCURRENCY = 8


def _write_parquet(root: Path, files: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for i in range(files):
        folder = root / f"{i // 1000:04d}"
        if i % 1000 == 0:
            folder.mkdir(parents=True, exist_ok=True)
        table = pa.table(
            {
                "id": pa.array(range(i * 20, i * 20 + 20), pa.int64()),
                "text": pa.array([f"sample {i}-{j}" for j in range(20)]),
            }
        )
        pq.write_table(table, folder / f"part-{i:06d}.parquet", row_group_size=10)


def _footers_directly(root: Path) -> tuple[int, float]:
    import pyarrow.parquet as pq

    paths = sorted(root.rglob("*.parquet"))
    started = time.perf_counter()
    with ThreadPoolExecutor(_CONCURRENCY) as pool:
        rows = sum(pool.map(lambda p: pq.read_metadata(p).num_rows, paths))
    elapsed = time.perf_counter() - started
    assert rows == len(paths) * 20
    return len(paths), elapsed


def _register(daemon: BenchDaemon, name: str) -> tuple[dict[str, object], int, float]:
    """One ``chunkd dataset register`` in a process of its own: its JSON report, its
    peak memory (KiB) and its CPU seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    env["CHUNKD_SOCKET"] = daemon.socket
    # The peak memory of the registering process, from its own /proc status at exit.
    code = (
        "import sys, re\n"
        "from chunkd.gateway.cli import main\n"
        "status = main(sys.argv[1:])\n"
        "hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
        "print('HWM', hwm, file=sys.stderr)\n"
        "raise SystemExit(status)\n"
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "dataset",
            "register",
            name,
            "local/pq/",
            "--format",
            "parquet",
            "--concurrency",
            str(_CONCURRENCY),
            "--json",
            "--quiet",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"chunkd dataset register failed: {done.stderr[-2000:]}")
    found = re.search(r"HWM (\d+)", done.stderr)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return json.loads(done.stdout), int(found.group(1)) if found else 0, cpu


def _cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _registration(report: Report, work: Path, *, quick: bool) -> None:
    """chunkd's registration against pyarrow reading the same footers, 100,000 files
    (``--quick``: 500), 3 rounds (1), paired per round; where the time goes in the note
    (the daemon's CPU a file, the registering process's peak memory)."""
    files = 500 if quick else 100_000
    data = work / "chunkd-data" / "pq"
    _write_parquet(data, files)
    rounds = report.rounds_for(1 if quick else 3)
    ours, theirs, peaks, daemon_cpu, client_cpu = [], [], [], [], []
    for r in range(rounds):
        # A cold daemon each round (its cache and the registry start empty), and the
        # page cache warm for both sides: the footers are read from memory either way.
        shutil.rmtree(work / "chunkd-cache", ignore_errors=True)
        shutil.rmtree(work / "chunkd-data" / "datasets", ignore_errors=True)
        daemon = BenchDaemon(work, {})
        try:
            cpu = _cpu_seconds(daemon.process.pid)
            if r % 2:
                counted, seconds = _footers_directly(data)
                result, peak, spent = _register(daemon, f"bench/pq{r}")
            else:
                result, peak, spent = _register(daemon, f"bench/pq{r}")
                counted, seconds = _footers_directly(data)
            daemon_cpu.append((_cpu_seconds(daemon.process.pid) - cpu) / files)
            client_cpu.append(spent / files)
        finally:
            daemon.stop()
        assert result["members"] == files == counted
        ours.append(float(result["files_per_second"]))  # type: ignore[arg-type]
        theirs.append(counted / seconds)
        peaks.append(peak)
    samples = Rounds.of(ours, theirs)  # paired by round, before sorting
    ratios = sorted(samples.ratios())
    ours.sort()
    theirs.sort()
    report.add(
        Result(
            f"register {files:,} small Parquet files (file://, {_CONCURRENCY} at once)",
            ours[len(ours) // 2],
            theirs[len(theirs) // 2],
            "files/s",
            "pyarrow read_metadata of every file, same concurrency",
            target_ratio=0.8,
            samples=samples,
            note=(
                f"ratio per round {ratios[0]:.2f}-{ratios[-1]:.2f}; "
                f"chunkd reads each batch's footers through the daemon in one readv that "
                f"the daemon does not keep (keep=false; file://: one thread hop a batch) "
                f"and writes the snapshot's pages; CPU a file: the daemon's "
                f"{statistics.median(daemon_cpu) * 1e6:.0f} us, the registering "
                f"process's {statistics.median(client_cpu) * 1e6:.0f} us; "
                f"peak memory of the registering process {max(peaks) / 1024:.0f} MiB; "
                f"DVC's anchor: 600k files in 6-8 h, about 25 files/s "
                f"({ours[len(ours) // 2] / 25:.0f}x that)"
            ),
        )
    )
    if not quick:
        shutil.rmtree(data, ignore_errors=True)
        _registration_at(report, work, 1_000_000)


def _registration_at(report: Report, work: Path, files: int) -> None:
    """One registration of ``files`` small Parquet files (the full bench: 1M): its rate
    and the registering process's peak memory, against pyarrow's footers once."""
    data = work / "chunkd-data" / "pq"
    print(f"datasets: writing {files:,} Parquet files", flush=True)
    _write_parquet(data, files)
    shutil.rmtree(work / "chunkd-cache", ignore_errors=True)
    shutil.rmtree(work / "chunkd-data" / "datasets", ignore_errors=True)
    daemon = BenchDaemon(work, {})
    try:
        cpu = _cpu_seconds(daemon.process.pid)
        result, peak, spent = _register(daemon, "bench/pq-large")
        daemon_cpu = (_cpu_seconds(daemon.process.pid) - cpu) / files
    finally:
        daemon.stop()
    counted, seconds = _footers_directly(data)
    assert result["members"] == files == counted
    report.add(
        Result(
            f"register {files:,} small Parquet files (file://, {_CONCURRENCY} at once)",
            float(result["files_per_second"]),  # type: ignore[arg-type]
            counted / seconds,
            "files/s",
            "pyarrow read_metadata of every file, same concurrency",
            note=(
                f"one round; CPU a file: the daemon's {daemon_cpu * 1e6:.0f} us, the "
                f"registering process's {spent / files * 1e6:.0f} us; "
                f"peak memory of the registering process {peak / 1024:.0f} MiB "
                f"({peak * 1024 / files:.0f} bytes a file): the members go through a spill "
                "file into pages, never all in memory"
            ),
        )
    )
    shutil.rmtree(data, ignore_errors=True)


def _registration_s3(report: Report, work: Path, *, quick: bool) -> None:
    """Registration's reads from S3 (moto's server, the latency of a real request
    handler): chunkd's scan of N files against pyarrow reading the same footers through
    its S3 file system, both 8 at once; the scan keeps its window of files in flight."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    from chunkd.client import Client
    from chunkd.client.datasets.register import WINDOW, scan_prefix
    from chunkd.testing import S3Server, s3_backend

    files = 100 if quick else 2_000
    local = work / "s3-source"
    _write_parquet(local, files)
    paths = sorted(local.rglob("*.parquet"))
    server = S3Server.start()
    try:
        bucket = "bench-register"
        s3 = server.client()
        s3.create_bucket(Bucket=bucket)
        for path in paths:
            s3.put_object(
                Bucket=bucket, Key=f"pre/{path.relative_to(local)}", Body=path.read_bytes()
            )
        fs = pafs.S3FileSystem(
            access_key="testing",
            secret_key="testing-secret",
            endpoint_override=server.endpoint,
            scheme="http",
            region="us-east-1",
        )
        keys = [f"{bucket}/pre/{path.relative_to(local)}" for path in paths]
        ours, theirs = [], []
        for r in range(report.rounds_for(1 if quick else 3)):
            config = work / "s3.toml"
            config.write_text(
                f'[cache]\ndir = "{work / "s3-cache"}"\nram_bytes = "256MiB"\n'
                f'disk_bytes = "1GiB"\ndisk_min_free_bytes = 0\n\n'
                + s3_backend("s3", f"s3://{bucket}/pre", server.endpoint, timeout="30s")
            )
            shutil.rmtree(work / "s3-cache", ignore_errors=True)
            daemon = BenchDaemon(work / "s3-node", {}, config)
            try:
                started = time.perf_counter()
                with Client(daemon.socket, timeout=600) as client:
                    got = scan_prefix(client, "s3/", fmt="parquet", concurrency=_CONCURRENCY)
                ours.append(files / (time.perf_counter() - started))
                assert len(got.members) == files
            finally:
                daemon.stop()
            started = time.perf_counter()
            with ThreadPoolExecutor(_CONCURRENCY) as pool:
                rows = sum(pool.map(lambda k: pq.read_metadata(k, filesystem=fs).num_rows, keys))
            theirs.append(files / (time.perf_counter() - started))
            assert rows == files * 20
            del r
    finally:
        server.stop()
        shutil.rmtree(local, ignore_errors=True)
    report.add(
        Result(
            f"scan {files:,} small Parquet files from S3 (moto, {_CONCURRENCY} at once)",
            statistics.median(ours),
            statistics.median(theirs),
            "files/s",
            "pyarrow read_metadata through its S3FileSystem, same concurrency",
            samples=Rounds.of(ours, theirs),
            note=(
                f"chunkd keeps {WINDOW * _CONCURRENCY} files in flight, each batch's footers "
                "read by the daemon at once (one GET a file, the version with its bytes)"
            ),
        )
    )


def _locality(report: Report, *, quick: bool) -> None:
    """The order's locality over one seed per round: the spread is over seeds (the
    figures of one seed are the same every run)."""
    from chunkd.client.datasets.order import Order, quality

    # Parquet-like: files of 8 row groups of 125 rows, 8 MiB decoded each (the window is
    # bounded by its 16 units, not by bytes), against a full shuffle of every row.
    files, groups, rows = (100, 8, 125) if quick else (1000, 8, 125)
    counts = [groups * rows] * files
    units = [[rows] * groups] * files
    costs = [[8 << 20] * groups] * files
    snapshot = "0" * 64
    run = min(files * groups * rows, 100_000)
    held: tuple[list[float], list[float]] = ([], [])
    for seed in range(1, report.rounds_for(1 if quick else 3) + 1):
        ours = Order(counts, snapshot=snapshot, seed=seed, epoch=0, units=units, unit_bytes=costs)
        full = Order(
            counts,
            snapshot=snapshot,
            seed=seed,
            epoch=0,
            window=None,
            window_bytes=None,
            units=units,
            unit_bytes=costs,
        )
        got = quality(ours, 0, run), quality(full, 0, run)
        if seed == 1:
            windowed, uniform = got  # the note's figures: seed 1's
        held[0].append(float(got[0].units_held))
        held[1].append(float(got[1].units_held))
    report.add(
        Result(
            f"order: row groups held open over {run:,} rows ({files} files x {groups} groups)",
            statistics.median(held[0]),
            statistics.median(held[1]),
            "groups",
            "a full random permutation",
            samples=Rounds.of(*held),
            note=(
                f"seeds 1-{len(held[0])}, one a round; "
                "lower is better: the decoded row groups a reader must hold to decode each "
                "once (chunkd mixes rows within windows of 16 row groups, at most 256 MiB "
                f"decoded); seed 1: files held: {windowed.members_held} against "
                f"{uniform.members_held}. Mean distance between adjacent samples, in "
                f"snapshot indices: {windowed.mean_gap:,.0f} for chunkd, "
                f"{uniform.mean_gap:,.0f} for the full shuffle "
                f"({windowed.mean_gap / max(uniform.mean_gap, 1e-9):.2f} of it; in order: 1)"
            ),
        )
    )


def _manifest_fd(target: int) -> tuple[int, int]:
    """A sealed memfd holding a valid manifest of about ``target`` bytes, written member
    by member (never whole in this process's heap): WebDataset-like members of 200
    samples of two files each. Returns the fd and the member count."""
    from chunkd import memfd

    def member(i: int) -> bytes:
        index = [
            [
                f"shard/sample{j:06d}",
                [["jpg", 1024 + j * 4096, 1578 + j], ["cls", 3584 + j * 4096, 1]],
            ]
            for j in range(200)
        ]
        entry = {
            "format": "wds",
            "key": f"wds/{i // 1000:04d}/part-{i:06d}.tar",
            "meta": {"index": index},
            "samples": 200,
            "size": 819_200,
            "version": f'"{i:x}-5f3a1c2b-c8000"',
        }
        return json.dumps(entry, sort_keys=True, separators=(",", ":")).encode()

    one = len(member(0)) + 1
    count = max(1, target // one)
    head = b'{"excluded":[],"format":"wds","members":['
    tail = (
        f'],"schema":1,"schema_of":null,"source":{{"backend":"local","prefix":"wds/"}},'
        f'"totals":{{"bytes":{count * 819_200},"members":{count},"samples":{count * 200}}}}}'
    ).encode()
    fd = memfd.create("bench-manifest")
    at = 0
    pieces = [head]
    for i in range(count):
        pieces.append(member(i) + (b"," if i + 1 < count else b""))
        if len(pieces) >= 512 or i + 1 == count:
            block = b"".join(pieces)
            memfd.write_at(fd, block, at)
            at += len(block)
            pieces = []
    memfd.write_at(fd, tail, at)
    memfd.seal(fd)
    return fd, count


def _in_one_process(fd: int) -> tuple[float, int]:
    """``Snapshot.parse`` of the manifest in ``fd`` in a fresh process: its seconds and
    its memory growth (VmHWM), what the daemon paid on its own before issue 24."""
    code = (
        "import os, re, sys, time\n"
        "from chunkd.snapshot import Snapshot\n"
        "data = os.pread(0, os.fstat(0).st_size, 0)\n"
        "status = lambda: open('/proc/self/status').read()\n"
        "base = int(re.search(r'VmRSS:\\s+(\\d+)', status()).group(1))\n"
        "started = time.perf_counter()\n"
        "Snapshot.parse(data)\n"
        "took = time.perf_counter() - started\n"
        "hwm = int(re.search(r'VmHWM:\\s+(\\d+)', status()).group(1))\n"
        "print(took, (hwm - base) * 1024)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], stdin=fd, capture_output=True, text=True, check=True
    )
    took, grew = done.stdout.split()
    return float(took), int(grew)


def _commit_cost(report: Report, work: Path, *, quick: bool) -> None:
    from chunkd.client import Client

    sizes = [4] if quick else [64, 240]
    for size in sizes:
        fd, members = _manifest_fd(size << 20)
        try:
            total = os.fstat(fd).st_size
            ours, theirs, grown, own, peaks, slowest, held = [], [], [], [], [], [], []
            for r in range(report.rounds_for(1)):
                shutil.rmtree(work / "chunkd-data" / "datasets", ignore_errors=True)
                daemon = BenchDaemon(work, {})
                watch = _Watch(daemon)
                try:
                    with Client(daemon.socket) as client:
                        started = time.perf_counter()
                        client.request("ds_commit", {"name": f"bench/m{r}"}, fds=[fd], timeout=None)
                        ours.append(time.perf_counter() - started)
                finally:
                    watch.stop()
                    daemon.stop()
                log = (work / "daemon.log").read_text(errors="replace")
                found = re.findall(r"checked in a worker in [\d.]+s, peak (\d+) MiB", log)
                peaks.append(int(found[-1]) if found else 0)
                grown.append(max(0, watch.peak - watch.base))
                own.append(max(0, watch.anon_peak - watch.anon_base))
                slowest.append(watch.slowest)
                took, grew = _in_one_process(fd)
                theirs.append(took)
                held.append(grew)
        finally:
            os.close(fd)
        samples = Rounds.of(ours, theirs)
        report.add(
            Result(
                f"commit a {total / 2**20:.0f} MiB manifest ({members:,} WebDataset-like members)",
                statistics.median(ours),
                statistics.median(theirs),
                "s",
                "Snapshot.parse of the same bytes in one process (the daemon's own, before)",
                samples=samples,
                better="lower",
                note=(
                    f"while it committed, the daemon's own memory (RssAnon) grew "
                    f"{max(own) / 2**20:.0f} MiB, its RSS {max(grown) / 2**20:.0f} MiB (the "
                    f"client's memfd pages, mapped while they were stored), and /healthz's "
                    f"slowest answer was {max(slowest):.2f}s; the worker's peak: {max(peaks)} "
                    f"MiB ({max(peaks) * 2**20 / total:.1f}x the manifest). A parse in one "
                    f"process grew it {max(held) / 2**20:.0f} MiB ({max(held) / total:.1f}x): "
                    "the daemon's own heap and GIL paid that before"
                ),
            )
        )


class _Watch:
    """In a thread, a daemon's peak RSS and ``/healthz``'s slowest answer, every 50 ms."""

    def __init__(self, daemon: BenchDaemon) -> None:
        self.daemon = daemon
        self.base = self.peak = _rss(daemon.process.pid)
        self.anon_base = self.anon_peak = _rss(daemon.process.pid, "RssAnon")
        self.slowest = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            started = time.monotonic()
            with urllib.request.urlopen(f"{self.daemon.url}/healthz", timeout=30):
                pass
            self.slowest = max(self.slowest, time.monotonic() - started)
            self.peak = max(self.peak, _rss(self.daemon.process.pid))
            self.anon_peak = max(self.anon_peak, _rss(self.daemon.process.pid, "RssAnon"))
            self._done.wait(0.05)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(60)


def _rss(pid: int, field: str = "VmRSS") -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(rf"{field}:\s+(\d+) kB", status)
    return int(found.group(1)) * 1024 if found else 0


def run(report: Report, work: Path, *, quick: bool) -> None:
    """The scenarios (see the module docstring)."""
    work.mkdir(parents=True, exist_ok=True)
    try:
        _registration(report, work, quick=quick)
        _registration_s3(report, work, quick=quick)
        _locality(report, quick=quick)
        _commit_cost(report, work / "commit", quick=quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)
