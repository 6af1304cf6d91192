"""A Plan as text: the one-line layout of the logs and the table printed at setup.

No torch.distributed: reads the plan, the blocks' parameter counts and the lowered schedule.
"""

from __future__ import annotations

from lightning_deepcee.planner.plan import Plan
from lightning_deepcee.runtime.stage import PipelineSpec
from lightning_deepcee.schedule import lower, render

__all__ = ["describe", "layout_line"]


def layout_line(plan: Plan, num_microbatches: int) -> str:
    """``[0, 3) on 0 | [3, 6) on 1,2 (0.50,0.50); 1f1b, 2 micro-batches`` for the logs."""
    parts = []
    for st in plan.stages:
        a, b = st.block_range
        part = f"[{a}, {b}) on {','.join(str(r) for r in st.ranks)}"
        if len(st.ranks) > 1 and plan.num_replicas == 1:
            part += " (" + ",".join(f"{x:.2f}" for x in st.batch_shares) + ")"
        parts.append(part)
    return " | ".join(parts) + f"; {plan.schedule}, {num_microbatches} micro-batches"


def describe(plan: Plan, spec: PipelineSpec, num_microbatches: int) -> str:
    """The partition and schedule, as printed at setup."""
    blocks = list(spec.blocks)
    lines = [
        f"DeepCEEStrategy: {plan.num_stages} stages x {plan.num_replicas} replica(s), "
        f"schedule {plan.schedule}, {num_microbatches} micro-batches",
        "  stage | blocks      | ranks        | parameters",
    ]
    for s, st in enumerate(plan.stages):
        a, b = st.block_range
        n = sum(p.numel() for blk in blocks[a:b] for p in blk.parameters())
        ranks = ",".join(str(r) for r in st.ranks)
        lines.append(f"  {s:>5} | [{a:>3}, {b:>3}) | {ranks:<12} | {n:,}")
    placement = {s: s for s in range(plan.num_stages)}
    lines.append("  schedule (stage | actions):")
    grid = render(lower(plan.stage_schedule(num_microbatches), placement), compute_only=True)
    lines.extend("    " + line for line in grid.splitlines())
    return "\n".join(lines)
