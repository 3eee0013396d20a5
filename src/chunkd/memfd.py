"""Sealed memfds: the one definition of creating, writing, sealing, checking and closing them.

chunkd hands bytes between processes as memfds sealed against every change
(:data:`SEALS`): the RAM tier keeps each chunk in one, the daemon sends them over the
local socket, and trainers send their checkpoint state in them. A receiver accepts
an fd only when it carries :data:`IMMUTABLE` (:func:`sealed_size`): bytes that could
change after they were hashed, or shrink under a mapping (SIGBUS), are refused.

This module needs nothing but the standard library: ``chunkd.cache``,
``chunkd.client`` and ``chunkd.gateway`` all use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import Iterable
from typing import Final

__all__ = [
    "IMMUTABLE",
    "SEALS",
    "close_all",
    "close_fd_result",
    "create",
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
