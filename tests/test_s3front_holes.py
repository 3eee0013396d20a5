"""The S3 front's holes found by the adversarial probe of issue 24, each against a real
daemon with moto behind it, through real clients (boto3, curl, urllib, raw sockets).

- DNS rebinding: an unsigned request from loopback under a Host that is not the front's
  own (or sent by a page of another site) is refused; signed ones are not affected.
- Keys ending in ``/`` with a body: a listing shows no key a GET cannot find.
- A bucket deleted behind the front is ``NoSuchBucket``, as S3 says, not ``NoSuchKey``.
- Hostile dates and numbers in headers and the query: a 4xx or the documented 200/304,
  never a 500 and never a traceback in the log.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from botocore import UNSIGNED
from botocore.exceptions import ClientError

from chunkd.testing import S3Server, s3_backend
from chunkd.testing.s3front import front_client
from tests.conftest import FrontNode
from tests.test_s3front import alive, code_of, error_code, raw

FOREIGN = "rebind.evil.example"


@pytest.fixture
def unsigned(s3_front: Callable[..., FrontNode]) -> FrontNode:
    node = s3_front(unsigned_from_loopback=True)
    (node.files / "open").write_bytes(b"open")
    return node


def _curl(node: FrontNode, path: str, *headers: str, head: bool = False) -> tuple[int, bytes]:
    """``curl`` from loopback, with ``headers`` (``Host: ...`` forges the Host)."""
    args = ["curl", "-s", "-o", "-", "-w", "\n%{http_code}", "--max-time", "10"]
    if head:
        args.append("-I")
    for header in headers:
        args += ["-H", header]
    out = subprocess.run(
        [*args, node.endpoint + path], capture_output=True, check=True, timeout=20
    ).stdout
    body, _, status = out.rpartition(b"\n")
    return int(status), body


# -- DNS rebinding ---------------------------------------------------------------------


@pytest.mark.timeout(40)
def test_unsigned_requests_under_a_foreign_host_are_refused(unsigned: FrontNode) -> None:
    """A page of rebind.evil.example whose name now points at 127.0.0.1 reads nothing:
    not an object, not a listing, not the bucket list; curl and urllib forge its Host."""
    port = unsigned.port
    for host in (FOREIGN, f"{FOREIGN}:{port}", "127.0.0.1.evil.example", "localhost.evil"):
        for path in ("/local/open", "/local?list-type=2", "/local", "/"):
            status, body = _curl(unsigned, path, f"Host: {host}")
            assert (status, code_of(body)) == (403, "AccessDenied"), (host, path)
            assert b"own names" in body
            assert b"Sign the request" in body
        status, body = _curl(unsigned, "/local/open", f"Host: {host}", head=True)
        assert status == 403
    request = urllib.request.Request(
        f"{unsigned.endpoint}/local/open", headers={"Host": f"{FOREIGN}:{port}"}
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 403
    assert code_of(refused.value.read()) == "AccessDenied"
    # A page of another site, under the front's own name: the browser says so itself.
    status, body = _curl(unsigned, "/local/open", "Sec-Fetch-Site: cross-site")
    assert (status, code_of(body)) == (403, "AccessDenied")
    assert unsigned.daemon.metric("chunkd_s3_requests_total", op="Unknown", code="AccessDenied")


@pytest.mark.timeout(40)
def test_unsigned_requests_under_the_fronts_own_names_still_read(unsigned: FrontNode) -> None:
    port = unsigned.port
    own = [
        f"127.0.0.1:{port}",
        f"localhost:{port}",
        f"LOCALHOST:{port}",
        f"local.localhost:{port}",  # RFC 6761: *.localhost is loopback
        f"[::1]:{port}",
        f"{socket.gethostname()}:{port}",
        "127.0.0.1",
    ]
    for host in own:
        assert _curl(unsigned, "/local/open", f"Host: {host}") == (200, b"open"), host
    for site in ("same-origin", "same-site", "none"):
        assert _curl(unsigned, "/local/open", f"Sec-Fetch-Site: {site}") == (200, b"open")
    # HTTP/1.0 without a Host: no browser page sends that.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"GET /local/open HTTP/1.0\r\n\r\n")
        answer = b"".join(iter(lambda: conn.recv(65536), b""))
    assert answer.startswith((b"HTTP/1.0 200", b"HTTP/1.1 200"))
    assert answer.endswith(b"\r\n\r\nopen")
    # boto3 unsigned with its default Host (the endpoint's host:port).
    s3 = front_client(unsigned.endpoint, signature_version=UNSIGNED)
    assert s3.get_object(Bucket="local", Key="open")["Body"].read() == b"open"
    assert [c["Key"] for c in s3.list_objects_v2(Bucket="local")["Contents"]] == ["open"]


@pytest.mark.timeout(40)
def test_signed_requests_under_any_host_are_served(unsigned: FrontNode) -> None:
    """A signature binds the Host it was made for: a signed request is not a page's."""
    for host in (FOREIGN, f"{FOREIGN}:{unsigned.port}"):
        status, _, body = raw(unsigned, "GET", "/local/open", headers={"Host": host})
        assert (status, body) == (200, b"open")
        status, _, body = raw(
            unsigned,
            "GET",
            "/local/open",
            headers={"Host": host, "Sec-Fetch-Site": "cross-site"},
        )
        assert (status, body) == (200, b"open")
    # Refused unsigned, with the rule for signed ones said: the old answer still holds
    # for a front without unsigned access.
    status, _, body = raw(unsigned, "GET", "/local/open", headers={"Host": FOREIGN}, secret=None)
    assert (status, code_of(body)) == (403, "AccessDenied")
    alive(unsigned)


# -- hostile dates and numbers -----------------------------------------------------------

HUGE = "9" * 5000
#: (header or query, value sent, the statuses S3's rules allow for a GET of /local/ten)
HOSTILE_HEADERS: list[tuple[str, str, set[int]]] = [
    # An unreadable If-(Un)Modified-Since is ignored, as S3 and RFC 9110 do.
    ("If-Modified-Since", "1 Jan 10000000000000000000000 00:00:00", {200}),
    ("If-Modified-Since", "Mon, 01 Jan 2024 00:00:00 +99999999999999999999999", {200}),
    ("If-Modified-Since", "Mon, 01 Jan 99999 00:00:00 GMT", {200}),
    ("If-Modified-Since", "Mon, 31 Feb 2024 00:00:00 GMT", {200}),
    ("If-Modified-Since", "Mon, 01 Jan 2024 99:99:99 GMT", {200}),
    ("If-Modified-Since", "Mon, 01 Jan 2024 00:00:00 -9999", {200}),
    ("If-Modified-Since", f"1 Jan {HUGE} 00:00:00", {200}),
    ("If-Modified-Since", "Mon, 1", {200}),
    ("If-Modified-Since", "", {200}),
    ("If-Unmodified-Since", "1 Jan 10000000000000000000000 00:00:00", {200}),
    ("If-Unmodified-Since", "Mon, 01 Jan 2024 00:00:00 +99999999999999999999999", {200}),
    ("If-Unmodified-Since", f"1 Jan {HUGE} 00:00:00", {200}),
    # A Range whose numbers are past any size: S3 serves the whole object.
    ("Range", f"bytes={HUGE}-", {200}),
    ("Range", f"bytes=0-{HUGE}", {200}),
    ("Range", f"bytes=-{HUGE}", {200}),
    ("Range", "bytes=" + ",".join(["0-1"] * 1000), {200}),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_hostile_dates_and_numbers_are_never_a_500(
    s3_front: Callable[..., FrontNode], signed: bool
) -> None:
    """Each hostile value a 4xx or the documented 200/206/304, never a 500 and never a
    traceback in the daemon's log: conditions, ranges and If-Range in headers, and the
    numbers and dates of the query and of the signature."""
    node = s3_front(unsigned_from_loopback=True)
    (node.files / "ten").write_bytes(b"0123456789")
    # An hour old: its Last-Modified is a strong validator, which If-Range's date wants.
    os.utime(node.files / "ten", (time.time() - 3600, time.time() - 3600))
    secret = None if not signed else "front-secret-for-tests"
    sent = 0
    for name, value, allowed in HOSTILE_HEADERS:
        for extra in ({}, {"Range": "bytes=2-4"}) if name != "Range" else ({},):
            headers = {name: value, **extra}
            wanted = {206 if s == 200 and extra else s for s in allowed}
            status, _, body = raw(node, "GET", "/local/ten", headers=headers, secret=secret)
            assert status in wanted, (name, value[:60], extra, status, body[:300])
            sent += 1
    # If-Range: a date or an ETag that is not the object's, or one no parser reads, is
    # no match: the whole object (RFC 9110 13.1.5), never the range of another version.
    for value in (
        "1 Jan 10000000000000000000000 00:00:00",
        f"1 Jan {HUGE} 00:00:00",
        "Mon, 01 Jan 2024 00:00:00 +99999999999999999999999",
        "Mon, 01 Jan 2001 00:00:00 GMT",
        '"not-the-etag"',
        "garbage",
    ):
        headers = {"Range": "bytes=2-4", "If-Range": value}
        status, _, body = raw(node, "GET", "/local/ten", headers=headers, secret=secret)
        assert (status, body) == (200, b"0123456789"), value[:60]
    head = node.client().head_object(Bucket="local", Key="ten")
    for value in (head["ETag"], head["ResponseMetadata"]["HTTPHeaders"]["last-modified"]):
        headers = {"Range": "bytes=2-4", "If-Range": value}
        status, _, body = raw(node, "GET", "/local/ten", headers=headers, secret=secret)
        assert (status, body) == (206, b"234"), value
    # The query's numbers.
    for query, status_code in (
        (f"list-type=2&max-keys={HUGE}", (400, "InvalidArgument")),
        ("list-type=2&max-keys=99999999999", (400, "InvalidArgument")),
        ("list-type=2&max-keys=%EF%BC%91", (400, "InvalidArgument")),  # a fullwidth 1
        (f"max-keys={HUGE}", (400, "InvalidArgument")),
    ):
        status, _, body = raw(node, "GET", "/local", query=query, secret=secret)
        assert (status, code_of(body)) == status_code, query[:60]
    for part in (HUGE, "0", "-1", "%C2%B2", "1.5", "99999999999999999999"):
        status, _, body = raw(node, "GET", "/local/ten", query=f"partNumber={part}", secret=secret)
        assert 400 <= status < 500
        assert code_of(body) in ("InvalidArgument", "InvalidPartNumber")
    status, _, body = raw(node, "GET", "/local/ten", query="partNumber=1", secret=secret)
    assert (status, body) == (200, b"0123456789")
    log = node.daemon.log.read_text()
    assert "Traceback" not in log
    assert "InternalError" not in log
    assert node.daemon.metric("chunkd_s3_requests_total", op="GetObject", code="InternalError") == 0
    assert sent > 20
    alive(node)


_V4 = (
    "AWS4-HMAC-SHA256 Credential=chunkd-test/{day}/us-east-1/s3/aws4_request, "
    "SignedHeaders=host;x-amz-content-sha256;x-amz-date, Signature=" + "0" * 64
)
_V2 = "AWS chunkd-test:AAAAAAAAAAAAAAAAAAAAAAAAAAA="


def _header_signed() -> Iterator[dict[str, str]]:
    """Header-signed requests whose x-amz-date or Date no clock can hold (sent as they
    are: a signer would write its own date)."""
    for date in (
        "00000101T000000Z",
        "99991231T235959Z",
        "20240231T000000Z",
        "20241301T000000Z",
        "2024\xb2\xb201T000000Z",  # superscript digits: isdigit(), not ASCII
        HUGE,
    ):
        yield {
            "Authorization": _V4.format(day=date[:8]),
            "x-amz-date": date,
            "x-amz-content-sha256": "UNSIGNED-PAYLOAD",
        }
        yield {"Authorization": _V2, "x-amz-date": date}
    for date in (
        "1 Jan 10000000000000000000000 00:00:00",
        "Mon, 01 Jan 2024 00:00:00 +99999999999999999999999",
        f"1 Jan {HUGE} 00:00:00",
        "Mon, 01 Jan 0000 00:00:00 GMT",
        "00000101T000000Z",
    ):
        yield {"Authorization": _V2, "Date": date}
        yield {
            "Authorization": _V4.format(day="20240101"),
            "Date": date,
            "x-amz-content-sha256": "UNSIGNED-PAYLOAD",
        }


def _presigned_queries() -> Iterator[str]:
    credential = "chunkd-test%2F00000101%2Fus-east-1%2Fs3%2Faws4_request"
    base = (
        "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={cred}&X-Amz-Date={date}"
        "&X-Amz-Expires={expires}&X-Amz-SignedHeaders=host&X-Amz-Signature=" + "0" * 64
    )
    for date, expires in (
        ("00000101T000000Z", "60"),
        ("99991231T235959Z", "60"),
        ("20240101T000000Z", HUGE),
        ("20240101T000000Z", "99999999999"),
        ("20240101T000000Z", "-1"),
        ("20240101T000000Z", "%C2%B2"),
        ("99991231T235959Z", "604800"),
    ):
        yield base.format(cred=credential.replace("00000101", date[:8]), date=date, expires=expires)
    for expires in (HUGE, "99999999999", "-1", "%C2%B2", "253402300800"):
        yield f"AWSAccessKeyId=chunkd-test&Signature=AAAA&Expires={expires}"


@pytest.mark.timeout(60)
def test_hostile_signature_times_are_refused_never_a_500(
    s3_front: Callable[..., FrontNode],
) -> None:
    """A header-signed request whose x-amz-date or Date no clock can hold, and a
    presigned URL whose date or expiry is past any clock: a 4xx, never a traceback."""
    node = s3_front()
    (node.files / "ten").write_bytes(b"0123456789")
    for headers in _header_signed():
        status, _, body = raw(node, "GET", "/local/ten", headers=headers, secret=None)
        assert 400 <= status < 500, (headers, status, body[:300])
        assert code_of(body), body
    for query in _presigned_queries():
        status, _, body = raw(node, "GET", "/local/ten", query=query, secret=None)
        assert 400 <= status < 500, (query[:200], status, body[:300])
    log = node.daemon.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    alive(node)


# -- a bucket deleted behind the front --------------------------------------------------


@pytest.fixture
def doomed_bucket(s3_server: S3Server) -> Iterator[str]:
    """A moto bucket of its own, which the test deletes (removed afterwards if not)."""
    name = f"chunkd-doomed-{uuid.uuid4().hex[:8]}"
    client = s3_server.client()
    client.create_bucket(Bucket=name)
    yield name
    with contextlib.suppress(ClientError):
        for item in client.list_objects_v2(Bucket=name).get("Contents", []):
            client.delete_object(Bucket=name, Key=item["Key"])
        client.delete_bucket(Bucket=name)


@pytest.mark.timeout(40)
def test_a_bucket_deleted_behind_the_front_is_no_such_bucket(
    s3_front: Callable[..., FrontNode], s3_server: S3Server, doomed_bucket: str
) -> None:
    """S3 answers NoSuchBucket when the bucket is gone, for objects and listings alike
    (HEAD a bare 404); the backend's missing bucket is not a missing key, nor a
    failing backend to retry and open the circuit on."""
    direct = s3_server.client()
    direct.put_object(Bucket=doomed_bucket, Key="k", Body=b"k")
    backend = s3_backend("doomed", f"s3://{doomed_bucket}", s3_server.endpoint, retries=1)
    node = s3_front(toml=backend)
    s3 = node.client()
    assert s3.head_bucket(Bucket="doomed")["ResponseMetadata"]["HTTPStatusCode"] == 200
    direct.delete_object(Bucket=doomed_bucket, Key="k")
    direct.delete_bucket(Bucket=doomed_bucket)
    for _ in range(8):  # more than the circuit takes to open, were these failures
        assert error_code(lambda: s3.get_object(Bucket="doomed", Key="k")) == "NoSuchBucket"
        assert error_code(lambda: s3.get_object(Bucket="doomed", Key="x/y")) == "NoSuchBucket"
        assert error_code(lambda: s3.head_object(Bucket="doomed", Key="k")) == "404"
        assert error_code(lambda: s3.list_objects_v2(Bucket="doomed")) == "NoSuchBucket"
        assert error_code(lambda: s3.list_objects(Bucket="doomed", Prefix="x/")) == "NoSuchBucket"
    status, _, body = raw(node, "GET", "/doomed/k")
    assert (status, code_of(body)) == (404, "NoSuchBucket")
    assert b"doomed" in body  # the front's bucket, never the backend's own name
    assert doomed_bucket.encode() not in body
    # The bucket back: the front reads it again, at once.
    direct.create_bucket(Bucket=doomed_bucket)
    direct.put_object(Bucket=doomed_bucket, Key="k", Body=b"back")
    assert s3.get_object(Bucket="doomed", Key="k")["Body"].read() == b"back"
    assert [c["Key"] for c in s3.list_objects_v2(Bucket="doomed")["Contents"]] == ["k"]
    assert "Traceback" not in node.daemon.log.read_text()
    alive(node)


# -- keys ending in "/" with a body --------------------------------------------------------

#: S3 keys that end in "/" and hold bytes, next to keys the front serves
SLASHED = {
    "a": b"a",
    "a/b": b"b",
    "both": b"the file both",
    "both/": b"a folder object with a body",
    "both/c": b"c",
    "dir/": b"a body under a key ending in /",
    "dir/x": b"x",
}


@pytest.mark.timeout(40)
def test_a_key_ending_in_a_slash_is_never_listed_as_another(
    s3_front: Callable[..., FrontNode], s3_server: S3Server
) -> None:
    """obstore names ``dir/`` as ``dir``, a key no object has; the front lists no key a
    GET cannot find, and a delimiter listing shows ``dir/`` as S3 does: a CommonPrefix."""
    node = s3_front()
    direct = s3_server.client()
    for key, body in SLASHED.items():
        direct.put_object(Bucket=node.name, Key=key, Body=body)
    s3 = node.client()

    def found(listed: list[dict[str, Any]]) -> None:
        for entry in listed:
            got = s3.get_object(Bucket="data", Key=entry["Key"])
            assert got["Body"].read() == SLASHED[entry["Key"]]
            assert (got["ETag"], got["ContentLength"]) == (entry["ETag"], entry["Size"])

    flat = s3.list_objects_v2(Bucket="data")["Contents"]
    assert [c["Key"] for c in flat] == ["a", "a/b", "both", "both/c", "dir/x"]
    found(flat)
    found(s3.list_objects(Bucket="data")["Contents"])
    level = s3.list_objects_v2(Bucket="data", Delimiter="/")
    theirs = direct.list_objects_v2(Bucket=node.name, Delimiter="/")
    assert [c["Key"] for c in level["Contents"]] == [c["Key"] for c in theirs["Contents"]]
    assert level["CommonPrefixes"] == theirs["CommonPrefixes"]  # dir/ among them
    found(level["Contents"])
    # Pages of one key (a client's probe) and of two: still no phantom, none twice.
    paged: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket="data", PaginationConfig={"PageSize": 2}
    ):
        paged += [c["Key"] for c in page.get("Contents", [])]
    assert paged == ["a", "a/b", "both", "both/c", "dir/x"]
    # Under dir/, S3 also lists the object dir/ itself: chunkd cannot read it (below).
    under = s3.list_objects_v2(Bucket="data", Prefix="dir/", Delimiter="/")
    assert [c["Key"] for c in under["Contents"]] == ["dir/x"]
    for key in ("dir", "dir/"):
        assert error_code(lambda key=key: s3.get_object(Bucket="data", Key=key)) == "NoSuchKey"
    alive(node)
