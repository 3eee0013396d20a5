"""The conditions of a GetObject or HeadObject, as S3 applies RFC 9110's.

:func:`check_conditions` takes ``If-Match``, else ``If-Unmodified-Since`` (a 412
``PreconditionFailed`` naming the condition), then ``If-None-Match``, else
``If-Modified-Since`` (a 304 ``NotModified`` carrying the object's validators);
:func:`range_applies` says whether a ``Range`` is served under ``If-Range`` (a strong
entity tag, or a date that is exactly the object's ``Last-Modified`` and a strong
validator), else the whole object is. An HTTP date that is no date is ignored, as S3
and RFC 9110 13.1.3 ignore it.

A mechanism of its own: functions of a request's headers and the object's
:class:`~chunkd.gateway.readpath.Stat`, with no routing in them;
:mod:`chunkd.gateway.s3front.front` asks them before it sends an object.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from chunkd.gateway.s3front.errors import S3Error, s3_error
from chunkd.gateway.s3front.requesttime import parse_http_date

if TYPE_CHECKING:
    from chunkd.gateway.readpath import Stat

__all__ = ["check_conditions", "range_applies"]

#: what a 304 carries of the headers a 200 would (RFC 9110 15.4.5)
_NOT_MODIFIED_HEADERS: Final = frozenset(
    {"ETag", "Last-Modified", "Cache-Control", "Expires", "Content-Location"}
)


def _http_date(text: str | None) -> float | None:
    """The time of a condition's HTTP date; None for none, and for one that is no date
    or out of any calendar's range: S3 (and RFC 9110 13.1.3) ignore such a condition."""
    return None if text is None else parse_http_date(text)


def range_applies(if_range: str | None, etag: str, stat: Stat) -> bool:
    """Whether a ``Range`` is served under ``If-Range`` (RFC 9110 13.1.5): its entity
    tag matches strongly, or its date is exactly the object's ``Last-Modified`` and that
    is a strong validator (a second or more old). Anything else, a date no calendar
    holds among them, is no match: the whole object, never a range of another version.
    """
    if if_range is None:
        return True
    value = if_range.strip()
    if value.startswith(('"', "W/")):
        return value == etag  # a weak tag never matches
    when = parse_http_date(value)
    modified = int(stat.meta.modified)
    return (
        when is not None and modified > 0 and int(when) == modified and modified <= time.time() - 1
    )


def _etag_matches(header: str, etag: str, *, weak: bool) -> bool:
    """Whether ``etag`` is in an If-Match (strong comparison: a ``W/`` tag never
    matches) or an If-None-Match (``weak``) list, RFC 9110 8.8.3.2."""
    bare = etag.strip('"')
    for tag in (tag.strip() for tag in header.split(",")):
        if tag == "*":
            return True
        if tag.startswith("W/"):
            if not weak:
                continue
            tag = tag[2:]
        if tag.strip('"') == bare:
            return True
    return False


def check_conditions(request: Mapping[str, str], stat: Stat, headers: dict[str, str]) -> None:
    """RFC 9110's order, as S3 applies it: If-Match, else If-Unmodified-Since; then
    If-None-Match, else If-Modified-Since (a 304 carries the object's validators)."""
    etag = headers["ETag"]
    modified = int(stat.meta.modified)  # HTTP dates have whole seconds
    if_match = request.get("If-Match")
    if if_match is not None:
        if not _etag_matches(if_match, etag, weak=False):
            raise s3_error(
                "PreconditionFailed",
                "At least one of the pre-conditions you specified did not hold",
                fields={"Condition": "If-Match"},
            )
    else:
        since = _http_date(request.get("If-Unmodified-Since"))
        if since is not None and stat.meta.modified and modified > since:
            raise s3_error(
                "PreconditionFailed",
                "At least one of the pre-conditions you specified did not hold",
                fields={"Condition": "If-Unmodified-Since"},
            )
    if_none = request.get("If-None-Match")
    not_modified = False
    if if_none is not None:
        not_modified = _etag_matches(if_none, etag, weak=True)
    else:
        since = _http_date(request.get("If-Modified-Since"))
        not_modified = since is not None and bool(stat.meta.modified) and modified <= since
    if not_modified:
        keep = {k: v for k, v in headers.items() if k in _NOT_MODIFIED_HEADERS}
        raise S3Error("NotModified", 304, "Not Modified", headers=keep)
