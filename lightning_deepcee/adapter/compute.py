"""Compute changes: a device that trains slower (or faster) than it did, judged from its own
step's compute time.

Pure (stdlib plus the pure core), tested in one process on synthetic streams. Every training
rank's executor times the compute of its step (wall seconds inside forward and backward actions,
``StepStats.compute_s``); under a CPU quota that wall time includes the stalls, which is exactly
what another tenant taking part of the device looks like. The per-step exchange carries every
rank's figure, so every rank's :class:`ComputeMonitor` sees the same stream and all of them
decide alike.

A rank's figures are calibrated on its own configuration (the plan and split running, whose
stage and micro-batches set the work) from the ``calibration_steps`` samples after
``warmup_steps``: a band from the ``1 - compute_band_quantile`` quantile (``low``) to the
``compute_band_quantile`` quantile (``high``), and the median (``expected``), from which a
change's ratio is measured. Each direction is judged against the end of the band nearest to it,
as the link monitor judges a drop by the optimistic figure and a rise by the pessimistic one, so
the spread the device showed while nothing changed never reads as a change. On a device under a
CPU quota that spread is wide: an action that starts with its period's budget whole runs at full
speed, one that starts after it is spent waits for the next period, so a device that mostly
waits for its neighbours reads up to twice its usual compute with nothing changed. The window
and thresholds are the link monitor's (:class:`~lightning_deepcee.adapter.MonitorConfig`), read
as slowdowns instead of bandwidths:

- ``normal -> slowed``: every sample of the window above ``high * slow_threshold``,
  ``react_after`` steps in a row; the ``replan`` proposal comes with the change (a split cannot
  help a slow device);
- ``slowed -> normal``: the window median back under ``high * fast_threshold``, ``react_after``
  steps in a row (no proposal: the clock and the plan searched for the slow device decide what
  to keep);
- ``normal -> faster`` and back, the same way upwards against ``low`` (a device that got its CPU
  back while it trains), proposing a ``replan`` with the change; but not while the step is
  slower than its own calibrated figure (the slowest rank's step, calibrated like the compute):
  a device reads faster when it waits for another one (under a CPU quota a waiting device
  starts each burst with its period's budget whole, so its actions stall less), and the plan's
  devices do not get faster together with a slower step.

:func:`observed_compute` scales a slowed device's block times in the profile by its measured
ratio, as :func:`~lightning_deepcee.adapter.observed_profile` scales a link's bandwidth, so the
planner sees the device as it runs now; as a link's rise is, a device's speed-up is capped at
its figure in the profile measured at setup (``ceiling``).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_deepcee.adapter.monitor import quantile
from lightning_deepcee.adapter.records import MonitorConfig
from lightning_deepcee.profiler.data import ClusterProfile

__all__ = ["ComputeMonitor", "ComputeState", "compute_ratios", "observed_compute"]

ComputeState = Literal["normal", "slowed", "faster"]


@dataclass
class _Device:
    calibration: list[float] = field(default_factory=list)
    expected: float | None = None
    """The calibration's median: a change's ratio is measured from it."""
    low: float = 0.0
    """The calibration's ``1 - compute_band_quantile`` quantile: a speed-up is judged by it."""
    high: float = 0.0
    """The calibration's ``compute_band_quantile`` quantile: a slowdown is judged by it."""
    window: deque[float] = field(default_factory=deque)
    state: ComputeState = "normal"
    streak: int = 0

    def calibrate(self, quantile_above: float) -> None:
        """Set the figures from the calibration samples."""
        self.expected = statistics.median(self.calibration)
        self.low = quantile(self.calibration, 1 - quantile_above)
        self.high = quantile(self.calibration, quantile_above)


class ComputeMonitor:
    """Every training rank's compute seconds per step against its calibrated figure."""

    def __init__(self, ranks: Iterable[int], config: MonitorConfig) -> None:
        self.config = config
        self._devices = {int(r): _Device(window=deque(maxlen=config.window)) for r in ranks}
        self._step = _Device(window=deque(maxlen=config.window))
        """The slowest rank's step seconds, calibrated and windowed as a device's compute."""
        self._start: int | None = None

    @property
    def ranks(self) -> list[int]:
        """The ranks watched (those that train)."""
        return sorted(self._devices)

    def observe(
        self, step: int, compute_s: Sequence[float], step_s: float = 0.0
    ) -> list[dict[str, Any]]:
        """Take step ``step``'s compute seconds (indexed by rank; 0 where a rank did not train)
        and its slowest rank's step seconds ``step_s`` (0: unknown), and return the proposals
        (``Decision``-like dicts with ``device`` instead of a link)."""
        if self._start is None:
            self._start = step
        if step < self._start + self.config.warmup_steps:
            return []
        if step_s > 0 and not self._calibrate(self._step, float(step_s)):
            self._step.window.append(float(step_s))
        out = []
        for rank, device in sorted(self._devices.items()):
            seconds = float(compute_s[rank]) if rank < len(compute_s) else 0.0
            if not seconds > 0 or self._calibrate(device, seconds):
                continue
            device.window.append(seconds)
            decision = self._advance(step, rank, device)
            if decision is not None:
                out.append(decision)
        return out

    def _calibrate(self, device: _Device, seconds: float) -> bool:
        """Add a calibration sample while ``device`` has no figure; True when it took it."""
        if device.expected is not None:
            return False
        device.calibration.append(seconds)
        if len(device.calibration) >= max(1, self.config.calibration_steps):
            device.calibrate(self.config.compute_band_quantile)
        return True

    def step_slower(self) -> bool:
        """The window's median step is above its calibrated figure by the hysteresis band
        (``fast_threshold``): a device reading faster meanwhile waits for another."""
        if self._step.expected is None or not self._step.window:
            return False
        # The band's low end: a step barely slower than usual already holds a speed-up back.
        return statistics.median(self._step.window) > self._step.low * self.config.fast_threshold

    def _advance(self, step: int, rank: int, device: _Device) -> dict[str, Any] | None:
        cfg, expected = self.config, device.expected
        assert expected is not None
        if len(device.window) < cfg.window:
            return None
        median = statistics.median(device.window)
        if device.state == "normal":
            slow = min(device.window) > device.high * cfg.slow_threshold
            fast = max(device.window) < device.low / cfg.slow_threshold and not self.step_slower()
            device.streak = device.streak + 1 if slow or fast else 0
            if device.streak < cfg.react_after:
                return None
            device.state, device.streak = ("slowed" if slow else "faster"), 0
            word = "slower" if slow else "faster"
            q = cfg.compute_band_quantile
            bound = (
                f"> its calibrated {q:g} quantile ({device.high * 1e3:.0f} ms)"
                f"*{cfg.slow_threshold:g}"
                if slow
                else f"< its calibrated {1 - q:g} quantile ({device.low * 1e3:.0f} ms)"
                f"/{cfg.slow_threshold:g}"
            )
            return {
                "step": step, "kind": "replan", "device": rank, "name": f"device {rank}",
                "old_s": expected, "new_s": median, "ratio": median / expected,
                "reason": f"every compute sample of the window {bound} for {cfg.react_after} "
                f"steps: the device computes {median / expected:.2f}x as long ({word}); re-plan "
                "with its measured speed",
            }  # fmt: skip
        back = (
            median < device.high * cfg.fast_threshold
            if device.state == "slowed"
            else median > device.low / cfg.fast_threshold
        )
        device.streak = device.streak + 1 if back else 0
        if device.streak >= cfg.react_after:
            device.state, device.streak = "normal", 0
        return None

    def ratios(self) -> dict[int, float]:
        """Per rank not ``normal``: its window median over its expectation."""
        out = {}
        for rank, device in self._devices.items():
            if device.state != "normal" and device.expected and device.window:
                out[rank] = statistics.median(device.window) / device.expected
        return out

    def signature(self) -> list[list[Any]]:
        """The ranks not ``normal`` with their states (what a search is tied to)."""
        return [[r, d.state] for r, d in sorted(self._devices.items()) if d.state != "normal"]

    def state_dict(self) -> dict[str, Any]:
        return {
            "start": self._start,
            "devices": {str(r): _device_state(d) for r, d in self._devices.items()},
            "step": _device_state(self._step),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._start = state["start"]
        window, q = self.config.window, self.config.compute_band_quantile
        self._devices = {int(r): _load_device(d, window, q) for r, d in state["devices"].items()}
        step = state.get("step")  # absent in a state saved before the step was watched
        self._step = _Device(window=deque(maxlen=window)) if step is None else (
            _load_device(step, window, q)
        )  # fmt: skip


def _device_state(d: _Device) -> dict[str, Any]:
    return {"calibration": d.calibration, "expected": d.expected, "window": list(d.window),
            "state": d.state, "streak": d.streak}  # fmt: skip


def _load_device(d: Mapping[str, Any], window: int, quantile_above: float) -> _Device:
    device = _Device(
        calibration=[float(v) for v in d["calibration"]],
        window=deque((float(v) for v in d["window"]), maxlen=window),
        state=d["state"],
        streak=int(d["streak"]),
    )
    if d["expected"] is not None:  # calibrated: the figures follow from the samples
        device.calibrate(quantile_above)
    return device


def compute_ratios(decisions: Iterable[Mapping[str, Any]]) -> dict[int, float]:
    """The ``device -> ratio`` of compute proposals among ``decisions`` (link ones skipped)."""
    return {int(d["device"]): float(d["ratio"]) for d in decisions if "device" in d}


def observed_compute(
    profile: ClusterProfile,
    ratios: Mapping[int, float],
    ceiling: ClusterProfile | None = None,
) -> tuple[ClusterProfile, dict[int, float]]:
    """``profile`` with each device of ``ratios`` computing ``ratio`` times as long (its block
    times and optimizer time scaled, its capability divided); returns the profile and the
    ratios applied. A ratio must be positive and finite. With ``ceiling`` (the profile measured
    at setup) no device is made faster than it is there: a ratio below one is raised to what
    brings the device back to that figure (a device slowed in ``profile`` may recover that far)."""
    applied = {}
    devices = list(profile.devices)
    measured = {} if ceiling is None else {d.rank: d for d in ceiling.devices}
    for i, device in enumerate(devices):
        ratio = ratios.get(device.rank)
        if ratio is not None and not 0 < ratio < float("inf"):
            raise ValueError(f"observed_compute: rank {device.rank}: ratio {ratio!r}")
        if ratio is not None and ratio < 1 and device.rank in measured:
            now, setup = sum(device.block_seconds), sum(measured[device.rank].block_seconds)
            ratio = min(1.0, max(ratio, setup / now)) if now > 0 else 1.0
        if ratio is None or abs(ratio - 1) < 1e-9:
            continue

        def scale(times: tuple[float, ...], r: float = ratio) -> tuple[float, ...]:
            return tuple(t * r for t in times)

        devices[i] = dataclasses.replace(
            device,
            forward_s=scale(device.forward_s),
            backward_input_s=scale(device.backward_input_s),
            backward_weight_s=scale(device.backward_weight_s),
            fixed_s=scale(device.fixed_s),
            backward_s=scale(device.backward_s),
            optimizer_s_per_byte=device.optimizer_s_per_byte * ratio,
            capability=device.capability / ratio,
        )
        applied[device.rank] = ratio
    return dataclasses.replace(profile, devices=tuple(devices)), applied
