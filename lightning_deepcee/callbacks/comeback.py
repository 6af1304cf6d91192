"""The adapter's come-back: probe the links a re-plan left, and know the plan to return to.

:class:`ComeBack` belongs to the Lightning shim
(:class:`~lightning_deepcee.callbacks.adapter.DynamicEnvironmentAdapter`). When a re-plan moves
away from slowed links (``adapter/comeback.py``: :func:`abandoned_links`), it keeps what the move
left (the plan, its profile and split, as a revert would restore them) and opens a probe on one
pair of each such link (``runtime/probe.py``); the probes' samples ride in the per-step exchange
(:attr:`pairs`, :meth:`records`), so every rank's :class:`ComeBackWatch` sees the same figures
and all of them decide the return at the same step. A device the move left because it
computed slower (idle, or with less work) is watched by a compute probe on that device
(``runtime/compute_probe.py``; every second when idle, every three seconds and shorter when it
trains) whose seconds ride in the exchange's probe slot of that rank (:meth:`compute_sample`),
judged by every rank's :class:`DeviceWatch`. Opening and closing probes are collective: every rank
calls them at the same step. See docs/adapter.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import lightning.pytorch as pl

from lightning_deepcee.adapter.comeback import (
    ComeBackWatch,
    DeviceWatch,
    abandoned_links,
    choose_return,
    probe_bytes,
    restored_profile,
    slowed_devices,
)
from lightning_deepcee.adapter.links import plan_pairs
from lightning_deepcee.runtime.compute_probe import ComputeProbe
from lightning_deepcee.runtime.cpu_quota import read_cpu_quota
from lightning_deepcee.runtime.probe import open_link_probe

if TYPE_CHECKING:
    from lightning_deepcee.adapter.guard import ActionGuard
    from lightning_deepcee.adapter.monitor import Link
    from lightning_deepcee.callbacks.replanner import Replanner, SplitState
    from lightning_deepcee.callbacks.strategy_view import AdaptableStrategy
    from lightning_deepcee.planner import Plan
    from lightning_deepcee.runtime.probe import LinkProbe
    from lightning_deepcee.runtime.transport import TransferRecord

__all__ = ["ComeBack", "ComeBackHost"]

OpenProbe = Callable[[tuple[int, int], int, int], "LinkProbe | None"]


class TimedProbe(Protocol):
    """What :class:`ComeBack` uses of a compute probe (``ComputeProbe``)."""

    def take(self) -> float: ...

    def close(self, timeout_s: float = ...) -> bool: ...


class ComeBackHost(Protocol):
    """What :meth:`ComeBack.come_back` uses of the adapter callback."""

    guard: ActionGuard
    replanner: Replanner
    split_state: SplitState

    def plan_at(self, strategy: AdaptableStrategy, split: int) -> Plan: ...

    def refuted_key(self, kind: str, target: Any) -> str: ...

    def is_refuted(self, key: str | None) -> bool: ...

    def record(self, trainer: pl.Trainer, entry: dict[str, Any]) -> None: ...


def start_compute_probe(trains: bool) -> ComputeProbe:
    """This device's compute probe: every second, about a quarter of a second of work, on an
    idle device; every three seconds and a tenth of a second where it trains (it takes that
    CPU from the training, a few percent of a slowed device's). Under a CPU quota a probe lasts
    at least three of its periods: a shorter one may fit in one period's budget and run at full
    speed however low the quota."""
    quota = read_cpu_quota()
    least = 0.0 if quota is None else 3 * quota.period_s
    if trains:
        return ComputeProbe(first_s=max(0.1, least), interval_s=3.0)
    return ComputeProbe(first_s=max(0.25, least))


class ComeBack:
    """The plan a re-plan left and the probes of the links it left (see the module docstring)."""

    def __init__(
        self,
        open_probe: OpenProbe | None = None,
        compute_probe: Callable[[bool], TimedProbe] | None = None,
    ) -> None:
        self._open = open_probe
        """Opens one pair's probe (collective); ``None``: ``runtime.probe.open_link_probe``."""
        self._compute_probe = compute_probe
        """Starts this device's compute probe (local), given whether the device trains;
        ``None``: :func:`start_compute_probe`."""
        self.left: dict[str, Any] | None = None
        """What the move left: ``plan``, ``profile``, ``split``, ``base``, ``replanned`` (the
        shape ``Replanner.revert`` restores)."""
        self.watch: ComeBackWatch | None = None
        self.devices: DeviceWatch | None = None
        """The slowed devices the move left, watched by their compute probes."""
        self._probes: list[LinkProbe] = []
        self._timer: TimedProbe | None = None
        """This device's compute probe, when it is one of :attr:`devices`."""
        self.lost: list[str] = []
        """Probes that ended on an error (a lost peer), described."""

    @property
    def pairs(self) -> list[Link]:
        """The probed pairs (in the per-step exchange after the plan's own pairs)."""
        return [] if self.watch is None else self.watch.probes

    def moved_away(
        self,
        strategy: AdaptableStrategy,
        left: dict[str, Any],
        replans: Sequence[Mapping[str, Any]],
        *,
        window: int,
        fast_threshold: float,
        slow_threshold: float,
    ) -> None:
        """On every rank, after a move: keep what it left and probe the slowed links and the
        slowed devices it left (none: nothing to come back for).

        A move from a layout that was itself moved to keeps coming back to the first plan left
        and keeps watching what that one left (the links the new plan does not use, every
        device), with this move's own: the plan in between was made for the change the first
        move answered, and a return to it would keep that change's answer after it is gone."""
        plan = strategy.current_plan()
        used = set(plan_pairs(plan))
        links = abandoned_links(replans, used, plan.idle_ranks)
        devices = slowed_devices(replans)
        if self.left is not None:
            left = self.left
            kept = [] if self.watch is None else self.watch.links
            fresh = {link.probe for link in links}
            links = sorted(
                links + [a for a in kept if not used & set(a.pairs) and a.probe not in fresh],
                key=lambda a: a.probe,
            )
            devices = sorted(set(devices) | set(self.watched_devices()))
        self.close()
        if not links and not devices:
            return
        self.left = left
        if links:
            self.watch = ComeBackWatch(links, window=window, fast_threshold=fast_threshold)
        if devices:
            self.devices = DeviceWatch(devices, window=window, slow_threshold=slow_threshold)
        self._open_probes(strategy.global_rank, plan.idle_ranks)

    def watched_devices(self) -> list[int]:
        """The devices the compute probes watch."""
        return [] if self.devices is None else list(self.devices.devices)

    def returns_to(self, plan: Mapping[str, Any]) -> bool:
        """``plan`` (a plan dict) has the layout of the plan left: a revert to it ends the
        come-back, as a return would."""
        from lightning_deepcee.adapter.replan import placement_key
        from lightning_deepcee.planner import Plan

        if self.left is None:
            return False
        left = placement_key(Plan.from_dict(self.left["plan"]))
        return left == placement_key(Plan.from_dict(dict(plan)))

    def compute_sample(self) -> float:
        """This device's newest compute probe seconds, or 0.0 (the exchange's probe slot)."""
        return 0.0 if self._timer is None else self._timer.take()

    def _open_probes(self, rank: int, idle: Collection[int]) -> None:
        if self.devices is not None and rank in self.devices.devices:
            self._timer = (self._compute_probe or start_compute_probe)(rank not in idle)
        if self.watch is None:
            return
        opener = self._open or partial(open_link_probe, resize=probe_bytes)
        for link in self.watch.links:
            probe = opener(link.probe, rank, probe_bytes(0.0))
            if probe is not None:
                self._probes.append(probe)

    def records(self) -> list[TransferRecord]:
        """This rank's probe samples since the last call (as received transfers)."""
        return [r for probe in self._probes for r in probe.take()]

    def observe(self, rows: Sequence[Sequence[Any]], probe_s: Sequence[float] = ()) -> None:
        """One step's exchanged rows (the probed pairs' are used) and compute probe seconds (the
        watched devices')."""
        if self.watch is not None:
            self.watch.observe(rows)
        if self.devices is not None:
            self.devices.observe(probe_s)

    def due(self) -> bool:
        """Some link or device left has recovered: time to consider the return."""
        links = self.watch is not None and bool(self.watch.recovered())
        return links or (self.devices is not None and bool(self.devices.recovered()))

    def choose(self, current_s: float, current_is: str, left_scale: float = 1.0) -> dict[str, Any]:
        """The return's :class:`ReplanChoice` as a dict, with the restored profile
        (``"profile"``); run on one rank and broadcast (``choose_return``'s arguments)."""
        from lightning_deepcee.planner import Plan
        from lightning_deepcee.profiler import ClusterProfile

        assert self.left is not None
        restored = ClusterProfile.from_dict(self.left["profile"])  # its devices as before
        if self.watch is not None:
            restored = restored_profile(restored, self.watch)
        plan = Plan.from_dict(self.left["plan"])
        choice = choose_return(
            plan, restored, current_s, current_is=current_is, left_scale=left_scale
        )
        return {**choice.to_dict(), "profile": restored.to_dict()}

    def come_back(
        self, trainer: pl.Trainer, strategy: AdaptableStrategy, host: ComeBackHost
    ) -> None:
        """On every rank, when :meth:`due`: back to the plan left if it is predicted faster than
        the running one (the clock's figure where there is one), kept or reverted by the clock
        as a move towards the plan; the probes stop either way."""
        from lightning_deepcee.adapter.replan import ReplanChoice, placement_key
        from lightning_deepcee.callbacks.replanner import on_one_rank
        from lightning_deepcee.planner import Plan
        from lightning_deepcee.planner.cost_model import predict_plan

        assert self.left is not None
        clocked = host.replanner.clocked_step(strategy)
        left_ref = host.replanner.reference(
            Plan.from_dict(self.left["plan"]), int(self.left["split"])
        )
        scale = 1.0
        if clocked is not None and left_ref is not None:  # each plan by its own clock
            current_s, current_is = clocked[1], "runs (measured)"
            scale = left_ref[0] / left_ref[1]
        elif clocked is not None:
            current_s, current_is = clocked[0], "runs, on the model's scale,"
        else:
            assert strategy.cluster_profile is not None
            running = host.plan_at(strategy, host.split_state.split)
            current_s = float(predict_plan(strategy.cluster_profile, running).step_time_s)
            current_is = "is predicted"
        outcome = on_one_rank(
            strategy, "coming back", lambda: self.choose(current_s, current_is, scale)
        )
        choice = ReplanChoice.from_dict(outcome)
        assert self.left is not None and choice.plan is not None
        left = {**self.left, "profile": outcome["profile"]}
        key = host.refuted_key("return", placement_key(choice.plan))
        entry = {"current_step_time_s": current_s, "new_step_time_s": choice.new_step_time_s}
        self.close()
        if not choice.apply or host.is_refuted(key):
            why = "the clock reverted this return" if choice.apply else choice.reason
            host.record(trainer, {**entry, "kind": "return-kept", "reason": why})
            return
        previous = host.replanner.snapshot(strategy)
        host.replanner.revert(trainer, strategy, left)
        host.guard.begin(
            trainer.global_step, {"kind": "return", "previous": previous, "key": key},
            towards_plan=True,
        )  # fmt: skip
        host.record(trainer, {**entry, "kind": "return-applied", "reason": choice.reason})

    def close(self) -> None:
        """On every rank at the same step: stop the probes and forget what was left."""
        self.stop()
        self.left, self.watch, self.devices = None, None, None

    def stop(self) -> None:
        """On every rank at the same step: stop the probes (what was left is kept)."""
        if self._timer is not None:
            self._timer.close()
            self._timer = None
        for probe in self._probes:
            ended = probe.close()
            if probe.error is not None or not ended:
                lost = f"{probe.src}->{probe.dst}: {probe.error or 'did not stop within 60 s'}"
                self.lost.append(lost)
                warnings.warn(
                    f"DeepCEE adapter: the probe of link {lost}; its samples stopped (a peer "
                    "lost or a link stalled), so that link's recovery was not seen from then",
                    stacklevel=2,
                )
        self._probes = []

    # -------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any] | None:
        if self.left is None or (self.watch is None and self.devices is None):
            return None
        return {
            "left": self.left,
            "watch": None if self.watch is None else self.watch.state_dict(),
            "devices": None if self.devices is None else self.devices.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restore what was left; :meth:`reopen` starts the probes again at the train start."""
        self.close()
        if state:
            self.left = dict(state["left"])
            watch, devices = state.get("watch"), state.get("devices")
            self.watch = None if watch is None else ComeBackWatch.from_state_dict(watch)
            self.devices = None if devices is None else DeviceWatch.from_state_dict(devices)

    def reopen(self, strategy: AdaptableStrategy) -> None:
        """On every rank at the train start after a resume: probe again, if anything was left
        and the running layout is the one that left it (else forget it)."""
        if (self.watch is None and self.devices is None) or self._probes or self._timer:
            return
        from lightning_deepcee.adapter.replan import placement_key
        from lightning_deepcee.planner import Plan

        plan = strategy.current_plan()
        assert self.left is not None
        back = placement_key(Plan.from_dict(self.left["plan"])) == placement_key(plan)
        if back or set(self.pairs) & set(plan_pairs(plan)):
            self.left, self.watch, self.devices = None, None, None
            return
        self._open_probes(strategy.global_rank, plan.idle_ranks)
