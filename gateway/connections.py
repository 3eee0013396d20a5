"""Connections to the HTTP port and the S3 front: who gets one, and how long it may take.

Both ports are aiohttp servers in one process, open to whoever can reach them, and a
connection costs a file descriptor and memory before any byte of it is authenticated.
Every connection is bounded here, before a route runs (``docs/security.md``,
"Connections and slow clients", says the same for operators):

**Admission**, when a connection is accepted, by its address alone (nothing else is
known yet): two budgets, *peers* and *anonymous*, both ports together, each lowered to a
quarter of the fd limit; at a cap, the connection that has waited longest for a request
head is closed to make room, or else the new one. The rules and their bookkeeping are
:mod:`chunkd.gateway.admission` (whose names this module re-exports); the handler here
takes a ticket at accept and tells it when its connection waits for a head, serves a
request, or closes.

**Time**: a TLS handshake and a new connection's first request head within
``server.header_timeout`` each; a later head within ``header_timeout`` of its first
byte; ``server.idle_timeout`` between requests (aiohttp's keep-alive); a request body
within ``server.body_timeout`` of its head; an answer the client takes no bytes of
for ``idle_timeout`` is cut off (the client is idle too); a body no route read is read
and dropped for :data:`LINGER` seconds after the answer, then the connection is closed.

aiohttp has no public hook for some of this (the parser's queue, its refusals, the
keep-alive timer), so :class:`GuardedHandler` leans on its ``RequestHandler``'s
internals; ``tests/test_slow_clients.py`` checks every bound against a real daemon,
and so an aiohttp that changes them.

**Size**: a request line of :attr:`HeadLimits.line` bytes, a header line (name and
value) of :attr:`HeadLimits.field`, :attr:`HeadLimits.headers` headers, and a whole
head of :attr:`HeadLimits.head` bytes, counted as the bytes arrive: the parser never
holds more than one head's bytes of a request it has not finished, so what an
unfinished request costs is bounded before its parsing ends. A connection refused
for its head is answered (431 here, the S3 front's XML there) and closed. Pipelined
requests wait parsed at most :data:`PIPELINED` at a time; reading pauses past that.
No body is decompressed (``auto_decompress=False``): no route wants a decoded body.

Metrics: ``chunkd_connections{port,budget}`` (open now),
``chunkd_connections_refused_total{port,budget,cap}`` (closed at once at a cap, none
to make room with) and ``chunkd_connections_cut_total{port,reason}`` (closed at a
bound: ``evicted`` to make room, ``header_timeout``, ``body_timeout``,
``send_stalled``, ``head_too_large``); a refused head is also a malformed request
(``chunkd_http_malformed_requests_total``).
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import contextlib
import functools
import ipaddress
import json
import ssl
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import RequestHandler, _ErrInfo

# Admission is a room of its own; its names are re-exported here, where they were.
from chunkd.gateway.admission import (
    PEER_CONNECTIONS_PER_ADDRESS,
    ConnectionGuard,
    ConnectionLimits,
    Ticket,
)

__all__ = [
    "ACCEPT_BACKLOG",
    "HTTP_HEAD",
    "LINGER",
    "PEER_CONNECTIONS_PER_ADDRESS",
    "PIPELINED",
    "ConnectionGuard",
    "ConnectionLimits",
    "GuardedHandler",
    "GuardedRunner",
    "HeadLimits",
    "HeadTooLarge",
    "Ticket",
]

#: seconds a body no route read is read and dropped after the answer (so that a client
#: that sent it whole still reads the answer, not a reset), before the connection closes
LINGER: Final = 1.0
#: requests parsed ahead while one is served; reading pauses past them
PIPELINED: Final = 2
#: connections the kernel queues for accepting (capped by net.core.somaxconn): a burst
#: of a crowd's connects past it drops SYNs, and a client's next try waits a second
ACCEPT_BACKLOG: Final = 1024


@dataclass(frozen=True, slots=True)
class HeadLimits:
    """What a request head may hold; the parser refuses more before it has finished."""

    #: bytes of the request line (method, target, version)
    line: int = 8190
    #: bytes of one header line, name and value
    field: int = 8190
    #: headers in one request
    headers: int = 128
    #: bytes of all header lines together
    section: int = 16384

    @property
    def head(self) -> int:
        """Bytes of a whole head, line and headers with their line ends, counted as
        they arrive."""
        return self.line + self.section + 4


#: the HTTP port's heads: browsers' cookies for a host are shared by its ports
HTTP_HEAD: Final = HeadLimits()


class HeadTooLarge(BadHttpMessage):
    """A request head past :attr:`HeadLimits.head` bytes (refused unparsed)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"Request head longer than {limit} bytes")
        self.limit = limit


def head_too_large(exc: BaseException | None) -> bool:
    """Whether a parse error is one of a head's size: a line or the whole head too long."""
    if isinstance(exc, LineTooLong | HeadTooLarge):
        return True
    return isinstance(exc, BadHttpMessage) and "too many headers" in str(exc).lower()


def client_ip(transport: asyncio.BaseTransport) -> str:
    """The client's IP address of a TCP transport (an IPv4-mapped IPv6 one as IPv4);
    ``""`` when there is none."""
    peer = transport.get_extra_info("peername")
    if not isinstance(peer, tuple) or not peer:
        return ""
    try:
        ip = ipaddress.ip_address(str(peer[0]).split("%")[0])
    except ValueError:
        return ""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


class GuardedHandler(RequestHandler):
    """aiohttp's connection handler under the bounds of the module docstring.

    Made by the server of a :class:`GuardedRunner`; with TLS, wrapped in the loop's
    own TLS protocol (:func:`_tls_protocol`), which admits the connection when it is
    accepted, before its handshake, so that one that never finishes a handshake counts
    against the caps and the header timeout like any other.
    """

    __slots__ = (
        "_body_timer",
        "_guard",
        "_head",
        "_head_seen",
        "_head_timer",
        "_opened",
        "_port",
        "_raw",
        "_refused",
        "_request_payload",
        "_stall_timer",
        "_ticket",
    )

    def __init__(
        self,
        manager: web.Server,
        *,
        guard: ConnectionGuard,
        port: str,
        head: HeadLimits,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._max_msg_queue_size = PIPELINED
        self._msg_queue_resume_size = PIPELINED - 1
        self._guard = guard
        self._port = port
        self._head = head
        self._ticket: Ticket | None = None
        self._raw: asyncio.BaseTransport | None = None
        self._opened = False
        self._refused = False
        self._head_seen = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._request_payload: StreamReader | None = None

    # -- admission and TLS ------------------------------------------------------------

    def admit(self, transport: asyncio.BaseTransport) -> bool:
        """Admit the connection of ``transport`` (its ticket), as soon as it is
        accepted; False: it is to be closed at once."""
        ticket = self._guard.admit(client_ip(transport), self._port)
        if ticket is None:
            return False
        self._ticket = ticket
        self._raw = transport
        ticket.closer = self._evicted
        return True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # With TLS, the connection was admitted when accepted (see _Admitting), and
        # this is its encrypted transport, after the handshake.
        if self._ticket is None and not self.admit(transport):
            transport.abort()  # type: ignore[attr-defined]
            return
        self._opened = True
        super().connection_made(transport)
        self._head_timer = self._loop.call_later(
            self._guard.limits.header_timeout, self._expired, "header_timeout"
        )

    def _evicted(self) -> None:
        transport = self.transport
        if self._opened:
            self.force_close()  # nothing of an answer is pending: a plain close
        if self._raw is not None and self._raw is not transport:
            # TLS: in its handshake, or not to wait for the client's close_notify
            self._raw.abort()  # type: ignore[attr-defined]

    def connection_lost(self, exc: BaseException | None) -> None:
        self._closed()
        if self._opened:
            super().connection_lost(exc)

    def handshake_lost(self) -> None:
        """The TLS protocol's connection ended (its handshake failed or timed out, or
        after this handler's own end): its place is free."""
        self._closed()

    def _closed(self) -> None:
        for timer in (self._head_timer, self._body_timer, self._stall_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._stall_timer = None
        if self._ticket is not None:
            self._ticket.release()

    # -- the head, counted as it arrives ----------------------------------------------

    def _awaiting_head(self) -> bool:
        payload = self._request_payload
        return (
            (payload is None or payload.is_eof())
            and not self._upgraded
            and self._payload_parser is None
        )

    def data_received(self, data: bytes) -> None:
        if self._refused or not self._opened:
            return
        if not self._awaiting_head():  # a body's bytes (and maybe the next head's)
            count = self._request_count
            payload = self._request_payload
            before = payload.total_bytes if payload is not None else 0
            super().data_received(data)
            if self._request_count != count:
                self._got_message()
            elif self._awaiting_head():
                # Only what followed the body's last byte can be the next head's
                # (bodies are never decoded here, so the payload counts wire bytes).
                body = payload.total_bytes - before if payload is not None else 0
                self._head_seen = max(len(data) - body, 0)
            return
        if not data:
            return
        if self._head_seen == 0 and not self._request_in_progress:
            self._first_head_byte()
        room = self._head.head - self._head_seen
        part = data if len(data) <= room else data[: room + 1]
        count = self._request_count
        super().data_received(part)
        if self._request_count != count:  # a head came whole (or a parse error)
            self._got_message()
            if len(part) < len(data):
                self.data_received(data[len(part) :])
            return
        self._head_seen += len(part)
        if self._head_seen > self._head.head:
            self._refuse_head()

    def _first_head_byte(self) -> None:
        """The first byte of a kept-alive connection's next head: the header timeout
        runs from it, and the idle timeout no more."""
        if self._head_timer is None:
            self._head_timer = self._loop.call_later(
                self._guard.limits.header_timeout, self._expired, "header_timeout"
            )
        if self._keepalive_handle is not None:
            self._keepalive_handle.cancel()
            self._keepalive_handle = None

    def _got_message(self) -> None:
        if self._messages and isinstance(self._messages[-1][0], _ErrInfo):
            self._refused = True  # the parser refused it: what follows is not read
        self._head_seen = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._ticket is not None:
            self._ticket.serving()
        payload = self._messages[-1][1] if self._messages else EMPTY_PAYLOAD
        self._request_payload = payload
        if not payload.is_eof():
            timer = self._loop.call_later(
                self._guard.limits.body_timeout, self._expired, "body_timeout"
            )
            self._body_timer = timer
            payload.on_eof(timer.cancel)

    def _refuse_head(self) -> None:
        """Answer a head past :attr:`HeadLimits.head` bytes as the parser's own
        refusals are answered (:meth:`handle_error`), then close; later bytes are
        dropped unparsed."""
        self._refused = True
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._guard.cut.labels(self._port, "head_too_large").inc()
        exc = HeadTooLarge(self._head.head)
        self._messages.append((_ErrInfo(status=400, exc=exc, message=exc.message), EMPTY_PAYLOAD))
        self._request_count += 1
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A head too large is 431, with the JSON error body of the HTTP routes."""
        if status != 400 or not head_too_large(exc):
            return super().handle_error(request, status, exc, message)
        self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        text = (
            f"the request head is over its bounds (a line of {self._head.line} bytes, "
            f"{self._head.headers} headers, {self._head.head} bytes in all)"
        )
        body = {"error": "RequestHeaderFieldsTooLarge", "message": text, "status": 431}
        response = web.Response(status=431, text=json.dumps(body), content_type="application/json")
        response.force_close()
        return response

    # -- answers and timers -----------------------------------------------------------

    async def finish_response(
        self, request: Any, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            if self._ticket is not None and not self._messages:
                self._ticket.waiting()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self._loop.call_later(
                self._guard.limits.idle_timeout, self._expired, "send_stalled"
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _expired(self, reason: str) -> None:
        if reason == "header_timeout":
            self._head_timer = None
            if self._request_in_progress or not self._awaiting_head():
                return  # a request came meanwhile (pipelined behind one in progress)
        elif reason == "body_timeout":
            self._body_timer = None
            if self._request_payload is None or self._request_payload.is_eof():
                return
        else:
            self._stall_timer = None
        self._guard.cut.labels(self._port, reason).inc()
        transport = self.transport
        self.force_close()
        if transport is not None:
            transport.abort()  # what is left to send is for a client that is gone


class _Admitting:
    """Mixed into the event loop's TLS protocol: the connection is admitted (or closed
    at once) when it is accepted, before its handshake, which must end within the
    header timeout; then the TLS protocol makes the handler's connection."""

    _handler: GuardedHandler
    _admitted: bool

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._admitted = self._handler.admit(transport)
        if not self._admitted:
            transport.abort()  # type: ignore[attr-defined]
            return
        super().connection_made(transport)  # type: ignore[misc]

    def connection_lost(self, exc: BaseException | None) -> None:
        self._handler.handshake_lost()
        if self._admitted:
            super().connection_lost(exc)  # type: ignore[misc]


class _AsyncioTLS(_Admitting, asyncio.sslproto.SSLProtocol):
    pass


def _tls_protocol(
    loop: asyncio.AbstractEventLoop,
    handler: GuardedHandler,
    context: ssl.SSLContext,
    timeout: float,
) -> asyncio.BaseProtocol:
    """``handler`` behind the TLS protocol ``loop`` itself uses for a TLS server (one
    of uvloop's, under uvloop), admitting at accept (:class:`_Admitting`)."""
    kind: type[Any] = _AsyncioTLS
    with contextlib.suppress(ImportError):
        import uvloop.loop

        if isinstance(loop, uvloop.Loop):
            kind = _uvloop_tls()
    protocol = kind(loop, handler, context, None, server_side=True, ssl_handshake_timeout=timeout)
    protocol._handler = handler
    protocol._admitted = False
    return protocol  # type: ignore[no-any-return]


@functools.cache
def _uvloop_tls() -> type[Any]:
    import uvloop.loop

    base: type[Any] = uvloop.loop.SSLProtocol  # type: ignore[attr-defined]  # not in its stubs
    return type("_UvloopTLS", (_Admitting, base), {})


class _GuardedServer(web.Server):
    """aiohttp's server, making :class:`GuardedHandler` (or a subclass) connections,
    behind TLS when ``tls`` is set."""

    handler_class: type[GuardedHandler]
    handler_args: dict[str, Any]
    tls: ssl.SSLContext | None

    def __call__(self) -> Any:
        handler = self.handler_class(self, loop=self._loop, **self._kwargs, **self.handler_args)
        if self.tls is None:
            return handler
        return _tls_protocol(self._loop, handler, self.tls, handler._guard.limits.header_timeout)


class GuardedRunner(web.AppRunner):
    """aiohttp's runner for one port, its connections made by :attr:`handler_class`
    under ``guard`` (see the module docstring). Serve it with a plain
    :class:`aiohttp.web.TCPSite`: with ``tls``, the handler makes the handshake.

    Args:
        app: the port's application.
        guard: the daemon's :class:`ConnectionGuard`.
        port: the port's name in the metrics (``http``, ``s3``).
        head: the bounds of a request head.
        tls: the server's TLS context; None: plain HTTP.
        kwargs: more of :class:`aiohttp.web.AppRunner`'s (``shutdown_timeout``,
            ``access_log``, ``logger``).
    """

    handler_class: ClassVar[type[GuardedHandler]] = GuardedHandler

    def __init__(
        self,
        app: web.Application,
        *,
        guard: ConnectionGuard,
        port: str,
        head: HeadLimits = HTTP_HEAD,
        tls: ssl.SSLContext | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            app,
            keepalive_timeout=guard.limits.idle_timeout,
            lingering_time=LINGER,
            auto_decompress=False,
            max_line_size=head.line,
            max_field_size=head.field,
            max_headers=head.headers,
            **kwargs,
        )
        self._tls = tls
        self._handler_args = {"guard": guard, "port": port, "head": head}

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _GuardedServer
        assert isinstance(server, _GuardedServer)
        server.handler_class = self.handler_class
        server.handler_args = self._handler_args
        server.tls = self._tls
        return server
