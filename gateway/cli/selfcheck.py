"""``chunkd selfcheck``: exercise the cache library end to end and say what happened.

It works in a directory of its own: a new temporary one by default, or ``--dir``, which
must be empty (or not exist yet); what it wrote is removed after, either way. It never
opens a cache it did not make: a directory that a daemon holds (its ``LOCK``) is
refused, naming the daemon's pid, and so is any directory that holds a cache, since a
selfcheck evicts to its own small budget and a stopped daemon's cache may hold
checkpoint chunks saved at ``local`` and not uploaded yet. A refusal changes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from chunkd.errors import ChunkdError

if TYPE_CHECKING:
    from chunkd.cache import ChunkId

__all__ = ["add_parser", "run", "run_selfcheck"]

_CHUNK = 4 << 20
# What a cache directory holds (cache/store.py): any of them marks one.
_CACHE_MARKS = ("LOCK", "index", "chunks", "tmp", "checkpoints")


def run_selfcheck(directory: str | None, chunks: int) -> int:
    """Run the self-check in ``directory`` (``None``: a new temporary one), then remove
    what it wrote; 0 when every step passed, 1 when one failed or the directory was
    refused."""
    try:
        if directory is None:
            with tempfile.TemporaryDirectory(prefix="chunkd-selfcheck-") as scratch:
                return asyncio.run(_selfcheck(Path(scratch), chunks, "a temporary directory"))
        root = Path(directory).absolute()
        made = _claim(root)
        try:
            return asyncio.run(_selfcheck(root, chunks, "removed after"))
        finally:
            _clear(root, made)
    except ChunkdError as exc:
        print(f"selfcheck failed: {exc}")
        return 1
    except BrokenPipeError:
        raise  # stdout is gone: nothing to say it on
    except OSError as exc:  # the directory: not readable, not creatable
        print(f"selfcheck failed: {exc.strerror or exc} ({exc.filename or directory})")
        return 1


def _claim(root: Path) -> bool:
    """Check that ``root`` may be the selfcheck's own (missing, or an empty directory
    no process holds); create it if missing and return whether it was.

    Raises:
        ChunkdError: ``root`` is a cache in use, holds a cache, or holds anything.
    """
    from chunkd.cache import lock_holder

    if root.exists() and not root.is_dir():
        raise ChunkdError(f"{root} is not a directory; give --dir an empty directory")
    holder = lock_holder(root) if root.is_dir() else None
    if holder is not None:
        raise ChunkdError(
            f"the cache directory {root} is in use by another chunkd (pid {holder}); a "
            "selfcheck never touches a daemon's cache (it would evict the daemon's chunks "
            "to its own budget). Nothing was changed: run it without --dir (a temporary "
            "directory of its own) or with an empty directory"
        )
    if not root.exists():
        root.mkdir(parents=True)
        return True
    held = sorted(entry.name for entry in root.iterdir())
    if any(name in _CACHE_MARKS for name in held):
        raise ChunkdError(
            f"{root} holds a chunkd cache ({', '.join(held)}); a selfcheck never works in "
            "one: it would evict its chunks to its own budget, and a stopped daemon's "
            "cache may hold checkpoint chunks not uploaded yet. Nothing was changed: run "
            "it without --dir (a temporary directory of its own) or with an empty directory"
        )
    if held:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise ChunkdError(
            f"{root} is not empty ({shown}); a selfcheck works only in an empty directory "
            "of its own, and removes what it wrote after. Nothing was changed"
        )
    return False


def _clear(root: Path, made: bool) -> None:
    """Remove what the selfcheck wrote into ``root`` (``root`` too if it ``made`` it),
    unless another process opened a cache there meanwhile."""
    from chunkd.cache import lock_holder

    if lock_holder(root) is not None:
        print(f"  {root} was opened by another chunkd meanwhile; left as it is")
        return
    if made:
        shutil.rmtree(root, ignore_errors=True)
        return
    for entry in root.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


async def _selfcheck(directory: Path, count: int, kept: str) -> int:
    from chunkd.cache import CacheConfig, ChunkCache, RamLease

    config = CacheConfig(
        dir=directory,
        ram_bytes=max(2, count // 2) * _CHUNK,
        disk_bytes=4 * count * _CHUNK,
        disk_min_free_bytes=64 << 20,
    )
    print(f"chunkd selfcheck in {directory} ({kept})")
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
        help="exercise the cache library in a directory of its own and print what it did",
        description=(
            "Create a cache in a directory of its own, store chunks, read them back from "
            "RAM and from disk, reopen the cache, check every byte, and remove it. Never "
            "touches a daemon's cache: a directory that holds one is refused. Exits "
            "non-zero on any failure or refusal."
        ),
    )
    check.add_argument(
        "--dir",
        default=None,
        help="an empty (or new) directory to check in, on the filesystem to test; "
        "refused if it holds a cache (default: a new temporary directory); what the "
        "selfcheck writes is removed after",
    )
    check.add_argument(
        "--chunks", type=int, default=16, help="chunks to store (default: %(default)s)"
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``chunkd selfcheck``; returns the exit status."""
    return run_selfcheck(args.dir, args.chunks)
