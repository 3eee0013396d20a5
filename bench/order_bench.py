"""The read order at scale: order version 2 (a paged snapshot's, built from its root)
against version 1 (arrays over every unit), and how each mixes.

1. **Build time and memory at 10M units** (1.25M Parquet-like members of 8 row groups of
   125 rows): a fresh process builds the epoch's order and locates a step's run of
   positions (its first batch's): :class:`~chunkd.client.datasets.order.PagedOrder`
   from the root's pages (members made on demand, a page at a time, as a page source
   would serve them), against :class:`~chunkd.client.datasets.order.Order` from the
   members' sample counts, units and decoded bytes already in hand (what ``order_of``
   builds for a schema-1 snapshot, less the pass over every member that works those
   lists out). The figures: seconds, and the process's memory growth (VmHWM after the
   imports to VmHWM at the end).
2. **At 100M units** (12.5M members): version 1 does not fit (its arrays and lists are
   over 10 GB); version 2 against its own figure at 10M units (the cost does not grow
   with the units).
3. **Locality and mixing**: over the epoch of 100,000 such members (``--quick``:
   10,000; 19 pages), both orders against a full random permutation of every row, in
   6 runs of 50,000 rows spread over the epoch: the most row groups a reader holds
   open in a run, and the mean distance between adjacent samples in the snapshot (a
   full shuffle: about N / 3).

``--quick``: 50,000 and 500,000 units.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

from .report import Report, Result, Rounds

REPO = Path(__file__).resolve().parent.parent

#: each member: 8 row groups of 125 rows, 8 MiB decoded each (windows bounded by units)
GROUPS, ROWS, DECODED = 8, 125, 8 << 20


class PageEntry(NamedTuple):
    """A generated root's entry for one page."""

    id: str
    members: int
    samples: int


class GeneratedRoot:
    """A schema-2 snapshot's root of ``units`` Parquet-like row groups, whose pages'
    members are made when a page is asked for (deterministically from its index): what
    an order reads of a snapshot (:class:`~chunkd.client.datasets.order.PagedSnapshot`)
    without writing millions of members. Page sizes are drawn as content-defined cuts
    make them: geometric, mean 4,096, at most 16,384."""

    schema = 2

    def __init__(self, units: int) -> None:
        import numpy as np

        members = max(1, units // GROUPS)
        self.id = hashlib.sha256(f"chunkd.bench.order:{units}".encode()).hexdigest()
        rng = np.random.default_rng(units)
        sizes: list[int] = []
        left = members
        while left:
            size = min(left, 16_384, max(1, int(rng.geometric(1 / 4096))))
            sizes.append(size)
            left -= size
        self.pages = tuple(
            PageEntry(hashlib.sha256(f"{self.id}:{i}".encode()).hexdigest(), n, n * GROUPS * ROWS)
            for i, n in enumerate(sizes)
        )
        self.starts = [0, *np.cumsum(sizes).tolist()]
        self.loads = 0

    def page_members(self, page: int) -> tuple[Any, ...]:
        from chunkd.snapshot import Member

        self.loads += 1
        groups = [[ROWS, 4 + g * 4096, 4096, DECODED] for g in range(GROUPS)]
        meta = {"footer": [4 + GROUPS * 4096, 512], "row_groups": groups}
        first = self.starts[page]
        return tuple(
            Member(f"part-{first + j:09d}.parquet", 40_000, "v", "parquet", GROUPS * ROWS, meta)
            for j in range(self.pages[page].members)
        )


def measure(kind: str, units: int) -> dict[str, float]:
    """In this (fresh) process: build ``kind``'s order of ``units`` and locate a step's
    run; its seconds and the memory it added."""
    import time

    import numpy as np

    from chunkd.client.datasets.formats import format_of
    from chunkd.client.datasets.order import Order, PagedOrder

    format_of("parquet")  # an import: not counted
    base = _status("VmHWM")
    started = time.perf_counter()
    if kind == "v2":
        root = GeneratedRoot(units)
        order: Any = PagedOrder(root, seed=1, epoch=0)
    else:
        members = units // GROUPS
        counts = [GROUPS * ROWS] * members
        unit_counts = [[ROWS] * GROUPS for _ in range(members)]
        costs = [[DECODED] * GROUPS for _ in range(members)]
        order = Order(
            counts,
            snapshot="0" * 64,
            seed=1,
            epoch=0,
            units=unit_counts,
            unit_bytes=costs,
        )
    built = time.perf_counter() - started
    order.locate(np.arange(0, 256, dtype=np.int64))
    first = time.perf_counter() - started
    return {"build": built, "first": first, "grew": float(_status("VmHWM") - base)}


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise LookupError(field)


def _fresh(kind: str, units: int) -> dict[str, float]:
    code = (
        "import json, sys\n"
        "from bench.order_bench import measure\n"
        "print(json.dumps(measure(sys.argv[1], int(sys.argv[2]))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, kind, str(units)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    found: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return found


def _scale(report: Report, *, quick: bool) -> None:
    small, large = (50_000, 500_000) if quick else (10_000_000, 100_000_000)
    rounds = report.rounds_for(1 if quick else 3)
    ours: list[dict[str, float]] = []
    theirs: list[dict[str, float]] = []
    for _ in range(rounds):
        ours.append(_fresh("v2", small))
        theirs.append(_fresh("v1", small))
    big = [_fresh("v2", large) for _ in range(rounds)]

    def pick(runs: list[dict[str, float]], key: str) -> list[float]:
        return [max(r[key], 1e-6) for r in runs]

    label = f"{small / 1e6:g}M units ({small // GROUPS:,} members)"
    report.add(
        Result(
            f"order: build and first positions at {label}",
            statistics.median(pick(ours, "first")),
            statistics.median(pick(theirs, "first")),
            "s",
            "order version 1 (arrays over every unit)",
            samples=Rounds.of(pick(ours, "first"), pick(theirs, "first")),
            better="lower",
            note=(
                "a fresh process each: version 2 (PagedOrder) builds from the root's "
                f"{len(GeneratedRoot(small).pages):,} pages (median "
                f"{statistics.median(pick(ours, 'build')) * 1e3:.1f} ms) and loads one "
                "group of at most 4 pages and 32,768 members for the first run of "
                "positions; version 1 (Order) builds its arrays from the members' counts, "
                "units and decoded bytes in hand (median "
                f"{statistics.median(pick(theirs, 'build')):.2f} s), not counting the pass "
                "over every member that works them out (order_of's)"
            ),
        )
    )
    report.add(
        Result(
            f"order: memory at {label}",
            statistics.median(pick(ours, "grew")) / 2**20,
            statistics.median(pick(theirs, "grew")) / 2**20,
            "MiB",
            "order version 1 (arrays over every unit)",
            samples=Rounds.of(
                [x / 2**20 for x in pick(ours, "grew")], [x / 2**20 for x in pick(theirs, "grew")]
            ),
            better="lower",
            note=(
                "the process's peak memory growth (VmHWM) from after its imports to after "
                "the first run of positions: version 2 holds the root's arrays and one "
                "group (its pages' members made and dropped); version 1 its lists and "
                "arrays over every unit"
            ),
        )
    )
    label_big = f"{large / 1e6:g}M units ({large // GROUPS:,} members)"
    report.add(
        Result(
            f"order: build and first positions at {label_big}",
            statistics.median(pick(big, "first")),
            statistics.median(pick(ours, "first")),
            "s",
            f"order version 2 at {small / 1e6:g}M units",
            samples=Rounds.of(pick(big, "first"), pick(ours, "first")),
            better="lower",
            note=(
                f"version 1 does not fit here (its arrays and lists: about "
                f"{statistics.median(pick(theirs, 'grew')) * large / small / 2**30:.0f} GiB "
                f"by its figure at {small / 1e6:g}M); version 2's build is O(pages) "
                f"({len(GeneratedRoot(large).pages):,} pages, median "
                f"{statistics.median(pick(big, 'build')) * 1e3:.1f} ms) and its memory "
                f"grew {statistics.median(pick(big, 'grew')) / 2**20:.0f} MiB (at "
                f"{small / 1e6:g}M: {statistics.median(pick(ours, 'grew')) / 2**20:.0f} MiB); "
                "the first positions cost one group, whatever the units"
            ),
        )
    )


def _spread(order: Any, starts: list[int], run: int) -> Any:
    """:func:`~chunkd.client.datasets.order.quality` over runs of ``run`` positions at
    ``starts``: the mean gap over all of them, the most units and members held and
    touched in one."""
    from chunkd.client.datasets.order import OrderQuality, quality

    found = [quality(order, start, start + run) for start in starts]
    return OrderQuality(
        sum(q.positions for q in found),
        max(q.members_touched for q in found),
        max(q.members_held for q in found),
        statistics.fmean(q.mean_gap for q in found),
        max(q.units_touched for q in found),
        max(q.units_held for q in found),
    )


def _mixing(report: Report, *, quick: bool) -> None:
    """Locality and mixing of both versions against a full random permutation."""
    from chunkd.client.datasets.order import Order, PagedOrder

    files = 10_000 if quick else 100_000
    root = GeneratedRoot(files * GROUPS)
    counts = [GROUPS * ROWS] * files
    units = [[ROWS] * GROUPS] * files
    costs = [[DECODED] * GROUPS] * files
    total = files * GROUPS * ROWS
    run, count = (50_000, 6)  # runs spread over the epoch: its groups, not its first
    starts = [i * (total - run) // (count - 1) for i in range(count)]
    held: tuple[list[float], list[float]] = ([], [])
    gaps: tuple[list[float], list[float]] = ([], [])
    figures: list[tuple[Any, ...]] = []
    for seed in range(1, report.rounds_for(1 if quick else 3) + 1):
        kw: dict[str, Any] = {"snapshot": root.id, "seed": seed, "epoch": 0}
        v1 = Order(counts, units=units, unit_bytes=costs, **kw)
        full = Order(counts, units=units, unit_bytes=costs, window=None, window_bytes=None, **kw)
        v2 = PagedOrder(root, seed=seed, epoch=0)
        got = tuple(_spread(order, starts, run) for order in (v2, v1, full))
        figures.append(got)
        held[0].append(float(got[0].units_held))
        held[1].append(float(got[2].units_held))
        gaps[0].append(got[0].mean_gap)
        gaps[1].append(got[1].mean_gap)
    v2q, v1q, fullq = figures[0]
    report.add(
        Result(
            f"order v2: row groups held open over {run:,} rows ({files:,} files x {GROUPS} groups)",
            statistics.median(held[0]),
            statistics.median(held[1]),
            "groups",
            "a full random permutation",
            samples=Rounds.of(*held),
            better="lower",
            note=(
                f"the most over {count} runs spread over the epoch; seeds 1-{len(held[0])}; "
                f"seed 1: version 2 holds {v2q.units_held} row groups ({v2q.members_held} "
                f"files), version 1 {v1q.units_held} ({v1q.members_held}), the full shuffle "
                f"{fullq.units_held} ({fullq.members_held}); row groups touched in a run: "
                f"{v2q.units_touched} / {v1q.units_touched} / {fullq.units_touched}"
            ),
        )
    )
    report.add(
        Result(
            f"order v2: mean distance between adjacent samples ({count} runs of {run:,} rows)",
            statistics.median(gaps[0]),
            statistics.median(gaps[1]),
            "samples",
            "order version 1 (windows over the whole dataset)",
            samples=Rounds.of(*gaps),
            better="higher",
            note=(
                f"in snapshot indices, over {total:,} samples; seed 1: version 2 "
                f"{v2q.mean_gap:,.0f}, version 1 {v1q.mean_gap:,.0f}, the full shuffle "
                f"{fullq.mean_gap:,.0f} (version 2: "
                f"{v2q.mean_gap / max(fullq.mean_gap, 1e-9):.2f} of it, version 1: "
                f"{v1q.mean_gap / max(fullq.mean_gap, 1e-9):.2f}; in order: 1): a window's "
                "units come from the 2-4 pages of a group"
            ),
        )
    )


def run(report: Report, work: Path, *, quick: bool) -> None:
    """The scenarios (see the module docstring)."""
    del work  # nothing is written
    _mixing(report, quick=quick)
    _scale(report, quick=quick)
