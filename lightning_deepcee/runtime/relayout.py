"""Moving the training state from one layout to another, point to point (a live re-plan).

A rank of the new layout needs the state of exactly the blocks of its new stage. Those blocks
were held by the old stages whose block ranges overlap the new one; every device of an old stage
holds that stage's state as a checkpoint shard would save it (the devices of a stage hold equal
copies). :func:`routes` lists, for every rank of the new layout, which old shards it needs and
from whom: from itself where it was a device of that old stage, else from the stage's first
device; :func:`move_shards` runs those transfers, sending each receiver only the part of the
shard its new blocks use (``select``), pickled once per new stage. A rank that keeps its blocks
moves nothing over the network, and a rank the new layout leaves idle receives nothing, so a
re-plan costs the bytes of the blocks that change owner, on the links between their old and new
owners, instead of whole stages through every rank.

torch.distributed; no Lightning.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_deepcee.runtime.transport import wire_device

__all__ = ["Route", "move_shards", "routes"]


@dataclass(frozen=True, order=True)
class Route:
    """Old stage ``stage``'s shard goes from rank ``src`` (its first device, or ``dst`` itself
    where ``dst`` was a device of it) to rank ``dst``, whose new stage holds ``blocks`` (a
    ``[start, end)`` range: what ``dst`` needs of the shard)."""

    src: int
    dst: int
    stage: int
    blocks: tuple[int, int]


def routes(
    old_ranges: Sequence[tuple[int, int]],
    old_placement: Sequence[Sequence[int]],
    new_ranges: Sequence[tuple[int, int]],
    new_placement: Sequence[Sequence[int]],
    tied_blocks: Sequence[Sequence[int]] = (),
) -> list[Route]:
    """Every transfer of a move from the old layout to the new one, in the order all ranks run
    them: each rank of a new stage gets the shard of every old stage whose blocks overlap its
    new range (a route with ``src == dst`` is a shard the rank already holds: it was a device
    of that old stage), and for a tied
    parameter its new blocks use (``tied_blocks``: the blocks of each), the shard of the old
    stage that saved it: the first old stage using it (the others leave it out).

    Any one total order is free of deadlock when each rank runs its own routes in it: the first
    unfinished route has both ends past all of their earlier routes, so it completes.
    """
    if len(old_ranges) != len(old_placement) or len(new_ranges) != len(new_placement):
        raise ValueError("routes: every stage needs both a block range and its ranks")

    def stages_using(blocks: Sequence[int]) -> list[int]:
        return [s for s, (a, b) in enumerate(old_ranges) if any(a <= i < b for i in blocks)]

    found: set[Route] = set()
    for (start, end), ranks in zip(new_ranges, new_placement, strict=True):
        needed = {s for s, (a, b) in enumerate(old_ranges) if a < end and start < b}
        for blocks in tied_blocks:
            owners = stages_using(blocks)
            if owners and any(start <= i < end for i in blocks):
                needed.add(owners[0])
        for stage in needed:
            if not old_placement[stage]:
                raise ValueError(f"routes: old stage {stage} has no rank")
            for dst in ranks:
                src = dst if dst in old_placement[stage] else old_placement[stage][0]
                found.add(Route(src, dst, stage, (start, end)))
    return sorted(found)


def move_shards(
    moves: Sequence[Route],
    rank: int,
    shard: Any,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    select: Callable[[Any, Route], Any] = lambda shard, move: shard,
) -> tuple[dict[int, Any], int]:
    """Run this rank's part of ``moves``; every rank of ``group`` calls it with the same list.

    ``shard`` is this rank's old stage's shard where it is the source of a route (else
    unused); ``select(shard, move)`` is the part of it ``move``'s receiver gets (by default the
    whole shard; one payload per new block range). Returns the shards this rank received or
    kept, by old stage index, and the bytes this rank sent over the network.
    """
    payloads: dict[tuple[int, int], torch.Tensor] = {}
    received: dict[int, Any] = {}
    sent = 0
    wire = wire_device(device, group)
    for move in moves:
        if move.src == rank and move.dst == rank:
            received[move.stage] = shard
        elif move.src == rank:
            payload = payloads.get(move.blocks)
            if payload is None:
                pickled = pickle.dumps(select(shard, move))
                payload = torch.frombuffer(bytearray(pickled), dtype=torch.uint8).to(wire)
                payloads[move.blocks] = payload
            size = torch.tensor([payload.numel()], dtype=torch.int64, device=wire)
            dist.send(size, move.dst, group=group)
            dist.send(payload, move.dst, group=group)
            sent += payload.numel()
        elif move.dst == rank:
            size = torch.zeros(1, dtype=torch.int64, device=wire)
            dist.recv(size, move.src, group=group)
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=wire)
            dist.recv(data, move.src, group=group)
            received[move.stage] = pickle.loads(data.cpu().numpy().tobytes())
    return received, sent
