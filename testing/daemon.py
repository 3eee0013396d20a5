"""A real ``chunkd serve`` process, launched, waited for and stopped in one place.

Every test, benchmark and lab that runs the daemon starts it here: the tests' fixtures
(``tests/conftest.py``), the benchmarks' :class:`bench.daemon.BenchDaemon`, the soak's
:class:`~chunkd.testing.soak.SoakDaemon`, the network lab's nodes
(:meth:`~chunkd.testing.netlab.Lab.start_node`, inside a namespace through
``prefix``) and the scale and GPU benches. What it does, in order:

1. the environment is this process's (or ``base_env``) without any ``CHUNKD_*``
   variable (a machine's own settings never leak into a test), then ``env`` on top,
   then ``listen`` and ``socket`` as ``CHUNKD_SERVER_LISTEN``/``CHUNKD_SERVER_SOCKET``
   unless ``env`` set them;
2. a config given as text is written to ``config_path`` (``cwd/chunkd.toml`` unless
   told); a :class:`~pathlib.Path` is used as it is; ``None`` runs on the embedded
   default;
3. ``[*prefix, *program, "serve", "--config", CONFIG, *args]`` runs in ``cwd``, its
   stdout and stderr appended to ``log`` (``cwd/daemon.log`` unless told);
4. :meth:`DaemonProcess.wait_ready` polls ``/readyz`` (or :meth:`wait_socket` the
   local socket) until it answers, and raises with the log's tail if the process
   exits first or the time runs out;
5. :meth:`DaemonProcess.stop` sends SIGTERM (or the signal asked), waits, and kills
   what is still running after ``timeout``.
"""

from __future__ import annotations

import os
import signal
import socket as socket_module
import ssl
import stat
import subprocess
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from chunkd.testing.ports import BIN

__all__ = ["CHUNKD", "DaemonProcess", "DaemonStartError"]

#: the installed ``chunkd`` command of the running interpreter
CHUNKD: tuple[str, ...] = (str(BIN / "chunkd"),)


class DaemonStartError(RuntimeError):
    """The daemon exited, or did not answer, before it was ready; the message holds
    the tail of its log."""


class DaemonProcess:
    """One ``chunkd serve`` process (started by the constructor).

    Args:
        config: the config's TOML text (written to ``config_path``), a path to a
            config file, or None for the embedded default.
        cwd: the daemon's working directory (created if missing).
        env: variables on top of ``base_env`` less its ``CHUNKD_*``.
        args: more ``chunkd serve`` arguments (``--enable-faults``).
        prefix: a command the daemon runs under (``ip netns exec NS``, ``prlimit ...``).
        program: the ``chunkd`` command (``python -m chunkd`` for a tree that is not
            installed).
        log: where stdout and stderr are appended (``cwd/daemon.log`` by default).
        config_path: where config text is written (``cwd/chunkd.toml`` by default).
        listen: ``HOST:PORT`` for ``CHUNKD_SERVER_LISTEN`` (unless ``env`` sets it).
        socket: the local socket, for ``CHUNKD_SERVER_SOCKET`` (unless ``env`` sets it).
        url: the HTTP address ``/readyz`` is asked at; by default ``http://`` and the
            listen address of the environment, if any.
        base_env: the environment to start from (this process's by default).
    """

    def __init__(
        self,
        config: str | Path | None = None,
        *,
        cwd: Path,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
        prefix: Sequence[str] = (),
        program: Sequence[str] = CHUNKD,
        log: Path | None = None,
        config_path: Path | None = None,
        listen: str | None = None,
        socket: Path | str | None = None,
        url: str | None = None,
        base_env: Mapping[str, str] | None = None,
    ) -> None:
        cwd.mkdir(parents=True, exist_ok=True)
        self.cwd = cwd
        base = os.environ if base_env is None else base_env
        environ = {k: v for k, v in base.items() if not k.startswith("CHUNKD_")}
        environ.update(env or {})
        if listen is not None:
            environ.setdefault("CHUNKD_SERVER_LISTEN", listen)
        if socket is not None:
            environ.setdefault("CHUNKD_SERVER_SOCKET", str(socket))
        #: the whole environment the daemon runs with
        self.env = environ
        #: the config file it runs on (None: the embedded default)
        self.config: Path | None
        if isinstance(config, str):
            self.config = config_path or cwd / "chunkd.toml"
            self.config.write_text(config)
        else:
            self.config = config
        self.log = log or cwd / "daemon.log"
        listening = environ.get("CHUNKD_SERVER_LISTEN")
        self.url = url or (f"http://{listening}" if listening else None)
        self.argv = [*prefix, *program, "serve"]
        if self.config is not None:
            self.argv += ["--config", str(self.config)]
        self.argv += args
        with self.log.open("ab") as sink:  # the child keeps its own copy
            self.process: subprocess.Popen[bytes] = subprocess.Popen(
                self.argv, cwd=cwd, env=environ, stdout=sink, stderr=sink
            )

    @property
    def pid(self) -> int:
        """The process id (of ``prefix``'s command, where one was given)."""
        return self.process.pid

    @property
    def socket(self) -> Path | None:
        """The local socket set by the environment (None where the config says)."""
        path = self.env.get("CHUNKD_SERVER_SOCKET")
        return None if path is None else Path(path)

    def log_tail(self, size: int = 4000) -> str:
        """The last ``size`` characters of the log."""
        try:
            return self.log.read_text(errors="replace")[-size:]
        except OSError as exc:
            return f"(no log: {exc})"

    def ready(self, context: ssl.SSLContext | None = None) -> bool:
        """Whether ``/readyz`` answers 200 now."""
        if self.url is None:
            raise ValueError("the daemon's HTTP address is unknown: give url or listen")
        try:
            with urllib.request.urlopen(f"{self.url}/readyz", timeout=5, context=context) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def wait_ready(self, timeout: float = 60.0, context: ssl.SSLContext | None = None) -> Self:
        """Wait until ``/readyz`` answers 200.

        Raises:
            DaemonStartError: the process exited first, or ``timeout`` seconds passed
                (the process is then stopped).
        """
        return self._wait(lambda: self.ready(context), "answer /readyz", timeout)

    def wait_socket(self, path: Path | str | None = None, timeout: float = 60.0) -> Self:
        """Wait until the local socket (``path``, or :attr:`socket`) accepts a
        connection.

        Raises:
            DaemonStartError: as :meth:`wait_ready`.
        """
        where = Path(path) if path is not None else self.socket
        if where is None:
            raise ValueError("the daemon's socket is unknown: give path or socket")

        def accepts() -> bool:
            try:
                if not stat.S_ISSOCK(where.stat().st_mode):
                    return False
                with socket_module.socket(socket_module.AF_UNIX) as probe:
                    probe.connect(str(where))
            except OSError:
                return False
            return True

        return self._wait(accepts, f"accept on {where}", timeout)

    def _wait(self, done: Callable[[], bool], what: str, timeout: float) -> Self:
        deadline = time.monotonic() + timeout
        while not done():
            if self.process.poll() is not None:
                raise DaemonStartError(
                    f"chunkd exited with {self.process.returncode} before it would {what}; "
                    f"{self.log}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.stop(timeout=10)
                raise DaemonStartError(
                    f"chunkd did not {what} within {timeout:g} s; {self.log}:\n{self.log_tail()}"
                )
            time.sleep(0.05)
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig`` (SIGTERM), wait up to ``timeout`` seconds, then SIGKILL; the
        exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=10)

    def kill(self) -> int:
        """SIGKILL (if still running), and wait; the exit status."""
        if self.process.poll() is None:
            self.process.kill()
        return self.process.wait(timeout=10)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
