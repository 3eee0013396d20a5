"""The daemon's logs: one event per line, as JSON for machines or as text for people.

Under systemd the daemon writes to stderr and journald keeps each line as one
entry, so a record must never span lines: a newline in a message, a field or a
traceback is escaped, never written. Loggers are named after their module
(``chunkd.gateway.sdnotify``); context goes in ``extra``, not into the message::

    log.info("backend read", extra={"backend": "data", "bytes": 4194304})

gives, in the ``json`` format::

    {"ts": "2025-01-02T03:04:05.678Z", "level": "info", "logger": "chunkd.gateway.read",
     "event": "backend read", "backend": "data", "bytes": 4194304}

(on one line), and in the ``text`` format::

    2025-01-02T03:04:05.678Z info    chunkd.gateway.read backend read backend=data bytes=4194304

Keys of the JSON object: ``ts`` (RFC 3339, UTC, milliseconds), ``level``, ``logger``,
``event`` (the formatted message), then every ``extra`` field, then ``exc`` (the
formatted traceback) and ``stack`` when the record has them. A value JSON cannot
hold is written as its ``str()``; an ``extra`` field that collides with one of
those keys is kept as ``extra_<key>``, and one whose name starts with ``_`` is left out.

Requests that aiohttp cannot parse (a bad request line, bad or oversized headers,
broken chunked framing, TLS or other bytes sent to the HTTP port) are anyone's to
send. aiohttp logs each at error level with a traceback; the daemon hands aiohttp a
:class:`MalformedRequestLog` instead, which counts each one and logs it as one
``info`` line, at most ten lines a minute, then one line with how many more came.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Final, TextIO, TypeAlias

from aiohttp.http_exceptions import HttpProcessingError

from chunkd.errors import ConfigError

__all__ = [
    "LOG_FORMATS",
    "LOG_LEVELS",
    "JsonFormatter",
    "MalformedRequestLog",
    "TextFormatter",
    "configure_logging",
]

#: Names accepted for ``level``, lowest first.
LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")
#: Names accepted for ``fmt``.
LOG_FORMATS: Final = ("json", "text")

_RESERVED: Final = frozenset({"ts", "level", "logger", "event", "exc", "stack"})

_ExcInfo: TypeAlias = (
    bool
    | BaseException
    | tuple[type[BaseException], BaseException, TracebackType | None]
    | tuple[None, None, None]
    | None
)

# Attributes every LogRecord has; whatever else a record carries came from ``extra``.
# Computed rather than listed so that attributes added by later Pythons (taskName in
# 3.12) are not mistaken for fields.
_RECORD_ATTRS: Final = frozenset(
    logging.LogRecord("", logging.INFO, "", 0, "", None, None).__dict__
) | {"message", "asctime"}

# Characters after which ``str.splitlines`` starts a new line. JSON escapes those
# below U+0020 itself; the three above it are legal unescaped inside JSON strings.
_JSON_BREAKS: Final = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}
_TEXT_BREAKS: Final = {
    ord(ch): ch.encode("unicode_escape").decode("ascii")
    for ch in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"
}


def configure_logging(level: str = "info", fmt: str = "json", stream: TextIO | None = None) -> None:
    """Send every log record to ``stream``, one event per line.

    Sets the root logger's level and installs one handler on it. Calling again
    replaces the handler installed before (with the new level, format and stream)
    instead of adding a second one; handlers installed by others are left alone.

    Args:
        level: the lowest level written: ``debug``, ``info``, ``warning``, ``error``
            or ``critical`` (any case).
        fmt: ``json`` (one JSON object per line) or ``text`` (one readable line).
        stream: where lines go; standard error by default, which journald collects
            under systemd.

    Raises:
        ConfigError: ``level`` or ``fmt`` is not one of the names above (a
            ``ValueError``).
    """
    level_name = level.strip().lower()
    if level_name not in LOG_LEVELS:
        raise ConfigError(f"log level {level!r} is unknown; use one of {', '.join(LOG_LEVELS)}")
    fmt_name = fmt.strip().lower()
    if fmt_name not in LOG_FORMATS:
        raise ConfigError(f"log format {fmt!r} is unknown; use one of {', '.join(LOG_FORMATS)}")
    formatter: logging.Formatter = JsonFormatter() if fmt_name == "json" else TextFormatter()
    handler = _EventLineHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _EventLineHandler)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level_name.upper())


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object on one line (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        # docstring inherited
        fields = _fields(self, record)
        try:
            line = json.dumps(fields, ensure_ascii=False, allow_nan=False, default=_safe_str)
        except (TypeError, ValueError):
            # A nested value json cannot take (a non-string key, NaN, a cycle): fall
            # back to str() for each top-level value that fails on its own.
            line = json.dumps(
                {key: _json_value(value) for key, value in fields.items()},
                ensure_ascii=False,
                allow_nan=False,
                default=_safe_str,
            )
        return line.translate(_JSON_BREAKS)


class TextFormatter(logging.Formatter):
    """Formats a record as ``ts level logger event key=value ...`` on one line.

    Values that are not plain words are quoted and escaped as JSON strings.
    """

    def format(self, record: logging.LogRecord) -> str:
        # docstring inherited
        fields = _fields(self, record)
        head = (
            f"{fields.pop('ts')} {fields.pop('level'):<7} {fields.pop('logger')} "
            f"{str(fields.pop('event')).translate(_TEXT_BREAKS)}"
        )
        pairs = [f"{key}={_text_value(value)}" for key, value in fields.items()]
        return " ".join([head, *pairs]).translate(_TEXT_BREAKS)


class MalformedRequestLog(logging.LoggerAdapter[logging.Logger]):
    """The logger aiohttp's server writes to (``AppRunner(app, logger=...)``).

    A record about a request aiohttp could not parse (its ``exc_info`` is an
    ``HttpProcessingError``) is counted with ``count`` and becomes one ``info`` line
    without a traceback: ``malformed HTTP request from ADDRESS refused: REASON``,
    with ``remote``, ``error`` and ``reason`` fields. Those lines are rate limited to
    ``burst`` per ``interval`` seconds; the requests past that are told in one line,
    ``N more malformed HTTP requests in the last S s (not logged one by one)`` with a
    ``malformed`` field, when the interval is over (or at :meth:`close`). Every other
    record, a handler's failure among them, passes unchanged.

    Args:
        logger: the logger to write to (``aiohttp.server``).
        count: called once per malformed request (the metric's ``inc``).
        burst: lines written one by one per interval.
        interval: seconds.
        clock: the time source (monotonic seconds).
    """

    def __init__(
        self,
        logger: logging.Logger,
        count: Callable[[], object],
        *,
        burst: int = 10,
        interval: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(logger, {})
        self._count = count
        self._burst = burst
        self._interval = interval
        self._clock = clock
        self._window = -interval  # when the current interval began
        self._written = 0  # lines written one by one in it
        self._untold = 0  # requests counted but not written since the last summary
        self._summary: asyncio.TimerHandle | None = None

    def log(
        self,
        level: int,
        msg: object,
        *args: object,
        exc_info: _ExcInfo = None,
        stack_info: bool = False,
        stacklevel: int = 1,
        extra: Mapping[str, object] | None = None,
        **kwargs: object,
    ) -> None:
        # docstring inherited
        error = _malformed_request(exc_info)
        if error is None:
            super().log(
                level,
                msg,
                *args,
                exc_info=exc_info,
                stack_info=stack_info,
                stacklevel=stacklevel,
                extra=extra,
                **kwargs,
            )
            return
        self._count()
        # aiohttp says "Error handling request from %s" with the client's address.
        remote = str(args[0]) if len(args) == 1 else "an unknown client"
        now = self._clock()
        if now - self._window >= self._interval:
            self._tell_untold()
            self._window, self._written = now, 0
        if self._written < self._burst:
            self._written += 1
            reason = _reason(error)
            self.logger.info(
                "malformed HTTP request from %s refused: %s",
                remote,
                reason,
                extra={"remote": remote, "error": type(error).__name__, "reason": reason},
            )
            return
        self._untold += 1
        if self._summary is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop to wait on: told with the next one, or at close()
                return
            wait = max(0.0, self._window + self._interval - now)
            self._summary = loop.call_later(wait, self._tell_untold)

    def close(self) -> None:
        """Write the summary line of the requests not told yet, if any."""
        self._tell_untold()

    def _tell_untold(self) -> None:
        if self._summary is not None:
            self._summary.cancel()
            self._summary = None
        if not self._untold:
            return
        untold, self._untold = self._untold, 0
        seconds = max(0.0, self._clock() - self._window)
        self.logger.info(
            "%d more malformed HTTP %s in the last %.0f s (not logged one by one)",
            untold,
            "request" if untold == 1 else "requests",
            seconds,
            extra={"malformed": untold},
        )


def _malformed_request(exc_info: _ExcInfo) -> HttpProcessingError | None:
    """The parse error of a malformed request that ``exc_info`` reports, if it is one."""
    if exc_info is True:
        exc_info = sys.exc_info()
    error = exc_info[1] if isinstance(exc_info, tuple) else exc_info
    return error if isinstance(error, HttpProcessingError) else None


def _reason(error: HttpProcessingError) -> str:
    """aiohttp's message on one short line, without its caret line."""
    lines = [line.strip() for line in str(error.message).splitlines()]
    text = " ".join(line for line in lines if line and set(line) != {"^"})
    return text if len(text) <= 160 else text[:157] + "..."


class _EventLineHandler(logging.StreamHandler[TextIO]):
    """The handler :func:`configure_logging` installs; its type marks it as ours."""


def _fields(formatter: logging.Formatter, record: logging.LogRecord) -> dict[str, Any]:
    """The record as ordered fields: ts, level, logger, event, extras, exc, stack."""
    fields: dict[str, Any] = {
        "ts": _rfc3339(record),
        "level": record.levelname.lower(),
        "logger": record.name,
        "event": record.getMessage(),
    }
    for key, value in record.__dict__.items():
        if key in _RECORD_ATTRS or key.startswith("_"):
            continue
        fields["extra_" + key if key in _RESERVED else key] = value
    if record.exc_info and not record.exc_text:
        # Cached on the record, as logging.Formatter.format does, so that several
        # handlers format a traceback once.
        record.exc_text = formatter.formatException(record.exc_info)
    if record.exc_text:
        fields["exc"] = record.exc_text
    if record.stack_info:
        fields["stack"] = formatter.formatStack(record.stack_info)
    return fields


def _rfc3339(record: logging.LogRecord) -> str:
    # record.msecs is truncated, never rounded up to 1000 (CPython gh-89047).
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


def _safe_str(value: object) -> str:
    try:
        return str(value)
    except Exception:  # a broken __str__ must not lose the whole event
        return f"<unprintable {type(value).__name__}>"


def _json_value(value: object) -> object:
    try:
        json.dumps(value, allow_nan=False, default=_safe_str)
    except (TypeError, ValueError):
        return _safe_str(value)
    return value


def _text_value(value: object) -> str:
    if isinstance(value, str):
        plain = value
    elif value is None or isinstance(value, (bool, int, float, list, tuple, dict)):
        try:
            plain = json.dumps(
                value, ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=_safe_str
            )
        except (TypeError, ValueError):
            plain = _safe_str(value)
    else:
        plain = _safe_str(value)
    return plain if _is_word(plain) else json.dumps(plain, ensure_ascii=False)


def _is_word(text: str) -> bool:
    return bool(text) and not any(
        ch.isspace() or ch in '"=\\' or not ch.isprintable() for ch in text
    )
