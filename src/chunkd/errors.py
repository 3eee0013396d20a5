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
    "CacheClosedError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "ChunkNotFoundError",
    "ChunkTooLargeError",
    "ChunkdError",
    "ConfigError",
    "IndexSchemaError",
    "IntegrityError",
    "InvalidChunkIdError",
    "InvalidKeyError",
    "InvalidRangeError",
    "InvalidRequestError",
    "ObjectNotFoundError",
    "ProtocolVersionError",
    "RangeNotSatisfiableError",
    "ReadOnlyBackendError",
    "TierUnavailableError",
    "UnknownBackendError",
    "UnsupportedStateError",
    "VersionChangedError",
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


class TierUnavailableError(ChunkdError, OSError):
    """A tier cannot serve right now (for example a disk tier degraded by EIO)."""


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


class BackendForbiddenError(BackendError, PermissionError):
    """The backend refused chunkd's credentials for this object (403/401)."""


class VersionChangedError(BackendError):
    """The object changed between chunkd's HEAD and its ranged GET (If-Match failed)."""


class InvalidRequestError(ChunkdError, ValueError):
    """A well-formed request with arguments chunkd refuses: a wrong type, a number out of
    bounds, nesting too deep. The request is answered with this error; the connection
    stays."""


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


class CheckpointError(ChunkdError, RuntimeError):
    """A checkpoint could not be saved, committed or loaded."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A checkpoint of that name exists and the save did not say ``overwrite=True``."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint has that name (a missing or torn manifest counts as none)."""


class UnsupportedStateError(ChunkdError, TypeError):
    """A state dict holds an object chunkd cannot save; the message names its key path."""
