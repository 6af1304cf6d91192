"""SplitTuner on synthetic step-time streams: climbs while finer splits pay, stops otherwise."""

from __future__ import annotations

import random

import pytest

from lightning_deepcee.adapter import SplitTuner, TunerDecision


def _run(
    tuner: SplitTuner, step_s: dict[int, float], steps: int, noise: float = 0.0
) -> list[TunerDecision]:
    """Feed ``steps`` step times, each the time of the split in force (plus noise)."""
    rng = random.Random(0)
    decisions = []
    for step in range(steps):
        t = step_s[tuner.split] * (1 + rng.uniform(-noise, noise))
        d = tuner.observe(step, t)
        if d is not None:
            decisions.append(d)
    return decisions


def test_climbs_while_finer_splits_pay_and_keeps_the_largest() -> None:
    tuner = SplitTuner(max_split=4, window=5, settle=1)
    tuner.start(2)
    decisions = _run(tuner, {2: 0.76, 3: 0.69, 4: 0.62}, 40, noise=0.01)
    assert [(d.kind, d.split) for d in decisions] == [("probe", 3), ("probe", 4), ("keep", 4)]
    assert not tuner.active and tuner.split == 4
    # Each split is held settle + window steps before it is judged.
    assert [d.step for d in decisions] == [5, 11, 17]


def test_reverts_when_a_finer_split_does_not_pay() -> None:
    tuner = SplitTuner(max_split=4, window=5, settle=1, min_gain=0.05)
    tuner.start(2)
    # x3 is 3% faster: within the noise margin, not worth it -> back to x2, tuning stops.
    decisions = _run(tuner, {2: 0.76, 3: 0.737, 4: 0.5}, 40, noise=0.005)
    assert [(d.kind, d.split) for d in decisions] == [("probe", 3), ("revert", 2)]
    assert decisions[-1].best_s == pytest.approx(0.76, rel=0.01)
    assert not tuner.active and tuner.split == 2
    # A slower finer split reverts too.
    tuner.start(2)
    decisions = _run(tuner, {2: 0.76, 3: 0.9}, 40)
    assert [(d.kind, d.split) for d in decisions] == [("probe", 3), ("revert", 2)]


def test_noise_alone_does_not_move_the_split_past_one_probe() -> None:
    # Equal true times with +-4% noise: medians of 5 never differ by 5% -> one probe, revert.
    for seed in range(20):
        tuner = SplitTuner(max_split=4, window=5, settle=1)
        tuner.start(1)
        rng = random.Random(seed)
        kinds = []
        for step in range(60):
            d = tuner.observe(step, 0.5 * (1 + rng.uniform(-0.04, 0.04)))
            if d is not None:
                kinds.append(d.kind)
        assert kinds == ["probe", "revert"], (seed, kinds)
        assert tuner.split == 1


def test_start_at_max_split_or_stop_does_nothing() -> None:
    tuner = SplitTuner(max_split=4)
    tuner.start(4)
    assert not tuner.active
    assert _run(tuner, {4: 1.0}, 20) == []
    tuner.start(2)
    tuner.stop()
    assert _run(tuner, {2: 1.0}, 20) == []


def test_state_round_trip_continues_the_same_way() -> None:
    a = SplitTuner(max_split=4, window=3, settle=0)
    a.start(2)
    for step in range(4):  # one window of x2 done, one sample of x3
        a.observe(step, 1.0 if a.split == 2 else 0.8)
    b = SplitTuner(max_split=4, window=3, settle=0)
    b.load_state_dict(a.state_dict())
    times = {2: 1.0, 3: 0.8, 4: 0.7}
    assert _run(a, times, 10) == _run(b, times, 10)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"max_split": 0}, "max_split"), ({"max_split": 2, "window": 0}, "window"),
     ({"max_split": 2, "min_gain": 1.0}, "min_gain")],
)  # fmt: skip
def test_bad_arguments(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SplitTuner(**kwargs)  # type: ignore[arg-type]
