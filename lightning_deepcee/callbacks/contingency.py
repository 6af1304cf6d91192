"""The adapter's plans searched ahead (``adapter/contingency.py``), kept on the searcher.

:class:`Contingencies` belongs to the :class:`~lightning_deepcee.callbacks.replanner.Replanner`
and lives on the searcher only (the device that runs re-plan searches, ``replanner.searcher``):
while nothing else is searched there it searches, in a child process paced like a re-plan
search, the plans for each wide-area link of the running layout at a tenth, then for each of its
training devices at a third of its speed, and keeps them per layout (a revert or a move back
finds them again). Each plan is usable as soon as it is found: the child writes them one by
one, and a pause (a re-plan search needs the device) keeps them and leaves the rest for later.
Starting and collecting them is local to the searcher, without a collective; the choice among
them, when a re-plan is proposed, is made there and broadcast with the re-plan's other outcomes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from lightning_deepcee.adapter.contingency import choose_contingency
from lightning_deepcee.adapter.replan import placement_key
from lightning_deepcee.adapter.search_process import SearchProcess

if TYPE_CHECKING:
    from lightning_deepcee.callbacks.strategy_view import AdaptableStrategy
    from lightning_deepcee.profiler import ClusterProfile

__all__ = ["Contingencies"]


class Contingencies:
    """Plans searched ahead for the running layout's wide-area links and devices, on the
    searcher."""

    def __init__(self, start: Callable[[Mapping[str, Any]], SearchProcess]) -> None:
        self._start = start
        """Starts a search process on a request (``SearchProcess``)."""
        self.plans: dict[str, list[dict[str, Any]]] = {}
        """Per layout (``placement_key`` as JSON): ``{"name", "plan"}`` dicts searched ahead."""
        self._searched: set[str] = set()
        """The layouts whose every scenario was searched."""
        self._job: SearchProcess | None = None
        self._job_key: str | None = None

    def prepare(self, strategy: AdaptableStrategy, pacing: dict[str, Any]) -> None:
        """Take what the search running has found; start one for the running layout if it has
        none (call on the searcher, between steps, while no re-plan search runs there)."""
        self._collect()
        profile = strategy.cluster_profile
        if self._job is not None or profile is None:
            return
        plan = strategy.current_plan()
        key = json.dumps(placement_key(plan))
        if key in self._searched:
            return
        self._job_key = key
        self._job = self._start(
            {"kind": "contingencies", "scopes": list(_SCOPES),
             "skip": [entry["name"] for entry in self.plans.get(key, [])],
             "profile": profile.to_dict(), "plan": plan.to_dict(),
             "device_gain": strategy.device_gain, "compression": list(strategy.compression),
             **pacing}
        )  # fmt: skip

    def choose(
        self, strategy: AdaptableStrategy, observed: ClusterProfile, current_s: float, gain: float
    ) -> dict[str, Any]:
        """On the searcher: the running layout's plans searched ahead so far, the fastest on
        ``observed`` as a ``ReplanChoice`` dict, or ``{"reason": ...}`` saying why there is
        none (not yet searched, or none differs from the running layout)."""
        from lightning_deepcee.planner import Plan

        self._collect()
        current = strategy.current_plan()
        key = json.dumps(placement_key(current))
        ready = self.plans.get(key, [])
        plans = [(entry["name"], Plan.from_dict(entry["plan"])) for entry in ready]
        choice = choose_contingency(observed, current, current_s, plans, gain=gain)
        if choice is not None:
            return choice.to_dict()
        searching = self._job is not None and self._job_key == key
        state = (
            "still searching" if searching else "searched" if key in self._searched else "not begun"
        )
        return {
            "reason": f"{len(ready)} plan(s) searched ahead for this layout, none of another "
            f"layout ({state})"
        }

    def pause(self) -> None:
        """Stop a search in progress (a re-plan search needs the device), keeping what it found;
        a later one searches the rest."""
        job, key = self._job, self._job_key
        if job is not None and key is not None:
            self._keep(key, job.found())
            job.cancel()
        self._job = self._job_key = None

    def _collect(self) -> None:
        job, key = self._job, self._job_key
        if job is None or key is None:
            return
        found = job.found()  # what it wrote so far, a plan per scenario as each is searched
        if job.done():
            self._job = self._job_key = None
            self._searched.add(key)
            with contextlib.suppress(RuntimeError):  # a failed search: what it found stands
                found = list(job.result()["plans"])
        self._keep(key, found)

    def _keep(self, key: str, entries: list[dict[str, Any]]) -> None:
        have = {entry["name"] for entry in self.plans.get(key, [])}
        fresh = [entry for entry in entries if entry["name"] not in have]
        self.plans[key] = self.plans.get(key, []) + fresh


_SCOPES = ("links", "devices")
"""What is searched ahead, in this order: each wide-area link at a tenth, each device slowed."""
