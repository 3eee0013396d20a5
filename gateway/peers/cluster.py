"""This node's view of the cluster: the one object the daemon holds for its peers.

:class:`Peers` puts the rooms of the package together and runs their lifecycle
(the HTTP session, the health rounds); each job is done in its own module:
:mod:`.membership` (who the members are), :mod:`.health` (probes, up and down,
apart and rejoined), :mod:`.placement` (whom to ask for a key), :mod:`.client`
(asking them) and :mod:`.token` (the shared secret). The methods here only pass on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from chunkd.gateway.peers.client import PeerClient
from chunkd.gateway.peers.health import Health
from chunkd.gateway.peers.holders import MAX_NAMED, Holders
from chunkd.gateway.peers.membership import Membership, Peer
from chunkd.gateway.peers.token import authorized, read_token

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from chunkd.cache import ChunkId
    from chunkd.gateway.config import PeersConfig
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.tls import PeerTLS

__all__ = ["Peers"]

log = logging.getLogger("chunkd.gateway.peers")


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
        self.token = read_token(config.token_file)
        self._membership = Membership(config, metrics)
        self._health = Health(self._membership, config, "http" if tls is None else "https")
        self._client = PeerClient(
            config, self._membership, self._health, metrics, token=self.token, tls=tls
        )
        #: As a chunk's owner: who holds it (holders serve, :mod:`.holders`).
        self.holders = Holders(
            fanout=config.holder_fanout,
            ttl=config.holder_ttl,
            on_size=metrics.peer_holders_tracked.set,
        )
        #: Whether a chunk this node holds is a replica of another node's save (the
        #: replica store sets it): its answers to held requests count as role replica.
        self.is_replica: Callable[[ChunkId], bool] = lambda cid: False
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Open the HTTP session and start probing."""
        self._health.session = self._client.open()
        self._task = asyncio.create_task(self._watch())

    async def close(self) -> None:
        """Stop probing and close connections."""
        pending = [t for t in (self._task, *self._health.running()) if t is not None]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self._client.close()

    async def _watch(self) -> None:
        while True:
            try:
                await self._membership.refresh()
                await self._health.probe_all()
                self._membership.export()
            except Exception:  # a probe round must never stop the probing
                log.exception("peers: a health round failed")
            await asyncio.sleep(self.config.health_interval)

    # -- membership and health ---------------------------------------------------------

    @property
    def members(self) -> list[Peer]:
        """Every member, this node included."""
        return self._membership.members

    def healthy(self) -> list[str]:
        """The members currently up (this node always is)."""
        return self._membership.healthy()

    def is_self(self, address: str) -> bool:
        """Whether ``address`` is this node."""
        return self._membership.is_self(address)

    def trusts(self, ip: str) -> bool:
        """Whether a connection from ``ip`` comes from another member's address
        (:meth:`.membership.Membership.trusts`): the peers' connection budget."""
        return self._membership.trusts(ip)

    def note(self, address: str, *, ok: bool, why: str = "") -> None:
        """Count a probe (or a request) to ``address`` as passed or failed (``why``)."""
        self._health.note(address, ok=ok, why=why)

    def handing_off(self) -> bool:
        """Whether this node rejoined the cluster lately: the chunks it owns may be
        with the member ranked next after it (:meth:`.health.Health.handing_off`)."""
        return self._health.handing_off()

    # -- placement and fetching ----------------------------------------------------------

    def owners(self, key: bytes) -> list[str]:
        """The healthy members in rendezvous order for ``key``."""
        return self._client.owners(key)

    async def fetch_chunk(
        self, backend: str, cid: ChunkId, *, replicas: Sequence[str] = ()
    ) -> memoryview | None:
        """Chunk ``cid``, verified: from the members in ``replicas`` first (what they
        hold, ``held=1``, role replica), then from its owner or the holders the owner
        names, then the next owners; None: fetch it yourself (this node owns it, or
        every source failed). See :meth:`.client.PeerClient.fetch_chunk`."""
        return await self._client.fetch_chunk(backend, cid, replicas=replicas)

    async def holding(self, cid: ChunkId, fetch: Callable[[], Awaitable[memoryview]]) -> memoryview:
        """``await fetch()`` (this node's own fetch of chunk ``cid``, which keeps the
        bytes before it returns), while holder requests for ``cid`` wait on it
        (:meth:`.client.PeerClient.holding`)."""
        return await self._client.holding(cid, fetch)

    async def fetching(self, cid: ChunkId, *, wait: float) -> memoryview | None:
        """Chunk ``cid`` once this node's own fetch of it (in flight now) is done,
        ``wait`` seconds at most; None otherwise (a holder request's
        wait: :meth:`.client.PeerClient.fetching`)."""
        return await self._client.fetching(cid, wait=wait)

    async def fetch_page(self, cid: ChunkId) -> memoryview | None:
        """Dataset registry page ``cid`` from its owner (or the next ones), verified;
        None: fetch it yourself (:meth:`.client.PeerClient.fetch_page`)."""
        return await self._client.fetch_page(cid)

    async def fetch_locator(
        self, backend: str, key: str, version: str, index: int, placement: bytes
    ) -> tuple[str, ChunkId, memoryview] | None:
        """Chunk ``index`` of object ``backend/key`` at ``version``, from the owners of
        ``placement`` in order: (the owner, the id it states, the bytes), or None.

        The caller checks the bytes against the stated id before it keeps them.
        """
        return await self._client.fetch_locator(backend, key, version, index, placement)

    def integrity_failure(self, owner: str, cid: ChunkId) -> None:
        """Count bytes from ``owner`` that did not hash to the ``cid`` it stated."""
        self._client.integrity_failure(owner, cid)

    # -- serving ------------------------------------------------------------------------

    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header carries the peer token (constant time)."""
        return authorized(self.token, header)

    def member(self, address: str | None) -> str | None:
        """``address`` (an ``X-Chunkd-Peer``) if it is another member, else None."""
        if address is None or address == self.address or self._membership.get(address) is None:
            return None
        return address

    def owner_answer(
        self,
        cid: ChunkId,
        asker: str | None,
        *,
        direct: bool,
        bad: Sequence[str],
        follows: bool = True,
    ) -> list[str]:
        """As ``cid``'s owner, how to answer a peer's request for it: the holders to
        send it to (answer 300), or ``[]``: serve it (:meth:`.holders.Holders.answer`).

        Args:
            cid: the chunk asked for.
            asker: the request's ``X-Chunkd-Peer`` (it carried the peer token); added
                to the chunk's holders only if it is another member.
            direct: the asker's holders failed (``direct=1``): serve it.
            bad: the holders that failed it (``bad=``, at most
                :data:`.holders.MAX_NAMED` read): forgotten for this chunk.
            follows: the asker follows a 300 (``holders=1``); else (an older daemon)
                it is served and never added to the holders.
        """
        named = self.holders.answer(
            cid,
            self.member(asker) if follows else None,
            direct=direct or not follows,
            bad=bad[:MAX_NAMED],
        )
        answer = "holders" if named else "direct" if direct else "served"
        self.metrics.peer_holder_answers.labels(answer).inc()
        return named

    def forget_holders(self, cid: ChunkId, bad: Sequence[str]) -> None:
        """As ``cid``'s owner, forget its holders ``bad`` (``forget=1``: an asker got
        the chunk from a later holder after these failed it;
        :meth:`.holders.Holders.forget`)."""
        self.holders.forget(cid, bad[:MAX_NAMED])

    def role_of_held(self, cid: ChunkId) -> str:
        """The role this node plays serving a chunk it holds: replica or holder."""
        return "replica" if self.is_replica(cid) else "holder"

    def served(self, member: str | None, nbytes: int, role: str = "owner") -> None:
        """Count ``nbytes`` served to ``member`` (its ``X-Chunkd-Peer``) in ``role``
        (owner, holder, replica); only members are counted, so a made-up name adds no
        series."""
        self.metrics.peer_bytes.labels("out").inc(nbytes)
        if (member := self.member(member)) is not None:
            self.metrics.peer_member_bytes.labels(member, "out").inc(nbytes)
            self.metrics.peer_role_bytes.labels(member, "out", role).inc(nbytes)

    def stats(self) -> dict[str, Any]:
        """For /v1/stats and ``chunkd stats``: the members, and per member the bytes
        received from it (``received``) and served to it (``served``) by the role
        the sender played (owner, holder, replica), from ``chunkd_peer_role_bytes``."""
        roles: dict[tuple[str, str], dict[str, int]] = {}
        for family in self.metrics.peer_role_bytes.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    labels = sample.labels
                    by_role = roles.setdefault((labels["peer"], labels["direction"]), {})
                    by_role[labels["role"]] = int(sample.value)

        def of(address: str, direction: str) -> dict[str, int]:
            got = roles.get((address, direction), {})
            return {role: got.get(role, 0) for role in ("owner", "holder", "replica")}

        return {
            "self": self.address,
            "members": [
                {
                    "address": p.address,
                    "healthy": p.healthy or p.address == self.address,
                    "received": of(p.address, "in"),
                    "served": of(p.address, "out"),
                    "in_flight": self._client.in_flight(p.address),
                }
                for p in self._membership.members
            ],
            "healthy": len(self.healthy()),
            "holders_tracked": len(self.holders),
            "tls": self.tls is not None,
        }
