"""When a signed S3 request says it was made, read as SigV2 and SigV4 both read it.

A header-signed request carries its time in ``x-amz-date`` (ISO 8601 basic,
``20240101T000000Z``, or, from some SigV2 clients, an HTTP date) or in ``Date``
(an HTTP date, ``Mon, 01 Jan 2024 00:00:00 GMT``), and must be within the
verifier's ``max_skew`` of the server's clock: :func:`check_skew` answers
``RequestTimeTooSkewed`` as S3 does. A presigned URL carries an expiry instead,
a count of seconds that :func:`parse_expires` reads.
"""

from __future__ import annotations

import calendar
import time
from email.utils import parsedate_to_datetime
from typing import Final

from chunkd.gateway.s3front.errors import s3_error
from chunkd.gateway.s3front.refusals import capped

__all__ = [
    "NO_DATE",
    "amz_date_of",
    "check_skew",
    "iso8601",
    "parse_amz_date",
    "parse_expires",
    "parse_http_date",
    "parse_request_time",
]

#: S3's message for a header-signed request with no time it can read
NO_DATE: Final = "AWS authentication requires a valid Date or x-amz-date header"

#: the longest HTTP date read: the longest form (RFC 850's, with its weekday in full)
#: is 38 characters; anything longer is no date, and is not given to a parser
_MAX_HTTP_DATE_CHARS: Final = 64
#: the most digits an expiry is read with: ten are more than any expiry, and int()
#: of thousands of digits is slow (and refused past 4300)
_MAX_EXPIRES_DIGITS: Final = 10


def parse_amz_date(value: str) -> float | None:
    """The time of ``YYYYMMDDTHHMMSSZ``, None if ``value`` is not one (a day the
    calendar has not, year 0000 among them: no clock holds it)."""
    if len(value) != 16 or value[8] != "T" or value[15] != "Z":
        return None
    digits = value[:8] + value[9:15]
    if not (digits.isascii() and digits.isdigit()):
        return None
    year, month, day = int(value[0:4]), int(value[4:6]), int(value[6:8])
    hour, minute, second = int(value[9:11]), int(value[11:13]), int(value[13:15])
    if not (year >= 1 and 1 <= month <= 12 and hour < 24 and minute < 60 and second < 61):
        return None
    if not 1 <= day <= calendar.monthrange(year, month)[1]:
        return None
    return float(calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0)))


def parse_http_date(value: str) -> float | None:
    """The time of an HTTP date (``Tue, 27 Mar 2007 19:36:42 +0000``, RFC 850 and
    asctime's forms too), None if ``value`` is not one: a date out of the calendar's
    range (a year of 23 digits, a zone of 99999 hours) is none either, never an error.
    A date without a zone (asctime's form, ``-0000``) is GMT (RFC 9110 5.6.7)."""
    if len(value) > _MAX_HTTP_DATE_CHARS:
        return None
    try:
        parsed = parsedate_to_datetime(value)
        return float(calendar.timegm(parsed.utctimetuple()))
    except (TypeError, ValueError, OverflowError, IndexError):
        return None


def parse_request_time(value: str) -> float | None:
    """The time of ``value`` in either form, ISO 8601 basic or HTTP date."""
    request_time = parse_amz_date(value)
    return parse_http_date(value) if request_time is None else request_time


def parse_expires(text: str) -> int | None:
    """The whole seconds of a presigned URL's expiry, None if ``text`` is no count."""
    if not text or len(text) > _MAX_EXPIRES_DIGITS or not (text.isascii() and text.isdigit()):
        return None
    return int(text)


def check_skew(request_time: float, shown: str, *, now: float, max_skew: float) -> None:
    """Refuse a request made more than ``max_skew`` seconds from ``now``.

    Args:
        request_time: when the request says it was made.
        shown: that time as the request wrote it, told back in ``RequestTime``.
        now: the server's time.
        max_skew: the most seconds allowed either way.

    Raises:
        S3Error: ``RequestTimeTooSkewed``, with S3's fields.
    """
    if abs(now - request_time) > max_skew:
        raise s3_error(
            "RequestTimeTooSkewed",
            "The difference between the request time and the current time is too large.",
            fields={
                "RequestTime": capped(shown),
                "ServerTime": iso8601(now),
                "MaxAllowedSkewMilliseconds": str(round(max_skew * 1000)),
            },
        )


def iso8601(seconds: float) -> str:
    """``seconds`` as S3 tells a time in an error: ``2024-01-01T00:00:00Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def amz_date_of(seconds: float) -> str:
    """``seconds`` as an ``x-amz-date``: ``20240101T000000Z``."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(seconds))
