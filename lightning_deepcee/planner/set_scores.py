"""The quick scores of device sets, in waves of independent calls.

:func:`~lightning_deepcee.planner.search.plan_search` gives every candidate device set a quick
search, most promising first, and stops where a set's compute bound cannot beat the best score
found: a serial rule, each step reading the scores before it. :func:`score_sets` makes the same
decisions with ``width`` calls at a time through a :class:`~.candidates.MapFn` (set-up spreads
them over every rank): a wave's calls run together, then its results are read in the serial
order, and a call past the point where the serial rule stops is made and not used. The scores
are therefore those of ``width=1``, whatever the width and however the map runs the calls.

Planner layer: pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from lightning_deepcee.planner.candidates import MapFn
from lightning_deepcee.planner.plan import Plan
from lightning_deepcee.profiler.data import ClusterProfile

__all__ = ["quick_step_time", "score_sets"]

Ranks = tuple[int, ...]
T = TypeVar("T")


def score_sets(
    order: Sequence[Ranks],
    zones: Sequence[Ranks],
    bound: Mapping[Ranks, float],
    *,
    score: Callable[[T], float | None],
    profiles: Callable[[Ranks], T],
    map_fn: MapFn,
    width: int = 1,
) -> dict[Ranks, float]:
    """Quick scores (predicted step seconds) of the device sets the serial rule scores.

    ``order``: every device first, then subsets by compute bound; each is scored until one's
    ``bound`` reaches the best score so far. ``zones``: each network group alone, by bound,
    scored unless already scored or its bound reaches the best zone's score so far. ``score``
    (it pickles: a module-level function or a ``functools.partial``) gives a set's score on what
    ``profiles`` makes of its ranks (its profile), ``None`` for a set that cannot hold the model
    (left out).
    """
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width: expected a positive integer, got {width!r}")
    scored: dict[Ranks, float] = {}

    def run(sets: Sequence[Ranks]) -> dict[Ranks, float | None]:
        results = map_fn(score, [profiles(ranks) for ranks in sets], [len(r) for r in sets])
        return dict(zip(sets, results, strict=True))

    def stops(ranks: Ranks) -> bool:
        return bool(scored) and bound[ranks] >= min(scored.values())

    for start in range(0, len(order), width):
        wave = [ranks for ranks in order[start : start + width] if ranks not in scored]
        if wave and stops(wave[0]):
            break
        results = run(wave)
        stopped = False
        for ranks in wave:
            if stops(ranks):
                stopped = True
                break
            value = results[ranks]
            if value is not None:
                scored[ranks] = value
        if stopped:
            break

    def best_zone() -> float:
        return min((scored[z] for z in zones if z in scored), default=float("inf"))

    for start in range(0, len(zones), width):
        wave = [
            z for z in zones[start : start + width] if z not in scored and bound[z] < best_zone()
        ]
        results = run(wave) if wave else {}
        for zone in wave:
            value = results[zone]
            if value is not None and zone not in scored and bound[zone] < best_zone():
                scored[zone] = value
    return scored


def quick_step_time(
    search: Callable[[ClusterProfile], Plan], profile: ClusterProfile
) -> float | None:
    """``search(profile)``'s predicted step seconds (a :func:`score_sets` score, with ``search``
    bound by ``functools.partial``); ``None`` for a device set that cannot hold the model."""
    try:
        return search(profile).predicted_step_time_s
    except ValueError:
        return None
