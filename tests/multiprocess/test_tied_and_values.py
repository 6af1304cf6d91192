"""Tied parameters across stages and block values that are dicts and tuples, under Lightning.

One torchrun job (3 processes) trains ``TiedLM`` (``tests/helpers/tied_models.py``: blocks passing
dicts and tuples with a bool mask, a float tensor that needs no gradient and a constant; a head
tied to the embedding; batches whose sequence length changes) in several layouts; each must equal a
single-process Lightning run: parameters (both tied copies), validation loss and predictions
after fit and after a re-plan, gradient clipping over the tied copies, checkpoints that keep the
tied weight once, and resume on the same and on another partition.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_deepcee.runtime.measure import model_fingerprint
from tests.helpers.equivalence import assert_params_close, tied_reference
from tests.helpers.launch import torchrun, write_configs
from tests.helpers.paths import WORKERS
from tests.helpers.plans import Stage, hand_plan
from tests.helpers.tied_models import TiedLM

pytestmark = pytest.mark.multiprocess
WORKER = WORKERS / "tied_worker.py"
TIED = ("embed.tokens.weight", "head.out.weight")


def _plan(stages: list[Stage], num_microbatches: int = 2) -> dict:
    return hand_plan(
        stages,
        model_fingerprint=model_fingerprint(TiedLM().configure_pipeline().blocks),
        global_batch_size=6,
        num_microbatches=num_microbatches,
        predicted_peak_memory_bytes={r: 0 for r in range(3)},
    ).to_dict()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tied")
    configs = [
        # Tie across stages 0 and 2 with a stage between; zero-bubble B/W split on dict and
        # tuple values; clipping counts the tied weight once.
        dict(name="pipeline", partition=[2, 2, 1], schedule="zb-h1", num_microbatches=2,
             clip=0.3, evaluate=True, consolidate=True),
        # Stage 0 shared by two devices (rows split 0.6/0.4): dict values routed by rows; the
        # tie's gradient sums over all three devices.
        dict(name="shared", plan=_plan([((0, 3), (1, 0), (0.6, 0.4)), ((3, 5), (2,), (1.0,))],
                                       num_microbatches=3), evaluate=True),
        # A re-plan after step 3 moves the embedding to rank 2 and the head to ranks 0 and 1.
        dict(name="replan", partition=[2, 2, 1], schedule="1f1b", num_microbatches=2,
             replan=dict(step=3, plan=_plan([((0, 1), (2,), (1.0,)),
                                             ((1, 5), (0, 1), (0.5, 0.5))])),
             evaluate=True),
        # DeepCEEStrategy(): profiles blocks that pass dicts and tuples, plans, validates and
        # predicts on the planned layout.
        dict(name="planned", evaluate=True),
        # Checkpoints: the tied weight saved once; resume on the same and on another partition.
        dict(name="resume_same", partition=[2, 2, 1], num_microbatches=2,
             resume_partition=[2, 2, 1]),
        dict(name="resume_other", partition=[2, 2, 1], num_microbatches=2,
             resume_partition=[1, 3, 1], receive_ahead=False),
    ]  # fmt: skip
    torchrun(WORKER, out, write_configs(out, configs), world=3)
    return out


@pytest.mark.parametrize(
    "name", ["pipeline", "shared", "replan", "planned", "resume_same", "resume_other"]
)
def test_tied_dict_and_tuple_values_match_single_process(trained: Path, name: str) -> None:
    clip = 0.3 if name == "pipeline" else None
    reference, val_loss, predictions = tied_reference(8, clip)
    ref = reference.state_dict()
    holders = 0
    for rank in range(3):
        got = torch.load(trained / name / f"rank{rank}.pt")
        assert_params_close(got, ref, f"{name} rank {rank}")
        holders += sum(key in got for key in TIED)
    assert holders >= 2, "the embedding's and the head's stages each hold the tied weight"
    for rank in range(3):
        eval_file = trained / name / f"rank{rank}_eval.json"
        if eval_file.exists():
            assert json.loads(eval_file.read_text())["val_loss"] == pytest.approx(val_loss, 1e-5)
            predicted = torch.load(trained / name / f"rank{rank}_predict.pt")
            torch.testing.assert_close(predicted, predictions, rtol=1e-5, atol=1e-6)


def test_clipping_engages(trained: Path) -> None:
    """The clipped reference differs from the unclipped one, so the 'pipeline' config's match
    shows that the global norm counted the tied weight once."""
    clipped, _, _ = tied_reference(8, 0.3)
    plain, _, _ = tied_reference(8, None)
    assert not torch.allclose(clipped.embed.tokens.weight, plain.embed.tokens.weight, atol=1e-4)


def test_checkpoints_keep_the_tied_weight_once(trained: Path) -> None:
    keys = json.loads((trained / "resume_same" / "shard_keys.json").read_text())
    assert "embed.tokens.weight" in keys["stage_000.pt"]
    assert not any(key in keys["stage_002.pt"] for key in TIED)
    merged = torch.load(trained / "pipeline" / "consolidated.pt")
    assert merged[TIED[0]].data_ptr() == merged[TIED[1]].data_ptr()
    whole = TiedLM()
    whole.load_state_dict(merged, strict=True)  # loads into the unsplit module
    reference, _, _ = tied_reference(8, 0.3)
    assert_params_close(merged, reference.state_dict(), "consolidated")
