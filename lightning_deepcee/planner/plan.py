"""The Plan: what the planner decided, in a form a user can print, save, diff and hand back.

This module owns two frozen records:

- :class:`StagePlan`: one pipeline stage, a contiguous half-open block range ``[start, end)``
  and the ranks that share it by (asymmetric) data parallelism, each with its share of every
  micro-batch.
- :class:`Plan`: the ordered stages, schedule, micro-batch count, global batch, the cost
  model's predictions, and the model's and cluster's fingerprints. JSON round-trip, a table
  (:meth:`Plan.format_table`) and :meth:`Plan.check_matches`, which refuses a saved plan that
  does not fit the current model or cluster.

A ``"compact"`` plan carries its schedule: the compact zero-bubble schedule is fitted to the
cluster's costs, so the planner stores the compute actions of every stage
(``stage_actions``) and every rank runs exactly those.

Pure: standard library only (plus the schedule package). A plan names every rank of the cluster
exactly once: in one stage, or in ``idle_ranks`` (a device the plan leaves out because the
cluster trains faster without it); block ranges are contiguous, in order, and cover every block.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_deepcee.planner.compression import check_hops
from lightning_deepcee.planner.stage_plan import (
    SHARE_TOLERANCE,
    StagePlan,
    checked_fields,
    compact_ranks,
    compact_shares,
    int_tuple,
    is_int,
    is_real,
)
from lightning_deepcee.schedule.actions import parse_actions
from lightning_deepcee.schedule.compact import COST_AWARE_SCHEDULE_KINDS
from lightning_deepcee.schedule.generators import StageSchedule, generate
from lightning_deepcee.schedule.lowering import lower
from lightning_deepcee.schedule.validate import validate

__all__ = ["SHARE_TOLERANCE", "Plan", "StagePlan", "compact_ranks"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A complete parallel plan: stages in pipeline order, schedule, batch split, predictions."""

    stages: tuple[StagePlan, ...]
    """Pipeline stages in order; stage ``s`` sends activations to stage ``s + 1``."""
    schedule: str
    """Schedule kind: one of :data:`~lightning_deepcee.schedule.SCHEDULE_KINDS`, or
    ``"compact"`` (the cost-fitted compact zero-bubble schedule, given in ``stage_actions``)."""
    num_microbatches: int
    """Micro-batches per optimizer step."""
    global_batch_size: int
    """Samples per optimizer step over the whole cluster (>= ``num_microbatches``)."""
    predicted_step_time_s: float
    """Cost model's step time (compute, non-overlapped transfers, all-reduce, optimizer)."""
    predicted_bubble_ratio: float
    """Cost model's idle share of stage-time in the pipeline (0 = no bubble)."""
    predicted_peak_memory_bytes: dict[int, int]
    """Cost model's peak memory per rank (parameters, gradients, Adam state, activations)."""
    model_fingerprint: str
    """Fingerprint of the model the plan was made for (see ``profiler.fingerprint``)."""
    cluster_fingerprint: str
    """Fingerprint of the device set the plan was made for."""
    notes: str = ""
    """Free text: why this plan won, which candidates were rejected."""
    stage_actions: tuple[str, ...] | None = None
    """``"compact"`` plans only: per stage, its compute actions in order, as text
    (``"0F0 0F1 0B0 0W0 ..."``, see :func:`~lightning_deepcee.schedule.format_actions`)."""
    num_replicas: int = 1
    """Data-parallel pipeline replicas, each reading its own shard of the data (a manual
    layout's ``num_stages`` below the process count). Every stage then lists one rank per
    replica, replica ``d`` running ``ranks[d]`` with equal shares. The planner's plans have one:
    devices sharing a stage split every micro-batch's rows instead."""
    idle_ranks: tuple[int, ...] = ()
    """Ranks of the cluster that hold no stage: they stay in the job (a later plan may use them)
    but compute nothing. ``notes`` says why (the predicted step with and without them)."""
    compute_bound_s: float | None = None
    """The compute bound of the devices the plan uses: the global batch's compute spread over
    their summed speed, with no bubble, transfer, fixed per-call cost or optimizer step. No plan
    on these devices can step faster (0 if their profile measured no per-sample compute).
    Set by the planner; ``None`` on a hand-made plan."""
    cluster_bound_s: float | None = None
    """The same bound over every device of the cluster, idle ones included."""
    step_parts_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Where the predicted step goes, in seconds, summing to it (set by the planner):
    ``"bound"`` (``compute_bound_s``), ``"imbalance"`` (the busiest stage's compute above the
    bound: uneven stages and fixed per-micro-batch costs), ``"stalls"`` (bubbles and dependency
    waits), ``"transfers"`` (activation hops not hidden behind compute), ``"allreduce"``,
    ``"optimizer"`` and ``"cpu_quota"`` (what a CPU quota adds above the rest)."""
    hop_compression: tuple[str, ...] = ()
    """Per hop (stage ``s`` to ``s + 1``), the method that compresses its float32 activations
    and their gradients (:mod:`~lightning_deepcee.planner.compression`); ``()`` when no hop is
    compressed (every hop ``"off"``: the step is exact)."""

    def __post_init__(self) -> None:
        stages = self.stages
        if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or not stages:
            raise ValueError(f"stages: expected a non-empty list of StagePlan, got {stages!r}")
        for index, stage in enumerate(stages):
            if not isinstance(stage, StagePlan):
                raise ValueError(
                    f"stages[{index}]: expected a StagePlan (use Plan.from_dict for plain dicts), "
                    f"got {stage!r}"
                )
        stages = tuple(stages)
        expected = 0
        for index, stage in enumerate(stages):
            start, end = stage.block_range
            if start != expected:
                raise ValueError(
                    f"stages[{index}].block_range: expected to start at block {expected} "
                    f"(stages are contiguous and in order), got [{start}, {end}); ranges: "
                    f"{[list(s.block_range) for s in stages]}"
                )
            expected = end
        seen: dict[int, int] = {}
        for index, stage in enumerate(stages):
            for rank in stage.ranks:
                if rank in seen:
                    raise ValueError(
                        f"stages[{index}].ranks: rank {rank} is already in stage {seen[rank]}; "
                        "each rank belongs to exactly one stage"
                    )
                seen[rank] = index
        idle = int_tuple("idle_ranks", self.idle_ranks) if self.idle_ranks else ()
        for rank in idle:
            if rank in seen or rank < 0 or idle.count(rank) > 1:
                raise ValueError(
                    f"idle_ranks: rank {rank} is negative, listed twice, or in stage "
                    f"{seen.get(rank)}; an idle rank holds no stage"
                )
        object.__setattr__(self, "idle_ranks", tuple(sorted(idle)))
        if self.schedule not in COST_AWARE_SCHEDULE_KINDS:
            raise ValueError(
                f"schedule: expected one of {', '.join(COST_AWARE_SCHEDULE_KINDS)}, got "
                f"{self.schedule!r}"
            )
        for name in ("num_microbatches", "global_batch_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        object.__setattr__(self, "stage_actions", self._checked_actions(len(stages)))
        object.__setattr__(self, "hop_compression", check_hops(self.hop_compression, len(stages)))
        self._check_replicas(stages)
        if self.global_batch_size < self.num_microbatches:
            raise ValueError(
                f"global_batch_size: {self.global_batch_size} samples cannot fill "
                f"{self.num_microbatches} micro-batches; lower num_microbatches to at most "
                f"{self.global_batch_size}"
            )
        for name in ("predicted_step_time_s", "predicted_bubble_ratio"):
            value = getattr(self, name)
            if not is_real(value) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: expected a non-negative finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        memory = self.predicted_peak_memory_bytes
        if not isinstance(memory, Mapping):
            raise ValueError(
                f"predicted_peak_memory_bytes: expected a mapping rank -> bytes, got {memory!r}"
            )
        memory_by_rank: dict[int, int] = {}
        for key, value in memory.items():
            rank = int(key) if isinstance(key, str) and key.strip().isdigit() else key
            if not is_int(rank) or rank not in seen or not is_int(value) or value < 0:
                raise ValueError(
                    f"predicted_peak_memory_bytes[{key!r}]: expected a rank of the plan "
                    f"({sorted(seen)}) mapped to a non-negative integer, got {value!r}"
                )
            memory_by_rank[int(rank)] = int(value)
        for name in ("compute_bound_s", "cluster_bound_s"):
            value = getattr(self, name)
            if value is not None:
                if not is_real(value) or not math.isfinite(value) or value < 0:
                    raise ValueError(f"{name}: expected a non-negative finite number, got {value}")
                object.__setattr__(self, name, float(value))
        parts = self.step_parts_s
        if not isinstance(parts, Mapping) or not all(
            isinstance(k, str) and is_real(v) and math.isfinite(v) for k, v in parts.items()
        ):
            raise ValueError(f"step_parts_s: expected a mapping name -> seconds, got {parts!r}")
        object.__setattr__(self, "step_parts_s", {k: float(v) for k, v in parts.items()})
        for name in ("model_fingerprint", "cluster_fingerprint", "notes"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}: expected a string, got {getattr(self, name)!r}")
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "predicted_peak_memory_bytes", memory_by_rank)

    def _check_replicas(self, stages: Sequence[StagePlan]) -> None:
        d = self.num_replicas
        if not is_int(d) or d < 1:
            raise ValueError(f"num_replicas: expected a positive integer, got {d!r}")
        if d > 1 and any(len(stage.ranks) != d for stage in stages):
            raise ValueError(
                f"num_replicas: {d} replicas need one rank per replica in every stage, got "
                f"{[len(stage.ranks) for stage in stages]} ranks per stage"
            )

    def _checked_actions(self, num_stages: int) -> tuple[str, ...] | None:
        actions = self.stage_actions
        if self.schedule != "compact":
            if actions is not None:
                raise ValueError(
                    f"stage_actions: only a 'compact' plan lists its actions; schedule "
                    f"{self.schedule!r} is generated (remove stage_actions)"
                )
            return None
        if (
            isinstance(actions, (str, bytes))
            or not isinstance(actions, Sequence)
            or len(actions) != num_stages
            or not all(isinstance(text, str) for text in actions)
        ):
            raise ValueError(
                f"stage_actions: a 'compact' plan needs one action string per stage "
                f"({num_stages}), got {actions!r}"
            )
        schedule: StageSchedule = {}
        for s, text in enumerate(actions):
            try:
                schedule[s] = parse_actions(text)
            except ValueError as exc:
                raise ValueError(f"stage_actions[{s}]: {exc}") from None
            wrong = [str(a) for a in schedule[s] if a.stage != s or not a.is_compute]
            if wrong:
                raise ValueError(
                    f"stage_actions[{s}]: expected compute actions (F, B, W, BW) of stage {s}, "
                    f"got {wrong[:3]}"
                )
        placement = {s: s for s in range(num_stages)}
        try:
            validate(lower(schedule, placement), placement, self.num_microbatches)
        except ValueError as exc:
            raise ValueError(f"stage_actions: not a valid schedule: {exc}") from None
        return tuple(actions)

    # ---------------------------------------------------------------------------------------
    # Views
    # ---------------------------------------------------------------------------------------

    def stage_schedule(self, num_microbatches: int | None = None) -> StageSchedule:
        """Compute actions per stage for ``num_microbatches`` (default: the plan's count).

        A ``"compact"`` plan's stored actions hold for its own micro-batch count only; for any
        other count (the adapter re-splitting) this returns ZB-H1, the zero-bubble schedule
        that needs no costs.
        """
        m = self.num_microbatches if num_microbatches is None else num_microbatches
        if self.schedule == "compact":
            if m == self.num_microbatches and self.stage_actions is not None:
                return {s: parse_actions(text) for s, text in enumerate(self.stage_actions)}
            return generate("zb-h1", self.num_stages, m)
        return generate(self.schedule, self.num_stages, m)

    # ---------------------------------------------------------------------------------------
    # Views of the layout
    # ---------------------------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages."""
        return len(self.stages)

    @property
    def num_blocks(self) -> int:
        """Number of model blocks the plan covers."""
        return self.stages[-1].block_range[1]

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank that holds a stage, sorted (``idle_ranks`` are the others)."""
        return tuple(sorted(rank for stage in self.stages for rank in stage.ranks))

    @property
    def world_ranks(self) -> tuple[int, ...]:
        """Every rank of the cluster the plan was made for: active and idle, sorted."""
        return tuple(sorted((*self.ranks, *self.idle_ranks)))

    @property
    def layout_key(self) -> tuple[object, ...]:
        """What makes two plans train alike: each stage's blocks and devices, the schedule, the
        micro-batch count and the hops' compression (not the batch shares, predictions or
        notes)."""
        stages = tuple((stage.block_range, stage.ranks) for stage in self.stages)
        return stages, self.schedule, self.num_microbatches, self.hop_compression

    def hop_method(self, hop: int) -> str:
        """The compression method of hop ``hop`` (stage ``hop`` to ``hop + 1``)."""
        return self.hop_compression[hop] if self.hop_compression else "off"

    @property
    def microbatch_size(self) -> float:
        """Mean samples per micro-batch (``global_batch_size / num_microbatches``)."""
        return self.global_batch_size / self.num_microbatches

    def replica_of(self, rank: int) -> int:
        """The data-parallel replica ``rank`` runs (0 unless ``num_replicas > 1``)."""
        return self.stages[self.stage_of(rank)].ranks.index(rank) if self.num_replicas > 1 else 0

    def stage_of(self, rank: int) -> int:
        """Index of the stage that ``rank`` belongs to."""
        for index, stage in enumerate(self.stages):
            if rank in stage.ranks:
                return index
        raise ValueError(f"rank: expected one of the plan's ranks {list(self.ranks)}, got {rank}")

    # ---------------------------------------------------------------------------------------
    # Checks against the current run
    # ---------------------------------------------------------------------------------------

    def check_matches(
        self,
        num_blocks: int,
        world_size: int,
        model_fingerprint: str | None = None,
        cluster_fingerprint: str | None = None,
    ) -> None:
        """Raise ``ValueError`` unless this (saved) plan fits the model and cluster of this run.

        A plan fits when it covers exactly ``num_blocks`` blocks, names each of the ranks
        ``0..world_size-1`` exactly once (in a stage or idle), and (when given) both
        fingerprints are equal.
        """
        problems = []
        if self.num_blocks != num_blocks:
            problems.append(f"it covers {self.num_blocks} blocks but the model has {num_blocks}")
        if list(self.world_ranks) != list(range(world_size)):
            problems.append(
                f"it names ranks {list(self.world_ranks)} but the world has {world_size} ranks "
                f"(0..{world_size - 1})"
            )
        if model_fingerprint is not None and model_fingerprint != self.model_fingerprint:
            problems.append(
                f"its model_fingerprint is {self.model_fingerprint!r} but the model's is "
                f"{model_fingerprint!r} (the model structure changed)"
            )
        if cluster_fingerprint is not None and cluster_fingerprint != self.cluster_fingerprint:
            problems.append(
                f"its cluster_fingerprint is {self.cluster_fingerprint!r} but the cluster's is "
                f"{cluster_fingerprint!r} (the hosts or ranks changed)"
            )
        if problems:
            raise ValueError(
                f"The saved plan does not fit this run: {'; '.join(problems)}. Re-plan (drop the "
                "saved plan so the planner searches again) or run on the model and cluster it "
                "was made for."
            )

    # ---------------------------------------------------------------------------------------
    # Serialisation
    # ---------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe dict (rank keys of the memory map become strings in JSON)."""
        return {
            "stages": [stage.to_dict() for stage in self.stages],
            "schedule": self.schedule,
            "num_microbatches": self.num_microbatches,
            "global_batch_size": self.global_batch_size,
            "predicted_step_time_s": self.predicted_step_time_s,
            "predicted_bubble_ratio": self.predicted_bubble_ratio,
            "predicted_peak_memory_bytes": {
                str(rank): value for rank, value in sorted(self.predicted_peak_memory_bytes.items())
            },
            "model_fingerprint": self.model_fingerprint,
            "cluster_fingerprint": self.cluster_fingerprint,
            "notes": self.notes,
            **({"stage_actions": list(self.stage_actions)} if self.stage_actions else {}),
            **({"num_replicas": self.num_replicas} if self.num_replicas != 1 else {}),
            **({"idle_ranks": list(self.idle_ranks)} if self.idle_ranks else {}),
            **{
                name: getattr(self, name)
                for name in ("compute_bound_s", "cluster_bound_s")
                if getattr(self, name) is not None
            },
            **({"step_parts_s": dict(self.step_parts_s)} if self.step_parts_s else {}),
            **({"hop_compression": list(self.hop_compression)} if self.hop_compression else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Inverse of :meth:`to_dict`; unknown or missing fields are errors."""
        fields = checked_fields(data, cls, "Plan")
        raw = fields["stages"]
        if isinstance(raw, Sequence) and not isinstance(raw, (str, bytes)):
            stages = []
            for index, item in enumerate(raw):
                try:
                    stages.append(StagePlan.from_dict(item))
                except (ValueError, TypeError) as exc:
                    raise ValueError(f"stages[{index}]: {exc}") from None
            fields["stages"] = tuple(stages)
        return cls(**fields)

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write as indented strict JSON."""
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False)
        Path(path).write_text(text + "\n", encoding="utf-8")

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a file written by :meth:`to_json`."""
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))

    def format_bound(self) -> str:
        """How far the prediction is from the compute bounds, and where the step goes (empty
        when the planner did not set them)."""
        if self.compute_bound_s is None:
            return ""
        step = self.predicted_step_time_s
        used = len(self.ranks)
        text = (
            f"compute bound: {self.compute_bound_s * 1e3:.2f} ms on its {used} devices "
            f"(predicted step at {self.compute_bound_s / step:.0%} of it)"
        )
        if self.cluster_bound_s is not None:
            total = used + len(self.idle_ranks)
            text += (
                f", {self.cluster_bound_s * 1e3:.2f} ms on all {total} devices "
                f"({self.cluster_bound_s / step:.0%})"
            )
        if self.step_parts_s:
            parts = ", ".join(
                f"{name} {seconds * 1e3:.2f} ms ({seconds / step:.0%})"
                for name, seconds in self.step_parts_s.items()
                if seconds * 1e3 >= 0.005
            )
            text += f"\nwhere the step goes: {parts}"
        return text

    def format_table(self) -> str:
        """A summary line and one row per stage: blocks, ranks, shares, peak memory."""
        header = ["stage", "blocks", "ranks", "shares", "peak_mem_GiB"]
        rows = [header]
        for index, stage in enumerate(self.stages):
            start, end = stage.block_range
            peak = max(self.predicted_peak_memory_bytes.get(r, 0) for r in stage.ranks)
            rows.append(
                [
                    str(index),
                    f"{start}-{end - 1}",
                    compact_ranks(stage.ranks),
                    compact_shares(stage.batch_shares),
                    f"{peak / 2**30:.2f}",
                ]
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [
            "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip() for r in rows
        ]
        lines.insert(1, "  ".join("-" * width for width in widths))
        summary = (
            f"schedule={self.schedule} microbatches={self.num_microbatches} "
            f"global_batch={self.global_batch_size} "
            f"predicted_step={self.predicted_step_time_s * 1e3:.2f} ms "
            f"bubble={self.predicted_bubble_ratio:.1%}"
        )
        if self.num_replicas > 1:
            summary += f" replicas={self.num_replicas}"
        if self.idle_ranks:
            summary += f" idle={compact_ranks(self.idle_ranks)}"
        if self.hop_compression:
            hops = (f"{h}->{h + 1} {m}" for h, m in enumerate(self.hop_compression) if m != "off")
            summary += f" compressed={','.join(hops)}"
        out = [summary, *lines]
        bound = self.format_bound()
        if bound:
            out.append(bound)
        if self.notes:
            out.append(f"notes: {self.notes}")
        return "\n".join(out)
