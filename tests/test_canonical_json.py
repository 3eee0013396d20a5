"""Canonical JSON is written once (chunkd.canonical): its flags, and the documents
written before and after it, through a real daemon and the client."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch

from chunkd import snapshot
from chunkd.canonical import canonical
from chunkd.client import Client
from chunkd.client import checkpoint as ckpt
from chunkd.errors import CheckpointNotFoundError, InvalidRequestError
from tests.conftest import Daemon

NAME = "local/modèle-café/étape-1"  # a name and a state key that are not ASCII
STATE_KEY = "couche.poids_é"


def old_dumps(doc: Any) -> bytes:
    """How checkpoint and registry documents were written before: ASCII escapes."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


@pytest.mark.timeout(5)
def test_the_flags_utf8_sorted_and_no_nan() -> None:
    assert (
        canonical({"b": 1, "a": "é", "c": [1.5, None]}) == '{"a":"é","b":1,"c":[1.5,null]}'.encode()
    )
    assert snapshot.canonical is canonical  # snapshots use the same function
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="NaN or Infinity"):
            canonical({"x": [bad]})
    with pytest.raises(ValueError, match="lone surrogate"):
        canonical({"k": "a\udc80b"})


def stored(daemon: Daemon, path: str) -> Path:
    return daemon.cwd / "chunkd-data" / "checkpoints" / path


@pytest.mark.timeout(30)
def test_a_non_ascii_checkpoint_is_utf8_now_and_an_old_escaped_one_still_reads(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    first = start_daemon(cwd=tmp_path / "a")
    state = {STATE_KEY: torch.arange(8, dtype=torch.float32), "nom": "été"}
    with Client(first.cwd / "chunkd.sock") as client:
        ckpt.save(state, NAME, client=client)
    root = stored(first, "modèle-café/étape-1")
    manifest_raw = (root / "manifest.json").read_bytes()
    manifest = json.loads(manifest_raw)
    (entry,) = manifest["parts"]
    part_path = first.cwd / "chunkd-data" / entry["key"]
    part_raw = part_path.read_bytes()
    # New documents: UTF-8, canonical, no escapes.
    for raw in (manifest_raw, part_raw):
        assert "étape".encode() in raw
        assert b"\\u00e9" not in raw
        assert raw == canonical(json.loads(raw))

    # The same checkpoint as the writers before wrote it: ASCII escapes, with the part's
    # hash in the manifest taken over those bytes.
    old_part = old_dumps(json.loads(part_raw))
    assert b"\\u00e9" in old_part
    part_path.write_bytes(old_part)
    entry["blake3"] = blake3.blake3(old_part).hexdigest()
    old_manifest = old_dumps(manifest)
    (root / "manifest.json").write_bytes(old_manifest)

    # A node that has none of it cached reads it, verifying each part by its bytes.
    second = start_daemon(
        cwd=tmp_path / "b", env={"CHUNKD_BACKENDS_LOCAL_URL": f"file://{first.cwd / 'chunkd-data'}"}
    )
    with Client(second.cwd / "chunkd.sock") as client:
        loaded = ckpt.load(NAME, client=client)
        assert torch.equal(loaded[STATE_KEY], state[STATE_KEY])
        assert loaded["nom"] == "été"
        assert ckpt.manifest(NAME, client=client)["manifest_id"] == (
            blake3.blake3(old_manifest).hexdigest()
        )
        # A new save over it writes UTF-8 again.
        ckpt.save(state, NAME, overwrite=True, client=client)
    assert "étape".encode() in (root / "manifest.json").read_bytes()


@pytest.mark.timeout(30)
def test_nan_extra_is_refused_before_the_manifest_and_a_nan_tensor_or_float_saves(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = start_daemon(cwd=tmp_path / "n")
    name = "local/nan/step-1"
    with Client(daemon.cwd / "chunkd.sock") as client:
        # NaN in the state is no JSON number (floats travel as their bits): it saves.
        state = {"w": torch.tensor([math.nan, 1.0]), "best": math.nan}
        handle = ckpt.async_save(state, name, save_id="s1", _commit="none", client=client)
        assert handle.wait(20, level="remote")
        with pytest.raises(InvalidRequestError, match="NaN"):  # the door or the committer
            ckpt.commit(name, "s1", 1, extra={"loss": math.nan}, client=client)
        # A lone surrogate is valid JSON on the wire (an escape) but no text: UTF-8
        # cannot hold it, so the commit is refused before the manifest is put.
        with pytest.raises(InvalidRequestError, match="lone surrogate"):
            ckpt.commit(name, "s1", 1, extra={"k": "a\udc80"}, client=client)
        with pytest.raises(CheckpointNotFoundError):
            ckpt.load(name, client=client)  # nothing was committed
        # ... and a save whose state holds one is refused before anything is staged.
        with pytest.raises(InvalidRequestError, match="lone surrogate"):
            ckpt.save({"a\udc80": torch.zeros(2)}, "local/nan/other", client=client)
        assert not stored(daemon, "nan/other").exists()
        assert not (stored(daemon, "nan/step-1") / "manifest.json").exists()
        ckpt.commit(name, "s1", 1, extra={"loss": 0.25, "note": "ça"}, client=client)
        loaded = ckpt.load(name, client=client)
        assert math.isnan(loaded["best"])
        assert math.isnan(float(loaded["w"][0]))
        assert ckpt.manifest(name, client=client)["note"] == "ça"
    raw = (stored(daemon, "nan/step-1") / "manifest.json").read_bytes()
    assert raw == canonical(json.loads(raw))
