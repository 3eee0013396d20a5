"""The trainer-side client against what a trainer would do instead.

1. A warm 256 MiB object into a torch tensor: chunkd's zero-copy view against
   ``np.fromfile`` of the same bytes from a page-cached local file, and against the
   HTTP path. Also with every byte touched (a sum), so lazy mapping gets no credit.
2. Warm 4 KiB random reads from a 1 GiB object, one process: against ``os.pread``
   on a page-cached local file, and against HTTP range requests.
3. 8 processes reading the same 1 GiB: the node's memory (sum of PSS) against 8
   private copies.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from chunkd.client import Client

from .daemon import BenchDaemon
from .report import Report, Result, Rounds

MiB = 1 << 20


def _tensor(view: memoryview) -> Any:
    try:
        import torch
    except ImportError:  # numpy stands in where torch is not installed
        return np.frombuffer(view, dtype=np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only memory: never written
        return torch.frombuffer(view, dtype=torch.uint8)


def _from_file(path: Path) -> Any:
    array = np.fromfile(path, dtype=np.uint8)
    try:
        import torch
    except ImportError:
        return array
    return torch.from_numpy(array)


def _total(tensor: Any) -> int:
    return int(tensor.sum())


def _interleaved(rounds: int, sides: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
    """Every side once untimed, then ``rounds`` rounds rotating their order (as
    :func:`bench.report.interleave` does); each side's seconds per round."""
    names = list(sides)
    for name in names:
        sides[name]()
    took: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            start = time.perf_counter()
            sides[name]()
            took[name].append(time.perf_counter() - start)
    return took


def _rates(amount: float, seconds: list[float]) -> list[float]:
    return [amount / s for s in seconds]


_PSS_READER = textwrap.dedent(
    """
    import os, sys, time
    mode, target = sys.argv[1], sys.argv[2]
    if mode == "chunkd":
        from chunkd.client import Client
        client = Client(target)
        view = client.read("local/gig.bin")
        total = 0
        for i in range(0, len(view), 4096):
            total += view[i]
    else:
        with open(target, "rb") as f:
            data = bytearray(f.read())
    print("ready", flush=True)
    sys.stdin.readline()
    """
)


def _pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def _eight_processes(mode: str, target: str) -> int:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PSS_READER, mode, target],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a reader process failed")
        return sum(_pss_kib(p.pid) for p in procs) * 1024
    finally:
        for p in procs:
            assert p.stdin is not None
            assert p.stdout is not None
            p.stdin.close()
            p.wait(timeout=60)
            p.stdout.close()


def _sizes(
    report: Report, client: Client, daemon: BenchDaemon, path: Path, big: int, *, quick: bool
) -> None:
    """Warm reads of the first N bytes of ``path`` (``local/big.bin``), N from 64 KiB to
    ``big``, for the plot of throughput against size: each contender repeats a read
    until about 16 MiB are read, 3 rounds, the median."""
    name = "local/big.bin"
    sizes = [s for s in (64 << 10, MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB) if s <= big]
    if quick:
        sizes = [64 << 10, MiB, big]
    buffer = bytearray(big)
    rounds = report.rounds_for(1 if quick else 3)
    points: dict[str, dict[int, float]] = {}
    for n in sizes:
        reps = max(1, 16 * MiB // n)
        window = memoryview(buffer)[:n]
        header = {"Range": f"bytes=0-{n - 1}"}

        def repeated(read: Callable[[], object], reps: int = reps) -> Callable[[], None]:
            def loop() -> None:
                for _ in range(reps):
                    read()

            return loop

        took = _interleaved(
            rounds,
            {
                "chunkd view (Client.read)": repeated(lambda n=n: _tensor(client.read(name, 0, n))),
                "Client.read_into a buffer": repeated(lambda w=window: client.read_into(name, w)),
                "np.fromfile, page cache": repeated(
                    lambda n=n: np.fromfile(path, dtype=np.uint8, count=n)
                ),
                "HTTP GET with Range": repeated(lambda h=header: daemon.http(name, h)),
            },
        )
        for label, seconds in took.items():
            points.setdefault(label, {})[n] = statistics.median(_rates(n * reps / 1e9, seconds))
    for label, by_size in points.items():
        report.sizes("client: warm read throughput against size", label, by_size, "GB/s")


def _latencies(
    client: Client, daemon: BenchDaemon, fd: int, offsets: list[int]
) -> dict[str, list[float]]:
    """Seconds of each warm 4 KiB read at ``offsets`` (HTTP: the first 300 of them)."""
    out: dict[str, list[float]] = {"chunkd Client.read": [], "os.pread, page cache": []}
    for off in offsets:
        start = time.perf_counter()
        client.read("local/gig.bin", off, 4096)
        out["chunkd Client.read"].append(time.perf_counter() - start)
    for off in offsets:
        start = time.perf_counter()
        os.pread(fd, 4096, off)
        out["os.pread, page cache"].append(time.perf_counter() - start)
    out["HTTP range GET"] = []
    for off in offsets[:300]:
        start = time.perf_counter()
        daemon.http("local/gig.bin", {"Range": f"bytes={off}-{off + 4095}"})
        out["HTTP range GET"].append(time.perf_counter() - start)
    return out


def run(report: Report, work: Path, *, quick: bool) -> None:
    """The client scenarios (``quick``: small objects, to check the bench runs)."""
    big = (16 if quick else 256) * MiB
    gig = (32 if quick else 1024) * MiB
    rounds = report.rounds_for(2 if quick else 5)  # each round is milliseconds: take 5
    data_dir = work / "chunkd-data"
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "big.bin").write_bytes(os.urandom(big))
    with (data_dir / "gig.bin").open("wb") as f:
        for _ in range(gig // (64 * MiB) or 1):
            f.write(os.urandom(min(gig, 64 * MiB)))
    gig = (data_dir / "gig.bin").stat().st_size
    daemon = BenchDaemon(
        work,
        {
            "CHUNKD_CACHE_RAM_BYTES": "3GiB",
            "CHUNKD_CACHE_DISK_BYTES": "4GiB",
            "CHUNKD_CACHE_FSYNC": "never",
            "CHUNKD_CACHE_DISK_MIN_FREE_BYTES": "0",
            "CHUNKD_BACKENDS_LOCAL_REVALIDATE": "immutable",
        },
    )
    try:
        client = Client(daemon.socket, cache_bytes=2 * (gig + big))
        client.read("local/big.bin")  # warm the daemon (and the client's mappings)
        client.read("local/gig.bin")
        np.fromfile(data_dir / "big.bin", dtype=np.uint8)  # and the page cache
        np.fromfile(data_dir / "gig.bin", dtype=np.uint8)

        print("client: warm object into a tensor", flush=True)
        took = _interleaved(
            rounds,
            {
                "ours": lambda: _tensor(client.read("local/big.bin")),
                "local": lambda: _from_file(data_dir / "big.bin"),
                "http": lambda: _tensor(memoryview(daemon.http("local/big.bin"))),
                "ours_sum": lambda: _total(_tensor(client.read("local/big.bin"))),
                "local_sum": lambda: _total(_from_file(data_dir / "big.bin")),
            },
        )
        gb = big / 1e9
        rates = {side: _rates(gb, seconds) for side, seconds in took.items()}
        med = {side: statistics.median(values) for side, values in rates.items()}
        mib = big // MiB
        report.add(
            Result(
                f"warm {mib} MiB into a tensor (chunkd view)",
                med["ours"],
                med["local"],
                "GB/s",
                "np.fromfile of a page-cached file",
                target_ratio=3.0,
                samples=Rounds.of(rates["ours"], rates["local"]),
                note="a zero-copy view over the chunks' sealed memfds, mapped contiguously",
            )
        )
        report.add(
            Result(
                f"warm {mib} MiB into a tensor, vs the HTTP path",
                med["ours"],
                med["http"],
                "GB/s",
                "HTTP GET of the object into a tensor",
                target_ratio=5.0,
                samples=Rounds.of(rates["ours"], rates["http"]),
            )
        )
        report.add(
            Result(
                f"warm {mib} MiB into a tensor, every byte summed",
                med["ours_sum"],
                med["local_sum"],
                "GB/s",
                "np.fromfile, then the same sum",
                samples=Rounds.of(rates["ours_sum"], rates["local_sum"]),
                note="touching every byte: mapping pages are faulted in, no credit for laziness",
            )
        )
        _sizes(report, client, daemon, data_dir / "big.bin", big, quick=quick)

        print("client: 4 KiB random reads", flush=True)
        rng = random.Random(5)
        offsets = [rng.randrange(0, gig - 4096) // 4096 * 4096 for _ in range(20_000)]
        http_offsets = offsets[:500]
        fd = os.open(data_dir / "gig.bin", os.O_RDONLY)
        try:
            for off in offsets[:2000]:
                client.read("local/gig.bin", off, 4096)

            def chunkd_reads() -> None:
                for off in offsets:
                    client.read("local/gig.bin", off, 4096)

            def pread_reads() -> None:
                for off in offsets:
                    os.pread(fd, 4096, off)

            def http_reads() -> None:
                for o in http_offsets:
                    daemon.http("local/gig.bin", {"Range": f"bytes={o}-{o + 4095}"})

            took = _interleaved(
                rounds, {"ours": chunkd_reads, "local": pread_reads, "http": http_reads}
            )
            latencies = _latencies(client, daemon, fd, offsets[: 2000 if quick else 5000])
        finally:
            os.close(fd)
        ours = _rates(len(offsets), took["ours"])
        local = _rates(len(offsets), took["local"])
        http = _rates(len(http_offsets), took["http"])
        figure = "client: latency of a warm 4 KiB random read"
        for label, seconds in latencies.items():
            report.latencies(figure, label, seconds)
        report.add(
            Result(
                "warm 4 KiB random reads, one process",
                statistics.median(ours),
                statistics.median(local),
                "ops/s",
                "os.pread on a page-cached file",
                target_ratio=1.0,
                samples=Rounds.of(ours, local),
                note="a read inside chunks the client has mapped needs no system call",
            )
        )
        report.add(
            Result(
                "warm 4 KiB random reads, vs the HTTP path",
                statistics.median(ours),
                statistics.median(http),
                "ops/s",
                "HTTP range GETs on loopback",
                target_ratio=10.0,
                samples=Rounds.of(ours, http),
            )
        )
        client.close()

        print("client: 8 processes, memory", flush=True)
        shared, private = [], []
        for _ in range(report.rounds_for(1 if quick else 3)):
            shared.append(_eight_processes("chunkd", daemon.socket) / MiB)
            private.append(_eight_processes("private", str(data_dir / "gig.bin")) / MiB)
        report.add(
            Result(
                f"8 processes holding the same {gig // MiB} MiB: sum of PSS",
                statistics.median(shared),
                statistics.median(private),
                "MiB",
                "8 private copies (read into a bytearray each)",
                samples=Rounds.of(shared, private),
                note="the chunks' pages are shared: each process is charged 1/8 of them",
            )
        )
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
