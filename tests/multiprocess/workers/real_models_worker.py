"""Worker for the real-model tests (Hugging Face GPT-2, ResNet-18); run under torchrun.

    torchrun --nproc_per_node=N tests/multiprocess/workers/real_models_worker.py OUT CONFIGS_JSON

(the repository on PYTHONPATH, as ``tests.helpers.launch.torchrun`` sets it)

For each config it trains the config's model with a manual DeepCEEStrategy layout and writes
every rank's ``state_dict`` (global names, buffers included) to ``OUT_DIR/<name>/rank<r>.pt``,
rank 0's warnings to ``warnings.json`` and, with ``"consolidate"``, the consolidated pipeline
checkpoint to ``consolidated.pt``. :func:`make_model` and :func:`make_loader` also build the
test's single-process reference, so both see the same weights and batches.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.paths import EXAMPLES
from tests.helpers.workers import run_configs, save_consolidated

sys.path.insert(0, str(EXAMPLES))  # examples/ is not a package
from hf_gpt2 import HFGPT2
from resnet18 import ResNet18Classifier

from lightning_deepcee import DeepCEEStrategy
from lightning_deepcee.demo import GPT, synthetic_images

GPT2_SIZES: dict[str, Any] = {
    "vocab_size": 64,
    "n_positions": 16,
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 32,
}
"""Tiny GPT-2: 6 blocks (wte, wpe, 2 GPT2Blocks, ln_f, lm_head)."""


def make_model(cfg: dict[str, Any]) -> pl.LightningModule:
    """The config's model with fixed initial weights (dropout 0: exact)."""
    if cfg["model"] == "gpt2":
        tie = cfg.get("tie", True)
        return HFGPT2(**GPT2_SIZES, dropout=0.0, tie_word_embeddings=tie, learning_rate=1e-2)
    if cfg["model"] == "demo-gpt":  # the same token batches as GPT-2
        sizes = {k: GPT2_SIZES[k] for k in ("vocab_size", "n_layer", "n_head", "n_embd")}
        return GPT(
            **sizes, block_size=GPT2_SIZES["n_positions"], dropout=0.0, learning_rate=1e-2,
            pipeline_blocks=cfg.get("pipeline_blocks", "layer"),
        )  # fmt: skip
    if cfg["model"] == "resnet":
        return ResNet18Classifier(num_classes=10, width=cfg.get("width", 64), learning_rate=1e-3)
    raise ValueError(f"unknown model {cfg['model']!r}")


def make_loader(cfg: dict[str, Any]) -> DataLoader[Any]:
    """Fixed batches in a fixed order (no shuffling), the same on every process."""
    batch_size, num_samples = cfg.get("batch_size", 8), cfg.get("num_samples", 32)
    if cfg["model"] in ("gpt2", "demo-gpt"):
        g = torch.Generator().manual_seed(1)
        seq_len = GPT2_SIZES["n_positions"]
        tokens = torch.randint(0, GPT2_SIZES["vocab_size"], (num_samples, seq_len + 1), generator=g)
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    else:
        data = synthetic_images(num_samples, image_size=32, num_classes=10, seed=1)
    return DataLoader(data, batch_size=batch_size, shuffle=False)


def _trainer(cfg: dict[str, Any], root: Path) -> pl.Trainer:
    strategy = DeepCEEStrategy(
        schedule=cfg["schedule"],
        num_microbatches=cfg["num_microbatches"],
        partition=cfg["partition"],
        verbose=False,
    )
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    return pl.Trainer(
        accelerator="cpu",
        devices=local,
        num_nodes=int(os.environ["WORLD_SIZE"]) // local,
        strategy=strategy,
        max_steps=cfg["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
        # Every rank reads the batches in order, as the single-process reference does.
        use_distributed_sampler=False,
    )


def run(cfg: dict[str, Any], out: Path) -> None:
    """Train one config and write what the test compares."""
    rank = int(os.environ["RANK"])
    target = out / cfg["name"]
    target.mkdir(parents=True, exist_ok=True)
    model, loader = make_model(cfg), make_loader(cfg)
    trainer = _trainer(cfg, target)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader)
    if rank == 0:
        found = [{"category": w.category.__name__, "message": str(w.message)} for w in caught]
        (target / "warnings.json").write_text(json.dumps(found))
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    torch.save(state, target / f"rank{rank}.pt")
    if cfg.get("consolidate"):
        save_consolidated(trainer, target)


def main() -> None:
    warnings.filterwarnings("ignore")
    run_configs(run)


if __name__ == "__main__":
    main()
