"""Pipeline actions: the atoms of a schedule.

A schedule is plain data: for each rank, an ordered list of :class:`Action`. An action names a
stage, a kind and a micro-batch, and prints as ``2F0`` (stage 2, forward, micro-batch 0) or
``1SEND_B3``; :func:`parse_action` reads that text back. The executor dispatches on ``kind`` and
never decides order.

Kinds, roughly:

- ``F``: forward of one micro-batch through the stage.
- ``B``: gradient with respect to the stage *input* (on the critical path to the previous stage).
- ``W``: gradient with respect to the stage *weights* (deferrable, fills bubbles).
- ``BW``: ``B`` and ``W`` in one backward pass.
- ``SEND_F`` / ``RECV_F``: stage ``s`` sends its output to ``s + 1`` / receives its input from
  ``s - 1``.
- ``SEND_B`` / ``RECV_B``: stage ``s`` sends its input gradient to ``s - 1`` / receives its output
  gradient from ``s + 1``.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "Action",
    "ActionKind",
    "format_actions",
    "parse_action",
    "parse_actions",
]


class ActionKind(str, enum.Enum):
    """What an action does; the value is its text form."""

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW})
COMM_KINDS = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})

# Longest alternatives first so that "BW" is not read as "B" followed by garbage.
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|BW|F|B|W)(\d+)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a rank's schedule: ``kind`` of ``stage`` on micro-batch ``microbatch``."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __post_init__(self) -> None:
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"Action indices must be >= 0, got {self.stage=} {self.microbatch=}")
        if not isinstance(self.kind, ActionKind):
            object.__setattr__(self, "kind", ActionKind(self.kind))

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @property
    def is_compute(self) -> bool:
        """True for F, B, W and BW."""
        return self.kind in COMPUTE_KINDS


def parse_action(text: str) -> Action:
    """Read an action from its text form, e.g. ``"2F0"`` or ``"0SEND_B3"``."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
        raise ValueError(
            f"Cannot parse action {text!r}: expected <stage><kind><microbatch> with kind one of "
            f"{', '.join(k.value for k in ActionKind)} (e.g. '2F0', '1SEND_B3')."
        )
    stage, kind, microbatch = match.groups()
    return Action(int(stage), ActionKind(kind), int(microbatch))


def parse_actions(text: str) -> list[Action]:
    """Read a whitespace- or comma-separated list of actions."""
    return [parse_action(tok) for tok in re.split(r"[\s,]+", text.strip()) if tok]


def format_actions(actions: list[Action]) -> str:
    """Text form of an action list, space separated; :func:`parse_actions` reads it back."""
    return " ".join(str(a) for a in actions)
