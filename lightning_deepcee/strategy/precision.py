"""Precision plugins whose gradient clipping uses the norm of the whole pipeline's gradient.

Each rank holds one stage's parameters, so Lightning's default ``clip_grad_by_norm`` would clip
every stage by its own norm and change the update. These plugins all-reduce the squared norms of
every stage first, exactly reproducing ``torch.nn.utils.clip_grad_norm_`` on the whole model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.optim import Optimizer

from lightning_deepcee.runtime.transport import all_reduce_

__all__ = ["PipelineMixedPrecision", "PipelinePrecision", "wrap_precision"]


def _clip_global_norm(precision: Precision, optimizer: Optimizer, clip_val: float) -> None:
    params = [p for p in precision.main_params(optimizer) if p.grad is not None]
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    squared = torch.zeros((), dtype=torch.float64, device=device)
    # Every device holding a copy of a parameter (the devices sharing its stage, or every
    # holder of a tied parameter) has the same all-reduced gradient: each contributes its
    # share, so every parameter counts once in the global norm.
    share = getattr(precision, "norm_share", 1.0)
    shares = getattr(precision, "norm_shares", {})
    for p, g in zip(params, grads, strict=True):
        squared += g.detach().double().pow(2).sum() * shares.get(id(p), share)
    if dist.is_available() and dist.is_initialized():
        all_reduce_(squared)
    total = squared.sqrt()
    coef = clip_val / (total + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef.to(g.dtype))


class PipelinePrecision(Precision):
    """Full precision (``32-true``) with global-norm clipping across pipeline stages."""

    norm_share: float = 1.0
    norm_shares: dict[int, float] = {}  # assigned per instance by the strategy, never mutated

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        _clip_global_norm(self, optimizer, float(clip_val))


class PipelineMixedPrecision(MixedPrecision):
    """``bf16-mixed`` autocast with global-norm clipping across pipeline stages."""

    norm_share: float = 1.0
    norm_shares: dict[int, float] = {}  # assigned per instance by the strategy, never mutated

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        _clip_global_norm(self, optimizer, float(clip_val))


def wrap_precision(plugin: Precision) -> Precision:
    """Return the pipeline-aware equivalent of a Lightning precision plugin, or raise."""
    if isinstance(plugin, (PipelinePrecision, PipelineMixedPrecision)):
        return plugin
    if isinstance(plugin, MixedPrecision):
        if plugin.scaler is not None or plugin.precision == "16-mixed":
            raise ValueError(
                "DeepCEEStrategy does not support precision='16-mixed': fp16 loss scaling would "
                "have to be applied on the last stage and its inf checks agreed across stages "
                "before every step. Use precision='bf16-mixed' (same speed on recent hardware, no "
                "scaler needed) or '32-true'."
            )
        return PipelineMixedPrecision("bf16-mixed", plugin.device)
    if type(plugin) is Precision:
        return PipelinePrecision()
    raise ValueError(
        f"DeepCEEStrategy supports precision '32-true' and 'bf16-mixed', not "
        f"{type(plugin).__name__}."
    )
