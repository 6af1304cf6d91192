"""A Hugging Face ``transformers`` GPT-2 trained as a pipeline, tied embeddings across stages.

    python examples/hf_gpt2.py fit                                  # 2 CPU processes, DeepCEE
    python examples/hf_gpt2.py fit --trainer.devices=3 --trainer.max_steps=50
    python examples/hf_gpt2.py fit --trainer.strategy=ddp           # any other strategy

``HFGPT2`` builds ``GPT2LMHeadModel(GPT2Config(...))`` with random weights (nothing is
downloaded) and keeps its modules under their Hugging Face names, so the LightningModule's
``state_dict`` (and a consolidated pipeline checkpoint) loads into ``GPT2LMHeadModel`` as is
(:meth:`HFGPT2.to_hf`). The pipeline blocks are the model's own modules in execution order:

    transformer.wte        token embedding          (shares its weight with lm_head)
    transformer.wpe        + position embedding, dropout
    transformer.h.0 ...    each GPT2Block
    transformer.ln_f       final LayerNorm
    lm_head                logits

The embedding and the head are two blocks each because a block's parameters are named by its
path: one "embedding" module holding both ``wte`` and ``wpe`` would rename them. GPT-2 ties
``lm_head.weight`` to ``transformer.wte.weight`` (one Parameter), so the first and the last
block share it: each stage that holds it keeps a copy, their gradients are summed and the copies
stay identical. Trains on the Shakespeare characters of ``lightning_deepcee.demo``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import lightning_deepcee  # noqa: F401  (registers strategy="deepcee")
from lightning_deepcee import PipelineSpec
from lightning_deepcee.demo import ShakespeareDataModule, lm_loss, token_accuracy

__all__ = ["HFGPT2", "CausalGPT2Block", "PositionEmbedding", "causal_mask", "main"]


def causal_mask(length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive ``(1, 1, T, T)`` mask: 0 on and below the diagonal, the dtype's minimum above.

    A GPT2Block called on its own gets no mask from ``GPT2Model``; with eager attention in
    transformers 5.x it would then attend to future tokens. An explicit mask is causal under
    every attention implementation and version.
    """
    blocked = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
    mask = torch.zeros(length, length, dtype=dtype, device=device)
    return mask.masked_fill(blocked, torch.finfo(dtype).min)[None, None]


class CausalGPT2Block(GPT2Block):
    """``GPT2Block`` as a pipeline block: hidden states in, hidden states out, causal.

    Same parameters and names as ``GPT2Block``; transformers 4.x returns a tuple, 5.x a tensor.
    """

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        mask = causal_mask(hidden_states.shape[1], hidden_states.dtype, hidden_states.device)
        out = super().forward(hidden_states, attention_mask=mask)
        return out[0] if isinstance(out, tuple) else out


class PositionEmbedding(nn.Embedding):
    """GPT-2's ``wpe`` as a block: adds position embeddings to token embeddings, then dropout.

    It is an ``nn.Embedding`` (its one parameter stays ``transformer.wpe.weight``); the dropout
    is GPT-2's ``transformer.drop`` and has no state.
    """

    def __init__(self, num_positions: int, dim: int, dropout: float) -> None:
        super().__init__(num_positions, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(tokens + super().forward(positions))


class _Transformer(nn.Module):
    """Holds GPT-2's trunk under ``GPT2Model``'s attribute names (no forward of its own)."""

    def __init__(self, hf: GPT2LMHeadModel, config: GPT2Config) -> None:
        super().__init__()
        self.wte = hf.transformer.wte
        self.wpe = PositionEmbedding(config.n_positions, config.n_embd, config.embd_pdrop)
        self.wpe.weight = hf.transformer.wpe.weight
        blocks = []
        for i, original in enumerate(hf.transformer.h):
            block = CausalGPT2Block(config, layer_idx=i)
            block.load_state_dict(original.state_dict())
            blocks.append(block)
        self.h = nn.ModuleList(blocks)
        self.ln_f = hf.transformer.ln_f


class HFGPT2(pl.LightningModule):
    """GPT-2 from ``transformers`` (random weights). Batches are ``(tokens, next_tokens)``.

    Args:
        vocab_size, n_positions, n_layer, n_head, n_embd: ``GPT2Config`` sizes
            (``n_positions`` is the longest sequence).
        dropout: GPT-2's three dropouts (``embd_pdrop``, ``attn_pdrop``, ``resid_pdrop``);
            0 makes a pipeline run equal one process bit for bit (docs/model_contract.md).
        tie_word_embeddings: GPT-2 ties ``lm_head.weight`` to ``transformer.wte.weight``.
        learning_rate, weight_decay: AdamW settings.
        seed: the initial weights, identical on every process.
    """

    def __init__(
        self,
        vocab_size: int = 96,
        n_positions: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        tie_word_embeddings: bool = True,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.gpt2_config = GPT2Config(
            vocab_size=vocab_size,
            n_positions=n_positions,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            resid_pdrop=dropout,
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=vocab_size - 1,
            eos_token_id=vocab_size - 1,
        )
        torch.manual_seed(seed)  # identical initial weights on every process
        hf = GPT2LMHeadModel(self.gpt2_config)
        self.gpt2_config = hf.config  # as the model resolved it (attention implementation)
        self.transformer = _Transformer(hf, hf.config)
        self.lm_head = hf.lm_head
        if tie_word_embeddings and self.lm_head.weight is not self.transformer.wte.weight:
            raise RuntimeError("GPT2LMHeadModel did not tie lm_head.weight to wte.weight.")

    def configure_pipeline(self) -> PipelineSpec:
        """The blocks in execution order (wte and lm_head share the tied weight) and the loss."""
        t = self.transformer
        return PipelineSpec(
            blocks=[t.wte, t.wpe, *t.h, t.ln_f, self.lm_head],
            loss_fn=lm_loss,
            tokens_fn=lambda batch: int(batch[0].numel()),
            # Logged as train_acc / val_acc, as validation_step logs it under other strategies.
            metrics_fn=lambda logits, batch: {"acc": token_accuracy(logits, batch)},
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)``: the blocks in order, what the pipeline runs."""
        t = self.transformer
        x = t.wpe(t.wte(tokens))
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))

    def to_hf(self) -> GPT2LMHeadModel:
        """A ``GPT2LMHeadModel`` with these weights (the names are the same)."""
        hf = GPT2LMHeadModel(self.gpt2_config)
        hf.load_state_dict(self.state_dict())
        return hf

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch[0])
        loss = lm_loss(logits, batch)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        self.log("train_acc", token_accuracy(logits, batch), on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch[0])
        loss = lm_loss(logits, batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_acc", token_accuracy(logits, batch), sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(),
            lr=self.hparams["learning_rate"],
            weight_decay=self.hparams["weight_decay"],
        )


class _CLI(LightningCLI):
    """LightningCLI that sizes the model's positions from the data and prints the final loss."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.link_arguments("data.block_size", "model.n_positions")

    def after_fit(self) -> None:
        metrics = self.trainer.callback_metrics
        loss = metrics.get("train_loss_step", metrics.get("train_loss"))  # the last step's
        if self.trainer.is_global_zero and loss is not None:
            print(f"final train_loss {float(loss):.4f} after {self.trainer.global_step} steps")


def main(args: list[str] | None = None) -> None:
    """Train on Shakespeare; defaults: 2 CPU processes, ``DeepCEEStrategy()``, 30 steps."""
    _CLI(
        HFGPT2,
        ShakespeareDataModule,
        args=args,
        trainer_defaults={
            "accelerator": "cpu",
            "devices": 2,
            "strategy": "deepcee",
            "max_steps": 30,
            "limit_val_batches": 4,
            "logger": False,
            "enable_checkpointing": False,
        },
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
