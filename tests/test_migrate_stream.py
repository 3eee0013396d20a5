"""Streamed writes that never overwrite (``Backend.put_stream``), and migrate over them.

Real backends: file:// directories and moto's S3 server (``chunkd.testing``). A streamed
write to S3 is a multipart upload finished with ``If-None-Match: *``; to a file://
backend a staging file linked into place. Neither overwrites an object, whenever it
appears, and a write that fails leaves nothing behind (no object, no multipart upload,
no staging file).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from chunkd.errors import IntegrityError, InvalidRequestError, SnapshotDriftError
from chunkd.gateway.backends import Backend, make_backend
from chunkd.gateway.backends.base import SINGLE_PUT_BYTES
from chunkd.gateway.backends.s3 import PART_BYTES
from chunkd.gateway.config import BackendConfig
from chunkd.gateway.metrics import Metrics
from chunkd.testing import S3Server

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
    assert staging_files(root) == []
    assert [m.key for batch in [b async for b in files.scan("a")] for m in batch] == [
        "a/b.bin",
        "a/c.bin",
    ]


async def _numbered(pieces: AsyncIterator[memoryview]) -> AsyncIterator[tuple[int, memoryview]]:
    n = 0
    async for piece in pieces:
        yield n, piece
        n += 1
