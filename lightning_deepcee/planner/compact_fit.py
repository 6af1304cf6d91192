"""Fitting the compact zero-bubble schedule to the search's best layouts.

The compact schedule (:func:`~lightning_deepcee.schedule.compact_zero_bubble`) is built from a
layout's own stage and link costs, so it cannot be scored like a generated kind inside the
search: fitting costs a few greedy simulations per candidate. :func:`fit_compact_pool` fits it
once at the end, to the few best distinct layouts, at each micro-batch count and under the
memory limits (one independent call per layout and count), and takes it only where it is
predicted clearly faster. It never predicts worse than ZB-H1 or 1F1B under the same caps.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from lightning_deepcee.planner.candidates import (
    Candidate,
    MapFn,
    SearchContext,
    Structure,
    serial_map,
)
from lightning_deepcee.planner.partition import Ranges
from lightning_deepcee.schedule.compact import compact_zero_bubble, default_max_in_flight

__all__ = ["fit_compact_at", "fit_compact_pool"]

_COMPACT_GAIN = 0.02
"""The compact schedule replaces the generated one only when predicted this much faster (its
actions are fitted to measured costs; a marginal gain is within their noise)."""
_COMPACT_CANDIDATES = 3
"""The compact schedule is fitted to this many of the best distinct layouts (baselines and the
beam's refined orders), not only to the winner under generated schedules: a layout that wins by
a little under the generated schedules can lose once both are fitted."""
_COMPACT_WINDOW = 1.5
"""Micro-batch counts whose best generated schedule is this much slower than the winner are not
fitted (the compact schedule gains at most the bubble)."""


def fit_compact_at(context: SearchContext, job: tuple[Candidate, int]) -> Candidate | None:
    """The compact schedule fitted to the layout of ``scored`` at ``m`` micro-batches
    (``job = (scored, m)``); ``None`` when nothing fits there or the count's generated schedules
    are far behind ``scored``.

    The layout's batch shares come from the best generated schedule at ``m``. The compact
    schedule may hold every micro-batch in flight on every stage; when that does not fit a
    device's memory, as many as ZB-H1 (``min(p, m)``), else as 1F1B.
    """
    scored, m = job
    p = len(scored.structure)
    evaluator = context.evaluator
    structure, ranges = scored.structure, scored.ranges
    evaluated = (context.evaluate(structure, ranges, k, m) for k in context.schedules)
    fitting = [c for c in evaluated if c is not None]
    if not fitting:
        return None
    generated = min(fitting, key=lambda c: c.step_time_s)
    if generated.step_time_s > _COMPACT_WINDOW * scored.step_time_s:
        return None  # far behind at this count: fitting will not close the gap
    b = context.global_batch_size / m
    costs = evaluator.stage_costs(generated.stages, microbatch_size=b)
    # Most micro-batches in flight first (covers the slowest hops), then ZB-H1's, 1F1B's.
    for caps in ([m] * p, [min(p, m)] * p, default_max_in_flight(p, m)):
        schedule = compact_zero_bubble(costs, m, max_in_flight=caps)
        prediction = evaluator.predict(
            generated.stages,
            "compact",
            m,
            context.global_batch_size,
            stage_schedule=schedule,
            breakdown=False,
        )
        if context.memory_check and not prediction.fits_memory:
            continue
        # The larger caps fit: the smaller ones cannot do better.
        return Candidate(
            prediction.step_time_s,
            scored.structure,
            scored.ranges,
            "compact",
            m,
            generated.stages,
            prediction,
            schedule,
        )
    return None


def _fastest(fits: Sequence[Candidate | None]) -> Candidate | None:
    """The fastest of ``fits``; the first of equals (the serial search's tie-break)."""
    best: Candidate | None = None
    for fitted in fits:
        if fitted is not None and (best is None or fitted.step_time_s < best.step_time_s):
            best = fitted
    return best


def fit_compact_pool(
    context: SearchContext,
    pool: Sequence[tuple[str, Candidate]],
    name: str,
    best: Candidate,
    map_fn: MapFn = serial_map,
) -> tuple[str, Candidate, str]:
    """``(name, best, note)`` once the compact schedule is fitted to the pool's best layouts.

    ``pool`` holds named candidates, best first; the first ``_COMPACT_CANDIDATES`` distinct
    layouts are fitted, each micro-batch count in one call of ``map_fn``. A fit replaces ``best``
    when it is predicted ``_COMPACT_GAIN`` faster than its own layout's generated schedule and
    faster than ``best``; the note then compares the two (empty otherwise).
    """
    layouts: list[tuple[str, Candidate]] = []
    seen: set[tuple[Structure, Ranges]] = set()
    for kind, scored in pool:
        layout = (scored.structure, scored.ranges)
        if layout not in seen:
            seen.add(layout)
            layouts.append((kind, scored))
        if len(layouts) == _COMPACT_CANDIDATES:
            break
    # A layout that needed more micro-batches than the search's counts to fit is fitted there.
    counts = {
        id(scored): sorted({*context.microbatch_counts, scored.num_microbatches})
        for _, scored in layouts
    }
    jobs = [
        (scored, m)
        for _, scored in layouts
        if len(scored.structure) > 1
        for m in counts[id(scored)]
    ]
    # A fit simulates the schedule's m micro-batches on each of its greedy steps: about m^2.
    costs = [float(m * m) for _, m in jobs]
    fits = iter(map_fn(functools.partial(fit_compact_at, context), jobs, costs))
    note = ""
    for kind, scored in layouts:
        if len(scored.structure) < 2:
            continue
        fitted = _fastest([next(fits) for _ in counts[id(scored)]])
        if (
            fitted is not None
            and fitted.step_time_s < scored.step_time_s * (1 - _COMPACT_GAIN)
            and fitted.step_time_s < best.step_time_s
        ):
            note = (
                f"; compact schedule (m={fitted.num_microbatches}) "
                f"{fitted.step_time_s * 1e3:.2f} ms vs {scored.schedule} "
                f"(m={scored.num_microbatches}) {scored.step_time_s * 1e3:.2f} ms"
            )
            name, best = kind, fitted
    return name, best, note
