"""A cluster in network namespaces, for tests and benchmarks (root only).

Four "nodes" and an S3 server, each in a network namespace of its own with an
address in 198.18.80.0/24, joined by a bridge in a sixth namespace; the process
that builds it reaches them all from 198.18.80.254. Every link is shaped with
``tc`` (tbf): the nodes' links at ``node_rate``, S3's at ``s3_rate``, so that the
backend's egress is the bottleneck, as it is where object storage gives a cluster
less than its nodes' NICs add up to. Everything is removed on exit.

Part of :mod:`chunkd.testing`; the daemon never imports it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from chunkd.testing import BIN, S3Server, s3_backend

__all__ = ["NET", "ROOT_IP", "S3_IP", "Lab", "LabUnavailable", "lab"]

NET = "198.18.80"
ROOT_IP = f"{NET}.254"
S3_IP = f"{NET}.5"
TOKEN = "a-shared-secret-for-the-namespaces"


class LabUnavailable(RuntimeError):
    """Namespaces cannot be built here (not root, no iproute2 or tc)."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _in(ns: str, *args: str) -> None:
    _ip("netns", "exec", ns, *args)


@dataclass
class Lab:
    """The namespaces, and the processes started in them."""

    work: Path
    nodes: list[str]
    s3_ns: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start_s3(self) -> None:
        """moto's server in the S3 namespace, with a bucket ``fanout``."""
        server = S3Server.start(host=S3_IP, port=9000, netns=self.s3_ns)
        self.processes.append(server.process)
        server.client().create_bucket(Bucket="fanout")

    def start_node(self, i: int, *, peers: bool) -> subprocess.Popen[bytes]:
        """Daemon ``i`` (1-4) in its namespace, with an empty cache."""
        node_dir = self.work / f"n{i}"
        shutil.rmtree(node_dir, ignore_errors=True)
        node_dir.mkdir(parents=True)
        config = node_dir / "chunkd.toml"
        config.write_text(self._toml(i, peers))
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
        with (node_dir / "daemon.log").open("ab") as log:  # the child keeps its own copy
            process = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.nodes[i - 1],
                    str(BIN / "chunkd"),
                    "serve",
                    "--config",
                    str(config),
                ],
                env=env,
                stdout=log,
                stderr=log,
            )
        self.processes.append(process)
        deadline = time.monotonic() + 60
        while not self.ready(i):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((node_dir / "daemon.log").read_text())
            time.sleep(0.1)
        return process

    def ready(self, i: int) -> bool:
        """Whether node ``i`` answers /readyz."""
        try:
            with urllib.request.urlopen(f"http://{NET}.{i}:8470/readyz", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def socket(self, i: int) -> Path:
        """Node ``i``'s local socket (the filesystem is shared: any process reaches it)."""
        return self.work / f"n{i}" / "chunkd.sock"

    def metric(self, i: int, sample: str) -> float:
        """The sum of node ``i``'s samples whose line starts with ``sample``."""
        with urllib.request.urlopen(f"http://{NET}.{i}:8470/metrics", timeout=10) as response:
            body = response.read().decode()
        return sum(
            float(line.rpartition(" ")[2])
            for line in body.splitlines()
            if line.startswith(sample) and not line.startswith("#")
        )

    def stop_nodes(self) -> None:
        """Stop every daemon (moto stays)."""
        for process in self.processes[1:]:
            process.terminate()
        for process in self.processes[1:]:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        del self.processes[1:]

    def _toml(self, i: int, peers: bool) -> str:
        token = self.work / "token"
        token.write_text(TOKEN)
        token.chmod(0o600)
        members = ", ".join(f'"{NET}.{n}:8470"' for n in range(1, len(self.nodes) + 1))
        section = (
            f'[peers]\nself = "{NET}.{i}:8470"\nmembers = [{members}]\n'
            f'token_file = "{token}"\nhealth_interval = "300ms"\ndown_after = 4\n'
            if peers
            else ""
        )
        node = self.work / f"n{i}"
        return f"""
[server]
listen = "{NET}.{i}:8470"
socket = "{node / "chunkd.sock"}"

[cache]
dir = "{node / "cache"}"
ram_bytes = "2GiB"
disk_bytes = "4GiB"
disk_min_free_bytes = 0
fsync = "never"

{section}
{s3_backend("ckpt", "s3://fanout/pre", f"http://{S3_IP}:9000", writable=True, retries=2)}"""


@contextmanager
def lab(work: Path, *, node_rate: str = "400mbit", s3_rate: str = "80mbit") -> Iterator[Lab]:
    """Build the namespaces; remove them, and stop what runs in them, on exit.

    Raises:
        LabUnavailable: not root, or iproute2/tc missing, or the kernel refuses.
    """
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        raise LabUnavailable("network namespaces need root, iproute2 and tc")
    tag = f"{os.getpid() % 10000}"
    switch = f"ck{tag}sw"
    nodes = [f"ck{tag}n{i}" for i in range(1, 5)]
    s3_ns = f"ck{tag}s3"
    made: list[str] = []
    links: list[str] = []
    built = Lab(work, nodes, s3_ns)
    try:
        try:
            _ip("netns", "add", switch)
            made.append(switch)
            _in(switch, "ip", "link", "add", "br0", "type", "bridge")
            _in(switch, "ip", "link", "set", "br0", "up")
            for i, ns in enumerate([*nodes, s3_ns], start=1):
                _ip("netns", "add", ns)
                made.append(ns)
                inner, outer = f"e{tag}x{i}", f"b{tag}x{i}"
                _ip(
                    "link",
                    "add",
                    inner,
                    "netns",
                    ns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    outer,
                    "netns",
                    switch,
                )
                _in(switch, "ip", "link", "set", outer, "master", "br0", "up")
                _in(ns, "ip", "addr", "add", f"{NET}.{i}/24", "dev", inner)
                _in(ns, "ip", "link", "set", inner, "up")
                _in(ns, "ip", "link", "set", "lo", "up")
                rate = s3_rate if ns == s3_ns else node_rate
                _in(
                    ns,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    inner,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    "256kb",
                    "latency",
                    "200ms",
                )
            root_if, root_peer = f"r{tag}x0", f"b{tag}x0"
            _ip("link", "add", root_if, "type", "veth", "peer", "name", root_peer, "netns", switch)
            links.append(root_if)
            _in(switch, "ip", "link", "set", root_peer, "master", "br0", "up")
            _ip("addr", "add", f"{ROOT_IP}/24", "dev", root_if)
            _ip("link", "set", root_if, "up")
        except subprocess.CalledProcessError as exc:
            raise LabUnavailable(
                f"cannot build the namespaces here: {exc.stderr.decode().strip()}"
            ) from exc
        yield built
    finally:
        for process in built.processes:
            process.terminate()
        for process in built.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        for link in links:
            subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)
