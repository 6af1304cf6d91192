"""The planner compresses a hop when the link makes it pay, and only then; a plan keeps the
choice, and predicting a plan uses its own hops, never new ones."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from lightning_deepcee.planner import CostModelConfig, Evaluator, Plan, StagePlan, plan_search
from lightning_deepcee.planner.compression import METHODS
from tests.helpers.clusters import make_profile

EVERY = CostModelConfig(compression=("bf16", "tah8", "tah4"))


def _two_stage(
    bandwidth: float, activation_bytes: int = 4_000_000, latency: float = 0.0
) -> tuple[Evaluator, list[StagePlan]]:
    profile = make_profile(
        speeds=[1.0, 1.0], num_blocks=2, bandwidth=bandwidth, block_s=0.05, latency=latency,
        activation_bytes=activation_bytes, parameter_bytes=1000,
    )  # fmt: skip
    stages = [
        StagePlan(block_range=(0, 1), ranks=(0,), batch_shares=(1.0,)),
        StagePlan(block_range=(1, 2), ranks=(1,), batch_shares=(1.0,)),
    ]
    return Evaluator(profile, EVERY), stages


def test_a_slow_hop_is_compressed_a_fast_one_is_not() -> None:
    slow, stages = _two_stage(bandwidth=3e6)  # 4 MB in 1.3 s each way: 4 bits pay most
    assert slow.choose_hops(stages, 1.0) == ("tah4",)
    auto = Evaluator(slow.profile, CostModelConfig(compression="auto"))
    assert auto.choose_hops(stages, 1.0) == ("tah8",)  # "auto" never takes 4 bits
    fast, stages = _two_stage(bandwidth=1e12)  # the link is free: nothing to gain, all to lose
    assert fast.choose_hops(stages, 1.0) == ()
    # 1 GB/s: bf16 halves 8 ms of transfers, a saving under 5% of a stage's 150 ms of compute
    # per micro-batch: not worth any error.
    lan, stages = _two_stage(bandwidth=1e9)
    assert lan.choose_hops(stages, 1.0) == ()
    off = Evaluator(slow.profile)
    assert off.choose_hops(stages, 1.0) == ()  # not allowed: never chosen


def test_the_most_accurate_method_within_the_margin_wins() -> None:
    # Tiny activations on a 10 ms link: every method moves them in about the latency.
    evaluator, stages = _two_stage(bandwidth=1e9, activation_bytes=64, latency=0.01)
    assert evaluator.choose_hops(stages, 1.0) == ()
    slow, stages = _two_stage(bandwidth=3e6)
    only8 = Evaluator(slow.profile, CostModelConfig(compression=("tah8",)))
    assert only8.choose_hops(stages, 1.0) == ("tah8",)


def test_compression_shortens_the_predicted_step_by_the_bytes_it_saves() -> None:
    evaluator, stages = _two_stage(bandwidth=3e6)
    off = evaluator.predict(stages, "1f1b", 4, 4, hops=())
    on = evaluator.predict(stages, "1f1b", 4, 4)
    assert on.hop_compression == ("tah4",) and off.hop_compression == ()
    assert on.step_time_s < 0.5 * off.step_time_s
    # The transfers carry the method's share of the bytes.
    costs = evaluator.stage_costs(stages, microbatch_size=1.0, hops=("tah4",))
    plain = evaluator.stage_costs(stages, microbatch_size=1.0, hops=())
    assert costs.send_forward_s[0] == pytest.approx(plain.send_forward_s[0] * METHODS["tah4"].ratio)
    assert costs.forward_s[0] > plain.forward_s[0]  # the codec's time, on both stages
    assert costs.forward_s[1] > plain.forward_s[1]


def test_search_keeps_the_choice_and_predicting_a_plan_uses_its_own_hops(tmp_path: Path) -> None:
    # Two zones of two equal devices, 2 MB/s between them: 16 samples' activations and
    # gradients take 3.2 s over the WAN, against 0.96 s of compute on all four devices.
    zone = np.array([0, 0, 1, 1])
    profile = make_profile(
        speeds=[1.0] * 4, num_blocks=8, latency=0.001, block_s=0.01, activation_bytes=200_000,
        bandwidth=np.where(zone[:, None] == zone[None, :], 1e10, 2e6), parameter_bytes=20_000,
    )  # fmt: skip
    plain = plan_search(profile, num_blocks=8, global_batch_size=16)
    packed = plan_search(profile, num_blocks=8, global_batch_size=16, config=EVERY)
    assert plain.hop_compression == ()
    assert packed.hop_compression and any(h != "off" for h in packed.hop_compression)
    assert packed.predicted_step_time_s < plain.predicted_step_time_s
    assert "compressed=" in packed.format_table()
    assert "ms in fp32" in packed.notes and "ms in fp32" not in plain.notes  # why, in the notes
    path = tmp_path / "plan.json"
    packed.to_json(path)
    assert Plan.from_json(path) == packed
    # An uncompressed plan predicted under a config that allows compression stays uncompressed.
    p = Evaluator(profile, EVERY).predict_plan(plain)
    assert p.hop_compression == ()
    assert p.step_time_s == pytest.approx(Evaluator(profile).predict_plan(plain).step_time_s)
    # And the compressed plan predicts as the search said.
    again = Evaluator(profile).predict_plan(packed)
    assert again.step_time_s == pytest.approx(packed.predicted_step_time_s)
    with pytest.raises(ValueError, match="hop_compression"):
        dataclasses.replace(packed, hop_compression=("zip",) * (packed.num_stages - 1))
