"""DeepCEEStrategy under Lightning equals single-process training, parameter by parameter.

Each test launches one ``torchrun`` job (the multi-node environment-variable path) that trains
the tiny model once per config; the parameters after several optimizer steps must equal a
single-process Lightning run on the whole batch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_deepcee.planner import Plan, StagePlan
from lightning_deepcee.profiler import ClusterProfile
from lightning_deepcee.runtime.measure import model_fingerprint
from tests.helpers.equivalence import assert_same_params, fit_reference, merged_ranks
from tests.helpers.launch import launch_fit
from tests.helpers.models import TinyNet

pytestmark = pytest.mark.multiprocess


def _replica_batches(num_samples: int, replicas: int, per_replica: int) -> list[list[int]]:
    """The global batches that ``replicas`` DistributedSampler shards (shuffle, seed 0) form."""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(0)).tolist()
    shards = [order[r::replicas] for r in range(replicas)]
    steps = len(shards[0]) // per_replica
    return [
        [i for shard in shards for i in shard[k * per_replica : (k + 1) * per_replica]]
        for k in range(steps)
    ]


GRID = [
    (kind, m) for kind in ("gpipe", "1f1b", "zb-h1") for m in (1, 3, 4)
]  # batch 10 into 3 or 4 micro-batches: uneven (4, 3, 3) and (3, 3, 2, 2)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_schedules_match_single_process(tmp_path: Path, world: int) -> None:
    configs: list[dict[str, Any]] = [
        {"name": f"{kind}-m{m}", "schedule": kind, "num_microbatches": m, "steps": 4}
        for kind, m in GRID
    ]
    # Explicit uneven partition, SGD with momentum and global-norm clipping that bites.
    configs.append(
        {"name": "clip", "schedule": "zb-h1", "num_microbatches": 4, "steps": 4, "clip": 0.05,
         "optimizer": "sgd", "partition": [1] * (world - 1) + [6 - (world - 1)]}
    )  # fmt: skip
    launch_fit(world, configs, tmp_path)
    ref = fit_reference(4)
    for kind, m in GRID:
        assert_same_params(merged_ranks(tmp_path / f"{kind}-m{m}", world), ref)
    assert_same_params(
        merged_ranks(tmp_path / "clip", world), fit_reference(4, clip=0.05, optimizer="sgd")
    )


def test_accumulation_and_evaluation_after_fit_match_single_process(tmp_path: Path) -> None:
    """accumulate_grad_batches=2 steps once per two batches on their summed gradient, exactly
    as one process does; validate() and test() after fit (default partition, 3 stages) run the
    layout that trained and log the single-process losses; a model error on one rank is what
    every rank reports."""
    configs: list[dict[str, Any]] = [
        {"name": "accumulate", "schedule": "1f1b", "num_microbatches": 3, "steps": 3,
         "accumulate": 2},
        {"name": "evaluate", "schedule": "zb-h1", "num_microbatches": 2, "steps": 4,
         "validate_after": True, "fresh_partition": [1, 1, 4]},
        # SGD: the bias before a BatchNorm has a gradient of float noise, which Adam would
        # scale up to a full step.
        {"name": "bn-exact", "schedule": "1f1b", "num_microbatches": 1, "steps": 3,
         "batch_norm": True, "optimizer": "sgd"},
        # Last: a step that fails mid-way leaves the process group unusable.
        {"name": "badloss", "schedule": "1f1b", "num_microbatches": 2, "expect_error": True,
         "non_scalar_loss": True},
    ]  # fmt: skip
    launch_fit(3, configs, tmp_path)
    # BatchNorm with whole batches and one device per stage: exact, running statistics too.
    assert_same_params(
        merged_ranks(tmp_path / "bn-exact", 3), fit_reference(3, optimizer="sgd", batch_norm=True)
    )
    # Shared stage 0 (ranks 0 and 1 split the rows): the two devices' running statistics stay
    # identical (_merged compares the copies bit for bit).
    shared = [
        {"name": "bn-shared", "plan": _asymmetric_plan(tmp_path / "bn.json", batch_norm=True),
         "steps": 3, "batch_norm": True, "batch_size": 20, "num_samples": 60},
    ]  # fmt: skip
    launch_fit(4, shared, tmp_path)
    merged = merged_ranks(tmp_path / "bn-shared", 4)
    assert int(merged["inp.1.num_batches_tracked"]) == 9  # 3 steps x 3 micro-batches
    assert_same_params(merged_ranks(tmp_path / "accumulate", 3), fit_reference(3, accumulate=2))
    # A model error on the last stage (rank 2): every rank names that rank and its error, and
    # none reports a lost device.
    for rank in range(3):
        text = (tmp_path / "badloss" / f"error_rank{rank}.txt").read_text()
        assert "loss_fn must return a scalar" in text, (rank, text)
        assert "DeviceLostError" not in text, (rank, text)
        if rank != 2:
            assert text.startswith("RankFailedError: DeepCEEStrategy: rank 2 (stage 2"), text
    evaluation: dict[str, float] = {}
    train_metrics: dict[str, float] = {}
    predictions: list[torch.Tensor] = []
    reference = fit_reference(
        4, evaluation=evaluation, train_metrics=train_metrics, predictions=predictions
    )
    assert_same_params(merged_ranks(tmp_path / "evaluate", 3), reference)
    # The module's torchmetrics accuracy (PipelineSpec.metrics_fn) is logged on every rank with
    # the value its own steps log in one process.
    assert set(evaluation) == {"val_loss", "val_acc", "test_loss", "test_acc"}
    assert {"train_acc_step", "train_acc_epoch"} <= set(train_metrics)
    for rank in range(3):
        got = json.loads((tmp_path / "evaluate" / f"rank{rank}_eval.json").read_text())
        assert got.keys() == evaluation.keys()
        for name, value in evaluation.items():
            assert got[name] == pytest.approx(value, rel=1e-5), (rank, name)
        trained = json.loads((tmp_path / "evaluate" / f"rank{rank}_train_metrics.json").read_text())
        for name in ("train_acc_step", "train_acc_epoch"):
            assert trained[name] == pytest.approx(train_metrics[name], rel=1e-5), (rank, name)
        # predict(): the module's predict_step on the pipeline's output, on every rank.
        predicted = torch.load(tmp_path / "evaluate" / f"rank{rank}_predict.pt")
        torch.testing.assert_close(predicted, predictions[0], rtol=1e-5, atol=1e-6)
        # validate() and predict() without fit, from the pipeline checkpoint, on another
        # partition: the same values.
        again = json.loads((tmp_path / "evaluate" / f"rank{rank}_eval_ckpt.json").read_text())
        for name in ("val_loss", "val_acc"):
            assert again[name] == pytest.approx(evaluation[name], rel=1e-5), (rank, name)
        predicted = torch.load(tmp_path / "evaluate" / f"rank{rank}_predict_ckpt.pt")
        torch.testing.assert_close(predicted, predictions[0], rtol=1e-5, atol=1e-6)


def _asymmetric_plan(path: Path, batch_norm: bool = False) -> str:
    """Stage 0 shared by ranks 0 and 1 (60/40 rows), then rank 2, then rank 3."""
    stages = (
        StagePlan(block_range=(0, 2), ranks=(1, 0), batch_shares=(0.6, 0.4)),
        StagePlan(block_range=(2, 5), ranks=(3,), batch_shares=(1.0,)),
        StagePlan(block_range=(5, 6), ranks=(2,), batch_shares=(1.0,)),
    )
    plan = Plan(
        stages=stages,
        schedule="zb-h1",
        num_microbatches=3,
        global_batch_size=10,
        predicted_step_time_s=1.0,
        predicted_bubble_ratio=0.0,
        predicted_peak_memory_bytes={r: 0 for r in range(4)},
        model_fingerprint=model_fingerprint(
            TinyNet(batch_norm=batch_norm).configure_pipeline().blocks
        ),
        cluster_fingerprint="",
    )
    plan.to_json(path)
    return str(path)


def _compact_plan(path: Path) -> str:
    """The asymmetric layout above under a compact schedule fitted to unequal stage costs."""
    from lightning_deepcee.schedule import StageCosts, compact_zero_bubble, format_actions

    costs = StageCosts(
        forward_s=(1.0, 3.0, 0.5), backward_input_s=(1.0, 3.0, 0.5),
        backward_weight_s=(2.0, 1.0, 0.5), activation_bytes=(0, 0, 0),
        send_forward_s=(0.2, 4.0), send_backward_s=(0.2, 4.0),
    )  # fmt: skip
    schedule = compact_zero_bubble(costs, 3, max_in_flight=[3, 3, 3])
    plan = Plan.from_json(_asymmetric_plan(path))
    data = plan.to_dict() | {"schedule": "compact"}
    data["stage_actions"] = [format_actions(schedule[s]) for s in range(3)]
    Plan.from_dict(data).to_json(path)
    return str(path)


def test_resume_consolidate_replicas_bf16_and_errors(tmp_path: Path) -> None:
    world = 4
    configs: list[dict[str, Any]] = [
        # A saved plan with asymmetric data parallelism inside stage 0 (receives posted when
        # the schedule reaches them; every other run receives ahead, the default).
        {"name": "plan", "plan": _asymmetric_plan(tmp_path / "plan.json"), "steps": 3,
         "receive_ahead": False, "monitor": True},
        # The same layout with a fitted compact schedule; re-split to 4 micro-batches (ZB-H1)
        # for one step and back to the plan's 3 (its own actions again).
        {"name": "compact", "plan": _compact_plan(tmp_path / "compact.json"), "steps": 4,
         "change_microbatches": [[1, 4], [2, 3]], "monitor": True},
        # The adapter's fast response changes the split between steps: still exact.
        {"name": "resplit", "schedule": "zb-h1", "num_microbatches": 2, "steps": 4,
         "change_microbatches": [[1, 4], [2, 3], [3, 2]]},
        # The adapter itself running (calibrates, watches every link, may decide).
        {"name": "adapter", "schedule": "1f1b", "num_microbatches": 2, "steps": 6,
         "adapter": True},
        # DeepCEEStrategy() with no layout argument: profile, search a plan, run it.
        {"name": "auto", "steps": 3},
        {"name": "resume", "schedule": "1f1b", "num_microbatches": 3, "resume": True},
        {"name": "cons", "schedule": "gpipe", "num_microbatches": 2, "steps": 3,
         "consolidate": True},
        # 2 stages x 2 data-parallel replicas, each reading its own shard of the data.
        {"name": "replicas", "schedule": "zb-h1", "num_microbatches": 3, "steps": 3,
         "num_stages": 2, "batch_size": 10, "num_samples": 60},  # 10 per replica, 20 per step
        # Stages placed against rank order (as the planner does to follow the network).
        {"name": "placed", "schedule": "zb-h1", "num_microbatches": 3, "steps": 3,
         "placement": [[2], [0], [3], [1]]},
        # Profiling at setup measures blocks and links without disturbing training.
        {"name": "profiled", "schedule": "1f1b", "num_microbatches": 2, "steps": 3,
         "profile": True},
        {"name": "bf16", "schedule": "zb-h1", "num_microbatches": 2, "steps": 3,
         "precision": "bf16-mixed"},
        {"name": "toomany", "schedule": "1f1b", "num_microbatches": 2, "num_blocks": 3,
         "expect_error": True},
        {"name": "versions", "schedule": "1f1b", "expect_error": True,
         "fake_version_on_rank": 2},
        {"name": "smallbatch", "schedule": "1f1b", "num_microbatches": 4, "batch_size": 3,
         "num_samples": 6, "expect_error": True},
        # Manual optimization is refused at setup on every rank (it used to hang).
        {"name": "manual", "schedule": "1f1b", "num_microbatches": 2, "expect_error": True,
         "manual_optimization": True},
    ]  # fmt: skip
    launch_fit(world, configs, tmp_path)
    # Resume after one epoch (3 steps) equals the uninterrupted 6-step run.
    assert_same_params(merged_ranks(tmp_path / "resume", world), fit_reference(6))
    # Consolidated checkpoint loads into the unsplit module and equals the trained shards.
    consolidated = torch.load(tmp_path / "cons" / "consolidated.pt")
    TinyNet().load_state_dict(consolidated, strict=True)
    assert_same_params(consolidated, merged_ranks(tmp_path / "cons", world), rtol=0, atol=0)
    assert_same_params(consolidated, fit_reference(3))
    assert_same_params(
        merged_ranks(tmp_path / "replicas", world),
        fit_reference(3, num_samples=60, batch_sampler=_replica_batches(60, 2, per_replica=10)),
    )
    assert_same_params(merged_ranks(tmp_path / "placed", world), fit_reference(3))
    assert_same_params(merged_ranks(tmp_path / "plan", world), fit_reference(3))
    # Ranks 0 and 1 share stage 0 and sum its gradients; ranks 2 and 3 have nothing to sum.
    sync = [
        json.loads((tmp_path / "plan" / f"rank{r}_stats.json").read_text()) for r in range(world)
    ]
    assert all(0 < s["grad_sync_s"] < s["wall_s"] for s in sync[:2]), sync
    assert all(s["grad_sync_s"] == 0 for s in sync[2:]), sync
    # The monitor compares the plan's prediction (1 s) with steps 2 and 3 (step 1 is warm-up).
    check = sync[0]["cost_model"]
    assert sync[0]["compared_steps"] == 2 and check["deepcee/predicted_step_s"] == 1.0, sync
    assert 0 < 1 / (1 + check["deepcee/cost_model_error"]) < 1.0, check  # measured, in seconds
    # Compact: step 1 is warm-up, step 2 runs 4 micro-batches (not the plan), step 3 is the
    # plan's again (skipped as a change), so only step 4 is compared with the prediction.
    compact = json.loads((tmp_path / "compact" / "rank0_stats.json").read_text())
    assert compact["compared_steps"] == 1, compact
    assert compact["cost_model"]["deepcee/predicted_step_s"] == 1.0, compact
    assert_same_params(merged_ranks(tmp_path / "compact", world), fit_reference(4))
    assert_same_params(merged_ranks(tmp_path / "resplit", world), fit_reference(4))
    assert_same_params(merged_ranks(tmp_path / "adapter", world), fit_reference(6))
    assert_same_params(merged_ranks(tmp_path / "auto", world), fit_reference(3))
    assert_same_params(merged_ranks(tmp_path / "profiled", world), fit_reference(3))
    profile = ClusterProfile.from_yaml(tmp_path / "profiled" / "profile.yaml")
    assert profile.num_devices == world and profile.num_blocks == 6
    assert all(min(d.forward_s) > 0 for d in profile.devices)
    # bf16 autocast: same trajectory as single-process bf16-mixed within bf16 rounding.
    assert_same_params(
        merged_ranks(tmp_path / "bf16", world), fit_reference(3, precision="bf16-mixed"), 2e-2, 2e-2
    )
    err = (tmp_path / "toomany" / "error.txt").read_text()
    assert "4 pipeline stages" in err and "only 3 blocks" in err
    err = (tmp_path / "versions" / "error.txt").read_text()
    assert "package versions differ across ranks" in err and "0.0.0+other" in err
    for rank in range(world):
        err = (tmp_path / "manual" / f"error_rank{rank}.txt").read_text()
        assert "automatic_optimization = False" in err and "strategy='ddp'" in err, err
    err = (tmp_path / "smallbatch" / "error.txt").read_text()
    assert "cannot be split into 4 micro-batches" in err


def test_elastic_restart_on_fewer_devices(tmp_path: Path) -> None:
    """Save after one epoch on 4 devices; resume on 3 with another partition and schedule: the
    checkpoint is re-partitioned (weights and optimizer state) and training continues exactly."""
    launch_fit(
        4,
        [{"name": "el4", "schedule": "1f1b", "num_microbatches": 3, "save_epoch_to": "el.ckpt"}],
        tmp_path,
    )
    launch_fit(
        3,
        [{"name": "el3", "schedule": "zb-h1", "num_microbatches": 2, "partition": [3, 2, 1],
          "resume_from": "el.ckpt"}],
        tmp_path,
    )  # fmt: skip
    assert_same_params(merged_ranks(tmp_path / "el3", 3), fit_reference(6))
