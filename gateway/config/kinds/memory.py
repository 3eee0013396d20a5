"""``memory://``: objects in the daemon's memory (tests, demos). No keys of its own;
it ignores those of remote stores."""

from __future__ import annotations

from typing import Final

from chunkd.gateway.config.kinds.kind import BackendKind

__all__ = ["KIND"]


def _url_problem(url: str) -> str | None:
    rest = url.partition("://")[2]
    if rest and not rest.startswith("/"):
        return "names a bucket, which memory backends have none of; write 'memory://'"
    return None


KIND: Final = BackendKind(
    schemes=("memory",),
    io="chunkd.gateway.backends.memory:MemoryBackend",
    example="memory://",
    what="a memory:// backend",
    url_problem=_url_problem,
    prefix=lambda url: url.partition("://")[2].strip("/"),
)
