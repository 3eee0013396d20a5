"""Staging: where each array goes in the memfd handed to the daemon, the copy into it,
and the sealed JSON documents sent beside it.

Tensors of at least :data:`OWN_SEGMENT_BYTES` get a segment each; smaller values are
packed together, 64-byte aligned, into shared segments of up to ``chunk_bytes``.

The copy is the trainer's whole blocking cost, so the memory it goes to is made
ready before the save (:class:`_Spare`): after each save a thread makes the next
memfd, maps it and faults every page in (``MADV_POPULATE_WRITE``), so the next save
copies into pages that are allocated, zeroed and mapped, with one ``memmove`` per
value and no system call or fault per page; then it unmaps (every writable mapping
must be gone before the seal) and seals. The spare asks for huge pages
(``MADV_HUGEPAGE``), which the node grants where shared memory may use them
(``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` at ``advise`` or
``within_size``). That decides the unmap's cost: 1.24 GiB of 4 KiB pages took
110-150 ms to unmap, more than the copy (70-90 ms), and no faster on two threads;
in 2 MiB pages it took under 1 ms. Measured on the 2-core VM: the trainer was
blocked 208-251 ms with ``never`` (5.4x less than ``torch.save``) and 54-103 ms with
``advise`` (16.9x). Without a spare (the first save, or a state
that grew) the values are written with ``pwrite`` into a new memfd, which is cheaper
than mapping fresh memory and faulting it in. CUDA tensors are copied by their
device straight into the mapping (:mod:`.cudastaging`), registered as pinned memory,
while the host copies the rest.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from chunkd import memfd
from chunkd.client.checkpoint import cudastaging
from chunkd.client.checkpoint.encode import Blob
from chunkd.client.checkpoint.views import blob_bytes, view_address

#: values at least this large get a segment (and so chunks) of their own
OWN_SEGMENT_BYTES: Final = 256 * 1024
_ALIGN: Final = 64
#: how much larger than a save a spare may be and still be taken for it
_SLACK: Final = 64 << 20
#: threads that copy a save's big values into its memfd
_STAGE_THREADS: Final = 2


def plan(blobs: list[Blob], chunk_bytes: int) -> tuple[list[tuple[int, int]], int]:
    """Give each blob a place; returns the segments (offset, size) and the total size."""
    segments: list[tuple[int, int]] = []
    offset = 0
    pack_start: int | None = None

    def close_pack() -> None:
        nonlocal pack_start
        if pack_start is not None:
            segments.append((pack_start, offset - pack_start))
            pack_start = None

    for blob in blobs:
        if blob.nbytes >= OWN_SEGMENT_BYTES:
            close_pack()
            offset = _round_up(offset, mmap.PAGESIZE)
            blob.node |= {"seg": len(segments), "off": 0, "len": blob.nbytes}
            segments.append((offset, blob.nbytes))
            offset += blob.nbytes
            continue
        start = _round_up(offset, _ALIGN)
        if pack_start is not None and start + blob.nbytes - pack_start > chunk_bytes:
            close_pack()
        if pack_start is None:
            offset = start = _round_up(offset, mmap.PAGESIZE)
            pack_start = start
        blob.node |= {"seg": len(segments), "off": start - pack_start, "len": blob.nbytes}
        offset = start + blob.nbytes
    close_pack()
    return segments, offset


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class StagingMemory:
    """A memfd being filled: its fd, its size, and the writable mapping of it, if any.

    Owned by one save at a time; :meth:`close` gives everything back.
    """

    def __init__(
        self, fd: int, size: int, mapping: memfd.WritableMapping | None, *, pinned: bool = False
    ) -> None:
        self.fd = fd
        self.size = size
        self.mapping = mapping
        #: whether the mapping is registered with CUDA as pinned memory
        self.pinned = pinned

    @classmethod
    def new(cls, size: int) -> StagingMemory:
        """A new memfd of ``size`` bytes, not mapped."""
        fd = memfd.create("chunkd-checkpoint", size)
        return cls(fd, size, None)

    def mapped(self, *, populate: bool = False) -> memfd.WritableMapping:
        """The mapping, made now if there is none; ``populate``: in huge pages where the
        node allows them, every page faulted in (see :class:`~chunkd.memfd.WritableMapping`)."""
        if self.mapping is None:
            self.mapping = memfd.WritableMapping(self.fd, self.size, populate=populate)
        return self.mapping

    def write(self, at: int, view: memoryview) -> None:
        """Put ``view``'s bytes at ``at``: a ``memmove`` into the mapping, else ``pwrite``."""
        if self.mapping is None:
            memfd.write_at(self.fd, view, at)
        elif view.nbytes:
            self.mapping.copy_in(at, view_address(view), view.nbytes)

    def unmap(self) -> None:
        """Drop the mapping (unregistering it first if it is pinned)."""
        mapping, self.mapping = self.mapping, None
        if mapping is None:
            return
        if self.pinned:
            self.pinned = False
            cudastaging.unregister(mapping)
        mapping.unmap()

    def seal(self, size: int) -> int:
        """Trim to ``size`` bytes, seal, and hand over the fd (the caller closes it)."""
        self.unmap()
        if self.size != size:
            os.ftruncate(self.fd, size)
            self.size = size
        memfd.seal(self.fd)
        fd, self.fd = self.fd, -1
        return fd

    def close(self) -> None:
        """Give the mapping and the fd back (after a failure, or when replaced)."""
        try:
            self.unmap()
        finally:
            if self.fd >= 0:
                fd, self.fd = self.fd, -1
                os.close(fd)

    def forget(self) -> None:
        """In a forked child: drop what the parent owns without touching it (the
        mapping was not inherited, see :class:`~chunkd.memfd.WritableMapping`)."""
        if self.mapping is not None:
            self.mapping.forget()
            self.mapping = None
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)  # the child's copy of the fd only


def stage(blobs: list[Blob], segments: list[tuple[int, int]], total: int) -> int:
    """Copy every blob into a memfd (the spare, when it is big enough) and seal it.

    Raises:
        CheckpointError: a CUDA tensor could not be copied.
        OSError: no memory for the memfd.
    """
    device = [b for b in blobs if b.nbytes and cudastaging.is_cuda(b.source)]
    host = [b for b in blobs if not (b.nbytes and cudastaging.is_cuda(b.source))]
    memory = SPARE.take(total) or StagingMemory.new(total)

    def place(blob: Blob) -> int:
        return int(segments[blob.node["seg"]][0] + blob.node["off"])

    def put(blob: Blob) -> None:
        memory.write(place(blob), blob_bytes(blob.source))

    try:
        copies = None
        if device:
            copies = cudastaging.DeviceCopies(memory.mapped(), registered=memory.pinned)
        try:
            if copies is not None:
                copies.begin()
                for blob in device:  # queued at once: the devices copy while the host does
                    copies.copy(blob.source, place(blob), blob.path)
            big = [b for b in host if b.nbytes >= OWN_SEGMENT_BYTES]
            for blob in host:
                if blob.nbytes < OWN_SEGMENT_BYTES:
                    put(blob)
            if len(big) > 1 and _STAGE_THREADS > 1:
                with ThreadPoolExecutor(_STAGE_THREADS, thread_name_prefix="chunkd-stage") as pool:
                    [*pool.map(put, big)]
            else:
                for blob in big:
                    put(blob)
        finally:
            if copies is not None:
                copies.finish()  # no copy may still land once the mapping goes
        return memory.seal(total)
    except BaseException:
        memory.close()
        raise


class _Spare:
    """The memory for the next save, made ready while training goes on.

    Most of the cost of staging into a new memfd is the kernel handing out pages
    (and, on a VM, the host backing them on first touch), then a fault or a system
    call per page. After each save a thread makes a memfd of the same size, maps it
    and faults every page in (``MADV_POPULATE_WRITE``: allocated, zeroed, mapped;
    in huge pages where the node allows them), so the next save only copies; after a
    save of CUDA tensors it also registers the mapping with CUDA. It costs one state's
    worth of shared memory between saves; set ``CHUNKD_CKPT_SPARE=0`` to go without.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: StagingMemory | None = None
        self._making = False
        self.enabled = os.environ.get("CHUNKD_CKPT_SPARE", "1") != "0"

    def ready(self) -> tuple[int, bool] | None:
        """(size, registered with CUDA) of the spare ready now, or None."""
        with self._lock:
            ready = self._ready
            return None if ready is None else (ready.size, ready.pinned)

    def take(self, size: int) -> StagingMemory | None:
        """The spare if it holds at least ``size`` bytes and not much more (the caller
        owns it). A spare far larger stays for a save of its size: taking it would
        make the trainer unmap and free the surplus, which costs more than the pages
        it saves (1.24 GiB of small pages took 110-150 ms to unmap)."""
        with self._lock:
            ready = self._ready
            if ready is None or size == 0 or not size <= ready.size <= 2 * size + _SLACK:
                return None
            self._ready = None
            return ready

    def prepare(self, size: int, *, pin: bool = False) -> None:
        """Make a spare of ``size`` bytes in the background (unless one as big is ready
        or being made); ``pin``: register it with CUDA too."""
        if not self.enabled or size == 0:
            return
        with self._lock:
            if self._making or (self._ready is not None and self._ready.size >= size):
                return
            self._making = True
        threading.Thread(
            target=self._make, args=(size, pin), name="chunkd-spare", daemon=True
        ).start()

    def _make(self, size: int, pin: bool) -> None:
        made: StagingMemory | None = None
        try:
            made = StagingMemory.new(size)
            made.mapped(populate=True)
            if pin:
                made.pinned = cudastaging.register(made.mapped())
        except Exception:
            # No room in shared memory now, CUDA refused, or anything else: the next
            # save allocates as it goes, and a later one may make a spare again.
            if made is not None:
                made.close()
            made = None
        finally:
            with self._lock:
                self._making = False
        with self._lock:
            old, self._ready = self._ready, made
        if old is not None:
            old.close()

    def forget_in_child(self) -> None:
        """After fork: the child must not write into the memory its parent will send."""
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self._making = False
        ready, self._ready = self._ready, None
        if ready is not None:
            ready.forget()


#: the process's spare (the fork hook below keeps a child from sharing it)
SPARE: Final = _Spare()
os.register_at_fork(after_in_child=SPARE.forget_in_child)


def sealed_json(doc: Any) -> int:
    """``doc`` as compact JSON in a new sealed memfd (the caller closes it)."""
    return memfd.sealed(json.dumps(doc, separators=(",", ":")).encode(), "chunkd-layout")
