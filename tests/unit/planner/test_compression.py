"""The compression setting and a plan's per-hop methods are checked with errors that say what
to write instead."""

from __future__ import annotations

import pytest

from lightning_deepcee.planner.compression import METHODS, allowed_methods, check_hops


def test_settings_name_the_methods_the_planner_may_choose() -> None:
    assert allowed_methods("off") == ()
    assert allowed_methods("auto") == ("bf16", "tah8")  # tah4 only when named
    assert allowed_methods("tah8") == ("tah8",)
    assert allowed_methods(["tah8", "off", "bf16", "tah8"]) == ("tah8", "bf16")
    with pytest.raises(ValueError, match=r"unknown method.*'int2'"):
        allowed_methods(["int2"])
    with pytest.raises(ValueError, match="expected 'off', 'auto'"):
        allowed_methods(3)  # type: ignore[arg-type]


def test_hops_are_one_method_per_hop_or_none() -> None:
    assert check_hops(["tah8", "off"], 3) == ("tah8", "off")
    assert check_hops(["off", "off"], 3) == ()  # nothing compressed: stored as none
    assert check_hops((), 3) == ()
    with pytest.raises(ValueError, match="2 hops"):
        check_hops(["tah8"], 3)
    with pytest.raises(ValueError, match="per hop"):
        check_hops(["zip", "off"], 3)
    with pytest.raises(ValueError, match="list of method names"):
        check_hops("tah8", 2)


def test_codes_are_distinct_and_off_is_zero() -> None:
    assert METHODS["off"].code == 0
    assert len({m.code for m in METHODS.values()}) == len(METHODS)
