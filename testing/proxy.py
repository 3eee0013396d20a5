"""A counting TCP proxy in front of a test server: bytes the daemon really read."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from typing import Any

from chunkd.testing.ports import free_port

__all__ = ["CountingProxy"]


class CountingProxy:
    """A TCP proxy in front of the S3 server that counts the bytes it answers with.

    The count does not depend on the daemon's own metrics. ``down()`` closes the
    listener and every connection (the backend is gone: connections are refused);
    ``up()`` listens again on the same port. ``close()`` ends everything and returns
    once every socket the proxy accepted or opened is closed.

    The proxy accepts connections itself, in the listening socket's reader callback,
    rather than through ``asyncio.start_server``: asyncio's server accepts in a task
    of its own, and a connection it accepts just before ``Server.close()`` fails an
    assertion there (``Server._attach``) that asyncio swallows outside debug mode,
    leaving that socket open and owned by no one (Python 3.11). Here every accepted
    socket belongs at once to a task the proxy holds, and each task closes its
    sockets and waits until they are closed before it ends.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.bytes_down = 0
        self.connections = 0
        #: seconds to sleep before passing on each 64 KiB the server sends (a slow link)
        self.delay = 0.0
        #: seconds to sleep before passing on each 64 KiB a client sends (a slow uplink)
        self.delay_up = 0.0
        self.bytes_up = 0
        #: cut the next response that grows past this many bytes (one shot)
        self.cut_after: int | None = None
        self.cuts = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._listener: socket.socket | None = None
        # down() bumps it: a connection accepted before down() is never relayed after.
        self._generation = 0
        # Each connection's task until it ends (the loop itself holds tasks weakly).
        self._tasks: set[asyncio.Task[None]] = set()
        # Every stream whose socket is not known to be closed yet.
        self._writers: set[asyncio.StreamWriter] = set()
        self.up()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    def up(self) -> None:
        async def start() -> None:
            listener = socket.socket()
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(("127.0.0.1", self.port))
                listener.listen(128)
                listener.setblocking(False)
            except BaseException:
                listener.close()
                raise
            self._listener = listener
            self._loop.add_reader(listener.fileno(), self._accept, listener)

        self._call(start())

    def down(self) -> None:
        async def stop() -> None:
            self._generation += 1
            if self._listener is not None:
                self._loop.remove_reader(self._listener.fileno())
                self._listener.close()
                self._listener = None
            for writer in list(self._writers):
                writer.transport.abort()

        self._call(stop())

    def reset(self) -> None:
        self.bytes_down = 0
        self.bytes_up = 0

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # none left to accept (or one reset before it was)
                return
            conn.setblocking(False)
            task = self._loop.create_task(self._serve(conn, self._generation))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket, generation: int) -> None:
        self.connections += 1
        if generation != self._generation:  # accepted just before down()
            conn.close()
            return
        reader = asyncio.StreamReader(limit=1 << 16)
        protocol = asyncio.StreamReaderProtocol(reader)
        try:
            transport, _ = await self._loop.connect_accepted_socket(lambda: protocol, conn)
        except BaseException:
            conn.close()
            raise
        writer = asyncio.StreamWriter(transport, protocol, reader, self._loop)
        self._writers.add(writer)
        try:
            if generation == self._generation:
                await self._relay(reader, writer)
        finally:
            await self._close(writer)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            return
        self._writers.add(up_writer)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, count: bool) -> None:
            try:
                sent = 0
                while data := await src.read(1 << 16):
                    if not count:
                        self.bytes_up += len(data)
                        if self.delay_up:
                            await asyncio.sleep(self.delay_up)
                    if count:
                        self.bytes_down += len(data)
                        sent += len(data)
                        if self.delay:
                            await asyncio.sleep(self.delay)
                        if self.cut_after is not None and sent > self.cut_after:
                            self.cut_after = None
                            self.cuts += 1
                            break  # the connection dies mid-body
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()

        try:
            # A task group, not gather: neither direction outlives the connection's task.
            async with asyncio.TaskGroup() as group:
                group.create_task(pipe(reader, up_writer, False))
                group.create_task(pipe(up_reader, writer, True))
        finally:
            await self._close(up_writer)

    async def _close(self, writer: asyncio.StreamWriter) -> None:
        """Abort ``writer``'s connection and wait until its socket is closed.

        The transport closes its socket in a later callback of the loop; a loop that
        stopped before it ran would leak the socket (ResourceWarning: unclosed
        transport), so the stream stays in ``_writers`` until that is done.
        """
        writer.transport.abort()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()
        self._writers.discard(writer)

    def close(self) -> None:
        """Stop listening, end every connection, and stop the proxy's loop."""
        self.down()

        async def finish() -> None:
            # Every connection is aborted: its task closes its sockets and ends. One
            # still waiting after 5 s (a long delay) is cancelled; its finally blocks
            # still close its streams.
            if self._tasks:
                _, pending = await asyncio.wait(set(self._tasks), timeout=5)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
            # A task cancelled while it waited for its sockets to close left its
            # streams here.
            for writer in list(self._writers):
                await self._close(writer)

        self._call(finish())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"
