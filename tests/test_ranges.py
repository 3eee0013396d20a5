"""Range headers and byte ranges: property tests."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chunkd.ranges import (
    ByteRange,
    InvalidRangeError,
    OffsetRange,
    RangeNotSatisfiableError,
    SuffixRange,
    parse_range,
    resolve,
)


@given(st.integers(0, 10**12), st.integers(0, 10**12), st.integers(1, 10**12))
def test_closed_ranges_resolve_inside_the_object(first: int, length: int, size: int) -> None:
    last = first + length
    request = parse_range(f"bytes={first}-{last}")
    assert request == ByteRange(first, last + 1)
    if first >= size:
        with pytest.raises(RangeNotSatisfiableError):
            resolve(request, size)
    else:
        start, end = resolve(request, size)
        assert (start, end) == (first, min(last + 1, size))


@given(st.integers(0, 10**9), st.integers(1, 10**9))
def test_suffix_and_offset_ranges(n: int, size: int) -> None:
    if n:
        assert resolve(parse_range(f"bytes=-{n}"), size) == (max(0, size - n), size)
    if n < size:
        assert resolve(parse_range(f"bytes={n}-"), size) == (n, size)


@given(st.text(max_size=40))
def test_anything_else_is_refused_or_understood(header: str) -> None:
    try:
        request = parse_range(header)
    except InvalidRangeError as exc:
        message = str(exc)
    else:
        assert isinstance(request, ByteRange | OffsetRange | SuffixRange)
        return
    assert "Range" in message


@pytest.mark.parametrize(
    "header", ["bytes=5-1", "bytes=-", "items=0-1", "bytes=0-1,2-3", "bytes=" + "9" * 30 + "-"]
)
def test_bad_headers(header: str) -> None:
    with pytest.raises(InvalidRangeError):
        parse_range(header)


def test_no_header_is_the_whole_object() -> None:
    assert parse_range(None) is None
    assert resolve(None, 10) == (0, 10)
    assert resolve(None, 0) == (0, 0)
    with pytest.raises(RangeNotSatisfiableError):
        resolve(SuffixRange(0), 10)
