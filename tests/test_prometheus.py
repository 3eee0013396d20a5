"""chunkd's Prometheus rules and Grafana dashboard against a real Prometheus.

- ``promtool`` checks the rules and the example config, and runs the rules' unit tests
  (``deploy/prometheus/chunkd.rules.test.yml``), which must test every recording rule
  and every alert of ``chunkd.rules.yml``.
- A real Prometheus (Debian's 2.42, on loopback, 1 s scrapes and rule evaluations)
  scrapes two real daemons, peers of each other, while trainers run named jobs on them
  (a Client naming the job, a StallMeter per rank reporting windows of steps whose
  waits the test chose, reads, a checkpoint save). The recording rules'
  cluster figures must equal what the two daemons report themselves, added up: the
  cumulative rules (``...:ratio_total``, ``...:total``) to 1e-9 relative once the last
  scrape is in; the windowed stall (``...:ratio_rate5m``) within 0.02 absolute
  (``rate()`` extrapolates each node's series a little past its samples, by up to one
  scrape interval, so the nodes are weighted a few percent apart).
- Every query of every panel of the Grafana dashboard answers a non-empty result.

Skipped, saying why, where Prometheus is absent (``make test`` installs it as root).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkd.client import Client, StallMeter
from chunkd.client import checkpoint as ckpt
from chunkd.testing.ports import BIN, free_port
from chunkd.testing.prometheus import (
    RULES,
    PrometheusServer,
    prometheus_or_skip,
    promtool_or_skip,
)

from .conftest import Daemon

DEPLOY = RULES.parent.parent
RULES_TEST = DEPLOY / "prometheus" / "chunkd.rules.test.yml"
EXAMPLE_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "chunkd.json"

TOKEN = "a-shared-secret-for-the-prometheus-test"
MiB = 1 << 20
#: the cumulative rules add the very numbers the daemons print: equal but for rounding
EXACT = 1e-9
#: the windowed stall ratio against the daemons' own sums (see the module's docstring)
STALL_TOLERANCE = 0.02


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool_or_skip(), *args],
        cwd=RULES.parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.timeout(60)
def test_promtool_checks_the_rules_and_runs_their_unit_tests() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", str(RULES_TEST))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout
    # the example scrape config is valid, rules and all
    config = promtool("check", "config", str(EXAMPLE_CONFIG))
    assert config.returncode == 0, config.stdout + config.stderr


@pytest.mark.timeout(10)
def test_every_rule_and_alert_has_a_unit_test() -> None:
    rules = RULES.read_text()
    records = re.findall(r"^\s*- record: (\S+)$", rules, re.MULTILINE)
    alerts = re.findall(r"^\s*- alert: (\S+)$", rules, re.MULTILINE)
    assert len(records) > 20, records
    assert len(alerts) == 5, alerts
    tests = RULES_TEST.read_text()
    tested = set(re.findall(r"^\s*- expr: (\S+)$", tests, re.MULTILINE))
    assert set(records) <= tested, f"recording rules without a test: {set(records) - tested}"
    alerted = re.findall(r"^\s*alertname: (\S+)$", tests, re.MULTILINE)
    for alert in alerts:
        # an alert's test checks it both silent and firing
        blocks = re.findall(
            rf"alertname: {alert}\n\s*exp_alerts:(.*?)(?=\n\s*- eval_time|\n\s*- interval|\Z)",
            tests,
            re.DOTALL,
        )
        assert any(b.strip() == "[]" for b in blocks), f"{alert}: no test where it is silent"
        assert any("exp_labels" in b for b in blocks), f"{alert}: no test where it fires"
    assert set(alerts) <= set(alerted)


#: panels that reduce each frame's fields to one value a bar (options.reduceOptions)
_REDUCING = frozenset({"bargauge", "gauge", "stat", "piechart"})
#: transformations that join several queries' frames into one table
_JOINS = frozenset({"merge", "joinByField", "seriesToColumns"})


@pytest.mark.timeout(10)
def test_grafana_panels_draw_each_series() -> None:
    """What Grafana makes of each panel's frames, checked in the JSON (no Grafana here).

    A table-format answer is one frame, one row per series, one numeric field
    ``Value``: a reducing panel (bar gauge, stat) with ``reduceOptions.values: false``
    reduces that field to one bar named "Value", so it needs ``values: true`` or
    time-series frames (``format: time_series``, one frame a series, named by its
    ``legendFormat``). A table of several queries shows one frame at a time, behind a
    picker, unless a transformation merges them; its ``Value #A``... columns are then
    renamed to say what they are."""
    dashboard = json.loads(DASHBOARD.read_text())
    wrong = []
    for panel in _panels(dashboard["panels"]):
        title, targets = panel["title"], panel.get("targets", [])
        tables = [t for t in targets if t.get("format") == "table"]
        if panel["type"] in _REDUCING:
            values = panel["options"]["reduceOptions"].get("values", False)
            if tables and not values:
                wrong.append(f"{title}: table-format queries reduced to one 'Value' bar")
        if panel["type"] == "table":
            if len(tables) != len(targets) or not all(t.get("instant") for t in targets):
                wrong.append(f"{title}: a table of queries that are not instant tables")
            ids = [t["id"] for t in panel.get("transformations", [])]
            if len(targets) > 1:
                if not _JOINS & set(ids):
                    wrong.append(f"{title}: {len(targets)} queries and no merge: one shown")
                renamed = {
                    name
                    for t in panel.get("transformations", [])
                    if t["id"] == "organize"
                    for name in t["options"].get("renameByName", {})
                }
                unnamed = {f"Value #{t['refId']}" for t in targets} - renamed
                if unnamed:
                    wrong.append(f"{title}: columns not renamed: {sorted(unnamed)}")
        if tables and panel["type"] not in _REDUCING | {"table"}:
            wrong.append(f"{title}: a {panel['type']} over table-format queries")
    assert not wrong, "\n".join(wrong)


MAKEFILE = Path(__file__).resolve().parent.parent / "Makefile"
#: what an admin's own policy-rc.d says (make prometheus must never lose it)
ADMINS_POLICY = "#!/bin/sh\n# the admin's own\nexit 0\n"
#: the commands make prometheus runs, shimmed: root, an apt-get that does what
#: $SHIM_APT says (and notes what policy-rc.d said while it ran), and a systemctl
#: that does nothing (this machine's apt and services are never touched)
_SHIMS = {
    "id": "#!/bin/sh\necho 0\n",
    "systemctl": "#!/bin/sh\nexit 0\n",
    "apt-get": """#!/bin/sh
case "$*" in *install*) ;; *) exit 0 ;; esac
out="$SHIM_DIR/during-install"
cat "$POLICY_RC" > "$out.new" 2>/dev/null || echo absent > "$out.new"
mv "$out.new" "$out"
case "$SHIM_APT" in
ok) exit 0 ;;
fail) exit 100 ;;
hang) exec sleep 60 ;;
esac
""",
}


def make_prometheus(tmp: Path, apt: str) -> subprocess.Popen[str]:
    """``make prometheus`` as root on a machine without prometheus, its apt-get shimmed
    (``apt``: ok, fail, hang) and its policy-rc.d at ``tmp/policy-rc.d``."""
    shims = tmp / "shims"
    shims.mkdir(exist_ok=True)
    for name, text in _SHIMS.items():
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    policy = tmp / "policy-rc.d"
    return subprocess.Popen(
        [
            "/usr/bin/make",
            "-s",
            "-f",
            str(MAKEFILE),
            "prometheus",
            "PROMETHEUS_BIN=chunkd-test-no-such-prometheus",
            f"POLICY_RC={policy}",
        ],
        cwd=tmp,
        env={
            "PATH": f"{shims}:/usr/bin:/bin",
            "SHIM_APT": apt,
            "SHIM_DIR": str(shims),
            "POLICY_RC": str(policy),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _policy_files(tmp: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in tmp.glob("policy-rc.d*")}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("apt", ["ok", "fail", "SIGINT", "SIGTERM"])
@pytest.mark.parametrize("admins", [False, True], ids=["no-policy", "admins-policy"])
def test_make_prometheus_puts_policy_rc_back_however_apt_ends(
    tmp_path: Path, apt: str, admins: bool
) -> None:
    """The install runs under a policy-rc.d saying 101 (no service started), and
    whatever becomes of apt-get (done, failed, interrupted), the admin's own
    policy-rc.d is back as it was, or none is left where there was none."""
    if admins:
        (tmp_path / "policy-rc.d").write_text(ADMINS_POLICY)
    make = make_prometheus(tmp_path, apt if apt in ("ok", "fail") else "hang")
    if apt.startswith("SIG"):
        started = tmp_path / "shims" / "during-install"
        deadline = time.monotonic() + 15
        while not started.exists():
            assert time.monotonic() < deadline, make.communicate()
            time.sleep(0.05)
        os.killpg(make.pid, getattr(signal, apt))  # Ctrl-C, or a CI job cancelled
    output, _ = make.communicate(timeout=20)
    during = (tmp_path / "shims" / "during-install").read_text()
    assert during.rstrip().endswith("exit 101"), (during, output)
    want = {"policy-rc.d": ADMINS_POLICY} if admins else {}
    deadline = time.monotonic() + 10  # the recipe's shell may end just after make
    while _policy_files(tmp_path) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _policy_files(tmp_path) == want, output


@pytest.mark.timeout(30)
def test_make_prometheus_recovers_from_a_run_killed_mid_install(tmp_path: Path) -> None:
    """A run killed with -9 mid-install leaves its own policy-rc.d, and the admin's
    saved beside it: the next run must not save ours over theirs, and puts theirs back."""
    (tmp_path / "policy-rc.d").write_text(ADMINS_POLICY)
    started = tmp_path / "shims" / "during-install"
    make = make_prometheus(tmp_path, "hang")
    deadline = time.monotonic() + 15
    while not started.exists():
        assert time.monotonic() < deadline, make.communicate()
        time.sleep(0.05)
    os.killpg(make.pid, signal.SIGKILL)  # nothing runs after this: no trap
    make.communicate()
    left = _policy_files(tmp_path)
    assert left.get("policy-rc.d.chunkd-saved") == ADMINS_POLICY, left
    started.unlink()
    output, _ = make_prometheus(tmp_path, "ok").communicate(timeout=20)
    assert started.read_text().rstrip().endswith("exit 101"), output
    assert _policy_files(tmp_path) == {"policy-rc.d": ADMINS_POLICY}, output


@pytest.mark.timeout(30)
def test_make_prometheus_leaves_two_policy_files_alone(tmp_path: Path) -> None:
    """An admin's policy-rc.d beside a saved one (ours not among them): which to keep
    is not for make to guess; it installs nothing and touches neither."""
    (tmp_path / "policy-rc.d").write_text(ADMINS_POLICY)
    (tmp_path / "policy-rc.d.chunkd-saved").write_text("#!/bin/sh\nexit 104\n")
    before = _policy_files(tmp_path)
    output, _ = make_prometheus(tmp_path, "ok").communicate(timeout=20)
    assert not (tmp_path / "shims" / "during-install").exists(), output
    assert "policy-rc.d" in output, output
    assert _policy_files(tmp_path) == before


class Trainer:
    """One node's ranks of a job, through what a training loop uses: a :class:`Client`
    naming the job (its hello says ``train_job``) for reads, and a :class:`StallMeter`
    per rank, fed each step's wait and time (figures the test chose, not the clock's),
    that sends one ``loader_report`` a round."""

    def __init__(self, node: Daemon, train_job: str, ranks: tuple[int, ...]) -> None:
        self.client = Client(node.cwd / "chunkd.sock", train_job=train_job, cache_bytes=0)
        self.meters = [
            StallMeter(self.client, rank=rank, world_size=8, window=3600.0) for rank in ranks
        ]

    def round(self, steps: int, wait: float, step: float, reads: list[str]) -> None:
        """``steps`` steps of ``step`` seconds each rank, ``wait`` of which waited for
        data, reported; then ``reads`` read whole."""
        for meter in self.meters:
            for _ in range(steps):
                meter.add(wait, step)
            meter.flush()
        for name in reads:
            view = self.client.read(name)
            assert len(view) == MiB
            view.release()

    def close(self) -> None:
        for meter in self.meters:
            meter.close()  # the last report: end=true, no steps
        self.client.close()


def node_toml(tmp: Path, port: int, ports: list[int], data: Path) -> str:
    tmp.mkdir(parents=True, exist_ok=True)
    token = tmp / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    members = ", ".join(f'"127.0.0.1:{p}"' for p in ports)
    return f"""
[cache]
dir = "{tmp / "cache"}"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
chunk_bytes = "1MiB"
fsync = "never"

[peers]
self = "127.0.0.1:{port}"
members = [{members}]
token_file = "{token}"
timeout = "2s"
health_interval = "300ms"
down_after = 4
up_after = 1

[[backends]]
name = "data"
url = "file://{data}"
writable = true
price = "example-s3-internet"
"""


@pytest.fixture
def cluster(start_daemon: Callable[..., Daemon], tmp_path: Path) -> list[Daemon]:
    """Two daemons, peers of each other, over one ``file://`` backend priced as S3
    read over the internet (so that every byte fetched costs something)."""
    prometheus_or_skip()  # before starting anything
    data = tmp_path / "data"
    data.mkdir()
    for i in range(8):
        (data / f"obj-{i}").write_bytes(os.urandom(MiB))
    ports = [free_port() for _ in range(2)]
    nodes = [
        start_daemon(
            node_toml(tmp_path / f"n{i}", port, ports, data),
            cwd=tmp_path / f"n{i}",
            env={"CHUNKD_SERVER_LISTEN": f"127.0.0.1:{port}"},
            port=port,
        )
        for i, port in enumerate(ports)
    ]
    deadline = time.monotonic() + 30
    while any(n.metric("chunkd_peer_healthy") < 2 for n in nodes):
        assert time.monotonic() < deadline, "the nodes never saw each other up"
        time.sleep(0.1)
    return nodes


def _job_sums(node: Daemon, metric: str, label: str = "train_job") -> dict[str, float]:
    """A node's own ``/metrics``: ``metric``'s samples added up by ``label``."""
    status, _, body = node.get("/metrics")
    assert status == 200
    sums: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        if name != metric:
            continue
        found = re.search(rf'{label}="([^"]*)"', labels)
        key = found.group(1) if found else ""
        sums[key] = sums.get(key, 0.0) + float(value)
    return sums


def _added(*maps: dict[str, float]) -> dict[str, float]:
    total: dict[str, float] = {}
    for each in maps:
        for key, value in each.items():
            total[key] = total.get(key, 0.0) + value
    return total


def _close(got: dict[str, float], want: dict[str, float], rel: float) -> bool:
    return got.keys() == want.keys() and all(
        math.isclose(got[k], want[k], rel_tol=rel, abs_tol=1e-12) for k in want
    )


def chunkd_cost(*args: str) -> str:
    """``chunkd cost ARGS`` as a user runs it; its output (it must exit 0)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    done = subprocess.run(
        [str(BIN / "chunkd"), "cost", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _json(node: Daemon, path: str) -> Any:
    status, _, body = node.get(path)
    assert status == 200, body
    return json.loads(body)


def _panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel of a dashboard, rows and the panels in them included."""
    for item in items:
        yield item
        yield from _panels(item.get("panels", []))


def _panel_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in _panels(dashboard["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


#: what the test puts for the dashboard's variables (every job, every node; a window
#: that covers the test's life)
_VARIABLES = {"train_job": ".+", "instance": ".+", "__range": "5m", "__rate_interval": "1m"}


def _substitute(expr: str) -> str:
    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in _VARIABLES, f"the dashboard uses ${name}, which this test does not know"
        return _VARIABLES[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", value, expr)


@pytest.mark.timeout(120)
def test_prometheus_adds_up_two_daemons(cluster: list[Daemon], tmp_path: Path) -> None:
    nodes = cluster
    server = PrometheusServer([f"127.0.0.1:{n.port}" for n in nodes], tmp_path / "prometheus")
    with server:
        server.wait_for("sum(up) == 2", timeout=20)
        # train-a runs on both nodes (ranks 0-1 on n0 waiting 30% of each step, ranks 2-3
        # on n1 waiting 10%); train-b on n0 only (5%)
        a0 = Trainer(nodes[0], "train-a", (0, 1))
        a1 = Trainer(nodes[1], "train-a", (2, 3))
        b0 = Trainer(nodes[0], "train-b", (0,))
        runs = [(a0, 0.15, 0.5), (a1, 0.05, 0.5), (b0, 0.02, 0.4)]
        try:
            _check_the_cluster(server, nodes, runs)
        finally:
            # after every check: each job's end (every rank's end=true, then a quiet
            # minute) takes its series out of /metrics
            for trainer, _, _ in runs:
                trainer.close()


def _check_the_cluster(
    server: PrometheusServer, nodes: list[Daemon], runs: list[tuple[Trainer, float, float]]
) -> None:
    a0, b0 = runs[0][0], runs[2][0]
    # a job's loader histograms are exported at 0 from its start (the trainers'
    # hellos), so Prometheus has a 0 before the first report and rate() counts the
    # first window too
    server.wait_for(
        'count(chunkd_loader_step_seconds_count{train_job=~"train-a|train-b"} == 0) == 3'
    )
    for round_ in range(4):
        # two new objects a round, and one of the last round's again (cache
        # hits, and peers' chunks)
        reads = sorted({2 * round_, 2 * round_ + 1, max(0, 2 * round_ - 1)})
        for trainer, wait, step in runs:
            trainer.round(10, wait, step, [f"data/obj-{i}" for i in reads])
        if round_ == 0:
            # train-a saves a checkpoint through n0 (backend writes, their cost)
            state = {"w": np.arange(MiB // 4, dtype=np.float32)}
            ckpt.save(state, "data/ckpt/train-a/1", client=a0.client)
            for trainer, phases in (
                (b0, {"rank": 0, "metadata": 0.25, "total": 1.0}),
                (a0, {"rank": 1, "metadata": 0.5, "first_chunk": 0.25, "total": 2.0}),
            ):
                with trainer.client.request("ds_first_batch", phases):
                    pass
            # fetch-c only costs: an object read over HTTP naming it, no stall meter
            status, _, body = nodes[1].get(
                "/v1/objects/data/obj-7", headers={"X-Chunkd-Job": "fetch-c"}
            )
            assert (status, len(body)) == (200, MiB)
            # and a read that names no job: none, which only costs (no report came)
            status, _, body = nodes[0].get("/v1/objects/data/obj-6")
            assert (status, len(body)) == (200, MiB)
            # the first scrape after the first round (3 meters' 10 steps a rank)
            server.wait_for(
                'sum(chunkd_loader_step_seconds_count{train_job=~"train-a|train-b"}) >= 50'
            )
        time.sleep(1.0)
    for trainer, _, _ in runs:
        for meter in trainer.meters:
            assert (meter.reports, meter.failed) == (4, 0), meter

    # What the daemons say, added up: the truth the cluster's figures must equal.
    waits = _added(*(_job_sums(n, "chunkd_loader_wait_seconds_sum") for n in nodes))
    steps = _added(*(_job_sums(n, "chunkd_loader_step_seconds_sum") for n in nodes))
    assert {job for job, s in steps.items() if s > 0} == {"train-a", "train-b"}, steps
    assert waits["train-a"] == pytest.approx(4 * 10 * (2 * 0.15 + 2 * 0.05))
    assert waits.get("fetch-c") == 0  # a live job with no steps: its series at 0
    stall = {job: waits[job] / steps[job] for job in waits if steps[job] > 0}
    server.wait_for(
        "train_job:chunkd_loader_stall:ratio_total",
        lambda r: _close({s["metric"]["train_job"]: float(s["value"][1]) for s in r}, stall, EXACT),
        timeout=15,
    )
    # /v1/jobs says the same, node by node
    views = [_json(n, "/v1/jobs") for n in nodes]
    by_job: dict[str, list[float]] = {}
    for view in views:
        for job in view["jobs"]:
            if not job["steps"]:
                continue
            sums = by_job.setdefault(job["name"], [0.0, 0.0])
            sums[0] += job["wait_seconds"]
            sums[1] += job["step_seconds"]
    assert {j: w / s for j, (w, s) in by_job.items()} == pytest.approx(stall, rel=EXACT)

    # The windowed stall: train-a's two nodes at 30% and 10% of equal steps, 20%.
    # Three more scrapes of both nodes first: rate() extrapolates each series by up
    # to a scrape interval, a share of its sampled span that these make smaller.
    settled = max(server.scrapes().values()) + 3 * server.interval
    server.wait_for("min(timestamp(up))", lambda r: float(r[0]["value"][1]) >= settled)
    windowed = server.values("train_job:chunkd_loader_stall:ratio_rate5m", by="train_job")
    assert windowed.keys() == stall.keys()
    for job, ratio in stall.items():
        assert abs(windowed[job] - ratio) <= STALL_TOLERANCE, (job, windowed, stall)
    assert stall["train-a"] == pytest.approx(0.2)

    # Cost: spent, without chunkd, saved, by job, as the nodes' counters add up.
    for rule, metric in (
        ("spent", "chunkd_cost_dollars_total"),
        ("direct", "chunkd_cost_direct_dollars_total"),
        ("saved", "chunkd_cost_saved_dollars_total"),
    ):
        want = _added(*(_job_sums(n, metric) for n in nodes))
        assert want.get("train-a", 0) > 0, (metric, want)
        server.wait_for(
            f"train_job:chunkd_cost_{rule}_dollars:total",
            lambda r, want=want: _close(
                {s["metric"]["train_job"]: float(s["value"][1]) for s in r}, want, EXACT
            ),
            timeout=10,
        )
        # the nodes' /v1/cost, added up by each row's label, says the same (a peer's
        # request for a job not live on the owner is charged there under `other`)
        ledger: dict[str, float] = {}
        for node in nodes:
            for job in _json(node, "/v1/cost")["jobs"]:
                figure = job[rule]
                figure = sum(figure.values()) if isinstance(figure, dict) else figure
                ledger[job["label"]] = ledger.get(job["label"], 0) + figure
        for job, value in want.items():
            assert ledger.get(job, 0.0) == pytest.approx(value, rel=1e-6), (rule, ledger, want)
        rates = server.values(f"train_job:chunkd_cost_{rule}_dollars:rate5m", by="train_job")
        assert rates.get("train-a", 0) > 0, rates

    # chunkd cost --prometheus: the same cluster figures, as a user asks for them.
    truth = {
        rule: _added(*(_job_sums(n, metric) for n in nodes))
        for rule, metric in (
            ("spent", "chunkd_cost_dollars_total"),
            ("direct", "chunkd_cost_direct_dollars_total"),
            ("saved", "chunkd_cost_saved_dollars_total"),
        )
    }
    asked = json.loads(chunkd_cost("--prometheus", server.url, "--json"))
    rows = {row["job"]: row for row in asked["jobs"]}
    for rule, want in truth.items():
        for job, value in want.items():
            got = rows[job][rule]
            got = sum(got.values()) if isinstance(got, dict) else got
            assert got == pytest.approx(value, rel=EXACT), (rule, job, rows)
    table = chunkd_cost("--prometheus", server.url, "--job", "train-a")
    line = next(row for row in table.splitlines() if row.startswith("train-a "))
    assert f"{truth['spent']['train-a']:.4f} USD" in line, table
    # over a window: what rate() counts since the first scrape, never more than all
    windowed = json.loads(chunkd_cost("--prometheus", server.url, "--since", "10m", "--json"))
    spent = {row["job"]: row["spent"] for row in windowed["jobs"]}
    assert 0 < spent["train-a"] <= truth["spent"]["train-a"] * 1.2, (spent, truth)

    # Every panel of the Grafana dashboard answers, from the templated datasource,
    # and each of its variables' label_values() lists what the test ran.
    dashboard = json.loads(DASHBOARD.read_text())
    empty = []
    for title, expr in _panel_queries(dashboard):
        if not server.query(_substitute(expr)):
            empty.append(f"{title}: {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    listed = {}
    for name in ("train_job", "instance"):
        found = re.fullmatch(r"label_values\((.+), (\w+)\)", variables[name]["definition"])
        assert found, variables[name]
        selector, label = found.groups()
        listed[name] = set(server.api(f"label/{label}/values", **{"match[]": selector}))
    # the jobs with a stall meter, and those that only cost (fetch-c's loader series
    # are at 0, but none has none)
    assert listed["train_job"] >= {"train-a", "train-b", "fetch-c", "none"}, listed
    assert listed["instance"] == {f"127.0.0.1:{n.port}" for n in nodes}, listed
