"""Real servers for tests and benchmarks: an S3-protocol server and a counting proxy.

Shipped with the package (as ``chunkd.cache.testing`` is) so that the tests and the
benchmarks use one implementation. Nothing in the daemon imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CountingProxy",
    "S3Server",
    "free_port",
    "refused_backend",
    "s3_backend",
    "wait_for_port",
]

BIN = Path(sys.executable).parent


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float = 30.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
        except OSError:
            time.sleep(0.05)
        else:
            return
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s")


@dataclass
class S3Server:
    """A real S3-protocol server (moto's server mode) in a subprocess."""

    port: int
    process: subprocess.Popen[bytes]
    host: str = "127.0.0.1"

    @classmethod
    def start(
        cls,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        checks_credentials_after: int | None = None,
        netns: str | None = None,
    ) -> S3Server:
        """Start moto_server and wait until it listens.

        Args:
            host: the address it listens on.
            port: its port (a free one on loopback by default).
            checks_credentials_after: refuse wrong credentials once this many
                requests have gone by unchecked (moto lets the first ones through).
            netns: run it in this network namespace (``ip netns exec``).
        """
        port = port or free_port()
        env = dict(os.environ)
        if checks_credentials_after is not None:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(checks_credentials_after)
        prefix = ["ip", "netns", "exec", netns] if netns else []
        process = subprocess.Popen(
            [*prefix, str(BIN / "moto_server"), "-H", host, "-p", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for_port(port, host=host)
        except BaseException:
            process.kill()
            process.wait()
            raise
        return cls(port, process, host)

    def stop(self) -> None:
        """Stop the server."""
        self.process.terminate()
        self.process.wait(timeout=10)

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing-secret",
            region_name="us-east-1",
        )


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


def s3_backend(name: str, url: str, endpoint: str, **keys: str | int | bool) -> str:
    """A ``[[backends]]`` table for an S3-protocol server of the tests (moto, over
    http), with its test credentials; ``keys`` add keys or override these (a str is
    written as a TOML string, a bool as true/false)."""
    table: dict[str, str | int | bool] = {
        "name": name,
        "url": url,
        "endpoint": endpoint,
        "region": "us-east-1",
        "access_key_id": "testing",
        "secret_access_key": "testing-secret",
        "allow_http": True,
        **keys,
    }
    lines = (f"{key} = {_toml_value(value)}\n" for key, value in table.items())
    return "[[backends]]\n" + "".join(lines)


def refused_backend(endpoint: str, **keys: str | int | bool) -> str:
    """A backend table ``vault`` over bucket ``locked`` with credentials a server that
    checks them refuses (``S3Server.start(checks_credentials_after=...)``), no retries."""
    wrong: dict[str, str | int | bool] = {
        "access_key_id": "not-a-key",
        "secret_access_key": "not-a-secret",
        "retries": 0,
    }
    return s3_backend("vault", "s3://locked/pre", endpoint, **{**wrong, **keys})


def _toml_value(value: str | int | bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return json.dumps(value)  # a TOML basic string
