"""Cost model: predicted step time, bubble ratio and memory of a plan on a measured cluster.

This module states the model and owns its functional API: :func:`predict`,
:func:`predict_plan`, :func:`stage_costs`, :func:`transfer_time_s`, :func:`allreduce_time_s`,
:func:`speed_shares` and :func:`in_flight_microbatches`. Each call builds an
:class:`~lightning_deepcee.planner.evaluator.Evaluator` (the arithmetic, with the profile's
arrays and memos); code that asks many questions of one profile, like the search, holds one
evaluator instead. The model, stated once:

- **Compute is affine in the micro-batch size.** Device ``d`` spends, on block ``k``, a fixed
  ``fixed_s[d][k]`` per call (kernel launches, dispatch: what a small micro-batch cannot shrink)
  plus ``(block_s[d][k] - fixed_s[d][k]) / reference_microbatch_size`` per sample; the fixed part
  is split over F, B and W in proportion to their times. With ``fixed_s = 0`` (hand-written
  profiles) this is linear. The fixed part is what makes many tiny micro-batches slow: the planner
  sees it and picks fewer, larger ones (or no pipeline) where dispatch dominates.
- **Asymmetric data parallelism.** A stage shared by several devices takes, for each micro-batch,
  the maximum over its devices of ``fixed_d + share_d * microbatch_size * per_sample_s[d]``:
  devices run their rows in parallel and the stage is done when the slowest is. Shares
  proportional to speed (whole F+B+W time per sample at the measured size) make every device
  finish together (see :func:`speed_shares`). Rows are whole samples: the runtime rounds each
  micro-batch towards the shares of the whole step
  (:func:`~lightning_deepcee.runtime.rows.split_step_rows`), so ``share_d * microbatch_size`` is
  each device's *mean* rows per micro-batch, exact over the step to within one row. A device
  whose mean is below one row holds a row in that fraction of the micro-batches and pays its
  fixed cost only then (``min(1, rows) * fixed_d``).
- **Runtime overhead.** Every executor action (a compute call, a send, a receive) costs the device
  one mean per-call fixed cost (its measured ``fixed_s`` over all blocks, per F, B or W call) on
  top of its compute: per micro-batch, F and B with their receive and send (none across the
  pipeline's ends) and W. Negligible on a fast device; on a slow one (a small CPU quota) the
  executor's dispatch, the B/W split and the message handling cost as much as a small block, which
  block compute alone does not show, so plans with many micro-batch actions there would be
  predicted too fast without this term. It is only as good as the measured ``fixed_s``, which a
  short CPU-quota period makes noisy. With ``fixed_s = 0`` (hand-written profiles) there is no
  overhead.
- **One backward pass.** A BW action (1F1B, GPipe) runs a micro-batch's backward in one call,
  which costs less than B then W (two walks over the graph): it is charged the blocks'
  ``backward_s`` (measured by the profiler; ``B + W`` where not measured) and one action. What
  it saves is a cost per call, the same at every micro-batch size: its slope is B + W's, its
  fixed part theirs less the saving. The
  first stage runs its backward whole in every schedule (nothing upstream needs its input
  gradient): its B only dispatches, its W is that one pass.
- **Activation transfers.** Between consecutive stages a micro-batch's boundary activation
  (``activation_bytes`` of the sending stage's last block, per sample, times the micro-batch size)
  moves once forward and its gradient once backward. Rows are laid out by shares on both sides, so
  sender ``i`` talks to receiver ``j`` only where their row intervals overlap; each such pair costs
  ``latency_ij + overlap_bytes / bandwidth_ij``. A device's messages are serialised (it sends or
  receives them one after another), and the hop takes the maximum over devices of that sum. With one
  device per stage this is exactly ``ClusterProfile.transfer_time_s``; with several it is
  conservative, since concurrent messages on distinct links are not overlapped. Messages between two
  *network groups* (:func:`~lightning_deepcee.profiler.group_by_network`) share the WAN link between
  them: their bytes together take at least ``bytes / capacity``, where the capacity is the median
  pair measured between the two groups (the profiler measures those pairs one at a time, so each is
  a reading of the whole WAN link; the fastest reading can carry a traffic shaper's burst
  allowance, which a sustained step does not get). Two cloud devices sending halves of a
  micro-batch to two edge devices take as long as one device sending all of it.
- **Pipeline.** The schedule is generated, lowered with one simulated rank per stage, validated
  and simulated (:mod:`lightning_deepcee.schedule.simulate`); the simulator overlaps transfers
  with compute exactly as far as the schedule order allows.
- **CPU quotas.** A device whose profile records a quota (``cpu_share < 1`` with a
  ``cpu_period_s``: a container's CPU limit, which the profiler reads from the process's cgroup)
  is simulated as a token bucket: its measured times hold while it computes without pause, and
  what it leaves unused while it waits for a message lets its next actions run at full speed
  (see the simulator's docstring). A stage takes the quota of its slowest device. Without it,
  every wait would be charged at the sustained speed and schedules that wait (ZB-H1 with few
  micro-batches) would be predicted too slow.
- **Host CPU under a quota.** A quota-limited device also spends CPU outside its blocks: the
  Lightning loop, hooks and logging, and the handling of every byte it sends or receives
  (activations, their gradients, the stage's all-reduce). At its quota that CPU costs
  ``cpu / cpu_share`` of wall time, and the device cannot finish a step sooner than its compute
  (at sustained speed), its optimizer step and that host time together: the step is at least the
  slowest such device's sum (``Prediction.cpu_floor_s``). The host CPU is
  ``CostModelConfig.host_cpu_s_per_step + host_cpu_s_per_byte * bytes``, constants fitted to
  measured runs, not measured per device. Without this floor a stage that gives a slow
  quota-limited device to itself looks free of the work outside its blocks, which at a small
  quota can be the whole step. Devices without a quota are not charged (a host that is not held
  back does that work in its waits).
- **Compression.** A hop may carry its float32 activation and gradient compressed
  (``Plan.hop_compression``; :mod:`~lightning_deepcee.planner.compression`): its bytes shrink
  by the method's ratio, and each of its two stages pays an encode and a decode per
  micro-batch, ``cost_factor`` times its slowest device's optimizer seconds per byte per value
  of its share, half on F and half on B (:mod:`~lightning_deepcee.planner.hops`). The search
  picks, per hop, the allowed method that moves the hop fastest with its codec time
  (``CostModelConfig.compression``), a lossier one only where that saves more than 5% of the
  hop's stages' compute; the host-CPU floor counts the compressed bytes.
- **All-reduce.** After its last W, each stage's group all-reduces its gradients with a ring:
  ``2 (n-1)/n * parameter_bytes / min_bandwidth + 2 (n-1) * max_latency`` over the group's pairs.
  The slowest stage's all-reduce is added to the step.
- **Optimizer.** Each device's measured seconds per parameter byte of an Adam step
  (``DeviceProfile.optimizer_s_per_byte``; ``CostModelConfig.optimizer_s_per_byte`` where not
  measured) times its stage's parameter bytes; the slowest device's is added. Every device of
  a stage updates the whole stage. A measured rate matters: small devices are several times
  slower than the constant's memory bandwidth.
- **Memory.** Per device, ``parameter_bytes * state_copies`` (weights, gradients, two Adam
  moments) plus the simulator's peak of what its stage holds: for every micro-batch in flight
  (from its F to its W or BW) the bytes its blocks save for backward, and, for the micro-batch
  being computed, the largest transient of its blocks; both per sample
  (``DeviceProfile.saved_bytes`` and ``transient_bytes``) times the whole rows the device holds
  of the largest micro-batch (compute is charged by its mean rows). A profile without them
  holds each block's output (``activation_bytes``) and no transient, which undercounts a
  transformer layer many times over.

``step_time_s = simulated pipeline + slowest stage all-reduce + optimizer``, or the CPU floor
when that is longer. See ``docs/planner.md`` for the correspondence with DeepCEE's Eq. 1.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_deepcee.planner.evaluator import Evaluator, in_flight_microbatches
from lightning_deepcee.planner.plan import Plan, StagePlan
from lightning_deepcee.planner.prediction import CostModelConfig, Prediction
from lightning_deepcee.profiler.data import ClusterProfile
from lightning_deepcee.schedule.generators import StageSchedule
from lightning_deepcee.schedule.simulate import StageCosts

__all__ = [
    "CostModelConfig",
    "Prediction",
    "allreduce_time_s",
    "in_flight_microbatches",
    "predict",
    "predict_plan",
    "speed_shares",
    "stage_costs",
    "transfer_time_s",
]


def transfer_time_s(
    profile: ClusterProfile, sender: StagePlan, receiver: StagePlan, num_bytes: float
) -> float:
    """Seconds to move ``num_bytes`` (one whole micro-batch's tensor) from one stage to another.

    Rows are split by shares on both sides; each overlapping (sender, receiver) pair costs
    ``latency + overlap_bytes / bandwidth`` on its directed link; a device's messages are
    serialised; the result is the maximum over devices of that sum (see the module docstring).
    """
    return Evaluator(profile).transfer_time_s(sender, receiver, num_bytes)


def allreduce_time_s(profile: ClusterProfile, ranks: Sequence[int], num_bytes: float) -> float:
    """Ring all-reduce of ``num_bytes`` among ``ranks``; 0 for a single rank.

    ``2 (n-1)/n * num_bytes / min_bandwidth + 2 (n-1) * max_latency``, with the minimum
    bandwidth and maximum latency over every ordered pair of the group (the ring order is not
    known to the planner, so the slowest pair bounds every hop).
    """
    return Evaluator(profile).allreduce_time_s(ranks, num_bytes)


def speed_shares(
    profile: ClusterProfile,
    ranks: Sequence[int],
    block_range: tuple[int, int],
    *,
    microbatch_size: float,
    in_flight: int,
    config: CostModelConfig | None = None,
    bounded_by_memory: bool = True,
) -> tuple[float, ...] | None:
    """Batch shares proportional to each device's speed on ``block_range``, bounded by memory.

    Device ``d``'s share is capped at what its memory holds after the stage's parameter state:
    ``(memory_bytes - state_copies * parameter_bytes) / (microbatch_size * (in_flight *
    saved_bytes + transient_bytes))``, bytes per sample of the stage (see *Memory* above); the
    rest of the batch is redistributed in proportion to the
    speed of the uncapped devices (water filling). ``None`` when the devices cannot hold the stage
    at all. ``bounded_by_memory=False`` gives the plain speed-proportional shares.
    """
    return Evaluator(profile, config).speed_shares(
        ranks,
        block_range,
        microbatch_size=microbatch_size,
        in_flight=in_flight,
        bounded_by_memory=bounded_by_memory,
    )


def stage_costs(
    profile: ClusterProfile, stages: Sequence[StagePlan], *, microbatch_size: float
) -> StageCosts:
    """Simulator costs of one micro-batch of ``microbatch_size`` samples on each stage.

    ``activation_bytes`` is what a whole micro-batch saves for backward on the stage and
    ``transient_bytes`` what it needs beyond that while it computes (each device holds its share
    of both); ``static_memory_bytes`` is left unset (added per device by :func:`predict`).
    """
    return Evaluator(profile).stage_costs(stages, microbatch_size=microbatch_size)


def predict(
    profile: ClusterProfile,
    stages: Sequence[StagePlan],
    schedule: str,
    num_microbatches: int,
    global_batch_size: int,
    *,
    config: CostModelConfig | None = None,
    stage_schedule: StageSchedule | None = None,
) -> Prediction:
    """Predict one optimizer step of ``stages`` under ``schedule`` (see the module docstring).

    The micro-batch size is ``global_batch_size / num_microbatches`` samples (the mean, when
    the division is not exact). ``schedule="compact"`` needs its actions in ``stage_schedule``
    (:meth:`Plan.stage_schedule <lightning_deepcee.planner.Plan.stage_schedule>`); the other
    kinds are generated.
    """
    return Evaluator(profile, config).predict(
        stages, schedule, num_microbatches, global_batch_size, stage_schedule=stage_schedule
    )


def predict_plan(
    profile: ClusterProfile, plan: Plan, *, config: CostModelConfig | None = None
) -> Prediction:
    """:func:`predict` of a saved or running ``plan`` (a compact plan with its own actions) on
    ``profile``: the same figure the search gave it when ``profile`` is the one it was made on."""
    return Evaluator(profile, config).predict_plan(plan)
