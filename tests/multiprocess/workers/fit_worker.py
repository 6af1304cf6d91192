"""Worker for the Lightning equivalence tests; run under torchrun (one process per stage).

    torchrun --nproc_per_node=N tests/multiprocess/workers/fit_worker.py OUT_DIR CONFIGS_JSON

(the repository on PYTHONPATH, as ``tests.helpers.launch.torchrun`` sets it)

For each config it trains the small test model with DeepCEEStrategy and writes every rank's
trained parameters (global names) to ``OUT_DIR/<name>/rank<r>.pt``; a config with
``"expect_error"`` records the error message instead. The test process compares with a
single-process reference run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

import lightning_deepcee
import lightning_deepcee.planner.rivals as rivals_module
import lightning_deepcee.runtime.spread_search as plan_spread_module
import lightning_deepcee.strategy.plan_trial as plan_trial
from lightning_deepcee import DeepCEEStrategy, DynamicEnvironmentAdapter, PipelineThroughputMonitor
from tests.helpers.models import TinyNet, make_loader
from tests.helpers.workers import QUIET, run_configs, save_consolidated, save_params

warnings.filterwarnings("ignore")


def make_trainer(cfg: dict[str, Any], root: Path, **overrides: Any) -> pl.Trainer:
    strategy = DeepCEEStrategy(
        plan=cfg.get("plan"),
        schedule=cfg.get("schedule"),
        num_microbatches=cfg.get("num_microbatches"),
        partition=cfg.get("partition"),
        num_stages=cfg.get("num_stages"),
        placement=cfg.get("placement"),
        profile_cache=str(root / "profile.yaml") if cfg.get("profile") else None,
        verbose=cfg.get("verbose", False),
        process_group_backend=cfg.get("backend"),
        receive_ahead=cfg.get("receive_ahead", True),
        plan_trial=cfg.get("plan_trial", 4),
    )
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    kwargs: dict[str, Any] = dict(
        # "accelerators": one per rank, each launched as its own node (test_gpu.py)
        accelerator=cfg["accelerators"][rank] if "accelerators" in cfg else "cpu",
        devices=local,
        num_nodes=int(os.environ["WORLD_SIZE"]) // local,
        strategy=strategy,
        max_steps=cfg.get("steps", 4),
        **QUIET,
        precision=cfg.get("precision", "32-true"),
        gradient_clip_val=cfg.get("clip"),
        accumulate_grad_batches=cfg.get("accumulate", 1),
        default_root_dir=str(root),
        # Lightning's DistributedSampler always shuffles training data; the single-process
        # reference reads in order, so only the multi-replica config (whose reference rebuilds
        # the sampler's order) keeps it.
        use_distributed_sampler=cfg.get("num_stages") is not None,
        callbacks=_callbacks(cfg),
    )
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


class _ChangeMicrobatches(pl.Callback):
    """Changes the micro-batch count between steps, as the adapter's fast response does."""

    def __init__(self, counts: dict[int, int]) -> None:
        self.counts = counts

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step in self.counts:
            trainer.strategy.set_num_microbatches(self.counts[trainer.global_step])


def _callbacks(cfg: dict[str, Any]) -> list[pl.Callback]:
    callbacks: list[pl.Callback] = []
    if "change_microbatches" in cfg:
        callbacks.append(_ChangeMicrobatches({int(k): v for k, v in cfg["change_microbatches"]}))
    if cfg.get("monitor"):
        callbacks.append(PipelineThroughputMonitor(window_size=10, log_every_n_steps=1))
    if cfg.get("adapter"):
        callbacks.append(
            DynamicEnvironmentAdapter(calibration_steps=2, window=2, react_after=1, min_bytes=1)
        )
    return callbacks


_ORIGINAL: dict[str, Any] = {
    "plan_search": plan_spread_module.plan_search,
    "record": rivals_module.TrialRace.record,
    "prepare": plan_trial.PlanTrial.prepare,
}
"""What ``_watch_trial`` wraps, as imported: each config wraps these, not the last config's."""


def _watch_trial(
    slow_searched: bool, layout: list[list[Any]] | None, alternative: list[list[Any]] | None
) -> dict[str, Any]:
    """Record what the plan trial does on this rank: the plan set-up built, each timed step
    (candidate index, seconds) and the layout each training step ran. ``slow_searched`` adds a
    second to the searched plan's steps, so that a rival wins and is moved to; ``layout``
    (``[[ranks, [start, end]], ...]``) stands in for the search's plan (the tiny model alone
    would be planned on one device, which has no rivals), and ``alternative`` (on fewer ranks:
    the others idle) for its alternative of another structure, predicted alike."""
    from lightning_deepcee.planner import make_plan
    from lightning_deepcee.planner.subsets import lift, restrict

    record: dict[str, Any] = {"calls": [], "layouts": []}
    plan_spread_module.plan_search = _ORIGINAL["plan_search"]  # type: ignore[assignment]
    if layout is not None:

        def made(profile: Any, stages: list[list[Any]], batch: int) -> Any:
            active = sorted({r for ranks, _ in stages for r in ranks})
            plan = make_plan(
                restrict(profile, active),
                [[active.index(r) for r in ranks] for ranks, _ in stages],
                [tuple(blocks) for _, blocks in stages],
                schedule="1f1b",
                num_microbatches=2,
                global_batch_size=batch,
            )
            return lift(plan, active, profile.num_devices)

        def plan_search(
            profile: Any, *, global_batch_size: int, alternatives: list[Any], **_: Any
        ) -> Any:
            searched = made(profile, layout, global_batch_size)
            if alternative is not None:
                other = made(profile, alternative, global_batch_size)
                alternatives.append(
                    dataclasses.replace(other, predicted_step_time_s=searched.predicted_step_time_s)
                )
            return searched

        plan_spread_module.plan_search = plan_search  # type: ignore[assignment]
    race_record, prepare = _ORIGINAL["record"], _ORIGINAL["prepare"]

    def record_step(race: Any, seconds: float) -> int | None:
        record["calls"].append([race.running, seconds])
        return race_record(race, seconds + (1.0 if slow_searched and race.running == 0 else 0))

    def prepare_trial(trial: Any, strategy: Any, *args: Any) -> None:
        record["searched"] = strategy.plan.to_dict()
        prepare(trial, strategy, *args)

    rivals_module.TrialRace.record = record_step  # type: ignore[method-assign]
    plan_trial.PlanTrial.prepare = prepare_trial  # type: ignore[method-assign]
    return record


class _RecordLayouts(pl.Callback):
    """Appends the layout each training step ran (``Plan.layout_key``) to ``layouts``."""

    def __init__(self, layouts: list[Any]) -> None:
        self.layouts = layouts

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.layouts.append(str(trainer.strategy.plan.layout_key))


def run(cfg: dict[str, Any], out: Path) -> None:
    rank = int(os.environ["RANK"])
    target = out / cfg["name"]
    model = TinyNet(
        num_blocks=cfg.get("num_blocks", 6),
        optimizer=cfg.get("optimizer", "adamw"),
        batch_norm=cfg.get("batch_norm", False),
    )
    loader = make_loader(cfg.get("batch_size", 10), cfg.get("num_samples", 30))
    if cfg.get("non_scalar_loss"):  # a model bug that only the last stage can see
        spec = model.configure_pipeline()
        broken = dataclasses.replace(
            spec, loss_fn=lambda out, batch: torch.nn.functional.cross_entropy(
                out, batch[1], reduction="none"
            )
        )  # fmt: skip
        model.configure_pipeline = lambda: broken  # type: ignore[method-assign]
    if cfg.get("manual_optimization"):
        model.automatic_optimization = False
    if "expect_error" in cfg:
        real_version = lightning_deepcee._version.VERSION
        if cfg.get("fake_version_on_rank") == rank:
            lightning_deepcee._version.VERSION = "0.0.0+other"
        try:
            make_trainer(cfg, target).fit(model, loader)
        except Exception as exc:
            target.mkdir(parents=True, exist_ok=True)
            (target / f"error_rank{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
            if rank == 0:
                (target / "error.txt").write_text(f"{type(exc).__name__}: {exc}")
        finally:
            lightning_deepcee._version.VERSION = real_version
        return
    if cfg.get("resume"):
        # Train one epoch, save, then resume in a fresh trainer and model for a second epoch.
        ckpt = target / "epoch1.ckpt"
        trainer = make_trainer(cfg, target, max_steps=-1, max_epochs=1)
        trainer.fit(model, loader)
        trainer.save_checkpoint(ckpt)
        if rank == 0:
            # What a save that crashed half-way leaves behind: it must not disturb the resume.
            partial = target / ".epoch1.ckpt.partial"
            partial.mkdir()
            (partial / "stage_000.pt").write_bytes(b"half a file")
        trainer.strategy.barrier()
        model = TinyNet(
            num_blocks=cfg.get("num_blocks", 6), optimizer=cfg.get("optimizer", "adamw")
        )
        make_trainer(cfg, target, max_steps=-1, max_epochs=2).fit(model, loader, ckpt_path=ckpt)
        save_params(model, target / f"rank{rank}.pt")
        return
    if "save_epoch_to" in cfg:  # first half of an elastic restart: one epoch, then save
        trainer = make_trainer(cfg, target, max_steps=-1, max_epochs=1)
        trainer.fit(model, loader)
        trainer.save_checkpoint(out / cfg["save_epoch_to"])
        return
    if "resume_from" in cfg:  # second half, possibly on another number of devices
        trainer = make_trainer(cfg, target, max_steps=-1, max_epochs=2)
        trainer.fit(model, loader, ckpt_path=out / cfg["resume_from"])
        save_params(model, target / f"rank{rank}.pt")
        return
    trial = _watch_trial(
        cfg.get("trial_slow_searched", False),
        cfg.get("searched_layout"),
        cfg.get("alternative_layout"),
    )
    trainer = make_trainer(cfg, target)
    trainer.callbacks.append(_RecordLayouts(trial["layouts"]))  # type: ignore[attr-defined]
    trainer.fit(model, loader)
    save_params(model, target / f"rank{rank}.pt")
    if trial["calls"] or cfg.get("record_trial"):
        trial["trained"] = trainer.strategy.plan.to_dict()
        (target / f"rank{rank}_trial.json").write_text(json.dumps(trial))
    if cfg.get("validate_after"):  # validate and test the trained pipeline, same trainer
        logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
        (target / f"rank{rank}_train_metrics.json").write_text(json.dumps(logged))
        metrics = trainer.validate(model, loader, verbose=False)[0]
        metrics.update(trainer.test(model, loader, verbose=False)[0])
        predictions = trainer.predict(model, loader)
        torch.save(torch.cat(predictions), target / f"rank{rank}_predict.pt")  # type: ignore[arg-type]
        (target / f"rank{rank}_eval.json").write_text(json.dumps(metrics))
        # Without fit, from the pipeline checkpoint of the trained run: a fresh trainer and an
        # untrained module (another partition, so the checkpoint is re-partitioned on load).
        ckpt = target / "trained.ckpt"
        trainer.save_checkpoint(ckpt)
        fresh = TinyNet(optimizer=cfg.get("optimizer", "adamw"))
        other = make_trainer({**cfg, "partition": cfg["fresh_partition"]}, target)
        again = other.validate(fresh, loader, ckpt_path=ckpt, verbose=False)[0]
        again_predictions = other.predict(fresh, loader, ckpt_path=ckpt)
        torch.save(torch.cat(again_predictions), target / f"rank{rank}_predict_ckpt.pt")  # type: ignore[arg-type]
        (target / f"rank{rank}_eval_ckpt.json").write_text(json.dumps(again))
    stats = trainer.strategy.last_step_stats
    figures: dict[str, Any] = {"grad_sync_s": stats.grad_sync_s, "wall_s": stats.wall_s}
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, PipelineThroughputMonitor):
            figures["cost_model"] = callback.cost_model_check()
            figures["compared_steps"] = len(callback._predicted_times)
    (target / f"rank{rank}_stats.json").write_text(json.dumps(figures))
    if cfg.get("consolidate"):
        save_consolidated(trainer, target)


if __name__ == "__main__":
    run_configs(run)
