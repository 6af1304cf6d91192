"""Worker for the live re-plan tests; run under torchrun (one process per device).

    torchrun --nproc_per_node=N tests/multiprocess/workers/replan_worker.py OUT_DIR CONFIGS_JSON

(the repository on PYTHONPATH, as ``tests.helpers.launch.torchrun`` sets it)

Each config trains the tiny model with DeepCEEStrategy (built by ``fit_worker.make_trainer``) and
changes the layout at step boundaries, either directly (``"apply"``: ``{step: [plan files]}``
passed to ``DeepCEEStrategy.apply_plan``; a list of one file per rank gives the ranks different
plans) or through the adapter (``"forced_replan"``: every rank's monitor reports a ``replan``
decision for the link at that step, as every rank's monitor reads the same exchanged figures).
Every rank writes its final parameters, Adam state and learning rates by global parameter name,
the plan it ended on, the errors that ``apply_plan`` raised and the adapter's decisions to
``OUT_DIR/<name>/rank<r>.pt``.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_deepcee import DynamicEnvironmentAdapter
from lightning_deepcee.adapter import Decision, search_process
from lightning_deepcee.callbacks import replanner as replanning
from lightning_deepcee.planner import Plan
from tests.helpers.models import TinyNet, make_loader
from tests.helpers.workers import run_configs
from tests.multiprocess.workers.fit_worker import make_trainer


class _AtOnce:
    """The re-plan search finished when it starts, so the step a re-plan lands on is known
    (forced at step S: proposed and searched at S, rank 0's flag in S+1's exchange, read and
    moved at S+2). The search process is tested in tests/unit."""

    def __init__(self, request: Any) -> None:
        self._outcome = search_process.run(request)

    def done(self) -> bool:
        return True

    def found(self) -> list[dict[str, Any]]:
        return list(self._outcome.get("plans", []))

    def result(self) -> dict[str, Any]:
        return self._outcome

    def cancel(self) -> None:
        """Nothing runs: there is nothing to stop."""


replanning.SearchProcess = _AtOnce  # type: ignore[assignment, misc]

warnings.filterwarnings("ignore")


class _ApplyPlans(pl.Callback):
    """Calls ``strategy.apply_plan`` at the end of the given steps; records what it raised."""

    def __init__(self, steps: dict[int, list[str]]) -> None:
        self.steps = steps
        self.errors: list[str] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        for path in self.steps.get(trainer.global_step, []):
            mine = path if isinstance(path, str) else path[trainer.global_rank]
            try:
                trainer.strategy.apply_plan(Plan.from_json(mine), trainer)  # type: ignore[attr-defined]
            except ValueError as exc:
                self.errors.append(f"step {trainer.global_step}: {exc}")


class _ForcedReplan(DynamicEnvironmentAdapter):
    """The adapter, with every rank's monitor adding a ``replan`` for ``link`` at ``step``.

    The decision says the link now delivers ``factor`` times the profile's bandwidth; it travels
    the adapter's own path (decide, its count checked in the next exchange) like a real one.
    """

    def __init__(self, step: int, link: list[int], factor: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.at_step, self.link, self.factor = step, (link[0], link[1]), factor
        self.plans: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plan = trainer.strategy.plan  # type: ignore[attr-defined]
        self.plans["setup"] = None if plan is None else plan.to_dict()
        super().on_train_start(trainer, pl_module)
        plan = trainer.strategy.plan  # type: ignore[attr-defined]
        self.plans["start"] = None if plan is None else plan.to_dict()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any
    ) -> None:
        monitor = self.monitor
        if monitor is not None and trainer.global_step == self.at_step:
            profile = trainer.strategy.cluster_profile  # type: ignore[attr-defined]
            src, dst = self.link
            old = 1e8 if profile is None else profile.bandwidth_bytes_per_s[src][dst]
            real = monitor.observe

            def observe(step: int, observations: Any) -> list[Decision]:
                forced = Decision(
                    step=step, link=self.link, kind="replan", old_bandwidth=old,
                    new_bandwidth=old * self.factor, split_factor=1, reason="forced by the test",
                )  # fmt: skip
                return [*real(step, observations), forced]

            monitor.observe = observe
            try:
                super().on_train_batch_end(trainer, pl_module, *args)
            finally:
                del monitor.observe
            return
        super().on_train_batch_end(trainer, pl_module, *args)


def _callbacks(cfg: dict[str, Any]) -> list[pl.Callback]:
    callbacks: list[pl.Callback] = []
    if "apply" in cfg:
        callbacks.append(_ApplyPlans({int(k): v for k, v in cfg["apply"].items()}))
    if "forced_replan" in cfg:
        step, link, factor = cfg["forced_replan"]
        callbacks.append(
            _ForcedReplan(
                step, link, factor, calibration_steps=1, window=1, react_after=1, min_bytes=1,
                replan_gain=cfg.get("replan_gain", 0.1),
            )
        )  # fmt: skip
    return callbacks


def _save_state(trainer: pl.Trainer, model: TinyNet, path: Path) -> None:
    """Parameters, Adam state and learning rate per global parameter name, plus what happened."""
    strategy: Any = trainer.strategy
    names = strategy.stage_part.optimizer_param_names(strategy.optimizers)[0]
    state = strategy.optimizers[0].state_dict()  # {} on a rank the plan left idle
    index_lr = [(i, g["lr"]) for g in state.get("param_groups", []) for i in g["params"]]
    adam = {
        name: {k: v.detach().cpu().clone() for k, v in state["state"][i].items()}
        for (i, _), name in zip(index_lr, names, strict=True)
    }
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    adapters = [c for c in callbacks if isinstance(c, _ForcedReplan)]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "adam": adam,
            "lr": {name: lr for (_, lr), name in zip(index_lr, names, strict=True)},
            "plan": None if strategy.plan is None else strategy.plan.to_dict(),
            "errors": [e for c in callbacks if isinstance(c, _ApplyPlans) for e in c.errors],
            "decisions": [d for c in adapters for d in c.decisions],
            "plans": [c.plans for c in adapters],
        },
        path,
    )


def run(cfg: dict[str, Any], out: Path) -> None:
    rank = int(os.environ["RANK"])
    target = out / cfg["name"]
    model = TinyNet()
    loader = make_loader(num_samples=cfg.get("num_samples", 30))
    if cfg.get("resume"):
        # One epoch (the re-plan happens inside it), save, resume in a fresh trainer and model.
        ckpt = target / "epoch1.ckpt"
        trainer = make_trainer(cfg, target, callbacks=_callbacks(cfg), max_steps=-1, max_epochs=1)
        trainer.fit(model, loader)
        trainer.save_checkpoint(ckpt)
        first_plan = trainer.strategy.plan  # type: ignore[attr-defined]
        model = TinyNet()
        trainer = make_trainer(cfg, target, callbacks=_callbacks(cfg), max_steps=-1, max_epochs=2)
        trainer.fit(model, loader, ckpt_path=ckpt)
        _save_state(trainer, model, target / f"rank{rank}.pt")
        if rank == 0:
            (target / "first_plan.json").write_text(json.dumps(first_plan.to_dict()))
        return
    trainer = make_trainer(cfg, target, callbacks=_callbacks(cfg))
    trainer.fit(model, loader)
    _save_state(trainer, model, target / f"rank{rank}.pt")


if __name__ == "__main__":
    run_configs(run)
