"""The frozen record in pages (chunkd.frozen): a small root and record pages in the
registry's ``pages/``, read lazily and checked by id; records of schema 1 still read;
the garbage collector's roots stream a record page by page."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest

from chunkd import memfd
from chunkd.client import Client
from chunkd.client.datasets import resolve
from chunkd.client.datasets.frozen import RECORD_PAGES_HELD, FrozenSource
from chunkd.errors import ChunkdError, ManifestError
from chunkd.frozen import (
    RECORD_PAGE_BYTES,
    RecordPageWriter,
    RecordRef,
    RecordRoot,
    member_chunks,
    parse_record_page,
    record_root_bytes,
)
from chunkd.gateway.config import load_config
from chunkd.gateway.daemon import Node, open_node
from chunkd.gateway.datasets.freeze import Freezer
from chunkd.gateway.metrics import Metrics
from chunkd.snapshot import PAGE_TARGET, Member, MemoryPages, Snapshot
from tests.conftest import Daemon
from tests.frozen_records import record_chunk_lists, record_pieces

RECORD = 16
FILES = {
    "data/a.bin": os.urandom(RECORD * 300_000),  # a 4 MiB chunk and a bit
    "data/b.bin": os.urandom(RECORD * 1000),
    "data/sub/c.bin": b"",
}


# -- helpers -------------------------------------------------------------------------


def page_the_record(registry: Path, snapshot_id: str) -> bytes:
    """Rewrite the schema-1 record the daemon wrote (its default) as a root and record
    pages, as a freeze with ``record_schema=2`` writes them: ``chunkd.frozen``'s own
    writer, pages into ``pages/``. Returns the root's bytes."""
    path = registry / "frozen" / f"{snapshot_id}.json"
    old = json.loads(path.read_bytes())
    if old["schema"] == 2:  # the daemon writes pages itself
        return path.read_bytes()
    manifest = Snapshot.parse((registry / "manifests" / f"{snapshot_id}.json").read_bytes())
    writer = RecordPageWriter(
        lambda ident, data: (registry / "pages" / f"{ident}.json").write_bytes(data),
        old["chunk_bytes"],
    )
    (registry / "pages").mkdir(exist_ok=True)
    for member, ids, content in zip(manifest.members, old["members"], old["content"], strict=True):
        writer.begin(member.key)
        for cid in ids:
            writer.add(cid)
        writer.end(content)
    raw = record_root_bytes(
        snapshot_id=snapshot_id,
        backend=old["backend"],
        chunk_bytes=old["chunk_bytes"],
        created=old["created"],
        members=writer.members,
        chunks=writer.chunks,
        pages=writer.finish(),
    )
    path.write_bytes(raw)
    return raw


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Iterator[tuple[Daemon, Client]]:
    daemon = start_daemon(cwd=tmp_path / "node")
    with Client(daemon.cwd / "chunkd.sock") as client:
        yield daemon, client


def data_dir(daemon: Daemon) -> Path:
    return daemon.cwd / "chunkd-data"


def write_objects(root: Path, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def snapshot_of(client: Client, keys: list[str]) -> Snapshot:
    members = []
    for key in keys:
        stat = client.stat(f"local/{key}")
        members.append(
            Member(
                key, stat.size, stat.version, "fixed", stat.size // RECORD, {"record_bytes": RECORD}
            )
        )
    return Snapshot.build(
        schema=1, backend="local", prefix="data/", format="fixed", members=members
    )


def commit(client: Client, snapshot: Snapshot, name: str) -> None:
    fd = memfd.sealed(snapshot.data)
    try:
        client.request("ds_commit", {"name": name}, fds=[fd], timeout=60)
    finally:
        os.close(fd)


def frozen_record(client: Client, ref: str) -> bytes:
    with client.request("ds_resolve", {"ref": ref}) as reply:
        assert len(reply.fds) == 2, reply.header
        return os.pread(reply.fds[1], os.fstat(reply.fds[1]).st_size, 0)


def chunkd_gc(daemon: Daemon) -> dict[str, Any]:
    with Client(daemon.cwd / "chunkd.sock", timeout=60) as client:
        _, payload, fds = client._request(
            {"op": "ckpt_gc", "target": "local", "keep_last": None, "grace": 0, "dry_run": False},
            "collecting garbage",
        )
        for fd in fds:
            os.close(fd)
    report: dict[str, Any] = json.loads(payload)
    return report


def age_everything(root: Path) -> None:
    """The chunks and the freeze's intents, two days old: only records keep chunks."""
    then = time.time() - 2 * 86400
    for path in [*(root / "chunks").iterdir(), *(root / "intents").iterdir()]:
        os.utime(path, (then, then))


# -- through a daemon --------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_paged_record_is_answered_as_its_root_and_reads_back_bit_exact(
    node: tuple[Daemon, Client],
) -> None:
    daemon, client = node
    root = data_dir(daemon)
    write_objects(root, FILES)
    snap = snapshot_of(client, sorted(FILES))
    commit(client, snap, "paged")
    report = client.request("ds_freeze", {"ref": "paged"}, timeout=120).header
    assert report["chunks"] == 3  # a.bin in 2 chunks, b.bin in 1, c.bin in none
    page_the_record(data_dir(daemon) / "datasets", snap.id)
    raw = frozen_record(client, "paged")
    record = json.loads(raw)
    # The record the daemon answers is the root: no chunk list in it.
    assert record["schema"] == 2
    assert record["totals"] == {"members": 3, "chunks": 3}
    assert "members" not in record
    lists = record_chunk_lists(data_dir(daemon) / "datasets", raw)
    assert [len(ids) for ids in lists] == [2, 1, 0]
    for ident, *_ in record["pages"]:
        page = (data_dir(daemon) / "datasets" / "pages" / f"{ident}.json").read_bytes()
        assert blake3.blake3(page).hexdigest() == ident
    # Freezing again: all there.
    assert client.request("ds_freeze", {"ref": "paged"}, timeout=120).header["already"]
    # The sources change; the frozen snapshot reads as it was.
    (root / "data/a.bin").write_bytes(os.urandom(100))
    time.sleep(1.1)
    snapshot, _, source = resolve(client, "paged")
    assert isinstance(source, FrozenSource)
    for member in snapshot.members:
        with source.file(member) as f:
            assert f.read() == FILES[member.key]
    assert source.read(snapshot.members[0], 4 << 20, 10) == FILES["data/a.bin"][4 << 20 :][:10]
    # diff learns each member's bytes from the record, pages and all.
    evidence = source.record
    assert evidence["content"] == [blake3.blake3(FILES[k]).hexdigest() for k in sorted(FILES)]
    assert evidence["members"] == lists


@pytest.mark.timeout(90)
def test_gc_keeps_a_paged_records_chunks_and_stops_on_a_missing_record_page(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    cwd = tmp_path / "node"
    daemon = start_daemon(cwd=cwd)
    root = data_dir(daemon)
    write_objects(root, FILES)
    with Client(daemon.cwd / "chunkd.sock") as client:
        snap = snapshot_of(client, sorted(FILES))
        commit(client, snap, "kept")
        client.request("ds_freeze", {"ref": "kept"}, timeout=120)
        page_the_record(root / "datasets", snap.id)
        raw = frozen_record(client, "kept")
    named = {c for ids in record_chunk_lists(root / "datasets", raw) for c in ids}
    garbage = os.urandom(1000)
    junk = root / "chunks" / blake3.blake3(garbage).hexdigest()
    junk.write_bytes(garbage)
    age_everything(root)
    report = chunkd_gc(daemon)
    assert report["swept"] == 1
    assert report["root_chunks"] == 3
    assert not junk.exists()
    assert {p.name for p in (root / "chunks").iterdir()} == named
    # A record page gone from the registry (and from a node that never held it): the
    # collection stops before deleting anything.
    junk.write_bytes(garbage)
    age_everything(root)
    page = json.loads(raw)["pages"][0][0]
    (root / "datasets" / "pages" / f"{page}.json").unlink()
    daemon.stop()
    shutil.rmtree(cwd / "chunkd-cache")
    daemon = start_daemon(cwd=cwd)
    with pytest.raises(ChunkdError, match=r"garbage collection stopped before deleting anything"):
        chunkd_gc(daemon)
    assert junk.exists()
    assert {p.name for p in (root / "chunks").iterdir()} == named | {junk.name}
    # Freezing again writes the record anew.
    with Client(daemon.cwd / "chunkd.sock") as client:
        assert not client.request("ds_freeze", {"ref": "kept"}, timeout=120).header["already"]
    assert chunkd_gc(daemon)["swept"] == 1


@pytest.mark.timeout(60)
def test_a_record_of_schema_1_still_reads_and_keeps_its_chunks(
    node: tuple[Daemon, Client],
) -> None:
    """What chunkd wrote before records paged: one document, every member's ids."""
    daemon, client = node
    root = data_dir(daemon)
    write_objects(root, FILES)
    snap = snapshot_of(client, sorted(FILES))
    commit(client, snap, "old")
    client.request("ds_freeze", {"ref": "old"}, timeout=120)
    path = root / "datasets" / "frozen" / f"{snap.id}.json"
    written = json.loads(path.read_bytes())
    pieces = record_pieces(root / "datasets", path.read_bytes())
    lists = [ids for ids, _ in pieces]
    old = {
        "format": "chunkd-dataset-frozen",
        "schema": 1,
        "id": snap.id,
        "backend": "local",
        "chunk_bytes": written["chunk_bytes"],
        "created": written["created"],
        "members": lists,
        "content": [content for _, content in pieces],
    }
    path.write_text(json.dumps(old))
    assert client.request("ds_freeze", {"ref": "old"}, timeout=120).header["already"]
    (root / "data/b.bin").write_bytes(os.urandom(100))
    time.sleep(1.1)
    snapshot, _, source = resolve(client, "old")
    assert isinstance(source, FrozenSource)
    assert source.record["members"] == lists
    for member in snapshot.members:
        with source.file(member) as f:
            assert f.read() == FILES[member.key]
    age_everything(root)
    assert chunkd_gc(daemon)["root_chunks"] == 3
    assert {p.name for p in (root / "chunks").iterdir()} == {c for ids in lists for c in ids}


# -- the format ------------------------------------------------------------------------


def random_ids(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [rng.randbytes(32).hex() for _ in range(count)]


def write_record(
    members: list[tuple[str, list[str]]], page_ends: frozenset[str] = frozenset()
) -> tuple[RecordRoot, dict[str, bytes]]:
    pages: dict[str, bytes] = {}
    writer = RecordPageWriter(pages.__setitem__, 4096)
    for key, ids in members:
        writer.begin(key)
        for cid in ids:
            writer.add(cid)
        writer.end(blake3.blake3(key.encode()).hexdigest())
        if key in page_ends:
            writer.cut()
    refs = writer.finish()
    raw = record_root_bytes(
        snapshot_id="0" * 64,
        backend="local",
        chunk_bytes=4096,
        created=0.0,
        members=len(members),
        chunks=sum(len(ids) for _, ids in members),
        pages=refs,
    )
    return RecordRoot.from_doc(json.loads(raw), "the record"), pages


@pytest.mark.timeout(30)
def test_record_pages_stay_under_their_bound_and_give_back_every_members_chunks() -> None:
    # One member of 150,000 chunks (10 MB of ids) spans pages; small ones share them.
    members = [
        ("a", random_ids(3, 1)),
        ("b", random_ids(150_000, 2)),
        ("c", []),
        ("d", random_ids(5, 3)),
        ("e", random_ids(7, 4)),
    ]
    root, pages = write_record(members, page_ends=frozenset({"d"}))
    assert len(root.pages) >= 4
    assert all(len(data) <= RECORD_PAGE_BYTES for data in pages.values())
    assert root.pages[-1].key == "e"  # a member page of the snapshot ended after "d"
    parsed = {i: parse_record_page(pages[r.id], r, 4096) for i, r in enumerate(root.pages)}
    for key, ids in members:
        assert list(member_chunks(root, key, len(ids), parsed.__getitem__)) == ids
    with pytest.raises(ManifestError, match=r"names 3 chunks for member 'a', which takes 4"):
        member_chunks(root, "a", 4, parsed.__getitem__)
    # Pages are checked against their ids and entries.
    first, second = root.pages[0], root.pages[1]
    with pytest.raises(ManifestError, match="hashes to"):
        parse_record_page(pages[first.id][:-1] + b" ", first, 4096)
    with pytest.raises(ManifestError, match="root names a page of another record"):
        parse_record_page(pages[second.id], RecordRef(second.id, "a", 0, second.ids), 4096)
    with pytest.raises(ManifestError, match="not a record page of 8192-byte chunks"):
        parse_record_page(pages[first.id], first, 8192)


class CountingPages(MemoryPages):
    """Pages in memory, counting the reads (what ds_page would be asked)."""

    def __init__(self, pages: dict[str, bytes]) -> None:
        super().__init__(pages)
        self.reads: list[str] = []

    def page(self, page_id: str) -> bytes:
        self.reads.append(page_id)
        return super().page(page_id)


@pytest.mark.timeout(30)
def test_a_frozen_source_loads_only_the_record_page_of_the_member_it_reads() -> None:
    keys = [f"data/{n:05d}.bin" for n in range(2000)]
    members = [Member(k, 4096 * 40, "v1", "fixed", 40, {"record_bytes": 4096}) for k in keys]
    snapshot = Snapshot.build(backend="local", prefix="data/", format="fixed", members=members)
    lists = {k: random_ids(40, n) for n, k in enumerate(keys)}
    pages: dict[str, bytes] = {}
    writer = RecordPageWriter(pages.__setitem__, 4096)
    for key in keys:
        writer.begin(key)
        for cid in lists[key]:
            writer.add(cid)
        writer.end(None)
    refs = writer.finish()
    assert len(refs) >= 2  # 2000 members of 40 ids: 5.4 MB of ids
    raw = record_root_bytes(
        snapshot_id=snapshot.id,
        backend="local",
        chunk_bytes=4096,
        created=0.0,
        members=len(keys),
        chunks=40 * len(keys),
        pages=refs,
    )
    source_pages = CountingPages(pages)
    source = FrozenSource.from_record(
        None,  # type: ignore[arg-type]  # no chunk is read here, only the record
        {"registry": "local/datasets"},
        raw,
        snapshot,
        pages=source_pages,
    )
    assert source.chunks_of(snapshot.members[1999]) == lists[keys[1999]]
    assert source_pages.reads == [refs[-1].id]
    assert source.chunks_of(snapshot.members[0]) == lists[keys[0]]
    assert source_pages.reads == [refs[-1].id, refs[0].id]
    assert source.chunks_of(snapshot.members[1]) == lists[keys[1]]
    assert len(source_pages.reads) == 2  # held
    for member in snapshot.members:
        source.chunks_of(member)
    assert len(source._held) <= RECORD_PAGES_HELD
    # A record of another snapshot is refused.
    with pytest.raises(ManifestError, match="names another snapshot"):
        FrozenSource.from_record(
            None,  # type: ignore[arg-type]
            {},
            raw.replace(snapshot.id.encode(), b"f" * 64),
            snapshot,
            pages=source_pages,
        )
    # A page missing is a clear error naming it.
    del source_pages.pages[refs[1].id]
    fresh = FrozenSource.from_record(None, {}, raw, snapshot, pages=source_pages)  # type: ignore[arg-type]
    on_it = next(m for m in snapshot.members if m.key >= refs[1].key)
    with pytest.raises(ManifestError, match=f"lacks page {refs[1].id}"):
        fresh.chunks_of(on_it)


# -- the writer, in this process ---------------------------------------------------------


@pytest.fixture
async def inproc(tmp_path: Path) -> AsyncIterator[Node]:
    """A node in this process: a writable file backend 'local' at ``tmp_path/local``
    (the registry at local/datasets), 4 KiB chunks."""
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
chunk_bytes = "4KiB"
fsync = "never"

[[backends]]
name = "local"
url = "file://{tmp_path / "local"}"
writable = true
revalidate = "1s"
""")
    config = load_config(toml, environ={}, cwd=tmp_path)
    async with open_node(config, Metrics(), tls=None) as node:
        yield node


def member_of(key: str, size: int, version: str) -> Member:
    return Member(key, size, version, "fixed", size, {"record_bytes": 1})


def cutting_keys(count: int, every: int) -> list[str]:
    """``count`` member keys in order, every ``every``-th one a key after which a member
    page ends (its blake3's first 8 bytes, little-endian, are 0 modulo PAGE_TARGET)."""
    keys: list[str] = []
    n = 0
    while len(keys) < count:
        want_cut = len(keys) % every == every - 1
        while True:
            key = f"data/m{len(keys):04d}-{n}.bin"
            n += 1
            digest = blake3.blake3(key.encode()).digest(length=8)
            if (int.from_bytes(digest, "little") % PAGE_TARGET == 0) == want_cut:
                break
        keys.append(key)
    return keys


@pytest.mark.timeout(60)
async def test_a_freeze_of_a_paged_snapshot_writes_record_pages_a_member_page_at_a_time(
    inproc: Node, tmp_path: Path
) -> None:
    root = tmp_path / "local"
    keys = cutting_keys(24, every=8)
    sizes = [0 if n == 5 else 4096 * (n % 4) + 100 * n for n in range(len(keys))]
    files = {k: os.urandom(size) for k, size in zip(keys, sizes, strict=True)}
    write_objects(root, files)
    members = []
    for key in keys:
        stat = await inproc.read_path.stat("local", key)
        members.append(
            Member(key, stat.size, stat.meta.version, "fixed", stat.size, {"record_bytes": 1})
        )
    built = MemoryPages()
    snap = Snapshot.build(
        backend="local", prefix="data/", format="fixed", members=members, pages=built, schema=2
    )
    assert len(snap.pages) == 3
    registry = inproc.datasets.registry
    for data in built.pages.values():
        await registry.put_page(data)
    freezer = Freezer(
        registry, inproc.read_path, inproc.cache, inproc.metrics, poll_interval=0.1, record_schema=2
    )
    bare = snap.with_pages(None)  # every member page comes from the registry, checked
    report = await freezer.freeze(bare)
    chunks = sum(-(-size // 4096) for size in sizes)
    assert (report["members"], report["chunks"], report["already"]) == (24, chunks, False)
    raw = (root / "datasets" / "frozen" / f"{snap.id}.json").read_bytes()
    record = json.loads(raw)
    assert record["schema"] == 2
    # A record page ends where a member page does: each member page's first key starts one.
    starts = [(key, chunk) for _, key, chunk, _ in record["pages"]]
    assert [(p.first, 0) for p in snap.pages] == starts
    lists = record_chunk_lists(root / "datasets", raw)
    for key, ids in zip(keys, lists, strict=True):
        data = files[key]
        assert ids == [
            blake3.blake3(data[at : at + 4096]).hexdigest() for at in range(0, len(data), 4096)
        ]
        assert all((root / "chunks" / cid).exists() for cid in ids)
    # Read back through the daemon's own reader, and again: all there.
    record_doc = await freezer.frozen(bare)
    assert record_doc is not None
    reader = freezer.chunks_of(record_doc, bare)
    await registry.load_pages(bare, [2])
    assert await reader.of_member(bare, 23) == lists[23]
    assert (await freezer.freeze(bare))["already"] is True
    # The record pages are content-addressed: a second snapshot sharing two of the three
    # member pages shares their record pages.
    changed = os.urandom(4096)
    write_objects(root, {keys[0]: changed})
    await asyncio.sleep(1.1)  # the backend's versions are re-checked after a second
    stat = await inproc.read_path.stat("local", keys[0])
    members[0] = Member(
        keys[0], stat.size, stat.meta.version, "fixed", stat.size, {"record_bytes": 1}
    )
    built_again = MemoryPages()
    again = Snapshot.build(
        backend="local",
        prefix="data/",
        format="fixed",
        members=members,
        pages=built_again,
        schema=2,
    )
    for data in built_again.pages.values():
        await registry.put_page(data)
    await freezer.freeze(again.with_pages(None))
    record_again = json.loads((root / "datasets" / "frozen" / f"{again.id}.json").read_bytes())
    first = {p[0] for p in record["pages"]}
    second = {p[0] for p in record_again["pages"]}
    assert len(first & second) == 2
