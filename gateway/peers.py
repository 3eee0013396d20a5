"""Peers: the other chunkd nodes of a cluster, and which of them owns which chunk.

Membership comes from ``[peers]``: a static list, a file that is re-read when it
changes, and a DNS name whose A/AAAA records are re-resolved every round (a
Kubernetes headless service); all of them together. Every member is probed
(``GET /healthz``) every ``health_interval``; a member is marked down after
``down_after`` failed probes in a row and up again after ``up_after`` passes. A
member that fails a chunk request counts as a failed probe too.

Placement is rendezvous (HRW) hashing: a key's owners are the healthy members
(this node included) ordered by ``blake3(member, key)``. Each key has one owner;
when a member comes or goes, only the keys it owned move.

Rejoining. A node is *apart* when more than half of the other members it has seen
up are down in its view (its link failed: a partition, a pulled cable). Meanwhile
the others put its keys on the member ranked next after it, which fetched and kept
them. So for ``_HANDOFF_WINDOW`` after it rejoins, a chunk this node owns but lacks
is asked of the member ranked next after it (a *handoff*) before the backend. A
handoff asks for what that member holds (``held=1``): it answers from its own tiers
or 404 at once, never fetching the chunk for this node nor asking this node for it,
so a handoff costs one round trip at most and never a second backend read.

Peer protocol (on the HTTP port; every request carries ``Authorization: Bearer
<token>`` from ``token_file``, compared in constant time; 401 otherwise). With
``tls_cert``/``tls_key``/``tls_ca`` set it is HTTPS, both ends verified against
``tls_ca`` (see :mod:`chunkd.gateway.tls`)::

    GET /v1/peer/chunks/{backend}/{id}   the chunk, from the owner's cache or fetched
                                         by the owner from <backend>/chunks/<id>
                                         (checkpoint chunks), under single flight
    GET /v1/peer/pages/{id}              a dataset registry page (its id is its blake3),
                                         from the owner's tiers or fetched by the owner
                                         from the registry's pages/<id>.json, under
                                         single flight (never passed on)
    GET /v1/peer/objects/{backend}/{key}?version=V&index=I
                                         chunk I of that object version (409 if the
                                         owner sees another version); the owner
                                         states the id in X-Chunkd-Chunk
    ...?held=1 (any route)              only what the node holds in its tiers, or
                                         404 NotHeld at once: never fetched for the
                                         asker (a rejoined node's handoff)

A connection from a member's address (an IP literal, a ``dns`` record, or what a
member's host name resolves to, looked up again every ``_HOST_LOOKUP_INTERVAL``) counts
against the peers' connection budget of the HTTP port, which anonymous clients cannot
take (:meth:`Peers.trusts`, :mod:`chunkd.gateway.connections`); trusted for the
budget only, never for data.

The receiver verifies every chunk against its id before it uses or caches it; a
peer that sends wrong bytes is counted, logged and skipped, and the reader tries
the next owner, then the backend. A request waits on its owner only while the
owner stays healthy (it may be fetching that chunk from a slow backend for every
node): a refused connection ends it at once; an owner that sends this node
nothing (for any request) for ``timeout`` is probed at once, and one that fails
that probe too (a hung process, a lost link) is left after ``timeout`` plus the
probe (at most 2 s more); nothing waits past a two-minute cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import quote

import aiohttp
import blake3

from chunkd import faults
from chunkd.cache import ChunkId
from chunkd.cache.singleflight import SingleFlight
from chunkd.errors import ConfigError, OwnerSilentError
from chunkd.gateway.config.addresses import split_listen

if TYPE_CHECKING:
    from chunkd.gateway.config import PeersConfig
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.tls import PeerTLS

__all__ = ["OwnerSilentError", "Peer", "Peers", "rank_owners"]

log = logging.getLogger("chunkd.gateway.peers")

# A probe waits at most this long (and never longer than [peers] timeout): /healthz
# answers from memory, so a peer that takes longer is in trouble whatever the setting.
_HEALTH_TIMEOUT: Final = 2.0
# How long after rejoining the cluster this node asks the member ranked next for the
# chunks it owns: the others read those through that member while this node was
# apart, and a job that lost a node restarts from its checkpoint within minutes.
_HANDOFF_WINDOW: Final = 600.0
# A handoff's query: answer from what you hold, or 404 at once (see the module docstring).
_HELD: Final = {"held": "1"}
# How often a member named by a host name is looked up again for the addresses it
# connects from (the peers' connection budget); its A/AAAA records rarely change.
_HOST_LOOKUP_INTERVAL: Final = 30.0


def rank_owners(members: list[str], key: bytes) -> list[str]:
    """``members`` in rendezvous order for ``key``: the first is its owner."""
    return sorted(
        members, key=lambda m: blake3.blake3(m.encode() + b"\0" + key).digest(), reverse=True
    )


@dataclass
class Peer:
    """One member and what the probes say of it."""

    address: str
    healthy: bool = True
    misses: int = 0
    passes: int = 0
    last_change: float = field(default_factory=time.time)


class Peers:
    """This node's view of the cluster.

    Args:
        config: the ``[peers]`` section (enabled).
        metrics: the daemon's metrics.
        tls: the TLS contexts made from ``config`` (:meth:`PeerTLS.from_config`);
            None: peers talk plain HTTP.
    """

    def __init__(
        self, config: PeersConfig, metrics: Metrics, *, tls: PeerTLS | None = None
    ) -> None:
        assert config.address is not None
        self.config = config
        self.address = config.address
        self.metrics = metrics
        self.tls = tls
        self._scheme = "http" if tls is None else "https"
        self.token = _read_token(config.token_file)
        self._members: dict[str, Peer] = {}
        self._file_stamp: tuple[float, int] | None = None
        self._resolved: list[str] = []
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._probes: SingleFlight[str, bool] = SingleFlight()  # one probe per peer at a time
        self._heard: dict[str, float] = {}  # when each peer last sent us anything
        # Members seen up (a passed probe while healthy): only those count towards this
        # node being apart (members that never came up, at a cold start, do not).
        self._seen_up: set[str] = set()
        self._apart = False
        self._rejoined_at: float | None = None  # monotonic; see handing_off()
        # The IP addresses of the other members, and of each member host name when it
        # was last looked up: connections from them get the peers' budget (trusts()).
        self._member_ips: frozenset[str] = frozenset()
        self._looked_up: dict[str, tuple[float, frozenset[str]]] = {}
        self._set_members(self._listed())

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Open the HTTP session and start probing."""
        self._session = aiohttp.ClientSession(
            # X-Chunkd-Peer: the owner counts what it serves to each member.
            headers={"Authorization": f"Bearer {self.token}", "X-Chunkd-Peer": self.address},
            # A request may wait on its owner's own backend fetch: it waits as long
            # as the owner stays healthy (see _ask), within [peers] request_timeout.
            timeout=aiohttp.ClientTimeout(
                total=self.config.request_timeout, connect=self.config.timeout
            ),
            connector=None if self.tls is None else aiohttp.TCPConnector(ssl=self.tls.client),
        )
        self._task = asyncio.create_task(self._watch())

    async def close(self) -> None:
        """Stop probing and close connections."""
        pending = [t for t in (self._task, *self._probes.running()) if t is not None]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    # -- membership -----------------------------------------------------------------

    def _listed(self) -> list[str]:
        members = list(self.config.members)
        path = self.config.members_file
        if path is not None:
            try:
                st = os.stat(path)
                self._file_stamp = (st.st_mtime, st.st_size)
                members += _parse_members(path.read_text())
            except OSError as exc:
                log.warning("peers: cannot read members_file %s (%s)", path, exc)
        members += self._resolved
        if self.address not in members:
            members.append(self.address)
        return list(dict.fromkeys(members))

    def _set_members(self, addresses: list[str]) -> None:
        old = set(self._members)
        self._members = {a: self._members.get(a) or Peer(a) for a in addresses}
        self._note_member_ips()
        if set(addresses) != old and old:
            log.info("peers: membership is now %s", ", ".join(addresses))
        self._export()

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

    @property
    def members(self) -> list[Peer]:
        """Every member, this node included."""
        return list(self._members.values())

    def healthy(self) -> list[str]:
        """The members currently up (this node always is)."""
        return [a for a, p in self._members.items() if p.healthy or a == self.address]

    def owners(self, key: bytes) -> list[str]:
        """The healthy members in rendezvous order for ``key``."""
        return rank_owners(self.healthy(), key)

    def is_self(self, address: str) -> bool:
        """Whether ``address`` is this node."""
        return address == self.address

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
            literal = _normal_ip(host)
            if literal:
                ips.add(literal)
            else:
                ips |= self._looked_up.get(host, (0.0, frozenset[str]()))[1]
        self._member_ips = frozenset(ips)

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

    # -- health ---------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            try:
                await self._resolve()
                self._reload_if_changed()
                await self._look_up_members()
                others = [p for p in self._members.values() if p.address != self.address]
                await asyncio.gather(*(self._probe(p) for p in others))
                self._export()
            except Exception:  # a probe round must never stop the probing
                log.exception("peers: a health round failed")
            await asyncio.sleep(self.config.health_interval)

    async def _probe(self, peer: Peer) -> None:
        await self._alive(peer.address)

    async def _alive(self, address: str) -> bool:
        """Probe ``address`` now (one probe at a time per peer; callers share it)."""
        try:
            return await self._probes.run(address, lambda: self._health(address))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and not task.cancelling():
                return False  # the probe was stopped (the daemon is closing), not us
            raise

    async def _health(self, address: str) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(
                f"{self._scheme}://{address}/healthz",
                timeout=aiohttp.ClientTimeout(total=min(_HEALTH_TIMEOUT, self.config.timeout)),
            ) as response:
                ok = response.status == 200
                why = "" if ok else f"/healthz answered {response.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            ok, why = False, f"/healthz: {_reason(exc)}"
        if ok:
            self._heard[address] = time.monotonic()
        self.note(address, ok=ok, why=why)
        return ok

    def note(self, address: str, *, ok: bool, why: str = "") -> None:
        """Count a probe (or a request) to ``address`` as passed or failed (``why``)."""
        peer = self._members.get(address)
        if peer is None:
            return
        if ok:
            peer.misses = 0
            peer.passes += 1
            if not peer.healthy and peer.passes >= self.config.up_after:
                peer.healthy, peer.last_change = True, time.time()
                log.info("peer %s is up", address)
            if peer.healthy:
                # Up by its probes, not by the start's assumption: at a cold start a
                # member that passes its first probe is still down, and must not make
                # this node look apart.
                self._seen_up.add(address)
        else:
            peer.passes = 0
            peer.misses += 1
            if peer.healthy and peer.misses >= self.config.down_after:
                peer.healthy, peer.last_change = False, time.time()
                log.warning(
                    "peer %s is down after %d failed probes (last: %s)",
                    address,
                    peer.misses,
                    why or "no reason given",
                )
        self._track_apart()
        self._export()

    def _track_apart(self) -> None:
        """Note when this node falls apart from the cluster and when it rejoins."""
        seen = [p for a, p in self._members.items() if a != self.address and a in self._seen_up]
        down = sum(not p.healthy for p in seen)
        apart = down * 2 > len(seen)
        if apart and not self._apart:
            log.warning(
                "peers: this node is apart from the cluster: %d of the %d others are down",
                down,
                len(seen),
            )
        elif self._apart and not apart:
            self._rejoined_at = time.monotonic()
            log.info(
                "peers: this node rejoined the cluster; for %.0f s it asks the member "
                "ranked next for the chunks it owns before the backend",
                _HANDOFF_WINDOW,
            )
        self._apart = apart

    def handing_off(self) -> bool:
        """Whether this node rejoined the cluster within ``_HANDOFF_WINDOW``: the
        chunks it owns may be with the member ranked next after it."""
        return (
            not self._apart
            and self._rejoined_at is not None
            and time.monotonic() - self._rejoined_at < _HANDOFF_WINDOW
        )

    def _sources(self, key: bytes) -> list[tuple[str, bool]]:
        """Whom to ask for ``key``, in order: the owners ranked before this node, then
        (when :meth:`handing_off`) the one ranked next after it, as a handoff."""
        owners = self.owners(key)
        asked: list[tuple[str, bool]] = []
        for rank, owner in enumerate(owners):
            if self.is_self(owner):
                if self.handing_off() and rank + 1 < len(owners):
                    asked.append((owners[rank + 1], True))
                break
            asked.append((owner, False))
        return asked

    def _export(self) -> None:
        self.metrics.peer_members.set(len(self._members))
        self.metrics.peer_healthy.set(len(self.healthy()))

    # -- fetching -------------------------------------------------------------------

    async def fetch_chunk(self, backend: str, cid: ChunkId) -> memoryview | None:
        """Chunk ``cid`` from its owner (or the next ones), verified; None: fetch it
        yourself (this node owns it, or every owner before it failed)."""
        return await self._fetch_by_id(cid, f"chunks/{backend}/{cid}", "chunk")

    async def fetch_page(self, cid: ChunkId) -> memoryview | None:
        """Dataset registry page ``cid`` (its id is the blake3 of its bytes, as a
        chunk's) from its owner (or the next ones), verified; None: fetch it yourself.
        The owner fetches it from the registry once for the cluster: no node asks the
        registry for a page's version (a page is named by its content)."""
        return await self._fetch_by_id(cid, f"pages/{cid}", "page")

    async def _fetch_by_id(self, cid: ChunkId, route: str, what: str) -> memoryview | None:
        assert self._session is not None
        for owner, handoff in self._sources(bytes(cid)):
            url = f"{self._scheme}://{owner}/v1/peer/{route}"
            try:
                answer = await self._ask(owner, url, _HELD if handoff else {})
                if answer is None:
                    continue
                _, data = answer
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                self._failed(owner, exc, f"a {what} request")
                log.info("peer %s did not give %s %s (%s); trying the next", owner, what, cid, exc)
                continue
            got = await asyncio.to_thread(ChunkId.of, data)
            if got != cid:
                self._count(owner, "integrity")
                self.metrics.peer_integrity_failures.labels(owner).inc()
                log.warning(
                    "peer %s sent %d bytes for %s %s that hash to %s; dropped them",
                    owner,
                    data.nbytes,
                    what,
                    cid,
                    got,
                )
                continue
            self._count(owner, "handoff" if handoff else "ok")
            self.metrics.peer_bytes.labels("in").inc(data.nbytes)
            self.metrics.peer_member_bytes.labels(owner, "in").inc(data.nbytes)
            return data
        return None

    async def fetch_locator(
        self, backend: str, key: str, version: str, index: int, placement: bytes
    ) -> tuple[str, ChunkId, memoryview] | None:
        """Chunk ``index`` of object ``backend/key`` at ``version``, from the owners of
        ``placement`` in order: (the owner, the id it states, the bytes), or None.

        The caller checks the bytes against the stated id before it keeps them.
        """
        assert self._session is not None
        for owner, handoff in self._sources(placement):
            url = f"{self._scheme}://{owner}/v1/peer/objects/{backend}/{quote(key)}"
            params = {"version": version, "index": str(index)} | (_HELD if handoff else {})
            try:
                answer = await self._ask(owner, url, params)
                if answer is None:
                    continue
                stated, data = ChunkId.parse(answer[0].get("X-Chunkd-Chunk", "")), answer[1]
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                self._failed(owner, exc, "an object request")
                log.info("peer %s did not give %s/%s#%d (%s)", owner, backend, key, index, exc)
                continue
            self._count(owner, "handoff" if handoff else "ok")
            self.metrics.peer_bytes.labels("in").inc(data.nbytes)
            self.metrics.peer_member_bytes.labels(owner, "in").inc(data.nbytes)
            return owner, stated, data
        return None

    async def _ask(
        self, owner: str, url: str, params: dict[str, str]
    ) -> tuple[dict[str, str], memoryview] | None:
        """GET ``url`` from ``owner``: (headers, body) on 200, None on another status.

        The wait adapts to the owner. It goes on while bytes arrive from it, for
        this request or any other, and while the owner answers its health probe (it
        may be fetching the chunk from a slow backend for everyone). After
        ``timeout`` with nothing from it the owner is probed at once; a failed probe
        ends the wait, so does the owner being marked down, and the hard cap. A
        refused or reset connection ends it at once.

        Raises:
            aiohttp.ClientError, OSError: the owner failed.
            OwnerSilentError: the owner went silent and failed its probe (already
                counted as a failed probe).
            TimeoutError: the owner is marked down, or the hard cap passed.
        """
        assert self._session is not None
        session = self._session
        heard = [time.monotonic()]  # when the owner last sent anything for this request

        def hear() -> None:
            heard[0] = self._heard[owner] = time.monotonic()

        async def call() -> tuple[int, dict[str, str], memoryview]:
            for attempt in range(2):
                try:
                    async with session.get(url, params=params) as response:
                        hear()
                        if response.status != 200:
                            return response.status, dict(response.headers), memoryview(b"")
                        pieces = []
                        async for piece in response.content.iter_any():
                            pieces.append(piece)
                            hear()
                        body = memoryview(pieces[0] if len(pieces) == 1 else b"".join(pieces))
                        faults.point("peer.receive")
                        return response.status, dict(response.headers), body
                except aiohttp.ServerDisconnectedError:
                    # A kept-alive connection the owner closed as it was reused: once
                    # more on a new one (a GET), rather than a second backend read.
                    if attempt:
                        raise
            raise AssertionError("unreachable")  # pragma: no cover

        timeout = self.config.timeout

        def silent() -> float:
            # Bytes from the owner for any request (or a passed probe) show it alive:
            # busy with a slow backend for every node, it still sends what it has.
            return time.monotonic() - max(heard[0], self._heard.get(owner, 0.0))

        task = asyncio.ensure_future(call())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=max(0.01, timeout - silent()))
                if done:
                    break
                if owner not in self.healthy():
                    raise TimeoutError(f"peer {owner} went down while it was asked")
                if silent() < timeout:
                    continue  # bytes came meanwhile
                # Silent for a whole timeout: busy with a slow backend for every node
                # (so wait on), or hung? Ask it directly rather than wait for
                # down_after probe rounds.
                alive = await self._alive(owner)
                if task.done():
                    break  # the answer came during the probe
                if not alive:
                    raise OwnerSilentError(
                        f"peer {owner} sent nothing for {timeout:g}s and failed a health probe"
                    )
                heard[0] = time.monotonic()  # it answered: another timeout of patience
        finally:
            if not task.done():
                task.cancel()
            elif not task.cancelled():
                task.exception()  # retrieved here; task.result() below re-raises it
        status, headers, body = task.result()
        if status != 200:
            self._count(owner, f"http_{status}")
            if status >= 500:
                self.note(owner, ok=False, why=f"a request answered {status}")
            return None
        return headers, body

    def integrity_failure(self, owner: str, cid: ChunkId) -> None:
        """Count bytes from ``owner`` that did not hash to the ``cid`` it stated."""
        self._count(owner, "integrity")
        self.metrics.peer_integrity_failures.labels(owner).inc()
        log.warning("peer %s sent bytes that do not hash to chunk %s; dropped them", owner, cid)

    def _failed(self, owner: str, exc: BaseException, what: str) -> None:
        """Count a request to ``owner`` that failed, towards marking it down."""
        self._count(owner, "error")
        if not isinstance(exc, OwnerSilentError):  # its failed probe was counted
            self.note(owner, ok=False, why=f"{what}: {_reason(exc)}")

    def _count(self, peer: str, outcome: str) -> None:
        self.metrics.peer_requests.labels(peer, outcome).inc()

    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header carries the peer token (constant time)."""
        wanted = f"Bearer {self.token}".encode()
        return hmac.compare_digest((header or "").encode("utf-8", "surrogateescape"), wanted)

    def served(self, member: str | None, nbytes: int) -> None:
        """Count ``nbytes`` served to ``member`` (its ``X-Chunkd-Peer``); only members
        are counted, so a made-up name adds no series."""
        self.metrics.peer_bytes.labels("out").inc(nbytes)
        if member is not None and member in self._members and member != self.address:
            self.metrics.peer_member_bytes.labels(member, "out").inc(nbytes)

    def stats(self) -> dict[str, Any]:
        """For /v1/stats and ``chunkd stats``."""
        return {
            "self": self.address,
            "members": [
                {"address": p.address, "healthy": p.healthy or p.address == self.address}
                for p in self._members.values()
            ],
            "healthy": len(self.healthy()),
            "tls": self.tls is not None,
        }


def _reason(exc: BaseException) -> str:
    """One line on why a request to a peer failed (TLS refusals included)."""
    cause = exc
    while not str(cause) and cause.__cause__ is not None:
        cause = cause.__cause__
    text = str(cause).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


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


def _read_token(path: Path | None) -> str:
    if path is None:
        raise ConfigError("[peers] needs token_file")
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"[peers] token_file {path} cannot be read ({exc.strerror or exc}); create it "
            "with the cluster's shared secret"
        ) from exc
    if len(token) < 16:
        raise ConfigError(
            f"[peers] token_file {path} holds under 16 characters; use a longer secret"
        )
    with contextlib.suppress(OSError):
        if os.stat(path).st_mode & 0o066:  # read or write by group or others; x is moot
            log.warning(
                "peers: token_file %s may be read or written by its group or others; chmod 600 it",
                path,
            )
    return token
