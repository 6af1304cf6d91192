"""A lowered schedule compiled to flat integer programs, and the simulator's fast loop on it.

The planner simulates thousands of candidate steps per search, most of them on the same few
generated schedules. :func:`compile_schedule` turns a lowered schedule into per-rank tuples of
small integers once (messages numbered, links numbered, actions checked against the placement)
and orders every rank's actions into one sequence in which each receive follows its send (a
deadlock shows there, once); :func:`run_compiled` then runs the timing model of
:mod:`~lightning_deepcee.schedule.simulate` down that sequence with list indexing, and
:func:`compiled_peak_memory` the memory peak from a second program that keeps only the actions
that change held activations. It gives the same floats as the event-recording simulator: the
same operations on each rank's clock and each link, in the same order.

Pure: the standard library only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lightning_deepcee.schedule.actions import Action, ActionKind
from lightning_deepcee.schedule.render import render
from lightning_deepcee.schedule.validate import ScheduleError

__all__ = [
    "CompiledSchedule",
    "compile_schedule",
    "compile_stage_schedule",
    "compiled_peak_memory",
    "move_compute",
    "quota_end",
    "run_compiled",
]

K = ActionKind
_RECV, _SEND_F, _SEND_B, _F, _B, _W, _BW = range(7)
_CODE = {
    K.RECV_F: _RECV,
    K.RECV_B: _RECV,
    K.SEND_F: _SEND_F,
    K.SEND_B: _SEND_B,
    K.F: _F,
    K.B: _B,
    K.W: _W,
    K.BW: _BW,
}
Op = tuple[int, int, int, int, int]
"""(code, stage, micro-batch, message, link): message and link are -1 where unused."""
FlatOp = tuple[int, int, int, int, int, int]
"""(rank index, code, stage, micro-batch, message, link): one action of a run order."""
MemoryOp = tuple[int, int, int, int]
"""(stage, micro-batch, held slot added by an F or -1, held slot released by a W/BW or -1)."""


@dataclass(frozen=True, slots=True)
class CompiledSchedule:
    """One lowered schedule and placement as integer programs (see the module docstring)."""

    ranks: tuple[int, ...]
    """The schedule's ranks, in its order."""
    programs: tuple[tuple[Op, ...], ...]
    """Per rank (``ranks`` order), its actions as :data:`Op` tuples."""
    memory_programs: tuple[tuple[MemoryOp, ...], ...]
    """Per rank, its compute actions as :data:`MemoryOp` tuples."""
    rank_stages: tuple[tuple[int, ...], ...]
    """Per rank, the stages placed on it."""
    num_messages: int
    num_links: int
    num_slots: int
    max_stage: int
    """The largest stage an action names (checked against the costs at run time)."""
    max_microbatch: int
    """The largest micro-batch an action names."""
    order: tuple[FlatOp, ...] | None = field(default=None, compare=False)
    """Every rank's actions in one order the timing model can run them in (each rank's in its
    program's order, each receive after its send), ``None`` when some rank waits forever.
    Which order does not change the figures (a rank's clock depends on its own actions and on
    the messages it receives; a link carries one rank's sends, in that rank's order), so a
    moved W keeps any valid one (:func:`move_compute`)."""


def _memory_op(
    code: int, s: int, mb: int, slots: dict[tuple[int, int], int], held: set[tuple[int, int]]
) -> MemoryOp:
    """The memory op of compute action ``code`` on (stage ``s``, micro-batch ``mb``): an F
    takes a held slot (numbered in ``slots`` at first use), a W or BW releases its F's."""
    key = (s, mb)
    added = released = -1
    if code == _F:
        added = slots.setdefault(key, len(slots))
        held.add(key)
    elif code >= _W and key in held:
        released = slots[key]
        held.discard(key)
    return (s, mb, added, released)


def compile_schedule(
    schedule: Mapping[int, Sequence[Action]], stage_to_rank: Mapping[int, int]
) -> CompiledSchedule:
    """Compile ``schedule`` (the output of :func:`~lightning_deepcee.schedule.lowering.lower`).

    Raises:
        ScheduleError: an action is on a rank its stage is not placed on, or a stage has no rank.
    """
    messages: dict[tuple[ActionKind, int, int], int] = {}
    links: dict[tuple[int, int], int] = {}
    slots: dict[tuple[int, int], int] = {}
    programs, memory_programs = [], []
    max_stage = max_mb = 0
    for rank, actions in schedule.items():
        program: list[Op] = []
        memory: list[MemoryOp] = []
        held: set[tuple[int, int]] = set()
        mine = {s for s, r in stage_to_rank.items() if r == rank}
        for a in actions:
            s, mb, kind = a.stage, a.microbatch, a.kind
            if s not in mine:
                pos = len(program)
                raise ScheduleError(
                    f"{a} is on rank {rank} but stage {s} is placed on rank "
                    f"{stage_to_rank.get(s)}\n{render(schedule, mark=(rank, pos))}"
                )
            if s > max_stage:
                max_stage = s
            if mb > max_mb:
                max_mb = mb
            code = _CODE[kind]
            if code == _RECV:
                key3 = (K.SEND_F, s - 1, mb) if kind == K.RECV_F else (K.SEND_B, s + 1, mb)
                msg = messages.setdefault(key3, len(messages))
                program.append((code, s, mb, msg, -1))
            elif code in (_SEND_F, _SEND_B):
                peer_stage = s + 1 if code == _SEND_F else s - 1
                if peer_stage not in stage_to_rank:
                    raise ScheduleError(f"{a} sends to stage {peer_stage}, which has no rank")
                link = links.setdefault((rank, stage_to_rank[peer_stage]), len(links))
                msg = messages.setdefault((kind, s, mb), len(messages))
                program.append((code, s, mb, msg, link))
            else:
                memory.append(_memory_op(code, s, mb, slots, held))
                program.append((code, s, mb, -1, -1))
        programs.append(tuple(program))
        memory_programs.append(tuple(memory))
    ranks = tuple(schedule)
    return CompiledSchedule(
        ranks=ranks,
        programs=tuple(programs),
        memory_programs=tuple(memory_programs),
        rank_stages=tuple(
            tuple(s for s, r in stage_to_rank.items() if r == rank) for rank in ranks
        ),
        num_messages=len(messages),
        order=_run_order(programs, len(messages)),
        num_links=len(links),
        num_slots=len(slots),
        max_stage=max_stage,
        max_microbatch=max_mb,
    )


def compile_stage_schedule(
    schedule: Mapping[int, Sequence[Action]],
) -> CompiledSchedule | None:
    """``compile_schedule(lower(schedule, identity), identity)`` without building the lowered
    actions: each stage on its own rank (stage ``s`` on rank ``s``), transfers inserted as
    :func:`~lightning_deepcee.schedule.lowering.lower` inserts them, the same numbering. The
    planner's schedule fitting compiles thousands of such candidates.

    Returns ``None`` where the schedule is not compute actions of stages ``0..p-1``, each in its
    own stage's list; the caller then lowers it, which reports what is wrong.
    """
    num_stages = len(schedule)
    last = num_stages - 1
    messages: dict[tuple[int, int, int], int] = {}
    slots: dict[tuple[int, int], int] = {}
    programs, memory_programs = [], []
    max_stage = max_mb = 0
    for s in range(num_stages):
        actions = schedule.get(s)
        if actions is None:
            return None
        if actions:
            max_stage = s
        program: list[Op] = []
        memory: list[MemoryOp] = []
        held: set[tuple[int, int]] = set()
        for a in actions:
            mb, code = a.microbatch, _CODE[a.kind]
            if a.stage != s or code < _F:
                return None
            if mb > max_mb:
                max_mb = mb
            backward = code in (_B, _BW)
            if code == _F and s > 0:
                msg = messages.setdefault((_SEND_F, s - 1, mb), len(messages))
                program.append((_RECV, s, mb, msg, -1))
            elif backward and s < last:
                msg = messages.setdefault((_SEND_B, s + 1, mb), len(messages))
                program.append((_RECV, s, mb, msg, -1))
            memory.append(_memory_op(code, s, mb, slots, held))
            program.append((code, s, mb, -1, -1))
            if code == _F and s < last:
                msg = messages.setdefault((_SEND_F, s, mb), len(messages))
                program.append((_SEND_F, s, mb, msg, 2 * s))
            elif backward and s > 0:
                msg = messages.setdefault((_SEND_B, s, mb), len(messages))
                program.append((_SEND_B, s, mb, msg, 2 * s - 1))
        programs.append(tuple(program))
        memory_programs.append(tuple(memory))
    return CompiledSchedule(
        ranks=tuple(range(num_stages)),
        programs=tuple(programs),
        memory_programs=tuple(memory_programs),
        rank_stages=tuple((s,) for s in range(num_stages)),
        num_messages=len(messages),
        order=_run_order(programs, len(messages)),
        num_links=max(2 * last, 0),
        num_slots=len(slots),
        max_stage=max_stage,
        max_microbatch=max_mb,
    )


def _run_order(programs: Sequence[Sequence[Op]], num_messages: int) -> tuple[FlatOp, ...] | None:
    """:attr:`CompiledSchedule.order`: each rank runs until it waits for a message not yet sent,
    round after round (the event simulator's order); ``None`` on a deadlock."""
    pos = [0] * len(programs)
    sent = [False] * num_messages
    out: list[FlatOp] = []
    progressed = True
    while progressed:
        progressed = False
        for r, program in enumerate(programs):
            p = start = pos[r]
            while p < len(program):
                code, s, mb, msg, link = program[p]
                if code == _RECV and not sent[msg]:
                    break
                if code in (_SEND_F, _SEND_B):
                    sent[msg] = True
                out.append((r, code, s, mb, msg, link))
                p += 1
            if p != start:
                pos[r], progressed = p, True
    if any(pos[r] < len(program) for r, program in enumerate(programs)):
        return None
    return tuple(out)


def move_compute(
    compiled: CompiledSchedule, stage: int, source: int, target: int
) -> CompiledSchedule:
    """``compiled`` (one stage per rank, :func:`compile_stage_schedule`) with the compute action
    at index ``source`` of ``stage``'s actions moved to index ``target`` (as ``list.pop`` then
    ``list.insert``): what compiling the moved schedule gives, for an action without transfers
    (a W), whose move leaves every message, link and held slot numbered as it was. The compact
    fitter's local search tries thousands of such moves; only the moved stage is rebuilt.

    Raises:
        ValueError: the action at ``source`` is not a W.
    """
    program = list(compiled.programs[stage])
    computes = [i for i, op in enumerate(program) if op[0] >= _F]
    op = program.pop(computes[source])
    if op[0] != _W:
        raise ValueError(f"stage {stage}'s action {source} is not a W: only a W moves alone")
    computes = [i for i, o in enumerate(program) if o[0] >= _F]
    at = computes[target] if target < len(computes) else len(program)
    if at > 0 and program[at - 1][0] == _RECV:
        at -= 1  # before the receive of the action it now precedes
    program.insert(at, op)
    memory = list(compiled.memory_programs[stage])
    memory.insert(target, memory.pop(source))
    programs, memory_programs = list(compiled.programs), list(compiled.memory_programs)
    programs[stage], memory_programs[stage] = tuple(program), tuple(memory)
    order = None
    if compiled.order is not None:  # the W right after the action it now follows
        flat = list(compiled.order)
        flat.remove((stage, *op))
        if at > 0:
            flat.insert(flat.index((stage, *program[at - 1])) + 1, (stage, *op))
        else:
            flat.insert(flat.index((stage, *program[1])), (stage, *op))
        order = tuple(flat)
    return dataclasses.replace(
        compiled, programs=tuple(programs), memory_programs=tuple(memory_programs), order=order
    )


def quota_end(
    share: float, period: float, last_end: float, credit: float, start: float, seconds: float
) -> tuple[float, float]:
    """When ``seconds`` of compute starting at ``start`` ends under a CPU quota of ``share`` of a
    core per ``period``, and the credit left: the token bucket of the simulator's *CPU quotas*
    (it earns ``share`` full-speed seconds per second, holds at most a period's budget, and
    was last drawn at ``last_end`` with ``credit`` left)."""
    credit = min(share * period, credit + share * max(0.0, start - last_end))
    work = seconds * share
    burst = credit / (1.0 - share)  # full-speed seconds the credit lasts
    if work <= burst:
        return start + work, credit - work * (1.0 - share)
    return start + burst + (work - burst) / share, 0.0


def run_compiled(
    compiled: CompiledSchedule,
    *,
    forward_s: Sequence[float],
    backward_input_s: Sequence[float],
    backward_weight_s: Sequence[float],
    backward_s: Sequence[float],
    send_forward_s: Sequence[float],
    send_backward_s: Sequence[float],
    scale: Sequence[float],
    quota: Sequence[tuple[float, float]] | None,
) -> tuple[list[float], list[float], float] | None:
    """Each rank's final clock and busy seconds and the last end of any action or message;
    ``None`` when some rank waits forever (the caller reports the deadlock). ``quota`` gives
    each stage's (share, period), or is ``None`` for no quota anywhere."""
    order = compiled.order
    if order is None:
        return None
    count = len(compiled.ranks)
    clock = [0.0] * count
    busy = [0.0] * count
    link_free = [0.0] * compiled.num_links
    arrival = [0.0] * compiled.num_messages
    # Seconds per stage by action code (the codes below _F are transfers: never looked up).
    compute = (*[forward_s] * _F, forward_s, backward_input_s, backward_weight_s, backward_s)
    limited = None
    if quota is not None:
        limited = [share < 1.0 and period > 0.0 for share, period in quota]
    credit: dict[int, tuple[float, float]] = {}
    last_end = 0.0
    for r, code, s, mb, msg, link in order:
        if code == _RECV:
            t = arrival[msg]
            if t > clock[r]:
                clock[r] = t
        elif code <= _SEND_B:
            hop = send_forward_s[s] if code == _SEND_F else send_backward_s[s - 1]
            clk, free = clock[r], link_free[link]
            end = (clk if clk >= free else free) + hop * scale[mb]
            link_free[link] = end
            arrival[msg] = end
            if end > last_end:
                last_end = end
        else:
            seconds = compute[code][s] * scale[mb]
            clk = clock[r]
            if limited is not None and limited[s]:
                assert quota is not None
                share, period = quota[s]
                before, banked = credit.get(r, (0.0, 0.0))
                end, banked = quota_end(share, period, before, banked, clk, seconds)
                credit[r] = (end, banked)
            else:
                end = clk + seconds
            busy[r] += end - clk
            clock[r] = end
            if end > last_end:
                last_end = end
    return clock, busy, last_end


def compiled_peak_memory(
    compiled: CompiledSchedule,
    *,
    activation_bytes: Sequence[float],
    transient_bytes: Sequence[float],
    static_bytes: Sequence[float],
    scale: Sequence[float],
) -> dict[int, int]:
    """Static bytes plus the peak of held activations (with the transient bytes of the action
    computing then), per rank: the simulator's memory model on the compiled program."""
    out: dict[int, int] = {}
    held = [0.0] * compiled.num_slots
    for rank, program, stages in zip(
        compiled.ranks, compiled.memory_programs, compiled.rank_stages, strict=True
    ):
        base = sum(static_bytes[s] for s in stages if s < len(static_bytes))
        current = peak = 0.0
        for s, mb, added, released in program:
            if added >= 0:
                held[added] = activation_bytes[s] * scale[mb]
                current += held[added]
            top = current + transient_bytes[s] * scale[mb]
            if top > peak:
                peak = top
            if released >= 0:
                current -= held[released]
        out[rank] = round(base + peak)
    return out
