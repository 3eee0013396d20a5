"""What a bad local client can make the node hold, measured against a real daemon.

The bound is written down in :mod:`chunkd.client.protocol` ("What a client can make
the node hold"): beyond the RAM tier's budget, a connection holds the chunks its
client keeps, at most one answer with fds it has not read, and its saves' staged
bytes. These tests count the node's memfd memory exactly: the memfds the daemon
holds (its fds and its mappings, from ``/proc``), plus those waiting in a client's
socket (taken out of it once the daemon has stopped writing to it), each inode
counted once at its size. ``/proc/meminfo``'s Shmem is printed beside, for a look
only: other processes of the machine move it too.

Chunks are 1 MiB and the RAM tier 16 MiB here, so that a client which pipelines reads
of distinct chunks and never reads an answer would, without the bound, make the node
hold several times the budget: the daemon answered every request, and the client's
socket kept each answer (about 170 of them before the daemon's send buffer was full,
whatever the chunks they carried).
"""

from __future__ import annotations

import array
import fcntl
import json
import mmap
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.client.protocol import MAX_FDS, PREFIX, VERSION, decode_header, recv_frame, send_frame
from chunkd.memfd import close_all
from tests.conftest import Daemon

MiB = 1 << 20
CHUNK = MiB
RAM = 16 * MiB
#: chunks of one read request in these tests: one answer's fds
PER_ANSWER = 4
ANSWER = PER_ANSWER * CHUNK
SEND_TIMEOUT = 2.0


def node_toml(work: Path, *, send_timeout: float = SEND_TIMEOUT, ram: int = RAM) -> str:
    """A daemon over the files of ``work/data``: 1 MiB chunks, no readahead (a read
    loads the chunks it names and no others)."""
    return f"""
[server]
socket_send_timeout = "{send_timeout}s"
readahead_chunks = 0
span_chunks = 1
shutdown_timeout = "5s"

[cache]
dir = "{work / "cache"}"
ram_bytes = {ram}
disk_bytes = "256MiB"
disk_min_free_bytes = 0
chunk_bytes = {CHUNK}
fsync = "never"

[[backends]]
name = "local"
url = "file://{work / "data"}"
writable = true
"""


@dataclass
class Node:
    daemon: Daemon
    data: Path

    @property
    def socket(self) -> Path:
        return self.daemon.cwd / "chunkd.sock"

    @property
    def pid(self) -> int:
        return self.daemon.process.pid

    def put(self, name: str, size: int) -> bytes:
        body = os.urandom(size)
        (self.data / name).write_bytes(body)
        return body


def start_node(start_daemon: Callable[..., Daemon], work: Path, **options: Any) -> Node:
    (work / "data").mkdir(parents=True)
    return Node(start_daemon(node_toml(work, **options), cwd=work), work / "data")


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Node:
    return start_node(start_daemon, tmp_path / "node")


# -- what the node holds ------------------------------------------------------------------


@dataclass
class Memfds:
    """The memfds a process holds, each inode with its size: by fd, and mapped only."""

    open: dict[int, int]
    mapped: dict[int, int]

    @property
    def all(self) -> dict[int, int]:
        return self.mapped | self.open

    @property
    def bytes(self) -> int:
        return sum(self.all.values())


def memfds_of(pid: int) -> Memfds:
    opened: dict[int, int] = {}
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(entry).startswith("/memfd:"):
                st = os.stat(entry)
                opened[st.st_ino] = st.st_size
        except OSError:
            continue  # closed while we looked
    mapped: dict[int, int] = {}
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/memfd:"):
            inode = int(fields[4])
            if inode not in opened:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                mapped[inode] = max(mapped.get(inode, 0), end - start)
    return Memfds(opened, mapped)


def other_fds(pid: int) -> int:
    """The process's fds that are not memfds (sockets, files, epolls)."""
    count = 0
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += not os.readlink(entry).startswith("/memfd:")
        except OSError:
            continue
    return count


def shmem() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem in /proc/meminfo")


def pinned(daemon: Daemon) -> dict[str, int]:
    """Chunks pinned in each tier (leases, a save's chunks)."""
    status, _, body = daemon.get("/v1/stats")
    assert status == 200
    return {tier["name"]: tier["pinned"] for tier in json.loads(body)["cache"]["tiers"]}


def eventually(check: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- raw clients ----------------------------------------------------------------------------


def connect(node: Node) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(node.socket))
    send_frame(sock, {"id": 0, "op": "hello", "version": VERSION})
    assert recv_frame(sock).header["ok"]
    return sock


def ask_read(sock: socket.socket, request_id: int, name: str, index: int) -> None:
    """Send a read of answer-sized range ``index`` of ``name``, as chunks."""
    send_frame(
        sock,
        {
            "id": request_id,
            "op": "read",
            "name": name,
            "offset": index * ANSWER,
            "length": ANSWER,
            "inline": False,
        },
    )


def drain(sock: socket.socket) -> tuple[list[dict[str, Any]], list[int], bool]:
    """Everything waiting in ``sock`` now: the frames' headers, their fds, and whether
    the daemon ended the stream after them (the end of the stream, or a reset)."""
    data = bytearray()
    fds: list[int] = []
    ended = False
    sock.setblocking(False)
    try:
        while True:
            try:
                got, ancillary, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(4 * MAX_FDS))
            except BlockingIOError:
                break
            except ConnectionResetError:  # closed with requests of ours unread: ended too
                ended = True
                break
            for level, kind, raw in ancillary:
                if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
                    fds.extend(array.array("i", raw[: len(raw) - len(raw) % 4]))
            if not got:
                ended = True
                break
            data += got
    finally:
        sock.settimeout(30)
    headers = []
    view = memoryview(data)
    while view:
        header_length, payload_length = PREFIX.unpack(view[: PREFIX.size])
        headers.append(decode_header(bytes(view[PREFIX.size : PREFIX.size + header_length])))
        view = view[PREFIX.size + header_length + payload_length :]
    return headers, fds, ended


def hung_up(sock: socket.socket, seconds: float) -> bool:
    """Whether the daemon shuts ``sock`` down within ``seconds`` (data may still wait)."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if any(events & select.POLLRDHUP for _, events in poller.poll(50)):
            return True
    return False


def unread(sock: socket.socket) -> int:
    """Bytes waiting in ``sock`` (FIONREAD)."""
    return int(struct.unpack("i", fcntl.ioctl(sock, termios.FIONREAD, bytes(4)))[0])


def assemble(header: dict[str, Any], fds: list[int]) -> bytes:
    """The bytes a read answer's spans name; closes its fds."""
    out = bytearray()
    try:
        for span, fd in zip(header["spans"], fds, strict=True):
            with mmap.mmap(fd, span["size"], prot=mmap.PROT_READ) as mapped:
                out += mapped[span["start"] : span["stop"]]
    finally:
        close_all(fds)
    return bytes(out)


def recv_slowly(sock: socket.socket, pause: float) -> tuple[dict[str, Any], list[int], int]:
    """One frame, read a few bytes at a time with ``pause`` seconds in the middle: its
    header, its fds, and its length."""
    first, ancillary, _, _ = sock.recvmsg(1, socket.CMSG_SPACE(4 * MAX_FDS))
    fds: list[int] = []
    for _, _, raw in ancillary:
        fds.extend(array.array("i", raw[: len(raw) - len(raw) % 4]))
    prefix = first
    while len(prefix) < PREFIX.size:
        prefix += sock.recv(1)
        time.sleep(0.005)
    header_length, payload_length = PREFIX.unpack(prefix)
    time.sleep(pause)
    body = b""
    while len(body) < header_length + payload_length:
        body += sock.recv(min(200, header_length + payload_length - len(body)))
        time.sleep(0.005)
    header = decode_header(body[:header_length])
    return header, fds, PREFIX.size + header_length + payload_length


# -- a client that never reads ----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_client_that_never_reads_holds_one_answer_and_is_dropped(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    # Long enough that the other client is served before the stuck one is dropped,
    # even on a busy machine.
    send_timeout = 4.0
    node = start_node(start_daemon, tmp_path / "node", send_timeout=send_timeout)
    requests = 16  # of distinct chunks: 64 MiB of answers, four times the RAM tier
    big = node.put("big.bin", requests * ANSWER)
    small = node.put("small.bin", 3 * CHUNK + 5)
    with Client(node.socket, timeout=10, cache_bytes=0) as other:
        # Warm: the daemon opens some of its own fds on its first read.
        assert bytes(other.read("local/small.bin")) == small
    assert eventually(lambda: node.daemon.metric("chunkd_local_clients") == 0, 5)
    fds_before = other_fds(node.pid)
    shmem_before = shmem()
    with connect(node) as stuck:
        for i in range(requests):
            ask_read(stuck, i + 1, "local/big.bin", i)
        asked = time.monotonic()

        # The others are served meanwhile, at once.
        with Client(node.socket, timeout=10, cache_bytes=0) as other:
            for _ in range(3):
                assert bytes(other.read("local/small.bin")) == small
        assert time.monotonic() - asked < send_timeout
        held = memfds_of(node.pid)
        assert held.bytes <= RAM + ANSWER, held

        # It is dropped after send_timeout: shut down, not closed, while its answer
        # waits in its socket: its connection still counts.
        assert hung_up(stuck, send_timeout + 15), "the daemon never dropped the stuck client"
        dropped_after = time.monotonic() - asked
        assert dropped_after >= send_timeout - 0.05
        assert eventually(lambda: node.daemon.metric("chunkd_local_clients") == 1, 5)
        assert node.daemon.metric("chunkd_local_stuck_clients_total") == 1
        held = memfds_of(node.pid)
        shmem_stuck = shmem() - shmem_before

        # What it holds: the one answer it never read, nothing after it.
        headers, fds, ended = drain(stuck)
        in_flight = {os.fstat(fd).st_ino: os.fstat(fd).st_size for fd in fds}
        assert ended
        assert [h["id"] for h in headers] == [1], headers
        assert len(fds) == PER_ANSWER
        assert sum(in_flight.values()) == ANSWER
        node_holds = sum((held.all | in_flight).values())
        assert node_holds <= RAM + ANSWER
        assert assemble(headers[0], fds) == big[:ANSWER]

    # Read or closed: the daemon lets the connection go, and holds what it did before.
    assert eventually(lambda: node.daemon.metric("chunkd_local_clients") == 0, 5)
    assert eventually(lambda: other_fds(node.pid) <= fds_before, 5)
    held = memfds_of(node.pid)
    assert held.bytes <= RAM
    assert pinned(node.daemon)["ram"] == 0
    print(
        f"dropped after {dropped_after:.2f}s; the node held {node_holds / MiB:.0f} MiB of "
        f"memfds (RAM tier {RAM / MiB:.0f} MiB, one answer {ANSWER / MiB:.0f} MiB) for a "
        f"client that sent {requests} reads ({requests * ANSWER / MiB:.0f} MiB) and read "
        f"none; Shmem moved {shmem_stuck / MiB:+.0f} MiB meanwhile (the whole machine's), "
        f"{(shmem() - shmem_before) / MiB:+.0f} MiB after"
    )


# -- a slow client ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_slow_reader_gets_its_bytes_and_holds_one_answer(node: Node) -> None:
    body = node.put("slow.bin", 6 * ANSWER)
    with connect(node) as slow:
        # One request at a time, each answer read a few bytes at a time; one of them
        # takes longer than send_timeout to read. Slow is not stuck: nobody waits.
        for index, pause in enumerate([0.0, SEND_TIMEOUT + 0.5, 0.0]):
            ask_read(slow, index + 1, "local/slow.bin", index)
            header, fds, _ = recv_slowly(slow, pause)
            assert header["id"] == index + 1
            assert assemble(header, fds) == body[index * ANSWER : (index + 1) * ANSWER]

        # Three requests sent at once, the answers read one every half second (inside
        # send_timeout): each is served, but only once the one before was read, so
        # the socket never holds more than one answer.
        for index in range(3, 6):
            ask_read(slow, index + 1, "local/slow.bin", index)
        for index in range(3, 6):
            assert select.select([slow], [], [], 10)[0], "no answer came"
            time.sleep(0.5)  # time enough for the daemon to send more, were it to
            waiting = unread(slow)
            held = memfds_of(node.pid)
            header, fds, length = recv_slowly(slow, 0.0)
            assert waiting == length, f"{waiting} bytes wait: more than the one answer"
            assert held.bytes <= RAM + ANSWER
            assert header["id"] == index + 1
            assert assemble(header, fds) == body[index * ANSWER : (index + 1) * ANSWER]
        ask_read(slow, 7, "local/slow.bin", 0)  # still served
        header, fds, _ = recv_slowly(slow, 0.0)
        assert assemble(header, fds) == body[:ANSWER]
    assert node.daemon.metric("chunkd_local_clients") <= 1
    assert node.daemon.metric("chunkd_local_stuck_clients_total") == 0  # slow is not stuck


# -- clients killed mid-read and mid-save ------------------------------------------------------

READER = textwrap.dedent(
    """
    import random, socket, sys, time
    from chunkd.client import Client
    from chunkd.client.protocol import VERSION, recv_frame, send_frame
    path, name, copy, mode = sys.argv[1:5]
    data = open(copy, "rb").read()
    if mode == "pipeline":  # asks and asks, and never reads an answer
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        send_frame(sock, {"id": 0, "op": "hello", "version": VERSION})
        assert recv_frame(sock).header["ok"]
        for i in range(8):
            send_frame(sock, {"id": i + 1, "op": "read", "name": name, "offset": i << 20,
                              "length": 3 << 20, "inline": False})
        print("ready", flush=True)
        time.sleep(600)
    with Client(path, timeout=30, cache_bytes=4 << 20) as client:
        print("ready", flush=True)
        rng = random.Random()
        while True:
            offset = rng.randrange(len(data))
            length = rng.randrange(1, 6 << 20)
            assert bytes(client.read(name, offset, length)) == data[offset : offset + length]
    """
)

SAVER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from chunkd.client import Client, checkpoint
    path, tag = sys.argv[1:3]
    with Client(path, timeout=30) as client:
        print("ready", flush=True)
        for i in range(1000):
            weights = np.random.default_rng([int(tag), i]).integers(0, 256, 3 << 20, np.uint8)
            name = f"local/ckpt/{tag}/{i}"
            checkpoint.save({"w": weights, "step": i}, name, client=client)
            print("saved", name, flush=True)
    """
)


#: the RAM tier of the daemon whose clients are killed
ROOMY_RAM = 32 * MiB


def weights_of(tag: int, step: int) -> np.ndarray:
    return np.random.default_rng([tag, step]).integers(0, 256, 3 << 20, np.uint8)


def run_and_kill(args: list[str], delay: float) -> list[str]:
    """Run a client process until it says it is ready, kill it ``delay`` seconds later
    (SIGKILL), and return the lines it printed."""
    process = subprocess.Popen(
        [sys.executable, "-c", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        ready = process.stdout.readline().strip()
        if ready != "ready":
            process.kill()
            _, err = process.communicate(timeout=10)
            raise AssertionError(f"the client did not start: {ready!r}\n{err[-2000:]}")
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        out, err = process.communicate(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == -signal.SIGKILL, err[-2000:]  # killed, not failed
    return out.splitlines()


@pytest.fixture
def roomy_node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Node:
    # A send_timeout far longer than the test waits: a killed client must be let go
    # because the kernel says so, not because it timed out.
    return start_node(start_daemon, tmp_path / "node", send_timeout=20.0, ram=ROOMY_RAM)


@pytest.mark.timeout(120)
def test_clients_killed_mid_read_and_mid_save_leave_nothing_behind(roomy_node: Node) -> None:
    node = roomy_node
    node.put("read.bin", 24 * CHUNK + 123)
    copy = node.data / "read.bin"
    path = str(node.socket)
    rng = random.Random()

    # Warm: the files, threads and directories a read and a save open stay open.
    with Client(node.socket, timeout=30) as warm:
        assert len(warm.read("local/read.bin")) == copy.stat().st_size
        ckpt.save({"w": weights_of(0, 0), "step": 0}, "local/ckpt/warm", client=warm)
    assert eventually(lambda: not memfds_of(node.pid).mapped, 20)
    fds_before = other_fds(node.pid)

    saved: list[str] = []
    for round_ in range(6):
        run_and_kill([READER, path, "local/read.bin", str(copy), "read"], rng.uniform(0, 0.4))
        tag = 100 + round_
        printed = run_and_kill([SAVER, path, str(tag)], rng.uniform(0.05, 0.8))
        # A saver saves one checkpoint after another: killed, it is always mid-save.
        saved += [line.split()[1] for line in printed if line.startswith("saved ")]
    for _ in range(2):
        run_and_kill([READER, path, "local/read.bin", str(copy), "pipeline"], 0.3)
        # Its connection goes when the kernel drops what it never read, long before the
        # daemon's send_timeout (20 s) would have dropped it.
        assert eventually(lambda: node.daemon.metric("chunkd_local_clients") == 0, 5)

    # Saves handed over go on to their commit, then give their staged bytes back.
    def settled() -> bool:
        held = memfds_of(node.pid)
        return (
            not held.mapped
            and held.bytes <= ROOMY_RAM
            and pinned(node.daemon) == {"ram": 0, "disk": 0}
            and node.daemon.metric("chunkd_local_clients") == 0
            and other_fds(node.pid) <= fds_before
        )

    assert eventually(settled, 30), (
        memfds_of(node.pid),
        pinned(node.daemon),
        other_fds(node.pid),
        fds_before,
    )
    # Nothing acknowledged is lost.
    with Client(node.socket, timeout=30) as check:
        for name in saved:
            tag, step = (int(part) for part in name.rsplit("/", 2)[1:])
            state = ckpt.load(name, client=check)
            assert state["step"] == step
            assert np.array_equal(state["w"], weights_of(tag, step))
    print(f"6 readers and 6 savers killed; {len(saved)} acknowledged saves load")
