"""Worker for tests/multiprocess/test_recover_in_process.py; one torchrun node per rank.

    torchrun --nnodes=4 --nproc_per_node=1 ... recover_worker.py OUT_DIR CONFIGS_JSON

(one config per launch: the device a config kills is gone for the next.) ``DeepCEEStrategy()``
trains ``TinyNet`` with ``ElasticCheckpoint(every_n_train_steps=3)``; the search is stood in for
by fixed layouts (the tiny model alone would be planned on one device): on 4 devices, blocks
[0, 2) | [2, 4) | [4, 6) on ranks 0 | 1 | 2 with rank 3 idle; on 3 devices, [0, 1) | [1, 4) |
[4, 6) on all three. Rank ``kill`` ends its process without a word when the step after
``kill_after`` steps begins. Each survivor writes its parameters to
``OUT_DIR/<name>/rank<its rank at the end>.pt`` and ``world<rank>.txt`` (world size at the end,
recoveries, admissions).

With ``join`` the killed device comes back: the test starts this script again, alone, with
``DEEPCEE_JOIN=1`` and the killed rank's device name (each rank's ``DEEPCEE_DEVICE`` is
``dev<RANK>``); until it has joined, the survivors take a second per step. On the four devices
after the join the layout is [0, 1) | [1, 3) | [3, 4) | [4, 6) on ranks 0 | 3 (the returning
device) | 1 | 2. The job's ranks keep their block timings and plans in a device cache, the
returning device has none of its own (as ``device_cache="auto"`` outside torchrun): the plan
search after the join must follow the job's.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

import lightning_deepcee.runtime.spread_search as spread_search
from lightning_deepcee import DeepCEEStrategy, ElasticCheckpoint
from lightning_deepcee.planner import make_plan
from lightning_deepcee.planner.subsets import lift, restrict
from lightning_deepcee.runtime.admission import wants_to_join
from tests.helpers.models import TinyNet, make_loader
from tests.helpers.workers import QUIET, run_configs, save_params

warnings.filterwarnings("ignore")
LAYOUTS = {
    1: [([0], (0, 6))],  # the returning device, setting up alone before it joins
    4: [([0], (0, 2)), ([1], (2, 4)), ([2], (4, 6))],
    3: [([0], (0, 1)), ([1], (1, 4)), ([2], (4, 6))],
}


RETURNED = [([0], (0, 1)), ([3], (1, 3)), ([1], (3, 4)), ([2], (4, 6))]


def _plan_search(profile: Any, *, global_batch_size: int, **_: Any) -> Any:
    returned = profile.num_devices == 4 and profile.devices[3].host == "dev2"
    stages = RETURNED if returned else LAYOUTS[profile.num_devices]
    active = sorted({r for ranks, _ in stages for r in ranks})
    plan = make_plan(
        restrict(profile, active),
        [[active.index(r) for r in ranks] for ranks, _ in stages],
        [blocks for _, blocks in stages],
        schedule="1f1b",
        num_microbatches=2,
        global_batch_size=global_batch_size,
    )
    return lift(plan, active, profile.num_devices)


class _Kill(pl.Callback):
    def __init__(self, rank: int, after: int) -> None:
        self.rank, self.after = rank, after

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.after and int(os.environ.get("RANK", -1)) == self.rank:
            os._exit(1)  # the device is gone


class _UntilJoined(pl.Callback):
    """After the loss, a second per step until a device has joined (at most ``limit``)."""

    def __init__(self, after: int, limit: int) -> None:
        self.after, self.limit = after, limit

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        admission = trainer.strategy.admission  # type: ignore[attr-defined]
        if self.after < trainer.global_step < self.limit and not admission.admissions:
            time.sleep(1.0)


def run(cfg: dict[str, Any], out: Path) -> None:
    os.environ.setdefault("DEEPCEE_DEVICE", f"dev{os.environ.get('RANK', '?')}")
    spread_search.plan_search = _plan_search  # type: ignore[assignment]
    target = out / cfg["name"]
    model = TinyNet()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=int(os.environ.get("WORLD_SIZE", 1)),
        strategy=DeepCEEStrategy(
            plan_trial=1,
            verbose=False,
            timeout_s=20,
            device_cache=None if wants_to_join() else str(target / "devices"),
        ),
        max_steps=cfg["steps"],
        **{**QUIET, "enable_checkpointing": True},
        gradient_clip_val=cfg.get("clip"),
        default_root_dir=str(target),
        use_distributed_sampler=False,
        callbacks=[
            ElasticCheckpoint(dirpath=str(target / "ckpt"), every_n_train_steps=3),
            _Kill(cfg["kill"], cfg["kill_after"]),
            *([_UntilJoined(cfg["kill_after"], cfg["steps"] - 2)] if cfg.get("join") else []),
        ],
    )
    trainer.fit(model, make_loader(), ckpt_path="last" if cfg.get("join") else None)
    rank = trainer.global_rank
    save_params(model, target / f"rank{rank}.pt")
    strategy: Any = trainer.strategy
    recoveries, joined = strategy.recovery.recoveries, strategy.admission.admissions
    (target / f"world{rank}.txt").write_text(f"{trainer.world_size} {recoveries} {joined}")


if __name__ == "__main__":
    run_configs(run)
