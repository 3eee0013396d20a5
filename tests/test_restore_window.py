"""A restore's window of chunks (client/checkpoint/reader.py): the next batch asked for
while this one is copied, nothing left open however the restore ends, and each node's
own starting offset in the chunk order."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkd.client import Client, Reply
from chunkd.client import checkpoint as ckpt
from chunkd.client.checkpoint.loading import _open_part
from chunkd.client.checkpoint.reader import _CHUNKS_PER_REQUEST, _node_seed, _rotated
from chunkd.errors import ChunkdError
from tests.conftest import Daemon, small_node_toml

CHUNK = 64 << 10
#: four batches of the window: more than the two in flight at once
CHUNKS = 4 * _CHUNKS_PER_REQUEST


class RecordingClient(Client):
    """A client of a real daemon that notes the ids of each ``ckpt_chunks`` it sends."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[list[str]] = []

    def request(self, op: str, fields: dict[str, Any] | None = None, **kwargs: Any) -> Reply:
        if op == "ckpt_chunks":
            self.batches.append(list((fields or {})["ids"]))
        return super().request(op, fields, **kwargs)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def node(start_daemon: Callable[..., Daemon], root: Path, data: Path) -> Daemon:
    root.mkdir()
    toml = small_node_toml(root / "cache", ("data", data), chunk_bytes="64KiB")
    return start_daemon(toml, cwd=root)


def saved(daemon: Daemon, name: str) -> tuple[dict[str, np.ndarray], list[str]]:
    """A state of :data:`CHUNKS` distinct chunks saved as ``name``, and its chunk ids."""
    rng = np.random.default_rng(29)
    state = {"w": rng.integers(0, 256, CHUNKS * CHUNK, dtype=np.uint8)}
    with Client(daemon.cwd / "chunkd.sock") as client:
        ckpt.save(state, name, client=client)
        (part,) = ckpt.manifest(name, client=client)["parts"]
    ids = [str(c) for seg in part["segments"] for c, _ in seg["chunks"]]
    assert len(set(ids)) == CHUNKS
    return state, ids


@pytest.mark.timeout(60)
def test_a_restore_of_four_batches_is_bit_exact_and_leaves_nothing_open(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    daemon = node(start_daemon, tmp_path / "a", data)
    state, _ = saved(daemon, "data/window/step-1")
    client = RecordingClient(daemon.cwd / "chunkd.sock")
    with client:
        before = open_fds()
        back = ckpt.load("data/window/step-1", client=client)
        assert open_fds() == before  # every batch's fds and the look-ahead's socket
        again = ckpt.load("data/window/step-1", client=client)
        assert open_fds() == before
    assert np.array_equal(back["w"], state["w"])
    assert np.array_equal(again["w"], state["w"])
    # The client's own connection asked every other batch (the first and the third of
    # each load), the look-ahead's connection the others.
    assert [len(b) for b in client.batches] == [_CHUNKS_PER_REQUEST] * 4
    assert len({c for b in client.batches for c in b}) == 2 * _CHUNKS_PER_REQUEST


@pytest.mark.timeout(60)
def test_the_next_batch_is_asked_for_before_this_one_is_copied(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    daemon = node(start_daemon, tmp_path / "a", data)
    _, ids = saved(daemon, "data/window/step-1")
    batches = [ids[i : i + _CHUNKS_PER_REQUEST] for i in range(0, CHUNKS, _CHUNKS_PER_REQUEST)]
    asked = "chunkd_local_requests_total"
    with Client(daemon.cwd / "chunkd.sock") as client:
        reader, _ = _open_part("data/window/step-1", client, 0)
        before = open_fds()
        at_start = daemon.metric(asked, op="ckpt_chunks")
        with closing(reader._batches(batches)) as each:
            first, fds = next(each)  # the first batch, not copied yet
            assert first == batches[0]
            assert len(fds) == _CHUNKS_PER_REQUEST
            deadline = time.monotonic() + 10
            while daemon.metric(asked, op="ckpt_chunks") < at_start + 2:
                assert time.monotonic() < deadline, "the second batch was never asked for"
                time.sleep(0.02)
        # Given up after one batch: its fds, the second's and the look-ahead's socket closed.
        assert open_fds() == before
        # Two in flight at most: the third waits for the first to be done with.
        assert daemon.metric(asked, op="ckpt_chunks") == at_start + 2


@pytest.mark.timeout(60)
def test_a_batch_failing_while_another_is_copied_raises_and_leaves_nothing_open(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    saver = node(start_daemon, tmp_path / "a", data)
    state, ids = saved(saver, "data/window/step-1")
    restorer = node(start_daemon, tmp_path / "b", data)  # an empty cache: reads the backend
    with Client(restorer.cwd / "chunkd.sock") as client:
        order = _rotated(ids, _node_seed(client.socket_path))
        # A chunk of the second batch is gone: asked for while the first is copied,
        # failing while the third is in flight.
        lost = order[_CHUNKS_PER_REQUEST + 5]
        (data / "chunks" / lost).rename(tmp_path / "lost")
        before = open_fds()
        with pytest.raises(ChunkdError, match="w"):
            ckpt.load("data/window/step-1", client=client)
        assert open_fds() == before
        # The daemon lent nothing it kept: the same client restores once the chunk is back.
        (tmp_path / "lost").rename(data / "chunks" / lost)
        back = ckpt.load("data/window/step-1", client=client)
        assert open_fds() == before
    assert np.array_equal(back["w"], state["w"])


def test_nodes_that_share_a_hostname_start_at_their_own_offsets() -> None:
    ids = [f"{i:064x}" for i in range(CHUNKS)]
    starts = {_rotated(ids, _node_seed(Path(f"/run/node{n}/chunkd.sock")))[0] for n in range(8)}
    assert len(starts) == 8
    assert sorted(_rotated(ids, _node_seed("/run/chunkd.sock"))) == sorted(ids)


@pytest.mark.timeout(60)
def test_daemons_on_one_host_restore_from_different_chunks_first(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    first = node(start_daemon, tmp_path / "a", data)
    state, _ = saved(first, "data/window/step-1")
    # Three: two of them may start at one offset by chance (1 in 256), all three hardly.
    daemons = [first, node(start_daemon, tmp_path / "b", data)]
    daemons.append(node(start_daemon, tmp_path / "c", data))
    asked = set()
    for daemon in daemons:
        client = RecordingClient(daemon.cwd / "chunkd.sock")
        with client:
            back = ckpt.load("data/window/step-1", client=client)
        assert np.array_equal(back["w"], state["w"])
        asked.add(client.batches[0][0])
    assert len(asked) > 1
