"""Admission of connections to the HTTP port and the S3 front: who gets one.

A connection is admitted when it is accepted, by its address alone (nothing else is
known yet), into one of two budgets, both ports together (``docs/security.md``,
"Connections and slow clients"):

- *peers*: connections from the address of a ``[peers]`` member
  (:meth:`chunkd.gateway.peers.Peers.trusts`), ``server.peer_connections`` in all and
  :data:`PEER_CONNECTIONS_PER_ADDRESS` from one address. Trust for the budget only:
  every peer route still wants the token (and, with TLS, the certificate).
- *anonymous*: every other address, ``server.max_connections`` in all and
  ``server.max_connections_per_address`` from one address (loopback has no cap of its
  own: every local process shares it).

Each budget is lowered to a quarter of the fd limit (:meth:`ConnectionLimits.of`), so a
crowd never takes the fds the local socket, the cache's memfds, the backends and the
peers need. At a cap, the connection of that budget (of that address, at the
per-address cap) that has waited longest for a request head (just connected, trickling
a head, or kept alive between requests) is closed to make room; when none waits (every
one has a request in progress), the new connection is closed at once. A crowd of
connections that never finish their heads is so always the first to go, and a fresh
request gets in.

This is the policy, bookkeeping only: a :class:`Ticket` per connection, and the
:class:`ConnectionGuard` that counts them and holds the metrics of every bound. The
aiohttp handler that enforces the bounds on a connection (time, head size) and asks
the guard for tickets is :mod:`chunkd.gateway.connections`, which re-exports these
names.
"""

from __future__ import annotations

import logging
import resource
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from prometheus_client import Counter as CounterMetric
from prometheus_client import Gauge

from chunkd.gateway.config.addresses import is_loopback

if TYPE_CHECKING:
    from chunkd.gateway.config import ServerConfig
    from chunkd.gateway.metrics import Metrics

__all__ = ["PEER_CONNECTIONS_PER_ADDRESS", "ConnectionGuard", "ConnectionLimits", "Ticket"]

# The logger's name is the one these bounds had in connections.py (its warning about the
# fd limit is looked for there).
log = logging.getLogger("chunkd.gateway.connections")

#: connections from one member's address: a peer's HTTP client opens at most 100
#: (aiohttp's connector limit), so this never binds a healthy peer
PEER_CONNECTIONS_PER_ADDRESS: Final = 256
#: the least a budget is lowered to, however low the fd limit
_FLOOR: Final = 16


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The bounds of :mod:`chunkd.gateway.connections`, from ``[server]``."""

    header_timeout: float = 10.0
    idle_timeout: float = 60.0
    body_timeout: float = 60.0
    max_connections: int = 1024
    max_per_address: int = 128
    peer_connections: int = 1024

    @classmethod
    def of(cls, server: ServerConfig, *, fd_limit: int | None = None) -> ConnectionLimits:
        """The limits ``server`` sets, each budget lowered to a quarter of ``fd_limit``
        (the process's soft ``RLIMIT_NOFILE`` when None), with a warning if it is."""
        fds = _fd_limit() if fd_limit is None else fd_limit
        quarter = max(_FLOOR, fds // 4)
        anonymous = min(server.max_connections, quarter)
        peers = min(server.peer_connections, quarter)
        if (anonymous, peers) != (server.max_connections, server.peer_connections):
            log.warning(
                "the fd limit (%d) lowers server.max_connections to %d and "
                "server.peer_connections to %d (a quarter of it each); raise LimitNOFILE "
                "(ulimit -n) to serve more",
                fds,
                anonymous,
                peers,
            )
        return cls(
            header_timeout=server.header_timeout,
            idle_timeout=server.idle_timeout,
            body_timeout=server.body_timeout,
            max_connections=anonymous,
            max_per_address=min(server.max_connections_per_address, anonymous),
            peer_connections=peers,
        )


def _fd_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 30 if soft == resource.RLIM_INFINITY else soft


class Ticket:
    """One admitted connection, from accept to close: its budget and whether it waits
    for a request head (and so may be closed to make room)."""

    __slots__ = ("_guard", "address", "budget", "capped", "closer", "port", "released")

    def __init__(self, guard: ConnectionGuard, budget: _Budget, address: str, port: str) -> None:
        self._guard = guard
        self.budget = budget
        self.address = address
        self.port = port
        #: whether the per-address cap applies (not to loopback's anonymous crowd)
        self.capped = budget.name == "peer" or not is_loopback(address)
        #: closes the connection to make room; set by its handler
        self.closer: Callable[[], None] = _nothing
        self.released = False

    def waiting(self) -> None:
        """The connection waits for a request head: it may be closed to make room.
        The one waiting longest goes first."""
        if not self.released:
            self.budget.unwait(self)
            self.budget.wait(self)

    def serving(self) -> None:
        """A request is in progress: the connection is not closed to make room."""
        if not self.released:
            self.budget.unwait(self)

    def release(self) -> None:
        """The connection is closed: its place is free (once; later calls do nothing)."""
        if not self.released:
            self.released = True
            self._guard.released(self)


def _nothing() -> None:
    pass


class _Budget:
    """Open connections of one budget: counts, and those waiting, oldest first."""

    __slots__ = ("by_address", "name", "open", "per_address", "total", "waiting", "waiting_at")

    def __init__(self, name: str, total: int, per_address: int) -> None:
        self.name = name
        self.total = total
        self.per_address = per_address
        self.open = 0
        self.by_address: Counter[str] = Counter()
        # dicts keep insertion order: the first waited longest
        self.waiting: dict[Ticket, None] = {}
        self.waiting_at: dict[str, dict[Ticket, None]] = {}

    def wait(self, ticket: Ticket) -> None:
        self.waiting[ticket] = None
        self.waiting_at.setdefault(ticket.address, {})[ticket] = None

    def unwait(self, ticket: Ticket) -> None:
        if self.waiting.pop(ticket, False) is None:
            at = self.waiting_at[ticket.address]
            del at[ticket]
            if not at:
                del self.waiting_at[ticket.address]

    def longest_waiting(self, address: str | None = None) -> Ticket | None:
        pool = self.waiting if address is None else self.waiting_at.get(address, {})
        return next(iter(pool), None)


class ConnectionGuard:
    """The admission of every connection to both ports, and the metrics of all the
    bounds (see the module docstring). One per daemon.

    Args:
        limits: the bounds.
        metrics: the daemon's metrics (the connection metrics join its registry).
        trusted: whether an IP address is a peer's (:meth:`Peers.trusts`).
    """

    def __init__(
        self, limits: ConnectionLimits, metrics: Metrics, trusted: Callable[[str], bool]
    ) -> None:
        self.limits = limits
        self._trusted = trusted
        self._peers = _Budget("peer", limits.peer_connections, PEER_CONNECTIONS_PER_ADDRESS)
        self._anonymous = _Budget("anonymous", limits.max_connections, limits.max_per_address)
        registry = metrics.registry
        self.open = Gauge(
            "chunkd_connections",
            "Connections open to the HTTP port and the S3 front, by budget (peer: from a "
            "[peers] member's address)",
            ["port", "budget"],
            registry=registry,
        )
        self.refused = CounterMetric(
            "chunkd_connections_refused",
            "Connections closed as soon as accepted: a cap (total, or address) was reached "
            "and every connection of it had a request in progress",
            ["port", "budget", "cap"],
            registry=registry,
        )
        self.cut = CounterMetric(
            "chunkd_connections_cut",
            "Connections the daemon closed at a bound: evicted (the one waiting longest for "
            "a request, to make room at a cap), header_timeout, body_timeout, send_stalled, "
            "head_too_large",
            ["port", "reason"],
            registry=registry,
        )
        for port in ("http", "s3"):
            for budget in ("peer", "anonymous"):
                self.open.labels(port, budget)
                for cap in ("total", "address"):
                    self.refused.labels(port, budget, cap)
            for reason in (
                "evicted",
                "header_timeout",
                "body_timeout",
                "send_stalled",
                "head_too_large",
            ):
                self.cut.labels(port, reason)

    def admit(self, address: str, port: str) -> Ticket | None:
        """A ticket for a connection from ``address`` accepted on ``port`` (``http``,
        ``s3``), waiting for its first head; None: close it at once (counted)."""
        budget = self._peers if address and self._trusted(address) else self._anonymous
        ticket = Ticket(self, budget, address, port)
        full = ticket.capped and budget.by_address[address] >= budget.per_address
        if full and not self._make_room(budget, address):
            self.refused.labels(port, budget.name, "address").inc()
            return None
        if budget.open >= budget.total and not self._make_room(budget, None):
            self.refused.labels(port, budget.name, "total").inc()
            return None
        budget.open += 1
        budget.by_address[address] += 1
        budget.wait(ticket)
        self.open.labels(port, budget.name).inc()
        return ticket

    def _make_room(self, budget: _Budget, address: str | None) -> bool:
        """Close the connection of ``budget`` (from ``address``) that has waited
        longest for a request head; False when none waits."""
        victim = budget.longest_waiting(address)
        if victim is None:
            return False
        self.cut.labels(victim.port, "evicted").inc()
        victim.release()  # its place is free now; its fd within a turn of the loop
        victim.closer()
        return True

    def released(self, ticket: Ticket) -> None:
        """Free ``ticket``'s place (called by :meth:`Ticket.release`)."""
        budget = ticket.budget
        budget.unwait(ticket)
        budget.open -= 1
        budget.by_address[ticket.address] -= 1
        if budget.by_address[ticket.address] <= 0:
            del budget.by_address[ticket.address]
        self.open.labels(ticket.port, budget.name).dec()
