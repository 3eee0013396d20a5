"""The benchmarks still run (tiny sizes), and their report says what it should. Their
figures are not checked here: speed is measured by `make bench`, never by a timed test."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# bench/ is not installed: it runs from the checkout as `python -m bench`, so its modules
# are imported from there (pytest's importlib mode puts no folder on sys.path)
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import history  # noqa: E402
from bench.report import Report, Result, Rounds, interleave  # noqa: E402
from chunkd.testing.s3rver import s3rver_binary  # noqa: E402

FAULT_ROW = "a disarmed fault point, per call"


#: what a run leaves in --out: its scratch (OUT/w<N>) is gone
LEFT = {"runs", "latest", "history", ".latest.lock"}


# every scenario at tiny sizes: about two minutes on 2 cores before the fan-out ran 8 nodes
# and a replaced node (issue 29: 130 s of its own), three and a half since
@pytest.mark.timeout(480)
def test_bench_quick_run_writes_a_complete_report(tmp_path: Path) -> None:
    # A previous run on this machine whose spread for one row is far above anything a
    # disarmed fault point reaches (Mcall/s against an empty call: about 1x): the new
    # run's ratio falls below it, and the report must say so, as worse.
    probe = Report(quick=True)
    meta = history.run_meta(probe) | {"started": probe.started - 3600}
    previous = Result(
        FAULT_ROW, 500.0, 1.0, "Mcall/s", "x", samples=Rounds.of([400, 500, 600], [1, 1, 1])
    )
    history.save(tmp_path / "history", meta, [previous.row()], keep=50)

    result = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=450,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    run = tmp_path / "latest"
    rows = json.loads((run / "results.json").read_text())
    by_name = {row["scenario"]: row for row in rows}
    for expected in (
        "RAM insert 4 MiB, 4 in flight (hash, memfd, seal)",
        "disk insert 4 MiB, one at a time, no fsync",
        "RAM hit: id -> leased fd -> release (sync)",
        "index lookup, one id per call",
        "open index of 0.02M chunks + first lookup",
        "insert 64 KiB, RAM over disk: fault points unset vs removed",
        FAULT_ROW,
    ):
        assert expected in by_name
    if os.geteuid() == 0 and s3rver_binary() is not None:  # the cold-read lab can run
        cold = [row for row in rows if row["area"] == "cold reads at link speed"]
        assert {row["scenario"].split(",")[0] for row in cold} == {
            "headroom: s3rver unshaped (a direct GET) over the link the rows share",
            "cold read of one 16 MiB object",
            "cold read of 50 objects of 256 KiB",
        }
    assert all(row["chunkd"] > 0 and row["baseline"] > 0 for row in rows)
    # every scenario of the run of everything recorded how long it took
    from bench.__main__ import SCENARIOS

    durations = json.loads((run / "durations.json").read_text())
    ran = [s.name for s in SCENARIOS if s.runs_in == "every"]
    assert [d["scenario"] for d in durations] == ran
    assert all(d["seconds"] > 0 for d in durations)
    assert {row["part_of"] for row in rows} <= set(ran)
    # rows built on interleave carry their rounds and the spread of the ratio
    insert = by_name["RAM insert 4 MiB, 4 in flight (hash, memfd, seal)"]
    assert insert["rounds"] >= 2
    assert insert["spread"][0] <= insert["ratio"] <= insert["spread"][1]
    assert insert["area"] == "cache"
    assert by_name[FAULT_ROW]["area"] == "faults"

    report = (run / "report.md").read_text()
    assert "## cache" in report
    assert "| scenario | chunkd | baseline | unit | ratio | spread | rounds |" in report
    fault_line = next(line for line in report.splitlines() if line.startswith(f"| {FAULT_ROW}"))
    assert "WORSE: below the previous spread 400-600x" in fault_line

    page = (run / "report.html").read_text()
    assert page.startswith("<!doctype html>")
    assert "<script" not in page
    assert "Content-Security-Policy" in page
    assert '<h2 id="cache">cache</h2>' in page
    assert '<tr class="worse"><td>a disarmed fault point, per call</td>' in page
    plots = sorted(p.name for p in run.glob("plot-*.svg"))
    assert plots, "no plot was drawn"
    for name in plots:
        assert (run / name).read_text().lstrip().startswith("<?xml")
    # each plot is inside the page too: it opens alone, from anywhere
    assert page.count('<img src="data:image/svg+xml;base64,') == len(plots)

    kept = sorted((tmp_path / "history").glob("*.json"))
    assert len(kept) == 2
    latest = max((json.loads(p.read_text()) for p in kept), key=lambda d: d["started"])
    assert latest["quick"] is True
    assert latest["machine"]["cpus"] >= 1
    assert re.fullmatch(r"[0-9a-f]{40}", latest["commit"])
    assert {row["scenario"] for row in latest["rows"]} == set(by_name)
    assert {p.name for p in tmp_path.iterdir()} <= LEFT  # scratch space is cleaned up


@pytest.mark.timeout(90)  # the loader at tiny sizes: under a minute on 2 shared cores
def test_loader_bench_quick_run_reports_every_row(tmp_path: Path) -> None:
    # The loader bench runs apart from the quick run of everything (its rounds start
    # daemons and rank processes): each of its rows comes out, with figures on both sides.
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--only", "loader", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=85,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    results = tmp_path / "latest" / "results.json"
    rows = {row["scenario"]: row for row in json.loads(results.read_text())}
    expected = {
        "one process, warm: Loader epoch, batch.columns (decoded once by the daemon)",
        "one process, warm: Loader epoch, batch.columns (in-process)",
        "one process, warm: Loader epoch, batch.samples (per sample)",
        "4 ranks of one node: samples/s in all (Loader, shared decode)",
        "4 ranks of one node: units decoded per unit",
        "4 ranks of one node: peak decoded bytes held, within decoded_bytes",
        "JSON lines: Loader epoch, batch.columns",
        "WebDataset: Loader epoch, batch.columns",
        "MDS: Loader epoch, batch.columns",
    }
    assert expected <= set(rows)
    for name in expected - {"MDS: Loader epoch, batch.columns"}:  # no Streaming in --quick
        assert rows[name]["chunkd"] > 0, name
        assert rows[name]["baseline"] > 0, name
    assert rows["MDS: Loader epoch, batch.columns"]["chunkd"] > 0
    durations = json.loads((tmp_path / "latest" / "durations.json").read_text())
    assert [(d["scenario"], d["rows"]) for d in durations] == [("loader", len(rows))]
    # each unit decoded once by the daemon for the four ranks, and held within the budget
    assert rows["4 ranks of one node: units decoded per unit"]["chunkd"] == 1.0
    held = rows["4 ranks of one node: peak decoded bytes held, within decoded_bytes"]
    assert held["chunkd"] <= held["baseline"]
    assert {p.name for p in tmp_path.iterdir()} <= LEFT


def _row(scenario: str, figures: list[float], unit: str = "GB/s", **kw: object) -> Result:
    """A row whose baseline is 1 every round: its ratio is its figure."""
    samples = Rounds.of(figures, [1.0] * len(figures))
    return Result(
        scenario, sorted(figures)[len(figures) // 2], 1.0, unit, "b", samples=samples, **kw
    )  # type: ignore[arg-type]


def _runs(tmp_path: Path, *runs: list[Result], quick: bool = False) -> list[dict[str, object]]:
    """Save ``runs`` (oldest first) as history, and load them as a new run would."""
    report = Report(quick=quick)
    meta = history.run_meta(report)
    for age, rows in enumerate(reversed(runs), start=1):
        old = meta | {"started": report.started - 60 * age}
        history.save(tmp_path, old, [r.row() for r in rows], keep=50)
    return history.load(tmp_path, meta)


def test_a_figure_outside_the_previous_spread_is_marked_better_or_worse(tmp_path: Path) -> None:
    previous = _runs(
        tmp_path,
        [
            _row("rate", [1.0, 1.2, 1.4]),
            _row("time", [1.0, 1.2, 1.4], unit="s"),
            _row("steady", [1.0, 1.2, 1.4]),
            _row("once", [1.0]),
        ],
    )
    now = [
        _row("rate", [1.5, 1.6, 1.7]),  # above a rate's spread: better
        _row("time", [1.5, 1.6, 1.7], unit="s"),  # above a time's spread: worse
        _row("steady", [1.35, 1.39, 1.5]),  # the median is inside: not marked
        _row("once", [3.0, 3.0, 3.0]),  # the previous row had one round: no spread
        _row("new", [1.0, 2.0, 3.0]),  # no previous row: no change
    ]
    changes = history.compare(now, previous)
    assert {s: c.verdict for s, c in changes.items()} == {
        "rate": "better",
        "time": "worse",
        "steady": "within",
        "once": "no spread",
    }
    assert changes["rate"].text() == f"BETTER: above the previous spread 1-1.4x ({_today()})"
    assert changes["time"].text().startswith("WORSE: above the previous spread 1-1.4x")
    assert changes["steady"].text() == "within the previous spread 1-1.4x"
    assert not changes["once"].marked


def test_the_comparison_is_with_the_newest_run_that_has_the_row(tmp_path: Path) -> None:
    previous = _runs(
        tmp_path,
        [_row("a", [1.0, 1.1]), _row("b", [5.0, 5.1])],  # the oldest
        [_row("a", [2.0, 2.1])],  # newer, without "b"
    )
    changes = history.compare([_row("a", [1.05, 1.05]), _row("b", [5.05, 5.05])], previous)
    assert changes["a"].verdict == "worse"  # against 2.0-2.1, not 1.0-1.1
    assert changes["b"].verdict == "within"


def test_quick_runs_and_full_runs_are_not_compared(tmp_path: Path) -> None:
    _runs(tmp_path, [_row("a", [1.0, 1.1])], quick=True)
    full = history.load(tmp_path, history.run_meta(Report(quick=False)))
    assert full == []
    assert history.compare([_row("a", [9.0, 9.0])], full) == {}


def test_a_row_without_a_baseline_is_compared_on_its_own_figure(tmp_path: Path) -> None:
    def alone(figures: list[float]) -> Result:
        return Result("p99", figures[1], float("nan"), "ms", "none", samples=Rounds.of(figures))

    previous = _runs(tmp_path, [alone([10.0, 11.0, 12.0])])
    change = history.compare([alone([5.0, 6.0, 7.0])], previous)["p99"]
    assert change.verdict == "better"  # a time, lower
    assert change.text().startswith("BETTER: below the previous spread 10-12 ms")


def test_history_keeps_the_newest_runs_only(tmp_path: Path) -> None:
    report = Report()
    meta = history.run_meta(report)
    for i in range(7):
        history.save(tmp_path, meta | {"started": 1000.0 + i}, [], keep=5)
    (tmp_path / "notes.txt").write_text("not a run: left alone")
    kept = [json.loads(p.read_text())["started"] for p in tmp_path.glob("*.json")]
    assert sorted(kept) == [1002.0, 1003.0, 1004.0, 1005.0, 1006.0]
    assert (tmp_path / "notes.txt").exists()


def test_spread_of_rounds_that_do_not_pair_up() -> None:
    paired = Rounds.of([2.0, 4.0], [1.0, 2.0])
    assert paired.ratio_spread() == (2.0, 2.0)
    unpaired = Rounds.of([2.0, 4.0, 3.0], [1.0, 2.0])  # the widest the sides allow
    assert unpaired.ratio_spread() == (1.0, 4.0)
    assert Result("x", 3.0, 1.5, "GB/s", "b", samples=unpaired).spread_text() == "1-4x"
    assert Result("x", 3.0, 1.5, "GB/s", "b").spread is None  # one round
    with pytest.raises(ValueError, match="1 to 64 rounds"):
        Rounds.of([1.0] * 65)


async def test_interleave_keeps_every_rounds_rate() -> None:
    times = iter([1.0, 2.0, 4.0, 2.0, 1.0, 1.0, 3.0, 3.0])  # warm-ups, then 3 rounds

    async def fast() -> tuple[float, float]:
        return 8.0, next(times)

    async def slow() -> tuple[float, float]:
        return 8.0, next(times)

    rates = await interleave(3, {"fast": fast, "slow": slow})
    # round 0: fast then slow; round 1: slow then fast; round 2: fast then slow
    assert rates.per_round == {"fast": [2.0, 8.0, 8 / 3], "slow": [4.0, 8.0, 8 / 3]}
    assert rates["fast"] == 8 / 3  # the median, as before: a dict of floats
    assert rates.pair("fast", "slow", 1e-3).ratio_spread() == (0.5, 1.0)


def test_the_page_escapes_what_the_rows_say(tmp_path: Path) -> None:
    report = Report()
    report.area = "cache <b>"
    report.add(Result("<img src=x onerror=alert(1)>", 2.0, 1.0, "GB/s", "a & b", note="<i>"))
    report.latencies("latency <svg>", "<x>", [0.001, 0.002, 0.003])
    folder = report.write(tmp_path)
    page = (folder / "report.html").read_text()
    assert "<img src=x" not in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "<i>" not in page
    assert '<h2 id="cache-b">cache &lt;b&gt;</h2>' in page
    assert (folder / "plot-latency-svg.svg").exists()


def _today() -> str:
    import time

    return time.strftime("%Y-%m-%d", time.gmtime())


def test_ttfb_streaming_baseline_is_unavailable_where_its_venv_cannot_be_built(tmp_path: Path):
    # The time-to-first-batch bench reports MosaicML Streaming as unavailable, never
    # fails, where its venv is absent (--quick builds none) or a package will not install.
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from bench import streaming_side as side\n"
        "root = Path(sys.argv[1])\n"
        "print(type(side.ensure_venv(root, build=False)).__name__)\n"
        "side.TORCH_SPEC = 'torch==0.0.1'  # no such release: pip fails at once\n"
        "got = side.ensure_venv(root)\n"
        "print(type(got).__name__, root.exists())\n"
        "print(got.reason)\n"
    )
    venv = tmp_path / "streaming-venv"
    result = subprocess.run(
        [sys.executable, "-c", script, str(venv)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if not line.startswith("ttfb:")]
    missing, failed, reason = lines[-3:]
    assert missing == "Unavailable"
    assert failed == "Unavailable False"  # the half-built venv is gone: the next run retries
    assert "torch==0.0.1" in reason
    assert "install.log" in reason


def test_the_soak_summaries_become_latency_plots(tmp_path: Path) -> None:
    from bench.__main__ import _soak_latencies

    ops = {
        "read_range": {"count": 10, "p50": 0.001, "p99": 0.01, "max": 0.1},
        "gc": {"count": 0, "p50": 0.0, "p99": 0.0, "max": 0.0},  # never came up: no row
    }
    (tmp_path / "soak-full.json").write_text(json.dumps({"clients": 64, "ops": ops}))
    report = Report()
    report.area = "soak"
    _soak_latencies(report, tmp_path)  # no soak-solo.json: that plot is left out
    assert [(s.figure, s.label, s.x, s.y) for s in report.series] == [
        (
            "soak: latency per op, 64 clients at once",
            "read_range",
            (50, 99, 100),
            (0.001, 0.01, 0.1),
        )
    ]


# -- run folders, durations, --list and the verdict in words (issue 27) -----------------

#: the smallest scenario of the bench: 2 rows of the cache's index, a few seconds quick
SMALL = "index_lookups"


def _bench(out: Path, *args: str, timeout: float = 50) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "bench", *args, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """Two quick runs of the smallest scenario into one --out: the folder and each run's
    output."""
    out = tmp_path_factory.mktemp("bench-out")
    return out, [_bench(out, "--quick", "--only", SMALL).stdout for _ in range(2)]


def _printed_folder(stdout: str) -> Path:
    """The run folder a run says it wrote its report into."""
    match = re.search(r"^report: (\S+)/report\.html", stdout, re.M)
    assert match, stdout
    return Path(match[1])


@pytest.mark.timeout(60)  # two quick runs of one small scenario: about 10 s
def test_each_run_keeps_its_own_folder_and_latest_points_at_the_newest(
    two_runs: tuple[Path, list[str]],
) -> None:
    out, stdouts = two_runs
    runs = sorted((out / "runs").iterdir())
    assert len(runs) == 2
    first, second = (_printed_folder(s) for s in stdouts)
    assert first != second
    assert {first.resolve(), second.resolve()} == {r.resolve() for r in runs}
    for run in runs:  # the first run's report was not overwritten by the second's
        for name in ("report.html", "report.md", "results.json", "series.json"):
            assert (run / name).is_file(), (run, name)
    latest = out / "latest"
    assert latest.is_symlink()
    assert not Path(os.readlink(latest)).is_absolute()  # the folder can be moved whole
    assert latest.resolve() == second.resolve()
    assert not (out / "report.html").exists()  # nothing written beside the run folders
    assert len(list((out / "history").glob("*.json"))) == 2  # history is shared by the runs


@pytest.mark.timeout(60)
def test_every_scenario_prints_and_records_its_duration(two_runs: tuple[Path, list[str]]) -> None:
    out, stdouts = two_runs
    assert re.search(rf"^\s*{SMALL}: took \d+(\.\d+)? s \(2 rows\)$", stdouts[1], re.M), stdouts[1]
    assert re.search(r"^run took \d+(\.\d+)? s", stdouts[1], re.M), stdouts[1]
    run = out / "latest"
    durations = json.loads((run / "durations.json").read_text())
    assert [(d["scenario"], d["area"], d["rows"]) for d in durations] == [(SMALL, "cache", 2)]
    assert durations[0]["seconds"] > 0
    rows = json.loads((run / "results.json").read_text())
    assert {row["part_of"] for row in rows} == {SMALL}  # each row says whose duration it is
    report = (run / "report.md").read_text()
    assert "## Durations" in report
    assert re.search(rf"^\| {SMALL} \| cache \| \d+(\.\d+)? s \| 2 \|$", report, re.M), report
    page = (run / "report.html").read_text()
    assert '<h2 id="durations">Durations</h2>' in page
    assert re.search(rf"<td>{SMALL}</td><td>cache</td><td class=\"num\">\d+(\.\d+)? s</td>", page)
    newest = max(
        (json.loads(p.read_text()) for p in (out / "history").glob("*.json")),
        key=lambda d: (d["started"], d["serial"]),
    )
    assert [(d["scenario"], d["rows"]) for d in newest["durations"]] == [(SMALL, 2)]
    assert newest["durations"][0]["seconds"] > 0
    assert newest["folder"] == "runs/" + os.readlink(run).split("/")[-1]


@pytest.mark.timeout(60)
def test_list_shows_every_scenario_with_its_typical_duration(
    two_runs: tuple[Path, list[str]], tmp_path: Path
) -> None:
    from bench.__main__ import SCENARIOS

    out, _ = two_runs
    duration = r"~?\d+(\.\d+)? (s|min|h)\b"
    for quick in (True, False):
        listed = _bench(out, "--list", *(["--quick"] if quick else []), timeout=20).stdout
        lines = {line.split()[0]: line for line in listed.splitlines() if line.strip()}
        for scenario in SCENARIOS:
            assert scenario.name in lines, (scenario.name, listed)
            assert re.search(duration, lines[scenario.name]), lines[scenario.name]
        # the quick runs above are history for --quick; a full run has only the estimate
        assert "history" in lines[SMALL] if quick else "estimate" in lines[SMALL]
        assert "estimate" in lines["soak"]
        assert re.search(r"^a run of every scenario.*" + duration, listed, re.M), listed
    fresh = tmp_path / "never-ran"
    listed = _bench(fresh, "--list", timeout=20).stdout
    assert "estimate" in listed
    assert not fresh.exists()  # --list only reads


def test_a_missed_target_says_by_how_much_and_against_what(tmp_path: Path) -> None:
    registration = Result(
        "registration, 100k small Parquet files",
        5218.0,
        14559.0,
        "files/s",
        "pyarrow reading the footers",
        target_ratio=0.8,
    )
    text = registration.verdict_text()
    assert registration.verdict == "missed"
    assert "0.36x" in text  # the figure
    assert "pyarrow reading the footers" in text  # against what
    assert "5,218 vs 14,559 files/s" in text or "5218 vs 14559 files/s" in text
    assert "target 0.8x" in text
    assert "missed by 2.2x" in text
    first_batch = Result("first batch, warm node", 1.34, 1.10, "s", "Streaming", target_max=0.5)
    text = first_batch.verdict_text()
    assert "1.34 s against Streaming 1.1 s" in text
    assert "at most 0.5 s" in text
    assert "missed by 2.7x" in text
    close = Result("cold read", 0.94, 1.0, "GB/s", "obstore", target_ratio=0.95)
    assert "missed by 1%" in close.verdict_text()
    met = Result("insert", 2.0, 1.0, "GB/s", "memcpy", target_ratio=0.5)
    assert met.verdict == "met"
    assert met.verdict_text().endswith("(met)")

    report = Report()
    report.area = "datasets"
    for row in (registration, first_batch, met):
        report.add(row)
    assert report.missed() == [
        f"registration, 100k small Parquet files: {registration.verdict_text()}",
        f"first batch, warm node: {first_batch.verdict_text()}",
    ]
    folder = report.write(tmp_path)
    written = (folder / "report.md").read_text() + (folder / "report.html").read_text()
    assert "MISSED" not in written
    line = next(ln for ln in written.splitlines() if ln.startswith("| registration"))
    assert registration.verdict_text() in line
    rows = json.loads((folder / "results.json").read_text())
    assert rows[0]["verdict_text"] == registration.verdict_text()


# -- two runs at once (review of issue 27) -----------------------------------------------


@pytest.mark.timeout(10)
def test_two_runs_at_once_keep_their_own_scratch(tmp_path: Path) -> None:
    from bench.__main__ import scratch

    out = tmp_path / "out"
    first = history.new_run_folder(out, 1_800_000_000.0)
    second = history.new_run_folder(out, 1_800_000_000.0)
    with scratch(first, None) as mine:
        (mine / "half-written").write_bytes(b"x")
        with scratch(second, None) as theirs:
            assert theirs != mine
            (theirs / "other").write_bytes(b"y")
        # the other run ended (its scratch removed) mid-scenario of this one
        assert (mine / "half-written").read_bytes() == b"x"
    assert mine.parent == out  # OUT/w<N>: short, for the daemons' socket paths
    assert not mine.exists()
    # --work DIR: each run under its folder's name; DIR itself (someone's disk) stays
    disk = tmp_path / "nvme"
    with scratch(first, disk) as mine, scratch(second, disk) as theirs:
        assert mine.parent == theirs.parent == disk
        assert mine != theirs
    assert disk.is_dir()
    assert list(disk.iterdir()) == []


@pytest.mark.timeout(10)
def test_latest_points_at_the_newest_run_whichever_ends_last(tmp_path: Path) -> None:
    out = tmp_path / "out"
    older = history.new_run_folder(out, 1_800_000_000.0)
    newer = history.new_run_folder(out, 1_800_000_060.0)
    history.point_latest(out, newer)
    history.point_latest(out, older)  # the run that started first ends last
    assert (out / "latest").resolve() == newer.resolve()
    # serials sort as numbers: -10 is after -9
    ninth, tenth = out / "runs" / "20270115T080100Z-9", out / "runs" / "20270115T080100Z-10"
    ninth.mkdir()
    tenth.mkdir()
    history.point_latest(out, tenth)
    history.point_latest(out, ninth)
    assert (out / "latest").resolve() == tenth.resolve()
    # the same folder again, or a newer one, moves it
    history.point_latest(out, tenth)
    assert (out / "latest").resolve() == tenth.resolve()
    newest = history.new_run_folder(out, 1_800_000_120.0)
    history.point_latest(out, newest)
    assert (out / "latest").resolve() == newest.resolve()
    assert not Path(os.readlink(out / "latest")).is_absolute()


@pytest.mark.timeout(30)
def test_list_says_how_much_of_the_total_needs_root_or_cuda(tmp_path: Path) -> None:
    from bench.__main__ import SCENARIOS

    listed = _bench(tmp_path / "never-ran", "--list", timeout=20).stdout
    gated = sum(
        s.full_s for s in SCENARIOS if s.name in ("fanout", "coldlink", "ckpt_blocking_cuda")
    )
    line = next(ln for ln in listed.splitlines() if ln.startswith("a run of every scenario"))
    minutes = f"{gated / 60:.0f} min"
    assert f"of which ~{minutes} only as root / with CUDA" in line, line
