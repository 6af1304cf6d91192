"""Coming back: which links a move left, when a probed link has recovered, what the return is
predicted on, and the adapter returning to the plan it left once the link is back (the
end-to-end world of ``test_adapter_decisions``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from lightning_deepcee.adapter.comeback import (
    Abandoned,
    ComeBackWatch,
    abandoned_links,
    choose_return,
    probe_bytes,
    restored_profile,
)
from lightning_deepcee.adapter.contingency import choose_contingency
from lightning_deepcee.adapter.gate import with_microbatches
from lightning_deepcee.adapter.replan import LinkFigure, observed_profile
from lightning_deepcee.callbacks.contingency import Contingencies
from lightning_deepcee.callbacks.replanner import SearchInFlight
from lightning_deepcee.planner import predict_plan
from lightning_deepcee.profiler import ClusterProfile
from tests.helpers.adapter_world import WAN, profile_at, run_adapter, world_plan, world_profile
from tests.helpers.plans import hand_plan

E = WAN


def _decision(name: str, pairs: list[tuple[int, int]], old: float, new: float) -> dict:
    return {
        "kind": "replan", "name": name, "link": list(pairs[0]), "pairs": [list(p) for p in pairs],
        "old_bandwidth": old, "new_bandwidth": new,
    }  # fmt: skip


FORWARD = _decision("net0->net1", [(0, 2), (1, 2)], E, E / 10)
BACKWARD = _decision("net1->net0", [(2, 0), (2, 1)], 0.9 * E, E / 10)


def test_a_link_and_its_reverse_are_one_link_left_probed_towards_an_idle_receiver() -> None:
    (left,) = abandoned_links([BACKWARD, FORWARD], used=[(0, 1), (1, 0)], idle=[2])
    assert left.pairs == ((0, 2), (1, 2), (2, 0), (2, 1))
    assert left.probe == (0, 2)  # the idle device receives and stamps
    assert left.expected == E  # the probed direction's figure before the fall
    assert left.name == "net0->net1 + net1->net0"


def test_links_the_new_plan_still_uses_or_that_got_faster_are_not_left() -> None:
    assert abandoned_links([FORWARD], used=[(0, 2), (2, 0)], idle=[1]) == []
    faster = _decision("net0->net1", [(0, 2)], E, 2 * E)
    assert abandoned_links([faster], used=[], idle=[0, 1, 2]) == []


def test_an_idle_sender_is_preferred_when_no_receiver_is_idle() -> None:
    (left,) = abandoned_links([BACKWARD], used=[(0, 1)], idle=[2])
    assert left.probe == (2, 0)


def test_probe_size_is_a_tenth_of_a_second_at_the_rate_now_within_bounds() -> None:
    assert probe_bytes(E) == int(E * 0.1)
    assert probe_bytes(E / 10) == int(E / 100)  # a link at a tenth: still a tenth of a second
    assert probe_bytes(1e3) == 64 * 2**10
    assert probe_bytes(1e12) == 4 * 2**20
    assert probe_bytes(0.0) == 64 * 2**10


def _watch(window: int = 5) -> ComeBackWatch:
    link = Abandoned(name="net0->net1", pairs=((0, 2), (2, 0)), probe=(0, 2), expected=E)
    return ComeBackWatch([link], window=window, fast_threshold=1.25)


def _sample(watch: ComeBackWatch, bandwidth: float, pair: tuple[int, int] = (0, 2)) -> None:
    watch.observe([[pair[0], pair[1], 1_000_000, 1_000_000 / bandwidth]])


def test_a_link_recovers_once_its_window_median_is_back_above_the_threshold() -> None:
    watch = _watch()
    for _ in range(10):
        _sample(watch, E / 10)
    assert watch.recovered() == []
    for _ in range(3):
        assert watch.recovered() == []  # most of the window still holds slow samples
        _sample(watch, 0.9 * E)
    assert [a.probe for a in watch.recovered()] == [(0, 2)]  # its median is back


def test_a_minority_of_fast_samples_or_other_pairs_do_not_recover_it() -> None:
    watch = _watch()
    for i in range(20):
        _sample(watch, E if i % 3 == 0 else E / 10)
        _sample(watch, E, pair=(1, 2))  # not the probed pair
    assert watch.recovered() == []
    for _ in range(5):
        _sample(watch, 0.75 * E)  # below E / 1.25: not back yet
    assert watch.recovered() == []


def test_the_watch_survives_a_checkpoint() -> None:
    watch = _watch()
    for bandwidth in (E / 10, E, E, E, E):
        _sample(watch, bandwidth)
    restored = ComeBackWatch.from_state_dict(json.loads(json.dumps(watch.state_dict())))
    assert restored.state_dict() == watch.state_dict()
    _sample(watch, E)
    _sample(restored, E)
    assert restored.recovered() == watch.recovered() != []


def test_the_return_is_predicted_on_the_profile_left_with_the_probed_figures() -> None:
    profile = world_profile()
    watch = ComeBackWatch(
        abandoned_links([FORWARD, BACKWARD], used=[(0, 1), (1, 0)], idle=[2]),
        window=3,
        fast_threshold=1.25,
    )
    for _ in range(3):
        _sample(watch, E / 2)
    half = restored_profile(profile, watch)
    assert half == profile_at(0.5)  # both directions at the probe's ratio
    for _ in range(3):
        _sample(watch, 0.95 * E)
    assert restored_profile(profile, watch) == profile  # recovered: the figures left
    plan = world_plan()
    predicted = predict_plan(profile, plan).step_time_s
    slower = choose_return(plan, profile, 2 * predicted, current_is="is predicted")
    assert slower.apply and slower.new_step_time_s == pytest.approx(predicted)
    assert not choose_return(plan, profile, 0.9 * predicted, current_is="is predicted").apply
    # Each plan by its own clock: the plan left ran 20% slower than predicted, so a running
    # plan measured 10% above the prediction is kept.
    clocked = choose_return(plan, profile, 1.1 * predicted, current_is="runs", left_scale=1.2)
    assert not clocked.apply and clocked.new_step_time_s == pytest.approx(1.2 * predicted)
    assert "expected, by its clock," in clocked.reason


def _cut(step: int) -> float:
    return 0.05 if 60 <= step < 120 else 1.0


FAST = 1e8  # a WAN fast enough for the world's plan to beat a plan without it
SOLO = hand_plan(
    [((0, 6), (0,), (1.0,))], global_batch_size=32, num_microbatches=1,
    model_fingerprint="model", cluster_fingerprint="cluster", idle_ranks=(1, 2),
)  # fmt: skip


def _fast_at(fraction: float) -> ClusterProfile:
    pairs = ((0, 2), (1, 2), (2, 0), (2, 1))
    figures = [
        LinkFigure(link=p, expected_bandwidth=FAST, measured_bandwidth=FAST * fraction,
                   state="degraded" if fraction < 1 else "normal")
        for p in pairs
    ]  # fmt: skip
    return observed_profile(world_profile(FAST), figures)[0]


def _fast_world(step: int, strategy: Any, fraction: float) -> float:
    running = with_microbatches(strategy.plan, strategy.num_microbatches)
    return float(predict_plan(_fast_at(fraction), running).step_time_s)


def _ahead_is_solo(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan searched ahead is SOLO (device 0 alone): far slower than the world's plan on the
    whole link, far faster at a twentieth of it."""

    def choose(self: Any, strategy: Any, observed: Any, current_s: float, gain: float) -> dict:
        current = strategy.current_plan()
        choice = choose_contingency(
            observed, current, current_s, [("net0<->net1", SOLO)], gain=gain
        )
        return {} if choice is None else choice.to_dict()

    monkeypatch.setattr(Contingencies, "choose", choose)


def test_after_a_severe_drop_the_adapter_returns_once_the_link_is_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _ahead_is_solo(monkeypatch)
    profile = world_profile(FAST)
    assert predict_plan(profile, world_plan()).step_time_s < predict_plan(profile, SOLO).step_time_s
    run = run_adapter(monkeypatch, 200, _cut, _fast_world, profile=profile)
    (moved,) = run.kinds("replan-applied")
    (back,) = run.kinds("return-applied")
    # The probe's window (5 samples) has a majority of samples of the restored link 3 steps
    # after it is back, and the figures land a step later.
    assert back["step"] == 120 + 3
    assert back["new_step_time_s"] < back["current_step_time_s"]
    assert run.strategy.moves == [SOLO, world_plan()]
    assert run.strategy.cluster_profile == profile  # the figures left: the link is back
    assert [d["action"] for d in run.kinds("confirmed")] == ["replan", "return"]
    assert run.adapter.comeback.pairs == [] and run.adapter.replanner.replanned is None
    assert moved["step"] < back["step"]


class _Stuck:
    """A re-plan search that never finishes; it knows whether it was cancelled."""

    cancelled = False

    def done(self) -> bool:
        return False

    def cancel(self) -> None:
        self.cancelled = True


def _search_in_flight_at(
    at: int, stuck: _Stuck, *, probing: bool = False
) -> Callable[[int, Any], None]:
    """A run's ``each_step``: at step ``at`` (no search running; ``probing``: a link the move
    left is probed), put ``stuck`` in flight as a search for ``FORWARD``."""

    def each_step(step: int, adapter: Any) -> None:
        if step == at:
            assert adapter.replanner.search is None
            assert bool(adapter.comeback.pairs) or not probing
            adapter.replanner.search = SearchInFlight(
                step=step, replans=[FORWARD], resplits=[], observed=world_profile(FAST),
                changes={}, configuration=adapter.configuration, clocked=False, searcher=0,
                job=stuck,
            )  # fmt: skip

    return each_step


def test_a_return_that_is_due_does_not_wait_for_a_search_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A search begun after the move (here: one that never ends, put in flight at step 100) is
    dropped when the link is back, and the return comes at the same step as without it."""
    _ahead_is_solo(monkeypatch)
    stuck = _Stuck()
    run = run_adapter(
        monkeypatch, 200, _cut, _fast_world, profile=world_profile(FAST),
        each_step=_search_in_flight_at(100, stuck, probing=True),
    )  # fmt: skip
    (back,) = run.kinds("return-applied")
    assert back["step"] == 120 + 3  # as in the test above
    (dropped,) = run.kinds("replan-dropped")
    assert dropped["step"] == back["step"] and "come-back" in dropped["reason"]
    assert stuck.cancelled and run.adapter.replanner.search is None
    assert run.strategy.moves == [SOLO, world_plan()]


def test_a_severe_drop_while_a_search_runs_supersedes_it_and_moves_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A search for an earlier change (one that never ends, put in flight at step 50) must not
    hold back the cut at step 60: it is dropped and the plan searched ahead is taken."""
    _ahead_is_solo(monkeypatch)
    stuck = _Stuck()
    run = run_adapter(
        monkeypatch, 100, _cut, _fast_world, profile=world_profile(FAST),
        each_step=_search_in_flight_at(50, stuck),
    )  # fmt: skip
    (dropped,) = run.kinds("replan-dropped")
    (moved,) = run.kinds("replan-applied")
    assert 60 < dropped["step"] == moved["step"] and "supersedes" in dropped["reason"]
    assert stuck.cancelled and run.kinds("replan-skipped") == []
    assert run.strategy.moves == [SOLO]


def test_a_severe_drop_is_judged_on_the_steps_since_it_began(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At the severe proposal the guard's window still holds steps from before the cut: the
    running plan's step is taken from the newest ``severe_samples`` steps, all on the cut link
    (here the world runs as the model predicts, so the figure is the prediction there)."""
    _ahead_is_solo(monkeypatch)
    run = run_adapter(monkeypatch, 80, _cut, _fast_world, profile=world_profile(FAST))
    (moved,) = run.kinds("replan-applied")
    cut_s = predict_plan(_fast_at(0.05), world_plan()).step_time_s
    assert moved["current_step_time_s"] == pytest.approx(cut_s, rel=0.06)


def test_no_return_while_the_link_stays_down(monkeypatch: pytest.MonkeyPatch) -> None:
    _ahead_is_solo(monkeypatch)
    run = run_adapter(
        monkeypatch, 200, lambda step: 0.05 if step >= 60 else 1.0, _fast_world,
        profile=world_profile(FAST),
    )  # fmt: skip
    assert len(run.kinds("replan-applied")) == 1 and run.kinds("return-applied") == []
    assert run.adapter.comeback.pairs == [(1, 2)]  # still probed, between two idle devices


def test_a_return_the_model_does_not_favour_is_kept_and_probing_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # In the plain world the plan searched ahead (devices 0 and 1) beats the world's plan also on
    # the whole link: once the link is back, the model keeps it, and the link is no longer probed.
    run = run_adapter(monkeypatch, 200, _cut)
    (kept,) = run.kinds("return-kept")
    assert kept["step"] == 120 + 3
    assert kept["new_step_time_s"] > kept["current_step_time_s"]
    assert run.kinds("return-applied") == [] and run.adapter.comeback.pairs == []
    assert len(run.strategy.moves) == 1


def test_what_was_left_survives_a_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    run = run_adapter(monkeypatch, 100, lambda step: 0.05 if step >= 60 else 1.0)
    state = json.loads(json.dumps(run.adapter.state_dict()))
    assert state["comeback"]["left"]["plan"] == world_plan().to_dict()
    again = run_adapter(monkeypatch, 1)
    again.adapter.load_state_dict(state)
    assert again.adapter.comeback.state_dict() == state["comeback"]
    assert ClusterProfile.from_dict(state["comeback"]["left"]["profile"]) == world_profile()


def test_a_move_from_a_moved_layout_keeps_coming_back_to_the_first_plan_left() -> None:
    """Device 2 slowed: move A leaves it idle; the cut link then moves B. The come-back still
    returns to the plan before A and watches device 2 with B's own link."""
    from types import SimpleNamespace

    from lightning_deepcee.callbacks.comeback import ComeBack

    def at(plan: Any) -> Any:
        return SimpleNamespace(current_plan=lambda: plan, global_rank=0)

    first = world_plan()
    same = {"model_fingerprint": "model", "cluster_fingerprint": "cluster"}
    plan_a = hand_plan([((0, 3), (0,), (1.0,)), ((3, 6), (1,), (1.0,))], schedule="1f1b",
                       global_batch_size=32, idle_ranks=(2,), **same)  # fmt: skip
    plan_b = hand_plan([((0, 6), (0,), (1.0,))], schedule="1f1b", global_batch_size=32,
                       idle_ranks=(1, 2), **same)  # fmt: skip
    left = {"plan": first.to_dict(), "profile": world_profile().to_dict(), "split": 1,
            "base": 2, "replanned": None}  # fmt: skip
    comeback = ComeBack(open_probe=lambda pair, rank, size: None)
    comeback.moved_away(at(plan_a), left, [{"device": 2, "ratio": 3.0}], window=5,
                        fast_threshold=1.25, slow_threshold=1.5)  # fmt: skip
    assert comeback.watched_devices() == [2] and comeback.watch is None
    link = _decision("0->1", [(0, 1)], E, E / 10)
    between = {**left, "plan": plan_a.to_dict()}
    comeback.moved_away(at(plan_b), between, [link], window=5, fast_threshold=1.25,
                        slow_threshold=1.5)  # fmt: skip
    assert comeback.left is not None and comeback.left["plan"] == first.to_dict()
    assert comeback.watched_devices() == [2] and comeback.pairs == [(0, 1)]
    assert comeback.returns_to(first.to_dict()) and not comeback.returns_to(plan_a.to_dict())
    comeback.close()
    assert comeback.left is None and comeback.watched_devices() == []
