"""``chunkd top``: the node's dashboard in a terminal.

It reads what the page reads (docs/dashboard.md): the snapshot ``GET /v1/dashboard``
once, then one sample a second from ``GET /v1/dashboard/stream``. It only formats:
every rate, ratio and percentile is the daemon's.

The live view is a textual :class:`TopApp`. One worker (:class:`DashboardFeed`) reads
the stream and posts messages (a snapshot, a sample, a restart, the connection's
state); the app keeps the last 300 samples and binds them to its panels, each of which
owns one concern and only draws. Through a daemon restart the feed reconnects with
backoff (1 s doubling to 5 s), sending ``Last-Event-ID``, and the daemon answers with
the samples missed or, when it is another boot, with a ``restarted`` event.

``--once`` prints the latest sample as text (no ANSI codes when stdout is not a
terminal) and ``--json`` as JSON, for scripts and logs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from typing import TYPE_CHECKING, Any, Final, TextIO

from chunkd.gateway.cli.options import http_options
from chunkd.gateway.cli.topfeed import (
    DaemonUnanswered,
    DashboardFeed,
    Endpoint,
    Sample,
    SampleArrived,
    fetch_snapshot,
)
from chunkd.gateway.cli.toppanels import (
    backends_text,
    checkpoints_text,
    clock,
    cost_text,
    errors_text,
    hot_text,
    jobs_text,
    node_text,
    peers_text,
    throughput_text,
    tiers_text,
)

if TYPE_CHECKING:
    from rich.console import RenderableType

__all__ = ["add_parser", "once", "run"]

#: how long ``--once`` waits for a first sample from a daemon that has none yet
ONCE_WAIT_S: Final = 5.0


# -- --once and --json ------------------------------------------------------------------


async def _latest(endpoint: Endpoint) -> tuple[dict[str, Any], Sample | None]:
    async with endpoint.session() as session:
        snapshot = await fetch_snapshot(session, endpoint)
        history = snapshot.get("history") or []
        if history:
            return snapshot["node"], history[-1]
        # a daemon that has just started has no sample yet: wait for its first
        found: list[Sample] = []
        arrived = asyncio.Event()

        def keep(message: object) -> None:
            if isinstance(message, SampleArrived) and not found:
                found.append(message.sample)
                arrived.set()

        feed = DashboardFeed(endpoint, keep, boot=snapshot["node"]["boot"])
        tasks = [asyncio.create_task(feed.follow(session)), asyncio.create_task(arrived.wait())]
        try:
            # the stream's end or failure, a first sample, or the time is up
            await asyncio.wait(tasks, timeout=ONCE_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return snapshot["node"], found[0] if found else None


def once(endpoint: Endpoint, *, as_json: bool, out: TextIO = sys.stdout) -> int:
    """Print the daemon's latest sample (text, or JSON); returns the exit status."""
    try:
        node, sample = asyncio.run(_latest(endpoint))
    except DaemonUnanswered as exc:
        print(f"chunkd top: {exc}", file=sys.stderr)
        return 1
    if as_json:
        json.dump(sample, out, indent=2)
        out.write("\n")
        return 0
    from rich.console import Console, Group
    from rich.rule import Rule

    console = Console(file=out, highlight=False, soft_wrap=False)
    width = console.width
    parts: list[RenderableType] = [node_text(node)]
    if sample is None:
        parts.append("no samples yet (the daemon has just started)")
    else:
        parts.append(f"sample {sample['seq']} at {clock(sample['t'])}")
        for title, body in (
            ("throughput", throughput_text([sample], width, sparklines=False)),
            ("tiers and hits", tiers_text(sample, width, 0)),
            ("backends", backends_text([sample], width, 0, sparklines=False)),
            ("peers", peers_text([sample], width, 0, sparklines=False)),
            ("checkpoints", checkpoints_text(sample, width, 0)),
            ("jobs", jobs_text(sample, width, 0)),
            ("cost", cost_text(sample, width, 0)),
            ("hottest", hot_text(sample, width, 0)),
            ("warnings and errors", errors_text(sample, width, 0)),
        ):
            parts += [Rule(title, align="left", style="dim"), body]
    console.print(Group(*parts))
    return 0


# -- the live view ----------------------------------------------------------------------


def live(endpoint: Endpoint) -> int:
    """Run the live view until ``q`` or Ctrl-C; returns the exit status."""
    from chunkd.gateway.cli.topview import TopApp

    # SIGINT (Ctrl-C before the screen takes the keyboard, or `kill -INT`) quits as q does
    with contextlib.suppress(KeyboardInterrupt):
        TopApp(endpoint).run()
    return 0


# -- the command ------------------------------------------------------------------------


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as handle:
            return handle.read().strip() or None
    return os.environ.get("CHUNKD_TOKEN") or None


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Declare ``chunkd top``."""
    top = sub.add_parser(
        "top",
        help="watch the node live: throughput, hits, backends, peers, saves, jobs, cost",
        description=(
            "A live view of the node's daemon (the dashboard at / in a terminal). q or "
            "Ctrl-C quits. --once prints the latest sample as text, --json as JSON."
        ),
    )
    http_options(top)
    top.add_argument(
        "--token-file",
        metavar="PATH",
        help="a file holding the daemon's server.token, sent as a Bearer header "
        "(default: $CHUNKD_TOKEN; none is needed from loopback)",
    )
    mode = top.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="print the latest sample and exit")
    mode.add_argument("--json", action="store_true", help="print the latest sample as JSON")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``chunkd top``; returns the exit status."""
    from chunkd.gateway.tls import cacert_context

    try:
        token = _token(args)
    except OSError as exc:
        print(f"chunkd top: cannot read --token-file {args.token_file} ({exc})", file=sys.stderr)
        return 2
    try:
        context = cacert_context(args.cacert)
    except OSError as exc:
        print(f"chunkd top: cannot use --cacert {args.cacert} ({exc})", file=sys.stderr)
        return 2
    endpoint = Endpoint(args.url, token, context)
    if args.once or args.json:
        return once(endpoint, as_json=args.json)
    return live(endpoint)
