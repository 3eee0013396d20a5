"""``chunkd gc``: retention and mark-and-sweep of checkpoint chunks, run by the daemon;
``chunkd gc BACKEND --scrub [--remove]``: every chunk of a store checked against its name.

It talks to the running daemon over its local socket, so it uses its backends and
credentials and never needs its own.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from chunkd.errors import ChunkdError
from chunkd.gateway.cli.options import human_size, socket_option

__all__ = ["add_parser", "gc", "run", "scrub"]


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
    if report.get("others_kept"):
        print(
            f"kept {report['others_kept']} checkpoints of other users (retention counts and "
            "retires only yours; docs/security.md)",
            file=out,
        )
    print(
        f"chunks: {report['chunks']} in the backend, {report['referenced']} referenced, "
        f"{report['kept_young']} unreferenced but younger than the grace period; "
        f"{verb} {report['swept']} ({human_size(report['freed_bytes'])})",
        file=out,
    )
    return 0


def scrub(backend: str, *, remove: bool, socket: str | None, out: TextIO = sys.stdout) -> int:
    """Check every chunk of ``backend``'s chunk store in the daemon; print each problem.

    Returns 0 when every chunk matches its name, 1 when some do not (or could not be
    checked), 2 on an error.
    """
    from chunkd.client import Client
    from chunkd.client import checkpoint as ckpt

    checked = size = removed = problems = 0
    try:
        with Client(socket) as client:
            for page in ckpt.scrub(backend, remove=remove, client=client):
                checked += page["checked"]
                size += page["bytes"]
                removed += page["removed"]
                for item in page["damaged"]:
                    problems += 1
                    print(f"{backend}/{item['key']}: {item['problem']}", file=out, flush=True)
    except ChunkdError as exc:
        print(f"chunkd gc --scrub: {exc}", file=sys.stderr)
        return 2
    verdict = f"{problems} problems" if problems else "no problems"
    tail = f"; removed {removed} damaged chunks" if remove else ""
    print(f"checked {checked} chunks ({human_size(size)}) of {backend}: {verdict}{tail}", file=out)
    if problems and not remove:
        print(
            "a damaged chunk is sent again by the next save or freeze that holds its bytes; "
            f"`chunkd gc {backend} --scrub --remove` deletes them now",
            file=out,
        )
    return 1 if problems else 0


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
    gc.add_argument(
        "--scrub",
        action="store_true",
        help=(
            "instead of collecting: read every chunk of BACKEND's chunk store and report "
            "those whose bytes do not hash to their names (exit status 1 if any)"
        ),
    )
    gc.add_argument(
        "--remove",
        action="store_true",
        help="with --scrub: delete the damaged chunks (an admin: docs/security.md)",
    )
    socket_option(gc)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``chunkd gc``; returns the exit status."""
    from chunkd.errors import ConfigError
    from chunkd.gateway.config import parse_duration

    if args.remove and not args.scrub:
        parser.error("--remove goes with --scrub")
    if args.scrub:
        if args.keep_last is not None or args.dry_run:
            parser.error("--scrub takes neither --keep-last nor --dry-run")
        backend = args.target.partition("/")[0]
        return scrub(backend, remove=args.remove, socket=args.socket)
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
