"""The dataset registry through real daemons: commits, versions, tags, resolving,
listings, bad input, crashes, concurrent registrations, freeze, GC roots, migrate.

A few tests run a node in the test's own process (:func:`open_node`), where what a
daemon's config cannot set is needed: a freeze's intent refresh period, a backend
call held or failed at one moment.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest

from chunkd import memfd
from chunkd.client import Client
from chunkd.client.datasets.pages import DaemonPages, commit_snapshot
from chunkd.client.results import Reply
from chunkd.errors import (
    BackendUnavailableError,
    ConfigError,
    DatasetError,
    DatasetNotFoundError,
    InvalidRequestError,
    ManifestError,
    ReadOnlyBackendError,
    SnapshotDriftError,
)
from chunkd.gateway.backends.file import FileBackend
from chunkd.gateway.config import BackendConfig, load_config
from chunkd.gateway.daemon import Node, open_node
from chunkd.gateway.datasets import Datasets
from chunkd.gateway.metrics import Metrics
from chunkd.snapshot import Member, Snapshot, page_bytes
from chunkd.testing import CountingProxy, s3_backend
from tests.conftest import Daemon
from tests.frozen_records import record_chunk_lists

RECORD = 16
CHUNK = 1 << 20


# -- helpers -----------------------------------------------------------------------------


def data_dir(daemon: Daemon) -> Path:
    return daemon.cwd / "chunkd-data"


def registry_dir(daemon: Daemon) -> Path:
    return data_dir(daemon) / "datasets"


def write_objects(root: Path, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def snapshot_of(
    client: Client, keys: list[str], *, backend: str = "local", prefix: str = "data/"
) -> Snapshot:
    """A fixed-record snapshot of real objects, at the versions the daemon sees now."""
    members = []
    for key in keys:
        stat = client.stat(f"{backend}/{key}")
        members.append(
            Member(
                key, stat.size, stat.version, "fixed", stat.size // RECORD, {"record_bytes": RECORD}
            )
        )
    return Snapshot.build(backend=backend, prefix=prefix, format="fixed", members=members)


def commit(client: Client, snapshot: Snapshot | bytes, name: str) -> dict[str, Any]:
    if isinstance(snapshot, Snapshot):  # its pages first (a paged one), then its root
        return commit_snapshot(client, name, snapshot)
    fd = memfd.sealed(snapshot)
    try:
        return client.request("ds_commit", {"name": name}, fds=[fd], timeout=60).header
    finally:
        os.close(fd)


async def put_pages(datasets: Any, snapshot: Snapshot) -> None:
    """Put a paged snapshot's pages into an in-process daemon's registry (what a
    client's ``ds_page_put`` does), before its root is committed."""
    for page in range(len(snapshot.pages)):
        await datasets.registry.put_page(page_bytes(snapshot.page_members(page)))


def fd_bytes(fd: int) -> bytes:
    return os.pread(fd, os.fstat(fd).st_size, 0)


def resolve(client: Client, ref: str) -> tuple[dict[str, Any], bytes, bytes | None]:
    with client.request("ds_resolve", {"ref": ref}) as reply:
        manifest = fd_bytes(reply.fds[0])
        frozen = fd_bytes(reply.fds[1]) if len(reply.fds) > 1 else None
        return reply.header, manifest, frozen


def listing(reply: Reply) -> list[dict[str, Any]]:
    import json

    entries: list[dict[str, Any]] = json.loads(reply.payload)
    return entries


def chunkd_cli(daemon: Daemon, *args: str) -> str:
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "chunkd"),
            *args,
            "--socket",
            str(daemon.cwd / "chunkd.sock"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Iterator[tuple[Daemon, Client]]:
    """A daemon on the embedded default: a writable file backend 'local', the registry
    at local/datasets."""
    daemon = start_daemon(cwd=tmp_path / "node")
    with Client(daemon.cwd / "chunkd.sock") as client:
        yield daemon, client


@pytest.fixture
async def inproc(tmp_path: Path) -> AsyncIterator[Node]:
    """A node in this process: a writable file backend 'local' (the registry at
    local/datasets) at ``tmp_path/local``, a read-only one 'root' at ``tmp_path/root``,
    and 4 KiB chunks (a freeze of a few MiB writes several intents)."""
    for folder in ("local", "root"):
        (tmp_path / folder).mkdir()
    toml = tmp_path / "inproc.toml"
    toml.write_text(f"""
[server]
socket = "{tmp_path / "inproc.sock"}"

[cache]
dir = "{tmp_path / "inproc-cache"}"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
chunk_bytes = "4KiB"
fsync = "never"

[[backends]]
name = "local"
url = "file://{tmp_path / "local"}"
writable = true
revalidate = "1s"

[[backends]]
name = "root"
url = "file://{tmp_path / "root"}"
revalidate = "1s"
""")
    config = load_config(toml, environ={}, cwd=tmp_path)
    async with open_node(config, Metrics(), tls=None) as node:
        yield node


def inproc_datasets(node: Node, **options: float) -> Datasets:
    """Another dataset registry over ``node``'s parts (same registry), with ``options``."""
    return Datasets(
        node.config.datasets,
        node.backends,
        node.read_path,
        node.cache,
        node.metrics,
        poll_interval=0.1,
        **options,
    )


async def inproc_snapshot(
    node: Node, keys: list[str], *, backend: str = "local", prefix: str = "data/"
) -> Snapshot:
    """:func:`snapshot_of`, through ``node``'s read path."""
    members = []
    for key in keys:
        stat = await node.read_path.stat(backend, key)
        members.append(
            Member(
                key,
                stat.size,
                stat.meta.version,
                "fixed",
                stat.size // RECORD,
                {"record_bytes": RECORD},
            )
        )
    return Snapshot.build(backend=backend, prefix=prefix, format="fixed", members=members)


FILES = {
    "data/a.bin": os.urandom(3 * CHUNK + 48),
    "data/b.bin": os.urandom(RECORD * 10),
    "data/sub/c.bin": os.urandom(CHUNK),
}


# -- commits, versions, tags, resolving ---------------------------------------------------


def test_commit_resolve_versions_and_tags(node: tuple[Daemon, Client]) -> None:
    daemon, client = node
    write_objects(data_dir(daemon), FILES)
    first = snapshot_of(client, sorted(FILES))
    got = commit(client, first, "text/web")
    assert (got["snapshot"], got["version"], got["created"]) == (first.id, 1, True)
    # The same snapshot again makes no new version.
    again = commit(client, first, "text/web")
    assert (again["version"], again["created"]) == (1, False)
    second = snapshot_of(client, ["data/a.bin"])
    assert commit(client, second, "text/web")["version"] == 2
    for ref, want, version in [
        ("text/web", second, 2),
        ("text/web@latest", second, 2),
        ("text/web@1", first, 1),
        ("text/web@2", second, 2),
    ]:
        header, manifest, frozen = resolve(client, ref)
        assert (header["snapshot"], header["name"], header["version"]) == (
            want.id,
            "text/web",
            version,
        )
        assert manifest == want.data
        assert Snapshot.parse(manifest, expect_id=want.id) == want
        assert header["frozen"] is False
        assert frozen is None
    header, manifest, _ = resolve(client, first.id)
    assert (header["snapshot"], header["name"], header["version"]) == (first.id, None, None)
    assert manifest == first.data
    # Tags: an append-only history, the newest entry wins.
    tagged = client.request("ds_tag", {"name": "text/web", "tag": "prod", "ref": "1"}).header
    assert (tagged["version"], tagged["seq"], tagged["snapshot"]) == (1, 1, first.id)
    assert resolve(client, "text/web@prod")[0]["snapshot"] == first.id
    assert resolve(client, "text/web@1")[0]["tags"] == ["prod"]
    moved = client.request(
        "ds_tag", {"name": "text/web", "tag": "prod", "ref": "text/web@latest"}
    ).header
    assert (moved["version"], moved["seq"]) == (2, 2)
    client.request("ds_tag", {"name": "text/web", "tag": "old", "ref": "text/web@1"})
    assert resolve(client, "text/web@prod")[0]["version"] == 2
    assert resolve(client, "text/web@2")[0]["tags"] == ["prod"]
    with client.request("ds_versions", {"name": "text/web"}) as reply:
        versions = listing(reply)
        assert reply.header["next"] is None
    assert [(v["version"], v["snapshot"], v["tags"]) for v in versions] == [
        (1, first.id, ["old"]),
        (2, second.id, ["prod"]),
    ]
    with client.request("ds_versions", {"name": "text/web", "limit": 1}) as reply:
        assert [v["version"] for v in listing(reply)] == [1]
        assert reply.header["next"] == 1
    with client.request("ds_versions", {"name": "text/web", "start_after": 1}) as reply:
        assert [v["version"] for v in listing(reply)] == [2]
        assert reply.header["next"] is None
    # The layout on the backend, as docs/datasets.md describes it.
    root = registry_dir(daemon)
    assert (root / "manifests" / f"{first.id}.json").read_bytes() == first.data
    assert sorted(p.name for p in (root / "names/text/web/_versions").iterdir()) == [
        "000000000001.json",
        "000000000002.json",
    ]


def test_names_are_listed_in_pages_with_their_latest_version(
    node: tuple[Daemon, Client],
) -> None:
    daemon, client = node
    write_objects(data_dir(daemon), FILES)
    snap = snapshot_of(client, ["data/b.bin"])
    other = snapshot_of(client, ["data/a.bin"])
    names = ["a", "a/B", "a/b", "a/b/c", "ab", "z9"]
    for name in names:
        commit(client, snap, name)
    commit(client, other, "a/b")
    client.request("ds_tag", {"name": "a", "tag": "versions", "ref": "1"})  # no a/_tags name
    seen: list[dict[str, Any]] = []
    token = None
    while True:
        with client.request("ds_list", {"limit": 2, "start_after": token}) as reply:
            page = listing(reply)
            assert len(page) <= 2
            seen += page
            token = reply.header["next"]
        if token is None:
            break
    assert sorted(e["name"] for e in seen) == sorted(names)
    latest = {e["name"]: (e["latest"], e["snapshot"]) for e in seen}
    assert latest["a/b"] == (2, other.id)
    assert latest["a"] == (1, snap.id)
    with client.request("ds_list", {"prefix": "a/b"}) as reply:
        assert sorted(e["name"] for e in listing(reply)) == ["a/b", "a/b/c"]
    with client.request("ds_list", {"prefix": "nothing"}) as reply:
        assert listing(reply) == []
        assert reply.header["next"] is None


def test_put_if_absent_of_the_file_backend_is_atomic(tmp_path: Path) -> None:
    backend = FileBackend(
        BackendConfig(name="f", url=f"file://{tmp_path}", writable=True), Metrics()
    )

    async def race() -> list[bool]:
        return await asyncio.gather(
            *(backend.put("k/x.json", f"{i}".encode() * 1000, if_absent=True) for i in range(64))
        )

    for round_ in range(5):
        (tmp_path / "k" / "x.json").unlink(missing_ok=True)
        won = asyncio.run(race())
        assert won.count(True) == 1, round_
        winner = won.index(True)
        assert (tmp_path / "k" / "x.json").read_bytes() == f"{winner}".encode() * 1000
    assert backend.supports_conditional_put


def test_concurrent_registrations_get_different_versions(node: tuple[Daemon, Client]) -> None:
    daemon, client = node
    write_objects(data_dir(daemon), FILES)
    stats = {k: client.stat(f"local/{k}") for k in sorted(FILES)}
    snapshots = []
    for i in range(12):  # distinct snapshots: each registers a version of its own
        key = sorted(FILES)[i % 3]
        stat = stats[key]
        member = Member(key, stat.size, stat.version, "fixed", i + 1, {"record_bytes": RECORD})
        snapshots.append(
            Snapshot.build(backend="local", prefix="data/", format="fixed", members=[member])
        )
    results: dict[int, dict[str, Any]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(snapshots))

    def register(i: int) -> None:
        with Client(daemon.cwd / "chunkd.sock") as own:
            start.wait()
            try:
                results[i] = commit(own, snapshots[i], "race")
            except BaseException as exc:
                errors.append(exc)

    threads = [threading.Thread(target=register, args=(i,)) for i in range(len(snapshots))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    versions = sorted(r["version"] for r in results.values())
    assert versions == list(range(1, len(snapshots) + 1))
    for i, result in results.items():
        assert resolve(client, f"race@{result['version']}")[0]["snapshot"] == snapshots[i].id


# -- bad input ---------------------------------------------------------------------------


def test_unknown_names_versions_and_tags(node: tuple[Daemon, Client]) -> None:
    daemon, client = node
    write_objects(data_dir(daemon), FILES)
    snap = snapshot_of(client, ["data/b.bin"])
    commit(client, snap, "known")
    with pytest.raises(DatasetNotFoundError, match="no dataset named nope"):
        resolve(client, "nope")
    with pytest.raises(DatasetNotFoundError, match="no dataset named nope"):
        resolve(client, "nope@3")
    with pytest.raises(DatasetNotFoundError, match="has no version 7; its versions go from 1 to 1"):
        resolve(client, "known@7")
    with pytest.raises(DatasetNotFoundError, match="has no tag 'prod'"):
        resolve(client, "known@prod")
    with pytest.raises(DatasetNotFoundError, match="no snapshot"):
        resolve(client, "0" * 64)
    with pytest.raises(DatasetNotFoundError):
        client.request("ds_versions", {"name": "nope"})
    with pytest.raises(DatasetNotFoundError):
        client.request("ds_tag", {"name": "known", "tag": "prod", "ref": "5"})
    with pytest.raises(DatasetNotFoundError, match="not a version of known"):
        client.request("ds_tag", {"name": "known", "tag": "prod", "ref": "other@1"})
    with pytest.raises(InvalidRequestError, match="not a dataset name"):
        resolve(client, "bad name")
    with pytest.raises(InvalidRequestError, match="not a tag"):
        client.request("ds_tag", {"name": "known", "tag": "latest", "ref": "1"})
    with pytest.raises(ManifestError):
        commit(client, b'{"not": "a manifest"}', "known")
    fd = memfd.create()  # not sealed
    memfd.write_at(fd, snap.data)
    try:
        with pytest.raises(InvalidRequestError, match="sealed"):
            client.request("ds_commit", {"name": "known"}, fds=[fd])
    finally:
        os.close(fd)
    assert resolve(client, "known")[0]["snapshot"] == snap.id  # nothing registered was damaged


def test_a_tag_or_version_whose_manifest_is_missing(node: tuple[Daemon, Client]) -> None:
    daemon, client = node
    write_objects(data_dir(daemon), FILES)
    snap = snapshot_of(client, ["data/b.bin"])
    kept = snapshot_of(client, ["data/a.bin"])
    commit(client, snap, "gone")
    commit(client, kept, "gone")
    client.request("ds_tag", {"name": "gone", "tag": "prod", "ref": "1"})
    (registry_dir(daemon) / "manifests" / f"{snap.id}.json").unlink()
    with pytest.raises(
        DatasetNotFoundError, match=r"gone@prod \(version 1\) names snapshot .* missing"
    ):
        resolve(client, "gone@prod")
    with pytest.raises(DatasetNotFoundError, match=r"gone@1 names snapshot .* missing"):
        resolve(client, "gone@1")
    assert resolve(client, "gone")[0]["snapshot"] == kept.id
    # Registering it again puts the manifest back.
    commit(client, snap, "gone")
    assert resolve(client, "gone@prod")[0]["snapshot"] == snap.id


def test_a_torn_or_forged_manifest_is_refused_and_nothing_else_is_damaged(
    node: tuple[Daemon, Client],
) -> None:
    daemon, client = node
    write_objects(data_dir(daemon), FILES)
    torn = snapshot_of(client, ["data/a.bin"])
    forged = snapshot_of(client, ["data/b.bin"])
    fine = snapshot_of(client, ["data/sub/c.bin"], prefix="data/sub/")
    for snap in (torn, forged, fine):
        commit(client, snap, "m")
    manifests = registry_dir(daemon) / "manifests"
    (manifests / f"{torn.id}.json").write_bytes(torn.data[: len(torn.data) // 2])
    # A forged manifest: a valid one, stored under another id.
    (manifests / f"{forged.id}.json").write_bytes(fine.data)
    with pytest.raises(ManifestError, match="torn or was altered"):
        resolve(client, "m@1")
    with pytest.raises(ManifestError, match="torn or was altered"):
        resolve(client, forged.id)
    assert resolve(client, "m@3")[1] == fine.data
    assert (manifests / f"{fine.id}.json").read_bytes() == fine.data
    # Registering the torn snapshot again replaces the torn bytes.
    assert commit(client, torn, "m")["version"] == 4
    assert resolve(client, "m@1")[1] == torn.data


def test_a_read_only_registry_refuses_writes_but_resolves(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    write_objects(shared, FILES)
    toml = f"""
[cache]
dir = "{tmp_path / "cache"}"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
fsync = "never"

[[backends]]
name = "rw"
url = "file://{shared}"
writable = true
revalidate = "1s"

[[backends]]
name = "ro"
url = "file://{shared}"
revalidate = "1s"
"""
    daemon = start_daemon(toml, env={"CHUNKD_DATASETS_REGISTRY": "rw/registry"})
    with Client(daemon.cwd / "chunkd.sock") as client:
        snap = snapshot_of(client, ["data/b.bin"], backend="ro")
        commit(client, snap, "d")
    daemon.stop()
    daemon = start_daemon(toml, env={"CHUNKD_DATASETS_REGISTRY": "ro/registry"})
    with Client(daemon.cwd / "chunkd.sock") as client:
        header, _, _ = resolve(client, "d")
        assert (header["snapshot"], header["registry"]) == (snap.id, "ro/registry")
        with client.request("ds_versions", {"name": "d"}) as reply:
            assert [v["version"] for v in listing(reply)] == [1]
        for request in (
            lambda: commit(client, snap, "d"),
            lambda: client.request("ds_tag", {"name": "d", "tag": "prod", "ref": "1"}),
            lambda: client.request("ds_freeze", {"ref": "d"}),
            lambda: client.request("ds_migrate", {"ref": "d", "to": "rw/copy"}),
        ):
            with pytest.raises(ReadOnlyBackendError, match=r"registry ro/registry .* read-only"):
                request()
    daemon.stop()
    # A writable registry, a read-only destination.
    daemon = start_daemon(toml, env={"CHUNKD_DATASETS_REGISTRY": "rw/registry"})
    with (
        Client(daemon.cwd / "chunkd.sock") as client,
        pytest.raises(ReadOnlyBackendError, match="migrate to ro/copy: backend 'ro'"),
    ):
        client.request("ds_migrate", {"ref": "d", "to": "ro/copy"})


def test_a_registry_that_is_down_says_so(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    registry = s3_backend(
        "reg", f"s3://{bucket}/pre", s3_proxy.endpoint, writable=True, timeout="2s", retries=0
    )
    write_objects(tmp_path, FILES)
    toml = f"""
[cache]
dir = "{tmp_path / "cache"}"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
fsync = "never"

[datasets]
registry = "reg/datasets"

[[backends]]
name = "local"
url = "file://{tmp_path}"
revalidate = "1s"

{registry}"""
    daemon = start_daemon(toml)
    with Client(daemon.cwd / "chunkd.sock") as client:
        snap = snapshot_of(client, ["data/b.bin"])
        assert commit(client, snap, "s3ds")["version"] == 1
        assert resolve(client, "s3ds")[0]["snapshot"] == snap.id
        s3_proxy.down()
        try:
            with pytest.raises(BackendUnavailableError, match="dataset registry reg/datasets"):
                resolve(client, "s3ds")
            # a paged snapshot's first request is its first page's put
            with pytest.raises(BackendUnavailableError, match="registry reg/datasets cannot be"):
                commit(client, snap, "s3ds")
            with pytest.raises(BackendUnavailableError, match="registering s3ds"):
                commit(client, snap.data, "s3ds")  # the root alone, once its pages are in
        finally:
            s3_proxy.up()
        assert resolve(client, "s3ds")[0]["snapshot"] == snap.id


def test_a_bad_registry_setting_is_a_config_error(tmp_path: Path) -> None:
    base = '[[backends]]\nname = "d"\nurl = "file:///srv"\n'
    for value, message in [
        ('"d"', "names no prefix"),
        ('"D/x"', "not a backend name"),
        ('"d/../x"', "prefix chunkd cannot use"),
    ]:
        path = tmp_path / "c.toml"
        path.write_text(f"[datasets]\nregistry = {value}\n{base}")
        with pytest.raises(ConfigError, match=message):
            load_config(path, environ={}, cwd=tmp_path)
    path.write_text(f'[datasets]\nregistry = "nobackend/x"\n{base}')
    assert load_config(path, environ={}, cwd=tmp_path).datasets.registry == "nobackend/x"


# -- crashes -----------------------------------------------------------------------------


def test_kill_9_during_registrations_loses_nothing_committed(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    cwd = tmp_path / "crash"
    daemon = start_daemon(cwd=cwd)
    write_objects(data_dir(daemon), FILES)
    with Client(daemon.cwd / "chunkd.sock") as client:
        stat = client.stat("local/data/b.bin")
    made: list[tuple[int, str]] = []
    stop = threading.Event()

    def register() -> None:
        with Client(daemon.cwd / "chunkd.sock", timeout=5) as own:
            i = 0
            while not stop.is_set():
                i += 1
                member = Member("data/b.bin", stat.size, stat.version, "fixed", i, {})
                snap = Snapshot.build(
                    backend="local", prefix="data/", format="fixed", members=[member]
                )
                try:
                    got = commit(own, snap, "crash")
                except Exception:
                    return
                made.append((got["version"], snap.id))

    thread = threading.Thread(target=register)
    thread.start()
    deadline = time.monotonic() + 20
    while len(made) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    daemon.stop(signal.SIGKILL)
    stop.set()
    thread.join(30)
    assert len(made) >= 5
    # What a crash between the two PUTs leaves: a manifest no version names, and a
    # file backend's temporary file beside the pointers.
    versions = registry_dir(daemon) / "names" / "crash" / "_versions"
    (versions / "000000999999.json#7").write_bytes(b'{"id": "tor')
    daemon = start_daemon(cwd=cwd)
    with Client(daemon.cwd / "chunkd.sock") as client:
        for version, ident in made:
            assert resolve(client, f"crash@{version}")[0]["snapshot"] == ident
        numbers = sorted(int(p.name[:12]) for p in versions.iterdir() if p.name.endswith(".json"))
        assert numbers == list(range(1, len(numbers) + 1))  # no gaps, no torn pointer
        for number in numbers:  # every pointer's manifest is there and whole
            header, manifest, _ = resolve(client, f"crash@{number}")
            Snapshot.parse(manifest, expect_id=header["snapshot"])
        member = Member("data/b.bin", stat.size, stat.version, "fixed", 10**6, {})
        snap = Snapshot.build(backend="local", prefix="data/", format="fixed", members=[member])
        assert commit(client, snap, "crash")["version"] == numbers[-1] + 1
        assert resolve(client, "crash")[0]["snapshot"] == snap.id


# -- freeze, GC, migrate -----------------------------------------------------------------


def frozen_bytes(client: Client, daemon: Daemon, frozen: bytes, index: int) -> bytes:
    import json

    record = json.loads(frozen)
    ids = record_chunk_lists(registry_dir(daemon), frozen)[index]
    out = b""
    for start in range(0, len(ids), 8):
        with client.request(
            "ckpt_chunks", {"backend": record["backend"], "ids": ids[start : start + 8]}
        ) as reply:
            out += b"".join(fd_bytes(fd) for fd in reply.fds)
    return out


def test_freeze_survives_a_rewrite_and_gc(node: tuple[Daemon, Client]) -> None:
    daemon, client = node
    root = data_dir(daemon)
    write_objects(root, FILES)
    keys = sorted(FILES)
    snap = snapshot_of(client, keys)
    commit(client, snap, "frz")
    report = client.request("ds_freeze", {"ref": "frz@1"}, timeout=120).header
    assert report["snapshot"] == snap.id
    assert (report["members"], report["bytes"]) == (3, sum(len(FILES[k]) for k in keys))
    assert report["chunks"] == sum(-(-len(FILES[k]) // client.chunk_bytes) for k in keys)
    assert report["uploaded"] == report["chunks"]
    assert not report["already"]
    assert client.request("ds_freeze", {"ref": snap.id}).header["already"] is True
    # The sources change and vanish.
    (root / "data/a.bin").write_bytes(os.urandom(100))
    (root / "data/sub/c.bin").unlink()
    time.sleep(1.1)  # the embedded backend re-checks versions after a second
    header, _, frozen = resolve(client, "frz")
    assert header["frozen"] is True
    assert header["chunks_backend"] == "local"
    assert frozen is not None
    # Garbage: an old chunk nothing names. The freeze's intents expire (two days old),
    # so only the frozen record keeps its chunks.
    chunks = root / "chunks"
    garbage = os.urandom(1000)
    junk = chunks / blake3.blake3(garbage).hexdigest()
    junk.write_bytes(garbage)
    two_days_ago = time.time() - 2 * 86400
    for path in [*chunks.iterdir(), *(root / "intents").iterdir()]:
        os.utime(path, (two_days_ago, two_days_ago))
    out = chunkd_cli(daemon, "gc", "local", "--grace", "0s")
    assert "removed 1" in out, out
    assert not junk.exists()
    assert not list((root / "intents").iterdir())
    for index, key in enumerate(keys):
        assert frozen_bytes(client, daemon, frozen, index) == FILES[key]
    # in the backend itself, not only cached
    for ids in record_chunk_lists(registry_dir(daemon), frozen):
        for cid in ids:
            assert blake3.blake3((chunks / cid).read_bytes()).hexdigest() == cid
    # A snapshot that is not frozen drifts.
    fresh = snapshot_of(client, ["data/a.bin", "data/b.bin"])
    commit(client, fresh, "drift")
    (root / "data/b.bin").write_bytes(os.urandom(RECORD * 10))
    time.sleep(1.1)
    with pytest.raises(SnapshotDriftError, match=r"member local/data/b\.bin of snapshot"):
        client.request("ds_freeze", {"ref": "drift"})
    (root / "data/a.bin").unlink()
    time.sleep(1.1)
    with pytest.raises(SnapshotDriftError, match=r"local/data/a\.bin .* gone"):
        client.request("ds_freeze", {"ref": "drift"})
    assert not (registry_dir(daemon) / "frozen" / f"{fresh.id}.json").exists()


def test_migrate_copies_verifies_and_registers_a_new_version(
    node: tuple[Daemon, Client],
) -> None:
    daemon, client = node
    root = data_dir(daemon)
    write_objects(root, FILES)
    keys = sorted(FILES)
    snap = snapshot_of(client, keys)
    commit(client, snap, "mig")
    got = client.request("ds_migrate", {"ref": "mig@1", "to": "local/copy"}, timeout=120).header
    assert (got["name"], got["version"], got["from"], got["frozen"]) == ("mig", 2, snap.id, False)
    assert (got["members"], got["copied"], got["kept"]) == (3, 3, 0)
    header, manifest, _ = resolve(client, "mig@2")
    copy = Snapshot.parse(manifest, expect_id=header["snapshot"], pages=DaemonPages(client))
    assert (copy.backend, copy.prefix) == ("local", "copy/")
    assert [m.key for m in copy.members] == ["copy/a.bin", "copy/b.bin", "copy/sub/c.bin"]
    assert [(m.size, m.samples, m.format, dict(m.meta)) for m in copy.members] == [
        (m.size, m.samples, m.format, dict(m.meta)) for m in snap.members
    ]
    for key in keys:
        assert (root / "copy" / key.removeprefix("data/")).read_bytes() == FILES[key]
        assert bytes(client.read(f"local/copy/{key.removeprefix('data/')}")) == FILES[key]
    # Twice is harmless: the copies are there, nothing is rewritten.
    again = client.request("ds_migrate", {"ref": "mig@1", "to": "local/copy"}).header
    assert (again["version"], again["created"], again["kept"]) == (2, False, 3)
    # A frozen snapshot migrates from its chunks, even when its sources are gone.
    client.request("ds_freeze", {"ref": "mig@1"})
    for key in keys:
        (root / key).unlink()
    time.sleep(1.1)
    moved = client.request(
        "ds_migrate", {"ref": snap.id, "to": "local/elsewhere", "name": "mig2"}
    ).header
    assert (moved["name"], moved["version"], moved["frozen"]) == ("mig2", 1, True)
    for key in keys:
        assert (root / "elsewhere" / key.removeprefix("data/")).read_bytes() == FILES[key]
    with pytest.raises(InvalidRequestError, match="at local/copy already"):
        client.request("ds_migrate", {"ref": "mig@2", "to": "local/copy"})
    with pytest.raises(InvalidRequestError, match="names no dataset"):
        client.request("ds_migrate", {"ref": snap.id, "to": "local/x"})


def test_a_freeze_writes_its_intent_and_waits_for_a_running_collection(
    node: tuple[Daemon, Client],
) -> None:
    import json

    daemon, client = node
    root = data_dir(daemon)
    write_objects(root, FILES)
    snap = snapshot_of(client, sorted(FILES))
    commit(client, snap, "wait")
    # The barrier of a collection that is sweeping (it never changes: after the expiry
    # it declares, the freeze takes it for dead and goes on).
    barrier = root / "gc" / "sweeping.json"
    barrier.parent.mkdir()
    barrier.write_text(json.dumps({"format": "chunkd-gc-barrier", "expires_after": 2}))
    waits = daemon.metric("chunkd_checkpoint_gc_barrier_waits_total")
    started = time.monotonic()
    report = client.request("ds_freeze", {"ref": "wait"}, timeout=60).header
    assert time.monotonic() - started >= 2
    assert daemon.metric("chunkd_checkpoint_gc_barrier_waits_total") == waits + 1
    (intent,) = (root / "intents").iterdir()
    assert intent.name.startswith("ds-")
    named = set(json.loads(intent.read_text())["chunks"])
    _, _, frozen = resolve(client, "wait")
    assert frozen is not None
    ids = {c for member in record_chunk_lists(registry_dir(daemon), frozen) for c in member}
    assert named == ids
    assert len(ids) == report["chunks"]


async def test_a_freeze_that_outlives_the_intent_ttl_keeps_or_refuses_its_chunks(
    inproc: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collection deletes intents older than its intent_ttl. A freeze stalled past
    it rewrites its intents meanwhile; one that could not fails, naming no chunk lost."""

    root = tmp_path / "local"
    backend = inproc.backends.get("local")
    get, stream_range = backend.get, backend.stream_range
    stalls: dict[str, asyncio.Event] = {}
    go = asyncio.Event()

    async def hold(key: str) -> None:
        if key in stalls:  # the freeze stalls after its first intent's chunks
            stalls[key].set()
            await go.wait()

    async def held_get(key: str, *args: Any, **kwargs: Any) -> Any:
        await hold(key)
        return await get(key, *args, **kwargs)

    async def held_stream(meta: Any, *args: Any, **kwargs: Any) -> AsyncIterator[memoryview]:
        await hold(meta.key)
        async for piece in stream_range(meta, *args, **kwargs):
            yield piece

    monkeypatch.setattr(backend, "get", held_get)
    monkeypatch.setattr(backend, "stream_range", held_stream)

    async def stalled_freeze(datasets: Datasets, name: str) -> tuple[Snapshot, dict[str, Any]]:
        # The first member fills one intent (256 chunks of 4 KiB) and more; the second
        # is read after that intent's chunks are sent, and stalls.
        first, second = f"data/{name}/a.bin", f"data/{name}/b.bin"
        write_objects(root, {first: os.urandom(300 * 4096), second: os.urandom(4096)})
        snap = await inproc_snapshot(inproc, [first, second], prefix=f"data/{name}/")
        await put_pages(datasets, snap)
        await datasets.commit(snap.data, name)
        stalls[second] = asyncio.Event()
        go.clear()
        freezing = asyncio.create_task(datasets.freeze(name))
        await asyncio.wait_for(stalls[second].wait(), 30)
        await asyncio.sleep(1.5)  # past the collection's intent_ttl below
        await inproc.checkpoints.gc("local", keep_last=None, grace=0, dry_run=False, intent_ttl=1)
        go.set()
        return snap, await freezing

    # No refresh within the test: the collection takes the first intent's chunks, and
    # the freeze says so rather than write a record that names them.
    with pytest.raises(DatasetError, match=r"gone from local/chunks/.*run freeze again"):
        await stalled_freeze(inproc_datasets(inproc), "stale")
    assert not list((root / "datasets" / "frozen").glob("*.json"))
    # Intents rewritten every 0.2 s: the same stall loses nothing.
    snap, report = await stalled_freeze(inproc_datasets(inproc, intent_refresh=0.2), "fresh")
    assert report["chunks"] == 301
    raw = (root / "datasets" / "frozen" / f"{snap.id}.json").read_bytes()
    named = {c for member in record_chunk_lists(root / "datasets", raw) for c in member}
    assert len(named) == 301
    assert all((root / "chunks" / cid).exists() for cid in named)


def test_migrate_never_overwrites_other_bytes_nor_its_own_source(
    node: tuple[Daemon, Client],
) -> None:
    daemon, client = node
    root = data_dir(daemon)
    write_objects(root, FILES)
    snap = snapshot_of(client, sorted(FILES))
    commit(client, snap, "safe")
    # Another object where a copy would go: refused by name, left as it was.
    other = os.urandom(len(FILES["data/b.bin"]))
    write_objects(root, {"copy/b.bin": other})
    with pytest.raises(DatasetError, match=r"local/copy/b\.bin exists already with other bytes"):
        client.request("ds_migrate", {"ref": "safe@1", "to": "local/copy"}, timeout=120)
    assert (root / "copy/b.bin").read_bytes() == other
    assert resolve(client, "safe")[0]["version"] == 1  # nothing registered
    # The same bytes there already: kept, the rest copied.
    write_objects(root, {"again/a.bin": FILES["data/a.bin"]})
    got = client.request("ds_migrate", {"ref": "safe@1", "to": "local/again"}, timeout=120).header
    assert (got["version"], got["copied"], got["kept"]) == (2, 2, 1)
    # A destination inside the source, or holding it (the root holds every prefix).
    for to in ("local/data/inner", "local", "local/"):
        with pytest.raises(InvalidRequestError, match="one inside the other"):
            client.request("ds_migrate", {"ref": "safe@1", "to": to})
    sub = snapshot_of(client, ["data/sub/c.bin"], prefix="data/sub/")
    commit(client, sub, "sub")
    with pytest.raises(InvalidRequestError, match="one inside the other"):
        client.request("ds_migrate", {"ref": "sub", "to": "local/data"})
    assert not (root / "data/c.bin").exists()


async def test_a_copy_of_a_dataset_at_a_backend_root_matches_it_key_for_key(
    inproc: Node, tmp_path: Path
) -> None:
    from chunkd.snapshot import diff as diff_snapshots

    # Backend 'root' is a folder holding only the dataset: its prefix is "".
    files = {"a.bin": os.urandom(3 * 4096 + 16), "sub/c.bin": os.urandom(RECORD * 4)}
    write_objects(tmp_path / "root", files)
    snap = await inproc_snapshot(inproc, sorted(files), backend="root", prefix="")
    await put_pages(inproc.datasets, snap)
    await inproc.datasets.commit(snap.data, "rooted")
    got = await inproc.datasets.migrate("rooted", "local/copy/moved")
    assert (got["version"], got["copied"]) == (2, 2)
    resolved, _ = await inproc.datasets.resolve("rooted@2")
    copy = resolved.snapshot
    # daemon code loads a paged snapshot's pages before it reads their members
    await inproc.datasets.registry.load_pages(copy, range(len(copy.pages)))
    assert (copy.backend, copy.prefix) == ("local", "copy/moved/")
    assert [m.key for m in copy.members] == ["copy/moved/a.bin", "copy/moved/sub/c.bin"]
    assert [m.relative(copy.prefix) for m in copy.members] == [
        m.relative(snap.prefix) for m in snap.members
    ]
    diff = diff_snapshots(snap, copy)
    assert (diff["added"], diff["removed"], diff["changed"]) == ([], [], [])
    for key, data in files.items():
        assert (tmp_path / "local" / "copy/moved" / key).read_bytes() == data


def test_damaged_pointers_tags_and_frozen_records_are_repaired_by_writing_again(
    node: tuple[Daemon, Client],
) -> None:
    import json

    daemon, client = node
    write_objects(data_dir(daemon), FILES)
    first = snapshot_of(client, ["data/a.bin"])
    second = snapshot_of(client, ["data/b.bin"])
    third = snapshot_of(client, ["data/sub/c.bin"], prefix="data/sub/")
    commit(client, first, "fix")
    commit(client, second, "fix")
    names = registry_dir(daemon) / "names" / "fix"
    # The highest pointer damaged: resolving the name says so (no older version
    # instead), and the next commit takes the next number.
    (names / "_versions" / "000000000002.json").write_bytes(b'{"id": "tor')
    with pytest.raises(ManifestError, match=r"000000000002\.json is damaged"):
        resolve(client, "fix")
    assert resolve(client, "fix@1")[0]["snapshot"] == first.id
    assert commit(client, second, "fix")["version"] == 3
    assert resolve(client, "fix")[0]["snapshot"] == second.id
    with pytest.raises(ManifestError, match=r"000000000002\.json is damaged"):
        resolve(client, "fix@2")
    # Listing the versions names the damaged one, and lists the others around it.
    with client.request("ds_versions", {"name": "fix"}) as reply:
        versions = listing(reply)
    assert [v["version"] for v in versions] == [1, 2, 3]
    assert versions[1]["snapshot"] is None
    assert "000000000002.json is damaged" in versions[1]["damaged"]["error"]
    # The head of a tag damaged: the tag moves past it.
    client.request("ds_tag", {"name": "fix", "tag": "prod", "ref": "1"})
    (names / "_tags" / "prod" / "000000000001.json").write_bytes(b"\x00garbage")
    with pytest.raises(ManifestError, match="is damaged"):
        resolve(client, "fix@prod")
    moved = client.request("ds_tag", {"name": "fix", "tag": "prod", "ref": "3"}).header
    assert (moved["seq"], moved["version"]) == (2, 3)
    assert resolve(client, "fix@prod")[0]["snapshot"] == second.id
    # A frozen record damaged, or of other members: freezing again writes a good one.
    commit(client, third, "cold")
    record = registry_dir(daemon) / "frozen" / f"{third.id}.json"
    client.request("ds_freeze", {"ref": "cold"}, timeout=60)
    good = json.loads(record.read_bytes())
    other = good | {"totals": {"members": 0, "chunks": 0}, "pages": []}
    for damage in (b'{"format": "chunkd-dataset-fro', json.dumps(other).encode()):
        record.write_bytes(damage)
        with pytest.raises(ManifestError, match="freeze the snapshot again"):
            resolve(client, "cold")
        again = client.request("ds_freeze", {"ref": "cold"}, timeout=60).header
        assert (again["already"], again["uploaded"]) == (False, 0)
        _, _, frozen = resolve(client, "cold")
        assert frozen is not None
        assert json.loads(frozen)["pages"] == good["pages"]


async def test_a_freeze_names_the_member_that_changed_and_the_registry_that_is_down(
    inproc: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "local"
    write_objects(root, {"data/v/a.bin": os.urandom(8 * 4096)})
    snap = await inproc_snapshot(inproc, ["data/v/a.bin"], prefix="data/v/")
    await put_pages(inproc.datasets, snap)
    await inproc.datasets.commit(snap.data, "moving")
    await inproc.datasets.commit(snap.data, "down")
    backend = inproc.backends.get("local")
    put = backend.put

    async def nothing_cached(cid: Any) -> None:
        return None

    lookup = inproc.cache.lookup

    async def nothing_leased(locator: Any) -> tuple[Any, None]:
        ref, lease = await lookup(locator)
        if lease is not None:
            lease.release()
        return ref, None

    async def rewriting_put(key: str, *args: Any, **kwargs: Any) -> bool:
        if key.startswith("intents/"):  # the member changes between its read and upload
            path = root / "data/v/a.bin"
            path.write_bytes(os.urandom(8 * 4096 + 1))
            later = time.time() + 10
            os.utime(path, (later, later))
        return await put(key, *args, **kwargs)

    # The chunks read must be read again to be sent (none is cached any more), and
    # the member changed meanwhile.
    monkeypatch.setattr(inproc.cache, "find", nothing_cached)
    monkeypatch.setattr(inproc.cache, "lookup", nothing_leased)
    monkeypatch.setattr(backend, "put", rewriting_put)
    with pytest.raises(
        SnapshotDriftError,
        match=r"member local/data/v/a\.bin of snapshot \w+ changed while it was frozen",
    ):
        await inproc.datasets.freeze("moving")
    monkeypatch.undo()

    # The registry goes down after the freeze resolved its snapshot.
    async def down_put(key: str, *args: Any, **kwargs: Any) -> bool:
        if key.startswith("intents/"):
            raise BackendUnavailableError("backend 'local': connection refused")
        return await put(key, *args, **kwargs)

    write_objects(root, {"data/w/a.bin": os.urandom(4 * 4096)})
    fresh = await inproc_snapshot(inproc, ["data/w/a.bin"], prefix="data/w/")
    await put_pages(inproc.datasets, fresh)
    await inproc.datasets.commit(fresh.data, "down")
    monkeypatch.setattr(backend, "put", down_put)
    with pytest.raises(
        BackendUnavailableError,
        match=r"freezing down: the dataset registry local/datasets cannot be reached",
    ):
        await inproc.datasets.freeze("down")
