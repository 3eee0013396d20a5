"""Sampling the soak's daemon: once a second its memory (footprint as the package
docstring counts it), fds and threads from ``/proc``, and its RAM tier from
``/v1/stats``, into a bounded :class:`SampleSeries`."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import urllib.request
from dataclasses import dataclass, fields
from typing import ClassVar

from chunkd.testing.soak.content import KiB

__all__ = ["DaemonSampler", "Sample", "SampleSeries", "sample_process"]

# -- sampling the daemon -----------------------------------------------------------------


@dataclass
class Sample:
    """The daemon at one moment (bytes unless named otherwise)."""

    #: seconds since the phase began
    t: float = 0.0
    #: what the daemon holds in all: ``process_bytes + memfd_bytes`` (see the package
    #: docstring)
    footprint: int = 0
    #: its own pages: ``pss - pss_shmem`` (private and file-backed, shares of libraries)
    process_bytes: int = 0
    pss: int = 0
    pss_shmem: int = 0
    rss: int = 0
    #: every memfd the daemon holds by an fd or a mapping, each once, at its allocated size
    memfd_bytes: int = 0
    #: of those, RAM-tier chunks and other memfds the daemon sealed (``/memfd:chunkd``)
    cache_memfd_bytes: int = 0
    #: of those, staged checkpoints handed over by clients (``/memfd:chunkd-checkpoint``)
    staged_memfd_bytes: int = 0
    #: distinct memfds held
    memfds: int = 0
    #: fds beyond the RAM tier's own count of chunks: connections, files, staged saves,
    #: chunks held by reads in flight after their eviction; 0 without a count
    untiered_fds: int = 0
    fds: int = 0
    #: fds that are memfds (several may name one memfd)
    memfd_fds: int = 0
    socket_fds: int = 0
    #: neither memfds nor sockets (files, pipes, eventfds, ...), less :attr:`backend_fds`
    other_fds: int = 0
    #: files under the backend's own directory (a ``file://`` backend's reads, listings
    #: and writes in flight): how many depends on the moment's load, not on what the
    #: daemon keeps, so they are counted apart from :attr:`other_fds`
    backend_fds: int = 0
    threads: int = 0
    #: the daemon's CPU time so far (user + system), seconds
    cpu_s: float = 0.0
    #: of that, its main thread's: the event loop, which serves every request
    loop_cpu_s: float = 0.0
    #: the node's ``Shmem`` and ``MemAvailable`` (``/proc/meminfo``)
    node_shmem: int = 0
    node_available: int = 0
    #: the RAM tier's own count (``/v1/stats``); -1 where the daemon did not answer
    ram_tier_bytes: int = -1
    ram_tier_chunks: int = -1
    #: the clients' PSS together (their shares of mapped chunks included)
    clients_pss: int = 0

    #: fields merged by their latest value when samples are merged; the rest by max
    LATEST: ClassVar[frozenset[str]] = frozenset({"t", "cpu_s", "loop_cpu_s"})

    def merged(self, other: Sample) -> Sample:
        """One sample for two neighbours: the later time, the larger of each gauge."""
        values = {}
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            values[f.name] = theirs if f.name in self.LATEST else max(mine, theirs)
        return Sample(**values)

    def row(self) -> dict[str, float]:
        """The sample as a flat row."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _kib_fields(path: str, wanted: tuple[str, ...]) -> dict[str, int]:
    """``Name:  N kB`` lines of a /proc file, as bytes."""
    found: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in wanted:
                found[name] = int(rest.split()[0]) * KiB
    return found


def _cpu_seconds(stat_path: str) -> float:
    """User plus system time of a process or thread (its ``stat`` file), seconds."""
    with open(stat_path) as f:
        fields_after_name = f.read().rpartition(")")[2].split()
    return (int(fields_after_name[11]) + int(fields_after_name[12])) / os.sysconf("SC_CLK_TCK")


def _memfd_name(link: str) -> str | None:
    """``chunkd`` for ``/memfd:chunkd (deleted)``; None for anything else."""
    if not link.startswith("/memfd:"):
        return None
    return link[len("/memfd:") :].removesuffix(" (deleted)")


def sample_process(pid: int, backend_dirs: tuple[str, ...] = ()) -> Sample:
    """The memory, fds and threads of process ``pid`` now, from ``/proc``.

    Files open under ``backend_dirs`` (a ``file://`` backend's root) are I/O in flight
    to the backend, counted as :attr:`Sample.backend_fds`.

    Each memfd is counted once, by its inode, whether the process holds it by one fd,
    by many or only by a mapping (``/proc/PID/map_files``, readable as root; else a
    mapping's length stands in for the memfd's size).

    Raises:
        ProcessLookupError: the process is gone.
    """
    proc = f"/proc/{pid}"
    try:
        rollup = _kib_fields(f"{proc}/smaps_rollup", ("Pss", "Pss_Shmem", "Rss"))
        threads = _kib_fields(f"{proc}/status", ("Threads",))["Threads"] // KiB
        cpu_s = _cpu_seconds(f"{proc}/stat")
        loop_cpu_s = _cpu_seconds(f"{proc}/task/{pid}/stat")
    except FileNotFoundError:
        raise ProcessLookupError(f"process {pid} is gone") from None
    sample = Sample(
        pss=rollup["Pss"],
        pss_shmem=rollup.get("Pss_Shmem", 0),
        rss=rollup["Rss"],
        threads=threads,
        cpu_s=cpu_s,
        loop_cpu_s=loop_cpu_s,
    )
    held: dict[tuple[int, int], tuple[str, int]] = {}  # (dev, inode) -> (name, bytes)
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(f"{proc}/fd"):
            try:
                link = os.readlink(entry.path)
                name = _memfd_name(link)
                sample.fds += 1
                if name is None:
                    if link.startswith("socket:"):
                        sample.socket_fds += 1
                    elif backend_dirs and link.startswith(backend_dirs):
                        sample.backend_fds += 1
                    else:
                        sample.other_fds += 1
                    continue
                sample.memfd_fds += 1
                st = os.stat(entry.path)  # follows the link to the memfd itself
            except FileNotFoundError:
                continue  # closed while we looked
            held[(st.st_dev, st.st_ino)] = (name, st.st_blocks * 512)
    with contextlib.suppress(FileNotFoundError), open(f"{proc}/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/memfd:"):
                continue
            name = _memfd_name(parts[5].rstrip("\n")) or ""
            span = parts[0]
            try:
                st = os.stat(f"{proc}/map_files/{span}")
                key, size = (st.st_dev, st.st_ino), st.st_blocks * 512
            except PermissionError:  # not root: the mapping's length
                start, _, end = span.partition("-")
                key, size = (-1, int(parts[4])), int(end, 16) - int(start, 16)
            except FileNotFoundError:
                continue
            held.setdefault(key, (name, size))
    for name, size in held.values():
        sample.memfd_bytes += size
        if name == "chunkd":
            sample.cache_memfd_bytes += size
        elif name == "chunkd-checkpoint":
            sample.staged_memfd_bytes += size
    sample.memfds = len(held)
    sample.process_bytes = sample.pss - sample.pss_shmem
    sample.footprint = sample.process_bytes + sample.memfd_bytes
    return sample


class SampleSeries:
    """Samples of one phase, at most ``capacity``: when full, neighbours are merged in
    pairs (:meth:`Sample.merged`) and every later sample stands for twice as many
    seconds. The peak of each gauge is kept exactly, whatever the merging."""

    def __init__(self, capacity: int = 2048) -> None:
        if capacity < 2:
            raise ValueError(f"capacity must be at least 2; got {capacity}")
        self.capacity = capacity
        self.samples: list[Sample] = []
        self.peak = Sample()
        self.count = 0
        self._stride = 1
        self._pending: Sample | None = None
        self._pending_count = 0

    def add(self, sample: Sample) -> None:
        """Take one raw sample."""
        self.count += 1
        self.peak = sample if self.count == 1 else self.peak.merged(sample)
        pending = sample if self._pending is None else self._pending.merged(sample)
        self._pending_count += 1
        if self._pending_count < self._stride:
            self._pending = pending
            return
        self._pending, self._pending_count = None, 0
        self.samples.append(pending)
        if len(self.samples) >= self.capacity:
            pairs = zip(self.samples[0::2], self.samples[1::2], strict=False)
            self.samples = [a.merged(b) for a, b in pairs]
            self._stride *= 2

    def window(self, start: float, end: float) -> list[Sample]:
        """The samples with ``start <= t < end``."""
        return [s for s in self.samples if start <= s.t < end]


class DaemonSampler(threading.Thread):
    """A thread that samples the daemon ``pid`` once every ``interval`` seconds into
    :attr:`series` (which :meth:`begin` replaces), until :meth:`stop`."""

    def __init__(
        self, pid: int, url: str, interval: float = 1.0, backend_dirs: tuple[str, ...] = ()
    ) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.pid = pid
        self.backend_dirs = backend_dirs
        self.url = url
        self.interval = interval
        self.series = SampleSeries()
        self.clients: list[int] = []
        self.failure: str | None = None
        self._began = time.monotonic()
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def begin(self, clients: list[int]) -> SampleSeries:
        """Start a new series now (a phase), counting the PSS of ``clients`` too."""
        with self._lock:
            self.series = SampleSeries()
            self.clients = list(clients)
            self._began = time.monotonic()
            return self.series

    def run(self) -> None:
        # docstring inherited
        next_at = time.monotonic()
        while not self._stopped.wait(max(0.0, next_at - time.monotonic())):
            next_at += self.interval
            try:
                sample = self.sample()
            except ProcessLookupError:
                self.failure = f"the daemon (pid {self.pid}) is gone"
                return
            except Exception as exc:  # a sampler that stops silently would hide a leak
                self.failure = f"the sampler failed: {type(exc).__name__}: {exc}"
                return
            with self._lock:
                sample.t = time.monotonic() - self._began
                self.series.add(sample)

    def sample(self) -> Sample:
        """One sample of the daemon, the node and the clients."""
        sample = sample_process(self.pid, self.backend_dirs)
        node = _kib_fields("/proc/meminfo", ("Shmem", "MemAvailable"))
        sample.node_shmem, sample.node_available = node["Shmem"], node["MemAvailable"]
        for pid in list(self.clients):
            # A client that is exiting answers ESRCH (ProcessLookupError), not the daemon.
            with contextlib.suppress(OSError, KeyError):
                sample.clients_pss += _kib_fields(f"/proc/{pid}/smaps_rollup", ("Pss",))["Pss"]
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            with urllib.request.urlopen(f"{self.url}/v1/stats", timeout=5) as response:
                ram = json.loads(response.read())["cache"]["tiers"][0]
            sample.ram_tier_bytes, sample.ram_tier_chunks = int(ram["bytes"]), int(ram["chunks"])
            sample.untiered_fds = max(0, sample.fds - sample.ram_tier_chunks)
        return sample

    def stop(self) -> None:
        """Stop sampling and wait for the thread."""
        self._stopped.set()
        if self.is_alive():
            self.join(timeout=30)
