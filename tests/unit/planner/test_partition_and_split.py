"""Partitions, the model contract checks and micro-batch splitting (single process)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from lightning_deepcee.planner import balanced_partition, check_partition, partition_from_sizes
from lightning_deepcee.runtime import (
    PipelineSpec,
    build_stage,
    get_pipeline_spec,
    split_batch,
    split_sizes,
)


def _brute_force(weights: list[float], k: int) -> float:
    n = len(weights)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@given(
    weights=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=9),
    k=st.integers(1, 9),
)
def test_balanced_partition_is_optimal(weights: list[float], k: int) -> None:
    if k > len(weights):
        with pytest.raises(ValueError, match="every stage needs at least one block"):
            balanced_partition(weights, k)
        return
    ranges = balanced_partition(weights, k)
    check_partition(ranges, len(weights))
    heaviest = max(sum(weights[a:b]) for a, b in ranges)
    assert heaviest == pytest.approx(_brute_force(weights, k))


def test_partition_checks() -> None:
    assert partition_from_sizes([3, 2, 3]) == [(0, 3), (3, 5), (5, 8)]
    with pytest.raises(ValueError, match="covers 7 blocks but the model has 8"):
        check_partition([(0, 3), (3, 7)], 8)
    with pytest.raises(ValueError, match="contiguous"):
        check_partition([(0, 3), (4, 8)], 8)


@given(total=st.integers(1, 200), m=st.integers(1, 50))
def test_split_sizes(total: int, m: int) -> None:
    if total < m:
        with pytest.raises(ValueError, match="cannot be split"):
            split_sizes(total, m)
        return
    sizes = split_sizes(total, m)
    assert sum(sizes) == total and len(sizes) == m
    assert max(sizes) - min(sizes) <= 1


def test_split_batch_nested() -> None:
    batch = {"x": torch.arange(10).view(5, 2), "meta": "tag", "pair": (torch.arange(5), [1])}
    parts = split_batch(batch, [3, 2])
    assert parts[0]["x"].shape == (3, 2) and parts[1]["x"].shape == (2, 2)
    assert parts[1]["pair"][0].tolist() == [3, 4]
    assert parts[0]["meta"] == "tag"


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)


class _WithSpec(_Plain):
    def __init__(self, extra: bool = False, twice: bool = False) -> None:
        super().__init__()
        self.extra = nn.Linear(2, 2) if extra else None
        self.twice = twice

    def configure_pipeline(self) -> PipelineSpec:
        blocks = [self.a, self.a] if self.twice else [self.a, self.b]
        return PipelineSpec(blocks=blocks, loss_fn=lambda out, b: out.mean())


def test_unsplittable_module_says_what_to_add() -> None:
    with pytest.raises(TypeError, match=r"no `configure_pipeline` method[\s\S]*def configure_"):
        get_pipeline_spec(_Plain())


def test_contract_errors() -> None:
    with pytest.raises(ValueError, match="belong to no pipeline block"):
        get_pipeline_spec(_WithSpec(extra=True))
    with pytest.raises(ValueError, match="appears twice"):
        get_pipeline_spec(_WithSpec(twice=True))


def test_build_stage_keeps_global_names() -> None:
    model = _WithSpec()
    spec = get_pipeline_spec(model)
    stage = build_stage(model, spec, [(0, 1), (1, 2)], 1)
    assert set(model.state_dict()) == {"b.weight", "b.bias"}
    assert isinstance(model.a, nn.Identity)
    assert stage.is_last and not stage.is_first
    x = torch.ones(1, 2)
    torch.testing.assert_close(stage.forward(x), model.b(x))
