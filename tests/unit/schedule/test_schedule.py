"""Schedule IR: text round trip, generators, lowering and the validator's errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_deepcee.schedule import (
    SCHEDULE_KINDS,
    Action,
    ActionKind,
    ScheduleError,
    format_actions,
    generate,
    lower,
    parse_action,
    parse_actions,
    render,
    validate,
)
from lightning_deepcee.schedule.generators import forward_only


@given(
    stage=st.integers(0, 99),
    kind=st.sampled_from(list(ActionKind)),
    mb=st.integers(0, 999),
)
def test_action_text_round_trip(stage: int, kind: ActionKind, mb: int) -> None:
    action = Action(stage, kind, mb)
    assert parse_action(str(action)) == action


def test_action_text_examples() -> None:
    assert str(Action(2, ActionKind.F, 0)) == "2F0"
    assert parse_action("1BW3") == Action(1, ActionKind.BW, 3)
    assert parse_action("0SEND_B12") == Action(0, ActionKind.SEND_B, 12)
    acts = parse_actions("0F0 0F1, 0BW0")
    assert format_actions(acts) == "0F0 0F1 0BW0"


@pytest.mark.parametrize("text", ["", "F0", "2X0", "2F", "-1F0", "2 F 0"])
def test_bad_action_text(text: str) -> None:
    with pytest.raises(ValueError, match="Cannot parse action"):
        parse_action(text)


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8])
def test_generated_schedules_validate(kind: str, p: int, m: int) -> None:
    placement = {s: s for s in range(p)}
    lowered = lower(generate(kind, p, m), placement)
    validate(lowered, placement, m)
    for rank, actions in lowered.items():
        compute = [a for a in actions if a.is_compute]
        forwards = [a.microbatch for a in compute if a.kind == ActionKind.F]
        assert forwards == list(range(m)), (rank, forwards)
        backward_kinds = {a.kind for a in compute} - {ActionKind.F}
        expected = {ActionKind.B, ActionKind.W} if kind == "zb-h1" else {ActionKind.BW}
        assert backward_kinds == expected


@pytest.mark.parametrize("p", [2, 3, 4])
def test_one_f_one_b_memory_bound(p: int) -> None:
    """1F1B keeps at most p - s micro-batches in flight on stage s; GPipe keeps all m."""
    m = 8
    for kind, bound in (("1f1b", lambda s: p - s), ("gpipe", lambda s: m)):
        for s, actions in generate(kind, p, m).items():
            live = peak = 0
            for a in actions:
                live += a.kind == ActionKind.F
                live -= a.kind == ActionKind.BW
                peak = max(peak, live)
            assert peak == bound(s)


def test_lowering_inserts_matched_transfers() -> None:
    placement = {0: 0, 1: 1}
    lowered = lower(generate("gpipe", 2, 1), placement)
    assert format_actions(lowered[0]) == "0F0 0SEND_F0 0RECV_B0 0BW0"
    assert format_actions(lowered[1]) == "1RECV_F0 1F0 1BW0 1SEND_B0"


def test_validator_marks_missing_receive() -> None:
    placement = {0: 0, 1: 1}
    lowered = lower(generate("gpipe", 2, 2), placement)
    lowered[1] = [a for a in lowered[1] if str(a) != "1RECV_F1"]
    with pytest.raises(ScheduleError, match=r"1F1 needs 1RECV_F1") as info:
        validate(lowered, placement, 2)
    assert ">>1F1<<" in str(info.value)


def test_validator_detects_deadlock() -> None:
    placement = {0: 0, 1: 1}
    lowered = {
        0: parse_actions("0RECV_B0 0F0 0SEND_F0 0BW0"),
        1: parse_actions("1RECV_F0 1F0 1BW0 1SEND_B0"),
    }
    with pytest.raises(ScheduleError):
        validate(lowered, placement, 1)
    # The same actions in a workable order on rank 0 but a circular wait:
    lowered = {
        0: parse_actions("0F0 0RECV_B0 0SEND_F0 0BW0"),
        1: parse_actions("1RECV_F0 1F0 1BW0 1SEND_B0"),
    }
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(lowered, placement, 1)


def test_validator_rejects_incomplete_and_reordered() -> None:
    placement = {0: 0}
    with pytest.raises(ScheduleError, match="no complete backward"):
        validate({0: parse_actions("0F0 0B0")}, placement, 1)
    with pytest.raises(ScheduleError, match="needs 0B0"):
        validate({0: parse_actions("0F0 0W0 0B0")}, placement, 1)
    with pytest.raises(ScheduleError, match="appears twice"):
        validate({0: parse_actions("0F0 0F0 0BW0")}, placement, 1)
    with pytest.raises(ScheduleError, match="placed on rank"):
        validate({1: parse_actions("0F0 0BW0")}, placement, 1)


def test_validator_rejects_out_of_order_messages() -> None:
    placement = {0: 0, 1: 1}
    lowered = {
        0: parse_actions("0F0 0SEND_F0 0F1 0SEND_F1"),
        1: parse_actions("1RECV_F1 1F1 1RECV_F0 1F0"),
    }
    with pytest.raises(ScheduleError, match="same order"):
        validate(lowered, placement, 2, require_backward=False)


def test_forward_only_schedule() -> None:
    placement = {0: 0, 1: 1, 2: 2}
    lowered = lower(forward_only(3, 4), placement)
    validate(lowered, placement, 4, require_backward=False)
    with pytest.raises(ScheduleError):
        validate(lowered, placement, 4)


def test_render_grid() -> None:
    text = render(lower(generate("1f1b", 2, 2), {0: 0, 1: 1}), compute_only=True)
    assert text.splitlines() == ["0 | 0F0  0F1  0BW0 0BW1", "1 | 1F0  1BW0 1F1  1BW1"]


@pytest.mark.parametrize("bad", [("gpipe", 0, 1), ("1f1b", 1, 0)])
def test_generator_arguments(bad: tuple[str, int, int]) -> None:
    with pytest.raises(ValueError):
        generate(*bad)
    with pytest.raises(ValueError, match="Unknown schedule"):
        generate("zb-v", 2, 2)
