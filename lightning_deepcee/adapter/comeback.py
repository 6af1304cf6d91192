"""Coming back: watch the links a re-plan moved away from, and return when they recover.

Pure (stdlib plus the pure core), tested in one process. A re-plan that leaves a slowed
wide-area link stops sending over it, so the monitor, which judges the running plan's own
transfers, never sees it recover. The Lightning side (``callbacks/comeback.py``) probes each such
link instead: one pair of it sends a message of known size at most once per step, the receiver
stamps the payload's time on the wire as the transport does, and the figures travel in the
per-step exchange. Here:

- :func:`abandoned_links`: the links of the move's ``replan`` proposals that the new plan no
  longer uses, one per pair of endpoint sets (a link and its reverse share one probe, as the
  observed profile lets a link's reverse change with it), with the pair to probe and the figure
  the link delivered before it fell;
- :class:`ComeBackWatch`: a window of probe samples per link; a link has recovered when the
  window is full and its median is back above ``expected / fast_threshold`` (the monitor's own
  rule for a degraded link's return);
- :func:`slowed_devices` and :class:`DeviceWatch`: the same for a device a move left because it
  computed slower (another tenant). Idle, nothing trains there to show its recovery; kept with
  less work, its compute time hardly shows it either (under a CPU quota a light load fits the
  slowed budget). So the device times a fixed piece of compute now and then
  (``runtime/compute_probe.py``) and the seconds travel in the exchange's probe slot of that
  rank. The first ``window`` samples are the device as it was left (slowed); it has recovered
  when a window's median is below that figure by ``slow_threshold`` (the compute monitor's own
  threshold for a change);
- :func:`choose_return`: the plan left, predicted on its own profile with each probed link at
  what the probe measures, against the running plan's step, each by its own clock where both
  have a reference (the model's error differs from plan to plan); the move back is made when it
  is expected faster (no margin: the plan left was the planner's choice on the same model, and
  the clock still confirms the move, as for any move towards the plan).
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_deepcee.adapter.monitor import Link, LinkState
from lightning_deepcee.adapter.replan import LinkFigure, ReplanChoice, observed_profile
from lightning_deepcee.planner.cost_model import predict_plan
from lightning_deepcee.planner.plan import Plan
from lightning_deepcee.profiler.data import ClusterProfile

__all__ = [
    "PROBE_TARGET_S",
    "Abandoned",
    "ComeBackWatch",
    "DeviceWatch",
    "abandoned_links",
    "choose_return",
    "probe_bytes",
    "restored_profile",
    "slowed_devices",
]

PROBE_TARGET_S = 0.1
"""A probe message takes about this long on its link as it runs now: the sender sizes each
message from the rate of its last round. Sized for the figure before the fall, a message on a
link at a tenth would hold the link for a second, and the small messages that cross it meanwhile
(the adapter's per-step all-reduce, which the idle ranks behind it join) would wait as long."""
_MIN_PROBE_BYTES = 64 * 2**10
_MAX_PROBE_BYTES = 4 * 2**20


def probe_bytes(rate: float) -> int:
    """The probe message's size for a link that now delivers ``rate`` bytes/s (0: unknown, the
    first message): about :data:`PROBE_TARGET_S` of transfer, within 64 KiB and 4 MiB (the
    profiler's large message)."""
    if not rate > 0:
        return _MIN_PROBE_BYTES
    return int(min(max(rate * PROBE_TARGET_S, _MIN_PROBE_BYTES), _MAX_PROBE_BYTES))


@dataclass(frozen=True, kw_only=True, slots=True)
class Abandoned:
    """A slowed link a move left: its pairs (both directions where both were proposed on), the
    pair probed, and what the link delivered before it fell (bytes/s)."""

    name: str
    pairs: tuple[Link, ...]
    probe: Link
    expected: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pairs": [list(p) for p in self.pairs],
            "probe": list(self.probe),
            "expected": self.expected,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Abandoned:
        return cls(
            name=str(data["name"]),
            pairs=tuple((int(s), int(d)) for s, d in data["pairs"]),
            probe=(int(data["probe"][0]), int(data["probe"][1])),
            expected=float(data["expected"]),
        )


def abandoned_links(
    replans: Iterable[Mapping[str, Any]], used: Iterable[Link], idle: Collection[int]
) -> list[Abandoned]:
    """The slowed links of ``replans`` (``Decision.to_dict()`` of the move's ``replan``
    proposals) none of whose pairs the new plan uses (``used``, its :func:`plan_pairs`).

    A link and its reverse (the same two sets of endpoints) are one entry, probed once. The
    probed pair prefers a receiver the new plan leaves idle (it stamps arrivals in a thread),
    then an idle sender; its link's figure before the fall is the entry's ``expected``.
    """
    used_pairs = set(used)
    entries: dict[frozenset[frozenset[int]], list[Mapping[str, Any]]] = {}
    for decision in replans:
        if "new_bandwidth" not in decision:
            continue  # a device's compute, not a link
        if float(decision["new_bandwidth"]) >= float(decision["old_bandwidth"]):
            continue  # a link that got faster was not left for being slow
        pairs = [(int(s), int(d)) for s, d in decision.get("pairs") or [decision["link"]]]
        if used_pairs.intersection(pairs):
            continue
        key = frozenset({frozenset(s for s, _ in pairs), frozenset(d for _, d in pairs)})
        entries.setdefault(key, []).append(decision)
    out = []
    for decisions in entries.values():
        links = {
            (int(s), int(d)): d_ for d_ in decisions for s, d in d_.get("pairs") or [d_["link"]]
        }
        probe = max(sorted(links), key=lambda p: (p[1] in idle, p[0] in idle))
        names = sorted({str(d.get("name") or f"{d['link'][0]}->{d['link'][1]}") for d in decisions})
        out.append(
            Abandoned(
                name=" + ".join(names),
                pairs=tuple(sorted(links)),
                probe=probe,
                expected=float(links[probe]["old_bandwidth"]),
            )
        )
    return sorted(out, key=lambda a: a.probe)


class ComeBackWatch:
    """Probe samples of the abandoned links, a window of ``window`` per link (see the module
    docstring). Every rank feeds it the same exchanged figures, so all judge alike."""

    def __init__(self, links: Sequence[Abandoned], *, window: int, fast_threshold: float) -> None:
        if window < 1:
            raise ValueError(f"ComeBackWatch: window must be at least 1, got {window}")
        if not fast_threshold >= 1:
            raise ValueError(f"ComeBackWatch: fast_threshold must be >= 1, got {fast_threshold}")
        self.links = list(links)
        self.window = window
        self.fast_threshold = fast_threshold
        self.samples: dict[Link, list[float]] = {a.probe: [] for a in self.links}

    @property
    def probes(self) -> list[Link]:
        """The probed pairs, sorted."""
        return sorted(self.samples)

    def observe(self, rows: Iterable[Sequence[Any]]) -> None:
        """``[src, dst, bytes, wire seconds, ...]`` rows of one step (the exchange's); rows
        of other pairs are ignored. The wire seconds as read: a link is back when its
        pessimistic reading says so."""
        for src, dst, num_bytes, seconds, *_ in rows:
            window = self.samples.get((int(src), int(dst)))
            if window is not None and float(seconds) > 0 and float(num_bytes) > 0:
                window.append(float(num_bytes) / float(seconds))
                del window[: -self.window]

    def measured(self, link: Abandoned) -> float | None:
        """The window median of ``link``'s probe (bytes/s), once the window is full."""
        window = self.samples[link.probe]
        return statistics.median(window) if len(window) >= self.window else None

    def recovered(self) -> list[Abandoned]:
        """The links whose probe's window median is back above ``expected / fast_threshold``."""
        out = []
        for link in self.links:
            measured = self.measured(link)
            if measured is not None and measured > link.expected / self.fast_threshold:
                out.append(link)
        return out

    def figures(self) -> list[LinkFigure]:
        """Every pair of every link with a full window, at its probe's ratio (``normal`` once
        recovered, so that the profile keeps its figure)."""
        recovered = {a.probe for a in self.recovered()}
        figures = []
        for link in self.links:
            measured = self.measured(link)
            if measured is None:
                continue
            state: LinkState = "normal" if link.probe in recovered else "degraded"
            figures += [
                LinkFigure(
                    link=pair,
                    expected_bandwidth=link.expected,
                    measured_bandwidth=measured,
                    state=state,
                )
                for pair in link.pairs
            ]
        return figures

    def state_dict(self) -> dict[str, Any]:
        return {
            "links": [a.to_dict() for a in self.links],
            "samples": [[list(p), list(w)] for p, w in sorted(self.samples.items())],
            "window": self.window,
            "fast_threshold": self.fast_threshold,
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> ComeBackWatch:
        watch = cls(
            [Abandoned.from_dict(a) for a in state["links"]],
            window=int(state["window"]),
            fast_threshold=float(state["fast_threshold"]),
        )
        for pair, window in state["samples"]:
            watch.samples[(int(pair[0]), int(pair[1]))] = [float(v) for v in window]
        return watch


def slowed_devices(replans: Iterable[Mapping[str, Any]]) -> list[int]:
    """The devices of ``replans``' compute proposals that computed slower (``ratio`` above one):
    the ones a move left to watch for their recovery, idle or with less work."""
    return sorted({int(d["device"]) for d in replans if "device" in d and float(d["ratio"]) > 1})


class DeviceWatch:
    """Compute probe seconds of the devices a move left, a window of ``window`` per device after
    as many calibration samples (the device as it was left), both after ``warmup`` samples left
    out (the move's own work: the new stage's first steps, the state just received); every rank
    sees the same."""

    def __init__(
        self, devices: Sequence[int], *, window: int, slow_threshold: float, warmup: int = 2
    ) -> None:
        if window < 1 or warmup < 0:
            raise ValueError(
                f"DeviceWatch: window must be at least 1 and warmup at least 0, got {window} "
                f"and {warmup}"
            )
        if not slow_threshold > 1:
            raise ValueError(f"DeviceWatch: slow_threshold must be above 1, got {slow_threshold}")
        self.devices = sorted(int(d) for d in devices)
        self.window = window
        self.slow_threshold = slow_threshold
        self.warmup = warmup
        self.skipped: dict[int, int] = dict.fromkeys(self.devices, 0)
        self.calibration: dict[int, list[float]] = {d: [] for d in self.devices}
        self.samples: dict[int, list[float]] = {d: [] for d in self.devices}

    def observe(self, probe_s: Sequence[float]) -> None:
        """One step's exchanged probe seconds (indexed by rank; 0 where no probe ended)."""
        for device in self.devices:
            seconds = float(probe_s[device]) if device < len(probe_s) else 0.0
            if not seconds > 0:
                continue
            if self.skipped[device] < self.warmup:
                self.skipped[device] += 1
                continue
            calibration = self.calibration[device]
            if len(calibration) < self.window:
                calibration.append(seconds)
                continue
            window = self.samples[device]
            window.append(seconds)
            del window[: -self.window]

    def slowed_s(self, device: int) -> float | None:
        """The probe's seconds on ``device`` as it was left (its calibration's median)."""
        calibration = self.calibration[device]
        return statistics.median(calibration) if len(calibration) >= self.window else None

    def speedup(self, device: int) -> float | None:
        """How many times faster the probe runs now than when the device was left (a full
        window's median), or ``None`` before that."""
        slowed, window = self.slowed_s(device), self.samples[device]
        if slowed is None or len(window) < self.window:
            return None
        return slowed / statistics.median(window)

    def recovered(self) -> list[int]:
        """The devices whose probe runs ``slow_threshold`` times faster than when left."""
        out = []
        for device in self.devices:
            speedup = self.speedup(device)
            if speedup is not None and speedup > self.slow_threshold:
                out.append(device)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "devices": self.devices, "window": self.window, "slow_threshold": self.slow_threshold,
            "calibration": [[d, w] for d, w in sorted(self.calibration.items())],
            "samples": [[d, w] for d, w in sorted(self.samples.items())],
            "warmup": self.warmup, "skipped": [[d, n] for d, n in sorted(self.skipped.items())],
        }  # fmt: skip

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> DeviceWatch:
        watch = cls(
            state["devices"],
            window=int(state["window"]),
            slow_threshold=float(state["slow_threshold"]),
            warmup=int(state.get("warmup", 0)),  # older states: no warm-up
        )
        for device, count in state.get("skipped", []):
            watch.skipped[int(device)] = int(count)
        for device, values in state["calibration"]:
            watch.calibration[int(device)] = [float(v) for v in values]
        for device, values in state["samples"]:
            watch.samples[int(device)] = [float(v) for v in values]
        return watch


def restored_profile(left_profile: ClusterProfile, watch: ComeBackWatch) -> ClusterProfile:
    """The profile of the plan left, with each probed link at what its probe measures (a
    recovered link keeps the profile's figure)."""
    return observed_profile(left_profile, watch.figures())[0]


def choose_return(
    left_plan: Plan,
    restored: ClusterProfile,
    current_s: float,
    *,
    current_is: str,
    left_scale: float = 1.0,
) -> ReplanChoice:
    """Whether to move back to ``left_plan`` (predicted on ``restored``, times ``left_scale``)
    from the running plan (``current_s``, described by ``current_is``).

    Both figures must be on one scale. With the clock's references of both configurations, the
    running plan's measured step and the plan left's prediction times its reference's
    measured / predicted (``left_scale``): each plan corrected by its own clock, since the model
    can be off by different amounts for different plans. Without them, the model's scale."""
    new_s = float(predict_plan(restored, left_plan).step_time_s) * left_scale
    apply = new_s < current_s
    left_is = "predicted" if left_scale == 1.0 else "expected, by its clock,"
    reason = (
        f"what it left is back: the plan left is {left_is} {new_s * 1e3:.1f} ms on it, "
        f"the running plan {current_is} {current_s * 1e3:.1f} ms"
    )
    return ReplanChoice(
        apply=apply, current_step_time_s=current_s, new_step_time_s=new_s, plan=left_plan,
        reason=reason,
    )  # fmt: skip
