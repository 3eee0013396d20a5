"""The S3 front's errors: an S3 error code, its HTTP status, and a message.

The front answers every failure as S3 does, with ``<Error><Code>...`` XML (see
:mod:`chunkd.gateway.s3front.xml`), so that an S3 client raises the error it knows
(boto3's ``ClientError`` with ``Error.Code``, s3fs's ``FileNotFoundError`` for
``NoSuchKey``). :class:`S3Error` is raised by the door alone; a chunkd error from
the read path is mapped to one by :func:`s3_error_of` at the edge.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from chunkd.errors import (
    BackendError,
    BackendForbiddenError,
    BackendUnavailableError,
    ChunkdError,
    IntegrityError,
    InvalidKeyError,
    ObjectNotFoundError,
    RangeNotSatisfiableError,
    UnknownBackendError,
    VersionChangedError,
)

__all__ = ["S3Error", "s3_error_of"]


class S3Error(ChunkdError):
    """An S3 error answer: ``code`` (``NoSuchKey``...), HTTP ``status``, ``message``.

    ``fields``: more elements of the ``<Error>`` document, as S3 adds them (the
    ``RequestTime`` and ``ServerTime`` of ``RequestTimeTooSkewed``, the
    ``StringToSign`` of ``SignatureDoesNotMatch``...). ``headers``: more response
    headers (``Content-Range`` of ``InvalidRange``, ``Retry-After`` of
    ``ServiceUnavailable``).
    """

    def __init__(
        self,
        code: str,
        status: int,
        message: str,
        *,
        fields: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.status = status
        self.message = message
        self.fields = dict(fields or {})
        self.headers = dict(headers or {})


#: S3's own status for each code the front answers
STATUS: Final = {
    "AccessDenied": 403,
    "AuthorizationHeaderMalformed": 400,
    "AuthorizationQueryParametersError": 400,
    "ExpiredToken": 400,
    "InvalidAccessKeyId": 403,
    "InvalidArgument": 400,
    "InvalidBucketName": 400,
    "InvalidPartNumber": 416,
    "InvalidRange": 416,
    "InvalidRequest": 400,
    "InvalidToken": 400,
    "MalformedXML": 400,
    "MethodNotAllowed": 405,
    "MissingSecurityHeader": 400,
    "NoSuchBucket": 404,
    "NoSuchKey": 404,
    "NotModified": 304,
    "PreconditionFailed": 412,
    "RequestHeaderSectionTooLarge": 400,
    "RequestTimeTooSkewed": 403,
    "ServiceUnavailable": 503,
    "SignatureDoesNotMatch": 403,
    "InternalError": 500,
    "SlowDown": 503,
    # S3's own is 501; the front answers 405 (the method is not allowed on this
    # resource), so no client counts a refused write as a server fault and retries it.
    "NotImplemented": 405,
}


def s3_error(code: str, message: str, **kwargs: Mapping[str, str]) -> S3Error:
    """An :class:`S3Error` of ``code`` with S3's status for it."""
    return S3Error(code, STATUS[code], message, **kwargs)


def s3_error_of(exc: ChunkdError, *, bucket: str, key: str | None) -> S3Error:
    """The S3 answer to a chunkd error raised while serving ``bucket``/``key``."""
    if isinstance(exc, S3Error):
        return exc
    if isinstance(exc, UnknownBackendError):
        return s3_error("NoSuchBucket", f"The specified bucket does not exist: {bucket}")
    if isinstance(exc, BackendError) and isinstance(exc, FileNotFoundError):
        # The backend's own bucket is gone (chunkd.errors.BucketNotFoundError): S3 says
        # so for every object and listing of it. The answer names the front's bucket,
        # never the backend's.
        return s3_error("NoSuchBucket", f"The specified bucket does not exist: {bucket}")
    if isinstance(exc, ObjectNotFoundError | InvalidKeyError):
        # A key chunkd cannot hold is one no object has: S3 answers NoSuchKey, never 400.
        return s3_error("NoSuchKey", "The specified key does not exist.")
    if isinstance(exc, RangeNotSatisfiableError):
        return s3_error(
            "InvalidRange",
            "The requested range is not satisfiable",
            headers={"Content-Range": f"bytes */{exc.size}"},
        )
    if isinstance(exc, VersionChangedError):
        # The object changed under a read that had begun: the client reads it again.
        return s3_error("ServiceUnavailable", "The object changed while it was read; retry")
    # What the backend said (its endpoint, its bucket) stays in the daemon's log.
    if isinstance(exc, BackendForbiddenError):
        return s3_error("AccessDenied", f"the backend behind bucket {bucket} refused chunkd")
    if isinstance(exc, BackendUnavailableError):
        return s3_error(
            "ServiceUnavailable",
            f"the backend behind bucket {bucket} is unavailable; retry later",
            headers={"Retry-After": "5"},
        )
    if isinstance(exc, IntegrityError):
        return s3_error("InternalError", "no verified copy of the bytes could be read; retry")
    return s3_error("InternalError", f"chunkd failed ({type(exc).__name__}); see its log")
