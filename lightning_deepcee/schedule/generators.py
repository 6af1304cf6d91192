"""Schedule generators: per-stage compute orders for GPipe, 1F1B and ZB-H1.

A generator returns ``dict[stage, list[Action]]`` holding only compute actions (F, B, W, BW).
:func:`~lightning_deepcee.schedule.lowering.lower` then maps stages to ranks and inserts the
send/receive actions. All generators keep exact synchronous semantics: every micro-batch gets one
F and either one BW or one B followed by one W, and the optimizer steps after the whole list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from lightning_deepcee.schedule.actions import Action, ActionKind

__all__ = [
    "SCHEDULE_KINDS",
    "StageSchedule",
    "forward_only",
    "generate",
    "gpipe",
    "one_f_one_b",
    "zb_h1",
]

StageSchedule = dict[int, list[Action]]
"""Compute actions per stage index (before lowering)."""

F, B, W, BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW


def _check(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


def _one_f_one_b_order(p: int, s: int, m: int) -> Iterator[tuple[ActionKind, int]]:
    """Stage ``s``'s 1F1B order of forwards (``F``) and backwards (``B``): ``p - s - 1`` warm-up
    forwards, then one forward before each backward while forwards remain. 1F1B runs each
    backward whole (BW); ZB-H1 splits it and places the W passes."""
    warmup = min(p - s - 1, m)
    yield from ((F, i) for i in range(warmup))
    f_next = warmup
    for b in range(m):
        if f_next < m:
            yield F, f_next
            f_next += 1
        yield B, b


def gpipe(num_stages: int, num_microbatches: int) -> StageSchedule:
    """All forwards, then all backwards (in micro-batch order), on every stage.

    Roughly: ``F0 F1 .. F(m-1) BW0 BW1 .. BW(m-1)``. Peak activation memory is ``m`` micro-batches.
    """
    _check(num_stages, num_microbatches)
    m = num_microbatches
    return {
        s: [Action(s, F, i) for i in range(m)] + [Action(s, BW, i) for i in range(m)]
        for s in range(num_stages)
    }


def one_f_one_b(num_stages: int, num_microbatches: int) -> StageSchedule:
    """1F1B: ``p - s - 1`` warm-up forwards, then alternate F and BW, then drain the BWs.

    Peak activation memory on stage ``s`` is ``min(p - s, m)`` micro-batches.
    """
    _check(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    return {
        s: [Action(s, BW if kind == B else F, i) for kind, i in _one_f_one_b_order(p, s, m)]
        for s in range(p)
    }


def zb_h1(num_stages: int, num_microbatches: int) -> StageSchedule:
    """ZB-H1 (Qi et al. 2024): 1F1B order with the backward split into B and W.

    Stage ``s`` keeps up to ``s`` W passes pending during the steady phase (the first stage runs
    each W right after its B, later stages defer more) and runs one W after every B once its
    forwards are done, so the W work lands where 1F1B leaves the stage waiting for gradients from
    downstream. With equal costs the step takes ``3m + p - 1`` units against 1F1B's
    ``3(m + p - 1)``. Activation memory stays at 1F1B's level plus the
    pending W inputs.
    """
    _check(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    out: StageSchedule = {}
    for s in range(p):
        max_pending_w = s
        acts: list[Action] = []
        forwards = w_next = 0
        for kind, i in _one_f_one_b_order(p, s, m):
            acts.append(Action(s, kind, i))
            if kind == F:
                forwards += 1
            elif i + 1 - w_next > max_pending_w or forwards >= m:
                acts.append(Action(s, W, w_next))
                w_next += 1
        acts.extend(Action(s, W, i) for i in range(w_next, m))
        out[s] = acts
    return out


def forward_only(num_stages: int, num_microbatches: int) -> StageSchedule:
    """Forwards only, in micro-batch order: the evaluation schedule (no backward)."""
    _check(num_stages, num_microbatches)
    return {s: [Action(s, F, i) for i in range(num_microbatches)] for s in range(num_stages)}


_GENERATORS: dict[str, Callable[[int, int], StageSchedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zb-h1": zb_h1,
}
SCHEDULE_KINDS: tuple[str, ...] = tuple(_GENERATORS)

MERGED_BACKWARD_KINDS: frozenset[str] = frozenset(
    kind for kind, gen in _GENERATORS.items() if any(a.kind == BW for a in gen(1, 1)[0])
)
"""Kinds that run each micro-batch's backward as one BW action (the others split it)."""


def generate(kind: str, num_stages: int, num_microbatches: int) -> StageSchedule:
    """Generate the named schedule (one of :data:`SCHEDULE_KINDS`)."""
    try:
        gen = _GENERATORS[kind]
    except KeyError:
        raise ValueError(
            f"Unknown schedule {kind!r}; choose one of {', '.join(SCHEDULE_KINDS)}."
        ) from None
    return gen(num_stages, num_microbatches)
