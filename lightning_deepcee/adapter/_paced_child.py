"""A child process's entry that is paced before it loads the work it runs (the re-plan search).

``python -m lightning_deepcee.adapter._paced_child FOLDER MODULE:FUNCTION`` lowers its own
priority (``nice 19``) and, under a CPU quota, paces itself to its share of it (:func:`pace`)
before it imports anything beyond the standard library: the planner's imports (numpy, scipy)
cost about a second and a half of CPU, twelve seconds or more of a device at a tenth of a core,
and unpaced they take the quota from the training process beside them. Then it imports
``MODULE``, calls ``FUNCTION(request, emit)`` on the request in ``FOLDER`` and writes its
outcome there. The packages' ``__init__`` files it runs first load only the standard library
(the adapter's names load on first use). The parent's side is
:class:`~lightning_deepcee.adapter.search_process.SearchProcess`, whose ``run`` is the function.

Standard library only (``tests/unit/adapter/test_adapter_replan.py`` checks it).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["ERRORS", "FOUND", "OUTCOME", "REQUEST", "main", "pace"]

REQUEST, OUTCOME, ERRORS = "request.json", "outcome.json", "stderr.txt"
FOUND = "found.jsonl"
"""Entries a contingency search has found so far, one JSON line each (read while it runs)."""


def pace(cores: float, period_s: float, share: float) -> None:
    """Keep this process's CPU to ``share`` of a quota of ``cores`` per ``period_s``: every few
    milliseconds of CPU (the kernel's timer ticks) a ``SIGPROF`` handler checks the spending
    since the window began; once a period's share is spent it sleeps until the spending is back
    at the rate, overshoot included (the Python code pauses between bytecodes)."""
    if not (cores > 0 and period_s > 0 and 0 < share <= 1):
        raise ValueError(f"pace: needs cores, period_s > 0 and share in (0, 1], got "
                         f"{cores}, {period_s}, {share}")  # fmt: skip
    rate = share * cores  # CPU seconds per second
    budget = rate * period_s
    window = {"wall": time.monotonic(), "cpu": time.process_time()}

    def check(signum: int, frame: FrameType | None) -> None:
        now, cpu = time.monotonic(), time.process_time()
        spent = cpu - window["cpu"]
        if spent >= budget:  # sleep until the window's spending is back at the rate
            time.sleep(max(0.0, window["wall"] + spent / rate - now))
        if spent >= budget or now - window["wall"] >= period_s:
            window["wall"], window["cpu"] = time.monotonic(), time.process_time()

    tick = max(budget / 4, 0.001)
    signal.signal(signal.SIGPROF, check)
    signal.setitimer(signal.ITIMER_PROF, tick, tick)


def main(argv: Sequence[str]) -> int:
    """Run the request in folder ``argv[0]`` with the function ``argv[1]`` (``module:name``)
    and write its outcome there (the child's side): priority and pace first, the function's
    imports after."""
    folder, (module, _, name) = Path(argv[0]), argv[1].partition(":")
    with contextlib.suppress(OSError):
        os.nice(19)
    request = json.loads((folder / REQUEST).read_text())
    if request.get("cpu") is not None:
        cores, period_s = request["cpu"]
        pace(float(cores), float(period_s), float(request["share"]))

    def emit(entry: dict[str, Any]) -> None:
        with open(folder / FOUND, "a") as found:
            found.write(json.dumps(entry) + "\n")

    try:
        outcome = getattr(importlib.import_module(module), name)(request, emit)
    except Exception as exc:  # the parent raises it on every rank
        outcome = {"error": f"{type(exc).__name__}: {exc}"}
    signal.setitimer(signal.ITIMER_PROF, 0, 0)
    partial = folder / (OUTCOME + ".part")
    partial.write_text(json.dumps(outcome))
    partial.replace(folder / OUTCOME)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
