"""The benchmarks still run (tiny sizes). Their figures are not checked here: speed is
measured by `make bench`, never by a timed test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_bench_quick_run_writes_a_complete_report(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads((tmp_path / "results.json").read_text())
    scenarios = {row["scenario"] for row in rows}
    for expected in (
        "RAM insert 4 MiB, 4 in flight (hash, memfd, seal)",
        "disk insert 4 MiB, one at a time, no fsync",
        "RAM hit: id -> leased fd -> release (sync)",
        "index lookup, one id per call",
        "open index of 0.02M chunks + first lookup",
    ):
        assert expected in scenarios
    assert all(row["chunkd"] > 0 and row["baseline"] > 0 for row in rows)
    report = (tmp_path / "report.md").read_text()
    assert "| scenario | chunkd | baseline |" in report
    assert not (tmp_path / "work").exists()  # scratch space is cleaned up
