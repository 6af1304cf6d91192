"""Plans that leave ranks idle: the active ranks equal one process, idle ranks hold nothing.

One torchrun job (4 processes) trains ``TiedLM`` (``_tied_models.py``) under plans whose
``idle_ranks`` hold no stage: ranks 1 and 3 idle; a re-plan that brings rank 1 in (blocks,
tied weight and optimizer state move onto it); a resume from a checkpoint saved with ranks 1
and 3 idle onto a plan that uses all four. Parameters, validation loss and predictions must
equal a single-process run; idle ranks must hold no parameters and read one batch, not every
batch (a stand-in, ``lightning_deepcee.loaders``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _tied_models import TiedLM, make_lm_loader, valid_tokens
from test_tied_and_values import WORKER, _assert_params, _free_port, _reference

from lightning_deepcee.planner import Plan, StagePlan
from lightning_deepcee.runtime.measure import model_fingerprint

pytestmark = pytest.mark.multiprocess


def _plan(stages: list[tuple[tuple[int, int], tuple[int, ...], tuple[float, ...]]],
          idle: tuple[int, ...]) -> dict[str, Any]:  # fmt: skip
    return Plan(
        stages=tuple(
            StagePlan(block_range=r, ranks=ranks, batch_shares=s) for r, ranks, s in stages
        ),
        schedule="1f1b",
        num_microbatches=2,
        global_batch_size=6,
        predicted_step_time_s=1.0,
        predicted_bubble_ratio=0.0,
        predicted_peak_memory_bytes={},
        model_fingerprint=model_fingerprint(TiedLM().configure_pipeline().blocks),
        cluster_fingerprint="",
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
    (out / "configs.json").write_text(json.dumps(configs))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
        "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
        str(WORKER), str(out), str(out / "configs.json"),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out


@pytest.mark.parametrize(("name", "idle"), [("idle", (1, 3)), ("replan", (3,)), ("resume", ())])
def test_idle_ranks_hold_nothing_and_active_ranks_match_one_process(
    trained: Path, name: str, idle: tuple[int, ...]
) -> None:
    reference, val_loss, predictions = _reference(8)
    ref = reference.state_dict()
    for rank in range(4):
        got = torch.load(trained / name / f"rank{rank}.pt")
        if rank in idle:
            assert got == {}, f"idle rank {rank} holds {sorted(got)[:3]}"
        else:
            assert got, f"rank {rank} should hold a stage"
            _assert_params(got, ref, f"{name} rank {rank}")
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
