"""Network chaos on one node's link while four cold nodes restore a checkpoint.

Root only, in network namespaces (:mod:`chunkd.testing.netlab`; skipped otherwise,
saying why). One 32 MiB checkpoint of 128 chunks is saved once; every scenario
starts four cold daemons with peers and hurts node 4's link only:

- random loss (nftables ``numgen`` drops, both directions);
- latency with jitter (a userspace relay in node 4's namespace: segments of
  different connections overtake each other);
- a partition (node 4 cut off from the others and S3): the others mark it down and
  finish their restore; healed, it is marked up by them and sees them all up again,
  no daemon restarted, and its own restore then comes from peers.

Every scenario: every read completes and is bit-exact, and the backend sends at
most 1.05x the checkpoint (plus its JSON, once per node). Each prints its figures.

The relay itself is tested on loopback too (no root): its delay is real, it
reorders between connections and never within one, and it holds back a sender
instead of buffering without bound.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.testing import netlab
from chunkd.testing.relay import PIECE, WINDOW, LatencyRelay, allowed

CHUNK = 256 * 1024
NAME = "ckpt/chaos/step-1"
#: a second checkpoint, which nobody reads before the partition heals
LATER = "ckpt/chaos/step-2"
#: the checkpoint's JSON (manifest and part), which every node reads from the backend
JSON_ALLOWANCE = 65536
CHAOTIC = 4


@dataclass
class Saved:
    """The lab, with the checkpoint saved in its S3 and no daemon running."""

    lab: netlab.Lab
    state: dict[str, torch.Tensor]
    size: int
    later: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Saved]:
    if shutil.which("nft") is None:
        pytest.skip("the network chaos needs nft (make tools installs nftables)")
    try:
        with netlab.lab(tmp_path_factory.mktemp("chaos"), chunk_bytes=CHUNK) as built:
            built.start_s3()
            g = torch.Generator().manual_seed(15)
            state = {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(8)}  # 32 MiB
            size = sum(t.numel() * t.element_size() for t in state.values())
            later = {f"v{i}": torch.randn(1024, 1024, generator=g) for i in range(2)}  # 8 MiB
            built.start_node(1, peers=False)
            with Client(built.socket(1), timeout=120) as client:
                ckpt.save(state, NAME, client=client)
                ckpt.save(later, LATER, client=client)
            built.stop_nodes()
            yield Saved(built, state, size, later)
    except netlab.LabUnavailable as exc:
        pytest.skip(str(exc))


def cold_cluster(lab: netlab.Lab) -> list[subprocess.Popen[bytes]]:
    """Four cold daemons with peers, each seeing all four up."""
    lab.stop_nodes()
    processes = [lab.start_node(i, peers=True) for i in range(1, 5)]
    wait_for(lambda: all(healthy(lab, i) == 4 for i in range(1, 5)), 20, "all four up")
    return processes


def healthy(lab: netlab.Lab, i: int) -> int:
    return int(lab.metric(i, "chunkd_peer_healthy"))


def wait_for(condition: Any, seconds: float, what: str) -> float:
    """Seconds until ``condition()`` holds; fails after ``seconds``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > seconds:
            pytest.fail(f"not {what} after {seconds:g}s")
        time.sleep(0.1)
    return time.monotonic() - started


def restore(saved: Saved, nodes: list[int], name: str = NAME) -> dict[int, float]:
    """Restore checkpoint ``name`` on ``nodes`` at once; every result bit-exact.
    Returns each node's seconds."""
    results: dict[int, Any] = {}
    took: dict[int, float] = {}
    state = saved.state if name == NAME else saved.later

    def load(i: int) -> None:
        started = time.perf_counter()
        try:
            with Client(saved.lab.socket(i), timeout=120) as client:
                results[i] = ckpt.load(name, client=client)
        except Exception as exc:  # reported below
            results[i] = exc
        took[i] = time.perf_counter() - started

    threads = [threading.Thread(target=load, args=(i,)) for i in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    for i in nodes:
        result = results.get(i)
        assert result is not None, f"node {i}'s restore did not finish"
        assert not isinstance(result, Exception), f"node {i}: {result!r}"
        assert result.keys() == state.keys()
        for key, tensor in state.items():
            assert torch.equal(result[key], tensor), f"node {i}: {key} differs"
    return took


def backend_bytes(lab: netlab.Lab, nodes: range = range(1, 5)) -> float:
    return sum(lab.metric(i, "chunkd_backend_read_bytes_total") for i in nodes)


def peer_bytes(lab: netlab.Lab) -> float:
    return sum(lab.metric(i, 'chunkd_peer_bytes_total{direction="in"}') for i in range(1, 5))


def check_backend(saved: Saved) -> float:
    """The backend sent each chunk about once for the whole cluster; the ratio."""
    backend = backend_bytes(saved.lab)
    assert saved.size <= backend <= 1.05 * saved.size + 4 * JSON_ALLOWANCE
    return backend / saved.size


def report(scenario: str, took: dict[int, float], saved: Saved, chaos: netlab.Chaos) -> None:
    """Print a scenario's figures (``pytest -s`` shows them)."""
    lab = saved.lab
    times = ", ".join(f"n{i} {s:.1f}s" for i, s in sorted(took.items()))
    failed = sum(requests(lab, i, "error") for i in range(1, 5))
    line = (
        f"\n[{scenario}] restore {times}; backend {backend_bytes(lab) / saved.size:.3f}x of "
        f"{saved.size >> 20} MiB; from peers {peer_bytes(lab) / 2**20:.0f} MiB; "
        f"failed peer requests {failed:.0f}; n{CHAOTIC} dropped {chaos.lost_packets} "
        f"(loss) + {chaos.cut_packets} (partition) packets"
    )
    if chaos.relay is not None:
        relay = chaos.relay
        line += (
            f"; relay: {relay.connections} connections, "
            f"{(relay.request_bytes + relay.answer_bytes) / 2**20:.1f} MiB, "
            f"{relay.pieces} pieces held {relay.mean_delay * 1000:.1f} ms on average, "
            f"{relay.overtaken} overtook, at most {relay.max_held_bytes / 2**20:.1f} MiB held"
        )
    print(line)


@pytest.mark.timeout(60)
def test_the_loss_rule_drops_about_the_share_it_is_told(saved: Saved) -> None:
    lab = saved.lab
    sent, port = 2000, 9999
    receiver = subprocess.Popen(
        [
            *("ip", "netns", "exec", lab.nodes[CHAOTIC - 1], sys.executable, "-c"),
            "import socket, sys\n"
            "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"s.bind(('{lab.address(CHAOTIC)}', {port})); s.settimeout(2)\n"
            "print('ready', flush=True); n = 0\n"
            "try:\n"
            "    while s.recv(64): n += 1\n"
            "except TimeoutError: pass\n"
            "print(n)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert receiver.stdout is not None
        assert receiver.stdout.readline().strip() == "ready"
        lab.lose(CHAOTIC, 20)
        subprocess.run(
            [
                *("ip", "netns", "exec", lab.nodes[0], sys.executable, "-c"),
                "import socket, time\n"
                "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                f"for _ in range({sent}):\n"
                f"    s.sendto(b'x', ('{lab.address(CHAOTIC)}', {port})); time.sleep(0.0002)\n",
            ],
            check=True,
            timeout=30,
        )
        got = int(receiver.stdout.readline())
    finally:
        receiver.kill()
        receiver.communicate()  # closes its stdout too
        chaos = lab.heal(CHAOTIC)
    print(f"\n[20% loss on n4, UDP from n1] {got} of {sent} arrived; {chaos.lost_packets} dropped")
    # 20% of 2000: 400 dropped, give or take 18 (one standard deviation).
    assert 0.72 * sent <= got <= 0.88 * sent
    assert chaos.lost_packets >= sent - got  # its counter saw them (and any others)


@pytest.mark.timeout(120)
def test_random_loss_on_one_node(saved: Saved) -> None:
    lab = saved.lab
    cold_cluster(lab)
    lab.lose(CHAOTIC, 8)
    try:
        took = restore(saved, [1, 2, 3, 4])
        chaos = lab.chaos(CHAOTIC)
    finally:
        lab.heal(CHAOTIC)
    report("8% loss on n4", took, saved, chaos)
    assert chaos.lost_packets > 100  # the loss was real: TCP lived through it
    check_backend(saved)


@pytest.mark.timeout(120)
def test_latency_with_jitter_on_one_node(saved: Saved) -> None:
    lab = saved.lab
    lab.stop_nodes()
    # Before the daemons start: connections opened earlier (their probes' kept-alive
    # ones) would keep the direct path.
    lab.delay(CHAOTIC, 0.010, 0.005, seed=15)
    try:
        cold_cluster(lab)
        took = restore(saved, [1, 2, 3, 4])
        chaos = lab.chaos(CHAOTIC)
    finally:
        lab.heal(CHAOTIC)
    report("10 ms ± 5 ms on n4", took, saved, chaos)
    relay = chaos.relay
    assert relay is not None
    # All of node 4's traffic went through the relay: chunks from and to its peers,
    # and from S3.
    carried = sum(
        lab.metric(CHAOTIC, sample)
        for sample in (
            'chunkd_peer_bytes_total{direction="in"}',
            'chunkd_peer_bytes_total{direction="out"}',
            "chunkd_backend_read_bytes_total",
        )
    )
    print(
        f"n{CHAOTIC} peers in+out and backend: {carried / 2**20:.1f} MiB; relayed "
        f"{(relay.answer_bytes + relay.request_bytes) / 2**20:.1f} MiB"
    )
    assert relay.answer_bytes + relay.request_bytes >= carried
    assert relay.overtaken > 0  # pieces of different connections overtook each other
    assert 0.005 <= relay.mean_delay <= 0.015
    check_backend(saved)
    # A cold start is no rejoin: no node hands its chunks off.
    assert all(requests(lab, i, "handoff") == 0 for i in range(1, 5))


@pytest.mark.timeout(150)
def test_a_partitioned_node_is_read_around_and_rejoins_without_a_restart(saved: Saved) -> None:
    lab = saved.lab
    processes = cold_cluster(lab)
    lab.partition(CHAOTIC)
    cut = time.monotonic()
    try:
        took = restore(saved, [1, 2, 3])
        # The others marked it down (their requests and probes failed), and it
        # marked them down: it is on its own.
        wait_for(lambda: all(healthy(lab, i) == 3 for i in (1, 2, 3)), 30, "n4 down for all")
        down = time.monotonic() - cut
        wait_for(lambda: healthy(lab, CHAOTIC) == 1, 30, "n4 alone")
        alone = time.monotonic() - cut
        assert backend_bytes(lab, range(CHAOTIC, CHAOTIC + 1)) == 0  # cut off from S3 too
    finally:
        chaos = lab.heal(CHAOTIC)
    rejoined = wait_for(
        lambda: all(healthy(lab, i) == 4 for i in range(1, 5)), 20, "all four up again"
    )
    assert all(p.poll() is None for p in processes)  # nobody was restarted
    before = backend_bytes(lab, range(CHAOTIC, CHAOTIC + 1))
    took |= restore(saved, [CHAOTIC])
    report(
        f"partition of n4: down for the others {down:.1f}s after the cut, alone "
        f"{alone:.1f}s after; healed, all four up again in {rejoined:.1f}s",
        took,
        saved,
        chaos,
    )
    assert chaos.cut_packets > 0
    # Its restore came from the peers that had the chunks: the backend sent it its
    # JSON only.
    assert backend_bytes(lab, range(CHAOTIC, CHAOTIC + 1)) - before <= JSON_ALLOWANCE
    from_peers = lab.metric(CHAOTIC, 'chunkd_checkpoint_restored_bytes_total{source="peer"}')
    assert from_peers >= saved.size
    # The chunks it owns again came from the member ranked next, which held them
    # while it was away (a handoff), not from its backend.
    assert requests(lab, CHAOTIC, "handoff") > 0
    check_backend(saved)

    # A checkpoint nobody has read, by all four at once while n4 still hands off:
    # the member it asks for its own chunks may be asking n4 for them at that moment;
    # a handoff asks for what the member holds (held=1), answered at once either way.
    later = sum(t.numel() * t.element_size() for t in saved.later.values())
    before = backend_bytes(lab)
    handoffs = requests(lab, CHAOTIC, "handoff")
    took = restore(saved, [1, 2, 3, 4], LATER)
    print(
        "[after the heal, a new checkpoint on all four] restore "
        + ", ".join(f"n{i} {s:.1f}s" for i, s in sorted(took.items()))
        + f"; backend {(backend_bytes(lab) - before) / later:.3f}x of {later >> 20} MiB; "
        f"n{CHAOTIC} handoffs {handoffs:.0f} then {requests(lab, CHAOTIC, 'handoff'):.0f}, "
        f"not held {requests(lab, CHAOTIC, 'http_404'):.0f}"
    )
    assert backend_bytes(lab) - before <= 1.05 * later + 4 * JSON_ALLOWANCE


def requests(lab: netlab.Lab, i: int, outcome: str) -> float:
    """Node ``i``'s peer requests with ``outcome``, to every peer."""
    return lab.metric(i, f'chunkd_peer_requests_total{{outcome="{outcome}",')


# -- the relay itself, on loopback (no root) ---------------------------------------------


@pytest.fixture
def echo_port() -> Iterator[int]:
    """A TCP echo server on loopback."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    conns: list[socket.socket] = []

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conns.append(conn)
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    def echo(conn: socket.socket) -> None:
        try:
            while data := conn.recv(65536):
                conn.sendall(data)
        except OSError:
            pass

    thread = threading.Thread(target=serve)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()
    for conn in conns:
        conn.close()


@pytest.fixture
def relay(echo_port: int) -> Iterator[LatencyRelay]:
    started = LatencyRelay.start(latency=0.02, jitter=0.01, upstream=f"127.0.0.1:{echo_port}")
    yield started
    started.close()


@pytest.mark.timeout(30)
def test_the_relay_delays_each_piece_both_ways(relay: LatencyRelay) -> None:
    with socket.create_connection(("127.0.0.1", relay.port)) as conn:
        trips = []
        for _ in range(5):
            started = time.perf_counter()
            conn.sendall(b"x")
            assert conn.recv(16) == b"x"
            trips.append(time.perf_counter() - started)
    # Each way 20 ms ± 10 ms: a round trip is at least 2 x 10 ms.
    assert min(trips) >= 0.020
    assert relay.stats().request_bytes == relay.stats().answer_bytes == 5


@pytest.mark.timeout(30)
def test_the_relay_reorders_between_connections_not_within_one(relay: LatencyRelay) -> None:
    def talk(tag: int) -> None:
        with socket.create_connection(("127.0.0.1", relay.port)) as conn:
            sent = bytes([tag]) * 1000
            for n in range(40):
                message = n.to_bytes(4, "big") + sent
                conn.sendall(message)
                got = b""
                while len(got) < len(message):
                    got += conn.recv(len(message) - len(got))
                assert got == message  # in order, whole, within the connection

    threads = [threading.Thread(target=talk, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = relay.stats()
    assert stats.connections == 4
    assert stats.overtaken > 0


@pytest.mark.timeout(30)
def test_the_relay_holds_a_sender_back_instead_of_buffering(relay: LatencyRelay) -> None:
    # The echo server answers into a socket nobody reads: it blocks, the relay's
    # answer direction fills, then its request direction, then the sender.
    with socket.create_connection(("127.0.0.1", relay.port)) as conn:
        conn.setblocking(False)
        sent = 0
        block = b"z" * 65536
        deadline = time.monotonic() + 10
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < 1.0:  # a second with nothing taken
            assert time.monotonic() < deadline, "the relay kept taking bytes"
            try:
                sent += conn.send(block)
                quiet_since = time.monotonic()
            except BlockingIOError:
                time.sleep(0.01)
        held = relay.stats().max_held_bytes
    # What it holds is its window per direction (plus a piece being read each way).
    assert 0 < held <= 2 * (WINDOW + 1) * PIECE
    assert sent < 64 << 20  # the rest is the kernel's socket buffers


def test_the_relay_never_connects_outside_the_labs() -> None:
    for inside in ("198.18.80.4", "198.19.255.1", "127.0.0.1", "::1"):
        assert allowed(inside), inside
    for outside in ("10.0.0.1", "8.8.8.8", "198.20.0.1", "198.17.255.255", "::ffff:8.8.8.8"):
        assert not allowed(outside), outside
    done = subprocess.run(
        [sys.executable, "-m", "chunkd.testing.relay", "--upstream", "192.0.2.1:80"],
        capture_output=True,
        check=False,
        timeout=30,
    )
    assert done.returncode != 0
    assert b"outside 198.18.0.0/15" in done.stderr
