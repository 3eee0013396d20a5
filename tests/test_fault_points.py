"""The fault walk: every fault point, with a crash and with an I/O error.

:data:`chunkd.faults.POINTS` lists each point once; this walk runs every one of them
with ``crash`` (the daemon kills itself with SIGKILL there) and with ``eio`` (the step
fails with EIO every time it is reached), so a new point is walked as soon as it is
listed. Each run:

1. starts node A with that one fault armed, peered with a healthy node B over one
   writable ``file://`` backend, on a cache small enough that chunks are evicted and
   read back from disk;
2. runs a workload that reaches every point: a save acknowledged at ``local``, one at
   ``remote``, cold reads on A (chunks from the backend and from B), reads on B
   (chunks A sends), and a second pass on A (disk reads, evictions);
3. checks that the point was reached, that no read returned a wrong byte, and, under
   EIO, that no read failed at all (a failing disk or peer costs speed, never a read);
4. kills A, starts it again without faults, and checks the invariants: every
   acknowledged save is there and loads bit for bit, no partial checkpoint is
   visible, every byte reads right from both nodes, and A's index and disk agree.
"""

from __future__ import annotations

import errno
import json
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest

from chunkd import faults
from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.errors import CheckpointNotFoundError, ChunkdError
from chunkd.testing import free_port
from chunkd.testing.soundness import assert_cache_sound
from tests.conftest import Daemon, wait_for_socket

CHUNK = 256 << 10
FILE_BYTES = 640 << 10  # three chunks, the last one short
FILES = 6
TOKEN = "a-token-for-the-fault-walk"


def node_toml(root: Path, name: str, port: int, peer: int, data: Path) -> str:
    """A node of two on loopback: a tiny cache (evictions, disk reads), one file backend."""
    return f"""
[server]
listen = "127.0.0.1:{port}"
socket = "{root / name / "chunkd.sock"}"
shutdown_timeout = "5s"

[cache]
dir = "{root / name / "cache"}"
chunk_bytes = "256KiB"
ram_bytes = "1MiB"
disk_bytes = "3MiB"
disk_min_free_bytes = 0
fsync = "never"
disk_retry_after = "1s"

[peers]
self = "127.0.0.1:{port}"
members = ["127.0.0.1:{port}", "127.0.0.1:{peer}"]
token_file = "{root / "token"}"
timeout = "1s"
health_interval = "100ms"
down_after = 2
up_after = 1

[[backends]]
name = "data"
url = "file://{data}"
writable = true
"""


@dataclass
class Walk:
    """The two nodes' setting: B stays up for the whole walk, A is started per case."""

    root: Path
    data: Path
    port_a: int
    port_b: int
    b: Daemon
    start: Callable[..., Daemon]
    #: every checkpoint a case saved: name -> its state (to compare loads with)
    states: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)

    def toml_a(self) -> str:
        return node_toml(self.root, "a", self.port_a, self.port_b, self.data)


@pytest.fixture
def walk(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Walk:
    data = tmp_path / "data"
    data.mkdir()
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    port_a, port_b = free_port(), free_port()
    b = start_daemon(
        node_toml(tmp_path, "b", port_b, port_a, data),
        cwd=tmp_path / "b",
        port=port_b,
        env={"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{port_b}"},
    )
    return Walk(tmp_path, data, port_a, port_b, b, start_daemon)


def write_files(data: Path, prefix: str, seed: int) -> dict[str, bytes]:
    """FILES fresh objects under ``prefix`` (no node has seen them): name -> bytes."""
    rng = np.random.default_rng(seed)
    (data / prefix).mkdir(parents=True, exist_ok=True)
    written = {}
    for i in range(FILES):
        body = rng.integers(0, 256, FILE_BYTES, dtype=np.uint8).tobytes()
        (data / prefix / f"f{i}").write_bytes(body)
        written[f"data/{prefix}/f{i}"] = body
    return written


def state_of(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.standard_normal(48 << 10).astype(np.float32) for i in range(3)}


def alive(daemon: Daemon) -> bool:
    return daemon.process.poll() is None


def start_a(walk: Walk, env: dict[str, str]) -> Daemon:
    """Start A (armed with ``env``'s faults) and wait until it serves, or died trying."""
    a = walk.start(
        walk.toml_a(),
        cwd=walk.root / "a",
        port=walk.port_a,
        env={"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{walk.port_a}", **env},
        extra_args=("--enable-faults",) if env else (),
        wait=False,
    )
    deadline = time.monotonic() + 30
    while alive(a) and not ready(a):
        assert time.monotonic() < deadline, f"node A never started: {a.log.read_text()[-3000:]}"
        time.sleep(0.05)
    return a


def ready(daemon: Daemon) -> bool:
    """Whether ``daemon`` answers on both doors (a fault may kill it while it starts)."""
    try:
        return daemon.get("/readyz")[0] == 200 and wait_for_socket(daemon.cwd / "chunkd.sock", 1)
    except OSError:
        return False


def b_sees_a(walk: Walk, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if walk.b.metric("chunkd_peer_healthy") >= 2:
            return True
        time.sleep(0.05)
    return False


@dataclass
class Outcome:
    """What the workload saw."""

    acked: dict[str, str] = field(default_factory=dict)  # checkpoint -> durability acked
    failures: list[str] = field(default_factory=list)  # operations that failed, and why


def workload(walk: Walk, a: Daemon, case: str, seed: int) -> Outcome:
    """Drive A (and B through A) until it is done or A is dead."""
    out = Outcome()
    on_a = write_files(walk.data, f"{case}/a", seed)
    on_b = write_files(walk.data, f"{case}/b", seed + 1)

    def attempt(what: str, step: Callable[[], Any]) -> Any:
        if not alive(a):
            return None
        try:
            return step()
        except (ChunkdError, OSError) as exc:
            out.failures.append(f"{what}: {type(exc).__name__}: {exc}")
            return None

    def read_all(client: Client, files: dict[str, bytes], where: str) -> None:
        for name, body in files.items():
            got = attempt(f"read {name} on {where}", lambda n=name: bytes(client.read(n)))
            if got is not None:
                assert got == body, f"{where} served wrong bytes for {name}"

    # A short timeout: a client waits that long for a killed daemon to come back.
    with Client(a.cwd / "chunkd.sock", timeout=3) as client:
        for durability in ("local", "remote"):
            name = f"data/{case}/ckpt-{durability}"
            state = walk.states[name] = state_of(seed + len(durability))
            result = attempt(
                f"save {name}",
                lambda n=name, s=state, d=durability: ckpt.save(
                    s, n, durability=d, client=client
                ).result(),
            )
            if result is not None:
                out.acked[name] = result.durability
        read_all(client, on_a, "A")
        if alive(a) and b_sees_a(walk):
            with Client(walk.b.cwd / "chunkd.sock", timeout=20) as on_node_b:
                for name, body in on_b.items():
                    assert bytes(on_node_b.read(name)) == body, f"B served wrong bytes for {name}"
        read_all(client, on_a, "A, again")  # RAM holds 4 chunks: these come from disk
        read_all(client, on_b, "A")
    return out


def settle(daemon: Daemon, timeout: float = 45) -> None:
    """Wait until ``daemon`` has no checkpoint job left (resumed ones included)."""
    deadline = time.monotonic() + timeout
    while True:
        status, _, body = daemon.get("/v1/stats")
        jobs = json.loads(body)["checkpoints"]["jobs"] if status == 200 else None
        if jobs is not None and all(j.get("state") in ("done", "failed") for j in jobs):
            return
        assert time.monotonic() < deadline, f"checkpoint jobs never settled: {jobs}"
        time.sleep(0.1)


def check_invariants(walk: Walk, a: Daemon, case: str, out: Outcome) -> None:
    with Client(a.cwd / "chunkd.sock", timeout=30) as client:
        # No acknowledged save lost: local and remote ones both load, bit for bit.
        for name in out.acked:
            try:
                back = ckpt.load(name, client=client)
            except CheckpointNotFoundError:
                said = [
                    line
                    for line in a.log.read_text(errors="replace").splitlines()
                    if "checkpoint" in line and "GET /v1/stats" not in line
                ]
                pytest.fail(
                    f"acknowledged save {name} ({out.acked[name]}) lost: " + "\n".join(said)
                )
            expected = walk.states[name]
            assert list(back) == list(expected), name
            for key, array in expected.items():
                assert back[key].tobytes() == array.tobytes(), f"{name}.{key} came back wrong"
        # No partial checkpoint visible: what is listed loads whole, what does not load
        # is not listed.
        for durability in ("local", "remote"):
            name = f"data/{case}/ckpt-{durability}"
            listed = [e for e in ckpt.list(name, client=client) if e["name"] == name]
            try:
                back = ckpt.load(name, client=client)
            except CheckpointNotFoundError:
                assert not [e for e in listed if e["state"] == "committed"], name
                assert name not in out.acked
            else:
                for key, array in walk.states[name].items():
                    assert back[key].tobytes() == array.tobytes(), f"{name}.{key} came back wrong"
        assert_manifests_whole(walk.data)
        # No wrong byte, from either node.
        for node in (a, walk.b):
            with Client(node.cwd / "chunkd.sock", timeout=30) as reader:
                for side in ("a", "b"):
                    for path in sorted((walk.data / case / side).iterdir()):
                        name = f"data/{case}/{side}/{path.name}"
                        assert bytes(reader.read(name)) == path.read_bytes(), name


def assert_manifests_whole(data: Path) -> None:
    """Every manifest in the backend names parts and chunks that are all there, intact."""
    for manifest in data.glob("**/manifest.json"):
        doc = json.loads(manifest.read_bytes())
        for part in doc["parts"]:
            raw = (data / part["key"]).read_bytes()
            assert blake3.blake3(raw).hexdigest() == part["blake3"], part["key"]
            for cid in chunk_ids(json.loads(raw)):
                body = (data / "chunks" / cid).read_bytes()
                assert blake3.blake3(body).hexdigest() == cid, f"chunk {cid} of {manifest}"


def chunk_ids(doc: Any) -> Iterator[str]:
    """Every chunk id a part document names (64 hex characters under a "chunks" key)."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key == "chunks" and isinstance(value, list):
                for entry in value:
                    cid = entry[0] if isinstance(entry, list) else entry
                    if isinstance(cid, str) and len(cid) == 64:
                        yield cid
            else:
                yield from chunk_ids(value)
    elif isinstance(doc, list):
        for value in doc:
            yield from chunk_ids(value)


CASES = [(point, action) for point in faults.POINTS for action in ("crash", "eio")]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("point", "action"), CASES, ids=[f"{p}:{a}" for p, a in CASES])
def test_every_fault_point_leaves_nothing_lost_and_no_wrong_byte(
    walk: Walk, point: str, action: str
) -> None:
    case = f"{point.replace('.', '-')}-{action}"
    seed = CASES.index((point, action)) * 10
    a = start_a(walk, {"CHUNKD_FAULTS": f"{point}:{action}", "CHUNKD_FAULTS_SEED": str(seed)})
    out = workload(walk, a, case, seed)
    log = a.log.read_text(errors="replace")
    assert "FAULT INJECTION IS ON" in log
    if action == "crash":
        assert a.process.wait(timeout=10) == -signal.SIGKILL, (
            f"the workload never reached {point} (extend it): {out.failures}"
        )
        assert f"chunkd: fault point {point}: crash" in log
    else:
        assert alive(a), f"node A died of an EIO at {point}:\n{log[-3000:]}"
        _, _, body = a.get("/v1/stats")
        hits = json.loads(body)["faults"]["hits"]
        assert hits.get(point, 0) >= 1, f"the workload never reached {point} (extend it)"
        reads = [f for f in out.failures if f.startswith("read ")]
        assert not reads, f"an EIO at {point} failed {len(reads)} reads: {reads[:3]}"
        a.process.kill()
        a.process.wait()
    again = start_a(walk, {})
    assert alive(again)
    settle(again)
    assert b_sees_a(walk)
    check_invariants(walk, again, case, out)
    again.stop()
    files, records = assert_cache_sound(again.cwd / "cache", CHUNK)
    assert records <= files  # the index claims nothing that is not on disk


def test_faults_need_the_switch_and_a_known_point(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    # Set without --enable-faults: ignored, with a warning, and the daemon serves.
    daemon = start_daemon(cwd=tmp_path / "n", env={"CHUNKD_FAULTS": "cache.insert:crash"})
    (daemon.cwd / "chunkd-data").mkdir(exist_ok=True)
    (daemon.cwd / "chunkd-data" / "k").write_bytes(b"x" * 1000)
    with Client(daemon.cwd / "chunkd.sock") as client:
        assert bytes(client.read("local/k")) == b"x" * 1000
    assert "CHUNKD_FAULTS is set (cache.insert:crash) but ignored" in daemon.log.read_text()
    _, _, body = daemon.get("/v1/stats")
    assert json.loads(body)["faults"] is None
    daemon.stop()
    # A typo is refused at start, naming the points there are.
    bad = start_daemon(
        cwd=tmp_path / "m",
        env={"CHUNKD_FAULTS": "disk.renam:crash"},
        extra_args=("--enable-faults",),
        wait=False,
    )
    assert bad.process.wait(timeout=30) == 2
    text = bad.log.read_text()
    assert "unknown fault point 'disk.renam'" in text
    assert "disk.rename" in text


def test_fault_specs_parse_and_fire_as_written() -> None:
    parsed = faults.parse("ckpt.part:crash, disk.rename:eio@0.25#3")
    assert [str(f) for f in parsed] == ["ckpt.part:crash", "disk.rename:eio@0.25#3"]
    for spec in ("disk.rename", "disk.rename:melt", "nowhere:eio", "disk.rename:eio@2"):
        with pytest.raises(ChunkdError):
            faults.parse(spec)
    faults.arm(faults.parse("disk.read:enospc#2"), seed=1)
    try:
        faults.point("disk.write")  # not armed: nothing
        faults.point("disk.read")  # the first time: not yet
        with pytest.raises(OSError, match=r"injected at fault point disk\.read") as caught:
            faults.point("disk.read")
        assert caught.value.errno == errno.ENOSPC
        assert faults.hits() == {"disk.read": 2}
    finally:
        faults.disarm()
    faults.point("disk.read")  # disarmed: nothing
