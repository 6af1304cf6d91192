"""The device sets' quick scores in waves: the serial rule's scores whatever the width."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from lightning_deepcee.planner.set_scores import score_sets

Ranks = tuple[int, ...]


class _Map:
    """A map that runs every call here and logs each wave's items."""

    def __init__(self) -> None:
        self.waves: list[list[Any]] = []

    def __call__(
        self, fn: Callable[[Any], Any], items: Sequence[Any], costs: Sequence[float] | None = None
    ) -> list[Any]:
        self.waves.append(list(items))
        return [fn(item) for item in items]


# Every device first, then subsets by compute bound; scores: None cannot hold the model.
ORDER: list[Ranks] = [(0, 1, 2, 3), (0, 1, 2), (0, 1), (1, 2), (0,), (2,)]
BOUND = {
    (0, 1, 2, 3): 1.0,
    (0, 1, 2): 1.2,
    (0, 1): 1.5,
    (1, 2): 1.9,
    (0,): 2.5,
    (2,): 3.0,
    (3,): 1.1,
}
SCORE: dict[Ranks, float | None] = {
    (0, 1, 2, 3): 2.0,
    (0, 1, 2): None,
    (0, 1): 1.8,
    (1, 2): 2.2,
    (0,): 2.6,
    (2,): 3.1,
    (3,): 4.0,
}
ZONES: list[Ranks] = [(3,), (0, 1), (2,)]  # by bound


def _serial_rule() -> dict[Ranks, float]:
    """The rule as plan_search wrote it before the waves: one set at a time."""
    scored: dict[Ranks, float] = {}
    for ranks in ORDER:
        if scored and BOUND[ranks] >= min(scored.values()):
            break
        if SCORE[ranks] is not None:
            scored[ranks] = SCORE[ranks]  # type: ignore[assignment]
    for zone in ZONES:
        best = min((scored[z] for z in ZONES if z in scored), default=float("inf"))
        if zone not in scored and BOUND[zone] < best and SCORE[zone] is not None:
            scored[zone] = SCORE[zone]  # type: ignore[assignment]
    return scored


@pytest.mark.parametrize("width", [1, 2, 3, 8])
def test_waves_give_the_serial_rules_scores(width: int) -> None:
    mapped = _Map()
    scored = score_sets(
        ORDER, ZONES, BOUND, score=SCORE.__getitem__, profiles=lambda r: r, map_fn=mapped,
        width=width,
    )  # fmt: skip
    expected = _serial_rule()
    assert scored == expected
    # (1, 2)'s bound 1.9 reaches the best score 1.8: it and what follows are not scored; the
    # zone (3,) is (its bound 1.1 is below the best zone's 1.8), (2,) is not (3.0).
    assert expected == {(0, 1, 2, 3): 2.0, (0, 1): 1.8, (3,): 4.0}
    assert all(len(wave) <= width for wave in mapped.waves)
    made = [ranks for wave in mapped.waves for ranks in wave]
    if width == 1:
        assert made == [(0, 1, 2, 3), (0, 1, 2), (0, 1), (3,)]  # no call is wasted
    assert len(made) <= len(expected) + 1 + 2 * width  # a wave's calls past each stop at most


def test_a_bad_width_is_refused() -> None:
    with pytest.raises(ValueError, match="width"):
        score_sets(ORDER, ZONES, BOUND, score=SCORE.__getitem__, profiles=lambda r: r,
                   map_fn=_Map(), width=0)  # fmt: skip
