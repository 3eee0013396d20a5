"""Checkpoint fan-out: 4 nodes restore one checkpoint, with peers and without.

Runs in network namespaces (:mod:`chunkd.testing.netlab`, root only; skipped
otherwise) with every link shaped by tc and S3's egress the bottleneck. Reports the
backend bytes per checkpoint byte and the wall time, side by side, and draws the
bytes each node got from each source (its own cache, peers, the backend) as
``fanout.svg`` next to the report.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.testing import netlab

from .report import Report, Result

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


def _svg(rows: dict[str, list[dict[str, float]]], size: int) -> str:
    """Stacked bars: per setup and node, the MiB from each source."""
    colors = {"local": "#6a9955", "peer": "#4f81bd", "backend": "#c0504d"}
    bar, gap, height = 36, 14, 220
    top = max(sum(s[k] for k in colors) for nodes in rows.values() for s in nodes) or 1
    parts = []
    x = 60
    for setup, nodes in rows.items():
        for n, sources in enumerate(nodes, start=1):
            y = height + 20
            for source in ("local", "peer", "backend"):
                h = sources[source] / top * height
                y -= h
                parts.append(
                    f'<rect x="{x}" y="{y:.1f}" width="{bar}" height="{h:.1f}" '
                    f'fill="{colors[source]}"><title>{setup} node {n} {source}: '
                    f"{sources[source] / 2**20:.0f} MiB</title></rect>"
                )
            parts.append(f'<text x="{x + 4}" y="{height + 36}" font-size="11">n{n}</text>')
            x += bar + gap
        parts.append(
            f'<text x="{x - len(nodes) * (bar + gap) + 20}" y="{height + 54}" '
            f'font-size="12">{setup}</text>'
        )
        x += 40
    legend = "".join(
        f'<rect x="{60 + i * 110}" y="4" width="12" height="12" fill="{c}"/>'
        f'<text x="{76 + i * 110}" y="14" font-size="12">{s}</text>'
        for i, (s, c) in enumerate(colors.items())
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{x + 20}" height="{height + 70}">'
        f'<text x="4" y="{height // 2}" font-size="11">MiB</text>'
        f'<text x="4" y="30" font-size="11">{top / 2**20:.0f}</text>'
        f"{legend}{''.join(parts)}</svg>\n"
    )


def run(report: Report, work: Path, out: Path, *, quick: bool) -> None:
    """The fan-out scenario; skipped (with a line saying why) without root."""
    import torch

    work.mkdir(parents=True, exist_ok=True)
    tensors, side = (4, 1024) if quick else (64, 2048)  # 16 MiB or 1 GiB of fp32
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
            with_peers, sources_peers = _round(lab, name, peers=True, logs=logs)
            without, sources_alone = _round(lab, name, peers=False, logs=logs)
            hung, sources_hung = _round(lab, name, peers=True, hang=NODES, logs=logs)
            dead, sources_dead = _round(
                lab, name, peers=True, hang=NODES, how=signal.SIGKILL, logs=logs
            )
    except netlab.LabUnavailable as exc:
        print(f"fanout: skipped ({exc})", flush=True)
        return
    backend_peers = sum(s["backend_read"] for s in sources_peers) / size
    backend_alone = sum(s["backend_read"] for s in sources_alone) / size
    label = f"{size / 2**30:.2f} GiB" if size >= 2**28 else f"{size / 2**20:.0f} MiB"
    shaping = "S3 egress 400 Mbit/s, nodes 2 Gbit/s (tc tbf), 4 namespaces"
    report.add(
        Result(
            f"fan-out of a {label} checkpoint to 4 nodes: backend bytes / checkpoint",
            backend_peers,
            backend_alone,
            "x",
            "the same 4 nodes without peers",
            target_max=1.05,
            note=f"{shaping}; cold caches; per node and source in fanout.svg",
        )
    )
    report.add(
        Result(
            f"fan-out of a {label} checkpoint to 4 nodes: restore rate",
            NODES * size / with_peers / 1e9,
            NODES * size / without / 1e9,
            "GB/s",
            "the same 4 nodes without peers",
            target_ratio=2.0,
            note=f"wall time {with_peers:.1f} s with peers, {without:.1f} s without "
            "(target: at most 0.5x the time)",
        )
    )
    readers = NODES - 1
    report.add(
        Result(
            f"fan-out of a {label} checkpoint, node 4 of 4 hung: backend bytes / checkpoint",
            sum(s["backend_read"] for s in sources_hung) / size,
            sum(s["backend_read"] for s in sources_dead) / size,
            "x",
            "node 4 dead instead (SIGKILL: refused at once)",
            note="SIGSTOP on node 4 as nodes 1-3 restore: its chunks go to their next "
            "owner, read once (it had fetched none yet)",
        )
    )
    report.add(
        Result(
            f"fan-out of a {label} checkpoint, node 4 of 4 hung: restore rate",
            readers * size / hung / 1e9,
            readers * size / dead / 1e9,
            "GB/s",
            "node 4 dead instead (SIGKILL: refused at once)",
            note=f"wall time {hung:.1f} s with node 4 hung, {dead:.1f} s with it dead: what "
            "a hang costs beyond a crash ([peers] timeout plus a probe, per reader)",
        )
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "fanout.svg").write_text(
        _svg(
            {
                "with peers": sources_peers,
                "without": sources_alone,
                "n4 hung": sources_hung,
                "n4 dead": sources_dead,
            },
            size,
        )
    )
