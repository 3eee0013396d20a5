"""Checkpoint fan-out: 4 nodes restore one checkpoint, with peers and without; then 8
nodes, with holders serving and with today's owners-only design, side by side.

Runs in network namespaces (:mod:`chunkd.testing.netlab`, root only; skipped
otherwise) with every link shaped by tc. At N=4 S3's egress is the bottleneck: it
reports the backend bytes per checkpoint byte and the wall time, side by side, over 3
rounds (``--quick``: 1) of every setup in a rotating order, and gives the report the
bytes each node got from each source (its own cache, peers, the backend) for its plot.

At N=8 (:func:`run_eight`) the nodes' links bind (80 Mbit/s each way against S3's 320)
and the CPU does not (the lab's CPU seconds over the wall time are a row): the slowest
node's restore over ``size / link``, the backend bytes over the size, and the most any
node served over what the busiest owner serves in today's design ((N-1) times its
share), for ``holder_fanout = 4`` (holders) against ``1000`` (owners always serve), and
once with node 8 cut off (pulled cable) for 5 s during the restore and healed.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.testing import netlab

from .report import Report, Result, Rounds

NODES = 4


def _restore(lab: netlab.Lab, name: str, nodes: list[int]) -> float:
    errors: list[BaseException] = []

    def load(i: int) -> None:
        try:
            with Client(lab.socket(i), timeout=600) as client:
                ckpt.load(name, client=client)
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(i,)) for i in nodes]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started


def _sources(lab: netlab.Lab, nodes: list[int]) -> list[dict[str, float]]:
    """Per node, the bytes its reader got from each source, as the daemon counted them."""
    sample = "chunkd_checkpoint_restored_bytes_total"
    return [
        {
            "local": lab.metric(i, f'{sample}{{source="cache"}}'),
            "peer": lab.metric(i, f'{sample}{{source="peer"}}'),
            "backend": lab.metric(i, f'{sample}{{source="backend"}}'),
            # what the backend sent this node, for its reader or a peer's
            "backend_read": lab.metric(i, "chunkd_backend_read_bytes_total"),
        }
        for i in nodes
    ]


def _round(
    lab: netlab.Lab,
    name: str,
    *,
    peers: bool,
    hang: int | None = None,
    how: signal.Signals = signal.SIGSTOP,
    logs: Path,
) -> tuple[float, list[dict[str, float]]]:
    """Cold nodes restore ``name``. With ``hang``, that node gets ``how`` as the others
    start, and sits it out: SIGSTOP (hung: it accepts connections and answers
    nothing) or SIGKILL (dead: connections are refused)."""
    lab.stop_nodes()
    processes = {i: lab.start_node(i, peers=peers) for i in range(1, NODES + 1)}  # cold
    if peers:
        deadline = time.monotonic() + 30
        while any(lab.metric(i, "chunkd_peer_healthy") < NODES for i in range(1, NODES + 1)):
            if time.monotonic() > deadline:
                raise RuntimeError("the nodes never all saw each other up")
            time.sleep(0.1)
    readers = [i for i in range(1, NODES + 1) if i != hang]
    if hang is not None:
        os.kill(processes[hang].pid, how)
    try:
        took = _restore(lab, name, readers)
    finally:
        if hang is not None and how == signal.SIGSTOP:
            os.kill(processes[hang].pid, signal.SIGCONT)
    sources = _sources(lab, readers)
    setup = "alone" if not peers else "peers" if hang is None else f"n{hang}-{how.name}"
    logs.mkdir(parents=True, exist_ok=True)
    for i in processes:  # the next round starts from empty node directories
        shutil.copy(lab.work / f"n{i}" / "daemon.log", logs / f"{setup}-n{i}.log")
    return took, sources


def run(report: Report, work: Path, out: Path, *, quick: bool) -> None:
    """The fan-out scenario, 4 nodes then 8; skipped (with a line saying why) without
    root."""
    run_four(report, work / "four", out, quick=quick)
    run_eight(report, work / "eight", out, quick=quick)
    run_replacement(report, work / "replacement", quick=quick)


def run_four(report: Report, work: Path, out: Path, *, quick: bool) -> None:
    """4 nodes with peers and without, and with node 4 hung or dead."""
    import torch

    work.mkdir(parents=True, exist_ok=True)
    tensors, side = (4, 1024) if quick else (64, 2048)  # 16 MiB or 1 GiB of fp32
    rounds = report.rounds_for(1 if quick else 3)
    g = torch.Generator().manual_seed(11)
    state = {f"w{i}": torch.randn(side, side, generator=g) for i in range(tensors)}
    size = sum(t.numel() * 4 for t in state.values())
    try:
        with netlab.lab(work, node_rate="2gbit", s3_rate="400mbit") as lab:
            lab.start_s3()
            lab.start_node(1, peers=False)
            with Client(lab.socket(1), timeout=600) as client:
                ckpt.save(state, "ckpt/fanout/step-1", client=client)
            del state
            name, logs = "ckpt/fanout/step-1", out / "fanout-logs"
            setups: dict[str, dict[str, Any]] = {
                "with peers": {"peers": True},
                "without": {"peers": False},
                "n4 hung": {"peers": True, "hang": NODES},
                "n4 dead": {"peers": True, "hang": NODES, "how": signal.SIGKILL},
            }
            runs: dict[str, list[tuple[float, list[dict[str, float]]]]] = {s: [] for s in setups}
            order = list(setups)
            for r in range(rounds):
                # every setup starts its nodes cold; the order rotates so none always
                # follows another's teardown
                for setup in order[r % len(order) :] + order[: r % len(order)]:
                    runs[setup].append(_round(lab, name, logs=logs, **setups[setup]))
    except netlab.LabUnavailable as exc:
        print(f"fanout: skipped ({exc})", flush=True)
        return
    label = f"{size / 2**30:.2f} GiB" if size >= 2**28 else f"{size / 2**20:.0f} MiB"
    shaping = "S3 egress 400 Mbit/s, nodes 2 Gbit/s (tc tbf), 4 namespaces"

    def backend(setup: str) -> list[float]:
        """Backend bytes over the checkpoint's, per round."""
        return [sum(s["backend_read"] for s in sources) / size for _, sources in runs[setup]]

    def rate(setup: str, readers: int) -> list[float]:
        """GB/s restored, per round."""
        return [readers * size / took / 1e9 for took, _ in runs[setup]]

    def wall(setup: str) -> float:
        return statistics.median(took for took, _ in runs[setup])

    figure = f"fan-out: what each node restored of a {label} checkpoint, by source"
    for setup, per_round in runs.items():
        # the round of median wall time stands for the setup
        _, sources = sorted(per_round, key=lambda run: run[0])[len(per_round) // 2]
        for node, got in enumerate(sources, start=1):
            parts = {source: got[source] / 2**20 for source in ("local", "peer", "backend")}
            report.stack(figure, f"{setup}: node {node}", parts, "MiB")
    med = statistics.median
    report.add(
        Result(
            f"fan-out of a {label} checkpoint to 4 nodes: backend bytes / checkpoint",
            med(backend("with peers")),
            med(backend("without")),
            "x",
            "the same 4 nodes without peers",
            target_max=1.05,
            samples=Rounds.of(backend("with peers"), backend("without")),
            note=f"{shaping}; cold caches; per node and source in the plot",
        )
    )
    report.add(
        Result(
            f"fan-out of a {label} checkpoint to 4 nodes: restore rate",
            med(rate("with peers", NODES)),
            med(rate("without", NODES)),
            "GB/s",
            "the same 4 nodes without peers",
            target_ratio=2.0,
            samples=Rounds.of(rate("with peers", NODES), rate("without", NODES)),
            note=f"wall time {wall('with peers'):.1f} s with peers, {wall('without'):.1f} s "
            "without (target: at most 0.5x the time)",
        )
    )
    readers = NODES - 1
    report.add(
        Result(
            f"fan-out of a {label} checkpoint, node 4 of 4 hung: backend bytes / checkpoint",
            med(backend("n4 hung")),
            med(backend("n4 dead")),
            "x",
            "node 4 dead instead (SIGKILL: refused at once)",
            samples=Rounds.of(backend("n4 hung"), backend("n4 dead")),
            note="SIGSTOP on node 4 as nodes 1-3 restore: its chunks go to their next "
            "owner, read once (it had fetched none yet)",
        )
    )
    report.add(
        Result(
            f"fan-out of a {label} checkpoint, node 4 of 4 hung: restore rate",
            med(rate("n4 hung", readers)),
            med(rate("n4 dead", readers)),
            "GB/s",
            "node 4 dead instead (SIGKILL: refused at once)",
            samples=Rounds.of(rate("n4 hung", readers), rate("n4 dead", readers)),
            note=f"wall time {wall('n4 hung'):.1f} s with node 4 hung, {wall('n4 dead'):.1f} s "
            "with it dead: what a hang costs beyond a crash ([peers] timeout plus a probe, per "
            "reader)",
        )
    )


# -- 8 nodes: holders against today's design -----------------------------------------

EIGHT = 8
#: each node's link, both ways: what binds the restore
LINK_MBIT = 80
#: S3's link: four nodes' worth, so that one copy of the checkpoint is not the bound
S3_MBIT = 320
#: small chunks, so that each of the 8 owners has several (64 for 64 MiB) and their
#: Binomial spread shows as it does with 4 MiB chunks of a large checkpoint
EIGHT_CHUNK = 1 << 20
#: node 8's cable is pulled this long after the restore starts, for this long
CUT_AFTER_S = 1.0
CUT_FOR_S = 5.0
#: the designs side by side: [peers] holder_fanout
HOLDERS = 4
TODAY = 1000


@dataclass
class EightRound:
    """One cold restore of the 8 nodes: times, each node's counters, CPU."""

    #: each node's own restore, seconds
    took: dict[int, float]
    wall: float
    #: each node's counters after the restore
    nodes: dict[int, dict[str, float]]
    #: CPU seconds the restore cost: each daemon ("n1"...), S3 ("s3") and the readers
    cpu: dict[str, float]
    #: the machine's busy cores over the restore, everyone's work included
    machine_cores: float
    exact: bool = True
    cut: dict[str, int] = field(default_factory=dict)

    def slowest(self, ideal: float) -> float:
        """The slowest node's restore over ``size / link``."""
        return max(self.took.values()) / ideal

    def backend(self, size: int) -> float:
        """Backend bytes over the checkpoint's."""
        return sum(n["backend_read"] for n in self.nodes.values()) / size

    def busiest(self) -> float:
        """The most peer bytes any node sent, over what the busiest owner would send in
        today's design: (N-1) times the largest share read from the backend."""
        share = max(n["backend_read"] for n in self.nodes.values())
        askers = len(self.nodes) - 1
        return max(n["peer_out"] for n in self.nodes.values()) / (askers * share)

    def owner_part(self) -> float:
        """The most owner-role bytes any node sent over (N-1) times its own share."""
        return max(
            n["owner_out"] / ((len(self.nodes) - 1) * n["backend_read"])
            for n in self.nodes.values()
            if n["backend_read"] > 0
        )

    def cores(self) -> float:
        """The lab's CPU (daemons, S3, readers) over the wall time."""
        return sum(self.cpu.values()) / self.wall


def _machine_busy() -> float:
    """The machine's busy CPU seconds so far (all cores, every process), /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _counters(lab: netlab.Lab, i: int) -> dict[str, float]:
    role = "chunkd_peer_role_bytes_total{"
    body = lab.metric
    return {
        "backend_read": body(i, "chunkd_backend_read_bytes_total"),
        "peer_in": body(i, 'chunkd_peer_bytes_total{direction="in"}'),
        "peer_out": body(i, 'chunkd_peer_bytes_total{direction="out"}'),
        "owner_out": _role(lab, i, role, "out", "owner"),
        "holder_out": _role(lab, i, role, "out", "holder"),
        "holder_in": _role(lab, i, role, "in", "holder"),
        "answers_holders": body(i, 'chunkd_peer_holder_answers_total{answer="holders"}'),
        "answers_served": body(i, 'chunkd_peer_holder_answers_total{answer="served"}'),
        "answers_direct": body(i, 'chunkd_peer_holder_answers_total{answer="direct"}'),
    }


def _role(lab: netlab.Lab, i: int, prefix: str, direction: str, role: str) -> float:
    """The sum over peers of node ``i``'s role bytes one way (labels in any order)."""
    with urllib.request.urlopen(f"{lab.url(i)}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(
        float(line.rpartition(" ")[2])
        for line in lines
        if line.startswith(prefix)
        and f'direction="{direction}"' in line
        and f'role="{role}"' in line
    )


def _round_eight(
    lab: netlab.Lab, name: str, state: dict[str, Any], *, fanout: int, cut: bool, logs: Path
) -> EightRound:
    """8 cold nodes restore ``name`` at once; with ``cut``, node 8's cable is pulled
    :data:`CUT_AFTER_S` into it and put back :data:`CUT_FOR_S` later."""
    import torch

    lab.stop_nodes()
    count = len(lab.nodes)
    nodes = range(1, count + 1)
    lab.start_nodes(nodes, peers=True, settings={"holder_fanout": fanout})
    deadline = time.monotonic() + 60
    while any(lab.metric(i, "chunkd_peer_healthy") < count for i in nodes):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {count} nodes never all saw each other up")
        time.sleep(0.2)
    took: dict[int, float] = {}
    loaded: dict[int, Any] = {}
    errors: list[BaseException] = []

    def load(i: int) -> None:
        try:
            began = time.perf_counter()
            with Client(lab.socket(i), timeout=600) as client:
                loaded[i] = ckpt.load(name, client=client)
            took[i] = time.perf_counter() - began
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    cut_counts: dict[str, int] = {}

    def pull_the_cable() -> None:
        time.sleep(CUT_AFTER_S)
        lab.partition(count)
        time.sleep(CUT_FOR_S)
        chaos = lab.heal(count)
        cut_counts["cut_packets"] = chaos.cut_packets

    threads = [threading.Thread(target=load, args=(i,)) for i in nodes]
    if cut:
        threads.append(threading.Thread(target=pull_the_cable))
    cpu_before = lab.cpu_seconds()
    self_before = resource.getrusage(resource.RUSAGE_SELF)
    busy_before = _machine_busy()
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    busy = _machine_busy() - busy_before
    self_after = resource.getrusage(resource.RUSAGE_SELF)
    cpu_after = lab.cpu_seconds()
    if errors:
        raise errors[0]
    cpu = {k: cpu_after[k] - cpu_before.get(k, 0.0) for k in cpu_after}
    cpu["readers"] = (self_after.ru_utime + self_after.ru_stime) - (
        self_before.ru_utime + self_before.ru_stime
    )
    counters = {i: _counters(lab, i) for i in nodes}
    exact = all(torch.equal(loaded[i][k], state[k]) for i in nodes for k in state)
    setup = f"eight-fanout{fanout}" + ("-cut" if cut else "")
    logs.mkdir(parents=True, exist_ok=True)
    for i in nodes:
        shutil.copy(lab.work / f"n{i}" / "daemon.log", logs / f"{setup}-n{i}.log")
    return EightRound(took, wall, counters, cpu, busy / wall, exact, cut_counts)


def eight_setups() -> dict[str, dict[str, Any]]:
    """The 8-node setups: name to :func:`_round_eight`'s arguments."""
    return {
        "holders": {"fanout": HOLDERS, "cut": False},
        "today": {"fanout": TODAY, "cut": False},
        "holders, n8 cut": {"fanout": HOLDERS, "cut": True},
    }


def measure_eight(
    work: Path,
    out: Path,
    *,
    quick: bool,
    rounds: int,
    chunk_bytes: int = EIGHT_CHUNK,
    only: tuple[str, ...] = (),
    nodes: int = EIGHT,
    queue: str = "200ms",
) -> tuple[int, dict[str, list[EightRound]]]:
    """The 8-node rounds: the checkpoint's size, and each setup's rounds (``only``:
    those setups of :func:`eight_setups`; ``chunk_bytes``, ``nodes``: another chunk size
    or cluster, for the figures beside the bench's; the last node is the one cut off).

    Raises:
        netlab.LabUnavailable: no namespaces here.
    """
    import torch

    work.mkdir(parents=True, exist_ok=True)
    tensors = 4 if quick else 16  # 16 or 64 MiB of fp32
    g = torch.Generator().manual_seed(29)
    state = {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(tensors)}
    size = sum(t.numel() * 4 for t in state.values())
    name, logs = "ckpt/fanout8/step-1", out / "fanout-logs"
    with netlab.lab(
        work,
        nodes=nodes,
        queue=queue,
        node_rate=f"{LINK_MBIT}mbit",
        s3_rate=f"{S3_MBIT}mbit",
        chunk_bytes=chunk_bytes,
    ) as lab:
        lab.start_s3()
        lab.start_node(1, peers=False)
        with Client(lab.socket(1), timeout=600) as client:
            ckpt.save(state, name, client=client)
        setups = {k: v for k, v in eight_setups().items() if not only or k in only}
        runs: dict[str, list[EightRound]] = {s: [] for s in setups}
        order = list(setups)
        for r in range(rounds):
            for setup in order[r % len(order) :] + order[: r % len(order)]:
                runs[setup].append(_round_eight(lab, name, state, logs=logs, **setups[setup]))
                print(f"fanout8: {setup}: {_describe(runs[setup][-1], size)}", flush=True)
    return size, runs


def ideal_seconds(size: int) -> float:
    """``size / link``: a node's restore if its link were all it waited for."""
    return size * 8 / (LINK_MBIT * 1e6)


def _describe(run: EightRound, size: int) -> str:
    return (
        f"slowest {run.slowest(ideal_seconds(size)):.2f}x size/link "
        f"({max(run.took.values()):.1f} s), backend {run.backend(size):.3f}x, "
        f"busiest server {run.busiest():.2f}, owner part {run.owner_part():.2f}, "
        f"lab CPU {run.cores():.2f} cores (machine {run.machine_cores:.2f}), "
        f"exact {run.exact}"
    )


def run_eight(report: Report, work: Path, out: Path, *, quick: bool) -> None:
    """8 nodes: holders against today's design, and a partition healed."""
    try:
        size, runs = measure_eight(
            work, out, quick=quick, rounds=report.rounds_for(1 if quick else 3)
        )
    except netlab.LabUnavailable as exc:
        print(f"fanout8: skipped ({exc})", flush=True)
        return
    if not all(r.exact for rounds in runs.values() for r in rounds):
        raise RuntimeError("a node of the 8 restored other bytes than were saved")
    ideal = ideal_seconds(size)
    label = f"{size / 2**20:.0f} MiB"
    shaping = (
        f"8 namespaces, links {LINK_MBIT} Mbit/s each way, S3 {S3_MBIT} Mbit/s (tc tbf), "
        f"{EIGHT_CHUNK >> 20} MiB chunks, size/link {ideal:.1f} s"
    )
    med = statistics.median
    holders, today, cut = runs["holders"], runs["today"], runs["holders, n8 cut"]

    def row(
        title: str,
        figure: Callable[[EightRound], float],
        baseline: list[EightRound],
        *,
        mine: list[EightRound] = holders,
        unit: str = "x",
        baseline_name: str = f"today's design (holder_fanout {TODAY})",
        target_max: float,
        note: str = "",
    ) -> None:
        ours, theirs = [figure(r) for r in mine], [figure(r) for r in baseline]
        report.add(
            Result(
                f"fan-out of a {label} checkpoint to 8 nodes: {title}",
                med(ours),
                med(theirs),
                unit,
                baseline_name,
                target_max=target_max,
                note=note,
                samples=Rounds.of(ours, theirs),
                better="lower",
            )
        )

    row(
        "slowest restore / (size / link)",
        lambda r: r.slowest(ideal),
        today,
        target_max=1.3,
        note=f"holder_fanout {HOLDERS}; {shaping}",
    )
    row("backend bytes / checkpoint", lambda r: r.backend(size), today, target_max=1.05)
    row(
        "most served by a node / (N-1) x the largest owner share",
        lambda r: r.busiest(),
        today,
        target_max=0.9,
        note="1.0 by construction in today's design",
    )
    row(
        "lab CPU during the restore (daemons, S3, readers)",
        lambda r: r.cores(),
        today,
        unit="cores",
        target_max=1.0,
        note="the lab's own processes, of the machine's 2 (other work on it is not counted)",
    )
    row(
        f"node 8 cut off {CUT_FOR_S:.0f} s and healed: slowest restore / (size / link)",
        lambda r: r.slowest(ideal),
        holders,
        mine=cut,
        baseline_name="the same without the cut",
        target_max=(CUT_FOR_S + 1.5 * ideal) / ideal,
        note=f"pulled cable (peers and S3) {CUT_AFTER_S:.0f} s into the restore",
    )
    row(
        f"node 8 cut off {CUT_FOR_S:.0f} s and healed: backend bytes / checkpoint",
        lambda r: r.backend(size),
        holders,
        mine=cut,
        baseline_name="the same without the cut",
        target_max=1.2,
    )
    figure = f"fan-out to 8 nodes: what each node served of a {label} checkpoint, by role"
    for setup, per_round in (("holders", holders), ("today", today)):
        chosen = sorted(per_round, key=lambda r: r.wall)[len(per_round) // 2]
        for node, got in chosen.nodes.items():
            parts = {
                "as owner": got["owner_out"] / 2**20,
                "as holder": got["holder_out"] / 2**20,
            }
            report.stack(figure, f"{setup}: node {node}", parts, "MiB")


# -- a replaced node restores from replicas --------------------------------------------

#: the replacement lab: two racks, so that node 1's replica is on node 3 or 4
REPLACEMENT_RACKS = {1: "r1", 2: "r1", 3: "r2", 4: "r2"}


@dataclass
class ReplacementRound:
    """A fresh node 1 loads a save of the node it replaces: with replicas (K=1) and
    without (K=0: the owners read the backend)."""

    took: dict[str, float]
    backend: dict[str, float]
    replica_in: dict[str, float]
    cpu: dict[str, float]
    exact: bool


def _replacement_round(lab: netlab.Lab, size_tensors: int, r: int) -> ReplacementRound:
    import torch

    lab.stop_nodes()
    nodes = range(1, 5)
    lab.start_nodes(nodes, peers=True)
    _wait_up(lab, list(nodes))
    g = torch.Generator().manual_seed(290 + r)  # new bytes each round: nothing deduplicated
    states = {
        k: {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(size_tensors)}
        for k in (1, 0)
    }
    with Client(lab.socket(1), timeout=600) as client:
        for k, state in states.items():
            level = "replicated" if k else "remote"  # replicated: every push answered
            handle = ckpt.save(
                state, f"ckpt/replaced/r{r}-k{k}", replicas=k, durability=level, client=client
            )
            if not handle.wait(600, level="remote"):
                raise RuntimeError("the save never reached the backend")
            if k and (_pushes_over(handle) or {}).get("outcome") != "full":
                raise RuntimeError(f"the save's replicas are not whole: {handle.replicas}")
    took: dict[str, float] = {}
    backend: dict[str, float] = {}
    replica_in: dict[str, float] = {}
    cpu_before = lab.cpu_seconds()
    exact = True
    for k in (1, 0):
        lab.replace_node(1)  # SIGKILL, then a fresh daemon with an empty cache
        _wait_up(lab, list(nodes))
        before = sum(lab.metric(i, "chunkd_backend_read_bytes_total") for i in nodes)
        began = time.perf_counter()
        with Client(lab.socket(1), timeout=600) as client:
            loaded = ckpt.load(f"ckpt/replaced/r{r}-k{k}", client=client)
        took[f"k{k}"] = time.perf_counter() - began
        after = sum(lab.metric(i, "chunkd_backend_read_bytes_total") for i in nodes)
        backend[f"k{k}"] = after - before
        replica_in[f"k{k}"] = _role(lab, 1, "chunkd_peer_role_bytes_total{", "in", "replica")
        exact = exact and all(torch.equal(loaded[n], v) for n, v in states[k].items())
    cpu_after = lab.cpu_seconds()
    # node 1 is a new process: its figure is its whole life (start, then the last load)
    cpu = {n: cpu_after[n] - (cpu_before.get(n, 0.0) if n != "n1" else 0.0) for n in cpu_after}
    return ReplacementRound(took, backend, replica_in, cpu, exact)


def _pushes_over(handle: ckpt.SaveHandle, timeout: float = 120.0) -> dict[str, Any] | None:
    """The save's replica report once its pushes are over. A save that reached the
    backend first counts as replicated before then (docs/replicas.md): here the
    pushes cross an 80 Mbit/s link and the upload a 320 Mbit/s one."""
    deadline = time.monotonic() + timeout
    while handle.replicas is None and time.monotonic() < deadline:
        handle.wait(0, level="remote")
        time.sleep(0.2)
    return handle.replicas


def _wait_up(lab: netlab.Lab, nodes: list[int]) -> None:
    deadline = time.monotonic() + 60
    while any(lab.metric(i, "chunkd_peer_healthy") < len(nodes) for i in nodes):
        if time.monotonic() > deadline:
            raise RuntimeError("the nodes never all saw each other up")
        time.sleep(0.2)


def measure_replacement(
    work: Path, *, quick: bool, rounds: int
) -> tuple[int, list[ReplacementRound]]:
    """The replacement rounds: the checkpoint's size, and each round.

    Raises:
        netlab.LabUnavailable: no namespaces here.
    """
    tensors = 4 if quick else 16  # 16 or 64 MiB
    work.mkdir(parents=True, exist_ok=True)
    with netlab.lab(
        work,
        nodes=4,
        node_rate=f"{LINK_MBIT}mbit",
        s3_rate=f"{S3_MBIT}mbit",
        chunk_bytes=EIGHT_CHUNK,
        racks=REPLACEMENT_RACKS,
    ) as lab:
        lab.start_s3()
        done = []
        for r in range(rounds):
            done.append(_replacement_round(lab, tensors, r))
            print(
                f"replacement: took {done[-1].took}, backend {done[-1].backend}, "
                f"replica in {done[-1].replica_in}, exact {done[-1].exact}",
                flush=True,
            )
    return tensors * 4 * 2**20, done


def run_replacement(report: Report, work: Path, *, quick: bool) -> None:
    """A replaced node's restore from replicas against one from the backend."""
    try:
        rounds = report.rounds_for(1 if quick else 3)
        size, done = measure_replacement(work, quick=quick, rounds=rounds)
    except netlab.LabUnavailable as exc:
        print(f"replacement: skipped ({exc})", flush=True)
        return
    if not all(r.exact for r in done):
        raise RuntimeError("the replaced node restored other bytes than were saved")
    ideal = ideal_seconds(size)
    label = f"{size / 2**20:.0f} MiB"
    med = statistics.median
    times = {k: [r.took[k] / ideal for r in done] for k in ("k1", "k0")}
    bytes_ = {k: [max(r.backend[k], 1.0) / size for r in done] for k in ("k1", "k0")}
    shaping = (
        f"4 namespaces in 2 racks, links {LINK_MBIT} Mbit/s each way, S3 {S3_MBIT} Mbit/s, "
        f"{EIGHT_CHUNK >> 20} MiB chunks, size/link {ideal:.1f} s"
    )
    report.add(
        Result(
            f"a replaced node loads the {label} save of the node it replaces: "
            "restore / (size / link)",
            med(times["k1"]),
            med(times["k0"]),
            "x",
            "the same save without replicas (replicas 0: its owners read the backend)",
            target_max=1.2,
            samples=Rounds.of(times["k1"], times["k0"]),
            better="lower",
            note=f"replicas 1, in the other rack's RAM; {shaping}",
        )
    )
    report.add(
        Result(
            f"a replaced node loads the {label} save of the node it replaces: "
            "backend bytes / checkpoint",
            med(bytes_["k1"]),
            med(bytes_["k0"]),
            "x",
            "the same save without replicas",
            target_max=0.01,
            samples=Rounds.of(bytes_["k1"], bytes_["k0"]),
            better="lower",
            note="with replicas only the manifest and the part's document",
        )
    )
