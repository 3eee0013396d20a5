"""One soak client process (``python -m chunkd.testing.soak PLAN``; numpy, never
torch): its plan, its loop of ops drawn from a weighted mix, every answer checked, and
its report of latencies (bounded histograms) and errors."""

from __future__ import annotations

import contextlib
import json
import math
import random
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Final

import numpy as np

from chunkd.client import Client, checkpoint
from chunkd.testing.soak.content import (
    MiB,
    SoakDataset,
    SoakMismatchError,
    StateShape,
    _mix,
    content,
)

__all__ = [
    "DEFAULT_MIX",
    "ERRORS_KEPT",
    "ClientPlan",
    "ClientReport",
    "LatencyHistogram",
    "SoakClient",
    "client_main",
]

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
