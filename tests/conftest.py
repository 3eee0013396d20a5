"""Shared fixtures: caches in temporary directories that are always closed."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from chunkd.cache import CacheConfig, ChunkCache
from chunkd.testing import CountingProxy, S3Server, free_port
from chunkd.testing.daemon import DaemonProcess

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


@pytest.fixture
def clean_cwd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No ``CHUNKD_*`` variable of the machine's, and the test's own directory as the
    working one: what a CLI test in-process sees is the config it set up."""
    for var in list(os.environ):
        if var.startswith("CHUNKD_"):
            monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto_server on a free loopback port for the whole session."""
    with S3Server.start() as server:
        yield server


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
    host: str = "127.0.0.1"
    #: the CA to check a daemon that serves HTTPS against ([peers] TLS); None: http
    tls_ca: Path | None = None

    @property
    def url(self) -> str:
        scheme = "http" if self.tls_ca is None else "https"
        return f"{scheme}://{self.host}:{self.port}"

    def get(
        self, path: str, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        request = urllib.request.Request(self.url + path, headers=headers or {})
        context = None
        if self.tls_ca is not None:
            context = ssl.create_default_context(cafile=str(self.tls_ca))
        try:
            with urllib.request.urlopen(request, timeout=60, context=context) as response:
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
    """Factory: ``start_daemon(toml_text)`` runs ``chunkd serve`` and waits for /readyz.

    ``tls_ca``: the daemon serves HTTPS; its helpers check it against this CA bundle.
    ``extra_args``: more ``chunkd serve`` arguments (``--enable-faults``).
    """
    started: list[Daemon] = []

    def factory(
        toml: str | None = None,
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        port: int | None = None,
        notify: bool = False,
        wait: bool = True,
        tls_ca: Path | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> Daemon:
        port = port or free_port()
        run_dir = cwd or tmp_path
        config = tmp_path / f"chunkd-{len(started)}.toml"
        notify_socket = None
        extra_env = dict(env or {})
        if notify:
            notify_socket = tmp_path / f"notify-{len(started)}.sock"
            extra_env["NOTIFY_SOCKET"] = str(notify_socket)
        launched = DaemonProcess(
            toml,
            cwd=run_dir,
            env=extra_env,
            args=extra_args,
            log=tmp_path / f"daemon-{len(started)}.log",
            config_path=config,
            listen=f"127.0.0.1:{port}",
            socket=run_dir / "chunkd.sock",
        )
        environ = launched.env
        host = environ["CHUNKD_SERVER_LISTEN"].rpartition(":")[0]
        daemon = Daemon(
            launched.process,
            port,
            config,
            run_dir,
            environ,
            launched.log,
            notify_socket,
            host=host,
            tls_ca=tls_ca,
        )
        started.append(daemon)
        if wait:
            wait_ready(daemon)
        return daemon

    yield factory
    for daemon in started:
        if daemon.process.poll() is None:
            daemon.process.kill()
            daemon.process.wait(timeout=10)
    # No daemon may leave a task's exception unretrieved: each is a failure nobody
    # handled (and a task that died).
    for daemon in started:
        log = daemon.log.read_text(errors="replace")
        assert "exception was never retrieved" not in log, (
            f"{daemon.log} shows a task exception that was never retrieved:\n{log[-4000:]}"
        )


def wait_for_socket(path: Path, timeout: float) -> bool:
    """Whether a daemon answers on the Unix socket ``path`` within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if stat.S_ISSOCK(path.stat().st_mode):
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                    probe.connect(str(path))
                return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


def small_node_toml(cache: Path, *backends: tuple[str, Path], chunk_bytes: str = "4MiB") -> str:
    """A daemon's config for a test: a small cache at ``cache``, no fsync, and a writable
    ``file://`` backend for each (name, directory) of ``backends``."""
    text = f"""
[cache]
dir = "{cache}"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
chunk_bytes = "{chunk_bytes}"
fsync = "never"
"""
    for name, root in backends:
        text += f"""
[[backends]]
name = "{name}"
url = "file://{root}"
writable = true
revalidate = "1s"
"""
    return text


def dataset_cli(daemon: Daemon, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``chunkd dataset ARGS`` as a user runs it, against ``daemon``'s socket; with
    ``check``, it must exit 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    env["CHUNKD_SOCKET"] = str(daemon.cwd / "chunkd.sock")
    done = subprocess.run(
        [str(BIN / "chunkd"), "dataset", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done


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


@contextlib.contextmanager
def veth_namespace(
    name: str, host: tuple[str, ...], inside: tuple[str, ...], prefix_len: int
) -> Iterator[str]:
    """A network namespace ``chunkd-NAME-PID`` on a veth pair: ``host`` addresses on the
    host's side, ``inside`` ones in the namespace (each ``/prefix_len``, from
    198.18.0.0/15 only); yields the namespace's name and removes everything afterwards.
    Skips the test where it cannot be built (not root, no iproute2)."""
    import shutil

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2; they show another host")
    tag = f"{name}{os.getpid() % 100000}"
    ns, host_if, ns_if = f"chunkd-{tag}", f"ck{tag}h", f"ck{tag}n"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def remove() -> None:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, check=False)

    try:
        ip("netns", "add", ns)
        ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        ip("link", "set", ns_if, "netns", ns)
        for address in host:
            ip("addr", "add", f"{address}/{prefix_len}", "dev", host_if)
        ip("link", "set", host_if, "up")
        for address in inside:
            ip("netns", "exec", ns, "ip", "addr", "add", f"{address}/{prefix_len}", "dev", ns_if)
        ip("netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        remove()
        pytest.skip(f"cannot build a network namespace here: {exc.stderr.decode().strip()}")
    try:
        yield ns
    finally:
        remove()


@pytest.fixture
def other_host() -> Iterator[tuple[str, str]]:
    """A network namespace on a veth pair: (the namespace, the host side's address).

    Addresses come from 198.18.0.0/15 only; everything is removed afterwards.
    """
    host_ip, ns_ip = "198.18.77.1", "198.18.77.2"
    with veth_namespace("t", (host_ip,), (ns_ip,), 30) as ns:
        yield ns, host_ip


_PROBE = """
import sys, urllib.request, urllib.error
url, auth = sys.argv[1], sys.argv[2]
request = urllib.request.Request(url, headers={"Authorization": auth} if auth else {})
try:
    with urllib.request.urlopen(request, timeout=20) as r:
        print(r.status, r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode())
"""


def get_from_namespace(ns: str, url: str, auth: str = "") -> tuple[int, str]:
    """GET ``url`` from inside the network namespace ``ns`` (another host, as
    ``other_host`` builds it): (status, body as text)."""
    import subprocess

    done = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", _PROBE, url, auth],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    status, _, body = done.stdout.strip().partition(" ")
    return int(status), body


@dataclass
class FrontNode:
    """A daemon that serves ``[s3_front]``: bucket ``data`` is the moto bucket ``name``
    (through ``proxy``, which counts the backend's bytes), ``local`` a file backend at
    ``files``."""

    daemon: Daemon
    endpoint: str
    port: int
    name: str
    proxy: CountingProxy
    files: Path

    def client(self, **config: Any) -> Any:
        from chunkd.testing.s3front import front_client

        return front_client(self.endpoint, **config)


@pytest.fixture
def s3_front(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> Callable[..., FrontNode]:
    """Factory: ``s3_front(**front_keys)`` starts a daemon with ``[s3_front]`` on a free
    port over bucket ``data`` (moto, counted) and ``local`` (files); ``toml`` adds
    more config."""
    from chunkd.testing import s3_backend
    from chunkd.testing.s3front import front_section

    def factory(*, toml: str = "", **front: str | bool) -> FrontNode:
        port = free_port()
        files = tmp_path / "files"
        files.mkdir(exist_ok=True)
        backend = s3_backend("data", f"s3://{bucket}", s3_proxy.endpoint, timeout="5s", retries=1)
        config = f"""
[server]
shutdown_timeout = "5s"

[cache]
dir = "{tmp_path / f"cache-{port}"}"
ram_bytes = "512MiB"
disk_bytes = "2GiB"
disk_min_free_bytes = 0
fsync = "never"

{front_section(port, **front)}
{toml}
{backend}
[[backends]]
name = "local"
url = "file://{files}"
writable = true
revalidate = "1s"
"""
        daemon = start_daemon(config)
        return FrontNode(daemon, f"http://127.0.0.1:{port}", port, bucket, s3_proxy, files)

    return factory
