"""The local socket's authority model (docs/security.md) with real uids.

Each request is made by a forked child of the test that gives up root for a plain
uid (and groups) before it connects, so the daemon learns who asks from the kernel
(``SO_PEERCRED``, ``SO_PEERGROUPS``), as it does from trainers.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkd import memfd
from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.errors import CheckpointNotFoundError
from chunkd.snapshot import Member, Snapshot
from tests.conftest import Daemon, small_node_toml

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other uids")

OWNER, OTHER, ADMIN_GID = 20001, 20002, 20042
STATE = {"w": np.arange(4096, dtype=np.float32)}


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Iterator[tuple[Daemon, Path]]:
    # Every uid must reach the socket: a world-searchable directory, a 0666 socket.
    public = Path(tempfile.mkdtemp(prefix="chunkd-authority-"))
    public.chmod(0o755)
    (tmp_path / "data").mkdir()
    toml = f"""
[server]
socket_mode = "0666"
admin_group = "{ADMIN_GID}"
""" + small_node_toml(tmp_path / "cache", ("local", tmp_path / "data"))
    socket = public / "chunkd.sock"
    daemon = start_daemon(toml, env={"CHUNKD_SERVER_SOCKET": str(socket)})
    # Everything a child needs is imported by the test process first: once it is
    # another uid it cannot read root's interpreter files.
    with Client(socket) as client:
        ckpt.save(STATE, "local/warm/step-0", client=client, world_size=1, timeout=60)
        ckpt.load("local/warm/step-0", client=client)
    yield daemon, socket
    shutil.rmtree(public, ignore_errors=True)


def as_user(
    socket: Path,
    uid: int,
    work: Callable[[Client], Any],
    *,
    gid: int | None = None,
    groups: tuple[int, ...] = (),
) -> dict[str, Any]:
    """Run ``work(client)`` in a child that is ``uid`` (primary group ``gid``, default
    ``uid``; supplementary ``groups``) and connected as it; its result or its error."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        status = 0
        try:
            os.close(read_end)
            os.setgroups(list(groups))
            os.setgid(uid if gid is None else gid)
            os.setuid(uid)
            try:
                with Client(socket) as client:
                    out = {"ok": True, "result": work(client)}
            except Exception as exc:
                out = {"ok": False, "kind": type(exc).__name__, "message": str(exc)}
            os.write(write_end, json.dumps(out, default=str).encode())
        except BaseException:
            status = 1
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0, f"the child as uid {uid} failed before it could answer"
    assert data, f"the child as uid {uid} sent no answer"
    answer: dict[str, Any] = json.loads(data)
    return answer


def refused(answer: dict[str, Any], *words: str) -> None:
    assert not answer["ok"], answer
    assert answer["kind"] == "AccessDeniedError", answer
    for word in words:
        assert word in answer["message"], answer


def save(name: str, **options: Any) -> Callable[[Client], Any]:
    def work(client: Client) -> Any:
        ckpt.save(STATE, name, client=client, world_size=1, timeout=60, **options)
        return ckpt.manifest(name, client=client).get("owner")

    return work


def delete(name: str) -> Callable[[Client], Any]:
    return lambda client: ckpt.delete(name, client=client)


@pytest.mark.timeout(90)
def test_checkpoints_are_changed_and_removed_by_their_owner_or_an_admin(
    node: tuple[Daemon, Path], tmp_path: Path
) -> None:
    _, socket = node
    name = "local/ckpt/run/step-1"
    assert as_user(socket, OWNER, save(name)) == {"ok": True, "result": OWNER}
    # Anyone reads it.
    loaded = as_user(socket, OTHER, lambda c: ckpt.load(name, client=c)["w"].sum().item())
    assert loaded == {"ok": True, "result": float(STATE["w"].sum())}
    # Another user may not delete it, overwrite it, retire it, or scrub-remove chunks.
    refused(as_user(socket, OTHER, delete(name)), f"uid {OTHER} may not delete", f"uid {OWNER}")
    refused(as_user(socket, OTHER, save(name, overwrite=True)), "may not overwrite")
    # Retention counts and retires only one's own: the owner's are kept.
    retire = as_user(
        socket,
        OTHER,
        lambda c: ckpt.gc("local/ckpt/run", keep_last=0, grace=3600, client=c),
    )
    assert retire["ok"], retire
    assert (retire["result"]["retired"], retire["result"]["others_kept"]) == ([], 1)
    scrub = as_user(socket, OTHER, lambda c: list(ckpt.scrub("local", remove=True, client=c)))
    refused(scrub, "may not remove chunks")
    # Nothing of it changed.
    with Client(socket) as client:
        manifest = ckpt.manifest(name, client=client)
        assert manifest["owner"] == OWNER
        assert [e["name"] for e in ckpt.list("local/ckpt/run", client=client)] == [name]
    # The owner may overwrite and delete; the owner's own gc retires.
    assert as_user(socket, OWNER, save(name, overwrite=True)) == {"ok": True, "result": OWNER}
    assert as_user(socket, OWNER, save("local/ckpt/run/step-2"))["ok"]
    # Another user's checkpoint planted in the owner's run does not block its retention.
    assert as_user(socket, OTHER, save("local/ckpt/run/step-0"))["ok"]
    retired = as_user(
        socket,
        OWNER,
        lambda c: ckpt.gc("local/ckpt/run", keep_last=1, grace=3600, client=c),
    )
    assert retired["ok"], retired
    assert (retired["result"]["retired"], retired["result"]["others_kept"]) == ([name], 1)
    assert as_user(socket, OTHER, delete("local/ckpt/run/step-0"))["ok"]
    assert as_user(socket, OWNER, delete("local/ckpt/run/step-2")) == {"ok": True, "result": 2}
    # An admin, by the admin group (primary or supplementary), may do it all.
    assert as_user(socket, OWNER, save("local/ckpt/run/step-3"))["ok"]
    assert as_user(socket, OTHER, delete("local/ckpt/run/step-3"), groups=(ADMIN_GID,))["ok"]
    assert as_user(socket, OWNER, save("local/ckpt/run/step-4"))["ok"]
    assert as_user(socket, OTHER, delete("local/ckpt/run/step-4"), gid=ADMIN_GID)["ok"]
    admin_scrub = as_user(
        socket,
        OTHER,
        lambda c: list(ckpt.scrub("local", remove=True, client=c)),
        groups=(ADMIN_GID,),
    )
    assert admin_scrub["ok"], admin_scrub


@pytest.mark.timeout(60)
def test_a_checkpoint_that_records_no_owner_is_an_admins_alone(
    node: tuple[Daemon, Path], tmp_path: Path
) -> None:
    _, socket = node
    name = "local/ckpt/old/step-1"
    assert as_user(socket, OWNER, save(name))["ok"]
    # As chunkd wrote it before it recorded owners.
    path = tmp_path / "data/checkpoints/ckpt/old/step-1/manifest.json"
    doc = json.loads(path.read_bytes())
    del doc["owner"]
    path.write_text(json.dumps(doc))
    refused(as_user(socket, OWNER, delete(name)), "records no owner")
    with Client(socket) as root:  # root is an admin
        assert ckpt.delete(name, client=root) >= 1


def commit(snapshot_data: bytes, name: str) -> Callable[[Client], Any]:
    def work(client: Client) -> Any:
        fd = memfd.sealed(snapshot_data)
        try:
            return client.request("ds_commit", {"name": name}, fds=[fd], timeout=60).header[
                "version"
            ]
        finally:
            os.close(fd)

    return work


def request(op: str, fields: dict[str, Any], answer: str) -> Callable[[Client], Any]:
    return lambda client: client.request(op, fields, timeout=60).header[answer]


@pytest.mark.timeout(90)
def test_a_dataset_name_is_written_by_its_owner_or_an_admin(
    node: tuple[Daemon, Path], tmp_path: Path
) -> None:
    _, socket = node
    (tmp_path / "data/web").mkdir()
    (tmp_path / "data/web/a.bin").write_bytes(os.urandom(64 * 16))
    with Client(socket) as root:
        stat = root.stat("local/web/a.bin")
    member = Member("web/a.bin", stat.size, stat.version, "fixed", 64, {"record_bytes": 16})
    snap = Snapshot.build(
        schema=1, backend="local", prefix="web/", format="fixed", members=[member]
    )
    other = Snapshot.build(
        schema=1, backend="local", prefix="web/", format="fixed", members=[member], schema_of=["x"]
    )
    assert as_user(socket, OWNER, commit(snap.data, "web")) == {"ok": True, "result": 1}
    version_1 = json.loads(
        (tmp_path / "data/datasets/names/web/_versions/000000000001.json").read_bytes()
    )
    assert version_1["uid"] == OWNER
    # Another user reads it, but may not write its name in any way.
    resolved = as_user(socket, OTHER, request("ds_resolve", {"ref": "web"}, "snapshot"))
    assert resolved == {"ok": True, "result": snap.id}
    refused(as_user(socket, OTHER, commit(other.data, "web")), "register a new version of")
    tag = {"name": "web", "tag": "prod", "ref": "1"}
    refused(as_user(socket, OTHER, request("ds_tag", tag, "seq")), "may not move a tag of")
    refused(as_user(socket, OTHER, request("ds_freeze", {"ref": "web@1"}, "uploaded")), "freeze")
    moved = {"ref": "web@1", "to": "local/copy", "name": None}
    refused(as_user(socket, OTHER, request("ds_migrate", moved, "version")), f"uid {OWNER}")
    assert not (tmp_path / "data/copy").exists()  # refused before anything was copied
    assert not (tmp_path / "data/datasets/names/web/_tags").exists()
    assert not (tmp_path / "data/datasets/frozen").exists()
    # A freeze by snapshot id is anyone's: it writes only what the daemon reads and verifies.
    by_id = as_user(socket, OTHER, request("ds_freeze", {"ref": snap.id}, "snapshot"))
    assert by_id == {"ok": True, "result": snap.id}
    # A name of one's own; and the owner may do all of it.
    assert as_user(socket, OTHER, commit(snap.data, "theirs")) == {"ok": True, "result": 1}
    assert as_user(socket, OWNER, commit(other.data, "web")) == {"ok": True, "result": 2}
    assert as_user(socket, OWNER, request("ds_tag", tag, "version")) == {"ok": True, "result": 1}
    assert as_user(socket, OWNER, request("ds_freeze", {"ref": "web@1"}, "snapshot"))["ok"]
    assert as_user(socket, OWNER, request("ds_migrate", moved, "version")) == {
        "ok": True,
        "result": 3,
    }
    # Root is an admin: anyone's name, and a freeze by id.
    with Client(socket) as root:
        assert root.request("ds_tag", {"name": "theirs", "tag": "x", "ref": "1"}).header["seq"] == 1
        assert root.request("ds_freeze", {"ref": snap.id}, timeout=60).header["snapshot"] == snap.id


@pytest.mark.timeout(90)
def test_a_save_id_gives_no_one_another_users_checkpoint(node: tuple[Daemon, Path]) -> None:
    _, socket = node
    name = "local/ckpt/sid/step-1"
    assert as_user(socket, OWNER, save(name))["ok"]
    with Client(socket) as root:
        save_id = ckpt.manifest(name, client=root)["save_id"]  # anyone may read it
    # Committing the owner's parts again, as one's own, with the owner's save id.
    for world in (1, 2):
        again = as_user(
            socket,
            OTHER,
            lambda c, w=world: ckpt.commit(name, save_id, w, overwrite=True, client=c),
        )
        refused(again, f"uid {OTHER} may not", f"uid {OWNER}")
    with Client(socket) as root:
        manifest = ckpt.manifest(name, client=root)
    assert (manifest["owner"], manifest["world_size"]) == (OWNER, 1)
    refused(as_user(socket, OTHER, delete(name)), "may not delete")

    # A two-rank save whose rank 1 another user planted under its save id: never
    # committed with the planted tensors, and the owner's rank 1 is not mistaken for it.
    evil = {"w": np.full(4096, 666, dtype=np.float32)}
    target, sid = "local/ckpt/sid/step-2", "victim-save-2"

    def plant(client: Client) -> Any:
        ckpt.save(evil, target, rank=1, world_size=2, save_id=sid, _commit="none", client=client)
        return "planted"

    assert as_user(socket, OTHER, plant) == {"ok": True, "result": "planted"}

    def rank(r: int) -> Callable[[Client], Any]:
        def work(client: Client) -> Any:
            ckpt.save(STATE, target, rank=r, world_size=2, save_id=sid, timeout=30, client=client)
            return r

        return work

    refused(as_user(socket, OWNER, rank(1)), "rank 1's part of save", f"uid {OTHER}")
    zero = as_user(socket, OWNER, rank(0))
    assert not zero["ok"], zero
    assert "several users" in zero["message"], zero
    with Client(socket) as root, pytest.raises(CheckpointNotFoundError):
        ckpt.manifest(target, client=root)  # nothing was committed

    # A save committed apart (as DCP does): only its saver (or an admin) commits it.
    parts, sid3 = "local/ckpt/sid/step-3", "owner-save-3"
    for r in (0, 1):

        def part(client: Client, r: int = r) -> Any:
            ckpt.save(
                STATE, parts, rank=r, world_size=2, save_id=sid3, _commit="none", client=client
            )
            return r

        assert as_user(socket, OWNER, part)["ok"]
    for world in (1, 2):
        stolen = as_user(socket, OTHER, lambda c, w=world: ckpt.commit(parts, sid3, w, client=c))
        refused(stolen, f"uid {OTHER} may not commit", f"saved by uid {OWNER}")
    assert as_user(socket, OWNER, lambda c: bool(ckpt.commit(parts, sid3, 2, client=c)))["ok"]
    with Client(socket) as root:
        manifest = ckpt.manifest(parts, client=root)
    assert (manifest["owner"], manifest["world_size"]) == (OWNER, 2)
