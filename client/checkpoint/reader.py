"""Reading a part's bytes: planned copies from the daemon's chunks into their targets,
host memory directly and device memory through the staging ring (:mod:`.device`)."""

from __future__ import annotations

import socket
import zlib
from collections import deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import closing
from functools import partial
from typing import Any, Final

from chunkd import memfd
from chunkd.client.checkpoint.device import (
    CudaLink,
    DeviceLink,
    DeviceRead,
    StagingRing,
    pack,
    read_exact,
)
from chunkd.client.checkpoint.process import COPY_THREADS
from chunkd.client.core import Client
from chunkd.client.protocol import MAX_REPLICAS
from chunkd.errors import CheckpointError, ChunkdError, IntegrityError

#: chunks asked for in one request: 256 MiB, which a cold backend must deliver
#: within the client's timeout
_CHUNKS_PER_REQUEST: Final = 64

#: requests (batches) in flight at once: the batch being copied and the next one,
#: asked for on a second connection, so that the daemon fetches the next batch while
#: the slowest chunks of this one come and while this one is copied. The daemon
#: answers one request at a time per connection (its bound on unread fds), hence one
#: connection per batch in flight. At most 2 x 64 chunks' fds are open at once.
_BATCHES_IN_FLIGHT: Final = 2


class PartReader:
    """The bytes of one part's segments, copied out of the daemon's chunks.

    Copies are planned first (:meth:`plan`: this node's bytes go to that buffer),
    then :meth:`run` asks the daemon for the chunks, 64 at a time (256 MiB),
    and reads each piece straight from the chunk's sealed memfd into its target
    with ``preadv``, on a few threads: no mapping of the chunk is set up (that
    costs more than the copy). The next batch is asked for (on a second connection
    to the daemon, opened for the run) before this one is copied, so the link stays
    busy between batches: at most two batches, 128 chunks' fds (512 MiB of 4 MiB
    chunks, the daemon's pages), are open at once, whatever the part's size.
    Every chunk order starts at this node's own offset (its hostname and its
    daemon's socket), so nodes restoring one checkpoint ask different owners first.

    Device targets (:meth:`plan_device`) are read the same way into the host
    buffers of a :class:`~.device.StagingRing`, whose copies to the device run on a
    side stream while the threads read on; :meth:`run` returns once those copies
    have finished. ``link`` is the way to the device: a :class:`~.device.CudaLink`
    unless given (tests give a :class:`~.device.ThreadLink`, the CPU stand-in).
    """

    def __init__(
        self, client: Client, name: str, part: dict[str, Any], link: DeviceLink | None = None
    ) -> None:
        self.client = client
        self.name = name
        self.backend = name.split("/", 1)[0]
        self.segments: list[list[tuple[str, int]]] = [
            [(str(c), int(n)) for c, n in seg["chunks"]] for seg in part["segments"]
        ]
        self._owners: dict[str, list[str]] = {}
        # The part's saver and replicas: the daemon asks its replicas first
        # (docs/replicas.md); a part without them (older, no peers) asks nothing more.
        self._origin: dict[str, Any] = {}
        node, wanted, save = part.get("node"), part.get("replicas"), part.get("save_id")
        if (  # what ckpt_chunks takes; anything else asks no replicas
            isinstance(node, str)
            and 0 < len(node) <= 300
            and isinstance(save, str)
            and 0 < len(save) <= 64
            and type(wanted) is int
            and 0 < wanted <= MAX_REPLICAS
        ):
            self._origin = {"save": save, "node": node, "replicas": wanted}
        # chunk id -> (start, stop, target) pieces to read from it
        self._planned: dict[str, list[tuple[int, int, memoryview]]] = {}
        # chunk id -> (start, stop, flat uint8 device tensor, offset in it) pieces
        self._device: dict[str, list[tuple[int, int, Any, int]]] = {}
        self._after: list[Callable[[], None]] = []
        self.link = link

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

    def plan_device(self, node: dict[str, Any], flat: Any) -> None:
        """Have :meth:`run` fill ``flat`` (a flat ``uint8`` tensor, on a device) with
        the bytes of ``node``, through the staging ring."""
        if flat.numel() != node["len"]:
            raise CheckpointError(
                f"checkpoint {self.name}: a value of {node['len']} bytes has a "
                f"{flat.numel()}-byte target on {flat.device}"
            )
        at = 0
        for cid, lo, hi in self._pieces(node["seg"], node["off"], node["len"]):
            self._device.setdefault(cid, []).append((lo, hi, flat, at))
            at += hi - lo
        if at != node["len"]:
            raise CheckpointError(f"checkpoint {self.name}: a value's bytes are incomplete")

    def after(self, step: Callable[[], None]) -> None:
        """Run ``step`` once every planned copy is done (e.g. a copy to a GPU)."""
        self._after.append(step)

    def run(self) -> None:
        """Do every planned copy, then every step given to :meth:`after`."""
        planned, self._planned = self._planned, {}
        to_device, self._device = self._device, {}
        wanted = _rotated(
            list(dict.fromkeys([*planned, *to_device])), _node_seed(self.client.socket_path)
        )
        batches = [
            wanted[start : start + _CHUNKS_PER_REQUEST]
            for start in range(0, len(wanted), _CHUNKS_PER_REQUEST)
        ]
        ring = StagingRing(self.link or CudaLink()) if to_device else None
        try:
            if ring is not None:
                ring.link.begin({d.device for pieces in to_device.values() for *_, d, _ in pieces})
            with (
                ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="chunkd-load") as pool,
                closing(self._batches(batches)) as each,
            ):
                for batch, fds in each:
                    jobs: list[Callable[[], None]] = [
                        partial(_read_pieces, fd, planned[cid])
                        for cid, fd in zip(batch, fds, strict=True)
                        if cid in planned
                    ]
                    if ring is not None:
                        reads = [
                            DeviceRead(fd, lo, hi, dest, at)
                            for cid, fd in zip(batch, fds, strict=True)
                            for lo, hi, dest, at in to_device.get(cid, ())
                        ]
                        jobs += [partial(ring.stage, job) for job in pack(reads, ring.nbytes)]
                    running = [pool.submit(job) for job in jobs]
                    wait(running)  # every job, even after one failed: they read these fds
                    for job in running:
                        job.result()
        finally:
            if ring is not None:  # every copy finished, also after a failure: no buffer
                ring.link.finish()  # goes back to the allocator under a copy in flight
        steps, self._after = self._after, []
        for step in steps:
            step()

    def _batches(
        self, batches: list[list[str]]
    ) -> Generator[tuple[list[str], list[int]], None, None]:
        """Each batch with its chunks' fds, in order, the next one asked for before
        this one is yielded; each batch's fds are closed once the caller is done
        with it (or gives up), and every batch asked for is waited for and closed
        however the run ends: nothing is left open."""
        if not batches:
            return
        # The look-ahead's own connection: the client's carries one request at a time.
        spare = (
            Client(
                self.client.socket_path,
                timeout=self.client.timeout,
                cache_bytes=0,
                train_job=self.client.train_job,
            )
            if len(batches) > 1
            else None
        )
        clients = [self.client] if spare is None else [self.client, spare]
        asked: deque[tuple[list[str], Future[list[int]]]] = deque()
        try:
            with ThreadPoolExecutor(len(clients), thread_name_prefix="chunkd-ask") as asking:
                for turn, batch in enumerate(batches[:_BATCHES_IN_FLIGHT]):
                    asked.append((batch, asking.submit(self._chunks, batch, clients[turn])))
                try:
                    for turn in range(len(batches)):
                        batch, answer = asked.popleft()
                        fds = answer.result()
                        try:
                            yield batch, fds
                        finally:
                            memfd.close_all(fds)
                        after = turn + _BATCHES_IN_FLIGHT
                        if after < len(batches):  # on the connection this batch freed
                            chosen = clients[after % len(clients)]
                            ask = asking.submit(self._chunks, batches[after], chosen)
                            asked.append((batches[after], ask))
                finally:
                    for _, answer in asked:  # given up: the batches still coming are closed
                        wait([answer])
                        if answer.exception() is None:
                            memfd.close_all(answer.result())
        finally:
            if spare is not None:
                spare.close()

    def _chunks(self, batch: list[str], client: Client) -> list[int]:
        try:
            answer = client.request(
                "ckpt_chunks",
                {"backend": self.backend, "ids": batch} | self._origin,
                what=f"loading {self.name}",
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


def _node_seed(socket_path: object) -> str:
    """This node's own seed for its chunk order: its hostname, and its daemon's
    socket, which tells apart nodes that share a hostname (network namespaces, or
    several daemons on one test host)."""
    return f"{socket.gethostname()}\0{socket_path}"


def _rotated(wanted: list[str], seed: str) -> list[str]:
    """``wanted`` starting at the seed's own place: N nodes restoring one checkpoint
    spread their first requests over the chunks' owners (docs/peers.md)."""
    if not wanted:
        return wanted
    turn = zlib.crc32(seed.encode()) % len(wanted)
    return wanted[turn:] + wanted[:turn]


def _read_pieces(fd: int, pieces: list[tuple[int, int, memoryview]]) -> None:
    for lo, _, target in pieces:
        read_exact(fd, target, lo)
