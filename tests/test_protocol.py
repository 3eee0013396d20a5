"""The local protocol's one definition: the op table, the error kinds, frames and memfds."""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import struct
from pathlib import Path

import pytest

from chunkd import errors, memfd
from chunkd.client import Client, protocol
from chunkd.client.protocol import OPS, error_answer, error_of, request_header
from chunkd.errors import (
    ChunkdError,
    InvalidKeyError,
    InvalidRequestError,
    ObjectNotFoundError,
    ProtocolError,
    RangeNotSatisfiableError,
)

from .conftest import Daemon


def test_every_op_and_field_is_written_down_in_the_module_docs() -> None:
    doc = protocol.__doc__ or ""
    for op in OPS.values():
        assert f"``{op.name}``" in doc
        assert op.answer
        assert op.doc
        for field in op.fields:
            assert field.describe() in doc
    assert {op for op in OPS if op.startswith("ckpt_")} == {
        "ckpt_save",
        "ckpt_wait",
        "ckpt_commit",
        "ckpt_manifest",
        "ckpt_chunks",
        "ckpt_list",
        "ckpt_delete",
        "ckpt_gc",
        "ckpt_scrub",
    }


def test_error_kinds_named_in_the_docs_are_classes_of_the_family() -> None:
    for op in OPS.values():
        for entry in op.errors:
            kind = entry.split(":")[0]
            if kind.startswith("and "):
                continue
            assert errors.error_class(kind).__name__ == kind, (op.name, kind)


def test_a_request_header_is_checked_against_the_table() -> None:
    assert request_header("stat", {"name": "local/a"}) == {"op": "stat", "name": "local/a"}
    assert request_header("ckpt_list", {"prefix": "local", "start_after": None}) == {
        "op": "ckpt_list",
        "prefix": "local",
    }
    with pytest.raises(InvalidRequestError, match="no field 'nmae'"):
        request_header("stat", {"nmae": "local/a"})
    with pytest.raises(InvalidRequestError, match="not an op"):
        request_header("stat2", {})
    with pytest.raises(InvalidRequestError, match="world_size must be from 1"):
        request_header("ckpt_commit", {"name": "l/c", "save_id": "s", "world_size": 0})
    with pytest.raises(InvalidRequestError, match="durability must be"):
        request_header("ckpt_save", {"name": "l/c", "durability": "disk"})
    with pytest.raises(InvalidKeyError):
        request_header("stat", {"name": 5})
    with pytest.raises(InvalidRequestError, match="wants 'job'"):
        request_header("ckpt_wait", {})


def test_op_check_fills_defaults() -> None:
    args = OPS["list"].check({"op": "list", "name": "local"})
    assert args == {
        "name": "local",
        "recursive": False,
        "fresh": False,
        "start_after": None,
        "limit": 1000,
    }
    assert OPS["ckpt_save"].field("durability").choices == protocol.DURABILITY_LEVELS
    assert OPS["ckpt_save"].field("commit").choices == protocol.COMMIT_MODES
    assert OPS["ckpt_wait"].field("commit").choices == protocol.COMMIT_MODES


def test_the_package_names_what_its_modules_define() -> None:
    from chunkd.client.protocol import discovery, fields, frames, ops
    from chunkd.client.protocol import errors as wire_errors

    defined = {
        name: getattr(module, name)
        for module in (discovery, fields, frames, ops, wire_errors)
        for name in module.__all__
    }
    for name in protocol.__all__:
        if name != "ProtocolError":  # chunkd.errors's, named here for the framing
            assert getattr(protocol, name) is defined[name], name
    assert protocol.ProtocolError is ProtocolError


def test_the_wire_kind_is_the_class_name_and_comes_back_as_the_class() -> None:
    for exc in (ObjectNotFoundError("gone"), RangeNotSatisfiableError("past", 5)):
        answer = error_answer(exc)
        assert answer == {"ok": False, "error": type(exc).__name__, "message": str(exc)}
        back = error_of(answer, "a read")
        assert type(back) is type(exc)
        assert str(back) == str(exc)
    assert error_answer(ValueError("x"))["error"] == "ChunkdError"
    assert type(error_of({"error": "FromANewerDaemon", "message": "m"}, "x")) is ChunkdError
    assert type(error_of({"error": "ValueError"}, "x")) is ChunkdError  # not of the family


def test_the_error_family_holds_the_moved_errors() -> None:
    for name in ("ProtocolError", "OwnerSilentError", "DaemonUnavailableError"):
        cls = errors.error_class(name)
        assert cls.__name__ == name
        assert issubclass(cls, ChunkdError)
        assert name in errors.__all__
    assert issubclass(errors.OwnerSilentError, TimeoutError)
    assert issubclass(errors.DaemonUnavailableError, ConnectionError)
    from chunkd.client import DaemonUnavailableError
    from chunkd.gateway.peers import OwnerSilentError

    assert DaemonUnavailableError is errors.DaemonUnavailableError
    assert OwnerSilentError is errors.OwnerSilentError


def test_sync_and_async_receivers_read_the_same_frame() -> None:
    left, right = socket.socketpair()
    fd = memfd.sealed(b"abc")
    try:
        protocol.send_frame(left, {"op": "x", "id": 1}, b"pay", fds=[fd])
        got = protocol.recv_frame(right)
        assert (got.header, got.payload, len(got.fds)) == ({"op": "x", "id": 1}, b"pay", 1)
        assert os.pread(got.fds[0], 3, 0) == b"abc"
        memfd.close_all(got.fds)

        async def receive() -> protocol.RawFrame | None:
            right.setblocking(False)
            protocol.send_frame(left, {"op": "y"}, fds=[fd])
            return await protocol.recv_raw_async(right)

        raw = asyncio.run(receive())
        assert raw is not None
        assert protocol.decode_header(raw.header) == {"op": "y"}
        assert len(raw.fds) == 1
        memfd.close_all(raw.fds)
        left.close()
        assert asyncio.run(protocol.recv_raw_async(right)) is None  # a clean end
    finally:
        os.close(fd)
        left.close()
        right.close()


def test_a_broken_prefix_is_not_in_sync() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(struct.pack(">II", protocol.MAX_HEADER + 1, 0))
        with pytest.raises(ProtocolError) as caught:
            protocol.recv_frame(right)
        assert not caught.value.in_sync


def test_memfds_are_sealed_and_checked_in_one_place(tmp_path: Path) -> None:
    fd = memfd.sealed(memoryview(b"x" * 5000))
    try:
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & memfd.SEALS == memfd.SEALS
        assert memfd.sealed_size(fd) == 5000
    finally:
        os.close(fd)
    open_fd = memfd.create("open", 10)
    plain = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR)
    try:
        assert memfd.sealed_size(open_fd) is None  # not sealed
        assert memfd.sealed_size(plain) is None  # not a memfd
    finally:
        memfd.close_all([open_fd, plain])
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(open_fd)


def test_a_hello_without_a_version_of_ours_is_a_version_error(start_daemon, tmp_path: Path) -> None:
    # Whatever is wrong with the version (none, a string, a float, a list, a flag, a
    # number out of bounds or another one), it is a client of another protocol.
    work = tmp_path / "work"
    (work / "chunkd-data").mkdir(parents=True)
    start_daemon(cwd=work)
    wrong: list[object] = [None, "2", 2.0, [2], True, -1, 1 << 40, 1]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(work / "chunkd.sock"))
        for i, version in enumerate(wrong):
            header: dict[str, object] = {"op": "hello", "id": i}
            if version is not None:
                header["version"] = version
            protocol.send_frame(sock, header)
            answer, _, fds = protocol.recv_frame(sock)
            assert (answer["ok"], answer["error"], answer["id"], fds) == (
                False,
                "ProtocolVersionError",
                i,
                [],
            ), version
            assert answer["message"]
            if version != 1:  # the client refuses it before it is sent
                fields = {} if version is None else {"version": version}
                with pytest.raises(errors.ProtocolVersionError):
                    request_header("hello", fields)
        protocol.send_frame(sock, {"op": "hello", "id": 99, "version": protocol.VERSION})
        answer, _, _ = protocol.recv_frame(sock)  # the connection stays
        assert (answer["ok"], answer["version"]) == (True, protocol.VERSION)


def test_client_request_is_public_and_raises_the_named_class(start_daemon, tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "chunkd-data").mkdir(parents=True)
    (work / "chunkd-data" / "a.bin").write_bytes(b"hello")
    daemon: Daemon = start_daemon(cwd=work)
    with Client(work / "chunkd.sock") as client:
        assert client.chunk_bytes > 0
        assert not client.closed
        with client.request("stat", {"name": "local/a.bin"}) as reply:
            assert reply.header["size"] == 5
            assert reply.fds == []
        with pytest.raises(ObjectNotFoundError):
            client.request("stat", {"name": "local/missing"})
        with pytest.raises(InvalidRequestError, match="no field"):
            client.request("stat", {"name": "local/a.bin", "bogus": 1})
        with client.request("read", {"name": "local/a.bin", "inline": False}) as reply:
            assert len(reply.fds) == 1
            assert memfd.sealed_size(reply.fds[0])
    assert client.closed
    assert daemon.get("/healthz")[0] == 200
