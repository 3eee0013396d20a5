"""The local socket, spoken raw (chunkd.client.protocol) to a real daemon."""

from __future__ import annotations

import concurrent.futures
import fcntl
import json
import mmap
import os
import signal
import socket
import stat as stat_module
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from chunkd.client.protocol import INLINE_MAX, VERSION, recv_frame, send_frame
from chunkd.memfd import SEALS

from .conftest import Daemon

MiB = 1 << 20


@pytest.fixture
def node(start_daemon, tmp_path: Path) -> Daemon:
    work = tmp_path / "work"
    (work / "chunkd-data").mkdir(parents=True)
    return start_daemon(cwd=work)


def sock_of(daemon: Daemon) -> Path:
    return daemon.cwd / "chunkd.sock"


def connect(daemon: Daemon, *, hello: bool = True) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60)
    sock.connect(str(sock_of(daemon)))
    if hello:
        assert ask(sock, op="hello", version=VERSION)[0]["ok"]
    return sock


def ask(sock: socket.socket, **request: object) -> tuple[dict, bytes, list[int]]:
    send_frame(sock, {"id": 7, **request})
    return recv_frame(sock)


def put_file(daemon: Daemon, name: str, data: bytes) -> None:
    path = daemon.cwd / "chunkd-data" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def assemble(header: dict, fds: list[int]) -> bytes:
    out = bytearray()
    try:
        for span, fd in zip(header["spans"], fds, strict=True):
            assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
            with mmap.mmap(fd, span["size"], prot=mmap.PROT_READ) as mapped:
                out += mapped[span["start"] : span["stop"]]
    finally:
        for fd in fds:
            os.close(fd)
    return bytes(out)


def test_reads_come_as_sealed_memfds(node: Daemon) -> None:
    data = os.urandom(10 * MiB + 123)
    put_file(node, "big.bin", data)
    assert stat_module.S_IMODE(sock_of(node).stat().st_mode) == 0o660  # server.socket_mode
    with connect(node, hello=False) as sock:
        hello, _, _ = ask(sock, op="hello", version=VERSION)
        assert hello["ok"]
        assert hello["id"] == 7
        assert hello["chunk_bytes"] == 4 * MiB
        stat, _, _ = ask(sock, op="stat", name="local/big.bin")
        assert stat["size"] == len(data)
        header, payload, fds = ask(sock, op="read", name="local/big.bin", offset=5, length=9 * MiB)
        assert payload == b""
        assert header["fds"] == len(fds) == 3
        assert assemble(header, fds) == data[5 : 5 + 9 * MiB]
        header, payload, fds = ask(sock, op="read", name="local/big.bin", offset=100, length=1000)
        assert header["inline"] is True
        assert fds == []
        assert payload == data[100:1100]
        header, _, fds = ask(sock, op="read", name="local/big.bin", offset=len(data) - 10)
        assert header["length"] == 10


def test_writing_through_a_handed_out_chunk_fails(node: Daemon) -> None:
    data = os.urandom(INLINE_MAX * 2)
    put_file(node, "sealed.bin", data)
    with connect(node) as sock:
        header, _, fds = ask(sock, op="read", name="local/sealed.bin")
        fd = fds[0]
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"evil", 0)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, header["spans"][0]["size"], flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        os.close(fd)
        header, _, fds = ask(sock, op="read", name="local/sealed.bin")
        assert assemble(header, fds) == data  # the cache is intact


def test_reads_past_the_end_follow_the_one_rule_of_ranges(node: Daemon) -> None:
    # src/chunkd/ranges.py: no range is the whole object; a range that asks for bytes
    # starts before the end; an empty range at or before the end selects nothing; a
    # range past the end is cut there. The same rule as HTTP and the backends.
    put_file(node, "five.bin", b"12345")
    put_file(node, "empty.bin", b"")
    with connect(node) as sock:
        for name, offset, length, got in [
            ("local/empty.bin", 0, None, b""),
            ("local/empty.bin", 0, 0, b""),
            ("local/five.bin", 5, 0, b""),
            ("local/five.bin", 3, 100, b"45"),
        ]:
            header, payload, _ = ask(sock, op="read", name=name, offset=offset, length=length)
            assert (header["ok"], payload) == (True, got), (name, offset, length)
        for name, offset, length in [
            ("local/empty.bin", 0, 1),
            ("local/five.bin", 5, None),
            ("local/five.bin", 5, 1),
            ("local/five.bin", 6, 0),
        ]:
            header, _, _ = ask(sock, op="read", name=name, offset=offset, length=length)
            assert header["error"] == "RangeNotSatisfiableError", (name, offset, length)
        header, payload, _ = ask(
            sock, op="readv", ranges=[["local/five.bin", 5, 0], ["local/five.bin", 5, 1]]
        )
        results = header["ranges"]
        assert results[0]["length"] == 0
        assert results[1]["error"] == "RangeNotSatisfiableError"


@pytest.mark.parametrize(
    ("request_", "kind"),
    [
        ({"op": "read", "name": "nope/x"}, "UnknownBackendError"),
        ({"op": "read", "name": "local/missing"}, "ObjectNotFoundError"),
        ({"op": "read", "name": "no-slash"}, "InvalidKeyError"),
        ({"op": "read", "name": "local/../x"}, "InvalidKeyError"),
        ({"op": "read", "name": "local/ok.bin", "offset": -1}, "InvalidRangeError"),
        ({"op": "read", "name": "local/ok.bin", "offset": 99}, "RangeNotSatisfiableError"),
        ({"op": "stat", "name": 5}, "InvalidKeyError"),
        # A wait that names its save without the save's id: not a save that was lost.
        ({"op": "ckpt_wait", "job": "j", "name": "local/b/1"}, "InvalidRequestError"),
    ],
)
def test_bad_requests_get_errors_and_the_connection_stays(node: Daemon, request_, kind):
    put_file(node, "ok.bin", b"12345")
    with connect(node) as sock:
        header, _, fds = ask(sock, **request_)
        assert fds == []
        # The kind and message only: an HTTP status belongs to the HTTP edge.
        assert (header["ok"], header["error"], header["id"]) == (False, kind, 7)
        assert "status" not in header
        assert header["message"]
        header, payload, _ = ask(sock, op="read", name="local/ok.bin")
        assert payload == b"12345"


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xff" * 64,  # a header length far over the limit
        struct.pack(">II", 0, 0),  # an empty header
        struct.pack(">II", 50, 0) + b'{"op": "read"',  # cut off mid-frame
    ],
)
def test_a_malformed_frame_closes_only_its_connection(node: Daemon, garbage: bytes) -> None:
    put_file(node, "ok.bin", b"fine")
    with connect(node) as good, connect(node) as bad:
        bad.sendall(garbage)
        if garbage.startswith(struct.pack(">II", 50, 0)):
            bad.shutdown(socket.SHUT_WR)
        assert closed_by_peer(bad)
        assert ask(good, op="read", name="local/ok.bin")[1] == b"fine"


def test_a_frame_that_breaks_a_rule_in_step_is_answered(node: Daemon) -> None:
    """A payload on a request, or fds on an op that takes none: the whole frame was
    read, so the stream is in step; the answer is a ProtocolError and the fds close."""
    put_file(node, "ok.bin", b"fine")
    with connect(node) as sock:
        assert ask(sock, op="read", name="local/ok.bin")[1] == b"fine"  # now cached
        before = fd_count(node.process.pid)
        raw = b'{"op":"stat","id":9,"name":"local/ok.bin"}'
        sock.sendall(struct.pack(">II", len(raw), 3) + raw + b"abc")
        header, _, fds = recv_frame(sock)
        assert (header["ok"], header["error"], header["id"], fds) == (False, "ProtocolError", 9, [])
        assert "payload" in header["message"]
        fd = os.memfd_create("x")
        try:
            send_frame(sock, {"op": "stat", "id": 10, "name": "local/ok.bin"}, fds=[fd])
        finally:
            os.close(fd)
        header, _, fds = recv_frame(sock)
        assert (header["ok"], header["error"], header["id"], fds) == (
            False,
            "ProtocolError",
            10,
            [],
        )
        assert "takes no fds" in header["message"]
        assert ask(sock, op="read", name="local/ok.bin")[1] == b"fine"  # still served
        assert fd_count(node.process.pid) <= before  # the fd that came was closed
    assert node.metric("chunkd_local_malformed_frames_total") == 2


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:  # closed with our bytes unread: a reset
        return True


def test_a_stalled_reader_stalls_only_itself(node: Daemon) -> None:
    put_file(node, "ok.bin", os.urandom(100_000))
    with connect(node) as stalled, connect(node) as other:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        for _ in range(50):  # ask and never read: its answers pile up
            send_frame(stalled, {"id": 1, "op": "read", "name": "local/ok.bin", "length": 60_000})
        started = time.monotonic()
        for _ in range(20):
            _, payload, _ = ask(other, op="read", name="local/ok.bin", length=60_000)
            assert len(payload) == 60_000
        assert time.monotonic() - started < 10


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_64_concurrent_clients(node: Daemon) -> None:
    data = os.urandom(9 * MiB)
    put_file(node, "shared.bin", data)

    def one(_: int) -> bytes:
        with connect(node) as sock:
            header, _, fds = ask(sock, op="read", name="local/shared.bin")
            return assemble(header, fds)

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    assert all(r == data for r in results)


CLIENT = textwrap.dedent(
    """
    import os, socket, sys, json
    from chunkd.client.protocol import VERSION, send_frame, recv_frame
    path, name, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    send_frame(sock, {"id": 0, "op": "hello", "version": VERSION})
    assert recv_frame(sock)[0]["ok"]
    send_frame(sock, {"id": 1, "op": "read", "name": name})
    if mode == "hang":
        print("sent", flush=True)
        sys.stdin.readline()
    header, payload, fds = recv_frame(sock)
    print(json.dumps({"inodes": [os.fstat(fd).st_ino for fd in fds], "ok": header["ok"]}))
    """
)


def test_processes_share_one_copy_and_dead_clients_leak_nothing(node: Daemon) -> None:
    data = os.urandom(12 * MiB)
    put_file(node, "one.bin", data)
    path = str(sock_of(node))
    with connect(node) as warm:
        header, _, fds = ask(warm, op="read", name="local/one.bin")
        assert assemble(header, fds) == data
    time.sleep(0.2)
    before = fd_count(node.process.pid)
    ram_before = node.metric("chunkd_cache_bytes", tier="ram")
    inodes = []
    for _ in range(4):
        done = subprocess.run(
            [sys.executable, "-c", CLIENT, path, "local/one.bin", "read"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        answer = json.loads(done.stdout)
        assert answer["ok"]
        inodes.append(answer["inodes"])
    assert len(inodes[0]) == 3
    assert all(i == inodes[0] for i in inodes)  # the same memfds: one copy on the node
    assert node.metric("chunkd_cache_bytes", tier="ram") == ram_before
    # Clients killed mid-request (before reading their answer) leak nothing.
    for _ in range(5):
        victim = subprocess.Popen(
            [sys.executable, "-c", CLIENT, path, "local/one.bin", "hang"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert victim.stdout is not None
        assert victim.stdout.readline().strip() == "sent"
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        victim.stdout.close()
        assert victim.stdin is not None
        victim.stdin.close()
    deadline = time.monotonic() + 10
    while fd_count(node.process.pid) > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert fd_count(node.process.pid) <= before
    assert node.metric("chunkd_local_clients") == 0
    assert node.get("/healthz")[0] == 200


@pytest.mark.parametrize(
    ("raw", "kind"),
    [
        (b"nope!", "InvalidRequestError"),  # not JSON
        (b"[]", "InvalidRequestError"),  # not an object
        (b'{"op":"boom","id":7}', "InvalidRequestError"),  # unknown op
        (b'{"op":"stat","id":7,"name":' + b"[" * 5000 + b"]" * 5000 + b"}", "InvalidRequestError"),
        (b'{"op":"read","id":7,"name":"local/ok.bin","offset":NaN}', "InvalidRequestError"),
        (b'{"op":"read","id":7,"name":"local/ok.bin","length":Infinity}', "InvalidRequestError"),
        (b'{"op":"read","id":7,"name":"local/ok.bin","offset":1e400}', "InvalidRequestError"),
        (b'{"op":"prefetch","id":7,"names":"local/ok.bin"}', "InvalidRequestError"),
        (b'{"op":"prefetch","id":7,"names":[1,2]}', "InvalidRequestError"),
        (
            b'{"op":"list","id":7,"name":"local","limit":10000000000000000000000}',
            "InvalidRequestError",
        ),
        (b'{"op":"list","id":7,"name":"local","start_after":5}', "InvalidRequestError"),
        (b'{"op":"readv","id":7,"ranges":[["local/ok.bin",0]]}', "InvalidRequestError"),
        (
            b'{"op":"ckpt_commit","id":7,"name":"local/c","save_id":"s","world_size":1e300}',
            "InvalidRequestError",
        ),
        (
            b'{"op":"ckpt_commit","id":7,"name":"local/c","save_id":"s","world_size":0}',
            "InvalidRequestError",
        ),
        (
            b'{"op":"ckpt_commit","id":7,"name":"local/c","save_id":"s","world_size":1000000}',
            "InvalidRequestError",
        ),
        (b'{"op":"ckpt_wait","id":7,"job":["x"]}', "InvalidRequestError"),
        (b'{"op":"ckpt_wait","id":7,"job":"x","timeout":-1}', "InvalidRequestError"),
        (b'{"op":"ckpt_chunks","id":7,"backend":"local","ids":[5]}', "InvalidRequestError"),
        (b'{"op":"ckpt_gc","id":7,"target":"local","keep_last":"3"}', "InvalidRequestError"),
        (b'{"op":"ckpt_gc","id":7,"target":"local","grace":1e999}', "InvalidRequestError"),
        (
            b'{"op":"ckpt_gc","id":7,"target":"local","grace":1' + b"0" * 400 + b"}",
            "InvalidRequestError",
        ),
        (
            b'{"op":"ckpt_wait","id":7,"job":"x","timeout":-1' + b"0" * 400 + b"}",
            "InvalidRequestError",
        ),
    ],
)
def test_a_well_framed_bad_request_is_answered_and_the_connection_stays(
    node: Daemon, raw: bytes, kind: str
) -> None:
    put_file(node, "ok.bin", b"fine")
    with connect(node) as sock:
        sock.sendall(struct.pack(">II", len(raw), 0) + raw)
        header, _, fds = recv_frame(sock)
        assert (header["ok"], header["error"], fds) == (False, kind, [])
        assert "status" not in header
        assert header["message"]
        assert ask(sock, op="read", name="local/ok.bin")[1] == b"fine"  # still served
    assert node.metric("chunkd_local_malformed_frames_total") == 0


def test_hundreds_of_hostile_frames_leave_no_task_exception_behind(node: Daemon) -> None:
    """Every kind of bad request, many times over; the daemon's log must show no task
    whose exception was never retrieved (the fixture checks it at the end)."""
    put_file(node, "ok.bin", b"fine")
    bodies = [
        b"[" * 40_000,
        b'{"op":"read","name":"local/ok.bin","offset":-1e308}',
        b'{"op":"readv","ranges":' + b"[" * 100 + b"]" * 100 + b"}",
        b'{"op":"ckpt_save","name":"local/x"}',
        b'{"op":"ckpt_delete","name":{"a":1}}',
        b'{"op":"hello","version":[2]}',
        b"\xff\xfe",
    ]
    for _ in range(30):
        with connect(node) as sock:
            for raw in bodies:
                sock.sendall(struct.pack(">II", len(raw), 0) + raw)
                header, _, _ = recv_frame(sock)
                assert header["ok"] is False
    assert node.get("/healthz")[0] == 200
