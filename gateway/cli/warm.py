"""``chunkd warm NAME...``: load objects into a running daemon's cache, with progress.

Objects load ``jobs`` at a time (8 by default); the daemon bounds them again with
its own prefetch slots (``[server] prefetch_in_flight``), shared with every
client's ``prefetch``, so no number of names can start more loads than that.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import ssl
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any, TextIO

from chunkd.errors import InvalidKeyError
from chunkd.gateway.cli.options import http_options
from chunkd.gateway.names import split_name
from chunkd.gateway.tls import cacert_context, unreachable

__all__ = ["add_parser", "run", "warm"]


def warm(
    names: Sequence[str],
    url: str,
    *,
    cacert: str | None = None,
    jobs: int = 8,
    out: TextIO = sys.stdout,
) -> int:
    """Warm each ``BACKEND/KEY`` in ``names`` through the daemon at ``url``.

    Loads ``jobs`` objects at a time. Prints one line per object as it is cached (one
    at a time on a terminal, a progress line rewritten in place) and a summary.
    Returns 0 when every object was loaded, 1 otherwise. ``cacert``: a PEM bundle to
    check an ``https://`` daemon against; None: the system's CAs.
    """
    try:
        context = cacert_context(cacert)
    except OSError as exc:
        print(f"chunkd warm: cannot use --cacert {cacert} ({exc})", file=sys.stderr)
        return 2
    if jobs < 1:
        print(f"chunkd warm: --jobs must be 1 or more; got {jobs}", file=sys.stderr)
        return 2
    lock = threading.Lock()
    live = jobs == 1 and out.isatty()
    gone = threading.Event()  # the daemon cannot be reached: stop starting loads
    failed = 0
    total = 0
    started = time.monotonic()

    def one(name: str) -> None:
        nonlocal failed, total
        try:
            backend, key = split_name(name)
        except InvalidKeyError:
            with lock:
                print(
                    f"{name}: not a name; write BACKEND/KEY (e.g. data/shards/000.parquet)",
                    file=out,
                )
                failed += 1
            return
        if gone.is_set():
            with lock:
                failed += 1
            return
        target = f"{url.rstrip('/')}/v1/warm/{urllib.parse.quote(backend, safe='')}/"
        target += urllib.parse.quote(key)
        try:
            size = _warm_one(name, target, out, context, live, lock)
        except urllib.error.HTTPError as exc:
            with lock:
                failed += 1
                print(f"{name}: failed: {_error_message(exc)}", file=out)
        except OSError as exc:
            with lock:
                failed += 1
                if not gone.is_set():
                    print(f"{name}: {unreachable(url, exc)}", file=out)
                gone.set()
        else:
            with lock:
                total += size

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, names))
    if gone.is_set():
        return 1
    took = time.monotonic() - started
    print(
        f"warmed {len(names) - failed} of {len(names)} objects, {total / 2**20:.1f} MiB "
        f"in {took:.1f}s",
        file=out,
    )
    return 1 if failed else 0


def _warm_one(
    name: str,
    target: str,
    out: TextIO,
    context: ssl.SSLContext | None,
    live: bool,
    lock: threading.Lock,
) -> int:
    request = urllib.request.Request(target, method="POST")
    last: dict[str, Any] = {}
    with urllib.request.urlopen(request, timeout=3600, context=context) as response:
        for line in response:
            last = json.loads(line)
            if live and not last.get("done"):
                loaded, size = int(last["loaded"]), max(1, int(last["size"]))
                mib = size / 2**20
                print(f"\r{name}: {100 * loaded // size:3d}% of {mib:.1f} MiB", end="", file=out)
    if not last.get("done"):
        raise OSError(f"the daemon stopped answering while warming {name}")
    size = int(last["size"])
    lead = "\r" if live else ""
    with lock:
        print(f"{lead}{name}: {size / 2**20:.1f} MiB in {last['chunks']} chunks, cached", file=out)
    return size


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read())
        return f"{exc.code} {body.get('message', '')}"
    except (ValueError, OSError):
        return f"{exc.code} {exc.reason}"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Declare ``chunkd warm``."""
    warm = sub.add_parser(
        "warm",
        help="load objects into the daemon's cache ahead of a job",
        description="Load BACKEND/KEY objects into a running daemon's cache, showing progress.",
    )
    warm.add_argument("names", nargs="+", metavar="NAME", help="BACKEND/KEY of an object")
    warm.add_argument(
        "--jobs",
        type=int,
        default=8,
        help="objects loaded at once (default: %(default)s; the daemon also bounds them)",
    )
    http_options(warm)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``chunkd warm``; returns the exit status."""
    return warm(args.names, args.url, cacert=args.cacert, jobs=args.jobs)
