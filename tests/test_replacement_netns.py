"""A node replaced in the middle of a run of saves restores its last save from the
replicas its peers hold in RAM (docs/replicas.md), not from the backend.

Four nodes in network namespaces (:mod:`chunkd.testing.netlab`; root only, skipped
otherwise), two racks (nodes 1-2 in ``r1``, 3-4 in ``r2``: a node's replica is in the
other rack), every node saving its own checkpoints with ``replicas = 1``. Node 1 is
killed (SIGKILL) while its third save is in flight, and a fresh node with its name,
address and an empty cache takes its place and loads node 1's last committed save.

- The saver alone lost: the replica node serves every chunk; the backend sends at
  most 1% of the checkpoint (the manifest and the part's document).
- The saver and its replica node both lost (K=1 cannot cover two): the fresh node's
  restore falls through the replica sources (one dead, the others never held it) and
  the owners to the backend, which sends each chunk once; the bytes are exact.

Bytes are asserted, never times (the restore time is a bench figure:
``bench/fanout_bench.py``).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.testing import netlab

RACKS = {1: "r1", 2: "r1", 3: "r2", 4: "r2"}
CHUNK = 1 << 20
#: each save: 2 tensors of 4 MiB, 8 chunks
SAVE_BYTES = 8 * CHUNK
#: saves each node makes in the run (node 1 is killed during its last)
STEPS = 3


def state_of(node: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * node + step)  # no two saves share a chunk
    return {f"w{k}": torch.randn(1024, 1024, generator=g) for k in range(2)}


def name_of(node: int, step: int) -> str:
    return f"ckpt/n{node}/step-{step}"


def backend_bytes(lab: netlab.Lab) -> float:
    """What the backend has sent the running nodes, all together."""
    return sum(lab.metric(i, "chunkd_backend_read_bytes_total") for i in lab.node_processes)


def role_bytes(lab: netlab.Lab, i: int, direction: str, role: str) -> float:
    """Node ``i``'s chunk bytes exchanged one way in one role, every peer together."""
    with urllib.request.urlopen(f"{lab.url(i)}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(
        float(line.rpartition(" ")[2])
        for line in lines
        if line.startswith("chunkd_peer_role_bytes_total{")
        and f'direction="{direction}"' in line
        and f'role="{role}"' in line
    )


def pushes_over(handle: ckpt.SaveHandle) -> dict[str, Any] | None:
    """The save's replica report once its pushes are over: a save that reached the
    backend first counts as replicated before then (docs/replicas.md)."""
    deadline = time.monotonic() + 30
    while handle.replicas is None and time.monotonic() < deadline:
        handle.wait(0, level="remote")
        time.sleep(0.1)
    return handle.replicas


def wait_all_up(lab: netlab.Lab, nodes: list[int]) -> None:
    deadline = time.monotonic() + 30
    while any(lab.metric(i, "chunkd_peer_healthy") < len(nodes) for i in nodes):
        assert time.monotonic() < deadline, "the nodes never all saw each other up"
        time.sleep(0.1)


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[netlab.Lab]:
    try:
        with netlab.lab(
            tmp_path,
            nodes=4,
            node_rate="400mbit",
            s3_rate="400mbit",
            chunk_bytes=CHUNK,
            racks=RACKS,
            peer_settings={"replicas": 1},
        ) as built:
            yield built
    except netlab.LabUnavailable as exc:
        pytest.skip(str(exc))


def run_of_saves(lab: netlab.Lab) -> dict[str, Any]:
    """Every node saves :data:`STEPS` checkpoints (replicas=1, each waited for until
    remote), node 1 killed once its last is handed over; node 1's last committed
    save, as its handle and manifest described it."""
    lab.start_s3()
    lab.start_nodes(range(1, 5), peers=True)
    wait_all_up(lab, [1, 2, 3, 4])
    errors: list[BaseException] = []
    last: dict[str, Any] = {}

    def saves(i: int) -> None:
        try:
            with Client(lab.socket(i), timeout=60) as client:
                for step in range(1, STEPS + 1):
                    if i == 1 and step == STEPS:  # in flight when the node dies
                        ckpt.async_save(state_of(i, step), name_of(i, step), client=client)
                        lab.kill_node(1)
                        return
                    handle = ckpt.save(
                        state_of(i, step),
                        name_of(i, step),
                        replicas=1,
                        durability="replicated",
                        client=client,
                    )
                    assert handle.wait(60, level="remote")
                    if i == 1:
                        last["step"] = step
                        last["replicas"] = pushes_over(handle)
                        last["manifest"] = ckpt.manifest(name_of(i, step), client=client)
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=saves, args=(i,)) for i in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    if errors:
        raise errors[0]
    assert last["step"] == STEPS - 1
    report = last["replicas"]
    assert report is not None
    assert report["outcome"] == "full", report  # the other rack took all of it
    assert set(report["targets"]) <= {lab.member(3), lab.member(4)}
    return last


def restore_on_a_fresh_node_one(lab: netlab.Lab, step: int) -> tuple[bool, float, float]:
    """Node 1's machine replaced (a fresh daemon, empty cache) loads its save of
    ``step``: (bit-exact, the backend's bytes meanwhile, replica bytes received)."""
    lab.start_node(1, peers=True)
    alive = sorted(lab.node_processes)
    wait_all_up(lab, alive)
    before = backend_bytes(lab)
    with Client(lab.socket(1), timeout=60) as client:
        loaded = ckpt.load(name_of(1, step), client=client)
    exact = loaded.keys() == state_of(1, step).keys() and all(
        torch.equal(loaded[k], v) for k, v in state_of(1, step).items()
    )
    from_replicas = role_bytes(lab, 1, "in", "replica")
    return exact, backend_bytes(lab) - before, from_replicas


@pytest.mark.timeout(120)
def test_a_node_replaced_mid_run_restores_its_last_save_from_replicas(
    lab: netlab.Lab,
) -> None:
    last = run_of_saves(lab)
    exact, from_backend, from_peers = restore_on_a_fresh_node_one(lab, last["step"])
    assert exact
    assert from_backend <= 0.01 * SAVE_BYTES, from_backend  # the manifest and the part
    assert from_peers >= SAVE_BYTES  # every chunk from the replica node


@pytest.mark.timeout(120)
def test_the_saver_and_its_replica_both_lost_restores_from_the_backend(
    lab: netlab.Lab,
) -> None:
    last = run_of_saves(lab)
    holder = int(last["replicas"]["targets"][0].partition(":")[0].rpartition(".")[2])
    lab.kill_node(holder)  # K=1: the one copy outside the backend goes with it
    exact, from_backend, _ = restore_on_a_fresh_node_one(lab, last["step"])
    assert exact
    assert SAVE_BYTES <= from_backend <= 1.05 * SAVE_BYTES + 65536  # each chunk once
