"""The inspector's worker process: media sniffing, and every op against a real daemon."""

from __future__ import annotations

import pytest

from chunkd.mediatype import MEDIA_TYPES, kind_of, sniff

# ---------------------------------------------------------------------------
# chunkd.mediatype
# ---------------------------------------------------------------------------

_HEADS = [
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "image/png", "image"),
    (b"\xff\xd8\xff\xe0\x00\x10JFIF\x00", "image/jpeg", "image"),
    (b"RIFF\x24\x00\x00\x00WEBPVP8 ", "image/webp", "image"),
    (b"GIF89a\x01\x00\x01\x00", "image/gif", "image"),
    (b"GIF87a\x01\x00\x01\x00", "image/gif", "image"),
    (b"RIFF\x24\x00\x00\x00WAVEfmt ", "audio/wav", "audio"),
    (b"fLaC\x00\x00\x00\x22", "audio/flac", "audio"),
    (b"ID3\x04\x00\x00\x00\x00\x00\x00", "audio/mpeg", "audio"),
    (b"\xff\xfb\x90\x64\x00\x00", "audio/mpeg", "audio"),
    (b"OggS\x00\x02\x00\x00", "audio/ogg", "audio"),
    (b"\x1a\x45\xdf\xa3\x9f\x42\x86\x81\x01", "video/webm", "video"),
    (b"\x00\x00\x00\x20ftypisom\x00\x00\x02\x00", "video/mp4", "video"),
]


@pytest.mark.parametrize(("head", "media_type", "kind"), _HEADS)
def test_sniff_knows_each_allowed_type(head: bytes, media_type: str, kind: str) -> None:
    assert sniff(head) == media_type
    assert media_type in MEDIA_TYPES
    assert kind_of(media_type) == kind


@pytest.mark.parametrize(
    "head",
    [
        b"",
        b"<svg xmlns='http://www.w3.org/2000/svg'><script>alert(1)</script></svg>",
        b"<?xml version='1.0'?><svg/>",
        b"<!DOCTYPE html><html><script>alert(1)</script>",
        b"<html><body>",
        b"PAR1\x15\x04",
        b'{"a": 1}\n',
        b"RIFF\x24\x00\x00\x00AVI LIST",
        b"\xff\xff\xff\xff",  # frame sync with reserved fields: random binary, not MP3
        b"\x89PN",
        b"\x00\x00\x00\x20moov",
    ],
)
def test_sniff_refuses_everything_else(head: bytes) -> None:
    assert sniff(head) is None


def test_kind_of_unknown_types() -> None:
    assert kind_of(None) is None
    assert kind_of("image/svg+xml") is None
    assert kind_of("text/html") is None
    assert len(MEDIA_TYPES) == 10


# ---------------------------------------------------------------------------
# the worker process, on a real daemon
# ---------------------------------------------------------------------------

import base64  # noqa: E402
import io  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import zlib  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from chunkd.errors import InvalidRequestError  # noqa: E402

from .conftest import BIN, Daemon, wait_for_socket  # noqa: E402

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A real PNG of random pixels (the browser decodes it)."""
    rng = random.Random(seed)

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    raw = b"".join(b"\0" + rng.randbytes(3 * width) for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


class Worker:
    """A real ``python -m chunkd.client.inspect.worker`` on the daemon's socket."""

    def __init__(self, socket: Path, log: Path, memory: int = 2 << 30) -> None:
        self.log = log.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "chunkd.client.inspect.worker", "--socket", str(socket),
             "--memory", str(memory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
        )  # fmt: skip
        self.n = 0

    def send(self, line: bytes) -> dict[str, Any]:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write(line + b"\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        assert answer, "the worker died"
        parsed: dict[str, Any] = json.loads(answer)
        return parsed

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        self.n += 1
        line = json.dumps({"n": self.n, "op": op, "args": {k: str(v) for k, v in args.items()}})
        answer = self.send(line.encode())
        assert answer["n"] == self.n
        return answer

    def ok(self, op: str, **args: Any) -> dict[str, Any]:
        answer = self.call(op, **args)
        assert answer["ok"], answer
        result: dict[str, Any] = answer["result"]
        return result

    def fails(self, op: str, kind: str, **args: Any) -> str:
        answer = self.call(op, **args)
        assert not answer["ok"], answer
        assert answer["error"] == kind, answer
        message: str = answer["message"]
        return message

    def close(self) -> None:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.close()
        code = self.process.wait(timeout=30)
        self.process.stdout.close()
        self.log.close()
        assert code == 0


class Node:
    """A daemon on the embedded default config, its data folder, and a worker."""

    def __init__(self, daemon: Daemon, worker: Worker) -> None:
        self.daemon = daemon
        self.worker = worker
        self.data = daemon.cwd / "chunkd-data"
        self.socket = daemon.cwd / "chunkd.sock"

    def put(self, key: str, data: bytes) -> str:
        path = self.data / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return f"local/{key}"


@pytest.fixture
def node(start_daemon: Any, tmp_path: Path) -> Iterator[Node]:
    daemon: Daemon = start_daemon()
    assert wait_for_socket(tmp_path / "chunkd.sock", 10)
    worker = Worker(tmp_path / "chunkd.sock", tmp_path / "worker.log")
    try:
        yield Node(daemon, worker)
    finally:
        worker.close()


def parquet_bytes(table: Any, row_group_size: int) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=row_group_size)
    return sink.getvalue()


def image_table(rows: int) -> tuple[Any, list[bytes]]:
    images = [png(4, 4, seed=i) for i in range(rows)]
    table = pa.table(
        {
            "id": pa.array(range(rows), pa.int64()),
            "text": [f"row {i} <script>alert({i})</script>" for i in range(rows)],
            "score": [float("nan") if i % 7 == 0 else i / 2 for i in range(rows)],
            "image": pa.array(images, pa.binary()),
        }
    )
    return table, images


def test_parquet_open_pages_and_last_row(node: Node) -> None:
    table, images = image_table(500)
    name = node.put("pq/images.parquet", parquet_bytes(table, 100))
    w = node.worker
    opened = w.ok("open", name=name)
    assert opened["kind"] == "parquet"
    assert opened["num_rows"] == 500
    assert [c["name"] for c in opened["schema"]] == ["id", "text", "score", "image"]
    assert opened["schema"][3]["type"] == "binary"
    groups = opened["row_groups"]
    assert opened["row_groups_total"] == 5
    assert [(g["index"], g["rows"], g["first_row"]) for g in groups] == [
        (i, 100, 100 * i) for i in range(5)
    ]
    stats = {c["name"]: c for c in groups[2]["columns"]}
    assert (stats["id"]["min"], stats["id"]["max"], stats["id"]["nulls"]) == (200, 299, 0)
    assert stats["image"]["compressed_bytes"] > 0
    assert opened["rl"] is None

    first = w.ok("rows", name=name)
    assert first["total"] == 500
    assert [r["index"] for r in first["rows"]] == list(range(20))
    assert first["next"] == 20
    row = first["rows"][3]["value"]
    assert row["id"] == 3
    assert row["text"] == "row 3 <script>alert(3)</script>"  # sent as it is
    assert row["image"]["media_type"] == "image/png"
    assert row["image"]["$bytes"] == len(images[3])
    assert base64.b64decode(row["image"]["b64"]) == images[3]
    assert first["rows"][0]["value"]["score"] == {"$float": "nan"}
    assert first["rows"][1]["value"]["score"] == 0.5

    across = w.ok("rows", name=name, start=95, count=10)  # two row groups
    assert [r["value"]["id"] for r in across["rows"]] == list(range(95, 105))

    last = w.ok("rows", name=name, start=499)
    assert [r["value"]["id"] for r in last["rows"]] == [499]
    assert last["next"] is None

    narrow = w.ok("rows", name=name, start=250, count=5, columns="id,text")
    assert [set(r["value"]) for r in narrow["rows"]] == [{"id", "text"}] * 5

    sample = w.ok("sample", id=f"{name}#321")
    assert sample["kind"] == "parquet"
    assert sample["value"]["id"] == 321
    assert base64.b64decode(sample["value"]["image"]["b64"]) == images[321]

    assert "holds 500 rows" in w.fails("rows", "InvalidRequestError", name=name, start=500)
    assert "no column 'nope'" in w.fails("rows", "InvalidRequestError", name=name, columns="nope")
    assert "count" in w.fails("rows", "InvalidRequestError", name=name, count=501)


def test_a_page_stops_before_16_mib_of_json(node: Node) -> None:
    big = [bytes([i]) * (900 << 10) for i in range(40)]  # 900 KiB each: sent inline
    name = node.put("pq/big.parquet", parquet_bytes(pa.table({"blob": big}), 10))
    page = node.worker.ok("rows", name=name, count=40)
    assert 10 < len(page["rows"]) < 40
    assert page["next"] == len(page["rows"])
    got = base64.b64decode(page["rows"][-1]["value"]["blob"]["b64"])
    assert got == big[len(page["rows"]) - 1]


def test_jsonl_values_whole_and_text_paging(node: Node) -> None:
    long = "x" * 100_000
    records = [
        {"i": i, "nested": {"list": [1, 2.5, None, True], "deep": {"a": "ü"}}, "html": "<script>"}
        for i in range(50)
    ]
    records[7]["long"] = long
    name = node.put("j/data.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in records))
    w = node.worker
    opened = w.ok("open", name=name)
    assert (opened["kind"], opened["lines"], opened["encoding"]) == ("jsonl", 50, "utf-8")
    page = w.ok("rows", name=name, start=5, count=10)
    assert [r["value"] for r in page["rows"]] == records[5:15]
    assert page["rows"][2]["value"]["long"] == long  # a 100 KB field, whole
    assert page["next"] == 15
    assert w.ok("rows", name=name, start=45, count=10)["next"] is None

    lines = [f"line {i}: " + "ab" * (i % 17) for i in range(1000)]
    text = node.put("t/notes.txt", ("\n".join(lines)).encode())  # no newline at the end
    opened = w.ok("open", name=text)
    assert (opened["kind"], opened["lines"]) == ("text", 1000)
    start, seen = 0, []
    while start is not None:
        page = w.ok("rows", name=text, start=start, count=300)
        seen += [r["value"] for r in page["rows"]]
        start = page["next"]
    assert seen == lines

    # a text object too big to count at open: lines are found as pages go
    many = [f"{i:08d}" for i in range(1_200_000)]
    huge = node.put("t/huge.log", ("\n".join(many) + "\n").encode())
    opened = w.ok("open", name=huge)
    assert opened["lines"] is None
    far = w.ok("rows", name=huge, start=1_000_000, count=3)
    assert [r["value"] for r in far["rows"]] == many[1_000_000:1_000_003]
    assert far["next"] == 1_000_003
    back = w.ok("rows", name=huge, start=12, count=2)
    assert [r["value"] for r in back["rows"]] == many[12:14]
    end = w.ok("rows", name=huge, start=1_199_999, count=5)
    assert [r["value"] for r in end["rows"]] == [many[-1]]
    assert end["next"] is None


def wds_tar(samples: int) -> tuple[bytes, list[dict[str, bytes]]]:
    sink = io.BytesIO()
    written = []
    with tarfile.open(fileobj=sink, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(samples):
            files = {
                "png": png(3, 3, seed=100 + i),
                "txt": f"caption {i} <script>".encode(),
                "json": json.dumps({"label": i}).encode(),
            }
            for ext, data in files.items():
                info = tarfile.TarInfo(f"shard/s{i:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            written.append(files)
    return sink.getvalue(), written


def test_webdataset_members_are_media_ranges(node: Node) -> None:
    data, written = wds_tar(30)
    name = node.put("wds/shard-000.tar", data)
    w = node.worker
    opened = w.ok("open", name=name)
    assert opened["kind"] == "wds"
    # Its headers are read only as far as the first page: the count is not known yet.
    assert opened["samples_total"] is None
    assert 20 <= opened["samples_indexed"] < 30
    assert len(opened["samples"]) == 20
    first = opened["samples"][0]
    assert first["key"] == "shard/s0000"
    exts = {m["ext"]: m for m in first["members"]}
    assert exts["png"]["media_type"] == "image/png"
    assert data[exts["png"]["offset"] :][: exts["png"]["length"]] == written[0]["png"]

    page = w.ok("rows", name=name, start=25, count=10)
    assert [r["index"] for r in page["rows"]] == list(range(25, 30))
    value = page["rows"][1]["value"]
    assert value["__key__"] == "shard/s0026"
    media = value["png"]["$media"]
    assert media["name"] == name
    assert media["media_type"] == "image/png"
    assert data[media["offset"] : media["offset"] + media["length"]] == written[26]["png"]
    assert value["txt"] == "caption 26 <script>"
    assert value["json"] == {"label": 26}
    assert w.ok("sample", id=f"{name}#4")["value"]["json"] == {"label": 4}
    assert w.ok("open", name=name)["samples_total"] == 30  # the last page read them all
    assert "holds 30 rows" in w.fails("rows", "InvalidRequestError", name=name, start=30)


def test_mds_shard_is_read_with_its_index(node: Node) -> None:
    from .test_dataset_formats import MDS_COLUMNS, mds_samples, mds_shard

    samples = mds_samples(40)
    shard, entry = mds_shard(MDS_COLUMNS, samples, "shard.00000.mds", None)
    name = node.put("mds/shard.00000.mds", shard)
    node.put("mds/index.json", json.dumps({"version": 2, "shards": [entry]}).encode())
    w = node.worker
    opened = w.ok("open", name=name)
    assert opened["kind"] == "mds"
    assert opened["samples_total"] == 40
    assert {"name": "text", "encoding": "str"} in opened["columns"]
    assert opened["shards"] == [{"name": name, "samples": 40}]
    page = w.ok("rows", name=name, start=38)
    assert [r["index"] for r in page["rows"]] == [38, 39]
    value = page["rows"][0]["value"]
    want = samples[38]
    assert value["text"] == want["text"]
    assert value["meta"] == want["meta"]
    assert value["big"] == want["big"]
    assert value["vec"] == want["vec"].tolist()
    assert value["grid"] == want["grid"].tolist()
    assert value["image"]["media_type"] == "image/jpeg"
    assert base64.b64decode(value["image"]["b64"]) == want["image"]
    assert value["obj"]["$bytes"] > 0  # a pickle: its bytes, never unpickled


def test_rollouts_grouped_sorted_and_never_cut(node: Node) -> None:
    rng = random.Random(9)
    rows = []
    for g in range(5):
        for k in range(4):
            rows.append(
                {
                    "prompt": f"prompt {g} <b>",
                    "completion": f"answer {g}.{k}",
                    "reward": rng.random(),
                    "group": f"g{g}",
                    "logprobs": [-0.5, -1.25],
                    "extra": k,
                }
            )
    name = node.put("rl/rollouts.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    w = node.worker
    assert w.ok("open", name=name)["rl"] == "rollouts"
    page = w.ok("rl", name=name, start=0, count=6)  # the page ends inside group g1
    assert page["kind"] == "rollouts"
    assert [g["group"] for g in page["groups"]] == ["g0", "g1"]
    assert [len(g["rollouts"]) for g in page["groups"]] == [4, 4]  # g1 completed
    assert page["next"] == 8
    for group in page["groups"]:
        rewards = [r["reward"] for r in group["rollouts"]]
        assert rewards == sorted(rewards, reverse=True)
        assert group["prompt"] == f"prompt {group['group'][1:]} <b>"
    top = page["groups"][1]["rollouts"][0]
    assert top["logprobs"] == [-0.5, -1.25]
    assert rows[top["index"]]["completion"] == top["completion"]
    assert top["fields"] == {"extra": rows[top["index"]]["extra"]}
    rest = w.ok("rl", name=name, start=page["next"], count=100)
    assert [g["group"] for g in rest["groups"]] == ["g2", "g3", "g4"]
    assert rest["next"] is None

    renamed = [
        {"question": r["prompt"], "answer": r["completion"], "score": r["reward"]} for r in rows
    ]
    other = node.put("rl/other.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in renamed))
    assert w.ok("open", name=other)["rl"] is None
    mapping = "prompt:question,completion:answer,reward:score"
    mapped = w.ok("rl", name=other, count=4, map=mapping)
    assert [len(g["rollouts"]) for g in mapped["groups"]] == [4]  # grouped by the prompt
    assert "map" in w.fails("rl", "InvalidRequestError", name=other, map="bogus:x")


def test_episodes_step_by_step(node: Node) -> None:
    steps = []
    for e in range(3):
        for s in range(5):
            steps.append(
                {
                    "episode": e,
                    "step": s,
                    "observation": [e, s],
                    "action": s % 2,
                    "reward": 1.0,
                    "done": s == 4,
                }
            )
    table = pa.Table.from_pylist(steps)
    name = node.put("rl/episodes.parquet", parquet_bytes(table, 4))
    w = node.worker
    assert w.ok("open", name=name)["rl"] == "episodes"
    page = w.ok("rl", name=name, start=0, count=7)  # ends inside episode 1
    assert [(e["episode"], e["length"], e["return"]) for e in page["episodes"]] == [
        (0, 5, 5.0),
        (1, 5, 5.0),
    ]
    assert page["next"] == 10
    last = page["episodes"][1]["steps"][-1]
    assert (last["index"], last["step"], last["done"], last["observation"]) == (9, 4, True, [1, 4])

    records = [
        {
            "episode_id": f"ep{e}",
            "steps": [
                {"obs": s, "action": "left", "reward": s, "terminated": s == 2} for s in range(3)
            ],
        }
        for e in range(2)
    ]
    per = node.put(
        "rl/per-episode.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in records)
    )
    answer = w.ok("rl", name=per)
    assert [(e["episode"], e["length"], e["return"]) for e in answer["episodes"]] == [
        ("ep0", 3, 3.0),
        ("ep1", 3, 3.0),
    ]
    assert [s["done"] for s in answer["episodes"][0]["steps"]] == [False, False, True]


def test_malformed_files_fail_alone(node: Node) -> None:
    w = node.worker
    table, _ = image_table(50)
    whole = parquet_bytes(table, 10)
    cut = node.put("bad/truncated.parquet", whole[:-100])
    assert "PAR1" in w.fails("open", "MalformedFileError", name=cut)

    lines = b'{"a": 1}\n{"a": 2}\n{"a": oops}\n{"a": 4}\n'
    bad_json = node.put("bad/lines.jsonl", lines)
    message = w.fails("rows", "MalformedFileError", name=bad_json)
    assert "line 2" in message
    bad_at = lines.index(b'{"a": oops')
    assert f"byte {bad_at}" in message
    assert [r["value"] for r in w.ok("rows", name=bad_json, count=2)["rows"]] == [
        {"a": 1},
        {"a": 2},
    ]
    as_text = w.ok("rows", name=bad_json, format="text")
    assert as_text["rows"][2]["value"] == '{"a": oops}'

    image = png(8, 8)
    corrupt = node.put("bad/broken.png", image[:40] + b"\0garbage" * 10)
    opened = w.ok("open", name=corrupt)
    assert (opened["kind"], opened["media_type"]) == ("image", "image/png")
    assert opened["media"]["$media"] == {
        "name": corrupt, "offset": 0, "length": 40 + 80, "media_type": "image/png"
    }  # fmt: skip

    data, _ = wds_tar(3)
    damaged = bytearray(data)
    second = data.index(b"shard/s0000.txt") - 0  # the header of the second file
    header_at = second - second % 512
    damaged[header_at + 148 : header_at + 156] = b"0000000\0"  # a wrong checksum
    broken = node.put("bad/broken.tar", bytes(damaged))
    message = w.fails("open", "MalformedFileError", name=broken)
    assert f"byte {header_at}" in message
    assert "checksum" in message

    assert "ObjectNotFound" in w.call("open", name="local/nope.parquet")["error"]
    assert w.call("open", name="nobackend/x")["error"] == "UnknownBackendError"
    assert w.ok("rows", name=node.put("ok.jsonl", b'{"fine": true}\n'))["rows"][0]["value"] == {
        "fine": True
    }


def test_requests_that_are_not_requests(node: Node) -> None:
    w = node.worker
    answer = w.send(b"this is not json")
    assert (answer["n"], answer["error"]) == (None, "InvalidRequestError")
    assert "no inspector op" in w.fails("explode", "InvalidRequestError")
    assert "takes no argument 'bogus'" in w.fails("open", "InvalidRequestError", bogus="1")
    assert "needs the argument 'name'" in w.fails("open", "InvalidRequestError")
    answer = w.send(json.dumps({"n": 99, "op": "open", "args": {"name": 5}}).encode())
    assert (answer["n"], answer["error"]) == (99, "InvalidRequestError")
    binary = node.put("blob.bin", bytes(range(256)) * 40)
    opened = w.ok("open", name=binary)
    assert opened["kind"] == "binary"
    assert opened["hex"] == (bytes(range(256)) * 16).hex()
    assert "no rows" in w.fails("rows", "InvalidRequestError", name=binary)
    limits = Path(f"/proc/{w.process.pid}/limits").read_text()
    # the worker limited its own address space (--memory), and still reads Parquet under it
    (address,) = [line.split()[3:5] for line in limits.splitlines() if "address space" in line]
    assert address == [str(2 << 30), str(2 << 30)]


def test_registered_dataset_views_match_the_cli(node: Node, tmp_path: Path) -> None:
    from chunkd.client import Client
    from chunkd.client.datasets import Dataset
    from chunkd.client.datasets.register import commit, scan_prefix

    tables = []
    for part in range(3):
        table = pa.table(
            {"id": pa.array(range(part * 40, part * 40 + 40), pa.int64()), "part": [part] * 40}
        )
        node.put(f"ds/web/part-{part}.parquet", parquet_bytes(table, 16))
        tables.append(table)
    with Client(node.socket) as client:
        commit(client, "web", scan_prefix(client, "local/ds/web/"))
        node.put("ds/web/part-3.parquet", parquet_bytes(pa.table({"id": [999], "part": [3]}), 16))
        commit(client, "web", scan_prefix(client, "local/ds/web/"))
        with Dataset.open("web@1", client) as dataset:
            want = [dataset[i] for i in (0, 57, 119)]
            snapshot_id = dataset.id
    w = node.worker
    listed = w.ok("datasets")
    assert [(d["name"], d["latest"]) for d in listed["datasets"]] == [("web", 2)]
    assert listed["next"] is None
    versions = w.ok("dataset", name="web")["versions"]
    assert [(v["version"], v["samples"]) for v in versions] == [(1, 120), (2, 121)]
    assert versions[0]["snapshot"] == snapshot_id
    assert "nope" in w.fails("dataset", "DatasetNotFoundError", name="nope")
    # any name of a version shows its dataset, that version marked (an id: looked up)
    assert w.ok("dataset", name="web")["marked"] is None
    for ref in ("web@1", snapshot_id):
        named = w.ok("dataset", name=ref)
        assert (named["name"], named["marked"]) == ("web", 1), ref
    assert w.ok("dataset", name="web@latest")["marked"] == 2
    assert "no snapshot abab" in w.fails("dataset", "DatasetNotFoundError", name="ab" * 32)
    w.fails("dataset", "InvalidRequestError", name="web@")
    # a bare NAME#N is the latest's sample N; the rl op reads a dataset's samples
    assert w.ok("sample", id="web#120")["value"] == {"id": 999, "part": 3}
    assert "neither prompt" in w.fails("rl", "InvalidRequestError", name="web@1")

    shown = w.ok("snapshot", ref="web@1", count=2)
    assert (shown["snapshot"], shown["name"], shown["version"]) == (snapshot_id, "web", 1)
    assert (shown["format"], shown["samples"], shown["members_total"]) == ("parquet", 120, 3)
    assert [(m["key"], m["first"], m["samples"]) for m in shown["members"]] == [
        ("ds/web/part-0.parquet", 0, 40),
        ("ds/web/part-1.parquet", 40, 40),
    ]
    assert shown["next"] == 2
    assert shown["schema"] == [["id", "int64"], ["part", "int64"]]
    assert shown["frozen"] is False

    diff = w.ok("diff", a="web@1", b="web@2")
    assert (diff["added"], diff["removed"], diff["changed"], diff["same"]) == (
        ["part-3.parquet"], [], [], 3
    )  # fmt: skip

    for index, value in zip((0, 57, 119), want, strict=True):
        sample = w.ok("sample", id=f"web@1#{index}")
        assert sample["value"] == value
        assert sample["dataset"]["index"] == index
        assert sample["dataset"]["snapshot"] == snapshot_id
        assert sample["member"] == f"ds/web/part-{index // 40}.parquet"
        assert sample["index"] == index % 40
    assert "holds 120" in w.fails("sample", "InvalidRequestError", id="web@1#120")
    assert w.call("sample", id="nope@1#0")["error"] == "DatasetNotFoundError"

    step = w.ok("step", ref="web@1", step=3, batch_size=4, world_size=2, seed=7)
    replay = subprocess.run(
        [str(BIN / "chunkd"), "dataset", "replay", "web@1", "--seed", "7", "--step", "3",
         "--batch-size", "4", "--world-size", "2", "--json", "--socket", str(node.socket)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    report = json.loads(replay.stdout)
    assert step["snapshot"] == report["snapshot"] == snapshot_id
    assert {r: v["ids"] for r, v in step["ranks"].items()} == {
        str(r["rank"]): [s["id"] for s in r["samples"]] for r in report["ranks"]
    }
    one = w.ok("step", ref="web@1", step=3, batch_size=4, world_size=2, seed=7, rank=1)
    assert list(one["ranks"]) == ["1"]
    assert one["ranks"]["1"] == step["ranks"]["1"]
    plain = w.ok("step", ref="web@1", step=0, batch_size=5, world_size=1, seed=0, shuffle="false")
    assert plain["ranks"]["0"]["ids"] == [f"ds/web/part-0.parquet#{i}" for i in range(5)]
    past = w.fails(
        "step", "InvalidRequestError", ref="web@1", step=99, batch_size=4, world_size=2, seed=7
    )
    assert "step 99" in past


@pytest.mark.parametrize("ending", [b"\n", b""])
def test_line_index_stays_bounded_and_exact(monkeypatch: pytest.MonkeyPatch, ending: bytes) -> None:
    from chunkd.client.inspect import lines as lines_module

    monkeypatch.setattr(lines_module, "MAX_MARKS", 8)  # the stride doubles many times
    rng = random.Random(2)
    want = [rng.randbytes(rng.randrange(0, 40)).replace(b"\n", b".") for _ in range(5000)]
    data = b"\n".join(want) + ending
    reads: list[tuple[int, int]] = []

    def read(offset: int, length: int) -> memoryview:
        reads.append((offset, length))
        return memoryview(data[offset : offset + length])

    index = lines_module.LineIndex("local/x.txt", len(data), read)
    for start in [0, 4999, 17, 2500, 1, 4000, 3999, 256, 255]:
        got = list(itertools.islice(index.lines_from(start), 3))
        assert [line for _, _, line in got] == want[start : start + 3]
        assert [n for n, _, _ in got] == list(range(start, min(start + 3, 5000)))
        for _, offset, line in got:
            assert data[offset : offset + len(line)] == line
    assert index.lines == 5000
    assert len(index._marks) <= 8
    with pytest.raises(InvalidRequestError, match="holds 5000 lines"):
        next(index.lines_from(5000))


def test_a_page_of_rollouts_completes_its_group_within_bounds(node: Node) -> None:
    from chunkd.client.inspect.rl import MAX_COMPLETION

    # One huge group, then rows with no group at all: neither reads on to the end.
    rows = [
        {"prompt": "p", "completion": f"c{i}", "reward": i % 7, "group": "g"}
        for i in range(MAX_COMPLETION + 500)
    ]
    rows += [{"prompt": "q", "completion": "x", "reward": 0, "group": None} for _ in range(50)]
    name = node.put("rl/long.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    page = node.worker.ok("rl", name=name, start=0, count=5)
    (group,) = page["groups"]
    assert len(group["rollouts"]) == 5 + MAX_COMPLETION
    assert page["next"] == 5 + MAX_COMPLETION
    nulls = node.worker.ok("rl", name=name, start=MAX_COMPLETION + 500, count=5)
    assert sum(len(g["rollouts"]) for g in nulls["groups"]) == 5  # a null group completes nothing
    assert nulls["next"] == MAX_COMPLETION + 505


# ---------------------------------------------------------------------------
# audio headers: duration, rate and channels (chunkd.client.inspect.audio)
# ---------------------------------------------------------------------------

import shutil  # noqa: E402
import wave  # noqa: E402

from chunkd.client.inspect.audio import MAX_READ, audio_info  # noqa: E402


def _wav_bytes(seconds: float, rate: int, channels: int, width: int = 2) -> bytes:
    """A real WAV written by the stdlib's ``wave``: silence of ``seconds``."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(b"\0" * int(seconds * rate) * channels * width)
    return out.getvalue()


class _Counted:
    """``read(offset, length)`` of bytes in memory, counting what is read."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.read_bytes = 0
        self.reads = 0

    def __call__(self, offset: int, length: int) -> bytes:
        assert 0 < length <= MAX_READ
        self.reads += 1
        piece = self.data[offset : offset + length]
        self.read_bytes += len(piece)
        return piece


def _ffmpeg(tmp_path: Path, name: str, *codec: str) -> bytes:
    """A 2.5 s stereo 44.1 kHz tone (22.05 kHz for MP3) encoded by ffmpeg."""
    out = tmp_path / name
    subprocess.run(
        ["ffmpeg", "-v", "error", "-y", "-f", "lavfi",
         "-i", "sine=frequency=440:sample_rate=44100:duration=2.5", "-ac", "2",
         *codec, str(out)],
        check=True, timeout=30,
    )  # fmt: skip
    return out.read_bytes()


@pytest.mark.timeout(10)
def test_a_wav_header_says_its_duration_rate_and_channels_reading_little() -> None:
    data = _wav_bytes(30, 48_000, 2)  # 5.8 MB
    read = _Counted(data)
    info = audio_info(read, len(data), "audio/wav")
    assert info == {
        "codec": "pcm",
        "duration": 30.0,
        "sample_rate": 48_000,
        "channels": 2,
        "bits": 16,
    }
    assert read.read_bytes < 256  # the chunk headers only
    mono = _wav_bytes(1.5, 8_000, 1, width=1)
    assert audio_info(_Counted(mono), len(mono), "audio/wav") == {
        "codec": "pcm", "duration": 1.5, "sample_rate": 8_000, "channels": 1, "bits": 8,
    }  # fmt: skip


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="ffmpeg is not installed")
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("name", "codec", "rate", "duration", "within"),
    [
        ("tone.flac", ("-c:a", "flac"), 44_100, 2.5, 0.001),
        ("tone.ogg", ("-c:a", "libvorbis"), 44_100, 2.5, 0.001),
        ("tone.opus.ogg", ("-c:a", "libopus", "-f", "ogg"), 48_000, 2.5, 0.01),
        # LAME's Info frame counts its padding frames: ffprobe says the same
        ("tone.mp3", ("-ar", "22050", "-c:a", "libmp3lame", "-b:a", "64k"), 22_050, 2.5, 0.1),
        ("vbr.mp3", ("-ar", "22050", "-c:a", "libmp3lame", "-q:a", "4"), 22_050, 2.5, 0.1),
        ("noinfo.mp3", ("-ar", "22050", "-c:a", "libmp3lame", "-b:a", "64k",
                        "-write_xing", "0", "-id3v2_version", "4"), 22_050, 2.5, 0.1),
    ],
)  # fmt: skip
def test_encoded_audio_headers_say_duration_rate_and_channels(
    tmp_path: Path, name: str, codec: tuple[str, ...], rate: int, duration: float, within: float
) -> None:
    data = _ffmpeg(tmp_path, name, *codec)
    media_type = sniff(data[:64])
    assert media_type is not None
    read = _Counted(data)
    info = audio_info(read, len(data), media_type)
    assert info is not None, name
    assert info["sample_rate"] == rate
    assert info["channels"] == 2
    assert info["duration"] == pytest.approx(duration, abs=within), info
    assert read.reads <= 4
    assert read.read_bytes <= 2 * MAX_READ


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "data",
    [
        b"RIFF\x04\x00\x00\x00WAVE",  # no fmt chunk
        b"RIFF\xff\xff\xff\xffWAVEfmt \x02\x00\x00\x00\x01\x00",  # fmt cut short
        b"fLaC\x00\x00",
        b"OggS" + b"\x00" * 30,
        b"ID3\x04\x00\x00\x7f\x7f\x7f\x7f",  # a tag that runs past the end
        b"\xff\xfb\x90",
    ],
)
def test_an_audio_header_that_does_not_parse_gives_none(data: bytes) -> None:
    media_type = sniff(data) or "audio/mpeg"
    assert audio_info(_Counted(data), len(data), media_type) is None


@pytest.mark.timeout(20)
def test_open_of_audio_says_its_duration_rate_and_channels(node: Node) -> None:
    name = node.put("sound/speech.wav", _wav_bytes(3.25, 16_000, 2))
    opened = node.worker.ok("open", name=name)
    assert opened["kind"] == "audio"
    assert opened["audio"] == {
        "codec": "pcm", "duration": 3.25, "sample_rate": 16_000, "channels": 2, "bits": 16,
    }  # fmt: skip
    # an audio cell carries the same, from its bytes
    table = pa.table({"clip": [_wav_bytes(0.5, 8_000, 1)]})
    cell = node.put("sound/clips.parquet", parquet_bytes(table, 1))
    value = node.worker.ok("rows", name=cell)["rows"][0]["value"]["clip"]
    assert value["audio"]["duration"] == 0.5
    assert value["audio"]["channels"] == 1


def _ogg_opus(pre_skip: int, granule: int) -> bytes:
    """An Ogg Opus stream of three pages: OpusHead, OpusTags, and a last audio page at
    ``granule`` (the parser reads headers and granules, not the packets)."""

    def page(kind: int, position: int, sequence: int, body: bytes) -> bytes:
        table = bytes([255] * (len(body) // 255) + [len(body) % 255])
        head = struct.pack("<4sBBqIIIB", b"OggS", 0, kind, position, 7, sequence, 0, len(table))
        return head + table + body

    opus_head = b"OpusHead" + struct.pack("<BBHIhB", 1, 2, pre_skip, 44_100, 0, 0)
    tags = b"OpusTags" + struct.pack("<I", 0) + struct.pack("<I", 0)
    return (
        page(2, 0, 0, opus_head) + page(0, 0, 1, tags) + page(4, granule, 2, b"\xfc" + b"\0" * 40)
    )


@pytest.mark.timeout(10)
def test_an_opus_stream_ending_before_its_pre_skip_has_no_duration() -> None:
    fine = _ogg_opus(pre_skip=312, granule=312 + 48_000)
    assert audio_info(_Counted(fine), len(fine), "audio/ogg") == {
        "codec": "opus", "duration": 1.0, "sample_rate": 44_100, "channels": 2, "bits": None,
    }  # fmt: skip
    short = _ogg_opus(pre_skip=3840, granule=1000)  # its last granule below the pre-skip
    info = audio_info(_Counted(short), len(short), "audio/ogg")
    assert info is not None
    assert info["duration"] is None  # unknown, never negative
    assert (info["codec"], info["channels"]) == ("opus", 2)


@pytest.mark.timeout(20)
def test_a_page_of_audio_tar_members_reads_a_bounded_number_of_headers(node: Node) -> None:
    from chunkd.client.inspect.values import AUDIO_CELLS

    samples = AUDIO_CELLS + 4
    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(samples):
            body = _ogg_opus(pre_skip=312, granule=312 + 48_000 * (i + 1))
            info = tarfile.TarInfo(f"clips/c{i:03d}.opus")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    name = node.put("wds/clips.tar", sink.getvalue())
    rows = node.worker.ok("rows", name=name, count=samples)["rows"]
    assert len(rows) == samples
    heard = [r["value"]["opus"]["$media"].get("audio") for r in rows]
    # the first AUDIO_CELLS carry their header's facts; the rest only their media range
    assert [h["duration"] for h in heard[:AUDIO_CELLS]] == [
        float(i + 1) for i in range(AUDIO_CELLS)
    ]
    assert heard[AUDIO_CELLS:] == [None] * 4
    # a sample shown alone reads its own header
    alone = node.worker.ok("sample", id=f"{name}#{samples - 1}")["value"]["opus"]["$media"]
    assert alone["audio"]["duration"] == float(samples)


@pytest.mark.timeout(60)
def test_dataset_of_a_snapshot_id_is_bounded(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dataset`` of an id: an id no snapshot has is a 404 in a request or two, however
    many datasets there are; a real one in an older version of a late dataset is found;
    a lookup past its bounds says how far it looked."""
    from chunkd.client import Client
    from chunkd.client.datasets.register import commit, scan_prefix
    from chunkd.client.inspect import registry as registry_module

    for folder in ("common", "old", "new"):
        node.put(f"ds/{folder}/part.jsonl", f'{{"folder": "{folder}"}}\n'.encode())
    with Client(node.socket) as client:
        common = scan_prefix(client, "local/ds/common/")
        for i in range(40):
            commit(client, f"d{i:03d}", common)
        old = commit(client, "zz/late", scan_prefix(client, "local/ds/old/"))["snapshot"]
        commit(client, "zz/late", scan_prefix(client, "local/ds/new/"))
    w = node.worker
    assert len(w.ok("datasets")["datasets"]) == 41

    def asked() -> float:
        return node.daemon.metric("chunkd_backend_requests_total", backend="local")

    before = asked()
    made_up = w.fails("dataset", "DatasetNotFoundError", name="ab" * 32)
    assert asked() - before <= 2, made_up  # the manifest's read, nothing listed
    before = asked()
    found = w.ok("dataset", name=old)
    assert (found["name"], found["marked"]) == ("zz/late", 1)

    # past its bounds the lookup gives up and says how far it went
    monkeypatch.setattr(registry_module, "OWNER_REQUESTS", 0)
    with Client(node.socket) as client:
        from chunkd.errors import DatasetNotFoundError

        with pytest.raises(DatasetNotFoundError) as caught:
            registry_module.Registry(client).owner_of(old)
    message = str(caught.value)
    assert "latest version of 41 datasets" in message
    assert "stops after 2000 versions, 0 requests" in message
    assert f"?snapshot={old}" in message
