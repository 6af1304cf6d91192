"""One pipeline stage of a :class:`~lightning_deepcee.planner.plan.Plan`, and the value checks and
compact text the plan shares with it.

Pure: standard library only.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SHARE_TOLERANCE",
    "StagePlan",
    "checked_fields",
    "compact_ranks",
    "compact_shares",
    "int_tuple",
    "is_int",
    "is_real",
]

SHARE_TOLERANCE = 1e-6
"""How far the batch shares of one stage may sum away from 1."""


def is_int(value: object) -> bool:
    if type(value) is int:  # fast path: plans of 1000+ ranks are built in the search loop
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    if type(value) is float or type(value) is int:
        return True
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def int_tuple(name: str, value: object) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name}: expected a list of integers, got {value!r}")
    for entry in value:
        if not is_int(entry):
            raise ValueError(f"{name}: expected a list of integers, got {list(value)!r}")
    return tuple(int(entry) for entry in value)


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """One pipeline stage: its blocks and the devices that share it."""

    block_range: tuple[int, int]
    """Half-open range ``(start, end)`` of model blocks this stage runs (``start < end``)."""
    ranks: tuple[int, ...]
    """Ranks that hold a replica of these blocks and split every micro-batch between them."""
    batch_shares: tuple[float, ...]
    """Fraction of each micro-batch's samples each rank processes (same order as ``ranks``);
    positive, summing to 1. Proportional to device speed, bounded by memory."""

    def __post_init__(self) -> None:
        block_range = int_tuple("block_range", self.block_range)
        if len(block_range) != 2 or not 0 <= block_range[0] < block_range[1]:
            raise ValueError(
                f"block_range: expected (start, end) with 0 <= start < end (half-open), got "
                f"{list(block_range)!r}"
            )
        ranks = int_tuple("ranks", self.ranks)
        if not ranks or min(ranks) < 0 or len(set(ranks)) != len(ranks):
            raise ValueError(
                f"ranks: expected a non-empty list of distinct non-negative ranks, got "
                f"{list(ranks)!r}"
            )
        shares = self.batch_shares
        if (
            isinstance(shares, (str, bytes))
            or not isinstance(shares, Sequence)
            or not all(is_real(s) and math.isfinite(s) and s > 0 for s in shares)
        ):
            raise ValueError(f"batch_shares: expected positive finite fractions, got {shares!r}")
        shares = tuple(float(s) for s in shares)
        if len(shares) != len(ranks):
            raise ValueError(
                f"batch_shares: expected {len(ranks)} entries (one per rank of {list(ranks)}), "
                f"got {len(shares)}"
            )
        if abs(sum(shares) - 1.0) > SHARE_TOLERANCE:
            raise ValueError(
                f"batch_shares: expected fractions summing to 1, got {list(shares)} "
                f"(sum {sum(shares):.9g}); divide each by their sum"
            )
        object.__setattr__(self, "block_range", block_range)
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "batch_shares", shares)

    @classmethod
    def trusted(
        cls, block_range: tuple[int, int], ranks: tuple[int, ...], batch_shares: tuple[float, ...]
    ) -> StagePlan:
        """A stage from values the planner computed itself (int tuples, positive float shares
        summing to 1), without the checks: the search builds tens of thousands per plan."""
        stage = object.__new__(cls)
        for name, value in zip(cls.__slots__, (block_range, ranks, batch_shares), strict=True):
            object.__setattr__(stage, name, value)
        return stage

    @property
    def num_blocks(self) -> int:
        """Number of blocks in this stage."""
        return self.block_range[1] - self.block_range[0]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe dict."""
        return {
            "block_range": list(self.block_range),
            "ranks": list(self.ranks),
            "batch_shares": list(self.batch_shares),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StagePlan:
        """Inverse of :meth:`to_dict`; unknown or missing fields are errors."""
        return cls(**checked_fields(data, cls, "StagePlan"))


def checked_fields(data: object, cls: type, where: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping of {cls.__name__} fields, got {data!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    unknown = [key for key in data if key not in names]
    if unknown:
        raise ValueError(
            f"{where}.{unknown[0]}: unknown field of {cls.__name__} (expected only: "
            f"{', '.join(names)})"
        )
    missing = [name for name in required if name not in data]
    if missing:
        raise ValueError(f"{where}.{missing[0]}: missing required field of {cls.__name__}")
    return dict(data)


def compact_ranks(ranks: Sequence[int]) -> str:
    """``0,1,2,3,7`` -> ``0-3,7`` so that a stage of 128 devices fits on a line."""
    parts: list[str] = []
    start = previous = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return ",".join(parts)


def compact_shares(shares: Sequence[float]) -> str:
    if len(shares) <= 8:
        return ",".join(f"{s:.3f}" for s in shares)
    return f"{min(shares):.4f}..{max(shares):.4f} ({len(shares)} ranks)"
