"""The compact zero-bubble schedule: a cost-aware generator for heterogeneous stages and links.

:func:`compact_zero_bubble` takes per-stage F/B/W costs and per-link transfer times
(:class:`~lightning_deepcee.schedule.simulate.StageCosts`) and a per-stage cap on the
micro-batches in flight (activations held from F to W), and returns compute actions per stage,
like the generators in :mod:`~lightning_deepcee.schedule.generators`.

How it works:

1. **Greedy list scheduling over a discrete-event simulation** (in the spirit of the zero-bubble
   paper's automatic scheduler, with a transfer time per link instead of one scalar). The stage
   that can act earliest acts next; when idle it picks among its ready actions by priority
   ``B`` (critical path) > ``F`` (only under its in-flight cap, and only once the activation has
   arrived) > ``W`` (fills the gap). F, B and W each stay in micro-batch order on a stage, so the
   messages on every link arrive in the order they are received. Readiness uses the FIFO link
   model of :func:`~lightning_deepcee.schedule.simulate.simulate`.
2. **Variants**: the greedy runs with several *soft* in-flight caps (from 1F1B's ``p - s`` up to
   the hard cap, plus one sized from each stage's round trip to the last stage), with B or F
   first, and with W either filling every gap or waiting for a B/F that is known to arrive
   before the W would end.
3. **Baselines**: split 1F1B (1F1B with BW replaced by B then W), ZB-H1 and split GPipe join the
   candidates whenever they fit the caps.
4. **Local search**: the best candidate is improved by moving single W actions to other legal
   positions while the simulated step time drops (bounded number of passes).

The candidate with the smallest simulated step time wins (ties: fewer micro-batches in flight).
Split 1F1B always fits the default caps, so the result is never slower than 1F1B under the same
costs; ZB-H1 holds up to ``min(p, m)`` micro-batches in flight on stage ``s`` (its deferred W
keep activations alive), so the result is never slower than ZB-H1 whenever the caps allow that
(for example ``max_in_flight=[m] * p``).

Roughly::

    costs = StageCosts(forward_s=(1, 2, 1), backward_input_s=(1, 2, 1),
                       backward_weight_s=(1, 2, 1), activation_bytes=(0, 0, 0),
                       send_forward_s=(0.1, 3.0), send_backward_s=(0.1, 3.0))
    schedule = compact_zero_bubble(costs, 8)
    lowered = lower(schedule, {s: s for s in range(3)})
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_deepcee.schedule import generators
from lightning_deepcee.schedule.actions import Action, ActionKind
from lightning_deepcee.schedule.compiled import compile_stage_schedule, move_compute
from lightning_deepcee.schedule.generators import StageSchedule
from lightning_deepcee.schedule.simulate import StageCosts, compiled_step_time, simulate_stages

__all__ = [
    "COST_AWARE_SCHEDULE_KINDS",
    "compact_zero_bubble",
    "default_max_in_flight",
    "generate_for_costs",
    "in_flight_peak",
    "simulated_step_time",
    "split_backward",
]

F, B, W, BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW

COST_AWARE_SCHEDULE_KINDS: tuple[str, ...] = (*generators.SCHEDULE_KINDS, "compact")
"""Kinds :func:`generate_for_costs` knows: the cost-free generators plus ``"compact"``."""

_EPS = 1e-12
_LOCAL_SEARCH_PASSES = 2
_LOCAL_SEARCH_MAX_ACTIONS = 600
"""Skip the local search above this many compute actions (it is quadratic)."""


def default_max_in_flight(num_stages: int, num_microbatches: int) -> list[int]:
    """1F1B's in-flight count per stage: ``min(p - s, m)`` micro-batches on stage ``s``."""
    return [min(num_stages - s, num_microbatches) for s in range(num_stages)]


def in_flight_peak(schedule: StageSchedule) -> dict[int, int]:
    """Peak micro-batches in flight per stage: F seen minus W/BW seen, over every prefix."""
    out: dict[int, int] = {}
    for stage, actions in schedule.items():
        current = peak = 0
        for a in actions:
            if a.kind == F:
                current += 1
                peak = max(peak, current)
            elif a.kind in (W, BW):
                current -= 1
        out[stage] = peak
    return out


def split_backward(schedule: StageSchedule) -> StageSchedule:
    """Replace every ``BW`` by ``B`` then ``W`` of the same micro-batch (same order, same time)."""
    out: StageSchedule = {}
    for stage, actions in schedule.items():
        acts: list[Action] = []
        for a in actions:
            if a.kind == BW:
                acts += [Action(a.stage, B, a.microbatch), Action(a.stage, W, a.microbatch)]
            else:
                acts.append(a)
        out[stage] = acts
    return out


def simulated_step_time(schedule: StageSchedule, costs: StageCosts, num_microbatches: int) -> float:
    """Step time of ``schedule`` with one stage per rank (identity placement), by
    :func:`~lightning_deepcee.schedule.simulate.simulate_stages`."""
    return simulate_stages(schedule, costs, num_microbatches=num_microbatches).step_time_s


def _check_caps(
    max_in_flight: Sequence[int] | None, num_stages: int, num_microbatches: int
) -> tuple[int, ...]:
    if max_in_flight is None:
        return tuple(default_max_in_flight(num_stages, num_microbatches))
    caps = list(max_in_flight)
    if len(caps) != num_stages:
        raise ValueError(
            f"max_in_flight has {len(caps)} entries but there are {num_stages} stages; give one "
            "cap per stage (1F1B needs min(p - s, m) on stage s)."
        )
    for s, cap in enumerate(caps):
        if int(cap) != cap or cap < 1:
            raise ValueError(
                f"max_in_flight[{s}] = {cap}; every cap must be an integer >= 1 (1F1B needs "
                f"{min(num_stages - s, num_microbatches)} on stage {s})."
            )
    return tuple(min(int(c), num_microbatches) for c in caps)


@dataclass(frozen=True, slots=True)
class _Variant:
    """One setting of the greedy list scheduler."""

    soft_caps: tuple[int, ...]
    """In-flight limit per stage the greedy keeps to (at most the hard cap)."""
    backward_first: bool
    """Prefer a ready B over a ready F (else F over B)."""
    wait_for_critical: bool
    """Idle instead of starting a W when a B/F is known to arrive before the W would end."""


class _Greedy:
    """One run of the list scheduler; :meth:`run` returns the per-stage compute order."""

    def __init__(self, costs: StageCosts, num_microbatches: int, variant: _Variant) -> None:
        p, m = costs.num_stages, num_microbatches
        self.costs, self.m, self.p, self.variant = costs, m, p, variant
        self.scale = costs.microbatch_scale or (1.0,) * m
        self.free = [0.0] * p
        self.nf, self.nb, self.nw = [0] * p, [0] * p, [0] * p
        self.act_arrival: list[list[float | None]] = [[None] * m for _ in range(p)]
        self.grad_arrival: list[list[float | None]] = [[None] * m for _ in range(p)]
        self.link_fwd = [0.0] * max(p - 1, 0)
        self.link_bwd = [0.0] * max(p - 1, 0)
        self.out: StageSchedule = {s: [] for s in range(p)}

    def _b_ready(self, s: int) -> float | None:
        if self.nb[s] >= self.nf[s]:
            return None
        if s == self.p - 1:
            return self.free[s]
        return self.grad_arrival[s][self.nb[s]]

    def _f_ready(self, s: int) -> float | None:
        if self.nf[s] >= self.m or self.nf[s] - self.nw[s] >= self.variant.soft_caps[s]:
            return None
        if s == 0:
            return 0.0
        return self.act_arrival[s][self.nf[s]]

    def _decide(self, s: int) -> tuple[float, ActionKind | None]:
        """Earliest time stage ``s`` can act on what is known now, and what it would run then."""
        if self.nw[s] >= self.m:
            return math.inf, None
        now = self.free[s]
        b_at, f_at = self._b_ready(s), self._f_ready(s)
        known = [t for t in (b_at, f_at) if t is not None]
        w_ok = self.nw[s] < self.nb[s]
        if w_ok:
            soonest = min(known, default=math.inf)
            if soonest <= now + _EPS:
                start = now
            else:
                w_end = now + self.costs.backward_weight_s[s] * self.scale[self.nw[s]]
                wait = self.variant.wait_for_critical and soonest < w_end - _EPS
                if not wait:
                    return now, W
                start = soonest
        elif known:
            start = max(now, min(known))
        else:
            return math.inf, None
        b_in = b_at is not None and b_at <= start + _EPS
        f_in = f_at is not None and f_at <= start + _EPS
        order = [(b_in, B), (f_in, F)] if self.variant.backward_first else [(f_in, F), (b_in, B)]
        for ready, kind in order:
            if ready:
                return start, kind
        return start, W

    def run(self) -> StageSchedule:
        c, p = self.costs, self.p
        # A stage's decision reads only its own state and the arrivals from its neighbours, so
        # after stage s acts only s and s +- 1 decide anew.
        decisions = [self._decide(s) for s in range(p)]
        for _ in range(3 * self.m * p):
            best_t, best_s, best_kind = math.inf, -1, None
            # Later stages first on ties: their B is nearer the end of the critical path.
            for s in reversed(range(p)):
                t, kind = decisions[s]
                if t < best_t - _EPS:
                    best_t, best_s, best_kind = t, s, kind
            if best_kind is None:  # pragma: no cover - the caps are >= 1, so this cannot happen
                raise RuntimeError("compact schedule: greedy scheduler made no progress")
            s, kind = best_s, best_kind
            if kind == F:
                mb = self.nf[s]
                self.nf[s] += 1
                cost = c.forward_s[s]
            elif kind == B:
                mb = self.nb[s]
                self.nb[s] += 1
                cost = c.backward_input_s[s]
            else:
                mb = self.nw[s]
                self.nw[s] += 1
                cost = c.backward_weight_s[s]
            end = best_t + cost * self.scale[mb]
            self.free[s] = end
            self.out[s].append(Action(s, kind, mb))
            if kind == F and s < p - 1:
                start = max(end, self.link_fwd[s])
                self.link_fwd[s] = start + c.send_forward_s[s] * self.scale[mb]
                self.act_arrival[s + 1][mb] = self.link_fwd[s]
            elif kind == B and s > 0:
                start = max(end, self.link_bwd[s - 1])
                self.link_bwd[s - 1] = start + c.send_backward_s[s - 1] * self.scale[mb]
                self.grad_arrival[s - 1][mb] = self.link_bwd[s - 1]
            for t in range(max(s - 1, 0), min(s + 2, p)):
                decisions[t] = self._decide(t)
        return self.out


def _round_trip_caps(costs: StageCosts, num_microbatches: int) -> list[int]:
    """In-flight count per stage that covers its round trip to the last stage in steady state.

    Between F(i) and B(i) stage ``s`` waits for the downstream F and B and both transfers on each
    link; in that time it can start one micro-batch per bottleneck period.
    """
    p, c = costs.num_stages, costs
    per_stage = [c.forward_s[s] + c.backward_input_s[s] + c.backward_weight_s[s] for s in range(p)]
    links = [max(c.send_forward_s[s], c.send_backward_s[s]) for s in range(p - 1)]
    period = max([*per_stage, *links, _EPS])
    caps = []
    for s in range(p):
        trip = sum(c.forward_s[t] + c.backward_input_s[t] for t in range(s + 1, p))
        trip += sum(c.send_forward_s[t] + c.send_backward_s[t] for t in range(s, p - 1))
        caps.append(min(num_microbatches, 1 + math.ceil(trip / period - _EPS)))
    return caps


def _variants(costs: StageCosts, num_microbatches: int, caps: tuple[int, ...]) -> list[_Variant]:
    p, m = costs.num_stages, num_microbatches
    base = default_max_in_flight(p, m)
    extras = sorted({0, 1, 2, 3, m} | {2**k for k in range(2, max(m, 1).bit_length() + 1)})
    soft: list[tuple[int, ...]] = []
    for k in extras:
        soft.append(tuple(max(1, min(caps[s], base[s] + k)) for s in range(p)))
    trip = _round_trip_caps(costs, m)
    soft.append(tuple(max(1, min(caps[s], max(trip[s], base[s]))) for s in range(p)))
    soft.append(tuple(max(1, min(caps[s], trip[s])) for s in range(p)))
    unique = list(dict.fromkeys(soft))
    return [
        _Variant(sc, backward_first, wait)
        for sc in unique
        for backward_first in (True, False)
        for wait in (False, True)
    ]


def _fits(schedule: StageSchedule, caps: Sequence[int]) -> bool:
    peaks = in_flight_peak(schedule)
    return all(peaks[s] <= caps[s] for s in range(len(caps)))


def _w_moves(schedule: StageSchedule) -> list[tuple[int, int, int]]:
    """Legal single-W moves ``(stage, from, to)``: after its B, keeping W order."""
    moves = []
    for s, acts in schedule.items():
        for i, a in enumerate(acts):
            if a.kind != W:
                continue
            lo = 0
            hi = len(acts) - 1
            for j in range(i - 1, -1, -1):
                prev = acts[j]
                if (prev.kind == B and prev.microbatch == a.microbatch) or prev.kind == W:
                    lo = j + 1
                    break
            for j in range(i + 1, len(acts)):
                if acts[j].kind == W:
                    hi = j - 1
                    break
            moves += [(s, i, t) for t in range(lo, hi + 1) if t != i]
    return moves


def _w_in_place(acts: Sequence[Action], at: int) -> bool:
    """Whether the W at ``at`` follows its B and keeps the Ws in micro-batch order."""
    mb = acts[at].microbatch
    if not any(a.kind == B and a.microbatch == mb for a in acts[:at]):
        return False
    before = [a.microbatch for a in acts[:at] if a.kind == W]
    after = [a.microbatch for a in acts[at + 1 :] if a.kind == W]
    return all(b < mb for b in before) and all(a > mb for a in after)


def _local_search(
    schedule: StageSchedule,
    best_time: float,
    costs: StageCosts,
    num_microbatches: int,
    caps: Sequence[int],
) -> tuple[StageSchedule, float]:
    """First-improvement moves of single W actions, a bounded number of passes. Each trial is
    the current compiled program with one W moved (:func:`move_compute`), timed without its
    memory peak (the caps bound it)."""
    compiled = compile_stage_schedule(schedule)
    if compiled is None or sum(len(a) for a in schedule.values()) > _LOCAL_SEARCH_MAX_ACTIONS:
        return schedule, best_time
    for _ in range(_LOCAL_SEARCH_PASSES):
        improved = False
        for s, i, t in _w_moves(schedule):
            acts = list(schedule[s])
            if i >= len(acts) or acts[i].kind != W:
                continue
            acts.insert(t, acts.pop(i))
            if not _w_in_place(acts, t) or in_flight_peak({s: acts})[s] > caps[s]:
                continue  # the moves were listed before an earlier move of this pass
            moved = move_compute(compiled, s, i, t)
            time = compiled_step_time(moved, costs, num_microbatches)
            if time is not None and time < best_time - 1e-9:
                schedule, compiled, best_time, improved = {**schedule, s: acts}, moved, time, True
        if not improved:
            break
    return schedule, best_time


def compact_zero_bubble(
    costs: StageCosts,
    num_microbatches: int,
    *,
    max_in_flight: Sequence[int] | None = None,
) -> StageSchedule:
    """A zero-bubble schedule fitted to heterogeneous stage and link costs.

    Args:
        costs: per-stage F/B/W seconds and per-link transfer seconds (``activation_bytes`` is not
            used; the memory limit is ``max_in_flight``). ``microbatch_scale`` is honoured.
        num_microbatches: micro-batches per optimizer step (``m``).
        max_in_flight: per stage, the most micro-batches whose activations are held at once (from
            F to W). Defaults to 1F1B's ``min(p - s, m)``; values above ``m`` mean ``m``.

    Returns:
        Compute actions per stage (F, B and W of every micro-batch; F, B and W each in
        micro-batch order), ready for :func:`~lightning_deepcee.schedule.lowering.lower`. Its
        simulated step time is never above split 1F1B's, ZB-H1's or GPipe's whenever that
        baseline fits ``max_in_flight`` (split 1F1B always fits the default).

    Raises:
        ValueError: ``num_microbatches < 1``, ``max_in_flight`` has the wrong length or a cap
            below 1.
    """
    p, m = costs.num_stages, num_microbatches
    if m < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {m}.")
    if costs.microbatch_scale is not None and len(costs.microbatch_scale) != m:
        raise ValueError(
            f"StageCosts.microbatch_scale has {len(costs.microbatch_scale)} entries but "
            f"num_microbatches is {m}; give one scale per micro-batch."
        )
    caps = _check_caps(max_in_flight, p, m)
    candidates: list[StageSchedule] = [
        split_backward(generators.one_f_one_b(p, m)),
        generators.zb_h1(p, m),
        split_backward(generators.gpipe(p, m)),
    ]
    candidates += [_Greedy(costs, m, v).run() for v in _variants(costs, m, caps)]
    best: StageSchedule | None = None
    best_key = (math.inf, math.inf)
    for cand in candidates:
        if not _fits(cand, caps) or not _in_order(cand):
            continue
        time = simulated_step_time(cand, costs, m)
        key = (time, float(sum(in_flight_peak(cand).values())))
        if key[0] < best_key[0] - 1e-12 or (abs(key[0] - best_key[0]) <= 1e-12 and key < best_key):
            best, best_key = cand, key
    if best is None:  # pragma: no cover - the greedy always fits its own caps
        raise RuntimeError("compact schedule: no candidate fits the in-flight caps")
    searched, _ = _local_search(best, best_key[0], costs, m, caps)
    return searched if _in_order(searched) else best


def _in_order(schedule: StageSchedule) -> bool:
    """Whether every stage runs its Fs, its Bs and its Ws each in micro-batch order."""
    for acts in schedule.values():
        for kind in (F, B, W):
            mbs = [a.microbatch for a in acts if a.kind == kind]
            if mbs != sorted(mbs):
                return False
    return True


def generate_for_costs(
    kind: str, costs: StageCosts, num_microbatches: int, **kwargs: Any
) -> StageSchedule:
    """Generate a schedule of any kind in :data:`COST_AWARE_SCHEDULE_KINDS` for ``costs``.

    ``"compact"`` calls :func:`compact_zero_bubble` (``kwargs`` go to it); the other kinds ignore
    the costs apart from the stage count and call
    :func:`~lightning_deepcee.schedule.generators.generate` (they take no ``kwargs``).
    """
    if kind == "compact":
        return compact_zero_bubble(costs, num_microbatches, **kwargs)
    if kind not in generators.SCHEDULE_KINDS:
        raise ValueError(
            f"Unknown schedule {kind!r}; choose one of {', '.join(COST_AWARE_SCHEDULE_KINDS)}."
        )
    if kwargs:
        raise TypeError(f"schedule {kind!r} takes no options, got {sorted(kwargs)}")
    return generators.generate(kind, costs.num_stages, num_microbatches)
