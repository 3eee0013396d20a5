"""Single arguments of a request, checked: types and bounds.

The ops of the local socket declare their fields in :data:`chunkd.client.protocol.OPS`
and are checked there (:meth:`~chunkd.client.protocol.Op.check`). These functions
check one value the same way (they build a :class:`~chunkd.client.protocol.Field`),
for documents that are not a request's header: a checkpoint's journal entry, say.

A wrong argument raises :class:`~chunkd.errors.InvalidRequestError` naming it, and
nothing a document names (a count, a size, a length) is used before it is checked.
"""

from __future__ import annotations

from typing import Any, Final

from chunkd.client.protocol import Field

__all__ = ["flag", "number", "optional_text", "text", "whole"]

_NO_DEFAULT: Final[Any] = Field("_", "flag", "").default


def text(header: dict[str, Any], key: str, *, max_bytes: int = 4096) -> str:
    """A string argument, at most ``max_bytes`` bytes of UTF-8."""
    value: str = Field(key, "text", "", high=max_bytes).check(header)
    return value


def optional_text(header: dict[str, Any], key: str, *, max_bytes: int = 4096) -> str | None:
    """A string argument that may be null or absent."""
    value: str | None = Field(key, "text", "", high=max_bytes, default=None).check(header)
    return value


def whole(
    header: dict[str, Any], key: str, *, low: int, high: int, default: Any = _NO_DEFAULT
) -> int:
    """A whole number from ``low`` to ``high``; ``default`` when absent or null."""
    return int(Field(key, "whole", "", low=low, high=high, default=default).check(header))


def number(
    header: dict[str, Any], key: str, *, low: float, high: float, default: Any = _NO_DEFAULT
) -> float:
    """A finite number from ``low`` to ``high``; ``default`` when absent or null."""
    return float(Field(key, "number", "", low=low, high=high, default=default).check(header))


def flag(header: dict[str, Any], key: str, *, default: bool = False) -> bool:
    """A boolean argument (``default`` when absent or null)."""
    return bool(Field(key, "flag", "", default=default).check(header))
