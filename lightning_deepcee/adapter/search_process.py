"""The re-plan search in a child process of its own, paced under a CPU quota (pure).

A search over device subsets and micro-batch counts takes seconds of CPU. Run as a thread of the
training process it holds the GIL against the training loop; run on a device under a CPU quota
(a container's CPU limit, a Kubernetes ``limits.cpu``, the lab's devices) it spends the quota
while training waits for a message, and training's next burst then stalls until the quota's next
period, however low the search's priority. So the search runs in a child process at the lowest
priority (``nice 19``) and, under a quota, spends at most ``share`` of each period's budget
(a ``SIGPROF`` timer counts its CPU and sleeps out the period when the share is spent), leaving
the rest to the training process and its communication threads. Both hold from the child's
first line: its entry (``_paced_child.py``) sets them before it imports the planner.

A re-plan searches the running plan's neighbourhood first (its training devices and their
subsets, half, the same and twice its micro-batches), which takes a fraction of a whole search,
and the whole cluster only when no plan near it pays.

Request and outcome are JSON files in a temporary folder: the request holds the observed
profile, the running plan, the margin and the strategy's ``device_gain`` and ``compression``;
the outcome is :meth:`ReplanChoice.to_dict` or ``{"error": ...}``. A search of plans ahead
also appends each plan to a file as it finds it, which the parent reads while it runs
(:meth:`SearchProcess.found`).
``python -m lightning_deepcee.adapter._paced_child FOLDER
lightning_deepcee.adapter.search_process:run`` runs one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lightning_deepcee.adapter._paced_child import ERRORS, FOUND, OUTCOME, REQUEST, pace

__all__ = ["SearchProcess", "pace", "run"]

_CHILD = "lightning_deepcee.adapter._paced_child"
"""The child's entry: priority and pace first, then this module's :func:`run`."""
_ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def run(
    request: Mapping[str, Any], emit: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """The search itself, as a dict: ``choose_replan`` on the request's profile and plan (the
    plan's neighbourhood first, ``neighbourhood_search``, and the whole cluster only when no
    plan near it pays by the request's ``"gain"``), or with ``"kind": "contingencies"`` a plan
    for each scenario of the request's ``"scopes"`` (``"links"``: ``contingency_profiles``,
    ``"devices"``: ``device_contingency_profiles``, in that order), searched in the plan's
    neighbourhood, those named in ``"skip"`` left out (``{"plans": [{"name": ..., "plan":
    ...}, ...]}``, a scenario nothing fits left out); ``emit`` takes each of those entries as
    soon as it is found."""
    from lightning_deepcee.adapter.contingency import (
        contingency_profiles,
        device_contingency_profiles,
        neighbourhood_search,
    )
    from lightning_deepcee.adapter.replan import choose_replan, placement_key
    from lightning_deepcee.planner.cost_model import predict_plan
    from lightning_deepcee.planner.plan import Plan
    from lightning_deepcee.planner.prediction import CostModelConfig
    from lightning_deepcee.planner.search import DEVICE_GAIN, plan_search
    from lightning_deepcee.profiler.data import ClusterProfile

    profile = ClusterProfile.from_dict(request["profile"])
    current = Plan.from_dict(request["plan"])
    device_gain = float(request.get("device_gain", DEVICE_GAIN))
    config = CostModelConfig(compression=tuple(request.get("compression", ())))
    search = functools.partial(
        plan_search,
        num_blocks=current.num_blocks,
        global_batch_size=current.global_batch_size,
        device_gain=device_gain,
        config=config,
    )
    if request.get("kind") == "contingencies":
        plans = []
        listed = {"links": contingency_profiles, "devices": device_contingency_profiles}
        skip = set(request.get("skip", ()))
        for scope in request.get("scopes", ("links", "devices")):
            for name, scenario in listed[scope](profile, current):
                if name in skip:
                    continue
                try:
                    found = neighbourhood_search(
                        scenario, current, device_gain=device_gain, config=config
                    )
                except ValueError:  # nothing fits that scenario: no plan ahead for it
                    continue
                plans.append({"name": name, "plan": found.to_dict()})
                if emit is not None:
                    emit(plans[-1])
        return {"plans": plans}
    clocked = request.get("current_s")
    current_s = None if clocked is None else float(clocked)
    gain = float(request["gain"])

    def near_first(observed: ClusterProfile, **_: Any) -> Plan:
        """The plan's neighbourhood first (seconds, not minutes): taken when it pays by
        ``gain``; the whole cluster is searched only when it does not."""
        reference = predict_plan(observed, current).step_time_s if current_s is None else current_s
        with contextlib.suppress(ValueError):  # nothing fits the neighbourhood
            near = neighbourhood_search(observed, current, device_gain=device_gain, config=config)
            near_s = predict_plan(observed, near, config=config).step_time_s
            if placement_key(near) != placement_key(current) and near_s < reference * (1 - gain):
                return dataclasses.replace(near, predicted_step_time_s=near_s)
        return search(observed)

    return choose_replan(
        profile, current, gain=gain, search=near_first, current_s=current_s
    ).to_dict()


def _reap(process: subprocess.Popen[bytes], folder: str) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()
    shutil.rmtree(folder, ignore_errors=True)


class SearchProcess:
    """One re-plan search running in a child process (the parent's side).

    Args:
        request: ``{"profile": ..., "plan": ..., "gain": ...}`` (dicts of the observed profile
            and the running plan) and optionally ``"cpu": [cores, period_s]`` (the quota this
            device runs under) with ``"share"``, the part of it the search may spend.
    """

    def __init__(self, request: Mapping[str, Any]) -> None:
        self._folder = tempfile.mkdtemp(prefix="deepcee-replan-")
        folder = Path(self._folder)
        (folder / REQUEST).write_text(json.dumps(dict(request)))
        env = dict(os.environ)
        source = str(Path(__file__).resolve().parents[2])  # the package's own copy, first
        env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
        env.update(dict.fromkeys(_ONE_THREAD, "1"))
        with open(folder / ERRORS, "wb") as errors:
            self._process = subprocess.Popen(
                [sys.executable, "-m", _CHILD, self._folder, f"{__name__}:run"],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors,
            )  # fmt: skip
        self._finalizer = weakref.finalize(self, _reap, self._process, self._folder)
        self._outcome: dict[str, Any] | None = None

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._process.pid

    def done(self) -> bool:
        """The search has finished (or failed)."""
        return self._process.poll() is not None

    def found(self) -> list[dict[str, Any]]:
        """The entries a contingency search has found so far (whole lines only; ``[]`` once
        its folder is gone: take :meth:`result` then)."""
        try:
            text = (Path(self._folder) / FOUND).read_text()
        except OSError:
            return []
        return [json.loads(line) for line in text.split("\n")[:-1]]

    def result(self) -> dict[str, Any]:
        """Its outcome (waits for it); its error raised as ``RuntimeError``."""
        if self._outcome is None:
            self._process.wait()
            self._outcome = self._read()
            self._finalizer()
        if "error" in self._outcome:
            raise RuntimeError(self._outcome["error"])
        return self._outcome

    def _read(self) -> dict[str, Any]:
        folder = Path(self._folder)
        try:
            outcome: dict[str, Any] = json.loads((folder / OUTCOME).read_text())
        except (OSError, ValueError):
            errors = (folder / ERRORS).read_text(errors="replace").strip().splitlines()
            tail = " | ".join(errors[-3:]) or "no output"
            return {"error": f"the search process exited {self._process.returncode}: {tail}"}
        return outcome

    def cancel(self) -> None:
        """Stop the search if it still runs and remove its files."""
        self._finalizer()
