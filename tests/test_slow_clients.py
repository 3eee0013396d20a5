"""Slow and abandoned connections on the HTTP port and the S3 front (issue 24).

Real daemons, real sockets: crowds of slow clients (``chunkd.testing.crowd``, a process
of its own) against each port, a peer daemon fetching through the peer route, the local
socket, and, for a crowd of many addresses, a network namespace with addresses in
198.18.0.0/15 only (removed at the end). The bounds are those of
``chunkd.gateway.connections`` (docs/security.md, "Connections and slow clients"); the
daemons here run them short: ``header_timeout`` 2 s, ``idle_timeout`` and
``body_timeout`` 3 s.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import resource
import select
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

import pytest

from chunkd.client import Client
from chunkd.testing import free_port
from chunkd.testing.s3front import front_section

from .conftest import Daemon, veth_namespace, wait_ready

HEADER_TIMEOUT = 2.0
IDLE_TIMEOUT = 3.0
BODY_TIMEOUT = 3.0
#: what a crowd may add to the daemon's anonymous memory (its heap), with 1,000 slow
#: connections against a port
RSS_BOUND = 64 << 20
#: each answer the tests wait for while a crowd is at the door
ANSWER_WITHIN = 1.0
CHUNK = 64 << 10
TOKEN = "slow-clients-peer-token-0123456789"
PROBE_OBJECTS = 8
PROBE_SIZE = 32 * CHUNK  # 32 chunks: some of them, surely, owned by the other node


def node_toml(
    tmp_path: Path,
    name: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    peers: list[str] | None = None,
    front_port: int | None = None,
    server: str = "",
    front: dict[str, str | bool] | None = None,
    header_timeout: float = HEADER_TIMEOUT,
) -> str:
    """A daemon's config: a file backend ``local`` over ``tmp_path/files``, the short
    connection bounds, and ``[peers]``/``[s3_front]`` when asked."""
    files = tmp_path / "files"
    files.mkdir(exist_ok=True)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    text = f"""
[server]
listen = "{host}:{port}"
socket = "{tmp_path / name / "chunkd.sock"}"
shutdown_timeout = "2s"
header_timeout = "{header_timeout}s"
idle_timeout = "{IDLE_TIMEOUT}s"
body_timeout = "{BODY_TIMEOUT}s"
{server}

[cache]
dir = "{tmp_path / name / "cache"}"
chunk_bytes = "{CHUNK // 1024}KiB"
ram_bytes = "128MiB"
disk_bytes = "512MiB"
disk_min_free_bytes = 0
fsync = "never"

[[backends]]
name = "local"
url = "file://{files}"
writable = true
"""
    if peers is not None:
        listed = ", ".join(f'"{m}"' for m in peers)
        text += f"""
[peers]
self = "{host}:{port}"
members = [{listed}]
token_file = "{token}"
timeout = "2s"
health_interval = "300ms"
down_after = 4
up_after = 1
"""
    if front_port is not None:
        text += "\n" + front_section(front_port, **(front or {}))
    return text


@contextlib.contextmanager
def fd_limit(fds: int) -> Iterator[None]:
    """Children started meanwhile inherit a soft fd limit of ``fds``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (fds, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def start(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    name: str,
    port: int,
    toml: str,
    *,
    fds: int | None = None,
    host: str = "127.0.0.1",
) -> Daemon:
    (tmp_path / name).mkdir(exist_ok=True)
    env = {"CHUNKD_SERVER_LISTEN": f"{host}:{port}"}
    if fds is None:
        daemon = start_daemon(toml, env=env, cwd=tmp_path / name, port=port, wait=False)
    else:
        with fd_limit(fds):
            daemon = start_daemon(toml, env=env, cwd=tmp_path / name, port=port, wait=False)
        limits = Path(f"/proc/{daemon.process.pid}/limits").read_text()
        assert any(
            line.startswith("Max open files") and line.split()[3] == str(fds)
            for line in limits.splitlines()
        ), limits
    wait_ready(daemon)
    return daemon


def memory(pid: int) -> dict[str, int]:
    """The process's RssAnon (its heap: what connections cost) and VmRSS, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("RssAnon", "VmRSS"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def healthz(host: str, port: int, *, source: str | None = None) -> float:
    """Seconds ``GET /healthz`` took (200, or it fails)."""
    started = time.monotonic()
    conn = http.client.HTTPConnection(
        host, port, timeout=10, source_address=None if source is None else (source, 0)
    )
    try:
        conn.request("GET", "/healthz")
        answer = conn.getresponse()
        body = answer.read()
    finally:
        conn.close()
    assert (answer.status, json.loads(body)) == (200, {"ok": True})
    return time.monotonic() - started


def timed_read(socket_path: Path, name: str, size: int) -> float:
    """Seconds a local socket read of ``name`` took (its ``size`` bytes, or it fails)."""
    started = time.monotonic()
    with Client(socket_path) as client:
        assert client.read(name).nbytes == size
    return time.monotonic() - started


def closed_after(sock: socket.socket, most: float) -> float | None:
    """Seconds until the server closes ``sock`` (reading and dropping what it sends);
    None if it is still open after ``most``."""
    started = time.monotonic()
    while (left := most - (time.monotonic() - started)) > 0:
        ready, _, _ = select.select([sock], [], [], left)
        if not ready:
            break
        try:
            if not sock.recv(65536):
                return time.monotonic() - started
        except ConnectionError:
            return time.monotonic() - started
    return None


def within(seconds: float | None, bound: float) -> bool:
    """Whether a connection was closed at ``bound`` (give or take the loop's turns)."""
    return seconds is not None and bound - 0.3 <= seconds <= bound + 1.0


@dataclass
class CrowdRun:
    """A crowd process (``chunkd.testing.crowd``) and what it said."""

    process: subprocess.Popen[str]
    result: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        port: int,
        count: int,
        mode: str,
        *,
        host: str = "127.0.0.1",
        sources: tuple[str, ...] = (),
        netns: str | None = None,
        rounds_for: float = 0.0,
        head_bytes: int = 16_000,
    ) -> CrowdRun:
        argv = [
            sys.executable,
            "-m",
            "chunkd.testing.crowd",
            f"--host={host}",
            f"--port={port}",
            f"--count={count}",
            f"--mode={mode}",
            f"--sources={','.join(sources)}",
            "--every=0.5",
            "--settle=0.3",
            f"--rounds-for={rounds_for}",
            "--observe=20",
            f"--head-bytes={head_bytes}",
        ]
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        return cls(process)

    def opened(self) -> None:
        """Wait until every connection was tried."""
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line.strip() == "opened", line

    def held(self) -> dict[str, int]:
        """The connections each source still held ``--settle`` seconds after ``opened``."""
        assert self.process.stdout is not None
        word, _, text = self.process.stdout.readline().partition(" ")
        assert word == "held", text
        held: dict[str, int] = json.loads(text)
        return held

    def finish(self) -> dict[str, Any]:
        """Wait for the crowd's end and its figures."""
        out, _ = self.process.communicate(timeout=30)
        assert self.process.returncode == 0, out
        self.result = json.loads(out.strip().splitlines()[-1])
        return self.result


@dataclass
class Probes:
    """Answers timed while a crowd is at the door, and the daemon's memory meanwhile."""

    pid: int
    worst: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    peak: dict[str, int] = field(default_factory=dict)

    def time(self, what: str, call: Callable[[], float]) -> None:
        try:
            seconds = call()
        except Exception as exc:  # reported by the test's assertion
            self.failures.append(f"{what}: {exc!r}")
            return
        self.worst[what] = max(self.worst.get(what, 0.0), seconds)

    def sample(self) -> None:
        for name, value in memory(self.pid).items():
            self.peak[name] = max(self.peak.get(name, 0), value)

    def late(self) -> dict[str, float]:
        return {what: s for what, s in self.worst.items() if s > ANSWER_WITHIN}


def sampling(probes: Probes, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            probes.sample()
            time.sleep(0.05)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def write_probe_objects(files: Path) -> list[str]:
    names = []
    for i in range(PROBE_OBJECTS):
        (files / f"probe-{i}").write_bytes(bytes([i]) * PROBE_SIZE)
        names.append(f"local/probe-{i}")
    (files / "small").write_bytes(b"s" * 1000)
    return names


def s3_get(host: str, port: int, path: str) -> tuple[int, bytes]:
    """An unsigned GET of the S3 front: (status, body)."""
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", path)
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def metric(daemon: Daemon, name: str, **labels: str) -> float:
    return daemon.metric(name, **labels)


# -- one port at a time: 1,000 slow clients from this host -------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("door", ["http", "s3"])
def test_a_thousand_slow_clients_leave_health_a_peer_and_the_local_socket_answering(
    door: str, start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """1,000 connections against one port of a daemon held to 512 fds (400 trickling
    a head, 300 silent, 300 sending 100 header lines of 8 KB), each one the daemon
    closes opened again every 0.5 s for 3 s: meanwhile ``/healthz``, a peer daemon's
    reads through the peer route and a local socket read each answer within 1 s, the
    daemon's heap grows by under 64 MiB, and every connection is closed by the daemon
    within the header timeout (most sooner, to make room for newer ones)."""
    port_a, port_b, front_port = free_port(), free_port(), free_port()
    members = [f"127.0.0.1:{port_a}", f"127.0.0.1:{port_b}"]
    a = start(
        start_daemon,
        tmp_path,
        "a",
        port_a,
        node_toml(tmp_path, "a", port_a, peers=members, front_port=front_port),
        fds=512,
    )
    b = start(start_daemon, tmp_path, "b", port_b, node_toml(tmp_path, "b", port_b, peers=members))
    names = write_probe_objects(tmp_path / "files")
    for name in names:  # in a's cache: b's fetches are served from it, allocating nothing
        timed_read(tmp_path / "a" / "chunkd.sock", name, PROBE_SIZE)
    for _ in range(20):  # the daemon's heap as it serves both ports
        healthz("127.0.0.1", port_a)
        s3_get("127.0.0.1", front_port, "/")
    time.sleep(0.5)
    probes = Probes(a.process.pid)
    baseline = memory(a.process.pid)
    served_before = metric(a, "chunkd_peer_bytes_total", direction="out")
    target = port_a if door == "http" else front_port
    crowds = [
        CrowdRun.start(target, 400, "trickle", rounds_for=3.0),
        CrowdRun.start(target, 300, "silent", rounds_for=3.0),
        CrowdRun.start(target, 300, "fat", rounds_for=3.0),
    ]
    for crowd in crowds:
        crowd.opened()
    stop = threading.Event()
    sampler = sampling(probes, stop)
    try:
        for name in names:
            probes.time("healthz", lambda: healthz("127.0.0.1", port_a))
            probes.time(
                "local socket", lambda: timed_read(a.cwd / "chunkd.sock", "local/small", 1000)
            )
            probes.time(
                "peer fetch", lambda n=name: timed_read(b.cwd / "chunkd.sock", n, PROBE_SIZE)
            )
            time.sleep(0.2)
        results = [crowd.finish() for crowd in crowds]
    finally:
        stop.set()
        sampler.join()
        for crowd in crowds:
            if crowd.process.poll() is None:
                crowd.process.kill()
                crowd.process.wait()
    assert not probes.failures, probes.failures
    assert not probes.late(), f"answers slower than {ANSWER_WITHIN}s: {probes.worst}"
    served = metric(a, "chunkd_peer_bytes_total", direction="out") - served_before
    assert served >= CHUNK, "b read nothing through a's peer route"
    assert metric(b, "chunkd_peer_requests_total", outcome="error") == 0
    grown = probes.peak["RssAnon"] - baseline["RssAnon"]
    print(
        f"\n{door}: RssAnon {baseline['RssAnon'] >> 20} MiB before, peak +{grown / 2**20:.1f} "
        f"MiB (VmRSS {baseline['VmRSS'] >> 20} -> {probes.peak['VmRSS'] >> 20} MiB); "
        f"worst answers {probes.worst}; crowds {results}"
    )
    assert grown <= RSS_BOUND, f"the heap grew by {grown >> 20} MiB"
    for result in results:
        assert result["opened"] >= 1000, result
        assert result["open_at_end"] == 0, result
        assert result["longest"] <= HEADER_TIMEOUT + 1.0, result
    # Each new connection at the cap closed the one waiting longest; the fat heads were
    # refused at their bound.
    assert metric(a, "chunkd_connections_cut_total", port=door, reason="head_too_large") > 0
    assert metric(a, "chunkd_connections_cut_total", reason="evicted") > 0
    assert healthz("127.0.0.1", port_a) < ANSWER_WITHIN


@pytest.mark.timeout(60)
def test_a_thousand_unfinished_heads_cost_the_heap_under_64_mib(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """What an unfinished request holds is bounded before its parsing ends: 1,000
    connections sending 100 header lines of 8 KB are refused at the HTTP port's bound
    (not read on), then 1,000 holding a head just under it (24 KB, never finished) at
    once add under 64 MiB to the daemon's heap, and ``/healthz`` answers within 1 s
    meanwhile."""
    port = free_port()
    a = start(
        start_daemon,
        tmp_path,
        "a",
        port,
        node_toml(tmp_path, "a", port, header_timeout=4.0),
        fds=4096,
    )
    for _ in range(20):
        healthz("127.0.0.1", port)
    time.sleep(0.5)
    baseline = memory(a.process.pid)
    probes = Probes(a.process.pid)
    stop = threading.Event()
    sampler = sampling(probes, stop)
    crowds: list[CrowdRun] = []
    try:
        fat = CrowdRun.start(port, 1000, "fat")  # refused at the bound, one after another
        crowds.append(fat)
        fat.opened()
        fat_result = fat.finish()
        held = CrowdRun.start(port, 1000, "full", head_bytes=24_000)  # all held at once
        crowds.append(held)
        held.opened()
        for _ in range(10):
            probes.time("healthz", lambda: healthz("127.0.0.1", port))
            time.sleep(0.1)
        kept = metric(a, "chunkd_connections", port="http")
        held_result = held.finish()
    finally:
        stop.set()
        sampler.join()
        for crowd in crowds:
            if crowd.process.poll() is None:
                crowd.process.kill()
                crowd.process.wait()
    grown = probes.peak["RssAnon"] - baseline["RssAnon"]
    print(
        f"\nRssAnon {baseline['RssAnon'] >> 20} MiB before, peak +{grown / 2**20:.1f} MiB "
        f"with {kept:.0f} connections open; healthz {probes.worst}; crowds "
        f"{[fat_result, held_result]}"
    )
    assert not probes.failures, probes.failures
    assert not probes.late(), probes.worst
    assert kept >= 990, "the unfinished heads were not held at once"
    assert grown <= RSS_BOUND, f"the heap grew by {grown >> 20} MiB"
    assert fat_result["longest"] < HEADER_TIMEOUT, fat_result  # refused, not waited for
    assert held_result["longest"] <= 4.0 + 1.0, held_result  # its header timeout


# -- each bound on its own --------------------------------------------------------------


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> tuple[Daemon, int]:
    """A daemon with the short bounds, and the port of its S3 front (unsigned requests
    from loopback let in)."""
    port, front_port = free_port(), free_port()
    toml = node_toml(
        tmp_path, "n", port, front_port=front_port, front={"unsigned_from_loopback": True}
    )
    daemon = start(start_daemon, tmp_path, "n", port, toml)
    (tmp_path / "files" / "x").write_bytes(b"x" * 100_000)
    return daemon, front_port


def connect(port: int, data: bytes = b"", *, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    if data:
        sock.sendall(data)
    return sock


def answer_of(sock: socket.socket, most: float = 5.0) -> bytes:
    """Everything ``sock`` receives until the server closes it (or ``most`` seconds)."""
    sock.settimeout(most)
    got = b""
    with contextlib.suppress(TimeoutError, ConnectionError):
        while piece := sock.recv(65536):
            got += piece
    return got


@pytest.mark.timeout(30)
def test_silent_trickling_and_idle_connections_are_closed_in_time(
    node: tuple[Daemon, int],
) -> None:
    """A connection that sends nothing, and one that trickles a head, are closed the
    header timeout after they opened; a kept-alive one the idle timeout after its
    answer; a next head begun after a while, the header timeout after its first byte."""
    daemon, front_port = node
    results: dict[str, float | None] = {}

    def silent(port: int, label: str) -> None:
        with connect(port) as sock:
            results[label] = closed_after(sock, HEADER_TIMEOUT + 3)

    def trickle() -> None:
        with connect(daemon.port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n") as sock:
            started = time.monotonic()
            n = 0
            while time.monotonic() - started < HEADER_TIMEOUT + 3:
                try:
                    sock.sendall(b"X-%d: y\r\n" % n)
                except OSError:
                    break
                n += 1
                if closed_after(sock, 0.3) is not None:
                    break
            results["trickle"] = time.monotonic() - started

    def idle() -> None:
        with connect(daemon.port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n") as sock:
            sock.settimeout(5)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            results["idle"] = closed_after(sock, IDLE_TIMEOUT + 3)

    def late_head() -> None:
        with connect(daemon.port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n") as sock:
            sock.settimeout(5)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            time.sleep(IDLE_TIMEOUT - 1.5)
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")
            results["late head"] = closed_after(sock, HEADER_TIMEOUT + 3)

    threads = [
        threading.Thread(target=silent, args=(daemon.port, "silent")),
        threading.Thread(target=silent, args=(front_port, "silent on the S3 front")),
        threading.Thread(target=trickle),
        threading.Thread(target=idle),
        threading.Thread(target=late_head),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for label in ("silent", "silent on the S3 front", "trickle", "late head"):
        assert within(results[label], HEADER_TIMEOUT), (label, results)
    assert within(results["idle"], IDLE_TIMEOUT), results
    assert metric(daemon, "chunkd_connections_cut_total", reason="header_timeout") >= 4


@pytest.mark.timeout(30)
@pytest.mark.parametrize("door", ["http", "s3"])
def test_a_head_past_its_bound_is_refused_before_it_ends(
    door: str, node: tuple[Daemon, int]
) -> None:
    """Header lines of 8 KB, each within the parser's line limit, sent one by one and
    never ended: the daemon answers once the head passes its bound (24 KB on the HTTP
    port, 16 KB on the S3 front: 8 KiB of headers, S3's own limit), and closes."""
    daemon, front_port = node
    port = daemon.port if door == "http" else front_port
    with connect(port, b"GET /local/x HTTP/1.1\r\nHost: 127.0.0.1\r\n") as sock:
        sent = 0
        answer = b""
        for n in range(100):
            try:
                sock.sendall(b"X-Pad-%03d: " % n + b"a" * 8000 + b"\r\n")
            except OSError:
                break
            sent += 1
            if select.select([sock], [], [], 0.05)[0]:  # an answer (or the close)
                answer = answer_of(sock)
                break
        else:
            answer = answer_of(sock, 1.0)
    assert sent <= (4 if door == "http" else 3), f"{sent} lines of 8 KB were taken"
    if door == "http":
        assert answer.split(b" ")[1] == b"431", answer[:200]
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"] == (
            "RequestHeaderFieldsTooLarge"
        )
    else:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.split(b" ")[1] == b"400", answer[:200]
        assert ET.fromstring(body).findtext("Code") == "RequestHeaderSectionTooLarge"
    assert metric(daemon, "chunkd_connections_cut_total", port=door, reason="head_too_large") == 1


@pytest.mark.timeout(30)
def test_a_body_ending_in_one_large_read_leaves_the_next_head_its_whole_bound(
    node: tuple[Daemon, int],
) -> None:
    """A body whose last piece arrives in one read larger than the head's bound (a
    replica push of a chunk on loopback does) is the body's: the next request on the
    kept-alive connection is answered, where every byte of that read was counted as
    the next head's and it was refused 431."""
    daemon, _ = node
    body = b"b" * 60_000
    head = f"POST /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n"
    with connect(daemon.port, head.encode()) as sock:
        time.sleep(0.3)  # the head is parsed alone; the body comes in one piece
        sock.sendall(body)
        time.sleep(0.3)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        answer = answer_of(sock)
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)  # a body has no CRLF at its end
    assert statuses == [b"405", b"200"], answer[:600]
    assert metric(daemon, "chunkd_connections_cut_total", port="http", reason="head_too_large") == 0


@pytest.mark.timeout(30)
def test_bodies_are_never_decompressed(node: tuple[Daemon, int]) -> None:
    """``Content-Encoding: gzip`` over bytes that are not gzip, on routes that read no
    body: answered as without it, and no traceback in the log (aiohttp decoded the
    body it drained after the answer and logged 'Unhandled exception')."""
    daemon, front_port = node
    body = b"this is not gzip at all"
    for port, path, status in (
        (daemon.port, "/logout", b"303"),
        (daemon.port, "/v1/warm/local/x", b"200"),
        (daemon.port, "/healthz", b"405"),
        (front_port, "/local/x", b"405"),
    ):
        request = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Encoding: gzip\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode() + body
        with connect(port, request) as sock:
            answer = answer_of(sock)
        assert answer.split(b" ")[1] == status, (path, answer[:300])
    time.sleep(0.5)
    log = daemon.log.read_text()
    assert "Unhandled exception" not in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.timeout(30)
def test_an_unfinished_chunked_body_on_the_s3_front_closes_soon_after_the_answer(
    node: tuple[Daemon, int],
) -> None:
    """A GET with ``Transfer-Encoding: chunked`` and no last chunk: the object at once,
    and the connection closed a second after (aiohttp read on for 10 s)."""
    _, front_port = node
    request = (
        b"GET /local/x HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n"
    )
    with connect(front_port, request) as sock:
        started = time.monotonic()
        answer = answer_of(sock, 15.0)
        seconds = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert answer.endswith(b"x" * 1000)
    assert seconds < 2.0, f"closed after {seconds:.1f}s"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("header", "code"),
    [
        (b"Content-Length: 99999999999999999999999", "InvalidArgument"),
        (b"Content-Length: 12a", "InvalidArgument"),
        (b"Content-Length: -1", "InvalidArgument"),
        (b"X-Big: " + b"b" * 9000, "RequestHeaderSectionTooLarge"),
    ],
)
def test_the_s3_front_names_what_its_parser_refused(
    header: bytes, code: str, node: tuple[Daemon, int]
) -> None:
    """A Content-Length that is no length is ``InvalidArgument`` (S3 answers it with a
    400), not ``RequestHeaderSectionTooLarge`` (the word 'overflow' in aiohttp's
    message for 23 digits made it one)."""
    _, front_port = node
    request = b"GET /local/x HTTP/1.1\r\nHost: 127.0.0.1\r\n" + header + b"\r\n\r\n"
    with connect(front_port, request) as sock:
        answer = answer_of(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400", answer[:300]
    assert ET.fromstring(body).findtext("Code") == code


@pytest.mark.timeout(30)
def test_a_body_that_never_comes_is_cut_at_the_body_timeout(node: tuple[Daemon, int]) -> None:
    """A request whose route answers without reading its body (the dashboard's
    stream, which runs as long as its client stays) and whose body never comes: the
    connection is cut the body timeout after the head."""
    daemon, _ = node
    request = b"GET /v1/dashboard/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n"
    with connect(daemon.port, request) as sock:
        seconds = closed_after(sock, BODY_TIMEOUT + 4)
    assert within(seconds, BODY_TIMEOUT), seconds
    assert metric(daemon, "chunkd_connections_cut_total", reason="body_timeout") == 1


@pytest.mark.timeout(30)
def test_an_answer_nobody_reads_is_cut_after_the_idle_timeout(
    node: tuple[Daemon, int], tmp_path: Path
) -> None:
    """A client that asks for 32 MiB and takes none of it: the connection is cut the
    idle timeout after the daemon's buffers filled, not held while the daemon waits."""
    daemon, _ = node
    size = 32 << 20
    (tmp_path / "files" / "big").write_bytes(b"b" * size)
    request = b"GET /v1/objects/local/big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with connect(daemon.port, request, rcvbuf=4096) as sock:
        time.sleep(IDLE_TIMEOUT + 3)
        got = len(answer_of(sock, 5.0))
    assert got < size, "the whole answer waited for its reader"
    assert metric(daemon, "chunkd_connections_cut_total", reason="send_stalled") == 1


# -- TLS: the handshake is under the same bounds -------------------------------------------


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (EC P-256, a day), as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "front.pem", directory / "front.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


@pytest.mark.timeout(30)
def test_a_tls_handshake_never_begun_is_closed_at_the_header_timeout(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """On a port that serves HTTPS (the S3 front with its own certificate), a
    connection that never sends a ClientHello is closed the header timeout after it
    opened (asyncio waits 60 s for a handshake), and HTTPS is served as before."""
    port, front_port = free_port(), free_port()
    cert, key = self_signed(tmp_path)
    front: dict[str, str | bool] = {
        "unsigned_from_loopback": True,
        "tls_cert": str(cert),
        "tls_key": str(key),
    }
    daemon = start(
        start_daemon,
        tmp_path,
        "n",
        port,
        node_toml(tmp_path, "n", port, front_port=front_port, front=front),
    )
    with connect(front_port) as sock:
        seconds = closed_after(sock, HEADER_TIMEOUT + 3)
    assert within(seconds, HEADER_TIMEOUT), seconds
    context = ssl.create_default_context(cafile=str(cert))
    conn = http.client.HTTPSConnection("127.0.0.1", front_port, timeout=10, context=context)
    try:
        conn.request("GET", "/")
        answer = conn.getresponse()
        body = answer.read()
    finally:
        conn.close()
    assert answer.status == 200, body
    assert b"<ListAllMyBucketsResult" in body
    assert daemon.process.poll() is None


# -- a crowd of many addresses: the caps, and the peers' budget ----------------------------


@dataclass
class CrowdNet:
    """A network namespace on a veth pair in 198.19.23.0/24 (part of 198.18.0.0/15)."""

    ns: str
    #: the host side's address, where the daemons listen
    host: str
    #: another host-side address, an anonymous client's
    probe: str
    #: the namespace's addresses, the crowd's
    crowd: tuple[str, ...]


@pytest.fixture
def crowd_net() -> Iterator[CrowdNet]:
    """A namespace with 8 addresses for a crowd, and two on the host side; everything
    is removed afterwards."""
    host, probe = "198.19.23.1", "198.19.23.5"
    crowd = tuple(f"198.19.23.{n}" for n in range(10, 18))
    with veth_namespace("c", (host, probe), crowd, 24) as ns:
        yield CrowdNet(ns, host, probe, crowd)


@pytest.mark.timeout(60)
def test_a_crowd_of_many_addresses_meets_both_caps_and_leaves_the_peers_budget(
    crowd_net: CrowdNet, start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """1,000 silent connections from 8 addresses of another host, against a daemon
    with ``max_connections = 64`` and ``max_connections_per_address = 16``: 600 from
    3 addresses hold 16 each at most, 400 more from 5 others bring the daemon to 64 in
    all and no further; meanwhile an anonymous client's ``/healthz``, a local socket
    read and the reads of a peer (from a member's address: a budget of its own)
    answer within 1 s, and no peer connection is refused."""
    net = crowd_net
    port_a, port_b = free_port(), free_port()
    members = [f"{net.host}:{port_a}", f"{net.host}:{port_b}"]
    caps = "max_connections = 64\nmax_connections_per_address = 16"
    a = start(
        start_daemon,
        tmp_path,
        "a",
        port_a,
        node_toml(tmp_path, "a", port_a, host=net.host, peers=members, server=caps),
        fds=1024,
        host=net.host,
    )
    b = start(
        start_daemon,
        tmp_path,
        "b",
        port_b,
        node_toml(tmp_path, "b", port_b, host=net.host, peers=members),
        host=net.host,
    )
    names = write_probe_objects(tmp_path / "files")
    for name in names:
        timed_read(a.cwd / "chunkd.sock", name, PROBE_SIZE)
    served_before = metric(a, "chunkd_peer_bytes_total", direction="out")
    few = CrowdRun.start(
        port_a, 600, "silent", host=net.host, sources=net.crowd[:3], netns=net.ns, rounds_for=4.0
    )
    many: CrowdRun | None = None
    probes = Probes(a.process.pid)
    anonymous: list[float] = []
    try:
        few.opened()
        held = few.held()
        many = CrowdRun.start(
            port_a,
            400,
            "silent",
            host=net.host,
            sources=net.crowd[3:],
            netns=net.ns,
            rounds_for=3.0,
        )
        many.opened()
        for name in names:
            probes.time("healthz", lambda: healthz(net.host, port_a, source=net.probe))
            probes.time(
                "local socket", lambda: timed_read(a.cwd / "chunkd.sock", "local/small", 1000)
            )
            probes.time(
                "peer fetch", lambda n=name: timed_read(b.cwd / "chunkd.sock", n, PROBE_SIZE)
            )
            anonymous.append(metric(a, "chunkd_connections", budget="anonymous"))
            time.sleep(0.2)
        peers_open = metric(a, "chunkd_connections", budget="peer")
        results = [few.finish(), many.finish()]
    finally:
        for crowd in (few, many):
            if crowd is not None and crowd.process.poll() is None:
                crowd.process.kill()
                crowd.process.wait()
    print(
        f"\nworst answers {probes.worst}; crowds {results}; anonymous connections {anonymous}; "
        f"peer connections {peers_open}"
    )
    assert set(held) == set(net.crowd[:3]), held
    assert max(held.values()) <= 16, held
    assert sum(held.values()) >= 40, held  # the per-address cap, not the total, bound them
    assert max(anonymous) <= 64, anonymous
    assert max(anonymous) >= 60, anonymous  # the total cap bound the crowd
    for result in results:
        assert result["open_at_end"] == 0, result
        assert result["longest"] <= HEADER_TIMEOUT + 1.0, result
    assert results[0]["opened"] + results[1]["opened"] >= 1000, results
    assert not probes.failures, probes.failures
    assert not probes.late(), probes.worst
    assert metric(a, "chunkd_connections_refused_total", budget="peer") == 0
    assert peers_open >= 1, "b's connections to a were not counted as a peer's"
    assert metric(a, "chunkd_peer_bytes_total", direction="out") - served_before >= CHUNK
    assert metric(b, "chunkd_peer_requests_total", outcome="error") == 0
