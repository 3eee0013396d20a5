"""The cost ledger's own rules (issue 30, review R1): which series it makes and keeps,
what survives a restart and what /metrics counts from 0, what its file holds.

Real parts: the real JobTable and Ledger with a test clock; one real daemon for the
restart and the damaged file.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from chunkd.errors import InvalidRequestError
from chunkd.gateway.costs import ledger as ledger_module
from chunkd.gateway.costs.ledger import Ledger
from chunkd.gateway.costs.prices import Prices
from chunkd.gateway.costs.since import parse_since
from chunkd.gateway.jobs.table import JobTable
from tests.conftest import Daemon
from tests.test_cost import _cost, _job, _samples

Clock = list[float]


def _ledger(
    now: Clock, *, top: int = 16, names: int = 64, tracked: int = 1024, **kwargs: Any
) -> Ledger:
    jobs = JobTable(top=top, idle=60.0, tracked=tracked, clock=lambda: now[0], wall=lambda: now[0])
    return Ledger(
        jobs,
        prices=kwargs.pop("prices", Prices({**Prices().tables}, {"data": "example-s3-internet"})),
        names=names,
        tracked=tracked,
        idle=60.0,
        clock=lambda: now[0],
        **kwargs,
    )


def _by(ledger: Ledger, metric: str, *labels: str) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for key, value in _samples(ledger, metric).items():
        found: dict[str, str] = dict(cast(Any, key))  # (label, value) pairs
        k = tuple(found[label] for label in labels)
        out[k] = out.get(k, 0.0) + value
    return out


def _read(ledger: Ledger, job: str | None, name: str | None, n: int = 1) -> None:
    ledger.charge(job, None, name, "bytes", "data", "read", n)


@pytest.mark.timeout(10)
def test_a_charge_naming_a_backend_the_daemon_has_not_makes_no_series() -> None:
    now = [1000.0]
    ledger = _ledger(now)
    for backend in ("nope", "x" * 1000):
        ledger.charge("run", None, "d", "request", backend, "get", 1)
        ledger.charge("run", None, "d", "bytes", backend, "read", 10)
        ledger.charge("run", None, "d", "direct", backend, "get", 10)
        ledger.charge("run", None, "d", "served", "ram", 10, backend, 10)
    ledger.charge("run", None, "d", "request", "data", "frobnicate", 1)  # no such op
    ledger.charge("run", None, "d", "written", "novel", 5, "data")  # no such kind
    ledger.charge("run", None, "d", "request", "data", "get", 1)
    backends = {
        dict(key).get("backend")
        for family in ledger.collector().collect()
        for sample in family.samples
        for key in [tuple(sample.labels.items())]
    }
    assert backends <= {None, "data"}
    row = _job(ledger.view(), "run")
    assert row["backend_requests"] == {"get": 1}
    assert row["direct_requests"] == {}
    assert row["saved"] == {"cache": 0.0, "peer": 0.0}  # no credit priced off no backend
    assert row["served_bytes"]["ram"] == 20  # served by the cache all the same
    assert row["written_bytes"] == {}


@pytest.mark.timeout(10)
def test_after_a_restart_metrics_count_from_zero_and_the_view_keeps_the_history(
    tmp_path: Path,
) -> None:
    now = [1000.0]
    path = tmp_path / "cost.json"
    ledger = _ledger(now, state_path=path)
    _read(ledger, "run-1", "text", 100)
    _read(ledger, None, None, 7)
    asyncio.run(ledger.save())
    again = _ledger(now, state_path=path)
    # Nothing counted by this process yet: no series (Prometheus saw a reset; its
    # increase() must not count the 107 bytes a second time).
    assert _by(again, "chunkd_cost_backend_bytes_total", "train_job") == {}
    view = again.view()
    assert _job(view, "run-1")["backend_bytes"]["read"] == 100
    assert view["totals"]["backend_bytes"]["read"] == 107
    _read(again, "run-1", "text", 5)
    _read(again, None, None, 1)
    assert _by(again, "chunkd_cost_backend_bytes_total", "train_job") == {
        ("run-1",): 5,
        ("none",): 1,
    }
    row = _job(again.view(), "run-1")
    assert row["backend_bytes"]["read"] == 105
    assert [(n["name"], n["backend_bytes"]["read"]) for n in row["names"]] == [("text", 105)]
    # And again: carried once, never twice.
    asyncio.run(again.save())
    third = _ledger(now, state_path=path)
    assert third.view()["totals"]["backend_bytes"]["read"] == 113
    assert _by(third, "chunkd_cost_backend_bytes_total", "train_job") == {}


@pytest.mark.timeout(10)
def test_the_file_keeps_an_hour_of_minutes_and_a_day_of_hours_per_job(tmp_path: Path) -> None:
    now = [1000.0]
    path = tmp_path / "cost.json"
    ledger = _ledger(now, state_path=path)
    for _ in range(1440):  # a day of busy minutes
        _read(ledger, "run", "text", 1)
        ledger.tick()
        now[0] += 60
    kept = ledger_module.RING_MINUTES + ledger_module.RING_HOURS
    asyncio.run(ledger.save())
    state = json.loads(path.read_text())
    (job,) = state["jobs"]
    assert len(job["minutes"]) + len(job["hours"]) <= kept
    # a snapshot is a few numbers: a day of one job is a few kB, not 1440 dicts
    assert path.stat().st_size < kept * 400
    # since: exact where a snapshot is kept (the last hour's minutes, then hourly)
    view = ledger.view(since=now[0] - 60 * 30 - 60)
    assert _job(view, "run")["backend_bytes"]["read"] == 30
    hours_ago = ledger.view(since=now[0] - 5 * 3600)
    counted_from = hours_ago["since"]
    assert now[0] - 6 * 3600 <= counted_from <= now[0] - 5 * 3600
    read = _job(hours_ago, "run")["backend_bytes"]["read"]
    assert read == round((now[0] - 60 - counted_from) / 60)  # the reads after it
    # read back: the same answers
    again = _ledger(now, state_path=path)
    assert _job(again.view(since=now[0] - 60 * 30 - 60), "run")["backend_bytes"]["read"] == 30


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "text",
    [
        "[]",
        "null",
        "5",
        '"x"',
        '{"version": 2}',
        '{"version": 2, "started": "x", "jobs": []}',
        '{"version": 2, "started": 0, "jobs": {}}',
        '{"version": 2, "started": 0, "jobs": [5]}',
        '{"version": 2, "started": 0, "jobs": [{"job": 5, "label": "a", "created": 0,'
        ' "touched": 0, "accounts": {}}]}',
        '{"version": 2, "started": 0, "jobs": [{"job": "a", "label": "a", "created": 0,'
        ' "touched": 0, "accounts": []}]}',
        '{"version": 2, "started": 0, "jobs": [{"job": "a", "label": "a", "created": 0,'
        ' "touched": 0, "accounts": {"-": {"bytes": [["data", "read", "9"]]}}}]}',
        '{"version": 2, "started": 0, "jobs": [{"job": "a", "label": "a", "created": 0,'
        ' "touched": 0, "accounts": {}, "minutes": [[0, [1, 2]]]}]}',
        '{"version": 2, "started": NaN, "jobs": []}',
        '{"version": 2, "started": 0, "jobs": [], "ended": []}',
        '{"version": 2, "started": 0, "jobs": [], "gc": [{"backend": 1}]}',
    ],
)
def test_a_cost_file_of_the_wrong_shape_is_set_aside_and_the_ledger_starts_from_zero(
    tmp_path: Path, text: str
) -> None:
    now = [1000.0]
    path = tmp_path / "cost.json"
    path.write_text(text)
    ledger = _ledger(now, state_path=path)
    assert not path.exists()
    assert (tmp_path / "cost.json.damaged").read_text() == text
    assert ledger.started == 1000.0
    assert ledger.view()["jobs"] == []
    _read(ledger, "run", "text", 3)
    assert ledger.view()["totals"]["backend_bytes"]["read"] == 3


@pytest.mark.timeout(10)
def test_a_names_label_holds_while_it_lives_and_letting_go_keeps_the_jobs_figures() -> None:
    now = [1000.0]
    ledger = _ledger(now, names=1)
    _read(ledger, "job1", "a")  # a takes the one slot
    _read(ledger, "job1", "b")  # b: other
    for _ in range(4):  # a goes quiet; b is read on
        now[0] += 30
        _read(ledger, "job1", "b")
    # a was let go (a slot free), but b lives: still other, never moved to b.
    assert _by(ledger, "chunkd_cost_backend_bytes_total", "train_job", "name") == {
        ("job1", "other"): 5
    }
    # a's figures stay in the job's row; since never goes back.
    row = _job(ledger.view(), "job1")
    assert row["backend_bytes"]["read"] == 6
    assert {n["name"]: n["backend_bytes"]["read"] for n in row["names"]} == {"a": 1, "other": 5}
    ledger.tick()
    mark = now[0]
    now[0] += 60
    for _ in range(5):
        _read(ledger, "job1", "b")
    now[0] += 31
    _read(ledger, "job1", None)  # the job lives on
    now[0] += 31  # b let go too
    _read(ledger, "job1", "c")  # a new name's life: labelled
    assert _job(ledger.view(since=mark), "job1")["backend_bytes"]["read"] == 7
    assert _job(ledger.view(), "job1")["backend_bytes"]["read"] == 13
    assert _by(ledger, "chunkd_cost_backend_bytes_total", "train_job", "name") == {
        ("job1", "other"): 10,
        ("job1", "-"): 1,
        ("job1", "c"): 1,
    }


@pytest.mark.timeout(10)
def test_a_job_past_tracked_stays_other_until_it_goes_quiet() -> None:
    now = [1000.0]
    ledger = _ledger(now, tracked=3)
    for job in ("j1", "j2", "j3"):
        _read(ledger, job, None)
    tries: list[float] = []
    retire_one = ledger._retire_one

    def counted(*now: float) -> bool:
        tries.append(1.0)
        return retire_one(*now)

    ledger._retire_one = counted  # type: ignore[method-assign,assignment]
    _read(ledger, "j4", None)  # tracked busy: other
    for _ in range(100):
        _read(ledger, "j4", None)
    # decided once: its later charges look for no room (no pass over the jobs)
    assert len(tries) == 1
    for _ in range(4):  # j1..j3 go quiet; j4 reads on
        now[0] += 30
        _read(ledger, "j4", None)
    # a slot could be had now, but j4 lives: other to its end, never moved to j4
    assert _by(ledger, "chunkd_cost_backend_bytes_total", "train_job").get(("j4",)) is None
    assert _by(ledger, "chunkd_cost_backend_bytes_total", "train_job")[("other",)] == 105
    now[0] += 61  # j4 quiet: a new start may be kept by name
    _read(ledger, "j4", None)
    assert _by(ledger, "chunkd_cost_backend_bytes_total", "train_job")[("j4",)] == 1


@pytest.mark.timeout(10)
def test_the_names_bound_holds_across_restarts(tmp_path: Path) -> None:
    now = [1000.0]
    path = tmp_path / "cost.json"
    for start in range(4):
        ledger = _ledger(now, names=2, state_path=path)
        for i in range(3):
            _read(ledger, None, f"d{start}-{i}")
        names = {n for _, n in _by(ledger, "chunkd_cost_backend_bytes_total", "train_job", "name")}
        assert names == {f"d{start}-0", f"d{start}-1", "other"}
        asyncio.run(ledger.save())
        now[0] += 10
    view = _ledger(now, names=2, state_path=path).view()
    assert view["totals"]["backend_bytes"]["read"] == 12
    (row,) = view["jobs"]
    assert len(row["names"]) <= 2 + 2  # the carried names are bounded too


@pytest.mark.timeout(10)
def test_a_since_too_far_back_or_ahead_is_a_clear_error_or_clamped_never_infinite() -> None:
    with pytest.raises(InvalidRequestError, match="is no time"):
        parse_since("9" * 310 + "d", 1000.0)
    assert parse_since("1e300", 1000.0) == 1000.0 + 86400
    assert parse_since("-5", 1000.0) == 0.0
    now = [1000.0]
    ledger = _ledger(now)
    _read(ledger, "run", None)
    for since in (-1e308, 1e308, float("inf"), float("-inf"), float("nan")):
        json.dumps(ledger.view(since=since), allow_nan=False)


@pytest.mark.timeout(10)
def test_a_job_that_ends_and_starts_again_counts_from_zero_in_metrics_and_its_row_goes_on() -> None:
    now = [1000.0]
    ledger = _ledger(now)
    _read(ledger, "run-7", "text", 30)
    assert _by(ledger, "chunkd_cost_backend_bytes_total", "train_job") == {("run-7",): 30}
    now[0] += 120  # ended (idle)
    _read(ledger, "run-7", "text", 5)  # a new start, same label
    assert _by(ledger, "chunkd_cost_backend_bytes_total", "train_job") == {("run-7",): 5}
    assert _job(ledger.view(), "run-7")["backend_bytes"]["read"] == 35


@pytest.mark.timeout(10)
def test_one_job_naming_many_datasets_holds_a_bounded_number_of_names() -> None:
    now = [1000.0]
    per_job = ledger_module.NAMES_PER_JOB
    ledger = _ledger(now, names=per_job * 4)
    for i in range(per_job + 50):
        _read(ledger, "greedy", f"invented-{i}")
    labels = _by(ledger, "chunkd_cost_backend_bytes_total", "train_job", "name")
    assert len(labels) == per_job + 1  # its first names, and other
    assert labels[("greedy", "other")] == 50
    _read(ledger, "honest", "text/web")  # another job's name is labelled still
    assert ("honest", "text/web") in _by(
        ledger, "chunkd_cost_backend_bytes_total", "train_job", "name"
    )


@pytest.mark.timeout(10)
def test_the_currency_is_that_of_the_tables_in_use_that_charge() -> None:
    from chunkd.gateway.config.schema import PriceTable

    euro = PriceTable(0.05, 0.0004, 0.005, 0.02, currency="EUR")
    prices = Prices({**Prices().tables, "eu": euro}, {"data": "eu", "files": "free"}, "free")
    assert prices.currency == "EUR"


@pytest.mark.timeout(60)
def test_a_restarted_daemon_shows_history_in_cost_zero_in_metrics_and_sets_a_bad_file_aside(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.bin").write_bytes(b"x" * 4096)
    toml = f"""
[cache]
dir = "{tmp_path / "cache"}"
ram_bytes = "64MiB"
disk_bytes = "64MiB"

[[backends]]
name = "data"
url = "file://{data}"
"""
    daemon = start_daemon(toml)
    status, _, body = daemon.get("/v1/objects/data/a.bin", {"X-Chunkd-Job": "run-1"})
    assert status == 200, body
    assert daemon.metric("chunkd_cost_direct_requests_total", train_job="run-1") == 1
    assert daemon.stop() == 0
    daemon = start_daemon(toml)
    assert _job(_cost(daemon), "run-1")["direct_requests"] == {"get": 1}
    assert daemon.metric("chunkd_cost_direct_requests_total") == 0
    assert daemon.stop() == 0
    state = tmp_path / "cache" / "cost.json"
    state.write_text("[]")
    daemon = start_daemon(toml)
    assert _cost(daemon)["jobs"] == []
    assert (tmp_path / "cache" / "cost.json.damaged").read_text() == "[]"


@pytest.mark.timeout(10)
def test_a_peers_request_for_a_remote_job_never_takes_a_slot_of_this_nodes_top() -> None:
    # top = 1: a peer asking for its own node's job first must not leave this node's
    # trainer `other` for its whole life.
    now = [1000.0]
    ledger = _ledger(now, top=1)
    ledger.charge("remote-job", None, "d", "bytes", "data", "read", 10, remote=True)
    assert ledger.jobs.live_labels() == frozenset()
    assert ledger.jobs.label("local-job") == "local-job"  # the slot is still free
    assert _by(ledger, "chunkd_cost_backend_bytes_total", "train_job") == {("other",): 10.0}
    # A job live here is charged under its own label, even for a peer's request.
    ledger.charge("local-job", None, "d", "bytes", "data", "read", 5, remote=True)
    assert _by(ledger, "chunkd_cost_backend_bytes_total", "train_job") == {
        ("other",): 10.0,
        ("local-job",): 5.0,
    }
    with pytest.raises(InvalidRequestError):
        ledger.jobs.label("other", start=False)
