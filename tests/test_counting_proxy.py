"""The tests' counting proxy (chunkd.testing.CountingProxy) leaves no socket open."""

from __future__ import annotations

import gc
import socket
import threading
import time
import warnings
from collections.abc import Iterator

import pytest

from chunkd.testing import CountingProxy


@pytest.fixture
def upstream() -> Iterator[int]:
    """A plain TCP server that answers every connection with a few bytes and closes it."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(b"hello")

    thread = threading.Thread(target=serve)
    thread.start()
    yield listener.getsockname()[1]
    done.set()
    thread.join()
    listener.close()


def test_connections_accepted_as_it_closes_leave_no_socket_open(upstream: int) -> None:
    # The race of the flaky CI runs, made certain: while the proxy's loop is busy,
    # clients connect (the kernel queues them) and close() is asked for, so that the
    # loop accepts them in the same round in which it learns to stop listening.
    clients: list[socket.socket] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for _ in range(5):
            proxy = CountingProxy(upstream)
            proxy._loop.call_soon_threadsafe(time.sleep, 0.3)  # the loop is busy
            time.sleep(0.05)
            clients += [socket.create_connection(("127.0.0.1", proxy.port)) for _ in range(20)]
            proxy.close()
            del proxy
            gc.collect()
        for client in clients:
            client.close()
        gc.collect()
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaks, leaks[:3]


def test_close_ends_connections_in_every_state(upstream: int) -> None:
    proxy = CountingProxy(upstream)
    proxy.delay = 30.0  # a connection that sleeps in the middle of its relay
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        slow = socket.create_connection(("127.0.0.1", proxy.port))
        done = socket.create_connection(("127.0.0.1", proxy.port))
        done.close()  # one the client has closed already
        time.sleep(0.2)
        started = time.monotonic()
        proxy.close()
        took = time.monotonic() - started
        assert slow.recv(100) == b""  # the proxy ended it
        slow.close()
        del proxy
        gc.collect()
    assert took < 8
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaks, leaks[:3]
