"""``python -m bench``: run every benchmark and write the report.

Options: ``--quick`` (small sizes; checks the benchmarks work, figures mean little),
``--out DIR`` (default ``bench/out``), ``--work DIR`` (scratch space on the disk
under test; default ``DIR/work``), ``--only SCENARIO`` (repeatable; ``ckpt`` runs every
checkpoint scenario).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import sys
from pathlib import Path

from . import (
    cache_bench,
    ckpt_bench,
    client_bench,
    dataset_bench,
    fanout_bench,
    faults_bench,
    gateway_bench,
    inspector_bench,
    listing_bench,
    s3front_bench,
    ttfb_bench,
)
from .report import Report


def _unwind(signum: int, _frame: object) -> None:
    signal.signal(signum, signal.SIG_IGN)
    sys.exit(128 + signum)


def main() -> int:
    """Run the benchmarks; 0 when every target was met."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
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
            "ttfb",
            "datasets",
            "inspector",
            "s3front",
            "faults",
        ),
        help="run only this scenario (repeatable)",
    )
    args = parser.parse_args()
    # A SIGTERM (a timeout, a CI job stopped) unwinds like Ctrl-C, so the fan-out
    # lab still removes its namespaces and stops its daemons; a second one (timeout
    # passes its own on) must not cut that cleanup short.
    signal.signal(signal.SIGTERM, _unwind)
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    report = Report()
    print(f"  {'scenario':<52} {'chunkd':>10}    {'baseline':>10} {'unit':<7} {'ratio':>7}")
    try:
        only = set(args.only) if args.only else None
        asyncio.run(cache_bench.run(report, work, quick=args.quick, only=only))
        if only is None or "gateway" in only:
            print("gateway: read path", flush=True)
            asyncio.run(gateway_bench.run(report, work / "gateway", quick=args.quick))
        if only is None or "client" in only:
            print("client: local socket", flush=True)
            client_bench.run(report, work / "client", quick=args.quick)
        if only is None or "listing" in only:
            print("listing: file:// and S3, through chunkd and with obstore", flush=True)
            asyncio.run(listing_bench.run(report, work / "listing", quick=args.quick))
        if only is None or "ckpt" in only or only & set(ckpt_bench.SCENARIOS):
            print("ckpt: checkpoints", flush=True)
            asyncio.run(ckpt_bench.run(report, work / "ckpt", quick=args.quick, only=only))
        if only is None or "fanout" in only:
            print("fanout: 4 nodes in network namespaces", flush=True)
            fanout_bench.run(report, work / "fanout", args.out, quick=args.quick)
        if only is None or "datasets" in only:
            print("datasets: registration, and the read order's locality", flush=True)
            dataset_bench.run(report, work / "datasets", quick=args.quick)
        if only is None or "inspector" in only:
            print("inspector: first page and last row in Chromium, against pyarrow", flush=True)
            inspector_bench.run(report, work / "inspector", quick=args.quick)
        if only is None or "s3front" in only:
            print("s3front: the S3 front, against the other doors and the S3 server", flush=True)
            s3front_bench.run(report, work / "s3front", quick=args.quick)
        if only is None or "faults" in only:
            print("faults: what the fault points cost when none is armed", flush=True)
            faults_bench.run(report, work / "faults", quick=args.quick)
        # Not in the quick run of every scenario (the test suite's): its Streaming
        # baseline needs a venv of its own, which only a full run builds.
        if (only is None and not args.quick) or (only is not None and "ttfb" in only):
            print("ttfb: time to first batch, against MosaicML Streaming and pyarrow", flush=True)
            ttfb_bench.run(report, work / "ttfb", quick=args.quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report.write(args.out)
    print(f"\nreport: {args.out / 'report.md'}")
    missed = [r.scenario for r in report.results if r.verdict == "MISSED"]
    if missed:
        print("targets missed: " + "; ".join(missed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
