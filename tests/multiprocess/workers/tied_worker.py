"""Worker for tests/multiprocess/test_tied_and_values.py; run under torchrun.

    torchrun --nproc_per_node=N tests/multiprocess/workers/tied_worker.py OUT_DIR CONFIGS_JSON

(the repository on PYTHONPATH, as ``tests.helpers.launch.torchrun`` sets it)

For each config it trains ``TiedLM`` (dict/tuple block values, a tied head, variable-length
batches) under DeepCEEStrategy and writes every rank's parameters (its module's whole
``state_dict``, tied copies included) to ``OUT_DIR/<name>/rank<r>.pt`` and the samples it read
in fit (with its last step's token count) to ``rank<r>_reads.json``, plus what the config asks
for: validation loss and predictions after fit, a consolidated checkpoint, the checkpoint
shards' keys.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_deepcee import DeepCEEStrategy
from lightning_deepcee.planner import Plan
from tests.helpers.tied_models import TiedLM, make_lm_loader
from tests.helpers.workers import QUIET, run_configs, save_consolidated, save_params

warnings.filterwarnings("ignore")
_PLANS: list[dict[str, Any]] = []


class _Replan(pl.Callback):
    """Applies a plan at the end of one step (a re-plan, as the adapter's slow response does)."""

    def __init__(self, step: int, plan: dict[str, Any]) -> None:
        self.step, self.plan = step, plan

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.strategy.apply_plan(Plan.from_dict(self.plan), trainer)  # type: ignore[attr-defined]


def _trainer(cfg: dict[str, Any], root: Path, **overrides: Any) -> pl.Trainer:
    plan = None
    if "plan" in cfg:  # one file per rank and trainer: no rank reads a file another writes
        _PLANS.append(cfg["plan"])
        plan = str(root / f"plan_rank{os.environ['RANK']}_{len(_PLANS)}.json")
        Plan.from_dict(cfg["plan"]).to_json(plan)
    strategy = DeepCEEStrategy(
        plan=plan,
        partition=cfg.get("partition"),
        schedule=cfg.get("schedule"),
        num_microbatches=cfg.get("num_microbatches"),
        verbose=False,
        receive_ahead=cfg.get("receive_ahead", True),
    )
    callbacks: list[pl.Callback] = []
    if "replan" in cfg:
        callbacks.append(_Replan(cfg["replan"]["step"], cfg["replan"]["plan"]))
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=strategy,
        max_steps=cfg.get("steps", 8),
        **QUIET,
        gradient_clip_val=cfg.get("clip"),
        default_root_dir=str(root),
        use_distributed_sampler=False,  # every rank reads the whole batch, in order
        callbacks=callbacks,
    )
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


def run(cfg: dict[str, Any], out: Path) -> None:
    rank = int(os.environ["RANK"])
    target = out / cfg["name"]
    target.mkdir(parents=True, exist_ok=True)
    loader = make_lm_loader(cfg.get("batch_size", 6))
    model = TiedLM()
    if "resume_partition" in cfg or "resume_plan" in cfg:
        # One epoch, save, resume for a second on another partition or plan.
        ckpt = target / "epoch1.ckpt"
        trainer = _trainer(cfg, target, max_steps=-1, max_epochs=1)
        trainer.fit(model, loader)
        trainer.save_checkpoint(ckpt)
        if rank == 0:
            shards = sorted(ckpt.glob("stage_*.pt"))
            keys = {p.name: sorted(torch.load(p)["state_dict"]) for p in shards}
            (target / "shard_keys.json").write_text(json.dumps(keys))
        model = TiedLM()
        resumed = dict(cfg)
        if "resume_plan" in cfg:
            resumed["plan"] = cfg["resume_plan"]
        else:
            resumed["partition"] = cfg["resume_partition"]
        _trainer(resumed, target, max_steps=-1, max_epochs=2).fit(model, loader, ckpt_path=ckpt)
        save_params(model, target / f"rank{rank}.pt")
        return
    trainer = _trainer(cfg, target)
    trainer.fit(model, loader)
    save_params(model, target / f"rank{rank}.pt")
    reads = {
        "fit": loader.dataset.reads,  # type: ignore[attr-defined]
        "last_step_tokens": trainer.strategy.last_step_tokens,  # type: ignore[attr-defined]
    }
    (target / f"rank{rank}_reads.json").write_text(json.dumps(reads))
    if cfg.get("evaluate"):
        metrics = trainer.validate(model, loader, verbose=False)[0]
        (target / f"rank{rank}_eval.json").write_text(json.dumps(metrics))
        predictions = trainer.predict(model, loader)
        torch.save(torch.cat(predictions), target / f"rank{rank}_predict.pt")  # type: ignore[arg-type]
    if cfg.get("consolidate"):
        save_consolidated(trainer, target)


if __name__ == "__main__":
    run_configs(run)
