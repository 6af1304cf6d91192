"""The adapter's per-step exchange on the wire (``adapter/exchange.py`` packs and reads it).

The ranks with a part to add (:func:`~lightning_deepcee.adapter.exchange.exchange_members`:
they train, search or probe) sum their parts in one all-reduce among themselves, posted at a
step's end and read at the next one's. A rank the running plan leaves idle that neither
searches nor probes is left out of that sum, so the exchange never waits for a device the plan
does not use (an end device at a few percent of a core, behind a thin link). Such a rank still
needs the sums, since its monitors must make the proposals the others make and it joins any
collective an action needs: the lowest member hands them on once they land, without waiting
for the hand-over to finish.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_deepcee.runtime.transport import start_all_reduce, wire_device

__all__ = ["ExchangeChannel"]


class ExchangeChannel:
    """Posts the exchange and lands it. Owns its process groups, one per membership, each made
    on every rank the first time an exchange of that membership is posted (all ranks post at
    the same steps with the same members, so they make the groups in the same order)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], Any] = {}
        self._handing: list[tuple[Any, torch.Tensor]] = []
        """The lowest member's hand-overs still on the wire, with the tensors they read."""

    def post(
        self,
        values: Sequence[float],
        members: Sequence[int],
        *,
        rank: int,
        world: int,
        device: torch.device,
    ) -> Callable[[], list[float]]:
        """Post this rank's part, ``values`` (a member's; zeros are assumed elsewhere); the
        returned callable waits for the sums and returns them, on every rank at the same step."""
        inside = tuple(sorted(set(members)))
        outside = tuple(r for r in range(world) if r not in inside)
        group = self._group(inside)
        relay = self._group((inside[0], *outside)) if outside else None
        self._handing = [(w, t) for w, t in self._handing if not w.is_completed()]
        if rank not in inside:
            assert relay is not None
            wire = wire_device(device, relay)
            received = torch.zeros(len(values), dtype=torch.float64, device=wire)

            def receive() -> list[float]:
                dist.broadcast(received, src=inside[0], group=relay)
                return [float(v) for v in received.tolist()]

            return receive
        finish = start_all_reduce(torch.tensor(values, dtype=torch.float64, device=device), group)

        def land() -> list[float]:
            summed = finish()
            if relay is not None and rank == inside[0]:
                staged = summed.to(wire_device(summed.device, relay))
                work = dist.broadcast(staged, src=rank, group=relay, async_op=True)
                if work is not None:
                    self._handing.append((work, staged))
            return [float(v) for v in summed.tolist()]

        return land

    def close(self) -> None:
        """Wait for the hand-overs still on the wire (the end of training)."""
        for work, _ in self._handing:
            work.wait()
        self._handing = []

    def _group(self, ranks: tuple[int, ...]) -> Any:
        if ranks not in self._groups:
            self._groups[ranks] = dist.new_group(list(ranks))
        return self._groups[ranks]
