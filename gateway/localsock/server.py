"""The local socket's server: the transport, and dispatch by the op table.

Binds the socket (permissions, group), accepts connections, reads each client's
peer credentials, frames requests and answers (:mod:`chunkd.client.protocol`), checks
each request against its op in :data:`~chunkd.client.protocol.OPS`, and hands it to
that op's handler: a lookup in :data:`HANDLERS`, built and checked when this module
is imported (:func:`~chunkd.gateway.localsock.family.handler_table`). A connection
starts with ``hello``; nothing else is answered before it.

The daemon is protected from every client:

* a malformed frame is answered with ``ProtocolError`` where the stream is still
  in step, and otherwise closes that connection only (which is which:
  :mod:`chunkd.client.protocol`);
* each connection is served by a task of its own, and a client that stops reading
  stalls only itself: a send that cannot progress for ``send_timeout`` seconds
  closes its connection;
* a client that dies mid-request leaks nothing: leases are released whether or not
  the answer was sent, and the fds in a message the kernel could not deliver are
  closed with it;
* a client holds at most **one answer with fds** it has not read, per connection
  (the bound is written down in :mod:`chunkd.client.protocol`, "What a client can
  make the node hold"). The fds of an answer sent keep their chunks' pages alive
  while they wait in the client's socket, evicted or not, and the kernel gives a
  sender no way to take them back: so after an answer with fds, the daemon handles
  the connection's next request only once the client has read everything sent to it
  (``SIOCOUTQ`` is 0, which a client that waits for each answer always has done). A
  client that sent the request first is waited for at most ``send_timeout``, woken
  by the kernel when it reads (an edge-triggered epoll on the socket's writability,
  which fires as the client takes each message), then served no more: the daemon
  shuts the connection down, and the connection keeps its place among the
  ``max_clients`` until the client has read that answer or closed its socket, so
  the unread fds of every client together stay within ``max_clients`` answers;
* peer credentials (SO_PEERCRED) are logged and counted per uid.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import select
import socket
import stat as statmod
import struct
import termios
from collections.abc import Awaitable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

from chunkd.client.protocol import (
    MAX_FDS,
    MAX_ID_BYTES,
    OPS,
    VERSION,
    RawFrame,
    check_job_name,
    decode_header,
    encode_frame,
    error_answer,
    recv_raw_async,
    send_frame_async,
)
from chunkd.errors import ChunkdError, InvalidRequestError, ProtocolError
from chunkd.gateway.authority import Caller, group_id, peer_groups
from chunkd.gateway.costs.attribution import ATTRIBUTION, Attribution, account_name
from chunkd.gateway.localsock import checkpoint_ops, dataset_ops, job_ops, prefetch_ops, read_ops
from chunkd.gateway.localsock.answer import Answer
from chunkd.gateway.localsock.family import Handler, Parts, handler_table
from chunkd.memfd import close_all

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge

    from chunkd.gateway.checkpoints import Checkpoints
    from chunkd.gateway.costs.ledger import Ledger
    from chunkd.gateway.datasets import Datasets
    from chunkd.gateway.decoding import DecodeService
    from chunkd.gateway.jobs.table import JobTable
    from chunkd.gateway.listing import Listings
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.prefetch import Prefetcher
    from chunkd.gateway.readpath import ReadPath

__all__ = ["HANDLERS", "LocalServer"]

log = logging.getLogger("chunkd.gateway.local")

T = TypeVar("T")

#: the handler of each op, by name: built (and checked) when this module is imported
HANDLERS: Final[Mapping[str, Handler]] = handler_table(
    prefetch_ops.FAMILY, read_ops.FAMILY, checkpoint_ops.FAMILY, dataset_ops.FAMILY, job_ops.FAMILY
)

_CREDS: Final = struct.Struct("3i")  # pid, uid, gid
_INT: Final = struct.Struct("i")  # what SIOCOUTQ answers


class _Connection:
    """What the server knows of one client connection."""

    def __init__(self, peer: dict[str, int], caller: Caller) -> None:
        self.peer = peer
        self.caller = caller
        self.greeted = False
        #: the job its ``hello`` named (``train_job``), None: no job
        self.job: str | None = None
        #: an answer that carried fds went out, and the client may not have read it
        self.fds_unread = False


class LocalServer:
    """Serves the local protocol on a Unix socket.

    Args:
        path: the socket's path (its directory must exist).
        read_path: the daemon's read path.
        metrics: the daemon's metrics.
        checkpoints: the daemon's checkpoint store (the ``ckpt_*`` ops).
        listings: the listing pages (the ``list`` op).
        prefetcher: where ``prefetch`` names go.
        datasets: the daemon's dataset registry (the ``ds_*`` ops).
        decoder: the daemon's decode service (``ds_decode``; None: answered "off").
        dataset_registry: ``[datasets] registry`` (``BACKEND/PREFIX``), which
            ``ds_resolve`` names (by default, ``datasets``' own).
        mode: the socket's permissions (0660 by default).
        group: the group that owns the socket, or None.
        send_timeout: seconds a send may make no progress, and a client may leave an
            answer with fds unread while it sends its next request, before it is
            dropped.
        max_clients: connections served at once; more wait in the listen backlog. A
            dropped connection whose answer with fds is unread still counts.
        jobs: the jobs this node serves (``loader_report``; None: none are kept).
        ledger: where the cost of each request's work goes (its
            :class:`~chunkd.gateway.costs.Attribution`: the connection's ``train_job``,
            the caller's uid and the request's dataset or checkpoint name).
    """

    def __init__(
        self,
        path: Path,
        read_path: ReadPath,
        metrics: Metrics,
        checkpoints: Checkpoints | None = None,
        *,
        listings: Listings,
        prefetcher: Prefetcher,
        datasets: Datasets | None = None,
        decoder: DecodeService | None = None,
        dataset_registry: str | None = None,
        mode: int = 0o660,
        group: str | None = None,
        send_timeout: float = 30.0,
        max_clients: int = 1024,
        jobs: JobTable | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        self.path = Path(path)
        self.ledger = ledger
        self._parts = Parts(
            read_path=read_path,
            listings=listings,
            prefetcher=prefetcher,
            metrics=metrics,
            checkpoints=checkpoints,
            datasets=datasets,
            decoder=decoder,
            dataset_registry=(
                datasets.registry_name
                if dataset_registry is None and datasets is not None
                else dataset_registry
            ),
            jobs=jobs,
        )
        self.mode = mode
        self.group = group
        self.send_timeout = send_timeout
        self._slots = asyncio.Semaphore(max_clients)
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._clients: set[asyncio.Task[None]] = set()
        self._requests: Counter = metrics.local_requests
        self._connected: Gauge = metrics.local_clients
        self._malformed: Counter = metrics.local_malformed
        self._stuck: Counter = metrics.local_stuck

    async def start(self) -> None:
        """Bind the socket (replacing a stale one) and start accepting."""
        self._clear_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))
            os.chmod(self.path, self.mode)  # the unit's UMask would leave it 0750
            if self.group is not None:
                self._give_to_group(self.group)
            sock.listen(1024)
            sock.setblocking(False)
        except ChunkdError:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            raise ChunkdError(
                f"cannot serve the local socket {self.path}: {exc.strerror or exc}; set "
                "server.socket (or CHUNKD_SERVER_SOCKET) to a path in a directory chunkd "
                "can write"
            ) from exc
        self._sock = sock
        self._accepting = asyncio.create_task(self._accept())
        log.info("local socket ready", extra={"socket": str(self.path)})

    def _clear_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not statmod.S_ISSOCK(st.st_mode):
            raise ChunkdError(
                f"{self.path} exists and is not a socket; remove it or move server.socket"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self.path))
        except OSError:
            os.unlink(self.path)  # nobody answers: left by a daemon that died
            return
        finally:
            probe.close()
        raise ChunkdError(f"another chunkd already serves {self.path}; stop it first")

    def _give_to_group(self, group: str) -> None:
        """Give the bound socket to ``group``: a name, or a numeric GID (a container's)."""
        gid = group_id(group, "server.socket_group")
        try:
            os.chown(self.path, -1, gid)
        except OSError as exc:
            raise ChunkdError(
                f"cannot give the local socket {self.path} to group {group!r} (GID {gid}): "
                f"{exc.strerror or exc}; the daemon's user must be a member of that group "
                "(SupplementaryGroups= under systemd, runAsGroup or supplementalGroups in a pod)"
            ) from exc

    async def close(self) -> None:
        """Stop accepting, drop every client, and remove the socket."""
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        for task in self._clients:
            task.cancel()
        await asyncio.gather(*self._clients, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    # -- connections -------------------------------------------------------------------

    async def _accept(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._slots.acquire()
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:
                self._slots.release()
                log.warning("local socket: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            except BaseException:
                self._slots.release()
                raise
            conn.setblocking(False)
            task = asyncio.create_task(self._serve(conn))
            self._clients.add(task)
            task.add_done_callback(self._clients.discard)

    async def _serve(self, conn: socket.socket) -> None:
        pid, uid, gid = _CREDS.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
        )
        caller = Caller(uid=uid, gid=gid, pid=pid, groups=peer_groups(conn))
        client = _Connection({"pid": pid, "uid": uid, "gid": gid}, caller)
        log.info("local client connected", extra=client.peer)
        self._connected.inc()
        try:
            await self._requests_of(conn, client)
            if client.fds_unread:  # not when cancelled: the daemon is stopping
                await self._hold_until_read(conn, client)
        finally:
            self._connected.dec()
            conn.close()
            self._slots.release()

    async def _requests_of(self, conn: socket.socket, client: _Connection) -> None:
        """Answer a connection's requests until it ends; why it ended is logged."""
        try:
            while True:
                raw = await recv_raw_async(conn)
                if raw is None:
                    return
                header, request_id = self._request_of(raw)
                op = str(header.get("op")) if isinstance(header, dict) else "malformed"
                self._requests.labels(str(client.peer["uid"]), op if op in OPS else "unknown").inc()
                await self._answer(conn, client, header, request_id, raw.fds)
        except ProtocolError as exc:  # the stream is lost: no answer can be framed
            self._malformed.inc()
            log.warning(
                "local client sent a malformed frame: %s; closing it", exc, extra=client.peer
            )
        except TimeoutError as exc:  # a stuck reader: it took no bytes, or left fds unread
            self._stuck.inc()
            log.warning("local client dropped: %s", exc, extra=client.peer)
        except ConnectionError as exc:
            log.info("local client went away: %s", exc, extra=client.peer)
        except Exception:
            # Never a task exception left unretrieved: a bug is logged, and only this
            # client's connection pays for it.
            log.exception("local client: the daemon failed; closing the connection")

    async def _hold_until_read(self, conn: socket.socket, client: _Connection) -> None:
        """Keep a connection that is served no more until its client has read what was
        sent to it, or closed its socket.

        Closing it would free its place among ``max_clients`` while the answer with
        fds waits in the client's socket all the same (its pages with it): a client
        could then pile up one answer per connection it opens. Shut down instead, the
        client reads what it has and then the end of the stream, and its sends fail.
        """
        if not _unread_bytes(conn):
            return  # read, or the client closed its end (which drops what it held)
        log.warning(
            "local client left an answer with fds unread; it is served no more, and its "
            "connection counts against socket_max_clients until it reads or closes it",
            extra=client.peer,
        )
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        await _until_read(conn, None)

    def _request_of(self, raw: RawFrame) -> tuple[dict[str, Any] | ChunkdError, object]:
        """The request a whole frame holds, or the error to answer it with; its id.

        A header that is not a JSON object chunkd takes (not JSON, nested too deep,
        NaN) is the request's own fault: ``InvalidRequestError``. A frame that breaks
        a framing rule while the stream stays in step is answered ``ProtocolError``.
        """
        try:
            header = decode_header(raw.header)
        except ProtocolError as exc:
            return InvalidRequestError(f"the request is not one chunkd takes: {exc}"), None
        request_id = header.get("id")
        if len(json.dumps(request_id)) > MAX_ID_BYTES:
            return InvalidRequestError(
                f"the request's id is over {MAX_ID_BYTES} bytes of JSON; use a short one "
                "(the answer echoes it)"
            ), None
        problem = None
        if raw.fds_cut:
            problem = f"more than {MAX_FDS} fds came with a request"
        elif raw.payload:
            problem = "requests carry no payload"
        if problem is not None:  # counted as malformed when it is answered
            return ProtocolError(problem, in_sync=True), request_id
        return header, request_id

    async def _answer(
        self,
        conn: socket.socket,
        client: _Connection,
        header: dict[str, Any] | ChunkdError,
        request_id: object,
        request_fds: list[int],
    ) -> None:
        answer = Answer(request_fds, client.caller)
        try:
            if client.fds_unread:
                # A client that waits for each answer has read it all before it asked
                # again: this costs it one ioctl. One that did not waits, or is dropped.
                try:
                    await _until_read(conn, self.send_timeout)
                except TimeoutError:
                    raise TimeoutError(
                        f"it sent a request and did not read, for {self.send_timeout:g}s, "
                        "the answer before it, which carried fds (a connection carries one "
                        "request at a time); it is served no more"
                    ) from None
                client.fds_unread = False
            try:
                response = await self._respond(conn, client, header, answer)
            except ChunkdError as exc:
                if isinstance(exc, ProtocolError):
                    self._malformed.inc()
                response = error_answer(exc)
            except ConnectionError:
                raise
            except Exception as exc:
                log.exception("local request %r failed", _op_of(header))
                response = error_answer(
                    ChunkdError(f"the daemon failed on this request ({exc!r}); its log says more")
                )
            response["id"] = request_id
            response.setdefault("fds", len(answer.fds))
            try:
                frame = encode_frame(response, answer.payload)
            except ProtocolError as exc:  # the daemon's own answer: a bug, not the client's
                log.exception("local request %r: its answer breaks the framing", _op_of(header))
                close_all(answer.owned)
                answer.owned, answer.fds = [], []
                response = error_answer(
                    ChunkdError(f"the daemon's answer to this request is too large ({exc})")
                ) | {"id": request_id, "fds": 0}
                try:
                    frame = encode_frame(response)
                except ProtocolError:  # the id itself is too long to echo twice
                    frame = encode_frame(response | {"id": None})
            client.fds_unread = bool(answer.fds)
            await send_frame_async(conn, frame, answer.fds, stall_limit=self.send_timeout)
        finally:
            for lease in answer.leases:
                lease.release()
            close_all(answer.owned)

    async def _respond(
        self,
        conn: socket.socket,
        client: _Connection,
        header: dict[str, Any] | ChunkdError,
        answer: Answer,
    ) -> dict[str, Any]:
        if isinstance(header, ChunkdError):
            raise header
        op = header.get("op")
        spec = OPS.get(op) if isinstance(op, str) else None  # a list or object is no op
        if spec is None:
            raise InvalidRequestError(f"unknown op {_op_of(header)!r}")
        low, high = spec.fds
        if not low <= len(answer.request_fds) <= high:
            takes = "no" if high == 0 else str(low) if low == high else f"{low} to {high}"
            raise ProtocolError(
                f"op {spec.name} takes {takes} fds; {len(answer.request_fds)} came",
                in_sync=True,
            )
        if spec.waits:
            return await self._unless_gone(conn, self._handle(client, spec.name, header, answer))
        return await self._handle(client, spec.name, header, answer)

    async def _unless_gone(self, conn: socket.socket, work: Awaitable[T]) -> T:
        """``await work``, stopped if the client closes its end meanwhile."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(work)
        gone: asyncio.Future[None] = loop.create_future()
        fd = conn.fileno()

        def check() -> None:
            try:
                data = conn.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if data:
                loop.remove_reader(fd)  # the client sent more: not gone; stop looking
            elif not gone.done():
                gone.set_result(None)

        loop.add_reader(fd, check)
        try:
            waits: set[asyncio.Future[Any]] = {task, gone}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        finally:
            loop.remove_reader(fd)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ConnectionError("the client went away while its request waited; it was stopped")
        return task.result()

    async def _handle(
        self, client: _Connection, op: str, header: dict[str, Any], answer: Answer
    ) -> dict[str, Any]:
        if op != "hello" and not client.greeted:
            raise InvalidRequestError(
                f'a connection starts with {{"op": "hello", "version": {VERSION}}}; '
                f"this one sent {_op_of(header)!r} first"
            )
        args = OPS[op].check(header)
        if op == "hello" and args["train_job"] is not None:
            check_job_name(args["train_job"])
        token = ATTRIBUTION.set(
            Attribution(
                job=args["train_job"] if op == "hello" else client.job,
                uid=client.caller.uid,
                name=account_name(op, args),
                ledger=self.ledger,
            )
        )
        try:
            response = await HANDLERS[op](self._parts, args, answer)
        finally:
            ATTRIBUTION.reset(token)
        if op == "hello":
            client.greeted = True
            client.job = args["train_job"]
        return response


def _unread_bytes(conn: socket.socket) -> int:
    """Bytes sent on ``conn`` that its peer has not read yet (``SIOCOUTQ``).

    On a Unix stream socket a message stays charged to its sender until the receiver
    has read all of it, so 0 means the peer took every frame, and the fds on them.
    """
    got = fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, bytes(_INT.size))
    return int(_INT.unpack(got)[0])


async def _until_read(conn: socket.socket, limit: float | None) -> None:
    """Return once the peer has read everything sent on ``conn``, or closed its end;
    :class:`TimeoutError` after ``limit`` seconds (None: no limit).

    Woken by the kernel, not by polling: a Unix socket signals "writable" to an
    edge-triggered epoll each time its peer takes a message off its queue (the last one
    included), and when the peer closes.
    """
    if not _unread_bytes(conn):
        return
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()
    with select.epoll(1) as watch:
        watch.register(conn.fileno(), select.EPOLLOUT | select.EPOLLET)
        loop.add_reader(watch.fileno(), woken.set)
        try:
            async with asyncio.timeout(limit):
                while True:
                    woken.clear()
                    watch.poll(0)  # the edges seen so far: the next wait is for a new one
                    if not _unread_bytes(conn):
                        return
                    await woken.wait()
        finally:
            loop.remove_reader(watch.fileno())


def _op_of(header: object) -> str:
    op = header.get("op") if isinstance(header, dict) else None
    return op[:40] if isinstance(op, str) else repr(op)[:40]
