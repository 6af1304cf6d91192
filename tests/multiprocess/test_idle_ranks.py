"""Plans that leave ranks idle: the active ranks equal one process, idle ranks hold nothing.

One torchrun job (4 processes) trains ``TiedLM`` (``tests/helpers/tied_models.py``) under plans
whose ``idle_ranks`` hold no stage: ranks 1 and 3 idle; a re-plan that brings rank 1 in (blocks,
tied weight and optimizer state move onto it); a resume from a checkpoint saved with ranks 1
and 3 idle onto a plan that uses all four. Parameters, validation loss and predictions must
equal a single-process run; idle ranks must hold no parameters and read one batch, not every
batch (a stand-in, ``lightning_deepcee.runtime.loaders``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_deepcee.runtime.measure import model_fingerprint
from tests.helpers.equivalence import assert_params_close, tied_reference
from tests.helpers.launch import torchrun, write_configs
from tests.helpers.paths import WORKERS
from tests.helpers.plans import Stage, hand_plan
from tests.helpers.tied_models import TiedLM, make_lm_loader, valid_tokens

pytestmark = pytest.mark.multiprocess


def _plan(stages: list[Stage], idle: tuple[int, ...]) -> dict[str, Any]:
    return hand_plan(
        stages,
        model_fingerprint=model_fingerprint(TiedLM().configure_pipeline().blocks),
        global_batch_size=6,
        idle_ranks=idle,
    ).to_dict()


TWO_IDLE = _plan([((0, 2), (0,), (1.0,)), ((2, 5), (2,), (1.0,))], idle=(1, 3))
ONE_IDLE = _plan([((0, 2), (1,), (1.0,)), ((2, 4), (0,), (1.0,)), ((4, 5), (2,), (1.0,))], (3,))
NONE_IDLE = _plan([((0, 3), (3, 1), (0.5, 0.5)), ((3, 5), (0, 2), (0.6, 0.4))], idle=())


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("idle")
    configs = [
        dict(name="idle", plan=TWO_IDLE, evaluate=True),
        dict(name="replan", plan=TWO_IDLE, replan=dict(step=3, plan=ONE_IDLE), evaluate=True),
        dict(name="resume", plan=TWO_IDLE, resume_plan=NONE_IDLE),
    ]
    torchrun(WORKERS / "tied_worker.py", out, write_configs(out, configs), world=4)
    return out


@pytest.mark.parametrize(("name", "idle"), [("idle", (1, 3)), ("replan", (3,)), ("resume", ())])
def test_idle_ranks_hold_nothing_and_active_ranks_match_one_process(
    trained: Path, name: str, idle: tuple[int, ...]
) -> None:
    reference, val_loss, predictions = tied_reference(8)
    ref = reference.state_dict()
    for rank in range(4):
        got = torch.load(trained / name / f"rank{rank}.pt")
        if rank in idle:
            assert got == {}, f"idle rank {rank} holds {sorted(got)[:3]}"
        else:
            assert got, f"rank {rank} should hold a stage"
            assert_params_close(got, ref, f"{name} rank {rank}")
        eval_file = trained / name / f"rank{rank}_eval.json"
        if eval_file.exists():  # every rank logs the same validation loss and predictions
            assert json.loads(eval_file.read_text())["val_loss"] == pytest.approx(val_loss, 1e-5)
            predicted = torch.load(trained / name / f"rank{rank}_predict.pt")
            torch.testing.assert_close(predicted, predictions, rtol=1e-5, atol=1e-6)


def test_idle_ranks_read_one_batch_and_a_rank_brought_in_reads_from_then_on(trained: Path) -> None:
    # 24 samples in batches of 6, 8 steps (two epochs): an active rank reads all 48 samples.
    reads = {
        name: [json.loads((trained / name / f"rank{r}_reads.json").read_text())["fit"]
               for r in range(4)]
        for name in ("idle", "replan")
    }  # fmt: skip
    assert reads["idle"] == [48, 6, 48, 6]
    # Rank 1 joins after step 3: its stand-in (6), then the batch Lightning had fetched ahead as
    # a stand-in, read at its step (6), then all of the second epoch (24).
    assert reads["replan"] == [48, 36, 48, 6]


def test_every_rank_counts_the_last_steps_real_tokens(trained: Path) -> None:
    last = next(b for i, b in enumerate(make_lm_loader(6)) if i == 3)  # the 8th step's batch
    for name in ("idle", "replan"):
        for rank in range(4):
            got = json.loads((trained / name / f"rank{rank}_reads.json").read_text())
            assert got["last_step_tokens"] == valid_tokens(last), f"{name} rank {rank}"
