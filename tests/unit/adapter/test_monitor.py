"""The adapter's link monitor on synthetic timing streams: no flapping, prompt reactions, no
proposal on warm-up, stalls or shared links, exact state round trips. Pure and fast (no torch, no
processes)."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_deepcee.adapter import (
    Decision,
    Link,
    LinkMonitor,
    LinkObservation,
    MonitorConfig,
    SharedLink,
    observations_from_transfers,
)
from tests.helpers.paths import ROOT

EXPECTED = 10e6  # bytes/s
LATENCY = 0.02  # s
NUM_BYTES = 1 << 20
LINK: Link = (0, 1)
# The state machine against the plan's figure from the first sample (warm-up and calibration are
# tested on their own below).
CFG = MonitorConfig(warmup_steps=0, calibration_steps=0)
# A step change must be acted on within this many samples (window fills, then react_after).
BOUND = CFG.window + CFG.react_after


def _monitor(config: MonitorConfig = CFG, links: Sequence[Link] = (LINK,)) -> LinkMonitor:
    return LinkMonitor(
        {link: EXPECTED for link in links}, {link: LATENCY for link in links}, config
    )


def _obs(
    step: int, factor: float, link: Link = LINK, num_bytes: int = NUM_BYTES
) -> LinkObservation:
    """One transfer over ``link`` at ``factor`` times the expected bandwidth."""
    return LinkObservation(step, *link, num_bytes, LATENCY + num_bytes / (EXPECTED * factor))


def _feed(monitor: LinkMonitor, factors: Sequence[float], start: int = 0) -> list[Decision]:
    decisions: list[Decision] = []
    for offset, factor in enumerate(factors):
        step = start + offset
        decisions += monitor.observe(step, [_obs(step, float(factor))])
    return decisions


def _kinds(decisions: Sequence[Decision], *kinds: str) -> list[Decision]:
    return [d for d in decisions if d.kind in kinds]


# -- no flapping -------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(25))
def test_multiplicative_noise_never_triggers(seed: int) -> None:
    rng = np.random.default_rng(seed)
    monitor = _monitor(links=[(0, 1), (1, 2), (2, 1)])
    decisions = []
    for step in range(500):
        factors = rng.uniform(0.8, 1.2, size=3)
        observations = [
            _obs(step, float(f), link)
            for f, link in zip(factors, [(0, 1), (1, 2), (2, 1)], strict=True)
        ]
        decisions += monitor.observe(step, observations)
    assert decisions == []
    assert all(monitor.current_split(link) == 1 for link in monitor.links)
    assert all(monitor.link_state(link) == "normal" for link in monitor.links)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.8, 1.2), min_size=1, max_size=300))
def test_any_noise_within_20_percent_never_triggers(factors: list[float]) -> None:
    assert _feed(_monitor(), factors) == []


def test_single_step_spikes_are_filtered_by_the_median() -> None:
    # One terrible step in every window never reaches the median.
    factors = [0.05 if step % CFG.window == 0 else 1.0 for step in range(300)]
    assert _feed(_monitor(), factors) == []


def test_alternating_every_step_does_not_flap() -> None:
    # Medians alternate below and above the thresholds, so no streak reaches react_after.
    assert _feed(_monitor(), [0.5, 1.0] * 150) == []


# -- fast response -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [None, 0, 1, 2, 3])
def test_drop_to_half_is_split_in_two_within_bound(seed: int | None) -> None:
    drop = 50
    rng = np.random.default_rng(seed)
    # Noiseless 50%, or noise that keeps the link between 50% and 60% of the plan.
    low = [0.5] * 60 if seed is None else list(rng.uniform(0.5, 0.6, 60))
    monitor = _monitor()
    decisions = _kinds(_feed(monitor, [1.0] * drop + low), "split", "merge")
    assert [d.kind for d in decisions] == ["split"]
    (split,) = decisions
    assert drop <= split.step < drop + BOUND
    assert split.split_factor == 2
    assert split.link == LINK
    assert split.old_bandwidth == EXPECTED
    assert 0.5 * EXPECTED * 0.999 <= split.new_bandwidth <= 0.6 * EXPECTED * 1.001
    assert monitor.current_split(LINK) == 2
    assert monitor.link_state(LINK) == "degraded"


@pytest.mark.parametrize(("factor", "split_factor"), [(0.6, 2), (0.4, 3), (0.3, 4), (0.1, 4)])
def test_split_factor_is_ceil_of_ratio_capped(factor: float, split_factor: int) -> None:
    decisions = _kinds(_feed(_monitor(), [1.0] * 10 + [factor] * 10), "split", "merge")
    assert [(d.kind, d.split_factor) for d in decisions] == [("split", split_factor)]


def test_max_split_caps_the_factor() -> None:
    monitor = _monitor(dataclasses.replace(CFG, max_split=2))
    (decision,) = _kinds(_feed(monitor, [1.0] * 10 + [0.1] * 10), "split")
    assert decision.split_factor == 2


def test_recovery_merges_within_bound() -> None:
    monitor = _monitor()
    recover = 80
    decisions = _feed(monitor, [1.0] * 50 + [0.5] * 30 + [1.0] * 40)
    merges = _kinds(decisions, "merge")
    assert [d.kind for d in _kinds(decisions, "split", "merge")] == ["split", "merge"]
    (merge,) = merges
    assert recover <= merge.step < recover + BOUND
    assert merge.split_factor == 1
    assert monitor.current_split(LINK) == 1
    assert monitor.link_state(LINK) == "normal"


def test_only_the_degraded_link_is_split() -> None:
    monitor = _monitor(links=[(0, 1), (1, 2)])
    decisions: list[Decision] = []
    for step in range(40):
        slow = 0.5 if step >= 20 else 1.0
        decisions += monitor.observe(step, [_obs(step, 1.0, (0, 1)), _obs(step, slow, (1, 2))])
    assert [(d.kind, d.link) for d in decisions] == [("split", (1, 2))]
    assert monitor.current_split((0, 1)) == 1
    assert monitor.current_split((1, 2)) == 2


# -- hysteresis --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_oscillation_at_the_slow_threshold_transitions_at_most_once(seed: int) -> None:
    rng = np.random.default_rng(seed)
    threshold = 1 / CFG.slow_threshold
    factors = list(threshold * rng.uniform(0.93, 1.07, 500))
    decisions = _kinds(_feed(_monitor(), factors), "split", "merge")
    # Once degraded, recovery needs 1/fast_threshold = 0.8 of the plan, never reached here.
    assert len(decisions) <= 1
    assert all(d.kind == "split" for d in decisions)


@pytest.mark.parametrize("seed", range(10))
def test_oscillation_at_the_fast_threshold_transitions_at_most_once(seed: int) -> None:
    rng = np.random.default_rng(seed)
    threshold = 1 / CFG.fast_threshold
    factors = [0.5] * 20 + list(threshold * rng.uniform(0.93, 1.07, 500))
    decisions = _kinds(_feed(_monitor(), factors), "split", "merge")
    # One split for the drop, then at most one merge: degrading again needs 0.67, not reached.
    assert [d.kind for d in decisions][:1] == ["split"]
    assert len(decisions) <= 2
    assert all(d.kind == "merge" for d in decisions[1:])


@pytest.mark.parametrize("half_period", [15, 30, 45])
def test_square_wave_gives_one_transition_per_half_cycle(half_period: int) -> None:
    num_cycles = 6
    factors = ([1.0] * half_period + [0.5] * half_period) * num_cycles
    decisions = _kinds(_feed(_monitor(), factors), "split", "merge")
    assert [d.kind for d in decisions] == ["split", "merge"] * (num_cycles - 1) + ["split"]
    for decision in decisions:
        since_edge = decision.step % half_period
        assert since_edge < BOUND


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([0.1, 0.3, 0.5, 0.66, 0.7, 0.8, 1.0, 1.6, 3.0]), st.integers(1, 12)
        ),
        min_size=1,
        max_size=40,
    )
)
def test_any_stream_alternates_split_and_merge(runs: list[tuple[float, int]]) -> None:
    factors = [factor for factor, length in runs for _ in range(length)]
    monitor = _monitor()
    decisions = _feed(monitor, factors)
    transitions = _kinds(decisions, "split", "merge")
    for index, decision in enumerate(transitions):
        assert decision.kind == ("split" if index % 2 == 0 else "merge")
        if decision.kind == "split":
            assert 2 <= decision.split_factor <= CFG.max_split
        else:
            assert decision.split_factor == 1
    steps = [d.step for d in transitions]
    assert all(b - a >= CFG.react_after for a, b in itertools.pairwise(steps))
    expected_split = transitions[-1].split_factor if transitions else 1
    assert monitor.current_split(LINK) == expected_split
    # Every replan belongs to a persisting state: at least replan_after after its transition,
    # or with it when the change was severe.
    for replan in _kinds(decisions, "replan"):
        earlier = [d.step for d in transitions if d.step <= replan.step]
        if "severe_threshold" in replan.reason:  # every sample of the window beyond it
            assert not (EXPECTED / 4 <= replan.new_bandwidth <= 4 * EXPECTED)
        elif earlier:
            assert replan.step - earlier[-1] >= CFG.replan_after


# -- slow response -----------------------------------------------------------------------------


def test_persistent_drop_replans_exactly_once() -> None:
    monitor = _monitor()
    decisions = _feed(monitor, [1.0] * 50 + [0.5] * 300)
    assert [d.kind for d in decisions] == ["split", "replan"]
    split, replan = decisions
    assert replan.step == split.step + CFG.replan_after
    assert replan.new_bandwidth == pytest.approx(0.5 * EXPECTED, rel=1e-6)
    assert replan.old_bandwidth == EXPECTED
    assert replan.split_factor == 2


@pytest.mark.parametrize("factor", [0.2, 0.1, 0.02])
def test_a_severe_drop_splits_and_replans_at_once(factor: float) -> None:
    monitor = _monitor()
    decisions = _feed(monitor, [1.0] * 50 + [factor] * 100)
    assert [d.kind for d in decisions] == ["split", "replan"]
    split, replan = decisions
    # At the severe_window-th severe sample (no react_after streak), the re-plan in the same step.
    assert split.step == replan.step == 50 + CFG.severe_window - 1 < 50 + CFG.window - 1
    assert split.split_factor == replan.split_factor == CFG.max_split
    assert replan.new_bandwidth == pytest.approx(factor * EXPECTED, rel=1e-6)
    assert "severe_threshold" in replan.reason
    assert monitor.link_state(LINK) == "degraded"


def test_a_drop_to_just_above_the_severe_threshold_waits_for_replan_after() -> None:
    factor = 1.05 / CFG.severe_threshold
    decisions = _feed(_monitor(), [1.0] * 50 + [factor] * 100)
    split, replan = decisions
    assert replan.step == split.step + CFG.replan_after


def test_a_severe_rise_replans_at_once() -> None:
    monitor = _monitor()
    decisions = _feed(monitor, [1.0] * 50 + [5.0] * 100)
    assert [d.kind for d in decisions] == ["replan"]
    assert decisions[0].step == 50 + CFG.severe_window - 1
    assert decisions[0].new_bandwidth == pytest.approx(5.0 * EXPECTED, rel=1e-6)
    assert monitor.link_state(LINK) == "improved"


def test_a_degraded_link_that_turns_severe_replans_then() -> None:
    monitor = _monitor()
    decisions = _feed(monitor, [1.0] * 50 + [0.5] * 12 + [0.1] * 30)
    assert [d.kind for d in decisions] == ["split", "replan"]
    split, replan = decisions
    assert split.step < 62 and replan.step == 62 + CFG.severe_window - 1
    assert "severe_threshold" in replan.reason
    assert replan.new_bandwidth == pytest.approx(0.1 * EXPECTED, rel=1e-6)


def test_one_sample_above_the_severe_threshold_keeps_the_usual_pace() -> None:
    # At a tenth but every severe_window-th sample: the newest severe_window samples never all
    # are severe at once.
    period = [0.1] * (CFG.severe_window - 1) + [0.3]
    factors = [1.0] * 50 + period * 40
    split, replan = _feed(_monitor(), factors)
    assert replan.step == split.step + CFG.replan_after


def test_samples_that_ended_a_state_do_not_also_start_a_severe_one() -> None:
    # The merge at step 9 is judged on the window's median, which lags the two severe samples
    # before it; the next severe split waits for severe_window samples after the merge.
    decisions = _feed(_monitor(), [0.1] * 5 + [1.0] * 3 + [0.1] * 6)
    assert [(d.step, d.kind) for d in decisions] == [
        (4, "split"), (4, "replan"), (9, "merge"), (12, "split"), (12, "replan")
    ]  # fmt: skip


@pytest.mark.parametrize("stalled", [1, 2])
def test_a_few_stalled_samples_are_no_severe_change(stalled: int) -> None:
    # Fewer severe samples in a row than severe_window: nothing, however deep.
    assert stalled < CFG.severe_window
    decisions = _feed(_monitor(), [1.0] * 50 + [0.01] * stalled + [1.0] * 50)
    assert decisions == []


@pytest.mark.parametrize(("severe_window", "window", "samples"), [(1, 5, 1), (2, 5, 2), (5, 5, 5),
                                                                   (3, 2, 2)])  # fmt: skip
def test_the_severe_window_sets_how_soon_a_severe_drop_is_acted_on(
    severe_window: int, window: int, samples: int
) -> None:
    # A window smaller than severe_window uses all of its own samples.
    config = dataclasses.replace(CFG, severe_window=severe_window, window=window)
    split, replan = _feed(_monitor(config), [1.0] * 50 + [0.1] * 30)
    assert split.step == replan.step == 50 + samples - 1
    assert f"newest {samples} samples" in replan.reason
    assert replan.new_bandwidth == pytest.approx(0.1 * EXPECTED, rel=1e-6)


def test_brief_drop_does_not_replan() -> None:
    decisions = _feed(_monitor(), [1.0] * 50 + [0.5] * 15 + [1.0] * 300)
    assert [d.kind for d in decisions] == ["split", "merge"]


def test_persistent_improvement_replans_once_without_splitting() -> None:
    monitor = _monitor()
    decisions = _feed(monitor, [1.0] * 50 + [2.0] * 300)
    assert [d.kind for d in decisions] == ["replan"]
    (replan,) = decisions
    assert replan.new_bandwidth == pytest.approx(2.0 * EXPECTED, rel=1e-6)
    assert replan.split_factor == 1
    assert 50 + CFG.replan_after <= replan.step < 50 + BOUND + CFG.replan_after
    assert monitor.link_state(LINK) == "improved"


def test_rebase_adopts_the_new_plan() -> None:
    monitor = _monitor()
    decisions = _feed(monitor, [1.0] * 50 + [0.5] * 30)
    replan = decisions[-1]
    assert replan.kind == "replan"
    monitor.rebase({LINK: replan.new_bandwidth}, {LINK: LATENCY})
    assert monitor.current_split(LINK) == 1
    assert monitor.link_state(LINK) == "normal"
    # At the new normal (half the old plan) nothing more happens.
    assert _feed(monitor, [0.5] * 200, start=80) == []


# -- measurement -------------------------------------------------------------------------------


def test_small_transfers_are_ignored() -> None:
    monitor = _monitor()
    small = CFG.min_bytes - 1
    for step in range(100):
        assert monitor.observe(step, [_obs(step, 0.05, num_bytes=small)]) == []
    assert monitor.measured_bandwidth(LINK) is None
    # At min_bytes the same stream is measured and acted on.
    monitor = _monitor()
    decisions = []
    for step in range(100):
        decisions += monitor.observe(step, [_obs(step, 0.05, num_bytes=CFG.min_bytes)])
    assert [d.kind for d in decisions][:1] == ["split"]


def test_latency_is_subtracted() -> None:
    monitor = _monitor()
    small = 2 * CFG.min_bytes  # mostly latency: 13 ms of payload next to 20 ms of latency
    for step in range(10):
        monitor.observe(step, [_obs(step, 1.0, num_bytes=small)])
    assert monitor.measured_bandwidth(LINK) == pytest.approx(EXPECTED, rel=1e-6)


def test_latency_dominated_and_unknown_transfers_are_ignored() -> None:
    monitor = _monitor()
    for step in range(50):
        observations = [
            LinkObservation(step, 0, 1, NUM_BYTES, LATENCY * 0.9),  # faster than the latency
            _obs(step, 0.1, link=(5, 6)),  # not a watched link
        ]
        assert monitor.observe(step, observations) == []
    assert monitor.measured_bandwidth(LINK) is None
    assert monitor.current_split((5, 6)) == 1


def test_several_transfers_in_a_step_make_one_sample() -> None:
    monitor = _monitor()
    for step in range(CFG.window):
        monitor.observe(step, [_obs(step, 1.0), _obs(step, 0.5, num_bytes=NUM_BYTES)])
    # Equal bytes at 1x and 0.5x: total bytes over total payload seconds = 2/3 of the plan.
    assert monitor.measured_bandwidth(LINK) == pytest.approx(EXPECTED * 2 / 3, rel=1e-6)


def test_observations_from_transfers() -> None:
    @dataclass
    class Record:
        peer: int
        num_bytes: int
        seconds: float
        direction: str

    observations = observations_from_transfers(
        7, 1, [Record(0, 100, 0.5, "recv"), Record(2, 200, 0.25, "send")]
    )
    assert observations == [
        LinkObservation(7, 0, 1, 100, 0.5),
        LinkObservation(7, 1, 2, 200, 0.25),
    ]
    with pytest.raises(ValueError, match="'send' or 'recv'"):
        observations_from_transfers(7, 1, [Record(0, 1, 1.0, "both")])


def test_from_matrices_skips_diagonal_and_missing_links() -> None:
    inf = math.inf
    monitor = LinkMonitor.from_matrices(
        [[inf, 1e6, inf], [2e6, inf, 3e6], [4e6, 5e6, inf]],
        [[0.0, 0.01, 0.0], [0.02, 0.0, 0.03], [0.04, 0.05, 0.0]],
        CFG,
    )
    assert monitor.links == [(0, 1), (1, 0), (1, 2), (2, 0), (2, 1)]
    state = monitor.state_dict()
    by_name = {e["name"]: e for e in state["links"]}
    assert by_name["1->2"]["expected"] == 3e6 and by_name["1->2"]["pairs"] == [[1, 2]]
    assert [1, 2, 0.03] in state["latency"]


# -- expectations: warm-up, calibration, stalls ------------------------------------------------

DEFAULTS = MonitorConfig()  # warm-up and calibration as the Callback runs them


def test_slow_first_steps_propose_nothing() -> None:
    # Start-up: the first 8 steps deliver a fifth of the plan, then the link is as planned.
    factors = [0.2] * 8 + [1.0] * 200
    assert _feed(_monitor(DEFAULTS), factors) == []
    # Judged from the first step against the plan's figure, the same start looks like a severe
    # drop (a fifth of the plan in every sample): split and re-plan at once, then merge.
    assert [d.kind for d in _feed(_monitor(CFG), factors)] == ["split", "replan", "merge"]


def test_the_calibration_lowers_a_plan_figure_the_wire_never_reaches() -> None:
    # The transfers' wire figure is 60% of the profile's large-message figure, all run long.
    factors = [0.6] * 300
    monitor = _monitor(DEFAULTS)
    assert _feed(monitor, factors) == []
    assert monitor.expected_bandwidth(LINK) == pytest.approx(0.6 * EXPECTED)
    assert [d.kind for d in _feed(_monitor(CFG), factors)][:1] == ["split"]
    # ... and a real drop from there is still a drop.
    decisions = _feed(_monitor(DEFAULTS), [0.6] * 60 + [0.3] * 20)
    assert [d.kind for d in decisions] == ["split"]


def test_the_calibration_never_raises_the_plan_figure() -> None:
    # Faster than planned while calibrating (e.g. alone on a link the plan shares): judged
    # against the plan, so returning to the plan's figure is no drop.
    monitor = _monitor(DEFAULTS)
    assert _feed(monitor, [2.0] * 16 + [1.0] * 200) == []
    assert monitor.expected_bandwidth(LINK) == EXPECTED


@pytest.mark.parametrize("seed", range(10))
def test_a_stalled_receiver_proposes_nothing(seed: int) -> None:
    # A receiver under a CPU quota: a quarter of its arrivals are stamped late (a stall of up to
    # 5x the transfer), the rest are the link's +-20%; the link itself never changes.
    rng = np.random.default_rng(seed)
    factors = [
        float(rng.uniform(0.2, 0.6) if rng.random() < 1 / 4 else rng.uniform(0.8, 1.2))
        for _ in range(500)
    ]
    monitor = _monitor(DEFAULTS)
    assert _feed(monitor, factors) == []
    assert monitor.link_state(LINK) == "normal"


def test_a_link_without_a_plan_figure_is_calibrated() -> None:
    monitor = LinkMonitor({LINK: None}, {LINK: LATENCY}, DEFAULTS)
    assert monitor.expected_bandwidth(LINK) is None
    decisions = _feed(monitor, [1.0] * 40 + [0.4] * 20)
    assert monitor.expected_bandwidth(LINK) == pytest.approx(EXPECTED, rel=0.05)
    assert [d.kind for d in decisions] == ["split"]
    with pytest.raises(ValueError, match="no expected bandwidth and calibration_steps=0"):
        LinkMonitor({LINK: None}, None, CFG)


# -- shared links ------------------------------------------------------------------------------

SHARED = SharedLink(name="net0->net1", pairs=((0, 2), (1, 2)), capacity=EXPECTED)


def _shared_step(step: int, share: float, together: bool = True) -> list[LinkObservation]:
    """Both senders move NUM_BYTES over the shared link: each at ``share`` of its capacity."""
    seconds = NUM_BYTES / (EXPECTED * share)
    if together:
        return [LinkObservation(step, s, d, NUM_BYTES, seconds) for s, d in SHARED.pairs]
    # one after the other, each alone at the full capacity
    return [LinkObservation(step, s, d, NUM_BYTES, NUM_BYTES / EXPECTED) for s, d in SHARED.pairs]


def _shared_monitor(config: MonitorConfig = DEFAULTS) -> LinkMonitor:
    # Each pair's own (solo) figure is the capacity: that is what the profiler measures.
    return LinkMonitor({(0, 2): EXPECTED, (1, 2): EXPECTED}, None, config, [SHARED])


@pytest.mark.parametrize("config", [DEFAULTS, CFG], ids=["calibrated", "plan"])
def test_two_senders_sharing_a_link_each_at_half_is_no_drop(config: MonitorConfig) -> None:
    monitor = _shared_monitor(config)
    decisions = []
    for step in range(300):
        # Alone during the warm-up, then always together: each pair sees half its solo figure.
        decisions += monitor.observe(step, _shared_step(step, 0.5, together=step >= 8))
    assert decisions == []
    assert monitor.link_state((0, 2)) == "normal" and monitor.link_names == ["net0->net1"]
    assert monitor.measured_bandwidth((1, 2)) == pytest.approx(EXPECTED)
    # Judged pair by pair against the solo figure, the same stream is a drop on both pairs.
    alone = LinkMonitor({(0, 2): EXPECTED, (1, 2): EXPECTED}, None, CFG)
    decisions = [d for step in range(20) for d in alone.observe(step, _shared_step(step, 0.5))]
    assert [(d.kind, d.link) for d in decisions] == [("split", (0, 2)), ("split", (1, 2))]


def test_senders_taking_turns_are_no_improvement() -> None:
    monitor = _shared_monitor()
    decisions = [
        d for step in range(300) for d in monitor.observe(step, _shared_step(step, 1.0, False))
    ]
    assert decisions == []
    assert monitor.link_state((0, 2)) == "normal"


def test_a_shared_link_dropping_to_a_quarter_is_one_decision_for_all_its_pairs() -> None:
    monitor = _shared_monitor()
    decisions = []
    for step in range(120):
        share = 0.5 if step < 60 else 0.125  # the link's capacity drops to a quarter at 60
        decisions += monitor.observe(step, _shared_step(step, share))
    split, replan = decisions
    assert split.kind == "split" and 60 <= split.step < 60 + BOUND
    assert split.name == "net0->net1" and split.pairs == ((0, 2), (1, 2))
    assert split.new_bandwidth == pytest.approx(EXPECTED / 4) and split.split_factor == 4
    assert "net0->net1 (0->2, 1->2) split x4" in str(split)
    assert replan.kind == "replan" and replan.step == split.step + DEFAULTS.replan_after
    assert Decision(**{**split.to_dict(), "link": (0, 2), "pairs": ((0, 2), (1, 2))}) == split


def test_shared_link_validation() -> None:
    with pytest.raises(ValueError, match="distinct"):
        SharedLink(name="x", pairs=((0, 1), (0, 1)))
    with pytest.raises(ValueError, match="capacity"):
        SharedLink(name="x", pairs=((0, 1),), capacity=0.0)
    other = SharedLink(name="y", pairs=((1, 2),))
    with pytest.raises(ValueError, match="in both"):
        LinkMonitor({}, None, DEFAULTS, [SHARED, other])


# -- checkpointing -----------------------------------------------------------------------------


def _noisy_stream(seed: int, length: int = 400) -> list[float]:
    """Noise around the plan with drops, recoveries and improvements."""
    rng = np.random.default_rng(seed)
    levels = rng.choice([0.3, 0.5, 1.0, 1.0, 2.0], size=length // 20)
    return [float(level * rng.uniform(0.9, 1.1)) for level in np.repeat(levels, 20)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cut", [3, 57, 123, 201])
def test_state_dict_round_trip_continues_identically(seed: int, cut: int) -> None:
    factors = _noisy_stream(seed)
    original = _monitor()
    _feed(original, factors[:cut])
    state = json.loads(json.dumps(original.state_dict()))
    restored = _monitor()
    restored.load_state_dict(state)
    assert restored.state_dict() == original.state_dict()
    rest = factors[cut:]
    expected = _feed(original, rest, start=cut)
    assert _feed(restored, rest, start=cut) == expected
    assert restored.state_dict() == original.state_dict()


def test_state_dict_carries_what_matters() -> None:
    # The round trip above can only fail if the state makes a difference: a fresh monitor fed
    # the same tail decides differently.
    factors = [1.0] * 50 + [0.5] * 30 + [1.0] * 30
    original = _monitor()
    _feed(original, factors[:60])
    assert original.current_split(LINK) == 2
    fresh = _monitor()
    restored = _monitor()
    restored.load_state_dict(json.loads(json.dumps(original.state_dict())))
    assert restored.current_split(LINK) == 2
    tail = factors[60:]
    continued = _feed(original, tail, start=60)
    assert [d.kind for d in continued] == ["replan", "merge"]
    assert _feed(restored, tail, start=60) == continued
    assert _feed(fresh, tail, start=60) != continued


def test_state_dict_keeps_a_rebase() -> None:
    monitor = _monitor()
    monitor.rebase({LINK: 5e6, (1, 2): 7e6})
    restored = _monitor()
    restored.load_state_dict(monitor.state_dict())
    assert restored.links == [(0, 1), (1, 2)]
    assert restored.state_dict() == monitor.state_dict()


def test_load_state_dict_rejects_other_versions_and_warns_on_config_change() -> None:
    state = _monitor().state_dict()
    with pytest.raises(ValueError, match="expected version 2, got 99"):
        _monitor().load_state_dict({**state, "version": 99})
    with pytest.warns(UserWarning, match="window"):
        _monitor(dataclasses.replace(CFG, window=3)).load_state_dict(state)


# -- validation and formatting -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"slow_threshold": 1.2, "fast_threshold": 1.25}, "fast_threshold < slow_threshold"),
        ({"severe_threshold": 1.4}, "severe_threshold >= slow_threshold"),
        ({"severe_threshold": math.inf}, "severe_threshold: expected a finite number"),
        ({"slow_threshold": 1.5, "fast_threshold": 1.5}, "fast_threshold=1.5"),
        ({"fast_threshold": 0.9}, "1 <= fast_threshold"),
        ({"slow_threshold": math.nan}, "finite"),
        ({"slow_threshold": "2"}, "expected a number"),
        ({"window": 0}, r"window: expected an integer >= 1, got 0; set window=5"),
        ({"react_after": 0}, "react_after"),
        ({"replan_after": -3}, "replan_after"),
        ({"min_bytes": -1}, ">= 0"),
        ({"max_split": 0}, "max_split"),
        ({"window": 2.5}, "expected an integer"),
        ({"severe_window": 0}, "severe_window: expected an integer >= 1"),
        ({"max_split": True}, "expected an integer"),
    ],
)
def test_config_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MonitorConfig(**kwargs)


@pytest.mark.parametrize("bandwidth", [0.0, -1.0, math.inf, math.nan])
def test_expected_bandwidth_validation(bandwidth: float) -> None:
    with pytest.raises(ValueError, match=r"expected_bandwidth\[\(0, 1\)\]: expected a finite"):
        LinkMonitor({LINK: bandwidth})


def test_latency_validation() -> None:
    with pytest.raises(ValueError, match="expected a finite latency >= 0"):
        LinkMonitor({LINK: 1e6}, {LINK: -0.1})
    with pytest.raises(ValueError, match="expected_bandwidth does not"):
        LinkMonitor({LINK: 1e6}, {(1, 0): 0.1})


def test_step_must_not_go_backwards() -> None:
    monitor = _monitor()
    monitor.observe(10, [])
    with pytest.raises(ValueError, match="step 9 is before the last observed step 10"):
        monitor.observe(9, [])


def test_decision_to_dict_and_str() -> None:
    (decision,) = _feed(_monitor(), [1.0] * 10 + [0.5] * 10)
    as_dict = json.loads(json.dumps(decision.to_dict()))
    assert as_dict["kind"] == "split"
    assert as_dict["link"] == [0, 1]
    assert as_dict["split_factor"] == 2
    text = str(decision)
    assert "\n" not in text
    assert text.startswith(f"step {decision.step} link 0->1 split x2: 10.00 MB/s -> 5.00 MB/s")


def test_monitor_is_pure() -> None:
    package = ROOT / "lightning_deepcee" / "adapter"
    for path in (package / "monitor.py", package / "records.py", package / "__init__.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in ("torch", "lightning", "pytorch_lightning"), (
                    f"{path.name} imports {name}"
                )
