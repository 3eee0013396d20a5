"""Real S3 clients read through the S3 front as users run them, with moto behind it.

Each test starts a daemon with ``[s3_front]`` (fixture ``s3_front``): bucket ``data``
is a moto bucket, ``local`` a directory. The clients are the ones users point at an
S3 endpoint unchanged: boto3 (and s3transfer, and its presigned URLs fetched with
curl), s3fs (and pandas through it), pyarrow's ``S3FileSystem`` (the AWS C++ SDK),
polars and obstore (object_store, in Rust) and the AWS CLI. Every read is checked
byte for byte against what was put, and each client meets a missing key (a 404 of
its own kind, never a 5xx) and a wrong secret (a permission error).

The keys hold what clients encode differently: a space, non-ASCII letters, ``+``
(a space in a query, never in a path) and ``%`` followed by hex digits (a key that
is decoded twice turns into another one).
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import boto3
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError

from chunkd.testing import S3Server
from chunkd.testing.s3front import FRONT_KEY, FRONT_SECRET, front_env

from .conftest import FrontNode

#: a key with spaces (two in a row)
SPACE = "with space/a  b.txt"
#: a key with non-ASCII letters (NFC, as typed)
UNICODE = "données/é.txt"
#: a key with ``+``: a path keeps it, a query reads it as a space
PLUS = "plus/1+1=2.bin"
#: a key with ``%`` and hex digits after it: decoded twice it would read "100% A.txt"
PERCENT = "percent/100%25 %41.txt"
AWKWARD = (SPACE, UNICODE, PLUS, PERCENT)

MiB = 1 << 20


def blob(size: int, seed: int | str) -> bytes:
    """``size`` pseudo-random bytes of ``seed``: each object's own, so no read can pass
    with another object's bytes or another range's."""
    return random.Random(seed).randbytes(size)


def put_all(s3_server: S3Server, bucket: str, objects: dict[str, bytes]) -> None:
    """Put ``objects`` into the moto bucket directly (not through the front)."""
    moto = s3_server.client()

    def put(key: str) -> None:
        moto.put_object(Bucket=bucket, Key=key, Body=objects[key])

    with ThreadPoolExecutor(8) as pool:  # moto answers a put in milliseconds, not less
        list(pool.map(put, objects))


def write_all(root: Path, objects: dict[str, bytes]) -> None:
    """Write ``objects`` as files under ``root`` (the ``local`` bucket)."""
    for key, body in objects.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)


def awkward_objects() -> dict[str, bytes]:
    return {key: blob(1000 + 17 * n, key) for n, key in enumerate(AWKWARD)}


def tree_objects() -> dict[str, bytes]:
    """A small tree: two "directories" under ``tree/`` and a file beside them."""
    keys = ["tree/a/1.txt", "tree/a/2.txt", "tree/b/3.txt", "tree/top.txt"]
    return {key: blob(300 + n, key) for n, key in enumerate(keys)}


def parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=100)
    return sink.getvalue()


def table_of(start: int, rows: int) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(range(start, start + rows), type=pa.int64()),
            "name": [f"row {i} é+%" for i in range(start, start + rows)],
            "score": [i / 7 for i in range(start, start + rows)],
        }
    )


#: three Parquet files under ``dir/`` (a dataset) and one at ``x.parquet``
PARTS = [table_of(300 * n, 300) for n in range(3)]
TABLE = table_of(10_000, 500)


def parquet_objects() -> dict[str, bytes]:
    objects = {f"dir/part-{n}.parquet": parquet_bytes(part) for n, part in enumerate(PARTS)}
    objects["x.parquet"] = parquet_bytes(TABLE)
    objects["x.csv"] = TABLE.to_pandas().to_csv(index=False).encode()
    return objects


def assert_no_server_faults(node: FrontNode) -> None:
    """No request of the test was answered with a 5xx (a client would have retried it)."""
    log = node.daemon.log.read_text(errors="replace")
    # the front logs each answer of 500 and up, and each body cut short, with its request id
    faults = [line for line in log.splitlines() if "(request " in line]
    assert not faults, "\n".join(faults)
    assert "Traceback" not in log, log[-4000:]


def curl(url: str, *args: str) -> tuple[int, bytes]:
    """(status, body) of a GET of ``url`` by curl, the URL sent as it is."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not on PATH: it is the plain HTTP client a presigned URL is for")
    done = subprocess.run(
        [
            "curl",
            "--silent",
            "--show-error",
            "--globoff",
            "--write-out",
            "\n%{http_code}",
            *args,
            url,
        ],
        capture_output=True,
        check=True,
        timeout=60,
    )
    body, _, status = done.stdout.rpartition(b"\n")
    return int(status), body


# -- boto3 ---------------------------------------------------------------------------


def test_boto3_reads_lists_downloads_and_presigns(
    s3_front: Callable[..., FrontNode], s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    node = s3_front()
    big = blob(20 * MiB + 12345, "big")
    objects = {**awkward_objects(), **tree_objects(), "big.bin": big}
    # a listing of moto's over three pages of 50, with and without a delimiter
    objects.update({f"page/{i:03d}/a": b"%d" % i for i in range(120)})
    objects.update({f"page/f{i:03d}": b"f%d" % i for i in range(30)})
    put_all(s3_server, bucket, objects)
    # and one of the directory's: 2,500 keys, 1,200 "directories" and 300 files beside
    many = {f"many/{i:04d}.txt": b"%d" % i for i in range(2500)}
    many.update({f"dirs/{i:04d}/f": b"d%d" % i for i in range(1200)})
    many.update({f"dirs/file{i:03d}": b"e%d" % i for i in range(300)})
    write_all(node.files, many)
    s3 = node.client()  # boto3's current default config: checksums when_supported

    for key in AWKWARD:
        got = s3.get_object(Bucket="data", Key=key)
        assert got["Body"].read() == objects[key], key
        assert got["ContentLength"] == len(objects[key])
        head = s3.head_object(Bucket="data", Key=key)
        assert head["ContentLength"] == len(objects[key])
        assert head["ETag"] == got["ETag"]
        ranged = s3.get_object(Bucket="data", Key=key, Range="bytes=100-199")
        assert ranged["Body"].read() == objects[key][100:200]
        assert ranged["ContentRange"] == f"bytes 100-199/{len(objects[key])}"
        assert ranged["ResponseMetadata"]["HTTPStatusCode"] == 206
    suffix = s3.get_object(Bucket="data", Key=PLUS, Range="bytes=-10")
    assert suffix["Body"].read() == objects[PLUS][-10:]
    tail = s3.get_object(Bucket="data", Key=PLUS, Range="bytes=990-")
    assert tail["Body"].read() == objects[PLUS][990:]

    listed = s3.list_objects_v2(Bucket="data", Prefix="")
    by_key = {item["Key"]: item for item in listed["Contents"]}
    for key in AWKWARD:  # boto3 asks for encoding-type=url and decodes the keys
        assert by_key[key]["Size"] == len(objects[key])
        assert by_key[key]["ETag"] == s3.head_object(Bucket="data", Key=key)["ETag"]

    # moto behind: 150 keys in pages of 50; 120 prefixes and 30 keys in pages of 50
    pages = list(
        s3.get_paginator("list_objects_v2").paginate(
            Bucket="data", Prefix="page/", PaginationConfig={"PageSize": 50}
        )
    )
    keys = [item["Key"] for page in pages for item in page.get("Contents", [])]
    assert keys == sorted(k for k in objects if k.startswith("page/"))
    assert len(pages) == 3
    pages = list(
        s3.get_paginator("list_objects_v2").paginate(
            Bucket="data", Prefix="page/", Delimiter="/", PaginationConfig={"PageSize": 50}
        )
    )
    prefixes = [p["Prefix"] for page in pages for p in page.get("CommonPrefixes", [])]
    keys = [item["Key"] for page in pages for item in page.get("Contents", [])]
    assert prefixes == [f"page/{i:03d}/" for i in range(120)]
    assert keys == [f"page/f{i:03d}" for i in range(30)]
    assert all(page["KeyCount"] <= 50 for page in pages)

    # the directory behind: 2,500 keys in pages of MaxKeys' default (1,000)
    pages = list(s3.get_paginator("list_objects_v2").paginate(Bucket="local", Prefix="many/"))
    assert [page["KeyCount"] for page in pages] == [1000, 1000, 500]
    keys = [item["Key"] for page in pages for item in page["Contents"]]
    assert keys == sorted(k for k in many if k.startswith("many/"))
    pages = list(
        s3.get_paginator("list_objects_v2").paginate(
            Bucket="local", Prefix="dirs/", Delimiter="/", PaginationConfig={"PageSize": 1000}
        )
    )
    prefixes = [p["Prefix"] for page in pages for p in page.get("CommonPrefixes", [])]
    keys = [item["Key"] for page in pages for item in page.get("Contents", [])]
    assert prefixes == [f"dirs/{i:04d}/" for i in range(1200)]
    assert keys == [f"dirs/file{i:03d}" for i in range(300)]
    assert [page["KeyCount"] for page in pages] == [1000, 500]

    # s3transfer: a HEAD, then ranged GETs of 5 MiB on several threads
    target = tmp_path / "big.bin"
    s3.download_file(
        "data",
        "big.bin",
        str(target),
        Config=TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB),
    )
    assert target.read_bytes() == big

    # a presigned SigV4 URL is a plain GET anyone can make, curl here
    presigner = node.client(signature_version="s3v4")
    for key in (SPACE, UNICODE, PERCENT):
        url = presigner.generate_presigned_url(
            "get_object", Params={"Bucket": "data", "Key": key}, ExpiresIn=300
        )
        assert "X-Amz-Signature=" in url
        assert curl(url) == (200, objects[key])
    url = presigner.generate_presigned_url(
        "get_object", Params={"Bucket": "data", "Key": PLUS}, ExpiresIn=300
    )
    assert curl(url, "--range", "10-19") == (206, objects[PLUS][10:20])
    tampered = url.replace("X-Amz-Expires=300", "X-Amz-Expires=301")
    assert curl(tampered)[0] == 403

    # a missing key is a 404 (NoSuchKey for GET, bare for HEAD); a wrong secret a 403
    with pytest.raises(ClientError) as missing:
        s3.get_object(Bucket="data", Key="tree/missing.txt")
    assert missing.value.response["Error"]["Code"] == "NoSuchKey"
    assert missing.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    with pytest.raises(ClientError) as missing:
        s3.head_object(Bucket="data", Key="tree/missing.txt")
    assert missing.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    wrong = boto3.client(
        "s3",
        endpoint_url=node.endpoint,
        aws_access_key_id=FRONT_KEY,
        aws_secret_access_key="not-" + FRONT_SECRET,
        region_name="us-east-1",
    )
    with pytest.raises(ClientError) as denied:
        wrong.get_object(Bucket="data", Key=SPACE)
    assert denied.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    assert denied.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert_no_server_faults(node)


def test_boto3_default_presigned_url_is_sigv2(
    s3_front: Callable[..., FrontNode], s3_server: S3Server, bucket: str
) -> None:
    """boto3's generate_presigned_url with its default config signs the query with
    SigV2 (``AWSAccessKeyId``, ``Signature``, ``Expires``) for an S3 endpoint: the URL
    users are handed by default must be served too, and checked (a changed Expires
    is refused).
    """
    node = s3_front()
    objects = awkward_objects()
    put_all(s3_server, bucket, objects)
    s3 = node.client()
    for key in (SPACE, UNICODE, PLUS, PERCENT):
        url = s3.generate_presigned_url(
            "get_object", Params={"Bucket": "data", "Key": key}, ExpiresIn=300
        )
        query = urlsplit(url).query
        assert "AWSAccessKeyId=" in query, url
        assert "Signature=" in query, url
        assert curl(url) == (200, objects[key]), url
    tampered = url.replace("Expires=", "Expires=1")
    assert curl(tampered)[0] == 403


# -- s3fs and pandas -----------------------------------------------------------------


def test_s3fs_and_pandas(
    s3_front: Callable[..., FrontNode], s3_server: S3Server, bucket: str
) -> None:
    import s3fs

    node = s3_front()
    medium = blob(MiB + 333, "medium")
    objects = {**awkward_objects(), **tree_objects(), **parquet_objects(), "medium.bin": medium}
    put_all(s3_server, bucket, objects)
    options = {"key": FRONT_KEY, "secret": FRONT_SECRET, "endpoint_url": node.endpoint}
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True, use_listings_cache=False)

    assert sorted(fs.ls("data/tree", detail=False)) == [
        "data/tree/a", "data/tree/b", "data/tree/top.txt",
    ]  # fmt: skip
    detail = {entry["name"]: entry for entry in fs.ls("data/tree", detail=True)}
    assert detail["data/tree/top.txt"]["size"] == len(objects["tree/top.txt"])
    assert detail["data/tree/a"]["type"] == "directory"
    info = fs.info("data/tree/top.txt")
    assert (info["type"], info["size"]) == ("file", len(objects["tree/top.txt"]))
    # a "directory": s3fs HEADs the key, which is no object (404), then lists
    assert fs.info("data/tree/a")["type"] == "directory"
    assert fs.isdir("data/tree")
    assert not fs.isfile("data/tree")

    with fs.open("data/medium.bin", "rb", block_size=256 * 1024) as f:
        assert f.read(100) == medium[:100]
        f.seek(700_000)
        assert f.read(5000) == medium[700_000:705_000]
        f.seek(-50, os.SEEK_END)
        assert f.read() == medium[-50:]
    for key in AWKWARD:
        assert fs.cat_file(f"data/{key}") == objects[key], key
        assert fs.cat_file(f"data/{key}", start=10, end=60) == objects[key][10:60]
        assert fs.info(f"data/{key}")["size"] == len(objects[key])
    assert fs.cat_file("data/medium.bin", start=-1000) == medium[-1000:]
    assert fs.cat_ranges(["data/medium.bin"] * 2, [0, MiB], [10, MiB + 10]) == [
        medium[:10],
        medium[MiB : MiB + 10],
    ]

    assert sorted(fs.glob("data/tree/*/*.txt")) == [
        "data/tree/a/1.txt", "data/tree/a/2.txt", "data/tree/b/3.txt",
    ]  # fmt: skip
    assert fs.find("data/tree") == [f"data/{k}" for k in sorted(tree_objects())]
    assert sorted(fs.find("data/", prefix="données")) == [f"data/{UNICODE}"]
    assert fs.exists(f"data/{PERCENT}")
    assert not fs.exists("data/percent/100% A.txt")  # what %25 and %41 decoded twice say

    frame = pd.read_parquet("s3://data/x.parquet", storage_options=options)
    pd.testing.assert_frame_equal(frame, TABLE.to_pandas())
    csv = pd.read_csv("s3://data/x.csv", storage_options=options)
    pd.testing.assert_frame_equal(csv, TABLE.to_pandas())

    with pytest.raises(FileNotFoundError):
        fs.cat_file("data/tree/missing.txt")
    with pytest.raises(FileNotFoundError):
        fs.info("data/tree/missing")
    wrong = s3fs.S3FileSystem(
        key=FRONT_KEY, secret="not-" + FRONT_SECRET, endpoint_url=node.endpoint,
        skip_instance_cache=True,
    )  # fmt: skip
    with pytest.raises(PermissionError):
        wrong.cat_file("data/tree/top.txt")
    assert_no_server_faults(node)


# -- pyarrow -------------------------------------------------------------------------


def test_pyarrow_s3filesystem(
    s3_front: Callable[..., FrontNode], s3_server: S3Server, bucket: str
) -> None:
    from pyarrow import fs as pafs

    node = s3_front()
    objects = {**awkward_objects(), **tree_objects(), **parquet_objects()}
    put_all(s3_server, bucket, objects)
    fs = pafs.S3FileSystem(
        endpoint_override=f"127.0.0.1:{node.port}",
        scheme="http",
        access_key=FRONT_KEY,
        secret_key=FRONT_SECRET,
        region="us-east-1",
    )

    info = fs.get_file_info("data/tree/top.txt")
    assert (info.type, info.size) == (pafs.FileType.File, len(objects["tree/top.txt"]))
    assert fs.get_file_info("data/tree").type == pafs.FileType.Directory
    assert fs.get_file_info("data/tree/a").type == pafs.FileType.Directory
    assert fs.get_file_info("data/tree/missing").type == pafs.FileType.NotFound
    listed = fs.get_file_info(pafs.FileSelector("data/tree", recursive=True))
    assert sorted((i.path, i.type) for i in listed) == sorted(
        [(f"data/{k}", pafs.FileType.File) for k in tree_objects()]
        + [("data/tree/a", pafs.FileType.Directory), ("data/tree/b", pafs.FileType.Directory)]
    )
    sizes = {i.path: i.size for i in listed if i.type == pafs.FileType.File}
    assert sizes == {f"data/{k}": len(v) for k, v in tree_objects().items()}

    for key in AWKWARD:
        with fs.open_input_file(f"data/{key}") as f:
            assert f.size() == len(objects[key]), key
            assert f.read_at(50, 100) == objects[key][100:150]
            assert f.read_at(10, len(objects[key]) - 10) == objects[key][-10:]
            assert f.readall() == objects[key]
        with fs.open_input_stream(f"data/{key}") as stream:
            assert stream.read() == objects[key]

    assert pq.read_table("data/x.parquet", filesystem=fs).equals(TABLE)
    dataset = ds.dataset("data/dir/", filesystem=fs, format="parquet")
    assert sorted(dataset.files) == [f"data/dir/part-{n}.parquet" for n in range(3)]
    assert dataset.to_table().sort_by("id").equals(pa.concat_tables(PARTS))

    with pytest.raises(FileNotFoundError):
        fs.open_input_file("data/tree/missing.txt")
    wrong = pafs.S3FileSystem(
        endpoint_override=f"127.0.0.1:{node.port}",
        scheme="http",
        access_key=FRONT_KEY,
        secret_key="not-" + FRONT_SECRET,
        region="us-east-1",
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1),
    )
    with pytest.raises(OSError, match="ACCESS_DENIED"):
        wrong.open_input_file("data/tree/top.txt")
    assert_no_server_faults(node)


# -- polars and obstore (object_store) -----------------------------------------------


def test_polars(s3_front: Callable[..., FrontNode], s3_server: S3Server, bucket: str) -> None:
    import polars as pl

    node = s3_front()
    objects = parquet_objects()
    objects["with space/x.parquet"] = objects["x.parquet"]
    put_all(s3_server, bucket, objects)
    options = {
        "aws_endpoint_url": node.endpoint,
        "aws_access_key_id": FRONT_KEY,
        "aws_secret_access_key": FRONT_SECRET,
        "aws_region": "us-east-1",
        "aws_allow_http": "true",
    }
    expected = pl.from_arrow(TABLE)
    frame = pl.read_parquet("s3://data/x.parquet", storage_options=options)
    assert frame.equals(expected)
    frame = pl.read_parquet("s3://data/with space/x.parquet", storage_options=options)
    assert frame.equals(expected)
    scanned = pl.scan_parquet("s3://data/dir/*.parquet", storage_options=options).collect()
    assert scanned.sort("id").equals(pl.from_arrow(pa.concat_tables(PARTS)))
    lazy = pl.scan_parquet("s3://data/x.parquet", storage_options=options)
    assert lazy.filter(pl.col("id") >= 10_450).select("id").collect()["id"].to_list() == list(
        range(10_450, 10_500)
    )

    with pytest.raises(FileNotFoundError):
        pl.read_parquet("s3://data/missing.parquet", storage_options=options)
    wrong = {**options, "aws_secret_access_key": "not-" + FRONT_SECRET}
    with pytest.raises(PermissionError, match="SignatureDoesNotMatch"):
        pl.read_parquet("s3://data/x.parquet", storage_options=wrong)
    assert_no_server_faults(node)


def test_obstore(s3_front: Callable[..., FrontNode], s3_server: S3Server, bucket: str) -> None:
    import obstore
    from obstore.exceptions import PermissionDeniedError
    from obstore.store import S3Store

    node = s3_front()
    objects = {**awkward_objects(), **tree_objects()}
    put_all(s3_server, bucket, objects)

    def store(secret: str = FRONT_SECRET) -> S3Store:
        return S3Store(
            "data",
            endpoint=node.endpoint,
            access_key_id=FRONT_KEY,
            secret_access_key=secret,
            region="us-east-1",
            client_options={"allow_http": True},
            retry_config={"max_retries": 0},
        )

    s3 = store()
    for key in AWKWARD:
        assert obstore.get(s3, key).bytes().to_bytes() == objects[key], key
        assert obstore.get_range(s3, key, start=10, end=60).to_bytes() == objects[key][10:60]
        assert (
            obstore.get_range(s3, key, start=900, length=100).to_bytes() == objects[key][900:1000]
        )
        ranges = obstore.get_ranges(s3, key, starts=[0, 500], ends=[5, 505])
        assert [r.to_bytes() for r in ranges] == [objects[key][:5], objects[key][500:505]]
        meta = obstore.head(s3, key)
        assert (meta["path"], meta["size"]) == (key, len(objects[key]))
    got = obstore.get(s3, PLUS, options={"range": {"suffix": 7}})
    assert got.bytes().to_bytes() == objects[PLUS][-7:]

    listed = [meta for batch in obstore.list(s3, prefix="tree") for meta in batch]
    assert sorted((m["path"], m["size"]) for m in listed) == sorted(
        (k, len(v)) for k, v in tree_objects().items()
    )
    everything = {meta["path"] for batch in obstore.list(s3) for meta in batch}
    assert everything == set(objects)
    level = obstore.list_with_delimiter(s3, prefix="tree")
    assert sorted(level["common_prefixes"]) == ["tree/a", "tree/b"]
    assert [m["path"] for m in level["objects"]] == ["tree/top.txt"]
    top = obstore.list_with_delimiter(s3)
    assert sorted(top["common_prefixes"]) == sorted({k.split("/")[0] for k in objects})

    with pytest.raises(FileNotFoundError):
        obstore.get(s3, "tree/missing.txt")
    with pytest.raises(FileNotFoundError):
        obstore.head(s3, "tree/missing.txt")
    with pytest.raises(PermissionDeniedError, match="SignatureDoesNotMatch"):
        obstore.get(store("not-" + FRONT_SECRET), SPACE)
    assert_no_server_faults(node)


# -- the AWS CLI ---------------------------------------------------------------------


def test_aws_cli(
    s3_front: Callable[..., FrontNode], s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    if shutil.which("aws") is None:
        pytest.skip("the AWS CLI (aws) is not on PATH: pip install awscli, or apt's awscli")
    node = s3_front()
    objects = {**awkward_objects(), **tree_objects()}
    put_all(s3_server, bucket, objects)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
        **front_env(node.endpoint),
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
        "PYTHONIOENCODING": "utf-8",
    }

    def aws(*args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        # --endpoint-url as well: CLIs before 1.29 and 2.13 (Debian 12's is 2.9) do not
        # read AWS_ENDPOINT_URL, and would go to AWS itself
        argv = ["aws", "--endpoint-url", node.endpoint, *args]
        done = subprocess.run(argv, env=env, capture_output=True, timeout=60)
        if check:
            assert done.returncode == 0, done.stderr.decode(errors="replace")
        return done

    listing = aws("s3", "ls", "s3://data/", "--recursive").stdout.decode()
    listed = {}
    for line in listing.splitlines():  # "2025-01-01 00:00:00       1000 KEY"
        _date, _time, size, key = line.split(maxsplit=3)
        listed[key] = int(size)
    # the keys as they are: spaces, "+" and "%" and all
    assert listed == {k: len(v) for k, v in objects.items()}
    for key in AWKWARD:
        assert aws("s3", "cp", f"s3://data/{key}", "-").stdout == objects[key], key
        head = json.loads(aws("s3api", "head-object", "--bucket", "data", "--key", key).stdout)
        assert head["ContentLength"] == len(objects[key])
    aws("s3", "cp", "s3://data/tree/", str(tmp_path / "tree"), "--recursive")
    for key, body in tree_objects().items():
        assert (tmp_path / key).read_bytes() == body, key

    missing = aws("s3", "cp", "s3://data/tree/missing.txt", "-", check=False)
    assert missing.returncode != 0
    assert b"404" in missing.stderr, missing.stderr
    missing = aws("s3api", "head-object", "--bucket", "data", "--key", "nope", check=False)
    assert b"404" in missing.stderr, missing.stderr
    env["AWS_SECRET_ACCESS_KEY"] = "not-" + FRONT_SECRET
    denied = aws("s3", "ls", "s3://data/", check=False)
    assert denied.returncode != 0
    assert b"SignatureDoesNotMatch" in denied.stderr, denied.stderr
    assert_no_server_faults(node)
