"""The peer client: this node's requests to the others for chunks and pages.

Peer protocol (on the HTTP port; every request carries ``Authorization: Bearer
<token>`` from ``token_file``, compared in constant time; 401 otherwise). With
``tls_cert``/``tls_key``/``tls_ca`` set it is HTTPS, both ends verified against
``tls_ca`` (see :mod:`chunkd.gateway.tls`). The routes are served by
:mod:`chunkd.gateway.api`::

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
                                         states the id in X-Chunkd-Chunk; always
                                         served by the owner (no holders)
    ...?held=1 (any route)              only what the node holds in its tiers, or
                                         404 NotHeld at once: never fetched for the
                                         asker (a rejoined node's handoff, a replica)
    GET /v1/peer/chunks/{backend}/{id}?held=1&wait=1
                                         a holder request: from the tiers, or after
                                         this node's own fetch of the chunk in flight
                                         (waiting while that fetch progresses: until
                                         it is silent for ``timeout``, at most
                                         ``request_timeout``), else 404 NotHeld
    GET /v1/peer/chunks/{backend}/{id}?holders=1&forget=1&bad=a:p
                                         a note to the owner: holders that failed
                                         this node before a later one gave the
                                         chunk; dropped from its list, 204
    ...?held=1&role=holder|replica      the role the asker asks in: both ends count
                                         the bytes under it (without it the server
                                         says replica for a chunk of its replica
                                         store, else holder)

Holders serve (checkpoint chunks). This node asks a chunk's owner with ``holders=1``
(it follows a 300; an asker without it, a daemon of the previous release, is always
served and never made a holder). The owner serves it itself until it has sent it
``holder_fanout`` times; after that it answers ``300 Multiple Choices`` with
``X-Chunkd-Holders: a:p, b:p`` (at most 3 members added to the chunk's list before
this asker, also when this asker asks again). This node then asks those holders in
order (holder requests: members only, never itself), verifying each answer, and at
last the owner again with ``holders=1&direct=1`` and one ``bad=a:p`` per holder that
was asked and failed (the owner serves, and drops them from the chunk's list); when
a later holder gave it, the failed ones go to the owner in a background note
(``forget=1``, at most 64 pending). See
:mod:`.holders` for the owner's side. A restore may name replica holders to ask
first (:meth:`PeerClient.fetch_chunk` ``replicas``): ``held=1`` without waiting,
role ``replica``.

Pipelining: at most ``per_peer_requests`` requests are in flight to any one member
(a semaphore per member, made when first needed); a restore asks for many chunks at
once, so its requests spread over several owners and holders, each bounded. A
request waits for its turn at most ``request_timeout``. Holder requests have
``per_peer_requests`` turns of their own per member and never wait for one: with
none free, the holder is not asked (counted ``peer_requests{outcome="skipped"}``,
not reported ``bad=``) and the next one is, then the owner. A holder request waits
on the holder's fetch, which may itself wait for a turn; were holder requests to
wait for turns, or hold the turns that fetches need, their waits could chain
across nodes in a circle. A request never sent (no turn, or the member went down
while it waited for one) is counted ``skipped`` and never against the member's
health.

A node apart (:meth:`.health.Health.apart`) probes the members that are down before
it places a chunk (:meth:`PeerClient._rejoin_probe`: each up to ``up_after`` times
while it passes; one round in flight, the next ``health_interval`` after it; a fetch
waits on it at most 0.5 s): healed,
it sees its peers up at once rather than read the backend for every chunk it owns
only because they looked down.

A handoff asks for what that member holds (``held=1``): it answers from its own
tiers or 404 at once, never fetching the chunk for this node nor asking this node
for it, so a handoff costs one round trip at most and never a second backend read.

The receiver verifies every chunk against its id before it uses or caches it; a
peer that sends wrong bytes is counted, logged and skipped, and the reader tries
the next source (:func:`.placement.sources`), then the backend. A request waits on
its owner only while the owner stays healthy (it may be fetching that chunk from a
slow backend for every node): a refused connection ends it at once; an owner that
sends this node nothing (for any request) for ``timeout`` is probed at once, and one
that fails that probe too (a hung process, a lost link) is left after ``timeout``
plus the probe (at most 2 s more); nothing waits past a two-minute cap. One GET to
one member is :meth:`PeerClient._ask`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Final
from urllib.parse import quote

import aiohttp

from chunkd import faults
from chunkd.cache import ChunkId
from chunkd.errors import OwnerSilentError
from chunkd.gateway.costs.headers import headers_of
from chunkd.gateway.peers.health import reason
from chunkd.gateway.peers.placement import Source, rank_owners, sources

if TYPE_CHECKING:
    from chunkd.gateway.config import PeersConfig
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.peers.health import Health
    from chunkd.gateway.peers.membership import Membership
    from chunkd.gateway.tls import PeerTLS

__all__ = ["HOLDERS_HEADER", "MAX_HOLDERS_NAMED", "PeerClient"]

log = logging.getLogger("chunkd.gateway.peers")

# A handoff's query: answer from what you hold, or 404 at once (see the module docstring).
_HELD: Final = {"held": "1"}
# A holder request: what you hold, or your own fetch of it in flight (while it progresses).
_HOLDER: Final = {"held": "1", "wait": "1"}
# An owner request from a node that follows a 300 (an older daemon sends none, and is
# always served).
_HOLDERS_OK: Final = ("holders", "1")
#: The header of an owner's 300 answer: the holders to ask, ``a:p, b:p``.
HOLDERS_HEADER: Final = "X-Chunkd-Holders"
#: The most holders an owner names in one answer, and the most an asker reads of it.
MAX_HOLDERS_NAMED: Final = 3
# The most notes of failed holders (forget=1) sent in the background at once; past it
# a note is not sent (the holder's ttl, or the next asker's bad=, drops it later).
_MAX_NOTES: Final = 64
# How long a fetch on a node apart waits for the probe round of the members down
# (PeerClient._rejoin_probe): a healed link answers in a round trip or two.
_REJOIN_WAIT: Final = 0.5
# peer_requests{outcome} of a chunk received, by the role its sender played.
_OUTCOMES: Final = {"owner": "ok", "holder": "holder", "replica": "replica", "handoff": "handoff"}

_Query = Mapping[str, str] | Sequence[tuple[str, str]]


class _NotAsked(TimeoutError):
    """The request never reached the member: no turn free for a holder request, the
    member went down while the request waited for its turn, or the wait for a turn
    passed ``request_timeout``. Never counted against the member's health."""


class _OwnFetch:
    """This node's own fetch of one chunk in flight (:meth:`PeerClient.holding`):
    its result for the holder requests that wait on it, and when it last made
    progress (a request for the chunk sent, or a piece of an answer received)."""

    __slots__ = ("done", "heard")

    def __init__(self, done: asyncio.Future[memoryview | None]) -> None:
        self.done = done
        self.heard = time.monotonic()


class PeerClient:
    """This node's side of the peer protocol: it asks, waits, verifies and counts.

    Args:
        config: the ``[peers]`` section (enabled).
        membership: the members (placement is over its healthy ones).
        health: the members' health (probes on silence, failures counted).
        metrics: the daemon's metrics.
        token: the cluster's shared secret.
        tls: the TLS contexts; None: plain HTTP.
    """

    def __init__(
        self,
        config: PeersConfig,
        membership: Membership,
        health: Health,
        metrics: Metrics,
        *,
        token: str,
        tls: PeerTLS | None,
    ) -> None:
        self.config = config
        self.membership = membership
        self.health = health
        self.metrics = metrics
        self._token = token
        self._tls = tls
        self._scheme = "http" if tls is None else "https"
        self.session: aiohttp.ClientSession | None = None
        # Turns per member (see _slot): those of owner, direct, replica and handoff
        # requests, and apart those of holder requests, which never wait for one.
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._holder_slots: dict[str, asyncio.Semaphore] = {}
        self._notes: set[asyncio.Task[None]] = set()  # forget=1 notes in flight
        # This node's fetches of checkpoint chunks in flight (holding): holder requests
        # for them wait (fetching). One per chunk: the restore's single flight.
        self._fetching: dict[ChunkId, _OwnFetch] = {}
        # The probe round of a node apart before it places a chunk (_rejoin_probe):
        # the one in flight (fetches share it), and when the next may start.
        self._rejoin_round: asyncio.Future[None] | None = None
        self._rejoin_next = 0.0
        self._closed = False  # no probe round starts after close()

    def open(self) -> aiohttp.ClientSession:
        """Open the HTTP session (requests and probes share it) and return it."""
        self.session = aiohttp.ClientSession(
            # X-Chunkd-Peer: the owner counts what it serves to each member.
            headers={
                "Authorization": f"Bearer {self._token}",
                "X-Chunkd-Peer": self.membership.address,
            },
            # A request may wait on its owner's own backend fetch: it waits as long
            # as the owner stays healthy (see _ask), within [peers] request_timeout.
            timeout=aiohttp.ClientTimeout(
                total=self.config.request_timeout, connect=self.config.timeout
            ),
            connector=None if self._tls is None else aiohttp.TCPConnector(ssl=self._tls.client),
        )
        return self.session

    async def close(self) -> None:
        """Close the connections, once the probe round in flight (if any) and the
        forget notes are cancelled: none of them runs on a closed session."""
        self._closed = True
        for note in list(self._notes):
            note.cancel()
        probing = self._rejoin_round
        if probing is not None:
            probing.cancel()
            await asyncio.wait([probing])
            if not probing.cancelled():
                probing.exception()  # retrieved: a round that failed as it ended
        if self.session is not None:
            await self.session.close()

    def owners(self, key: bytes) -> list[str]:
        """The healthy members in rendezvous order for ``key``."""
        return rank_owners(self.membership.healthy(), key)

    def _sources(self, key: bytes) -> list[Source]:
        return sources(
            self.owners(key), self.membership.address, handing_off=self.health.handing_off()
        )

    async def fetch_chunk(
        self,
        backend: str,
        cid: ChunkId,
        *,
        replicas: Sequence[str] = (),
    ) -> memoryview | None:
        """Chunk ``cid``, verified, from the first source that has it: the members in
        ``replicas`` (asked in order, ``held=1``: what they hold, at once), then its
        owner (or the holders the owner names, then the owner with ``direct=1``), then
        the next owners. None: fetch it yourself (this node owns it, or every source
        failed).

        Args:
            backend: the backend the chunk belongs to.
            cid: the chunk's id.
            replicas: member addresses that may hold a replica of the chunk, asked
                first (an address that is not a healthy member, or this node, is
                skipped).
        """
        route = f"chunks/{backend}/{cid}"
        if self.health.apart():
            # This node owns most chunks now only because the others look down: it
            # may have just healed (a partition, a pulled cable), its peers up again
            # before its probes say so. Look now, rather than read the backend for
            # every chunk it wants meanwhile.
            await self._rejoin_probe()
        for replica in self._replica_sources(replicas):
            data = await self._held(replica, route, cid, _HELD, role="replica")
            if data is not None:
                return data
        for owner, handoff in self._sources(bytes(cid)):
            if handoff:
                data = await self._held(owner, route, cid, _HELD, role="handoff")
            else:
                data = await self._from_owner(owner, route, cid)
            if data is not None:
                return data
        return None

    async def holding(self, cid: ChunkId, fetch: Callable[[], Awaitable[memoryview]]) -> memoryview:
        """``await fetch()``: this node's own fetch of chunk ``cid`` (from its peers or
        the backend; it keeps the bytes before it returns them), which holder requests
        for ``cid`` wait on meanwhile (:meth:`fetching`). A second fetch of the same
        id at once (another backend's) runs untracked."""
        if cid in self._fetching:
            return await fetch()
        tracked = asyncio.get_running_loop().create_future()
        self._fetching[cid] = _OwnFetch(tracked)
        data = None
        try:
            data = await fetch()
        finally:
            del self._fetching[cid]
            # Waiters learn the bytes, or None when the fetch failed (the failure is
            # this node's readers' own).
            tracked.set_result(data)
        return data

    async def fetching(self, cid: ChunkId, *, wait: float) -> memoryview | None:
        """Chunk ``cid`` once this node's own fetch of it (in flight now,
        :meth:`holding`) is done: a holder request's wait. It waits while that fetch
        makes progress: until it has been silent (no request for ``cid`` sent, no piece
        of an answer received) for ``wait`` seconds, counted from this wait's start at
        the earliest, and ``request_timeout`` at most in all. None: no such fetch, it
        failed or found nothing, it went silent, or the cap passed.

        A node fetching with a window of many chunks receives each at a fraction of
        its link, so one chunk may take far longer than ``wait``; a fetch that waits on
        a holder that waits on it (a cycle an owner change can make) progresses on
        neither side, and the silence ends both waits."""
        running = self._fetching.get(cid)
        if running is None:
            return None
        start = time.monotonic()
        cap = start + self.config.request_timeout
        while True:
            now = time.monotonic()
            left = min(max(running.heard, start) + wait, cap) - now
            if left <= 0:
                return None
            try:
                return await asyncio.wait_for(asyncio.shield(running.done), left)
            except TimeoutError:
                continue  # progress meanwhile moved the end of the silence on, or not

    async def _rejoin_probe(self) -> None:
        """Probe the members that are down, now, while this node is apart: each one up
        to ``up_after`` times back to back while it passes (a healed link answers in a
        round trip), so that a member reachable again is up before this node places a
        chunk. One round at a time, shared by concurrent fetches, the next one
        ``health_interval`` after it ended at the earliest; a fetch waits on it at most
        :data:`_REJOIN_WAIT` (a node truly alone, whose probes time out, loses that
        much per fetch at most, and only while a round is in flight)."""
        if self._closed:
            return
        if self._rejoin_round is None:
            if time.monotonic() < self._rejoin_next:
                return
            self._rejoin_round = asyncio.ensure_future(self._rejoin_rounds())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.shield(self._rejoin_round), min(_REJOIN_WAIT, self.config.timeout)
            )

    async def _rejoin_rounds(self) -> None:
        started = time.monotonic()

        async def until_up(address: str) -> None:
            for _ in range(self.config.up_after):
                if not await self.health.alive(address):
                    return
                peer = self.membership.get(address)
                if peer is None or peer.healthy:
                    return

        try:
            down = [p.address for p in self.membership.others() if not p.healthy]
            await asyncio.gather(*(until_up(a) for a in down))
        finally:
            ended = time.monotonic()
            self._rejoin_next = ended + self.config.health_interval
            self._rejoin_round = None
            still = self.health.apart()
            log.log(
                logging.DEBUG if still else logging.INFO,
                "peers: this node was apart; probed the members down before placing a "
                "chunk (%.2f s): %s",
                ended - started,
                "still apart" if still else "rejoined",
            )

    def _replica_sources(self, replicas: Sequence[str]) -> list[str]:
        """The addresses of ``replicas`` worth asking: healthy members, not this node,
        each once."""
        if not replicas:
            return []
        healthy = set(self.membership.healthy())
        asked = dict.fromkeys(
            r for r in replicas if r in healthy and not self.membership.is_self(r)
        )
        return list(asked)

    async def _from_owner(self, owner: str, route: str, cid: ChunkId) -> memoryview | None:
        """Chunk ``cid`` from ``owner``: its answer, or the holders it names (then the
        owner again with ``direct=1``, naming the holders that failed)."""
        url = f"{self._scheme}://{owner}/v1/peer/{route}"
        try:
            answer = await self._ask(owner, url, [_HOLDERS_OK], choices=True, chunk=cid)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self._failed(owner, exc, "a chunk request")
            log.info("peer %s did not give chunk %s (%s); trying the next", owner, cid, exc)
            return None
        if answer is None:
            return None
        status, headers, data = answer
        if status == 300:
            self._count(owner, "holders")
            bad: list[str] = []
            for holder in self._holders_named(owner, headers.get(HOLDERS_HEADER, "")):
                data_ = await self._held(holder, route, cid, _HOLDER, role="holder", failed=bad)
                if data_ is not None:
                    if bad:
                        self._note_failed(owner, url, bad)
                    return data_
            # The holders failed (or none was a member, or none had a turn free): the
            # owner serves, and drops the failed ones from the chunk's list.
            direct = [_HOLDERS_OK, ("direct", "1"), *(("bad", b) for b in bad)]
            try:
                answer = await self._ask(owner, url, direct, chunk=cid)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                self._failed(owner, exc, "a direct chunk request")
                log.info("peer %s did not give chunk %s (%s); trying the next", owner, cid, exc)
                return None
            if answer is None:
                return None
            data = answer[2]
        return await self._verified(owner, cid, data, role="owner", what="chunk")

    def _note_failed(self, owner: str, url: str, bad: list[str]) -> None:
        """Tell ``owner``, in the background, that holders ``bad`` failed this node
        although a later one gave the chunk (``forget=1``, answered 204), so that it
        stops naming them; not sent past :data:`_MAX_NOTES` in flight."""
        if len(self._notes) >= _MAX_NOTES:
            return
        query = [_HOLDERS_OK, ("forget", "1"), *(("bad", b) for b in bad)]

        async def note() -> None:
            try:
                if await self._ask(owner, url, query) is not None:
                    self._count(owner, "forget")
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                self._failed(owner, exc, "a note of failed holders")

        task = asyncio.ensure_future(note())
        self._notes.add(task)
        task.add_done_callback(self._notes.discard)

    def _holders_named(self, owner: str, header: str) -> list[str]:
        """The holders a 300 names that this node asks: at most the first
        :data:`MAX_HOLDERS_NAMED` names, each a healthy member other than this node and
        the owner (a name that is not, a stranger's address say, is never followed)."""
        healthy = set(self.membership.healthy())
        named: dict[str, None] = {}
        for name in header.split(",", MAX_HOLDERS_NAMED)[:MAX_HOLDERS_NAMED]:
            address = name.strip()
            if address in healthy and address != owner and not self.membership.is_self(address):
                named[address] = None
            elif address:
                log.debug("peer %s named holder %r, not a healthy member: skipped", owner, address)
        return list(named)

    async def _held(
        self,
        peer: str,
        route: str,
        cid: ChunkId,
        params: Mapping[str, str],
        *,
        role: str,
        failed: list[str] | None = None,
    ) -> memoryview | None:
        """Chunk ``cid`` from what ``peer`` holds (``held=1``), verified; None: it does
        not hold it, failed, or sent wrong bytes (counted against its health), and then
        ``peer`` goes into ``failed``; or it was not asked (a holder request finds no
        turn free: never reported as failed).

        The request says the role it asks ``peer`` in (``role=``), so that both ends
        count the bytes under the same one."""
        url = f"{self._scheme}://{peer}/v1/peer/{route}"
        query = {**params, "role": "holder" if role == "handoff" else role}
        try:
            answer = await self._ask(peer, url, query, holder="wait" in params, chunk=cid)
        except _NotAsked as exc:
            self._failed(peer, exc, f"a {role} request")
            log.debug("peer %s not asked for chunk %s as %s (%s)", peer, cid, role, exc)
            return None
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self._failed(peer, exc, f"a {role} request")
            log.info("peer %s did not give chunk %s as %s (%s)", peer, cid, role, exc)
            data = None
        else:
            data = (
                None
                if answer is None
                else await self._verified(peer, cid, answer[2], role=role, what="chunk")
            )
            if answer is not None and data is None:
                self.health.note(peer, ok=False, why=f"sent wrong bytes for chunk {cid} as {role}")
        if data is None and failed is not None:
            failed.append(peer)
        return data

    async def _verified(
        self, peer: str, cid: ChunkId, data: memoryview, *, role: str, what: str
    ) -> memoryview | None:
        """``data`` if it hashes to ``cid`` (counted as received from ``peer`` in
        ``role``), else None (counted as an integrity failure, dropped)."""
        got = await asyncio.to_thread(ChunkId.of, data)
        if got != cid:
            self._count(peer, "integrity")
            self.metrics.peer_integrity_failures.labels(peer).inc()
            log.warning(
                "peer %s sent %d bytes for %s %s that hash to %s; dropped them",
                peer,
                data.nbytes,
                what,
                cid,
                got,
            )
            return None
        self._count(peer, _OUTCOMES[role])
        self.metrics.peer_bytes.labels("in").inc(data.nbytes)
        self.metrics.peer_member_bytes.labels(peer, "in").inc(data.nbytes)
        metric_role = "holder" if role == "handoff" else role
        self.metrics.peer_role_bytes.labels(peer, "in", metric_role).inc(data.nbytes)
        return data

    async def fetch_page(self, cid: ChunkId) -> memoryview | None:
        """Dataset registry page ``cid`` (its id is the blake3 of its bytes, as a
        chunk's) from its owner (or the next ones), verified; None: fetch it yourself.
        The owner fetches it from the registry once for the cluster: no node asks the
        registry for a page's version (a page is named by its content)."""
        assert self.session is not None
        for owner, handoff in self._sources(bytes(cid)):
            if handoff:
                data = await self._held(owner, f"pages/{cid}", cid, _HELD, role="handoff")
                if data is not None:
                    return data
                continue
            url = f"{self._scheme}://{owner}/v1/peer/pages/{cid}"
            try:
                answer = await self._ask(owner, url, {})
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                self._failed(owner, exc, "a page request")
                log.info("peer %s did not give page %s (%s); trying the next", owner, cid, exc)
                continue
            if answer is None:
                continue
            data = await self._verified(owner, cid, answer[2], role="owner", what="page")
            if data is not None:
                return data
        return None

    async def fetch_locator(
        self, backend: str, key: str, version: str, index: int, placement: bytes
    ) -> tuple[str, ChunkId, memoryview] | None:
        """Chunk ``index`` of object ``backend/key`` at ``version``, from the owners of
        ``placement`` in order: (the owner, the id it states, the bytes), or None.

        The owner always serves it (no holders for objects: its readers read at once,
        and a holder named then would not have the chunk yet). The caller checks the
        bytes against the stated id before it keeps them.
        """
        assert self.session is not None
        for owner, handoff in self._sources(placement):
            url = f"{self._scheme}://{owner}/v1/peer/objects/{backend}/{quote(key)}"
            params = {"version": version, "index": str(index)} | (_HELD if handoff else {})
            if handoff:
                params |= {"role": "holder"}
            try:
                answer = await self._ask(owner, url, params)
                if answer is None:
                    continue
                stated = ChunkId.parse(answer[1].get("X-Chunkd-Chunk", ""))
                data = answer[2]
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                self._failed(owner, exc, "an object request")
                log.info("peer %s did not give %s/%s#%d (%s)", owner, backend, key, index, exc)
                continue
            self._count(owner, "handoff" if handoff else "ok")
            self.metrics.peer_bytes.labels("in").inc(data.nbytes)
            self.metrics.peer_member_bytes.labels(owner, "in").inc(data.nbytes)
            role = "holder" if handoff else "owner"
            self.metrics.peer_role_bytes.labels(owner, "in", role).inc(data.nbytes)
            return owner, stated, data
        return None

    async def _ask(
        self,
        owner: str,
        url: str,
        params: _Query,
        *,
        choices: bool = False,
        holder: bool = False,
        chunk: ChunkId | None = None,
    ) -> tuple[int, dict[str, str], memoryview] | None:
        """GET ``url`` from ``owner``: (status, headers, body) on 200 (or on 300, an
        owner's list of holders, when ``choices``), None on another status.

        At most ``per_peer_requests`` run at once to one member: a request waits for
        its turn first (:meth:`_slot`), at most ``request_timeout``, and is given up
        if the member went down meanwhile. A holder request (``holder``) has turns of
        its own and never waits for one: with none free it is not sent. (A holder
        waits on its own fetch, which may wait for a turn here; were holder requests
        to hold or wait for the turns that fetches need, holder waits could chain
        across nodes in a circle.) The wait adapts to the owner. It goes on while bytes arrive from
        it, for this request or any other, and while the owner answers its health
        probe (it may be fetching the chunk from a slow backend for everyone). After
        ``timeout`` with nothing from it the owner is probed at once; a failed probe
        ends the wait, so does the owner being marked down, and the hard cap. A
        refused or reset connection ends it at once. (A holder that waits on its own
        fetch sends nothing meanwhile but answers its probe: the wait goes on.)

        ``chunk``: the request is part of this node's own fetch of that chunk; its
        sending and each piece of its answer mark that fetch as progressing, which
        holder requests waiting on it go by (:meth:`fetching`).

        Raises:
            _NotAsked: it was not sent (no turn, or the member went down first).
            aiohttp.ClientError, OSError: the owner failed.
            OwnerSilentError: the owner went silent and failed its probe (already
                counted as a failed probe).
            TimeoutError: the owner is marked down, or the hard cap passed.
        """
        assert self.session is not None
        session = self.session
        health = self.health
        if holder:
            slot = self._slot(owner, self._holder_slots)
            if slot.locked():
                raise _NotAsked(f"no turn free for a holder request to peer {owner}")
            await slot.acquire()  # free: no wait
        else:
            slot = self._slot(owner, self._slots)
            try:
                async with asyncio.timeout(self.config.request_timeout):
                    await slot.acquire()
            except TimeoutError:
                raise _NotAsked(
                    f"no turn to ask peer {owner} within {self.config.request_timeout:g}s"
                ) from None
        if owner not in self.membership.healthy():
            slot.release()
            raise _NotAsked(f"peer {owner} went down while this node waited to ask it")
        heard = [time.monotonic()]  # when the owner last sent anything for this request
        own = None if chunk is None else self._fetching.get(chunk)
        if own is not None:
            own.heard = heard[0]  # sent: the fetch progresses (it may have waited a turn)

        def hear() -> None:
            heard[0] = health.hear(owner)
            if own is not None:
                own.heard = heard[0]

        async def call() -> tuple[int, dict[str, str], memoryview]:
            for attempt in range(2):
                try:
                    # the job the fetch is for pays on the owner (X-Chunkd-Job, -Name)
                    async with session.get(
                        url, params=params, allow_redirects=False, headers=headers_of()
                    ) as response:
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
            return time.monotonic() - max(heard[0], health.last_heard(owner))

        task = asyncio.ensure_future(call())
        # The turn is given back when the request ends, also when this wait is
        # cancelled before it (a cancelled task still has to close its connection).
        task.add_done_callback(lambda _: slot.release())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=max(0.01, timeout - silent()))
                if done:
                    break
                if owner not in self.membership.healthy():
                    raise TimeoutError(f"peer {owner} went down while it was asked")
                if silent() < timeout:
                    continue  # bytes came meanwhile
                # Silent for a whole timeout: busy with a slow backend for every node
                # (so wait on), or hung? Ask it directly rather than wait for
                # down_after probe rounds.
                alive = await health.alive(owner)
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
        # 204: a note's answer (forget=1), never a chunk's.
        if status in (200, 204) or (status == 300 and choices):
            return status, headers, body
        self._count(owner, f"http_{status}")
        if status >= 500:
            health.note(owner, ok=False, why=f"a request answered {status}")
        return None

    def _slot(self, peer: str, slots: dict[str, asyncio.Semaphore]) -> asyncio.Semaphore:
        """The turns of requests to ``peer`` in ``slots``: ``per_peer_requests`` at
        once. Made when first needed, one per member (those of addresses no longer
        members are forgotten as new ones are made)."""
        slot = slots.get(peer)
        if slot is None:
            if len(slots) >= len(self.membership.members):
                for gone in [a for a in slots if self.membership.get(a) is None]:
                    del slots[gone]
            slot = slots[peer] = asyncio.Semaphore(self.config.per_peer_requests)
        return slot

    def in_flight(self, peer: str) -> int:
        """Requests to ``peer`` running now (within ``per_peer_requests``, and as
        many again for holder requests)."""
        return sum(
            self.config.per_peer_requests - slots[peer]._value
            for slots in (self._slots, self._holder_slots)
            if peer in slots
        )

    def integrity_failure(self, owner: str, cid: ChunkId) -> None:
        """Count bytes from ``owner`` that did not hash to the ``cid`` it stated."""
        self._count(owner, "integrity")
        self.metrics.peer_integrity_failures.labels(owner).inc()
        log.warning("peer %s sent bytes that do not hash to chunk %s; dropped them", owner, cid)

    def _failed(self, owner: str, exc: BaseException, what: str) -> None:
        """Count a request to ``owner`` that failed, towards marking it down (one
        that was never sent is counted ``skipped``, and not against it)."""
        if isinstance(exc, _NotAsked):
            self._count(owner, "skipped")
            return
        self._count(owner, "error")
        if not isinstance(exc, OwnerSilentError):  # its failed probe was counted
            self.health.note(owner, ok=False, why=f"{what}: {reason(exc)}")

    def _count(self, peer: str, outcome: str) -> None:
        self.metrics.peer_requests.labels(peer, outcome).inc()
