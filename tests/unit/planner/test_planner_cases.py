"""The planner on a 20-GPU, 3-zone cluster (Sailor's OPT-350M profiles) at three WAN speeds.

A plan over several zones must never be predicted slower than the best plan on one zone alone:
the compute bound that orders the device subsets ignores the links, so across a slow WAN it
ranks mixed sets above every zone. A large global batch on few devices needs more
micro-batches than the default counts; the search adds them where memory requires. Every plan
reports its compute bounds and where its predicted step goes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lightning_deepcee.planner import Plan
from lightning_deepcee.planner.candidates import MAX_MEMORY_COUNT, memory_counts
from lightning_deepcee.planner.search import make_plan, plan_search
from lightning_deepcee.planner.subsets import restrict
from lightning_deepcee.profiler.data import ClusterProfile
from tests.helpers.paths import ROOT

CASES = ROOT / "configs" / "profiles" / "sailor_opt350m"
GLOBAL_BATCH = 1024


def _load(name: str) -> ClusterProfile:
    return ClusterProfile.from_yaml(CASES / f"{name}_mbs2.yaml")


@pytest.mark.parametrize("name", ["w01", "w1", "w10"])
def test_the_plan_is_no_slower_than_any_zone_alone(name: str) -> None:
    profile = _load(name)
    plan = plan_search(profile, num_blocks=profile.num_blocks, global_batch_size=GLOBAL_BATCH)
    zones = [range(0, 4), range(4, 12), range(12, 20)]  # GH-96, A100-40, V100-16
    alone = [
        plan_search(
            restrict(profile, zone), num_blocks=profile.num_blocks, global_batch_size=GLOBAL_BATCH
        ).predicted_step_time_s
        for zone in zones
    ]
    assert plan.predicted_step_time_s <= min(alone) * (1 + 1e-9), (name, alone, plan.notes)


def test_across_a_slow_wan_the_fast_zone_trains_alone() -> None:
    profile = _load("w01")
    plan = plan_search(profile, num_blocks=profile.num_blocks, global_batch_size=GLOBAL_BATCH)
    assert plan.ranks == (0, 1, 2, 3)  # the GH-96 zone: any set across the WAN is slower
    assert plan.idle_ranks == tuple(range(4, 20))


def test_memory_counts_are_growing_divisors_of_the_batch() -> None:
    assert memory_counts(16, 1024) == (32, 64, 128, 256, 512, 1024)
    assert memory_counts(16, 1000) == (40, 100, 200, 500, 1000)
    assert memory_counts(16, 16) == ()
    assert memory_counts(4, 7) == ()
    assert memory_counts(16, 2**20)[-1] == MAX_MEMORY_COUNT


def test_more_microbatches_where_memory_requires_them() -> None:
    # Two 16 GB V100s hold 512 samples each per step: at 16 micro-batches (32 samples a device)
    # their activations do not fit, in any layout; with more micro-batches they do.
    profile = restrict(_load("w01"), (12, 13))
    for stages, ranges in [([(0, 1)], [(0, 26)]), ([(0,), (1,)], [(0, 13), (13, 26)])]:
        for schedule in ("1f1b", "zb-h1"):
            assert (
                make_plan(
                    profile,
                    stages,
                    ranges,
                    schedule=schedule,
                    num_microbatches=16,
                    global_batch_size=GLOBAL_BATCH,
                )
                is None
            )
    plan = plan_search(profile, num_blocks=profile.num_blocks, global_batch_size=GLOBAL_BATCH)
    assert plan.num_microbatches in memory_counts(16, GLOBAL_BATCH)
    for rank, peak in plan.predicted_peak_memory_bytes.items():
        assert peak <= profile.devices[rank].memory_bytes


@pytest.mark.parametrize("name", ["w01", "w10"])
def test_the_plan_reports_its_bounds_and_where_its_step_goes(name: str, tmp_path: Path) -> None:
    profile = _load(name)
    plan = plan_search(profile, num_blocks=profile.num_blocks, global_batch_size=GLOBAL_BATCH)
    assert plan.compute_bound_s is not None and plan.cluster_bound_s is not None
    assert plan.cluster_bound_s <= plan.compute_bound_s <= plan.predicted_step_time_s
    parts = plan.step_parts_s
    assert parts["bound"] == plan.compute_bound_s
    assert math.isclose(sum(parts.values()), plan.predicted_step_time_s, rel_tol=1e-9)
    assert all(seconds >= -1e-9 for seconds in parts.values()), parts
    table = plan.format_table()
    assert "compute bound:" in table and "where the step goes:" in table
    path = tmp_path / "plan.json"
    plan.to_json(path)
    assert Plan.from_json(path) == plan
    # A plan saved before the bounds existed still loads, without them.
    data = json.loads(path.read_text())
    for key in ("compute_bound_s", "cluster_bound_s", "step_parts_s"):
        del data[key]
    old = Plan.from_dict(data)
    assert old.compute_bound_s is None and old.format_bound() == ""
