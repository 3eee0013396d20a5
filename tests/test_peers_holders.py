"""Holders serve (issue 29): an owner sends a hot chunk to a few askers and names
them to the later ones; holder lists are bounded and expire; only members are ever
named; a holder that lies is caught and dropped; requests to one peer are bounded."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web

from chunkd.cache import ChunkId
from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.gateway.peers import rank_owners
from chunkd.gateway.peers.holders import MAX_CHUNKS, MAX_HOLDERS_PER_CHUNK, Holders
from chunkd.testing import CountingProxy, S3Server, free_port
from tests.conftest import Daemon
from tests.test_peers import TOKEN, load_everywhere, node_toml, serving

KiB = 1 << 10
CHUNK = 256 * KiB
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def cid(n: int) -> ChunkId:
    return ChunkId.of(n.to_bytes(8, "big"))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the owner's list, alone -----------------------------------------------------------


@pytest.mark.timeout(10)
def test_an_owner_serves_fanout_copies_then_names_the_holders_with_fewest_askers() -> None:
    holders = Holders(fanout=2, ttl=600)
    c = cid(1)
    assert holders.answer(c, "a:1") == []  # served: 1 copy
    assert holders.answer(c, "b:1") == []  # served: 2 copies
    # Only the first named holder counts an asker (the others are fallbacks).
    assert holders.answer(c, "c:1") == ["a:1", "b:1"]
    assert holders.answer(c, "d:1") == ["a:1", "b:1", "c:1"]  # a full after this
    assert holders.holders(c) == [("a:1", 2), ("b:1", 0), ("c:1", 0), ("d:1", 0)]
    # Never the asker itself, at most three, each below the fan-out, fewest first.
    assert holders.answer(c, "c:1") == ["b:1"]  # asks again: a full; d came after it
    assert holders.answer(c, "e:1") == ["b:1", "c:1", "d:1"]  # b full after this
    assert holders.answer(c, "f:1") == ["c:1", "d:1", "e:1"]
    assert holders.holders(c) == [
        ("a:1", 2),
        ("b:1", 2),
        ("c:1", 1),
        ("d:1", 0),
        ("e:1", 0),
        ("f:1", 0),
    ]
    # The asker's holders failed: served, and the bad ones are forgotten.
    assert holders.answer(c, "g:1", direct=True, bad=["e:1", "nobody:1"]) == []
    assert [a for a, _ in holders.holders(c)] == ["a:1", "b:1", "c:1", "d:1", "f:1", "g:1"]
    # No holder has room: the owner serves.
    full = Holders(fanout=1, ttl=600)
    assert full.answer(c, "a:1") == []
    assert full.answer(c, "b:1") == ["a:1"]
    assert full.answer(c, "a:1") == []  # asks again: nobody before it, served
    assert full.answer(c, "c:1") == ["b:1"]
    assert full.answer(c, "d:1") == ["c:1"]
    # A caller that is not a member (None) is answered but never added.
    assert full.answer(c, None) == ["d:1"]
    assert full.answer(c, "e:1") == []  # each holder had its asker
    assert [a for a, _ in full.holders(c)] == ["a:1", "b:1", "c:1", "d:1", "e:1"]


@pytest.mark.timeout(10)
def test_a_node_that_asks_again_is_sent_only_to_holders_added_before_it() -> None:
    # Two nodes that ask again must never be sent to each other: each would wait on
    # the other's fetch (review 1, finding 1).
    holders = Holders(fanout=4, ttl=600)
    c = cid(2)
    for owner_copy in ("o1:1", "o2:1", "o3:1", "o4:1"):
        assert holders.answer(c, owner_copy) == []
    assert holders.answer(c, "A:1") == ["o1:1", "o2:1", "o3:1"]
    # Only o1 (named first) counted A: o2-o4 have fewer askers now.
    assert holders.answer(c, "B:1") == ["o2:1", "o3:1", "o4:1"]
    for _ in range(6):  # again and again: A is never sent to B, nor B to itself
        assert "B:1" not in holders.answer(c, "A:1")
        assert "B:1" not in holders.answer(c, "B:1")
    assert holders.answer(c, "o1:1") == []  # the first holder has none before it


@pytest.mark.timeout(10)
def test_holder_lists_are_bounded_per_chunk_and_in_chunks() -> None:
    holders = Holders(fanout=1, ttl=600)
    c = cid(2)
    for n in range(MAX_HOLDERS_PER_CHUNK + 8):
        holders.answer(c, f"10.0.0.{n}:8470")
    listed = holders.holders(c)
    assert len(listed) == MAX_HOLDERS_PER_CHUNK
    assert listed[-1][0] == f"10.0.0.{MAX_HOLDERS_PER_CHUNK + 7}:8470"  # the newest kept
    # Past 65,536 chunks the least recently asked is forgotten first.
    sizes: list[int] = []
    many = Holders(fanout=1, ttl=600, on_size=sizes.append)
    first, second = cid(-1 & 0xFFFF_FFFF), cid(0xFFFF_FFFE)
    many.answer(first, "a:1")
    many.answer(second, "a:1")
    for n in range(MAX_CHUNKS - 2):
        many.answer(cid(n), "a:1")
    assert len(many) == MAX_CHUNKS
    many.answer(first, "b:1")  # asked again: now the most recent
    many.answer(cid(MAX_CHUNKS), "a:1")
    assert len(many) == MAX_CHUNKS
    assert many.holders(second) == []  # forgotten
    assert [a for a, _ in many.holders(first)] == ["a:1", "b:1"]
    assert sizes[-1] == MAX_CHUNKS  # the gauge follows


@pytest.mark.timeout(10)
def test_holders_expire_after_the_ttl() -> None:
    clock = Clock()
    holders = Holders(fanout=1, ttl=60, clock=clock)
    c = cid(3)
    holders.answer(c, "a:1")
    clock.now += 40
    assert holders.answer(c, "b:1") == ["a:1"]
    clock.now += 30  # a was added 70 s ago, b 30 s ago
    assert [a for a, _ in holders.holders(c)] == ["b:1"]
    clock.now += 61  # the chunk was not asked for a ttl: forgotten with its copies sent
    assert holders.answer(c, "c:1") == []
    assert [a for a, _ in holders.holders(c)] == ["c:1"]


# -- an owner among daemons ------------------------------------------------------------


def holder_toml(
    tmp_path: Path,
    bucket: str,
    proxy: CountingProxy,
    name: str,
    port: int,
    members: list[int],
    fanout: int = 1,
    **peers: Any,
) -> str:
    text = node_toml(tmp_path, bucket, proxy, name, port, members)
    more = "".join(f"{k} = {v}\n" for k, v in peers.items())
    text = text.replace("[peers]\n", f"[peers]\nholder_fanout = {fanout}\n{more}")
    return text.replace("[cache]\n", f"[cache]\nchunk_bytes = {CHUNK}\n")


def state_of(seed: int, tensors: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(256, 256, generator=g) for i in range(tensors)}  # 256 KiB


def chunks_of(manifest: dict[str, Any]) -> dict[str, int]:
    return {
        c: int(n)
        for part in manifest["parts"]
        for seg in part["segments"]
        for c, n in seg["chunks"]
    }


def ask(
    node: Daemon, path: str, peer: str | None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    sent = dict(AUTH) | ({"X-Chunkd-Peer": peer} if peer else {}) | (headers or {})
    return node.get(path, sent)


def start(
    start_daemon: Callable[..., Daemon], toml: str, cwd: Path, port: int, **kw: Any
) -> Daemon:
    return start_daemon(
        toml, cwd=cwd, env={"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{port}"}, port=port, **kw
    )


@pytest.mark.timeout(60)
def test_an_owner_names_only_members_and_refuses_bad_requests(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    port = free_port()
    # Members that never run: the owner's lists need no health, only membership.
    a, b, c, d, e = (f"127.0.0.1:{free_port()}" for _ in range(5))
    ports = [port, *(int(m.rsplit(":", 1)[1]) for m in (a, b, c, d, e))]
    node = start(
        start_daemon,
        holder_toml(tmp_path, bucket, s3_proxy, "owner", port, ports, fanout=2),
        tmp_path / "owner",
        port,
    )
    state = state_of(7, 1)
    with Client(node.cwd / "chunkd.sock") as client:
        ckpt.save(state, "ckpt/own/1", client=client)
        manifest = ckpt.manifest("ckpt/own/1", client=client)
    chunk = next(iter(chunks_of(manifest)))
    plain = f"/v1/peer/chunks/ckpt/{chunk}"
    path = f"{plain}?holders=1"  # the asker follows a 300
    stranger = "203.0.113.9:8470"
    assert ask(node, path, a)[0] == 200  # served: 1
    assert ask(node, path, stranger)[0] == 200  # served: 2, never a holder
    got = ask(node, path, b)
    assert got[0] == 300
    assert got[2] == b""
    assert got[1]["X-Chunkd-Holders"] == a
    # An asker that does not say it follows a 300 (a daemon of the previous release)
    # is served although a has room, and never named a holder (see below).
    got = ask(node, plain, e)
    assert got[0] == 200
    assert ChunkId.of(got[2]) == ChunkId.parse(chunk)
    assert ask(node, path, c)[1]["X-Chunkd-Holders"] == f"{a}, {b}"
    assert ask(node, path, stranger)[1]["X-Chunkd-Holders"] == f"{b}, {c}"
    # bad= naming strangers changes nothing; more than three is refused.
    listed = ask(node, f"{path}&direct=1&bad={stranger}&bad=198.51.100.1:1", d)
    assert listed[0] == 200
    assert ChunkId.of(listed[2]) == ChunkId.parse(chunk)
    bad4 = "&".join(f"bad=127.0.0.1:{p}" for p in range(1, 5))
    status, _, body = ask(node, f"{path}&direct=1&{bad4}", d)
    assert (status, json.loads(body)["error"]) == (400, "InvalidRequestError")
    # The owner drops bad holders that are: c is never named again.
    assert ask(node, f"{path}&direct=1&bad={c}", d)[0] == 200
    # (b was counted once above: only the first named one is.)
    assert ask(node, path, stranger)[1]["X-Chunkd-Holders"] == f"{b}, {d}"
    # A huge X-Chunkd-Peer (within the head's bound) is no member: answered, not kept.
    assert ask(node, path, "x" * 2000)[1]["X-Chunkd-Holders"] == f"{d}"
    assert "x" * 40 not in node.get("/metrics")[2].decode()
    # A holder request for a chunk not held answers 404 at once, fetching nothing.
    s3_proxy.reset()
    missing = "/v1/peer/chunks/ckpt/" + "ab" * 32 + "?held=1&wait=1"
    started = time.monotonic()
    status, _, body = ask(node, missing, a)
    assert (status, json.loads(body)["error"]) == (404, "NotHeld")
    assert time.monotonic() - started < 1.5  # no fetch in flight: no wait
    assert s3_proxy.bytes_down == 0
    # Without the token: 401, whatever the query.
    status, _, body = node.get(f"{plain}?held=1&wait=1", {"X-Chunkd-Peer": a})
    assert status == 401
    # A held=1 answer is counted in the role the asker names, as the asker counts it.
    got = ask(node, f"{plain}?held=1&role=replica", c)
    assert got[0] == 200
    assert node.metric(
        "chunkd_peer_role_bytes_total", peer=c, direction="out", role="replica"
    ) == len(got[2])
    assert node.metric("chunkd_peer_holder_answers_total", answer="holders") == 5
    assert node.metric("chunkd_peer_holder_answers_total", answer="direct") == 2
    assert node.metric("chunkd_peer_role_bytes_total", peer=a, direction="out", role="owner") > 0
    assert node.metric("chunkd_peer_holders_tracked") == 1
    stats = json.loads(node.get("/v1/stats")[2])["peers"]
    mine = {m["address"]: m for m in stats["members"]}
    assert mine[a]["served"]["owner"] == len(listed[2])
    assert mine[d]["served"]["owner"] == 2 * len(listed[2])
    assert stranger not in mine
    assert "Traceback" not in node.log.read_text()


def cold_cluster(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    bucket: str,
    proxy: CountingProxy,
    state: dict[str, torch.Tensor],
    name: str,
    count: int,
    **peers: Any,
) -> tuple[list[Daemon], dict[str, Any]]:
    """Save ``state`` as ``name`` through a node of its own, then start ``count``
    nodes that never saw its chunks, all up in each other's view."""
    port = free_port()
    saver = start(
        start_daemon,
        holder_toml(tmp_path, bucket, proxy, "saver", port, [port]),
        tmp_path / "saver",
        port,
    )
    with Client(saver.cwd / "chunkd.sock") as client:
        ckpt.save(state, name, client=client)
        manifest = ckpt.manifest(name, client=client)
    saver.stop()
    ports = [free_port() for _ in range(count)]
    nodes = [
        start(
            start_daemon,
            holder_toml(tmp_path, bucket, proxy, f"n{i}", p, ports, **peers),
            tmp_path / f"n{i}",
            p,
        )
        for i, p in enumerate(ports)
    ]
    deadline = time.monotonic() + 20
    while any(n.metric("chunkd_peer_healthy") < count for n in nodes):
        assert time.monotonic() < deadline, "the nodes never all saw each other up"
        time.sleep(0.1)
    return nodes, manifest


@pytest.mark.timeout(90)
def test_five_nodes_restore_through_holders_with_one_backend_read_per_chunk(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    state = state_of(11, 48)  # 12 MiB, 48 chunks
    n = 5
    nodes, manifest = cold_cluster(
        start_daemon, tmp_path, bucket, s3_proxy, state, "ckpt/holders/1", n, fanout=1
    )
    s3_proxy.reset()
    for result in load_everywhere(nodes, "ckpt/holders/1"):
        assert not isinstance(result, Exception), result
        assert all(torch.equal(result[k], state[k]) for k in state)
    chunks = chunks_of(manifest)
    size = sum(chunks.values())
    # Each chunk left the backend once for the cluster (plus each node's JSON).
    assert size <= s3_proxy.bytes_down <= 1.05 * size + n * 64 * KiB
    members = [f"127.0.0.1:{node.port}" for node in nodes]
    owned = dict.fromkeys(members, 0)
    for c, length in chunks.items():
        owned[rank_owners(members, bytes.fromhex(c))[0]] += length

    def total(node: Daemon, **labels: str) -> float:
        return node.metric("chunkd_peer_role_bytes_total", **labels)

    # Owners named holders; nodes served chunks they did not own, as holders.
    assert sum(m.metric("chunkd_peer_holder_answers_total", answer="holders") for m in nodes) > 0
    assert sum(total(m, direction="out", role="holder") for m in nodes) > 0
    received = sum(total(m, direction="in") for m in nodes)
    served = sum(total(m, direction="out") for m in nodes)
    assert received == served >= (n - 1) * size - sum(owned.values())  # all by role
    assert received >= (n - 1) * size * 0.99
    # The busiest owner served less than N-1 copies of its share: today's design
    # (owners only) serves exactly that.
    ratios = [
        total(node, direction="out", role="owner") / ((n - 1) * owned[address])
        for node, address in zip(nodes, members, strict=True)
        if owned[address]
    ]
    assert max(ratios) < 1, ratios
    assert sum(m.metric("chunkd_peer_integrity_failures_total") for m in nodes) == 0
    # /v1/stats gives the same per member and role, for the dashboard.
    for node in nodes:
        members_stats = json.loads(node.get("/v1/stats")[2])["peers"]["members"]
        for way, direction in (("received", "in"), ("served", "out")):
            for role in ("owner", "holder", "replica"):
                assert sum(m[way][role] for m in members_stats) == total(
                    node, direction=direction, role=role
                )


@pytest.mark.timeout(60)
def test_an_asker_follows_only_member_holders_within_its_bound_per_peer(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    # A peer that is not chunkd owns part of the chunks: it answers every request
    # slowly, with 300 naming a stranger (not a member) first in a long header, and
    # 404 to direct=1. The stranger (a real server) must never be asked, the asker
    # must fall back to the owner and then the backend, and never have more than
    # per_peer_requests requests at the owner at once.
    port, owner_port, stranger_port = free_port(), free_port(), free_port()
    owner, stranger = f"127.0.0.1:{owner_port}", f"127.0.0.1:{stranger_port}"
    seen: dict[str, Any] = {"now": 0, "most": 0, "plain": [], "direct": [], "stranger": 0}
    header = ", ".join([stranger, *(f"198.18.{i // 250}.{i % 250}:8470" for i in range(400))])
    assert len(header) > 6000

    async def chunk(request: web.Request) -> web.Response:
        seen["now"] += 1
        seen["most"] = max(seen["most"], seen["now"])
        try:
            await asyncio.sleep(0.05)
        finally:
            seen["now"] -= 1
        if request.query.get("direct") == "1":
            seen["direct"].append(request.query.getall("bad", []))
            return web.json_response({"error": "NotFound"}, status=404)
        seen["plain"].append(request.match_info["id"])
        return web.Response(status=300, headers={"X-Chunkd-Holders": header})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def strange(request: web.Request) -> web.Response:
        seen["stranger"] += 1
        return web.Response(body=b"")

    fake = web.Application()
    fake.router.add_get("/v1/peer/chunks/{backend}/{id}", chunk)
    fake.router.add_get("/healthz", healthz)
    lone = web.Application()
    lone.router.add_get("/{tail:.*}", strange)
    state = state_of(12, 40)  # 40 chunks
    with serving(fake, owner_port), serving(lone, stranger_port):

        def node(name: str) -> Daemon:
            toml = holder_toml(
                tmp_path, bucket, s3_proxy, name, port, [port, owner_port], per_peer_requests=2
            )
            return start(start_daemon, toml, tmp_path / name, port)

        saver = node("first")
        with Client(saver.cwd / "chunkd.sock") as client:
            ckpt.save(state, "ckpt/strange/1", client=client)
            manifest = ckpt.manifest("ckpt/strange/1", client=client)
        saver.stop()
        asker = node("cold")
        deadline = time.monotonic() + 20
        while asker.metric("chunkd_peer_healthy") < 2:
            assert time.monotonic() < deadline, "the node never saw the owner up"
            time.sleep(0.1)
        with Client(asker.cwd / "chunkd.sock") as client:
            back = ckpt.load("ckpt/strange/1", client=client)
    assert all(torch.equal(back[k], state[k]) for k in state)
    members = [f"127.0.0.1:{port}", owner]
    theirs = [c for c in chunks_of(manifest) if rank_owners(members, bytes.fromhex(c))[0] == owner]
    assert len(theirs) >= 8
    assert sorted(seen["plain"]) == sorted(theirs)  # each asked once, then direct=1
    assert seen["direct"] == [[]] * len(theirs)  # no holder was asked, none is bad
    assert seen["stranger"] == 0
    assert seen["most"] == 2  # pipelined, and bounded per peer
    assert asker.metric("chunkd_peer_requests_total", peer=owner, outcome="holders") == len(theirs)
    assert asker.metric("chunkd_peer_requests_total", outcome="error") == 0


@pytest.mark.timeout(60)
def test_a_holder_request_waits_while_the_holders_fetch_progresses(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    # A node restoring with a window of many chunks receives each slowly: a holder
    # request waits on its fetch as long as that fetch receives bytes (here 6 s, three
    # times the 2 s timeout), and gives up only on a fetch silent for a timeout.
    state = state_of(21, 16)
    port = free_port()
    saver = start(
        start_daemon,
        holder_toml(tmp_path, bucket, s3_proxy, "saver", port, [port]),
        tmp_path / "saver",
        port,
    )
    with Client(saver.cwd / "chunkd.sock") as client:
        ckpt.save(state, "ckpt/slow/1", client=client)
        chunks = list(chunks_of(ckpt.manifest("ckpt/slow/1", client=client)))
    data = {c: ask(saver, f"/v1/peer/chunks/ckpt/{c}?held=1", None)[2] for c in chunks}
    saver.stop()
    while True:  # an owner port that owns two chunks at least
        slow_port = free_port()
        members = [f"127.0.0.1:{port}", f"127.0.0.1:{slow_port}"]
        owned = [c for c in chunks if rank_owners(members, bytes.fromhex(c))[0] == members[1]]
        if len(owned) >= 2:
            break
    dribbled, silent = owned[:2]
    began = {dribbled: threading.Event(), silent: threading.Event()}

    async def chunk(request: web.Request) -> web.StreamResponse:
        c = request.match_info["id"]
        response = web.StreamResponse()
        response.content_length = len(data[c])
        await response.prepare(request)
        if c in began:
            began[c].set()
        if c == dribbled:  # 16 pieces, 0.4 s apart
            piece = len(data[c]) // 16
            for i in range(16):
                await asyncio.sleep(0.4)
                await response.write(data[c][i * piece : (i + 1) * piece])
        else:
            if c == silent:  # nothing for 6 s, then all of it
                await asyncio.sleep(6)
            await response.write(data[c])
        await response.write_eof()
        return response

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    def restored(node: Daemon) -> dict[str, torch.Tensor]:
        with Client(node.cwd / "chunkd.sock") as client:
            return ckpt.load("ckpt/slow/1", client=client)

    app = web.Application()
    app.router.add_get("/v1/peer/chunks/{backend}/{id}", chunk)
    app.router.add_get("/healthz", healthz)
    with serving(app, slow_port):
        node = start(
            start_daemon,
            holder_toml(tmp_path, bucket, s3_proxy, "node", port, [port, slow_port]),
            tmp_path / "node",
            port,
        )
        deadline = time.monotonic() + 20
        while node.metric("chunkd_peer_healthy") < 2:
            assert time.monotonic() < deadline, "the node never saw its peer up"
            time.sleep(0.1)
        with ThreadPoolExecutor(3) as pool:
            restore = pool.submit(restored, node)
            assert all(e.wait(20) for e in began.values())
            asks = {
                c: pool.submit(ask, node, f"/v1/peer/chunks/ckpt/{c}?held=1&wait=1", None)
                for c in began
            }
            status, _, body = asks[dribbled].result()
            assert (status, body) == (200, data[dribbled])  # 6 s, never silent for 2
            status, _, body = asks[silent].result()
            assert (status, json.loads(body)["error"]) == (404, "NotHeld")  # silent: given up
            back = restore.result()
        assert all(torch.equal(back[k], state[k]) for k in state)
        assert "Traceback" not in node.log.read_text()


@pytest.mark.timeout(60)
def test_a_holder_request_never_waits_for_a_turn_and_one_not_sent_is_not_bad(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    # Two members that are not chunkd: an owner F that names holder H for every chunk
    # (and answers direct=1 404), and H, which answers each holder request slowly
    # (404: as a holder whose wait ran out). A holder request that waited for a turn
    # could chain holder waits across nodes in a circle (review 1, finding 2): one
    # finding no turn free is not sent, and H is not reported bad for it.
    port, f_port, h_port = free_port(), free_port(), free_port()
    holder = f"127.0.0.1:{h_port}"
    seen: dict[str, Any] = {"now": 0, "most": 0, "held": 0, "direct": [], "opted": []}

    async def owner_chunk(request: web.Request) -> web.Response:
        if request.query.get("direct") == "1":
            seen["direct"].append(request.query.getall("bad", []))
            return web.json_response({"error": "NotFound"}, status=404)
        seen["opted"].append(request.query.get("holders"))
        return web.Response(status=300, headers={"X-Chunkd-Holders": holder})

    async def holder_chunk(request: web.Request) -> web.Response:
        if request.query.get("wait") != "1":  # asked as the owner of its own chunks
            return web.json_response({"error": "NotFound"}, status=404)
        seen["held"] += 1
        seen["now"] += 1
        seen["most"] = max(seen["most"], seen["now"])
        try:
            await asyncio.sleep(0.3)
        finally:
            seen["now"] -= 1
        return web.json_response({"error": "NotHeld"}, status=404)

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    apps = []
    for handler in (owner_chunk, holder_chunk):
        app = web.Application()
        app.router.add_get("/v1/peer/chunks/{backend}/{id}", handler)
        app.router.add_get("/healthz", healthz)
        apps.append(app)
    members = [port, f_port, h_port]
    state = state_of(14, 40)
    with serving(apps[0], f_port), serving(apps[1], h_port):

        def node(name: str) -> Daemon:
            toml = holder_toml(tmp_path, bucket, s3_proxy, name, port, members, per_peer_requests=1)
            return start(start_daemon, toml, tmp_path / name, port)

        saver = node("first")
        with Client(saver.cwd / "chunkd.sock") as client:
            ckpt.save(state, "ckpt/turns/1", client=client)
        saver.stop()
        asker = node("cold")
        deadline = time.monotonic() + 20
        while asker.metric("chunkd_peer_healthy") < 3:
            assert time.monotonic() < deadline, "the node never saw F and H up"
            time.sleep(0.1)
        with Client(asker.cwd / "chunkd.sock") as client:
            back = ckpt.load("ckpt/turns/1", client=client)
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert set(seen["opted"]) == {"1"}  # the asker says it follows a 300
    assert seen["most"] == 1  # holder requests: per_peer_requests at once
    skipped = asker.metric("chunkd_peer_requests_total", peer=holder, outcome="skipped")
    assert skipped > 0  # the others found no turn and were not sent
    assert seen["held"] + skipped == len(seen["direct"])
    assert seen["direct"].count([holder]) == seen["held"]  # only those asked are bad
    assert seen["direct"].count([]) == skipped
    assert asker.metric("chunkd_peer_requests_total", outcome="error") == 0


@pytest.mark.timeout(60)
def test_holders_that_failed_are_reported_although_a_later_one_gave_the_chunk(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    # O names H then G for its chunks; H (not chunkd) holds nothing (404: it evicted
    # them, or restarted empty), G gives them. The asker tells O that H failed
    # (forget=1), and O stops naming H (review 1, finding 4).
    o_port, a_port, g_port, h_port, z_port = (free_port() for _ in range(5))
    o, a, g, h, z = (f"127.0.0.1:{p}" for p in (o_port, a_port, g_port, h_port, z_port))
    ports = [o_port, a_port, g_port, h_port, z_port]

    async def chunk(request: web.Request) -> web.Response:
        return web.json_response({"error": "NotHeld"}, status=404)

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/v1/peer/chunks/{backend}/{id}", chunk)
    app.router.add_get("/healthz", healthz)
    state = state_of(15, 24)
    with serving(app, h_port):
        owner, asker, good = (
            start(
                start_daemon,
                # Turns enough that no holder request goes unsent for want of one.
                holder_toml(
                    tmp_path, bucket, s3_proxy, name, p, ports, fanout=2, per_peer_requests=64
                ),
                tmp_path / name,
                p,
            )
            for name, p in (("o", o_port), ("a", a_port), ("g", g_port))
        )
        with Client(owner.cwd / "chunkd.sock") as client:
            ckpt.save(state, "ckpt/forget/1", client=client)
            manifest = ckpt.manifest("ckpt/forget/1", client=client)
        deadline = time.monotonic() + 20
        while any(n.metric("chunkd_peer_healthy") != 4 for n in (asker, good)):  # z down
            assert time.monotonic() < deadline, "the nodes never saw each other up"
            time.sleep(0.1)
        healthy = [o, a, g, h]
        owned = [c for c in chunks_of(manifest) if rank_owners(healthy, bytes.fromhex(c))[0] == o]
        assert len(owned) >= 3
        for c in owned:  # H gets O's first copy of each: listed first
            assert ask(owner, f"/v1/peer/chunks/ckpt/{c}?holders=1", h)[0] == 200
        with Client(good.cwd / "chunkd.sock") as client:  # G the second: listed next
            ckpt.load("ckpt/forget/1", client=client)
        with Client(asker.cwd / "chunkd.sock") as client:  # sent to H, then G
            back = ckpt.load("ckpt/forget/1", client=client)
        assert all(torch.equal(back[k], state[k]) for k in state)
        deadline = time.monotonic() + 10  # the notes go in the background
        while asker.metric("chunkd_peer_requests_total", peer=o, outcome="forget") < len(owned):
            assert time.monotonic() < deadline, "the asker never told O all its notes"
            time.sleep(0.1)
    # H was asked as the holder of each of O's chunks (and as the owner of its own).
    assert asker.metric("chunkd_peer_requests_total", peer=h, outcome="http_404") >= len(owned)
    assert asker.metric("chunkd_peer_requests_total", peer=g, outcome="holder") == len(owned)
    assert owner.metric("chunkd_peer_holder_answers_total", answer="direct") == 0
    for c in owned:  # H forgotten; G (and the asker) still named
        status, headers, _ = ask(owner, f"/v1/peer/chunks/ckpt/{c}?holders=1", z)
        assert status == 300
        assert h not in headers["X-Chunkd-Holders"], headers
        assert g in headers["X-Chunkd-Holders"]


@pytest.mark.timeout(60)
def test_a_holder_that_sends_damaged_bytes_is_counted_dropped_and_read_around(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    # L is a member that is not chunkd: it gets chunks from their owner O as any
    # member does, and answers holder requests for them with damaged bytes. A node
    # restoring after it is sent to L by O, catches the damage, tells O (bad=L) and
    # gets the chunk from O; O never names L again for those chunks.
    o_port, a_port, l_port, m_port, z_port = (free_port() for _ in range(5))
    o, a, liar, m, z = (f"127.0.0.1:{p}" for p in (o_port, a_port, l_port, m_port, z_port))
    ports = [o_port, a_port, l_port, m_port, z_port]
    held_asks: list[str] = []

    async def chunk(request: web.Request) -> web.Response:
        if request.query.get("held") == "1":
            held_asks.append(request.match_info["id"])
            return web.Response(body=os.urandom(CHUNK))  # damaged: any other bytes
        return web.json_response({"error": "NotFound"}, status=404)

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/v1/peer/chunks/{backend}/{id}", chunk)
    app.router.add_get("/healthz", healthz)
    state = state_of(13, 24)
    with serving(app, l_port):
        owner, asker = (
            start(
                start_daemon,
                holder_toml(tmp_path, bucket, s3_proxy, name, p, ports, fanout=2),
                tmp_path / name,
                p,
            )
            for name, p in (("o", o_port), ("a", a_port))
        )
        with Client(owner.cwd / "chunkd.sock") as client:
            ckpt.save(state, "ckpt/damaged/1", client=client)
            manifest = ckpt.manifest("ckpt/damaged/1", client=client)
        deadline = time.monotonic() + 20
        while asker.metric("chunkd_peer_healthy") < 3:  # o, a and the liar; m and z never
            assert time.monotonic() < deadline, "the asker never saw the others up"
            time.sleep(0.1)
        healthy = [o, a, liar]
        owned = [c for c in chunks_of(manifest) if rank_owners(healthy, bytes.fromhex(c))[0] == o]
        assert len(owned) >= 4
        for c in owned:  # the liar, then m, get each of O's chunks: O's first two copies
            for member in (liar, m):
                status, _, body = ask(owner, f"/v1/peer/chunks/ckpt/{c}?holders=1", member)
                assert status == 200
                assert ChunkId.of(body) == ChunkId.parse(c)
        with Client(asker.cwd / "chunkd.sock") as client:
            back = ckpt.load("ckpt/damaged/1", client=client)
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert held_asks  # O named the liar (until the asker marked it down)
    assert set(held_asks) <= set(owned)
    failures = asker.metric("chunkd_peer_integrity_failures_total", peer=liar)
    assert failures == len(held_asks)
    assert asker.metric("chunkd_peer_requests_total", peer=liar, outcome="integrity") == failures
    assert asker.metric("chunkd_peer_role_bytes_total", peer=liar) == 0  # nothing kept
    assert owner.metric("chunkd_peer_holder_answers_total", answer="direct") >= len(held_asks)
    for c in held_asks:  # dropped: O names the others with room, never the liar
        status, headers, _ = ask(owner, f"/v1/peer/chunks/ckpt/{c}?holders=1", z)
        assert status == 300
        assert liar not in headers["X-Chunkd-Holders"], headers
        assert a in headers["X-Chunkd-Holders"]


@pytest.mark.timeout(60)
def test_object_chunks_by_locator_are_served_by_their_owner_to_concurrent_readers(
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    bucket: str,
    s3_proxy: CountingProxy,
    s3_server: S3Server,
) -> None:
    # A dataset's readers read the same shard at about the same time: an owner that
    # named holders for objects would name nodes whose read has not finished (review
    # 1, finding 3). The owner always serves object chunks: no 300, no holder asked.
    data = os.urandom(12 * CHUNK)
    s3_server.client().put_object(Bucket=bucket, Key="pre/shards/hot.bin", Body=data)
    ports = [free_port() for _ in range(3)]
    nodes = [
        start(
            start_daemon,
            holder_toml(tmp_path, bucket, s3_proxy, f"n{i}", p, ports, fanout=1),
            tmp_path / f"n{i}",
            p,
        )
        for i, p in enumerate(ports)
    ]
    deadline = time.monotonic() + 20
    while any(n.metric("chunkd_peer_healthy") < 3 for n in nodes):
        assert time.monotonic() < deadline, "the nodes never all saw each other up"
        time.sleep(0.1)
    s3_proxy.reset()

    def read(node: Daemon) -> bytes:
        with Client(node.cwd / "chunkd.sock", timeout=60) as client:
            return bytes(client.read("ckpt/shards/hot.bin"))

    assert read(nodes[0]) == data  # its owners now know the ids of their chunks
    with ThreadPoolExecutor(2) as pool:  # then two at once, each asking every owner
        assert list(pool.map(read, nodes[1:])) == [data, data]
    assert len(data) <= s3_proxy.bytes_down <= len(data) + 64 * KiB  # each chunk once
    for n in nodes:
        assert n.metric("chunkd_peer_holder_answers_total", answer="holders") == 0
        assert n.metric("chunkd_peer_requests_total", outcome="http_404") == 0
        assert n.metric("chunkd_peer_role_bytes_total", role="holder") == 0
        assert n.metric("chunkd_peer_integrity_failures_total") == 0
    served = sum(n.metric("chunkd_peer_role_bytes_total", direction="out") for n in nodes)
    assert served == sum(n.metric("chunkd_peer_role_bytes_total", direction="in") for n in nodes)
    assert served > len(data)  # each of the two later readers got most of it from peers


@pytest.mark.timeout(30)
async def test_the_apart_nodes_probe_round_is_over_at_close(tmp_path: Path) -> None:
    from chunkd.gateway.config import load_config
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.peers import Peers

    async def slow(request: web.Request) -> web.Response:  # a member whose probe hangs
        await asyncio.sleep(3)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/healthz", slow)
    port = free_port()
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    path = tmp_path / "chunkd.toml"
    path.write_text(
        f'[peers]\nself = "127.0.0.1:{free_port()}"\nmembers = ["127.0.0.1:{port}"]\n'
        f'token_file = "{token}"\n[[backends]]\nname = "local"\nurl = "file://{tmp_path}/d"\n'
    )
    peers = Peers(load_config(path, environ={}, cwd=tmp_path).peers, Metrics())
    with serving(app, port):
        await peers.start()
        try:
            client = peers._client
            await client.membership.refresh()
            member = client.membership.get(f"127.0.0.1:{port}")
            assert member is not None
            member.healthy = False
            await client._rejoin_probe()  # a fetch waits a little; the round goes on
            probing = client._rejoin_round
            assert probing is not None
            assert not probing.done()
            await client.close()
            assert probing.done()  # cancelled and awaited, not left on a closed session
            await client._rejoin_probe()  # a fetch during shutdown starts none
            assert client._rejoin_round is None
        finally:
            await peers.close()
