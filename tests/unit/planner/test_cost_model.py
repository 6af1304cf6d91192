"""Unit tests of the cost model: simulator agreement, monotonicity, all-reduce, shares, memory."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from lightning_deepcee.planner.cost_model import (
    CostModelConfig,
    allreduce_time_s,
    in_flight_microbatches,
    predict,
    speed_shares,
    stage_costs,
    transfer_time_s,
)
from lightning_deepcee.planner.plan import StagePlan
from lightning_deepcee.profiler.data import ClusterProfile
from lightning_deepcee.runtime.rows import split_sizes, split_step_rows
from tests.helpers.clusters import make_profile


def _pipeline(p: int, blocks_per_stage: int) -> list[StagePlan]:
    return [
        StagePlan(
            block_range=(s * blocks_per_stage, (s + 1) * blocks_per_stage),
            ranks=(s,),
            batch_shares=(1.0,),
        )
        for s in range(p)
    ]


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_equal_stages_reproduce_analytic_numbers(p: int, m: int) -> None:
    profile = make_profile(speeds=[1.0] * p, num_blocks=p)
    stages = _pipeline(p, 1)
    one_f_one_b = predict(profile, stages, "1f1b", m, m)
    assert one_f_one_b.step_time_s == pytest.approx(3 * (m + p - 1))
    assert one_f_one_b.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))
    assert one_f_one_b.transfer_s == 0.0
    assert one_f_one_b.allreduce_s == 0.0
    assert one_f_one_b.compute_s == pytest.approx(3 * m)
    zero_bubble = predict(profile, stages, "zb-h1", m, m)
    if m >= p:
        assert zero_bubble.step_time_s == pytest.approx(3 * m + p - 1)


def _with_quota(profile: ClusterProfile, shares: list[float], period_s: float) -> ClusterProfile:
    devices = tuple(
        dataclasses.replace(d, cpu_share=share, cpu_period_s=period_s)
        for d, share in zip(profile.devices, shares, strict=True)
    )
    return dataclasses.replace(profile, devices=devices)


def test_cpu_quota_forgives_the_bubbles_a_period_can_absorb() -> None:
    """ZB-H1 with p = m = 4 on quota-limited devices: waits let later actions run at full speed.

    With a long period the busiest stage's compute (the bucket starts empty, so no stage can
    beat it) is nearly reached; without the quota the prediction carries the whole bubble.
    """
    plain = make_profile(speeds=[1.0] * 4, num_blocks=4, block_s=0.01)
    stages = _pipeline(4, 1)
    busy = 4 * 3 * 0.01
    no_host = CostModelConfig(host_cpu_s_per_step=0.0, host_cpu_s_per_byte=0.0)
    without = predict(plain, stages, "zb-h1", 4, 4)
    assert without.step_time_s > 1.15 * busy
    quota = _with_quota(plain, [0.48] * 4, 10.0)
    long_period = predict(quota, stages, "zb-h1", 4, 4, config=no_host)
    assert busy * (1 - 1e-9) <= long_period.step_time_s < 1.05 * busy
    assert long_period.cpu_floor_s == pytest.approx(busy)  # the busiest device's own compute
    short_period = predict(
        _with_quota(plain, [0.48] * 4, 0.001), stages, "zb-h1", 4, 4, config=no_host
    )
    assert long_period.step_time_s < short_period.step_time_s < without.step_time_s
    # No quota on any device: the costs carry none and nothing changes.
    assert stage_costs(plain, stages, microbatch_size=1).cpu_share is None


def test_host_cpu_under_a_quota_sets_a_floor_on_the_step() -> None:
    """A quota-limited device also spends CPU outside its blocks (Lightning's loop, every byte it
    sends or receives); at its quota that CPU takes ``cpu / share`` of wall time, after its
    compute and optimizer step."""
    plain = make_profile(
        speeds=[1.0, 1.0], num_blocks=2, block_s=0.01, activation_bytes=1000, parameter_bytes=100
    )
    stages = _pipeline(2, 1)
    config = CostModelConfig(host_cpu_s_per_step=0.02, host_cpu_s_per_byte=1e-6)
    m = 4
    unlimited = predict(plain, stages, "1f1b", m, m, config=config)
    assert unlimited.cpu_floor_s == 0.0  # no quota: the host CPU is not charged

    quota = _with_quota(plain, [1.0, 0.1], 0.1)
    limited = predict(quota, stages, "1f1b", m, m, config=config)
    busy = m * 3 * 0.01
    optimizer = 1e-10 * 100  # the config's constant: the profile measured no optimizer rate
    moved = 2 * 1000 * m  # one boundary, each sample's activation forward and gradient back
    host = 0.02 + 1e-6 * moved
    assert limited.cpu_floor_s == pytest.approx(busy + optimizer + host / 0.1)
    assert limited.step_time_s == pytest.approx(limited.cpu_floor_s)
    assert limited.step_time_s > limited.pipeline_s + limited.optimizer_s

    # Host CPU of zero: the floor is the device's own compute and optimizer, under the pipeline.
    free = CostModelConfig(host_cpu_s_per_step=0.0, host_cpu_s_per_byte=0.0)
    loose = predict(quota, stages, "1f1b", m, m, config=free)
    assert loose.cpu_floor_s == pytest.approx(busy + optimizer)
    assert loose.step_time_s == pytest.approx(loose.pipeline_s + loose.optimizer_s)

    # A shared stage all-reduces its gradients: those bytes count too (ring: 4 (n-1)/n P).
    shared = [StagePlan(block_range=(0, 2), ranks=(0, 1), batch_shares=(0.5, 0.5))]
    dp = predict(quota, shared, "1f1b", 1, 2, config=config)
    ring = 4 * (2 - 1) / 2 * 200
    assert dp.cpu_floor_s == pytest.approx(
        1 * 3 * 2 * 0.01 + 1e-10 * 200 + (0.02 + 1e-6 * ring) / 0.1
    )
    for name in ("host_cpu_s_per_step", "host_cpu_s_per_byte"):
        with pytest.raises(ValueError, match=name):
            CostModelConfig(**{name: -1.0})


def test_a_shared_stage_takes_its_slowest_devices_quota() -> None:
    profile = _with_quota(make_profile(speeds=[2.0, 1.0, 1.0], num_blocks=2), [0.3, 0.6, 1.0], 0.1)
    stages = [
        StagePlan(block_range=(0, 1), ranks=(0, 1), batch_shares=(0.2, 0.8)),  # rank 1 slower
        StagePlan(block_range=(1, 2), ranks=(2,), batch_shares=(1.0,)),
    ]
    costs = stage_costs(profile, stages, microbatch_size=10)
    assert costs.cpu_share == (0.6, 1.0)
    assert costs.cpu_period_s == (0.1, 0.1)


def test_runtime_overhead_is_one_fixed_call_per_executor_action() -> None:
    """A middle stage runs 3 F-side, 3 B-side and 1 W action per micro-batch; ends run fewer.
    The first stage's B only dispatches (with its receive): its W is the whole backward."""
    profile = make_profile(speeds=[1.0, 0.25, 1.0], num_blocks=3, fixed_fraction=0.25)
    # Device d's fixed cost is 0.25 s per block call / speed: 0.25 s, 1 s (the slow device), 0.25 s.
    costs = stage_costs(profile, _pipeline(3, 1), microbatch_size=1)
    per_row = [0.75, 3.0, 0.75]
    fixed = [0.25, 1.0, 0.25]
    f_actions, w_actions = [2, 3, 2], [1, 1, 1]
    for s in range(3):
        assert costs.forward_s[s] == pytest.approx(fixed[s] * (1 + f_actions[s]) + per_row[s])
        split = fixed[s] * (3 + f_actions[s]) + 2 * per_row[s]  # B and W, as for a middle stage
        assert costs.merged_backward_s[s] == pytest.approx(split - fixed[s])  # one action fewer
        if s == 0:
            assert costs.backward_input_s[s] == pytest.approx(f_actions[s] * fixed[s])
            assert costs.backward_weight_s[s] == pytest.approx(split - f_actions[s] * fixed[s])
            continue
        assert costs.backward_input_s[s] == pytest.approx(costs.forward_s[s])
        assert costs.backward_weight_s[s] == pytest.approx(
            fixed[s] * (1 + w_actions[s]) + per_row[s]
        )
    # Without a measured fixed cost there is no overhead (hand-written profiles stay linear).
    linear = make_profile(speeds=[1.0, 0.25, 1.0], num_blocks=3)
    assert stage_costs(linear, _pipeline(3, 1), microbatch_size=1).forward_s == pytest.approx(
        (1.0, 4.0, 1.0)
    )


def test_one_backward_pass_is_charged_where_the_executor_runs_one() -> None:
    """A measured ``backward_s`` (the whole backward in one call) prices a BW action (1F1B,
    GPipe) and the first stage's W; B and W of the other stages keep their split costs."""
    base = make_profile(speeds=[1.0, 1.0, 1.0], num_blocks=3)
    half = dataclasses.replace(
        base,
        devices=tuple(
            dataclasses.replace(d, backward_s=tuple(0.5 * t for t in d.merged_backward_s))
            for d in base.devices
        ),
    )
    stages = _pipeline(3, 1)
    plain, cheap = (stage_costs(profile, stages, microbatch_size=1) for profile in (base, half))
    assert plain.merged_backward_s == pytest.approx((2.0, 2.0, 2.0))
    assert cheap.merged_backward_s == pytest.approx((1.0, 1.0, 1.0))
    assert (plain.backward_input_s[0], plain.backward_weight_s[0]) == (0.0, 2.0)
    assert (cheap.backward_input_s[0], cheap.backward_weight_s[0]) == (0.0, 1.0)
    assert cheap.backward_input_s[1:] == plain.backward_input_s[1:] == (1.0, 1.0)
    assert cheap.backward_weight_s[1:] == plain.backward_weight_s[1:] == (1.0, 1.0)
    m = 4
    for kind in ("1f1b", "gpipe"):
        before, after = (predict(profile, stages, kind, m, m) for profile in (base, half))
        assert before.step_time_s == pytest.approx((m + 2) * 3.0)
        assert after.step_time_s == pytest.approx((m + 2) * 2.0)
        assert after.compute_s == pytest.approx(m * 2.0)
    zb = [predict(profile, stages, "zb-h1", m, m) for profile in (base, half)]
    assert zb[1].step_time_s == zb[0].step_time_s  # the last stage sets the pace here
    assert zb[1].compute_s == zb[0].compute_s == pytest.approx(m * 3.0)


def test_one_backward_pass_saves_a_fixed_cost_per_call() -> None:
    """What one pass saves over B then W is a per-call cost (the graph walked once, one
    dispatch): the same at every micro-batch size, taken from the fixed part."""
    base = make_profile(
        speeds=[1.0, 1.0], num_blocks=2, reference_microbatch_size=4, fixed_fraction=0.5
    )
    merged = dataclasses.replace(
        base,
        devices=tuple(
            dataclasses.replace(d, backward_s=tuple(t - 0.4 for t in d.merged_backward_s))
            for d in base.devices
        ),
    )
    overhead = 0.5  # the mean per-call fixed cost: one action fewer than B then W
    for b in (1.0, 2.0, 4.0, 8.0):
        costs = stage_costs(merged, _pipeline(2, 1), microbatch_size=b)
        split = costs.backward_input_s[1] + costs.backward_weight_s[1]
        assert costs.merged_backward_s[1] == pytest.approx(split - 0.4 - overhead)


def test_microbatch_size_scales_compute_linearly() -> None:
    profile = make_profile(speeds=[1.0, 1.0], num_blocks=2, reference_microbatch_size=4)
    costs = stage_costs(profile, _pipeline(2, 1), microbatch_size=8)
    assert costs.forward_s == (2.0, 2.0)
    assert costs.activation_bytes == (8000.0, 8000.0)


def test_fixed_cost_is_paid_once_per_microbatch() -> None:
    # Half of each block's time at the reference size (4 samples) is fixed: t(n) = 0.5 + n / 8.
    profile = make_profile(
        speeds=[1.0, 1.0], num_blocks=2, reference_microbatch_size=4, fixed_fraction=0.5
    )
    # Every executor action also costs the mean per-call fixed cost (0.5 s): F with its send
    # (stage 0) or receive (stage 1) is two actions, W one.
    at_reference = stage_costs(profile, _pipeline(2, 1), microbatch_size=4)
    assert at_reference.forward_s == pytest.approx((1.0 + 2 * 0.5, 1.0 + 2 * 0.5))
    doubled = stage_costs(profile, _pipeline(2, 1), microbatch_size=8)
    assert doubled.forward_s == pytest.approx((1.5 + 2 * 0.5, 1.5 + 2 * 0.5))
    one = stage_costs(profile, _pipeline(2, 1), microbatch_size=1)
    assert one.backward_weight_s[1] == pytest.approx(0.625 + 0.5)
    # The first stage's whole backward is its W (B only dispatches): the same total.
    assert one.backward_input_s[0] + one.backward_weight_s[0] == pytest.approx(
        one.backward_input_s[1] + one.backward_weight_s[1]
    )
    # The same 16 samples in 16 micro-batches pay the fixed part 16 times: with it, a single
    # micro-batch on one device beats the 2-stage pipeline; without it, the pipeline wins.
    single = [StagePlan(block_range=(0, 2), ranks=(0,), batch_shares=(1.0,))]
    linear = make_profile(speeds=[1.0, 1.0], num_blocks=2, reference_microbatch_size=4)
    assert predict(linear, _pipeline(2, 1), "zb-h1", 16, 16).step_time_s < (
        predict(linear, single, "zb-h1", 1, 16).step_time_s
    )
    assert predict(profile, _pipeline(2, 1), "zb-h1", 16, 16).step_time_s > (
        predict(profile, single, "zb-h1", 1, 16).step_time_s
    )


def test_shares_proportional_to_speed_balance_a_stage() -> None:
    profile = make_profile(speeds=[1.0, 3.0], num_blocks=2)
    shares = speed_shares(profile, (0, 1), (0, 2), microbatch_size=4, in_flight=1)
    assert shares == pytest.approx((0.25, 0.75))
    assert shares is not None
    balanced = [StagePlan(block_range=(0, 2), ranks=(0, 1), batch_shares=shares)]
    even = [StagePlan(block_range=(0, 2), ranks=(0, 1), batch_shares=(0.5, 0.5))]
    # Per micro-batch of 4 samples: each device does its share; the stage waits for the slowest.
    assert stage_costs(profile, balanced, microbatch_size=4).forward_s[0] == pytest.approx(2.0)
    assert stage_costs(profile, even, microbatch_size=4).forward_s[0] == pytest.approx(4.0)
    assert (
        predict(profile, balanced, "1f1b", 2, 8).step_time_s
        < predict(profile, even, "1f1b", 2, 8).step_time_s
    )


@pytest.mark.parametrize(
    ("shares", "global_batch", "m"),
    [
        ((0.49, 0.51), 48, 16),
        ((0.2, 0.8), 30, 10),
        ((0.45, 0.45, 0.1), 32, 16),
        ((0.3, 0.3, 0.4), 50, 7),
    ],
)
def test_stage_cost_is_the_step_mean_of_the_runtime_rows(
    shares: tuple[float, ...], global_batch: int, m: int
) -> None:
    """The stage cost is the busiest device's mean time per micro-batch over the rows it runs.

    The runtime rounds every micro-batch to whole rows towards the step's shares
    (``split_step_rows``); the model's per-micro-batch stage time must match the busiest
    device's mean over the step, to within one row spread over the micro-batches.
    """
    speeds = [1.0, 0.5, 0.25][: len(shares)]
    profile = make_profile(speeds=speeds, num_blocks=1, fixed_fraction=0.25)
    stage = [StagePlan(block_range=(0, 1), ranks=tuple(range(len(shares))), batch_shares=shares)]
    predicted = stage_costs(profile, stage, microbatch_size=global_batch / m).forward_s[0]
    # Forward: a quarter of the block's time is fixed, plus the F action's own overhead (one
    # more fixed call; a single stage has no send or receive); the rest is per row.
    fixed = [2 * 0.25 / s for s in speeds]
    per_row = [0.75 / s for s in speeds]
    split = split_step_rows(split_sizes(global_batch, m), shares)
    busy = []
    for d in range(len(shares)):
        rows = [end - start for start, end in (ranges[d] for ranges in split)]
        busy.append(sum(fixed[d] + k * per_row[d] for k in rows if k > 0) / m)
    one_row = max(f + r for f, r in zip(fixed, per_row, strict=True)) / m
    assert predicted == pytest.approx(max(busy), abs=one_row)


def test_device_below_one_row_pays_its_fixed_cost_only_when_it_has_a_row() -> None:
    """Three devices share 2-row micro-batches; the slow one holds a row in about 1 of 10."""
    profile = make_profile(speeds=[1.0, 1.0, 0.1], num_blocks=1, fixed_fraction=0.5)
    shares = (0.45 / 0.95, 0.45 / 0.95, 0.05 / 0.95)
    stage = [StagePlan(block_range=(0, 1), ranks=(0, 1, 2), batch_shares=shares)]
    # Device 2 (forward: 5 s fixed, 5 s for the F action's overhead, 5 s per row) averages
    # 2 x 0.053 rows: 0.105 x (5 + 5 + 5) s; fixed costs in every micro-batch would be 10.5 s.
    assert stage_costs(profile, stage, microbatch_size=2).forward_s[0] == pytest.approx(
        2 * shares[2] * 15.0
    )


def test_shares_bounded_by_memory() -> None:
    profile = make_profile(speeds=[1.0, 3.0], num_blocks=2, activation_bytes=100, memory_bytes=800)
    # Each device holds in_flight * mb * share * 200 B/sample; memory 800 B caps a share at 1/2.
    shares = speed_shares(profile, (0, 1), (0, 2), microbatch_size=4, in_flight=2)
    assert shares == pytest.approx((0.5, 0.5))
    assert speed_shares(profile, (0, 1), (0, 2), microbatch_size=8, in_flight=2) is None
    free = speed_shares(
        profile, (0, 1), (0, 2), microbatch_size=8, in_flight=2, bounded_by_memory=False
    )
    assert free == pytest.approx((0.25, 0.75))


def test_single_pair_transfer_matches_profile() -> None:
    profile = make_profile(speeds=[1.0, 1.0], num_blocks=2, bandwidth=1e3, latency=0.5)
    a, b = _pipeline(2, 1)
    assert transfer_time_s(profile, a, b, 4000) == pytest.approx(
        profile.transfer_time_s(0, 1, 4000)
    )
    costs = stage_costs(profile, [a, b], microbatch_size=2)
    assert costs.send_forward_s == pytest.approx((0.5 + 2000 / 1e3,))
    assert costs.send_backward_s == pytest.approx((0.5 + 2000 / 1e3,))


def test_transfer_splits_rows_between_group_members() -> None:
    profile = make_profile(speeds=[1.0] * 4, num_blocks=2, bandwidth=1e3)
    sender = StagePlan(block_range=(0, 1), ranks=(0, 1), batch_shares=(0.5, 0.5))
    receiver = StagePlan(block_range=(1, 2), ranks=(2, 3), batch_shares=(0.5, 0.5))
    # Rows 0..1/2 go 0 -> 2, rows 1/2..1 go 1 -> 3, each half of the bytes.
    assert transfer_time_s(profile, sender, receiver, 4000) == pytest.approx(2.0)
    skewed = StagePlan(block_range=(1, 2), ranks=(2, 3), batch_shares=(0.25, 0.75))
    # Device 3 receives a quarter from 0 and half from 1, one after the other.
    assert transfer_time_s(profile, sender, skewed, 4000) == pytest.approx(3.0)


def test_pairs_between_two_network_groups_share_the_wan_link() -> None:
    # Two regions of two devices: 1e6 B/s LANs, one 1e3 B/s WAN link between them.
    bw = np.full((4, 4), 1e6)
    bw[np.ix_([0, 1], [2, 3])] = bw[np.ix_([2, 3], [0, 1])] = 1e3
    profile = make_profile(speeds=[1.0] * 4, num_blocks=2, bandwidth=bw, latency=0.25)
    sender = StagePlan(block_range=(0, 1), ranks=(0, 1), batch_shares=(0.5, 0.5))
    receiver = StagePlan(block_range=(1, 2), ranks=(2, 3), batch_shares=(0.5, 0.5))
    # Each pair alone would take 0.25 + 2000 / 1e3; together they push 4000 bytes through the WAN.
    assert transfer_time_s(profile, sender, receiver, 4000) == pytest.approx(0.25 + 4.0)
    assert transfer_time_s(profile, receiver, sender, 4000) == pytest.approx(0.25 + 4.0)
    # One device per stage: unchanged (exactly the profile's link time).
    one = StagePlan(block_range=(0, 1), ranks=(0,), batch_shares=(1.0,))
    two = StagePlan(block_range=(1, 2), ranks=(3,), batch_shares=(1.0,))
    alone = profile.transfer_time_s(0, 3, 4000)
    assert transfer_time_s(profile, one, two, 4000) == pytest.approx(alone)
    # Inside one region the switch carries the pairs side by side: no sharing.
    lan_a = StagePlan(block_range=(0, 1), ranks=(0, 2), batch_shares=(0.5, 0.5))
    lan_b = StagePlan(block_range=(1, 2), ranks=(1, 3), batch_shares=(0.5, 0.5))
    assert transfer_time_s(profile, lan_a, lan_b, 4000) == pytest.approx(0.25 + 2000 / 1e6)
    # The median pair between the groups sets the shared capacity: one fast reading (a
    # shaper's burst) does not raise it; most pairs reading 2e3 B/s do.
    bw[0, 2] = 5e3
    burst = make_profile(speeds=[1.0] * 4, num_blocks=2, bandwidth=bw, latency=0.25)
    assert transfer_time_s(burst, sender, receiver, 4000) == pytest.approx(0.25 + 4.0)
    bw[0, 2] = bw[0, 3] = bw[1, 2] = 2e3
    faster = make_profile(speeds=[1.0] * 4, num_blocks=2, bandwidth=bw, latency=0.25)
    assert transfer_time_s(faster, sender, receiver, 4000) == pytest.approx(0.25 + 2.0)


def test_doubling_bandwidth_never_increases_predicted_time() -> None:
    rng = np.random.default_rng(0)
    for _ in range(5):
        n = 6
        bandwidth = rng.uniform(1e3, 1e5, (n, n))
        speeds = list(rng.uniform(0.5, 4.0, n))
        slow = make_profile(speeds=speeds, num_blocks=6, bandwidth=bandwidth, latency=0.01)
        fast = make_profile(speeds=speeds, num_blocks=6, bandwidth=2 * bandwidth, latency=0.01)
        stages = [
            StagePlan(block_range=(0, 2), ranks=(0, 1), batch_shares=(0.4, 0.6)),
            StagePlan(block_range=(2, 3), ranks=(2,), batch_shares=(1.0,)),
            StagePlan(block_range=(3, 6), ranks=(3, 4, 5), batch_shares=(0.2, 0.3, 0.5)),
        ]
        for schedule in ("gpipe", "1f1b", "zb-h1"):
            for m in (1, 3, 8):
                before = predict(slow, stages, schedule, m, 8 * m).step_time_s
                after = predict(fast, stages, schedule, m, 8 * m).step_time_s
                assert after <= before + 1e-12


def test_allreduce_grows_with_group_size() -> None:
    profile = make_profile(speeds=[1.0] * 8, num_blocks=1, bandwidth=1e6, latency=0.001)
    times = [allreduce_time_s(profile, range(n), 1e6) for n in range(1, 9)]
    assert times[0] == 0.0
    assert all(a < b for a, b in itertools.pairwise(times))
    assert times[1] == pytest.approx(2 * 0.5 * 1.0 + 2 * 0.001)
    with_params = make_profile(speeds=[1.0] * 4, num_blocks=1, bandwidth=1e6, parameter_bytes=10**6)
    two = [StagePlan(block_range=(0, 1), ranks=(0, 1), batch_shares=(0.5, 0.5))]
    four = [StagePlan(block_range=(0, 1), ranks=(0, 1, 2, 3), batch_shares=(0.25,) * 4)]
    assert (
        predict(with_params, two, "1f1b", 1, 4).allreduce_s
        < predict(with_params, four, "1f1b", 1, 4).allreduce_s
    )


def test_memory_and_optimizer_terms() -> None:
    profile = make_profile(
        speeds=[1.0, 1.0],
        num_blocks=2,
        parameter_bytes=1000,
        activation_bytes=10,
        memory_bytes=5000,
    )
    config = CostModelConfig(optimizer_s_per_byte=1e-3)
    prediction = predict(profile, _pipeline(2, 1), "1f1b", 4, 8, config=config)
    # Stage 0 holds min(p, m) = 2 micro-batches of 2 samples x 10 B; stage 1 holds one.
    assert prediction.peak_memory_bytes == {0: 4 * 1000 + 40, 1: 4 * 1000 + 20}
    assert prediction.optimizer_s == pytest.approx(1.0)
    assert prediction.fits_memory
    tight = make_profile(
        speeds=[1.0, 1.0],
        num_blocks=2,
        parameter_bytes=1000,
        activation_bytes=10,
        memory_bytes=4030,
    )
    assert predict(tight, _pipeline(2, 1), "1f1b", 4, 8).over_memory_ranks == (0,)
    assert in_flight_microbatches("1f1b", 2, 4) == (2, 1)
    assert in_flight_microbatches("gpipe", 2, 4) == (4, 4)


def test_measured_optimizer_rate_replaces_the_constant() -> None:
    profile = make_profile(speeds=[1.0, 1.0, 1.0], num_blocks=2, parameter_bytes=1000)
    rates = [2e-4, 0.0, 5e-4]  # rank 1 not measured: the configured constant
    profile = dataclasses.replace(
        profile,
        devices=tuple(
            dataclasses.replace(d, optimizer_s_per_byte=rate)
            for d, rate in zip(profile.devices, rates, strict=True)
        ),
    )
    config = CostModelConfig(optimizer_s_per_byte=1e-4)
    stages = [
        StagePlan(block_range=(0, 1), ranks=(0, 1), batch_shares=(0.5, 0.5)),
        StagePlan(block_range=(1, 2), ranks=(2,), batch_shares=(1.0,)),
    ]
    # Stage 0: max(2e-4, 1e-4) x 1000 B = 0.2 s; stage 1: 5e-4 x 1000 B = 0.5 s; the slowest.
    assert predict(profile, stages, "1f1b", 2, 2, config=config).optimizer_s == pytest.approx(0.5)
    first_only = [StagePlan(block_range=(0, 2), ranks=(0, 1), batch_shares=(0.5, 0.5))]
    assert predict(profile, first_only, "1f1b", 2, 2, config=config).optimizer_s == pytest.approx(
        2e-4 * 2000
    )
    unmeasured = [StagePlan(block_range=(0, 2), ranks=(1,), batch_shares=(1.0,))]
    assert predict(profile, unmeasured, "1f1b", 2, 2, config=config).optimizer_s == pytest.approx(
        1e-4 * 2000
    )


def test_predict_rejects_bad_input() -> None:
    profile = make_profile(speeds=[1.0, 1.0], num_blocks=2)
    with pytest.raises(ValueError, match="schedule"):
        predict(profile, _pipeline(2, 1), "nope", 1, 1)
    with pytest.raises(ValueError, match="cannot fill 4 micro-batches"):
        predict(profile, _pipeline(2, 1), "1f1b", 4, 2)
    with pytest.raises(ValueError, match="profile has 2 blocks"):
        predict(profile, _pipeline(1, 1), "1f1b", 1, 1)
    with pytest.raises(ValueError, match="rank 5"):
        predict(
            profile,
            [StagePlan(block_range=(0, 2), ranks=(5,), batch_shares=(1.0,))],
            "1f1b",
            1,
            1,
        )
    with pytest.raises(ValueError, match="optimizer_s_per_byte"):
        CostModelConfig(optimizer_s_per_byte=-1.0)
