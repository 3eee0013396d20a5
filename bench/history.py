"""Each run kept on this machine, and each row compared with the previous run.

A run writes its report into a folder of its own, ``runs/<UTC time>/``
(``runs/20261204T101500Z/``), and ``latest`` (a relative symlink) points at the newest
one written. The run is also saved as ``history/<UTC time>.json``: its rows with their
rounds and spreads, each scenario's duration, the machine, the git commit, the date and
its folder. Only the last ``keep`` runs are kept (50 by default), folders and history
alike, the oldest removed. A scenario's typical duration (:func:`typical_durations`,
``python -m bench --list``) is the median of its last runs kept here.

A row is compared with the most recent earlier run that has a row of the same scenario,
ran in the same mode (``--quick`` or not) and on the same kind of machine (architecture,
CPU model, CPUs, memory: a container's host name changes, the machine does not). The
row's figure (its ratio, or chunkd's own figure where there is no baseline) is marked
when it falls outside that run's spread, the min and max of the figure over its rounds:
above or below, and whether that is better or worse. The machines are noisy, so a fixed
percentage would mark noise on one row and miss a real change on another; a run's own
spread says how much that row moves by itself. A previous row of one round has no
spread, and is not marked against.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .results import Result, Run, number_text

__all__ = [
    "Change",
    "compare",
    "load",
    "new_run_folder",
    "point_latest",
    "prune_runs",
    "run_meta",
    "save",
    "typical_durations",
]

FORMAT = 1
#: a history file's name: the run's start, UTC, and a serial if two runs share a second
_NAME = re.compile(r"^\d{8}T\d{6}Z(-\d+)?\.json$")
#: a run folder's name: the same, without the suffix
_RUN = re.compile(r"^(\d{8}T\d{6}Z)(?:-(\d+))?$")
#: how many of a scenario's latest durations its typical one is the median of
TYPICAL_OF = 5
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Change:
    """How a row compares with the same row of the previous run."""

    now: float
    previous: float
    #: the previous run's spread of the figure; ``None`` when it had one round
    spread: tuple[float, float] | None
    rounds: int
    date: str
    commit: str
    on_ratio: bool
    higher_is_better: bool
    unit: str

    @property
    def verdict(self) -> str:
        """'better' or 'worse' (outside the previous spread), 'within', or 'no spread'."""
        if self.spread is None or not math.isfinite(self.now):
            return "no spread"
        low, high = self.spread
        if low <= self.now <= high:
            return "within"
        return "better" if (self.now > high) == self.higher_is_better else "worse"

    @property
    def marked(self) -> bool:
        """Whether the row fell outside the previous run's spread."""
        return self.verdict in ("better", "worse")

    def text(self) -> str:
        """What the report's column says."""
        what = "ratio" if self.on_ratio else "figure"
        suffix = "x" if self.on_ratio else f" {self.unit}"
        verdict = self.verdict
        if verdict == "no spread":
            return f"previous {what} {number_text(self.previous)}{suffix} (one round, no spread)"
        assert self.spread is not None
        span = f"{number_text(self.spread[0])}-{number_text(self.spread[1])}{suffix}"
        if verdict == "within":
            return f"within the previous spread {span}"
        side = "above" if self.now > self.spread[1] else "below"
        return f"{verdict.upper()}: {side} the previous spread {span} ({self.date[:10]})"


def run_meta(report: Run) -> dict[str, Any]:
    """The run's date, machine, commit and mode, as its history file starts."""
    machine = _machine()
    return {
        "format": FORMAT,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(report.started)),
        "started": report.started,
        "seconds": round(time.time() - report.started, 1),
        "quick": report.quick,
        "machine": machine,
        "machine_key": _machine_key(machine),
        "durations": [d.to_json() for d in report.durations],
    } | _commit()


def this_machine() -> dict[str, Any]:
    """What a run's history says of the machine: ``machine`` and ``machine_key``."""
    machine = _machine()
    return {"machine": machine, "machine_key": _machine_key(machine)}


@dataclass(frozen=True)
class Typical:
    """A scenario's typical duration from the runs kept in history."""

    seconds: float
    #: how many runs it is the median of
    runs: int
    #: the newest of them, ``YYYY-MM-DD``
    date: str


def typical_durations(folder: Path, *, quick: bool) -> dict[str, Typical]:
    """Each scenario's median duration over its last :data:`TYPICAL_OF` runs in
    ``folder`` (history) in this mode on this kind of machine. A run where it gave no
    row (skipped: no root, no torch) does not count."""
    runs = load(folder, {"quick": quick} | this_machine())
    seen: dict[str, list[tuple[float, str]]] = {}
    for run in runs:  # newest first
        for entry in run.get("durations", ()):
            try:
                name, seconds, rows = str(entry["scenario"]), float(entry["seconds"]), entry["rows"]
            except (KeyError, TypeError, ValueError):
                continue
            if rows and math.isfinite(seconds) and len(seen.setdefault(name, [])) < TYPICAL_OF:
                seen[name].append((seconds, str(run.get("date", ""))[:10]))
    return {
        name: Typical(statistics.median(s for s, _ in got), len(got), got[0][1])
        for name, got in seen.items()
        if got
    }


def new_run_folder(out: Path, started: float) -> Path:
    """Make ``out/runs/<UTC time of started>/`` (a serial added if that is taken) and
    return it."""
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started))
    serial = 1
    while True:
        folder = runs / (stamp if serial == 1 else f"{stamp}-{serial}")
        try:
            folder.mkdir()
        except FileExistsError:  # two runs in one second (the tests): keep both
            serial += 1
            continue
        return folder


def _run_order(name: str) -> tuple[str, int] | None:
    """Where a run folder's name sorts among the runs: its UTC time, then its serial
    (``-10`` after ``-9``); None for a name that is no run's."""
    match = _RUN.match(name)
    return (match[1], int(match[2] or 1)) if match else None


def point_latest(out: Path, folder: Path) -> None:
    """Point ``out/latest`` at ``folder`` (relative, so ``out`` can move), replacing the
    link at once: a reader sees the previous run or this one, never neither.

    Only a folder that sorts at or after the one ``latest`` points at moves it: of two
    runs at once, the one that started last is the newest whichever ends last. The
    look and the replace hold a lock (``out/.latest.lock``), so that two runs ending
    together cannot both look before either replaces. A ``latest`` that is not a
    symlink is someone's own and is left alone, with a line."""
    import fcntl

    latest = out / "latest"
    with open(out / ".latest.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if latest.exists() and not latest.is_symlink():
            print(f"{latest} is not a symlink: left alone, not pointed at {folder}", flush=True)
            return
        if latest.is_symlink():
            current = _run_order(Path(os.readlink(latest)).name)
            mine = _run_order(folder.name)
            if current is not None and mine is not None and mine < current:
                print(
                    f"{latest} left at the newer run {os.readlink(latest)}, not pointed at "
                    f"{folder.name}",
                    flush=True,
                )
                return
        temporary = out / f".latest-{os.getpid()}"
        temporary.unlink(missing_ok=True)
        temporary.symlink_to(folder.relative_to(out))
        os.replace(temporary, latest)


def prune_runs(out: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` run folders of ``out/runs`` (by their names:
    the UTC time, then the serial). Other files there are left alone."""
    import shutil

    runs = out / "runs"
    if not runs.is_dir():
        return
    named = []
    for path in runs.iterdir():
        match = _RUN.match(path.name)
        if match and path.is_dir() and not path.is_symlink():
            named.append(((match[1], int(match[2] or 1)), path))
    named.sort()
    for _, path in named[: max(0, len(named) - keep)]:
        shutil.rmtree(path, ignore_errors=True)


def load(folder: Path, meta: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The runs kept in ``folder`` that ``meta``'s run compares with (same mode, same
    kind of machine), newest first. A file that is not a run (half written, another
    format) is skipped."""
    runs = []
    for path in _files(folder):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            continue
        if doc.get("quick") != meta["quick"] or doc.get("machine_key") != meta["machine_key"]:
            continue
        runs.append(doc)
    runs.sort(key=lambda d: (float(d.get("started", 0)), int(d.get("serial", 1))), reverse=True)
    return runs


def compare(results: Iterable[Result], previous: list[dict[str, Any]]) -> dict[str, Change]:
    """Each row's :class:`Change` against the newest run in ``previous`` (newest first)
    that has its scenario; rows no run has, or judged differently then (with a baseline
    then and none now), have none."""
    changes = {}
    for result in results:
        for run in previous:
            row = next(
                (r for r in run.get("rows", ()) if r.get("scenario") == result.scenario), None
            )
            if row is None:
                continue
            if bool(row.get("on_ratio")) == result.on_ratio:
                spread = row.get("spread")
                changes[result.scenario] = Change(
                    now=result.figure,
                    previous=float(row.get("figure", float("nan"))),
                    spread=(float(spread[0]), float(spread[1])) if spread else None,
                    rounds=int(row.get("rounds", 1)),
                    date=str(run.get("date", "")),
                    commit=str(run.get("commit", "")),
                    on_ratio=result.on_ratio,
                    higher_is_better=result.higher_is_better,
                    unit=result.unit,
                )
            break
    return changes


def save(folder: Path, meta: Mapping[str, Any], rows: list[dict[str, Any]], *, keep: int) -> Path:
    """Write the run as ``folder/<UTC time>.json`` and remove all but the newest ``keep``."""
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(float(meta["started"])))
    path = folder / f"{stamp}.json"
    serial = 1
    while path.exists():  # two runs in one second (the tests): keep both
        serial += 1
        path = folder / f"{stamp}-{serial}.json"
    # the serial orders two runs started in the same second
    text = json.dumps(dict(meta) | {"serial": serial, "rows": rows}, indent=1) + "\n"
    partial = path.with_suffix(".part")
    partial.write_text(text)
    partial.rename(path)  # a reader never sees half a run
    _prune(folder, keep)
    return path


def _files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return [p for p in folder.iterdir() if _NAME.match(p.name)]


def _prune(folder: Path, keep: int) -> None:
    def started(path: Path) -> tuple[float, str]:
        try:
            return float(json.loads(path.read_text()).get("started", 0)), path.name
        except (OSError, ValueError, AttributeError):
            return 0.0, path.name  # unreadable: the first to go

    files = sorted(_files(folder), key=started)
    for path in files[: max(0, len(files) - keep)]:
        path.unlink(missing_ok=True)


def _machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    return {
        "arch": platform.machine(),
        "cpu": model,
        "cpus": len(os.sched_getaffinity(0)),
        "memory_gib": round(memory / 2**30),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "host": platform.node(),
    }


def _machine_key(machine: Mapping[str, Any]) -> str:
    return f"{machine['arch']}|{machine['cpu']}|{machine['cpus']}|{machine['memory_gib']}"


def _commit() -> dict[str, Any]:
    """The checkout's commit, and whether files it tracks were changed."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30, check=False
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.TimeoutExpired):
        commit, dirty = "", False
    return {"commit": commit, "dirty": dirty}
