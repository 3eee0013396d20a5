"""A cluster in network namespaces, for tests and benchmarks (root only).

``nodes`` "nodes" (4 unless told; at most :data:`MAX_NODES`) and an S3 server, each
in a network namespace of its own, node ``i`` at ``198.18.80.i`` and S3 at
:data:`S3_IP` (``.200``), joined by a bridge in a namespace of its own; the process
that builds it reaches them all from 198.18.80.254. A lab built while another runs on
the machine (two test runs at once) takes the next free /24, 198.18.81.0/24 and up
(:attr:`Lab.net`; ask the lab, not the constants, for its addresses). Every link is
shaped with ``tc`` (tbf) in both directions, on the namespace's end of its veth
(what it sends) and on the bridge's end (what it receives): the nodes' links at
``node_rate``, S3's at ``s3_rate``, so that the backend's egress is the bottleneck,
as it is where object storage gives a cluster less than its nodes' NICs add up to.
Everything is removed on exit.

Members may carry failure-domain labels (``racks``: ``host:port rack=R`` in
``[peers] members``); ``peer_settings`` adds ``[peers]`` keys (``holder_fanout``,
``per_peer_requests``, ``replicas``) to every node's config. A node can be killed
(:meth:`Lab.kill_node`, SIGKILL) and replaced by a fresh one with the same name,
address and an empty cache (:meth:`Lab.replace_node`); :meth:`Lab.cpu_seconds`
reads each daemon's and S3's CPU time from ``/proc``, to show that a figure was
bound by the links and not by the CPU.

Network chaos, on one node's link at a time (this kernel has no netem: its qdiscs
are fifo, htb, tbf and ingress). Each is a table of nftables rules in the node's
own namespace, so the others' links stay clean:

- :meth:`Lab.lose`: random loss, both directions (``numgen random mod 100 < P``
  drops), table ``inet chunkd_chaos``;
- :meth:`Lab.partition`: the node cut off from the other nodes, and from S3 unless
  told otherwise (a pulled cable: see the method), same table;
- :meth:`Lab.delay`: latency ± jitter, from :class:`chunkd.testing.relay.LatencyRelay`
  in the node's namespace; table ``ip chunkd_relay`` redirects the node's TCP to it
  (inbound to port 8470, outbound to every lab address);
- :meth:`Lab.heal`: removes the node's tables and stops its relay.

The process that builds the lab is the observer, not a part of the cluster: its
address (:data:`ROOT_IP`) is never dropped nor delayed, so that the metrics and
``/readyz`` of a cut-off node can still be read.

Part of :mod:`chunkd.testing`; the daemon never imports it.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from chunkd.testing import S3Server, s3_backend
from chunkd.testing.daemon import DaemonProcess
from chunkd.testing.relay import RELAY_MARK, LatencyRelay, RelayStats
from chunkd.testing.s3rver import KEY as S3RVER_KEY
from chunkd.testing.s3rver import S3rverServer, s3rver_binary

__all__ = [
    "MAX_NODES",
    "NET",
    "RELAY_PORT",
    "ROOT_IP",
    "S3_IP",
    "Chaos",
    "Lab",
    "LabUnavailable",
    "cpu_seconds",
    "lab",
]

#: the first lab's /24 (a lab built while another runs takes the next free one,
#: 198.18.81, 198.18.82...: :attr:`Lab.net`)
NET = "198.18.80"
ROOT_IP = f"{NET}.254"
#: S3's address in the first lab: above every node's (node i is NET.i)
S3_IP = f"{NET}.200"
#: the /24s labs may take, 198.18.80-198.18.143 (all in 198.18.0.0/15)
_NETS: Final = range(80, 144)
#: labs built by this process so far (two at once need names of their own)
_LABS: Final = itertools.count()
#: held while a lab picks its /24 and builds its links
_PICK_LOCK: Final = Path("/run/chunkd-netlab.lock")
#: the most nodes a lab builds (a namespace, a veth pair and a daemon each)
MAX_NODES: Final = 32
#: a ``[peers]`` value a lab writes into the nodes' configs
PeerValue = str | int | float | bool
TOKEN = "a-shared-secret-for-the-namespaces"
#: the daemons' HTTP (and peer) port
PORT: Final = 8470
#: where a node's latency relay accepts, in its namespace
RELAY_PORT: Final = 8479
_CHAOS_TABLE: Final = "chunkd_chaos"
_RELAY_TABLE: Final = "chunkd_relay"


class LabUnavailable(RuntimeError):
    """Namespaces cannot be built here (not root, no iproute2 or tc)."""


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system, seconds) of process ``pid`` and of its living
    descendants, and of the children it has reaped, from ``/proc``; 0.0 if it is
    gone.

    A daemon's own threads are in its figure; a process killed before the reading
    is not (read before killing).
    """
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: the fields follow the last ")"
        fields = stat.rpartition(")")[2].split()
        # utime, stime, cutime, cstime are fields 14-17 of stat(5); fields[0] is field 3
        total += sum(int(value) for value in fields[11:15]) / tick
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                pending += [int(child) for child in task.read_text().split()]
            except OSError:
                continue
    return total


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _in(ns: str, *args: str) -> None:
    _ip("netns", "exec", ns, *args)


def _nft(ns: str, *args: str, script: str | None = None) -> str:
    """Run ``nft ARGS`` in namespace ``ns``, or the nft ``script`` (one transaction:
    all of it or none); its output.

    Raises:
        LabUnavailable: no ``nft`` here (only the chaos needs it).
    """
    if shutil.which("nft") is None:
        raise LabUnavailable("the network chaos needs nft (make tools installs nftables)")
    argv = ["ip", "netns", "exec", ns, "nft", *args, *(["-f", "-"] if script else [])]
    done = subprocess.run(argv, input=(script or "").encode(), capture_output=True, check=False)
    if done.returncode != 0:
        what = script or " ".join(args)
        raise RuntimeError(f"nft in {ns} refused:\n{what}\n{done.stderr.decode().strip()}")
    return done.stdout.decode()


@dataclass
class Chaos:
    """What one node's chaos did, from the rules' counters and its relay."""

    #: packets the loss rule dropped (both directions)
    lost_packets: int = 0
    #: packets the partition rules dropped (both directions)
    cut_packets: int = 0
    #: what the node's latency relay carried (None: no relay)
    relay: RelayStats | None = None


@dataclass
class _NodeChaos:
    """The chaos applied to one node now: what its tables are made from."""

    loss_percent: int = 0
    cut_from: tuple[str, ...] = ()
    relay: LatencyRelay | None = None


@dataclass
class Lab:
    """The namespaces, and the processes started in them.

    Args:
        work: where the nodes' directories, configs and logs go.
        nodes: the nodes' namespaces, node 1 first.
        s3_ns: S3's namespace.
        chunk_bytes: the nodes' ``[cache] chunk_bytes`` (None: the default, 4 MiB);
            a checkpoint is chunked at the saving daemon's size.
        racks: node number to its failure domain; a labelled member is written
            ``host:port rack=R`` in every node's ``[peers] members`` (an unlabelled
            one is a domain of its own).
        peer_settings: ``[peers]`` keys every node gets (``holder_fanout = 1000``),
            on top of the lab's own; :meth:`start_node` can add more.
    """

    work: Path
    nodes: list[str]
    s3_ns: str
    chunk_bytes: int | None = None
    racks: dict[int, str] = field(default_factory=dict)
    peer_settings: dict[str, PeerValue] = field(default_factory=dict)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    #: each running node's daemon, by node number
    node_processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    #: each namespace's veth ends: (its own end, the bridge's end), for shaping
    links: dict[str, tuple[str, str]] = field(default_factory=dict)
    switch_ns: str = ""
    #: each link's queue, as tbf's latency (what :meth:`shape_node` keeps)
    queue: str = "200ms"
    #: this lab's /24 (``198.18.80`` unless another lab held it when this one was built)
    net: str = NET

    @property
    def s3_ip(self) -> str:
        """S3's address in this lab."""
        return f"{self.net}.200"

    @property
    def root_ip(self) -> str:
        """The observer's address in this lab."""
        return f"{self.net}.254"

    _chaos: dict[int, _NodeChaos] = field(default_factory=dict, init=False, repr=False)
    #: the access key and secret of the S3 server started (moto's by default)
    s3_keys: tuple[str, str] = ("testing", "testing-secret")
    #: S3's end of its link, in its namespace (what :meth:`shape_s3` shapes)
    s3_link: str = ""

    def start_s3(self, *, server: str = "moto") -> None:
        """An S3 server in the S3 namespace on port 9000, with a bucket ``fanout``:
        ``"moto"``, or ``"s3rver"`` (:mod:`chunkd.testing.s3rver`), which serves a
        range of a large object without reading all of it.

        Raises:
            LabUnavailable: ``"s3rver"`` is not installed (``make emulators``).
        """
        if server == "s3rver":
            binary = s3rver_binary()
            if binary is None:
                raise LabUnavailable("s3rver is not installed (make emulators; it needs npm)")
            s3rver = S3rverServer.start(
                binary,
                self.work / "s3rver",
                ["fanout"],
                host=self.s3_ip,
                port=9000,
                netns=self.s3_ns,
            )
            self.processes.insert(0, s3rver.process)  # stop_nodes() keeps processes[0]
            self.s3_keys = (S3RVER_KEY, S3RVER_KEY)
            return
        moto = S3Server.start(host=self.s3_ip, port=9000, netns=self.s3_ns)
        self.processes.insert(0, moto.process)
        moto.client().create_bucket(Bucket="fanout")

    def s3_client(self) -> Any:
        """A boto3 client of the lab's S3 server, from the observer."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=f"http://{self.s3_ip}:9000",
            aws_access_key_id=self.s3_keys[0],
            aws_secret_access_key=self.s3_keys[1],
            region_name="us-east-1",
        )

    def shape_s3(self, rate: str) -> None:
        """Set S3's link, both directions, to ``rate`` (a tc rate: ``"500mbit"``)."""
        self._shape(self.s3_ns, rate)

    def shape_node(self, i: int, rate: str) -> None:
        """Set node ``i``'s link, both directions, to ``rate``."""
        self._shape(self.nodes[self._index(i)], rate)

    def _shape(self, ns: str, rate: str) -> None:
        inner, outer = self.links[ns]
        shape = _tbf(rate, self.queue)
        _in(ns, "tc", "qdisc", "change", "dev", inner, "root", "tbf", *shape)
        _in(self.switch_ns, "tc", "qdisc", "change", "dev", outer, "root", "tbf", *shape)

    def start_node(
        self, i: int, *, peers: bool, settings: Mapping[str, PeerValue] | None = None
    ) -> subprocess.Popen[bytes]:
        """Daemon ``i`` (1 to the lab's nodes) in its namespace, with an empty cache
        (its directory is made anew); ``settings`` are ``[peers]`` keys on top of
        the lab's ``peer_settings``."""
        return self.start_nodes([i], peers=peers, settings=settings)[i]

    def start_nodes(
        self,
        numbers: Iterable[int],
        *,
        peers: bool,
        settings: Mapping[str, PeerValue] | None = None,
    ) -> dict[int, subprocess.Popen[bytes]]:
        """Start the daemons of ``numbers`` at once (as :meth:`start_node`), then wait
        until each is ready: a cluster of eight starts in the time of its slowest
        daemon, not of eight in a row."""
        daemons: dict[int, DaemonProcess] = {}
        for i in numbers:
            self._index(i)
            if i in self.node_processes and self.node_processes[i].poll() is None:
                raise RuntimeError(f"node {i} is running; kill_node or stop_nodes first")
            node_dir = self.work / f"n{i}"
            shutil.rmtree(node_dir, ignore_errors=True)
            node_dir.mkdir(parents=True)
            daemons[i] = DaemonProcess(
                self._toml(i, peers, {**self.peer_settings, **(settings or {})}),
                cwd=node_dir,
                prefix=("ip", "netns", "exec", self.nodes[i - 1]),
                url=self.url(i),
            )
            self.processes.append(daemons[i].process)
            self.node_processes[i] = daemons[i].process
        for daemon in daemons.values():
            daemon.wait_ready(60.0)
        return {i: daemon.process for i, daemon in daemons.items()}

    def kill_node(self, i: int) -> None:
        """SIGKILL node ``i``'s daemon (a crash: nothing is flushed nor said to the
        peers) and reap it; its directory stays, as a dead machine's disk does."""
        process = self.node_processes.pop(i, None)
        if process is None:
            raise RuntimeError(f"node {i} is not running")
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait()
        self.processes.remove(process)

    def replace_node(
        self, i: int, *, peers: bool = True, settings: Mapping[str, PeerValue] | None = None
    ) -> subprocess.Popen[bytes]:
        """The machine of node ``i`` replaced: its daemon killed (SIGKILL) if it still
        runs, then a fresh one started with the same name, address and config and
        an empty cache (its old directory removed)."""
        if i in self.node_processes:
            self.kill_node(i)
        return self.start_node(i, peers=peers, settings=settings)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of each running daemon (``"n1"``...) and of the S3
        server (``"s3"``), from ``/proc`` (:func:`cpu_seconds`); the difference of
        two readings is what a run cost."""
        figures = {f"n{i}": cpu_seconds(p.pid) for i, p in sorted(self.node_processes.items())}
        if self.processes and self.processes[0] not in self.node_processes.values():
            figures["s3"] = cpu_seconds(self.processes[0].pid)
        return figures

    def _index(self, i: int) -> int:
        if not 1 <= i <= len(self.nodes):
            raise ValueError(f"no node {i}: the lab has nodes 1-{len(self.nodes)}")
        return i - 1

    def ready(self, i: int) -> bool:
        """Whether node ``i`` answers /readyz."""
        try:
            with urllib.request.urlopen(f"http://{self.address(i)}:8470/readyz", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def socket(self, i: int) -> Path:
        """Node ``i``'s local socket (the filesystem is shared: any process reaches it)."""
        return self.work / f"n{i}" / "chunkd.sock"

    def metric(self, i: int, sample: str) -> float:
        """The sum of node ``i``'s samples whose line starts with ``sample``."""
        with urllib.request.urlopen(f"{self.url(i)}/metrics", timeout=10) as response:
            body = response.read().decode()
        return sum(
            float(line.rpartition(" ")[2])
            for line in body.splitlines()
            if line.startswith(sample) and not line.startswith("#")
        )

    def stop_nodes(self) -> None:
        """Stop every daemon (moto stays)."""
        for process in self.processes[1:]:
            process.terminate()
        for process in self.processes[1:]:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        del self.processes[1:]
        self.node_processes.clear()

    def address(self, i: int) -> str:
        """Node ``i``'s address."""
        return f"{self.net}.{i}"

    def member(self, i: int) -> str:
        """Node ``i`` as the members name it: ``host:port``."""
        return f"{self.address(i)}:{PORT}"

    def url(self, i: int) -> str:
        """Node ``i``'s HTTP address, for the observer."""
        return f"http://{self.member(i)}"

    # -- chaos on one node's link ----------------------------------------------------

    def lose(self, i: int, percent: int) -> None:
        """Drop ``percent`` % of node ``i``'s packets at random, both directions.

        Every packet on its link (to and from the other nodes and S3) is dropped with
        that chance, independently: ``numgen random mod 100 < percent``, in the
        node's namespace. TCP sees loss (retransmits, timeouts); loopback and the
        observer do not.
        """
        if not 0 <= percent <= 100:
            raise ValueError(f"loss is a percentage, not {percent}")
        self._node_chaos(i).loss_percent = percent
        self._write_chaos(i)

    def partition(self, i: int, *, backend: bool = True) -> None:
        """Cut node ``i`` off from the other nodes, and from S3 unless ``backend`` is
        False; the cluster sees it vanish without a word (packets dropped, not
        refused), as when its cable is pulled or its switch port dies.

        ``backend=True`` (the default) is that pulled cable: one NIC carries both the
        peers and the object store, so a node cut off from its peers cannot read the
        backend either, and what it does meanwhile costs the backend nothing. With
        ``backend=False`` only the peer fabric is cut: the node then reads every
        chunk from the backend itself, which is correct but not a fan-out.
        """
        others = [self.address(n) for n in range(1, len(self.nodes) + 1) if n != i]
        self._node_chaos(i).cut_from = (*others, *([self.s3_ip] if backend else []))
        self._write_chaos(i)

    def delay(self, i: int, latency: float, jitter: float = 0.0, *, seed: int = 0) -> None:
        """Delay node ``i``'s TCP by ``latency`` ± ``jitter`` seconds each way.

        A :class:`~chunkd.testing.relay.LatencyRelay` starts in the node's namespace,
        and nftables ``redirect`` rules there send it the node's connections: inbound
        ones to port 8470 (peers asking it, not the observer) and outbound ones to
        every other lab address (its peers and S3). The relay finds where each was
        going (``SO_ORIGINAL_DST``) and connects on with ``SO_MARK``
        :data:`~chunkd.testing.relay.RELAY_MARK`, which the rules pass. Connections
        opened before this call keep their path; the daemons' configs do not change.
        """
        chaos = self._node_chaos(i)
        if chaos.relay is not None:
            raise RuntimeError(f"node {i} has a relay already; heal it first")
        ns = self.nodes[i - 1]
        chaos.relay = LatencyRelay.start(
            latency=latency,
            jitter=jitter,
            listen=f"0.0.0.0:{RELAY_PORT}",
            mark=RELAY_MARK,
            netns=ns,
            seed=seed,
        )
        # Outbound: to every lab address but this node and the observer. The relay's
        # own connections onwards carry its mark and go out as they are.
        _nft(
            ns,
            script=f"""
table ip {_RELAY_TABLE} {{
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname != "lo" ip saddr != {self.root_ip} tcp dport {PORT} redirect to :{RELAY_PORT}
  }}
  chain output {{
    type nat hook output priority -100; policy accept;
    meta mark {RELAY_MARK:#x} return
    ip daddr {self.net}.0/24 ip daddr != {{ {self.address(i)}, {self.root_ip} }} meta l4proto tcp \
      redirect to :{RELAY_PORT}
  }}
}}
""",
        )

    def chaos(self, i: int) -> Chaos:
        """What node ``i``'s chaos did so far (dropped packets, the relay's figures)."""
        chaos = self._chaos.get(i)
        if chaos is None:
            return Chaos()
        lost, cut = self._dropped(i)
        relay = chaos.relay.stats() if chaos.relay is not None else None
        return Chaos(lost_packets=lost, cut_packets=cut, relay=relay)

    def heal(self, i: int) -> Chaos:
        """Remove node ``i``'s chaos: its tables go and its relay stops (connections
        through it are cut, as a restarted middlebox cuts them). Returns what the
        chaos did."""
        chaos = self._chaos.pop(i, None)
        if chaos is None:
            return Chaos()
        ns = self.nodes[i - 1]
        try:
            lost, cut = self._dropped(i)
        except RuntimeError:
            lost = cut = 0
        try:
            # Added, then deleted: a table that was not there is no error (nft 1.0.6
            # has no "destroy").
            _nft(
                ns,
                script="".join(
                    f"table {family} {name} {{}}\ndelete table {family} {name}\n"
                    for family, name in (("inet", _CHAOS_TABLE), ("ip", _RELAY_TABLE))
                ),
            )
        finally:
            relay = chaos.relay.close() if chaos.relay is not None else None
        return Chaos(lost_packets=lost, cut_packets=cut, relay=relay)

    def heal_all(self) -> None:
        """Heal every node (the lab's teardown does it too)."""
        for i in list(self._chaos):
            self.heal(i)

    def _node_chaos(self, i: int) -> _NodeChaos:
        self._index(i)
        return self._chaos.setdefault(i, _NodeChaos())

    def _write_chaos(self, i: int) -> None:
        """Replace node ``i``'s chaos table with one made from its settings, in one
        transaction (add, delete, add: a table that was not there is no error)."""
        chaos = self._chaos[i]
        rules: dict[str, list[str]] = {"input": [], "output": []}
        for chain, way in (("input", "saddr"), ("output", "daddr")):
            hook = "iifname" if chain == "input" else "oifname"
            rules[chain] += [f'{hook} "lo" accept', f"ip {way} {self.root_ip} accept"]
            if chaos.cut_from:
                rules[chain].append(
                    f'ip {way} {{ {", ".join(chaos.cut_from)} }} counter name "cut" drop'
                )
            if chaos.loss_percent:
                rules[chain].append(
                    f'numgen random mod 100 < {chaos.loss_percent} counter name "lost" drop'
                )
        chains = "".join(
            f"  chain {chain} {{\n    type filter hook {chain} priority filter - 10; "
            f"policy accept;\n" + "".join(f"    {rule}\n" for rule in body) + "  }\n"
            for chain, body in rules.items()
        )
        # The counters outlive a rewrite: the drops of a loss and a later partition add up.
        lost, cut = self._dropped(i)
        _nft(
            self.nodes[i - 1],
            script=f"table inet {_CHAOS_TABLE} {{}}\ndelete table inet {_CHAOS_TABLE}\n"
            f"table inet {_CHAOS_TABLE} {{\n"
            f"  counter lost {{ packets {lost} bytes 0 }}\n"
            f"  counter cut {{ packets {cut} bytes 0 }}\n{chains}}}\n",
        )

    def _has_chaos_table(self, i: int) -> bool:
        listing = _nft(self.nodes[i - 1], "list", "tables")
        return f"inet {_CHAOS_TABLE}" in listing

    def _dropped(self, i: int) -> tuple[int, int]:
        """Packets node ``i``'s loss and partition rules dropped: (lost, cut)."""
        if not self._has_chaos_table(i):
            return 0, 0
        listing = json.loads(
            _nft(self.nodes[i - 1], "-j", "list", "counters", "table", "inet", _CHAOS_TABLE)
        )
        counters = {
            item["counter"]["name"]: int(item["counter"]["packets"])
            for item in listing["nftables"]
            if "counter" in item
        }
        return counters.get("lost", 0), counters.get("cut", 0)

    def _toml(self, i: int, peers: bool, settings: Mapping[str, PeerValue]) -> str:
        token = self.work / "token"
        token.write_text(TOKEN)
        token.chmod(0o600)
        members = ", ".join(
            json.dumps(self.member(n) + (f" rack={self.racks[n]}" if n in self.racks else ""))
            for n in range(1, len(self.nodes) + 1)
        )
        more = "".join(f"{key} = {_toml_value(value)}\n" for key, value in settings.items())
        section = (
            f'[peers]\nself = "{self.member(i)}"\nmembers = [{members}]\n'
            f'token_file = "{token}"\nhealth_interval = "300ms"\ndown_after = 4\n{more}'
            if peers
            else ""
        )
        node = self.work / f"n{i}"
        chunk = f"chunk_bytes = {self.chunk_bytes}\n" if self.chunk_bytes else ""
        return f"""
[server]
listen = "{self.member(i)}"
socket = "{node / "chunkd.sock"}"

[cache]
dir = "{node / "cache"}"
{chunk}ram_bytes = "2GiB"
disk_bytes = "4GiB"
disk_min_free_bytes = 0
fsync = "never"

{section}
{
            s3_backend(
                "ckpt",
                "s3://fanout/pre",
                f"http://{self.s3_ip}:9000",
                writable=True,
                retries=2,
                access_key_id=self.s3_keys[0],
                secret_access_key=self.s3_keys[1],
            )
        }"""


@contextmanager
def _picking() -> Iterator[None]:
    """Hold the machine's lock on picking a lab's /24 (other processes' labs wait)."""
    import fcntl

    with _PICK_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _free_net() -> str:
    """The first /24 of :data:`_NETS` no lab's observer has an address in now: two labs
    on one machine (two test runs) would otherwise both put 198.18.80.254 up in the
    root namespace, and one's requests would reach the other's nodes.

    Raises:
        LabUnavailable: every one is taken.
    """
    shown = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True
    ).stdout
    for third in _NETS:
        if f" 198.18.{third}.254/" not in shown:
            return f"198.18.{third}"
    raise LabUnavailable(f"{len(_NETS)} labs run on this machine already")


def _toml_value(value: PeerValue) -> str:
    """``value`` as TOML: a bool as true/false, a number as it is, a str quoted."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value)


def _tbf(rate: str, queue: str = "200ms") -> tuple[str, ...]:
    """A tbf qdisc's settings for a link of ``rate`` whose queue holds ``queue`` of it."""
    return ("rate", rate, "burst", "256kb", "latency", queue)


@contextmanager
def lab(
    work: Path,
    *,
    nodes: int = 4,
    node_rate: str = "400mbit",
    s3_rate: str = "80mbit",
    chunk_bytes: int | None = None,
    racks: Mapping[int, str] | None = None,
    peer_settings: Mapping[str, PeerValue] | None = None,
    queue: str = "200ms",
) -> Iterator[Lab]:
    """Build the namespaces; remove them, and stop what runs in them (relays too),
    on exit.

    Args:
        work: the nodes' directories go here.
        nodes: how many nodes (1 to :data:`MAX_NODES`).
        node_rate: each node's link, both ways (tc tbf rate).
        s3_rate: S3's link, both ways.
        chunk_bytes: the nodes' chunk size (None: the daemon's default).
        racks: node number to its failure domain label (``rack=R`` in the members).
        peer_settings: ``[peers]`` keys every node gets.
        queue: how much of its rate each link's queue holds (tbf ``latency``): what
            waits there delays everything behind it, the ACKs of a node's downloads
            included when its upload is full.

    Raises:
        LabUnavailable: not root, or iproute2/tc missing, or the kernel refuses.
        ValueError: ``nodes`` out of range, or a rack for a node the lab has not.
    """
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"a lab has 1 to {MAX_NODES} nodes, not {nodes}")
    if racks and not set(racks) <= set(range(1, nodes + 1)):
        raise ValueError(f"racks name nodes the lab has not: {sorted(set(racks))}")
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        raise LabUnavailable("network namespaces need root, iproute2 and tc")
    tag = f"{os.getpid() % 10000}{next(_LABS) % 10}"  # names of at most 15 bytes
    switch = f"ck{tag}sw"
    names = [f"ck{tag}n{i}" for i in range(1, nodes + 1)]
    s3_ns = f"ck{tag}s3"
    made: list[str] = []
    links: list[str] = []
    built = Lab(
        work,
        names,
        s3_ns,
        chunk_bytes=chunk_bytes,
        racks=dict(racks or {}),
        peer_settings=dict(peer_settings or {}),
        switch_ns=switch,
        queue=queue,
    )
    s3_number = int(built.s3_ip.rpartition(".")[2])
    try:
        # Two labs at once (two test runs) each get a /24 of their own; the lock is
        # held until this one's observer address is up, which is what marks it taken.
        with _picking():
            try:
                built.net = _free_net()
                _ip("netns", "add", switch)
                made.append(switch)
                _in(switch, "ip", "link", "add", "br0", "type", "bridge")
                _in(switch, "ip", "link", "set", "br0", "up")
                for i, ns in [*enumerate(names, start=1), (s3_number, s3_ns)]:
                    _ip("netns", "add", ns)
                    made.append(ns)
                    inner, outer = f"e{tag}x{i}", f"b{tag}x{i}"
                    _ip(
                        "link",
                        "add",
                        inner,
                        "netns",
                        ns,
                        "type",
                        "veth",
                        "peer",
                        "name",
                        outer,
                        "netns",
                        switch,
                    )
                    _in(switch, "ip", "link", "set", outer, "master", "br0", "up")
                    _in(ns, "ip", "addr", "add", f"{built.net}.{i}/24", "dev", inner)
                    _in(ns, "ip", "link", "set", inner, "up")
                    _in(ns, "ip", "link", "set", "lo", "up")
                    rate = s3_rate if ns == s3_ns else node_rate
                    # both ways: what the namespace sends (its end) and receives (the bridge's)
                    shape = _tbf(rate, queue)
                    _in(ns, "tc", "qdisc", "add", "dev", inner, "root", "tbf", *shape)
                    _in(switch, "tc", "qdisc", "add", "dev", outer, "root", "tbf", *shape)
                    built.links[ns] = (inner, outer)
                    if ns == s3_ns:
                        built.s3_link = inner
                root_if, root_peer = f"r{tag}x0", f"b{tag}x0"
                _ip(
                    "link",
                    "add",
                    root_if,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    root_peer,
                    "netns",
                    switch,
                )
                links.append(root_if)
                _in(switch, "ip", "link", "set", root_peer, "master", "br0", "up")
                _ip("addr", "add", f"{built.root_ip}/24", "dev", root_if)
                _ip("link", "set", root_if, "up")
            except subprocess.CalledProcessError as exc:
                raise LabUnavailable(
                    f"cannot build the namespaces here: {exc.stderr.decode().strip()}"
                ) from exc
        yield built
    finally:
        for chaos in built._chaos.values():  # the relays; the rules go with the namespaces
            if chaos.relay is not None:
                chaos.relay.close()
        built._chaos.clear()
        for process in built.processes:
            process.terminate()
        for process in built.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        for link in links:
            subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)
