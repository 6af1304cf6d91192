"""Unit tests of the discrete-event schedule simulator and its trace/timeline outputs."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_deepcee.schedule import (
    SCHEDULE_KINDS,
    Action,
    ActionKind,
    ScheduleError,
    SimulationResult,
    StageCosts,
    StageSchedule,
    generate,
    lower,
    parse_actions,
    plot_timeline,
    simulate,
    validate,
)

K = ActionKind


def _run(
    kind_or_schedule: str | StageSchedule, p: int, m: int, costs: StageCosts
) -> SimulationResult:
    placement = {s: s for s in range(p)}
    stage_schedule = (
        generate(kind_or_schedule, p, m) if isinstance(kind_or_schedule, str) else kind_or_schedule
    )
    rank_schedule = lower(stage_schedule, placement)
    validate(rank_schedule, placement, m)
    return simulate(rank_schedule, placement, costs, num_microbatches=m)


def _reference_zb_h1(p: int, m: int) -> StageSchedule:
    """ZB-H1 as in Qi et al.: 1F1B order, B/W split, stage ``s`` defers up to ``s`` W passes.

    Later stages defer W, so B reaches stage 0 early and stage 0 never waits in the steady phase;
    with equal F/B/W this gives the paper's bubble of ``p - 1`` time units per rank.
    """
    out: StageSchedule = {}
    for s in range(p):
        warmup = min(p - s - 1, m)
        acts = [Action(s, K.F, i) for i in range(warmup)]
        f_next, b_next, w_next = warmup, 0, 0
        while b_next < m:
            if f_next < m:
                acts.append(Action(s, K.F, f_next))
                f_next += 1
            acts.append(Action(s, K.B, b_next))
            b_next += 1
            if b_next - w_next > s or f_next >= m:
                acts.append(Action(s, K.W, w_next))
                w_next += 1
        acts.extend(Action(s, K.W, i) for i in range(w_next, m))
        out[s] = acts
    return out


# ---- analytical checks with equal costs: F = B = W = 1, BW = 2, no transfer time ----------------

PM_PAIRS = [(1, 1), (1, 4), (2, 1), (2, 2), (2, 5), (3, 3), (3, 5), (4, 4), (4, 8), (5, 7)]


@pytest.mark.parametrize(("p", "m"), PM_PAIRS)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_step_time_is_textbook(kind: str, p: int, m: int) -> None:
    result = _run(kind, p, m, StageCosts.uniform(p))
    assert result.step_time_s == (m + p - 1) * 3
    assert result.per_rank_busy_s == {r: 3.0 * m for r in range(p)}


@pytest.mark.parametrize(("p", "m"), PM_PAIRS)
def test_1f1b_bubble_ratio(p: int, m: int) -> None:
    result = _run("1f1b", p, m, StageCosts.uniform(p))
    assert result.bubble_ratio == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
def test_a_bw_action_costs_its_own_backward_where_given(kind: str) -> None:
    """BW (one backward pass) costs ``backward_s`` where given, B + W otherwise; B and W alone
    keep their own costs, so ZB-H1 does not change."""
    p, m = 3, 5
    placement = {s: s for s in range(p)}
    ranked = lower(generate(kind, p, m), placement)
    plain = StageCosts.uniform(p)
    merged = dataclasses.replace(plain, backward_s=(1.5,) * p)
    assert plain.merged_backward_s == (2.0,) * p
    for events in (True, False):
        before = simulate(ranked, placement, plain, num_microbatches=m, events=events)
        after = simulate(ranked, placement, merged, num_microbatches=m, events=events)
        if kind == "zb-h1":
            assert after.step_time_s == before.step_time_s
        else:
            assert before.step_time_s == (m + p - 1) * 3
            assert after.step_time_s == (m + p - 1) * 2.5


def test_exact_numbers_p4_m8() -> None:
    costs = StageCosts.uniform(4)
    assert _run("gpipe", 4, 8, costs).step_time_s == 33.0
    one_f_one_b = _run("1f1b", 4, 8, costs)
    assert one_f_one_b.step_time_s == 33.0
    assert one_f_one_b.bubble_ratio == pytest.approx(3 / 11)
    zb = _run(_reference_zb_h1(4, 8), 4, 8, costs)
    assert zb.step_time_s == 27.0  # 3m + (p - 1): one third of 1F1B's bubble


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in PM_PAIRS if p >= 2 and m >= p])
def test_reference_zb_h1_has_a_third_of_the_1f1b_bubble(p: int, m: int) -> None:
    costs = StageCosts.uniform(p)
    zb = _run(_reference_zb_h1(p, m), p, m, costs)
    assert zb.step_time_s == 3 * m + (p - 1)
    assert zb.step_time_s < _run("1f1b", p, m, costs).step_time_s


@pytest.mark.parametrize(
    ("p", "m"), [(2, 2), (3, 3), (4, 4), (5, 5), (5, 7), (2, 5), (3, 5), (4, 8), (4, 16)]
)
def test_generated_zb_h1_is_faster_than_1f1b(p: int, m: int) -> None:
    costs = StageCosts.uniform(p)
    zb = _run("zb-h1", p, m, costs)
    assert zb.step_time_s == 3 * m + (p - 1)
    assert zb.step_time_s < _run("1f1b", p, m, costs).step_time_s


# ---- transfers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("t", [0.0, 0.25, 3.0])
def test_transfer_time_adds_along_the_critical_path(p: int, t: float) -> None:
    result = _run("gpipe", p, 1, StageCosts.uniform(p, send_s=t))
    assert result.step_time_s == pytest.approx(p * (1 + 2) + 2 * (p - 1) * t)


def test_fifo_link_queues_back_to_back_sends() -> None:
    costs = StageCosts(
        forward_s=(0.1, 0.5),
        backward_input_s=(0.0, 0.0),
        backward_weight_s=(0.0, 0.0),
        activation_bytes=(0, 0),
        send_forward_s=(1.0,),
        send_backward_s=(0.0,),
    )
    result = _run("gpipe", 2, 2, costs)
    sends = [e for e in result.events if e.action.kind == K.SEND_F]
    assert [(e.start_s, e.end_s) for e in sends] == [
        pytest.approx((0.1, 1.1)),
        pytest.approx((1.1, 2.1)),  # waits for the first message, not for F1 (done at 0.2)
    ]
    assert all(e.rank == 0 and e.peer_rank == 1 for e in sends)
    forwards = {
        e.action.microbatch: e.start_s
        for e in result.events
        if e.action == Action(1, K.F, e.action.microbatch)
    }
    assert forwards == {0: pytest.approx(1.1), 1: pytest.approx(2.1)}
    assert result.step_time_s == pytest.approx(2.6)


def test_send_costs_the_sender_nothing() -> None:
    costs = StageCosts.uniform(2, send_s=10.0)
    result = _run("gpipe", 2, 2, costs)
    rank0_f1 = next(e for e in result.events if e.action == Action(0, K.F, 1))
    assert rank0_f1.start_s == 1.0


def test_microbatch_scale_scales_compute_and_transfer() -> None:
    base = StageCosts.uniform(2, send_s=0.5)
    scaled = StageCosts(
        forward_s=base.forward_s,
        backward_input_s=base.backward_input_s,
        backward_weight_s=base.backward_weight_s,
        activation_bytes=(100, 100),
        send_forward_s=base.send_forward_s,
        send_backward_s=base.send_backward_s,
        microbatch_scale=(2.0,),
    )
    assert _run("gpipe", 2, 1, scaled).step_time_s == pytest.approx(2 * (2 * 3 + 2 * 0.5))
    assert _run("gpipe", 2, 1, scaled).peak_memory_bytes == {0: 200, 1: 200}
    with pytest.raises(
        ValueError, match="microbatch_scale has 1 entries but num_microbatches is 2"
    ):
        _run("gpipe", 2, 2, scaled)


# ---- CPU quotas: a token bucket of full-speed seconds -------------------------------------------


def _with_quota(costs: StageCosts, share: float, period: float) -> StageCosts:
    p = costs.num_stages
    return dataclasses.replace(costs, cpu_share=(share,) * p, cpu_period_s=(period,) * p)


def test_quota_lets_a_waiting_device_catch_up_at_full_speed() -> None:
    # Two stages, F = 1, BW = 2 at the sustained speed; half a core, 4 s periods (2 s budget).
    result = _run("gpipe", 2, 1, _with_quota(StageCosts.uniform(2), share=0.5, period=4.0))
    spans = {(e.rank, e.action.kind): (e.start_s, e.end_s) for e in result.events}
    # Rank 0 starts with an empty bucket: its F runs at the sustained speed.
    assert spans[(0, K.F)] == pytest.approx((0.0, 1.0))
    # Rank 1 waited 1 s (0.5 s of credit): its F (0.5 s of full-speed work) runs at full speed,
    # its BW (1 s of work) at full speed while the 0.25 s left lasts (0.5 s), then at half speed.
    assert spans[(1, K.F)] == pytest.approx((1.0, 1.5))
    assert spans[(1, K.BW)] == pytest.approx((1.5, 3.0))
    # Rank 0 waited 2 s (1 s of credit, under the 2 s cap): its BW runs at full speed.
    assert spans[(0, K.BW)] == pytest.approx((3.0, 4.0))
    assert result.step_time_s == pytest.approx(4.0)
    assert _run("gpipe", 2, 1, StageCosts.uniform(2)).step_time_s == pytest.approx(6.0)


def test_quota_credit_is_capped_at_one_periods_budget() -> None:
    # Rank 1 waits 1 s, which would earn 0.5 s, but a 0.2 s period holds 0.1 s of credit.
    result = _run("gpipe", 2, 1, _with_quota(StageCosts.uniform(2), share=0.5, period=0.2))
    spans = {(e.rank, e.action.kind): (e.start_s, e.end_s) for e in result.events}
    assert spans[(1, K.F)] == pytest.approx((1.0, 1.0 + 0.2 + (0.5 - 0.2) / 0.5))


def test_quota_without_waits_changes_nothing() -> None:
    costs = StageCosts.uniform(1)
    for share, period in [(0.3, 0.1), (1.0, 0.1), (0.5, 0.0)]:
        assert _run("1f1b", 1, 5, _with_quota(costs, share, period)).step_time_s == pytest.approx(
            15.0
        )


@settings(max_examples=60, deadline=None)
@given(
    p=st.integers(1, 4),
    m=st.integers(1, 6),
    kind=st.sampled_from(sorted(SCHEDULE_KINDS)),
    costs=st.lists(st.floats(0.05, 3.0), min_size=12, max_size=12),
    sends=st.lists(st.floats(0.0, 2.0), min_size=6, max_size=6),
    shares=st.lists(st.floats(0.05, 1.0), min_size=4, max_size=4),
    period=st.floats(0.0, 5.0),
)
def test_quota_step_lies_between_the_busiest_rank_and_no_quota(
    p: int,
    m: int,
    kind: str,
    costs: list[float],
    sends: list[float],
    shares: list[float],
    period: float,
) -> None:
    plain = StageCosts(
        forward_s=tuple(costs[:p]),
        backward_input_s=tuple(costs[4 : 4 + p]),
        backward_weight_s=tuple(costs[8 : 8 + p]),
        activation_bytes=(0.0,) * p,
        send_forward_s=tuple(sends[: p - 1]),
        send_backward_s=tuple(sends[3 : 3 + p - 1]),
    )
    quota = dataclasses.replace(plain, cpu_share=tuple(shares[:p]), cpu_period_s=(period,) * p)
    without = _run(kind, p, m, plain)
    within = _run(kind, p, m, quota)
    assert within.step_time_s <= without.step_time_s * (1 + 1e-9)
    # The bucket is empty at the start and earns at most `share` per second, so a rank cannot
    # finish its work in less than its sustained compute time.
    busiest = max(
        m * (plain.forward_s[s] + plain.backward_input_s[s] + plain.backward_weight_s[s])
        for s in range(p)
    )
    assert within.step_time_s >= busiest * (1 - 1e-9)


def test_quota_fields_are_checked() -> None:
    base = StageCosts.uniform(2)
    with pytest.raises(ValueError, match="go together"):
        dataclasses.replace(base, cpu_share=(0.5, 0.5))
    with pytest.raises(ValueError, match=r"fraction of a core in \(0, 1\]"):
        dataclasses.replace(base, cpu_share=(0.5, 1.5), cpu_period_s=(0.1, 0.1))
    with pytest.raises(ValueError, match="cpu_share"):
        dataclasses.replace(base, cpu_share=(0.5, 0.0), cpu_period_s=(0.1, 0.1))
    with pytest.raises(ValueError, match="cpu_period_s"):
        dataclasses.replace(base, cpu_share=(0.5, 0.5), cpu_period_s=(0.1,))


# ---- deadlock and bad input ---------------------------------------------------------------------


def test_deadlock_is_detected_and_named() -> None:
    placement = {0: 0, 1: 1}
    bad = {
        0: parse_actions("0F0 0RECV_B0 0SEND_F0 0BW0"),
        1: parse_actions("1RECV_F0 1F0 1BW0 1SEND_B0"),
    }
    with pytest.raises(ScheduleError) as info:
        simulate(bad, placement, StageCosts.uniform(2), num_microbatches=1)
    msg = str(info.value)
    assert "deadlock" in msg
    assert "rank 0 at 0RECV_B0 (position 1)" in msg
    assert "rank 1 at 1RECV_F0 (position 0)" in msg
    assert ">>0RECV_B0<<" in msg


def test_receive_that_nobody_sends_is_a_deadlock() -> None:
    placement = {0: 0, 1: 1}
    bad = {0: parse_actions("0F0 0BW0"), 1: parse_actions("1RECV_F0 1F0 1BW0")}
    with pytest.raises(ScheduleError, match="no rank ever sends it"):
        simulate(bad, placement, StageCosts.uniform(2), num_microbatches=1)


def test_misplaced_action_is_rejected() -> None:
    bad = {0: parse_actions("1F0")}
    with pytest.raises(ScheduleError, match="stage 1 is placed on rank 1"):
        simulate(bad, {0: 0, 1: 1}, StageCosts.uniform(2), num_microbatches=1)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("forward_s", (1.0, -1.0), r"forward_s\[1\] = -1.0"),
        ("backward_input_s", (1.0,), "backward_input_s has 1 entries, expected 2"),
        ("send_forward_s", (1.0, 1.0), "send_forward_s has 2 entries, expected 1"),
        ("send_backward_s", (float("nan"),), "finite"),
        ("static_memory_bytes", (1, 2, 3), "static_memory_bytes has 3 entries, expected 2"),
        ("microbatch_scale", (1.0, 0.0), r"microbatch_scale\[1\] = 0.0; .* > 0"),
        ("backward_s", (1.0,), "backward_s has 1 entries, expected 2"),
    ],
)
def test_stage_costs_validation(field: str, value: tuple[float, ...], match: str) -> None:
    kwargs: dict[str, tuple[float, ...]] = {
        "forward_s": (1.0, 1.0),
        "backward_input_s": (1.0, 1.0),
        "backward_weight_s": (1.0, 1.0),
        "activation_bytes": (1.0, 1.0),
        "send_forward_s": (0.0,),
        "send_backward_s": (0.0,),
    }
    kwargs[field] = value
    with pytest.raises(ValueError, match=match):
        StageCosts(**kwargs)


# ---- memory -------------------------------------------------------------------------------------


def test_peak_memory_counts_static_and_held_activations() -> None:
    p, m = 3, 6
    costs = StageCosts(
        forward_s=(1.0,) * p,
        backward_input_s=(1.0,) * p,
        backward_weight_s=(1.0,) * p,
        activation_bytes=(10, 20, 30),
        send_forward_s=(0.0,) * (p - 1),
        send_backward_s=(0.0,) * (p - 1),
        static_memory_bytes=(1000, 2000, 3000),
    )
    assert _run("gpipe", p, m, costs).peak_memory_bytes == {0: 1060, 1: 2120, 2: 3180}
    # 1F1B holds min(p - s, m) micro-batches on stage s.
    assert _run("1f1b", p, m, costs).peak_memory_bytes == {0: 1030, 1: 2040, 2: 3030}


# ---- property test over random heterogeneous costs ----------------------------------------------

_cost = st.floats(min_value=0.01, max_value=10.0, allow_nan=False, allow_infinity=False)
_link = st.floats(min_value=0.0, max_value=10.0, allow_nan=False, allow_infinity=False)


@st.composite
def _problems(draw: st.DrawFn) -> tuple[int, int, StageCosts]:
    p = draw(st.integers(1, 5))
    m = draw(st.integers(1, 8))

    def stages(elem: st.SearchStrategy[float], n: int) -> tuple[float, ...]:
        return tuple(draw(st.lists(elem, min_size=n, max_size=n)))

    scale = draw(st.none() | st.lists(st.floats(0.25, 4.0), min_size=m, max_size=m).map(tuple))
    costs = StageCosts(
        forward_s=stages(_cost, p),
        backward_input_s=stages(_cost, p),
        backward_weight_s=stages(_cost, p),
        activation_bytes=stages(st.floats(1.0, 1e9), p),
        send_forward_s=stages(_link, p - 1),
        send_backward_s=stages(_link, p - 1),
        microbatch_scale=scale,
    )
    return p, m, costs


def _critical_path_s(costs: StageCosts, microbatch: int) -> float:
    """One micro-batch's dependency chain: every F and hop forward, every B and hop back, W0."""
    scale = costs.microbatch_scale[microbatch] if costs.microbatch_scale else 1.0
    chain = (
        sum(costs.forward_s)
        + sum(costs.send_forward_s)
        + sum(costs.backward_input_s)
        + sum(costs.send_backward_s)
        + costs.backward_weight_s[0]
    )
    return chain * scale


@settings(max_examples=60, deadline=None)
@given(_problems())
def test_simulation_properties(problem: tuple[int, int, StageCosts]) -> None:
    p, m, costs = problem
    results = {kind: _run(kind, p, m, costs) for kind in SCHEDULE_KINDS}
    lower_bound = max(_critical_path_s(costs, i) for i in range(m))
    for kind, result in results.items():
        eps = 1e-9 * max(1.0, result.step_time_s)
        assert result.step_time_s + eps >= max(result.per_rank_busy_s.values()), kind
        assert result.step_time_s + eps >= lower_bound, kind
        assert 0.0 <= result.bubble_ratio < 1.0, kind
        for ev in result.events:
            assert 0.0 <= ev.start_s <= ev.end_s <= result.step_time_s + eps
    assert results["1f1b"].peak_memory_bytes[0] <= results["gpipe"].peak_memory_bytes[0]


# ---- outputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
def test_chrome_trace(kind: str, tmp_path: Path) -> None:
    p, m = 3, 4
    placement = {s: s for s in range(p)}
    rank_schedule = lower(generate(kind, p, m), placement)
    result = simulate(
        rank_schedule, placement, StageCosts.uniform(p, send_s=0.5), num_microbatches=m
    )
    trace = json.loads(json.dumps(result.to_chrome_trace()))
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    compute = Counter((e["pid"], e["name"]) for e in complete if e["tid"] == 0)
    expected = Counter(
        (r, str(a)) for r, acts in rank_schedule.items() for a in acts if a.is_compute
    )
    assert compute == expected
    assert all(v == 1 for v in compute.values())
    sends = [e for e in complete if e["tid"] != 0]
    num_sends = sum(1 for acts in rank_schedule.values() for a in acts if not a.is_compute) // 2
    assert len(sends) == num_sends
    assert all(e["dur"] == pytest.approx(0.5e6) for e in sends)
    f0 = next(e for e in complete if e["name"] == "0F0")
    assert (f0["ts"], f0["dur"]) == (0.0, pytest.approx(1e6))
    # Perfetto drops slices that partially overlap on one track.
    by_track: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in complete:
        by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_track.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in itertools.pairwise(spans))
    path = tmp_path / "trace.json"
    result.write_chrome_trace(path)
    assert json.loads(path.read_text())["traceEvents"] == trace["traceEvents"]


def test_plot_timeline_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = _run("zb-h1", 4, 8, StageCosts.uniform(4, send_s=0.3))
    path = tmp_path / "timeline.png"
    plot_timeline(result, path)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 1000


@settings(max_examples=30, deadline=None)
@given(_problems())
def test_without_events_the_figures_are_the_same(problem: tuple[int, int, StageCosts]) -> None:
    """A search asks for no events; step time, busy time, bubble and memory do not change."""
    p, m, costs = problem
    placement = {s: s for s in range(p)}
    for kind in sorted(SCHEDULE_KINDS):
        ranked = lower(generate(kind, p, m), placement)
        full = simulate(ranked, placement, costs, num_microbatches=m)
        bare = simulate(ranked, placement, costs, num_microbatches=m, events=False)
        assert bare.events == () and full.events
        assert dataclasses.replace(full, events=()) == bare, kind
