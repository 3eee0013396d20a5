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
"""

from __future__ import annotations

import argparse
import base64
import decimal
import io
import json
import math
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TextIO

from chunkd.gateway.cli.options import http_options, human_size

if TYPE_CHECKING:
    import ssl

    from rich.console import Console, RenderableType
    from rich.text import Text

__all__ = ["add_parser", "run"]

_PROG: Final = "chunkd inspect"
#: a string longer than this (or of more lines) is folded unless --full
FOLD_CHARS: Final = 240
FOLD_LINES: Final = 3
#: list items shown before the rest are counted
FOLD_ITEMS: Final = 16
#: a float in a table shows this many significant digits (inspect.js's SIG_DIGITS)
SIG_DIGITS: Final = 4
_FOUR_DIGITS: Final = decimal.Decimal("1.000")
#: columns of a rows table; --columns picks others
MAX_COLUMNS: Final = 10
#: samples shown for --step; the other ids are listed
STEP_SAMPLES: Final = 4
#: ids of a step listed per rank
STEP_IDS: Final = 256
#: images previewed in one view, and the largest one fetched for it
PREVIEWS: Final = 4
PREVIEW_BYTES: Final = 16 << 20
#: the largest answer read from the daemon (its pages are at most 64 MiB)
MAX_ANSWER: Final = 80 << 20
#: bars of a rollout's logprob strip; a longer rollout gives each bar several tokens
STRIP_BARS: Final = 16
#: a token below this probability is drawn orange and counted in the strip's summary
LOW_P: Final = 0.5
_BARS: Final = "▁▂▃▄▅▆▇█"
#: Parquet footer metadata a writer keeps for itself: not printed unless --full
WRITER_METADATA: Final = frozenset({"ARROW:schema", "pandas"})
#: the inspector sends a footer metadata value's first 4 KiB (client/inspect/objects.py)
_METADATA_SENT: Final = 4096
#: a value this long of base64's alphabet alone is taken for binary, not text
_BASE64_CHARS: Final = 64
_BASE64: Final = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_SAMPLE: Final = re.compile(r"(?P<base>.+)#(?P<index>[0-9]+)")
_SNAPSHOT_ID: Final = re.compile(r"[0-9a-f]{64}")
# C0 controls but tab and newline, DEL and C1: a sample must not drive the terminal.
_CONTROLS: Final = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)]}
del _CONTROLS[0x09], _CONTROLS[0x0A]


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
    api = _Api(args.url.rstrip("/"), context=context, token=token)
    view = _View(args, api, sys.stdout)
    try:
        return view.run(parser)
    except _Unreachable as exc:
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 1
    except _Refused as exc:
        print(f"{_PROG}: {exc.message}", file=sys.stderr)
        if exc.status in (401, 403):
            print(
                f"{_PROG}: give server.token with --token-file PATH or CHUNKD_TOKEN",
                file=sys.stderr,
            )
        elif exc.kind == "DatasetNotFoundError" and args.target and "/" not in args.target:
            print(f"{_PROG}: a backend's listing is {args.target}/", file=sys.stderr)
        return 1


# -- the daemon's API --------------------------------------------------------------------


class _Unreachable(Exception):
    """No usable answer from the daemon."""


class _Refused(Exception):
    """The daemon answered with an error."""

    def __init__(self, kind: str, message: str, status: int) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.status = status


@dataclass
class _Api:
    """``GET`` requests to the daemon's HTTP port."""

    url: str
    context: ssl.SSLContext | None = None
    token: str | None = None

    def op(self, op: str, **args: object) -> Any:
        """The result of inspector op ``op``; None-valued args are left out."""
        query = {k: _arg(v) for k, v in args.items() if v is not None}
        return json.loads(self.get(f"/v1/inspect/{op}", query))

    def listing(self, backend: str, prefix: str, **query: object) -> Any:
        """A page of ``/v1/list``."""
        path = f"/v1/list/{_quote(backend)}/{_quote(prefix)}"
        return json.loads(self.get(path, {k: _arg(v) for k, v in query.items() if v is not None}))

    def media(self, name: str, offset: int, length: int) -> bytes:
        """Bytes of an object's window, through the media route."""
        backend, _, key = name.partition("/")
        path = f"/v1/inspect/media/{_quote(backend)}/{_quote(key)}"
        return self.get(path, {"offset": str(offset), "length": str(length)})

    def get(self, path: str, query: dict[str, str]) -> bytes:
        url = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(url, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=120, context=self.context) as response:
                body: bytes = response.read(MAX_ANSWER + 1)
        except urllib.error.HTTPError as exc:
            raise _refusal(exc) from None
        except (urllib.error.URLError, OSError) as exc:
            from chunkd.gateway.tls import unreachable

            raise _Unreachable(unreachable(self.url, exc)) from None
        if len(body) > MAX_ANSWER:
            raise _Unreachable(f"{path}: the answer is over {MAX_ANSWER >> 20} MiB; ask for less")
        return body


def _refusal(exc: urllib.error.HTTPError) -> _Refused:
    try:
        body = json.loads(exc.read(1 << 20))
        return _Refused(str(body["error"]), str(body["message"]), exc.code)
    except (ValueError, KeyError, TypeError, OSError):
        return _Refused("HTTPError", f"the daemon answered {exc.code} {exc.reason}", exc.code)


def _arg(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _quote(text: str) -> str:
    return urllib.parse.quote(text, safe="/")


# -- the views ---------------------------------------------------------------------------


@dataclass
class _View:
    """One invocation: asks the API, prints what it answers."""

    args: argparse.Namespace
    api: _Api
    out: TextIO
    console: Console = field(init=False)
    previews: int = 0

    def __post_init__(self) -> None:
        from rich.console import Console

        self.console = Console(file=self.out, highlight=False, soft_wrap=False)

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
        except _Refused as exc:
            if exc.kind != "UnknownBackendError":
                raise
            # Not a backend's object: a dataset name with '/' in it, perhaps.
            try:
                return self.dataset(target)
            except _Refused:
                raise exc from None

    # each view returns the exit status

    def datasets(self) -> int:
        answer = self.api.op("datasets", limit=self.args.count)
        if self.emit(answer):
            return 0
        from rich.table import Table

        table = Table(
            "dataset", "latest", "created", "tags", title="datasets", title_justify="left"
        )
        for entry in answer.get("datasets", []):
            table.add_row(
                _text(entry.get("name")),
                _text(entry.get("latest")),
                _text(_when(entry.get("created"))),
                _text(", ".join(map(str, entry.get("tags") or []))),
            )
        self.console.print(table)
        if not answer.get("datasets"):
            self.say("no datasets are registered (chunkd dataset register NAME BACKEND/PREFIX)")
        self.more(answer.get("next"), "more datasets follow")
        return 0

    def listing(self, backend: str, prefix: str) -> int:
        count = self.args.count or 100
        answer = self.api.listing(backend, prefix, limit=count, start_after=self.args.after)
        if self.emit(answer):
            return 0
        from rich.table import Table

        title = f"{backend}/{answer.get('prefix') or ''}"
        table = Table("name", "size", "modified", title=_text(title), title_justify="left")
        table.columns[1].justify = "right"
        for entry in answer.get("entries", []):
            if entry.get("type") == "directory":
                table.add_row(_text(entry["name"] + "/", "bold"), "", "")
            else:
                table.add_row(
                    _text(entry["name"]),
                    human_size(entry.get("size") or 0),
                    _text(_when(entry.get("modified"))),
                )
        self.console.print(table)
        if not answer.get("entries"):
            self.say("nothing is listed here")
        if answer.get("next"):
            self.say(f"more entries follow: --after {_shell(answer['next'])}")
        return 0

    def object(self, name: str) -> int:
        args = self.args
        opened = self.api.op("open", name=name, format=args.format)
        if opened.get("kind") == "snapshot" and args.format is None:
            # a dataset named like an object (text/web, or local/pets where backend
            # local has no such key): the worker said so; show it as a dataset
            return self.dataset(name)
        fmt = args.format or opened.get("kind")
        page: Any = None
        page_op = ""
        if args.rl or args.map:
            page_op = "rl"
            page = self.api.op("rl", name=name, start=args.start, count=args.count, map=args.map)
        elif fmt in ("parquet", "jsonl", "text", "wds", "mds"):
            page_op = "rows"
            page = self.api.op(
                "rows",
                name=name,
                start=args.start,
                count=args.count,
                format=args.format,
                columns=args.columns,
            )
        if self.emit({"open": opened, page_op: page} if page_op else opened):
            return 0
        self.summary(opened)
        if page_op == "rows":
            self.rows(page)
            if opened.get("rl"):
                self.say(f"this looks like RL {opened['rl']}: --rl shows them grouped")
        elif page_op == "rl":
            self.rl(page)
        return 0

    def summary(self, opened: dict[str, Any]) -> None:
        from rich.table import Table

        kind = opened.get("kind")
        head = Table.grid(padding=(0, 2))
        head.add_column(style="bold")
        head.add_column()
        facts: list[tuple[str, Any]] = [
            ("object", opened.get("name")),
            ("kind", kind),
            ("size", f"{human_size(opened.get('size') or 0)} ({opened.get('size')} bytes)"),
            ("version", opened.get("version")),
        ]
        if opened.get("media_type"):
            facts.append(("media type", opened["media_type"]))
        if opened.get("rl"):
            facts.append(("RL data", opened["rl"]))
        if kind == "audio":
            facts.append(("audio", _audio(opened.get("audio")) or "its header could not be read"))
        for key, label in (
            ("num_rows", "rows"),
            ("lines", "lines"),
            ("encoding", "encoding"),
            ("samples_total", "samples"),
            ("shards", "shards"),
        ):
            if opened.get(key) is not None:
                value = opened[key]
                facts.append((label, len(value) if isinstance(value, list) else value))
        for label, value in facts:
            head.add_row(label, self.cell(value))
        self.console.print(head)
        if kind == "parquet":
            self.parquet(opened)
        elif kind == "wds":
            self.wds_samples(opened.get("samples") or [])
        elif kind == "mds":
            self.small_table("columns", ["name", "encoding"], opened.get("columns") or [])
        elif kind == "binary":
            self.binary(opened)
        elif kind in ("image", "audio", "video"):
            self.images(opened)

    def parquet(self, opened: dict[str, Any]) -> None:
        self.small_table("schema", ["name", "type"], opened.get("schema") or [])
        groups = opened.get("row_groups") or []
        total = opened.get("row_groups_total", len(groups))
        shown = groups if self.args.full else groups[:FOLD_ITEMS]
        rows = [
            {
                "index": g.get("index"),
                "rows": g.get("rows"),
                "first_row": g.get("first_row"),
                "bytes": human_size(g.get("bytes") or 0),
            }
            for g in shown
        ]
        self.small_table(f"row groups ({total})", ["index", "rows", "first_row", "bytes"], rows)
        if total > len(shown):
            self.say(f"{total - len(shown)} more row groups (--full or --json lists them)")
        metadata = opened.get("metadata") or {}
        items = list(metadata.items())[:FOLD_ITEMS] if not self.args.full else metadata.items()
        shown = [{"key": k, "value": v} for k, v in items if self.args.full or not _kept(k, v)]
        if shown:
            self.small_table("metadata", ["key", "value"], shown)
        hidden = [(k, v) for k, v in items if not self.args.full and _kept(k, v)]
        for key, value in hidden:
            self.say(f"{_clean(str(key))} ({_metadata_size(value)}, hidden; --full shows it)")
        if len(metadata) > FOLD_ITEMS and not self.args.full:
            self.say(f"{len(metadata) - FOLD_ITEMS} more metadata keys (--full or --json)")

    def wds_samples(self, samples: list[dict[str, Any]]) -> None:
        from rich.table import Table

        table = Table("#", "key", "members", title="samples", title_justify="left")
        for sample in samples[: self.args.count or 20]:
            members = ", ".join(
                f"{m.get('ext')} ({human_size(m.get('length') or 0)}"
                + (f", {m['media_type']})" if m.get("media_type") else ")")
                for m in sample.get("members") or []
            )
            table.add_row(_text(sample.get("index")), _text(sample.get("key")), _text(members))
        self.console.print(table)

    def binary(self, opened: dict[str, Any]) -> None:
        for key in ("hex", "text"):
            value = opened.get(key)
            if isinstance(value, str):
                lines = value.splitlines() or [value]
                cut = lines if self.args.full else lines[:16]
                self.console.print(_text(key, "bold"))
                self.console.print(_text("\n".join(cut)))
                if len(cut) < len(lines):
                    self.say(f"{len(lines) - len(cut)} more lines (--full)")

    def rows(self, page: dict[str, Any]) -> None:
        from rich.table import Table

        rows = page.get("rows") or []
        names: list[str] = []
        if rows and all(isinstance(r.get("value"), dict) for r in rows):
            for row in rows:
                names += [k for k in row["value"] if k not in names]
        hidden = names[MAX_COLUMNS:]
        names = names[:MAX_COLUMNS]
        start, total = page.get("start", 0), page.get("total")
        end = start + len(rows)
        title = f"rows {start} to {end - 1}" + (f" of {total}" if total is not None else "")
        table = Table("#", *(names or ["value"]), title=title, title_justify="left")
        for row in rows:
            value = row.get("value")
            cells = [self.cell(value.get(n)) for n in names] if names else [self.cell(value)]
            table.add_row(_text(row.get("index")), *cells)
        self.console.print(table)
        if hidden:
            self.say(f"{len(hidden)} more columns: {', '.join(hidden)} (--columns picks)")
        self.more(page.get("next"), "next page: --start {}")
        if any(True for _ in _images(rows)):
            # A table stays a table: previews come with one sample.
            first = f"{page.get('name')}#{rows[0].get('index')}"
            self.say(f"images show with one sample: chunkd inspect {_shell(first)}")

    def rl(self, page: dict[str, Any]) -> None:
        kind = page.get("kind")
        if kind == "rollouts":
            self.rollouts(page.get("groups") or [])
        elif kind == "episodes":
            self.episodes(page.get("episodes") or [])
        else:
            self.say(
                "no RL data: the fields match neither rollouts nor episodes (--map names them)"
            )
        self.more(page.get("next"), "next page: --start {}")

    def rollouts(self, groups: list[dict[str, Any]]) -> None:
        from rich.table import Table

        for group in groups:
            label = "group" + (f" {group['group']}" if group.get("group") is not None else "")
            self.console.print(_text(label, "bold"), self.cell(group.get("prompt")))
            rollouts = group.get("rollouts") or []
            # Optional fields no rollout of the group has are left out.
            names = ["reward", "advantage", "completion", "logprobs", "fields"]
            names = [n for n in names if any(r.get(n) not in (None, {}) for r in rollouts)]
            table = Table("#", *names)
            if "logprobs" in names and not self.args.full:
                # the strip on a line of its own; its summary wraps below it
                table.columns[names.index("logprobs") + 1].min_width = STRIP_BARS + 2
            for rollout in rollouts:
                cells = (self.rollout_cell(n, rollout.get(n)) for n in names)
                table.add_row(_text(rollout.get("index")), *cells)
            self.console.print(table)
        if not groups:
            self.say("no rollouts in this page")
        elif not self.args.full and any(
            _strip(r.get("logprobs")) is not None for g in groups for r in g.get("rollouts") or []
        ):
            self.say(
                "logprobs: a bar per token, or per few tokens (their mean); its height is "
                f"the probability (e^logprob), orange below p {LOW_P}; --full lists them all"
            )

    def rollout_cell(self, name: str, value: Any) -> Text:
        """A rollout's field; its logprobs as a strip and a summary, unless --full."""
        if name == "logprobs" and not self.args.full:
            strip = _strip(value)
            if strip is not None:
                return strip
        return self.cell(value)

    def episodes(self, episodes: list[dict[str, Any]]) -> None:
        from rich.table import Table

        for episode in episodes:
            self.console.print(
                _text(f"episode {episode.get('episode')}", "bold"),
                _text(f"return {episode.get('return')}, {episode.get('length')} steps"),
            )
            steps = episode.get("steps") or []
            timeline = "".join(_step_mark(s) for s in steps[:200])
            self.console.print(_text(f"timeline {timeline}"))
            table = Table("#", "step", "observation", "action", "reward", "done")
            shown = steps if self.args.full else steps[: FOLD_ITEMS * 2]
            for step in shown:
                table.add_row(
                    _text(step.get("index")),
                    _text(step.get("step")),
                    self.cell(step.get("observation")),
                    self.cell(step.get("action")),
                    self.cell(step.get("reward")),
                    self.cell(step.get("done")),
                )
            self.console.print(table)
            if len(shown) < len(steps):
                self.say(f"{len(steps) - len(shown)} more steps (--full)")
            self.show_previews(shown)
        if not episodes:
            self.say("no episodes in this page")

    def sample(self, sample_id: str, base: str) -> int:
        answer = self.api.op("sample", id=sample_id)
        if self.emit(answer):
            return 0
        self.print_sample(answer)
        return 0

    def print_sample(self, answer: dict[str, Any]) -> None:
        from rich.json import JSON
        from rich.table import Table

        head = Table.grid(padding=(0, 2))
        head.add_column(style="bold")
        head.add_column()
        for key in ("id", "name", "index", "kind", "dataset", "member"):
            value = answer.get(key)
            if isinstance(value, dict) and "ref" in value:  # the snapshot's sample
                value = f"{value['ref']}#{value.get('index')} (snapshot {value.get('snapshot')})"
            if value is not None:
                head.add_row(key, self.cell(value))
        self.console.print(head)
        folded = self.fold(answer.get("value"))
        self.console.print(JSON.from_data(folded, ensure_ascii=False))
        self.show_previews(answer.get("value"))

    def dataset(self, name: str) -> int:
        answer = self.api.op("dataset", name=name)
        if self.emit(answer):
            return 0
        from rich.table import Table

        table = Table(
            "version", "snapshot", "created", "samples", "bytes", "tags",
            title=_text(f"dataset {answer.get('name')}"), title_justify="left",
        )  # fmt: skip
        for version in answer.get("versions") or []:
            table.add_row(
                _text(version.get("version")),
                _text(str(version.get("snapshot") or "")[:16]),
                _text(_when(version.get("created"))),
                _text(version.get("samples")),
                human_size(version.get("bytes") or 0),
                _text(", ".join(map(str, version.get("tags") or []))),
            )
        self.console.print(table)
        self.say(f"a snapshot: chunkd inspect {_shell(str(answer.get('name')))}@VERSION")
        return 0

    def snapshot(self, ref: str) -> int:
        answer = self.api.op("snapshot", ref=ref, start=self.args.start, count=self.args.count)
        if self.emit(answer):
            return 0
        from rich.table import Table

        head = Table.grid(padding=(0, 2))
        head.add_column(style="bold")
        head.add_column()
        for key in ("ref", "snapshot", "name", "version", "backend", "prefix", "format"):
            head.add_row(key, self.cell(answer.get(key)))
        head.add_row("samples", self.cell(answer.get("samples")))
        head.add_row("bytes", _text(human_size(answer.get("bytes") or 0)))
        head.add_row("members", self.cell(answer.get("members_total")))
        head.add_row("frozen", self.cell(answer.get("frozen")))
        excluded = answer.get("excluded") or []
        if excluded:
            head.add_row("excluded", self.cell(excluded))
        self.console.print(head)
        schema = answer.get("schema")
        if isinstance(schema, list) and schema and all(_is_pair(s) for s in schema):
            pairs = [{"name": s[0], "type": s[1]} for s in schema[: FOLD_ITEMS * 4]]
            self.small_table("schema", ["name", "type"], pairs)
        elif isinstance(schema, list) and schema and all(isinstance(s, dict) for s in schema):
            self.small_table("schema", ["name", "type"], schema)
        elif schema:
            self.console.print(_text("schema", "bold"), self.cell(schema))
        members = answer.get("members") or []
        table = Table("key", "size", "samples", "first", title="members", title_justify="left")
        for member in members:
            table.add_row(
                _text(member.get("key")),
                human_size(member.get("size") or 0),
                _text(member.get("samples")),
                _text(member.get("first")),
            )
        self.console.print(table)
        shown_end = self.args.start + len(members)
        total = answer.get("members_total") or 0
        if shown_end < total:
            self.say(f"{total - shown_end} more members: --start {shown_end}")
        return 0

    def diff(self, a: str, b: str) -> int:
        answer = self.api.op("diff", a=a, b=b)
        if self.emit(answer):
            return 0
        added, removed = answer.get("added") or [], answer.get("removed") or []
        changed = answer.get("changed") or []
        more = answer.get("more") or {}
        self.console.print(
            _text(f"{answer.get('a')} -> {answer.get('b')}: ", "bold"),
            _text(
                f"{answer.get('same', 0)} same, "
                f"{len(added) + more.get('added', 0)} added, "
                f"{len(removed) + more.get('removed', 0)} removed, "
                f"{len(changed) + more.get('changed', 0)} changed"
            ),
        )
        for mark, members in (("+", added), ("-", removed), ("~", changed)):
            shown = members if self.args.full else members[: FOLD_ITEMS * 4]
            for member in shown:
                self.console.print(_text(f"{mark} "), self.cell(_member_line(member)))
            if len(shown) < len(members):
                self.say(f"{len(members) - len(shown)} more '{mark}' (--full)")
        return 0

    def step(self) -> int:
        args = self.args
        answer = self.api.op(
            "step",
            ref=args.ref,
            step=args.step,
            batch_size=args.batch_size,
            world_size=args.world_size,
            seed=args.seed,
            epoch=args.epoch,
            rank=args.rank,
            window=args.window,
            window_bytes=args.window_bytes,
            shuffle=False if args.no_shuffle else None,
        )
        ranks: dict[str, Any] = answer.get("ranks") or {}
        ids = [i for share in ranks.values() for i in share.get("ids") or []]
        backend = answer.get("backend")
        if backend is None and ids:
            backend = self.api.op("snapshot", ref=answer.get("snapshot") or args.ref, count=1)[
                "backend"
            ]
        limit = args.count or STEP_SAMPLES
        samples = [self.api.op("sample", id=f"{backend}/{i}") for i in ids[:limit]]
        if self.emit({"step": answer, "samples": samples}):
            return 0
        self.console.print(
            _text(f"step {answer.get('step')} of {answer.get('ref')}", "bold"),
            _text(f"(snapshot {str(answer.get('snapshot'))[:16]})"),
        )
        for rank, share in sorted(ranks.items(), key=lambda item: int(item[0])):
            rank_ids = share.get("ids") or []
            padding = share.get("padding") or 0
            self.console.print(
                _text(f"rank {rank}: ", "bold"),
                _text(f"{len(rank_ids)} ids" + (f", {padding} padding" if padding else "")),
            )
            listed = rank_ids if args.full else rank_ids[:STEP_IDS]
            self.console.print(_text("  " + "  ".join(map(str, listed))))
            if len(listed) < len(rank_ids):
                self.say(f"{len(rank_ids) - len(listed)} more ids (--full or --json)")
        for sample in samples:
            self.console.rule()
            self.print_sample(sample)
        if len(ids) > len(samples):
            self.say(f"{len(ids) - len(samples)} more samples (--count K shows more)")
        return 0

    # -- formatting ------------------------------------------------------------------------

    def emit(self, answer: Any) -> bool:
        """Print ``answer`` as JSON if --json asked for it; whether it did."""
        if not self.args.json:
            return False
        text = json.dumps(answer, indent=2, ensure_ascii=False)
        # C1 controls can only sit inside JSON strings, where \\u escapes are valid.
        self.out.write(text.translate({c: f"\\u{c:04x}" for c in range(0x80, 0xA0)}) + "\n")
        return True

    def say(self, line: str) -> None:
        """A note for the reader: dim, after the view."""
        self.console.print(_text(line, "dim"))

    def more(self, token: Any, template: str) -> None:
        if token is not None:
            self.say(template.format(token))

    def small_table(self, title: str, names: list[str], rows: list[dict[str, Any]]) -> None:
        from rich.table import Table

        table = Table(*names, title=_text(title), title_justify="left")
        for row in rows:
            table.add_row(*(self.cell(row.get(n)) for n in names))
        self.console.print(table)

    def cell(self, value: Any) -> Text:
        """One value, on a few lines at most unless --full."""
        from rich.text import Text

        if value is None:
            return Text("null", style="dim")
        if isinstance(value, bool):
            return Text(str(value).lower())
        if isinstance(value, float) and not self.args.full:
            return Text(_float(value))
        if isinstance(value, int | float):
            return Text(str(value))
        if isinstance(value, str):
            return self.whole(value)
        special = _special(value)
        if special is not None:
            return Text(special, style="cyan")
        return self.whole(json.dumps(self.fold(value), ensure_ascii=False))

    def whole(self, text: str) -> Text:
        """``text`` folded to a few lines; with --full all of it, a word longer than its
        column (base64, a URL) broken across lines rather than cut."""
        if not self.args.full:
            return _text(_fold_text(text))
        out = _text(text)
        out.overflow = "fold"
        return out

    def fold(self, value: Any, depth: int = 0) -> Any:
        """``value`` with long strings folded, long lists cut and binary described."""
        if isinstance(value, str):
            return _clean(value if self.args.full else _fold_text(value))
        if isinstance(value, list):
            shown = value if self.args.full else value[:FOLD_ITEMS]
            folded = [self.fold(v, depth + 1) for v in shown]
            if len(shown) < len(value):
                folded.append(f"... {len(value) - len(shown)} more items (--full)")
            return folded
        if isinstance(value, dict):
            special = _special(value)
            if special is not None:
                return special
            return {_clean(str(k)): self.fold(v, depth + 1) for k, v in value.items()}
        return value

    def show_previews(self, value: Any) -> None:
        """Each image in ``value``: its type and size, and a preview on a terminal."""
        if self.args.no_preview or self.args.json or not self.console.is_terminal:
            return
        for image in _images(value):
            if self.previews >= PREVIEWS:
                return
            data = self.image_bytes(image)
            if data is None:
                continue
            preview = _half_blocks(data, min(self.console.width - 2, 64))
            if preview is not None:
                self.previews += 1
                self.console.print(preview)

    def images(self, opened: dict[str, Any]) -> None:
        media = opened.get("$media") or opened.get("media")
        if isinstance(media, dict):
            media = media.get("$media", media)
            self.console.print(_text(_special({"$media": media}) or ""))
            self.show_previews({"$media": media})

    def image_bytes(self, value: dict[str, Any]) -> bytes | None:
        if "$bytes" in value and isinstance(value.get("b64"), str):
            return base64.b64decode(value["b64"])
        media = value.get("$media")
        if isinstance(media, dict) and 0 < (media.get("length") or 0) <= PREVIEW_BYTES:
            try:
                return self.api.media(str(media["name"]), int(media["offset"]), media["length"])
            except _Refused:
                return None
        return None


def _special(value: Any) -> str | None:
    """A ``$``-value of the API in a few words; None for an ordinary object."""
    if not isinstance(value, dict):
        return None
    if "$bytes" in value:
        kind = value.get("media_type") or "binary"
        sound = _audio(value.get("audio"))
        return f"<{kind}, {human_size(value['$bytes'] or 0)}" + (f", {sound}>" if sound else ">")
    if isinstance(value.get("$media"), dict):
        media = value["$media"]
        kind = media.get("media_type") or "media"
        sound = _audio(media.get("audio"))
        return (
            f"<{kind}, {human_size(media.get('length') or 0)}"
            + (f", {sound}" if sound else "")
            + f" at {_clean(str(media.get('name')))}+{media.get('offset')}>"
        )
    for key in ("$float", "$datetime", "$decimal"):
        if key in value:
            return _clean(str(value[key]))
    return None


def _images(value: Any, depth: int = 0) -> Iterator[dict[str, Any]]:
    """The image values inside ``value``, depth first (bounded depth)."""
    if depth > 16:
        return
    if isinstance(value, dict):
        media = value.get("$media")
        described = media if isinstance(media, dict) else value if "$bytes" in value else None
        if described is not None and str(described.get("media_type") or "").startswith("image/"):
            yield value
        else:
            for item in value.values():
                yield from _images(item, depth + 1)
    elif isinstance(value, list):
        for item in value[: FOLD_ITEMS * 4]:
            yield from _images(item, depth + 1)


def _half_blocks(data: bytes, width: int) -> RenderableType | None:
    """An image as rows of '▀', each cell two pixels (its colour over its background)."""
    try:
        from PIL import Image
    except ImportError:
        return None
    from rich.color import Color
    from rich.style import Style
    from rich.text import Text

    Image.MAX_IMAGE_PIXELS = 64 << 20  # a bigger one is refused, not decoded
    try:
        with Image.open(io.BytesIO(data)) as image:
            size = image.size
            image.draft("RGB", (width, width))
            rgb = image.convert("RGB")
        rgb.thumbnail((max(8, width), 48))
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError):
        return None
    pixels = rgb.load()
    if pixels is None:
        return None
    w, h = rgb.size
    text = Text(f"{size[0]}x{size[1]} pixels\n", style="dim")
    for y in range(0, h, 2):
        for x in range(w):
            top = pixels[x, y]
            below = pixels[x, y + 1] if y + 1 < h else None
            text.append(
                "▀",
                Style(
                    color=Color.from_rgb(*top[:3]),  # type: ignore[index]
                    bgcolor=Color.from_rgb(*below[:3]) if below else None,  # type: ignore[index]
                ),
            )
        text.append("\n")
    return text


def _audio(info: Any) -> str:
    """What an audio header says, as the page says it: ``2.50 s, 16 kHz, mono, PCM
    16-bit``; empty when the header could not be read."""
    if not isinstance(info, dict):
        return ""
    parts = []
    duration = info.get("duration")
    if isinstance(duration, int | float) and not isinstance(duration, bool):
        minutes, seconds = divmod(float(duration), 60)
        parts.append(f"{int(minutes)}:{seconds:05.2f}" if minutes else f"{seconds:.2f} s")
    rate = info.get("sample_rate")
    if isinstance(rate, int | float) and not isinstance(rate, bool) and rate > 0:
        parts.append(f"{rate / 1000:g} kHz")
    channels = info.get("channels")
    if isinstance(channels, int) and not isinstance(channels, bool) and channels > 0:
        parts.append({1: "mono", 2: "stereo"}.get(channels, f"{channels} channels"))
    codec = " ".join(
        str(x)
        for x in (info.get("codec"), f"{info['bits']}-bit" if info.get("bits") else None)
        if x
    )
    if codec:
        parts.append(_clean(codec))
    return ", ".join(parts)


def _kept(key: str, value: Any) -> bool:
    """Whether a Parquet footer's metadata is its writer's own (Arrow's schema, pandas'),
    or binary or base64 no one reads as text: named with its size, not printed."""
    if key in WRITER_METADATA:
        return True
    text = str(value)
    return "\ufffd" in text or (len(text) >= _BASE64_CHARS and _BASE64.fullmatch(text) is not None)


def _metadata_size(value: Any) -> str:
    size = len(str(value).encode("utf-8", "replace"))
    # the inspector sends the first 4 KiB of a value: one that long may be longer
    return f"{size}+ bytes" if size >= _METADATA_SENT else f"{size} bytes"


def _logprob(value: Any) -> float | None:
    """A logprob of the API's values: a number, or ``{"$float": "-inf"}``; None else."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value) if not math.isnan(value) else None
    if isinstance(value, dict) and value.get("$float") == "-inf":
        return -math.inf
    return None


def _strip(value: Any) -> Text | None:
    """Logprobs as one line: a bar per token or per few tokens (their mean), its height
    the probability, orange below :data:`LOW_P`; then tokens, mean, minimum and how many
    are below. None for what is not a list of logprobs."""
    from rich.text import Text

    if not isinstance(value, list):
        return None
    numbers = []
    for item in value:
        logprob = _logprob(item)
        if logprob is not None:
            numbers.append(logprob)
        elif not (isinstance(item, dict) and item.get("$float") == "nan"):
            return None  # not logprobs (top-k entries, text...): shown as a value is
    if not numbers:
        return None
    per = -(-len(numbers) // STRIP_BARS)
    out = Text()
    for start in range(0, len(numbers), per):
        bucket = numbers[start : start + per]
        p = min(max(sum(math.exp(v) for v in bucket) / len(bucket), 0.0), 1.0)
        bar = _BARS[round(p * (len(_BARS) - 1))]
        out.append(bar, style="dark_orange" if p < LOW_P else "cyan")
    low = sum(math.exp(v) < LOW_P for v in numbers)
    mean = sum(numbers) / len(numbers)
    out.append(
        f" {len(numbers)} tokens, mean {_short(mean)}, min {_short(min(numbers))}, "
        f"{low} below p {LOW_P}"
    )
    return out


def _float(value: float) -> str:
    """A float as the page shows it (``fmtFloat`` in inspect.js, the same strings): 4
    significant digits (``0.1429``), whole digits never rounded away (``12345.7``),
    below 0.001 or from 10^15 in exponent form with its trailing zeros dropped
    (``2.914e-4``, ``1e-5``), a whole number whole (``3``), as JavaScript writes them;
    --full prints every digit."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    if value.is_integer():
        # JavaScript's String(n): every digit below 10^21, exponent form from there
        return str(int(value)) if abs(value) < 1e21 else repr(value).replace("e+0", "e+")
    size = abs(value)
    sign = "-" if value < 0 else ""
    if size < 1e-3 or size >= 1e15:
        # toExponential(3): the exact value rounded half up, then `\.?0+e` dropped
        exact = decimal.Decimal(size)
        exponent = exact.adjusted()
        digits = exact.scaleb(-exponent).quantize(_FOUR_DIGITS, decimal.ROUND_HALF_UP)
        if digits >= 10:  # 9.9996e-4 rounds to 10.000e-4: 1.000e-3
            exponent += 1
            digits = exact.scaleb(-exponent).quantize(_FOUR_DIGITS, decimal.ROUND_HALF_UP)
        mantissa = re.sub(r"\.?0+$", "", f"{digits:f}")
        return f"{sign}{mantissa}e{'+' if exponent >= 0 else '-'}{abs(exponent)}"
    # toFixed(max(1, 4 - whole digits)): the exact value rounded half up
    whole = math.floor(math.log10(size)) + 1
    places = max(1, SIG_DIGITS - whole)
    fixed = decimal.Decimal(size).quantize(
        decimal.Decimal(1).scaleb(-places), decimal.ROUND_HALF_UP
    )
    text = f"{fixed:f}".rstrip("0")
    return f"{sign}{text}0" if text.endswith(".") else f"{sign}{text}"


def _short(value: float) -> str:
    """A logprob in 3 significant digits (``-0.418``, ``-12.3``, ``-inf``)."""
    return f"{value:.3g}"


def _when(value: Any) -> str:
    """A time the API sends as seconds since the epoch, in UTC for a person."""
    import datetime as dt

    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            when = dt.datetime.fromtimestamp(value, dt.UTC)
        except (OverflowError, OSError, ValueError):
            return str(value)
        return when.strftime("%Y-%m-%d %H:%M:%S")
    return "" if value is None else str(value)


def _step_mark(step: dict[str, Any]) -> str:
    if step.get("done"):
        return "|"
    reward = step.get("reward")
    if isinstance(reward, int | float) and not isinstance(reward, bool):
        return "+" if reward > 0 else "-" if reward < 0 else "."
    return "."


def _is_pair(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2


def _member_line(member: Any) -> Any:
    if isinstance(member, dict):
        parts = [str(member.get("key"))]
        for key in ("size", "samples"):
            if member.get(key) is not None:
                parts.append(f"{key} {member[key]}")
        return ", ".join(parts)
    return member


def _fold_text(text: str) -> str:
    """``text`` cut to :data:`FOLD_LINES` lines and :data:`FOLD_CHARS` characters."""
    lines = text.split("\n")
    cut = "\n".join(lines[:FOLD_LINES])[:FOLD_CHARS]
    if len(cut) == len(text):
        return text
    return f"{cut}... [{len(text) - len(cut)} more chars, --full]"


def _clean(text: str) -> str:
    """``text`` with control characters shown as escapes: data never drives the terminal."""
    return text.translate(_CONTROLS)


def _text(value: Any, style: str = "") -> Text:
    """``value`` as rich text, never read as markup."""
    from rich.text import Text

    return Text(_clean("" if value is None else str(value)), style=style)


def _shell(word: str) -> str:
    import shlex

    return shlex.quote(word)
