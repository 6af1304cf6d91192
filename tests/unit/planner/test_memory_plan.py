"""The cost model charges measured activation memory: saved bytes per micro-batch in flight,
transient bytes for the one computing; transfers stay on the output bytes; old profiles load."""

from __future__ import annotations

import dataclasses

import numpy as np

from lightning_deepcee.planner.cost_model import predict, speed_shares, stage_costs
from lightning_deepcee.planner.plan import StagePlan
from lightning_deepcee.planner.search import plan_search
from lightning_deepcee.planner.subsets import restrict
from lightning_deepcee.profiler.data import ClusterProfile
from tests.helpers.clusters import make_profile


def _with_memory(
    profile: ClusterProfile,
    saved: tuple[int, ...] | None,
    transient: tuple[int, ...] | None,
    memory_bytes: tuple[int, ...] | None = None,
) -> ClusterProfile:
    devices = tuple(
        dataclasses.replace(
            d,
            saved_bytes=saved or (),
            transient_bytes=transient or (),
            memory_bytes=d.memory_bytes if memory_bytes is None else memory_bytes[d.rank],
        )
        for d in profile.devices
    )
    return dataclasses.replace(profile, devices=devices)


def _pipeline(ranges: list[tuple[int, int]]) -> list[StagePlan]:
    return [StagePlan(block_range=r, ranks=(s,), batch_shares=(1.0,)) for s, r in enumerate(ranges)]


def test_old_profile_without_memory_fields_loads_and_falls_back() -> None:
    profile = make_profile(speeds=[1.0, 2.0], num_blocks=4, parameter_bytes=100)
    data = profile.to_dict()
    for device in data["devices"]:
        del device["saved_bytes"], device["transient_bytes"]
    loaded = ClusterProfile.from_dict(data)
    assert loaded == profile
    assert loaded.devices[0].saved_bytes == () and loaded.devices[0].held_bytes == (1000,) * 4
    # Without them a stage holds its blocks' outputs, with no transient: as if measured so.
    same = _with_memory(profile, saved=(1000,) * 4, transient=(0,) * 4)
    stages = _pipeline([(0, 2), (2, 4)])
    assert predict(loaded, stages, "1f1b", 4, 8) == predict(same, stages, "1f1b", 4, 8)


def test_peak_memory_is_state_plus_in_flight_saved_plus_transient() -> None:
    base = make_profile(
        speeds=[1.0, 1.0], num_blocks=4, parameter_bytes=100, activation_bytes=10, latency=0.01,
        bandwidth=1e3,
    )  # fmt: skip
    saved, transient = (400, 300, 200, 100), (50, 70, 20, 10)
    profile = _with_memory(base, saved, transient)
    stages = _pipeline([(0, 2), (2, 4)])
    b = 2  # 8 samples in 4 micro-batches
    prediction = predict(profile, stages, "1f1b", 4, 8)
    # 1F1B on 2 stages: stage 0 holds 2 micro-batches at its peak, stage 1 holds 1.
    assert prediction.peak_memory_bytes == {
        0: 4 * 200 + 2 * (400 + 300) * b + 70 * b,
        1: 4 * 200 + 1 * (200 + 100) * b + 20 * b,
    }
    # Transfers carry the boundary block's output (10 B/sample), not what it saves.
    costs = stage_costs(profile, stages, microbatch_size=b)
    assert costs.send_forward_s == (0.01 + 10 * b / 1e3,)
    assert costs == dataclasses.replace(
        stage_costs(base, stages, microbatch_size=b),
        activation_bytes=costs.activation_bytes,
        transient_bytes=costs.transient_bytes,
    )


def test_memory_counts_the_whole_rows_a_device_holds() -> None:
    """Shares 1/4 and 3/4 of 2-row micro-batches: the runtime gives the devices 0 or 1 and 1 or
    2 rows, so their memory must hold 1 and 2 rows (compute is charged by the mean)."""
    base = make_profile(speeds=[1.0, 3.0], num_blocks=2, parameter_bytes=100)
    profile = _with_memory(base, saved=(400, 300), transient=(50, 70))
    shared = [StagePlan(block_range=(0, 2), ranks=(0, 1), batch_shares=(0.25, 0.75))]
    prediction = predict(profile, shared, "1f1b", 4, 8)  # one micro-batch in flight
    per_row = 400 + 300 + 70
    assert prediction.peak_memory_bytes == {0: 4 * 200 + 1 * per_row, 1: 4 * 200 + 2 * per_row}
    # Memory for one row each: the faster device cannot take its speed's share (2 rows at
    # times), so shares are capped at half each; 1-row micro-batches give it all it wants.
    tight = _with_memory(base, (400, 300), (50, 70), memory_bytes=(4 * 200 + per_row,) * 2)
    assert speed_shares(tight, (0, 1), (0, 2), microbatch_size=2, in_flight=1) == (0.5, 0.5)
    assert speed_shares(tight, (0, 1), (0, 2), microbatch_size=1, in_flight=1) == (0.25, 0.75)


def _edge_cluster(memory_bytes: tuple[int, int]) -> ClusterProfile:
    """A fast device with little memory (rank 0) and a slow one with plenty (rank 1) behind a
    slow link: without memory limits the fast device alone is the best plan."""
    bandwidth = np.array([[np.inf, 1e6], [1e6, np.inf]])
    base = make_profile(
        speeds=[4.0, 0.5], num_blocks=4, bandwidth=bandwidth, block_s=0.01,
        parameter_bytes=100_000, activation_bytes=1000,
    )  # fmt: skip
    saved, transient = (1_000_000,) * 4, (500_000,) * 4
    return _with_memory(base, saved, transient, memory_bytes)


def test_measured_memory_forbids_the_fastest_layout() -> None:
    roomy = plan_search(_edge_cluster((10**12, 10**12)), num_blocks=4, global_batch_size=16)
    assert roomy.idle_ranks == (1,), roomy.format_table()  # the fast device alone
    # 3 MB on the fast device: its parameter state (1.6 MB) and one sample of one block
    # (1 MB saved + 0.5 MB transient) fit, the whole model's activations for one sample do not.
    tight_profile = _edge_cluster((3_000_000, 10**12))
    alone = restrict(tight_profile, [0])
    for m in (1, 2, 4, 8, 16):
        fast_alone = predict(alone, _pipeline([(0, 4)]), "1f1b", m, 16)
        assert fast_alone.over_memory_ranks == (0,), (m, fast_alone.peak_memory_bytes)
    tight = plan_search(tight_profile, num_blocks=4, global_batch_size=16)
    # Data parallelism cannot fit either (the fast device would still hold every block for the
    # one row it gets): a pipeline gives the fast device what it can hold, the slow one the rest.
    assert tight.idle_ranks == () and tight.num_stages == 2, tight.format_table()
    assert tight.stages[0].ranks == (0,) and tight.stages[0].block_range == (0, 1)
    memory = {d.rank: d.memory_bytes for d in tight_profile.devices}
    for rank, peak in tight.predicted_peak_memory_bytes.items():
        assert peak <= memory[rank], (rank, peak, tight.format_table())
    # The same cluster measured without saved bytes (outputs only) keeps the fast device alone.
    unmeasured = _with_memory(tight_profile, saved=None, transient=None)
    assert plan_search(unmeasured, num_blocks=4, global_batch_size=16).idle_ranks == (1,)
