"""chunkd.client.dcp: torch.distributed.checkpoint saved and loaded through real daemons.

The multi-rank tests run each rank as its own process (``python worker.py ...``, the
script below) in a gloo process group on loopback; the full tensors come from a file
the test writes, so the test and every rank agree on them without sharing code.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .conftest import Daemon, free_port

torch = pytest.importorskip("torch")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from chunkd.client import Client, checkpoint  # noqa: E402
from chunkd.client.dcp import ChunkdStorageReader, ChunkdStorageWriter  # noqa: E402
from chunkd.errors import CheckpointExistsError, IntegrityError  # noqa: E402
from chunkd.testing.daemon import DaemonProcess  # noqa: E402

# DCP warns on every save and load made without a process group, even with
# no_dist=True; a single process is what these tests mean.
single_process = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning"
)

KiB = 1024


def bits(tensor: Any) -> Any:
    """The raw bytes of a tensor (bit-exact comparison, -0.0 and NaN included)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(got: Any, want: Any) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert torch.equal(bits(got), bits(want))


# -- one process -------------------------------------------------------------------------


@single_process
def test_single_process_round_trip_is_bit_exact(start_daemon: Any, tmp_path: Path) -> None:
    start_daemon(cwd=tmp_path / "node")
    generator = torch.Generator().manual_seed(1)
    tied = torch.randn(64, 32, generator=generator)
    saved = {
        "model": {
            "w": torch.randn(512, 256, generator=generator),  # its own segment
            "b16": torch.randn(128, 64, generator=generator).to(torch.bfloat16),
            "ids": torch.arange(1000, dtype=torch.int64),
            "mask": torch.rand(33, generator=generator) > 0.5,
            "half_t": torch.randn(16, 48, generator=generator).half().t(),  # a strided view
            "embed": tied,  # tied weights: one tensor under two names
            "head": tied,
            "empty": torch.empty(0, 3),
        },
        "step": 5,
        "extra": {"lr": 0.1, "name": "run1", "blob": b"\x00\xff" * 100},
    }
    target = {
        "model": {k: torch.zeros_like(v) for k, v in saved["model"].items()},
        "step": 0,
        "extra": {"lr": 0.0, "name": "", "blob": b""},
    }
    with Client(tmp_path / "node" / "chunkd.sock") as client:
        writer = ChunkdStorageWriter("local/dcp/s1", client=client)
        dcp.save(saved, storage_writer=writer, no_dist=True)
        dcp.load(
            target,
            storage_reader=ChunkdStorageReader("local/dcp/s1", client=client),
            no_dist=True,
        )
        doc = checkpoint.manifest("local/dcp/s1", client=client)

        # the name is taken now: a second save fails before it writes anything
        with pytest.raises(CheckpointException) as refused:
            dcp.save(
                saved,
                storage_writer=ChunkdStorageWriter("local/dcp/s1", client=client),
                no_dist=True,
            )
    for key, want in saved["model"].items():
        assert_bit_equal(target["model"][key], want)
    assert target["step"] == 5
    assert target["extra"] == saved["extra"]
    assert doc["world_size"] == 1
    assert isinstance(doc["dcp_metadata"], str)
    assert [type(e) for e, _ in refused.value.failures.values()] == [CheckpointExistsError]


# -- several ranks -----------------------------------------------------------------------

WORKER = """
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from chunkd.client import Client
from chunkd.client.dcp import ChunkdStorageReader, ChunkdStorageWriter

mode, rank, world, port, sock, name, folder = sys.argv[1:]
rank, world = int(rank), int(world)
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
)
done = False
try:
    mesh = init_device_mesh("cpu", (world,))
    full = torch.load(f"{folder}/full.pt")
    client = Client(sock)
    if mode == "save":
        state = {
            "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
            "w16": distribute_tensor(full["w16"], mesh, [Shard(0)]),
            "rep": full["rep"].clone(),
            "step": 5,
        }
        dcp.save(state, storage_writer=ChunkdStorageWriter(name, client=client))
    else:
        state = {
            "w": distribute_tensor(torch.zeros_like(full["w"]), mesh, [Shard(0)]),
            "w16": distribute_tensor(torch.zeros_like(full["w16"]), mesh, [Shard(0)]),
            "rep": torch.zeros_like(full["rep"]),
            "step": 0,
        }
        dcp.load(state, storage_reader=ChunkdStorageReader(name, client=client))
        torch.save(
            {
                "w": state["w"].full_tensor(),
                "w_local": state["w"].to_local(),
                "w16": state["w16"].full_tensor(),
                "rep": state["rep"],
                "step": state["step"],
            },
            f"{folder}/loaded-{rank}.pt",
        )
    dist.barrier()
    client.close()
    done = True
finally:
    dist.destroy_process_group()
# Every rank got past the barrier: leave without the interpreter's teardown, in which
# gloo's threads now and then abort the process ("terminate called without an active
# exception", SIGABRT) after all the work is done. A rank that failed raised above.
if done:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
"""


def full_state() -> dict[str, Any]:
    """What the ranks save: 1 MiB and 256 KiB sharded, 512 KiB replicated."""
    generator = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(1024, 256, generator=generator),
        "w16": torch.randn(512, 256, generator=generator).to(torch.bfloat16),
        "rep": torch.randn(512, 256, generator=generator),
    }


def run_ranks(folder: Path, mode: str, world: int, sock: Path, name: str) -> None:
    """Run ``world`` ranks of WORKER and wait for them; fail with their output."""
    script = folder / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    env["OMP_NUM_THREADS"] = "1"  # two cores for several ranks
    port = free_port()
    logs = [folder / f"{mode}-{rank}.log" for rank in range(world)]
    ranks = []
    for rank, log in enumerate(logs):
        args = [mode, str(rank), str(world), str(port), str(sock), name, str(folder)]
        with log.open("wb") as sink:
            ranks.append(
                subprocess.Popen(
                    [sys.executable, str(script), *args],
                    env=env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + 90  # a rank whose peer died waits in gloo for long
    try:
        for p in ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in ranks]
    if any(codes):
        output = "\n".join(
            f"--- rank {r}: exit {c}\n{logs[r].read_text()}" for r, c in enumerate(codes)
        )
        pytest.fail(f"{mode} with {world} ranks failed (negative: killed):\n{output}")


@dataclass
class FourRankSave:
    daemon: Daemon
    folder: Path
    name: str
    #: bytes the daemon wrote to its backend during the save
    written: float

    @property
    def socket(self) -> Path:
        return self.folder / "chunkd.sock"


@pytest.fixture(scope="module")
def four_rank_save(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FourRankSave]:
    """One daemon, and one checkpoint saved into it by 4 ranks."""
    folder = tmp_path_factory.mktemp("dcp4")
    port = free_port()
    launched = DaemonProcess(cwd=folder, listen=f"127.0.0.1:{port}", socket=folder / "chunkd.sock")
    daemon = Daemon(
        launched.process, port, folder / "none.toml", folder, launched.env, launched.log
    )
    try:
        launched.wait_ready()
        torch.save(full_state(), folder / "full.pt")
        before = daemon.metric("chunkd_backend_write_bytes_total", backend="local")
        run_ranks(folder, "save", 4, folder / "chunkd.sock", "local/dcp/four")
        after = daemon.metric("chunkd_backend_write_bytes_total", backend="local")
        yield FourRankSave(daemon, folder, "local/dcp/four", after - before)
    finally:
        daemon.stop()


@pytest.mark.timeout(240)
def test_four_ranks_save_and_two_ranks_load_resharded(four_rank_save: FourRankSave) -> None:
    saved = four_rank_save
    run_ranks(saved.folder, "load", 2, saved.socket, saved.name)
    full = full_state()
    for rank in range(2):
        loaded = torch.load(saved.folder / f"loaded-{rank}.pt")
        assert_bit_equal(loaded["w"], full["w"])
        assert_bit_equal(loaded["w_local"], full["w"][rank * 512 : (rank + 1) * 512])
        assert_bit_equal(loaded["w16"], full["w16"])
        assert_bit_equal(loaded["rep"], full["rep"])
        assert loaded["step"] == 5
    with Client(saved.socket) as client:
        doc = checkpoint.manifest(saved.name, client=client)
    assert doc["world_size"] == 4
    assert sorted(p["rank"] for p in doc["parts"]) == [0, 1, 2, 3]


@pytest.mark.timeout(240)
def test_replicated_tensors_are_uploaded_once(four_rank_save: FourRankSave) -> None:
    full = full_state()
    logical = sum(t.numel() * t.element_size() for t in full.values())  # 1.75 MiB
    # Besides the tensors: the pickled step, and small JSON (intents, parts, the
    # manifest with DCP's metadata). The replicated tensor once more would be 512 KiB.
    written = four_rank_save.written
    assert logical <= written < logical + 64 * KiB, f"{written=:.0f} for {logical=}"


# -- damage ------------------------------------------------------------------------------


@single_process
def test_a_damaged_chunk_fails_the_load_naming_the_tensor(
    start_daemon: Any, tmp_path: Path
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    start_daemon(cwd=first)
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(512, 256, generator=generator)
    with Client(first / "chunkd.sock") as client:
        dcp.save(
            {"layers.0.weight": weight, "step": 1},
            storage_writer=ChunkdStorageWriter("local/dcp/damaged", client=client),
            no_dist=True,
        )
        part = checkpoint.manifest("local/dcp/damaged", client=client)["parts"][0]
    tree = dict(zip(part["tree"]["keys"], part["tree"]["values"], strict=True))
    node = next(v for k, v in tree.items() if k.startswith("layers.0.weight@"))
    chunk_id = part["segments"][node["seg"]]["chunks"][0][0]
    stored = first / "chunkd-data" / "chunks" / chunk_id
    raw = bytearray(stored.read_bytes())
    raw[1000:1016] = bytes(16)  # the same size, other bytes
    stored.write_bytes(bytes(raw))

    # A second daemon over the same backend: its cache has never seen the chunk.
    start_daemon(cwd=second, env={"CHUNKD_BACKENDS_LOCAL_URL": f"file://{first / 'chunkd-data'}"})
    target = {"layers.0.weight": torch.zeros_like(weight), "step": 0}
    with Client(second / "chunkd.sock") as client:
        reader = ChunkdStorageReader("local/dcp/damaged", client=client)
        with pytest.raises(CheckpointException) as failed:
            dcp.load(target, storage_reader=reader, no_dist=True)
    [(error, _)] = failed.value.failures.values()
    assert isinstance(error, IntegrityError)
    assert "layers.0.weight" in str(error)
    assert chunk_id in str(error)
