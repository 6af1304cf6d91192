"""Decide with the model, confirm with the clock: the split gate, the plan's link figures, and the
whole adapter (monitor, gate, re-plan choice, guard) on synthetic streams, in one process.

The end-to-end tests run the real ``DynamicEnvironmentAdapter`` with a stand-in strategy: each
step's gathered transfers and step time come from a small synthetic world instead of the
all-reduce, and the world's step time is the cost model's prediction of whatever the adapter
runs (a world in which the model is right), or one in which the model is wrong.
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
import torch

from lightning_deepcee import DeepCEEStrategy, DynamicEnvironmentAdapter
from lightning_deepcee.adapter import (
    LinkFigure,
    SplitChoice,
    choose_split,
    link_expectations,
    observed_profile,
    plan_pairs,
    search_process,
    with_microbatches,
)
from lightning_deepcee.adapter.exchange import Exchanged
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

    def result(self) -> dict[str, Any]:
        return self._outcome


WAN = 1e7  # bytes/s between the two network groups {0, 1} and {2}
LAN = 1e9


def _profile(wan: float = WAN) -> ClusterProfile:
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


def _plan() -> Plan:
    """Devices 0 and 1 share stage 0 by rows and send to device 2 over the WAN, ZB-H1 with two
    micro-batches: the cost model's best micro-batch count on the profile's own links."""
    return hand_plan(
        [((0, 3), (0, 1), (0.5, 0.5)), ((3, 6), (2,), (1.0,))],
        schedule="zb-h1",
        global_batch_size=32,
        model_fingerprint="model",
        cluster_fingerprint="cluster",
    )


def _at(fraction: float) -> ClusterProfile:
    """The profile with the WAN (every pair across it, both ways) at ``fraction``."""
    figures = [
        LinkFigure(link=pair, expected_bandwidth=WAN, measured_bandwidth=WAN * fraction,
                   state="degraded" if fraction < 1 else "normal")
        for pair in ((0, 2), (1, 2), (2, 0), (2, 1))
    ]  # fmt: skip
    return observed_profile(_profile(), figures)[0]


# --------------------------------------------------------------------------- the split gate


def test_the_gate_refuses_a_split_on_the_plans_own_links() -> None:
    choice = choose_split(_profile(), _plan(), current_split=1, max_split=4, gain=0.1)
    assert not choice.apply and choice.split == 1
    assert min(choice.step_time_s, key=lambda k: choice.step_time_s[k]) == 1
    assert SplitChoice.from_dict(choice.to_dict()) == choice


def test_the_gate_splits_when_the_wan_drops_to_a_quarter() -> None:
    choice = choose_split(_at(0.25), _plan(), current_split=1, max_split=4, gain=0.1)
    assert choice.apply and choice.split > 1 and choice.gain > 0.1
    assert "faster than x1" in choice.reason


def test_the_gate_refuses_a_gain_below_its_threshold() -> None:
    predicted = choose_split(_at(0.25), _plan(), current_split=1, max_split=4, gain=0.0)
    assert predicted.apply
    refused = choose_split(
        _at(0.25), _plan(), current_split=1, max_split=4, gain=predicted.gain + 0.01
    )
    assert not refused.apply and refused.split == 1
    # A milder drop gains less than the default threshold.
    mild = choose_split(_at(0.7), _plan(), current_split=1, max_split=4, gain=0.1)
    assert not mild.apply and mild.split == 1
    with pytest.raises(ValueError, match="gain must be in"):
        choose_split(_profile(), _plan(), current_split=1, max_split=4, gain=1.0)


def test_the_gate_returns_to_the_plans_count_when_no_split_pays() -> None:
    choice = choose_split(_profile(), _plan(), current_split=3, max_split=4, gain=0.1)
    assert choice.apply and choice.split == 1 and "back to the plan's count" in choice.reason
    # A split in force that is still the best, but by less than the threshold: back to the
    # plan's count too (a deviation from the plan must earn its keep).
    mild = choose_split(_at(0.7), _plan(), current_split=1, max_split=4, gain=0.0)
    assert mild.apply and 0 < mild.gain < 0.1
    back = choose_split(_at(0.7), _plan(), current_split=mild.split, max_split=4, gain=0.1)
    assert back.apply and back.split == 1


def test_with_microbatches_runs_another_count_as_the_executor_does() -> None:
    plan = _plan()
    assert with_microbatches(plan, 2) is plan
    assert with_microbatches(plan, 6).num_microbatches == 6
    data = plan.to_dict()
    actions = ["0F0 0F1 0B0 0W0 0B1 0W1", "1F0 1B0 1W0 1F1 1B1 1W1"]
    compact = Plan.from_dict({**data, "schedule": "compact", "stage_actions": actions})
    split = with_microbatches(compact, 4)
    assert split.schedule == "zb-h1" and split.stage_actions is None
    assert predict_plan(_profile(), split).step_time_s > 0


# --------------------------------------------------------------------------- the plan's figures


def test_the_plan_pairs_and_their_figures_follow_the_cost_models_groups() -> None:
    pairs = plan_pairs(_plan())
    assert pairs == [(0, 2), (1, 2), (2, 0), (2, 1)]
    expected, shared = link_expectations(_profile(), [*pairs, (0, 1)])
    assert expected == {(0, 1): LAN}  # inside a group: the pair's own figure
    assert [(s.name, s.pairs, s.capacity) for s in shared] == [
        ("net0->net1", ((0, 2), (1, 2)), WAN),
        ("net1->net0", ((2, 0), (2, 1)), WAN),
    ]
    # One pair of the plan crossing: its own figure, but the link still lists every pair.
    _, (lone, _) = link_expectations(_profile(wan=4e6), [(0, 2), (2, 0)])
    assert lone.pairs == ((0, 2), (1, 2)) and lone.capacity == 4e6
    assert link_expectations(None, pairs) == (dict.fromkeys(pairs), [])


# --------------------------------------------------------------------------- end to end

BYTES = 1_000_000  # per pair and step
PROFILE = _profile()


class _Strategy(DeepCEEStrategy):
    """Runs nothing: records the adapter's micro-batch changes and plan moves."""

    def __init__(self, profile: ClusterProfile | None) -> None:
        super().__init__()
        self.stage_part.plan = _plan()
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
    return predict_plan(_at(fraction), running).step_time_s


def _predicted(fraction: float, plan: Plan, num_microbatches: int) -> float:
    return _predicted_cached(fraction, json.dumps(plan.to_dict()), num_microbatches)


def _model_world(step: int, strategy: _Strategy, fraction: float) -> float:
    """The step time the cost model predicts for what runs now (the model is right)."""
    return _predicted(fraction, strategy.plan, strategy.num_microbatches)


@dataclasses.dataclass
class _Run:
    adapter: DynamicEnvironmentAdapter
    strategy: _Strategy
    microbatches: list[int]

    def kinds(self, *kinds: str) -> list[dict[str, Any]]:
        return [d for d in self.adapter.decisions if d["kind"] in kinds]


def _run(
    monkeypatch: pytest.MonkeyPatch,
    steps: int,
    wan: Callable[[int], float] = lambda step: 1.0,
    world: Callable[[int, _Strategy, float], float] = _model_world,
    *,
    wan_back: Callable[[int], float] | None = None,
    noise: float = 0.03,
    wire: Callable[[int, np.random.Generator], float] = lambda step, rng: 1.0,
    seed: int = 0,
    profile: ClusterProfile | None = PROFILE,
    **adapter_args: Any,
) -> _Run:
    """Train ``steps`` steps; at each the WAN runs at ``wan(step)`` of the profile (``wan_back``:
    the gradients' direction, if different), both senders of a direction share it (each at
    half), the receivers stamp their arrivals ``wire`` times as fast as that, and the step takes
    ``world(..., the slower direction)`` times +-``noise``."""
    rng = np.random.default_rng(seed)
    strategy = _Strategy(profile)
    adapter = DynamicEnvironmentAdapter(**adapter_args)
    gather = lambda out, obj: out.__setitem__(0, obj)  # noqa: E731
    monkeypatch.setattr(torch.distributed, "all_gather_object", gather)
    monkeypatch.setattr(replanning, "SearchProcess", AtOnce)  # searches land on a known step
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
        ) -> Callable[[], Exchanged]:
            return lambda: Exchanged(step, r, t, count > 0, done)  # lands at the next step

        monkeypatch.setattr(adapter, "_exchange", exchange)
        adapter.on_train_batch_end(trainer, None, None, None, 0)
        microbatches.append(strategy.num_microbatches)
    return _Run(adapter, strategy, microbatches)


def _acted(run: _Run) -> list[dict[str, Any]]:
    return [d for d in run.adapter.decisions if d["kind"].endswith("-applied")]


@pytest.mark.parametrize("seed", range(3))
def test_no_action_on_a_network_that_does_not_change(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    # +-20% on the wire, +-10% on the step, 300 steps.
    run = _run(monkeypatch, 300, noise=0.1, wire=lambda s, rng: rng.uniform(0.8, 1.2), seed=seed)
    assert _acted(run) == [] and set(run.microbatches) == {2}
    assert run.adapter.monitor is not None
    assert run.adapter.monitor.signature() == ()


def test_no_action_on_slow_first_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # Start-up: the first 9 steps are 4x slower and their arrivals 5x later.
    def slow(step: int, strategy: _Strategy, fraction: float) -> float:
        return (4.0 if step < 10 else 1.0) * _model_world(step, strategy, fraction)

    run = _run(monkeypatch, 150, world=slow, wire=lambda s, rng: 0.2 if s < 10 else 1.0)
    assert run.adapter.decisions == [] and set(run.microbatches) == {2}


@pytest.mark.parametrize("seed", range(3))
def test_no_action_on_a_cpu_stalled_device_whose_links_are_fine(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    # A device under a CPU quota: a third of the steps stall up to 3x, a fifth of the arrivals
    # are stamped late; the links deliver what the plan expects.
    stalls = np.random.default_rng(100 + seed)

    def stalled(step: int, strategy: _Strategy, fraction: float) -> float:
        stall = stalls.uniform(1.0, 3.0) if stalls.random() < 1 / 3 else 1.0
        return stall * _model_world(step, strategy, fraction)

    late = lambda step, rng: rng.uniform(0.3, 0.7) if rng.random() < 0.2 else 1.0  # noqa: E731
    run = _run(monkeypatch, 300, world=stalled, noise=0.1, wire=late, seed=seed)
    assert _acted(run) == [] and set(run.microbatches) == {2}


def test_two_senders_sharing_the_wan_each_at_half_take_no_action(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # _run always lets both senders of a direction share the WAN: at the profile's figure each
    # pair sees half of it, which judged pair by pair would be a drop on every pair.
    run = _run(monkeypatch, 200)
    assert run.adapter.decisions == []
    monitor = run.adapter.monitor
    assert monitor is not None and monitor.link_names == ["net0->net1", "net1->net0"]
    assert monitor.measured_bandwidth((0, 2)) == pytest.approx(WAN, rel=0.01)


def _drop(step: int) -> float:
    return 0.25 if 60 <= step < 160 else 1.0


def test_a_real_drop_is_split_kept_while_it_pays_and_merged_at_the_restore(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = _run(monkeypatch, 240, _drop, replan_after=1000)
    split, merge = _acted(run)
    assert split["kind"] == "split-applied" and 60 < split["step"] <= 60 + 8 + 1
    assert split["to"] > 1 and run.microbatches[split["step"]] == 2 * split["to"]
    assert merge["kind"] == "merge-applied" and 160 < merge["step"] <= 160 + 8 + 1
    assert run.microbatches[-1] == 2
    verdicts = run.kinds("confirmed", "reverted")
    assert [(v["kind"], v["action_step"]) for v in verdicts] == [
        ("confirmed", split["step"]),
        ("confirmed", merge["step"]),
    ]
    assert verdicts[0]["after_s"] < 0.95 * verdicts[0]["before_s"]
    # Within the window (settle 2 + 6 steps) of each action.
    assert all(v["step"] == v["action_step"] + 8 for v in verdicts)


def test_the_clock_reference_is_taken_only_while_the_links_are_as_profiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The drop starts at step 12, before the monitor has calibrated (step 15) and flagged it
    # (step 18): no reference then, though the links looked as profiled for a few steps. The
    # split configuration runs while the link is degraded and a step or two after the restore
    # is flagged: none for it either. After the restore the plan's own configuration gets its
    # reference on the model's scale (the model is right in this world: measured over
    # predicted is 1 within the noise).
    def early(step: int) -> float:
        return 0.25 if 12 <= step < 100 else 1.0

    run = _run(monkeypatch, 200, early, replan_after=1000)
    assert _acted(run)  # a split while degraded, a merge after
    ((key, (measured, predicted)),) = run.adapter.replanner.clock.items()
    assert json.loads(key)[1] == 1  # the plan's own count, not the split
    assert measured == pytest.approx(predicted, rel=0.05)


def test_a_proposal_during_a_verdict_waits_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # The activations' direction drops first, the gradients' a few steps later: the second
    # proposal arrives while the first split waits for its verdict.
    run = _run(
        monkeypatch, 120, lambda step: 0.25 if step >= 60 else 1.0,
        wan_back=lambda step: 0.25 if step >= 64 else 1.0, replan_after=1000,
    )  # fmt: skip
    first = _acted(run)[0]
    (deferred,) = run.kinds("deferred")
    verdict = run.kinds("confirmed", "reverted")[0]
    assert first["step"] < deferred["step"] < verdict["step"] == first["step"] + 8
    # Considered at the verdict (when the window's last step time lands, a step later): the
    # next entry is its gate outcome.
    entries = run.adapter.decisions
    after = entries[entries.index(verdict) + 1]
    assert after["kind"].startswith("split-") and after["step"] == verdict["step"] + 1


def test_a_split_that_does_not_pay_is_reverted_within_its_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The model is wrong here: more micro-batches make the step 10% slower.
    def wrong(step: int, strategy: _Strategy, fraction: float) -> float:
        base = _predicted(fraction, strategy.plan, 2)
        return base * (1.1 if strategy.num_microbatches > 2 else 1.0)

    run = _run(monkeypatch, 150, _drop, wrong, replan_after=1000)
    (split,) = _acted(run)
    (reverted,) = run.kinds("reverted")
    assert reverted["action_step"] == split["step"] and reverted["step"] == split["step"] + 8
    assert set(run.microbatches[reverted["step"] :]) == {2}
    # The link stays degraded, the same split is not tried again.
    assert run.kinds("confirmed") == []


def test_a_reverted_split_is_not_retried_under_the_same_link_states(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def wrong(step: int, strategy: _Strategy, fraction: float) -> float:
        base = _predicted(fraction, strategy.plan, 2)
        return base * (1.1 if strategy.num_microbatches > 2 else 1.0)

    # The WAN drops at 60, recovers at 100 and drops again at 140.
    def twice(step: int) -> float:
        return 0.25 if 60 <= step < 100 or step >= 140 else 1.0

    run = _run(monkeypatch, 200, twice, wrong, replan_after=1000)
    (split,) = _acted(run)
    assert split["step"] < 100 and run.kinds("reverted")[0]["action_step"] == split["step"]
    again = [d for d in run.kinds("split-kept") if d["step"] > 140]
    assert again and "reverted" in again[0]["reason"]
    assert set(run.microbatches[-40:]) == {2}


def test_the_gate_keeps_the_split_when_the_predicted_gain_is_too_small(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = _run(monkeypatch, 120, _drop, split_gain=0.5, replan_after=1000)
    assert _acted(run) == [] and set(run.microbatches) == {2}
    (kept,) = run.kinds("split-kept")
    assert "needs 50%" in kept["reason"] or "back to" in kept["reason"] or "x1" in kept["reason"]


def test_a_replan_that_does_not_pay_is_reverted_to_the_previous_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The drop persists; no split passes the gate; the re-plan is predicted faster but runs 10%
    # slower than the plan it replaced.
    def wrong(step: int, strategy: _Strategy, fraction: float) -> float:
        base = _predicted(fraction, _plan(), 2)
        return base * (1.0 if strategy.plan == _plan() else 1.1)

    run = _run(monkeypatch, 140, _drop, wrong, split_gain=0.99)
    (applied,) = run.kinds("replan-applied")
    (reverted,) = run.kinds("reverted")
    assert reverted["action"] == "replan" and reverted["step"] == applied["step"] + 8
    moved, back = run.strategy.moves
    assert moved.stages != _plan().stages and back == _plan()
    assert run.strategy.cluster_profile == _profile()  # the profile the plan was made for
    assert run.strategy.plan == _plan() and run.microbatches[-1] == 2


def test_without_a_profile_the_adapter_only_watches(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.warns(UserWarning, match="no cluster profile"):
        run = _run(monkeypatch, 120, _drop, profile=None)
    assert _acted(run) == [] and set(run.microbatches) == {2}
    skipped = run.kinds("split-skipped")
    assert skipped and all("needs a cluster profile" in d["reason"] for d in skipped)
    assert run.kinds("split")  # the proposals themselves are logged
