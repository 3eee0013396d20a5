"""The loader by columns (issue 25), side by side with what a user would use instead.

Every figure is a rate over a whole epoch (or a fixed run), rounds interleaved with the
contenders' order rotating each round; a row gives the median and the min-max of the
per-round ratio. The VM's load average is in each note: the machine is shared.

1. **One process, warm**: a registered Parquet snapshot of 320,000 rows, 4 number columns
   (int64, float64, int32, float32), 2 files of 4 row groups of 40,000 rows, on the
   daemon's ``file://`` backend. chunkd: a ``Loader`` with its default settings (shuffled,
   windows of 16 units, decode ahead), batches of 256, ``batch.columns`` to numpy, an
   epoch, with ``shared_decode`` on (units decoded once by the daemon and mapped) and off
   (decoded in-process); and the per-sample path (``batch.samples``: a dict per row).
   Baselines: pyarrow ``ParquetFile(path).iter_batches(batch_size=256)`` over the same
   files in file order, each column ``.to_numpy()`` (the decode limit), and pyarrow row by
   row (``to_pylist`` per batch: the old comparison). One untimed epoch of each first
   (the daemon's cache, its decoded entries and the page cache warm).
2. **Four ranks of one node**: 4 processes started at once, each a ``Loader`` of rank r of
   4 (shared decode), against 4 pyarrow processes each reading row groups r, r+4, ... with
   ``iter_batches``; samples/s in all (samples over the span from the first start to the
   last end). A daemon restarted each round (its decoded entries empty): the daemon's
   ``chunkd_dataset_decodes_total`` and friends, scraped from ``/metrics`` before and
   after, show each unit decoded once per node, and ``chunkd_dataset_decoded_bytes``,
   polled every 20 ms, its peak against ``[datasets] decoded_bytes``; one more round
   under a budget of half the snapshot's decoded bytes.
3. **Formats**: JSON lines, WebDataset and MDS snapshots, one process, warm: the
   ``Loader``'s ``batch.columns`` over an epoch against each format's natural reader over
   the same files in file order: ``json.loads`` line by line; ``tarfile`` iteration
   reading each member; Streaming's own MDS reader (``MDSReader.get_item``, in the
   Streaming venv of :mod:`bench.streaming_side`) where that venv exists, else said so.
4. **Tensors that survive in-place ops**: a batch of 256 records of 4 KiB (a ``fixed``
   column): the default collate's copy of the read-only view into a tensor of its own,
   against a ``MAP_PRIVATE`` copy-on-write mapping of a sealed memfd of the same size (a
   tensor over it); each then ``add_(1)``. Time per batch, both with and without the
   ``add_``.

Where the one-process rows miss their target, one more epoch runs under cProfile and the
row's note gives the functions with the largest own time, with their share.

``python -m bench --only loader`` runs it; ``--quick`` (small sizes, one round) in well
under a minute. ``python -m bench.loader_bench rank ...`` and ``pyarrow-rank ...`` are
the rank processes of (2).

It is one job at ~950 lines: the loader's reading speed, one scenario family (one
process, four ranks, the formats, in-place tensors) against the readers a user would use
instead, sharing their snapshots, their registration, the daemon's decode metrics and the
interleaved rounds; the daemon is :class:`bench.daemon.BenchDaemon`, the Streaming venv
:mod:`bench.streaming_side`, and the rows go to :class:`bench.report.Report`.
"""

from __future__ import annotations

import argparse
import io
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .daemon import BenchDaemon
from .report import Report, Result, Rounds
from .streaming_side import StreamingVenv, ensure_venv

__all__ = ["DecodedPeak", "decode_metrics", "run"]

BATCH = 256
WORLD = 4
_HERE = Path(__file__).resolve()


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (5 min {five:.1f}) on {os.cpu_count()} cores"


def _interleaved(
    rounds: int, contenders: dict[str, Callable[[], tuple[int, float]]]
) -> dict[str, list[float]]:
    """Each contender's rate (items/s) per round; the order rotates by one each round."""
    names = list(contenders)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            items, seconds = contenders[name]()
            rates[name].append(items / max(seconds, 1e-9))
    return rates


def _add(
    report: Report,
    scenario: str,
    ours: list[float],
    theirs: list[float],
    unit: str,
    baseline: str,
    note: str,
    target: float | None = None,
) -> Result:
    result = Result(
        scenario,
        statistics.median(ours),
        statistics.median(theirs),
        unit,
        baseline,
        target_ratio=target,
        samples=Rounds.of(ours, theirs),
        note=note,
    )
    report.add(result)
    return result


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} [{min(values):,.0f}-{max(values):,.0f}]"


# -- data --------------------------------------------------------------------------------


def _write_parquet(folder: Path, files: int, groups: int, rows: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    n = groups * rows
    for i in range(files):
        table = pa.table(
            {
                "a": np.arange(i * n, (i + 1) * n, dtype=np.int64),
                "b": rng.random(n),
                "c": rng.integers(0, 1 << 30, n).astype(np.int32),
                "d": rng.random(n).astype(np.float32),
            }
        )
        pq.write_table(table, folder / f"part-{i}.parquet", row_group_size=rows)


def _register(daemon: BenchDaemon, name: str, prefix: str, fmt: str) -> dict[str, Any]:
    chunkd = str(Path(sys.executable).parent / "chunkd")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    env["CHUNKD_SOCKET"] = daemon.socket
    done = subprocess.run(
        [chunkd, "dataset", "register", name, prefix, "--format", fmt, "--json", "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"chunkd dataset register {name} failed: {done.stderr[-2000:]}")
    registered: dict[str, Any] = json.loads(done.stdout)
    return registered


def decode_metrics(url: str) -> dict[str, float]:
    """The daemon's ``chunkd_dataset_decode*`` metrics, ``name{labels}`` to value."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("chunkd_dataset_decode") and "_created" not in line:
            if "_bucket" in line:
                continue
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


# -- 1. one process ----------------------------------------------------------------------


def _epoch(loader: Any, firsts: list[dict[str, float]] | None = None) -> tuple[int, float]:
    """An epoch of ``loader``, each batch's columns to numpy; the first batch's phases
    (``Loader.first_batch``, and ``seconds``: from the iteration's start to the first
    batch's columns in hand) go into ``firsts``."""
    import numpy as np

    rows = 0
    first = 0.0
    started = time.perf_counter()
    for batch in loader:
        columns = [np.asarray(c) for c in batch.columns.values()]
        rows += len(columns[0])
        if not first:
            first = time.perf_counter() - started
    took = time.perf_counter() - started
    if firsts is not None:
        firsts.append(dict(loader.first_batch) | {"seconds": first})
    loader.close()
    return rows, took


def _samples_epoch(loader: Any) -> tuple[int, float]:
    rows = 0
    started = time.perf_counter()
    for batch in loader:
        rows += len(batch.samples)
    took = time.perf_counter() - started
    loader.close()
    return rows, took


def _iter_batches(paths: list[Path], firsts: list[float] | None = None) -> tuple[int, float]:
    import pyarrow.parquet as pq

    rows = 0
    started = time.perf_counter()
    for path in paths:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH):
            columns = [column.to_numpy() for column in batch.columns]
            if not rows and firsts is not None:
                firsts.append(time.perf_counter() - started)
            rows += len(columns[0])
    return rows, time.perf_counter() - started


def _to_pylist(paths: list[Path]) -> tuple[int, float]:
    import pyarrow.parquet as pq

    rows = 0
    started = time.perf_counter()
    for path in paths:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH):
            rows += len(batch.to_pylist())
    return rows, time.perf_counter() - started


def _one_process(report: Report, work: Path, *, quick: bool) -> dict[str, Any]:
    from chunkd.client import Client
    from chunkd.client.datasets import Dataset, Loader

    files, groups, rows = (2, 2, 5_000) if quick else (2, 4, 40_000)
    data = work / "chunkd-data" / "pq"
    _write_parquet(data, files, groups, rows)
    paths = sorted(data.glob("*.parquet"))
    total = files * groups * rows
    daemon = BenchDaemon(work, {})
    try:
        _register(daemon, "loader", "local/pq/", "parquet")
        client = Client(daemon.socket)
        dataset = Dataset.open("loader", client)
        seeds = iter(range(1, 1000))

        firsts: dict[str, list[dict[str, float]]] = {"shared": [], "local": []}
        pyarrow_firsts: list[float] = []

        def loader(shared: bool) -> Callable[[], tuple[int, float]]:
            return lambda: _epoch(
                Loader(dataset, batch_size=BATCH, seed=next(seeds), shared_decode=shared),
                firsts["shared" if shared else "local"],
            )

        contenders = {
            "shared": loader(True),
            "unmeasured": lambda: _epoch(
                Loader(
                    dataset, batch_size=BATCH, seed=next(seeds), shared_decode=True, measure=False
                )
            ),
            "local": loader(False),
            "samples": lambda: _samples_epoch(
                Loader(dataset, batch_size=BATCH, seed=next(seeds), shared_decode=True)
            ),
            "iter_batches": lambda: _iter_batches(paths, pyarrow_firsts),
            "to_pylist": lambda: _to_pylist(paths),
        }
        for run in contenders.values():  # warm: the daemon's cache and entries, the page cache
            assert run()[0] == total
        for found in (*firsts.values(), pyarrow_firsts):
            found.clear()  # the warm-up's first batches were cold
        before = decode_metrics(daemon.url)
        rates = _interleaved(report.rounds_for(1 if quick else 3), contenders)
        after = decode_metrics(daemon.url)
        # where a shuffled epoch's time goes, for the rows below their target
        profiles = {
            key: where_time_goes(
                lambda shared=key == "shared": _epoch(
                    Loader(dataset, batch_size=BATCH, seed=next(seeds), shared_decode=shared)
                )
            )
            for key in ("shared", "local")
            if statistics.median(rates[key]) < 0.8 * statistics.median(rates["iter_batches"])
        }
        client.close()
    finally:
        daemon.stop()
    shape = f"{total:,} rows, 4 number columns, {files} files x {groups} row groups"
    held = _delta(after, before, "chunkd_dataset_decode_hits_total")
    decoded = _delta(after, before, 'chunkd_dataset_decodes_total{where="daemon"}')
    reader = _delta(after, before, 'chunkd_dataset_decodes_total{where="reader"}')
    common = (
        f"{shape}; batches of {BATCH}; chunkd: Loader defaults (shuffled, windows of 16 "
        f"units), batch.columns to numpy; pyarrow over the same files in file order; "
        f"while timed, the daemon decoded {decoded:.0f} units and answered {held:.0f} "
        f"from held entries, readers decoded {reader:.0f} in-process; {_load()}"
    )
    iter_name = "pyarrow ParquetFile.iter_batches(256), columns .to_numpy()"
    for key, label in (("shared", "decoded once by the daemon"), ("local", "in-process")):
        _add(
            report,
            f"one process, warm: Loader epoch, batch.columns ({label})",
            rates[key],
            rates["iter_batches"],
            "rows/s",
            iter_name,
            f"shared_decode={key == 'shared'}; "
            + common
            + (f"; {profiles[key]}" if key in profiles else ""),
            target=0.8,
        )
    for key, label in (("shared", "decoded once by the daemon"), ("local", "in-process")):
        ours = [f["seconds"] for f in firsts[key]]
        phases = {
            p: statistics.median(f.get(p, 0.0) for f in firsts[key])
            for p in ("metadata", "first_chunk", "decode")
        }
        report.add(
            Result(
                f"one process, warm: Loader's time to first batch ({label})",
                statistics.median(ours),
                statistics.median(pyarrow_firsts),
                "s",
                "pyarrow ParquetFile(path).iter_batches(256): its first batch to numpy",
                target_max=0.5,
                samples=Rounds.of(ours, pyarrow_firsts),
                note=(
                    f"from the iteration's start to the first batch's columns in hand; the "
                    f"loader's own phases (medians): first chunk (its first unit in hand, "
                    f"the first steps' prefetch included) {phases['first_chunk']:.4f}s, "
                    f"decode (the rest of the batch) {phases['decode']:.4f}s, and resolving "
                    f"the snapshot before it (Dataset.open, once) {phases['metadata']:.4f}s; "
                    + common
                ),
            )
        )
    _add(
        report,
        "one process, warm: Loader epoch, its trainer's wait measured (stall meter on)",
        rates["shared"],
        rates["unmeasured"],
        "rows/s",
        "the same Loader with measure=False",
        "what measuring each step's wait costs a loop (two clock reads and a bucket a "
        "step, one loader_report a 5 s window; docs/jobs.md); shared_decode=True; " + common,
        target=0.95,
    )
    _add(
        report,
        "one process, warm: Loader epoch, batch.samples (per sample)",
        rates["samples"],
        rates["to_pylist"],
        "rows/s",
        "pyarrow row by row (iter_batches(256).to_pylist())",
        "the old per-sample path (a dict per row), shared_decode=True; " + common,
    )
    _add(
        report,
        "one process, warm: Loader epoch, batch.columns, vs row by row",
        rates["shared"],
        rates["to_pylist"],
        "rows/s",
        "pyarrow row by row (iter_batches(256).to_pylist())",
        "shared_decode=True; " + common,
    )
    return {"rates": rates, "paths": paths, "total": total, "units": files * groups}


def where_time_goes(run: Callable[[], object], top: int = 6) -> str:
    """``run()`` under cProfile: its functions with the largest own time, and each one's
    share of the whole (the note of a row whose target was missed)."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    try:
        run()
    finally:
        profile.disable()
    stats: Any = pstats.Stats(profile)
    total = max(float(stats.total_tt), 1e-9)
    ranked = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    shown = [
        f"{name if file == '~' else f'{Path(file).name}:{line} {name}'} {own / total:.0%} "
        f"({calls:,} calls)"
        for (file, line, name), (_, calls, own, _, _) in ranked
    ]
    return f"cProfile of one epoch ({total:.2f}s), own time: " + "; ".join(shown)


# -- 2. four ranks -----------------------------------------------------------------------


class DecodedPeak:
    """``chunkd_dataset_decoded_bytes`` of a daemon, polled every 20 ms: its peak."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.peak = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                found = decode_metrics(self.url)
            except OSError:
                found = {}
            self.peak = max(self.peak, found.get("chunkd_dataset_decoded_bytes", 0.0))
            self._done.wait(0.02)

    def stop(self) -> float:
        self._done.set()
        self._thread.join(30)
        return self.peak


def _ranks(argv: Callable[[int], list[str]]) -> tuple[int, float, list[dict[str, Any]]]:
    env = {**os.environ, "PYTHONPATH": str(_HERE.parent.parent)}
    procs = [
        subprocess.Popen(
            argv(r), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
        )
        for r in range(WORLD)
    ]
    answers = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"a rank failed ({proc.returncode}): {err[-2000:]}")
        answers.append(json.loads(out.strip().splitlines()[-1]))
    samples = sum(a["samples"] for a in answers)
    span = max(a["ended"] for a in answers) - min(a["started"] for a in answers)
    return samples, span, answers


def _four_ranks(report: Report, work: Path, first: dict[str, Any], *, quick: bool) -> None:
    paths: list[Path] = first["paths"]
    total: int = first["total"]
    rounds = report.rounds_for(1 if quick else 3)
    seeds = iter(range(100, 1000))
    seen: list[dict[str, Any]] = []
    # the snapshot's decoded bytes, as the daemon counts them (a held epoch's)
    budget_env: dict[str, str] = {}

    def chunkd_job() -> tuple[int, float]:
        daemon = BenchDaemon(work, budget_env)  # a fresh daemon: no decoded entry held
        try:
            before = decode_metrics(daemon.url)
            poll = DecodedPeak(daemon.url)
            seed = next(seeds)
            samples, span, answers = _ranks(
                lambda r: [
                    sys.executable,
                    "-m",
                    "bench.loader_bench",
                    "rank",
                    f"--socket={daemon.socket}",
                    "--ref=loader",
                    f"--rank={r}",
                    f"--seed={seed}",
                ]
            )
            peak = poll.stop()
            after = decode_metrics(daemon.url)
        finally:
            daemon.stop()
        assert samples == total, (samples, total)
        seen.append(
            {
                "daemon": _delta(after, before, 'chunkd_dataset_decodes_total{where="daemon"}'),
                "reader": _delta(after, before, 'chunkd_dataset_decodes_total{where="reader"}'),
                "repeats": _delta(after, before, "chunkd_dataset_decode_repeats_total"),
                "hits": _delta(after, before, "chunkd_dataset_decode_hits_total"),
                "waits": _delta(after, before, "chunkd_dataset_decode_waits_total"),
                "evicted": _delta(after, before, "chunkd_dataset_decoded_evicted_total"),
                "declined": sum(
                    v - before.get(k, 0.0)
                    for k, v in after.items()
                    if k.startswith("chunkd_dataset_decode_declined_total")
                ),
                "peak": peak,
                "mapped": sum(a["mapped"] for a in answers),
                "local": sum(a["decoded"] for a in answers),
            }
        )
        return samples, span

    def pyarrow_job() -> tuple[int, float]:
        samples, span, _ = _ranks(
            lambda r: [
                sys.executable,
                "-m",
                "bench.loader_bench",
                "pyarrow-rank",
                f"--rank={r}",
                *[str(p) for p in paths],
            ]
        )
        assert samples == total, (samples, total)
        return samples, span

    rates = _interleaved(rounds, {"chunkd": chunkd_job, "pyarrow": pyarrow_job})
    units = first["units"]

    def said(s: dict[str, Any]) -> str:
        return (
            f"daemon decodes {s['daemon']:.0f}, reader decodes {s['reader']:.0f}, repeats "
            f"{s['repeats']:.0f}, hits {s['hits']:.0f}, waits {s['waits']:.0f}, declined "
            f"{s['declined']:.0f}, evicted {s['evicted']:.0f}; ranks mapped {s['mapped']} and "
            f"decoded {s['local']}; peak decoded bytes held {s['peak'] / 2**20:.1f} MiB"
        )

    # One more job under a budget of half the snapshot's decoded bytes (the held peak of
    # the first job is all of them): the bytes held stay within it, at the cost of repeats.
    full = max(s["peak"] for s in seen)
    budget = int(full // 2)
    budget_env["CHUNKD_DATASETS_DECODED_BYTES"] = str(budget)
    small_rate = chunkd_job()
    small = seen.pop()
    one = statistics.median(first["rates"]["shared"])
    _add(
        report,
        f"{WORLD} ranks of one node: samples/s in all (Loader, shared decode)",
        rates["chunkd"],
        rates["pyarrow"],
        "samples/s",
        f"{WORLD} processes of pyarrow iter_batches(256), row groups r::{WORLD}",
        f"{total:,} rows, {units} units; each rank a Loader of rank r of {WORLD}, batch.columns "
        f"to numpy, an epoch; a fresh daemon each round (entries empty, chunks warm on "
        f"disk); one process reads {one:,.0f} rows/s (row above); per round: "
        + " | ".join(said(s) for s in seen)
        + f"; under [datasets] decoded_bytes = {budget / 2**20:.1f} MiB (half the snapshot's "
        f"{full / 2**20:.1f} MiB): {small_rate[0] / small_rate[1]:,.0f} samples/s, "
        + said(small)
        + f"; {_load()}",
    )
    per_unit = [(s["daemon"] + s["reader"]) / units for s in seen]
    report.add(
        Result(
            f"{WORLD} ranks of one node: units decoded per unit",
            statistics.median(per_unit),
            1.0,
            "decodes",
            "once per node",
            samples=Rounds.of(per_unit, [1.0] * len(seen)),
            better="lower",
            note=(
                f"chunkd_dataset_decodes_total (where=daemon, and where=reader: decoded "
                f"in-process where the daemon declined) / {units} units, each round; the "
                f"readers' in-process decodes: {[int(s['reader']) for s in seen]}"
            ),
        )
    )
    report.add(
        Result(
            f"{WORLD} ranks of one node: peak decoded bytes held, within decoded_bytes",
            small["peak"] / 2**20,
            budget / 2**20,
            "MiB",
            "[datasets] decoded_bytes",
            better="lower",
            note=f"polled every 20 ms; {said(small)}",
        )
    )


def _rank(options: argparse.Namespace) -> None:
    import numpy as np

    from chunkd.client import Client
    from chunkd.client.datasets import Dataset, Loader

    client = Client(options.socket)
    dataset = Dataset.open(options.ref, client)
    loader = Loader(
        dataset,
        batch_size=BATCH,
        seed=options.seed,
        rank=options.rank,
        world_size=WORLD,
        shared_decode=not options.local,
    )
    samples = 0
    started = time.time()
    for batch in loader:
        columns = [np.asarray(c) for c in batch.columns.values()]
        samples += len(columns[0])
    ended = time.time()
    units = loader.units()
    mapped, decoded = (units.mapped, units.decoded) if units is not None else (0, 0)
    loader.close()
    client.close()
    answer = {"samples": samples, "started": started, "ended": ended}
    print(json.dumps(answer | {"mapped": mapped, "decoded": decoded}))


def _pyarrow_rank(options: argparse.Namespace) -> None:
    import pyarrow.parquet as pq

    samples = 0
    started = time.time()
    index = 0
    for path in options.paths:
        parquet = pq.ParquetFile(path)
        mine = [g for g in range(parquet.num_row_groups) if (index + g) % WORLD == options.rank]
        index += parquet.num_row_groups
        if not mine:
            continue
        for batch in parquet.iter_batches(batch_size=BATCH, row_groups=mine):
            columns = [column.to_numpy() for column in batch.columns]
            samples += len(columns[0])
    print(json.dumps({"samples": samples, "started": started, "ended": time.time()}))


# -- 3. formats --------------------------------------------------------------------------


def _write_jsonl(folder: Path, files: int, lines: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        with (folder / f"part-{i}.jsonl").open("w") as out:
            for j in range(lines):
                n = i * lines + j
                out.write(
                    json.dumps({"id": n, "label": n % 1000, "text": f"sample {n} " + "w" * 160})
                    + "\n"
                )


def _write_wds(folder: Path, files: int, samples: int) -> None:
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for i in range(files):
        with tarfile.open(folder / f"shard-{i}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for j in range(samples):
                key = f"s{i:03d}{j:06d}"
                for ext, data in (
                    ("bin", rng.bytes(1024)),
                    ("cls", str((i * samples + j) % 1000).encode()),
                ):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def _write_mds(folder: Path, shards: int, samples: int) -> None:
    """Uncompressed MDS shards and their index.json, laid out as Streaming's MDSWriter
    writes them: columns ``id`` (int), ``score`` (float32), ``text`` (str)."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    names, encodings, sizes = ["id", "score", "text"], ["int", "float32", "str"], [8, 4, None]
    config = {
        "version": 2,
        "format": "mds",
        "compression": None,
        "hashes": [],
        "size_limit": 1 << 26,
        "column_names": names,
        "column_encodings": encodings,
        "column_sizes": sizes,
    }
    config_data = json.dumps(config, sort_keys=True).encode()
    entries = []
    for s in range(shards):
        encoded = []
        for j in range(samples):
            n = s * samples + j
            text = (f"sample {n} " + "w" * 160).encode()
            encoded.append(
                np.array([len(text)], np.uint32).tobytes()
                + np.int64(n).tobytes()
                + np.float32(n / 7).tobytes()
                + text
            )
        offsets = np.array([0] + [len(e) for e in encoded]).cumsum().astype(np.uint32)
        offsets += 4 + 4 * (samples + 1) + len(config_data)
        raw = np.uint32(samples).tobytes() + offsets.tobytes() + config_data + b"".join(encoded)
        basename = f"shard.{s:05d}.mds"
        (folder / basename).write_bytes(raw)
        entries.append(
            {
                "samples": samples,
                "raw_data": {"basename": basename, "bytes": len(raw), "hashes": {}},
                "zip_data": None,
                **config,
            }
        )
    (folder / "index.json").write_text(json.dumps({"version": 2, "shards": entries}))


def _json_lines(paths: list[Path]) -> tuple[int, float]:
    count = 0
    started = time.perf_counter()
    for path in paths:
        with path.open("rb") as lines:
            for line in lines:
                json.loads(line)
                count += 1
    return count, time.perf_counter() - started


def _tar_members(paths: list[Path]) -> tuple[int, float]:
    samples = 0
    started = time.perf_counter()
    for path in paths:
        key = None
        with tarfile.open(path, "r|") as tar:
            for member in tar:
                found = tar.extractfile(member)
                assert found is not None
                found.read()
                stem = member.name.split(".", 1)[0]
                if stem != key:
                    key, samples = stem, samples + 1
    return samples, time.perf_counter() - started


def _streaming_mds(folder: Path, rounds: int, *, quick: bool) -> list[tuple[int, float]] | str:
    """Streaming's own MDS reader over ``folder``, ``rounds`` passes after one untimed
    (in its venv); a reason where it cannot run."""
    if quick:  # importing streaming alone takes 15 s here
        return "--quick runs no Streaming"
    venv = ensure_venv(build=False)
    if not isinstance(venv, StreamingVenv):
        return venv.reason
    done = subprocess.run(
        venv.args("mds-read", f"--folder={folder}", f"--passes={rounds}"),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        return f"Streaming's MDS reader failed: {done.stderr.strip()[-500:]}"
    passes = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return [(p["samples"], p["seconds"]) for p in passes]


def _formats(report: Report, work: Path, *, quick: bool) -> None:
    from chunkd.client import Client
    from chunkd.client.datasets import Dataset, Loader

    files, per = (2, 2_000) if quick else (4, 50_000)
    data = work / "chunkd-data"
    _write_jsonl(data / "jl", files, per)
    _write_wds(data / "wds", files, per // 10)
    _write_mds(data / "mds", files, per // 5)
    rounds = report.rounds_for(1 if quick else 3)
    daemon = BenchDaemon(work, {})
    try:
        for name, prefix, fmt in (
            ("jl", "local/jl/", "jsonl"),
            ("wds", "local/wds/", "wds"),
            ("mds", "local/mds/", "mds"),
        ):
            _register(daemon, name, prefix, fmt)
        client = Client(daemon.socket)
        seeds = iter(range(1, 1000))

        def epoch(ref: str) -> Callable[[], tuple[int, float]]:
            dataset = Dataset.open(ref, client)
            return lambda: _epoch(Loader(dataset, batch_size=BATCH, seed=next(seeds)))

        def epoch_parsed(ref: str) -> Callable[[], tuple[int, float]]:
            dataset = Dataset.open(ref, client)

            def run() -> tuple[int, float]:
                loader = Loader(dataset, batch_size=BATCH, seed=next(seeds))
                rows = 0
                started = time.perf_counter()
                for batch in loader:
                    for line in batch.columns["line"].to_pylist():
                        json.loads(line)
                        rows += 1
                took = time.perf_counter() - started
                loader.close()
                return rows, took

            return run

        jl = sorted((data / "jl").glob("*.jsonl"))
        tars = sorted((data / "wds").glob("*.tar"))
        contenders = {
            "jl": epoch("jl"),
            "jl parsed": epoch_parsed("jl"),
            "json.loads": lambda: _json_lines(jl),
            "wds": epoch("wds"),
            "tarfile": lambda: _tar_members(tars),
            "mds": epoch("mds"),
        }
        for run in contenders.values():
            run()
        rates = _interleaved(rounds, contenders)
        mds = _streaming_mds(data / "mds", rounds, quick=quick)
        client.close()
    finally:
        daemon.stop()
    load = _load()
    _add(
        report,
        "JSON lines: Loader epoch, batch.columns",
        rates["jl"],
        rates["json.loads"],
        "lines/s",
        "json.loads line by line over the files",
        f"{files * per:,} lines of ~200 bytes in {files} files; chunkd gives each batch's lines "
        f"as one Arrow binary column (unparsed); with json.loads of each of them too: "
        f"{_spread(rates['jl parsed'])} lines/s (median [min-max]); {load}",
        target=1.0,
    )
    _add(
        report,
        "WebDataset: Loader epoch, batch.columns",
        rates["wds"],
        rates["tarfile"],
        "samples/s",
        "tarfile iteration (r|), every member read",
        f"{files * per // 10:,} samples (1 KiB .bin, a .cls) in {files} tars; chunkd: "
        f"__key__, bin, cls as Arrow columns; {load}",
        target=1.0,
    )
    if isinstance(mds, str):
        report.add(
            Result(
                "MDS: Loader epoch, batch.columns",
                statistics.median(rates["mds"]),
                float("nan"),
                "samples/s",
                "Streaming's MDSReader.get_item",
                samples=Rounds.of(rates["mds"]),
                note=f"baseline unavailable: {mds}; {load}",
            )
        )
    else:
        theirs = [n / max(s, 1e-9) for n, s in mds]
        _add(
            report,
            "MDS: Loader epoch, batch.columns",
            rates["mds"],
            theirs,
            "samples/s",
            "Streaming 0.13's own reader (MDSReader.get_item), shard by shard",
            f"{files * per // 5:,} samples (int, float32, str of ~170 bytes) in {files} "
            f"uncompressed shards; Streaming's passes run after chunkd's rounds, in its venv; "
            f"{load}",
            target=1.0,
        )


# -- 4. tensors that survive in-place ops ------------------------------------------------


def _inplace(report: Report, *, quick: bool) -> None:
    import numpy as np
    import torch

    from chunkd import memfd

    record, rows = 4096, BATCH
    size = record * rows
    source = np.random.default_rng(2).integers(0, 255, size, dtype=np.uint8)
    view = source.reshape(rows, record)
    view.flags.writeable = False  # what a batch's column is: a read-only view
    fd = memfd.sealed(source.tobytes(), "bench-inplace")
    reps = 200 if quick else 2000

    def copied(add: bool) -> Callable[[], tuple[int, float]]:
        def run() -> tuple[int, float]:
            started = time.perf_counter()
            for _ in range(reps):
                tensor = torch.from_numpy(view.copy())
                if add:
                    tensor.add_(1)
            return reps, time.perf_counter() - started

        return run

    def private(add: bool) -> Callable[[], tuple[int, float]]:
        def run() -> tuple[int, float]:
            started = time.perf_counter()
            for _ in range(reps):
                mapping = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
                tensor = torch.frombuffer(mapping, dtype=torch.uint8).view(rows, record)
                if add:
                    tensor.add_(1)
                del tensor
                mapping.close()
            return reps, time.perf_counter() - started

        return run

    # One intra-op thread: on 2 shared cores torch's second thread spins against the
    # load, and a 1 MiB add_ took 16 ms instead of 0.2.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rounds = report.rounds_for(1 if quick else 5)
        rates = _interleaved(
            rounds,
            {
                "copy+add": copied(True),
                "cow+add": private(True),
                "copy": copied(False),
                "cow": private(False),
            },
        )
    finally:
        torch.set_num_threads(threads)
        os.close(fd)
    per = {k: [1e6 / r for r in v] for k, v in rates.items()}  # microseconds per batch
    for add, label in ((True, ", then add_(1)"), (False, ", no write")):
        ours, theirs = per["cow+add" if add else "cow"], per["copy+add" if add else "copy"]
        report.add(
            Result(
                f"a batch of {rows} x 4 KiB records as a writable tensor{label}",
                statistics.median(ours),
                statistics.median(theirs),
                "us",
                "the default collate's copy (torch.from_numpy(view.copy()))",
                samples=Rounds.of(ours, theirs),
                better="lower",
                note=(
                    "chunkd side: a MAP_PRIVATE copy-on-write mapping of a sealed memfd of the "
                    "same 1 MiB, torch.frombuffer over it (mapped and unmapped per batch); "
                    f"lower is better; {reps} batches a round; torch.set_num_threads(1); {_load()}"
                ),
            )
        )


# -- the scenario ------------------------------------------------------------------------


def run(report: Report, work: Path, *, quick: bool) -> None:
    """The scenarios (see the module docstring)."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    try:
        first = _one_process(report, work / "one", quick=quick)
        _four_ranks(report, work / "one", first, quick=quick)
        _formats(report, work / "formats", quick=quick)
        _inplace(report, quick=quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    """A rank of the four-rank scenario (the bench starts it)."""
    parser = argparse.ArgumentParser(prog="python -m bench.loader_bench")
    commands = parser.add_subparsers(dest="command", required=True)
    rank = commands.add_parser("rank", help="one rank: a Loader of rank r of 4, an epoch")
    rank.add_argument("--socket", required=True)
    rank.add_argument("--ref", required=True)
    rank.add_argument("--rank", type=int, required=True)
    rank.add_argument("--seed", type=int, required=True)
    rank.add_argument("--local", action="store_true", help="shared_decode=False")
    theirs = commands.add_parser("pyarrow-rank", help="one rank: iter_batches of r::4 groups")
    theirs.add_argument("--rank", type=int, required=True)
    theirs.add_argument("paths", nargs="+")
    options = parser.parse_args()
    if options.command == "rank":
        _rank(options)
    else:
        _pyarrow_rank(options)


if __name__ == "__main__":
    main()
