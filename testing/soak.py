"""The soak: one real daemon under many client processes for a bounded time, and what
its memory, fds and threads do meanwhile.

Shared by ``tests/test_soak.py`` (16 clients, about a minute) and ``bench/soak_bench.py``
(64 clients, 30 minutes). The parts:

- :class:`SoakDataset`: the objects of a ``file://`` backend, written once: a listing
  prefix of many small objects (``list/``, at least 10,000 in the full soak) and larger
  ones of several chunks (``obj/``). Every byte is a pure function of its object and
  position (:func:`content`), so a client checks any range it reads without holding
  the data, and a daemon that hands out a wrong byte anywhere is caught.
- :class:`SoakClient`: one client process (``python -m chunkd.testing.soak PLAN``; numpy,
  never torch). Until its deadline it draws ops from a weighted mix: reads of random
  ranges, of whole small objects and of ranges over several chunks, ``read_into``,
  ``read_ranges``, ``stat``, listing pages of the big prefix (with ``start_after``),
  ``prefetch``, checkpoint saves at ``local`` (``save``, or ``async_save`` and a wait)
  of numpy state that is the same across clients and across steps in parts, loads that
  check every array, and a collection now and then that keeps the client's last two
  checkpoints. Each op's latency goes into a bounded histogram; each failure is counted
  with its message. The report is a JSON file the driver reads.
- :class:`DaemonSampler`: once a second, the daemon's memory, fds and threads from
  ``/proc`` (see :class:`Sample` for what is counted how), and its RAM tier from
  ``/v1/stats``, into a bounded :class:`SampleSeries`.
- :class:`Soak`: the driver: dataset, daemon, sampler; :meth:`Soak.load` runs one
  phase of N clients and returns a :class:`LoadResult` (time series, count, p50, p99
  and max per op, errors), which renders as Markdown, JSON and CSV.

The memory a daemon holds
    A RAM-tier chunk is a memfd. Its pages are not in the daemon's RSS or PSS unless
    the daemon maps it, and most it holds only as an fd. So the daemon's footprint is
    ``Pss - Pss_Shmem`` (its private and file-backed pages, its share of the libraries)
    plus every memfd it holds by an fd or a mapping, counted once per memfd (many fds
    and mappings of one memfd hold one set of pages) and in full (the daemon keeps all
    of them alive, whoever else maps them), at the pages the kernel allocated
    (``st_blocks``). Mapped memfd pages are in ``Pss_Shmem`` too, hence the subtraction.

The budget and its ε
    The footprint stays under ``ram_bytes + ε``, where ε (:meth:`SoakConfig.epsilon`)
    is what the daemon needs apart from its RAM tier:

    - :data:`PROCESS_ALLOWANCE`, 272 MiB, whatever the number of clients: the
      interpreter and the daemon's imports (45 MiB of PSS idle, measured); the lmdb
      index's pages it has touched (under 8 MiB here, measured: 16); what the daemon
      keeps in memory bounded by entries, which fills over minutes: listing pages
      (65,536 entries, about 20 MiB: a page is kept per ``start_after``, so one key sits
      in many pages: 24), the versions of objects it knows (65,536, every checkpoint
      file included: 16), the hot set, the dashboard's samples and the metrics (8);
      thread stacks (obstore's tokio runtime keeps up to 512 blocking threads, each
      touching tens of KiB: 32); what glibc's arenas and Python's object arenas hold
      after the bursts (50 to 60 MiB over a 15-minute run, measured: 64); and what the
      daemon keeps of each finished save for an hour, whatever their number (about
      8 KiB a save of this state, measured with tracemalloc; 64 clients save about 4 a
      second: 56 MiB in 30 minutes, so 64; not an hour at any rate);
    - :data:`CLIENT_ALLOWANCE` per client, 1 MiB: a connection's buffers (a frame's
      payload is at most 1 MiB) and the chunks pinned by its reads in flight after
      their eviction;
    - the staged checkpoints the daemon holds, per client: the daemon keeps a save's
      sealed memfd (``chunkd-checkpoint``) until its upload is done, outside
      ``ram_bytes`` by design, and a client starts a save only once its last one is
      committed (as a trainer's saves are minutes apart): the staged size of one
      state (:attr:`StateShape.staged_bytes`). Nothing in the daemon bounds the
      staged bytes of saves that come faster than their uploads.

Nothing here grows with time: latencies go into histograms of fixed buckets, errors
keep a count and the first :data:`ERRORS_KEPT` messages, the time series halves its
resolution when full, and the daemon's log is scanned line by line.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Final

import numpy as np
import numpy.typing as npt

from chunkd.client import Client, checkpoint
from chunkd.testing.ports import BIN, free_port

__all__ = [
    "CLIENT_ALLOWANCE",
    "DEFAULT_MIX",
    "ERRORS_KEPT",
    "PROCESS_ALLOWANCE",
    "ClientPlan",
    "ClientReport",
    "DaemonSampler",
    "GiB",
    "KiB",
    "LatencyHistogram",
    "LoadResult",
    "LogReport",
    "MiB",
    "OpStats",
    "Sample",
    "SampleSeries",
    "Soak",
    "SoakClient",
    "SoakConfig",
    "SoakDaemon",
    "SoakDataset",
    "SoakMismatchError",
    "StateShape",
    "content",
    "sample_process",
]

KiB: Final = 1 << 10
MiB: Final = 1 << 20
GiB: Final = 1 << 30

#: ε's part for the daemon process itself, whatever the load (see the module docstring)
PROCESS_ALLOWANCE: Final = 272 * MiB
#: ε's part per client, besides its staged save (see the module docstring)
CLIENT_ALLOWANCE: Final = 1 * MiB
#: error messages kept per report (every error is counted)
ERRORS_KEPT: Final = 20
#: the ops a client draws from, and how often (relative weights)
DEFAULT_MIX: Final[Mapping[str, float]] = {
    "read_range": 28,
    "read_small": 20,
    "read_span": 10,
    "read_into": 10,
    "read_ranges": 5,
    "stat": 10,
    "list": 8,
    "prefetch": 3,
    "save": 4,
    "load": 2,
}

_MASK: Final = (1 << 64) - 1


# -- the dataset ------------------------------------------------------------------------


def _mix(*parts: int) -> int:
    """A 64-bit hash of some integers (splitmix64's finaliser over each in turn)."""
    z = 0x9E3779B97F4A7C15
    for part in parts:
        z = (z ^ (part & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
        z ^= z >> 31
    return z


def content(key_id: int, offset: int, length: int) -> npt.NDArray[np.uint8]:
    """Bytes ``[offset, offset + length)`` of the object ``key_id``.

    Word ``j`` (8 bytes, little-endian) of an object is splitmix64 of ``key_id``'s
    seed plus ``j``: any range is computed without the bytes before it, and no two
    objects (or chunks) share bytes, so no read is answered right by chance.
    """
    first = offset // 8
    count = (offset + length + 7) // 8 - first
    z = np.arange(first, first + count, dtype=np.uint64)
    z += np.uint64(_mix(key_id))  # arrays wrap silently; numpy scalars would warn
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    raw = z.astype("<u8", copy=False).view(np.uint8)
    skip = offset - first * 8
    return raw[skip : skip + length]


@dataclass(frozen=True)
class SoakDataset:
    """The objects of the soak's ``file://`` backend, all derived from ``seed``.

    ``list/`` holds ``small_objects`` objects of ``small_bytes`` (one chunk each), the
    prefix the listing op pages through; ``obj/`` holds ``large_objects`` of
    ``large_bytes`` (several chunks each, sizes not page-aligned).
    """

    seed: int = 7
    small_objects: int = 10_000
    small_bytes: tuple[int, int] = (512, 16 * KiB)
    large_objects: int = 120
    large_bytes: tuple[int, int] = (3 * MiB // 2, 6 * MiB)
    backend: str = "data"

    SMALL_PREFIX: ClassVar[str] = "list"
    LARGE_PREFIX: ClassVar[str] = "obj"

    def small_key(self, i: int) -> str:
        """The key (in the backend) of small object ``i``."""
        return f"{self.SMALL_PREFIX}/s-{i:06d}.bin"

    def large_key(self, i: int) -> str:
        """The key of large object ``i``."""
        return f"{self.LARGE_PREFIX}/o-{i:05d}.bin"

    def small_id(self, i: int) -> int:
        """The content id of small object ``i`` (see :func:`content`)."""
        return _mix(self.seed, 1, i)

    def large_id(self, i: int) -> int:
        """The content id of large object ``i``."""
        return _mix(self.seed, 2, i)

    def small_size(self, i: int) -> int:
        """The size of small object ``i``."""
        low, high = self.small_bytes
        return low + _mix(self.seed, 3, i) % (high - low + 1)

    def large_size(self, i: int) -> int:
        """The size of large object ``i``."""
        low, high = self.large_bytes
        return low + _mix(self.seed, 4, i) % (high - low + 1)

    @property
    def total_bytes(self) -> int:
        """Bytes of every object together."""
        small = sum(self.small_size(i) for i in range(self.small_objects))
        return small + sum(self.large_size(i) for i in range(self.large_objects))

    def write(self, root: Path) -> None:
        """Write every object under ``root`` (the backend's directory)."""
        (root / self.SMALL_PREFIX).mkdir(parents=True, exist_ok=True)
        (root / self.LARGE_PREFIX).mkdir(parents=True, exist_ok=True)
        for i in range(self.small_objects):
            data = content(self.small_id(i), 0, self.small_size(i))
            (root / self.small_key(i)).write_bytes(data.tobytes())
        for i in range(self.large_objects):
            size = self.large_size(i)
            with (root / self.large_key(i)).open("wb") as f:
                for at in range(0, size, 8 * MiB):
                    f.write(content(self.large_id(i), at, min(8 * MiB, size - at)).tobytes())


@dataclass(frozen=True)
class StateShape:
    """The numpy state dict each client saves: parts the same across clients, across
    steps, and new every step, so saves deduplicate both ways."""

    #: the same in every client and step (``uint8``): deduplicated across clients
    shared_bytes: int = 2 * MiB
    #: the client's own, the same every step (``int32``): deduplicated across steps
    own_bytes: int = 1 * MiB
    #: new every step (``uint16``): what a step uploads
    moving_bytes: int = 256 * KiB
    seed: int = 11

    @property
    def staged_bytes(self) -> int:
        """An upper bound of the memfd one save stages: the arrays, each page-aligned,
        and a page of small values."""
        page = 4 * KiB
        arrays = (self.shared_bytes, self.own_bytes, self.moving_bytes)
        return sum(-(-n // page) * page for n in arrays) + 2 * page

    def _arrays(self, client: int, step: int) -> dict[str, npt.NDArray[Any]]:
        return {
            "shared": content(_mix(self.seed, 1), 0, self.shared_bytes),
            "own": content(_mix(self.seed, 2, client), 0, self.own_bytes).view(np.int32),
            "moving": content(_mix(self.seed, 3, client, step), 0, self.moving_bytes).view(
                np.uint16
            ),
            "bias": content(_mix(self.seed, 4, client, step), 0, 512).view(np.int64),
        }

    def state(self, client: int, step: int) -> dict[str, Any]:
        """The state client ``client`` saves at ``step``."""
        arrays = self._arrays(client, step)
        return {
            "model": {"shared": arrays["shared"].reshape(-1, 1024), "own": arrays["own"]},
            "optim": {"moving": arrays["moving"], "bias": arrays["bias"]},
            "step": step,
            "client": f"client-{client}",
        }

    def check(self, loaded: Any, client: int, step: int) -> int:
        """Raise :class:`SoakMismatchError` unless ``loaded`` is the state of
        ``(client, step)``; returns the bytes compared."""
        want = self._arrays(client, step)
        try:
            got = {
                "shared": loaded["model"]["shared"].reshape(-1),
                "own": loaded["model"]["own"],
                "moving": loaded["optim"]["moving"],
                "bias": loaded["optim"]["bias"],
            }
            scalars = (loaded["step"], loaded["client"])
        except (KeyError, TypeError) as exc:
            raise SoakMismatchError(f"the loaded state lacks {exc}") from None
        if scalars != (step, f"client-{client}"):
            raise SoakMismatchError(f"the loaded state's scalars are {scalars!r}")
        compared = 0
        for key, array in want.items():
            other = got[key]
            if not isinstance(other, np.ndarray) or other.dtype != array.dtype:
                raise SoakMismatchError(f"{key}: loaded as {type(other).__name__}")
            if not np.array_equal(other, array):
                raise SoakMismatchError(f"{key}: the loaded array differs from the saved one")
            compared += array.nbytes
        return compared


class SoakMismatchError(AssertionError):
    """What the daemon answered is not what the soak's data says it should be."""


# -- latencies and reports ---------------------------------------------------------------


class LatencyHistogram:
    """Latencies in log-spaced buckets, 16 per doubling (each about 4.4% wide) from
    1 us up: a fixed size whatever the count, and quantiles within a bucket's width."""

    STEPS: ClassVar[int] = 16
    FLOOR: ClassVar[float] = 1e-6

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}
        self.count = 0
        self.total = 0.0
        self.max = 0.0

    def record(self, seconds: float) -> None:
        """Count one latency."""
        at = 0 if seconds <= self.FLOOR else int(math.log2(seconds / self.FLOOR) * self.STEPS) + 1
        at = min(at, 64 * self.STEPS)  # beyond 2^64 us: one bucket
        self.buckets[at] = self.buckets.get(at, 0) + 1
        self.count += 1
        self.total += seconds
        self.max = max(self.max, seconds)

    def merge(self, other: LatencyHistogram) -> None:
        """Add ``other``'s counts to this one."""
        for at, n in other.buckets.items():
            self.buckets[at] = self.buckets.get(at, 0) + n
        self.count += other.count
        self.total += other.total
        self.max = max(self.max, other.max)

    def quantile(self, q: float) -> float:
        """The ``q`` quantile (0..1): its bucket's upper edge, never above the max."""
        if not self.count:
            return 0.0
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for at in sorted(self.buckets):
            seen += self.buckets[at]
            if seen >= rank:
                return min(self.max, self.FLOOR * 2 ** (at / self.STEPS))
        return self.max

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (:meth:`from_json` reads it back)."""
        return {
            "buckets": {str(k): v for k, v in self.buckets.items()},
            "count": self.count,
            "total": self.total,
            "max": self.max,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> LatencyHistogram:
        """The histogram :meth:`to_json` wrote."""
        histogram = cls()
        histogram.buckets = {int(k): int(v) for k, v in doc["buckets"].items()}
        histogram.count = int(doc["count"])
        histogram.total = float(doc["total"])
        histogram.max = float(doc["max"])
        return histogram


@dataclass
class ClientReport:
    """What one client (or all of them, merged) did: latencies per op, errors, checks."""

    ops: dict[str, LatencyHistogram] = field(default_factory=dict)
    #: failures per op (each one's message is in ``first_errors`` while there is room)
    errors: dict[str, int] = field(default_factory=dict)
    first_errors: list[str] = field(default_factory=list)
    #: reads whose every byte was compared with :func:`content`, and those bytes
    verified_reads: int = 0
    verified_bytes: int = 0
    #: checkpoint loads whose every array was compared with what was saved
    verified_loads: int = 0
    #: listing pages whose keys, sizes and token were compared with the dataset's
    verified_pages: int = 0

    def record(self, op: str, seconds: float) -> None:
        """Count one successful op and its latency."""
        self.ops.setdefault(op, LatencyHistogram()).record(seconds)

    def error(self, op: str, message: str) -> None:
        """Count one failed op; keep its message while there is room."""
        self.errors[op] = self.errors.get(op, 0) + 1
        if len(self.first_errors) < ERRORS_KEPT:
            self.first_errors.append(f"{op}: {message}"[:2000])

    @property
    def error_count(self) -> int:
        """Failed ops, all kinds together."""
        return sum(self.errors.values())

    def merge(self, other: ClientReport) -> None:
        """Add ``other`` to this report."""
        for op, histogram in other.ops.items():
            self.ops.setdefault(op, LatencyHistogram()).merge(histogram)
        for op, n in other.errors.items():
            self.errors[op] = self.errors.get(op, 0) + n
        room = ERRORS_KEPT - len(self.first_errors)
        self.first_errors += other.first_errors[: max(0, room)]
        self.verified_reads += other.verified_reads
        self.verified_bytes += other.verified_bytes
        self.verified_loads += other.verified_loads
        self.verified_pages += other.verified_pages

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (:meth:`from_json` reads it back)."""
        return {
            "ops": {op: h.to_json() for op, h in self.ops.items()},
            "errors": self.errors,
            "first_errors": self.first_errors,
            "verified_reads": self.verified_reads,
            "verified_bytes": self.verified_bytes,
            "verified_loads": self.verified_loads,
            "verified_pages": self.verified_pages,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ClientReport:
        """The report :meth:`to_json` wrote."""
        return cls(
            ops={op: LatencyHistogram.from_json(h) for op, h in doc["ops"].items()},
            errors={str(k): int(v) for k, v in doc["errors"].items()},
            first_errors=[str(m) for m in doc["first_errors"]],
            verified_reads=int(doc["verified_reads"]),
            verified_bytes=int(doc["verified_bytes"]),
            verified_loads=int(doc["verified_loads"]),
            verified_pages=int(doc["verified_pages"]),
        )


# -- a client process --------------------------------------------------------------------


@dataclass(frozen=True)
class ClientPlan:
    """What one client process does: the driver writes it as JSON, the client reads it."""

    index: int
    phase: str
    socket: str
    dataset: SoakDataset
    state: StateShape
    mix: dict[str, float]
    duration: float
    chunk_bytes: int
    cache_bytes: int
    #: a collection (keep the last two checkpoints) after every this many saves
    gc_every: int
    #: where the client writes its :class:`ClientReport`
    out: str

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (:meth:`from_json` reads it back)."""
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ClientPlan:
        """The plan :meth:`to_json` wrote."""
        dataset = dict(doc["dataset"])
        for key in ("small_bytes", "large_bytes"):
            dataset[key] = tuple(dataset[key])
        return cls(
            **{f.name: doc[f.name] for f in fields(cls) if f.name not in ("dataset", "state")},
            dataset=SoakDataset(**dataset),
            state=StateShape(**doc["state"]),
        )


class SoakClient:
    """One client process's loop: ops drawn from the plan's mix until its deadline.

    Each op's latency covers the call to chunkd only; checking the answer comes
    after and is not timed.
    """

    def __init__(self, plan: ClientPlan) -> None:
        self.plan = plan
        self.data = plan.dataset
        self.name = plan.dataset.backend
        self.rng = random.Random(_mix(plan.dataset.seed, 99, plan.index, len(plan.phase)))
        self.report = ClientReport()
        self.client = Client(plan.socket, cache_bytes=plan.cache_bytes, timeout=120.0)
        self.step = 0
        #: the last save's handle and step (what a load reads, once committed)
        self.last: tuple[checkpoint.SaveHandle, int] | None = None
        self.ops: dict[str, Callable[[], None]] = {
            "read_range": self.read_range,
            "read_small": self.read_small,
            "read_span": self.read_span,
            "read_into": self.read_into,
            "read_ranges": self.read_ranges,
            "stat": self.stat,
            "list": self.list_page,
            "prefetch": self.prefetch,
            "save": self.save,
            "load": self.load,
        }
        unknown = set(plan.mix) - set(self.ops)
        if unknown:
            raise ValueError(f"the mix names ops no client runs: {sorted(unknown)}")

    @contextlib.contextmanager
    def timed(self, op: str) -> Iterator[None]:
        """Record the latency of the block as ``op`` if it raises nothing."""
        started = time.perf_counter()
        yield
        self.report.record(op, time.perf_counter() - started)

    def run(self, deadline: float) -> ClientReport:
        """Run ops until ``deadline`` (``time.monotonic``); the report."""
        names = list(self.plan.mix)
        weights = [self.plan.mix[n] for n in names]
        while time.monotonic() < deadline:
            op = self.rng.choices(names, weights)[0]
            try:
                self.ops[op]()
            except Exception as exc:  # every failure is a finding: count it, go on
                where = traceback.extract_tb(exc.__traceback__)[-1]
                self.report.error(
                    op,
                    f"{type(exc).__name__}: {exc} (at {Path(where.filename).name}:{where.lineno})",
                )
        if self.last is not None:  # the last save is waited for: none is left half done
            try:
                self.last[0].wait(120.0, level="local")
            except Exception as exc:
                self.report.error("ckpt_wait_local", f"{type(exc).__name__}: {exc}")
        if "torch" in sys.modules:
            self.report.error("imports", "torch was imported: soak clients use numpy only")
        self.client.close()
        return self.report

    # -- reads ----------------------------------------------------------------------

    def _large(self) -> tuple[str, int, int]:
        i = self.rng.randrange(self.data.large_objects)
        return (
            f"{self.name}/{self.data.large_key(i)}",
            self.data.large_id(i),
            self.data.large_size(i),
        )

    def _verify(self, got: Any, key_id: int, offset: int, length: int, what: str) -> None:
        array = np.frombuffer(got, dtype=np.uint8)
        if array.size != length:
            raise SoakMismatchError(f"{what}: {array.size} bytes, not {length}")
        want = content(key_id, offset, length)
        if not np.array_equal(array, want):
            bad = int(np.flatnonzero(array != want)[0])
            raise SoakMismatchError(f"{what}: byte {offset + bad} differs")
        self.report.verified_reads += 1
        self.report.verified_bytes += length

    def read_range(self) -> None:
        """A random range (1 B to 1 MiB, log-uniform) of a large object."""
        name, key_id, size = self._large()
        offset = self.rng.randrange(size)
        length = int(2 ** self.rng.uniform(0, 20))
        with self.timed("read_range"):
            view = self.client.read(name, offset, length)
        self._verify(view, key_id, offset, min(length, size - offset), f"{name}@{offset}+{length}")

    def read_small(self) -> None:
        """A whole small object (one chunk, often answered inline)."""
        i = self.rng.randrange(self.data.small_objects)
        name = f"{self.name}/{self.data.small_key(i)}"
        with self.timed("read_small"):
            view = self.client.read(name)
        self._verify(view, self.data.small_id(i), 0, self.data.small_size(i), name)

    def read_span(self) -> None:
        """A range over 2 to 4 chunks: one contiguous view over several memfds."""
        name, key_id, size = self._large()
        chunk = self.plan.chunk_bytes
        length = min(size, self.rng.randint(chunk + 1, 4 * chunk))
        offset = self.rng.randrange(size - length + 1)
        with self.timed("read_span"):
            view = self.client.read(name, offset, length)
        self._verify(view, key_id, offset, length, f"{name}@{offset}+{length}")

    def read_into(self) -> None:
        """``read_into`` a fresh numpy buffer of up to 2 MiB."""
        name, key_id, size = self._large()
        offset = self.rng.randrange(size)
        buffer = np.empty(self.rng.randint(1, 2 * MiB), dtype=np.uint8)
        with self.timed("read_into"):
            got = self.client.read_into(name, buffer.data, offset)
        self._verify(buffer[:got], key_id, offset, min(buffer.size, size - offset), name)

    def read_ranges(self) -> None:
        """16 small ranges of small objects in one ``read_ranges`` (``readv``)."""
        asked = []
        for _ in range(16):
            i = self.rng.randrange(self.data.small_objects)
            size = self.data.small_size(i)
            offset = self.rng.randrange(size)
            length = self.rng.randint(1, size - offset)
            asked.append((i, offset, length))
        with self.timed("read_ranges"):
            got = self.client.read_ranges(
                [(f"{self.name}/{self.data.small_key(i)}", o, n) for i, o, n in asked]
            )
        for (i, offset, length), data in zip(asked, got, strict=True):
            if isinstance(data, Exception):
                raise data
            self._verify(data, self.data.small_id(i), offset, length, self.data.small_key(i))

    def stat(self) -> None:
        """``stat`` of an object of either kind: its size must be right."""
        if self.rng.random() < 0.5:
            name, _, size = self._large()
        else:
            i = self.rng.randrange(self.data.small_objects)
            name, size = f"{self.name}/{self.data.small_key(i)}", self.data.small_size(i)
        with self.timed("stat"):
            info = self.client.stat(name)
        if info.size != size or not info.version:
            raise SoakMismatchError(f"stat {name}: size {info.size}, version {info.version!r}")

    def list_page(self) -> None:
        """One page of the big prefix after a random key (or from its start)."""
        count = self.data.small_objects
        first = self.rng.randrange(-1, count)  # -1: from the start
        limit = self.rng.randint(1, 1000)
        after = None if first < 0 else self.data.small_key(first)
        prefix = f"{self.name}/{self.data.SMALL_PREFIX}"
        with self.timed("list"):
            entries, token = self.client.ls_page(prefix, start_after=after, limit=limit)
        expect = range(first + 1, min(count, first + 1 + limit))
        names = [e["name"] for e in entries]
        want = [f"{self.name}/{self.data.small_key(i)}" for i in expect]
        if names != want:
            raise SoakMismatchError(
                f"list after {after}: {len(names)} entries from {names[:1]}, not {len(want)} "
                f"from {want[:1]}"
            )
        sizes = [e.get("size") for e in entries]
        if sizes != [self.data.small_size(i) for i in expect]:
            raise SoakMismatchError(f"list after {after}: sizes differ")
        more = expect.stop < count
        if (token is not None) != more or (more and token != self.data.small_key(expect[-1])):
            raise SoakMismatchError(f"list after {after}: next token {token!r}")
        self.report.verified_pages += 1

    def prefetch(self) -> None:
        """Ask the daemon to load three large objects in the background."""
        names = [self._large()[0] for _ in range(3)]
        with self.timed("prefetch"):
            self.client.prefetch(names)

    # -- checkpoints ----------------------------------------------------------------

    def _checkpoint_prefix(self) -> str:
        return f"{self.name}/ckpt/{self.plan.phase}/c{self.plan.index:03d}"

    def save(self) -> None:
        """Save the next step at ``local``: half with ``save``, half with
        ``async_save`` then ``wait``; every ``gc_every`` saves, a collection.

        The save before is first waited for until it is committed, as a trainer's
        next save comes long after its last: so the daemon holds at most one staged
        save per client (the ε of :meth:`SoakConfig.epsilon` counts on it).
        """
        if self.last is not None:
            with self.timed("ckpt_wait_remote"):
                if not self.last[0].wait(120.0, level="remote"):
                    raise TimeoutError(f"{self.last[0].name} was not committed in 120 s")
        self.step += 1
        step = self.step
        state = self.plan.state.state(self.plan.index, step)
        name = f"{self._checkpoint_prefix()}/step-{step:06d}"
        if step % 2:
            with self.timed("ckpt_save_local"):
                handle = checkpoint.save(
                    state, name, durability="local", step=step, client=self.client
                )
        else:
            with self.timed("ckpt_async_save"):
                handle = checkpoint.async_save(
                    state, name, durability="local", step=step, client=self.client
                )
            with self.timed("ckpt_wait_local"):
                handle.wait(120.0)
        self.last = (handle, step)
        if self.plan.gc_every and step % self.plan.gc_every == 0:
            with self.timed("ckpt_gc"):
                checkpoint.gc(self._checkpoint_prefix(), keep_last=2, grace=0, client=self.client)

    def load(self) -> None:
        """Load the last save (once committed) and compare every array."""
        if self.last is None:
            self.save()
            return
        handle, step = self.last
        if not handle.wait(120.0, level="remote"):
            raise TimeoutError(f"{handle.name} was not committed in 120 s")
        with self.timed("ckpt_load"):
            state = checkpoint.load(handle.name, client=self.client)
        self.plan.state.check(state, self.plan.index, step)
        self.report.verified_loads += 1


def client_main(plan_path: str) -> int:
    """A client process: read the plan, say ``ready``, wait for ``go``, run, report."""
    plan = ClientPlan.from_json(json.loads(Path(plan_path).read_text()))
    try:
        soak = SoakClient(plan)
    except Exception as exc:
        report = ClientReport()
        report.error("connect", f"{type(exc).__name__}: {exc}")
        Path(plan.out).write_text(json.dumps(report.to_json()))
        return 1
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 2  # the driver gave up before the start
    report = soak.run(time.monotonic() + plan.duration)
    Path(plan.out).write_text(json.dumps(report.to_json()))
    return 0


# -- sampling the daemon -----------------------------------------------------------------


@dataclass
class Sample:
    """The daemon at one moment (bytes unless named otherwise)."""

    #: seconds since the phase began
    t: float = 0.0
    #: what the daemon holds in all: ``process_bytes + memfd_bytes`` (see the module
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


# -- the daemon --------------------------------------------------------------------------


@dataclass(frozen=True)
class SoakConfig:
    """The soak's daemon, dataset and clients.

    The RAM budget is smaller than the dataset, so the RAM tier evicts all along
    and the disk tier serves and promotes.
    """

    dataset: SoakDataset = field(default_factory=SoakDataset)
    state: StateShape = field(default_factory=StateShape)
    mix: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    ram_bytes: int = 128 * MiB
    disk_bytes: int = 2 * GiB
    chunk_bytes: int = 1 * MiB
    #: each client's own cache of mapped chunks: it keeps evicted chunks alive, so the
    #: node holds up to ``ram_bytes`` plus this much per client (a trainer's default
    #: is 1 GiB; the soak keeps the node's total small)
    client_cache_bytes: int = 32 * MiB
    #: a collection after every this many saves of a client (0: none)
    gc_every: int = 8
    #: how long the daemon answers a listing from its memory
    list_revalidate: str = "5s"
    process_allowance: int = PROCESS_ALLOWANCE

    def epsilon(self, clients: int) -> int:
        """What the daemon may hold beyond ``ram_bytes`` with ``clients`` clients (see
        the module docstring)."""
        return self.process_allowance + clients * (CLIENT_ALLOWANCE + self.state.staged_bytes)

    def toml(self, work: Path, port: int) -> str:
        """The daemon's config file, everything under ``work``."""
        return f"""
[server]
listen = "127.0.0.1:{port}"
socket = "{work / "chunkd.sock"}"
log_format = "json"
shutdown_timeout = "10s"

[cache]
dir = "{work / "cache"}"
ram_bytes = {self.ram_bytes}
disk_bytes = {self.disk_bytes}
disk_min_free_bytes = 0
chunk_bytes = {self.chunk_bytes}
fsync = "never"

[datasets]
registry = "{self.dataset.backend}/datasets"

[[backends]]
name = "{self.dataset.backend}"
url = "file://{work / "backend"}"
writable = true
list_revalidate = "{self.list_revalidate}"
"""


@dataclass
class LogReport:
    """What the daemon's log holds that a healthy run would not."""

    tracebacks: int = 0
    errors: int = 0
    warnings: int = 0
    first: list[str] = field(default_factory=list)


class SoakDaemon:
    """``chunkd serve`` on a config of :class:`SoakConfig`, its log in ``work/daemon.log``."""

    def __init__(self, work: Path, config: SoakConfig) -> None:
        self.work = work
        self.port = free_port()
        self.config_path = work / "chunkd.toml"
        self.config_path.write_text(config.toml(work, self.port))
        self.log_path = work / "daemon.log"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
        with self.log_path.open("ab") as sink:
            self.process = subprocess.Popen(
                [str(BIN / "chunkd"), "serve", "--config", str(self.config_path)],
                cwd=work,
                env=environ,
                stdout=sink,
                stderr=sink,
            )
        self._wait_ready(60.0)

    @property
    def url(self) -> str:
        """The daemon's HTTP address."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def socket(self) -> str:
        """The daemon's local socket."""
        return str(self.work / "chunkd.sock")

    @property
    def pid(self) -> int:
        """The daemon's process id."""
        return self.process.pid

    def ready(self) -> bool:
        """Whether ``/readyz`` answers 200 now."""
        try:
            with urllib.request.urlopen(f"{self.url}/readyz", timeout=5) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"chunkd did not start; see {self.log_path}")
            time.sleep(0.1)

    def log_report(self) -> LogReport:
        """Tracebacks, errors and warnings in the log, read a line at a time."""
        report = LogReport()
        with self.log_path.open(errors="replace") as log:
            for line in log:
                bad = "Traceback" in line or "exception was never retrieved" in line
                level = _log_level(line)
                report.tracebacks += bad
                report.errors += level in ("error", "critical")
                report.warnings += level == "warning"
                if (bad or level in ("error", "critical")) and len(report.first) < 5:
                    report.first.append(line.strip()[:2000])
        return report

    def stop(self) -> int:
        """SIGTERM, and wait (SIGKILL after 30 s); the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=10)


def _log_level(line: str) -> str:
    """The level of one JSON log line ("" when it is not one)."""
    if not line.startswith("{"):
        return ""
    try:
        return str(json.loads(line).get("level", "")).lower()
    except ValueError:
        return ""


# -- the driver --------------------------------------------------------------------------


@dataclass(frozen=True)
class OpStats:
    """One op over a phase, all clients together (seconds)."""

    count: int
    errors: int
    p50: float
    p99: float
    max: float
    mean: float


@dataclass
class LoadResult:
    """One phase of the soak: N clients for a while, and the daemon meanwhile."""

    phase: str
    clients: int
    #: seconds from the start signal until the last client reported
    seconds: float
    #: samples in the first ``warmup`` seconds are left out of the drift figures
    warmup: float
    ram_bytes: int
    epsilon: int
    report: ClientReport
    series: SampleSeries
    #: client processes that did not end well (exit status, or no report)
    client_failures: list[str] = field(default_factory=list)

    @property
    def ops(self) -> dict[str, OpStats]:
        """Each op's count, errors and latencies."""
        out = {}
        for op in sorted(set(self.report.ops) | set(self.report.errors)):
            h = self.report.ops.get(op, LatencyHistogram())
            mean = h.total / h.count if h.count else 0.0
            errors = self.report.errors.get(op, 0)
            out[op] = OpStats(h.count, errors, h.quantile(0.5), h.quantile(0.99), h.max, mean)
        return out

    @property
    def errors(self) -> int:
        """Failed ops and failed client processes."""
        return self.report.error_count + len(self.client_failures)

    @property
    def peak(self) -> Sample:
        """The largest value of each gauge over the phase."""
        return self.series.peak

    @property
    def peak_footprint(self) -> int:
        """The largest footprint sampled."""
        return self.series.peak.footprint

    @property
    def limit(self) -> int:
        """``ram_bytes + epsilon``: what the footprint must stay under."""
        return self.ram_bytes + self.epsilon

    def _settled(self) -> tuple[list[Sample], list[Sample]]:
        """The first and last fifths of the samples after the warm-up."""
        after = [s for s in self.series.samples if s.t >= self.warmup]
        fifth = max(1, len(after) // 5)
        return after[:fifth], after[-fifth:]

    def cpu_rate(self, counter: str) -> float:
        """CPU seconds per second over the phase of ``cpu_s`` or ``loop_cpu_s``."""
        samples = self.series.samples
        if len(samples) < 2 or samples[-1].t <= samples[0].t:
            return 0.0
        spent = getattr(samples[-1], counter) - getattr(samples[0], counter)
        return float(spent / (samples[-1].t - samples[0].t))

    def settled(self, gauge: str) -> tuple[float, float]:
        """The medians of ``gauge`` (a :class:`Sample` field) over the first and the
        last fifth of the samples after the warm-up."""
        early, late = self._settled()
        if not early:
            return 0.0, 0.0
        return (
            float(np.median([getattr(s, gauge) for s in early])),
            float(np.median([getattr(s, gauge) for s in late])),
        )

    def drift(self, gauge: str) -> float:
        """How much ``gauge`` grew from the first fifth of the samples after the
        warm-up to the last fifth (:meth:`settled`)."""
        early, late = self.settled(gauge)
        return late - early

    def summary(self) -> dict[str, Any]:
        """The figures, JSON-ready."""
        peak = self.peak
        return {
            "phase": self.phase,
            "clients": self.clients,
            "seconds": round(self.seconds, 1),
            "samples": self.series.count,
            "errors": self.errors,
            "first_errors": self.report.first_errors + self.client_failures[:ERRORS_KEPT],
            "verified_reads": self.report.verified_reads,
            "verified_bytes": self.report.verified_bytes,
            "verified_loads": self.report.verified_loads,
            "verified_pages": self.report.verified_pages,
            "ram_bytes": self.ram_bytes,
            "epsilon": self.epsilon,
            "peak_footprint": self.peak_footprint,
            "peak_pss": peak.pss,
            "peak_cache_memfd_bytes": peak.cache_memfd_bytes,
            "peak_staged_memfd_bytes": peak.staged_memfd_bytes,
            "peak_node_shmem": peak.node_shmem,
            "peak_clients_pss": peak.clients_pss,
            "peak_fds": peak.fds,
            "peak_threads": peak.threads,
            "cpu_per_second": self.cpu_rate("cpu_s"),
            "loop_cpu_per_second": self.cpu_rate("loop_cpu_s"),
            "fd_drift": self.drift("fds"),
            "other_fd_drift": self.drift("other_fds"),
            "socket_fd_drift": self.drift("socket_fds"),
            "untiered_fd_drift": self.drift("untiered_fds"),
            "peak_untiered_fds": peak.untiered_fds,
            "process_drift": self.drift("process_bytes"),
            "peak_process_bytes": peak.process_bytes,
            "ops": {op: asdict(s) for op, s in self.ops.items()},
        }

    def markdown(self) -> str:
        """The phase as Markdown: figures, then a table of ops."""
        s = self.summary()
        lines = [
            f"## Soak phase `{self.phase}`: {self.clients} clients, {s['seconds']} s",
            "",
            f"- errors: **{s['errors']}**; verified: {s['verified_reads']} reads "
            f"({s['verified_bytes'] / GiB:.2f} GiB), {s['verified_loads']} checkpoint loads, "
            f"{s['verified_pages']} listing pages",
            f"- daemon footprint (PSS - Pss_Shmem + memfds held) peak "
            f"**{s['peak_footprint'] / MiB:.0f} MiB** against ram_bytes "
            f"{self.ram_bytes / MiB:.0f} MiB + epsilon {self.epsilon / MiB:.0f} MiB "
            f"= {self.limit / MiB:.0f} MiB",
            f"- peaks: PSS {s['peak_pss'] / MiB:.0f} MiB, cache memfds "
            f"{s['peak_cache_memfd_bytes'] / MiB:.0f} MiB, staged checkpoints "
            f"{s['peak_staged_memfd_bytes'] / MiB:.0f} MiB, node Shmem "
            f"{s['peak_node_shmem'] / MiB:.0f} MiB, clients' PSS "
            f"{s['peak_clients_pss'] / MiB:.0f} MiB",
            f"- fds peak {s['peak_fds']}, drift after warm-up {s['fd_drift']:+.0f} "
            f"(neither memfds nor sockets: {s['other_fd_drift']:+.0f}; beyond the RAM "
            f"tier's chunks: {s['untiered_fd_drift']:+.0f}, peak {s['peak_untiered_fds']}); "
            f"threads peak {s['peak_threads']}; own pages (PSS - Pss_Shmem) peak "
            f"{s['peak_process_bytes'] / MiB:.0f} MiB, drift {s['process_drift'] / MiB:+.1f} MiB",
            f"- daemon CPU {s['cpu_per_second']:.2f} s/s, of which its event loop "
            f"{s['loop_cpu_per_second']:.2f} s/s",
            "",
            "| op | count | errors | p50 ms | p99 ms | max ms |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for op, st in self.ops.items():
            lines.append(
                f"| {op} | {st.count} | {st.errors} | {st.p50 * 1e3:.2f} | "
                f"{st.p99 * 1e3:.2f} | {st.max * 1e3:.1f} |"
            )
        if s["first_errors"]:
            lines += ["", "First errors:", ""] + [f"- `{m}`" for m in s["first_errors"]]
        return "\n".join(lines) + "\n"

    def csv(self) -> str:
        """The time series, one row a sample."""
        out = io.StringIO()
        rows = [s.row() for s in self.series.samples]
        writer = csv.DictWriter(out, fieldnames=list(Sample().row()))
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()

    def write(self, out: Path) -> None:
        """``soak-PHASE.md``, ``.json`` (summary and series) and ``.csv`` under ``out``."""
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"soak-{self.phase}"
        stem.with_suffix(".md").write_text(self.markdown())
        doc = self.summary() | {"series": [s.row() for s in self.series.samples]}
        stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
        stem.with_suffix(".csv").write_text(self.csv())


class Soak:
    """The driver: a dataset written under ``work``, a daemon over it, a sampler.

    Use as a context manager; :meth:`load` runs a phase of clients.
    """

    def __init__(self, work: Path, config: SoakConfig | None = None) -> None:
        self.work = work
        self.config = config or SoakConfig()
        work.mkdir(parents=True, exist_ok=True)
        self.config.dataset.write(work / "backend")
        self.daemon = SoakDaemon(work, self.config)
        self.sampler = DaemonSampler(
            self.daemon.pid, self.daemon.url, backend_dirs=(f"{work / 'backend'}/",)
        )
        self.sampler.start()

    def __enter__(self) -> Soak:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop the sampler and the daemon."""
        self.sampler.stop()
        self.daemon.stop()

    def warm(self) -> float:
        """Read every large object once (the RAM tier fills and starts evicting);
        the seconds it took."""
        started = time.monotonic()
        data = self.config.dataset
        with Client(self.daemon.socket, cache_bytes=0, timeout=120.0) as client:
            for i in range(data.large_objects):
                client.read(f"{data.backend}/{data.large_key(i)}")
        return time.monotonic() - started

    def load(
        self,
        phase: str,
        clients: int,
        duration: float,
        *,
        warmup: float | None = None,
        mix: Mapping[str, float] | None = None,
    ) -> LoadResult:
        """``clients`` client processes for ``duration`` seconds; the daemon sampled
        all along. ``warmup``: seconds left out of the drift figures (a fifth of the
        duration unless told)."""
        folder = self.work / f"clients-{phase}"
        folder.mkdir(parents=True, exist_ok=True)
        plans = [
            ClientPlan(
                index=i,
                phase=phase,
                socket=self.daemon.socket,
                dataset=self.config.dataset,
                state=self.config.state,
                mix=dict(mix or self.config.mix),
                duration=duration,
                chunk_bytes=self.config.chunk_bytes,
                cache_bytes=self.config.client_cache_bytes,
                gc_every=self.config.gc_every,
                out=str(folder / f"report-{i}.json"),
            )
            for i in range(clients)
        ]
        processes = []
        environ = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
        with (folder / "stderr.log").open("ab") as stderr:
            for plan in plans:
                path = folder / f"plan-{plan.index}.json"
                path.write_text(json.dumps(plan.to_json()))
                processes.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "chunkd.testing.soak", str(path)],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=stderr,
                        env=environ,
                        text=True,
                    )
                )
        failures: list[str] = []
        try:
            for plan, process in zip(plans, processes, strict=True):
                assert process.stdout is not None
                if process.stdout.readline().strip() != "ready":
                    failures.append(f"client {plan.index} did not start (see {folder})")
            series = self.sampler.begin([p.pid for p in processes])
            started = time.monotonic()
            for process in processes:
                assert process.stdin is not None
                with contextlib.suppress(BrokenPipeError):
                    process.stdin.write("go\n")
                    process.stdin.flush()
            # An op in flight at the deadline ends first (a collection may take a while).
            deadline = started + duration + 180.0
            for plan, process in zip(plans, processes, strict=True):
                try:
                    code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                    failures.append(f"client {plan.index} was still running at the deadline")
                    continue
                if code != 0:
                    failures.append(f"client {plan.index} exited with {code} (see {folder})")
            seconds = time.monotonic() - started
            self.sampler.begin([])  # the phase's series is complete
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
                for pipe in (process.stdin, process.stdout):
                    if pipe is not None:
                        with contextlib.suppress(BrokenPipeError):
                            pipe.close()
        if self.sampler.failure:
            failures.append(self.sampler.failure)
        merged = ClientReport()
        for plan in plans:
            try:
                merged.merge(ClientReport.from_json(json.loads(Path(plan.out).read_text())))
            except (OSError, ValueError, KeyError) as exc:
                failures.append(f"client {plan.index} left no report: {exc}")
        return LoadResult(
            phase=phase,
            clients=clients,
            seconds=seconds,
            warmup=duration / 5 if warmup is None else warmup,
            ram_bytes=self.config.ram_bytes,
            epsilon=self.config.epsilon(clients),
            report=merged,
            series=series,
            client_failures=failures,
        )

    def check_serving(self) -> None:
        """A fresh client reads and checks one object of each kind, and ``/readyz``
        answers: the daemon still serves.

        Raises:
            AssertionError: it does not.
        """
        data = self.config.dataset
        assert self.daemon.ready(), "the daemon's /readyz does not answer 200"
        with Client(self.daemon.socket, cache_bytes=0, timeout=60.0) as client:
            for name, key_id, size in (
                (data.small_key(0), data.small_id(0), data.small_size(0)),
                (data.large_key(0), data.large_id(0), data.large_size(0)),
            ):
                got = np.frombuffer(client.read(f"{data.backend}/{name}"), dtype=np.uint8)
                assert np.array_equal(got, content(key_id, 0, size)), f"{name} reads wrong"


if __name__ == "__main__":
    raise SystemExit(client_main(sys.argv[1]))
