"""The Dynamic Environment Adapter: watch the links, decide with the model, confirm with the clock.

Pure modules (no torch, no Lightning), tested in one process on synthetic timing streams:

- ``records.py``: the monitor's settings, observations and proposals (plain data);
- ``monitor.py``: the link monitor (warm-up, expectations, shared links, hysteresis) that
  proposes split / merge / re-plan;
- ``links.py``: which pairs the running plan uses and the figures to judge them by;
- ``gate.py``: what a change of split is predicted to gain (the running plan re-predicted);
- ``replan.py``: the observed profile and whether a searched plan is worth moving to;
- ``guard.py``: the step time before and after an action, and whether to keep it.

``callback.py`` is the Lightning Callback (:class:`DynamicEnvironmentAdapter`) that feeds them and
applies what they decide, imported on first use so that the pure modules import without
Lightning. See ``docs/adapter.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_deepcee.adapter.gate import SplitChoice, choose_split, with_microbatches
from lightning_deepcee.adapter.guard import ActionGuard, GuardConfig, Verdict
from lightning_deepcee.adapter.links import link_expectations, plan_pairs
from lightning_deepcee.adapter.monitor import (
    Decision,
    DecisionKind,
    Link,
    LinkMonitor,
    LinkObservation,
    LinkState,
    MonitorConfig,
    SharedLink,
    observations_from_transfers,
)
from lightning_deepcee.adapter.replan import (
    LinkFigure,
    ReplanChoice,
    choose_replan,
    figure_from_decision,
    figures_from_decision,
    link_figures,
    observed_profile,
)

if TYPE_CHECKING:
    from lightning_deepcee.callbacks.adapter import DynamicEnvironmentAdapter

__all__ = [
    "ActionGuard",
    "Decision",
    "DecisionKind",
    "DynamicEnvironmentAdapter",
    "GuardConfig",
    "Link",
    "LinkFigure",
    "LinkMonitor",
    "LinkObservation",
    "LinkState",
    "MonitorConfig",
    "ReplanChoice",
    "SharedLink",
    "SplitChoice",
    "Verdict",
    "choose_replan",
    "choose_split",
    "figure_from_decision",
    "figures_from_decision",
    "link_expectations",
    "link_figures",
    "observations_from_transfers",
    "observed_profile",
    "plan_pairs",
    "with_microbatches",
]


def __getattr__(name: str) -> Any:
    """``DynamicEnvironmentAdapter`` loads Lightning: imported on first use (PEP 562)."""
    if name == "DynamicEnvironmentAdapter":
        from lightning_deepcee.callbacks.adapter import DynamicEnvironmentAdapter

        return DynamicEnvironmentAdapter
    raise AttributeError(f"module 'lightning_deepcee.adapter' has no attribute {name!r}")
