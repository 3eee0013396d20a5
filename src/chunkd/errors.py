"""The chunkd error family.

Every error chunkd raises on purpose derives from :class:`ChunkdError`, and each
leaf also derives from the builtin exception a caller would already catch, so that
``except FileNotFoundError`` or ``except ValueError`` keeps working. Errors are
mapped to HTTP status codes only at the HTTP edge, never here.

A message says what was asked, what happened, and what to do about it.

This module is light on purpose: the client imports it without the daemon's
dependencies.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BackendForbiddenError",
    "BackendUnavailableError",
    "BucketNotFoundError",
    "CacheClosedError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "ChunkNotFoundError",
    "ChunkTooLargeError",
    "ChunkdError",
    "ConfigError",
    "DaemonUnavailableError",
    "DatasetError",
    "DatasetFormatError",
    "DatasetNotFoundError",
    "IndexSchemaError",
    "InspectCrashedError",
    "InspectError",
    "InspectTimeoutError",
    "IntegrityError",
    "InvalidChunkIdError",
    "InvalidKeyError",
    "InvalidRangeError",
    "InvalidRequestError",
    "MalformedFileError",
    "ManifestError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "OwnerSilentError",
    "ProtocolError",
    "ProtocolVersionError",
    "RangeNotSatisfiableError",
    "ReadOnlyBackendError",
    "ResumeStateError",
    "SnapshotDriftError",
    "UnknownBackendError",
    "UnsupportedStateError",
    "UnversionedObjectError",
    "VersionChangedError",
    "error_class",
]


class ChunkdError(Exception):
    """Root of every error chunkd raises on purpose."""


class InvalidChunkIdError(ChunkdError, ValueError):
    """A chunk id is not 64 lowercase-or-uppercase hex characters (or 32 raw bytes)."""


class ChunkTooLargeError(ChunkdError, ValueError):
    """A chunk is larger than the configured ``chunk_bytes`` limit."""


class IntegrityError(ChunkdError, ValueError):
    """Bytes do not hash to the chunk id they were stored or sent under."""


class ChunkNotFoundError(ChunkdError, LookupError):
    """A chunk id is not held by the cache (or tier) that was asked."""


class ObjectNotFoundError(ChunkdError, FileNotFoundError):
    """An object (``BACKEND/KEY``) does not exist in its backend."""


class CacheClosedError(ChunkdError, RuntimeError):
    """An operation was attempted on a cache, tier or index that is closed."""


class IndexSchemaError(ChunkdError, RuntimeError):
    """The on-disk index has a schema this version cannot read or migrate."""


class ConfigError(ChunkdError, ValueError):
    """A configuration value is missing or invalid."""


class UnknownBackendError(ChunkdError, LookupError):
    """A name was asked of a backend that is not configured (the backend list is the allowlist)."""


class InvalidKeyError(ChunkdError, ValueError):
    """An object key that chunkd refuses: empty, too long, ``..``, control characters."""


class BackendError(ChunkdError, OSError):
    """A backend could not answer a request."""


class BackendUnavailableError(BackendError, ConnectionError):
    """The backend is down, timing out, or answering 5xx (or its circuit is open)."""


class UnversionedObjectError(BackendError, ValueError):
    """The backend answered with no version chunkd can pin a read to: an http(s)://
    server that sends no strong ``ETag`` for a backend not declared
    ``immutable_files``. Reads there could mix two versions of a file, so none is made."""


class BackendForbiddenError(BackendError, PermissionError):
    """The backend refused chunkd's credentials for this object (403/401)."""


class BucketNotFoundError(BackendError, FileNotFoundError):
    """The backend's own bucket (or container) does not exist: deleted behind chunkd, or
    never made. No object of the backend can be read or listed until it is back."""


class VersionChangedError(BackendError):
    """The object changed between chunkd's HEAD and its ranged GET (If-Match failed)."""


class InvalidRequestError(ChunkdError, ValueError):
    """A well-formed request with arguments chunkd refuses: a wrong type, a number out of
    bounds, nesting too deep. The request is answered with this error; the connection
    stays."""


class ProtocolError(ChunkdError, ValueError):
    """A frame that breaks the local protocol's framing rules.

    ``in_sync`` says whether the whole frame was read all the same, so that the
    stream is still in step and the frame can be answered (with this error) rather
    than the connection closed; see :mod:`chunkd.client.protocol`.
    """

    def __init__(self, message: str, *, in_sync: bool = False) -> None:
        super().__init__(message)
        self.in_sync = in_sync


class DaemonUnavailableError(ChunkdError, ConnectionError):
    """No chunkd daemon answers on this node's socket (or it stopped answering)."""


class OwnerSilentError(ChunkdError, TimeoutError):
    """A peer that owns a chunk sent nothing for ``[peers] timeout`` and then failed a
    health probe."""


class ProtocolVersionError(ChunkdError, RuntimeError):
    """The client and the daemon speak different versions of the local protocol."""


class InvalidRangeError(ChunkdError, ValueError):
    """A byte range that is malformed, or asks for several ranges at once."""


class RangeNotSatisfiableError(ChunkdError, ValueError):
    """A well-formed byte range that lies outside the object."""

    def __init__(self, message: str, size: int = 0) -> None:
        super().__init__(message)
        self.size = size


class ReadOnlyBackendError(ChunkdError, PermissionError):
    """A write was asked of a backend that is not configured ``writable = true``."""


class ReservedKeyError(ChunkdError, PermissionError):
    """A write that would land under a prefix chunkd keeps for its own layout in a
    backend (``chunks/``, ``checkpoints/``, ``intents/``, ``gc/``, the dataset
    registry); the message names the key and the prefix. Nothing was written."""


class AccessDeniedError(ChunkdError, PermissionError):
    """The caller may not change or remove this thing: it was made by another user, and
    the caller is neither root, the daemon's own user, nor in ``server.admin_group``
    (docs/security.md, "Who may do what")."""


class CheckpointError(ChunkdError, RuntimeError):
    """A checkpoint could not be saved, committed or loaded."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A checkpoint of that name exists and the save did not say ``overwrite=True``."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint has that name (a missing or torn manifest counts as none)."""


class UnsupportedStateError(ChunkdError, TypeError):
    """A state dict holds an object chunkd cannot save; the message names its key path."""


class DatasetError(ChunkdError, RuntimeError):
    """A dataset could not be registered, resolved or read."""


class DatasetNotFoundError(DatasetError, LookupError):
    """No registered dataset, version, tag or snapshot answers to that name (a tag or
    version whose manifest is missing counts as none)."""


class ObjectExistsError(DatasetError, FileExistsError):
    """An object chunkd was to write is there already with other bytes (a migrate's
    destination); it was not overwritten."""


class ManifestError(DatasetError, ValueError):
    """A snapshot manifest is malformed, torn, forged (its bytes do not hash to its id),
    or of a schema this code does not read."""


class SnapshotDriftError(DatasetError):
    """A snapshot member's source object changed or vanished since it was registered;
    the message names the member. Freeze the snapshot to keep reading it."""


class DatasetFormatError(DatasetError, ValueError):
    """A file cannot be read as the format it was registered as; the message names it."""


class ResumeStateError(DatasetError, ValueError):
    """A loader state is corrupted, or belongs to another snapshot, seed or order."""


class InspectError(ChunkdError, RuntimeError):
    """The inspector could not show an object or a sample."""


class MalformedFileError(InspectError, ValueError):
    """A file cannot be read as its format (a truncated Parquet footer, a bad JSON line,
    a broken tar header, a corrupt image); the message names the file and the fault."""


class InspectTimeoutError(InspectError, TimeoutError):
    """An inspector request ran past ``server.inspect_timeout``; its worker was killed."""


class InspectCrashedError(InspectError):
    """An inspector worker died on a request (out of memory, or a crash in native code
    on a hostile file); it was replaced, and only that request failed."""


def _family(root: type[ChunkdError]) -> dict[str, type[ChunkdError]]:
    found = {root.__name__: root}
    for sub in root.__subclasses__():
        if sub.__module__ == __name__:
            found |= _family(sub)
    return found


#: every class of the family by name: the error kinds the local socket carries
_KINDS: dict[str, type[ChunkdError]] = _family(ChunkdError)


def error_class(kind: object) -> type[ChunkdError]:
    """The class of the family named ``kind`` (an error kind on the wire); ChunkdError
    for a name the family does not hold (a newer daemon's, say)."""
    return _KINDS.get(kind, ChunkdError) if isinstance(kind, str) else ChunkdError
