"""AWS Signature Version 2 verification for the S3 front (S3's HMAC-SHA1 scheme).

Old clients sign headers this way, and boto3 still presigns URLs this way by
default (``generate_presigned_url`` of a client in ``us-east-1`` with an
``endpoint_url`` and no ``signature_version``): users hand such URLs to curl.
Each is checked against the secret of its access key, as
:mod:`chunkd.gateway.s3front.sigv4` checks SigV4; that module's
:class:`~chunkd.gateway.s3front.sigv4.SigV4Verifier` tells the forms apart and
calls :class:`SigV2Verifier`. Two forms, as S3's "Signing and Authenticating REST
Requests" describes them:

1. The ``Authorization`` header ``AWS AKID:<base64 signature>``, with a ``Date`` or
   ``x-amz-date`` header within ``max_skew`` of the server's clock.
2. A presigned URL: ``AWSAccessKeyId``, ``Signature`` and ``Expires`` (seconds
   since the epoch) in the query.

The signature is ``base64(HMAC-SHA1(secret, StringToSign))``, where::

    StringToSign = VERB "\\n" Content-MD5 "\\n" Content-Type "\\n" Date "\\n"
                   CanonicalizedAmzHeaders CanonicalizedResource

``Date`` is the ``Expires`` of a presigned URL, and empty when an ``x-amz-date``
header is sent (S3's rule; botocore's ``HmacV1Auth`` signs its ``Date`` header
even then, and that is taken too). ``CanonicalizedAmzHeaders`` is one
``name:value\\n`` per ``x-amz-*`` header, names lowercased and sorted, repeated
values joined with ``,``. ``CanonicalizedResource`` is the path exactly as sent
(path-style: ``/bucket/key``, percent-encoded as the client encoded it, which is
what botocore signs; a bucket's alone, ``/bucket``, is taken with its ``/`` too,
as S3 and botocore sign it) and, after a ``?``, the sub-resources of :data:`SUBRESOURCES`
the query holds, sorted by name, their values decoded. A presigned URL made by
botocore carries the signed ``x-amz-*``, ``content-type`` and ``content-md5``
"headers" in its query; they are read from there.

Parameters other than the sub-resources (``prefix``, ``list-type``...) are not
signed in SigV2, at S3 as here; that is the scheme's weakness, and why SigV4
replaced it. Whoever reads the query must decode names and values as this
module does (``+`` as a space, :func:`chunkd.gateway.s3front.querystring.decoded_query`),
so that a sub-resource that is served was signed.

A StringToSign past :data:`~chunkd.gateway.s3front.refusals.MAX_SIGNED_TEXT` (its
CanonicalizedAmzHeaders are as long as the request makes them) is refused unhashed,
and what a ``SignatureDoesNotMatch`` tells back is capped.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Callable
from typing import TYPE_CHECKING, Final
from urllib.parse import unquote

from chunkd.gateway.s3front.errors import s3_error
from chunkd.gateway.s3front.refusals import (
    capped,
    check_signed_text,
    invalid_token,
    signature_mismatch,
)
from chunkd.gateway.s3front.requesttime import (
    NO_DATE,
    check_skew,
    iso8601,
    parse_expires,
    parse_request_time,
)

if TYPE_CHECKING:
    from chunkd.gateway.config.values import Secret
    from chunkd.gateway.s3front.querystring import QueryParameter

__all__ = ["HEADER_PREFIX", "QUERY_SIGNS", "SUBRESOURCES", "SigV2Verifier"]

#: how a SigV2 ``Authorization`` header begins
HEADER_PREFIX: Final = "AWS "

#: the query parameters of a SigV2 presigned URL, all required
QUERY_AUTH_PARAMS: Final = ("AWSAccessKeyId", "Signature", "Expires")

#: a query parameter that makes a request SigV2-presigned (or a broken attempt at one)
QUERY_SIGNS: Final = frozenset({"AWSAccessKeyId", "Signature"})

#: the query parameters that are part of the CanonicalizedResource: S3's list and
#: those botocore's ``HmacV1Auth`` signs (a superset of it)
SUBRESOURCES: Final = frozenset(
    {
        "accelerate", "acl", "analytics", "cors", "defaultObjectAcl", "delete",
        "inventory", "lifecycle", "location", "logging", "metrics", "notification",
        "object-lock", "partNumber", "policy", "replication", "requestPayment",
        "restore", "select", "select-type", "storageClass", "tagging", "torrent",
        "uploadId", "uploads", "versionId", "versioning", "versions", "website",
        "response-cache-control", "response-content-disposition",
        "response-content-encoding", "response-content-language",
        "response-content-type", "response-expires",
    }
)  # fmt: skip


class SigV2Verifier:
    """Checks SigV2 signatures; made and called by ``SigV4Verifier``, which parses
    the request once and picks the scheme.

    No I/O and no state but its arguments: one HMAC-SHA1 per request, a second
    when the first does not match and the request has another reading (``Date``
    sent beside ``x-amz-date``, a bucket's path with or without its ``/``).

    Args:
        secret_of: the secret of an access key id; raises ``S3Error``
            (``InvalidAccessKeyId``) for an unknown one.
        max_skew: how far, in seconds, a header-signed request's time may be from
            the server's; the slack given to a presigned URL's ``Expires`` too.
        max_expires: how far ahead, in seconds, a presigned URL's ``Expires`` may
            be (S3 keeps SigV4's to a week; a SigV2 URL gets the same).
        clock: the current time, in seconds since the epoch.
    """

    def __init__(
        self,
        secret_of: Callable[[str], Secret],
        *,
        max_skew: float,
        max_expires: float,
        clock: Callable[[], float],
    ) -> None:
        self._secret_of = secret_of
        self._max_skew = max_skew
        self._max_expires = max_expires
        self._clock = clock

    def verify_header(
        self,
        method: str,
        raw_path: str,
        query: list[QueryParameter],
        by_name: dict[str, list[str]],
        authorization: str,
    ) -> str:
        """Verify ``Authorization: AWS AKID:signature``.

        Args:
            method: the HTTP method, as sent.
            raw_path: the path exactly as sent, without the query.
            query: the parameters of the query string.
            by_name: the headers, lowercased name -> every value sent.
            authorization: the one ``Authorization`` header's value.

        Returns:
            The access key id that signed.

        Raises:
            S3Error: malformed, unknown key, skewed or wrong signature.
        """
        access_key, colon, signature = authorization[len(HEADER_PREFIX) :].strip().partition(":")
        if not colon or not access_key or not signature:
            raise s3_error(
                "InvalidArgument",
                "AWS authorization header is invalid. Expected AwsAccessKeyId:signature",
                fields={"ArgumentName": "Authorization"},
            )
        if "x-amz-security-token" in by_name:
            raise invalid_token()
        secret = self._secret_of(access_key)
        amz_date = _joined(by_name, "x-amz-date")
        date = _joined(by_name, "date")
        stamp = amz_date if amz_date is not None else date
        request_time = None if stamp is None else parse_request_time(stamp)
        if stamp is None or request_time is None:
            raise s3_error("AccessDenied", NO_DATE)
        check_skew(request_time, stamp, now=self._clock(), max_skew=self._max_skew)
        amz_headers = _canonical_amz_headers(by_name, [])
        head = f"{method}\n{_header(by_name, 'content-md5')}\n{_header(by_name, 'content-type')}\n"
        # S3 signs an empty Date when x-amz-date is sent; botocore signs its Date anyway.
        dates = [""] if amz_date is not None else [_header(by_name, "date")]
        if amz_date is not None and date is not None:
            dates.append(_header(by_name, "date"))
        strings = [
            f"{head}{date_line}\n{amz_headers}{resource}"
            for date_line in dates
            for resource in _canonical_resources(raw_path, query)
        ]
        _check(access_key, secret, strings, signature)
        return access_key

    def verify_query(
        self,
        method: str,
        raw_path: str,
        query: list[QueryParameter],
        by_name: dict[str, list[str]],
    ) -> str:
        """Verify a presigned URL's ``AWSAccessKeyId``, ``Signature`` and ``Expires``.

        Args:
            method: the HTTP method, as sent.
            raw_path: the path exactly as sent, without the query.
            query: the parameters of the query string.
            by_name: the headers, lowercased name -> every value sent.

        Returns:
            The access key id that signed.

        Raises:
            S3Error: parameters missing or repeated, unknown key, expired, too far
                ahead, or a wrong signature.
        """
        params: dict[str, str] = {}
        # What botocore moves from headers into a presigned URL's query.
        moved: list[tuple[str, str]] = []
        for parameter in query:
            name = parameter.name
            if name in QUERY_AUTH_PARAMS:
                if name in params:
                    raise s3_error(
                        "AuthorizationQueryParametersError",
                        f"{name} is given more than once; give it once.",
                    )
                # base64 has "+" but no space: a "+" sent raw is one of its own.
                params[name] = (
                    unquote(parameter.raw_value) if name == "Signature" else parameter.value
                )
            else:
                lowered = name.lower()
                if lowered.startswith("x-amz-") or lowered in ("content-type", "content-md5"):
                    moved.append((lowered, parameter.value))
        missing = [name for name in QUERY_AUTH_PARAMS if name not in params]
        if missing:
            raise s3_error(
                "AccessDenied",
                "Query-string authentication requires the Signature, Expires and "
                f"AWSAccessKeyId parameters; missing: {', '.join(missing)}",
            )
        access_key, signature, expires_text = (params[name] for name in QUERY_AUTH_PARAMS)
        expires = parse_expires(expires_text)
        if expires is None:
            raise s3_error(
                "AccessDenied",
                f"Invalid date (should be seconds since epoch): {capped(expires_text)}",
            )
        if "x-amz-security-token" in by_name or any(n == "x-amz-security-token" for n, _ in moved):
            raise invalid_token()
        secret = self._secret_of(access_key)
        now = self._clock()
        if now > expires:
            raise s3_error(
                "AccessDenied",
                "Request has expired",
                fields={"Expires": iso8601(expires), "ServerTime": iso8601(now)},
            )
        if expires - now > self._max_expires + self._max_skew:
            raise s3_error(
                "AuthorizationQueryParametersError",
                f"Expires must be at most {int(self._max_expires)} seconds from now (S3's "
                f"limit for presigned URLs is a week); it is {expires_text}, "
                f"{int(expires - now)} seconds from now. Presign the URL again with a "
                "shorter expiry.",
            )
        in_query = dict(moved)
        content_md5 = in_query.get("content-md5", _header(by_name, "content-md5"))
        content_type = in_query.get("content-type", _header(by_name, "content-type"))
        head = (
            f"{method}\n{content_md5}\n{content_type}\n{expires_text}\n"
            + _canonical_amz_headers(by_name, moved)
        )
        strings = [head + resource for resource in _canonical_resources(raw_path, query)]
        _check(access_key, secret, strings, signature)
        return access_key


def _check(access_key: str, secret: Secret, strings: list[str], signature: str) -> None:
    """Pass if ``signature`` signs one of ``strings``; the error shows the first."""
    for string_to_sign in strings:
        check_signed_text(string_to_sign, "StringToSign")
    provided = signature.encode("utf-8", "surrogateescape")
    key = secret.reveal().encode("utf-8")
    for string_to_sign in strings:
        digest = hmac.new(
            key, string_to_sign.encode("utf-8", "surrogateescape"), hashlib.sha1
        ).digest()
        if hmac.compare_digest(base64.b64encode(digest), provided):
            return
    raise signature_mismatch(access_key, signature, StringToSign=strings[0])


# -- canonical forms ---------------------------------------------------------------


def _canonical_amz_headers(by_name: dict[str, list[str]], moved: list[tuple[str, str]]) -> str:
    """``name:value\\n`` of every ``x-amz-*`` header (and of those moved into the
    query), sorted by name; values stripped and joined with ``,`` as botocore does."""
    values: dict[str, list[str]] = {}
    for name, value in moved:
        if name.startswith("x-amz-"):
            values.setdefault(name, []).append(value)
    for name, sent in by_name.items():
        if name.startswith("x-amz-"):
            values.setdefault(name, []).extend(sent)
    return "".join(
        f"{name}:{','.join(v.strip() for v in values[name])}\n" for name in sorted(values)
    )


def _canonical_resources(raw_path: str, query: list[QueryParameter]) -> list[str]:
    """The CanonicalizedResource: the path as sent, and ``?`` and the sub-resources
    if the query has any.

    The path of a bucket alone has two forms: ``/bucket/`` (S3's, and what botocore
    signs for ``GET /bucket?list-type=2``) first, and ``/bucket`` as sent.
    """
    path = raw_path or "/"
    paths = [path]
    if path.count("/") == 1 and path != "/":
        paths.insert(0, path + "/")
    subresources = []
    for parameter in query:
        name = parameter.name
        if name in SUBRESOURCES:
            text = f"{name}={parameter.value}" if parameter.has_value else name
            subresources.append((name, text))
    if not subresources:
        return paths
    # Sorted by name alone, repeats kept in the order sent, as botocore sorts them.
    subresources.sort(key=lambda pair: pair[0])
    suffix = "?" + "&".join(text for _, text in subresources)
    return [path + suffix for path in paths]


# -- parsing -----------------------------------------------------------------------


def _joined(by_name: dict[str, list[str]], name: str) -> str | None:
    values = by_name.get(name)
    return None if values is None else ",".join(values)


def _header(by_name: dict[str, list[str]], name: str) -> str:
    """A standard header's line: its value stripped, '' when it is not sent."""
    values = by_name.get(name)
    return "" if values is None else ",".join(v.strip() for v in values)
