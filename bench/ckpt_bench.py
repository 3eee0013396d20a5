"""Checkpoints through chunkd against ``torch.save`` and DCP on the same local disk.

The state is a synthetic model with realistic tensor sizes: an embedding table, N
transformer layers (qkv, proj, mlp up/down in bf16, layer norms as small tensors),
and Adam moments (exp_avg, exp_avg_sq in fp32) with their step counters. Full size
is ~1.24 GiB; ``--quick`` uses a few MiB and 2 rounds. Before every timed save a byte
in every 64 KiB of every tensor changes, so no chunk of an earlier save can be
deduplicated (a trainer's state changes every step); background work of one round
(the daemon's upload, DCP's writer thread, dirty pages) is finished and synced before
the next. The saves, the noisy rows, run 5 rounds (``--rounds`` overrides), the others
3; every row gives its median and the spread of its rounds.

1. Trainer blocking time: ``async_save`` until it returns, against ``torch.save`` to a
   local file (closed, not fsynced: page cache) and DCP ``async_save`` with a
   ``FileSystemWriter`` (until it returns: its staging copy).
2. Durable save: ``save(durability="local")`` (fsynced on this node's disk) against
   DCP ``save`` with ``FileSystemWriter`` (``sync_files=True``, the default).
3. Four ranks (forked processes) saving the same replicated state at once: bytes
   written to the backend (the daemon's ``chunkd_backend_write_bytes_total``) against
   the bytes of DCP's files from four gloo ranks, both as multiples of the state's size.
4. A step that changes 25% of the big tensors' bytes: bytes uploaded against a full save.
5. ``load_into`` existing tensors from the daemon's warm RAM cache against
   ``torch.load`` of a page-cached file and DCP ``load`` from page-cached files.
6. Only where CUDA is available (skipped, saying so, elsewhere): 1. with the state's
   tensors on the GPU: ``async_save`` (device-to-host copies straight into the staged
   memfd, registered as pinned memory) against ``torch.save`` and DCP ``async_save``
   of the same CUDA tensors.

It is one job at ~680 lines: the checkpoint path's speed, one scenario family (blocking,
durable, four ranks, a delta, load, CUDA) against ``torch.save`` and DCP on one
synthetic model state, which every scenario shares (and :mod:`bench.gpu_bench` takes);
the daemon is :class:`bench.daemon.BenchDaemon`, and the rows go to
:class:`bench.report.Report`.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import statistics
import time
import urllib.request
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkd.client import Client, checkpoint
from chunkd.testing import free_port

from .daemon import BenchDaemon
from .report import Phase, Rates, Report, Result, Rounds, interleave

try:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
except ImportError:  # torch is an optional extra: the other benchmarks run without it
    torch = None  # type: ignore[assignment]

MiB = 1 << 20
GiB = 1 << 30
#: one byte in every this many of each tensor changes between saves
_PERTURB_STRIDE = 64 * 1024
_RANKS = 4

__all__ = ["FULL", "QUICK", "SCENARIOS", "ModelShape", "model_state", "run", "tensors"]

SCENARIOS = (
    "ckpt_blocking",
    "ckpt_durable",
    "ckpt_ranks",
    "ckpt_delta",
    "ckpt_load",
    "ckpt_blocking_cuda",
)
#: rounds of the save rows (the noisy ones) and of the others, in a full run
_SAVE_ROUNDS = 5
_OTHER_ROUNDS = 3
#: rounds of every row in a --quick run (enough for a spread)
_QUICK_ROUNDS = 2


# -- the state -------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes: what the synthetic state is made of."""

    vocab: int
    dim: int
    layers: int


#: ~1.24 GiB: 133M parameters, 2 bytes of weight and 8 of Adam moments each
FULL = ModelShape(vocab=32_000, dim=1024, layers=8)
#: ~6 MiB, for --quick
QUICK = ModelShape(vocab=2048, dim=128, layers=2)


def model_state(shape: ModelShape, seed: int) -> dict[str, Any]:
    """A model + Adam state dict as a trainer checkpoints it; the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    d = shape.dim

    def weight(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen, dtype=torch.bfloat16).mul_(0.02)

    model: dict[str, torch.Tensor] = {"embed.weight": weight(shape.vocab, d)}
    for i in range(shape.layers):
        p = f"layers.{i}."
        model[p + "attn_norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        model[p + "attn.qkv.weight"] = weight(3 * d, d)
        model[p + "attn.proj.weight"] = weight(d, d)
        model[p + "mlp_norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        model[p + "mlp.up.weight"] = weight(4 * d, d)
        model[p + "mlp.down.weight"] = weight(d, 4 * d)
    model["norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
    moments: dict[int, dict[str, torch.Tensor]] = {}
    for i, tensor in enumerate(model.values()):
        exp_avg = torch.randn(tensor.shape, generator=gen).mul_(1e-3)
        exp_avg_sq = torch.randn(tensor.shape, generator=gen).mul_(1e-3).square_()
        moments[i] = {"step": torch.tensor(1000.0), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    group = {
        "lr": 3e-4,
        "betas": (0.9, 0.95),
        "eps": 1e-8,
        "weight_decay": 0.1,
        "params": list(range(len(model))),
    }
    return {"model": model, "optim": {"state": moments, "param_groups": [group]}, "step": 1000}


def tensors(state: Any) -> Iterator[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from tensors(value)
    elif isinstance(state, list | tuple):
        for value in state:
            yield from tensors(value)


def _like(state: Any) -> Any:
    """The same structure with zeroed tensors of the same shapes: a load target."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {key: _like(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_like(value) for value in state]
    if isinstance(state, tuple):
        return tuple(_like(value) for value in state)
    return state


def _nbytes(state: Any) -> int:
    return sum(t.nbytes for t in tensors(state))


def _perturb(state: Any) -> None:
    """A new step: one byte in every 64 KiB of every tensor changes (every chunk is new)."""
    for tensor in tensors(state):
        tensor.reshape(-1).view(torch.uint8)[::_PERTURB_STRIDE].add_(1)


def _same(a: Any, b: Any) -> bool:
    return all(torch.equal(x, y) for x, y in zip(tensors(a), tensors(b), strict=True))


# -- helpers ---------------------------------------------------------------------------


def _metric(url: str, sample: str) -> float:
    """One sample of the daemon's /metrics, e.g. ``name_total{label="x"}``; 0 if absent."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def _backend_bytes(daemon: BenchDaemon) -> float:
    return _metric(daemon.url, 'chunkd_backend_write_bytes_total{backend="local"}')


def _phase(run: Callable[[], tuple[float, float]]) -> Phase:
    async def phase() -> tuple[float, float]:
        return run()

    return phase


def _size(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB / 4 else f"{nbytes / MiB:.1f} MiB"


def _name(label: str) -> str:
    return f"local/bench/{label}-{uuid.uuid4().hex[:8]}"


def _dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _ms(rates: Rates, name: str, size: float) -> str:
    """The median time of phase ``name`` and its spread over the rounds, in ms."""
    times = sorted(size / rate * 1e3 for rate in rates.per_round[name])
    return f"{size / rates[name] * 1e3:.0f} ms ({times[0]:.0f}-{times[-1]:.0f})"


@dataclass
class _Bench:
    """What the scenarios share: the daemon, a client, the state and a scratch dir."""

    daemon: BenchDaemon
    client: Client
    state: dict[str, Any]
    files: Path
    #: timed rounds of the save rows
    save_rounds: int
    #: timed rounds of the other rows
    rounds: int

    @property
    def nbytes(self) -> int:
        return _nbytes(self.state)


# -- 1. blocking time ------------------------------------------------------------------


async def blocking(report: Report, b: _Bench) -> None:
    await _blocking(report, b, b.state, "")


async def _blocking(report: Report, b: _Bench, state: dict[str, Any], where: str) -> None:
    size = _nbytes(state)
    pt = b.files / "blocking.pt"
    dcp_dir = b.files / "blocking-dcp"

    def chunkd() -> tuple[float, float]:
        _perturb(state)
        os.sync()
        start = time.perf_counter()
        handle = checkpoint.async_save(state, _name("blocking"), client=b.client)
        took = time.perf_counter() - start
        handle.wait()  # untimed: the daemon's work must not spill into the next round
        return size, took

    def torch_save() -> tuple[float, float]:
        _perturb(state)
        os.sync()
        start = time.perf_counter()
        torch.save(state, pt)
        return size, time.perf_counter() - start

    def dcp_async() -> tuple[float, float]:
        _perturb(state)
        shutil.rmtree(dcp_dir, ignore_errors=True)  # a new step's directory
        os.sync()
        writer = FileSystemWriter(dcp_dir)
        start = time.perf_counter()
        future = dcp.async_save(state, storage_writer=writer, no_dist=True)
        took = time.perf_counter() - start
        future.result()
        return size, took

    rates = await interleave(
        b.save_rounds,
        {"chunkd": _phase(chunkd), "torch": _phase(torch_save), "dcp": _phase(dcp_async)},
    )
    label = f"{_size(size)}{where}"
    report.add(
        Result(
            f"trainer blocked by a {label} save: async_save",
            rates["chunkd"] / 1e9,
            rates["torch"] / 1e9,
            "GB/s",
            "torch.save to a local file (closed; page cache, no fsync)",
            target_ratio=10.0,
            samples=rates.pair("chunkd", "torch", 1e-9),
            note=(
                f"GB/s here is state size / time the trainer is blocked, so 10x means blocked "
                f"a tenth as long: async_save {_ms(rates, 'chunkd', size)} (a copy into "
                f"memory made ready after the previous save, the seal, the hand-off to the "
                f"daemon), torch.save {_ms(rates, 'torch', size)}; median (min-max)"
            ),
        )
    )
    report.add(
        Result(
            f"trainer blocked by a {label} save: vs DCP async_save",
            rates["chunkd"] / 1e9,
            rates["dcp"] / 1e9,
            "GB/s",
            "DCP async_save, FileSystemWriter, until it returns",
            target_ratio=1.0,
            samples=rates.pair("chunkd", "dcp", 1e-9),
            note=(
                f"DCP async_save returns after copying the state into new CPU tensors "
                f"({_ms(rates, 'dcp', size)}); its writer thread then competes with training"
            ),
        )
    )


# -- 2. durable save -------------------------------------------------------------------


async def durable(report: Report, b: _Bench) -> None:
    state, size = b.state, b.nbytes
    dcp_dir = b.files / "durable-dcp"

    def chunkd() -> tuple[float, float]:
        _perturb(state)
        os.sync()
        start = time.perf_counter()
        handle = checkpoint.save(state, _name("durable"), durability="local", client=b.client)
        took = time.perf_counter() - start
        handle.wait(level="remote")  # untimed: the upload must not spill into the next round
        return size, took

    def dcp_save() -> tuple[float, float]:
        _perturb(state)
        shutil.rmtree(dcp_dir, ignore_errors=True)  # a new step's directory
        os.sync()
        writer = FileSystemWriter(dcp_dir)
        start = time.perf_counter()
        dcp.save(state, storage_writer=writer, no_dist=True)
        return size, time.perf_counter() - start

    rates = await interleave(b.save_rounds, {"chunkd": _phase(chunkd), "dcp": _phase(dcp_save)})
    report.add(
        Result(
            f"durable save {_size(b.nbytes)} (durability=local)",
            rates["chunkd"] / 1e9,
            rates["dcp"] / 1e9,
            "GB/s",
            "DCP save, FileSystemWriter (sync_files=True), local disk",
            target_ratio=1.0,
            samples=rates.pair("chunkd", "dcp", 1e-9),
            note=(
                f"save() until every chunk is hashed, written to the disk tier (raw, "
                f"O_DIRECT from the sealed memfd's pages) and synced (syncfs), and the job "
                f"journal is fsynced: {_ms(rates, 'chunkd', size)}; DCP "
                f"{_ms(rates, 'dcp', size)}; the upload to the backend that follows is not "
                f"timed"
            ),
        )
    )


# -- 3. four identical ranks -----------------------------------------------------------
#
# The rank processes are forked: they share the parent's state copy-on-write (so four
# ranks of the full state fit in memory) and start without importing torch again.
# Forked after torch ran parallel ops, a child must keep to one thread (as DataLoader
# workers do).


def _chunkd_rank(rank: int, state: Any, socket: str, name: str, save_id: str, meet: Any) -> None:
    torch.set_num_threads(1)
    client = Client(socket)
    try:
        meet.wait()
        checkpoint.save(
            state,
            name,
            rank=rank,
            world_size=_RANKS,
            save_id=save_id,
            durability="remote",
            client=client,
        )
    finally:
        client.close()


def _dcp_rank(rank: int, state: Any, port: int, root: str, meet: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=_RANKS
    )
    try:
        meet.wait()
        dcp.save(state, storage_writer=FileSystemWriter(root))
    finally:
        dist.destroy_process_group()


def _together(target: Callable[..., None], args: tuple[Any, ...]) -> float:
    """Fork a process per rank running ``target(rank, *args, meet)``; release them at
    once; returns the seconds until the last one is done."""
    context = multiprocessing.get_context("fork")
    meet = context.Barrier(_RANKS + 1)
    procs = [context.Process(target=target, args=(r, *args, meet)) for r in range(_RANKS)]
    for p in procs:
        p.start()
    try:
        meet.wait(timeout=600)
        start = time.perf_counter()
        for p in procs:
            p.join(timeout=600)
        took = time.perf_counter() - start
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"a rank process failed (exit codes {failed})")
    return took


async def ranks(report: Report, b: _Bench) -> None:
    state, size = b.state, b.nbytes
    chunkd_x: list[float] = []
    dcp_x: list[float] = []
    chunkd_s: list[float] = []
    dcp_s: list[float] = []
    parts: dict[str, Any] = {}
    for _ in range(b.rounds):
        _perturb(state)
        name = _name("ranks")
        os.sync()
        before = _backend_bytes(b.daemon)
        chunkd_s.append(_together(_chunkd_rank, (state, b.daemon.socket, name, uuid.uuid4().hex)))
        chunkd_x.append((_backend_bytes(b.daemon) - before) / size)
        parts = checkpoint.manifest(name, client=b.client)
        root = b.files / "ranks-dcp"
        os.sync()
        dcp_s.append(_together(_dcp_rank, (state, free_port(), str(root))))
        dcp_x.append(_dir_bytes(root) / size)
        shutil.rmtree(root, ignore_errors=True)
    report.add(
        Result(
            f"{_RANKS} ranks, same {_size(size)} state: bytes written / state",
            statistics.median(chunkd_x),
            statistics.median(dcp_x),
            "x",
            f"DCP save, {_RANKS} gloo ranks, FileSystemWriter: bytes of its files",
            target_max=1.05,
            samples=Rounds.of(chunkd_x, dcp_x),
            note=(
                f"{_RANKS} processes save identical replicated state under one save id, "
                f"at once, to one daemon; chunkd's figure is its chunkd_backend_write_bytes_total "
                f"delta (chunks, intents, parts, manifest); the last manifest counts "
                f"{parts['new_bytes'] / MiB:.0f} MiB new of {parts['logical_bytes'] / MiB:.0f} "
                f"MiB logical. DCP's default planner also writes a replicated tensor on one "
                f"rank only. Wall time: chunkd {statistics.median(chunkd_s):.1f} s to remote, "
                f"DCP {statistics.median(dcp_s):.1f} s (fsynced). The ranks are forked and "
                f"share the state's pages copy-on-write"
            ),
        )
    )


# -- 4. a step that changes a quarter --------------------------------------------------


async def delta(report: Report, b: _Bench) -> None:
    state = b.state
    big = [t for t in tensors(state) if t.nbytes >= checkpoint.OWN_SEGMENT_BYTES]
    big_bytes = sum(t.nbytes for t in big)
    random.Random(4).shuffle(big)
    changed: list[torch.Tensor] = []
    changed_bytes = 0
    for tensor in big:  # whole tensors, in a fixed shuffled order, up to a quarter
        n = tensor.nbytes
        if changed_bytes + n <= big_bytes // 4:
            changed.append(tensor)
            changed_bytes += n

    written: list[float] = []
    new: list[float] = []
    full = dedup = 0
    for _ in range(b.rounds):
        _perturb(state)
        checkpoint.save(state, _name("step-a"), client=b.client)
        for tensor in changed:
            tensor.mul_(0.9)  # every value of these moves (a decayed weight, a moment)
        for moments in state["optim"]["state"].values():
            moments["step"].add_(1)
        state["step"] += 1
        os.sync()
        before = _backend_bytes(b.daemon)
        done = checkpoint.save(state, _name("step-b"), client=b.client).result()
        written.append((_backend_bytes(b.daemon) - before) / MiB)
        new.append(done.new_bytes / MiB)
        full, dedup = done.logical_bytes, done.dedup_bytes
    share = changed_bytes / big_bytes
    report.add(
        Result(
            f"{share:.0%} of the big tensors changed: bytes written for the step",
            statistics.median(written),
            full / MiB,
            "MiB",
            "a full save (torch.save and DCP write everything each step)",
            target_max=round((changed_bytes + 4 * MiB) * 1.05 / MiB, 1),
            samples=Rounds.of(written, [full / MiB]),
            note=(
                f"{len(changed)} of {len(big)} tensors >= 256 KiB changed, "
                f"{changed_bytes / MiB:.0f} MiB ({changed_bytes / full:.1%} of the state); "
                "every step counter changed too (packed small values). Figure: the daemon's "
                "chunkd_backend_write_bytes_total delta; target: the changed bytes plus "
                "one 4 MiB chunk of packed small values, +5%"
            ),
        )
    )
    report.add(
        Result(
            f"{share:.0%} of the big tensors changed: new_bytes the save reported",
            statistics.median(new),
            full / MiB,
            "MiB",
            "a full save",
            samples=Rounds.of(new, [full / MiB]),
            note=f"SaveResult.new_bytes; dedup_bytes {dedup / MiB:.0f} MiB",
        )
    )


# -- 5. load into existing tensors -----------------------------------------------------


async def load(report: Report, b: _Bench) -> None:
    state, size = b.state, b.nbytes
    _perturb(state)
    name = _name("load")
    checkpoint.save(state, name, client=b.client)
    pt = b.files / "load.pt"
    torch.save(state, pt)
    dcp_dir = b.files / "load-dcp"
    dcp.save(state, storage_writer=FileSystemWriter(dcp_dir), no_dist=True)
    os.sync()
    target = _like(state)

    def chunkd() -> tuple[float, float]:
        start = time.perf_counter()
        checkpoint.load_into(target, name, client=b.client)
        return size, time.perf_counter() - start

    def torch_load() -> tuple[float, float]:
        start = time.perf_counter()
        loaded = torch.load(pt)
        took = time.perf_counter() - start
        del loaded
        return size, took

    def dcp_load() -> tuple[float, float]:
        start = time.perf_counter()
        dcp.load(target, storage_reader=FileSystemReader(dcp_dir), no_dist=True)
        return size, time.perf_counter() - start

    # interleave's untimed first round is the warm-up: the daemon's RAM cache, the page cache
    rates = await interleave(
        b.rounds,
        {"chunkd": _phase(chunkd), "torch": _phase(torch_load), "dcp": _phase(dcp_load)},
    )
    checkpoint.load_into(target, name, client=b.client)
    if not _same(target, state):
        raise RuntimeError(f"load_into of {name} did not restore the saved tensors")
    label = _size(size)
    report.add(
        Result(
            f"load_into {label} of existing tensors, warm daemon",
            rates["chunkd"] / 1e9,
            rates["torch"] / 1e9,
            "GB/s",
            "torch.load of a page-cached file (into new tensors)",
            target_ratio=5.0,
            samples=rates.pair("chunkd", "torch", 1e-9),
            note=(
                "load_into copies from the chunks' memfds (daemon RAM tier) into the "
                "tensors in place; torch.load allocates new tensors, as it always does"
            ),
        )
    )
    report.add(
        Result(
            f"load_into {label} of existing tensors, vs DCP",
            rates["chunkd"] / 1e9,
            rates["dcp"] / 1e9,
            "GB/s",
            "DCP load, FileSystemReader, page-cached files, in place",
            target_ratio=3.0,
            samples=rates.pair("chunkd", "dcp", 1e-9),
        )
    )


# -- 6. blocking time with the state on the GPU ----------------------------------------


async def blocking_cuda(report: Report, b: _Bench) -> None:
    if not torch.cuda.is_available():
        print("ckpt: blocking_cuda skipped, this machine has no CUDA device", flush=True)
        return
    state = _to(b.state, torch.device("cuda"))
    try:
        await _blocking(report, b, state, " CUDA")
    finally:
        del state
        torch.cuda.empty_cache()


def _to(state: Any, device: torch.device) -> Any:
    """The same structure with its tensors copied to ``device``."""
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {key: _to(value, device) for key, value in state.items()}
    if isinstance(state, list):
        return [_to(value, device) for value in state]
    if isinstance(state, tuple):
        return tuple(_to(value, device) for value in state)
    return state


# -- all of them -----------------------------------------------------------------------


_SCENARIOS = {
    "ckpt_blocking": blocking,
    "ckpt_durable": durable,
    "ckpt_ranks": ranks,
    "ckpt_delta": delta,
    "ckpt_load": load,
    "ckpt_blocking_cuda": blocking_cuda,
}


async def run(report: Report, work: Path, *, quick: bool, only: set[str] | None = None) -> None:
    """The checkpoint scenarios (or ``only`` those named); ``quick`` shrinks them."""
    wanted = [s for s in SCENARIOS if only is None or "ckpt" in only or s in only]
    if not wanted:
        return
    if torch is None:
        print("ckpt: skipped, torch is not installed (pip install torch==2.13.0)", flush=True)
        return
    files = work / "files"
    files.mkdir(parents=True, exist_ok=True)
    shape = QUICK if quick else FULL
    state = model_state(shape, 1)
    save_rounds = report.rounds_for(_QUICK_ROUNDS if quick else _SAVE_ROUNDS)
    rounds = report.rounds_for(_QUICK_ROUNDS if quick else _OTHER_ROUNDS)
    try:
        with warnings.catch_warnings():
            # DCP without a process group says that it assumes a single process: it does
            warnings.filterwarnings("ignore", r"torch\.distributed is (disabled, )?unavailable")
            for scenario in wanted:
                print(f"ckpt: {scenario.removeprefix('ckpt_')}", flush=True)
                # A daemon (and a backend directory) per scenario, removed after it: a
                # full run saves some 25 GiB, which no one disk should have to hold at once.
                with report.timed(scenario, "checkpoints"):
                    home = work / scenario
                    daemon = BenchDaemon(
                        home,
                        {"CHUNKD_CACHE_RAM_BYTES": "4GiB", "CHUNKD_CACHE_DISK_BYTES": "40GiB"},
                    )
                    client = Client(daemon.socket)
                    try:
                        bench = _Bench(daemon, client, state, files, save_rounds, rounds)
                        await _SCENARIOS[scenario](report, bench)
                    finally:
                        client.close()
                        daemon.stop()
                        shutil.rmtree(home, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
