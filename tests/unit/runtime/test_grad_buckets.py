"""Bucket caps of the stage copies' gradient sum, from the links between them."""

from __future__ import annotations

import pytest

from lightning_deepcee.runtime.grad_buckets import (
    MAX_BUCKET_BYTES,
    MIN_BUCKET_BYTES,
    BucketedGradSync,
    bucket_bytes_for,
)
from tests.helpers.clusters import make_profile


def test_buckets_are_large_where_the_links_are_slow_to_answer() -> None:
    # 4 devices, 30 ms and 100 Mbit/s: the latency is a tenth of the all-reduce at
    # 4 x 0.03 s x 12.5 MB/s x 10 = 15 MB.
    wan = make_profile(speeds=[1.0] * 4, num_blocks=2, bandwidth=12.5e6, latency=0.03)
    assert bucket_bytes_for(wan, [0, 1, 2, 3]) == 15_000_000
    lan = make_profile(speeds=[1.0] * 4, num_blocks=2, bandwidth=125e6, latency=0.0001)
    assert bucket_bytes_for(lan, [0, 1, 2, 3]) == MIN_BUCKET_BYTES
    far = make_profile(speeds=[1.0] * 4, num_blocks=2, bandwidth=125e6, latency=0.3)
    assert bucket_bytes_for(far, [0, 1, 2, 3]) == MAX_BUCKET_BYTES
    assert bucket_bytes_for(None, [0, 1]) == MAX_BUCKET_BYTES  # no profile: DDP's cap


def test_a_bucket_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        BucketedGradSync([], None, bucket_bytes=0)


def test_the_environment_sets_the_cap_and_a_bad_value_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lan = make_profile(speeds=[1.0] * 2, num_blocks=2, bandwidth=125e6, latency=0.0001)
    monkeypatch.setenv("DEEPCEE_GRAD_BUCKET_MB", "4")
    assert bucket_bytes_for(lan, [0, 1]) == 4 * 2**20
    monkeypatch.setenv("DEEPCEE_GRAD_BUCKET_MB", "inf")
    assert bucket_bytes_for(None, [0, 1]) > 2**40  # one bucket for any model
    for bad in ("0", "-1", "lots"):
        monkeypatch.setenv("DEEPCEE_GRAD_BUCKET_MB", bad)
        with pytest.raises(ValueError, match="DEEPCEE_GRAD_BUCKET_MB"):
            bucket_bytes_for(lan, [0, 1])
