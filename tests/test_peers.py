"""Peer sharing between daemons on loopback: one backend read per chunk for the cluster."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web

from chunkd.cache import ChunkId
from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.gateway.peers import rank_owners
from chunkd.testing import CountingProxy, S3Server, free_port, s3_backend
from tests.conftest import Daemon

TOKEN = "a-shared-secret-for-the-tests"
MiB = 1 << 20


def node_toml(
    tmp_path: Path,
    bucket: str,
    proxy: CountingProxy,
    name: str,
    port: int,
    members: list[int] | None = None,
    members_file: Path | None = None,
) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    listed = ", ".join(f'"127.0.0.1:{p}"' for p in members or [])
    extra = f'members_file = "{members_file}"\n' if members_file else ""
    return f"""
[server]
listen = "127.0.0.1:{port}"
socket = "{tmp_path / name / "chunkd.sock"}"

[cache]
dir = "{tmp_path / name / "cache"}"
ram_bytes = "256MiB"
disk_bytes = "1GiB"
disk_min_free_bytes = 0
fsync = "never"

[peers]
self = "127.0.0.1:{port}"
members = [{listed}]
{extra}token_file = "{token}"
timeout = "2s"
health_interval = "300ms"
down_after = 4
up_after = 1

{s3_backend("ckpt", f"s3://{bucket}/pre", proxy.endpoint, writable=True, retries=1)}"""


def state_of(seed: int, tensors: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(512, 512, generator=g) for i in range(tensors)}  # 1 MiB each


def start_cluster(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    bucket: str,
    proxy: CountingProxy,
    count: int,
) -> list[Daemon]:
    ports = [free_port() for _ in range(count)]
    nodes = [
        start_daemon(
            node_toml(tmp_path, bucket, proxy, f"n{i}", port, ports),
            cwd=tmp_path / f"n{i}",
            env={"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{port}"},
            port=port,
        )
        for i, port in enumerate(ports)
    ]
    # The first nodes saw the later ones down while they started: wait until every
    # node sees every other up, so that they all agree on the owners.
    deadline = time.monotonic() + 20
    while any(n.metric("chunkd_peer_healthy") < count for n in nodes):
        assert time.monotonic() < deadline, "the nodes never all saw each other up"
        time.sleep(0.1)
    return nodes


def restore_cluster(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    bucket: str,
    proxy: CountingProxy,
    state: dict[str, torch.Tensor],
    name: str,
) -> tuple[list[Daemon], dict[str, Any]]:
    """Save ``state`` as ``name`` through a 3-node cluster, then start 3 fresh nodes
    that have never seen its chunks: (those nodes, the committed manifest)."""
    nodes = start_cluster(start_daemon, tmp_path, bucket, proxy, 3)
    with Client(nodes[0].cwd / "chunkd.sock") as client:
        ckpt.save(state, name, client=client)
        manifest = ckpt.manifest(name, client=client)
    for node in nodes:
        node.stop()
    nodes = start_cluster(start_daemon, tmp_path / "again", bucket, proxy, 3)
    time.sleep(0.5)  # a health round
    return nodes, manifest


def load_everywhere(nodes: list[Daemon], name: str) -> list[Any]:
    results: list[Any] = [None] * len(nodes)

    def load(i: int) -> None:
        try:
            with Client(nodes[i].cwd / "chunkd.sock", timeout=60) as client:
                results[i] = ckpt.load(name, client=client)
        except Exception as exc:  # reported below
            results[i] = exc

    threads = [threading.Thread(target=load, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def test_three_nodes_restore_a_checkpoint_with_one_backend_read_per_chunk(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    state = state_of(1)
    nodes, _ = restore_cluster(start_daemon, tmp_path, bucket, s3_proxy, state, "ckpt/fanout/1")
    s3_proxy.reset()
    for result in load_everywhere(nodes, "ckpt/fanout/1"):
        assert not isinstance(result, Exception), result
        assert all(torch.equal(result[k], state[k]) for k in state)
    size = sum(t.numel() * 4 for t in state.values())
    # Each chunk left the backend once for the whole cluster (plus 3 x the JSON).
    assert size <= s3_proxy.bytes_down <= 1.1 * size
    got_from_peers = sum(n.metric("chunkd_peer_bytes_total", direction="in") for n in nodes)
    sent_to_peers = sum(n.metric("chunkd_peer_bytes_total", direction="out") for n in nodes)
    assert got_from_peers == sent_to_peers >= size  # two of three nodes got every chunk
    assert all(n.metric("chunkd_peer_healthy") == 3 for n in nodes)
    # Where each node's reader got its bytes, counted as they were handed out: the
    # whole state on every node; each chunk once from the backend in all (or from its
    # owner's cache, when a peer's request had the owner fetch it first), the rest
    # from peers.
    restored = [
        {
            source: n.metric("chunkd_checkpoint_restored_bytes_total", source=source)
            for source in ("cache", "peer", "backend")
        }
        for n in nodes
    ]
    assert all(sum(r.values()) == pytest.approx(size, rel=0.01) for r in restored), restored
    first = sum(r["backend"] + r["cache"] for r in restored)
    assert 0.99 * size <= first <= 1.1 * size, restored  # as the proxy's count above
    assert sum(r["peer"] for r in restored) == got_from_peers, restored


def test_three_nodes_read_one_cold_object_with_one_backend_read_per_chunk(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    bucket: str,
    s3_proxy: CountingProxy,
    s3_server: S3Server,
) -> None:
    data = os.urandom(24 * MiB)
    s3_server.client().put_object(Bucket=bucket, Key="pre/shards/000.bin", Body=data)
    nodes = start_cluster(start_daemon, tmp_path, bucket, s3_proxy, 3)
    time.sleep(0.5)
    s3_proxy.reset()
    results: list[Any] = [None] * 3

    def read(i: int) -> None:
        with Client(nodes[i].cwd / "chunkd.sock", timeout=60) as client:
            results[i] = bytes(client.read("ckpt/shards/000.bin"))

    threads = [threading.Thread(target=read, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == [data, data, data]
    outcomes = {
        outcome: sum(n.metric("chunkd_peer_requests_total", outcome=outcome) for n in nodes)
        for outcome in ("ok", "error", "integrity", "http_409", "http_404", "http_503")
    }
    # A GET the backend breaks off mid-body (moto does, now and then, on 2 busy
    # cores) is retried, or a span finished chunk by chunk: the partial chunk is read
    # twice. That is the read path's retry, not a second owner.
    logs = [n.log.read_text() for n in nodes]
    broken = sum(text.count("a span GET failed") + text.count("; retry ") for text in logs)
    assert len(data) <= s3_proxy.bytes_down <= 1.05 * len(data) + broken * 4 * MiB, outcomes
    assert sum(n.metric("chunkd_peer_bytes_total", direction="in") for n in nodes) > 0


def test_a_node_killed_mid_restore_costs_no_reader_its_bytes(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    state = state_of(2, tensors=16)
    nodes, _ = restore_cluster(start_daemon, tmp_path, bucket, s3_proxy, state, "ckpt/kill/1")
    s3_proxy.delay = 0.01  # slow enough that the kill lands mid-restore
    results: list[Any] = []
    loader = threading.Thread(
        target=lambda: results.extend(load_everywhere(nodes[:2], "ckpt/kill/1"))
    )
    loader.start()
    time.sleep(0.5)
    nodes[2].process.kill()
    loader.join(timeout=120)
    s3_proxy.delay = 0
    assert len(results) == 2
    for result in results:
        assert not isinstance(result, Exception), result
        assert all(torch.equal(result[k], state[k]) for k in state)


def test_a_hung_node_costs_at_most_one_more_backend_read_of_the_chunks_it_owns(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    state = state_of(3, tensors=16)
    nodes, manifest = restore_cluster(
        start_daemon, tmp_path, bucket, s3_proxy, state, "ckpt/hung/1"
    )
    chunks: dict[bytes, int] = {}
    for part in manifest["parts"]:  # the parts, as the manifest committed them
        for segment in part["segments"]:
            chunks.update((bytes.fromhex(cid), length) for cid, length in segment["chunks"])
    members = [f"127.0.0.1:{n.port}" for n in nodes]
    owns = [0] * len(nodes)
    for cid, size in chunks.items():
        owns[members.index(rank_owners(members, cid)[0])] += size
    # The node that owns the most hangs (the ports are random, and with few chunks
    # a fixed node could own none of them).
    hung_at = owns.index(max(owns))
    owned = owns[hung_at]
    assert owned > 0
    hung, readers = nodes[hung_at], [n for i, n in enumerate(nodes) if i != hung_at]
    s3_proxy.reset()
    # Stopped, not dead: its kernel still accepts connections, nothing answers them.
    os.kill(hung.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        results = load_everywhere(readers, "ckpt/hung/1")
        took = time.monotonic() - started
    finally:
        os.kill(hung.process.pid, signal.SIGCONT)
    for result in results:
        assert not isinstance(result, Exception), result
        assert result is not None, "a restore never finished"
        assert all(torch.equal(result[k], state[k]) for k in state)
    size = sum(chunks.values())
    # The hung node's chunks were read once more, by their next owner, for both
    # readers; the other chunks once. (The manifest and parts: a few KiB per node.)
    logs = [n.log.read_text() for n in readers]
    broken = sum(text.count("a span GET failed") + text.count("; retry ") for text in logs)
    assert size <= s3_proxy.bytes_down <= size + owned + (256 << 10) + broken * 4 * MiB, (
        s3_proxy.bytes_down,
        size,
        owned,
    )
    # Each reader gave up on the hung owner after one silent timeout and a failed
    # probe (2 s + at most 2 s), in parallel for all its chunks: never a wait per chunk.
    assert sum(n.metric("chunkd_peer_requests_total", outcome="error") for n in readers) > 0
    assert took < 60, took  # 4 s here; 10 s when it waited for the probe rounds


@pytest.mark.timeout(90)
def test_a_healed_node_probes_its_peers_before_it_reads_the_backend_for_their_chunks(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    # Node 0 sees its two peers down (stopped), then they come back and every node
    # restores at once. Its probe loop (every 3 s, two passes to be up) would see them
    # up seconds later; meanwhile it owned every chunk and read them all from the
    # backend (the lab's healed node: 1.4-1.9x the checkpoint). It probes first.
    state = state_of(5, tensors=16)
    slow = 'health_interval = "3s"\ndown_after = 2\nup_after = 2\n'

    def toml(tmp: Path, name: str, port: int, ports: list[int]) -> str:
        text = node_toml(tmp, bucket, s3_proxy, name, port, ports)
        return text.replace('health_interval = "300ms"\ndown_after = 4\nup_after = 1\n', slow)

    def cluster(tmp: Path) -> list[Daemon]:
        ports = [free_port() for _ in range(3)]
        nodes = [
            start_daemon(
                toml(tmp, f"n{i}", port, ports),
                cwd=tmp / f"n{i}",
                env={"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{port}"},
                port=port,
            )
            for i, port in enumerate(ports)
        ]
        deadline = time.monotonic() + 30
        while any(n.metric("chunkd_peer_healthy") < 3 for n in nodes):
            assert time.monotonic() < deadline, "the nodes never all saw each other up"
            time.sleep(0.1)
        return nodes

    saver = cluster(tmp_path)
    with Client(saver[0].cwd / "chunkd.sock") as client:
        ckpt.save(state, "ckpt/healed/1", client=client)
        manifest = ckpt.manifest("ckpt/healed/1", client=client)
    for node in saver:
        node.stop()
    size = sum(
        int(n) for part in manifest["parts"] for seg in part["segments"] for _, n in seg["chunks"]
    )
    nodes = cluster(tmp_path / "again")
    time.sleep(6.5)  # two probe rounds: node 0 has seen its peers pass a probe (up)
    for node in nodes[1:]:
        os.kill(node.process.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 40
        while nodes[0].metric("chunkd_peer_healthy") > 1:
            assert time.monotonic() < deadline, "node 0 never saw its peers down"
            time.sleep(0.1)
    finally:
        for node in nodes[1:]:
            os.kill(node.process.pid, signal.SIGCONT)
    s3_proxy.reset()
    for result in load_everywhere(nodes, "ckpt/healed/1"):
        assert not isinstance(result, Exception), result
        assert all(torch.equal(result[k], state[k]) for k in state)
    # Each chunk from the backend about once (plus each node's manifest and parts; a
    # chunk or two asked at the very moment of the heal may be read twice); without
    # the probe, node 0 read every chunk it wanted itself: 1.7-1.9x.
    assert size <= s3_proxy.bytes_down <= 1.2 * size + 3 * 64 * 1024, (s3_proxy.bytes_down, size)
    assert "rejoined" in nodes[0].log.read_text()


@contextlib.contextmanager
def serving(app: web.Application, port: int) -> Iterator[None]:
    """Serve ``app`` on 127.0.0.1:``port`` from a thread of its own (a peer that is
    not chunkd), until the block ends."""
    import asyncio

    ready = threading.Event()
    box: dict[str, Any] = {}

    def serve() -> None:
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        box["loop"], box["runner"] = loop, runner
        ready.set()
        loop.run_forever()
        # Stopped: callbacks still queued (a closed transport's connection_lost, which
        # lets go of its socket) run now, before the loop is closed; left queued, the
        # transports are collected unclosed later and the ResourceWarning fails
        # whichever test runs then.
        loop.run_until_complete(asyncio.sleep(0.05))
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield
    finally:
        loop = box.get("loop")
        if loop is not None:
            asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(10)
            # The closed connections' transports finish closing in the loop's next
            # turns: stopped before them, they are collected unclosed later, and the
            # ResourceWarning fails whichever test runs then.
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0.2), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def test_a_lying_peer_is_caught_and_never_cached(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    bucket: str,
    s3_proxy: CountingProxy,
    s3_server: S3Server,
) -> None:
    liar_port = free_port()
    served = []

    async def lie(request: web.Request) -> web.Response:
        served.append(request.match_info["id"])
        return web.Response(body=os.urandom(4096))

    async def lie_object(request: web.Request) -> web.Response:
        served.append(request.match_info["key"])
        headers = {"X-Chunkd-Chunk": os.urandom(32).hex()}
        return web.Response(body=os.urandom(4096), headers=headers)

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/v1/peer/chunks/{backend}/{id}", lie)
    app.router.add_get("/v1/peer/objects/{backend}/{key:.*}", lie_object)
    app.router.add_get("/healthz", healthz)
    with serving(app, liar_port):
        port = free_port()
        node = start_daemon(
            node_toml(tmp_path, bucket, s3_proxy, "honest", port, [port, liar_port]),
            cwd=tmp_path / "honest",
            env={"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{port}"},
            port=port,
        )
        state = state_of(3)
        with Client(node.cwd / "chunkd.sock") as client:
            ckpt.save(state, "ckpt/liar/step-1", client=client)
            manifest = ckpt.manifest("ckpt/liar/step-1", client=client)
        chunks = [c for seg in manifest["parts"][0]["segments"] for c, _ in seg["chunks"]]
        node.stop()
        while True:  # a port for the reader beside which HRW gives the liar some chunks
            port = free_port()
            members = [f"127.0.0.1:{port}", f"127.0.0.1:{liar_port}"]
            owned_by_liar = [
                c for c in chunks if rank_owners(members, bytes.fromhex(c))[0] == members[1]
            ]
            if owned_by_liar:
                break
        node = start_daemon(  # the same node with an empty cache
            node_toml(tmp_path, bucket, s3_proxy, "honest2", port, [port, liar_port]),
            cwd=tmp_path / "honest2",
            env={"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{port}"},
            port=port,
        )
        time.sleep(0.5)
        with Client(node.cwd / "chunkd.sock") as client:
            back = ckpt.load("ckpt/liar/step-1", client=client)
        assert all(torch.equal(back[k], state[k]) for k in state)
        assert set(owned_by_liar) <= set(served)
        failures = node.metric(
            "chunkd_peer_integrity_failures_total", peer=f"127.0.0.1:{liar_port}"
        )
        assert failures >= len(owned_by_liar)
        # Objects read by locator: the liar states an id its bytes do not hash to.
        data = os.urandom(6 * MiB)  # two chunks
        s3 = s3_server.client()
        members = [f"127.0.0.1:{port}", f"127.0.0.1:{liar_port}"]
        for n in range(64):  # an object one of whose chunks the liar owns
            key = f"objects/lied-{n}.bin"
            etag = s3.put_object(Bucket=bucket, Key=f"pre/{key}", Body=data)["ETag"]
            placements = [f"ckpt\0{key}\0{etag}\0{i}".encode() for i in range(2)]
            if any(rank_owners(members, p)[0] == members[1] for p in placements):
                break
        with Client(node.cwd / "chunkd.sock") as client:
            assert bytes(client.read(f"ckpt/{key}")) == data
        assert key in served
        assert (
            node.metric("chunkd_peer_integrity_failures_total", peer=f"127.0.0.1:{liar_port}")
            > failures
        )


def test_a_peer_cannot_rewrite_a_chunk_map_this_node_knows(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    bucket: str,
    s3_proxy: CountingProxy,
    s3_server: S3Server,
) -> None:
    # A peer that states a consistent id (its bytes do hash to it), but not the one
    # this node's chunk map holds for the locator: its bytes must not be served,
    # stored or recorded.
    port, liar_port = free_port(), free_port()
    members = [f"127.0.0.1:{port}", f"127.0.0.1:{liar_port}"]
    asked: list[str] = []

    async def lie_object(request: web.Request) -> web.Response:
        asked.append(request.match_info["key"])
        body = os.urandom(4 * MiB)
        return web.Response(body=body, headers={"X-Chunkd-Chunk": str(ChunkId.of(body))})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    data = os.urandom(6 * MiB)  # two chunks
    s3 = s3_server.client()
    for n in range(64):  # an object one of whose chunks the liar owns
        key = f"objects/known-{n}.bin"
        etag = s3.put_object(Bucket=bucket, Key=f"pre/{key}", Body=data)["ETag"]
        placements = [f"ckpt\0{key}\0{etag}\0{i}".encode() for i in range(2)]
        if any(rank_owners(members, p)[0] == members[1] for p in placements):
            break

    def toml(peer_ports: list[int]) -> str:
        # RAM only: after a restart the chunk map is known and the chunks are not.
        text = node_toml(tmp_path, bucket, s3_proxy, "node", port, peer_ports)
        return text.replace("[cache]\n", '[cache]\nwrite_policy = "upper-only"\n')

    env = {"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{port}"}
    alone = start_daemon(toml([port]), cwd=tmp_path / "node", env=env, port=port)
    assert alone.get(f"/v1/objects/ckpt/{key}")[2] == data  # the chunk map, from the backend
    assert alone.stop() == 0

    app = web.Application()
    app.router.add_get("/v1/peer/objects/{backend}/{key:.*}", lie_object)
    app.router.add_get("/healthz", healthz)
    with serving(app, liar_port):
        node = start_daemon(toml([port, liar_port]), cwd=tmp_path / "node", env=env, port=port)
        deadline = time.monotonic() + 20
        while node.metric("chunkd_peer_healthy") < 2:
            assert time.monotonic() < deadline, "the node never saw the liar up"
            time.sleep(0.1)
        status, _, body = node.get(f"/v1/objects/ckpt/{key}")
        assert status == 200
        assert body == data
        assert key in asked
        failures = node.metric("chunkd_peer_integrity_failures_total", peer=members[1])
        assert failures >= 1
        assert node.get(f"/v1/objects/ckpt/{key}")[2] == data  # nothing of the liar's kept
        assert node.stop() == 0


def test_peer_routes_want_the_token(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    port = free_port()
    node = start_daemon(
        node_toml(tmp_path, bucket, s3_proxy, "solo", port, [port]),
        cwd=tmp_path / "solo",
        env={"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{port}"},
        port=port,
    )
    path = "/v1/peer/chunks/ckpt/" + "ab" * 32
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        status, _, body = node.get(path, headers)
        assert status == 401
        assert json.loads(body)["error"] == "Unauthorized"
    status, _, _ = node.get(path, {"Authorization": f"Bearer {TOKEN}"})
    assert status == 404  # authorized: the chunk is in no cache and not in the backend
    # the registry's pages, by id: the same door, the same token
    page = "/v1/peer/pages/" + "cd" * 32
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert node.get(page, headers)[0] == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    status, _, body = node.get(page, auth)
    assert status == 404, body  # no such page (this node's registry backend is not set up)
    for bad in ("zz", "../../names", "cd" * 31, "CD" * 32):
        status, _, body = node.get("/v1/peer/pages/" + bad, auth)
        assert status in (400, 404), (bad, status)  # refused by its id, never a 500
        assert json.loads(body)["error"] != "Internal"
    assert node.get(page + "?held=1", auth)[0] == 404  # held only: not in the tiers
    assert "Traceback" not in node.log.read_text()


def test_a_held_only_peer_request_answers_from_the_tiers_and_never_fetches(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    bucket: str,
    s3_server: S3Server,
    s3_proxy: CountingProxy,
) -> None:
    # What a rejoined node's handoff asks (held=1): the chunk if this node holds it,
    # else 404 NotHeld at once, with no backend read made on the asker's behalf.
    port = free_port()
    node = start_daemon(
        node_toml(tmp_path, bucket, s3_proxy, "solo", port, [port]),
        cwd=tmp_path / "solo",
        env={"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{port}"},
        port=port,
    )
    data = bytes(range(256)) * 4096  # 1 MiB, one chunk
    s3_server.client().put_object(Bucket=bucket, Key="pre/held.bin", Body=data)
    status, headers, _ = node.get("/v1/objects/ckpt/held.bin", {"Range": "bytes=0-0"})
    assert status == 206
    version = headers["ETag"]  # an S3 version is its quoted ETag: the same token
    auth = {"Authorization": f"Bearer {TOKEN}"}
    s3_proxy.reset()
    missing = "/v1/peer/chunks/ckpt/" + "ab" * 32 + "?held=1"
    status, _, body = node.get(missing, auth)
    assert (status, json.loads(body)["error"]) == (404, "NotHeld")
    query = f"version={urllib.parse.quote(version)}&index=0"
    status, headers, body = node.get(f"/v1/peer/objects/ckpt/held.bin?{query}&held=1", auth)
    assert (status, body) == (200, data)
    cid = headers["X-Chunkd-Chunk"]
    status, _, body = node.get(f"/v1/peer/chunks/ckpt/{cid}?held=1", auth)
    assert (status, body) == (200, data)
    assert s3_proxy.bytes_down == 0  # all of it from the tiers
    s3_server.client().put_object(Bucket=bucket, Key="pre/cold.bin", Body=data[::-1])
    head = urllib.request.Request(f"{node.url}/v1/objects/ckpt/cold.bin", method="HEAD")
    with urllib.request.urlopen(head, timeout=30) as response:  # a HEAD reads no chunk
        cold = f"version={urllib.parse.quote(response.headers['ETag'])}&index=0"
    s3_proxy.reset()
    status, _, body = node.get(f"/v1/peer/objects/ckpt/cold.bin?{cold}&held=1", auth)
    assert (status, json.loads(body)["error"]) == (404, "NotHeld")
    assert s3_proxy.bytes_down == 0  # not fetched for the asker


@pytest.mark.timeout(60)
def test_a_peer_that_goes_away_mid_body_leaves_no_traceback(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    bucket: str,
    s3_server: S3Server,
    s3_proxy: CountingProxy,
) -> None:
    # An asker that gives up (or is cut off) mid-body: one line at info, no traceback.
    port = free_port()
    toml = node_toml(tmp_path, bucket, s3_proxy, "solo", port, [port])
    node = start_daemon(
        toml.replace("[cache]\n", "[cache]\nchunk_bytes = 16777216\n"),
        cwd=tmp_path / "solo",
        env={"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{port}"},
        port=port,
    )
    data = os.urandom(16 * MiB)  # one chunk, far more than the socket buffers hold
    etag = s3_server.client().put_object(Bucket=bucket, Key="pre/big.bin", Body=data)["ETag"]
    path = f"/v1/peer/objects/ckpt/big.bin?version={urllib.parse.quote(etag)}&index=0"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert node.get(path, auth)[:3:2] == (200, data)  # in the cache now
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
            )
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            # Reset rather than close: the daemon's next write fails at once.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    deadline = time.monotonic() + 10
    while "went away" not in node.log.read_text():
        assert time.monotonic() < deadline, node.log.read_text()[-2000:]
        time.sleep(0.1)
    assert node.get(path, auth)[:3:2] == (200, data)  # still serving
    assert node.stop() == 0
    log = node.log.read_text()
    assert "Traceback" not in log
    assert "Error handling request" not in log


def test_a_rewritten_members_file_is_used_without_a_restart(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    ports = [free_port(), free_port()]
    members = tmp_path / "members"
    members.write_text(f"# from the hostlist\n127.0.0.1:{ports[0]}\n")
    nodes = [
        start_daemon(
            node_toml(tmp_path, bucket, s3_proxy, f"m{i}", port, members_file=members),
            cwd=tmp_path / f"m{i}",
            env={"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{port}"},
            port=port,
        )
        for i, port in enumerate(ports)
    ]

    def stats(node: Daemon) -> dict[str, Any]:
        status, _, body = node.get("/v1/stats")
        assert status == 200
        return json.loads(body)["peers"]

    assert len(stats(nodes[0])["members"]) == 1
    members.write_text(f"127.0.0.1:{ports[0]}\n127.0.0.1:{ports[1]}\n")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and stats(nodes[0])["healthy"] != 2:
        time.sleep(0.1)
    assert stats(nodes[0])["healthy"] == 2
    # ...and the new member is used: a chunk it owns comes from it.
    state = state_of(4)
    with Client(nodes[1].cwd / "chunkd.sock") as client:
        ckpt.save(state, "ckpt/members/step-1", client=client)
        ckpt.load("ckpt/members/step-1", client=client)  # warm on node 1
    with Client(nodes[0].cwd / "chunkd.sock") as client:
        back = ckpt.load("ckpt/members/step-1", client=client)
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert nodes[0].metric("chunkd_peer_bytes_total", direction="in") > 0
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(f"{nodes[0].url}/v1/peer/chunks/ckpt/{'00' * 32}", timeout=5)


def test_members_from_a_dns_name(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    ports = [free_port(), free_port()]
    toml = node_toml(tmp_path, bucket, s3_proxy, "dns", ports[0], [ports[0]])
    toml = toml.replace("[peers]\n", f'[peers]\ndns = "localhost:{ports[1]}"\n')
    node = start_daemon(
        toml,
        cwd=tmp_path / "dns",
        env={"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{ports[0]}"},
        port=ports[0],
    )
    start_daemon(
        node_toml(tmp_path, bucket, s3_proxy, "other", ports[1], ports),
        cwd=tmp_path / "other",
        env={"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{ports[1]}"},
        port=ports[1],
    )
    deadline = time.monotonic() + 10
    healthy: list[str] = []
    while time.monotonic() < deadline:
        _, _, body = node.get("/v1/stats")
        members = json.loads(body)["peers"]["members"]
        healthy = [m["address"] for m in members if m["healthy"]]
        if f"127.0.0.1:{ports[1]}" in healthy:
            break
        time.sleep(0.1)
    assert f"127.0.0.1:{ports[1]}" in healthy


def test_chunkd_stats_shows_the_peers(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    import subprocess
    import sys

    nodes = start_cluster(start_daemon, tmp_path, bucket, s3_proxy, 2)
    chunkd = str(Path(sys.executable).parent / "chunkd")
    shown = subprocess.run(
        [chunkd, "stats", "--url", nodes[0].url], capture_output=True, text=True, check=True
    ).stdout
    assert "peers: 2 of 2 up" in shown
    assert f"127.0.0.1:{nodes[1].port}" in shown
    assert "backend ckpt (s3): ok" in shown
    nodes[1].process.kill()
    deadline = time.monotonic() + 20
    while "DOWN" not in shown:
        assert time.monotonic() < deadline, shown
        time.sleep(0.3)
        shown = subprocess.run(
            [chunkd, "stats", "--url", nodes[0].url], capture_output=True, text=True, check=True
        ).stdout
    assert "peers: 1 of 2 up" in shown


def test_rendezvous_moves_only_the_keys_of_the_member_that_left() -> None:
    members = [f"10.0.0.{i}:8470" for i in range(1, 9)]
    keys = [os.urandom(32) for _ in range(4000)]
    before = {k: rank_owners(members, k)[0] for k in keys}
    gone = members[3]
    after = {k: rank_owners([m for m in members if m != gone], k)[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == gone for k in moved)  # only the departed node's keys move
    assert len(moved) == sum(1 for k in keys if before[k] == gone)
    counts = [sum(1 for k in keys if before[k] == m) for m in members]
    assert min(counts) > 0.7 * len(keys) / len(members)  # spread evenly
    assert max(counts) < 1.3 * len(keys) / len(members)
    joined = {k: rank_owners([*members, "10.0.0.99:8470"], k)[0] for k in keys}
    assert all(joined[k] in (before[k], "10.0.0.99:8470") for k in keys)
