"""Discrete-event simulation of a lowered schedule: step time, bubbles, memory and a trace.

This module owns the timing model the planner uses to compare schedules before anything runs:

- a rank runs its actions in order; F, B, W and BW take their per-stage cost (``BW``: its own
  ``backward_s`` where given, else B + W);
- a SEND costs the sender nothing (the runtime sends asynchronously) and occupies the directed
  link ``(src_rank, dst_rank)`` for its transfer time, first in first out: a message starts when
  both the sender has reached the SEND and the previous message on that link has arrived;
- a RECV blocks its rank until the matching message has fully arrived;
- a (stage, micro-batch) holds its activations from the start of its F to the end of its W or BW;
  while a rank computes F, B, W or BW it also needs its stage's transient bytes on top;
- **CPU quotas** (``StageCosts.cpu_share`` and ``cpu_period_s``): a device limited to a share of
  a core (a container's CPU limit; Linux CFS lets it run ``share * period`` seconds each period
  at full speed, then stalls it) takes the given times when it computes without pause, but what
  it does not use while it waits lets its next actions run at full speed: a token bucket that
  earns ``share`` seconds of full speed per second and holds at most one period's budget
  (:meth:`_Simulator._compute_end`). A pipeline's short bubbles then cost such a device
  nothing: the device catches up after them, so a step can shrink to its busiest device's
  compute time, where a model without the bucket would add the bubbles on top.

Latency is folded into the transfer time (it occupies the link), and a send does not wait for
the receiver to post its receive; both are deliberate simplifications of the real transport.

Roughly::

    costs = StageCosts.uniform(4, forward_s=1.0, send_s=0.1)
    rank_schedule = lower(generate("1f1b", 4, 8), {s: s for s in range(4)})
    result = simulate(rank_schedule, {s: s for s in range(4)}, costs, num_microbatches=8)
    result.step_time_s, result.bubble_ratio
    result.write_chrome_trace("trace.json")  # open in https://ui.perfetto.dev
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_deepcee.schedule.actions import Action, ActionKind
from lightning_deepcee.schedule.compiled import (
    CompiledSchedule,
    compile_schedule,
    compile_stage_schedule,
    compiled_peak_memory,
    quota_end,
    run_compiled,
)
from lightning_deepcee.schedule.generators import StageSchedule
from lightning_deepcee.schedule.lowering import lower
from lightning_deepcee.schedule.render import render
from lightning_deepcee.schedule.validate import ScheduleError

__all__ = [
    "SimEvent",
    "SimulationResult",
    "StageCosts",
    "compiled_step_time",
    "simulate",
    "simulate_stages",
]

K = ActionKind
_MessageKey = tuple[ActionKind, int, int]
"""(SEND kind, sending stage, micro-batch): identifies one message."""


def _check_values(name: str, values: Sequence[float], length: int, *, positive: bool) -> None:
    if len(values) != length:
        raise ValueError(f"StageCosts.{name} has {len(values)} entries, expected {length}.")
    for i, v in enumerate(values):
        bad = not math.isfinite(v) or v < 0 or (positive and v == 0)
        if bad:
            want = "> 0" if positive else ">= 0"
            raise ValueError(
                f"StageCosts.{name}[{i}] = {v}; every entry must be finite and {want}."
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCosts:
    """Per-stage compute, transfer and memory costs of one micro-batch."""

    forward_s: tuple[float, ...]
    """Seconds of F on each stage."""
    backward_input_s: tuple[float, ...]
    """Seconds of B (gradient w.r.t. the stage input) on each stage."""
    backward_weight_s: tuple[float, ...]
    """Seconds of W (gradient w.r.t. the weights) on each stage."""
    activation_bytes: tuple[float, ...]
    """Bytes one micro-batch's saved activations hold on each stage, from its F to its W/BW."""
    send_forward_s: tuple[float, ...]
    """Seconds to move one activation from stage ``s`` to ``s + 1``; ``num_stages - 1`` entries."""
    send_backward_s: tuple[float, ...]
    """Seconds to move one gradient from stage ``s + 1`` to ``s``; ``num_stages - 1`` entries."""
    static_memory_bytes: tuple[float, ...] | None = None
    """Bytes each stage holds all step (weights, gradients, optimizer state); None means 0."""
    transient_bytes: tuple[float, ...] | None = None
    """Bytes each stage needs beyond its held activations while it computes one micro-batch's F,
    B, W or BW (intermediates, gradients); scaled like ``activation_bytes``. None means 0."""
    microbatch_scale: tuple[float, ...] | None = None
    """Micro-batch ``i``'s compute, transfer and activation costs are multiplied by ``scale[i]``
    (unequal micro-batch sizes); None means all 1."""
    cpu_share: tuple[float, ...] | None = None
    """Per stage, the fraction of a core its device may use under a CPU quota, in (0, 1] (see
    *CPU quotas* in the module docstring); None, or 1, means no quota. Give with
    ``cpu_period_s``."""
    cpu_period_s: tuple[float, ...] | None = None
    """Per stage, that quota's period in seconds; None, or 0, means no quota."""
    backward_s: tuple[float, ...] | None = None
    """Seconds of a BW action (the whole backward in one pass) on each stage; None means B + W.
    One pass over the graph costs less than B then W on a CPU."""

    def __post_init__(self) -> None:
        p = len(self.forward_s)
        if p < 1:
            raise ValueError("StageCosts.forward_s is empty; give one entry per stage.")
        per_stage = ["forward_s", "backward_input_s", "backward_weight_s", "activation_bytes"]
        for name in ("static_memory_bytes", "transient_bytes", "backward_s"):
            if getattr(self, name) is not None:
                per_stage.append(name)
        for name in [*per_stage, "send_forward_s", "send_backward_s", "microbatch_scale"]:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(float(v) for v in value))
        for name in per_stage:
            _check_values(name, getattr(self, name), p, positive=False)
        _check_values("send_forward_s", self.send_forward_s, p - 1, positive=False)
        _check_values("send_backward_s", self.send_backward_s, p - 1, positive=False)
        if self.microbatch_scale is not None:
            scale = self.microbatch_scale
            _check_values("microbatch_scale", scale, len(scale), positive=True)
        if (self.cpu_share is None) != (self.cpu_period_s is None):
            raise ValueError(
                "StageCosts.cpu_share and cpu_period_s go together: give both (one entry per "
                "stage) or neither."
            )
        if self.cpu_share is not None and self.cpu_period_s is not None:
            object.__setattr__(self, "cpu_share", tuple(float(v) for v in self.cpu_share))
            object.__setattr__(self, "cpu_period_s", tuple(float(v) for v in self.cpu_period_s))
            _check_values("cpu_share", self.cpu_share, p, positive=True)
            _check_values("cpu_period_s", self.cpu_period_s, p, positive=False)
            if max(self.cpu_share) > 1.0:
                raise ValueError(
                    f"StageCosts.cpu_share = {self.cpu_share}; each entry is a fraction of a core "
                    "in (0, 1]."
                )

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages these costs describe."""
        return len(self.forward_s)

    @property
    def merged_backward_s(self) -> tuple[float, ...]:
        """Seconds of a BW action on each stage: ``backward_s``, else B + W."""
        if self.backward_s is not None:
            return self.backward_s
        pairs = zip(self.backward_input_s, self.backward_weight_s, strict=True)
        return tuple(b + w for b, w in pairs)

    @classmethod
    def uniform(
        cls,
        num_stages: int,
        *,
        forward_s: float = 1.0,
        backward_input_s: float = 1.0,
        backward_weight_s: float = 1.0,
        activation_bytes: float = 0.0,
        send_s: float = 0.0,
    ) -> StageCosts:
        """The same costs on every stage and link (the textbook setting of GPipe/1F1B/ZB-H1)."""
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}.")
        p = num_stages
        return cls(
            forward_s=(forward_s,) * p,
            backward_input_s=(backward_input_s,) * p,
            backward_weight_s=(backward_weight_s,) * p,
            activation_bytes=(activation_bytes,) * p,
            send_forward_s=(send_s,) * (p - 1),
            send_backward_s=(send_s,) * (p - 1),
        )


@dataclass(frozen=True, slots=True)
class SimEvent:
    """One interval of the simulated step.

    A compute action runs on ``rank``; a transfer (``action`` is a SEND) runs on the directed link
    from ``rank`` to ``peer_rank``.
    """

    rank: int
    action: Action
    start_s: float
    end_s: float
    peer_rank: int | None = None

    @property
    def is_transfer(self) -> bool:
        """True for a message on a link, False for compute on a rank."""
        return self.peer_rank is not None

    @property
    def duration_s(self) -> float:
        """Length of the interval in seconds."""
        return self.end_s - self.start_s


@dataclass(frozen=True, kw_only=True, slots=True)
class SimulationResult:
    """What one simulated optimizer step looks like."""

    step_time_s: float
    """Time from the first action to the last rank finishing (and the last message arriving)."""
    per_rank_busy_s: dict[int, float]
    """Compute seconds per rank (waiting and sending excluded)."""
    bubble_ratio: float
    """``1 - total busy / (num_ranks * step_time)``: the share of rank-time spent idle."""
    peak_memory_bytes: dict[int, int]
    """Static memory plus the peak of concurrently held activations (with the transient bytes of
    the action computing then), per rank."""
    events: tuple[SimEvent, ...] = field(default=())
    """Compute events and transfers, sorted by start time."""

    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome trace-event JSON (loads in Perfetto and chrome://tracing).

        One process per rank; thread 0 is compute and threads 1, 2, ... are that rank's outgoing
        links (one per destination rank, so concurrent sends to two neighbours do not overlap on
        one track). Times are in microseconds.
        """
        link_tid: dict[tuple[int, int], int] = {}
        for ev in self.events:
            if ev.peer_rank is not None:
                link_tid.setdefault((ev.rank, ev.peer_rank), 0)
        per_rank: dict[int, int] = defaultdict(int)
        for src, dst in sorted(link_tid):
            per_rank[src] += 1
            link_tid[(src, dst)] = per_rank[src]
        out: list[dict[str, Any]] = []
        for rank in sorted(self.per_rank_busy_s):
            out.append(_meta("process_name", rank, 0, f"rank {rank}"))
            out.append(_meta("thread_name", rank, 0, "compute"))
        for (src, dst), tid in sorted(link_tid.items()):
            out.append(_meta("thread_name", src, tid, f"send to rank {dst}"))
        for ev in self.events:
            tid = 0 if ev.peer_rank is None else link_tid[(ev.rank, ev.peer_rank)]
            args: dict[str, Any] = {"stage": ev.action.stage, "microbatch": ev.action.microbatch}
            if ev.peer_rank is not None:
                args["to_rank"] = ev.peer_rank
            out.append(
                {
                    "name": str(ev.action),
                    "cat": "transfer" if ev.is_transfer else "compute",
                    "ph": "X",
                    "pid": ev.rank,
                    "tid": tid,
                    "ts": ev.start_s * 1e6,
                    "dur": ev.duration_s * 1e6,
                    "args": args,
                }
            )
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_chrome_trace` as JSON to ``path``."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_chrome_trace(), f)


def _meta(name: str, pid: int, tid: int, label: str) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {"name": label}}


class _Simulator:
    """Mutable state of one run; :func:`simulate` is the public face."""

    def __init__(
        self,
        schedule: Mapping[int, Sequence[Action]],
        stage_to_rank: Mapping[int, int],
        costs: StageCosts,
        scale: Sequence[float],
        record: bool = True,
    ) -> None:
        self.schedule = schedule
        self.record = record
        self.last_end = 0.0
        """The latest end of any action or transfer (the step's end, with the clocks)."""
        self.stage_to_rank = stage_to_rank
        self.costs = costs
        self.scale = scale
        self.pos = {r: 0 for r in schedule}
        self.clock = {r: 0.0 for r in schedule}
        self.busy = {r: 0.0 for r in schedule}
        self.link_free: dict[tuple[int, int], float] = defaultdict(float)
        self.arrival: dict[_MessageKey, float] = {}
        self.events: list[SimEvent] = []
        self.credit: dict[int, tuple[float, float]] = {}
        """Per rank under a CPU quota: (end of its last compute action, full-speed seconds
        banked then); see :meth:`_compute_end`."""

    def run(self) -> None:
        # A directed link has one sender, whose sends are in program order, so FIFO order on a
        # link never depends on how ranks interleave here: advancing each rank as far as it can,
        # round after round, gives the same times as a global event queue.
        progressed = True
        while progressed:
            progressed = False
            for rank in self.schedule:
                while self.pos[rank] < len(self.schedule[rank]) and self._step(rank):
                    self.pos[rank] += 1
                    progressed = True
        stuck = [r for r in self.schedule if self.pos[r] < len(self.schedule[r])]
        if stuck:
            raise self._deadlock(stuck)

    def _step(self, rank: int) -> bool:
        """Run the next action of ``rank``; False if it is a receive whose message is not sent."""
        a = self.schedule[rank][self.pos[rank]]
        s, mb, c = a.stage, a.microbatch, self.costs
        if a.kind in (K.RECV_F, K.RECV_B):
            arrival = self.arrival.get(_awaited(a))
            if arrival is None:
                return False
            self.clock[rank] = max(self.clock[rank], arrival)
        elif a.kind in (K.SEND_F, K.SEND_B):
            peer = self.stage_to_rank[s + 1 if a.kind == K.SEND_F else s - 1]
            hop = c.send_forward_s[s] if a.kind == K.SEND_F else c.send_backward_s[s - 1]
            start = max(self.clock[rank], self.link_free[(rank, peer)])
            end = start + hop * self.scale[mb]
            self.link_free[(rank, peer)] = end
            self.arrival[(a.kind, s, mb)] = end
            self.last_end = max(self.last_end, end)
            if self.record:
                self.events.append(SimEvent(rank, a, start, end, peer))
        else:
            if a.kind == K.F:
                seconds = c.forward_s[s]
            elif a.kind == K.B:
                seconds = c.backward_input_s[s]
            elif a.kind == K.W:
                seconds = c.backward_weight_s[s]
            else:  # K.BW
                seconds = c.merged_backward_s[s]
            seconds *= self.scale[mb]
            start = self.clock[rank]
            end = self._compute_end(rank, s, start, seconds)
            self.clock[rank] = end
            self.busy[rank] += end - start
            self.last_end = max(self.last_end, end)
            if self.record:
                self.events.append(SimEvent(rank, a, start, end))
        return True

    def _compute_end(self, rank: int, stage: int, start: float, seconds: float) -> float:
        """When ``seconds`` of compute (at the sustained speed) that starts at ``start`` ends.

        Without a quota: ``start + seconds``. Under a quota of ``share`` of a core with period
        ``P`` the action is ``seconds * share`` of full-speed work, and the rank banks credit,
        a token bucket: it earns ``share`` seconds of full speed per second (waiting or not),
        spends one per second at full speed, and holds at most ``share * P``, a period's
        budget. With credit it runs at full speed; without, at ``share``. The bucket is empty
        at the step's start (the step before kept the device busy to its end).
        """
        costs = self.costs
        if costs.cpu_share is None or costs.cpu_period_s is None:
            return start + seconds
        share, period = costs.cpu_share[stage], costs.cpu_period_s[stage]
        if share >= 1.0 or period <= 0.0:
            return start + seconds
        last_end, credit = self.credit.get(rank, (0.0, 0.0))
        end, credit = quota_end(share, period, last_end, credit, start, seconds)
        self.credit[rank] = (end, credit)
        return end

    def _deadlock(self, stuck: list[int]) -> ScheduleError:
        senders = {(a.kind, a.stage, a.microbatch) for acts in self.schedule.values() for a in acts}
        parts = []
        for r in stuck:
            a = self.schedule[r][self.pos[r]]
            kind, stage, mb = _awaited(a)
            src = self.stage_to_rank.get(stage, "?")
            why = "" if (kind, stage, mb) in senders else " (no rank ever sends it)"
            parts.append(
                f"rank {r} at {a} (position {self.pos[r]}) waits for {stage}{kind.value}{mb} "
                f"from rank {src}{why}"
            )
        first = stuck[0]
        return ScheduleError(
            f"deadlock: {'; '.join(parts)}. Reorder the compute actions so that every receive's "
            f"message is sent earlier on its peer (validate() checks this without costs).\n"
            f"{render(self.schedule, mark=(first, self.pos[first]))}"
        )


def _awaited(recv: Action) -> _MessageKey:
    """The message a RECV waits for."""
    if recv.kind == K.RECV_F:
        return (K.SEND_F, recv.stage - 1, recv.microbatch)
    return (K.SEND_B, recv.stage + 1, recv.microbatch)


def _check_inputs(
    schedule: Mapping[int, Sequence[Action]],
    stage_to_rank: Mapping[int, int],
    costs: StageCosts,
    num_microbatches: int,
) -> None:
    p = costs.num_stages
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}.")
    scale = costs.microbatch_scale
    if scale is not None and len(scale) != num_microbatches:
        raise ValueError(
            f"StageCosts.microbatch_scale has {len(scale)} entries but num_microbatches is "
            f"{num_microbatches}; give one scale per micro-batch."
        )
    missing = [s for s in range(p) if s not in stage_to_rank]
    if missing:
        raise ValueError(f"stage_to_rank has no rank for stages {missing} (costs cover {p}).")
    for rank, actions in schedule.items():
        for pos, a in enumerate(actions):
            if a.stage >= p or a.microbatch >= num_microbatches:
                raise ScheduleError(
                    f"{a} is out of range for {p} stages and {num_microbatches} micro-batches\n"
                    f"{render(schedule, mark=(rank, pos))}"
                )
            if stage_to_rank[a.stage] != rank:
                raise ScheduleError(
                    f"{a} is on rank {rank} but stage {a.stage} is placed on rank "
                    f"{stage_to_rank[a.stage]}\n{render(schedule, mark=(rank, pos))}"
                )


def simulate(
    schedule: Mapping[int, Sequence[Action]],
    stage_to_rank: Mapping[int, int],
    costs: StageCosts,
    *,
    num_microbatches: int,
    events: bool = True,
    compiled: CompiledSchedule | None = None,
) -> SimulationResult:
    """Simulate one step of a lowered schedule (the output of :func:`lower`).

    ``events=False`` leaves the result's ``events`` empty (a search needs only the figures) and
    runs the compiled fast loop (:mod:`~lightning_deepcee.schedule.compiled`, same figures);
    ``compiled`` is ``compile_schedule(schedule, stage_to_rank)`` when the caller keeps it.

    Raises:
        ValueError: ``costs`` or ``stage_to_rank`` do not fit the schedule.
        ScheduleError: an action is misplaced or out of range, or the ranks deadlock (the message
            names every stuck rank and shows the grid with the first one marked).
    """
    if not events:
        fast = _simulate_compiled(schedule, stage_to_rank, costs, num_microbatches, compiled)
        if fast is not None:
            return fast
    _check_inputs(schedule, stage_to_rank, costs, num_microbatches)
    scale = costs.microbatch_scale or (1.0,) * num_microbatches
    sim = _Simulator(schedule, stage_to_rank, costs, scale, record=events)
    sim.run()
    step = max([*sim.clock.values(), sim.last_end], default=0.0)
    total_busy = sum(sim.busy.values())
    capacity = len(schedule) * step
    return SimulationResult(
        step_time_s=step,
        per_rank_busy_s=dict(sim.busy),
        bubble_ratio=1.0 - total_busy / capacity if capacity > 0 else 0.0,
        peak_memory_bytes=_peak(compile_schedule(schedule, stage_to_rank), costs, scale),
        events=tuple(sorted(sim.events, key=lambda e: (e.start_s, e.rank, e.is_transfer))),
    )


def simulate_stages(
    schedule: StageSchedule,
    costs: StageCosts,
    *,
    num_microbatches: int,
    compiled: CompiledSchedule | None = None,
) -> SimulationResult:
    """:func:`simulate` without events of a schedule of compute actions per stage (before
    lowering), each stage on its own rank: compiled without lowering
    (:func:`~lightning_deepcee.schedule.compiled.compile_stage_schedule`, or ``compiled`` when
    the caller keeps it), the same figures. Wrong inputs and deadlocks raise as :func:`simulate`
    raises them."""
    placement = {s: s for s in range(costs.num_stages)}
    compiled = compiled or compile_stage_schedule(schedule)
    if compiled is not None:
        fast = _simulate_compiled(schedule, placement, costs, num_microbatches, compiled)
        if fast is not None:
            return fast
    lowered = lower(schedule, placement)
    return simulate(lowered, placement, costs, num_microbatches=num_microbatches, events=False)


def _simulate_compiled(
    schedule: Mapping[int, Sequence[Action]],
    stage_to_rank: Mapping[int, int],
    costs: StageCosts,
    num_microbatches: int,
    compiled: CompiledSchedule | None,
) -> SimulationResult | None:
    """:func:`simulate` without events on the compiled program; ``None`` when the inputs are
    wrong or the ranks deadlock (the event simulator then raises the detailed error)."""
    p, m = costs.num_stages, num_microbatches
    scale = costs.microbatch_scale or (1.0,) * m
    if m < 1 or len(scale) != m or any(s not in stage_to_rank for s in range(p)):
        return None
    if compiled is None:
        try:
            compiled = compile_schedule(schedule, stage_to_rank)
        except ScheduleError:
            return None
    if compiled.max_stage >= p or compiled.max_microbatch >= m:
        return None
    ran = _run(compiled, costs, scale)
    if ran is None:
        return None
    clock, busy, last_end = ran
    step = max([*clock, last_end], default=0.0)
    capacity = len(compiled.ranks) * step
    return SimulationResult(
        step_time_s=step,
        per_rank_busy_s=dict(zip(compiled.ranks, busy, strict=True)),
        bubble_ratio=1.0 - sum(busy) / capacity if capacity > 0 else 0.0,
        peak_memory_bytes=_peak(compiled, costs, scale),
    )


def compiled_step_time(
    compiled: CompiledSchedule, costs: StageCosts, num_microbatches: int
) -> float | None:
    """The step time alone (no memory peak) of a schedule compiled with its stages' costs in
    mind (:func:`~lightning_deepcee.schedule.compiled.compile_stage_schedule`, whose stages
    and micro-batches ``costs`` and ``num_microbatches`` must cover); ``None`` when the ranks
    deadlock. The compact fitter's local search times thousands of candidates this way."""
    scale = costs.microbatch_scale or (1.0,) * num_microbatches
    ran = _run(compiled, costs, scale)
    return None if ran is None else max([*ran[0], ran[2]], default=0.0)


def _run(
    compiled: CompiledSchedule, costs: StageCosts, scale: Sequence[float]
) -> tuple[list[float], list[float], float] | None:
    """:func:`~lightning_deepcee.schedule.compiled.run_compiled` on ``costs``."""
    quota = None
    if costs.cpu_share is not None and costs.cpu_period_s is not None:
        quota = tuple(zip(costs.cpu_share, costs.cpu_period_s, strict=True))
    return run_compiled(
        compiled,
        forward_s=costs.forward_s,
        backward_input_s=costs.backward_input_s,
        backward_weight_s=costs.backward_weight_s,
        backward_s=costs.merged_backward_s,
        send_forward_s=costs.send_forward_s,
        send_backward_s=costs.send_backward_s,
        scale=scale,
        quota=quota,
    )


def _peak(compiled: CompiledSchedule, costs: StageCosts, scale: Sequence[float]) -> dict[int, int]:
    """Per rank, static bytes plus the peak of held and transient activation bytes."""
    p = costs.num_stages
    return compiled_peak_memory(
        compiled,
        activation_bytes=costs.activation_bytes,
        transient_bytes=costs.transient_bytes or (0.0,) * p,
        static_bytes=costs.static_memory_bytes or (0.0,) * p,
        scale=scale,
    )
