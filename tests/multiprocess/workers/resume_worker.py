"""Worker for tests/multiprocess/test_elastic_resume.py; run under torchrun (3 processes).

    torchrun --nproc_per_node=3 tests/multiprocess/workers/resume_worker.py OUT_DIR

For each of ``async`` and ``blocking`` checkpoint saves: train ``TiedLM`` with
``ElasticCheckpoint(every_n_train_steps=3)`` on partition [2, 2, 1]; every rank raises after
step 11 (two steps after the step-9 checkpoint, which is one batch into epoch 2); then a new
Trainer resumes with ``ckpt_path="last"`` on partition [1, 3, 1] and trains to the end of
epoch 3. Writes each
rank's parameters to ``OUT_DIR/<name>/rank<r>.pt``.

Then ``mismatch``: rank 2 resumes from ``blocking``'s step-9 checkpoint while the others start
afresh; every rank must refuse to train (``check_same_checkpoint``) and writes the error to
``OUT_DIR/mismatch/rank<r>.txt``.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_deepcee import DeepCEEStrategy, ElasticCheckpoint
from tests.helpers.tied_models import TiedLM, make_shuffled_lm_loader
from tests.helpers.workers import save_params

warnings.filterwarnings("ignore")
FAIL_AT = 11


class _Fail(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == FAIL_AT:
            raise RuntimeError(f"simulated failure after step {FAIL_AT}")


def _trainer(root: Path, partition: list[int], asynchronous: bool, fail: bool) -> pl.Trainer:
    callbacks: list[pl.Callback] = [ElasticCheckpoint(dirpath=str(root / "ckpt"),
                                                      every_n_train_steps=3)]  # fmt: skip
    if fail:
        callbacks.append(_Fail())
    return pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=DeepCEEStrategy(
            partition=partition,
            num_microbatches=2,
            async_checkpoint=asynchronous,
            verbose=False,
        ),
        max_epochs=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(root),
        use_distributed_sampler=False,  # the loader's own epoch-seeded sampler, on every rank
        callbacks=callbacks,
    )


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    for name, asynchronous in (("async", True), ("blocking", False)):
        root = out / name
        try:
            _trainer(root, [2, 2, 1], asynchronous, fail=True).fit(
                TiedLM(), make_shuffled_lm_loader(6), ckpt_path="last"
            )
        except RuntimeError as err:
            assert "simulated failure" in str(err), err
        else:
            raise AssertionError("the first fit should have failed")
        model = TiedLM()
        trainer = _trainer(root, [1, 3, 1], asynchronous, fail=False)
        trainer.fit(model, make_shuffled_lm_loader(6), ckpt_path="last")
        save_params(model, root / f"rank{rank}.pt")
        if rank == 0:
            (root / "resumed_from.txt").write_text(str(trainer.ckpt_path))
            print(f"=== end of {name}", flush=True)
    root = out / "mismatch"
    path = str(out / "blocking" / "ckpt" / "step=9.ckpt") if rank == 2 else None
    try:
        _trainer(root, [2, 2, 1], False, fail=False).fit(
            TiedLM(), make_shuffled_lm_loader(6), ckpt_path=path
        )
    except RuntimeError as err:
        (root / f"rank{rank}.txt").write_text(str(err))


if __name__ == "__main__":
    main()
