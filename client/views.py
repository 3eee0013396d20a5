"""Zero-copy, read-only views of the sealed chunk memfds the daemon sends.

The daemon answers a read with one sealed memfd per chunk (SCM_RIGHTS). A
:class:`Chunk` holds one such fd and maps it read-only when a view needs it; a
:class:`ChunkLRU` is the client's bounded cache of them. A range inside one chunk is
a view into that chunk's mapping. A range over several chunks is still **one
contiguous view**: the address space is reserved once (an anonymous ``PROT_NONE``
mapping) and each chunk's memfd is mapped at its place inside it with ``MAP_FIXED``
(chunks are page-size multiples, all but an object's last). The region is unmapped
when the last view of it is garbage collected. A region of 2 MiB or more starts at a
2 MiB aligned address and is advised ``MADV_HUGEPAGE`` (a chunk mapped alone is
placed so by the kernel wherever huge pages are on): where the daemon's RAM tier
holds a chunk in huge pages (see :mod:`chunkd.cache.ram`), the kernel maps each
2 MiB with one fault instead of 512 (it maps a huge page only where the address is
aligned as the file offset is); where it holds 4 KiB pages, or huge pages are off,
the alignment and the advice change nothing. Where ``MAP_FIXED`` fails, for
whatever reason, the range is copied into a fresh buffer instead: the same bytes,
slower, and still read-only. :class:`Located` is a range as the pieces that hold it,
and makes that view, or copies it into a caller's buffer (:func:`byte_target`: any
writable buffer, or a CPU tensor's own memory, pinned or not).

Only the standard library; numpy is imported by :func:`as_numpy` when it is called.
Everything here but :func:`as_numpy` is internal to :mod:`chunkd.client`.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import mmap
import os
import sys
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, NamedTuple, cast

from chunkd.client import protocol
from chunkd.memfd import Libc, sealed_size
from chunkd.memfd import libc as bound_libc

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer
    from numpy import ndarray
    from numpy.typing import DTypeLike
    from torch import Tensor

__all__ = [
    "Chunk",
    "ChunkLRU",
    "Located",
    "Span",
    "as_numpy",
    "byte_target",
    "check_chunk_fd",
    "chunk_budget",
    "tensor_bytes",
]

log = logging.getLogger("chunkd.client")

_PAGE: Final = mmap.PAGESIZE
#: a PMD-mapped transparent huge page (as :data:`chunkd.cache.ram.HUGE_PAGE`)
_HUGE_PAGE: Final = 2 << 20
_MADV_HUGEPAGE: Final = 14
#: a copy into a caller's buffer of at least this many bytes runs on several threads
_PARALLEL_COPY_BYTES: Final = 32 << 20
#: at most this many threads copy one range (a host's copy rate grows with a few
#: threads, not with many, and a trainer's own threads need the cores too)
_COPY_THREADS: Final = 4


def _copy_threads() -> int:
    """Threads for one large copy: up to 4, and at most half the CPUs this process may
    use (measured on 2 CPUs: one thread copied 7.4 GB/s out of the memfds, four 5.2)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(_COPY_THREADS, cpus // 2))


# -- chunk mappings ----------------------------------------------------------------------


def _page_round(size: int) -> int:
    return max(_PAGE, -(-size // _PAGE) * _PAGE)


class Chunk:
    """One chunk's sealed memfd, and its read-only mapping once a view needs it.

    The fd is closed when the last reference to the chunk goes; a mapping lives on
    in the views made from it.
    """

    __slots__ = ("__weakref__", "_closer", "_mapping", "_whole", "fd", "id", "size")

    def __init__(self, chunk_id: str, size: int, fd: int) -> None:
        self.id = chunk_id
        self.size = size
        self.fd = fd
        self._mapping: mmap.mmap | None = None
        self._whole: memoryview | None = None
        self._closer = weakref.finalize(self, os.close, fd)
        self._closer.atexit = False

    def view(self, start: int, stop: int) -> memoryview:
        whole = self._whole
        if whole is None:
            if self._mapping is None:
                # The kernel places a memfd's mapping 2 MiB aligned by itself wherever
                # the node lets shared memory use huge pages.
                self._mapping = mmap.mmap(self.fd, self.size, prot=mmap.PROT_READ)
                if self.size >= _HUGE_PAGE:
                    with contextlib.suppress(OSError):  # a kernel without THP
                        self._mapping.madvise(_MADV_HUGEPAGE)
            whole = self._whole = memoryview(self._mapping).toreadonly()
        return whole[start:stop]

    def copy_to(self, start: int, target: memoryview) -> None:
        """Copy ``target.nbytes`` bytes from ``start`` into ``target``.

        From the mapping if the chunk has one; else ``preadv`` from the fd, which sets
        up no mapping (mapping a chunk and faulting its pages in costs more than
        reading it once).
        """
        whole = self._whole
        if whole is not None:
            target[:] = whole[start : start + target.nbytes]
            return
        at = 0
        while at < target.nbytes:
            got = os.preadv(self.fd, [target[at:]], start + at)
            if got <= 0:  # the fd is sealed against shrinking: never, short of a bug
                raise protocol.ProtocolError(f"chunk {self.id} is shorter than {self.size} bytes")
            at += got


class ChunkLRU:
    """Chunk mappings by chunk id, least recently used first out."""

    def __init__(self, max_bytes: int, max_chunks: int) -> None:
        self.max_bytes = max_bytes
        self.max_chunks = max_chunks
        self.nbytes = 0
        self._entries: OrderedDict[str, Chunk] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, chunk_id: object) -> bool:
        return chunk_id in self._entries

    def get(self, chunk_id: str) -> Chunk | None:
        chunk = self._entries.get(chunk_id)
        if chunk is not None:
            self._entries.move_to_end(chunk_id)
        return chunk

    def put(self, chunk: Chunk) -> None:
        charge = _page_round(chunk.size)
        if charge > self.max_bytes or self.max_chunks <= 0:
            return
        old = self._entries.pop(chunk.id, None)
        if old is not None:
            self.nbytes -= _page_round(old.size)
        self._entries[chunk.id] = chunk
        self.nbytes += charge
        while self.nbytes > self.max_bytes or len(self._entries) > self.max_chunks:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= _page_round(evicted.size)

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0


def chunk_budget() -> int:
    """Cached chunks hold an fd each: stay well inside the process's fd limit."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 256
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    return max(16, soft // 4)


# -- contiguous views over several chunks -----------------------------------------------


_PROT_NONE: Final = 0
_MAP_FIXED: Final = 0x10  # Linux, every architecture chunkd runs on


def _libc() -> Libc:
    if not sys.platform.startswith("linux"):
        raise OSError("contiguous chunk views need Linux")
    return bound_libc()


class Span(NamedTuple):
    """Bytes ``start`` to ``stop`` of one chunk."""

    chunk: Chunk
    start: int
    stop: int


def _contiguous(spans: list[Span]) -> bool:
    """Whether the chunks of ``spans`` can sit back to back at page-aligned places."""
    return all(
        a.stop == a.chunk.size and b.start == 0 and a.chunk.size % _PAGE == 0
        for a, b in itertools.pairwise(spans)
    )


def _map_fixed(libc: Libc, address: int, chunk: Chunk) -> None:
    """Map ``chunk`` read-only at ``address``, replacing what is mapped there."""
    flags = mmap.MAP_SHARED | _MAP_FIXED
    got = libc.mmap(address, chunk.size, mmap.PROT_READ, flags, chunk.fd, 0)
    if got != address:
        err = ctypes.get_errno()
        if got is not None and got != libc.failed:
            libc.munmap(got, chunk.size)
        raise OSError(err, f"MAP_FIXED of chunk {chunk.id} failed: {os.strerror(err)}")


def _layout(spans: list[Span], length: int) -> memoryview:
    """One read-only view of ``length`` bytes over the chunks of ``spans``, no copy.

    Reserves the address space of all the chunks, maps each chunk's memfd at its
    place with ``MAP_FIXED``, and unmaps the whole region when the ctypes array that
    exposes it is garbage collected (that is, once no view of it is left).

    Raises:
        OSError: a mapping failed; nothing is left mapped.
    """
    libc = _libc()
    total = sum(span.chunk.size for span in spans)
    used = _page_round(total)
    # A region of a huge page or more gets the slack to start on a 2 MiB boundary; the
    # slack stays PROT_NONE address space, never memory.
    huge = total >= _HUGE_PAGE
    reserved = used + (_HUGE_PAGE - _PAGE if huge else 0)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    base = libc.mmap(None, reserved, _PROT_NONE, flags, -1, 0)
    if base is None or base == libc.failed:
        err = ctypes.get_errno()
        raise OSError(err, f"reserving {reserved} bytes failed: {os.strerror(err)}")
    try:
        start = -(-base // _HUGE_PAGE) * _HUGE_PAGE if huge else base
        at = 0
        for span in spans:
            _map_fixed(libc, start + at, span.chunk)
            at += span.chunk.size
        if huge:
            # Ignored where huge pages are off; EINVAL (a kernel without THP) as well.
            libc.madvise(start, used, _MADV_HUGEPAGE)
        region = (ctypes.c_char * used).from_address(start)
        unmap = weakref.finalize(region, libc.munmap, base, reserved)
        # At interpreter exit a view may still be read by another finalizer: leave the
        # region to the kernel rather than unmap it under that reader.
        unmap.atexit = False
    except BaseException:
        libc.munmap(base, reserved)
        raise
    first = spans[0].start
    return memoryview(region).cast("B")[first : first + length].toreadonly()


@dataclass(slots=True)
class Located:
    """A byte range of one object version, as pieces held by the client."""

    name: str
    version: str
    size: int
    length: int
    pieces: list[Span | memoryview]

    def view(self) -> memoryview:
        """The range as one read-only view: zero-copy when the pieces allow it."""
        pieces = self.pieces
        if not pieces or self.length == 0:
            return memoryview(b"")
        if len(pieces) == 1:
            piece = pieces[0]
            if isinstance(piece, memoryview):
                return piece.toreadonly()
            return piece.chunk.view(piece.start, piece.stop).toreadonly()
        spans = [piece for piece in pieces if isinstance(piece, Span)]
        if len(spans) == len(pieces) and _contiguous(spans):
            try:
                return _layout(spans, self.length)
            except OSError as exc:
                log.debug("contiguous view of %s failed (%s); copying instead", self.name, exc)
        buffer = bytearray(self.length)
        self.copy_into(memoryview(buffer))
        return memoryview(buffer).toreadonly()

    def copy_into(self, target: memoryview) -> int:
        """Copy the range into ``target`` (a writable byte view); return bytes copied.

        Each byte is copied once, straight from the chunk into ``target``; a range of
        at least 32 MiB is copied by up to four threads (half the CPUs at most), piece
        by piece.
        """
        jobs: list[tuple[Span | memoryview, memoryview]] = []
        at = 0
        for piece in self.pieces:
            n = min(_piece_len(piece), len(target) - at)
            if n <= 0:
                break
            jobs.append((piece, target[at : at + n]))
            at += n
        threads = min(_copy_threads(), len(jobs)) if at >= _PARALLEL_COPY_BYTES else 1
        if threads > 1:
            with ThreadPoolExecutor(threads, thread_name_prefix="chunkd-copy") as pool:
                for _ in pool.map(_copy_piece, jobs):
                    pass
        else:
            for job in jobs:
                _copy_piece(job)
        return at

    def to_bytes(self) -> bytes:
        """The range as ``bytes`` (one copy)."""
        return b"".join(_source(piece) for piece in self.pieces)


def _source(piece: Span | memoryview) -> memoryview:
    if isinstance(piece, memoryview):
        return piece
    return piece.chunk.view(piece.start, piece.stop)


def _piece_len(piece: Span | memoryview) -> int:
    return piece.nbytes if isinstance(piece, memoryview) else piece.stop - piece.start


def _copy_piece(job: tuple[Span | memoryview, memoryview]) -> None:
    piece, target = job
    if isinstance(piece, memoryview):
        target[:] = piece[: target.nbytes]
    else:
        piece.chunk.copy_to(piece.start, target)


# -- what goes in and out ---------------------------------------------------------------


def check_chunk_fd(chunk_id: str, size: int, fd: int) -> None:
    """Refuse an fd that is not a sealed memfd of at least ``size`` bytes.

    A memfd that could shrink under a mapping would crash the reader with SIGBUS; one
    that could change would not hold the chunk its id names.
    """
    if size <= 0:
        raise protocol.ProtocolError(f"the daemon sent chunk {chunk_id} of size {size}")
    held = sealed_size(fd)
    if held is None or held < size:
        raise protocol.ProtocolError(
            f"the daemon sent chunk {chunk_id} in an fd that is not a sealed memfd of {size} bytes"
        )


def byte_target(buf: WriteableBuffer | Tensor) -> memoryview:
    """``buf`` as a flat, writable byte view (what a read copies into).

    A torch tensor is taken as its own memory (:func:`tensor_bytes`): a read lands in
    it with no copy in between.

    Raises:
        TypeError: ``buf`` is read-only, or a tensor :func:`tensor_bytes` refuses.
    """
    torch = sys.modules.get("torch")  # a tensor exists only where torch was imported
    if torch is not None and isinstance(buf, torch.Tensor):
        return tensor_bytes(buf)
    target = memoryview(cast("WriteableBuffer", buf))
    if target.readonly:
        raise TypeError("read_into needs a writable buffer; got a read-only one")
    if target.format != "B" or target.ndim != 1:
        target = target.cast("B")
    return target


def tensor_bytes(tensor: Tensor) -> memoryview:
    """A writable byte view of a CPU tensor's own memory (pinned or not), no copy.

    Made from the tensor's address, so it needs neither numpy nor the buffer protocol
    (which torch tensors lack); the view keeps the tensor alive. A pinned tensor is a
    CPU tensor whose pages are locked for the GPU's copy engines: bytes read into it
    can go on to a device with ``.to("cuda", non_blocking=True)``.

    Raises:
        TypeError: the tensor is not on the CPU, not contiguous (the bytes would land
            out of its element order), not strided, or a lazily conjugated or negated
            view.
    """
    if tensor.device.type != "cpu":
        raise TypeError(
            f"read_into copies into host memory, not into a tensor on {tensor.device}: "
            "read into a pinned CPU tensor (torch.empty(..., pin_memory=True)), then "
            "copy it with .to(device, non_blocking=True)"
        )
    if str(tensor.layout) != "torch.strided" or not tensor.is_contiguous():
        raise TypeError(
            "read_into needs a contiguous, strided tensor: its bytes are filled in "
            "order; pass tensor.contiguous() and copy it back"
        )
    if tensor.is_conj() or tensor.is_neg():
        raise TypeError(
            "read_into cannot fill a lazily conjugated or negated view; pass "
            "tensor.resolve_conj().resolve_neg()"
        )
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    region = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    region._chunkd_owner = tensor  # type: ignore[attr-defined]  # the memory's owner
    return memoryview(region).cast("B")


def as_numpy(view: memoryview, dtype: DTypeLike = "uint8") -> ndarray[Any, Any]:
    """A numpy array over a view from :meth:`~chunkd.client.Client.read`, without a copy.

    The array is read-only, like the view, and keeps the view's mapping alive.
    numpy is imported here, on first use.

    Raises:
        ValueError: the view's length is not a multiple of the dtype's size.
    """
    import numpy

    return numpy.frombuffer(view, dtype=dtype)
