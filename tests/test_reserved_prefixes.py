"""The one rule for writes where a client picks the key: chunkd's own prefixes are refused.

``ds_migrate`` writes ``PREFIX + the member's key below the snapshot's prefix``; each
reserved prefix is reached both ways (the destination prefix, and a member's own
relative key migrated to the backend's root), and each is refused before anything is
written, with what the planted object would have done checked not to happen.
Backends that share a store (one inside the other's bucket prefix or directory) keep
each other's prefixes: a key of one that lands in the other's chunk store is refused.
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
from chunkd.gateway.config import BackendConfig
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
    snap = Snapshot.build(schema=1, backend=backend, prefix=prefix, format="fixed", members=members)
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
    # A registry at its backend's root keeps its own folders there: pages too.
    root = ReservedPrefixes("reg")
    for key in ("manifests/a.json", "names/a/_versions/1.json", "frozen/a.json", "pages/a.json"):
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
        schema=1,
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
    with client.request("ds_resolve", {"ref": victim.id}) as reply:  # its fds closed
        header = reply.header
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


def test_backends_that_share_a_store_keep_each_others_prefixes(tmp_path: Path) -> None:
    real = tmp_path / "real"
    (real / "team").mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    configs = [
        BackendConfig("raw", "s3://b"),
        BackendConfig("ckpt", "s3://b/team"),
        BackendConfig("alias", "s3://b/team/"),  # the same place under another name
        BackendConfig("deep", "s3://b/team/chunks/x"),  # inside ckpt's chunk store
        BackendConfig("other", "s3://c"),  # another bucket
        BackendConfig("gcs", "gs://b"),  # another service
        BackendConfig("fs", f"file://{tmp_path / 'link'}"),  # the same directory, by a link
        BackendConfig("fsteam", f"file://{real / 'team'}"),
        BackendConfig("m1", "memory://"),
        BackendConfig("m2", "memory://"),
    ]
    rule = ReservedPrefixes("ckpt/datasets", configs)
    # raw holds ckpt (and alias) under team/: ckpt's prefixes, its registry's included.
    for key in (
        "team/chunks/abc",
        "team/chunks",
        "team/checkpoints/run/step-9/manifest.json",
        "team/intents/x.0.json",
        "team/gc/x.json",
        "team/datasets/frozen/x.json",
    ):
        with pytest.raises(ReservedKeyError, match=r"raw/team/.*which is ckpt/"):
            rule.check("raw", key, door="ds_migrate")
    for key in ("team/data/a", "teamx/chunks/a", "datasets/a", "team/chunksx"):
        assert rule.check("raw", key, door="ds_migrate") == key
    with pytest.raises(ReservedKeyError):
        rule.check("raw", "chunks/abc", door="ds_migrate")  # its own, as before
    # Two names for one place keep each other's prefixes: alias keeps the registry's.
    with pytest.raises(ReservedKeyError):
        rule.check("alias", "datasets/names/a/_versions/1.json", door="ds_migrate")
    assert "datasets/" in rule.of("ckpt")
    # A backend inside another's reserved prefix is reserved whole.
    for key in ("a", "data/part-0.parquet"):
        with pytest.raises(ReservedKeyError, match=r"all of backend 'deep' lies inside"):
            rule.check("deep", key, door="ds_migrate")
    # Other buckets, services and memory stores are stores of their own.
    for name in ("other", "gcs", "m1", "m2"):
        assert rule.of(name) == EVERY_BACKEND, name
        assert rule.check(name, "team/chunks/a", door="ds_migrate") == "team/chunks/a"
    # Directories: compared after symbolic links are resolved.
    with pytest.raises(ReservedKeyError, match=r"fs/team/chunks/a.*which is fsteam/chunks/"):
        rule.check("fs", "team/chunks/a", door="ds_migrate")
    assert rule.check("fsteam", "team/chunks/a", door="ds_migrate") == "team/chunks/a"
    # Without the backends' places, each backend is a store of its own (as before).
    alone = ReservedPrefixes("ckpt/datasets")
    assert alone.check("raw", "team/chunks/abc", door="ds_migrate") == "team/chunks/abc"


def nested_config(tmp_path: Path) -> str:
    """``raw`` at a directory, ``ckpt`` (the registry's backend) at its ``team/``."""
    root = tmp_path / "root"
    return (
        small_node_toml(
            tmp_path / "cache",
            ("raw", root),
            ("ckpt", root / "team"),
            ("src", tmp_path / "src"),
        )
        + """
[datasets]
registry = "ckpt/datasets"
"""
    )


@pytest.mark.timeout(60)
def test_migrate_into_another_backend_s_reserved_prefix_by_a_shared_directory_is_refused(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    for name in ("root/team", "src"):
        (tmp_path / name).mkdir(parents=True)
    daemon = start_daemon(nested_config(tmp_path), cwd=tmp_path / "run")
    root, src = tmp_path / "root", tmp_path / "src"
    with Client(daemon.cwd / "chunkd.sock") as client:
        state = {"w": np.arange(4096, dtype=np.float32)}
        ckpt.save(state, "ckpt/run/step-1", client=client, world_size=1, timeout=60)
        victim = next(p.name for p in (root / "team/chunks").iterdir())
        evil = os.urandom(RECORD * 4)
        plant(src, {"m.bin": evil, f"x/team/chunks/{victim}": evil, "x/team/gc/x.json": evil})
        register(client, "one", "src", "", ["m.bin"])
        register(client, "two", "src", "x/", [f"x/team/chunks/{victim}"])
        register(client, "three", "src", "x/", ["x/team/gc/x.json"])
        before = tree(root)
        # Way 1: the destination prefix is ckpt's chunk store (or its registry), by raw.
        for to in ("raw/team/chunks", "raw/team/datasets/frozen", "raw/team/gc"):
            with pytest.raises(ReservedKeyError, match=rf"ds_migrate would write {to}/"):
                client.request("ds_migrate", {"ref": "one", "to": to})
        # Way 2: a member's own key lands there from raw's root.
        with pytest.raises(ReservedKeyError, match=f"raw/team/chunks/{victim}.*ckpt/chunks/"):
            client.request("ds_migrate", {"ref": "two", "to": "raw"})
        with pytest.raises(ReservedKeyError, match=r"raw/team/gc/x\.json"):
            client.request("ds_migrate", {"ref": "three", "to": "raw"})
        assert tree(root) == before  # nothing written
        # The chunk is ckpt's own still, and a save finishes at once (no planted barrier).
        started = time.monotonic()
        ckpt.save(state, "ckpt/run/step-2", client=client, world_size=1, timeout=30)
        assert time.monotonic() - started < 20
        np.testing.assert_array_equal(ckpt.load("ckpt/run/step-2", client=client)["w"], state["w"])
        # raw's keys outside ckpt's prefixes are still raw's to fill.
        got = client.request("ds_migrate", {"ref": "one", "to": "raw/team/data"}, timeout=60)
        assert got.header["copied"] == 1
        assert (root / "team/data/m.bin").read_bytes() == evil
