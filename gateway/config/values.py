"""One value of the configuration: sizes, durations, secrets, and how each kind is read.

A :class:`Kind` is how a key's value is read (from TOML, from an environment string,
or from a caller building a config in code) and how its default is written back as
TOML. Every parser raises :class:`~chunkd.errors.ConfigError` with a message that
names the key and where the value came from (the file, or the variable).
"""

from __future__ import annotations

import hmac
import json
import math
import mmap
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction
from pathlib import Path
from typing import Any, Final, final

from chunkd.cache import MAX_CHUNK_BYTES
from chunkd.errors import ConfigError

__all__ = [
    "ENVIRONMENT",
    "Kind",
    "Origin",
    "Secret",
    "format_duration",
    "format_size",
    "parse_duration",
    "parse_size",
]

#: the source of a value read from a ``CHUNKD_*`` variable
ENVIRONMENT: Final = "environment"

# -- sizes and durations ------------------------------------------------------------

_BINARY: Final = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_DECIMAL: Final = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_SIZE_UNITS: Final[dict[str, int]] = {
    "": 1,
    "b": 1,
    **{f"{p}ib": f for p, f in _BINARY.items()},
    **{f"{p}i": f for p, f in _BINARY.items()},
    **{f"{p}b": f for p, f in _DECIMAL.items()},
}
_NUMBER: Final = r"(?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)"
_SIZE_RE: Final = re.compile(rf"(?P<number>{_NUMBER})\s*(?P<unit>[A-Za-z]*)")
_SIZE_HINT: Final = "write it like '8GiB'"
# Largest unit first, binary before decimal: the exact spelling format_size picks.
_FORMAT_UNITS: Final = (
    *((f"{p.upper()}iB", f) for p, f in reversed(_BINARY.items())),
    *((f"{p.upper() if p != 'k' else p}B", f) for p, f in reversed(_DECIMAL.items())),
)

_DURATION_UNITS: Final[dict[str, Fraction]] = {
    "ms": Fraction(1, 1000),
    "s": Fraction(1),
    "m": Fraction(60),
    "h": Fraction(3600),
    "d": Fraction(86400),
}
_DURATION_PART: Final = re.compile(rf"({_NUMBER})\s*(ms|s|m|h|d)\s*")
_DURATION_RE: Final = re.compile(rf"(?:{_DURATION_PART.pattern})+")
_DURATION_HINT: Final = "write it like '30s', '5m' or '250ms'"


def where_from(source: str, key: str) -> str:
    """Where a value comes from, as error messages start."""
    if source == ENVIRONMENT:
        return f"environment {key}"
    return f"{source}: {key}"


def show(value: object) -> str:
    """A value as an error message shows it: TOML booleans, quoted strings, short."""
    """A value as an error message shows it: TOML booleans, quoted strings, short."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_size(text: str | int, *, key: str, source: str) -> int:
    """A size in bytes, from an integer or a string like ``"8GiB"`` or ``"10GB"``.

    Binary units (KiB, MiB, GiB, TiB, PiB; also Ki, Mi, ...) count in 1024s, decimal
    units (kB, MB, GB, TB, PB) in 1000s; units are case-insensitive and may follow a
    space. A fraction (``"1.5GiB"``) is rounded down to a whole byte. A bare ``"8G"``
    is refused as ambiguous.

    Args:
        text: the value as given (TOML integer or string, or an environment string).
        key: what the value is for, as messages name it: ``"[cache] ram_bytes"`` or
            the environment variable.
        source: the file the value came from, or ``"environment"``.

    Returns:
        The size in bytes, 0 or more.

    Raises:
        ConfigError: the value is not a size (a bool, a float, garbage, a negative
            number); the message names ``key`` and ``source``.
    """
    return _parse_size(text, key, source)


def _parse_size(value: object, key: str, source: str) -> int:
    where = where_from(source, key)
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"{where} = {show(value)} is not a size; {_SIZE_HINT}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{where} = {value} is negative; a size is 0 or more, like '8GiB'")
        return value
    text = value.strip()
    if text.startswith("-"):
        raise ConfigError(f"{where} = {value!r} is negative; a size is 0 or more, like '8GiB'")
    match = _SIZE_RE.fullmatch(text)
    if match is None:
        raise ConfigError(f"{where} = {value!r} is not a size; {_SIZE_HINT}")
    number, unit = Fraction(match["number"]), match["unit"].lower()
    if unit in _BINARY:
        raise ConfigError(
            f"{where} = {value!r} is ambiguous; write {match['number']}{unit.upper()}iB for "
            f"binary units (1024) or {match['number']}{unit.upper()}B for decimal ones (1000)"
        )
    factor = _SIZE_UNITS.get(unit)
    if factor is None:
        raise ConfigError(f"{where} = {value!r} is not a size; {_SIZE_HINT}")
    if factor == 1 and number.denominator != 1:
        raise ConfigError(f"{where} = {value!r} is not a whole number of bytes; {_SIZE_HINT}")
    return int(number * factor)


def format_size(size: int) -> str:
    """``size`` bytes as an exact string :func:`parse_size` reads back.

    The largest unit that divides ``size`` exactly, binary first:
    ``8 << 30`` gives ``"8GiB"``, ``10**9`` gives ``"1GB"``, ``123`` gives ``"123"``.

    Raises:
        ValueError: ``size`` is negative.
    """
    if size < 0:
        raise ValueError(f"a size is 0 or more bytes; got {size}")
    for unit, factor in _FORMAT_UNITS:
        if size and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def parse_duration(text: str | int | float, *, key: str, source: str) -> float:
    """A duration in seconds, from a number or a string like ``"250ms"`` or ``"1h30m"``.

    Units (lowercase): ``ms``, ``s``, ``m`` (minutes), ``h``, ``d``; parts add up
    (``"1m30s"``); a bare number is seconds.

    Args:
        text: the value as given (TOML number or string, or an environment string).
        key: what the value is for, as messages name it.
        source: the file the value came from, or ``"environment"``.

    Returns:
        The duration in seconds, 0 or more.

    Raises:
        ConfigError: the value is not a duration (a bool, garbage, a negative or
            non-finite number); the message names ``key`` and ``source``.
    """
    return _parse_duration(text, key, source)


def _parse_duration(value: object, key: str, source: str) -> float:
    where = where_from(source, key)
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{where} = {show(value)} is not a duration; {_DURATION_HINT}")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(
                f"{where} = {value!r} is not a duration of 0 seconds or more; {_DURATION_HINT}"
            )
        return float(value)
    text = value.strip()
    if re.fullmatch(_NUMBER, text):
        return float(Fraction(text))
    if not _DURATION_RE.fullmatch(text):
        problem = "is negative" if text.startswith("-") else "is not a duration"
        raise ConfigError(f"{where} = {value!r} {problem}; {_DURATION_HINT}")
    total = sum(
        (Fraction(number) * _DURATION_UNITS[unit] for number, unit in _DURATION_PART.findall(text)),
        start=Fraction(0),
    )
    return float(total)


def format_duration(seconds: float) -> str:
    """``seconds`` as an exact string :func:`parse_duration` reads back.

    The largest unit that divides it exactly: ``86400`` gives ``"1d"``, ``90`` gives
    ``"90s"``, ``0.05`` gives ``"50ms"``; otherwise seconds, ``"0.0001s"``.

    Raises:
        ValueError: ``seconds`` is negative or not finite.
    """
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a duration is 0 seconds or more; got {seconds}")
    exact = Fraction(repr(float(seconds)))
    for unit in ("d", "h", "m", "s", "ms"):
        count = exact / _DURATION_UNITS[unit]
        if count.denominator == 1 and (count or unit == "s"):
            return f"{count.numerator}{unit}"
    return f"{float(seconds)!r}s"


# -- secrets ------------------------------------------------------------------------


@final
class Secret:
    """A string that is never shown: ``repr`` and ``str`` give ``Secret('***')``.

    Credentials are wrapped from the moment they are read, so a config that is
    printed, logged or served by ``/v1/stats`` cannot leak them. Only the code that
    hands a credential to a backend client calls :meth:`reveal`. Two secrets are
    equal when their values are (compared in constant time).
    """

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        """The secret value itself. Never log it."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        return hmac.compare_digest(self._value.encode(), other._value.encode())

    def __hash__(self) -> int:
        return hash((Secret, self._value))


# -- where a value came from ----------------------------------------------------------


@dataclass(frozen=True)
class Origin:
    """Where one value came from: a file (or a class) and a key, or a variable."""

    source: str
    #: "[cache] ram_bytes", or the environment variable
    key: str

    @property
    def where(self) -> str:
        return where_from(self.source, self.key)

    @property
    def from_env(self) -> bool:
        return self.source == ENVIRONMENT

    def error(self, value: object, problem: str) -> ConfigError:
        return ConfigError(f"{self.where} = {show(value)} {problem}")


Parse = Callable[[object, Origin], Any]


def toml_value(value: object) -> str:
    """``value`` as TOML text: ``true``, ``8``, ``"text"``, ``["a", "b"]``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Enum):
        return toml_value(value.value)
    if isinstance(value, str | Path):
        return json.dumps(str(value))
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML spelling for {value!r}")


@dataclass(frozen=True)
class Kind:
    """How the values of a key are read, and how its default is written in TOML."""

    #: reads a value as given (TOML, an environment string, or a Python value) and
    #: checks it; raises ConfigError naming ``origin``
    parse: Parse
    #: the TOML text of a value, as the docs show a default
    write: Callable[[Any], str] = toml_value
    #: the TOML text that means "unset" (None) for this kind; None: unset is
    #: written by leaving the key out
    unset: str | None = None


# -- the kinds ----------------------------------------------------------------------


def parse_text(value: object, origin: Origin) -> str:
    """A non-empty string."""
    if not isinstance(value, str):
        raise origin.error(value, "is not a string; write it in quotes")
    if not value.strip():
        raise ConfigError(f"{origin.where} is empty; give a value, or leave the key out")
    return value


def _path(value: object, origin: Origin) -> Path:
    return value if isinstance(value, Path) else Path(parse_text(value, origin))


def _bool(value: object, origin: Origin) -> bool:
    if isinstance(value, bool):
        return value
    if origin.from_env and isinstance(value, str):
        word = value.strip().lower()
        if word in ("true", "1", "yes", "on"):
            return True
        if word in ("false", "0", "no", "off"):
            return False
        raise origin.error(value, "is not true or false; write true or false")
    raise origin.error(value, "is not true or false; write true or false, without quotes")


def _count(value: object, origin: Origin) -> int:
    if origin.from_env and isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip()):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise origin.error(value, "is not a whole number; write it like 3")
    if value < 0:
        raise origin.error(value, "is negative; write 0 or more")
    return value


def _positive_count(value: object, origin: Origin) -> int:
    count = _count(value, origin)
    if count < 1:
        raise origin.error(value, "is not 1 or more; write a whole number like 8")
    return count


def _size(value: object, origin: Origin) -> int:
    return _parse_size(value, origin.key, origin.source)


def _chunk_size(value: object, origin: Origin) -> int:
    size = _parse_size(value, origin.key, origin.source)
    if size <= 0 or size % mmap.PAGESIZE:
        raise origin.error(
            value,
            f"is not a positive multiple of the page size ({format_size(mmap.PAGESIZE)}), "
            "which chunks need to be mapped side by side; write it like '4MiB'",
        )
    if size > MAX_CHUNK_BYTES:
        raise origin.error(
            value,
            f"is larger than {format_size(MAX_CHUNK_BYTES)}, the largest chunk chunkd writes "
            "(a chunk store's object larger than that is taken as damaged); write it like '4MiB'",
        )
    return size


def _duration(value: object, origin: Origin) -> float:
    return _parse_duration(value, origin.key, origin.source)


def _positive_duration(value: object, origin: Origin) -> float:
    seconds = _parse_duration(value, origin.key, origin.source)
    if seconds <= 0:
        raise origin.error(value, f"is not more than 0 seconds; {_DURATION_HINT}")
    return seconds


def _revalidate(value: object, origin: Origin) -> float | None:
    if value is None or (isinstance(value, str) and value.strip() == "immutable"):
        return None
    try:
        return _parse_duration(value, origin.key, origin.source)
    except ConfigError:
        raise origin.error(
            value, "is neither 'immutable' nor a duration; write 'immutable', or like '5m'"
        ) from None


def _choice(*options: str) -> Parse:
    def convert(value: object, origin: Origin) -> str:
        if value not in options:
            listed = ", ".join(repr(option) for option in options)
            raise origin.error(value, f"is not one of {listed}; write one of those")
        return str(value)

    return convert


def _enum(kind: type[Enum]) -> Parse:
    check = _choice(*(str(member.value) for member in kind))

    def convert(value: object, origin: Origin) -> Enum:
        return kind(check(value, origin))

    return convert


def _secret(value: object, origin: Origin) -> Secret:
    if isinstance(value, Secret):
        secret = value
    elif isinstance(value, str):
        secret = Secret(value)
    else:
        # The value is not shown: it may be the secret itself, mistyped.
        raise ConfigError(f"{origin.where} is not a string; write the secret in quotes")
    if not secret.reveal():
        raise ConfigError(f"{origin.where} is empty; give the secret, or leave the key out")
    return secret


def _socket_mode(value: object, origin: Origin) -> int:
    hint = "write it as a string like '0660', or as TOML octal 0o660"
    if isinstance(value, str):
        digits = value.strip().lower().removeprefix("0o")
        if not re.fullmatch(r"[0-7]{1,4}", digits):
            raise origin.error(value, f"is not an octal permission mode; {hint}")
        mode = int(digits, 8)
    elif isinstance(value, int) and not isinstance(value, bool):
        mode = value
    else:
        raise origin.error(value, f"is not a permission mode; {hint}")
    if not 0 <= mode <= 0o777:
        raise origin.error(value, f"is not a permission mode from 0 to 0777; {hint}")
    return mode


def _price(value: object, origin: Origin) -> float:
    if origin.from_env and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise origin.error(value, "is not a number; write it like 0.0004") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise origin.error(value, "is not a number; write it like 0.0004, without quotes")
    if value < 0 or value == float("inf"):
        raise origin.error(value, "is not a finite price of 0 or more; write it like 0.0004")
    return float(value)


def choice(*options: str) -> Kind:
    """One of ``options``, a string."""
    return Kind(_choice(*options))


def enum_of(kind: type[Enum]) -> Kind:
    """A member of ``kind``, written as its value."""
    return Kind(_enum(kind))


def _write_size(size: int) -> str:
    return json.dumps(format_size(size))


def _write_duration(seconds: float) -> str:
    return json.dumps(format_duration(seconds))


#: a non-empty string
TEXT: Final = Kind(parse_text)
#: a path (relative ones start from the working directory)
PATH: Final = Kind(_path)
#: true or false (from the environment also 1/0, yes/no, on/off)
BOOL: Final = Kind(_bool)
#: a whole number, 0 or more
COUNT: Final = Kind(_count)
#: a whole number, 1 or more
POSITIVE_COUNT: Final = Kind(_positive_count)
#: a price: a finite number, 0 or more (an integer is taken as a float)
PRICE: Final = Kind(_price)
#: a size in bytes: 123, "8GiB", "10GB"
SIZE: Final = Kind(_size, _write_size)
#: a size that is a positive multiple of the page size
CHUNK_SIZE: Final = Kind(_chunk_size, _write_size)
#: a duration in seconds: 1.5, "250ms", "1h30m"
DURATION: Final = Kind(_duration, _write_duration)
#: a duration of more than 0 seconds
POSITIVE_DURATION: Final = Kind(_positive_duration, _write_duration)
#: "immutable" (None) or a duration
REVALIDATE: Final = Kind(_revalidate, _write_duration, unset='"immutable"')
#: a string that is never shown
SECRET: Final = Kind(_secret)
#: permissions: "0660" or TOML octal 0o660
SOCKET_MODE: Final = Kind(_socket_mode, lambda mode: f'"{mode:04o}"')
