"""The GPU load path on a GPU node (issue 16), measured in one short run.

::

    python -m bench.gpu_bench --out DIR            # on a machine with CUDA (a few minutes)
    python -m bench.gpu_bench --dry-run --out DIR  # anywhere: tiny sizes, the CPU stands in
    python -m bench.gpu_bench --fetch-wheels       # here, before a device run (see below)

It starts its own ``chunkd serve`` (the embedded default: a ``file://`` backend under a
scratch directory) from this tree, uninstalled, and measures, each the median of
``--rounds`` timed runs after an untimed warm-up:

1. **the pinned host-to-device limit**: one large copy from a pinned tensor to the
   GPU (``cudaMemcpyAsync``, timed with CUDA events), and the same in pieces of the
   staging buffer's size, and from pageable memory;
2. **``checkpoint.load_into`` CUDA tensors** from the warm daemon (GB/s, and the
   fraction of 1.), and ``checkpoint.load(map_location="cuda")``;
3. **``torch.load(map_location="cuda")``** of the same state from a page-cached file;
4. **DCP load onto the GPU**: ``FileSystemReader`` from page-cached files, and
   ``ChunkdStorageReader``, into the same CUDA tensors;
5. ``load_into`` CPU tensors: the host path alone, the rate out of the memfds here;
6. **``Client.read_into`` a pinned tensor** (a warm 1 GiB object), against
   ``readinto`` of the page-cached file, and on to the GPU;
7. **``checkpoint.async_save`` from CUDA tensors** (the time the trainer is blocked)
   against ``torch.save`` of the same CUDA tensors to a local file;
8. what would close the gap from the memfds' rate to the link's: ``preadv`` from
   sealed memfds into a pinned buffer on 1 to 16 threads; the same out of a tmpfs
   with huge pages (mounted for the run, when root may); the memfds mapped and
   registered with ``cudaHostRegister`` and copied to the GPU with no staging copy.

Every load is checked bit for bit against the saved state; a mismatch, or a step
that fails, makes the exit status 1 (the other steps still run). Without CUDA (and
without ``--dry-run``) it exits with status 2 at once, saying so. Results go to
``DIR/gpu_bench.json`` and ``DIR/gpu_bench.md``, rewritten after every row, so a run
cut short still leaves what it measured.

On the device machine of this workplace (``python3`` 3.12 with torch, aiohttp,
uvloop, numpy, prometheus-client; without blake3, lmdb, obstore, zstandard), carry
those four as wheels: ``--fetch-wheels`` writes them to ``.whl/`` (ignored by git
through ``.git/info/exclude``), then the device command is::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \\
        --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
    PYTHONUNBUFFERED=1 python3 -m bench.gpu_bench --out $OUT

with ``.whl`` carried. The script puts this tree's ``src/`` on the path itself.

It is one job at ~1,100 lines: one run on a GPU node of the load and save paths onto the
device, each against its baseline on the same state, that must stand alone there (this
tree uninstalled, a few carried wheels, its own results written after every row, a
watchdog), so it does not go through :mod:`bench.report`; the model state is
:mod:`bench.ckpt_bench`'s and the daemon the kit's launcher
(:class:`~chunkd.testing.daemon.DaemonProcess`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import importlib.util
import json
import mmap
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
_SRC = _ROOT / "src"
if importlib.util.find_spec("chunkd") is None:  # the device runs this tree uninstalled
    sys.path.insert(0, str(_SRC))

from bench.ckpt_bench import ModelShape, model_state, tensors  # noqa: E402
from chunkd import memfd  # noqa: E402
from chunkd.client import Client, checkpoint  # noqa: E402
from chunkd.client.checkpoint.device import (  # noqa: E402
    STAGING_BUFFER_BYTES,
    STAGING_BUFFERS,
    ThreadLink,
)
from chunkd.client.views import tensor_bytes  # noqa: E402
from chunkd.testing.daemon import DaemonProcess  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
#: the packages the device machine lacks, carried as wheels (cp312, manylinux x86-64)
WHEELS = ("blake3", "lmdb", "obstore", "zstandard")
#: one byte in every this many of each tensor changes between saves (every chunk new)
_PERTURB_STRIDE = 64 * 1024
_CHUNK = 4 * MiB


# -- results -----------------------------------------------------------------------------


@dataclass
class Row:
    """One measured figure, with what it is compared against."""

    key: str
    scenario: str
    value: float
    unit: str
    baseline: float | None = None
    baseline_name: str = ""
    #: ">= 5x" (value / baseline) or ">= 0.8" (value itself); empty: no goal
    goal: str = ""
    note: str = ""

    @property
    def ratio(self) -> float | None:
        return self.value / self.baseline if self.baseline else None

    @property
    def verdict(self) -> str:
        """'met'; or in words the figure, against what, the goal and by how much it was
        missed; '' without a goal."""
        if not self.goal:
            return ""
        wanted = float(self.goal.split()[1].rstrip("x"))
        on_ratio = self.goal.endswith("x")
        got = self.ratio if on_ratio else self.value
        if got is not None and got >= wanted:
            return "met"
        if got is None:
            return f"missed: no baseline to compare with, goal {self.goal}"
        figure = f"{got:.2f}x against {self.baseline_name}" if on_ratio else f"{got:.3g}"
        if got <= 0:
            by = "missed: measured 0"
        elif wanted / got >= 1.5:
            by = f"missed by {wanted / got:.1f}x"
        else:
            by = f"missed by {(1 - got / wanted) * 100:.0f}%"
        return f"{figure}, goal {self.goal} ({by})"


@dataclass
class Results:
    """Everything a run found; written out after every row."""

    out: Path
    dry_run: bool
    machine: dict[str, Any] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    checks: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        ratio = f"{row.ratio:6.2f}x" if row.ratio is not None else " " * 7
        base = f"{row.baseline:>9.3f}" if row.baseline is not None else " " * 9
        print(
            f"  {row.scenario:<58} {row.value:>9.3f} vs {base} {row.unit:<6} {ratio} "
            f"{row.goal:<7} {row.verdict}",
            flush=True,
        )
        self.write()

    def check(self, ok: bool, what: str) -> None:
        (self.checks if ok else self.failures).append(what)
        print(f"  check {'ok' if ok else 'FAILED'}: {what}", flush=True)
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        doc = {
            "dry_run": self.dry_run,
            "started": self.started,
            "seconds": round(time.time() - self.started, 1),
            "machine": self.machine,
            "rows": [asdict(r) | {"ratio": r.ratio, "verdict": r.verdict} for r in self.rows],
            "raw": self.raw,
            "checks": self.checks,
            "failures": self.failures,
        }
        (self.out / "gpu_bench.json").write_text(json.dumps(doc, indent=2) + "\n")
        (self.out / "gpu_bench.md").write_text(self.markdown())

    def markdown(self) -> str:
        m = self.machine
        lines = [
            "# chunkd GPU load path" + (" (dry run: the CPU stands in for the GPU)" * self.dry_run),
            "",
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(self.started))}; "
            f"{m.get('gpu', 'no GPU')}; {m.get('cpus')} CPUs; Python {m.get('python')}; "
            f"torch {m.get('torch')} (CUDA {m.get('cuda')}); Linux {m.get('kernel')}; "
            f"shmem huge pages: {m.get('shmem_enabled')}; state {m.get('state_gib', 0):.2f} GiB.",
            "",
            "| scenario | chunkd | baseline | unit | ratio | goal | verdict | note |",
            "| --- | ---: | ---: | --- | ---: | --- | --- | --- |",
        ]
        for r in self.rows:
            base = f"{r.baseline:.3f} ({r.baseline_name})" if r.baseline is not None else ""
            ratio = f"{r.ratio:.2f}x" if r.ratio is not None else ""
            lines.append(
                f"| {r.scenario} | {r.value:.3f} | {base} | {r.unit} | {ratio} | {r.goal} "
                f"| {r.verdict} | {r.note} |"
            )
        if self.raw:
            lines += ["", "Raw measurements:", "", "```", json.dumps(self.raw, indent=1), "```"]
        lines += ["", f"Checks passed: {len(self.checks)}; failed: {len(self.failures)}."]
        lines += [f"- FAILED: {f}" for f in self.failures]
        return "\n".join(lines) + "\n"


# -- the daemon --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalDaemon:
    """``python -m chunkd serve`` from this tree in ``work``, on the embedded default."""

    def __init__(self, work: Path, ram_bytes: int, disk_bytes: int) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.work = work
        self.port = _free_port()
        paths = [str(_SRC), *filter(None, [os.environ.get("PYTHONPATH")])]
        self.log_path = work / "daemon.log"
        self._daemon = DaemonProcess(
            cwd=work,
            program=(sys.executable, "-m", "chunkd"),
            env={
                "CHUNKD_CACHE_RAM_BYTES": str(ram_bytes),
                "CHUNKD_CACHE_DISK_BYTES": str(disk_bytes),
                "CHUNKD_CACHE_DISK_MIN_FREE_BYTES": "0",
                "CHUNKD_CACHE_FSYNC": "never",
                "PYTHONPATH": os.pathsep.join(paths),
            },
            listen=f"127.0.0.1:{self.port}",
            socket=self.socket,
            log=self.log_path,
        )
        self.process = self._daemon.process
        self._daemon.wait_ready(60.0)

    @functools.cached_property
    def socket(self) -> Path:
        """The local socket, in a short directory of its own: a socket's path is at most
        107 bytes, which a deep ``work`` (a test's temporary directory) can pass."""
        return Path(tempfile.mkdtemp(prefix="chunkd-gpu-")) / "chunkd.sock"

    @property
    def data(self) -> Path:
        """The directory of the ``local`` backend."""
        return self.work / "chunkd-data"

    def stop(self) -> None:
        self._daemon.stop(timeout=30)
        shutil.rmtree(self.socket.parent, ignore_errors=True)


# -- the state ---------------------------------------------------------------------------


def like(state: Any, device: Any) -> Any:
    """The same structure with new, poisoned tensors on ``device`` (a load target)."""
    import torch

    if isinstance(state, torch.Tensor):
        target = torch.empty_like(state, device=device)
        target.view(-1).view(torch.uint8).fill_(0xA5)  # never zeros: unwritten bytes show
        return target
    if isinstance(state, dict):
        return {k: like(v, device) for k, v in state.items()}
    if isinstance(state, list):
        return [like(v, device) for v in state]
    if isinstance(state, tuple):
        return tuple(like(v, device) for v in state)
    return state


def same(a: Any, b: Any) -> bool:
    """Whether the tensors of ``a`` and ``b`` hold the same bytes (on any devices)."""
    import torch

    pairs = list(zip(tensors(a), tensors(b), strict=True))
    return all(
        x.shape == y.shape
        and x.dtype == y.dtype
        and torch.equal(
            x.reshape(-1).view(torch.uint8), y.to(x.device).reshape(-1).view(torch.uint8)
        )
        for x, y in pairs
    )


def _raw(tensor: Any) -> Any:
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def perturb(state: Any) -> None:
    """A new step: one byte in every 64 KiB of every tensor changes."""
    import torch

    for tensor in tensors(state):
        tensor.reshape(-1).view(torch.uint8)[::_PERTURB_STRIDE].add_(1)


def nbytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(state))


# -- timing ------------------------------------------------------------------------------


class Bench:
    """The run: the device, the daemon, a client, the state and the results."""

    def __init__(self, args: argparse.Namespace, torch: Any, results: Results) -> None:
        self.args = args
        self.torch = torch
        self.results = results
        self.dry = bool(args.dry_run)
        self.device = torch.device("cpu" if self.dry else "cuda")
        self.rounds = args.rounds
        self.work = Path(tempfile.mkdtemp(prefix="chunkd-gpu-bench-", dir=args.work))
        self.daemon: LocalDaemon | None = None
        self.client: Client | None = None
        self.state: dict[str, Any] = {}
        self.size = 0
        self.name = ""
        self.limit = 0.0

    # Every load onto the device is complete when it returns; a copy queued on the
    # current stream (torch.load's, DCP's) is waited for before the clock stops.
    def sync(self) -> None:
        if not self.dry:
            self.torch.cuda.synchronize()

    def timed(self, run: Callable[[], Any], rounds: int | None = None) -> float:
        """Median seconds of ``rounds`` runs of ``run``, after one untimed warm-up."""
        run()
        self.sync()
        took = []
        for _ in range(rounds or self.rounds):
            self.sync()
            start = time.perf_counter()
            run()
            self.sync()
            took.append(time.perf_counter() - start)
        return statistics.median(took)

    def step(self, name: str, run: Callable[[], None]) -> None:
        """Run one scenario; a failure is recorded, and the next one runs."""
        print(f"gpu_bench: {name}", flush=True)
        start = time.perf_counter()
        try:
            run()
        except Exception as exc:  # every step reports; the exit status says it failed
            self.results.check(False, f"{name} raised {type(exc).__name__}: {exc}")
        print(f"gpu_bench: {name} took {time.perf_counter() - start:.1f} s", flush=True)

    # -- setting up ----------------------------------------------------------------------

    def start(self) -> None:
        shape = ModelShape(vocab=self.args.vocab, dim=self.args.dim, layers=self.args.layers)
        self.state = model_state(shape, 1)
        self.size = nbytes(self.state)
        self.results.machine["state_gib"] = self.size / GiB
        ram = 4 * self.size + 2 * GiB  # the staged save, its cached chunks, the object
        self.daemon = LocalDaemon(self.work / "daemon", ram, 4 * self.size + 4 * GiB)
        self.client = Client(self.daemon.socket, timeout=300)
        self.name = f"local/gpu-bench/load-{uuid.uuid4().hex[:8]}"
        checkpoint.save(self.state, self.name, client=self.client)

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.daemon is not None:
            self.daemon.stop()
        shutil.rmtree(self.work, ignore_errors=True)

    # -- 1. the link -------------------------------------------------------------------

    def h2d_limit(self) -> None:
        torch = self.torch
        size = self.args.h2d_mib * MiB
        host = torch.empty(size, dtype=torch.uint8, pin_memory=not self.dry)
        host.random_(0, 256)
        pageable = torch.empty(size, dtype=torch.uint8)
        pageable.copy_(host)
        dev = torch.empty(size, dtype=torch.uint8, device=self.device)
        piece = STAGING_BUFFER_BYTES

        def whole() -> None:
            dev.copy_(host, non_blocking=True)

        def pieces() -> None:
            for at in range(0, size, piece):
                dev[at : at + piece].copy_(host[at : at + piece], non_blocking=True)

        def from_pageable() -> None:
            dev.copy_(pageable, non_blocking=True)

        rounds = max(self.rounds, 5)
        whole_s = self._device_time(whole, rounds)
        self.limit = size / whole_s / 1e9
        pieces_s = self._device_time(pieces, rounds)
        pageable_s = self._device_time(from_pageable, rounds)
        self.results.check(torch.equal(dev.cpu(), pageable), "the H2D copy moved the bytes")
        what = "CPU memcpy (stand-in)" if self.dry else "cudaMemcpyAsync"
        self.results.add(
            Row(
                "h2d_limit",
                f"pinned host to device, one {size // MiB} MiB copy ({what})",
                self.limit,
                "GB/s",
                note="the limit the load path's rates are fractions of",
            )
        )
        self.results.add(
            Row(
                "h2d_pieces",
                f"pinned host to device in {piece // MiB} MiB copies (the ring's)",
                size / pieces_s / 1e9,
                "GB/s",
                self.limit,
                "one large copy",
            )
        )
        self.results.add(
            Row(
                "h2d_pageable",
                "pageable host to device (what torch.load's copies get)",
                size / pageable_s / 1e9,
                "GB/s",
                self.limit,
                "pinned",
            )
        )

    def _device_time(self, run: Callable[[], None], rounds: int) -> float:
        """Median seconds of ``run``: CUDA events around it, or the wall clock on the CPU."""
        torch = self.torch
        run()
        self.sync()
        took = []
        for _ in range(rounds):
            if self.dry:
                start = time.perf_counter()
                run()
                took.append(time.perf_counter() - start)
                continue
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            run()
            end.record()
            end.synchronize()
            took.append(begin.elapsed_time(end) / 1e3)
        return statistics.median(took)

    # -- 2.-5. loading -------------------------------------------------------------------

    def loads(self) -> None:
        torch, state, size, client = self.torch, self.state, self.size, self.client
        assert client is not None
        link = ThreadLink() if self.dry else None  # the CPU stand-in: the ring, on the CPU
        target = like(state, self.device)
        where = "CPU (ring, stand-in)" if self.dry else "CUDA"

        def chunkd_into() -> None:
            checkpoint.load_into(target, self.name, client=client, _link=link)

        chunkd_s = self.timed(chunkd_into)
        self.results.check(same(target, state), f"load_into {where} tensors restored the state")
        rate = size / chunkd_s / 1e9
        loaded: list[Any] = []

        def chunkd_new() -> None:
            loaded[:] = [
                checkpoint.load(self.name, map_location=self.device, client=client, _link=link)
            ]

        new_s = self.timed(chunkd_new)
        self.results.check(same(loaded[0], state), f"load(map_location={self.device}) restored it")
        loaded.clear()

        pt = self.work / "state.pt"
        torch.save(state, pt)

        def torch_load() -> None:
            loaded[:] = [torch.load(pt, map_location=self.device)]

        torch_s = self.timed(torch_load)
        self.results.check(same(loaded[0], state), "torch.load restored it")
        loaded.clear()

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

        from chunkd.client.dcp import ChunkdStorageReader, ChunkdStorageWriter

        dcp_dir = self.work / "dcp"
        dcp.save(state, storage_writer=FileSystemWriter(dcp_dir), no_dist=True)
        dcp_target = like(state, self.device)

        def dcp_load() -> None:
            dcp.load(dcp_target, storage_reader=FileSystemReader(dcp_dir), no_dist=True)

        dcp_s = self.timed(dcp_load)
        self.results.check(same(dcp_target, state), "DCP FileSystemReader restored it")
        dcp_name = f"local/gpu-bench/dcp-{uuid.uuid4().hex[:8]}"
        dcp.save(state, storage_writer=ChunkdStorageWriter(dcp_name, client=client), no_dist=True)
        chunkd_dcp_target = like(state, self.device)

        def chunkd_dcp() -> None:
            reader = ChunkdStorageReader(dcp_name, client=client)
            dcp.load(chunkd_dcp_target, storage_reader=reader, no_dist=True)

        chunkd_dcp_s = self.timed(chunkd_dcp)
        self.results.check(same(chunkd_dcp_target, state), "ChunkdStorageReader restored it")

        host_target = like(state, "cpu")

        def host_into() -> None:
            checkpoint.load_into(host_target, self.name, client=client)

        host_s = self.timed(host_into)
        self.results.check(same(host_target, state), "load_into CPU tensors restored it")

        gib = f"{size / GiB:.2f} GiB"
        ring = f"{STAGING_BUFFERS} x {STAGING_BUFFER_BYTES // MiB} MiB"
        self.results.add(
            Row(
                "load_into_cuda",
                f"load_into {where} tensors, {gib}, warm daemon",
                rate,
                "GB/s",
                size / torch_s / 1e9,
                f"torch.load(map_location={str(self.device)!r}), page-cached file",
                ">= 5x",
                f"staging ring {ring} pinned, side-stream copies; torch.load {torch_s:.2f} s, "
                f"load_into {chunkd_s:.3f} s",
            )
        )
        if self.limit:
            self.results.add(
                Row(
                    "load_into_cuda_fraction",
                    "load_into CUDA tensors as a fraction of the pinned H2D limit",
                    rate / self.limit,
                    "x",
                    goal=">= 0.8",
                    note=f"{rate:.2f} of {self.limit:.2f} GB/s",
                )
            )
        self.results.add(
            Row(
                "load_into_cuda_vs_dcp",
                f"load_into {where} tensors vs DCP onto the device",
                rate,
                "GB/s",
                size / dcp_s / 1e9,
                "DCP load, FileSystemReader, page-cached files",
            )
        )
        self.results.add(
            Row(
                "dcp_chunkd_reader",
                "DCP load onto the device through ChunkdStorageReader",
                size / chunkd_dcp_s / 1e9,
                "GB/s",
                size / dcp_s / 1e9,
                "DCP FileSystemReader",
                note="the DCP adapter decodes on the CPU, then DCP copies each tensor over",
            )
        )
        self.results.add(
            Row(
                "load_new_cuda",
                f"load(map_location={str(self.device)!r}): new tensors",
                size / new_s / 1e9,
                "GB/s",
                size / torch_s / 1e9,
                "torch.load, same map_location",
            )
        )
        self.results.add(
            Row(
                "load_into_host",
                "load_into CPU tensors (the rate out of the memfds)",
                size / host_s / 1e9,
                "GB/s",
                rate,
                f"load_into {where}",
                note="preadv from the chunks' memfds into pageable tensors, 4 threads",
            )
        )

    # -- 6. read_into a pinned tensor ----------------------------------------------------

    def read_into(self) -> None:
        torch, client, daemon = self.torch, self.client, self.daemon
        assert client is not None
        assert daemon is not None
        size = self.args.object_mib * MiB
        key = f"gpu-bench/blob-{uuid.uuid4().hex[:8]}.bin"
        path = daemon.data / key
        path.parent.mkdir(parents=True, exist_ok=True)
        blob = torch.randint(0, 256, (size,), dtype=torch.uint8)
        path.write_bytes(tensor_bytes(blob))
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=not self.dry)
        name = f"local/{key}"

        def chunkd() -> None:
            got = client.read_into(name, pinned)
            if got != size:
                raise RuntimeError(f"read_into {name} copied {got} of {size} bytes")

        chunkd_s = self.timed(chunkd)
        self.results.check(torch.equal(pinned, blob), "read_into filled the pinned tensor")
        file_into = torch.empty(size, dtype=torch.uint8, pin_memory=not self.dry)
        file_view = tensor_bytes(file_into)

        def from_file() -> None:
            with path.open("rb", buffering=0) as f:
                got = 0
                while got < size:
                    n = f.readinto(file_view[got:])
                    if not n:
                        raise RuntimeError(f"{path} ended at byte {got}")
                    got += n

        file_s = self.timed(from_file)
        dev = torch.empty(size, dtype=torch.uint8, device=self.device)

        def to_device() -> None:
            chunkd()
            dev.copy_(pinned, non_blocking=True)

        device_s = self.timed(to_device)
        self.results.check(torch.equal(dev.cpu(), blob), "read_into then copy reached the device")
        pin = "pinned" if not self.dry else "plain (stand-in for pinned)"
        self.results.add(
            Row(
                "read_into_pinned",
                f"Client.read_into a {pin} tensor, {size // MiB} MiB object, warm",
                size / chunkd_s / 1e9,
                "GB/s",
                size / file_s / 1e9,
                "readinto of the page-cached file, same tensor",
                note="each byte copied once, from the chunk's memfd (preadv), 4 threads",
            )
        )
        self.results.add(
            Row(
                "read_into_then_device",
                "read_into the pinned tensor, then to the device (sequential)",
                size / device_s / 1e9,
                "GB/s",
                self.limit or None,
                "the pinned H2D limit",
            )
        )

    # -- 7. saving from CUDA -------------------------------------------------------------

    def saves(self) -> None:
        torch, client = self.torch, self.client
        assert client is not None
        dev_state = {
            "model": {k: v.to(self.device) for k, v in self.state["model"].items()},
            "step": self.state["step"],
        }
        size = nbytes(dev_state)
        pt = self.work / "save.pt"

        def chunkd() -> float:
            perturb(dev_state)
            self.sync()
            start = time.perf_counter()
            handle = checkpoint.async_save(
                dev_state, f"local/gpu-bench/save-{uuid.uuid4().hex[:8]}", client=client
            )
            took = time.perf_counter() - start
            handle.wait()  # untimed: the daemon's work must not spill into the next round
            return took

        def torch_save() -> float:
            perturb(dev_state)
            self.sync()
            start = time.perf_counter()
            torch.save(dev_state, pt)
            return time.perf_counter() - start

        chunkd()
        torch_save()
        chunkd_s = statistics.median(chunkd() for _ in range(self.rounds))
        torch_s = statistics.median(torch_save() for _ in range(self.rounds))
        last = f"local/gpu-bench/check-{uuid.uuid4().hex[:8]}"
        checkpoint.save(dev_state, last, client=client)
        back = checkpoint.load(last, client=client)
        self.results.check(same(back, dev_state), "async_save from the device saved its bytes")
        self.results.add(
            Row(
                "async_save_cuda",
                f"trainer blocked by async_save of {size / GiB:.2f} GiB of "
                f"{self.device.type.upper()} weights",
                size / chunkd_s / 1e9,
                "GB/s",
                size / torch_s / 1e9,
                "torch.save of the same tensors to a local file (page cache)",
                note=f"state size / time blocked: async_save {chunkd_s * 1e3:.0f} ms, "
                f"torch.save {torch_s * 1e3:.0f} ms",
            )
        )

    # -- 8. what would close the gap -----------------------------------------------------

    def raw(self) -> None:
        torch = self.torch
        count = max(1, self.args.raw_mib * MiB // _CHUNK)
        payload = os.urandom(_CHUNK)
        fds = [memfd.sealed(payload) for _ in range(count)]
        try:
            dest = torch.empty(count * _CHUNK, dtype=torch.uint8, pin_memory=not self.dry)
            view = tensor_bytes(dest)
            plain = self._sweep(fds, view, "memfd_to_pinned", "sealed memfds (4 KiB pages)")
            self.results.check(
                bytes(view[-_CHUNK:]) == payload, "memfd to pinned copies moved the bytes"
            )
            if not self.dry:
                self._registered(fds, "registered_to_device", "4 KiB pages")
            if self._collapse(fds):
                dest.zero_()
                self._sweep(
                    fds, view, "collapsed_to_pinned", "memfds collapsed to 2 MiB pages", plain
                )
                self.results.check(
                    bytes(view[:_CHUNK]) == payload, "collapsed memfds hold the same bytes"
                )
                if not self.dry:
                    self._registered(fds, "registered_collapsed_to_device", "2 MiB pages")
            self._huge_tmpfs(count, payload, view, plain)
        finally:
            memfd.close_all(fds)

    def _sweep(
        self,
        fds: list[int],
        view: memoryview,
        key: str,
        what: str,
        against: dict[int, float] | None = None,
    ) -> dict[int, float]:
        """``preadv`` every fd into ``view`` on each thread count; one row, the best."""
        rates = {
            t: len(fds) * _CHUNK / self._copy_in(fds, view, t) / 1e9 for t in self.args.threads
        }
        self.results.raw[f"{key}_GBps_by_threads"] = rates
        best = max(rates, key=lambda t: rates[t])
        base = (against or rates)[best if against else min(rates)]
        self.results.add(
            Row(
                key,
                f"preadv {what} into pinned memory, {best} threads",
                rates[best],
                "GB/s",
                base,
                f"memfds of 4 KiB pages, {best} threads" if against else f"{min(rates)} thread",
                note="by threads: " + ", ".join(f"{t}: {r:.1f}" for t, r in rates.items()),
            )
        )
        return rates

    def _copy_in(self, fds: list[int], view: memoryview, threads: int) -> float:
        from chunkd.client.checkpoint.device import read_exact

        def one(i: int) -> None:
            read_exact(fds[i], view[i * _CHUNK : (i + 1) * _CHUNK], 0)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(len(fds))))  # warm-up: the destination's pages
            took = []
            for _ in range(max(self.rounds, 3)):
                start = time.perf_counter()
                list(pool.map(one, range(len(fds))))
                took.append(time.perf_counter() - start)
        return statistics.median(took)

    def _collapse(self, fds: list[int]) -> bool:
        """``madvise(MADV_COLLAPSE)`` each sealed memfd into 2 MiB pages, as the daemon
        could once a chunk is sealed; records the cost. False where the kernel refuses."""
        libc = _Libc()
        start = time.perf_counter()
        for fd in fds:
            error = libc.collapse(fd, _CHUNK)
            if error:
                self.results.raw["collapse"] = f"MADV_COLLAPSE failed: {os.strerror(error)}"
                return False
        took = time.perf_counter() - start
        self.results.raw["collapse"] = {
            "chunks": len(fds),
            "ms_per_4MiB_chunk": took / len(fds) * 1e3,
            "ShmemHugePages": _meminfo("ShmemHugePages"),
        }
        return True

    def _huge_tmpfs(
        self, count: int, payload: bytes, view: memoryview, plain: dict[int, float]
    ) -> None:
        """The same bytes out of a tmpfs mounted huge=always (pages huge as written)."""
        if not self.args.huge:
            self.results.raw["huge_tmpfs"] = "skipped (--huge: mount a tmpfs with huge=always)"
            return
        mount = self.work / "huge"
        mount.mkdir()
        size = count * _CHUNK + 64 * MiB
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},huge=always", "chunkd-huge", str(mount)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            self.results.raw["huge_tmpfs"] = f"mount failed: {done.stderr.strip()}"
            return
        try:
            fds = []
            try:
                for i in range(count):
                    file = mount / f"c{i}"
                    file.write_bytes(payload)
                    fds.append(os.open(file, os.O_RDONLY))
                self._sweep(fds, view, "huge_tmpfs_to_pinned", "a huge=always tmpfs", plain)
            finally:
                memfd.close_all(fds)
        finally:
            subprocess.run(["umount", str(mount)], check=False)

    def _registered(self, fds: list[int], key: str, pages: str) -> None:
        """Map each memfd, cudaHostRegister the mapping, copy it to the GPU: no staging."""
        torch = self.torch
        cudart = torch.cuda.cudart()
        libc = _Libc()
        read_only, portable = 0x08, 0x01  # cudaHostRegisterReadOnly | cudaHostRegisterPortable
        total = len(fds) * _CHUNK
        dev = torch.empty(total, dtype=torch.uint8, device="cuda")
        addresses: list[int] = []
        registered: list[int] = []
        try:
            start = time.perf_counter()
            addresses += [libc.map(fd, _CHUNK) for fd in fds]
            map_s = time.perf_counter() - start
            start = time.perf_counter()
            for address in addresses:
                code = _code(cudart.cudaHostRegister(address, _CHUNK, read_only | portable))
                if code != 0:
                    self.results.raw[key] = f"cudaHostRegister(read-only) failed: error {code}"
                    return
                registered.append(address)
            register_s = time.perf_counter() - start
            hosts = [
                torch.frombuffer((ctypes.c_char * _CHUNK).from_address(a), dtype=torch.uint8)
                for a in addresses
            ]

            def copy() -> None:
                for i, host in enumerate(hosts):
                    dev[i * _CHUNK : (i + 1) * _CHUNK].copy_(host, non_blocking=True)

            copy_s = self._device_time(copy, max(self.rounds, 3))
            self.results.check(
                torch.equal(dev[-_CHUNK:].cpu(), hosts[-1]), f"{key}: the bytes reached the GPU"
            )
            start = time.perf_counter()
            while registered:
                cudart.cudaHostUnregister(registered.pop())
            unregister_s = time.perf_counter() - start
            once = total / (map_s + register_s + copy_s + unregister_s) / 1e9
            self.results.raw[key] = {
                "chunks": len(fds),
                "mmap_s": map_s,
                "register_s": register_s,
                "copy_s": copy_s,
                "unregister_s": unregister_s,
            }
            self.results.add(
                Row(
                    key,
                    f"memfd mappings ({pages}) cudaHostRegister'ed, to the GPU, no staging",
                    total / copy_s / 1e9,
                    "GB/s",
                    self.limit or None,
                    "the pinned H2D limit",
                    note=f"once registered; mapping, registering and unregistering each "
                    f"chunk for one copy: {once:.1f} GB/s (register "
                    f"{register_s / len(fds) * 1e6:.0f} us a 4 MiB chunk)",
                )
            )
        finally:
            self.sync()
            for address in registered:
                cudart.cudaHostUnregister(address)
            for address in addresses:
                libc.unmap(address, _CHUNK)


class _Libc:
    """``mmap``, ``munmap`` and ``madvise`` through ctypes (Linux)."""

    _MADV_COLLAPSE = 25  # Linux 6.1
    _MAP_FIXED = 0x10
    _PROT_NONE = 0  # not in Python's mmap module before 3.13
    _HUGE = 2 * MiB

    def __init__(self) -> None:
        bound = memfd.libc()  # the package's one binding
        self._mmap, self._munmap, self._madvise = bound.mmap, bound.munmap, bound.madvise

    def map(self, fd: int, size: int, address: int | None = None) -> int:
        """``fd`` mapped read-only and shared (at ``address``, replacing what is there)."""
        flags = mmap.MAP_SHARED | (self._MAP_FIXED if address is not None else 0)
        got = self._mmap(address, size, mmap.PROT_READ, flags, fd, 0)
        if got is None or got == ctypes.c_void_p(-1).value:
            error = ctypes.get_errno()
            raise OSError(error, f"mmap of fd {fd} failed: {os.strerror(error)}")
        return int(got)

    def unmap(self, address: int, size: int) -> None:
        self._munmap(address, size)

    def collapse(self, fd: int, size: int) -> int:
        """Collapse ``fd``'s pages into huge pages; 0, or the errno. The mapping must
        sit at a 2 MiB boundary: reserve more address space, map into it aligned."""
        reserved = size + self._HUGE
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        base = self._mmap(None, reserved, self._PROT_NONE, flags, -1, 0)
        if base is None or base == ctypes.c_void_p(-1).value:
            return ctypes.get_errno()
        try:
            aligned = -(-base // self._HUGE) * self._HUGE
            try:
                self.map(fd, size, aligned)
            except OSError as exc:
                return exc.errno or -1
            if self._madvise(aligned, size, self._MADV_COLLAPSE) != 0:
                return ctypes.get_errno()
            return 0
        finally:
            self._munmap(base, reserved)


def _meminfo(key: str) -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return line.split(":", 1)[1].strip()
    return "?"


def _code(error: Any) -> int:
    """A cudaError as an int (torch's binding returns an enum)."""
    return int(getattr(error, "value", error))


# -- the run -----------------------------------------------------------------------------


def machine(torch: Any, dry: bool) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for key, path in (
        ("shmem_enabled", "/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        ("thp_enabled", "/sys/kernel/mm/transparent_hugepage/enabled"),
    ):
        with contextlib.suppress(OSError):
            info[key] = Path(path).read_text().strip()
    with contextlib.suppress(OSError):
        info["mem_total_kib"] = next(
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal:")
        )
    if not dry:
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = f"{props.name}, {props.total_memory / GiB:.0f} GiB"
    return info


def fetch_wheels(root: Path) -> int:
    """Download the wheels the device machine lacks into ``root/.whl``, at the
    versions installed here; make git ignore that folder."""
    from importlib import metadata

    exclude = root / ".git" / "info" / "exclude"
    if exclude.parent.is_dir():
        known = exclude.read_text().split() if exclude.exists() else []
        if "/.whl/" not in known:
            with exclude.open("a") as f:
                f.write("/.whl/\n")
    else:  # a worktree, say: .git is a file
        print(f"gpu_bench: add /.whl/ to the git excludes of {root} yourself", flush=True)
    wanted = [f"{name}=={metadata.version(name)}" for name in WHEELS]
    platforms = [
        "manylinux_2_28_x86_64",
        "manylinux_2_27_x86_64",
        "manylinux_2_17_x86_64",
        "manylinux2014_x86_64",
        "manylinux1_x86_64",
    ]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        *[arg for p in platforms for arg in ("--platform", p)],
        "-d",
        str(root / ".whl"),
        *wanted,
    ]
    print(" ".join(command), flush=True)
    return subprocess.run(command, check=False).returncode


def _watchdog(seconds: float, results: Results, bench: Bench) -> None:
    """Past ``seconds``, write what was measured and exit 3: the device's time is short."""

    def expire() -> None:
        results.failures.append(f"the run took over --budget {seconds:.0f} s and was stopped")
        results.write()
        print(f"gpu_bench: over its budget of {seconds:.0f} s; stopping", file=sys.stderr)
        if bench.daemon is not None:
            bench.daemon.process.kill()
        os._exit(3)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_bench", description=__doc__)
    parser.add_argument("--out", type=Path, help="where gpu_bench.json and gpu_bench.md go")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes; the CPU stands in")
    parser.add_argument("--fetch-wheels", action="store_true", help="download .whl/ and stop")
    parser.add_argument("--layers", type=int, help="transformer layers of the state")
    parser.add_argument("--dim", type=int, help="model width")
    parser.add_argument("--vocab", type=int, help="vocabulary")
    parser.add_argument("--rounds", type=int, help="timed runs of each contender")
    parser.add_argument("--object-mib", type=int, help="size of the read_into object")
    parser.add_argument("--h2d-mib", type=int, help="size of the H2D limit's copy")
    parser.add_argument("--raw-mib", type=int, help="bytes of memfds in the raw copies")
    parser.add_argument("--threads", type=int, nargs="+", help="thread counts, raw copies")
    parser.add_argument("--huge", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--budget", type=float, default=420.0, help="seconds before giving up")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory's parent")
    args = parser.parse_args(argv)
    if args.fetch_wheels:
        return fetch_wheels(_ROOT)
    if args.out is None:
        parser.error("--out DIR is required")
    # A GPU run: ~2 GiB of state (dim 2048, 3 layers); a dry run: ~6 MiB.
    full = {"layers": 3, "dim": 2048, "vocab": 32_000, "rounds": 3, "object_mib": 1024}
    full |= {"h2d_mib": 1024, "raw_mib": 1024, "threads": [1, 2, 4, 8, 16]}
    dry = {"layers": 2, "dim": 128, "vocab": 2048, "rounds": 1, "object_mib": 40}
    dry |= {"h2d_mib": 32, "raw_mib": 32, "threads": [1, 2, 4]}
    for key, value in (dry if args.dry_run else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.huge is None:
        args.huge = not args.dry_run and os.geteuid() == 0
    try:
        import torch
    except ImportError:
        print("gpu_bench: torch is not installed (pip install torch)", file=sys.stderr)
        return 2
    if not args.dry_run and not torch.cuda.is_available():
        print(
            f"gpu_bench: CUDA is not available here (torch {torch.__version__}, CUDA "
            f"{torch.version.cuda or 'none: a CPU-only build'}): this run measures the GPU "
            "load path and needs a GPU; use --dry-run for a rehearsal on the CPU",
            file=sys.stderr,
        )
        return 2
    results = Results(args.out, args.dry_run, machine(torch, args.dry_run))
    bench = Bench(args, torch, results)
    _watchdog(args.budget, results, bench)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
    with warnings.catch_warnings():
        # DCP without a process group says that it assumes a single process: it does
        warnings.filterwarnings("ignore", r"torch\.distributed is (disabled, )?unavailable")
        warnings.filterwarnings("ignore", r".*TypedStorage is deprecated")
        try:
            bench.step("setup", bench.start)
            if bench.client is not None:
                bench.step("the pinned H2D limit", bench.h2d_limit)
                bench.step("loads", bench.loads)
                bench.step("read_into", bench.read_into)
                bench.step("saves", bench.saves)
            bench.step("raw copies", bench.raw)
        finally:
            bench.stop()
    results.write()
    print(f"gpu_bench: wrote {args.out / 'gpu_bench.json'} and {args.out / 'gpu_bench.md'}")
    if results.failures:
        print(f"gpu_bench: {len(results.failures)} check(s) FAILED:", file=sys.stderr)
        for failure in results.failures:
            print(f"  {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
