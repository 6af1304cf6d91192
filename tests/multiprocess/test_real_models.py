"""Real models under DeepCEEStrategy equal single-process Lightning, parameter by parameter.

A Hugging Face ``GPT2LMHeadModel`` (examples/hf_gpt2.py), whose tied embedding
(``transformer.wte.weight`` is ``lm_head.weight``) is used by the first and the last block, and
a torchvision-style ResNet-18 with BatchNorm (examples/resnet18.py). Each test launches one
``torchrun`` job (``workers/real_models_worker.py``) with a manual layout, and compares every rank's
weights after a few AdamW steps with one process training on the same batches.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_deepcee.runtime.checkpoint import shard_file
from tests.helpers.launch import torchrun, write_configs
from tests.helpers.paths import WORKERS
from tests.multiprocess.workers.real_models_worker import GPT2_SIZES, make_loader, make_model

pytestmark = pytest.mark.multiprocess
WORKER = WORKERS / "real_models_worker.py"
TIED = ("transformer.wte.weight", "lm_head.weight")


def _launch(world: int, configs: list[dict[str, Any]], out: Path) -> None:
    # The worker (a script) imports examples/ and the package whatever the install.
    torchrun(WORKER, out, write_configs(out, configs), world=world, timeout=600)


def _reference(cfg: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
    """One process, the whole batch: the trained module and its ``state_dict``.

    It runs on one thread, as each worker does (OMP_NUM_THREADS=1): CPU kernels pick their
    algorithm and summation order by thread count, and AdamW turns a rounding difference in a
    gradient that is (nearly) zero, such as a 3x3 convolution's taps over padding only, into
    a visible weight difference.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = make_model(cfg)
            trainer = pl.Trainer(
                accelerator="cpu", devices=1, max_steps=cfg["steps"], logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            )  # fmt: skip
            trainer.fit(model, make_loader(cfg))
    finally:
        torch.set_num_threads(threads)
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ranks(directory: Path, world: int) -> list[dict[str, torch.Tensor]]:
    return [torch.load(directory / f"rank{r}.pt") for r in range(world)]


def _merged(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Union of the ranks' ``state_dict``s; a name held twice must hold the same values."""
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in part.items():
            if k in merged:
                torch.testing.assert_close(v, merged[k], rtol=0, atol=0)
            merged[k] = v
    return merged


def _assert_equal(got: dict, ref: dict, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    assert got.keys() == ref.keys(), sorted(got.keys() ^ ref.keys())
    for k in ref:
        try:
            torch.testing.assert_close(got[k], ref[k], rtol=rtol, atol=atol)
        except AssertionError as exc:
            raise AssertionError(f"{k}: {exc}") from None


def _key_bias_apart(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A GPT-2 ``state_dict`` with each attention's key bias moved to ``<name>[key]``.

    Softmax ignores a shift shared by all keys, so the key bias's exact gradient is 0: what
    either run computes is rounding (about 1e-11 here), and AdamW scales it up to
    ``lr * |g| / eps`` per step, about 1e-5 after 4 steps. It differs between the pipeline and
    one process whenever micro-batching changes the rounding, so it gets its own tolerance.
    """
    n = int(GPT2_SIZES["n_embd"])
    out = dict(state)
    for name, value in state.items():
        if name.endswith(("attn.c_attn.bias", "attn.qkv.bias")):  # [query, key, value], n each
            out[name] = torch.cat([value[:n], value[2 * n :]])
            out[f"{name}[key]"] = value[n : 2 * n]
    return out


def _assert_gpt2_equal(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    """Equal to rounding. AdamW (lr 1e-2) divides each gradient by its own running scale, so an
    element whose gradient is nearly 0 moves by a rounding-sized share of lr: with transformers
    5.x one weight of 4096 differs by 1.4e-5 after 4 steps. A wrong gradient moves many
    elements by about lr, far above the 5e-5 allowed."""
    got, ref = _key_bias_apart(got), _key_bias_apart(ref)
    keys = {k for k in ref if k.endswith("[key]")}
    _assert_equal(
        {k: got[k] for k in got.keys() - keys}, {k: ref[k] for k in ref.keys() - keys}, atol=5e-5
    )
    _assert_equal({k: got[k] for k in keys}, {k: ref[k] for k in keys}, atol=1e-4)


def _gpt2_config(name: str, tie: bool, **layout: Any) -> dict[str, Any]:
    # 6 blocks [wte, wpe, h.0, h.1, ln_f, lm_head] on 3 stages: the tied weight's two blocks
    # land on stages 0 and 2, and stage 1 holds neither.
    return {"name": name, "model": "gpt2", "tie": tie, "partition": [2, 2, 2], "steps": 4,
            "num_microbatches": 2, **layout}  # fmt: skip


def test_hf_gpt2_untied_matches_single_process(tmp_path: Path) -> None:
    """The Hugging Face blocks (explicit causal mask, HF parameter names) under the pipeline
    equal one process: the same model as below with its embeddings untied."""
    cfg = _gpt2_config("untied", tie=False, schedule="1f1b")
    _launch(3, [cfg], tmp_path)
    parts = _ranks(tmp_path / "untied", 3)
    _, ref = _reference(cfg)
    assert "lm_head.weight" in ref and "transformer.wte.weight" in ref
    _assert_gpt2_equal(_merged(parts), ref)


def test_hf_gpt2_tied_embeddings_across_stages(tmp_path: Path) -> None:
    """``lm_head.weight`` is ``transformer.wte.weight``: stages 0 and 2 each hold a copy, their
    gradients are summed, the copies stay identical and equal the single-process weight; the
    consolidated checkpoint loads into ``GPT2LMHeadModel`` with the tie intact."""
    cfg = _gpt2_config("tied", tie=True, schedule="zb-h1", consolidate=True)
    _launch(3, [cfg], tmp_path)
    parts = _ranks(tmp_path / "tied", 3)
    reference, ref = _reference(cfg)
    assert reference.lm_head.weight is reference.transformer.wte.weight
    # Stage 0 holds the embedding copy, stage 2 the head copy, stage 1 neither.
    assert TIED[0] in parts[0] and TIED[1] not in parts[0]
    assert TIED[1] in parts[2] and TIED[0] not in parts[2]
    assert not set(TIED) & parts[1].keys()
    torch.testing.assert_close(parts[0][TIED[0]], parts[2][TIED[1]], rtol=0, atol=0)
    _assert_gpt2_equal(_merged(parts), ref)

    # The checkpoint stores the tied weight once; consolidation gives both names one tensor.
    ckpt = tmp_path / "tied" / "final.ckpt"
    shards = [torch.load(ckpt / shard_file(s), weights_only=False)["state_dict"] for s in range(3)]
    assert sum(bool(set(TIED) & shard.keys()) for shard in shards) == 1
    consolidated = torch.load(tmp_path / "tied" / "consolidated.pt")
    _assert_gpt2_equal(consolidated, ref)
    assert consolidated[TIED[0]].data_ptr() == consolidated[TIED[1]].data_ptr()
    hf = make_model(cfg).to_hf()  # type: ignore[operator]
    hf.load_state_dict(consolidated)  # strict: the Hugging Face names
    assert hf.lm_head.weight is hf.transformer.wte.weight
    tokens = next(iter(make_loader(cfg)))[0]
    hf.eval()
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, reference(tokens), rtol=1e-4, atol=1e-4)


def test_demo_gpt_stages_that_end_mid_layer(tmp_path: Path) -> None:
    """The demo GPT with ``pipeline_blocks="sublayer"``: 6 blocks [embed, attn0, mlp0, attn1,
    mlp1, head] on 3 stages [embed, attn0] | [mlp0, attn1] | [mlp1, head], so both cuts fall
    inside a transformer layer; zero-bubble, batches of 8 rows in 3 micro-batches (3, 3, 2):
    every weight equals one process training on the whole batches."""
    cfg = {"name": "sublayer", "model": "demo-gpt", "pipeline_blocks": "sublayer",
           "partition": [2, 2, 2], "schedule": "zb-h1", "num_microbatches": 3,
           "steps": 4}  # fmt: skip
    _launch(3, [cfg], tmp_path)
    parts = _ranks(tmp_path / "sublayer", 3)
    assert any(k.startswith("blocks.0.attn.") for k in parts[0])
    assert not any(k.startswith("blocks.0.mlp.") for k in parts[0])
    assert any(k.startswith("blocks.0.mlp.") for k in parts[1])
    _, ref = _reference(cfg)
    _assert_gpt2_equal(_merged(parts), ref)


def test_resnet18_batchnorm_exact_with_one_microbatch(tmp_path: Path) -> None:
    """ResNet-18 on 2 stages: with one micro-batch and one device per stage the weights and the
    BatchNorm running statistics equal one process; with 2 micro-batches setup warns."""
    layout = {"model": "resnet", "schedule": "1f1b", "partition": [6, 8]}  # stem+layer1 | rest
    configs = [
        {"name": "exact", **layout, "num_microbatches": 1, "steps": 3},
        {"name": "split", **layout, "num_microbatches": 2, "steps": 1},
    ]
    _launch(2, configs, tmp_path)
    _, ref = _reference(configs[0])
    merged = _merged(_ranks(tmp_path / "exact", 2))
    assert int(merged["bn1.num_batches_tracked"]) == 3
    assert any(k.endswith("running_var") for k in merged)
    _assert_equal(merged, ref)

    def batch_norm_warnings(name: str) -> list[dict[str, str]]:
        found = json.loads((tmp_path / name / "warnings.json").read_text())
        return [w for w in found if "BatchNorm" in w["message"]]

    # Two micro-batches: each normalised on its own, the running statistics updated twice.
    split = _merged(_ranks(tmp_path / "split", 2))
    assert int(split["bn1.num_batches_tracked"]) == 2
    assert not batch_norm_warnings("exact")
    warned = batch_norm_warnings("split")
    assert len(warned) == 1 and warned[0]["category"] == "UserWarning", warned
    assert "num_microbatches=1" in warned[0]["message"], warned
