"""Checkpoint requests with sizes out of bounds, and waits that cost what is there.

Raw requests over the local socket of a real daemon: each size a request can name is
bounded and a request beyond a bound is answered ``InvalidRequestError`` at once; a
commit waiting for parts that never come costs one listing request per look,
whatever its world size, and stops when its client goes away.

The requests beyond a bound go out as raw frames, not through :class:`Client`: the
client builds its headers with :func:`protocol.request_header`, which refuses a
field out of bounds before it is sent, so only a raw frame reaches the daemon's own
checks. That the client refuses the same fields is asserted beside.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from chunkd.client import Client, protocol
from chunkd.client.protocol import MAX_STEP
from chunkd.errors import InvalidRequestError
from chunkd.gateway.checkpoints import MAX_SEGMENTS
from tests.conftest import Daemon

_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def sealed(data: bytes) -> int:
    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    return fd


def raw_socket(path: Path) -> socket.socket:
    """A connection to the daemon that has said hello, for requests sent by hand."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    protocol.send_frame(sock, {"op": "hello", "id": 1, "version": protocol.VERSION})
    reply, _, _ = protocol.recv_frame(sock)
    assert reply["ok"], reply
    return sock


def daemon_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Iterator[tuple[Daemon, Client]]:
    daemon = start_daemon(cwd=tmp_path / "node")
    with Client(daemon.cwd / "chunkd.sock", timeout=5) as client:
        yield daemon, client


def raw_request(
    sock: socket.socket, header: dict[str, Any], fds: list[int] | None = None
) -> dict[str, Any]:
    """Send ``header`` as it is (no client-side checks) and return the daemon's
    answer; raise the error it names."""
    protocol.send_frame(sock, header | {"id": 2}, fds=fds)
    answer, _, got = protocol.recv_frame(sock)
    for fd in got:
        os.close(fd)
    assert answer.get("id") == 2, answer
    if not answer["ok"]:
        raise protocol.error_of(answer, str(header.get("op")))
    return answer


def fields_of(header: dict[str, Any]) -> dict[str, Any]:
    """A raw header's fields, as a client passes them to ``request_header``."""
    return {k: v for k, v in header.items() if k not in ("op", "id")}


SAVE: dict[str, Any] = {
    "op": "ckpt_save",
    "name": "local/bounds/1",
    "save_id": "b1",
    "world_size": 1,
}


def save_request(sock: socket.socket, header: dict[str, Any], layout: dict[str, Any]) -> None:
    layout_fd = sealed(json.dumps(layout).encode())
    data_fd = sealed(b"\0" * 4096)
    try:
        raw_request(sock, SAVE | header, [layout_fd, data_fd])
    finally:
        os.close(layout_fd)
        os.close(data_fd)


SEGMENT = [[0, 4096]]
TREE: dict[str, Any] = {"t": "dict", "keys": [], "values": []}


@pytest.mark.parametrize(
    ("header", "layout", "bound"),
    [
        ({"step": 10**30}, {"segments": SEGMENT, "tree": TREE}, str(MAX_STEP)),
        ({"step": "12"}, {"segments": SEGMENT, "tree": TREE}, "step"),
        ({"overwrite": "yes"}, {"segments": SEGMENT, "tree": TREE}, "overwrite"),
        ({}, {"segments": [[0, 0]] * (MAX_SEGMENTS + 1), "tree": TREE}, str(MAX_SEGMENTS)),
        ({}, {"segments": [[0, 1, 2]], "tree": TREE}, "segment"),
        ({}, {"segments": [[-1, 10]], "tree": TREE}, "segment"),
        ({}, {"segments": [[0, 1 << 60]], "tree": TREE}, "segment"),
        ({}, {"segments": [[0, 8192]], "tree": TREE}, "outside"),
        ({}, {"segments": [[0, 4096]] * 1000, "tree": TREE}, "may not overlap"),
        ({}, {"tree": TREE}, "segments"),
    ],
    ids=[
        "huge-step",
        "string-step",
        "string-overwrite",
        "too-many-segments",
        "segment-of-three",
        "negative-offset",
        "huge-size",
        "past-the-staged-bytes",
        "overlapping-segments",
        "no-segments",
    ],
)
def test_a_save_beyond_a_bound_is_refused_at_once(
    node: tuple[Daemon, Client], header: dict[str, Any], layout: dict[str, Any], bound: str
) -> None:
    daemon, _ = node
    with raw_socket(daemon.cwd / "chunkd.sock") as sock:
        started = time.monotonic()
        with pytest.raises(InvalidRequestError, match=bound):
            save_request(sock, header, layout)
        assert time.monotonic() - started < 5
        assert daemon.metric("chunkd_checkpoint_saves_total", outcome="started") == 0
        save_request(sock, {}, {"segments": SEGMENT, "tree": TREE})  # the connection stays
    if header:  # a field of the header: the client refuses it too, before sending
        with pytest.raises(InvalidRequestError, match=bound):
            protocol.request_header("ckpt_save", fields_of(SAVE | header))
    else:  # a layout: only the daemon reads it
        protocol.request_header("ckpt_save", fields_of(SAVE))


@pytest.mark.parametrize(
    ("request_", "bound", "client_refuses"),
    [
        ({"op": "ckpt_commit", "world_size": 10**6}, str(protocol.MAX_WORLD_SIZE), True),
        ({"op": "ckpt_commit", "world_size": 0}, "world_size", True),
        # what a save id may hold is the daemon's to say (the client sends any text)
        ({"op": "ckpt_commit", "world_size": 1, "save_id": "../../x"}, "save_id", False),
        (
            {"op": "ckpt_list", "prefix": "local", "limit": 10**6},
            str(protocol.MAX_LIST_PAGE),
            True,
        ),
        ({"op": "ckpt_list", "prefix": "local", "start_after": "k" * 5000}, "start_after", True),
        (
            {"op": "ckpt_wait", "job": "j", "name": "local/b/1", "save_id": "s", "rank": 2**40},
            "rank",
            True,
        ),
        (
            {"op": "ckpt_wait", "job": "j", "name": "local/b/1", "save_id": "s", "world_size": -1},
            "world_size",
            True,
        ),
        ({"op": "ckpt_wait", "job": "j", "name": "local/b/1", "save_id": "a/b"}, "save_id", False),
    ],
    ids=[
        "commit-huge-world",
        "commit-empty-world",
        "commit-save-id-with-slashes",
        "list-huge-page",
        "list-long-token",
        "wait-huge-rank",
        "wait-negative-world",
        "wait-save-id-with-slashes",
    ],
)
def test_other_requests_beyond_a_bound_are_refused_at_once(
    node: tuple[Daemon, Client], request_: dict[str, Any], bound: str, client_refuses: bool
) -> None:
    daemon, _ = node
    # Every other field the op takes, well within its bounds (an unknown field is
    # refused on its own: the protocol names each op's fields).
    fields = {f.name for f in protocol.OPS[request_["op"]].fields}
    usual = {"name": "local/bounds/c", "save_id": "c1", "overwrite": False}
    header = {k: v for k, v in usual.items() if k in fields} | request_
    with raw_socket(daemon.cwd / "chunkd.sock") as sock:
        started = time.monotonic()
        with pytest.raises(InvalidRequestError, match=bound):
            raw_request(sock, header)
        assert time.monotonic() - started < 5
    if client_refuses:
        with pytest.raises(InvalidRequestError, match=bound):
            protocol.request_header(header["op"], fields_of(header))
    else:
        protocol.request_header(header["op"], fields_of(header))


def test_commits_waiting_for_many_missing_parts_cost_what_is_there(
    node: tuple[Daemon, Client],
) -> None:
    # 64 commits each waiting for 65536 parts that never come: every look lists the
    # parts present (none), in one request, and builds nothing of world_size.
    daemon, _ = node
    waiting = []
    for i in range(64):
        sock = raw_socket(daemon.cwd / "chunkd.sock")
        protocol.send_frame(
            sock,
            {
                "op": "ckpt_commit",
                "id": 2,
                "name": f"local/wide/{i}",
                "save_id": f"never{i}",
                "world_size": protocol.MAX_WORLD_SIZE,
                "overwrite": False,
            },
        )
        waiting.append(sock)
    try:
        time.sleep(5)  # the looks back off to one every 2 s
        cpu = daemon_cpu_seconds(daemon.process.pid)
        lists = daemon.metric("chunkd_backend_requests_total", op="list")
        worst = 0.0
        measured = time.monotonic()
        while time.monotonic() - measured < 6:
            asked = time.monotonic()
            status, _, _ = daemon.get("/healthz")
            assert status == 200
            worst = max(worst, time.monotonic() - asked)
            time.sleep(0.05)
        spent = daemon_cpu_seconds(daemon.process.pid) - cpu
        looks = daemon.metric("chunkd_backend_requests_total", op="list") - lists
    finally:
        for sock in waiting:
            sock.close()
    print(f"{looks:g} listing requests, {spent:.2f}s of daemon CPU, /healthz at worst {worst:.3f}s")
    assert looks <= 64 * (6 / 2 + 2)  # one request per look, a look every 2 s
    assert worst < 0.5
    # The previous code spent about 3.5 s of CPU here (65536 part keys per look).
    assert spent < 1.5


def test_a_commit_whose_client_went_away_stops_looking_for_parts(
    node: tuple[Daemon, Client],
) -> None:
    daemon, _ = node
    sock = raw_socket(daemon.cwd / "chunkd.sock")
    protocol.send_frame(
        sock,
        {
            "op": "ckpt_commit",
            "id": 2,
            "name": "local/gone/1",
            "save_id": "never",
            "world_size": 2,
            "overwrite": False,
        },
    )

    def lists() -> float:
        return daemon.metric("chunkd_backend_requests_total", op="list")

    first = lists()
    deadline = time.monotonic() + 10
    while lists() < first + 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert lists() >= first + 3  # it looks, over and over
    sock.close()
    time.sleep(0.5)
    settled = lists()
    time.sleep(5)  # at least two more looks, were it still waiting
    assert lists() == settled


def test_a_commit_cannot_replace_the_manifest_fields_of_chunkd(
    node: tuple[Daemon, Client],
) -> None:
    _, client = node
    extra = sealed(json.dumps({"dcp_metadata": "x", "parts": [], "save_id": "other"}).encode())
    header = {"op": "ckpt_commit", "name": "local/extra/1", "save_id": "e1", "world_size": 1}
    try:
        with pytest.raises(InvalidRequestError, match=r"\['parts', 'save_id'\]"):
            client._request(header | {"overwrite": False}, "committing", [extra])
    finally:
        os.close(extra)
