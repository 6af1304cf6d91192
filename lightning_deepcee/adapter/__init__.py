"""The Dynamic Environment Adapter: watch the links, decide with the model, confirm with the clock.

Pure modules (no torch, no Lightning), tested in one process on synthetic timing streams:

- ``records.py``: the monitor's settings, observations and proposals (plain data);
- ``monitor.py``: the link monitor (warm-up, expectations, shared links, hysteresis) that
  proposes split / merge / re-plan;
- ``links.py``: which pairs the running plan uses and the figures to judge them by;
- ``gate.py``: what a change of split is predicted to gain (the running plan re-predicted);
- ``replan.py``: the observed profile and whether a searched plan is worth moving to;
- ``guard.py``: the step time before and after an action, and whether to keep it.

The Lightning Callback (:class:`DynamicEnvironmentAdapter`, ``callbacks/adapter.py``) feeds them
and applies what they decide. Every public name is imported on first use (PEP 562), so that
importing a module of this package loads only what that module needs: the re-plan search's
child (``_paced_child.py``) starts pacing itself before the planner loads. See
``docs/adapter.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_WHERE = {
    "SplitChoice": "lightning_deepcee.adapter.gate",
    "choose_split": "lightning_deepcee.adapter.gate",
    "with_microbatches": "lightning_deepcee.adapter.gate",
    "ActionGuard": "lightning_deepcee.adapter.guard",
    "GuardConfig": "lightning_deepcee.adapter.guard",
    "Verdict": "lightning_deepcee.adapter.guard",
    "link_expectations": "lightning_deepcee.adapter.links",
    "plan_pairs": "lightning_deepcee.adapter.links",
    "Decision": "lightning_deepcee.adapter.monitor",
    "DecisionKind": "lightning_deepcee.adapter.monitor",
    "Link": "lightning_deepcee.adapter.monitor",
    "LinkMonitor": "lightning_deepcee.adapter.monitor",
    "LinkObservation": "lightning_deepcee.adapter.monitor",
    "LinkState": "lightning_deepcee.adapter.monitor",
    "MonitorConfig": "lightning_deepcee.adapter.monitor",
    "SharedLink": "lightning_deepcee.adapter.monitor",
    "observations_from_transfers": "lightning_deepcee.adapter.monitor",
    "LinkFigure": "lightning_deepcee.adapter.replan",
    "ReplanChoice": "lightning_deepcee.adapter.replan",
    "choose_replan": "lightning_deepcee.adapter.replan",
    "figure_from_decision": "lightning_deepcee.adapter.replan",
    "figures_from_decision": "lightning_deepcee.adapter.replan",
    "link_figures": "lightning_deepcee.adapter.replan",
    "observed_profile": "lightning_deepcee.adapter.replan",
    "DynamicEnvironmentAdapter": "lightning_deepcee.callbacks.adapter",
}
"""Where each public name lives (``DynamicEnvironmentAdapter`` loads Lightning)."""


def __getattr__(name: str) -> Any:
    """Import a public name on first use (PEP 562)."""
    if name not in _WHERE:
        raise AttributeError(f"module 'lightning_deepcee.adapter' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
