"""lab_bench's worker reads DeepCEEStrategy through its public names only.

The worker records the layout of every DeepCEE run (``deepcee_summary``) after training, on the
lab, where no test runs it; a property the strategy no longer has would fail every benchmark
run at its end. Here the summary is taken from a fresh strategy (before set-up) and from one
holding a plan and a profile.
"""

from __future__ import annotations

import json

from lightning_deepcee import DeepCEEStrategy
from lightning_deepcee.planner import plan_search
from lightning_deepcee.profiler import ClusterProfile
from tests.helpers.benchmarks import load_benchmark
from tests.helpers.paths import EXAMPLE_PROFILE


def test_the_summary_of_a_strategy_before_and_after_planning() -> None:
    summary = load_benchmark("lab_bench").deepcee_summary
    fresh = DeepCEEStrategy(schedule="1f1b", num_microbatches=2, partition=[1, 1])
    before = summary(fresh)
    assert before["num_microbatches"] == 2 and "plan" not in before
    json.dumps(before)  # what the worker writes

    profile = ClusterProfile.from_yaml(EXAMPLE_PROFILE)
    plan = plan_search(profile, num_blocks=profile.num_blocks, global_batch_size=32)
    planned = DeepCEEStrategy()
    planned.stage_part.plan = plan  # as set-up leaves it
    planned.cluster_profile = profile
    after = summary(planned)
    assert after["schedule"] == plan.schedule
    assert after["ranges"] == [list(st.block_range) for st in plan.stages]
    assert after["plan"] == plan.to_dict() and after["profile"] == profile.to_dict()
    json.dumps(after)
