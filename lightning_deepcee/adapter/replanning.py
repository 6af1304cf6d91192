"""The adapter's slow response: re-plan on the links as measured, revert, restore on resume.

Part of the Lightning shim (``callback.py``): the search runs in a child process on an idle
device (else rank 0) while training goes on (``search_process.SearchProcess``); every rank takes
its outcome at the same step, and moves blocks only when the cost model predicts a gain and the
configuration it was searched for still runs. See docs/adapter.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_deepcee.adapter.replan import placement_key
from lightning_deepcee.adapter.search_process import SearchProcess

if TYPE_CHECKING:
    from lightning_deepcee.adapter.callback import DynamicEnvironmentAdapter

__all__ = [
    "apply_replan", "clocked_step", "finish_replan", "note_clock", "on_one_rank",
    "record_replan", "restore_replan", "revert_replan", "searcher", "start_replan",
]  # fmt: skip


def start_replan(
    adapter: DynamicEnvironmentAdapter,
    trainer: pl.Trainer,
    strategy: Any,
    replans: list[dict[str, Any]],
    resplits: list[dict[str, Any]],
) -> None:
    """Begin the search for a plan on the links as measured, in a child process on the searcher
    (:func:`searcher`), so that training goes on meanwhile; :func:`finish_replan` takes its
    outcome on every rank at the step after the searcher says it is done. No search starts when
    none can pay (:func:`_hopeless`)."""
    from lightning_deepcee.planner.cost_model import predict_plan

    observed, changes = adapter._observed(strategy, replans)
    current = adapter._plan_at(strategy, adapter._split)
    gain = adapter.replan_gain
    predicted_s = predict_plan(observed, current).step_time_s
    clocked = clocked_step(adapter, strategy)
    current_s = predicted_s if clocked is None else clocked[0]
    running = (
        f"the running plan is predicted {predicted_s * 1e3:.1f} ms on the links as measured"
        if clocked is None
        else f"the running plan runs {current_s * 1e3:.1f} ms in the cost model's scale "
        f"(measured {clocked[1] * 1e3:.1f} ms; the model predicts {predicted_s * 1e3:.1f} ms "
        "on the links as measured)"
    )
    why = _hopeless(changes, current_s, adapter._floor_s, gain, running)
    if why is not None:
        record_replan(adapter, trainer, replans, "kept", why)
        if resplits:
            adapter._resplit(trainer, strategy, resplits)
        return
    adapter._search = {
        "step": trainer.global_step, "replans": replans, "resplits": resplits,
        "observed": observed, "changes": changes, "configuration": adapter._changes,
        "signature": adapter._signature(), "job": None, "clocked": clocked is not None,
        "searcher": searcher(strategy.plan, strategy.cluster_profile),
    }  # fmt: skip
    if strategy.global_rank == adapter._search["searcher"]:
        adapter._search["job"] = SearchProcess(
            {"profile": observed.to_dict(), "plan": current.to_dict(), "gain": gain,
             "current_s": current_s, "device_gain": strategy.device_gain,
             **_pacing(adapter.search_cpu_share)}
        )  # fmt: skip
    why = (
        f"searching a plan for the links as measured, in the background on rank "
        f"{adapter._search['searcher']}; training goes on"
    )
    adapter._record(trainer, {"kind": "replan-search", "reason": why})


def _hopeless(
    changes: dict[Any, tuple[float, float]],
    current_s: float,
    floor_s: float | None,
    gain: float,
    running: str,
) -> str | None:
    """Why no search can find a plan worth moving to, or None.

    The links as measured change no figure of the profile (a link that rose back to its setup
    figure, where rises are capped): the search would find the running plan again. Or the
    running plan's step ``current_s`` (described by ``running``) is within the margin of
    ``floor_s``, the step time of the plan the planner chose for the links as measured at
    setup: rises are capped at those figures, and a slower link never makes a plan faster, so
    no plan on the links as they are now can beat it.
    """
    if all(abs(new - old) <= 0.01 * old for old, new in changes.values()):
        return (
            "the links as measured change no figure of the profile (a rise is capped at the "
            "figure measured at setup), so a search would find the running plan again"
        )
    if floor_s is not None and floor_s >= current_s * (1 - gain):
        return (
            f"no plan can gain the margin {gain:.0%}: {running}, and no plan beats the "
            f"{floor_s * 1e3:.1f} ms of setup's plan on the links as measured at setup"
        )
    return None


def note_clock(adapter: DynamicEnvironmentAdapter, strategy: Any, step: int) -> None:
    """Take the running configuration's clock reference, once: the guard's median step over a
    whole window and the model's prediction for it, while every link is as profiled.

    The monitor flags a change only some steps after it began (its ``window`` of samples, then
    ``react_after`` of them), so a candidate becomes the reference only once the links have
    stayed as profiled for that long after it; a change inside its window drops it."""
    from lightning_deepcee.planner.cost_model import predict_plan

    monitor, measured = adapter.monitor, adapter.guard.steady_s
    key = _clock_key(adapter, strategy)
    candidate = adapter._clock_candidate
    steady = (
        monitor is not None
        and monitor.calibrated
        and not monitor.signature()
        and measured is not None
        and strategy.cluster_profile is not None
    )
    if not steady or (candidate is not None and candidate[0] != key):
        adapter._clock_candidate = None
        return
    if key in adapter._clock or measured is None:
        return
    if candidate is None:
        current = adapter._plan_at(strategy, adapter._split)
        predicted = predict_plan(strategy.cluster_profile, current).step_time_s
        adapter._clock_candidate = [key, measured, float(predicted), step]
    elif step >= candidate[3] + adapter.config.window + adapter.config.react_after:
        adapter._clock[key] = [float(candidate[1]), float(candidate[2])]
        adapter._clock_candidate = None


def clocked_step(adapter: DynamicEnvironmentAdapter, strategy: Any) -> tuple[float, float] | None:
    """The running configuration's step now, by the clock: ``(on the model's scale, measured)``.

    The guard's median over its last whole window, times predicted / measured of the
    configuration's reference (:func:`note_clock`). The model can be wrong about how much a
    slower link costs (overlap it assumes, a receiver's CPU quota it does not see); the clock
    is not, and on the model's scale the figure compares with the model's predictions of other
    plans. ``None`` without a reference or a whole window."""
    reference = adapter._clock.get(_clock_key(adapter, strategy))
    measured = adapter.guard.steady_s
    if reference is None or measured is None:
        return None
    return measured * reference[1] / reference[0], measured


def _clock_key(adapter: DynamicEnvironmentAdapter, strategy: Any) -> str:
    return json.dumps([placement_key(strategy.current_plan()), adapter._split])


def _pacing(share: float) -> dict[str, Any]:
    """The CPU quota this device runs under and the share of it a search may spend."""
    from lightning_deepcee.runtime.cpu_quota import read_cpu_quota

    quota = read_cpu_quota()
    return {} if quota is None else {"cpu": [quota.cores, quota.period_s], "share": share}


def finish_replan(adapter: DynamicEnvironmentAdapter, trainer: pl.Trainer, strategy: Any) -> None:
    """The searcher's search is done: take its outcome on every rank; move if it pays, the
    configuration it was searched for is still the one running and the links still say what
    they said when it began (the monitor's signature)."""
    search, adapter._search = adapter._search, None
    assert search is not None
    job = search["job"]
    outcome = on_one_rank(
        strategy, "re-planning", lambda: job.result() if job else {}, src=search["searcher"]
    )
    replans, resplits = search["replans"], search["resplits"]
    if search["configuration"] != adapter._changes:
        why = "the split or layout changed while it searched; the links are judged afresh"
        record_replan(adapter, trainer, replans, "dropped", why)
        return
    if search["signature"] != adapter._signature():
        why = (
            "the links changed state while it searched (a recovery, another link); a plan for "
            "the links as they were is not moved to, and they are judged afresh"
        )
        record_replan(adapter, trainer, replans, "dropped", why)
        return
    if not apply_replan(adapter, trainer, strategy, search, outcome) and resplits:
        adapter._resplit(trainer, strategy, resplits)


def apply_replan(
    adapter: DynamicEnvironmentAdapter,
    trainer: pl.Trainer,
    strategy: Any,
    search: dict[str, Any],
    outcome: dict[str, Any],
) -> bool:
    """Move on every rank to the searched plan if it pays; True when it was applied."""
    from lightning_deepcee.adapter.replan import ReplanChoice

    step = trainer.global_step
    profile = strategy.cluster_profile
    replans, observed, changes = search["replans"], search["observed"], search["changes"]
    choice = ReplanChoice.from_dict(outcome)
    changed = ", ".join(
        f"{src}->{dst} {old / 1e6:.3g} -> {new / 1e6:.3g} MB/s"
        for (src, dst), (old, new) in sorted(changes.items())
    )
    new_s = choice.new_step_time_s
    figures_line = (
        f"profile links {changed or 'unchanged'}; running plan "
        f"{'measured, on the model scale,' if search.get('clocked') else 'predicted'} "
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
    key = (
        None if choice.plan is None else adapter._refuted_key("replan", placement_key(choice.plan))
    )
    why = choice.reason
    if choice.apply and key in adapter._refuted:
        why = "the clock reverted a move to this layout under the same link states"
    if not choice.apply or choice.plan is None or key in adapter._refuted:
        record_replan(adapter, trainer, replans, "kept", f"{why}; {figures_line}", choice.to_dict())
        return False
    previous = {
        "plan": strategy.plan.to_dict(),
        "profile": profile.to_dict(),
        "split": adapter._split,
        "base": adapter._base_microbatches,
        "replanned": adapter._replanned,
    }
    origin = placement_key(strategy.current_plan())
    strategy.apply_plan(choice.plan, trainer)
    strategy.cluster_profile = observed
    if adapter._replanned is not None:
        origin = adapter._replanned["origin"]  # a resume compares with the first layout
    measured = (adapter._replanned or {}).get("measured", profile.to_dict())
    adapter._replanned = {
        "plan": choice.plan.to_dict(),
        "profile": observed.to_dict(),
        "origin": origin,
        "measured": measured,  # the setup profile: the ceiling of a link's recovery
    }
    adapter._split, adapter._base_microbatches = 1, strategy.num_microbatches
    adapter._new_monitor(strategy)
    adapter.guard.begin(
        step, {"kind": "replan", "previous": previous, "key": key}, towards_plan=False
    )
    record_replan(
        adapter, trainer, replans, "applied", f"{choice.reason}; {figures_line}", choice.to_dict()
    )
    return True


def record_replan(
    adapter: DynamicEnvironmentAdapter,
    trainer: pl.Trainer,
    replans: list[dict[str, Any]],
    action: str,
    why: str,
    choice: dict[str, Any] | None = None,
) -> None:
    links = ", ".join(d.get("name") or f"{d['link'][0]}->{d['link'][1]}" for d in replans)
    rank_zero_info(
        f"DeepCEE adapter: step {trainer.global_step} re-plan for link(s) {links}: {action} ({why})"
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
    adapter.decisions.append(entry)


def revert_replan(
    adapter: DynamicEnvironmentAdapter, trainer: pl.Trainer, strategy: Any, previous: dict[str, Any]
) -> None:
    from lightning_deepcee.planner import Plan
    from lightning_deepcee.profiler import ClusterProfile

    strategy.apply_plan(Plan.from_dict(previous["plan"]), trainer)
    strategy.cluster_profile = ClusterProfile.from_dict(previous["profile"])
    adapter._replanned = previous["replanned"]
    adapter._base_microbatches = previous["base"] or strategy.num_microbatches
    adapter._split = int(previous["split"])
    adapter._apply_split(trainer, strategy)
    adapter._new_monitor(strategy)


def restore_replan(adapter: DynamicEnvironmentAdapter, trainer: pl.Trainer, strategy: Any) -> None:
    """On resume: run the re-planned layout again if setup chose the one it replaced."""
    from lightning_deepcee.planner import Plan
    from lightning_deepcee.profiler import ClusterProfile

    assert adapter._replanned is not None
    plan = Plan.from_dict(adapter._replanned["plan"])
    try:
        running = placement_key(strategy.current_plan())
    except ValueError:
        running = None
    if running == placement_key(plan):
        return  # setup runs the re-planned layout already (e.g. passed as plan=...)
    problem = None
    if running != adapter._replanned["origin"]:
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
        adapter._replanned = None
        adapter._split, adapter._base_microbatches = 1, strategy.num_microbatches
        adapter.monitor = None
        adapter.guard.cancel()
        return
    rank_zero_info("DeepCEE adapter: restoring the re-planned layout of the checkpoint.")
    strategy.apply_plan(plan, trainer)
    saved = ClusterProfile.from_dict(adapter._replanned["profile"])
    current = strategy.cluster_profile
    if current is None or (
        current.cluster_fingerprint == saved.cluster_fingerprint
        and current.model_fingerprint == saved.model_fingerprint
    ):
        strategy.cluster_profile = saved  # the profile the restored plan was made for


def on_one_rank(
    strategy: Any, what: str, compute: Callable[[], dict[str, Any]], src: int = 0
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


def searcher(plan: Any, profile: Any) -> int:
    """The rank that runs a re-plan search: the fastest device the plan leaves idle, whose CPU
    training does not use (a search takes seconds of CPU, and a device under a CPU quota pays
    for every one of them in its own steps, however low the thread's priority); rank 0 when
    every device trains."""
    idle = list(getattr(plan, "idle_ranks", ()) or ())
    if not idle:
        return 0
    devices = {} if profile is None else {d.rank: d for d in profile.devices}

    def speed(rank: int) -> float:
        device = devices.get(rank)
        return 0.0 if device is None else float(device.capability)

    return max(idle, key=lambda rank: (speed(rank), -rank))
