"""The S3 front's XML: errors, bucket lists, locations and object listings, as S3
writes them (namespace ``http://s3.amazonaws.com/doc/2006-03-01/``).

Documents are built as text from escaped parts: a listing page of 1,000 keys is
written in about a millisecond, and nothing a key holds can break out of its
element (XML 1.0 cannot carry most control characters at all; a key that holds one
is written with ``encoding-type=url``, as S3 asks clients to do, or not listed).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final
from urllib.parse import quote
from xml.sax.saxutils import escape

__all__ = [
    "Content",
    "Listing",
    "bucket_list",
    "error_document",
    "iso8601",
    "listing_v1",
    "listing_v2",
    "location",
    "xml_safe",
]

_HEAD: Final = '<?xml version="1.0" encoding="UTF-8"?>\n'
_NS: Final = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'
#: what the front reports as every object's owner (chunkd has no accounts)
_OWNER: Final = "<Owner><ID>chunkd</ID><DisplayName>chunkd</DisplayName></Owner>"


def xml_safe(text: str) -> bool:
    """Whether XML 1.0 can carry ``text`` as it is."""
    return all(
        c in "\t\n\r" or (" " <= c < "\ufffe" and not "\ud800" <= c <= "\udfff") for c in text
    )


def _clean(text: str) -> str:
    """``text`` with what XML 1.0 cannot carry written as ``\\xNN`` (a message that
    quotes a client's bytes, a prefix echoed back without ``encoding-type=url``)."""
    if xml_safe(text):
        return text
    return "".join(
        c if xml_safe(c) else c.encode("unicode_escape", "backslashreplace").decode("ascii")
        for c in text
    )


def iso8601(seconds: float) -> str:
    """``seconds`` since the epoch as S3 writes times in XML: ``2026-12-01T19:03:52.000Z``."""
    whole = int(seconds)
    millis = int((seconds - whole) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"


def _text(value: str, *, url: bool = False) -> str:
    """An element's text: url-encoded for ``encoding-type=url`` (as S3 does: ``/``
    kept, a space as ``%20``), XML-escaped in any case."""
    return escape(quote(value, safe="/") if url else _clean(value))


def error_document(code: str, message: str, request_id: str, fields: dict[str, str]) -> bytes:
    """An ``<Error>`` document."""
    more = "".join(f"<{name}>{escape(_clean(value))}</{name}>" for name, value in fields.items())
    return (
        f"{_HEAD}<Error><Code>{code}</Code><Message>{escape(_clean(message))}</Message>{more}"
        f"<RequestId>{request_id}</RequestId></Error>"
    ).encode()


def bucket_list(names: Iterable[str], created: float) -> bytes:
    """A ``ListAllMyBucketsResult`` of ``names``, all created at ``created``."""
    when = iso8601(created)
    buckets = "".join(
        f"<Bucket><Name>{escape(name)}</Name><CreationDate>{when}</CreationDate></Bucket>"
        for name in names
    )
    return (
        f"{_HEAD}<ListAllMyBucketsResult {_NS}>{_OWNER}<Buckets>{buckets}</Buckets>"
        "</ListAllMyBucketsResult>"
    ).encode()


def location(region: str) -> bytes:
    """A ``LocationConstraint`` document (empty for ``us-east-1``, as S3 answers)."""
    text = "" if region == "us-east-1" else escape(region)
    return f"{_HEAD}<LocationConstraint {_NS}>{text}</LocationConstraint>".encode()


@dataclass(frozen=True, slots=True)
class Content:
    """One object of a listing."""

    key: str
    size: int
    etag: str
    modified: float


def _contents(contents: Iterable[Content], *, url: bool, owner: bool) -> str:
    who = _OWNER if owner else ""
    return "".join(
        f"<Contents><Key>{_text(c.key, url=url)}</Key>"
        f"<LastModified>{iso8601(c.modified)}</LastModified>"
        f"<ETag>{escape(c.etag)}</ETag><Size>{c.size}</Size>{who}"
        "<StorageClass>STANDARD</StorageClass></Contents>"
        for c in contents
    )


def _prefixes(prefixes: Iterable[str], *, url: bool) -> str:
    return "".join(
        f"<CommonPrefixes><Prefix>{_text(p, url=url)}</Prefix></CommonPrefixes>" for p in prefixes
    )


def _optional(name: str, value: str | None, *, url: bool = False) -> str:
    return "" if value is None else f"<{name}>{_text(value, url=url)}</{name}>"


@dataclass(frozen=True, slots=True)
class Listing:
    """One page of a listing as both ListObjects versions answer it."""

    bucket: str
    prefix: str
    delimiter: str | None
    max_keys: int
    contents: list[Content]
    #: common prefixes, each ending with the delimiter
    prefixes: list[str]
    #: the key (or common prefix) to resume after; None: the last page
    after: str | None
    #: ``encoding-type=url``
    url: bool

    def _head(self) -> str:
        return (
            f"{_HEAD}<ListBucketResult {_NS}><Name>{escape(self.bucket)}</Name>"
            f"<Prefix>{_text(self.prefix, url=self.url)}</Prefix>"
        )

    def _body(self, *, owner: bool) -> str:
        return (
            ("<EncodingType>url</EncodingType>" if self.url else "")
            + _contents(self.contents, url=self.url, owner=owner)
            + _prefixes(self.prefixes, url=self.url)
            + "</ListBucketResult>"
        )

    def _truncated(self) -> str:
        return f"<IsTruncated>{'true' if self.after is not None else 'false'}</IsTruncated>"


def listing_v2(
    page: Listing,
    *,
    continuation: str | None,
    next_continuation: str | None,
    start_after: str | None,
    owner: bool,
) -> bytes:
    """A ``ListBucketResult`` of ListObjectsV2."""
    parts = [
        page._head(),
        _optional("Delimiter", page.delimiter, url=page.url),
        f"<MaxKeys>{page.max_keys}</MaxKeys>",
        f"<KeyCount>{len(page.contents) + len(page.prefixes)}</KeyCount>",
        page._truncated(),
        _optional("ContinuationToken", continuation),
        _optional("NextContinuationToken", next_continuation),
        _optional("StartAfter", start_after, url=page.url),
        page._body(owner=owner),
    ]
    return "".join(parts).encode()


def listing_v1(page: Listing, *, marker: str) -> bytes:
    """A ``ListBucketResult`` of ListObjects (v1), with ``NextMarker`` whenever it is
    truncated (S3 sends it only with a delimiter, and clients resume after the last
    key otherwise; a page whose keys were all left out has no last key)."""
    parts = [
        page._head(),
        f"<Marker>{_text(marker, url=page.url)}</Marker>",
        _optional("NextMarker", page.after, url=page.url),
        f"<MaxKeys>{page.max_keys}</MaxKeys>",
        _optional("Delimiter", page.delimiter, url=page.url),
        page._truncated(),
        page._body(owner=True),
    ]
    return "".join(parts).encode()
