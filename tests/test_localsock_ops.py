"""The local socket's dispatch table: every op of the protocol's op table has exactly one
handler, in the module of its family, and a table that breaks that rule stops the
daemon's import (chunkd.gateway.localsock, "Adding an op")."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from chunkd.client.protocol import OPS, VERSION, recv_frame, send_frame
from chunkd.gateway.localsock import checkpoint_ops, dataset_ops, job_ops, prefetch_ops, read_ops
from chunkd.gateway.localsock.answer import Answer
from chunkd.gateway.localsock.family import Family, Parts, handler_table
from chunkd.gateway.localsock.server import HANDLERS

FAMILIES = (
    prefetch_ops.FAMILY,
    read_ops.FAMILY,
    checkpoint_ops.FAMILY,
    dataset_ops.FAMILY,
    job_ops.FAMILY,
)


async def _nothing(parts: Parts, args: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
    return {"ok": True}  # pragma: no cover - registered, never called


@pytest.mark.timeout(5)
def test_every_op_of_the_table_has_exactly_one_handler() -> None:
    assert list(HANDLERS) == list(OPS)
    owners = [f.name for f in FAMILIES for name in f.handlers]
    assert len(owners) == len(OPS)  # no op in two families
    assert set(checkpoint_ops.FAMILY.handlers) == {n for n in OPS if n.startswith("ckpt_")}
    assert set(dataset_ops.FAMILY.handlers) == {n for n in OPS if n.startswith("ds_")}
    assert set(read_ops.FAMILY.handlers) == {"stat", "read", "readv", "list"}
    assert set(prefetch_ops.FAMILY.handlers) == {"hello", "prefetch"}


@pytest.mark.timeout(5)
def test_an_op_without_a_handler_breaks_the_table() -> None:
    for family in FAMILIES:
        for missing in family.handlers:
            short = Family(family.name)
            short.handlers = {n: h for n, h in family.handlers.items() if n != missing}
            others = [f for f in FAMILIES if f is not family]
            with pytest.raises(TypeError, match=f"no handler for op {missing} "):
                handler_table(*others, short)


@pytest.mark.timeout(5)
def test_a_handler_must_name_an_op_and_an_op_has_one() -> None:
    with pytest.raises(TypeError, match="names op 'ckpt_nothing', which"):
        Family("checkpoint").op("ckpt_nothing")(_nothing)
    twice = Family("read")
    twice.op("stat")(_nothing)
    with pytest.raises(TypeError, match="two handlers for 'stat'"):
        twice.op("stat")(_nothing)
    with pytest.raises(TypeError, match="among the read ops and among the prefetch ops"):
        handler_table(*FAMILIES, twice_of("prefetch", "stat"))


def twice_of(name: str, op: str) -> Family:
    family = Family(name)
    family.op(op)(_nothing)
    return family


@pytest.mark.timeout(30)
def test_an_op_declared_without_a_handler_stops_the_daemons_import() -> None:
    # A new entry in the op table, and no handler yet: the daemon does not start (it
    # would answer "unknown op" to an op its own protocol declares).
    script = textwrap.dedent(
        """
        from chunkd.client.protocol import OPS, Op
        OPS["ckpt_rename"] = Op("ckpt_rename", "Rename a checkpoint.", (), "``{}``")
        import chunkd.gateway.daemon
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=25, check=False
    )
    assert done.returncode != 0
    assert "TypeError: no handler for op ckpt_rename of chunkd.client.protocol.OPS" in done.stderr


@pytest.mark.timeout(30)
def test_stat_answers_its_backends_revalidation(start_daemon, tmp_path: Path) -> None:
    # `chunkd serve` with no config: backend `local`, revalidated after 1 s; the read
    # path answers it (the door no longer reads the backend's config).
    work = tmp_path / "work"
    (work / "chunkd-data").mkdir(parents=True)
    (work / "chunkd-data" / "a.bin").write_bytes(b"abc")
    daemon = start_daemon(cwd=work)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(20)
        sock.connect(str(daemon.cwd / "chunkd.sock"))
        send_frame(sock, {"op": "hello", "version": VERSION, "id": 1})
        assert recv_frame(sock)[0]["ok"]
        send_frame(sock, {"op": "stat", "name": "local/a.bin", "id": 2})
        header, _, _ = recv_frame(sock)
    assert (header["ok"], header["size"], header["revalidate"]) == (True, 3, 1.0)
