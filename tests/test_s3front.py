"""The S3 front against a real daemon with moto behind it: what S3 clients rely on.

Ranges at the edges, conditional requests, listings across pages and delimiters
(checked against moto's own answers for the same keys), keys S3 allows and chunkd
cannot hold, the signature checks, bad input of every kind (each the right S3 error
code, never a 5xx, the daemon alive after), and single flight: 8 clients reading one
cold object cost the backend one read.
"""

from __future__ import annotations

import datetime
import email.utils
import http.client
import socket
import subprocess
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_from_bytes, unquote_to_bytes

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.exceptions import ClientError

from chunkd.testing import S3Server
from chunkd.testing.s3front import FRONT_KEY, FRONT_SECRET, front_client
from tests.conftest import FrontNode, get_from_namespace

pytestmark = pytest.mark.timeout(120)

NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


def raw(
    node: FrontNode,
    method: str,
    path: str,
    *,
    query: str = "",
    headers: dict[str, str] | None = None,
    key: str = FRONT_KEY,
    secret: str | None = FRONT_SECRET,
) -> tuple[int, dict[str, str], bytes]:
    """One request as sent on the wire: ``path`` and ``query`` already encoded, signed
    by botocore's own S3 signer unless ``secret`` is None (over the path as S3
    canonicalises it: decoded once, encoded strictly, as a client of that key signs)."""
    target = path + (f"?{query}" if query else "")
    sent = dict(headers or {})
    if secret is not None:
        canonical = quote_from_bytes(unquote_to_bytes(path), safe="/~")
        url = node.endpoint + canonical + (f"?{query}" if query else "")
        request = AWSRequest(method=method, url=url, headers=sent)
        S3SigV4Auth(Credentials(key, secret), "s3", "us-east-1").add_auth(request)
        sent = dict(request.headers.items())
    connection = http.client.HTTPConnection("127.0.0.1", node.port, timeout=30)
    try:
        connection.putrequest(method, target, skip_host="Host" in sent, skip_accept_encoding=True)
        for name, value in sent.items():
            connection.putheader(name, value)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def code_of(body: bytes) -> str:
    """The ``<Code>`` of an S3 error document."""
    return ET.fromstring(body).findtext("Code") or ""


def error_code(call: Callable[[], Any]) -> str:
    with pytest.raises(ClientError) as caught:
        call()
    return str(caught.value.response["Error"]["Code"])


def alive(node: FrontNode) -> None:
    status, _, _ = node.daemon.get("/readyz")
    assert status == 200
    assert node.daemon.process.poll() is None


@pytest.fixture
def front(s3_front: Callable[..., FrontNode]) -> FrontNode:
    return s3_front()


# -- buckets -------------------------------------------------------------------------


def test_buckets_are_the_configured_backends(front: FrontNode) -> None:
    s3 = front.client()
    assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == ["data", "local"]
    assert s3.head_bucket(Bucket="data")["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert s3.get_bucket_location(Bucket="local")["LocationConstraint"] is None
    assert error_code(lambda: s3.head_bucket(Bucket="nope")) == "404"
    assert error_code(lambda: s3.list_objects_v2(Bucket="nope")) == "NoSuchBucket"
    # The moto bucket's own name is no bucket of the front: only configured names are.
    assert error_code(lambda: s3.list_objects_v2(Bucket=front.name)) == "NoSuchBucket"


# -- objects: ranges, conditions, overrides --------------------------------------------


def test_a_conditional_get_of_a_version_not_seen_here_reads_no_span(
    front: FrontNode, s3_server: S3Server
) -> None:
    # A cold GET learns the version from its own first GET, whose span reads ahead; a
    # GET that may be answered 304 asks with a HEAD, and reads nothing it won't send.
    s3_server.client().put_object(Bucket=front.name, Key="cond/big.bin", Body=bytes(12 << 20))
    etag = s3_server.client().head_object(Bucket=front.name, Key="cond/big.bin")["ETag"]
    before = front.proxy.bytes_down
    status, _, body = raw(front, "GET", "/data/cond/big.bin", headers={"If-None-Match": etag})
    assert (status, body) == (304, b"")
    time.sleep(0.5)  # a span started in the background would be reading by now
    assert front.proxy.bytes_down - before < 64 << 10  # a HEAD's answer, no object bytes


def test_ranges_at_the_edges(front: FrontNode) -> None:
    (front.files / "ten").write_bytes(b"0123456789")
    (front.files / "empty").write_bytes(b"")
    s3 = front.client()

    def ranged(spec: str) -> tuple[int, bytes, str | None]:
        got = s3.get_object(Bucket="local", Key="ten", Range=spec)
        meta = got["ResponseMetadata"]
        return meta["HTTPStatusCode"], got["Body"].read(), got.get("ContentRange")

    assert ranged("bytes=0-0") == (206, b"0", "bytes 0-0/10")
    assert ranged("bytes=9-9") == (206, b"9", "bytes 9-9/10")
    assert ranged("bytes=5-100") == (206, b"56789", "bytes 5-9/10")
    assert ranged("bytes=-1") == (206, b"9", "bytes 9-9/10")
    assert ranged("bytes=-100") == (206, b"0123456789", "bytes 0-9/10")
    assert ranged("bytes=0-") == (206, b"0123456789", "bytes 0-9/10")
    # S3 serves the whole object for a Range it cannot read, or several ranges.
    assert ranged("bytes=abc")[:2] == (200, b"0123456789")
    assert ranged("bytes=0-1,4-5")[:2] == (200, b"0123456789")
    assert error_code(lambda: s3.get_object(Bucket="local", Key="ten", Range="bytes=10-")) == (
        "InvalidRange"
    )
    status, headers, body = raw(front, "GET", "/local/ten", headers={"Range": "bytes=10-20"})
    assert (status, code_of(body), headers["Content-Range"]) == (416, "InvalidRange", "bytes */10")
    assert error_code(lambda: s3.get_object(Bucket="local", Key="empty", Range="bytes=0-")) == (
        "InvalidRange"
    )
    assert s3.get_object(Bucket="local", Key="empty")["Body"].read() == b""
    assert s3.get_object(Bucket="local", Key="ten", VersionId="null")["Body"].read() == (
        b"0123456789"
    )
    head = s3.head_object(Bucket="local", Key="ten", Range="bytes=2-4")
    assert (head["ContentLength"], head["ContentRange"]) == (3, "bytes 2-4/10")


def test_conditional_requests(front: FrontNode, s3_server: S3Server) -> None:
    s3_server.client().put_object(Bucket=front.name, Key="c.bin", Body=b"conditional")
    s3 = front.client()
    etag = s3.head_object(Bucket="data", Key="c.bin")["ETag"]
    modified = s3.head_object(Bucket="data", Key="c.bin")["LastModified"]
    before = modified - datetime.timedelta(hours=1)
    after = modified + datetime.timedelta(hours=1)

    def get(**conditions: Any) -> Any:
        return s3.get_object(Bucket="data", Key="c.bin", **conditions)

    assert get(IfMatch=etag)["Body"].read() == b"conditional"
    assert error_code(lambda: get(IfMatch='"0000"')) == "PreconditionFailed"
    assert error_code(lambda: get(IfUnmodifiedSince=before)) == "PreconditionFailed"
    assert get(IfUnmodifiedSince=after)["Body"].read() == b"conditional"
    # If-Match holds, If-Unmodified-Since does not: S3 (and RFC 9110) serve it.
    assert get(IfMatch=etag, IfUnmodifiedSince=before)["Body"].read() == b"conditional"
    assert error_code(lambda: get(IfNoneMatch=etag)) == "304"
    assert error_code(lambda: get(IfModifiedSince=after)) == "304"
    assert get(IfModifiedSince=before)["Body"].read() == b"conditional"
    assert get(IfNoneMatch='"other"', IfModifiedSince=after)["Body"].read() == b"conditional"
    # A 304 carries the validators, and no body; so does a HEAD's.
    status, headers, body = raw(front, "GET", "/data/c.bin", headers={"If-None-Match": etag})
    assert (status, headers["ETag"], body) == (304, etag, b"")
    # The three HTTP date forms, asctime (no zone: GMT) among them.
    asctime = after.astimezone(datetime.UTC).strftime("%a %b %d %H:%M:%S %Y")
    status, _, _ = raw(front, "GET", "/data/c.bin", headers={"If-Modified-Since": asctime})
    assert status == 304
    # If-Match compares strongly (a weak tag never matches), If-None-Match weakly.
    assert error_code(lambda: get(IfMatch=f"W/{etag}")) == "PreconditionFailed"
    assert error_code(lambda: get(IfNoneMatch=f"W/{etag}")) == "304"
    assert error_code(lambda: s3.head_object(Bucket="data", Key="c.bin", IfMatch='"x"')) == "412"


def test_etag_and_last_modified_pass_through(front: FrontNode, s3_server: S3Server) -> None:
    direct = s3_server.client()
    direct.put_object(Bucket=front.name, Key="p/v.bin", Body=b"v" * 1000)
    theirs = direct.head_object(Bucket=front.name, Key="p/v.bin")
    ours = front.client().head_object(Bucket="data", Key="p/v.bin")
    assert ours["ETag"] == theirs["ETag"]
    assert ours["LastModified"] == theirs["LastModified"]
    assert ours["ContentLength"] == 1000
    listed = front.client().list_objects_v2(Bucket="data", Prefix="p/")["Contents"][0]
    assert (listed["ETag"], listed["Size"]) == (theirs["ETag"], 1000)


def test_response_header_overrides(front: FrontNode) -> None:
    (front.files / "o.txt").write_bytes(b"override")
    got = front.client().get_object(
        Bucket="local",
        Key="o.txt",
        ResponseContentType="text/plain; charset=utf-8",
        ResponseContentDisposition='attachment; filename="o.txt"',
        ResponseCacheControl="no-store",
        ResponseContentLanguage="en",
    )
    assert got["ContentType"] == "text/plain; charset=utf-8"
    assert got["ContentDisposition"] == 'attachment; filename="o.txt"'
    assert got["CacheControl"] == "no-store"
    assert got["ContentLanguage"] == "en"
    assert got["Body"].read() == b"override"


SPECIAL_KEYS = [
    "with space/a b.txt",
    "données/é.txt",
    "plus+sign.bin",
    "per%cent.bin",
    "eq=amp&semi;.bin",
    "tilde~star*(paren).bin",
    "日本/語.bin",
]


def test_keys_with_spaces_unicode_plus_and_percent(front: FrontNode, s3_server: S3Server) -> None:
    direct = s3_server.client()
    for number, key in enumerate(SPECIAL_KEYS):
        direct.put_object(Bucket=front.name, Key=key, Body=f"{number}:{key}".encode())
    s3 = front.client()
    for number, key in enumerate(SPECIAL_KEYS):
        assert s3.get_object(Bucket="data", Key=key)["Body"].read() == f"{number}:{key}".encode()
        assert s3.head_object(Bucket="data", Key=key)["ContentLength"] == len(
            f"{number}:{key}".encode()
        )
    listed = [c["Key"] for c in s3.list_objects_v2(Bucket="data")["Contents"]]
    assert listed == sorted(SPECIAL_KEYS, key=lambda k: k.encode())


def test_keys_chunkd_cannot_hold_are_no_such_key(front: FrontNode) -> None:
    (front.files / "dir").mkdir()
    (front.files / "dir" / "f").write_bytes(b"f")
    (front.files / "top").write_bytes(b"top")
    s3 = front.client()
    for key in ["dir/", "dir//f", "./top", "dir/./f", "dir/../top", "../top", "a\\b"]:
        assert error_code(lambda key=key: s3.get_object(Bucket="local", Key=key)) == "NoSuchKey"
        assert error_code(lambda key=key: s3.head_object(Bucket="local", Key=key)) == "404"
    # On the wire, as a path trick would send them: never a 400, never a file outside.
    for path in [
        "/local/dir/",
        "/local/..%2f..%2fetc%2fpasswd",
        "/local/%2e%2e/%2e%2e/etc/passwd",
        "/local/dir%00f",
        "/local/%ff%fe",
        "/local//top",
    ]:
        status, _, body = raw(front, "GET", path)
        assert (status, code_of(body)) == (404, "NoSuchKey"), path
        status, _, body = raw(front, "HEAD", path)
        assert (status, body) == (404, b""), path
    for path in ["/..%2f..%2fetc/passwd", "/%ff/x", "/no-such/x"]:
        status, _, body = raw(front, "GET", path)
        assert (status, code_of(body)) == (404, "NoSuchBucket"), path
    alive(front)


# -- listings --------------------------------------------------------------------------

# Keys that cover what listing semantics turn on: a prefix that is not a directory, a
# key that is a prefix of others, keys that sort around "/", deep and shallow levels.
LISTED_KEYS = [
    "a",
    "a/b",
    "a/b/c",
    "a/b/d",
    "a/bc",
    "a.b",
    "a-b/x",
    "ab/x",
    "ab/y/z",
    "b/1",
    "b/2",
    "b/3/4",
    "c d/é",
    "c+d",
    "c%d",
    "zz",
]


def _listing(client: Any, bucket: str, **params: Any) -> list[tuple[str, ...]]:
    """Every page of a ListObjectsV2, as (kind, name) rows in the order answered."""
    rows: list[tuple[str, ...]] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, **params):
        rows += [("key", c["Key"], str(c["Size"])) for c in page.get("Contents", [])]
        rows += [("prefix", p["Prefix"]) for p in page.get("CommonPrefixes", [])]
        rows.append(("page",))
    return rows


def _listing_v1(client: Any, bucket: str, **params: Any) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for page in client.get_paginator("list_objects").paginate(Bucket=bucket, **params):
        rows += [("key", c["Key"]) for c in page.get("Contents", [])]
        rows += [("prefix", p["Prefix"]) for p in page.get("CommonPrefixes", [])]
        rows.append(("page",))
    return rows


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"Delimiter": "/"},
        {"Prefix": "a"},
        {"Prefix": "a", "Delimiter": "/"},
        {"Prefix": "a/", "Delimiter": "/"},
        {"Prefix": "a/b", "Delimiter": "/"},
        {"Prefix": "ab/", "Delimiter": "/"},
        {"Prefix": "c", "Delimiter": "/"},
        {"Prefix": "nothing"},
        {"Delimiter": "/", "PaginationConfig": {"PageSize": 1}},
        {"Delimiter": "/", "PaginationConfig": {"PageSize": 2}},
        {"PaginationConfig": {"PageSize": 3}},
        {"StartAfter": "a/b"},
        # (StartAfter inside a common prefix is left out: moto drops the prefix, as a
        # string that sorts before StartAfter; the front rolls up the keys after it, as
        # S3 does. test_start_after_inside_a_prefix checks the front's answer.)
        {"StartAfter": "b", "Delimiter": "/", "PaginationConfig": {"PageSize": 2}},
        {"Delimiter": "b"},
        {"Prefix": "a", "Delimiter": "b/"},
    ],
)
def test_listing_matches_s3(front: FrontNode, s3_server: S3Server, params: dict[str, Any]) -> None:
    """The same keys, the same parameters: the front answers what moto (S3) does, page
    for page."""
    direct = s3_server.client()
    for key in LISTED_KEYS:
        direct.put_object(Bucket=front.name, Key=key, Body=key.encode())
    ours = _listing(front.client(), "data", **params)
    theirs = _listing(direct, front.name, **params)
    assert ours == theirs


@pytest.mark.parametrize(
    "params",
    [
        {"Delimiter": "/"},
        {"Prefix": "a", "Delimiter": "/"},
        {"Marker": "a/b"},
        {"Marker": "a/b", "PaginationConfig": {"PageSize": 3}},
    ],
)
def test_listing_v1_matches_s3(
    front: FrontNode, s3_server: S3Server, params: dict[str, Any]
) -> None:
    direct = s3_server.client()
    for key in LISTED_KEYS:
        direct.put_object(Bucket=front.name, Key=key, Body=key.encode())
    assert _listing_v1(front.client(), "data", **params) == _listing_v1(
        direct, front.name, **params
    )


def test_start_after_inside_a_prefix_and_v1_pages(front: FrontNode, s3_server: S3Server) -> None:
    direct = s3_server.client()
    for key in LISTED_KEYS:
        direct.put_object(Bucket=front.name, Key=key, Body=key.encode())
    s3 = front.client()
    # The keys after a/b roll up into a/ again, as S3 lists them.
    after = s3.list_objects_v2(Bucket="data", StartAfter="a/b", Delimiter="/")
    assert [p["Prefix"] for p in after["CommonPrefixes"]][:2] == ["a/", "ab/"]
    # v1 says where to go on whenever it is truncated, with a delimiter or without.
    first = s3.list_objects(Bucket="data", MaxKeys=2)
    assert (first["IsTruncated"], first["NextMarker"]) == (True, "a-b/x")
    # v1 with a delimiter pages keys and prefixes together, NextMarker the last of either.
    rows = _listing_v1(s3, "data", Delimiter="/", PaginationConfig={"PageSize": 2})
    pages = [i for i, row in enumerate(rows) if row == ("page",)]
    assert all(b - a <= 3 for a, b in zip([-1, *pages], pages, strict=False))
    names = [row[1] for row in rows if row != ("page",)]
    assert sorted(names) == sorted(
        ["a", "a-b/", "a.b", "a/", "ab/", "b/", "c d/", "c+d", "c%d", "zz"]
    )


def test_folder_markers_are_no_objects(front: FrontNode, s3_server: S3Server) -> None:
    """Zero-byte ``m/`` markers (S3 consoles make them) are not listed as objects ``m``
    that a GET could not find; a real empty object is."""
    direct = s3_server.client()
    for key in ("m/", "m/x", "n/o/", "empty", "n/_SUCCESS"):
        direct.put_object(Bucket=front.name, Key=key, Body=b"x" if key == "m/x" else b"")
    s3 = front.client()
    keys = [c["Key"] for c in s3.list_objects_v2(Bucket="data")["Contents"]]
    assert keys == ["empty", "m/x", "n/_SUCCESS"]
    level = s3.list_objects_v2(Bucket="data", Delimiter="/")
    assert [c["Key"] for c in level["Contents"]] == ["empty"]
    assert [p["Prefix"] for p in level["CommonPrefixes"]] == ["m/", "n/"]
    assert error_code(lambda: s3.head_object(Bucket="data", Key="m/")) == "404"
    assert error_code(lambda: s3.head_object(Bucket="data", Key="m")) == "404"


def test_listing_at_scale(front: FrontNode) -> None:
    """20,000 keys in 200 directories: every key once, in order, in pages of at most
    1,000; a directory level pages its 200 prefixes; max-keys is capped at 1,000."""
    for d in range(200):
        folder = front.files / "big" / f"d{d:03d}"
        folder.mkdir(parents=True)
        for f in range(100):
            (folder / f"f{f:03d}").write_bytes(b"")
    s3 = front.client()
    keys: list[str] = []
    pages = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket="local", Prefix="big/"):
        assert page["KeyCount"] <= 1000
        keys += [c["Key"] for c in page.get("Contents", [])]
        pages += 1
    assert keys == [f"big/d{d:03d}/f{f:03d}" for d in range(200) for f in range(100)]
    # A page that ends with a full batch of the backend's listing does not look past it
    # (a backend request per page): with 20 x 1,000 keys the 21st page may come empty.
    assert pages in (20, 21)
    level = s3.list_objects_v2(Bucket="local", Prefix="big/", Delimiter="/", MaxKeys=150)
    assert [p["Prefix"] for p in level["CommonPrefixes"]] == [f"big/d{d:03d}/" for d in range(150)]
    assert level["IsTruncated"]
    rest = s3.list_objects_v2(
        Bucket="local",
        Prefix="big/",
        Delimiter="/",
        ContinuationToken=level["NextContinuationToken"],
    )
    assert (len(rest["CommonPrefixes"]), rest["IsTruncated"]) == (50, False)
    capped = s3.list_objects_v2(Bucket="local", Prefix="big/", MaxKeys=5000)
    assert (capped["KeyCount"], capped["MaxKeys"], capped["IsTruncated"]) == (1000, 1000, True)
    none = s3.list_objects_v2(Bucket="local", Prefix="big/", MaxKeys=0)
    assert (none["KeyCount"], "Contents" in none) == (0, False)


def test_listing_params_and_encoding(front: FrontNode) -> None:
    (front.files / "sp ace").mkdir()
    (front.files / "sp ace" / "a+b%c").write_bytes(b"1")
    s3 = front.client()
    owned = s3.list_objects_v2(Bucket="local", FetchOwner=True)["Contents"][0]
    assert (owned["Key"], owned["Owner"]["ID"]) == ("sp ace/a+b%c", "chunkd")
    assert "Owner" not in s3.list_objects_v2(Bucket="local")["Contents"][0]
    # Without encoding-type, the key as XML text; with it, url-encoded as S3 does.
    status, _, body = raw(front, "GET", "/local", query="list-type=2")
    assert status == 200
    assert ET.fromstring(body).find(f"{NS}Contents/{NS}Key").text == "sp ace/a+b%c"  # type: ignore[union-attr]
    status, _, body = raw(front, "GET", "/local", query="encoding-type=url&list-type=2")
    assert ET.fromstring(body).find(f"{NS}Contents/{NS}Key").text == "sp%20ace/a%2Bb%25c"  # type: ignore[union-attr]


# -- auth --------------------------------------------------------------------------------


def test_signatures_are_checked(front: FrontNode, monkeypatch: pytest.MonkeyPatch) -> None:
    (front.files / "s").write_bytes(b"secret bytes")
    wrong = front_client(front.endpoint)
    wrong._request_signer._credentials = Credentials(FRONT_KEY, "not-the-secret")
    assert error_code(lambda: wrong.get_object(Bucket="local", Key="s")) == (
        "SignatureDoesNotMatch"
    )
    status, _, body = raw(front, "GET", "/local/s", key="unknown-key")
    assert (status, code_of(body)) == (403, "InvalidAccessKeyId")
    status, _, body = raw(front, "GET", "/local/s", secret=None)
    assert (status, code_of(body)) == (403, "AccessDenied")
    # A request signed 20 minutes ago (or ahead) is refused, whoever signed it.
    import botocore.auth

    skewed = datetime.datetime.now(datetime.UTC).replace(tzinfo=None) - datetime.timedelta(
        minutes=20
    )
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: skewed)
    status, _, body = raw(front, "GET", "/local/s")
    assert (status, code_of(body)) == (403, "RequestTimeTooSkewed")
    monkeypatch.undo()
    # A signed request with one header changed after signing.
    request = AWSRequest(
        method="GET", url=f"{front.endpoint}/local/s", headers={"Range": "bytes=0-1"}
    )
    S3SigV4Auth(Credentials(FRONT_KEY, FRONT_SECRET), "s3", "us-east-1").add_auth(request)
    sent = dict(request.headers.items())
    sent["Range"] = "bytes=0-5"
    status, _, body = raw(front, "GET", "/local/s", headers=sent, secret=None)
    assert (status, code_of(body)) == (403, "SignatureDoesNotMatch")
    log = front.daemon.log.read_text()
    assert FRONT_SECRET not in log
    status, _, stats = front.daemon.get("/v1/stats")
    assert status == 200
    assert FRONT_SECRET.encode() not in stats
    assert b'"***"' in stats


def _curl(url: str) -> tuple[int, bytes]:
    done = subprocess.run(
        ["curl", "-s", "-g", "-o", "-", "-w", "\n%{http_code}", url],
        capture_output=True,
        timeout=30,
        check=True,
    )
    body, _, status = done.stdout.rpartition(b"\n")
    return int(status), body


def test_presigned_urls_with_curl(front: FrontNode) -> None:
    (front.files / "shared file.bin").write_bytes(b"presigned bytes")
    s3 = front_client(front.endpoint, signature_version="s3v4")
    url = s3.generate_presigned_url(
        "get_object", Params={"Bucket": "local", "Key": "shared file.bin"}, ExpiresIn=60
    )
    assert "X-Amz-Signature=" in url
    assert _curl(url) == (200, b"presigned bytes")
    # One character of the signature changed, or of the key.
    tampered = url[:-1] + ("0" if url[-1] != "0" else "1")
    status, body = _curl(tampered)
    assert (status, code_of(body)) == (403, "SignatureDoesNotMatch")
    status, body = _curl(url.replace("shared%20file", "shared%20filf"))
    assert (status, code_of(body)) == (403, "SignatureDoesNotMatch")
    expiring = s3.generate_presigned_url(
        "get_object", Params={"Bucket": "local", "Key": "shared file.bin"}, ExpiresIn=1
    )
    time.sleep(2.1)
    status, body = _curl(expiring)
    assert (status, code_of(body)) == (403, "AccessDenied")
    assert b"expired" in body


def test_unsigned_requests_only_from_loopback_when_allowed(
    s3_front: Callable[..., FrontNode],
) -> None:
    node = s3_front(unsigned_from_loopback=True)
    (node.files / "open").write_bytes(b"open")
    status, _, body = raw(node, "GET", "/local/open", secret=None)
    assert (status, body) == (200, b"open")
    # Signed requests are still checked: a bad signature is no unsigned request.
    status, _, body = raw(node, "GET", "/local/open", secret="wrong-secret")
    assert (status, code_of(body)) == (403, "SignatureDoesNotMatch")


def test_keys_file_is_read_again_when_it_changes(
    s3_front: Callable[..., FrontNode], tmp_path: Path
) -> None:
    keys = tmp_path / "front.keys"
    keys.write_text("# the front's keys\nfirst-key first-secret-123\n")
    keys.chmod(0o600)
    node = s3_front(keys_file=str(keys))
    (node.files / "k").write_bytes(b"k")
    assert raw(node, "GET", "/local/k", key="first-key", secret="first-secret-123")[0] == 200
    assert raw(node, "GET", "/local/k")[0] == 200  # the key of the config stays
    keys.write_text("second-key second-secret-456\n")
    deadline = time.monotonic() + 10
    while raw(node, "GET", "/local/k", key="first-key", secret="first-secret-123")[0] == 200:
        assert time.monotonic() < deadline, "a key taken out of the file still works"
        time.sleep(0.2)
    status, _, body = raw(node, "GET", "/local/k", key="first-key", secret="first-secret-123")
    assert (status, code_of(body)) == (403, "InvalidAccessKeyId")
    assert raw(node, "GET", "/local/k", key="second-key", secret="second-secret-456")[0] == 200


@pytest.mark.parametrize(
    ("front_keys", "wanted"),
    [
        ({"access_key_id": ""}, "access_key_id and secret_access_key go together"),
        ({"keys_file": "/nonexistent/keys"}, "cannot read it"),
    ],
)
def test_bad_front_config_is_refused_at_start(
    start_daemon: Callable[..., Any], tmp_path: Path, front_keys: dict[str, str], wanted: str
) -> None:
    from chunkd.testing.s3front import front_section

    section = front_section(18999, **front_keys)
    if front_keys.get("access_key_id") == "":
        section = section.replace('access_key_id = ""\n', "")
        section = "\n".join(line for line in section.splitlines() if "access_key_id" not in line)
    toml = f'{section}\n[[backends]]\nname = "local"\nurl = "file://{tmp_path}"\n'
    daemon = start_daemon(toml, wait=False)
    assert daemon.process.wait(timeout=30) == 2
    assert wanted in daemon.log.read_text()


def test_no_keys_and_no_unsigned_is_refused(
    start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    toml = f'[s3_front]\nlisten = "127.0.0.1:18998"\n[[backends]]\nname = "l"\nurl = "file://{tmp_path}"\n'
    daemon = start_daemon(toml, wait=False)
    assert daemon.process.wait(timeout=30) == 2
    assert "[s3_front] has no access key" in daemon.log.read_text()


# -- bad input -------------------------------------------------------------------------


def test_bad_requests_get_s3_errors_never_a_5xx(front: FrontNode) -> None:
    (front.files / "x").write_bytes(b"x")
    cases: list[tuple[str, str, str, dict[str, str], int, str]] = [
        ("GET", "/local", "list-type=2&max-keys=abc", {}, 400, "InvalidArgument"),
        ("GET", "/local", "list-type=2&max-keys=-1", {}, 400, "InvalidArgument"),
        ("GET", "/local", "list-type=2&max-keys=%C2%B2", {}, 400, "InvalidArgument"),
        ("GET", "/local", "list-type=2&start-after=" + "s" * 1100, {}, 400, "InvalidArgument"),
        ("GET", "/local", "marker=" + "m" * 1100, {}, 400, "InvalidArgument"),
        (
            "GET",
            "/local",
            "list-type=2&continuation-token=" + "A" * 3000,
            {},
            400,
            "InvalidArgument",
        ),
        ("GET", "/local/x", "response-content-type=a%0Db", {}, 400, "InvalidArgument"),
        ("GET", "/local/x", "response-cache-control=%7F", {}, 400, "InvalidArgument"),
        ("GET", "/local", "list-type=3", {}, 400, "InvalidArgument"),
        ("GET", "/local", "list-type=2&encoding-type=base64", {}, 400, "InvalidArgument"),
        ("GET", "/local", "list-type=2&continuation-token=garbage", {}, 400, "InvalidArgument"),
        ("GET", "/local", "list-type=2&continuation-token=%FF%FE", {}, 400, "InvalidArgument"),
        ("GET", "/local", "list-type=2&prefix=" + "p" * 2000, {}, 400, "InvalidArgument"),
        ("GET", "/local", "acl", {}, 405, "NotImplemented"),
        ("GET", "/local", "versions", {}, 405, "NotImplemented"),
        ("GET", "/local/x", "tagging", {}, 405, "NotImplemented"),
        ("GET", "/local/x", "partNumber=2", {}, 416, "InvalidPartNumber"),
        ("GET", "/local/x", "versionId=3HL4kqtJlcpXroDTDmJ", {}, 405, "NotImplemented"),
        ("HEAD", "/local/x", "versionId=3HL4kqtJlcpXroDTDmJ", {}, 405, ""),
        ("PUT", "/local/new", "", {}, 405, "NotImplemented"),
        ("PUT", "/local/chunks/" + "0" * 64, "", {}, 403, "AccessDenied"),
        ("PUT", "/local/checkpoints/run/step-1/manifest.json", "", {}, 403, "AccessDenied"),
        ("DELETE", "/local/intents/a.json", "", {}, 403, "AccessDenied"),
        ("PUT", "/local/datasets/names/x", "", {}, 403, "AccessDenied"),
        ("PUT", "/local/gc/x.json", "", {}, 403, "AccessDenied"),
        ("PUT", "/local/gcx", "", {}, 405, "NotImplemented"),
        ("POST", "/local/x", "uploads", {}, 405, "NotImplemented"),
        ("DELETE", "/local/x", "", {}, 405, "NotImplemented"),
        ("PUT", "/newbucket", "", {}, 405, "NotImplemented"),
        ("POST", "/local", "delete", {}, 405, "NotImplemented"),
        ("PATCH", "/local/x", "", {}, 405, "MethodNotAllowed"),
        ("GET", "/local/x", "", {"X-Big": "b" * 9000}, 400, "RequestHeaderSectionTooLarge"),
    ]
    for method, path, query, headers, status, code in cases:
        got, _, body = raw(front, method, path, query=query, headers=headers)
        assert (got, code_of(body) if body else "") == (status, code), (method, path, query)
    alive(front)


def _send_raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(data)
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_what_the_parser_refuses_is_s3_xml(front: FrontNode) -> None:
    """A header past what the HTTP parser takes, or a broken request line, is still
    answered in S3 XML (aiohttp alone would answer plain text)."""
    huge = b"GET /local/x HTTP/1.1\r\nHost: x\r\nX-Huge: " + b"h" * 100_000 + b"\r\n\r\n"
    answer = _send_raw(front.port, huge)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400"
    assert code_of(body) == "RequestHeaderSectionTooLarge"
    many = b"".join(b"X-H%d: v\r\n" % n for n in range(300))
    answer = _send_raw(front.port, b"GET /local/x HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert (head.split(b" ")[1], code_of(body)) == (b"400", "RequestHeaderSectionTooLarge")
    answer = _send_raw(front.port, b"GET /\x00\x01 HTTP/9.9\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert (head.split(b" ")[1], code_of(body)) == (b"400", "InvalidRequest")
    alive(front)


# -- the read path ---------------------------------------------------------------------


def test_eight_clients_on_a_cold_object_cost_one_backend_read(
    front: FrontNode, s3_server: S3Server
) -> None:
    size = 24 << 20
    payload = bytes(range(256)) * (size // 256)
    s3_server.client().put_object(Bucket=front.name, Key="cold.bin", Body=payload)
    front.proxy.bytes_down = 0
    results: list[bytes] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def read() -> None:
        try:
            client = front.client()
            barrier.wait()
            results.append(client.get_object(Bucket="data", Key="cold.bin")["Body"].read())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=100)
    assert not errors
    assert len(results) == 8
    assert all(r == payload for r in results)
    assert size <= front.proxy.bytes_down <= size * 1.05
    assert front.daemon.metric("chunkd_s3_requests_total", op="GetObject", code="OK") == 8


def test_a_changed_object_is_read_at_its_new_version(
    s3_front: Callable[..., FrontNode],
) -> None:
    node = s3_front()
    path = node.files / "v.txt"
    path.write_bytes(b"version one")
    s3 = node.client()
    first = s3.get_object(Bucket="local", Key="v.txt")
    assert first["Body"].read() == b"version one"
    time.sleep(1.1)
    path.write_bytes(b"version two!")
    later = time.time() + 1
    while time.time() < later + 5:
        got = s3.get_object(Bucket="local", Key="v.txt")
        body = got["Body"].read()
        if body != b"version one":
            break
        time.sleep(0.3)
    assert body == b"version two!"
    assert got["ETag"] != first["ETag"]
    assert email.utils.parsedate_to_datetime(
        got["ResponseMetadata"]["HTTPHeaders"]["last-modified"]
    )


def test_quoted_keys_round_trip_through_the_signature(front: FrontNode) -> None:
    """A key's every byte as clients encode it on the wire (botocore, object_store)."""
    key = "q/ !\"#$&'()*+,;=@[]^`{|}~é"
    (front.files / "q").mkdir()
    (front.files / "q" / key.removeprefix("q/")).write_bytes(b"quoted")
    status, _, body = raw(front, "GET", "/local/" + quote(key, safe="/~"))
    assert (status, body) == (200, b"quoted")
    assert front.client().get_object(Bucket="local", Key=key)["Body"].read() == b"quoted"


def test_https_with_the_front_certificate(
    s3_front: Callable[..., FrontNode], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With tls_cert and tls_key the front serves HTTPS only; a client that trusts the
    CA (AWS_CA_BUNDLE) reads, one that does not refuses the certificate."""
    from tests.test_peers_tls import Authority

    authority = Authority(tmp_path / "pki", "front")
    cert, key = authority.issue("s3-front")
    node = s3_front(tls_cert=str(cert), tls_key=str(key))
    (node.files / "tls.bin").write_bytes(b"over tls")
    endpoint = node.endpoint.replace("http://", "https://")
    monkeypatch.setenv("AWS_CA_BUNDLE", str(authority.pem))
    assert front_client(endpoint).get_object(Bucket="local", Key="tls.bin")["Body"].read() == (
        b"over tls"
    )
    monkeypatch.delenv("AWS_CA_BUNDLE")
    from botocore.exceptions import SSLError

    with pytest.raises(SSLError):
        front_client(endpoint, retries={"max_attempts": 1}).head_object(
            Bucket="local", Key="tls.bin"
        )
    with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
        raw(node, "GET", "/local/tls.bin")  # plain HTTP gets no answer


def test_a_dead_backend_is_service_unavailable_then_heals(
    front: FrontNode, s3_server: S3Server
) -> None:
    """The backend down: a cold read is 503 ServiceUnavailable with Retry-After (S3's
    answer a client retries), never a hang; what is cached still reads; then it heals."""
    direct = s3_server.client()
    direct.put_object(Bucket=front.name, Key="warm.bin", Body=b"w" * 1000)
    direct.put_object(Bucket=front.name, Key="cold.bin", Body=b"c" * 1000)
    s3 = front.client(retries={"max_attempts": 1})
    assert s3.get_object(Bucket="data", Key="warm.bin")["Body"].read() == b"w" * 1000
    front.proxy.down()
    try:
        status, headers, body = raw(front, "GET", "/data/cold.bin")
        assert (status, code_of(body)) == (503, "ServiceUnavailable")
        assert headers["Retry-After"] == "5"
        status, _, body = raw(front, "GET", "/data", query="list-type=2&prefix=c")
        assert (status, code_of(body)) == (503, "ServiceUnavailable")
        # The answer names no endpoint or bucket of the backend; the log does.
        assert front.name.encode() not in body
        assert str(front.proxy.port).encode() not in body
        alive(front)
    finally:
        front.proxy.up()
    assert s3.get_object(Bucket="data", Key="cold.bin")["Body"].read() == b"c" * 1000


def test_random_requests_never_get_a_5xx(s3_front: Callable[..., FrontNode]) -> None:
    """400 requests of random methods, paths, queries and headers, unsigned (let in from
    loopback, so they reach the door's every branch) and signed: each answer is an S3
    error document or a success, never a 5xx, and the daemon lives. Seeded: a failure
    replays with the same seed."""
    import random

    node = s3_front(unsigned_from_loopback=True)
    (node.files / "d").mkdir()
    (node.files / "d" / "f").write_bytes(b"f" * 100)
    seed = 20261201
    rng = random.Random(seed)
    parts = [
        "local",
        "data",
        "d",
        "f",
        "..",
        ".",
        "",
        "%00",
        "%ff",
        "%2F",
        "a%20b",
        "%C3%A9",
        "+",
        "~",
    ]
    names = ["list-type", "prefix", "delimiter", "max-keys", "continuation-token", "marker",
             "start-after", "encoding-type", "fetch-owner", "location", "acl", "versionId",
             "partNumber", "response-content-type", "uploads", "X-Amz-Signature",
             "X-Amz-Credential", "X-Amz-Date", "X-Amz-Expires", "Signature",
             "AWSAccessKeyId"]  # fmt: skip
    values = ["", "2", "1", "0", "-1", "abc", "/", "%ff", "url", "99999999999", "a%20b", "null"]
    headers = ["Range", "If-Match", "If-None-Match", "If-Modified-Since", "Authorization",
               "X-Amz-Date", "X-Amz-Content-Sha256", "If-Unmodified-Since"]  # fmt: skip
    header_values = ["bytes=0-", "bytes=-5", "bytes=9-1", "*", '"x"', "AWS4-HMAC-SHA256 x",
                     "Tue, 01 Dec 2026 00:00:00 GMT", "garbage", "AWS a:b", ""]  # fmt: skip
    for number in range(400):
        method = rng.choice(["GET", "GET", "GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS"])
        path = "/" + "/".join(rng.choice(parts) for _ in range(rng.randint(0, 4)))
        query = "&".join(
            f"{rng.choice(names)}={rng.choice(values)}" for _ in range(rng.randint(0, 3))
        )
        sent = {rng.choice(headers): rng.choice(header_values) for _ in range(rng.randint(0, 3))}
        sign = rng.random() < 0.3
        status, _, body = raw(
            node, method, path, query=query, headers=sent, secret=FRONT_SECRET if sign else None
        )
        where = f"seed {seed}, request {number}: {method} {path}?{query} {sent}"
        assert status < 500, where
        if status >= 400 and method != "HEAD":
            assert code_of(body), where
    alive(node)


def test_three_nodes_fronts_read_one_cold_object_once_from_the_backend(
    start_daemon: Callable[..., Any],
    tmp_path: Path,
    bucket: str,
    s3_proxy: Any,
    s3_server: S3Server,
) -> None:
    """The front is a door onto the read path, peers included: three nodes' fronts
    reading one cold object at once cost the backend about one read of it."""
    import os

    from chunkd.testing import free_port
    from chunkd.testing.s3front import front_section
    from tests.test_peers import node_toml

    data = os.urandom(16 << 20)
    s3_server.client().put_object(Bucket=bucket, Key="pre/shards/000.bin", Body=data)
    ports = [free_port() for _ in range(3)]
    fronts = [free_port() for _ in range(3)]
    nodes = [
        start_daemon(
            node_toml(tmp_path, bucket, s3_proxy, f"n{i}", port, ports)
            + "\n"
            + front_section(fronts[i]),
            cwd=tmp_path / f"n{i}",
            env={"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{port}"},
            port=port,
        )
        for i, port in enumerate(ports)
    ]
    deadline = time.monotonic() + 20
    while any(n.metric("chunkd_peer_healthy") < 3 for n in nodes):
        assert time.monotonic() < deadline, "the nodes never all saw each other up"
        time.sleep(0.1)
    s3_proxy.reset()
    results: list[bytes | None] = [None] * 3

    def read(i: int) -> None:
        client = front_client(f"http://127.0.0.1:{fronts[i]}")
        results[i] = client.get_object(Bucket="ckpt", Key="shards/000.bin")["Body"].read()

    threads = [threading.Thread(target=read, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=100)
    assert results == [data, data, data]
    logs = [n.log.read_text() for n in nodes]
    broken = sum(text.count("a span GET failed") + text.count("; retry ") for text in logs)
    assert len(data) <= s3_proxy.bytes_down <= 1.05 * len(data) + broken * (4 << 20)
    assert sum(n.metric("chunkd_peer_bytes_total", direction="in") for n in nodes) > 0


def test_a_bucket_key_the_client_cannot_name_fails_only_its_listings(
    front: FrontNode, s3_server: S3Server
) -> None:
    """An S3 key with an empty segment ("a//b") stops a listing that reaches it, with
    an error that says so; other prefixes list, reads work, and the backend is not
    counted as failing (its circuit stays closed)."""
    direct = s3_server.client()
    for key in ("a/1", "a//b", "b/2"):
        direct.put_object(Bucket=front.name, Key=key, Body=b"x")
    s3 = front.client(retries={"max_attempts": 1})
    status, _, body = raw(front, "GET", "/data", query="list-type=2")
    assert (status, code_of(body)) == (500, "InternalError")
    assert b"empty, '.' or '..' segment" in body
    assert [c["Key"] for c in s3.list_objects_v2(Bucket="data", Prefix="b/")["Contents"]] == ["b/2"]
    for _ in range(6):  # more than the failures that would open the circuit
        raw(front, "GET", "/data", query="list-type=2")
    assert s3.get_object(Bucket="data", Key="b/2")["Body"].read() == b"x"


def test_unsigned_requests_from_another_host_are_refused_even_when_allowed(
    s3_front: Callable[..., FrontNode], other_host: tuple[str, str]
) -> None:
    """unsigned_from_loopback lets in this host's unsigned requests only: from another
    host (a network namespace) an unsigned GET is AccessDenied, a presigned one reads."""

    from chunkd.testing import free_port

    ns, host_ip = other_host
    port = free_port()
    node = s3_front(listen=f"{host_ip}:{port}", unsigned_from_loopback=True)
    (node.files / "far.bin").write_bytes(b"far away")
    endpoint = f"http://{host_ip}:{port}"
    presigned = front_client(endpoint, signature_version="s3v4").generate_presigned_url(
        "get_object", Params={"Bucket": "local", "Key": "far.bin"}, ExpiresIn=60
    )

    def from_there(url: str) -> tuple[int, str]:
        return get_from_namespace(ns, url)

    status, body = from_there(f"{endpoint}/local/far.bin")
    assert status == 403
    assert "<Code>AccessDenied</Code>" in body
    assert from_there(presigned) == (200, "far away")


def test_sigv2_can_be_turned_off_and_a_readable_keys_file_is_warned_of(
    s3_front: Callable[..., FrontNode], tmp_path: Path
) -> None:
    keys = tmp_path / "loose.keys"
    keys.write_text("loose-key loose-secret-123\n")
    keys.chmod(0o644)
    node = s3_front(sigv2=False, keys_file=str(keys))
    (node.files / "v2.bin").write_bytes(b"v2")
    v2_url = node.client().generate_presigned_url(
        "get_object", Params={"Bucket": "local", "Key": "v2.bin"}, ExpiresIn=60
    )
    assert "AWSAccessKeyId=" in v2_url  # boto3's default for us-east-1
    status, body = _curl(v2_url)
    assert (status, code_of(body)) == (400, "InvalidRequest")
    assert b"sigv2 = false" in body
    v4_url = front_client(node.endpoint, signature_version="s3v4").generate_presigned_url(
        "get_object", Params={"Bucket": "local", "Key": "v2.bin"}, ExpiresIn=60
    )
    assert _curl(v4_url) == (200, b"v2")
    log = node.daemon.log.read_text()
    assert "other users may read it (mode 0644)" in log
    assert "loose-secret-123" not in log
