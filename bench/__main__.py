"""``python -m bench``: run the benchmarks and write the report.

Each run writes into a folder of its own, ``OUT/runs/<UTC time>/`` (``--out``, default
``bench/out``): ``report.html`` (a table per area with each ratio, its spread, target and
verdict in words, each scenario's duration, the plots, and each row against the previous
run), ``report.md``, ``results.json``, ``durations.json``, ``series.json``, the plots as
``plot-*.svg``, and what a scenario writes of its own (the fan-out's logs, the soak's
summaries). ``OUT/latest`` points at the newest run (of two at once, the one that
started last); older runs stay (the last 50). Every run is also kept in
``OUT/history/``, which the next run compares with.

Options: ``--quick`` (small sizes, few rounds; checks the benchmarks work, figures mean
little), ``--out DIR``, ``--work DIR`` (scratch space on the disk under test: the run's
own ``DIR/<UTC time>/``, removed at its end; default the first free ``OUT/w<N>/``), ``--only
SCENARIO`` (repeatable; ``ckpt`` runs every checkpoint scenario), ``--rounds N`` (every
scenario that takes rounds runs N; by default saves run 5 or more and the others 3 or
more), ``--list`` (each scenario with its typical duration, from this machine's history
where it has one, else the estimate below; runs nothing).
The soak (64 clients for 30 minutes) runs only when asked for: ``--only soak``; it is not
part of the run of every scenario.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import (
    cache_bench,
    ckpt_bench,
    client_bench,
    coldlink_bench,
    dataset_bench,
    fanout_bench,
    faults_bench,
    gateway_bench,
    inspector_bench,
    listing_bench,
    loader_bench,
    order_bench,
    s3front_bench,
    scale_bench,
    soak_bench,
    ttfb_bench,
)
from .history import typical_durations
from .report import Report
from .results import duration_text


@dataclass(frozen=True)
class Scenario:
    """One thing ``--only`` names, and how long it takes when no history says."""

    name: str
    area: str
    #: estimated seconds of a full run and of a ``--quick`` one (the 2-core VM)
    full_s: float
    quick_s: float
    #: which runs it is part of: "every" run, "full" (not ``--quick``'s run of every
    #: scenario), or only when "asked" for with ``--only``
    runs_in: str = "every"
    #: what ``--list`` adds about a full run, and about a quick one
    note: str = ""
    quick_note: str = ""
    #: what it needs to give rows ("root", "CUDA"); without it, it is skipped in seconds
    needs: str = ""


_DATASETS = "datasets and time to first batch"
#: every scenario, in the order a run takes them, with its estimated duration (full,
#: quick) on the 2-core development VM. Where they come from: quick, a --quick run of
#: every scenario (2026-12-06, 152 s in all); full, the cache, client and faults
#: scenarios run alone (2026-12-06, under load from other work), the loader (83-115 s)
#: and ttfb (265-390 s) runs of issue 25, the 46-minute make bench of 2026-12-04 for the
#: others, and the datasets area's sizes (docs/scale.md) for it. The history of a
#: machine replaces them once it has run a scenario.
SCENARIOS: tuple[Scenario, ...] = (
    Scenario("ram_insert", "cache", 15, 0.5),
    Scenario("disk_insert", "cache", 30, 1),
    Scenario("disk_read", "cache", 10, 0.5),
    Scenario("ram_hits", "cache", 3, 0.5),
    Scenario("index_lookups", "cache", 6, 1),
    Scenario("index_open", "cache", 30, 1),
    Scenario("gateway", "gateway (read path)", 120, 12),
    Scenario("client", "client", 70, 14),
    Scenario("listing", "listing", 180, 5),
    Scenario("ckpt_blocking", "checkpoints", 150, 1.5),
    Scenario("ckpt_durable", "checkpoints", 180, 1),
    Scenario("ckpt_ranks", "checkpoints", 180, 1.5),
    Scenario("ckpt_delta", "checkpoints", 120, 1.5),
    Scenario("ckpt_load", "checkpoints", 120, 2),
    Scenario(
        "ckpt_blocking_cuda",
        "checkpoints",
        120,
        1,
        note="rows only with CUDA",
        quick_note="rows only with CUDA",
        needs="CUDA",
    ),
    Scenario(
        "fanout",
        "fan-out",
        900,
        150,
        note="root only: network namespaces",
        quick_note="root only: network namespaces",
        needs="root",
    ),
    Scenario(
        "coldlink",
        "cold reads at link speed",
        360,
        7,
        note="root only, with s3rver (make emulators)",
        quick_note="root only, with s3rver (make emulators)",
        needs="root",
    ),
    Scenario(
        "datasets",
        _DATASETS,
        1800,
        70,
        note="registers 100k and 1M files, opens 10M members; Ray's 1M files add about "
        "30 min where the disk has 16 GB free",
    ),
    Scenario("inspector", "inspector", 240, 4),
    Scenario("s3front", "S3 front", 120, 4),
    Scenario("faults", "faults", 90, 4),
    Scenario("loader", _DATASETS, 100, 30, runs_in="full"),
    Scenario(
        "ttfb",
        _DATASETS,
        330,
        80,
        runs_in="full",
        note="the first run on a machine also builds Streaming's venv: minutes more",
    ),
    Scenario(
        "soak",
        "soak",
        1920,
        60,
        runs_in="asked",
        note="64 clients for 30 minutes",
        quick_note="3 clients for 20 s",
    ),
)
#: what ``--only`` takes: every scenario, and ``ckpt`` for all the checkpoint ones
ONLY = (*(s.name for s in SCENARIOS), "ckpt")


def _unwind(signum: int, _frame: object) -> None:
    signal.signal(signum, signal.SIG_IGN)
    sys.exit(128 + signum)


def _soak_latencies(report: Report, out: Path) -> None:
    """The soak's per-op latencies (its JSON summaries: p50, p99, max) as plot series:
    one plot of N clients and one of a client alone."""
    for phase, title in (("full", "clients at once"), ("solo", "one client alone")):
        try:
            doc: dict[str, Any] = json.loads((out / f"soak-{phase}.json").read_text())
        except (OSError, ValueError):
            continue
        figure = f"soak: latency per op, {doc.get('clients', '?')} {title}"
        for op, stats in sorted(doc.get("ops", {}).items()):
            if stats.get("count"):
                report.latencies(
                    figure, op, {50: stats["p50"], 99: stats["p99"], 100: stats["max"]}
                )


def _list(out: Path, *, quick: bool) -> None:
    """Print every scenario with its typical duration in this mode, and where that figure
    comes from."""
    known = typical_durations(out / "history", quick=quick)
    mode = "--quick runs" if quick else "full runs (make bench)"
    print(f"Typical durations of {mode} on this machine, from {out / 'history'} or estimated:")
    print(f"{'scenario':<20} {'area':<34} {'typical':>9}  from")
    every, gated = 0.0, 0.0
    needs = []
    for scenario in SCENARIOS:
        typical = known.get(scenario.name)
        if typical is not None:
            seconds = typical.seconds
            source = (
                f"history: median of {typical.runs} run{'s' * (typical.runs > 1)}, "
                f"latest {typical.date}"
            )
            shown = duration_text(seconds)
        else:
            seconds = scenario.quick_s if quick else scenario.full_s
            source = "estimate"
            shown = "~" + duration_text(seconds)
        if scenario.runs_in == "asked":
            source += "; only with --only " + scenario.name
        elif scenario.runs_in == "full" and quick:
            source += "; not in --quick's run of every scenario"
        else:
            every += seconds
            if scenario.needs:
                gated += seconds
                needs += [scenario.needs] if scenario.needs not in needs else []
        note = scenario.quick_note if quick else scenario.note
        if note:
            source += f"; {note}"
        print(f"{scenario.name:<20} {scenario.area:<34} {shown:>9}  {source}")
    command = "python -m bench --quick" if quick else "make bench"
    gate = " / ".join(
        {"root": "as root", "CUDA": "with CUDA"}.get(n, n) for n in sorted(needs, reverse=True)
    )
    of_which = f", of which ~{duration_text(gated)} only {gate}" if gated else ""
    print(
        f"a run of every scenario ({command}): ~{duration_text(every)}{of_which} "
        "(each scenario where it runs; a skipped one takes seconds)"
    )
    print("--only ckpt runs every ckpt_* scenario")


def main() -> int:
    """Run the benchmarks; 0 when every scenario ran (missed targets are in the report)."""
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check the bench runs")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument(
        "--only",
        action="append",
        choices=ONLY,
        help="run only this scenario (repeatable); 'soak' (30 minutes) runs only so",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        metavar="N",
        help="rounds for every scenario that takes them (default: 5+ for saves, 3+ others)",
    )
    parser.add_argument(
        "--list",
        action="store_true",
        help="list the scenarios with their typical duration (with --quick: of a quick run)",
    )
    args = parser.parse_args()
    if args.rounds is not None and not 1 <= args.rounds <= 64:
        parser.error("--rounds takes 1 to 64")
    if args.list:
        _list(args.out, quick=args.quick)
        return 0
    # A SIGTERM (a timeout, a CI job stopped) unwinds like Ctrl-C, so the fan-out
    # lab still removes its namespaces and stops its daemons; a second one (timeout
    # passes its own on) must not cut that cleanup short.
    signal.signal(signal.SIGTERM, _unwind)
    report = Report(quick=args.quick, rounds_override=args.rounds)
    folder = report.folder(args.out)
    print(f"run folder: {folder}", flush=True)
    with scratch(folder, args.work) as work:
        _run(args, report, folder, work)
    folder = report.write(args.out)
    print(f"\nreport: {folder / 'report.html'} (and report.md; {args.out / 'latest'} points here)")
    print(f"run took {duration_text(time.time() - report.started)}")
    missed = report.missed()
    if missed:
        print(f"targets missed ({len(missed)}):")
        for line in missed:
            print(f"  {line}")
    return 0


@contextlib.contextmanager
def scratch(folder: Path, work: Path | None) -> Iterator[Path]:
    """The run's own scratch space, removed when the run ends however it ends: the
    first free ``OUT/w<N>`` (made with one ``mkdir``, so two runs never take the same;
    short, as the daemons' sockets live under it and a Unix socket's path holds at most
    107 bytes), or with ``--work DIR`` the run folder's name under ``DIR`` (``DIR``
    itself, someone's disk, is left). Two runs at once never share it: a shared
    ``OUT/work`` was removed by whichever run ended first, under the other's scenario."""
    if work is None:
        out = folder.parent.parent
        for n in itertools.count():
            path = out / f"w{n}"
            try:
                path.mkdir()
                break
            except FileExistsError:
                continue
    else:
        path = work / folder.name
        path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _run(args: argparse.Namespace, report: Report, folder: Path, work: Path) -> None:
    """Every scenario asked for, into ``report``; ``work`` is the run's scratch."""
    print(f"  {'scenario':<52} {'chunkd':>10}    {'baseline':>10} {'unit':<7} {'ratio':>7}")
    only = set(args.only) if args.only else None

    def wanted(name: str, line: str) -> bool:
        if only is None or name in only:
            print(line, flush=True)
            return True
        return False

    def area(name: str) -> str:
        return next(s.area for s in SCENARIOS if s.name == name)

    report.area = "cache"
    asyncio.run(cache_bench.run(report, work, quick=args.quick, only=only))
    if wanted("gateway", "gateway: read path"):
        with report.timed("gateway", area("gateway")):
            asyncio.run(gateway_bench.run(report, work / "gateway", quick=args.quick))
    if wanted("client", "client: local socket"):
        with report.timed("client", area("client")):
            client_bench.run(report, work / "client", quick=args.quick)
    if wanted("listing", "listing: file:// and S3, through chunkd and obstore"):
        with report.timed("listing", area("listing")):
            asyncio.run(listing_bench.run(report, work / "listing", quick=args.quick))
    if only is None or "ckpt" in only or only & set(ckpt_bench.SCENARIOS):
        report.area = "checkpoints"
        print("ckpt: checkpoints", flush=True)
        asyncio.run(ckpt_bench.run(report, work / "ckpt", quick=args.quick, only=only))
    if wanted("fanout", "fanout: 4 and 8 nodes, and a replaced node, in network namespaces"):
        with report.timed("fanout", area("fanout")):
            fanout_bench.run(report, work / "fanout", folder, quick=args.quick)
    if wanted(
        "coldlink",
        "coldlink: cold reads over a shaped link with added latency, against obstore",
    ):
        with report.timed("coldlink", area("coldlink")):
            coldlink_bench.run(report, work / "coldlink", quick=args.quick)
    if wanted("datasets", "datasets: registration, and the read order's locality"):
        with report.timed("datasets", area("datasets")):
            dataset_bench.run(report, work / "datasets", quick=args.quick)
            order_bench.run(report, work / "order", quick=args.quick)
            scale_bench.run(report, work / "scale", quick=args.quick)
    if wanted("inspector", "inspector: first page and last row in Chromium"):
        with report.timed("inspector", area("inspector")):
            inspector_bench.run(report, work / "inspector", quick=args.quick)
    if wanted("s3front", "s3front: the S3 front, against the other doors"):
        with report.timed("s3front", area("s3front")):
            s3front_bench.run(report, work / "s3front", quick=args.quick)
    if wanted("faults", "faults: what the fault points cost when none is armed"):
        with report.timed("faults", area("faults")):
            faults_bench.run(report, work / "faults", quick=args.quick)
    # Not in the quick run of every scenario (the test suite's, which has a test of
    # its own for it): the loader's rounds take processes, daemons and epochs.
    if (only is None and not args.quick) or (only is not None and "loader" in only):
        print("loader: columns, against pyarrow and each format's own reader", flush=True)
        with report.timed("loader", area("loader")):
            loader_bench.run(report, work / "loader", quick=args.quick)
    # Not in the quick run of every scenario (the test suite's): its Streaming
    # baseline needs a venv of its own, which only a full run builds.
    if (only is None and not args.quick) or (only is not None and "ttfb" in only):
        print("ttfb: time to first batch, against MosaicML Streaming and pyarrow", flush=True)
        with report.timed("ttfb", area("ttfb")):
            ttfb_bench.run(report, work / "ttfb", quick=args.quick)
    # Only when asked for: 30 minutes (a quick soak is still over 40 s with its
    # solo phase and the wait for idle threads), too long for the run of everything.
    if only is not None and "soak" in only:
        print("soak: clients against one daemon", flush=True)
        with report.timed("soak", area("soak")):
            soak_bench.run(report, work / "soak", folder, quick=args.quick)
            _soak_latencies(report, folder)


if __name__ == "__main__":
    raise SystemExit(main())
