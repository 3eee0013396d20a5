"""The fan-out simulation (bench/fanout_sim.py) keeps its books: every node gets every
chunk once, the backend sends each chunk once with peers, bytes are conserved, today's
owners serve N-1 copies of what they own (as many as the Binomial model says), holders
take over beyond ``holder_fanout``, and CPU is charged as measured. Small runs, seconds;
no figure of the model's speed is checked here beyond what physics allows."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# bench/ is not installed: it runs from the checkout (see tests/test_bench.py)
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.fanout_sim import LAB_CPU, Cpu, Setup, main, scaled, simulate  # noqa: E402

MiB = 1 << 20

SMALL = Setup(
    nodes=6,
    size=48 * MiB + 12345,  # a short last chunk
    chunk=MiB,
    link_up=100e6,
    link_down=100e6,
    backend=200e6,
    window=8,
    rtt=0.0005,
)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("design", ["owner", "holders"])
@pytest.mark.parametrize("barrier", [True, False])
def test_every_node_gets_every_chunk_once_and_the_backend_sends_one_copy(
    design: str, barrier: bool
) -> None:
    out = simulate(replace(SMALL, design=design, barrier=barrier))
    size, n = SMALL.size, SMALL.nodes
    assert out.backend_bytes == pytest.approx(size)  # each chunk read once for the cluster
    assert out.received == pytest.approx([size] * n)  # each node got each chunk once
    # what was received came from the backend or a peer, and nothing else
    assert sum(out.received) == pytest.approx(out.backend_bytes + sum(out.served))
    assert sum(out.owned) == pytest.approx(size)
    assert all(not math.isnan(t) and t > 0 for t in out.times)


@pytest.mark.timeout(30)
def test_two_batches_in_flight_still_give_every_chunk_once() -> None:
    """The client's look-ahead: the next batch asked for while this one comes."""
    setup = replace(SMALL, design="holders", window=4, batches_in_flight=2, holder_fanout=2)
    out = simulate(setup)
    assert out.received == pytest.approx([setup.size] * setup.nodes)
    assert out.backend_bytes == pytest.approx(setup.size)
    assert out.cpu_seconds["readers"] == 0.0


@pytest.mark.timeout(30)
def test_without_peers_every_node_reads_the_backend() -> None:
    out = simulate(replace(SMALL, design="alone"))
    assert out.backend_bytes == pytest.approx(SMALL.nodes * SMALL.size)
    assert out.served == [0.0] * SMALL.nodes
    # N copies through the backend's egress take at least N x size / egress
    assert out.slowest >= SMALL.nodes * SMALL.size / SMALL.backend * 0.999


@pytest.mark.timeout(30)
def test_today_every_owner_serves_n_minus_1_copies_of_its_share() -> None:
    out = simulate(replace(SMALL, design="owner"))
    n = SMALL.nodes
    assert out.served == pytest.approx([(n - 1) * o for o in out.owned])
    assert out.owner_served == pytest.approx(out.served)
    assert out.answers == {"served": (n - 1) * SMALL.chunks, "holders": 0, "direct": 0}
    assert out.served_ratio == pytest.approx(1.0)
    assert out.owner_ratio == pytest.approx(1.0)


@pytest.mark.timeout(30)
def test_the_busiest_owner_is_where_the_binomial_model_puts_it() -> None:
    """docs/peers.md: chunks per owner are Binomial(K, 1/N), the busiest about
    sqrt(2 ln N) deviations above the mean; over seeds the model's busiest owner is
    within 25% of it."""
    n, k = 40, 1200
    # coarse steps: only the bytes are looked at
    setup = replace(
        SMALL, nodes=n, size=k * 4096, chunk=4096, window=4, design="owner", quantum=50.0
    )
    busiest = []
    for seed in range(4):
        out = simulate(replace(setup, seed=seed))
        busiest.append(max(out.served) / ((n - 1) * 4096))
    mean = k / n
    predicted = mean + math.sqrt(2 * math.log(n)) * math.sqrt(mean * (1 - 1 / n))
    assert sum(busiest) / len(busiest) == pytest.approx(predicted, rel=0.25)
    assert all(b > mean for b in busiest)


@pytest.mark.timeout(30)
def test_holders_serve_beyond_the_owners_fanout() -> None:
    setup = replace(SMALL, nodes=10, design="holders", holder_fanout=2, same_offset=True)
    out = simulate(setup)
    n, fanout = setup.nodes, setup.holder_fanout
    assert out.answers["holders"] > 0
    assert out.holder_bytes > 0
    # an owner sends each of its chunks itself at most holder_fanout times (no failures:
    # no direct answers), the rest comes from holders
    assert out.answers["direct"] == 0
    for sent, owned in zip(out.owner_served, out.owned, strict=True):
        assert sent <= fanout * owned + 1e-6
    assert sum(out.served) - sum(out.owner_served) == pytest.approx(out.holder_bytes)
    assert out.owner_ratio <= fanout / (n - 1) + 1e-9
    assert out.backend_bytes == pytest.approx(setup.size)
    assert 0 < out.most_holders <= n
    # an owner remembers at most 32 holders of a chunk, whatever the cluster's size
    many = simulate(replace(setup, nodes=40, size=8 * MiB, window=2, quantum=10.0))
    assert many.most_holders == 32
    assert many.received == pytest.approx([8 * MiB] * 40)
    # with a fan-out no smaller than the askers, holders never answer
    wide = simulate(replace(setup, holder_fanout=n))
    assert wide.answers["holders"] == 0
    assert wide.served == pytest.approx(simulate(replace(setup, design="owner")).served)


@pytest.mark.timeout(30)
def test_a_holder_that_waits_too_long_sends_the_asker_on() -> None:
    """A holder waits on its own fetch at most holder_timeout, then 404: the asker tries
    the next holder, then the owner directly, which drops the holders that failed."""
    setup = replace(SMALL, nodes=10, design="holders", holder_fanout=2, same_offset=True, window=48)
    patient = simulate(replace(setup, holder_timeout=None))
    assert patient.holder_timeouts == 0
    assert patient.answers["direct"] == 0
    hasty = simulate(replace(setup, holder_timeout=1e-4))
    assert hasty.holder_timeouts > 0
    assert hasty.answers["direct"] > 0
    # each chunk still reaches every node once, from one backend copy
    assert hasty.received == pytest.approx([setup.size] * setup.nodes)
    assert hasty.backend_bytes == pytest.approx(setup.size)


@pytest.mark.timeout(30)
def test_no_node_restores_faster_than_its_link_allows() -> None:
    for design in ("owner", "holders"):
        out = simulate(replace(SMALL, design=design, link_down=50e6))
        assert out.slowest >= SMALL.size / 50e6 * 0.999
        assert out.slowest_ratio >= 0.999


@pytest.mark.timeout(30)
def test_cpu_is_charged_per_byte_and_can_be_the_bound() -> None:
    slow = Cpu(recv=2e-8, serve=1e-8, s3=1e-8, copy=5e-9, cores=2.0)
    out = simulate(replace(SMALL, design="owner", cpu=slow))
    size, n = SMALL.size, SMALL.nodes
    peer = sum(out.served)
    assert out.cpu_seconds["daemons"] == pytest.approx(n * size * slow.recv + peer * slow.serve)
    assert out.cpu_seconds["s3"] == pytest.approx(out.backend_bytes * slow.s3)
    assert out.cpu_seconds["readers"] == pytest.approx(n * size * slow.copy)
    # the work cannot take less than the cores can do it in
    assert out.slowest >= sum(out.cpu_seconds.values()) / slow.cores * 0.999
    # a request's own cost, whatever its size, is charged once a chunk
    per_request = replace(slow, recv_request=1e-3, serve_request=2e-4, s3_request=5e-3)
    charged = simulate(replace(SMALL, design="owner", cpu=per_request)).cpu_seconds
    k = SMALL.chunks
    assert charged["s3"] - out.cpu_seconds["s3"] == pytest.approx(k * 5e-3)
    assert charged["daemons"] - out.cpu_seconds["daemons"] == pytest.approx(
        n * k * 1e-3 + (n - 1) * k * 2e-4
    )
    free = simulate(replace(SMALL, design="owner"))
    assert free.cpu_seconds == {"daemons": 0.0, "s3": 0.0, "readers": 0.0, "probes": 0.0}
    assert out.slowest > free.slowest


@pytest.mark.timeout(30)
def test_health_probes_take_their_cpu_all_through_the_restore() -> None:
    cpu = Cpu(recv=2e-8, serve=1e-8, s3=1e-8, copy=5e-9, cores=2.0, probe=1e-3)
    setup = replace(SMALL, design="owner", health_interval=0.1)
    probed = simulate(replace(setup, cpu=cpu))
    quiet = simulate(replace(setup, cpu=replace(cpu, probe=0.0)))
    n = setup.nodes
    # each daemon probes n - 1 peers every 0.1 s (and answers as many): 1 ms each
    per_daemon = 1e-3 * (n - 1) / 0.1
    assert probed.cpu_seconds["probes"] == pytest.approx(n * per_daemon * probed.slowest)
    assert probed.slowest > quiet.slowest
    with pytest.raises(ValueError, match="probes alone"):
        simulate(replace(setup, cpu=cpu, health_interval=0.001))


@pytest.mark.timeout(30)
def test_a_given_placement_is_kept() -> None:
    shares = (20, 0, 14, 9, 5, 1)  # 49 chunks of SMALL
    out = simulate(replace(SMALL, design="owner", shares=shares))
    assert [math.ceil(o / MiB) for o in out.owned] == list(shares)  # one chunk is short
    with pytest.raises(ValueError, match="shares"):
        simulate(replace(SMALL, shares=(1, 2)))


@pytest.mark.timeout(30)
def test_a_run_is_determined_by_its_seed() -> None:
    one = simulate(replace(SMALL, cpu=LAB_CPU, seed=3))
    assert simulate(replace(SMALL, cpu=LAB_CPU, seed=3)).times == one.times
    assert simulate(replace(SMALL, cpu=LAB_CPU, seed=4)).owned != one.owned


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "bad",
    [
        {"nodes": 0},
        {"size": 0},
        {"window": 0},
        {"design": "gossip"},
        {"holder_fanout": 0},
        {"batches_in_flight": 0},
        {"holder_order": "random"},
        {"holders_named": "random"},
        {"link_up": 0.0},
    ],
)
def test_a_setup_that_cannot_run_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"must be|design|holder_order|holders_named"):
        simulate(replace(SMALL, **bad))  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_the_command_line_prints_both_designs_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    assert main(["--nodes", "5", "--size", "0.03125", "--chunk", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "owner" in printed
    assert "holders" in printed
    rows = json.loads(out.read_text())
    assert [r["design"] for r in rows] == ["owner", "holders"]
    assert all(r["backend_over_size"] == pytest.approx(1.0) for r in rows)
    assert rows[0]["most_served_over_share"] == pytest.approx(1.0)


@pytest.mark.timeout(10)
def test_a_scaled_run_keeps_the_askers_of_a_chunk_at_once() -> None:
    big = replace(SMALL, nodes=100, size=1600 * MiB, window=64, rtt=1e-3)
    small = scaled(big, 16)
    assert small.chunks == 100
    assert small.window == 4
    assert small.rtt == pytest.approx(1e-3 / 16)
    assert small.holder_timeout == pytest.approx(2.0 / 16)
    # N W / K, the askers of one chunk at once, and W / K stay
    assert small.nodes * small.window / small.chunks == big.nodes * big.window / big.chunks
    with pytest.raises(ValueError, match="at least 1"):
        scaled(big, 0.5)
