"""A bounded pool of worker processes: :class:`WorkerPool`, run in the role of its
:class:`PoolRole`. The inspector's (``docs/inspector.md``,
:mod:`chunkd.gateway.inspector.pool`) and the dataset decoder's (``docs/decoding.md``,
:mod:`chunkd.gateway.decoding`) are each a pool of their own role.

The daemon never decodes a file: each request goes to one of ``workers`` processes of
``python -m ROLE.MODULE`` (the inspector's ``chunkd.client.inspect.worker``), ordinary
clients of the local socket. The protocol, one JSON object a line::

    daemon -> worker (stdin)    {"n": N, "op": OP, "args": {...}}
    worker -> daemon (stdout)   {"n": N, "ok": true, "result": {...}}
                                {"n": N, "ok": false, "error": KIND, "message": TEXT}

A worker serves one request at a time. The pool:

1. starts nothing until the first request (a daemon that is never inspected spawns no
   process), then at most ``workers`` processes, each as it is first needed;
2. queues a request while every worker is busy, at most :data:`MAX_WAITING` of them;
   one more is refused at once (``BackendUnavailableError``, a 503 with Retry-After);
3. writes the request line and waits ``timeout`` seconds for the answer line. Past it
   the worker is killed (its whole process group) and the request fails with
   ``InspectTimeoutError``; a worker that dies, closes its stdout, sends a line over
   :data:`MAX_ANSWER_BYTES` or one that is not an answer to the request fails it with
   ``InspectCrashedError``. Either way the next request gets a fresh worker;
4. raises an error answer as the chunkd error its kind names
   (:func:`chunkd.errors.error_class`), so the HTTP edge maps it like any other;
5. gives up a call that is cancelled (its client left: the route cancels it): a waiting
   one leaves the queue, a running one's worker is killed and replaced, since its
   answer would be left unread.

A role with ``fds`` gives each worker one end of a socket pair (``--fds N``): before each
success answer line, the worker sends exactly one message on it carrying the answer's
fds, if any (SCM_RIGHTS); :meth:`WorkerPool.call_fds` takes it right after the line, without
waiting (it is queued before the line was written). A success answer without it, or an
error answer with one, is a broken protocol (``InspectCrashedError``).

A worker's environment holds what Python needs (``PATH``, the locale, ``HOME``,
``PYTHONPATH``), ``CHUNKD_SOCKET`` and its allocators' settings: never the daemon's
own, which holds backend credentials and the server token. Its stderr is read all the
time (a full pipe would stall it) and logged, each line cut to
:data:`STDERR_LINE_CHARS`, at most :data:`STDERR_LINES` lines a minute for the whole
pool.

The mechanism is here, apart from either role, so that the decoder does not reach into
the inspector's package for it; a role is a declaration (:class:`PoolRole`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import re
import signal
import socket as sockets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from chunkd.errors import (
    BackendUnavailableError,
    CacheClosedError,
    ChunkdError,
    InspectCrashedError,
    InspectError,
    InspectTimeoutError,
    error_class,
)

__all__ = [
    "MAX_ANSWER_BYTES",
    "MAX_WAITING",
    "STDERR_LINES",
    "STDERR_LINE_CHARS",
    "PoolRole",
    "WorkerPool",
    "sockets_close",
]

# The logger's name is the one the pool had in the inspector's package: log filters and
# dashboards that name it keep working.
log = logging.getLogger("chunkd.gateway.inspector")

#: requests that may wait for a busy pool; one more is refused with a 503
MAX_WAITING: Final = 64
#: the longest answer line a worker may send (a page of rows is at most 16 MiB of JSON)
MAX_ANSWER_BYTES: Final = 64 << 20
#: worker stderr lines logged a minute, for the whole pool; the rest are counted
STDERR_LINES: Final = 30
#: a worker stderr line is cut to this many characters in the log
STDERR_LINE_CHARS: Final = 2000
_STDERR_WINDOW: Final = 60.0
#: the last stderr lines of each worker, logged when it dies on a request
_LAST_WORDS: Final = 8
#: subjects a worker remembers having served (for the next request about them)
_SERVED: Final = 32
#: a worker's error answers are small; one longer than this is not one
_MAX_ERROR_BYTES: Final = 1 << 20
#: how a worker's success answer starts (its keys in this order: see the worker)
_RESULT: Final = re.compile(rb'\{"n":([0-9]{1,18}),"ok":true,"result":')
#: how long a worker that closed its stdout gets to exit before it is killed
_EXIT_GRACE: Final = 2.0
#: what a worker keeps of the daemon's environment: what Python needs to start
_ENVIRONMENT: Final = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "PYTHONPATH")
#: fds one answer of a worker may carry (a role with ``fds``)
_MAX_ANSWER_FDS: Final = 4
#: what a worker's allocators are told: under RLIMIT_AS, address space reserved ahead
#: counts as used, and glibc's per-thread arenas (64 MiB each) and mimalloc's reserve
#: (128 MiB at its first allocation) would spend a quarter of a 512 MiB limit on nothing
_ALLOCATOR: Final = {"MALLOC_ARENA_MAX": "2", "MIMALLOC_ARENA_RESERVE": "0"}


@dataclass(frozen=True, slots=True)
class PoolRole:
    """What a pool's workers are: the module they run and how their failures read."""

    #: a word for logs and messages: ``inspector``, ``decoder``
    name: str
    #: the verb of a request in messages: ``inspect``, ``decode``
    verb: str
    #: the worker's module (``python -m MODULE --socket PATH --memory BYTES``)
    module: str
    #: the config keys named in messages
    workers_key: str
    timeout_key: str
    memory_key: str
    #: what a request that timed out should do, for its message
    timeout_advice: str
    #: what a request whose worker crashed may mean, for its message
    crash_advice: str
    #: requests that may wait for a busy pool
    max_waiting: int = MAX_WAITING
    #: each worker gets a socket pair for the fds of its answers (``--fds N``)
    fds: bool = False
    #: requests about one subject go to the worker that served it lately
    affinity: Callable[[str, dict[str, Any]], str | None] | None = None


class WorkerPool:
    """``workers`` processes of ``python -m ROLE.MODULE``, each reading through the
    daemon's local socket ``socket``, limited to ``memory`` bytes of address space and
    ``timeout`` seconds a request.

    Args:
        socket: The daemon's local socket, which the workers read through.
        role: What the workers are (:class:`PoolRole`).
        workers: How many processes decode at once.
        timeout: Seconds one request may take before its worker is killed.
        memory: Bytes of address space each worker may map (``--memory``).
    """

    def __init__(
        self, socket: Path, role: PoolRole, *, workers: int, timeout: float, memory: int
    ) -> None:
        self.socket = socket
        self.role = role
        self.workers = workers
        self.timeout = timeout
        self.memory = memory
        self._slots = asyncio.Semaphore(workers)
        self._waiting = 0
        self._idle: list[_Worker] = []
        self._live: set[_Worker] = set()
        self._reaping: set[asyncio.Task[None]] = set()
        self._warming: set[asyncio.Task[None]] = set()
        self._stderr = _StderrLog(role.name)
        self._closed = False

    @property
    def started(self) -> int:
        """Worker processes running now."""
        return len(self._live)

    @property
    def busy(self) -> bool:
        """Whether a request now would be refused: every worker is busy and
        ``role.max_waiting`` requests wait."""
        return self._slots.locked() and self._waiting >= self.role.max_waiting

    async def call(self, op: str, args: dict[str, Any]) -> bytes:
        """Run ``op`` with ``args`` in a worker; its result, as the worker wrote it: a
        JSON object in ASCII, passed on without being parsed (a page of rows may be
        megabytes, and parsing holds the GIL however it is threaded).

        Raises:
            InspectTimeoutError: The request ran past ``timeout``; its worker was killed.
            InspectCrashedError: The worker died on the request (out of memory, a crash
                in native code) or broke the protocol; it was replaced.
            BackendUnavailableError: :data:`MAX_WAITING` requests are already waiting.
            CacheClosedError: The daemon is stopping.
            ChunkdError: The worker's error answer, as the class its kind names
                (``MalformedFileError``, ``ObjectNotFoundError``, ...).
        """
        result, fds = await self._call(op, args)
        sockets_close(fds)
        return result

    async def call_fds(self, op: str, args: dict[str, Any]) -> tuple[bytes, list[int]]:
        """:meth:`call`, with the fds the worker sent with its answer (a role with
        ``fds``): the caller's to close."""
        return await self._call(op, args)

    async def _call(self, op: str, args: dict[str, Any]) -> tuple[bytes, list[int]]:
        self._check_open()
        if self.busy:
            raise BackendUnavailableError(
                f"the {self.role.name} is busy: {self._waiting} requests are waiting for its "
                f"{self.workers} workers; try again shortly (or raise {self.role.workers_key})"
            )
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        fds: list[int] = []
        try:
            self._check_open()
            affinity = self.role.affinity
            subject = None if affinity is None else affinity(op, args)
            worker = await self._take(subject)
            if subject is not None and subject not in worker.served:
                worker.served.append(subject)
            try:
                answer, fds = await worker.ask(op, args)
            except InspectCrashedError:
                self._check_open()  # killed by close(): the daemon is stopping
                raise
            finally:
                if worker.broken or self._closed or len(self._live) > self.workers:
                    self._retire(worker)
                else:
                    self._idle.append(worker)
        except BaseException:
            sockets_close(fds)
            raise
        finally:
            self._slots.release()
        if isinstance(answer, bytes):
            return answer, fds
        kind = answer.get("error")
        message = answer.get("message")
        raise error_class(kind)(message if isinstance(message, str) else f"{kind}")

    async def close(self) -> None:
        """Stop every worker: kill each, and wait until each is reaped."""
        self._closed = True
        # A worker being started comes to the pool closed, and retires itself.
        await asyncio.gather(*self._warming, return_exceptions=True)
        self._idle.clear()
        for worker in list(self._live):
            self._retire(worker)
        while self._reaping:
            await asyncio.gather(*self._reaping, return_exceptions=True)

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError(
                f"the daemon is stopping: the {self.role.name} takes no more requests"
            )

    async def _take(self, subject: str | None = None) -> _Worker:
        """An idle worker that is still alive, or a new one: the one that served
        ``subject`` (an object or a snapshot) lately, if it is idle, since it holds what
        it decoded of it (a Parquet footer, a row group)."""
        if subject is not None:
            for worker in reversed(self._idle):
                if subject in worker.served:
                    self._idle.remove(worker)
                    self._idle.append(worker)
                    break
        while self._idle:
            worker = self._idle.pop()
            if worker.process.returncode is None:
                return worker
            self._retire(worker)  # died while idle: killed from outside, say
        if not self._live and not self._warming:
            # The first request: the others start now, beside it. A page asks for a
            # file's summary and its first rows at once, and a worker takes ~0.5 s to start.
            for _ in range(self.workers - 1):
                task = asyncio.ensure_future(self._spare())
                self._warming.add(task)
                task.add_done_callback(self._warming.discard)
        elif self._warming:
            # One is starting already: take it rather than start one more than the bound.
            await asyncio.wait(set(self._warming), return_when=asyncio.FIRST_COMPLETED)
            return await self._take(subject)
        return await self._spawn()

    async def _spare(self) -> None:
        """Start a worker ahead of the requests that will want it."""
        try:
            worker = await self._spawn()
        except CacheClosedError:
            return  # the daemon is stopping
        except ChunkdError as exc:
            log.warning("a %s worker did not start: %s", self.role.name, exc)
            return
        if len(self._live) > self.workers:
            self._retire(worker)  # the requests started their own meanwhile
        else:
            self._idle.append(worker)

    async def _spawn(self) -> _Worker:
        env = {name: os.environ[name] for name in _ENVIRONMENT if name in os.environ}
        env["CHUNKD_SOCKET"] = str(self.socket)
        env["PYTHONUNBUFFERED"] = "1"
        env |= _ALLOCATOR
        command = [sys.executable, "-m", self.role.module]
        command += ["--socket", str(self.socket), "--memory", str(self.memory)]
        channel: sockets.socket | None = None
        theirs: sockets.socket | None = None
        if self.role.fds:
            channel, theirs = sockets.socketpair(sockets.AF_UNIX, sockets.SOCK_SEQPACKET)
            channel.setblocking(False)
            command += ["--fds", str(theirs.fileno())]
        try:
            process = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                limit=MAX_ANSWER_BYTES,
                # Its own process group: a terminal's Ctrl-C goes to the daemon alone,
                # and a kill reaches whatever the worker started.
                start_new_session=True,
                close_fds=True,
                pass_fds=() if theirs is None else (theirs.fileno(),),
            )
        except OSError as exc:
            if channel is not None:
                channel.close()
            raise InspectError(
                f"cannot start {_article(self.role.name)} worker ({' '.join(command[:3])}): {exc}"
            ) from exc
        finally:
            if theirs is not None:
                theirs.close()  # the worker has its copy
        worker = _Worker(process, self._stderr, self.role, timeout=self.timeout, channel=channel)
        self._live.add(worker)
        log.info("%s worker started", self.role.name, extra={"pid": process.pid})
        if self._closed:  # close() ran while it started
            self._retire(worker)
            self._check_open()
        return worker

    def _retire(self, worker: _Worker) -> None:
        """Kill ``worker`` now; it is reaped in a task that :meth:`close` waits for."""
        if worker not in self._live:
            return
        self._live.discard(worker)
        worker.kill()
        task = asyncio.ensure_future(worker.reap())
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)


class _Worker:
    """One worker process, serving one request at a time."""

    def __init__(
        self,
        process: asyncio.subprocess.Process,
        stderr: _StderrLog,
        role: PoolRole,
        *,
        timeout: float,
        channel: sockets.socket | None = None,
    ) -> None:
        self.process = process
        self.role = role
        #: the daemon's end of the worker's socket pair for answer fds (a role with fds)
        self.channel = channel
        #: seconds a request may take
        self.timeout = timeout
        self.pid = process.pid
        #: it must not serve again: it timed out, died, or left an answer unread
        self.broken = False
        self.last_words: collections.deque[str] = collections.deque(maxlen=_LAST_WORDS)
        #: what it served lately (objects, snapshots): requests for them come back here
        self.served: collections.deque[str] = collections.deque(maxlen=_SERVED)
        self._n = 0
        assert process.stderr is not None
        self._drain = asyncio.ensure_future(stderr.drain(process.stderr, self))

    async def ask(self, op: str, args: dict[str, Any]) -> tuple[bytes | dict[str, Any], list[int]]:
        """Send one request and read its answer line (and the fds sent with it)."""
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        timeout = self.timeout
        # Broken until a whole answer is in: a timeout, a crash or a cancelled request
        # leaves an answer unread, and the next request would read it as its own.
        self.broken = True
        self._n += 1
        line = json.dumps({"n": self._n, "op": op, "args": args}).encode() + b"\n"
        try:
            async with asyncio.timeout(timeout):
                self.process.stdin.write(line)
                await self.process.stdin.drain()
                answer = await self.process.stdout.readline()
        except TimeoutError:
            self.kill()
            role = self.role
            log.warning(
                "%s worker killed: a request ran past %s",
                role.name,
                role.timeout_key,
                extra={"pid": self.pid, "op": op, "timeout_s": timeout},
            )
            raise InspectTimeoutError(
                f"{role.verb} {op} {_describe(args)} ran past {role.timeout_key} "
                f"({timeout:g}s); its worker was killed and replaced. {role.timeout_advice}"
            ) from None
        except ValueError:  # the line ran past the stream's limit
            raise self._crashed(
                op, args, f"sent an answer over {MAX_ANSWER_BYTES >> 20} MiB"
            ) from None
        except (ConnectionError, BrokenPipeError):
            raise self._crashed(op, args, await self._exit_status()) from None
        if not answer.endswith(b"\n"):
            raise self._crashed(op, args, await self._exit_status())
        found = _RESULT.match(answer)
        if found is not None:
            # {"n":N,"ok":true,"result":{...}}\n: the result is what lies between.
            result = answer[found.end() : -2]
            if int(found[1]) != self._n or not answer.endswith(b"}\n") or result[:1] != b"{":
                raise self._crashed(op, args, "sent a line that is not the answer to its request")
            fds = self._answer_fds()
            if self.channel is not None and fds is None:
                raise self._crashed(op, args, "sent an answer without its fds")
            self.broken = False
            return result, fds or []
        parsed = _parse(answer) if len(answer) <= _MAX_ERROR_BYTES else None
        if not isinstance(parsed, dict) or parsed.get("n") != self._n:
            raise self._crashed(op, args, "sent a line that is not the answer to its request")
        stray = self._answer_fds()
        if stray is not None:
            sockets_close(stray)
            raise self._crashed(op, args, "sent fds with an answer that carries none")
        if parsed.get("ok") is not True and parsed.get("error") == "InspectCrashedError":
            return parsed, []  # it ran out of memory, say: answered, but not to serve again
        self.broken = False
        return parsed, []

    def _answer_fds(self) -> list[int] | None:
        """The fds of the one message the worker queued before its answer line; None
        where it sent none (or the role has no channel)."""
        if self.channel is None:
            return None
        try:
            _, fds, flags, _ = sockets.recv_fds(
                self.channel, 64, _MAX_ANSWER_FDS, sockets.MSG_DONTWAIT
            )
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return None
        if flags & sockets.MSG_CTRUNC:
            sockets_close(fds)
            return None
        return list(fds)

    def kill(self) -> None:
        """SIGKILL the worker's process group (it started it as its session leader)."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        if self.channel is not None:
            self.channel.close()  # fds queued on it, unread, are released with it

    async def reap(self) -> None:
        """Wait for the killed worker to be reaped and its stderr drained."""
        try:
            await self.process.wait()
            await self._drain
        except Exception:  # the reap of one worker must not fail close()
            log.exception("%s worker %d: reaping failed", self.role.name, self.pid)

    async def _exit_status(self) -> str:
        try:
            async with asyncio.timeout(_EXIT_GRACE):
                code = await self.process.wait()
        except TimeoutError:
            self.kill()
            return "closed its output"
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            return f"was killed by {name}" + (
                " (out of memory?)" if -code in (signal.SIGKILL, signal.SIGABRT) else ""
            )
        return f"exited with status {code}"

    def _crashed(self, op: str, args: dict[str, Any], why: str) -> InspectCrashedError:
        self.kill()
        log.warning(
            "%s worker %s on a request",
            self.role.name,
            why,
            extra={"pid": self.pid, "op": op, "stderr": " | ".join(self.last_words)},
        )
        return InspectCrashedError(
            f"{self.role.verb} {op} {_describe(args)} failed: its worker {why}. The worker "
            f"was replaced and only this request failed; {self.role.crash_advice}"
        )


class _StderrLog:
    """Worker stderr into the daemon's log: cut, and rate-limited for the whole pool."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._window = 0.0
        self._logged = 0
        self._dropped = 0

    async def drain(self, stream: asyncio.StreamReader, worker: _Worker) -> None:
        """Read ``stream`` to its end, logging each line within the rate."""
        partial = b""
        try:
            while piece := await stream.read(64 << 10):
                lines = (partial + piece).split(b"\n")
                partial = lines.pop()[: STDERR_LINE_CHARS * 4]
                for line in lines:
                    self._line(worker, line)
            if partial:
                self._line(worker, partial)
        except Exception:  # a broken pipe ends the drain, never the daemon
            log.debug("%s worker %d: stderr ended", self._name, worker.pid, exc_info=True)

    def _line(self, worker: _Worker, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace").rstrip()[:STDERR_LINE_CHARS]
        if not text:
            return
        worker.last_words.append(text)
        now = time.monotonic()
        if now - self._window >= _STDERR_WINDOW:
            if self._dropped:
                log.warning("%d more %s worker stderr lines dropped", self._dropped, self._name)
            self._window, self._logged, self._dropped = now, 0, 0
        if self._logged >= STDERR_LINES:
            self._dropped += 1
            return
        self._logged += 1
        log.info("%s worker stderr: %s", self._name, text, extra={"pid": worker.pid})


def _parse(line: bytes) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None


def _describe(args: dict[str, Any]) -> str:
    """The request's arguments for a message, each cut short."""
    shown = ", ".join(f"{k}={str(v)[:200]!r}" for k, v in list(args.items())[:6])
    return f"({shown})"


def _article(name: str) -> str:
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def sockets_close(fds: list[int]) -> None:
    """Close each fd of ``fds`` (an answer's, unwanted or not taken)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
