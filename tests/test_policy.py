"""Eviction policies: scan resistance, pins, and invariants under random operations."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chunkd.cache import EvictionPolicy, LruPolicy, S3FifoPolicy


def _simulate(policy: EvictionPolicy[int], capacity: int, trace: list[int]) -> float:
    """Replay ``trace`` (unit-size keys) through a cache of ``capacity``.

    Returns the hit ratio of the hot keys (those below 1000).
    """
    policy.set_capacity(capacity)
    held: set[int] = set()
    hits = hot = 0
    for key in trace:
        hot += key < 1000
        if key in held:
            hits += 1
            policy.access(key)
            continue
        while len(held) >= capacity:
            victim = policy.evict(lambda _k: False)
            assert victim is not None
            held.remove(victim)
        held.add(key)
        policy.insert(key, 1)
    return hits / hot


def _hot_set_with_scans(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    hot = list(range(50))
    trace: list[int] = []
    scan_key = 10_000
    for _ in range(40):
        trace += [rng.choice(hot) for _ in range(200)]
        trace += list(range(scan_key, scan_key + 300))  # a one-pass scan, larger than the cache
        scan_key += 300
    return trace


def test_s3fifo_keeps_the_hot_set_through_scans_where_lru_does_not() -> None:
    trace = _hot_set_with_scans()
    s3 = _simulate(S3FifoPolicy(), 100, trace)
    lru = _simulate(LruPolicy(), 100, trace)
    # Each scan is three times the cache. LRU loses the whole hot set to every scan
    # and re-reads it; S3-FIFO keeps it in the main queue and misses almost only the
    # first touch of each hot key.
    assert s3 > 0.97
    assert lru < 0.8


@pytest.mark.parametrize("policy_type", [S3FifoPolicy, LruPolicy])
def test_pinned_keys_are_never_chosen(policy_type: type[EvictionPolicy[int]]) -> None:
    policy = policy_type()
    policy.set_capacity(10)
    for key in range(10):
        policy.insert(key, 1)
        policy.access(key)
    pinned = {0, 3, 7}
    evicted = []
    while (victim := policy.evict(lambda k: k in pinned)) is not None:
        evicted.append(victim)
    assert sorted(evicted) == sorted(set(range(10)) - pinned)
    assert len(policy) == len(pinned)
    assert policy.evict(lambda k: k in pinned) is None


def test_s3fifo_readmits_ghosts_to_the_main_queue() -> None:
    policy: S3FifoPolicy[int] = S3FifoPolicy()
    policy.set_capacity(10)
    policy.insert(1, 1)
    assert policy.evict(lambda _k: False) == 1  # unread: leaves a ghost
    policy.insert(1, 1)
    policy.insert(2, 1)
    # 2 sits in the small queue, 1 in main: the small queue is evicted first.
    assert policy.evict(lambda _k: False) == 2


def test_small_ratio_is_validated() -> None:
    with pytest.raises(ValueError, match="small_ratio"):
        S3FifoPolicy(small_ratio=1.5)


ops = st.lists(
    st.tuples(st.sampled_from(["insert", "access", "remove", "evict"]), st.integers(0, 30)),
    max_size=300,
)


@pytest.mark.parametrize("policy_type", [S3FifoPolicy, LruPolicy])
@given(ops=ops)
def test_policy_tracks_exactly_the_live_keys(
    policy_type: type[EvictionPolicy[int]], ops: list[tuple[str, int]]
) -> None:
    policy = policy_type()
    policy.set_capacity(20)
    live: set[int] = set()
    for op, key in ops:
        if op == "insert" and key not in live:
            policy.insert(key, 1 + key % 3)
            live.add(key)
        elif op == "access":
            policy.access(key)
        elif op == "remove":
            policy.remove(key)
            live.discard(key)
        elif op == "evict":
            pinned = {k for k in live if k % 4 == key % 4}
            victim = policy.evict(lambda k, p=pinned: k in p)  # type: ignore[misc]
            if victim is None:
                assert live <= pinned
            else:
                assert victim in live
                assert victim not in pinned
                live.remove(victim)
        assert len(policy) == len(live)


def test_s3fifo_finds_a_victim_behind_pinned_hot_keys() -> None:
    policy: S3FifoPolicy[str] = S3FifoPolicy()
    policy.set_capacity(100)
    for n in range(9):
        policy.insert(f"k{n}", 10)
        policy.access(f"k{n}")
    assert policy.evict(lambda _k: False) is not None  # moves the read keys to main
    hot = [f"k{n}" for n in range(9) if f"k{n}" in policy._main]
    for key in hot:
        for _ in range(3):
            policy.access(key)
    pinned = set(hot[:2])
    victim = policy.evict(lambda k: k in pinned)
    assert victim is not None
    assert victim not in pinned
