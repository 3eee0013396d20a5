"""The HTTP status of each chunkd error: one table for the HTTP API and the local socket."""

from __future__ import annotations

from typing import Any, Final

from chunkd.errors import (
    BackendForbiddenError,
    BackendUnavailableError,
    CacheClosedError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChunkNotFoundError,
    IntegrityError,
    InvalidChunkIdError,
    InvalidKeyError,
    InvalidRequestError,
    ObjectNotFoundError,
    ProtocolVersionError,
    ReadOnlyBackendError,
    UnknownBackendError,
    UnsupportedStateError,
    VersionChangedError,
)
from chunkd.gateway.ranges import InvalidRangeError, RangeNotSatisfiableError

__all__ = ["error_answer", "http_status"]

# (status, kind) per error class, most specific first.
STATUS: Final[list[tuple[type[BaseException], int]]] = [
    (UnknownBackendError, 404),
    (CheckpointNotFoundError, 404),
    (CheckpointExistsError, 409),
    (ReadOnlyBackendError, 403),
    (UnsupportedStateError, 400),
    (ObjectNotFoundError, 404),
    (ChunkNotFoundError, 404),
    (InvalidKeyError, 400),
    (InvalidChunkIdError, 400),
    (InvalidRequestError, 400),
    (ProtocolVersionError, 400),
    (InvalidRangeError, 400),
    (RangeNotSatisfiableError, 416),
    (BackendForbiddenError, 403),
    (VersionChangedError, 409),
    (BackendUnavailableError, 503),
    (IntegrityError, 502),
    (CacheClosedError, 503),
]


def http_status(exc: BaseException) -> int:
    """The status for ``exc`` (500 for anything the table does not name)."""
    return next((code for cls, code in STATUS if isinstance(exc, cls)), 500)


def error_answer(exc: BaseException) -> dict[str, Any]:
    """The error answer of the local socket: kind, HTTP-like status, message, and the
    chunk id when the error names one."""
    out: dict[str, Any] = {
        "ok": False,
        "error": type(exc).__name__,
        "status": http_status(exc),
        "message": str(exc),
    }
    chunk = getattr(exc, "chunk_id", None)
    if chunk is not None:
        out["chunk"] = chunk
    return out
