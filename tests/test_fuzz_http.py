"""Fuzzing the HTTP routes against a real daemon.

Hypothesis writes raw HTTP/1.1 requests to every route of :mod:`chunkd.gateway.api`
(objects, chunks, warm, list, stats, metrics, health, the pages and their data, the
inspector, the peer routes): random methods, paths built from the routes with path
tricks (``..``, ``%2e%2e``, ``%2F``, ``%00``, backslashes, unicode raw and escaped,
very long), query strings, headers (``Range`` and ``If-Range`` variants, the server
and peer tokens right, wrong or swapped, cookies, ``Origin``, ``Host``) and bodies,
and now and then a request that is not HTTP. The daemon listens on a non-loopback
address of this host (the ``other_host`` veth, 198.18.0.0/15) when it can, so its
guard is in play. Properties:

* never a 5xx, but 503 (documented: not ready, a backend or the cache unavailable);
* never a traceback in a body; an error of the app is JSON of the documented shape,
  ``{"error": KIND, "message": TEXT, "status": N}``;
* an object read returns the right bytes (whole, or the range ``Content-Range`` names);
* no byte of a file outside the backends, nor a token, is ever in an answer;
* the process stays alive and ``/healthz`` answers.

Bounded for the suite (see ``EXAMPLES``); seeds and scale as in
:mod:`tests.test_fuzz_localsock` (``CHUNKD_FUZZ_SEED``, ``CHUNKD_FUZZ_SCALE``).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import re
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import given, seed
from hypothesis import strategies as st

from chunkd.testing import free_port

from .conftest import Daemon
from .test_fuzz_localsock import fuzz_seed, fuzz_settings, replayable, weighted

KiB = 1 << 10
#: suite budget of this file: about 1,000 requests in ~15 s
EXAMPLES = 350
SERVER_TOKEN = "fuzz-server-token-0123456789"
PEER_TOKEN = "fuzz-peer-token-0123456789ab"

TOML = """
[server]
listen = "{listen}"
token = "{token}"
shutdown_timeout = "3s"
inspect_workers = 1
inspect_timeout = "5s"

[cache]
dir = "{cache}"
ram_bytes = "64MiB"
disk_bytes = "128MiB"
disk_min_free_bytes = 0
chunk_bytes = "64KiB"
fsync = "never"

[peers]
self = "{listen}"
members = []
token_file = "{peer_token}"

[datasets]
registry = "local/datasets"

[[backends]]
name = "local"
url = "file://{data}"
writable = true
revalidate = "1s"
"""


@dataclass
class Node:
    """The daemon under fuzz, what it serves, and what it must never show."""

    daemon: Daemon
    host: str
    port: int
    known: dict[str, bytes]  # key -> bytes, in backend "local"
    versions: dict[str, str]  # key -> version
    secrets: list[bytes]  # a file outside the backends, the tokens
    remote: bool  # whether the test's requests come from a non-loopback address


def known_objects() -> dict[str, bytes]:
    rng = random.Random(16)
    return {
        "known/small.txt": b"the small object\n" * 3,
        "known/mid.bin": rng.randbytes(3 * 64 * KiB + 17),
        "known/empty.bin": b"",
        "known/ü ñ/space.bin": rng.randbytes(300),
        "known/a%2Fb.bin": rng.randbytes(10),  # a key with an escape in its name
        "known/tar.csv": b"a,b\n1,2\n3,4\n",
    }


@pytest.fixture
def node(
    start_daemon: Callable[..., Daemon], tmp_path: Path, request: pytest.FixtureRequest
) -> Node:
    try:
        _, host = request.getfixturevalue("other_host")
        remote = True
    except pytest.skip.Exception:
        host, remote = "127.0.0.1", False  # no namespace here: the loopback view only
    port = free_port()
    data, work = tmp_path / "data", tmp_path / "work"
    known = known_objects()
    for key, blob in known.items():
        (data / key).parent.mkdir(parents=True, exist_ok=True)
        (data / key).write_bytes(blob)
    secret = f"outside-the-backends-{random.SystemRandom().getrandbits(64):016x}".encode()
    (tmp_path / "secret.txt").write_bytes(secret)  # next to data/: ../secret.txt
    (tmp_path / "secret.bin").write_bytes(secret)
    work.mkdir()
    (work / "secret.txt").write_bytes(secret)  # in the daemon's working directory
    token_file = tmp_path / "peer-token"
    token_file.write_text(PEER_TOKEN)
    token_file.chmod(0o600)
    toml = TOML.format(
        listen=f"{host}:{port}",
        token=SERVER_TOKEN,
        cache=tmp_path / "cache",
        peer_token=token_file,
        data=data,
    )
    daemon = start_daemon(toml, cwd=work, port=port, env={"CHUNKD_SERVER_LISTEN": f"{host}:{port}"})
    daemon.host = host
    status, _, body = daemon.get(
        "/v1/list/local/known/?recursive=true", {"Authorization": f"Bearer {SERVER_TOKEN}"}
    )
    assert status == 200, body
    entries = json.loads(body)["entries"]
    versions = {e["name"]: e["version"] for e in entries if e.get("version")}
    secrets = [secret, SERVER_TOKEN.encode(), PEER_TOKEN.encode()]
    return Node(daemon, host, port, known, versions, secrets, remote)


# -- what is sent ---------------------------------------------------------------------------

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=16)
TRICKS = [
    "..",
    ".",
    "%2e%2e",
    "%2E%2E",
    ".%2e",
    "%2f",
    "%2F..%2F",
    "..%2f..%2fsecret.txt",
    "%00",
    "%ff",
    "%",
    "%zz",
    "\\",
    "..\\secret.txt",
    "",
    "~",
    ";a=b",
    "secret.txt",
    "../secret.txt",
    "../../secret.txt",
    "%2e%2e/secret.txt",
    "..%252fsecret.txt",
    "/etc/passwd",
    "%C0%AE%C0%AE",
    "ü",
    "%C3%BC",
    "\u202e",
    "a" * 300,
]


def segments(known: list[str]) -> st.SearchStrategy[str]:
    """A path after a route's prefix: a known key, tricks, or text; escaped or not."""
    key = weighted(
        (4, st.sampled_from(known)),
        (3, st.lists(st.sampled_from(TRICKS) | TEXT, min_size=1, max_size=4).map("/".join)),
        (1, st.sampled_from(known).map(lambda k: k.replace("/", "%2F"))),
        (1, st.integers(1000, 9000).map(lambda n: "k" * n)),  # past the request line limit
    )
    escaped = st.sampled_from(["raw", "quote", "quote_all"])
    return st.tuples(key, escaped).map(lambda pair: _escape(*pair))


def _escape(key: str, how: str) -> str:
    if how == "quote":
        return quote(key, safe="/%")
    if how == "quote_all":
        return quote(key, safe="")
    return key


CHUNK_IDS = st.one_of(
    st.text("0123456789abcdef", min_size=64, max_size=64),
    st.sampled_from(["", "xyz", "0" * 63, "0" * 65, "G" * 64, "%30" * 64]),
    TEXT,
)
INSPECT_OPS = ["open", "rows", "sample", "rl", "datasets", "dataset", "snapshot", "diff", "step"]


@st.composite
def paths(draw: st.DrawFn, node: Node) -> str:
    """A request target: a route of the daemon's (mostly) and a query string."""
    known = sorted(node.known)
    key = segments(known)
    backend = draw(
        weighted((8, st.just("local")), (1, st.sampled_from(["nope", "LOCAL", "", ".."])))
    )
    route = draw(
        weighted(
            (8, key.map(lambda k: f"/v1/objects/{backend}/{k}")),
            (1, CHUNK_IDS.map(lambda c: f"/v1/chunks/{c}")),
            (2, key.map(lambda k: f"/v1/list/{backend}/{k}")),
            (1, st.just("/v1/list/local")),
            (1, key.map(lambda k: f"/v1/warm/{backend}/{k}")),
            (1, CHUNK_IDS.map(lambda c: f"/v1/peer/chunks/{backend}/{c}")),
            (1, CHUNK_IDS.map(lambda c: f"/v1/peer/pages/{c}")),
            (2, key.map(lambda k: f"/v1/peer/objects/{backend}/{k}")),
            (1, st.sampled_from([*INSPECT_OPS, "nope", ""]).map(lambda o: f"/v1/inspect/{o}")),
            (1, key.map(lambda k: f"/v1/inspect/media/{backend}/{k}")),
            (
                2,
                st.sampled_from(
                    [
                        "/v1/stats",
                        "/metrics",
                        "/healthz",
                        "/readyz",
                        "/",
                        "/inspect",
                        "/inspect/",
                        "/login",
                        "/logout",
                        "/v1/dashboard",
                        "/v1/dashboard/stream",
                        "/static/dashboard.js",
                        "/static/../api.py",
                        "/static/%2e%2e%2fapi.py",
                        "/v1",
                        "/v1/",
                        "//v1/stats",
                        "/v1/objects",
                        "/v1/objects/",
                        "*",
                        "http://evil.example/v1/stats",
                        "/v1/stats/",
                        "/V1/STATS",
                    ]
                ),
            ),
            (1, key.map(lambda k: f"/inspect/{k}")),
            (1, key.map(lambda k: f"/static/{k}")),
        )
    )
    pairs = draw(st.lists(query_pairs(node), max_size=4))
    if not pairs:
        return route
    return route + "?" + "&".join(pairs)


def query_pairs(node: Node) -> st.SearchStrategy[str]:
    names = st.sampled_from(
        [
            *("recursive", "limit", "start_after", "offset", "length", "version", "index"),
            *("last", "name", "next", "failed", "row", "n", "a"),
        ]
    )
    values = weighted(
        (3, st.sampled_from(["true", "false", "1", "0", "", "-1", "1e3", "99999999999999999"])),
        (2, st.integers(-5, 10**6).map(str)),
        (1, st.sampled_from(sorted(node.versions.values()) or ["v"])),
        (2, TEXT),
        (1, st.sampled_from(sorted(node.known)).map(lambda k: f"local/{k}")),
    )
    pair = st.tuples(names, values).map(lambda p: f"{p[0]}={quote(p[1], safe='')}")
    return weighted((6, pair), (1, TEXT.map(lambda t: quote(t, safe="=&"))))


RANGES = st.one_of(
    st.builds(
        "bytes={}-{}".format,
        st.one_of(st.just(""), st.integers(0, 250_000).map(str)),
        st.one_of(st.just(""), st.integers(0, 250_000).map(str)),
    ),
    st.sampled_from(
        [
            "bytes=0-0",
            "bytes=-1",
            "bytes=-0",
            "bytes=0-",
            "bytes=0-1,3-4",
            "bytes=5-1",
            "bytes=a-b",
            "bytes=",
            "bytes",
            "items=0-1",
            "bytes=0-99999999999999999999999",
            "bytes=-99999999999999999999999",
            "bytes = 0-5",
            "BYTES=0-5",
            "bytes=0-5 ",
            "bytes=--1",
            "bytes=1-2-3",
        ]
    ),
    TEXT,
)


@st.composite
def headers(draw: st.DrawFn, node: Node) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    auth = draw(
        weighted(
            (6, st.just(f"Bearer {SERVER_TOKEN}")),
            (2, st.just(f"Bearer {PEER_TOKEN}")),
            (2, st.none()),
            (
                1,
                st.sampled_from(
                    [
                        "",
                        "Bearer",
                        "Bearer ",
                        f"Bearer  {SERVER_TOKEN}",
                        f"bearer {SERVER_TOKEN}",
                        f"Bearer {SERVER_TOKEN} ",
                        f"Bearer {SERVER_TOKEN[:-1]}",
                        f"Basic {SERVER_TOKEN}",
                        "Bearer \u00e9\u00e9",
                    ]
                ),
            ),
            (1, TEXT),
        )
    )
    if auth is not None:
        out.append(("Authorization", auth))
    if draw(st.integers(0, 2)) == 0:
        out.append(("Range", draw(RANGES)))
    if draw(st.integers(0, 9)) == 0:
        out.append(("If-Range", draw(st.sampled_from([*node.versions.values(), '"x"', ""]))))
    if draw(st.integers(0, 9)) == 0:
        out.append(
            (
                "Origin",
                draw(st.sampled_from(["null", "http://evil.example", "::", "", "http://["]) | TEXT),
            )
        )
    if draw(st.integers(0, 9)) == 0:
        out.append(("Sec-Fetch-Site", draw(st.sampled_from(["cross-site", "same-origin", "none"]))))
    if draw(st.integers(0, 9)) == 0:
        out.append(("Cookie", draw(st.sampled_from(["chunkd_session=x", "a=b; c", "=;="]) | TEXT)))
    if draw(st.integers(0, 14)) == 0:
        out.append(("X-Chunkd-Peer", draw(TEXT)))
    if draw(st.integers(0, 14)) == 0:
        out.append(("Last-Event-ID", draw(TEXT)))
    if draw(st.integers(0, 14)) == 0:
        out.append(("Accept-Encoding", draw(st.sampled_from(["gzip", "br", "*", "identity;q=0"]))))
    return out


@dataclass(frozen=True)
class Request:
    """One raw request; ``raw`` when it is not meant to be well-formed HTTP."""

    method: str
    target: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    host: str | None
    raw: bytes | None = None

    def encode(self) -> bytes:
        if self.raw is not None:
            return self.raw
        lines = [f"{self.method} {self.target} HTTP/1.1"]
        if self.host is not None:
            lines.append(f"Host: {self.host}")
        lines += [f"{name}: {value}" for name, value in self.headers]
        lines += [f"Content-Length: {len(self.body)}", "Connection: close"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + self.body

    def __repr__(self) -> str:  # short: Hypothesis prints (and warns of) long reprs
        text = self.encode()
        return f"Request({text[:600]!r}{'...' if len(text) > 600 else ''})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


@st.composite
def requests(draw: st.DrawFn, node: Node) -> Request:
    if draw(st.integers(0, 24)) == 0:  # not HTTP, or HTTP broken on purpose
        raw = draw(
            st.binary(min_size=1, max_size=200)
            | st.sampled_from(
                [
                    b"GET /healthz HTTP/9.9\r\n\r\n",
                    b"GET /healthz\r\n\r\n",
                    b"GET  /healthz HTTP/1.1\r\n\r\n",
                    b"GET /v1/stats HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
                    b"GET /v1/stats HTTP/1.1\r\nX: \x00\r\n\r\n",
                    b"POST /v1/warm/local/x HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
                    b"POST /login HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                    b"GET /v1/objects/local/known/small.txt HTTP/1.1\r\nRange: bytes=0-1\r\n"
                    b"Range: bytes=2-3\r\nConnection: close\r\n\r\n",
                    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n",
                    b"GET / HTTP/1.1\r\n" + b"X-Long: " + b"b" * 9000 + b"\r\n\r\n",
                ]
            )
        )
        return Request("RAW", "", (), b"", None, raw=raw)
    method = draw(
        weighted(
            (10, st.just("GET")),
            (3, st.just("HEAD")),
            (3, st.just("POST")),
            (1, st.sampled_from(["PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "get", "FOO"])),
        )
    )
    target = draw(paths(node))
    sent = draw(headers(node))
    body = b""
    if method in ("POST", "PUT", "PATCH") and draw(st.booleans()):
        body = draw(
            st.binary(max_size=64)
            | st.sampled_from(
                [
                    f"token={SERVER_TOKEN}&next=/inspect/".encode(),
                    b"token=&next=//evil.example",
                    f"token={SERVER_TOKEN}&next=/\t/evil.example".encode(),
                    b"next=%ff",
                ]
            )
        )
        if body.startswith((b"token", b"next")):
            sent.append(("Content-Type", "application/x-www-form-urlencoded"))
    if target == "/login" and method == "POST" and SERVER_TOKEN.encode() not in body:
        target = "/logout"  # a wrong login sleeps 0.5 s on purpose: too slow to fuzz
    host = draw(
        weighted(
            (8, st.just(f"{node.host}:{node.port}")),
            (1, st.sampled_from(["localhost", "evil.example", "", "[::1]:1", "[", "a:b:c"])),
            (1, st.none()),
        )
    )
    return Request(method, target, tuple(sent), body, host)


# -- sending and checking ----------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes


def send(node: Node, request: Request) -> Reply | None:
    """Send ``request`` on a new connection; None when the daemon closed it unanswered
    (what it does with bytes that are not HTTP)."""
    with socket.create_connection((node.host, node.port), timeout=15) as sock:
        # Refused before it was all sent (a BrokenPipeError): the answer may be there still.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(request.encode())
        response = http.client.HTTPResponse(
            sock, method="HEAD" if request.method == "HEAD" else "GET"
        )
        try:
            response.begin()
        except (http.client.RemoteDisconnected, ConnectionResetError):
            return None
        if response.getheader("Content-Type", "").startswith("text/event-stream"):
            return Reply(response.status, response.headers, b"")  # never ends: headers only
        try:
            body = response.read()
        except http.client.IncompleteRead as exc:
            body = exc.partial  # a stream cut mid-body: what came is checked
        return Reply(response.status, response.headers, body)


#: 5xx the routes document: not ready yet or stopping (readyz), a backend or the cache
#: unavailable (with Retry-After)
DOCUMENTED_5XX = {503}
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


def check(node: Node, request: Request, reply: Reply | None) -> str:
    """Check one answer; what it was, for the run's summary."""
    if reply is None:
        assert request.raw is not None, ("a well-formed request got no answer", request)
        return "closed"
    status, body = reply.status, reply.body
    assert status < 500 or status in DOCUMENTED_5XX, (status, body[:2000], request)
    text = body.decode("utf-8", "replace")
    assert "Traceback" not in text, (text[:4000], request)
    assert 'File "/' not in text, (text[:4000], request)
    shown = body + str(reply.headers).encode("utf-8", "surrogateescape")
    for secret in node.secrets:
        assert secret not in shown, ("an answer shows a secret", request, body[:300])
    if request.method == "HEAD":
        assert body == b"", request
    elif status >= 400:
        kind = reply.headers.get_content_type()
        if kind == "application/json":
            error = json.loads(body)
            assert isinstance(error.get("error"), str), error
            assert error["error"], error
            assert isinstance(error.get("message"), str), error
            assert error["message"], error
            assert error.get("status") == status, (error, status)
        elif status == 416 and _is_page(request.target):
            return f"{status}:file"  # a page or an asset is a file: aiohttp answers its Range
        else:  # only aiohttp's own parser, before any route: a request that is not HTTP
            assert status in (400, 413, 414, 431), (status, kind, body[:500], request)
            return f"{status}:parser"
    check_object(node, request, reply)
    return f"{status}"


def _is_page(target: str) -> bool:
    path = target.partition("?")[0]
    return path in ("/", "/login") or path.startswith(("/static/", "/inspect/"))


def check_object(node: Node, request: Request, reply: Reply) -> None:
    """A read of a known object answers its bytes, whole or the range it names."""
    prefix = "/v1/objects/local/"
    if request.method != "GET" or not request.target.startswith(prefix):
        return
    key = request.target[len(prefix) :].partition("?")[0]
    blob = node.known.get(key)
    if blob is None or reply.status not in (200, 206):
        return
    if reply.status == 200:
        assert reply.body == blob, (request, len(reply.body))
        return
    match = _CONTENT_RANGE.fullmatch(reply.headers.get("Content-Range", ""))
    assert match is not None, (request, dict(reply.headers))
    start, end, size = map(int, match.groups())
    assert size == len(blob), (request, dict(reply.headers))
    assert reply.body == blob[start : end + 1], (request, dict(reply.headers))


# -- the test -----------------------------------------------------------------------------------


def test_random_requests_to_every_route_never_break_the_daemon(
    node: Node, request: pytest.FixtureRequest
) -> None:
    run_seed = fuzz_seed()
    outcomes: Counter[str] = Counter()
    counts = {"examples": 0, "requests": 0}

    @fuzz_settings(EXAMPLES)
    @seed(run_seed)
    @given(batch=st.lists(requests(node), min_size=1, max_size=4))
    def some_requests(batch: list[Request]) -> None:
        counts["examples"] += 1
        for one in batch:
            counts["requests"] += 1
            outcomes[check(node, one, send(node, one))] += 1
        assert node.daemon.process.poll() is None, "the daemon died"
        assert node.daemon.get("/healthz")[0] == 200

    started = time.monotonic()
    with replayable(request, run_seed, "HTTP fuzz"):
        some_requests()
        log = node.daemon.log.read_text(errors="replace")
        assert "Traceback" not in log, f"the daemon's log shows a traceback:\n{log[-4000:]}"
    view = "from another address (the guard in play)" if node.remote else "from loopback"
    print(
        f"HTTP fuzz: seed {run_seed}: {counts['requests']} requests in {counts['examples']} "
        f"examples, {view}, in {time.monotonic() - started:.1f}s; answers: "
        + ", ".join(f"{what} {n}" for what, n in sorted(outcomes.items()))
    )


# -- what the fuzz found (each fixed) ------------------------------------------------------


def test_an_origin_that_is_not_a_url_is_refused(node: Node) -> None:
    for method in ("POST", "GET"):
        sent = Request(
            method,
            "/v1/stats",
            (("Authorization", f"Bearer {SERVER_TOKEN}"), ("Origin", "http://[")),
            b"",
            f"{node.host}:{node.port}",
        )
        reply = send(node, sent)
        assert reply is not None
        assert reply.status in (200, 403), (reply.status, reply.body)
