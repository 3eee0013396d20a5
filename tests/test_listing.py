"""Listings of any size: Backend.scan, the file lister, pages, the token, the cache, the doors."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
from pathlib import Path

import obstore
import pytest
from obstore.store import LocalStore

from chunkd.client import Client
from chunkd.client.protocol import VERSION, recv_frame, send_frame
from chunkd.gateway.backends import Backend, Backends, FileLister, make_backend
from chunkd.gateway.config import BackendConfig
from chunkd.gateway.listing import ListEntry, Listings
from chunkd.gateway.metrics import Metrics
from chunkd.testing import s3_backend

from .conftest import Daemon

# Names that sort differently as whole keys than as path components ('-' and '.'
# sort before '/'), spaces, non-ASCII, and a name like a LocalStore staging file.
NAMES = ["a", "b", "a-c", "a.b", "data", "data.json", "x y", "é", "Z", "a0"]


def make_tree(root: Path, count: int, seed: int = 1) -> list[str]:
    """``count`` attempts at random files under ``root``; returns the keys made, sorted."""
    rng = random.Random(seed)
    made = set()
    for i in range(count):
        parts = [rng.choice(NAMES) + str(rng.randint(0, 2)) for _ in range(rng.randint(1, 4))]
        path = root.joinpath(*parts)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.is_dir():
                path.write_bytes(b"x" * (i % 7))
                made.add("/".join(parts))
        except (NotADirectoryError, FileExistsError, IsADirectoryError):
            continue
    return sorted(k for k in made if (root / k).is_file())


def obstore_keys(root: Path, prefix: str | None = None) -> list[str]:
    store = LocalStore(str(root))
    return sorted(m["path"] for batch in obstore.list(store, prefix) for m in batch)


def test_the_file_lister_lists_what_obstore_lists_in_key_order(tmp_path: Path) -> None:
    keys = make_tree(tmp_path, 600)
    (tmp_path / "staging#1").write_bytes(b"half")  # LocalStore hides a put in progress
    (tmp_path / "kept#x").write_bytes(b"shown")
    os.symlink(tmp_path / keys[0], tmp_path / "link")
    expected = obstore_keys(tmp_path)
    assert "staging#1" not in expected
    assert "kept#x" in expected
    assert "link" in expected
    lister = FileLister(str(tmp_path))
    for page in (1, 7, 1000):
        got: list[str] = []
        after = None
        while True:
            batch = lister.batch("", after, page)
            got += [m.key for m in batch]
            if len(batch) < page:
                break
            after = batch[-1].key
        assert got == expected
    # Any key resumes the listing, present or not.
    rng = random.Random(2)
    for token in [*rng.sample(expected, 25), "a", "b/", "a-", "zzz", "\U0010ffff"]:
        assert [m.key for m in lister.batch("", token, 10_000)] == [
            k for k in expected if k > token
        ]
    # Prefixes are whole path segments, like obstore's.
    for prefix in {k.rsplit("/", 1)[0] for k in expected if "/" in k}:
        assert [m.key for m in lister.batch(prefix, None, 10_000)] == obstore_keys(tmp_path, prefix)
    # Sizes and versions are LocalStore's.
    store = LocalStore(str(tmp_path))
    for meta in lister.batch("", None, 50):
        head = obstore.head(store, meta.key)
        assert (meta.size, meta.version) == (head["size"], head["e_tag"])


def memory_backend(metrics: Metrics | None = None, **keys: object) -> Backend:
    config = BackendConfig(name="mem", url="memory://", writable=True, **keys)
    return make_backend(config, metrics or Metrics())


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(params=["memory", "file", "s3"])
def any_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """An empty backend of each kind (s3: moto, a fresh bucket)."""
    if request.param == "memory":
        return memory_backend()
    if request.param == "file":
        (tmp_path / "data").mkdir()
        config = BackendConfig(name="files", url=f"file://{tmp_path}/data", writable=True)
        return make_backend(config, Metrics())
    s3_server = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("bucket")
    return make_backend(s3_server.backend_config("s3", f"s3://{bucket}/pre"), Metrics())


KEYS = sorted(
    {f"{a}/{b}" for a in ("a", "a-b", "a.c", "b", "d/e") for b in ("0", "1-x", "é", "z.y")}
    | {"a", "top.bin", "d/e-f"}
)


async def test_scan_is_in_key_order_on_every_backend(any_backend: Backend, tmp_path: Path) -> None:
    if any_backend.config.scheme == "file":
        for key in KEYS:
            if key == "a":
                continue  # a file and a directory cannot share a name
            path = tmp_path / "data" / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(key.encode())
        keys = [k for k in KEYS if k != "a"]
    else:
        for key in KEYS:
            await any_backend.put(key, key.encode())
        keys = KEYS
    for batch in (1, 3, 1000):
        for after in (None, "a", "a-b/1-x", "b/", "c", "zz"):
            got = [
                m.key
                async for metas in any_backend.scan("", start_after=after, batch=batch)
                for m in metas
            ]
            assert got == [k for k in keys if after is None or k > after]
    got = [m.key async for metas in any_backend.scan("d", batch=2) for m in metas]
    assert got == [k for k in keys if k.startswith("d/")]


def one_level(keys: list[str], prefix: str) -> list[ListEntry]:
    """What a delimiter listing of ``prefix`` holds, computed from all the keys."""
    top = f"{prefix}/" if prefix else ""
    out: dict[str, ListEntry] = {}
    for key in keys:
        if not key.startswith(top):
            continue
        rest = key[len(top) :]
        if "/" in rest:
            name = top + rest.split("/")[0]
            out.setdefault(name + "/", ListEntry(name, "directory"))
        else:
            out[key] = ListEntry(key, "file")
    return [out[k] for k in sorted(out)]


async def read_all(listings: Listings, prefix: str, recursive: bool, limit: int) -> list[ListEntry]:
    out: list[ListEntry] = []
    token = None
    for _ in range(10_000):
        page = await listings.page(
            "mem", prefix, recursive=recursive, start_after=token, limit=limit
        )
        assert len(page.entries) <= limit
        out += page.entries
        token = page.next
        if token is None:
            return out
    raise AssertionError("the listing never ended")


async def test_pages_group_by_directory_and_resume_after_their_token() -> None:
    backend = memory_backend(list_revalidate=0)
    rng = random.Random(3)
    keys = sorted(
        {"/".join(rng.choice(NAMES) for _ in range(rng.randint(1, 3))) for _ in range(400)}
    )
    for key in keys:
        await backend.put(key, b"x")
    listings = Listings(Backends([backend]), Metrics())
    for limit in (1, 2, 7, 1000):
        for prefix in ("", "a", "data", "a/b", "nope"):
            got = await read_all(listings, prefix, False, limit)
            assert [(e.key, e.type) for e in got] == [
                (e.key, e.type) for e in one_level(keys, prefix)
            ]
        got = await read_all(listings, "", True, limit)
        assert [e.key for e in got] == keys
        assert all(e.type == "file" and e.size == 1 and e.version for e in got)
    await listings.close()


async def test_a_folded_directory_is_skipped_not_read_through() -> None:
    metrics = Metrics()
    backend = memory_backend(metrics, list_revalidate=0)
    for i in range(5000):
        await backend.put(f"big/{i:05d}", b"")
    for key in ("a.txt", "z.txt", "big.json"):
        await backend.put(key, b"")
    listings = Listings(Backends([backend]), metrics)
    requests = "chunkd_backend_requests_total"
    before = sample(metrics, requests, backend="mem", op="list")
    got = await read_all(listings, "", False, 1000)
    assert [e.key for e in got] == ["a.txt", "big.json", "big", "z.txt"]  # "." sorts before "/"
    # 5,000 keys under big/ at 1,000 a request: a read-through would take 6 requests.
    assert sample(metrics, requests, backend="mem", op="list") - before <= 3
    await listings.close()


async def test_pages_are_cached_for_list_revalidate_then_read_again() -> None:
    metrics = Metrics()
    backend = memory_backend(metrics, list_revalidate=0.5)
    await backend.put("shards/0", b"")
    listings = Listings(Backends([backend]), metrics)
    first = await listings.page("mem", "shards")
    await backend.put("shards/1", b"")  # a folder gains a shard
    assert await listings.page("mem", "shards") == first  # within list_revalidate
    assert sample(metrics, "chunkd_list_requests_total", backend="mem", source="cache") == 1
    await asyncio.sleep(0.6)
    again = await listings.page("mem", "shards")
    assert [e.key for e in again.entries] == ["shards/0", "shards/1"]
    await listings.close()


async def test_the_next_page_is_read_ahead_and_served_once_when_nothing_is_cached() -> None:
    metrics = Metrics()
    backend = memory_backend(metrics, list_revalidate=0)
    for i in range(30):
        await backend.put(f"k/{i:02d}", b"")
    listings = Listings(Backends([backend]), metrics)
    first = await listings.page("mem", "k", limit=10)
    await asyncio.sleep(0.2)  # the read-ahead of the second page lands meanwhile
    second = await listings.page("mem", "k", start_after=first.next, limit=10)
    assert [e.key for e in second.entries] == [f"k/{i:02d}" for i in range(10, 20)]
    assert sample(metrics, "chunkd_list_requests_total", backend="mem", source="cache") == 1
    await backend.put("k/10a", b"")  # not cached: the page is read again when asked again
    again = await listings.page("mem", "k", start_after=first.next, limit=10)
    assert "k/10a" in [e.key for e in again.entries]
    await listings.close()


async def test_a_page_fits_its_byte_budget_however_long_the_keys() -> None:
    backend = memory_backend()
    keys = [f"long/{i:04d}-" + 'é"\\' * 300 for i in range(50)]
    for key in keys:
        await backend.put(key, b"")
    listings = Listings(Backends([backend]), Metrics())
    token = None
    seen: list[str] = []
    while True:
        page = await listings.page("mem", "long", start_after=token, max_bytes=20_000)
        encoded = json.dumps(page.columns(), ensure_ascii=False).encode()
        assert len(encoded) <= 20_000 + 4096
        assert page.entries
        seen += [e.key for e in page.entries]
        token = page.next
        if token is None:
            break
    assert seen == keys
    await listings.close()


# -- through a real daemon ------------------------------------------------------------


@pytest.fixture
def node(start_daemon, tmp_path: Path) -> Daemon:
    work = tmp_path / "work"
    (work / "chunkd-data").mkdir(parents=True)
    return start_daemon(cwd=work)


def shards(daemon: Daemon, folder: str, count: int, suffix: str = ".jsonl") -> list[str]:
    root = daemon.cwd / "chunkd-data" / folder
    root.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(count):
        name = f"shard-{i:06d}{suffix}"
        fd = os.open(root / name, os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b'{"i": %d}\n' % i)
        os.close(fd)
        names.append(f"local/{folder}/{name}")
    return names


def filesystem(daemon: Daemon):
    import fsspec

    sock = str(daemon.cwd / "chunkd.sock")
    return fsspec.filesystem("chunkd", socket_path=sock, skip_instance_cache=True)


def test_a_folder_of_1200_shards_lists_through_fsspec_and_the_client(node: Daemon) -> None:
    import fsspec

    names = shards(node, "many", 1200)
    fs = fsspec.filesystem(
        "chunkd", socket_path=str(node.cwd / "chunkd.sock"), skip_instance_cache=True
    )
    assert fs.ls("local/many", detail=False) == names
    assert sorted(fs.glob("chunkd://local/many/*.jsonl")) == names
    with Client(node.cwd / "chunkd.sock") as client:
        entries = client.ls("local/many")
        assert [e["name"] for e in entries] == names
        root = node.cwd / "chunkd-data"
        for entry in entries[::97]:
            st = (root / entry["name"].removeprefix("local/")).stat()
            assert (entry["type"], entry["size"]) == ("file", st.st_size)
            assert entry["modified"] == pytest.approx(st.st_mtime, abs=1e-5)
        assert [e["name"] for e in client.ls("local")] == ["local/many"]
        page, token = client.ls_page("local/many", limit=500)
        assert len(page) == 500
        assert token == "many/shard-000499.jsonl"
        rest = list(client.iter_ls("local/many", start_after=token))
        assert [e["name"] for e in page + rest] == names


def test_http_list_pages_with_a_token(node: Daemon) -> None:
    names = shards(node, "http", 1200)
    got: list[str] = []
    token = None
    pages = 0
    while True:
        query = "limit=500" + (f"&start_after={token}" if token else "")
        status, _, body = node.get(f"/v1/list/local/http?{query}")
        assert status == 200, body
        doc = json.loads(body)
        got += [e["name"] for e in doc["entries"]]
        pages += 1
        token = doc["next"]
        if token is None:
            break
    assert got == names
    assert pages == 3
    status, _, body = node.get("/v1/list/local?recursive=true&limit=10000")
    assert [e["name"] for e in json.loads(body)["entries"]] == names
    status, _, body = node.get("/v1/list/local")
    assert json.loads(body)["entries"] == [{"name": "local/http", "type": "directory"}]
    for bad, code in (
        ("/v1/list/local/http?limit=0", 400),
        ("/v1/list/local/http?recursive=maybe", 400),
        ("/v1/list/nope/x", 404),
        ("/v1/list/local/..%2Fetc", 400),
    ):
        status, _, body = node.get(bad)
        assert status == code, (bad, body)
        assert json.loads(body)["message"]


def test_an_old_client_gets_a_clear_error_not_a_first_page(node: Daemon) -> None:
    shards(node, "old", 1200)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(node.cwd / "chunkd.sock"))
        send_frame(sock, {"op": "list", "id": 1, "name": "local/old"})  # no hello
        answer, payload, _ = recv_frame(sock)
        assert (answer["ok"], answer["error"], payload) == (False, "InvalidRequestError", b"")
        send_frame(sock, {"op": "hello", "id": 2, "version": 1})
        answer, _, _ = recv_frame(sock)
        assert (answer["ok"], answer["error"]) == (False, "ProtocolVersionError")
        assert f"version {VERSION}" in answer["message"]
        assert "version 1" in answer["message"] or "speaks 1" in answer["message"]
        send_frame(sock, {"op": "list", "id": 3, "name": "local/old"})
        answer, payload, _ = recv_frame(sock)
        assert answer["ok"] is False
        assert payload == b""


@pytest.mark.slow
def test_100k_files_list_through_fsspec(node: Daemon) -> None:
    import fsspec

    names = shards(node, "huge", 100_001, suffix=".bin")
    fs = fsspec.filesystem(
        "chunkd", socket_path=str(node.cwd / "chunkd.sock"), skip_instance_cache=True
    )
    assert fs.ls("local/huge", detail=False) == names
    assert fs.find("local/huge") == names
    assert len(fs.glob("local/huge/*.bin")) == len(names)
    walked = list(fs.walk("local"))
    assert [(root, dirs) for root, dirs, _ in walked] == [("local", ["huge"]), ("local/huge", [])]
    assert sum(len(files) for _, _, files in walked) == len(names)
    assert fs.info("local/huge")["type"] == "directory"
    assert fs.info(names[-1])["size"] > 0
    # A recursive listing of more than the old 100,000-object limit is no failure.
    assert node.metric("chunkd_backend_errors_total", kind="BackendUnavailableError") == 0
    assert node.metric("chunkd_backend_circuit_open") == 0


def s3_daemon(start_daemon, tmp_path: Path, s3_server) -> Daemon:
    bucket = f"ls-{os.urandom(5).hex()}"
    s3_server.client().create_bucket(Bucket=bucket)
    toml = f"""
[cache]
dir = "{tmp_path / "cache"}"
ram_bytes = "64MiB"
disk_bytes = "256MiB"
disk_min_free_bytes = 0
fsync = "never"

{s3_backend("data", f"s3://{bucket}/pre", s3_server.endpoint)}"""
    daemon = start_daemon(toml)
    daemon.bucket = bucket  # type: ignore[attr-defined]
    return daemon


def test_s3_directory_markers_list_as_directories_in_fsspec(
    start_daemon, tmp_path: Path, s3_server
) -> None:
    daemon = s3_daemon(start_daemon, tmp_path, s3_server)
    client = s3_server.client()
    for key, body in (("pre/tables/", b""), ("pre/tables/a.parquet", b"PAR1"), ("pre/x", b"1")):
        client.put_object(Bucket=daemon.bucket, Key=key, Body=body)  # type: ignore[attr-defined]
    fs = filesystem(daemon)
    assert fs.ls("data", detail=False) == ["data/tables", "data/x"]
    assert fs.ls("data/tables", detail=False) == ["data/tables/a.parquet"]
    assert fs.find("data") == ["data/tables/a.parquet", "data/x"]
    assert fs.find("data", withdirs=True) == [  # the path itself too, as fsspec's own find
        "data",
        "data/tables",
        "data/tables/a.parquet",
        "data/x",
    ]
    with Client(daemon.cwd / "chunkd.sock") as raw:
        # The listed folder's own marker is not an entry of it.
        assert [e["name"] for e in raw.ls("data/tables", recursive=True)] == [
            "data/tables/a.parquet"
        ]


def test_a_start_after_no_key_can_be_lists_after_it_and_the_backend_stays_up(
    start_daemon, tmp_path: Path, s3_server
) -> None:
    """A start point that is no key (S3's start-after may be any string) lists what
    follows it in key order; the backend, which takes only keys, is never asked with
    it, so it is no outage either."""
    daemon = s3_daemon(start_daemon, tmp_path, s3_server)
    for key in ("pre/k/a", "pre/k b"):
        s3_server.client().put_object(Bucket=daemon.bucket, Key=key, Body=b"1")  # type: ignore[attr-defined]
    wanted = {"a//b": ["data/k b", "data/k/a"], "./x": ["data/k b", "data/k/a"]}
    wanted["k/../a"] = ["data/k/a"]
    for _ in range(4):  # more than the circuit takes, were each an outage
        for token, names in wanted.items():
            status, _, body = daemon.get(f"/v1/list/data?recursive=true&start_after={token}")
            assert status == 200, body
            assert [e["name"] for e in json.loads(body)["entries"]] == names, token
        with Client(daemon.cwd / "chunkd.sock") as raw:
            assert raw.ls_page("data", start_after="a//b") is not None
    status, _, body = daemon.get("/v1/list/data?limit=%C2%B2")  # "²" is a digit to Python
    assert status == 400, body
    assert daemon.metric("chunkd_backend_circuit_open", backend="data") == 0
    assert daemon.metric("chunkd_backend_errors_total", kind="BackendUnavailableError") == 0
    assert daemon.get("/v1/objects/data/k/a")[2] == b"1"
    # obstore drops an offset's last "/": "k b" sorts before "k/" and must not come.
    status, _, body = daemon.get("/v1/list/data?recursive=true&start_after=k/")
    assert [e["name"] for e in json.loads(body)["entries"]] == ["data/k/a"]


def test_names_with_control_characters_list_in_pages_that_fit(node: Daemon) -> None:
    root = node.cwd / "chunkd-data" / "ctl"
    root.mkdir()
    for i in range(1000):  # each name's bytes take six in JSON
        (root / ("\x01" * 240 + f"{i:04d}")).write_bytes(b"")
    with Client(node.cwd / "chunkd.sock") as client:
        assert len(client.ls("local/ctl")) == 1000
    assert node.metric("chunkd_local_malformed_frames_total") == 0


async def test_a_read_ahead_joined_by_its_reader_is_not_served_again() -> None:
    metrics = Metrics()
    backend = memory_backend(metrics, list_revalidate=0)
    for i in range(30):
        await backend.put(f"k/{i:02d}", b"")
    listings = Listings(Backends([backend]), metrics)
    first = await listings.page("mem", "k", limit=10)
    # At once: the read-ahead of the second page is still in flight, and is joined.
    second = await listings.page("mem", "k", start_after=first.next, limit=10)
    assert len(second.entries) == 10
    await asyncio.sleep(0.2)
    await backend.put("k/10a", b"")
    again = await listings.page("mem", "k", start_after=first.next, limit=10)
    assert "k/10a" in [e.key for e in again.entries]  # not the page read ahead before
    await listings.close()


def s3_model(keys: list[str], prefix: str, delimiter: str | None) -> list[str]:
    """What S3 lists for ``prefix`` and ``delimiter``: keys and common prefixes, in order."""
    out: list[str] = []
    for key in sorted(keys, key=lambda k: k.encode()):
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix) :]
        if delimiter and delimiter in rest:
            common = prefix + rest[: rest.index(delimiter) + len(delimiter)]
            if not out or out[-1] != common:
                out.append(common)
        else:
            out.append(key)
    return out


async def test_s3_pages_match_the_model_for_any_prefix_and_delimiter() -> None:
    """``page_of`` (the S3 front's listing) against a model of S3, over random keys,
    raw prefixes (not directories), delimiters and page sizes."""
    rng = random.Random(20261201)
    alphabet = ["a", "b", "ab", "a.b", "a-b", "b+", "é", "1"]
    keys = set()
    while len(keys) < 600:
        depth = rng.randint(1, 4)
        keys.add("/".join(rng.choice(alphabet) for _ in range(depth)))
    backend = memory_backend(list_revalidate=0)
    for key in keys:
        await backend.put(key, b"x")
    listings = Listings(Backends([backend]), Metrics())
    prefixes = ["", "a", "a/", "ab", "a/b", "a.b/", "b+/é", "é", "zz", "a/a/a/a/"]
    for prefix in prefixes:
        for delimiter in (None, "/", "b", "+/"):
            for limit in (1, 3, 1000):
                got: list[str] = []
                token = None
                for _ in range(5000):
                    page = await listings.page_of(
                        "mem", prefix, delimiter=delimiter, start_after=token, limit=limit
                    )
                    assert len(page.entries) <= limit
                    got += [
                        f"{e.key}{delimiter}" if e.type == "directory" else e.key
                        for e in page.entries
                    ]
                    token = page.next
                    if token is None:
                        break
                assert got == s3_model(list(keys), prefix, delimiter), (prefix, delimiter, limit)
    await listings.close()


async def test_s3_pages_of_prefixes_no_key_can_start_with_or_odd_start_points() -> None:
    """Prefixes whose natural start point is no key ("0" would start at "/...",
    "data/0" at "data//..."), prefixes no key can have ("/", "data//", "data/./"), and
    start points that are no key ("data/./x"): each lists what S3 would, never fails."""
    keys = ["0001", "0/x", "0a", "data/0a", "data/0/b", "data/1", "data/.hidden", "data/..x", "z"]
    backend = memory_backend(list_revalidate=0)
    for key in keys:
        await backend.put(key, b"x")
    listings = Listings(Backends([backend]), Metrics())

    async def listed(prefix: str, delimiter: str | None, after: str | None = None) -> list[str]:
        page = await listings.page_of(
            "mem", prefix, delimiter=delimiter, start_after=after, limit=1000
        )
        return [f"{e.key}{delimiter}" if e.type == "directory" else e.key for e in page.entries]

    for prefix in ("0", "data/0", "data/.", "data/..", "d", ""):
        for delimiter in (None, "/"):
            assert await listed(prefix, delimiter) == s3_model(keys, prefix, delimiter), prefix
    for prefix in ("/", "data//", "data/./", "//", "data/../"):
        assert await listed(prefix, None) == [], prefix
    for after in ("data/./x", "data/.", "data//", "0/", "/"):
        wanted = [k for k in s3_model(keys, "", None) if k > after]
        assert await listed("", None, after) == wanted, after
    await listings.close()


async def test_the_cache_of_pages_is_bounded_for_empty_pages_too() -> None:
    backend = memory_backend(list_revalidate=60)
    await backend.put("a/b", b"x")
    listings = Listings(Backends([backend]), Metrics(), cache_entries=100)
    for n in range(3000):
        await listings.page_of("mem", f"nothing-{n}", delimiter="/")
    assert len(listings._cache) <= 100
    await listings.close()
