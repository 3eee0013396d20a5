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
                                         states the id in X-Chunkd-Chunk
    ...?held=1 (any route)              only what the node holds in its tiers, or
                                         404 NotHeld at once: never fetched for the
                                         asker (a rejoined node's handoff)

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
import logging
import time
from typing import TYPE_CHECKING, Final
from urllib.parse import quote

import aiohttp

from chunkd import faults
from chunkd.cache import ChunkId
from chunkd.errors import OwnerSilentError
from chunkd.gateway.peers.health import reason
from chunkd.gateway.peers.placement import Source, rank_owners, sources

if TYPE_CHECKING:
    from chunkd.gateway.config import PeersConfig
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.peers.health import Health
    from chunkd.gateway.peers.membership import Membership
    from chunkd.gateway.tls import PeerTLS

__all__ = ["PeerClient"]

log = logging.getLogger("chunkd.gateway.peers")

# A handoff's query: answer from what you hold, or 404 at once (see the module docstring).
_HELD: Final = {"held": "1"}


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
        """Close the connections."""
        if self.session is not None:
            await self.session.close()

    def owners(self, key: bytes) -> list[str]:
        """The healthy members in rendezvous order for ``key``."""
        return rank_owners(self.membership.healthy(), key)

    def _sources(self, key: bytes) -> list[Source]:
        return sources(
            self.owners(key), self.membership.address, handing_off=self.health.handing_off()
        )

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
        assert self.session is not None
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
        assert self.session is not None
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
        assert self.session is not None
        session = self.session
        health = self.health
        heard = [time.monotonic()]  # when the owner last sent anything for this request

        def hear() -> None:
            heard[0] = health.hear(owner)

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
            return time.monotonic() - max(heard[0], health.last_heard(owner))

        task = asyncio.ensure_future(call())
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
        if status != 200:
            self._count(owner, f"http_{status}")
            if status >= 500:
                health.note(owner, ok=False, why=f"a request answered {status}")
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
            self.health.note(owner, ok=False, why=f"{what}: {reason(exc)}")

    def _count(self, peer: str, outcome: str) -> None:
        self.metrics.peer_requests.labels(peer, outcome).inc()
