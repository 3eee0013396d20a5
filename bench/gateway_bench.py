"""The daemon's read path against what a user would use instead, on one S3 server.

The S3 server is moto's server mode on loopback, behind a proxy that counts the
bytes it sends: that count, not the daemon's metrics, is the backend bytes figure.

1. Cold read of one large object through chunkd (HTTP) against a direct obstore read
   (and against the same 4 MiB ranges read directly); also at smaller sizes, for the
   plot of throughput against size.
2. 8 processes reading the same cold objects: through chunkd, and through s3fs with
   fsspec's per-process block cache. Backend bytes and wall time.
3. Warm HTTP reads through chunkd against the cold read.
4. 64 KiB range GETs one at a time: through chunkd (warm) against obstore straight
   from S3, each timed, for the latency distribution.

Every scenario runs 3 rounds (``--quick``: 2), a fresh cold object each; a row gives
the medians and the spread of the per-round ratio.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import random
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import obstore
from obstore.store import S3Store

from chunkd.testing import CountingProxy, S3Server

from .daemon import BenchDaemon
from .report import Report, Result, Rounds

MiB = 1 << 20
ACCESS_KEY, SECRET_KEY = "bench", "bench-secret"

_CHUNKD_READER = textwrap.dedent(
    """
    import sys, urllib.request
    url, names = sys.argv[1], sys.argv[2:]
    for name in names:
        with urllib.request.urlopen(f"{url}/v1/objects/data/{name}", timeout=600) as r:
            while r.read(1 << 20):
                pass
    """
)

_S3FS_READER = textwrap.dedent(
    """
    import sys, s3fs
    endpoint, bucket, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    fs = s3fs.S3FileSystem(key="bench", secret="bench-secret",
                           client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"})
    for name in names:
        # fsspec's default: a 'readahead' block cache of 50 MiB blocks, per process
        with fs.open(f"{bucket}/pre/{name}", "rb", cache_type="readahead") as f:
            while f.read(1 << 20):
                pass
    """
)


def _daemon(work: Path, bucket: str, endpoint: str) -> BenchDaemon:
    work.mkdir(parents=True, exist_ok=True)
    config = work / "chunkd.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [cache]
            dir = "{work / "cache"}"
            ram_bytes = "2GiB"
            disk_bytes = "4GiB"
            disk_min_free_bytes = 0
            fsync = "never"
            write_policy = "write-behind"
            [[backends]]
            name = "data"
            url = "s3://{bucket}/pre"
            endpoint = "{endpoint}"
            region = "us-east-1"
            access_key_id = "{ACCESS_KEY}"
            secret_access_key = "{SECRET_KEY}"
            allow_http = true
            """
        )
    )
    return BenchDaemon(work, {}, config)


def s3_store(bucket: str, endpoint: str) -> S3Store:
    """What a user would read the bench's bucket with directly: obstore, under ``pre/``."""
    return S3Store(
        bucket,
        prefix="pre",
        endpoint=endpoint,
        region="us-east-1",
        access_key_id=ACCESS_KEY,
        secret_access_key=SECRET_KEY,
        client_options={"allow_http": True},
        virtual_hosted_style_request=False,
    )


def _upload(server: S3Server, bucket: str, name: str, size: int) -> None:
    client = server.client()
    data = os.urandom(size)
    client.put_object(Bucket=bucket, Key=f"pre/{name}", Body=data)


async def _ranged(store: S3Store, name: str, size: int) -> int:
    """Read an object as a chunked reader does: 4 MiB ranges, 5 in flight."""
    limit = asyncio.Semaphore(5)

    async def one(start: int) -> int:
        async with limit:
            data = await obstore.get_range_async(
                store, name, start=start, end=min(size, start + 4 * MiB)
            )
            return len(data)

    return sum(await asyncio.gather(*(one(s) for s in range(0, size, 4 * MiB))))


def _readers(args_per_process: list[list[str]]) -> float:
    started = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", *args]) for args in args_per_process]
    codes = [p.wait(timeout=900) for p in procs]
    took = time.perf_counter() - started
    if any(codes):
        raise RuntimeError(f"a reader process failed: exit codes {codes}")
    return took


def _latencies(
    daemon: BenchDaemon, store: S3Store, name: str, size: int, ours: int, theirs: int, seed: int
) -> tuple[list[float], list[float]]:
    """Seconds of each of ``ours`` 64 KiB range GETs of ``name`` through the daemon (one
    kept-alive HTTP connection, as a reader keeps one) and of ``theirs`` straight from
    S3 with obstore; random offsets, the same for both sides."""
    rng = random.Random(seed)
    span = 64 * 1024
    offsets = [rng.randrange(0, size - span) for _ in range(max(ours, theirs))]
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
    through, direct = [], []
    try:
        for off in offsets[:ours]:
            start = time.perf_counter()
            conn.request("GET", f"/v1/objects/data/{name}", headers={"Range": _range(off, span)})
            with conn.getresponse() as response:
                got = len(response.read())
            through.append(time.perf_counter() - start)
            assert got == span, got
    finally:
        conn.close()
    for off in offsets[:theirs]:
        start = time.perf_counter()
        got = len(obstore.get_range(store, name, start=off, end=off + span))
        direct.append(time.perf_counter() - start)
        assert got == span, got
    return through, direct


def _range(offset: int, length: int) -> str:
    return f"bytes={offset}-{offset + length - 1}"


async def run(report: Report, work: Path, *, quick: bool) -> None:
    """The gateway scenarios (``quick``: small objects, to check the bench runs)."""
    big = (16 if quick else 256) * MiB
    # the cold read at each of these sizes, for the plot; the rows are of the largest
    sizes = [4 * MiB, big] if quick else [16 * MiB, 64 * MiB, big]
    shared_size = (4 if quick else 32) * MiB
    shared_count = 2 if quick else 4
    processes = 8
    rounds = report.rounds_for(2 if quick else 3)
    work.mkdir(parents=True, exist_ok=True)
    server = S3Server.start()
    proxy = CountingProxy(server.port)
    bucket = f"bench-{uuid.uuid4().hex[:10]}"
    server.client().create_bucket(Bucket=bucket)
    daemon = None
    try:
        print("gateway: uploading objects", flush=True)
        for size in sizes:
            for r in range(rounds):
                _upload(server, bucket, f"big-{size}-{r}", size)
        for r in range(rounds):
            for i in range(shared_count):
                _upload(server, bucket, f"c{r}-{i}", shared_size)
                _upload(server, bucket, f"s{r}-{i}", shared_size)
        daemon = _daemon(work / "daemon", bucket, proxy.endpoint)
        store = s3_store(bucket, proxy.endpoint)

        print("gateway: cold read", flush=True)
        # per size, each contender's GB/s in every round
        got_rates: dict[int, dict[str, list[float]]] = {}
        for size in sizes:
            rates: dict[str, list[float]] = {"cold": [], "direct": [], "ranged": [], "warm": []}
            for r in range(rounds):
                name = f"big-{size}-{r}"

                async def direct(name: str = name, size: int = size) -> None:
                    result = await obstore.get_async(store, name)
                    data = await result.bytes_async()
                    assert len(data) == size

                async def ranged(name: str = name, size: int = size) -> None:
                    assert await _ranged(store, name, size) == size

                async def chunkd(name: str = name, size: int = size) -> None:
                    assert await asyncio.to_thread(daemon.stream, f"data/{name}") == size

                # the direct reads and chunkd's cold one take turns going first; the
                # warm read always follows the cold one
                sides = [("direct", direct), ("ranged", ranged), ("cold", chunkd)]
                for side, read in sides[r % 3 :] + sides[: r % 3]:
                    start = time.perf_counter()
                    await read()
                    rates[side].append(size / 1e9 / (time.perf_counter() - start))
                start = time.perf_counter()
                await chunkd()
                rates["warm"].append(size / 1e9 / (time.perf_counter() - start))
            got_rates[size] = rates
        figure = "gateway: read throughput against object size"
        for side, label in (
            ("warm", "chunkd warm (HTTP)"),
            ("cold", "chunkd cold (HTTP)"),
            ("direct", "obstore get, whole object"),
            ("ranged", "obstore 4 MiB ranges, 5 in flight"),
        ):
            points = {size: statistics.median(got_rates[size][side]) for size in sizes}
            report.sizes(figure, label, points, "GB/s")
        rates = got_rates[big]
        med = {side: statistics.median(values) for side, values in rates.items()}
        report.add(
            Result(
                f"cold read {big // MiB} MiB through chunkd (HTTP)",
                med["cold"],
                med["direct"],
                "GB/s",
                "direct obstore get, whole object",
                target_ratio=0.9,
                samples=Rounds.of(rates["cold"], rates["direct"]),
                note=(
                    "chunkd keeps several 4 MiB ranged GETs in flight, hashes and stores each "
                    "chunk, and streams to an HTTP client on loopback; the S3 server is moto; "
                    "a fresh object each round"
                ),
            )
        )
        report.add(
            Result(
                f"cold read {big // MiB} MiB through chunkd, vs the same 4 MiB ranges",
                med["cold"],
                med["ranged"],
                "GB/s",
                "direct obstore ranged gets, 4 MiB each, 5 in flight",
                samples=Rounds.of(rates["cold"], rates["ranged"]),
                note=(
                    "moto answers a ranged GET by reading the whole object (a 4 MiB range of a "
                    "256 MiB object takes ~230 ms, of a 4 MiB object ~12 ms), so any reader "
                    "that fetches in chunks pays it; this row isolates chunkd's own cost"
                ),
            )
        )
        report.add(
            Result(
                f"warm read {big // MiB} MiB through chunkd (HTTP)",
                med["warm"],
                med["cold"],
                "GB/s",
                "the same read, cold",
                samples=Rounds.of(rates["warm"], rates["cold"]),
            )
        )

        print(f"gateway: {processes} processes, same cold objects", flush=True)
        total = shared_size * shared_count
        shared: dict[str, list[float]] = {
            "chunkd_s": [],
            "s3fs_s": [],
            "chunkd_x": [],
            "s3fs_x": [],
        }
        for r in range(rounds):
            chunkd_names = [f"c{r}-{i}" for i in range(shared_count)]
            s3fs_names = [f"s{r}-{i}" for i in range(shared_count)]
            for side in ("chunkd", "s3fs")[r % 2 :] + ("chunkd", "s3fs")[: r % 2]:
                proxy.reset()
                if side == "chunkd":
                    took = _readers(
                        [[_CHUNKD_READER, daemon.url, *chunkd_names] for _ in range(processes)]
                    )
                else:
                    took = _readers(
                        [
                            [_S3FS_READER, proxy.endpoint, bucket, *s3fs_names]
                            for _ in range(processes)
                        ]
                    )
                shared[f"{side}_s"].append(took)
                shared[f"{side}_x"].append(proxy.bytes_down / total)
        report.add(
            Result(
                f"{processes} processes, same {total // MiB} MiB cold: backend bytes / data",
                statistics.median(shared["chunkd_x"]),
                statistics.median(shared["s3fs_x"]),
                "x",
                "s3fs + fsspec readahead cache, per process",
                target_max=1.05,
                samples=Rounds.of(shared["chunkd_x"], shared["s3fs_x"]),
                note=(
                    "bytes the S3 server sent, counted by a proxy in front of it, divided by "
                    "the bytes of the objects read; the target is 1.0x for chunkd; fresh "
                    "objects each round"
                ),
            )
        )
        report.add(
            Result(
                f"{processes} processes, same {total // MiB} MiB cold: wall time",
                statistics.median(shared["chunkd_s"]),
                statistics.median(shared["s3fs_s"]),
                "s",
                "s3fs + fsspec readahead cache, per process",
                samples=Rounds.of(shared["chunkd_s"], shared["s3fs_s"]),
                note="lower is better: ratio below 1 means chunkd finished first",
            )
        )

        print("gateway: 64 KiB range GETs, one at a time", flush=True)
        # The shared objects are warm in the daemon now; the direct side reads S3.
        ours, theirs = (50, 10) if quick else (200, 40)
        through_all: list[float] = []
        direct_all: list[float] = []
        p50s: tuple[list[float], list[float]] = ([], [])
        for r in range(rounds):
            through, direct_s = await asyncio.to_thread(
                _latencies, daemon, store, f"c{r}-0", shared_size, ours, theirs, r
            )
            through_all += through
            direct_all += direct_s
            p50s[0].append(statistics.median(through) * 1e3)
            p50s[1].append(statistics.median(direct_s) * 1e3)
        figure = f"gateway: latency of a 64 KiB range GET of a {shared_size // MiB} MiB object"
        report.latencies(figure, "chunkd, warm (HTTP, kept alive)", through_all)
        report.latencies(figure, "obstore get_range from S3", direct_all)
        report.add(
            Result(
                f"64 KiB range GET of a {shared_size // MiB} MiB object, warm: p50 latency",
                statistics.median(through_all) * 1e3,
                statistics.median(direct_all) * 1e3,
                "ms",
                "obstore get_range of the same ranges from the S3 server",
                samples=Rounds.of(*p50s),
                note=(
                    f"lower is better; {len(through_all)} GETs through the daemon on one "
                    f"kept-alive connection, {len(direct_all)} from moto (which reads the whole "
                    f"object for a range); p99 {_p99(through_all) * 1e3:.2f} ms vs "
                    f"{_p99(direct_all) * 1e3:.1f} ms; the spread is of the per-round p50s"
                ),
            )
        )
    finally:
        if daemon is not None:
            daemon.stop()
        proxy.close()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
