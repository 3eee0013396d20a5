"""The trainer-side client: socket discovery, zero-copy views, its cache, and a real daemon.

The first half needs no daemon: discovery and errors against a small fake that speaks
the protocol's framing, and contiguous views over memfds made here. The second half
runs ``chunkd serve`` (the ``start_daemon`` fixture) and reads through its local
socket; those tests skip, saying why, when the daemon does not create its socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import gc
import hashlib
import io
import mmap
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from chunkd.client import (
    AsyncClient,
    ChunkdFile,
    Client,
    DaemonUnavailableError,
    ObjectStat,
    as_numpy,
    protocol,
    views,
)
from chunkd.client.fsspec import ChunkdFileSystem
from chunkd.errors import (
    CacheClosedError,
    ChunkdError,
    InvalidKeyError,
    InvalidRequestError,
    ObjectNotFoundError,
    RangeNotSatisfiableError,
    UnknownBackendError,
)

from .conftest import wait_for_socket

PAGE = mmap.PAGESIZE
MiB = 1 << 20


# -- helpers -----------------------------------------------------------------------------


def sealed_memfd(data: bytes) -> int:
    """A memfd holding ``data``, sealed as the daemon's RAM tier seals its chunks."""
    fd = os.memfd_create("chunkd-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    fcntl.fcntl(
        fd,
        fcntl.F_ADD_SEALS,
        fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE,
    )
    return fd


def make_chunk(data: bytes, chunk_id: str | None = None) -> views.Chunk:
    return views.Chunk(chunk_id or hashlib.sha256(data).hexdigest(), len(data), sealed_memfd(data))


def mapped_at(address: int) -> str | None:
    """The /proc/self/maps line of the mapping that starts at ``address``, if any."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        if int(line.split("-", 1)[0], 16) == address:
            return line
    return None


def view_address(view: memoryview) -> int:
    """Where a contiguous view's region starts (its exporter is the ctypes array)."""
    assert isinstance(view.obj, ctypes.Array)
    return int(ctypes.addressof(view.obj))


class FakeDaemon:
    """Speaks the local protocol's framing on a Unix socket; answers through ``handler``.

    ``handler(header)`` returns the answer (``id`` is added), or None for no answer.
    """

    def __init__(
        self, path: Path, handler: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None
    ) -> None:
        self.path = path
        self.handler = handler or (lambda header: {"ok": True, "started": 0})
        self.requests: list[dict[str, Any]] = []
        self.connections = 0
        self.drop_next = False
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(16)
        self._listener.settimeout(0.05)
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            self.connections += 1
            self._conns.append(conn)
            thread = threading.Thread(target=self._talk, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _talk(self, conn: socket.socket) -> None:
        while True:
            try:
                header, _, fds = protocol.recv_frame(conn)
            except (OSError, protocol.ProtocolError):
                return
            for fd in fds:
                os.close(fd)
            self.requests.append(header)
            if header["op"] == "hello":
                reply: dict[str, Any] | None = {
                    "ok": True,
                    "version": protocol.VERSION,
                    "chunk_bytes": 4 * MiB,
                    "daemon": f"fake at {self.path.name}",
                }
            elif self.drop_next:
                self.drop_next = False
                conn.shutdown(socket.SHUT_RDWR)
                return
            else:
                reply = self.handler(header)
            if reply is not None:
                try:
                    protocol.send_frame(conn, reply | {"id": header["id"]})
                except OSError:
                    return

    def ops(self) -> list[str]:
        return [r["op"] for r in self.requests]

    def close(self) -> None:
        self._stop.set()
        self._threads[0].join(5)
        self._listener.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in self._threads[1:]:
            thread.join(5)
        for conn in self._conns:
            conn.close()


@pytest.fixture
def fake_daemon(tmp_path: Path) -> Iterator[Callable[..., FakeDaemon]]:
    made: list[FakeDaemon] = []

    def factory(path: Path | str, handler: Any = None) -> FakeDaemon:
        fake = FakeDaemon(tmp_path / path, handler)
        made.append(fake)
        return fake

    yield factory
    for fake in made:
        fake.close()


@pytest.fixture
def no_env_socket(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No $CHUNKD_SOCKET and an empty working directory (so no ./chunkd.sock)."""
    monkeypatch.delenv("CHUNKD_SOCKET", raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


# -- discovery and errors (no daemon) ----------------------------------------------------


def test_default_socket_paths_put_chunkd_socket_first(
    monkeypatch: pytest.MonkeyPatch, no_env_socket: Path
) -> None:
    assert protocol.default_socket_paths() == [
        Path("/run/chunkd/chunkd.sock"),
        Path("chunkd.sock"),
    ]
    monkeypatch.setenv("CHUNKD_SOCKET", "/somewhere/d.sock")
    assert protocol.default_socket_paths()[0] == Path("/somewhere/d.sock")


@pytest.mark.skipif(
    Path("/run/chunkd/chunkd.sock").exists(), reason="a real chunkd serves this host"
)
def test_client_finds_the_daemon_in_discovery_order(
    monkeypatch: pytest.MonkeyPatch, no_env_socket: Path, fake_daemon: Any, tmp_path: Path
) -> None:
    here = fake_daemon(no_env_socket / "chunkd.sock")
    env = fake_daemon("env.sock")
    explicit = fake_daemon("explicit.sock")

    # No CHUNKD_SOCKET: ./chunkd.sock (there is no /run/chunkd/chunkd.sock).
    with Client() as client:
        assert client.daemon == "fake at chunkd.sock"
        assert client.socket_path == Path("chunkd.sock")
    # CHUNKD_SOCKET comes first.
    monkeypatch.setenv("CHUNKD_SOCKET", str(env.path))
    with Client() as client:
        assert client.daemon == "fake at env.sock"
    # An argument wins over everything.
    with Client(explicit.path) as client:
        assert client.daemon == "fake at explicit.sock"
    # A CHUNKD_SOCKET nobody answers on: the next path in order.
    monkeypatch.setenv("CHUNKD_SOCKET", str(tmp_path / "gone.sock"))
    with Client() as client:
        assert client.daemon == "fake at chunkd.sock"
    assert [fake.ops() for fake in (here, env, explicit)] == [["hello"] * 2, ["hello"], ["hello"]]


def test_no_daemon_raises_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, no_env_socket: Path, tmp_path: Path
) -> None:
    # A socket file left by a daemon that died: connection refused.
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(stale))
    monkeypatch.setenv("CHUNKD_SOCKET", str(stale))
    with pytest.raises(DaemonUnavailableError) as caught:
        Client(timeout=1)
    error = caught.value
    assert isinstance(error, ChunkdError)
    assert isinstance(error, ConnectionError)
    message = str(error)
    assert f"{stale} (Connection refused)" in message
    assert "/run/chunkd/chunkd.sock (No such file or directory)" in message
    assert f"{no_env_socket / 'chunkd.sock'} (No such file or directory)" in message
    assert "chunkd serve" in message
    assert "make run" in message
    assert "CHUNKD_SOCKET" in message

    with pytest.raises(DaemonUnavailableError, match="socket_path") as caught:
        Client(tmp_path / "nowhere.sock")
    assert str(tmp_path / "nowhere.sock") in str(caught.value)


def test_error_answers_raise_the_named_class(fake_daemon: Any) -> None:
    kinds = iter(["ObjectNotFoundError", "UnknownBackendError", "RangeNotSatisfiableError", "os"])

    def refuse(header: dict[str, Any]) -> dict[str, Any]:
        kind = next(kinds)
        return {"ok": False, "error": kind, "status": 404, "message": f"no: {kind}"}

    fake = fake_daemon("d.sock", refuse)
    with Client(fake.path) as client:
        with pytest.raises(ObjectNotFoundError, match="no: ObjectNotFoundError"):
            client.stat("data/a")
        with pytest.raises(UnknownBackendError, match="no: UnknownBackendError"):
            client.read("data/a")
        with pytest.raises(RangeNotSatisfiableError, match="no: RangeNotSatisfiableError"):
            client.read("data/a", 10)
        # Kinds outside chunkd.errors (or not errors at all) fall back to ChunkdError.
        with pytest.raises(ChunkdError, match="no: os") as caught:
            client.stat("data/a")
        assert type(caught.value) is ChunkdError


def test_a_dropped_connection_is_reconnected_and_the_request_sent_again(
    fake_daemon: Any,
) -> None:
    fake = fake_daemon("d.sock", lambda h: {"ok": True, "started": len(h["names"])})
    with Client(fake.path) as client:
        assert client.prefetch(["data/a", "data/b"]) == 2
        fake.drop_next = True
        assert client.prefetch("data/c") == 1
    assert fake.connections == 2
    assert fake.ops() == ["hello", "prefetch", "prefetch", "hello", "prefetch"]


def test_reconnecting_gives_up_after_the_timeout(fake_daemon: Any) -> None:
    fake = fake_daemon("d.sock")
    with Client(fake.path, timeout=0.5) as client:
        assert client.prefetch([]) == 0
        fake.close()  # the socket file stays, as after a crash: connection refused
        started = time.monotonic()
        with pytest.raises(DaemonUnavailableError, match=r"none came back within 0.5s"):
            client.prefetch(["data/a"])
        assert 0.4 < time.monotonic() - started < 5


def test_a_daemon_that_does_not_answer_times_out(fake_daemon: Any) -> None:
    fake = fake_daemon("d.sock", lambda header: None)
    with Client(fake.path, timeout=0.3) as client:
        started = time.monotonic()
        with pytest.raises(DaemonUnavailableError, match=r"did not answer a stat of data/a"):
            client.stat("data/a")
        assert time.monotonic() - started < 5


def test_a_closed_client_refuses_calls(fake_daemon: Any) -> None:
    fake = fake_daemon("d.sock")
    client = Client(fake.path)
    client.close()
    with pytest.raises(CacheClosedError, match="closed"):
        client.read("data/a")
    with pytest.raises(CacheClosedError):
        client.prefetch(["data/a"])


def test_prefetch_splits_long_name_lists(fake_daemon: Any) -> None:
    fake = fake_daemon("d.sock", lambda h: {"ok": True, "started": len(h["names"])})
    names = [f"data/{'k' * 900}/{i}" for i in range(200)]
    with Client(fake.path) as client:
        assert client.prefetch(iter(names)) == 200
    batches = [r["names"] for r in fake.requests if r["op"] == "prefetch"]
    assert len(batches) > 1
    assert [name for batch in batches for name in batch] == names


# -- zero-copy views over memfds (no daemon) ---------------------------------------------


def test_contiguous_view_over_two_memfds() -> None:
    rng = random.Random(1)
    first = rng.randbytes(3 * PAGE)  # chunks are page multiples, all but the last
    second = rng.randbytes(PAGE + 123)
    a, b = make_chunk(first), make_chunk(second)
    located = views.Located(
        "t/x",
        "v1",
        len(first + second),
        len(first) - 10 + 100,
        [
            views.Span(a, 10, len(first)),
            views.Span(b, 0, 100),
        ],
    )
    view = located.view()
    assert view.readonly
    assert view.format == "B"
    assert view.contiguous
    assert bytes(view) == (first + second)[10 : len(first) + 100]
    with pytest.raises(TypeError):
        view[0] = 0
    with pytest.raises(TypeError):
        view[5:7] = b"xy"
    array = as_numpy(view)
    assert not array.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        array[0] = 1

    # No copy: the region's pages are the memfds' own, mapped side by side.
    base = view_address(view)
    assert "memfd:chunkd-test" in (mapped_at(base) or "")
    assert "memfd:chunkd-test" in (mapped_at(base + len(first)) or "")
    # The region outlives the chunks (and their fds) ...
    del a, b, located
    gc.collect()
    assert bytes(view[:5]) == first[10:15]
    # ... and is unmapped once the last view of it is gone.
    del view, array
    gc.collect()
    assert mapped_at(base) is None


def test_whole_chunks_are_laid_out_exactly() -> None:
    chunks = [bytes([i]) * (2 * PAGE) for i in range(5)] + [b"tail"]
    spans = [views.Span(make_chunk(c), 0, len(c)) for c in chunks]
    total = sum(map(len, chunks))
    view = views.Located("t/x", "v", total, total, list(spans)).view()
    assert bytes(view) == b"".join(chunks)
    assert isinstance(view.obj, ctypes.Array)


def test_a_failed_map_fixed_falls_back_to_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = b"a" * PAGE, b"bc" * 100

    def refuse(libc: Any, address: int, chunk: Any) -> None:
        raise OSError(12, "no memory for you")

    monkeypatch.setattr(views, "_map_fixed", refuse)
    located = views.Located(
        "t/x",
        "v",
        PAGE + 200,
        PAGE + 200,
        [
            views.Span(make_chunk(first), 0, PAGE),
            views.Span(make_chunk(second), 0, 200),
        ],
    )
    view = located.view()
    assert isinstance(view.obj, bytearray)
    assert view.readonly
    assert bytes(view) == first + second


def test_chunks_that_are_not_page_multiples_are_copied() -> None:
    located = views.Located(
        "t/x",
        "v",
        200,
        200,
        [
            views.Span(make_chunk(b"x" * 100), 0, 100),
            views.Span(make_chunk(b"y" * 100), 0, 100),
        ],
    )
    view = located.view()
    assert bytes(view) == b"x" * 100 + b"y" * 100
    assert view.readonly


def test_a_single_chunk_range_is_a_view_into_its_mapping() -> None:
    data = random.Random(2).randbytes(2 * PAGE + 5)
    chunk = make_chunk(data)
    view = views.Located("t/x", "v", len(data), 100, [views.Span(chunk, 7, 107)]).view()
    assert isinstance(view.obj, mmap.mmap)
    assert view.readonly
    assert bytes(view) == data[7:107]
    # Dropping the chunk (as eviction does) closes its fd; the view lives on.
    fd = chunk.fd
    del chunk
    gc.collect()
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)
    assert bytes(view) == data[7:107]


def test_chunk_lru_is_bounded_by_bytes_and_count() -> None:
    lru = views.ChunkLRU(max_bytes=3 * PAGE, max_chunks=10)
    chunks = [make_chunk(bytes([i]) * PAGE) for i in range(4)]
    for chunk in chunks[:3]:
        lru.put(chunk)
    assert lru.get(chunks[0].id) is chunks[0]  # now the most recent
    lru.put(chunks[3])
    assert len(lru) == 3
    assert lru.nbytes == 3 * PAGE
    assert chunks[1].id not in lru  # the least recently used went
    assert all(c.id in lru for c in (chunks[0], chunks[2], chunks[3]))

    # Charges are page-rounded: a 10-byte chunk costs a page.
    lru.put(make_chunk(b"0123456789"))
    assert len(lru) == 3
    assert lru.nbytes == 3 * PAGE
    # A chunk over the whole budget is not cached at all.
    lru.put(make_chunk(b"z" * (4 * PAGE)))
    assert len(lru) == 3

    counted = views.ChunkLRU(max_bytes=1 << 30, max_chunks=2)
    for chunk in chunks:
        counted.put(chunk)
    assert len(counted) == 2
    assert [c.id for c in chunks[2:]] == list(counted._entries)

    none = views.ChunkLRU(max_bytes=0, max_chunks=10)
    none.put(chunks[0])
    assert len(none) == 0


def test_client_import_is_light() -> None:
    code = (
        "import sys, chunkd.client\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in "
        "('numpy', 'torch', 'aiohttp', 'lmdb', 'obstore', 'blake3', 'zstandard', 'uvloop')"
        " or m.startswith(('chunkd.gateway', 'chunkd.cache'))]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- against a real daemon ---------------------------------------------------------------

BIG = 10 * MiB + 123  # spans three 4 MiB chunks


@dataclass
class Node:
    """A running ``chunkd serve`` with a few files in its ``local`` backend."""

    daemon: Any
    socket: Path
    data: Path
    files: dict[str, bytes]


def serve(
    start_daemon: Any,
    tmp_path: Path,
    toml: str | None = None,
    extra: dict[str, bytes] | None = None,
) -> Node:
    data = tmp_path / "chunkd-data"
    data.mkdir(exist_ok=True)
    rng = random.Random(7)
    files = {"big.bin": rng.randbytes(BIG), "small.txt": b"hello chunkd\n" * 10, **(extra or {})}
    for key, content in files.items():
        (data / key).parent.mkdir(parents=True, exist_ok=True)
        (data / key).write_bytes(content)
    daemon = start_daemon(toml)
    sock = tmp_path / "chunkd.sock"
    if not wait_for_socket(sock, 10):
        pytest.skip(
            f"`chunkd serve` did not create its local socket {sock} within 10 s "
            "(the daemon side of the local protocol is not serving)"
        )
    return Node(daemon, sock, data, files)


IMMUTABLE_TOML = """
[server]
socket = "{dir}/chunkd.sock"
[cache]
dir = "{dir}/chunkd-cache"
ram_bytes = "256MiB"
disk_bytes = "1GiB"
disk_min_free_bytes = 0
chunk_bytes = "{chunk_bytes}"
fsync = "never"
[[backends]]
name = "local"
url = "file://{dir}/chunkd-data"
revalidate = "immutable"
"""


@pytest.fixture
def node(start_daemon: Any, tmp_path: Path) -> Node:
    """``chunkd serve`` with no config: backend ``local`` (revalidated after 1 s), 4 MiB chunks."""
    return serve(start_daemon, tmp_path)


@pytest.fixture
def immutable_node(start_daemon: Any, tmp_path: Path) -> Node:
    """``chunkd serve`` with an immutable ``local`` backend and 64 KiB chunks."""
    toml = IMMUTABLE_TOML.format(dir=tmp_path, chunk_bytes="64KiB")
    tail = 256 * 64 * 1024 + 100  # the 257th chunk holds 100 bytes
    return serve(start_daemon, tmp_path, toml, {"odd.bin": random.Random(3).randbytes(tail)})


class Counting:
    """Counts a client's round trips by op."""

    def __init__(self, client: Client) -> None:
        self.ops: list[str] = []
        exchange = client._connection._exchange

        def counted(
            header: dict[str, Any],
            send_fds: list[int] | None = None,
            timeout: float | None = None,
        ) -> Any:
            self.ops.append(header["op"])
            return exchange(header, send_fds, timeout)

        client._connection._exchange = counted  # type: ignore[method-assign]


def test_reads_equal_the_file_bytes(node: Node) -> None:
    big = node.files["big.bin"]
    with Client(node.socket) as client:
        whole = client.read("local/big.bin")
        assert len(whole) == BIG
        assert whole.readonly
        assert bytes(whole) == big
        assert isinstance(whole.obj, ctypes.Array)  # one view over three mapped chunks

        inside = client.read("local/big.bin", 5 * MiB, 2 * MiB)  # inside chunk 1
        assert isinstance(inside.obj, mmap.mmap)
        assert bytes(inside) == big[5 * MiB : 7 * MiB]

        across = client.read("local/big.bin", 4 * MiB - 10, 4 * MiB + 20)  # chunks 0..2
        assert bytes(across) == big[4 * MiB - 10 : 8 * MiB + 10]

        assert bytes(client.read("local/big.bin", BIG - 50)) == big[-50:]
        assert bytes(client.read("local/big.bin", BIG - 50, 10**9)) == big[-50:]
        assert bytes(client.read("local/big.bin", 123, 0)) == b""
        assert bytes(client.read("local/small.txt")) == node.files["small.txt"]
        assert bytes(client.read("local/small.txt", 6, 6)) == b"chunkd"

        st = client.stat("local/big.bin")
        assert st == ObjectStat("local/big.bin", BIG, st.version, 4 * MiB, 3, st.modified)
        assert st.modified == pytest.approx((node.data / "big.bin").stat().st_mtime, abs=1e-5)

        numbers = as_numpy(client.read("local/big.bin", 0, 4096), dtype="<u4")
        assert numbers.shape == (1024,)
        assert numbers.tobytes() == big[:4096]


def test_read_into_and_files(node: Node) -> None:
    big = node.files["big.bin"]
    with Client(node.socket) as client:
        buf = bytearray(6 * MiB)
        assert client.read_into("local/big.bin", buf, 3 * MiB) == 6 * MiB
        assert buf == big[3 * MiB : 9 * MiB]
        # Capped at the object's end.
        assert client.read_into("local/big.bin", buf, BIG - 1000) == 1000
        assert buf[:1000] == big[-1000:]
        numpy = pytest.importorskip("numpy")
        pinned = numpy.zeros(1000, dtype=numpy.uint8)
        assert client.read_into("local/big.bin", memoryview(pinned), 17) == 1000
        assert pinned.tobytes() == big[17:1017]
        with pytest.raises(TypeError, match="writable"):
            client.read_into("local/big.bin", b"read-only")

        with client.open("local/big.bin") as raw:
            assert isinstance(raw, ChunkdFile)
            assert raw.readable()
            assert raw.seekable()
            assert raw.size == BIG
            assert raw.read(10) == big[:10]
            assert raw.seek(-20, io.SEEK_END) == BIG - 20
            assert raw.read() == big[-20:]
            assert raw.read(5) == b""
            raw.seek(4 * MiB - 3)
            assert raw.tell() == 4 * MiB - 3
            target = bytearray(6)
            assert raw.readinto(target) == 6
            assert target == big[4 * MiB - 3 : 4 * MiB + 3]
        with io.BufferedReader(client.open("local/big.bin"), buffer_size=1 << 16) as buffered:
            assert buffered.read() == big


def test_pyarrow_reads_parquet_through_a_chunkd_file(start_daemon: Any, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"x": list(range(200_000)), "y": [str(i) for i in range(200_000)]})
    sink = io.BytesIO()
    pq.write_table(table, sink)
    node = serve(start_daemon, tmp_path, None, {"t/part-0.parquet": sink.getvalue()})
    with (
        Client(node.socket) as client,
        pa.PythonFile(client.open("local/t/part-0.parquet"), mode="r") as handle,
    ):
        assert pq.read_table(handle).equals(table)


def test_a_mapped_range_is_read_again_without_a_round_trip(immutable_node: Node) -> None:
    big = immutable_node.files["big.bin"]
    with Client(immutable_node.socket) as client:
        counting = Counting(client)
        first = client.read("local/big.bin", MiB, 3 * MiB)
        assert counting.ops == ["read"]
        again = client.read("local/big.bin", MiB, 3 * MiB)
        inside = client.read("local/big.bin", 2 * MiB + 5, 1000)
        assert client.stat("local/big.bin").size == BIG
        assert client.read_into("local/big.bin", bytearray(100), MiB) == 100
        assert counting.ops == ["read"]
        assert bytes(first) == bytes(again) == big[MiB : 4 * MiB]
        assert bytes(inside) == big[2 * MiB + 5 : 2 * MiB + 1005]

        # With the daemon gone, what is mapped still reads.
        immutable_node.daemon.stop()
        assert bytes(client.read("local/big.bin", MiB, 3 * MiB)) == big[MiB : 4 * MiB]
        assert counting.ops == ["read"]


def test_a_stale_name_is_revalidated_with_a_stat(node: Node) -> None:
    path = node.data / "small.txt"
    with Client(node.socket) as client:
        old = client.read("local/big.bin", 0, 2 * MiB)
        counting = Counting(client)
        time.sleep(1.2)  # the embedded `local` backend is re-checked after a second
        again = client.read("local/big.bin", 0, 2 * MiB)
        assert counting.ops == ["stat"]
        assert bytes(again) == bytes(old)

        # A new version of a mapped object: its old chunk ids are forgotten.
        changed = bytes(reversed(node.files["big.bin"]))
        (node.data / "big.bin").write_bytes(changed)
        time.sleep(1.2)
        counting.ops.clear()
        assert bytes(client.read("local/big.bin", 0, 2 * MiB)) == changed[: 2 * MiB]
        assert counting.ops == ["stat", "read"]
        assert bytes(old) == node.files["big.bin"][: 2 * MiB]

        before = client.read("local/small.txt")
        path.write_bytes(b"a new version, of another size\n")
        time.sleep(1.2)
        assert bytes(client.read("local/small.txt")) == b"a new version, of another size\n"
        assert bytes(before) == node.files["small.txt"]


def test_reads_of_more_chunks_than_one_answer_carries(immutable_node: Node) -> None:
    big, odd = immutable_node.files["big.bin"], immutable_node.files["odd.bin"]
    with Client(immutable_node.socket) as client:
        counting = Counting(client)
        view = client.read("local/big.bin")  # 161 chunks of 64 KiB: one answer
        assert bytes(view) == big
        assert counting.ops == ["read"]
        # 257 chunks, the last of 100 bytes: two requests, still one mapped view.
        tail = client.read("local/odd.bin")
        assert counting.ops == ["read", "read", "read"]
        assert isinstance(tail.obj, ctypes.Array)
        assert bytes(tail) == odd
        # Known size: balanced requests.
        client.close()
    with Client(immutable_node.socket, cache_bytes=0) as client:
        client.stat("local/odd.bin")
        counting = Counting(client)
        assert bytes(client.read("local/odd.bin", 10)) == odd[10:]
        assert counting.ops == ["read", "read"]


def test_views_and_memfds_are_read_only(node: Node) -> None:
    with Client(node.socket) as client:
        single = client.read("local/big.bin", 0, 1 * MiB)
        multi = client.read("local/big.bin")
        for view in (single, multi):
            with pytest.raises(TypeError):
                view[0] = 1
            with pytest.raises(TypeError):
                memoryview(view).cast("B")[0] = 1
            with pytest.raises(ValueError, match="read-only"):
                as_numpy(view)[0] = 1
        chunk = next(iter(client._reader.chunks._entries.values()))
        with pytest.raises(PermissionError):
            os.pwrite(chunk.fd, b"x", 0)
        with pytest.raises(PermissionError):
            mmap.mmap(chunk.fd, chunk.size)  # a shared, writable mapping
        with pytest.raises(PermissionError):
            os.ftruncate(chunk.fd, 0)
        assert bytes(multi) == node.files["big.bin"]


def test_client_cache_is_bounded_and_views_outlive_eviction(node: Node) -> None:
    big = node.files["big.bin"]
    with Client(node.socket, cache_bytes=5 * MiB) as client:
        views = [client.read("local/big.bin", i * 4 * MiB, 4 * MiB) for i in range(3)]
        info = client.cache_info()
        assert info.chunks == 1
        assert info.bytes <= 5 * MiB
        assert info.names == 1
        gc.collect()
        assert [bytes(v) for v in views] == [big[: 4 * MiB], big[4 * MiB : 8 * MiB], big[8 * MiB :]]


SUBPROCESS_READ = """
import hashlib, sys
from chunkd.client import Client
with Client() as client:
    view = client.read(sys.argv[1])
    print(hashlib.sha256(view).hexdigest(), len(view))
"""


def test_several_processes_read_the_same_bytes(node: Node) -> None:
    env = os.environ | {"CHUNKD_SOCKET": str(node.socket)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SUBPROCESS_READ, "local/big.bin"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outputs
    expected = f"{hashlib.sha256(node.files['big.bin']).hexdigest()} {BIG}\n".encode()
    assert [out for out, _ in outputs] == [expected] * 4


def test_a_request_the_protocol_refuses_is_not_sent_and_the_connection_stays(
    node: Node,
) -> None:
    with Client(node.socket) as client:
        assert client.request("stat", {"name": "local/small.txt"}).header["ok"]
        sock = client._connection._sock
        for fields, refused in [
            ({"name": "local/small.txt", "bogus": 1}, InvalidRequestError),
            ({"name": 5}, InvalidKeyError),
        ]:
            with pytest.raises(refused):
                client.request("stat", fields)
        with pytest.raises(InvalidKeyError):
            client.stat(5)  # type: ignore[arg-type]
        with pytest.raises(InvalidKeyError, match="longer than"):
            client.stat("local/" + "k" * 100_000)
        assert client._connection._sock is sock  # not dropped, not reconnected
        assert client.request("stat", {"name": "local/small.txt"}).header["size"] == len(
            node.files["small.txt"]
        )


def test_reads_at_the_end_follow_one_rule_cached_or_not(node: Node) -> None:
    # chunkd.ranges: a range that asks for bytes starts before the end. The client's
    # own cache answers as the daemon does, so a read does not depend on what is
    # cached; fsspec's slices stay slices.
    (node.data / "empty.bin").write_bytes(b"")
    size = len(node.files["small.txt"])
    with Client(node.socket) as client:
        for cached in (False, True):
            if cached:
                client.stat("local/empty.bin")
                client.read("local/small.txt")
            assert bytes(client.read("local/empty.bin")) == b""
            assert bytes(client.read("local/empty.bin", 0, 0)) == b""
            assert bytes(client.read("local/small.txt", size, 0)) == b""
            assert (
                bytes(client.read("local/small.txt", size - 3, 100)) == node.files["small.txt"][-3:]
            )
            for name, offset, length in [
                ("local/empty.bin", 0, 5),
                ("local/small.txt", size, 1),
                ("local/small.txt", size, None),
            ]:
                with pytest.raises(RangeNotSatisfiableError, match="past the end"):
                    client.read(name, offset, length)
            got = client.read_ranges(
                [("local/small.txt", size - 2, 10), ("local/small.txt", size, 4)]
            )
            assert got[0] == node.files["small.txt"][-2:]
            assert isinstance(got[1], RangeNotSatisfiableError)
    fs = ChunkdFileSystem(socket_path=str(node.socket), skip_instance_cache=True)
    assert fs.cat_ranges(["local/small.txt"] * 2, [size - 2, size], [size + 8, size + 4]) == [
        node.files["small.txt"][-2:],
        b"",
    ]


def test_daemon_errors_map_to_chunkd_errors(node: Node) -> None:
    with Client(node.socket) as client:
        with pytest.raises(UnknownBackendError, match="nope") as unknown:
            client.read("nope/x")
        assert isinstance(unknown.value, LookupError)
        with pytest.raises(ObjectNotFoundError, match=r"missing\.bin") as missing:
            client.read("local/missing.bin")
        assert isinstance(missing.value, FileNotFoundError)
        with pytest.raises(ObjectNotFoundError):
            client.stat("local/missing.bin")
        for bad in ("local/../etc/passwd", "no-slash", "local/a\x00b"):
            with pytest.raises(InvalidKeyError) as invalid:
                client.read(bad)
            assert isinstance(invalid.value, ValueError)
        with pytest.raises(ChunkdError, match="past the end"):
            client.read("local/small.txt", 10_000)
        with pytest.raises(ValueError, match="offset"):
            client.read("local/small.txt", -1)
        # The connection survives errors.
        assert bytes(client.read("local/small.txt")) == node.files["small.txt"]


def test_a_killed_and_restarted_daemon_is_reconnected(
    node: Node, start_daemon: Any, tmp_path: Path
) -> None:
    big = node.files["big.bin"]
    (node.data / "later.bin").write_bytes(big[::-1])
    with Client(node.socket) as client:
        old = client.read("local/big.bin")
        old_single = client.read("local/big.bin", 100, 1000)
        node.daemon.stop(signal.SIGKILL)
        assert bytes(old) == big
        assert bytes(old_single) == big[100:1100]

        # A read while no daemon serves waits for one (with backoff) ...
        got: list[Any] = []
        reader = threading.Thread(target=lambda: got.append(client.read("local/later.bin")))
        reader.start()
        time.sleep(0.3)
        start_daemon(cwd=tmp_path)  # the same cwd: the same socket and cache
        reader.join(60)
        assert not reader.is_alive()
        assert bytes(got[0]) == big[::-1]
        # ... and then everything works again, old views included.
        assert bytes(client.read("local/big.bin", 3, 5 * MiB)) == big[3 : 5 * MiB + 3]
        assert bytes(old) == big


def test_a_forked_child_gets_its_own_connection(node: Node) -> None:
    big = node.files["big.bin"]
    with Client(node.socket) as client:
        view = client.read("local/big.bin", 0, 5 * MiB)
        pid = os.fork()
        if pid == 0:  # the child: no pytest machinery past this point
            ok = False
            try:
                ok = (
                    bytes(view) == big[: 5 * MiB]
                    and bytes(client.read("local/big.bin", 7 * MiB)) == big[7 * MiB :]
                    and bytes(client.read("local/small.txt")) == node.files["small.txt"]
                )
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert bytes(client.read("local/small.txt")) == node.files["small.txt"]


def test_prefetch_starts_loads(node: Node) -> None:
    with Client(node.socket) as client:
        assert client.prefetch(["local/big.bin", "local/small.txt"]) == 2
        assert client.prefetch("local/big.bin") == 1
        assert client.prefetch([]) == 0


async def test_async_client(immutable_node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    node = immutable_node
    big = node.files["big.bin"]
    async with AsyncClient(node.socket) as client:
        view = await client.read("local/big.bin", 10, 5 * MiB)
        assert bytes(view) == big[10 : 5 * MiB + 10]
        st = await client.stat("local/big.bin")
        assert st.size == BIG

        def no_threads(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("a cache hit hopped to a thread")

        monkeypatch.setattr(asyncio, "to_thread", no_threads)
        again = await client.read("local/big.bin", 20, 1000)
        assert bytes(again) == big[20:1020]
        buf = bytearray(1000)
        assert await client.read_into("local/big.bin", buf, 30) == 1000
        assert buf == big[30:1030]
        assert (await client.stat("local/big.bin")).version == st.version
        monkeypatch.undo()

        assert await client.prefetch(["local/small.txt"]) == 1
        raw = await client.open("local/small.txt")
        assert raw.read() == node.files["small.txt"]
        with pytest.raises(ObjectNotFoundError):
            await client.read("local/missing")
