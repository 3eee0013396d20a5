"""The arguments of a local-socket request, checked: types and bounds.

A request whose arguments are wrong is answered with
:class:`~chunkd.errors.InvalidRequestError` naming the argument, never by closing
the connection, and nothing a request names (a count, a size, a length) is used
before it is checked against its bound.
"""

from __future__ import annotations

import math
from typing import Any, Final

from chunkd.errors import InvalidRequestError

__all__ = ["flag", "number", "optional_text", "text", "whole"]

_NO_DEFAULT: Final[Any] = object()


def _missing(op: object, key: str) -> InvalidRequestError:
    return InvalidRequestError(f"{op} wants {key!r}")


def text(header: dict[str, Any], key: str, *, max_bytes: int = 4096) -> str:
    """A string argument, at most ``max_bytes`` bytes of UTF-8."""
    value = header.get(key)
    if not isinstance(value, str):
        if value is None:
            raise _missing(header.get("op"), key)
        raise InvalidRequestError(f"{key} must be a string; got {_show(value)}")
    if len(value) > max_bytes or len(value.encode("utf-8", "surrogatepass")) > max_bytes:
        raise InvalidRequestError(f"{key} is longer than {max_bytes} bytes")
    return value


def optional_text(header: dict[str, Any], key: str, *, max_bytes: int = 4096) -> str | None:
    """A string argument that may be null or absent."""
    return None if header.get(key) is None else text(header, key, max_bytes=max_bytes)


def whole(
    header: dict[str, Any], key: str, *, low: int, high: int, default: Any = _NO_DEFAULT
) -> int:
    """A whole number from ``low`` to ``high``; ``default`` when absent or null."""
    value = header.get(key)
    if value is None:
        if default is _NO_DEFAULT:
            raise _missing(header.get("op"), key)
        return int(default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{key} must be a whole number; got {_show(value)}")
    if not low <= value <= high:
        raise InvalidRequestError(f"{key} must be from {low} to {high}; got {value}")
    return value


def number(
    header: dict[str, Any], key: str, *, low: float, high: float, default: Any = _NO_DEFAULT
) -> float:
    """A finite number from ``low`` to ``high``; ``default`` when absent or null."""
    value = header.get(key)
    if value is None:
        if default is _NO_DEFAULT:
            raise _missing(header.get("op"), key)
        return float(default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"{key} must be a number; got {_show(value)}")
    # A whole number is compared as it is: it may be too large for a float.
    if not ((isinstance(value, int) or math.isfinite(value)) and low <= value <= high):
        raise InvalidRequestError(f"{key} must be from {low:g} to {high:g}; got {value!r}")
    return float(value)


def flag(header: dict[str, Any], key: str, *, default: bool = False) -> bool:
    """A boolean argument (``default`` when absent or null)."""
    value = header.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{key} must be true or false; got {_show(value)}")
    return value


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
