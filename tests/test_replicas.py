"""Replicas of a save's chunks in other nodes' RAM (docs/replicas.md): placement by
failure domain, the push and its bounds, the receiving store's budget and lifetime,
the durability level ``replicated``, restores from replicas and their faults."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from chunkd.cache import MAX_CHUNK_BYTES, ChunkCache, ChunkId
from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.client.checkpoint.reader import PartReader
from chunkd.client.protocol import DURABILITY_LEVELS
from chunkd.errors import CheckpointNotFoundError, ConfigError
from chunkd.gateway.checkpoints.model import Durability, SaveRequest
from chunkd.gateway.config import load_config
from chunkd.gateway.config.addresses import split_member
from chunkd.gateway.metrics import Metrics
from chunkd.gateway.peers.membership import Peer
from chunkd.gateway.peers.replicas import (
    MAX_IN_FLIGHT_PER_SENDER,
    MAX_SAVES_PER_SAVER,
    ReplicaRefused,
    ReplicaStore,
    replica_targets,
    restore_sources,
)
from chunkd.testing import CountingProxy, free_port, s3_backend
from tests.conftest import Daemon

TOKEN = "a-shared-secret-for-the-replica-tests"
MiB = 1 << 20


# -- placement and labels --------------------------------------------------------------


def test_member_labels_parse_and_bad_ones_are_refused(tmp_path: Path) -> None:
    assert split_member("10.0.0.7:8470 rack=r1") == ("10.0.0.7:8470", {"rack": "r1"})
    assert split_member("[::1]:8470") == ("[::1]:8470", {})
    for bad in ("10.0.0.7:8470 rack", "10.0.0.7:8470 rack=a rack=b", "10.0.0.7:8470 Rack=a"):
        with pytest.raises(ValueError, match="label"):
            split_member(bad)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    path = tmp_path / "chunkd.toml"
    path.write_text(
        f"""
[peers]
self = "127.0.0.1:9001"
members = ["127.0.0.1:9001 rack=a", "127.0.0.1:9002  rack=b"]
token_file = "{token}"

[[backends]]
name = "local"
url = "file://{tmp_path}/data"
"""
    )
    config = load_config(path, environ={}, cwd=tmp_path)
    assert config.peers.members == ("127.0.0.1:9001 rack=a", "127.0.0.1:9002 rack=b")
    path.write_text(
        f'[peers]\nself = "127.0.0.1:9001"\nmembers = ["127.0.0.1:9002 b"]\n'
        f'token_file = "{token}"\n[[backends]]\nname = "local"\nurl = "file://{tmp_path}/data"\n'
    )
    with pytest.raises(ConfigError, match="not a label"):
        load_config(path, environ={}, cwd=tmp_path)


def _peer(address: str, rack: str | None) -> Peer:
    return Peer(address, labels={} if rack is None else {"rack": rack})


def test_replica_targets_leave_out_the_savers_failure_domain() -> None:
    members = [
        _peer("10.0.0.1:8470", "a"),
        _peer("10.0.0.2:8470", "a"),
        _peer("10.0.0.3:8470", "b"),
        _peer("10.0.0.4:8470", "b"),
        _peer("10.0.0.5:8470", None),  # a domain of its own
    ]
    for save in ("s1", "s2", "s3", "s4"):
        order = replica_targets(members, save, "10.0.0.1:8470")
        assert sorted(order) == ["10.0.0.3:8470", "10.0.0.4:8470", "10.0.0.5:8470"]
        # The same order on every node (up or down does not enter): a restore finds them.
        assert order == replica_targets(list(reversed(members)), save, "10.0.0.1:8470")
        assert restore_sources(members, save, "10.0.0.1:8470", 1) == order[:3]
    # Unlabelled members: every other member is a target.
    bare = [_peer(f"10.0.1.{i}:8470", None) for i in range(4)]
    assert len(replica_targets(bare, "s", "10.0.1.0:8470")) == 3
    assert restore_sources(bare, "s", "10.0.1.0:8470", 0) == []
    # Orders differ by save: one saver's replicas spread over the cluster.
    firsts = {replica_targets(bare, f"s{i}", "10.0.1.0:8470")[0] for i in range(40)}
    assert len(firsts) == 3


# -- the receiving store ------------------------------------------------------------------


async def test_replica_store_bounds_budget_and_lifetime(
    open_cache: Callable[..., Any],
) -> None:
    cache: ChunkCache = await open_cache(ram_bytes=64 * MiB, chunk_bytes=4 * MiB)
    metrics = Metrics()
    members = {"10.0.0.2:8470", "10.0.0.3:8470"}
    store = ReplicaStore(cache, metrics, 3 * MiB, lambda a: a in members)
    saver = "10.0.0.2:8470"

    def refused(sender: str | None, who: str, length: int | None) -> int:
        with pytest.raises(ReplicaRefused) as caught:
            store.admit(sender, who, length)
        return caught.value.status

    assert refused(None, saver, 10) == 401
    assert refused("10.9.9.9:8470", "10.9.9.9:8470", 10) == 401  # not a member
    assert refused(saver, "10.0.0.3:8470", 10) == 401  # in another's name
    assert refused(saver, saver, None) == 411
    assert refused(saver, saver, MAX_CHUNK_BYTES + 1) == 413
    assert refused(saver, saver, 3 * MiB + 1) == 507  # past the budget, before a byte is read
    slots = [store.admit(saver, saver, 1) for _ in range(MAX_IN_FLIGHT_PER_SENDER)]
    assert refused(saver, saver, 1) == 429  # per sender...
    store.admit("10.0.0.3:8470", "10.0.0.3:8470", 1)()  # ...not for the others
    for release in slots:
        release()

    blobs = [os.urandom(MiB) for _ in range(4)]
    ids = [ChunkId.of(b) for b in blobs]

    async def push(save: str, i: int) -> None:
        release = store.admit(saver, saver, len(blobs[i]))
        try:
            await store.store(saver, save, ids[i], memoryview(blobs[i]), seq=int(save[1:]))
        finally:
            release()

    def note(save: str, *, replicated: bool = False, remote: bool = False) -> None:
        store.note(saver, save, replicated=replicated, remote=remote, seq=int(save[1:]))

    release = store.admit(saver, saver, MiB)
    try:
        with pytest.raises(ReplicaRefused) as damaged:
            await store.store(saver, "s1", ids[0], memoryview(blobs[1]), seq=1)
    finally:
        release()
    assert damaged.value.status == 422
    assert not store.holds(ids[0])

    await push("s1", 0)
    await push("s1", 1)
    assert store.used == 2 * MiB
    assert store.holds(ids[0])
    assert metrics.replica_bytes._value.get() == 2 * MiB  # type: ignore[attr-defined]
    lease = await cache.find(ids[0])  # served as any held chunk
    assert lease is not None
    assert bytes(lease.view()) == blobs[0]
    lease.release()
    with pytest.raises(ReplicaRefused) as full:
        store.admit(saver, saver, 2 * MiB)
    assert full.value.status == 507

    # Held until s1 is remote and a later save is committed and replicated.
    note("s1", replicated=True)
    note("s1", remote=True)
    assert store.used == 2 * MiB
    await push("s2", 1)  # shared with s1: held once
    await push("s2", 2)
    assert store.used == 3 * MiB
    note("s2", replicated=True)
    assert store.used == 3 * MiB  # s2 is not committed: s1 is the one a restore wants
    note("s2", remote=True)
    assert store.used == 2 * MiB  # s1 let go; chunk 1 stays for s2
    assert not store.holds(ids[0])
    assert store.holds(ids[1])
    assert store.holds(ids[2])

    # A later save whole on other nodes (its remote note comes once every chunk got
    # its copies) lets every older one go, committed or not; not a later one.
    await push("s3", 3)
    note("s4", remote=True)
    assert store.used == 0
    await push("s5", 0)
    note("s4", replicated=True, remote=True)  # again, late
    assert store.used == MiB
    assert store.holds(ids[0])
    note("s5", replicated=True)
    note("s6", replicated=True, remote=True)
    assert store.used == 0

    # At most MAX_SAVES_PER_SAVER saves of one saver: the oldest by seq goes.
    for n in range(MAX_SAVES_PER_SAVER + 2, 0, -1):
        store.note(saver, f"x{n}", replicated=True, remote=False, seq=100 + n)
    kept = store.stats()["savers"][saver]  # type: ignore[index]
    assert sorted(kept) == sorted(f"x{n}" for n in range(3, MAX_SAVES_PER_SAVER + 3))
    store.close()
    assert store.used == 0


async def _pushed(store: ReplicaStore, saver: str, save: str, blob: bytes, seq: int) -> bool:
    release = store.admit(saver, saver, len(blob))
    try:
        return await store.store(saver, save, ChunkId.of(blob), memoryview(blob), seq=seq)
    finally:
        release()


async def test_a_late_note_of_an_older_save_lets_no_newer_one_go(
    open_cache: Callable[..., Any],
) -> None:
    cache: ChunkCache = await open_cache(ram_bytes=16 * MiB)
    saver = "10.0.0.2:8470"
    store = ReplicaStore(cache, Metrics(), 8 * MiB, lambda a: a == saver)
    blob = os.urandom(MiB)
    assert await _pushed(store, saver, "s2", blob, seq=2)
    store.note(saver, "s2", replicated=True, remote=False, seq=2)
    store.note(saver, "s2", replicated=False, remote=True, seq=2)
    # s1 began before s2; its pushes were slower, so its notes come now.
    store.note(saver, "s1", replicated=False, remote=True, seq=1)
    store.note(saver, "s1", replicated=True, remote=True, seq=1)
    assert store.holds(ChunkId.of(blob))
    assert store.used == MiB
    # A late push of s1 is not kept (it would never be let go by s2's notes).
    assert not await _pushed(store, saver, "s1", os.urandom(MiB), seq=1)
    assert store.used == MiB
    assert list(store.stats()["savers"][saver]) == ["s2"]  # type: ignore[index]


async def test_a_push_landing_while_its_save_is_let_go_is_not_kept(
    open_cache: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache: ChunkCache = await open_cache(ram_bytes=16 * MiB)
    saver = "10.0.0.2:8470"
    store = ReplicaStore(cache, Metrics(), 8 * MiB, lambda a: a == saver)
    put_leased = cache.ram.put_leased
    entered, go_on = asyncio.Event(), asyncio.Event()

    async def slow_put(chunk: Any) -> Any:  # the real RAM tier, after the note came
        entered.set()
        await go_on.wait()
        return await put_leased(chunk)

    monkeypatch.setattr(cache.ram, "put_leased", slow_put)
    landing = asyncio.ensure_future(_pushed(store, saver, "s1", os.urandom(MiB), seq=1))
    await entered.wait()
    store.note(saver, "s2", replicated=True, remote=True, seq=2)  # s1 let go meanwhile
    go_on.set()
    assert not await landing
    for n in range(3, 3 + MAX_SAVES_PER_SAVER + 2):
        store.note(saver, f"s{n}", replicated=True, remote=True, seq=n)
    assert store.used == 0
    assert cache.ram.stats().pinned == 0


async def test_a_chunk_larger_than_the_ram_tier_takes_is_refused_before_its_body(
    open_cache: Callable[..., Any],
) -> None:
    cache: ChunkCache = await open_cache(ram_bytes=16 * MiB, chunk_bytes=MiB)
    saver = "10.0.0.2:8470"
    store = ReplicaStore(cache, Metrics(), 8 * MiB, lambda a: a == saver)
    with pytest.raises(ReplicaRefused) as refused:
        store.admit(saver, saver, MiB + 1)
    assert refused.value.status == 413
    store.admit(saver, saver, MiB)()


async def test_a_saver_no_longer_a_member_is_let_go_after_the_grace(
    open_cache: Callable[..., Any],
) -> None:
    cache: ChunkCache = await open_cache(ram_bytes=16 * MiB)
    members = {"10.0.0.2:8470", "10.0.0.3:8470"}
    store = ReplicaStore(cache, Metrics(), 8 * MiB, lambda a: a in members, grace=600)
    assert await _pushed(store, "10.0.0.2:8470", "s1", os.urandom(MiB), seq=1)
    assert await _pushed(store, "10.0.0.3:8470", "s1", os.urandom(MiB), seq=1)
    members.discard("10.0.0.2:8470")  # replaced under another address
    store.sweep(now=1000.0)
    assert store.used == 2 * MiB  # within the grace: it may come back
    store.sweep(now=1599.0)
    assert store.used == 2 * MiB
    store.sweep(now=1600.0)
    assert store.used == MiB
    assert list(store.stats()["savers"]) == ["10.0.0.3:8470"]  # type: ignore[call-overload]
    assert cache.ram.stats().pinned == 1


@pytest.mark.timeout(30)
async def test_a_failed_chunk_read_cancels_the_saves_other_pushes(
    open_cache: Callable[..., Any], tmp_path: Path
) -> None:
    from chunkd.cache import BytesLease, ChunkLease
    from chunkd.errors import CheckpointError
    from chunkd.gateway.peers import Peers
    from chunkd.gateway.peers.replicas import Replicas

    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    path = tmp_path / "chunkd.toml"
    path.write_text(
        f'[peers]\nself = "127.0.0.1:{free_port()}"\nmembers = ["127.0.0.1:{free_port()}"]\n'
        f'token_file = "{token}"\n[[backends]]\nname = "local"\nurl = "file://{tmp_path}/d"\n'
    )
    config = load_config(path, environ={}, cwd=tmp_path)
    cache: ChunkCache = await open_cache(ram_bytes=16 * MiB)
    metrics = Metrics()
    replicas = Replicas(Peers(config.peers, metrics, tls=None), cache, metrics)
    blobs = [os.urandom(1024) for _ in range(6)]
    chunks = {ChunkId.of(b): len(b) for b in blobs}
    first = next(iter(chunks))
    never = asyncio.Event()

    async def source(cid: ChunkId) -> ChunkLease:
        if cid == first:
            raise CheckpointError(f"chunk {cid} is gone from this node's disk")
        await never.wait()  # the others are still being read
        return BytesLease(cid, memoryview(blobs[0]))

    try:
        with pytest.raises(CheckpointError, match="gone"):
            await replicas.push("local", "s1", chunks, source, 1, seq=1)
        left = [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "replicate"]  # type: ignore[union-attr]
        assert left == []
    finally:
        await replicas.close()


# -- old documents -------------------------------------------------------------------------


def test_old_journals_and_parts_still_read() -> None:
    old_journal = {
        "backend": "ckpt",
        "path": "run/step-1",
        "save_id": "abc",
        "rank": 0,
        "world_size": 1,
        "durability": "remote",
        "overwrite": False,
        "commit": "auto",
        "step": 1,
        "segments": [[0, 10]],
        "tree": None,
        "uid": 1000,
        "admin": False,
    }
    request = SaveRequest.from_json(old_journal)
    assert request.replicas is None
    assert request.node is None
    assert request.durability is Durability.REMOTE
    assert SaveRequest.from_json(request.to_json()) == request
    assert Durability.parse("local") < Durability.parse("replicated") < Durability.REMOTE
    assert DURABILITY_LEVELS == ("staged", "local", "replicated", "remote")
    # A part written before replicas: no node, no replicas; it loads as before.
    part = {"rank": 0, "save_id": "abc", "segments": [{"size": 3, "chunks": [["ab" * 32, 3]]}]}
    assert PartReader(None, "ckpt/run/step-1", part)._origin == {}  # type: ignore[arg-type]
    part |= {"node": "10.0.0.1:8470", "replicas": 2}
    assert PartReader(None, "ckpt/run/step-1", part)._origin == {  # type: ignore[arg-type]
        "save": "abc",
        "node": "10.0.0.1:8470",
        "replicas": 2,
    }


# -- daemons on loopback ------------------------------------------------------------------


def node_toml(
    tmp_path: Path,
    bucket: str,
    proxy: CountingProxy,
    name: str,
    port: int,
    members: list[tuple[int, str]],
    *,
    budget: str = "256MiB",
    replicas: int = 0,
    hosts: list[str] | None = None,
) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    at = hosts or ["127.0.0.1"] * len(members)
    host = at[[p for p, _ in members].index(port)]
    listed = ", ".join(f'"{h}:{p} rack={rack}"' for h, (p, rack) in zip(at, members, strict=True))
    return f"""
[server]
listen = "{host}:{port}"
socket = "{tmp_path / name / "chunkd.sock"}"

[cache]
dir = "{tmp_path / name / "cache"}"
ram_bytes = "256MiB"
disk_bytes = "1GiB"
disk_min_free_bytes = 0
fsync = "never"

[peers]
self = "{host}:{port}"
members = [{listed}]
token_file = "{token}"
timeout = "2s"
health_interval = "300ms"
down_after = 4
up_after = 1
replicas = {replicas}
replica_budget = "{budget}"

{s3_backend("ckpt", f"s3://{bucket}/pre", proxy.endpoint, writable=True, retries=1)}"""


def state_of(seed: int, tensors: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(512, 512, generator=g) for i in range(tensors)}  # 1 MiB each


async def test_parts_of_one_save_never_let_that_save_go(
    open_cache: Callable[..., Any],
) -> None:
    # Two ranks on one host push their parts of one save under one saver; an older
    # saver gave each part its own seq. The part whose notes make the save whole
    # must not let go of the other part's chunks, nor make its later pushes late.
    cache: ChunkCache = await open_cache(ram_bytes=16 * MiB)
    saver = "10.0.0.2:8470"
    store = ReplicaStore(cache, Metrics(), 8 * MiB, lambda a: a == saver)
    old, a, b, c = (os.urandom(MiB) for _ in range(4))
    assert await _pushed(store, saver, "s1", old, seq=1)
    store.note(saver, "s1", replicated=True, remote=True, seq=1)
    assert await _pushed(store, saver, "s2", a, seq=10)  # rank 0's part
    assert await _pushed(store, saver, "s2", b, seq=11)  # rank 1's part
    store.note(saver, "s2", replicated=True, remote=False, seq=11)
    store.note(saver, "s2", replicated=False, remote=True, seq=11)
    assert store.holds(ChunkId.of(a))
    assert store.holds(ChunkId.of(b))
    assert not store.holds(ChunkId.of(old))  # the previous committed save goes
    # Rank 0's last push and its notes come after: kept, and they let nothing go.
    assert await _pushed(store, saver, "s2", c, seq=10)
    store.note(saver, "s2", replicated=True, remote=True, seq=10)
    assert store.used == 3 * MiB
    assert list(store.stats()["savers"][saver]) == ["s2"]  # type: ignore[index]
    # A later save whole lets s2 go (its seq is the largest its parts gave, 11).
    store.note(saver, "s3", replicated=True, remote=True, seq=12)
    assert store.used == 0


class Cluster:
    """Nodes on loopback, one rack each unless told."""

    def __init__(
        self,
        start_daemon: Callable[..., Daemon],
        tmp_path: Path,
        bucket: str,
        proxy: CountingProxy,
        racks: list[str],
        budgets: list[str] | None = None,
        *,
        hosts: list[str] | None = None,
        replicas: int = 0,
    ) -> None:
        self.start_daemon = start_daemon
        self.hosts = hosts or ["127.0.0.1"] * len(racks)
        self.replicas = replicas
        self.tmp_path = tmp_path
        self.bucket = bucket
        self.proxy = proxy
        self.ports = [free_port() for _ in racks]
        self.members = list(zip(self.ports, racks, strict=True))
        self.budgets = budgets or ["256MiB"] * len(racks)
        self.nodes = [self.start(i) for i in range(len(racks))]
        self.wait_all_up()

    def start(self, i: int, *, fresh: str = "") -> Daemon:
        name = f"n{i}{fresh}"
        return self.start_daemon(
            node_toml(
                self.tmp_path,
                self.bucket,
                self.proxy,
                name,
                self.ports[i],
                self.members,
                budget=self.budgets[i],
                replicas=self.replicas,
                hosts=self.hosts,
            ),
            cwd=self.tmp_path / name,
            env={"CHUNKD_SERVER_LISTEN": self.address(i)},
            port=self.ports[i],
        )

    def wait_all_up(self) -> None:
        deadline = time.monotonic() + 20
        while any(n.metric("chunkd_peer_healthy") < len(self.nodes) for n in self.nodes):
            assert time.monotonic() < deadline, "the nodes never all saw each other up"
            time.sleep(0.1)

    def address(self, i: int) -> str:
        return f"{self.hosts[i]}:{self.ports[i]}"

    def node_at(self, address: str) -> Daemon:
        return self.nodes[[self.address(i) for i in range(len(self.nodes))].index(address)]

    def peers(self) -> list[Peer]:
        return [
            _peer(f"{h}:{p}", rack) for h, (p, rack) in zip(self.hosts, self.members, strict=True)
        ]

    def client(self, i: int) -> Client:
        return Client(self.nodes[i].cwd / "chunkd.sock")


def held(node: Daemon, cid: str) -> bytes | None:
    status, _, body = node.get(
        f"/v1/peer/chunks/ckpt/{cid}?held=1", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    return body if status == 200 else None


def part_chunks(manifest: dict[str, Any], rank: int = 0) -> list[str]:
    part = next(p for p in manifest["parts"] if p["rank"] == rank)
    return list(dict.fromkeys(c for seg in part["segments"] for c, _ in seg["chunks"]))


@pytest.mark.timeout(90)
def test_a_save_is_replicated_across_racks_and_let_go_after_the_next(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    cluster = Cluster(start_daemon, tmp_path, bucket, s3_proxy, ["a", "a", "b", "c"])
    saver = cluster.nodes[0]
    state = state_of(1)
    with cluster.client(0) as client:
        handle = ckpt.save(
            state, "ckpt/rep/step-1", replicas=1, durability="replicated", client=client
        )
        assert handle.replicas is not None
        assert handle.replicas["outcome"] == "full"
        handle.wait(level="remote")
        manifest = ckpt.manifest("ckpt/rep/step-1", client=client)
    part = manifest["parts"][0]
    assert part["node"] == cluster.address(0)
    assert part["replicas"] == 1
    chunks = part_chunks(manifest)
    order = replica_targets(cluster.peers(), part["save_id"], cluster.address(0))
    assert cluster.address(1) not in order  # same rack as the saver
    first = cluster.nodes[cluster.ports.index(int(order[0].rpartition(":")[2]))]
    for cid in chunks:  # on the first target, served as a held chunk, bit-exact
        body = held(first, cid)
        assert body is not None
        assert ChunkId.of(body) == ChunkId.parse(cid)
    assert first.metric("chunkd_replica_received_total", outcome="stored") == len(chunks)
    assert saver.metric("chunkd_replica_pushes_total", outcome="ok") == len(chunks)
    assert saver.metric("chunkd_replica_saves_total", outcome="full") == 1
    replica_bytes = first.metric("chunkd_replica_bytes")
    assert replica_bytes == sum(n for seg in part["segments"] for _, n in seg["chunks"])
    assert cluster.nodes[1].metric("chunkd_replica_received_total") == 0

    # The next save, replicated and committed: the first one's replicas are let go.
    with cluster.client(0) as client:
        handle2 = ckpt.save(state_of(2), "ckpt/rep/step-2", replicas=1, client=client)
        manifest2 = ckpt.manifest("ckpt/rep/step-2", client=client)
    assert handle2.replicas is not None
    second = sum(n for seg in manifest2["parts"][0]["segments"] for _, n in seg["chunks"])
    deadline = time.monotonic() + 10
    while (total := sum(n.metric("chunkd_replica_bytes") for n in cluster.nodes)) != second:
        assert time.monotonic() < deadline, f"{total} bytes of replicas held, not {second}"
        time.sleep(0.2)


@pytest.mark.timeout(90)
def test_a_full_budget_gives_fewer_replicas_counted_and_the_save_completes(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    cluster = Cluster(
        start_daemon, tmp_path, bucket, s3_proxy, ["a", "b", "c"], ["1GiB", "3MiB", "2MiB"]
    )
    with cluster.client(0) as client:
        handle = ckpt.save(state_of(3), "ckpt/full/step-1", replicas=1, client=client)
        assert handle.result().durability == "remote"
        loaded = ckpt.load("ckpt/full/step-1", client=client)
    assert all(torch.equal(loaded[k], v) for k, v in state_of(3).items())
    report = handle.replicas
    assert report is not None
    assert report["outcome"] == "partial"
    assert report["whole"] == 5
    assert report["chunks"] == 8
    saver, small = cluster.nodes[0], cluster.nodes[1:]
    # Each target refused its first chunk past the budget (the pushes of a save run
    # a few at once, so more than one may have been on the way), then was skipped.
    full = saver.metric("chunkd_replica_pushes_total", outcome="full")
    assert 2 <= full <= 2 * 8
    assert sum(n.metric("chunkd_replica_received_total", outcome="full") for n in small) == full
    assert saver.metric("chunkd_replica_saves_total", outcome="partial") == 1
    assert small[0].metric("chunkd_replica_bytes") == 3 * MiB
    assert small[1].metric("chunkd_replica_bytes") == 2 * MiB


def _raw_put(port: int, path: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
    """One PUT on a socket of its own, the body sent only after the daemon's first
    answer (a refusal, or ``100 Continue`` to an ``Expect``): (the final status, what
    came before the body was sent)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(f"PUT {path} HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode())
        first = b""
        while b"\r\n\r\n" not in first:
            got = sock.recv(65536)
            assert got, "closed before an answer"
            first += got
        answer = first
        if first.startswith(b"HTTP/1.1 100 ") or body:
            sock.sendall(body)
            answer = (
                first.partition(b"\r\n\r\n")[2] if first.startswith(b"HTTP/1.1 100 ") else first
            )
            while b"\r\n\r\n" not in answer:
                got = sock.recv(65536)
                assert got, "closed before an answer"
                answer += got
        return int(answer.split(b" ", 2)[1]), first


@pytest.mark.timeout(60)
def test_refused_pushes_cost_no_body(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    cluster = Cluster(start_daemon, tmp_path, bucket, s3_proxy, ["a", "b"], ["1536KiB", "256MiB"])
    node, other = cluster.nodes[0], cluster.address(1)
    blob = os.urandom(MiB)
    cid = ChunkId.of(blob)
    path = f"/v1/peer/replicas/ckpt/{cid}?save=s1&saver={other}&seq=1"
    auth = {"Authorization": f"Bearer {TOKEN}", "X-Chunkd-Peer": other}
    announced = {"Content-Length": str(MiB)}
    expect = {"Expect": "100-continue"}
    # Heads alone, a body announced and never sent: each is refused at once.
    assert _raw_put(node.port, path, announced, b"")[0] == 401  # no token
    assert _raw_put(node.port, path, announced | expect, b"")[0] == 401
    stranger = auth | {"X-Chunkd-Peer": "127.0.0.1:1"} | announced
    assert _raw_put(node.port, path.replace(other, "127.0.0.1:1"), stranger, b"")[0] == 401
    too_big = auth | {"Content-Length": str(MAX_CHUNK_BYTES + 1)}
    assert _raw_put(node.port, path, too_big, b"")[0] == 413
    assert _raw_put(node.port, path, too_big | expect, b"")[0] == 413
    assert _raw_put(node.port, path, auth | {"Transfer-Encoding": "chunked"}, b"")[0] == 411
    # A body that is not the chunk its id names: read, hashed, refused.
    status, first = _raw_put(node.port, path, auth | announced | expect, os.urandom(MiB))
    assert first.startswith(b"HTTP/1.1 100 ")
    assert status == 422
    assert node.metric("chunkd_replica_received_total", outcome="refused") == 1
    assert node.metric("chunkd_replica_received_total", outcome="invalid") == 4
    assert node.metric("chunkd_replica_bytes") == 0
    status, first = _raw_put(node.port, path, auth | announced | expect, blob)
    assert first.startswith(b"HTTP/1.1 100 ")
    assert status == 200
    assert node.metric("chunkd_replica_bytes") == MiB
    assert node.metric("chunkd_replica_received_total", outcome="stored") == 1
    # Past the budget (1.5 MiB): refused before 100 Continue, the body never sent.
    other_blob = os.urandom(MiB)
    status, first = _raw_put(
        node.port,
        path.replace(str(cid), str(ChunkId.of(other_blob))),
        auth | announced | expect,
        b"",
    )
    assert status == 507
    assert not first.startswith(b"HTTP/1.1 100 ")
    assert node.metric("chunkd_replica_received_total", outcome="full") == 1
    # A note in a stranger's name, or from one, is refused: it holds nothing here.
    request = urllib.request.Request(
        f"{node.url}/v1/peer/replicas/saves?save=s9&saver=127.0.0.1:1&seq=1&state=replicated",
        method="POST",
        headers=auth | {"X-Chunkd-Peer": "127.0.0.1:1"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    refused.value.close()
    assert refused.value.code == 401


@pytest.mark.timeout(90)
def test_an_uncommitted_saves_replicas_never_make_it_restorable(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    bucket: str,
    s3_proxy: CountingProxy,
    s3_server: Any,
) -> None:
    from chunkd.gateway.checkpoints.model import parts_prefix

    cluster = Cluster(start_daemon, tmp_path, bucket, s3_proxy, ["a", "b", "c"])
    with cluster.client(0) as client:
        # commit "none": the part goes in, the manifest (the commit) not yet.
        handle = ckpt.async_save(
            state_of(4), "ckpt/open/step-1", replicas=2, client=client, _commit="none"
        )
        # Its part in the backend is level remote (which includes replicated) at
        # once; the pushes' report comes when they are over.
        deadline = time.monotonic() + 30
        while handle.wait(10, level="replicated") and handle.replicas is None:
            assert time.monotonic() < deadline, "the pushes never ended"
            time.sleep(0.1)
        assert handle.replicas is not None
        assert handle.replicas["outcome"] == "full"
        assert handle.wait(30)  # its part is in the backend
    assert sum(n.metric("chunkd_replica_bytes") for n in cluster.nodes[1:]) == 2 * 8 * MiB
    s3 = s3_server.client()
    prefix = parts_prefix("open/step-1", handle.save_id)
    listed = s3.list_objects_v2(Bucket=bucket)["Contents"]
    keys = [o["Key"] for o in listed]
    assert len([k for k in keys if prefix in k]) == 1, (prefix, keys)
    key = next(k for k in keys if prefix in k)
    part = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    chunks = list(dict.fromkeys(c for seg in part["segments"] for c, _ in seg["chunks"]))
    cluster.nodes[0].stop(signal.SIGKILL)
    cluster.nodes[0] = cluster.start(0, fresh="-fresh")
    cluster.wait_all_up()
    # Its replicas are there and served by id...
    for node in cluster.nodes[1:]:
        assert all(held(node, cid) is not None for cid in chunks)
    # ...yet the name is not restorable, nor listed.
    with cluster.client(0) as client:
        with pytest.raises(CheckpointNotFoundError):
            ckpt.load("ckpt/open/step-1", client=client)
        assert ckpt.list("ckpt/open/", client=client) == []
        # Committed now: it loads, from the replicas.
        ckpt.commit("ckpt/open/step-1", handle.save_id, 1, client=client)
        before = cluster.proxy.bytes_down
        loaded = ckpt.load("ckpt/open/step-1", client=client)
    assert all(torch.equal(loaded[k], v) for k, v in state_of(4).items())
    assert cluster.proxy.bytes_down - before <= 0.01 * 8 * MiB


def _restore_fresh(cluster: Cluster, name: str) -> tuple[dict[str, torch.Tensor], int]:
    """Kill node 0, start a fresh one with its name and an empty cache, load ``name``
    there: (the state, the bytes the backend sent meanwhile)."""
    cluster.nodes[0].stop(signal.SIGKILL)
    cluster.nodes[0] = cluster.start(0, fresh=f"-{time.monotonic_ns()}")
    cluster.wait_all_up()
    before = cluster.proxy.bytes_down
    with cluster.client(0) as client:
        loaded = ckpt.load(name, client=client)
    return loaded, cluster.proxy.bytes_down - before


@pytest.mark.timeout(90)
def test_a_replaced_node_restores_from_replicas(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    cluster = Cluster(start_daemon, tmp_path, bucket, s3_proxy, ["a", "b", "c"])
    state = state_of(5)
    with cluster.client(0) as client:
        ckpt.save(state, "ckpt/back/step-1", replicas=1, client=client)
    loaded, from_backend = _restore_fresh(cluster, "ckpt/back/step-1")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert from_backend <= 0.01 * 8 * MiB, from_backend
    fresh = cluster.nodes[0]
    assert fresh.metric("chunkd_checkpoint_restored_bytes_total", source="peer") == 8 * MiB
    served = sum(
        n.metric("chunkd_peer_role_bytes_total", direction="out", role="replica")
        for n in cluster.nodes[1:]
    )
    assert served == 8 * MiB


@pytest.mark.timeout(90)
def test_k1_with_the_saver_and_its_replica_lost_restores_from_the_backend(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    cluster = Cluster(start_daemon, tmp_path, bucket, s3_proxy, ["a", "b", "c"])
    state = state_of(6)
    with cluster.client(0) as client:
        handle = ckpt.save(state, "ckpt/lost/step-1", replicas=1, client=client)
    assert handle.replicas is not None
    (target,) = handle.replicas["targets"]
    lost = cluster.ports.index(int(str(target).rpartition(":")[2]))
    cluster.nodes[lost].stop(signal.SIGKILL)  # the replica peer, dead during the restore
    cluster.nodes[0].stop(signal.SIGKILL)
    cluster.nodes[0] = cluster.start(0, fresh="-fresh")
    before = cluster.proxy.bytes_down
    with cluster.client(0) as client:
        loaded = ckpt.load("ckpt/lost/step-1", client=client)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert cluster.proxy.bytes_down - before >= 8 * MiB  # every chunk from the backend


@pytest.mark.timeout(90)
def test_a_damaged_replica_is_counted_and_the_next_source_serves(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    from aiohttp import web

    from tests.test_peers import serving

    liar_port = free_port()
    stored: list[str] = []

    async def take(request: web.Request) -> web.Response:  # a member that takes pushes
        await request.read()
        stored.append(request.match_info["id"])
        return web.json_response({"ok": True})

    async def lie(request: web.Request) -> web.Response:  # ...and answers with garbage
        return web.Response(body=os.urandom(MiB))

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application(client_max_size=MAX_CHUNK_BYTES + 1)
    app.router.add_put("/v1/peer/replicas/{backend}/{id}", take)
    app.router.add_post("/v1/peer/replicas/saves", ok)
    app.router.add_get("/v1/peer/chunks/{backend}/{id}", lie)
    app.router.add_get("/healthz", ok)
    with serving(app, liar_port):
        cluster = Cluster.__new__(Cluster)
        cluster.start_daemon, cluster.tmp_path = start_daemon, tmp_path
        cluster.bucket, cluster.proxy = bucket, s3_proxy
        cluster.ports = [free_port(), free_port(), liar_port]
        cluster.members = list(zip(cluster.ports, ["a", "b", "c"], strict=True))
        cluster.budgets = ["256MiB"] * 3
        cluster.hosts, cluster.replicas = ["127.0.0.1"] * 3, 0
        cluster.nodes = [cluster.start(0), cluster.start(1)]
        liar = f"127.0.0.1:{liar_port}"
        save_id = next(
            f"s{i}"
            for i in range(100)
            if replica_targets(cluster.peers(), f"s{i}", cluster.address(0))[0] == liar
        )
        state = state_of(7)
        with cluster.client(0) as client:
            handle = ckpt.async_save(
                state,
                "ckpt/liar/step-1",
                replicas=1,
                save_id=save_id,
                world_size=1,
                client=client,
            )
            assert handle.result(60).replicas["targets"] == [liar]  # type: ignore[index]
        assert len(stored) == 8
        loaded, _ = _restore_fresh(cluster, "ckpt/liar/step-1")
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
        fresh = cluster.nodes[0]
        # Every replica answer was damaged (the liar may own some chunks too: more)
        assert fresh.metric("chunkd_peer_integrity_failures_total") >= 8


@pytest.mark.timeout(60)
def test_a_save_without_replicas_meets_replicated_at_local(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    cluster = Cluster(start_daemon, tmp_path, bucket, s3_proxy, ["a", "b"])
    s3_proxy.delay_up = 0.05  # the upload cannot finish first
    try:
        with cluster.client(0) as client:
            handle = ckpt.save(
                state_of(8, 2), "ckpt/none/step-1", durability="replicated", client=client
            )
            result = handle.result()
    finally:
        s3_proxy.delay_up = 0
    assert result.durability == "local"  # never said to be replicated: nothing was copied
    assert result.replicas is None
    assert sum(n.metric("chunkd_replica_bytes") for n in cluster.nodes) == 0


def _peers_config(tmp_path: Path, own: str, other: str) -> Any:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    path = tmp_path / "chunkd.toml"
    path.write_text(
        f'[peers]\nself = "{own}"\nmembers = ["{other}"]\n'
        f'token_file = "{token}"\n[[backends]]\nname = "local"\nurl = "file://{tmp_path}/d"\n'
    )
    return load_config(path, environ={}, cwd=tmp_path).peers


@pytest.mark.timeout(30)
async def test_a_push_dropped_after_its_head_or_mid_body_lets_its_slot_go(
    open_cache: Callable[..., Any], tmp_path: Path
) -> None:
    from aiohttp import web

    from chunkd.gateway.appkeys import PEERS
    from chunkd.gateway.peers import Peers
    from chunkd.gateway.peers.replica_routes import REPLICAS, add_replica_routes

    # The real routes, store and membership on a server of this process's loop
    # (plain asyncio: the sender's reset can come before the 100 Continue is written).
    port, other = free_port(), f"127.0.0.1:{free_port()}"
    peers = Peers(_peers_config(tmp_path, f"127.0.0.1:{port}", other), Metrics(), tls=None)
    cache: ChunkCache = await open_cache(ram_bytes=16 * MiB)
    store = ReplicaStore(cache, Metrics(), 64 * MiB, lambda a: a == other)
    app = web.Application()
    add_replica_routes(app)
    app[PEERS], app[REPLICAS] = peers, store
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    blob = os.urandom(MiB)
    path = f"/v1/peer/replicas/ckpt/{ChunkId.of(blob)}?save=s1&saver={other}&seq=1"
    head = (
        f"PUT {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"X-Chunkd-Peer: {other}\r\nContent-Length: {MiB}\r\nExpect: 100-continue\r\n\r\n"
    ).encode()
    loop = asyncio.get_running_loop()
    try:
        for n in range(2 * MAX_IN_FLIGHT_PER_SENDER):
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.setblocking(False)
                await loop.sock_sendall(sock, head)
                if n % 2:  # mid-body: after 100 Continue, half the body, then a reset
                    assert (await loop.sock_recv(sock, 65536)).startswith(b"HTTP/1.1 100 ")
                    await loop.sock_sendall(sock, blob[: MiB // 2])
            await asyncio.sleep(0.05)  # the server (on this loop) sees the reset
        # A slot or a byte of the budget still taken: 429 (or 507) for ever.
        for _ in range(100):
            if not store.stats()["reserved"]:
                break
            await asyncio.sleep(0.1)
        assert store.stats()["reserved"] == 0
        store.admit(other, other, MiB)()
    finally:
        await runner.cleanup()
        await peers.close()


@pytest.mark.timeout(90)
def test_a_push_or_note_in_a_members_name_comes_from_its_address(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    # Each node on an address of its own; this test connects from 127.0.0.1, no member's.
    hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    cluster = Cluster(start_daemon, tmp_path, bucket, s3_proxy, ["a", "b", "c"], hosts=hosts)
    with cluster.client(0) as client:
        handle = ckpt.save(state_of(9, 2), "ckpt/who/step-1", replicas=1, client=client)
    assert handle.replicas is not None
    assert handle.replicas["outcome"] == "full"  # the saver's own pushes are taken
    (target,) = handle.replicas["targets"]
    holder = cluster.node_at(str(target))
    assert holder.metric("chunkd_replica_bytes") == 2 * MiB
    victim = cluster.address(0)
    auth = {"Authorization": f"Bearer {TOKEN}", "X-Chunkd-Peer": victim}
    for state in ("replicated", "remote"):
        request = urllib.request.Request(
            f"{holder.url}/v1/peer/replicas/saves?save=zz&saver={victim}"
            f"&seq={1 << 62}&state={state}",
            method="POST",
            headers=auth,
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        refused.value.close()
        assert refused.value.code == 401
    blob = os.urandom(MiB)
    pushed = f"/v1/peer/replicas/ckpt/{ChunkId.of(blob)}?save=zz&saver={victim}&seq=1"
    with socket.create_connection((holder.host, holder.port), timeout=10) as sock:
        sock.sendall(
            f"PUT {pushed} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"X-Chunkd-Peer: {victim}\r\nContent-Length: {MiB}\r\n"
            "Expect: 100-continue\r\n\r\n".encode()
        )
        assert sock.recv(65536).split(b" ", 2)[1] == b"401"
    assert holder.metric("chunkd_replica_bytes") == 2 * MiB  # nothing let go, nothing added


@pytest.mark.timeout(90)
def test_a_save_not_yet_committed_never_lets_the_last_committed_go(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    cluster = Cluster(start_daemon, tmp_path, bucket, s3_proxy, ["a", "b", "c"])
    saver = cluster.nodes[0]
    with cluster.client(0) as client:
        ckpt.save(state_of(10, 2), "ckpt/dcp/step-1", replicas=1, client=client)
        first = part_chunks(ckpt.manifest("ckpt/dcp/step-1", client=client))
        # commit "none" (every torch DCP save): the part is remote, the save is not
        # committed until the trainer's ckpt_commit.
        handle = ckpt.async_save(
            state_of(11, 2), "ckpt/dcp/step-2", replicas=1, client=client, _commit="none"
        )
        deadline = time.monotonic() + 30
        while saver.metric("chunkd_checkpoint_saves_total", outcome="committed") < 2:
            assert time.monotonic() < deadline, "the second part never went in"
            time.sleep(0.1)
        assert handle.wait(10)
        assert handle.replicas is not None
        assert handle.replicas["outcome"] == "full"
        # step-1's replicas stay beside step-2's: step-2 is not committed.
        assert sum(n.metric("chunkd_replica_bytes") for n in cluster.nodes) == 4 * MiB
        holders = [n for n in cluster.nodes[1:] if held(n, first[0]) is not None]
        assert holders
        ckpt.commit("ckpt/dcp/step-2", handle.save_id, 1, client=client)
    deadline = time.monotonic() + 30
    while sum(n.metric("chunkd_replica_bytes") for n in cluster.nodes) != 2 * MiB:
        assert time.monotonic() < deadline, "step-1's replicas were never let go"
        time.sleep(0.2)


@pytest.mark.timeout(90)
def test_two_ranks_parts_of_one_save_from_one_node_are_all_held(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    cluster = Cluster(start_daemon, tmp_path, bucket, s3_proxy, ["a", "b"])
    saver, target = cluster.nodes

    def save_two_parts(name: str, seed: int) -> list[str]:
        save_id = f"{name.rpartition('/')[2]}-{seed}"
        with cluster.client(0) as client:
            # Rank 0's part is pushed first; rank 1's later (both on this node).
            first = ckpt.async_save(
                state_of(seed, 2),
                name,
                replicas=1,
                rank=0,
                world_size=2,
                save_id=save_id,
                client=client,
            )
            assert first.wait(30, level="replicated")
            second = ckpt.async_save(
                state_of(seed + 1, 2),
                name,
                replicas=1,
                rank=1,
                world_size=2,
                save_id=save_id,
                client=client,
            )
            assert first.wait(60)
            assert second.wait(60)
            assert first.replicas is not None
            assert second.replicas is not None
            assert first.replicas["outcome"] == second.replicas["outcome"] == "full"
            manifest = ckpt.manifest(name, client=client)
        return part_chunks(manifest, 0) + part_chunks(manifest, 1)

    chunks = save_two_parts("ckpt/ranks/step-1", 1)
    deadline = time.monotonic() + 10
    while saver.metric("chunkd_replica_pushes_total", outcome="ok") < len(chunks):
        assert time.monotonic() < deadline, "the pushes never ended"
        time.sleep(0.1)
    time.sleep(0.5)  # the notes of both parts are in
    for cid in chunks:  # both ranks' parts on the target, none let go by the other's notes
        assert held(target, cid) is not None
    assert target.metric("chunkd_replica_bytes") == 4 * MiB
    later = save_two_parts("ckpt/ranks/step-2", 3)
    deadline = time.monotonic() + 10
    while target.metric("chunkd_replica_bytes") != 4 * MiB:  # step-2's parts alone
        assert time.monotonic() < deadline, "step-1's replicas were never let go"
        time.sleep(0.2)
    for cid in later:
        assert held(target, cid) is not None
    assert saver.metric("chunkd_replica_pushes_total", outcome="late") == 0
    assert target.metric("chunkd_replica_received_total", outcome="refused") == 0


@pytest.mark.timeout(90)
def test_a_dcp_saves_look_for_its_commit_is_one_per_save_and_cheap(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    cluster = Cluster(start_daemon, tmp_path, bucket, s3_proxy, ["a", "b"])
    saver, target = cluster.nodes

    def sent(op: str) -> float:
        return saver.metric("chunkd_backend_requests_total", op=op)

    with cluster.client(0) as client:
        ckpt.save(state_of(20, 2), "ckpt/look/step", replicas=1, client=client)
        gets = sent("get")
        # Two ranks' parts of a DCP save (commit "none") over the committed one.
        handles = [
            ckpt.async_save(
                state_of(21 + rank, 2),
                "ckpt/look/step",
                overwrite=True,
                replicas=1,
                rank=rank,
                world_size=2,
                save_id="look-2",
                client=client,
                _commit="none",
            )
            for rank in range(2)
        ]
        for handle in handles:
            assert handle.wait(30)
        time.sleep(5)  # two poll intervals and more
        # One look for the save, not one per part; the manifest (the previous save's)
        # read once, then only HEADs while it stays the same.
        assert sent("get") - gets == 1
        ckpt.commit("ckpt/look/step", "look-2", 2, overwrite=True, client=client)
        deadline = time.monotonic() + 15
        while target.metric("chunkd_replica_bytes") != 4 * MiB:  # look-2's parts alone
            assert time.monotonic() < deadline, "the first save's replicas were never let go"
            time.sleep(0.2)

        # A save never committed stops looking once a later save of the node is.
        never = ckpt.async_save(
            state_of(30, 2), "ckpt/look/never", replicas=1, client=client, _commit="none"
        )
        assert never.wait(30)
        ckpt.save(state_of(31, 2), "ckpt/look/later", replicas=1, client=client)
        time.sleep(2.5)  # the look's next turn sees it
        heads = sent("head")
        time.sleep(4.5)
        assert sent("head") == heads


@pytest.mark.timeout(60)
def test_pushes_a_target_does_not_keep_are_counted_late_not_ok(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    cluster = Cluster(start_daemon, tmp_path, bucket, s3_proxy, ["a", "b"])
    saver, target = cluster.nodes
    # The target saw a save of this saver whole with a far larger seq (as after the
    # saver's clock stepped back): every push of the next save is answered kept: false.
    request = urllib.request.Request(
        f"{target.url}/v1/peer/replicas/saves?save=ahead&saver={cluster.address(0)}"
        f"&seq={1 << 62}&state=remote",
        method="POST",
        headers={"Authorization": f"Bearer {TOKEN}", "X-Chunkd-Peer": cluster.address(0)},
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200
    with cluster.client(0) as client:
        handle = ckpt.save(state_of(40, 2), "ckpt/late/step-1", replicas=1, client=client)
    assert handle.replicas is not None
    assert handle.replicas["outcome"] == "none"  # not "full": no copy was kept
    assert handle.replicas["whole"] == 0
    late = saver.metric("chunkd_replica_pushes_total", outcome="late")
    assert late >= 1  # then the target is skipped (pushes already on the way come too)
    assert late == target.metric("chunkd_replica_received_total", outcome="refused")
    assert saver.metric("chunkd_replica_pushes_total", outcome="ok") == 0
    assert target.metric("chunkd_replica_bytes") == 0


@pytest.mark.timeout(60)
def test_an_old_client_is_never_told_the_level_replicated(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    cluster = Cluster(start_daemon, tmp_path, bucket, s3_proxy, ["a", "b"], replicas=1)
    saver = cluster.nodes[0]
    s3_proxy.down()  # the save stays short of remote, its pushes over: replicated
    down = True
    try:
        with cluster.client(0) as client:
            # What an older client sends: no replicas (the daemon's default, 1, applies).
            handle = ckpt.async_save(state_of(12, 2), "ckpt/old/step-1", client=client)
            deadline = time.monotonic() + 30
            while saver.metric("chunkd_replica_saves_total", outcome="full") < 1:
                assert time.monotonic() < deadline, "the pushes never ended"
                time.sleep(0.1)
            old = client.request(
                "ckpt_wait", {"job": handle.job_id, "level": "remote", "timeout": 0.2}
            )
            new = client.request(
                "ckpt_wait", {"job": handle.job_id, "level": "replicated", "timeout": 0.2}
            )
            old.close()
            new.close()
            assert old.header["durability"] in ("staged", "local", "remote")
            assert old.header["durability"] == "local"
            assert new.header["durability"] == "replicated"
            s3_proxy.up()
            down = False
            assert handle.result(60).durability == "remote"
    finally:
        if down:
            s3_proxy.up()
