"""The replica pushes' connections (gateway/peers/replicas.py): a saver's pushes and
notes to a peer reuse kept-alive connections, not one connection each."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from chunkd.client import checkpoint as ckpt
from chunkd.gateway.peers.replicas import MAX_IN_FLIGHT_PER_SENDER
from chunkd.testing import CountingProxy
from tests.conftest import Daemon
from tests.test_replicas import Cluster, part_chunks, state_of


def connections_to(port: int) -> set[int]:
    """The client ports of every IPv4 TCP connection to ``port`` that the kernel lists,
    open or in TIME_WAIT (either end of a loopback connection counts once)."""
    ports = set()
    with open("/proc/net/tcp") as table:
        for line in list(table)[1:]:
            local, remote, state = line.split()[1:4]
            local_port, remote_port = (
                int(local.rpartition(":")[2], 16),
                int(remote.rpartition(":")[2], 16),
            )
            if state == "0A":  # listening
                continue
            if remote_port == port:
                ports.add(local_port)
            elif local_port == port:
                ports.add(remote_port)
    return ports


@pytest.mark.timeout(60)
def test_pushes_reuse_kept_alive_connections(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    cluster = Cluster(start_daemon, tmp_path, bucket, s3_proxy, ["a", "b"])
    before = connections_to(cluster.ports[1])
    with cluster.client(0) as client:  # 24 values of 1 MiB: 24 chunks, each its own push
        state = state_of(3, tensors=24)
        handle = ckpt.save(
            state, "ckpt/keep/step-1", replicas=1, durability="replicated", client=client
        )
        handle.wait(level="remote")  # the notes sent too, and nothing left to upload
        manifest = ckpt.manifest("ckpt/keep/step-1", client=client)
    opened = connections_to(cluster.ports[1]) - before
    chunks = part_chunks(manifest)
    assert cluster.nodes[0].metric("chunkd_replica_pushes_total", outcome="ok") == len(chunks)
    assert cluster.nodes[1].metric("chunkd_replica_received_total", outcome="stored") == len(chunks)
    # A connection per push would be one per chunk (each left in TIME_WAIT); kept-alive
    # ones are at most the pushes in flight to one target, and the probes' own.
    assert len(chunks) == 24
    assert len(opened) <= MAX_IN_FLIGHT_PER_SENDER + 1, sorted(opened)
