"""A discrete-event model of one checkpoint restored on N nodes at once (issue 29).

``python -m bench.fanout_sim --nodes N [--design owner|holders|both] ...`` prints, per
design, the slowest node's restore time against ``size / link``, the backend's bytes
against the checkpoint's, and the most any node served against ``N - 1`` times its
owner share (today's design); ``--json FILE`` writes the same figures.
``python -m bench.fanout_sim --preset lab4|lab8|n100|n1000`` runs the setups that
docs/peers.md ("The model for 1,000 nodes") quotes (N=100 and N=1,000 with ``--scale 8``
or ``16`` and ``--sliding``: a full-size run is 25.6 million transfers);
``--calibrate WORK`` measures the CPU costs.

What it models, and how:

* **Links** are fluids. Every transfer (a chunk from the backend or from a peer, or a
  client's copy out of the chunks) is a flow through a few resources: the sender's
  uplink (or the backend's egress), the receiver's downlink, and CPU. Rates are shared
  at every step so that no resource is oversubscribed and every flow is held back by
  at least one resource it uses (equal shares first, then each flow scaled up by the
  slack of its tightest resource, a few rounds: TCP's sharing, roughly).
* **CPU** is a per-byte cost in core-seconds: a daemon receiving a chunk (aiohttp's
  read, the blake3 check against its id, the copy into its RAM tier), a daemon serving
  one (aiohttp's send), the S3 server sending one (moto), and the client's copy out of
  the chunk's memfd. They draw on one pool of ``cores`` shared by every process (the
  lab: one 2-core VM runs S3, N daemons and the readers) or on each node's own
  (``shared=False``), and one process (a daemon's event loop, moto) uses at most
  ``process_cores``. The costs are measured on this machine (``--calibrate``), never
  fitted to the lab's times.
* **Owners** are rendezvous hashing's: each chunk's owner is an independent uniform
  pick among the members, which is what HRW with a good hash gives.
* **Holders** (``design="holders"``) follow docs/peers.md's protocol: an owner serves
  a chunk itself while it has sent it fewer than ``holder_fanout`` times, then answers
  with at most ``holders_per_answer`` holders (members it served or sent on, fewest
  askers first, each below ``holder_fanout`` askers); either way the asker joins the
  list. The asker asks those holders in turn (a holder whose own fetch of the chunk is
  in flight waits for it, then sends), then the owner directly. ``design="owner"`` is
  today's protocol: the owner serves every asker. ``design="alone"``: no peers, every
  node reads the backend.
* **Requests**: each node's reader asks for its chunks in its own order (starting at an
  offset of its own, or all at one offset: ``same_offset``, which is what the lab does,
  since its readers share one host name), ``window`` chunks at a time, either in
  batches that wait for each other (today's client: 64 a request, copies after each)
  or as a sliding window; a node has at most ``per_peer_requests`` requests in flight
  to any one member (a request waiting on its server's own fetch keeps its place); each
  request costs ``rtt`` before its bytes flow. An owner fetches a chunk from the backend
  once (single flight), for its own reader and for every asker.

The model leaves out TCP's slow start and loss, disk tiers (everything fits in RAM)
and failures. Times are the model's; tests check its bytes and counts.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "LAB_CPU",
    "PRESETS",
    "Cpu",
    "Outcome",
    "Setup",
    "calibrate",
    "calibrate_cpu",
    "scaled",
    "simulate",
]

MiB = 2**20
GiB = 2**30

Done = Callable[[], None]

#: The most holders an owner remembers for one chunk (gateway/peers/holders.py): one
#: more forgets a holder with no room left, else the oldest.
MAX_HOLDERS_PER_CHUNK = 32


@dataclass(frozen=True)
class Cpu:
    """Per-byte CPU costs (core-seconds per byte) and the cores they draw on.

    Attributes:
        recv: a daemon receiving a chunk from a peer or the backend, verifying it
            against its id and keeping it.
        serve: a daemon sending a chunk to a peer.
        s3: the S3 server sending a chunk.
        copy: the reader copying a chunk out of the daemon's memfd into its tensors.
        recv_request, serve_request, s3_request: the same, per chunk (a request's cost
            whatever its size: HTTP, the event loop, moto's signature check), seconds.
        probe: one health probe, the prober's and the answerer's CPU together, seconds:
            each daemon probes its N - 1 peers every ``health_interval`` and answers as
            many, all through the restore (taken off its CPU before any transfer).
        cores: the pool's cores (``shared``) or each node's.
        shared: one pool for every process of the cluster (the lab's VM); else each node
            has ``cores`` of its own, and the S3 server is not limited.
        process_cores: the most one daemon or the S3 server uses (an asyncio loop, and
            moto, run on one core; blake3 in a thread adds a little). None: no limit.
    """

    recv: float
    serve: float
    s3: float
    copy: float
    recv_request: float = 0.0
    serve_request: float = 0.0
    s3_request: float = 0.0
    probe: float = 0.0
    cores: float = 2.0
    shared: bool = True
    process_cores: float | None = 1.0


@dataclass(frozen=True)
class Setup:
    """One restore: N cold nodes each read the whole checkpoint at once.

    Attributes:
        nodes: N.
        size: the checkpoint's bytes.
        chunk: its chunk size.
        link_up: each node's uplink, bytes/s.
        link_down: each node's downlink, bytes/s (None: not shaped).
        backend: the backend's egress to the whole cluster, bytes/s.
        design: ``holders``, ``owner`` (today's) or ``alone`` (no peers).
        holder_fanout: copies an owner sends itself, and askers a holder is sent.
        holders_per_answer: holders named in one answer.
        holder_order: which holders an owner names: ``fewest`` askers first (the spec;
            among equals the earliest added), or ``oldest``: the earliest added with room
            (the likeliest to hold the chunk already, not to be fetching it).
        holder_count: whose asker count an answer raises: ``all`` the holders it names
            (the spec), or ``first``: only the first, the one the asker will get it from
            unless that one fails.
        holders_named: the order the picked holders are named (and asked) in: ``added``
            (the earliest added first, as gateway/peers/holders.py names them) or
            ``picked`` (fewest askers first).
        holders_ready: name only holders that hold the chunk already (as if each told
            its owner once it had it), never one still fetching: what a protocol without
            chains would give.
        holder_timeout: the longest a holder waits on its own fetch for an asker
            (``[peers] timeout``), then answers 404 and the asker tries the next holder,
            then the owner directly (None: no limit).
        per_peer_requests: requests one node has in flight to one member (None: no bound).
        window: chunks a node's reader has asked for and not got.
        barrier: the reader asks ``window`` chunks in one request and copies them
            before it asks for more (today's client); else a sliding window.
        batches_in_flight: with ``barrier``, batches asked for at once (the client
            since 79ee093: 2, the next asked on a second connection; 1 before).
        same_offset: every node starts its pass at one offset (the lab: one host name).
        rtt: seconds each request costs before its bytes flow (round trip, handling).
        health_interval: ``[peers] health_interval``: the probes' CPU (``Cpu.probe``).
        cpu: the CPU model (None: CPU is free).
        seed: the owners and offsets.
        shares: the chunks each node owns (a lab's own placement, to compare with it),
            in a seeded random order; None: each chunk's owner a uniform pick.
        quantum: the shortest step, as a fraction of one chunk's time at ``link_up``.
    """

    nodes: int
    size: int
    chunk: int = 4 * MiB
    link_up: float = 12.5e9
    link_down: float | None = 12.5e9
    backend: float = 100e9
    design: str = "holders"
    holder_fanout: int = 4
    holders_per_answer: int = 3
    holder_order: str = "fewest"
    holder_count: str = "all"
    holder_timeout: float | None = 2.0
    holders_named: str = "added"
    holders_ready: bool = False
    per_peer_requests: int | None = 4
    window: int = 64
    barrier: bool = True
    batches_in_flight: int = 1
    same_offset: bool = False
    rtt: float = 0.001
    health_interval: float = 1.0
    cpu: Cpu | None = None
    seed: int = 0
    shares: tuple[int, ...] | None = None
    quantum: float = 0.25

    @property
    def chunks(self) -> int:
        return max(1, math.ceil(self.size / self.chunk))

    @property
    def link(self) -> float:
        """The node link that bounds a restore: its downlink if shaped, else its uplink."""
        return min(self.link_up, self.link_down or math.inf)


@dataclass
class Outcome:
    """What a run gave.

    Attributes:
        setup: the run's setup.
        times: each node's restore time, seconds.
        backend_bytes: bytes the backend sent.
        served: bytes each node sent to peers.
        owner_served: of those, bytes sent as the chunk's owner.
        owned: bytes of the chunks each node owns.
        received: bytes each node received (peers and backend).
        answers: the owners' answers: served, holders, direct.
        holder_bytes: bytes sent by nodes answering holder requests.
        most_holders: the longest holder list any owner kept for a chunk.
        holder_timeouts: holder requests that waited ``holder_timeout`` and got 404.
        cpu_seconds: core-seconds spent, by the daemons, S3 and the readers.
        steps: the simulation's steps.
    """

    setup: Setup
    times: list[float]
    backend_bytes: float
    served: list[float]
    owner_served: list[float]
    owned: list[float]
    received: list[float]
    answers: dict[str, int]
    holder_bytes: float
    most_holders: int
    holder_timeouts: int
    cpu_seconds: dict[str, float]
    steps: int

    @property
    def slowest(self) -> float:
        return max(self.times)

    @property
    def ideal(self) -> float:
        """``size / link``: a node's restore if its link were the only limit."""
        return self.setup.size / self.setup.link

    @property
    def bound(self) -> float:
        """The links' bound: ``size / link``, or the backend sending one copy (``alone``:
        N copies) if that takes longer."""
        copies = self.setup.nodes if self.setup.design == "alone" else 1
        return max(self.ideal, copies * self.setup.size / self.setup.backend)

    @property
    def slowest_ratio(self) -> float:
        """The slowest node's restore / (size / link)."""
        return self.slowest / self.ideal

    @property
    def backend_ratio(self) -> float:
        return self.backend_bytes / self.setup.size

    @property
    def served_ratio(self) -> float:
        """The most any node served / what the busiest owner serves in today's design:
        (N - 1) times the largest owner share (the lab's figure, bench/fanout_bench.py)."""
        n = self.setup.nodes
        return max(self.served) / ((n - 1) * max(self.owned)) if n > 1 else 0.0

    @property
    def owner_ratio(self) -> float:
        """The most any node served as an owner / (N - 1) times its own share: 1 in
        today's design, about holder_fanout / (N - 1) with holders."""
        n = self.setup.nodes
        return max(
            (
                s / ((n - 1) * o)
                for s, o in zip(self.owner_served, self.owned, strict=True)
                if o > 0
            ),
            default=0.0,
        )

    @property
    def served_max_over_mean(self) -> float:
        """The most any node served / (N - 1) x size / N, the mean owner's share."""
        n = self.setup.nodes
        return max(self.served) / ((n - 1) * self.setup.size / n) if n > 1 else 0.0

    def row(self) -> dict[str, Any]:
        """The figures, for the table and the JSON."""
        return {
            "design": self.setup.design,
            "nodes": self.setup.nodes,
            "size_bytes": self.setup.size,
            "chunks": self.setup.chunks,
            "slowest_s": round(self.slowest, 3),
            "fastest_s": round(min(self.times), 3),
            "size_over_link_s": round(self.ideal, 3),
            "links_bound_s": round(self.bound, 3),
            "slowest_over_size_link": round(self.slowest_ratio, 3),
            "backend_over_size": round(self.backend_ratio, 4),
            "most_served_over_share": round(self.served_ratio, 3),
            "most_owner_served_over_own_share": round(self.owner_ratio, 3),
            "most_served_over_mean_share": round(self.served_max_over_mean, 3),
            "answers": self.answers,
            "holder_bytes": self.holder_bytes,
            "holder_timeouts": self.holder_timeouts,
            "cpu_seconds": {k: round(v, 2) for k, v in self.cpu_seconds.items()},
            "steps": self.steps,
        }


class _Sim:
    """The state of one run; :func:`simulate` is the way in."""

    SLOTS = 6  # sender link, receiver link, sender's pool, receiver's pool, two processes

    def __init__(self, s: Setup) -> None:
        self.s = s
        n, k = s.nodes, s.chunks
        rng = np.random.default_rng(s.seed)
        if s.shares is not None:
            if len(s.shares) != n or sum(s.shares) != k or min(s.shares) < 0:
                raise ValueError(f"shares must give each of {n} nodes its chunks, {k} in all")
            self.owner = np.repeat(np.arange(n), s.shares)
            rng.shuffle(self.owner)
        else:
            self.owner = rng.integers(0, n, size=k) if n > 1 else np.zeros(k, dtype=np.int64)
        sizes = np.full(k, s.chunk, dtype=np.float64)
        sizes[-1] = s.size - s.chunk * (k - 1)
        self.sizes = sizes
        offsets = (
            np.full(n, int(rng.integers(0, k))) if s.same_offset else rng.integers(0, k, size=n)
        )
        self.order = [np.roll(np.arange(k), -int(off)) for off in offsets]
        self.have = np.zeros((n, k), dtype=bool)
        self.inflight: dict[tuple[int, int], list[Done]] = {}
        # resources: 0 none (no limit), 1..n uplinks, n+1..2n downlinks, backend,
        # the shared pool or n node pools, n daemons and S3 as processes
        self.r_up = 1
        self.r_down = 1 + n
        self.r_backend = 1 + 2 * n
        self.r_pool = 2 + 2 * n
        self.r_proc = self.r_pool + n
        self.r_s3 = self.r_proc + n
        caps = np.full(self.r_s3 + 1, np.inf)
        caps[self.r_up : self.r_up + n] = s.link_up
        caps[self.r_down : self.r_down + n] = s.link_down or np.inf
        caps[self.r_backend] = s.backend
        cpu = s.cpu
        # each daemon's probes: cores taken all through the restore
        self.probing = (
            cpu.probe * (n - 1) / s.health_interval
            if cpu is not None and s.design != "alone"
            else 0.0
        )
        if cpu is not None:
            pool = cpu.cores - (n * self.probing if cpu.shared else self.probing)
            own = None if cpu.process_cores is None else cpu.process_cores - self.probing
            if pool <= 0 or (own is not None and own <= 0):
                raise ValueError(f"the health probes alone use up the CPU: {s}")
            caps[self.r_pool : self.r_pool + n] = pool
            if own is not None and cpu.process_cores is not None:
                caps[self.r_proc : self.r_proc + n] = own
                caps[self.r_s3] = cpu.process_cores
        self.caps = caps
        # flows, as arrays of the active ones
        self.f_id = np.zeros(0, dtype=np.int64)
        self.f_left = np.zeros(0)
        self.f_res = np.zeros((0, self.SLOTS), dtype=np.int64)
        self.f_w = np.zeros((0, self.SLOTS))
        self.new: list[tuple[int, float, list[int], list[float]]] = []
        self.on_done: dict[int, Done] = {}
        self.next_id = 0
        self.now = 0.0
        self.timers: list[tuple[float, int, Done]] = []
        self.timer_seq = 0
        # per-peer request slots
        self.slots: dict[tuple[int, int], int] = {}
        self.waiting: dict[tuple[int, int], deque[Done]] = {}
        # holders: per chunk, the owner's copies sent and its list of [node, askers]
        self.sent = np.zeros(k, dtype=np.int64)
        self.holders: dict[int, list[list[int]]] = {}
        # figures
        self.backend_bytes = 0.0
        self.served = np.zeros(n)
        self.owner_served = np.zeros(n)
        self.received = np.zeros(n)
        self.holder_bytes = 0.0
        self.answers = {"served": 0, "holders": 0, "direct": 0}
        self.timeouts = 0
        self.cpu_seconds = {"daemons": 0.0, "s3": 0.0, "readers": 0.0, "probes": 0.0}
        self.times = [math.nan] * n
        self.steps = 0

    # --- flows -------------------------------------------------------------------

    def _pool(self, node: int) -> int:
        assert self.s.cpu is not None
        return self.r_pool if self.s.cpu.shared else self.r_pool + node

    def flow(self, src: int | None, dst: int, nbytes: float, done: Done) -> None:
        """A chunk from node ``src`` (None: the backend) to node ``dst``."""
        cpu = self.s.cpu
        res = [self.r_backend if src is None else self.r_up + src, self.r_down + dst, 0, 0, 0, 0]
        w = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
        if cpu is not None:
            per_request = cpu.s3_request if src is None else cpu.serve_request
            send = (cpu.s3 if src is None else cpu.serve) + per_request / nbytes
            recv = cpu.recv + cpu.recv_request / nbytes
            res[3], w[3] = self._pool(dst), recv
            res[5], w[5] = self.r_proc + dst, recv
            if src is not None:
                res[2], w[2] = self._pool(src), send
                res[4], w[4] = self.r_proc + src, send
            elif cpu.shared:  # S3 runs on the lab's VM too
                res[2], w[2] = self.r_pool, send
                res[4], w[4] = self.r_s3, send
            self.cpu_seconds["daemons"] += nbytes * recv
            self.cpu_seconds["s3" if src is None else "daemons"] += nbytes * send
        if src is None:
            self.backend_bytes += nbytes
        else:
            self.served[src] += nbytes
        self.received[dst] += nbytes
        self._add(nbytes, res, w, done)

    def copy(self, node: int, nbytes: float, done: Done) -> None:
        """The reader at ``node`` copies ``nbytes`` out of its chunks."""
        cpu = self.s.cpu
        if cpu is None or cpu.copy <= 0:
            done()
            return
        self.cpu_seconds["readers"] += nbytes * cpu.copy
        self._add(nbytes, [self._pool(node), 0, 0, 0, 0, 0], [cpu.copy, 0, 0, 0, 0, 0], done)

    def _add(self, nbytes: float, res: list[int], w: list[float], done: Done) -> None:
        res = [r if x > 0 else 0 for r, x in zip(res, w, strict=True)]  # unused: no limit
        fid = self.next_id
        self.next_id += 1
        self.on_done[fid] = done
        self.new.append((fid, nbytes, res, w))

    def later(self, delay: float, then: Done) -> None:
        if delay <= 0:
            then()
            return
        self.timer_seq += 1
        heapq.heappush(self.timers, (self.now + delay, self.timer_seq, then))

    def _rates(self) -> np.ndarray:
        """Each flow's rate: equal shares of every resource first, then each flow scaled
        up by the slack of its tightest resource (never past any resource's capacity)."""
        res, w, caps = self.f_res, self.f_w, self.caps
        flat, nres = res.ravel(), caps.size
        with np.errstate(divide="ignore"):
            level = caps / np.bincount(flat, weights=w.ravel(), minlength=nres)
            level[0] = np.inf
            rate = level[res].min(axis=1)
            for _ in range(3):
                load = np.bincount(flat, weights=(w * rate[:, None]).ravel(), minlength=nres)
                slack = caps / load
                slack[0] = np.inf
                grow = slack[res].min(axis=1)
                if grow.max() < 1.001:
                    break
                rate *= grow
        return np.asarray(rate, dtype=np.float64)

    def _admit(self) -> None:
        if not self.new:
            return
        ids, left, res, w = zip(*self.new, strict=True)
        self.new.clear()
        self.f_id = np.concatenate([self.f_id, np.array(ids, dtype=np.int64)])
        self.f_left = np.concatenate([self.f_left, np.array(left, dtype=np.float64)])
        self.f_res = np.concatenate([self.f_res, np.array(res, dtype=np.int64)])
        self.f_w = np.concatenate([self.f_w, np.array(w, dtype=np.float64)])

    def run(self, until: float = 1e7) -> None:
        quantum = self.s.quantum * self.s.chunk / self.s.link_up
        while True:
            while self.timers and self.timers[0][0] <= self.now:
                heapq.heappop(self.timers)[2]()
            self._admit()
            if self.f_id.size == 0:
                if not self.timers:
                    return
                self.now = self.timers[0][0]
                continue
            rate = self._rates()
            dt = float((self.f_left / rate).min())
            if self.timers:  # a timer (a request's overhead, a holder's wait) ends a step
                dt = min(dt, self.timers[0][0] - self.now)
            # but no step is shorter than the quantum: a flow or timer ends up to a
            # quantum late, where thousands of them would make as many steps
            dt = max(dt, quantum)
            self.now += dt
            self.steps += 1
            if self.now > until:
                raise RuntimeError(f"the restore did not end within {until} s")
            self.f_left -= rate * dt
            done = self.f_left <= 1e-6 * self.s.chunk
            if done.any():
                finished = self.f_id[done].tolist()
                keep = ~done
                self.f_id, self.f_left = self.f_id[keep], self.f_left[keep]
                self.f_res, self.f_w = self.f_res[keep], self.f_w[keep]
                for fid in finished:
                    self.on_done.pop(fid)()

    # --- the protocol ----------------------------------------------------------

    def acquire(self, node: int, peer: int, then: Done) -> None:
        """A request slot from ``node`` to ``peer`` (``per_peer_requests``)."""
        bound = self.s.per_peer_requests
        key = (node, peer)
        if bound is None or self.slots.get(key, 0) < bound:
            self.slots[key] = self.slots.get(key, 0) + 1
            then()
        else:
            self.waiting.setdefault(key, deque()).append(then)

    def release(self, node: int, peer: int) -> None:
        key = (node, peer)
        queue = self.waiting.get(key)
        if queue:
            queue.popleft()()  # the slot passes on
        else:
            self.slots[key] -= 1

    def got(self, node: int, c: int) -> None:
        self.have[node, c] = True
        for then in self.inflight.pop((node, c)):
            then()

    def fetch(self, node: int, c: int, then: Done) -> None:
        """``node`` gets chunk ``c`` (single flight), then ``then``."""
        if self.have[node, c]:
            then()
            return
        waiters = self.inflight.get((node, c))
        if waiters is not None:
            waiters.append(then)
            return
        self.inflight[(node, c)] = [then]
        owner = int(self.owner[c])
        if self.s.design == "alone" or owner == node:
            self.later(
                self.s.rtt, lambda: self.flow(None, node, self.sizes[c], lambda: self.got(node, c))
            )
        else:
            self.ask_owner(node, c, owner, direct=False)

    def ask_owner(
        self, node: int, c: int, owner: int, *, direct: bool, bad: tuple[int, ...] = ()
    ) -> None:
        def arrive() -> None:
            self.later(
                self.s.rtt, lambda: self.owner_answers(node, c, owner, direct=direct, bad=bad)
            )

        self.acquire(node, owner, arrive)

    def owner_answers(
        self, node: int, c: int, owner: int, *, direct: bool, bad: tuple[int, ...] = ()
    ) -> None:
        """The owner's answer, as gateway/peers/holders.py's ``Holders.answer`` makes it."""
        s = self.s
        if s.design == "holders":
            listed = self.holders.setdefault(c, [])
            if bad:
                listed[:] = [h for h in listed if h[0] not in bad]
            picks: list[list[int]] = []
            if not direct and self.sent[c] >= s.holder_fanout:
                room = [
                    h
                    for h in listed
                    if h[1] < s.holder_fanout
                    and h[0] != node
                    and (not s.holders_ready or self.have[h[0], c])
                ]
                if s.holder_order == "fewest":
                    room.sort(key=lambda h: h[1])  # stable: the earliest added first
                picks = room[: s.holders_per_answer]
                if s.holders_named == "added":
                    picks.sort(key=listed.index)
            if not picks:
                self.sent[c] += 1
            if all(h[0] != node for h in listed):
                if len(listed) >= MAX_HOLDERS_PER_CHUNK:  # one with no room, else the oldest
                    full = next((i for i, h in enumerate(listed) if h[1] >= s.holder_fanout), 0)
                    del listed[full]
                listed.append([node, 0])
            if picks:
                for h in picks if s.holder_count == "all" else picks[:1]:
                    h[1] += 1
                self.answers["holders"] += 1
                self.release(node, owner)
                self.ask_holders(node, c, owner, [h[0] for h in picks])
                return
        self.answers["direct" if direct else "served"] += 1

        def send() -> None:
            self.owner_served[owner] += self.sizes[c]
            self.flow(owner, node, self.sizes[c], finish)

        def finish() -> None:
            self.release(node, owner)
            self.got(node, c)

        self.fetch(owner, c, send)

    def ask_holders(
        self, node: int, c: int, owner: int, holders: list[int], bad: tuple[int, ...] = ()
    ) -> None:
        if not holders:
            self.ask_owner(node, c, owner, direct=True, bad=bad)
            return
        holder, rest = holders[0], holders[1:]

        def finish() -> None:
            self.release(node, holder)
            self.got(node, c)

        def send() -> None:
            self.holder_bytes += self.sizes[c]
            self.flow(holder, node, self.sizes[c], finish)

        def not_held() -> None:  # 404 NotHeld: the next holder, then the owner
            self.release(node, holder)
            self.ask_holders(node, c, owner, rest, (*bad, holder))

        def answer() -> None:
            if self.have[holder, c]:
                send()
                return
            waiters = self.inflight.get((holder, c))
            if waiters is None:
                not_held()
                return
            # the holder waits on its own fetch, at most holder_timeout
            settled = [False]

            def ready() -> None:
                if not settled[0]:
                    settled[0] = True
                    send()

            def expire() -> None:
                if not settled[0]:
                    settled[0] = True
                    self.timeouts += 1
                    not_held()

            waiters.append(ready)
            if self.s.holder_timeout is not None:
                self.later(self.s.holder_timeout, expire)

        self.acquire(node, holder, lambda: self.later(self.s.rtt, answer))

    def reader(self, node: int) -> None:
        """Node ``node``'s reader: every chunk, in its order, ``window`` at a time."""
        if self.s.barrier:
            self._batches(node)
        else:
            self._sliding(node)

    def _batches(self, node: int) -> None:
        """Batches of ``window`` chunks, ``batches_in_flight`` asked at once; each is
        copied once all its chunks are here and the batch before it is copied, and the
        next batch is asked for then (client/checkpoint/reader.py)."""
        s, order = self.s, self.order[node]
        batches = [order[i : i + s.window].tolist() for i in range(0, len(order), s.window)]
        arrived = [False] * len(batches)
        state = {"asked": 0, "copied": 0}

        def copy_next() -> None:
            k = state["copied"]
            if k < len(batches) and arrived[k]:
                arrived[k] = False  # copied once
                self.copy(node, float(self.sizes[batches[k]].sum()), done_copying)

        def done_copying() -> None:
            state["copied"] += 1
            if state["copied"] == len(batches):
                self.times[node] = self.now
                return
            ask()
            copy_next()

        def ask() -> None:
            k = state["asked"]
            if k >= len(batches):
                return
            state["asked"] += 1
            pending = [len(batches[k])]

            def one() -> None:
                pending[0] -= 1
                if pending[0] == 0:
                    arrived[k] = True
                    copy_next()

            for c in batches[k]:
                self.fetch(node, c, one)

        for _ in range(min(s.batches_in_flight, len(batches))):
            ask()

    def _sliding(self, node: int) -> None:
        """A sliding window: a chunk asked for as soon as one arrives."""
        s, order = self.s, self.order[node]
        total = len(order)
        state = {"next": 0, "copied": 0}

        def copied() -> None:
            state["copied"] += 1
            if state["copied"] >= total:
                self.times[node] = self.now

        def admit() -> None:
            c = int(order[state["next"]])
            state["next"] += 1

            def one() -> None:
                self.copy(node, float(self.sizes[c]), copied)
                if state["next"] < total:
                    admit()

            self.fetch(node, c, one)

        for _ in range(min(s.window, total)):
            admit()


def simulate(setup: Setup) -> Outcome:
    """Run ``setup`` to the end: every node holds every chunk.

    Raises:
        ValueError: a setup that cannot run.
        RuntimeError: the restore never ends (a protocol deadlock: a bug).
    """
    counts = (
        setup.nodes,
        setup.size,
        setup.chunk,
        setup.window,
        setup.holder_fanout,
        setup.batches_in_flight,
    )
    if min(counts) < 1 or setup.holders_per_answer < 1 or (setup.per_peer_requests or 1) < 1:
        raise ValueError(
            "nodes, size, chunk, window, holder_fanout, batches_in_flight, holders_per_answer and "
            f"per_peer_requests must be positive: {setup}"
        )
    if setup.link_up <= 0 or (setup.link_down or 1) <= 0 or setup.backend <= 0:
        raise ValueError(f"links and the backend must be positive rates: {setup}")
    if setup.holder_order not in ("fewest", "oldest") or setup.holder_count not in (
        "all",
        "first",
    ):
        raise ValueError(f"holder_order fewest|oldest, holder_count all|first: {setup}")
    if setup.holders_named not in ("added", "picked"):
        raise ValueError(f"holders_named added|picked: {setup}")
    if setup.design not in ("holders", "owner", "alone"):
        raise ValueError(f"design {setup.design!r}: holders, owner or alone")
    sim = _Sim(setup)
    for node in range(setup.nodes):
        sim.reader(node)
    sim.run()
    if sim.inflight or any(math.isnan(t) for t in sim.times):
        raise RuntimeError("the restore stopped with chunks still wanted: a deadlock")
    sim.cpu_seconds["probes"] = setup.nodes * sim.probing * max(sim.times)
    owned = np.bincount(sim.owner, weights=sim.sizes, minlength=setup.nodes)
    return Outcome(
        setup=setup,
        times=list(sim.times),
        backend_bytes=sim.backend_bytes,
        served=sim.served.tolist(),
        owner_served=sim.owner_served.tolist(),
        owned=owned.tolist(),
        received=sim.received.tolist(),
        answers=dict(sim.answers),
        holder_bytes=sim.holder_bytes,
        most_holders=max((len(h) for h in sim.holders.values()), default=0),
        holder_timeouts=sim.timeouts,
        cpu_seconds=dict(sim.cpu_seconds),
        steps=sim.steps,
    )


# --- calibration: the CPU costs, measured on this machine ---------------------------


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` (all its threads)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def calibrate(
    work: Path, *, size: int = 256 * MiB, chunk: int = 4 * MiB, rounds: int = 3
) -> dict[str, float]:
    """Measure the per-byte CPU costs of :class:`Cpu` here, with real processes.

    A moto S3 server and a real daemon on loopback (4 MiB chunks, everything in RAM, a
    ``[peers]`` section with itself as the only member). A checkpoint of ``size`` bytes
    is saved through a first daemon, which is then stopped; a fresh one (empty cache)
    restores it with the client's ``load``, as a lab node does without peers, and then
    serves each of its chunks on the peer route (``/v1/peer/chunks/...``) ``rounds``
    times. Each process's CPU comes from ``/proc/<pid>/stat``:

    * ``recv``: the daemon's CPU for the cold restore, per byte (its S3 GETs over
      aiohttp/obstore, blake3 against the id, the RAM tier's copy, the fds sent to the
      reader): the work of a chunk received from a peer, too;
    * ``s3``: moto's CPU for the cold restore, per byte (one ranged GET a chunk, as
      the daemon asks);
    * ``serve``: the daemon's CPU answering the peer route from RAM, per byte;
    * ``copy``: this process's CPU for the ``load`` (the reader's ``preadv`` into its
      arrays), per byte.

    Returns:
        The costs in core-seconds per byte, and the throughputs they mean (GB/s a core).
    """
    import http.client
    import time

    from chunkd.client import Client
    from chunkd.client import checkpoint as ckpt
    from chunkd.testing import S3Server, s3_backend
    from chunkd.testing.daemon import DaemonProcess
    from chunkd.testing.ports import free_port

    work.mkdir(parents=True, exist_ok=True)
    token = work / "token"
    token.write_text("calibration-token")
    token.chmod(0o600)
    rng = np.random.default_rng(7)
    pieces = 8
    state = {f"w{i}": rng.integers(0, 256, size // pieces, dtype=np.uint8) for i in range(pieces)}

    def start(s3: S3Server, name: str) -> tuple[DaemonProcess, int]:
        port = free_port()
        config = f"""
[server]
listen = "127.0.0.1:{port}"

[cache]
dir = "{work / name / "cache"}"
ram_bytes = "{2 * size}"
disk_bytes = "{2 * size}"
disk_min_free_bytes = 0
chunk_bytes = {chunk}
fsync = "never"

[peers]
self = "127.0.0.1:{port}"
members = ["127.0.0.1:{port}"]
token_file = "{token}"

{s3_backend("ckpt", "s3://calib/pre", s3.endpoint, writable=True)}"""
        daemon = DaemonProcess(
            config, cwd=work / name, listen=f"127.0.0.1:{port}", socket=work / f"{name}.sock"
        )
        daemon.wait_ready()
        return daemon, port

    figures: dict[str, float] = {}
    with S3Server.start() as s3:
        s3.client().create_bucket(Bucket="calib")
        saver, _ = start(s3, "saver")
        try:
            with Client(work / "saver.sock", timeout=600) as client:
                ckpt.save(state, "ckpt/calib/step-1", client=client)
        finally:
            saver.stop()
        listing = s3.client().list_objects_v2(Bucket="calib", Prefix="pre/chunks/")
        ids = [item["Key"].rsplit("/", 1)[1] for item in listing.get("Contents", [])]
        daemon, port = start(s3, "reader")
        try:
            moto0, d0, me0 = (
                _cpu_seconds(s3.process.pid),
                _cpu_seconds(daemon.pid),
                time.process_time(),
            )
            with Client(work / "reader.sock", timeout=600) as client:
                loaded = ckpt.load("ckpt/calib/step-1", client=client)
            me1 = time.process_time()
            moto1, d1 = _cpu_seconds(s3.process.pid), _cpu_seconds(daemon.pid)
            if not all(np.array_equal(loaded[k], v) for k, v in state.items()):
                raise RuntimeError("the calibration's checkpoint did not load back bit-exact")
            served, warm = 0, []
            for _ in range(rounds):
                before, nbytes = _cpu_seconds(daemon.pid), 0
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
                for cid in ids:
                    conn.request(
                        "GET",
                        f"/v1/peer/chunks/ckpt/{cid}",
                        headers={
                            "Authorization": "Bearer calibration-token",
                            "X-Chunkd-Peer": f"127.0.0.1:{port}",
                        },
                    )
                    answer = conn.getresponse()
                    body = answer.read()
                    if answer.status != 200:
                        raise RuntimeError(f"the peer route answered {answer.status}")
                    nbytes += len(body)
                conn.close()
                warm.append((_cpu_seconds(daemon.pid) - before) / nbytes)
                served = nbytes
        finally:
            daemon.stop()
    total = sum(v.nbytes for v in state.values())
    figures["recv"] = (d1 - d0) / total
    figures["s3"] = (moto1 - moto0) / total
    figures["serve"] = min(warm)
    figures["copy"] = (me1 - me0) / total
    figures["bytes"] = float(total)
    figures["served_bytes"] = float(served)
    for key in ("recv", "serve", "s3", "copy"):
        figures[f"{key}_GBps_per_core"] = (1 / figures[key] / 1e9) if figures[key] > 0 else math.inf
    return figures


def calibrate_cpu(work: Path) -> dict[str, Any]:
    """:func:`calibrate` at 1 MiB and at 4 MiB chunks, and the costs per byte and per
    request that fit both (``cost(chunk) = per_byte + per_request / chunk``)."""
    small, large = MiB, 4 * MiB
    one = calibrate(work / "1m", chunk=small)
    four = calibrate(work / "4m", chunk=large)
    fitted: dict[str, float] = {"copy": four["copy"]}
    for key in ("recv", "serve", "s3"):
        per_request = max((one[key] - four[key]) / (1 / small - 1 / large), 0.0)
        fitted[key] = max(four[key] - per_request / large, 0.0)
        fitted[f"{key}_request"] = per_request
    return {"1MiB": one, "4MiB": four, "fitted": fitted}


# --- the setups docs/peers.md quotes, and the command line ---------------------------

#: The CPU costs measured here by :func:`calibrate_cpu` (this 2-core VM, Python 3.11,
#: 2026-12-06, while other work ran: each figure is one run at 1 MiB and one at 4 MiB
#: chunks, fitted as a cost per byte plus one per request; ``python -m bench.fanout_sim
#: --calibrate WORK`` measures them again): a daemon receiving and verifying 1.71 ns/B
#: + 1.87 ms a chunk, serving 0.15 ns/B + 0.31 ms, moto sending 0.23 ns/B + 5.0 ms a
#: GET, the reader copying 0.42 ns/B; a health probe 0.7 ms (four daemons probing each
#: other every 300 ms, against one without peers, over 10 s). The lab's processes share
#: its 2 cores.
LAB_CPU = Cpu(
    recv=1.71e-9,
    serve=0.149e-9,
    s3=0.23e-9,
    copy=0.42e-9,
    recv_request=1.87e-3,
    serve_request=0.313e-3,
    s3_request=4.99e-3,
    probe=0.7e-3,
    cores=2.0,
)

_MBIT = 1e6 / 8

#: The lab at N=4 (bench/fanout_bench.py's run_four): 1 GiB, 4 MiB chunks, nodes 2 Gbit/s
#: and S3 400 Mbit/s each way, one host name (one offset), today's client (64 chunks a
#: request), 2 cores for everything.
LAB4 = Setup(
    nodes=4,
    size=GiB,
    chunk=4 * MiB,
    link_up=2000 * _MBIT,
    link_down=2000 * _MBIT,
    backend=400 * _MBIT,
    design="owner",
    same_offset=True,
    health_interval=0.3,
    cpu=LAB_CPU,
)
#: The lab at N=8 (bench/fanout_bench.py's run_eight): 64 MiB, 1 MiB chunks, nodes 80
#: Mbit/s and S3 320 Mbit/s each way.
LAB8 = replace(
    LAB4,
    nodes=8,
    size=64 * MiB,
    chunk=MiB,
    link_up=80 * _MBIT,
    link_down=80 * _MBIT,
    backend=320 * _MBIT,
)
#: The lab's own placements (L's figures, 1 MiB chunks): chunks each node owned.
LAB8_SHARES = (10, 4, 9, 10, 3, 9, 12, 7)
LAB4_SHARES = (15, 9, 18, 22)
#: 100 GiB, 4 MiB chunks, 100 Gb/s links each way, the backend 100 GB/s, 16 cores a node.
LARGE = Setup(
    nodes=100,
    size=100 * GiB,
    link_up=100e9 / 8,
    link_down=100e9 / 8,
    backend=100e9,
)
PRESETS: dict[str, Setup] = {
    "lab4": LAB4,
    "lab8": LAB8,
    "lab8-placed": replace(LAB8, shares=LAB8_SHARES, same_offset=False, batches_in_flight=2),
    "lab4-placed": replace(
        LAB8, nodes=4, shares=LAB4_SHARES, same_offset=False, batches_in_flight=2
    ),
    "n100": LARGE,
    "n1000": replace(LARGE, nodes=1000),
}


def scaled(setup: Setup, factor: float) -> Setup:
    """``setup`` with its chunks, window, request overhead and holder timeout divided by
    ``factor`` (the chunk size, links and N kept): every time in the run shrinks by
    ``factor`` and the ratios stay (docs/peers.md, "Scaling the N=1,000 run")."""
    if factor < 1:
        raise ValueError(f"a scale factor is at least 1, not {factor}")
    timeout = None if setup.holder_timeout is None else setup.holder_timeout / factor
    return replace(
        setup,
        size=max(setup.chunk, round(setup.size / factor)),
        window=max(1, round(setup.window / factor)),
        rtt=setup.rtt / factor,
        holder_timeout=timeout,
    )


def _table(outcomes: list[Outcome]) -> str:
    head = (
        f"{'design':8} {'N':>5} {'chunks':>7} {'slowest s':>10} {'size/link s':>11} "
        f"{'slowest/(S/B)':>13} {'backend/S':>9} {'most served/share':>17} {'answers':>22}"
    )
    lines = [head]
    for o in outcomes:
        a = o.answers
        lines.append(
            f"{o.setup.design:8} {o.setup.nodes:5d} {o.setup.chunks:7d} {o.slowest:10.2f} "
            f"{o.ideal:11.2f} {o.slowest_ratio:13.3f} {o.backend_ratio:9.4f} "
            f"{o.served_ratio:17.3f} {a['served']:>8}/{a['holders']}/{a['direct']:<6}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The command line; see the module's docstring."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.fanout_sim", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), help="start from a named setup")
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--size", type=float, help="the checkpoint, GiB")
    parser.add_argument("--chunk", type=float, help="the chunk size, MiB")
    parser.add_argument("--link", type=float, help="each node's link each way, Gbit/s")
    parser.add_argument("--backend", type=float, help="the backend's egress, Gbit/s")
    parser.add_argument(
        "--design", choices=("owner", "holders", "both", "alone", "all"), default="both"
    )
    parser.add_argument("--holder-fanout", type=int)
    parser.add_argument("--per-peer-requests", type=int, help="0: no bound")
    parser.add_argument("--window", type=int)
    parser.add_argument("--sliding", action="store_true", help="a sliding window, not batches")
    parser.add_argument(
        "--same-offset", action="store_true", help="every node starts at one offset"
    )
    parser.add_argument(
        "--cpu",
        choices=("lab", "none", "node"),
        help="CPU: the lab's 2 shared cores, none, or --cores a node",
    )
    parser.add_argument(
        "--cores", type=float, default=16.0, help="with --cpu node: each node's cores"
    )
    parser.add_argument("--seed", type=int)
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="divide the chunks, window, rtt and holder timeout by this (N=1,000 runs: 16)",
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--calibrate",
        type=Path,
        metavar="WORK",
        help="measure the CPU costs (a daemon and moto, in WORK) and exit",
    )
    args = parser.parse_args(argv)
    if args.calibrate is not None:
        print(json.dumps(calibrate_cpu(args.calibrate), indent=2))
        return 0
    base = PRESETS[args.preset] if args.preset else replace(LARGE, nodes=args.nodes or 100)
    changes: dict[str, Any] = {}
    if args.nodes:
        changes["nodes"] = args.nodes
    if args.size:
        changes["size"] = int(args.size * GiB)
    if args.chunk:
        changes["chunk"] = int(args.chunk * MiB)
    if args.link:
        changes["link_up"] = changes["link_down"] = args.link * 1e9 / 8
    if args.backend:
        changes["backend"] = args.backend * 1e9 / 8
    if args.holder_fanout:
        changes["holder_fanout"] = args.holder_fanout
    if args.per_peer_requests is not None:
        changes["per_peer_requests"] = args.per_peer_requests or None
    if args.window:
        changes["window"] = args.window
    if args.sliding:
        changes["barrier"] = False
    if args.same_offset:
        changes["same_offset"] = True
    if args.seed is not None:
        changes["seed"] = args.seed
    if args.cpu == "lab":
        changes["cpu"] = LAB_CPU
    elif args.cpu == "none":
        changes["cpu"] = None
    elif args.cpu == "node":
        changes["cpu"] = replace(LAB_CPU, cores=args.cores, shared=False, process_cores=None)
    setup = scaled(replace(base, **changes), args.scale)
    designs = {
        "both": ["owner", "holders"],
        "all": ["owner", "holders", "alone"],
    }.get(args.design, [args.design])
    outcomes = [simulate(replace(setup, design=d)) for d in designs]
    print(_table(outcomes))
    if args.json is not None:
        rows = [o.row() | {"setup": _setup_json(o.setup)} for o in outcomes]
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _setup_json(setup: Setup) -> dict[str, Any]:
    return asdict(setup)


if __name__ == "__main__":
    sys.exit(main())
