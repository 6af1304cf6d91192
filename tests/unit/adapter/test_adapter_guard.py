"""Confirm with the clock: the ActionGuard on synthetic step-time streams (pure, one process)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lightning_deepcee.adapter import ActionGuard, GuardConfig, Verdict

CFG = GuardConfig()  # window 6, settle 2, min_gain 0.05


def _run(
    guard: ActionGuard, times: list[float], start: int = 0, act_at: int | None = None
) -> list[Verdict]:
    """Feed ``times`` from step ``start``; an action (away from the plan) after ``act_at``."""
    verdicts = []
    for offset, seconds in enumerate(times):
        step = start + offset
        verdict = guard.record(step, seconds)
        if verdict is not None:
            verdicts.append(verdict)
        if step == act_at:
            guard.begin(step, {"kind": "split", "to": 2}, towards_plan=False)
    return verdicts


def test_an_action_that_did_not_pay_is_reverted_within_its_window() -> None:
    guard = ActionGuard(CFG)
    # 1.0 s/step before; the action makes it 10% slower.
    (verdict,) = _run(guard, [1.0] * 20 + [1.1] * 20, act_at=19)
    assert not verdict.keep
    assert verdict.step == 19 + CFG.settle + CFG.window  # exactly one window after settling
    assert verdict.before_s == 1.0 and verdict.after_s == pytest.approx(1.1)
    assert verdict.action == {"kind": "split", "to": 2, "step": 19}
    assert guard.pending is None


def test_an_action_that_paid_is_kept() -> None:
    guard = ActionGuard(CFG)
    (verdict,) = _run(guard, [1.0] * 20 + [0.8] * 20, act_at=19)
    assert verdict.keep and verdict.after_s == pytest.approx(0.8)
    assert "faster" in verdict.reason
    # After a kept action, the window it was judged on is the next baseline.
    assert guard.baseline_s == pytest.approx(0.8)


@pytest.mark.parametrize(("newest", "keep"), [(3, True), (None, False)])
def test_a_move_after_a_severe_change_is_judged_against_the_steps_since_it(
    newest: int | None, keep: bool
) -> None:
    # 1.0 s a step, then a cut (1.6 s) proposed on at its third step and moved on at once: the
    # window before the move holds three steps from before the cut, whose median is 1.3 s.
    guard = ActionGuard(CFG)
    for step, seconds in enumerate([1.0] * 10 + [1.6] * 3):
        guard.record(step, seconds)
    guard.begin(12, {"kind": "replan"}, towards_plan=False, newest=newest)
    verdicts = [guard.record(13 + i, 1.25) for i in range(CFG.settle + CFG.window)]
    verdict = verdicts[-1]
    assert verdict is not None and verdict.keep == keep
    assert verdict.before_s == pytest.approx(1.6 if newest else 1.3)


def test_a_gain_below_min_gain_is_not_enough() -> None:
    (verdict,) = _run(ActionGuard(CFG), [1.0] * 20 + [0.97] * 20, act_at=19)
    assert not verdict.keep


def test_a_step_back_towards_the_plan_is_kept_unless_it_hurts() -> None:
    for after, keep in ((1.03, True), (1.2, False), (0.7, True)):
        guard = ActionGuard(CFG)
        _run(guard, [1.0] * 10)
        guard.begin(9, {"kind": "split", "to": 1}, towards_plan=True)
        (verdict,) = _run(guard, [after] * 10, start=10)
        assert verdict.keep is keep, (after, verdict)


def test_the_settling_steps_are_left_out() -> None:
    config = GuardConfig(settle=4)
    # The steps right after the action rebuild executors: slow ones there change nothing.
    times = [1.0] * 20 + [30.0] * config.settle + [0.8] * config.window
    (verdict,) = _run(ActionGuard(config), times, act_at=19)
    assert verdict.keep and verdict.after_s == pytest.approx(0.8)
    # Counted instead, the same steps would have been judged.
    (verdict,) = _run(ActionGuard(GuardConfig(settle=0)), times, act_at=19)
    assert verdict.after_s > 1.0 and not verdict.keep


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    ("effect", "most_kept", "least_kept"), [(1.1, 0.02, 0.0), (1.0, 0.25, 0.0), (0.8, 1.0, 0.98)]
)
def test_on_noisy_steps_the_verdict_follows_the_effect(
    seed: int, effect: float, most_kept: float, least_kept: float
) -> None:
    # +-10% step-time noise; the action costs 10%, changes nothing, or gains 20% (200 times each).
    rng = np.random.default_rng(seed)
    kept = 0
    for _ in range(200):
        guard = ActionGuard(CFG)
        times = list(rng.uniform(0.9, 1.1, 10)) + list(effect * rng.uniform(0.9, 1.1, 20))
        (verdict,) = _run(guard, times, act_at=9)
        assert verdict.step == 9 + CFG.settle + CFG.window  # never later than its window
        kept += verdict.keep
    assert least_kept * 200 <= kept <= most_kept * 200, kept


def test_no_baseline_keeps_the_action() -> None:
    guard = ActionGuard(CFG)
    guard.settle()  # the start of training: nothing measured yet
    guard.begin(1, {"kind": "replan"}, towards_plan=False)
    (verdict,) = _run(guard, [2.0] * 10, start=2)
    assert verdict.keep and verdict.before_s is None


def test_one_action_at_a_time_and_nonpositive_times_are_ignored() -> None:
    guard = ActionGuard(CFG)
    guard.begin(0, {"kind": "split"}, towards_plan=False)
    with pytest.raises(RuntimeError, match="already waiting"):
        guard.begin(1, {"kind": "split"}, towards_plan=False)
    assert _run(guard, [0.0, float("nan"), -1.0] * 10) == []


@pytest.mark.parametrize("cut", [3, 17, 21, 25, 31])
def test_state_dict_round_trip_continues_identically(cut: int) -> None:
    rng = np.random.default_rng(cut)
    times = list(rng.uniform(0.9, 1.1, 20)) + list(rng.uniform(0.7, 0.8, 20))
    original = ActionGuard(CFG)
    _run(original, times[:cut], act_at=19)
    restored = ActionGuard(CFG)
    restored.load_state_dict(json.loads(json.dumps(original.state_dict())))
    if cut <= 19:
        for guard in (original, restored):
            _run(guard, times[cut:20], start=cut, act_at=19)
        cut = 20
    tail = times[cut:]
    assert _run(restored, tail, start=cut) == _run(original, tail, start=cut)
    assert restored.state_dict() == original.state_dict()
    with pytest.raises(ValueError, match="expected version 1"):
        restored.load_state_dict({**original.state_dict(), "version": 0})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"window": 0}, "window"), ({"settle": -1}, "settle"), ({"min_gain": 1.0}, "min_gain")],
)
def test_config_validation(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GuardConfig(**kwargs)  # type: ignore[arg-type]
