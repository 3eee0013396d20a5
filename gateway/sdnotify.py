"""Telling systemd how the daemon is doing: the ``sd_notify`` protocol, without libsystemd.

Under ``Type=notify`` systemd passes the address of a datagram socket in
``NOTIFY_SOCKET``: an absolute path, or a name in the abstract namespace written
with a leading ``@``. A service reports its state by sending one ``AF_UNIX``
``SOCK_DGRAM`` datagram of newline-separated ``KEY=VALUE`` lines to it. systemd
takes the sender's pid from the kernel (``SCM_CREDENTIALS``); with
``NotifyAccess=main`` only the daemon's main process is heard.

What chunkd sends, and when:

1. ``STATUS=...`` while starting, e.g. ``STATUS=opening index``; ``systemctl status``
   shows the latest one.
2. ``READY=1`` (with a ``STATUS=`` line) once, after the index is open and every HTTP
   site and the local socket are bound. Until then the unit is "activating" and units
   ordered after it wait; without it systemd kills the daemon at ``TimeoutStartSec``.
3. ``WATCHDOG=1`` every half ``WATCHDOG_USEC`` (``WatchdogSec=`` in the unit), sent by
   a task on the event loop (:meth:`SystemdNotifier.run_watchdog`). The pings stop
   when the loop is stuck, and then systemd kills and restarts the daemon
   (``Restart=on-failure``): a wedged loop serves nobody, so it must not look alive.
   systemd sets ``WATCHDOG_PID`` to the pid it expects pings from; a child process
   that inherited the environment sees another pid and stays silent.
4. ``STOPPING=1`` (with a ``STATUS=`` line) as soon as SIGTERM arrives, before
   draining: systemd then knows the daemon is shutting down on purpose.

Outside systemd (no ``NOTIFY_SOCKET``) the notifier is disabled and every call is a
no-op. Sending never raises for a missing or dead socket: the daemon must keep
serving even if systemd's socket has gone away, so such failures are logged at debug
level and reported as ``False``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Mapping
from typing import Final

__all__ = ["SystemdNotifier"]

log = logging.getLogger("chunkd.gateway.sdnotify")

# systemd's socket has a large receive buffer, so a send hardly ever waits; the limit
# only bounds how long a jammed socket could hold up the event loop.
_SEND_TIMEOUT: Final = 1.0

# Characters after which ``str.splitlines`` (and so a reader of the datagram) would
# start a new line: a STATUS text containing one could forge another assignment.
_LINE_BREAKS: Final = dict.fromkeys(map(ord, "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"), " ")


class SystemdNotifier:
    """Sends state notifications to systemd over the ``NOTIFY_SOCKET`` datagram socket.

    Use :meth:`from_env` in the daemon; the constructor is for tests and for callers
    that already know the address.

    Args:
        address: the notification socket: an absolute path, or an abstract-namespace
            name written with a leading ``@``. ``None`` (or ``""``) disables the notifier.
        watchdog_usec: the watchdog timeout in microseconds, or ``None`` when systemd
            expects no pings from this process.
    """

    def __init__(self, address: str | None, *, watchdog_usec: int | None = None) -> None:
        self._address: str | None = address or None
        self._watchdog_usec = (
            watchdog_usec if watchdog_usec is not None and watchdog_usec > 0 else None
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SystemdNotifier:
        """Build a notifier from the variables systemd sets for the service.

        Reads ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID``. The watchdog
        applies only when ``WATCHDOG_PID`` is absent or equals this process's pid.
        Addresses that are neither a path nor ``@name`` (e.g. ``vsock:``) and values
        that do not parse disable the part they belong to, with a debug message.

        Args:
            environ: the environment to read; ``os.environ`` by default.

        Returns:
            A notifier, disabled when the process does not run under ``Type=notify``.
        """
        env = os.environ if environ is None else environ
        address: str | None = env.get("NOTIFY_SOCKET") or None
        if address is not None and not address.startswith(("/", "@")):
            log.debug("NOTIFY_SOCKET=%r is not a unix socket address; not notifying", address)
            address = None
        return cls(address, watchdog_usec=_watchdog_usec(env))

    @property
    def enabled(self) -> bool:
        """Whether there is a socket to notify (the process runs under ``Type=notify``)."""
        return self._address is not None

    @property
    def address(self) -> str | None:
        """The notification socket as systemd wrote it (``@`` for abstract), or ``None``."""
        return self._address

    def notify(self, *lines: str) -> bool:
        """Send ``lines`` as one datagram of ``KEY=VALUE`` lines.

        Args:
            *lines: assignments such as ``"READY=1"``; each must contain ``=`` and no
                newline.

        Returns:
            ``True`` when the datagram was sent; ``False`` when the notifier is disabled
            or the socket is missing, refuses, or does not answer in time.

        Raises:
            ValueError: a line is not a single ``KEY=VALUE`` assignment (a caller's bug,
                never a runtime condition).
        """
        for line in lines:
            key, sep, _ = line.partition("=")
            if not sep or not key or "\n" in line:
                raise ValueError(
                    f"sd_notify line {line!r} is not one KEY=VALUE assignment; "
                    "pass each assignment as its own argument, without newlines"
                )
        if self._address is None or not lines:
            return False
        payload = ("\n".join(lines) + "\n").encode()
        target = "\0" + self._address[1:] if self._address.startswith("@") else self._address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.settimeout(_SEND_TIMEOUT)
                sock.sendto(payload, target)
        except OSError as exc:
            log.debug("sd_notify to %s failed: %s", self._address, exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """Send ``READY=1``: the index is open and every listener is bound.

        Args:
            status: an optional ``STATUS=`` text sent in the same datagram.

        Returns:
            Whether the datagram was sent.
        """
        return self.notify("READY=1", *self._status_lines(status))

    def stopping(self, status: str | None = None) -> bool:
        """Send ``STOPPING=1``: shutdown has begun (SIGTERM was received).

        Args:
            status: an optional ``STATUS=`` text sent in the same datagram.

        Returns:
            Whether the datagram was sent.
        """
        return self.notify("STOPPING=1", *self._status_lines(status))

    def status(self, text: str) -> bool:
        """Send ``STATUS=text``, the one-line state ``systemctl status`` shows.

        Line breaks in ``text`` become spaces.

        Returns:
            Whether the datagram was sent.
        """
        return self.notify(*self._status_lines(text))

    def watchdog(self) -> bool:
        """Send one ``WATCHDOG=1`` keep-alive ping.

        Returns:
            Whether the datagram was sent (``False`` also when the watchdog is off).
        """
        if self.watchdog_interval() is None:
            return False
        return self.notify("WATCHDOG=1")

    def watchdog_interval(self) -> float | None:
        """Seconds between watchdog pings: half of ``WATCHDOG_USEC``.

        Half the timeout leaves a full interval of slack for a ping delayed by a busy
        loop before systemd gives up.

        Returns:
            The interval, or ``None`` when the notifier or the watchdog is disabled.
        """
        if self._address is None or self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 2e6

    async def run_watchdog(self, stop: asyncio.Event) -> None:
        """Ping the watchdog every :meth:`watchdog_interval` seconds until ``stop`` is set.

        Run it as a task on the daemon's event loop: it pings only while the loop runs
        tasks, which is what the watchdog is meant to check. Returns at once when the
        watchdog is disabled.

        Args:
            stop: set to end the pings (at shutdown, after ``STOPPING=1``).
        """
        interval = self.watchdog_interval()
        if interval is None:
            return
        while not stop.is_set():
            self.watchdog()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    def __repr__(self) -> str:
        return f"SystemdNotifier(address={self._address!r}, watchdog_usec={self._watchdog_usec!r})"

    @staticmethod
    def _status_lines(status: str | None) -> tuple[str, ...]:
        if status is None:
            return ()
        return ("STATUS=" + status.translate(_LINE_BREAKS),)


def _watchdog_usec(env: Mapping[str, str]) -> int | None:
    """``WATCHDOG_USEC`` when it is meant for this process, else ``None``."""
    raw_usec = env.get("WATCHDOG_USEC")
    if not raw_usec:
        return None
    raw_pid = env.get("WATCHDOG_PID")
    if raw_pid:
        try:
            pid = int(raw_pid)
        except ValueError:
            log.debug("WATCHDOG_PID=%r is not a pid; no watchdog", raw_pid)
            return None
        if pid != os.getpid():
            # Inherited from the parent systemd started: the pings are its job.
            return None
    try:
        usec = int(raw_usec)
    except ValueError:
        log.debug("WATCHDOG_USEC=%r is not a number of microseconds; no watchdog", raw_usec)
        return None
    return usec if usec > 0 else None
