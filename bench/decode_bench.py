"""Decode once per node (docs/decoding.md): what a unit costs a reader, three ways.

A registered Parquet snapshot (2 files, 8 row groups of 40,000 rows, 4 columns: int64,
float64, int32, string) on a ``file://`` backend, warm in the daemon's cache. For each
unit, in one process:

* **in-process**: ``format_of("parquet").decode(...)`` through the pinned source (what a
  reader does where the daemon does not decode);
* **daemon, first**: ``SharedDecoder.unit`` of a unit no one asked for yet (the daemon's
  worker reads, decodes and seals it; the reader maps it);
* **daemon, held**: the same request again (what every other rank and worker of the node
  pays: a round trip, a map and the IPC footer).

Usage: ``python -m bench.decode_bench [--work DIR] [--rounds N]``; prints one line per
way, milliseconds per unit (median over the rounds, and the spread).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.daemon import BenchDaemon

ROWS = 40_000
GROUPS = 4
FILES = 2


def write_snapshot(folder: Path) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    n = ROWS * GROUPS
    for i in range(FILES):
        table = pa.table(
            {
                "a": np.arange(n, dtype=np.int64),
                "b": rng.random(n),
                "c": rng.integers(0, 1 << 30, n).astype(np.int32),
                "d": pa.array([f"row-{j}-" + "y" * 20 for j in range(n)]),
            }
        )
        pq.write_table(table, folder / f"part-{i}.parquet", row_group_size=ROWS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_bench")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args(argv)
    work = options.work or Path(tempfile.mkdtemp(prefix="chunkd-decode-bench-"))
    write_snapshot(work / "chunkd-data" / "pq")
    daemon = BenchDaemon(work, {})
    try:
        chunkd = str(Path(sys.executable).parent / "chunkd")
        env = {"CHUNKD_SOCKET": daemon.socket, "PATH": str(Path(sys.executable).parent)}
        subprocess.run(
            [chunkd, "dataset", "register", "bench", "local/pq/", "--format", "parquet"],
            env=env,
            check=True,
            capture_output=True,
        )
        print(measure(daemon.socket, options.rounds))
    finally:
        daemon.stop()
    return 0


def measure(socket: str, rounds: int) -> str:
    from chunkd.client import Client
    from chunkd.client.datasets import resolve
    from chunkd.client.datasets.formats import format_of
    from chunkd.client.datasets.shared import SharedDecoder

    client = Client(socket_path=socket)
    snapshot, _, source = resolve(client, "bench")
    fmt = format_of("parquet")
    units = [(m, u) for m in snapshot.members for u in range(len(fmt.units(m)))]
    shared = SharedDecoder(client)
    shared.unit(source, units[0][0], fmt, 0, ("a",))  # the workers start: not timed
    for member, _ in units:  # the members' bytes warm in the daemon's cache
        source.read(member, 0, member.size)

    def per_unit(run: Any) -> float:
        started = time.perf_counter()
        for member, unit in units:
            assert run(member, unit) is not None
        return 1000 * (time.perf_counter() - started) / len(units)

    local = [per_unit(lambda m, u: fmt.decode(source, m, u, None)) for _ in range(rounds)]
    first = []
    for columns in [None, ("a", "b", "c", "d"), ("d", "c", "b", "a")][:rounds] or [None]:
        first.append(per_unit(lambda m, u, c=columns: shared.unit(source, m, fmt, u, c)))
    held = [per_unit(lambda m, u: shared.unit(source, m, fmt, u, None)) for _ in range(rounds)]
    shared.close()
    client.close()
    lines = [f"{len(units)} units of {ROWS} rows, 4 columns (ms per unit, median [min-max])"]
    for name, times in (("in-process", local), ("daemon, first", first), ("daemon, held", held)):
        lines.append(
            f"  {name:14} {statistics.median(times):8.3f} [{min(times):.3f}-{max(times):.3f}]"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
