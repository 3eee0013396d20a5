"""Options and formatting that several commands share."""

from __future__ import annotations

import argparse

__all__ = ["http_options", "human_size", "socket_option"]


def http_options(parser: argparse.ArgumentParser) -> None:
    """``--url`` and ``--cacert``: for commands that talk to the daemon's HTTP port."""
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


def socket_option(parser: argparse.ArgumentParser) -> None:
    """``--socket``: for commands that talk to the daemon's local socket."""
    parser.add_argument(
        "--socket",
        metavar="PATH",
        help="the daemon's local socket (default: $CHUNKD_SOCKET, /run/chunkd/chunkd.sock, "
        "./chunkd.sock)",
    )


def human_size(size: float) -> str:
    """``size`` bytes for a person: ``512 B``, ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
