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
way (the path with ``+`` kept, the query with ``+`` as a space: the verifier's own
reading is :func:`chunkd.gateway.s3front.querystring.decoded_query`), so that what
is served is what was signed.

The payload hash (``x-amz-content-sha256``) goes into the canonical request as
sent; checking it against the body is the business of whoever reads a body.

What a request can make the verifier do is bounded: ``SignedHeaders`` must be as
signers write it (lowercase, sorted, each name once, at most
:data:`MAX_SIGNED_HEADERS`), a canonical request past
:data:`~chunkd.gateway.s3front.refusals.MAX_SIGNED_TEXT` is refused unhashed, and
what a ``SignatureDoesNotMatch`` tells back is capped
(:mod:`chunkd.gateway.s3front.refusals`).

SigV2 (HMAC-SHA1) is checked too, against the same keys, by
:mod:`chunkd.gateway.s3front.sigv2`: an ``Authorization: AWS AKID:signature``
header, and a presigned URL with ``AWSAccessKeyId``, ``Signature`` and ``Expires``
(what boto3's ``generate_presigned_url`` makes with its default config).
:meth:`SigV4Verifier.verify` tells the four forms apart; a request that carries
more than one (a header and a signed query, or both query forms) is refused with
``InvalidArgument``.

It is one job at ~680 lines: checking one algorithm's signature, in its two forms, from
the request as it came over the wire: parse the ``Authorization`` header or the
``X-Amz-*`` query, rebuild the canonical request and the string to sign, derive (and
cache) the signing key, compare. Its parts are steps of that one algorithm, each with
S3's own refusal; what SigV4 and SigV2 share (a request's time, the query as signed,
bounded refusals) is already in rooms beside it, and SigV2 is a room of its own.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Final
from urllib.parse import quote_from_bytes, unquote_to_bytes

from chunkd.gateway.s3front import sigv2
from chunkd.gateway.s3front.errors import S3Error, s3_error
from chunkd.gateway.s3front.querystring import QueryParameter, parse_query
from chunkd.gateway.s3front.refusals import (
    capped,
    check_signed_text,
    invalid_token,
    signature_mismatch,
)
from chunkd.gateway.s3front.requesttime import (
    NO_DATE,
    amz_date_of,
    check_skew,
    iso8601,
    parse_amz_date,
    parse_expires,
    parse_http_date,
)

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

#: the most headers one request may sign: a client signs a dozen, and each name
#: signed is a line of the canonical request
MAX_SIGNED_HEADERS: Final = 64

_HEX: Final = frozenset("0123456789abcdefABCDEF")

_UNSUPPORTED_MECHANISM: Final = (
    "The authorization mechanism you have provided is not supported. Please use AWS4-HMAC-SHA256."
)
_THREE_COMPONENTS: Final = (
    "The authorization header is malformed; the authorization header requires "
    "three components: Credential, SignedHeaders, and Signature."
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
        sigv2_allowed: bool = True,
    ) -> None:
        self._keys = keys  # looked up per request: a live mapping may change
        self._sigv2_allowed = sigv2_allowed
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
        query = parse_query(raw_query)
        v4_query = v2_query = False
        for parameter in query:
            v4_query = v4_query or parameter.name in _QUERY_SIGNS
            v2_query = v2_query or parameter.name in sigv2.QUERY_SIGNS
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
                self._check_sigv2_allowed()
                access_key = self._v2.verify_header(
                    method, raw_path, query, by_name, authorization[0]
                )
                return Identity(access_key, presigned=False)
            return self._verify_header(method, raw_path, query, by_name, authorization[0])
        if v4_query and v2_query:
            raise _mixed("X-Amz-Algorithm")
        if v2_query:
            self._check_sigv2_allowed()
            access_key = self._v2.verify_query(method, raw_path, query, by_name)
            return Identity(access_key, presigned=True)
        if v4_query:
            return self._verify_query(method, raw_path, query, by_name)
        return None

    def _check_sigv2_allowed(self) -> None:
        if not self._sigv2_allowed:
            raise s3_error(
                "InvalidRequest",
                "SigV2 signatures are turned off on this front ([s3_front] sigv2 = false); "
                "sign with AWS4-HMAC-SHA256 (boto3: Config(signature_version='s3v4'))",
            )

    # -- the Authorization header --------------------------------------------

    def _verify_header(
        self,
        method: str,
        raw_path: str,
        query: list[QueryParameter],
        by_name: dict[str, list[str]],
        authorization: str,
    ) -> Identity:
        scope, signed_names, signature = _parse_authorization(authorization)
        names = _check_signed_names(signed_names, _header_error)
        if "x-amz-security-token" in by_name:
            raise invalid_token()
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
        check_skew(request_time, amz_date, now=self._clock(), max_skew=self._max_skew)
        canonical_request = _canonical_request(
            method, raw_path, query, by_name, names, payload_hash, presigned=False
        )
        self._check(scope, secret, amz_date, canonical_request, signature)
        return Identity(scope.access_key, presigned=False)

    # -- presigned URLs -------------------------------------------------------

    def _verify_query(
        self,
        method: str,
        raw_path: str,
        query: list[QueryParameter],
        by_name: dict[str, list[str]],
    ) -> Identity:
        params: dict[str, str] = {}
        token = False
        for parameter in query:
            if parameter.name in QUERY_AUTH_PARAMS:
                if parameter.name in params:
                    raise _query_error(f"{parameter.name} is given more than once; give it once.")
                params[parameter.name] = parameter.value
            elif parameter.name == "X-Amz-Security-Token":
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
        request_time = parse_amz_date(amz_date)
        if request_time is None:
            raise _query_error(
                "X-Amz-Date must be in the ISO8601 Long Format \"yyyyMMdd'T'HHmmss'Z'\""
            )
        expires_text = params["X-Amz-Expires"]
        expires = parse_expires(expires_text)
        if expires is None:
            raise _query_error("X-Amz-Expires should be a number")
        if not 1 <= expires <= self._max_expires:
            raise _query_error(
                f"X-Amz-Expires must be between 1 and {int(self._max_expires)} seconds "
                f"(S3's limit is a week); it is {expires}"
            )
        if token:
            raise invalid_token()
        if scope.date != amz_date[:8]:
            raise _query_error(
                f"Invalid credential date. Date {scope.date} is not the same as "
                f"X-Amz-Date {amz_date[:8]}."
            )
        names = _check_signed_names(params["X-Amz-SignedHeaders"], _query_error)
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
                    "Expires": iso8601(request_time + expires),
                    "ServerTime": iso8601(now),
                },
            )
        payload_hash = UNSIGNED_PAYLOAD
        for parameter in query:
            if parameter.name == "X-Amz-Content-Sha256":
                payload_hash = parameter.value
                break
        else:
            header_hash = _single(by_name, "x-amz-content-sha256")
            if header_hash is not None and "x-amz-content-sha256" in names:
                payload_hash = header_hash
        canonical_request = _canonical_request(
            method, raw_path, query, by_name, names, payload_hash, presigned=True
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
                fields={"AWSAccessKeyId": capped(access_key)},
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
            raise signature_mismatch(
                scope.access_key,
                signature,
                StringToSign=string_to_sign,
                CanonicalRequest=canonical_request,
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
    return (
        _parse_credential(parts["Credential"], _header_error),
        parts["SignedHeaders"],
        parts["Signature"],
    )


def _parse_credential(credential: str, error: Callable[[str], S3Error]) -> _Scope:
    parts = credential.rsplit("/", 4)
    if len(parts) != 5 or not parts[0]:
        raise error(
            'the Credential is mal-formed; expecting "<YOUR-AKID>/YYYYMMDD/REGION/'
            'SERVICE/aws4_request".'
        )
    access_key, date, region, service, terminator = parts
    if len(date) != 8 or not (date.isascii() and date.isdigit()):
        raise error(f"Invalid credential date {capped(date)!r}; expecting YYYYMMDD.")
    if service != SERVICE:
        raise error(f"incorrect service {capped(service)!r}. This endpoint belongs to 's3'.")
    if terminator != TERMINATOR:
        raise error(
            f"incorrect terminal {capped(terminator)!r}. This endpoint uses 'aws4_request'."
        )
    return _Scope(access_key, date, region)


def _check_signed_names(signed_names: str, error: Callable[[str], S3Error]) -> list[str]:
    """The names of ``SignedHeaders``, checked to be as SigV4 signers write them.

    Each is lowercase, named once, and the list is sorted: the canonical request
    holds them in this order, one line each. Anything else is refused before it is
    built, so a list that repeats a name thousands of times costs no canonical
    request of thousands of lines (of what could be a long header each).
    """
    names = signed_names.split(";")
    if len(names) > MAX_SIGNED_HEADERS:
        raise error(
            f"SignedHeaders names {len(names)} headers, more than the {MAX_SIGNED_HEADERS} "
            "this endpoint takes; sign fewer headers."
        )
    if not all(names):
        raise error(f"SignedHeaders {capped(signed_names)!r} holds an empty header name.")
    if signed_names != signed_names.lower() or any(a >= b for a, b in pairwise(names)):
        raise error(
            f"SignedHeaders {capped(signed_names)!r} is not as SigV4 signs it: header "
            "names in lowercase, sorted, each once, separated by ';'."
        )
    if "host" not in names:
        raise s3_error(
            "AccessDenied",
            "The host header must be signed: SignedHeaders does not name it.",
        )
    return names


def _request_time(by_name: dict[str, list[str]]) -> tuple[str, float]:
    """The ``x-amz-date`` (or ``Date`` made one) of the request, and its time."""
    amz_date = _single(by_name, "x-amz-date")
    if amz_date is not None:
        request_time = parse_amz_date(amz_date)
        if request_time is None:
            raise s3_error("AccessDenied", NO_DATE)
        return amz_date, request_time
    date = _single(by_name, "date")
    request_time = None if date is None else parse_http_date(date)
    if request_time is None:
        raise s3_error("AccessDenied", NO_DATE)
    return amz_date_of(request_time), request_time


def _is_sha256_hex(value: str) -> bool:
    return len(value) == 64 and set(value) <= _HEX


# -- canonical forms ---------------------------------------------------------------


def _canonical_request(
    method: str,
    raw_path: str,
    query: list[QueryParameter],
    by_name: dict[str, list[str]],
    names: list[str],
    payload_hash: str,
    *,
    presigned: bool,
) -> str:
    """The canonical request: what the signature signs (through its hash).

    Raises:
        S3Error: ``InvalidRequest`` if it is longer than ``MAX_SIGNED_TEXT``.
    """
    canonical_request = "\n".join(
        (
            method,
            _canonical_uri(raw_path),
            # A presigned URL's signature is in the query it signs: left out.
            _canonical_query(query, drop_signature=presigned),
            _canonical_headers(names, by_name),
            ";".join(names),
            payload_hash,
        )
    )
    check_signed_text(canonical_request, "canonical request")
    return canonical_request


def _canonical_uri(raw_path: str) -> str:
    """``raw_path`` decoded once and encoded strictly, ``/`` kept, not normalised.

    Decoding works on bytes, so an escape that is not UTF-8 survives; an invalid
    escape (``%zz``) is kept as text, its ``%`` then encoded as ``%25``.
    """
    if not raw_path:
        return "/"
    return quote_from_bytes(unquote_to_bytes(raw_path.encode("utf-8", "surrogateescape")), safe="/")


def _encode_component(raw: str) -> str:
    return quote_from_bytes(
        unquote_to_bytes(raw.replace("+", " ").encode("utf-8", "surrogateescape")), safe=""
    )


def _canonical_query(query: list[QueryParameter], *, drop_signature: bool) -> str:
    pairs = sorted(
        (_encode_component(parameter.raw_name), _encode_component(parameter.raw_value))
        for parameter in query
        if not (drop_signature and parameter.name == "X-Amz-Signature")
    )
    return "&".join(f"{name}={value}" for name, value in pairs)


def _canonical_headers(names: list[str], by_name: dict[str, list[str]]) -> str:
    """``name:value`` lines of the signed headers, each ending in a newline.

    A signed header the request does not carry has no line: S3 takes such a
    request (libs3 signs ``transfer-encoding`` it never sends), and the signature
    still decides, since its signer either gave the line or did not. An
    ``x-amz-*`` header carried but not signed is refused, as S3 refuses it: it
    could change what the request means (``x-amz-copy-source``) without
    breaking the signature. ``x-amz-content-sha256`` alone may ride unsigned, as
    S3 allows: it is the payload hash line of a header-signed request anyway.
    """
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
