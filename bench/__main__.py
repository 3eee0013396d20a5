"""``python -m bench``: run the benchmarks and write the report.

Writes into ``--out`` (default ``bench/out``): ``report.html`` (a table per area with
each ratio, its spread and target, the plots, and each row against the previous run),
``report.md``, ``results.json``, ``series.json``, the plots as ``plot-*.svg``, and the
run into ``history/`` (the last 50 runs on this machine).

Options: ``--quick`` (small sizes, few rounds; checks the benchmarks work, figures mean
little), ``--out DIR``, ``--work DIR`` (scratch space on the disk under test; default
``OUT/work``), ``--only SCENARIO`` (repeatable; ``ckpt`` runs every checkpoint
scenario; ``loader`` the loader by columns), ``--rounds N`` (every scenario that takes
rounds runs N; by default saves run 5 or more and the others 3 or more). The soak (64
clients for 30 minutes) runs only when asked for: ``--only soak``; it is not part of the
run of every scenario.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import sys
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
from .report import Report


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


def main() -> int:
    """Run the benchmarks; 0 when every target was met."""
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
        choices=(
            *cache_bench.SCENARIOS,
            "gateway",
            "client",
            "listing",
            "ckpt",
            *ckpt_bench.SCENARIOS,
            "fanout",
            "coldlink",
            "ttfb",
            "loader",
            "datasets",
            "inspector",
            "s3front",
            "faults",
            "soak",
        ),
        help="run only this scenario (repeatable); 'soak' (30 minutes) runs only so",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        metavar="N",
        help="rounds for every scenario that takes them (default: 5+ for saves, 3+ others)",
    )
    args = parser.parse_args()
    if args.rounds is not None and not 1 <= args.rounds <= 64:
        parser.error("--rounds takes 1 to 64")
    # A SIGTERM (a timeout, a CI job stopped) unwinds like Ctrl-C, so the fan-out
    # lab still removes its namespaces and stops its daemons; a second one (timeout
    # passes its own on) must not cut that cleanup short.
    signal.signal(signal.SIGTERM, _unwind)
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    report = Report(quick=args.quick, rounds_override=args.rounds)
    print(f"  {'scenario':<52} {'chunkd':>10}    {'baseline':>10} {'unit':<7} {'ratio':>7}")
    only = set(args.only) if args.only else None

    def wanted(name: str, area: str, line: str) -> bool:
        if only is None or name in only:
            report.area = area
            print(line, flush=True)
            return True
        return False

    try:
        report.area = "cache"
        asyncio.run(cache_bench.run(report, work, quick=args.quick, only=only))
        if wanted("gateway", "gateway (read path)", "gateway: read path"):
            asyncio.run(gateway_bench.run(report, work / "gateway", quick=args.quick))
        if wanted("client", "client", "client: local socket"):
            client_bench.run(report, work / "client", quick=args.quick)
        if wanted("listing", "listing", "listing: file:// and S3, through chunkd and obstore"):
            asyncio.run(listing_bench.run(report, work / "listing", quick=args.quick))
        if only is None or "ckpt" in only or only & set(ckpt_bench.SCENARIOS):
            report.area = "checkpoints"
            print("ckpt: checkpoints", flush=True)
            asyncio.run(ckpt_bench.run(report, work / "ckpt", quick=args.quick, only=only))
        if wanted("fanout", "fan-out", "fanout: 4 nodes in network namespaces"):
            fanout_bench.run(report, work / "fanout", args.out, quick=args.quick)
        if wanted(
            "coldlink",
            "cold reads at link speed",
            "coldlink: cold reads over a shaped link with added latency, against obstore",
        ):
            coldlink_bench.run(report, work / "coldlink", quick=args.quick)
        if wanted(
            "datasets",
            "datasets and time to first batch",
            "datasets: registration, and the read order's locality",
        ):
            dataset_bench.run(report, work / "datasets", quick=args.quick)
            order_bench.run(report, work / "order", quick=args.quick)
            scale_bench.run(report, work / "scale", quick=args.quick)
        if wanted("inspector", "inspector", "inspector: first page and last row in Chromium"):
            inspector_bench.run(report, work / "inspector", quick=args.quick)
        if wanted("s3front", "S3 front", "s3front: the S3 front, against the other doors"):
            s3front_bench.run(report, work / "s3front", quick=args.quick)
        if wanted("faults", "faults", "faults: what the fault points cost when none is armed"):
            faults_bench.run(report, work / "faults", quick=args.quick)
        # Not in the quick run of every scenario (the test suite's, which has a test of
        # its own for it): the loader's rounds take processes, daemons and epochs.
        if (only is None and not args.quick) or (only is not None and "loader" in only):
            report.area = "datasets and time to first batch"
            print("loader: columns, against pyarrow and each format's own reader", flush=True)
            loader_bench.run(report, work / "loader", quick=args.quick)
        # Not in the quick run of every scenario (the test suite's): its Streaming
        # baseline needs a venv of its own, which only a full run builds.
        if (only is None and not args.quick) or (only is not None and "ttfb" in only):
            report.area = "datasets and time to first batch"
            print("ttfb: time to first batch, against MosaicML Streaming and pyarrow", flush=True)
            ttfb_bench.run(report, work / "ttfb", quick=args.quick)
        # Only when asked for: 30 minutes (a quick soak is still over 40 s with its
        # solo phase and the wait for idle threads), too long for the run of everything.
        if only is not None and "soak" in only:
            report.area = "soak"
            print("soak: clients against one daemon", flush=True)
            soak_bench.run(report, work / "soak", args.out, quick=args.quick)
            _soak_latencies(report, args.out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report.write(args.out)
    print(f"\nreport: {args.out / 'report.html'} (and report.md)")
    missed = [r.scenario for r in report.results if r.verdict == "MISSED"]
    if missed:
        print("targets missed: " + "; ".join(missed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
