"""DeepCEEStrategy's arguments: bad values fail at construction, with the setting named."""

from __future__ import annotations

import pytest

from lightning_deepcee import DeepCEEStrategy


def test_profile_rounds_default_and_bad_values() -> None:
    assert DeepCEEStrategy().profile_rounds == 3
    assert DeepCEEStrategy(profile_rounds=1).profile_rounds == 1
    for bad in (0, -2, True, 2.5, "3"):
        with pytest.raises(ValueError, match=rf"profile_rounds={bad!r}\) must be an integer >= 1"):
            DeepCEEStrategy(profile_rounds=bad)  # type: ignore[arg-type]
