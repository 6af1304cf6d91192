"""DynamicEnvironmentAdapter: the Lightning Callback that runs the link monitor during training.

A thin shim over the pure :mod:`lightning_deepcee.adapter` (monitor, tuner, re-plan choice): it
feeds them the executor's transfer timings each step, gathers their decisions so every rank acts
on the same step, and applies them through the strategy (micro-batch splits, ``apply_plan``).
See docs/adapter.md.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_deepcee.runtime.transport import TransferRecord

__all__ = ["DynamicEnvironmentAdapter"]


class DynamicEnvironmentAdapter(Callback):
    """Follows the links at run time: finer micro-batches when a link slows, re-plan when it stays.

    A thin shim over :class:`~lightning_deepcee.adapter.LinkMonitor` and
    :mod:`lightning_deepcee.adapter.replan` (pure, see docs/adapter.md). Each step every rank
    turns its *received* transfers (bytes and seconds on the wire, from a transfer's header to
    its payload) into link observations. The first ``calibration_steps`` steps set what each link
    normally delivers under this schedule; then the monitor compares each window median with it.

    A ``split`` only applies to a link that matters: if at the degraded bandwidth its transfers
    of the step take less than ``min_link_share`` of the step's wall time (a LAN link whose
    measured speed wobbles under CPU contention), the decision is logged as ignored.

    Decisions are gathered on every rank so all ranks act on the same step:

    - ``split`` / ``merge`` (fast response): the step's micro-batch count becomes the configured
      count times the largest split in force, from the next step on, so a stage behind a slow link
      starts on smaller pieces sooner; it returns to the configured count when links recover.
      After a split, a :class:`~lightning_deepcee.adapter.SplitTuner` tries one piece more at a
      time while the median step time (max over ranks) drops by ``tune_gain`` or more, and
      settles on the best split it measured (``tune_gain=None``: no tuning).
    - ``replan`` (slow response): every rank's link figures are gathered; the strategy's
      ``cluster_profile`` is rescaled on every link that is off its expectation (by
      ``measured / expected``, both directions unless the reverse has its own observation, see
      :func:`~lightning_deepcee.adapter.observed_profile`); rank 0 re-predicts the running plan
      on it and searches a new plan, and broadcasts the outcome. If the new plan's predicted step
      time beats the running plan's by more than ``replan_gain``, every rank calls
      ``DeepCEEStrategy.apply_plan``: blocks and their optimizer state move at this step
      boundary, gradients stay exact. The observed profile becomes the strategy's profile, the
      splits are dropped (the new plan's micro-batch count is the configured one) and the links
      are calibrated again under the new plan. Without a profile (a manual layout without
      ``profile=True``) the decision is logged and skipped.

    Every decision, and every re-plan's figures and outcome, goes to the console and to the
    loggers (``deepcee/adapter_microbatches``, ``deepcee/adapter_replan_*``). The state (monitor
    windows, splits, calibration, the plan a re-plan moved to and the profile it was made for)
    is saved in checkpoints; on resume the re-planned layout is restored at ``on_train_start``
    when setup chose the layout that re-plan replaced (the run continues exactly), and dropped
    (with a re-calibration) when setup chose another one (another cluster or a new plan).

    Args:
        replan_gain: the least predicted gain, as a fraction of the running plan's predicted step
            time (on the observed profile), for which a re-plan moves blocks; in ``[0, 1)``.
            Moving blocks costs a gather of the whole training state and a re-calibration, and
            a predicted gain within the cost model's error may not be real, so a smaller gain is
            not worth acting on.
        tune_gain: the least relative drop of the median step time (over ``window`` steps) for
            the tuner to keep a finer split, in ``[0, 1)``; ``None`` keeps the monitor's split.
            The other arguments are the monitor's (see docs/adapter.md).
    """

    def __init__(
        self,
        slow_threshold: float = 1.5,
        fast_threshold: float = 1.25,
        window: int = 5,
        react_after: int = 3,
        replan_after: int = 20,
        min_bytes: int = 65536,
        max_split: int = 4,
        calibration_steps: int = 10,
        min_link_share: float = 0.1,
        replan_gain: float = 0.1,
        tune_gain: float | None = 0.05,
    ) -> None:
        from lightning_deepcee.adapter import MonitorConfig, SplitTuner

        self.config = MonitorConfig(
            slow_threshold=slow_threshold,
            fast_threshold=fast_threshold,
            window=window,
            react_after=react_after,
            replan_after=replan_after,
            min_bytes=min_bytes,
            max_split=max_split,
        )
        if calibration_steps < 1:
            raise ValueError(f"calibration_steps must be >= 1, got {calibration_steps}")
        if not 0 <= min_link_share < 1:
            raise ValueError(f"min_link_share must be in [0, 1), got {min_link_share}")
        if isinstance(replan_gain, bool) or not 0 <= replan_gain < 1:
            raise ValueError(
                f"replan_gain must be in [0, 1) (a fraction of the step time), got {replan_gain}"
            )
        self.min_link_share = min_link_share
        self.calibration_steps = calibration_steps
        self.replan_gain = float(replan_gain)
        self.tuner: SplitTuner | None = None
        if tune_gain is not None:
            self.tuner = SplitTuner(max_split=max_split, window=window, min_gain=tune_gain)
        self._tuned_split: int | None = None
        """The tuner's split while it is in force (overrides the monitor's largest split)."""
        self._last_batch_end: float | None = None
        self.monitor: Any = None
        self._calibration: dict[str, list[float]] = {}
        self._calibration_start = 0
        """Global step after which the current calibration began (0, or the last re-plan's)."""
        self._splits: dict[str, int] = {}
        self._base_microbatches: int | None = None
        self.decisions: list[dict[str, Any]] = []
        self._replanned: dict[str, Any] | None = None
        """After an applied re-plan: the plan (dict), the profile it was made for (dict) and the
        layout setup had chosen (``_layout_key``), for a resume to restore it."""

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = _deepcee(trainer)
        if self._replanned is not None:
            self._restore_replan(trainer, strategy)
        if self._base_microbatches is None:
            self._base_microbatches = strategy.num_microbatches
        self._apply(trainer)  # after a resume, re-apply the split in force

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        from lightning_deepcee.adapter import LinkMonitor, observations_from_transfers

        strategy = _deepcee(trainer)
        step = trainer.global_step
        now = time.perf_counter()
        step_s = 0.0 if self._last_batch_end is None else now - self._last_batch_end
        self._last_batch_end = now
        # A receive's blocked time includes waiting for the sender's compute, which a split
        # shortens: judging links by it makes the adapter's own splits look like recoveries.
        # The payload's time on the wire (after its header arrived) is what the link delivers.
        received = [
            TransferRecord(r.peer, r.num_bytes, r.wire_s, r.direction)
            for r in strategy.transfer_records
            if r.direction == "recv" and r.wire_s is not None
        ]
        observations = [
            o
            for o in observations_from_transfers(step, strategy.global_rank, received)
            if o.num_bytes >= self.config.min_bytes and o.seconds > 0
        ]
        if self.monitor is None:
            for o in observations:
                key = f"{o.src}->{o.dst}"
                self._calibration.setdefault(key, []).append(o.num_bytes / o.seconds)
            if step < self._calibration_start + self.calibration_steps:
                return
            expected = _median_per_link(strategy, self._calibration)
            self.monitor = LinkMonitor(expected, None, self.config)
            return
        step_bytes: dict[tuple[int, int], int] = {}
        for o in observations:
            step_bytes[(o.src, o.dst)] = step_bytes.get((o.src, o.dst), 0) + o.num_bytes
        mine = []
        for d in self.monitor.observe(step, observations):
            # Carry the deciding rank's figures, so every rank judges the decision alike.
            entry = d.to_dict()
            entry["step_bytes"] = step_bytes.get(d.link, 0)
            entry["step_s"] = step_s
            mine.append(entry)
        # Most steps decide nothing: one small all-reduce says so (and gives every rank the same
        # step time, the slowest rank's, for the tuner); only a step with a decision somewhere
        # pays for gathering the decisions themselves.
        summary = torch.tensor(
            [float(len(mine)), step_s], dtype=torch.float64, device=strategy.root_device
        )
        torch.distributed.all_reduce(summary, op=torch.distributed.ReduceOp.MAX)
        count, slowest_s = int(summary[0].item()), float(summary[1].item())
        if count == 0:
            self._tune(trainer, step, slowest_s)
            return
        gathered: list[list[dict[str, Any]] | None] = [None] * strategy.world_size
        torch.distributed.all_gather_object(gathered, mine)
        decisions = [d for part in gathered for d in (part or [])]
        if decisions:
            self._decide(trainer, strategy, decisions)

    def _decide(self, trainer: pl.Trainer, strategy: Any, decisions: list[dict[str, Any]]) -> None:
        replans = []
        for d in decisions:
            key = f"{d['link'][0]}->{d['link'][1]}"
            wire_s = d.get("step_bytes", 0) / max(d["new_bandwidth"], 1e-9)
            if d["kind"] == "split" and wire_s < self.min_link_share * d.get("step_s", 0.0):
                d = {**d, "kind": "ignored-split"}
                rank_zero_info(
                    f"DeepCEE adapter: step {d['step']} link {key} split ignored: its transfers "
                    f"take {wire_s * 1e3:.1f} ms of a {d['step_s'] * 1e3:.0f} ms step "
                    f"(< min_link_share={self.min_link_share})"
                )
                self.decisions.append(d)
                continue
            if d["kind"] in ("split", "merge"):
                self._splits[key] = int(d["split_factor"])
            if d["kind"] == "replan":
                replans.append(d)
            self.decisions.append(d)
            rank_zero_info(
                f"DeepCEE adapter: step {d['step']} link {key} {d['kind']} "
                f"x{d['split_factor']}: {d['old_bandwidth'] / 1e6:.3g} -> "
                f"{d['new_bandwidth'] / 1e6:.3g} MB/s ({d['reason']})"
            )
            for logger in trainer.loggers:
                logger.log_metrics(
                    {f"deepcee/adapter_link{key}_mb_per_s": d["new_bandwidth"] / 1e6},
                    step=trainer.global_step,
                )
        if replans:
            self._replan(trainer, strategy, replans)
        if self.tuner is not None and any(d["kind"] in ("split", "merge") for d in decisions):
            # The monitor changed the split: tune from its new split (or stop: all merged).
            self._tuned_split = None
            split = max(self._splits.values(), default=1)
            if split > 1:
                self.tuner.start(split)
            else:
                self.tuner.stop()
        self._apply(trainer)

    def _tune(self, trainer: pl.Trainer, step: int, step_s: float) -> None:
        """Feed the tuner this step's time (the same on every rank) and apply its decision."""
        if self.tuner is None or not self.tuner.active:
            return
        decision = self.tuner.observe(step, step_s)
        if decision is None:
            return
        self._tuned_split = decision.split
        entry = {**asdict(decision), "kind": "tune-" + decision.kind}
        self.decisions.append(entry)
        rank_zero_info(f"DeepCEE adapter: {decision}")
        for logger in trainer.loggers:
            logger.log_metrics({"deepcee/adapter_tuned_split": float(decision.split)}, step=step)
        self._apply(trainer)

    def _replan(self, trainer: pl.Trainer, strategy: Any, replans: list[dict[str, Any]]) -> None:
        """The slow response: on every rank together (the decisions were gathered)."""
        from lightning_deepcee.adapter import (
            ReplanChoice,
            choose_replan,
            figure_from_decision,
            link_figures,
            observed_profile,
        )

        step = trainer.global_step
        profile = strategy.cluster_profile
        if profile is None or strategy.num_replicas != 1:
            why = (
                "re-planning needs a cluster profile (DeepCEEStrategy() plans from one; a manual "
                "layout needs profile=True)"
                if profile is None
                else "a manual layout with several data-parallel replicas cannot be re-planned"
            )
            self._record_replan(trainer, replans, "skipped", why)
            return
        # Every rank watches its incoming links: gather all of them (a re-plan is rare).
        mine = [] if self.monitor is None else link_figures(self.monitor.state_dict())
        gathered: list[Any] = [None] * strategy.world_size
        torch.distributed.all_gather_object(gathered, mine)
        figures = [f for part in gathered for f in (part or [])]
        figures += [figure_from_decision(d) for d in replans]
        observed, changes = observed_profile(profile, figures)
        outcome: dict[str, Any] = {}
        if strategy.is_global_zero:
            try:
                current = strategy.current_plan()
                outcome = choose_replan(observed, current, gain=self.replan_gain).to_dict()
            except Exception as exc:  # the other ranks wait in the broadcast: tell them
                outcome = {"error": f"{type(exc).__name__}: {exc}"}
        outcome = strategy.broadcast(outcome)
        if "error" in outcome:
            raise RuntimeError(f"DeepCEE adapter: re-planning failed on rank 0: {outcome['error']}")
        choice = ReplanChoice.from_dict(outcome)
        changed = ", ".join(
            f"{src}->{dst} {old / 1e6:.3g} -> {new / 1e6:.3g} MB/s"
            for (src, dst), (old, new) in sorted(changes.items())
        )
        new_s = choice.new_step_time_s
        figures_line = (
            f"profile links {changed or 'unchanged'}; running plan predicted "
            f"{choice.current_step_time_s * 1e3:.1f} ms on them, searched plan "
            f"{'none' if new_s is None else f'{new_s * 1e3:.1f} ms'}"
        )
        for logger in trainer.loggers:
            metrics = {
                "deepcee/adapter_replan_current_ms": choice.current_step_time_s * 1e3,
                "deepcee/adapter_replan_applied": float(choice.apply),
            }
            if new_s is not None:
                metrics["deepcee/adapter_replan_new_ms"] = new_s * 1e3
            logger.log_metrics(metrics, step=step)
        if not choice.apply or choice.plan is None:
            self._record_replan(
                trainer, replans, "kept", f"{choice.reason}; {figures_line}", choice.to_dict()
            )
            return
        origin = _layout_key(strategy.current_plan())
        strategy.apply_plan(choice.plan, trainer)
        strategy.cluster_profile = observed
        if self._replanned is not None:
            origin = self._replanned["origin"]  # a resume compares with the first layout
        self._replanned = {
            "plan": choice.plan.to_dict(),
            "profile": observed.to_dict(),
            "origin": origin,
        }
        self._restart_calibration(step, strategy)
        self._record_replan(
            trainer,
            replans,
            "applied",
            f"{choice.reason}; {figures_line}; links calibrated again under the new plan",
            choice.to_dict(),
        )

    def _record_replan(
        self,
        trainer: pl.Trainer,
        replans: list[dict[str, Any]],
        action: str,
        why: str,
        choice: dict[str, Any] | None = None,
    ) -> None:
        links = ", ".join(f"{d['link'][0]}->{d['link'][1]}" for d in replans)
        rank_zero_info(
            f"DeepCEE adapter: step {trainer.global_step} re-plan for link(s) {links}: {action} "
            f"({why})"
        )
        entry: dict[str, Any] = {
            "step": trainer.global_step,
            "kind": "replan-" + action,
            "links": [list(d["link"]) for d in replans],
            "reason": why,
        }
        if choice is not None:
            entry["current_step_time_s"] = choice["current_step_time_s"]
            entry["new_step_time_s"] = choice["new_step_time_s"]
            entry["plan"] = choice["plan"]
        self.decisions.append(entry)

    def _restart_calibration(self, step: int, strategy: Any) -> None:
        """After the layout changed: calibrate every link again, no split in force."""
        self.monitor = None
        self._calibration = {}
        self._calibration_start = step
        self._splits = {}
        self._tuned_split = None
        if self.tuner is not None:
            self.tuner.stop()
        self._base_microbatches = strategy.num_microbatches

    def _restore_replan(self, trainer: pl.Trainer, strategy: Any) -> None:
        """On resume: run the re-planned layout again if setup chose the one it replaced."""
        from lightning_deepcee.planner import Plan
        from lightning_deepcee.profiler import ClusterProfile

        assert self._replanned is not None
        plan = Plan.from_dict(self._replanned["plan"])
        try:
            running = _layout_key(strategy.current_plan())
        except ValueError:
            running = None
        if running == _layout_key(plan):
            return  # setup runs the re-planned layout already (e.g. passed as plan=...)
        problem = None
        if running != self._replanned["origin"]:
            problem = "setup chose another layout than the one the re-plan replaced"
        else:
            try:
                strategy.check_plan(plan)
            except ValueError as exc:
                problem = str(exc)
        if problem is not None:
            rank_zero_info(
                f"DeepCEE adapter: not restoring the re-planned layout of the checkpoint "
                f"({problem}); keeping setup's layout and calibrating the links again."
            )
            self._replanned = None
            self._restart_calibration(trainer.global_step, strategy)
            return
        rank_zero_info("DeepCEE adapter: restoring the re-planned layout of the checkpoint.")
        strategy.apply_plan(plan, trainer)
        saved = ClusterProfile.from_dict(self._replanned["profile"])
        current = strategy.cluster_profile
        if current is None or (
            current.cluster_fingerprint == saved.cluster_fingerprint
            and current.model_fingerprint == saved.model_fingerprint
        ):
            strategy.cluster_profile = saved  # the profile the restored plan was made for

    def _apply(self, trainer: pl.Trainer) -> None:
        strategy = _deepcee(trainer)
        base = self._base_microbatches or strategy.num_microbatches
        split = self._tuned_split or max(self._splits.values(), default=1)
        target = base * split
        if target != strategy.num_microbatches:
            strategy.set_num_microbatches(target)
            for logger in trainer.loggers:
                logger.log_metrics(
                    {"deepcee/adapter_microbatches": float(target)}, step=trainer.global_step
                )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": None if self.monitor is None else self.monitor.state_dict(),
            "calibration": self._calibration,
            "splits": self._splits,
            "base_microbatches": self._base_microbatches,
            "decisions": self.decisions,
            "calibration_start": self._calibration_start,
            "replanned": self._replanned,
            "tuner": None if self.tuner is None else self.tuner.state_dict(),
            "tuned_split": self._tuned_split,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from lightning_deepcee.adapter import LinkMonitor

        self._calibration = dict(state_dict["calibration"])
        self._splits = dict(state_dict["splits"])
        self._base_microbatches = state_dict["base_microbatches"]
        self.decisions = list(state_dict["decisions"])
        # Checkpoints from before re-planning existed lack these two.
        self._calibration_start = int(state_dict.get("calibration_start", 0))
        self._replanned = state_dict.get("replanned")
        self._tuned_split = state_dict.get("tuned_split")
        if self.tuner is not None and state_dict.get("tuner") is not None:
            self.tuner.load_state_dict(state_dict["tuner"])
        self.monitor = None
        if state_dict["monitor"] is not None:
            self.monitor = LinkMonitor({}, None, self.config)
            self.monitor.load_state_dict(state_dict["monitor"])


def _deepcee(trainer: pl.Trainer) -> Any:
    from lightning_deepcee.strategy import DeepCEEStrategy

    if not isinstance(trainer.strategy, DeepCEEStrategy):
        raise TypeError("This callback needs Trainer(strategy=DeepCEEStrategy()).")
    return trainer.strategy


def _layout_key(plan: Any) -> list[Any]:
    """What a plan decides about placement (stages, devices, shares, schedule), JSON-ready;
    not its micro-batch count, which the fast response changes."""
    stages = [
        [list(st.block_range), list(st.ranks), [round(x, 6) for x in st.batch_shares]]
        for st in plan.stages
    ]
    return [stages, plan.schedule]


def _median_per_link(
    strategy: Any, samples: dict[str, list[float]]
) -> dict[tuple[int, int], float]:
    """Every rank's calibration medians, gathered so all ranks watch every link alike."""
    import statistics

    mine = {k: statistics.median(v) for k, v in samples.items() if v}
    gathered: list[dict[str, float] | None] = [None] * strategy.world_size
    torch.distributed.all_gather_object(gathered, mine)
    expected: dict[tuple[int, int], float] = {}
    for part in gathered:
        for key, value in (part or {}).items():
            src, dst = key.split("->")
            expected[(int(src), int(dst))] = value
    return expected
