"""Sealed memfds: the one definition of creating, writing, sealing, checking and closing them.

chunkd hands bytes between processes as memfds sealed against every change
(:data:`SEALS`): the RAM tier keeps each chunk in one, the daemon sends them over the
local socket, and trainers send their checkpoint state in them. A receiver accepts
an fd only when it carries :data:`IMMUTABLE` (:func:`sealed_size`): bytes that could
change after they were hashed, or shrink under a mapping (SIGBUS), are refused.

A memfd is filled before it is sealed, with ``pwrite`` (:func:`write_at`) or through
a :class:`WritableMapping`: copies into a mapping whose pages are in place cost no
system call and no fault per page, but every writable mapping must be gone before
the seal (the kernel refuses ``F_SEAL_WRITE`` while one exists).

This module needs nothing but the standard library: ``chunkd.cache``,
``chunkd.client`` and ``chunkd.gateway`` all use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Iterable
from typing import Final

__all__ = [
    "IMMUTABLE",
    "SEALS",
    "Libc",
    "WritableMapping",
    "close_all",
    "close_fd_result",
    "create",
    "libc",
    "seal",
    "sealed",
    "sealed_off_loop",
    "sealed_size",
    "write_at",
]

#: the seals chunkd puts on every memfd it hands out (no more seals, no change at all)
SEALS: Final = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
#: the seals a receiver requires: the bytes can neither change nor change size
IMMUTABLE: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def create(name: str = "chunkd", size: int = 0) -> int:
    """A new memfd that can be sealed (close-on-exec), ``size`` bytes of zeros."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    if size:
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
    return fd


def write_at(fd: int, data: bytes | memoryview, offset: int = 0) -> None:
    """Write all of ``data`` at ``offset`` (``pwrite`` until it is all there)."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def seal(fd: int) -> None:
    """Put :data:`SEALS` on ``fd``: from now on its bytes and size are fixed."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)


def sealed(data: bytes | memoryview, name: str = "chunkd") -> int:
    """Copy ``data`` into a new memfd, seal it, and return the fd (close-on-exec).

    Blocking (one copy of the bytes); safe to call from any thread.
    """
    view = memoryview(data).cast("B")
    fd = create(name, view.nbytes)
    try:
        write_at(fd, view)
        seal(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


async def sealed_off_loop(data: bytes | memoryview, name: str = "chunkd") -> int:
    """:func:`sealed` in a worker thread.

    Cancelling the caller never leaks the memfd: the copy finishes in its thread and
    the fd is closed as soon as it exists.
    """
    future = asyncio.get_running_loop().run_in_executor(None, sealed, data, name)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(close_fd_result)
        raise


def close_fd_result(future: asyncio.Future[int]) -> None:
    """Done-callback: close the fd a finished future produced (nothing if it failed)."""
    if not future.cancelled() and future.exception() is None:
        os.close(future.result())


def sealed_size(fd: int) -> int | None:
    """The size of ``fd`` if it is a memfd carrying :data:`IMMUTABLE`; None otherwise."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return None  # not a memfd (or not an fd at all)
    if seals & IMMUTABLE != IMMUTABLE:
        return None
    return os.fstat(fd).st_size


def close_all(fds: Iterable[int]) -> None:
    """Close every fd in ``fds``, each once, whatever the others do.

    A close that fails (``EINTR``, ``EIO``) has released the fd on Linux all the
    same, so the error is not worth raising over the fds still to close.
    """
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


#: madvise(2) advice (Linux): fault every page in, writable (5.14 and later)
_MADV_POPULATE_WRITE: Final = 23
#: madvise(2) advice (Linux): a child made by fork(2) does not get the mapping
_MADV_DONTFORK: Final = 10
#: madvise(2) advice (Linux): use huge pages here where the system allows them
_MADV_HUGEPAGE: Final = 14


class Libc:
    """``mmap``, ``munmap`` and ``madvise`` through ctypes, bound once (:func:`libc`);
    ``failed`` is what ``mmap`` returns on failure (``MAP_FAILED``)."""

    _lock = threading.Lock()
    _bound: Libc | None = None

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        self.munmap = libc.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.madvise = libc.madvise
        self.madvise.restype = ctypes.c_int
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.failed = ctypes.c_void_p(-1).value

    @classmethod
    def get(cls) -> Libc:
        with cls._lock:
            if cls._bound is None:
                cls._bound = cls()
            return cls._bound


def libc() -> Libc:
    """The process's ctypes binding of ``mmap``, ``munmap`` and ``madvise``."""
    return Libc.get()


class WritableMapping:
    """The first ``size`` bytes of a memfd, mapped shared and writable at :attr:`address`.

    Made with ``mmap(2)`` through ctypes rather than :class:`mmap.mmap`, so that a
    forked child can drop it without unmapping (see :meth:`forget`): the mapping is
    ``MADV_DONTFORK``, because a child holding a writable mapping of the memfd would
    make the parent's seal fail for as long as the child lives.

    Args:
        fd: the memfd (at least ``size`` bytes long).
        size: bytes to map (more than 0).
        populate: fault every page in now (``MADV_POPULATE_WRITE``; skipped on
            kernels without it): allocated, zeroed if new, and mapped, so that the
            copies that fill it later cost no fault. The range asks for huge pages
            first (``MADV_HUGEPAGE``): where shared memory may use them
            (``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` set to
            ``advise`` or ``within_size``) a 2 MiB page costs one fault, one entry to
            unmap and one page to free where 4 KiB pages cost 512 of each.

    Raises:
        OSError: the kernel refused the mapping (no memory, a limit on mappings).
    """

    def __init__(self, fd: int, size: int, *, populate: bool = False) -> None:
        if size <= 0:
            raise ValueError(f"a mapping needs at least one byte; got {size}")
        libc = Libc.get()
        address = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if address in (None, libc.failed):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {size} bytes of a memfd failed: {os.strerror(err)}")
        self.address: int = address
        self.size = size
        self._libc = libc
        self._mapped = True
        try:
            self._advise(_MADV_DONTFORK, "MADV_DONTFORK")
            if populate:
                with contextlib.suppress(OSError):  # a kernel without THP: small pages
                    self._advise(_MADV_HUGEPAGE, "MADV_HUGEPAGE")
                self.populate()
        except BaseException:
            self.unmap()
            raise

    def populate(self) -> bool:
        """Fault every page in, writable; False where the kernel cannot (before 5.14).

        Raises:
            OSError: no memory for the pages (``ENOMEM``), or another failure.
        """
        try:
            self._advise(_MADV_POPULATE_WRITE, "MADV_POPULATE_WRITE")
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False
            raise
        return True

    def _advise(self, advice: int, name: str) -> None:
        if self._libc.madvise(self.address, self.size, advice) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise({name}) failed: {os.strerror(err)}")

    def buffer(self) -> ctypes.Array[ctypes.c_char]:
        """A ctypes array over the mapping (for ``torch.frombuffer``, ``numpy``): it
        must not be used after :meth:`unmap`."""
        if not self._mapped:
            raise ValueError("the mapping is gone")
        return (ctypes.c_char * self.size).from_address(self.address)

    def copy_in(self, offset: int, source: int, nbytes: int) -> None:
        """Copy ``nbytes`` from address ``source`` to ``offset`` (the GIL is released
        during the copy, so several threads copy at once).

        Raises:
            ValueError: the range lies outside the mapping, or it is gone.
        """
        if not self._mapped:
            raise ValueError("the mapping is gone")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"{nbytes} bytes at {offset} lie outside a {self.size}-byte mapping")
        if nbytes:
            ctypes.memmove(self.address + offset, source, nbytes)

    @property
    def mapped(self) -> bool:
        """Whether the mapping is still there."""
        return self._mapped

    def unmap(self) -> None:
        """Remove the mapping (once; later calls do nothing).

        Raises:
            OSError: ``munmap`` failed (never, for a mapping this object made).
        """
        if not self._mapped:
            return
        self._mapped = False
        if self._libc.munmap(self.address, self.size) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"munmap failed: {os.strerror(err)}")

    def forget(self) -> None:
        """In a forked child: drop the mapping without unmapping (the child has none,
        and the address may hold something else of the child's by now)."""
        self._mapped = False
