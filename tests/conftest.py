"""Shared fixtures: caches in temporary directories that are always closed."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from chunkd.cache import CacheConfig, ChunkCache

OpenCache = Callable[..., Awaitable[ChunkCache]]


@pytest.fixture
async def open_cache(tmp_path: Path) -> AsyncIterator[OpenCache]:
    """Factory: ``await open_cache(**config)`` opens a cache under ``tmp_path/cache``.

    Small budgets and no fsync unless overridden; every cache opened is closed at
    the end of the test.
    """
    opened: list[ChunkCache] = []

    async def factory(**overrides: Any) -> ChunkCache:
        settings: dict[str, Any] = {
            "dir": tmp_path / "cache",
            "ram_bytes": 8 << 20,
            "disk_bytes": 32 << 20,
            "disk_min_free_bytes": 0,
            "chunk_bytes": 1 << 20,
            "fsync": "never",
        }
        settings.update(overrides)
        cache = await ChunkCache.open(CacheConfig(**settings))
        opened.append(cache)
        return cache

    yield factory
    for cache in opened:
        await cache.close()


# -- real servers for the gateway tests --------------------------------------------------


BIN = Path(sys.executable).parent


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        except OSError:
            time.sleep(0.05)
        else:
            return
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


@dataclass
class S3Server:
    """A real S3-protocol server (moto's server mode) in a subprocess."""

    port: int
    process: subprocess.Popen[bytes]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing-secret",
            region_name="us-east-1",
        )


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto_server on a free loopback port for the whole session."""
    port = free_port()
    process = subprocess.Popen(
        [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port)
        yield S3Server(port, process)
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def bucket(s3_server: S3Server) -> Iterator[str]:
    """A fresh, empty bucket (removed afterwards)."""
    import uuid

    name = f"chunkd-{uuid.uuid4().hex[:12]}"
    client = s3_server.client()
    client.create_bucket(Bucket=name)
    yield name
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
        for item in page.get("Contents", []):
            client.delete_object(Bucket=name, Key=item["Key"])
    client.delete_bucket(Bucket=name)


class CountingProxy:
    """A TCP proxy in front of the S3 server that counts the bytes it answers with.

    The count does not depend on the daemon's own metrics. ``down()`` closes the
    listener and every connection (the backend is gone: connections are refused);
    ``up()`` listens again on the same port.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.bytes_down = 0
        self.connections = 0
        #: seconds to sleep before passing on each 64 KiB the server sends (a slow link)
        self.delay = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.up()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    def up(self) -> None:
        async def start() -> None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

        self._call(start())

    def down(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
                self._server = None
            for writer in list(self._writers):
                writer.transport.abort()

        self._call(stop())

    def reset(self) -> None:
        self.bytes_down = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, count: bool) -> None:
            try:
                while data := await src.read(1 << 16):
                    if count:
                        self.bytes_down += len(data)
                        if self.delay:
                            await asyncio.sleep(self.delay)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))
        self._writers.difference_update((writer, up_writer))

    def close(self) -> None:
        self.down()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def s3_proxy(s3_server: S3Server) -> Iterator[CountingProxy]:
    proxy = CountingProxy(s3_server.port)
    yield proxy
    proxy.close()


@dataclass
class Daemon:
    """A real ``chunkd serve`` process."""

    process: subprocess.Popen[bytes]
    port: int
    config: Path
    cwd: Path
    env: dict[str, str]
    log: Path
    notify_socket: Path | None = None
    lines: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(
        self, path: str, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        request = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a metric's samples matching ``labels`` (0 when absent)."""
        status, _, body = self.get("/metrics")
        assert status == 200
        total = 0.0
        for line in body.decode().splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            head, _, value = line.rpartition(" ")
            metric, _, label_text = head.partition("{")
            if metric != name:
                continue
            if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
                total += float(value)
        return total

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Factory: ``start_daemon(toml_text)`` runs ``chunkd serve`` and waits for /readyz."""
    started: list[Daemon] = []

    def factory(
        toml: str | None = None,
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        port: int | None = None,
        notify: bool = False,
        wait: bool = True,
    ) -> Daemon:
        port = port or free_port()
        run_dir = cwd or tmp_path
        run_dir.mkdir(parents=True, exist_ok=True)
        config = tmp_path / f"chunkd-{len(started)}.toml"
        args = [str(BIN / "chunkd"), "serve"]
        if toml is not None:
            config.write_text(toml)
            args += ["--config", str(config)]
        environ = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
        environ.update(env or {})
        environ["CHUNKD_SERVER_LISTEN"] = f"127.0.0.1:{port}"
        notify_socket = None
        if notify:
            notify_socket = tmp_path / f"notify-{len(started)}.sock"
            environ["NOTIFY_SOCKET"] = str(notify_socket)
        log = tmp_path / f"daemon-{len(started)}.log"
        with log.open("ab") as sink:
            process = subprocess.Popen(args, cwd=run_dir, env=environ, stdout=sink, stderr=sink)
        daemon = Daemon(process, port, config, run_dir, environ, log, notify_socket)
        started.append(daemon)
        if wait:
            wait_ready(daemon)
        return daemon

    yield factory
    for daemon in started:
        if daemon.process.poll() is None:
            daemon.process.kill()
            daemon.process.wait(timeout=10)


def wait_ready(daemon: Daemon, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon.process.poll() is not None:
            raise AssertionError(
                f"chunkd exited with {daemon.process.returncode}:\n{daemon.log.read_text()}"
            )
        try:
            status, _, _ = daemon.get("/readyz")
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"chunkd not ready after {timeout}s:\n{daemon.log.read_text()}")
