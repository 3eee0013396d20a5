"""Whether a cache directory is sound: what the index claims is on disk, and right.

The invariant every crash and fault test checks after the fact, on a cache whose
daemon is stopped (or was killed): every record of the index has its file, of the
recorded size, decoding to bytes that hash to the chunk's id; and no file under
``chunks/`` sits under a name its bytes do not hash to. Files the index does not
know (a crash between a rename and its record) are allowed: the next start's
reconciliation adopts or removes them.

Part of :mod:`chunkd.testing`; the daemon never imports it.
"""

from __future__ import annotations

from pathlib import Path

import blake3
import zstandard

from chunkd.cache import ChunkId, Codec, Index

__all__ = ["assert_cache_sound"]


def _file_matches_name(path: Path) -> bool:
    raw = path.read_bytes()
    cid = ChunkId.parse(path.name)
    if blake3.blake3(raw).digest() == cid:
        return True
    try:
        data = zstandard.ZstdDecompressor().decompress(raw)
    except zstandard.ZstdError:
        return False
    return blake3.blake3(data).digest() == cid


def assert_cache_sound(root: Path, chunk_bytes: int) -> tuple[int, int]:
    """Check the cache directory ``root``; returns (files, index records).

    Raises:
        AssertionError: a file under a wrong name, or a record whose file is
            missing, of another size, or damaged.
    """
    files = list((root / "chunks").glob("*/*/*"))
    for path in files:
        assert _file_matches_name(path), f"{path} does not hash to its name"
    records = 0
    index = Index(root / "index", chunk_bytes=chunk_bytes)
    try:
        after: bytes | None = None
        while page := index.scan_chunks(after, 500):
            for cid, record in page:
                after = cid
                records += 1
                path = root / "chunks" / str(cid)[:2] / str(cid)[2:4] / str(cid)
                assert path.exists(), f"the index claims chunk {cid}, but its file is missing"
                raw = path.read_bytes()
                assert len(raw) == record.stored_size, (
                    f"chunk {cid}: the file holds {len(raw)} bytes, the index says "
                    f"{record.stored_size}"
                )
                data = (
                    zstandard.ZstdDecompressor().decompress(raw)
                    if record.codec == Codec.ZSTD
                    else raw
                )
                assert blake3.blake3(data).digest() == cid, f"chunk {cid}: its file is damaged"
    finally:
        index.close()
    return len(files), records
