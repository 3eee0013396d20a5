"""The live chunk ids of one garbage collection, in bounded memory: :class:`MarkSet`.

A collection's mark may name tens of millions of chunk ids (a 100 TB frozen snapshot
is 25M of them); held as a Python ``set`` that is GBs. Here the ids are written to
disk instead, as sorted *runs* of fixed-width records (32 bytes, the binary chunk id,
duplicates dropped), and read back as one ascending stream, a k-way merge of the runs
(:func:`heapq.merge`). The sweep walks the backend's listing of ``chunks/``, which
every backend gives in key order (hex ids in key order are binary ids in order), and
advances the stream alongside it (:class:`LiveIds`): a chunk is live when the stream
holds its id.

What the ids may cost, whatever their number (docs/checkpoints.md, "How much memory a
collection takes"):

* memory: one run being filled, :data:`RUN_IDS` ids (about 73 bytes each as Python
  ``bytes`` in a list: 4.6 MiB), and while merging, at most :data:`MERGE_FAN_IN` runs
  read at once through a buffer of :data:`READ_BUFFER` bytes each (4 MiB);
* disk: 32 bytes per id named (less the duplicates inside a run), twice that while two
  levels of runs are merged, in a directory of the daemon's cache dir
  (``<cache dir>/checkpoints/gc-mark/``) removed when the collection ends.

Runs are merged by level, :data:`MERGE_FAN_IN` at a time, so no merge reads more than
that many files at once however many ids there are.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Final

__all__ = ["ID_BYTES", "MERGE_FAN_IN", "READ_BUFFER", "RUN_IDS", "LiveIds", "MarkSet", "id_bytes"]

#: one chunk id, binary (blake3-256)
ID_BYTES: Final = 32
#: ids sorted in memory at once before they are written as a run
RUN_IDS: Final = 1 << 16
#: runs one merge reads at once
MERGE_FAN_IN: Final = 64
#: the buffer each run is read through while merging (2048 ids)
READ_BUFFER: Final = 64 << 10

_HEX_ID: Final = re.compile(r"[0-9a-f]{64}")


def id_bytes(cid: str) -> bytes | None:
    """Chunk id ``cid`` (64 lowercase hex digits) as 32 bytes; None for any other
    string (no chunk is stored under it: ``chunks/`` holds chunks by their ids)."""
    return bytes.fromhex(cid) if _HEX_ID.fullmatch(cid) else None


class MarkSet:
    """The chunk ids a collection marks live, spilled to disk in sorted runs.

    Add ids with :meth:`extend` (in any order, repeated or not); then :meth:`live`
    gives them back as an ascending stream. Close it (or use it as an async context
    manager) to remove its files.

    Args:
        parent: the directory its own directory is made in (created if missing).
    """

    def __init__(self, parent: Path) -> None:
        self._parent = parent
        self._dir: Path | None = None
        self._pending: list[bytes] = []
        #: run files by level: level 0 holds runs of RUN_IDS ids, level n+1 merges of
        #: MERGE_FAN_IN runs of level n
        self._levels: list[list[Path]] = []
        self._names = itertools.count()
        #: ids named (with repeats), and ids not chunk ids (left out)
        self.named = 0
        self.ignored = 0

    async def __aenter__(self) -> MarkSet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Remove the run files."""
        self._pending = []
        self._levels = []
        if self._dir is not None:
            await asyncio.to_thread(shutil.rmtree, self._dir, True)
            self._dir = None

    async def extend(self, ids: Iterable[str]) -> None:
        """Mark ``ids`` live; ids that are not chunk ids are counted and left out."""
        pending = self._pending
        for cid in ids:
            self.named += 1
            raw = id_bytes(cid)
            if raw is None:
                self.ignored += 1
                continue
            pending.append(raw)
            if len(pending) >= RUN_IDS:
                self._pending = []
                await asyncio.to_thread(self._spill, pending)
                pending = self._pending

    async def absorb(self, live: LiveIds) -> None:
        """Mark live every id ``live`` holds from its current place on (it is used up)."""
        pending, self._pending = self._pending, []
        await asyncio.to_thread(self._absorb, pending, live._rest())

    async def live(self) -> LiveIds:
        """Every id added so far, as :class:`LiveIds` (nothing may be added after; it
        reads this set's files, so it is used before :meth:`close`)."""
        pending, self._pending = self._pending, []
        return await asyncio.to_thread(lambda: LiveIds(_merged(self._runs_to_merge(pending))))

    # -- in a thread --------------------------------------------------------------------

    def _directory(self) -> Path:
        if self._dir is None:
            self._parent.mkdir(parents=True, exist_ok=True)
            self._dir = Path(tempfile.mkdtemp(prefix="mark-", dir=self._parent))
        return self._dir

    def _absorb(self, pending: list[bytes], ids: Iterator[bytes]) -> None:
        for cid in ids:
            self.named += 1
            pending.append(cid)
            if len(pending) >= RUN_IDS:
                self._spill(pending)
        self._pending = pending

    def _spill(self, ids: list[bytes]) -> None:
        """Sort ``ids``, write them as a run of level 0, merge full levels up."""
        ids.sort()
        path = self._directory() / f"{next(self._names)}.run"
        with path.open("wb") as out:
            out.writelines(_unique(ids))
        ids.clear()
        self._add_run(0, path)

    def _add_run(self, level: int, path: Path) -> None:
        while len(self._levels) <= level:
            self._levels.append([])
        runs = self._levels[level]
        runs.append(path)
        if len(runs) >= MERGE_FAN_IN:
            self._levels[level] = []
            self._add_run(level + 1, self._merge_into_run(runs))

    def _merge_into_run(self, runs: list[Path]) -> Path:
        path = self._directory() / f"{next(self._names)}.run"
        merged = _merged(runs)
        with path.open("wb") as out:
            while block := b"".join(itertools.islice(merged, 2048)):
                out.write(block)
        for run in runs:
            run.unlink()
        return path

    def _runs_to_merge(self, pending: list[bytes]) -> list[Path]:
        """The runs left, at most MERGE_FAN_IN of them (the smallest merged first)."""
        if pending:
            self._spill(pending)
        runs = [run for level in self._levels for run in level]
        self._levels = []
        while len(runs) > MERGE_FAN_IN:
            runs.sort(key=lambda p: p.stat().st_size)
            head, runs = runs[:MERGE_FAN_IN], runs[MERGE_FAN_IN:]
            runs.append(self._merge_into_run(head))
        return runs


class LiveIds:
    """An ascending stream of marked ids, asked about ascending ids (a listing of
    ``chunks/`` in key order): :meth:`holding` says which of them it holds."""

    def __init__(self, stream: Iterator[bytes]) -> None:
        self._stream = stream
        self._head = next(stream, None)

    def _rest(self) -> Iterator[bytes]:
        if self._head is not None:
            yield self._head
            yield from self._stream

    def _holding(self, ids: list[bytes]) -> list[bool]:
        held: list[bool] = []
        head, stream = self._head, self._stream
        for cid in ids:
            while head is not None and head < cid:
                head = next(stream, None)
            held.append(head == cid)
        self._head = head
        return held

    async def holding(self, ids: list[bytes]) -> list[bool]:
        """Whether each of ``ids`` is held. ``ids`` ascend, and each call's ids come
        after the last call's (the stream only goes forward)."""
        if not ids:
            return []
        return await asyncio.to_thread(self._holding, ids)


def _unique(ids: Iterable[bytes]) -> Iterator[bytes]:
    """``ids`` (sorted) without repeats."""
    last = None
    for cid in ids:
        if cid != last:
            yield cid
            last = cid


def _read_run(path: Path) -> Iterator[bytes]:
    with path.open("rb", buffering=0) as run:
        while block := run.read(READ_BUFFER):
            view = memoryview(block)
            for at in range(0, len(block), ID_BYTES):
                yield bytes(view[at : at + ID_BYTES])


def _merged(runs: list[Path]) -> Iterator[bytes]:
    return _unique(heapq.merge(*(_read_run(run) for run in runs)))
