"""Reading a part's bytes: planned copies from the daemon's chunks into their targets."""

from __future__ import annotations

import os
import socket
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from chunkd import memfd
from chunkd.client.checkpoint.process import COPY_THREADS
from chunkd.client.core import Client
from chunkd.errors import CheckpointError, ChunkdError, IntegrityError

#: chunks asked for in one request: 256 MiB, which a cold backend must deliver
#: within the client's timeout
_CHUNKS_PER_REQUEST: Final = 64


class PartReader:
    """The bytes of one part's segments, copied out of the daemon's chunks.

    Copies are planned first (:meth:`plan`: this node's bytes go to that buffer),
    then :meth:`run` asks the daemon for the chunks, 64 at a time (256 MiB),
    and reads each piece straight from the chunk's sealed memfd into its target
    with ``preadv``, on a few threads: no mapping of the chunk is set up (that
    costs more than the copy), and at most one batch of fds is open at once.
    """

    def __init__(self, client: Client, name: str, part: dict[str, Any]) -> None:
        self.client = client
        self.name = name
        self.backend = name.split("/", 1)[0]
        self.segments: list[list[tuple[str, int]]] = [
            [(str(c), int(n)) for c, n in seg["chunks"]] for seg in part["segments"]
        ]
        self._owners: dict[str, list[str]] = {}
        # chunk id -> (start, stop, target) pieces to read from it
        self._planned: dict[str, list[tuple[int, int, memoryview]]] = {}
        self._after: list[Callable[[], None]] = []

    def note_owner(self, node: dict[str, Any], path: str) -> None:
        for cid, _, _ in self._pieces(node["seg"], node["off"], node["len"]):
            self._owners.setdefault(cid, []).append(path)

    def plan(self, node: dict[str, Any], target: memoryview) -> None:
        """Have :meth:`run` fill ``target`` with the bytes of ``node``."""
        if target.nbytes != node["len"]:
            raise CheckpointError(
                f"checkpoint {self.name}: a value of {node['len']} bytes has a "
                f"{target.nbytes}-byte target"
            )
        at = 0
        for cid, lo, hi in self._pieces(node["seg"], node["off"], node["len"]):
            self._planned.setdefault(cid, []).append((lo, hi, target[at : at + hi - lo]))
            at += hi - lo
        if at != node["len"]:
            raise CheckpointError(f"checkpoint {self.name}: a value's bytes are incomplete")

    def after(self, step: Callable[[], None]) -> None:
        """Run ``step`` once every planned copy is done (e.g. a copy to a GPU)."""
        self._after.append(step)

    def run(self) -> None:
        """Do every planned copy, then every step given to :meth:`after`."""
        planned, self._planned = self._planned, {}
        wanted = list(planned)
        if wanted:  # each host starts at its own place: N nodes restoring one
            # checkpoint spread their requests over the chunks' owners (docs/peers.md)
            turn = zlib.crc32(socket.gethostname().encode()) % len(wanted)
            wanted = wanted[turn:] + wanted[:turn]
        with ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="chunkd-load") as pool:
            for start in range(0, len(wanted), _CHUNKS_PER_REQUEST):
                batch = wanted[start : start + _CHUNKS_PER_REQUEST]
                fds = self._chunks(batch)
                try:
                    jobs = [(fd, planned[cid]) for cid, fd in zip(batch, fds, strict=True)]
                    for _ in pool.map(_read_pieces, jobs):
                        pass
                finally:
                    memfd.close_all(fds)
        steps, self._after = self._after, []
        for step in steps:
            step()

    def _chunks(self, batch: list[str]) -> list[int]:
        try:
            answer = self.client.request(
                "ckpt_chunks", {"backend": self.backend, "ids": batch}, what=f"loading {self.name}"
            )
        except ChunkdError as exc:
            raise self._named(exc) from exc
        fds = answer.fds
        if len(fds) != len(batch) or len(answer.header.get("sizes", [])) != len(batch):
            answer.close()
            raise CheckpointError(
                f"the daemon sent {len(fds)} chunks of {len(batch)} for {self.name}"
            )
        return fds

    def _named(self, exc: ChunkdError) -> ChunkdError:
        cid = getattr(exc, "chunk_id", None)
        paths = self._owners.get(cid or "", [])
        if not paths:
            return exc
        shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
        cls = type(exc) if isinstance(exc, IntegrityError | CheckpointError) else CheckpointError
        return cls(f"checkpoint {self.name}: cannot load {shown}: {exc}")

    def _pieces(self, seg: int, off: int, length: int) -> Iterator[tuple[str, int, int]]:
        """(chunk id, start in chunk, stop in chunk) covering ``length`` bytes at ``off``."""
        pos = 0
        for cid, size in self.segments[seg]:
            lo, hi = max(off, pos), min(off + length, pos + size)
            if lo < hi:
                yield cid, lo - pos, hi - pos
            pos += size
            if pos >= off + length:
                return


def _read_pieces(job: tuple[int, list[tuple[int, int, memoryview]]]) -> None:
    fd, pieces = job
    for lo, _, target in pieces:
        at = 0
        while at < target.nbytes:
            got = os.preadv(fd, [target[at:]], lo + at)
            if got <= 0:
                raise CheckpointError("a chunk from the daemon is shorter than its size")
            at += got
