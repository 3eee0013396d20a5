"""How the disk tier stores a chunk's bytes: raw, or one zstd frame when that pays.

A chunk is compressed only when it saves at least ``1 - ratio`` of its size. A big
chunk is probed first with a few small samples spread over it, so an incompressible
chunk (most tensors) costs a few small compressions, not a full one. A stored file
says it is compressed by its first bytes (:data:`ZSTD_MAGIC`), which is how a file
the index does not know is read back (:func:`stored_forms`).

Compressors and decompressors are kept one per thread (zstd's are not thread-safe):
the disk tier calls :meth:`ChunkCodec.encode` and :meth:`ChunkCodec.decode` on its
worker threads.
"""

from __future__ import annotations

import threading
from typing import Final

import zstandard

from chunkd.cache.index import Codec
from chunkd.errors import IntegrityError

__all__ = ["ZSTD_MAGIC", "ChunkCodec", "stored_forms"]

# Constants, not config keys: they are the file format or the cost model of one
# decision, and no operator setting would make them better on one node than another.
#: the first bytes of a zstd frame: how a stored chunk says it is compressed
ZSTD_MAGIC: Final = b"\x28\xb5\x2f\xfd"
#: a big chunk is probed for compressibility with this many samples of this size
#: (64 KiB in all), so an incompressible chunk costs a small fraction of a compression
_SAMPLE_BYTES: Final = 16 * 1024
_SAMPLES: Final = 4
#: below this a chunk is stored raw: under one file system block there is nothing to save
_MIN_COMPRESS_BYTES: Final = 4096


class ChunkCodec:
    """The disk tier's choice of stored form, and its inverse.

    Args:
        compress: compress at all (``False``: every chunk is stored raw).
        level: zstd level.
        ratio: the largest compressed/raw ratio worth keeping (7/8).
    """

    def __init__(self, *, compress: bool = True, level: int = 1, ratio: float = 7 / 8) -> None:
        self.compress = compress
        self._level = level
        self._ratio = ratio
        self._local = threading.local()

    def encode(self, data: memoryview) -> tuple[memoryview | bytes, Codec]:
        """The bytes to store for ``data``, and how they are stored."""
        size = data.nbytes
        if not self.compress or size < _MIN_COMPRESS_BYTES:
            return data, Codec.RAW
        compressor = self._compressor()
        if size > 4 * _SAMPLE_BYTES:
            # Probe samples spread over the chunk first: incompressible data (most
            # tensors) then costs a few small compressions, not a full one.
            step = (size - _SAMPLE_BYTES) // (_SAMPLES - 1)
            probed = sum(
                len(compressor.compress(data[i * step : i * step + _SAMPLE_BYTES]))
                for i in range(_SAMPLES)
            )
            if probed > self._ratio * _SAMPLES * _SAMPLE_BYTES:
                return data, Codec.RAW
        packed = compressor.compress(data)
        if len(packed) <= self._ratio * size:
            return packed, Codec.ZSTD
        return data, Codec.RAW

    def decode(self, codec: int, raw: bytearray, size: int) -> bytearray:
        """The chunk's bytes from its stored form (at most ``size`` bytes are made).

        Raises:
            IntegrityError: a zstd frame is damaged.
        """
        if codec != Codec.ZSTD:
            return raw
        try:
            return bytearray(self._decompressor().decompress(raw, max_output_size=size))
        except zstandard.ZstdError as exc:
            raise IntegrityError(f"zstd frame is damaged ({exc})") from None

    def _compressor(self) -> zstandard.ZstdCompressor:
        comp: zstandard.ZstdCompressor | None = getattr(self._local, "comp", None)
        if comp is None:
            comp = zstandard.ZstdCompressor(level=self._level)
            self._local.comp = comp
        return comp

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        dec: zstandard.ZstdDecompressor | None = getattr(self._local, "dec", None)
        if dec is None:
            dec = zstandard.ZstdDecompressor()
            self._local.dec = dec
        return dec


def stored_forms(raw: bytearray, max_chunk: int) -> list[tuple[Codec, int]]:
    """How a file of unknown form may have been stored, as (codec, chunk size): zstd
    (if it looks like it), then raw; none bigger than ``max_chunk``."""
    out = []
    if raw.startswith(ZSTD_MAGIC):
        try:
            size = zstandard.frame_content_size(bytes(raw[:18]))
        except zstandard.ZstdError:
            size = -1
        if 0 <= size <= max_chunk:  # a damaged header must not make us allocate more
            out.append((Codec.ZSTD, size))
    if len(raw) <= max_chunk:
        out.append((Codec.RAW, len(raw)))
    return out
