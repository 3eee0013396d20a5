"""Checkpoint fan-out: 4 nodes restore one checkpoint, with peers and without.

Runs in network namespaces (:mod:`chunkd.testing.netlab`, root only; skipped
otherwise) with every link shaped by tc and S3's egress the bottleneck. Reports the
backend bytes per checkpoint byte and the wall time, side by side, over 3 rounds
(``--quick``: 1) of every setup in a rotating order, and gives the report the bytes
each node got from each source (its own cache, peers, the backend) for its plot.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import threading
import time
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
    """The fan-out scenario; skipped (with a line saying why) without root."""
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
