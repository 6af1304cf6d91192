"""Unit tests of the Evaluator: same answers as the functional cost model, memos per instance."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lightning_deepcee.planner import (
    CostModelConfig,
    Evaluator,
    StagePlan,
    allreduce_time_s,
    in_flight_microbatches,
    plan_search,
    predict,
    predict_plan,
    speed_shares,
    stage_costs,
    transfer_time_s,
)
from lightning_deepcee.profiler.data import ClusterProfile
from tests.helpers.clusters import make_profile


def _profile(bandwidth: float, *, num_devices: int = 4, num_blocks: int = 4) -> ClusterProfile:
    """Two sites of two devices (``bandwidth`` between them), devices of speed 1, 2, 1, 2."""
    site = np.arange(num_devices) // 2
    return make_profile(
        speeds=[float(1 + r % 2) for r in range(num_devices)],
        num_blocks=num_blocks,
        bandwidth=np.where(site[:, None] == site[None, :], 1e9, bandwidth),
        latency=1e-3,
        block_s=0.01,
        activation_bytes=50_000,
        parameter_bytes=1_000_000,
        reference_microbatch_size=2,
        fixed_fraction=0.1,
    )


STAGES = (
    StagePlan(block_range=(0, 2), ranks=(0, 1), batch_shares=(1 / 3, 2 / 3)),
    StagePlan(block_range=(2, 4), ranks=(2, 3), batch_shares=(0.25, 0.75)),
)


def test_evaluator_matches_the_functional_api() -> None:
    profile = _profile(1e7)
    config = CostModelConfig(optimizer_s_per_byte=2e-10)
    evaluator = Evaluator(profile, config)
    for kind in ("1f1b", "zb-h1"):
        assert evaluator.predict(STAGES, kind, 4, 16) == predict(
            profile, STAGES, kind, 4, 16, config=config
        )
    assert evaluator.stage_costs(STAGES, microbatch_size=4) == stage_costs(
        profile, STAGES, microbatch_size=4
    )
    assert evaluator.transfer_time_s(STAGES[0], STAGES[1], 1e5) == transfer_time_s(
        profile, STAGES[0], STAGES[1], 1e5
    )
    assert evaluator.allreduce_time_s((0, 2, 3), 1e6) == allreduce_time_s(profile, (0, 2, 3), 1e6)
    for bounded in (True, False):
        assert evaluator.speed_shares(
            (0, 1, 3), (1, 3), microbatch_size=4, in_flight=2, bounded_by_memory=bounded
        ) == speed_shares(
            profile,
            (0, 1, 3),
            (1, 3),
            microbatch_size=4,
            in_flight=2,
            config=config,
            bounded_by_memory=bounded,
        )
    assert evaluator.in_flight_microbatches("zb-h1", 3, 5) == in_flight_microbatches("zb-h1", 3, 5)


def test_breakdown_only_adds_the_transfer_figure() -> None:
    evaluator = Evaluator(_profile(1e6))
    full = evaluator.predict(STAGES, "1f1b", 4, 16)
    quick = evaluator.predict(STAGES, "1f1b", 4, 16, breakdown=False)
    assert full.transfer_s > 0.0
    assert quick == dataclasses.replace(full, transfer_s=0.0)


def test_predict_plan_gives_the_search_figure() -> None:
    profile = _profile(1e7)
    plan = plan_search(profile, num_blocks=4, global_batch_size=16)
    evaluator = Evaluator(profile)
    assert evaluator.predict_plan(plan) == predict_plan(profile, plan)
    assert evaluator.predict_plan(plan).step_time_s == plan.predicted_step_time_s


def test_memos_belong_to_one_evaluator() -> None:
    """Two profiles with the same ranks but different links never share a memoised link."""
    slow, fast = Evaluator(_profile(1e6)), Evaluator(_profile(1e8))
    ranks = (0, 2)
    first = [e.allreduce_time_s(ranks, 1e6) for e in (slow, fast, slow, fast)]
    assert first[0] == first[2] and first[1] == first[3]
    assert first[0] > first[1]
    assert first[0] == Evaluator(_profile(1e6)).allreduce_time_s(ranks, 1e6)
    # The same holds for whole predictions, interleaved.
    a = slow.predict(STAGES, "zb-h1", 4, 16)
    b = fast.predict(STAGES, "zb-h1", 4, 16)
    assert a.step_time_s > b.step_time_s
    assert slow.predict(STAGES, "zb-h1", 4, 16) == a


def _stage(blocks: tuple[int, int], ranks: tuple[int, ...], shares: tuple[float, ...]) -> StagePlan:
    return StagePlan(block_range=blocks, ranks=ranks, batch_shares=shares)


def test_memoised_stages_and_transfers_give_the_figures_computed_afresh() -> None:
    """Stage costs and transfers are memoised per evaluator; a one-device pair takes a short
    path. Every figure equals the general computation on a fresh evaluator."""
    profile = _profile(1e7, num_devices=4, num_blocks=6)
    warm = Evaluator(profile)
    layouts = [
        (_stage((0, 2), (0,), (1.0,)), _stage((2, 6), (1, 3), (0.4, 0.6))),
        (_stage((0, 3), (0, 2), (0.5, 0.5)), _stage((3, 6), (1,), (1.0,))),
        (
            _stage((0, 2), (0,), (1.0,)),
            _stage((2, 4), (2,), (1.0,)),
            _stage((4, 6), (1, 3), (0.4, 0.6)),
        ),
    ]
    for _ in range(2):  # the second pass reads the memos
        for stages in layouts:
            cold = Evaluator(profile)
            assert warm.stage_costs(stages, microbatch_size=4) == cold.stage_costs(
                stages, microbatch_size=4
            )
            assert warm.predict(stages, "zb-h1", 4, 16) == cold.predict(stages, "zb-h1", 4, 16)
    one, other = _stage((0, 2), (0,), (1.0,)), _stage((2, 6), (2,), (1.0,))
    general = Evaluator(profile)._transfer((0,), (1.0,), (2,), (1.0,), 1e5)
    assert warm.transfer_time_s(one, other, 1e5) == general


def test_evaluator_rejects_what_predict_rejects() -> None:
    evaluator = Evaluator(_profile(1e7))
    with pytest.raises(ValueError, match="last stage ends at block 2"):
        evaluator.stage_costs(STAGES[:1], microbatch_size=1)
    with pytest.raises(ValueError, match="stage_schedule"):
        evaluator.predict(STAGES, "compact", 4, 16)
    with pytest.raises(ValueError, match="schedule: expected one of"):
        evaluator.predict(STAGES, "gpipe-ish", 4, 16)
    with pytest.raises(ValueError, match="cannot fill"):
        evaluator.predict(STAGES, "1f1b", 4, 3)
