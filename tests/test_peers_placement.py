"""Placement without a cluster: whom a reader asks for a key, in which order."""

from __future__ import annotations

import blake3
import pytest

from chunkd.gateway.peers.placement import Source, rank_owners, sources

pytestmark = pytest.mark.timeout(10)

MEMBERS = [f"10.0.0.{i}:8470" for i in range(1, 6)]


def test_a_reader_asks_the_owners_ranked_before_it_and_stops_at_itself() -> None:
    owners = rank_owners(MEMBERS, b"some chunk")
    me = owners[2]
    assert sources(owners, me, handing_off=False) == [
        Source(owners[0], handoff=False),
        Source(owners[1], handoff=False),
    ]
    assert sources(owners, owners[0], handing_off=False) == []  # it owns it: the backend


def test_a_rejoined_owner_hands_off_to_the_member_ranked_next_after_it() -> None:
    owners = rank_owners(MEMBERS, b"another chunk")
    assert sources(owners, owners[0], handing_off=True) == [Source(owners[1], handoff=True)]
    assert sources(owners, owners[1], handing_off=True) == [
        Source(owners[0], handoff=False),
        Source(owners[2], handoff=True),
    ]
    assert sources(owners, owners[-1], handing_off=True) == [
        Source(o, handoff=False) for o in owners[:-1]
    ]  # nobody ranked after it to hand off to


def test_rendezvous_order_is_the_blake3_of_member_and_key() -> None:
    # The order every node computes alike (docs/peers.md, Placement).
    key = b"k"
    expected = sorted(
        MEMBERS, key=lambda m: blake3.blake3(m.encode() + b"\0" + key).digest(), reverse=True
    )
    assert rank_owners(MEMBERS, key) == expected
    assert rank_owners(list(reversed(MEMBERS)), key) == expected
