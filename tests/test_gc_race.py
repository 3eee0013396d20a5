"""Garbage collection racing saves that deduplicate against unreferenced chunks.

A save that finds a chunk in the backend skips its upload; a collection that decided
to delete that chunk must not delete it after that. These tests run a real daemon, a
collection loop on one connection and saves on another, and look at the backend's
files directly.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from chunkd.client import Client, protocol
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


def test_a_save_waits_for_a_live_barrier_and_passes_an_abandoned_one(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = start_daemon(cwd=tmp_path / "node")
    barriers = daemon.cwd / "chunkd-data" / "gc"
    barriers.mkdir(parents=True)

    def write(path: Path, doc: dict[str, Any]) -> None:
        fresh = path.with_suffix(".tmp")
        fresh.write_text(json.dumps(doc))
        os.replace(fresh, path)  # a new version: a new inode

    # A collection killed -9 leaves its barrier: unchanged, it is abandoned after the
    # expiry it declares, measured by the save's clock.
    write(barriers / "dead.json", {"format": "chunkd-gc-barrier", "expires_after": 1.5})
    stop = threading.Event()

    def alive() -> None:  # a collection that refreshes its barrier for 3 s, then ends
        began = time.monotonic()
        n = 0
        while time.monotonic() - began < 3 and not stop.is_set():
            write(barriers / "alive.json", {"expires_after": 1.0, "refreshes": n})
            n += 1
            time.sleep(0.3)
        (barriers / "alive.json").unlink()

    refresher = threading.Thread(target=alive, daemon=True)
    refresher.start()
    try:
        with Client(daemon.cwd / "chunkd.sock") as client:
            started = time.monotonic()
            ckpt.save({"w": torch.ones(1024)}, "local/waits/1", client=client)
            took = time.monotonic() - started
    finally:
        stop.set()
        refresher.join(timeout=10)
    # It waited past the live barrier's 1 s expiry (it kept changing) until it was gone.
    assert 2.5 <= took < 20
    assert daemon.metric("chunkd_checkpoint_gc_barrier_waits_total") == 1
    log = daemon.log.read_text()
    assert "gc/dead.json has not changed" in log
    assert "gc/alive.json has not changed" not in log


def test_a_collection_stopped_by_its_client_removes_its_barrier(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    # A collection stopped while its deletes are in flight keeps its barrier up
    # until they are surely over (the backend's timeout times its attempts): 1 s here.
    quick = {"CHUNKD_BACKENDS_LOCAL_TIMEOUT": "1s", "CHUNKD_BACKENDS_LOCAL_RETRIES": "0"}
    daemon = start_daemon(cwd=tmp_path / "node", env=quick)
    data = daemon.cwd / "chunkd-data"
    chunks = data / "chunks"
    chunks.mkdir(parents=True)
    old = time.time() - 2 * 86400
    total = 40_000
    for i in range(total):  # unreferenced chunks, old enough for any grace period
        path = chunks / f"{i:064x}"
        path.write_bytes(b"x")
        os.utime(path, (old, old))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(daemon.cwd / "chunkd.sock"))
    protocol.send_frame(sock, {"op": "hello", "id": 1, "version": protocol.VERSION})
    protocol.recv_frame(sock)
    protocol.send_frame(
        sock, {"op": "ckpt_gc", "id": 2, "target": "local", "grace": 0, "dry_run": False}
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if list((data / "gc").glob("*.json")) and len(os.listdir(chunks)) < total - 1000:
            break
        time.sleep(0.01)
    else:
        raise AssertionError("the collection neither put up its barrier nor deleted chunks")
    sock.close()  # the client goes away mid-sweep
    deadline = time.monotonic() + 10
    while list((data / "gc").glob("*.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list((data / "gc").glob("*.json"))
    left = len(os.listdir(chunks))
    time.sleep(1)
    assert len(os.listdir(chunks)) == left > 0  # it stopped deleting
    print(f"stopped with {left} of {total} chunks left")
