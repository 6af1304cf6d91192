"""The compiled fast loop gives the event simulator's figures exactly.

``simulate(..., events=False)`` runs :mod:`lightning_deepcee.schedule.compiled`; the recording
simulator (``events=True``) is the reference. Random costs, unequal micro-batches, CPU quotas and
every generated schedule: step time, busy seconds, bubble and memory peaks must be equal floats.
"""

from __future__ import annotations

import random

import pytest

from lightning_deepcee.schedule.compiled import compile_schedule
from lightning_deepcee.schedule.generators import SCHEDULE_KINDS, generate
from lightning_deepcee.schedule.lowering import lower
from lightning_deepcee.schedule.simulate import StageCosts, simulate
from lightning_deepcee.schedule.validate import ScheduleError


def _costs(rng: random.Random, p: int, m: int, *, quota: bool, unequal: bool) -> StageCosts:
    def values(n: int) -> tuple[float, ...]:
        return tuple(rng.uniform(0.001, 0.05) for _ in range(n))

    return StageCosts(
        forward_s=values(p),
        backward_input_s=values(p),
        backward_weight_s=values(p),
        activation_bytes=tuple(rng.uniform(1e3, 1e6) for _ in range(p)),
        send_forward_s=values(p - 1),
        send_backward_s=values(p - 1),
        static_memory_bytes=tuple(rng.uniform(1e6, 1e8) for _ in range(p)),
        transient_bytes=tuple(rng.uniform(0, 1e5) for _ in range(p)),
        microbatch_scale=tuple(rng.uniform(0.5, 1.5) for _ in range(m)) if unequal else None,
        cpu_share=tuple(rng.choice([1.0, 0.25, 0.6]) for _ in range(p)) if quota else None,
        cpu_period_s=tuple(rng.choice([0.01, 0.1]) for _ in range(p)) if quota else None,
    )


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
@pytest.mark.parametrize("seed", range(6))
def test_the_fast_loop_equals_the_event_simulator(kind: str, seed: int) -> None:
    rng = random.Random(seed)
    p, m = rng.randint(1, 6), rng.randint(1, 9)
    placement = {s: s for s in range(p)}
    ranked = lower(generate(kind, p, m), placement)
    costs = _costs(rng, p, m, quota=seed % 2 == 1, unequal=seed % 3 == 2)
    reference = simulate(ranked, placement, costs, num_microbatches=m, events=True)
    compiled = compile_schedule(ranked, placement)
    for fast in (
        simulate(ranked, placement, costs, num_microbatches=m, events=False),
        simulate(ranked, placement, costs, num_microbatches=m, events=False, compiled=compiled),
    ):
        assert fast.step_time_s == reference.step_time_s
        assert fast.per_rank_busy_s == reference.per_rank_busy_s
        assert fast.bubble_ratio == reference.bubble_ratio
        assert fast.peak_memory_bytes == reference.peak_memory_bytes
        assert fast.events == ()


def test_two_stages_on_one_rank_and_bad_inputs_match_too() -> None:
    placement = {0: 0, 1: 1, 2: 1}
    ranked = lower(generate("1f1b", 3, 4), placement)
    costs = _costs(random.Random(7), 3, 4, quota=False, unequal=False)
    reference = simulate(ranked, placement, costs, num_microbatches=4)
    fast = simulate(ranked, placement, costs, num_microbatches=4, events=False)
    assert (fast.step_time_s, fast.peak_memory_bytes) == (
        reference.step_time_s,
        reference.peak_memory_bytes,
    )
    # Wrong inputs raise the event simulator's detailed errors on the fast path as well.
    with pytest.raises(ScheduleError, match="out of range"):
        simulate(ranked, placement, costs, num_microbatches=3, events=False)
    with pytest.raises(ScheduleError, match="deadlock"):
        stuck = {r: list(reversed(actions)) for r, actions in ranked.items()}
        simulate(stuck, placement, costs, num_microbatches=4, events=False)
