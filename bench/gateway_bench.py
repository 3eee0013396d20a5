"""The daemon's read path against what a user would use instead, on one S3 server.

The S3 server is moto's server mode on loopback, behind a proxy that counts the
bytes it sends: that count, not the daemon's metrics, is the backend bytes figure.

1. Cold read of one large object through chunkd (HTTP) against a direct obstore read.
2. 8 processes reading the same cold objects: through chunkd, and through s3fs with
   fsspec's per-process block cache. Backend bytes and wall time.
3. Warm HTTP reads through chunkd against the cold read.
"""

from __future__ import annotations

import asyncio
import os
import shutil
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
from .report import Report, Result

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


async def run(report: Report, work: Path, *, quick: bool) -> None:
    """The gateway scenarios (``quick``: small objects, to check the bench runs)."""
    big = (16 if quick else 256) * MiB
    shared_size = (4 if quick else 32) * MiB
    shared_count = 2 if quick else 4
    processes = 8
    work.mkdir(parents=True, exist_ok=True)
    server = S3Server.start()
    proxy = CountingProxy(server.port)
    bucket = f"bench-{uuid.uuid4().hex[:10]}"
    server.client().create_bucket(Bucket=bucket)
    daemon = None
    try:
        print("gateway: uploading objects", flush=True)
        rounds = 2
        for r in range(rounds):
            _upload(server, bucket, f"big-{r}", big)
        for name in [f"c-{i}" for i in range(shared_count)] + [
            f"s-{i}" for i in range(shared_count)
        ]:
            _upload(server, bucket, name, shared_size)
        daemon = _daemon(work / "daemon", bucket, proxy.endpoint)
        store = s3_store(bucket, proxy.endpoint)

        print("gateway: cold read", flush=True)
        cold, direct, ranged, warm = [], [], [], []
        for r in range(rounds):
            name = f"big-{r}"
            start = time.perf_counter()
            result = await obstore.get_async(store, name)
            data = await result.bytes_async()
            direct.append(time.perf_counter() - start)
            assert len(data) == big
            del data
            start = time.perf_counter()
            got = await _ranged(store, name, big)
            ranged.append(time.perf_counter() - start)
            assert got == big
            start = time.perf_counter()
            got = await asyncio.to_thread(daemon.stream, f"data/{name}")
            cold.append(time.perf_counter() - start)
            assert got == big
            start = time.perf_counter()
            await asyncio.to_thread(daemon.stream, f"data/{name}")
            warm.append(time.perf_counter() - start)
        gb = big / 1e9
        report.add(
            Result(
                f"cold read {big // MiB} MiB through chunkd (HTTP)",
                gb / min(cold),
                gb / min(direct),
                "GB/s",
                "direct obstore get, whole object",
                target_ratio=0.9,
                note=(
                    "chunkd keeps several 4 MiB ranged GETs in flight, hashes and stores each "
                    "chunk, and streams to an HTTP client on loopback; the S3 server is moto"
                ),
            )
        )
        report.add(
            Result(
                f"cold read {big // MiB} MiB through chunkd, vs the same 4 MiB ranges",
                gb / min(cold),
                gb / min(ranged),
                "GB/s",
                "direct obstore ranged gets, 4 MiB each, 5 in flight",
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
                gb / min(warm),
                gb / min(cold),
                "GB/s",
                "the same read, cold",
            )
        )

        print(f"gateway: {processes} processes, same cold objects", flush=True)
        total = shared_size * shared_count
        names = [f"c-{i}" for i in range(shared_count)]
        proxy.reset()
        chunkd_s = _readers([[_CHUNKD_READER, daemon.url, *names] for _ in range(processes)])
        chunkd_bytes = proxy.bytes_down
        names = [f"s-{i}" for i in range(shared_count)]
        proxy.reset()
        s3fs_s = _readers(
            [[_S3FS_READER, proxy.endpoint, bucket, *names] for _ in range(processes)]
        )
        s3fs_bytes = proxy.bytes_down
        report.add(
            Result(
                f"{processes} processes, same {total // MiB} MiB cold: backend bytes / data",
                chunkd_bytes / total,
                s3fs_bytes / total,
                "x",
                "s3fs + fsspec readahead cache, per process",
                target_max=1.05,
                note=(
                    "bytes the S3 server sent, counted by a proxy in front of it, divided by "
                    "the bytes of the objects read; the target is 1.0x for chunkd"
                ),
            )
        )
        report.add(
            Result(
                f"{processes} processes, same {total // MiB} MiB cold: wall time",
                chunkd_s,
                s3fs_s,
                "s",
                "s3fs + fsspec readahead cache, per process",
                note="lower is better: ratio below 1 means chunkd finished first",
            )
        )
    finally:
        if daemon is not None:
            daemon.stop()
        proxy.close()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
