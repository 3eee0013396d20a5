"""The S3 front's SigV4 verifier: requests signed by real clients verify, others do not.

The signer is always a real one: botocore's own ``S3SigV4Auth`` and
``S3SigV4QueryAuth`` (what boto3, s3fs and the AWS CLI use), boto3's presigned URLs,
and, over a real socket, boto3, obstore (object_store, as polars uses it) and
pyarrow's ``S3FileSystem`` (the AWS C++ SDK) talking to a small aiohttp server whose
handler runs the verifier.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field, replace
from urllib.parse import quote, urlsplit
from xml.sax.saxutils import escape

import boto3
import botocore.auth
import obstore
import pytest
import s3fs
from aiohttp import ClientSession, web
from botocore.auth import S3SigV4Auth, S3SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from botocore.exceptions import ClientError
from botocore.utils import percent_encode_sequence
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy
from obstore.store import S3Store
from pyarrow import fs as pafs
from yarl import URL

from chunkd.gateway.config.values import Secret
from chunkd.gateway.s3front.errors import STATUS, S3Error
from chunkd.gateway.s3front.querystring import decoded_query
from chunkd.gateway.s3front.refusals import MAX_SHOWN, MAX_SIGNED_TEXT
from chunkd.gateway.s3front.sigv4 import (
    MAX_SIGNED_HEADERS,
    SIGNING_KEY_CACHE_SIZE,
    Identity,
    SigV4Verifier,
)
from chunkd.gateway.s3front.xml import error_document

KEY = "AKIDCHUNKDTEST01"
SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCY=chunkd-test-secret"
OTHER_KEY = "AKIDCHUNKDTEST02"
OTHER_SECRET = "an0ther/secret+for=the-second-key"
ALL_SECRETS = (SECRET, OTHER_SECRET)
HOST = "127.0.0.1:9000"
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
ENDPOINT = f"http://{HOST}"

#: S3 keys that clients encode in every way S3 allows
AWKWARD_KEYS = [
    "plain.txt",
    "with space/and  two  spaces",
    "unicode/é/日本語/🙂.bin",
    "plus+sign+key",
    "percent%41%literal%",
    "tilde~key",
    "equals=and&amp",
    "double//slash///x",
    "dot/../segments/./x",
    "..",
    "./.",
    "semi;colon,comma!*'()$@:[]",
    "trailing/",
    "question?mark#hash",
    "tab\tand\nnewline",
]


@dataclass(frozen=True)
class Wire:
    """One request as the front receives it."""

    method: str
    path: str
    query: str
    headers: CIMultiDict[str] = field(default_factory=CIMultiDict)


def verifier(clock: Callable[[], float] = time.time) -> SigV4Verifier:
    return SigV4Verifier({KEY: Secret(SECRET), OTHER_KEY: Secret(OTHER_SECRET)}, clock=clock)


def object_target(key: str, bucket: str = "bkt") -> str:
    # As botocore's rest-xml serializer writes a greedy label.
    return f"/{bucket}/{quote(key, safe='/~')}"


def wire_of(request: AWSRequest, extra: Iterable[tuple[str, str]] = ()) -> Wire:
    """What an HTTP client sends for ``request``: its headers, ``Host`` and more."""
    url = urlsplit(request.prepare().url)
    headers: CIMultiDict[str] = CIMultiDict(request.headers.items())
    if "Host" not in headers:
        headers["Host"] = url.netloc
    headers.add("User-Agent", "Botocore/1.0 test")
    headers.add("Accept-Encoding", "identity")
    headers.extend(extra)
    return Wire(request.method, url.path, url.query, headers)


class FixedPayloadAuth(S3SigV4Auth):
    """botocore's S3 signer with the payload hash given (streamed uploads, unsigned)."""

    def __init__(self, credentials: Credentials, region: str, payload_hash: str) -> None:
        super().__init__(credentials, "s3", region)
        self._payload_hash = payload_hash

    def payload(self, request: AWSRequest) -> str:
        return self._payload_hash


def sign(
    method: str,
    target: str,
    *,
    headers: dict[str, str] | None = None,
    key: str = KEY,
    secret: str = SECRET,
    token: str | None = None,
    region: str = "us-east-1",
    payload_hash: str | None = None,
    context: dict[str, object] | None = None,
) -> Wire:
    request = AWSRequest(method=method, url=ENDPOINT + target, headers=headers or {})
    request.context.update(context or {})
    credentials = Credentials(key, secret, token)
    if payload_hash is None:
        S3SigV4Auth(credentials, "s3", region).add_auth(request)
    else:
        FixedPayloadAuth(credentials, region, payload_hash).add_auth(request)
    return wire_of(request)


def presign(
    method: str,
    target: str,
    *,
    expires: int = 300,
    key: str = KEY,
    secret: str = SECRET,
    token: str | None = None,
    region: str = "us-east-1",
) -> Wire:
    request = AWSRequest(method=method, url=ENDPOINT + target)
    S3SigV4QueryAuth(Credentials(key, secret, token), "s3", region, expires=expires).add_auth(
        request
    )
    url = urlsplit(request.prepare().url)
    return Wire(method, url.path, url.query, CIMultiDict({"Host": url.netloc}))


def boto3_client(secret: str = SECRET, endpoint: str = "http://127.0.0.1:1", **config: object):
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=KEY,
        aws_secret_access_key=secret,
        config=Config(
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            retries={"max_attempts": 1, "mode": "standard"},
            **config,
        ),
    )


def presigned_url(operation: str, params: dict[str, str], expires: int = 300) -> Wire:
    url = urlsplit(boto3_client().generate_presigned_url(operation, params, ExpiresIn=expires))
    return Wire("GET", url.path, url.query, CIMultiDict({"Host": url.netloc}))


def passes(wire: Wire, v: SigV4Verifier | None = None, key: str = KEY) -> Identity:
    identity = (v or verifier()).verify(wire.method, wire.path, wire.query, wire.headers)
    assert identity is not None
    assert identity.access_key == key
    return identity


def refuse(wire: Wire, code: str, v: SigV4Verifier | None = None) -> S3Error:
    """The S3Error of ``wire``, checked to be ``code`` and to hold no secret."""
    with pytest.raises(S3Error) as caught:
        (v or verifier()).verify(wire.method, wire.path, wire.query, wire.headers)
    error = caught.value
    assert error.code == code, (error.code, error.message)
    shown = " ".join(
        [error.message, str(error), repr(error), *error.fields.values(), *error.headers.values()]
    )
    for secret in ALL_SECRETS:
        assert secret not in shown
    return error


def with_query(wire: Wire, name: str, value: str | None) -> Wire:
    """``wire`` with query parameter ``name`` set to ``value`` (raw), or dropped."""
    pairs = [p for p in wire.query.split("&") if p.partition("=")[0] != name]
    if value is not None:
        pairs.append(f"{name}={value}")
    return replace(wire, query="&".join(pairs))


def with_header(wire: Wire, name: str, value: str | None) -> Wire:
    headers = wire.headers.copy()
    headers.popall(name, None)
    if value is not None:
        headers[name] = value
    return replace(wire, headers=headers)


def flip(text: str, index: int) -> str:
    """``text`` with the character at ``index`` changed to another of its kind."""
    char = text[index]
    if char in "0123456789abcdef":
        new = "0123456789abcdef"[("0123456789abcdef".index(char) + 1) % 16]
    elif char.isalpha():
        new = "b" if char == "a" else "a"
    else:
        new = "Z"
    return text[:index] + new + text[index + 1 :]


# -- requests that verify ----------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize("key", AWKWARD_KEYS)
def test_object_requests_of_awkward_keys_verify(method: str, key: str) -> None:
    identity = passes(sign(method, object_target(key)))
    assert identity == Identity(KEY, presigned=False)


@pytest.mark.parametrize("key", AWKWARD_KEYS)
def test_presigned_urls_of_awkward_keys_verify(key: str) -> None:
    wire = presigned_url("get_object", {"Bucket": "bkt", "Key": key})
    assert passes(wire) == Identity(KEY, presigned=True)
    assert passes(presign("GET", object_target(key))).presigned


def test_a_listing_with_many_parameters_verifies() -> None:
    params = {
        "prefix": "a b/+c%/é",
        "list-type": "2",
        "delimiter": "/",
        "continuation-token": "1ZxY/+=AbC==",
        "encoding-type": "url",
        "max-keys": "1000",
        "start-after": "dir/~x",
        "fetch-owner": "",
    }
    passes(sign("GET", "/bkt?" + percent_encode_sequence(params)))
    passes(presigned_url("list_objects_v2", {"Bucket": "bkt", "Prefix": "a b/+c"}))


def test_query_parameters_without_a_value_and_out_of_order_verify() -> None:
    passes(sign("GET", "/bkt/key?tagging"))
    passes(sign("GET", "/bkt?uploads&prefix=z&max-uploads=10&delimiter=%2F"))
    passes(sign("GET", "/bkt/key?versionId=&partNumber=1"))


def test_a_plus_in_the_query_is_a_space_as_object_store_sends_it() -> None:
    # object_store sends a space as "+" and signs it as "%20"; a literal "+" it
    # sends as "%2B". Signed by botocore with the "%20" form, sent with "+":
    signed = sign("GET", "/bkt?list-type=2&prefix=a%20b%2Bc")
    passes(replace(signed, query="list-type=2&prefix=a+b%2Bc"))


@pytest.mark.parametrize(
    "payload_hash",
    [
        "UNSIGNED-PAYLOAD",
        "STREAMING-UNSIGNED-PAYLOAD-TRAILER",
        "STREAMING-AWS4-HMAC-SHA256-PAYLOAD",
        "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER",
        "a" * 64,
    ],
)
def test_every_payload_hash_clients_send_verifies(payload_hash: str) -> None:
    passes(sign("PUT", object_target("up/load"), payload_hash=payload_hash))


def test_a_trailer_checksum_request_as_botocore_makes_it_verifies() -> None:
    context = {"checksum": {"request_algorithm": {"in": "trailer", "name": "x-amz-checksum-crc32"}}}
    wire = sign(
        "PUT",
        object_target("k"),
        headers={"Content-Encoding": "aws-chunked", "X-Amz-Trailer": "x-amz-checksum-crc32"},
        context=context,
    )
    assert wire.headers["X-Amz-Content-SHA256"] == "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
    passes(wire)


def test_a_date_header_instead_of_x_amz_date_verifies() -> None:
    wire = sign("GET", object_target("k"), headers={"Date": "placeholder"})
    assert "X-Amz-Date" not in wire.headers
    passes(wire)


def test_repeated_and_spaced_headers_verify() -> None:
    request = AWSRequest(method="GET", url=ENDPOINT + object_target("k"))
    request.headers.add_header("X-Amz-Meta-Tag", "first")
    request.headers.add_header("X-Amz-Meta-Tag", "  second   with  spaces ")
    request.headers.add_header("Range", "  bytes=0-9 ")
    S3SigV4Auth(Credentials(KEY, SECRET), "s3", "us-east-1").add_auth(request)
    wire = wire_of(request)
    assert wire.headers.getall("X-Amz-Meta-Tag") == ["first", "  second   with  spaces "]
    passes(wire)
    # Headers as a plain mapping (one value each) verify too.
    plain = sign("GET", object_target("k"), headers={"Range": "bytes=0-9"})
    assert verifier().verify(plain.method, plain.path, plain.query, dict(plain.headers))


@pytest.mark.parametrize("region", ["us-east-1", "eu-west-3", "auto", "garage", "x" * 40])
def test_whatever_region_the_client_signed_with_verifies(region: str) -> None:
    passes(sign("GET", object_target("k"), region=region))
    passes(presign("GET", object_target("k"), region=region))


def test_the_key_that_signed_is_the_identity() -> None:
    assert passes(sign("GET", "/b/k", key=OTHER_KEY, secret=OTHER_SECRET), key=OTHER_KEY)


def test_unsigned_headers_may_change() -> None:
    wire = sign("GET", object_target("k"))
    passes(with_header(wire, "User-Agent", "something else entirely"))
    passes(with_header(wire, "Accept-Encoding", "gzip"))


def test_a_request_with_no_signature_is_anonymous() -> None:
    v = verifier()
    assert v.verify("GET", "/bkt/k", "", CIMultiDictProxy(CIMultiDict({"Host": HOST}))) is None
    assert v.verify("GET", "/bkt", "list-type=2&prefix=a", {"Host": HOST}) is None
    assert v.verify("GET", "/bkt/k", "X-Amz-Date=20240101T000000Z", {}) is None


def test_skew_within_the_limit_verifies() -> None:
    now = time.time()
    wire = sign("GET", object_target("k"))
    passes(wire, verifier(clock=lambda: now + 14 * 60))
    passes(wire, verifier(clock=lambda: now - 14 * 60))


# -- requests that do not ----------------------------------------------------------


def test_a_wrong_secret_does_not_match() -> None:
    wire = sign("GET", object_target("k"), secret="not-" + SECRET)
    error = refuse(wire, "SignatureDoesNotMatch")
    assert error.status == 403
    assert error.fields["AWSAccessKeyId"] == KEY
    assert error.fields["CanonicalRequest"].startswith("GET\n/bkt/k\n")
    assert error.fields["StringToSign"].startswith("AWS4-HMAC-SHA256\n")
    # The signature the server expected is not told.
    right = sign("GET", object_target("k"))
    expected = right.headers["Authorization"].rpartition("Signature=")[2]
    assert expected not in " ".join(error.fields.values())


def test_an_unknown_access_key_is_refused() -> None:
    error = refuse(sign("GET", "/b/k", key="AKIDNOBODY"), "InvalidAccessKeyId")
    assert error.status == 403
    refuse(presign("GET", "/b/k", key="AKIDNOBODY"), "InvalidAccessKeyId")


def test_one_character_changed_anywhere_signed_does_not_match() -> None:
    wire = sign(
        "GET",
        "/bkt/some/key.bin?list-type=2&prefix=abc",
        headers={"Range": "bytes=0-99", "X-Amz-Meta-A": "value"},
    )
    refuse(replace(wire, path="/bkt/some/kez.bin"), "SignatureDoesNotMatch")
    refuse(replace(wire, path="/bkt/some//key.bin"), "SignatureDoesNotMatch")
    refuse(replace(wire, path="/bkt/some/key.bin/"), "SignatureDoesNotMatch")
    refuse(replace(wire, query="list-type=2&prefix=abd"), "SignatureDoesNotMatch")
    refuse(replace(wire, query="list-type=2&prefix=abc&x=1"), "SignatureDoesNotMatch")
    refuse(replace(wire, method="HEAD"), "SignatureDoesNotMatch")
    refuse(with_header(wire, "Range", "bytes=0-98"), "SignatureDoesNotMatch")
    refuse(with_header(wire, "Host", "127.0.0.1:9001"), "SignatureDoesNotMatch")
    refuse(with_header(wire, "X-Amz-Content-SHA256", "b" * 64), "SignatureDoesNotMatch")
    presigned = presign("GET", "/bkt/some/key.bin")
    refuse(replace(presigned, path="/bkt/some/key.bim"), "SignatureDoesNotMatch")
    refuse(with_query(presigned, "X-Amz-Expires", "301"), "SignatureDoesNotMatch")
    refuse(with_query(presigned, "response-content-type", "text/html"), "SignatureDoesNotMatch")


@pytest.mark.parametrize("minutes", [16, -16])
def test_a_skewed_clock_is_refused(minutes: int) -> None:
    now = time.time()
    error = refuse(
        sign("GET", object_target("k")),
        "RequestTimeTooSkewed",
        verifier(clock=lambda: now + minutes * 60),
    )
    assert error.status == 403
    assert set(error.fields) == {"RequestTime", "ServerTime", "MaxAllowedSkewMilliseconds"}
    assert error.fields["MaxAllowedSkewMilliseconds"] == "900000"


def test_an_expired_presigned_url_is_refused() -> None:
    now = time.time()
    wire = presigned_url("get_object", {"Bucket": "bkt", "Key": "k"}, expires=300)
    passes(wire, verifier(clock=lambda: now + 290))
    error = refuse(wire, "AccessDenied", verifier(clock=lambda: now + 310))
    assert error.message == "Request has expired"
    assert error.fields["X-Amz-Expires"] == "300"
    assert {"Expires", "ServerTime"} <= set(error.fields)


def test_a_presigned_url_from_the_future_is_refused() -> None:
    now = time.time()
    wire = presign("GET", object_target("k"))
    error = refuse(wire, "AccessDenied", verifier(clock=lambda: now - 16 * 60))
    assert error.message == "Request is not valid yet"


@pytest.mark.parametrize("expires", ["0", "604801", "-5", "abc", "", "1.5", "99999999999999"])
def test_a_bad_expiry_is_refused(expires: str) -> None:
    wire = with_query(presign("GET", object_target("k")), "X-Amz-Expires", expires)
    assert refuse(wire, "AuthorizationQueryParametersError").status == 400


def test_the_longest_expiry_is_a_week() -> None:
    passes(presign("GET", object_target("k"), expires=604800))


@pytest.mark.parametrize(
    "name",
    [
        "X-Amz-Algorithm",
        "X-Amz-Credential",
        "X-Amz-Date",
        "X-Amz-Expires",
        "X-Amz-SignedHeaders",
        "X-Amz-Signature",
    ],
)
def test_a_presigned_url_missing_a_parameter_is_refused(name: str) -> None:
    refuse(with_query(presign("GET", "/b/k"), name, None), "AuthorizationQueryParametersError")


def test_bad_presigned_parameters_are_refused() -> None:
    wire = presign("GET", "/b/k")
    twice = replace(wire, query=wire.query + "&X-Amz-Date=20240101T000000Z")
    refuse(twice, "AuthorizationQueryParametersError")
    refuse(
        with_query(wire, "X-Amz-Algorithm", "AWS4-HMAC-SHA512"), "AuthorizationQueryParametersError"
    )
    refuse(
        with_query(wire, "X-Amz-Date", "2024-01-01T00:00:00Z"), "AuthorizationQueryParametersError"
    )
    refuse(with_query(wire, "X-Amz-Credential", "AKID%2Fnope"), "AuthorizationQueryParametersError")
    refuse(
        with_query(wire, "X-Amz-Credential", f"{KEY}%2F20200101%2Fus-east-1%2Fs3%2Faws4_request"),
        "AuthorizationQueryParametersError",
    )
    refuse(with_query(wire, "X-Amz-SignedHeaders", "range"), "AccessDenied")


def _authorization(wire: Wire) -> str:
    return wire.headers["Authorization"]


@pytest.mark.parametrize(
    "make",
    [
        lambda a: "AWS4-HMAC-SHA256",
        lambda a: "AWS4-HMAC-SHA256 ",
        lambda a: a.split(", Signature=")[0],
        lambda a: a.replace(", SignedHeaders=", ", Foo=bar, SignedHeaders="),
        lambda a: a + ", Signature=" + "0" * 64,
        lambda a: a.replace("Credential=", "Credential "),
        lambda a: a.replace("/aws4_request", ""),
        lambda a: a.replace("/s3/", "/ec2/"),
        lambda a: a.replace("/aws4_request", "/aws3_request"),
        lambda a: a.replace("/" + a.split("/")[1] + "/", "/2024011/", 1),
        lambda a: a.replace(f"Credential={KEY}", "Credential="),
        lambda a: a.replace("SignedHeaders=", "SignedHeaders=;"),
        lambda a: "AWS4-HMAC-SHA256 " + "Credential=" * 10000,
        lambda a: "AWS4-HMAC-SHA256 \x00\xff\u2603,,,===;;;",
        lambda a: a + "," + "x" * 20000,
    ],
)
def test_a_malformed_authorization_header_is_refused(make: Callable[[str], str]) -> None:
    wire = sign("GET", object_target("k"))
    error = refuse(
        with_header(wire, "Authorization", make(_authorization(wire))),
        "AuthorizationHeaderMalformed",
    )
    assert error.status == 400


def test_a_credential_date_other_than_the_request_date_is_refused() -> None:
    wire = sign("GET", object_target("k"))
    date = wire.headers["X-Amz-Date"][:8]
    bad = _authorization(wire).replace(f"/{date}/", "/20000101/")
    refuse(with_header(wire, "Authorization", bad), "AuthorizationHeaderMalformed")


def test_tolerant_spacing_of_the_authorization_header_verifies() -> None:
    wire = sign("GET", object_target("k"))
    compact = _authorization(wire).replace(", ", ",")
    passes(with_header(wire, "Authorization", compact))
    spaced = _authorization(wire).replace(", ", " ,   ")
    passes(with_header(wire, "Authorization", "  " + spaced + "  "))
    algorithm, _, parts = _authorization(wire).partition(" ")
    reordered = algorithm + " " + ", ".join(reversed(parts.split(", ")))
    passes(with_header(wire, "Authorization", reordered))


@pytest.mark.parametrize(
    "authorization",
    [
        # "AWS AKID:sig" is SigV2, checked: tests/test_s3front_sigv2.py
        f"AWS4-ECDSA-P256-SHA256 Credential={KEY}/20240101/s3/aws4_request, "
        "SignedHeaders=host, Signature=3045",
        "Bearer abc.def.ghi",
        "",
    ],
)
def test_other_signing_schemes_are_refused(authorization: str) -> None:
    wire = with_header(sign("GET", "/b/k"), "Authorization", authorization)
    error = refuse(wire, "InvalidRequest")
    assert "AWS4-HMAC-SHA256" in error.message


def test_a_missing_or_bad_content_hash_is_refused() -> None:
    wire = sign("GET", object_target("k"))
    error = refuse(with_header(wire, "X-Amz-Content-SHA256", None), "InvalidRequest")
    assert error.message == "Missing required header for this request: x-amz-content-sha256"
    for bad in ("UNSIGNED", "a" * 63, "g" * 64, "STREAMING-AWS4-ECDSA-P256-SHA256-PAYLOAD", ""):
        refuse(with_header(wire, "X-Amz-Content-SHA256", bad), "InvalidArgument")


def test_a_missing_or_bad_date_is_refused() -> None:
    wire = sign("GET", object_target("k"))
    error = refuse(with_header(wire, "X-Amz-Date", None), "AccessDenied")
    assert error.message == "AWS authentication requires a valid Date or x-amz-date header"
    for bad in ("20240101T000000", "2024-01-01T00:00:00Z", "20241301T000000Z", "tomorrow"):
        refuse(with_header(wire, "X-Amz-Date", bad), "AccessDenied")
    dated = sign("GET", object_target("k"), headers={"Date": "x"})
    refuse(with_header(dated, "Date", "not a date"), "AccessDenied")


def test_both_auth_mechanisms_at_once_are_refused() -> None:
    wire = sign("GET", object_target("k"))
    presigned = presign("GET", object_target("k"))
    both = replace(wire, query=presigned.query)
    error = refuse(both, "InvalidArgument")
    assert error.message.startswith("Only one auth mechanism allowed")


def test_a_security_token_is_refused() -> None:
    refuse(sign("GET", "/b/k", token="FQoGZXIvYXdzE"), "InvalidToken")
    refuse(presign("GET", "/b/k", token="FQoGZXIvYXdzE"), "InvalidToken")


def test_an_unsigned_host_is_refused_and_an_absent_signed_header_does_not_match() -> None:
    wire = sign("GET", object_target("k"), headers={"Range": "bytes=0-1"})
    no_host = _authorization(wire).replace("host;", "")
    refuse(with_header(wire, "Authorization", no_host), "AccessDenied")
    refuse(with_header(wire, "Host", None), "AccessDenied")
    refuse(with_header(wire, "Range", None), "SignatureDoesNotMatch")
    presigned = presign("GET", "/b/k")
    refuse(with_query(presigned, "X-Amz-SignedHeaders", "range"), "AccessDenied")
    refuse(with_query(presigned, "X-Amz-SignedHeaders", "host%3Brange"), "SignatureDoesNotMatch")


@pytest.mark.parametrize("presigned", [False, True])
def test_an_unsigned_amz_header_is_refused(presigned: bool) -> None:
    wire = presign("GET", "/b/k") if presigned else sign("GET", object_target("k"))
    error = refuse(with_header(wire, "X-Amz-Copy-Source", "/other/key"), "AccessDenied")
    assert error.fields["HeadersNotSigned"] == "x-amz-copy-source"
    # Except the payload hash, which S3 lets a presigned request carry unsigned.
    if presigned:
        passes(with_header(wire, "X-Amz-Content-SHA256", "UNSIGNED-PAYLOAD"))
    # x-amzn-trace-id is no x-amz-* header: SDKs leave it unsigned on purpose.
    passes(with_header(wire, "X-Amzn-Trace-Id", "Root=1-abc"))


def test_two_authorization_headers_are_refused() -> None:
    wire = sign("GET", object_target("k"))
    headers = wire.headers.copy()
    headers.add("Authorization", wire.headers["Authorization"])
    refuse(replace(wire, headers=headers), "AuthorizationHeaderMalformed")


# -- what one request can make the verifier do ---------------------------------------


def error_document_of(error: S3Error) -> bytes:
    """The ``<Error>`` document the front writes for ``error``."""
    return error_document(error.code, error.message, "REQUESTID", error.fields)


def test_a_presigned_url_signing_host_thirteen_thousand_times_is_refused_at_once() -> None:
    # 13,000 "host" fit in a 64 KiB request line; with a 7 KiB Host, each would be a
    # 7 KiB line of a 91 MB canonical request, told back in the error.
    wire = presign("GET", "/bkt/k")
    wire = with_header(wire, "Host", "h" * 7000)
    wire = with_query(wire, "X-Amz-SignedHeaders", ";".join(["host"] * 13000))
    started = time.perf_counter()
    error = refuse(wire, "AuthorizationQueryParametersError")
    document = error_document_of(error)
    # Generous for a loaded machine: refusing it unread takes well under a millisecond.
    assert time.perf_counter() - started < 1.0
    assert "13000 headers" in error.message
    assert len(document) < 4096


@pytest.mark.parametrize(
    "signed_headers",
    [
        "host;host",
        "host;range;range",
        "x-amz-date;host",
        "host;x-amz-date;range",
        "Host;x-amz-date",
        "host;X-Amz-Date",
    ],
)
def test_signed_headers_that_repeat_are_unsorted_or_not_lowercase_are_refused(
    signed_headers: str,
) -> None:
    wire = sign("GET", object_target("k"), headers={"Range": "bytes=0-1"})
    signed = _authorization(wire).replace(
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date",
        f"SignedHeaders={signed_headers}",
    )
    assert signed != _authorization(wire)
    error = refuse(with_header(wire, "Authorization", signed), "AuthorizationHeaderMalformed")
    assert "lowercase, sorted, each once" in error.message
    presigned = with_header(presign("GET", "/b/k"), "Range", "bytes=0-1")
    error = refuse(
        with_query(presigned, "X-Amz-SignedHeaders", signed_headers),
        "AuthorizationQueryParametersError",
    )
    assert "lowercase, sorted, each once" in error.message


def test_at_most_64_headers_may_be_signed() -> None:
    # botocore signs host, x-amz-content-sha256, x-amz-date and every header given.
    def signed_with(count: int) -> Wire:
        metadata = {f"x-amz-meta-m{n:03d}": "v" for n in range(count - 3)}
        return sign("GET", object_target("k"), headers=metadata)

    wire = signed_with(MAX_SIGNED_HEADERS)
    assert _authorization(wire).count(";") == MAX_SIGNED_HEADERS - 1
    passes(wire)
    error = refuse(signed_with(MAX_SIGNED_HEADERS + 1), "AuthorizationHeaderMalformed")
    assert f"more than the {MAX_SIGNED_HEADERS}" in error.message


def test_a_query_the_front_takes_verifies_and_a_longer_canonical_request_is_refused() -> None:
    # 10,000 "é" are 60,000 characters once encoded: within the front's 64 KiB line.
    long = sign("GET", "/bkt?" + percent_encode_sequence({"list-type": "2", "prefix": "é" * 10000}))
    assert 60000 < len(long.query) < 65536
    passes(long)
    # Each "+" is a space, "%20" in the canonical request: 100,000 of them are more
    # than MAX_SIGNED_TEXT, and refused before any hashing.
    huge = replace(long, query="prefix=" + "+" * 100_000)
    error = refuse(huge, "InvalidRequest")
    assert "canonical request" in error.message
    assert str(MAX_SIGNED_TEXT) in error.message


def test_what_a_mismatch_tells_back_is_capped_at_both_ends() -> None:
    target = "/bkt?" + percent_encode_sequence({"list-type": "2", "prefix": "p" * 50000})
    short = refuse(sign("GET", "/bkt/k", secret="wrong"), "SignatureDoesNotMatch")
    assert "left out" not in " ".join(short.fields.values())
    error = refuse(sign("GET", target, secret="wrong"), "SignatureDoesNotMatch")
    for name in ("CanonicalRequest", "StringToSign", "SignatureProvided", "AWSAccessKeyId"):
        assert len(error.fields[name]) <= MAX_SHOWN + 64, name
    canonical = error.fields["CanonicalRequest"]
    assert canonical.startswith("GET\n/bkt\nlist-type=2&prefix=ppp")
    assert "characters left out]..." in canonical
    # The end, where the signed headers and the payload hash are, is kept.
    assert canonical.endswith("\nhost;x-amz-content-sha256;x-amz-date\n" + EMPTY_SHA256)
    assert len(error_document_of(error)) < 3 * MAX_SHOWN + 2048
    # A signature of any length is told back capped too.
    wire = presign("GET", "/b/k")
    error = refuse(with_query(wire, "X-Amz-Signature", "f" * 60000), "SignatureDoesNotMatch")
    assert len(error.fields["SignatureProvided"]) <= MAX_SHOWN + 64


def test_an_unknown_key_of_any_length_is_told_back_capped() -> None:
    error = refuse(presign("GET", "/b/k", key="K" * 60000), "InvalidAccessKeyId")
    assert len(error.fields["AWSAccessKeyId"]) <= MAX_SHOWN + 64
    assert len(error_document_of(error)) < 4096


def test_the_query_is_read_as_the_verifier_signs_it() -> None:
    assert decoded_query("a+b=c%20d&flag&x=&=v&&k=%zz&k=%C3%A9+%2B") == [
        ("a b", "c d"),
        ("flag", ""),
        ("x", ""),
        ("", "v"),
        ("k", "%zz"),
        ("k", "é +"),
    ]
    params = {"prefix": "a b/+c%/é", "list-type": "2", "start-after": "~x=y&z"}
    wire = sign("GET", "/bkt?" + percent_encode_sequence(params))
    passes(wire)
    assert decoded_query(wire.query) == list(params.items())
    # object_store's form of the same query reads the same.
    obstore_form = wire.query.replace("%20", "+")
    assert obstore_form != wire.query
    passes(replace(wire, query=obstore_form))
    assert decoded_query(obstore_form) == list(params.items())


# -- properties --------------------------------------------------------------------

_TEXT = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    key=_TEXT,
    secret=_TEXT,
    prefix=_TEXT,
    presigned=st.booleans(),
    index=st.integers(0, 63),
)
def test_any_key_signed_by_botocore_verifies_and_any_flipped_signature_does_not(
    key: str, secret: str, prefix: str, presigned: bool, index: int
) -> None:
    # A control character, which the percent-encoded canonical request never holds
    # raw, lets the test look for the secret in the answer however short it is.
    secret = "\x01" + secret
    v = SigV4Verifier({KEY: Secret(secret)})
    target = object_target(key) + "?" + percent_encode_sequence({"prefix": prefix, "x-id": "1"})
    wire = (
        presign("GET", target, secret=secret) if presigned else sign("GET", target, secret=secret)
    )
    assert v.verify(wire.method, wire.path, wire.query, wire.headers) == Identity(KEY, presigned)

    if presigned:
        signature = wire.query.rpartition("X-Amz-Signature=")[2]
        tampered = with_query(wire, "X-Amz-Signature", flip(signature, index))
    else:
        authorization = _authorization(wire)
        head, _, signature = authorization.rpartition("Signature=")
        tampered = with_header(wire, "Authorization", head + "Signature=" + flip(signature, index))
    with pytest.raises(S3Error) as caught:
        v.verify(tampered.method, tampered.path, tampered.query, tampered.headers)
    assert caught.value.code == "SignatureDoesNotMatch"
    assert secret not in " ".join([caught.value.message, *caught.value.fields.values()])


_FRAGMENTS = st.sampled_from(
    [
        "AWS4-HMAC-SHA256",
        " ",
        ",",
        "=",
        ";",
        "/",
        "&",
        "%",
        "%zz",
        "%FF",
        "+",
        "Credential",
        "SignedHeaders",
        "Signature",
        KEY,
        "20240101",
        "us-east-1",
        "s3",
        "aws4_request",
        "host",
        "x-amz-date",
        "X-Amz-Algorithm",
        "X-Amz-Credential",
        "X-Amz-Date",
        "X-Amz-Expires",
        "X-Amz-SignedHeaders",
        "X-Amz-Signature",
        "X-Amz-Security-Token",
        "20240101T000000Z",
        "9" * 5000,
        "\x00",
        "é",
    ]
)
_GARBAGE = st.lists(st.one_of(_FRAGMENTS, st.text(max_size=8)), max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(
    authorization=st.none() | _GARBAGE,
    query=_GARBAGE,
    path=_GARBAGE,
    amz_date=st.none() | _GARBAGE,
    date=st.none() | _GARBAGE,
    content_hash=st.none() | _GARBAGE,
)
def test_garbage_is_refused_with_an_s3_error_and_never_crashes(
    authorization: str | None,
    query: str,
    path: str,
    amz_date: str | None,
    date: str | None,
    content_hash: str | None,
) -> None:
    headers: CIMultiDict[str] = CIMultiDict({"Host": HOST})
    for name, value in (
        ("Authorization", authorization),
        ("X-Amz-Date", amz_date),
        ("Date", date),
        ("X-Amz-Content-SHA256", content_hash),
    ):
        if value is not None:
            headers[name] = value
    # No garbage can be signed with a configured secret: it verifies as no one (no
    # signature at all) or is refused with an S3 error, never with another exception.
    refused: S3Error | None = None
    try:
        identity = verifier().verify("GET", "/" + path, query, headers)
    except S3Error as error:
        refused, identity = error, None
    assert identity is None
    if refused is not None:
        assert refused.code in STATUS
        shown = " ".join([refused.message, *refused.fields.values()])
        assert SECRET not in shown
        assert OTHER_SECRET not in shown


def test_the_signing_key_cache_stays_bounded() -> None:
    v = verifier()
    for n in range(SIGNING_KEY_CACHE_SIZE + 50):
        passes(sign("GET", "/b/k", region=f"region-{n}"), v)
    assert v.signing_keys_cached == SIGNING_KEY_CACHE_SIZE
    # A key still cached and one evicted both verify.
    passes(sign("GET", "/b/k", region=f"region-{SIGNING_KEY_CACHE_SIZE + 49}"), v)
    passes(sign("GET", "/b/k", region="region-0"), v)
    assert v.signing_keys_cached == SIGNING_KEY_CACHE_SIZE


def test_botocore_is_still_the_signer_these_tests_trust() -> None:
    # If botocore ever normalised S3 paths, the awkward-key tests would test nothing.
    assert botocore.auth.S3SigV4Auth._normalize_url_path(None, "/a//../b") == "/a//../b"  # type: ignore[arg-type]


# -- real clients over a real socket -----------------------------------------------

LISTING = (
    '<?xml version="1.0" encoding="UTF-8"?>'
    '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
    "<Name>bkt</Name><Prefix></Prefix><KeyCount>0</KeyCount><MaxKeys>1000</MaxKeys>"
    "<IsTruncated>false</IsTruncated></ListBucketResult>"
)


@dataclass
class Front:
    """An aiohttp server that answers after verifying, and what it saw."""

    url: str
    identities: list[Identity | None] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)


@pytest.fixture
async def front() -> AsyncIterator[Front]:
    v = verifier()
    seen = Front("")

    async def handle(request: web.Request) -> web.Response:
        path, _, query = request.raw_path.partition("?")
        try:
            seen.identities.append(v.verify(request.method, path, query, request.headers))
        except S3Error as error:
            seen.refusals.append(error.code)
            body = (
                f"<Error><Code>{error.code}</Code>"
                f"<Message>{escape(error.message)}</Message></Error>"
            )
            return web.Response(status=error.status, text=body, content_type="application/xml")
        if "list-type=2" in query:
            return web.Response(text=LISTING, content_type="application/xml")
        headers = {
            "ETag": '"5d41402abc4b2a76b9719d911017c592"',
            "Last-Modified": "Mon, 01 Jan 2024 00:00:00 GMT",
        }
        return web.Response(body=b"hello", headers=headers, content_type="application/octet-stream")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    seen.url = f"http://127.0.0.1:{port}"
    try:
        yield seen
    finally:
        await runner.cleanup()


WIRE_KEY = "dir/with space/plus+sign/é 日本/~tilde=eq&amp!*'(),;:@$"


async def test_boto3_over_the_wire_verifies(front: Front) -> None:
    client = boto3_client(endpoint=front.url)

    def calls() -> None:
        for key in (WIRE_KEY, "a//b/../c", "%41%"):
            assert client.get_object(Bucket="bkt", Key=key)["Body"].read() == b"hello"
            client.head_object(Bucket="bkt", Key=key)
        client.list_objects_v2(Bucket="bkt", Prefix="a b+c/é", Delimiter="/", StartAfter="~x")

    await asyncio.to_thread(calls)
    assert front.refusals == []
    assert front.identities == [Identity(KEY, presigned=False)] * 7


async def test_a_boto3_presigned_url_fetched_over_the_wire_verifies(front: Front) -> None:
    client = boto3_client(endpoint=front.url)
    url = client.generate_presigned_url("get_object", {"Bucket": "bkt", "Key": WIRE_KEY})
    async with ClientSession() as session, session.get(URL(url, encoded=True)) as response:
        assert response.status == 200
        assert await response.read() == b"hello"
    assert front.identities == [Identity(KEY, presigned=True)]


async def test_a_wrong_secret_over_the_wire_is_refused(front: Front) -> None:
    client = boto3_client(secret="wrong", endpoint=front.url)

    def call() -> None:
        with pytest.raises(ClientError) as caught:
            client.get_object(Bucket="bkt", Key=WIRE_KEY)
        assert caught.value.response["Error"]["Code"] == "SignatureDoesNotMatch"

    await asyncio.to_thread(call)
    assert front.refusals == ["SignatureDoesNotMatch"]


async def test_obstore_over_the_wire_verifies(front: Front) -> None:
    store = S3Store(
        "bkt",
        endpoint=front.url,
        access_key_id=KEY,
        secret_access_key=SECRET,
        region="us-east-1",
        client_options={"allow_http": True},
        retry_config={"max_retries": 0},
    )
    result = await obstore.get_async(store, WIRE_KEY)
    assert bytes(await result.bytes_async()) == b"hello"
    await obstore.head_async(store, WIRE_KEY)
    # object_store sends the space of a prefix as "+", signs it as "%20".
    assert await obstore.list(store, prefix="a b+c/é").collect_async() == []
    await obstore.list_with_delimiter_async(store, prefix="a b+c")
    assert front.refusals == []
    assert front.identities == [Identity(KEY, presigned=False)] * 4


async def test_pyarrow_over_the_wire_verifies(front: Front) -> None:
    s3 = pafs.S3FileSystem(
        access_key=KEY,
        secret_key=SECRET,
        endpoint_override=front.url.removeprefix("http://"),
        scheme="http",
        region="us-east-1",
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1),
    )

    def calls() -> None:
        assert s3.get_file_info("bkt/" + WIRE_KEY).size == 5
        s3.get_file_info(pafs.FileSelector("bkt/a b+c", allow_not_found=True))

    await asyncio.to_thread(calls)
    assert front.refusals == []
    assert front.identities
    assert set(front.identities) == {Identity(KEY, presigned=False)}


async def test_s3fs_over_the_wire_verifies(front: Front) -> None:
    s3 = s3fs.S3FileSystem(
        key=KEY,
        secret=SECRET,
        endpoint_url=front.url,
        client_kwargs={"region_name": "us-east-1"},
        config_kwargs={"retries": {"max_attempts": 1}},
        asynchronous=True,
        skip_instance_cache=True,
    )
    session = await s3.set_session()
    try:
        assert await s3._cat_file("bkt/" + WIRE_KEY) == b"hello"
        assert (await s3._info("bkt/" + WIRE_KEY))["size"] == 5
        with pytest.raises(FileNotFoundError):  # the front's listing is empty
            await s3._ls("bkt/a b+c", refresh=True)
    finally:
        await session.close()
    assert front.refusals == []
    assert set(front.identities) == {Identity(KEY, presigned=False)}
