"""PNG timeline of a simulated step: one row per rank, a box per compute action.

Rows are labelled by ``row_labels`` (e.g. the stage and its devices) or by rank; every box long
enough to hold text names its action and micro-batch (``F3``, ``W0``); the title always ends
with the simulated pipeline's time (in ms, as the plan table prints) and bubble fraction.
Colours: F blue, B green, W orange, BW teal; transfers are thin grey bars along the bottom of
the sending rank's row. matplotlib is optional and imported only when a plot is drawn
(``pip install matplotlib``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from lightning_deepcee.schedule.actions import ActionKind
from lightning_deepcee.schedule.simulate import SimulationResult

__all__ = ["plot_timeline"]

_COLOURS = {
    ActionKind.F: "tab:blue",
    ActionKind.B: "tab:green",
    ActionKind.W: "tab:orange",
    ActionKind.BW: "teal",
}
_TRANSFER_COLOUR = "grey"


def plot_timeline(
    result: SimulationResult,
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    row_labels: Mapping[int, str] | None = None,
    empty_rows: Sequence[str] = (),
) -> None:
    """Draw ``result`` as a Gantt chart and save it as a PNG at ``path``.

    ``row_labels`` maps a rank of the simulation to its row label (default ``rank N``);
    ``empty_rows`` adds labelled rows with nothing on them below (devices a plan leaves idle).
    """
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(
            "plot_timeline needs matplotlib, which is not installed: pip install matplotlib"
        ) from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted(result.per_rank_busy_s)
    row = {r: i for i, r in enumerate(ranks)}
    step = result.step_time_s or 1.0
    rows = len(ranks) + len(empty_rows)
    fig, ax = plt.subplots(
        figsize=(max(6.0, min(24.0, 0.4 * len(result.events))), 0.6 * rows + 1.2)
    )
    try:
        for ev in result.events:
            y = row[ev.rank]
            if ev.is_transfer:
                ax.barh(
                    y + 0.38,
                    ev.duration_s,
                    left=ev.start_s,
                    height=0.08,
                    color=_TRANSFER_COLOUR,
                    alpha=0.7,
                )
                continue
            ax.barh(
                y,
                ev.duration_s,
                left=ev.start_s,
                height=0.6,
                color=_COLOURS[ev.action.kind],
                edgecolor="black",
                linewidth=0.4,
            )
            if ev.duration_s > 0.025 * step:
                ax.text(
                    ev.start_s + ev.duration_s / 2,
                    y,
                    f"{ev.action.kind.value}{ev.action.microbatch}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
        labels = row_labels or {}
        names = [labels.get(r, f"rank {r}") for r in ranks] + list(empty_rows)
        ax.set_yticks(range(rows), names)
        ax.invert_yaxis()
        ax.set_xlim(0, step)
        ax.set_xlabel("seconds")
        figures = f"pipeline {result.step_time_s * 1e3:.2f} ms, bubble {result.bubble_ratio:.1%}"
        ax.set_title(f"{title}: {figures}" if title else figures)
        handles = [Patch(color=c, label=k.value) for k, c in _COLOURS.items()]
        handles.append(Patch(color=_TRANSFER_COLOUR, label="transfer"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=120)
    finally:
        plt.close(fig)
