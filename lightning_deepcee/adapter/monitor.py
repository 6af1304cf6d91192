"""The Dynamic Environment Adapter's logic: watch every link, decide split / merge / re-plan.

This module is pure (stdlib only, no torch, no Lightning) so it is tested in one process on
synthetic timing streams. A Lightning Callback shim feeds it the executor's per-transfer timings
once per step and applies the decisions it returns.

Roughly, per directed link ``(src, dst)`` and per step:

1. the step's transfers over the link give one sample of effective bandwidth,
   ``sum(num_bytes) / sum(seconds - expected latency)`` (transfers under ``min_bytes`` skipped);
2. the sample enters a sliding window of ``window`` samples; only the window median is judged;
3. a state machine (NORMAL, DEGRADED, IMPROVED) moves after ``react_after`` consecutive medians
   beyond a threshold, with different thresholds in and out (hysteresis);
4. entering DEGRADED returns a ``split`` decision (fast response), leaving it a ``merge``; a
   DEGRADED or IMPROVED state that persists ``replan_after`` steps returns one ``replan``.

See ``docs/adapter.md`` for the reasoning behind each default.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, Protocol

__all__ = [
    "Decision",
    "DecisionKind",
    "Link",
    "LinkMonitor",
    "LinkObservation",
    "LinkState",
    "MonitorConfig",
    "observations_from_transfers",
]

Link = tuple[int, int]
"""A directed link ``(src_rank, dst_rank)``."""

DecisionKind = Literal["split", "merge", "replan"]
LinkState = Literal["normal", "degraded", "improved"]

_STATE_DICT_VERSION = 1
# A transfer whose time is almost all latency says nothing about bandwidth: if less than this
# fraction of its seconds is left after subtracting the expected latency, it is skipped rather
# than turned into a huge (or negative) bandwidth.
_MIN_PAYLOAD_FRACTION = 0.05
# ceil(expected / measured) on an exact ratio (2.0000000001 from float rounding) must not jump
# to the next split factor.
_SPLIT_RATIO_TOLERANCE = 1e-6


@dataclass(frozen=True, kw_only=True, slots=True)
class MonitorConfig:
    """Thresholds of the link monitor; every default is explained in ``docs/adapter.md``."""

    slow_threshold: float = 1.5
    """A link is degraded when its median bandwidth falls below ``expected / slow_threshold``
    (and, symmetrically, improved when it rises above ``expected * slow_threshold``)."""
    fast_threshold: float = 1.25
    """A degraded link recovers when its median is back above ``expected / fast_threshold``
    (an improved one settles when back below ``expected * fast_threshold``). It lies strictly
    between 1 and ``slow_threshold`` so the gap between the two is a hysteresis band: a link
    hovering at one threshold cannot flap between states."""
    window: int = 5
    """Samples (steps in which the link carried data) in the sliding window; decisions use the
    window median, so a single noisy step cannot trigger anything."""
    react_after: int = 3
    """Consecutive window medians beyond a threshold before the state changes (the fast
    response: split or merge)."""
    replan_after: int = 20
    """Steps a DEGRADED or IMPROVED state must persist before the slow response: one re-plan."""
    min_bytes: int = 65536
    """Transfers smaller than this many bytes are ignored: their time is mostly latency and
    jitter, not bandwidth."""
    max_split: int = 4
    """The most pieces a micro-batch may be split into on a degraded link."""

    def __post_init__(self) -> None:
        for name in ("slow_threshold", "fast_threshold"):
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
        defaults = {f.name: f.default for f in fields(MonitorConfig)}
        for name, minimum in (
            ("window", 1),
            ("react_after", 1),
            ("replan_after", 1),
            ("min_bytes", 0),
            ("max_split", 1),
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

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable copy."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class LinkObservation:
    """One completed transfer of ``num_bytes`` from rank ``src`` to rank ``dst`` that took
    ``seconds`` (latency included), during training step ``step``."""

    step: int
    src: int
    dst: int
    num_bytes: int
    seconds: float

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
    """What the monitor asks of the runtime at the end of step ``step`` for ``link``.

    - ``split``: the sender before ``link`` splits each micro-batch into ``split_factor`` pieces
      from the next step on, so the receiving stage can start on the first piece sooner.
    - ``merge``: the link recovered; send whole micro-batches again (``split_factor`` is 1).
    - ``replan``: the change persisted; re-plan with ``new_bandwidth`` for this link and move
      blocks at a step boundary (``split_factor`` is the split in force, unchanged).
    """

    step: int
    link: Link
    kind: DecisionKind
    old_bandwidth: float
    """What the plan assumed, bytes/s."""
    new_bandwidth: float
    """The window median measured when deciding, bytes/s."""
    split_factor: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable copy (``link`` as a list)."""
        return {
            "step": self.step,
            "link": list(self.link),
            "kind": self.kind,
            "old_bandwidth": self.old_bandwidth,
            "new_bandwidth": self.new_bandwidth,
            "split_factor": self.split_factor,
            "reason": self.reason,
        }

    def __str__(self) -> str:
        src, dst = self.link
        return (
            f"step {self.step} link {src}->{dst} {self.kind} x{self.split_factor}: "
            f"{_fmt_bw(self.old_bandwidth)} -> {_fmt_bw(self.new_bandwidth)} ({self.reason})"
        )


@dataclass(slots=True)
class _LinkTrack:
    expected_bandwidth: float
    expected_latency: float
    window: deque[float]
    state: LinkState = "normal"
    down_streak: int = 0
    up_streak: int = 0
    since_step: int = 0
    split: int = 1
    replanned: bool = False


class LinkMonitor:
    """Watches directed links against the bandwidth the plan assumed and returns decisions.

    ``expected_bandwidth`` maps ``(src, dst)`` to bytes/s (finite, positive); only those links
    are watched, observations of any other link are ignored. ``expected_latency`` maps links to
    one-way latency in seconds, subtracted from every transfer's time (0 where missing).
    """

    def __init__(
        self,
        expected_bandwidth: Mapping[Link, float],
        expected_latency: Mapping[Link, float] | None = None,
        config: MonitorConfig | None = None,
    ) -> None:
        self.config = config if config is not None else MonitorConfig()
        self._links: dict[Link, _LinkTrack] = {}
        self._last_step: int | None = None
        self._install(expected_bandwidth, expected_latency, keep_windows=False)

    @classmethod
    def from_matrices(
        cls,
        bandwidth_bytes_per_s: Sequence[Sequence[float]],
        latency_s: Sequence[Sequence[float]] | None = None,
        config: MonitorConfig | None = None,
    ) -> LinkMonitor:
        """Build from ``[src][dst]`` matrices (``ClusterProfile.bandwidth_bytes_per_s`` and
        ``latency_s``); the diagonal and non-finite entries (no real link) are skipped."""
        bandwidth: dict[Link, float] = {}
        latency: dict[Link, float] = {}
        for src, row in enumerate(bandwidth_bytes_per_s):
            for dst, value in enumerate(row):
                if src != dst and math.isfinite(value):
                    bandwidth[(src, dst)] = float(value)
                    if latency_s is not None:
                        latency[(src, dst)] = float(latency_s[src][dst])
        return cls(bandwidth, latency, config)

    # -- queries ---------------------------------------------------------------------------

    @property
    def links(self) -> list[Link]:
        """The watched links, sorted."""
        return sorted(self._links)

    def current_split(self, link: Link) -> int:
        """Pieces each micro-batch over ``link`` is split into now (1 for an unwatched link)."""
        track = self._links.get(_link(link))
        return 1 if track is None else track.split

    def link_state(self, link: Link) -> LinkState:
        """``normal``, ``degraded`` or ``improved`` (``normal`` for an unwatched link)."""
        track = self._links.get(_link(link))
        return "normal" if track is None else track.state

    def measured_bandwidth(self, link: Link) -> float | None:
        """Median of the link's window, bytes/s; None before its first sample."""
        track = self._links.get(_link(link))
        if track is None or not track.window:
            return None
        return statistics.median(track.window)

    # -- updates ---------------------------------------------------------------------------

    def observe(self, step: int, observations: Sequence[LinkObservation]) -> list[Decision]:
        """Take step ``step``'s transfers and return the decisions for it, sorted by link.

        Every watched link that carried at least one measurable transfer gets one sample
        (total bytes over total latency-corrected seconds). ``step`` is the monitor's clock for
        ``replan_after`` and must not go backwards.
        """
        if self._last_step is not None and step < self._last_step:
            raise ValueError(
                f"LinkMonitor.observe: step {step} is before the last observed step "
                f"{self._last_step}; pass the global step, which only grows (after resuming, "
                "load_state_dict restores the last step)"
            )
        self._last_step = step
        totals: dict[Link, list[float]] = {}
        for obs in observations:
            track = self._links.get(obs.link)
            if track is None or obs.num_bytes < self.config.min_bytes or obs.num_bytes <= 0:
                continue
            payload_s = obs.seconds - track.expected_latency
            if not math.isfinite(payload_s) or payload_s <= _MIN_PAYLOAD_FRACTION * obs.seconds:
                continue
            total = totals.setdefault(obs.link, [0.0, 0.0])
            total[0] += obs.num_bytes
            total[1] += payload_s
        decisions: list[Decision] = []
        for link in sorted(totals):
            num_bytes, seconds = totals[link]
            track = self._links[link]
            track.window.append(num_bytes / seconds)
            decision = self._advance(step, link, track)
            if decision is not None:
                decisions.append(decision)
        return decisions

    def rebase(
        self,
        expected_bandwidth: Mapping[Link, float],
        expected_latency: Mapping[Link, float] | None = None,
    ) -> None:
        """Adopt a new plan's assumptions (after acting on a ``replan``): every link goes back
        to NORMAL with split 1; measured windows of links still watched are kept."""
        self._install(expected_bandwidth, expected_latency, keep_windows=True)

    # -- checkpointing ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue identically after a resume, as JSON-ready types."""
        return {
            "version": _STATE_DICT_VERSION,
            "config": self.config.to_dict(),
            "last_step": self._last_step,
            "links": [
                {
                    "src": link[0],
                    "dst": link[1],
                    "expected_bandwidth": track.expected_bandwidth,
                    "expected_latency": track.expected_latency,
                    "window": list(track.window),
                    "state": track.state,
                    "down_streak": track.down_streak,
                    "up_streak": track.up_streak,
                    "since_step": track.since_step,
                    "split": track.split,
                    "replanned": track.replanned,
                }
                for link, track in sorted(self._links.items())
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`. The watched links and their expectations come from
        the state (so a ``rebase`` survives a resume); the config stays this monitor's own."""
        version = state.get("version")
        if version != _STATE_DICT_VERSION:
            raise ValueError(
                f"LinkMonitor.load_state_dict: expected version {_STATE_DICT_VERSION}, got "
                f"{version!r}; the checkpoint was written by an incompatible version"
            )
        saved_config = state.get("config")
        if saved_config is not None and saved_config != self.config.to_dict():
            known = {f.name for f in fields(MonitorConfig)}
            changed = sorted(
                k for k in known if saved_config.get(k) != getattr(self.config, k, None)
            )
            warnings.warn(
                f"LinkMonitor.load_state_dict: the checkpoint's MonitorConfig differs in "
                f"{changed}; continuing with the current config {self.config}",
                stacklevel=2,
            )
        links: dict[Link, _LinkTrack] = {}
        for entry in state["links"]:
            state_name = entry["state"]
            if state_name not in ("normal", "degraded", "improved"):
                raise ValueError(
                    f"LinkMonitor.load_state_dict: link {entry['src']}->{entry['dst']} has "
                    f"unknown state {state_name!r}; expected normal, degraded or improved"
                )
            links[(int(entry["src"]), int(entry["dst"]))] = _LinkTrack(
                expected_bandwidth=float(entry["expected_bandwidth"]),
                expected_latency=float(entry["expected_latency"]),
                window=deque((float(v) for v in entry["window"]), maxlen=self.config.window),
                state=state_name,
                down_streak=int(entry["down_streak"]),
                up_streak=int(entry["up_streak"]),
                since_step=int(entry["since_step"]),
                split=min(int(entry["split"]), self.config.max_split),
                replanned=bool(entry["replanned"]),
            )
        self._links = links
        last_step = state.get("last_step")
        self._last_step = None if last_step is None else int(last_step)

    # -- internals -------------------------------------------------------------------------

    def _install(
        self,
        expected_bandwidth: Mapping[Link, float],
        expected_latency: Mapping[Link, float] | None,
        *,
        keep_windows: bool,
    ) -> None:
        latency = dict(expected_latency or {})
        links: dict[Link, _LinkTrack] = {}
        for raw_link, bandwidth in expected_bandwidth.items():
            link = _link(raw_link)
            if not (isinstance(bandwidth, int | float) and math.isfinite(bandwidth)) or (
                bandwidth <= 0
            ):
                raise ValueError(
                    f"expected_bandwidth[{link}]: expected a finite bandwidth > 0 bytes/s, got "
                    f"{bandwidth!r}; leave links without a real connection out of the mapping"
                )
            lat = latency.get(link, 0.0)
            if not (isinstance(lat, int | float) and math.isfinite(lat)) or lat < 0:
                raise ValueError(
                    f"expected_latency[{link}]: expected a finite latency >= 0 seconds, got {lat!r}"
                )
            old = self._links.get(link) if keep_windows else None
            window = deque(old.window if old else (), maxlen=self.config.window)
            links[link] = _LinkTrack(float(bandwidth), float(lat), window)
        for raw_link in latency:
            if _link(raw_link) not in links:
                raise ValueError(
                    f"expected_latency has link {raw_link} but expected_bandwidth does not; "
                    "give both for every watched link"
                )
        self._links = links

    def _advance(self, step: int, link: Link, track: _LinkTrack) -> Decision | None:
        cfg = self.config
        if len(track.window) < cfg.window:
            return None
        median = statistics.median(track.window)
        expected = track.expected_bandwidth
        slow_below = expected / cfg.slow_threshold
        fast_above = expected * cfg.slow_threshold
        if track.state == "normal":
            track.down_streak = track.down_streak + 1 if median < slow_below else 0
            track.up_streak = track.up_streak + 1 if median > fast_above else 0
            if track.down_streak >= cfg.react_after:
                return self._enter_degraded(step, link, track, median)
            if track.up_streak >= cfg.react_after:
                self._enter(track, "improved", step)
            return None
        if track.state == "degraded":
            recovered = median > expected / cfg.fast_threshold
            track.up_streak = track.up_streak + 1 if recovered else 0
            if track.up_streak >= cfg.react_after:
                self._enter(track, "normal", step)
                track.split = 1
                return self._decision(
                    step,
                    link,
                    track,
                    "merge",
                    median,
                    f"median > expected/{cfg.fast_threshold:g} for {cfg.react_after} "
                    "consecutive samples; send whole micro-batches again",
                )
            return self._maybe_replan(step, link, track, median, "slower")
        # improved
        settled = median < expected * cfg.fast_threshold
        track.down_streak = track.down_streak + 1 if settled else 0
        if track.down_streak >= cfg.react_after:
            self._enter(track, "normal", step)
            return None
        return self._maybe_replan(step, link, track, median, "faster")

    def _enter_degraded(self, step: int, link: Link, track: _LinkTrack, median: float) -> Decision:
        cfg = self.config
        self._enter(track, "degraded", step)
        ratio = track.expected_bandwidth / median
        track.split = max(1, min(cfg.max_split, math.ceil(ratio * (1 - _SPLIT_RATIO_TOLERANCE))))
        return self._decision(
            step,
            link,
            track,
            "split",
            median,
            f"median < expected/{cfg.slow_threshold:g} for {cfg.react_after} consecutive "
            f"samples; split each micro-batch {track.split} ways "
            f"(ceil({ratio:.2f}), max_split={cfg.max_split})",
        )

    def _maybe_replan(
        self, step: int, link: Link, track: _LinkTrack, median: float, direction: str
    ) -> Decision | None:
        if track.replanned or step - track.since_step < self.config.replan_after:
            return None
        track.replanned = True
        return self._decision(
            step,
            link,
            track,
            "replan",
            median,
            f"link {direction} than planned for {step - track.since_step} steps "
            f"(replan_after={self.config.replan_after}); re-plan with the measured bandwidth",
        )

    @staticmethod
    def _enter(track: _LinkTrack, state: LinkState, step: int) -> None:
        track.state = state
        track.since_step = step
        track.down_streak = 0
        track.up_streak = 0
        track.replanned = False

    @staticmethod
    def _decision(
        step: int, link: Link, track: _LinkTrack, kind: DecisionKind, median: float, reason: str
    ) -> Decision:
        return Decision(
            step=step,
            link=link,
            kind=kind,
            old_bandwidth=track.expected_bandwidth,
            new_bandwidth=median,
            split_factor=track.split,
            reason=reason,
        )


def _link(raw: Any) -> Link:
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
