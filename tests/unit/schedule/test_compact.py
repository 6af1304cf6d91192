"""The compact zero-bubble schedule: validity, in-flight caps and never worse than 1F1B/ZB-H1."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_deepcee.schedule import ActionKind, StageCosts, generate, lower, validate
from lightning_deepcee.schedule.compact import (
    COST_AWARE_SCHEDULE_KINDS,
    compact_zero_bubble,
    default_max_in_flight,
    generate_for_costs,
    in_flight_peak,
    simulated_step_time,
    split_backward,
)
from lightning_deepcee.schedule.generators import StageSchedule, one_f_one_b, zb_h1


def _costs(
    f: list[float],
    b: list[float],
    w: list[float],
    send_f: list[float],
    send_b: list[float],
    scale: list[float] | None = None,
) -> StageCosts:
    return StageCosts(
        forward_s=tuple(f),
        backward_input_s=tuple(b),
        backward_weight_s=tuple(w),
        activation_bytes=(0.0,) * len(f),
        send_forward_s=tuple(send_f),
        send_backward_s=tuple(send_b),
        microbatch_scale=None if scale is None else tuple(scale),
    )


@st.composite
def _cases(draw: st.DrawFn, *, full_caps: bool = False) -> tuple[StageCosts, int, list[int]]:
    p = draw(st.integers(1, 5))
    m = draw(st.integers(1, 10))
    compute = st.floats(0.1, 3.0)
    link = st.floats(0.0, 5.0)
    costs = _costs(
        draw(st.lists(compute, min_size=p, max_size=p)),
        draw(st.lists(compute, min_size=p, max_size=p)),
        draw(st.lists(compute, min_size=p, max_size=p)),
        draw(st.lists(link, min_size=p - 1, max_size=p - 1)),
        draw(st.lists(link, min_size=p - 1, max_size=p - 1)),
    )
    caps = [m] * p if full_caps else [draw(st.integers(min(p - s, m), m)) for s in range(p)]
    return costs, m, caps


def _time(schedule: StageSchedule, costs: StageCosts, m: int) -> float:
    return simulated_step_time(schedule, costs, m)


def _baselines(costs: StageCosts, m: int) -> tuple[float, float]:
    p = costs.num_stages
    # Split 1F1B (B then W) is never slower than plain 1F1B: its gradient leaves after B.
    return _time(split_backward(one_f_one_b(p, m)), costs, m), _time(zb_h1(p, m), costs, m)


def _check_structure(schedule: StageSchedule, p: int, m: int) -> None:
    placement = {s: s for s in range(p)}
    validate(lower(schedule, placement), placement, m)
    for s, acts in schedule.items():
        for kind in (ActionKind.F, ActionKind.B, ActionKind.W):
            assert [a.microbatch for a in acts if a.kind == kind] == list(range(m)), (s, kind)
        assert all(a.stage == s for a in acts)


@settings(max_examples=40, deadline=None)
@given(_cases())
def test_compact_is_valid_capped_and_never_worse(case: tuple[StageCosts, int, list[int]]) -> None:
    costs, m, caps = case
    p = costs.num_stages
    schedule = compact_zero_bubble(costs, m, max_in_flight=caps)
    _check_structure(schedule, p, m)
    peaks = in_flight_peak(schedule)
    assert all(peaks[s] <= caps[s] for s in range(p)), (peaks, caps)
    t_compact = _time(schedule, costs, m)  # simulate raises on deadlock
    t_1f1b, t_zb = _baselines(costs, m)
    assert t_compact <= t_1f1b + 1e-9
    zb_peaks = in_flight_peak(zb_h1(p, m))
    if all(zb_peaks[s] <= caps[s] for s in range(p)):
        assert t_compact <= t_zb + 1e-9


@settings(max_examples=25, deadline=None)
@given(_cases(full_caps=True))
def test_compact_with_memory_for_m_beats_both(case: tuple[StageCosts, int, list[int]]) -> None:
    costs, m, caps = case
    schedule = compact_zero_bubble(costs, m, max_in_flight=caps)
    _check_structure(schedule, costs.num_stages, m)
    assert _time(schedule, costs, m) <= min(_baselines(costs, m)) + 1e-9


@settings(max_examples=20, deadline=None)
@given(
    case=_cases(),
    scale=st.lists(st.floats(0.25, 2.0), min_size=10, max_size=10),
)
def test_compact_with_unequal_microbatches(
    case: tuple[StageCosts, int, list[int]], scale: list[float]
) -> None:
    base, m, caps = case
    costs = _costs(
        list(base.forward_s),
        list(base.backward_input_s),
        list(base.backward_weight_s),
        list(base.send_forward_s),
        list(base.send_backward_s),
        scale[:m],
    )
    schedule = compact_zero_bubble(costs, m, max_in_flight=caps)
    _check_structure(schedule, costs.num_stages, m)
    assert _time(schedule, costs, m) <= _baselines(costs, m)[0] + 1e-9


def test_default_caps_are_one_f_one_b_in_flight() -> None:
    for p in range(1, 6):
        for m in range(1, 9):
            assert default_max_in_flight(p, m) == list(in_flight_peak(one_f_one_b(p, m)).values())


def test_slow_wan_link_strictly_better_with_default_caps() -> None:
    # Four equal stages; the link between stages 1 and 2 is a slow wide-area hop.
    costs = _costs([1.0] * 4, [1.0] * 4, [1.0] * 4, [0.1, 3.0, 0.1], [0.1, 3.0, 0.1])
    schedule = compact_zero_bubble(costs, 8)
    t_1f1b, t_zb = _baselines(costs, 8)
    t_compact = _time(schedule, costs, 8)
    assert t_compact < min(t_1f1b, t_zb) - 0.5, (t_compact, t_1f1b, t_zb)
    peaks = in_flight_peak(schedule)
    assert all(peaks[s] <= 4 - s for s in range(4))


def test_slow_stage_strictly_better_when_memory_allows() -> None:
    # Stage 1 is 2x slower than the others; every link takes 1 s each way.
    f = [1.0, 2.0, 1.0, 1.0]
    costs = _costs(f, f, f, [1.0] * 3, [1.0] * 3)
    schedule = compact_zero_bubble(costs, 8, max_in_flight=[8] * 4)
    t_1f1b, t_zb = _baselines(costs, 8)
    t_compact = _time(schedule, costs, 8)
    assert t_compact < min(t_1f1b, t_zb) - 0.5, (t_compact, t_1f1b, t_zb)


def test_slow_wan_link_and_slow_stage_strictly_better() -> None:
    f = [1.0, 1.0, 2.0]
    costs = _costs(f, f, [0.5, 0.5, 1.0], [0.2, 4.0], [0.2, 4.0])
    schedule = compact_zero_bubble(costs, 6, max_in_flight=[6, 6, 6])
    t_compact = _time(schedule, costs, 6)
    assert t_compact < min(_baselines(costs, 6)) - 0.5


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_equal_costs_match_zb_h1(p: int, m: int) -> None:
    costs = StageCosts.uniform(p)
    caps = list(in_flight_peak(zb_h1(p, m)).values())  # ZB-H1's own memory
    schedule = compact_zero_bubble(costs, m, max_in_flight=caps)
    t_compact = _time(schedule, costs, m)
    assert t_compact <= _time(zb_h1(p, m), costs, m) + 1e-9
    if m >= p:  # the textbook 3m + p - 1 assumes a full steady phase
        assert t_compact <= 3 * m + p - 1 + 1e-9
    # With 1F1B's memory it is never worse than 1F1B.
    assert _time(compact_zero_bubble(costs, m), costs, m) <= _baselines(costs, m)[0] + 1e-9


def test_split_backward_is_never_slower() -> None:
    costs = _costs([1.0, 2.0], [0.5, 1.0], [0.7, 0.2], [1.5], [0.3])
    plain = one_f_one_b(2, 5)
    split = split_backward(plain)
    assert all(a.kind != ActionKind.BW for acts in split.values() for a in acts)
    # The split form sends the input gradient right after B instead of after B and W.
    assert _time(split, costs, 5) < _time(plain, costs, 5)
    uniform = StageCosts.uniform(4)
    assert _time(split_backward(one_f_one_b(4, 8)), uniform, 8) == 3 * 8 + 2 * 3  # 3m + 2(p-1)
    assert _time(one_f_one_b(4, 8), uniform, 8) == 3 * (8 + 4 - 1)


def test_generate_for_costs() -> None:
    costs = StageCosts.uniform(3, send_s=0.5)
    for kind in COST_AWARE_SCHEDULE_KINDS:
        schedule = generate_for_costs(kind, costs, 4)
        _check_structure(split_backward(schedule), 3, 4)
    assert generate_for_costs("1f1b", costs, 4) == generate("1f1b", 3, 4)
    assert generate_for_costs("compact", costs, 4, max_in_flight=[4, 4, 4]) == (
        compact_zero_bubble(costs, 4, max_in_flight=[4, 4, 4])
    )
    with pytest.raises(ValueError, match="Unknown schedule 'zb-v'"):
        generate_for_costs("zb-v", costs, 4)
    with pytest.raises(TypeError, match="takes no options"):
        generate_for_costs("gpipe", costs, 4, max_in_flight=[4, 4, 4])


def test_bad_arguments() -> None:
    costs = StageCosts.uniform(3)
    with pytest.raises(ValueError, match="max_in_flight has 2 entries"):
        compact_zero_bubble(costs, 4, max_in_flight=[3, 2])
    with pytest.raises(ValueError, match=r"max_in_flight\[1\] = 0"):
        compact_zero_bubble(costs, 4, max_in_flight=[3, 0, 1])
    with pytest.raises(ValueError, match="num_microbatches must be >= 1"):
        compact_zero_bubble(costs, 0)
    # Caps above m mean m; a cap below 1F1B's is allowed (1F1B is then no candidate).
    low = compact_zero_bubble(costs, 4, max_in_flight=[1, 1, 1])
    _check_structure(low, 3, 4)
    assert all(v <= 1 for v in in_flight_peak(low).values())
    assert compact_zero_bubble(costs, 4, max_in_flight=[99] * 3) == compact_zero_bubble(
        costs, 4, max_in_flight=[4] * 3
    )


def test_the_local_search_keeps_each_kind_in_micro_batch_order() -> None:
    """A case where a move listed before an earlier move of the same pass put W 2 before W 1."""
    costs = _costs(
        [2.0, 3.0, 0.9375],
        [1.0, 2.25, 2.1875],
        [1.0, 0.5, 2.5],
        [4.375, 3.0],
        [0.0, 2.75],
        [0.25, 0.75, 0.6875, 0.9375, 1.3125, 1.25, 1.5, 1.5, 1.5],
    )
    schedule = compact_zero_bubble(costs, 9, max_in_flight=[5, 5, 2])
    _check_structure(schedule, 3, 9)
    assert _time(schedule, costs, 9) <= _baselines(costs, 9)[0] + 1e-9
