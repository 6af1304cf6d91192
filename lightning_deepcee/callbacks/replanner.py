"""The adapter's slow response: re-plan on the links as measured, revert, restore on resume.

:class:`Replanner` belongs to the Lightning shim
(:class:`~lightning_deepcee.callbacks.adapter.DynamicEnvironmentAdapter`) and owns the re-plan
state: the search running in the background (:class:`SearchInFlight`), the record of an applied
re-plan that a resume restores (:class:`Replanned`), the clock's references
(:class:`ClockReference`) and setup's floor. The search runs in a child process on an idle
device (else rank 0) while training goes on (``search_process.SearchProcess``); every rank
takes its outcome at the same step, and moves blocks only when the cost model predicts a gain
and the configuration it was searched for still runs. See docs/adapter.md.

It reaches the callback through :class:`ReplanHost` and the strategy through
:class:`~lightning_deepcee.callbacks.strategy_view.AdaptableStrategy`: public members only.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, Protocol

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_deepcee.adapter.replan import hopeless_search, placement_key, profile_drift
from lightning_deepcee.adapter.search_process import SearchProcess
from lightning_deepcee.callbacks.contingency import Contingencies

if TYPE_CHECKING:
    from lightning_deepcee.adapter.guard import ActionGuard
    from lightning_deepcee.adapter.monitor import LinkMonitor, MonitorConfig
    from lightning_deepcee.callbacks.strategy_view import AdaptableStrategy
    from lightning_deepcee.planner import Plan
    from lightning_deepcee.profiler import ClusterProfile

__all__ = [
    "ClockReference", "ReplanHost", "Replanned", "Replanner", "SearchInFlight", "SplitState",
    "on_one_rank", "searcher",
]  # fmt: skip


@dataclasses.dataclass(kw_only=True, slots=True)
class SplitState:
    """The fast response's state, which a re-plan resets: pieces per micro-batch, and the
    micro-batch count they divide (the plan's, once known)."""

    split: int = 1
    base_microbatches: int | None = None


@dataclasses.dataclass(kw_only=True, slots=True)
class SearchInFlight:
    """A re-plan search running in the background: its context on every rank, the search
    itself (``job``) on the searcher."""

    step: int
    replans: list[dict[str, Any]]
    resplits: list[dict[str, Any]]
    observed: ClusterProfile
    changes: dict[Any, tuple[float, float]]
    configuration: int
    """The callback's count of configuration changes when it began."""
    clocked: bool
    searcher: int
    job: Any = None
    """The :class:`SearchProcess` (``done()``, ``result()``, ``cancel()``), on the searcher."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Replanned:
    """After an applied re-plan: the plan and the profile it was made for, the layout setup had
    chosen (``placement_key``), and setup's profile (the ceiling of a link's recovery); a resume
    restores the plan. Saved in the callback's state as :meth:`to_dict`."""

    plan: dict[str, Any]
    profile: dict[str, Any]
    origin: Any
    measured: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        data = {"plan": self.plan, "profile": self.profile, "origin": self.origin}
        return data if self.measured is None else {**data, "measured": self.measured}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Replanned | None:
        if data is None:
            return None
        return cls(
            plan=data["plan"],
            profile=data["profile"],
            origin=data["origin"],
            measured=data.get("measured"),
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ClockReference:
    """The guard's median step of one configuration and the model's prediction for it, taken
    while every link was as profiled (a candidate until confirmed at ``step``)."""

    key: str
    measured_s: float
    predicted_s: float
    step: int


class ReplanHost(Protocol):
    """What the :class:`Replanner` uses of its callback."""

    config: MonitorConfig
    guard: ActionGuard
    monitor: LinkMonitor | None
    decisions: list[dict[str, Any]]
    replan_gain: float
    search_cpu_share: float
    split_state: SplitState

    @property
    def configuration(self) -> int: ...

    def observed(
        self, strategy: AdaptableStrategy, proposals: list[dict[str, Any]]
    ) -> tuple[ClusterProfile, dict[Any, tuple[float, float]]]: ...

    def plan_at(self, strategy: AdaptableStrategy, split: int) -> Plan: ...

    def signature(self) -> list[Any]: ...

    def refuted_key(self, kind: str, target: Any) -> str: ...

    def is_refuted(self, key: str | None) -> bool: ...

    def resplit(
        self, trainer: pl.Trainer, strategy: AdaptableStrategy, proposals: list[dict[str, Any]]
    ) -> None: ...

    def apply_split(self, trainer: pl.Trainer, strategy: AdaptableStrategy) -> None: ...

    def new_monitor(self, strategy: AdaptableStrategy) -> None: ...

    def moved_away(
        self,
        strategy: AdaptableStrategy,
        left: dict[str, Any],
        replans: list[dict[str, Any]],
    ) -> None: ...

    def record(self, trainer: pl.Trainer, entry: dict[str, Any]) -> None: ...

    def watched_devices(self) -> list[int]: ...


class Replanner:
    """The slow response of one callback (see the module docstring)."""

    def __init__(self, host: ReplanHost) -> None:
        self.host = host
        self.search: SearchInFlight | None = None
        self.replanned: Replanned | None = None
        self.clock: dict[str, list[float]] = {}
        """Per configuration (layout and split): ``[measured s, predicted s]``; their ratio
        puts the clock's step times on the model's scale."""
        self.clock_candidate: ClockReference | None = None
        """A reference waiting to be confirmed."""
        self.floor_s: float | None = None
        """The step time predicted at setup for the plan the planner chose then, on the links
        as measured then: no plan beats it on slower links (``None``: a manual layout)."""
        self.ahead = Contingencies(lambda request: SearchProcess(request))
        """Plans searched ahead for the running layout's wide-area links (on the searcher)."""

    def search_ahead(self, strategy: AdaptableStrategy) -> None:
        """Between steps, on the searcher while no re-plan search runs there: search the running
        layout's plans ahead if it has none (local, no collective). A rank that is no longer the
        searcher (a move changed which devices are idle) stops the one it ran."""
        if strategy.global_rank != self.searcher(strategy):
            self.ahead.pause()
        elif self.search is None:
            self.ahead.prepare(strategy, _pacing(self.host.search_cpu_share))

    def searcher(self, strategy: AdaptableStrategy) -> int:
        """The rank that searches now (:func:`searcher`), never a device the come-back watches:
        its probe times the device, and a search beside it would read as the device's load."""
        return searcher(strategy.plan, strategy.cluster_profile, self.host.watched_devices())

    # ------------------------------------------------------------------------ the search
    def start(
        self,
        trainer: pl.Trainer,
        strategy: AdaptableStrategy,
        replans: list[dict[str, Any]],
        resplits: list[dict[str, Any]],
    ) -> None:
        """Begin the search for a plan on the links as measured, in a child process on the
        searcher (:func:`searcher`), so that training goes on meanwhile; :meth:`finish` takes
        its outcome on every rank at the step after the searcher says it is done. No search
        starts when none can pay
        (:func:`~lightning_deepcee.adapter.replan.hopeless_search`)."""
        from lightning_deepcee.planner.cost_model import predict_plan

        host = self.host
        observed, changes = host.observed(strategy, replans)
        current = host.plan_at(strategy, host.split_state.split)
        gain = host.replan_gain
        predicted_s = predict_plan(observed, current).step_time_s
        severe = any(d.get("severe") for d in replans)  # the newest steps are the network now
        clocked = self.clocked_step(strategy, host.config.severe_samples if severe else None)
        current_s = predicted_s if clocked is None else clocked[0]
        running = (
            f"the running plan is predicted {predicted_s * 1e3:.1f} ms on the links as measured"
            if clocked is None
            else f"the running plan runs {current_s * 1e3:.1f} ms in the cost model's scale "
            f"(measured {clocked[1] * 1e3:.1f} ms; the model predicts {predicted_s * 1e3:.1f} ms "
            "on the links as measured)"
        )
        why = hopeless_search(changes, current_s, self.floor_s, gain, running)
        if why is not None:
            self.record(trainer, replans, "kept", why)
            if resplits:
                host.resplit(trainer, strategy, resplits)
            return
        search = SearchInFlight(
            step=trainer.global_step, replans=replans, resplits=resplits, observed=observed,
            changes=changes, configuration=host.configuration, clocked=clocked is not None,
            searcher=self.searcher(strategy),
        )  # fmt: skip
        ahead = on_one_rank(
            strategy,
            "choosing a plan searched ahead",
            lambda: self.ahead.choose(strategy, observed, current_s, gain),
            src=search.searcher,
        )
        if ahead.get("apply") and self._apply(trainer, strategy, search, ahead):
            return
        if strategy.global_rank == search.searcher:
            self.ahead.pause()
            search.job = SearchProcess(
                {"profile": observed.to_dict(), "plan": current.to_dict(), "gain": gain,
                 "current_s": current_s, "device_gain": strategy.device_gain,
                 "compression": list(strategy.compression), **_pacing(host.search_cpu_share)}
            )  # fmt: skip
        self.search = search
        why = (
            f"searching a plan for the links as measured, in the background on rank "
            f"{search.searcher}; training goes on (plans ahead: {ahead.get('reason', 'none')})"
        )
        host.record(trainer, {"kind": "replan-search", "reason": why})

    def cancel(self) -> None:
        """Abandon a search still running (training ended), and one searching ahead."""
        if self.search is not None and self.search.job is not None:
            self.search.job.cancel()
        self.search = None
        self.ahead.pause()

    def drop(self, trainer: pl.Trainer, why: str) -> None:
        """On every rank at the same step: abandon the search in flight, if any, and log its
        proposals dropped, ``why``: a come-back is due (it goes to a plan known good on this
        network, and the links are judged afresh from there), or a newer change supersedes it
        (the next search plans for every figure the monitors hold). The search ahead goes on."""
        search, self.search = self.search, None
        if search is None:
            return
        if search.job is not None:
            search.job.cancel()
        self.record(trainer, search.replans, "dropped", why)

    def finish(self, trainer: pl.Trainer, strategy: AdaptableStrategy) -> None:
        """The searcher's search is done: take its outcome on every rank; move if it pays, the
        configuration it was searched for is still the one running and no figure it planned on
        moved by more than the monitors' ``slow_threshold`` since (:func:`profile_drift` of the
        observed profiles: a state change that moves no figure does not make it stale)."""
        search, self.search = self.search, None
        assert search is not None
        job = search.job
        outcome = on_one_rank(
            strategy, "re-planning", lambda: job.result() if job else {}, src=search.searcher
        )
        replans, resplits = search.replans, search.resplits
        if search.configuration != self.host.configuration:
            why = "the split or layout changed while it searched; the links are judged afresh"
            self.record(trainer, replans, "dropped", why)
            return
        now, _ = self.host.observed(strategy, replans)  # the monitors' states win
        drift = profile_drift(search.observed, now, self.host.config.slow_threshold)
        if drift:
            why = (
                f"what it planned for changed while it searched ({', '.join(drift)}); a plan "
                "for the network as it was is not moved to, and it is judged afresh"
            )
            self.record(trainer, replans, "dropped", why)
            return
        if not self._apply(trainer, strategy, search, outcome) and resplits:
            self.host.resplit(trainer, strategy, resplits)

    def _apply(
        self,
        trainer: pl.Trainer,
        strategy: AdaptableStrategy,
        search: SearchInFlight,
        outcome: dict[str, Any],
    ) -> bool:
        """Move on every rank to the searched plan if it pays; True when it was applied."""
        from lightning_deepcee.adapter.replan import ReplanChoice

        host, step = self.host, trainer.global_step
        profile, plan = strategy.cluster_profile, strategy.plan
        assert profile is not None and plan is not None
        choice = ReplanChoice.from_dict(outcome)
        figures_line = _figures_line(choice, search)
        _log_choice(trainer, choice)
        target = None if choice.plan is None else placement_key(choice.plan)
        key = None if target is None else host.refuted_key("replan", target)
        why = choice.reason
        if choice.apply and host.is_refuted(key):
            why = "the clock reverted a move to this layout under the same link states"
        if not choice.apply or choice.plan is None or host.is_refuted(key):
            self.record(trainer, search.replans, "kept", f"{why}; {figures_line}", choice.to_dict())
            return False
        previous = self.snapshot(strategy)
        origin = placement_key(strategy.current_plan())
        strategy.apply_plan(choice.plan, trainer)
        strategy.cluster_profile = search.observed
        measured = profile.to_dict()
        if self.replanned is not None:
            origin = self.replanned.origin  # a resume compares with the first layout
            measured = self.replanned.measured or measured
        self.replanned = Replanned(
            plan=choice.plan.to_dict(),
            profile=search.observed.to_dict(),
            origin=origin,
            measured=measured,  # the setup profile: the ceiling of a link's recovery
        )
        host.split_state.split, host.split_state.base_microbatches = 1, strategy.num_microbatches
        host.new_monitor(strategy)
        host.moved_away(strategy, previous, search.replans)
        severe = any(d.get("severe") for d in search.replans)  # judged on the steps since
        host.guard.begin(
            step, {"kind": "replan", "previous": previous, "key": key}, towards_plan=False,
            newest=host.config.severe_samples if severe else None,
        )  # fmt: skip
        why = f"{choice.reason}; {figures_line}"
        self.record(trainer, search.replans, "applied", why, choice.to_dict())
        return True

    def record(
        self,
        trainer: pl.Trainer,
        replans: list[dict[str, Any]],
        action: str,
        why: str,
        choice: dict[str, Any] | None = None,
    ) -> None:
        """Log a re-plan proposal's outcome and add it to the callback's ``decisions``."""
        links = ", ".join(d.get("name") or f"{d['link'][0]}->{d['link'][1]}" for d in replans)
        rank_zero_info(
            f"DeepCEE adapter: step {trainer.global_step} re-plan for link(s) {links}: "
            f"{action} ({why})"
        )
        entry: dict[str, Any] = {
            "step": trainer.global_step,
            "kind": "replan-" + action,
            "links": [list(d["link"]) if "link" in d else d["name"] for d in replans],
            "reason": why,
        }
        if choice is not None:
            entry["current_step_time_s"] = choice["current_step_time_s"]
            entry["new_step_time_s"] = choice["new_step_time_s"]
            entry["plan"] = choice["plan"]
        self.host.decisions.append(entry)

    # ----------------------------------------------------------------- revert, restore
    def snapshot(self, strategy: AdaptableStrategy) -> dict[str, Any]:
        """What :meth:`revert` restores: the running plan, its profile and split, and the record
        of the re-plan in force."""
        profile, plan = strategy.cluster_profile, strategy.plan
        assert profile is not None and plan is not None
        return {
            "plan": plan.to_dict(),
            "profile": profile.to_dict(),
            "split": self.host.split_state.split,
            "base": self.host.split_state.base_microbatches,
            "replanned": None if self.replanned is None else self.replanned.to_dict(),
        }

    def revert(
        self, trainer: pl.Trainer, strategy: AdaptableStrategy, previous: dict[str, Any]
    ) -> None:
        """Back to the plan, profile and split of ``previous`` (:meth:`snapshot`): the clock
        refuted a re-plan, or the links a re-plan left recovered."""
        from lightning_deepcee.planner import Plan
        from lightning_deepcee.profiler import ClusterProfile

        strategy.apply_plan(Plan.from_dict(previous["plan"]), trainer)
        strategy.cluster_profile = ClusterProfile.from_dict(previous["profile"])
        self.replanned = Replanned.from_dict(previous["replanned"])
        split = self.host.split_state
        split.base_microbatches = previous["base"] or strategy.num_microbatches
        split.split = int(previous["split"])
        self.host.apply_split(trainer, strategy)
        self.host.new_monitor(strategy)

    def restore(self, trainer: pl.Trainer, strategy: AdaptableStrategy) -> None:
        """On resume: run the re-planned layout again if setup chose the one it replaced."""
        from lightning_deepcee.planner import Plan
        from lightning_deepcee.profiler import ClusterProfile

        replanned = self.replanned
        assert replanned is not None
        plan = Plan.from_dict(replanned.plan)
        try:
            running = placement_key(strategy.current_plan())
        except ValueError:
            running = None
        if running == placement_key(plan):
            return  # setup runs the re-planned layout already (e.g. passed as plan=...)
        problem = None
        if running != replanned.origin:
            problem = "setup chose another layout than the one the re-plan replaced"
        else:
            try:
                strategy.check_plan(plan)
            except ValueError as exc:
                problem = str(exc)
        if problem is not None:
            rank_zero_info(
                f"DeepCEE adapter: not restoring the re-planned layout of the checkpoint "
                f"({problem}); keeping setup's layout and watching its links afresh."
            )
            self.replanned = None
            self.host.split_state.split = 1
            self.host.split_state.base_microbatches = strategy.num_microbatches
            self.host.monitor = None
            self.host.guard.cancel()
            return
        rank_zero_info("DeepCEE adapter: restoring the re-planned layout of the checkpoint.")
        strategy.apply_plan(plan, trainer)
        saved = ClusterProfile.from_dict(replanned.profile)
        current = strategy.cluster_profile
        if current is None or (
            current.cluster_fingerprint == saved.cluster_fingerprint
            and current.model_fingerprint == saved.model_fingerprint
        ):
            strategy.cluster_profile = saved  # the profile the restored plan was made for

    # ----------------------------------------------------------------------- the clock
    def set_floor(self, strategy: AdaptableStrategy) -> None:
        """Take setup's floor from the running plan, unless a re-plan or a resume set it."""
        if self.floor_s is None and self.replanned is None:
            self.floor_s = _setup_floor(strategy)

    def note_clock(self, strategy: AdaptableStrategy, step: int) -> None:
        """Take the running configuration's clock reference, once: the guard's median step over
        a whole window and the model's prediction for it, while every link is as profiled.

        The monitor flags a change only some steps after it began (its ``window`` of samples,
        then ``react_after`` of them), so a candidate becomes the reference only once the links
        have stayed as profiled for that long after it; a change inside its window drops it."""
        from lightning_deepcee.planner.cost_model import predict_plan

        host = self.host
        monitor, measured = host.monitor, host.guard.steady_s
        key = self._clock_key(strategy)
        candidate = self.clock_candidate
        steady = (
            monitor is not None
            and monitor.calibrated
            and not host.signature()  # every link and device as profiled
            and measured is not None
            and strategy.cluster_profile is not None
        )
        if not steady or (candidate is not None and candidate.key != key):
            self.clock_candidate = None
            return
        if key in self.clock or measured is None or strategy.cluster_profile is None:
            return
        if candidate is None:
            current = host.plan_at(strategy, host.split_state.split)
            predicted = predict_plan(strategy.cluster_profile, current).step_time_s
            self.clock_candidate = ClockReference(
                key=key, measured_s=measured, predicted_s=float(predicted), step=step
            )
        elif step >= candidate.step + host.config.window + host.config.react_after:
            self.clock[key] = [float(candidate.measured_s), float(candidate.predicted_s)]
            self.clock_candidate = None

    def clocked_step(
        self, strategy: AdaptableStrategy, newest: int | None = None
    ) -> tuple[float, float] | None:
        """The running configuration's step now, by the clock: ``(on the model's scale,
        measured)``.

        The guard's median over its last whole window (``newest``: over its newest ``newest``
        steps, where a severe change shows in every one of them while the window still holds
        steps from before it), times predicted / measured of the configuration's reference
        (:meth:`note_clock`). The model can be wrong about how much a slower link costs (overlap
        it assumes, a receiver's CPU quota it does not see); the clock is not, and on the
        model's scale the figure compares with the model's predictions of other plans. ``None``
        without a reference or a whole window."""
        reference = self.clock.get(self._clock_key(strategy))
        guard = self.host.guard
        measured = guard.steady_s
        if measured is not None and newest is not None:
            measured = guard.newest_s(newest) or measured
        if reference is None or measured is None:
            return None
        return measured * reference[1] / reference[0], measured

    def reference(self, plan: Plan, split: int) -> tuple[float, float] | None:
        """The clock's reference of the configuration ``plan`` with ``split`` pieces:
        ``(measured s, predicted s)``, or ``None`` if it never ran steady long enough."""
        reference = self.clock.get(json.dumps([placement_key(plan), split]))
        return None if reference is None else (reference[0], reference[1])

    def _clock_key(self, strategy: AdaptableStrategy) -> str:
        return json.dumps([placement_key(strategy.current_plan()), self.host.split_state.split])


def _figures_line(choice: Any, search: SearchInFlight) -> str:
    links = sorted((k, v) for k, v in search.changes.items() if not isinstance(k, str))
    devices = sorted((k, v) for k, v in search.changes.items() if isinstance(k, str))
    changed = ", ".join(
        [
            f"{src}->{dst} {old / 1e6:.3g} -> {new / 1e6:.3g} MB/s"
            for (src, dst), (old, new) in links
        ]
        + [f"{name} computing x{new / old:.2f}" for name, (old, new) in devices]
    )
    new_s = choice.new_step_time_s
    return (
        f"profile links {changed or 'unchanged'}; running plan "
        f"{'measured, on the model scale,' if search.clocked else 'predicted'} "
        f"{choice.current_step_time_s * 1e3:.1f} ms on them, searched plan "
        f"{'none' if new_s is None else f'{new_s * 1e3:.1f} ms'}"
    )


def _log_choice(trainer: pl.Trainer, choice: Any) -> None:
    new_s = choice.new_step_time_s
    for logger in trainer.loggers:
        metrics = {
            "deepcee/adapter_replan_current_ms": choice.current_step_time_s * 1e3,
            "deepcee/adapter_replan_applied": float(choice.apply),
        }
        if new_s is not None:
            metrics["deepcee/adapter_replan_new_ms"] = new_s * 1e3
        logger.log_metrics(metrics, step=trainer.global_step)


def _pacing(share: float) -> dict[str, Any]:
    """The CPU quota this device runs under and the share of it a search may spend."""
    from lightning_deepcee.runtime.cpu_quota import read_cpu_quota

    quota = read_cpu_quota()
    return {} if quota is None else {"cpu": [quota.cores, quota.period_s], "share": share}


def on_one_rank(
    strategy: AdaptableStrategy, what: str, compute: Callable[[], dict[str, Any]], src: int = 0
) -> Any:
    """``compute()`` on rank ``src``, its outcome broadcast; its error raised on every rank."""
    outcome: dict[str, Any] = {}
    if strategy.global_rank == src:
        try:
            outcome = compute()
        except Exception as exc:  # the other ranks wait in the broadcast: tell them
            outcome = {"error": f"{type(exc).__name__}: {exc}"}
    outcome = strategy.broadcast(outcome, src=src)
    if "error" in outcome:
        raise RuntimeError(f"DeepCEE adapter: {what} failed on rank {src}: {outcome['error']}")
    return outcome


def searcher(plan: Any, profile: Any, exclude: Collection[int] = ()) -> int:
    """The rank that runs a re-plan search: the fastest device the plan leaves idle, whose CPU
    training does not use (a search takes seconds of CPU, and a device under a CPU quota pays
    for every one of them in its own steps, however low the thread's priority), ``exclude``
    left out; rank 0 when every device trains."""
    idle = [r for r in getattr(plan, "idle_ranks", ()) or () if r not in exclude]
    if not idle:
        return 0
    devices = {} if profile is None else {d.rank: d for d in profile.devices}

    def speed(rank: int) -> float:
        device = devices.get(rank)
        return 0.0 if device is None else float(device.capability)

    return max(idle, key=lambda rank: (speed(rank), -rank))


def _setup_floor(strategy: AdaptableStrategy) -> float | None:
    """The running plan's predicted step time on the strategy's profile when the planner chose
    it (not a manual layout); the re-plan search's floor (:class:`Replanner`)."""
    from lightning_deepcee.planner.cost_model import predict_plan

    plan, profile = strategy.plan, strategy.cluster_profile
    if plan is None or profile is None or plan.notes == "manual layout":
        return None
    return float(predict_plan(profile, plan).step_time_s)
