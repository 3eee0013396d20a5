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
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from chunkd.client import Client

from .daemon import BenchDaemon
from .report import Report, Result

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


def _best(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


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


def run(report: Report, work: Path, *, quick: bool) -> None:
    """The client scenarios (``quick``: small objects, to check the bench runs)."""
    big = (16 if quick else 256) * MiB
    gig = (32 if quick else 1024) * MiB
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
        ours = _best(lambda: _tensor(client.read("local/big.bin")), 5)
        local = _best(lambda: _from_file(data_dir / "big.bin"), 5)
        http = _best(lambda: _tensor(memoryview(daemon.http("local/big.bin"))), 3)
        ours_sum = _best(lambda: _total(_tensor(client.read("local/big.bin"))), 3)
        local_sum = _best(lambda: _total(_from_file(data_dir / "big.bin")), 3)
        gb = big / 1e9
        mib = big // MiB
        report.add(
            Result(
                f"warm {mib} MiB into a tensor (chunkd view)",
                gb / ours,
                gb / local,
                "GB/s",
                "np.fromfile of a page-cached file",
                target_ratio=3.0,
                note="a zero-copy view over the chunks' sealed memfds, mapped contiguously",
            )
        )
        report.add(
            Result(
                f"warm {mib} MiB into a tensor, vs the HTTP path",
                gb / ours,
                gb / http,
                "GB/s",
                "HTTP GET of the object into a tensor",
                target_ratio=5.0,
            )
        )
        report.add(
            Result(
                f"warm {mib} MiB into a tensor, every byte summed",
                gb / ours_sum,
                gb / local_sum,
                "GB/s",
                "np.fromfile, then the same sum",
                note="touching every byte: mapping pages are faulted in, no credit for laziness",
            )
        )

        print("client: 4 KiB random reads", flush=True)
        rng = random.Random(5)
        offsets = [rng.randrange(0, gig - 4096) // 4096 * 4096 for _ in range(20_000)]
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

            ours = _best(chunkd_reads, 3)
            local = _best(pread_reads, 3)
        finally:
            os.close(fd)
        http_offsets = offsets[:500]
        http = _best(
            lambda: [
                daemon.http("local/gig.bin", {"Range": f"bytes={o}-{o + 4095}"})
                for o in http_offsets
            ],
            2,
        )
        report.add(
            Result(
                "warm 4 KiB random reads, one process",
                len(offsets) / ours,
                len(offsets) / local,
                "ops/s",
                "os.pread on a page-cached file",
                target_ratio=1.0,
                note="a read inside chunks the client has mapped needs no system call",
            )
        )
        report.add(
            Result(
                "warm 4 KiB random reads, vs the HTTP path",
                len(offsets) / ours,
                len(http_offsets) / http,
                "ops/s",
                "HTTP range GETs on loopback",
                target_ratio=10.0,
            )
        )
        client.close()

        print("client: 8 processes, memory", flush=True)
        shared = _eight_processes("chunkd", daemon.socket)
        private = _eight_processes("private", str(data_dir / "gig.bin"))
        report.add(
            Result(
                f"8 processes holding the same {gig // MiB} MiB: sum of PSS",
                shared / MiB,
                private / MiB,
                "MiB",
                "8 private copies (read into a bytearray each)",
                note="the chunks' pages are shared: each process is charged 1/8 of them",
            )
        )
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
