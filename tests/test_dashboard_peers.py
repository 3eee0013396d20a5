"""The peers panel against real daemons on loopback (issue 29): after a restore through
holders (``holder_fanout = 1``) and a save with one replica, the snapshot, the page (in
headless Chromium) and ``chunkd top --once`` each show per peer the bytes it served as
holder and as replica, and the replica budget and use, with the figures ``/metrics``
counts."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.testing import CountingProxy, free_port, s3_backend
from chunkd.testing.browser import chromium, chromium_missing
from tests.conftest import BIN, Daemon

TOKEN = "a-shared-secret-for-the-dashboard"
NODES = 4
BUDGET = 64 << 20
IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"
ROLES = ("owner", "holder", "replica")
SAVES = ("full", "partial", "none")


def _node_toml(
    tmp_path: Path, bucket: str, proxy: CountingProxy, name: str, port: int, ports: list[int]
) -> str:
    (tmp_path / name).mkdir(parents=True, exist_ok=True)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    members = ", ".join(f'"127.0.0.1:{p}"' for p in ports)
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
chunk_bytes = "1MiB"

[peers]
self = "127.0.0.1:{port}"
members = [{members}]
token_file = "{token}"
timeout = "5s"
health_interval = "300ms"
down_after = 4
up_after = 1
holder_fanout = 1
replicas = 1
replica_budget = "{BUDGET >> 20}MiB"

{s3_backend("ckpt", f"s3://{bucket}/dash", proxy.endpoint, writable=True, retries=1)}"""


def _restored(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> tuple[list[Daemon], dict[str, torch.Tensor]]:
    """Four nodes; node 0 saves a checkpoint without replicas and one with one replica,
    then the other three restore each at once: (the nodes, the replicated state)."""
    ports = [free_port() for _ in range(NODES)]
    nodes = [
        start_daemon(
            _node_toml(tmp_path, bucket, s3_proxy, f"n{i}", port, ports),
            cwd=tmp_path / f"n{i}",
            env={"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{port}"},
            port=port,
        )
        for i, port in enumerate(ports)
    ]
    deadline = time.monotonic() + 20
    while any(n.metric("chunkd_peer_healthy") < NODES for n in nodes):
        assert time.monotonic() < deadline, "the nodes never all saw each other up"
        time.sleep(0.1)
    plain, replicated = _state(29), _state(30)
    with Client(nodes[0].cwd / "chunkd.sock", timeout=60) as client:
        ckpt.save(plain, "ckpt/dashboard/plain", client=client, replicas=0)
        ckpt.save(replicated, "ckpt/dashboard/replicated", client=client)  # [peers] replicas
    # the replicas go in the background: wait until the saver counts the save
    deadline = time.monotonic() + 30
    while sum(nodes[0].metric("chunkd_replica_saves_total", outcome=o) for o in SAVES) < 1:
        assert time.monotonic() < deadline, "the save's replicas were never counted"
        time.sleep(0.2)
    # Three nodes restore the plain save at once: with holder_fanout 1 an owner serves
    # a chunk once and sends the next asker to the node it served. Then the replicated
    # one, which they find first in the replica's RAM.
    _load(nodes[1:], "ckpt/dashboard/plain", plain)
    _load(nodes[1:], "ckpt/dashboard/replicated", replicated)
    return nodes, replicated


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(512, 512, generator=g) for i in range(16)}  # 1 MiB each


def _load(nodes: list[Daemon], name: str, state: dict[str, torch.Tensor]) -> None:
    """``name`` restored on every one of ``nodes`` at once, bit-exact."""
    failures: list[BaseException] = []

    def load(node: Daemon) -> None:
        try:
            with Client(node.cwd / "chunkd.sock", timeout=60) as client:
                loaded = ckpt.load(name, client=client)
            assert all(torch.equal(loaded[k], state[k]) for k in state)
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=load, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures


def _latest(node: Daemon) -> dict[str, Any]:
    status, _, body = node.get("/v1/dashboard")
    assert status == 200
    history = json.loads(body)["history"]
    assert history
    return history[-1]


def _settled(
    node: Daemon, check: Callable[[dict[str, Any]], bool], timeout: float = 15
) -> dict[str, Any]:
    """The node's latest sample once ``check`` holds for it (a sample a second)."""
    deadline = time.monotonic() + timeout
    while True:
        sample = _latest(node)
        if check(sample):
            return sample
        assert time.monotonic() < deadline, json.dumps(sample["peers"], indent=1)
        time.sleep(0.3)


def _role_total(sample: dict[str, Any], direction: str, role: str) -> float:
    return sum(m["role_bytes"][direction][role] for m in sample["peers"]["members"])


@pytest.mark.timeout(120)
def test_the_peers_panel_shows_bytes_by_role_and_the_replica_budget(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    nodes, state = _restored(start_daemon, tmp_path, bucket, s3_proxy)
    size = sum(t.numel() * 4 for t in state.values())
    # Each node's sample says what /metrics counts, peer by peer and role by role.
    samples = []
    for node in nodes:

        def counted(sample: dict[str, Any], node: Daemon = node) -> bool:
            return all(
                _role_total(sample, d, r)
                == node.metric("chunkd_peer_role_bytes_total", direction=d, role=r)
                for d in ("in", "out")
                for r in ROLES
            )

        sample = _settled(node, counted)
        samples.append(sample)
        replicas = sample["peers"]["replicas"]
        assert replicas["budget_bytes"] == BUDGET
        assert replicas["bytes"] == node.metric("chunkd_replica_bytes")
    # Holders served: some node received chunks from a holder, and as many went out.
    holder_in = sum(_role_total(s, "in", "holder") for s in samples)
    assert holder_in > 0
    assert holder_in == sum(_role_total(s, "out", "holder") for s in samples)
    assert sum(s["peers"]["holder_answers"]["holders"] for s in samples) > 0
    # The save's one replica is held in some other node's RAM, within the budget.
    saver = samples[0]["peers"]["replicas"]
    assert saver["saves"]["full"] == 1
    assert saver["pushes"]["ok"] > 0
    held = [s["peers"]["replicas"]["bytes"] for s in samples[1:]]
    assert size <= sum(held) <= BUDGET
    assert (
        sum(s["peers"]["replicas"]["received"]["stored"] for s in samples) == saver["pushes"]["ok"]
    )
    if chromium_missing() is None:
        _check_the_page(nodes)
    _check_top(nodes)


def _check_the_page(nodes: list[Daemon]) -> None:
    """The page of the node that received the most from holders shows it per peer."""
    from playwright.sync_api import expect

    # the node that received the most from holders: its page shows a holder figure
    node = max(
        nodes, key=lambda n: n.metric("chunkd_peer_role_bytes_total", direction="in", role="holder")
    )
    sample = _settled(node, lambda s: _role_total(s, "in", "holder") > 0)
    with chromium() as browser:
        context = browser.new_context(viewport={"width": 1280, "height": 900}, timezone_id="UTC")
        page = context.new_page()
        problems: list[str] = []
        page.on(
            "console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None
        )
        page.on("pageerror", lambda e: problems.append(str(e)))
        response = page.goto(node.url + "/")
        assert response is not None
        assert response.status == 200
        assert "default-src 'none'" in response.headers["content-security-policy"]
        summary = f"{NODES} of {NODES} up · self {sample['peers']['self']}"
        expect(page.locator("#peers-summary")).to_have_text(summary, timeout=30_000)
        expect(page.locator("#rep-budget")).to_have_text("64.0 MiB")
        rows = page.locator("#peers tbody tr:not([hidden])")
        expect(rows).to_have_count(NODES, timeout=30_000)  # every member, self included
        table = page.evaluate(
            "Array.from(document.querySelectorAll('#peers tbody tr:not([hidden])'))"
            ".map((r) => Array.from(r.cells).map((c) => c.textContent))"
        )
        by_address = {row[0]: row for row in table}
        members = {m["address"]: m for m in sample["peers"]["members"]}
        assert set(by_address) == set(members)
        # received from it: owner, holder, replica are the row's 5th to 7th cells
        assert by_address[sample["peers"]["self"]][1] == "self"
        holders = [a for a, m in members.items() if m["role_bytes"]["in"]["holder"] > 0]
        assert holders
        for address in holders:
            assert by_address[address][5] != "0 B", by_address[address]
        hover = page.evaluate(
            "document.querySelector('#peers tbody tr:not([hidden])').cells[5].title"
        )
        assert hover.endswith(" now"), hover
        assert " since the start, " in hover, hover
        if os.environ.get("CHUNKD_SCREENSHOTS") == "1":
            IMAGES.mkdir(parents=True, exist_ok=True)
            page.locator("#peers-panel").screenshot(path=str(IMAGES / "dashboard-peers.png"))
        assert problems == []
        context.close()


def _check_top(nodes: list[Daemon]) -> None:
    """``chunkd top --once``: the same figures, as text."""
    node = max(
        nodes, key=lambda n: n.metric("chunkd_peer_role_bytes_total", direction="in", role="holder")
    )
    shown = subprocess.run(
        [str(BIN / "chunkd"), "top", "--url", node.url, "--once"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "COLUMNS": "160"},
    ).stdout
    assert " of 64.0 MiB;" in shown, shown
    assert "holder " in shown, shown
    mine = [line for line in shown.splitlines() if line.startswith(f"{node.host}:{node.port} ")]
    assert len(mine) == 1, shown
    assert mine[0].split()[1] == "self", shown
