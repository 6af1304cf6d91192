"""DynamicEnvironmentAdapter: the Lightning Callback that runs the adapter during training.

A thin shim over the pure :mod:`lightning_deepcee.adapter` (monitor, gate, re-plan choice,
guard): it gathers every rank's transfer timings each step, feeds the monitor, puts the
monitor's proposals to the cost model (on rank 0, the outcome broadcast), applies what passes
through the strategy (micro-batch splits, ``apply_plan``) and reverts what the clock says did
not pay. Every rank runs the same monitor and guard on the same all-reduced figures, so all of
them take the same decisions on the same step. See docs/adapter.md.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_deepcee.adapter import exchange
from lightning_deepcee.adapter.compute import ComputeMonitor
from lightning_deepcee.adapter.guard import ActionGuard, GuardConfig, Verdict
from lightning_deepcee.adapter.monitor import LinkMonitor, LinkObservation, MonitorConfig
from lightning_deepcee.callbacks.after_step import AfterStepCallback
from lightning_deepcee.callbacks.comeback import ComeBack
from lightning_deepcee.callbacks.exchange_channel import ExchangeChannel
from lightning_deepcee.callbacks.replanner import Replanned, Replanner, SplitState, on_one_rank
from lightning_deepcee.callbacks.strategy_view import deepcee_strategy

if TYPE_CHECKING:
    from lightning_deepcee.callbacks.strategy_view import AdaptableStrategy
    from lightning_deepcee.planner import Plan
    from lightning_deepcee.profiler import ClusterProfile

__all__ = ["DynamicEnvironmentAdapter"]

_STATE_VERSION = 3


class DynamicEnvironmentAdapter(AfterStepCallback):
    """Follows the links at run time: acts only where the model predicts a gain, keeps only what
    the clock confirms (docs/adapter.md).

    Each step one all-reduce, posted at the step's end and read at the next one's (so its
    latency hides behind a step), sums the received transfers per device pair (bytes and
    seconds on the wire) with the step times of the ranks that train, search or probe (the
    other ranks are handed the sums), so every rank's
    :class:`~lightning_deepcee.adapter.LinkMonitor` sees the whole pipeline and judges each link
    against what the plan expects of it (:func:`~lightning_deepcee.adapter.link_expectations`),
    lowered to a figure calibrated after ``warmup_steps`` where that is lower; the same
    all-reduce carries every rank's compute time, which a
    :class:`~lightning_deepcee.adapter.compute.ComputeMonitor` judges against the device's own
    calibrated figure (a ``replan`` when a device slows down or speeds up). A ``split`` or
    ``merge`` proposal changes the split only as
    :func:`~lightning_deepcee.adapter.choose_split` predicts it pays (``split_gain``); a
    ``replan`` proposal starts :func:`~lightning_deepcee.adapter.choose_replan` in a child
    process (on the fastest idle device, else rank 0) while training goes on, unless the running
    plan is predicted within the margin of setup's plan on setup's links, and moves blocks
    (``DeepCEEStrategy.apply_plan``) only as it predicts it pays (``replan_gain``). The clock
    (:class:`~lightning_deepcee.adapter.ActionGuard`) then compares the median step time
    (the slowest rank's) over ``confirm_window`` steps after ``confirm_settle`` with the window
    before; an action away from the plan that did not gain ``confirm_gain`` is reverted (the
    previous split, or the previous plan and profile) and not retried while the links say the
    same. Proposals arriving while an action waits for its verdict are considered after it.
    After a re-plan that left slowed links, those links are probed, and the adapter returns to
    the plan it left once they recover and the model predicts that plan faster
    (:class:`~lightning_deepcee.callbacks.comeback.ComeBack`).
    Without a cluster profile nothing can be predicted: the adapter only watches and logs.

    Proposals, gate outcomes and verdicts go to the console (rank 0), the loggers and
    ``decisions``; the state is checkpointed, and on resume a re-planned layout is restored
    when setup chose the layout it replaced (else the links are watched afresh).

    Args:
        split_gain: the least predicted gain (a fraction of the step time) for which the split
            changes, in ``[0, 1)``.
        replan_gain: the least predicted gain for which a re-plan moves blocks, in ``[0, 1)``;
            moving blocks sends the state of the blocks that change owner.
        confirm_window: steps measured before and after an action.
        confirm_settle: steps left out after an action before its window.
        confirm_gain: the least measured gain for which an action away from the plan is kept
            (and the most measured loss for which one back towards it is kept), in ``[0, 1)``.
        search_cpu_share: on a device under a CPU quota, the most of it a re-plan search may
            spend, in ``(0, 1]``; the rest stays with training and its communication threads.
        The other arguments are the monitor's (:class:`~lightning_deepcee.adapter.MonitorConfig`).
    """

    def __init__(
        self,
        slow_threshold: float = 1.5,
        fast_threshold: float = 1.25,
        window: int = 5,
        react_after: int = 3,
        replan_after: int = 20,
        severe_threshold: float = 4.0,
        severe_window: int = 3,
        min_bytes: int = 65536,
        stamp_error_s: float = 0.01,
        max_split: int = 4,
        warmup_steps: int = 5,
        calibration_steps: int = 10,
        calibration_quantile: float = 0.75,
        compute_band_quantile: float = 0.9,
        split_gain: float = 0.1,
        replan_gain: float = 0.1,
        confirm_window: int = 6,
        confirm_settle: int = 2,
        confirm_gain: float = 0.05,
        search_cpu_share: float = 0.5,
    ) -> None:
        self.config = MonitorConfig(
            slow_threshold=slow_threshold, fast_threshold=fast_threshold, window=window,
            react_after=react_after, replan_after=replan_after,
            severe_threshold=severe_threshold, severe_window=severe_window, min_bytes=min_bytes,
            stamp_error_s=stamp_error_s, max_split=max_split, warmup_steps=warmup_steps,
            calibration_steps=calibration_steps, calibration_quantile=calibration_quantile,
            compute_band_quantile=compute_band_quantile,
        )  # fmt: skip
        for name, value in (("split_gain", split_gain), ("replan_gain", replan_gain)):
            if isinstance(value, bool) or not 0 <= value < 1:
                raise ValueError(
                    f"DynamicEnvironmentAdapter: {name} must be in [0, 1) (a fraction of the "
                    f"step time), got {value}"
                )
        if isinstance(search_cpu_share, bool) or not 0 < search_cpu_share <= 1:
            raise ValueError(
                "DynamicEnvironmentAdapter: search_cpu_share must be in (0, 1] (a fraction of "
                f"the searcher's CPU quota), got {search_cpu_share}"
            )
        self.split_gain, self.replan_gain = float(split_gain), float(replan_gain)
        self.search_cpu_share = float(search_cpu_share)
        self.guard = ActionGuard(
            GuardConfig(window=confirm_window, settle=confirm_settle, min_gain=confirm_gain)
        )
        self.monitor: LinkMonitor | None = None
        self.compute: ComputeMonitor | None = None
        """Every training rank's compute time against its own calibrated figure."""
        self._compute_of = -1
        """The configuration count the compute monitor was made for."""
        self.decisions: list[dict[str, Any]] = []
        self._pairs: list[tuple[int, int]] = []
        """The pairs the running plan's transfers use (the all-reduce's layout)."""
        self._inflight: Callable[[], exchange.Exchanged] | None = None
        """Waits for the exchange posted at the end of the last step and reads it."""
        self._proposed: list[dict[str, Any]] = []
        """This rank's proposals counted in the exchange in flight (checked when it lands)."""
        self._changes = 0
        """Counts changes of the running configuration (split, layout): figures and searches
        begun under an older count describe a configuration that is gone."""
        self.split_state = SplitState()
        """Pieces per micro-batch now (the fast response), and the count they divide."""
        self.replanner = Replanner(self)
        """The slow response and its state: the search in flight, an applied re-plan, the
        clock's references, setup's floor."""
        self.comeback = ComeBack()
        """The plan a re-plan left and the probes of the slowed links it left."""
        self._refuted: list[str] = []
        """Actions the clock reverted, with the link states they were taken under (JSON)."""
        self._deferred: list[dict[str, Any]] = []
        self._last_batch_end: float | None = None
        self._after_trial = False
        self.channel = ExchangeChannel()

    # ------------------------------------------------------------------------------ hooks
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer, _deepcee(trainer))

    def _start(self, trainer: pl.Trainer, strategy: AdaptableStrategy) -> None:
        """Watch the running layout from here: at the start, and after the plan trial."""
        from lightning_deepcee.adapter.links import plan_pairs

        replanner = self.replanner
        self._inflight, self._proposed, replanner.search = None, [], None
        if replanner.replanned is not None:
            replanner.restore(trainer, strategy)
        if replanner.replanned is None:
            self.comeback.close()  # nothing was left, or the layout that left it is not restored
        self.comeback.reopen(strategy)
        if self.split_state.base_microbatches is None:
            self.split_state.base_microbatches = strategy.num_microbatches
        self.apply_split(trainer, strategy)  # after a resume, the split in force
        assert strategy.plan is not None  # set up before training starts
        if self.monitor is None or self._pairs != plan_pairs(strategy.plan):
            self.new_monitor(strategy)
        replanner.set_floor(strategy)
        self.guard.settle()
        self._last_batch_end = time.perf_counter()
        if strategy.cluster_profile is None:
            rank_zero_warn(
                "DynamicEnvironmentAdapter: the strategy has no cluster profile, so no action "
                "can be predicted; the adapter watches and logs the links but takes no action. "
                "Profile the cluster (DeepCEEStrategy() or profile=True) to let it act."
            )

    @override
    def after_train_step(self, trainer: pl.Trainer) -> None:
        strategy = _deepcee(trainer)
        if strategy.trial_running:  # the plan trial moves the layout: watch the one it leaves
            self._after_trial = True
            return
        if self._after_trial:  # as from the start, on the trial's layout and micro-batches
            self._after_trial, self.replanner.floor_s = False, None
            self.split_state.split, self.split_state.base_microbatches = 1, None
            self._start(trainer, strategy)
        if self.monitor is None:
            return
        step = trainer.global_step
        now = time.perf_counter()
        step_s = 0.0 if self._last_batch_end is None else now - self._last_batch_end
        self._last_batch_end = now
        # The exchange posted last step lands now (its latency hid behind this step). Every
        # rank reads the same sums, so every rank's monitors make the same proposals from them
        # and all act on them together now, with no further collective; the count each rank
        # posts checks that at the next landing.
        landed = None if self._inflight is None else self._inflight()
        self._inflight = None
        mine: list[dict[str, Any]] = []
        if landed is not None:
            exchange.check_agreement(landed, len(self._proposed))
            observations = [LinkObservation(landed.step, *row) for row in landed.rows]
            mine = [d.to_dict() for d in self.monitor.observe(landed.step, observations)]
            mine += self._watch_compute(strategy, landed)
        search = self.replanner.search
        job = None if search is None else search.job  # on the searcher
        self._inflight = self._exchange(
            strategy, step, step_s, len(mine), job is not None and job.done()
        )
        self._proposed = mine
        if landed is None:
            return
        monitor, changes = self.monitor, self._changes
        verdict = self.guard.record(landed.step, landed.slowest_s)
        if verdict is not None:
            self._on_verdict(trainer, strategy, verdict)
        self.replanner.note_clock(strategy, landed.step)
        if landed.search_done and self.replanner.search is not None:
            self.replanner.finish(trainer, strategy)
        if mine:
            self._decide(trainer, strategy, mine, stale=monitor is not self.monitor)
        self.comeback.observe(landed.rows, landed.probe_s)
        if self.comeback.due() and self.guard.pending is None:
            self.replanner.drop(trainer, "the come-back is due and goes first")
            self.comeback.come_back(trainer, strategy, self)
        if self._changes != changes:
            self._forget_exchange()  # its figures and proposals are of the configuration left
        self.replanner.search_ahead(strategy)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._forget_exchange()
        self.channel.close()
        self.replanner.cancel()  # a search still running is abandoned
        self.comeback.stop()  # its probes; what was left stays for a later fit

    def _forget_exchange(self) -> None:
        """Let the exchange in flight land and drop it, with the proposals it counted (on every
        rank at the same step: the configuration changes on all of them together)."""
        if self._inflight is not None:
            self._inflight()
        self._inflight, self._proposed = None, []

    # --------------------------------------------------------------------------- per step
    def _watch_compute(
        self, strategy: AdaptableStrategy, landed: exchange.Exchanged
    ) -> list[dict[str, Any]]:
        """Feed the ranks' compute times to the compute monitor, made afresh for every
        configuration (its stages and micro-batches set the work)."""
        if self.compute is None or self._compute_of != self._changes:
            assert strategy.plan is not None
            ranks = [r for stage in strategy.plan.stages for r in stage.ranks]
            self.compute, self._compute_of = ComputeMonitor(ranks, self.config), self._changes
        return self.compute.observe(landed.step, landed.compute_s, landed.slowest_s)

    def _exchange(
        self, strategy: AdaptableStrategy, step: int, step_s: float, count: int, search_done: bool
    ) -> Callable[[], exchange.Exchanged]:
        """Post the exchange: per pair (bytes, wire seconds), each member's step time and
        proposal count, and whether the background re-plan search finished; the returned
        callable waits for it and reads it. Ranks with nothing to add are handed the sums
        (:class:`~lightning_deepcee.callbacks.exchange_channel.ExchangeChannel`)."""
        pairs = self._pairs + self.comeback.pairs
        records = [*strategy.transfer_records, *self.comeback.records()]
        stats = strategy.last_step_stats
        world = strategy.world_size
        values = exchange.pack(
            pairs, records, rank=strategy.global_rank, world=world,
            min_bytes=self.config.min_bytes, step_s=step_s, count=count,
            search_done=search_done, compute_s=stats.compute_s if stats else 0.0,
            probe_s=self.comeback.compute_sample(), stamp_error_s=self.config.stamp_error_s,
        )  # fmt: skip
        assert strategy.plan is not None
        search = self.replanner.search
        members = exchange.exchange_members(
            [r for stage in strategy.plan.stages for r in stage.ranks],
            [self.replanner.searcher(strategy), *([] if search is None else [search.searcher])],
            self.comeback.pairs, self.comeback.watched_devices(),
        )  # fmt: skip
        land = self.channel.post(
            values, members, rank=strategy.global_rank, world=world, device=strategy.root_device
        )
        return lambda: exchange.unpack(step, pairs, world, land())

    def _decide(
        self,
        trainer: pl.Trainer,
        strategy: AdaptableStrategy,
        decisions: list[dict[str, Any]],
        stale: bool = False,
    ) -> None:
        """The monitor's proposals, on every rank together."""
        from lightning_deepcee.adapter.monitor import describe_link

        for d in decisions:
            self.decisions.append(d)
            if "device" in d:
                rank_zero_info(
                    f"DeepCEE adapter: step {d['step']} {d['name']} {d['kind']}: "
                    f"{d['old_s'] * 1e3:.0f} -> {d['new_s'] * 1e3:.0f} ms of compute a step "
                    f"({d['reason']})"
                )
                continue
            name = d.get("name") or f"{d['link'][0]}->{d['link'][1]}"
            rank_zero_info(
                f"DeepCEE adapter: step {d['step']} link {describe_link(name, d.get('pairs', []))}"
                f" {d['kind']} x{d['split_factor']}: {d['old_bandwidth'] / 1e6:.3g} -> "
                f"{d['new_bandwidth'] / 1e6:.3g} MB/s ({d['reason']})"
            )
            for logger in trainer.loggers:
                logger.log_metrics(
                    {f"deepcee/adapter_link{name}_mb_per_s": d["new_bandwidth"] / 1e6},
                    step=trainer.global_step,
                )
        if stale:
            return  # made under the layout a revert just left
        why = self._cannot_predict(strategy)
        if why is not None:
            for kind in sorted({d["kind"] for d in decisions}):
                if kind == "replan":
                    self.replanner.record(trainer, decisions, "skipped", why)
                else:
                    self.record(trainer, {"kind": f"{kind}-skipped", "reason": why})
            return
        pending = self.guard.pending
        if pending is not None:
            self._deferred += decisions
            why = f"waits for the verdict on the {pending['kind']} of step {pending['step']}"
            self.record(trainer, {"kind": "deferred", "reason": why})
            return
        self._act(trainer, strategy, decisions)

    def _act(
        self, trainer: pl.Trainer, strategy: AdaptableStrategy, proposals: list[dict[str, Any]]
    ) -> None:
        replans = [d for d in proposals if d["kind"] == "replan"]
        resplits = [d for d in proposals if d["kind"] in ("split", "merge")]
        if replans:
            # A search in flight planned for the network before this change: the new one plans
            # for every figure the monitors hold now, that search's change included.
            self.replanner.drop(
                trainer, f"a newer change ({replans[0].get('name', 'a link')}) supersedes it"
            )
            self.replanner.start(trainer, strategy, replans, resplits)
            return  # the split proposals wait for the search: a new plan would replace them
        if resplits:
            self.resplit(trainer, strategy, resplits)

    def _cannot_predict(self, strategy: AdaptableStrategy) -> str | None:
        if strategy.cluster_profile is None:
            return (
                "acting needs a prediction, and predicting needs a cluster profile "
                "(DeepCEEStrategy() plans from one; a manual layout needs profile=True)"
            )
        if strategy.num_replicas != 1:
            return "a manual layout with several data-parallel replicas cannot be re-planned"
        return None

    @property
    def configuration(self) -> int:
        """Counts changes of the running configuration (split, layout)."""
        return self._changes

    def observed(
        self, strategy: AdaptableStrategy, proposals: list[dict[str, Any]]
    ) -> tuple[ClusterProfile, dict[Any, tuple[float, float]]]:
        """The profile as the links behave now (the proposals' figures, then the monitor's) and
        the devices compute now (the proposals' ratios, then the compute monitor's; slowed or
        faster ones scaled, none faster than measured at setup; keyed ``device <rank>``)."""
        from lightning_deepcee.adapter.compute import compute_ratios, observed_compute
        from lightning_deepcee.adapter.replan import (
            figures_from_decision,
            link_figures,
            observed_profile,
        )
        from lightning_deepcee.profiler import ClusterProfile

        # The monitor's figures last: they cover every pair of a link, and later figures win.
        figures = [f for d in proposals if "link" in d for f in figures_from_decision(d)]
        figures += [] if self.monitor is None else link_figures(self.monitor.state_dict())
        profile = strategy.cluster_profile
        assert profile is not None
        ceiling = profile  # as measured, until a re-plan replaced it
        replanned = self.replanner.replanned
        if replanned is not None and replanned.measured is not None:
            ceiling = ClusterProfile.from_dict(replanned.measured)
        observed, changes = observed_profile(
            profile, figures, ceiling=ceiling, changing_below=1 / self.config.slow_threshold
        )
        ratios = compute_ratios(proposals)
        if self.compute is not None:  # its state now wins over a proposal's, as for links
            ratios = {r: x for r, x in ratios.items() if r not in self.compute.ranks}
            ratios.update(self.compute.ratios())
        observed, applied = observed_compute(observed, ratios, ceiling=ceiling)
        return observed, {**changes, **{f"device {r}": (1.0, x) for r, x in applied.items()}}

    def plan_at(self, strategy: AdaptableStrategy, split: int) -> Plan:
        """The running plan with ``split`` pieces per micro-batch of its own count."""
        from lightning_deepcee.adapter.gate import with_microbatches

        base = self.split_state.base_microbatches or strategy.num_microbatches
        return with_microbatches(with_microbatches(strategy.current_plan(), base), base * split)

    def signature(self) -> list[Any]:
        """The monitor's link states (what a refuted action and a search are tied to)."""
        links = [] if self.monitor is None else [list(s) for s in self.monitor.signature()]
        return links + ([] if self.compute is None else self.compute.signature())

    def refuted_key(self, kind: str, target: Any) -> str:
        """An action as the clock may refute it: its kind and target under these link states."""
        return json.dumps([kind, target, self.signature()], sort_keys=True)

    def is_refuted(self, key: str | None) -> bool:
        """Whether the clock reverted the action ``key`` (:meth:`refuted_key`)."""
        return key in self._refuted

    # -------------------------------------------------------------------- fast response
    def resplit(
        self, trainer: pl.Trainer, strategy: AdaptableStrategy, proposals: list[dict[str, Any]]
    ) -> None:
        """Put split or merge proposals to the gate; apply the split it predicts pays."""
        from lightning_deepcee.adapter.gate import SplitChoice, choose_split

        observed, _ = self.observed(strategy, proposals)
        plan, split = self.plan_at(strategy, 1), self.split_state.split

        def gate() -> dict[str, Any]:
            return choose_split(
                observed, plan, current_split=split, max_split=self.config.max_split,
                gain=self.split_gain,
            ).to_dict()  # fmt: skip

        choice = SplitChoice.from_dict(on_one_rank(strategy, "the split gate", gate))
        merging = all(d["kind"] == "merge" for d in proposals)
        label = "merge" if choice.split < split or (merging and not choice.apply) else "split"
        predicted = {str(k): round(v * 1e3, 3) for k, v in choice.step_time_s.items()}
        entry = {"predicted_ms": predicted, "from": split, "to": choice.split}
        key = self.refuted_key("split", choice.split)
        if choice.apply and key in self._refuted:
            self.record(trainer, {**entry, "kind": f"{label}-kept", "reason": "the clock "
                         f"reverted x{choice.split} under the same link states"})  # fmt: skip
            return
        if not choice.apply:
            self.record(trainer, {**entry, "kind": f"{label}-kept", "reason": choice.reason})
            return
        previous = split
        self.split_state.split = choice.split
        self.apply_split(trainer, strategy)
        self.guard.begin(
            trainer.global_step,
            {"kind": label, "from": previous, "to": choice.split, "key": key},
            towards_plan=choice.split < previous,
        )
        self.record(trainer, {**entry, "kind": f"{label}-applied", "reason": choice.reason})

    def apply_split(self, trainer: pl.Trainer, strategy: AdaptableStrategy) -> None:
        """Run the split in force (``split_state``) from the next step on."""
        split = self.split_state
        target = (split.base_microbatches or strategy.num_microbatches) * split.split
        if target != strategy.num_microbatches:
            strategy.set_num_microbatches(target)
            self._changes += 1
            for logger in trainer.loggers:
                logger.log_metrics(
                    {"deepcee/adapter_microbatches": float(target)}, step=trainer.global_step
                )

    def record(self, trainer: pl.Trainer, entry: dict[str, Any]) -> None:
        """Log a decision on rank 0 and add it to ``decisions``."""
        entry = {"step": trainer.global_step, **entry}
        rank_zero_info(f"DeepCEE adapter: step {entry['step']} {entry['kind']}: {entry['reason']}")
        self.decisions.append(entry)

    # -------------------------------------------------------------------- the clock
    def _on_verdict(
        self, trainer: pl.Trainer, strategy: AdaptableStrategy, verdict: Verdict
    ) -> None:
        action = verdict.action
        kind = "confirmed" if verdict.keep else "reverted"
        rank_zero_info(f"DeepCEE adapter: {verdict}")
        self.decisions.append(
            {"step": verdict.step, "kind": kind, "action": action["kind"],
             "action_step": action["step"], "before_s": verdict.before_s,
             "after_s": verdict.after_s, "reason": verdict.reason}
        )  # fmt: skip
        rebuilt = False
        if not verdict.keep:
            if action.get("key") is not None:
                self._refuted.append(action["key"])
            if action["kind"] in ("split", "merge"):
                self.split_state.split = int(action["from"])
                self.apply_split(trainer, strategy)
            else:
                if action["kind"] == "replan" and self.comeback.returns_to(
                    action["previous"]["plan"]
                ):
                    self.comeback.close()  # back on the plan it left
                self.replanner.revert(trainer, strategy, action["previous"])
                rebuilt = True
            self.guard.settle()
        if self._deferred and self.guard.pending is None:
            deferred, self._deferred = self._deferred, []
            if not rebuilt:
                self._act(trainer, strategy, deferred)

    # -------------------------------------------------------------------- coming back
    def moved_away(
        self, strategy: AdaptableStrategy, left: dict[str, Any], replans: list[dict[str, Any]]
    ) -> None:
        """A re-plan moved away from ``left``: probe the slowed links and devices it left."""
        self.comeback.moved_away(
            strategy, left, replans, window=self.config.window,
            fast_threshold=self.config.fast_threshold, slow_threshold=self.config.slow_threshold,
        )  # fmt: skip

    def watched_devices(self) -> list[int]:
        """The devices the come-back's compute probes time (no search runs there)."""
        return self.comeback.watched_devices()

    # -------------------------------------------------------------------- layout changes
    def new_monitor(self, strategy: AdaptableStrategy) -> None:
        """Watch the running plan's links afresh (start, re-plan, revert, another layout)."""
        from lightning_deepcee.adapter.links import link_expectations, plan_pairs

        assert strategy.plan is not None
        self._pairs = plan_pairs(strategy.plan)
        expected, shared = link_expectations(strategy.cluster_profile, self._pairs)
        self.monitor = LinkMonitor(expected, None, self.config, shared)
        self._deferred = []
        self._changes += 1

    # -------------------------------------------------------------------- checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        replanned = self.replanner.replanned
        return {
            "version": _STATE_VERSION,
            "monitor": None if self.monitor is None else self.monitor.state_dict(),
            "pairs": [list(p) for p in self._pairs],
            "guard": self.guard.state_dict(),
            "split": self.split_state.split,
            "base_microbatches": self.split_state.base_microbatches,
            "decisions": self.decisions,
            "replanned": None if replanned is None else replanned.to_dict(),
            "refuted": self._refuted,
            "deferred": self._deferred,
            "floor_s": self.replanner.floor_s,
            "comeback": self.comeback.state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.decisions = list(state_dict.get("decisions", []))
        self.replanner.replanned = Replanned.from_dict(state_dict.get("replanned"))
        self.split_state.base_microbatches = state_dict.get("base_microbatches")
        if state_dict.get("version") != _STATE_VERSION:
            rank_zero_warn(
                "DynamicEnvironmentAdapter: the checkpoint's adapter state is from another "
                "version; its links are watched afresh and no split is in force."
            )
            return
        self.monitor = None
        if state_dict["monitor"] is not None:
            self.monitor = LinkMonitor({}, None, self.config)
            self.monitor.load_state_dict(state_dict["monitor"])
        self._pairs = [(int(s), int(d)) for s, d in state_dict["pairs"]]
        self.guard.load_state_dict(state_dict["guard"])
        self.split_state.split = int(state_dict["split"])
        self._refuted = list(state_dict["refuted"])
        self._deferred = list(state_dict["deferred"])
        self.replanner.floor_s = state_dict.get("floor_s")
        self.comeback.load_state_dict(state_dict.get("comeback"))


def _deepcee(trainer: pl.Trainer) -> AdaptableStrategy:
    strategy: AdaptableStrategy = deepcee_strategy(trainer, "DynamicEnvironmentAdapter")
    return strategy
