"""Four "nodes" in network namespaces, S3 in a fifth, every link shaped with tc.

Root only (skipped otherwise, saying why). Addresses are in 198.18.80.0/24; every
namespace and link is removed afterwards (see :mod:`chunkd.testing.netlab`).
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.testing import netlab


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[netlab.Lab]:
    try:
        with netlab.lab(tmp_path) as built:
            yield built
    except netlab.LabUnavailable as exc:
        pytest.skip(str(exc))


def restore_everywhere(lab: netlab.Lab, name: str) -> list[Any]:
    results: list[Any] = [None] * 4

    def load(i: int) -> None:
        try:
            with Client(lab.socket(i + 1), timeout=120) as client:
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
def test_four_nodes_restore_through_peers_with_the_backend_read_once(lab: netlab.Lab) -> None:
    lab.start_s3()
    g = torch.Generator().manual_seed(5)
    state = {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(8)}  # 16 MiB
    size = sum(t.numel() * 4 for t in state.values())
    lab.start_node(1, peers=False)
    with Client(lab.socket(1), timeout=120) as client:
        ckpt.save(state, "ckpt/fanout/step-1", client=client)
    lab.stop_nodes()
    for i in range(1, 5):
        lab.start_node(i, peers=True)  # cold caches
    deadline = time.monotonic() + 20
    while any(lab.metric(i, "chunkd_peer_healthy") < 4 for i in range(1, 5)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    results = restore_everywhere(lab, "ckpt/fanout/step-1")
    for result in results:
        assert not isinstance(result, Exception), result
        assert all(torch.equal(result[k], state[k]) for k in state)
    backend = sum(lab.metric(i, "chunkd_backend_read_bytes_total") for i in range(1, 5))
    from_peers = sum(lab.metric(i, 'chunkd_peer_bytes_total{direction="in"}') for i in range(1, 5))
    assert size <= backend <= 1.05 * size + 4 * 65536  # chunks once; the JSON per node
    assert from_peers >= 2.5 * size  # three of four nodes got most chunks from peers


@pytest.mark.timeout(90)
def test_a_lab_of_six_shapes_both_ways_and_replaces_a_node_with_an_empty_one(
    tmp_path: Path,
) -> None:
    try:
        with netlab.lab(
            tmp_path, nodes=6, node_rate="50mbit", peer_settings={"holder_fanout": 1000}
        ) as built:
            with netlab.lab(tmp_path / "beside") as beside:  # another run's lab
                assert beside.net != built.net
            check_the_lab_of_six(built)
    except netlab.LabUnavailable as exc:
        pytest.skip(str(exc))
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in [*built.nodes, built.s3_ns, built.switch_ns])


def check_the_lab_of_six(built: netlab.Lab) -> None:
    assert len(built.nodes) == 6
    assert built.s3_ip not in {built.address(i) for i in range(1, 7)}
    for ns in built.nodes:  # what the node sends, and what the bridge sends it
        inner, outer = built.links[ns]
        for where, dev in ((ns, inner), (built.switch_ns, outer)):
            shown = subprocess.run(
                ["ip", "netns", "exec", where, "tc", "qdisc", "show", "dev", dev],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert "tbf" in shown, (where, dev, shown)
            assert "50Mbit" in shown, (where, dev, shown)
    built.start_s3()
    first = built.start_node(6, peers=True, settings={"per_peer_requests": 2})
    config = (built.work / "n6" / "chunkd.toml").read_text()
    assert f'"{built.member(6)}"' in config
    assert "holder_fanout = 1000" in config
    assert "per_peer_requests = 2" in config
    (built.work / "n6" / "cache" / "left-behind").write_bytes(b"x")
    cpu = built.cpu_seconds()
    assert set(cpu) == {"n6", "s3"}
    assert cpu["n6"] > 0
    assert cpu["s3"] > 0
    fresh = built.replace_node(6)  # SIGKILL, then a fresh daemon on an empty directory
    assert first.returncode == -9
    assert fresh.pid != first.pid
    assert built.ready(6)
    assert not (built.work / "n6" / "cache" / "left-behind").exists()
    built.kill_node(6)
    assert not built.ready(6)
    assert set(built.cpu_seconds()) == {"s3"}
    with pytest.raises(ValueError, match="nodes 1-6"):
        built.start_node(7, peers=False)
