"""Cold reads at link speed: chunkd against a direct obstore read over the same link.

S3 (s3rver, :mod:`chunkd.testing.s3rver`, which serves a range without reading the
whole object as moto does) runs in a network namespace of its own behind a
tbf-shaped link (:mod:`chunkd.testing.netlab`, root only; skipped otherwise). chunkd
runs in node 1's namespace with an empty cache each round; the baseline is obstore
itself, run in the same namespace, so both cross the same link. This kernel has no
netem: latency comes from the lab's userspace relay on node 1's link
(:meth:`~chunkd.testing.netlab.Lab.delay`), half of the round trip each way.

Rows, per added round trip (1 ms and 10 ms; ``--quick``: 1 ms):

1. one 1 GiB object read whole: chunkd's local socket (``read_into`` one buffer)
   against one obstore GET of it (target 0.95x);
2. 2,000 objects of 256 KiB, 32 at a time on both sides: 32 threads with a chunkd
   ``Client`` each against 32 obstore GETs in flight (target 0.9x).

First, the S3 server alone: a direct read with the link unshaped, which the link
rate is chosen below (at most half of it), so that the link, not the server, is
what both sides share.

``python -m bench.coldlink_bench direct ...`` is the baseline's reader, run by the
bench inside the node's namespace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from chunkd.client import Client
from chunkd.testing import netlab

from .report import Report, Result, Rounds

SMALL = 256 << 10
CONCURRENCY = 32
BUCKET = "fanout"
PREFIX = "pre"


def _direct(lab: netlab.Lab, keys: list[str], *, whole: bool) -> float:
    """Seconds obstore takes in node 1's namespace to read ``keys`` (one GET each,
    :data:`CONCURRENCY` at a time), timed by the reader itself."""
    args = [
        "ip",
        "netns",
        "exec",
        lab.nodes[0],
        sys.executable,
        "-m",
        "bench.coldlink_bench",
        "direct",
        "--endpoint",
        f"http://{lab.s3_ip}:9000",
        "--key",
        lab.s3_keys[0],
        "--secret",
        lab.s3_keys[1],
        "--concurrency",
        str(1 if whole else CONCURRENCY),
        *(f"{PREFIX}/{key}" for key in keys),
    ]
    done = subprocess.run(
        args,
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"the direct reader failed (exit {done.returncode}): "
            f"{(done.stderr or done.stdout)[-2000:]}"
        )
    return float(json.loads(done.stdout)["seconds"])


def _through_chunkd(lab: netlab.Lab, keys: list[str], sizes: dict[str, int]) -> float:
    """Seconds chunkd takes to deliver ``keys`` cold (a fresh daemon, an empty cache)
    into buffers of the reader's, :data:`CONCURRENCY` readers at a time."""
    lab.stop_nodes()
    lab.start_node(1, peers=False)
    local = threading.local()
    clients: list[Client] = []
    lock = threading.Lock()

    def read(key: str) -> int:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = Client(lab.socket(1), timeout=900)
            with lock:
                clients.append(client)
        buffer = bytearray(sizes[key])
        got = client.read_into(f"ckpt/{key}", buffer)
        assert got == sizes[key], (key, got)
        return got

    try:
        with ThreadPoolExecutor(min(CONCURRENCY, len(keys))) as pool:
            started = time.perf_counter()
            total = sum(pool.map(read, keys))
            took = time.perf_counter() - started
    finally:
        for client in clients:
            client.close()
    assert total == sum(sizes[k] for k in keys)
    return took


def _rounds(rounds: int, sides: dict[str, Callable[[], float]], amount: float) -> Rounds:
    """Run each side ``rounds`` times, rotating their order; rates (amount/s)."""
    names = list(sides)
    got: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            got[name].append(amount / sides[name]())
    return Rounds.of(got["chunkd"], got["direct"])


def run(report: Report, work: Path, *, quick: bool) -> None:
    """Every row; ``quick`` shrinks the objects, and runs one round trip and one round."""
    try:
        with netlab.lab(work, node_rate="10gbit", s3_rate="10gbit") as lab:
            lab.start_s3(server="s3rver")
            _measure(report, lab, quick=quick)
    except netlab.LabUnavailable as exc:
        print(f"  cold reads at link speed: skipped ({exc})", flush=True)


def _measure(report: Report, lab: netlab.Lab, *, quick: bool) -> None:
    big_bytes = (16 << 20) if quick else (1 << 30)
    count = 50 if quick else 2000
    rounds = report.rounds_for(1 if quick else 3)
    s3 = lab.s3_client()
    big = os.urandom(big_bytes)
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/big.bin", Body=big)
    del big
    small = [f"small/{i:05d}.bin" for i in range(count)]
    for key in small:
        s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{key}", Body=os.urandom(SMALL))
    sizes = {"big.bin": big_bytes, **dict.fromkeys(small, SMALL)}

    # The server alone, the link unshaped: the link is set well below it.
    _direct(lab, ["big.bin"], whole=True)  # into the server's page cache
    server = max(big_bytes / _direct(lab, ["big.bin"], whole=True) for _ in range(2))
    link_mbit = int(min(500, server * 8 / 1e6 / 2)) if not quick else 200
    lab.shape_s3(f"{link_mbit}mbit")
    link = link_mbit * 1e6 / 8
    report.add(
        Result(
            "headroom: s3rver unshaped (a direct GET) over the link the rows share",
            server / 1e9,
            link / 1e9,
            "GB/s",
            f"the link the rows below share, {link_mbit} Mbit/s",
            area="cold reads at link speed",
            note="the link is at most half of what the server sustains here (a ratio of 2 or "
            "more), so that the link, not s3rver on 2 shared cores, is the bottleneck both "
            "sides meet",
        )
    )
    for rtt_ms in (1,) if quick else (1, 10):
        lab.delay(1, rtt_ms / 2000)
        try:
            whole = _rounds(
                rounds,
                {
                    "chunkd": lambda: _through_chunkd(lab, ["big.bin"], sizes),
                    "direct": lambda: _direct(lab, ["big.bin"], whole=True),
                },
                big_bytes,
            )
            report.add(
                Result(
                    f"cold read of one {big_bytes >> 20} MiB object, {link_mbit} Mbit/s "
                    f"link, +{rtt_ms} ms RTT",
                    statistics.median(whole.chunkd) / 1e6,
                    statistics.median(whole.baseline) / 1e6,
                    "MB/s",
                    "one obstore GET of it, in the same namespace",
                    target_ratio=0.95,
                    samples=whole.scaled(1e-6),
                    area="cold reads at link speed",
                    note=f"the link's rate is {link / 1e6:.1f} MB/s",
                )
            )
            many = _rounds(
                rounds,
                {
                    "chunkd": lambda: _through_chunkd(lab, small, sizes),
                    "direct": lambda: _direct(lab, small, whole=False),
                },
                count * SMALL,
            )
            report.add(
                Result(
                    f"cold read of {count:,} objects of 256 KiB, {CONCURRENCY} at a time, "
                    f"+{rtt_ms} ms RTT",
                    statistics.median(many.chunkd) / 1e6,
                    statistics.median(many.baseline) / 1e6,
                    "MB/s",
                    f"obstore GETs, {CONCURRENCY} in flight, in the same namespace",
                    target_ratio=0.9,
                    samples=many.scaled(1e-6),
                    area="cold reads at link speed",
                    note=f"{CONCURRENCY} threads with a chunkd Client each; each object one "
                    "GET on both sides (chunkd learns its version from that GET)",
                )
            )
        finally:
            lab.heal(1)
        lab.stop_nodes()


# -- the direct reader, in the node's namespace ------------------------------------------


async def _read_direct(args: argparse.Namespace) -> float:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        BUCKET,
        endpoint=args.endpoint,
        access_key_id=args.key,
        secret_access_key=args.secret,
        region="us-east-1",
        client_options={"allow_http": True},
        virtual_hosted_style_request=False,
    )
    gate = asyncio.Semaphore(args.concurrency)

    async def one(key: str) -> int:
        async with gate:
            result = await obstore.get_async(store, key)
            return len(await result.bytes_async())

    started = time.perf_counter()
    await asyncio.gather(*(one(key) for key in args.keys))
    return time.perf_counter() - started


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.coldlink_bench")
    sub = parser.add_subparsers(dest="command", required=True)
    direct = sub.add_parser("direct", help="read keys with obstore; print the seconds")
    direct.add_argument("--endpoint", required=True)
    direct.add_argument("--key", required=True)
    direct.add_argument("--secret", required=True)
    direct.add_argument("--concurrency", type=int, default=1)
    direct.add_argument("keys", nargs="+")
    args = parser.parse_args(argv)
    seconds = asyncio.run(_read_direct(args))
    print(json.dumps({"seconds": seconds}), flush=True)
    # Out at once: obstore's runtime torn down at interpreter exit, after a 1 GiB GET,
    # now and then aborts the process (SIGABRT) once the figure is already printed.
    os._exit(0)


if __name__ == "__main__":
    _main()
