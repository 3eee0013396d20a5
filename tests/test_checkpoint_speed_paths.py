"""The fast paths of a checkpoint save, each checked for the bytes it must keep: chunk
files written with O_DIRECT from a sealed memfd's pages, the staged memfd filled
through a mapping made ready ahead (and what a fork must not do to it), and the
choice of the CUDA path (the CUDA copies themselves run only where a GPU is)."""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import mmap
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from chunkd import memfd
from chunkd.cache import Chunk, ChunkId
from chunkd.cache.disk import DiskTier
from chunkd.cache.index import Index
from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.client.checkpoint import cudastaging, staging
from chunkd.client.checkpoint.staging import SPARE
from chunkd.errors import UnsupportedStateError
from tests.conftest import Daemon

MiB = 1 << 20
PAGE = mmap.PAGESIZE


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Iterator[tuple[Daemon, Client]]:
    """A daemon on the embedded default (a writable file backend 'local'), and a client."""
    daemon = start_daemon(cwd=tmp_path / "node")
    with Client(daemon.cwd / "chunkd.sock") as client:
        yield daemon, client


def _resident_pages(path: Path) -> list[bool]:
    """Which pages of ``path`` are in the page cache now (mincore of a mapping)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vec = (ctypes.c_ubyte * -(-size // PAGE))()
    with path.open("rb") as f:
        # Private and writable only so that ctypes gives its address; nothing is
        # written, so every page mincore sees is the file's own (or none).
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            anchor = ctypes.c_char.from_buffer(m)
            address = ctypes.addressof(anchor)
            del anchor
            assert libc.mincore(ctypes.c_void_p(address), size, vec) == 0, ctypes.get_errno()
        finally:
            m.close()
    return [bool(v & 1) for v in vec]


async def _put_sealed(tier: DiskTier, cid: ChunkId, data: bytes) -> bool:
    """Put ``data`` with a direct write from a sealed memfd's pages, as a save does."""
    fd = memfd.sealed(data)
    mapped = mmap.mmap(fd, len(data), prot=mmap.PROT_READ)
    view = memoryview(mapped)
    try:
        return await tier.put(Chunk.trusted(cid, view), sync=False, compress=False, direct=True)
    finally:
        view.release()
        os.close(fd)
        # The disk tier's worker thread lets go of the chunk a moment after the put
        # returns (its result is set first): the mapping closes once it has.
        for _ in range(200):
            try:
                mapped.close()
                break
            except BufferError:
                await asyncio.sleep(0.01)
        else:
            raise AssertionError("the disk tier kept a view of the chunk's bytes")


def _direct_io_here(path: Path) -> bool:
    probe = path / "probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError:
        return False
    else:
        return True
    finally:
        os.close(fd)
        probe.unlink()


# -- direct writes of chunk files ---------------------------------------------------------


async def test_a_direct_put_writes_the_chunk_without_filling_the_page_cache(
    tmp_path: Path,
) -> None:
    if not _direct_io_here(tmp_path):
        pytest.skip(f"{tmp_path} takes no O_DIRECT")
    tier = DiskTier(tmp_path / "disk", Index(tmp_path / "index"), budget_bytes=1 << 30)
    try:
        # A tail shorter than a block goes buffered; the pages before it go direct.
        data = os.urandom(MiB + 100)
        cid = ChunkId.of(data)
        assert await _put_sealed(tier, cid, data)
        buffered = os.urandom(MiB)
        other = ChunkId.of(buffered)
        assert await tier.put(Chunk.trusted(other, buffered), sync=False, compress=False)

        direct_pages = _resident_pages(tier.path_of(cid))
        buffered_pages = _resident_pages(tier.path_of(other))
        assert all(buffered_pages), "a buffered write leaves its pages cached (the probe works)"
        assert not any(direct_pages[:-1]), "the block-aligned part went around the page cache"
        assert tier.path_of(cid).read_bytes() == data
        lease = await tier.get(cid)
        assert lease is not None
        with lease:
            assert lease.read() == data  # read back and verified against its id
    finally:
        await tier.close()
        tier.index.close()


async def test_a_direct_put_of_bytes_at_an_odd_address_is_written_buffered(
    tmp_path: Path,
) -> None:
    tier = DiskTier(tmp_path / "disk", Index(tmp_path / "index"), budget_bytes=1 << 30)
    try:
        raw = bytearray(2 * MiB + 1)
        raw[1:] = os.urandom(2 * MiB)
        odd = memoryview(raw)[1:]  # O_DIRECT refuses this buffer: EINVAL, nothing written
        cid = ChunkId.of(odd)
        assert await tier.put(Chunk.trusted(cid, odd), sync=False, compress=False, direct=True)
        assert tier.path_of(cid).read_bytes() == bytes(odd)
        assert not any((tier.root / "tmp").iterdir())
    finally:
        await tier.close()
        tier.index.close()


async def test_a_direct_put_on_shared_memory_is_written_either_way(tmp_path: Path) -> None:
    if not os.path.isdir("/dev/shm"):  # noqa: ASYNC240 - one stat, before the test starts
        pytest.skip("no /dev/shm")
    root = Path("/dev/shm") / f"chunkd-test-{os.getpid()}-{time.monotonic_ns()}"
    tier = DiskTier(root / "disk", Index(tmp_path / "index"), budget_bytes=1 << 30)
    try:
        data = os.urandom(MiB)
        cid = ChunkId.of(data)
        assert await _put_sealed(tier, cid, data)
        assert tier.path_of(cid).read_bytes() == data
    finally:
        await tier.close()
        tier.index.close()
        shutil.rmtree(root, ignore_errors=True)


# -- filling a memfd through a mapping ----------------------------------------------------


def test_a_mapped_memfd_is_sealed_only_once_its_mapping_is_gone() -> None:
    fd = memfd.create("test", 3 * PAGE)
    try:
        mapping = memfd.WritableMapping(fd, 3 * PAGE, populate=True)
        data = os.urandom(PAGE + 7)
        source = ctypes.create_string_buffer(data, len(data))
        mapping.copy_in(PAGE - 3, ctypes.addressof(source), len(data))
        with pytest.raises(ValueError, match="outside"):
            mapping.copy_in(2 * PAGE, ctypes.addressof(source), len(data))
        with pytest.raises(OSError, match="Device or resource busy"):
            memfd.seal(fd)  # the kernel refuses F_SEAL_WRITE while a writable mapping exists
        mapping.unmap()
        mapping.unmap()  # once only
        memfd.seal(fd)
        assert os.pread(fd, len(data), PAGE - 3) == data
        assert memfd.sealed_size(fd) == 3 * PAGE
    finally:
        os.close(fd)


def test_a_child_forked_while_a_memfd_is_mapped_does_not_stop_the_seal() -> None:
    fd = memfd.create("test", 4 * PAGE)
    try:
        mapping = memfd.WritableMapping(fd, 4 * PAGE, populate=True)
        pid = os.fork()
        if pid == 0:  # the child holds no mapping of it (MADV_DONTFORK): it only waits
            time.sleep(3)
            os._exit(0)
        try:
            mapping.unmap()
            memfd.seal(fd)  # EBUSY if the child had inherited the writable mapping
        finally:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    finally:
        os.close(fd)


# -- staging through a real daemon --------------------------------------------------------


def _state(seed: int, scale: int = 1) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(64, 1024 * scale, generator=gen)
    return {
        "w": torch.randn(512, 1024 * scale, generator=gen).to(torch.bfloat16),
        "t": wide.t(),  # not contiguous: made contiguous on the way
        "c": torch.randn(300, 300, dtype=torch.complex64, generator=gen).conj(),
        "small": [torch.arange(i + 1) for i in range(20)],
        "n": np.random.default_rng(seed).standard_normal(70_000 * scale),
        "empty": torch.empty(0, 3),
        "step": seed,
    }


def _same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        assert torch.equal(a.resolve_conj(), b.resolve_conj())
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


def _wait_for_spare(size: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (ready := SPARE.ready()) is None or ready[0] < size:
        assert time.monotonic() < deadline, f"no spare of {size} bytes was made ready"
        time.sleep(0.02)


def test_saves_through_the_prepared_spare_restore_every_byte(
    node: tuple[Daemon, Client],
) -> None:
    _, client = node
    assert SPARE.enabled
    first = _state(1)
    ckpt.save(first, "local/spare/a", durability="local", client=client)
    staged = sum(t.nbytes for t in (first["w"], first["t"], first["c"])) + first["n"].nbytes
    _wait_for_spare(staged)
    second = _state(2)  # the same layout: staged into the spare, through its mapping
    ckpt.async_save(second, "local/spare/b", durability="local", client=client).wait()
    bigger = _state(3, scale=2)  # outgrew the spare: a new memfd, written with pwrite
    ckpt.save(bigger, "local/spare/c", durability="local", client=client)
    for name, state in (("a", first), ("b", second), ("c", bigger)):
        _same(ckpt.load(f"local/spare/{name}", client=client), state)


def test_a_save_after_a_fork_stages_and_seals(node: tuple[Daemon, Client]) -> None:
    _, client = node
    state = _state(4)
    ckpt.save(state, "local/fork/a", durability="local", client=client)
    _wait_for_spare(state["w"].nbytes)
    pid = os.fork()
    if pid == 0:  # a DataLoader worker, say: alive while its parent saves
        time.sleep(5)
        os._exit(0)
    try:
        state["w"].add_(1)
        ckpt.save(state, "local/fork/b", durability="local", client=client)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    _same(ckpt.load("local/fork/b", client=client), state)


def test_tensors_may_change_as_soon_as_async_save_returns(node: tuple[Daemon, Client]) -> None:
    _, client = node
    state = _state(5)
    ckpt.save(state, "local/change/warm", durability="local", client=client)
    _wait_for_spare(state["w"].nbytes)
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    expected["n"] = state["n"].copy()
    handle = ckpt.async_save(state, "local/change/b", durability="local", client=client)
    state["w"].zero_()
    state["n"][:] = 0
    handle.wait()
    loaded = ckpt.load("local/change/b", client=client)
    _same(loaded["w"], expected["w"])
    _same(loaded["n"], expected["n"])


# -- the CUDA path: chosen only for CUDA tensors -----------------------------------------


def test_cpu_state_takes_the_host_path_and_never_starts_cuda(
    node: tuple[Daemon, Client],
) -> None:
    _, client = node
    state = _state(6)
    assert not any(cudastaging.is_cuda(v) for v in (state["w"], state["t"], state["n"], 3))
    started = torch.cuda.is_initialized()  # another test may have started it
    ckpt.save(state, "local/host/a", durability="local", client=client)
    assert torch.cuda.is_initialized() == started


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a process without CUDA")
def test_a_cuda_tensor_without_cuda_fails_naming_its_key() -> None:
    with pytest.raises(UnsupportedStateError, match=r"model\.w is a tensor on cuda:0.*no CUDA"):
        cudastaging.check_cuda(torch.device("cuda", 0), "model.w")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_copied_straight_into_the_staged_memfd(
    node: tuple[Daemon, Client],
) -> None:
    _, client = node
    cpu = _state(7)
    cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in cpu.items()}
    cuda["t"] = cpu["t"].t().contiguous().cuda().t()  # a non-contiguous device view
    cuda["small"] = [t.cuda() for t in cpu["small"]]
    cuda["host"] = cpu["w"]  # host and device values in one state
    handle = ckpt.async_save(cuda, "local/cuda/a", durability="local", client=client)
    cuda["w"].zero_()  # the copies were done when async_save returned
    handle.wait()
    _same(ckpt.load("local/cuda/a", client=client), cpu | {"host": cpu["w"]})
    _wait_for_spare(cpu["w"].nbytes)
    ready = SPARE.ready()
    assert ready is not None
    assert ready[1], "after a CUDA save the spare is registered ahead"
    cuda["w"].copy_(cpu["w"].cuda())
    ckpt.save(cuda, "local/cuda/b", durability="local", client=client)
    _same(ckpt.load("local/cuda/b", client=client), cpu | {"host": cpu["w"]})


def test_a_spare_far_larger_than_a_save_stays_for_a_save_of_its_size() -> None:
    # Taking it would make the trainer unmap and free the surplus on its blocking path.
    spare = staging._Spare()
    spare.prepare(256 << 20)
    deadline = time.monotonic() + 60
    while spare.ready() is None:
        assert time.monotonic() < deadline, "no spare was made"
        time.sleep(0.01)
    assert spare.take(0) is None
    assert spare.take(1 << 20) is None  # 1 MiB: 255 MiB would be unmapped for it
    assert spare.ready() is not None
    taken = spare.take(200 << 20)  # within twice the size plus the slack
    assert taken is not None
    assert taken.size == 256 << 20
    assert spare.ready() is None
    taken.close()
