"""What a backend tells about one object version: :class:`ObjectMeta`."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["ObjectMeta"]


class ObjectMeta(NamedTuple):
    """What a HEAD (or a listing) tells about one object version.

    A named tuple: listings make one per object, and it is the cheapest immutable
    record Python builds.
    """

    key: str
    size: int
    #: the version token: the ETag, or size and mtime where a store has no ETag
    version: str
    #: the ETag to send as If-Match, when the store has one
    etag: str | None
    #: when the object was last written (seconds since the epoch; 0 when unknown)
    modified: float = 0.0
