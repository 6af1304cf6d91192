"""Confirm with the clock: keep an action only if the measured step time says it paid.

Pure (standard library only). The cost model can be wrong about what an action gains (a link's
figure off its scale, a device whose CPU quota the model does not capture, a schedule the
executor runs differently), so every action the adapter takes is measured: the median step time
(the slowest rank's, the same on every rank) over ``window`` steps after the action against the
median over the last ``window`` steps before it. Roughly::

    guard.record(step, step_s)            # every step: baseline, or the pending action's window
    guard.begin(step, action)             # an action was applied at the end of ``step``
    ...                                   # ``settle`` steps left out, then ``window`` measured
    verdict = guard.record(step, step_s)  # -> Verdict(keep=True/False) when the window is full

- An action *away* from the plan (a split, a re-plan) is kept only if the step got at least
  ``min_gain`` faster: an action that does not measurably pay costs a window, not a run.
- An action *back towards* the plan (fewer pieces, back to the plan's count) is kept unless the
  step got more than ``min_gain`` slower: the plan's own choice needs no proof, only no harm.
- The first ``settle`` steps after an action (and after :meth:`ActionGuard.settle`: a revert, the
  start of training, a resume) are left out: the executors are rebuilt, receive-ahead slots are
  sized by the previous step, blocks may have moved.

The caller reverts an action whose verdict is ``keep=False`` and calls :meth:`settle`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["ActionGuard", "GuardConfig", "Verdict"]

_STATE_DICT_VERSION = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class GuardConfig:
    """How an action is confirmed; every default is explained in ``docs/adapter.md``."""

    window: int = 6
    """Steps measured after an action (and the baseline before it); their medians are compared,
    so up to ``window // 2 - 1`` outlier steps on either side change nothing."""
    settle: int = 2
    """Steps left out after an action before its window starts."""
    min_gain: float = 0.05
    """The least relative drop of the median step time for an action away from the plan to be
    kept (and the most relative rise for one back towards it); above the noise of the median of
    ``window`` steps, so noise alone keeps nothing."""

    def __post_init__(self) -> None:
        for name, minimum in (("window", 1), ("settle", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(
                    f"GuardConfig.{name}: expected an integer >= {minimum}, got {value!r}"
                )
        value = self.min_gain
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            raise ValueError(
                f"GuardConfig.min_gain: expected a number in [0, 1), got {value!r}; set "
                "min_gain=0.05 (the default)"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable copy."""
        return asdict(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """The clock's verdict on one action."""

    step: int
    """The step that completed the action's window."""
    action: dict[str, Any]
    """What :meth:`ActionGuard.begin` was given (the caller's description of the action)."""
    keep: bool
    before_s: float | None
    """Median step time before the action (``None``: no baseline, the action is kept)."""
    after_s: float
    """Median step time over the window after it."""
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable copy."""
        return asdict(self)

    def __str__(self) -> str:
        before = "-" if self.before_s is None else f"{self.before_s * 1e3:.0f}"
        verdict = "keep" if self.keep else "revert"
        return (
            f"step {self.step} {verdict} {self.action.get('kind', 'action')} of step "
            f"{self.action.get('step', '?')}: {before} -> {self.after_s * 1e3:.0f} ms/step "
            f"({self.reason})"
        )


class ActionGuard:
    """Measures the step time around each action and says whether to keep it (module docstring).

    One action is pending at a time; the caller takes no other action until its verdict.
    """

    def __init__(self, config: GuardConfig | None = None) -> None:
        self.config = config if config is not None else GuardConfig()
        self._history: deque[float] = deque(maxlen=self.config.window)
        self._after: list[float] = []
        self._settling = 0
        self._pending: dict[str, Any] | None = None

    @property
    def pending(self) -> dict[str, Any] | None:
        """The action waiting for its verdict (as given to :meth:`begin`), or ``None``."""
        return None if self._pending is None else dict(self._pending["action"])

    @property
    def baseline_s(self) -> float | None:
        """Median step time of the last ``window`` steps measured (``None`` before any)."""
        return statistics.median(self._history) if self._history else None

    def newest_s(self, n: int) -> float | None:
        """Median of the newest ``n`` steps measured, with no action pending (``None`` with
        fewer): the network as it is now, after a change every one of them shows."""
        if self._pending is not None or n < 1 or len(self._history) < n:
            return None
        return statistics.median(list(self._history)[-n:])

    @property
    def steady_s(self) -> float | None:
        """The baseline once it spans a whole window with no action pending, else ``None``."""
        if self._pending is not None or len(self._history) < self.config.window:
            return None
        return statistics.median(self._history)

    def begin(
        self,
        step: int,
        action: Mapping[str, Any],
        *,
        towards_plan: bool,
        newest: int | None = None,
    ) -> None:
        """``action`` was applied at the end of ``step``; judge it after ``settle + window``
        steps against the steps before it (``newest``: against the newest ``newest`` of them, for
        a change every one of them shows while the window still holds steps from before it).
        ``towards_plan``: the action returns towards the plan's own configuration (kept unless
        measurably slower)."""
        if self._pending is not None:
            raise RuntimeError(
                "ActionGuard.begin: an action is already waiting for its verdict "
                f"({self._pending['action']}); take one action at a time"
            )
        before_s = self.newest_s(newest) if newest else None
        self._pending = {
            "action": {**dict(action), "step": step},
            "before_s": self.baseline_s if before_s is None else before_s,
            "towards_plan": bool(towards_plan),
        }
        self._after = []
        self._settling = self.config.settle

    def settle(self) -> None:
        """The configuration changed without an action to judge (a revert, the start of
        training, a resume): leave out the next ``settle`` steps and measure afresh (the
        baseline, or the pending action's window from its start)."""
        self._history.clear()
        self._after = []
        self._settling = self.config.settle

    def cancel(self) -> None:
        """Forget the pending action (what it changed is gone: a resume chose another layout)."""
        self._pending = None
        self.settle()

    def record(self, step: int, step_s: float) -> Verdict | None:
        """One step's time (the slowest rank's); the verdict when an action's window is full."""
        if not (math.isfinite(step_s) and step_s > 0):
            return None
        if self._settling > 0:
            self._settling -= 1
            return None
        if self._pending is None:
            self._history.append(step_s)
            return None
        self._after.append(step_s)
        if len(self._after) < self.config.window:
            return None
        return self._verdict(step)

    def _verdict(self, step: int) -> Verdict:
        pending, after = self._pending, statistics.median(self._after)
        assert pending is not None
        before, towards = pending["before_s"], pending["towards_plan"]
        gain = self.config.min_gain
        if before is None:
            keep, reason = True, "no step time measured before it"
        elif towards:
            keep = after <= before * (1 + gain)
            reason = (
                f"back towards the plan: kept unless more than {gain:.0%} slower, "
                f"{after / before - 1:+.1%}"
            )
        else:
            keep = after <= before * (1 - gain)
            reason = f"kept only if at least {gain:.0%} faster, {after / before - 1:+.1%}"
        self._history = deque(self._after, maxlen=self.config.window)
        self._after = []
        self._pending = None
        return Verdict(
            step=step,
            action=dict(pending["action"]),
            keep=keep,
            before_s=before,
            after_s=after,
            reason=reason,
        )

    # -- checkpointing ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable state (for checkpoints)."""
        return {
            "version": _STATE_DICT_VERSION,
            "config": self.config.to_dict(),
            "history": list(self._history),
            "after": list(self._after),
            "settling": self._settling,
            "pending": self._pending,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict` (this guard's config is kept)."""
        if state.get("version") != _STATE_DICT_VERSION:
            raise ValueError(
                f"ActionGuard.load_state_dict: expected version {_STATE_DICT_VERSION}, got "
                f"{state.get('version')!r}; the checkpoint was written by an incompatible version"
            )
        self._history = deque((float(v) for v in state["history"]), maxlen=self.config.window)
        self._after = [float(v) for v in state["after"]]
        self._settling = int(state["settling"])
        pending = state["pending"]
        self._pending = None if pending is None else dict(pending)
