"""A small synthetic world for the adapter's end-to-end tests, in one process.

The real ``DynamicEnvironmentAdapter`` runs with a stand-in strategy (:class:`WorldStrategy`):
each step's gathered transfers and step time come from this world instead of the all-reduce,
and its step time is the cost model's prediction of whatever the adapter runs (a world in which
the model is right), or what a test's ``world`` makes it. Three equal devices: 0 and 1 on a LAN,
2 across a WAN.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from lightning_deepcee import DeepCEEStrategy, DynamicEnvironmentAdapter
from lightning_deepcee.adapter import (
    LinkFigure,
    observed_profile,
    plan_pairs,
    search_process,
    with_microbatches,
)
from lightning_deepcee.adapter.comeback import probe_bytes
from lightning_deepcee.adapter.exchange import Exchanged
from lightning_deepcee.callbacks import comeback as coming_back
from lightning_deepcee.callbacks import replanner as replanning
from lightning_deepcee.planner import Plan, predict_plan
from lightning_deepcee.profiler import ClusterProfile, DeviceProfile
from tests.helpers.plans import hand_plan


class AtOnce:
    """A background search that has finished when it starts (the tests need known steps)."""

    def __init__(self, request: dict[str, Any]) -> None:
        self._outcome = search_process.run(request)

    def done(self) -> bool:
        return True

    def found(self) -> list[dict[str, Any]]:
        return list(self._outcome.get("plans", []))

    def result(self) -> dict[str, Any]:
        return self._outcome

    def cancel(self) -> None:
        """Nothing runs: there is nothing to stop."""


class NoProbe:
    """A compute probe that times nothing: the synthetic world's ``probe(step)`` gives every
    rank's exchanged probe seconds."""

    def __init__(self, trains: bool) -> None:
        self.trains = trains

    def take(self) -> float:
        return 0.0

    def close(self, timeout_s: float = 30.0) -> bool:
        return True


WAN = 1e7  # bytes/s between the two network groups {0, 1} and {2}
LAN = 1e9


def world_profile(wan: float = WAN) -> ClusterProfile:
    """Three equal devices: 0 and 1 on a LAN, 2 across a WAN; activations big enough for the WAN
    to matter, a per-call cost big enough for needless micro-batches to cost."""
    seconds = (1e-2,) * 6
    devices = tuple(
        DeviceProfile(
            rank=r, host=f"h{r}", kind="cpu", memory_bytes=2**34, forward_s=seconds,
            backward_input_s=seconds, backward_weight_s=tuple(2 * t for t in seconds),
            activation_bytes=(131072,) * 6, parameter_bytes=(1088,) * 6,
            reference_microbatch_size=8, capability=1.0, fixed_s=(1e-2,) * 6,
        )
        for r in range(3)
    )  # fmt: skip
    group = (0, 0, 1)
    bandwidth = [
        [math.inf if i == j else LAN if group[i] == group[j] else wan for j in range(3)]
        for i in range(3)
    ]
    return ClusterProfile(
        devices=devices,
        latency_s=[[0.0 if i == j else 1e-4 for j in range(3)] for i in range(3)],
        bandwidth_bytes_per_s=bandwidth,
        num_blocks=6,
        model_fingerprint="model",
        cluster_fingerprint="cluster",
    )


def world_plan() -> Plan:
    """Devices 0 and 1 share stage 0 by rows and send to device 2 over the WAN, ZB-H1 with two
    micro-batches: the cost model's best micro-batch count on the profile's own links."""
    return hand_plan(
        [((0, 3), (0, 1), (0.5, 0.5)), ((3, 6), (2,), (1.0,))],
        schedule="zb-h1",
        global_batch_size=32,
        model_fingerprint="model",
        cluster_fingerprint="cluster",
    )


def profile_at(fraction: float) -> ClusterProfile:
    """The profile with the WAN (every pair across it, both ways) at ``fraction``."""
    figures = [
        LinkFigure(link=pair, expected_bandwidth=WAN, measured_bandwidth=WAN * fraction,
                   state="degraded" if fraction < 1 else "normal")
        for pair in ((0, 2), (1, 2), (2, 0), (2, 1))
    ]  # fmt: skip
    return observed_profile(world_profile(), figures)[0]


BYTES = 1_000_000  # per pair and step
PROFILE = world_profile()


class WorldStrategy(DeepCEEStrategy):
    """Runs nothing: records the adapter's micro-batch changes and plan moves."""

    def __init__(self, profile: ClusterProfile | None) -> None:
        super().__init__()
        self.stage_part.plan = world_plan()
        self.cluster_profile = profile
        self.stage_part.num_microbatches = self.stage_part.plan.num_microbatches
        self.moves: list[Plan] = []

    @property
    def world_size(self) -> int:
        return 1

    def set_num_microbatches(self, num_microbatches: int) -> None:
        self.stage_part.num_microbatches = num_microbatches

    def apply_plan(self, plan: Plan, trainer: Any) -> None:
        self.moves.append(plan)
        self.stage_part.plan, self.stage_part.num_microbatches = plan, plan.num_microbatches


@functools.cache
def _predicted_cached(fraction: float, plan: str, num_microbatches: int) -> float:
    running = with_microbatches(Plan.from_dict(json.loads(plan)), num_microbatches)
    return predict_plan(profile_at(fraction), running).step_time_s


def predicted(fraction: float, plan: Plan, num_microbatches: int) -> float:
    return _predicted_cached(fraction, json.dumps(plan.to_dict()), num_microbatches)


def model_world(step: int, strategy: WorldStrategy, fraction: float) -> float:
    """The step time the cost model predicts for what runs now (the model is right)."""
    return predicted(fraction, strategy.plan, strategy.num_microbatches)


@dataclasses.dataclass
class Run:
    adapter: DynamicEnvironmentAdapter
    strategy: WorldStrategy
    microbatches: list[int]

    def kinds(self, *kinds: str) -> list[dict[str, Any]]:
        return [d for d in self.adapter.decisions if d["kind"] in kinds]


def run_adapter(
    monkeypatch: pytest.MonkeyPatch,
    steps: int,
    wan: Callable[[int], float] = lambda step: 1.0,
    world: Callable[[int, WorldStrategy, float], float] = model_world,
    *,
    wan_back: Callable[[int], float] | None = None,
    noise: float = 0.03,
    wire: Callable[[int, np.random.Generator], float] = lambda step, rng: 1.0,
    seed: int = 0,
    profile: ClusterProfile | None = PROFILE,
    compute: Callable[[int], list[float]] = lambda step: [],
    probe: Callable[[int], list[float]] = lambda step: [],
    each_step: Callable[[int, DynamicEnvironmentAdapter], None] = lambda step, adapter: None,
    **adapter_args: Any,
) -> Run:
    """Train ``steps`` steps; at each the WAN runs at ``wan(step)`` of the profile (``wan_back``:
    the gradients' direction, if different), both senders of a direction share it (each at
    half), the receivers stamp their arrivals ``wire`` times as fast as that, and the step takes
    ``world(..., the slower direction)`` times +-``noise``; ``compute(step)`` is every rank's
    compute seconds of the step (none by default), ``probe(step)`` every rank's compute probe
    seconds; ``each_step(step, adapter)`` runs before each step's end (a test's hand on the
    adapter's state). The probes of links a re-plan left
    (``adapter.comeback.pairs``) report one message per step at the link's rate."""
    rng = np.random.default_rng(seed)
    strategy = WorldStrategy(profile)
    adapter = DynamicEnvironmentAdapter(**adapter_args)
    monkeypatch.setattr(replanning, "SearchProcess", AtOnce)  # searches land on a known step
    monkeypatch.setattr(coming_back, "open_link_probe", lambda pair, rank, size, **_: None)
    monkeypatch.setattr(coming_back, "start_compute_probe", NoProbe)  # probe(step) has figures
    trainer: Any = SimpleNamespace(strategy=strategy, loggers=[], global_step=0)
    adapter.on_train_start(trainer, None)
    microbatches = []
    for step in range(1, steps + 1):
        trainer.global_step = step
        forward = wan(step)
        back = forward if wan_back is None else wan_back(step)
        rows = [
            [s, d, BYTES, BYTES / (WAN * (forward if s < d else back) / 2) / wire(step, rng)]
            for s, d in plan_pairs(strategy.plan)
        ]
        # A link a re-plan left is probed alone: one message at the link's whole figure.
        size = probe_bytes(WAN)
        rows += [
            [s, d, size, size / (WAN * (forward if s < d else back)) / wire(step, rng)]
            for s, d in adapter.comeback.pairs
        ]
        fraction = min(forward, back)
        seconds = world(step, strategy, fraction) * rng.uniform(1 - noise, 1 + noise)

        def exchange(
            strategy: Any,
            step: int,
            step_s: float,
            count: int,
            done: bool,
            r: Any = rows,
            t: float = seconds,
            c: tuple[float, ...] = tuple(compute(step)),
            p: tuple[float, ...] = tuple(probe(step)),
        ) -> Callable[[], Exchanged]:
            return lambda: Exchanged(step, r, t, count > 0, done, c, p)  # lands at the next step

        monkeypatch.setattr(adapter, "_exchange", exchange)
        each_step(step, adapter)
        adapter.on_train_batch_end(trainer, None, None, None, 0)
        microbatches.append(strategy.num_microbatches)
    return Run(adapter, strategy, microbatches)


def acted(run: Run) -> list[dict[str, Any]]:
    return [d for d in run.adapter.decisions if d["kind"].endswith("-applied")]
