"""A latency relay: TCP carried with every piece delayed by latency ± jitter.

This kernel has no netem, so latency, jitter and the reordering jitter brings come
from userspace. The relay accepts TCP connections, connects on to where each was
going, and passes on every piece it reads (at most 64 KiB) after a delay drawn for
that piece, in both directions. Within one connection the pieces keep their order
(a later piece never leaves before an earlier one, as TCP would see it); between
connections they overtake each other, which is the reordering a node sees when
one link's delay varies.

Where a connection goes:

- **transparent** (no ``upstream``), in a node's network namespace under
  :meth:`chunkd.testing.netlab.Lab.delay`: nftables ``redirect`` rules send the
  node's TCP to the relay, which reads the original destination with
  ``getsockopt(SOL_IP, SO_ORIGINAL_DST)``; its own connections onwards carry
  ``SO_MARK`` :data:`RELAY_MARK`, which the rules let through, so they are not
  redirected back to it. No daemon's config changes.
- **fixed** (``upstream=(host, port)``): every connection goes to one server, as a
  plain proxy on loopback does.

It only ever connects to 198.18.0.0/15 (the labs' addresses) or loopback; a
connection to anything else is closed unanswered and counted as ``refused``.

Bounded: each direction of a connection holds at most :data:`WINDOW` pieces
(``WINDOW * PIECE`` bytes); when that is full the relay stops reading the sender,
and TCP's flow control pushes back on it. At most ``max_connections`` at once;
more are closed at once.

The relay runs as a subprocess (``python -m chunkd.testing.relay``, under ``ip netns
exec`` for a namespace), so it has an interpreter of its own and dies with its
parent: it reads commands on stdin (``stats``: one JSON line of
:class:`RelayStats` on stdout; ``stop``, or stdin closed: exit) and writes one
line, ``{"ready": ...}``, once it listens. :class:`LatencyRelay` is the parent's
handle on it.

Part of :mod:`chunkd.testing`; the daemon never imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import itertools
import json
import random
import select
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any, Final, Self

__all__ = ["PIECE", "RELAY_MARK", "WINDOW", "LatencyRelay", "RelayStats", "allowed"]

#: the most bytes read (and passed on after one delay) at a time
PIECE: Final = 64 * 1024
#: pieces held per direction of a connection before the relay stops reading its sender
WINDOW: Final = 16
#: SO_MARK of the relay's own connections onwards: the redirect rules skip them
RELAY_MARK: Final = 0x6368

# linux/netfilter_ipv4.h: the destination a connection had before NAT redirected it
_SO_ORIGINAL_DST: Final = 80
_ALLOWED: Final = (
    ipaddress.ip_network("198.18.0.0/15"),
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("::1/128"),
)
_CONNECT_TIMEOUT: Final = 5.0
#: how long the parent waits for the relay's answer to a command
_ANSWER_TIMEOUT: Final = 10.0


def allowed(host: str) -> bool:
    """Whether the relay may connect to ``host``: the labs' 198.18.0.0/15 or loopback."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(address in network for network in _ALLOWED)


@dataclass
class RelayStats:
    """What a relay carried, since it started."""

    #: connections accepted and carried on
    connections: int = 0
    #: connections closed unanswered: a destination outside the labs, the relay itself,
    #: an upstream that refused, or more than ``max_connections`` at once
    refused: int = 0
    #: bytes from the side that connected towards its destination
    request_bytes: int = 0
    #: bytes from the destination back
    answer_bytes: int = 0
    #: pieces passed on, both directions
    pieces: int = 0
    #: pieces that left after a piece (of another connection) that had arrived later
    overtaken: int = 0
    #: the most bytes held back at once, every connection together
    max_held_bytes: int = 0
    #: the mean delay a piece was held, in seconds
    mean_delay: float = 0.0


@dataclass
class _Relay:
    """The relay itself, in the subprocess."""

    latency: float
    jitter: float
    seed: int
    upstream: tuple[str, int] | None
    mark: int | None
    max_connections: int
    stats: RelayStats = field(default_factory=RelayStats, init=False)
    _held: int = field(default=0, init=False)  # bytes held back now, every connection
    _open: int = field(default=0, init=False)  # connections now
    _delayed: float = field(default=0.0, init=False)  # seconds, every piece passed on
    # Each piece's arrival order, across connections: a piece that leaves after one
    # that arrived later was overtaken.
    _sequence: itertools.count[int] = field(default_factory=itertools.count, init=False)
    _last_sent: int = field(default=-1, init=False)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set, init=False)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set, init=False)
    _random: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)

    def delay(self) -> float:
        """One piece's delay: latency ± jitter, uniform, never below zero."""
        return max(0.0, self.latency + self._random.uniform(-self.jitter, self.jitter))

    def figures(self) -> RelayStats:
        """The stats now."""
        pieces = self.stats.pieces
        self.stats.mean_delay = self._delayed / pieces if pieces else 0.0
        return self.stats

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Carry one accepted connection to its destination and back."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # so that stop() waits for it to close its sockets
        self._writers.add(writer)
        up_writer: asyncio.StreamWriter | None = None
        self._open += 1
        try:
            destination = self._destination(writer)
            if destination is None or self._open > self.max_connections:
                self.stats.refused += 1
                return
            try:
                up_reader, up_writer = await self._connect(destination)
            except (OSError, TimeoutError):
                self.stats.refused += 1
                return
            self._writers.add(up_writer)
            self.stats.connections += 1
            # Neither direction outlives the other's failure; a clean end (EOF) of one
            # is passed on as a half close, and the other goes on.
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._carry(reader, up_writer, "request"))
                    group.create_task(self._carry(up_reader, writer, "answer"))
            except* (ConnectionError, OSError):
                pass  # one side reset: both are closed below, as a router's loss would
        finally:
            self._open -= 1
            await asyncio.gather(*(_close(s) for s in (writer, up_writer) if s is not None))
            self._writers.discard(writer)
            if up_writer is not None:
                self._writers.discard(up_writer)
            self._tasks.discard(task)

    def _destination(self, writer: asyncio.StreamWriter) -> tuple[str, int] | None:
        if self.upstream is not None:
            return self.upstream
        sock = writer.get_extra_info("socket")
        try:
            raw = sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
        except OSError:
            return None  # no NAT record: not a redirected connection
        host, port = socket.inet_ntoa(raw[4:8]), int.from_bytes(raw[2:4], "big")
        if (host, port) == tuple(sock.getsockname()[:2]) or not allowed(host):
            return None  # not redirected (it would loop to the relay), or off the labs
        return host, port

    async def _connect(
        self, destination: tuple[str, int]
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, port = destination
        if not allowed(host):
            raise ConnectionRefusedError(f"{host} is outside 198.18.0.0/15 and loopback")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            if self.mark is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, self.mark)
            loop = asyncio.get_running_loop()
            await asyncio.wait_for(loop.sock_connect(sock, (host, port)), _CONNECT_TIMEOUT)
            return await asyncio.open_connection(sock=sock, limit=PIECE)
        except BaseException:
            sock.close()
            raise

    async def _carry(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, direction: str
    ) -> None:
        """Pass ``source``'s pieces to ``sink``, each after its delay, in order."""
        loop = asyncio.get_running_loop()
        # (due, arrival order, delay, bytes); None: the sender closed its side
        held: asyncio.Queue[tuple[float, int, float, bytes] | None] = asyncio.Queue(WINDOW)

        async def take() -> None:
            while data := await source.read(PIECE):
                delay = self.delay()
                # put() waits while WINDOW pieces are held: the relay stops reading,
                # the sender's window fills, and TCP holds the sender back.
                await held.put((loop.time() + delay, next(self._sequence), delay, data))
                self._held += len(data)
                self.stats.max_held_bytes = max(self.stats.max_held_bytes, self._held)
            await held.put(None)

        async def give() -> None:
            while (item := await held.get()) is not None:
                due, order, delay, data = item
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                self._held -= len(data)
                self._delayed += delay
                if order < self._last_sent:
                    self.stats.overtaken += 1
                self._last_sent = max(self._last_sent, order)
                self.stats.pieces += 1
                if direction == "request":
                    self.stats.request_bytes += len(data)
                else:
                    self.stats.answer_bytes += len(data)
                sink.write(data)
                await sink.drain()
            if sink.can_write_eof():
                sink.write_eof()

        async with asyncio.TaskGroup() as group:
            group.create_task(take())
            group.create_task(give())

    async def close_all(self) -> None:
        """Abort every connection and wait until each one's task closed its sockets
        (cancelled after 5 s; its ``finally`` still closes them)."""
        for writer in list(self._writers):
            writer.transport.abort()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=5)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)


async def _close(stream: asyncio.StreamWriter) -> None:
    """Close ``stream`` once what it still buffers is sent; abort it after 10 s (a
    receiver that no longer reads)."""
    stream.close()
    try:
        await asyncio.wait_for(stream.wait_closed(), 10)
    except (TimeoutError, ConnectionError, OSError):
        stream.transport.abort()


async def _serve(relay: _Relay, host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await asyncio.start_server(relay.connection, host, port, limit=PIECE, backlog=256)
    commands = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(commands), sys.stdin)
    listening = server.sockets[0].getsockname()[1]
    _answer({"ready": True, "port": listening})
    try:
        while line := (await commands.readline()).strip():
            if line == b"stats":
                _answer(asdict(relay.figures()))
            elif line == b"stop":
                break
            else:
                _answer({"error": f"unknown command {line.decode(errors='replace')!r}"})
    finally:
        server.close()
        await relay.close_all()
        _answer(asdict(relay.figures()))


def _answer(message: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m chunkd.testing.relay")
    parser.add_argument("--listen", default="127.0.0.1:0", help="host:port to accept on")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds per piece")
    parser.add_argument("--jitter", type=float, default=0.0, help="± seconds, uniform")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--upstream", help="host:port for every connection (else transparent)")
    parser.add_argument("--mark", type=lambda s: int(s, 0), help="SO_MARK of connections onwards")
    parser.add_argument("--max-connections", type=int, default=512)
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    upstream = None
    if args.upstream:
        up_host, _, up_port = args.upstream.rpartition(":")
        if not allowed(up_host):
            parser.error(f"--upstream {up_host} is outside 198.18.0.0/15 and loopback")
        upstream = (up_host, int(up_port))
    relay = _Relay(
        latency=args.latency,
        jitter=args.jitter,
        seed=args.seed,
        upstream=upstream,
        mark=args.mark,
        max_connections=args.max_connections,
    )
    asyncio.run(_serve(relay, host, int(port)))


class LatencyRelay:
    """The parent's handle on a relay subprocess (see the module's docstring).

    Args:
        process: the relay, started by :meth:`start`.
        port: where it accepts.
    """

    def __init__(self, process: subprocess.Popen[str], port: int) -> None:
        self.process = process
        self.port = port
        #: the stats the relay sent as it stopped (None while it runs)
        self.final: RelayStats | None = None

    @classmethod
    def start(
        cls,
        *,
        latency: float,
        jitter: float = 0.0,
        listen: str = "127.0.0.1:0",
        upstream: str | None = None,
        mark: int | None = None,
        netns: str | None = None,
        seed: int = 0,
    ) -> Self:
        """Start a relay and wait until it accepts.

        Args:
            latency: seconds each piece is held, on average.
            jitter: each piece's delay is ``latency`` ± up to this, uniformly.
            listen: ``host:port`` to accept on (port 0: any free one).
            upstream: ``host:port`` every connection goes to; None: transparent
                (the original destination of a redirected connection).
            mark: ``SO_MARK`` of the relay's connections onwards (needs root).
            netns: run it in this network namespace (``ip netns exec``; root).
            seed: the delays' random seed, so that a run can be repeated.
        """
        # -c, not -m: chunkd.testing imports this module, and runpy warns when the
        # module it runs as __main__ is already in sys.modules
        argv = [sys.executable, "-c", "from chunkd.testing.relay import _main; _main()"]
        argv += ["--listen", listen]
        argv += ["--latency", str(latency), "--jitter", str(jitter), "--seed", str(seed)]
        if upstream is not None:
            argv += ["--upstream", upstream]
        if mark is not None:
            argv += ["--mark", hex(mark)]
        prefix = ["ip", "netns", "exec", netns] if netns else []
        process = subprocess.Popen(
            [*prefix, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            ready = _read_line(process, 30.0)
        except BaseException:
            process.kill()
            process.wait()
            raise
        if not ready.get("ready"):
            process.kill()
            process.wait()
            raise RuntimeError(f"the relay did not start: {ready}")
        return cls(process, int(ready["port"]))

    def stats(self) -> RelayStats:
        """What it carried so far (its final stats once it stopped)."""
        if self.final is not None:
            return self.final
        assert self.process.stdin is not None
        self.process.stdin.write("stats\n")
        self.process.stdin.flush()
        return RelayStats(**_read_line(self.process, _ANSWER_TIMEOUT))

    def close(self) -> RelayStats:
        """Stop it (its connections are cut) and return its final stats."""
        if self.final is not None:
            return self.final
        final = RelayStats()
        try:
            assert self.process.stdin is not None
            self.process.stdin.write("stop\n")
            self.process.stdin.close()
            final = RelayStats(**_read_line(self.process, _ANSWER_TIMEOUT))
        except (OSError, ValueError, TimeoutError, RuntimeError):
            self.process.kill()  # it is not answering: its stats are lost with it
        finally:
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            if self.process.stdout is not None:
                self.process.stdout.close()
        self.final = final
        return final


def _read_line(process: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """The relay's next JSON line, within ``timeout`` seconds."""
    stdout: IO[str] | None = process.stdout
    assert stdout is not None
    deadline = time.monotonic() + timeout
    ready: list[IO[str]] = []
    while not ready:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the relay said nothing for {timeout:g}s")
        ready, _, _ = select.select([stdout], [], [], left)
    line = stdout.readline()
    if not line:
        raise RuntimeError(f"the relay exited (status {process.wait()})")
    answer = json.loads(line)
    assert isinstance(answer, dict)
    return answer


if __name__ == "__main__":
    _main()
