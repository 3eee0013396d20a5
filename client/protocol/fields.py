"""A field of a local-socket request: its type, its bounds, and the check of a value.

The op table (:mod:`chunkd.client.protocol.ops`) is built of these; the daemon's
other JSON documents (the journal, manifests) are checked with them too
(:mod:`chunkd.gateway.arguments`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from chunkd.errors import ChunkdError, InvalidRequestError

__all__ = ["MAX_OFFSET", "Field", "FieldType"]

#: the largest offset or length a request may name: a signed 64-bit file offset
MAX_OFFSET: Final = (1 << 63) - 1

FieldType = Literal["text", "whole", "number", "flag", "choice", "texts", "ranges", "counts"]
_NO_DEFAULT: Final[Any] = object()


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a request: its name, type, bounds and whether it is required.

    ``high`` bounds a ``whole`` or ``number`` (with ``low``), the UTF-8 bytes of a
    ``text``, and the items of a ``texts`` or ``ranges`` list; a ``counts`` list holds
    exactly ``high`` whole numbers, each at most :data:`MAX_OFFSET`. A ``choice`` is one
    of ``choices``. A field is required when it has no ``default``; a null counts as
    absent. A wrong value raises ``error`` (:class:`~chunkd.errors.InvalidRequestError`
    unless the field names another).
    """

    name: str
    kind: FieldType
    doc: str
    low: float = 0
    high: float = 0
    default: Any = _NO_DEFAULT
    choices: tuple[str, ...] = ()
    error: type[ChunkdError] = InvalidRequestError

    @property
    def required(self) -> bool:
        """Whether a request must carry this field."""
        return self.default is _NO_DEFAULT

    def check(self, header: Mapping[str, Any]) -> Any:
        """The field's value in ``header``, checked; its default when absent or null."""
        value = header.get(self.name)
        if value is None:
            if self.required:
                raise self.error(f"{_show_op(header)} wants {self.name!r}")
            return self.default
        checker = _CHECKS[self.kind]
        return checker(self, value)

    def describe(self) -> str:
        """One line for the docs: name, type, bounds, required or default."""
        if self.kind == "text":
            what = f"string of at most {int(self.high)} bytes"
        elif self.kind == "whole":
            what = f"whole number {_num(self.low)}..{_num(self.high)}"
        elif self.kind == "number":
            what = f"number {_num(self.low)}..{_num(self.high)}"
        elif self.kind == "flag":
            what = "true|false"
        elif self.kind == "choice":
            what = "|".join(f'"{c}"' for c in self.choices)
        elif self.kind == "texts":
            what = f"list of at most {int(self.high)} strings"
        elif self.kind == "counts":
            what = f"list of {int(self.high)} whole numbers"
        else:
            what = f"list of 1..{int(self.high)} [name, offset, length]"
        need = "required" if self.required else f"default {json.dumps(self.default)}"
        return f"``{self.name}``: {what}, {need}; {self.doc}"

    def _fail(self, what: str, value: object) -> ChunkdError:
        return self.error(f"{self.name} must be {what}; got {_show(value)}")


def _check_text(field: Field, value: object) -> str:
    if not isinstance(value, str):
        raise field._fail("a string", value)
    limit = int(field.high)
    if len(value) > limit or _utf8_size(field, value) > limit:
        raise field.error(f"{field.name} is longer than {limit} bytes")
    return value


def _utf8_size(field: Field, value: str) -> int:
    """The UTF-8 bytes of ``value``; a lone surrogate (JSON can escape one, "\\ud800")
    is refused here, once, rather than wherever the daemon would encode it."""
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise field.error(
            f"{field.name} holds a lone surrogate, which is not text: {_show(value)}; "
            "send valid Unicode (a pair of surrogates, or the character itself)"
        ) from None


def _is_whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_whole(field: Field, value: object) -> int:
    if not _is_whole(value):
        raise field._fail("a whole number", value)
    assert isinstance(value, int)
    if not field.low <= value <= field.high:
        raise field.error(
            f"{field.name} must be from {_num(field.low)} to {_num(field.high)}; got {value}"
        )
    return value


def _check_number(field: Field, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise field._fail("a number", value)
    # A whole number is compared as it is: it may be too large for a float.
    if not ((isinstance(value, int) or math.isfinite(value)) and field.low <= value <= field.high):
        raise field.error(
            f"{field.name} must be from {field.low:g} to {field.high:g}; got {_show(value)}"
        )
    return float(value)


def _check_flag(field: Field, value: object) -> bool:
    if not isinstance(value, bool):
        raise field._fail("true or false", value)
    return value


def _check_choice(field: Field, value: object) -> str:
    if not isinstance(value, str) or value not in field.choices:
        raise field._fail(" or ".join(repr(c) for c in field.choices), value)
    return value


def _check_texts(field: Field, value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise field._fail("a list of strings", value)
    if len(value) > field.high:
        raise field.error(f"{field.name} holds {len(value)} items; at most {int(field.high)}")
    for item in value:
        _utf8_size(field, item)
    return value


def _check_counts(field: Field, value: object) -> list[int]:
    if (
        not isinstance(value, list)
        or len(value) != field.high
        or not all(_is_whole(n) and 0 <= n <= MAX_OFFSET for n in value)
    ):
        raise field._fail(f"a list of {int(field.high)} whole numbers >= 0", value)
    return [int(n) for n in value]


def _check_ranges(field: Field, value: object) -> list[tuple[str, int, int]]:
    if not isinstance(value, list) or not 0 < len(value) <= field.high:
        raise field.error(
            f"{field.name} must be a list of 1 to {int(field.high)} [name, offset, length]"
        )
    out = []
    for item in value:
        if (
            not isinstance(item, list | tuple)
            or len(item) != 3
            or not isinstance(item[0], str)
            or not all(_is_whole(n) and 0 <= n <= MAX_OFFSET for n in item[1:])
        ):
            raise field.error(
                f"each of {field.name} is [name, offset, length] with whole numbers >= 0; "
                f"got {_show(item)}"
            )
        _utf8_size(field, item[0])
        out.append((item[0], int(item[1]), int(item[2])))
    return out


_CHECKS: Final[Mapping[str, Any]] = {
    "text": _check_text,
    "whole": _check_whole,
    "number": _check_number,
    "flag": _check_flag,
    "choice": _check_choice,
    "texts": _check_texts,
    "ranges": _check_ranges,
    "counts": _check_counts,
}


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _show_op(header: Mapping[str, Any]) -> str:
    op = header.get("op")
    return op[:40] if isinstance(op, str) else "the request"
