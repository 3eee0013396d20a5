"""Warm views over the RAM tier's memfds in huge pages: the RAM tier allocates a chunk
of 2 MiB or more through an aligned mapping advised ``MADV_HUGEPAGE`` where
``shmem_enabled`` allows huge pages, and the client maps chunks 2 MiB aligned and
advised. Neither may change a byte: under ``never`` (this machine's default), and under
``advise``, set for the test and put back after (root only; skipped elsewhere).
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from pathlib import Path

import numpy
import pytest

from chunkd.cache.chunkid import ChunkId
from chunkd.cache.ram import HUGE_PAGE, RamTier, shmem_huge_pages
from chunkd.cache.tier import Chunk
from chunkd.client import views

MiB = 1 << 20
SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
#: chunk sizes: whole huge pages, one huge page, and an object's last chunk (one huge
#: page and a ragged tail)
SIZES = (4 * MiB, 2 * MiB, 3 * MiB + 100)


def _mode() -> str | None:
    try:
        text = SHMEM_ENABLED.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


@contextlib.contextmanager
def shmem_enabled(mode: str) -> Iterator[None]:
    """``shmem_enabled`` set to ``mode`` for the block and put back after, whatever
    happens; the test is skipped where it cannot be set."""
    before = _mode()
    if before is None:
        pytest.skip(f"{SHMEM_ENABLED} is missing: this kernel has no transparent huge pages")
    if before == mode:
        yield
        return
    try:
        SHMEM_ENABLED.write_text(mode)
    except OSError as exc:
        pytest.skip(f"shmem_enabled cannot be set to {mode} here ({exc}; it needs root)")
    try:
        yield
    finally:
        SHMEM_ENABLED.write_text(before)


def _pmd_mapped_kib(start: int, length: int) -> int:
    """``ShmemPmdMapped`` of this process's mappings inside ``[start, start+length)``."""
    total, inside = 0, False
    length = -(-length // 4096) * 4096  # the last chunk's mapping ends on a page
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = start <= low and high <= start + length
        elif inside and head == "ShmemPmdMapped:":
            total += int(line.split()[1])
    return total


async def _chunks(tier: RamTier, seed: int) -> tuple[list[bytes], list[views.Chunk]]:
    """Chunks of :data:`SIZES` random bytes put into ``tier``, as the client holds them
    (a dup of each sealed memfd the tier would send)."""
    rng = random.Random(seed)
    datas = [rng.randbytes(size) for size in SIZES]
    held = []
    for data in datas:
        cid = ChunkId.of(data)
        assert await tier.put(Chunk.trusted(cid, data))
        lease = tier.lease(cid)
        assert lease is not None
        try:
            fd = os.dup(lease.fileno())
        finally:
            lease.release()
        views.check_chunk_fd(str(cid), len(data), fd)  # sealed, as a client requires
        held.append(views.Chunk(str(cid), len(data), fd))
    return datas, held


async def _check_views(seed: int, *, huge: bool) -> list[int]:
    """Read the chunks back every way the client maps them (each byte compared); return
    the KiB of each aligned view mapped as huge pages (``ShmemPmdMapped``). A range over
    several chunks is aligned by the client; a chunk alone by the kernel, where huge
    pages are on (``huge``)."""
    tier = RamTier(64 * MiB)
    try:
        datas, held = await _chunks(tier, seed)
    finally:
        await tier.close()  # the client's dups keep the memfds
    whole = b"".join(datas)
    spans = [views.Span(chunk, 0, chunk.size) for chunk in held]
    located = views.Located("t/x", "v", len(whole), len(whole), list(spans))
    view = located.view()
    assert view.readonly
    assert bytes(view) == whole
    # A range that starts inside the first chunk and ends inside the last.
    inner = views.Located(
        "t/x",
        "v",
        len(whole),
        len(whole) - 12345 - 678,
        [
            views.Span(held[0], 12345, held[0].size),
            spans[1],
            views.Span(held[2], 0, held[2].size - 678),
        ],
    ).view()
    assert bytes(inner) == whole[12345 : len(whole) - 678]
    # One chunk alone: its own mapping.
    single = held[0].view(0, held[0].size)
    assert bytes(single) == datas[0]
    assert bytes(held[2].view(HUGE_PAGE - 7, held[2].size)) == datas[2][HUGE_PAGE - 7 :]
    pmd_mapped = []
    for mapped in (view, single) if huge else (view,):
        start = _start(mapped)
        assert start % HUGE_PAGE == 0, f"a view of {len(mapped)} bytes starts at {start:#x}"
        pmd_mapped.append(_pmd_mapped_kib(start, len(mapped)))
    return pmd_mapped


def _start(view: memoryview) -> int:
    """The address of a view's first byte."""
    return int(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data)


@pytest.mark.timeout(20)
async def test_aligned_advised_views_read_the_chunks_bytes_under_never() -> None:
    with shmem_enabled("never"):
        assert not shmem_huge_pages()
        assert await _check_views(seed=1, huge=False) == [0]


@pytest.mark.timeout(20)
async def test_chunks_in_huge_pages_read_the_same_bytes_under_advise() -> None:
    with shmem_enabled("advise"):
        assert shmem_huge_pages()
        # The huge pages really happened: the tier allocated them and the client's
        # aligned mapping maps them as such (one PMD per 2 MiB, not 512 PTEs).
        assert all(kib > 0 for kib in await _check_views(seed=2, huge=True))
