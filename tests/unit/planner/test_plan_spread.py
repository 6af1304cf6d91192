"""A spread plan search is the serial one: calls handed out (pickled, run in any order) give the
same plan and alternatives, and calls are assigned by device speed."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from lightning_deepcee.planner.candidates import SearchContext
from lightning_deepcee.planner.evaluator import Evaluator
from lightning_deepcee.planner.plan import Plan
from lightning_deepcee.planner.search import plan_search
from lightning_deepcee.profiler.data import ClusterProfile
from lightning_deepcee.runtime.spread_search import assign_calls, spread
from tests.helpers.clusters import random_profile
from tests.helpers.paths import EXAMPLE_PROFILE as EXAMPLE


class PicklingMap:
    """A MapFn as another process sees it: the function and each item pickled, run last item
    first; records how many calls each map handed out."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(
        self,
        fn: Callable[[Any], Any],
        items: Sequence[Any],
        costs: Sequence[float] | None = None,
    ) -> list[Any]:
        assert costs is None or len(costs) == len(items)
        self.sizes.append(len(items))
        remote = pickle.loads(pickle.dumps(fn))
        done = {
            i: remote(pickle.loads(pickle.dumps(items[i]))) for i in reversed(range(len(items)))
        }
        return [pickle.loads(pickle.dumps(done[i])) for i in range(len(items))]


def _profiles() -> list[tuple[ClusterProfile, int]]:
    example = ClusterProfile.from_yaml(EXAMPLE)
    return [(example, 48), *((random_profile(seed, 6, 10), 32) for seed in range(4))]


@pytest.mark.parametrize("case", range(5))
def test_a_spread_search_finds_the_serial_plan(case: int) -> None:
    profile, batch = _profiles()[case]
    serial_alternatives: list[Plan] = []
    spread_alternatives: list[Plan] = []
    serial = plan_search(
        profile,
        num_blocks=profile.num_blocks,
        global_batch_size=batch,
        alternatives=serial_alternatives,
    )
    mapper = PicklingMap()
    spread_plan = plan_search(
        profile,
        num_blocks=profile.num_blocks,
        global_batch_size=batch,
        alternatives=spread_alternatives,
        map_fn=mapper,
        map_width=4,  # the device sets' quick searches too, four at a time
    )
    assert max(mapper.sizes) > 1  # the search handed calls out
    assert spread_plan.to_dict() == serial.to_dict()
    assert [p.to_dict() for p in spread_alternatives] == [p.to_dict() for p in serial_alternatives]


def test_a_context_pickles_without_its_memos() -> None:
    profile = ClusterProfile.from_yaml(EXAMPLE)
    context = SearchContext(
        Evaluator(profile),
        global_batch_size=48,
        schedules=("1f1b",),
        microbatch_counts=(4,),
        memory_check=True,
    )
    empty = len(pickle.dumps(context))
    structure = tuple((r,) for r in range(profile.num_devices))
    ranges = context.partition(structure)
    assert ranges is not None
    scored = context.evaluate(structure, ranges, "1f1b", 4)
    assert scored is not None and context._evaluated and context.evaluator._stages
    assert len(pickle.dumps(context)) == empty
    copy = pickle.loads(pickle.dumps(context))
    again = copy.evaluate(structure, ranges, "1f1b", 4)
    assert again is not None and again.step_time_s == scored.step_time_s


def test_calls_go_to_the_faster_devices() -> None:
    assert assign_calls([1.0] * 4, [1.0, 1.0]) == [0, 1, 0, 1]
    owners = assign_calls([1.0] * 9, [2.0, 1.0, 0.25])
    assert [owners.count(r) for r in range(3)] == [6, 3, 0]
    assert assign_calls([], [1.0]) == []


def test_the_costliest_calls_go_first_to_the_fastest_devices() -> None:
    costs, weights = [1.0, 1.0, 8.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [2.0, 1.0, 0.5]

    def makespan(owners: list[int]) -> float:
        loads = [0.0] * len(weights)
        for cost, rank in zip(costs, owners, strict=True):
            loads[rank] += cost
        return max(load / w for load, w in zip(loads, weights, strict=True))

    owners = assign_calls(costs, weights)
    assert owners[2] == 0  # the costly call on the fastest rank
    # Sharing out by cost beats sharing out by count (which sends the costly call to rank 1).
    by_count = assign_calls([1.0] * len(costs), weights)
    assert by_count[2] == 1
    assert makespan(owners) == 5.0 < makespan(by_count)


def test_without_a_process_group_the_work_runs_here() -> None:
    calls = spread(lambda map_fn: map_fn(lambda x: x * 2, [1, 2, 3]), [1.0])
    assert calls == [2, 4, 6]
