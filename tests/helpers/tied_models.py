"""A tiny language model whose blocks pass dicts and tuples and whose head is tied to its
embedding, with variable-length batches (no file named test_*, not collected).

Blocks: ``embed`` (ids -> {"h", "mask", "lengths", "causal"}), three ``Mix`` blocks (dict ->
tuple -> dict -> tuple, each a masked causal mean over the sequence, so results depend on the
batch's length), ``head`` (a LayerNorm and a Linear whose weight *is* the embedding's). The
loss is a per-sample mean over valid tokens, then the mean over samples: exact under any split.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_deepcee import PipelineSpec

VOCAB, HIDDEN, MAX_T, PAD = 32, 16, 12, 0


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, HIDDEN)
        self.position = nn.Parameter(torch.randn(MAX_T, HIDDEN) * 0.1)

    def forward(self, ids: torch.Tensor) -> dict[str, Any]:
        mask = ids != PAD
        h = self.tokens(ids) + self.position[: ids.shape[1]]
        # "lengths": a float tensor that needs no gradient; "causal": a constant.
        return {"h": h, "mask": mask, "lengths": mask.sum(1, keepdim=True).float(), "causal": True}


def _unpack(value: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if isinstance(value, dict):
        assert value["causal"] is True
        return value["h"], value["mask"], value["lengths"]
    return value[0], value[1], value[2]


class Mix(nn.Module):
    def __init__(self, returns: str) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)
        self.gate = nn.Linear(HIDDEN, 1)
        self.returns = returns

    def forward(self, value: Any) -> Any:
        h, mask, lengths = _unpack(value)
        m = mask.unsqueeze(-1).to(h.dtype)
        prefix = (h * m).cumsum(1) / m.cumsum(1).clamp(min=1.0)
        h = h + torch.sigmoid(self.gate(h)) * torch.tanh(self.lin(prefix)) / lengths.unsqueeze(-1)
        if self.returns == "tuple":
            return (h, mask, lengths)
        return {"h": h, "mask": mask, "lengths": lengths, "causal": True}


class Head(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.out.weight = embedding.weight  # tied

    def forward(self, value: Any) -> torch.Tensor:
        h, _, _ = _unpack(value)
        return self.out(self.norm(h))  # type: ignore[no-any-return]


def lm_loss(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    ids, targets = batch
    mask = (ids != PAD).float()
    per_token = nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), reduction="none"
    ).view_as(mask)
    return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1.0)).mean()


class TiedLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = Embed()
        self.mixes = nn.ModuleList([Mix("tuple"), Mix("dict"), Mix("tuple")])
        self.head = Head(self.embed.tokens)

    def configure_pipeline(self) -> PipelineSpec:
        return PipelineSpec(
            blocks=[self.embed, *self.mixes, self.head], loss_fn=lm_loss, tokens_fn=valid_tokens
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        value: Any = self.embed(ids)
        for mix in self.mixes:
            value = mix(value)
        return self.head(value)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return lm_loss(self(batch[0]), batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", lm_loss(self(batch[0]), batch))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])[:, -1]  # last position's logits: [B, VOCAB] whatever the length

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class _Sequences(Dataset[torch.Tensor]):
    """``num`` token sequences of MAX_T + 1 tokens; each valid for 3..MAX_T tokens, then PAD."""

    def __init__(self, num: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.data = torch.randint(1, VOCAB, (num, MAX_T + 1), generator=g)
        lengths = torch.randint(3, MAX_T + 1, (num,), generator=g)
        for i, n in enumerate(lengths.tolist()):
            self.data[i, n:] = PAD
        self.reads = 0
        """Samples read so far (by this process)."""

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        self.reads += 1
        return self.data[index]


def valid_tokens(batch: Any) -> int:
    """Tokens of a batch before its padding (the throughput figures count them)."""
    return int((batch[0] != PAD).sum())


def _collate(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut the batch to its longest valid sequence: the length changes from batch to batch."""
    batch = torch.stack(samples)
    longest = int((batch[:, :MAX_T] != PAD).sum(1).max())
    return batch[:, :longest], batch[:, 1 : longest + 1]


def make_lm_loader(batch_size: int = 8, num: int = 24) -> DataLoader[Any]:
    return DataLoader(_Sequences(num), batch_size=batch_size, shuffle=False, collate_fn=_collate)


def make_shuffled_lm_loader(batch_size: int = 8, num: int = 24) -> DataLoader[Any]:
    """Shuffled by epoch (``set_epoch``), the same order in every process and every run."""
    data = _Sequences(num)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(data, batch_size=batch_size, sampler=sampler, collate_fn=_collate)
