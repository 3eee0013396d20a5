"""Bulk dataset jobs on Ray: ``chunkd dataset register|check --ray`` on a real local Ray
cluster of two nodes (``ray.cluster_utils.Cluster``), each node with its own chunkd
daemon (the two peered), as users run them.

Ray registers its nodes on the machine's own interface even when told 127.0.0.1, so the
cluster, the daemons and the drivers run inside a network namespace the test makes,
where loopback is all there is (nothing leaves it); Ray's files live in a temporary
folder of the test's own (``RAY_TMPDIR``), so no other Ray on the machine is touched. The
cluster is stopped by its own handle (``Cluster.shutdown``), never ``ray stop``.
"""

from __future__ import annotations

import importlib.util
import io
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from chunkd.testing.daemon import DaemonProcess

from .conftest import BIN, Daemon, get_from_namespace, small_node_toml, wait_for_socket

HAVE_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(
    not HAVE_RAY,
    reason="ray is not installed (pip install 'chunkd[ray]'; make test installs it): "
    "the bulk jobs on a Ray cluster are not tested",
)
TOKEN = "a-shared-secret-for-the-ray-tests"
FILES = 12
BATCH = 3

# The cluster, in a process of its own inside the namespace: two nodes, each of whose
# workers reaches its own node's daemon through CHUNKD_SOCKET; the address on stdout;
# shut down by its handle when stdin closes.
_CLUSTER = """
import json, sys
from ray.cluster_utils import Cluster
sockets = json.loads(sys.argv[1])
common = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}
cluster = Cluster(
    initialize_head=True,
    head_node_args={**common, "include_dashboard": False,
                    "env_vars": {"CHUNKD_SOCKET": sockets[0]}},
)
try:
    for socket in sockets[1:]:
        cluster.add_node(**common, env_vars={"CHUNKD_SOCKET": socket})
    cluster.wait_for_nodes()
    # One task on each node first: both raylets run workers and see each other's CPUs
    # before a test's job spreads its tasks (the first job after a start could find
    # the later node not yet schedulable).
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On
    ray.init(address=cluster.address, log_to_driver=False)
    warm = ray.remote(num_cpus=1)(lambda: None)
    ray.get([warm.options(scheduling_strategy=On(n["NodeID"], soft=False)).remote()
             for n in ray.nodes() if n["Alive"]])
    ray.shutdown()
    print(json.dumps({"address": cluster.address}), flush=True)
    sys.stdin.read()
finally:
    cluster.shutdown()
"""


@dataclass
class Lab:
    """Two daemons and a two-node Ray cluster in the namespace ``ns``."""

    ns: str
    address: str
    root: Path
    daemons: list[Daemon]
    env: dict[str, str]

    def socket(self, node: int) -> Path:
        return self.root / f"n{node}" / "chunkd.sock"

    def run(
        self, *argv: str, node: int = 0, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """``argv`` inside the namespace, as a client of node ``node``'s daemon."""
        env = {**self.env, "CHUNKD_SOCKET": str(self.socket(node))}
        return subprocess.run(
            ["ip", "netns", "exec", self.ns, *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )

    def dataset(self, *args: str, node: int = 0) -> subprocess.CompletedProcess[str]:
        return self.run(str(BIN / "chunkd"), "dataset", *args, node=node)

    def reads(self, node: int) -> float:
        """Reads node ``node``'s daemon answered on its local socket."""
        return sum(
            self.metric(node, "chunkd_local_requests_total", op=op) for op in ("read", "readv")
        )

    def metric(self, node: int, name: str, **labels: str) -> float:
        status, body = get_from_namespace(self.ns, f"{self.daemons[node].url}/metrics")
        assert status == 200, body
        total = 0.0
        for line in body.splitlines():
            head, _, value = line.rpartition(" ")
            metric, _, label_text = head.partition("{")
            if metric == name and all(f'{k}="{v}"' in label_text for k, v in labels.items()):
                total += float(value)
        return total


def _node_toml(root: Path, node: int, ports: list[int]) -> str:
    members = ", ".join(f'"127.0.0.1:{p}"' for p in ports)
    return (
        small_node_toml(root / f"n{node}" / "cache", ("data", root / "data"))
        + f"""
[server]
listen = "127.0.0.1:{ports[node]}"
socket = "{root / f"n{node}" / "chunkd.sock"}"

[datasets]
registry = "data/registry"

[peers]
self = "127.0.0.1:{ports[node]}"
members = [{members}]
token_file = "{root / "token"}"
timeout = "2s"
health_interval = "300ms"
up_after = 1
"""
    )


def _write_parquet(root: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    for i in range(FILES):
        rows = 30 + 7 * i
        table = pa.table(
            {"id": list(range(rows)), "text": [f"row {n} of {i}" for n in range(rows)]}
        )
        sink = io.BytesIO()
        pq.write_table(table, sink, row_group_size=20)
        path = root / "data" / "pq" / f"part-{i:03d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(sink.getvalue())


def _write_bad_parquet(root: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder = root / "data" / "pqbad"
    folder.mkdir(parents=True)
    for i in range(3):
        sink = io.BytesIO()
        pq.write_table(pa.table({"id": list(range(10 * i, 10 * i + 10))}), sink)
        (folder / f"part-{i}.parquet").write_bytes(sink.getvalue())
    (folder / "part-1b.parquet").write_bytes(b"PAR1 this is no parquet footer PAR1")


def _write_jsonl(root: Path) -> None:
    folder = root / "data" / "js"
    folder.mkdir(parents=True)
    for i in range(6):
        (folder / f"good-{i}.jsonl").write_bytes(b'{"a": 1}\n' * (i + 1))
    (folder / "bad-1.jsonl").write_bytes(b'{"a": 1}\n{"a": oops}\n')
    (folder / "bad-2.jsonl").write_bytes(b'{"a": 1}\n\xff\xfe\n')
    (folder / "empty.jsonl").write_bytes(b"")


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    """The namespace, two peered daemons in it, and the Ray cluster; all stopped and
    removed afterwards, each by its own handle."""
    if not HAVE_RAY:
        pytest.skip("ray is not installed (pip install 'chunkd[ray]')")
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("the Ray cluster runs in a network namespace: that needs root and iproute2")
    from chunkd.testing import free_port

    ns = f"chunkd-ray{os.getpid()}"
    root = Path(tempfile.mkdtemp(prefix="ckray-"))  # short: Ray's socket paths live below
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHUNKD_", "RAY_"))}
    env["RAY_TMPDIR"] = str(root / "ray")
    (root / "ray").mkdir()
    (root / "token").write_text(TOKEN)
    (root / "token").chmod(0o600)
    launched: list[DaemonProcess] = []
    cluster: subprocess.Popen[bytes] | None = None
    added = subprocess.run(["ip", "netns", "add", ns], capture_output=True, check=False)
    if added.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"cannot make a network namespace here: {added.stderr.decode().strip()}")
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        _write_parquet(root)
        _write_bad_parquet(root)
        _write_jsonl(root)
        ports = [free_port(), free_port()]
        daemons = []
        for node in range(2):
            config = root / f"n{node}.toml"
            daemon = DaemonProcess(
                _node_toml(root, node, ports),
                cwd=root / f"n{node}",
                base_env=env,
                prefix=("ip", "netns", "exec", ns),
                log=root / f"daemon-{node}.log",
                config_path=config,
            )
            launched.append(daemon)
            daemons.append(Daemon(daemon.process, ports[node], config, daemon.cwd, env, daemon.log))
        with (root / "cluster.log").open("ab") as sink:
            sockets = json.dumps([str(root / f"n{n}" / "chunkd.sock") for n in range(2)])
            cluster = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-c", _CLUSTER, sockets],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=sink,
                start_new_session=True,
            )
        for node, daemon in enumerate(launched):
            daemon.wait_socket(root / f"n{node}" / "chunkd.sock", timeout=30)
        assert cluster.stdout is not None
        ready, _, _ = select.select([cluster.stdout], [], [], 60)
        line = cluster.stdout.readline() if ready else b""
        assert line, f"the Ray cluster did not start:\n{(root / 'cluster.log').read_text()[-4000:]}"
        address = json.loads(line)["address"]
        built = Lab(ns, address, root, daemons, env)
        deadline = time.monotonic() + 20
        while any(built.metric(n, "chunkd_peer_healthy") < 2 for n in range(2)):
            assert time.monotonic() < deadline, "the two daemons never saw each other up"
            time.sleep(0.2)
        yield built
    finally:
        if cluster is not None:
            if cluster.stdin is not None:
                cluster.stdin.close()  # the cluster shuts itself down by its handle
            if cluster.stdout is not None:
                cluster.stdout.close()
            try:
                cluster.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(cluster.pid, signal.SIGKILL)  # its own session: what it started
                cluster.wait(timeout=10)
        for daemon in launched:
            daemon.process.terminate()  # all at once: they stop side by side
        for daemon in launched:
            daemon.stop(timeout=15)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)


def _json(done: subprocess.CompletedProcess[str]) -> Any:
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@needs_ray
@pytest.mark.timeout(75)  # the first test starts the cluster (module fixture): ~20 s here
def test_a_registration_on_ray_gives_the_snapshot_of_a_local_one(lab: Lab) -> None:
    local = _json(lab.dataset("register", "pq-local", "data/pq", "--json"))
    reads_before = lab.reads(1)
    ray = _json(
        lab.dataset(
            "register", "pq-ray", "data/pq", "--ray", lab.address, "--batch", str(BATCH), "--json"
        )
    )
    assert ray["members"] == local["members"] == FILES
    assert ray["samples"] == local["samples"]
    # Page boundaries depend on the members alone: the same files, the same snapshot.
    assert ray["snapshot"] == local["snapshot"]
    assert ray["ray"]["tasks"] == FILES // BATCH
    assert ray["ray"]["nodes"] == 2, ray["ray"]
    # The driver used node 0's daemon; node 1's daemon read footers for the tasks that ran
    # there, through its own socket.
    assert lab.reads(1) > reads_before
    shown = _json(lab.dataset("show", "pq-ray", "--json"))
    assert shown["snapshot"] == local["snapshot"]
    for batch in ("0", "1025"):
        refused = lab.dataset("register", "pq-x", "data/pq", "--ray", lab.address, "--batch", batch)
        assert refused.returncode == 1
        assert "a batch is 1 to 1024 members" in refused.stderr
        assert "Traceback" not in refused.stderr


_KILLED = """
import json, os, signal, sys
from pathlib import Path
from chunkd.client import Client
from chunkd.client.datasets.bulk import register_on_ray, scan_batch
from chunkd.client.datasets.register import commit
from chunkd.errors import ChunkdError

marker, name, kills = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
address, retries = sys.argv[4], int(sys.argv[5])

def dies_halfway(backend, entries, options, skip_bad, concurrency=8):
    # The second batch's task: half its files scanned through the daemon, then its
    # worker dies (SIGKILL, as the OOM killer ends it), on its first `kills` attempts.
    if entries[0]["key"].endswith("part-003.parquet"):
        attempts = int(marker.read_text()) if marker.exists() else 0
        if attempts < kills:
            half = len(entries) // 2
            scan_batch(backend, entries[:half], options[:half], skip_bad, concurrency)
            marker.write_text(str(attempts + 1))
            os.kill(os.getpid(), signal.SIGKILL)
    return scan_batch(backend, entries, options, skip_bad, concurrency)

with Client() as client:
    try:
        snapshot, run = register_on_ray(
            client, "data/pq", address=address, batch=3, retries=retries, task=dies_halfway
        )
    except ChunkdError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
        sys.exit(0)
    keys = [m.key for m in snapshot.members]  # (its pages leave with the commit)
    answer = commit(client, name, snapshot)
    print(json.dumps({"snapshot": snapshot.id, "version": answer["version"], "keys": keys,
                      "tasks": run.tasks}))
"""


@needs_ray
@pytest.mark.timeout(45)
def test_a_task_killed_halfway_is_retried_into_the_same_snapshot(lab: Lab) -> None:
    local = _json(lab.dataset("register", "pq-base", "data/pq", "--json"))
    marker = lab.root / "killed-once"
    done = _json(
        lab.run(sys.executable, "-c", _KILLED, str(marker), "pq-retried", "1", lab.address, "3")
    )
    assert marker.read_text() == "1"  # the fault did fire, once
    assert done["snapshot"] == local["snapshot"]
    assert len(done["keys"]) == len(set(done["keys"])) == FILES  # no member twice
    assert done["tasks"] == FILES // BATCH
    assert done["version"] == 1  # one version: the commit is one, at the end
    listed = _json(lab.dataset("show", "pq-retried@1", "--json"))
    assert listed["members"] == FILES


@needs_ray
@pytest.mark.timeout(45)
def test_a_task_that_keeps_dying_fails_the_job_and_commits_nothing(lab: Lab) -> None:
    marker = lab.root / "killed-always"
    done = _json(
        lab.run(sys.executable, "-c", _KILLED, str(marker), "pq-dead", "99", lab.address, "1")
    )
    assert done["error"] == "DatasetError", done
    assert "failed after 1 retries" in done["message"]
    assert "nothing was committed" in done["message"]
    assert "part-003.parquet" in done["message"]  # which batch
    assert marker.read_text() == "2"  # the first run and its one retry
    missing = lab.dataset("show", "pq-dead")
    assert missing.returncode == 1
    assert "pq-dead" in missing.stderr
    assert "Traceback" not in missing.stderr


@needs_ray
@pytest.mark.timeout(45)
def test_a_file_that_is_not_its_format_fails_or_is_excluded_as_locally(lab: Lab) -> None:
    ray = ("--ray", lab.address, "--batch", "2")
    local = lab.dataset("register", "bad-local", "data/pqbad")
    failed = lab.dataset("register", "bad-ray", "data/pqbad", *ray)
    assert local.returncode == failed.returncode == 1, failed.stderr
    # The task's own error, not retried, as a local registration words it.
    said = failed.stderr.splitlines()[-1]
    assert said == local.stderr.splitlines()[-1].replace("bad-local", "bad-ray"), failed.stderr
    assert "pqbad/part-1b.parquet" in failed.stderr
    assert "Traceback" not in failed.stderr
    assert lab.dataset("show", "bad-ray").returncode == 1  # nothing registered
    skipped = _json(lab.dataset("register", "bad-ray", "data/pqbad", "--skip-bad", "--json", *ray))
    alone = _json(lab.dataset("register", "bad-local", "data/pqbad", "--skip-bad", "--json"))
    assert skipped["snapshot"] == alone["snapshot"]
    assert [e["key"] for e in skipped["excluded"]] == ["pqbad/part-1b.parquet"]


@needs_ray
@pytest.mark.timeout(45)
def test_check_on_ray_finds_what_a_local_check_finds(lab: Lab) -> None:
    _json(lab.dataset("register", "js", "data/js", "--json"))
    local = lab.dataset("check", "js", "--deep", "--json")
    ray = lab.dataset("check", "js", "--deep", "--json", "--ray", lab.address, "--batch", "2")
    assert local.returncode == ray.returncode == 1, (local.stderr, ray.stderr)
    found = json.loads(ray.stdout)
    assert found == json.loads(local.stdout)
    codes = {f["code"] for f in found}
    assert {"jsonl-not-json", "jsonl-not-utf8", "empty-member"} <= codes, found


@pytest.mark.timeout(30)
def test_without_ray_installed_the_error_says_how_to_install_it(
    start_daemon: Any, tmp_path: Path
) -> None:
    (tmp_path / "data" / "pq").mkdir(parents=True)
    (tmp_path / "data" / "pq" / "a.jsonl").write_bytes(b'{"a": 1}\n')
    start_daemon(
        small_node_toml(tmp_path / "cache", ("data", tmp_path / "data"))
        + '\n[datasets]\nregistry = "data/registry"\n'
    )
    assert wait_for_socket(tmp_path / "chunkd.sock", 10)
    # As where Ray is not installed: its import fails.
    without_ray = (
        "import sys; sys.modules['ray'] = None; "
        "from chunkd.gateway.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    env["CHUNKD_SOCKET"] = str(tmp_path / "chunkd.sock")
    for args in (("register", "pq", "data/pq", "--ray"), ("check", "pq", "--ray", "h:1")):
        done = subprocess.run(
            [sys.executable, "-c", without_ray, "dataset", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=20,
            check=False,
        )
        assert done.returncode == 1, done.stderr
        assert "pip install 'chunkd[ray]'" in done.stderr
        assert "Traceback" not in done.stderr
    alone = subprocess.run(
        [str(BIN / "chunkd"), "dataset", "register", "pq", "data/pq", "--batch", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=20,
        check=False,
    )
    assert alone.returncode == 1
    assert "--batch sizes the tasks of a job on Ray: give --ray too" in alone.stderr
    listed = subprocess.run(
        [str(BIN / "chunkd"), "dataset", "ls", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=20,
        check=True,
    )
    assert json.loads(listed.stdout) == []  # nothing registered


@pytest.mark.timeout(30)
def test_a_check_is_cut_into_runs_of_whole_pages() -> None:
    from chunkd.client.datasets.bulk import _slices
    from chunkd.snapshot import Member, Snapshot

    members = [Member(f"k/{i:06d}", 1, "v1", "jsonl", 1) for i in range(20_000)]
    paged = Snapshot.build(backend="data", prefix="k/", format="jsonl", members=members, schema=2)
    assert len(paged.pages) > 2  # content-defined ends: about one a 4,096 members
    starts = {0}
    for ref in paged.pages:
        starts.add(max(starts) + ref.members)
    runs = list(_slices(paged, 4096))
    assert runs[0][0] == 0
    assert runs[-1][1] == len(members)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(runs))  # contiguous, no overlap
    assert all(start in starts for start, _ in runs)  # each run starts a page
    assert all(stop - start >= 4096 for start, stop in runs[:-1])
    flat = Snapshot.build(
        backend="data", prefix="k/", format="jsonl", members=members[:10], schema=1
    )
    assert list(_slices(flat, 4)) == [(0, 4), (4, 8), (8, 10)]
