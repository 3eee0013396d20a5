"""A content address is trusted only once verified: damaged chunks are repaired or scrubbed.

Two real daemons share one file backend (a cluster's object store). A chunk in
``chunks/`` whose bytes are not its name's (planted before the reserved-prefix rule, or
damaged since) is found by the node that reads it, rewritten by the next save or freeze
that holds its bytes, and found everywhere by ``chunkd gc BACKEND --scrub``.

No object under ``chunks/`` is read whole without a bound: one larger than any chunk is
damaged unread. ``--scrub --remove`` takes the collection's side of the barrier
protocol: the race with a save that repairs a chunk is run with a scrub in this process
(its delete held at the moment that matters) against a real daemon's save.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import blake3
import numpy as np
import pytest

from chunkd import memfd
from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.errors import IntegrityError
from chunkd.gateway.backends.file import FileBackend
from chunkd.gateway.checkpoints.scrub import scrub
from chunkd.gateway.chunkstore import MAX_CHUNK_BYTES, DamagedChunks
from chunkd.gateway.config import BackendConfig
from chunkd.gateway.metrics import Metrics
from chunkd.snapshot import Member, Snapshot
from tests.conftest import Daemon, small_node_toml
from tests.frozen_records import record_chunk_lists

CHUNK = 1 << 20
BIN = Path(sys.executable).parent


def config(tmp_path: Path, node: str) -> str:
    return (
        small_node_toml(
            tmp_path / node / "cache", ("shared", tmp_path / "shared"), chunk_bytes="1MiB"
        )
        + """
[datasets]
registry = "shared/datasets"
"""
    )


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Daemon:
    """Daemon a over the shared backend ``tmp_path/shared``."""
    (tmp_path / "shared").mkdir()
    return start_daemon(config(tmp_path, "a"), cwd=tmp_path / "a")


@pytest.fixture
def nodes(
    node: Daemon, start_daemon: Callable[..., Daemon], tmp_path: Path
) -> Iterator[tuple[Client, Client]]:
    """Two daemons, a and b, over one shared backend; each has its own cache."""
    b = start_daemon(config(tmp_path, "b"), cwd=tmp_path / "b")
    with Client(node.cwd / "chunkd.sock") as ca, Client(b.cwd / "chunkd.sock") as cb:
        yield ca, cb


def chunk_ids(client: Client, name: str) -> list[str]:
    manifest = ckpt.manifest(name, client=client)
    ids = []
    for part in manifest["parts"]:
        for segment in part["segments"]:
            ids.extend(cid for cid, _ in segment["chunks"])
    return ids


def poison(store: Path, cid: str, *, size: int | None = None) -> bytes:
    """Replace chunk ``cid``'s bytes with others (of the same size unless ``size``)."""
    path = store / "chunks" / cid
    bad = os.urandom(path.stat().st_size if size is None else size)
    path.write_bytes(bad)
    return bad


def plant_large(store: Path, cid: str, size: int) -> None:
    """Make chunk ``cid`` a sparse file of ``size`` bytes (costs no disk)."""
    with (store / "chunks" / cid).open("r+b") as f:
        f.truncate(size)


def is_sound(store: Path, cid: str) -> bool:
    return blake3.blake3((store / "chunks" / cid).read_bytes()).hexdigest() == cid


def read_bytes(daemon: Daemon) -> float:
    return daemon.metric("chunkd_backend_read_bytes_total", backend="shared")


def barrier_waits(daemon: Daemon) -> float:
    return daemon.metric("chunkd_checkpoint_gc_barrier_waits_total")


def barriers(store: Path) -> list[str]:
    return sorted(p.name for p in (store / "gc").glob("*.json")) if (store / "gc").exists() else []


@pytest.mark.timeout(90)
def test_a_save_rewrites_a_chunk_read_damaged_or_of_the_wrong_size(
    nodes: tuple[Client, Client], tmp_path: Path
) -> None:
    a, b = nodes
    store = tmp_path / "shared"
    state = {"w": np.random.default_rng(1).standard_normal(3 * CHUNK // 4, dtype=np.float32)}
    ckpt.save(state, "shared/run/step-1", client=a, world_size=1, timeout=60)
    ids = chunk_ids(a, "shared/run/step-1")
    assert len(ids) == 3
    # Someone replaces a chunk with other bytes of the same size. Node a, which never
    # read it back, dedups against it: its size is right.
    poison(store, ids[0])
    ckpt.save(state, "shared/run/step-2", client=a, world_size=1, timeout=60)
    assert not is_sound(store, ids[0])
    # Node b reads it from the backend: damaged, and noted.
    with pytest.raises(IntegrityError, match=f"chunk {ids[0]} in backend 'shared' is damaged"):
        ckpt.load("shared/run/step-2", client=b)
    # b's next save holding those bytes writes them again ...
    ckpt.save(state, "shared/run/step-3", client=b, world_size=1, timeout=60)
    assert is_sound(store, ids[0])
    # ... and the checkpoints that named them load everywhere.
    for step in (1, 2, 3):
        got = ckpt.load(f"shared/run/step-{step}", client=b)
        np.testing.assert_array_equal(got["w"], state["w"])
    # A chunk of the wrong size is rewritten by any node's save, read or not.
    poison(store, ids[1], size=100)
    ckpt.save(state, "shared/run/step-4", client=a, world_size=1, timeout=60)
    assert is_sound(store, ids[1])
    assert all(is_sound(store, cid) for cid in ids)


@pytest.mark.timeout(90)
def test_a_freeze_rewrites_a_frozen_chunk_read_damaged(
    nodes: tuple[Client, Client], tmp_path: Path
) -> None:
    a, b = nodes
    store = tmp_path / "shared"
    data = os.urandom(2 * CHUNK + 1000)
    snap = register_one(a, store, "frz", data)
    assert a.request("ds_freeze", {"ref": "frz"}, timeout=60).header["uploaded"] == 3
    record = (store / f"datasets/frozen/{snap.id}.json").read_bytes()
    ids = record_chunk_lists(store / "datasets", record)[0]
    poison(store, ids[1])
    assert a.request("ds_freeze", {"ref": "frz"}, timeout=60).header["already"] is True
    with pytest.raises(IntegrityError, match="is damaged"):
        b.request("ckpt_chunks", {"backend": "shared", "ids": [ids[1]]}, timeout=60)
    again = b.request("ds_freeze", {"ref": "frz"}, timeout=60).header
    assert again["already"] is False
    assert is_sound(store, ids[1])
    with b.request("ckpt_chunks", {"backend": "shared", "ids": ids}, timeout=60) as reply:
        got = b"".join(os.pread(fd, os.fstat(fd).st_size, 0) for fd in reply.fds)
    assert got == data


def register_one(client: Client, store: Path, name: str, data: bytes) -> Snapshot:
    """Dataset ``name``: one member, ``data/m.bin`` of the shared store, holding ``data``."""
    (store / "data").mkdir()
    (store / "data/m.bin").write_bytes(data)
    stat = client.stat("shared/data/m.bin")
    snap = Snapshot.build(
        schema=1,
        backend="shared",
        prefix="data/",
        format="fixed",
        members=[
            Member(
                "data/m.bin", stat.size, stat.version, "fixed", stat.size // 8, {"record_bytes": 8}
            )
        ],
    )
    fd = memfd.sealed(snap.data)
    try:
        client.request("ds_commit", {"name": name}, fds=[fd], timeout=60)
    finally:
        os.close(fd)
    return snap


@pytest.mark.timeout(60)
def test_migrating_a_frozen_snapshot_reads_no_chunk_larger_than_its_record_allows(
    node: Daemon, tmp_path: Path
) -> None:
    store = tmp_path / "shared"
    with Client(node.cwd / "chunkd.sock") as client:
        snap = register_one(client, store, "frz", os.urandom(2 * CHUNK + 1000))
        client.request("ds_freeze", {"ref": "frz"}, timeout=60)
        record = (store / f"datasets/frozen/{snap.id}.json").read_bytes()
        ids = record_chunk_lists(store / "datasets", record)[0]
        plant_large(store, ids[0], 48 << 20)
        before = read_bytes(node)
        with pytest.raises(IntegrityError, match=f"chunk {ids[0]} in shared is damaged"):
            client.request("ds_migrate", {"ref": "frz", "to": "shared/copy"}, timeout=60)
        assert read_bytes(node) - before < 4 * CHUNK
    assert not (store / "copy").exists()


def scrub_cli(socket: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "chunkd"), "gc", "shared", "--scrub", *args, "--socket", str(socket)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(90)
def test_scrub_reports_and_removes_chunks_that_do_not_match_their_names(
    nodes: tuple[Client, Client], tmp_path: Path
) -> None:
    a, _ = nodes
    store = tmp_path / "shared"
    state = {"w": np.arange(5 * CHUNK // 4, dtype=np.float32)}
    ckpt.save(state, "shared/run/step-1", client=a, world_size=1, timeout=60)
    ids = sorted(chunk_ids(a, "shared/run/step-1"))
    assert len(ids) == 5
    poison(store, ids[1])
    poison(store, ids[3], size=7)
    (store / "chunks/not-a-chunk").write_bytes(b"x")
    socket = tmp_path / "a" / "chunkd.sock"
    found = scrub_cli(socket)
    assert found.returncode == 1, found.stderr
    assert f"chunks/{ids[1]}: its 1048576 bytes hash to" in found.stdout
    assert f"chunks/{ids[3]}: its 7 bytes hash to" in found.stdout
    assert "chunks/not-a-chunk: not a chunk id" in found.stdout
    assert "checked 5 chunks" in found.stdout
    assert "3 problems" in found.stdout
    assert (store / "chunks" / ids[1]).exists()  # reported, not removed
    # Page by page through the op, the same answer.
    seen: list[str] = []
    after = None
    while True:
        page = a.request(
            "ckpt_scrub", {"backend": "shared", "start_after": after, "limit": 2}
        ).header
        seen += [d["key"] for d in page["damaged"]]
        after = page["next"]
        if after is None:
            break
    assert sorted(seen) == sorted([f"chunks/{ids[1]}", f"chunks/{ids[3]}", "chunks/not-a-chunk"])
    # The save's intent names them (kept a day after its commit, as a save in flight
    # keeps its own): a save may be repairing them, so --remove leaves them.
    kept = scrub_cli(socket, "--remove")
    assert kept.returncode == 1, kept.stderr
    assert "removed 0" in kept.stdout
    assert kept.stdout.count("not removed: a save or freeze in flight names it") == 2
    assert (store / "chunks" / ids[1]).exists()
    assert barriers(store) == []  # its barrier came and went
    for intent in (store / "intents").glob("*.json"):  # a day later, the collection's
        intent.unlink()
    removed = scrub_cli(socket, "--remove")
    assert removed.returncode == 1, removed.stderr
    assert "removed 2" in removed.stdout
    assert barriers(store) == []
    assert not (store / "chunks" / ids[1]).exists()
    assert not (store / "chunks" / ids[3]).exists()
    assert (store / "chunks/not-a-chunk").exists()  # not chunkd's: left alone
    assert all(is_sound(store, c) for c in ids if c not in (ids[1], ids[3]))
    # The next save sends them again; the store is clean after.
    ckpt.save(state, "shared/run/step-2", client=a, world_size=1, timeout=60)
    (store / "chunks/not-a-chunk").unlink()
    clean = scrub_cli(socket)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "checked 5 chunks" in clean.stdout
    assert "no problems" in clean.stdout
    np.testing.assert_array_equal(ckpt.load("shared/run/step-1", client=a)["w"], state["w"])


@pytest.mark.timeout(60)
def test_a_save_replaces_a_chunk_of_the_wrong_size_without_reading_it(
    node: Daemon, tmp_path: Path
) -> None:
    store = tmp_path / "shared"
    state = {"w": np.random.default_rng(2).standard_normal(3 * CHUNK // 4, dtype=np.float32)}
    with Client(node.cwd / "chunkd.sock") as client:
        ckpt.save(state, "shared/run/step-1", client=client, world_size=1, timeout=60)
        ids = chunk_ids(client, "shared/run/step-1")
        # A planted object far larger than any chunk, under a chunk's name.
        plant_large(store, ids[0], 48 << 20)
        before = read_bytes(node)
        ckpt.save(state, "shared/run/step-2", client=client, world_size=1, timeout=60)
        read = read_bytes(node) - before
    assert is_sound(store, ids[0])
    # Its size said it was damaged: only the replacement was read back (and small
    # documents), nothing of the 48 MiB.
    assert read < 2 * CHUNK, read


@pytest.mark.timeout(60)
def test_scrub_reports_an_object_larger_than_any_chunk_without_reading_it(
    node: Daemon, tmp_path: Path
) -> None:
    store = tmp_path / "shared"
    state = {"w": np.arange(3 * CHUNK // 4, dtype=np.float32)}
    with Client(node.cwd / "chunkd.sock") as client:
        ckpt.save(state, "shared/run/step-1", client=client, world_size=1, timeout=60)
        ids = sorted(chunk_ids(client, "shared/run/step-1"))
        huge = MAX_CHUNK_BYTES + (36 << 20)
        plant_large(store, ids[1], huge)
        before = read_bytes(node)
        page = client.request("ckpt_scrub", {"backend": "shared"}, timeout=60).header
        read = read_bytes(node) - before
    assert page["damaged"] == [
        {
            "key": f"chunks/{ids[1]}",
            "problem": f"{huge} bytes, more than any chunk ({MAX_CHUNK_BYTES}): not read",
        }
    ]
    assert (page["checked"], page["bytes"]) == (2, 2 * CHUNK)
    assert read <= 2 * CHUNK, read  # the two sound chunks, nothing of the large one
    for intent in (store / "intents").glob("*.json"):
        intent.unlink()
    removed = scrub_cli(node.cwd / "chunkd.sock", "--remove")
    assert "removed 1" in removed.stdout, removed.stdout + removed.stderr
    assert not (store / "chunks" / ids[1]).exists()
    assert read_bytes(node) - before <= 4 * CHUNK


class HeldDeletes(FileBackend):
    """A file backend whose deletes under ``chunks/`` first await ``hold(key)``: the
    moment between a scrub's last look at a chunk and its delete, held open."""

    hold: Callable[[str], Awaitable[None]] | None = None

    async def delete(self, key: str) -> None:
        if self.hold is not None and key.startswith("chunks/"):
            await self.hold(key)
        await super().delete(key)


def held_backend(store: Path) -> HeldDeletes:
    """The shared store as an in-process backend (1 s per request, no retries)."""
    return HeldDeletes(
        BackendConfig("shared", f"file://{store}", writable=True, timeout=1.0, retries=0),
        Metrics(),
    )


@pytest.mark.timeout(60)
async def test_scrub_remove_never_deletes_a_chunk_a_save_just_repaired(
    node: Daemon, tmp_path: Path
) -> None:
    store = tmp_path / "shared"
    socket = node.cwd / "chunkd.sock"
    state = {"w": np.random.default_rng(3).standard_normal(3 * CHUNK // 4, dtype=np.float32)}

    def save(name: str) -> None:
        with Client(socket) as client:
            ckpt.save(state, name, client=client, world_size=1, timeout=60)

    await asyncio.to_thread(save, "shared/run/step-1")
    with Client(socket) as client:
        ids = chunk_ids(client, "shared/run/step-1")
    poison(store, ids[0], size=100)  # any save repairs it: its size is wrong
    for intent in (store / "intents").glob("*.json"):  # step-1's, a day later
        intent.unlink()
    backend = held_backend(store)
    saving: list[asyncio.Task[None]] = []

    async def hold(key: str) -> None:
        # The scrub has read the chunk again and found it damaged; before its delete,
        # a save on the node repairs it and commits (or waits for the scrub's barrier).
        waits = await asyncio.to_thread(barrier_waits, node)
        saving.append(asyncio.create_task(asyncio.to_thread(save, "shared/run/step-2")))
        for _ in range(400):
            if saving[0].done() or await asyncio.to_thread(barrier_waits, node) > waits:
                return  # saved, or waiting for the scrub's barrier
            await asyncio.sleep(0.05)

    backend.hold = hold
    try:
        page = await scrub(backend, DamagedChunks(), remove=True)
    finally:
        await backend.close()
    await asyncio.wait_for(saving[0], 30)
    assert page.removed == 1  # the damaged copy it read
    # The committed checkpoint names no chunk that is gone, nor a damaged one.
    with Client(socket) as client:
        named = chunk_ids(client, "shared/run/step-2")
        got = ckpt.load("shared/run/step-2", client=client)
    assert all((store / "chunks" / c).exists() and is_sound(store, c) for c in named)
    np.testing.assert_array_equal(got["w"], state["w"])
    assert barrier_waits(node) == 1  # the save waited for the scrub's barrier
    assert barriers(store) == []


@pytest.mark.timeout(30)
async def test_a_scrub_that_ends_mid_delete_removes_its_barrier(tmp_path: Path) -> None:
    store = tmp_path / "shared"
    (store / "chunks").mkdir(parents=True)
    cid = blake3.blake3(b"the true bytes").hexdigest()
    (store / "chunks" / cid).write_bytes(b"other bytes")
    backend = held_backend(store)
    held = asyncio.Event()
    up: list[list[str]] = []

    async def hold(key: str) -> None:
        up.append(barriers(store))
        held.set()
        await asyncio.Event().wait()  # the client went away meanwhile

    backend.hold = hold
    try:
        task = asyncio.create_task(scrub(backend, DamagedChunks(), remove=True))
        await asyncio.wait_for(held.wait(), 10)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert len(up[0]) == 1  # its barrier was up while it deleted
        # The delete may still be on its way: the barrier stays for the request's
        # bound (1 s here), then goes.
        for _ in range(100):
            if not barriers(store):
                break
            await asyncio.sleep(0.1)
        assert barriers(store) == []
    finally:
        await backend.close()
    assert (store / "chunks" / cid).exists()


@pytest.mark.timeout(60)
def test_a_load_never_reads_an_object_larger_than_any_chunk(
    nodes: tuple[Client, Client], tmp_path: Path
) -> None:
    a, b = nodes
    store = tmp_path / "shared"
    state = {"w": np.arange(CHUNK // 4, dtype=np.float32)}
    ckpt.save(state, "shared/big/step-1", client=a, world_size=1, timeout=60)
    (cid,) = chunk_ids(a, "shared/big/step-1")
    path = store / "chunks" / cid
    good = path.read_bytes()
    with path.open("r+b") as f:
        f.truncate(MAX_CHUNK_BYTES + (1 << 20))  # sparse: 65 MiB that take no disk
    with pytest.raises(IntegrityError, match="more than any chunk"):
        ckpt.load("shared/big/step-1", client=b)
    # Written again by the next save that holds it (b noted it): b loads it then.
    ckpt.save(state, "shared/big/step-2", client=b, world_size=1, timeout=60)
    assert path.read_bytes() == good
    np.testing.assert_array_equal(ckpt.load("shared/big/step-1", client=b)["w"], state["w"])
