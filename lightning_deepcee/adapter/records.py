"""The link monitor's records: its settings, what it observes and what it proposes.

Plain, typed, JSON-ready data (stdlib only): :class:`MonitorConfig`, :class:`SharedLink`,
:class:`LinkObservation` (with :func:`observations_from_transfers`, which turns a rank's transfer
records into observations) and :class:`Decision`. The monitor itself is
:mod:`lightning_deepcee.adapter.monitor`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, Protocol

__all__ = [
    "Decision",
    "DecisionKind",
    "Link",
    "LinkObservation",
    "LinkState",
    "MonitorConfig",
    "SharedLink",
    "as_link",
    "check_bandwidth",
    "describe_link",
    "observations_from_transfers",
]

Link = tuple[int, int]
"""A directed device pair ``(src_rank, dst_rank)``."""

DecisionKind = Literal["split", "merge", "replan"]
LinkState = Literal["normal", "degraded", "improved"]

# Pairs named in a decision's one-line text; a shared link between two large groups has many.
_PAIRS_SHOWN = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class MonitorConfig:
    """Thresholds of the link monitor; every default is explained in ``docs/adapter.md``."""

    slow_threshold: float = 1.5
    """A link is degraded when every sample of its window is below ``expected / slow_threshold``
    for ``react_after`` steps (and, symmetrically, improved when every one is above
    ``expected * slow_threshold``)."""
    fast_threshold: float = 1.25
    """A degraded link recovers when its median is back above ``expected / fast_threshold``
    (an improved one settles when back below ``expected * fast_threshold``). It lies strictly
    between 1 and ``slow_threshold`` so the gap between the two is a hysteresis band: a link
    hovering at one threshold cannot flap between states."""
    window: int = 5
    """Samples (steps in which the link carried data) in the sliding window: a change must show
    in all of them, a recovery in their median, so a few noisy steps cannot trigger anything."""
    react_after: int = 3
    """Consecutive steps with the window beyond a threshold before the state changes (a
    ``split`` or ``merge`` proposal)."""
    replan_after: int = 20
    """Steps a DEGRADED or IMPROVED state must persist before the slow response: one re-plan."""
    severe_threshold: float = 4.0
    """A link whose every one of the newest ``severe_window`` samples is below ``expected /
    severe_threshold`` (above ``expected * severe_threshold``) changes state at once, without
    ``react_after``, and proposes its re-plan with the split, without ``replan_after`` (a link
    already degraded or improved proposes it when it turns severe): a change that large is no
    transient (a stall inflates a minority of samples), and each step on the old plan costs
    several."""
    severe_window: int = 3
    """The newest samples a severe change must show in, all of them (a ``window`` smaller than
    this uses all of its own): a drop to a quarter is acted on at its third sample, not its
    fifth, and a stall that inflates one sample, or two, still cannot pass for one."""
    min_bytes: int = 65536
    """Transfers smaller than this many bytes are ignored: their time is mostly latency and
    jitter, not bandwidth."""
    stamp_error_s: float = 0.01
    """Seconds a transfer's wire time may be read long by its stamps: the sender's payload can
    leave an interpreter switch interval (5 ms) after its header, and the receiver's timer can
    stamp it one switch late. Whether a link is slower than expected is judged on each
    transfer's wire time less this (at least 0): a transfer of a millisecond or two read late
    by up to this is not taken for a slow link, while a link slow enough to matter still is.
    Whether it is faster (and the come-back's judgement) uses the time as read."""
    max_split: int = 4
    """The most pieces a micro-batch may be split into on a degraded link."""
    warmup_steps: int = 5
    """Steps, from the first one the monitor sees, whose transfers are left out: the first
    steps of a run (or of a new layout) are slow for reasons that have nothing to do with the
    links (allocation, first-call overheads, devices not yet in step)."""
    calibration_steps: int = 10
    """Samples after the warm-up from which each link's calibrated figure is taken; the link is
    judged against ``min(plan's figure, calibrated figure)``, or the calibrated figure alone
    where the plan gives none. 0 trusts the plan's figure from the first sample on."""
    calibration_quantile: float = 0.75
    """Which quantile of the calibration samples is the calibrated figure: above the median,
    so that a minority of stalled samples (a CPU quota that stalls the receiver while it stamps
    an arrival) does not lower it."""
    compute_band_quantile: float = 0.9
    """A device's compute is judged against a band of its calibration samples: a slowdown
    against this quantile of them, a speed-up against ``1 - compute_band_quantile``. Under a
    CPU quota a device that mostly waits reads up to twice its usual compute with nothing
    changed (an action that starts after its period's budget is spent waits for the next
    period); the band keeps that spread from reading as a change. In ``[0.5, 1]``."""

    def __post_init__(self) -> None:
        for name in (
            "slow_threshold",
            "fast_threshold",
            "severe_threshold",
            "calibration_quantile",
            "compute_band_quantile",
            "stamp_error_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"MonitorConfig.{name}: expected a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"MonitorConfig.{name}: expected a finite number, got {value}")
        if not 1.0 <= self.fast_threshold < self.slow_threshold:
            raise ValueError(
                "MonitorConfig: expected 1 <= fast_threshold < slow_threshold (the gap is the "
                f"hysteresis band), got fast_threshold={self.fast_threshold}, "
                f"slow_threshold={self.slow_threshold}; e.g. set fast_threshold=1.25, "
                "slow_threshold=1.5"
            )
        if self.severe_threshold < self.slow_threshold:
            raise ValueError(
                "MonitorConfig: expected severe_threshold >= slow_threshold (a severe change is "
                f"a large one), got severe_threshold={self.severe_threshold}, "
                f"slow_threshold={self.slow_threshold}; e.g. set severe_threshold=4"
            )
        if self.stamp_error_s < 0:
            raise ValueError(
                f"MonitorConfig.stamp_error_s: expected seconds >= 0, got {self.stamp_error_s}; "
                "set stamp_error_s=0.01 (the default) or 0 to judge the wire time as read"
            )
        if not 0.0 <= self.calibration_quantile <= 1.0:
            raise ValueError(
                "MonitorConfig.calibration_quantile: expected a number in [0, 1], got "
                f"{self.calibration_quantile}; set calibration_quantile=0.75 (the default)"
            )
        if not 0.5 <= self.compute_band_quantile <= 1.0:
            raise ValueError(
                "MonitorConfig.compute_band_quantile: expected a number in [0.5, 1], got "
                f"{self.compute_band_quantile}; set compute_band_quantile=0.9 (the default)"
            )
        defaults = {f.name: f.default for f in fields(MonitorConfig)}
        for name, minimum in (
            ("window", 1),
            ("severe_window", 1),
            ("react_after", 1),
            ("replan_after", 1),
            ("min_bytes", 0),
            ("max_split", 1),
            ("warmup_steps", 0),
            ("calibration_steps", 0),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"MonitorConfig.{name}: expected an integer, got {value!r}")
            if value < minimum:
                raise ValueError(
                    f"MonitorConfig.{name}: expected an integer >= {minimum}, got {value}; "
                    f"set {name}={defaults[name]} (the default) or any "
                    f"value >= {minimum}"
                )

    @property
    def severe_samples(self) -> int:
        """How many of the newest samples a severe change is judged on: ``severe_window``, or
        the whole ``window`` where that is smaller."""
        return min(self.severe_window, self.window)

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable copy."""
        return asdict(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class SharedLink:
    """Device pairs whose transfers cross one link together, judged as one link.

    The cost model lets all messages between two network groups share the wide-area link
    between them (``planner/evaluator.py``): two senders in one region sending to another region
    each get a part of it. Judging each pair by its solo figure would read that sharing as a
    drop; the monitor sums the bytes of all the pairs instead and compares with ``capacity``.
    """

    name: str
    """How decisions name the link (e.g. ``net0->net1``)."""
    pairs: tuple[Link, ...]
    """The directed pairs that cross it."""
    capacity: float | None = None
    """Bytes/s the pairs share (the plan's figure); ``None``: calibrated only."""

    def __post_init__(self) -> None:
        pairs = tuple(as_link(p) for p in self.pairs)
        if not pairs or len(set(pairs)) != len(pairs):
            raise ValueError(
                f"SharedLink {self.name!r}: expected distinct (src, dst) pairs, got {pairs}"
            )
        object.__setattr__(self, "pairs", tuple(sorted(pairs)))
        if self.capacity is not None:
            check_bandwidth(f"SharedLink {self.name!r}.capacity", self.capacity)


@dataclass(frozen=True, slots=True)
class LinkObservation:
    """One completed transfer of ``num_bytes`` from rank ``src`` to rank ``dst`` that took
    ``seconds`` (latency included), during training step ``step``; ``optimistic_seconds``: the
    least it may have taken, each transfer's time less the stamps' error
    (``MonitorConfig.stamp_error_s``), judged for a slow link (None: ``seconds``)."""

    step: int
    src: int
    dst: int
    num_bytes: int
    seconds: float
    optimistic_seconds: float | None = None

    @property
    def link(self) -> Link:
        return (self.src, self.dst)


class _TransferLike(Protocol):
    # Matches runtime.transport.TransferRecord without importing torch.
    @property
    def peer(self) -> int: ...
    @property
    def num_bytes(self) -> int: ...
    @property
    def seconds(self) -> float: ...
    @property
    def direction(self) -> str: ...


def observations_from_transfers(
    step: int, rank: int, records: Iterable[_TransferLike]
) -> list[LinkObservation]:
    """Turn one rank's transfer records (``peer, num_bytes, seconds, direction``) into
    observations: a ``send`` is the link ``rank -> peer``, a ``recv`` the link ``peer -> rank``."""
    observations = []
    for record in records:
        if record.direction == "send":
            src, dst = rank, record.peer
        elif record.direction == "recv":
            src, dst = record.peer, rank
        else:
            raise ValueError(
                f"transfer record direction: expected 'send' or 'recv', got {record.direction!r}"
            )
        observations.append(LinkObservation(step, src, dst, record.num_bytes, record.seconds))
    return observations


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """What the monitor proposes at the end of step ``step`` for the link ``name``.

    - ``split``: the link is slower than planned; split micro-batches (``split_factor`` pieces
      would restore each piece's time on the link) so the stage behind it starts sooner.
    - ``merge``: the link recovered; send whole micro-batches again (``split_factor`` is 1).
    - ``replan``: the change persisted; re-plan with the measured bandwidth and move blocks at a
      step boundary (``split_factor`` is the link's split, unchanged).

    A proposal only: the Callback asks the cost model what acting on it would gain and confirms
    the outcome with the step time before keeping it.
    """

    step: int
    link: Link
    """The link's first pair (its only one unless the link is shared)."""
    kind: DecisionKind
    old_bandwidth: float
    """What the link is judged against (bytes/s)."""
    new_bandwidth: float
    """The window median measured when deciding, bytes/s."""
    split_factor: int
    reason: str
    pairs: tuple[Link, ...] = ()
    """Every pair of the link (``(link,)`` unless it is a :class:`SharedLink`)."""
    name: str = ""
    """The link's name (``src->dst`` for a single pair)."""
    severe: bool = False
    """A severe change: every one of the newest ``severe_window`` samples shows it, so the
    newest steps are the network as it is now."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "link", as_link(self.link))
        if not self.pairs:
            object.__setattr__(self, "pairs", (self.link,))
        if not self.name:
            object.__setattr__(self, "name", f"{self.link[0]}->{self.link[1]}")

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable copy (links as lists)."""
        return {
            "step": self.step,
            "link": list(self.link),
            "kind": self.kind,
            "old_bandwidth": self.old_bandwidth,
            "new_bandwidth": self.new_bandwidth,
            "split_factor": self.split_factor,
            "reason": self.reason,
            "pairs": [list(p) for p in self.pairs],
            "name": self.name,
            "severe": self.severe,
        }

    def __str__(self) -> str:
        return (
            f"step {self.step} link {describe_link(self.name, self.pairs)} {self.kind} "
            f"x{self.split_factor}: {_fmt_bw(self.old_bandwidth)} -> "
            f"{_fmt_bw(self.new_bandwidth)} ({self.reason})"
        )


def describe_link(name: str, pairs: Sequence[Sequence[int]]) -> str:
    """``0->1`` for a single pair, ``net0->net1 (0->2, 1->2)`` for a shared link."""
    if len(pairs) <= 1:
        return name
    shown = ", ".join(f"{s}->{d}" for s, d in pairs[:_PAIRS_SHOWN])
    more = f", ... {len(pairs)} pairs" if len(pairs) > _PAIRS_SHOWN else ""
    return f"{name} ({shown}{more})"


def check_bandwidth(where: str, value: Any) -> None:
    """``ValueError`` (naming ``where``) unless ``value`` is a finite bandwidth > 0."""
    if not (isinstance(value, int | float) and not isinstance(value, bool)) or not (
        math.isfinite(value) and value > 0
    ):
        raise ValueError(
            f"{where}: expected a finite bandwidth > 0 bytes/s, got {value!r}; leave links "
            "without a real connection out of the mapping (None: calibrate it)"
        )


def as_link(raw: Any) -> Link:
    """``(src, dst)`` as a tuple of ints; ``ValueError`` naming the value otherwise."""
    try:
        src, dst = raw
        return (int(src), int(dst))
    except (TypeError, ValueError):
        raise ValueError(
            f"link {raw!r}: expected a pair (src_rank, dst_rank) of integers"
        ) from None


def _fmt_bw(bytes_per_s: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.2f} {unit}"
    return f"{bytes_per_s:.0f} B/s"
