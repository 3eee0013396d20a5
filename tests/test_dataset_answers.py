"""What ``chunkd dataset`` and the loader answer, counted and named right (issue 24):
``check`` counts every finding and groups identical ones, a resume error names both
snapshots whole, and ``--json`` prints each command's documented answer, never the
socket's own fields.

A real daemon on the embedded default config (``local`` at ``./chunkd-data``, the
registry at ``local/datasets``), the command line run as users run it.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from chunkd.client import Client
from chunkd.client.datasets import Dataset, Loader
from chunkd.errors import ResumeStateError

from .conftest import Daemon, dataset_cli

RECORD = 16


def cli(daemon: Daemon, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return dataset_cli(daemon, *args, check=check)


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Daemon:
    return start_daemon(cwd=tmp_path / "node")


def write(daemon: Daemon, key: str, data: bytes) -> None:
    path = daemon.cwd / "chunkd-data" / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.mark.timeout(60)
def test_check_counts_200_files_with_the_same_warning_as_200_in_one_group(node: Daemon) -> None:
    for i in range(200):
        write(node, f"empty/e-{i:03d}.bin", b"")
    for i in range(3):
        write(node, f"empty/full-{i}.bin", os.urandom(RECORD * 4))
    cli(node, "register", "empties", "local/empty/", "--format", f"fixed:{RECORD}")

    done = cli(node, "check", "empties")
    assert "empties: 0 errors, 200 warnings (203 files checked)" in done.stdout
    grouped = [line for line in done.stdout.splitlines() if "[empty-member]" in line]
    assert grouped == [
        "warning: holds no samples [empty-member] (200 files: empty/e-000.bin, "
        "empty/e-001.bin, empty/e-002.bin, ...)"
    ]
    (finding,) = json.loads(cli(node, "check", "empties", "--json").stdout)
    assert finding == {
        "level": "warning",
        "member": "empty/e-000.bin",
        "code": "empty-member",
        "message": "holds no samples",
        "count": 200,
        "examples": ["empty/e-000.bin", "empty/e-001.bin", "empty/e-002.bin"],
    }


@pytest.mark.timeout(60)
def test_a_resume_error_names_both_snapshots_whole(node: Daemon) -> None:
    for i in range(2):
        write(node, f"rec/part-{i}.bin", os.urandom(RECORD * 10))
    cli(node, "register", "rec", "local/rec/", "--format", f"fixed:{RECORD}")
    with Client(node.cwd / "chunkd.sock") as client:
        dataset = Dataset.open("rec", client)
        loader = Loader(dataset, batch_size=2, seed=1)
        state = loader.state()
        # Another snapshot whose id shares its first 48 digits: a cut id would show two
        # snapshots that look the same.
        other = dataset.id[:48] + ("0" if dataset.id[48] != "0" else "1") * 16
        with pytest.raises(ResumeStateError) as refused:
            loader.restore(state | {"snapshot": other})
    said = str(refused.value)
    assert other in said
    assert dataset.id in said


@pytest.mark.timeout(60)
def test_json_answers_are_the_documented_fields_only(node: Daemon) -> None:
    for i in range(2):
        write(node, f"js/part-{i}.bin", os.urandom(RECORD * 8))
    cli(node, "register", "js", "local/js/", "--format", f"fixed:{RECORD}")
    shown = json.loads(cli(node, "show", "js", "--json").stdout)
    assert shown["snapshot"] == shown["id"]
    assert len(shown["id"]) == 64

    tagged = json.loads(cli(node, "tag", "js@1", "prod", "--json").stdout)
    assert tagged == {
        "name": "js",
        "tag": "prod",
        "seq": 1,
        "version": 1,
        "snapshot": shown["id"],
    }
    frozen = json.loads(cli(node, "freeze", "js@1", "--json").stdout)
    assert sorted(frozen) == sorted(
        ["snapshot", "members", "chunks", "bytes", "uploaded", "uploaded_bytes", "already"]
    )
    assert frozen["snapshot"] == shown["id"]
    migrated = json.loads(cli(node, "migrate", "js@1", "--to", "local/moved", "--json").stdout)
    assert sorted(migrated) == sorted(
        [
            "snapshot",
            "name",
            "version",
            "created",
            "from",
            "frozen",
            "members",
            "bytes",
            "copied",
            "kept",
        ]
    )
    assert (migrated["from"], migrated["version"]) == (shown["id"], 2)
