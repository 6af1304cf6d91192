"""The adapter's link monitor: watch every link, propose split / merge / re-plan.

This module is pure (stdlib only, no torch, no Lightning) so it is tested in one process on
synthetic timing streams. The Lightning Callback feeds it every step's transfers (gathered from
all ranks) and puts each proposal to the cost model and then to the clock before acting on it
(``adapter/gate.py``, ``adapter/guard.py``).

What it watches is a *link*: one directed device pair, or a :class:`SharedLink`, the pairs whose
transfers cross one wide-area link together (as the cost model shares the link between two network
groups). Roughly, per link and per step:

1. the steps of the first ``warmup_steps`` are left out (start-up, first allocations, CPU-quota
   stalls before the pipeline runs in step);
2. the step's transfers give one sample: per pair ``bytes`` and latency-corrected ``seconds``,
   then ``sum(bytes) / max(least seconds)`` over the pairs (the link's throughput if the pairs
   ran together, the cost model's assumption, each transfer's time less the stamps' error,
   ``stamp_error_s``) and ``sum(bytes) / sum(seconds)`` (if they ran one after another, the
   time as read); for a single pair without a stamp error both are ``bytes / seconds``;
3. the link's expectation is the plan's figure (the profile's bandwidth of the pair, or the
   capacity the pairs of a shared link share), lowered to a calibrated figure when that is
   lower: the ``calibration_quantile`` of the link's first ``calibration_steps`` samples;
4. a link is *degraded* when every sample of its window, taken as if the pairs ran together
   (the optimistic figure), is below ``expected / slow_threshold``, and *improved* when every
   sample taken as if they ran one after another (the pessimistic one) is above
   ``expected * slow_threshold``, for ``react_after`` steps in a row: neither a minority of
   stalled samples nor how the pairs happened to overlap looks like a change; it is back to
   normal when the window median is past ``expected / fast_threshold`` (hysteresis);
5. entering DEGRADED proposes a ``split``, leaving it a ``merge``; a DEGRADED or IMPROVED state
   that persists ``replan_after`` steps proposes one ``replan``;
6. a severe change (every one of the newest ``severe_window`` samples beyond
   ``severe_threshold`` times the expectation) enters its state at once and proposes its
   ``replan`` with the ``split``; a link already degraded (improved) that turns severe proposes
   its ``replan`` then.

See ``docs/adapter.md`` for the reasoning behind each default.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from lightning_deepcee.adapter.records import (
    Decision,
    DecisionKind,
    Link,
    LinkObservation,
    LinkState,
    MonitorConfig,
    SharedLink,
    as_link,
    check_bandwidth,
    describe_link,
    observations_from_transfers,
)

__all__ = [
    "Decision",
    "DecisionKind",
    "Link",
    "LinkMonitor",
    "LinkObservation",
    "LinkState",
    "MonitorConfig",
    "SharedLink",
    "describe_link",
    "observations_from_transfers",
    "quantile",
]

_STATE_DICT_VERSION = 2
# A transfer whose time is almost all latency says nothing about bandwidth: if less than this
# fraction of its seconds is left after subtracting the expected latency, it is skipped rather
# than turned into a huge (or negative) bandwidth.
_MIN_PAYLOAD_FRACTION = 0.05
# ceil(expected / measured) on an exact ratio (2.0000000001 from float rounding) must not jump
# to the next split factor.
_SPLIT_RATIO_TOLERANCE = 1e-6


@dataclass(slots=True)
class _Track:
    """One watched link (a pair or a shared link) and its state machine."""

    name: str
    pairs: tuple[Link, ...]
    planned: float | None
    """The plan's figure, bytes/s (None: none given)."""
    expected: float | None
    """What the link is judged against; None until calibrated."""
    calibration: list[float]
    together: deque[float]
    """Samples assuming the pairs ran at the same time: sum(bytes) / max(seconds)."""
    apart: deque[float]
    """Samples assuming they ran one after another: sum(bytes) / sum(seconds)."""
    state: LinkState = "normal"
    down_streak: int = 0
    up_streak: int = 0
    since_step: int = 0
    split: int = 1
    replanned: bool = False
    fresh: int = 0
    """Samples since the state was entered: a severe change is judged on these only, so the
    samples that ended one state cannot also start the next."""

    def measured(self) -> float | None:
        window = self.apart if self.state == "improved" else self.together
        return statistics.median(window) if window else None


class LinkMonitor:
    """Watches links against what the plan expects of them and proposes decisions.

    ``expected_bandwidth`` maps each watched pair ``(src, dst)`` to the plan's figure in bytes/s
    (finite, positive) or ``None`` (calibrated only); ``shared`` groups pairs into
    :class:`SharedLink` s, judged together against their capacity (their pairs need not be in
    ``expected_bandwidth``). Observations of any other pair are ignored. ``expected_latency``
    maps pairs to one-way latency in seconds, subtracted from every transfer's time (0 where
    missing).
    """

    def __init__(
        self,
        expected_bandwidth: Mapping[Link, float | None],
        expected_latency: Mapping[Link, float] | None = None,
        config: MonitorConfig | None = None,
        shared: Iterable[SharedLink] = (),
    ) -> None:
        self.config = config if config is not None else MonitorConfig()
        self._tracks: dict[str, _Track] = {}
        self._track_of: dict[Link, str] = {}
        self._latency: dict[Link, float] = {}
        self._last_step: int | None = None
        self._start_step: int | None = None
        self._install(expected_bandwidth, expected_latency, tuple(shared), keep_windows=False)

    @classmethod
    def from_matrices(
        cls,
        bandwidth_bytes_per_s: Sequence[Sequence[float]],
        latency_s: Sequence[Sequence[float]] | None = None,
        config: MonitorConfig | None = None,
    ) -> LinkMonitor:
        """Build from ``[src][dst]`` matrices (``ClusterProfile.bandwidth_bytes_per_s`` and
        ``latency_s``), every pair its own link; the diagonal and non-finite entries (no real
        link) are skipped."""
        bandwidth: dict[Link, float | None] = {}
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
        """Every watched pair, sorted."""
        return sorted(self._track_of)

    @property
    def link_names(self) -> list[str]:
        """The watched links (pairs and shared links) by name, sorted."""
        return sorted(self._tracks)

    def current_split(self, link: Link) -> int:
        """The split the link of pair ``link`` asked for (1 for an unwatched pair)."""
        track = self._track(link)
        return 1 if track is None else track.split

    def link_state(self, link: Link) -> LinkState:
        """``normal``, ``degraded`` or ``improved`` (``normal`` for an unwatched pair)."""
        track = self._track(link)
        return "normal" if track is None else track.state

    def measured_bandwidth(self, link: Link) -> float | None:
        """The window median of the link of pair ``link`` (bytes/s) as it is judged now (the
        pessimistic figure while improved, else the optimistic one); None before a sample."""
        track = self._track(link)
        return None if track is None else track.measured()

    def expected_bandwidth(self, link: Link) -> float | None:
        """What the link of pair ``link`` is judged against; None while it calibrates."""
        track = self._track(link)
        return None if track is None else track.expected

    @property
    def calibrated(self) -> bool:
        """Every watched link has its expectation (none is still calibrating)."""
        return all(track.expected is not None for track in self._tracks.values())

    def signature(self) -> tuple[tuple[str, str], ...]:
        """``(name, state)`` of every link that is not normal: what the links say now."""
        return tuple(
            (name, track.state) for name, track in sorted(self._tracks.items())
            if track.state != "normal"
        )  # fmt: skip

    # -- updates ---------------------------------------------------------------------------

    def observe(self, step: int, observations: Sequence[LinkObservation]) -> list[Decision]:
        """Take step ``step``'s transfers and return the decisions for it, sorted by link.

        Every watched link that carried at least one measurable transfer gets one sample.
        ``step`` is the monitor's clock for ``warmup_steps`` and ``replan_after`` and must not
        go backwards.
        """
        if self._last_step is not None and step < self._last_step:
            raise ValueError(
                f"LinkMonitor.observe: step {step} is before the last observed step "
                f"{self._last_step}; pass the global step, which only grows (after resuming, "
                "load_state_dict restores the last step)"
            )
        self._last_step = step
        if self._start_step is None:
            self._start_step = step
        if step < self._start_step + self.config.warmup_steps:
            return []
        per_pair: dict[Link, list[float]] = {}
        for obs in observations:
            name = self._track_of.get(obs.link)
            if name is None or obs.num_bytes < self.config.min_bytes or obs.num_bytes <= 0:
                continue
            latency = self._latency.get(obs.link, 0.0)
            payload_s = obs.seconds - latency
            if not math.isfinite(payload_s) or payload_s <= _MIN_PAYLOAD_FRACTION * obs.seconds:
                continue
            # The least the payload may have taken (the stamps' error off each transfer), and
            # never below the same share of what was read as a payload must keep.
            least = obs.seconds if obs.optimistic_seconds is None else obs.optimistic_seconds
            least_s = max(min(least - latency, payload_s), _MIN_PAYLOAD_FRACTION * payload_s)
            total = per_pair.setdefault(obs.link, [0.0, 0.0, 0.0])
            total[0] += obs.num_bytes
            total[1] += payload_s
            total[2] += least_s
        per_track: dict[str, list[list[float]]] = {}
        for link, sums in per_pair.items():
            per_track.setdefault(self._track_of[link], []).append(sums)
        decisions: list[Decision] = []
        for name in sorted(per_track):
            totals = per_track[name]
            num_bytes = sum(t[0] for t in totals)
            track = self._tracks[name]
            # Judged slow on the least time, faster on the time as read (step 2 above).
            track.together.append(num_bytes / max(t[2] for t in totals))
            track.apart.append(num_bytes / sum(t[1] for t in totals))
            track.fresh += 1
            if track.expected is None:
                self._calibrate(track)
                continue
            decisions += self._advance(step, track)
        return decisions

    def rebase(
        self,
        expected_bandwidth: Mapping[Link, float | None],
        expected_latency: Mapping[Link, float] | None = None,
        shared: Iterable[SharedLink] = (),
    ) -> None:
        """Adopt a new plan's figures (after acting on a ``replan``): every link goes back to
        NORMAL with split 1, judged against the new figures (links without one calibrate
        again); measured windows of links still watched under the same name are kept."""
        self._install(expected_bandwidth, expected_latency, tuple(shared), keep_windows=True)

    # -- checkpointing ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue identically after a resume, as JSON-ready types."""
        return {
            "version": _STATE_DICT_VERSION,
            "config": self.config.to_dict(),
            "last_step": self._last_step,
            "start_step": self._start_step,
            "latency": [[s, d, lat] for (s, d), lat in sorted(self._latency.items())],
            "links": [
                {
                    "name": name,
                    "pairs": [list(p) for p in track.pairs],
                    "planned": track.planned,
                    "expected": track.expected,
                    "calibration": list(track.calibration),
                    "together": list(track.together),
                    "apart": list(track.apart),
                    "state": track.state,
                    "down_streak": track.down_streak,
                    "up_streak": track.up_streak,
                    "since_step": track.since_step,
                    "split": track.split,
                    "replanned": track.replanned,
                    "fresh": track.fresh,
                }
                for name, track in sorted(self._tracks.items())
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
        size = self.config.window
        tracks: dict[str, _Track] = {}
        for entry in state["links"]:
            state_name = entry["state"]
            if state_name not in ("normal", "degraded", "improved"):
                raise ValueError(
                    f"LinkMonitor.load_state_dict: link {entry['name']} has unknown state "
                    f"{state_name!r}; expected normal, degraded or improved"
                )
            tracks[entry["name"]] = _Track(
                name=entry["name"],
                pairs=tuple(as_link(p) for p in entry["pairs"]),
                planned=_optional_float(entry["planned"]),
                expected=_optional_float(entry["expected"]),
                calibration=[float(v) for v in entry["calibration"]],
                together=deque((float(v) for v in entry["together"]), maxlen=size),
                apart=deque((float(v) for v in entry["apart"]), maxlen=size),
                state=state_name,
                down_streak=int(entry["down_streak"]),
                up_streak=int(entry["up_streak"]),
                since_step=int(entry["since_step"]),
                split=min(int(entry["split"]), self.config.max_split),
                replanned=bool(entry["replanned"]),
                fresh=int(entry.get("fresh", size)),
            )
        self._tracks = tracks
        self._track_of = {pair: name for name, t in tracks.items() for pair in t.pairs}
        self._latency = {(int(s), int(d)): float(lat) for s, d, lat in state["latency"]}
        self._last_step = _optional_int(state.get("last_step"))
        self._start_step = _optional_int(state.get("start_step"))

    # -- internals -------------------------------------------------------------------------

    def _track(self, link: Link) -> _Track | None:
        name = self._track_of.get(as_link(link))
        return None if name is None else self._tracks[name]

    def _install(
        self,
        expected_bandwidth: Mapping[Link, float | None],
        expected_latency: Mapping[Link, float] | None,
        shared: tuple[SharedLink, ...],
        *,
        keep_windows: bool,
    ) -> None:
        cfg = self.config
        figures: dict[str, tuple[tuple[Link, ...], float | None]] = {}
        track_of: dict[Link, str] = {}
        for group in shared:
            if group.name in figures:
                raise ValueError(f"shared: two links are named {group.name!r}")
            for pair in group.pairs:
                if pair in track_of:
                    raise ValueError(
                        f"shared: pair {pair} is in both {track_of[pair]!r} and {group.name!r}; "
                        "a pair crosses one shared link at most"
                    )
                track_of[pair] = group.name
            figures[group.name] = (group.pairs, group.capacity)
        for raw_link, bandwidth in expected_bandwidth.items():
            link = as_link(raw_link)
            if bandwidth is not None:
                check_bandwidth(f"expected_bandwidth[{link}]", bandwidth)
            if link in track_of:
                continue  # judged with its shared link
            name = f"{link[0]}->{link[1]}"
            track_of[link] = name
            figures[name] = ((link,), None if bandwidth is None else float(bandwidth))
        latency: dict[Link, float] = {}
        for raw_link, lat in (expected_latency or {}).items():
            link = as_link(raw_link)
            if link not in track_of:
                raise ValueError(
                    f"expected_latency has link {raw_link} but expected_bandwidth does not; "
                    "give both for every watched link"
                )
            if not (isinstance(lat, int | float) and math.isfinite(lat)) or lat < 0:
                raise ValueError(
                    f"expected_latency[{link}]: expected a finite latency >= 0 seconds, got {lat!r}"
                )
            latency[link] = float(lat)
        tracks: dict[str, _Track] = {}
        for name, (pairs, planned) in figures.items():
            if planned is None and cfg.calibration_steps == 0:
                raise ValueError(
                    f"link {name}: no expected bandwidth and calibration_steps=0; give the "
                    "plan's figure or calibrate (calibration_steps >= 1)"
                )
            old = self._tracks.get(name) if keep_windows else None
            tracks[name] = _Track(
                name=name,
                pairs=pairs,
                planned=planned,
                expected=planned if cfg.calibration_steps == 0 or keep_windows else None,
                calibration=[],
                together=deque(old.together if old else (), maxlen=cfg.window),
                apart=deque(old.apart if old else (), maxlen=cfg.window),
            )
        self._tracks = tracks
        self._track_of = track_of
        self._latency = latency

    def _calibrate(self, track: _Track) -> None:
        track.calibration.append(track.together[-1])
        if len(track.calibration) < self.config.calibration_steps:
            return
        calibrated = quantile(track.calibration, self.config.calibration_quantile)
        track.expected = calibrated if track.planned is None else min(track.planned, calibrated)

    def _advance(self, step: int, track: _Track) -> list[Decision]:
        cfg = self.config
        if len(track.together) < cfg.window:
            return []
        together = statistics.median(track.together)
        apart = statistics.median(track.apart)
        expected = track.expected
        assert expected is not None
        # A severe change is judged on the newest severe_window samples, all of them taken in
        # the state now held, and its figure is their median (the window's would still hold
        # samples from before the change).
        n = cfg.severe_samples
        newest_t, newest_a = list(track.together)[-n:], list(track.apart)[-n:]
        severe_slow = track.fresh >= n and max(newest_t) < expected / cfg.severe_threshold
        severe_fast = track.fresh >= n and min(newest_a) > expected * cfg.severe_threshold
        slow_median, fast_median = statistics.median(newest_t), statistics.median(newest_a)
        if track.state == "normal":
            # A change must show in every sample of the window, not just its median: a
            # receiver whose CPU quota stalls it stamps a minority of arrivals late (or early).
            slow = max(track.together) < expected / cfg.slow_threshold
            fast = min(track.apart) > expected * cfg.slow_threshold
            track.down_streak = track.down_streak + 1 if slow else 0
            track.up_streak = track.up_streak + 1 if fast else 0
            if severe_slow:
                split = self._enter_degraded(step, track, slow_median, severe=True)
                return [split, self._replan(step, track, slow_median, "slower", severe=True)]
            if severe_fast:
                self._enter(track, "improved", step)
                return [self._replan(step, track, fast_median, "faster", severe=True)]
            if track.down_streak >= cfg.react_after:
                return [self._enter_degraded(step, track, together)]
            if track.up_streak >= cfg.react_after:
                self._enter(track, "improved", step)
            return []
        if track.state == "degraded":
            recovered = together > expected / cfg.fast_threshold
            track.up_streak = track.up_streak + 1 if recovered else 0
            if track.up_streak >= cfg.react_after:
                self._enter(track, "normal", step)
                track.split = 1
                return [
                    self._decision(
                        step,
                        track,
                        "merge",
                        together,
                        f"median > expected/{cfg.fast_threshold:g} for {cfg.react_after} "
                        "consecutive samples; send whole micro-batches again",
                    )
                ]
            if not track.replanned and severe_slow:
                return [self._replan(step, track, slow_median, "slower", severe=True)]
            return self._maybe_replan(step, track, together, "slower")
        # improved
        settled = apart < expected * cfg.fast_threshold
        track.down_streak = track.down_streak + 1 if settled else 0
        if track.down_streak >= cfg.react_after:
            self._enter(track, "normal", step)
            return []
        if not track.replanned and severe_fast:
            return [self._replan(step, track, fast_median, "faster", severe=True)]
        return self._maybe_replan(step, track, apart, "faster")

    def _enter_degraded(
        self, step: int, track: _Track, median: float, *, severe: bool = False
    ) -> Decision:
        cfg = self.config
        self._enter(track, "degraded", step)
        assert track.expected is not None
        ratio = track.expected / median
        track.split = max(1, min(cfg.max_split, math.ceil(ratio * (1 - _SPLIT_RATIO_TOLERANCE))))
        return self._decision(
            step,
            track,
            "split",
            median,
            (
                f"every one of the newest {cfg.severe_samples} samples < "
                f"expected/{cfg.severe_threshold:g}, "
                if severe
                else f"every sample < expected/{cfg.slow_threshold:g} for {cfg.react_after} steps, "
            )
            + f"median {median / track.expected:.0%} of expected; {track.split} pieces per "
            "micro-batch would restore each piece's time "
            f"(ceil({ratio:.2f}), max_split={cfg.max_split})",
        )

    def _maybe_replan(
        self, step: int, track: _Track, median: float, direction: str
    ) -> list[Decision]:
        if track.replanned or step - track.since_step < self.config.replan_after:
            return []
        return [self._replan(step, track, median, direction, severe=False)]

    def _replan(
        self, step: int, track: _Track, median: float, direction: str, *, severe: bool
    ) -> Decision:
        cfg = self.config
        track.replanned = True
        why = (
            f"every one of the newest {cfg.severe_samples} samples {direction} "
            f"than planned by more than {cfg.severe_threshold:g}x (severe_threshold)"
            if severe
            else f"link {direction} than planned for {step - track.since_step} steps "
            f"(replan_after={cfg.replan_after})"
        )
        return self._decision(
            step, track, "replan", median, f"{why}; re-plan with the measured bandwidth", severe
        )

    @staticmethod
    def _enter(track: _Track, state: LinkState, step: int) -> None:
        track.state = state
        track.since_step = step
        track.down_streak = 0
        track.up_streak = 0
        track.replanned = False
        track.fresh = 0

    @staticmethod
    def _decision(
        step: int,
        track: _Track,
        kind: DecisionKind,
        median: float,
        reason: str,
        severe: bool = False,
    ) -> Decision:
        assert track.expected is not None
        return Decision(
            step=step,
            link=track.pairs[0],
            kind=kind,
            old_bandwidth=track.expected,
            new_bandwidth=median,
            split_factor=track.split,
            reason=reason,
            pairs=track.pairs,
            name=track.name,
            severe=severe,
        )


def quantile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
