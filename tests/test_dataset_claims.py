"""What a client may claim in a manifest, and who may freeze what (issue 24).

* A member's ``content`` hash and a snapshot's ``origin`` are chunkd's own records
  (migrate writes them, from the bytes it read); a ``ds_commit`` from the local socket
  that carries either is refused, whether its manifest is checked in the daemon or, past
  :data:`~chunkd.gateway.datasets.registry.IN_PROCESS_BYTES`, in a worker process. So a
  manifest that names a victim's snapshot as its ``origin`` can no longer make
  ``chunkd dataset diff`` call the victim and the forgery "the same".
* On the same object, a content claim never outweighs a version-token difference.
* A freeze by snapshot id is anyone's (it writes only what the daemon reads and
  verifies); a freeze of a version of a name stays its owner's or an admin's.

Real daemons on the embedded default config (a writable file backend ``local`` at
``./chunkd-data``, the registry at ``local/datasets``), requests over the local socket.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest

from chunkd import memfd
from chunkd.client import Client
from chunkd.client.datasets import resolve
from chunkd.errors import DatasetNotFoundError, ManifestError
from chunkd.gateway.datasets.registry import IN_PROCESS_BYTES
from chunkd.snapshot import Member, Snapshot, diff
from tests.frozen_records import record_contents

from .conftest import Daemon, dataset_cli, small_node_toml


def lines(seed: int, count: int = 50) -> bytes:
    return b"".join(b'{"i": %06d, "seed": %03d}\n' % (i, seed) for i in range(count))


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Daemon:
    daemon = start_daemon(cwd=tmp_path / "node")
    data = daemon.cwd / "chunkd-data"
    for folder, seed in (("victim", 0), ("forged", 50)):
        (data / folder).mkdir(parents=True)
        for i in range(3):
            (data / folder / f"part-{i}.jsonl").write_bytes(lines(seed + i))
    return daemon


def commit(client: Client, data: bytes, name: str) -> dict[str, Any]:
    fd = memfd.sealed(data)
    try:
        return dict(client.request("ds_commit", {"name": name}, fds=[fd], timeout=60).header)
    finally:
        os.close(fd)


def claiming(
    snapshot: Snapshot, *, content: list[str] | None, origin: str | None, prefix: str | None = None
) -> Snapshot:
    """``snapshot`` with members that claim ``content`` and an ``origin``."""
    members = [
        Member(
            m.key, m.size, m.version, m.format, m.samples, m.meta, None if content is None else c
        )
        for m, c in zip(snapshot.members, content or [None] * len(snapshot.members), strict=True)
    ]
    return Snapshot.build(
        schema=1,
        backend=snapshot.backend,
        prefix=prefix if prefix is not None else snapshot.prefix,
        format=snapshot.format,
        members=members,
        schema_of=snapshot.schema_of,
        origin=origin,
    )


@pytest.mark.timeout(60)
def test_a_commit_may_not_claim_content_or_an_origin(node: Daemon) -> None:
    dataset_cli(node, "register", "victim", "local/victim/", "--format", "jsonl")
    dataset_cli(node, "register", "plain", "local/forged/", "--format", "jsonl")
    data = node.cwd / "chunkd-data"
    with Client(node.cwd / "chunkd.sock") as client:
        victim = resolve(client, "victim")[0]
        plain = resolve(client, "plain")[0]
        # The forgery: other bytes, at another place, naming the victim as its origin
        # and claiming the victim's hashes as its own.
        victims = [blake3.blake3((data / m.key).read_bytes()).hexdigest() for m in victim.members]
        forgeries = {
            "both": claiming(plain, content=victims, origin=victim.id),
            "origin": claiming(plain, content=None, origin=victim.id),
            "content": claiming(plain, content=victims, origin=None),
            # the same objects as the victim's, at made-up versions, claiming its hashes
            "versions": Snapshot.build(
                schema=1,
                backend="local",
                prefix=victim.prefix,
                format="jsonl",
                members=[
                    Member(m.key, m.size, "forged-" + m.version, m.format, m.samples, m.meta, c)
                    for m, c in zip(victim.members, victims, strict=True)
                ],
            ),
        }
        for what, forged in forgeries.items():
            with pytest.raises(ManifestError, match="chunkd records") as refused:
                commit(client, forged.data, f"forged-{what}")
            message = str(refused.value)
            for field in ("origin", "content"):
                assert (field in message) == (field in forged.claims or what == "both"), (
                    what,
                    message,
                )
            assert "nothing was registered" in message
            with pytest.raises(DatasetNotFoundError):
                client.request("ds_resolve", {"ref": f"forged-{what}"})
        # The diff a user runs never sees a forgery, and tells the two apart.
        report = json.loads(dataset_cli(node, "diff", "victim", "plain", "--json").stdout)
        assert report["same"] is False
        assert report["unknown"] == ["part-0.jsonl", "part-1.jsonl", "part-2.jsonl"]
        # The same manifest without the claims registers as usual.
        assert commit(client, claiming(plain, content=None, origin=None).data, "clean")["created"]
    # Migrate, the daemon's own, still records both.
    dataset_cli(node, "migrate", "victim", "--to", "local/moved")
    with Client(node.cwd / "chunkd.sock") as client:
        copy = resolve(client, "victim")[0]
        assert copy.origin == victim.id
        # a paged copy reads its pages through the client
        assert [m.content for m in copy.members] == victims
    assert "Traceback" not in node.log.read_text(errors="replace")


@pytest.mark.timeout(60)
def test_a_large_manifests_claims_are_refused_by_its_worker(node: Daemon) -> None:
    with Client(node.cwd / "chunkd.sock") as client:
        stat = client.stat("local/victim/part-0.jsonl")

        def big(content: str | None) -> Snapshot:
            meta = {"index": [[i * 1024, i * 77_777] for i in range(40)]}
            members = [
                Member(f"victim/{i:08d}.jsonl", stat.size, stat.version, "jsonl", 50, meta, content)
                for i in range(1200)
            ]
            snap = Snapshot.build(
                schema=1, backend="local", prefix="victim/", format="jsonl", members=members
            )
            assert len(snap.data) > IN_PROCESS_BYTES  # checked in a worker process
            return snap

        with pytest.raises(ManifestError, match="chunkd records") as refused:
            commit(client, big("ab" * 32).data, "big")
        assert "content" in str(refused.value)
        with pytest.raises(DatasetNotFoundError):
            client.request("ds_resolve", {"ref": "big"})
        assert commit(client, big(None).data, "big")["version"] == 1
    assert "checked in a worker" in node.log.read_text(errors="replace")


def test_on_one_object_a_content_claim_never_outweighs_a_version_token() -> None:
    """The rules of :func:`chunkd.snapshot.diff`, on snapshots built in process (a
    manifest that claims content no longer reaches a registry from a client)."""
    meta = {"record_bytes": 1}

    def snap(version: str, content: str | None, backend: str = "data") -> Snapshot:
        member = Member("d/k", 4, version, "fixed", 4, meta, content)
        return Snapshot.build(
            schema=1, backend=backend, prefix="d/", format="fixed", members=[member]
        )

    h, other = "1" * 64, "2" * 64
    # The same object at two versions: claims that agree do not make it "the same".
    report = diff(snap("v1", h), snap("v2", h))
    assert report["same"] is False
    assert report["changed"] == [{"key": "k", "fields": ["version"], "samples": [4, 4]}]
    # ... and claims that disagree add that the bytes differ.
    assert diff(snap("v1", h), snap("v2", other))["changed"][0]["fields"] == ["content", "version"]
    # The same version with hashes that differ (a faked file:// token): different.
    assert diff(snap("v1", h), snap("v1", other))["changed"][0]["fields"] == ["content"]
    assert diff(snap("v1", None), snap("v1", None))["same_by"] == {"content": 0, "version": 1}
    # Frozen records, the daemon's own reads at each recorded version, show that the
    # object's bytes were the same at both versions.
    record = {"chunk_bytes": 4, "members": [["c" * 64]], "content": [h]}
    same = diff(snap("v1", None), snap("v2", None), frozen=(record, record))
    assert same["same_by"] == {"content": 1, "version": 0}
    assert same["same"] is True
    # Other objects (a copy elsewhere): hashes decide, as before.
    assert diff(snap("v1", h), snap("v9", h, backend="copy"))["same_by"]["content"] == 1
    assert diff(snap("v1", h), snap("v9", None, backend="copy"))["unknown"] == ["k"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other uids")
@pytest.mark.timeout(60)
def test_anyone_may_freeze_by_snapshot_id_and_a_names_version_stays_its_owners(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    from tests.test_authority import OTHER, OWNER, as_user, refused

    # Every uid must reach the socket: a world-searchable directory, a 0666 socket.
    public = Path(tempfile.mkdtemp(prefix="chunkd-claims-"))
    public.chmod(0o755)
    socket = public / "chunkd.sock"
    toml = '[server]\nsocket_mode = "0666"\n' + small_node_toml(
        tmp_path / "cache", ("local", tmp_path / "data")
    )
    try:
        start_daemon(toml, env={"CHUNKD_SERVER_SOCKET": str(socket)})
        (tmp_path / "data" / "web").mkdir(parents=True)
        (tmp_path / "data" / "web" / "a.bin").write_bytes(os.urandom(64 * 16))
        with Client(socket) as root:
            stat = root.stat("local/web/a.bin")
        member = Member("web/a.bin", stat.size, stat.version, "fixed", 64, {"record_bytes": 16})
        snap = Snapshot.build(
            schema=1, backend="local", prefix="web/", format="fixed", members=[member]
        )

        def do(op: str, fields: dict[str, Any], answer: str) -> Callable[[Client], Any]:
            return lambda client: client.request(op, fields, timeout=60).header[answer]

        def commit_as(client: Client) -> Any:
            return commit(client, snap.data, "web")["version"]

        assert as_user(socket, OWNER, commit_as) == {"ok": True, "result": 1}
        # A version of another's name: its owner's (or an admin's).
        freeze_name = do("ds_freeze", {"ref": "web@1"}, "uploaded")
        refused(as_user(socket, OTHER, freeze_name), "freeze")
        frozen = tmp_path / "data" / "datasets" / "frozen" / f"{snap.id}.json"
        assert not frozen.exists()
        # By its id: anyone's. The record holds only what the daemon read and verified.
        by_id = as_user(socket, OTHER, do("ds_freeze", {"ref": snap.id}, "snapshot"))
        assert by_id == {"ok": True, "result": snap.id}
        record = json.loads(frozen.read_bytes())
        assert record["id"] == snap.id
        digest = blake3.blake3((tmp_path / "data" / "web" / "a.bin").read_bytes()).hexdigest()
        registry = tmp_path / "data" / "datasets"
        assert record_contents(registry, frozen.read_bytes()) == [digest]
        again = as_user(socket, OWNER, do("ds_freeze", {"ref": "web@1"}, "already"))
        assert again == {"ok": True, "result": True}
    finally:
        shutil.rmtree(public, ignore_errors=True)
