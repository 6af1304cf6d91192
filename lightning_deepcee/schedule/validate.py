"""Validation of lowered schedules.

:func:`validate` checks a per-rank action list against the rules the executor relies on and
raises :class:`ScheduleError` whose message shows the whole grid with the failing action marked:

- placement: each action runs on the rank its stage is placed on;
- counts: every (stage, micro-batch) has one F and either one BW or one B and one W;
- local order: F after its RECV_F, B/BW after F and RECV_B, W after B, sends after what they send;
- matching: every SEND has the peer's RECV, and between two ranks the messages of one direction
  are received in the order they are sent (the transport relies on this; it uses no tags);
- progress: with asynchronous sends and blocking receives, every rank can run to its end.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence

from lightning_deepcee.schedule.actions import Action, ActionKind
from lightning_deepcee.schedule.render import render

__all__ = ["ScheduleError", "validate"]

K = ActionKind


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message shows the grid with the failing action marked."""


def _fail(
    schedule: Mapping[int, Sequence[Action]], msg: str, rank: int | None = None, pos: int = -1
) -> ScheduleError:
    mark = (rank, pos) if rank is not None and pos >= 0 else None
    return ScheduleError(f"{msg}\n{render(schedule, mark=mark)}")


def _peer_stage(action: Action) -> int:
    """The stage on the other end of a transfer action."""
    return action.stage + 1 if action.kind in (K.SEND_F, K.RECV_B) else action.stage - 1


def validate(
    schedule: Mapping[int, Sequence[Action]],
    stage_to_rank: Mapping[int, int],
    num_microbatches: int,
    *,
    require_backward: bool = True,
) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is complete, ordered and deadlock-free.

    ``require_backward=False`` accepts forward-only (evaluation) schedules.
    """
    num_stages = len(stage_to_rank)
    last = num_stages - 1
    seen: dict[int, Counter[tuple[int, ActionKind, int]]] = {}
    for rank, actions in schedule.items():
        done: Counter[tuple[int, ActionKind, int]] = Counter()
        for pos, a in enumerate(actions):
            if a.stage >= num_stages or a.microbatch >= num_microbatches:
                raise _fail(schedule, f"{a} is out of range", rank, pos)
            if stage_to_rank[a.stage] != rank:
                raise _fail(
                    schedule,
                    f"{a} runs on rank {rank} but stage {a.stage} is placed on rank "
                    f"{stage_to_rank[a.stage]}",
                    rank,
                    pos,
                )
            s, mb = a.stage, a.microbatch
            needs: list[tuple[int, ActionKind, int]] = []
            remote_prev = s > 0 and stage_to_rank[s - 1] != rank
            remote_next = s < last and stage_to_rank[s + 1] != rank
            if a.kind == K.F and remote_prev:
                needs.append((s, K.RECV_F, mb))
            if a.kind in (K.B, K.BW):
                needs.append((s, K.F, mb))
                if remote_next:
                    needs.append((s, K.RECV_B, mb))
            if a.kind == K.W:
                needs.append((s, K.B, mb))
            if a.kind == K.SEND_F:
                needs.append((s, K.F, mb))
            if a.kind == K.SEND_B and not (done[(s, K.B, mb)] or done[(s, K.BW, mb)]):
                raise _fail(schedule, f"{a} sends a gradient before B/BW of it ran", rank, pos)
            for need in needs:
                if not done[need]:
                    raise _fail(
                        schedule,
                        f"{a} needs {need[0]}{need[1].value}{need[2]} earlier on rank {rank}",
                        rank,
                        pos,
                    )
            key = (s, a.kind, mb)
            if done[key]:
                raise _fail(schedule, f"{a} appears twice", rank, pos)
            if a.kind in (K.B, K.W) and done[(s, K.BW, mb)]:
                raise _fail(schedule, f"{a} after BW of the same micro-batch", rank, pos)
            if a.kind == K.BW and (done[(s, K.B, mb)] or done[(s, K.W, mb)]):
                raise _fail(schedule, f"{a} after a split B/W of the same micro-batch", rank, pos)
            done[key] += 1
        seen[rank] = done
    _check_counts(schedule, stage_to_rank, num_microbatches, seen, require_backward)
    _check_matching(schedule, stage_to_rank)
    _check_progress(schedule, stage_to_rank)


def _check_counts(
    schedule: Mapping[int, Sequence[Action]],
    stage_to_rank: Mapping[int, int],
    num_microbatches: int,
    seen: Mapping[int, Counter[tuple[int, ActionKind, int]]],
    require_backward: bool,
) -> None:
    for s, rank in stage_to_rank.items():
        done = seen.get(rank, Counter())
        for mb in range(num_microbatches):
            if not done[(s, K.F, mb)]:
                raise _fail(schedule, f"stage {s} has no F for micro-batch {mb}")
            if not require_backward:
                continue
            split = done[(s, K.B, mb)] and done[(s, K.W, mb)]
            if not (done[(s, K.BW, mb)] or split):
                raise _fail(schedule, f"stage {s} has no complete backward for micro-batch {mb}")


def _check_matching(
    schedule: Mapping[int, Sequence[Action]], stage_to_rank: Mapping[int, int]
) -> None:
    sends: dict[tuple[int, int, str], list[int]] = defaultdict(list)
    recvs: dict[tuple[int, int, str], list[int]] = defaultdict(list)
    for rank, actions in schedule.items():
        for a in actions:
            if a.kind in (K.SEND_F, K.SEND_B):
                peer = stage_to_rank[_peer_stage(a)]
                sends[(rank, peer, a.kind.value[-1])].append(a.microbatch)
            elif a.kind in (K.RECV_F, K.RECV_B):
                peer = stage_to_rank[_peer_stage(a)]
                recvs[(peer, rank, a.kind.value[-1])].append(a.microbatch)
    for key in set(sends) | set(recvs):
        src, dst, direction = key
        if sends[key] != recvs[key]:
            raise _fail(
                schedule,
                f"rank {src} sends {direction}-messages for micro-batches {sends[key]} to rank "
                f"{dst}, which receives {recvs[key]}: every send needs a receive, in the same "
                "order",
            )


def _check_progress(
    schedule: Mapping[int, Sequence[Action]], stage_to_rank: Mapping[int, int]
) -> None:
    """Run every rank with unit steps: sends never block, a receive waits for its send."""
    pos = {r: 0 for r in schedule}
    sent: set[tuple[int, ActionKind, int]] = set()
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in schedule.items():
            while pos[rank] < len(actions):
                a = actions[pos[rank]]
                if a.kind == K.RECV_F and (a.stage - 1, K.SEND_F, a.microbatch) not in sent:
                    break
                if a.kind == K.RECV_B and (a.stage + 1, K.SEND_B, a.microbatch) not in sent:
                    break
                if a.kind in (K.SEND_F, K.SEND_B):
                    sent.add((a.stage, a.kind, a.microbatch))
                pos[rank] += 1
                progressed = True
    stuck = [r for r in schedule if pos[r] < len(schedule[r])]
    if stuck:
        r = stuck[0]
        waiting = ", ".join(f"rank {x} at {schedule[x][pos[x]]}" for x in stuck)
        raise _fail(schedule, f"deadlock: {waiting} wait forever", r, pos[r])
