"""DeepCEEStrategy's arguments: bad values fail at construction, with the setting named."""

from __future__ import annotations

import pytest

from lightning_deepcee import DeepCEEStrategy


def test_profile_rounds_default_and_bad_values() -> None:
    assert DeepCEEStrategy().profile_settings.rounds == 3
    assert DeepCEEStrategy(profile_rounds=1).profile_settings.rounds == 1
    for bad in (0, -2, True, 2.5, "3"):
        with pytest.raises(ValueError, match=rf"profile_rounds={bad!r}\) must be an integer >= 1"):
            DeepCEEStrategy(profile_rounds=bad)  # type: ignore[arg-type]


def test_profile_block_budget_default_none_and_bad_values() -> None:
    assert DeepCEEStrategy().profile_settings.block_budget_s == 6.0
    assert DeepCEEStrategy(profile_block_budget_s=None).profile_settings.block_budget_s is None
    for bad in (0.0, -5.0):
        with pytest.raises(ValueError, match=r"profile_block_budget_s=.*must be > 0"):
            DeepCEEStrategy(profile_block_budget_s=bad)


def test_device_gain_default_and_bad_values() -> None:
    assert DeepCEEStrategy().device_gain == 0.05
    assert DeepCEEStrategy(device_gain=0.0).device_gain == 0.0
    for bad in (-0.1, 1.0, True):
        with pytest.raises(ValueError, match=r"device_gain=.*must be in \[0, 1\)"):
            DeepCEEStrategy(device_gain=bad)


def test_plan_trial_default_and_bad_values() -> None:
    assert DeepCEEStrategy().plan_trial == 4
    assert DeepCEEStrategy(plan_trial=1).plan_trial == 1
    for bad in (0, -1, True, 2.0, "3"):
        with pytest.raises(ValueError, match=rf"plan_trial={bad!r}\) must be an integer >= 1"):
            DeepCEEStrategy(plan_trial=bad)  # type: ignore[arg-type]
