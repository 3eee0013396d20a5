"""Replicas: copies of a save's chunks in other nodes' RAM, so that a node replaced
after a crash restores its part from its peers, not from the backend.

``docs/replicas.md`` is the user's page; the protocol, written down once, is this::

    placement  replica_targets(members, save_id, saver): every member (up or down)
               ranked by HRW of ``save_id 0x00 saver``, leaving out the saver and
               every member of its failure domain (its ``rack=`` label; a member
               without one is a domain of its own)
    push       for each chunk of the saver's part, in the background once the part
               is local: PUT /v1/peer/replicas/{backend}/{id}?save=S&saver=ADDR&seq=N to
               the first K targets of that order that accept (a down, full or
               failing one: the next); body = the chunk, at most MAX_CHUNK_BYTES
    receive    refused before the body is read when the sender is not a member, is
               not the saver it names or does not connect from that member's
               address (401 refused), has MAX_IN_FLIGHT_PER_SENDER
               pushes in flight (429 refused), names no length or more than a chunk
               (411/413 invalid), or would take the store past replica_budget (507
               full); else the body is read, verified against its id (422 invalid),
               and kept in the RAM tier, pinned (200 stored)
    note       POST /v1/peer/replicas/saves?save=S&saver=ADDR&seq=N&state=replicated
               once every chunk of S went out (to each target that took one), and
               &state=remote once S is committed and its pushes are over (to every
               other member when every chunk got K copies, else to S's targets)
    lifetime   seq (SaveRequest.seq, ns at the save, one per save on the saver: its
               ranks' parts share it; never below the saver's last + 1) orders one
               saver's saves (a receiver keeps the largest a save's parts gave); a save
               is held on a node until a later save of that saver (larger seq) is
               committed and replicated (on this node or others): then every save
               of that saver with a smaller seq is let go (never the save noted);
               a late note or push of an older save lets nothing go and is not kept
               (the saver counts such a push ``late``, not ``ok``); at most
               MAX_SAVES_PER_SAVER saves of one saver are held (the smallest seq
               goes), a saver no longer a member is let go after holder_ttl, and
               replica_budget bounds them
    restore    a node loading a part whose document names its saver (``node``) and
               ``replicas`` K asks the first K + RESTORE_EXTRA targets of the same
               order, as holder requests (``held=1``: an answer from what the node
               holds, or a cheap 404), before the chunk's owner and the backend

A replica answers only by chunk id: a restore's manifest always comes from the
backend (or this node's own jobs), so an uncommitted save's replicas never make it
restorable.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final
from urllib.parse import quote

import aiohttp

from chunkd.cache import MAX_CHUNK_BYTES, Chunk, ChunkId, ChunkLease
from chunkd.gateway.config.addresses import split_listen
from chunkd.gateway.peers.placement import rank_owners

if TYPE_CHECKING:
    from chunkd.cache import ChunkCache
    from chunkd.gateway.metrics import Metrics
    from chunkd.gateway.peers import Peers
    from chunkd.gateway.peers.membership import Peer

__all__ = [
    "MAX_IN_FLIGHT_PER_SENDER",
    "MAX_SAVES_PER_SAVER",
    "RESTORE_EXTRA",
    "PushReport",
    "ReplicaRefused",
    "ReplicaStore",
    "Replicas",
    "replica_targets",
    "restore_sources",
]

log = logging.getLogger("chunkd.gateway.peers")

#: replica pushes one sender may have in flight on a receiver; 429 past it
MAX_IN_FLIGHT_PER_SENDER: Final = 4
#: saves of one saver a receiver holds at once; the oldest is let go past it
MAX_SAVES_PER_SAVER: Final = 8
#: targets a restore asks beyond K (a full or down target's chunks went to the next)
RESTORE_EXTRA: Final = 2
#: pushes this node has in flight for one save, and to one target (all saves)
_PUSHES_PER_SAVE: Final = 8
_PUSHES_PER_TARGET: Final = MAX_IN_FLIGHT_PER_SENDER
#: tries of one push refused with 429 (busy) before the target counts as failed
_BUSY_TRIES: Final = 5


def replica_targets(members: Iterable[Peer], save_id: str, saver: str) -> list[str]:
    """Where ``saver``'s replicas of save ``save_id`` go, in order: every member
    (up or down) by HRW of ``save_id 0x00 saver``, without the saver and the members
    of its failure domain (:attr:`.membership.Peer.domain`)."""
    by_address = {p.address: p for p in members}
    own = by_address.get(saver)
    domain = own.domain if own is not None else f"node={saver}"
    key = save_id.encode() + b"\0" + saver.encode()
    return [
        a
        for a in rank_owners(list(by_address), key)
        if a != saver and by_address[a].domain != domain
    ]


def restore_sources(members: Iterable[Peer], save_id: str, saver: str, k: int) -> list[str]:
    """The members a restore of ``saver``'s part of ``save_id`` (saved with ``k``
    replicas) asks first: the first ``k`` + :data:`RESTORE_EXTRA` replica targets."""
    if k <= 0:
        return []
    return replica_targets(members, save_id, saver)[: k + RESTORE_EXTRA]


# -- the receiving side ------------------------------------------------------------------


class ReplicaRefused(Exception):
    """A push this node does not take: the HTTP status, the outcome counted
    (``replica_received{outcome}``) and why."""

    def __init__(self, status: int, outcome: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.outcome = outcome


@dataclass
class _Held:
    lease: ChunkLease
    size: int
    #: the (saver, save) pairs that hold it
    saves: set[tuple[str, str]] = field(default_factory=set)


@dataclass
class _Save:
    #: the saver's order of its saves (the save request's ``seq``): later is larger
    seq: int
    chunks: set[ChunkId] = field(default_factory=set)
    replicated: bool = False
    remote: bool = False


class ReplicaStore:
    """Other nodes' replicas in this node's RAM tier, pinned, within a byte budget.

    Args:
        cache: the daemon's cache (the RAM tier keeps the chunks; a held lease pins each).
        metrics: the daemon's metrics.
        budget: ``[peers] replica_budget``: bytes of replicas held and being received.
        is_member: whether an address is another member of the cluster.
        grace: seconds the replicas of a saver that is no longer a member stay
            (``[peers] holder_ttl``); then they are let go (:meth:`sweep`).
    """

    def __init__(
        self,
        cache: ChunkCache,
        metrics: Metrics,
        budget: int,
        is_member: Callable[[str], bool],
        *,
        grace: float = 600.0,
    ) -> None:
        self.cache = cache
        self.metrics = metrics
        self.budget = budget
        self.grace = grace
        # The RAM tier takes no chunk larger than the cache's chunk_bytes: such a push
        # is refused before its body, not once it is read and hashed.
        self.max_chunk = min(MAX_CHUNK_BYTES, cache.config.chunk_bytes)
        self._is_member = is_member
        self._held: dict[ChunkId, _Held] = {}
        self._saves: dict[str, dict[str, _Save]] = {}
        #: per saver, its newest save known whole (replicated and remote): its seq, its id
        self._whole: dict[str, tuple[int, str]] = {}
        #: savers with replicas here that are no longer members, since when (monotonic)
        self._gone: dict[str, float] = {}
        self._used = 0
        self._reserved = 0
        self._in_flight: dict[str, int] = {}
        metrics.replica_budget.set(budget)
        metrics.replica_bytes.set(0)

    @property
    def used(self) -> int:
        """Bytes of replicas held now."""
        return self._used

    def is_member(self, address: str) -> bool:
        """Whether ``address`` is another member (only members push and note)."""
        return self._is_member(address)

    def holds(self, cid: ChunkId) -> bool:
        """Whether ``cid`` is held as a replica (a holder answer's role is ``replica``)."""
        return cid in self._held

    def stats(self) -> dict[str, object]:
        """For /v1/stats and the dashboard."""
        return {
            "budget": self.budget,
            "bytes": self._used,
            "chunks": len(self._held),
            "savers": {s: list(saves) for s, saves in self._saves.items()},
            "reserved": self._reserved,
        }

    def admit(self, sender: str | None, saver: str, length: int | None) -> Callable[[], None]:
        """Check a push before its body is read; returns the release of its slot and
        of the bytes it reserved (call it once the push is over).

        Raises:
            ReplicaRefused: the push is not taken (see the module docstring).
        """
        if sender is None or not self._is_member(sender):
            raise ReplicaRefused(
                401, "refused", "replica pushes come from members only (X-Chunkd-Peer)"
            )
        if saver != sender:
            raise ReplicaRefused(
                401, "refused", f"a member pushes its own replicas; saver={saver[:80]!r}"
            )
        if length is None:
            raise ReplicaRefused(411, "invalid", "a replica push states its Content-Length")
        if not 0 <= length <= self.max_chunk:
            raise ReplicaRefused(
                413, "invalid", f"a replica is one chunk, at most {self.max_chunk} bytes here"
            )
        if self._in_flight.get(sender, 0) >= MAX_IN_FLIGHT_PER_SENDER:
            raise ReplicaRefused(
                429,
                "refused",
                f"{MAX_IN_FLIGHT_PER_SENDER} replica pushes of {sender} are in flight here",
            )
        if self._used + self._reserved + length > self.budget:
            self.sweep()  # a gone saver's replicas make room first
        if self._used + self._reserved + length > self.budget:
            raise ReplicaRefused(
                507,
                "full",
                f"this node's replica budget ({self.budget} bytes) is full; push to the next",
            )
        self._in_flight[sender] = self._in_flight.get(sender, 0) + 1
        self._reserved += length
        done = False

        def release() -> None:
            nonlocal done
            if done:
                return
            done = True
            self._reserved -= length
            left = self._in_flight[sender] - 1
            if left:
                self._in_flight[sender] = left
            else:
                del self._in_flight[sender]

        return release

    async def store(
        self, saver: str, save: str, cid: ChunkId, body: memoryview, *, seq: int
    ) -> bool:
        """Verify ``body`` against ``cid`` and keep it for ``saver``'s ``save`` (its
        ``seq``), after :meth:`admit`, whose reservation covers it. False: not kept,
        since the save is older than one of the saver's already whole here (a late
        push), or was let go while the chunk went into the RAM tier.

        Raises:
            ReplicaRefused: the bytes are not the chunk (422), or the RAM tier declined
                them (507 full).
        """
        got = await asyncio.to_thread(ChunkId.of, body)
        if got != cid:
            raise ReplicaRefused(
                422, "invalid", f"the {body.nbytes} bytes pushed hash to {got}, not {cid}"
            )
        if self._late(saver, save, seq):
            return False
        held = self._held.get(cid)
        lease = None
        if held is None:
            lease = await self.cache.ram.put_leased(Chunk.trusted(cid, body))
            if lease is None:
                raise ReplicaRefused(
                    507, "full", "this node's RAM tier is full of pinned chunks; push to the next"
                )
        # Looked up after the await: a note may have let the save go meanwhile, or
        # another push of the chunk landed.
        if self._late(saver, save, seq):
            if lease is not None:
                lease.release()
            return False
        entry = self._save(saver, save, seq)
        held = self._held.get(cid)
        if held is None:
            assert lease is not None
            held = self._held[cid] = _Held(lease, body.nbytes)
            self._used += body.nbytes
            self.metrics.replica_bytes.set(self._used)
        elif lease is not None:
            lease.release()
        held.saves.add((saver, save))
        entry.chunks.add(cid)
        return True

    def note(self, saver: str, save: str, *, replicated: bool, remote: bool, seq: int) -> None:
        """The saver says ``save`` (its ``seq``) went out whole (``replicated``) or is
        committed (``remote``); the saves this makes unneeded are let go.

        Once a save is both (here, or elsewhere: a ``remote`` note for a save this
        node holds nothing of comes only once every chunk of it got its copies),
        every save of that saver with a smaller ``seq`` is let go, committed or not:
        the newer committed save is the one a restore wants. A late note of a save
        older than one already whole here lets nothing go.

        Several ranks on one node save their parts of one save under one ``save``:
        their pushes and notes all name it, and it is never let go by its own notes
        (its seq is the largest any of them gave: the saver gives them one).
        """
        if self._late(saver, save, seq):
            return
        saves = self._saves.get(saver)
        entry = None if saves is None else saves.get(save)
        if entry is None and replicated:
            entry = self._save(saver, save, seq)
        if entry is not None:
            entry.seq = max(entry.seq, seq)
            entry.replicated |= replicated
            entry.remote |= remote
            whole = entry.replicated and entry.remote
            seq = entry.seq
        else:
            whole = remote
        if not whole:
            return
        if seq >= self._whole.get(saver, (-1, ""))[0]:
            self._whole[saver] = (seq, save)
        for name, older in list(self._saves.get(saver, {}).items()):
            if name != save and older.seq < seq:
                self._let_go(saver, name)

    def _late(self, saver: str, save: str, seq: int) -> bool:
        """Whether a push or note of ``saver``'s ``save`` (``seq``) comes after a later
        save of that saver was whole here (never: the save that is whole itself)."""
        whole = self._whole.get(saver)
        return whole is not None and seq < whole[0] and save != whole[1]

    def sweep(self, now: float | None = None) -> None:
        """Let go of the replicas of savers that have not been members for
        :attr:`grace` seconds (a replaced node under a new address never notes its
        saves again; its restore asks by the old address, which is gone)."""
        now = time.monotonic() if now is None else now
        for saver in list(self._saves):
            if self._is_member(saver):
                self._gone.pop(saver, None)
            elif now - self._gone.setdefault(saver, now) >= self.grace:
                log.info("replicas: %s is no longer a member; letting its replicas go", saver)
                for save in list(self._saves.get(saver, ())):
                    self._let_go(saver, save)
                self._gone.pop(saver, None)
                self._whole.pop(saver, None)
        for saver in list(self._whole):
            if saver not in self._saves and not self._is_member(saver):
                del self._whole[saver]

    def _save(self, saver: str, save: str, seq: int) -> _Save:
        saves = self._saves.setdefault(saver, {})
        entry = saves.get(save)
        if entry is None:
            entry = saves[save] = _Save(seq)
            while len(saves) > MAX_SAVES_PER_SAVER:
                self._let_go(saver, min(saves, key=lambda name: saves[name].seq))
        else:
            entry.seq = max(entry.seq, seq)  # the largest any part of it gave
        return entry

    def _let_go(self, saver: str, save: str) -> None:
        saves = self._saves.get(saver)
        if saves is None:
            return
        entry = saves.pop(save, None)
        if not saves:
            del self._saves[saver]
        if entry is None:
            return
        for cid in entry.chunks:
            held = self._held.get(cid)
            if held is None:
                continue
            held.saves.discard((saver, save))
            if not held.saves:
                del self._held[cid]
                self._used -= held.size
                held.lease.release()  # the RAM tier may evict it now, as any cached chunk
        self.metrics.replica_bytes.set(self._used)
        log.info("replicas: let go of save %s of %s", save, saver)

    def close(self) -> None:
        """Release every held replica."""
        for saver in list(self._saves):
            for save in list(self._saves.get(saver, ())):
                self._let_go(saver, save)


# -- the saving side -------------------------------------------------------------------


@dataclass
class PushReport:
    """What became of one save's pushes."""

    wanted: int
    chunks: int = 0
    #: the save's seq (its notes carry it)
    seq: int = 0
    #: chunks with ``wanted`` copies, and the fewest copies any chunk got
    whole: int = 0
    fewest: int = 0
    #: targets that took at least one chunk
    targets: list[str] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        """``full`` (K copies of every chunk), ``partial`` or ``none``."""
        if self.chunks == self.whole:
            return "full"
        return "none" if not self.targets else "partial"

    def describe(self) -> dict[str, object]:
        """What a save's handle says of its replicas."""
        return {
            "wanted": self.wanted,
            "chunks": self.chunks,
            "whole": self.whole,
            "fewest": self.fewest,
            "outcome": self.outcome,
            "targets": list(self.targets),
        }


class Replicas:
    """Both sides of replication for the daemon: :attr:`store` (what other nodes push
    here) and :meth:`push` (this node's saves to the others).

    Args:
        peers: the cluster (members, labels, health, token, TLS).
        cache: the daemon's cache.
        metrics: the daemon's metrics.
    """

    def __init__(self, peers: Peers, cache: ChunkCache, metrics: Metrics) -> None:
        self.peers = peers
        self.metrics = metrics
        self.default = peers.config.replicas
        self.store = ReplicaStore(
            cache,
            metrics,
            peers.config.replica_budget,
            lambda a: a != peers.address and any(p.address == a for p in peers.members),
            grace=peers.config.holder_ttl,
        )
        # Answers to held requests for a replica count as role replica.
        peers.is_replica = self.store.holds
        self._scheme = "http" if peers.tls is None else "https"
        self._session: aiohttp.ClientSession | None = None
        self._per_target: dict[str, asyncio.Semaphore] = {}

    @property
    def address(self) -> str:
        """This node's address (a part's ``node``)."""
        return self.peers.address

    def targets(self, save_id: str) -> list[str]:
        """Where this node's replicas of ``save_id`` go, in order."""
        return replica_targets(self.peers.members, save_id, self.peers.address)

    def sources(self, save_id: str, saver: str, k: int) -> list[str]:
        """The members a restore asks first for ``saver``'s part of ``save_id``."""
        return [
            a
            for a in restore_sources(self.peers.members, save_id, saver, k)
            if a != self.peers.address
        ]

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            tls = self.peers.tls
            self._session = aiohttp.ClientSession(
                headers={
                    "Authorization": f"Bearer {self.peers.token}",
                    "X-Chunkd-Peer": self.peers.address,
                },
                timeout=aiohttp.ClientTimeout(
                    total=self.peers.config.request_timeout, connect=self.peers.config.timeout
                ),
                # Pushes and notes reuse kept-alive connections (a push's body no
                # longer counts against the next request's head bound: 09a623c), from
                # this node's own address: a receiver takes a push or note in a
                # member's name only from that member's address.
                connector=aiohttp.TCPConnector(
                    ssl=tls.client if tls is not None else True, local_addr=self._local_addr()
                ),
            )
        return self._session

    def _local_addr(self) -> tuple[str, int] | None:
        """Where pushes and notes leave from: this node's address's IP (None: a host
        name, left to the kernel)."""
        try:
            host = split_listen(self.peers.address)[0]
            ipaddress.ip_address(host)
        except ValueError:
            return None
        return host, 0

    async def close(self) -> None:
        """Close the push connections and let go of every held replica."""
        if self._session is not None:
            await self._session.close()
        self.store.close()

    async def push(
        self,
        backend: str,
        save_id: str,
        chunks: Mapping[ChunkId, int],
        source: Callable[[ChunkId], Awaitable[ChunkLease]],
        k: int,
        *,
        seq: int,
    ) -> PushReport:
        """Push every chunk of ``chunks`` to ``k`` targets that take it (the next one
        when a target is down, full or failing), then tell each target that took any
        that the save (``seq``: its order among this node's saves) went out whole
        (``state=replicated``). A chunk ``source`` fails to read fails the push: the
        other chunks' pushes are cancelled (their leases let go) before it raises."""
        report = PushReport(wanted=k, chunks=len(chunks), seq=seq)
        order = self.targets(save_id)
        healthy = set(self.peers.healthy())
        # A target that is down, or refused this save (full, failed), is skipped for
        # the rest of it: the next in the order takes its chunks.
        skipped = {a for a in order if a not in healthy}
        took: dict[str, int] = {}
        slots = asyncio.Semaphore(_PUSHES_PER_SAVE)
        copies: list[int] = []

        async def replicate(cid: ChunkId) -> None:
            async with slots:
                got = 0
                lease = await source(cid)
                with lease:
                    body = lease.view()
                    for target in order:
                        if got >= k:
                            break
                        if target in skipped:
                            continue
                        outcome = await self._put(target, backend, save_id, seq, cid, body)
                        self.metrics.replica_pushes.labels(target, outcome).inc()
                        if outcome == "ok":
                            got += 1
                            took[target] = took.get(target, 0) + 1
                        else:
                            skipped.add(target)
                copies.append(got)

        tasks = [asyncio.ensure_future(replicate(c)) for c in chunks]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        report.whole = sum(1 for n in copies if n >= k)
        report.fewest = min(copies, default=k)
        report.targets = [a for a in order if a in took]
        self.metrics.replica_saves.labels(report.outcome).inc()
        await self.note(report.targets, save_id, "replicated", seq=seq)
        return report

    async def committed(self, save_id: str, report: PushReport) -> None:
        """Say that ``save_id`` is committed, its pushes over (``report``): to every
        other member when each chunk got its copies (they let this node's older
        saves go), else only to the targets that took some."""
        if report.outcome == "full":
            targets = [p.address for p in self.peers.members if p.address != self.address]
        else:
            targets = report.targets
        await self.note(targets, save_id, "remote", seq=report.seq)

    async def note(self, targets: Iterable[str], save_id: str, state: str, *, seq: int) -> None:
        """Tell ``targets`` that this node's ``save_id`` (its ``seq``) is ``state``
        (best effort: a target that misses it lets the save go with a later one)."""
        session = self._open()
        saver = quote(self.peers.address, safe="")

        async def tell(target: str) -> None:
            url = (
                f"{self._scheme}://{target}/v1/peer/replicas/saves"
                f"?save={quote(save_id, safe='')}&saver={saver}&state={state}&seq={seq}"
            )
            try:
                async with session.post(url) as response:
                    answer = await response.read()
                    if response.status != 200:
                        log.warning(
                            "replicas: %s answered %d to the note that %s is %s: %s",
                            target,
                            response.status,
                            save_id,
                            state,
                            answer[:200],
                        )
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                log.info(
                    "replicas: could not tell %s that %s is %s (%s)", target, save_id, state, exc
                )

        await asyncio.gather(*(tell(t) for t in targets))

    async def _put(
        self, target: str, backend: str, save_id: str, seq: int, cid: ChunkId, body: memoryview
    ) -> str:
        """One push: ``ok``, ``full``, ``late`` (answered ``kept: false``) or ``failed``."""
        session = self._open()
        url = (
            f"{self._scheme}://{target}/v1/peer/replicas/{quote(backend, safe='')}/{cid}"
            f"?save={quote(save_id, safe='')}&saver={quote(self.peers.address, safe='')}"
            f"&seq={seq}"
        )
        slot = self._per_target.setdefault(target, asyncio.Semaphore(_PUSHES_PER_TARGET))
        for attempt in range(_BUSY_TRIES):
            async with slot:
                try:
                    async with session.put(url, data=body, expect100=True) as response:
                        answer = await response.read()
                        status = response.status
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    log.info("replicas: push of %s to %s failed (%s)", cid, target, exc)
                    return "failed"
            if status == 200:
                # Taken, but not kept: a later save of this node is whole there (this
                # one is superseded, or this node's clock went back): not a copy.
                return "ok" if _kept(answer) else "late"
            if status == 507:
                return "full"
            if status != 429:
                log.warning("replicas: %s refused chunk %s with %d", target, cid, status)
                return "failed"
            await asyncio.sleep(0.05 * (attempt + 1))  # its bound for this node: wait a turn
        return "failed"


def _kept(answer: bytes) -> bool:
    """Whether a push's 200 answer keeps the chunk: all but an explicit
    ``"kept": false`` (a receiver that says nothing of it kept it)."""
    try:
        doc = json.loads(answer)
    except ValueError:
        return True
    return not (isinstance(doc, dict) and doc.get("kept") is False)
