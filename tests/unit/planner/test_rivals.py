"""Rivals of a plan: near layouts the cost model cannot rank, listed for the setup trial.

Checked against a brute force over the same cost model: every rival keeps the plan's devices,
moves its block boundaries by at most two blocks in all or runs another schedule or micro-batch
count, is predicted within the margin and carries its true prediction; every layout that
qualifies is listed, the fastest of each schedule and count first; idle ranks stay idle.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from lightning_deepcee.planner import Plan, predict_plan
from lightning_deepcee.planner.rivals import (
    TRIAL_STEPS,
    TrialRace,
    choose_rivals,
    out_of_race,
    pick_timed,
    rival_plans,
    rival_runs,
)
from lightning_deepcee.planner.search import make_plan, plan_search
from lightning_deepcee.profiler.data import ClusterProfile
from lightning_deepcee.schedule.actions import format_actions
from lightning_deepcee.schedule.generators import generate
from tests.helpers.clusters import make_profile, two_zones


def _cluster(speeds: list[float], wan: float = 2e7, blocks: int = 12) -> ClusterProfile:
    zone = np.array([0, 0] + [1] * (len(speeds) - 2))
    bandwidth = np.where(zone[:, None] == zone[None, :], 1e9, wan)
    return make_profile(
        speeds=speeds,
        num_blocks=blocks,
        bandwidth=bandwidth,
        latency=0.001,
        block_s=0.01,
        activation_bytes=100_000,
        parameter_bytes=4_000_000,
    )


def _cuts(plan: Plan) -> tuple[int, ...]:
    return tuple(st.block_range[0] for st in plan.stages[1:])


def _moves(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True))


def _plan(profile: ClusterProfile, schedule: str = "zb-h1") -> Plan:
    plan = make_plan(
        profile,
        [[0], [1], [2], [3]],
        [(0, 3), (3, 6), (6, 9), (9, 12)],
        schedule=schedule,
        num_microbatches=4,
        global_batch_size=32,
    )
    assert plan is not None
    return plan


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_rivals_are_the_near_layouts_within_the_margin(schedule: str) -> None:
    profile = _cluster([1.0, 1.1, 0.9, 1.05])
    plan = _plan(profile, schedule)
    within = 0.15
    rivals = rival_plans(profile, plan, count=50, within=within, runs=[(schedule, 4)])
    assert rivals, "equal devices: some near layout is within 15%"
    limit = plan.predicted_step_time_s * (1 + within)
    listed = set()
    for rival in rivals:
        assert [st.ranks for st in rival.stages] == [st.ranks for st in plan.stages]
        assert (rival.schedule, rival.num_microbatches) == (schedule, 4)
        assert 1 <= _moves(_cuts(rival), _cuts(plan)) <= 2
        assert rival.predicted_step_time_s <= limit * (1 + 1e-12)
        again = predict_plan(profile, rival).step_time_s
        assert again == pytest.approx(rival.predicted_step_time_s, rel=1e-9)
        assert "rival" in rival.notes
        listed.add(_cuts(rival))
    times = [r.predicted_step_time_s for r in rivals]
    assert times == sorted(times)
    # Brute force: every partition within two moves that the cost model puts under the limit.
    expected = set()
    for cuts in itertools.combinations(range(1, 12), 3):
        if not 1 <= _moves(cuts, _cuts(plan)) <= 2:
            continue
        bounds = (0, *cuts, 12)
        other = make_plan(
            profile,
            [[0], [1], [2], [3]],
            list(itertools.pairwise(bounds)),
            schedule=schedule,
            num_microbatches=4,
            global_batch_size=32,
        )
        if other is not None and other.predicted_step_time_s <= limit:
            expected.add(cuts)
    assert listed == expected


def test_rivals_run_other_schedules_and_counts_fastest_of_each_first() -> None:
    profile = _cluster([1.0, 1.1, 0.9, 1.05])
    plan = _plan(profile, "zb-h1")  # 4 micro-batches of a batch of 32
    assert rival_runs(plan) == [
        ("zb-h1", 4), ("1f1b", 4), ("1f1b", 2), ("zb-h1", 2), ("1f1b", 8), ("zb-h1", 8),
    ]  # fmt: skip
    within = 0.3
    rivals = rival_plans(profile, plan, count=500, within=within)
    limit = plan.predicted_step_time_s * (1 + within)
    listed = {(_cuts(r), r.schedule, r.num_microbatches) for r in rivals}
    assert len(listed) == len(rivals)
    expected = set()
    for cuts in itertools.combinations(range(1, 12), 3):
        for kind, m in rival_runs(plan):
            if _moves(cuts, _cuts(plan)) > 2 or (cuts, kind, m) == (_cuts(plan), "zb-h1", 4):
                continue
            other = make_plan(
                profile,
                [[0], [1], [2], [3]],
                list(itertools.pairwise((0, *cuts, 12))),
                schedule=kind,
                num_microbatches=m,
                global_batch_size=32,
            )
            if other is not None and other.predicted_step_time_s <= limit:
                expected.add((cuts, kind, m))
    assert listed == expected
    assert {(k, m) for _, k, m in listed} - {("zb-h1", 4)}, "other runs are listed"
    runs = list(dict.fromkeys((r.schedule, r.num_microbatches) for r in rivals))
    firsts, rest = rivals[: len(runs)], rivals[len(runs) :]
    assert [(r.schedule, r.num_microbatches) for r in firsts] == runs
    for part in (firsts, rest):
        times = [r.predicted_step_time_s for r in part]
        assert times == sorted(times)
    for rival in rivals:
        assert predict_plan(profile, rival).step_time_s == pytest.approx(
            rival.predicted_step_time_s, rel=1e-9
        )
        changed = (rival.schedule, rival.num_microbatches) != ("zb-h1", 4)
        assert ("micro-batches" in rival.notes) == changed, rival.notes
        assert ("boundaries moved" in rival.notes) == (_cuts(rival) != _cuts(plan)), rival.notes


def test_rival_runs_keep_counts_that_divide_the_batch() -> None:
    profile = _cluster([1.0, 1.1, 0.9, 1.05])
    plan = make_plan(
        profile, [[0], [1], [2], [3]], [(0, 3), (3, 6), (6, 9), (9, 12)], schedule="1f1b",
        num_microbatches=3, global_batch_size=6,
    )  # fmt: skip
    assert plan is not None
    # 3 // 2 = 1 divides 6; 2 * 3 = 6 divides 6.
    assert rival_runs(plan) == [("1f1b", 3), ("zb-h1", 3), ("1f1b", 1), ("zb-h1", 1),
                                ("1f1b", 6), ("zb-h1", 6)]  # fmt: skip
    # A compact plan's rivals run generated kinds; 8 does not divide 12.
    fitted = generate("zb-h1", 4, 4)
    compact = dataclasses.replace(
        plan,
        schedule="compact",
        num_microbatches=4,
        global_batch_size=12,
        stage_actions=tuple(format_actions(fitted[s]) for s in range(4)),
    )
    assert rival_runs(compact) == [("1f1b", 4), ("zb-h1", 4), ("1f1b", 2), ("zb-h1", 2)]


def test_count_and_margin_bound_the_list() -> None:
    profile = _cluster([1.0, 1.1, 0.9, 1.05])
    plan = _plan(profile)
    many = rival_plans(profile, plan, count=50, within=0.15)
    assert len(many) > 2
    assert rival_plans(profile, plan, count=2, within=0.15) == many[:2]
    assert rival_plans(profile, plan, count=0) == []
    none = rival_plans(profile, plan, count=5, within=0.0)
    assert all(r.predicted_step_time_s <= plan.predicted_step_time_s for r in none)
    with pytest.raises(ValueError, match="count"):
        rival_plans(profile, plan, count=-1)
    with pytest.raises(ValueError, match="within"):
        rival_plans(profile, plan, count=1, within=-0.1)


def test_rivals_of_a_plan_with_idle_ranks_keep_them_idle() -> None:
    profile = _cluster([4.0, 4.0, 1.0, 1.0, 1.0, 1.0], wan=1e5)
    plan = plan_search(profile, num_blocks=12, global_batch_size=32)
    assert plan.idle_ranks, plan.format_table()
    rivals = rival_plans(profile, plan, count=4, within=0.5)
    for rival in rivals:
        assert rival.idle_ranks == plan.idle_ranks
        assert rival.ranks == plan.ranks
        rival.check_matches(12, 6, plan.model_fingerprint, plan.cluster_fingerprint)
        assert predict_plan(profile, rival).step_time_s == pytest.approx(
            rival.predicted_step_time_s, rel=1e-9
        )


def test_a_single_stage_has_no_rivals() -> None:
    profile = _cluster([1.0, 1.0, 1.0, 1.0])
    plan = make_plan(
        profile, [[0, 1, 2, 3]], [(0, 12)], schedule="1f1b", num_microbatches=1,
        global_batch_size=32,
    )  # fmt: skip
    assert plan is not None
    assert rival_plans(profile, plan, count=3) == []


def test_the_search_lists_its_alternatives() -> None:
    # At 10 MB/s both zones are predicted fastest, by less than 20%: a device gain of 0.2 keeps
    # zone A alone, and the plan on both zones is an alternative.
    profile = two_zones(1e7)
    found: list[Plan] = []
    plan = plan_search(profile, num_blocks=8, global_batch_size=32, device_gain=0.2,
                       alternatives=found)  # fmt: skip
    assert plan == plan_search(profile, num_blocks=8, global_batch_size=32, device_gain=0.2)
    assert plan.ranks == (0, 1), plan.format_table()
    assert found, "the search scored other candidates"
    assert any(set(p.ranks) & {2, 3, 4, 5} for p in found), [p.ranks for p in found]
    keys = [p.layout_key for p in [plan, *found]]
    assert len(set(keys)) == len(keys), "each layout once, never the plan's"
    times = [p.predicted_step_time_s for p in found]
    assert times == sorted(times)
    for p in found:
        p.check_matches(8, 6, plan.model_fingerprint, plan.cluster_fingerprint)
        assert predict_plan(profile, p).step_time_s == pytest.approx(
            p.predicted_step_time_s, rel=1e-9
        )


def test_choose_rivals_gives_half_the_places_to_other_structures() -> None:
    profile = two_zones(1e7)
    found: list[Plan] = []
    plan = plan_search(profile, num_blocks=8, global_batch_size=32, device_gain=0.2,
                       alternatives=found)  # fmt: skip
    limit = plan.predicted_step_time_s * 1.10
    close = [p for p in found if p.predicted_step_time_s <= limit]
    near = rival_plans(profile, plan, count=8)
    chosen = choose_rivals(profile, plan, found, count=4)
    assert len(chosen) <= 4
    assert all(p.predicted_step_time_s <= limit * (1 + 1e-12) for p in chosen)
    times = [p.predicted_step_time_s for p in chosen]
    assert times == sorted(times)
    structures = [p for p in chosen if "alternative" in p.notes]
    assert len(structures) == min(len(close), 2 if near else 4), (len(close), len(near))
    assert choose_rivals(profile, plan, [], count=3) == rival_plans(profile, plan, count=3)
    assert choose_rivals(profile, plan, [plan], count=3) == rival_plans(profile, plan, count=3)


def _on(ranks: tuple[int, ...]) -> Plan:
    profile = two_zones(1e7)
    plan = make_plan(
        profile, [list(ranks)], [(0, 8)], schedule="1f1b", num_microbatches=4,
        global_batch_size=32,
    )  # fmt: skip
    assert plan is not None
    return plan


def test_pick_timed_applies_the_searchs_rule_to_the_clock() -> None:
    two, three, six = _on((0, 1)), _on((0, 1, 2)), _on((0, 1, 2, 3, 4, 5))
    # Same devices: the fastest, but the searched plan (index 0) unless beaten by 2%.
    assert pick_timed([two, two, two], [1.0, 0.9, 0.95], device_gain=0.05) == 1
    assert pick_timed([two, two], [1.0, 0.99], device_gain=0.05) == 0
    # More devices must be device_gain faster; fewer devices win within it.
    assert pick_timed([two, six], [1.0, 0.96], device_gain=0.05) == 0
    assert pick_timed([two, six], [1.0, 0.90], device_gain=0.05) == 1
    assert pick_timed([six, two], [0.96, 1.0], device_gain=0.05) == 1
    assert pick_timed([six, three, two], [0.80, 0.82, 0.95], device_gain=0.05) == 1
    assert pick_timed([six, two], [0.96, 1.0], device_gain=0.0) == 0
    with pytest.raises(ValueError, match="2 plans and 1 timings"):
        pick_timed([two, six], [1.0], device_gain=0.05)


def test_a_rival_leaves_the_race_only_when_its_fastest_step_is_far_beyond_the_fastest() -> None:
    # device_gain 0.05 + RACE_MARGIN 0.30: out beyond 1.35x the fastest median.
    assert not out_of_race([], 1.0, device_gain=0.05)
    assert not out_of_race([1.34], 1.0, device_gain=0.05)
    assert out_of_race([1.36], 1.0, device_gain=0.05)
    assert not out_of_race([2.0, 1.2], 1.0, device_gain=0.05)  # one stalled step is not enough
    # A larger device_gain keeps slower plans in: pick_timed may still take one with fewer devices.
    assert not out_of_race([1.5], 1.0, device_gain=0.25)
    assert out_of_race([1.6], 1.0, device_gain=0.25)


def test_the_trial_race_runs_each_candidate_its_steps_then_names_the_winner() -> None:
    two, three = _on((0, 1)), _on((0, 1, 2))
    race = TrialRace([two, two, three], device_gain=0.05)
    moves = [race.record(s) for s in (1.9, 1.0, 1.1)]  # the first step allocates
    assert moves == [None, None, 1] and race.running == 1
    moves = [race.record(s) for s in (1.5, 0.9, 0.95)]
    assert moves == [None, None, 2] and race.medians == [1.1, 0.95]
    # A step 35% beyond device_gain slower than the fastest median, after the first: out.
    assert race.record(2.0) is None and race.running == 2  # the first step is not judged
    assert race.record(1.4) == 1 and race.winner == 1 and race.running == 1
    assert race.steps == [[1.9, 1.0, 1.1], [1.5, 0.9, 0.95], [2.0, 1.4]]
    with pytest.raises(RuntimeError, match="after the race ended"):
        race.record(1.0)


def test_the_trial_race_keeps_the_running_plan_when_it_wins_and_refuses_bad_figures() -> None:
    two = _on((0, 1))
    race = TrialRace([two, two], device_gain=0.05)
    for _ in range(TRIAL_STEPS):
        race.record(1.0)
    assert [race.record(1.0) for _ in range(TRIAL_STEPS)] == [None, None, 0]  # not 2% faster
    race = TrialRace([two, two], device_gain=0.05)
    with pytest.raises(ValueError, match="a step of nan s"):
        race.record(float("nan"))
    with pytest.raises(ValueError, match=r"a step of -1\.0 s"):
        race.record(-1.0)
