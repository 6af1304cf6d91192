"""Text rendering of a lowered schedule as a grid: one row per rank, one column per position."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_deepcee.schedule.actions import Action

__all__ = ["render"]


def render(
    schedule: Mapping[int, Sequence[Action]],
    *,
    compute_only: bool = False,
    mark: tuple[int, int] | None = None,
) -> str:
    """Render ``schedule`` as a fixed-width grid.

    Args:
        schedule: actions per rank (lowered) or per stage (not lowered).
        compute_only: drop send/receive actions, which makes the pipeline shape easier to see.
        mark: ``(rank, position)`` of an action to highlight as ``>>2F0<<`` (positions count the
            actions of the unfiltered list).
    """
    rows: dict[int, list[str]] = {}
    for rank in sorted(schedule):
        cells = []
        for pos, action in enumerate(schedule[rank]):
            if compute_only and not action.is_compute and mark != (rank, pos):
                continue
            text = str(action)
            if mark == (rank, pos):
                text = f">>{text}<<"
            cells.append(text)
        rows[rank] = cells
    width = max((len(c) for cells in rows.values() for c in cells), default=1)
    label = max((len(str(r)) for r in rows), default=1)
    lines = []
    for rank, cells in rows.items():
        lines.append(f"{rank:>{label}} | " + " ".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(lines)
