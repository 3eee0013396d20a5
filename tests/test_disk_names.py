"""The disk tier's names and records while a write syncs its directory outside the lock.

A write renames its file to the chunk's name, fsyncs the directory without holding
``_names_lock`` (so concurrent inserts' fsyncs overlap), then records the chunk. These
tests hold one write inside that directory fsync (the real fsync runs once released)
and check what the tier's other threads may and may not do meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chunkd.cache import Chunk, ChunkId, DiskTier, Index, disk
from chunkd.testing.soundness import assert_cache_sound

_HOLD_S = 10.0  # the most a held fsync waits: a test that fails must still end


class _Held:
    """Holds the directory fsync of one path until released; the others run at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls: list[Path] = []
        self._real: Callable[[Path], None] = disk._fsync_dir

    def __call__(self, path: Path) -> None:
        self.calls.append(path)
        if path == self.path:
            self.entered.set()
            self.release.wait(_HOLD_S)
        self._real(path)


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[DiskTier]:
    index = Index(tmp_path / "index")
    # A held fsync must not count as a stalled disk (which would decline the writes).
    yield DiskTier(
        tmp_path, index, budget_bytes=1 << 30, fsync="always", compress=False, stall_after=30
    )
    index.close()


def _chunk(**avoid: str) -> Chunk:
    """A random chunk whose leaf directory is not ``avoid``'s."""
    while True:
        chunk = Chunk.of(os.urandom(64 << 10))
        if chunk.id.hex()[:4] not in avoid.values():
            return chunk


async def _hold_first(
    tier: DiskTier, monkeypatch: pytest.MonkeyPatch, chunk: Chunk
) -> tuple[_Held, asyncio.Task[bool]]:
    held = _Held(tier.path_of(chunk.id).parent)
    monkeypatch.setattr(disk, "_fsync_dir", held)
    task = asyncio.ensure_future(tier.put(chunk))
    assert await asyncio.to_thread(held.entered.wait, 5), "the write never synced its directory"
    return held, task


async def _closed_and_sound(tier: DiskTier, root: Path) -> tuple[int, int]:
    await tier.close()
    tier.index.close()
    return assert_cache_sound(root, 64 << 20)


@pytest.mark.timeout(30)
async def test_another_insert_completes_while_one_syncs_its_directory(
    tier: DiskTier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = Chunk.of(os.urandom(64 << 10))
    held, task = await _hold_first(tier, monkeypatch, first)
    try:
        second = _chunk(first=first.id.hex()[:4])
        # With the lock held across the fsync this waits for the first write.
        assert await asyncio.wait_for(tier.put(second), 3) is True
        assert tier.index.lookup(second.id) is not None
        assert tier.index.lookup(first.id) is None  # no record before its name is durable
    finally:
        held.release.set()
    assert await task is True
    assert tier.index.lookup(first.id) is not None
    assert await _closed_and_sound(tier, tmp_path) == (2, 2)


@pytest.mark.timeout(30)
async def test_reconciliation_leaves_a_chunk_being_named_to_its_write(
    tier: DiskTier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunk = Chunk.of(os.urandom(64 << 10))
    held, task = await _hold_first(tier, monkeypatch, chunk)
    try:
        done = await asyncio.to_thread(tier.reconcile)
        # Adopting it would let its record commit before its name is durable.
        assert done["orphans_adopted"] == 0
        assert done["orphans_removed"] == 0
        assert tier.index.lookup(chunk.id) is None
        assert tier.path_of(chunk.id).exists()
    finally:
        held.release.set()
    assert await task is True
    assert tier.index.lookup(chunk.id) is not None
    assert await _closed_and_sound(tier, tmp_path) == (1, 1)


@pytest.mark.timeout(30)
async def test_a_chunk_discarded_while_being_named_is_never_recorded(
    tier: DiskTier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunk = Chunk.of(os.urandom(64 << 10))
    held, task = await _hold_first(tier, monkeypatch, chunk)
    rejected = tier.stats().rejected
    try:
        await asyncio.wait_for(tier.discard(chunk.id), 3)
        assert not tier.path_of(chunk.id).exists()
    finally:
        held.release.set()
    assert await task is False
    assert tier.stats().rejected == rejected + 1
    assert tier.index.lookup(chunk.id) is None
    assert await _closed_and_sound(tier, tmp_path) == (0, 0)


def _same_leaf(first: ChunkId, salt: bytes) -> Chunk:
    """A chunk whose id shares ``first``'s leaf directory (about 65,536 tries)."""
    leaf = first.hex()[:4]
    for n in range(1 << 22):
        chunk = Chunk.of(salt + n.to_bytes(8, "little"))
        if chunk.id.hex()[:4] == leaf:
            return chunk
    raise AssertionError("no id in the same leaf directory")  # pragma: no cover


@pytest.mark.timeout(30)
async def test_a_sync_write_into_a_directory_made_without_sync_syncs_its_parents(
    tier: DiskTier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = Chunk.of(b"made its directory without fsync")
    assert await tier.put(first, sync=False) is True
    second = _same_leaf(first.id, b"second")
    leaf = tier.path_of(second.id).parent
    assert leaf == tier.path_of(first.id).parent
    spy = _Held(tmp_path / "never")
    monkeypatch.setattr(disk, "_fsync_dir", spy)
    assert await tier.put(second) is True
    # The leaf's own name (in its parent) and the parent's (in chunks/) were never
    # synced: the record must not claim a file a power loss could unname.
    assert spy.calls == [leaf.parent, tmp_path / "chunks", leaf]
    spy.calls.clear()
    assert await tier.put(_same_leaf(first.id, b"third")) is True
    assert spy.calls == [leaf]  # once synced, the parents are not synced again
    assert await _closed_and_sound(tier, tmp_path) == (3, 3)


@pytest.mark.timeout(30)
async def test_reconciliation_makes_an_orphan_durable_before_adopting_it(
    tier: DiskTier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunk = Chunk.of(os.urandom(64 << 10))
    assert await tier.put(chunk) is True
    tier.index.delete_chunks([chunk.id])  # as a process killed before its record commits
    leaf = tier.path_of(chunk.id).parent
    spy = _Held(tmp_path / "never")
    monkeypatch.setattr(disk, "_fsync_dir", spy)
    done = await asyncio.to_thread(tier.reconcile)
    assert done["orphans_adopted"] == 1
    # Its name (and its directories' names) durable before its record can commit.
    assert spy.calls == [leaf, leaf.parent, tmp_path / "chunks"]
    assert await _closed_and_sound(tier, tmp_path) == (1, 1)


@pytest.mark.timeout(30)
def test_a_write_never_renames_over_a_chunk_recorded_since_it_looked(tmp_path: Path) -> None:
    # Write A (fsync, zstd) looks the id up, then another write of it (B: raw, no fsync,
    # as a checkpoint's) records it before A renames. A must not replace B's recorded
    # file: the record would then describe a file of another size and form, a reader or
    # eviction would drop the chunk, and a pinned chunk would be lost.
    index = Index(tmp_path / "index")
    tier = DiskTier(
        tmp_path, index, budget_bytes=1 << 30, fsync="always", compress=True, stall_after=30
    )
    try:
        chunk = Chunk.of(b"a" * (256 << 10))  # compressible: A would store zstd, B raw
        looked, go = threading.Event(), threading.Event()
        real_room = tier._make_room

        def make_room(need: int) -> bool:
            if threading.current_thread().name == "A":
                looked.set()  # A has passed its lookup
                go.wait(_HOLD_S)
            return real_room(need)

        tier._make_room = make_room  # type: ignore[method-assign]
        results: dict[str, bool] = {}
        a = threading.Thread(
            name="A", target=lambda: results.__setitem__("A", tier.write_sync(chunk, True, True))
        )
        a.start()
        assert looked.wait(_HOLD_S)
        results["B"] = tier.write_sync(chunk, False, False)
        tier.pin([chunk.id])
        recorded = index.lookup(chunk.id)
        assert recorded is not None
        go.set()
        a.join(_HOLD_S)
        assert results == {"A": True, "B": True}  # A finds it held: nothing to write
        assert index.lookup(chunk.id) == recorded, "the record B wrote stands"
        final = tier.path_of(chunk.id)
        assert final.stat().st_size == recorded.stored_size
        got = tier.read_sync(chunk.id)
        assert got is not None
        assert bytes(got) == bytes(chunk.data)
        assert not list(tier._tmp_dir.iterdir()), "A's temporary file is gone"
    finally:
        index.close()
