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
    serve.add_argument(
        "--enable-faults",
        action="store_true",
        help=(
            "honour CHUNKD_FAULTS: make the named fault points crash or fail on purpose "
            "(for tests; never on a node whose data you need)"
        ),
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the daemon until SIGTERM; returns the exit status."""
    from chunkd.gateway.daemon import serve

    return serve(args.config, enable_faults=args.enable_faults)
