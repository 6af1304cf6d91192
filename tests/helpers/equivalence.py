"""Single-process references and the comparisons of what the ranks of a torchrun job saved."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from tests.helpers.models import TinyNet, make_loader
from tests.helpers.tied_models import TiedLM, make_lm_loader


def fit_reference(
    steps: int, clip: float | None = None, optimizer: str = "adamw", **kw: Any
) -> dict:
    """Single-process Lightning: ``TinyNet`` trained ``steps`` optimizer steps; its state dict.

    ``kw``: num_blocks, batch_norm, batch_size, num_samples, batch_sampler, precision, accumulate;
    with ``evaluation`` (and ``train_metrics``, ``predictions``) also what fit, validate(), test()
    and predict() log, into those containers."""
    warnings.filterwarnings("ignore")
    model = TinyNet(
        num_blocks=kw.get("num_blocks", 6),
        optimizer=optimizer,
        batch_norm=kw.get("batch_norm", False),
    )
    loader = make_loader(kw.get("batch_size", 10), kw.get("num_samples", 30))
    if "batch_sampler" in kw:
        loader = DataLoader(loader.dataset, batch_sampler=kw["batch_sampler"])
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=clip,
        precision=kw.get("precision", "32-true"), accumulate_grad_batches=kw.get("accumulate", 1),
    )  # fmt: skip
    trainer.fit(model, loader)
    if "evaluation" in kw:  # what training, validate() and test() log, same trainer
        kw["train_metrics"].update({k: float(v) for k, v in trainer.callback_metrics.items()})
        kw["evaluation"].update(trainer.validate(model, loader, verbose=False)[0])
        kw["evaluation"].update(trainer.test(model, loader, verbose=False)[0])
        kw["predictions"].append(torch.cat(trainer.predict(model, loader)))  # type: ignore[arg-type]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def merged_ranks(directory: Path, world: int) -> dict[str, torch.Tensor]:
    """Every rank's ``rank<r>.pt`` under ``directory`` as one state dict; replicas of a stage
    must hold bit-identical copies."""
    merged: dict[str, torch.Tensor] = {}
    for r in range(world):
        part = torch.load(directory / f"rank{r}.pt")
        for k, v in part.items():
            if k in merged:  # data-parallel replicas hold identical copies of a stage
                torch.testing.assert_close(v, merged[k], rtol=0, atol=0)
            merged[k] = v
    return merged


def assert_same_params(got: dict, ref: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """The same parameter names, each close to the reference."""
    assert got.keys() == ref.keys()
    for k in ref:
        try:
            torch.testing.assert_close(got[k], ref[k], rtol=rtol, atol=atol)
        except AssertionError as exc:
            raise AssertionError(f"parameter {k}: {exc}") from None


def tied_reference(steps: int, clip: float | None = None) -> tuple[TiedLM, float, torch.Tensor]:
    """Single-process Lightning: trained parameters, validation loss, predictions."""
    warnings.filterwarnings("ignore")
    model = TiedLM()
    loader = make_lm_loader(6)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=clip,
    )  # fmt: skip
    trainer.fit(model, loader)
    val = trainer.validate(model, loader, verbose=False)[0]["val_loss"]
    predictions = torch.cat(trainer.predict(model, loader))  # type: ignore[arg-type]
    return model, float(val), predictions


def assert_params_close(
    got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], where: str
) -> None:
    """Every parameter in ``got`` close to the reference's, named with ``where`` if not."""
    for key, value in got.items():
        torch.testing.assert_close(value, ref[key], rtol=1e-5, atol=1e-6, msg=f"{where}: {key}")
