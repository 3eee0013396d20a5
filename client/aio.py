"""The :class:`~chunkd.client.Client` API as coroutines: :class:`AsyncClient`.

Calls that need the daemon run on a worker thread over one sync client; reads and
stats that the client cache answers run on the event loop.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

from chunkd.client.core import DEFAULT_CACHE_BYTES, DEFAULT_TIMEOUT, Client
from chunkd.client.files import ChunkdFile
from chunkd.client.jobs import job_name
from chunkd.client.reader import check_range
from chunkd.client.results import CacheInfo, ObjectStat
from chunkd.client.views import byte_target
from chunkd.errors import ChunkdError

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["AsyncClient"]

#: an AsyncClient copies a cache hit on the event loop up to this size, else in a thread
_LOOP_COPY_BYTES: Final = 1 << 20


class AsyncClient:
    """The :class:`Client` API as coroutines.

    v1 runs each call that needs the daemon on a worker thread with
    :func:`asyncio.to_thread`, over one sync :class:`Client` (one request on its
    connection at a time). Reads and stats that the client cache answers run on the
    event loop and never hop threads; only a cache hit that :meth:`read_into` must copy
    and that is over 1 MiB is copied in a thread, so the loop does not stall.

    Connects on ``await connect()``, ``async with``, or the first call.

    Args:
        socket_path: as for :class:`Client`.
        timeout: as for :class:`Client`.
        cache_bytes: as for :class:`Client`.
        train_job: as for :class:`Client` (checked, and the environment read, here).

    Raises:
        ValueError: ``train_job`` is no job name.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        train_job: str | None = None,
    ) -> None:
        self._args = (socket_path, timeout, cache_bytes, job_name(train_job))
        self._client: Client | None = None
        self._connecting: asyncio.Lock | None = None

    @classmethod
    def from_client(cls, client: Client) -> AsyncClient:
        """An async face over an already connected :class:`Client` (shares its cache)."""
        self = cls()
        self._client = client
        return self

    @property
    def client(self) -> Client:
        """The sync client underneath.

        Raises:
            RuntimeError: not connected yet.
        """
        if self._client is None:
            raise RuntimeError("the AsyncClient is not connected yet; await connect() first")
        return self._client

    async def connect(self) -> AsyncClient:
        """Connect (once); return the client.

        Raises:
            DaemonUnavailableError: no daemon answers.
        """
        if self._client is None:
            if self._connecting is None:
                self._connecting = asyncio.Lock()
            async with self._connecting:
                if self._client is None:
                    path, timeout, cache_bytes, train_job = self._args
                    self._client = await asyncio.to_thread(
                        Client, path, timeout=timeout, cache_bytes=cache_bytes, train_job=train_job
                    )
        return self

    async def _sync(self) -> Client:
        if self._client is None:
            await self.connect()
        assert self._client is not None
        return self._client

    async def read(self, name: str, offset: int = 0, length: int | None = None) -> memoryview:
        """See :meth:`Client.read`."""
        client = await self._sync()
        check_range(offset, length)
        located = client.reader.from_cache(name, offset, length, time.monotonic())
        if located is not None:
            return located.view()
        return await asyncio.to_thread(client.read, name, offset, length)

    async def read_into(self, name: str, buf: WriteableBuffer, offset: int = 0) -> int:
        """See :meth:`Client.read_into`."""
        client = await self._sync()
        target = byte_target(buf)
        check_range(offset, None)
        located = client.reader.from_cache(name, offset, len(target), time.monotonic())
        if located is None:
            return await asyncio.to_thread(client.read_into, name, target, offset)
        if located.length <= _LOOP_COPY_BYTES:
            return located.copy_into(target)
        return await asyncio.to_thread(located.copy_into, target)

    async def stat(self, name: str) -> ObjectStat:
        """See :meth:`Client.stat`."""
        client = await self._sync()
        known = client.reader.fresh(name)
        if known is not None:
            return known.stat(name)
        return await asyncio.to_thread(client.stat, name)

    async def open(self, name: str) -> ChunkdFile:
        """See :meth:`Client.open`. The file's own methods are blocking (sync) calls."""
        return ChunkdFile(await self._sync(), await self.stat(name))

    async def prefetch(self, names: Iterable[str]) -> int:
        """See :meth:`Client.prefetch`."""
        client = await self._sync()
        listed = [names] if isinstance(names, str) else list(names)
        return await asyncio.to_thread(client.prefetch, listed)

    async def ls(self, prefix: str, *, recursive: bool = False) -> list[dict[str, Any]]:
        """See :meth:`Client.ls`."""
        client = await self._sync()
        return await asyncio.to_thread(client.ls, prefix, recursive=recursive)

    async def ls_page(
        self,
        prefix: str,
        *,
        recursive: bool = False,
        start_after: str | None = None,
        limit: int | None = None,
    ) -> tuple[list[dict[str, Any]], str | None]:
        """See :meth:`Client.ls_page`."""
        client = await self._sync()
        return await asyncio.to_thread(
            client.ls_page, prefix, recursive=recursive, start_after=start_after, limit=limit
        )

    async def read_ranges(
        self, ranges: Iterable[tuple[str, int, int]]
    ) -> list[bytes | ChunkdError]:
        """See :meth:`Client.read_ranges`."""
        client = await self._sync()
        return await asyncio.to_thread(client.read_ranges, list(ranges))

    def cache_info(self) -> CacheInfo:
        """See :meth:`Client.cache_info`."""
        return self.client.cache_info()

    async def close(self) -> None:
        """See :meth:`Client.close`."""
        if self._client is not None:
            self._client.close()

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
