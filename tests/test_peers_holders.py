"""Holders serve (issue 29): an owner sends a hot chunk to a few askers and names
them to the later ones; holder lists are bounded and expire; only members are ever
named; a holder that lies is caught and dropped; requests to one peer are bounded."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from chunkd.cache import ChunkId
from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.gateway.peers.holders import MAX_CHUNKS, MAX_HOLDERS_PER_CHUNK, Holders
from chunkd.testing import CountingProxy, free_port
from tests.conftest import Daemon
from tests.test_peers import TOKEN, node_toml

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
    assert holders.answer(c, "c:1") == ["a:1", "b:1"]  # each named once
    assert holders.answer(c, "d:1") == ["a:1", "b:1", "c:1"]  # a, b full after this
    assert holders.holders(c) == [("a:1", 2), ("b:1", 2), ("c:1", 1), ("d:1", 0)]
    # Never the asker itself, at most three, each below the fan-out, fewest first.
    assert holders.answer(c, "c:1") == ["d:1"]
    assert holders.answer(c, "e:1") == ["c:1", "d:1"]
    assert holders.answer(c, "f:1") == ["e:1"]
    # The asker's holders failed: served, and the bad ones are forgotten.
    assert holders.answer(c, "g:1", direct=True, bad=["e:1", "nobody:1"]) == []
    assert [a for a, _ in holders.holders(c)] == ["a:1", "b:1", "c:1", "d:1", "f:1", "g:1"]
    # No holder has room: the owner serves.
    full = Holders(fanout=1, ttl=600)
    assert full.answer(c, "a:1") == []
    assert full.answer(c, "b:1") == ["a:1"]
    assert full.answer(c, "a:1") == ["b:1"]
    assert full.answer(c, "c:1") == []  # a and b each had their asker
    # A caller that is not a member (None) is answered but never added.
    assert full.answer(c, None) == ["c:1"]
    assert [a for a, _ in full.holders(c)] == ["a:1", "b:1", "c:1"]


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
    a, b, c, d = (f"127.0.0.1:{free_port()}" for _ in range(4))
    ports = [port, *(int(m.rsplit(":", 1)[1]) for m in (a, b, c, d))]
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
    path = f"/v1/peer/chunks/ckpt/{chunk}"
    stranger = "203.0.113.9:8470"
    assert ask(node, path, a)[0] == 200  # served: 1
    assert ask(node, path, stranger)[0] == 200  # served: 2, never a holder
    got = ask(node, path, b)
    assert got[0] == 300
    assert got[2] == b""
    assert got[1]["X-Chunkd-Holders"] == a
    assert ask(node, path, c)[1]["X-Chunkd-Holders"] == f"{a}, {b}"
    assert ask(node, path, stranger)[1]["X-Chunkd-Holders"] == f"{b}, {c}"
    # bad= naming strangers changes nothing; more than three is refused.
    listed = ask(node, f"{path}?direct=1&bad={stranger}&bad=198.51.100.1:1", d)
    assert listed[0] == 200
    assert ChunkId.of(listed[2]) == ChunkId.parse(chunk)
    bad4 = "&".join(f"bad=127.0.0.1:{p}" for p in range(1, 5))
    status, _, body = ask(node, f"{path}?direct=1&{bad4}", d)
    assert (status, json.loads(body)["error"]) == (400, "InvalidRequestError")
    # The owner drops bad holders that are: c is never named again.
    assert ask(node, f"{path}?direct=1&bad={c}", d)[0] == 200
    assert ask(node, path, a)[1]["X-Chunkd-Holders"] == f"{d}"
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
    status, _, body = node.get(f"{path}?held=1&wait=1", {"X-Chunkd-Peer": a})
    assert status == 401
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
