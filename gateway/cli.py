"""The ``chunkd`` command line.

Subcommands import what they need when they run, so ``chunkd --help`` and
``chunkd --version`` work in a bare install.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import chunkd

__all__ = ["main"]


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
    serve = sub.add_parser(
        "serve",
        help="run the daemon",
        description=(
            "Run the chunkd daemon. Without --config it runs on an embedded default: a "
            "file:// backend named 'local' over ./chunkd-data, the cache in ./chunkd-cache "
            "and HTTP on 127.0.0.1:8470. CHUNKD_<SECTION>_<KEY> variables override single keys."
        ),
    )
    serve.add_argument(
        "--config", metavar="PATH", help="TOML config (e.g. /etc/chunkd/chunkd.toml)"
    )
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
    _http_options(warm)
    check = sub.add_parser(
        "selfcheck",
        help="exercise the cache in a directory and print what it did",
        description=(
            "Open (or create) a cache directory, store chunks, read them back from RAM "
            "and from disk, reopen the cache, and check every byte. Exits non-zero on "
            "any failure."
        ),
    )
    check.add_argument(
        "--dir", default="chunkd-cache", help="cache directory (default: %(default)s)"
    )
    check.add_argument(
        "--chunks", type=int, default=16, help="chunks to store (default: %(default)s)"
    )
    stats = sub.add_parser(
        "stats",
        help="show what the daemon holds: tiers, backends, saves, peers",
        description="Print the running daemon's /v1/stats for a person (or --json).",
    )
    _http_options(stats)
    stats.add_argument("--json", action="store_true", help="print the JSON as it is")
    ckpt = sub.add_parser(
        "ckpt",
        help="list checkpoints",
        description="Checkpoints saved through chunkd, as the node's daemon sees them.",
    )
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", metavar="COMMAND", required=True)
    ls = ckpt_sub.add_parser(
        "ls",
        help="list checkpoints under BACKEND[/PREFIX]",
        description="Names, steps, sizes, dedup ratio (logical / new bytes) and durability.",
    )
    ls.add_argument("prefix", metavar="BACKEND[/PREFIX]")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _socket_option(ls)
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
    _socket_option(gc)
    return parser


def _http_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default="http://127.0.0.1:8470",
        help="the daemon's HTTP address, https:// with [peers] TLS (default: %(default)s)",
    )
    parser.add_argument(
        "--cacert",
        metavar="PATH",
        help="PEM CA bundle to check an https:// daemon's certificate against (its "
        "[peers] tls_ca; default: the system's CAs)",
    )


def _socket_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket",
        metavar="PATH",
        help="the daemon's local socket (default: $CHUNKD_SOCKET, /run/chunkd/chunkd.sock, "
        "./chunkd.sock)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``chunkd``; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        from chunkd.gateway.daemon import serve as run_daemon

        return run_daemon(args.config)
    if args.command == "warm":
        from chunkd.gateway.warm import warm as run_warm

        return run_warm(args.names, args.url, cacert=args.cacert, jobs=args.jobs)
    if args.command == "selfcheck":
        from chunkd.gateway.selfcheck import run_selfcheck

        return run_selfcheck(args.dir, args.chunks)
    if args.command == "stats":
        from chunkd.gateway.statscmd import stats as show_stats

        return show_stats(args.url, as_json=args.json, cacert=args.cacert)
    if args.command == "ckpt":
        from chunkd.gateway.ckptcmd import ls

        return ls(args.prefix, socket=args.socket, as_json=args.json)
    if args.command == "gc":
        from chunkd.errors import ConfigError
        from chunkd.gateway.ckptcmd import gc
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
    parser.print_help(sys.stderr)
    return 2
