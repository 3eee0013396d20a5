"""``chunkd inspect``: look inside objects and dataset snapshots from a terminal.

The same views as the ``/inspect/`` page, through the same JSON API
(``GET /v1/inspect/{op}``, ``docs/inspector.md``): this command only asks and
formats. The forms::

    chunkd inspect                          registered datasets
    chunkd inspect BACKEND/[PREFIX/]        a page of a listing
    chunkd inspect BACKEND/KEY              a summary and the first page of rows
    chunkd inspect 'BACKEND/KEY#I'          one sample (the I-th of the object)
    chunkd inspect 'NAME@V#I'               one sample (the I-th of the snapshot)
    chunkd inspect NAME                     a dataset's versions
    chunkd inspect NAME@V                   a snapshot: totals, schema, members
    chunkd inspect --diff A B               what differs between two snapshots
    chunkd inspect --step N --ref NAME@V --seed S --batch-size B --world-size W
                                            the ids step N read, then each sample

Output is bounded: a page of rows (``--start``, ``--count``), long strings folded to a
few lines (``--full`` shows them whole), long lists cut, at most a few samples and
image previews. Images show their type and size, and a half-block preview when Pillow
is installed and the output is a terminal. ``--json`` prints the API's answers.

A rollout's logprobs are one line, as the page's strip: a bar per token (or per few
tokens, their mean), its height the token's probability (e^logprob), orange below
p 0.5, then the tokens, mean, minimum and how many are below p 0.5 (``--full`` lists
every value). Floats show 4 significant digits, as on the page (``--full``: every
digit). A Parquet footer's metadata that its writer keeps for itself (Arrow's
base64 ``ARROW:schema``, pandas' schema, any binary or base64 value) is named with its
size, not printed (``--full`` prints it); the other key-value metadata shows as it is.

This module is the command: its arguments, and which view they ask for. The rooms
beside it: :mod:`~chunkd.gateway.cli.inspect_api` asks the daemon,
:mod:`~chunkd.gateway.cli.inspect_text` prints values and tables (the views'
``Printer``), :mod:`~chunkd.gateway.cli.inspect_images` renders images in the terminal,
:mod:`~chunkd.gateway.cli.inspect_catalog` shows datasets, listings and snapshots, and
:mod:`~chunkd.gateway.cli.inspect_objects` an object's pages, samples and steps.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Final

from chunkd.gateway.cli.inspect_api import InspectApi, Refused, Unreachable
from chunkd.gateway.cli.inspect_objects import ObjectViews
from chunkd.gateway.cli.options import http_options

__all__ = ["add_parser", "run"]

_PROG: Final = "chunkd inspect"
_SAMPLE: Final = re.compile(r"(?P<base>.+)#(?P<index>[0-9]+)")
_SNAPSHOT_ID: Final = re.compile(r"[0-9a-f]{64}")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Declare ``chunkd inspect``."""
    parser = sub.add_parser(
        "inspect",
        help="look inside objects and dataset snapshots: rows, samples, RL data",
        description=(
            "Open objects (Parquet, JSON lines, text, WebDataset tars, MDS shards, images, "
            "audio, video) and dataset snapshots through the daemon's cache, reading only "
            "the ranges a view needs, and show them in the terminal. TARGET is BACKEND/ or "
            "BACKEND/PREFIX/ (a listing), BACKEND/KEY (an object), 'BACKEND/KEY#I' or "
            "'NAME@V#I' (one sample), NAME (a dataset's versions) or NAME@V (a snapshot); "
            "none lists the datasets."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  chunkd inspect local/train/\n"
            "  chunkd inspect local/train/part-0.parquet --start 100 --count 10\n"
            "  chunkd inspect local/rollouts.jsonl --rl\n"
            "  chunkd inspect 'mnist@3#1234'\n"
            "  chunkd inspect --diff mnist@2 mnist@3\n"
            "  chunkd inspect --step 500 --ref mnist@3 --seed 0 --batch-size 32 --world-size 8"
        ),
    )
    parser.add_argument("target", nargs="?", metavar="TARGET")
    http_options(parser)
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        help="a file holding server.token, sent as 'Authorization: Bearer' (default: "
        "$CHUNKD_TOKEN; none from this host)",
    )
    parser.add_argument("--json", action="store_true", help="print the API's JSON answers")
    parser.add_argument(
        "--full",
        action="store_true",
        help="show long strings and lists whole: every logprob, a Parquet footer's "
        "writer metadata (ARROW:schema)",
    )
    parser.add_argument("--no-preview", action="store_true", help="no image previews")
    page = parser.add_argument_group("pages")
    page.add_argument("--start", type=int, default=0, metavar="N", help="first row (default: 0)")
    page.add_argument("--count", type=int, metavar="K", help="rows, rollouts or entries in a page")
    page.add_argument("--after", metavar="TOKEN", help="a listing's page after TOKEN (its next)")
    page.add_argument("--columns", metavar="A,B", help="the columns of rows to show")
    page.add_argument(
        "--format",
        metavar="FORMAT",
        help="read the object as parquet, jsonl, text, wds, mds, image, audio, video or "
        "binary (default: from its key and first bytes)",
    )
    page.add_argument("--rl", action="store_true", help="show rows as RL rollouts or episodes")
    page.add_argument(
        "--map", metavar="FIELD:NAME,...", help="RL field names, e.g. prompt:question,reward:score"
    )
    parser.add_argument("--diff", nargs=2, metavar=("A", "B"), help="compare two snapshots")
    step = parser.add_argument_group("what a training step read (--step)")
    step.add_argument("--step", type=int, metavar="N")
    step.add_argument("--ref", metavar="NAME@V")
    step.add_argument("--seed", type=int)
    step.add_argument("--batch-size", type=int)
    step.add_argument("--world-size", type=int)
    step.add_argument("--epoch", type=int, default=0)
    step.add_argument("--rank", type=int, help="one rank's share only")
    step.add_argument("--window", type=int, metavar="N", help="the loader's window, in units")
    step.add_argument("--window-bytes", type=int, metavar="BYTES", help="its bound in bytes")
    step.add_argument("--no-shuffle", action="store_true", help="the loader did not shuffle")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``chunkd inspect``; returns the exit status."""
    from chunkd.gateway.tls import cacert_context

    try:
        context = cacert_context(args.cacert)
    except OSError as exc:
        print(f"{_PROG}: cannot use --cacert {args.cacert} ({exc})", file=sys.stderr)
        return 2
    token = os.environ.get("CHUNKD_TOKEN") or None
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            print(f"{_PROG}: cannot read --token-file {args.token_file} ({exc})", file=sys.stderr)
            return 2
    api = InspectApi(args.url.rstrip("/"), context=context, token=token)
    view = _View(args, api, sys.stdout)
    try:
        return view.run(parser)
    except Unreachable as exc:
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 1
    except Refused as exc:
        print(f"{_PROG}: {exc.message}", file=sys.stderr)
        if exc.status in (401, 403):
            print(
                f"{_PROG}: give server.token with --token-file PATH or CHUNKD_TOKEN",
                file=sys.stderr,
            )
        elif exc.kind == "DatasetNotFoundError" and args.target and "/" not in args.target:
            print(f"{_PROG}: a backend's listing is {args.target}/", file=sys.stderr)
        return 1


class _View(ObjectViews):
    """One invocation: which view the arguments ask for."""

    def run(self, parser: argparse.ArgumentParser) -> int:
        args = self.args
        if args.count is not None and args.count < 1:
            parser.error("--count must be 1 or more")
        if args.start < 0:
            parser.error("--start must be 0 or more")
        if args.diff:
            return self.diff(*args.diff)
        if args.step is not None:
            missing = [
                f"--{name.replace('_', '-')}"
                for name in ("ref", "seed", "batch_size", "world_size")
                if getattr(args, name) is None
            ]
            if missing:
                parser.error(f"--step wants {', '.join(missing)} too")
            return self.step()
        target: str | None = args.target
        if target is None:
            return self.datasets()
        if sample := _SAMPLE.fullmatch(target):
            return self.sample(target, sample["base"])
        if "@" in target or _SNAPSHOT_ID.fullmatch(target):
            return self.snapshot(target)
        if "/" not in target:
            return self.dataset(target)
        backend, _, rest = target.partition("/")
        if not rest or rest.endswith("/"):
            return self.listing(backend, rest)
        try:
            return self.object(target)
        except Refused as exc:
            if exc.kind != "UnknownBackendError":
                raise
            # Not a backend's object: a dataset name with '/' in it, perhaps.
            try:
                return self.dataset(target)
            except Refused:
                raise exc from None
