"""``chunkd inspect``'s views of what is registered and listed: the datasets, a page of
a backend's listing, a dataset's versions, a snapshot (totals, schema, a page of
members) and what differs between two snapshots."""

from __future__ import annotations

from typing import Any

from chunkd.gateway.cli.inspect_text import FOLD_ITEMS, Printer, rich_text, shell_word, when_text
from chunkd.gateway.cli.options import human_size

__all__ = ["CatalogViews"]


class CatalogViews(Printer):
    """The catalog's views; each returns the exit status."""

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
                rich_text(entry.get("name")),
                rich_text(entry.get("latest")),
                rich_text(when_text(entry.get("created"))),
                rich_text(", ".join(map(str, entry.get("tags") or []))),
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
        table = Table("name", "size", "modified", title=rich_text(title), title_justify="left")
        table.columns[1].justify = "right"
        for entry in answer.get("entries", []):
            if entry.get("type") == "directory":
                table.add_row(rich_text(entry["name"] + "/", "bold"), "", "")
            else:
                table.add_row(
                    rich_text(entry["name"]),
                    human_size(entry.get("size") or 0),
                    rich_text(when_text(entry.get("modified"))),
                )
        self.console.print(table)
        if not answer.get("entries"):
            self.say("nothing is listed here")
        if answer.get("next"):
            self.say(f"more entries follow: --after {shell_word(answer['next'])}")
        return 0

    def dataset(self, name: str) -> int:
        answer = self.api.op("dataset", name=name)
        if self.emit(answer):
            return 0
        from rich.table import Table

        table = Table(
            "version", "snapshot", "created", "samples", "bytes", "tags",
            title=rich_text(f"dataset {answer.get('name')}"), title_justify="left",
        )  # fmt: skip
        for version in answer.get("versions") or []:
            table.add_row(
                rich_text(version.get("version")),
                rich_text(str(version.get("snapshot") or "")[:16]),
                rich_text(when_text(version.get("created"))),
                rich_text(version.get("samples")),
                human_size(version.get("bytes") or 0),
                rich_text(", ".join(map(str, version.get("tags") or []))),
            )
        self.console.print(table)
        self.say(f"a snapshot: chunkd inspect {shell_word(str(answer.get('name')))}@VERSION")
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
        head.add_row("bytes", rich_text(human_size(answer.get("bytes") or 0)))
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
            self.console.print(rich_text("schema", "bold"), self.cell(schema))
        members = answer.get("members") or []
        table = Table("key", "size", "samples", "first", title="members", title_justify="left")
        for member in members:
            table.add_row(
                rich_text(member.get("key")),
                human_size(member.get("size") or 0),
                rich_text(member.get("samples")),
                rich_text(member.get("first")),
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
            rich_text(f"{answer.get('a')} -> {answer.get('b')}: ", "bold"),
            rich_text(
                f"{answer.get('same', 0)} same, "
                f"{len(added) + more.get('added', 0)} added, "
                f"{len(removed) + more.get('removed', 0)} removed, "
                f"{len(changed) + more.get('changed', 0)} changed"
            ),
        )
        for mark, members in (("+", added), ("-", removed), ("~", changed)):
            shown = members if self.args.full else members[: FOLD_ITEMS * 4]
            for member in shown:
                self.console.print(rich_text(f"{mark} "), self.cell(_member_line(member)))
            if len(shown) < len(members):
                self.say(f"{len(members) - len(shown)} more '{mark}' (--full)")
        return 0


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
