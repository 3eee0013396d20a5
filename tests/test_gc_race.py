"""Garbage collection racing saves that deduplicate against unreferenced chunks.

A save that finds a chunk in the backend skips its upload; a collection that decided
to delete that chunk must not delete it after that. These tests run a real daemon, a
collection loop on one connection and saves on another, and look at the backend's
files directly.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from tests.conftest import Daemon

KiB = 1 << 10


def gc_loop(socket: Path, stop: threading.Event, runs: list[Any]) -> None:
    """Collect garbage in backend ``local`` with no grace period, over and over.

    Each report (the payload: what every chunkd version answers) goes to ``runs``;
    an error ends the loop, as the last item of ``runs``.
    """
    request = {"op": "ckpt_gc", "target": "local", "keep_last": None, "grace": 0, "dry_run": False}
    try:
        with Client(socket, timeout=60) as client:
            while not stop.is_set():
                _, payload, fds = client._request(request, "collecting garbage")
                for fd in fds:
                    os.close(fd)
                runs.append(json.loads(payload))
    except Exception as exc:  # the test reports it
        runs.append(exc)


def missing_chunks(data: Path, manifest: dict[str, Any]) -> list[str]:
    """The chunks a manifest names that the file backend at ``data`` lacks."""
    named = {c for part in manifest["parts"] for seg in part["segments"] for c, _ in seg["chunks"]}
    return sorted(c for c in named if not (data / "chunks" / c).exists())


def test_gc_in_a_loop_never_deletes_what_a_committed_save_deduplicated_against(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    # 4 KiB chunks: one save names 512 of them, so a sweep has many to delete while
    # the next save checks which ones the backend has.
    daemon = start_daemon(cwd=tmp_path / "node", env={"CHUNKD_CACHE_CHUNK_BYTES": "4KiB"})
    socket = daemon.cwd / "chunkd.sock"
    data = daemon.cwd / "chunkd-data"
    state = {"w": torch.randn(512, 1024, generator=torch.Generator().manual_seed(5))}
    stop = threading.Event()
    runs: list[Any] = []
    collector = threading.Thread(target=gc_loop, args=(socket, stop, runs), daemon=True)
    broken: list[tuple[str, list[str]]] = []
    deadline = time.monotonic() + 12
    saves = 0
    with Client(socket, timeout=60) as client:
        collector.start()
        try:
            while time.monotonic() < deadline and not broken and collector.is_alive():
                name = f"local/race/step-{saves}"
                ckpt.save(state, name, client=client)
                manifest = ckpt.manifest(name, client=client)
                gone = missing_chunks(data, manifest)
                if gone:
                    broken.append((name, gone))
                ckpt.delete(name, client=client)
                # The intent would expire after a day; without it, the chunks are
                # unreferenced, and the next save deduplicates against them.
                for intent in (data / "intents").glob(f"{manifest['save_id']}.*.json"):
                    intent.unlink()
                saves += 1
        finally:
            stop.set()
            collector.join(timeout=60)
    errors = [r for r in runs if isinstance(r, Exception)]
    assert not errors, f"a collection failed: {errors[0]!r}"
    assert not broken, (
        f"after {saves} saves and {len(runs)} collections, {broken[0][0]} was committed "
        f"naming {len(broken[0][1])} chunks the collection had deleted"
    )
    swept = sum(r["swept"] for r in runs)
    waits = daemon.metric("chunkd_checkpoint_gc_barrier_waits_total")
    print(f"{saves} saves, {len(runs)} collections, {swept} chunks swept, {waits:g} waits")
    assert saves >= 10
    assert len(runs) >= 10
    assert swept > 0  # the collections did delete chunks
    assert waits > 0  # and saves did wait for them
