"""The Dynamic Environment Adapter: the link monitor that decides split / merge / re-plan.

``monitor.py`` is pure (no torch, no Lightning); a thin Lightning Callback feeds it the executor's
per-transfer timings each step and applies its decisions. See ``docs/adapter.md``.
"""

from __future__ import annotations

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

__all__ = [
    "Decision",
    "DecisionKind",
    "Link",
    "LinkMonitor",
    "LinkObservation",
    "LinkState",
    "MonitorConfig",
    "observations_from_transfers",
]
