"""``chunkd warm NAME...``: load objects into a running daemon's cache, with progress."""

from __future__ import annotations

import json
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any, TextIO

from chunkd.gateway.tls import cacert_context, unreachable

__all__ = ["warm"]


def warm(
    names: Sequence[str], url: str, *, cacert: str | None = None, out: TextIO = sys.stdout
) -> int:
    """Warm each ``BACKEND/KEY`` in ``names`` through the daemon at ``url``.

    Prints one progress line per object (rewritten in place on a terminal) and a
    summary. Returns 0 when every object was loaded, 1 otherwise. ``cacert``: a PEM
    bundle to check an ``https://`` daemon against; None: the system's CAs.
    """
    try:
        context = cacert_context(cacert)
    except OSError as exc:
        print(f"chunkd warm: cannot use --cacert {cacert} ({exc})", file=sys.stderr)
        return 2
    failed = 0
    total = 0
    started = time.monotonic()
    for name in names:
        backend, _, key = name.partition("/")
        if not backend or not key:
            print(f"{name}: not a name; write BACKEND/KEY (e.g. data/shards/000.parquet)", file=out)
            failed += 1
            continue
        target = f"{url.rstrip('/')}/v1/warm/{urllib.parse.quote(backend, safe='')}/"
        target += urllib.parse.quote(key)
        try:
            total += _warm_one(name, target, out, context)
        except urllib.error.HTTPError as exc:
            failed += 1
            print(f"{name}: failed: {_error_message(exc)}", file=out)
        except OSError as exc:
            print(f"{name}: {unreachable(url, exc)}", file=out)
            return 1
    took = time.monotonic() - started
    print(
        f"warmed {len(names) - failed} of {len(names)} objects, {total / 2**20:.1f} MiB "
        f"in {took:.1f}s",
        file=out,
    )
    return 1 if failed else 0


def _warm_one(name: str, target: str, out: TextIO, context: ssl.SSLContext | None) -> int:
    request = urllib.request.Request(target, method="POST")
    last: dict[str, Any] = {}
    live = out.isatty()
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
    print(f"{lead}{name}: {size / 2**20:.1f} MiB in {last['chunks']} chunks, cached", file=out)
    return size


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read())
        return f"{exc.code} {body.get('message', '')}"
    except (ValueError, OSError):
        return f"{exc.code} {exc.reason}"
