"""``chunkd stats``: what the node's daemon says about itself, for a person to read."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any, TextIO

from chunkd.gateway.cli.options import http_options, human_size
from chunkd.gateway.tls import cacert_context, unreachable

__all__ = ["add_parser", "run", "stats"]


def stats(url: str, *, as_json: bool, cacert: str | None = None, out: TextIO = sys.stdout) -> int:
    """Print ``/v1/stats`` of the daemon at ``url``; returns the exit status.

    ``cacert``: a PEM bundle to check an ``https://`` daemon against (its ``[peers]
    tls_ca``); None: the system's CAs.
    """
    try:
        context = cacert_context(cacert)
    except OSError as exc:
        print(f"chunkd stats: cannot use --cacert {cacert} ({exc})", file=sys.stderr)
        return 2
    try:
        with urllib.request.urlopen(
            f"{url.rstrip('/')}/v1/stats", timeout=10, context=context
        ) as response:
            body = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"chunkd stats: {unreachable(url, exc)}", file=sys.stderr)
        return 1
    if as_json:
        json.dump(body, out, indent=2)
        out.write("\n")
        return 0
    print(f"chunkd {body.get('version')}, up {body.get('uptime_s', 0):.0f}s", file=out)
    for tier in body.get("cache", {}).get("tiers", []):
        print(
            f"  {tier['name']:>5}: {human_size(tier['bytes'])} "
            f"of {human_size(tier['budget_bytes'])}, "
            f"{tier['chunks']} chunks, {tier['hits']} hits, {tier['evictions']} evictions"
            + (f", degraded: {tier['degraded']}" if tier.get("degraded") else ""),
            file=out,
        )
    for backend in body.get("backends", []):
        state = "circuit open" if backend.get("circuit_open") else "ok"
        print(f"  backend {backend['name']} ({backend['scheme']}): {state}", file=out)
    jobs = body.get("checkpoints", {}).get("jobs", [])
    for job in jobs:
        print(f"  saving {job['name']} rank {job['rank']}: {job['state']}", file=out)
    peers: dict[str, Any] | None = body.get("peers")
    if peers:
        members = peers.get("members", [])
        tls = ", TLS" if peers.get("tls") else ""
        print(
            f"  peers: {peers['healthy']} of {len(members)} up (self {peers['self']}{tls})",
            file=out,
        )
        for member in members:
            print(f"    {member['address']:<24} {'up' if member['healthy'] else 'DOWN'}", file=out)
    else:
        print("  peers: none ([peers] is not configured)", file=out)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Declare ``chunkd stats``."""
    stats = sub.add_parser(
        "stats",
        help="show what the daemon holds: tiers, backends, saves, peers",
        description="Print the running daemon's /v1/stats for a person (or --json).",
    )
    http_options(stats)
    stats.add_argument("--json", action="store_true", help="print the JSON as it is")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``chunkd stats``; returns the exit status."""
    return stats(args.url, as_json=args.json, cacert=args.cacert)
