"""Split tuner: after a ``split``, try finer splits while they measurably shorten the step.

The monitor's split factor, ``ceil(expected / measured)``, makes each piece's time on the slow
link what the plan assumed for a whole micro-batch. It does not know how much of the step the
link's transfers are: on a link that carries most of the step, finer pieces keep overlapping
more of the transfer with the next stage's compute (and, with receives posted ahead, the
forward and backward streams with each other), until the per-piece cost (a message's latency,
an action's fixed cost) eats the gain. Where that point lies depends on the link, the model and
the devices, so the tuner measures it: it holds each split for ``window`` steps (after
``settle`` steps for the new split to take hold), and moves one piece finer while the median
step time improves by at least ``min_gain``; otherwise it returns to the best split seen and
stops. It never goes below the monitor's split and never above ``max_split``.

Pure (standard library only): the Lightning callback feeds it one step time per step, the same
on every rank (a max over ranks), so every rank takes the same decisions.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["SplitTuner", "TunerDecision"]


@dataclass(frozen=True, slots=True)
class TunerDecision:
    """A change of the split in force: ``split`` from ``step + 1`` on, and why."""

    step: int
    kind: str
    """``probe`` (try one piece more), ``revert`` (back to the best split, tuning stops) or
    ``keep`` (the largest split helped; tuning stops)."""
    split: int
    measured_s: float
    """Median step time of the split just measured."""
    best_s: float
    """Median step time of the best split so far (the one measured, if it is the best)."""

    def __str__(self) -> str:
        return (
            f"step {self.step} tune {self.kind} x{self.split}: {self.measured_s * 1e3:.0f} ms/step "
            f"measured, best {self.best_s * 1e3:.0f} ms/step"
        )


@dataclass
class SplitTuner:
    """Hill-climbs the split factor by measured step time (see the module docstring)."""

    max_split: int
    window: int = 5
    settle: int = 1
    """Steps left out after each change: the first step with new micro-batch sizes rebuilds the
    executors and cannot receive ahead (its slot sizes are from the old split)."""
    min_gain: float = 0.05
    """The least relative improvement of the median step time for a finer split to be kept; it
    stays above the step time's noise between windows, so noise alone never keeps a split."""
    active: bool = False
    split: int = 1
    best_split: int = 1
    best_s: float | None = None
    _seen: int = 0
    _samples: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name, minimum in (("max_split", 1), ("window", 1), ("settle", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(
                    f"SplitTuner.{name}: expected an integer >= {minimum}, got {value!r}"
                )
        if not 0 <= self.min_gain < 1:
            raise ValueError(
                f"SplitTuner.min_gain: expected a number in [0, 1), got {self.min_gain}"
            )

    def start(self, split: int) -> None:
        """The monitor put ``split`` in force: measure it, then try finer ones."""
        self.active = split < self.max_split
        self.split = self.best_split = split
        self.best_s = None
        self._reset()

    def stop(self) -> None:
        """The split was dropped (merge, re-plan): nothing to tune."""
        self.active = False
        self._reset()

    def observe(self, step: int, step_s: float) -> TunerDecision | None:
        """One step's time under the split in force; a decision when a window is complete."""
        if not self.active or step_s <= 0:
            return None
        self._seen += 1
        if self._seen <= self.settle:
            return None
        self._samples.append(step_s)
        if len(self._samples) < self.window:
            return None
        measured = statistics.median(self._samples)
        self._reset()
        if self.best_s is None or measured < self.best_s * (1 - self.min_gain):
            self.best_s, self.best_split = measured, self.split
            if self.split >= self.max_split:
                self.active = False
                return TunerDecision(step, "keep", self.split, measured, measured)
            self.split += 1
            return TunerDecision(step, "probe", self.split, measured, measured)
        self.active = False
        self.split = self.best_split
        return TunerDecision(step, "revert", self.split, measured, self.best_s)

    def _reset(self) -> None:
        self._seen = 0
        self._samples = []

    def state_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable state (for checkpoints)."""
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, list(value) if key == "_samples" else value)
