"""The HTTP status of each chunkd error, for the HTTP edge alone.

The local socket carries an error's kind (its class name) and message, never a
status: see :func:`chunkd.client.protocol.error_answer`.
"""

from __future__ import annotations

from typing import Final

from chunkd.errors import (
    AccessDeniedError,
    BackendForbiddenError,
    BackendUnavailableError,
    BucketNotFoundError,
    CacheClosedError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChunkNotFoundError,
    DatasetFormatError,
    DatasetNotFoundError,
    InspectCrashedError,
    InspectError,
    InspectTimeoutError,
    IntegrityError,
    InvalidChunkIdError,
    InvalidKeyError,
    InvalidRangeError,
    InvalidRequestError,
    MalformedFileError,
    ManifestError,
    ObjectExistsError,
    ObjectNotFoundError,
    ProtocolError,
    ProtocolVersionError,
    RangeNotSatisfiableError,
    ReadOnlyBackendError,
    ReservedKeyError,
    ResumeStateError,
    SnapshotDriftError,
    UnknownBackendError,
    UnsupportedStateError,
    UnversionedObjectError,
    VersionChangedError,
)

__all__ = ["http_status"]

# (error class, status), most specific first.
STATUS: Final[list[tuple[type[BaseException], int]]] = [
    (UnknownBackendError, 404),
    (CheckpointNotFoundError, 404),
    (CheckpointExistsError, 409),
    (DatasetNotFoundError, 404),
    (SnapshotDriftError, 409),
    (ObjectExistsError, 409),
    (ManifestError, 502),
    (DatasetFormatError, 422),
    (MalformedFileError, 422),
    (InspectTimeoutError, 504),
    (InspectCrashedError, 422),
    (ResumeStateError, 400),
    (ReadOnlyBackendError, 403),
    (ReservedKeyError, 403),
    (AccessDeniedError, 403),
    (UnsupportedStateError, 400),
    (ObjectNotFoundError, 404),
    (BucketNotFoundError, 404),
    (ChunkNotFoundError, 404),
    (InvalidKeyError, 400),
    (InvalidChunkIdError, 400),
    (InvalidRequestError, 400),
    (ProtocolVersionError, 400),
    (ProtocolError, 400),
    (InvalidRangeError, 400),
    (RangeNotSatisfiableError, 416),
    (BackendForbiddenError, 403),
    (VersionChangedError, 409),
    (BackendUnavailableError, 503),
    (IntegrityError, 502),
    (UnversionedObjectError, 502),
    (CacheClosedError, 503),
    # The inspector's own fault (a file's is MalformedFileError by then, 422): a bug.
    (InspectError, 500),
]


def http_status(exc: BaseException) -> int:
    """The status for ``exc`` (500 for anything the table does not name)."""
    return next((code for cls, code in STATUS if isinstance(exc, cls)), 500)
