"""``chunkd gc``: retention and mark-and-sweep of checkpoint chunks, run by the daemon.

It talks to the running daemon over its local socket, so it uses its backends and
credentials and never needs its own.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from chunkd.errors import ChunkdError
from chunkd.gateway.cli.options import human_size, socket_option

__all__ = ["add_parser", "gc", "run"]


def gc(
    target: str,
    *,
    keep_last: int | None,
    grace: float,
    dry_run: bool,
    socket: str | None,
    out: TextIO = sys.stdout,
) -> int:
    """Run retention and mark-and-sweep in the daemon; print what it did."""
    from chunkd.client import Client
    from chunkd.client import checkpoint as ckpt

    try:
        with Client(socket) as client:
            report = ckpt.gc(
                target, keep_last=keep_last, grace=grace, dry_run=dry_run, client=client
            )
    except ChunkdError as exc:
        print(f"chunkd gc: {exc}", file=sys.stderr)
        return 1
    verb = "would remove" if dry_run else "removed"
    for name in report.get("retired", []):
        print(f"{verb} checkpoint {name} (keep_last {keep_last})", file=out)
    print(
        f"chunks: {report['chunks']} in the backend, {report['referenced']} referenced, "
        f"{report['kept_young']} unreferenced but younger than the grace period; "
        f"{verb} {report['swept']} ({human_size(report['freed_bytes'])})",
        file=out,
    )
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Declare ``chunkd gc``."""
    gc = sub.add_parser(
        "gc",
        help="delete checkpoint chunks no manifest references",
        description=(
            "Retention (--keep-last N checkpoints under BACKEND/PREFIX, by step), then "
            "mark every chunk that a manifest, an uncommitted save or an in-flight "
            "intent references anywhere in the backend, and sweep the others that are "
            "older than the grace period."
        ),
    )
    gc.add_argument("target", metavar="BACKEND[/PREFIX]")
    gc.add_argument("--keep-last", type=int, metavar="N", help="keep the N newest checkpoints")
    gc.add_argument(
        "--grace",
        default="1h",
        help="sweep only chunks older than this (default: %(default)s)",
    )
    gc.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    socket_option(gc)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``chunkd gc``; returns the exit status."""
    from chunkd.errors import ConfigError
    from chunkd.gateway.config import parse_duration

    if args.keep_last is not None and args.keep_last < 0:
        parser.error("--keep-last must be 0 or more")
    try:
        grace = parse_duration(args.grace, key="--grace", source="the command line")
    except ConfigError as exc:
        parser.error(str(exc))
    return gc(
        args.target,
        keep_last=args.keep_last,
        grace=grace,
        dry_run=args.dry_run,
        socket=args.socket,
    )
