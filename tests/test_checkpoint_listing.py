"""Listing and collecting more checkpoints than one answer of the local socket holds.

The checkpoints are written straight into a file backend, in the documented format
(docs/checkpoints.md): thousands of them, with long names, whose listing takes well
over the 1 MiB a payload may carry.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from chunkd.client import Client, protocol
from chunkd.client import checkpoint as ckpt
from tests.conftest import Daemon

COUNT = 4000
LONG = "x" * 150 + "/" + "y" * 150


def write_checkpoints(data: Path, count: int) -> list[str]:
    """``count`` committed checkpoints with no parts; their names, in key order."""
    names = []
    for i in range(count):
        path = f"big/{LONG}/run-{i:05d}"
        manifest = {
            "format": "chunkd-checkpoint",
            "schema": 1,
            "name": f"local/{path}",
            "save_id": f"s{i}",
            "world_size": 1,
            "step": i,
            "created": 1_700_000_000 + i,
            "logical_bytes": 1000,
            "new_bytes": 10,
            "parts": [],
        }
        folder = data / "checkpoints" / path
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text(json.dumps(manifest))
        names.append(f"local/{path}")
    return names


def chunkd(daemon: Daemon, *args: str) -> str:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "chunkd"), *args],
        capture_output=True,
        text=True,
        check=True,
        env=daemon.env,
    )
    return done.stdout


def test_listing_and_collecting_more_checkpoints_than_one_answer_holds(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    began = time.monotonic()
    daemon = start_daemon(cwd=tmp_path / "node")
    data = daemon.cwd / "chunkd-data"
    names = write_checkpoints(data, COUNT)
    socket = str(daemon.cwd / "chunkd.sock")
    with Client(socket) as client:
        ckpt.save({"w": torch.ones(8)}, "local/big/saved-through-chunkd", client=client)
        started = time.monotonic()
        entries = ckpt.list("local/big", client=client)
        took = time.monotonic() - started
        assert len(json.dumps(entries)) > protocol.MAX_PAYLOAD  # more than one answer
        listed = [e["name"] for e in entries]
        assert sorted(listed) == sorted([*names, "local/big/saved-through-chunkd"])
        assert len(set(listed)) == len(listed)
        pages = list(ckpt.pages("local/big", limit=700, client=client))
        assert all(len(p) <= 700 for p in pages)
        assert [e["name"] for p in pages for e in p] == listed

    shown = json.loads(chunkd(daemon, "ckpt", "ls", "local/big", "--json", "--socket", socket))
    assert [e["name"] for e in shown] == listed

    # Retention over all of them: the report names every checkpoint it retires.
    dry = chunkd(daemon, "gc", "local/big", "--keep-last", "0", "--dry-run", "--socket", socket)
    retired = [line.split()[3] for line in dry.splitlines() if line.startswith("would remove ")]
    assert sorted(retired) == sorted([*names, "local/big/saved-through-chunkd"])
    assert len("\n".join(retired)) > protocol.MAX_PAYLOAD
    out = chunkd(daemon, "gc", f"local/big/{LONG}", "--keep-last", "10", "--socket", socket)
    assert out.count("removed checkpoint") == COUNT - 10
    with Client(socket) as client:
        left = [e["name"] for e in ckpt.list(f"local/big/{LONG}", client=client)]
    assert left == names[-10:]  # the newest steps stay
    print(f"listed {COUNT} checkpoints in {took:.2f}s; all in {time.monotonic() - began:.2f}s")


async def test_retention_deletes_only_the_checkpoint_it_listed(open_cache, tmp_path: Path) -> None:
    """Retention decides on a listing; a save that commits at the same name afterwards
    (overwrite=True) must not be deleted with the one that was listed."""
    from chunkd.errors import CheckpointNotFoundError
    from chunkd.gateway.backends import Backends, make_backend
    from chunkd.gateway.checkpoints import Checkpoints
    from chunkd.gateway.config import BackendConfig
    from chunkd.gateway.metrics import Metrics

    (tmp_path / "ckpts").mkdir()
    metrics = Metrics()
    backend = make_backend(
        BackendConfig(name="ck", url=f"file://{tmp_path / 'ckpts'}", writable=True), metrics
    )
    store = Checkpoints(await open_cache(), Backends([backend]), metrics, tmp_path / "jobs")
    manifest = tmp_path / "ckpts" / "checkpoints" / "run" / "step-1" / "manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(
        json.dumps({"format": "chunkd-checkpoint", "save_id": "newer", "parts": []})
    )
    with pytest.raises(CheckpointNotFoundError, match="committed again"):
        await store.delete("ck/run/step-1", save_id="listed")
    assert manifest.exists()
    assert await store.delete("ck/run/step-1", save_id="newer") == 1
    assert not manifest.exists()
