"""A content address is trusted only once verified: damaged chunks are repaired or scrubbed.

Two real daemons share one file backend (a cluster's object store). A chunk in
``chunks/`` whose bytes are not its name's (planted before the reserved-prefix rule, or
damaged since) is found by the node that reads it, rewritten by the next save or freeze
that holds its bytes, and found everywhere by ``chunkd gc BACKEND --scrub``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import blake3
import numpy as np
import pytest

from chunkd import memfd
from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.errors import IntegrityError
from chunkd.snapshot import Member, Snapshot
from tests.conftest import Daemon, small_node_toml

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
def nodes(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Iterator[tuple[Client, Client]]:
    """Two daemons, a and b, over one shared backend; each has its own cache."""
    (tmp_path / "shared").mkdir()
    a = start_daemon(config(tmp_path, "a"), cwd=tmp_path / "a")
    b = start_daemon(config(tmp_path, "b"), cwd=tmp_path / "b")
    with Client(a.cwd / "chunkd.sock") as ca, Client(b.cwd / "chunkd.sock") as cb:
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


def is_sound(store: Path, cid: str) -> bool:
    return blake3.blake3((store / "chunks" / cid).read_bytes()).hexdigest() == cid


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
    (store / "data").mkdir()
    (store / "data/m.bin").write_bytes(data)
    stat = a.stat("shared/data/m.bin")
    snap = Snapshot.build(
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
        a.request("ds_commit", {"name": "frz"}, fds=[fd], timeout=60)
    finally:
        os.close(fd)
    assert a.request("ds_freeze", {"ref": "frz"}, timeout=60).header["uploaded"] == 3
    record = json.loads((store / f"datasets/frozen/{snap.id}.json").read_bytes())
    ids = record["members"][0]
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
    removed = scrub_cli(socket, "--remove")
    assert removed.returncode == 1, removed.stderr
    assert "removed 2" in removed.stdout
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
