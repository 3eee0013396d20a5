"""``chunkd selfcheck``: exercise the cache library end to end and say what happened."""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from chunkd.errors import ChunkdError

if TYPE_CHECKING:
    from chunkd.cache import ChunkId

__all__ = ["add_parser", "run", "run_selfcheck"]

_CHUNK = 4 << 20


def run_selfcheck(directory: str, chunks: int) -> int:
    """Run the self-check in ``directory``; 0 when every step passed."""
    try:
        return asyncio.run(_selfcheck(Path(directory).resolve(), chunks))
    except ChunkdError as exc:
        print(f"selfcheck failed: {exc}")
        return 1


async def _selfcheck(directory: Path, count: int) -> int:
    from chunkd.cache import CacheConfig, ChunkCache, RamLease

    config = CacheConfig(
        dir=directory,
        ram_bytes=max(2, count // 2) * _CHUNK,
        disk_bytes=4 * count * _CHUNK,
        disk_min_free_bytes=64 << 20,
    )
    print(f"chunkd selfcheck in {directory}")
    print(
        f"  RAM tier {config.ram_bytes >> 20} MiB, disk tier {config.disk_bytes >> 20} MiB, "
        f"chunks of {config.chunk_bytes >> 20} MiB"
    )
    failures = 0

    async def step(label: str, body: Callable[[], Awaitable[str]]) -> None:
        nonlocal failures
        start = time.perf_counter()
        try:
            detail = await body()
            verdict = "ok  "
        except Exception as exc:
            detail = f"{type(exc).__name__}: {exc}"
            verdict = "FAIL"
            failures += 1
        print(f"  [{verdict}] {label:<44} {1e3 * (time.perf_counter() - start):8.1f} ms  {detail}")

    payloads = [_payload(i) for i in range(count)]
    ids: list[ChunkId] = []
    cache = await ChunkCache.open(config)
    try:

        async def insert() -> str:
            for data in payloads:
                ids.append(await cache.insert(data))
            st = cache.stats().tiers
            return (
                f"{count} chunks; RAM holds {st[0].chunks}, disk {st[1].chunks} "
                f"({st[1].bytes >> 20} MiB stored)"
            )

        async def read_ram() -> str:
            served = 0
            for cid, data in zip(ids, payloads, strict=True):
                lease = await cache.get(cid)
                with lease:
                    if lease.read() != data:
                        raise ChunkdError(f"chunk {cid} came back with other bytes")
                    served += isinstance(lease, RamLease)
            return f"all {count} verified ({served} served as memfds after promotion)"

        async def sealed() -> str:
            with await cache.get(ids[0]) as lease:
                fd = lease.fileno()
                if fd is None:
                    raise ChunkdError("the RAM tier handed out no fd")
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
                try:
                    os.pwrite(fd, b"x", 0)
                except PermissionError:
                    return f"write refused (seals 0x{seals:x})"
                raise ChunkdError("a write through a handed-out fd succeeded")

        async def read_disk() -> str:
            for cid in ids:
                await cache.ram.discard(cid)
            for cid, data in zip(ids, payloads, strict=True):
                with await cache.get(cid) as lease:
                    if lease.read() != data:
                        raise ChunkdError(f"chunk {cid} came back from disk with other bytes")
            return f"RAM emptied; all {count} read back from disk, verified, promoted"

        await step("insert (hash, memfd + seal, disk write)", insert)
        await step("read back (RAM, else disk and promote)", read_ram)
        await step("sealed memfd refuses writes", sealed)
        await step("read back from disk", read_disk)
    finally:
        await cache.close()

    async def reopen() -> str:
        start = time.perf_counter()
        again = await ChunkCache.open(config)
        opened = time.perf_counter() - start
        try:
            for cid, data in zip(ids, payloads, strict=True):
                with await again.get(cid) as lease:
                    if lease.read() != data:
                        raise ChunkdError(f"chunk {cid} differs after reopening")
            done = await again.wait_reconciled()
        finally:
            await again.close()
        return f"opened in {opened * 1e3:.1f} ms, all {count} served; reconcile: {done}"

    await step("reopen and serve what it held", reopen)
    print("selfcheck passed" if not failures else f"selfcheck: {failures} step(s) failed")
    return 1 if failures else 0


def _payload(i: int) -> bytes:
    # Half random (stored raw), half repetitive (stored zstd-compressed).
    if i % 2:
        return os.urandom(_CHUNK)
    return (f"chunk {i} ".encode() * (_CHUNK // 8 + 1))[:_CHUNK]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Declare ``chunkd selfcheck``."""
    check = sub.add_parser(
        "selfcheck",
        help="exercise the cache in a directory and print what it did",
        description=(
            "Open (or create) a cache directory, store chunks, read them back from RAM "
            "and from disk, reopen the cache, and check every byte. Exits non-zero on "
            "any failure."
        ),
    )
    check.add_argument(
        "--dir", default="chunkd-cache", help="cache directory (default: %(default)s)"
    )
    check.add_argument(
        "--chunks", type=int, default=16, help="chunks to store (default: %(default)s)"
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``chunkd selfcheck``; returns the exit status."""
    return run_selfcheck(args.dir, args.chunks)
