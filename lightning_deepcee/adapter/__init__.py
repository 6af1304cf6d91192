"""The Dynamic Environment Adapter: the link monitor that decides split / merge / re-plan.

``monitor.py`` is pure (no torch, no Lightning); a thin Lightning Callback feeds it the executor's
per-transfer timings each step and applies its decisions. ``replan.py`` (pure too) turns a
``replan`` decision into an observed profile and a searched plan worth moving to, or not.
``tuner.py`` (pure) tries finer splits after a ``split`` while they shorten the step.
``callback.py`` is the Lightning Callback (:class:`DynamicEnvironmentAdapter`), imported on first
use so that the pure modules import without Lightning. See ``docs/adapter.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_deepcee.adapter.monitor import (
    Decision,
    DecisionKind,
    Link,
    LinkMonitor,
    LinkObservation,
    LinkState,
    MonitorConfig,
    observations_from_transfers,
)
from lightning_deepcee.adapter.replan import (
    LinkFigure,
    ReplanChoice,
    choose_replan,
    figure_from_decision,
    link_figures,
    observed_profile,
)
from lightning_deepcee.adapter.tuner import SplitTuner, TunerDecision

if TYPE_CHECKING:
    from lightning_deepcee.adapter.callback import DynamicEnvironmentAdapter

__all__ = [
    "Decision",
    "DecisionKind",
    "DynamicEnvironmentAdapter",
    "Link",
    "LinkFigure",
    "LinkMonitor",
    "LinkObservation",
    "LinkState",
    "MonitorConfig",
    "ReplanChoice",
    "SplitTuner",
    "TunerDecision",
    "choose_replan",
    "figure_from_decision",
    "link_figures",
    "observations_from_transfers",
    "observed_profile",
]


def __getattr__(name: str) -> Any:
    """``DynamicEnvironmentAdapter`` loads Lightning: imported on first use (PEP 562)."""
    if name == "DynamicEnvironmentAdapter":
        from lightning_deepcee.adapter.callback import DynamicEnvironmentAdapter

        return DynamicEnvironmentAdapter
    raise AttributeError(f"module 'lightning_deepcee.adapter' has no attribute {name!r}")
