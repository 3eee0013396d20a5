"""The S3 front against the other doors onto the same node, and against the S3 server.

One ``chunkd serve`` with ``[s3_front]`` over bucket ``data`` (a moto server on
loopback, behind a proxy that counts the bytes it sends: that count, not the daemon's
metrics, is the backend bytes figure). Every S3 client is boto3 with its default
config (:func:`chunkd.testing.s3front.front_client`; the direct one is configured the
same way with moto's keys), reading into memory with ``get_object()['Body'].read()``.

1. A warm 256 MiB object (``--quick``: 8 MiB), read whole once through ``/v1/objects``
   first: ``GetObject`` through the front, and s3transfer's ``download_fileobj`` (default
   ``TransferConfig``: 8 MiB ranged GETs, 10 threads) into a ``BytesIO``, against the
   same read over ``GET /v1/objects`` (urllib, read whole) and over the local socket
   (``chunkd.client.Client``: ``read``, a zero-copy view, and ``read_into`` a buffer
   allocated once).
2. A cold object of the same size: ``GetObject`` through the front (a fresh object each
   run) against a direct ``GetObject`` of the same object from the S3 server.
3. 8 processes (``--quick``: 2) reading the same cold objects, 4 of 32 MiB (``--quick``:
   2 of 4 MiB), through the front, against 8 processes reading them from the S3 server
   directly: backend bytes over the objects' bytes (the goal is 1.0x: one fetch for all
   8) and wall time. Each process builds its client, says it is ready and waits: the
   time runs from the go to the last exit, so interpreter start and imports are not in it.

Each contender runs once untimed, then 3 times (``--quick``: once), the contenders'
order rotating each round; a row shows the medians, its note each side's spread.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chunkd.client import Client
from chunkd.testing import CountingProxy, S3Server, free_port
from chunkd.testing.s3front import FRONT_KEY, FRONT_SECRET, front_client, front_section

from .daemon import BenchDaemon
from .report import Report, Result, Rounds

MiB = 1 << 20
#: the S3 server's keys (what :meth:`S3Server.client` signs with)
SERVER_KEY, SERVER_SECRET = "testing", "testing-secret"
BACKEND = "data"
PREFIX = "pre/"

#: one reader process: builds its boto3 client, says ``ready``, reads every object
#: whole on ``go`` and prints the bytes it read
_READER = textwrap.dedent(
    """
    import sys, boto3
    endpoint, key_id, secret, bucket, prefix, *names = sys.argv[1:]
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key_id,
                      aws_secret_access_key=secret, region_name="us-east-1")
    print("ready", flush=True)
    sys.stdin.readline()
    got = 0
    for name in names:
        got += len(s3.get_object(Bucket=bucket, Key=prefix + name)["Body"].read())
    print(got, flush=True)
    """
)

#: one timed run: takes the round (0 is the warm-up), returns seconds
Phase = Callable[[int], float]


def _daemon(work: Path, bucket: str, endpoint: str, front_port: int) -> BenchDaemon:
    work.mkdir(parents=True, exist_ok=True)
    config = work / "chunkd.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [cache]
            dir = "{work / "cache"}"
            ram_bytes = "3GiB"
            disk_bytes = "4GiB"
            disk_min_free_bytes = 0
            fsync = "never"
            write_policy = "write-behind"
            [[backends]]
            name = "{BACKEND}"
            url = "s3://{bucket}/{PREFIX.rstrip("/")}"
            endpoint = "{endpoint}"
            region = "us-east-1"
            access_key_id = "{SERVER_KEY}"
            secret_access_key = "{SERVER_SECRET}"
            allow_http = true
            """
        )
        + front_section(front_port)
    )
    return BenchDaemon(work, {}, config)


def _direct_client(endpoint: str) -> Any:
    """boto3 on the S3 server itself (through the proxy), default config, as a user has it."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=SERVER_KEY,
        aws_secret_access_key=SERVER_SECRET,
        region_name="us-east-1",
    )


def _upload(server: S3Server, bucket: str, name: str, size: int) -> str:
    """Put ``size`` random bytes at ``pre/NAME``; returns their digest (random, so no
    two objects share a chunk the cache could already hold)."""
    data = os.urandom(size)
    server.client().put_object(Bucket=bucket, Key=PREFIX + name, Body=data)
    return hashlib.blake2b(data).hexdigest()


def _interleaved(rounds: int, phases: dict[str, Phase]) -> dict[str, list[float]]:
    """Every phase once untimed (round 0), then ``rounds`` rounds in a rotating order,
    as :func:`bench.report.interleave` does; returns each phase's seconds per round."""
    names = list(phases)
    for name in names:
        phases[name](0)
    took: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            took[name].append(phases[name](i + 1))
    return took


def _timed(fn: Callable[[], int], want: int) -> float:
    start = time.perf_counter()
    got = fn()
    took = time.perf_counter() - start
    if got != want:
        raise RuntimeError(f"a read returned {got:,} bytes of a {want:,}-byte object")
    return took


def _rates(size: int, seconds: list[float]) -> list[float]:
    return [size / 1e9 / s for s in seconds]


def _spread(values: list[float], digits: int = 2) -> str:
    """``median (min-max), N runs``."""
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:.{digits}f} ({low:.{digits}f}-{high:.{digits}f}, {len(values)} runs)"


def _readers(
    processes: int,
    endpoint: str,
    credentials: tuple[str, str],
    bucket: str,
    prefix: str,
    names: list[str],
    want: int,
) -> float:
    """Wall time of ``processes`` reader processes reading ``names`` whole (``want``
    bytes in all, each), from the go to the last exit."""
    env = os.environ | {"AWS_EC2_METADATA_DISABLED": "true"}
    args = [sys.executable, "-c", _READER, endpoint, *credentials, bucket, prefix, *names]
    procs = [
        subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(processes)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a reader process failed before it was ready")
        start = time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outputs = [p.communicate(timeout=900)[0] for p in procs]
        took = time.perf_counter() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    if any(codes):
        raise RuntimeError(f"a reader process failed: exit codes {codes}")
    got = [int(o.strip().splitlines()[-1]) for o in outputs]
    if any(g != want for g in got):
        raise RuntimeError(f"reader processes read {got} bytes; each should have read {want:,}")
    return took


def run(report: Report, work: Path, *, quick: bool) -> None:
    """The S3 front scenarios (``quick``: small objects, to check the bench runs)."""
    size = (8 if quick else 256) * MiB
    shared_size = (4 if quick else 32) * MiB
    shared_count = 2 if quick else 4
    processes = 2 if quick else 8
    rounds = report.rounds_for(1 if quick else 3)
    work.mkdir(parents=True, exist_ok=True)
    server = S3Server.start()
    proxy = CountingProxy(server.port)
    bucket = f"bench-{uuid.uuid4().hex[:10]}"
    server.client().create_bucket(Bucket=bucket)
    daemon = None
    client = None
    try:
        print("s3front: uploading objects", flush=True)
        digest = _upload(server, bucket, "warm", size)
        for r in range(rounds + 1):
            _upload(server, bucket, f"cold-{r}", size)
            for i in range(shared_count):
                _upload(server, bucket, f"s{r}-{i}", shared_size)
        front_port = free_port()
        daemon = _daemon(work / "daemon", bucket, proxy.endpoint, front_port)
        front = front_client(f"http://127.0.0.1:{front_port}")
        direct = _direct_client(proxy.endpoint)
        client = Client(daemon.socket, cache_bytes=2 * size)
        _warm(report, daemon, front, client, size, digest, rounds)
        _cold(report, proxy, front, direct, bucket, size, rounds)
        _shared(
            report,
            proxy,
            front_port,
            bucket,
            processes=processes,
            shared_size=shared_size,
            shared_count=shared_count,
            rounds=rounds,
        )
    finally:
        if client is not None:
            client.close()
        if daemon is not None:
            daemon.stop()
        proxy.close()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def _warm(
    report: Report,
    daemon: BenchDaemon,
    front: Any,
    client: Client,
    size: int,
    digest: str,
    rounds: int,
) -> None:
    print("s3front: warm object", flush=True)
    name = f"{BACKEND}/warm"
    got = daemon.http(name)  # warms the daemon; the front must serve the same bytes
    if hashlib.blake2b(got).hexdigest() != digest:
        raise RuntimeError("GET /v1/objects served other bytes than were uploaded")
    body = front.get_object(Bucket=BACKEND, Key="warm")["Body"].read()
    if hashlib.blake2b(body).hexdigest() != digest:
        raise RuntimeError("the S3 front's GetObject served other bytes than were uploaded")
    del got, body
    buffer = bytearray(size)

    def get_object(_round: int) -> float:
        return _timed(
            lambda: len(front.get_object(Bucket=BACKEND, Key="warm")["Body"].read()), size
        )

    def download_fileobj(r: int) -> float:
        sink = io.BytesIO()

        def download() -> int:
            front.download_fileobj(BACKEND, "warm", sink)
            return sink.seek(0, io.SEEK_END)  # its parts land out of order

        took = _timed(download, size)
        if r == 0 and hashlib.blake2b(sink.getbuffer()).hexdigest() != digest:
            raise RuntimeError("download_fileobj through the S3 front got other bytes")
        return took

    took = _interleaved(
        rounds,
        {
            "get_object": get_object,
            "download_fileobj": download_fileobj,
            "http": lambda _r: _timed(lambda: len(daemon.http(name)), size),
            "read": lambda _r: _timed(lambda: len(client.read(name)), size),
            "read_into": lambda _r: _timed(lambda: client.read_into(name, buffer), size),
        },
    )
    rates = {contender: _rates(size, seconds) for contender, seconds in took.items()}
    median = {contender: statistics.median(r) for contender, r in rates.items()}
    mib = size // MiB
    alternatives = {
        "http": (
            "/v1/objects (HTTP)",
            "GET /v1/objects of the same object, read whole (urllib)",
        ),
        "read": (
            "Client.read (local socket)",
            "chunkd.client.Client.read over the local socket: a zero-copy view",
        ),
        "read_into": (
            "Client.read_into (local socket)",
            "chunkd.client.Client.read_into a buffer allocated once (one copy)",
        ),
    }
    for alternative, (label, baseline_name) in alternatives.items():
        report.add(
            Result(
                f"s3 front: warm {mib} MiB GetObject, vs {label}",
                median["get_object"],
                median[alternative],
                "GB/s",
                baseline_name,
                samples=Rounds.of(rates["get_object"], rates[alternative]),
                note=(
                    f"boto3 get_object()['Body'].read(), default config, the object in the "
                    f"daemon's RAM tier; GB/s, median (min-max): front "
                    f"{_spread(rates['get_object'])}, {alternative} {_spread(rates[alternative])}"
                ),
            )
        )
    report.add(
        Result(
            f"s3 front: warm {mib} MiB download_fileobj, vs /v1/objects (HTTP)",
            median["download_fileobj"],
            median["http"],
            "GB/s",
            alternatives["http"][1],
            samples=Rounds.of(rates["download_fileobj"], rates["http"]),
            note=(
                "s3transfer with its default TransferConfig (8 MiB ranged GETs, 10 threads) "
                "into a BytesIO, through the front; GB/s, median (min-max): front "
                f"{_spread(rates['download_fileobj'])}, http {_spread(rates['http'])}"
            ),
        )
    )


def _cold(
    report: Report,
    proxy: CountingProxy,
    front: Any,
    direct: Any,
    bucket: str,
    size: int,
    rounds: int,
) -> None:
    print("s3front: cold object", flush=True)
    fetched: list[float] = []
    checksummed: list[bool] = []

    def through_front(r: int) -> float:
        proxy.reset()
        took = _timed(
            lambda: len(front.get_object(Bucket=BACKEND, Key=f"cold-{r}")["Body"].read()), size
        )
        fetched.append(proxy.bytes_down / size)
        return took

    def from_server(r: int) -> float:
        def get() -> int:
            answer = direct.get_object(Bucket=bucket, Key=f"{PREFIX}cold-{r}")
            headers = answer["ResponseMetadata"]["HTTPHeaders"]
            checksummed.append(any(h.startswith("x-amz-checksum-") for h in headers))
            return len(answer["Body"].read())

        return _timed(get, size)

    took = _interleaved(rounds, {"front": through_front, "direct": from_server})
    front_rates, direct_rates = _rates(size, took["front"]), _rates(size, took["direct"])
    checked = (
        "the server's answers carry x-amz-checksum-*, which boto3 checks by default"
        if any(checksummed)
        else "no answer carries a checksum for boto3 to check"
    )
    report.add(
        Result(
            f"s3 front: cold {size // MiB} MiB GetObject, vs the S3 server",
            statistics.median(front_rates),
            statistics.median(direct_rates),
            "GB/s",
            "boto3 get_object of the same object from the S3 server (through the proxy)",
            samples=Rounds.of(front_rates, direct_rates),
            note=(
                f"a fresh object each run; GB/s, median (min-max): front "
                f"{_spread(front_rates)}, direct {_spread(direct_rates)}; backend bytes / "
                f"object through the front "
                f"{', '.join(f'{b:.3f}' for b in fetched)} (warm-up first). chunkd fetches "
                f"4 MiB ranges, and moto answers a ranged GET by reading the whole object "
                f"(see the gateway rows), which a direct whole GET never pays; {checked}"
            ),
        )
    )


def _shared(
    report: Report,
    proxy: CountingProxy,
    front_port: int,
    bucket: str,
    *,
    processes: int,
    shared_size: int,
    shared_count: int,
    rounds: int,
) -> None:
    print(f"s3front: {processes} processes, same cold objects", flush=True)
    total = shared_size * shared_count
    fetched: dict[str, list[float]] = {"front": [], "direct": []}

    def phase(side: str) -> Phase:
        def one(r: int) -> float:
            names = [f"s{r}-{i}" for i in range(shared_count)]
            proxy.reset()
            if side == "front":
                endpoint = f"http://127.0.0.1:{front_port}"
                front_keys = (FRONT_KEY, FRONT_SECRET)
                took = _readers(processes, endpoint, front_keys, BACKEND, "", names, total)
            else:
                server_keys = (SERVER_KEY, SERVER_SECRET)
                took = _readers(
                    processes, proxy.endpoint, server_keys, bucket, PREFIX, names, total
                )
            if r:
                fetched[side].append(proxy.bytes_down / total)
            return took

        return one

    took = _interleaved(rounds, {"front": phase("front"), "direct": phase("direct")})
    label = f"{processes} processes, same {total // MiB} MiB cold"
    baseline_name = f"{processes} boto3 processes reading the S3 server directly"
    report.add(
        Result(
            f"s3 front: {label}: backend bytes / data",
            statistics.median(fetched["front"]),
            statistics.median(fetched["direct"]),
            "x",
            baseline_name,
            target_max=1.05,
            samples=Rounds.of(fetched["front"], fetched["direct"]),
            note=(
                f"bytes the S3 server sent, counted by a proxy in front of it, over the "
                f"objects' bytes; fresh objects each run, read by both sides; median "
                f"(min-max): front {_spread(fetched['front'], 3)}, direct "
                f"{_spread(fetched['direct'], 3)}; the target is 1.0x: single flight across "
                f"the {processes} processes"
            ),
        )
    )
    report.add(
        Result(
            f"s3 front: {label}: wall time",
            statistics.median(took["front"]),
            statistics.median(took["direct"]),
            "s",
            baseline_name,
            samples=Rounds.of(took["front"], took["direct"]),
            note=(
                f"lower is better: ratio below 1 means the front finished first; from the go "
                f"to the last exit; s, median (min-max): front {_spread(took['front'])}, direct "
                f"{_spread(took['direct'])}"
            ),
        )
    )
