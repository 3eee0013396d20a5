"""Checkpoints through a real daemon: round trips, dedup, durability, kill -9, safety, GC."""

from __future__ import annotations

import json
import math
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.errors import (
    BackendForbiddenError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    IntegrityError,
    ReadOnlyBackendError,
    UnsupportedStateError,
)
from chunkd.testing import CountingProxy, S3Server, refused_backend, s3_backend
from tests.conftest import Daemon, wait_for_socket

MiB = 1 << 20

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
]


def s3_toml(tmp_path: Path, bucket: str, proxy: CountingProxy, *, name: str = "cache") -> str:
    backend = s3_backend(
        "ckpt", f"s3://{bucket}/pre", proxy.endpoint, writable=True, timeout="5s", retries=1
    )
    return f"""
[server]
shutdown_timeout = "10s"

[cache]
dir = "{tmp_path / name}"
ram_bytes = "256MiB"
disk_bytes = "2GiB"
disk_min_free_bytes = 0
fsync = "never"

{backend}"""


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Iterator[tuple[Daemon, Client]]:
    """A daemon on the embedded default (a writable file backend 'local'), and a client."""
    daemon = start_daemon(cwd=tmp_path / "node")
    with Client(daemon.cwd / "chunkd.sock") as client:
        yield daemon, client


@pytest.fixture
def s3_node(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> Iterator[tuple[Daemon, Client]]:
    daemon = start_daemon(s3_toml(tmp_path, bucket, s3_proxy), cwd=tmp_path / "s3node")
    with Client(daemon.cwd / "chunkd.sock") as client:
        yield daemon, client


# -- comparing state bit for bit ---------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    fresh = torch.empty(t.shape, dtype=t.dtype).copy_(t)  # standard strides
    return bytes(fresh.reshape(-1).view(torch.uint8).numpy())


def assert_same(a: Any, b: Any, path: str = "") -> None:
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, path
        assert a.shape == b.shape, path
        assert tensor_bytes(a) == tensor_bytes(b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, path
        assert a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Any bit pattern the dtype can hold (NaNs included); bools are 0 or 1."""
    count = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    raw = np.random.default_rng(seed).integers(0, 256, size=count, dtype=np.uint8)
    if dtype == torch.bool:
        raw %= 2
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 7), max_size=3)))
    base = random_tensor(dtype, shape, draw(st.integers(0, 2**32)))
    form = draw(st.sampled_from(["plain", "transposed", "strided", "slice"]))
    if form == "transposed" and base.dim() >= 2:
        return base.transpose(0, 1)
    if form == "strided" and base.dim() >= 1:
        return base[::2]
    if form == "slice" and base.dim() >= 1 and base.shape[0] > 1:
        return base[1:]
    return base


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    tensors(),
    tensors().map(lambda t: t.numpy() if t.dtype in (torch.float32, torch.int64) else t),
    st.sampled_from([np.float32(1.5), np.int16(-3), np.float64("nan"), np.bool_(True)]),
)

state_dicts = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=5), st.integers(-5, 5)), children, max_size=4),
    ),
    max_leaves=12,
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(state=st.dictionaries(st.text(min_size=1, max_size=6), state_dicts, max_size=5))
def test_round_trip_is_bit_exact_for_every_dtype_and_structure(
    node: tuple[Daemon, Client], state: dict[str, Any]
) -> None:
    _, client = node
    name = f"local/prop/{time.monotonic_ns()}"
    ckpt.save(state, name, client=client)
    assert_same(ckpt.load(name, client=client), state)


def test_tied_views_empty_and_zero_dim_tensors(node: tuple[Daemon, Client]) -> None:
    _, client = node
    weight = torch.randn(64, 32)
    state = {
        "embed": weight,
        "lm_head": weight,  # tied: the same tensor
        "row": weight[3],  # a view of the same storage, not the same tensor
        "cols": weight[:, ::4],
        "empty": torch.empty(0, 5, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "big": torch.randn(600, 600),  # over OWN_SEGMENT_BYTES: a segment of its own
        "rng": torch.get_rng_state(),
        "np_rng": np.random.default_rng(0).bit_generator.state,
    }
    ckpt.save(state, "local/views/1", client=client)
    back = ckpt.load("local/views/1", client=client)
    assert_same(back, state)
    assert back["lm_head"] is back["embed"]
    assert back["row"] is not back["embed"]
    z = torch.randn(8, dtype=torch.complex64)
    ckpt.save({"z": z, "zc": z.conj(), "zn": z._neg_view()}, "local/views/2", client=client)
    back = ckpt.load("local/views/2", client=client)
    assert torch.equal(back["zc"], z.conj().resolve_conj())
    assert torch.equal(back["zn"], -z)
    # Tied in the checkpoint, separate in the target: both are filled in place.
    target = {k: torch.zeros_like(v) for k, v in state.items() if k in ("embed", "lm_head")}
    ckpt.load_into(target, "local/views/1", strict=False, client=client)
    assert torch.equal(target["embed"], weight)
    assert torch.equal(target["lm_head"], weight)
    assert target["embed"] is not target["lm_head"]


def test_load_into_fills_tensors_in_place(node: tuple[Daemon, Client]) -> None:
    _, client = node
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.LayerNorm(300))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 300)).sum().backward()
    optim.step()
    saved = {"model": model.state_dict(), "optim": optim.state_dict(), "step": 12}
    ckpt.save(saved, "local/inplace/1", client=client)
    expected = {"model": {k: v.clone() for k, v in saved["model"].items()}}

    fresh = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.LayerNorm(300))
    target = {
        "model": fresh.state_dict(),
        "optim": torch.optim.AdamW(fresh.parameters()).state_dict(),
        "step": 0,
    }
    before = {k: v.data_ptr() for k, v in target["model"].items()}
    pinned = (
        torch.empty(300, 300).pin_memory() if torch.cuda.is_available() else torch.empty(300, 300)
    )
    target["model"]["0.weight"] = pinned
    before["0.weight"] = pinned.data_ptr()
    ckpt.load_into(target, "local/inplace/1", strict=False, client=client)
    for key, value in target["model"].items():
        assert value.data_ptr() == before[key], key  # the same storage, filled in place
        assert torch.equal(value, expected["model"][key]), key
    assert target["step"] == 12
    assert target["optim"]["state"][0]["exp_avg"].shape == (300, 300)

    wrong = {"model": {k: torch.zeros(1) for k in saved["model"]}, "optim": {}, "step": 0}
    with pytest.raises(CheckpointError, match=r"model\.0\.weight"):
        ckpt.load_into(wrong, "local/inplace/1", client=client)


# -- safety ------------------------------------------------------------------------------


def test_unsupported_object_fails_before_staging_and_names_its_path(
    node: tuple[Daemon, Client],
) -> None:
    daemon, client = node
    state = {"model": {"w": torch.ones(3)}, "sched": {"fn": [1, lambda x: x]}}
    with pytest.raises(UnsupportedStateError, match=r"sched\.fn\[1\]"):
        ckpt.save(state, "local/bad/1", client=client)
    with pytest.raises(UnsupportedStateError, match="key"):
        ckpt.save({"m": {(1, 2): 3}}, "local/bad/2", client=client)
    assert daemon.metric("chunkd_checkpoint_saves_total", outcome="started") == 0
    with pytest.raises(CheckpointNotFoundError):
        ckpt.load("local/bad/1", client=client)


def test_overwrite_is_refused_unless_asked(node: tuple[Daemon, Client]) -> None:
    _, client = node
    ckpt.save({"v": torch.zeros(4)}, "local/ow/1", client=client)
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        ckpt.save({"v": torch.ones(4)}, "local/ow/1", client=client)
    ckpt.save({"v": torch.ones(4)}, "local/ow/1", overwrite=True, client=client)
    assert torch.equal(ckpt.load("local/ow/1", client=client)["v"], torch.ones(4))


def test_read_only_backend_and_unknown_backend_fail_at_save(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = start_daemon(cwd=tmp_path / "ro", env={"CHUNKD_BACKENDS_LOCAL_WRITABLE": "false"})
    with Client(daemon.cwd / "chunkd.sock") as client:
        with pytest.raises(ReadOnlyBackendError, match="writable = true"):
            ckpt.save({"v": torch.zeros(2)}, "local/x/1", client=client)
        with pytest.raises(LookupError, match="no backend named 'nope'"):
            ckpt.save({"v": torch.zeros(2)}, "nope/x/1", client=client)
        with pytest.raises(ValueError, match="BACKEND/PATH"):
            ckpt.save({"v": torch.zeros(2)}, "local", client=client)
        with pytest.raises(ValueError, match=r"\.\."):
            ckpt.save({"v": torch.zeros(2)}, "local/a/../b", client=client)


def test_refused_credentials_fail_at_save_not_a_hang(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    server = S3Server.start(checks_credentials_after=1)
    try:
        server.client().create_bucket(Bucket="locked")
        daemon = start_daemon(
            f"""
[cache]
dir = "{tmp_path / "cache"}"
fsync = "never"
disk_min_free_bytes = 0
{refused_backend(server.endpoint, writable=True)}""",
            cwd=tmp_path / "vault",
        )
        with Client(daemon.cwd / "chunkd.sock") as client:
            started = time.monotonic()
            with pytest.raises(BackendForbiddenError, match="'vault'"):
                ckpt.save({"v": torch.zeros(2)}, "vault/x/1", client=client)
            assert time.monotonic() - started < 10
    finally:
        server.stop()


def chunk_of(manifest: dict[str, Any], key: str) -> str:
    """The first chunk id holding top-level value ``key`` of part 0."""
    part = manifest["parts"][0]
    node = dict(zip(part["tree"]["keys"], part["tree"]["values"], strict=True))[key]
    return part["segments"][node["seg"]]["chunks"][0][0]


def test_damaged_or_missing_chunk_fails_the_load_naming_the_tensor(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    first = start_daemon(cwd=tmp_path / "a")
    state = {"layers.0.weight": torch.randn(512, 512), "layers.1.weight": torch.randn(512, 512)}
    with Client(first.cwd / "chunkd.sock") as client:
        ckpt.save(state, "local/dmg/1", client=client)
        manifest = ckpt.manifest("local/dmg/1", client=client)
    data = first.cwd / "chunkd-data"
    damaged = data / "chunks" / chunk_of(manifest, "layers.0.weight")
    raw = bytearray(damaged.read_bytes())
    raw[100] ^= 0xFF
    damaged.write_bytes(raw)
    # A second node over the same backend: its cache has none of the chunks. (One fault
    # at a time: each node starts its pass over the chunks at an offset of its own, so
    # with both faults at once either could be met first.)
    backend = {"CHUNKD_BACKENDS_LOCAL_URL": f"file://{data}"}
    second = start_daemon(cwd=tmp_path / "b", env=backend)
    with Client(second.cwd / "chunkd.sock") as client:
        with pytest.raises(IntegrityError, match=r"layers\.0\.weight"):
            ckpt.load("local/dmg/1", client=client)
        assert second.metric("chunkd_checkpoint_integrity_failures_total") >= 1
        raw[100] ^= 0xFF  # repaired: the damaged copy was never cached
        damaged.write_bytes(raw)
        assert_same(ckpt.load("local/dmg/1", client=client), state)
    (data / "chunks" / chunk_of(manifest, "layers.1.weight")).unlink()
    third = start_daemon(cwd=tmp_path / "c", env=backend)  # a cold cache again
    with (
        Client(third.cwd / "chunkd.sock") as client,
        pytest.raises(CheckpointError, match=r"layers\.1\.weight"),
    ):
        ckpt.load("local/dmg/1", client=client)


def test_torn_or_missing_manifest_means_no_checkpoint(node: tuple[Daemon, Client]) -> None:
    daemon, client = node
    ckpt.save({"v": torch.zeros(4)}, "local/torn/1", client=client)
    manifest = daemon.cwd / "chunkd-data" / "checkpoints" / "torn" / "1" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:20])
    with pytest.raises(CheckpointNotFoundError, match="torn"):
        ckpt.load("local/torn/1", client=client)
    assert ckpt.list("local/torn", client=client) == []
    with pytest.raises(CheckpointNotFoundError):
        ckpt.load("local/never/1", client=client)


# -- dedup -------------------------------------------------------------------------------

RANK_SCRIPT = """
import sys, torch
from chunkd.client import Client, checkpoint
rank, socket, save_id = int(sys.argv[1]), sys.argv[2], sys.argv[3]
g = torch.Generator().manual_seed(1234)
state = {f"layer{i}": torch.randn(256, 1024, generator=g) for i in range(8)}
state["rank_step"] = rank
with Client(socket) as client:
    r = checkpoint.save(state, "ckpt/ddp/step-1", rank=rank, world_size=4, save_id=save_id,
                        client=client).result()
print(r.logical_bytes, r.new_bytes)
"""


def bucket_bytes(s3_server: S3Server, bucket: str, prefix: str) -> int:
    listing = s3_server.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sum(o["Size"] for o in listing.get("Contents", []))


def test_four_ranks_saving_identical_state_upload_it_once(
    s3_node: tuple[Daemon, Client], s3_server: S3Server, bucket: str
) -> None:
    daemon, _ = s3_node
    socket = str(daemon.cwd / "chunkd.sock")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(r), socket, "sameid"],
            stdout=subprocess.PIPE,
        )
        for r in range(4)
    ]
    outputs = [p.communicate(timeout=90)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    state_bytes = 8 * 256 * 1024 * 4
    assert sum(int(o[0]) for o in outputs) >= 4 * state_bytes
    new = sum(int(o[1]) for o in outputs)
    assert state_bytes <= new <= 1.05 * state_bytes
    written = daemon.metric("chunkd_backend_write_bytes_total", backend="ckpt")
    assert state_bytes <= written <= 1.05 * state_bytes  # chunks once, plus small JSON
    stored = bucket_bytes(s3_server, bucket, "pre/chunks/")
    assert state_bytes <= stored <= 1.01 * state_bytes
    with Client(socket) as client:
        for rank in (0, 3):
            part = ckpt.load("ckpt/ddp/step-1", part=rank, client=client)
            assert part["rank_step"] == rank
        entry = ckpt.list("ckpt/ddp", client=client)[0]
        assert entry["world_size"] == 4
        assert entry["dedup_ratio"] >= 3.9


def test_a_step_that_changed_a_quarter_uploads_about_a_quarter(
    s3_node: tuple[Daemon, Client],
) -> None:
    daemon, client = s3_node
    g = torch.Generator().manual_seed(7)
    state = {f"layer{i}": torch.randn(512, 512, generator=g) for i in range(8)}
    state["step"] = 1
    full = ckpt.save(state, "ckpt/run/step-1", client=client).result()
    for i in range(2):  # 2 of 8 equal tensors: 25% of the bytes
        state[f"layer{i}"] = state[f"layer{i}"] + 1
    state["step"] = 2
    before = daemon.metric("chunkd_backend_write_bytes_total", backend="ckpt")
    step = ckpt.save(state, "ckpt/run/step-2", client=client).result()
    sent = daemon.metric("chunkd_backend_write_bytes_total", backend="ckpt") - before
    assert 0.24 * full.logical_bytes <= step.new_bytes <= 0.26 * full.logical_bytes
    assert sent <= 0.27 * full.logical_bytes
    assert_same(ckpt.load("ckpt/run/step-2", client=client), state)


# -- kill -9 -----------------------------------------------------------------------------

TRAINER_SCRIPT = """
import os, signal, sys, torch
from chunkd.client import Client, checkpoint
g = torch.Generator().manual_seed(99)
state = {f"w{i}": torch.randn(512, 512, generator=g) for i in range(6)}
client = Client(sys.argv[1])
checkpoint.async_save(state, "ckpt/killed/step-5", client=client)
for t in state.values():
    t.zero_()  # training goes on and changes its tensors at once
os.kill(os.getpid(), signal.SIGKILL)
"""


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def committed(client: Client, name: str) -> bool:
    return any(
        e["name"] == name and e["state"] == "committed" for e in ckpt.list(name, client=client)
    )


def test_trainer_killed_after_async_save_still_commits(
    s3_node: tuple[Daemon, Client], s3_proxy: CountingProxy
) -> None:
    daemon, client = s3_node
    s3_proxy.delay_up = 0.01  # the upload is still going when the trainer dies
    trainer = subprocess.run(
        [sys.executable, "-c", TRAINER_SCRIPT, str(daemon.cwd / "chunkd.sock")], check=False
    )
    assert trainer.returncode == -signal.SIGKILL
    s3_proxy.delay_up = 0
    wait_for(lambda: committed(client, "ckpt/killed/step-5"), 60, "the commit")
    g = torch.Generator().manual_seed(99)
    expected = {f"w{i}": torch.randn(512, 512, generator=g) for i in range(6)}
    assert_same(ckpt.load("ckpt/killed/step-5", client=client), expected)


def test_daemon_killed_after_local_save_resumes_the_upload(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    toml = s3_toml(tmp_path, bucket, s3_proxy)
    daemon = start_daemon(toml, cwd=tmp_path / "n")
    state = {f"w{i}": torch.randn(512, 512) for i in range(6)}
    s3_proxy.delay_up = 0.05  # the upload cannot finish before the kill
    with Client(daemon.cwd / "chunkd.sock") as client:
        handle = ckpt.save(state, "ckpt/resume/step-9", durability="local", client=client)
        assert handle.result().durability in ("local", "remote")
        daemon.process.kill()
        daemon.process.wait()
        s3_proxy.delay_up = 0
        restarted = start_daemon(toml, cwd=tmp_path / "n", port=daemon.port)
        assert wait_for_socket(restarted.cwd / "chunkd.sock", 30)
        wait_for(lambda: committed(client, "ckpt/resume/step-9"), 60, "the resumed commit")
        assert_same(ckpt.load("ckpt/resume/step-9", client=client), state)
        log = restarted.log.read_text()
        assert "resuming checkpoint ckpt/resume/step-9" in log


def test_a_restore_from_a_slow_steady_backend_reads_each_chunk_once(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    # Each 4 MiB chunk takes about twice the backend timeout to arrive, though no read
    # of it stalls: many restores sharing one slow link look like this.
    state = {f"w{i}": torch.randn(1024, 1024) for i in range(2)}  # a 4 MiB chunk each
    saver = start_daemon(s3_toml(tmp_path, bucket, s3_proxy, name="saver"), cwd=tmp_path / "s")
    with Client(saver.cwd / "chunkd.sock") as client:
        ckpt.save(state, "ckpt/slow/step-1", client=client)
    saver.stop()
    short = s3_toml(tmp_path, bucket, s3_proxy, name="cold").replace('"5s"', '"2s"')
    cold = start_daemon(short, cwd=tmp_path / "cold")
    s3_proxy.reset()
    s3_proxy.delay = 4.0 / 64  # per 64 KiB: about 4 s for a chunk
    try:
        with Client(cold.cwd / "chunkd.sock", timeout=60) as client:
            loaded = ckpt.load("ckpt/slow/step-1", client=client)
    finally:
        s3_proxy.delay = 0
    assert_same(loaded, state)
    size = 2 * 4 * MiB
    assert size <= s3_proxy.bytes_down < size + (256 << 10)  # no chunk read twice


@pytest.mark.timeout(240)
def test_daemon_killed_mid_save_leaves_all_or_nothing(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    toml = s3_toml(tmp_path, bucket, s3_proxy)
    state = {f"w{i}": torch.randn(1024, 512) for i in range(4)}
    outcomes = []
    for attempt, delay in enumerate((0.0, 0.15, 0.4, 0.8, 1.5)):
        daemon = start_daemon(toml, cwd=tmp_path / "m")
        name = f"ckpt/chaos/step-{attempt}"
        s3_proxy.delay_up = 0.01
        with Client(daemon.cwd / "chunkd.sock") as client:
            handle = ckpt.async_save(state, name, durability="local", client=client)
            time.sleep(delay)
            daemon.process.kill()
            daemon.process.wait()
            del handle
        s3_proxy.delay_up = 0
        restarted = start_daemon(toml, cwd=tmp_path / "m", port=daemon.port)
        with Client(restarted.cwd / "chunkd.sock") as client:

            def settled(restarted: Daemon = restarted) -> bool:
                status, _, body = restarted.get("/v1/stats")
                return status == 200 and not json.loads(body)["checkpoints"]["jobs"]

            wait_for(settled, 60, "resumed saves to finish")
            try:
                back = ckpt.load(name, client=client)
            except CheckpointNotFoundError:
                outcomes.append("absent")
            else:
                assert_same(back, state)
                outcomes.append("complete")
        restarted.stop()
    assert "complete" in outcomes  # a kill after the local level always completes


def restart(daemon: Daemon, start_daemon: Callable[..., Daemon], toml: str | None) -> Daemon:
    """Kill ``daemon`` with -9 and start it again, on the same cache, socket and port."""
    daemon.process.kill()
    daemon.process.wait()
    again = start_daemon(toml, cwd=daemon.cwd, port=daemon.port)
    assert wait_for_socket(again.cwd / "chunkd.sock", 30)
    return again


def test_wait_after_a_restart_finds_saves_that_were_committed(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = start_daemon(cwd=tmp_path / "n")
    state = {"w": torch.randn(512, 512)}
    with Client(daemon.cwd / "chunkd.sock") as client:
        # Acknowledged at local, then committed, then the daemon is killed: the job
        # (and its journal) is gone, the checkpoint is not.
        handle = ckpt.save(state, "local/after/step-1", durability="local", client=client)
        wait_for(lambda: committed(client, "local/after/step-1"), 30, "the commit")
        # A DCP-style part (commit="none"): done once the part is in the backend.
        part = ckpt.async_save(
            state, "local/after/step-2", save_id="dcp2", _commit="none", client=client
        )
        assert part.wait(30)
        manifest_id = ckpt.manifest("local/after/step-1", client=client)["manifest_id"]
        restart(daemon, start_daemon, None)
        assert handle.wait(30, level="remote")
        result = handle.result()
        assert (result.durability, result.manifest_id) == ("remote", manifest_id)
        assert result.logical_bytes == 512 * 512 * 4
        assert part.wait(30, level="remote")
        ckpt.commit("local/after/step-2", "dcp2", 1, client=client)
        assert_same(ckpt.load("local/after/step-2", client=client), state)
        with pytest.raises(CheckpointExistsError):  # it was saved: not to be saved again
            ckpt.save(state, "local/after/step-1", client=client)


def test_wait_after_a_restart_says_a_save_was_lost_when_nothing_of_it_is_anywhere(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    # A disk tier too small for the chunks: no local level, no journal; the backend
    # is down, so nothing of the save reaches it before the daemon is killed.
    toml = s3_toml(tmp_path, bucket, s3_proxy).replace('"2GiB"', '"1MiB"')
    daemon = start_daemon(toml, cwd=tmp_path / "n")
    with Client(daemon.cwd / "chunkd.sock") as client:
        s3_proxy.down()
        handle = ckpt.async_save(
            {"w": torch.randn(1024, 1024)}, "ckpt/lost/step-1", durability="staged", client=client
        )
        assert handle.wait(10)
        assert not handle.wait(0.5, level="local")
        s3_proxy.up()
        restart(daemon, start_daemon, toml)
        with pytest.raises(CheckpointError, match="holds neither its part nor a manifest"):
            handle.wait(30)
        ckpt.save({"w": torch.ones(4)}, "ckpt/lost/step-1", client=client)  # the name is free


def test_wait_after_a_restart_tells_a_save_that_failed(
    start_daemon: Callable[..., Daemon], tmp_path: Path, bucket: str, s3_proxy: CountingProxy
) -> None:
    toml = s3_toml(tmp_path, bucket, s3_proxy)
    daemon = start_daemon(toml, cwd=tmp_path / "n")
    with Client(daemon.cwd / "chunkd.sock") as client:
        s3_proxy.down()
        handle = ckpt.save(
            {"w": torch.randn(1024, 1024)}, "ckpt/failed/step-1", durability="local", client=client
        )
        # Killed while the backend is down; the job's chunks are then lost from the
        # node's disk: the restarted daemon cannot finish the job, and records why.
        daemon.process.kill()
        daemon.process.wait()
        for chunk in (tmp_path / "cache" / "chunks").rglob("*"):
            if chunk.is_file():
                chunk.unlink()
        s3_proxy.up()
        again = restart(daemon, start_daemon, toml)
        gone = "gone from the node's disk|no longer on this node's disk"
        with pytest.raises(CheckpointError, match=gone) as first:
            handle.wait(30)
        restart(again, start_daemon, toml)  # a second restart: the job is gone from memory
        with pytest.raises(CheckpointError, match=gone) as second:
            handle.wait(30)
        assert str(second.value) == str(first.value)
        with pytest.raises(CheckpointNotFoundError):
            ckpt.load("ckpt/failed/step-1", client=client)


def test_backend_down_delays_the_commit_and_loses_nothing(
    s3_node: tuple[Daemon, Client], s3_proxy: CountingProxy
) -> None:
    _, client = s3_node
    state = {"w": torch.randn(256, 256)}
    s3_proxy.down()
    handle = ckpt.async_save(state, "ckpt/outage/step-1", durability="local", client=client)
    assert handle.wait(30)  # durable on the node's disk without the backend
    assert not handle.wait(1, level="remote")
    s3_proxy.up()
    assert handle.wait(60, level="remote")
    assert_same(ckpt.load("ckpt/outage/step-1", client=client), state)


# -- GC and listing ----------------------------------------------------------------------


def test_gc_sweeps_only_unreferenced_chunks_and_keeps_concurrent_saves(
    node: tuple[Daemon, Client],
) -> None:
    daemon, client = node
    shared = torch.randn(512, 512)
    ckpt.save({"shared": shared, "own": torch.randn(512, 512)}, "local/gc/step-1", client=client)
    ckpt.save({"shared": shared, "own": torch.randn(512, 512)}, "local/gc/step-2", client=client)
    ckpt.save({"shared": shared, "own": torch.randn(512, 512)}, "local/gc/step-3", client=client)
    chunks = daemon.cwd / "chunkd-data" / "chunks"
    assert len(list(chunks.iterdir())) == 4
    socket = str(daemon.cwd / "chunkd.sock")

    def chunkd(*args: str) -> str:
        done = subprocess.run(
            [str(Path(sys.executable).parent / "chunkd"), *args, "--socket", socket],
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout

    listing = chunkd("ckpt", "ls", "local/gc")
    assert "local/gc/step-1" in listing
    assert "remote" in listing
    dry = chunkd("gc", "local/gc", "--keep-last", "2", "--grace", "0s", "--dry-run")
    assert "would remove checkpoint local/gc/step-1" in dry
    assert len(list(chunks.iterdir())) == 4
    young = chunkd("gc", "local/gc", "--keep-last", "2")  # the default grace: 1h
    assert "removed checkpoint local/gc/step-1" in young
    assert len(list(chunks.iterdir())) == 4  # unreferenced, but younger than the grace
    # Each save's intent outlives its commit (a collection that started before the
    # save must not sweep what it deduplicated against), for a day.
    chunkd("gc", "local/gc", "--grace", "0s")
    assert len(list(chunks.iterdir())) == 4
    intents = daemon.cwd / "chunkd-data" / "intents"
    two_days_ago = time.time() - 2 * 86400
    for old in intents.iterdir():
        os.utime(old, (two_days_ago, two_days_ago))
    # A save in flight (its intent is written, its manifest is not) keeps its chunks.
    inflight = intents / "inflight.0.json"
    inflight.write_text(json.dumps({"chunks": [c.name for c in chunks.iterdir()]}))
    chunkd("gc", "local/gc", "--grace", "0s")
    assert len(list(chunks.iterdir())) == 4
    assert [p.name for p in intents.iterdir()] == ["inflight.0.json"]  # old ones expired
    inflight.unlink()
    out = chunkd("gc", "local/gc", "--grace", "0s")
    assert "removed 1" in out
    assert len(list(chunks.iterdir())) == 3
    assert [e["name"] for e in ckpt.list("local/gc", client=client)] == [
        "local/gc/step-2",
        "local/gc/step-3",
    ]
    for name in ("local/gc/step-2", "local/gc/step-3"):
        assert torch.equal(ckpt.load(name, client=client)["shared"], shared)
    with pytest.raises(CheckpointNotFoundError):
        ckpt.load("local/gc/step-1", client=client)
    assert ckpt.delete("local/gc/step-2", client=client) == 2  # the manifest and its part
    with pytest.raises(CheckpointNotFoundError):
        ckpt.delete("local/gc/step-2", client=client)


def test_retention_matches_whole_path_components(node: tuple[Daemon, Client]) -> None:
    daemon, client = node
    for run in ("run1", "run10"):
        ckpt.save({"w": torch.full((4,), float(len(run)))}, f"local/ret/{run}/s-1", client=client)
    assert [e["name"] for e in ckpt.list("local/ret/run1", client=client)] == ["local/ret/run1/s-1"]
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "chunkd"),
            "gc",
            "local/ret/run1",
            "--keep-last",
            "0",
            "--socket",
            str(daemon.cwd / "chunkd.sock"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "removed checkpoint local/ret/run1/s-1" in done.stdout
    assert "run10" not in done.stdout
    assert torch.equal(ckpt.load("local/ret/run10/s-1", client=client)["w"], torch.full((4,), 5.0))


def test_durability_levels_are_reached_in_order(node: tuple[Daemon, Client]) -> None:
    _, client = node
    state = {"w": torch.randn(1024, 1024)}
    handle = ckpt.async_save(state, "local/levels/step-1", durability="staged", client=client)
    assert handle.wait(30)
    assert handle.wait(30, level="local")
    assert handle.wait(30, level="remote")
    result = handle.result()
    assert result.durability == "remote"
    assert result.logical_bytes == 4 * MiB


def test_reader_reads_single_values_and_tied_ones_alone(node: tuple[Daemon, Client]) -> None:
    _, client = node
    weight = torch.randn(256, 256)
    ckpt.save({"embed": weight, "head": weight, "bias": torch.ones(3)}, "local/rd/1", client=client)
    with ckpt.CheckpointReader("local/rd/1", client=client) as reader:
        assert set(reader.values) == {"embed", "head", "bias"}
        assert torch.equal(reader.read(["head"])["head"], weight)
        assert torch.equal(reader.read(["bias"])["bias"], torch.ones(3))


GLOO_SCRIPT = """
import os, sys, torch, torch.distributed as dist
from chunkd.client import Client, checkpoint
rank, port, socket = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
state = {"shard": torch.full((128, 128), float(rank)), "common": torch.arange(100_000.0)}
with Client(socket) as client:
    result = checkpoint.save(state, "local/gloo/step-3", client=client).result()
    dist.barrier()
    back = checkpoint.load("local/gloo/step-3", client=client)
assert torch.equal(back["shard"], state["shard"]), rank
print(result.durability, result.new_bytes, flush=True)
dist.destroy_process_group()
os._exit(0)  # past the work: gloo's threads may abort the interpreter's teardown
"""


def test_ranks_under_torch_distributed_agree_on_one_save(node: tuple[Daemon, Client]) -> None:
    from chunkd.testing import free_port

    daemon, client = node
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", GLOO_SCRIPT, str(r), port, str(daemon.cwd / "chunkd.sock")],
            stdout=subprocess.PIPE,
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=90)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert [o[0] for o in outputs] == [b"remote", b"remote"]
    manifest = ckpt.manifest("local/gloo/step-3", client=client)
    assert manifest["world_size"] == 2
    assert len({p["save_id"] for p in manifest["parts"]}) == 1
    assert torch.equal(
        ckpt.load("local/gloo/step-3", part=1, client=client)["shard"], torch.ones(128, 128)
    )
    # "common" is the same on both ranks (and large enough for chunks of its own):
    # it is uploaded once.
    assert sum(int(o[1]) for o in outputs) == 2 * 128 * 128 * 4 + 400_000


GLOO_BAD_SCRIPT = """
import os, sys, torch, torch.distributed as dist
from chunkd.client import Client, checkpoint
from chunkd.errors import UnsupportedStateError
rank, port, socket = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
state = {"w": torch.ones(4), "hook": (lambda: 0) if rank == 1 else 0}
with Client(socket) as client:
    try:
        checkpoint.save(state, "local/gloo-bad/step-1", client=client)
    except UnsupportedStateError as exc:
        print("refused:", exc, flush=True)
dist.destroy_process_group()
os._exit(0)  # past the work: gloo's threads may abort the interpreter's teardown
"""


def test_a_rank_that_cannot_save_stops_every_rank_before_staging(
    node: tuple[Daemon, Client],
) -> None:
    from chunkd.testing import free_port

    daemon, client = node
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", GLOO_BAD_SCRIPT, str(r), port, str(daemon.cwd / "chunkd.sock")],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=90)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert "another rank cannot save" in outputs[0]
    assert "rank 1" in outputs[0]
    assert "hook" in outputs[1]
    assert daemon.metric("chunkd_checkpoint_saves_total", outcome="started") == 0
    with pytest.raises(CheckpointNotFoundError):
        ckpt.load("local/gloo-bad/step-1", client=client)


def test_a_commit_repeated_for_the_same_save_is_the_same_commit(
    node: tuple[Daemon, Client],
) -> None:
    _, client = node
    handle = ckpt.async_save(
        {"w": torch.ones(8)}, "local/twice/1", save_id="once", _commit="none", client=client
    )
    assert handle.wait(30)
    first = ckpt.commit("local/twice/1", "once", 1, client=client)
    assert ckpt.commit("local/twice/1", "once", 1, client=client) == first  # a retry
    other = ckpt.async_save(
        {"w": torch.zeros(8)},
        "local/twice/1",
        save_id="other",
        _commit="none",
        overwrite=True,
        client=client,
    )
    assert other.wait(30)
    with pytest.raises(CheckpointExistsError, match="committed by another save"):
        ckpt.commit("local/twice/1", "other", 1, client=client)
    assert torch.equal(ckpt.load("local/twice/1", client=client)["w"], torch.ones(8))


def test_a_chunk_no_tier_keeps_is_fetched_once_for_every_waiter(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    # Budgets smaller than one chunk: neither RAM nor disk keeps a fetched chunk, so
    # the readers that waited for the fetch are served with its bytes, not by another.
    small = {"CHUNKD_CACHE_RAM_BYTES": "1MiB", "CHUNKD_CACHE_DISK_BYTES": "1MiB"}
    daemon = start_daemon(cwd=tmp_path / "tight", env=small)
    weight = torch.randn(1024, 1024)  # one 4 MiB chunk
    with Client(daemon.cwd / "chunkd.sock") as client:
        ckpt.save({"w": weight}, "local/tight/1", client=client)
        cid = chunk_of(ckpt.manifest("local/tight/1", client=client), "w")
        gets = daemon.metric("chunkd_backend_requests_total", op="get")
        # The same chunk eight times in one request: eight readers of one fetch.
        reply, _, fds = client._request(
            {"op": "ckpt_chunks", "backend": "local", "ids": [cid] * 8}, "loading"
        )
        try:
            assert reply["sizes"] == [4 * MiB] * 8
            for fd in fds:
                assert os.pread(fd, 4 * MiB, 0) == tensor_bytes(weight)
        finally:
            for fd in fds:
                os.close(fd)
        assert daemon.metric("chunkd_backend_requests_total", op="get") - gets == 1
        assert torch.equal(ckpt.load("local/tight/1", client=client)["w"], weight)
