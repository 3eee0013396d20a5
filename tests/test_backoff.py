from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chunkd.backoff import Backoff


@given(
    base=st.floats(0, 10),
    spread=st.floats(0, 100),
    attempt=st.integers(0, 10_000),
    jitter=st.sampled_from(["full", "equal", "none"]),
)
def test_a_delay_stays_within_its_ceiling_and_the_cap(base, spread, attempt, jitter) -> None:
    backoff = Backoff(base, base + spread, jitter=jitter)
    delay = backoff.delay(attempt)
    ceiling = backoff.ceiling(attempt)
    assert 0 <= delay <= ceiling <= backoff.cap
    if jitter == "equal":
        assert delay >= ceiling / 2
    if jitter == "none":
        assert delay == ceiling


def test_delays_grow_to_the_cap_and_stop_at_the_deadline() -> None:
    backoff = Backoff(0.01, 0.04, jitter="none")
    delays = backoff.delays()
    assert [next(delays) for _ in range(5)] == [0.01, 0.02, 0.04, 0.04, 0.04]
    assert backoff.total(3) == pytest.approx(0.07)
    ended = list(Backoff(0.001, 0.002, jitter="none").delays(deadline=time.monotonic() - 1))
    assert ended == []
    cut = next(Backoff(5, 5, jitter="none").delays(deadline=time.monotonic() + 0.5))
    assert 0 < cut <= 0.5


@pytest.mark.parametrize(("base", "cap", "factor"), [(-1, 1, 2), (2, 1, 2), (0.1, 1, 0.5)])
def test_a_nonsense_backoff_is_refused(base, cap, factor) -> None:
    with pytest.raises(ValueError, match="needs 0 <= base <= cap"):
        Backoff(base, cap, factor=factor)
