"""``chunkd ckpt ls``: checkpoints as the node's daemon sees them.

It talks to the running daemon over its local socket, so it uses its backends and
credentials and never needs its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

from chunkd.errors import ChunkdError
from chunkd.gateway.cli.options import human_size, socket_option

__all__ = ["add_parser", "ls", "run"]


def ls(prefix: str, *, socket: str | None, as_json: bool, out: TextIO = sys.stdout) -> int:
    """Print the checkpoints under ``BACKEND[/PREFIX]`` (every page); returns the exit status."""
    from chunkd.client import Client
    from chunkd.client import checkpoint as ckpt

    try:
        with Client(socket) as client:
            entries = ckpt.list(prefix, client=client)
    except ChunkdError as exc:
        print(f"chunkd ckpt ls: {exc}", file=sys.stderr)
        return 1
    if as_json:
        json.dump(entries, out, indent=2)
        out.write("\n")
        return 0
    rows: list[tuple[str, ...]] = [
        ("NAME", "STEP", "SIZE", "NEW", "DEDUP", "DURABILITY", "STATE", "CREATED")
    ]
    rows += [_row(e) for e in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip(), file=out
        )
    if not entries:
        print(f"(no checkpoints under {prefix})", file=out)
    return 0


def _row(entry: dict[str, Any]) -> tuple[str, ...]:
    logical, new = int(entry.get("logical_bytes") or 0), int(entry.get("new_bytes") or 0)
    dedup = "-" if not logical else ("all" if new == 0 else f"{logical / new:.2f}x")
    created = entry.get("created")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created)) if created else "-"
    step = entry.get("step")
    return (
        str(entry["name"]),
        "-" if step is None else str(step),
        human_size(logical),
        human_size(new),
        dedup,
        str(entry.get("durability") or "-"),
        str(entry.get("state") or "-"),
        when,
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Declare ``chunkd ckpt ls``."""
    ckpt = sub.add_parser(
        "ckpt",
        help="list checkpoints",
        description="Checkpoints saved through chunkd, as the node's daemon sees them.",
    )
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", metavar="COMMAND", required=True)
    listing = ckpt_sub.add_parser(
        "ls",
        help="list checkpoints under BACKEND[/PREFIX]",
        description="Names, steps, sizes, dedup ratio (logical / new bytes) and durability.",
    )
    listing.add_argument("prefix", metavar="BACKEND[/PREFIX]")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    socket_option(listing)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``chunkd ckpt ls``; returns the exit status."""
    return ls(args.prefix, socket=args.socket, as_json=args.json)
