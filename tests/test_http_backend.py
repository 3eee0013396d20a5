"""The ``https://`` (and ``http://``) kind: read-only, unlisted, versioned by strong ETag.

Against Debian's nginx (``nginx-light``) on loopback (:mod:`chunkd.testing.nginx`),
which serves ``Range``, ``ETag`` (strong: mtime and size), ``If-Match`` and
``If-None-Match`` as a mirror or a static file server does. The conformance suite
runs with the kind's claims (no writes, no listings); the rest: a server without
ETags refused unless ``immutable_files``, the config's refusals, and reads through a
real ``chunkd serve``.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from chunkd.client import Client
from chunkd.client.datasets.register import (
    MAX_KEYS,
    MAX_KEYS_FILE_BYTES,
    read_keys,
    scan_prefix,
)
from chunkd.errors import (
    BackendUnavailableError,
    ConfigError,
    InvalidRequestError,
    ObjectNotFoundError,
    ReadOnlyBackendError,
    UnversionedObjectError,
    VersionChangedError,
)
from chunkd.gateway.backends import Backend, make_backend
from chunkd.gateway.config import BackendConfig
from chunkd.gateway.metrics import Metrics
from chunkd.ranges import ByteRange
from chunkd.testing.backends import BackendTests
from chunkd.testing.nginx import NginxServer, nginx_or_skip
from chunkd.testing.proxy import CountingProxy

from .conftest import Daemon, dataset_cli

# nginx's ETag holds the mtime in seconds: each write here moves it a second on.
_CLOCK = itertools.count(int(time.time()) - 100_000)


def put_file(root: Path, key: str, data: bytes) -> None:
    """Write a file the server serves, with an mtime of its own (a new ETag)."""
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    stamp = next(_CLOCK)
    os.utime(path, (stamp, stamp))


@pytest.fixture
def nginx(tmp_path: Path) -> Iterator[NginxServer]:
    nginx_or_skip()
    root = tmp_path / "www"
    root.mkdir()
    with NginxServer(root, tmp_path / "nginx") as server:
        yield server


def web_backend(server: NginxServer, **keys: object) -> Backend:
    config = BackendConfig(name="web", url=f"{server.url}/pre", allow_http=True, **keys)  # type: ignore[arg-type]
    return make_backend(config, Metrics())


@pytest.mark.timeout(20)
class TestHTTP(BackendTests):
    claims: ClassVar[frozenset[str]] = frozenset()  # reads only

    @pytest.fixture
    async def backend(self, nginx: NginxServer) -> AsyncIterator[Backend]:
        self.root = nginx.root / "pre"
        backend = web_backend(nginx)
        yield backend
        await backend.close()

    async def write(self, backend: Backend, key: str, data: bytes) -> None:
        put_file(self.root, key, data)


@pytest.mark.timeout(20)
async def test_a_server_without_etags_is_refused_unless_its_files_are_immutable(
    tmp_path: Path,
) -> None:
    nginx_or_skip()
    root = tmp_path / "www"
    put_file(root, "pre/a.bin", b"0123456789")
    with NginxServer(root, tmp_path / "nginx", etag=False) as server:
        strict = web_backend(server)
        with pytest.raises(UnversionedObjectError, match=r"sent no ETag.*immutable_files = true"):
            await strict.head("a.bin")
        with pytest.raises(UnversionedObjectError, match="no ETag"):
            await strict.get("a.bin", ByteRange(0, 4))
        assert not strict.circuit_open  # the server's answer, not a failure
        fixed = web_backend(server, immutable_files=True)
        meta = await fixed.head("a.bin")
        assert meta is not None
        assert (meta.size, meta.etag) == (10, None)
        assert meta.version.startswith("10-")  # size and Last-Modified
        got = await fixed.get("a.bin", ByteRange(2, 5), version=meta)
        assert got is not None
        assert bytes(got) == b"234"
        # A changed file (its Last-Modified moved) is another version: a pinned read
        # of the old one refuses the new bytes.
        put_file(root, "pre/a.bin", b"abcdefghij")
        changed = await fixed.head("a.bin")
        assert changed is not None
        assert changed.version != meta.version
        with pytest.raises(VersionChangedError):
            await fixed.get("a.bin", ByteRange(0, 4), version=meta)
        await strict.close()
        await fixed.close()


@pytest.mark.timeout(20)
async def test_a_weak_etag_is_no_version(tmp_path: Path) -> None:
    nginx_or_skip()
    root = tmp_path / "www"
    put_file(root, "pre/a.bin", b"0123456789")
    with NginxServer(root, tmp_path / "nginx", etag='W/"same-for-all"') as server:
        strict = web_backend(server)
        with pytest.raises(
            UnversionedObjectError, match=r"only a weak ETag \(W/\"same-for-all\"\)"
        ):
            await strict.head("a.bin")
        fixed = web_backend(server, immutable_files=True)
        meta = await fixed.head("a.bin")
        assert meta is not None
        assert (meta.etag, meta.version.startswith("10-")) == (None, True)
        first = await fixed.open_first("a.bin", 0, 4, piece_bytes=64)
        assert first is not None
        assert first.meta.version == meta.version  # the weak ETag plays no part
        assert first.pieces is not None
        assert b"".join([bytes(p) async for p in first.pieces]) == b"0123"
        got = await fixed.get("a.bin", ByteRange(4, 8), version=meta)
        assert got is not None
        assert bytes(got) == b"4567"
        await strict.close()
        await fixed.close()


@pytest.mark.timeout(10)
async def test_writes_are_refused_with_a_clear_error(nginx: NginxServer) -> None:
    backend = web_backend(nginx)
    with pytest.raises(ReadOnlyBackendError, match="served over HTTP, which chunkd only reads"):
        await backend.put("k", b"x")
    await backend.close()
    with pytest.raises(ConfigError, match=r"writable is true, but an http.* is read-only"):
        BackendConfig(name="web", url=f"{nginx.url}/", allow_http=True, writable=True)


@pytest.mark.timeout(10)
def test_the_config_of_an_http_backend() -> None:
    with pytest.raises(ConfigError, match="is plain http, but allow_http is false"):
        BackendConfig(name="web", url="http://127.0.0.1:9/x")
    with pytest.raises(ConfigError, match="has credentials in it"):
        BackendConfig(name="web", url="https://u:p@example.org/x")
    BackendConfig(name="web", url="https://example.org/x")  # https needs no allow_http
    with pytest.raises(ConfigError, match="takes no region"):
        make_backend(BackendConfig(name="web", url="https://h/x", region="eu"), Metrics())
    with pytest.raises(ConfigError, match="an s3:// backend takes no immutable_files"):
        make_backend(BackendConfig(name="s", url="s3://b", immutable_files=True), Metrics())


@pytest.mark.timeout(30)
def test_a_daemon_reads_an_http_backend_by_its_versions(
    nginx: NginxServer, start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    data = bytes(range(256)) * 40
    put_file(nginx.root, "mirror/shard.bin", data)
    daemon = start_daemon(
        f"""
[cache]
dir = "{tmp_path / "cache"}"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
fsync = "never"

[[backends]]
name = "web"
url = "{nginx.url}/mirror"
allow_http = true
revalidate = "1ms"
"""
    )
    status, headers, body = daemon.get("/v1/objects/web/shard.bin", {"Range": "bytes=100-199"})
    assert (status, body) == (206, data[100:200])
    first = headers["ETag"]
    status, headers, body = daemon.get("/v1/objects/web/shard.bin")
    assert (status, body, headers["ETag"]) == (200, data, first)
    # The file changes on the server: a new ETag, a new version (a read pinned to the
    # old one is refused: BackendTests' test_conditional_read_of_a_changed_object).
    changed = data[::-1]
    put_file(nginx.root, "mirror/shard.bin", changed)
    time.sleep(0.05)
    status, headers, body = daemon.get("/v1/objects/web/shard.bin", {"Range": "bytes=0-9"})
    assert (status, body) == (206, changed[:10])
    assert headers["ETag"] != first
    # A client holding bytes of the old version asks for more of it: it gets the new
    # version whole, never a mix of the two.
    status, headers, body = daemon.get(
        "/v1/objects/web/shard.bin", {"Range": "bytes=10-19", "If-Range": first}
    )
    assert (status, body) == (200, changed)
    status, _, body = daemon.get("/v1/objects/web/nope.bin")
    assert status == 404
    status, _, body = daemon.get("/v1/list/web")
    assert status == 400
    assert b"cannot be listed" in body
    assert "Traceback" not in daemon.log.read_text()


def _web_node(nginx: NginxServer, start_daemon: Callable[..., Daemon], tmp_path: Path) -> Daemon:
    """A daemon with the nginx mirror (``web``) and a file:// registry (``reg``)."""
    (tmp_path / "reg").mkdir()
    return start_daemon(
        f"""
[cache]
dir = "{tmp_path / "cache"}"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
fsync = "never"

[[backends]]
name = "web"
url = "{nginx.url}/mirror"
allow_http = true
revalidate = "1ms"

[[backends]]
name = "reg"
url = "file://{tmp_path / "reg"}"
writable = true

[datasets]
registry = "reg/datasets"
"""
    )


@pytest.mark.timeout(60)
def test_a_dataset_on_an_http_mirror_registers_from_a_file_of_keys(
    nginx: NginxServer, start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    names = [f"train/part-{i}.jsonl" for i in range(5)]
    for i, name in enumerate(names):
        put_file(
            nginx.root, f"mirror/{name}", b"".join(b'{"n": %d}\n' % (i * 10 + j) for j in range(10))
        )
    daemon = _web_node(nginx, start_daemon, tmp_path)
    keys = tmp_path / "keys.txt"
    keys.write_text("\n".join(name.removeprefix("train/") for name in reversed(names)) + "\n\n")
    # No listing: without its keys, the registration says how to give them.
    unlisted = dataset_cli(daemon, "register", "mirror", "web/train", check=False)
    assert unlisted.returncode != 0
    assert "cannot be listed" in unlisted.stderr
    assert "--keys" in unlisted.stderr
    assert "Traceback" not in unlisted.stderr
    done = dataset_cli(daemon, "register", "mirror", "web/train", "--keys", str(keys), "--json")
    registered = json.loads(done.stdout)
    assert (registered["members"], registered["samples"]) == (5, 50)
    shown = json.loads(dataset_cli(daemon, "show", "mirror", "--json").stdout)
    assert shown["members"] == 5
    assert dataset_cli(daemon, "check", "mirror").returncode == 0
    # A member rewritten on the mirror (a new ETag) is drift, named.
    put_file(nginx.root, f"mirror/{names[2]}", b'{"n": -1}\n' * 10)
    drifted = dataset_cli(daemon, "check", "mirror", "--json", check=False)
    assert drifted.returncode == 1
    assert {f["member"] for f in json.loads(drifted.stdout) if f["code"] == "drift"} == {names[2]}
    # The Python API takes the keys as a list; a key that names nothing is an error.
    with Client(daemon.cwd / "chunkd.sock") as client:
        snapshot = scan_prefix(client, "web/train", keys=["part-0.jsonl", "part-1.jsonl"])
        assert [m.key for m in snapshot.members] == names[:2]
        with pytest.raises(ObjectNotFoundError, match=r"part-9\.jsonl"):
            scan_prefix(client, "web/train", keys=["part-0.jsonl", "part-9.jsonl"])
    missing = tmp_path / "missing.txt"
    missing.write_text("part-0.jsonl\npart-0.jsonl\n")
    twice = dataset_cli(daemon, "register", "x", "web/train", "--keys", str(missing), check=False)
    assert "named twice" in twice.stderr
    absent = dataset_cli(
        daemon, "register", "x", "web/train", "--keys", str(tmp_path / "nope"), check=False
    )
    assert "cannot read the file of keys" in absent.stderr


@pytest.mark.timeout(20)
def test_a_file_of_keys_is_bounded(tmp_path: Path) -> None:
    many = tmp_path / "many.txt"
    many.write_bytes(b"k\n" * (MAX_KEYS + 1))
    with pytest.raises(
        InvalidRequestError, match=f"more than a registration takes \\({MAX_KEYS}\\)"
    ):
        read_keys(many)
    large = tmp_path / "large.txt"
    with large.open("wb") as out:
        out.truncate(MAX_KEYS_FILE_BYTES + 1)
    with pytest.raises(InvalidRequestError, match="larger than"):
        read_keys(large)
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(InvalidRequestError, match="not UTF-8"):
        read_keys(tmp_path / "latin.txt")
    (tmp_path / "ok.txt").write_bytes("b/ü.jsonl\r\na.jsonl\n\n".encode())
    assert read_keys(tmp_path / "ok.txt") == ["a.jsonl", "b/ü.jsonl"]


@pytest.mark.timeout(20)
async def test_a_kind_that_is_only_its_io_gets_retries_and_the_circuit_breaker(
    nginx: NginxServer,
) -> None:
    # gateway/backends/http.py has no retry or breaker of its own: the registry's
    # wrapper (Resilient) gives it the same rules as every kind.
    put_file(nginx.root, "pre/k", b"through the proxy")
    proxy = CountingProxy(nginx.port)
    metrics = Metrics()
    config = BackendConfig(
        name="web", url=f"http://127.0.0.1:{proxy.port}/pre", allow_http=True, retries=1
    )
    backend = make_backend(config, metrics)

    def sample(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, {"backend": "web", **labels}) or 0.0

    try:
        assert await backend.head("k") is not None
        proxy.down()
        for _ in range(2):  # each: an attempt and one retry, both refused
            with pytest.raises(BackendUnavailableError):
                await backend.head("k")
        assert sample("chunkd_backend_requests_total", op="head") == 5
        assert not backend.circuit_open
        with pytest.raises(BackendUnavailableError):
            await backend.head("k")  # the 5th failure in a row opens it: no retry
        assert backend.circuit_open
        assert sample("chunkd_backend_requests_total", op="head") == 6
        assert sample("chunkd_backend_circuit_open") == 1
        with pytest.raises(BackendUnavailableError, match="chunkd stopped asking it"):
            await backend.get("k")  # fails fast, nothing sent
        assert sample("chunkd_backend_requests_total", op="get") == 0
        # the five refused attempts; a request failed fast by the open circuit is no error
        assert sample("chunkd_backend_errors_total", kind="BackendUnavailableError") == 5
    finally:
        await backend.close()
        proxy.close()
