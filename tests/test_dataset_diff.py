"""``chunkd dataset diff`` never calls two contents the same when it does not know it
(issue 24): each member is the same, different or unknown.

A real daemon on the embedded default config (a writable file backend ``local`` at
``./chunkd-data``, the registry at ``local/datasets``), datasets registered and frozen
with the command line as users run it, and snapshots that carry content hashes
committed through the local socket.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest

from chunkd import memfd
from chunkd.client import Client
from chunkd.client.datasets import resolve
from chunkd.errors import ManifestError
from chunkd.snapshot import Member, Snapshot, diff
from tests.frozen_records import record_contents

from .conftest import Daemon, dataset_cli


def cli(daemon: Daemon, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return dataset_cli(daemon, *args, check=check)


def lines(seed: int, count: int = 50) -> bytes:
    return b"".join(b'{"i": %06d, "seed": %03d}\n' % (i, seed) for i in range(count))


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Daemon:
    daemon = start_daemon(cwd=tmp_path / "node")
    root = daemon.cwd / "chunkd-data" / "js"
    root.mkdir(parents=True)
    for i in range(3):
        (root / f"part-{i}.jsonl").write_bytes(lines(i))
    return daemon


def diff_of(daemon: Daemon, a: str, b: str) -> tuple[dict[str, Any], str]:
    as_json = json.loads(cli(daemon, "diff", a, b, "--json").stdout)
    return as_json, cli(daemon, "diff", a, b).stdout


@pytest.mark.timeout(60)
def test_a_line_rewritten_at_the_same_length_is_a_changed_member(node: Daemon) -> None:
    cli(node, "register", "js", "local/js/", "--format", "jsonl")
    path = node.cwd / "chunkd-data" / "js" / "part-1.jsonl"
    before = path.read_bytes()
    after = before.replace(b'{"i": 000007, "seed": 001}', b'{"i": 000007, "seed": 999}')
    assert after != before
    assert len(after) == len(before)
    path.write_bytes(after)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert json.loads(cli(node, "register", "js", "local/js/", "--json").stdout)["version"] == 2

    report, text = diff_of(node, "js@1", "js@2")
    assert report["same"] is False
    assert report["changed"] == [
        {"key": "part-1.jsonl", "fields": ["version"], "samples": [50, 50]}
    ]
    assert report["unknown"] == []
    assert (report["unchanged"], report["same_by"]) == (2, {"content": 0, "version": 2})
    # The keys the inspector's page shows are all there still.
    for key in ("a", "b", "added", "removed", "samples", "bytes", "schema_changed"):
        assert key in report
    assert "the same contents" not in text
    assert "1 changed" in text
    assert "~ part-1.jsonl (version)" in text

    # The same snapshot under two names: the same objects at the same versions.
    cli(node, "register", "twin", "local/js/", "--format", "jsonl")
    report, text = diff_of(node, "js@2", "twin@1")
    assert report["same"] is True
    assert report["same_by"] == {"content": 0, "version": 3}
    assert "the same contents" in text
    assert "3 by version token" in text


@pytest.mark.timeout(60)
def test_copies_are_unknown_until_hashes_on_both_sides_decide(node: Daemon) -> None:
    data = node.cwd / "chunkd-data"
    shutil.copytree(data / "js", data / "copy")
    (data / "other").mkdir()
    for i in range(3):
        body = lines(i) if i != 2 else lines(77)  # same length, other bytes
        (data / "other" / f"part-{i}.jsonl").write_bytes(body)
    for name in ("js", "copy", "other"):
        cli(node, "register", name, f"local/{name}/", "--format", "jsonl")

    # Other objects, no hash of their bytes: unknown, never "the same".
    report, text = diff_of(node, "js", "copy")
    assert report["same"] is False
    assert report["unknown"] == ["part-0.jsonl", "part-1.jsonl", "part-2.jsonl"]
    assert (report["changed"], report["unchanged"]) == ([], 0)
    assert "the same contents" not in text
    assert "3 unknown" in text
    assert "? part-0.jsonl" in text
    assert "not known to be the same" in text

    # Frozen on both sides: their chunk ids decide.
    for name in ("js", "copy", "other"):
        cli(node, "freeze", name)
    report, text = diff_of(node, "js", "copy")
    assert report["same"] is True
    assert report["same_by"] == {"content": 3, "version": 0}
    assert "3 by content hash" in text
    report, text = diff_of(node, "js", "other")
    assert report["changed"] == [
        {"key": "part-2.jsonl", "fields": ["content"], "samples": [50, 50]}
    ]
    assert report["unchanged"] == 2
    assert "~ part-2.jsonl (content)" in text


@pytest.mark.timeout(60)
def test_a_members_content_hash_is_compared_and_absent_from_the_canonical_json(
    node: Daemon,
) -> None:
    plain = Member("k", 1, "v", "fixed", 1, {"record_bytes": 1})
    assert "content" not in plain.to_json()  # existing manifests keep their ids
    data = node.cwd / "chunkd-data"
    shutil.copytree(data / "js", data / "copy")

    def snapshot(prefix: str, hashed: bool, wrong: str | None = None) -> Snapshot:
        snap = resolve(client, prefix)[0]
        members = []
        for m in snap.members:
            digest = blake3.blake3((data / m.key).read_bytes()).hexdigest()
            if wrong is not None and m.key.endswith(wrong):
                digest = "0" * 64
            members.append(Member(m.key, m.size, m.version, m.format, m.samples, m.meta, digest))
        keep = members if hashed else list(snap.members)
        return Snapshot.build(
            backend="local", prefix=f"{prefix}/", format="jsonl", members=keep, schema_of=None
        )

    for name in ("js", "copy"):
        cli(node, "register", name, f"local/{name}/", "--format", "jsonl")
    with Client(node.cwd / "chunkd.sock") as client:
        hashed_js, hashed_copy = snapshot("js", hashed=True), snapshot("copy", hashed=True)
        wrong_copy = snapshot("copy", hashed=True, wrong="part-1.jsonl")
        bare_copy = snapshot("copy", hashed=False)
        # Only chunkd records hashes (migrate, freeze): a client's manifest that carries
        # them is refused (tests/test_dataset_claims.py has the rest).
        fd = memfd.sealed(hashed_js.data)
        try:
            with pytest.raises(ManifestError, match="chunkd records"):
                client.request("ds_commit", {"name": "hashed-js"}, fds=[fd], timeout=30)
        finally:
            os.close(fd)
    # A hash decides where both sides have one ...
    report = diff(hashed_js, hashed_copy)
    assert report["same"] is True
    assert report["same_by"] == {"content": 3, "version": 0}
    report = diff(hashed_js, wrong_copy)
    assert [(c["key"], c["fields"]) for c in report["changed"]] == [("part-1.jsonl", ["content"])]
    # ... and one side's hash alone says nothing.
    report = diff(hashed_js, bare_copy)
    assert report["same"] is False
    assert report["unknown"] == ["part-0.jsonl", "part-1.jsonl", "part-2.jsonl"]


@pytest.mark.timeout(90)
def test_a_verified_copy_compares_by_content_with_its_origin_and_every_copy(
    node: Daemon,
) -> None:
    data = node.cwd / "chunkd-data"
    cli(node, "register", "js", "local/js/", "--format", "jsonl")
    # Migrate reads every byte of the original at its recorded versions: the copy's
    # members carry their hashes, and the copy names the original as its origin.
    cli(node, "migrate", "js@1", "--to", "local/moved")
    report, text = diff_of(node, "js@1", "js@2")
    assert report["same"] is True, report
    assert report["same_by"] == {"content": 3, "version": 0}
    assert "3 by content hash" in text
    with Client(node.cwd / "chunkd.sock") as client:
        copy = resolve(client, "js@2")[0]
        original = resolve(client, "js@1")[0]
        assert copy.origin == original.id
        for member in copy.members:  # a paged copy reads its pages through the client
            assert member.content == blake3.blake3((data / member.key).read_bytes()).hexdigest()
    # A second copy of the copy: their hashes decide, both ways.
    cli(node, "migrate", "js@2", "--to", "local/again")
    assert diff_of(node, "js@2", "js@3")[0]["same_by"] == {"content": 3, "version": 0}
    # The original changes at the same length and is registered again: the new version
    # is no copy, and reads the same objects as js@1 (version tokens decide there), but
    # other objects than the copies (unknown, until it is frozen).
    path = data / "js" / "part-1.jsonl"
    path.write_bytes(path.read_bytes().replace(b'"seed": 001}', b'"seed": 777}'))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    cli(node, "register", "js", "local/js/", "--format", "jsonl")  # js@4
    assert diff_of(node, "js@1", "js@4")[0]["changed"] == [
        {"key": "part-1.jsonl", "fields": ["version"], "samples": [50, 50]}
    ]
    assert diff_of(node, "js@2", "js@4")[0]["unknown"] == [
        "part-0.jsonl",
        "part-1.jsonl",
        "part-2.jsonl",
    ]
    # A freeze records each member's hash in the frozen record: now content decides.
    cli(node, "freeze", "js@4")
    frozen = next((data / "datasets" / "frozen").glob("*.json")).read_bytes()
    assert len(record_contents(data / "datasets", frozen)) == 3
    report, _ = diff_of(node, "js@2", "js@4")
    assert report["changed"] == [
        {"key": "part-1.jsonl", "fields": ["content"], "samples": [50, 50]}
    ]
    assert report["same_by"] == {"content": 2, "version": 0}
