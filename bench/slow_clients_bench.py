"""What slow connections cost a daemon at size: ``python -m bench.slow_clients_bench``.

Not a scenario of ``python -m bench`` (no ratio to a contender): a table of what the
bounds of ``chunkd.gateway.connections`` hold a crowd to. One ``chunkd serve`` with
``max_connections`` raised to the crowd's size, its fd limit raised to match, and a
header timeout long enough for the crowd to be held whole; for each count (default
1,000, 4,000 and 10,000; ``--counts``) and each kind of connection, a crowd
(``chunkd.testing.crowd``) opens that many and holds them:

- ``silent``: connections that send nothing;
- ``full HTTP``: a head of 24,000 bytes on the HTTP port, just under its bound, never
  finished;
- ``full S3``: a head of 16,000 bytes on the S3 front, just under its bound;
- ``fat``: 100 header lines of 8 KB (the probe of issue 24), refused at the bound.

Each row: connections held at once (the daemon's ``chunkd_connections`` once the crowd
opened; at most a quarter of the fd limit, which this process raises as far as its
hard limit lets it), how much the daemon's heap (RssAnon) grew, that over the
connections held, the seconds the crowd took to open, and the slowest of ``/healthz``
meanwhile. Prints a Markdown table and writes ``slow_clients.json`` into ``--out``.

Measured on a shared 2-core machine (hard fd limit 20,000, so 5,000 held at most):
a silent connection costs 5-8 KiB of heap, one holding an unfinished head at the HTTP
port's bound 45-47 KiB, at the S3 front's 29-32 KiB; 1,000 to 10,000 fat heads (100
lines of 8 KB) are refused one after another, 2-10 MiB in all; ``/healthz`` answered
within 7 ms throughout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from chunkd.testing import free_port
from chunkd.testing.s3front import front_section

from .daemon import BenchDaemon

_KINDS = {
    "silent": ("http", ["--mode=silent"]),
    "full HTTP": ("http", ["--mode=full", "--head-bytes=24000"]),
    "full S3": ("s3", ["--mode=full", "--head-bytes=16000"]),
    "fat": ("http", ["--mode=fat"]),
}


def _heap(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _open_connections(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("chunkd_connections{")
    )


def _healthz(url: str) -> float:
    started = time.monotonic()
    with urllib.request.urlopen(f"{url}/healthz", timeout=30) as answer:
        answer.read()
    return time.monotonic() - started


def measure(work: Path, count: int, kind: str) -> dict[str, Any]:
    """One row: ``count`` connections of ``kind`` against a fresh daemon."""
    import resource

    port, front_port = free_port(), free_port()
    config = work / f"chunkd-{count}-{kind.replace(' ', '-')}.toml"
    files = work / "files"
    files.mkdir(parents=True, exist_ok=True)
    config.write_text(
        f"""
[server]
header_timeout = "60s"
max_connections = {count + 64}
max_connections_per_address = {count + 64}

[cache]
dir = "{work / "cache"}"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
fsync = "never"

[[backends]]
name = "local"
url = "file://{files}"

{front_section(front_port)}
"""
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * count + 1024  # max_connections is at most a quarter of it
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(hard, want)))
    except (ValueError, OSError):  # the hard limit cannot be raised here
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        daemon = BenchDaemon(work / "daemon", {}, config=config, port=port)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        for _ in range(50):
            _healthz(daemon.url)
        time.sleep(0.5)
        pid = daemon.process.pid
        before = _heap(pid)
        peak = [before]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _heap(pid))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        door, args = _KINDS[kind]
        target = port if door == "http" else front_port
        started = time.monotonic()
        crowd = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "chunkd.testing.crowd",
                f"--port={target}",
                f"--count={count}",
                "--settle=2",
                "--observe=120",
                *args,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert crowd.stdout is not None
        crowd.stdout.readline()  # opened
        opened = time.monotonic() - started
        held = _open_connections(daemon.url)
        slowest = max(_healthz(daemon.url) for _ in range(20))
        crowd.stdout.readline()  # held
        crowd.terminate()
        crowd.wait()
        done.set()
        sampler.join()
        grown = peak[0] - before
        return {
            "kind": kind,
            "count": count,
            "held": int(held),
            "heap_grown_mib": round(grown / 2**20, 1),
            # the connections held (the probe's own is one of them), when there are any
            "per_held_kib": round(grown / 1024 / (held - 1), 1) if held > 10 else None,
            "open_seconds": round(opened, 2),
            "healthz_worst_s": round(slowest, 4),
        }
    finally:
        daemon.process.terminate()
        daemon.process.wait(timeout=30)
        daemon.log.close()


def main(argv: list[str] | None = None) -> int:
    """Measure every count and kind; print the table, write the JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.slow_clients_bench")
    parser.add_argument("--counts", default="1000,4000,10000")
    parser.add_argument("--kinds", default=",".join(_KINDS))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for count in (int(c) for c in args.counts.split(",")):
        for kind in args.kinds.split(","):
            work = args.out / "work" / "slow-clients" / f"{count}-{kind.replace(' ', '-')}"
            rows.append(measure(work, count, kind))
            print(rows[-1], flush=True)
    (args.out / "slow_clients.json").write_text(json.dumps(rows, indent=2))
    print("\n| kind | crowd | held at once | heap grew | per connection | opened in | /healthz |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        each = "-" if row["per_held_kib"] is None else f"{row['per_held_kib']} KiB"
        print(
            f"| {row['kind']} | {row['count']} | {row['held']} | {row['heap_grown_mib']} MiB "
            f"| {each} | {row['open_seconds']} s | {row['healthz_worst_s']} s |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
