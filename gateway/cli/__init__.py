"""The ``chunkd`` command line: one module per command.

Each command module declares its parser (``add_parser``) and runs it (``run``).
Commands import what they need when they run, so ``chunkd --help`` and
``chunkd --version`` work in a bare install.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

import chunkd
from chunkd.gateway.cli import (
    ckpt,
    config,
    cost,
    dataset,
    doctor,
    gc,
    inspect,
    selfcheck,
    serve,
    stats,
    top,
    warm,
)

__all__ = ["build_parser", "main"]

COMMANDS: dict[str, ModuleType] = {
    "serve": serve,
    "warm": warm,
    "selfcheck": selfcheck,
    "doctor": doctor,
    "config": config,
    "stats": stats,
    "ckpt": ckpt,
    "gc": gc,
    "dataset": dataset,
    "inspect": inspect,
    "top": top,
    "cost": cost,
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for ``chunkd``."""
    parser = argparse.ArgumentParser(
        prog="chunkd",
        description=(
            "chunkd: a per-node storage gateway for GPU training clusters. It fronts "
            "object storage with a content-addressed cache in RAM and on local NVMe."
        ),
    )
    parser.add_argument("--version", action="version", version=f"chunkd {chunkd.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``chunkd``; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = COMMANDS.get(args.command or "")
    if command is None:
        parser.print_help(sys.stderr)
        return 2
    status: int = command.run(args, parser)
    return status
