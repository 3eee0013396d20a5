"""The soak: 64 client processes against one daemon for 30 minutes (``--only soak``).

The clients of :mod:`chunkd.testing.soak` (numpy only) draw mixed reads, listings,
prefetches, checkpoint saves, loads and collections, and check every byte; the
daemon is sampled once a second. First one client runs alone for a while on the same
daemon, warm: its latencies are the baseline of the rows "OP p99, N clients vs 1".
The other rows: the ops that succeeded (all of them, or the row is missed), the
daemon's memory peak against ``ram_bytes`` plus ε (the soak module's docstring says
what ε holds), fds and its own pages in the last fifth of the run against the first
fifth after the warm-up, and the threads' peak.

Into the out dir: ``soak-solo.*`` and ``soak-full.*`` (Markdown, JSON with the time
series, CSV of the time series) and ``soak.svg`` (memory and fds over time).
"""

from __future__ import annotations

import time
from pathlib import Path

from chunkd.testing.soak import (
    GiB,
    LoadResult,
    MiB,
    Soak,
    SoakConfig,
    SoakDataset,
    sample_process,
)

from .report import Report, Result

#: tokio's default cap of blocking threads (obstore's runtime), plus the daemon's own
THREAD_CAP = 512 + 64


def _config(quick: bool) -> SoakConfig:
    if quick:
        return SoakConfig(dataset=SoakDataset(small_objects=2000, large_objects=24), gc_every=2)
    # A dataset of about 1.5 GiB against a 512 MiB RAM tier: it evicts all along.
    return SoakConfig(
        dataset=SoakDataset(small_objects=10_000, large_objects=400),
        ram_bytes=512 * MiB,
        disk_bytes=4 * GiB,
    )


def run(
    report: Report,
    work: Path,
    out: Path,
    *,
    quick: bool,
    duration: float | None = None,
    clients: int | None = None,
) -> None:
    """The soak: ``clients`` (64; quick: 3) for ``duration`` seconds (1800; quick: 20),
    after one client alone for a tenth of that (at least 5 s, at most 2 minutes)."""
    duration = duration if duration is not None else 20.0 if quick else 1800.0
    clients = clients if clients is not None else 3 if quick else 64
    solo_seconds = min(120.0, max(5.0, duration / 10))
    config = _config(quick)
    started = time.monotonic()
    with Soak(work, config) as soak:
        print(f"soak: dataset of {config.dataset.total_bytes / GiB:.2f} GiB written", flush=True)
        soak.warm()
        time.sleep(12.0)  # tokio's idle blocking threads go after 10 s
        rest = sample_process(soak.daemon.pid)
        print(f"soak: one client alone for {solo_seconds:.0f} s", flush=True)
        solo = soak.load("solo", 1, solo_seconds)
        print(f"soak: {clients} clients for {duration:.0f} s", flush=True)
        full = soak.load("full", clients, duration)
        soak.check_serving()
        log = soak.daemon.log_report()
    solo.write(out)
    full.write(out)
    (out / "soak.svg").write_text(_svg(full))
    print(full.markdown(), flush=True)
    _rows(report, solo, full, rest.threads, quick=quick)
    print(
        f"soak: done in {time.monotonic() - started:.0f} s; daemon log: {log.tracebacks} "
        f"tracebacks, {log.errors} errors, {log.warnings} warnings",
        flush=True,
    )
    if log.tracebacks or log.errors:
        print("soak: the daemon's log: " + " | ".join(log.first), flush=True)


def _rows(
    report: Report, solo: LoadResult, full: LoadResult, rest_threads: int, *, quick: bool
) -> None:
    n = full.clients
    label = f"{n} clients, {full.seconds / 60:.0f} min" if not quick else f"{n} clients (quick)"
    for op, stats in full.ops.items():
        alone = solo.ops.get(op)
        if alone is None or not alone.count or not stats.count:
            continue  # a rare op (a collection) may not come up in a short solo run
        report.add(
            Result(
                f"soak: {op} p99, {n} clients vs 1",
                stats.p99 * 1e3,
                alone.p99 * 1e3,
                "ms",
                "the same op, one client alone on the same daemon",
                note=f"p50 {stats.p50 * 1e3:.1f} ms vs {alone.p50 * 1e3:.1f} ms; "
                f"{stats.count} ops; 2 cores shared by the daemon and every client",
            )
        )
    ops = sum(s.count for s in full.ops.values())
    report.add(
        Result(
            f"soak: ops that succeeded, {label}",
            ops,
            ops + full.errors,
            "ops",
            "every op the clients ran",
            target_ratio=1.0,
            note=(
                f"every byte checked: {full.report.verified_reads} reads "
                f"({full.report.verified_bytes / GiB:.1f} GiB), {full.report.verified_loads} "
                f"checkpoint loads, {full.report.verified_pages} listing pages"
                + (f"; first errors: {full.summary()['first_errors'][:3]}" if full.errors else "")
            ),
        )
    )
    peak = full.peak
    report.add(
        Result(
            "soak: daemon memory peak, of ram_bytes + epsilon",
            full.peak_footprint / MiB,
            full.limit / MiB,
            "MiB",
            f"ram_bytes {full.ram_bytes / MiB:.0f} MiB + epsilon {full.epsilon / MiB:.0f} MiB",
            target_max=full.limit / MiB,
            note=(
                "PSS - Pss_Shmem + every memfd held (by fd or mapping, once each); peaks: "
                f"cache memfds {peak.cache_memfd_bytes / MiB:.0f} MiB, staged saves "
                f"{peak.staged_memfd_bytes / MiB:.0f} MiB, own pages "
                f"{peak.process_bytes / MiB:.0f} MiB; node Shmem {peak.node_shmem / MiB:.0f} "
                f"MiB, clients' PSS {peak.clients_pss / MiB:.0f} MiB"
            ),
        )
    )
    report.add(
        Result(
            "soak: RAM tier's memfds peak, of ram_bytes",
            peak.cache_memfd_bytes / MiB,
            full.ram_bytes / MiB,
            "MiB",
            "ram_bytes",
            target_max=(full.ram_bytes + n * MiB) / MiB,
            note="allowed: ram_bytes plus 1 MiB a client, chunks that reads in flight hold "
            "after their eviction",
        )
    )
    early, late = full.settled("process_bytes")
    report.add(
        Result(
            "soak: daemon's own pages, last fifth vs first after warm-up",
            late / MiB,
            early / MiB,
            "MiB",
            "the same, first fifth after the warm-up",
            note="PSS - Pss_Shmem, medians: a heap that grows with requests served shows here",
        )
    )
    for gauge, what, slack, note in (
        ("fds", "fds", None, "medians; memfds move with the mix of chunks the RAM tier holds"),
        (
            "untiered_fds",
            "fds but the RAM tier's chunks",
            32.0,
            "connections, files, staged saves, chunks held by reads in flight: flat, or "
            "something leaks",
        ),
    ):
        early, late = full.settled(gauge)
        report.add(
            Result(
                f"soak: daemon {what}, last fifth vs first after warm-up",
                late,
                early,
                "fds",
                "the same, first fifth after the warm-up",
                target_max=None if slack is None else early + slack,
                note=note,
            )
        )
    report.add(
        Result(
            "soak: daemon threads, peak vs at rest",
            peak.threads,
            rest_threads,
            "threads",
            "the daemon at rest before the load",
            target_max=THREAD_CAP,
            note="obstore's tokio runtime keeps up to 512 blocking threads, each for 10 s idle",
        )
    )
    report.add(
        Result(
            f"soak: daemon's event loop CPU, {n} clients vs 1",
            full.cpu_rate("loop_cpu_s"),
            solo.cpu_rate("loop_cpu_s"),
            "s/s",
            "one client alone",
            note=f"the whole daemon: {full.cpu_rate('cpu_s'):.2f} s/s vs "
            f"{solo.cpu_rate('cpu_s'):.2f} s/s; 1.00 is a core: the loop serves every request",
        )
    )
    rate = ops / full.seconds
    report.add(
        Result(
            f"soak: ops/s, {n} clients vs 1",
            rate,
            sum(s.count for s in solo.ops.values()) / solo.seconds,
            "ops/s",
            "one client alone",
        )
    )


def _svg(result: LoadResult) -> str:
    """Memory (MiB) and fds over the run, one polyline each, the limit dashed."""
    samples = result.series.samples
    width, height, left = 720, 240, 50
    end = max((s.t for s in samples), default=1.0) or 1.0
    lines = {
        "footprint": ("#c0504d", [s.footprint / MiB for s in samples]),
        "cache memfds": ("#4f81bd", [s.cache_memfd_bytes / MiB for s in samples]),
        "own pages": ("#6a9955", [s.process_bytes / MiB for s in samples]),
        "staged saves": ("#9b59b6", [s.staged_memfd_bytes / MiB for s in samples]),
    }
    top = max([result.limit / MiB, *(v for _, vs in lines.values() for v in vs)]) * 1.05
    fds = [float(s.fds) for s in samples]
    fd_top = max(fds, default=1.0) * 1.1 or 1.0

    def path(values: list[float], scale: float, base: int) -> str:
        return " ".join(
            f"{left + s.t / end * width:.1f},{base + height - v / scale * height:.1f}"
            for s, v in zip(samples, values, strict=True)
        )

    parts = [
        f'<polyline fill="none" stroke="{color}" stroke-width="1.5" '
        f'points="{path(values, top, 20)}"><title>{name}</title></polyline>'
        for name, (color, values) in lines.items()
    ]
    limit_y = 20 + height - result.limit / MiB / top * height
    parts.append(
        f'<line x1="{left}" x2="{left + width}" y1="{limit_y:.1f}" y2="{limit_y:.1f}" '
        f'stroke="#333" stroke-dasharray="4 3"><title>ram_bytes + epsilon</title></line>'
    )
    fd_base = height + 60
    parts.append(
        f'<polyline fill="none" stroke="#333" stroke-width="1.5" '
        f'points="{path(fds, fd_top, fd_base)}"><title>fds</title></polyline>'
    )
    legend = "".join(
        f'<rect x="{left + i * 130}" y="4" width="12" height="12" fill="{color}"/>'
        f'<text x="{left + 16 + i * 130}" y="14" font-size="12">{name}</text>'
        for i, (name, (color, _)) in enumerate(lines.items())
    )
    axes = "".join(
        f'<line x1="{left}" x2="{left + width}" y1="{base + height}" y2="{base + height}" '
        f'stroke="#999"/><text x="{left - 14}" y="{base + height + 4}" font-size="11">0</text>'
        for base in (20, fd_base)
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 110}" '
        f'height="{2 * height + 90}">{legend}{axes}'
        f'<text x="2" y="30" font-size="11">{top:.0f}</text>'
        f'<text x="2" y="{20 + height // 2}" font-size="11">MiB</text>'
        f'<text x="{left + width + 4}" y="{limit_y + 4:.0f}" font-size="11">ram + epsilon</text>'
        f'<text x="2" y="{fd_base + 10}" font-size="11">{fd_top:.0f}</text>'
        f'<text x="2" y="{fd_base + height // 2}" font-size="11">fds</text>'
        f'<text x="{left}" y="{2 * height + 85}" font-size="11">0 s</text>'
        f'<text x="{left + width - 40}" y="{2 * height + 85}" font-size="11">{end:.0f} s</text>'
        f"{''.join(parts)}</svg>\n"
    )
