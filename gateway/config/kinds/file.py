"""``file:///dir``: a directory (a POSIX mount). It takes no keys of its own, and
ignores those of remote stores (the daemon's own file permissions apply)."""

from __future__ import annotations

from typing import Final

from chunkd.gateway.config.kinds.kind import BackendKind

__all__ = ["KIND"]


def _url_problem(url: str) -> str | None:
    rest = url.partition("://")[2]
    if not rest.startswith("/"):
        return "is not an absolute file URL; write it like 'file:///data/chunkd'"
    if ".." in rest.split("/"):
        return "has '..' in its path; write the directory without it"
    return None


def _prefix(url: str) -> str:
    # the absolute directory, taken literally (no percent-decoding)
    return url.partition("://")[2].rstrip("/") or "/"


KIND: Final = BackendKind(
    schemes=("file",),
    io="chunkd.gateway.backends.file:FileBackend",
    example="file:///absolute/dir",
    what="a file:// backend",
    url_problem=_url_problem,
    prefix=_prefix,
)
