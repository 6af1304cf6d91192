"""Decide with the model, confirm with the clock: the split gate, the plan's link figures, and the
whole adapter (monitor, gate, re-plan choice, guard) on synthetic streams, in one process.

The end-to-end tests run the real ``DynamicEnvironmentAdapter`` with a stand-in strategy: each
step's gathered transfers and step time come from a small synthetic world instead of the
all-reduce, and the world's step time is the cost model's prediction of whatever the adapter
runs (a world in which the model is right), or one in which the model is wrong.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from lightning_deepcee.adapter import (
    SplitChoice,
    choose_split,
    link_expectations,
    plan_pairs,
    with_microbatches,
)
from lightning_deepcee.planner import Plan, predict_plan
from tests.helpers.adapter_world import (
    LAN,
    WAN,
    WorldStrategy,
    acted,
    model_world,
    predicted,
    profile_at,
    run_adapter,
    world_plan,
    world_profile,
)

# --------------------------------------------------------------------------- the split gate


def test_the_gate_refuses_a_split_on_the_plans_own_links() -> None:
    choice = choose_split(world_profile(), world_plan(), current_split=1, max_split=4, gain=0.1)
    assert not choice.apply and choice.split == 1
    assert min(choice.step_time_s, key=lambda k: choice.step_time_s[k]) == 1
    assert SplitChoice.from_dict(choice.to_dict()) == choice


def test_the_gate_splits_when_the_wan_drops_to_a_quarter() -> None:
    choice = choose_split(profile_at(0.25), world_plan(), current_split=1, max_split=4, gain=0.1)
    assert choice.apply and choice.split > 1 and choice.gain > 0.1
    assert "faster than x1" in choice.reason


def test_the_gate_refuses_a_gain_below_its_threshold() -> None:
    predicted = choose_split(profile_at(0.25), world_plan(), current_split=1, max_split=4, gain=0.0)
    assert predicted.apply
    refused = choose_split(
        profile_at(0.25), world_plan(), current_split=1, max_split=4, gain=predicted.gain + 0.01
    )
    assert not refused.apply and refused.split == 1
    # A milder drop gains less than the default threshold.
    mild = choose_split(profile_at(0.7), world_plan(), current_split=1, max_split=4, gain=0.1)
    assert not mild.apply and mild.split == 1
    with pytest.raises(ValueError, match="gain must be in"):
        choose_split(world_profile(), world_plan(), current_split=1, max_split=4, gain=1.0)


def test_the_gate_returns_to_the_plans_count_when_no_split_pays() -> None:
    choice = choose_split(world_profile(), world_plan(), current_split=3, max_split=4, gain=0.1)
    assert choice.apply and choice.split == 1 and "back to the plan's count" in choice.reason
    # A split in force that is still the best, but by less than the threshold: back to the
    # plan's count too (a deviation from the plan must earn its keep).
    mild = choose_split(profile_at(0.7), world_plan(), current_split=1, max_split=4, gain=0.0)
    assert mild.apply and 0 < mild.gain < 0.1
    back = choose_split(
        profile_at(0.7), world_plan(), current_split=mild.split, max_split=4, gain=0.1
    )
    assert back.apply and back.split == 1


def test_with_microbatches_runs_another_count_as_the_executor_does() -> None:
    plan = world_plan()
    assert with_microbatches(plan, 2) is plan
    assert with_microbatches(plan, 6).num_microbatches == 6
    data = plan.to_dict()
    actions = ["0F0 0F1 0B0 0W0 0B1 0W1", "1F0 1B0 1W0 1F1 1B1 1W1"]
    compact = Plan.from_dict({**data, "schedule": "compact", "stage_actions": actions})
    split = with_microbatches(compact, 4)
    assert split.schedule == "zb-h1" and split.stage_actions is None
    assert predict_plan(world_profile(), split).step_time_s > 0


# --------------------------------------------------------------------------- the plan's figures


def test_the_plan_pairs_and_their_figures_follow_the_cost_models_groups() -> None:
    pairs = plan_pairs(world_plan())
    assert pairs == [(0, 2), (1, 2), (2, 0), (2, 1)]
    expected, shared = link_expectations(world_profile(), [*pairs, (0, 1)])
    assert expected == {(0, 1): LAN}  # inside a group: the pair's own figure
    assert [(s.name, s.pairs, s.capacity) for s in shared] == [
        ("net0->net1", ((0, 2), (1, 2)), WAN),
        ("net1->net0", ((2, 0), (2, 1)), WAN),
    ]
    # One pair of the plan crossing: its own figure, but the link still lists every pair.
    _, (lone, _) = link_expectations(world_profile(wan=4e6), [(0, 2), (2, 0)])
    assert lone.pairs == ((0, 2), (1, 2)) and lone.capacity == 4e6
    assert link_expectations(None, pairs) == (dict.fromkeys(pairs), [])


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("seed", range(3))
def test_no_action_on_a_network_that_does_not_change(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    # +-20% on the wire, +-10% on the step, 300 steps.
    run = run_adapter(
        monkeypatch, 300, noise=0.1, wire=lambda s, rng: rng.uniform(0.8, 1.2), seed=seed
    )
    assert acted(run) == [] and set(run.microbatches) == {2}
    assert run.adapter.monitor is not None
    assert run.adapter.monitor.signature() == ()


def test_no_action_on_slow_first_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # Start-up: the first 9 steps are 4x slower and their arrivals 5x later.
    def slow(step: int, strategy: WorldStrategy, fraction: float) -> float:
        return (4.0 if step < 10 else 1.0) * model_world(step, strategy, fraction)

    run = run_adapter(monkeypatch, 150, world=slow, wire=lambda s, rng: 0.2 if s < 10 else 1.0)
    assert run.adapter.decisions == [] and set(run.microbatches) == {2}


@pytest.mark.parametrize("seed", range(3))
def test_no_action_on_a_cpu_stalled_device_whose_links_are_fine(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    # A device under a CPU quota: a third of the steps stall up to 3x, a fifth of the arrivals
    # are stamped late; the links deliver what the plan expects.
    stalls = np.random.default_rng(100 + seed)

    def stalled(step: int, strategy: WorldStrategy, fraction: float) -> float:
        stall = stalls.uniform(1.0, 3.0) if stalls.random() < 1 / 3 else 1.0
        return stall * model_world(step, strategy, fraction)

    late = lambda step, rng: rng.uniform(0.3, 0.7) if rng.random() < 0.2 else 1.0  # noqa: E731
    run = run_adapter(monkeypatch, 300, world=stalled, noise=0.1, wire=late, seed=seed)
    assert acted(run) == [] and set(run.microbatches) == {2}


def test_two_senders_sharing_the_wan_each_at_half_take_no_action(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # _run always lets both senders of a direction share the WAN: at the profile's figure each
    # pair sees half of it, which judged pair by pair would be a drop on every pair.
    run = run_adapter(monkeypatch, 200)
    assert run.adapter.decisions == []
    monitor = run.adapter.monitor
    assert monitor is not None and monitor.link_names == ["net0->net1", "net1->net0"]
    assert monitor.measured_bandwidth((0, 2)) == pytest.approx(WAN, rel=0.01)


def _drop(step: int) -> float:
    return 0.25 if 60 <= step < 160 else 1.0


def test_a_real_drop_is_split_kept_while_it_pays_and_merged_at_the_restore(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = run_adapter(monkeypatch, 240, _drop, replan_after=1000)
    split, merge = acted(run)
    assert split["kind"] == "split-applied" and 60 < split["step"] <= 60 + 8 + 1
    assert split["to"] > 1 and run.microbatches[split["step"]] == 2 * split["to"]
    assert merge["kind"] == "merge-applied" and 160 < merge["step"] <= 160 + 8 + 1
    assert run.microbatches[-1] == 2
    verdicts = run.kinds("confirmed", "reverted")
    assert [(v["kind"], v["action_step"]) for v in verdicts] == [
        ("confirmed", split["step"]),
        ("confirmed", merge["step"]),
    ]
    assert verdicts[0]["after_s"] < 0.95 * verdicts[0]["before_s"]
    # Within the window (settle 2 + 6 steps) of each action.
    assert all(v["step"] == v["action_step"] + 8 for v in verdicts)


def test_the_clock_reference_is_taken_only_while_the_links_are_as_profiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The drop starts at step 12, before the monitor has calibrated (step 15) and flagged it
    # (step 18): no reference then, though the links looked as profiled for a few steps. The
    # split configuration runs while the link is degraded and a step or two after the restore
    # is flagged: none for it either. After the restore the plan's own configuration gets its
    # reference on the model's scale (the model is right in this world: measured over
    # predicted is 1 within the noise).
    def early(step: int) -> float:
        return 0.25 if 12 <= step < 100 else 1.0

    run = run_adapter(monkeypatch, 200, early, replan_after=1000)
    assert acted(run)  # a split while degraded, a merge after
    ((key, (measured, predicted)),) = run.adapter.replanner.clock.items()
    assert json.loads(key)[1] == 1  # the plan's own count, not the split
    assert measured == pytest.approx(predicted, rel=0.05)


def test_a_proposal_during_a_verdict_waits_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # The activations' direction drops first, the gradients' a few steps later: the second
    # proposal arrives while the first split waits for its verdict.
    run = run_adapter(
        monkeypatch, 120, lambda step: 0.25 if step >= 60 else 1.0,
        wan_back=lambda step: 0.25 if step >= 64 else 1.0, replan_after=1000,
    )  # fmt: skip
    first = acted(run)[0]
    (deferred,) = run.kinds("deferred")
    verdict = run.kinds("confirmed", "reverted")[0]
    assert first["step"] < deferred["step"] < verdict["step"] == first["step"] + 8
    # Considered at the verdict (when the window's last step time lands, a step later): the
    # next entry is its gate outcome.
    entries = run.adapter.decisions
    after = entries[entries.index(verdict) + 1]
    assert after["kind"].startswith("split-") and after["step"] == verdict["step"] + 1


def test_a_direction_still_read_normal_but_falling_is_predicted_at_its_own_figure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The gradients' direction drops to a tenth (severe at once); the activations' falls to
    # 0.3, not severe and not yet degraded when the re-plan is chosen: it is predicted at 3 MB/s,
    # not at its old 10 MB/s.
    run = run_adapter(
        monkeypatch, 60, lambda step: 0.3 if step >= 40 else 1.0,
        wan_back=lambda step: 0.1 if step >= 40 else 1.0, replan_after=1000,
    )  # fmt: skip
    (proposal,) = [d for d in run.kinds("replan") if d.get("severe")]
    assert proposal["link"] == [2, 0]  # only the gradients' direction was proposed
    (applied,) = run.kinds("replan-applied")
    assert "0->2 10 -> 3 MB/s" in applied["reason"] and "2->0 10 -> 1 MB/s" in applied["reason"]


def test_a_split_that_does_not_pay_is_reverted_within_its_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The model is wrong here: more micro-batches make the step 10% slower.
    def wrong(step: int, strategy: WorldStrategy, fraction: float) -> float:
        base = predicted(fraction, strategy.plan, 2)
        return base * (1.1 if strategy.num_microbatches > 2 else 1.0)

    run = run_adapter(monkeypatch, 150, _drop, wrong, replan_after=1000)
    (split,) = acted(run)
    (reverted,) = run.kinds("reverted")
    assert reverted["action_step"] == split["step"] and reverted["step"] == split["step"] + 8
    assert set(run.microbatches[reverted["step"] :]) == {2}
    # The link stays degraded, the same split is not tried again.
    assert run.kinds("confirmed") == []


def test_a_reverted_split_is_not_retried_under_the_same_link_states(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def wrong(step: int, strategy: WorldStrategy, fraction: float) -> float:
        base = predicted(fraction, strategy.plan, 2)
        return base * (1.1 if strategy.num_microbatches > 2 else 1.0)

    # The WAN drops at 60, recovers at 100 and drops again at 140.
    def twice(step: int) -> float:
        return 0.25 if 60 <= step < 100 or step >= 140 else 1.0

    run = run_adapter(monkeypatch, 200, twice, wrong, replan_after=1000)
    (split,) = acted(run)
    assert split["step"] < 100 and run.kinds("reverted")[0]["action_step"] == split["step"]
    again = [d for d in run.kinds("split-kept") if d["step"] > 140]
    assert again and "reverted" in again[0]["reason"]
    assert set(run.microbatches[-40:]) == {2}


def test_the_gate_keeps_the_split_when_the_predicted_gain_is_too_small(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = run_adapter(monkeypatch, 120, _drop, split_gain=0.5, replan_after=1000)
    assert acted(run) == [] and set(run.microbatches) == {2}
    (kept,) = run.kinds("split-kept")
    assert "needs 50%" in kept["reason"] or "back to" in kept["reason"] or "x1" in kept["reason"]


def test_a_replan_that_does_not_pay_is_reverted_to_the_previous_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The drop persists; no split passes the gate; the re-plan is predicted faster but runs 10%
    # slower than the plan it replaced.
    def wrong(step: int, strategy: WorldStrategy, fraction: float) -> float:
        base = predicted(fraction, world_plan(), 2)
        return base * (1.0 if strategy.plan == world_plan() else 1.1)

    run = run_adapter(monkeypatch, 140, _drop, wrong, split_gain=0.99)
    (applied,) = run.kinds("replan-applied")
    (reverted,) = run.kinds("reverted")
    assert reverted["action"] == "replan" and reverted["step"] == applied["step"] + 8
    moved, back = run.strategy.moves
    assert moved.stages != world_plan().stages and back == world_plan()
    assert run.strategy.cluster_profile == world_profile()  # the profile the plan was made for
    assert run.strategy.plan == world_plan() and run.microbatches[-1] == 2


def test_without_a_profile_the_adapter_only_watches(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.warns(UserWarning, match="no cluster profile"):
        run = run_adapter(monkeypatch, 120, _drop, profile=None)
    assert acted(run) == [] and set(run.microbatches) == {2}
    skipped = run.kinds("split-skipped")
    assert skipped and all("needs a cluster profile" in d["reason"] for d in skipped)
    assert run.kinds("split")  # the proposals themselves are logged


def test_the_adapter_waits_for_the_plan_trial_then_starts_on_its_layout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The plan trial runs the first 20 steps (a drop the adapter would split within 9 steps
    # falls there); at step 21 it leaves the winner, which runs 4 micro-batches, not 2.
    trial = {"running": True}
    monkeypatch.setattr(WorldStrategy, "trial_running", property(lambda self: trial["running"]))

    def world(step: int, strategy: WorldStrategy, fraction: float) -> float:
        trial["running"] = step <= 20
        if step == 21:
            strategy.set_num_microbatches(4)
        return model_world(step, strategy, fraction)

    run = run_adapter(monkeypatch, 80, lambda step: 0.25 if step <= 20 else 1.0, world)
    assert run.adapter.decisions == []  # nothing judged on the trial's steps
    assert run.adapter.split_state.base_microbatches == 4
    assert run.microbatches[20:] == [4] * 60, run.microbatches
