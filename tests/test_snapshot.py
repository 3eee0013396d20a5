"""The snapshot manifest format: canonical bytes, ids, schema versions, references."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chunkd import snapshot
from chunkd.errors import InvalidRequestError, ManifestError
from chunkd.snapshot import Member, MemoryPages, Ref, Snapshot, parse_ref, upgrades

DATA = Path(__file__).parent / "data"
#: the id of tests/data/snapshot-schema1.json, a manifest written by the first
#: schema: it must read (and keep its id) under every later chunkd
SCHEMA1_ID = "bc05c82fd2d27b8b7f088906359744bd8db93a86e7b8ad2f02a23f502b3a4eb1"


def members(count: int) -> list[Member]:
    return [
        Member(f"p/{i:05d}.bin", 64 * (i + 1), f"v{i}", "fixed", i + 1, {"record_bytes": 64})
        for i in range(count)
    ]


def test_the_id_is_the_blake3_of_the_canonical_bytes_whatever_the_member_order() -> None:
    listed = members(50)
    pages = MemoryPages()
    one = Snapshot.build(backend="data", prefix="p/", format="fixed", members=listed, pages=pages)
    two = Snapshot.build(backend="data", prefix="p/", format="fixed", members=listed[::-1])
    assert one.id == two.id == snapshot.snapshot_id(one.data)
    assert one.data == snapshot.canonical(json.loads(one.data))
    assert [m.key for m in one.members] == sorted(m.key for m in listed)
    again = Snapshot.parse(one.data, expect_id=one.id, pages=pages)
    assert again == one
    assert len(again) == sum(range(1, 51))
    assert again.locate(0) == (0, 0)
    assert again.locate(1) == (1, 0)
    assert again.locate(len(again) - 1) == (49, 49)
    with pytest.raises(IndexError):
        again.locate(len(again))


@pytest.mark.parametrize("schema", [1, 2])
def test_a_torn_or_forged_manifest_is_refused_by_its_id(schema: int) -> None:
    good = Snapshot.build(
        backend="data", prefix="p/", format="fixed", members=members(3), schema=schema
    )
    with pytest.raises(ManifestError, match="torn or was altered"):
        Snapshot.parse(good.data[:-10], expect_id=good.id)
    forged = good.data.replace(b'"p/"', b'"q/"')  # the source's prefix, in either form
    assert forged != good.data
    with pytest.raises(ManifestError, match="torn or was altered"):
        Snapshot.parse(forged, expect_id=good.id)
    # Totals that do not add up are refused even when the id matches the bytes.
    doc = json.loads(good.data)
    doc["totals"]["samples"] += 1
    with pytest.raises(ManifestError, match="totals"):
        Snapshot.parse(snapshot.canonical(doc))
    with pytest.raises(ManifestError, match="not JSON"):
        Snapshot.parse(b"\xff\xfe")
    if schema == 1:  # a schema-2 root holds no member: its pages are checked when read
        doc = json.loads(good.data)
        doc["members"][0]["format"] = "CSV!"  # any format name parses; format_of refuses others
        with pytest.raises(ManifestError, match="'CSV!' is not a format name"):
            Snapshot.parse(snapshot.canonical(doc))


def test_a_manifest_of_the_first_schema_still_reads_with_its_id() -> None:
    data = (DATA / "snapshot-schema1.json").read_bytes()
    old = Snapshot.parse(data, expect_id=SCHEMA1_ID)
    assert [m.key for m in old.members] == ["web/a.jsonl", "web/b.jsonl"]
    assert len(old) == 5
    assert old.excluded == ({"key": "web/c.jsonl", "error": "not UTF-8"},)


def test_older_schemas_are_upgraded_and_newer_ones_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    good = Snapshot.build(backend="data", prefix="p/", format="fixed", members=members(2))
    doc = json.loads(good.data)
    doc["schema"] = snapshot.SCHEMA + 1
    with pytest.raises(ManifestError, match="upgrade chunkd"):
        Snapshot.parse(snapshot.canonical(doc))
    del doc["schema"]
    with pytest.raises(ManifestError, match="no schema"):
        Snapshot.parse(snapshot.canonical(doc))

    # A schema after this one: its upgrade from this one runs on read.
    def rename(old: dict[str, object]) -> dict[str, object]:
        new = dict(old)
        new["schema_of"] = {"upgraded": True}
        return new

    monkeypatch.setattr(upgrades, "SCHEMA", upgrades.SCHEMA + 1)
    monkeypatch.setitem(upgrades._UPGRADES, upgrades.SCHEMA - 1, rename)
    upgraded = Snapshot.parse(good.data, expect_id=good.id)
    assert upgraded.schema_of == {"upgraded": True}
    assert upgraded.id == good.id  # the id is of the stored bytes


@pytest.mark.parametrize(
    ("text", "ref"),
    [
        ("text/web", Ref("text/web", tag="latest")),
        ("text/web@latest", Ref("text/web", tag="latest")),
        ("text/web@3", Ref("text/web", version=3)),
        ("web@prod", Ref("web", tag="prod")),
        ("a" * 64, Ref(None, id="a" * 64)),
    ],
)
def test_references(text: str, ref: Ref) -> None:
    assert parse_ref(text) == ref


@pytest.mark.parametrize(
    "text",
    ["", "@3", "web@0", "web@", "../web", "web/../x", "/web", "web/", "we b", "web@-1", "a@b@c"],
)
def test_bad_references_are_refused(text: str) -> None:
    with pytest.raises(InvalidRequestError):
        parse_ref(text)
