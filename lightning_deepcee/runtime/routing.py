"""Row routing between pipeline stages that several devices share (asymmetric data parallelism).

Every micro-batch is a block of rows. Inside stage ``s`` the devices split each micro-batch into
contiguous row ranges in proportion to their batch shares (the planner makes shares proportional
to speed, so a fast device takes more rows). Between two stages a sender passes each receiver
exactly the rows where their ranges overlap; the receiver concatenates the pieces in row order.
Gradients travel back along the same pieces. Both ends compute the overlaps from the same sizes
and shares, so no message carries routing metadata beyond the shape header.

A plain pipeline is the special case of one device per stage with share 1: every micro-batch
travels whole to the one next device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_deepcee.planner.rows import split_rows

__all__ = ["Piece", "Router", "StageLayout", "split_rows"]


@dataclass(frozen=True, slots=True)
class StageLayout:
    """The global ranks that share one stage and their batch shares (same order)."""

    ranks: tuple[int, ...]
    shares: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.ranks or len(self.ranks) != len(self.shares):
            raise ValueError(f"A stage needs ranks and one share per rank, got {self}")


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows ``[start, end)`` of this rank's tensor that travel to or from ``peer``."""

    peer: int
    start: int
    end: int

    @property
    def num_rows(self) -> int:
        return self.end - self.start


class Router:
    """Which rows this rank holds of each micro-batch, and which pieces it sends and receives."""

    def __init__(self, layouts: Sequence[StageLayout], stage_index: int, rank: int) -> None:
        self.layouts = list(layouts)
        self.stage_index = stage_index
        self.rank = rank
        self.position = self.layouts[stage_index].ranks.index(rank)

    def _ranges(self, stage: int, num_rows: int) -> list[tuple[int, int]]:
        return split_rows(num_rows, self.layouts[stage].shares)

    def my_rows(self, num_rows: int) -> tuple[int, int]:
        """This rank's rows of a micro-batch of ``num_rows`` rows."""
        return self._ranges(self.stage_index, num_rows)[self.position]

    def _pieces(self, other_stage: int, num_rows: int) -> list[Piece]:
        start, end = self.my_rows(num_rows)
        pieces = []
        for peer, (a, b) in zip(
            self.layouts[other_stage].ranks, self._ranges(other_stage, num_rows), strict=True
        ):
            lo, hi = max(a, start), min(b, end)
            if hi > lo:
                pieces.append(Piece(peer, lo - start, hi - start))
        return pieces

    def next_pieces(self, num_rows: int) -> list[Piece]:
        """Pieces of this rank's rows exchanged with the next stage (activations out, grads in)."""
        return self._pieces(self.stage_index + 1, num_rows)

    def prev_pieces(self, num_rows: int) -> list[Piece]:
        """Pieces of this rank's rows exchanged with the previous stage (inputs in, grads out)."""
        return self._pieces(self.stage_index - 1, num_rows)
