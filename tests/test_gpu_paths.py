"""The GPU load path, tested where there is no GPU.

The staging ring's ordering and reuse run with :class:`ThreadLink`, the CPU stand-in
for a device's copy stream (one thread running the copies in order, late on purpose);
``load_into`` and ``load`` go through the same ring when given that link; read_into
fills a CPU tensor's own memory (a pinned tensor is one of those, but pinning needs
CUDA: here the tensors are plain); the GPU bench rehearses on the CPU; a CUDA
``map_location`` without CUDA fails before anything is read.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkd import memfd
from chunkd.client import AsyncClient, Client
from chunkd.client import checkpoint as ckpt
from chunkd.client.checkpoint.device import (
    STAGING_BUFFER_BYTES,
    STAGING_BUFFERS,
    DeviceLink,
    DeviceRead,
    Fence,
    StagingRing,
    ThreadLink,
    check_location,
    device_bytes,
    pack,
)
from chunkd.client.views import byte_target, tensor_bytes
from chunkd.errors import CheckpointError, CheckpointNotFoundError
from tests.conftest import Daemon

torch = pytest.importorskip("torch")

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Iterator[tuple[Daemon, Client]]:
    """A daemon on the embedded default (a writable file backend 'local'), and a client."""
    daemon = start_daemon(cwd=tmp_path / "node")
    with Client(daemon.cwd / "chunkd.sock") as client:
        yield daemon, client


def raw(tensor: Any) -> bytes:
    return bytes(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


# -- the staging ring ---------------------------------------------------------------------


@pytest.fixture
def chunks() -> Iterator[tuple[list[int], list[bytes]]]:
    """Twelve sealed memfds of 96 KiB of distinct random bytes, as the daemon sends."""
    payloads = [os.urandom(96 * 1024) for _ in range(12)]
    fds = [memfd.sealed(p) for p in payloads]
    yield fds, payloads
    memfd.close_all(fds)


def test_a_buffer_is_refilled_only_after_its_copies_ran(
    chunks: tuple[list[int], list[bytes]],
) -> None:
    # A slow "device": each batch of copies runs 20 ms after it was sent, while four
    # threads read as fast as they can. A buffer filled again before its copies ran
    # would send the next job's bytes: the destination shows it.
    fds, payloads = chunks
    link = ThreadLink(delay=0.02)
    ring = StagingRing(link, count=2, nbytes=128 * 1024)
    dest = torch.zeros(sum(len(p) for p in payloads), dtype=torch.uint8)
    reads, at = [], 0
    for fd, payload in zip(fds, payloads, strict=True):
        reads.append(DeviceRead(fd, 0, len(payload), dest, at))
        at += len(payload)
    jobs = pack(reads, ring.nbytes)
    link.begin([dest.device])
    try:
        with ThreadPoolExecutor(4) as pool:
            for _ in pool.map(ring.stage, jobs):
                pass
    finally:
        link.finish()
    assert raw(dest) == b"".join(payloads)
    assert ring.made == link.buffers == 2  # reused, never more than the ring holds
    assert link.batches == len(jobs) > 2 * ring.count


class Gate:
    """A fence that passes once opened; records who waited on it."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1
        self.opened.wait(10)


def test_the_ring_reuses_the_buffer_given_back_first_and_waits_for_its_fence() -> None:
    ring = StagingRing(ThreadLink(), count=2, nbytes=4096)
    first, second = ring.acquire(), ring.acquire()
    assert (first.number, second.number) == (0, 1)
    gates = Gate(), Gate()
    ring.release(second, gates[1])
    ring.release(first, gates[0])
    got: list[Any] = []
    taker = threading.Thread(target=lambda: got.append(ring.acquire()))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive()  # its buffer's copies have not finished
    assert gates[1].waits == 1
    gates[1].opened.set()
    taker.join(5)
    assert got == [second]  # given back first, out first
    # All buffers out: the next taker waits for a release, not for a new buffer.
    third: list[Any] = []
    blocked = threading.Thread(target=lambda: third.append(ring.acquire()))
    gates[0].opened.set()
    assert ring.acquire() is first
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive()
    ring.release(first, None)
    blocked.join(5)
    assert third == [first]
    assert ring.made == 2


class Recorder(DeviceLink):
    """A link that copies at once and records each batch it was sent."""

    def __init__(self) -> None:
        self.sent: list[list[tuple[int, int, Any, int]]] = []

    def begin(self, devices: Any) -> None:
        pass

    def host_buffer(self, nbytes: int) -> Any:
        return torch.empty(nbytes, dtype=torch.uint8)

    def send(self, buffer: Any, copies: list[tuple[int, int, Any, int]]) -> Fence:
        self.sent.append(copies)
        for start, stop, dest, at in copies:
            dest[at : at + stop - start].copy_(buffer[start:stop])
        return Gate()

    def finish(self) -> None:
        pass


def test_pieces_that_continue_one_another_go_as_one_copy(
    chunks: tuple[list[int], list[bytes]],
) -> None:
    fds, payloads = chunks
    link = Recorder()
    ring = StagingRing(link, count=1, nbytes=1 << 20)
    one, other = torch.zeros(150_000, dtype=torch.uint8), torch.zeros(100, dtype=torch.uint8)
    ring.stage(
        [
            DeviceRead(fds[0], 0, 96 * 1024, one, 0),
            DeviceRead(fds[1], 0, 150_000 - 96 * 1024, one, 96 * 1024),  # continues it
            DeviceRead(fds[2], 10, 110, other, 0),  # another destination
        ]
    )
    assert [(c[0], c[1], c[3]) for c in link.sent[0]] == [(0, 150_000, 0), (150_000, 150_100, 0)]
    assert raw(one) == payloads[0] + payloads[1][: 150_000 - 96 * 1024]
    assert raw(other) == payloads[2][10:110]


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=12),
    nbytes=st.integers(1, 4096),
)
def test_pack_splits_reads_into_jobs_of_the_buffer_size_in_order(
    lengths: list[int], nbytes: int
) -> None:
    dest = object()
    reads, at = [], 0
    for i, n in enumerate(lengths):
        reads.append(DeviceRead(i, 7, 7 + n, dest, at))
        at += n
    jobs = pack(reads, nbytes)
    assert all(0 < sum(r.stop - r.start for r in job) <= nbytes for job in jobs)
    assert all(sum(r.stop - r.start for r in job) == nbytes for job in jobs[:-1])
    flat = [r for job in jobs for r in job]
    covered = [(r.fd, b, r.at + b - r.start) for r in flat for b in range(r.start, r.stop)]
    assert covered == [(r.fd, b, r.at + b - r.start) for r in reads for b in range(r.start, r.stop)]


def test_a_failed_copy_fails_the_load_after_the_other_copies_finished(
    chunks: tuple[list[int], list[bytes]],
) -> None:
    fds, payloads = chunks
    link = ThreadLink(delay=0.005)
    ring = StagingRing(link, count=2, nbytes=128 * 1024)
    dest = torch.zeros(len(payloads[0]), dtype=torch.uint8)
    wrong = torch.zeros(10, dtype=torch.uint8)  # too small: its copy raises
    link.begin([dest.device])
    with ThreadPoolExecutor(2) as pool:
        for _ in pool.map(
            ring.stage,
            [[DeviceRead(fds[0], 0, 1000, wrong, 0)], [DeviceRead(fds[1], 0, 96 * 1024, dest, 0)]],
        ):
            pass
    with pytest.raises(RuntimeError):
        link.finish()
    # The stand-in stream stopped, and a new load starts it again.
    link.begin([dest.device])
    ring.stage([DeviceRead(fds[2], 0, 96 * 1024, dest, 0)])
    link.finish()
    assert raw(dest) == payloads[2]


def test_device_bytes_is_the_tensors_own_memory_or_none() -> None:
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    flat = device_bytes(tensor)
    assert flat is not None
    assert flat.data_ptr() == tensor.data_ptr()
    assert flat.numel() == 48
    assert device_bytes(tensor.t()) is None  # strided
    assert device_bytes(torch.randn(3, dtype=torch.complex64).conj()) is None
    assert device_bytes(tensor[1:]).data_ptr() == tensor[1:].data_ptr()


# -- loading through the ring -------------------------------------------------------------


def state() -> dict[str, Any]:
    """Values that cross chunks and staging buffers, views, tied weights, arrays."""
    import numpy as np

    gen = torch.Generator().manual_seed(5)
    big = torch.randn(5 * MiB // 4 + 333, generator=gen)  # over a 4 MiB chunk, odd length
    emb = torch.randn(1024, 1024, generator=gen).to(torch.bfloat16)
    return {
        "big": big,
        "huge": torch.randn(3 * STAGING_BUFFER_BYTES // 8, generator=gen, dtype=torch.float64),
        "emb": emb,
        "head": emb,  # tied
        "small": [torch.arange(i + 1, dtype=torch.int16) for i in range(40)],
        "flags": torch.rand(1000, generator=gen) > 0.5,
        "c": torch.randn(77, generator=gen, dtype=torch.complex64),
        "grid": torch.randn(64, 48, generator=gen),
        "array": np.arange(5000, dtype=np.float32),
        "step": 7,
    }


def test_load_into_through_the_ring_restores_every_byte(node: tuple[Daemon, Client]) -> None:
    _, client = node
    saved = state()
    ckpt.save(saved, "local/ring/a", client=client)
    target = {
        k: v.clone() if isinstance(v, torch.Tensor) else v
        for k, v in state().items()
        if k not in ("small", "array", "step")
    }
    for key in ("big", "huge", "emb", "c", "grid", "flags"):
        target[key].view(-1).view(torch.uint8).fill_(0xA5)  # poison: unwritten bytes show
    target["head"] = target["emb"]
    target["small"] = [torch.full((i + 1,), -1, dtype=torch.int16) for i in range(40)]
    grid_t = torch.full((48, 64), 3.0)
    target["grid"] = grid_t.t()  # a strided view: filled beside, copied over
    target["array"], target["step"] = saved["array"].copy() * 0, 0
    link = ThreadLink(delay=0.002)
    ckpt.load_into(target, "local/ring/a", client=client, _link=link)
    for key in ("big", "huge", "emb", "c", "grid", "flags"):
        assert raw(target[key]) == raw(saved[key]), key
    assert target["head"] is target["emb"]
    assert [raw(t) for t in target["small"]] == [raw(t) for t in saved["small"]]
    assert target["grid"].data_ptr() == grid_t.data_ptr()
    assert (target["array"] == saved["array"]).all()
    assert target["step"] == 7
    assert 0 < link.buffers <= STAGING_BUFFERS
    assert link.batches >= 3  # 'huge' alone fills three staging buffers

    loaded = ckpt.load("local/ring/a", client=client, _link=ThreadLink())
    for key in ("big", "huge", "emb", "c", "grid", "flags"):
        assert raw(loaded[key]) == raw(saved[key]), key
    assert loaded["head"] is loaded["emb"]


def test_load_into_cpu_tensors_without_a_link_reads_straight_into_them(
    node: tuple[Daemon, Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CPU fast path stays: no ring, no link, not even for a CUDA-less process.
    _, client = node
    saved = state()
    ckpt.save(saved, "local/ring/b", client=client)

    def no_ring(*_: Any, **__: Any) -> None:
        raise AssertionError("a CPU load made a staging ring")

    monkeypatch.setattr("chunkd.client.checkpoint.reader.StagingRing", no_ring)
    target = {"big": torch.zeros_like(saved["big"]), "emb": torch.zeros_like(saved["emb"])}
    before = target["big"].data_ptr()
    ckpt.load_into(target, "local/ring/b", client=client, strict=False)
    assert raw(target["big"]) == raw(saved["big"])
    assert target["big"].data_ptr() == before


@no_cuda
@pytest.mark.parametrize("where", ["cuda", "cuda:0", "cuda:3"])
def test_a_cuda_map_location_without_cuda_fails_before_anything_is_read(where: str) -> None:
    # The name does not exist: the CUDA check comes first, before any request.
    with pytest.raises(CheckpointError, match=r"sees no CUDA device.*map_location='cpu'"):
        ckpt.load("local/no/such/checkpoint", map_location=where)
    with pytest.raises(CheckpointError, match="sees no CUDA device"):
        check_location(torch.device(where), "x")


def test_a_map_location_that_is_no_device_is_refused_clearly() -> None:
    with pytest.raises(CheckpointError, match=r"map_location='gpu0' is not a device"):
        ckpt.load("local/x", map_location="gpu0")
    assert check_location("cpu", "x") == torch.device("cpu")


@no_cuda
def test_a_cpu_map_location_is_not_refused(node: tuple[Daemon, Client]) -> None:
    _, client = node
    with pytest.raises(CheckpointNotFoundError):
        ckpt.load("local/no/such", map_location=torch.device("cpu"), client=client)


# -- read_into a tensor -------------------------------------------------------------------


def test_byte_target_of_a_tensor_is_its_own_memory() -> None:
    tensor = torch.zeros(1000, dtype=torch.float32)
    view = byte_target(tensor)
    assert view.nbytes == 4000
    assert not view.readonly
    assert ctypes.addressof(ctypes.c_char.from_buffer(view)) == tensor.data_ptr()
    view[:4] = b"\x00\x00\x80\x3f"
    assert tensor[0].item() == 1.0
    part = tensor[10:20]
    assert ctypes.addressof(ctypes.c_char.from_buffer(tensor_bytes(part))) == part.data_ptr()
    assert byte_target(torch.empty(0)).nbytes == 0


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (torch.zeros(4, 4).t(), "contiguous"),
        (torch.zeros(4, device="meta"), "host memory"),
        (torch.randn(4, dtype=torch.complex64).conj(), "conjugated"),
        (torch.zeros(4, 4).to_sparse(), "strided"),
    ],
)
def test_read_into_refuses_a_tensor_it_cannot_fill_in_order(bad: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        byte_target(bad)


@pytest.fixture
def blob(node: tuple[Daemon, Client]) -> tuple[Client, bytes]:
    daemon, client = node
    data = os.urandom(40 * MiB + 12345)  # 11 chunks: over the threaded copy's threshold
    folder = daemon.cwd / "chunkd-data"
    folder.mkdir(exist_ok=True)
    (folder / "blob.bin").write_bytes(data)
    return client, data


def test_read_into_a_tensor_fills_it_in_place(
    blob: tuple[Client, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, data = blob
    monkeypatch.setattr("chunkd.client.views._copy_threads", lambda: 4)  # the threaded copy
    tensor = torch.empty(len(data) // 4, dtype=torch.int32)  # a pinned tensor is such a one
    address = tensor.data_ptr()
    assert client.read_into("local/blob.bin", tensor) == tensor.numel() * 4
    assert tensor.data_ptr() == address
    assert raw(tensor) == data[: tensor.numel() * 4]
    # From an offset, into part of a tensor; the object ends first.
    small = torch.zeros(3000, dtype=torch.uint8)
    assert client.read_into("local/blob.bin", small[1000:], len(data) - 1500) == 1500
    assert raw(small[:1000]) == bytes(1000)
    assert raw(small[1000:2500]) == data[-1500:]


def test_read_into_copies_from_a_mapping_or_a_memfd_alike(blob: tuple[Client, bytes]) -> None:
    client, data = blob
    tensor = torch.empty(len(data), dtype=torch.uint8)
    client.read_into("local/blob.bin", tensor)  # chunks not mapped: preadv
    assert raw(tensor) == data
    view = client.read("local/blob.bin", 10, 1000)  # maps the first chunk
    chunks = client._reader.chunks._entries.values()
    assert sum(chunk._whole is not None for chunk in chunks) == 1
    tensor.zero_()
    assert client.read_into("local/blob.bin", tensor) == len(data)  # a mapping, then preadv
    assert raw(tensor) == data
    del view


async def test_async_read_into_a_tensor(blob: tuple[Client, bytes]) -> None:
    client, data = blob
    async with AsyncClient(client.socket_path) as aclient:
        tensor = torch.empty(5 * MiB, dtype=torch.uint8)
        assert await aclient.read_into("local/blob.bin", tensor, 100) == 5 * MiB
    assert raw(tensor) == data[100 : 100 + 5 * MiB]


# -- the GPU bench ------------------------------------------------------------------------


def bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu_bench", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )


@pytest.mark.slow
def test_the_gpu_bench_rehearses_on_the_cpu(tmp_path: Path) -> None:
    started = time.monotonic()
    done = bench(tmp_path, "--dry-run", "--out", str(tmp_path / "out"), "--work", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "gpu_bench.json").read_text())
    assert doc["dry_run"] is True
    assert doc["failures"] == []
    keys = {row["key"] for row in doc["rows"]}
    assert {
        "h2d_limit",
        "load_into_cuda",
        "load_into_cuda_fraction",
        "load_into_cuda_vs_dcp",
        "load_into_host",
        "read_into_pinned",
        "async_save_cuda",
        "memfd_to_pinned",
    } <= keys
    assert all(row["value"] > 0 for row in doc["rows"])
    assert len(doc["checks"]) >= 10
    table = (tmp_path / "out" / "gpu_bench.md").read_text()
    assert "| load_into CPU (ring, stand-in) tensors" in table
    assert not list(tmp_path.glob("chunkd-gpu-bench-*"))  # its scratch is gone
    assert time.monotonic() - started < 100


@no_cuda
def test_the_gpu_bench_without_cuda_says_so_and_fails(tmp_path: Path) -> None:
    done = bench(tmp_path, "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "CUDA is not available here" in done.stderr
    assert "--dry-run" in done.stderr
    assert not (tmp_path / "out").exists()
