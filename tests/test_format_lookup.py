"""The formats' plug-in lookup (issue 26, registration at the speed of the footers):
asking every installed distribution for ``chunkd.formats`` entry points costs
milliseconds, and ``names()`` and ``detect()`` are asked for every file a registration
lists. The lookup is kept until a ``sys.path`` entry changes (a package installed or
removed there)."""

from __future__ import annotations

import importlib.metadata
import time
from pathlib import Path
from typing import Any

import pytest

from chunkd.client.datasets.formats import detect, names


@pytest.mark.timeout(10)
def test_plug_ins_are_looked_up_again_only_when_a_path_entry_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    asked: list[Any] = []
    lookup = importlib.metadata.entry_points

    def counted(**selection: Any) -> Any:
        asked.append(selection)
        return lookup(**selection)

    monkeypatch.setattr(importlib.metadata, "entry_points", counted)
    assert "parquet" in names()
    for _ in range(20):
        assert detect("a/b.parquet") == "parquet"
        names()
    assert len(asked) == 1  # once, for the sys.path seen
    time.sleep(0.05)  # past the file system's clock tick
    # A package installed into a path entry: its format is found at the next call.
    (site / "tinyfmt.py").write_text("FORMAT = None\n")
    dist = site / "tinyfmt-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tinyfmt\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[chunkd.formats]\ntinyfmt = tinyfmt:FORMAT\n")
    assert "tinyfmt" in names()
    assert len(asked) == 2
    names()
    assert len(asked) == 2
