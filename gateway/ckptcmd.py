"""``chunkd ckpt ls`` and ``chunkd gc``: checkpoints as the node's daemon sees them.

Both talk to the running daemon over its local socket, so they use its backends and
credentials and never need their own.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.errors import ChunkdError

__all__ = ["gc", "ls"]


def ls(prefix: str, *, socket: str | None, as_json: bool, out: TextIO = sys.stdout) -> int:
    """Print the checkpoints under ``BACKEND[/PREFIX]`` (every page); returns the exit status."""
    try:
        with Client(socket) as client:
            entries = ckpt.list(prefix, client=client)
    except ChunkdError as exc:
        print(f"chunkd ckpt ls: {exc}", file=sys.stderr)
        return 1
    if as_json:
        json.dump(entries, out, indent=2)
        out.write("\n")
        return 0
    rows: list[tuple[str, ...]] = [
        ("NAME", "STEP", "SIZE", "NEW", "DEDUP", "DURABILITY", "STATE", "CREATED")
    ]
    rows += [_row(e) for e in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip(), file=out
        )
    if not entries:
        print(f"(no checkpoints under {prefix})", file=out)
    return 0


def _row(entry: dict[str, Any]) -> tuple[str, ...]:
    logical, new = int(entry.get("logical_bytes") or 0), int(entry.get("new_bytes") or 0)
    dedup = "-" if not logical else ("all" if new == 0 else f"{logical / new:.2f}x")
    created = entry.get("created")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created)) if created else "-"
    step = entry.get("step")
    return (
        str(entry["name"]),
        "-" if step is None else str(step),
        _human(logical),
        _human(new),
        dedup,
        str(entry.get("durability") or "-"),
        str(entry.get("state") or "-"),
        when,
    )


def gc(
    target: str,
    *,
    keep_last: int | None,
    grace: float,
    dry_run: bool,
    socket: str | None,
    out: TextIO = sys.stdout,
) -> int:
    """Run retention and mark-and-sweep in the daemon; print what it did."""
    try:
        with Client(socket) as client:
            report = ckpt.gc(
                target, keep_last=keep_last, grace=grace, dry_run=dry_run, client=client
            )
    except ChunkdError as exc:
        print(f"chunkd gc: {exc}", file=sys.stderr)
        return 1
    verb = "would remove" if dry_run else "removed"
    for name in report.get("retired", []):
        print(f"{verb} checkpoint {name} (keep_last {keep_last})", file=out)
    print(
        f"chunks: {report['chunks']} in the backend, {report['referenced']} referenced, "
        f"{report['kept_young']} unreferenced but younger than the grace period; "
        f"{verb} {report['swept']} ({_human(report['freed_bytes'])})",
        file=out,
    )
    return 0


def _human(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")  # pragma: no cover
