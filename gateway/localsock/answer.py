"""What one answer of the local socket carries besides its header.

Every op's handler gets the :class:`Answer` of its request: the fds the request
brought, the caller the kernel named, and room for what goes back (leases to
release, fds to send, a payload). The server sends it and releases what it holds,
whether or not the client is still there to take it. A memfd a request carries is
taken only sealed (:func:`sealed_size`).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, Final

from chunkd import memfd
from chunkd.client.protocol import MAX_PAYLOAD
from chunkd.errors import InvalidRequestError

if TYPE_CHECKING:
    from chunkd.cache import ChunkLease
    from chunkd.gateway.authority import Caller

__all__ = ["LIST_BYTES", "Answer", "sealed_size"]

#: what a listing page's entries may take of an answer's payload (the rest is slack)
LIST_BYTES: Final = MAX_PAYLOAD - 4096


class Answer:
    """What one answer carries besides its header: leases to release, fds to send,
    fds to close once sent (the request's own among them), and a payload.

    Args:
        request_fds: the fds that came with the request (closed with the answer).
        caller: who sent the request (the kernel's word); None: the daemon itself.
    """

    def __init__(self, request_fds: list[int], caller: Caller | None = None) -> None:
        self.request_fds = request_fds
        #: who sent the request (the kernel's word): the ops that change or remove
        #: what someone made check it (docs/security.md); None: the daemon itself
        self.caller = caller
        self.leases: list[ChunkLease] = []
        self.fds: list[int] = []
        self.owned: list[int] = list(request_fds)
        self.payload = b""

    async def send_chunk(self, lease: ChunkLease) -> None:
        """Send a leased chunk's sealed memfd (sealing a copy if it has none); the
        caller has put the lease in :attr:`leases` already."""
        fd = lease.fileno()
        if fd is None:  # no RAM copy (RAM full of pinned chunks): seal one for it
            fd = await memfd.sealed_off_loop(lease.view())
            self.owned.append(fd)
        self.fds.append(fd)

    def send_fd(self, fd: int) -> None:
        """Send ``fd``, which the answer now owns: it is closed once sent (or not)."""
        self.owned.append(fd)
        self.fds.append(fd)

    async def send_json(self, doc: Any) -> None:
        """Send ``doc`` as compact JSON in a sealed memfd, written off the loop (a
        document with no bound on its size: a manifest, a collection's report)."""
        self.send_fd(await asyncio.to_thread(_sealed_json, doc))


def sealed_size(fd: int, what: str) -> int:
    """The size of ``fd``, a memfd a request carries, sealed against writes and resizes.

    Raises:
        InvalidRequestError: ``fd`` is not such a memfd (``what`` names it).
    """
    size = memfd.sealed_size(fd)
    if size is None:
        raise InvalidRequestError(
            f"{what} must be a memfd sealed against writes and resizes (F_SEAL_WRITE, "
            "F_SEAL_SHRINK, F_SEAL_GROW): its bytes could otherwise change after they "
            "were hashed"
        )
    return size


def _sealed_json(doc: Any) -> int:
    return memfd.sealed(json.dumps(doc, separators=(",", ":")).encode())
