"""What a dataset check finds: :class:`Finding`, and how findings show sizes and schemas.

The type below both :mod:`chunkd.client.datasets.check` (which runs the rules of every
dataset and groups what is found) and each format's own rules
(:meth:`~chunkd.client.datasets.formats.Format.check`, in the format's module) build,
so that neither imports the other: the check calls the formats, the formats build
findings. :mod:`chunkd.client.datasets.check` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Finding", "Level", "columns_text", "size_text"]

Level = Literal["error", "warning"]


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing a check found.

    Attributes:
        level: ``"error"`` (samples are wrong or unreadable) or ``"warning"``.
        member: the member's key (the first of ``examples``), or None for the dataset
            as a whole, or for the rest of a code's findings.
        code: the rule (see :mod:`chunkd.client.datasets.check`).
        message: what was found, and what to do.
        count: how many times it was found (members that carry it).
        examples: a few of those members' keys (at most
            :data:`~chunkd.client.datasets.check.EXAMPLES`).
    """

    level: Level
    member: str | None
    code: str
    message: str
    count: int = 1
    examples: tuple[str, ...] = ()


def columns_text(schema: Any) -> str:
    """A schema as findings show it: ``[name:type, ...]`` (a format's rules use it)."""
    if not isinstance(schema, list):
        return repr(schema)
    return "[" + ", ".join(":".join(str(p) for p in column) for column in schema) + "]"


def size_text(n: int) -> str:
    """``n`` bytes as findings show them (``12.5 MiB``; a format's rules use it)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"
