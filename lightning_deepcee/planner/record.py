"""What set-up decided, saved beside a run's logs: the plan, the profile, a timeline, and why.

:func:`write_setup_record` writes, into one folder:

- ``plan.json``: the plan (``DeepCEEStrategy(plan=...)`` and ``deepcee plan`` read it);
- ``profile.json``: the measured cluster (``DeepCEEStrategy(profile_cache=...)`` reuses it,
  ``deepcee plan --profile`` plans on it);
- ``timeline.png``: the plan's simulated step, a row per stage named by its hosts, an empty
  row per idle device (needs matplotlib; without it the record says how to get it);
- ``why.txt``: the plan table, and every device set the search scored with its predicted step,
  by host and network group (region), best first.

:func:`plan_timeline` draws the timeline for ``deepcee plan --timeline`` as well.

Pure: the planner, the schedule package and the standard library (matplotlib when installed).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from lightning_deepcee.planner.cost_model import stage_costs
from lightning_deepcee.planner.plan import Plan, compact_ranks
from lightning_deepcee.planner.search import DeviceSetScore
from lightning_deepcee.profiler.data import ClusterProfile
from lightning_deepcee.profiler.grouping import group_devices
from lightning_deepcee.schedule.lowering import lower
from lightning_deepcee.schedule.simulate import SimulationResult, simulate

__all__ = ["format_device_sets", "plan_timeline", "simulate_plan", "write_setup_record"]


def simulate_plan(plan: Plan, profile: ClusterProfile) -> SimulationResult:
    """The plan's step under the cost model, with events (one simulated rank per stage)."""
    costs = stage_costs(
        profile, plan.stages, microbatch_size=plan.global_batch_size / plan.num_microbatches
    )
    placement = {s: s for s in range(len(plan.stages))}
    ranked = lower(plan.stage_schedule(), placement)
    return simulate(ranked, placement, costs, num_microbatches=plan.num_microbatches)


def plan_timeline(plan: Plan, profile: ClusterProfile, path: str | os.PathLike[str]) -> None:
    """Draw the plan's simulated step as a PNG: a row per stage named by its devices' hosts
    (``ImportError`` without matplotlib)."""
    from lightning_deepcee.schedule.timeline import plot_timeline

    labels = {
        s: f"stage {s}, blocks {st.block_range[0]}-{st.block_range[1] - 1}: "
        + ", ".join(profile.devices[r].host for r in st.ranks)
        for s, st in enumerate(plan.stages)
    }
    result = simulate_plan(plan, profile)
    rest = plan.predicted_step_time_s - result.step_time_s
    title = (
        f"{plan.schedule}, {plan.num_microbatches} micro-batches: predicted step "
        f"{plan.predicted_step_time_s * 1e3:.2f} ms = pipeline + {rest * 1e3:.2f} ms of "
        "all-reduce, optimizer and CPU quota"
    )
    idle = [f"idle: {profile.devices[r].host} (rank {r})" for r in plan.idle_ranks]
    plot_timeline(result, path, title=title, row_labels=labels, empty_rows=idle)


def format_device_sets(
    profile: ClusterProfile, device_sets: Mapping[tuple[int, ...], DeviceSetScore], chosen: Plan
) -> str:
    """Each scored device set, fastest first: predicted step, search depth, and its devices by
    network group (``group N: host, host``); the chosen set is marked."""
    groups = group_devices(profile).network_groups
    group_of = {r: k for k, members in enumerate(groups) for r in members}
    used = tuple(sorted(chosen.ranks))
    lines = ["device sets scored (predicted step; 'quick' = one schedule, a first estimate):"]
    for ranks, score in sorted(device_sets.items(), key=lambda item: item[1].step_time_s):
        by_group: dict[int, list[str]] = {}
        for r in ranks:
            by_group.setdefault(group_of[r], []).append(profile.devices[r].host)
        where = "; ".join(f"group {k}: {', '.join(hosts)}" for k, hosts in sorted(by_group.items()))
        mark = "  <- chosen" if tuple(sorted(ranks)) == used else ""
        depth = "full " if score.full else "quick"
        lines.append(
            f"  {score.step_time_s * 1e3:10.2f} ms  {depth}  ranks {compact_ranks(sorted(ranks))}"
            f" ({where}){mark}"
        )
    lines.append(
        "network groups: "
        + "; ".join(f"group {k}: ranks {compact_ranks(sorted(g))}" for k, g in enumerate(groups))
    )
    return "\n".join(lines)


def write_setup_record(
    folder: str | os.PathLike[str],
    plan: Plan,
    profile: ClusterProfile,
    device_sets: Mapping[tuple[int, ...], DeviceSetScore] | None = None,
) -> list[Path]:
    """Write the record files into ``folder`` (created; existing files replaced) and return
    their paths; a timeline that cannot be drawn is explained in ``why.txt`` instead."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "plan.json", out / "profile.json"]
    plan.to_json(written[0])
    profile.to_json(written[1])
    why = [plan.format_table()]
    if device_sets:
        why.append(format_device_sets(profile, device_sets, plan))
    timeline = out / "timeline.png"
    try:
        plan_timeline(plan, profile, timeline)
        written.append(timeline)
    except ImportError:
        why.append("timeline.png not drawn: pip install matplotlib")
    except Exception as error:  # a picture must not end the run that set-up has made ready
        why.append(f"timeline.png not drawn: {type(error).__name__}: {error}")
    (out / "why.txt").write_text("\n\n".join(why) + "\n", encoding="utf-8")
    written.append(out / "why.txt")
    return written
