"""The S3 front's benchmark still runs (tiny sizes). Its speeds are not checked here:
speed is measured by `make bench`, never by a timed test; the backend bytes are, since
one fetch for every process reading the same object is what the front promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_s3front_bench_quick_run_writes_its_rows(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--only", "s3front", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    results = tmp_path / "latest" / "results.json"  # the run's own folder
    rows = {row["scenario"]: row for row in json.loads(results.read_text())}
    for expected in (
        "s3 front: warm 8 MiB GetObject, vs /v1/objects (HTTP)",
        "s3 front: warm 8 MiB GetObject, vs Client.read (local socket)",
        "s3 front: warm 8 MiB GetObject, vs Client.read_into (local socket)",
        "s3 front: warm 8 MiB download_fileobj, vs /v1/objects (HTTP)",
        "s3 front: cold 8 MiB GetObject, vs the S3 server",
        "s3 front: 2 processes, same 8 MiB cold: wall time",
    ):
        assert expected in rows
    assert all(row["chunkd"] > 0 and row["baseline"] > 0 for row in rows.values())
    shared = rows["s3 front: 2 processes, same 8 MiB cold: backend bytes / data"]
    assert shared["chunkd"] <= 1.05  # one fetch for both processes
    assert shared["baseline"] >= 2  # each direct reader fetched the objects itself
    assert not (tmp_path / "work").exists()  # scratch space is cleaned up
