"""The trainer-side client against what a trainer would do instead.

1. A warm 256 MiB object into a torch tensor: chunkd's zero-copy view against
   ``np.fromfile`` of the same bytes from a page-cached local file, and against the
   HTTP path. Also with every byte touched (a sum), so lazy mapping gets no credit.
2. Warm 4 KiB random reads from a 1 GiB object, one process: against ``os.pread``
   on a page-cached local file, and against HTTP range requests.
3. 8 processes reading the same 1 GiB: the node's memory (sum of PSS) against 8
   private copies.
4. Warm views and page sizes: a warm 96 MiB ``Client.read`` with every page touched
   (and with every byte summed), against ``np.fromfile``, with the RAM tier's memfds in
   4 KiB pages (``shmem_enabled=never``) and in 2 MiB pages (``advise``, set for the
   run and put back after, even on error; needs root), each with demand faults and
   with ``MADV_POPULATE_READ``; the cost of a fault per 4 KiB page, and whether the
   huge pages really happened (``ShmemHugePages``, ``ShmemPmdMapped``).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import random
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from chunkd.cache.ram import shmem_huge_pages
from chunkd.client import Client
from chunkd.memfd import libc

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


_SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
_MADV_POPULATE_READ = 22
#: the size of the warm-views scenario (the issue's figure)
_VIEW_BYTES = 96 * MiB


def _selected_mode() -> str | None:
    try:
        text = _SHMEM_ENABLED.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


@contextlib.contextmanager
def _shmem_enabled(mode: str) -> Iterator[bool]:
    """``shmem_enabled`` set to ``mode`` for the block and put back after, whatever
    happens in it; yields False (and changes nothing) where it cannot be set."""
    before = _selected_mode()
    if before is None:
        yield False
        return
    try:
        _SHMEM_ENABLED.write_text(mode)
    except OSError:
        yield False
        return
    try:
        yield True
    finally:
        _SHMEM_ENABLED.write_text(before)


def _meminfo_kib(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(f"{key}:"):
                return int(line.split()[1])
    return 0


def _pmd_mapped_kib() -> int:
    """This process's shared memory mapped as huge pages (``ShmemPmdMapped``)."""
    total = 0
    with open(f"/proc/{os.getpid()}/smaps") as f:
        for line in f:
            if line.startswith("ShmemPmdMapped:"):
                total += int(line.split()[1])
    return total


def _touch(view: Any) -> int:
    """One byte of every 4 KiB page: each page faulted in, nothing else paid for."""
    return int(np.frombuffer(view, dtype=np.uint8)[::4096].sum())


def _populate(view: memoryview) -> None:
    """``MADV_POPULATE_READ`` over the view's pages: every page mapped in one call."""
    address = np.frombuffer(view, dtype=np.uint8).ctypes.data
    start = address // mmap.PAGESIZE * mmap.PAGESIZE
    if libc().madvise(start, address + len(view) - start, _MADV_POPULATE_READ) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"MADV_POPULATE_READ failed: {os.strerror(err)}")


def _warm_views(report: Report, client: Client, data_dir: Path, *, quick: bool) -> None:
    """The warm 96 MiB view against ``np.fromfile``, in 4 KiB and in 2 MiB shmem pages.

    Each setting has its own object (other bytes, so other chunks), loaded into the
    daemon while ``shmem_enabled`` is that setting's: ``never`` (4 KiB pages, as a
    default kernel), ``advise`` (the RAM tier allocates through an advised, aligned
    mapping: 2 MiB pages). The reads are interleaved, each under its own setting (set
    before the timer starts); the setting found is put back at the end.
    """
    print("client: warm views, 4 KiB and 2 MiB pages", flush=True)
    pages = _VIEW_BYTES // 4096
    names = {"4k": "view-4k.bin", "2m": "view-2m.bin"}
    modes = {"4k": "never", "2m": "advise"}
    for name in names.values():
        (data_dir / name).write_bytes(os.urandom(_VIEW_BYTES))
    local = data_dir / names["4k"]
    found: dict[str, dict[str, int]] = {}
    settings: list[str] = []
    for setting, name in names.items():
        with _shmem_enabled(modes[setting]) as ok:
            if not ok and setting == "2m":
                print("  2 MiB pages skipped: shmem_enabled cannot be set here (root?)")
                continue
            before = _meminfo_kib("ShmemHugePages")
            view = client.read(f"local/{name}")
            _touch(view)
            found[setting] = {
                "huge_pages_kib": _meminfo_kib("ShmemHugePages") - before,
                "pmd_mapped_kib": _pmd_mapped_kib(),
                "huge_allowed": int(shmem_huge_pages()),
            }
            del view
            settings.append(setting)
    for setting, seen in found.items():
        print(
            f"  {setting} ({modes[setting]}): ShmemHugePages +{seen['huge_pages_kib']} KiB "
            f"as the daemon loaded it, ShmemPmdMapped {seen['pmd_mapped_kib']} KiB in this "
            f"process with the view alive",
            flush=True,
        )
    np.fromfile(local, dtype=np.uint8)  # the page cache

    def sides(setting: str) -> dict[str, Callable[[], object]]:
        name = f"local/{names[setting]}"

        def touched(populate: bool) -> Callable[[], object]:
            def read() -> object:
                view = client.read(name)
                if populate:
                    _populate(view)
                return _touch(view)

            return read

        def summed(populate: bool) -> Callable[[], object]:
            def read() -> object:
                view = client.read(name)
                if populate:
                    _populate(view)
                return int(np.frombuffer(view, dtype=np.uint8).sum(dtype=np.uint64))

            return read

        return {
            f"{setting} map": lambda: client.read(name),
            f"{setting} touch": touched(False),
            f"{setting} touch populated": touched(True),
            f"{setting} sum": summed(False),
            f"{setting} sum populated": summed(True),
        }

    timed: dict[str, tuple[str | None, Callable[[], object]]] = {
        "fromfile touch": (None, lambda: _touch(np.fromfile(local, dtype=np.uint8))),
        "fromfile sum": (
            None,
            lambda: int(np.fromfile(local, dtype=np.uint8).sum(dtype=np.uint64)),
        ),
    }
    for setting in settings:
        for label, side in sides(setting).items():
            timed[label] = (modes[setting], side)
    took = _interleaved_under(report.rounds_for(5 if quick else 15), timed)
    gb = _VIEW_BYTES / 1e9
    rates = {label: _rates(gb, seconds) for label, seconds in took.items()}
    med = {label: statistics.median(seconds) for label, seconds in took.items()}
    words = {"4k": "4 KiB shmem pages (never)", "2m": "2 MiB pages (advise, MADV_HUGEPAGE)"}
    for setting in settings:
        seen = found[setting]
        checked = (
            f"ShmemHugePages +{seen['huge_pages_kib'] // 1024} MiB at load, "
            f"ShmemPmdMapped {seen['pmd_mapped_kib'] // 1024} MiB in the reader"
        )
        for how, base in (("touch", "fromfile touch"), ("sum", "fromfile sum")):
            what = "every page touched" if how == "touch" else "every byte summed"
            for populated in (False, True):
                label = f"{setting} {how}" + (" populated" if populated else "")
                faults = "MADV_POPULATE_READ" if populated else "demand faults"
                report.add(
                    Result(
                        f"warm 96 MiB view, {what}: {words[setting]}, {faults}",
                        statistics.median(rates[label]),
                        statistics.median(rates[base]),
                        "GB/s",
                        f"np.fromfile of a page-cached file ({what})",
                        target_ratio=3.0 if how == "touch" else None,
                        samples=Rounds.of(rates[label], rates[base]),
                        note=checked,
                    )
                )
        mapped = med[f"{setting} map"]
        # against what a page of np.fromfile costs (read from the page cache, touched)
        per_file_page = [max(1e-6, s / pages * 1e6) for s in took["fromfile touch"]]
        per_page = {
            label: [max(1e-6, (s - mapped) / pages * 1e6) for s in took[f"{setting} {label}"]]
            for label in ("touch", "touch populated")
        }
        for label, figures in per_page.items():
            faults = "MADV_POPULATE_READ" if "populated" in label else "demand faults"
            report.add(
                Result(
                    f"warm 96 MiB view: fault cost per 4 KiB page, {words[setting]}, {faults}",
                    statistics.median(figures),
                    statistics.median(per_file_page),
                    "us/page",
                    "np.fromfile's cost per 4 KiB page (page cache read, touched)",
                    samples=Rounds.of(figures, per_file_page),
                    note=f"(touch - map) / {pages} pages; the map alone: {mapped * 1e3:.2f} ms",
                )
            )
        print(
            f"  {setting}: map {mapped * 1e3:.2f} ms, "
            f"touch {med[f'{setting} touch'] * 1e3:.2f} ms, "
            f"touch populated {med[f'{setting} touch populated'] * 1e3:.2f} ms, "
            f"sum {med[f'{setting} sum'] * 1e3:.2f} ms; np.fromfile "
            f"{med['fromfile touch'] * 1e3:.2f} ms, + sum {med['fromfile sum'] * 1e3:.2f} ms",
            flush=True,
        )


def _interleaved_under(
    rounds: int, sides: dict[str, tuple[str | None, Callable[[], object]]]
) -> dict[str, list[float]]:
    """:func:`_interleaved`, each side run under its ``shmem_enabled`` mode (None: as
    found), set before its timer starts and put back after the last round."""
    names = list(sides)
    took: dict[str, list[float]] = {name: [] for name in names}
    found = _selected_mode()
    try:
        for i in range(-1, rounds):  # round -1: every side once, untimed
            for name in names[i % len(names) :] + names[: i % len(names)]:
                mode, side = sides[name]
                want = mode or found
                if want is not None and want != _selected_mode():
                    _SHMEM_ENABLED.write_text(want)
                start = time.perf_counter()
                side()
                seconds = time.perf_counter() - start
                if i >= 0:
                    took[name].append(seconds)
    finally:
        if found is not None and found != _selected_mode():
            _SHMEM_ENABLED.write_text(found)
    return took


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
        client = Client(daemon.socket, cache_bytes=2 * (gig + big + 2 * _VIEW_BYTES))
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
        _warm_views(report, client, data_dir, quick=quick)

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
