"""Reading a ``since`` time: ``1h``/``30m``/``2d`` ago, an ISO time, or seconds since
the epoch (``chunkd cost --since``, ``GET /v1/cost?since=``)."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from typing import Final

from chunkd.errors import InvalidRequestError

__all__ = ["parse_since"]

_AGO: Final = re.compile(r"([0-9]+(?:\.[0-9]+)?)(s|m|h|d)")
_UNITS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


#: the latest ``since`` kept: a day after now (later ones are clamped to it, earlier than
#: the epoch to 0), so that every answer's ``since`` is a finite number
LATEST: Final = 86400.0


def parse_since(text: str, now: float) -> float:
    """``text`` as seconds since the epoch, between 0 and a day after ``now``.

    Raises:
        InvalidRequestError: it is neither a duration ago, an ISO time nor a number, or
            it is no finite time (a duration of more digits than a float holds).
    """
    when = _parse(text, now)
    if not math.isfinite(when):
        raise InvalidRequestError(
            f"since {text.strip()[:64]!r} is no time: it is out of range; write a duration "
            "ago like 1h, 30m or 2d, an ISO time, or seconds since the epoch"
        )
    return min(max(when, 0.0), now + LATEST)


def _parse(text: str, now: float) -> float:
    text = text.strip()
    ago = _AGO.fullmatch(text)
    if ago is not None:
        return now - float(ago[1]) * _UNITS[ago[2]]
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if math.isfinite(seconds):
            return seconds
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidRequestError(
            f"since {text[:64]!r} is no time: write a duration ago like 1h, 30m or 2d, an "
            "ISO time like 2026-12-06T20:00:00Z, or seconds since the epoch"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()
