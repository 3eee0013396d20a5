"""The one rule for writes where a client picks the key: chunkd's own prefixes are refused.

``ds_migrate`` writes ``PREFIX + the member's key below the snapshot's prefix``; each
reserved prefix is reached both ways (the destination prefix, and a member's own
relative key migrated to the backend's root), and each is refused before anything is
written, with what the planted object would have done checked not to happen.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import blake3
import numpy as np
import pytest

from chunkd import memfd
from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.errors import InvalidKeyError, ReservedKeyError
from chunkd.gateway.reserved import EVERY_BACKEND, ReservedPrefixes
from chunkd.snapshot import Member, Snapshot
from tests.conftest import Daemon, small_node_toml

RECORD = 16


def config(tmp_path: Path) -> str:
    return (
        small_node_toml(tmp_path / "cache", ("local", tmp_path / "local"))
        + f"""
[[backends]]
name = "src"
url = "file://{tmp_path / "src"}"
revalidate = "1s"

[datasets]
registry = "local/datasets"
"""
    )


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Iterator[tuple[Client, Path]]:
    for name in ("local", "src"):
        (tmp_path / name).mkdir()
    daemon = start_daemon(config(tmp_path), cwd=tmp_path / "run")
    with Client(daemon.cwd / "chunkd.sock") as client:
        yield client, tmp_path


def plant(root: Path, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def register(client: Client, name: str, backend: str, prefix: str, keys: list[str]) -> Snapshot:
    members = []
    for key in keys:
        stat = client.stat(f"{backend}/{key}")
        members.append(
            Member(
                key, stat.size, stat.version, "fixed", stat.size // RECORD, {"record_bytes": RECORD}
            )
        )
    snap = Snapshot.build(backend=backend, prefix=prefix, format="fixed", members=members)
    fd = memfd.sealed(snap.data)
    try:
        client.request("ds_commit", {"name": name}, fds=[fd], timeout=60)
    finally:
        os.close(fd)
    return snap


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


def test_the_rule_covers_every_prefix_and_only_the_registry_backend_has_its_own() -> None:
    rule = ReservedPrefixes("reg/datasets")
    assert rule.of("other") == EVERY_BACKEND == ("chunks/", "checkpoints/", "intents/", "gc/")
    assert rule.of("reg") == (*EVERY_BACKEND, "datasets/")
    for key in ("chunks/ab", "checkpoints/x/manifest.json", "intents/a.json", "gc/x.json"):
        with pytest.raises(ReservedKeyError, match="a prefix chunkd keeps"):
            rule.check("other", key, door="ds_migrate")
    rule.check("other", "datasets/frozen/x.json", door="ds_migrate")  # not the registry's
    for key in ("datasets/frozen/x.json", "datasets/names/a/_versions/1.json", "datasets"):
        with pytest.raises(ReservedKeyError):
            rule.check("reg", key, door="ds_migrate")
    for key in ("chunksx/a", "data/chunks/a", "gcx", "my-datasets/a", "checkpoints.txt"):
        assert rule.check("reg", key, door="ds_migrate") == key
    # A registry at its backend's root keeps its own three folders there.
    root = ReservedPrefixes("reg")
    for key in ("manifests/a.json", "names/a/_versions/1.json", "frozen/a.json"):
        with pytest.raises(ReservedKeyError):
            root.check("reg", key, door="ds_migrate")
    assert root.check("reg", "datasets/a", door="ds_migrate") == "datasets/a"


@pytest.mark.timeout(90)
def test_migrate_refuses_every_reserved_prefix_reached_either_way(
    node: tuple[Client, Path],
) -> None:
    client, root = node
    local, src = root / "local", root / "src"
    # A victim: a dataset and a checkpoint of someone else's, on the registry backend.
    victim_bytes = os.urandom(RECORD * 64)
    plant(local, {"victim/part.bin": victim_bytes})
    victim = register(client, "victim", "local", "victim/", ["victim/part.bin"])
    state = {"w": np.arange(1024, dtype=np.float32)}
    ckpt.save(state, "local/ckpt/run/step-1", client=client, world_size=1, timeout=60)
    before = tree(local)

    # What an attacker would plant: a chunk named by the victim's content (poison), a
    # checkpoint step above the victim's (a hijacked "latest"), an intent, a GC barrier
    # (every save and freeze waits an hour), and the registry's own records.
    victim_chunk = blake3.blake3(victim_bytes).hexdigest()
    payloads = {
        "chunks": f"chunks/{victim_chunk}",
        "checkpoints": "checkpoints/ckpt/run/step-999/manifest.json",
        "intents": "intents/evil.0.json",
        "gc": "gc/x.json",
        "frozen": f"datasets/frozen/{victim.id}.json",
        "manifests": f"datasets/manifests/{victim.id}.json",
        "names": "datasets/names/victim/_versions/000000000002.json",
    }
    evil = os.urandom(RECORD * 4)
    for what, key in payloads.items():
        # Way 1: the destination prefix itself is reserved.
        plant(src, {f"{what}/m.bin": evil})
        register(client, f"a-{what}", "src", f"{what}/", [f"{what}/m.bin"])
        folder = key.rpartition("/")[0]
        with pytest.raises(ReservedKeyError, match=rf"ds_migrate would write local/{folder}/"):
            client.request("ds_migrate", {"ref": f"a-{what}", "to": f"local/{folder}"})
        # Way 2: a member's own key below the source's prefix lands there from the root.
        plant(src, {f"x-{what}/{key}": evil})
        register(client, f"b-{what}", "src", f"x-{what}/", [f"x-{what}/{key}"])
        with pytest.raises(ReservedKeyError, match=f"local/{key}"):
            client.request("ds_migrate", {"ref": f"b-{what}", "to": "local"})
    # A member key that climbs out of the source's prefix is no key at all.
    forged = Snapshot.build(
        backend="src",
        prefix="x/",
        format="fixed",
        members=[Member("x/../chunks/abc", 64, "v", "fixed", 4, {"record_bytes": RECORD})],
    )
    fd = memfd.sealed(forged.data)
    try:
        client.request("ds_commit", {"name": "forged"}, fds=[fd], timeout=60)
    finally:
        os.close(fd)
    with pytest.raises(InvalidKeyError, match=r"'\.\.' path segment"):
        client.request("ds_migrate", {"ref": "forged", "to": "local"})

    # Nothing was written under any reserved prefix, and the victims are as they were.
    # (the registrations above wrote only manifests and version pointers of their own)
    new = tree(local) - before
    assert {p for p in new if not p.startswith(("datasets/names/", "datasets/manifests/"))} == set()
    for key in payloads.values():
        assert not (local / key).exists() or key.startswith("datasets/manifests/")
    assert (local / payloads["manifests"]).read_bytes() == victim.data
    assert not (local / "datasets/names/victim/_versions/000000000002.json").exists()
    header = client.request("ds_resolve", {"ref": victim.id}).header
    assert header["frozen"] is False
    assert header["snapshot"] == victim.id
    assert [e["name"] for e in ckpt.list("local/ckpt/run", client=client)] == [
        "local/ckpt/run/step-1"
    ]
    # No planted barrier: a save and a freeze finish at once.
    started = time.monotonic()
    ckpt.save(state, "local/ckpt/run/step-2", client=client, world_size=1, timeout=30)
    assert client.request("ds_freeze", {"ref": "victim"}, timeout=30).header["uploaded"] >= 1
    assert time.monotonic() - started < 20
    np.testing.assert_array_equal(
        ckpt.load("local/ckpt/run/step-2", client=client)["w"], state["w"]
    )


@pytest.mark.timeout(60)
def test_migrate_elsewhere_on_the_backend_still_works(node: tuple[Client, Path]) -> None:
    client, root = node
    data = os.urandom(RECORD * 8)
    plant(root / "src", {"x/chunks-of-mine/a.bin": data, "x/gcx/b.bin": data})
    register(client, "fine", "src", "x/", ["x/chunks-of-mine/a.bin", "x/gcx/b.bin"])
    got = client.request("ds_migrate", {"ref": "fine", "to": "local"}, timeout=60).header
    assert (got["copied"], got["kept"]) == (2, 0)
    assert (root / "local/chunks-of-mine/a.bin").read_bytes() == data
