"""A crowd of slow HTTP clients (slowloris), to hold a server's connection bounds to
account: ``python -m chunkd.testing.crowd --port PORT --count N --mode MODE``.

Run it as a process of its own (in a network namespace with ``ip netns exec``, for
addresses of other hosts): it raises its own fd limit, opens ``count`` connections as
fast as it can, from ``--sources`` (round robin; the kernel's choice when none), and
holds each as ``mode`` says, never finishing a request:

- ``silent``: sends nothing;
- ``trickle``: a request line and ``Host``, then one more header line every
  ``--every`` seconds;
- ``fat``: a request line, then 100 header lines of 8,000 bytes (each within a
  parser's line limit; 800 KB a request, the probe of issue 24);
- ``full``: a head of ``--head-bytes`` bytes in all (header lines of at most 8,000
  bytes), all but its last line end: as much as a server takes of an unfinished head.

It prints ``opened`` on a line of its own once every connection was tried, ``held``
and the JSON of ``held_by_source`` (below) ``--settle`` seconds later, and, at the
end, one line of JSON: the connections opened and refused, how many the server
closed and after how long each had been open (``longest``), how many of the last
round each source still held ``--settle`` seconds after ``opened``
(``held_by_source``), and how many were still open when it gave up (``open_at_end``).
With ``--rounds-for S`` the slots whose connections the server closed are opened
again every ``--every`` seconds for ``S`` seconds (as the slowloris tool does); the
figures of ``longest`` and ``open_at_end`` are of every connection, the last ones
included. It ends when every connection is closed, or after ``--observe`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Final

__all__ = ["Crowd", "main"]

_FAT_LINE: Final = b"X-Pad-%03d: " + b"a" * 8000 + b"\r\n"


def _full_head(size: int) -> bytes:
    """Header lines of ``size`` bytes in all, at most 8,000 each, the last unended."""
    lines = []
    n = 0
    while size > 0:
        name = b"X-Fill-%03d: " % n
        take = min(8000, size)
        value = b"f" * max(1, take - len(name) - 2)
        line = name + value + b"\r\n"
        lines.append(line)
        size -= len(line)
        n += 1
    return b"".join(lines)[:-2]


@dataclass
class Crowd:
    """What the crowd saw (see the module docstring)."""

    opened: int = 0
    refused: int = 0
    closed: int = 0
    longest: float = 0.0
    open_now: int = 0
    held_by_source: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        """The figures as one line of JSON."""
        return json.dumps(
            {
                "opened": self.opened,
                "refused": self.refused,
                "closed": self.closed,
                "longest": round(self.longest, 3),
                "open_at_end": self.open_now,
                "held_by_source": self.held_by_source,
            }
        )


async def _hold(
    crowd: Crowd,
    host: str,
    port: int,
    source: str | None,
    mode: str,
    every: float,
    live: dict[int, str],
    tried: asyncio.Future[None],
    head_bytes: int,
) -> None:
    """One connection, from its connect to the server's close (or cancellation)."""
    try:
        reader, writer = await asyncio.open_connection(
            host, port, local_addr=None if source is None else (source, 0)
        )
    except OSError:
        crowd.refused += 1
        return
    finally:
        if not tried.done():
            tried.set_result(None)
    started = time.monotonic()
    crowd.opened += 1
    crowd.open_now += 1
    live[id(writer)] = source or ""

    async def feed() -> None:
        first = b"GET /healthz HTTP/1.1\r\nHost: crowd\r\n"
        writer.write(first)
        if mode == "full":
            writer.write(_full_head(head_bytes - len(first)))
            await writer.drain()
            return
        if mode == "fat":
            for n in range(100):
                writer.write(_FAT_LINE % n)
                await writer.drain()
            return
        if mode == "trickle":
            n = 0
            while True:
                await writer.drain()
                await asyncio.sleep(every)
                writer.write(b"X-Trickle-%d: x\r\n" % n)
                n += 1

    feeding = asyncio.ensure_future(feed()) if mode != "silent" else None
    try:
        while await reader.read(65536):
            pass  # an answer (a refusal) before the close
        crowd.closed += 1
        crowd.longest = max(crowd.longest, time.monotonic() - started)
    except OSError:
        crowd.closed += 1
        crowd.longest = max(crowd.longest, time.monotonic() - started)
    finally:
        crowd.open_now -= 1
        del live[id(writer)]
        if feeding is not None:
            feeding.cancel()
            with contextlib.suppress(BaseException):
                await feeding
        writer.close()


async def run(
    host: str,
    port: int,
    *,
    count: int,
    mode: str,
    head_bytes: int = 16000,
    sources: list[str],
    every: float,
    rounds_for: float,
    settle: float,
    observe: float,
) -> Crowd:
    """Run the crowd (see the module docstring) and return what it saw."""
    crowd = Crowd()
    live: dict[int, str] = {}
    slots: list[asyncio.Task[None] | None] = [None] * count

    def source_of(slot: int) -> str | None:
        return sources[slot % len(sources)] if sources else None

    loop = asyncio.get_running_loop()

    def open_slot(slot: int) -> asyncio.Future[None]:
        tried: asyncio.Future[None] = loop.create_future()
        slots[slot] = asyncio.ensure_future(
            _hold(crowd, host, port, source_of(slot), mode, every, live, tried, head_bytes)
        )
        return tried

    started = time.monotonic()
    # Connect as fast as the loop can, 256 connects in flight at most.
    for first in range(0, count, 256):
        batch = [open_slot(slot) for slot in range(first, min(count, first + 256))]
        await asyncio.wait(batch, timeout=observe)
    print("opened", flush=True)
    await asyncio.sleep(settle)
    crowd.held_by_source = {}
    for source in live.values():
        crowd.held_by_source[source] = crowd.held_by_source.get(source, 0) + 1
    print("held", json.dumps(crowd.held_by_source), flush=True)
    while time.monotonic() - started < rounds_for:
        await asyncio.sleep(every)
        for slot, task in enumerate(slots):
            if task is None or task.done():
                open_slot(slot)
    while any(t is not None and not t.done() for t in slots):
        if time.monotonic() - started > observe:
            break
        await asyncio.sleep(0.05)
    for task in slots:
        if task is not None:
            task.cancel()
    await asyncio.gather(*(t for t in slots if t is not None), return_exceptions=True)
    crowd.open_now = len(live)
    return crowd


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m chunkd.testing.crowd")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--mode", choices=("silent", "trickle", "fat", "full"), default="silent")
    parser.add_argument("--head-bytes", type=int, default=16000)
    parser.add_argument("--sources", default="", help="source addresses, comma-separated")
    parser.add_argument("--every", type=float, default=0.5)
    parser.add_argument("--rounds-for", type=float, default=0.0)
    parser.add_argument("--settle", type=float, default=0.5)
    parser.add_argument("--observe", type=float, default=30.0)
    args = parser.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = args.count + 256
    if hard != resource.RLIM_INFINITY and hard < want:
        print(f"the fd limit ({hard}) is under {want}", file=sys.stderr)
        return 2
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(want, 1024), hard))
    socket.setdefaulttimeout(None)
    crowd = asyncio.run(
        run(
            args.host,
            args.port,
            count=args.count,
            mode=args.mode,
            head_bytes=args.head_bytes,
            sources=[s for s in args.sources.split(",") if s],
            every=args.every,
            rounds_for=args.rounds_for,
            settle=args.settle,
            observe=args.observe,
        )
    )
    print(crowd.to_json(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
