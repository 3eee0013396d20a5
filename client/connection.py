"""The client's connection to the node's daemon: find it, say hello, reconnect, fork.

A :class:`Connection` connects to the first socket that answers ``hello``: the
``socket_path`` argument, else ``$CHUNKD_SOCKET``, ``/run/chunkd/chunkd.sock``,
``./chunkd.sock``. When the connection breaks (the daemon restarted), the next
request reconnects with backoff for up to ``timeout`` seconds and is sent again:
every operation is idempotent. A request the daemon does not answer within
``timeout`` seconds raises :class:`~chunkd.errors.DaemonUnavailableError`. One
request at a time goes over a connection (under its lock). In a forked child
(a data-loader worker), :meth:`Connection.after_fork` gives it a lock of its own and
a connection of its own on first use.

An error answer raises the :mod:`chunkd.errors` class that the daemon named, with the
daemon's message (a name it does not know raises :class:`~chunkd.errors.ChunkdError`).

Internal to :mod:`chunkd.client`: :class:`~chunkd.client.Client` holds one.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Final

from chunkd.backoff import Backoff
from chunkd.client import protocol
from chunkd.errors import CacheClosedError, ChunkdError, DaemonUnavailableError
from chunkd.memfd import close_all

__all__ = ["Connection"]

log = logging.getLogger("chunkd.client")

#: the delays between attempts to reconnect to a daemon that went away
_RECONNECT: Final = Backoff(base=0.02, cap=0.5, jitter="equal")


def _fields_of(header: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in header.items() if k != "op"}


class Connection:
    """A connection to this node's chunkd daemon, connected on creation.

    Args:
        socket_path: the daemon's socket; None: the first of
            :func:`~chunkd.client.protocol.default_socket_paths` that answers.
        timeout: seconds to wait for an answer, and for the daemon to come back.
        train_job: the job (a checked name) its hello claims, and every reconnection's
            (:mod:`chunkd.client.jobs`); None: none.

    Attributes:
        timeout: as given.
        train_job: as given.
        path: the socket of the daemon last connected to.
        hello: that daemon's answer to ``hello``.
        closed: whether :meth:`close` was called.

    Raises:
        DaemonUnavailableError: no daemon answers on any of the sockets tried.
    """

    def __init__(
        self, socket_path: Path | None, timeout: float, train_job: str | None = None
    ) -> None:
        self.timeout = timeout
        self.train_job = train_job
        self._socket_arg = socket_path
        self._io_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.path: Path | None = None
        self.hello: dict[str, Any] = {}
        self._next_id = 0
        self.closed = False
        with self._io_lock:
            self._connect()

    def check_open(self) -> None:
        """Raise :class:`~chunkd.errors.CacheClosedError` once :meth:`close` was called."""
        if self.closed:
            raise CacheClosedError("this chunkd Client is closed; create a new one")

    def close(self) -> None:
        """Close the connection for good: every request after this one is refused."""
        with self._io_lock:
            self.closed = True
            self._disconnect()

    def after_fork(self) -> None:
        """In a forked child: a fresh lock, and a connection of its own on first use."""
        self._io_lock = threading.Lock()
        self._disconnect()  # closes only the child's copy of the socket

    def _candidates(self) -> list[Path]:
        if self._socket_arg is not None:
            return [self._socket_arg]
        paths = protocol.default_socket_paths()
        if self.path in paths:  # after a break, the daemon we had comes first
            paths.remove(self.path)
            paths.insert(0, self.path)
        return paths

    def _connect(self) -> None:
        """Connect to the first socket whose daemon says hello (under the io lock)."""
        tried: list[str] = []
        for path in self._candidates():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(os.fspath(path))
                self._next_id += 1
                hello_request = protocol.request_header(
                    "hello", {"version": protocol.VERSION, "train_job": self.train_job}
                )
                protocol.send_frame(sock, hello_request | {"id": self._next_id})
                hello, _, fds = protocol.recv_frame(sock)
                close_all(fds)
            except (OSError, protocol.ProtocolError) as exc:
                sock.close()
                reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
                if isinstance(exc, PermissionError):
                    reason += "; join the group that owns it (server.socket_group)"
                tried.append(f"{os.path.abspath(path)} ({reason})")
                continue
            if not hello.get("ok"):
                sock.close()
                raise protocol.error_of(hello, "hello")
            if hello.get("version") != protocol.VERSION:
                sock.close()
                raise ChunkdError(
                    f"the chunkd daemon at {path} speaks local protocol version "
                    f"{hello.get('version')!r}; this client speaks {protocol.VERSION}; "
                    "install the same chunkd version for both"
                )
            self._sock, self.path, self.hello = sock, path, hello
            return
        hint = (
            "pass the socket_path the daemon serves (server.socket in its config)"
            if self._socket_arg is not None
            else "set CHUNKD_SOCKET to the socket of a running daemon"
        )
        raise DaemonUnavailableError(
            f"no chunkd daemon answered on {', '.join(tried)}; start one on this node "
            f"with `chunkd serve` (or `make run` in a chunkd checkout), or {hint}"
        )

    def _reconnect(self) -> None:
        """Connect again, with backoff, for up to ``timeout`` seconds (under the io lock)."""
        delays = _RECONNECT.delays(deadline=time.monotonic() + self.timeout)
        while True:
            try:
                self._connect()
            except DaemonUnavailableError as exc:
                delay = next(delays, None)
                if delay is None:
                    raise DaemonUnavailableError(
                        f"lost the connection to the chunkd daemon and none came back "
                        f"within {self.timeout:g}s: {exc}"
                    ) from None
                time.sleep(delay)
            else:
                return

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _exchange(
        self,
        header: dict[str, Any],
        send_fds: list[int] | None = None,
        timeout: float | None = None,
    ) -> tuple[dict[str, Any], bytes, list[int]]:
        """One round trip on the connection (under the io lock)."""
        assert self._sock is not None
        self._next_id += 1
        request = header | {"id": self._next_id}
        protocol.send_frame(self._sock, request, fds=send_fds)
        if timeout is not None:
            self._sock.settimeout(timeout)
        try:
            reply, payload, fds = protocol.recv_frame(self._sock)
        finally:
            if timeout is not None and self._sock is not None:
                self._sock.settimeout(self.timeout)
        if reply.get("id") != request["id"]:
            close_all(fds)
            raise protocol.ProtocolError(
                f"answer {reply.get('id')!r} came for request {request['id']}"
            )
        return reply, payload, fds

    def request(
        self,
        header: dict[str, Any],
        what: str,
        send_fds: list[int] | None = None,
        *,
        timeout: float | None = None,
    ) -> tuple[dict[str, Any], bytes, list[int]]:
        """Send a request and return its successful answer; the caller owns the fds.

        ``send_fds`` go with the request (the caller keeps and closes them);
        ``timeout`` replaces the client's for this answer (a long daemon-side wait). A broken
        connection is reconnected (with backoff) and the request sent once more. An
        error answer raises its :mod:`chunkd.errors` class; a field the op does not
        take, or out of its bounds, raises :class:`InvalidRequestError` before anything
        is sent (the connection stays).
        """
        header = protocol.request_header(header["op"], _fields_of(header))
        with self._io_lock:
            self.check_open()
            for attempt in range(2):
                if self._sock is None:
                    self._reconnect()
                try:
                    reply, payload, fds = self._exchange(header, send_fds, timeout)
                except TimeoutError:
                    self._disconnect()
                    raise DaemonUnavailableError(
                        f"the chunkd daemon at {self.path} did not answer {what} within "
                        f"{timeout or self.timeout:g}s; it may be overloaded (raise "
                        "Client(timeout=...))"
                    ) from None
                except protocol.ProtocolError:
                    self._disconnect()
                    raise
                except OSError as exc:  # reset, broken pipe, EOF: the daemon went away
                    self._disconnect()
                    if attempt:
                        raise DaemonUnavailableError(
                            f"the chunkd daemon at {self.path} dropped {what} twice: {exc}"
                        ) from exc
                    log.info("chunkd connection lost (%s); reconnecting", exc)
                    continue
                except BaseException:
                    # Interrupted mid-exchange (KeyboardInterrupt, ...): the answer may
                    # still come, so this connection cannot carry the next request.
                    self._disconnect()
                    raise
                break
        if not reply.get("ok"):
            close_all(fds)
            raise protocol.error_of(reply, what)
        return reply, payload, fds
