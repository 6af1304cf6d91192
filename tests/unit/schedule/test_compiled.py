"""The compiled fast loop gives the event simulator's figures exactly.

``simulate(..., events=False)`` runs :mod:`lightning_deepcee.schedule.compiled`; the recording
simulator (``events=True``) is the reference. Random costs, unequal micro-batches, CPU quotas and
every generated schedule: step time, busy seconds, bubble and memory peaks must be equal floats.
Schedules compiled before lowering (``compile_stage_schedule``, one stage per rank) must give the
figures of the lowered ones.
"""

from __future__ import annotations

import random

import pytest

from lightning_deepcee.schedule.actions import Action, ActionKind
from lightning_deepcee.schedule.compact import compact_zero_bubble
from lightning_deepcee.schedule.compiled import (
    compile_schedule,
    compile_stage_schedule,
    move_compute,
)
from lightning_deepcee.schedule.generators import SCHEDULE_KINDS, StageSchedule, generate
from lightning_deepcee.schedule.lowering import lower
from lightning_deepcee.schedule.simulate import (
    StageCosts,
    compiled_step_time,
    simulate,
    simulate_stages,
)
from lightning_deepcee.schedule.validate import ScheduleError

W = ActionKind.W


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


def _moved_w(schedule: StageSchedule, rng: random.Random) -> StageSchedule:
    """``schedule`` with one W of a random stage moved to a random later place (still after
    its B): the kind of edit the compact fitter's local search makes."""
    stage = rng.choice(
        [s for s, acts in schedule.items() if any(a.kind == ActionKind.W for a in acts)]
    )
    acts = list(schedule[stage])
    i = rng.choice([j for j, a in enumerate(acts) if a.kind == ActionKind.W])
    w = acts.pop(i)
    acts.insert(rng.randint(i, len(acts)), w)
    return {**schedule, stage: acts}


@pytest.mark.parametrize("seed", range(12))
def test_a_stage_schedule_compiled_before_lowering_gives_the_lowered_figures(seed: int) -> None:
    rng = random.Random(100 + seed)
    p, m = rng.randint(1, 6), rng.randint(1, 9)
    costs = _costs(rng, p, m, quota=seed % 2 == 1, unequal=seed % 3 == 2)
    kinds: list[StageSchedule] = [generate(kind, p, m) for kind in SCHEDULE_KINDS]
    kinds.append(compact_zero_bubble(costs, m))
    kinds.append(_moved_w(kinds[-1], rng))
    placement = {s: s for s in range(p)}
    for schedule in kinds:
        reference = simulate(lower(schedule, placement), placement, costs, num_microbatches=m)
        compiled = compile_stage_schedule(schedule)
        assert compiled is not None
        assert (
            compiled.num_messages
            == compile_schedule(lower(schedule, placement), placement).num_messages
        )
        for fast in (
            simulate_stages(schedule, costs, num_microbatches=m),
            simulate_stages(schedule, costs, num_microbatches=m, compiled=compiled),
        ):
            assert fast.step_time_s == reference.step_time_s
            assert fast.per_rank_busy_s == reference.per_rank_busy_s
            assert fast.bubble_ratio == reference.bubble_ratio
            assert fast.peak_memory_bytes == reference.peak_memory_bytes


def test_a_stage_schedule_that_cannot_be_compiled_before_lowering_raises_as_lowered() -> None:
    costs = _costs(random.Random(3), 3, 4, quota=False, unequal=False)
    schedule = generate("1f1b", 3, 4)
    misplaced = {**schedule, 1: [Action(2, ActionKind.F, 0), *schedule[1][1:]]}
    assert compile_stage_schedule(misplaced) is None
    with pytest.raises(ScheduleError, match="placed on rank"):
        simulate_stages(misplaced, costs, num_microbatches=4)
    stuck = {s: list(reversed(acts)) for s, acts in schedule.items()}
    assert compile_stage_schedule(stuck) is not None
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate_stages(stuck, costs, num_microbatches=4)


@pytest.mark.parametrize("seed", range(8))
def test_a_w_moved_in_the_compiled_program_equals_compiling_the_moved_schedule(seed: int) -> None:
    rng = random.Random(300 + seed)
    p, m = rng.randint(2, 6), rng.randint(2, 9)
    costs = _costs(rng, p, m, quota=seed % 2 == 1, unequal=seed % 3 == 2)
    schedule = compact_zero_bubble(costs, m)
    compiled = compile_stage_schedule(schedule)
    assert compiled is not None
    for _ in range(6):  # a chain of moves, each on the previous program
        stage = rng.choice([s for s, acts in schedule.items() if any(a.kind == W for a in acts)])
        acts = list(schedule[stage])
        i = rng.choice([j for j, a in enumerate(acts) if a.kind == W])
        t = rng.randint(i, len(acts) - 1)  # later: still after its B
        acts.insert(t, acts.pop(i))
        schedule = {**schedule, stage: acts}
        compiled = move_compute(compiled, stage, i, t)
        assert compiled == compile_stage_schedule(schedule)
        step = compiled_step_time(compiled, costs, m)
        assert step == simulate_stages(schedule, costs, num_microbatches=m).step_time_s
    with pytest.raises(ValueError, match="not a W"):
        first_f = next(j for j, a in enumerate(schedule[0]) if a.kind == ActionKind.F)
        move_compute(compiled, 0, first_f, first_f + 1)
