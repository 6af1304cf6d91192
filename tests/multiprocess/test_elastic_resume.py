"""A failure mid-epoch, then ``ckpt_path="last"``: the resumed run equals one uninterrupted process.

One torchrun job (3 processes, ``workers/resume_worker.py``) trains ``TiedLM`` on a loader shuffled
by epoch (4 batches an epoch) with ``ElasticCheckpoint(every_n_train_steps=3)``; every rank
fails after step 11. A new Trainer resumes from the newest complete checkpoint, step 9's, taken
one batch into epoch 2, on another partition. Its parameters after epoch 3 must equal a single
process that never failed: the mid-epoch checkpoint resumes with the batch after the last one
trained, in epoch 2's order (Lightning alone would start the epoch's data again, in epoch 0's
order), and steps 10-11 are redone. Saves in
the background and blocking saves both.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_deepcee.runtime.checkpoint import newest_checkpoint
from tests.helpers.equivalence import assert_params_close
from tests.helpers.launch import torchrun
from tests.helpers.paths import WORKERS
from tests.helpers.tied_models import TiedLM, make_shuffled_lm_loader

pytestmark = pytest.mark.multiprocess

WORKER = WORKERS / "resume_worker.py"


def _reference() -> dict[str, torch.Tensor]:
    warnings.filterwarnings("ignore")
    pl.seed_everything(0, verbose=False)
    model = TiedLM()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(model, make_shuffled_lm_loader(6))
    assert trainer.global_step == 12
    return model.state_dict()


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("resume")
    # One stream: the report lines (stderr) stay between the worker's markers (stdout).
    (log,) = torchrun(WORKER, out, world=3)
    return out, log


@pytest.mark.parametrize("name", ["async", "blocking"])
def test_resume_mid_epoch_equals_uninterrupted(resumed: tuple[Path, str], name: str) -> None:
    out, whole_log = resumed
    log = whole_log.split(f"=== end of {name}")[0].split("=== end of")[-1]
    assert Path((out / name / "resumed_from.txt").read_text()).name == "step=9.ckpt"
    ref = _reference()
    for rank in range(3):
        got = torch.load(out / name / f"rank{rank}.pt")
        assert_params_close(got, ref, f"{name} rank {rank}")
    # The resume said what it found: the failure two steps after the checkpoint, both plans.
    assert "resuming from" in log and "step=9" in log, log[-4000:]
    assert "failed at step 11" in log and "2 to redo" in log, log[-4000:]
    assert "old plan: [0, 2) on" in log and "new plan: [0, 1) on" in log, log[-4000:]
    assert "ended before the epoch ended" not in log  # the loader was resumable
    # save_top_k=1 keeps the newest, and Lightning never removes the one a run resumed from.
    ckpt = out / name / "ckpt"
    assert newest_checkpoint(ckpt) == ckpt / "step=12.ckpt"
    kept = sorted(p.name for p in ckpt.iterdir() if p.name.endswith(".ckpt"))
    assert kept == ["step=12.ckpt", "step=9.ckpt"], kept
    assert not [p for p in ckpt.iterdir() if p.name.endswith(".partial")]
    history = [p.name for p in ckpt.glob("deepcee_failure.*.json")]
    assert len(history) == 1 and not (ckpt / "deepcee_failure.json").exists(), history


def test_ranks_given_different_checkpoints_refuse_to_train(resumed: tuple[Path, str]) -> None:
    """Rank 2 resumes from a checkpoint, ranks 0 and 1 start afresh: every rank stops before
    the first step and names what each rank loaded."""
    out, _ = resumed
    for rank in range(3):
        error = (out / "mismatch" / f"rank{rank}.txt").read_text()
        assert "would resume from different checkpoints" in error, error
        assert "rank 0 (" in error and "): None" in error and "step=9.ckpt" in error, error
