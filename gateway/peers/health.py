"""Health: which members are up, and whether this node is apart from the others.

Every member is probed (``GET /healthz``) every ``health_interval``; a member is
marked down after ``down_after`` failed probes in a row and up again after
``up_after`` passes. A member that fails a chunk request counts as a failed probe
too (:meth:`Health.note`), and one that went silent is probed at once
(:meth:`Health.alive`, one probe per member at a time, which callers share).

Rejoining. A node is *apart* when more than half of the other members it has seen
up are down in its view (its link failed: a partition, a pulled cable). Meanwhile
the others put its keys on the member ranked next after it, which fetched and kept
them. So for ``_HANDOFF_WINDOW`` after it rejoins (:meth:`Health.handing_off`), a
chunk this node owns but lacks is asked of that member (a *handoff*,
:func:`.placement.sources`) before the backend.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Final

import aiohttp

from chunkd.cache.singleflight import SingleFlight

if TYPE_CHECKING:
    from chunkd.gateway.config import PeersConfig
    from chunkd.gateway.peers.membership import Membership

__all__ = ["Health", "reason"]

log = logging.getLogger("chunkd.gateway.peers")

# A probe waits at most this long (and never longer than [peers] timeout): /healthz
# answers from memory, so a peer that takes longer is in trouble whatever the setting.
_HEALTH_TIMEOUT: Final = 2.0
# How long after rejoining the cluster this node asks the member ranked next for the
# chunks it owns: the others read those through that member while this node was
# apart, and a job that lost a node restarts from its checkpoint within minutes.
_HANDOFF_WINDOW: Final = 600.0


class Health:
    """The probes of the other members, and what they and the requests say.

    Args:
        membership: the members, whose :class:`.membership.Peer` records this keeps.
        config: the ``[peers]`` section (enabled).
        scheme: ``http`` or ``https`` (with ``[peers]`` TLS).
    """

    def __init__(self, membership: Membership, config: PeersConfig, scheme: str) -> None:
        self.membership = membership
        self.config = config
        self._scheme = scheme
        #: The peers' HTTP session, opened by :meth:`Peers.start` (probes share it).
        self.session: aiohttp.ClientSession | None = None
        self._probes: SingleFlight[str, bool] = SingleFlight()  # one probe per peer at a time
        self._heard: dict[str, float] = {}  # when each peer last sent us anything
        # Members seen up (a passed probe while healthy): only those count towards this
        # node being apart (members that never came up, at a cold start, do not).
        self._seen_up: set[str] = set()
        self._apart = False
        self._rejoined_at: float | None = None  # monotonic; see handing_off()

    def running(self) -> list[asyncio.Future[bool]]:
        """The probes in flight (to cancel at close)."""
        return self._probes.running()

    async def probe_all(self) -> None:
        """Probe every other member once (a health round)."""
        await asyncio.gather(*(self.alive(p.address) for p in self.membership.others()))

    def hear(self, address: str) -> float:
        """Note that ``address`` sent this node something now; returns now."""
        now = self._heard[address] = time.monotonic()
        return now

    def last_heard(self, address: str) -> float:
        """When (monotonic) ``address`` last sent this node anything; 0: never."""
        return self._heard.get(address, 0.0)

    async def alive(self, address: str) -> bool:
        """Probe ``address`` now (one probe at a time per peer; callers share it)."""
        try:
            return await self._probes.run(address, lambda: self._health(address))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and not task.cancelling():
                return False  # the probe was stopped (the daemon is closing), not us
            raise

    async def _health(self, address: str) -> bool:
        assert self.session is not None
        try:
            async with self.session.get(
                f"{self._scheme}://{address}/healthz",
                timeout=aiohttp.ClientTimeout(total=min(_HEALTH_TIMEOUT, self.config.timeout)),
            ) as response:
                ok = response.status == 200
                why = "" if ok else f"/healthz answered {response.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            ok, why = False, f"/healthz: {reason(exc)}"
        if ok:
            self.hear(address)
        self.note(address, ok=ok, why=why)
        return ok

    def note(self, address: str, *, ok: bool, why: str = "") -> None:
        """Count a probe (or a request) to ``address`` as passed or failed (``why``)."""
        peer = self.membership.get(address)
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
        self.membership.export()

    def _track_apart(self) -> None:
        """Note when this node falls apart from the cluster and when it rejoins."""
        seen = [p for p in self.membership.others() if p.address in self._seen_up]
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

    def apart(self) -> bool:
        """Whether this node is apart from the cluster now: more than half of the
        other members it has seen up are down in its view."""
        return self._apart

    def handing_off(self) -> bool:
        """Whether this node rejoined the cluster within ``_HANDOFF_WINDOW``: the
        chunks it owns may be with the member ranked next after it."""
        return (
            not self._apart
            and self._rejoined_at is not None
            and time.monotonic() - self._rejoined_at < _HANDOFF_WINDOW
        )


def reason(exc: BaseException) -> str:
    """One line on why a request to a peer failed (TLS refusals included)."""
    cause = exc
    while not str(cause) and cause.__cause__ is not None:
        cause = cause.__cause__
    text = str(cause).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
