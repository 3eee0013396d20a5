"""Streamed writes that never overwrite (``Backend.put_stream``), and migrate over them.

Real backends: file:// directories and moto's S3 server (``chunkd.testing``). A streamed
write to S3 is a multipart upload finished with ``If-None-Match: *``; to a file://
backend a staging file linked into place. Neither overwrites an object, whenever it
appears, and a write that fails leaves nothing behind (no object, no multipart upload,
no staging file).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import blake3
import pytest

from chunkd import memfd
from chunkd.client import Client
from chunkd.client.datasets.pages import DaemonPages
from chunkd.errors import (
    IntegrityError,
    InvalidRequestError,
    ObjectExistsError,
    SnapshotDriftError,
)
from chunkd.gateway.backends import Backend, Backends, make_backend
from chunkd.gateway.backends.base import SINGLE_PUT_BYTES
from chunkd.gateway.backends.s3 import PART_BYTES
from chunkd.gateway.config import BackendConfig
from chunkd.gateway.datasets.migrate import Migrator
from chunkd.gateway.datasets.registry import Registry
from chunkd.gateway.metrics import Metrics
from chunkd.gateway.readpath import ReadPath
from chunkd.snapshot import Member, MemoryPages, Snapshot, _cuts_after
from chunkd.testing import S3Server, s3_backend

from .conftest import Daemon, OpenCache, small_node_toml

PIECE = 1 << 20


def pattern(size: int, seed: int = 0) -> bytes:
    """``size`` bytes that differ from one MiB to the next."""
    block = hashlib.sha256(str(seed).encode()).digest() * (PIECE // 32)
    return b"".join(
        (i.to_bytes(8, "big") + block[8:])[: min(PIECE, size - i * PIECE)]
        for i in range(-(-size // PIECE))
    )


async def pieces_of(data: bytes, *, fail_after: int | None = None) -> AsyncIterator[memoryview]:
    """``data`` in 1 MiB pieces; with ``fail_after``, a read error after that many."""
    view = memoryview(data)
    for n, start in enumerate(range(0, len(data), PIECE)):
        if fail_after is not None and n == fail_after:
            raise SnapshotDriftError("the source changed while it was read")
        yield view[start : start + PIECE]


@pytest.fixture
async def s3(s3_server: S3Server, bucket: str) -> AsyncIterator[Backend]:
    backend = make_backend(s3_server.backend_config("s3", f"s3://{bucket}/pre"), Metrics())
    yield backend
    await backend.close()


@pytest.fixture
async def files(tmp_path: Path) -> AsyncIterator[Backend]:
    (tmp_path / "dst").mkdir()
    backend = make_backend(
        BackendConfig("dst", f"file://{tmp_path / 'dst'}", writable=True), Metrics()
    )
    yield backend
    await backend.close()


def uploads(s3_server: S3Server, bucket: str) -> list[dict[str, Any]]:
    """The multipart uploads in progress in ``bucket``."""
    found = s3_server.client().list_multipart_uploads(Bucket=bucket)
    return list(found.get("Uploads", []))


def staging_files(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if "#" in p.name]


# -- S3: a multipart upload finished only where nothing is --------------------------------


@pytest.mark.timeout(30)
async def test_s3_streamed_write_of_many_parts(
    s3: Backend, s3_server: S3Server, bucket: str
) -> None:
    assert s3.streams_conditional_put
    data = pattern(2 * PART_BYTES + 3 * PIECE + 17)
    assert await s3.put_stream("big/one.bin", pieces_of(data), size=len(data))
    got = s3_server.client().get_object(Bucket=bucket, Key="pre/big/one.bin")["Body"].read()
    assert got == data
    assert uploads(s3_server, bucket) == []
    assert s3.held_by_put(len(data)) == PART_BYTES


@pytest.mark.timeout(30)
async def test_s3_streamed_write_never_overwrites_an_object_that_appears(
    s3: Backend, s3_server: S3Server, bucket: str
) -> None:
    # The object appears while the parts are being sent: CompleteMultipartUpload with
    # If-None-Match: * is refused (412), the other writer's bytes stay, and the
    # upload is aborted.
    data = pattern(2 * PART_BYTES + 5, seed=1)
    client = s3_server.client()

    async def racing() -> AsyncIterator[memoryview]:
        async for n, piece in _numbered(pieces_of(data)):
            if n == 9:  # a part sent already
                assert len(uploads(s3_server, bucket)) == 1
                client.put_object(Bucket=bucket, Key="pre/raced.bin", Body=b"theirs")
            yield piece

    assert not await s3.put_stream("raced.bin", racing(), size=len(data))
    assert client.get_object(Bucket=bucket, Key="pre/raced.bin")["Body"].read() == b"theirs"
    assert uploads(s3_server, bucket) == []
    # and an object there from the start: the same answer, nothing written
    small = pattern(PIECE)
    assert not await s3.put_stream("raced.bin", pieces_of(small), size=len(small))
    assert client.get_object(Bucket=bucket, Key="pre/raced.bin")["Body"].read() == b"theirs"


@pytest.mark.timeout(30)
async def test_s3_streamed_write_that_fails_halfway_leaves_nothing(
    s3: Backend, s3_server: S3Server, bucket: str
) -> None:
    data = pattern(3 * PART_BYTES, seed=2)
    with pytest.raises(SnapshotDriftError, match="changed while it was read"):
        await s3.put_stream("half.bin", pieces_of(data, fail_after=20), size=len(data))
    assert await s3.head("half.bin") is None
    assert uploads(s3_server, bucket) == []
    # a source that gives fewer bytes than it said: refused, nothing left either
    with pytest.raises(IntegrityError, match="was to be"):
        await s3.put_stream("half.bin", pieces_of(data[:-1]), size=len(data))
    assert await s3.head("half.bin") is None
    assert uploads(s3_server, bucket) == []


@pytest.mark.timeout(30)
async def test_s3_without_a_key_puts_whole_and_refuses_larger(
    s3_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Credentials the streamed write cannot sign with (the machine's, here the
    # environment's are cleared): what cannot finish conditionally is put whole, and
    # an object larger than the single put is refused before anything is read.
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    config = s3_server.backend_config(
        "s3", f"s3://{bucket}/pre", access_key_id=None, secret_access_key=None
    )
    backend = make_backend(config, Metrics())
    try:
        assert not backend.streams_conditional_put

        async def never() -> AsyncIterator[bytes]:
            if backend.name:  # a stream that fails when read
                raise AssertionError("read")
            yield b""

        with pytest.raises(InvalidRequestError, match="cannot finish a streamed write"):
            await backend.put_stream("x.bin", never(), size=SINGLE_PUT_BYTES + 1)
    finally:
        await backend.close()


# -- file://: a staging file linked into place --------------------------------------------


@pytest.mark.timeout(30)
async def test_file_streamed_write_links_into_place_and_never_overwrites(
    files: Backend, tmp_path: Path
) -> None:
    root = tmp_path / "dst"
    data = pattern(5 * PIECE + 3)
    assert files.streams_conditional_put
    assert await files.put_stream("a/b.bin", pieces_of(data), size=len(data))
    assert (root / "a/b.bin").read_bytes() == data
    (root / "a/c.bin").write_bytes(b"mine")
    assert not await files.put_stream("a/c.bin", pieces_of(data), size=len(data))
    assert (root / "a/c.bin").read_bytes() == b"mine"
    with pytest.raises(SnapshotDriftError):
        await files.put_stream("a/d.bin", pieces_of(data, fail_after=2), size=len(data))
    assert not (root / "a/d.bin").exists()
    # a write that fails makes no directory of its key either
    with pytest.raises(SnapshotDriftError):
        await files.put_stream("new/dir/d.bin", pieces_of(data, fail_after=2), size=len(data))
    assert not (root / "new").exists()
    assert await files.put_stream("new/dir/e.bin", pieces_of(data), size=len(data))
    assert (root / "new/dir/e.bin").read_bytes() == data
    assert staging_files(root) == []
    assert [m.key for batch in [b async for b in files.scan("")] for m in batch] == [
        "a/b.bin",
        "a/c.bin",
        "new/dir/e.bin",
    ]


async def _numbered(pieces: AsyncIterator[memoryview]) -> AsyncIterator[tuple[int, memoryview]]:
    n = 0
    async for piece in pieces:
        yield n, piece
        n += 1


# -- migrate: paged, streamed, bounded ----------------------------------------------------


@pytest.fixture
async def migrator(
    open_cache: OpenCache, tmp_path: Path, s3_server: S3Server, bucket: str
) -> AsyncIterator[Migrator]:
    """A migrator from backend ``src`` (``tmp_path/src``) to ``dst`` (file://, the
    registry's: ``dst/datasets``) or ``s3`` (moto), over a real cache and read path."""
    for name in ("src", "dst"):
        (tmp_path / name).mkdir()
    metrics = Metrics()
    backends = Backends.from_config(
        [
            BackendConfig("src", f"file://{tmp_path / 'src'}"),
            BackendConfig("dst", f"file://{tmp_path / 'dst'}", writable=True),
            s3_server.backend_config("s3", f"s3://{bucket}/pre"),
        ],
        metrics,
    )
    read_path = ReadPath(await open_cache(), backends, metrics)
    try:
        yield Migrator(Registry(backends, "dst/datasets"), read_path, backends)
    finally:
        await read_path.close()
        await backends.close()


async def source_members(migrator: Migrator, root: Path, files: dict[str, bytes]) -> list[Member]:
    """``files`` written under ``root`` (backend ``src``), as members (fixed records)."""
    members = []
    for key, data in sorted(files.items()):
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        meta = await migrator.backends.get("src").head(key)
        assert meta is not None
        members.append(
            Member(key, len(data), meta.version, "fixed", len(data) // 16, {"record_bytes": 16})
        )
    return members


async def paged_snapshot(migrator: Migrator, members: list[Member]) -> Snapshot:
    """A schema-2 snapshot of ``members`` whose pages are in the registry, read as a
    daemon reads one: its root alone, each page loaded when asked for."""
    pages = MemoryPages()
    built = Snapshot.build(
        backend="src", prefix="m/", format="fixed", members=members, pages=pages, schema=2
    )
    for data in pages.pages.values():
        await migrator.registry.put_page(data)
    return Snapshot.parse(built.data, expect_id=built.id)


@pytest.mark.timeout(60)
async def test_a_member_larger_than_the_memory_bound_migrates_in_bounded_memory(
    migrator: Migrator, tmp_path: Path, s3_server: S3Server, bucket: str
) -> None:
    # 48 MiB member, streamed to S3 in 8 MiB parts: the migration's Python heap peaks
    # well under the member's size (today's migrate held it whole, and read the copy
    # back whole).
    size = 48 << 20
    data = pattern(size, seed=5)
    members = await source_members(migrator, tmp_path / "src", {"m/big.bin": data})
    snapshot = await paged_snapshot(migrator, members)
    del data
    tracemalloc.start()
    try:
        copy, counts = await migrator.copy(snapshot, "s3/copy", None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"peak traced heap {peak / (1 << 20):.1f} MiB migrating a {size >> 20} MiB member")
    assert counts["copied"] == 1
    assert peak < 24 << 20, peak
    body = s3_server.client().get_object(Bucket=bucket, Key="pre/copy/big.bin")["Body"]
    digest = hashlib.sha256()
    while chunk := body.read(1 << 20):
        digest.update(chunk)
    assert digest.hexdigest() == hashlib.sha256(pattern(size, seed=5)).hexdigest()
    [member] = copy.members
    assert member.content == blake3.blake3(pattern(size, seed=5)).hexdigest()
    assert uploads(s3_server, bucket) == []


@pytest.mark.timeout(60)
async def test_migrate_never_overwrites_another_object_on_s3(
    migrator: Migrator, tmp_path: Path, s3_server: S3Server, bucket: str
) -> None:
    data = pattern(20 << 20, seed=6)
    members = await source_members(
        migrator, tmp_path / "src", {"m/a.bin": b"a" * 32, "m/big.bin": data}
    )
    snapshot = await paged_snapshot(migrator, members)
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="pre/copy/big.bin", Body=b"someone else's bytes")
    with pytest.raises(
        ObjectExistsError, match=r"s3/copy/big\.bin exists already with other bytes"
    ):
        await migrator.copy(snapshot, "s3/copy", None)
    got = client.get_object(Bucket=bucket, Key="pre/copy/big.bin")["Body"].read()
    assert got == b"someone else's bytes"
    assert uploads(s3_server, bucket) == []


@pytest.mark.timeout(60)
async def test_migrate_failing_halfway_leaves_no_object_and_no_upload(
    migrator: Migrator, tmp_path: Path, s3_server: S3Server, bucket: str
) -> None:
    # The member reads as other bytes than its recorded content: that is found at the
    # end of its stream, after two parts were sent, and before the upload is finished.
    data = pattern(20 << 20, seed=7)
    [member] = await source_members(migrator, tmp_path / "src", {"m/big.bin": data})
    wrong = dataclasses.replace(member, content="0" * 64)
    # a recorded content hash: chunkd's own claim, in a one-document (schema-1) snapshot
    snapshot = Snapshot.build(backend="src", prefix="m/", format="fixed", members=[wrong], schema=1)
    with pytest.raises(IntegrityError, match=r"read as other bytes than it records"):
        await migrator.copy(snapshot, "s3/copy", None)
    assert await migrator.backends.get("s3").head("copy/big.bin") is None
    assert uploads(s3_server, bucket) == []
    # the same to file://: no object, no staging file
    with pytest.raises(IntegrityError, match=r"read as other bytes than it records"):
        await migrator.copy(snapshot, "dst/copy", None)
    assert not (tmp_path / "dst/copy/big.bin").exists()
    assert staging_files(tmp_path / "dst") == []


@pytest.mark.timeout(60)
async def test_an_old_snapshot_migrates_into_a_paged_one_with_content(
    migrator: Migrator, tmp_path: Path
) -> None:
    files = {f"m/{i:03d}.bin": pattern(16 * (i + 1), seed=i) for i in range(40)}
    members = await source_members(migrator, tmp_path / "src", files)
    old = Snapshot.build(backend="src", prefix="m/", format="fixed", members=members, schema=1)
    assert old.schema == 1
    copy, counts = await migrator.copy(old, "dst/copy", None)
    assert (counts["copied"], counts["kept"]) == (40, 0)
    assert copy.schema == 2
    assert copy.origin == old.id
    ident, version, _ = await migrator.registry.commit(copy.data, "old", verified_copy=True)
    assert (ident, version) == (copy.id, 1)
    # Read back as a reader does: the root, then its pages from the registry.
    resolved = (await migrator.registry.resolve("old@1")).snapshot
    assert resolved.schema == 2
    await migrator.registry.load_pages(resolved, range(len(resolved.pages)))
    got = {m.key: m for m in resolved.members}
    assert sorted(got) == [f"copy/{i:03d}.bin" for i in range(40)]
    for key, data in files.items():
        member = got["copy/" + key.removeprefix("m/")]
        assert member.content == blake3.blake3(data).hexdigest()
        assert (tmp_path / "dst/copy" / key.removeprefix("m/")).read_bytes() == data


@pytest.mark.timeout(60)
async def test_a_paged_snapshot_migrates_page_by_page(migrator: Migrator, tmp_path: Path) -> None:
    # Members whose keys end pages (content-defined), so the source has several pages;
    # the migration loads them from the registry as it goes (the snapshot has no page
    # source of its own).
    keys = [f"m/{i:05d}.bin" for i in range(40_000) if _cuts_after(f"m/{i:05d}.bin")][:3]
    keys += [f"m/{i:05d}.bin" for i in range(30)]
    files = {key: key.encode() * 4 for key in keys}
    members = await source_members(migrator, tmp_path / "src", files)
    snapshot = await paged_snapshot(migrator, members)
    assert len(snapshot.pages) >= 3
    assert snapshot.page_loads == 0
    copy, counts = await migrator.copy(snapshot, "dst/copy", None)
    assert counts["copied"] == len(files)
    assert snapshot.page_loads >= len(snapshot.pages)
    assert [m.key for m in copy.members] == sorted("copy/" + k.removeprefix("m/") for k in files)
    for key, data in files.items():
        assert (tmp_path / "dst/copy" / key.removeprefix("m/")).read_bytes() == data
    # Again: every object is there with the same bytes, kept as it is.
    again, counts = await migrator.copy(snapshot, "dst/copy", None)
    assert (counts["copied"], counts["kept"]) == (0, len(files))
    assert again.id == copy.id


# -- through the daemon -------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_ds_migrate_streams_an_old_snapshot_to_s3_as_a_paged_copy(
    start_daemon: Callable[..., Daemon], tmp_path: Path, s3_server: S3Server, bucket: str
) -> None:
    # A schema-1 snapshot (what older chunkd registered) with a member of three parts,
    # migrated by the daemon to S3: a multipart upload finished conditionally, and
    # the copy registered as a schema-2 snapshot whose members record their content.
    shared = tmp_path / "shared"
    files = {"data/big.bin": pattern(PART_BYTES * 2 + 4096, seed=9), "data/a.bin": b"a" * 64}
    for key, data in files.items():
        (shared / key).parent.mkdir(parents=True, exist_ok=True)
        (shared / key).write_bytes(data)
    toml = (
        small_node_toml(tmp_path / "cache", ("shared", shared), chunk_bytes="1MiB")
        + '\n[datasets]\nregistry = "shared/datasets"\n'
        + s3_backend("s3", f"s3://{bucket}/pre", s3_server.endpoint, writable=True)
    )
    daemon = start_daemon(toml, cwd=tmp_path / "node")
    with Client(daemon.cwd / "chunkd.sock") as client:
        members = []
        for key in sorted(files):
            stat = client.stat(f"shared/{key}")
            members.append(
                Member(key, stat.size, stat.version, "fixed", stat.size // 16, {"record_bytes": 16})
            )
        old = Snapshot.build(
            backend="shared", prefix="data/", format="fixed", members=members, schema=1
        )
        fd = memfd.sealed(old.data)
        try:
            client.request("ds_commit", {"name": "old"}, fds=[fd], timeout=60)
        finally:
            os.close(fd)
        got = client.request("ds_migrate", {"ref": "old", "to": "s3/copy"}, timeout=60).header
        assert (got["version"], got["from"], got["copied"]) == (2, old.id, 2)
        with client.request("ds_resolve", {"ref": "old@2"}) as reply:
            root = os.pread(reply.fds[0], os.fstat(reply.fds[0]).st_size, 0)
        copy = Snapshot.parse(root, expect_id=got["snapshot"], pages=DaemonPages(client))
        assert copy.schema == 2
        assert copy.origin == old.id
        assert [(m.key, m.content) for m in copy.members] == [
            ("copy/a.bin", blake3.blake3(files["data/a.bin"]).hexdigest()),
            ("copy/big.bin", blake3.blake3(files["data/big.bin"]).hexdigest()),
        ]
    s3 = s3_server.client()
    assert (
        s3.get_object(Bucket=bucket, Key="pre/copy/big.bin")["Body"].read() == files["data/big.bin"]
    )
    assert uploads(s3_server, bucket) == []
    assert "Traceback" not in daemon.log.read_text()


@pytest.mark.timeout(30)
async def test_a_store_without_a_conditional_finish_puts_whole_and_never_overwrites() -> None:
    backend = make_backend(BackendConfig("mem", "memory://", writable=True), Metrics())
    try:
        assert not backend.streams_conditional_put
        assert backend.held_by_put(3 * PIECE) == 3 * PIECE
        data = pattern(3 * PIECE, seed=3)
        assert await backend.put_stream("k.bin", pieces_of(data), size=len(data))
        assert not await backend.put_stream("k.bin", pieces_of(b"x" * 10), size=10)
        assert bytes(await backend.get("k.bin") or b"") == data
        with pytest.raises(IntegrityError, match="was to be"):
            await backend.put_stream("l.bin", pieces_of(data), size=len(data) - 1)
        assert await backend.head("l.bin") is None
        with pytest.raises(InvalidRequestError, match="puts at most 67108864 bytes whole"):
            await backend.put_stream("m.bin", pieces_of(b""), size=SINGLE_PUT_BYTES + 1)
    finally:
        await backend.close()
