"""The ``https://`` kind against servers that do not behave as nginx does.

A small aiohttp server in the test, on 127.0.0.1 (a real server over a real socket),
answers as a mirror that lies might: it ignores ``If-Match`` or ``Range``, sends a huge
body for a small range, sends neither ``ETag`` nor ``Last-Modified``, routes by exact
path (no merging of slashes), and redirects (to its own origin, or to another port).
nginx (:mod:`chunkd.testing.nginx`) answers a request line too long with a 414. And a
file of keys (``read_keys``) holding what is no key is refused with its line.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from chunkd.client.datasets.register import read_keys
from chunkd.errors import (
    BackendForbiddenError,
    IntegrityError,
    InvalidKeyError,
    InvalidRequestError,
    UnversionedObjectError,
    VersionChangedError,
)
from chunkd.gateway.backends import Backend, http, make_backend
from chunkd.gateway.config import BackendConfig
from chunkd.gateway.metrics import Metrics
from chunkd.ranges import ByteRange
from chunkd.testing.nginx import NginxServer, nginx_or_skip

DATA = b"0123456789"
_STAMP = "Sun, 06 Dec 2026 10:00:00 GMT"
#: what the huge answer claims (and would send): a 4-byte range's body of 64 MiB
HUGE = 64 << 20


@dataclass
class Liar:
    """The server's state: what it was asked, what it sent, its ports."""

    port: int = 0
    other_port: int = 0
    paths: list[str] = field(default_factory=list)
    other_paths: list[str] = field(default_factory=list)
    version: int = 1
    huge_sent: int = 0


def _range(request: web.Request) -> tuple[int, int]:
    first, last = request.headers["Range"].removeprefix("bytes=").split("-")
    return int(first), int(last) + 1


def _app(liar: Liar) -> web.Application:
    async def plain(request: web.Request) -> web.StreamResponse:
        headers = {"ETag": '"a1"', "Last-Modified": _STAMP}
        if request.method == "HEAD" or "Range" not in request.headers:
            return web.Response(body=DATA, headers=headers)
        first, stop = _range(request)
        headers["Content-Range"] = f"bytes {first}-{stop - 1}/{len(DATA)}"
        return web.Response(status=206, body=DATA[first:stop], headers=headers)

    async def ignores_if_match(request: web.Request) -> web.StreamResponse:
        # Rewritten after its first GET, and answering every GET with what it has
        # now, whatever If-Match says.
        body = (b"A" if liar.version == 1 else b"B") * 10
        headers = {"ETag": f'"v{liar.version}"', "Last-Modified": _STAMP}
        if request.method == "HEAD":
            return web.Response(body=body, headers=headers)
        liar.version = 2
        first, stop = _range(request)
        headers["Content-Range"] = f"bytes {first}-{stop - 1}/10"
        return web.Response(status=206, body=body[first:stop], headers=headers)

    async def ignores_range(request: web.Request) -> web.StreamResponse:
        return web.Response(body=DATA, headers={"ETag": '"w1"', "Last-Modified": _STAMP})

    async def huge(request: web.Request) -> web.StreamResponse:
        headers = {"ETag": '"h1"', "Last-Modified": _STAMP}
        if request.method == "HEAD":
            return web.Response(body=DATA, headers=headers)
        first, stop = _range(request)
        headers["Content-Range"] = f"bytes {first}-{stop - 1}/10"
        response = web.StreamResponse(status=206, headers=headers)
        if request.path.endswith("huge"):
            response.content_length = HUGE  # said before the body
        else:
            response.enable_chunked_encoding()  # the size is never said
        transport = request.transport  # taken now: aiohttp drops it once the peer goes
        await response.prepare(request)
        piece = b"x" * (1 << 20)
        try:
            while liar.huge_sent < HUGE:
                async with asyncio.timeout(1.0):
                    await response.write(piece)
                liar.huge_sent += len(piece)
        except (TimeoutError, ConnectionError, RuntimeError):
            pass  # chunkd hung up, or stopped reading
        finally:
            # Hang up whatever ended the writing (the test's end included): a client
            # that stopped reading would leave this connection flushing forever.
            if transport is not None:
                transport.abort()
        return response

    async def unversioned(request: web.Request) -> web.StreamResponse:
        return web.Response(body=DATA)  # no ETag, no Last-Modified

    async def moved(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/pre/a.bin")

    async def away(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(f"http://127.0.0.1:{liar.other_port}/x")

    async def away_https(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(f"https://localhost:{liar.other_port}/x")

    @web.middleware
    async def seen(request: web.Request, handler: web.Handler) -> web.StreamResponse:
        liar.paths.append(request.raw_path)
        return await handler(request)

    app = web.Application(middlewares=[seen])
    for path, handler in {
        "/pre/a.bin": plain,
        "/pre/ignores-if-match": ignores_if_match,
        "/pre/ignores-range": ignores_range,
        "/pre/huge": huge,
        "/pre/huge-chunked": huge,
        "/pre/unversioned": unversioned,
        "/pre/moved": moved,
        "/pre/away": away,
        "/pre/away-https": away_https,
    }.items():
        app.router.add_get(path, handler)  # HEAD too
    return app


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    # A handler still writing to a client that stopped reading is cut at cleanup.
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    return runner, server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


@pytest.fixture
async def liar() -> AsyncIterator[Liar]:
    state = Liar()
    other = web.Application()

    async def anything(request: web.Request) -> web.StreamResponse:
        state.other_paths.append(request.raw_path)
        return web.Response(body=b"NOT THE MIRROR", headers={"ETag": '"o"'})

    other.router.add_route("*", "/{tail:.*}", anything)
    other_runner, state.other_port = await _serve(other)
    runner, state.port = await _serve(_app(state))
    yield state
    await runner.cleanup()
    await other_runner.cleanup()


def _backend(
    liar: Liar, metrics: Metrics | None = None, *, kind: str = "http", **keys: object
) -> Backend:
    """A backend on the server: the http kind, or (``kind="s3"``) an obstore kind,
    S3 with the server as its endpoint and ``pre`` its bucket."""
    where = f"http://127.0.0.1:{liar.port}"
    if kind == "s3":
        keys |= {"endpoint": where, "region": "us-east-1", "access_key_id": "k"}
        keys |= {"secret_access_key": "s"}
        url = "s3://pre"
    else:
        url = f"{where}/pre"
    config = BackendConfig(name="web", url=url, allow_http=True, retries=1, **keys)  # type: ignore[arg-type]
    return make_backend(config, metrics or Metrics())


@pytest.mark.timeout(10)
async def test_a_key_is_asked_for_at_its_exact_path(liar: Liar) -> None:
    # One "/" between the URL and the key: this server routes by exact path.
    backend = _backend(liar)
    meta = await backend.head("a.bin")
    assert meta is not None
    assert meta.size == len(DATA)
    got = await backend.get("a.bin", ByteRange(2, 5), version=meta)
    assert got is not None
    assert bytes(got) == b"234"
    assert liar.paths == ["/pre/a.bin", "/pre/a.bin"]
    await backend.close()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", ["http", "s3"])
async def test_a_server_that_ignores_if_match_never_mixes_versions(liar: Liar, kind: str) -> None:
    # Every obstore kind too: the answer's version is checked, not only asked for.
    backend = _backend(liar, kind=kind)
    meta = await backend.head("ignores-if-match")
    assert meta is not None
    first = await backend.get("ignores-if-match", ByteRange(0, 5), version=meta)
    assert first is not None
    assert bytes(first) == b"AAAAA"
    # The file changed on the server, which sends its new bytes despite If-Match.
    with pytest.raises(VersionChangedError):
        await backend.get("ignores-if-match", ByteRange(5, 10), version=meta)
    with pytest.raises(VersionChangedError):
        async for _ in backend.stream_range(meta, ByteRange(0, 10), piece_bytes=4):
            pass
    assert not backend.circuit_open
    await backend.close()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", ["http", "s3"])
async def test_a_server_that_ignores_range_is_refused_not_retried(liar: Liar, kind: str) -> None:
    metrics = Metrics()
    backend = _backend(liar, metrics, kind=kind)
    meta = await backend.head("ignores-range")
    assert meta is not None
    for _ in range(6):
        with pytest.raises(IntegrityError, match="does not serve byte ranges"):
            await backend.get("ignores-range", ByteRange(2, 5), version=meta)
    # Its answer, not a failure: never retried, never counted against it.
    assert not backend.circuit_open
    gets = metrics.registry.get_sample_value(
        "chunkd_backend_requests_total", {"backend": "web", "op": "get"}
    )
    assert gets == 6
    await backend.close()


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("kind", "name"),
    # S3 (obstore) refuses a GET without a Content-Length itself
    [("http", "huge"), ("http", "huge-chunked"), ("s3", "huge")],
)
async def test_a_small_range_never_reads_a_huge_body(liar: Liar, name: str, kind: str) -> None:
    backend = _backend(liar, kind=kind)
    meta = await backend.head(name)
    assert meta is not None
    with pytest.raises(IntegrityError, match="sent more than the 4 bytes asked for"):
        await backend.get(name, ByteRange(0, 4), version=meta)
    with pytest.raises(IntegrityError, match="sent more than the 4 bytes"):
        async for _ in backend.stream_range(meta, ByteRange(0, 4), piece_bytes=1 << 20):
            pass

    async def first_read() -> None:
        first = await backend.open_first(name, 0, 4, piece_bytes=1 << 20)
        assert first is not None
        assert first.pieces is not None
        async for _ in first.pieces:
            pass

    with pytest.raises(IntegrityError, match="sent more than the 4 bytes"):
        await first_read()
    # Three answers of 64 MiB each were on offer; chunkd stopped each well before.
    assert liar.huge_sent < HUGE // 2
    assert not backend.circuit_open
    await backend.close()


@pytest.mark.timeout(10)
async def test_immutable_files_needs_a_last_modified(liar: Liar) -> None:
    backend = _backend(liar, immutable_files=True)
    with pytest.raises(UnversionedObjectError, match="no ETag and no Last-Modified"):
        await backend.head("unversioned")
    with pytest.raises(UnversionedObjectError, match="no Last-Modified"):
        await backend.get("unversioned", ByteRange(0, 4))
    assert not backend.circuit_open
    await backend.close()


@pytest.mark.timeout(10)
async def test_redirects_are_followed_only_within_the_rule(liar: Liar) -> None:
    backend = _backend(liar)
    # Within its own origin: followed.
    meta = await backend.head("moved")
    assert meta is not None
    assert meta.etag == '"a1"'
    got = await backend.get("moved", ByteRange(0, 4))
    assert got is not None
    assert bytes(got) == b"0123"
    # To another server on loopback: plain http, then https to a name that resolves
    # to loopback. Refused, said, and never asked.
    with pytest.raises(BackendForbiddenError, match=r"does not follow \(not https\)"):
        await backend.head("away")
    with pytest.raises(BackendForbiddenError, match=r"127\.0\.0\.1:\d+, which chunkd does not"):
        await backend.get("away", ByteRange(0, 4))
    with pytest.raises(BackendForbiddenError, match=r"resolves to an address that is not public"):
        await backend.head("away-https")
    assert liar.other_paths == []
    assert not backend.circuit_open
    await backend.close()


@pytest.mark.timeout(20)
async def test_a_redirect_whose_host_rebinds_to_loopback_is_refused_not_retried(
    liar: Liar, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DNS rebinding: the redirect's host resolved to a public address when the rule
    # checked it, and to loopback when connecting. No public name resolves here, so the
    # first lookup's answer is what the check is told; the connection's resolver is real.
    async def looked_public(self: object, key: str, url: object) -> None:
        return None

    monkeypatch.setattr(http.HTTPBackend, "_check_redirect", looked_public)
    backend = _backend(liar)
    for _ in range(6):
        with pytest.raises(BackendForbiddenError, match="now resolves to an address that is not"):
            await backend.head("away-https")
    assert liar.other_paths == [], "the loopback server was never asked"
    assert not backend.circuit_open, "the rule's refusal is not a backend that is down"
    await backend.close()


@pytest.mark.timeout(20)
async def test_a_url_too_long_for_the_server_is_the_keys_own(tmp_path: Path) -> None:
    nginx_or_skip()
    root = tmp_path / "www"
    (root / "pre").mkdir(parents=True)
    metrics = Metrics()
    with NginxServer(root, tmp_path / "nginx", header_buffers="4 1k") as server:
        config = BackendConfig(name="web", url=f"{server.url}/pre", allow_http=True)
        backend = make_backend(config, metrics)
        key = "k/" + "x" * 1018  # a request line over 1 KiB: nginx answers 414
        for _ in range(6):
            with pytest.raises(InvalidKeyError, match="refused the URL of the key"):
                await backend.head(key)
        assert not backend.circuit_open
        rejected = metrics.registry.get_sample_value(
            "chunkd_backend_rejected_keys_total", {"backend": "web"}
        )
        assert rejected == 6
        await backend.close()


@pytest.mark.timeout(10)
def test_a_file_of_keys_holds_only_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_bytes("\ufeff a.jsonl \r\n\tb/c.jsonl\n\n".encode())
    assert read_keys(keys) == ["a.jsonl", "b/c.jsonl"]
    for text, line, what in [
        ("a\n../x\n", 2, r"'\.\./x' has an empty, '\.' or '\.\.' path segment"),
        ("a\x00b\n", 1, "holds a control character"),
        ("ok\na\rb\n", 2, "holds a control character"),
        ("a\\b\n", 1, "holds a backslash"),
        ("x" * 1025 + "\n", 1, "keys are at most 1024"),
    ]:
        keys.write_bytes(text.encode())
        with pytest.raises(InvalidRequestError, match=f"line {line} of the file of keys.*{what}"):
            read_keys(os.fspath(keys))
