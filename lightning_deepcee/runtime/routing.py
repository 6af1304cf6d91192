"""Row routing between pipeline stages that several devices share (asymmetric data parallelism).

Every micro-batch is a block of rows. Inside stage ``s`` the devices split each micro-batch into
contiguous row ranges in proportion to their batch shares (the planner makes shares proportional to
speed, so a fast device takes more rows), rounded to whole rows so that over the step each device
holds its share to within one row (:func:`~lightning_deepcee.runtime.rows.split_step_rows`).
Between two stages a sender passes each receiver exactly the rows where their ranges overlap; the
receiver concatenates the pieces in row order. Gradients travel back along the same pieces. Both
ends compute the overlaps from the same sizes and shares, so no message carries routing metadata
beyond the shape header.

A plain pipeline is the special case of one device per stage with share 1: every micro-batch
travels whole to the one next device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_deepcee.runtime.rows import split_rows, split_step_rows

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
    """Which rows this rank holds of each micro-batch, and which pieces it sends and receives.

    :meth:`begin_step` lays out the step's micro-batches (their sizes); the other methods take a
    micro-batch index into that step.
    """

    def __init__(self, layouts: Sequence[StageLayout], stage_index: int, rank: int) -> None:
        self.layouts = list(layouts)
        self.stage_index = stage_index
        self.rank = rank
        self.position = self.layouts[stage_index].ranks.index(rank)
        self._sizes: tuple[int, ...] | None = None
        self._split: dict[int, list[list[tuple[int, int]]]] = {}

    def begin_step(self, sizes: Sequence[int]) -> None:
        """Lay out the rows of a step whose micro-batches have ``sizes`` rows (kept while equal)."""
        key = tuple(sizes)
        if key == self._sizes:
            return
        near = range(max(self.stage_index - 1, 0), min(self.stage_index + 2, len(self.layouts)))
        self._split = {s: split_step_rows(key, self.layouts[s].shares) for s in near}
        self._sizes = key

    def _ranges(self, stage: int, microbatch: int) -> list[tuple[int, int]]:
        if self._sizes is None:
            raise RuntimeError("Router.begin_step(sizes) must lay out the step first")
        return self._split[stage][microbatch]

    def my_rows(self, microbatch: int) -> tuple[int, int]:
        """This rank's rows ``[start, end)`` of micro-batch ``microbatch`` of the step."""
        return self._ranges(self.stage_index, microbatch)[self.position]

    def _pieces(self, other_stage: int, microbatch: int) -> list[Piece]:
        start, end = self.my_rows(microbatch)
        pieces = []
        for peer, (a, b) in zip(
            self.layouts[other_stage].ranks, self._ranges(other_stage, microbatch), strict=True
        ):
            lo, hi = max(a, start), min(b, end)
            if hi > lo:
                pieces.append(Piece(peer, lo - start, hi - start))
        return pieces

    def next_pieces(self, microbatch: int) -> list[Piece]:
        """Pieces of this rank's rows exchanged with the next stage (activations out, grads in)."""
        return self._pieces(self.stage_index + 1, microbatch)

    def prev_pieces(self, microbatch: int) -> list[Piece]:
        """Pieces of this rank's rows exchanged with the previous stage (inputs in, grads out)."""
        return self._pieces(self.stage_index - 1, microbatch)
