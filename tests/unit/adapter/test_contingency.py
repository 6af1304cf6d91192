"""Plans searched ahead for the running layout's wide-area links: which profiles they are made
on, when one is chosen, and the adapter moving to one at a severe drop without a search (the
end-to-end world of ``test_adapter_decisions``)."""

from __future__ import annotations

import math
import time

import pytest

from lightning_deepcee.adapter import search_process
from lightning_deepcee.adapter.contingency import (
    CONTINGENCY_FACTOR,
    choose_contingency,
    contingency_profiles,
    neighbourhood_search,
)
from lightning_deepcee.adapter.replan import placement_key
from lightning_deepcee.callbacks.contingency import Contingencies
from lightning_deepcee.planner import Plan, plan_search, predict_plan
from tests.helpers.adapter_world import acted, profile_at, run_adapter, world_plan, world_profile
from tests.helpers.plans import hand_plan


def test_each_crossed_pair_of_groups_is_planned_at_a_tenth_both_ways() -> None:
    profile = world_profile()
    ((name, scaled),) = contingency_profiles(profile, world_plan())
    assert name == "net0<->net1"
    for src in range(3):
        for dst in range(3):
            old, new = (
                profile.bandwidth_bytes_per_s[src][dst],
                scaled.bandwidth_bytes_per_s[src][dst],
            )
            if src == dst:
                assert math.isinf(new)
            elif {src, dst} in ({0, 2}, {1, 2}):  # across the WAN, both directions
                assert new == pytest.approx(old * CONTINGENCY_FACTOR)
            else:
                assert new == old  # the LAN pair
    assert scaled.devices == profile.devices and scaled.latency_s == profile.latency_s
    with pytest.raises(ValueError, match="factor must be in"):
        contingency_profiles(profile, world_plan(), factor=1.0)


def test_a_layout_inside_one_group_has_no_contingency() -> None:
    inside = hand_plan(
        [((0, 3), (0,), (1.0,)), ((3, 6), (1,), (1.0,))],
        schedule="1f1b",
        global_batch_size=32,
        model_fingerprint="model",
        cluster_fingerprint="cluster",
    )
    assert contingency_profiles(world_profile(), inside) == []


def _ahead() -> list[tuple[str, Plan]]:
    return [
        (name, neighbourhood_search(scenario, world_plan()))
        for name, scenario in contingency_profiles(world_profile(), world_plan())
    ]


def test_the_plan_searched_ahead_is_taken_when_the_link_falls() -> None:
    ahead = _ahead()
    ((_, plan),) = ahead
    assert placement_key(plan) != placement_key(world_plan())  # the tenth moves the layout
    for fraction in (0.1, 0.05):
        observed = profile_at(fraction)
        current_s = predict_plan(observed, world_plan()).step_time_s
        choice = choose_contingency(observed, world_plan(), current_s, ahead, gain=0.1)
        assert choice is not None and choice.apply and choice.plan == plan
        assert choice.new_step_time_s == pytest.approx(predict_plan(observed, plan).step_time_s)
        assert "searched ahead for net0<->net1" in choice.reason


def test_the_plan_searched_ahead_must_beat_the_running_one_by_the_margin() -> None:
    ahead = _ahead()
    ((_, plan),) = ahead
    ahead_s = predict_plan(world_profile(), plan).step_time_s
    # The running plan within 10% of it: kept; beyond: moved.
    choice = choose_contingency(world_profile(), world_plan(), ahead_s * 1.05, ahead, gain=0.1)
    assert choice is not None and not choice.apply and choice.plan == plan
    choice = choose_contingency(world_profile(), world_plan(), ahead_s * 1.2, ahead, gain=0.1)
    assert choice is not None and choice.apply
    current_s = predict_plan(world_profile(), world_plan()).step_time_s
    # Only the running layout ahead: nothing to choose.
    assert (
        choose_contingency(
            world_profile(), world_plan(), current_s, [("x", world_plan())], gain=0.1
        )
        is None
    )
    with pytest.raises(ValueError, match="gain must be in"):
        choose_contingency(world_profile(), world_plan(), current_s, ahead, gain=1.0)


def test_the_search_process_plans_every_contingency() -> None:
    request = {
        "kind": "contingencies",
        "scopes": ["links"],
        "profile": world_profile().to_dict(),
        "plan": world_plan().to_dict(),
        "device_gain": 0.05,
    }
    outcome = search_process.run(request)
    ((name, plan),) = _ahead()
    assert [entry["name"] for entry in outcome["plans"]] == [name]
    assert Plan.from_dict(outcome["plans"][0]["plan"]).stages == plan.stages


def _severe(step: int) -> float:
    return 0.05 if step >= 60 else 1.0


def test_a_severe_drop_moves_to_the_plan_searched_ahead_without_a_search(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = run_adapter(monkeypatch, 120, _severe)
    (applied,) = run.kinds("replan-applied")
    proposals = [d for d in run.adapter.decisions if d["kind"] == "replan"]
    # Proposed for both directions with the split, once the newest severe_window (3) samples
    # are all severe, and applied as they are made: when that step's exchange lands, one later.
    assert {d["name"] for d in proposals} == {"net0->net1", "net1->net0"}
    assert {d["step"] for d in proposals} == {60 + 3 - 1}
    assert applied["step"] == proposals[0]["step"] + 1
    assert all("severe_threshold" in d["reason"] for d in proposals)
    assert "searched ahead" in applied["reason"]
    assert run.kinds("replan-search") == [] and run.kinds("split-applied") == []
    ((_, plan),) = _ahead()
    assert run.strategy.moves == [plan] and run.strategy.plan == plan
    (confirmed,) = run.kinds("confirmed")
    assert confirmed["action"] == "replan" and confirmed["after_s"] < confirmed["before_s"]
    assert [d["kind"] for d in acted(run)] == ["replan-applied"]


def test_a_milder_drop_keeps_the_usual_pace(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fall to a third is no severe change: the split first, the re-plan replan_after steps
    # after it (then, here, to the plan searched ahead: the model predicts it fastest).
    run = run_adapter(monkeypatch, 160, lambda step: 0.3 if step >= 60 else 1.0)
    splits = [d for d in run.adapter.decisions if d["kind"] == "split"]
    replans = [d for d in run.adapter.decisions if d["kind"] == "replan"]
    assert {d["step"] for d in replans} == {splits[0]["step"] + 20}
    kinds = [d["kind"] for d in run.adapter.decisions]
    assert kinds.index("split-applied") < kinds.index("replan-applied")
    assert "searched ahead" in run.kinds("replan-applied")[0]["reason"]


def test_without_a_plan_ahead_the_search_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Contingencies, "choose", lambda *args, **kwargs: {})
    run = run_adapter(monkeypatch, 120, _severe)
    (search,) = run.kinds("replan-search")
    (applied,) = run.kinds("replan-applied")
    # Proposed at the 3rd severe sample (step 62), acted on as the exchange lands (63).
    assert search["step"] == 60 + 3 and applied["step"] > search["step"]
    assert "searched ahead" not in applied["reason"]


def test_each_training_device_is_planned_at_a_third_of_its_speed() -> None:
    from lightning_deepcee.adapter.compute import observed_compute
    from lightning_deepcee.adapter.contingency import (
        COMPUTE_FACTOR,
        device_contingency_profiles,
    )

    profile = world_profile()
    scenarios = device_contingency_profiles(profile, world_plan())
    assert [name for name, _ in scenarios] == ["device 0", "device 1", "device 2"]
    for rank, (_, scenario) in enumerate(scenarios):
        assert scenario == observed_compute(profile, {rank: COMPUTE_FACTOR})[0]
    with pytest.raises(ValueError, match="factor must be above 1"):
        device_contingency_profiles(profile, world_plan(), factor=0.5)
    request = {"kind": "contingencies", "scopes": ["devices"], "profile": profile.to_dict(),
               "plan": world_plan().to_dict(), "device_gain": 0.05}  # fmt: skip
    outcome = search_process.run(request)
    assert [entry["name"] for entry in outcome["plans"]] == ["device 0", "device 1", "device 2"]


class _Job:
    """A contingency search as the searcher sees it, run at once; ``ready`` entries of it are
    found while it still runs, all once ``finish()`` is called."""

    def __init__(self, request: dict, log: list[dict], ready: int | None = None) -> None:
        log.append(dict(request))
        self.outcome = search_process.run(request)
        self.ready = len(self.outcome["plans"]) if ready is None else ready
        self.cancelled = False

    def finish(self) -> None:
        self.ready = len(self.outcome["plans"])

    def found(self) -> list[dict]:
        return [] if self.cancelled else self.outcome["plans"][: self.ready]

    def done(self) -> bool:
        return self.ready == len(self.outcome["plans"])

    def result(self) -> dict:
        return self.outcome

    def cancel(self) -> None:
        self.cancelled = True


def test_the_searcher_searches_links_then_devices_and_keeps_both() -> None:
    from tests.helpers.adapter_world import WorldStrategy

    started: list[dict] = []
    strategy = WorldStrategy(world_profile())
    ahead = Contingencies(lambda request: _Job(request, started))  # type: ignore[arg-type,return-value]
    for _ in range(4):
        ahead.prepare(strategy, {})
    assert [r["scopes"] for r in started] == [["links", "devices"]]  # then nothing more
    names = [p["name"] for plans in ahead.plans.values() for p in plans]
    assert names == ["net0<->net1", "device 0", "device 1", "device 2"]


def test_plans_found_so_far_are_used_and_kept_through_a_pause() -> None:
    """The link's plan, found first, is chosen while the devices' are still searched; a pause
    keeps it, and the search started next skips it."""
    from tests.helpers.adapter_world import WorldStrategy

    started: list[dict] = []
    jobs: list[_Job] = []

    def start(request: dict) -> _Job:
        jobs.append(_Job(request, started, ready=1))
        return jobs[-1]

    strategy = WorldStrategy(world_profile())
    ahead = Contingencies(start)  # type: ignore[arg-type]
    current = strategy.current_plan()
    current_s = predict_plan(profile_at(0.05), current).step_time_s
    # Before its search begins, and while it has found nothing, the choice says so.
    none = ahead.choose(strategy, profile_at(0.05), current_s, 0.1)  # type: ignore[arg-type]
    assert none == {"reason": "0 plan(s) searched ahead for this layout, none of another "
                    "layout (not begun)"}  # fmt: skip
    ahead.prepare(strategy, {})
    choice = ahead.choose(strategy, profile_at(0.05), current_s, 0.1)  # type: ignore[arg-type]
    assert choice["apply"] and "net0<->net1" in choice["reason"]
    ahead.pause()
    assert jobs[0].cancelled
    ahead.prepare(strategy, {})
    assert started[1]["skip"] == ["net0<->net1"]
    jobs[1].finish()
    ahead.prepare(strategy, {})
    names = [p["name"] for plans in ahead.plans.values() for p in plans]
    assert names == ["net0<->net1", "device 0", "device 1", "device 2"]
    assert len(started) == 2


def test_no_plan_ahead_yet_says_the_search_still_runs() -> None:
    from tests.helpers.adapter_world import WorldStrategy

    strategy = WorldStrategy(world_profile())
    ahead = Contingencies(lambda request: _Job(request, [], ready=0))  # type: ignore[arg-type,return-value]
    ahead.prepare(strategy, {})
    current_s = predict_plan(profile_at(0.05), strategy.current_plan()).step_time_s
    none = ahead.choose(strategy, profile_at(0.05), current_s, 0.1)  # type: ignore[arg-type]
    assert none == {"reason": "0 plan(s) searched ahead for this layout, none of another "
                    "layout (still searching)"}  # fmt: skip


def test_the_search_process_writes_each_plan_as_it_finds_it() -> None:
    request = {"kind": "contingencies", "profile": world_profile().to_dict(),
               "plan": world_plan().to_dict(), "device_gain": 0.05}  # fmt: skip
    job = search_process.SearchProcess(request)
    deadline = time.monotonic() + 600
    while not job.done():  # the child runs at nice 19: a busy loop here would starve it
        assert time.monotonic() < deadline, "the search process did not finish in 10 min"
        time.sleep(0.05)
    found = job.found()
    assert [e["name"] for e in found] == ["net0<->net1", "device 0", "device 1", "device 2"]
    assert job.result()["plans"] == found
    assert job.found() == []  # the folder is gone with the result


def test_the_neighbourhood_search_stays_on_the_plans_devices_and_counts() -> None:
    from lightning_deepcee.adapter.compute import observed_compute

    profile, plan = world_profile(), world_plan()
    slowed, _ = observed_compute(profile, {2: 3.0})
    found = neighbourhood_search(slowed, plan)
    used = {r for stage in found.stages for r in stage.ranks}
    assert used <= {r for stage in plan.stages for r in stage.ranks}
    m = plan.num_microbatches
    assert found.num_microbatches in {max(1, m // 2), m, 2 * m}
    assert found.schedule in ("1f1b", "zb-h1", plan.schedule)
    full = plan_search(slowed, num_blocks=6, global_batch_size=32)
    # Near the full search's own prediction on this world (it has no device to add).
    assert predict_plan(slowed, found).step_time_s <= 1.1 * predict_plan(slowed, full).step_time_s
