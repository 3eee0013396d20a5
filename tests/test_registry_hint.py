"""Resolving ``NAME@latest`` and ``NAME@TAG`` from the hint and forward probes, through
real daemons: reads that do not grow with the history, and the rule that a resolve
never returns a version older than a commit (or tag move) that had finished before
the resolve began, with two daemons committing, moving a tag and resolving at once."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chunkd.client import Client
from chunkd.client.datasets.pages import commit_snapshot
from chunkd.snapshot import Member, Snapshot
from tests.conftest import Daemon


def snapshot(tag: str, count: int = 3) -> Snapshot:
    members = [
        Member(f"m/{i:04d}.bin", 64, f"{tag}-{i}", "fixed", 4, {"record_bytes": 16})
        for i in range(count)
    ]
    return Snapshot.build(
        backend="local", prefix="data/", format="fixed", members=members, schema=2
    )


def node_toml(shared: Path, here: Path) -> str:
    return f"""
[server]
socket = "{here / "chunkd.sock"}"

[cache]
dir = "{here / "cache"}"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
fsync = "never"

[[backends]]
name = "local"
url = "file://{shared}"
writable = true
"""


def two_nodes(start_daemon: Callable[..., Daemon], tmp_path: Path) -> list[Daemon]:
    """Two daemons over one registry (local/datasets, a file backend both write)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    nodes = []
    for i in range(2):
        here = tmp_path / f"n{i}"
        here.mkdir()
        nodes.append(start_daemon(node_toml(shared, here), cwd=here))
    return nodes


def resolved(client: Client, ref: str) -> dict[str, Any]:
    with client.request("ds_resolve", {"ref": ref}) as reply:
        return dict(reply.header)


def requests(daemon: Daemon, op: str) -> float:
    return daemon.metric("chunkd_backend_requests_total", backend="local", op=op)


@pytest.mark.timeout(60)
def test_resolving_latest_of_a_name_with_1000_versions_does_not_list_them(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = start_daemon(cwd=tmp_path / "node")
    versions = tmp_path / "node" / "chunkd-data" / "datasets" / "names" / "big" / "_versions"
    with Client(daemon.cwd / "chunkd.sock") as client:
        one, two = snapshot("one"), snapshot("two")
        commit_snapshot(client, "big", one)
        # Versions 2-999 as an older daemon wrote them (no hint): the next commit lists
        # them once, from where its probes stop, and leaves a hint at 1000.
        for number in range(2, 1000):
            pointer = {
                "created": 1.0,
                "format": "chunkd-dataset-version",
                "id": one.id if number % 2 else two.id,
                "name": "big",
                "schema": 1,
                "version": number,
            }
            (versions / f"{number:012d}.json").write_text(json.dumps(pointer))
        assert commit_snapshot(client, "big", snapshot("three"))["version"] == 1000
        hint = versions.parent / "_latest.json"
        assert json.loads(hint.read_text()) == {"version": 1000}
        resolved(client, "big@latest")  # its manifest parsed and kept: not counted below
        lists, gets, heads = (requests(daemon, op) for op in ("list", "get", "head"))
        for ref in ("big@latest", "big"):
            header = resolved(client, ref)
            assert header["version"] == 1000
        # Per resolve: the hint and version 1000's pointer (a ranged read each: a HEAD
        # and a GET), 1001 (a HEAD: absent), the frozen record's HEAD; one listing, of
        # the name's tags (none), never of its versions.
        assert requests(daemon, "list") - lists == 2 * 1
        assert requests(daemon, "get") - gets == 2 * 2
        assert requests(daemon, "head") - heads == 2 * 4


@pytest.mark.timeout(60)
def test_a_hint_behind_or_naming_nothing_or_damaged_never_gives_an_older_version(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = start_daemon(cwd=tmp_path / "node")
    name_dir = tmp_path / "node" / "chunkd-data" / "datasets" / "names" / "h"
    hint = name_dir / "_latest.json"
    with Client(daemon.cwd / "chunkd.sock") as client:
        for i in range(20):
            assert commit_snapshot(client, "h", snapshot(f"s{i}"))["version"] == i + 1
        client.request("ds_tag", {"name": "h", "tag": "best", "ref": "3"})
        for hinted in (b'{"version":1}', b'{"version":17}', b'{"version":5000}', b"[[[", b""):
            hint.write_bytes(hinted)  # a daemon that died before its hint, a forged one
            assert resolved(client, "h")["version"] == 20
            assert resolved(client, "h@best")["version"] == 3
        tag_hint = name_dir / "_tags" / "best" / "_latest.json"
        assert json.loads(tag_hint.read_text()) == {"seq": 1}
        for n in range(4, 15):
            client.request("ds_tag", {"name": "h", "tag": "best", "ref": str(n)})
        tag_hint.write_bytes(b'{"seq":1}')  # far behind: probes, then one listing
        assert resolved(client, "h@best")["version"] == 14
        assert resolved(client, "h@latest")["tags"] == []
        assert resolved(client, "h@14")["tags"] == ["best"]
    assert "Traceback" not in daemon.log.read_text()


@pytest.mark.timeout(90)
def test_a_resolve_never_returns_a_version_older_than_a_commit_finished_before_it(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    nodes = two_nodes(start_daemon, tmp_path)
    lock = threading.Lock()
    commits: list[tuple[float, int]] = []  # (when it finished, version)
    moves: list[tuple[float, int]] = []  # (when it finished, the version tagged)
    broken: list[str] = []
    errors: list[BaseException] = []
    done = threading.Event()
    with Client(nodes[0].cwd / "chunkd.sock") as client:
        commit_snapshot(client, "race", snapshot("first"))
        client.request("ds_tag", {"name": "race", "tag": "live", "ref": "1"})

    def guarded(work: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                work()
            except BaseException as exc:
                errors.append(exc)
                done.set()

        return run

    def committer(i: int) -> None:
        with Client(nodes[i].cwd / "chunkd.sock", timeout=60) as client:
            for n in range(12):
                answer = commit_snapshot(client, "race", snapshot(f"n{i}-{n}"))
                with lock:
                    commits.append((time.monotonic(), answer["version"]))

    def mover() -> None:
        clients = [Client(n.cwd / "chunkd.sock", timeout=60) for n in nodes]
        try:
            n = 0
            while not done.is_set():
                client = clients[n % 2]
                n += 1
                # Tag whatever is latest now: moves are sequential, their versions rise.
                latest = resolved(client, "race")["version"]
                answer = client.request(
                    "ds_tag", {"name": "race", "tag": "live", "ref": str(latest)}
                ).header
                with lock:
                    moves.append((time.monotonic(), answer["version"]))
        finally:
            for c in clients:
                c.close()

    def resolver(i: int) -> None:
        with Client(nodes[i].cwd / "chunkd.sock", timeout=60) as client:
            while not done.is_set():
                for ref, history in (("race@latest", commits), ("race@live", moves)):
                    began = time.monotonic()
                    with lock:
                        floor = max((v for t, v in history if t < began), default=1)
                    got = resolved(client, ref)["version"]
                    if got < floor:
                        broken.append(f"{ref} on node {i}: version {got}, after {floor}")

    writers = [threading.Thread(target=guarded(lambda i=i: committer(i))) for i in range(2)]
    others = [threading.Thread(target=guarded(mover))]
    others += [threading.Thread(target=guarded(lambda i=i: resolver(i))) for i in range(2)]
    for t in writers + others:
        t.start()
    for t in writers:
        t.join(timeout=70)
    done.set()
    for t in others:
        t.join(timeout=20)
    assert not errors, errors
    assert not broken, broken
    versions = sorted(v for _, v in commits)
    assert versions == list(range(2, 26))  # every commit got its own number
    assert len(moves) >= 3
    with Client(nodes[1].cwd / "chunkd.sock") as client:
        assert resolved(client, "race")["version"] == 25
    for node in nodes:
        assert "Traceback" not in node.log.read_text()
