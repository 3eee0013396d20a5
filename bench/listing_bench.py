"""Listings through chunkd against obstore's own ``list``, side by side.

1. 100,000 keys of a ``file://`` backend (one folder), listed recursively: through a
   daemon that caches no listings (each round a fresh daemon), and with obstore's
   ``list`` on a ``LocalStore`` of the same folder.
2. 20,000 keys of moto S3: the same, cold; then repeated within ``list_revalidate``
   (the daemon answers from its listing cache).
3. 1,000,000 keys (1,000 folders of 1,000): the peak memory of the daemon and of a
   client reading every page, against obstore collecting the same listing.

Every scenario runs 3 rounds (``--quick``: 1), each rotating the order of the two
contenders; a row gives the medians and the spread of the per-round ratio.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import obstore
from obstore.store import LocalStore, S3Store

from chunkd.client import Client
from chunkd.testing import S3Server

from .daemon import BenchDaemon
from .gateway_bench import ACCESS_KEY, SECRET_KEY, s3_store
from .report import Report, Result, Rounds

_CLIENT = textwrap.dedent(
    """
    import re, sys
    from chunkd.client import Client
    with Client(sys.argv[1]) as client:
        count = sum(1 for _ in client.iter_ls(sys.argv[2], recursive=True))
    status = open("/proc/self/status").read()
    print(count, re.search(r"VmHWM:\\s+(\\d+)", status).group(1))
    """
)

_OBSTORE = textwrap.dedent(
    """
    import re, sys
    import obstore
    from obstore.store import LocalStore
    listed = obstore.list(LocalStore(sys.argv[1]), sys.argv[2]).collect()
    status = open("/proc/self/status").read()
    print(len(listed), re.search(r"VmHWM:\\s+(\\d+)", status).group(1))
    """
)


def _files(root: Path, folders: int, per_folder: int) -> int:
    for f in range(folders):
        folder = root / f"part-{f:04d}" if folders > 1 else root
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_folder):
            fd = os.open(folder / f"shard-{i:06d}.bin", os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, b"x" * (i % 64))
            os.close(fd)
    return folders * per_folder


def _config(work: Path, backend: str, *, list_revalidate: str) -> Path:
    config = work / "chunkd.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [cache]
            dir = "{work / "cache"}"
            ram_bytes = "256MiB"
            disk_bytes = "1GiB"
            disk_min_free_bytes = 0
            fsync = "never"
            {backend}
            list_revalidate = "{list_revalidate}"
            """
        )
    )
    return config


def _count_through(daemon: BenchDaemon, name: str) -> tuple[int, float]:
    started = time.perf_counter()
    with Client(daemon.socket, timeout=600) as client:
        count = sum(1 for _ in client.iter_ls(name, recursive=True))
    return count, time.perf_counter() - started


def _vm(pid: int, field: str) -> int:
    """A VmRSS or VmHWM figure of a process, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for process {pid}")


async def _obstore_count(store: object, prefix: str) -> tuple[int, float]:
    started = time.perf_counter()
    count = 0
    async for batch in obstore.list(store, prefix, chunk_size=1000):  # type: ignore[arg-type]
        count += len(batch)
    return count, time.perf_counter() - started


def _keys(count: int) -> str:
    """``count`` keys as a row names them: 500, 20k, 1M."""
    if count >= 1_000_000:
        return f"{count / 1e6:g}M"
    return f"{count // 1000}k" if count >= 1000 else str(count)


def _rounds(report: Report, quick: bool) -> int:
    return report.rounds_for(1 if quick else 3)


async def _file_rows(report: Report, work: Path, *, quick: bool) -> None:
    count = 2_000 if quick else 100_000
    data = work / "data"
    _files(data / "flat", 1, count)
    backend = f'[[backends]]\nname = "local"\nurl = "file://{data}"'
    chunkd_s, direct_s = [], []
    for r in range(_rounds(report, quick)):
        daemon = BenchDaemon(work / f"d{r}", {}, _config(work, backend, list_revalidate="0"))
        try:
            order = ["chunkd", "direct"] if r % 2 == 0 else ["direct", "chunkd"]
            for who in order:
                if who == "chunkd":
                    got, took = await asyncio.to_thread(_count_through, daemon, "local/flat")
                    chunkd_s.append(took)
                else:
                    got, took = await _obstore_count(LocalStore(str(data)), "flat")
                    direct_s.append(took)
                assert got == count, (who, got)
        finally:
            daemon.stop()
    report.add(
        Result(
            f"list {_keys(count)} keys of a file:// backend, cold",
            count / statistics.median(chunkd_s),
            count / statistics.median(direct_s),
            "keys/s",
            "obstore list of a LocalStore",
            target_ratio=0.5,
            samples=Rounds.of([count / s for s in chunkd_s], [count / s for s in direct_s]),
            note=(
                "one folder, listed recursively in pages of 1,000 over the local socket, by a "
                "daemon that caches no listings; obstore walks the folder in Rust and returns "
                "the keys unordered (chunkd's come in key order, resumable after any key)"
            ),
        )
    )


async def _upload(store: S3Store, count: int) -> None:
    slots = asyncio.Semaphore(32)

    async def one(i: int) -> None:
        async with slots:
            await obstore.put_async(store, f"keys/part-{i // 1000:03d}/k-{i:06d}", b"x")

    await asyncio.gather(*(one(i) for i in range(count)))


async def _s3_rows(report: Report, work: Path, *, quick: bool) -> None:
    count = 500 if quick else 20_000
    work.mkdir(parents=True, exist_ok=True)
    server = S3Server.start()
    bucket = f"bench-{uuid.uuid4().hex[:10]}"
    server.client().create_bucket(Bucket=bucket)
    store = s3_store(bucket, server.endpoint)
    try:
        print(f"listing: uploading {count} keys to moto", flush=True)
        await _upload(store, count)
        backend = textwrap.dedent(
            f"""
            [[backends]]
            name = "data"
            url = "s3://{bucket}/pre"
            endpoint = "{server.endpoint}"
            region = "us-east-1"
            access_key_id = "{ACCESS_KEY}"
            secret_access_key = "{SECRET_KEY}"
            allow_http = true
            """
        )
        cold_s, direct_s, warm_s = [], [], []
        for r in range(_rounds(report, quick)):
            config = _config(work, backend, list_revalidate="5m")
            daemon = BenchDaemon(work / f"s{r}", {}, config)
            try:
                order = ["chunkd", "direct"] if r % 2 == 0 else ["direct", "chunkd"]
                for who in order:
                    if who == "chunkd":
                        got, took = await asyncio.to_thread(_count_through, daemon, "data/keys")
                        cold_s.append(took)
                        again, took = await asyncio.to_thread(_count_through, daemon, "data/keys")
                        assert again == got
                        warm_s.append(took)
                    else:
                        got, took = await _obstore_count(store, "keys")
                        direct_s.append(took)
                    assert got == count, (who, got)
            finally:
                daemon.stop()
        rate = count / statistics.median(direct_s)
        report.add(
            Result(
                f"list {_keys(count)} keys of moto S3, cold",
                count / statistics.median(cold_s),
                rate,
                "keys/s",
                "obstore list of the same bucket",
                target_ratio=0.5,
                samples=Rounds.of([count / s for s in cold_s], [count / s for s in direct_s]),
                note="the same ListObjectsV2 pages; chunkd adds the local socket and its pages",
            )
        )
        report.add(
            Result(
                f"list {_keys(count)} keys of moto S3, repeated",
                count / statistics.median(warm_s),
                rate,
                "keys/s",
                "obstore list of the same bucket",
                target_ratio=10,
                samples=Rounds.of([count / s for s in warm_s], [count / s for s in direct_s]),
                note="answered from the daemon's listing cache, within list_revalidate",
            )
        )
    finally:
        server.stop()


async def _memory_rows(report: Report, work: Path, *, quick: bool) -> None:
    folders = 20 if quick else 1000
    data = work / "million"
    count = await asyncio.to_thread(_files, data / "keys", folders, 1000)
    backend = f'[[backends]]\nname = "local"\nurl = "file://{data}"'
    daemon_mib, client_mib, direct_mib, took = [], [], [], []
    for r in range(_rounds(report, quick)):
        # a fresh daemon each round: its growth is measured from its start
        daemon = BenchDaemon(work / f"m{r}", {}, _config(work, backend, list_revalidate="30s"))
        try:
            before = _vm(daemon.process.pid, "VmRSS")
            started = time.perf_counter()
            listed = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-c", _CLIENT, daemon.socket, "local/keys"],
                capture_output=True,
                text=True,
                timeout=1800,
                check=True,
            )
            took.append(time.perf_counter() - started)
            got, client_kib = (int(x) for x in listed.stdout.split())
            assert got == count, got
            # RSS counts whole pages: a growth below one page shows as one page.
            daemon_mib.append(max(4, _vm(daemon.process.pid, "VmHWM") - before) / 1024)
            client_mib.append(client_kib / 1024)
        finally:
            daemon.stop()
        direct = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", _OBSTORE, str(data), "keys"],
            capture_output=True,
            text=True,
            timeout=1800,
            check=True,
        )
        got, direct_kib = (int(x) for x in direct.stdout.split())
        assert got == count, got
        direct_mib.append(direct_kib / 1024)
    keys = _keys(count)
    report.add(
        Result(
            f"list {keys} keys: the daemon's peak memory growth",
            statistics.median(daemon_mib),
            statistics.median(direct_mib),
            "MiB",
            "peak RSS of a reader holding obstore's list().collect()",
            samples=Rounds.of(daemon_mib, direct_mib),
            note=(
                f"lower is better; the listing took {statistics.median(took):.1f}s; the "
                "daemon holds one page and its caches: 65,536 listing entries and 262,144 "
                "names at most"
            ),
        )
    )
    report.add(
        Result(
            f"list {keys} keys: a reader's peak RSS (iter_ls)",
            statistics.median(client_mib),
            statistics.median(direct_mib),
            "MiB",
            "peak RSS of a reader holding obstore's list().collect()",
            samples=Rounds.of(client_mib, direct_mib),
            note="lower is better; the reader holds one page at a time (its imports included)",
        )
    )


async def run(report: Report, work: Path, *, quick: bool) -> None:
    """The listing scenarios (``quick``: a few thousand keys, to check the bench runs)."""
    work.mkdir(parents=True, exist_ok=True)
    try:
        await _file_rows(report, work / "file", quick=quick)
        await _s3_rows(report, work / "s3", quick=quick)
        await _memory_rows(report, work / "mem", quick=quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)
