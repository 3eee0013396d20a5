"""Chunk ids and chunking: property tests."""

from __future__ import annotations

import blake3
import pytest
from hypothesis import given
from hypothesis import strategies as st

from chunkd.cache import ChunkId, chunk_count, split_chunks
from chunkd.errors import ChunkdError, InvalidChunkIdError


@given(st.binary(max_size=4096))
def test_id_is_blake3_and_round_trips_through_hex(data: bytes) -> None:
    cid = ChunkId.of(data)
    assert bytes(cid) == blake3.blake3(data).digest()
    assert str(cid) == blake3.blake3(data).hexdigest()
    assert ChunkId.parse(str(cid)) == cid
    assert ChunkId.parse(str(cid).upper()) == cid
    assert ChunkId.from_digest(bytes(cid)) == cid
    assert hash(ChunkId.parse(str(cid))) == hash(cid)
    assert cid.matches(data)


def test_large_buffers_hash_the_same_on_many_threads() -> None:
    data = bytes(range(256)) * (5 << 12)  # 5 MiB: hashed with max_threads=AUTO
    assert bytes(ChunkId.of(data)) == blake3.blake3(data).digest()


@given(st.text(max_size=100))
def test_parse_rejects_anything_but_64_hex_chars(text: str) -> None:
    valid = len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)
    if valid:
        assert str(ChunkId.parse(text)) == text.lower()
    else:
        with pytest.raises(InvalidChunkIdError, match="chunk id"):
            ChunkId.parse(text)


@pytest.mark.parametrize(
    "bad", ["", "xyz", "0" * 63, "0" * 65, "g" * 64, " " + "0" * 63, "0" * 62 + "\n0"]
)
def test_parse_errors_are_value_errors_with_a_clear_message(bad: str) -> None:
    with pytest.raises(ValueError, match="expected 64 hex characters") as info:
        ChunkId.parse(bad)
    assert isinstance(info.value, ChunkdError)


def test_wrong_digest_length_and_type_are_refused() -> None:
    with pytest.raises(InvalidChunkIdError, match="32 raw bytes"):
        ChunkId(b"\x00" * 31)
    with pytest.raises(InvalidChunkIdError, match="hex string"):
        ChunkId.parse(b"\x00" * 32)  # type: ignore[arg-type]


def test_slices_are_plain_bytes_and_repr_is_readable() -> None:
    cid = ChunkId.of(b"x")
    assert type(cid[:4]) is bytes
    assert repr(cid) == f"ChunkId('{cid}')"


@given(st.binary(max_size=10_000), st.integers(min_value=1, max_value=3000))
def test_split_chunks_covers_the_buffer_without_copies(data: bytes, size: int) -> None:
    parts = list(split_chunks(data, size))
    assert b"".join(parts) == data
    assert len(parts) == chunk_count(len(data), size)
    assert all(p.nbytes == size for p in parts[:-1])
    if parts:
        assert 0 < parts[-1].nbytes <= size
    assert all(p.obj is data for p in parts)  # views of the caller's buffer


def test_split_chunks_views_typed_buffers_as_bytes() -> None:
    words = memoryview(bytearray(64)).cast("I")
    parts = list(split_chunks(words, 10))
    assert [p.nbytes for p in parts] == [10] * 6 + [4]
    assert all(p.format == "B" for p in parts)


@pytest.mark.parametrize("size", [0, -1])
def test_split_chunks_rejects_nonpositive_sizes(size: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        list(split_chunks(b"abc", size))
    with pytest.raises(ValueError, match="positive"):
        chunk_count(3, size)
