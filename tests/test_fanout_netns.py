"""Four "nodes" in network namespaces, S3 in a fifth, every link shaped with tc.

Root only (the suite skips it otherwise, saying why). Addresses are in
198.18.80.0/24; every namespace and link is removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.gateway.testing import BIN
from tests.conftest import wait_for_socket

NET = "198.18.80"
ROOT_IP = f"{NET}.254"
S3_IP = f"{NET}.5"
TOKEN = "a-shared-secret-for-namespaces"


@dataclass
class Lab:
    tag: str
    nodes: list[str]  # namespace names
    s3_ns: str
    switch: str
    links: list[str]  # root-side link names to delete


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _in(ns: str, *args: str) -> None:
    _ip("netns", "exec", ns, *args)


@pytest.fixture
def lab() -> Iterator[Lab]:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("the namespace fan-out needs root, iproute2 and tc")
    tag = f"{os.getpid() % 10000}"
    switch = f"ck{tag}sw"
    nodes = [f"ck{tag}n{i}" for i in range(1, 5)]
    s3_ns = f"ck{tag}s3"
    made: list[str] = []
    links: list[str] = []
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _in(switch, "ip", "link", "add", "br0", "type", "bridge")
        _in(switch, "ip", "link", "set", "br0", "up")
        # Nodes 1-4 and S3 (5): each a namespace with a veth into the bridge. The
        # nodes' links are fast; S3's egress is the bottleneck, as in a data centre
        # where object storage gives the cluster less than the nodes' NICs add up to.
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
            rate = "80mbit" if ns == s3_ns else "400mbit"
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
        # The test process reaches everyone from the root namespace.
        root_if, root_peer = f"r{tag}x0", f"b{tag}x0"
        _ip("link", "add", root_if, "type", "veth", "peer", "name", root_peer, "netns", switch)
        links.append(root_if)
        _in(switch, "ip", "link", "set", root_peer, "master", "br0", "up")
        _ip("addr", "add", f"{ROOT_IP}/24", "dev", root_if)
        _ip("link", "set", root_if, "up")
    except subprocess.CalledProcessError as exc:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        for link in links:
            subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)
        pytest.skip(f"cannot build the namespaces here: {exc.stderr.decode().strip()}")
    try:
        yield Lab(tag, nodes, s3_ns, switch, links)
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        for link in links:
            subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)


def _toml(work: Path, i: int, peers: bool) -> str:
    members = ", ".join(f'"{NET}.{n}:8470"' for n in range(1, 5))
    section = (
        f'[peers]\nself = "{NET}.{i}:8470"\nmembers = [{members}]\n'
        f'token_file = "{work / "token"}"\nhealth_interval = "300ms"\ndown_after = 4\n'
        if peers
        else ""
    )
    return f"""
[server]
listen = "{NET}.{i}:8470"
socket = "{work / f"n{i}" / "chunkd.sock"}"

[cache]
dir = "{work / f"n{i}" / "cache"}"
ram_bytes = "512MiB"
disk_bytes = "2GiB"
disk_min_free_bytes = 0
fsync = "never"

{section}
[[backends]]
name = "ckpt"
url = "s3://fanout/pre"
endpoint = "http://{S3_IP}:9000"
region = "us-east-1"
access_key_id = "testing"
secret_access_key = "testing-secret"
allow_http = true
writable = true
timeout = "30s"
retries = 2
"""


def _serve(lab: Lab, work: Path, i: int, peers: bool) -> subprocess.Popen[bytes]:
    node_dir = work / f"n{i}"
    shutil.rmtree(node_dir, ignore_errors=True)
    node_dir.mkdir(parents=True)
    config = node_dir / "chunkd.toml"
    config.write_text(_toml(work, i, peers))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    with (node_dir / "daemon.log").open("ab") as log:  # the child keeps its own copy
        process = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                lab.nodes[i - 1],
                str(BIN / "chunkd"),
                "serve",
                "--config",
                str(config),
            ],
            env=env,
            stdout=log,
            stderr=log,
        )
    assert wait_for_socket(node_dir / "chunkd.sock", 60), (node_dir / "daemon.log").read_text()
    return process


def _metric(i: int, name: str) -> float:
    with urllib.request.urlopen(f"http://{NET}.{i}:8470/metrics", timeout=10) as response:
        body = response.read().decode()
    return sum(
        float(line.rpartition(" ")[2])
        for line in body.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def _restore_everywhere(work: Path, name: str) -> list[Any]:
    results: list[Any] = [None] * 4

    def load(i: int) -> None:
        try:
            with Client(work / f"n{i + 1}" / "chunkd.sock", timeout=120) as client:
                results[i] = ckpt.load(name, client=client)
        except Exception as exc:  # reported by the caller
            results[i] = exc

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results


@pytest.mark.timeout(600)
def test_four_nodes_restore_through_peers_with_the_backend_read_once(
    lab: Lab, tmp_path: Path
) -> None:
    work = tmp_path
    (work / "token").write_text(TOKEN)
    (work / "token").chmod(0o600)
    moto = subprocess.Popen(
        ["ip", "netns", "exec", lab.s3_ns, str(BIN / "moto_server"), "-H", S3_IP, "-p", "9000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        import boto3

        s3 = boto3.client(
            "s3",
            endpoint_url=f"http://{S3_IP}:9000",
            aws_access_key_id="testing",
            aws_secret_access_key="testing-secret",
            region_name="us-east-1",
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                s3.create_bucket(Bucket="fanout")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        g = torch.Generator().manual_seed(5)
        state = {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(8)}  # 16 MiB
        size = sum(t.numel() * 4 for t in state.values())
        daemons = [_serve(lab, work, 1, peers=False)]
        with Client(work / "n1" / "chunkd.sock", timeout=120) as client:
            ckpt.save(state, "ckpt/fanout/step-1", client=client)
        first = daemons.pop()
        first.terminate()
        first.wait(timeout=30)
        daemons = [_serve(lab, work, i, peers=True) for i in range(1, 5)]  # cold caches
        time.sleep(1)  # a health round
        started = time.monotonic()
        results = _restore_everywhere(work, "ckpt/fanout/step-1")
        took = time.monotonic() - started
        for result in results:
            assert not isinstance(result, Exception), result
            assert all(torch.equal(result[k], state[k]) for k in state)
        backend = sum(_metric(i, "chunkd_backend_read_bytes_total") for i in range(1, 5))
        from_peers = sum(_metric(i, 'chunkd_peer_bytes_total{direction="in"}') for i in range(1, 5))
        assert size <= backend <= 1.05 * size + 4 * 65536  # chunks once, JSON per node
        assert from_peers >= 2.5 * size  # three of four nodes got most chunks from peers
        print(f"fan-out of {size >> 20} MiB to 4 nodes: {took:.1f}s, backend {backend / size:.2f}x")
    finally:
        for daemon in daemons:
            daemon.terminate()
        for daemon in daemons:
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
        moto.terminate()
        moto.wait(timeout=30)
