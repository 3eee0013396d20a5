"""The `chunkd` command and the packaging it relies on, run as real processes."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

import chunkd

BIN = Path(sys.executable).parent / "chunkd"
REPO = Path(__file__).resolve().parent.parent


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=cwd, check=False)


def test_version_and_help() -> None:
    version = run(str(BIN), "--version")
    assert version.returncode == 0
    assert version.stdout.strip() == f"chunkd {chunkd.__version__}"
    assert chunkd.__version__ != "0+unknown"
    helped = run(str(BIN), "--help")
    assert helped.returncode == 0
    assert "storage gateway" in helped.stdout
    assert "selfcheck" in helped.stdout
    module = run(sys.executable, "-m", "chunkd", "--version")
    assert module.stdout == version.stdout


def test_no_command_prints_usage_and_fails() -> None:
    bare = run(str(BIN))
    assert bare.returncode == 2
    assert "usage: chunkd" in bare.stderr


def test_unknown_command_is_a_clear_error() -> None:
    wrong = run(str(BIN), "frobnicate")
    assert wrong.returncode == 2
    assert "invalid choice: 'frobnicate'" in wrong.stderr


def test_selfcheck_prints_what_it_did_and_is_repeatable(tmp_path: Path) -> None:
    for attempt in range(2):
        result = run(str(BIN), "selfcheck", "--dir", str(tmp_path / "c"), "--chunks", "4")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "selfcheck passed" in result.stdout
        assert "write refused" in result.stdout
        assert result.stdout.count("[ok  ]") == 5, (attempt, result.stdout)


def test_selfcheck_reports_a_busy_directory(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    with (tmp_path / "c" / "LOCK").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        result = run(str(BIN), "selfcheck", "--dir", str(tmp_path / "c"))
    assert result.returncode == 1
    assert "in use by another chunkd" in result.stdout


def test_subpackages_install_under_chunkd_only(tmp_path: Path) -> None:
    # From a neutral directory: the repo's folders are not importable bare...
    probe = (
        "import importlib.util as u, chunkd.cache, chunkd.gateway, chunkd.client;"
        "print([u.find_spec(m) is None for m in ('cache', 'gateway', 'client')]);"
        "print(chunkd.cache.__file__)"
    )
    result = run(sys.executable, "-c", probe, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    bare, path = result.stdout.splitlines()
    assert bare == "[True, True, True]"
    # ...and chunkd.cache is the very cache/ folder of this checkout.
    assert Path(path).resolve() == (REPO / "cache" / "__init__.py").resolve()
    assert Path(path) == REPO / "src" / "chunkd" / "cache" / "__init__.py"


def test_the_cache_library_imports_no_networking() -> None:
    probe = (
        "import sys, chunkd.cache;"
        "bad = {'aiohttp', 'obstore', 'prometheus_client', 'chunkd.gateway', 'chunkd.client'};"
        "print(sorted(bad & set(sys.modules)))"
    )
    result = run(sys.executable, "-c", probe)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_chunkd_runs_without_the_daemon_extras_imported() -> None:
    probe = "import sys; from chunkd.gateway import cli; print('aiohttp' in sys.modules)"
    result = run(sys.executable, "-c", probe)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
