"""``chunkd serve``: run the daemon (its lifecycle is :mod:`chunkd.gateway.daemon`)."""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Declare ``chunkd serve``."""
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


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the daemon until SIGTERM; returns the exit status."""
    from chunkd.gateway.daemon import serve

    return serve(args.config)
