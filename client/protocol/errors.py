"""Errors on the local socket: an error answer from an exception, and back.

The kind on the wire is the class name of an error of the :mod:`chunkd.errors`
family; there is no HTTP status on the socket.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chunkd.errors import ChunkdError, error_class

__all__ = ["error_answer", "error_of"]


def error_answer(exc: BaseException) -> dict[str, Any]:
    """The error answer to a request that failed with ``exc``: its kind (the class
    name, ``ChunkdError`` for what is not of the family), its message, and the chunk
    id when the error names one."""
    kind = type(exc).__name__ if isinstance(exc, ChunkdError) else "ChunkdError"
    out: dict[str, Any] = {"ok": False, "error": kind, "message": str(exc)}
    chunk = getattr(exc, "chunk_id", None)
    if chunk is not None:
        out["chunk"] = str(chunk)
    return out


def error_of(answer: Mapping[str, Any], what: str) -> ChunkdError:
    """The :mod:`chunkd.errors` exception an error answer (or readv entry) names, with
    the daemon's message (``what`` was asked says it when there is none)."""
    kind = answer.get("error")
    message = answer.get("message") or f"the chunkd daemon refused {what} ({kind})"
    error = error_class(kind)(str(message))
    if isinstance(answer.get("chunk"), str):
        error.chunk_id = answer["chunk"]  # type: ignore[attr-defined]
    return error
