"""Unit tests of the runtime's row split (pure): micro-batch sizes and whole rows per device."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_deepcee.runtime.rows import split_rows, split_sizes, split_step_rows


def test_split_sizes_even_larger_first() -> None:
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="cannot be split into 5"):
        split_sizes(4, 5)


def test_odd_microbatches_alternate_instead_of_favouring_one_device() -> None:
    """3 rows shared 0.49 / 0.51: 1-2 then 2-1, not 1-2 every micro-batch (which is 16 / 32)."""
    split = split_step_rows([3] * 16, (0.49, 0.51))
    counts = [[end - start for start, end in ranges] for ranges in split]
    assert counts[:4] == [[1, 2], [2, 1], [1, 2], [2, 1]]
    assert [sum(c[d] for c in counts) for d in range(2)] == [24, 24]
    assert [[end - start for start, end in split_rows(3, (0.49, 0.51))]] * 2 == [[1, 2], [1, 2]]


@settings(max_examples=300, deadline=None)
@given(
    shares=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6).filter(lambda s: sum(s) > 0.05),
    batch=st.integers(1, 200),
    m=st.integers(1, 24),
)
def test_step_split_is_contiguous_and_follows_the_step_shares(
    shares: list[float], batch: int, m: int
) -> None:
    if batch < m:
        batch = m
    sizes = split_sizes(batch, m)
    split = split_step_rows(sizes, shares)
    assert len(split) == m
    for size, ranges in zip(sizes, split, strict=True):
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(a <= b for a, b in ranges)
        assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
    total = sum(shares)
    for d, share in enumerate(shares):
        rows = sum(end - start for start, end in (r[d] for r in split))
        assert abs(rows - batch * share / total) < 1.0 + 1e-9
    # One micro-batch is the plain largest-remainder split.
    assert split_step_rows([batch], shares) == [split_rows(batch, shares)]


def test_step_split_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="non-negative with a positive sum"):
        split_step_rows([3], (0.0, 0.0))
    with pytest.raises(ValueError, match="sizes must be >= 0"):
        split_step_rows([3, -1], (0.5, 0.5))
