"""A small character-level GPT (nanoGPT-style) as a plain LightningModule.

It trains with any Lightning strategy through ``training_step``; ``configure_pipeline`` is the one
method DeepCEEStrategy needs: the ordered blocks (embedding, transformer layers, head) and the loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torchmetrics.functional import accuracy

from lightning_deepcee.demo.base import BlockModule
from lightning_deepcee.runtime.stage import PipelineSpec

__all__ = ["GPT", "PIPELINE_BLOCKS", "GPTConfig", "lm_loss", "token_accuracy"]

PIPELINE_BLOCKS = ("layer", "sublayer")
"""The granularities ``GPT(pipeline_blocks=...)`` offers the pipeline."""


@dataclass(frozen=True)
class GPTConfig:
    """Model size. The defaults give about 0.8M parameters."""

    vocab_size: int = 96
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


class _Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok(idx) + self.pos(pos))


class _Attention(nn.Module):
    """Pre-norm causal self-attention with its residual: ``x + proj(attn(ln(x)))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class _MLP(nn.Module):
    """Pre-norm feed-forward with its residual: ``x + net(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.net = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.net(self.ln(x)))


class _Block(nn.Module):
    """One transformer layer: attention, then the MLP (two pipeline blocks when ``sublayer``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn = _Attention(cfg)
        self.mlp = _MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x))


class _Head(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.out = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def lm_loss(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    """Next-token cross entropy, a mean over the micro-batch's tokens."""
    return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


def token_accuracy(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    """Share of next tokens predicted right (a mean over the micro-batch's tokens)."""
    return accuracy(
        logits.flatten(0, 1), batch[1].flatten(), task="multiclass", num_classes=logits.shape[-1]
    )


class GPT(BlockModule):
    """Character-level GPT. Batches are ``(tokens, next_tokens)`` of shape ``(B, T)``.

    ``pipeline_blocks`` sets the granularity the pipeline may cut at: ``"layer"`` lists each
    transformer layer as one block (``n_layer + 2`` blocks); ``"sublayer"`` lists its attention
    and its MLP as two (``2 * n_layer + 2``), so a stage can end after a layer's attention and
    the planner can balance stages on devices of very different speeds more finely. The model,
    its weights and its parameter names are the same either way.
    """

    val_acc_in_progress_bar = False

    def __init__(
        self,
        vocab_size: int = 96,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.0,
        seed: int = 0,
        pipeline_blocks: str = "layer",
    ) -> None:
        super().__init__()
        if pipeline_blocks not in PIPELINE_BLOCKS:
            raise ValueError(
                f"GPT(pipeline_blocks={pipeline_blocks!r}): choose one of {PIPELINE_BLOCKS}."
            )
        self.save_hyperparameters()
        cfg = GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, dropout)
        torch.manual_seed(seed)  # identical initial weights on every process
        self.embed = _Embedding(cfg)
        self.blocks = nn.ModuleList([_Block(cfg) for _ in range(n_layer)])
        self.head = _Head(cfg)
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.net.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    def configure_pipeline(self) -> PipelineSpec:
        """The one addition DeepCEEStrategy needs."""
        layers: list[nn.Module] = list(self.blocks)
        if self.hparams["pipeline_blocks"] == "sublayer":
            layers = [h for b in layers if isinstance(b, _Block) for h in (b.attn, b.mlp)]
        return PipelineSpec(
            blocks=[self.embed, *layers, self.head],
            loss_fn=lm_loss,
            tokens_fn=lambda batch: int(batch[0].numel()),
            # Logged as train_acc / val_acc, as validation_step logs it in one process.
            metrics_fn=lambda logits, batch: {"acc": token_accuracy(logits, batch)},
        )

    def sequence(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def step_loss(self, logits: torch.Tensor, batch: Any) -> torch.Tensor:
        return lm_loss(logits, batch)

    def step_accuracy(self, logits: torch.Tensor, batch: Any) -> torch.Tensor:
        return token_accuracy(logits, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(),
            lr=self.hparams["learning_rate"],
            weight_decay=self.hparams["weight_decay"],
        )
