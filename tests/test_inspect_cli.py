"""``chunkd inspect`` as users run it: a subprocess against a real daemon and its real
inspector workers, on real Parquet, JSON lines and dataset snapshots, and once in a
real terminal (tmux) to see the rendered table and an image preview."""

from __future__ import annotations

import base64
import json
import math
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import BIN, Daemon, free_port, wait_for_socket

MEDIA = Path(__file__).parent / "data" / "media"


@pytest.fixture
def node(start_daemon: Any, tmp_path: Path) -> Daemon:
    """A daemon on the embedded default: ``local`` is ``./chunkd-data``."""
    (tmp_path / "chunkd-data").mkdir()
    daemon: Daemon = start_daemon()
    assert wait_for_socket(tmp_path / "chunkd.sock", 10)
    return daemon


def put(tmp_path: Path, key: str, body: bytes) -> None:
    path = tmp_path / "chunkd-data" / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body)


def env() -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    environ["COLUMNS"] = "120"
    return environ


def inspect(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "chunkd"), "inspect", "--url", daemon.url, *args],
        capture_output=True,
        text=True,
        env=env(),
        timeout=110,
        check=False,
    )


def ok(daemon: Daemon, *args: str) -> str:
    done = inspect(daemon, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def parquet(tmp_path: Path, key: str, rows: int) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "chunkd-data" / key
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "id": list(range(rows)),
            "city": [f"city-{i}" for i in range(rows)],
            "score": [i / 4 for i in range(rows)],
        }
    )
    pq.write_table(table, path, row_group_size=25)


def test_a_parquet_file_shows_its_summary_and_a_page_of_rows(node: Daemon, tmp_path: Path) -> None:
    parquet(tmp_path, "table/part-0.parquet", 60)
    out = ok(node, "local/table/part-0.parquet", "--start", "10", "--count", "3")
    assert "local/table/part-0.parquet" in out
    assert "parquet" in out
    for column in ("id", "city", "score"):
        assert column in out
    assert "row groups (3)" in out
    assert "rows 10 to 12 of 60" in out
    for i in (10, 11, 12):
        assert f"city-{i}" in out
    assert "city-13" not in out
    assert "city-9 " not in out
    assert "next page: --start 13" in out
    only = ok(node, "local/table/part-0.parquet", "--count", "2", "--columns", "city")
    assert "city-1" in only
    assert "score" not in only.split("rows 0 to 1")[1]
    as_json = json.loads(ok(node, "local/table/part-0.parquet", "--count", "2", "--json"))
    assert as_json["open"]["num_rows"] == 60
    assert [r["value"]["id"] for r in as_json["rows"]["rows"]] == [0, 1]


def test_json_lines_fold_long_strings_unless_full(node: Daemon, tmp_path: Path) -> None:
    long = "word " * 2000
    records = [{"n": i, "text": long if i == 1 else f"short {i}"} for i in range(5)]
    put(tmp_path, "lines.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in records))
    out = ok(node, "local/lines.jsonl")
    assert "jsonl" in out
    assert "short 4" in out
    assert "more chars, --full" in out
    assert len(out) < 6000  # the 10,000-character string is folded to a few lines
    full = ok(node, "local/lines.jsonl", "--full", "--count", "2")
    assert full.count("word") >= 2000


def test_a_sample_of_an_object(node: Daemon, tmp_path: Path) -> None:
    records = [{"n": i, "label": f"label-{i}"} for i in range(10)]
    put(tmp_path, "lines.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in records))
    out = ok(node, "local/lines.jsonl#7")
    assert "local/lines.jsonl#7" in out
    assert '"label-7"' in out
    assert "label-6" not in out
    assert "label-8" not in out
    answer = json.loads(ok(node, "local/lines.jsonl#7", "--json"))
    assert answer["value"] == records[7]


def test_a_dataset_its_snapshots_a_sample_a_diff_and_a_step(node: Daemon, tmp_path: Path) -> None:
    parquet(tmp_path, "ds/part-0.parquet", 40)
    register = [str(BIN / "chunkd"), "dataset", "register", "cities", "local/ds/", "--quiet"]
    socket_env = env() | {"CHUNKD_SOCKET": str(tmp_path / "chunkd.sock")}
    subprocess.run(register, env=socket_env, check=True, timeout=110, capture_output=True)
    parquet(tmp_path, "ds/part-1.parquet", 20)
    subprocess.run(register, env=socket_env, check=True, timeout=110, capture_output=True)

    versions = ok(node, "cities")
    assert "dataset cities" in versions
    # a dataset named like an object: its first segment no backend, or no such key
    for name in ("text/cities", "local/cities"):
        subprocess.run(
            [*register[:3], name, *register[4:]],
            env=socket_env, check=True, timeout=110, capture_output=True,
        )  # fmt: skip
        assert f"dataset {name}" in ok(node, name)
    assert "40" in versions
    assert "60" in versions
    snapshot = ok(node, "cities@2")
    assert "ds/part-0.parquet" in snapshot
    assert "ds/part-1.parquet" in snapshot
    assert "local" in snapshot
    assert "60" in snapshot
    sample = ok(node, "cities@2#45")
    assert "ds/part-1.parquet" in sample  # global sample 45 is row 5 of the second file
    assert '"city-5"' in sample
    diff = ok(node, "--diff", "cities@1", "cities@2")
    assert "1 added" in diff
    assert "part-1.parquet" in diff
    step = ok(
        node,
        "--step", "1", "--ref", "cities@2", "--seed", "3",
        "--batch-size", "2", "--world-size", "2", "--count", "2",
    )  # fmt: skip
    assert "rank 0" in step
    assert "rank 1" in step
    answer = json.loads(
        ok(
            node,
            "--step",
            "1",
            "--ref",
            "cities@2",
            "--seed",
            "3",
            "--batch-size",
            "2",
            "--world-size",
            "2",
            "--json",
        )
    )
    ids = answer["step"]["ranks"]["0"]["ids"]
    assert len(ids) == 2
    for sample_id in ids:
        assert sample_id in step
    # Each sample shown is the one its id names.
    first = answer["samples"][0]
    assert first["id"] == f"local/{ids[0]}"
    index = int(ids[0].rpartition("#")[2])
    assert first["value"]["city"] == f"city-{index}"


def test_a_malformed_file_prints_why_and_exits_1(node: Daemon, tmp_path: Path) -> None:
    put(tmp_path, "broken.parquet", b"PAR1" + os.urandom(200))
    done = inspect(node, "local/broken.parquet")
    assert done.returncode == 1
    assert "broken.parquet" in done.stderr
    assert "Parquet" in done.stderr
    assert "Traceback" not in done.stderr
    put(tmp_path, "bad.jsonl", b'{"a": 1}\n{"a": \n')
    done = inspect(node, "local/bad.jsonl", "--start", "1")
    assert done.returncode == 1, done.stdout
    assert "bad.jsonl" in done.stderr


def test_missing_things_and_an_unreachable_daemon_exit_1(node: Daemon) -> None:
    done = inspect(node, "local/nothing.parquet")
    assert done.returncode == 1
    assert "nothing.parquet" in done.stderr
    done = inspect(node, "nosuch@1")
    assert done.returncode == 1
    assert "nosuch" in done.stderr
    done = subprocess.run(
        [str(BIN / "chunkd"), "inspect", "--url", f"http://127.0.0.1:{free_port()}", "local/x"],
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "no answer from" in done.stderr
    assert "chunkd serve" in done.stderr


def test_a_listing_page(node: Daemon, tmp_path: Path) -> None:
    for i in range(5):
        put(tmp_path, f"dir/file-{i}.bin", b"x" * (i + 1))
    put(tmp_path, "dir/sub/deeper.bin", b"y")
    out = ok(node, "local/dir/")
    for i in range(5):
        assert f"local/dir/file-{i}.bin" in out
    assert "local/dir/sub/" in out
    page = ok(node, "local/dir/", "--count", "2")
    assert "file-1.bin" in page
    assert "file-2.bin" not in page
    assert "--after" in page


def test_control_characters_in_data_never_reach_the_terminal(node: Daemon, tmp_path: Path) -> None:
    record = {"text": "\x1b]0;pwned\x07\x1b[2Jred\x9b31m"}
    put(tmp_path, "evil.jsonl", json.dumps(record, ensure_ascii=False).encode() + b"\n")
    for args in (["local/evil.jsonl"], ["local/evil.jsonl#0"], ["local/evil.jsonl", "--json"]):
        out = ok(node, *args)
        assert "\x1b" not in out
        assert "\x07" not in out
        assert "\x9b" not in out
        assert "pwned" in out


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_in_a_terminal_a_table_and_an_image_preview(node: Daemon, tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    parquet(tmp_path, "table.parquet", 30)
    put(tmp_path, "picture.png", (MEDIA / "picture.png").read_bytes())
    chunkd = f"{BIN / 'chunkd'} inspect --url {node.url}"

    def screen(command: str, until: str) -> str:
        # A tmux server of its own each time: a killed server may still be exiting when
        # the next one would start under the same name.
        server = f"chunkd-test-{os.getpid()}-{time.monotonic_ns()}"
        subprocess.run(
            ["tmux", "-L", server, "new-session", "-d", "-x", "100", "-y", "30",
             f"{command}; sleep 30"],
            check=True, env=env() | {"TERM": "xterm-256color"}, timeout=30,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            text = ""
            while time.monotonic() < deadline:
                text = subprocess.run(
                    ["tmux", "-L", server, "capture-pane", "-p"],
                    capture_output=True, text=True, check=True, timeout=30,
                ).stdout  # fmt: skip
                if until in text:
                    return text
                time.sleep(0.2)
            raise AssertionError(f"{until!r} never showed:\n{text}")
        finally:
            subprocess.run(["tmux", "-L", server, "kill-server"], check=False, timeout=30)

    table = screen(f"{chunkd} local/table.parquet --count 5", "next page")
    lines = table.splitlines()
    header = next(line for line in lines if "city" in line and "score" in line)
    assert header.startswith("┃")
    assert header.rstrip().endswith("┃")
    for i in range(5):
        assert any(f"city-{i}" in line and line.startswith("│") for line in lines)
    assert all(len(line) <= 100 for line in lines)
    picture = screen(f"{chunkd} local/picture.png", "pixels")
    assert "image/png" in picture
    assert "48x32 pixels" in picture
    assert sum(line.count("▀") for line in picture.splitlines()) >= 48 * 10
    plain = screen(f"{chunkd} local/picture.png --no-preview; echo done-here", "done-here")
    assert "image/png" in plain
    assert "▀" not in plain


def _table_rows(out: str) -> list[list[str]]:
    """The body lines of each row of the first table in ``out`` (rich's box drawing:
    a row's first line has its index in the first column)."""
    rows: list[list[str]] = []
    body = out.split("┡", 1)[1].split("└", 1)[0].splitlines()[1:]
    for line in body:
        if not line.startswith("│"):
            continue
        if line.split("│")[1].strip():
            rows.append([])
        rows[-1].append(line)
    return rows


@pytest.mark.timeout(60)
def test_rl_logprobs_are_one_strip_and_a_summary_a_rollout(node: Daemon, tmp_path: Path) -> None:
    logprobs = [-0.1] * 90 + [-3.0] * 10
    records = [
        {"group": 0, "prompt": "2+2?", "completion": f"two and two make {i}, I think",
         "reward": i / 4, "advantage": i / 8 - 0.2, "logprobs": logprobs}
        for i in range(4)
    ]  # fmt: skip
    put(tmp_path, "rl.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in records))
    narrow = subprocess.run(
        [str(BIN / "chunkd"), "inspect", "--url", node.url, "local/rl.jsonl", "--rl"],
        capture_output=True, text=True, env=env() | {"COLUMNS": "80"}, timeout=60, check=True,
    ).stdout  # fmt: skip
    rows = _table_rows(narrow)
    assert len(rows) == 4, narrow
    # the strip on one line, its summary wrapped under it: a few lines a rollout, not 17
    for row in rows:
        assert sum(bool(line.split("│")[-2].strip()) for line in row) <= 3, narrow
    # a bar per 7 tokens, each its tokens' mean probability: the last three hold -3.0
    assert "▇" * 12 + "▆" + "▁" * 2 in narrow
    assert "[-0.1" not in narrow
    # floats in 4 significant digits, as on the page
    assert "0.04999999999999999" not in narrow
    assert "│ 0.05 " in narrow
    assert "orange below p 0.5" in narrow
    wide = subprocess.run(
        [str(BIN / "chunkd"), "inspect", "--url", node.url, "local/rl.jsonl", "--rl"],
        capture_output=True, text=True, env=env() | {"COLUMNS": "200"}, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert wide.count("100 tokens, mean -0.39, min -3, 10 below p 0.5") == 4, wide
    # --full lists every value
    full = ok(node, "local/rl.jsonl", "--rl", "--full")
    assert full.count("-0.1") >= 4 * 90
    assert "tokens, mean" not in full


@pytest.mark.timeout(60)
def test_a_parquet_footer_hides_its_writers_metadata(node: Daemon, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    blob = base64.b64encode(os.urandom(300)).decode()
    table = pa.table({"id": list(range(5)), "city": [f"city-{i}" for i in range(5)]})
    table = table.replace_schema_metadata({"owner": "data-team", "blob": blob})
    (tmp_path / "chunkd-data").mkdir(exist_ok=True)
    pq.write_table(table, tmp_path / "chunkd-data" / "meta.parquet")  # with ARROW:schema
    out = ok(node, "local/meta.parquet", "--count", "2")
    assert "data-team" in out  # the user's own metadata shows
    schema = re.search(r"ARROW:schema \((\d+) bytes, hidden", out)
    assert schema, out
    answer = json.loads(ok(node, "local/meta.parquet", "--count", "2", "--json"))
    assert int(schema[1]) == len(answer["open"]["metadata"]["ARROW:schema"])
    assert f"blob ({len(blob)} bytes, hidden" in out
    assert not re.search(r"[A-Za-z0-9+/]{40,}", out), out  # no base64 before the rows
    assert "rows 0 to 1 of 5" in out
    # --full prints them whole (wrapped in the table's cells)
    full = re.sub(r"[\s│]", "", ok(node, "local/meta.parquet", "--count", "2", "--full"))
    assert blob in full
    assert answer["open"]["metadata"]["ARROW:schema"] in full


@pytest.mark.timeout(60)
def test_an_audio_file_says_its_duration_rate_and_channels(node: Daemon, tmp_path: Path) -> None:
    put(tmp_path, "tone.wav", (MEDIA / "tone.wav").read_bytes())
    out = ok(node, "local/tone.wav")
    answer = json.loads(ok(node, "local/tone.wav", "--json"))["audio"]
    assert answer["sample_rate"] > 0
    assert answer["channels"] > 0
    assert answer["duration"] > 0
    rate = f"{answer['sample_rate'] / 1000:g} kHz"
    channels = {1: "mono", 2: "stereo"}.get(answer["channels"], f"{answer['channels']} channels")
    assert re.search(rf"audio\s+{answer['duration']:.2f} s, {rate}, {channels}", out), out


_FLOATS = [
    2.9137e-4, 1e-5, -1e-5, 1.5e-7, 9.99996e-4, 0.00099995, 0.001, 0.0012345, 0.05,
    0.04999999999999999, 0.14285714285714285, 0.5, -0.5, 1.25, 3.14159, 123.45, 999.99995,
    12345.678, -98765.4321, 1234567.891, 1e15 + 0.5, 2.5e-300, 5e-324, 3.0, -0.0, 1e20,
    1e21, 1.2345e25, float("nan"), float("inf"), float("-inf"), 0.1 + 0.2, 1 / 3, 2 / 3e8,
]  # fmt: skip


@pytest.mark.timeout(30)
def test_cli_floats_are_the_pages_strings() -> None:
    """``chunkd inspect`` rounds a float to the very string the page's ``fmtFloat``
    gives (run in Chromium from inspect.js itself), exponent form included."""
    from chunkd.gateway.cli.inspect_text import float_text as _float
    from chunkd.testing.browser import chromium, chromium_missing

    missing = chromium_missing()
    if missing is not None:
        pytest.skip(missing)
    import chunkd.gateway.dashboard

    static = Path(chunkd.gateway.dashboard.__file__).parent / "static"
    source = (static / "inspect.js").read_text()
    digits = re.search(r"^const SIG_DIGITS = \d+;", source, re.M)
    rule = re.search(r"^function fmtFloat\(n\) \{\n.*?^\}\n", source, re.M | re.S)
    assert digits is not None
    assert rule is not None
    script = f"{digits.group(0)}\n{rule.group(0)}\nreturn values.map(fmtFloat);"
    with chromium() as browser:
        page = browser.new_page()
        # JSON has no NaN or Infinity: they travel as strings and become numbers there
        sent = [
            v if math.isfinite(v) else {"nan": "NaN", "inf": "Infinity"}.get(str(v), "-Infinity")
            for v in _FLOATS
        ]
        page_strings = page.evaluate(
            f"sent => {{ const values = sent.map(Number); {script} }}", sent
        )
    assert [_float(v) for v in _FLOATS] == page_strings
    assert (_float(2.9137e-4), _float(1e-5)) == ("2.914e-4", "1e-5")
