"""Chunk ids and chunking.

A chunk id is the blake3-256 digest of a chunk's raw (uncompressed) bytes. It is
the cache's only key for data. :class:`ChunkId` subclasses :class:`bytes` (the 32
raw digest bytes) so that dict lookups and lmdb keys cost nothing extra; ``str()``
gives the 64-character lowercase hex form used in file names, URLs and logs.
"""

from __future__ import annotations

import binascii
from collections.abc import Iterator
from typing import Final

import blake3

from chunkd.errors import InvalidChunkIdError

__all__ = [
    "DIGEST_BYTES",
    "HEX_CHARS",
    "MAX_CHUNK_BYTES",
    "ChunkId",
    "chunk_count",
    "hash_threads",
    "split_chunks",
]

DIGEST_BYTES: Final = 32
HEX_CHARS: Final = 2 * DIGEST_BYTES
#: the largest chunk chunkd writes (``cache.chunk_bytes`` is at most this): an object
#: in a chunk store that is larger is no chunk, and is never read whole
MAX_CHUNK_BYTES: Final = 64 << 20
_HEX_DIGITS: Final = frozenset("0123456789abcdefABCDEF")

# blake3 hashes one buffer on several threads (it releases the GIL). Below this
# size the thread start-up costs more than it saves.
_MULTITHREAD_MIN_BYTES: Final = 1 << 20


def hash_threads(size: int) -> int:
    """The ``max_threads`` value to hand blake3 for a buffer of ``size`` bytes."""
    return blake3.blake3.AUTO if size >= _MULTITHREAD_MIN_BYTES else 1


class ChunkId(bytes):
    """The blake3-256 digest of a chunk's raw bytes.

    Build one with :meth:`of` (hash bytes), :meth:`parse` (64 hex characters) or
    :meth:`from_digest` (32 raw bytes). Instances are immutable, hashable and
    compare equal to the same digest.
    """

    __slots__ = ()

    def __new__(cls, digest: bytes | bytearray | memoryview) -> ChunkId:
        raw = bytes(digest)
        if len(raw) != DIGEST_BYTES:
            raise InvalidChunkIdError(
                f"a chunk id is {DIGEST_BYTES} raw bytes (blake3-256); got {len(raw)} bytes"
            )
        return super().__new__(cls, raw)

    @classmethod
    def from_digest(cls, digest: bytes | bytearray | memoryview) -> ChunkId:
        """Wrap 32 raw digest bytes, as stored in the index."""
        return cls(digest)

    @classmethod
    def parse(cls, text: str | ChunkId) -> ChunkId:
        """Parse the 64-character hex form (either case); raise on anything else.

        Raises:
            InvalidChunkIdError: ``text`` is not exactly 64 hex characters.
        """
        if isinstance(text, ChunkId):
            return text
        if not isinstance(text, str):
            raise InvalidChunkIdError(
                f"a chunk id is given as a 64-character hex string; got {type(text).__name__}"
            )
        if len(text) != HEX_CHARS or not _HEX_DIGITS.issuperset(text):
            shown = text if len(text) <= 80 else text[:77] + "..."
            raise InvalidChunkIdError(
                f"not a chunk id: {shown!r}; expected {HEX_CHARS} hex characters "
                "(the blake3-256 of the chunk's bytes)"
            )
        return cls(binascii.unhexlify(text))

    @classmethod
    def of(cls, data: bytes | bytearray | memoryview, *, threads: int | None = None) -> ChunkId:
        """Hash ``data`` (any contiguous buffer) and return its id.

        ``threads`` caps blake3's threads; by default a large buffer is hashed on
        every core. Pass 1 when another thread works on the same bytes meanwhile.
        """
        view = memoryview(data)
        most = hash_threads(view.nbytes) if threads is None else threads
        return cls(blake3.blake3(view, max_threads=most).digest())

    def matches(self, data: bytes | bytearray | memoryview) -> bool:
        """True when ``data`` hashes to this id."""
        return ChunkId.of(data) == self

    @property
    def hex_id(self) -> str:
        """The 64-character lowercase hex form."""
        return self.hex()

    def __str__(self) -> str:
        return self.hex()

    def __repr__(self) -> str:
        return f"ChunkId('{self.hex()}')"


def chunk_count(size: int, chunk_bytes: int) -> int:
    """How many chunks of at most ``chunk_bytes`` a ``size``-byte object splits into."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive; got {chunk_bytes}")
    if size < 0:
        raise ValueError(f"size must not be negative; got {size}")
    return -(-size // chunk_bytes)


def split_chunks(data: bytes | bytearray | memoryview, chunk_bytes: int) -> Iterator[memoryview]:
    """Split a buffer into consecutive chunks of ``chunk_bytes`` (the last may be short).

    No bytes are copied: each chunk is a :class:`memoryview` slice of ``data``. An
    empty buffer yields nothing. Multi-dimensional or non-byte buffers are viewed as
    flat bytes (they must be C-contiguous).
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive; got {chunk_bytes}")
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    for start in range(0, view.nbytes, chunk_bytes):
        yield view[start : start + chunk_bytes]
