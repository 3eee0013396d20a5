"""``chunkd inspect``'s views of what is inside: an object's summary (its kind's facts:
a Parquet footer, a tar's samples, MDS columns, a binary's first bytes, an image) and
its pages of rows or RL data (rollouts with their logprob strips, episodes), one
sample, and a step's ids with its samples."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, Final

from chunkd.gateway.cli.inspect_catalog import CatalogViews
from chunkd.gateway.cli.inspect_images import image_values
from chunkd.gateway.cli.inspect_text import FOLD_ITEMS, audio_text, clean, rich_text, shell_word
from chunkd.gateway.cli.options import human_size

if TYPE_CHECKING:
    from rich.text import Text

__all__ = ["LOW_P", "MAX_COLUMNS", "STEP_IDS", "STEP_SAMPLES", "STRIP_BARS", "ObjectViews"]

#: columns of a rows table; --columns picks others
MAX_COLUMNS: Final = 10
#: samples shown for --step; the other ids are listed
STEP_SAMPLES: Final = 4
#: ids of a step listed per rank
STEP_IDS: Final = 256
#: bars of a rollout's logprob strip; a longer rollout gives each bar several tokens
STRIP_BARS: Final = 16
#: a token below this probability is drawn orange and counted in the strip's summary
LOW_P: Final = 0.5
_BARS: Final = "▁▂▃▄▅▆▇█"
#: Parquet footer metadata a writer keeps for itself: not printed unless --full
WRITER_METADATA: Final = frozenset({"ARROW:schema", "pandas"})
#: the inspector sends a footer metadata value's first 4 KiB (client/inspect/views/parquet.py)
_METADATA_SENT: Final = 4096
#: a value this long of base64's alphabet alone is taken for binary, not text
_BASE64_CHARS: Final = 64
_BASE64: Final = re.compile(r"[A-Za-z0-9+/]+={0,2}")


class ObjectViews(CatalogViews):
    """An object's views, a sample's and a step's; each view returns the exit status."""

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
            facts.append(
                ("audio", audio_text(opened.get("audio")) or "its header could not be read")
            )
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
            self.say(f"{clean(str(key))} ({_metadata_size(value)}, hidden; --full shows it)")
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
            table.add_row(
                rich_text(sample.get("index")), rich_text(sample.get("key")), rich_text(members)
            )
        self.console.print(table)

    def binary(self, opened: dict[str, Any]) -> None:
        for key in ("hex", "text"):
            value = opened.get(key)
            if isinstance(value, str):
                lines = value.splitlines() or [value]
                cut = lines if self.args.full else lines[:16]
                self.console.print(rich_text(key, "bold"))
                self.console.print(rich_text("\n".join(cut)))
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
            table.add_row(rich_text(row.get("index")), *cells)
        self.console.print(table)
        if hidden:
            self.say(f"{len(hidden)} more columns: {', '.join(hidden)} (--columns picks)")
        self.more(page.get("next"), "next page: --start {}")
        if any(True for _ in image_values(rows)):
            # A table stays a table: previews come with one sample.
            first = f"{page.get('name')}#{rows[0].get('index')}"
            self.say(f"images show with one sample: chunkd inspect {shell_word(first)}")

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
            self.console.print(rich_text(label, "bold"), self.cell(group.get("prompt")))
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
                table.add_row(rich_text(rollout.get("index")), *cells)
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
                rich_text(f"episode {episode.get('episode')}", "bold"),
                rich_text(f"return {episode.get('return')}, {episode.get('length')} steps"),
            )
            steps = episode.get("steps") or []
            timeline = "".join(_step_mark(s) for s in steps[:200])
            self.console.print(rich_text(f"timeline {timeline}"))
            table = Table("#", "step", "observation", "action", "reward", "done")
            shown = steps if self.args.full else steps[: FOLD_ITEMS * 2]
            for step in shown:
                table.add_row(
                    rich_text(step.get("index")),
                    rich_text(step.get("step")),
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
            rich_text(f"step {answer.get('step')} of {answer.get('ref')}", "bold"),
            rich_text(f"(snapshot {str(answer.get('snapshot'))[:16]})"),
        )
        for rank, share in sorted(ranks.items(), key=lambda item: int(item[0])):
            rank_ids = share.get("ids") or []
            padding = share.get("padding") or 0
            self.console.print(
                rich_text(f"rank {rank}: ", "bold"),
                rich_text(f"{len(rank_ids)} ids" + (f", {padding} padding" if padding else "")),
            )
            listed = rank_ids if args.full else rank_ids[:STEP_IDS]
            self.console.print(rich_text("  " + "  ".join(map(str, listed))))
            if len(listed) < len(rank_ids):
                self.say(f"{len(rank_ids) - len(listed)} more ids (--full or --json)")
        for sample in samples:
            self.console.rule()
            self.print_sample(sample)
        if len(ids) > len(samples):
            self.say(f"{len(ids) - len(samples)} more samples (--count K shows more)")
        return 0


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


def _short(value: float) -> str:
    """A logprob in 3 significant digits (``-0.418``, ``-12.3``, ``-inf``)."""
    return f"{value:.3g}"


def _step_mark(step: dict[str, Any]) -> str:
    if step.get("done"):
        return "|"
    reward = step.get("reward")
    if isinstance(reward, int | float) and not isinstance(reward, bool):
        return "+" if reward > 0 else "-" if reward < 0 else "."
    return "."
