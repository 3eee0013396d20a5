"""Membership: who the other chunkd nodes of the cluster are, and where they connect from.

Members come from ``[peers]``: a static list, a file that is re-read when it
changes, and a DNS name whose A/AAAA records are re-resolved every round (a
Kubernetes headless service); all of them together, this node always among them.
Each member is a :class:`Peer` record whose health :mod:`.health` keeps. An entry of
the list or the file may carry labels after its address (``10.0.0.7:8470 rack=r1``,
:func:`~chunkd.gateway.config.addresses.split_member`): ``rack`` is the member's
failure domain, which replica placement keeps a save's copies out of
(``docs/replicas.md``). Labels are the entry's, never the member's own claim.

A connection from a member's address (an IP literal, a ``dns`` record, or what a
member's host name resolves to, looked up again every ``_HOST_LOOKUP_INTERVAL``)
counts against the peers' connection budget of the HTTP port, which anonymous
clients cannot take (:meth:`Membership.trusts`, :mod:`chunkd.gateway.connections`);
trusted for the budget only, never for data.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from chunkd.gateway.config.addresses import split_listen, split_member

if TYPE_CHECKING:
    from chunkd.gateway.config import PeersConfig
    from chunkd.gateway.metrics import Metrics

__all__ = ["Membership", "Peer"]

log = logging.getLogger("chunkd.gateway.peers")

# How often a member named by a host name is looked up again for the addresses it
# connects from (the peers' connection budget); its A/AAAA records rarely change.
_HOST_LOOKUP_INTERVAL: Final = 30.0


@dataclass
class Peer:
    """One member and what the probes say of it."""

    address: str
    healthy: bool = True
    misses: int = 0
    passes: int = 0
    last_change: float = field(default_factory=time.time)
    #: the labels its entry gives (``{"rack": "r1"}``); empty: none
    labels: dict[str, str] = field(default_factory=dict)
    #: the IP addresses it connects from: its address's IP literal, or what its host
    #: name resolved to when last looked up (empty: not known yet, or this node)
    ips: frozenset[str] = frozenset()

    def connects_from(self, ip: str | None) -> bool:
        """Whether a connection from ``ip`` may be this member's (the replica routes
        take a push or note in its name only from it)."""
        return ip is not None and _normal_ip(ip) in self.ips

    @property
    def domain(self) -> str:
        """Its failure domain: ``rack=`` label, else a domain of its own (its address)."""
        rack = self.labels.get("rack")
        return f"rack={rack}" if rack is not None else f"node={self.address}"


class Membership:
    """The members of the cluster, this node (``config.address``) included.

    Args:
        config: the ``[peers]`` section (enabled).
        metrics: the daemon's metrics (the member gauges).
    """

    def __init__(self, config: PeersConfig, metrics: Metrics) -> None:
        assert config.address is not None
        self.config = config
        self.address = config.address
        self.metrics = metrics
        self._members: dict[str, Peer] = {}
        self._file_stamp: tuple[float, int] | None = None
        self._resolved: list[str] = []
        self._labels: dict[str, dict[str, str]] = {}
        # The IP addresses of the other members, and of each member host name when it
        # was last looked up: connections from them get the peers' budget (trusts()).
        self._member_ips: frozenset[str] = frozenset()
        self._looked_up: dict[str, tuple[float, frozenset[str]]] = {}
        self._set_members(self._listed())

    # -- who the members are ------------------------------------------------------------

    @property
    def members(self) -> list[Peer]:
        """Every member, this node included."""
        return list(self._members.values())

    def get(self, address: str) -> Peer | None:
        """The member at ``address``; None: not a member (any more)."""
        return self._members.get(address)

    def others(self) -> list[Peer]:
        """Every member but this node."""
        return [p for p in self._members.values() if p.address != self.address]

    def healthy(self) -> list[str]:
        """The members currently up (this node always is)."""
        return [a for a, p in self._members.items() if p.healthy or a == self.address]

    def is_self(self, address: str) -> bool:
        """Whether ``address`` is this node."""
        return address == self.address

    async def refresh(self) -> None:
        """Re-resolve ``dns``, re-read ``members_file`` if it changed, and look up the
        member host names due for it: the start of every health round."""
        await self._resolve()
        self._reload_if_changed()
        await self._look_up_members()

    def export(self) -> None:
        """Set the member gauges."""
        self.metrics.peer_members.set(len(self._members))
        self.metrics.peer_healthy.set(len(self.healthy()))

    def _listed(self) -> list[str]:
        entries = list(self.config.members)
        path = self.config.members_file
        if path is not None:
            try:
                st = os.stat(path)
                self._file_stamp = (st.st_mtime, st.st_size)
                entries += _parse_members(path.read_text())
            except OSError as exc:
                log.warning("peers: cannot read members_file %s (%s)", path, exc)
        members: list[str] = []
        labels: dict[str, dict[str, str]] = {}
        for entry in entries:
            try:
                address, tags = split_member(entry)
            except ValueError as exc:
                log.warning("peers: member entry %r skipped: it %s", entry[:120], exc)
                continue
            members.append(address)
            if tags:
                labels.setdefault(address, tags)  # the first entry of an address wins
        members += self._resolved
        if self.address not in members:
            members.append(self.address)
        self._labels = labels
        return list(dict.fromkeys(members))

    def _set_members(self, addresses: list[str]) -> None:
        old = set(self._members)
        self._members = {a: self._members.get(a) or Peer(a) for a in addresses}
        for address, peer in self._members.items():
            peer.labels = dict(self._labels.get(address, {}))
        self._note_member_ips()
        if set(addresses) != old and old:
            log.info("peers: membership is now %s", ", ".join(addresses))
        self.export()

    async def _resolve(self) -> None:
        """Re-resolve ``dns``; a failed lookup keeps the last answer."""
        if self.config.dns is None:
            return
        host, _, port = self.config.dns.rpartition(":")
        host = host.strip("[]")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, int(port), type=socket.SOCK_STREAM
            )
        except OSError as exc:
            log.warning("peers: cannot resolve %s (%s); keeping the last members", host, exc)
            return
        hosts = {str(info[4][0]) for info in infos}
        found = sorted(f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts)
        if found != self._resolved:
            self._resolved = found
            self._set_members(self._listed())

    def _reload_if_changed(self) -> None:
        path = self.config.members_file
        if path is None:
            return
        try:
            st = os.stat(path)
        except OSError:
            return
        if (st.st_mtime, st.st_size) != self._file_stamp:
            self._set_members(self._listed())

    # -- where they connect from ------------------------------------------------------

    def trusts(self, ip: str) -> bool:
        """Whether a connection from ``ip`` comes from another member's address: it
        then counts against the peers' connection budget, not the anonymous one
        (:mod:`chunkd.gateway.connections`). Trust for a budget only, never for data:
        every peer route still wants the token (and the certificate, with TLS).

        Members are known by the addresses they listen on (IP literals, the ``dns``
        records, and host names looked up every ``_HOST_LOOKUP_INTERVAL``); a member
        that connects from another address of its host is an anonymous client.
        """
        return _normal_ip(ip) in self._member_ips

    def _member_hosts(self) -> set[str]:
        """The host parts of the other members' addresses."""
        hosts = set()
        for member in self._members:
            if member != self.address:
                with contextlib.suppress(ValueError):
                    hosts.add(split_listen(member)[0])
        return hosts

    def _note_member_ips(self) -> None:
        """Set :meth:`trusts`' addresses: the members' IP literals, and what the last
        lookup of each member host name found."""
        ips: set[str] = set()
        for host in self._member_hosts():
            ips |= self._ips_of(host)
        self._member_ips = frozenset(ips)
        for address, peer in self._members.items():
            with contextlib.suppress(ValueError):
                if address != self.address:
                    peer.ips = self._ips_of(split_listen(address)[0])

    def _ips_of(self, host: str) -> frozenset[str]:
        literal = _normal_ip(host)
        if literal:
            return frozenset((literal,))
        return self._looked_up.get(host, (0.0, frozenset[str]()))[1]

    async def _look_up_members(self) -> None:
        """Look up the member host names not looked up for ``_HOST_LOOKUP_INTERVAL``
        (a failed lookup keeps what the last one found), then :meth:`_note_member_ips`."""
        hosts = {host for host in self._member_hosts() if not _normal_ip(host)}
        for gone in set(self._looked_up) - hosts:
            del self._looked_up[gone]
        now = time.monotonic()
        stale = [
            host
            for host in hosts
            if now - self._looked_up.get(host, (-_HOST_LOOKUP_INTERVAL, None))[0]
            >= _HOST_LOOKUP_INTERVAL
        ]
        loop = asyncio.get_running_loop()

        async def look_up(host: str) -> None:
            try:
                infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("peers: cannot look up member %s (%s)", host, exc)
                return
            found = frozenset(_normal_ip(str(info[4][0])) for info in infos) - {""}
            self._looked_up[host] = (time.monotonic(), found)

        if stale:
            await asyncio.gather(*map(look_up, stale))
        self._note_member_ips()


def _normal_ip(text: str) -> str:
    """``text`` as an IP address in its usual spelling (an IPv4-mapped IPv6 one as
    IPv4, no zone); ``""`` when it is none."""
    try:
        ip = ipaddress.ip_address(text.split("%")[0])
    except ValueError:
        return ""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def _parse_members(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            out.append(entry)
    return out
