"""Schema-2 snapshots in the registry, through real daemons: pages put and read with
``ds_page_put`` and ``ds_page``, a root committed and resolved alone, schema-1
manifests as before, and bad input (a page missing, damaged, of another snapshot,
over its bound, claiming content; a registration killed while it puts pages)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest

from chunkd import memfd
from chunkd.client import Client
from chunkd.client.datasets.dataset import resolve as resolve_snapshot
from chunkd.client.datasets.pages import DaemonPages, commit_snapshot, put_page
from chunkd.errors import DatasetNotFoundError, InvalidRequestError, ManifestError
from chunkd.gateway.config import load_config
from chunkd.gateway.daemon import Node, open_node
from chunkd.gateway.metrics import Metrics
from chunkd.snapshot import (
    PAGE_MAX_BYTES,
    Member,
    MemoryPages,
    Snapshot,
    canonical,
    page_bytes,
)
from tests.conftest import Daemon

#: today's (schema-1) manifest of three members, as chunkd wrote it before pages, and
#: its id: it must resolve with that id, byte for byte
SCHEMA1 = (
    b'{"excluded":[],"format":"fixed","members":[{"format":"fixed","key":"k00.bin","meta":'
    b'{"record_bytes":16},"samples":2,"size":32,"version":"v0"},{"format":"fixed","key":'
    b'"k01.bin","meta":{"record_bytes":16},"samples":2,"size":32,"version":"v1"},{"format":'
    b'"fixed","key":"k02.bin","meta":{"record_bytes":16},"samples":2,"size":32,"version":'
    b'"v2"}],"schema":1,"schema_of":null,"source":{"backend":"local","prefix":"data/"},'
    b'"totals":{"bytes":96,"members":3,"samples":6}}'
)
SCHEMA1_ID = "545f810ce09cfbd8ee3907392884db94d8862d3805f0cefc3762cd46d96c0ac2"


def members(count: int, *, tag: str = "v", size: int = 64) -> list[Member]:
    return [
        Member(f"m/{i:06d}.bin", size, f"{tag}{i}", "fixed", size // 16, {"record_bytes": 16})
        for i in range(count)
    ]


def built(count: int, *, tag: str = "v", size: int = 64) -> tuple[Snapshot, MemoryPages]:
    pages = MemoryPages()
    snapshot = Snapshot.build(
        backend="local",
        prefix="data/",
        format="fixed",
        members=members(count, tag=tag, size=size),
        pages=pages,
        schema=2,
    )
    return snapshot, pages


def registry_dir(daemon: Daemon) -> Path:
    return daemon.cwd / "chunkd-data" / "datasets"


def page_files(daemon: Daemon) -> set[str]:
    folder = registry_dir(daemon) / "pages"
    return {p.name for p in folder.iterdir()} if folder.exists() else set()


def pointers(daemon: Daemon, name: str) -> list[str]:
    folder = registry_dir(daemon) / "names" / name / "_versions"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def commit_bytes(client: Client, data: bytes, name: str) -> dict[str, Any]:
    fd = memfd.sealed(data)
    try:
        return dict(client.request("ds_commit", {"name": name}, fds=[fd], timeout=60).header)
    finally:
        os.close(fd)


def resolve_raw(client: Client, ref: str) -> tuple[dict[str, Any], list[bytes]]:
    with client.request("ds_resolve", {"ref": ref}) as reply:
        return dict(reply.header), [os.pread(fd, os.fstat(fd).st_size, 0) for fd in reply.fds]


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Iterator[tuple[Daemon, Client]]:
    """A daemon on the embedded default: the registry at local/datasets."""
    daemon = start_daemon(cwd=tmp_path / "node")
    with Client(daemon.cwd / "chunkd.sock") as client:
        yield daemon, client


@pytest.mark.timeout(60)
def test_a_paged_snapshot_is_committed_by_pages_then_root_and_read_page_by_page(
    node: tuple[Daemon, Client],
) -> None:
    daemon, client = node
    snapshot, pages = built(12_000)
    assert snapshot.schema == 2
    assert len(snapshot.pages) >= 2
    answer = commit_snapshot(client, "paged/one", snapshot, pages)
    assert answer["snapshot"] == snapshot.id
    assert answer["version"] == 1
    assert answer["pages"] == answer["pages_created"] == len({r.id for r in snapshot.pages})
    assert page_files(daemon) == {f"{r.id}.json" for r in snapshot.pages}
    # The resolve answers the root alone: the daemon never reads a page to resolve.
    header, fds = resolve_raw(client, "paged/one")
    assert header["snapshot"] == snapshot.id
    assert fds == [snapshot.data]
    got, _, _ = resolve_snapshot(client, "paged/one")
    assert got.schema == 2
    assert got.page_loads == 0
    last = len(got.members) - 1
    assert got.members[last] == snapshot.members[last]  # loads the last page only
    assert got.page_loads == 1
    assert list(got.iter_members()) == list(snapshot.iter_members())
    # Registering it again puts no page anew, and makes no version.
    again = commit_snapshot(client, "paged/one", snapshot, pages)
    assert again["pages_created"] == 0
    assert again["created"] is False
    # A page put straight (ds_page_put) says whether it was there.
    ref = snapshot.pages[0]
    put = put_page(client, pages.page(ref.id))
    assert (put["page"], put["created"]) == (ref.id, False)


@pytest.mark.timeout(60)
def test_versions_share_pages_and_a_commit_without_pages_in_memory_writes_them_again(
    node: tuple[Daemon, Client],
) -> None:
    _daemon, client = node
    first, pages = built(12_000)
    commit_snapshot(client, "shared", first, pages)
    # One member changed: only the page that holds it is new.
    changed = list(first.iter_members())
    changed[5] = Member(changed[5].key, 64, "changed", "fixed", 4, {"record_bytes": 16})
    second = Snapshot.build(
        backend="local", prefix="data/", format="fixed", members=changed, schema=2
    )
    new_pages = {r.id for r in second.pages} - {r.id for r in first.pages}
    assert len(new_pages) == 1
    answer = commit_snapshot(client, "shared", second)  # pages written from its members
    assert answer["version"] == 2
    assert answer["pages_created"] == 1


@pytest.mark.timeout(60)
def test_a_schema1_manifest_commits_and_resolves_as_before_with_its_id(
    node: tuple[Daemon, Client],
) -> None:
    daemon, client = node
    assert blake3.blake3(SCHEMA1).hexdigest() == SCHEMA1_ID
    answer = commit_bytes(client, SCHEMA1, "old/one")
    assert answer["snapshot"] == SCHEMA1_ID
    assert answer["version"] == 1
    for ref in ("old/one", "old/one@1", SCHEMA1_ID):
        header, fds = resolve_raw(client, ref)
        assert header["snapshot"] == SCHEMA1_ID
        assert fds == [SCHEMA1]
    got, _, _ = resolve_snapshot(client, "old/one")
    assert got.schema == 1
    assert got.id == SCHEMA1_ID
    assert got.members[2].key == "k02.bin"
    assert (registry_dir(daemon) / "manifests" / f"{SCHEMA1_ID}.json").read_bytes() == SCHEMA1


@pytest.mark.timeout(60)
def test_a_root_whose_page_is_missing_is_refused_naming_it_and_nothing_is_registered(
    node: tuple[Daemon, Client],
) -> None:
    daemon, client = node
    old, old_pages = built(3)
    commit_snapshot(client, "gap", old, old_pages)
    snapshot, pages = built(12_000, tag="w")
    lost = snapshot.pages[-1].id
    for ref in snapshot.pages[:-1]:
        put_page(client, pages.page(ref.id))
    with pytest.raises(DatasetNotFoundError, match=lost):
        commit_bytes(client, snapshot.data, "gap")
    assert pointers(daemon, "gap") == ["000000000001.json"]
    assert not (registry_dir(daemon) / "manifests" / f"{snapshot.id}.json").exists()
    assert resolve_raw(client, "gap")[0]["snapshot"] == old.id
    # A reader of a committed snapshot whose page went missing is told which.
    commit_snapshot(client, "gap", snapshot, pages)
    (registry_dir(daemon) / "pages" / f"{lost}.json").unlink()
    got, _, _ = resolve_snapshot(client, "gap")
    with pytest.raises(DatasetNotFoundError, match=lost):
        got.members[len(got.members) - 1]
    assert got.members[0] == snapshot.members[0]  # the other pages read on


@pytest.mark.timeout(60)
def test_a_damaged_page_is_refused_by_its_id_and_never_cached(
    node: tuple[Daemon, Client],
) -> None:
    daemon, client = node
    snapshot, pages = built(12_000)
    commit_snapshot(client, "torn", snapshot, pages)
    ref = snapshot.pages[0]
    path = registry_dir(daemon) / "pages" / f"{ref.id}.json"
    good = path.read_bytes()
    path.write_bytes(good[:-40] + b" " * 40)  # same size, other bytes
    got, _, _ = resolve_snapshot(client, "torn")
    for _ in range(2):  # the daemon kept nothing of it: the second read is refused too
        with pytest.raises(ManifestError, match=ref.id):
            got.members[0]
    with pytest.raises(ManifestError, match=ref.id):
        DaemonPages(client).page(ref.id)
    # Putting the page again repairs it; readers go on.
    assert put_page(client, good)["created"] is True
    assert path.read_bytes() == good
    assert got.members[0] == snapshot.members[0]
    assert "Traceback" not in daemon.log.read_text()


@pytest.mark.timeout(60)
def test_a_root_naming_a_page_of_another_snapshot_fails_when_read_naming_the_page(
    node: tuple[Daemon, Client],
) -> None:
    _daemon, client = node
    a, a_pages = built(12_000, tag="a")
    b, b_pages = built(12_000, tag="b", size=128)  # the same keys, other sizes
    commit_snapshot(client, "mixed", a, a_pages)
    commit_snapshot(client, "other", b, b_pages)
    # B's root with its first page swapped for A's, which does not fit B's entry.
    doc = json.loads(b.data)
    doc["pages"][0][0] = a.pages[0].id
    forged = canonical(doc)
    answer = commit_bytes(client, forged, "mixed")  # every page it names is there
    got, _, _ = resolve_snapshot(client, answer["snapshot"])
    with pytest.raises(ManifestError, match=a.pages[0].id):
        got.members[0]
    # Nothing of A or B was damaged.
    for name, snapshot in (("mixed@1", a), ("other", b)):
        read, _, _ = resolve_snapshot(client, name)
        assert list(read.iter_members()) == list(snapshot.iter_members())


@pytest.mark.timeout(60)
def test_a_page_put_over_its_bound_or_not_a_page_or_claiming_content_is_refused(
    node: tuple[Daemon, Client],
) -> None:
    daemon, client = node
    with pytest.raises(InvalidRequestError, match=str(PAGE_MAX_BYTES)):
        put_page(client, b"{" + b" " * PAGE_MAX_BYTES)
    claimed = [
        Member("a", 1, "v", "fixed", 0, {}, content="0" * 64),
        Member("b", 1, "v", "fixed", 0, {}),
    ]
    with pytest.raises(ManifestError, match="content"):
        put_page(client, page_bytes(claimed))
    for bad in (
        b"[" * 100_000,  # a shape no page has: refused before it is parsed
        b'{"kind":"chunkd-dataset-page","members":[],"schema":2}',
        page_bytes(members(2))[::-1],
        page_bytes(list(reversed(members(2)))),  # not in key order
        json.dumps(json.loads(page_bytes(members(2))), indent=1).encode(),  # not canonical
    ):
        with pytest.raises(ManifestError):
            put_page(client, bad)
    assert page_files(daemon) == set()
    with pytest.raises(InvalidRequestError):
        client.request("ds_page", {"page": "not-an-id"})
    with pytest.raises(InvalidRequestError, match="registry"):
        client.request("ds_page", {"page": "0" * 64, "registry": "elsewhere/datasets"})
    with pytest.raises(DatasetNotFoundError, match="0" * 64):
        client.request("ds_page", {"page": "0" * 64})
    assert "Traceback" not in daemon.log.read_text()


_REGISTER = textwrap.dedent("""
    import sys
    from chunkd.client import Client
    from chunkd.client.datasets.pages import put_page
    from chunkd.snapshot import MemoryPages, Member, Snapshot

    pages = MemoryPages()
    members = [
        Member(f"m/{i:06d}.bin", 64, f"x{i}", "fixed", 4, {"record_bytes": 16})
        for i in range(40_000)
    ]
    snapshot = Snapshot.build(
        backend="local", prefix="data/", format="fixed", members=members, pages=pages, schema=2
    )
    with Client(sys.argv[1]) as client:
        for n, ref in enumerate(snapshot.pages):
            put_page(client, pages.page(ref.id))
            if n == 2:
                print("putting", flush=True)
    print("done", flush=True)
    sys.stdin.read()  # the test kills it before: the root is never committed
""")


@pytest.mark.timeout(90)
def test_a_registration_killed_while_it_puts_pages_leaves_the_previous_version(
    node: tuple[Daemon, Client], tmp_path: Path
) -> None:
    daemon, client = node
    old, old_pages = built(3)
    commit_snapshot(client, "crash", old, old_pages)
    script = tmp_path / "register.py"
    script.write_text(_REGISTER)
    process = subprocess.Popen(
        [sys.executable, str(script), str(daemon.cwd / "chunkd.sock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert process.stdin is not None
    assert process.stdout is not None
    with process.stdin, process.stdout:
        try:
            assert process.stdout.readline() == b"putting\n"
            os.kill(process.pid, signal.SIGKILL)
        finally:
            process.kill()
            process.wait(timeout=30)
    assert page_files(daemon)  # pages of the cut registration are there, harmless
    header, fds = resolve_raw(client, "crash")
    assert header["snapshot"] == old.id
    assert header["version"] == 1
    assert fds == [old.data]
    # The retry succeeds: the pages there are not put again.
    snapshot = Snapshot.build(
        backend="local",
        prefix="data/",
        format="fixed",
        members=members(40_000, tag="x"),
        schema=2,
    )
    answer = commit_snapshot(client, "crash", snapshot)
    assert answer["version"] == 2
    assert answer["pages_created"] < answer["pages"]
    got, _, _ = resolve_snapshot(client, "crash")
    assert got.id == snapshot.id
    assert got.members[39_999] == snapshot.members[39_999]
    assert "Traceback" not in daemon.log.read_text()


@pytest.fixture
async def inproc(tmp_path: Path) -> AsyncIterator[Node]:
    """A node in this process (its registry at local/datasets), for daemon code's API."""
    (tmp_path / "local").mkdir()
    toml = tmp_path / "inproc.toml"
    toml.write_text(f"""
[server]
socket = "{tmp_path / "inproc.sock"}"

[cache]
dir = "{tmp_path / "inproc-cache"}"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
fsync = "never"

[[backends]]
name = "local"
url = "file://{tmp_path / "local"}"
writable = true
""")
    config = load_config(toml, environ={}, cwd=tmp_path)
    async with open_node(config, Metrics(), tls=None) as node:
        yield node


@pytest.mark.timeout(60)
async def test_daemon_code_loads_the_pages_it_needs_once_and_indexes_their_members(
    inproc: Node,
) -> None:
    registry = inproc.datasets.registry
    snapshot, pages = built(12_000)
    for ref in snapshot.pages:
        assert await registry.put_page(pages.page(ref.id)) == (ref.id, True)
    ident, version, created = await registry.commit(snapshot.data, "inproc")
    assert (ident, version, created) == (snapshot.id, 1, True)
    got = (await registry.resolve("inproc")).snapshot
    last = len(got.members) - 1
    with pytest.raises(ManifestError, match="not loaded"):
        got.members[last]
    await registry.load_pages(got, [0, got.page_of(last), 0])
    assert got.members[0] == snapshot.members[0]
    assert got.members[last] == snapshot.members[last]
    assert registry.pages.fetched == 2
    assert await registry.page(snapshot.pages[0].id) == pages.page(snapshot.pages[0].id)
    assert registry.pages.fetched == 2  # held by the node's tiers: no second fetch
    # A page that does not fit the root is refused by the snapshot, naming it.
    other, other_pages = built(12_000, size=128)
    await registry.put_page(other_pages.page(other.pages[0].id))
    with pytest.raises(ManifestError, match=other.pages[0].id):
        await asyncio.to_thread(
            got.offer_page, got.pages[0].id, other_pages.page(other.pages[0].id)
        )
    with pytest.raises(DatasetNotFoundError, match="0" * 64):
        await registry.page("0" * 64)
