"""The S3 front's SigV2 check: what old clients and boto3's default presigned URLs sign.

The signer is always a real one: botocore's ``HmacV1Auth`` (``Authorization: AWS
AKID:sig``) and ``HmacV1QueryAuth`` (``AWSAccessKeyId``, ``Signature``, ``Expires``),
and ``boto3.client(...).generate_presigned_url`` with the default config, which signs
with SigV2 for ``us-east-1`` and a custom endpoint. Then, over a real socket, curl
fetches such a URL from a daemon's front, and a boto3 client configured for SigV2
(``signature_version="s3"``) reads through it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import replace
from email.utils import formatdate
from typing import Any
from urllib.parse import urlsplit

import boto3
import pytest
from botocore.auth import HmacV1Auth, HmacV1QueryAuth, S3SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from multidict import CIMultiDict

from chunkd.gateway.s3front.refusals import MAX_SHOWN, MAX_SIGNED_TEXT
from chunkd.gateway.s3front.sigv4 import Identity
from chunkd.gateway.s3front.xml import error_document
from chunkd.testing.s3front import FRONT_KEY, FRONT_SECRET
from tests.conftest import FrontNode
from tests.test_s3front_sigv4 import (
    AWKWARD_KEYS,
    ENDPOINT,
    KEY,
    OTHER_KEY,
    OTHER_SECRET,
    SECRET,
    Wire,
    object_target,
    passes,
    refuse,
    verifier,
    with_header,
    with_query,
)

pytestmark = pytest.mark.timeout(120)


def sign(
    method: str,
    target: str,
    *,
    headers: dict[str, str] | None = None,
    key: str = KEY,
    secret: str = SECRET,
) -> Wire:
    """``target`` signed in the ``Authorization`` header by botocore's HmacV1Auth."""
    request = AWSRequest(method=method, url=ENDPOINT + target, headers=headers or {})
    HmacV1Auth(Credentials(key, secret)).add_auth(request)
    url = urlsplit(request.prepare().url)
    sent: CIMultiDict[str] = CIMultiDict(request.headers.items())
    sent["Host"] = url.netloc
    sent.add("User-Agent", "Botocore/1.0 test")
    return Wire(method, url.path, url.query, sent)


def presign(
    method: str, target: str, *, expires: int = 300, key: str = KEY, secret: str = SECRET
) -> Wire:
    """``target`` presigned by botocore's HmacV1QueryAuth."""
    request = AWSRequest(method=method, url=ENDPOINT + target)
    HmacV1QueryAuth(Credentials(key, secret), expires=expires).add_auth(request)
    url = urlsplit(request.prepare().url)
    return Wire(method, url.path, url.query, CIMultiDict({"Host": url.netloc}))


def default_client(endpoint: str = ENDPOINT, secret: str = SECRET) -> Any:
    """A boto3 client with boto3's default config, as users make one."""
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=KEY,
        aws_secret_access_key=secret,
    )


def default_presigned(params: dict[str, str], expires: int = 300) -> Wire:
    """A URL of boto3's default ``generate_presigned_url``, checked to be SigV2."""
    client = default_client()
    url = urlsplit(client.generate_presigned_url("get_object", params, ExpiresIn=expires))
    names = {pair.partition("=")[0] for pair in url.query.split("&")}
    assert {"AWSAccessKeyId", "Signature", "Expires"} <= names, url
    assert not any(name.startswith("X-Amz-") for name in names), url
    return Wire("GET", url.path, url.query, CIMultiDict({"Host": url.netloc}))


def query_param(wire: Wire, name: str) -> str:
    for pair in wire.query.split("&"):
        if pair.partition("=")[0] == name:
            return pair.partition("=")[2]
    raise AssertionError(f"{name} not in {wire.query}")


def signed_by_hand(string_to_sign: str, secret: str = SECRET) -> str:
    digest = hmac.new(secret.encode(), string_to_sign.encode(), hashlib.sha1).digest()
    return base64.b64encode(digest).decode("ascii")


# -- requests that verify ----------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize("key", AWKWARD_KEYS)
def test_header_signed_requests_of_awkward_keys_verify(method: str, key: str) -> None:
    assert passes(sign(method, object_target(key))) == Identity(KEY, presigned=False)


@pytest.mark.parametrize("key", AWKWARD_KEYS)
def test_presigned_urls_of_awkward_keys_verify(key: str) -> None:
    assert passes(presign("GET", object_target(key))) == Identity(KEY, presigned=True)
    assert passes(default_presigned({"Bucket": "bkt", "Key": key})).presigned


def test_sub_resources_and_response_overrides_are_signed() -> None:
    wire = default_presigned(
        {
            "Bucket": "bkt",
            "Key": "a b/c+d%e.txt",
            "ResponseContentType": "text/plain; charset=utf-8",
            "ResponseContentDisposition": 'attachment; filename="a b.txt"',
            "VersionId": "v+1/x",
        }
    )
    passes(wire)
    # An override changed, or added after signing, breaks the signature: it is
    # part of the CanonicalizedResource.
    refuse(with_query(wire, "response-content-type", "text%2Fhtml"), "SignatureDoesNotMatch")
    refuse(with_query(wire, "response-expires", "0"), "SignatureDoesNotMatch")
    refuse(with_query(wire, "versionId", "v2"), "SignatureDoesNotMatch")
    # A parameter name encoded another way is the same parameter to the front.
    refuse(with_query(wire, "response%2Dcache-control", "no-store"), "SignatureDoesNotMatch")
    # Header-signed, with bare and valued sub-resources out of order.
    passes(sign("GET", "/bkt/key?versionId=3&acl&partNumber=1&response-content-language=fr"))
    passes(sign("GET", "/bkt?location"))


def test_a_bucket_alone_verifies_with_and_without_its_slash() -> None:
    # botocore signs "/bkt/" for "GET /bkt?list-type=2", as S3 has it; others "/bkt".
    passes(sign("GET", "/bkt?list-type=2&prefix=a%20b"))
    request = AWSRequest(method="GET", url=ENDPOINT + "/bkt?list-type=2")
    request.auth_path = "/bkt/"
    HmacV1Auth(Credentials(KEY, SECRET)).add_auth(request)
    sent = CIMultiDict(request.headers.items())
    passes(Wire("GET", "/bkt", "list-type=2", sent))
    listing = urlsplit(
        default_client().generate_presigned_url("list_objects_v2", {"Bucket": "bkt"})
    )
    assert "AWSAccessKeyId=" in listing.query
    passes(Wire("GET", listing.path, listing.query, CIMultiDict({"Host": listing.netloc})))
    refuse(Wire("GET", "/bkt2", "list-type=2", sent), "SignatureDoesNotMatch")


def test_amz_and_content_headers_are_signed() -> None:
    headers = {
        "Content-Type": "application/octet-stream",
        "Content-MD5": "1B2M2Y8AsgTpgAmY7PhCfg==",
        "x-amz-meta-Note": "  some words  ",
        "X-Amz-Copy-Source": "/other/k",
    }
    wire = sign("PUT", object_target("up"), headers=headers)
    passes(wire)
    for name, value in [
        ("Content-Type", "text/html"),
        ("Content-MD5", "XrY7u+Ae7tCTyyK7j1rNww=="),
        ("x-amz-meta-note", "other"),
        ("x-amz-copy-source", "/secret/k"),
        ("x-amz-acl", "public-read"),  # added, never signed
    ]:
        refuse(with_header(wire, name, value), "SignatureDoesNotMatch")
    # A signed header that is carried twice is read whole.
    twice = sign("GET", "/bkt/k", headers={"x-amz-meta-a": "1"})
    twice.headers.add("x-amz-meta-a", "2")
    refuse(twice, "SignatureDoesNotMatch")


def test_x_amz_date_signs_an_empty_date_as_s3_says_and_botocores_date_is_taken() -> None:
    now = time.time()
    amz_date = formatdate(now, usegmt=True)
    # S3's rule: with x-amz-date, the Date line is empty.
    string_to_sign = f"GET\n\n\n\nx-amz-date:{amz_date}\n/bkt/k"
    wire = Wire(
        "GET",
        "/bkt/k",
        "",
        CIMultiDict(
            {
                "Host": "h",
                "x-amz-date": amz_date,
                "Authorization": f"AWS {KEY}:{signed_by_hand(string_to_sign)}",
            }
        ),
    )
    passes(wire)
    # botocore signs its own Date header even when x-amz-date is sent.
    passes(sign("GET", "/bkt/k", headers={"x-amz-date": amz_date}))
    # x-amz-date in the ISO form decides the time, the Date header aside.
    iso = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    passes(sign("GET", "/bkt/k", headers={"x-amz-date": iso}))


def test_a_signature_with_a_raw_plus_verifies() -> None:
    # base64 signatures hold "+" and "/": some clients send them unencoded.
    for n in range(40):
        wire = presign("GET", object_target(f"k{n}"))
        signature = query_param(wire, "Signature")
        if "%2B" in signature:
            passes(with_query(wire, "Signature", signature.replace("%2B", "+")))
            return
    pytest.fail("no signature with a '+' in 40 tries")


def test_the_second_key_verifies_as_itself() -> None:
    passes(sign("GET", "/bkt/k", key=OTHER_KEY, secret=OTHER_SECRET), key=OTHER_KEY)
    passes(presign("GET", "/bkt/k", key=OTHER_KEY, secret=OTHER_SECRET), key=OTHER_KEY)


# -- requests that do not ----------------------------------------------------------


def test_tampered_signature_path_and_expires_do_not_match() -> None:
    wire = default_presigned({"Bucket": "bkt", "Key": "shared file.bin"})
    signature = query_param(wire, "Signature")
    error = refuse(with_query(wire, "Signature", "A" + signature[1:]), "SignatureDoesNotMatch")
    assert error.fields["AWSAccessKeyId"] == KEY
    assert error.fields["SignatureProvided"] == "A" + signature[1:].replace("%3D", "=").replace(
        "%2F", "/"
    ).replace("%2B", "+")
    assert error.fields["StringToSign"].startswith("GET\n\n\n")
    assert error.fields["StringToSign"].endswith("\n/bkt/shared%20file.bin")
    refuse(replace(wire, path="/bkt/shared%20filf.bin"), "SignatureDoesNotMatch")
    refuse(replace(wire, path="/bkt/shared file.bin"), "SignatureDoesNotMatch")
    refuse(replace(wire, method="PUT"), "SignatureDoesNotMatch")
    expires = query_param(wire, "Expires")
    refuse(with_query(wire, "Expires", str(int(expires) + 1)), "SignatureDoesNotMatch")
    header = sign("GET", "/bkt/k")
    authorization = header.headers["Authorization"]
    refuse(with_header(header, "Authorization", authorization[:-2] + "x="), "SignatureDoesNotMatch")
    refuse(replace(header, path="/bkt/j"), "SignatureDoesNotMatch")


def test_the_error_shows_neither_the_secret_nor_the_expected_signature() -> None:
    right = sign("GET", "/bkt/k")
    wrong = sign("GET", "/bkt/k", secret="not-the-secret")
    error = refuse(wrong, "SignatureDoesNotMatch")
    expected = right.headers["Authorization"].rpartition(":")[2]
    shown = " ".join([error.message, *error.fields.values()])
    assert expected not in shown
    assert set(error.fields) == {"AWSAccessKeyId", "StringToSign", "SignatureProvided"}
    refuse(presign("GET", "/bkt/k", secret=OTHER_SECRET), "SignatureDoesNotMatch")


def test_an_unknown_key_is_invalid_access_key_id() -> None:
    for wire in (sign("GET", "/bkt/k", key="nobody"), presign("GET", "/bkt/k", key="nobody")):
        error = refuse(wire, "InvalidAccessKeyId")
        assert error.status == 403
        assert error.fields["AWSAccessKeyId"] == "nobody"


def test_expired_and_far_future_urls_are_refused() -> None:
    wire = presign("GET", "/bkt/k", expires=60)
    expires = int(query_param(wire, "Expires"))
    passes(wire, verifier(clock=lambda: expires))
    error = refuse(wire, "AccessDenied", verifier(clock=lambda: expires + 1))
    assert error.message == "Request has expired"
    assert error.fields["Expires"] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires))
    assert "ServerTime" in error.fields
    # A week ahead (and the clock skew) is the most; more is a parameter error.
    week = presign("GET", "/bkt/k", expires=7 * 24 * 3600)
    passes(week)
    error = refuse(
        presign("GET", "/bkt/k", expires=8 * 24 * 3600), "AuthorizationQueryParametersError"
    )
    assert "604800" in error.message
    for bad in ("", "soon", "-1", "1e9", "1" * 11):
        refuse(with_query(wire, "Expires", bad), "AccessDenied")


def test_a_skewed_or_missing_date_is_refused() -> None:
    wire = sign("GET", "/bkt/k")
    now = time.time()
    passes(wire, verifier(clock=lambda: now + 800))
    error = refuse(wire, "RequestTimeTooSkewed", verifier(clock=lambda: now + 1200))
    assert error.fields["MaxAllowedSkewMilliseconds"] == "900000"
    assert error.fields["RequestTime"] == wire.headers["Date"]
    refuse(wire, "RequestTimeTooSkewed", verifier(clock=lambda: now - 1200))
    refuse(with_header(wire, "Date", None), "AccessDenied")
    refuse(with_header(wire, "Date", "not a date"), "AccessDenied")
    skewed = formatdate(now - 3600, usegmt=True)
    refuse(sign("GET", "/bkt/k", headers={"x-amz-date": skewed}), "RequestTimeTooSkewed")


def test_malformed_v2_requests_are_refused() -> None:
    wire = presign("GET", "/bkt/k")
    for name in ("AWSAccessKeyId", "Signature", "Expires"):
        if name == "Expires":
            # Without Expires a URL is SigV2 still: its other two say so.
            error = refuse(with_query(wire, name, None), "AccessDenied")
            assert "missing: Expires" in error.message
        else:
            refuse(with_query(wire, name, None), "AccessDenied")
    doubled = replace(wire, query=wire.query + "&Expires=" + query_param(wire, "Expires"))
    refuse(doubled, "AuthorizationQueryParametersError")
    header = sign("GET", "/bkt/k")
    for bad in ("AWS ", f"AWS {KEY}", f"AWS {KEY}:", "AWS :abc="):
        refuse(with_header(header, "Authorization", bad), "InvalidArgument")
    refuse(sign("GET", "/bkt/k", headers={"x-amz-security-token": "FQoG"}), "InvalidToken")
    refuse(with_query(wire, "x-amz-security-token", "FQoG"), "InvalidToken")


def test_more_than_one_auth_mechanism_is_refused() -> None:
    query = presign("GET", "/bkt/k")
    header = sign("GET", "/bkt/k")
    v2_query_and_header = replace(header, query=query.query)
    error = refuse(v2_query_and_header, "InvalidArgument")
    assert error.message.startswith("Only one auth mechanism allowed")
    request = AWSRequest(method="GET", url=ENDPOINT + "/bkt/k")
    S3SigV4QueryAuth(Credentials(KEY, SECRET), "s3", "us-east-1", expires=60).add_auth(request)
    v4_query = urlsplit(request.prepare().url).query
    both_queries = replace(query, query=query.query + "&" + v4_query)
    error = refuse(both_queries, "InvalidArgument")
    assert error.message.startswith("Only one auth mechanism allowed")
    refuse(replace(header, query=v4_query), "InvalidArgument")


def test_a_request_with_no_signature_is_still_anonymous() -> None:
    v = verifier()
    assert v.verify("GET", "/bkt/k", "Expires=123&prefix=a", CIMultiDict({"Host": "h"})) is None


@pytest.mark.parametrize("presigned", [False, True])
def test_what_a_mismatch_tells_back_is_capped_at_both_ends(presigned: bool) -> None:
    # CanonicalizedAmzHeaders hold every x-amz-* header, and a presigned URL's x-amz-*
    # parameters: as long as the request makes them.
    big = "m" * 50000
    if presigned:
        wire = with_query(presign("GET", "/bkt/k"), "x-amz-meta-big", big)
    else:
        wire = sign("GET", "/bkt/k", headers={"x-amz-meta-big": big}, secret="wrong")
    error = refuse(wire, "SignatureDoesNotMatch")
    string_to_sign = error.fields["StringToSign"]
    assert len(string_to_sign) <= MAX_SHOWN + 64
    assert string_to_sign.startswith("GET\n\n\n")
    assert "characters left out]..." in string_to_sign
    assert string_to_sign.endswith("m\n/bkt/k")
    document = error_document(error.code, error.message, "REQUESTID", error.fields)
    assert len(document) < 2 * MAX_SHOWN + 2048


def test_a_string_to_sign_longer_than_the_cap_is_refused_unhashed() -> None:
    wire = with_query(presign("GET", "/bkt/k"), "x-amz-meta-big", "m" * (MAX_SIGNED_TEXT + 1))
    error = refuse(wire, "InvalidRequest")
    assert "StringToSign" in error.message
    header = sign("GET", "/bkt/k", headers={"x-amz-meta-big": "m" * (MAX_SIGNED_TEXT + 1)})
    refuse(header, "InvalidRequest")


def test_a_signature_or_expiry_of_any_length_is_told_back_capped() -> None:
    wire = presign("GET", "/bkt/k")
    error = refuse(with_query(wire, "Signature", "A" * 60000), "SignatureDoesNotMatch")
    assert len(error.fields["SignatureProvided"]) <= MAX_SHOWN + 64
    error = refuse(with_query(wire, "Expires", "9" * 60000), "AccessDenied")
    assert len(error.message) < MAX_SHOWN + 256


# -- over a real socket --------------------------------------------------------------


def _curl(url: str) -> tuple[int, dict[str, str], bytes]:
    done = subprocess.run(
        ["curl", "-s", "-g", "-D", "-", "-o", "-", url],
        capture_output=True,
        timeout=30,
        check=True,
    )
    head, _, body = done.stdout.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {
        name.strip().lower(): value.strip()
        for name, _, value in (line.partition(":") for line in lines)
    }
    return int(status_line.split()[1]), headers, body


def test_a_default_presigned_url_is_served_to_curl(s3_front: Callable[..., FrontNode]) -> None:
    node = s3_front()
    objects = {
        "shared file.bin": b"presigned bytes",
        "dir/é 日本+plus%pct.txt": "unicode bytes é".encode(),
    }
    for key, data in objects.items():
        (node.files / key).parent.mkdir(parents=True, exist_ok=True)
        (node.files / key).write_bytes(data)
    s3 = node.client()
    for key, data in objects.items():
        url = s3.generate_presigned_url(
            "get_object", Params={"Bucket": "local", "Key": key}, ExpiresIn=300
        )
        assert "AWSAccessKeyId=" in url
        assert "X-Amz-" not in url
        status, _, body = _curl(url)
        assert (status, body) == (200, data), url
    url = s3.generate_presigned_url(
        "get_object",
        Params={
            "Bucket": "local",
            "Key": "shared file.bin",
            "ResponseContentType": "text/plain; charset=utf-8",
        },
        ExpiresIn=300,
    )
    status, headers, body = _curl(url)
    assert (status, body) == (200, b"presigned bytes")
    assert headers["content-type"] == "text/plain; charset=utf-8"
    status, _, body = _curl(url.replace("text%2Fplain", "text%2Fhtml"))
    assert status == 403
    assert ET.fromstring(body).findtext("Code") == "SignatureDoesNotMatch"
    expiring = s3.generate_presigned_url(
        "get_object", Params={"Bucket": "local", "Key": "shared file.bin"}, ExpiresIn=1
    )
    time.sleep(2)
    status, _, body = _curl(expiring)
    assert status == 403
    error = ET.fromstring(body)
    assert error.findtext("Code") == "AccessDenied"
    assert error.findtext("Message") == "Request has expired"
    assert FRONT_SECRET not in node.daemon.log.read_text()


def test_a_sigv2_client_reads_through_the_front(s3_front: Callable[..., FrontNode]) -> None:
    node = s3_front()
    (node.files / "old client.bin").write_bytes(b"v2 bytes")
    s3 = node.client(signature_version="s3", retries={"max_attempts": 1})
    assert s3.get_object(Bucket="local", Key="old client.bin")["Body"].read() == b"v2 bytes"
    assert s3.head_object(Bucket="local", Key="old client.bin")["ContentLength"] == 8
    listed = s3.list_objects_v2(Bucket="local")["Contents"]
    assert [entry["Key"] for entry in listed] == ["old client.bin"]
    wrong = boto3.client(
        "s3",
        endpoint_url=node.endpoint,
        region_name="us-east-1",
        aws_access_key_id=FRONT_KEY,
        aws_secret_access_key="not-the-secret",
        config=Config(signature_version="s3", retries={"max_attempts": 1}),
    )
    with pytest.raises(wrong.exceptions.ClientError) as denied:
        wrong.get_object(Bucket="local", Key="old client.bin")
    assert denied.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
