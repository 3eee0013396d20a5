"""AWS Signature Version 4 verification for the S3 front, and the door to SigV2's.

Every signed request is checked against the secret of the access key that signed
it: the verifier rebuilds the canonical request from what came over the wire,
derives the signing key from the configured secret and compares signatures in
constant time. Two SigV4 forms are accepted, as S3 accepts them:

1. The ``Authorization`` header: ``AWS4-HMAC-SHA256 Credential=AKID/YYYYMMDD/
   REGION/s3/aws4_request, SignedHeaders=host;x-amz-date, Signature=<hex>``, with
   ``x-amz-date`` (or ``Date``) and ``x-amz-content-sha256`` headers.
2. A presigned URL: ``X-Amz-Algorithm``, ``X-Amz-Credential``, ``X-Amz-Date``,
   ``X-Amz-Expires``, ``X-Amz-SignedHeaders`` and ``X-Amz-Signature`` in the query.

The region of the credential scope is taken as the client gives it: a region is
no secret, and clients differ in the one they default to (``us-east-1``,
``auto``, the one in ``~/.aws/config``). The signature is checked with it, so a
client signs correctly whatever region it was told.

Canonicalisation follows S3 (not the other AWS services): the path is
percent-decoded once and re-encoded strictly, with no ``//`` or ``..``
normalisation, since S3 keys may hold them. In the query a ``+`` is a space, as
S3 reads it and as object_store (obstore, polars) sends one; botocore and the AWS
C++ SDK (pyarrow) send ``%20`` and ``%2B`` and canonicalise the same either way.
Whoever reads the request's key and query parameters must decode them the same
way (the path with ``+`` kept, the query with ``+`` as a space), so that what is
served is what was signed.

The payload hash (``x-amz-content-sha256``) goes into the canonical request as
sent; checking it against the body is the business of whoever reads a body.

SigV2 (HMAC-SHA1) is checked too, against the same keys, by
:mod:`chunkd.gateway.s3front.sigv2`: an ``Authorization: AWS AKID:signature``
header, and a presigned URL with ``AWSAccessKeyId``, ``Signature`` and ``Expires``
(what boto3's ``generate_presigned_url`` makes with its default config).
:meth:`SigV4Verifier.verify` tells the four forms apart; a request that carries
more than one (a header and a signed query, or both query forms) is refused with
``InvalidArgument``.
"""

from __future__ import annotations

import calendar
import hashlib
import hmac
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Final
from urllib.parse import quote_from_bytes, unquote, unquote_to_bytes

from chunkd.gateway.s3front import sigv2
from chunkd.gateway.s3front.errors import S3Error, s3_error

if TYPE_CHECKING:
    from chunkd.gateway.config.values import Secret

__all__ = ["Identity", "SigV4Verifier"]

ALGORITHM: Final = "AWS4-HMAC-SHA256"
SERVICE: Final = "s3"
TERMINATOR: Final = "aws4_request"
UNSIGNED_PAYLOAD: Final = "UNSIGNED-PAYLOAD"

#: the payload hashes that are no sha256: what current SDKs send for unsigned,
#: streamed (aws-chunked) and trailer-checksummed bodies
PAYLOAD_HASH_WORDS: Final = frozenset(
    {
        UNSIGNED_PAYLOAD,
        "STREAMING-UNSIGNED-PAYLOAD-TRAILER",
        "STREAMING-AWS4-HMAC-SHA256-PAYLOAD",
        "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER",
    }
)

#: the query parameters of a presigned URL, all required
QUERY_AUTH_PARAMS: Final = (
    "X-Amz-Algorithm",
    "X-Amz-Credential",
    "X-Amz-Date",
    "X-Amz-Expires",
    "X-Amz-SignedHeaders",
    "X-Amz-Signature",
)

#: a query parameter that makes a request presigned (or a broken attempt at one)
_QUERY_SIGNS: Final = frozenset({"X-Amz-Algorithm", "X-Amz-Credential", "X-Amz-Signature"})

#: signing keys derived and kept, one per (access key, date, region)
SIGNING_KEY_CACHE_SIZE: Final = 256

#: an Authorization header longer than this is refused unread
MAX_AUTHORIZATION_LENGTH: Final = 8192

_HEX: Final = frozenset("0123456789abcdefABCDEF")
_DIGITS: Final = frozenset("0123456789")

_UNSUPPORTED_MECHANISM: Final = (
    "The authorization mechanism you have provided is not supported. Please use AWS4-HMAC-SHA256."
)
_THREE_COMPONENTS: Final = (
    "The authorization header is malformed; the authorization header requires "
    "three components: Credential, SignedHeaders, and Signature."
)
_NO_DATE: Final = "AWS authentication requires a valid Date or x-amz-date header"
_MISMATCH: Final = (
    "The request signature we calculated does not match the signature you provided. "
    "Check your key and signing method."
)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who signed a request that verified.

    Attributes:
        access_key: the access key id that signed ("" for an anonymous request,
            an Identity the door makes itself: the verifier returns None).
        presigned: whether the signature came in the query (a presigned URL)
            rather than in the ``Authorization`` header.
    """

    access_key: str
    presigned: bool


@dataclass(frozen=True, slots=True)
class _Scope:
    """The parts of ``AKID/YYYYMMDD/REGION/s3/aws4_request``."""

    access_key: str
    date: str
    region: str

    @property
    def text(self) -> str:
        return f"{self.date}/{self.region}/{SERVICE}/{TERMINATOR}"


class SigV4Verifier:
    """Checks the SigV4 (and SigV2) signature of S3 requests against configured secrets.

    One instance serves every request; it holds the keys and a bounded cache of
    derived signing keys, and does no I/O, so :meth:`verify` is called on the
    event loop. A SigV2 request is handed to a
    :class:`~chunkd.gateway.s3front.sigv2.SigV2Verifier` that shares the keys,
    the clock and the limits.

    Args:
        keys: access key id -> secret access key.
        max_skew: how far, in seconds, a header-signed request's time may be from
            the server's (S3's own is 15 minutes); a presigned URL may be dated
            at most this far in the future.
        max_expires: the longest ``X-Amz-Expires`` accepted, in seconds (S3's is
            a week); a SigV2 URL's ``Expires`` may be at most this far (and
            ``max_skew``) ahead.
        clock: the current time, in seconds since the epoch.
    """

    def __init__(
        self,
        keys: Mapping[str, Secret],
        *,
        max_skew: float = 900.0,
        max_expires: float = 604800.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._keys = keys  # looked up per request: a live mapping may change
        self._max_skew = max_skew
        self._max_expires = max_expires
        self._clock = clock
        self._signing_keys: OrderedDict[tuple[str, str, str, str], bytes] = OrderedDict()
        self._v2 = sigv2.SigV2Verifier(
            self._secret, max_skew=max_skew, max_expires=max_expires, clock=clock
        )

    @property
    def signing_keys_cached(self) -> int:
        """How many derived signing keys are held (at most ``SIGNING_KEY_CACHE_SIZE``)."""
        return len(self._signing_keys)

    def verify(
        self,
        method: str,
        raw_path: str,
        raw_query: str,
        headers: Mapping[str, str],
    ) -> Identity | None:
        """Verify the signature of one request.

        Args:
            method: the HTTP method, as sent (``GET``).
            raw_path: the request target's path exactly as sent on the wire,
                percent-encoded, without the query (aiohttp's ``raw_path`` up to
                its ``?``).
            raw_query: the raw query string after ``?`` ('' if none).
            headers: the request headers; a multidict's repeated headers are all
                read (``items()`` gives every one).

        Returns:
            Who signed, or None when the request carries no signature at all (no
            ``Authorization`` header, no ``X-Amz-Algorithm``, ``X-Amz-Credential``,
            ``X-Amz-Signature``, ``AWSAccessKeyId`` or ``Signature`` query
            parameter): whether anonymous requests are allowed is the door's
            decision.

        Raises:
            S3Error: the request is signed, and the signature is malformed,
                unknown, expired, skewed or wrong (``SignatureDoesNotMatch``), or
                it is signed in more than one way (``InvalidArgument``).
        """
        by_name = _headers_by_name(headers.items())
        authorization = by_name.get("authorization")
        query = _parse_query(raw_query) if raw_query else []
        v4_query = v2_query = False
        for name, _, _ in query:
            v4_query = v4_query or name in _QUERY_SIGNS
            v2_query = v2_query or name in sigv2.QUERY_SIGNS
        if authorization is not None:
            if v4_query or v2_query:
                raise _mixed("Authorization")
            if len(authorization) != 1:
                raise s3_error(
                    "AuthorizationHeaderMalformed",
                    "The authorization header is malformed; a request carries one "
                    "Authorization header, this one has several.",
                )
            if len(authorization[0]) > MAX_AUTHORIZATION_LENGTH:
                raise _header_error(
                    f"it is {len(authorization[0])} characters long, more than the "
                    f"{MAX_AUTHORIZATION_LENGTH} any client sends."
                )
            if authorization[0].startswith(sigv2.HEADER_PREFIX):
                access_key = self._v2.verify_header(
                    method, raw_path, raw_query, by_name, authorization[0]
                )
                return Identity(access_key, presigned=False)
            return self._verify_header(method, raw_path, query, by_name, authorization[0])
        if v4_query and v2_query:
            raise _mixed("X-Amz-Algorithm")
        if v2_query:
            access_key = self._v2.verify_query(method, raw_path, raw_query, by_name)
            return Identity(access_key, presigned=True)
        if v4_query:
            return self._verify_query(method, raw_path, query, by_name)
        return None

    # -- the Authorization header --------------------------------------------

    def _verify_header(
        self,
        method: str,
        raw_path: str,
        query: list[tuple[str, str, str]],
        by_name: dict[str, list[str]],
        authorization: str,
    ) -> Identity:
        scope, signed_names, signature = _parse_authorization(authorization)
        if "x-amz-security-token" in by_name:
            raise _invalid_token()
        amz_date, request_time = _request_time(by_name)
        payload_hash = _single(by_name, "x-amz-content-sha256")
        if payload_hash is None:
            raise s3_error(
                "InvalidRequest",
                "Missing required header for this request: x-amz-content-sha256",
            )
        if payload_hash not in PAYLOAD_HASH_WORDS and not _is_sha256_hex(payload_hash):
            raise s3_error(
                "InvalidArgument",
                "x-amz-content-sha256 must be UNSIGNED-PAYLOAD, "
                "STREAMING-UNSIGNED-PAYLOAD-TRAILER, STREAMING-AWS4-HMAC-SHA256-PAYLOAD, "
                "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER or a valid sha256 value.",
                fields={"ArgumentName": "x-amz-content-sha256"},
            )
        if scope.date != amz_date[:8]:
            raise s3_error(
                "AuthorizationHeaderMalformed",
                "The authorization header is malformed; Invalid credential date. "
                f"Date {scope.date} is not the same as X-Amz-Date {amz_date[:8]}.",
            )
        secret = self._secret(scope.access_key)
        now = self._clock()
        if abs(now - request_time) > self._max_skew:
            raise s3_error(
                "RequestTimeTooSkewed",
                "The difference between the request time and the current time is too large.",
                fields={
                    "RequestTime": amz_date,
                    "ServerTime": _iso8601(now),
                    "MaxAllowedSkewMilliseconds": str(round(self._max_skew * 1000)),
                },
            )
        canonical_headers = _canonical_headers(signed_names, by_name)
        canonical_request = "\n".join(
            (
                method,
                _canonical_uri(raw_path),
                _canonical_query(query, drop_signature=False),
                canonical_headers,
                signed_names,
                payload_hash,
            )
        )
        self._check(scope, secret, amz_date, canonical_request, signature)
        return Identity(scope.access_key, presigned=False)

    # -- presigned URLs -------------------------------------------------------

    def _verify_query(
        self,
        method: str,
        raw_path: str,
        query: list[tuple[str, str, str]],
        by_name: dict[str, list[str]],
    ) -> Identity:
        params: dict[str, str] = {}
        token = False
        for name, _, raw_value in query:
            if name in QUERY_AUTH_PARAMS:
                if name in params:
                    raise _query_error(f"{name} is given more than once; give it once.")
                params[name] = _decode(raw_value)
            elif name == "X-Amz-Security-Token":
                token = True
        missing = [name for name in QUERY_AUTH_PARAMS if name not in params]
        if missing:
            raise _query_error(
                "Query-string authentication version 4 requires the X-Amz-Algorithm, "
                "X-Amz-Credential, X-Amz-Signature, X-Amz-Date, X-Amz-SignedHeaders, "
                f"and X-Amz-Expires parameters; missing: {', '.join(missing)}."
            )
        if params["X-Amz-Algorithm"] != ALGORITHM:
            raise _query_error('X-Amz-Algorithm only supports "AWS4-HMAC-SHA256"')
        scope = _parse_credential(params["X-Amz-Credential"], _query_error)
        amz_date = params["X-Amz-Date"]
        request_time = _parse_amz_date(amz_date)
        if request_time is None:
            raise _query_error(
                "X-Amz-Date must be in the ISO8601 Long Format \"yyyyMMdd'T'HHmmss'Z'\""
            )
        expires_text = params["X-Amz-Expires"]
        # Ten digits are more than any expiry; more are not read (int() of thousands
        # of digits is slow, and refused past 4300).
        if not expires_text or len(expires_text) > 10 or not set(expires_text) <= _DIGITS:
            raise _query_error("X-Amz-Expires should be a number")
        expires = int(expires_text)
        if not 1 <= expires <= self._max_expires:
            raise _query_error(
                f"X-Amz-Expires must be between 1 and {int(self._max_expires)} seconds "
                f"(S3's limit is a week); it is {expires}"
            )
        if token:
            raise _invalid_token()
        if scope.date != amz_date[:8]:
            raise _query_error(
                f"Invalid credential date. Date {scope.date} is not the same as "
                f"X-Amz-Date {amz_date[:8]}."
            )
        signed_names = params["X-Amz-SignedHeaders"]
        _check_signed_names(signed_names, _query_error)
        secret = self._secret(scope.access_key)
        now = self._clock()
        if request_time - now > self._max_skew:
            raise s3_error("AccessDenied", "Request is not valid yet")
        if now > request_time + expires:
            raise s3_error(
                "AccessDenied",
                "Request has expired",
                fields={
                    "X-Amz-Expires": expires_text,
                    "Expires": _iso8601(request_time + expires),
                    "ServerTime": _iso8601(now),
                },
            )
        payload_hash = UNSIGNED_PAYLOAD
        for name, _, raw_value in query:
            if name == "X-Amz-Content-Sha256":
                payload_hash = _decode(raw_value)
                break
        else:
            header_hash = _single(by_name, "x-amz-content-sha256")
            if header_hash is not None and "x-amz-content-sha256" in _lower_names(signed_names):
                payload_hash = header_hash
        canonical_request = "\n".join(
            (
                method,
                _canonical_uri(raw_path),
                _canonical_query(query, drop_signature=True),
                _canonical_headers(signed_names, by_name),
                signed_names,
                payload_hash,
            )
        )
        self._check(scope, secret, amz_date, canonical_request, params["X-Amz-Signature"])
        return Identity(scope.access_key, presigned=True)

    # -- both forms -----------------------------------------------------------

    def _secret(self, access_key: str) -> Secret:
        secret = self._keys.get(access_key)
        if secret is None:
            raise s3_error(
                "InvalidAccessKeyId",
                "The AWS Access Key Id you provided does not exist in our records.",
                fields={"AWSAccessKeyId": access_key},
            )
        return secret

    def _check(
        self,
        scope: _Scope,
        secret: Secret,
        amz_date: str,
        canonical_request: str,
        signature: str,
    ) -> None:
        string_to_sign = "\n".join(
            (
                ALGORITHM,
                amz_date,
                scope.text,
                hashlib.sha256(canonical_request.encode("utf-8", "surrogateescape")).hexdigest(),
            )
        )
        expected = hmac.new(
            self._signing_key(scope, secret),
            string_to_sign.encode("utf-8", "surrogateescape"),
            hashlib.sha256,
        ).hexdigest()
        if not hmac.compare_digest(
            expected.encode("ascii"), signature.encode("utf-8", "surrogateescape")
        ):
            raise s3_error(
                "SignatureDoesNotMatch",
                _MISMATCH,
                fields={
                    "AWSAccessKeyId": scope.access_key,
                    "StringToSign": string_to_sign,
                    "SignatureProvided": signature,
                    "CanonicalRequest": canonical_request,
                },
            )

    def _signing_key(self, scope: _Scope, secret: Secret) -> bytes:
        """The key of ``scope``: four HMACs, once per access key, day and region."""
        # The secret is part of the key: an access key given a new secret derives anew.
        cache_key = (scope.access_key, scope.date, scope.region, secret.reveal())
        key = self._signing_keys.get(cache_key)
        if key is not None:
            self._signing_keys.move_to_end(cache_key)
            return key
        key = ("AWS4" + secret.reveal()).encode("utf-8")
        for part in (scope.date, scope.region, SERVICE, TERMINATOR):
            key = hmac.new(key, part.encode("utf-8", "surrogateescape"), hashlib.sha256).digest()
        self._signing_keys[cache_key] = key
        if len(self._signing_keys) > SIGNING_KEY_CACHE_SIZE:
            self._signing_keys.popitem(last=False)
        return key


# -- parsing ---------------------------------------------------------------------


def _headers_by_name(items: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    by_name: dict[str, list[str]] = {}
    for name, value in items:
        by_name.setdefault(name.lower(), []).append(value)
    return by_name


def _single(by_name: dict[str, list[str]], name: str) -> str | None:
    values = by_name.get(name)
    return None if values is None else ",".join(values)


def _parse_authorization(value: str) -> tuple[_Scope, str, str]:
    """The credential scope, signed header names and signature of the header."""
    algorithm, _, rest = value.strip().partition(" ")
    if algorithm != ALGORITHM:
        raise s3_error("InvalidRequest", _UNSUPPORTED_MECHANISM)
    parts: dict[str, str] = {}
    for part in rest.split(","):
        name, equals, part_value = part.strip().partition("=")
        if not equals or name not in ("Credential", "SignedHeaders", "Signature"):
            raise s3_error("AuthorizationHeaderMalformed", _THREE_COMPONENTS)
        if name in parts:
            raise _header_error(f"{name} is given more than once.")
        parts[name] = part_value.strip()
    if len(parts) != 3:
        raise s3_error("AuthorizationHeaderMalformed", _THREE_COMPONENTS)
    scope = _parse_credential(parts["Credential"], _header_error)
    _check_signed_names(parts["SignedHeaders"], _header_error)
    return scope, parts["SignedHeaders"], parts["Signature"]


def _parse_credential(credential: str, error: Callable[[str], S3Error]) -> _Scope:
    parts = credential.rsplit("/", 4)
    if len(parts) != 5 or not parts[0]:
        raise error(
            'the Credential is mal-formed; expecting "<YOUR-AKID>/YYYYMMDD/REGION/'
            'SERVICE/aws4_request".'
        )
    access_key, date, region, service, terminator = parts
    if len(date) != 8 or not set(date) <= _DIGITS:
        raise error(f"Invalid credential date {date!r}; expecting YYYYMMDD.")
    if service != SERVICE:
        raise error(f"incorrect service {service!r}. This endpoint belongs to 's3'.")
    if terminator != TERMINATOR:
        raise error(f"incorrect terminal {terminator!r}. This endpoint uses 'aws4_request'.")
    return _Scope(access_key, date, region)


def _check_signed_names(signed_names: str, error: Callable[[str], S3Error]) -> None:
    names = _lower_names(signed_names)
    if not all(names):
        raise error(f"SignedHeaders {signed_names!r} holds an empty header name.")
    if "host" not in names:
        raise s3_error(
            "AccessDenied",
            "The host header must be signed: SignedHeaders does not name it.",
        )


def _lower_names(signed_names: str) -> list[str]:
    return signed_names.lower().split(";")


def _request_time(by_name: dict[str, list[str]]) -> tuple[str, float]:
    """The ``x-amz-date`` (or ``Date`` made one) of the request, and its time."""
    amz_date = _single(by_name, "x-amz-date")
    if amz_date is not None:
        request_time = _parse_amz_date(amz_date)
        if request_time is None:
            raise s3_error("AccessDenied", _NO_DATE)
        return amz_date, request_time
    date = _single(by_name, "date")
    if date is None:
        raise s3_error("AccessDenied", _NO_DATE)
    try:
        parsed = parsedate_to_datetime(date)
        # An RFC 7231 date is GMT; "-0000" (as botocore writes it) parses as naive.
        request_time = float(calendar.timegm(parsed.utctimetuple()))
    except (TypeError, ValueError, OverflowError, IndexError):
        raise s3_error("AccessDenied", _NO_DATE) from None
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(request_time)), request_time


def _parse_amz_date(value: str) -> float | None:
    """The time of ``YYYYMMDDTHHMMSSZ``, None if ``value`` is not one."""
    if len(value) != 16 or value[8] != "T" or value[15] != "Z":
        return None
    digits = value[:8] + value[9:15]
    if not set(digits) <= _DIGITS:
        return None
    fields = (
        int(value[0:4]),
        int(value[4:6]),
        int(value[6:8]),
        int(value[9:11]),
        int(value[11:13]),
        int(value[13:15]),
    )
    year, month, day, hour, minute, second = fields
    if not (1 <= month <= 12 and 1 <= day <= 31 and hour < 24 and minute < 60 and second < 61):
        return None
    return float(calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0)))


def _is_sha256_hex(value: str) -> bool:
    return len(value) == 64 and set(value) <= _HEX


# -- canonical forms ---------------------------------------------------------------


def _canonical_uri(raw_path: str) -> str:
    """``raw_path`` decoded once and encoded strictly, ``/`` kept, not normalised.

    Decoding works on bytes, so an escape that is not UTF-8 survives; an invalid
    escape (``%zz``) is kept as text, its ``%`` then encoded as ``%25``.
    """
    if not raw_path:
        return "/"
    return quote_from_bytes(unquote_to_bytes(raw_path.encode("utf-8", "surrogateescape")), safe="/")


def _parse_query(raw_query: str) -> list[tuple[str, str, str]]:
    """Each parameter of ``raw_query``: (decoded name, raw name, raw value)."""
    query = []
    for pair in raw_query.split("&"):
        if not pair:
            continue
        raw_name, _, raw_value = pair.partition("=")
        query.append((_decode(raw_name), raw_name, raw_value))
    return query


def _decode(raw: str) -> str:
    return unquote(raw.replace("+", " "))


def _encode_component(raw: str) -> str:
    return quote_from_bytes(
        unquote_to_bytes(raw.replace("+", " ").encode("utf-8", "surrogateescape")), safe=""
    )


def _canonical_query(query: list[tuple[str, str, str]], *, drop_signature: bool) -> str:
    pairs = sorted(
        (_encode_component(raw_name), _encode_component(raw_value))
        for name, raw_name, raw_value in query
        if not (drop_signature and name == "X-Amz-Signature")
    )
    return "&".join(f"{name}={value}" for name, value in pairs)


def _canonical_headers(signed_names: str, by_name: dict[str, list[str]]) -> str:
    """``name:value`` lines of the signed headers, each ending in a newline.

    A signed header the request does not carry has no line: S3 takes such a
    request (libs3 signs ``transfer-encoding`` it never sends), and the signature
    still decides, since its signer either gave the line or did not. An
    ``x-amz-*`` header carried but not signed is refused, as S3 refuses it: it
    could change what the request means (``x-amz-copy-source``) without
    breaking the signature. ``x-amz-content-sha256`` alone may ride unsigned, as
    S3 allows: it is the payload hash line of a header-signed request anyway.
    """
    names = _lower_names(signed_names)
    if "host" not in by_name:
        raise s3_error("AccessDenied", "The host header is signed but the request has none.")
    signed = set(names)
    unsigned = sorted(
        name
        for name in by_name
        if name.startswith("x-amz-") and name not in signed and name != "x-amz-content-sha256"
    )
    if unsigned:
        raise s3_error(
            "AccessDenied",
            "There were headers present in the request which were not signed",
            fields={"HeadersNotSigned": ", ".join(unsigned)},
        )
    lines = []
    for name in names:
        values = by_name.get(name)
        if values is not None:
            # Trimall: no leading or trailing space, runs of spaces made one.
            lines.append(f"{name}:{','.join(' '.join(v.split()) for v in values)}\n")
    return "".join(lines)


# -- errors ------------------------------------------------------------------------


def _header_error(what: str) -> S3Error:
    return s3_error(
        "AuthorizationHeaderMalformed", f"The authorization header is malformed; {what}"
    )


def _mixed(argument: str) -> S3Error:
    return s3_error(
        "InvalidArgument",
        "Only one auth mechanism allowed; only the X-Amz-Algorithm query "
        "parameter, Signature query string parameter or the Authorization "
        "header should be specified",
        fields={"ArgumentName": argument},
    )


def _query_error(what: str) -> S3Error:
    return s3_error("AuthorizationQueryParametersError", what)


def _invalid_token() -> S3Error:
    return s3_error(
        "InvalidToken",
        "The provided token is malformed or otherwise invalid: this endpoint issues no "
        "session tokens; sign with an access key and secret alone.",
    )


def _iso8601(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))
