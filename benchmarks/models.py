"""Model presets and block splits shared by every system of ``benchmarks/lab_bench.py``.

Every system trains the *same* demo GPT (``lightning_deepcee.demo.GPT``: embedding, ``n_layer``
transformer blocks, head; identical initial weights from ``seed``) on the same Shakespeare
windows. Only the way the work is spread over the devices differs.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["GPT_PRESETS", "count_parameters", "gpt_blocks", "gpt_kwargs", "uniform_split"]

# Sizes (parameters of lightning_deepcee.demo.GPT with vocab 96). ``n_layer`` is 10 so that the
# 12 blocks (embed + 10 layers + head) split evenly into 6 ranks x 2 virtual stages for
# ScheduleInterleavedZeroBubble on cee6.
GPT_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=10, n_embd=64, n_head=4, block_size=64),  # ~0.5M parameters
    "small": dict(n_layer=10, n_embd=128, n_head=4, block_size=64),  # ~2.0M
    "medium": dict(n_layer=10, n_embd=256, n_head=8, block_size=64),  # ~7.9M
}


def gpt_kwargs(size: str) -> dict[str, Any]:
    if size not in GPT_PRESETS:
        raise ValueError(f"unknown GPT size {size!r}; choose one of {sorted(GPT_PRESETS)}")
    return dict(vocab_size=96, dropout=0.0, learning_rate=3e-3, seed=0, **GPT_PRESETS[size])


def gpt_blocks(model: nn.Module) -> list[nn.Module]:
    """The ordered blocks of the demo GPT (what ``configure_pipeline`` hands DeepCEE)."""
    return [model.embed, *model.blocks, model.head]


def uniform_split(num_blocks: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous block ranges, as even as possible by block count (earlier stages get extra)."""
    if num_stages > num_blocks:
        raise ValueError(f"cannot split {num_blocks} blocks into {num_stages} stages")
    base, extra = divmod(num_blocks, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        end = start + base + (1 if s < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    from lightning_deepcee.demo import GPT

    for name in GPT_PRESETS:
        m = GPT(**gpt_kwargs(name))
        print(name, f"{count_parameters(m):,}", [count_parameters(b) for b in gpt_blocks(m)][:3])
        del m
